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
//! the posterior (from the prior, [`crate::sim::structured`] draws a simulated truth with it).

use std::collections::BTreeMap;

use rand::Rng;
use rand_distr::{Distribution, StandardNormal};

use crate::candidates::Candidate;

/// Prior standard deviations of each family's terms, on the log scale (0.1 is about 10%).
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
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

impl FamilyPriors {
    /// The sizes this repository measured: the analytic prior's errors on the one machine whose
    /// full profile it holds (copus-core throughput.rs, 60 candidates of tiny-5m on 2 ranks,
    /// [`Self::estimate`]), before the prior's constants were fitted to it, so what a prior
    /// not fitted to the user's machine may err by; the global term is the published table's
    /// spread for a tuned stack (0.25) and the data-parallel span, which 2 ranks cannot tell,
    /// is taken as the tensor-parallel size. The structured truth of the simulated evidence
    /// (recipes/evidence-structured.ron) has these sizes.
    pub fn measured() -> Self {
        Self { global: 0.25, tp: 0.08, pp: 0.19, dp_span: 0.08, micro: 0.13, micro_tp: 0.09, layout: 0.05, trend: 0.02, own: 0.13 }
    }

    /// Every family at 0: a prior that is taken as exact (set the families it is unsure of).
    pub fn none() -> Self {
        Self { global: 0.0, tp: 0.0, pp: 0.0, dp_span: 0.0, micro: 0.0, micro_tp: 0.0, layout: 0.0, trend: 0.0, own: 0.0 }
    }

    /// The family standard deviations one set of measured errors shows, by the method of
    /// moments: `y[i] = ln(measured / prior)` of `candidates[i]` on nodes of `ranks_per_node`
    /// ranks. The families are taken in the belief's order (global, tp, pp, data-parallel span,
    /// micro-batch, micro-batch x tp, layout, trend), each fitted to what the ones before left:
    /// a family's standard deviation is the spread of its groups' mean residuals less what the
    /// residual scatter alone would give them, its groups' means are then removed; the trend is
    /// the slope of the residuals on the centred `ln(B_g / B_m)`, and `own` their final scatter.
    /// The global term is one draw, so its size is `|mean| / 0.8` (the mean absolute value of a
    /// normal is 0.8 standard deviations). A family with one group in the data (or none)
    /// gets 0: the data cannot tell it, and the caller must say what it assumes instead.
    pub fn estimate(candidates: &[Candidate], y: &[f64], ranks_per_node: usize) -> Self {
        let n = candidates.len().min(y.len());
        if n == 0 {
            return Self::none();
        }
        let (candidates, y) = (&candidates[..n], &y[..n]);
        let mean = y.iter().sum::<f64>() / n as f64;
        let mut r: Vec<f64> = y.iter().map(|v| v - mean).collect();
        let per_node = ranks_per_node.max(1);
        let keys: [&TermOf<'_>; 6] = [
            &|c| Some(Term::Tp(c.dims.tp)),
            &|c| Some(Term::Pp(c.dims.pp)),
            &|c| (c.dims.dp > 1).then(|| Term::DpSpan(c.dims.world_size() > per_node)),
            &|c| Some(Term::Micro(c.micro_batch)),
            &|c| Some(Term::MicroTp(c.micro_batch, c.dims.tp)),
            &|c| Some(Term::Layout(c.dims.dp, c.dims.tp, c.dims.pp)),
        ];
        let mut sds = [0.0; 6];
        for (k, key) in keys.iter().enumerate() {
            let mut groups: BTreeMap<Term, (f64, f64)> = BTreeMap::new();
            for (c, v) in candidates.iter().zip(&r) {
                if let Some(t) = key(c) {
                    let g = groups.entry(t).or_default();
                    (g.0, g.1) = (g.0 + v, g.1 + 1.0);
                }
            }
            if groups.len() < 2 {
                continue;
            }
            let members: f64 = groups.values().map(|g| g.1).sum();
            let between = groups.values().map(|g| g.0 * g.0 / g.1).sum::<f64>() / members;
            let scatter = r.iter().map(|v| v * v).sum::<f64>() / n as f64;
            let noise = scatter * groups.len() as f64 / members;
            sds[k] = (between - noise).max(0.0).sqrt();
            for (c, v) in candidates.iter().zip(r.iter_mut()) {
                if let Some(g) = key(c).and_then(|t| groups.get(&t)) {
                    *v -= g.0 / g.1;
                }
            }
        }
        let x: Vec<f64> = candidates.iter().map(|c| (c.global_batch as f64 / c.micro_batch as f64).ln()).collect();
        let xm = x.iter().sum::<f64>() / n as f64;
        let sxx: f64 = x.iter().map(|v| (v - xm).powi(2)).sum();
        let slope = if sxx > 0.0 { x.iter().zip(&r).map(|(a, b)| (a - xm) * b).sum::<f64>() / sxx } else { 0.0 };
        let own = (x.iter().zip(&r).map(|(a, b)| (b - slope * (a - xm)).powi(2)).sum::<f64>() / n as f64).sqrt();
        let [tp, pp, dp_span, micro, micro_tp, layout] = sds;
        Self { global: mean.abs() / 0.8, tp, pp, dp_span, micro, micro_tp, layout, trend: slope.abs(), own }
    }
}

/// The family term of a candidate, if it has one in that family.
type TermOf<'a> = dyn Fn(&Candidate) -> Option<Term> + 'a;

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
}

/// The posterior over the family terms of a fixed list of candidates.
///
/// The weights of the shared families are held as a Gaussian (mean and covariance); each
/// candidate's own term is integrated out in closed form, so the covariance stays the size of
/// the families (tens of terms) whatever the number of candidates. A candidate's measurements
/// enter as one summary, their precision-weighted mean `ybar` with variance `v`; given the
/// weights `w`, its own term is then `k (ybar - x.w)` with `k = own^2 / (own^2 + v)` and
/// variance `(1 - k) own^2`, so its prediction is `(1 - k) x.w + k ybar`.
#[derive(Clone, Debug)]
pub struct Belief {
    candidates: Vec<Candidate>,
    /// Each candidate's sparse feature vector over the shared families: (weight index, value).
    features: Vec<Vec<(usize, f64)>>,
    /// Prior variance of each candidate's own term.
    own: f64,
    /// The prior of the shared weights: variances (the mean is 0).
    prior_var: Vec<f64>,
    /// Each candidate's measurement summary: precision-weighted mean of `y` and its variance.
    summary: Vec<Option<(f64, f64)>>,
    /// Posterior mean of the shared weights.
    mean: Vec<f64>,
    /// Posterior covariance of the shared weights, row-major `d x d`.
    cov: Vec<f64>,
    /// Each candidate's posterior mean and variance of `y`, kept from the last fit.
    predictions: Vec<(f64, f64)>,
    /// The lower Cholesky factor of `cov`, kept from the last fit.
    chol: Vec<f64>,
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
            .map(|c| {
                let d = c.dims;
                let mut x = vec![
                    (slot(Term::Global, priors.global), 1.0),
                    (slot(Term::Tp(d.tp), priors.tp), 1.0),
                    (slot(Term::Pp(d.pp), priors.pp), 1.0),
                    (slot(Term::Micro(c.micro_batch), priors.micro), 1.0),
                    (slot(Term::MicroTp(c.micro_batch, d.tp), priors.micro_tp), 1.0),
                    (slot(Term::Layout(d.dp, d.tp, d.pp), priors.layout), 1.0),
                    (slot(Term::Trend, priors.trend), trend_of(c) - centre),
                ];
                if d.dp > 1 {
                    x.push((slot(Term::DpSpan(d.world_size() > per_node), priors.dp_span), 1.0));
                }
                x
            })
            .collect();
        let prior_var: Vec<f64> = sd.iter().map(|s| s * s).collect();
        let n = prior_var.len();
        let mut b = Self {
            candidates: candidates.to_vec(),
            features,
            own: priors.own * priors.own,
            prior_var,
            summary: vec![None; candidates.len()],
            mean: vec![0.0; n],
            cov: Vec::new(),
            predictions: Vec::new(),
            chol: Vec::new(),
        };
        b.refit();
        b
    }

    /// The number of shared weights (family terms, without the candidates' own terms).
    pub fn terms(&self) -> usize {
        self.mean.len()
    }

    /// The candidates, in the order [`Belief::sample`] returns them.
    pub fn candidates(&self) -> &[Candidate] {
        &self.candidates
    }

    fn position(&self, c: &Candidate) -> Option<usize> {
        self.candidates.iter().position(|d| d == c)
    }

    /// `S a` for a sparse vector `a`.
    fn cov_times(&self, a: &[(usize, f64)]) -> Vec<f64> {
        let n = self.terms();
        let mut out = vec![0.0; n];
        for &(k, v) in a {
            for (o, s) in out.iter_mut().zip(&self.cov[k * n..(k + 1) * n]) {
                *o += v * s;
            }
        }
        out
    }

    fn dot(a: &[(usize, f64)], w: &[f64]) -> f64 {
        a.iter().map(|&(k, v)| v * w[k]).sum()
    }

    /// The posterior from the prior and every candidate's summary, by rank-one updates: a
    /// summary `(ybar, v)` of candidate `c` is one observation of `x_c.w` with variance
    /// `own^2 + v` (the own term and the measurement noise, both independent of `w`).
    fn refit(&mut self) {
        let n = self.terms();
        self.mean = vec![0.0; n];
        self.cov = vec![0.0; n * n];
        for (k, v) in self.prior_var.iter().enumerate() {
            self.cov[k * n + k] = *v;
        }
        for i in 0..self.candidates.len() {
            let Some((ybar, v)) = self.summary[i] else { continue };
            let x = &self.features[i];
            let sx = self.cov_times(x);
            let s = Self::dot(x, &sx) + self.own + v;
            let innovation = ybar - Self::dot(x, &self.mean);
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
        self.predictions = (0..self.candidates.len())
            .map(|i| {
                let (a, b, e) = self.linear(i);
                (Self::dot(&a, &self.mean) + b, (Self::dot(&a, &self.cov_times(&a)) + e).max(0.0))
            })
            .collect();
        self.chol = cholesky(&self.cov, n);
    }

    /// Adds one observation of `y(c) = ln(measured / prior)` with `variance` (a window of `n`
    /// steps of scatter `sigma`: `sigma^2 / n`), merged into the candidate's summary by
    /// precision. Observations of non-candidates, non-finite values and non-positive variances
    /// are ignored.
    pub fn observe(&mut self, c: &Candidate, y: f64, variance: f64) {
        let Some(i) = self.position(c) else { return };
        if !(y.is_finite() && variance.is_finite() && variance > 0.0) {
            return;
        }
        self.summary[i] = Some(match self.summary[i] {
            Some((m, v)) => {
                let p = 1.0 / v + 1.0 / variance;
                ((m / v + y / variance) / p, 1.0 / p)
            }
            None => (y, variance),
        });
        self.refit();
    }

    /// Replaces the measurement summaries: each `(candidate, ybar, variance)` the mean of `y`
    /// over its measurements and that mean's variance; candidates not listed have none. One
    /// refit for all, where [`Belief::observe`] refits per observation.
    pub fn set_summaries(&mut self, summaries: &[(Candidate, f64, f64)]) {
        self.summary = vec![None; self.candidates.len()];
        for (c, y, v) in summaries {
            if let Some(i) = self.position(c)
                && y.is_finite()
                && v.is_finite()
                && *v > 0.0
            {
                self.summary[i] = Some((*y, *v));
            }
        }
        self.refit();
    }

    /// Candidate `i`'s prediction as `a.w + b + e`: the sparse weight vector `a`, the constant
    /// `b` and the variance of the independent `e` (its own term given the weights).
    fn linear(&self, i: usize) -> (Vec<(usize, f64)>, f64, f64) {
        match self.summary[i] {
            Some((ybar, v)) => {
                let k = self.own / (self.own + v);
                let a = self.features[i].iter().map(|&(j, x)| (j, (1.0 - k) * x)).collect();
                (a, k * ybar, (1.0 - k) * self.own)
            }
            None => (self.features[i].clone(), 0.0, self.own),
        }
    }

    /// The posterior mean and standard deviation of `y(c)`; `None` for a non-candidate.
    pub fn predict(&self, c: &Candidate) -> Option<(f64, f64)> {
        let (m, v) = self.predictions[self.position(c)?];
        Some((m, v.sqrt()))
    }

    /// The posterior mean and standard deviation of `y(c) - y(d)`: the difference shares the
    /// families the two candidates share, so two members of one family differ by less than
    /// either is known. `None` unless both are candidates.
    pub fn predict_difference(&self, c: &Candidate, d: &Candidate) -> Option<(f64, f64)> {
        let i = self.position(c)?;
        self.differences_from(d).map(|all| all[i])
    }

    /// [`Belief::predict_difference`] of every candidate (in candidate order) from `d`, at the
    /// cost of one: `var(y_c - y_d) = var(y_c) + var(y_d) - 2 a_c' S a_d` with `S a_d` once.
    pub fn differences_from(&self, d: &Candidate) -> Option<Vec<(f64, f64)>> {
        let j = self.position(d)?;
        let (a_d, _, _) = self.linear(j);
        let s_d = self.cov_times(&a_d);
        let (m_d, v_d) = self.predictions[j];
        let out = (0..self.candidates.len())
            .map(|i| {
                if i == j {
                    return (0.0, 0.0);
                }
                let (a, _, _) = self.linear(i);
                let (m, v) = self.predictions[i];
                let var = v + v_d - 2.0 * Self::dot(&a, &s_d);
                (m - m_d, var.max(0.0).sqrt())
            })
            .collect();
        Some(out)
    }

    /// One joint draw of every candidate's `y` from the posterior (in candidate order): the
    /// weights drawn as `mean + L z` with `L` the Cholesky factor of the covariance, then each
    /// candidate's own term given them.
    pub fn sample(&self, rng: &mut impl Rng) -> Vec<f64> {
        let n = self.terms();
        let l = &self.chol;
        let z: Vec<f64> = (0..n).map(|_| StandardNormal.sample(rng)).collect();
        let w: Vec<f64> = (0..n).map(|r| self.mean[r] + (0..=r).map(|k| l[r * n + k] * z[k]).sum::<f64>()).collect();
        (0..self.candidates.len())
            .map(|i| {
                let (a, b, e) = self.linear(i);
                let own: f64 = StandardNormal.sample(rng);
                Self::dot(&a, &w) + b + e.sqrt() * own
            })
            .collect()
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

    /// The method of moments on draws from known priors gives them back, roughly: each
    /// family's estimate within a factor of two of its prior over many candidates.
    #[test]
    fn family_sizes_are_estimated_from_a_profile() {
        let mut cands = Vec::new();
        for (dp, tp, pp) in [(8, 1, 1), (4, 2, 1), (2, 4, 1), (1, 8, 1), (4, 1, 2), (2, 2, 2), (1, 4, 2), (2, 1, 4), (1, 2, 4), (1, 1, 8)] {
            for m in [1, 2, 4, 8] {
                for b in [16, 32, 64, 128, 256] {
                    if b % (dp * m) == 0 {
                        cands.push(c(dp, tp, pp, b, m));
                    }
                }
            }
        }
        let p =
            FamilyPriors { global: 0.3, tp: 0.2, pp: 0.2, dp_span: 0.0, micro: 0.15, micro_tp: 0.0, layout: 0.0, trend: 0.1, own: 0.05 };
        let (mut own, mut trend, mut micro) = (0.0, 0.0, 0.0);
        let runs = 40;
        for seed in 0..runs {
            let y = Belief::new(&cands, &p, 8).sample(&mut StdRng::seed_from_u64(seed));
            let e = FamilyPriors::estimate(&cands, &y, 8);
            (own, trend, micro) = (own + e.own / runs as f64, trend + e.trend / runs as f64, micro + e.micro / runs as f64);
        }
        assert!(own > 0.5 * p.own && own < 2.0 * p.own, "own {own}");
        assert!(trend > 0.5 * p.trend && trend < 1.5 * p.trend, "trend {trend}");
        assert!(micro > 0.5 * p.micro && micro < 1.5 * p.micro, "micro {micro}");
        // No data, no sizes.
        assert_eq!(FamilyPriors::estimate(&[], &[], 8).own, 0.0);
    }
}
