//! The statistics the headline reports, each small enough to check by hand: the time a loss
//! curve crosses a target (interpolated between evaluations), paired time ratios with a
//! bootstrap interval over seeds, and the fit that picks the objective whose statistical
//! efficiency predicts a fixed-batch sweep's times to target.

use copus_core::goodput::{LrRule, Objective, ObjectiveKind};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};

/// The first time the curve `evals` (time, loss; in time order) is at or below `target`,
/// linearly interpolated between the last evaluation above and the first at or below it;
/// `None` if it never gets there. An evaluation at time 0 already below the target crosses at 0.
pub fn crossing_time(evals: &[(f64, f64)], target: f64) -> Option<f64> {
    let first = evals.iter().position(|&(_, l)| l <= target)?;
    if first == 0 {
        return Some(evals[0].0);
    }
    let ((t0, l0), (t1, l1)) = (evals[first - 1], evals[first]);
    // l0 > target >= l1, so the denominator is positive.
    Some(t0 + (t1 - t0) * (l0 - target) / (l0 - l1))
}

/// The geometric mean of positive numbers (NaN for none).
pub fn geometric_mean(xs: &[f64]) -> f64 {
    (xs.iter().map(|x| x.ln()).sum::<f64>() / xs.len() as f64).exp()
}

/// A ratio's point estimate and its bootstrap interval.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct RatioInterval {
    /// The geometric mean of the paired ratios.
    pub ratio: f64,
    /// Lower end of the 95% percentile-bootstrap interval.
    pub low: f64,
    /// Upper end.
    pub high: f64,
    /// Seeds paired.
    pub n: usize,
}

/// The geometric mean of paired ratios (one per seed) and its 95% percentile-bootstrap interval
/// over seeds: `reps` resamples of the seeds with replacement, the 2.5th and 97.5th percentiles
/// of their geometric means (the resampled values at ranks `floor(0.025 (reps - 1))` and
/// `ceil(0.975 (reps - 1))`). `None` without a ratio or with a non-positive one.
pub fn paired_ratio(ratios: &[f64], reps: usize, seed: u64) -> Option<RatioInterval> {
    if ratios.is_empty() || ratios.iter().any(|r| !(r.is_finite() && *r > 0.0)) || reps == 0 {
        return None;
    }
    let logs: Vec<f64> = ratios.iter().map(|r| r.ln()).collect();
    let n = logs.len();
    let mean = |xs: &mut dyn Iterator<Item = f64>| xs.sum::<f64>() / n as f64;
    let ratio = geometric_mean(ratios);
    let mut rng = StdRng::seed_from_u64(seed);
    let mut means: Vec<f64> = (0..reps).map(|_| mean(&mut (0..n).map(|_| logs[rng.random_range(0..n)])).exp()).collect();
    means.sort_by(f64::total_cmp);
    let at = |q: f64, up: bool| {
        let i = q * (reps - 1) as f64;
        means[if up { i.ceil() } else { i.floor() } as usize]
    };
    Some(RatioInterval { ratio, low: at(0.025, false), high: at(0.975, true), n })
}

/// One arm of a fixed-batch sweep: its batch, measured samples/s and time to a target.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct SweepPoint {
    /// Global batch (sequences).
    pub global_batch: usize,
    /// Measured samples/s of the arm's configuration.
    pub samples_per_sec: f64,
    /// Seconds to the target (mean over seeds).
    pub time_to_target: f64,
}

/// How well one objective predicts a sweep.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct ObjectiveFit {
    /// The objective.
    pub objective: ObjectiveKind,
    /// The best-fitting effective noise scale (B_simple held constant over the run).
    pub phi: f64,
    /// Root mean square of log(predicted / measured time) at that noise scale.
    pub rms_log_error: f64,
}

/// The candidate objectives of the fit: plain Goodput (a rate re-tuned at every batch), the
/// LR-tuned objective under the sqrt and linear rules, and AdaScale's gain as the rate rule.
pub fn candidate_objectives() -> Vec<ObjectiveKind> {
    vec![
        ObjectiveKind::Plain,
        ObjectiveKind::LrTuned { rule: LrRule::Sqrt },
        ObjectiveKind::LrTuned { rule: LrRule::Linear },
        ObjectiveKind::LrTuned { rule: LrRule::AdaScale },
    ]
}

/// Fits each objective to a sweep: the time to target of batch B predicted as
/// `K / (samples_per_sec(B) * efficiency(B; b0, phi))`, with K (a scale: the reference samples
/// the target needs) fitted in closed form on the log scale and phi searched on a log grid
/// (0.25 to 65536 sequences, 1/16 of an octave apart). The fits come back best first (smallest
/// `rms_log_error`); an objective that cannot fit (no progress at some batch) is left out.
/// Needs at least three points of at least two batches.
pub fn fit_objectives(sweep: &[SweepPoint], b0: f64, objectives: &[ObjectiveKind]) -> Option<Vec<ObjectiveFit>> {
    let ok =
        |p: &SweepPoint| p.samples_per_sec > 0.0 && p.time_to_target > 0.0 && p.samples_per_sec.is_finite() && p.time_to_target.is_finite();
    let mut batches: Vec<usize> = sweep.iter().map(|p| p.global_batch).collect();
    batches.dedup();
    if sweep.len() < 3 || batches.len() < 2 || !sweep.iter().all(ok) || b0.is_nan() || b0 <= 0.0 {
        return None;
    }
    let mut fits: Vec<ObjectiveFit> = objectives
        .iter()
        .map(|&kind| {
            let o = kind.build();
            let mut best = ObjectiveFit { objective: kind, phi: f64::NAN, rms_log_error: f64::INFINITY };
            for k in -32..=256 {
                let phi = 2f64.powf(k as f64 / 16.0);
                if let Some(rms) = rms_at(o.as_ref(), sweep, b0, phi)
                    && rms < best.rms_log_error
                {
                    best = ObjectiveFit { objective: kind, phi, rms_log_error: rms };
                }
            }
            best
        })
        .collect();
    // An objective that gives no progress at some batch of the sweep at every noise scale
    // cannot fit it.
    fits.retain(|f| f.rms_log_error.is_finite());
    fits.sort_by(|a, b| a.rms_log_error.total_cmp(&b.rms_log_error));
    Some(fits)
}

/// The fit's error at one noise scale: residuals of log time against log of `1 / (throughput *
/// efficiency)`, less their mean (the closed-form log K).
fn rms_at(o: &dyn Objective, sweep: &[SweepPoint], b0: f64, phi: f64) -> Option<f64> {
    let residuals: Vec<f64> = sweep
        .iter()
        .map(|p| {
            let e = o.efficiency(p.global_batch as f64, b0, phi);
            (e > 0.0).then(|| p.time_to_target.ln() + (p.samples_per_sec * e).ln())
        })
        .collect::<Option<_>>()?;
    let n = residuals.len() as f64;
    let mean = residuals.iter().sum::<f64>() / n;
    Some((residuals.iter().map(|r| (r - mean).powi(2)).sum::<f64>() / n).sqrt())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crossings_by_hand() {
        // 10 s at 6.4, 20 s at 5.9: 6.0 is 0.4 of the 0.5 drop down, at 18 s.
        let evals = [(0.0, 8.0), (10.0, 6.4), (20.0, 5.9), (30.0, 5.5)];
        assert!((crossing_time(&evals, 6.0).unwrap() - 18.0).abs() < 1e-12);
        assert_eq!(crossing_time(&evals, 5.5), Some(30.0));
        assert_eq!(crossing_time(&evals, 5.4), None);
        assert_eq!(crossing_time(&evals, 9.0), Some(0.0));
        // A curve that goes back up after crossing: the first crossing counts.
        let bumpy = [(0.0, 7.0), (4.0, 5.0), (8.0, 6.5)];
        assert!((crossing_time(&bumpy, 6.0).unwrap() - 2.0).abs() < 1e-12);
    }

    #[test]
    fn bootstrap_by_hand() {
        // Equal ratios: no spread.
        let r = paired_ratio(&[0.8, 0.8, 0.8], 500, 1).unwrap();
        assert!((r.ratio - 0.8).abs() < 1e-12 && (r.low - 0.8).abs() < 1e-12 && (r.high - 0.8).abs() < 1e-12);
        // Two seeds, ratios 1 and 4: geometric mean 2; a resample is {1,1} (mean 1) with
        // probability 1/4, {4,4} (mean 4) with 1/4, else 2, so the 2.5th and 97.5th percentiles
        // of 4000 resamples are 1 and 4.
        let r = paired_ratio(&[1.0, 4.0], 4000, 7).unwrap();
        assert!((r.ratio - 2.0).abs() < 1e-12, "{r:?}");
        assert!((r.low - 1.0).abs() < 1e-12 && (r.high - 4.0).abs() < 1e-12, "{r:?}");
        assert_eq!(r.n, 2);
        assert!(paired_ratio(&[], 10, 1).is_none());
        assert!(paired_ratio(&[1.0, -1.0], 10, 1).is_none());
        // The same seed gives the same interval.
        let xs = [0.7, 0.9, 0.85, 1.1, 0.6];
        assert_eq!(paired_ratio(&xs, 1000, 3), paired_ratio(&xs, 1000, 3));
        let r = paired_ratio(&xs, 1000, 3).unwrap();
        assert!(r.low < r.ratio && r.ratio < r.high && r.low >= 0.6 && r.high <= 1.1, "{r:?}");
    }

    /// A sweep made from one objective at a known noise scale is fitted back to that objective
    /// and noise scale, with no error; the others fit worse. (B_g 2 is left out: at this noise
    /// the sqrt rule's rate there makes no progress, an infinite time.)
    #[test]
    fn the_fit_recovers_the_objective_that_made_the_sweep() {
        let truth = ObjectiveKind::LrTuned { rule: LrRule::Sqrt };
        let (b0, phi) = (16.0, 32.0);
        let o = truth.build();
        let sweep: Vec<SweepPoint> = [(4usize, 24.0), (8, 27.0), (16, 29.0), (32, 30.0), (64, 30.5)]
            .iter()
            .map(|&(b, t)| SweepPoint {
                global_batch: b,
                samples_per_sec: t,
                time_to_target: 5000.0 / (t * o.efficiency(b as f64, b0, phi)),
            })
            .collect();
        let fits = fit_objectives(&sweep, b0, &candidate_objectives()).unwrap();
        assert_eq!(fits[0].objective, truth);
        assert!((fits[0].phi - phi).abs() < 1e-9, "{:?}", fits[0]);
        assert!(fits[0].rms_log_error < 1e-9);
        assert!(fits[1].rms_log_error > 1e-3, "{fits:?}");
        assert!(fit_objectives(&sweep[..2], b0, &candidate_objectives()).is_none());
    }

    /// The fit on the headline's stored sweep (`testdata/sweep-shakespeare-tiny.json`: each
    /// fixed arm's B_g, profiled samples/s and mean time to each target, as the headline
    /// logged them in `results.json` and the profile) gives back the fits its `report.md`
    /// printed (B_simple to 0.1, the error to 0.001).
    #[test]
    fn the_fit_on_the_stored_sweep_is_reproducible() {
        #[derive(Deserialize)]
        struct Stored {
            b0: f64,
            targets: Vec<Target>,
        }
        #[derive(Deserialize)]
        struct Target {
            loss: f64,
            sweep: Vec<SweepPoint>,
            fits: Vec<ObjectiveFit>,
        }
        let stored: Stored = serde_json::from_str(include_str!("testdata/sweep-shakespeare-tiny.json")).unwrap();
        assert!(!stored.targets.is_empty());
        for t in &stored.targets {
            let fits = fit_objectives(&t.sweep, stored.b0, &candidate_objectives()).unwrap();
            assert_eq!(fits.len(), t.fits.len(), "target {}", t.loss);
            for want in &t.fits {
                let got = fits.iter().find(|f| f.objective == want.objective).unwrap();
                assert!((got.phi - want.phi).abs() <= 0.05 + 1e-9, "target {}: {got:?} vs {want:?}", t.loss);
                assert!((got.rms_log_error - want.rms_log_error).abs() <= 5e-4 + 1e-9, "target {}: {got:?} vs {want:?}", t.loss);
            }
            // The winner is the stored one (up to a tie within the printed precision).
            assert!((fits[0].rms_log_error - t.fits[0].rms_log_error).abs() <= 5e-4 + 1e-9, "target {}: {fits:?}", t.loss);
        }
    }
}
