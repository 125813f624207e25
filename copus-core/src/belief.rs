//! A structured belief about throughput: how far each candidate's measured samples/s sits from
//! its prior, learned jointly over the families candidates share.
//!
//! The belief models `y(c) = ln(measured(c) / prior(c))` as a sum of family terms, the same
//! families the simulated truth draws its errors from:
//!
//! - one global term (a prior off by a constant factor, another machine);
//! - one per tensor-parallel degree, per pipeline degree and per data-parallel span (within a
//!   node, across nodes);
//! - one per micro-batch size, and one per (micro-batch size, tensor-parallel degree) pair;
//! - one per layout, shared by every B_g and B_m on it;
//! - a smooth trend in `ln(B_g / B_m)` (the count of micro-batches per step), one slope;
//! - a small independent part of each candidate.
//!
//! Each term has a Gaussian prior with the standard deviation its family is given
//! ([`FamilyPriors`]); a measurement window of `n` steps adds one observation of `y(c)` with
//! variance `jitter^2 / n` (the steps' own scatter). Updates are exact Bayesian linear regression
//! as rank-one (Kalman) updates of the weights' mean and covariance, so one measurement informs
//! every candidate that shares a family, and every candidate's prediction carries its own
//! standard error. [`Belief::sample`] draws one joint realisation of every candidate's `y` from
//! the posterior, for Thompson sampling.

use std::collections::BTreeMap;

use rand::Rng;
use rand_distr::{Distribution, StandardNormal};

use crate::candidates::Candidate;

/// Prior standard deviations of each family's terms, on the log scale (0.1 is about 10%).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct FamilyPriors {
    /// The global term shared by every candidate.
    pub global: f64,
    /// One term per tensor-parallel degree.
    pub tp: f64,
    /// One term per pipeline degree.
    pub pp: f64,
    /// One term per data-parallel span: within a node, or across nodes.
    pub dp_span: f64,
    /// One term per micro-batch size.
    pub micro: f64,
    /// One term per (micro-batch size, tensor-parallel degree).
    pub micro_tp: f64,
    /// One term per layout, shared by all its batches.
    pub layout: f64,
    /// The slope of the trend in `ln(B_g / B_m)` (per unit of the centred log).
    pub trend: f64,
    /// Each candidate's own term.
    pub own: f64,
}

impl Default for FamilyPriors {
    fn default() -> Self {
        Self { global: 0.5, tp: 0.2, pp: 0.2, dp_span: 0.15, micro: 0.1, micro_tp: 0.05, layout: 0.1, trend: 0.05, own: 0.03 }
    }
}

/// A family term's key: which weight a candidate's feature vector names.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Term {
    Global,
    Tp(usize),
    Pp(usize),
    /// Data-parallel span: `false` within a node, `true` across nodes (dp > 1 only).
    DpSpan(bool),
    Micro(usize),
    MicroTp(usize, usize),
    Layout(usize, usize, usize),
    Trend,
    Own(usize),
}

/// The posterior over the family terms of a fixed list of candidates.
#[derive(Clone, Debug)]
pub struct Belief {
    candidates: Vec<Candidate>,
    /// Each candidate's sparse feature vector: (weight index, value).
    features: Vec<Vec<(usize, f64)>>,
    /// Posterior mean of the weights.
    mean: Vec<f64>,
    /// Posterior covariance of the weights, row-major `d x d`.
    cov: Vec<f64>,
}

impl Belief {
    /// The prior belief over `candidates`, whose ranks sit `ranks_per_node` to a node (tensor
    /// parallelism inside a node, data parallelism outside it: a replica of `tp * pp` ranks
    /// spans nodes when `dp * tp * pp` exceeds a node).
    pub fn new(candidates: &[Candidate], priors: &FamilyPriors, ranks_per_node: usize) -> Self {
        let per_node = ranks_per_node.max(1);
        let trend_of = |c: &Candidate| (c.global_batch as f64 / c.micro_batch as f64).ln();
        let centre = candidates.iter().map(trend_of).sum::<f64>() / candidates.len().max(1) as f64;
        let mut index: BTreeMap<Term, usize> = BTreeMap::new();
        let mut sd: Vec<f64> = Vec::new();
        let mut slot = |t: Term, s: f64| -> usize {
            *index.entry(t).or_insert_with(|| {
                sd.push(s);
                sd.len() - 1
            })
        };
        let features: Vec<Vec<(usize, f64)>> = candidates
            .iter()
            .enumerate()
            .map(|(i, c)| {
                let d = c.dims;
                let mut x = vec![
                    (slot(Term::Global, priors.global), 1.0),
                    (slot(Term::Tp(d.tp), priors.tp), 1.0),
                    (slot(Term::Pp(d.pp), priors.pp), 1.0),
                    (slot(Term::Micro(c.micro_batch), priors.micro), 1.0),
                    (slot(Term::MicroTp(c.micro_batch, d.tp), priors.micro_tp), 1.0),
                    (slot(Term::Layout(d.dp, d.tp, d.pp), priors.layout), 1.0),
                    (slot(Term::Trend, priors.trend), trend_of(c) - centre),
                    (slot(Term::Own(i), priors.own), 1.0),
                ];
                if d.dp > 1 {
                    x.push((slot(Term::DpSpan(d.world_size() > per_node), priors.dp_span), 1.0));
                }
                x
            })
            .collect();
        let n = sd.len();
        let mut cov = vec![0.0; n * n];
        for (k, s) in sd.iter().enumerate() {
            cov[k * n + k] = s * s;
        }
        Self { candidates: candidates.to_vec(), features, mean: vec![0.0; n], cov }
    }

    /// The number of weights (family terms).
    pub fn terms(&self) -> usize {
        self.mean.len()
    }

    fn position(&self, c: &Candidate) -> Option<usize> {
        self.candidates.iter().position(|d| d == c)
    }

    /// `S x` for the feature vector `x` of candidate `i`.
    fn cov_times(&self, i: usize) -> Vec<f64> {
        let n = self.terms();
        let mut out = vec![0.0; n];
        for &(k, v) in &self.features[i] {
            for (o, s) in out.iter_mut().zip(&self.cov[k * n..(k + 1) * n]) {
                *o += v * s;
            }
        }
        out
    }

    fn dot(&self, i: usize, w: &[f64]) -> f64 {
        self.features[i].iter().map(|&(k, v)| v * w[k]).sum()
    }

    /// Adds one observation of `y(c) = ln(measured / prior)` with `variance` (a window of `n`
    /// steps of scatter `sigma`: `sigma^2 / n`). Observations of non-candidates, non-finite
    /// values and non-positive variances are ignored.
    pub fn observe(&mut self, c: &Candidate, y: f64, variance: f64) {
        let Some(i) = self.position(c) else { return };
        if !(y.is_finite() && variance.is_finite() && variance > 0.0) {
            return;
        }
        let sx = self.cov_times(i);
        let s = self.dot(i, &sx) + variance;
        let innovation = y - self.dot(i, &self.mean);
        let n = self.terms();
        for (m, g) in self.mean.iter_mut().zip(&sx) {
            *m += g * innovation / s;
        }
        for r in 0..n {
            let a = sx[r] / s;
            if a == 0.0 {
                continue;
            }
            for (cv, g) in self.cov[r * n..(r + 1) * n].iter_mut().zip(&sx) {
                *cv -= a * g;
            }
        }
    }

    /// The posterior mean and standard deviation of `y(c)`; `None` for a non-candidate.
    pub fn predict(&self, c: &Candidate) -> Option<(f64, f64)> {
        let i = self.position(c)?;
        let var = self.dot(i, &self.cov_times(i));
        Some((self.dot(i, &self.mean), var.max(0.0).sqrt()))
    }

    /// One joint draw of every candidate's `y` from the posterior (in candidate order): the
    /// weights drawn as `mean + L z` with `L` the Cholesky factor of the covariance.
    pub fn sample(&self, rng: &mut impl Rng) -> Vec<f64> {
        let n = self.terms();
        let l = cholesky(&self.cov, n);
        let z: Vec<f64> = (0..n).map(|_| StandardNormal.sample(rng)).collect();
        let w: Vec<f64> = (0..n).map(|r| self.mean[r] + (0..=r).map(|k| l[r * n + k] * z[k]).sum::<f64>()).collect();
        (0..self.candidates.len()).map(|i| self.dot(i, &w)).collect()
    }
}

/// The lower Cholesky factor of a symmetric positive semi-definite `n x n` matrix; pivots that
/// rounding leaves at or below zero give a zero column (that direction has no uncertainty left).
fn cholesky(a: &[f64], n: usize) -> Vec<f64> {
    let mut l = vec![0.0; n * n];
    for j in 0..n {
        let d = a[j * n + j] - (0..j).map(|k| l[j * n + k] * l[j * n + k]).sum::<f64>();
        if d <= 1e-300 {
            continue;
        }
        let d = d.sqrt();
        l[j * n + j] = d;
        for i in j + 1..n {
            let s = a[i * n + j] - (0..j).map(|k| l[i * n + k] * l[j * n + k]).sum::<f64>();
            l[i * n + j] = s / d;
        }
    }
    l
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::ParallelDims;
    use rand::SeedableRng;
    use rand::rngs::StdRng;

    fn c(dp: usize, tp: usize, pp: usize, b: usize, m: usize) -> Candidate {
        Candidate::new(ParallelDims::new(dp, tp, pp, dp * tp * pp).unwrap(), b, m).unwrap()
    }

    /// Priors with only the named families non-zero.
    fn only(global: f64, own: f64, tp: f64) -> FamilyPriors {
        FamilyPriors { global, tp, pp: 0.0, dp_span: 0.0, micro: 0.0, micro_tp: 0.0, layout: 0.0, trend: 0.0, own }
    }

    /// One candidate, one observation: the scalar conjugate update by hand.
    #[test]
    fn one_observation_is_the_conjugate_update() {
        let a = c(1, 1, 1, 8, 2);
        let p = only(0.5, 0.2, 0.0);
        let mut b = Belief::new(&[a], &p, 8);
        let v0 = 0.5f64 * 0.5 + 0.2 * 0.2;
        let (m, s) = b.predict(&a).unwrap();
        assert!(m.abs() < 1e-15 && (s * s - v0).abs() < 1e-12);
        let (y, r) = (0.3, 0.01);
        b.observe(&a, y, r);
        let (m, s) = b.predict(&a).unwrap();
        assert!((m - v0 / (v0 + r) * y).abs() < 1e-12, "{m}");
        assert!((s * s - v0 * r / (v0 + r)).abs() < 1e-12, "{}", s * s);
    }

    /// Two candidates that share only the global term: measuring one moves the other by the
    /// global term's posterior, by hand: mean a/(a+b+r) y, variance a + b - a^2/(a+b+r).
    #[test]
    fn a_shared_family_carries_a_measurement_to_its_members() {
        let (x, z) = (c(1, 1, 1, 8, 2), c(1, 1, 1, 16, 2));
        let p = only(0.4, 0.1, 0.0);
        let mut b = Belief::new(&[x, z], &p, 8);
        let (a, o, r, y) = (0.16, 0.01, 0.0025, -0.2);
        b.observe(&x, y, r);
        let (m, s) = b.predict(&z).unwrap();
        assert!((m - a / (a + o + r) * y).abs() < 1e-12, "{m}");
        assert!((s * s - (a + o - a * a / (a + o + r))).abs() < 1e-12, "{}", s * s);
        // A candidate of another tp degree shares the global term only when tp has no prior.
        let t2 = c(1, 2, 1, 8, 2);
        let mut wide = Belief::new(&[x, t2], &only(0.4, 0.1, 0.3), 8);
        wide.observe(&x, y, r);
        let (m2, s2) = wide.predict(&t2).unwrap();
        assert!((m2 - a / (a + o + 0.09 + r) * y).abs() < 1e-12, "{m2}");
        assert!(s2 > s, "another tp degree stays less certain: {s2} vs {s}");
    }

    /// Repeated observations shrink the variance as 1/n; the data-parallel span term tells
    /// within-node replicas from across-node ones.
    #[test]
    fn more_steps_mean_more_certainty_and_spans_are_families() {
        let a = c(2, 1, 1, 8, 2);
        let p = only(10.0, 0.0, 0.0);
        let mut b = Belief::new(&[a], &p, 8);
        for _ in 0..4 {
            b.observe(&a, 0.1, 0.04);
        }
        let (m, s) = b.predict(&a).unwrap();
        // By hand: precision 1/100 + 4/0.04, mean (4 * 0.1 / 0.04) / that precision.
        let precision = 1.0 / 100.0 + 4.0 / 0.04;
        assert!((m - 10.0 / precision).abs() < 1e-12 && (s * s - 1.0 / precision).abs() < 1e-12, "{m} {}", s * s);
        let spans = FamilyPriors { dp_span: 0.2, ..only(0.0, 0.0, 0.0) };
        let (near, far) = (c(2, 4, 1, 8, 1), c(4, 4, 1, 8, 1));
        let mut b = Belief::new(&[near, far], &spans, 8);
        b.observe(&near, 0.3, 1e-6);
        assert!((b.predict(&near).unwrap().0 - 0.3).abs() < 1e-4);
        assert!(b.predict(&far).unwrap().0.abs() < 1e-12, "a replica across nodes is another family");
    }

    /// Thompson draws have the posterior's mean and spread.
    #[test]
    fn joint_draws_follow_the_posterior() {
        let cands = [c(1, 1, 1, 8, 2), c(1, 2, 1, 8, 2), c(2, 1, 1, 8, 2), c(1, 1, 2, 16, 4)];
        let mut b = Belief::new(&cands, &FamilyPriors::default(), 2);
        b.observe(&cands[0], 0.2, 0.01);
        let mut rng = StdRng::seed_from_u64(7);
        let n = 20_000;
        let draws: Vec<Vec<f64>> = (0..n).map(|_| b.sample(&mut rng)).collect();
        for (i, x) in cands.iter().enumerate() {
            let (m, s) = b.predict(x).unwrap();
            let mean = draws.iter().map(|d| d[i]).sum::<f64>() / n as f64;
            let var = draws.iter().map(|d| (d[i] - mean).powi(2)).sum::<f64>() / n as f64;
            assert!((mean - m).abs() < 4.0 * s / (n as f64).sqrt() + 1e-9, "{i}: {mean} vs {m}");
            assert!((var.sqrt() / s - 1.0).abs() < 0.05, "{i}: {} vs {s}", var.sqrt());
        }
    }

    /// A structured truth drawn from the families is recovered: after measuring a few
    /// candidates, every unmeasured one is predicted within two posterior standard deviations
    /// of its drawn truth far more often than not, and far better than the prior alone.
    #[test]
    fn a_structured_truth_is_recovered_from_a_few_measurements() {
        let mut cands = Vec::new();
        for (dp, tp, pp) in [(8, 1, 1), (4, 2, 1), (2, 4, 1), (1, 8, 1), (4, 1, 2), (2, 2, 2), (1, 4, 2), (2, 1, 4), (1, 2, 4)] {
            for m in [1, 2, 4] {
                for b in [16, 32, 64] {
                    if b % (dp * m) == 0 {
                        cands.push(c(dp, tp, pp, b, m));
                    }
                }
            }
        }
        let p = FamilyPriors::default();
        let mut within = 0;
        let mut total = 0;
        let (mut err_prior, mut err_post) = (0.0, 0.0);
        for seed in 0..20u64 {
            let mut rng = StdRng::seed_from_u64(seed);
            // The truth: one joint draw from the prior itself.
            let truth = Belief::new(&cands, &p, 4).sample(&mut rng);
            let mut b = Belief::new(&cands, &p, 4);
            let measured: Vec<usize> = (0..cands.len()).step_by(5).collect();
            for &i in &measured {
                let noise: f64 = StandardNormal.sample(&mut rng);
                b.observe(&cands[i], truth[i] + 0.02 * noise, 0.02 * 0.02);
            }
            for (i, x) in cands.iter().enumerate().filter(|(i, _)| !measured.contains(i)) {
                let (m, s) = b.predict(x).unwrap();
                within += usize::from((m - truth[i]).abs() <= 2.0 * s);
                total += 1;
                err_prior += truth[i].powi(2);
                err_post += (m - truth[i]).powi(2);
            }
        }
        let share = within as f64 / total as f64;
        assert!(share > 0.9, "{within} of {total} within two standard deviations");
        assert!(err_post < 0.2 * err_prior, "posterior error {err_post} against the prior's {err_prior}");
    }
}
