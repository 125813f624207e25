//! Optimizer settings and the two AdamW implementations they build: Burn's (`init`, a
//! `ModuleOptimizer` for burn-train users) and copus's ([`AdamW`], moments held as tensors and
//! the update fused on the host; what the trainer and the engine's ranks use). Both update
//! to the bit alike.

mod adamw;

use burn::config::Config;
use burn::module::ParamGroup;
use burn::optim::{AdamWConfig, ModuleOptimizer};
use copus_core::gns::{GnsError, GnsEstimator, Memory};
use copus_core::goodput::LrRule;

pub use adamw::{AdamW, Moments};
pub(crate) use adamw::{MOMENT_1, MOMENT_2, TIME, contiguous_f32, marked_as};

/// An optimizer setting out of range.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
#[error("optimizer setting `{field}` must be {allowed}, got {value}")]
pub struct SettingError {
    /// The field of [`OptimConfig`].
    pub field: &'static str,
    /// The values allowed.
    pub allowed: &'static str,
    /// The value given.
    pub value: f64,
}

/// AdamW, schedule and clipping settings. Defaults follow common Llama pre-training; build
/// with `OptimConfig::new()` and the `with_*` setters, and the optimizer with
/// [`OptimConfig::init`].
#[derive(Config, Debug, PartialEq)]
pub struct OptimConfig {
    /// Peak learning rate at the reference batch `b0`.
    #[config(default = 1e-3)]
    pub lr: f64,
    /// Reference global batch (sequences) for the LR rule and statistical efficiency.
    #[config(default = 8)]
    pub b0: usize,
    /// How the LR follows B_g.
    #[config(default = "LrRule::Sqrt")]
    pub lr_rule: LrRule,
    /// Linear warmup, in steps at `b0` (with the [`ScheduleClock::Samples`] clock:
    /// `warmup_steps * b0` samples, whatever the batch).
    #[config(default = 20)]
    pub warmup_steps: u64,
    /// End of the cosine decay (after which the LR stays at its floor), in steps at `b0` like
    /// `warmup_steps`.
    #[config(default = 1000)]
    pub total_steps: u64,
    /// What advances the warmup and decay: samples (the default; every batch size follows the
    /// same schedule in data) or optimizer steps.
    #[config(default = "ScheduleClock::Samples")]
    pub schedule_clock: ScheduleClock,
    /// Final LR as a fraction of the peak.
    #[config(default = 0.1)]
    pub min_lr_ratio: f64,
    /// Adam beta 1.
    #[config(default = 0.9)]
    pub beta1: f64,
    /// Adam beta 2.
    #[config(default = 0.95)]
    pub beta2: f64,
    /// Adam epsilon (PyTorch's default 1e-8; Burn's is 1e-5).
    #[config(default = 1e-8)]
    pub eps: f64,
    /// Decoupled weight decay.
    #[config(default = 0.1)]
    pub weight_decay: f64,
    /// Apply weight decay to norms and embeddings too.
    #[config(default = false)]
    pub decay_norms_and_embeddings: bool,
    /// Clip the global gradient norm to this value.
    #[config(default = "Some(1.0)")]
    pub clip_norm: Option<f64>,
    /// EMA factor of the noise-scale estimator.
    #[config(default = 0.95)]
    pub gns_theta: f64,
    /// How far back the noise-scale estimate reaches: `None`, the EMA alone; `Some(n)`, a long
    /// average of up to about `n` steps beside it, reported while the two agree and restarted
    /// from the EMA when they part (copus-core `gns::Memory::Adaptive`).
    #[config(default = "None")]
    pub gns_memory: Option<f64>,
}

/// What advances a learning-rate schedule.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum ScheduleClock {
    /// Once per optimizer step, whatever its batch.
    Steps,
    /// By the step's samples over `B0`: a step at `B0` advances it by one, at `2 B0` by two.
    Samples,
}

impl Default for OptimConfig {
    fn default() -> Self {
        Self::new()
    }
}

fn check(field: &'static str, value: f64, ok: bool, allowed: &'static str) -> Result<(), SettingError> {
    if ok && value.is_finite() { Ok(()) } else { Err(SettingError { field, allowed, value }) }
}

impl OptimConfig {
    /// Checks every range.
    pub fn validate(&self) -> Result<(), SettingError> {
        check("lr", self.lr, self.lr > 0.0, "> 0")?;
        check("b0", self.b0 as f64, self.b0 > 0, ">= 1")?;
        check("total_steps", self.total_steps as f64, self.total_steps > 0, ">= 1")?;
        check("min_lr_ratio", self.min_lr_ratio, (0.0..=1.0).contains(&self.min_lr_ratio), "in [0, 1]")?;
        check("beta1", self.beta1, (0.0..1.0).contains(&self.beta1), "in [0, 1)")?;
        check("beta2", self.beta2, (0.0..1.0).contains(&self.beta2), "in [0, 1)")?;
        check("eps", self.eps, self.eps > 0.0, "> 0")?;
        check("weight_decay", self.weight_decay, self.weight_decay >= 0.0, ">= 0")?;
        if let Some(c) = self.clip_norm {
            check("clip_norm", c, c > 0.0, "> 0 (or None)")?;
        }
        check("gns_theta", self.gns_theta, (0.0..1.0).contains(&self.gns_theta), "in [0, 1)")?;
        if let Some(m) = self.gns_memory {
            let ema = 1.0 / (1.0 - self.gns_theta);
            check("gns_memory", m, m >= ema, "at least the EMA's 1 / (1 - gns_theta) steps (or None)")?;
        }
        Ok(())
    }

    /// The noise-scale estimator these settings ask for (`gns_theta`, `gns_memory`).
    pub fn gns_estimator(&self) -> Result<GnsEstimator, GnsError> {
        let memory = self.gns_memory.map_or(Memory::Fixed, |max_steps| Memory::Adaptive { max_steps });
        GnsEstimator::new(self.gns_theta)?.with_memory(memory)
    }

    /// Schedule factor at `step` (0-based) counted in steps: linear warmup to 1, cosine to
    /// `min_lr_ratio`.
    pub fn schedule(&self, step: u64) -> f64 {
        self.schedule_at(step as f64, 1.0)
    }

    /// Schedule factor of a step that starts at position `at` and advances it by `len` (in
    /// steps at `b0`): the warmup's value after the step, `min(1, (at + len) / warmup_steps)`,
    /// while `at` is in the warmup, then cosine from 1 to `min_lr_ratio` over
    /// `[warmup_steps, total_steps]` at `at`. With `len = 1` and `at` the step index it is the
    /// step-counted schedule.
    pub fn schedule_at(&self, at: f64, len: f64) -> f64 {
        let warmup = self.warmup_steps as f64;
        if at < warmup {
            return ((at + len) / warmup).min(1.0);
        }
        let decay = self.total_steps.saturating_sub(self.warmup_steps).max(1) as f64;
        let t = ((at - warmup) / decay).min(1.0);
        self.min_lr_ratio + (1.0 - self.min_lr_ratio) * 0.5 * (1.0 + (std::f64::consts::PI * t).cos())
    }

    /// Learning rate of step `step` (0-based), which starts after `samples` samples and has
    /// global batch `batch`, at noise scale `phi`: the schedule on the recipe's clock times the
    /// LR rule's factor.
    pub fn lr_at(&self, step: u64, samples: u64, batch: usize, phi: Option<f64>) -> f64 {
        let schedule = match self.schedule_clock {
            ScheduleClock::Steps => self.schedule(step),
            ScheduleClock::Samples => {
                let b0 = self.b0 as f64;
                self.schedule_at(samples as f64 / b0, batch as f64 / b0)
            }
        };
        self.lr * schedule * self.lr_rule.factor(batch as f64, self.b0 as f64, phi)
    }
}

impl OptimConfig {
    /// Burn's AdamW with these settings; parameters whose path contains one of `no_decay` take
    /// no weight decay unless `decay_norms_and_embeddings`.
    pub fn init(&self, no_decay: &[String]) -> ModuleOptimizer {
        let adamw = |wd: f64| {
            AdamWConfig::new()
                .with_beta_1(self.beta1 as f32)
                .with_beta_2(self.beta2 as f32)
                .with_epsilon(self.eps as f32)
                .with_weight_decay(wd as f32)
        };
        let mut optim = adamw(self.weight_decay).init();
        if !self.decay_norms_and_embeddings && self.weight_decay > 0.0 {
            for p in no_decay {
                optim = optim.with_group(ParamGroup::from_predicate(p.clone()), adamw(0.0).build(), None);
            }
        }
        optim
    }

    /// copus's AdamW ([`AdamW`]) with these settings: the same updates as [`OptimConfig::init`]'s
    /// to the bit, with the moments held as tensors and the update fused on the host.
    pub fn adamw(&self, no_decay: &[String]) -> AdamW {
        let no_decay = if self.decay_norms_and_embeddings { &[] } else { no_decay };
        AdamW::new(self.beta1 as f32, self.beta2 as f32, self.eps as f32, self.weight_decay as f32, no_decay)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `gns_memory` builds the estimator it names; one shorter than the EMA's memory (20 steps
    /// at theta 0.95) or not finite is refused, naming the field.
    #[test]
    fn the_noise_memory_builds_the_estimator_it_names() {
        assert_eq!(OptimConfig::new().gns_estimator().unwrap().memory(), Memory::Fixed);
        let c = OptimConfig::new().with_gns_memory(Some(500.0));
        c.validate().unwrap();
        assert_eq!(c.gns_estimator().unwrap().memory(), Memory::Adaptive { max_steps: 500.0 });
        OptimConfig::new().with_gns_memory(Some(20.0)).validate().unwrap();
        for bad in [19.0, f64::NAN, f64::INFINITY] {
            let e = OptimConfig::new().with_gns_memory(Some(bad)).validate().unwrap_err();
            assert_eq!(e.field, "gns_memory", "{bad}");
            assert!(OptimConfig::new().with_gns_memory(Some(bad)).gns_estimator().is_err(), "{bad}");
        }
    }
}
