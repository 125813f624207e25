//! copus-burn: copus execution on Burn 0.22.
//!
//! copus adapts the global batch, the 3D-parallel layout and the micro-batch while an LLM
//! trains, by Goodput (throughput times the statistical efficiency that the gradient noise
//! scale gives). There are three ways to use it.
//!
//! **A recipe file**, with the `recipes` binary: a model, data, a schedule and a candidate
//! space in RON, trained and reported end to end.
//!
//! ```text
//! cargo run --release -p recipes -- recipes/shakespeare-tiny.ron
//! ```
//!
//! **The driver**, from your own program: a [`JobBuilder`] turns a model that implements
//! [`ParallelLm`], a candidate space and a throughput prior into a [`Driver`] over the
//! 3D-parallel [`Engine`], and Copus decides after every step.
//!
//! ```
//! use std::sync::Arc;
//! use copus_burn::{DataSource, JobBuilder, OptimConfig};
//! use copus_core::memory::{GIB, MemoryModel};
//! use copus_core::model::ModelSpec;
//! use copus_core::schedule::ScheduleKind;
//! use copus_core::{CandidateSpace, ClusterModel, ClusterSpec, CopusRule};
//! use copus_models::{LlamaConfig, full_params};
//!
//! /// Sequences that count up by 3 from a start that varies: something to learn.
//! struct Counting;
//! impl DataSource for Counting {
//!     fn sequences(&self, first: u64, count: usize) -> Vec<i64> {
//!         (first..first + count as u64).flat_map(|i| (0..17).map(move |j| ((i as i64 % 5) + 3 * j) % 256)).collect()
//!     }
//! }
//!
//! let spec = ModelSpec { seq_len: 16, vocab_size: 256, ..ModelSpec::tiny_1m() };
//! let cfg = LlamaConfig::from_spec(&spec);
//! let device = burn::tensor::Device::flex().autodiff();
//! let full = full_params(&cfg.init(&device));
//! // Two in-process ranks; B_g 2 or 4, B_m 1 or 2, on every layout of two ranks.
//! let space = CandidateSpace::new(2, vec![2, 4], vec![1, 2], ScheduleKind::OneFOneB, MemoryModel::fp32(), 8.0 * GIB)?.enumerate(&spec);
//! let prior = ClusterModel::new(ClusterSpec::cpu_ranks(2, 2), spec);
//! let job = JobBuilder::new(Arc::new(cfg), space, OptimConfig::new().with_b0(2))
//!     .prior(&prior)?
//!     .start_batch(2, 1, None)
//!     .copus(CopusRule::default())
//!     .build(&full)?;
//! let (mut driver, mut copus) = (job.driver, job.orchestrator.expect("asked for"));
//! for _ in 0..2 {
//!     let step = driver.step(&Counting, &mut copus)?;
//!     assert!(step.step.metrics.loss.is_finite());
//! }
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! **The Learner add-on** (feature `learner`): adaptive batching by noise scale and Goodput for
//! burn-train's `SupervisedTraining`, on one device or several; `examples/learner.rs` is a
//! whole program.
//!
//! ```ignore
//! use copus_burn::learner::{CopusBatchingConfig, CopusTrainingExt};
//! let copus = CopusBatchingConfig::new(4).with_initial_accumulation(4).init()?; // B0 = 16
//! let learner = copus.learner(model, optim, schedule); // the schedule, scaled by the batch rule
//! SupervisedTraining::new(dir, train_loader, valid_loader).with_copus(&copus, device).launch(learner);
//! ```
//!
//! The modules:
//!
//! - [`optim`]: optimizer settings (`OptimConfig`: AdamW, schedule, LR rule, clipping) and the
//!   AdamW they build, copus's (moments held as tensors, one host pass) or Burn's;
//! - [`trainer`]: the single-rank trainer with micro-batching, token-normalised loss, AdamW,
//!   warmup + cosine schedule with the batch-size LR rule, global-norm clipping and the
//!   gradient-noise-scale probe feeding copus-core's estimator;
//! - [`closing`]: closing an optimizer step (probe memory, estimator, clipping, LR), shared by
//!   the trainer, the engine's ranks and the Learner strategy;
//! - [`grads`]: whole-model gradient arithmetic (squared norms, scaling, sums);
//! - [`fused`]: the fused operations of a training step on Flex (the softmax cross entropy
//!   [`cross_entropy_sum`], the summed next-token loss models use; causal attention, linear
//!   layers, RMSNorm, RoPE, SwiGLU) and the row kernels the vocabulary-parallel loss shares;
//! - [`comm`]: the communication wing: the `Collective` trait, its in-process backend (a
//!   thread per rank), MPI processes (feature `mpi`), GPU libraries (`comm::gpu`, features
//!   `nccl`, `rccl`, and LibTorch's memory with `tch`) and device placement (`comm::placement`);
//! - [`parallel`]: what a model implements to be sharded (`ParallelLm` with its
//!   `ParallelPlan`, `StageModel`), shard slicing and the vocabulary-parallel embedding;
//! - [`state`]: the layout-independent training state (a leaf shared by the next three);
//! - [`engine`]: the 3D-parallel engine (tensor, pipeline and data parallelism, the noise-scale
//!   probe under 3D);
//! - [`reconfig`]: in-memory reconfiguration with rollback;
//! - [`driver`]: the adaptive loop (step, observe, decide, validate, reconfigure) over a data
//!   source and a decision source (embedded orchestrator, service client, scripted);
//! - [`checkpoint`]: checkpoints of the training state, loadable into any layout;
//! - [`job`]: the one way to assemble a run (engine options, start, policy) into a driver;
//! - [`run_dir`]: a run folder's checkpoints (rotation, resume from the newest that loads) and
//!   logs cut back to a checkpoint;
//! - `learner` (feature `learner`): adaptive batching for burn-train's `SupervisedTraining`;
//!
//! The root re-exports what a user starts from: the job builder, the engine and its
//! configuration, the driver with its clock and its data and decision sources, the run folder,
//! the single-rank trainer, the optimizer settings, and the traits a model implements. Loop
//! internals (`closing`, `trainer::accumulate`) stay one module down.
//!
//! The crate is model-agnostic: a model implements [`CausalLm`] for single-rank training and
//! [`ParallelLm`] for the engine.
//!
//! `unsafe` code is denied here except in these modules, each of whose blocks carries its
//! `SAFETY` comment (clippy's `undocumented_unsafe_blocks` checks it):
//! - `comm::threads`: the in-process in-place all-reduce, where rank threads read and write each
//!   other's buffers;
//! - `comm::mpi`: the MPI bindings (`Send` for communicator handles, request tests and waits,
//!   non-blocking sends whose buffers live until they complete);
//! - `comm::gpu` (`group`, `nccl`, `rccl`, `cuda_tensor`): `Send` for a GPU communicator, cudarc's device pointers,
//!   and RCCL and HIP called through libloading;
//! - `fused::gemm`: the `gemm` crate's raw-pointer products, behind bounds checks of every
//!   operand;
//! - `fused::attention`: its output buffer, which its tasks write at disjoint places;
//! - `fused::torch` (feature `tch`): the operator counter's two C functions (cpp/);
//! - `comm::placement` (feature `cuda`): asking whether the CUDA driver library is installed
//!   before counting its devices.

#![deny(unsafe_code)]

pub mod checkpoint;
pub mod closing;
pub mod comm;
pub mod driver;
pub mod engine;
pub mod fused;
pub mod grads;
pub mod job;
#[cfg(feature = "learner")]
pub mod learner;
pub mod optim;
pub mod parallel;
pub mod reconfig;
pub mod run_dir;
pub mod state;
pub mod traffic;
pub mod trainer;
mod wire;

pub use copus_core::decision::DecisionSource;
pub use driver::{Clock, DataSource, Driver, DriverError, DriverStep};
pub use engine::{Engine, EngineConfig, EngineError, EngineStep, RankDevice, ReconfigPhase};
pub use fused::cross_entropy_sum;
pub use job::{EngineOptions, Job, JobBuilder};
#[cfg(feature = "learner")]
pub use learner::{CopusBatching, CopusBatchingConfig, CopusTrainingExt};
pub use optim::{OptimConfig, ScheduleClock};
pub use parallel::{ParallelLm, ParallelPlan, ShardPlan, StageModel};
pub use reconfig::ReconfigReport;
pub use run_dir::RunDir;
pub use state::{StateError, TrainingState};
pub use trainer::{CausalLm, MicroBatch, StepMetrics, TrainError, Trainer};

#[cfg(test)]
mod tests {
    use super::*;
    use crate::trainer::accumulate;
    use burn::module::Module;
    use burn::nn::{Embedding, EmbeddingConfig, Linear, LinearConfig};
    use burn::tensor::{Device, Int, Tensor};

    /// A next-token model small enough for exact checks: embedding then a linear head.
    #[derive(Module, Debug)]
    struct Bigram {
        emb: Embedding,
        out: Linear,
    }

    impl CausalLm for Bigram {
        fn loss_sum(&self, inputs: Tensor<2, Int>, targets: Tensor<2, Int>) -> Tensor<1> {
            cross_entropy_sum(self.out.forward(self.emb.forward(inputs)), targets)
        }
        fn no_decay_predicates(&self) -> Vec<String> {
            vec!["emb".into()]
        }
    }

    const V: usize = 16;

    fn device() -> Device {
        Device::flex().autodiff()
    }

    fn model() -> Bigram {
        let d = device();
        d.seed(3);
        Bigram { emb: EmbeddingConfig::new(V, 8).init(&d), out: LinearConfig::new(8, V).init(&d) }
    }

    /// Sequences where token t is followed by (3t + 1) mod V, with a few random positions.
    fn sequences(count: usize, seq: usize, seed: u64) -> Vec<Vec<i64>> {
        let mut x = seed;
        (0..count)
            .map(|_| {
                x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                let mut t = (x >> 33) as i64 % V as i64;
                (0..=seq)
                    .map(|_| {
                        let cur = t;
                        t = (3 * t + 1) % V as i64;
                        cur
                    })
                    .collect()
            })
            .collect()
    }

    fn micro_batches(seqs: &[Vec<i64>], b_m: usize) -> Vec<MicroBatch> {
        seqs.chunks(b_m).map(|c| MicroBatch::from_windows(&c.iter().map(|q| q.as_slice()).collect::<Vec<_>>(), &device())).collect()
    }

    fn flat(m: &Bigram) -> Vec<f32> {
        let mut v = m.emb.weight.val().into_data().try_to_vec::<f32>().unwrap();
        v.extend(m.out.weight.val().into_data().try_to_vec::<f32>().unwrap());
        v
    }

    #[test]
    fn the_split_of_a_step_does_not_change_the_gradient() {
        let m = model();
        let seqs = sequences(8, 6, 1);
        let whole = accumulate(&m, &micro_batches(&seqs, 8)).unwrap();
        for b_m in [4, 2, 1] {
            let split = accumulate(&m, &micro_batches(&seqs, b_m)).unwrap();
            assert!((split.loss - whole.loss).abs() < 1e-6 * whole.loss, "B_m {b_m}: loss");
            let diff = grads::diff_sq_norm(&m, &split.grads, &whole.grads);
            assert!(diff.sqrt() < 1e-5 * whole.grad_sq_norm.sqrt(), "B_m {b_m}: |diff| {}", diff.sqrt());
            assert!((split.grad_sq_norm - whole.grad_sq_norm).abs() < 1e-5 * whole.grad_sq_norm);
        }
    }

    #[test]
    fn micro_batch_norms_are_the_norms_of_each_micro_batch_mean_gradient() {
        // Independent reference: the gradient of each 1-sequence micro-batch on its own.
        let m = model();
        let seqs = sequences(4, 5, 9);
        let joint = accumulate(&m, &micro_batches(&seqs, 1)).unwrap();
        let alone: Vec<f64> =
            seqs.iter().map(|s| accumulate(&m, &micro_batches(std::slice::from_ref(s), 1)).unwrap().grad_sq_norm).collect();
        let mean = alone.iter().sum::<f64>() / alone.len() as f64;
        assert!((joint.mean_micro_sq_norm - mean).abs() < 1e-5 * mean, "{} vs {mean}", joint.mean_micro_sq_norm);
        // And T is the norm of the mean of those gradients, which is smaller than their mean norm.
        assert!(joint.grad_sq_norm < joint.mean_micro_sq_norm);
    }

    #[test]
    fn schedule_by_hand() {
        let c = OptimConfig { lr: 1.0, warmup_steps: 4, total_steps: 14, min_lr_ratio: 0.1, ..OptimConfig::default() };
        assert_eq!(c.schedule(0), 0.25);
        assert_eq!(c.schedule(3), 1.0);
        assert!((c.schedule(4) - 1.0).abs() < 1e-12);
        // Half way through the cosine: 0.1 + 0.9 * 0.5.
        assert!((c.schedule(9) - 0.55).abs() < 1e-12);
        assert!((c.schedule(14) - 0.1).abs() < 1e-12);
        assert!((c.schedule(100) - 0.1).abs() < 1e-12);
        // sqrt rule at 4x the reference batch (b0 8) doubles the rate: step 3 after 24
        // samples is at position 3 and ends past the warmup.
        assert!((c.lr_at(3, 24, 32, None) - 2.0).abs() < 1e-12);
    }

    /// The schedule counts samples: a step at 2 B0 advances it by two, so a run at any batch
    /// sees the same rate at the same number of samples.
    #[test]
    fn the_schedule_counts_samples() {
        let c = OptimConfig {
            lr: 1.0,
            b0: 8,
            warmup_steps: 4,
            total_steps: 14,
            min_lr_ratio: 0.1,
            lr_rule: copus_core::goodput::LrRule::Constant,
            ..OptimConfig::default()
        };
        // B = 16 from 0 samples: warmup value after two reference steps, 2 / 4.
        assert_eq!(c.lr_at(0, 0, 16, None), 0.5);
        // Its second step starts at 16 samples (position 2) and ends the warmup: 4 / 4.
        assert_eq!(c.lr_at(1, 16, 16, None), 1.0);
        // After 72 samples (position 9), half way through the cosine whatever the batch or
        // the number of steps it took.
        for (step, b) in [(9, 8), (4, 16), (1, 64)] {
            assert!((c.lr_at(step, 72, b, None) - 0.55).abs() < 1e-12, "{step} steps of {b}");
        }
        // A batch that overshoots the warmup's end is capped at the peak: (3 + 8) / 4 > 1.
        assert_eq!(c.lr_at(3, 24, 64, None), 1.0);
        // The step clock ignores samples: step 4 is the warmup's end at any batch.
        let steps = OptimConfig { schedule_clock: crate::ScheduleClock::Steps, ..c };
        assert_eq!(steps.lr_at(0, 0, 16, None), 0.25);
        assert!((steps.lr_at(9, 720, 80, None) - 0.55).abs() < 1e-12);
        assert_eq!(steps.schedule(9), c.schedule_at(9.0, 1.0));
        // At B0 the sample clock is the step clock, to the bit: the step-counted schedule
        // written out by hand (linear warmup (s + 1) / W, then cosine over [W, T]).
        for b0 in [1usize, 8, 16] {
            let c = OptimConfig { b0, lr_rule: copus_core::goodput::LrRule::Sqrt, ..c.clone() };
            for s in 0..20u64 {
                let (w, t) = (c.warmup_steps, c.total_steps);
                let by_hand = if s < w {
                    (s + 1) as f64 / w as f64
                } else {
                    let x = ((s - w) as f64 / (t - w) as f64).min(1.0);
                    c.min_lr_ratio + (1.0 - c.min_lr_ratio) * 0.5 * (1.0 + (std::f64::consts::PI * x).cos())
                };
                assert_eq!(c.lr_at(s, s * b0 as u64, b0, None).to_bits(), (c.lr * by_hand).to_bits(), "b0 {b0}, step {s}");
            }
        }
    }

    #[test]
    fn training_lowers_the_loss_and_feeds_the_noise_estimator() {
        let mut t = Trainer::new(model(), OptimConfig { lr: 0.05, warmup_steps: 1, total_steps: 40, ..OptimConfig::default() }).unwrap();
        let mut first = None;
        let mut last = None;
        for step in 0..30 {
            let seqs = sequences(8, 6, 100 + step);
            let m = t.step(&micro_batches(&seqs, 2)).unwrap();
            first.get_or_insert(m.loss);
            last = Some(m);
        }
        let last = last.unwrap();
        assert!(last.loss < 0.5 * first.unwrap(), "{} -> {}", first.unwrap(), last.loss);
        assert_eq!((last.step, last.global_batch, last.micro_batch, last.num_micro), (30, 8, 2, 4));
        assert_eq!(last.tokens_seen, 30 * 8 * 6);
        assert!(last.grad_sq.is_some() && last.trace.is_some());
        assert_eq!(t.gns().observations(), 30);
    }

    #[test]
    fn one_micro_batch_per_step_uses_the_biased_fallback() {
        let mut t = Trainer::new(model(), OptimConfig::default()).unwrap();
        let a = t.step(&micro_batches(&sequences(4, 6, 1), 4)).unwrap();
        assert!(a.b_simple.is_none(), "the first n == 1 step has nothing to difference");
        let b = t.step(&micro_batches(&sequences(4, 6, 2), 4)).unwrap();
        assert!(b.gns_biased && b.trace.is_some());
    }

    #[test]
    fn norms_and_embeddings_skip_weight_decay_unless_asked() {
        // Tokens 0..4 only: embedding rows 8.. get a zero gradient, so AdamW moves them only
        // through weight decay: not at all when excluded, by exactly (1 - lr * wd) when included.
        let seqs: Vec<Vec<i64>> = vec![vec![0, 1, 2, 3, 0, 1, 2]; 4];
        let (lr, wd) = (0.01, 0.5);
        let row = |m: &Bigram| m.emb.weight.val().narrow(0, 8, 8).into_data().try_to_vec::<f32>().unwrap();
        for decay_all in [false, true] {
            let m0 = model();
            let before = row(&m0);
            let cfg =
                OptimConfig { lr, weight_decay: wd, warmup_steps: 0, decay_norms_and_embeddings: decay_all, ..OptimConfig::default() };
            let mut t = Trainer::new(m0, cfg).unwrap();
            let lr_used = t.step(&micro_batches(&seqs, 2)).unwrap().lr;
            let after = row(t.model());
            for (a, b) in after.iter().zip(&before) {
                let want = if decay_all { b * (1.0 - (lr_used * wd) as f32) } else { *b };
                assert!((a - want).abs() <= 1e-7 * b.abs().max(1.0), "decay_all {decay_all}: {a} vs {want}");
            }
        }
    }

    #[test]
    fn bad_inputs_are_errors() {
        let e = Trainer::new(model(), OptimConfig { beta2: 1.0, ..OptimConfig::default() }).err().unwrap();
        assert_eq!(e.to_string(), "optimizer setting `beta2` must be in [0, 1), got 1");
        let mut t = Trainer::new(model(), OptimConfig::default()).unwrap();
        let mut mb = micro_batches(&sequences(4, 6, 1), 2);
        mb.extend(micro_batches(&sequences(1, 6, 1), 1));
        assert!(matches!(t.step(&mb), Err(TrainError::Batch(_))));
        assert!(matches!(t.step(&[]), Err(TrainError::Batch(_))));
        // The model survives a refused step.
        let before = flat(t.model());
        t.step(&micro_batches(&sequences(2, 6, 1), 2)).unwrap();
        assert_ne!(before, flat(t.model()));
    }
}
