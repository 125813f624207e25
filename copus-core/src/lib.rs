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
//! - [`belief`]: a structured Bayesian belief about throughput over the families candidates
//!   share (tensor and pipeline degree, data-parallel span, micro-batch, layout, trend);
//! - [`schedule`]: GPipe and 1F1B pipeline schedules as instruction lists;
//! - [`policy`]: the policies that decide when to change batch size or layout (the scorer they
//!   share, the baselines, Copus), the hindsight oracle, and the line-up a comparison runs;
//! - [`reshard`]: the moves that take every shard from one layout to another;
//! - [`sim`]: the simulated clock on synthetic statistics (known noise trajectory, McCandlish
//!   progress model);
//! - [`orchestrator`]: observations to validated decisions, and the service's wire protocol.
//! - [`decision`]: the `DecisionSource` interface between a training loop and what decides
//!   (the orchestrator, a scripted plan, a remote service's client).

//!
//! The root re-exports what a user starts from: the candidates and layouts of a space, the
//! throughput models (a measured profile, the analytic cluster model), the scorer, the Copus
//! rule ([`CopusRule`]: the rule on the structured belief by default, or the earlier switch
//! rule), the orchestrator that turns observations into decisions, and the decision interface
//! a training loop calls.
//!
//! ```
//! use copus_core::{CandidateSpace, ClusterModel, ClusterSpec, CopusRule, Orchestrator, Scorer};
//! use copus_core::memory::{GIB, MemoryModel};
//! use copus_core::model::ModelSpec;
//! use copus_core::schedule::ScheduleKind;
//!
//! // Every (layout, B_g, B_m) of 8 GPUs for a 1M-parameter model, scored by the analytic model.
//! let spec = ModelSpec::tiny_1m();
//! let space = CandidateSpace::new(8, vec![8, 16, 32], vec![1, 2, 4], ScheduleKind::OneFOneB, MemoryModel::fp32(), 80.0 * GIB)
//!     .unwrap()
//!     .enumerate(&spec);
//! let prior = ClusterModel::new(ClusterSpec::cpu_ranks(8, 8), spec);
//! let scorer = Scorer::plain(&space.feasible, &prior, 8.0).unwrap();
//! // A run of about an hour whose layout changes cost about 10 s at first (measured later);
//! // eight ranks to a node.
//! let copus = CopusRule::for_run(3600.0, 10.0).policy(&scorer, 8).unwrap();
//! let orchestrator = Orchestrator::new(copus, scorer);
//! assert!(!space.feasible.is_empty() && orchestrator.policy_name().contains("copus"));
//! ```

#![forbid(unsafe_code)]

pub mod accumulation;
pub mod belief;
pub mod candidates;
pub mod decision;
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

pub use candidates::{Candidate, CandidateSpace, Enumeration};
pub use decision::{DecisionSource, Scripted};
pub use layout::ParallelDims;
pub use orchestrator::Orchestrator;
pub use policy::{Copus, CopusRule, Decision, Policy, Scorer, StepObservation, SwitchRule};
pub use throughput::{ClusterModel, ClusterSpec, ThroughputModel, ThroughputProfile};
