//! Statistical efficiency, Goodput, the objectives that rank candidates, and learning-rate
//! rules for batch-size changes.
//!
//! `SE(B) = (phi + B0) / (phi + B)` with `phi = B_simple`: the fraction of a sample's progress at
//! the reference batch B0 that a sample at batch B still makes. Goodput = throughput * SE.

use serde::{Deserialize, Serialize};

/// Statistical efficiency of batch `batch` relative to `b0` at noise scale `phi`.
pub fn statistical_efficiency(batch: f64, b0: f64, phi: f64) -> f64 {
    (phi + b0) / (phi + batch)
}

/// Expected loss decrease per step of McCandlish's quadratic model, in units of the best
/// possible step at infinite batch: `2x - x^2 (1 + phi / B)` with `x = lr / lr_max`.
pub fn progress_per_step(x: f64, phi: f64, batch: f64) -> f64 {
    2.0 * x - x * x * (1.0 + phi / batch)
}

/// How the learning rate follows the batch size.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum LrRule {
    /// Keep the learning rate.
    Constant,
    /// `lr = lr0 * sqrt(B / B0)`, the usual rule for Adam.
    Sqrt,
    /// `lr = lr0 * B / B0`, the rule for SGD.
    Linear,
    /// AdaScale: `lr = lr0 * gain`, `gain = (phi + B0) B / ((phi + B) B0)` (1 while phi is unknown).
    AdaScale,
}

impl LrRule {
    /// The factor on the base learning rate at batch `batch`, reference `b0`, noise `phi`.
    pub fn factor(self, batch: f64, b0: f64, phi: Option<f64>) -> f64 {
        let s = batch / b0;
        match self {
            LrRule::Constant => 1.0,
            LrRule::Sqrt => s.sqrt(),
            LrRule::Linear => s,
            LrRule::AdaScale => phi.map_or(1.0, |phi| s * statistical_efficiency(batch, b0, phi)),
        }
    }
}

/// Ranks candidates: the statistical part of Goodput.
pub trait Objective: Send + Sync + std::fmt::Debug {
    /// Short name for reports.
    fn name(&self) -> &'static str;
    /// Progress per sample at `batch` relative to one sample at `b0`, given the noise scale.
    fn efficiency(&self, batch: f64, b0: f64, phi: f64) -> f64;
    /// Goodput: throughput (samples/s) times efficiency.
    fn goodput(&self, throughput: f64, batch: f64, b0: f64, phi: f64) -> f64 {
        throughput * self.efficiency(batch, b0, phi)
    }
}

/// Plain Goodput (Pollux/AdaptDL, COPUS): assumes the learning rate is tuned for each batch.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct PlainGoodput;

impl Objective for PlainGoodput {
    fn name(&self) -> &'static str {
        "plain"
    }
    fn efficiency(&self, batch: f64, b0: f64, phi: f64) -> f64 {
        statistical_efficiency(batch, b0, phi)
    }
}

/// LR-aware Goodput: progress per sample of the quadratic model at the learning rate the rule
/// actually gives, relative to the same at B0. With a rule that hits the optimal rate at every
/// batch it equals plain Goodput; with sqrt scaling it charges batches whose rate is off.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct LrAwareGoodput {
    /// `x0 = lr0 / lr_max`: the base learning rate as a fraction of the largest useful one, at B0.
    pub x0: f64,
    /// How the run scales the learning rate with the batch.
    pub rule: LrRule,
}

impl Objective for LrAwareGoodput {
    fn name(&self) -> &'static str {
        "lr-aware"
    }
    fn efficiency(&self, batch: f64, b0: f64, phi: f64) -> f64 {
        let x = self.x0 * self.rule.factor(batch, b0, Some(phi));
        let at_b0 = progress_per_step(self.x0, phi, b0) / b0;
        let here = progress_per_step(x, phi, batch).max(0.0) / batch;
        if at_b0 > 0.0 { here / at_b0 } else { 0.0 }
    }
}

/// Progress under an LR rule from a reference rate tuned at B0 for the current noise: the rate
/// at B0 is the quadratic model's best there, `x0 = 1 / (1 + phi / B0)` (so at B0 the
/// efficiency is 1 whatever phi), and the rule scales it to other batches. Unlike
/// [`LrAwareGoodput`] with a fixed `x0`, the reference never overshoots as phi grows; this is
/// the truth "training under the LR rule at the reference-tuned rate".
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct LrTunedGoodput {
    /// How the run scales the learning rate with the batch.
    pub rule: LrRule,
}

impl Objective for LrTunedGoodput {
    fn name(&self) -> &'static str {
        "lr-tuned"
    }
    fn efficiency(&self, batch: f64, b0: f64, phi: f64) -> f64 {
        let x0 = 1.0 / (1.0 + phi.max(0.0) / b0);
        let x = x0 * self.rule.factor(batch, b0, Some(phi));
        let at_b0 = progress_per_step(x0, phi, b0) / b0;
        let here = progress_per_step(x, phi, batch).max(0.0) / batch;
        if at_b0 > 0.0 { here / at_b0 } else { 0.0 }
    }
}

/// Which objective a recipe asks for.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub enum ObjectiveKind {
    /// [`PlainGoodput`]: the learning rate assumed tuned at every batch.
    Plain,
    /// [`LrAwareGoodput`]: progress at the rate `rule` gives from a fixed base rate.
    LrAware {
        /// `x0 = lr0 / lr_max` at B0: the base learning rate over the largest useful one.
        x0: f64,
        /// How the run scales the learning rate with the batch.
        rule: LrRule,
    },
    /// [`LrTunedGoodput`]: progress at the rate `rule` gives from a rate tuned at B0.
    LrTuned {
        /// How the run scales the learning rate with the batch.
        rule: LrRule,
    },
}

impl ObjectiveKind {
    /// The objective consistent with training under `rule` from a rate tuned at B0: progress
    /// at the rate the rule gives ([`LrTunedGoodput`]); plain Goodput for AdaScale, whose gain
    /// is the rate re-tuned for the batch that plain Goodput assumes.
    pub fn for_rule(rule: LrRule) -> Self {
        match rule {
            LrRule::AdaScale => ObjectiveKind::Plain,
            rule => ObjectiveKind::LrTuned { rule },
        }
    }

    /// The objective this kind names, with its settings.
    pub fn build(self) -> Box<dyn Objective> {
        match self {
            ObjectiveKind::Plain => Box::new(PlainGoodput),
            ObjectiveKind::LrAware { x0, rule } => Box::new(LrAwareGoodput { x0, rule }),
            ObjectiveKind::LrTuned { rule } => Box::new(LrTunedGoodput { rule }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// At B0 the tuned rate gives efficiency 1 at any noise; with a rule that matches the
    /// quadratic model's best rate at every batch (what plain Goodput assumes) it equals plain
    /// Goodput; with sqrt scaling it is below plain Goodput away from B0, by hand at one point.
    #[test]
    fn the_tuned_reference_never_overshoots() {
        let sqrt = LrTunedGoodput { rule: LrRule::Sqrt };
        for phi in [1.0, 16.0, 256.0, 4096.0] {
            assert!((sqrt.efficiency(16.0, 16.0, phi) - 1.0).abs() < 1e-12, "phi {phi}");
            assert!(sqrt.efficiency(64.0, 16.0, phi) > 0.0, "phi {phi}");
        }
        // phi = 16, B0 = 16, B = 64: x0 = 1/2, x = 1; progress 2 - (1 + 1/4) = 0.75 per step,
        // 0.75 / 64 per sample; at B0: 0.5 / 16. Ratio 0.375; plain: 32 / 80 = 0.4.
        assert!((sqrt.efficiency(64.0, 16.0, 16.0) - 0.375).abs() < 1e-12);
        assert!(sqrt.efficiency(64.0, 16.0, 16.0) < PlainGoodput.efficiency(64.0, 16.0, 16.0));
    }

    #[test]
    fn efficiency_equals_adaptdl_gain_over_scale() {
        // AdaptDL: var = tr(Sigma) / B0 (gradient variance at B0), sqr = |G|^2, s = B / B0,
        // gain(s) = (var + sqr) / (var / s + sqr), efficiency = gain / s.
        for &(trace, grad_sq) in &[(100.0, 2.0), (3.0, 0.5), (1e4, 1e-3)] {
            for &(b0, b) in &[(8.0, 8.0), (8.0, 64.0), (32.0, 512.0), (4.0, 6.0)] {
                let var = trace / b0;
                let s: f64 = b / b0;
                let gain = (var + grad_sq) / (var / s + grad_sq);
                let se = statistical_efficiency(b, b0, trace / grad_sq);
                assert!((se - gain / s).abs() < 1e-12, "{se} vs {}", gain / s);
                // AdaScale's gain is that same gain.
                assert!((LrRule::AdaScale.factor(b, b0, Some(trace / grad_sq)) - gain).abs() < 1e-9);
            }
        }
    }

    #[test]
    fn efficiency_by_hand() {
        // phi = 56, B0 = 8, B = 120: (56 + 8) / (56 + 120) = 64 / 176.
        assert!((statistical_efficiency(120.0, 8.0, 56.0) - 64.0 / 176.0).abs() < 1e-15);
        assert_eq!(statistical_efficiency(8.0, 8.0, 56.0), 1.0);
        assert_eq!(PlainGoodput.goodput(1000.0, 120.0, 8.0, 56.0), 1000.0 * 64.0 / 176.0);
    }

    #[test]
    fn lr_rules() {
        assert_eq!(LrRule::Sqrt.factor(32.0, 8.0, None), 2.0);
        assert_eq!(LrRule::Linear.factor(32.0, 8.0, None), 4.0);
        assert_eq!(LrRule::Constant.factor(32.0, 8.0, None), 1.0);
        assert_eq!(LrRule::AdaScale.factor(32.0, 8.0, None), 1.0);
    }

    #[test]
    fn lr_aware_matches_plain_at_the_optimal_rate() {
        // The quadratic model's best x at batch B is B / (B + phi); then progress/step = B/(B+phi),
        // so progress per sample relative to B0 is (phi + B0) / (phi + B): plain SE.
        let (b0, phi) = (16.0, 200.0);
        for b in [16.0, 64.0, 256.0, 2048.0] {
            let x = b / (b + phi);
            let x0 = b0 / (b0 + phi);
            let rel = (progress_per_step(x, phi, b) / b) / (progress_per_step(x0, phi, b0) / b0);
            assert!((rel - statistical_efficiency(b, b0, phi)).abs() < 1e-12);
        }
    }

    #[test]
    fn lr_aware_charges_unstable_rates() {
        // x0 = 0.5 and linear scaling to 4x gives x = 2: 2x - x^2(1 + phi/B) < 0, no progress.
        let o = LrAwareGoodput { x0: 0.5, rule: LrRule::Linear };
        assert_eq!(o.efficiency(64.0, 16.0, 10.0), 0.0);
        assert!((o.efficiency(16.0, 16.0, 10.0) - 1.0).abs() < 1e-12);
        // From a conservative x0, progress per step is about 2x, so with sqrt scaling a sample at
        // 4x the batch is worth about sqrt(1/4) of one at B0, below plain SE (0.95 here).
        let s = LrAwareGoodput { x0: 0.001, rule: LrRule::Sqrt };
        let e = s.efficiency(64.0, 16.0, 1000.0);
        assert!((e - 0.5).abs() < 0.02, "{e}");
        assert!(e < PlainGoodput.efficiency(64.0, 16.0, 1000.0));
    }
}
