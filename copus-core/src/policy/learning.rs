//! Copus on a structured belief: Goodput over every feasible (S, B_g, B_m), its throughput
//! learned by [`Belief`] (one measurement informs every candidate that shares a family), its
//! exploration by the knowledge gradient (a trial where what one window of measurement can
//! tell is worth its cost), and one decision rule, [`Rule`], of six settings.
//!
//! Every `window` steps (and whenever the configuration changed a window ago) the policy
//! judges, with `H` the seconds the run has left ([`StepObservation::remaining_secs`], else
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
//! 2. **Try.** Otherwise, at the noise estimate's point, each candidate's trial is valued in
//!    closed form: go there, measure it for a window (the belief of `y(c) - y(cur)`, normal
//!    with mean `m` and deviation `s`, narrows by the window's jitter), then keep it or go back,
//!    whichever the measured mean says is worth more over what is left. With `G` lognormal in
//!    the measured mean this is `E[max(G_c e^X R, G_cur (R - back))]`, `R` the seconds after the
//!    window. The trial worth the most is made when its gain over staying reaches `threshold`
//!    of staying's progress, and so does its gain over the better of staying and going
//!    outright (what the window can tell): where the belief is narrow, as under a measured
//!    profile, nothing is tried; where it is wide, as under the analytic prior, candidates of
//!    every B_g are tried, nearest ties and widest beliefs first. A trial starts only once the
//!    running configuration has run `dwell_steps`, and a trial of another B_g is confirmed like
//!    a decided one. After its window, measured into the belief first, a trial is kept or
//!    undone at the measured mean and the noise estimate's point, after the cost of going back
//!    (a trial of another B_g goes back without an estimate). Both moves count as the trial's,
//!    not as decisions. A candidate may be tried again while its belief stays wide enough to
//!    pass the test.
//!
//! A change of B_g is judged only once the running B_g has run `dwell_steps` (its noise
//! estimate has seen the batch); before that, and before there is a usable estimate, only
//! candidates of the running B_g are compared, on throughput. Steps of the running
//! configuration are the belief's measurements: `y = ln(measured / prior)`, their scatter
//! pooled over candidates (the step jitter) giving each candidate's mean its variance.

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
    /// Seconds the run has left, used until the run says ([`StepObservation::remaining_secs`]).
    /// `> 0`.
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
    /// Seconds the run has left, once it has said.
    remaining: Option<f64>,
    /// Running means of the measured layout and batch changes' seconds: (sum, count).
    costs: [(f64, f64); 2],
    /// Layout changes decided (at the lower bound) and made for trials (there and back).
    layouts: (u64, u64),
    /// The configuration running and the step it was first seen at.
    seen: Option<(Candidate, u64)>,
    /// The B_g running and the step it was first seen at.
    batch_seen: Option<(usize, u64)>,
    /// A change of B_g judged worth it (upwards or not) since this step, not yet confirmed.
    wanted: Option<(bool, u64)>,
    /// A trial under way: the candidate it left and the one it measures.
    trial: Option<(Candidate, Candidate)>,
}

impl Learning {
    /// Its mark in a saved [`PolicyState`] (`rule`): the switch rule shares the name `copus`.
    pub const RULE: &'static str = "learning";
    /// B_simple taken as "very large" (statistical efficiency 1 at every batch that matters).
    const PHI_CAP: f64 = 1e9;
    /// The step scatter assumed before measurements pool it (log scale), and the weight of
    /// that assumption in steps.
    const JITTER: (f64, f64) = (0.1, 4.0);

    /// Copus over `scorer`'s candidates and priors, its belief's families with the standard
    /// deviations `priors` on a cluster of `ranks_per_node` ranks to a node. An error if `rule`
    /// is out of range.
    pub fn new(scorer: Scorer, rule: Rule, priors: &FamilyPriors, ranks_per_node: usize) -> Result<Self, PolicyError> {
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
            remaining: None,
            costs: [(0.0, 0.0); 2],
            layouts: (0, 0),
            seen: None,
            batch_seen: None,
            wanted: None,
            trial: None,
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
    /// (a trial's, there and back), apart: trials are not decisions.
    pub fn layout_changes(&self) -> (u64, u64) {
        self.layouts
    }

    /// Takes the seconds the run has left. Where that is not positive and finite (a run past
    /// its budget, or one whose time to go at the running configuration's pace is unbounded
    /// because it makes no progress there), the rule's `horizon` stands in: keeping the last
    /// value instead froze a run that had reached a configuration without progress a moment
    /// before its end at a horizon of a fraction of a second, where no change repays its cost.
    fn set_remaining(&mut self, remaining_secs: f64) {
        self.remaining = (remaining_secs.is_finite() && remaining_secs > 0.0).then_some(remaining_secs);
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
    fn best_change(&self, cur: usize, y_cur: f64, eligible: &[usize], band: &[f64], relative: &dyn Fn(usize) -> f64) -> Option<usize> {
        let h = self.horizon();
        let c0 = self.belief.candidates()[cur];
        let points: Vec<Option<f64>> = if band.is_empty() { vec![None] } else { band.iter().map(|p| Some(*p)).collect() };
        let mut pick = None::<(usize, f64)>;
        for &i in eligible {
            if i == cur {
                continue;
            }
            let c = self.belief.candidates()[i];
            let left = (h - self.cost(&c0, &c)).max(0.0);
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

    /// What a trial of candidate `i` from `cur` is worth over staying, in samples-to-progress
    /// (Goodput x seconds), at B_simple `p`: go there (its cost), measure it for a window, then
    /// keep it or go back (the cost of going back), whichever the measured mean says is worth
    /// more over what is left; with `(m, s)` the belief's mean and standard deviation of
    /// `y(i) - y(cur)`. Returns the trial's gain and the gain of going outright (no way back).
    /// `v` is the variance of one window's mean of `y` (the step jitter over `window` steps).
    fn trial_gain(&self, cur: usize, i: usize, y_cur: f64, (m, s): (f64, f64), p: Option<f64>, v: f64) -> (f64, f64) {
        let h = self.horizon();
        let (c0, c) = (self.belief.candidates()[cur], self.belief.candidates()[i]);
        let (go, back) = (self.cost(&c0, &c), self.cost(&c, &c0));
        let (g_cur, g_i) = (self.value(cur, y_cur, p), self.value(i, y_cur, p));
        let step = c.global_batch as f64 / (self.prior[i] * (y_cur + m).exp());
        // The window ends with the run at the latest: a window valued past the run's end made a
        // trial look worth its trip a moment before the end, whatever it went to.
        let t_w = (self.rule.window as f64 * step).min((h - go).max(0.0));
        // The window's mean of y(i) has variance v: the belief of the difference narrows from
        // s^2 to s1^2, and its mean moves by a normal of variance s^2 - s1^2 before the window.
        let s2 = s * s;
        let s1_2 = if s2 + v > 0.0 { s2 * v / (s2 + v) } else { 0.0 };
        let moved = (s2 - s1_2).max(0.0).sqrt();
        let rest = (h - go - t_w).max(0.0);
        let kept = g_i * (s1_2 / 2.0).exp() * rest;
        let returned = g_cur * (rest - back).max(0.0);
        let after = expected_max_lognormal(kept, m, moved, returned);
        let mean_i = g_i * (m + s2 / 2.0).exp();
        (mean_i * t_w + after - g_cur * h, mean_i * (h - go) - g_cur * h)
    }

    /// The candidate among `eligible` whose trial gains the most (knowledge gradient), at
    /// B_simple `p` (the noise estimate's point; throughput alone without one). A trial is worth
    /// making when its gain over staying reaches `threshold` of staying's progress over the
    /// horizon, and so does what the window can tell: the trial's gain over the better of staying
    /// and going outright. Where the belief is narrow (a measured profile) the second is small
    /// and nothing is tried; a change that is certain is the decision's, at its lower bound.
    fn best_trial(&self, cur: usize, y_cur: f64, eligible: &[usize], p: Option<f64>, differences: &[(f64, f64)]) -> Option<usize> {
        let stay = self.value(cur, y_cur, p) * self.horizon();
        let bar = self.rule.threshold * stay;
        let v = self.jitter_var() / self.rule.window as f64;
        let mut pick = None::<(usize, f64)>;
        for &i in eligible {
            let Some(&d) = differences.get(i) else { continue };
            if i == cur || d.1.is_nan() || d.1 <= 0.0 {
                continue;
            }
            let (trial, outright) = self.trial_gain(cur, i, y_cur, d, p, v);
            // Strictly positive: a trial whose trip alone outlasts the run is never worth it.
            if trial > 0.0 && trial >= bar && trial - outright.max(0.0) >= bar && pick.is_none_or(|(_, g)| trial > g) {
                pick = Some((i, trial));
            }
        }
        pick.map(|(i, _)| i)
    }

    /// The end of a trial: back to where it came from unless staying is worth at least as
    /// much at the measured mean, after the cost of going back. A trial of another B_g is
    /// judged at the point of the noise `band` (without one it goes back); one of the same B_g
    /// on throughput alone. `None` keeps it.
    fn trial_end(&mut self, ci: usize, y_cur: f64, band: Option<[f64; 3]>) -> Option<usize> {
        let (from, to) = self.trial.take()?;
        let cur = self.belief.candidates()[ci];
        if to != cur {
            return None;
        }
        let fi = self.belief.candidates().iter().position(|c| *c == from)?;
        let y_from = self.belief.predict(&from)?.0;
        let p = match band {
            _ if from.global_batch == cur.global_batch => None,
            Some(b) => Some(b[1]),
            None => return Some(fi),
        };
        let h = self.horizon();
        let left = (h - self.cost(&cur, &from)).max(0.0);
        (self.value(ci, y_cur, p) * h < self.value(fi, y_from, p) * left).then_some(fi)
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

    /// The decision to move from `cur` to candidate `i`, counted as a layout change decided or
    /// made for a trial (there or back).
    fn count(&mut self, cur: &Candidate, i: usize, trial: bool) -> Decision {
        let decision = Decision::to(cur, self.belief.candidates()[i]);
        if matches!(decision, Decision::ChangeLayout(_)) {
            if trial { self.layouts.1 += 1 } else { self.layouts.0 += 1 }
        }
        decision
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
        if let Some(r) = obs.remaining_secs {
            self.set_remaining(r);
        }
        let (ran, dwelled) = self.track(obs);
        let r = self.rule;
        if ran < r.window || ran % r.window != 0 {
            return Decision::Keep;
        }
        let Some(ci) = self.belief.candidates().iter().position(|c| *c == cur) else { return Decision::Keep };
        if self.trial.is_some_and(|(_, to)| to == cur) {
            // The trial's window is in the belief before the trial is judged.
            self.refit_at[ci] = 0.0;
        }
        self.refit();
        let estimate = self.band(obs);
        let band = estimate.filter(|_| dwelled >= r.dwell_steps).map_or(Vec::new(), |b| b.to_vec());
        let eligible: Vec<usize> = (0..self.belief.candidates().len())
            .filter(|&i| !band.is_empty() || self.belief.candidates()[i].global_batch == cur.global_batch)
            .filter(|&i| self.prior[i].is_finite())
            .collect();
        let z = r.confidence;
        let y_cur = self.belief.predict(&cur).map_or(0.0, |p| p.0);
        // A trial measured for its window is kept or undone at the measured mean.
        if let Some(back) = self.trial_end(ci, y_cur, estimate) {
            return self.count(&cur, back, true);
        }
        // Decide: at the belief's lower bound of each candidate's throughput relative to cur.
        let differences = self.belief.differences_from(&cur).unwrap_or_default();
        let lower = |i: usize| differences.get(i).map_or(f64::NEG_INFINITY, |(m, s)| m - z * s);
        let decided = self.best_change(ci, y_cur, &eligible, &band, &|i| lower(i) + y_cur);
        // Else a trial, where what one window can tell is worth its cost (knowledge gradient),
        // once the running configuration has been measured for the dwell.
        let (target, trial) = match decided {
            Some(i) => (Some(i), false),
            None if ran >= r.dwell_steps => (self.best_trial(ci, y_cur, &eligible, band.get(1).copied(), &differences), true),
            None => (None, false),
        };
        let Some(i) = self.confirmed(target, &cur, obs.step) else { return Decision::Keep };
        if trial {
            self.trial = Some((cur, self.belief.candidates()[i]));
        }
        self.count(&cur, i, trial)
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

    fn learned(&self) -> PolicyState {
        let mut state = super::interface::learned_by_scorer(Some(&self.scorer));
        state.layout_cost = (self.costs[0].1 > 0.0).then(|| self.costs[0].0 / self.costs[0].1);
        state.seen = self.seen;
        state.batch_seen = self.batch_seen;
        // A change of B_g being confirmed goes on being confirmed after a resume.
        state.winning = self.wanted.zip(self.seen).map(|((up, since), (c, _))| (c.dims, if up { 1 } else { -1 }, since));
        // A trial under way is kept or undone after its window also across a resume.
        if let Some((from, to)) = self.trial {
            (state.trial, state.left) = (Some((to, self.seen.map_or(0, |s| s.1))), Some(from));
        }
        let cands = self.belief.candidates().iter().zip(&self.measured);
        state.belief = cands.filter(|(_, m)| m.n > 0.0).map(|(c, m)| (*c, m.n, m.mean, m.m2)).collect();
        state.rule = Some(Self::RULE.into());
        state
    }

    fn restore_learned(&mut self, state: &PolicyState) {
        super::interface::restore_scorer(Some(&mut self.scorer), state);
        if let Some(c) = state.layout_cost.filter(|c| c.is_finite() && *c >= 0.0) {
            self.costs[0] = (c, 1.0);
        }
        (self.seen, self.batch_seen) = (state.seen, state.batch_seen);
        self.trial = state.trial.zip(state.left).map(|((to, _), from)| (from, to));
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

/// `E[max(a e^X, k)]` for `X ~ N(m, s^2)`, `a, k >= 0`: the lognormal's partial
/// expectation above `k` plus `k` times the chance of staying below it.
fn expected_max_lognormal(a: f64, m: f64, s: f64, k: f64) -> f64 {
    if a <= 0.0 {
        return k.max(0.0);
    }
    if k <= 0.0 {
        return a * (m + s * s / 2.0).exp();
    }
    if s <= 0.0 {
        return (a * m.exp()).max(k);
    }
    let cdf = |x: f64| 0.5 * libm::erfc(-x / std::f64::consts::SQRT_2);
    let cut = (k / a).ln();
    k * cdf((cut - m) / s) + a * (m + s * s / 2.0).exp() * cdf((m + s * s - cut) / s)
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
        StepObservation { step, current, noise: None, remaining_secs: None }
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

    /// A candidate measured to be 30% faster is chosen by the decision itself, at the lower
    /// bound; one measured 10% slower is not (measured, it is not worth a trial either).
    #[test]
    fn a_measured_gain_is_taken_and_a_loss_is_not() {
        let (c, o) = (Candidate::new(d(1, 1, 1), 8, 8).unwrap(), Candidate::new(d(1, 1, 1), 8, 4).unwrap());
        let s = scorer_of(&[(d(1, 1, 1), 8, 8, 100.0), (d(1, 1, 1), 8, 4, 100.0)]);
        for (speed, wanted) in [(130.0, Decision::ChangeBatch(o)), (90.0, Decision::Keep)] {
            let mut p = Learning::new(s.clone(), Rule::default(), &flat(0.3, 0.1), 8).unwrap();
            for _ in 0..64 {
                p.observe_throughput(&o, speed);
            }
            p.stale = true;
            assert_eq!(run(&mut p, c, 100.0, 64), wanted, "{speed}");
        }
    }

    /// A layout change that is measured to be 10% faster is made when the run has an hour
    /// left and not when it has 60 s, with the change costing 10 s (it repays in 100 s).
    #[test]
    fn a_layout_change_must_repay_its_cost_over_what_is_left() {
        let (c, o) = (Candidate::new(d(2, 1, 1), 8, 4).unwrap(), Candidate::new(d(1, 2, 1), 8, 8).unwrap());
        let s = scorer_of(&[(d(2, 1, 1), 8, 4, 100.0), (d(1, 2, 1), 8, 8, 100.0)]);
        for (left, wanted) in [(3600.0, Decision::ChangeLayout(o)), (60.0, Decision::Keep)] {
            let mut p = Learning::new(s.clone(), Rule { layout_cost: 10.0, ..Rule::default() }, &flat(0.3, 0.01), 8).unwrap();
            for _ in 0..64 {
                p.observe_throughput(&o, 110.0);
            }
            p.set_remaining(left);
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
            let mut p = Learning::new(s.clone(), rule, &flat(0.01, 0.01), 8).unwrap();
            for step in 1..=80 {
                p.observe_throughput(&c, 100.0);
                let seen = (24 < step && step <= estimate_until).then_some(noise).flatten();
                let decision = p.decide(&StepObservation { step, current: c, noise: seen, remaining_secs: None });
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

    /// A trial of another B_g waits for the dwell and is confirmed like a decided change of
    /// B_g: at B_simple 8, B_g 16 at 1.5x the speed has the same Goodput as B_g 8 (efficiency
    /// 1 / (1 + B / B_simple): 1/2 against 2/3), so with a wide belief its trial is worth a
    /// window; judged every 4 steps, first at 16 (the dwell), it goes ahead at 32.
    #[test]
    fn a_trial_of_another_batch_waits_for_the_dwell_and_is_confirmed() {
        let (c, o) = (Candidate::new(d(1, 1, 1), 8, 8).unwrap(), Candidate::new(d(1, 1, 1), 16, 8).unwrap());
        let s = scorer_of(&[(d(1, 1, 1), 8, 8, 100.0), (d(1, 1, 1), 16, 8, 150.0)]);
        let noise = Some(NoiseEstimate { grad_sq: 1.0, trace: 8.0, biased: false, grad_sq_se: 0.0, trace_se: 0.0 });
        let rule = Rule { dwell_steps: 16, window: 4, ..Rule::default() };
        let mut p = Learning::new(s.clone(), rule, &flat(0.3, 0.3), 8).unwrap();
        p.set_remaining(3600.0);
        let first = (1..=64).find_map(|step| {
            p.observe_throughput(&c, 100.0);
            let decision = p.decide(&StepObservation { step, current: c, noise, remaining_secs: None });
            (decision != Decision::Keep).then_some((step, decision))
        });
        assert_eq!(first, Some((32, Decision::ChangeBatch(o))));
        assert_eq!(p.trial, Some((c, o)), "a trial, kept or undone after its window");
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
            let mut p = Learning::new(scorer.clone(), Rule { layout_cost: 1.0, ..Rule::default() }, &priors, 4).unwrap();
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

    /// `E[max(a e^X, k)]` in closed form against a quadrature of the normal density.
    #[test]
    fn the_expected_maximum_is_the_integral() {
        for (a, m, s, k) in [(1.0, 0.0, 0.3, 1.0), (2.0, -0.4, 0.2, 1.5), (0.5, 0.3, 0.05, 0.7), (1.0, 0.1, 0.0, 0.9), (1.0, 0.0, 0.2, 0.0)]
        {
            let (n, lo, hi) = (200_000, -10.0, 10.0);
            let dz = (hi - lo) / n as f64;
            let numeric: f64 = (0..n)
                .map(|j| {
                    let z = lo + (j as f64 + 0.5) * dz;
                    let density = (-z * z / 2.0).exp() / (2.0 * std::f64::consts::PI).sqrt();
                    (a * (m + s * z).exp()).max(k) * density * dz
                })
                .sum();
            let closed = expected_max_lognormal(a, m, s, k);
            assert!((closed - numeric).abs() < 1e-6 * numeric.max(1.0), "{a} {m} {s} {k}: {closed} against {numeric}");
        }
    }

    /// A running layout measured, another unmeasured behind a wide belief, a layout change of
    /// 10 s and 600 s left.
    fn two_layouts(global: f64, own: f64) -> (Learning, Candidate, Candidate) {
        two_layouts_with(global, own, 0.05)
    }

    /// [`two_layouts`] with the running layout's steps `scatter` apart (relative).
    fn two_layouts_with(global: f64, own: f64, scatter: f64) -> (Learning, Candidate, Candidate) {
        let (c, o) = (Candidate::new(d(2, 1, 1), 8, 4).unwrap(), Candidate::new(d(1, 2, 1), 8, 8).unwrap());
        let s = scorer_of(&[(d(2, 1, 1), 8, 4, 100.0), (d(1, 2, 1), 8, 8, 100.0)]);
        let mut p = Learning::new(s, Rule { layout_cost: 10.0, ..Rule::default() }, &flat(global, own), 8).unwrap();
        for k in 0..32 {
            p.observe_throughput(&c, 100.0 * (1.0 + scatter * ((k % 4) as f64 - 1.5)));
        }
        p.set_remaining(600.0);
        p.refit();
        (p, c, o)
    }

    /// The trial's gain in closed form against a simulation of the trial itself: the true
    /// difference drawn from the belief, a window's mean measured with the jitter, the belief
    /// updated by hand, kept when the updated mean is worth more than going back, and the
    /// progress of the way there, the window and the rest counted against staying. Twice: a
    /// wide belief and a quiet measurement, then a narrow belief and a noisy one (where the
    /// window tells about half of what is unknown).
    #[test]
    fn a_trials_gain_is_what_simulating_the_trial_gives() {
        for (global, own, scatter) in [(0.3, 0.2, 0.05), (0.05, 0.04, 0.4)] {
            the_trials_gain_is_simulated(global, own, scatter);
        }
    }

    fn the_trials_gain_is_simulated(global: f64, own: f64, scatter: f64) {
        use rand_distr::{Distribution, StandardNormal};
        let (p, c, o) = two_layouts_with(global, own, scatter);
        let (ci, oi) = (0, 1);
        assert_eq!((p.belief.candidates()[ci], p.belief.candidates()[oi]), (c, o));
        let (m, s) = p.belief.predict_difference(&o, &c).unwrap();
        let y_cur = p.predict(&c).unwrap().0;
        let v = p.jitter_var() / p.rule.window as f64;
        let (gain, outright) = p.trial_gain(ci, oi, y_cur, (m, s), None, v);
        // By hand: throughputs at the belief's mean of cur, the trial's window at o's mean.
        let (g_cur, g_o) = (100.0 * y_cur.exp(), 100.0 * y_cur.exp());
        let (h, go, back) = (600.0, 10.0, 10.0);
        let t_w = 8.0 * 8.0 / (100.0 * (y_cur + m).exp());
        let rest = h - go - t_w;
        let k = s * s / (s * s + v);
        let s1 = (s * s * v / (s * s + v)).sqrt();
        let mut rng = <rand::rngs::StdRng as rand::SeedableRng>::seed_from_u64(5);
        let n = 400_000;
        let (mut sum, mut sum2) = (0.0, 0.0);
        for _ in 0..n {
            let z1: f64 = StandardNormal.sample(&mut rng);
            let z2: f64 = StandardNormal.sample(&mut rng);
            let truth = m + s * z1;
            let seen = truth + v.sqrt() * z2;
            let updated = m + k * (seen - m);
            let keep = g_o * (updated + s1 * s1 / 2.0).exp() * rest >= g_cur * (rest - back);
            let progress = g_o * truth.exp() * t_w + if keep { g_o * truth.exp() * rest } else { g_cur * (rest - back) };
            let x = progress - g_cur * h;
            (sum, sum2) = (sum + x, sum2 + x * x);
        }
        let mean = sum / n as f64;
        let se = ((sum2 / n as f64 - mean * mean) / n as f64).sqrt();
        assert!((gain - mean).abs() < 4.0 * se, "closed form {gain:.2}, simulated {mean:.2} +- {se:.2}");
        // Going outright has no way back: its gain is the mean's, and the trial is worth more.
        let by_hand = g_o * (m + s * s / 2.0).exp() * (h - go) - g_cur * h;
        assert!((outright - by_hand).abs() < 1e-9 * by_hand.abs().max(1.0));
        assert!(gain > outright, "{gain} {outright}");
        assert!(v > 0.2 * s * s || gain > 0.0, "the quiet case is worth a trial: {gain}");
    }

    /// The knowledge-gradient choice on two candidates: with a wide belief about the other
    /// layout the window's information is worth the trip there and back, so it is tried, and
    /// undone when measured slower (both moves counted as trials, not decisions); with a
    /// narrow belief, or 30 s left, it is not tried.
    #[test]
    fn a_trial_is_made_where_a_window_can_change_the_choice() {
        // Judged every 8 steps, a trial starts at the first judgement after the dwell (20): 24.
        let (mut p, c, o) = two_layouts(0.3, 0.2);
        assert_eq!(run(&mut p, c, 100.0, 24), Decision::ChangeLayout(o));
        assert_eq!(run(&mut p, o, 80.0, 8), Decision::ChangeLayout(c), "measured 20% slower: back");
        assert_eq!(p.layout_changes(), (0, 2));
        let (mut p, c, _) = two_layouts(0.3, 0.2);
        assert_eq!(run(&mut p, c, 100.0, 16), Decision::Keep, "not before the dwell");
        let (mut p, c, o) = two_layouts(0.3, 0.2);
        assert_eq!(run(&mut p, c, 100.0, 24), Decision::ChangeLayout(o));
        assert_eq!(run(&mut p, o, 120.0, 8), Decision::Keep, "measured 20% faster: kept");
        let (mut narrow, c, _) = two_layouts(0.005, 0.005);
        assert_eq!(run(&mut narrow, c, 100.0, 24), Decision::Keep);
        let (mut short, c, _) = two_layouts(0.3, 0.2);
        short.set_remaining(30.0);
        assert_eq!(run(&mut short, c, 100.0, 24), Decision::Keep);
        // A moment before the end (less than the trip there), nothing is worth trying: the
        // window's progress counts only up to the run's end.
        let (mut ending, c, _) = two_layouts(0.3, 0.2);
        ending.set_remaining(0.05);
        assert_eq!(run(&mut ending, c, 100.0, 24), Decision::Keep);
    }

    /// Without a usable time to go (past the budget, or unbounded at a configuration that
    /// makes no progress) the rule's horizon stands in, not the last value seen.
    #[test]
    fn an_unusable_time_to_go_falls_back_to_the_rules_horizon() {
        let (mut p, _, _) = two_layouts(0.3, 0.2);
        assert_eq!(p.horizon(), 600.0);
        for unusable in [f64::INFINITY, 0.0, -5.0, f64::NAN] {
            p.set_remaining(0.05);
            p.set_remaining(unusable);
            assert_eq!(p.horizon(), p.rule.horizon, "{unusable}");
        }
    }

    /// A trial of a candidate measured before is judged on its new window: measured 24 steps
    /// at the running speed, then tried again and measured 40% slower for 8 steps, it is undone
    /// (its 32 steps would not move the belief's refit on their own: that waits for 36).
    #[test]
    fn a_trial_is_judged_on_its_own_window() {
        let (mut p, c, o) = two_layouts(0.3, 0.2);
        for _ in 0..24 {
            p.observe_throughput(&o, 100.0);
        }
        p.refit();
        p.trial = Some((c, o));
        assert_eq!(run(&mut p, o, 60.0, 8), Decision::ChangeLayout(c));
    }

    #[test]
    fn out_of_range_settings_are_named() {
        let s = crate::policy::test_util::toy().0;
        let e = Learning::new(s, Rule { window: 0, ..Rule::default() }, &FamilyPriors::default(), 8).err().unwrap();
        assert!(matches!(e, PolicyError::Bad { field: "window", .. }), "{e}");
    }

    /// A checkpoint of what it learned restores the same belief.
    #[test]
    fn what_it_learned_survives_a_checkpoint() {
        let (s, _) = crate::policy::test_util::toy();
        let mut p = Learning::new(s.clone(), Rule::default(), &FamilyPriors::default(), 4).unwrap();
        let c = *s.candidates().next().map(|(c, _)| c).unwrap();
        for k in 0..20 {
            p.observe_throughput(&c, 50.0 + k as f64);
        }
        p.observe_reconfiguration(3.0, true);
        let state = p.learned();
        let mut q = Learning::new(s.clone(), Rule::default(), &FamilyPriors::default(), 4).unwrap();
        q.restore_learned(&state);
        p.refit();
        q.refit();
        for (x, _) in s.candidates() {
            let (a, b) = (p.predict(x).unwrap(), q.predict(x).unwrap());
            assert!((a.0 - b.0).abs() < 1e-12 && (a.1 - b.1).abs() < 1e-12);
        }
        assert_eq!(q.cost(&c, &Candidate::new(d(2, 2, 1), 4, 1).unwrap()), 3.0);
        // A change of B_g half confirmed stays half confirmed, and a trial stays a trial.
        let o = *s.candidates().nth(1).map(|(c, _)| c).unwrap();
        p.seen = Some((c, 7));
        p.wanted = Some((true, 12));
        p.trial = Some((o, c));
        let mut r = Learning::new(s.clone(), Rule::default(), &FamilyPriors::default(), 4).unwrap();
        r.restore_learned(&p.learned());
        assert_eq!(r.wanted, Some((true, 12)));
        assert_eq!(r.trial, Some((o, c)));
        assert_eq!((q.wanted, q.trial), (None, None), "nothing was being confirmed or tried");
    }
}
