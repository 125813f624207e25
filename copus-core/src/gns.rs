//! Gradient noise scale (McCandlish et al. 2018), measured online.
//!
//! A gradient averaged over B samples has `E|g_B|^2 = |G|^2 + tr(Sigma) / B`. Two batch sizes
//! give two equations; per step the probe supplies both: the mean squared norm `L` of the
//! `n` micro-batch gradients (size `B_m`) and the squared norm `T` of their mean (size `n B_m`):
//!
//! `|G|^2 ~ (n T - L) / (n - 1)`, `tr(Sigma) ~ B_m n (L - T) / (n - 1)`, `B_simple = tr(Sigma) / |G|^2`.
//!
//! Numerator and denominator are smoothed separately with a bias-corrected EMA, then divided.
//! With [`Memory::Adaptive`] the smoothed estimate reaches further back while the noise scale
//! holds still: a second, long average is kept beside the EMA and reported while the two agree,
//! and restarted from the EMA when they part (see [`Memory`]).
//! With one micro-batch per step (n = 1) consecutive steps are differenced instead:
//! `E|g_t - g_{t-1}|^2 = tr(Sigma) (1/B_t + 1/B_{t-1})` and `E[g_t . g_{t-1}] = |G|^2`, which
//! holds only while G stays put between steps, so such estimates are marked biased.

use serde::{Deserialize, Serialize};
use thiserror::Error;

/// Bad numbers handed to the estimator.
#[derive(Clone, Debug, PartialEq, Error)]
pub enum GnsError {
    /// A norm is negative, NaN or infinite.
    #[error("`{field}` must be a finite number >= 0, got {value}")]
    BadNorm {
        /// The norm at fault, as the input names it (`sq_small`, `grad_sq_norm`, ...).
        field: &'static str,
        /// The value given.
        value: f64,
    },
    /// A batch size is zero, or the two sizes are equal.
    #[error("batch sizes must be positive and different, got small = {small}, big = {big}")]
    BadBatches {
        /// The small batch size: B_m online, `b_small` offline.
        small: f64,
        /// The big batch size: B_g = B_m * n online, `b_big` offline.
        big: f64,
    },
    /// EMA factor outside [0, 1).
    #[error("`theta` must be in [0, 1), got {0}")]
    BadTheta(f64),
    /// An adaptive memory shorter than the EMA's, or not finite.
    #[error("an adaptive memory's `max_steps` must be finite and at least the EMA's 1 / (1 - theta) = {ema}, got {value}")]
    BadMemory {
        /// The `max_steps` given.
        value: f64,
        /// The EMA's memory, 1 / (1 - theta).
        ema: f64,
    },
}

/// One estimate of the gradient's signal and noise.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct NoiseEstimate {
    /// |G|^2, squared norm of the true gradient.
    pub grad_sq: f64,
    /// tr(Sigma), trace of the per-sample gradient covariance.
    pub trace: f64,
    /// Whether the estimate came from differencing steps (biased when G drifts).
    pub biased: bool,
    /// Standard error of `grad_sq` (0: exact or not known); for a smoothed estimate, from the
    /// spread of the raw estimates it averages.
    #[serde(default)]
    pub grad_sq_se: f64,
    /// Standard error of `trace`, likewise.
    #[serde(default)]
    pub trace_se: f64,
}

impl NoiseEstimate {
    /// `B_simple = tr(Sigma) / |G|^2`; `None` while |G|^2 is not positive (noise dominates the
    /// measurement), which callers treat as "very large".
    pub fn b_simple(&self) -> Option<f64> {
        (self.grad_sq > 0.0 && self.trace >= 0.0).then(|| self.trace / self.grad_sq)
    }

    /// The range of B_simple within `z` standard errors of |G|^2 and tr(Sigma): `(low, high)`,
    /// the smallest tr over the largest |G|^2 and the other way round. `high` is infinite while
    /// |G|^2 may be zero; an estimate whose |G|^2 is non-positive even `z` standard errors up
    /// bounds nothing (`None`). This is informative where the point estimate is not: at a
    /// small batch under large noise the smoothed |G|^2 is often non-positive, yet its upper
    /// end bounds B_simple from below.
    pub fn b_simple_band(&self, z: f64) -> Option<(f64, f64)> {
        let z = z.max(0.0);
        let (g_hi, g_lo) = (self.grad_sq + z * self.grad_sq_se.max(0.0), self.grad_sq - z * self.grad_sq_se.max(0.0));
        let (t_lo, t_hi) = ((self.trace - z * self.trace_se.max(0.0)).max(0.0), self.trace + z * self.trace_se.max(0.0));
        if !(g_hi > 0.0 && t_hi.is_finite()) {
            return None;
        }
        Some((t_lo / g_hi, if g_lo > 0.0 { t_hi / g_lo } else { f64::INFINITY }))
    }
}

fn check_norm(field: &'static str, value: f64) -> Result<f64, GnsError> {
    if value.is_finite() && value >= 0.0 { Ok(value) } else { Err(GnsError::BadNorm { field, value }) }
}

/// The two-batch-size estimator: mean squared norms `sq_small` at batch `b_small` and `sq_big`
/// at `b_big` (offline: averages over many batches of each size; online: one step's L and T).
pub fn two_batch_estimate(b_small: f64, sq_small: f64, b_big: f64, sq_big: f64) -> Result<NoiseEstimate, GnsError> {
    if !(b_small > 0.0 && b_big > 0.0 && b_small != b_big && b_small.is_finite() && b_big.is_finite()) {
        return Err(GnsError::BadBatches { small: b_small, big: b_big });
    }
    let sq_small = check_norm("sq_small", sq_small)?;
    let sq_big = check_norm("sq_big", sq_big)?;
    let grad_sq = (b_big * sq_big - b_small * sq_small) / (b_big - b_small);
    let trace = (sq_small - sq_big) / (1.0 / b_small - 1.0 / b_big);
    Ok(NoiseEstimate { grad_sq, trace, biased: false, grad_sq_se: 0.0, trace_se: 0.0 })
}

/// What the probe measured in one optimizer step (after un-scaling, before clipping, with the
/// loss normalised the same way at both sizes: each norm is that of a mean gradient).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct StepStats {
    /// Samples per micro-batch, B_m.
    pub micro_batch: usize,
    /// Micro-batches in the step over all dp ranks, n = B_g / B_m.
    pub num_micro: usize,
    /// L: mean over micro-batches of |g_k|^2, each g_k the mean gradient of micro-batch k.
    pub mean_micro_sq_norm: f64,
    /// T: |g|^2 of the step's mean gradient (after the dp reduction).
    pub grad_sq_norm: f64,
    /// |g_t - g_{t-1}|^2 against the previous step's mean gradient, when the probe keeps it;
    /// used only when n == 1.
    pub diff_sq_norm: Option<f64>,
}

/// Bias-corrected exponential moving average (also smooths step costs in `accumulation`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub(crate) struct Ema {
    biased: f64,
    weight: f64,
}

impl Ema {
    pub(crate) fn update(&mut self, theta: f64, x: f64) {
        self.biased = theta * self.biased + (1.0 - theta) * x;
        self.weight = theta * self.weight + (1.0 - theta);
    }
    pub(crate) fn value(&self) -> Option<f64> {
        (self.weight > 0.0).then(|| self.biased / self.weight)
    }
}

/// How far back the smoothed estimate reaches.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub enum Memory {
    /// The EMA alone: about `1 / (1 - theta)` steps, however still the noise scale holds.
    #[default]
    Fixed,
    /// Beside the EMA, a long average of the raw estimates that forgets `1 / max_steps` per
    /// step (so it grows like a plain mean of every step since its start, up to about
    /// `max_steps`), reported while the EMA agrees with it: while the noise scale holds still
    /// its standard error keeps shrinking, where the EMA's stays that of ~20 steps. Each step,
    /// for |G|^2 and tr(Sigma) alike, the difference of the two is compared with its own
    /// standard error (`sd sqrt(1/n_ema - 1/n_long)`: the long average holds the EMA's steps);
    /// beyond `RESTART_Z` of them the long average is restarted from the EMA (the same mean,
    /// spread and effective count). A noise scale that moves is followed with a lag: until a
    /// restart the long average trails it by up to `RESTART_Z` of the EMA's standard errors
    /// while reporting its own, smaller standard error (a slow drift is read as more certain
    /// than it is); after one, the EMA's summary keeps its weight (fading by `1 / max_steps` a
    /// step), so while the EMA keeps moving the long average trails it and restarts again once
    /// it holds twice the EMA's count (a 4x jump of the trace: two restarts, 40 steps).
    ///
    /// Why: at a small B_g the EMA's band of B_simple is wide and wanders; a rule reading it
    /// over thousands of steps sees its chance excursions as often as it looks, however it
    /// confirms them. The long average's band narrows with the time spent at a still noise
    /// scale, so such excursions become rare without slowing the reaction to a real change
    /// beyond the restart's lag.
    Adaptive {
        /// The longest memory, in steps (at least the EMA's).
        max_steps: f64,
    },
}

/// Standard errors by which the EMA and the long average of [`Memory::Adaptive`] may differ
/// before the long average restarts (a false restart, about one per few thousand steps, only
/// shortens the memory for a while).
pub const RESTART_Z: f64 = 4.0;

/// A weighted average of the raw estimates (|G|^2, tr(Sigma)) with its spread: sums of the
/// weights, their squares, and the weighted values and squared values. Every weight decays by
/// the same factor per step and a new step enters with weight 1, so the mean is a
/// bias-corrected EMA and `(sum w)^2 / sum w^2` its effective count of observations.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
struct Window {
    w: f64,
    w2: f64,
    y: [f64; 2],
    yy: [f64; 2],
}

impl Window {
    fn push(&mut self, decay: f64, y: [f64; 2]) {
        self.w = decay * self.w + 1.0;
        self.w2 = decay * decay * self.w2 + 1.0;
        for ((sum, sum_sq), y) in self.y.iter_mut().zip(&mut self.yy).zip(y) {
            *sum = decay * *sum + y;
            *sum_sq = decay * *sum_sq + y * y;
        }
    }

    /// A window of `count` equal weights with these means and mean squares (a summary of
    /// another average: the long one restarts from the EMA's).
    fn summary(count: f64, mean: [f64; 2], mean_sq: [f64; 2]) -> Self {
        Self { w: count, w2: count, y: mean.map(|m| m * count), yy: mean_sq.map(|m| m * count) }
    }

    fn count(&self) -> f64 {
        if self.w2 > 0.0 { (self.w * self.w / self.w2).max(1.0) } else { 0.0 }
    }

    fn mean(&self) -> Option<[f64; 2]> {
        (self.w > 0.0).then(|| self.y.map(|y| y / self.w))
    }

    /// Standard errors of the two means: the weighted spread over the effective count.
    fn standard_errors(&self) -> [f64; 2] {
        let (Some(mean), n) = (self.mean(), self.count()) else { return [0.0; 2] };
        if n < 2.0 {
            return [0.0; 2];
        }
        [0, 1].map(|i| ((self.yy[i] / self.w - mean[i] * mean[i]).max(0.0) / n).sqrt())
    }
}

/// Online, smoothed estimator; its state serialises for checkpoints.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct GnsEstimator {
    theta: f64,
    grad_sq: Ema,
    trace: Ema,
    from_differencing: Ema,
    /// (batch, |g|^2) of the previous step, for the n == 1 fallback.
    previous: Option<(f64, f64)>,
    observations: u64,
    /// Second moments of the raw estimates (|G|^2 squared, tr squared), for the standard
    /// errors of the smoothed ones.
    #[serde(default)]
    moments: [Ema; 2],
    /// How far back the reported estimate reaches.
    #[serde(default)]
    memory: Memory,
    /// The long average of [`Memory::Adaptive`] (empty with [`Memory::Fixed`]).
    #[serde(default)]
    long: Window,
    /// Times the long average restarted from the EMA.
    #[serde(default)]
    restarts: u64,
}

impl Default for GnsEstimator {
    fn default() -> Self {
        Self::new(0.95).expect("0.95 is a valid theta")
    }
}

impl GnsEstimator {
    /// An estimator whose EMAs keep `theta` of the old value per step (0.95: about 20 steps).
    pub fn new(theta: f64) -> Result<Self, GnsError> {
        if !(0.0..1.0).contains(&theta) {
            return Err(GnsError::BadTheta(theta));
        }
        Ok(Self {
            theta,
            grad_sq: Ema::default(),
            trace: Ema::default(),
            from_differencing: Ema::default(),
            previous: None,
            observations: 0,
            moments: [Ema::default(); 2],
            memory: Memory::Fixed,
            long: Window::default(),
            restarts: 0,
        })
    }

    /// The same estimator with `memory` (checked against the EMA's own).
    pub fn with_memory(mut self, memory: Memory) -> Result<Self, GnsError> {
        if let Memory::Adaptive { max_steps } = memory {
            let ema = 1.0 / (1.0 - self.theta);
            if !(max_steps.is_finite() && max_steps >= ema) {
                return Err(GnsError::BadMemory { value: max_steps, ema });
            }
        }
        self.memory = memory;
        Ok(self)
    }

    /// How far back the reported estimate reaches.
    pub fn memory(&self) -> Memory {
        self.memory
    }

    /// Times the long average of [`Memory::Adaptive`] restarted from the EMA.
    pub fn restarts(&self) -> u64 {
        self.restarts
    }

    /// Feeds one step; returns that step's raw estimate (`None` for the first n == 1 step or
    /// an n == 1 step without a difference norm).
    pub fn observe(&mut self, s: &StepStats) -> Result<Option<NoiseEstimate>, GnsError> {
        if s.micro_batch == 0 || s.num_micro == 0 {
            return Err(GnsError::BadBatches { small: s.micro_batch as f64, big: (s.micro_batch * s.num_micro) as f64 });
        }
        let t = check_norm("grad_sq_norm", s.grad_sq_norm)?;
        let batch = (s.micro_batch * s.num_micro) as f64;
        let raw = if s.num_micro >= 2 {
            let l = check_norm("mean_micro_sq_norm", s.mean_micro_sq_norm)?;
            Some(two_batch_estimate(s.micro_batch as f64, l, batch, t)?)
        } else {
            let diff = s.diff_sq_norm.map(|d| check_norm("diff_sq_norm", d)).transpose()?;
            match (self.previous, diff) {
                (Some((prev_batch, prev_sq)), Some(diff)) => {
                    let trace = diff / (1.0 / batch + 1.0 / prev_batch);
                    let dot = 0.5 * (t + prev_sq - diff);
                    Some(NoiseEstimate { grad_sq: dot, trace, biased: true, grad_sq_se: 0.0, trace_se: 0.0 })
                }
                _ => None,
            }
        };
        self.previous = Some((batch, t));
        if let Some(e) = raw {
            self.grad_sq.update(self.theta, e.grad_sq);
            self.trace.update(self.theta, e.trace);
            self.from_differencing.update(self.theta, if e.biased { 1.0 } else { 0.0 });
            for (m, x) in self.moments.iter_mut().zip([e.grad_sq * e.grad_sq, e.trace * e.trace]) {
                m.update(self.theta, x);
            }
            self.observations += 1;
            if let Memory::Adaptive { max_steps } = self.memory {
                self.long.push(1.0 - 1.0 / max_steps, [e.grad_sq, e.trace]);
                self.restart_if_parted();
            }
        }
        Ok(raw)
    }

    /// The EMA as a window: its means, mean squares and effective count.
    fn ema_window(&self) -> Option<Window> {
        let mean = [self.grad_sq.value()?, self.trace.value()?];
        let mean_sq = [self.moments[0].value()?, self.moments[1].value()?];
        Some(Window::summary(self.ema_count(), mean, mean_sq))
    }

    /// The EMA's effective count of observations, `(sum w)^2 / sum w^2` of a bias-corrected
    /// EMA of k of them: `(1 + theta)(1 - theta^k) / ((1 - theta)(1 + theta^k))`.
    fn ema_count(&self) -> f64 {
        let th = self.theta;
        let tk = th.powf(self.observations as f64);
        if th == 0.0 { 1.0 } else { ((1.0 + th) * (1.0 - tk) / ((1.0 - th) * (1.0 + tk))).max(1.0) }
    }

    /// Restarts the long average from the EMA where either mean differs from the EMA's by
    /// more than [`RESTART_Z`] standard errors of the difference, `sd sqrt(1/n_ema - 1/n_long)`
    /// with the raw estimates' `sd` from the long average (once the long average holds at least
    /// twice the EMA's count; before, the two are nearly the same steps).
    fn restart_if_parted(&mut self) {
        let Some(ema) = self.ema_window() else { return };
        if self.long.count() < 2.0 * ema.count() {
            return;
        }
        let (Some(a), Some(b)) = (ema.mean(), self.long.mean()) else { return };
        // The spread of the raw estimates from the long average (many more of them than the
        // EMA holds, so the test's own scale is not a noisy one), over the difference's count.
        let sb = self.long.standard_errors();
        let scale = (self.long.count() / ema.count() - 1.0).max(0.0).sqrt();
        let parted = (0..2).any(|i| sb[i] > 0.0 && (a[i] - b[i]).abs() > RESTART_Z * sb[i] * scale);
        if parted {
            self.long = ema;
            self.restarts += 1;
        }
    }

    /// The smoothed estimate so far; biased when differenced steps carry more than 1% of it.
    /// With [`Memory::Adaptive`], the long average's means and standard errors.
    pub fn estimate(&self) -> Option<NoiseEstimate> {
        let biased = self.from_differencing.value()? > 0.01;
        if let (Memory::Adaptive { .. }, Some([g, t])) = (self.memory, self.long.mean()) {
            let [grad_sq_se, trace_se] = self.long.standard_errors();
            return Some(NoiseEstimate { grad_sq: g, trace: t, biased, grad_sq_se, trace_se });
        }
        let (g, t) = (self.grad_sq.value()?, self.trace.value()?);
        let (grad_sq_se, trace_se) = self.standard_errors(g, t);
        Some(NoiseEstimate { grad_sq: g, trace: t, biased, grad_sq_se, trace_se })
    }

    /// Standard errors of the EMA means `g`, `t` of the raw estimates: their spread over the
    /// effective number of observations of a bias-corrected EMA of `k` of them,
    /// `(sum w)^2 / sum w^2 = (1 + theta)(1 - theta^k) / ((1 - theta)(1 + theta^k))`. 0 before
    /// two observations.
    fn standard_errors(&self, g: f64, t: f64) -> (f64, f64) {
        if self.observations < 2 {
            return (0.0, 0.0);
        }
        let [gg, tt] = [self.moments[0], self.moments[1]].map(|m| m.value().unwrap_or(0.0));
        let n = self.ema_count();
        (((gg - g * g).max(0.0) / n).sqrt(), ((tt - t * t).max(0.0) / n).sqrt())
    }

    /// B_simple of the smoothed estimate ([`Self::estimate`]); `None` before the first
    /// estimate or while the smoothed |G|^2 is not positive.
    pub fn b_simple(&self) -> Option<f64> {
        self.estimate()?.b_simple()
    }

    /// Steps that contributed a raw estimate (an n == 1 step without a previous one does not).
    pub fn observations(&self) -> u64 {
        self.observations
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;
    use rand::rngs::StdRng;
    use rand_distr::{Distribution, StandardNormal};

    /// Synthetic per-sample gradients: G fixed, covariance diagonal with known trace.
    struct Synthetic {
        g: Vec<f64>,
        sd: Vec<f64>,
        rng: StdRng,
    }

    impl Synthetic {
        fn new(dim: usize, grad_sq: f64, trace: f64, seed: u64) -> Self {
            let mut rng = StdRng::seed_from_u64(seed);
            // Uneven G and Sigma, scaled to the requested |G|^2 and tr(Sigma).
            let g: Vec<f64> = (0..dim).map(|_| StandardNormal.sample(&mut rng)).collect();
            let gn: f64 = g.iter().map(|x| x * x).sum();
            let g = g.iter().map(|x| x * (grad_sq / gn).sqrt()).collect();
            let var: Vec<f64> = (0..dim).map(|i| 1.0 + (i % 7) as f64).collect();
            let vs: f64 = var.iter().sum();
            let sd = var.iter().map(|v| (v * trace / vs).sqrt()).collect();
            Self { g, sd, rng }
        }
        /// Mean gradient of a batch of `b` samples: G + N(0, Sigma / b).
        fn batch(&mut self, b: usize) -> Vec<f64> {
            let s = (b as f64).sqrt();
            self.g
                .iter()
                .zip(&self.sd)
                .map(|(g, sd)| {
                    let z: f64 = StandardNormal.sample(&mut self.rng);
                    g + sd * z / s
                })
                .collect()
        }
    }

    fn sq(v: &[f64]) -> f64 {
        v.iter().map(|x| x * x).sum()
    }

    fn rel(a: f64, b: f64) -> f64 {
        (a - b).abs() / b.abs()
    }

    #[test]
    fn closed_form_on_exact_expectations() {
        // |G|^2 = 2, tr = 64: E|g_4|^2 = 18, E|g_32|^2 = 4 exactly.
        let e = two_batch_estimate(4.0, 18.0, 32.0, 4.0).unwrap();
        assert!((e.grad_sq - 2.0).abs() < 1e-12 && (e.trace - 64.0).abs() < 1e-9);
        assert!((e.b_simple().unwrap() - 32.0).abs() < 1e-9);
        // The online form with n = 8 micro-batches of 4 is the same equation.
        let mut est = GnsEstimator::new(0.9).unwrap();
        let raw = est
            .observe(&StepStats { micro_batch: 4, num_micro: 8, mean_micro_sq_norm: 18.0, grad_sq_norm: 4.0, diff_sq_norm: None })
            .unwrap()
            .unwrap();
        assert!((raw.grad_sq - 2.0).abs() < 1e-12 && (raw.trace - 64.0).abs() < 1e-9);
        // Bias correction: after one observation the smoothed value is the observation.
        assert!((est.b_simple().unwrap() - 32.0).abs() < 1e-9);
    }

    #[test]
    fn smoothed_online_estimates_land_within_five_percent() {
        let (grad_sq, trace) = (1.5, 120.0);
        let mut syn = Synthetic::new(2000, grad_sq, trace, 7);
        let mut est = GnsEstimator::new(0.95).unwrap();
        let (b_m, n) = (4, 16);
        for _ in 0..300 {
            let micro: Vec<Vec<f64>> = (0..n).map(|_| syn.batch(b_m)).collect();
            let l = micro.iter().map(|g| sq(g)).sum::<f64>() / n as f64;
            let mean: Vec<f64> = (0..micro[0].len()).map(|i| micro.iter().map(|g| g[i]).sum::<f64>() / n as f64).collect();
            est.observe(&StepStats { micro_batch: b_m, num_micro: n, mean_micro_sq_norm: l, grad_sq_norm: sq(&mean), diff_sq_norm: None })
                .unwrap();
        }
        let e = est.estimate().unwrap();
        assert!(!e.biased);
        assert!(rel(e.grad_sq, grad_sq) < 0.05, "|G|^2 {} vs {grad_sq}", e.grad_sq);
        assert!(rel(e.trace, trace) < 0.05, "tr {} vs {trace}", e.trace);
        assert!(rel(e.b_simple().unwrap(), trace / grad_sq) < 0.05);
    }

    #[test]
    fn differencing_fallback_is_marked_biased_and_close_when_g_is_still() {
        let (grad_sq, trace) = (2.0, 100.0);
        let mut syn = Synthetic::new(2000, grad_sq, trace, 11);
        let mut est = GnsEstimator::new(0.95).unwrap();
        let mut prev: Option<Vec<f64>> = None;
        for _ in 0..400 {
            let g = syn.batch(32);
            let diff = prev.as_ref().map(|p| sq(&g.iter().zip(p).map(|(a, b)| a - b).collect::<Vec<_>>()));
            est.observe(&StepStats { micro_batch: 32, num_micro: 1, mean_micro_sq_norm: sq(&g), grad_sq_norm: sq(&g), diff_sq_norm: diff })
                .unwrap();
            prev = Some(g);
        }
        let e = est.estimate().unwrap();
        assert!(e.biased);
        assert_eq!(est.observations(), 399);
        assert!(rel(e.grad_sq, grad_sq) < 0.05, "{}", e.grad_sq);
        assert!(rel(e.trace, trace) < 0.05, "{}", e.trace);
    }

    #[test]
    fn offline_two_batch_estimator_recovers_the_truth() {
        let (grad_sq, trace) = (0.8, 40.0);
        let mut syn = Synthetic::new(1000, grad_sq, trace, 3);
        let mean_sq = |syn: &mut Synthetic, b| (0..400).map(|_| sq(&syn.batch(b))).sum::<f64>() / 400.0;
        let small = mean_sq(&mut syn, 2);
        let big = mean_sq(&mut syn, 64);
        let e = two_batch_estimate(2.0, small, 64.0, big).unwrap();
        assert!(rel(e.grad_sq, grad_sq) < 0.05, "{}", e.grad_sq);
        assert!(rel(e.trace, trace) < 0.05, "{}", e.trace);
    }

    #[test]
    fn bad_inputs_are_errors() {
        assert!(matches!(two_batch_estimate(4.0, 1.0, 4.0, 1.0), Err(GnsError::BadBatches { .. })));
        let mut est = GnsEstimator::default();
        let e = est
            .observe(&StepStats { micro_batch: 4, num_micro: 2, mean_micro_sq_norm: f64::NAN, grad_sq_norm: 1.0, diff_sq_norm: None })
            .unwrap_err();
        assert_eq!(e.to_string(), "`mean_micro_sq_norm` must be a finite number >= 0, got NaN");
        assert!(GnsEstimator::new(1.0).is_err());
        assert_eq!(est.estimate(), None);
        // Noise-dominated measurement: |G|^2 estimate <= 0 gives no B_simple.
        assert_eq!(NoiseEstimate { grad_sq: -0.1, trace: 3.0, biased: false, grad_sq_se: 0.0, trace_se: 0.0 }.b_simple(), None);
    }

    #[test]
    fn a_window_is_the_hand_weighted_average() {
        // Decay 0.5 over 2, 4, 6: weights 0.25, 0.5, 1.
        let mut w = Window::default();
        for y in [2.0, 4.0, 6.0] {
            w.push(0.5, [y, -y]);
        }
        let (ws, ys) = ([0.25, 0.5, 1.0], [2.0, 4.0, 6.0]);
        let sw: f64 = ws.iter().sum();
        let sw2: f64 = ws.iter().map(|w| w * w).sum();
        let mean = ws.iter().zip(ys).map(|(w, y)| w * y).sum::<f64>() / sw;
        let var = ws.iter().zip(ys).map(|(w, y)| w * (y - mean) * (y - mean)).sum::<f64>() / sw;
        let n = sw * sw / sw2;
        assert!((w.mean().unwrap()[0] - mean).abs() < 1e-12 && (w.mean().unwrap()[1] + mean).abs() < 1e-12);
        assert!((w.count() - n).abs() < 1e-12, "{} vs {n}", w.count());
        for se in w.standard_errors() {
            assert!((se - (var / n).sqrt()).abs() < 1e-12, "{se}");
        }
        // A summary of equal weights has that count, mean and spread.
        let s = Window::summary(4.0, [1.0, 2.0], [5.0, 4.0]);
        assert_eq!((s.count(), s.mean()), (4.0, Some([1.0, 2.0])));
        assert_eq!(s.standard_errors(), [(4.0f64 / 4.0).sqrt(), 0.0]);
    }

    /// Raw estimates of one step of `b_m` x `n` at (grad_sq, trace).
    fn feed(est: &mut GnsEstimator, src: &mut Synthetic, b_m: usize, n: usize) {
        let grads: Vec<Vec<f64>> = (0..n).map(|_| src.batch(b_m)).collect();
        let l = grads.iter().map(|g| sq(g)).sum::<f64>() / n as f64;
        let mean: Vec<f64> = (0..grads[0].len()).map(|i| grads.iter().map(|g| g[i]).sum::<f64>() / n as f64).collect();
        est.observe(&StepStats { micro_batch: b_m, num_micro: n, mean_micro_sq_norm: l, grad_sq_norm: sq(&mean), diff_sq_norm: None })
            .unwrap();
    }

    #[test]
    fn an_adaptive_memory_narrows_on_a_still_noise_scale_and_follows_a_jump() {
        let (grad_sq, trace) = (1.0, 400.0);
        let mut fixed = GnsEstimator::new(0.95).unwrap();
        let mut adaptive = GnsEstimator::new(0.95).unwrap().with_memory(Memory::Adaptive { max_steps: 2000.0 }).unwrap();
        // The same draws for both: one source per estimator, same seed.
        let (mut a, mut b) = (Synthetic::new(64, grad_sq, trace, 5), Synthetic::new(64, grad_sq, trace, 5));
        for _ in 0..1500 {
            feed(&mut fixed, &mut a, 4, 4);
            feed(&mut adaptive, &mut b, 4, 4);
        }
        let (f, e) = (fixed.estimate().unwrap(), adaptive.estimate().unwrap());
        // Still: the standard error of the long average (its effective count near 1,300 after
        // 1,500 steps) against the EMA's (count 39), within 3 of them of the truth; no false
        // restart.
        assert!(e.grad_sq_se < 0.35 * f.grad_sq_se, "{} vs {}", e.grad_sq_se, f.grad_sq_se);
        assert!((e.grad_sq - grad_sq).abs() < 3.0 * e.grad_sq_se, "{e:?}");
        assert!((e.trace - trace).abs() < 3.0 * e.trace_se, "{e:?}");
        assert_eq!(adaptive.restarts(), 0);
        // The noise scale jumps 4x: within a few EMA memories the long average has restarted
        // and reads the new trace, as the EMA does.
        let restarts = adaptive.restarts();
        let mut b = Synthetic::new(64, grad_sq, 4.0 * trace, 6);
        for _ in 0..150 {
            feed(&mut adaptive, &mut b, 4, 4);
        }
        let e = adaptive.estimate().unwrap();
        assert!(adaptive.restarts() > restarts);
        assert!(rel(e.trace, 4.0 * trace) < 0.1, "{e:?}");
    }

    #[test]
    fn an_adaptive_memory_shorter_than_the_ema_is_refused() {
        let err = GnsEstimator::new(0.95).unwrap().with_memory(Memory::Adaptive { max_steps: 10.0 }).unwrap_err();
        assert!(err.to_string().contains("max_steps"), "{err}");
        assert!(GnsEstimator::new(0.95).unwrap().with_memory(Memory::Adaptive { max_steps: f64::INFINITY }).is_err());
        // Fixed reports the EMA, the same EMA an adaptive memory keeps beside its long average.
        let mut a = GnsEstimator::new(0.9).unwrap().with_memory(Memory::Adaptive { max_steps: 100.0 }).unwrap();
        let mut b = GnsEstimator::new(0.9).unwrap().with_memory(Memory::Fixed).unwrap();
        let steps = [(9.0, 3.0), (12.0, 2.0), (7.0, 2.5)];
        for (l, t) in steps {
            let s = StepStats { micro_batch: 2, num_micro: 4, mean_micro_sq_norm: l, grad_sq_norm: t, diff_sq_norm: None };
            a.observe(&s).unwrap();
            b.observe(&s).unwrap();
        }
        // By hand: the raw estimates weighted 0.81, 0.9, 1.
        let raw: Vec<NoiseEstimate> = steps.iter().map(|&(l, t)| two_batch_estimate(2.0, l, 8.0, t).unwrap()).collect();
        let hand = |f: fn(&NoiseEstimate) -> f64| raw.iter().zip([0.81, 0.9, 1.0]).map(|(e, w)| w * f(e)).sum::<f64>() / 2.71;
        let (fixed, ema) = (b.estimate().unwrap(), a.ema_window().unwrap().mean().unwrap());
        for (got, want) in
            [(fixed.grad_sq, hand(|e| e.grad_sq)), (fixed.trace, hand(|e| e.trace)), (ema[0], fixed.grad_sq), (ema[1], fixed.trace)]
        {
            assert!((got - want).abs() < 1e-12 * want.abs().max(1.0), "{got} vs {want}");
        }
        // The adaptive one reports its long average instead (weights 0.99^2, 0.99, 1).
        assert!((a.estimate().unwrap().grad_sq - fixed.grad_sq).abs() > 1e-3);
    }

    #[test]
    fn estimator_state_round_trips_through_ron() {
        let mut est = GnsEstimator::new(0.9).unwrap().with_memory(Memory::Adaptive { max_steps: 100.0 }).unwrap();
        est.observe(&StepStats { micro_batch: 2, num_micro: 4, mean_micro_sq_norm: 9.0, grad_sq_norm: 3.0, diff_sq_norm: None }).unwrap();
        let text = ron::to_string(&est).unwrap();
        let back: GnsEstimator = ron::from_str(&text).unwrap();
        assert_eq!(back, est);
    }
}
