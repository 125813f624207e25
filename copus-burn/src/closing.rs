//! Closing an optimizer step, written once for every training loop (the single-rank trainer,
//! the engine's ranks and the Learner strategy).
//!
//! - [`ProbeMemory`] keeps the previous step's mean gradient for the noise probe's
//!   one-micro-batch fallback. It is kept only after a step of one micro-batch and forgotten
//!   after any other, so a 1 -> several -> 1 micro-batch sequence never differences against a
//!   stale gradient.
//! - [`StepCloser`] adds what a loop that owns its estimator and schedule does next: the
//!   statistics to the estimator, global-norm clipping and the learning rate.

use burn::module::Module;
use burn::optim::GradientsParams;
use copus_core::gns::{GnsError, GnsEstimator, NoiseEstimate, StepStats};

use crate::grads;
use crate::optim::OptimConfig;

/// The previous step's gradient, for the one-micro-batch probe.
#[derive(Default)]
pub struct ProbeMemory {
    previous: Option<GradientsParams>,
}

impl ProbeMemory {
    /// Nothing remembered.
    pub fn new() -> Self {
        Self::default()
    }

    /// The gradient a step of `num_micro` micro-batches differences against: the previous
    /// step's, when both have one micro-batch.
    pub fn previous(&self, num_micro: usize) -> Option<&GradientsParams> {
        if num_micro == 1 { self.previous.as_ref() } else { None }
    }

    /// Remembers `mean` after a step of one micro-batch; forgets any earlier gradient after a
    /// step of several.
    pub fn remember<M: Module>(&mut self, module: &M, num_micro: usize, mean: &GradientsParams) {
        self.previous = (num_micro == 1).then(|| grads::scaled(module, mean, 1.0));
    }

    /// What is remembered (for staging and checkpoints).
    pub fn get(&self) -> Option<&GradientsParams> {
        self.previous.as_ref()
    }

    /// Replaces what is remembered (when resuming).
    pub fn set(&mut self, previous: Option<GradientsParams>) {
        self.previous = previous;
    }
}

/// A closed step: the gradient to apply and what was decided on the way.
pub struct Closed {
    /// The mean gradient, clipped to the configured global norm.
    pub grads: GradientsParams,
    /// Global gradient norm before clipping.
    pub grad_norm: f64,
    /// Learning rate of this step (schedule x batch-size rule).
    pub lr: f64,
    /// The smoothed noise estimate after this step's statistics.
    pub estimate: Option<NoiseEstimate>,
}

/// What a gradient of global norm `grad_norm` is scaled by: `clip_norm / grad_norm` where it is
/// larger than the configured clip norm, else 1.
pub fn clip_factor(cfg: &OptimConfig, grad_norm: f64) -> f64 {
    match cfg.clip_norm {
        Some(c) if grad_norm > c => c / grad_norm,
        _ => 1.0,
    }
}

/// The probe memory, the noise-scale estimator, clipping and the learning rate of one loop.
pub struct StepCloser {
    memory: ProbeMemory,
    gns: GnsEstimator,
}

impl StepCloser {
    /// A closer whose estimator smooths with EMA factor `theta`.
    pub fn new(theta: f64) -> Result<Self, GnsError> {
        Ok(Self::with_estimator(GnsEstimator::new(theta)?))
    }

    /// A closer around `gns` (the estimator an [`crate::optim::OptimConfig`] asks for).
    pub fn with_estimator(gns: GnsEstimator) -> Self {
        Self { memory: ProbeMemory::new(), gns }
    }

    /// The probe memory (to difference against, to stage, to restore).
    pub fn memory(&self) -> &ProbeMemory {
        &self.memory
    }

    /// The probe memory, mutably (when resuming).
    pub fn memory_mut(&mut self) -> &mut ProbeMemory {
        &mut self.memory
    }

    /// The estimator.
    pub fn gns(&self) -> &GnsEstimator {
        &self.gns
    }

    /// Replaces the estimator (when resuming).
    pub fn set_gns(&mut self, gns: GnsEstimator) {
        self.gns = gns;
    }

    /// Closes step `step` (0-based) of `global_batch` sequences, after `samples` samples: feeds `stats` (measured
    /// before clipping; `stats.grad_sq_norm` is the whole model's |g|^2) to the estimator,
    /// remembers or forgets `mean` for the probe, clips it and picks the learning rate.
    #[allow(clippy::too_many_arguments)]
    pub fn close<M: Module>(
        &mut self,
        module: &M,
        cfg: &OptimConfig,
        step: u64,
        samples: u64,
        global_batch: usize,
        stats: &StepStats,
        mean: GradientsParams,
    ) -> Result<Closed, GnsError> {
        self.gns.observe(stats)?;
        self.memory.remember(module, stats.num_micro, &mean);
        Ok(self.close_unprobed(module, cfg, step, samples, global_batch, stats.grad_sq_norm, mean))
    }

    /// [`close`](Self::close) without the probe: nothing observed or remembered; the estimate
    /// is the one from before. Only to measure what the probe costs.
    #[allow(clippy::too_many_arguments)]
    pub fn close_unprobed<M: Module>(
        &self,
        module: &M,
        cfg: &OptimConfig,
        step: u64,
        samples: u64,
        global_batch: usize,
        grad_sq_norm: f64,
        mean: GradientsParams,
    ) -> Closed {
        let grad_norm = grad_sq_norm.sqrt();
        let factor = clip_factor(cfg, grad_norm);
        let grads = if factor == 1.0 { mean } else { grads::scaled(module, &mean, factor) };
        let estimate = self.gns.estimate();
        let lr = cfg.lr_at(step, samples, global_batch, estimate.and_then(|e| e.b_simple()));
        Closed { grads, grad_norm, lr, estimate }
    }
}
