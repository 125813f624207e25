//! Adaptive batching for burn-train's `SupervisedTraining` (feature `learner`).
//!
//! Enabling it on an existing Learner takes two calls on one [`CopusBatching`] handle:
//!
//! ```ignore
//! use copus_burn::learner::{CopusBatchingConfig, CopusTrainingExt};
//! let copus = CopusBatchingConfig::new(16).init()?;            // loader batches of 16, B0 = 16
//! let learner = copus.learner(model, optim, scheduler);        // the scheduler, batch-scaled
//! SupervisedTraining::new(dir, train_loader, valid_loader)
//!     .with_copus(&copus, device)                              // strategy and the three metrics
//!     .launch(learner);
//! ```
//!
//! A Learner built without the scaled scheduler is refused when training starts (unless the LR
//! rule is `Constant`), so forgetting it cannot silently leave the learning rate unscaled.
//!
//! The training strategy runs the loader's batches as micro-batches and accumulates `k` of them
//! per optimizer step (the mean gradient, weighted by each micro-batch's samples). Per step it
//! measures every micro-batch's squared gradient norm and that of the mean, feeds copus-core's
//! noise-scale estimator, and every `adapt_every` steps picks the accumulation count (and, with a
//! loader built on [`CopusBatching::batch_strategy`], the micro-batch size) with the highest
//! Goodput under the measured step costs ([`copus_core::accumulation`]). The optimizer, its state
//! and the model are never rebuilt: a batch change only changes how many gradients go into the
//! next step and the learning-rate factor the scheduler wrapper applies.
//!
//! Files: `config` (settings), `state` (the shared state and what a checkpoint keeps), `lr` (the
//! scheduler wrapper), `loader` (the batch strategy), `strategy` (the training strategy, on one
//! device or several), `metrics` (what burn-train's dashboard shows).

mod config;
mod loader;
mod lr;
mod metrics;
mod state;
mod strategy;

use std::collections::VecDeque;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use burn::optim::ModuleOptimizer;
use burn::optim::lr_scheduler::module_lr_scheduler::ModuleLrScheduler;
use burn::tensor::Device;
use burn::train::{Learner, LearnerModel, SupervisedTraining, TrainingStrategy};
use copus_core::accumulation::{CostTracker, Plan, best_plan_on, score_on};
use copus_core::gns::GnsEstimator;
use copus_core::gns::StepStats;
use copus_core::goodput::LrRule;

use config::bad;
pub use config::{CopusBatchingConfig, CopusLearnerError, ScheduleClock};
pub use loader::AdaptiveBatchSize;
pub use lr::BatchScaledLr;
pub use metrics::{BatchSizeMetric, EfficiencyMetric, NoiseScaleMetric};
pub(crate) use state::StepMeasure;
use state::{Persisted, SNAPSHOTS_KEPT, Shared, State};
pub use state::{Snapshot, StepRecord};
pub use strategy::CopusStrategy;

impl CopusBatchingConfig {
    /// Checks the settings and builds the shared handle.
    pub fn init(&self) -> Result<CopusBatching, CopusLearnerError> {
        self.validate()?;
        let mut options = if self.micro_batch_options.is_empty() { vec![self.micro_batch] } else { self.micro_batch_options.clone() };
        options.sort_unstable();
        options.dedup();
        let plan = Plan { micro_batch: self.micro_batch, accumulation: self.initial_accumulation };
        let estimator = GnsEstimator::new(self.smoothing).map_err(|e| bad("smoothing", e.to_string(), self.smoothing))?;
        let kept = Persisted {
            b0: plan.batch(),
            plan,
            options,
            estimator,
            costs: CostTracker::new(self.smoothing),
            steps: 0,
            samples: 0,
            micro_batches: 0,
            lr_factor: 1.0,
            mismatched_steps: 0,
        };
        let state = State { kept, history: Vec::new(), snapshots: VecDeque::new(), devices: 1, schedule_advance: 1.0 };
        Ok(CopusBatching {
            shared: Arc::new(Shared {
                config: self.clone(),
                scheduler_steps: std::sync::atomic::AtomicU64::new(0),
                follows: std::sync::atomic::AtomicBool::new(false),
                micro_batch: AtomicUsize::new(self.micro_batch),
                state: Mutex::new(state),
            }),
        })
    }
}

/// The shared handle: hands out the strategy, scheduler wrapper, batch strategy and metrics, all
/// reading and writing one state. Cheap to clone.
#[derive(Clone)]
pub struct CopusBatching {
    shared: Arc<Shared>,
}

impl CopusBatching {
    /// The burn-train training strategy on `device` (an autodiff device is made from it).
    pub fn training_strategy<M: LearnerModel>(&self, device: Device) -> TrainingStrategy<M> {
        self.shared.lock().devices = 1;
        TrainingStrategy::Custom(Arc::new(CopusStrategy::new(self.clone(), vec![device])))
    }

    /// The strategy on several devices through burn-train's multi-device step: each round runs
    /// one micro-batch per device (the loader split across them, as Burn's own multi-device
    /// strategy does), gradients are gathered on the first device, and accumulation counts are
    /// multiples of the device count, so a bigger batch costs more rounds only every
    /// `devices` micro-batches.
    pub fn training_strategy_multi<M: LearnerModel>(&self, devices: Vec<Device>) -> Result<TrainingStrategy<M>, CopusLearnerError> {
        let n = devices.len();
        let cfg = &self.shared.config;
        if n == 0 {
            return Err(bad("devices", "one or more", n));
        }
        if !cfg.initial_accumulation.is_multiple_of(n) {
            return Err(bad("initial_accumulation", format!("a multiple of the {n} devices"), cfg.initial_accumulation));
        }
        if cfg.max_accumulation < n {
            return Err(bad("max_accumulation", format!("at least the {n} devices"), cfg.max_accumulation));
        }
        self.shared.lock().devices = n;
        Ok(TrainingStrategy::Custom(Arc::new(CopusStrategy::new(self.clone(), devices))))
    }

    /// Wraps a scheduler (a burn scheduler config's `init()`, or any `LrScheduler`) so its
    /// learning rate is multiplied by the batch rule's factor `lr_rule(B / B0)`, updated whenever
    /// the batch changes; the schedule advances by `schedule_clock`. Give it one schedule: of
    /// a `ModuleLrScheduler` with several groups only the base group's rate is used (burn-optim
    /// does not expose the groups, so this cannot be checked). For parameter groups with their
    /// own schedules, wrap each:
    /// `ModuleLrScheduler::new(copus.lr_scheduler(base)).with_group(group,
    /// copus.lr_scheduler(other))`. The record holds the schedule's own keys, as a Learner
    /// without copus writes them, plus copus's state under `copus.`, which Burn's checkpointer
    /// saves and `.checkpoint(n)` restores.
    pub fn lr_scheduler(&self, inner: impl Into<ModuleLrScheduler>) -> BatchScaledLr {
        BatchScaledLr { inner: inner.into(), shared: self.shared.clone(), debt: 0.0, last: None }
    }

    /// The micro-batch sizes copus may still choose (one, after falling back to a loader
    /// that ignores changes).
    pub fn micro_batch_options(&self) -> Vec<usize> {
        self.shared.lock().options.clone()
    }

    /// A Learner whose scheduler is `scheduler` scaled by the batch rule: `Learner::new(model,
    /// optim, copus.lr_scheduler(scheduler))`.
    pub fn learner<M: LearnerModel>(&self, model: M, optim: ModuleOptimizer, scheduler: impl Into<ModuleLrScheduler>) -> Learner<M> {
        Learner::new(model, optim, self.lr_scheduler(scheduler))
    }

    /// Sets how far the schedule advances at the coming optimizer step, from its samples.
    pub(crate) fn set_step_samples(&self, samples: usize) {
        let mut s = self.shared.lock();
        s.schedule_advance = samples as f64 / s.b0 as f64;
    }

    /// Refuses a Learner whose scheduler is not this handle's [`BatchScaledLr`]: its learning
    /// rate would not follow the batch. A `Constant` LR rule needs no scaling and passes.
    pub(crate) fn check_scheduler<M: LearnerModel>(&self, learner: &Learner<M>) -> Result<(), String> {
        let cfg = &self.shared.config;
        if cfg.lr_rule == LrRule::Constant && cfg.schedule_clock == ScheduleClock::Steps {
            // Nothing to scale and nothing to re-time.
            return Ok(());
        }
        let before = self.shared.scheduler_steps.load(Ordering::Relaxed);
        // A copy of the Learner steps its copy of the scheduler; the original is untouched.
        let mut probe = learner.clone();
        probe.lr_step();
        if self.shared.scheduler_steps.load(Ordering::Relaxed) == before {
            return Err(format!(
                "the Learner's LR scheduler is not copus's: build it with `copus.learner(model, optim, scheduler)` or \
                 `Learner::new(model, optim, copus.lr_scheduler(scheduler))` (or set lr_rule to Constant and schedule_clock to \
                 Steps; they are {:?} and {:?})",
                cfg.lr_rule, cfg.schedule_clock
            ));
        }
        Ok(())
    }

    /// A loader batch strategy whose size follows the chosen micro-batch. Build the training
    /// loader with it (`BatchDataLoader::new(Box::new(copus.batch_strategy()), ..)`) to let copus
    /// change the micro-batch as well as the accumulation count.
    pub fn batch_strategy<I>(&self) -> AdaptiveBatchSize<I> {
        AdaptiveBatchSize { items: Vec::new(), shared: self.shared.clone() }
    }

    /// Burn metric: the smoothed noise scale `B_simple`.
    pub fn noise_scale_metric(&self) -> NoiseScaleMetric {
        NoiseScaleMetric::new(self.clone())
    }

    /// Burn metric: samples per optimizer step.
    pub fn batch_size_metric(&self) -> BatchSizeMetric {
        BatchSizeMetric::new(self.clone())
    }

    /// Burn metric: statistical efficiency of the current batch against `B0`.
    pub fn efficiency_metric(&self) -> EfficiencyMetric {
        EfficiencyMetric::new(self.clone())
    }

    /// The settings.
    pub fn config(&self) -> &CopusBatchingConfig {
        &self.shared.config
    }

    /// The reference batch `B0`.
    pub fn b0(&self) -> usize {
        self.shared.lock().b0
    }

    /// The state now.
    pub fn snapshot(&self) -> Snapshot {
        let s = self.shared.lock();
        s.snapshot(&self.shared.config)
    }

    /// Every optimizer step so far.
    pub fn history(&self) -> Vec<StepRecord> {
        self.shared.lock().history.clone()
    }

    /// The snapshot published at training iteration `index` (the newest such), or the latest one.
    pub(crate) fn snapshot_at(&self, index: Option<usize>) -> Snapshot {
        let s = self.shared.lock();
        if let Some(i) = index
            && let Some((_, snap)) = s.snapshots.iter().rev().find(|(j, _)| *j == i)
        {
            return *snap;
        }
        s.snapshot(&self.shared.config)
    }

    /// The plan of the step about to start.
    pub(crate) fn plan(&self) -> Plan {
        self.shared.lock().plan
    }

    /// Records a finished micro-batch of `samples` at training `iteration` (what the metrics see).
    pub(crate) fn publish_micro_batch(&self, iteration: usize, samples: usize, seconds: f64) {
        let mut s = self.shared.lock();
        s.micro_batches += 1;
        s.samples += samples as u64;
        s.costs.observe_micro(samples, seconds);
        let snap = s.snapshot(&self.shared.config);
        s.snapshots.push_back((iteration, snap));
        if s.snapshots.len() > SNAPSHOTS_KEPT {
            s.snapshots.pop_front();
        }
    }

    /// Refuses, before the first optimizer step, a loader whose batches are not the configured
    /// micro-batch (`full`: the step was not cut short by the epoch's end).
    pub(crate) fn check_loader(&self, sizes: &[usize], full: bool) -> Result<(), String> {
        let s = self.shared.lock();
        if s.steps == 0 && full && sizes.iter().any(|&x| x != s.plan.micro_batch) {
            return Err(format!(
                "the training loader produced batches of {sizes:?} samples, but CopusBatchingConfig::micro_batch is {}; \
                 build the loader with that batch size (or on `batch_strategy()`), or set micro_batch to the loader's",
                s.plan.micro_batch
            ));
        }
        Ok(())
    }

    /// Closes an optimizer step: feeds the estimator and the cost model, and decides the next plan.
    pub(crate) fn finish_step(&self, m: StepMeasure) {
        let cfg = &self.shared.config;
        let mut s = self.shared.lock();
        s.steps += 1;
        s.costs.observe_step(m.overhead_seconds);
        let n = m.micro_sizes.len();
        let equal = n > 0 && m.micro_sizes.iter().all(|&x| x == m.micro_sizes[0]);
        let mean_micro = if n > 0 { m.micro_sq_norms.iter().sum::<f64>() / n as f64 } else { 0.0 };
        // A step with unequal micro-batches (the end of an epoch) breaks the estimator's
        // assumption; it is skipped rather than mis-measured.
        if equal {
            let stats = StepStats {
                micro_batch: m.micro_sizes[0],
                num_micro: n,
                mean_micro_sq_norm: mean_micro,
                grad_sq_norm: m.grad_sq_norm,
                diff_sq_norm: m.diff_sq_norm,
            };
            // Non-finite norms mean a diverged step; the estimator refuses them and we keep going.
            let _ = s.estimator.observe(&stats);
        }
        let planned = s.plan.micro_batch;
        s.mismatched_steps = if equal && m.micro_sizes[0] != planned { s.mismatched_steps + 1 } else { 0 };
        // A loader cut by `batch_strategy()` follows changes, though a prefetching one still
        // hands out the batches it queued before (steps close by samples, so those count
        // fully). A plain loader ignores changes: after three whole steps of the wrong size,
        // adapt the accumulation only, at about the same batch, and at that batch's LR factor.
        if s.mismatched_steps >= 3 && s.options.len() > 1 && !self.shared.follows.load(Ordering::Relaxed) {
            let actual = m.micro_sizes[0];
            let d = s.devices;
            let rounds = (s.plan.batch() as f64 / (actual * d) as f64).round().clamp(1.0, (cfg.max_accumulation / d).max(1) as f64);
            s.options = vec![actual];
            s.plan = Plan { micro_batch: actual, accumulation: rounds as usize * d };
            s.lr_factor = cfg.lr_rule.factor(s.plan.batch() as f64, s.b0 as f64, s.phi());
            self.shared.micro_batch.store(actual, Ordering::Relaxed);
        }
        let used_lr = s.lr_factor;
        let used_plan = s.plan;
        let switched_to = if !cfg.frozen && s.steps.is_multiple_of(cfg.adapt_every as u64) { self.decide(&mut s) } else { None };
        let samples_total = s.samples;
        let b_simple = s.estimator.b_simple();
        let step = s.steps;
        s.history.push(StepRecord {
            step,
            plan: used_plan,
            micro_batches: n,
            samples: m.micro_sizes.iter().sum(),
            samples_total,
            grad_sq_norm: m.grad_sq_norm,
            mean_micro_sq_norm: mean_micro,
            b_simple,
            lr_factor: used_lr,
            seconds: m.step_seconds,
            switched_to,
        });
    }

    fn decide(&self, s: &mut State) -> Option<Plan> {
        let cfg = &self.shared.config;
        if s.estimator.observations() < cfg.min_observations {
            return None;
        }
        let phi = s.phi()?;
        let objective = cfg.objective.build();
        let b0 = s.b0 as f64;
        // Measure every micro-batch option once before trusting a fitted cost model.
        let measured = s.costs.measured();
        let d = s.devices;
        let next = if cfg.cost.is_none()
            && let Some(&m) = s.options.iter().find(|m| !measured.contains(m))
        {
            let rounds = (s.plan.batch() as f64 / (m * d) as f64).round().clamp(1.0, (cfg.max_accumulation / d) as f64);
            Some(Plan { micro_batch: m, accumulation: rounds as usize * d })
        } else {
            let cost = cfg.cost.or_else(|| s.costs.model())?;
            let best = best_plan_on(&cost, objective.as_ref(), phi, b0, &s.options, cfg.max_accumulation, s.b0, d)?;
            let current = score_on(&cost, objective.as_ref(), phi, b0, s.plan, d);
            (best.plan != s.plan && best.goodput > current.goodput * (1.0 + cfg.min_gain)).then_some(best.plan)
        };
        let next = next.filter(|p| *p != s.plan)?;
        s.plan = next;
        s.lr_factor = cfg.lr_rule.factor(next.batch() as f64, b0, Some(phi));
        self.shared.micro_batch.store(next.micro_batch, Ordering::Relaxed);
        Some(next)
    }
}

/// Wires copus into burn-train's `SupervisedTraining` in one call.
pub trait CopusTrainingExt {
    /// The copus training strategy on `device`, and its three metrics (noise scale, batch
    /// size, efficiency). Build the Learner with [`CopusBatching::learner`].
    fn with_copus(self, copus: &CopusBatching, device: Device) -> Self;
}

impl<M: LearnerModel> CopusTrainingExt for SupervisedTraining<M> {
    fn with_copus(self, copus: &CopusBatching, device: Device) -> Self {
        self.with_training_strategy(copus.training_strategy(device))
            .metric_train_numeric(copus.noise_scale_metric())
            .metric_train_numeric(copus.batch_size_metric())
            .metric_train_numeric(copus.efficiency_metric())
    }
}

#[cfg(test)]
mod tests {
    use burn::optim::lr_scheduler::LrScheduler;
    use burn::optim::lr_scheduler::linear::LinearLrSchedulerConfig;

    use super::*;

    /// Rates of a linear schedule from 1.0 down by 0.01 per schedule step, scaled by copus, as
    /// steps of `samples` samples go by (B0 = 4).
    fn rates(clock: ScheduleClock, samples: &[usize]) -> Vec<f64> {
        let copus = CopusBatchingConfig::new(4).with_schedule_clock(clock).with_lr_rule(LrRule::Constant).init().unwrap();
        let mut lr = copus.lr_scheduler(LinearLrSchedulerConfig::new(1.0, 0.0, 100).init().unwrap());
        samples
            .iter()
            .map(|&n| {
                copus.set_step_samples(n);
                lr.step()
            })
            .collect()
    }

    #[test]
    fn gradient_checkpointing_reaches_the_strategys_devices() {
        let strategy = |on: bool| {
            let copus = CopusBatchingConfig::new(4).with_gradient_checkpointing(on).init().unwrap();
            CopusStrategy::new(copus, vec![Device::flex()])
        };
        let want = format!("{:?}", Device::flex().autodiff().gradient_checkpointing().gradient_checkpointing_strategy());
        let off = format!("{:?}", Device::flex().autodiff().gradient_checkpointing_strategy());
        assert_ne!(want, off);
        assert_eq!(format!("{:?}", strategy(true).devices()[0].gradient_checkpointing_strategy()), want);
        assert_eq!(format!("{:?}", strategy(false).devices()[0].gradient_checkpointing_strategy()), off);
    }

    /// Parameter groups keep their own schedules when each is wrapped: every group's rate is
    /// its own schedule's times the batch factor.
    #[test]
    fn each_wrapped_group_keeps_its_schedule() {
        use burn::module::{ParamGroup, ParamId};
        use burn::optim::lr_scheduler::constant::ConstantLr;
        let copus = CopusBatchingConfig::new(4).with_lr_rule(LrRule::Linear).init().unwrap();
        copus.shared.lock().lr_factor = 2.0;
        let head = ParamId::new();
        let mut lr = ModuleLrScheduler::new(copus.lr_scheduler(ConstantLr::from(0.1)))
            .with_group(ParamGroup::from_ids(vec![head]), copus.lr_scheduler(ConstantLr::from(0.01)));
        let rates = lr.step();
        assert!((rates.base() - 0.2).abs() < 1e-12, "{}", rates.base());
        assert!((rates.lr_from_param(head, None) - 0.02).abs() < 1e-12);
        assert!((rates.lr_from_param(ParamId::new(), None) - 0.2).abs() < 1e-12);
    }

    #[test]
    fn the_schedule_advances_by_samples_or_by_steps() {
        let close = |a: &[f64], b: &[f64]| a.len() == b.len() && a.iter().zip(b).all(|(x, y)| (x - y).abs() < 1e-12);
        // At B0 both clocks take one schedule step per optimizer step.
        let at_b0 = rates(ScheduleClock::Samples, &[4, 4, 4]);
        assert!(close(&at_b0, &rates(ScheduleClock::Steps, &[4, 4, 4])), "{at_b0:?}");
        assert!(close(&at_b0, &[1.0, 0.99, 0.98]), "{at_b0:?}");
        // Twice B0 takes two schedule steps a step; half of it one every other step.
        let by_samples = rates(ScheduleClock::Samples, &[4, 8, 8, 2, 2]);
        assert!(close(&by_samples, &[1.0, 0.98, 0.96, 0.96, 0.95]), "{by_samples:?}");
        let by_steps = rates(ScheduleClock::Steps, &[4, 8, 8, 2, 2]);
        assert!(close(&by_steps, &[1.0, 0.99, 0.98, 0.97, 0.96]), "{by_steps:?}");
    }
}
