//! Single-device batch planning: the accumulation count `k` and micro-batch size `m` by Goodput.
//!
//! On one device an optimizer step of `k` micro-batches of `m` samples costs `k t(m) + o`, where
//! `t(m) = a + b m` is one micro-batch's forward and backward and `o` the optimizer step (plus the
//! per-step probe work). Throughput is `k m / (k t(m) + o)` and Goodput multiplies it by the
//! statistical efficiency of the batch `B = k m`. Bigger batches raise throughput only by
//! amortising `a` (a bigger micro-batch) and `o` (more accumulation), so the best batch on one
//! device grows with the noise scale but stays far below the data-parallel optimum. With a fixed
//! micro-batch and plain Goodput `d/dk = 0` gives `k* = sqrt(o phi / (m t(m)))`.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::gns::Ema;
use crate::goodput::Objective;

/// Seconds of one step's parts: `t(m) = per_micro_batch + per_sample * m`, plus `per_step`.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct StepCost {
    /// Fixed seconds of one micro-batch's forward and backward (launches, framework overhead).
    pub per_micro_batch: f64,
    /// Seconds per sample of forward and backward.
    pub per_sample: f64,
    /// Seconds of the optimizer step and the per-step probe work.
    pub per_step: f64,
}

/// A cost model that cannot be used.
#[derive(Clone, Debug, PartialEq, Error)]
pub enum CostError {
    /// A negative, NaN or infinite part, or a model where a micro-batch takes no time.
    #[error("step cost `{field}` must be a finite number >= 0 (and a micro-batch must take time), got {value}")]
    Bad {
        /// The part of [`StepCost`] at fault (`per_micro_batch`, `per_sample`, `per_step`).
        field: &'static str,
        /// The value it has.
        value: f64,
    },
}

impl StepCost {
    /// Checks that every part is finite and non-negative and a micro-batch costs something.
    pub fn validate(&self) -> Result<(), CostError> {
        for (field, value) in [("per_micro_batch", self.per_micro_batch), ("per_sample", self.per_sample), ("per_step", self.per_step)] {
            if !(value.is_finite() && value >= 0.0) {
                return Err(CostError::Bad { field, value });
            }
        }
        if self.per_micro_batch + self.per_sample <= 0.0 {
            return Err(CostError::Bad { field: "per_sample", value: self.per_sample });
        }
        Ok(())
    }

    /// `t(m)`: seconds of one micro-batch of `m` samples.
    pub fn micro_seconds(&self, m: usize) -> f64 {
        self.per_micro_batch + self.per_sample * m as f64
    }

    /// Seconds of an optimizer step of `plan`.
    pub fn step_seconds(&self, plan: Plan) -> f64 {
        plan.accumulation as f64 * self.micro_seconds(plan.micro_batch) + self.per_step
    }

    /// Samples per second at `plan`.
    pub fn throughput(&self, plan: Plan) -> f64 {
        plan.batch() as f64 / self.step_seconds(plan)
    }

    /// Seconds of an optimizer step of `plan` when `devices` run micro-batches side by side:
    /// `ceil(k / devices)` rounds of `t(m)` (here `t(m)` is one round's time), then `o`.
    pub fn step_seconds_on(&self, plan: Plan, devices: usize) -> f64 {
        plan.accumulation.div_ceil(devices.max(1)) as f64 * self.micro_seconds(plan.micro_batch) + self.per_step
    }
}

/// Micro-batch size and accumulation count of one optimizer step.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Plan {
    /// Samples per micro-batch, `m`.
    pub micro_batch: usize,
    /// Micro-batches per optimizer step, `k`.
    pub accumulation: usize,
}

impl Plan {
    /// The batch of an optimizer step, `k m`.
    pub fn batch(&self) -> usize {
        self.micro_batch * self.accumulation
    }
}

/// A plan with its predicted numbers.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Scored {
    /// The micro-batch size and accumulation count scored.
    pub plan: Plan,
    /// Predicted samples per second.
    pub throughput: f64,
    /// Statistical efficiency relative to the reference batch.
    pub efficiency: f64,
    /// `throughput * efficiency`.
    pub goodput: f64,
}

/// Scores `plan` at noise scale `phi` against the reference batch `b0`.
pub fn score(cost: &StepCost, objective: &dyn Objective, phi: f64, b0: f64, plan: Plan) -> Scored {
    score_on(cost, objective, phi, b0, plan, 1)
}

/// [`score`] with `devices` running micro-batches side by side.
pub fn score_on(cost: &StepCost, objective: &dyn Objective, phi: f64, b0: f64, plan: Plan, devices: usize) -> Scored {
    let throughput = plan.batch() as f64 / cost.step_seconds_on(plan, devices);
    let efficiency = objective.efficiency(plan.batch() as f64, b0, phi);
    Scored { plan, throughput, efficiency, goodput: throughput * efficiency }
}

/// The plan with the highest Goodput among micro-batches `micro_batches` and accumulation counts
/// `1..=max_accumulation` whose batch is at least `min_batch`; ties go to the smaller batch.
/// `None` when no plan qualifies.
pub fn best_plan(
    cost: &StepCost,
    objective: &dyn Objective,
    phi: f64,
    b0: f64,
    micro_batches: &[usize],
    max_accumulation: usize,
    min_batch: usize,
) -> Option<Scored> {
    best_plan_on(cost, objective, phi, b0, micro_batches, max_accumulation, min_batch, 1)
}

/// [`best_plan`] for `devices` running micro-batches side by side: accumulation counts are
/// multiples of `devices` (every round fills every device).
#[allow(clippy::too_many_arguments)]
pub fn best_plan_on(
    cost: &StepCost,
    objective: &dyn Objective,
    phi: f64,
    b0: f64,
    micro_batches: &[usize],
    max_accumulation: usize,
    min_batch: usize,
    devices: usize,
) -> Option<Scored> {
    let devices = devices.max(1);
    let mut best: Option<Scored> = None;
    for &micro_batch in micro_batches.iter().filter(|&&m| m > 0) {
        for accumulation in (devices..=max_accumulation).step_by(devices) {
            let plan = Plan { micro_batch, accumulation };
            if plan.batch() < min_batch {
                continue;
            }
            let s = score_on(cost, objective, phi, b0, plan, devices);
            let better = match &best {
                None => true,
                Some(b) => s.goodput > b.goodput || (s.goodput == b.goodput && plan.batch() < b.plan.batch()),
            };
            if better {
                best = Some(s);
            }
        }
    }
    best
}

/// The continuous optimum of plain Goodput over the accumulation count at a fixed micro-batch,
/// `k* = sqrt(o phi / (m t(m)))` (before rounding and bounds).
pub fn plain_optimal_accumulation(cost: &StepCost, phi: f64, micro_batch: usize) -> f64 {
    (cost.per_step * phi / (micro_batch as f64 * cost.micro_seconds(micro_batch))).sqrt()
}

/// Online step costs: a smoothed time per micro-batch for each size seen, and per optimizer step.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CostTracker {
    theta: f64,
    micro: BTreeMap<usize, Ema>,
    step: Ema,
}

impl CostTracker {
    /// A tracker whose averages keep `theta` of the old value per observation (clamped to [0, 1)).
    pub fn new(theta: f64) -> Self {
        Self { theta: theta.clamp(0.0, 0.999_999), micro: BTreeMap::new(), step: Ema::default() }
    }

    /// One micro-batch of `m` samples took `seconds`; ignores bad numbers.
    pub fn observe_micro(&mut self, m: usize, seconds: f64) {
        if m > 0 && seconds.is_finite() && seconds >= 0.0 {
            self.micro.entry(m).or_default().update(self.theta, seconds);
        }
    }

    /// The per-step work (optimizer, probe) took `seconds`; ignores bad numbers.
    pub fn observe_step(&mut self, seconds: f64) {
        if seconds.is_finite() && seconds >= 0.0 {
            self.step.update(self.theta, seconds);
        }
    }

    /// Micro-batch sizes with a measurement.
    pub fn measured(&self) -> Vec<usize> {
        self.micro.keys().copied().collect()
    }

    /// Smoothed seconds of a micro-batch of `m`, if measured.
    pub fn micro_seconds(&self, m: usize) -> Option<f64> {
        self.micro.get(&m)?.value()
    }

    /// The cost model fitted to the measurements: `t(m) = a + b m` by least squares over the
    /// measured sizes (`a = 0` with one size; `a` and `b` kept non-negative), `o` the smoothed
    /// per-step time. `None` before any micro-batch is measured.
    pub fn model(&self) -> Option<StepCost> {
        let points: Vec<(f64, f64)> = self.micro.iter().filter_map(|(&m, e)| Some((m as f64, e.value()?))).collect();
        let per_step = self.step.value().unwrap_or(0.0);
        let (a, b) = match points.as_slice() {
            [] => return None,
            [(m, t)] => (0.0, t / m),
            _ => {
                let n = points.len() as f64;
                let mx = points.iter().map(|p| p.0).sum::<f64>() / n;
                let my = points.iter().map(|p| p.1).sum::<f64>() / n;
                let sxx: f64 = points.iter().map(|p| (p.0 - mx) * (p.0 - mx)).sum();
                let sxy: f64 = points.iter().map(|p| (p.0 - mx) * (p.1 - my)).sum();
                let b = (sxy / sxx).max(0.0);
                let a = my - b * mx;
                if a >= 0.0 {
                    (a, b)
                } else {
                    // Through the origin instead: b = sum(m t) / sum(m^2).
                    let b = points.iter().map(|p| p.0 * p.1).sum::<f64>() / points.iter().map(|p| p.0 * p.0).sum::<f64>();
                    (0.0, b)
                }
            }
        };
        let cost = StepCost { per_micro_batch: a, per_sample: b, per_step };
        cost.validate().ok().map(|_| cost)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::goodput::PlainGoodput;

    #[test]
    fn best_accumulation_is_the_rounded_closed_form() {
        let cost = StepCost { per_micro_batch: 0.002, per_sample: 0.001, per_step: 0.05 };
        for &phi in &[10.0, 100.0, 1_000.0, 10_000.0] {
            for &m in &[2usize, 8, 32] {
                let k_star = plain_optimal_accumulation(&cost, phi, m);
                let best = best_plan(&cost, &PlainGoodput, phi, 8.0, &[m], 4096, 1).unwrap();
                let k = best.plan.accumulation as f64;
                assert!(k == k_star.floor().max(1.0) || k == k_star.ceil(), "phi {phi} m {m}: k {k} vs k* {k_star}");
            }
        }
    }

    #[test]
    fn best_batch_grows_with_the_noise_scale() {
        let cost = StepCost { per_micro_batch: 0.0, per_sample: 0.001, per_step: 0.032 };
        let mut last = 0;
        for &phi in &[4.0, 16.0, 64.0, 256.0, 1024.0, 4096.0] {
            let b = best_plan(&cost, &PlainGoodput, phi, 4.0, &[2], 1024, 4).unwrap().plan.batch();
            // per_sample m = t(m)/m and o/b = 32 samples: B* = sqrt(32 phi).
            let closed = (32.0 * phi).sqrt();
            assert!((b as f64 - closed).abs() <= 2.0, "phi {phi}: B {b} vs {closed}");
            assert!(b >= last);
            last = b;
        }
        assert!(last > 300);
    }

    #[test]
    fn bigger_micro_batches_win_when_they_amortise_a_fixed_cost() {
        let cost = StepCost { per_micro_batch: 0.01, per_sample: 0.001, per_step: 0.0 };
        let best = best_plan(&cost, &PlainGoodput, 1e6, 8.0, &[4, 8, 16], 8, 8).unwrap();
        assert_eq!(best.plan, Plan { micro_batch: 16, accumulation: 1 });
        // Without noise a sample beyond B0 is wasted: the fastest plan at B = 8 wins
        // (8 / 0.018 s = 444/s against 4 x 2: 286/s, and 16 x 1: 615/s at efficiency 1/2).
        let best = best_plan(&cost, &PlainGoodput, 0.0, 8.0, &[4, 8, 16], 8, 8).unwrap();
        assert_eq!(best.plan, Plan { micro_batch: 8, accumulation: 1 });
        assert!(best_plan(&cost, &PlainGoodput, 1.0, 8.0, &[4], 1, 8).is_none());
    }

    #[test]
    fn more_devices_make_bigger_batches_cheaper() {
        // Rounds of 4 devices: k = 4 costs one round, so throughput rises 4x up to k = 4.
        let cost = StepCost { per_micro_batch: 0.0, per_sample: 0.001, per_step: 0.004 };
        let phi = 200.0;
        let one = best_plan_on(&cost, &PlainGoodput, phi, 8.0, &[8], 64, 8, 1).unwrap();
        let four = best_plan_on(&cost, &PlainGoodput, phi, 8.0, &[8], 64, 8, 4).unwrap();
        assert_eq!(four.plan.accumulation % 4, 0);
        assert!(four.plan.batch() > one.plan.batch(), "{four:?} vs {one:?}");
        // Hand-computed: k = 4 on 4 devices is one round of 8 ms plus 4 ms: 32 / 0.012 s.
        let s = score_on(&cost, &PlainGoodput, phi, 8.0, Plan { micro_batch: 8, accumulation: 4 }, 4);
        assert!((s.throughput - 32.0 / 0.012).abs() < 1e-9);
        assert_eq!(best_plan_on(&cost, &PlainGoodput, phi, 8.0, &[8], 3, 8, 4), None);
    }

    #[test]
    fn tracker_fits_a_linear_cost() {
        let mut t = CostTracker::new(0.5);
        assert!(t.model().is_none());
        for _ in 0..3 {
            t.observe_micro(4, 0.01 + 4.0 * 0.002);
            t.observe_micro(16, 0.01 + 16.0 * 0.002);
            t.observe_step(0.3);
        }
        t.observe_micro(8, f64::NAN);
        let c = t.model().unwrap();
        assert!((c.per_micro_batch - 0.01).abs() < 1e-12 && (c.per_sample - 0.002).abs() < 1e-12);
        assert!((c.per_step - 0.3).abs() < 1e-12);
        assert_eq!(t.measured(), vec![4, 16]);
        let mut one = CostTracker::new(0.9);
        one.observe_micro(8, 0.08);
        let c = one.model().unwrap();
        assert_eq!((c.per_micro_batch, c.per_step), (0.0, 0.0));
        assert!((c.per_sample - 0.01).abs() < 1e-12);
    }

    #[test]
    fn bad_costs_are_refused() {
        let c = StepCost { per_micro_batch: 0.0, per_sample: -1.0, per_step: 0.0 };
        assert!(matches!(c.validate(), Err(CostError::Bad { field: "per_sample", .. })));
        let c = StepCost { per_micro_batch: 0.0, per_sample: 0.0, per_step: 1.0 };
        assert!(c.validate().is_err());
    }
}
