//! The shared handle [`CopusBatching`]: its construction from the settings, the state it
//! shares, and the decision of the next plan at the end of a step. The training strategy and
//! the metrics it hands out add their constructors in their own files.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use burn::optim::ModuleOptimizer;
use burn::optim::lr_scheduler::module_lr_scheduler::ModuleLrScheduler;
use burn::train::{Learner, LearnerModel};
use copus_core::accumulation::{CostTracker, Plan, best_plan_on, score_on};
use copus_core::gns::GnsEstimator;
use copus_core::gns::StepStats;
use copus_core::goodput::LrRule;

use super::config::{CopusBatchingConfig, CopusLearnerError, ScheduleClock, bad};
use super::loader::AdaptiveBatchSize;
use super::lr::BatchScaledLr;
use super::state::{Persisted, SNAPSHOTS_KEPT, Shared, Snapshot, State, StepMeasure, StepRecord};

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
    pub(super) shared: Arc<Shared>,
}

impl CopusBatching {
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
