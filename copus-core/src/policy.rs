//! Policies: after each optimizer step, keep the configuration, change the batch (same layout),
//! or change the layout. All choose among the feasible candidates only, so a decision is always
//! something copus-core accepted.
//!
//! - [`Static`]: never changes.
//! - [`CbsFixedLayout`]: B_g near `c * B_simple` on a fixed layout.
//! - [`MerrillWarmup`]: doubles B_g when the critical batch passes `2 * B_g` (sqrt LR rule).
//! - [`DpOnlyGoodput`]: AdaptDL-like: best Goodput over (B_g, B_m) on a fixed layout.
//! - [`Copus`]: best Goodput over all candidates, with switch thresholds and a payback test for
//!   layout changes.
//! - [`hindsight_oracle`]: the best schedule for a known noise trajectory, by dynamic
//!   programming, and [`schedule_time`] to cost any schedule on the same terms (regret).

use std::collections::HashMap;
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::candidates::Candidate;
use crate::gns::NoiseEstimate;
use crate::goodput::{Objective, PlainGoodput};
use crate::layout::ParallelDims;
use crate::throughput::ThroughputModel;

/// What a policy sees after a step.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct StepObservation {
    /// Optimizer steps done.
    pub step: u64,
    /// Configuration that ran the step.
    pub current: Candidate,
    /// Smoothed noise estimate, once there is one.
    pub noise: Option<NoiseEstimate>,
}

impl StepObservation {
    /// B_simple of the smoothed estimate; `None` before one exists or while noise dominates.
    pub fn b_simple(&self) -> Option<f64> {
        self.noise.and_then(|n| n.b_simple())
    }
}

/// A policy's answer.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub enum Decision {
    /// Keep the configuration.
    Keep,
    /// Same layout, new B_g and/or B_m.
    ChangeBatch(Candidate),
    /// New layout (and possibly batch).
    ChangeLayout(Candidate),
}

impl Decision {
    fn to(current: &Candidate, target: Candidate) -> Self {
        if target == *current {
            Decision::Keep
        } else if target.layout_differs(current) {
            Decision::ChangeLayout(target)
        } else {
            Decision::ChangeBatch(target)
        }
    }

    /// The configuration after the decision.
    pub fn target(&self, current: Candidate) -> Candidate {
        match *self {
            Decision::Keep => current,
            Decision::ChangeBatch(c) | Decision::ChangeLayout(c) => c,
        }
    }
}

/// Decides configuration changes from step observations.
pub trait Policy: Send {
    /// Name for reports.
    fn name(&self) -> String;
    /// The decision after a step.
    fn decide(&mut self, obs: &StepObservation) -> Decision;
    /// Tells the policy what a reconfiguration really cost, in seconds on the run's clock.
    fn observe_reconfiguration(&mut self, _seconds: f64, _layout_changed: bool) {}
    /// Tells the policy the samples/s a step of `candidate` achieved on the run's clock; a
    /// policy with a [`Scorer`] learns from it ([`Scorer::observe_throughput`]).
    fn observe_throughput(&mut self, _candidate: &Candidate, _samples_per_sec: f64) {}
    /// What the policy has learned during the run (measured throughput, switch costs), for a
    /// whole-run checkpoint. Settings given at construction are not part of it.
    fn learned(&self) -> PolicyState {
        PolicyState::default()
    }
    /// Continues from a [`Policy::learned`] of the same policy over the same candidates.
    fn restore_learned(&mut self, _state: &PolicyState) {}
}

/// What a policy learned during a run; see [`Policy::learned`].
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct PolicyState {
    /// Smoothed measured samples/s of the candidates the run has run.
    #[serde(default)]
    pub measured: Vec<(Candidate, f64)>,
    /// The estimated seconds of a layout change, when the policy learns it.
    #[serde(default)]
    pub layout_cost: Option<f64>,
    /// The configuration running and the step it started at (dwell time).
    #[serde(default)]
    pub seen: Option<(Candidate, u64)>,
    /// The configuration before the last change (hysteresis).
    #[serde(default)]
    pub left: Option<Candidate>,
    /// The layout before the last layout change (hysteresis).
    #[serde(default)]
    pub left_layout: Option<ParallelDims>,
    /// The change wanted at every judgement since a step: layout, batch direction (-1, 0, 1)
    /// and that step.
    #[serde(default)]
    pub winning: Option<(ParallelDims, i8, u64)>,
}

/// Bad policy settings.
#[derive(Clone, Debug, PartialEq, Error)]
pub enum PolicyError {
    /// No candidate has a throughput.
    #[error("no feasible candidate has a throughput; check the world size, batch lists and memory")]
    NoCandidates,
    /// A number out of range.
    #[error("`{field}` must be {allowed}, got {value}")]
    Bad {
        /// Setting.
        field: &'static str,
        /// Allowed range.
        allowed: &'static str,
        /// Value given.
        value: f64,
    },
    /// The fixed layout has no candidate.
    #[error("layout {0} has no feasible candidate")]
    NoLayout(ParallelDims),
}

fn check(field: &'static str, value: f64, ok: bool, allowed: &'static str) -> Result<(), PolicyError> {
    if ok && value.is_finite() { Ok(()) } else { Err(PolicyError::Bad { field, allowed, value }) }
}

/// Candidates with their predicted throughput; shared by the policies.
#[derive(Clone)]
pub struct Scorer {
    entries: Vec<(Candidate, f64)>,
    /// The throughput model's value of each entry.
    prior: Vec<f64>,
    /// Smoothed measured samples/s of each entry the run has run.
    measured: Vec<Option<f64>>,
    /// Reference batch B0 of statistical efficiency.
    pub b0: f64,
    objective: Arc<dyn Objective>,
}

/// One candidate's score.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Score {
    /// The candidate.
    pub candidate: Candidate,
    /// Predicted samples/s.
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
        let entries: Vec<_> = candidates
            .iter()
            .filter_map(|c| throughput.samples_per_sec(c).filter(|t| *t > 0.0 && t.is_finite()).map(|t| (*c, t)))
            .collect();
        if entries.is_empty() {
            return Err(PolicyError::NoCandidates);
        }
        let prior = entries.iter().map(|e| e.1).collect();
        let measured = vec![None; entries.len()];
        Ok(Self { entries, prior, measured, b0, objective })
    }

    /// Plain Goodput with reference batch `b0`.
    pub fn plain(candidates: &[Candidate], throughput: &dyn ThroughputModel, b0: f64) -> Result<Self, PolicyError> {
        Self::new(candidates, throughput, b0, Arc::new(PlainGoodput))
    }

    /// Learns throughput online from a step of `c` that ran at `samples_per_sec`. A candidate
    /// the run has run is scored by its own measurements (an EMA with weight
    /// [`Self::THROUGHPUT_SMOOTHING`] on the newest); every other candidate by its prior times
    /// the geometric mean of measured / prior over the run ones, so a prior that is off by a
    /// constant factor (another machine, the analytic model) is corrected from the first
    /// measurement. Non-positive or non-finite measurements and non-candidates are ignored.
    pub fn observe_throughput(&mut self, c: &Candidate, samples_per_sec: f64) {
        if !(samples_per_sec.is_finite() && samples_per_sec > 0.0) {
            return;
        }
        let Some(i) = self.entries.iter().position(|(d, _)| d == c) else { return };
        let w = Self::THROUGHPUT_SMOOTHING;
        self.measured[i] = Some(self.measured[i].map_or(samples_per_sec, |m| (1.0 - w) * m + w * samples_per_sec));
        self.rescale();
    }

    /// The smoothed measurements of the candidates the run has run, in candidate order.
    pub fn measured(&self) -> Vec<(Candidate, f64)> {
        self.entries.iter().zip(&self.measured).filter_map(|((c, _), m)| m.map(|m| (*c, m))).collect()
    }

    /// Replaces the measurements by `measured` (from [`Self::measured`]) and rescales the rest,
    /// as if they had been observed; entries that are not candidates are ignored.
    pub fn set_measured(&mut self, measured: &[(Candidate, f64)]) {
        self.measured = vec![None; self.entries.len()];
        for (c, m) in measured {
            if let Some(i) = self.entries.iter().position(|(d, _)| d == c)
                && m.is_finite()
                && *m > 0.0
            {
                self.measured[i] = Some(*m);
            }
        }
        self.rescale();
    }

    /// Each entry's throughput from its measurement, else its prior times the geometric mean of
    /// measured / prior.
    fn rescale(&mut self) {
        let logs: Vec<f64> = self.measured.iter().zip(&self.prior).filter_map(|(m, p)| m.map(|m| (m / p).ln())).collect();
        let scale = if logs.is_empty() { 1.0 } else { (logs.iter().sum::<f64>() / logs.len() as f64).exp() };
        for ((entry, prior), measured) in self.entries.iter_mut().zip(&self.prior).zip(&self.measured) {
            entry.1 = measured.unwrap_or(prior * scale);
        }
    }

    /// Weight of the newest measurement in [`Self::observe_throughput`]'s EMA.
    pub const THROUGHPUT_SMOOTHING: f64 = 0.5;

    /// The candidates with throughputs.
    pub fn candidates(&self) -> impl Iterator<Item = &(Candidate, f64)> {
        self.entries.iter()
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

/// Never changes anything.
#[derive(Clone, Debug, Default)]
pub struct Static;

impl Policy for Static {
    fn name(&self) -> String {
        "static".into()
    }
    fn decide(&mut self, _obs: &StepObservation) -> Decision {
        Decision::Keep
    }
}

/// Critical-batch-size rule on a fixed layout: B_g tracks `c * B_simple` (never shrinking when
/// `monotone`), with the fastest B_m for that B_g.
#[derive(Clone)]
pub struct CbsFixedLayout {
    scorer: Scorer,
    layout: ParallelDims,
    c: f64,
    monotone: bool,
}

impl CbsFixedLayout {
    /// `c` scales B_simple to the target batch (McCandlish: B_crit ~ B_simple).
    pub fn new(scorer: Scorer, layout: ParallelDims, c: f64, monotone: bool) -> Result<Self, PolicyError> {
        check("c", c, c > 0.0, "a positive number")?;
        if !scorer.candidates().any(|(x, _)| x.dims == layout) {
            return Err(PolicyError::NoLayout(layout));
        }
        Ok(Self { scorer, layout, c, monotone })
    }
}

impl Policy for CbsFixedLayout {
    fn name(&self) -> String {
        format!("cbs(c={}, {})", self.c, self.layout)
    }
    fn observe_throughput(&mut self, candidate: &Candidate, samples_per_sec: f64) {
        self.scorer.observe_throughput(candidate, samples_per_sec);
    }
    fn learned(&self) -> PolicyState {
        PolicyState { measured: self.scorer.measured(), ..PolicyState::default() }
    }
    fn restore_learned(&mut self, state: &PolicyState) {
        self.scorer.set_measured(&state.measured);
    }
    fn decide(&mut self, obs: &StepObservation) -> Decision {
        let Some(phi) = obs.b_simple() else { return Decision::Keep };
        let target = (self.c * phi).max(1.0);
        let floor = if self.monotone { obs.current.global_batch } else { 0 };
        let best_b = self
            .scorer
            .candidates()
            .filter(|(x, _)| x.dims == self.layout && x.global_batch >= floor)
            .map(|(x, _)| x.global_batch)
            .min_by(|a, b| ((*a as f64) / target).ln().abs().total_cmp(&((*b as f64) / target).ln().abs()).then(a.cmp(b)));
        match best_b.and_then(|b| self.scorer.fastest(self.layout, b)) {
            Some(t) if t.global_batch != obs.current.global_batch || obs.current.dims != self.layout => Decision::to(&obs.current, t),
            _ => Decision::Keep,
        }
    }
}

/// Batch-size warmup after Merrill et al.: double B_g when the critical batch (B_simple) passes
/// twice the current B_g; the engine's sqrt LR rule then scales the rate by sqrt 2.
#[derive(Clone)]
pub struct MerrillWarmup {
    scorer: Scorer,
}

impl MerrillWarmup {
    /// Uses the current layout; doubles only to B_g that are candidates on it.
    pub fn new(scorer: Scorer) -> Self {
        Self { scorer }
    }
}

impl Policy for MerrillWarmup {
    fn name(&self) -> String {
        "merrill-warmup".into()
    }
    fn observe_throughput(&mut self, candidate: &Candidate, samples_per_sec: f64) {
        self.scorer.observe_throughput(candidate, samples_per_sec);
    }
    fn learned(&self) -> PolicyState {
        PolicyState { measured: self.scorer.measured(), ..PolicyState::default() }
    }
    fn restore_learned(&mut self, state: &PolicyState) {
        self.scorer.set_measured(&state.measured);
    }
    fn decide(&mut self, obs: &StepObservation) -> Decision {
        let Some(phi) = obs.b_simple() else { return Decision::Keep };
        let b = obs.current.global_batch;
        if phi <= 2.0 * b as f64 {
            return Decision::Keep;
        }
        match self.scorer.fastest(obs.current.dims, 2 * b) {
            Some(t) => Decision::ChangeBatch(t),
            None => Decision::Keep,
        }
    }
}

/// Thresholds of the Goodput policies.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct SwitchRule {
    /// Relative Goodput gain needed to change the batch (same layout).
    pub batch_threshold: f64,
    /// Relative Goodput gain needed to change the layout.
    pub layout_threshold: f64,
    /// Seconds within which a layout change must repay its cost.
    pub horizon: f64,
    /// Estimated seconds of one layout change (updated from measurements).
    pub layout_cost: f64,
    /// Weight of a new measurement in the cost estimate.
    pub cost_smoothing: f64,
    /// Standard errors of the noise estimate a change must hold across: a switch is made only
    /// when it pays at B_simple `z` standard errors below, at, and above the estimate.
    #[serde(default = "default_confidence")]
    pub confidence: f64,
    /// Steps a configuration runs before the next change (the run's first included), so the
    /// smoothed estimate has seen the configuration it judges.
    #[serde(default = "default_min_dwell")]
    pub min_dwell_steps: u64,
    /// Consecutive decisions a change must win (to the same layout, in the same batch
    /// direction) before it is made: the smoothed estimate's errors last about its EMA window,
    /// so a change that only wins during one excursion is not made.
    #[serde(default = "default_confirm")]
    pub confirm_steps: u64,
}

fn default_confirm() -> u64 {
    20
}

fn default_confidence() -> f64 {
    1.0
}

fn default_min_dwell() -> u64 {
    20
}

impl Default for SwitchRule {
    fn default() -> Self {
        Self {
            batch_threshold: 0.02,
            layout_threshold: 0.05,
            horizon: 600.0,
            layout_cost: 10.0,
            cost_smoothing: 0.5,
            confidence: default_confidence(),
            min_dwell_steps: default_min_dwell(),
            confirm_steps: default_confirm(),
        }
    }
}

impl SwitchRule {
    /// Checks the ranges.
    pub fn validate(&self) -> Result<(), PolicyError> {
        check("batch_threshold", self.batch_threshold, self.batch_threshold >= 0.0, ">= 0")?;
        check("layout_threshold", self.layout_threshold, self.layout_threshold >= 0.0, ">= 0")?;
        check("horizon", self.horizon, self.horizon > 0.0, "> 0 seconds")?;
        check("layout_cost", self.layout_cost, self.layout_cost >= 0.0, ">= 0 seconds")?;
        check("cost_smoothing", self.cost_smoothing, (0.0..=1.0).contains(&self.cost_smoothing), "in [0, 1]")?;
        check("confidence", self.confidence, self.confidence >= 0.0, ">= 0 standard errors")
    }
}

/// AdaptDL/Pollux-like: the best Goodput over (B_g, B_m) on the current layout.
#[derive(Clone)]
pub struct DpOnlyGoodput {
    scorer: Scorer,
    rule: SwitchRule,
}

impl DpOnlyGoodput {
    /// With the batch threshold of `rule`.
    pub fn new(scorer: Scorer, rule: SwitchRule) -> Result<Self, PolicyError> {
        rule.validate()?;
        Ok(Self { scorer, rule })
    }
}

impl Policy for DpOnlyGoodput {
    fn name(&self) -> String {
        "dp-only-goodput".into()
    }
    fn observe_throughput(&mut self, candidate: &Candidate, samples_per_sec: f64) {
        self.scorer.observe_throughput(candidate, samples_per_sec);
    }
    fn learned(&self) -> PolicyState {
        PolicyState { measured: self.scorer.measured(), ..PolicyState::default() }
    }
    fn restore_learned(&mut self, state: &PolicyState) {
        self.scorer.set_measured(&state.measured);
    }
    fn decide(&mut self, obs: &StepObservation) -> Decision {
        let Some(phi) = obs.b_simple() else { return Decision::Keep };
        let cur = &obs.current;
        let Some(best) = self.scorer.best(phi, |c| c.dims == cur.dims) else { return Decision::Keep };
        let now = self.scorer.throughput(cur).map_or(0.0, |t| self.scorer.goodput(t, cur.global_batch, phi));
        if best.goodput > now * (1.0 + self.rule.batch_threshold) { Decision::to(cur, best.candidate) } else { Decision::Keep }
    }
}

/// The COPUS policy: Goodput over every feasible (S, B_g, B_m), with decisions that hold
/// under the noise estimate's uncertainty.
///
/// A layout change must beat the current configuration by `layout_threshold` and repay its
/// estimated cost within `horizon` at B_simple `confidence` standard errors below, at and
/// above the estimate; a batch change must beat it by `batch_threshold` at all three. The band
/// comes from the standard errors of the smoothed |G|^2 and tr(Sigma), so a small batch under
/// large noise, whose |G|^2 estimate is often non-positive, still bounds B_simple from below. A
/// change is made once it has been wanted at every judgement over `confirm_steps` steps, a
/// configuration runs `min_dwell_steps` before the next change, and going back to the
/// configuration (or, for a layout change, the layout) the run just left needs twice the
/// threshold and twice the confirmation, so two near-equal configurations do not alternate. The layout cost is the policy's own running estimate,
/// starting from `rule.layout_cost` and updated from each measured layout change.
#[derive(Clone)]
pub struct Copus {
    scorer: Scorer,
    rule: SwitchRule,
    /// The configuration seen last and the step it was first seen at.
    seen: Option<(Candidate, u64)>,
    /// The configuration before the last change.
    left: Option<Candidate>,
    /// The layout before the last layout change.
    left_layout: Option<ParallelDims>,
    /// The change wanted at every judgement since a step: (layout, batch direction, step).
    winning: Option<(ParallelDims, std::cmp::Ordering, u64)>,
}

impl Copus {
    /// With switch thresholds and payback horizon from `rule`.
    pub fn new(scorer: Scorer, rule: SwitchRule) -> Result<Self, PolicyError> {
        rule.validate()?;
        Ok(Self { scorer, rule, seen: None, left: None, left_layout: None, winning: None })
    }

    /// B_simple taken as "very large" (statistical efficiency 1 at every batch that matters).
    const PHI_CAP: f64 = 1e9;

    /// `wanted` once the same kind of change (layout, batch direction) has been the one wanted
    /// at every judgement over `confirm_steps` steps (twice the rule's for going back);
    /// `Keep` until then. A judgement for
    /// keeping, or for another change, starts the count again; steps without a usable
    /// estimate make no judgement.
    fn confirmed(&mut self, step: u64, cur: &Candidate, wanted: Decision, confirm_steps: u64) -> Decision {
        let target = wanted.target(*cur);
        if target == *cur {
            self.winning = None;
            return Decision::Keep;
        }
        let key = (target.dims, target.global_batch.cmp(&cur.global_batch));
        let since = match self.winning {
            Some((d, o, since)) if (d, o) == key => since,
            _ => step,
        };
        self.winning = Some((key.0, key.1, since));
        if step.saturating_sub(since) + 1 >= confirm_steps {
            self.winning = None;
            wanted
        } else {
            Decision::Keep
        }
    }

    fn goodput_at(&self, c: &Candidate, phi: f64) -> f64 {
        self.scorer.throughput(c).map_or(0.0, |t| self.scorer.goodput(t, c.global_batch, phi))
    }

    /// The current estimate of a layout change's cost, seconds.
    pub fn layout_cost(&self) -> f64 {
        self.rule.layout_cost
    }

    /// The scorer (for reports: every candidate's score).
    pub fn scorer(&self) -> &Scorer {
        &self.scorer
    }
}

impl Policy for Copus {
    fn name(&self) -> String {
        "copus".into()
    }

    fn decide(&mut self, obs: &StepObservation) -> Decision {
        let cur = obs.current;
        match self.seen {
            Some((c, _)) if c == cur => {}
            previous => {
                self.left = previous.map(|p| p.0);
                if let Some(l) = self.left.filter(|l| l.dims != cur.dims) {
                    self.left_layout = Some(l.dims);
                }
                self.seen = Some((cur, obs.step));
            }
        }
        let since = self.seen.map_or(0, |s| s.1);
        if obs.step.saturating_sub(since) + 1 < self.rule.min_dwell_steps {
            return Decision::Keep;
        }
        // The band of B_simple the estimate allows; the point estimate, or the band's low end
        // while the smoothed |G|^2 is not positive. An infinite high end is a very large one.
        // No usable estimate this step: no judgement, and the run of confirmations goes on
        // (at a small batch under large noise this is frequent, and resetting would trap the
        // run there).
        let Some((low, high)) = obs.noise.and_then(|n| n.b_simple_band(self.rule.confidence)) else { return Decision::Keep };
        let phi = obs.b_simple().unwrap_or(low);
        let band = [low, phi, high.min(Self::PHI_CAP)];
        let r = self.rule;
        // Back to the configuration the run left, or (for a layout change) to its layout.
        let back = |t: &Candidate| self.left == Some(*t) || (t.dims != cur.dims && self.left_layout == Some(t.dims));
        let threshold = |t: &Candidate, base: f64| if back(t) { 2.0 * base } else { base };
        // Best other layout at the estimate; it must repay across the band.
        if let Some(o) = self.scorer.best(phi, |c| c.dims != cur.dims) {
            let th = threshold(&o.candidate, r.layout_threshold);
            let holds = band.iter().all(|&p| {
                let now = self.goodput_at(&cur, p);
                let stay = self.scorer.best(p, |c| c.dims == cur.dims).map_or(now, |s| s.goodput.max(now));
                let go = self.goodput_at(&o.candidate, p);
                // Progress over the horizon with the switch (paying its cost) must beat staying.
                go > now * (1.0 + th) && go * (r.horizon - r.layout_cost).max(0.0) > stay * r.horizon
            });
            if holds {
                let confirm = if back(&o.candidate) { 2 * r.confirm_steps } else { r.confirm_steps };
                return self.confirmed(obs.step, &cur, Decision::ChangeLayout(o.candidate), confirm);
            }
        }
        let (wanted, confirm) = match self.scorer.best(phi, |c| c.dims == cur.dims) {
            Some(s) if s.candidate != cur => {
                let th = threshold(&s.candidate, r.batch_threshold);
                let holds = band.iter().all(|&p| self.goodput_at(&s.candidate, p) > self.goodput_at(&cur, p) * (1.0 + th));
                let confirm = if back(&s.candidate) { 2 * r.confirm_steps } else { r.confirm_steps };
                (if holds { Decision::to(&cur, s.candidate) } else { Decision::Keep }, confirm)
            }
            _ => (Decision::Keep, r.confirm_steps),
        };
        self.confirmed(obs.step, &cur, wanted, confirm)
    }

    fn observe_throughput(&mut self, candidate: &Candidate, samples_per_sec: f64) {
        self.scorer.observe_throughput(candidate, samples_per_sec);
    }

    fn observe_reconfiguration(&mut self, seconds: f64, layout_changed: bool) {
        if layout_changed && seconds.is_finite() && seconds >= 0.0 {
            let w = self.rule.cost_smoothing;
            self.rule.layout_cost = (1.0 - w) * self.rule.layout_cost + w * seconds;
        }
    }

    fn learned(&self) -> PolicyState {
        PolicyState {
            measured: self.scorer.measured(),
            layout_cost: Some(self.rule.layout_cost),
            seen: self.seen,
            left: self.left,
            left_layout: self.left_layout,
            winning: self.winning.map(|(d, o, s)| (d, o as i8, s)),
        }
    }

    fn restore_learned(&mut self, state: &PolicyState) {
        self.scorer.set_measured(&state.measured);
        if let Some(c) = state.layout_cost.filter(|c| c.is_finite() && *c >= 0.0) {
            self.rule.layout_cost = c;
        }
        (self.seen, self.left, self.left_layout) = (state.seen, state.left, state.left_layout);
        self.winning = state.winning.map(|(d, o, s)| (d, o.cmp(&0), s));
    }
}

/// Noise scale over training, indexed by progress in B0-equivalent samples.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Trajectory {
    /// (progress at which the value starts, B_simple), progress increasing from 0.
    pub points: Vec<(f64, f64)>,
    /// Progress at which training ends (the target).
    pub end: f64,
}

impl Trajectory {
    /// Validates the points.
    pub fn new(points: Vec<(f64, f64)>, end: f64) -> Result<Self, PolicyError> {
        if points.is_empty() || points[0].0 != 0.0 {
            return Err(PolicyError::Bad {
                field: "trajectory",
                allowed: "points starting at progress 0",
                value: points.first().map_or(f64::NAN, |p| p.0),
            });
        }
        for w in points.windows(2) {
            check("trajectory progress", w[1].0, w[1].0 > w[0].0, "strictly increasing")?;
        }
        for p in &points {
            check("trajectory B_simple", p.1, p.1 >= 0.0, ">= 0")?;
        }
        let last = points[points.len() - 1].0;
        check("trajectory end", end, end > last, "after the last point")?;
        Ok(Self { points, end })
    }

    /// Segments (start, end, phi).
    fn segments(&self) -> impl Iterator<Item = (f64, f64, f64)> + '_ {
        self.points.iter().enumerate().map(|(i, &(s, phi))| (s, self.points.get(i + 1).map_or(self.end, |p| p.0), phi))
    }
}

/// Costs of switching on the simulated clock, seconds.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct SwitchCosts {
    /// A batch-only change.
    pub batch: f64,
    /// A layout change.
    pub layout: f64,
}

impl SwitchCosts {
    fn between(&self, a: &Candidate, b: &Candidate) -> f64 {
        if a == b {
            0.0
        } else if a.layout_differs(b) {
            self.layout
        } else {
            self.batch
        }
    }
}

/// A schedule: the configuration from each trajectory point on.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Schedule {
    /// One candidate per trajectory segment.
    pub per_segment: Vec<Candidate>,
    /// Seconds to reach the trajectory's end, switches included.
    pub time: f64,
}

/// Seconds that `per_segment` takes on `trajectory`, starting from `initial` (switches to the
/// first segment's candidate are charged). `None` if a candidate has no throughput.
pub fn schedule_time(
    trajectory: &Trajectory,
    per_segment: &[Candidate],
    scorer: &Scorer,
    costs: SwitchCosts,
    initial: Option<Candidate>,
) -> Option<f64> {
    if per_segment.len() != trajectory.points.len() {
        return None;
    }
    let mut prev = initial;
    let mut time = 0.0;
    for ((start, end, phi), c) in trajectory.segments().zip(per_segment) {
        let t = scorer.throughput(c)?;
        time += prev.map_or(0.0, |p| costs.between(&p, c));
        time += (end - start) / scorer.goodput(t, c.global_batch, phi);
        prev = Some(*c);
    }
    Some(time)
}

/// The fastest schedule for a known trajectory (dynamic programming over segments x candidates,
/// O(segments x candidates) with per-layout minima).
pub fn hindsight_oracle(trajectory: &Trajectory, scorer: &Scorer, costs: SwitchCosts, initial: Option<Candidate>) -> Schedule {
    let cands: Vec<(Candidate, f64)> = scorer.candidates().copied().collect();
    let n = cands.len();
    let mut layout_of: Vec<usize> = Vec::with_capacity(n);
    let mut layouts: HashMap<ParallelDims, usize> = HashMap::new();
    for (c, _) in &cands {
        let next = layouts.len();
        layout_of.push(*layouts.entry(c.dims).or_insert(next));
    }
    let num_layouts = layouts.len();
    let segments: Vec<(f64, f64, f64)> = trajectory.segments().collect();
    // cost[i]: best time to finish the segments so far ending in candidate i.
    let mut cost: Vec<f64> = cands.iter().map(|(c, _)| initial.map_or(0.0, |p| costs.between(&p, c))).collect();
    let mut back: Vec<Vec<u32>> = Vec::with_capacity(segments.len());
    for (k, &(start, end, phi)) in segments.iter().enumerate() {
        if k > 0 {
            // Predecessors: the same candidate (free), the best of the same layout (batch cost),
            // the best of any other layout (layout cost). Keep the best per layout and the two
            // best layouts, so "any other layout" is O(1).
            let mut best_layout = vec![(f64::INFINITY, 0usize); num_layouts];
            for i in 0..n {
                if cost[i] < best_layout[layout_of[i]].0 {
                    best_layout[layout_of[i]] = (cost[i], i);
                }
            }
            let (mut first, mut second) = ((f64::INFINITY, 0usize, usize::MAX), (f64::INFINITY, 0usize, usize::MAX));
            for (l, &(v, j)) in best_layout.iter().enumerate() {
                if v < first.0 {
                    second = first;
                    first = (v, j, l);
                } else if v < second.0 {
                    second = (v, j, l);
                }
            }
            let mut from = vec![0u32; n];
            let mut next = vec![0.0; n];
            for i in 0..n {
                let l = layout_of[i];
                let mut b = (cost[i], i);
                let (v, j) = best_layout[l];
                if v + costs.batch < b.0 {
                    b = (v + costs.batch, j);
                }
                let other = if first.2 != l { first } else { second };
                if other.0 + costs.layout < b.0 {
                    b = (other.0 + costs.layout, other.1);
                }
                next[i] = b.0;
                from[i] = b.1 as u32;
            }
            cost = next;
            back.push(from);
        }
        for (i, (c, t)) in cands.iter().enumerate() {
            cost[i] += (end - start) / scorer.goodput(*t, c.global_batch, phi);
        }
    }
    let (mut i, time) = cost.iter().enumerate().fold((0, f64::INFINITY), |b, (i, &v)| if v < b.1 { (i, v) } else { b });
    let mut per_segment = vec![cands[i].0; segments.len()];
    for k in (1..segments.len()).rev() {
        i = back[k - 1][i] as usize;
        per_segment[k - 1] = cands[i].0;
    }
    Schedule { per_segment, time }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::candidates::CandidateSpace;
    use crate::memory::MemoryModel;
    use crate::model::ModelSpec;
    use crate::schedule::ScheduleKind;
    use crate::throughput::{ClusterModel, ClusterSpec, ProfileEntry, ThroughputProfile};
    use proptest::prelude::*;

    /// The default rule without a dwell time or confirmation (these tests judge single
    /// decisions).
    fn no_dwell() -> SwitchRule {
        SwitchRule { min_dwell_steps: 1, confirm_steps: 1, ..SwitchRule::default() }
    }

    /// An estimate of B_simple `phi` (|G|^2 = 1) whose |G|^2 has standard error `g_se`.
    fn noisy(current: Candidate, step: u64, phi: f64, g_se: f64) -> StepObservation {
        StepObservation {
            step,
            current,
            noise: Some(NoiseEstimate { grad_sq: 1.0, trace: phi, biased: false, grad_sq_se: g_se, trace_se: 0.0 }),
        }
    }

    #[test]
    fn copus_waits_its_dwell_time_before_a_change() {
        let (s, _) = toy();
        let start = Candidate::new(d(2, 2, 1), 4, 1).unwrap();
        let rule = SwitchRule { layout_cost: 1.0, min_dwell_steps: 20, confirm_steps: 1, ..SwitchRule::default() };
        let mut p = Copus::new(s, rule).unwrap();
        // High noise calls for dp4 at B_g 128 from the first step, but the run has been in this
        // configuration for fewer than 20 steps until step 20.
        for step in 1..20 {
            assert_eq!(p.decide(&noisy(start, step, 1e6, 0.0)), Decision::Keep, "step {step}");
        }
        assert!(matches!(p.decide(&noisy(start, 20, 1e6, 0.0)), Decision::ChangeLayout(_)));
        // After a change the count starts again.
        let moved = Candidate::new(d(4, 1, 1), 128, 1).unwrap();
        assert_eq!(p.decide(&noisy(moved, 21, 2.0, 0.0)), Decision::Keep);
        assert_eq!(p.learned().seen, Some((moved, 21)));
        assert_eq!(p.learned().left, Some(start));
    }

    #[test]
    fn copus_changes_only_what_pays_across_the_estimates_band() {
        let (s, _) = toy();
        let start = Candidate::new(d(2, 2, 1), 4, 1).unwrap();
        let rule = SwitchRule { layout_cost: 1.0, horizon: 1e4, ..no_dwell() };
        // The noise scale at which the best choice stops being tp2 at B_g 4, by bisection on
        // the scorer (the decision rule's own point).
        let best_is_start = |phi: f64| s.best(phi, |_| true).unwrap().candidate == start;
        let (mut lo, mut hi) = (1.0, 1e6);
        assert!(best_is_start(lo) && !best_is_start(hi));
        for _ in 0..60 {
            let mid: f64 = (lo * hi).sqrt();
            if best_is_start(mid) { lo = mid } else { hi = mid }
        }
        // Well above the crossover a precise estimate moves; the same point estimate with a
        // wide band (its low end below the crossover) does not.
        let phi = 16.0 * hi;
        let mut precise = Copus::new(s.clone(), rule).unwrap();
        assert_ne!(precise.decide(&noisy(start, 5, phi, 0.0)), Decision::Keep);
        let mut unsure = Copus::new(s.clone(), rule).unwrap();
        assert_eq!(unsure.decide(&noisy(start, 5, phi, 20.0)), Decision::Keep, "phi / 21 is below the crossover");
        // A narrow band around the same estimate moves.
        let mut fairly_sure = Copus::new(s, rule).unwrap();
        assert_ne!(fairly_sure.decide(&noisy(start, 5, phi, 0.1)), Decision::Keep);
    }

    #[test]
    fn a_change_is_made_only_after_winning_its_confirmation_steps_in_a_row() {
        let (s, _) = toy();
        let start = Candidate::new(d(2, 2, 1), 4, 1).unwrap();
        let rule = SwitchRule { layout_cost: 1.0, confirm_steps: 5, ..no_dwell() };
        let mut p = Copus::new(s, rule).unwrap();
        // High noise wins four decisions, then one low-noise decision breaks the run.
        for step in 1..=4 {
            assert_eq!(p.decide(&noisy(start, step, 1e6, 0.0)), Decision::Keep, "step {step}");
        }
        assert_eq!(p.decide(&noisy(start, 5, 2.0, 0.0)), Decision::Keep);
        for step in 6..=9 {
            assert_eq!(p.decide(&noisy(start, step, 1e6, 0.0)), Decision::Keep, "step {step}");
        }
        assert!(matches!(p.decide(&noisy(start, 10, 1e6, 0.0)), Decision::ChangeLayout(_)), "five in a row");
    }

    #[test]
    fn going_back_needs_twice_the_gain() {
        // Two layouts; measured throughput puts the second 15% ahead: enough to go there
        // (threshold 10%), not enough to come back after the first turns out 15% ahead again.
        let (s, _) = toy();
        let a = Candidate::new(d(4, 1, 1), 4, 1).unwrap();
        let b = Candidate::new(d(2, 2, 1), 4, 1).unwrap();
        let rule = SwitchRule { layout_cost: 0.0, batch_threshold: 10.0, layout_threshold: 0.10, ..no_dwell() };
        let mut p = Copus::new(s, rule).unwrap();
        for (c, t) in [(a, 10.0), (b, 11.5)] {
            p.observe_throughput(&c, t);
            p.observe_throughput(&c, t);
        }
        assert_eq!(p.decide(&noisy(a, 1, 1.0, 0.0)), Decision::ChangeLayout(b));
        // Now a measures 15% faster than b: going back to where it came from needs 20%.
        for _ in 0..20 {
            p.observe_throughput(&a, 13.2);
        }
        assert_eq!(p.decide(&noisy(b, 2, 1.0, 0.0)), Decision::Keep);
        for _ in 0..20 {
            p.observe_throughput(&a, 14.5);
        }
        // 26% ahead: back, once it has been wanted over twice the confirmation (2 steps here).
        assert_eq!(p.decide(&noisy(b, 3, 1.0, 0.0)), Decision::Keep, "one judgement is not enough to go back");
        assert_eq!(p.decide(&noisy(b, 4, 1.0, 0.0)), Decision::ChangeLayout(a), "26% ahead: back");
    }

    fn d(dp: usize, tp: usize, pp: usize) -> ParallelDims {
        ParallelDims { dp, tp, pp }
    }

    fn obs(current: Candidate, phi: f64) -> StepObservation {
        StepObservation {
            step: 10,
            current,
            noise: Some(NoiseEstimate { grad_sq: 1.0, trace: phi, biased: false, grad_sq_se: 0.0, trace_se: 0.0 }),
        }
    }

    /// Two layouts on 4 ranks, B_m = 1: tp2 is faster at small B_g, dp4 at large B_g.
    /// Step time dp4 = 0.5 + 0.1 * B_g / 4; tp2 (dp2) = 0.1 + 0.1 * B_g / 2 * 0.8.
    fn toy() -> (Scorer, ThroughputProfile) {
        let mut rows = Vec::new();
        for b in [4usize, 8, 16, 32, 64, 128] {
            let t_dp = 0.5 + 0.1 * b as f64 / 4.0;
            let t_tp = 0.1 + 0.08 * b as f64 / 2.0;
            rows.push(ProfileEntry { dp: 4, tp: 1, pp: 1, global_batch: b, micro_batch: 1, samples_per_sec: b as f64 / t_dp });
            rows.push(ProfileEntry { dp: 2, tp: 2, pp: 1, global_batch: b, micro_batch: 1, samples_per_sec: b as f64 / t_tp });
        }
        let p = ThroughputProfile::new("toy".into(), "toy".into(), rows).unwrap();
        let cands: Vec<Candidate> = [d(4, 1, 1), d(2, 2, 1)]
            .iter()
            .flat_map(|&dims| [4usize, 8, 16, 32, 64, 128].map(|b| Candidate::new(dims, b, 1).unwrap()))
            .collect();
        (Scorer::plain(&cands, &p, 4.0).unwrap(), p)
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
        // A repeated measurement is smoothed: EMA with weight 0.5 on the newest.
        s.observe_throughput(&a, pa);
        assert!((s.throughput(&a).unwrap() - 0.75 * pa).abs() < 1e-12 * pa);
        // Junk and non-candidates change nothing.
        let before: Vec<f64> = s.candidates().map(|x| x.1).collect();
        s.observe_throughput(&a, f64::NAN);
        s.observe_throughput(&a, -1.0);
        s.observe_throughput(&Candidate::new(d(1, 4, 1), 4, 1).unwrap(), 10.0);
        assert_eq!(before, s.candidates().map(|x| x.1).collect::<Vec<f64>>());
    }

    #[test]
    fn copus_acts_on_measured_throughput_not_only_on_the_prior() {
        // Low noise, B_g = 4: the prior says tp2 (0.26 s) beats dp4 (0.6 s). Measurements say
        // the opposite on this machine: dp4 at 20 samples/s, tp2 at 5.
        let (s, _) = toy();
        let dp4 = Candidate::new(d(4, 1, 1), 4, 1).unwrap();
        let tp2 = Candidate::new(d(2, 2, 1), 4, 1).unwrap();
        let rule = SwitchRule { layout_cost: 0.0, ..no_dwell() };
        let noise = Some(NoiseEstimate { grad_sq: 1.0, trace: 1.0, biased: false, grad_sq_se: 0.0, trace_se: 0.0 });
        let obs = |current| StepObservation { step: 10, current, noise };
        let mut prior_only = Copus::new(s.clone(), rule).unwrap();
        assert_eq!(prior_only.decide(&obs(dp4)), Decision::ChangeLayout(tp2), "the prior alone moves to tp2");
        let mut learning = Copus::new(s, rule).unwrap();
        learning.observe_throughput(&dp4, 20.0);
        learning.observe_throughput(&tp2, 5.0);
        assert_eq!(learning.decide(&obs(dp4)), Decision::Keep, "measured, dp4 is faster");
        // From tp2 the way back to dp4 (the layout it came from) needs two judgements.
        assert_eq!(learning.decide(&obs(tp2)), Decision::Keep);
        assert_eq!(learning.decide(&StepObservation { step: 11, current: tp2, noise }), Decision::ChangeLayout(dp4));
    }

    #[test]
    fn toy_profile_crosses_over() {
        let (s, _) = toy();
        // By hand: at B_g = 4, dp4 0.6 s vs tp2 0.26 s; at 128, dp4 3.7 s vs tp2 5.22 s.
        assert_eq!(s.best(1e9, |c| c.global_batch == 4).unwrap().candidate.dims, d(2, 2, 1));
        assert_eq!(s.best(1e9, |c| c.global_batch == 128).unwrap().candidate.dims, d(4, 1, 1));
    }

    #[test]
    fn copus_switches_layout_when_noise_grows_and_only_when_it_repays() {
        let (s, _) = toy();
        let start = Candidate::new(d(2, 2, 1), 4, 1).unwrap();
        let mut p = Copus::new(s.clone(), SwitchRule { layout_cost: 1.0, ..no_dwell() }).unwrap();
        // Low noise: small batches are efficient, tp2 at B_g = 4 stays best.
        assert_eq!(p.decide(&obs(start, 2.0)), Decision::Keep);
        // High noise: big batches are free of statistical cost, dp4 at 128 wins.
        match p.decide(&obs(start, 1e6)) {
            Decision::ChangeLayout(c) => assert_eq!((c.dims, c.global_batch), (d(4, 1, 1), 128)),
            other => panic!("expected a layout change, got {other:?}"),
        }
        // The same gain does not repay a layout change that costs more than the horizon.
        let mut slow = Copus::new(s, SwitchRule { layout_cost: 1e4, ..no_dwell() }).unwrap();
        match slow.decide(&obs(start, 1e6)) {
            Decision::ChangeBatch(c) => assert_eq!(c.dims, d(2, 2, 1)),
            other => panic!("expected a batch change on the same layout, got {other:?}"),
        }
        // Measured costs move the estimate.
        slow.observe_reconfiguration(2.0, true);
        assert!((slow.layout_cost() - (0.5 * 1e4 + 0.5 * 2.0)).abs() < 1e-9);
    }

    #[test]
    fn copus_respects_the_batch_threshold() {
        let (s, _) = toy();
        let cur = Candidate::new(d(2, 2, 1), 4, 1).unwrap();
        // phi = 40 on tp2, by hand: B_g 4 -> 4/0.26 = 15.38; B_g 8 -> 8/0.42 * 44/48 = 17.46;
        // B_g 16 -> 16/0.74 * 44/56 = 16.99. Best is 8, a 13.5% gain.
        let phi = 40.0;
        let best = s.best(phi, |c| c.dims == cur.dims).unwrap();
        assert_eq!(best.candidate.global_batch, 8);
        let now = s.goodput(s.throughput(&cur).unwrap(), 4, phi);
        let gain = best.goodput / now - 1.0;
        assert!((gain - (8.0 / 0.42 * 44.0 / 48.0) / (4.0 / 0.26) + 1.0).abs() < 1e-9, "{gain}");
        let rule = |t| SwitchRule { batch_threshold: t, layout_threshold: 1e9, ..no_dwell() };
        let mut below = Copus::new(s.clone(), rule(gain * 1.01)).unwrap();
        assert_eq!(below.decide(&obs(cur, phi)), Decision::Keep);
        let mut above = Copus::new(s, rule(gain * 0.99)).unwrap();
        assert_eq!(above.decide(&obs(cur, phi)), Decision::ChangeBatch(best.candidate));
    }

    #[test]
    fn baselines_follow_their_rules() {
        let (s, _) = toy();
        let cur = Candidate::new(d(4, 1, 1), 8, 1).unwrap();
        // Merrill: B_simple 20 > 2 * 8 doubles to 16; B_simple 15 keeps.
        let mut m = MerrillWarmup::new(s.clone());
        assert_eq!(m.decide(&obs(cur, 20.0)), Decision::ChangeBatch(Candidate::new(d(4, 1, 1), 16, 1).unwrap()));
        assert_eq!(m.decide(&obs(cur, 15.0)), Decision::Keep);
        // CBS with c = 1: target 30 -> nearest B_g in log terms is 32; never shrinks when monotone.
        let mut c = CbsFixedLayout::new(s.clone(), d(4, 1, 1), 1.0, true).unwrap();
        assert_eq!(c.decide(&obs(cur, 30.0)).target(cur).global_batch, 32);
        assert_eq!(c.decide(&obs(cur, 1.0)), Decision::Keep);
        let mut shrink = CbsFixedLayout::new(s.clone(), d(4, 1, 1), 1.0, false).unwrap();
        assert_eq!(shrink.decide(&obs(cur, 1.0)).target(cur).global_batch, 4);
        // DP-only Goodput never leaves its layout even where another is far better.
        let mut a = DpOnlyGoodput::new(s.clone(), SwitchRule::default()).unwrap();
        let small = Candidate::new(d(4, 1, 1), 128, 1).unwrap();
        let dec = a.decide(&obs(small, 0.5));
        assert_eq!(dec.target(small).dims, d(4, 1, 1));
        assert_eq!(dec.target(small).global_batch, 4);
        assert_eq!(Static.decide(&obs(cur, 1e6)), Decision::Keep);
        // No noise estimate yet: everyone keeps.
        let none = StepObservation { step: 0, current: cur, noise: None };
        assert_eq!(Copus::new(s, SwitchRule::default()).unwrap().decide(&none), Decision::Keep);
        assert!(CbsFixedLayout::new(toy().0, d(1, 4, 1), 1.0, true).is_err());
    }

    /// Brute force over every schedule: the reference for the oracle.
    fn brute(traj: &Trajectory, s: &Scorer, costs: SwitchCosts, initial: Option<Candidate>) -> f64 {
        let cands: Vec<Candidate> = s.candidates().map(|c| c.0).collect();
        let k = traj.points.len();
        let mut best = f64::INFINITY;
        let total = cands.len().pow(k as u32);
        for mut code in 0..total {
            let sched: Vec<Candidate> = (0..k)
                .map(|_| {
                    let c = cands[code % cands.len()];
                    code /= cands.len();
                    c
                })
                .collect();
            best = best.min(schedule_time(traj, &sched, s, costs, initial).unwrap());
        }
        best
    }

    fn small_scorer() -> Scorer {
        let (_, p) = toy();
        let cands: Vec<Candidate> = [(d(4, 1, 1), 4), (d(4, 1, 1), 32), (d(2, 2, 1), 4), (d(2, 2, 1), 32)]
            .iter()
            .map(|&(dims, b)| Candidate::new(dims, b, 1).unwrap())
            .collect();
        Scorer::plain(&cands, &p, 4.0).unwrap()
    }

    #[test]
    fn oracle_equals_brute_force_and_beats_every_static_schedule() {
        let s = small_scorer();
        let traj = Trajectory::new(vec![(0.0, 1.0), (100.0, 10.0), (300.0, 200.0), (600.0, 5000.0)], 2000.0).unwrap();
        for costs in
            [SwitchCosts { batch: 0.0, layout: 0.0 }, SwitchCosts { batch: 0.5, layout: 3.0 }, SwitchCosts { batch: 0.0, layout: 1e6 }]
        {
            let start = Candidate::new(d(2, 2, 1), 4, 1).unwrap();
            let o = hindsight_oracle(&traj, &s, costs, Some(start));
            let b = brute(&traj, &s, costs, Some(start));
            assert!((o.time - b).abs() < 1e-9 * b, "oracle {} vs brute force {b}", o.time);
            assert!((schedule_time(&traj, &o.per_segment, &s, costs, Some(start)).unwrap() - o.time).abs() < 1e-9 * o.time);
            for (c, _) in s.candidates() {
                let fixed = vec![*c; traj.points.len()];
                assert!(o.time <= schedule_time(&traj, &fixed, &s, costs, Some(start)).unwrap() + 1e-9);
            }
        }
        // Free switches with growing noise: the oracle moves to larger batches.
        let o = hindsight_oracle(&traj, &s, SwitchCosts { batch: 0.0, layout: 0.0 }, None);
        assert!(o.per_segment[0].global_batch < o.per_segment[3].global_batch, "{:?}", o.per_segment);
    }

    proptest! {
        #[test]
        fn oracle_matches_brute_force_on_random_trajectories(
            phis in proptest::collection::vec(0.1f64..1e4, 1..5),
            batch_cost in 0.0f64..5.0,
            layout_cost in 0.0f64..50.0,
        ) {
            let s = small_scorer();
            let points: Vec<(f64, f64)> = phis.iter().enumerate().map(|(i, &p)| (i as f64 * 150.0, p)).collect();
            let traj = Trajectory::new(points, phis.len() as f64 * 150.0).unwrap();
            let costs = SwitchCosts { batch: batch_cost, layout: layout_cost };
            let o = hindsight_oracle(&traj, &s, costs, None);
            let b = brute(&traj, &s, costs, None);
            prop_assert!((o.time - b).abs() <= 1e-9 * b, "oracle {} vs {}", o.time, b);
        }
    }

    #[test]
    fn bad_settings_are_errors() {
        let (s, _) = toy();
        let e = Copus::new(s.clone(), SwitchRule { horizon: 0.0, ..no_dwell() }).err().unwrap();
        assert_eq!(e.to_string(), "`horizon` must be > 0 seconds, got 0");
        assert!(CbsFixedLayout::new(s, d(4, 1, 1), f64::NAN, true).is_err());
        assert!(Trajectory::new(vec![(1.0, 3.0)], 5.0).is_err());
        assert!(Trajectory::new(vec![(0.0, 3.0), (0.0, 4.0)], 5.0).is_err());
        assert!(Trajectory::new(vec![(0.0, 3.0)], 0.0).is_err());
        let empty: [Candidate; 0] = [];
        assert!(matches!(Scorer::plain(&empty, &toy().1, 4.0), Err(PolicyError::NoCandidates)));
    }

    #[test]
    fn copus_on_the_cluster_model_moves_to_dp_as_noise_grows() {
        // 3B on 8xH100: with low noise small B_g on a model-parallel layout; with high noise the
        // pure dp layout at a large batch.
        let cm = ClusterModel::new(ClusterSpec::h100_nvlink(1), ModelSpec::llama_3_2_3b());
        let space = CandidateSpace::new(
            8,
            vec![4, 8, 16, 32, 64, 128, 256],
            vec![1, 2, 4],
            ScheduleKind::OneFOneB,
            MemoryModel::mixed_bf16(),
            80e9,
        )
        .unwrap();
        let cands = space.enumerate(&cm.model).feasible;
        let s = Scorer::plain(&cands, &cm, 4.0).unwrap();
        let low = s.best(1.0, |_| true).unwrap().candidate;
        let high = s.best(1e5, |_| true).unwrap().candidate;
        assert_eq!(low.global_batch, 4);
        assert!(low.dims.dp < 8);
        assert_eq!(high.dims.dp, 8);
        assert!(high.global_batch >= 128);
        let mut p = Copus::new(s, SwitchRule { layout_cost: 30.0, ..no_dwell() }).unwrap();
        assert!(matches!(p.decide(&obs(low, 1e5)), Decision::ChangeLayout(c) if c.dims.dp == 8));
    }
}
