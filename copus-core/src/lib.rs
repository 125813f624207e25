//! copus-core: the decision engine of copus, with no tensor dependency.
//!
//! copus co-adapts the global batch size B_g, the 3D parallel layout S = (dp, tp, pp) and the
//! micro-batch size B_m while an LLM pre-trains, choosing by Goodput = throughput x statistical
//! efficiency. This crate holds all of that reasoning:
//!
//! - [`layout`]: validated `ParallelDims` and the `RankGrid` of ranks and groups;
//! - [`model`]: `ModelSpec` shapes, parameter and FLOP counts, presets, per-parameter sharding specs;
//! - [`memory`]: bytes per rank against a device budget;
//! - [`accumulation`]: single-device plans (accumulation count, micro-batch) by Goodput;
//! - [`candidates`]: every (S, B_g, B_m) with `B_g = dp * B_m * a`, rejections with reasons;
//! - [`gns`]: the online gradient-noise-scale estimator;
//! - [`goodput`]: statistical efficiency, objectives and learning-rate rules;
//! - [`throughput`]: measured profiles and the analytic cluster model;
//! - [`schedule`]: GPipe and 1F1B pipeline schedules as instruction lists;
//! - [`policy`]: the policies that decide when to change batch size or layout (the scorer they
//!   share, the baselines, Copus), the hindsight oracle, and the line-up a comparison runs;
//! - [`reshard`]: the moves that take every shard from one layout to another;
//! - [`sim`]: the simulated clock on synthetic statistics (known noise trajectory, McCandlish
//!   progress model);
//! - [`orchestrator`]: observations to validated decisions, and the service's wire protocol.

#![forbid(unsafe_code)]

pub mod accumulation;
pub mod candidates;
pub mod gns;
pub mod goodput;
pub mod layout;
pub mod memory;
pub mod model;
pub mod orchestrator;
pub mod policy;
pub mod published;
pub mod reshard;
pub mod schedule;
pub mod sim;
pub mod throughput;
