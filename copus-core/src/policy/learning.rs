//! Copus on a structured belief: Goodput over every feasible (S, B_g, B_m), its throughput
//! learned by [`Belief`] (one measurement informs every candidate that shares a family), its
//! exploration by Thompson sampling, and one decision rule, [`Rule`], of six settings.
//!
//! Every `window` steps (and whenever the configuration changed a window ago) the policy
//! judges, with `H` the seconds the run has left ([`Policy::observe_horizon`], else
//! `rule.horizon`) and `cost(c)` the measured seconds of the change to `c` (a layout change's
//! and a batch change's estimates, each a running mean of the changes made):
//!
//! 1. **Decide.** Over the band of B_simple the noise estimate allows (`confidence` standard
//!    errors each side, with the point estimate), and at the belief's lower bound of the
//!    throughput ratio (`confidence` standard deviations of `y(c) - y(cur)` below its mean),
//!    a candidate `c` is worth the change when its Goodput over what is left of the horizon
//!    after the change beats staying by `threshold` at every point of the band:
//!    `G_c (H - cost(c)) >= (1 + threshold) G_cur H`. Of those, the one with the largest
//!    smallest margin is chosen. A change of B_g goes ahead only once changes of B_g the same
//!    way have been judged worth it at every judgement for `dwell_steps` steps: the smoothed
//!    noise estimate's error is correlated over about that span, and a run that looks at its
//!    band every window would otherwise act on the band's one-sided error rate again and again
//!    (on a flat noise scale the rule without this went up and back down scores of times).
//! 2. **Explore.** Otherwise one joint draw of every candidate's throughput from the belief
//!    replaces its lower bound, and the same test is made on the draw among the running
//!    B_g's candidates, charging the change's cost twice (there and back) over the horizon
//!    (Thompson sampling): a layout or B_m the belief is unsure of wins sometimes, in
//!    proportion to the chance that it is better, and is then measured for a window; one
//!    measured before may be measured again. A change of B_g is never a trial: it is the
//!    band's decision.
//!
//! A change of B_g is judged only once the running B_g has run `dwell_steps` (its noise
//! estimate has seen the batch); before that, and before there is a usable estimate, only
//! candidates of the running B_g are compared, on throughput. Steps of the running
//! configuration are the belief's measurements: `y = ln(measured / prior)`, their scatter
//! pooled over candidates (the step jitter) giving each candidate's mean its variance.

use rand::SeedableRng;
use rand::rngs::StdRng;
use serde::{Deserialize, Serialize};

use super::error::{PolicyError, check};
use super::interface::{Decision, Policy, PolicyState, StepObservation};
use super::scorer::Scorer;
use crate::belief::{Belief, FamilyPriors};
use crate::candidates::Candidate;

/// The settings of [`Learning`]: six, each documented with the range it takes.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Rule {
    /// Standard errors (of the noise estimate) and standard deviations (of the throughput
    /// belief) a change must hold across: about 84% one-sided confidence at 1. `>= 0`.
    pub confidence: f64,
    /// The relative Goodput gain over the horizon, after the change's cost, a change must
    /// reach: what the models' error below that is not worth acting on. `>= 0`.
    pub threshold: f64,
    /// Seconds the run has left, used until the run says ([`Policy::observe_horizon`]). `> 0`.
    pub horizon: f64,
    /// The first estimate of a layout change's seconds, replaced by the measured changes'
    /// running mean. `>= 0`.
    pub layout_cost: f64,
    /// Steps a global batch runs before a change of it is judged (its smoothed noise estimate
    /// has seen it). `>= 1`.
    pub dwell_steps: u64,
    /// Steps between judgements, and a new configuration's first measurement window. `>= 1`.
    pub window: u64,
}

impl Default for Rule {
    fn default() -> Self {
        Self { confidence: 1.0, threshold: 0.02, horizon: 600.0, layout_cost: 10.0, dwell_steps: 20, window: 8 }
    }
}

impl Rule {
    /// Checks the ranges; the error names the first setting out of range.
    pub fn validate(&self) -> Result<(), PolicyError> {
        check("confidence", self.confidence, self.confidence >= 0.0, ">= 0 standard errors")?;
        check("threshold", self.threshold, self.threshold >= 0.0, ">= 0")?;
        check("horizon", self.horizon, self.horizon > 0.0, "> 0 seconds")?;
        check("layout_cost", self.layout_cost, self.layout_cost >= 0.0, ">= 0 seconds")?;
        check("dwell_steps", self.dwell_steps as f64, self.dwell_steps >= 1, ">= 1 step")?;
        check("window", self.window as f64, self.window >= 1, ">= 1 step")
    }
}

/// One candidate's measured steps: count, mean and sum of squared deviations of
/// `y = ln(measured / prior)`.
#[derive(Clone, Copy, Debug, Default)]
struct Measured {
    n: f64,
    mean: f64,
    m2: f64,
}

impl Measured {
    /// At most this many steps weigh in a candidate's mean: the newest then counts 1/256, so
    /// a machine whose speed drifts is followed.
    const MEMORY: f64 = 256.0;

    fn add(&mut self, y: f64) {
        self.n = (self.n + 1.0).min(Self::MEMORY);
        let d = y - self.mean;
        self.mean += d / self.n;
        self.m2 += d * (y - self.mean);
        if self.n >= Self::MEMORY {
            self.m2 *= (Self::MEMORY - 1.0) / Self::MEMORY;
        }
    }
}

/// Copus on a structured belief; see the module's documentation.
#[derive(Clone)]
pub struct Learning {
    scorer: Scorer,
    rule: Rule,
    belief: Belief,
    /// Each candidate's prior samples/s, in the belief's candidate order.
    prior: Vec<f64>,
    measured: Vec<Measured>,
    /// Whether measurements arrived since the belief's last refit.
    stale: bool,
    /// Each candidate's step count at the belief's last refit.
    refit_at: Vec<f64>,
    rng: StdRng,
    /// Seconds the run has left, once it has said.
    remaining: Option<f64>,
    /// Running means of the measured layout and batch changes' seconds: (sum, count).
    costs: [(f64, f64); 2],
    /// Layout changes decided (at the lower bound) and explored (on a draw).
    layouts: (u64, u64),
    /// The configuration running and the step it was first seen at.
    seen: Option<(Candidate, u64)>,
    /// The B_g running and the step it was first seen at.
    batch_seen: Option<(usize, u64)>,
    /// A change of B_g judged worth it (upwards or not) since this step, not yet confirmed.
    wanted: Option<(bool, u64)>,
}

impl Learning {
    /// B_simple taken as "very large" (statistical efficiency 1 at every batch that matters).
    const PHI_CAP: f64 = 1e9;
    /// The step scatter assumed before measurements pool it (log scale), and the weight of
    /// that assumption in steps.
    const JITTER: (f64, f64) = (0.1, 4.0);

    /// Copus over `scorer`'s candidates and priors, its belief's families with the standard
    /// deviations `priors` on a cluster of `ranks_per_node` ranks to a node; `seed` seeds its
    /// Thompson draws. An error if `rule` is out of range.
    pub fn new(scorer: Scorer, rule: Rule, priors: &FamilyPriors, ranks_per_node: usize, seed: u64) -> Result<Self, PolicyError> {
        rule.validate()?;
        let candidates: Vec<Candidate> = scorer.candidates().map(|(c, _)| *c).collect();
        let prior = candidates.iter().map(|c| scorer.prior(c).unwrap_or(f64::NAN)).collect();
        let belief = Belief::new(&candidates, priors, ranks_per_node);
        Ok(Self {
            measured: vec![Measured::default(); candidates.len()],
            refit_at: vec![0.0; candidates.len()],
            scorer,
            rule,
            belief,
            prior,
            stale: false,
            rng: StdRng::seed_from_u64(seed),
            remaining: None,
            costs: [(0.0, 0.0); 2],
            layouts: (0, 0),
            seen: None,
            batch_seen: None,
            wanted: None,
        })
    }

    /// The pooled step scatter of `y` (variance), with [`Self::JITTER`] as a prior.
    fn jitter_var(&self) -> f64 {
        let (s0, w0) = Self::JITTER;
        let (ss, dof) = self.measured.iter().filter(|m| m.n >= 2.0).fold((0.0, 0.0), |(ss, d), m| (ss + m.m2, d + m.n - 1.0));
        (s0 * s0 * w0 + ss) / (w0 + dof)
    }

    /// Refits the belief when a candidate was measured for the first time or has run half as
    /// many steps again as at the last refit (its mean's variance fell by a third): between,
    /// the posterior moves by little and a refit costs a pass over every candidate.
    fn refit(&mut self) {
        let moved = self.measured.iter().zip(&self.refit_at).any(|(m, at)| m.n > 0.0 && (*at == 0.0 || m.n >= 1.5 * at));
        if !(self.stale && moved) {
            return;
        }
        self.refit_at = self.measured.iter().map(|m| m.n).collect();
        let var = self.jitter_var();
        let summaries: Vec<(Candidate, f64, f64)> = (self.belief.candidates().iter().zip(&self.measured))
            .filter(|(_, m)| m.n > 0.0)
            .map(|(c, m)| (*c, m.mean, var / m.n))
            .collect();
        self.belief.set_summaries(&summaries);
        self.stale = false;
    }

    /// The estimated seconds of the change from `cur` to `c`.
    fn cost(&self, cur: &Candidate, c: &Candidate) -> f64 {
        let (sum, n) = self.costs[usize::from(!c.layout_differs(cur))];
        if c == cur {
            0.0
        } else if n > 0.0 {
            sum / n
        } else if c.layout_differs(cur) {
            self.rule.layout_cost
        } else {
            0.0
        }
    }

    /// The belief's posterior mean and standard deviation of `ln(throughput / prior)` for `c`
    /// (measurements up to the last judgement).
    pub fn predict(&self, c: &Candidate) -> Option<(f64, f64)> {
        self.belief.predict(c)
    }

    /// Layout changes decided so far (the decision at the belief's lower bound) and explored
    /// (a Thompson draw's), apart: trials are not decisions.
    pub fn layout_changes(&self) -> (u64, u64) {
        self.layouts
    }

    /// The seconds the run has left.
    pub fn horizon(&self) -> f64 {
        self.remaining.unwrap_or(self.rule.horizon)
    }

    /// `c`'s Goodput at `phi` (throughput alone without one) for `y(c)` = `y`.
    fn value(&self, i: usize, y: f64, phi: Option<f64>) -> f64 {
        let t = self.prior[i] * y.exp();
        let c = &self.belief.candidates()[i];
        phi.map_or(t, |p| self.scorer.goodput(t, c.global_batch, p))
    }

    /// The candidate that beats staying on `cur` (whose `y` is `y_cur`) by the threshold over
    /// the horizon at every point of `band` (or on throughput, `band` empty), each candidate's
    /// `y` given by `relative(i)`; the one with the largest smallest margin.
    /// Each change's cost is counted `trips` times (2 for a trial: there and back).
    fn best_change(
        &self,
        cur: usize,
        y_cur: f64,
        eligible: &[usize],
        band: &[f64],
        relative: &dyn Fn(usize) -> f64,
        trips: f64,
    ) -> Option<usize> {
        let h = self.horizon();
        let c0 = self.belief.candidates()[cur];
        let points: Vec<Option<f64>> = if band.is_empty() { vec![None] } else { band.iter().map(|p| Some(*p)).collect() };
        let mut pick = None::<(usize, f64)>;
        for &i in eligible {
            if i == cur {
                continue;
            }
            let c = self.belief.candidates()[i];
            let left = (h - trips * self.cost(&c0, &c)).max(0.0);
            let rel = relative(i);
            let margin = points
                .iter()
                .map(|&p| {
                    let now = self.value(cur, y_cur, p);
                    let go = self.value(i, rel, p);
                    if now > 0.0 {
                        go * left / (now * h)
                    } else if go > 0.0 {
                        f64::INFINITY
                    } else {
                        0.0
                    }
                })
                .fold(f64::INFINITY, f64::min);
            if margin >= 1.0 + self.rule.threshold && pick.is_none_or(|(_, m)| margin > m) {
                pick = Some((i, margin));
            }
        }
        pick.map(|(i, _)| i)
    }

    /// The band of B_simple at which changes of B_g are judged, with the point estimate (or
    /// the low end while |G|^2 is not positive); `None` without a usable estimate.
    fn band(&self, obs: &StepObservation) -> Option<[f64; 3]> {
        let (low, high) = obs.noise.and_then(|n| n.b_simple_band(self.rule.confidence))?;
        let phi = obs.b_simple().unwrap_or(low);
        Some([low, phi.min(Self::PHI_CAP), high.min(Self::PHI_CAP)])
    }

    /// A decided change of B_g goes ahead only once changes of B_g the same way have been
    /// judged worth it at every judgement for `dwell_steps` steps (the span over which the
    /// smoothed noise estimate's error is correlated: one look at the band errs at its one-sided
    /// rate, and a run looks every window); a change of layout or B_m at the same B_g goes
    /// ahead at once. Anything else clears what was being confirmed.
    fn confirmed(&mut self, decided: Option<usize>, cur: &Candidate, step: u64) -> Option<usize> {
        let Some(i) = decided else {
            self.wanted = None;
            return None;
        };
        let b = self.belief.candidates()[i].global_batch;
        if b == cur.global_batch {
            self.wanted = None;
            return Some(i);
        }
        let up = b > cur.global_batch;
        match self.wanted {
            Some((u, since)) if u == up => {
                if step.saturating_sub(since) >= self.rule.dwell_steps {
                    self.wanted = None;
                    Some(i)
                } else {
                    None
                }
            }
            _ => {
                self.wanted = Some((up, step));
                None
            }
        }
    }

    /// Steps the configuration and its B_g have run, noting changes of either.
    fn track(&mut self, obs: &StepObservation) -> (u64, u64) {
        let cur = obs.current;
        if self.seen.is_none_or(|(c, _)| c != cur) {
            self.seen = Some((cur, obs.step));
        }
        if self.batch_seen.is_none_or(|(b, _)| b != cur.global_batch) {
            self.batch_seen = Some((cur.global_batch, obs.step));
        }
        let since = |s: u64| obs.step.saturating_sub(s) + 1;
        (since(self.seen.map_or(0, |s| s.1)), since(self.batch_seen.map_or(0, |s| s.1)))
    }
}

impl Policy for Learning {
    fn name(&self) -> String {
        "copus".into()
    }

    fn decide(&mut self, obs: &StepObservation) -> Decision {
        let cur = obs.current;
        let (ran, dwelled) = self.track(obs);
        let r = self.rule;
        if ran < r.window || ran % r.window != 0 {
            return Decision::Keep;
        }
        let Some(ci) = self.belief.candidates().iter().position(|c| *c == cur) else { return Decision::Keep };
        self.refit();
        let band = if dwelled >= r.dwell_steps { self.band(obs) } else { None };
        let band = band.map_or(Vec::new(), |b| b.to_vec());
        let eligible: Vec<usize> = (0..self.belief.candidates().len())
            .filter(|&i| !band.is_empty() || self.belief.candidates()[i].global_batch == cur.global_batch)
            .filter(|&i| self.prior[i].is_finite())
            .collect();
        let z = r.confidence;
        // Decide: at the belief's lower bound of each candidate's throughput relative to cur.
        let differences = self.belief.differences_from(&cur).unwrap_or_default();
        let lower = |i: usize| differences.get(i).map_or(f64::NEG_INFINITY, |(m, s)| m - z * s);
        let y_cur = self.belief.predict(&cur).map_or(0.0, |p| p.0);
        let decided = self.best_change(ci, y_cur, &eligible, &band, &|i| lower(i) + y_cur, 1.0);
        let decided = self.confirmed(decided, &cur, obs.step);
        let explored = decided.is_none();
        let target = decided.or_else(|| {
            // Explore: one joint draw in place of the lower bound, among the running B_g's
            // candidates (a change of B_g is the band's decision, never a trial), paying for
            // the way there and back.
            let draw = self.belief.sample(&mut self.rng);
            let relative = |i: usize| draw[i] - draw[ci] + y_cur;
            let same_batch: Vec<usize> =
                eligible.iter().copied().filter(|&i| self.belief.candidates()[i].global_batch == cur.global_batch).collect();
            self.best_change(ci, y_cur, &same_batch, &band, &relative, 2.0)
        });
        let Some(i) = target else { return Decision::Keep };
        let decision = Decision::to(&cur, self.belief.candidates()[i]);
        if matches!(decision, Decision::ChangeLayout(_)) {
            if explored { self.layouts.1 += 1 } else { self.layouts.0 += 1 }
        }
        decision
    }

    fn scorer(&self) -> Option<&Scorer> {
        Some(&self.scorer)
    }

    fn scorer_mut(&mut self) -> Option<&mut Scorer> {
        Some(&mut self.scorer)
    }

    fn observe_throughput(&mut self, candidate: &Candidate, samples_per_sec: f64) {
        self.scorer.observe_throughput(candidate, samples_per_sec);
        let Some(i) = self.belief.candidates().iter().position(|c| c == candidate) else { return };
        let y = (samples_per_sec / self.prior[i]).ln();
        if y.is_finite() {
            self.measured[i].add(y);
            self.stale = true;
        }
    }

    fn observe_reconfiguration(&mut self, seconds: f64, layout_changed: bool) {
        if seconds.is_finite() && seconds >= 0.0 {
            let k = usize::from(!layout_changed);
            self.costs[k] = (self.costs[k].0 + seconds, self.costs[k].1 + 1.0);
        }
    }

    fn observe_horizon(&mut self, remaining_secs: f64) {
        if remaining_secs.is_finite() && remaining_secs > 0.0 {
            self.remaining = Some(remaining_secs);
        }
    }

    fn learned(&self) -> PolicyState {
        let mut state = super::interface::learned_by_scorer(Some(&self.scorer));
        state.layout_cost = (self.costs[0].1 > 0.0).then(|| self.costs[0].0 / self.costs[0].1);
        state.seen = self.seen;
        state.batch_seen = self.batch_seen;
        // A change of B_g being confirmed goes on being confirmed after a resume.
        state.winning = self.wanted.zip(self.seen).map(|((up, since), (c, _))| (c.dims, if up { 1 } else { -1 }, since));
        let cands = self.belief.candidates().iter().zip(&self.measured);
        state.belief = cands.filter(|(_, m)| m.n > 0.0).map(|(c, m)| (*c, m.n, m.mean, m.m2)).collect();
        state
    }

    fn restore_learned(&mut self, state: &PolicyState) {
        super::interface::restore_scorer(Some(&mut self.scorer), state);
        if let Some(c) = state.layout_cost.filter(|c| c.is_finite() && *c >= 0.0) {
            self.costs[0] = (c, 1.0);
        }
        (self.seen, self.batch_seen) = (state.seen, state.batch_seen);
        self.wanted = state.winning.filter(|w| w.1 != 0).map(|(_, dir, since)| (dir > 0, since));
        self.measured = vec![Measured::default(); self.measured.len()];
        for (c, n, mean, m2) in &state.belief {
            if let Some(i) = self.belief.candidates().iter().position(|d| d == c)
                && [*n, *mean, *m2].iter().all(|x| x.is_finite())
                && *n > 0.0
            {
                self.measured[i] = Measured { n: n.min(Measured::MEMORY), mean: *mean, m2: m2.max(0.0) };
            }
        }
        self.stale = true;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gns::NoiseEstimate;
    use crate::layout::ParallelDims;
    use crate::policy::test_util::d;
    use crate::throughput::{ProfileEntry, ThroughputProfile};

    /// Priors with a global and an own term only (every candidate one family).
    fn flat(global: f64, own: f64) -> FamilyPriors {
        FamilyPriors { global, tp: 0.0, pp: 0.0, dp_span: 0.0, micro: 0.0, micro_tp: 0.0, layout: 0.0, trend: 0.0, own }
    }

    fn scorer_of(rows: &[(ParallelDims, usize, usize, f64)]) -> Scorer {
        let entries = rows.iter().map(|&(l, b, m, t)| ProfileEntry::of(&Candidate::new(l, b, m).unwrap(), t)).collect();
        let p = ThroughputProfile::new("t".into(), "t".into(), entries).unwrap();
        let cands: Vec<Candidate> = rows.iter().map(|&(l, b, m, _)| Candidate::new(l, b, m).unwrap()).collect();
        Scorer::plain(&cands, &p, 4.0).unwrap()
    }

    fn at(step: u64, current: Candidate) -> StepObservation {
        StepObservation { step, current, noise: None }
    }

    /// Runs `cur` for `steps` steps at `sps`, deciding at each; the first change, if any.
    fn run(p: &mut Learning, cur: Candidate, sps: f64, steps: u64) -> Decision {
        for step in 1..=steps {
            p.observe_throughput(&cur, sps);
            let d = p.decide(&at(step, cur));
            if d != Decision::Keep {
                return d;
            }
        }
        Decision::Keep
    }

    /// Two micro-batch sizes of one layout and B_g, equal priors, the running one measured:
    /// the decision at the belief's lower bound does not move to the unmeasured one, and
    /// Thompson's draw moves there with the probability the posterior gives it, by hand
    /// `P(y_o - y_c > ln(1 + threshold)) = 1 - Phi((ln(1 + threshold) - m) / s)` with (m, s) the
    /// posterior of the difference.
    #[test]
    fn thompson_tries_the_unmeasured_candidate_as_often_as_it_may_be_better() {
        let (c, o) = (Candidate::new(d(1, 1, 1), 8, 8).unwrap(), Candidate::new(d(1, 1, 1), 8, 4).unwrap());
        let s = scorer_of(&[(d(1, 1, 1), 8, 8, 100.0), (d(1, 1, 1), 8, 4, 100.0)]);
        let rule = Rule { window: 8, ..Rule::default() };
        let (mut moved, trials) = (0, 2000);
        let mut expected = 0.0;
        for seed in 0..trials {
            let mut p = Learning::new(s.clone(), rule, &flat(0.3, 0.1), 8, seed).unwrap();
            let decision = run(&mut p, c, 100.0, 8);
            let (m, sd) = p.belief.predict_difference(&o, &c).unwrap();
            // The lower bound alone never wins here: m is 0 by symmetry.
            assert!(m.abs() < 1e-12 && m - sd < (1.0 + rule.threshold).ln());
            let cdf = |x: f64| 0.5 * libm::erfc(-x / std::f64::consts::SQRT_2);
            expected = 1.0 - cdf(((1.0 + rule.threshold).ln() - m) / sd);
            moved += usize::from(decision == Decision::ChangeBatch(o));
        }
        let share = moved as f64 / trials as f64;
        let se = (expected * (1.0 - expected) / trials as f64).sqrt();
        assert!((share - expected).abs() < 4.0 * se, "moved {share:.3}, by hand {expected:.3}");
        assert!(expected > 0.2 && expected < 0.5, "{expected}");
    }

    /// A candidate measured to be 30% faster is chosen by the decision itself, at the lower
    /// bound; one measured 10% slower is not, whatever the draws.
    #[test]
    fn a_measured_gain_is_taken_and_a_loss_is_not() {
        let (c, o) = (Candidate::new(d(1, 1, 1), 8, 8).unwrap(), Candidate::new(d(1, 1, 1), 8, 4).unwrap());
        let s = scorer_of(&[(d(1, 1, 1), 8, 8, 100.0), (d(1, 1, 1), 8, 4, 100.0)]);
        for (speed, wanted) in [(130.0, Decision::ChangeBatch(o)), (90.0, Decision::Keep)] {
            for seed in 0..20 {
                let mut p = Learning::new(s.clone(), Rule::default(), &flat(0.3, 0.1), 8, seed).unwrap();
                for _ in 0..64 {
                    p.observe_throughput(&o, speed);
                }
                p.stale = true;
                assert_eq!(run(&mut p, c, 100.0, 64), wanted, "{speed} seed {seed}");
            }
        }
    }

    /// A layout change that is measured to be 10% faster is made when the run has an hour
    /// left and not when it has 60 s, with the change costing 10 s (it repays in 100 s).
    #[test]
    fn a_layout_change_must_repay_its_cost_over_what_is_left() {
        let (c, o) = (Candidate::new(d(2, 1, 1), 8, 4).unwrap(), Candidate::new(d(1, 2, 1), 8, 8).unwrap());
        let s = scorer_of(&[(d(2, 1, 1), 8, 4, 100.0), (d(1, 2, 1), 8, 8, 100.0)]);
        for (left, wanted) in [(3600.0, Decision::ChangeLayout(o)), (60.0, Decision::Keep)] {
            let mut p = Learning::new(s.clone(), Rule { layout_cost: 10.0, ..Rule::default() }, &flat(0.3, 0.01), 8, 1).unwrap();
            for _ in 0..64 {
                p.observe_throughput(&o, 110.0);
            }
            p.observe_horizon(left);
            assert_eq!(run(&mut p, c, 100.0, 8), wanted, "{left} s left");
        }
    }

    /// A change of B_g waits for the dwell and a noise estimate; at a large B_simple the larger
    /// batch, twice as fast, wins once both are there and the band has said so at every
    /// judgement for `dwell_steps`. An estimate that goes away before then clears it.
    #[test]
    fn a_change_of_batch_waits_for_the_dwell_and_is_confirmed() {
        let (c, o) = (Candidate::new(d(1, 1, 1), 8, 8).unwrap(), Candidate::new(d(1, 1, 1), 32, 8).unwrap());
        let s = scorer_of(&[(d(1, 1, 1), 8, 8, 100.0), (d(1, 1, 1), 32, 8, 200.0)]);
        let rule = Rule { dwell_steps: 16, window: 4, ..Rule::default() };
        let noise = Some(NoiseEstimate { grad_sq: 1.0, trace: 1e4, biased: false, grad_sq_se: 0.0, trace_se: 0.0 });
        let first_change = |estimate_until: u64| {
            let mut p = Learning::new(s.clone(), rule, &flat(0.01, 0.01), 8, 1).unwrap();
            for step in 1..=80 {
                p.observe_throughput(&c, 100.0);
                let seen = (24 < step && step <= estimate_until).then_some(noise).flatten();
                let decision = p.decide(&StepObservation { step, current: c, noise: seen });
                if decision != Decision::Keep {
                    assert_eq!(decision, Decision::ChangeBatch(o));
                    return Some(step);
                }
            }
            None
        };
        // First judged worth it at 28 (the first judgement with an estimate after the dwell),
        // then at 32, ..., 44: 16 steps of the same judgement.
        assert_eq!(first_change(80), Some(44));
        // The estimate gone at 40: the judgement at 40 finds no band, and nothing is changed.
        assert_eq!(first_change(39), None);
    }

    /// Thompson's draws try layouts and micro-batches of the running B_g, never another B_g:
    /// with two B_g of equal prior Goodput and a wide belief, no draw of 500 moves the batch.
    #[test]
    fn exploration_never_changes_the_batch() {
        let (c, o) = (Candidate::new(d(1, 1, 1), 8, 8).unwrap(), Candidate::new(d(1, 1, 1), 16, 8).unwrap());
        // At B_simple 8, B_g 16 at 1.5x the speed has the same Goodput as B_g 8 (efficiency
        // 1 / (1 + B / B_simple): 1/2 against 2/3).
        let s = scorer_of(&[(d(1, 1, 1), 8, 8, 100.0), (d(1, 1, 1), 16, 8, 150.0)]);
        let noise = Some(NoiseEstimate { grad_sq: 1.0, trace: 8.0, biased: false, grad_sq_se: 0.0, trace_se: 0.0 });
        let rule = Rule { dwell_steps: 1, window: 8, ..Rule::default() };
        for seed in 0..500 {
            let mut p = Learning::new(s.clone(), rule, &flat(0.3, 0.3), 8, seed).unwrap();
            for step in 1..=8 {
                p.observe_throughput(&c, 100.0);
                let decision = p.decide(&StepObservation { step, current: c, noise });
                assert_ne!(decision, Decision::ChangeBatch(o), "seed {seed}");
            }
        }
    }

    /// On a simulated run over a structured truth, what the belief learned about the
    /// candidates the run measured, and about those it did not, is within two posterior
    /// standard deviations of the drawn truth for most of them.
    #[test]
    fn a_simulated_run_recovers_the_structured_truth() {
        use crate::sim::{SimConfig, SimNoise, simulate, structured};
        use std::sync::Arc;
        let (scorer, _) = crate::policy::test_util::toy();
        let priors = FamilyPriors::default();
        let (mut within, mut total) = (0, 0);
        for seed in 0..8 {
            let truth = structured(&scorer, &priors, 4, seed).unwrap();
            let traj = crate::policy::Trajectory::new(vec![(0.0, 4.0), (2e4, 64.0)], 2e5).unwrap();
            let cfg = SimConfig {
                costs: crate::policy::SwitchCosts { batch: 0.1, layout: 1.0 },
                truth: Arc::new(crate::goodput::PlainGoodput),
                b0: 4.0,
                noise: SimNoise::LogNormal { error: 0.1 },
                warmup_steps: 5,
                max_steps: 100_000,
                seed,
                record_steps: false,
                jitter: 0.1,
            };
            let mut p = Learning::new(scorer.clone(), Rule { layout_cost: 1.0, ..Rule::default() }, &priors, 4, seed).unwrap();
            let start = *scorer.candidates().next().unwrap();
            simulate(&mut p, &truth, &traj, start.0, &cfg).unwrap();
            p.stale = true;
            p.refit();
            for (c, t) in truth.candidates() {
                let y = (t / scorer.prior(c).unwrap()).ln();
                let (m, s) = p.predict(c).unwrap();
                within += usize::from((m - y).abs() <= 2.0 * s);
                total += 1;
            }
            assert!(p.measured.iter().filter(|m| m.n > 0.0).count() >= 2, "seed {seed}: it measured");
        }
        assert!(within as f64 >= 0.85 * total as f64, "{within} of {total} within two standard deviations");
    }

    #[test]
    fn out_of_range_settings_are_named() {
        let s = crate::policy::test_util::toy().0;
        let e = Learning::new(s, Rule { window: 0, ..Rule::default() }, &FamilyPriors::default(), 8, 0).err().unwrap();
        assert!(matches!(e, PolicyError::Bad { field: "window", .. }), "{e}");
    }

    /// A checkpoint of what it learned restores the same belief.
    #[test]
    fn what_it_learned_survives_a_checkpoint() {
        let (s, _) = crate::policy::test_util::toy();
        let mut p = Learning::new(s.clone(), Rule::default(), &FamilyPriors::default(), 4, 0).unwrap();
        let c = *s.candidates().next().map(|(c, _)| c).unwrap();
        for k in 0..20 {
            p.observe_throughput(&c, 50.0 + k as f64);
        }
        p.observe_reconfiguration(3.0, true);
        let state = p.learned();
        let mut q = Learning::new(s.clone(), Rule::default(), &FamilyPriors::default(), 4, 0).unwrap();
        q.restore_learned(&state);
        p.refit();
        q.refit();
        for (x, _) in s.candidates() {
            let (a, b) = (p.predict(x).unwrap(), q.predict(x).unwrap());
            assert!((a.0 - b.0).abs() < 1e-12 && (a.1 - b.1).abs() < 1e-12);
        }
        assert_eq!(q.cost(&c, &Candidate::new(d(2, 2, 1), 4, 1).unwrap()), 3.0);
        // A change of B_g half confirmed stays half confirmed.
        p.seen = Some((c, 7));
        p.wanted = Some((true, 12));
        let mut r = Learning::new(s.clone(), Rule::default(), &FamilyPriors::default(), 4, 0).unwrap();
        r.restore_learned(&p.learned());
        assert_eq!(r.wanted, Some((true, 12)));
        assert_eq!(q.wanted, None, "nothing was being confirmed");
    }
}
