//! The scorer the policies share: candidates with a throughput prior, corrected online by
//! measured throughput, and scored by Goodput = throughput x statistical efficiency.

use std::sync::Arc;

use serde::{Deserialize, Serialize};

use super::error::{PolicyError, check};
use crate::candidates::Candidate;
use crate::goodput::{Objective, PlainGoodput};
use crate::layout::ParallelDims;
use crate::throughput::ThroughputModel;

/// Candidates with their predicted throughput; shared by the policies.
#[derive(Clone)]
pub struct Scorer {
    /// Each candidate with the samples/s it is scored by: its measurement once it has one, else
    /// its prior rescaled by the measurements (see [`Scorer::observe_throughput`]).
    entries: Vec<(Candidate, f64)>,
    /// The throughput model's value of each entry.
    prior: Vec<f64>,
    /// Smoothed measured samples/s of each entry the run has run.
    measured: Vec<Option<f64>>,
    /// Measurements taken per candidate, up to [`Self::SETTLED`] (restored measurements without
    /// a count count as settled).
    counts: Vec<u32>,
    /// [`Scorer::prior_log_error`], kept by [`Scorer::rescale`].
    log_error: Option<(f64, usize)>,
    /// Rescale each layout by its own measurements ([`Scorer::set_per_layout`]).
    per_layout: bool,
    /// Reference batch B0 of statistical efficiency.
    pub b0: f64,
    /// Turns throughput and noise into Goodput (plain, or a variant).
    objective: Arc<dyn Objective>,
}

/// One candidate's score.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Score {
    /// The candidate scored.
    pub candidate: Candidate,
    /// Samples/s the scorer holds for it: its measurement, or its prior rescaled.
    pub throughput: f64,
    /// Statistical efficiency at the current noise.
    pub efficiency: f64,
    /// throughput * efficiency.
    pub goodput: f64,
}

impl Scorer {
    /// Evaluates the throughput model once per candidate; candidates it cannot run are dropped.
    pub fn new(
        candidates: &[Candidate],
        throughput: &dyn ThroughputModel,
        b0: f64,
        objective: Arc<dyn Objective>,
    ) -> Result<Self, PolicyError> {
        check("b0", b0, b0 > 0.0, "a positive batch size")?;
        let entries = candidates.iter().filter_map(|c| throughput.samples_per_sec(c).map(|t| (*c, t))).collect();
        Self::from_prior(entries, b0, objective)
    }

    /// Candidates with their prior samples/s (those not positive and finite dropped), nothing
    /// measured yet.
    fn from_prior(mut entries: Vec<(Candidate, f64)>, b0: f64, objective: Arc<dyn Objective>) -> Result<Self, PolicyError> {
        entries.retain(|(_, t)| *t > 0.0 && t.is_finite());
        if entries.is_empty() {
            return Err(PolicyError::NoCandidates);
        }
        let prior = entries.iter().map(|e| e.1).collect();
        let measured = vec![None; entries.len()];
        let counts = vec![0; entries.len()];
        Ok(Self { entries, prior, measured, counts, log_error: None, per_layout: false, b0, objective })
    }

    /// Plain Goodput with reference batch `b0`.
    pub fn plain(candidates: &[Candidate], throughput: &dyn ThroughputModel, b0: f64) -> Result<Self, PolicyError> {
        Self::new(candidates, throughput, b0, Arc::new(PlainGoodput))
    }

    /// Learns throughput online from a step of `c` that ran at `samples_per_sec`. A candidate
    /// the run has run is scored by its own measurements (their mean over the first ten, then
    /// an EMA with weight [`Self::THROUGHPUT_SMOOTHING`] on the newest); every other candidate
    /// by its prior times the geometric mean of measured / prior over the run ones, so a prior that is off by a
    /// constant factor (another machine, the analytic model) is corrected from the first
    /// measurement. Non-positive or non-finite measurements and non-candidates are ignored.
    pub fn observe_throughput(&mut self, c: &Candidate, samples_per_sec: f64) {
        if !(samples_per_sec.is_finite() && samples_per_sec > 0.0) {
            return;
        }
        let Some(i) = self.entries.iter().position(|(d, _)| d == c) else { return };
        self.counts[i] = (self.counts[i] + 1).min(Self::SETTLED);
        let w = (1.0 / self.counts[i] as f64).max(Self::THROUGHPUT_SMOOTHING);
        self.measured[i] = Some(self.measured[i].map_or(samples_per_sec, |m| (1.0 - w) * m + w * samples_per_sec));
        self.rescale();
    }

    /// The smoothed measurements of the candidates the run has run, in candidate order.
    pub fn measured(&self) -> Vec<(Candidate, f64)> {
        self.entries.iter().zip(&self.measured).filter_map(|((c, _), m)| m.map(|m| (*c, m))).collect()
    }

    /// How many measurements each measured candidate's value averages, counted up to the ten
    /// after which the newest weighs [`Self::THROUGHPUT_SMOOTHING`]; saved beside
    /// [`Self::measured`] so a restored scorer smooths its next measurements as the original
    /// would.
    pub fn measurement_counts(&self) -> Vec<(Candidate, u32)> {
        let measured = self.entries.iter().zip(&self.measured).zip(&self.counts);
        measured.filter(|((_, m), _)| m.is_some()).map(|(((c, _), _), n)| (*c, *n)).collect()
    }

    /// Restores [`Self::measurement_counts`] after [`Self::set_measured`] (which counts every
    /// restored measurement as settled); counts of candidates without a measurement are
    /// ignored.
    pub fn set_measurement_counts(&mut self, counts: &[(Candidate, u32)]) {
        for (c, n) in counts {
            if let Some(i) = self.entries.iter().position(|(d, _)| d == c)
                && self.measured[i].is_some()
            {
                self.counts[i] = (*n).clamp(1, Self::SETTLED);
            }
        }
    }

    /// Replaces the measurements by `measured` (from [`Self::measured`]) and rescales the rest,
    /// as if they had been observed; entries that are not candidates are ignored.
    pub fn set_measured(&mut self, measured: &[(Candidate, f64)]) {
        self.measured = vec![None; self.entries.len()];
        self.counts = vec![0; self.entries.len()];
        for (c, m) in measured {
            if let Some(i) = self.entries.iter().position(|(d, _)| d == c)
                && m.is_finite()
                && *m > 0.0
            {
                self.measured[i] = Some(*m);
                self.counts[i] = Self::SETTLED;
            }
        }
        self.rescale();
    }

    /// Rescales each unmeasured candidate by the measurements of its own layout where that
    /// layout has any (the geometric mean of measured / prior over them), else by all of them
    /// (the default, `false`): for a prior whose errors are shared within a layout (a
    /// pipeline or collective cost it models wrongly) rather than common to every candidate.
    /// [`Scorer::prior_log_error`] is then the spread about each layout's own mean.
    pub fn set_per_layout(&mut self, on: bool) {
        self.per_layout = on;
        self.rescale();
    }

    /// Whether the run has measured a candidate of layout `dims`.
    pub fn layout_measured(&self, dims: ParallelDims) -> bool {
        self.entries.iter().zip(&self.measured).any(|((c, _), m)| c.dims == dims && m.is_some())
    }

    /// Each entry's throughput from its measurement, else its prior times the geometric mean of
    /// measured / prior (over its layout's measurements with [`Scorer::set_per_layout`]).
    fn rescale(&mut self) {
        let logs: Vec<(ParallelDims, f64)> = (self.entries.iter().zip(&self.measured).zip(&self.prior))
            .filter_map(|(((c, _), m), p)| m.map(|m| (c.dims, (m / p).ln())))
            .collect();
        let n = logs.len();
        let mean = if n == 0 { 0.0 } else { logs.iter().map(|l| l.1).sum::<f64>() / n as f64 };
        // Each measured layout's own mean (per layout only): what its measurements' errors are
        // taken about, one degree of freedom each.
        let mut layouts: Vec<(ParallelDims, f64, usize)> = Vec::new();
        if self.per_layout {
            for &(dims, x) in &logs {
                match layouts.iter_mut().find(|l| l.0 == dims) {
                    Some(l) => (l.1, l.2) = (l.1 + x, l.2 + 1),
                    None => layouts.push((dims, x, 1)),
                }
            }
        }
        let center = |dims: ParallelDims| layouts.iter().find(|l| l.0 == dims).map_or(mean, |l| l.1 / l.2 as f64);
        let groups = layouts.len().max(1);
        let ss: f64 = logs.iter().map(|(d, x)| (x - center(*d)).powi(2)).sum();
        self.log_error = (n > groups && n >= 2).then(|| ((ss / (n - groups) as f64).sqrt(), n));
        let scales: Vec<f64> = self.entries.iter().map(|(c, _)| center(c.dims).exp()).collect();
        for (((entry, prior), measured), scale) in self.entries.iter_mut().zip(&self.prior).zip(&self.measured).zip(scales) {
            entry.1 = measured.unwrap_or(prior * scale);
        }
    }

    /// How far the prior is from the measurements: the standard deviation of
    /// `log(measured / prior)` over the measured candidates about its mean (the shared factor
    /// the rescaling already removes), and their number. `None` before two are measured.
    pub fn prior_log_error(&self) -> Option<(f64, usize)> {
        self.log_error
    }

    /// The prior samples/s of `c` (the throughput model's, or the profile's), if it is a
    /// candidate.
    pub fn prior(&self, c: &Candidate) -> Option<f64> {
        self.entries.iter().position(|(d, _)| d == c).map(|i| self.prior[i])
    }

    /// Whether the run has measured `c` (a step of it ran).
    pub fn is_measured(&self, c: &Candidate) -> bool {
        self.entries.iter().zip(&self.measured).any(|((d, _), m)| d == c && m.is_some())
    }

    /// The same candidates with each prior replaced by `f(candidate, prior)` and no
    /// measurements; candidates whose new value is not positive and finite are dropped. What
    /// the simulator uses to make a truth the policies do not know.
    pub fn map_prior(&self, f: impl Fn(&Candidate, f64) -> f64) -> Result<Self, PolicyError> {
        let entries = self.entries.iter().zip(&self.prior).map(|((c, _), p)| (*c, f(c, *p))).collect();
        Self::from_prior(entries, self.b0, self.objective.clone())
    }

    /// Weight of the newest measurement in [`Self::observe_throughput`]'s EMA once a candidate
    /// has 10 measurements; before that, each is weighted equally (the running mean), so a
    /// short trial is judged on the mean of its steps rather than on its last two.
    pub const THROUGHPUT_SMOOTHING: f64 = 0.1;

    /// The count from which the EMA's weight is [`Self::THROUGHPUT_SMOOTHING`].
    const SETTLED: u32 = 10;

    /// The candidates with throughputs.
    pub fn candidates(&self) -> impl Iterator<Item = &(Candidate, f64)> {
        self.entries.iter()
    }

    /// The candidates with throughputs and whether each is measured.
    pub fn candidates_measured(&self) -> impl Iterator<Item = (&Candidate, f64, bool)> {
        self.entries.iter().zip(&self.measured).map(|((c, t), m)| (c, *t, m.is_some()))
    }

    /// Predicted samples/s of a candidate, if it is one.
    pub fn throughput(&self, c: &Candidate) -> Option<f64> {
        self.entries.iter().find(|(d, _)| d == c).map(|(_, t)| *t)
    }

    /// Goodput of a throughput at batch `batch` and noise `phi`.
    pub fn goodput(&self, throughput: f64, batch: usize, phi: f64) -> f64 {
        self.objective.goodput(throughput, batch as f64, self.b0, phi)
    }

    /// Scores of every candidate that passes `filter`.
    pub fn score_all(&self, phi: f64, filter: impl Fn(&Candidate) -> bool) -> Vec<Score> {
        self.entries
            .iter()
            .filter(|(c, _)| filter(c))
            .map(|&(candidate, throughput)| {
                let efficiency = self.objective.efficiency(candidate.global_batch as f64, self.b0, phi);
                Score { candidate, throughput, efficiency, goodput: throughput * efficiency }
            })
            .collect()
    }

    /// The highest-Goodput candidate that passes `filter` (ties: the smaller batch, then order).
    pub fn best(&self, phi: f64, filter: impl Fn(&Candidate) -> bool) -> Option<Score> {
        let mut best: Option<Score> = None;
        for &(candidate, throughput) in &self.entries {
            if !filter(&candidate) {
                continue;
            }
            let goodput = self.goodput(throughput, candidate.global_batch, phi);
            if best.is_none_or(|b| goodput > b.goodput) {
                let efficiency = goodput / throughput;
                best = Some(Score { candidate, throughput, efficiency, goodput });
            }
        }
        best
    }

    /// The highest-throughput micro-batch for a layout and global batch.
    pub fn fastest(&self, dims: ParallelDims, global_batch: usize) -> Option<Candidate> {
        self.entries
            .iter()
            .filter(|(c, _)| c.dims == dims && c.global_batch == global_batch)
            .max_by(|a, b| a.1.total_cmp(&b.1))
            .map(|(c, _)| *c)
    }
}

#[cfg(test)]
impl Scorer {
    /// A scorer without candidates, which [`Scorer::new`] refuses: for tests of code that must
    /// not panic on one.
    pub(crate) fn empty_for_tests() -> Self {
        Self {
            entries: Vec::new(),
            prior: Vec::new(),
            measured: Vec::new(),
            counts: Vec::new(),
            log_error: None,
            per_layout: false,
            b0: 1.0,
            objective: Arc::new(PlainGoodput),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::test_util::{d, toy};

    #[test]
    fn per_layout_rescaling_uses_each_layouts_own_measurements() {
        let (mut s, _) = toy();
        let (a4, a64) = (Candidate::new(d(4, 1, 1), 4, 1).unwrap(), Candidate::new(d(4, 1, 1), 64, 1).unwrap());
        let (b8, b64) = (Candidate::new(d(2, 2, 1), 8, 1).unwrap(), Candidate::new(d(2, 2, 1), 64, 1).unwrap());
        let prior = |s: &Scorer, c: &Candidate| s.prior[s.entries.iter().position(|(e, _)| e == c).unwrap()];
        let (pa4, pa64, pb8, pb64) = (prior(&s, &a4), prior(&s, &a64), prior(&s, &b8), prior(&s, &b64));
        // dp4 measured at twice its prior, tp2 at half: one shared factor cancels out
        // (geometric mean 1); per layout each keeps its own.
        s.observe_throughput(&a4, 2.0 * pa4);
        s.observe_throughput(&b8, 0.5 * pb8);
        assert!((s.throughput(&a64).unwrap() - pa64).abs() < 1e-12 * pa64);
        let ln2 = 2f64.ln();
        assert!((s.prior_log_error().unwrap().0 - ln2 * 2f64.sqrt()).abs() < 1e-12);
        s.set_per_layout(true);
        assert!(!s.layout_measured(d(1, 4, 1)) && s.layout_measured(d(2, 2, 1)));
        assert!((s.throughput(&a64).unwrap() - 2.0 * pa64).abs() < 1e-12 * pa64);
        assert!((s.throughput(&b64).unwrap() - 0.5 * pb64).abs() < 1e-12 * pb64);
        // One measurement per layout leaves no spread about the layouts' own means.
        assert_eq!(s.prior_log_error(), None);
        // A second dp4 candidate at 3x: dp4's factor is sqrt(2 * 3); the spread about it is
        // ln(1.5) / 2 on each, one degree of freedom: ln(1.5) / sqrt(2).
        let a16 = Candidate::new(d(4, 1, 1), 16, 1).unwrap();
        s.observe_throughput(&a16, 3.0 * prior(&s, &a16));
        assert!((s.throughput(&a64).unwrap() - 6f64.sqrt() * pa64).abs() < 1e-12 * pa64);
        assert!((s.throughput(&b64).unwrap() - 0.5 * pb64).abs() < 1e-12 * pb64);
        let (sd, n) = s.prior_log_error().unwrap();
        assert_eq!(n, 3);
        assert!((sd - 1.5f64.ln() / 2f64.sqrt()).abs() < 1e-12);
        // Back to one factor: the geometric mean of 2, 0.5 and 3.
        s.set_per_layout(false);
        assert!((s.throughput(&b64).unwrap() - 3f64.cbrt() * pb64).abs() < 1e-12 * pb64);
    }

    #[test]
    fn measured_throughput_replaces_the_prior_and_rescales_the_rest() {
        let (mut s, _) = toy();
        let a = Candidate::new(d(4, 1, 1), 4, 1).unwrap();
        let b = Candidate::new(d(2, 2, 1), 8, 1).unwrap();
        let c = Candidate::new(d(2, 2, 1), 32, 1).unwrap();
        let (pa, pb, pc) = (s.throughput(&a).unwrap(), s.throughput(&b).unwrap(), s.throughput(&c).unwrap());
        // One measurement at half the prior: it replaces the prior, and every unrun candidate
        // is halved too.
        s.observe_throughput(&a, pa / 2.0);
        assert_eq!(s.throughput(&a), Some(pa / 2.0));
        assert!((s.throughput(&c).unwrap() - pc / 2.0).abs() < 1e-12 * pc);
        // A second candidate at 4x its prior: the rest scale by the geometric mean, sqrt(0.5 * 4).
        s.observe_throughput(&b, 4.0 * pb);
        assert_eq!(s.throughput(&b), Some(4.0 * pb));
        assert!((s.throughput(&c).unwrap() - pc * 2f64.sqrt()).abs() < 1e-12 * pc);
        // Repeated measurements are averaged: the running mean of the first ten (a third one
        // tells the mean, (0.5 + 1 + 1) / 3, from an EMA of weight 0.5, which gives 0.875).
        s.observe_throughput(&a, pa);
        assert!((s.throughput(&a).unwrap() - 0.75 * pa).abs() < 1e-12 * pa);
        s.observe_throughput(&a, pa);
        assert!((s.throughput(&a).unwrap() - 2.5 / 3.0 * pa).abs() < 1e-12 * pa);
        // Junk and non-candidates change nothing.
        let before: Vec<f64> = s.candidates().map(|x| x.1).collect();
        s.observe_throughput(&a, f64::NAN);
        s.observe_throughput(&a, -1.0);
        s.observe_throughput(&Candidate::new(d(1, 4, 1), 4, 1).unwrap(), 10.0);
        assert_eq!(before, s.candidates().map(|x| x.1).collect::<Vec<f64>>());
    }

    /// The running mean of the first ten measurements, then an EMA of weight 0.1; a scorer
    /// restored with the counts smooths the next measurement as the original does, one
    /// restored without them (an older checkpoint) as a settled one.
    #[test]
    fn smoothing_counts_survive_a_restore() {
        let (mut s, _) = toy();
        let a = Candidate::new(d(4, 1, 1), 4, 1).unwrap();
        for x in [1.0, 2.0, 3.0] {
            s.observe_throughput(&a, x);
        }
        assert!((s.throughput(&a).unwrap() - 2.0).abs() < 1e-12);
        assert_eq!(s.measurement_counts(), vec![(a, 3)]);
        let mut with = toy().0;
        with.set_measured(&s.measured());
        with.set_measurement_counts(&s.measurement_counts());
        let mut without = toy().0;
        without.set_measured(&s.measured());
        for t in [&mut s, &mut with, &mut without] {
            t.observe_throughput(&a, 6.0);
        }
        // By hand: (1 + 2 + 3 + 6) / 4 = 3; settled: 0.9 * 2 + 0.1 * 6 = 2.4.
        assert!((s.throughput(&a).unwrap() - 3.0).abs() < 1e-12);
        assert_eq!(with.throughput(&a), s.throughput(&a));
        assert!((without.throughput(&a).unwrap() - 2.4).abs() < 1e-12);
        // Past ten, the newest weighs 0.1.
        for _ in 0..6 {
            s.observe_throughput(&a, 3.0);
        }
        assert_eq!(s.measurement_counts(), vec![(a, 10)]);
        s.observe_throughput(&a, 13.0);
        assert!((s.throughput(&a).unwrap() - 4.0).abs() < 1e-12);
    }

    #[test]
    fn toy_profile_crosses_over() {
        let (s, _) = toy();
        // By hand: at B_g = 4, dp4 0.6 s vs tp2 0.26 s; at 128, dp4 3.7 s vs tp2 5.22 s.
        assert_eq!(s.best(1e9, |c| c.global_batch == 4).unwrap().candidate.dims, d(2, 2, 1));
        assert_eq!(s.best(1e9, |c| c.global_batch == 128).unwrap().candidate.dims, d(4, 1, 1));
    }
}
