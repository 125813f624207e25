//! The add-on's shared state: what one optimizer step measured, the estimator and plan the
//! handles read and write, what a checkpoint keeps, and what the metrics show.

use std::collections::VecDeque;
use std::sync::atomic::AtomicUsize;
use std::sync::{Mutex, MutexGuard};

use copus_core::accumulation::{CostTracker, Plan};
use copus_core::gns::GnsEstimator;
use serde::{Deserialize, Serialize};

use super::config::CopusBatchingConfig;

/// What the add-on shows at one training iteration (one micro-batch).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Snapshot {
    /// Optimizer steps done.
    pub steps: u64,
    /// Training samples consumed.
    pub samples: u64,
    /// The plan of the step in progress.
    pub plan: Plan,
    /// The smoothed noise scale `B_simple`, once measured.
    pub b_simple: Option<f64>,
    /// Statistical efficiency of the current batch against `B0`, once the noise scale is known.
    pub efficiency: Option<f64>,
    /// The factor on the scheduler's learning rate.
    pub lr_factor: f64,
}

/// One optimizer step, as the strategy ran it.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct StepRecord {
    /// 1-based optimizer step.
    pub step: u64,
    /// The plan the step ran under (the last step of an epoch may hold fewer micro-batches).
    pub plan: Plan,
    /// Micro-batches in the step.
    pub micro_batches: usize,
    /// Samples in the step (from the loader's progress).
    pub samples: usize,
    /// Samples consumed up to and including this step.
    pub samples_total: u64,
    /// `|g|^2` of the step's mean gradient.
    pub grad_sq_norm: f64,
    /// Mean of the micro-batch `|g_k|^2`.
    pub mean_micro_sq_norm: f64,
    /// Smoothed `B_simple` after the step.
    pub b_simple: Option<f64>,
    /// The learning-rate factor the step used.
    pub lr_factor: f64,
    /// Seconds of the whole step.
    pub seconds: f64,
    /// The plan decided for the next step, when it changed.
    pub switched_to: Option<Plan>,
}

pub(super) struct Shared {
    pub(super) config: CopusBatchingConfig,
    /// Steps taken by any copy of the batch-scaled scheduler (a Learner without one is refused).
    pub(super) scheduler_steps: std::sync::atomic::AtomicU64,
    /// The loader cuts its batches with [`AdaptiveBatchSize`], so it follows micro-batch
    /// changes (batches of the old size may still be queued in a prefetching loader).
    pub(super) follows: std::sync::atomic::AtomicBool,
    /// The micro-batch the loader should produce next (read by [`AdaptiveBatchSize`]).
    pub(super) micro_batch: AtomicUsize,
    pub(super) state: Mutex<State>,
}

/// The add-on's state: what a checkpoint keeps ([`Persisted`], reached through `Deref`), and
/// what only this process needs.
pub(super) struct State {
    pub(super) kept: Persisted,
    pub(super) history: Vec<StepRecord>,
    /// (iteration in the epoch, snapshot) for the metrics, which may run behind.
    pub(super) snapshots: VecDeque<(usize, Snapshot)>,
    /// Devices running micro-batches side by side (accumulation counts are multiples of it).
    pub(super) devices: usize,
    /// How far the schedule advances at the coming optimizer step (samples over `B0`).
    pub(super) schedule_advance: f64,
}

/// What a checkpoint keeps of the state: everything a resumed run decides from.
#[derive(Clone, Serialize, Deserialize)]
pub(super) struct Persisted {
    /// The reference batch B0.
    pub(super) b0: usize,
    /// The accumulation count and micro-batch in force.
    pub(super) plan: Plan,
    /// The micro-batch sizes the loader can produce.
    pub(super) options: Vec<usize>,
    /// The noise-scale estimator.
    pub(super) estimator: GnsEstimator,
    /// Measured step costs per micro-batch size.
    pub(super) costs: CostTracker,
    /// Optimizer steps done.
    pub(super) steps: u64,
    /// Samples trained on.
    pub(super) samples: u64,
    /// Micro-batches run.
    pub(super) micro_batches: u64,
    /// The learning-rate factor of the batch rule in force.
    pub(super) lr_factor: f64,
    /// Consecutive steps whose micro-batches were not the planned size (a loader that ignores
    /// micro-batch changes, or one still handing out batches it prepared before a change).
    pub(super) mismatched_steps: u32,
}

/// The scheduler record's payload: the kept state's JSON object with the scheduler's unspent
/// advance (`debt`, in schedule steps) beside its fields, one flat object.
pub(super) fn saved_json(kept: &Persisted, debt: f64) -> Vec<u8> {
    /// The fields in the order of earlier versions: the kept state's, then `debt`.
    #[derive(Serialize)]
    struct Saved<'a> {
        #[serde(flatten)]
        kept: &'a Persisted,
        debt: f64,
    }
    serde_json::to_vec(&Saved { kept, debt }).expect("the state serialises")
}

/// The kept state and the scheduler's advance from [`saved_json`]'s bytes.
pub(super) fn from_saved_json(bytes: &[u8]) -> Option<(Persisted, f64)> {
    let mut v: serde_json::Value = serde_json::from_slice(bytes).ok()?;
    let debt = v.as_object_mut()?.remove("debt")?.as_f64()?;
    Some((serde_json::from_value(v).ok()?, debt))
}

impl std::ops::Deref for State {
    type Target = Persisted;

    fn deref(&self) -> &Persisted {
        &self.kept
    }
}

impl std::ops::DerefMut for State {
    fn deref_mut(&mut self) -> &mut Persisted {
        &mut self.kept
    }
}

pub(super) const SNAPSHOTS_KEPT: usize = 1 << 16;

impl Shared {
    pub(super) fn lock(&self) -> MutexGuard<'_, State> {
        // A panic elsewhere while holding the lock leaves plain numbers behind; keep going.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl State {
    pub(super) fn phi(&self) -> Option<f64> {
        let e = self.estimator.estimate()?;
        // Noise swamping the signal (|G|^2 <= 0) reads as a very large noise scale.
        Some(e.b_simple().unwrap_or(1e12))
    }

    pub(super) fn snapshot(&self, config: &CopusBatchingConfig) -> Snapshot {
        let phi = self.phi();
        let objective = config.objective.build();
        Snapshot {
            steps: self.steps,
            samples: self.samples,
            plan: self.plan,
            b_simple: self.estimator.b_simple(),
            efficiency: phi.map(|phi| objective.efficiency(self.plan.batch() as f64, self.b0 as f64, phi)),
            lr_factor: self.lr_factor,
        }
    }
}

/// What one optimizer step measured, handed to the shared state.
pub(crate) struct StepMeasure {
    pub(crate) micro_sizes: Vec<usize>,
    pub(crate) micro_sq_norms: Vec<f64>,
    pub(crate) grad_sq_norm: f64,
    pub(crate) diff_sq_norm: Option<f64>,
    pub(crate) step_seconds: f64,
    pub(crate) overhead_seconds: f64,
}
