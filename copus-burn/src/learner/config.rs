//! The add-on's settings (`CopusBatchingConfig`), checked when the handle is built, and its
//! error type.

use burn::config::Config;
use copus_core::accumulation::StepCost;
use copus_core::goodput::{LrRule, ObjectiveKind};
use thiserror::Error;

/// Settings of the add-on. `micro_batch` is the batch size the training loader produces.
#[derive(Config, Debug)]
pub struct CopusBatchingConfig {
    /// Samples per loader batch at the start (the micro-batch, `m`).
    pub micro_batch: usize,
    /// Micro-batches per optimizer step at the start; the reference batch is
    /// `B0 = micro_batch * initial_accumulation`, the batch the learning rate is tuned for.
    /// The default, 1, keeps the loader's batch as the step, as plain burn-train does; the noise
    /// scale is then measured from consecutive steps until copus accumulates more.
    #[config(default = 1)]
    pub initial_accumulation: usize,
    /// The largest accumulation count considered.
    #[config(default = 64)]
    pub max_accumulation: usize,
    /// Micro-batch sizes the loader may switch between (needs a loader built with
    /// `CopusBatching::batch_strategy`); empty keeps `micro_batch`.
    #[config(default = "Vec::new()")]
    pub micro_batch_options: Vec<usize>,
    /// How the learning rate follows the batch: `Sqrt` (Adam), `Linear` (SGD), `AdaScale`, `Constant`.
    #[config(default = "LrRule::Sqrt")]
    pub lr_rule: LrRule,
    /// The objective that ranks plans: `Plain` Goodput, or `LrAware { x0, rule }`.
    #[config(default = "ObjectiveKind::Plain")]
    pub objective: ObjectiveKind,
    /// EMA factor of the noise-scale estimator (0.9: about 10 steps of memory).
    #[config(default = 0.9)]
    pub smoothing: f64,
    /// Optimizer steps between decisions.
    #[config(default = 10)]
    pub adapt_every: usize,
    /// Noise measurements needed before the first decision.
    #[config(default = 5)]
    pub min_observations: u64,
    /// Switch only when the best plan beats the current one's Goodput by this fraction.
    #[config(default = 0.05)]
    pub min_gain: f64,
    /// A fixed cost model instead of measured step times (reproducible decisions).
    #[config(default = "None")]
    pub cost: Option<StepCost>,
    /// Keep the batch fixed and only measure (a baseline that still reports the metrics).
    #[config(default = false)]
    pub frozen: bool,
    /// What advances the wrapped schedule: `Samples` (by `B / B0` per optimizer step, so
    /// warmup and decay keep their length in samples as the batch grows; at `B0` the same as
    /// counting steps) or `Steps` (once per optimizer step, as plain burn-train).
    #[config(default = "ScheduleClock::Samples")]
    pub schedule_clock: ScheduleClock,
    /// Recompute memory-bound activations in the backward pass (Burn's balanced gradient
    /// checkpointing) on the strategy's devices. burn-train 0.22's
    /// `SupervisedTraining::gradient_checkpointing()` applies to its own strategies only, so
    /// with copus set it here (or pass devices already made with it; they are kept as given).
    #[config(default = false)]
    pub gradient_checkpointing: bool,
}

pub use crate::optim::ScheduleClock;

/// A setting out of range.
#[derive(Clone, Debug, PartialEq, Error)]
pub enum CopusLearnerError {
    /// A field with a value it cannot take.
    #[error("copus learner setting `{field}` must be {allowed}, got {value}")]
    Setting {
        /// Field.
        field: &'static str,
        /// Allowed values.
        allowed: String,
        /// The value given.
        value: String,
    },
}

pub(super) fn bad(field: &'static str, allowed: impl Into<String>, value: impl std::fmt::Debug) -> CopusLearnerError {
    CopusLearnerError::Setting { field, allowed: allowed.into(), value: format!("{value:?}") }
}

impl CopusBatchingConfig {
    /// Checks every setting; an error names the field, the value and what is allowed.
    pub fn validate(&self) -> Result<(), CopusLearnerError> {
        if self.micro_batch == 0 {
            return Err(bad("micro_batch", "1 or more", self.micro_batch));
        }
        if self.max_accumulation == 0 {
            return Err(bad("max_accumulation", "1 or more", self.max_accumulation));
        }
        if !(1..=self.max_accumulation).contains(&self.initial_accumulation) {
            return Err(bad("initial_accumulation", format!("in 1..={}", self.max_accumulation), self.initial_accumulation));
        }
        if self.micro_batch_options.contains(&0) {
            return Err(bad("micro_batch_options", "sizes of 1 or more", &self.micro_batch_options));
        }
        if !self.micro_batch_options.is_empty() && !self.micro_batch_options.contains(&self.micro_batch) {
            return Err(bad(
                "micro_batch_options",
                format!("a list that contains micro_batch = {}", self.micro_batch),
                &self.micro_batch_options,
            ));
        }
        if !(0.0..1.0).contains(&self.smoothing) {
            return Err(bad("smoothing", "in [0, 1)", self.smoothing));
        }
        if self.adapt_every == 0 {
            return Err(bad("adapt_every", "1 or more", self.adapt_every));
        }
        if !(self.min_gain.is_finite() && self.min_gain >= 0.0) {
            return Err(bad("min_gain", "a finite number >= 0", self.min_gain));
        }
        if let ObjectiveKind::LrAware { x0, .. } = self.objective
            && !(x0.is_finite() && x0 > 0.0 && x0 <= 1.0)
        {
            return Err(bad("objective.x0", "in (0, 1]", x0));
        }
        if let Some(cost) = &self.cost {
            cost.validate().map_err(|e| bad("cost", e.to_string(), cost))?;
        }
        Ok(())
    }
}
