//! The COPUS policy: Goodput over every feasible (S, B_g, B_m), with the [`SwitchRule`]
//! thresholds, payback test, dwell time and confirmation that keep it from switching on noise.

use serde::{Deserialize, Serialize};

use super::error::{PolicyError, check};
use super::interface::{Decision, Policy, PolicyState, StepObservation, learned_by_scorer, restore_scorer};
use super::scorer::Scorer;
use crate::candidates::Candidate;
use crate::layout::ParallelDims;

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
    /// Steps a global batch runs before the next change (the run's first included), so the
    /// smoothed estimate has seen the batch it judges; trials of layouts and micro-batches at
    /// the same B_g (exploration) do not restart it. [`Confirmation::Sequential`] may end it
    /// early for a change of B_g.
    #[serde(default = "default_min_dwell")]
    pub min_dwell_steps: u64,
    /// Consecutive decisions a change must win (to the same layout, in the same batch
    /// direction) before it is made: the smoothed estimate's errors last about its EMA window,
    /// so a change that only wins during one excursion is not made.
    #[serde(default = "default_confirm")]
    pub confirm_steps: u64,
    /// Exploration: the log standard deviation assumed for the prior's error on a candidate
    /// the run has not measured, until two candidates are measured (then their spread about
    /// the prior takes over, see [`Copus`]). A candidate whose expected improvement over the
    /// best measured one, under that error, is at least the switch threshold (or
    /// `trial_threshold`; and, for a layout, repays two layout changes over the horizon) is
    /// tried for `trial_steps` steps
    /// (only candidates of the running B_g during the dwell or without a noise estimate); 0
    /// turns exploration off.
    #[serde(default = "default_explore")]
    pub explore: f64,
    /// Steps of a trial before it is judged on its measurement (longer if none of them was
    /// measured yet).
    #[serde(default = "default_trial_steps")]
    pub trial_steps: u64,
    /// The noise scale exploration and the end of a trial judge at (see [`ExploreNoise`]).
    #[serde(default)]
    pub explore_noise: ExploreNoise,
    /// Exploration: the log-error added per step of distance from an unmeasured candidate to
    /// the nearest measured one (a doubling or halving of B_g is one step, another layout
    /// one more), `s_c = sqrt(s^2 + explore_distance^2 d)`: the prior rescaled by the
    /// measurements is trusted less far from them. 0 (the default) gives every unmeasured
    /// candidate the same log-error.
    #[serde(default)]
    pub explore_distance: f64,
    /// Exploration: the prior's log-error shared by the candidates of one layout, for a prior
    /// whose errors come from what it models per layout (a pipeline bubble, a collective's
    /// cost). When positive, the scorer rescales each measured layout by its own measurements
    /// ([`Scorer::set_per_layout`]), and an unmeasured candidate of a layout the run has not
    /// measured at all gets `s_c = sqrt(s^2 + explore_layout^2)`, so a layout the prior rates
    /// wrongly is tried where its trial could repay. 0 (the default): one factor for every
    /// layout and no extra error.
    #[serde(default)]
    pub explore_layout: f64,
    /// Exploration: the expected improvement (a share of the best measured value) every trial
    /// must reach, in place of the switch thresholds (`batch_threshold` for a trial of the
    /// running layout, `layout_threshold` for another); a layout trial must still repay its
    /// two changes over the horizon. `None` (the default): the switch thresholds.
    #[serde(default)]
    pub trial_threshold: Option<f64>,
    /// How a change is chosen under the band of B_simple (see [`Choice`]).
    #[serde(default)]
    pub choice: Choice,
    /// What the confirmation counts and from when (see [`Confirmation`]).
    #[serde(default)]
    pub confirmation: Confirmation,
}

/// What a change's confirmation counts, and from when.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum Confirmation {
    /// Judgements start once the running B_g has run `min_dwell_steps`; the count is per
    /// target layout and batch direction, so two near-equal targets of different layouts
    /// that alternate as the best start it again.
    #[default]
    PerLayout,
    /// A change of B_g is counted per batch direction alone (the layout its count ends on is
    /// the one best then): which layout serves a B_g best is a question of throughput, not
    /// of the noise estimate the confirmation guards against. Judgements also count during
    /// the dwell, whose end a confirmed change then waits for, so the dwell and the
    /// confirmation overlap instead of following each other.
    Direction,
    /// [`Confirmation::Direction`] with an early end for a change of B_g, a group-sequential
    /// test: k steps into a run of judgements that want it (k below the `confirm_steps` it
    /// needs; steps without a usable estimate count, as they do for the full count), the
    /// change is made at once, before the dwell's end, if it also wins across the band of
    /// B_simple `confidence * sqrt(confirm_steps / k)` standard errors wide (O'Brien-Fleming's
    /// boundary: wide at the first look, the rule's own band at the last; with `confidence` 0
    /// the band is the point and the first judgement decides). Changes of layout or micro-batch
    /// at the same B_g do not end early: their gain is throughput, which the band does not
    /// bound. The band's standard errors describe independent unbiased raw estimates, so the
    /// early end applies only while the smoothed estimate is unbiased (the differenced
    /// estimates of one-micro-batch steps weigh under 1% in it) and the running B_g has run
    /// `trial_steps` steps (the spread comes from at least that many estimates). A change
    /// predicted to win by far while the estimate is precise is made within a few steps; one
    /// near the threshold, or under a noisy or biased estimate, waits for the full count and
    /// the dwell.
    Sequential,
}

/// How the policy picks the change it then confirms.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum Choice {
    /// The best other layout at the point estimate, if it wins across the band, else the best
    /// batch of the running layout at the point estimate, if that wins across the band.
    #[default]
    Point,
    /// Among every candidate that wins across the band (a layout change also repaying its
    /// cost at every point of it), the one whose smallest gain over the band is largest: while
    /// the band is wide, a change that holds wherever the noise scale lies in it (a smaller
    /// step towards the point estimate's best) is made, where `Point` waits for the band to
    /// narrow around its best.
    Robust,
}

/// The noise scale exploration values candidates at, and a trial is judged at.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum ExploreNoise {
    /// The point estimate of B_simple, or the band's low end while |G|^2 is not positive;
    /// the end of a trial goes back to another global batch when it wins at that point.
    #[default]
    Point,
    /// The point estimate only while |G|^2 is positive `confidence` standard errors down
    /// (measured, not noise), else B_simple "very large" (as a non-positive |G|^2 means), so a
    /// run at a small batch under large noise still tries the faster large batches; the end of
    /// a trial goes back to another global batch only when that wins across the band.
    Significant,
}

fn default_explore() -> f64 {
    0.3
}

fn default_trial_steps() -> u64 {
    8
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
            explore: default_explore(),
            trial_steps: default_trial_steps(),
            explore_noise: ExploreNoise::default(),
            explore_distance: 0.0,
            explore_layout: 0.0,
            trial_threshold: None,
            choice: Choice::default(),
            confirmation: Confirmation::default(),
        }
    }
}

impl SwitchRule {
    /// Checks the ranges: thresholds and `layout_cost` >= 0, `horizon` > 0, `cost_smoothing` in
    /// [0, 1], `confidence` >= 0, all finite; the error names the first setting out of range.
    pub fn validate(&self) -> Result<(), PolicyError> {
        check("batch_threshold", self.batch_threshold, self.batch_threshold >= 0.0, ">= 0")?;
        check("layout_threshold", self.layout_threshold, self.layout_threshold >= 0.0, ">= 0")?;
        check("horizon", self.horizon, self.horizon > 0.0, "> 0 seconds")?;
        check("layout_cost", self.layout_cost, self.layout_cost >= 0.0, ">= 0 seconds")?;
        check("cost_smoothing", self.cost_smoothing, (0.0..=1.0).contains(&self.cost_smoothing), "in [0, 1]")?;
        check("confidence", self.confidence, self.confidence >= 0.0, ">= 0 standard errors")?;
        check("explore", self.explore, self.explore >= 0.0, ">= 0 (0: no exploration)")?;
        check("explore_distance", self.explore_distance, self.explore_distance >= 0.0, ">= 0 (0: the same for all)")?;
        check("explore_layout", self.explore_layout, self.explore_layout >= 0.0, ">= 0 (0: one factor for every layout)")?;
        if let Some(t) = self.trial_threshold {
            check("trial_threshold", t, t >= 0.0, ">= 0")?;
        }
        check("trial_steps", self.trial_steps as f64, self.trial_steps >= 1, ">= 1 step")
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
/// global batch runs `min_dwell_steps` before the next change (unless
/// [`Confirmation::Sequential`] ends the count early), and going back to the
/// configuration (or, for a layout change, the layout) the run just left needs twice the
/// threshold and twice the confirmation, so two near-equal configurations do not alternate. The
/// layout cost is the policy's own running estimate, starting from `rule.layout_cost` and updated
/// from each measured layout change.
///
/// Throughput is learned by trying: once a configuration has run more than `trial_steps`
/// steps and no change is pending, a candidate the run has not measured is tried when its
/// expected improvement over the best measured candidate is worth it. Its value (Goodput at the
/// point estimate of B_simple; throughput alone, within the running B_g, before there is an
/// estimate) is taken as log-normal about the prediction (prior throughput rescaled by the
/// measurements) with the prior's log-error; the expected improvement must reach the switch
/// threshold and, for a layout, earn over the horizon more than the two layout changes a trial
/// may cost (there and back). After `trial_steps` measured steps (judged on their mean) the run
/// keeps the trial or goes at once to the best measured candidate of the trial's B_g or back
/// where it came from; the trial does not count as a change to come back from (the hysteresis
/// from before it is put back). Every candidate is tried at most once (also when the driver
/// refuses the trial), so a prior that ranks candidates wrongly is corrected within
/// (candidates) x `trial_steps` steps, and only candidates that could win enough to pay for
/// the trial are tried.
///
/// Its [`Policy::learned`] saves the scorer's measurements, the layout-cost estimate and the
/// dwell, hysteresis and confirmation state, so a resumed run decides as the original would.
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
    /// The candidate on trial and the step the trial was decided at.
    trial: Option<(Candidate, u64)>,
    /// The hysteresis state from before the trial, put back when it ends.
    before_trial: Option<(Option<Candidate>, Option<ParallelDims>)>,
    /// Every candidate tried so far (a trial the driver refused is not tried again).
    tried: Vec<Candidate>,
    /// The B_g running and the step it was first seen at (the dwell).
    batch_seen: Option<(usize, u64)>,
}

impl Copus {
    /// With switch thresholds, payback horizon and starting layout-cost estimate from `rule`;
    /// an error if `rule` is out of range ([`SwitchRule::validate`]).
    pub fn new(mut scorer: Scorer, rule: SwitchRule) -> Result<Self, PolicyError> {
        rule.validate()?;
        if rule.explore_layout > 0.0 {
            scorer.set_per_layout(true);
        }
        Ok(Self {
            scorer,
            rule,
            seen: None,
            left: None,
            left_layout: None,
            winning: None,
            trial: None,
            before_trial: None,
            tried: Vec::new(),
            batch_seen: None,
        })
    }

    /// B_simple taken as "very large" (statistical efficiency 1 at every batch that matters).
    const PHI_CAP: f64 = 1e9;

    /// `wanted` once the same kind of change (layout, batch direction; the direction alone for
    /// a change of B_g under [`Confirmation::Direction`] and [`Confirmation::Sequential`]) has
    /// been the one wanted at every judgement over `confirm_steps` steps (twice the rule's for
    /// going back) and the dwell is over (`dwelled`); `Keep` until then. A judgement for
    /// keeping, or for another change, starts the count again; steps without a usable estimate
    /// make no judgement.
    /// Under [`Confirmation::Sequential`] a change of B_g is made before the count is complete
    /// (and before the dwell's end) when it wins by `threshold` across the band widened to
    /// `confidence * sqrt(confirm_steps / k)`, k steps into the run of judgements.
    fn confirmed(&mut self, obs: &StepObservation, wanted: Decision, confirm_steps: u64, dwelled: bool, threshold: f64) -> Decision {
        let (step, cur) = (obs.step, &obs.current);
        let target = wanted.target(*cur);
        if target == *cur {
            self.winning = None;
            return Decision::Keep;
        }
        let key = (target.dims, target.global_batch.cmp(&cur.global_batch));
        let by_direction =
            matches!(self.rule.confirmation, Confirmation::Direction | Confirmation::Sequential) && key.1 != std::cmp::Ordering::Equal;
        let since = match self.winning {
            Some((d, o, since)) if o == key.1 && (d == key.0 || by_direction) => since,
            _ => step,
        };
        self.winning = Some((key.0, key.1, since));
        let k = step.saturating_sub(since) + 1;
        let early = self.rule.confirmation == Confirmation::Sequential
            && key.1 != std::cmp::Ordering::Equal
            && k < confirm_steps
            && self.batch_seen.is_some_and(|(_, since)| step.saturating_sub(since) + 1 >= self.rule.trial_steps)
            && {
                let z = self.rule.confidence * (confirm_steps as f64 / k as f64).sqrt();
                obs.noise.filter(|n| !n.biased).and_then(|n| n.b_simple_band(z)).is_some_and(|(low, high)| {
                    let phi = obs.b_simple().unwrap_or(low);
                    self.wins_across(cur, &target, [low, phi, high.min(Self::PHI_CAP)], threshold)
                })
            };
        if early || (dwelled && k >= confirm_steps) {
            self.winning = None;
            wanted
        } else {
            Decision::Keep
        }
    }

    /// Whether `target` beats `cur` by `threshold` at every noise scale of `band`; a change of
    /// layout must also repay its cost over the horizon against staying on the running layout
    /// (its best batch there).
    fn wins_across(&self, cur: &Candidate, target: &Candidate, band: [f64; 3], threshold: f64) -> bool {
        let r = self.rule;
        band.iter().all(|&p| {
            let now = self.goodput_at(cur, p);
            let go = self.goodput_at(target, p);
            go > now * (1.0 + threshold)
                && (!target.layout_differs(cur) || go * (r.horizon - r.layout_cost).max(0.0) > self.stay_goodput(cur, p, now) * r.horizon)
        })
    }

    fn goodput_at(&self, c: &Candidate, phi: f64) -> f64 {
        self.scorer.throughput(c).map_or(0.0, |t| self.scorer.goodput(t, c.global_batch, phi))
    }

    /// The log-optimism granted to unmeasured candidates: `explore` until two candidates are
    /// measured, then the prior's measured log-error shrunk towards `explore` as one
    /// pseudo-observation, `sqrt((explore^2 + n s^2) / (1 + n))`: a prior that proves right
    /// stops paying for trials, one that proves wrong keeps earning them.
    fn optimism(&self) -> f64 {
        let e = self.rule.explore;
        match self.scorer.prior_log_error() {
            Some((sd, n)) => ((e * e + n as f64 * sd * sd) / (1.0 + n as f64)).sqrt(),
            None => e,
        }
    }

    /// A candidate's value to exploration: its Goodput at the noise scale `phi` when there is
    /// one, else its throughput (and only candidates of the running B_g are compared).
    fn value(&self, c: &Candidate, samples_per_sec: f64, phi: Option<f64>) -> f64 {
        phi.map_or(samples_per_sec, |p| self.scorer.goodput(samples_per_sec, c.global_batch, p))
    }

    /// The measured candidate of highest [`Copus::value`] at `phi` among the `eligible` ones.
    fn best_measured(&self, phi: Option<f64>, eligible: impl Fn(&Candidate) -> bool) -> Option<(Candidate, f64)> {
        self.scorer
            .candidates_measured()
            .filter(|(c, _, measured)| *measured && eligible(c))
            .map(|(c, t, _)| (*c, self.value(c, t, phi)))
            .max_by(|a, b| a.1.total_cmp(&b.1))
    }

    /// A trial of the candidate the run has not measured whose trial is worth most, when `cur`
    /// has run more than `trial_steps` steps (`ran`) and no change is pending. Its value (Goodput
    /// at the noise scale `phi` of [`Copus::explore_noise`]; throughput, within the running
    /// B_g, without an estimate) is taken as log-normal about the prediction with the prior's
    /// log-error ([`Copus::optimism`], widened by `explore_distance`); the trial's worth is its
    /// expected improvement over the best measured candidate. It is made when that improvement
    /// is at least the switch threshold or `trial_threshold` (of the best measured value) and,
    /// for a layout, when the improvement earned over the
    /// horizon pays for the two layout changes a trial may cost (there and back). Among those,
    /// the candidate with the largest net worth is tried; `Keep` if there is none.
    fn explore(&mut self, step: u64, cur: &Candidate, ran: u64, phi: Option<f64>) -> Decision {
        let r = self.rule;
        if r.explore <= 0.0 || self.winning.is_some() || ran <= r.trial_steps {
            return Decision::Keep;
        }
        let Some(now) = self.scorer.throughput(cur).map(|t| self.value(cur, t, phi)) else { return Decision::Keep };
        let eligible = |c: &Candidate| phi.is_some() || c.global_batch == cur.global_batch;
        let best_known = self.best_measured(phi, eligible).map_or(now, |(_, v)| v.max(now));
        let s = self.optimism();
        // Where the run has measured (B_g, layout), for the distance of an unmeasured candidate.
        let mut near = Vec::new();
        if r.explore_distance > 0.0 {
            for (c, _, measured) in self.scorer.candidates_measured() {
                if measured && !near.contains(&(c.global_batch, c.dims)) {
                    near.push((c.global_batch, c.dims));
                }
            }
        }
        let mut next = None::<(Candidate, f64)>;
        for (c, t, measured) in self.scorer.candidates_measured() {
            if measured || !eligible(c) || c == cur || self.tried.contains(c) {
                continue;
            }
            let layout = c.layout_differs(cur);
            let (th, cost) = if layout { (r.layout_threshold, 2.0 * r.layout_cost) } else { (r.batch_threshold, 0.0) };
            let th = r.trial_threshold.unwrap_or(th);
            let mut s_c = if near.is_empty() { s } else { (s * s + r.explore_distance.powi(2) * distance(c, &near)).sqrt() };
            if r.explore_layout > 0.0 && !self.scorer.layout_measured(c.dims) {
                s_c = s_c.hypot(r.explore_layout);
            }
            let gain = expected_improvement(self.value(c, t, phi), best_known, s_c);
            // Progress-seconds: the gain over the horizon against the time the changes take.
            let worth = gain * r.horizon - best_known * cost;
            if gain >= th * best_known && worth > 0.0 && next.is_none_or(|(_, w)| worth > w) {
                next = Some((*c, worth));
            }
        }
        let Some((next, _)) = next else { return Decision::Keep };
        self.trial = Some((next, step));
        self.before_trial = Some((self.left, self.left_layout));
        self.tried.push(next);
        Decision::to(cur, next)
    }

    /// The end of a trial: the best measured candidate among the trial's B_g and the
    /// configuration the trial started from (`origin`), by Goodput at `phi` (by throughput
    /// without an estimate, the trial's B_g only), when it beats `cur` by the switch
    /// threshold; `Keep` otherwise.
    /// With [`ExploreNoise::Significant`] and a band (`band`: its low end, the point, its
    /// capped high end), going back to the origin's other B_g must win at all three.
    fn after_trial(&self, cur: &Candidate, origin: Option<Candidate>, phi: Option<f64>, band: Option<[f64; 3]>) -> Decision {
        let Some(now) = self.scorer.throughput(cur).map(|t| self.value(cur, t, phi)) else { return Decision::Keep };
        let eligible = |c: &Candidate| c.global_batch == cur.global_batch || (phi.is_some() && origin == Some(*c));
        match self.best_measured(phi, eligible) {
            Some((c, v)) if c != *cur => {
                let th = if c.layout_differs(cur) { self.rule.layout_threshold } else { self.rule.batch_threshold };
                let wins = match band {
                    Some(band) if c.global_batch != cur.global_batch => {
                        band.iter().all(|&p| self.goodput_at(&c, p) > self.goodput_at(cur, p) * (1.0 + th))
                    }
                    _ => v > now * (1.0 + th),
                };
                if wins { Decision::to(cur, c) } else { Decision::Keep }
            }
            _ => Decision::Keep,
        }
    }

    /// The noise scale exploration and the end of a trial judge at, with the band a trial's
    /// way back must hold across ([`ExploreNoise::Significant`] only); `None` without a band.
    fn explore_noise(&self, obs: &StepObservation) -> Option<(f64, Option<[f64; 3]>)> {
        let (low, high) = obs.noise.and_then(|n| n.b_simple_band(self.rule.confidence))?;
        let point = obs.b_simple();
        match self.rule.explore_noise {
            ExploreNoise::Point => Some((point.unwrap_or(low), None)),
            ExploreNoise::Significant => {
                // A finite high end: |G|^2 is positive `confidence` standard errors down.
                let phi = if high.is_finite() { point.unwrap_or(low) } else { Self::PHI_CAP };
                Some((phi, Some([low, phi.min(Self::PHI_CAP), high.min(Self::PHI_CAP)])))
            }
        }
    }

    /// [`Choice::Robust`]: the candidate whose smallest Goodput gain over `cur` across `band`
    /// is largest, among those that beat `cur` by their threshold (`threshold(c, base)`) at
    /// every point of it and, for another layout, repay the change's cost over the horizon
    /// against the best of the running layout there.
    fn robust_choice(&self, cur: &Candidate, band: [f64; 3], threshold: &dyn Fn(&Candidate, f64) -> f64) -> Option<Candidate> {
        let r = self.rule;
        let now = band.map(|p| self.goodput_at(cur, p));
        let stay = std::array::from_fn::<f64, 3, _>(|i| self.stay_goodput(cur, band[i], now[i]));
        let mut pick = None::<(Candidate, f64)>;
        for (c, t, _) in self.scorer.candidates_measured() {
            if c == cur {
                continue;
            }
            let layout = c.layout_differs(cur);
            let th = threshold(c, if layout { r.layout_threshold } else { r.batch_threshold });
            let go = band.map(|p| self.scorer.goodput(t, c.global_batch, p));
            // Any progress is infinitely more than none (a configuration the objective gives no
            // progress at must be left, as `Point` leaves it).
            let gain = |g: f64, n: f64| {
                if n > 0.0 {
                    g / n
                } else if g > 0.0 {
                    f64::INFINITY
                } else {
                    0.0
                }
            };
            let worst = (0..3).map(|i| gain(go[i], now[i])).fold(f64::INFINITY, f64::min);
            let repays = !layout || (0..3).all(|i| go[i] * (r.horizon - r.layout_cost).max(0.0) > stay[i] * r.horizon);
            if worst > 1.0 + th && repays && pick.is_none_or(|(_, w)| worst > w) {
                pick = Some((*c, worst));
            }
        }
        pick.map(|(c, _)| c)
    }

    /// Goodput at `phi` of staying on `cur`'s layout: its best batch there, or `now` (`cur`'s
    /// own) if higher; what a layout change must out-earn over the horizon.
    fn stay_goodput(&self, cur: &Candidate, phi: f64, now: f64) -> f64 {
        self.scorer.best(phi, |c| c.dims == cur.dims).map_or(now, |s| s.goodput.max(now))
    }

    /// `decided` if it is a change; else a trial if one is worth it, valued at the noise scale
    /// of [`Copus::explore_noise`] (`phi`, the decision's, when that has none); `phi` `None`
    /// (during the dwell): a trial of the running B_g only.
    fn or_explore(&mut self, decided: Decision, obs: &StepObservation, ran: u64, phi: Option<f64>) -> Decision {
        if decided != Decision::Keep {
            return decided;
        }
        let Some(phi) = phi else { return self.explore(obs.step, &obs.current, ran, None) };
        let at = self.explore_noise(obs).map_or(phi, |n| n.0);
        self.explore(obs.step, &obs.current, ran, Some(at))
    }

    /// The current estimate of a layout change's cost, seconds.
    pub fn layout_cost(&self) -> f64 {
        self.rule.layout_cost
    }
}

/// Steps from `c` to the nearest of the measured (B_g, layout) pairs `near`: the doublings
/// between the global batches, plus one for another layout.
fn distance(c: &Candidate, near: &[(usize, ParallelDims)]) -> f64 {
    near.iter()
        .map(|&(b, dims)| (c.global_batch as f64 / b as f64).log2().abs() + if dims == c.dims { 0.0 } else { 1.0 })
        .fold(f64::INFINITY, f64::min)
}

/// `E[max(V - best, 0)]` for `V` log-normal with median `median` and log standard deviation
/// `s` (the call price at zero rate): `median e^(s^2/2) Phi(d + s) - best Phi(d)`, with
/// `d = ln(median / best) / s`; `max(median - best, 0)` when `s` is 0.
pub(crate) fn expected_improvement(median: f64, best: f64, s: f64) -> f64 {
    if !(median > 0.0 && best > 0.0) {
        return 0.0;
    }
    if s <= 0.0 {
        return (median - best).max(0.0);
    }
    let cdf = |x: f64| 0.5 * libm::erfc(-x / std::f64::consts::SQRT_2);
    let d = (median / best).ln() / s;
    (median * (0.5 * s * s).exp() * cdf(d + s) - best * cdf(d)).max(0.0)
}

impl Policy for Copus {
    fn name(&self) -> String {
        "copus".into()
    }

    fn decide(&mut self, obs: &StepObservation) -> Decision {
        let cur = obs.current;
        let (ran, dwelled) = self.track(obs);
        if let Some(back) = self.end_trial(obs) {
            return back;
        }
        // During the dwell only the running B_g is explored (the estimate has not yet seen
        // this batch long enough to compare others), and no change is made but a change of B_g
        // that `Confirmation::Sequential` ends early; judgements count towards a confirmation
        // then only under `Confirmation::Direction` and `Confirmation::Sequential`.
        let dwell_over = dwelled >= self.rule.min_dwell_steps;
        if !dwell_over && self.rule.confirmation == Confirmation::PerLayout {
            return self.explore(obs.step, &cur, ran, None);
        }
        // The band of B_simple the estimate allows; the point estimate, or the band's low end
        // while the smoothed |G|^2 is not positive. An infinite high end is a very large one.
        // No usable estimate this step: no judgement, and the run of confirmations goes on
        // (at a small batch under large noise this is frequent, and resetting would trap the
        // run there).
        let Some((low, high)) = obs.noise.and_then(|n| n.b_simple_band(self.rule.confidence)) else {
            return self.explore(obs.step, &cur, ran, None);
        };
        let phi = obs.b_simple().unwrap_or(low);
        let band = [low, phi, high.min(Self::PHI_CAP)];
        self.judge(obs, ran, dwell_over, phi, band)
    }

    fn scorer(&self) -> Option<&Scorer> {
        Some(&self.scorer)
    }

    fn scorer_mut(&mut self) -> Option<&mut Scorer> {
        Some(&mut self.scorer)
    }

    fn observe_reconfiguration(&mut self, seconds: f64, layout_changed: bool) {
        if layout_changed && seconds.is_finite() && seconds >= 0.0 {
            let w = self.rule.cost_smoothing;
            self.rule.layout_cost = (1.0 - w) * self.rule.layout_cost + w * seconds;
        }
    }

    fn learned(&self) -> PolicyState {
        PolicyState {
            layout_cost: Some(self.rule.layout_cost),
            seen: self.seen,
            left: self.left,
            left_layout: self.left_layout,
            winning: self.winning.map(|(d, o, s)| (d, o as i8, s)),
            trial: self.trial,
            before_trial: self.before_trial,
            tried: self.tried.clone(),
            batch_seen: self.batch_seen,
            ..learned_by_scorer(self.scorer())
        }
    }

    fn restore_learned(&mut self, state: &PolicyState) {
        restore_scorer(self.scorer_mut(), state);
        if let Some(c) = state.layout_cost.filter(|c| c.is_finite() && *c >= 0.0) {
            self.rule.layout_cost = c;
        }
        (self.seen, self.left, self.left_layout) = (state.seen, state.left, state.left_layout);
        self.winning = state.winning.map(|(d, o, s)| (d, o.cmp(&0), s));
        (self.trial, self.before_trial, self.batch_seen) = (state.trial, state.before_trial, state.batch_seen);
        self.tried = state.tried.clone();
    }
}

/// The phases of [`Policy::decide`].
impl Copus {
    /// Decide, track: notes a change of configuration (what the run left, and its layout) and a
    /// change of B_g (which restarts the dwell, unless a trial made it); returns the steps the
    /// configuration has run and the steps its B_g has run.
    fn track(&mut self, obs: &StepObservation) -> (u64, u64) {
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
        // A trial does not restart the dwell; the B_g the run stays on after it does.
        match self.batch_seen {
            Some((b, _)) if b == cur.global_batch => {}
            _ if self.trial.is_some_and(|(t, _)| t == cur) => {}
            _ => self.batch_seen = Some((cur.global_batch, obs.step)),
        }
        // Steps the configuration has run (its measurement's age) and steps its B_g has run
        // (the dwell: the smoothed estimate has seen this batch, whatever trials of layouts and
        // micro-batches ran meanwhile).
        let ran = obs.step.saturating_sub(self.seen.map_or(0, |s| s.1)) + 1;
        let dwelled = obs.step.saturating_sub(self.batch_seen.map_or(0, |s| s.1)) + 1;
        (ran, dwelled)
    }

    /// Decide, trial: a trial in progress is kept until it has run its steps and been
    /// measured, then ended (and left at once where that pays); one refused or failed is
    /// dropped. `Some`: the decision this step, made by the trial.
    fn end_trial(&mut self, obs: &StepObservation) -> Option<Decision> {
        let cur = obs.current;
        // A trial runs its steps, then is left at once if a measured candidate of its B_g is
        // faster; it does not count as a change to come back from.
        if let Some((t, decided)) = self.trial {
            if t != cur {
                // Refused or failed: not tried again (`tried`), hysteresis as it was.
                self.trial = None;
                (self.left, self.left_layout) = self.before_trial.take().unwrap_or((self.left, self.left_layout));
            } else if obs.step.saturating_sub(decided) < self.rule.trial_steps || !self.scorer.is_measured(&cur) {
                // Until it has run its steps and been measured (the driver does not measure
                // the first step after a layout change on the wall clock).
                return Some(Decision::Keep);
            } else {
                self.trial = None;
                let origin = self.left;
                (self.left, self.left_layout) = self.before_trial.take().unwrap_or((None, None));
                let back = match self.rule.explore_noise {
                    ExploreNoise::Point => self.after_trial(&cur, origin, obs.b_simple(), None),
                    ExploreNoise::Significant => {
                        let noise = self.explore_noise(obs);
                        self.after_trial(&cur, origin, noise.map(|n| n.0), noise.and_then(|n| n.1))
                    }
                };
                if back != Decision::Keep {
                    return Some(back);
                }
            }
        }
        None
    }

    /// Decide, judge: at the estimate `phi` and across the `band` of B_simple it allows, the
    /// change the rule wants (back to what the run left at twice the threshold and
    /// confirmations), once confirmed; otherwise a trial where one is worth it.
    fn judge(&mut self, obs: &StepObservation, ran: u64, dwell_over: bool, phi: f64, band: [f64; 3]) -> Decision {
        let cur = obs.current;
        let r = self.rule;
        // Back to the configuration the run left, or (for a layout change) to its layout.
        let back = |t: &Candidate| self.left == Some(*t) || (t.dims != cur.dims && self.left_layout == Some(t.dims));
        let threshold = |t: &Candidate, base: f64| if back(t) { 2.0 * base } else { base };
        if r.choice == Choice::Robust {
            let wanted = self.robust_choice(&cur, band, &threshold);
            let confirm = if wanted.is_some_and(|c| back(&c)) { 2 * r.confirm_steps } else { r.confirm_steps };
            let th = wanted.map_or(0.0, |c| threshold(&c, if c.layout_differs(&cur) { r.layout_threshold } else { r.batch_threshold }));
            let decided = self.confirmed(obs, wanted.map_or(Decision::Keep, |c| Decision::to(&cur, c)), confirm, dwell_over, th);
            return self.or_explore(decided, obs, ran, dwell_over.then_some(phi));
        }
        // Best other layout at the estimate; it must repay across the band.
        if let Some(o) = self.scorer.best(phi, |c| c.dims != cur.dims) {
            let th = threshold(&o.candidate, r.layout_threshold);
            // Progress over the horizon with the switch (paying its cost) must beat staying.
            if self.wins_across(&cur, &o.candidate, band, th) {
                let confirm = if back(&o.candidate) { 2 * r.confirm_steps } else { r.confirm_steps };
                let decided = self.confirmed(obs, Decision::ChangeLayout(o.candidate), confirm, dwell_over, th);
                return if decided == Decision::Keep && !dwell_over { self.or_explore(decided, obs, ran, None) } else { decided };
            }
        }
        let (wanted, confirm, th) = match self.scorer.best(phi, |c| c.dims == cur.dims) {
            Some(s) if s.candidate != cur => {
                let th = threshold(&s.candidate, r.batch_threshold);
                let holds = self.wins_across(&cur, &s.candidate, band, th);
                let confirm = if back(&s.candidate) { 2 * r.confirm_steps } else { r.confirm_steps };
                (if holds { Decision::to(&cur, s.candidate) } else { Decision::Keep }, confirm, th)
            }
            _ => (Decision::Keep, r.confirm_steps, r.batch_threshold),
        };
        let decided = self.confirmed(obs, wanted, confirm, dwell_over, th);
        self.or_explore(decided, obs, ran, dwell_over.then_some(phi))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::candidates::CandidateSpace;
    use crate::gns::NoiseEstimate;
    use crate::memory::MemoryModel;
    use crate::model::ModelSpec;
    use crate::policy::test_util::{d, no_dwell, obs, toy};
    use crate::schedule::ScheduleKind;
    use crate::throughput::{ClusterModel, ClusterSpec, ProfileEntry, ThroughputProfile};

    /// An estimate of B_simple `phi` (|G|^2 = 1) whose |G|^2 has standard error `g_se`.
    fn noisy(current: Candidate, step: u64, phi: f64, g_se: f64) -> StepObservation {
        StepObservation {
            step,
            current,
            noise: Some(NoiseEstimate { grad_sq: 1.0, trace: phi, biased: false, grad_sq_se: g_se, trace_se: 0.0 }),
            remaining_secs: None,
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

    #[test]
    fn copus_acts_on_measured_throughput_not_only_on_the_prior() {
        // Low noise, B_g = 4: the prior says tp2 (0.26 s) beats dp4 (0.6 s). Measurements say
        // the opposite on this machine: dp4 at 20 samples/s, tp2 at 5.
        let (s, _) = toy();
        let dp4 = Candidate::new(d(4, 1, 1), 4, 1).unwrap();
        let tp2 = Candidate::new(d(2, 2, 1), 4, 1).unwrap();
        let rule = SwitchRule { layout_cost: 0.0, ..no_dwell() };
        let noise = Some(NoiseEstimate { grad_sq: 1.0, trace: 1.0, biased: false, grad_sq_se: 0.0, trace_se: 0.0 });
        let obs = |current| StepObservation { step: 10, current, noise, remaining_secs: None };
        let mut prior_only = Copus::new(s.clone(), rule).unwrap();
        assert_eq!(prior_only.decide(&obs(dp4)), Decision::ChangeLayout(tp2), "the prior alone moves to tp2");
        let mut learning = Copus::new(s, rule).unwrap();
        learning.observe_throughput(&dp4, 20.0);
        learning.observe_throughput(&tp2, 5.0);
        assert_eq!(learning.decide(&obs(dp4)), Decision::Keep, "measured, dp4 is faster");
        // From tp2 the way back to dp4 (the layout it came from) needs two judgements.
        assert_eq!(learning.decide(&obs(tp2)), Decision::Keep);
        assert_eq!(learning.decide(&StepObservation { step: 11, current: tp2, noise, remaining_secs: None }), Decision::ChangeLayout(dp4));
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

    /// Without a noise estimate, only the running B_g is explored, on throughput: the
    /// unmeasured tp2 at B_g 4 (prior 15.4 samples/s against dp4's measured 6.7) is tried once
    /// dp4 has run more than `trial_steps` steps; measured at 3.0 it is left at once, back to
    /// dp4, and never tried again; the learned state carries the trial bookkeeping.
    #[test]
    fn a_trial_is_made_judged_on_its_measurement_and_not_repeated() {
        let (s, _) = toy();
        let dp4 = Candidate::new(d(4, 1, 1), 4, 1).unwrap();
        let tp2 = Candidate::new(d(2, 2, 1), 4, 1).unwrap();
        let rule = SwitchRule { explore: 0.3, trial_steps: 2, layout_cost: 0.0, ..no_dwell() };
        let mut p = Copus::new(s.clone(), rule).unwrap();
        let at = |step, current| StepObservation { step, current, noise: None, remaining_secs: None };
        let prior_dp4 = s.throughput(&dp4).unwrap();
        for step in 1..=2 {
            p.observe_throughput(&dp4, prior_dp4);
            assert_eq!(p.decide(&at(step, dp4)), Decision::Keep, "step {step}: dp4 has not run long enough");
        }
        p.observe_throughput(&dp4, prior_dp4);
        assert_eq!(p.decide(&at(3, dp4)), Decision::ChangeLayout(tp2), "the trial");
        assert_eq!(p.learned().trial, Some((tp2, 3)));
        p.observe_throughput(&tp2, 3.0);
        assert_eq!(p.decide(&at(4, tp2)), Decision::Keep, "the trial runs its two steps");
        // A fresh policy restored from the learned state decides the same.
        let mut resumed = Copus::new(s, rule).unwrap();
        resumed.restore_learned(&p.learned());
        assert_eq!(resumed.learned(), p.learned());
        p.observe_throughput(&tp2, 3.0);
        resumed.observe_throughput(&tp2, 3.0);
        assert_eq!(p.decide(&at(5, tp2)), Decision::ChangeLayout(dp4), "measured slower: back at once");
        assert_eq!(resumed.decide(&at(5, tp2)), Decision::ChangeLayout(dp4));
        for step in 6..12 {
            p.observe_throughput(&dp4, prior_dp4);
            assert_eq!(p.decide(&at(step, dp4)), Decision::Keep, "step {step}: tp2 is measured, nothing left to try");
        }
        assert_eq!(p.learned().tried, vec![tp2]);
    }

    /// `explore_noise` by hand: |G|^2 = 1 with standard error 2 is not positive one standard
    /// error down, so `Significant` reads B_simple as very large (the band: tr / 3 up to
    /// infinity); with standard error 0.5 it is measured and the point estimate stands (band
    /// 100 / 1.5 to 100 / 0.5). A negative |G|^2 whose band still exists: `Point` takes the
    /// band's low end, 100 / 0.5.
    #[test]
    fn an_insignificant_signal_is_explored_as_a_very_large_noise_scale() {
        let (s, _) = toy();
        let cur = Candidate::new(d(4, 1, 1), 4, 1).unwrap();
        let at = |grad_sq: f64, se: f64| StepObservation {
            step: 10,
            current: cur,
            noise: Some(NoiseEstimate { grad_sq, trace: 100.0, biased: false, grad_sq_se: se, trace_se: 0.0 }),
            remaining_secs: None,
        };
        let point = Copus::new(s.clone(), no_dwell()).unwrap();
        let signif = Copus::new(s, SwitchRule { explore_noise: ExploreNoise::Significant, ..no_dwell() }).unwrap();
        let cap = Copus::PHI_CAP;
        assert_eq!(point.explore_noise(&at(1.0, 2.0)), Some((100.0, None)));
        assert_eq!(signif.explore_noise(&at(1.0, 2.0)), Some((cap, Some([100.0 / 3.0, cap, cap]))));
        assert_eq!(signif.explore_noise(&at(1.0, 0.5)), Some((100.0, Some([100.0 / 1.5, 100.0, 200.0]))));
        assert_eq!(point.explore_noise(&at(-0.5, 1.0)), Some((200.0, None)));
        assert_eq!(signif.explore_noise(&at(-0.5, 1.0)), Some((cap, Some([200.0, cap, cap]))));
        assert_eq!(signif.explore_noise(&at(-2.0, 1.0)), None, "no band: nothing bounded");
    }

    /// dp4 at B_g 4 measured at its prior (6.67 samples/s), B_simple estimated at 4 with |G|^2
    /// = 1 +- 2 (not significant), layout trials priced out. Plain Goodput at 4 (b0 4), by
    /// hand: B_g 8 11.43 x 8/12 = 7.62, B_g 16 17.78 x 8/20 = 7.11, B_g 128 34.6 x 8/132 = 2.10,
    /// so `Point` tries B_g 8; at "very large" Goodput is throughput and `Significant` tries
    /// B_g 128 (34.6 samples/s, 5.2 times B_g 4). With |G|^2 = 1 +- 0.1 both go to B_g 8.
    #[test]
    fn an_insignificant_signal_sends_the_trial_to_the_fast_large_batch() {
        let (s, _) = toy();
        let b = |g| Candidate::new(d(4, 1, 1), g, 1).unwrap();
        let first_trial = |mode, se| {
            let rule = SwitchRule { explore: 0.3, trial_steps: 2, layout_cost: 1e6, explore_noise: mode, ..no_dwell() };
            let mut p = Copus::new(s.clone(), rule).unwrap();
            let noise = Some(NoiseEstimate { grad_sq: 1.0, trace: 4.0, biased: false, grad_sq_se: se, trace_se: 0.0 });
            (1..=3)
                .map(|step| {
                    p.observe_throughput(&b(4), s.throughput(&b(4)).unwrap());
                    p.decide(&StepObservation { step, current: b(4), noise, remaining_secs: None })
                })
                .collect::<Vec<_>>()
        };
        let trial = |c| vec![Decision::Keep, Decision::Keep, Decision::ChangeBatch(c)];
        assert_eq!(first_trial(ExploreNoise::Point, 2.0), trial(b(8)));
        assert_eq!(first_trial(ExploreNoise::Significant, 2.0), trial(b(128)));
        // Measured well, the band [3.6, 4, 4.4] holds B_g 8's gain: both modes decide it at once
        // (a change, not a trial).
        for mode in [ExploreNoise::Point, ExploreNoise::Significant] {
            assert_eq!(first_trial(mode, 0.1)[0], Decision::ChangeBatch(b(8)), "{mode:?}");
        }
    }

    /// The end of a trial of dp4 B_g 16 measured at 15 samples/s, from dp4 B_g 4 (6.67): at
    /// B_simple 4 the origin wins (15 x 8/20 = 6.0), at the band's high end 40 the trial does
    /// (15 x 44/56 = 11.8). Judged at the point the run goes back; across the band
    /// [2.1, 4, 40] it stays.
    #[test]
    fn a_trial_goes_back_to_another_batch_only_when_that_wins_across_the_band() {
        let (s, _) = toy();
        let b = |g| Candidate::new(d(4, 1, 1), g, 1).unwrap();
        let mut p = Copus::new(s.clone(), no_dwell()).unwrap();
        p.observe_throughput(&b(4), s.throughput(&b(4)).unwrap());
        p.observe_throughput(&b(16), 15.0);
        assert_eq!(p.after_trial(&b(16), Some(b(4)), Some(4.0), None), Decision::ChangeBatch(b(4)));
        assert_eq!(p.after_trial(&b(16), Some(b(4)), Some(4.0), Some([2.1, 4.0, 40.0])), Decision::Keep);
        // Measured at 5 samples/s the trial loses everywhere (at 40: 3.9), and the run goes back.
        let mut q = Copus::new(s.clone(), no_dwell()).unwrap();
        q.observe_throughput(&b(4), s.throughput(&b(4)).unwrap());
        q.observe_throughput(&b(16), 5.0);
        assert_eq!(q.after_trial(&b(16), Some(b(4)), Some(4.0), Some([2.1, 4.0, 40.0])), Decision::ChangeBatch(b(4)));
    }

    /// `trial_threshold` replaces the switch threshold a trial's expected improvement must
    /// reach: tp2's over dp4 at B_g 4 is `g` (a share of dp4's samples/s, 1.41); with the
    /// layout threshold just above `g` it is not tried, with a trial threshold just under `g`
    /// it is, and a trial threshold just above `g` keeps it untried.
    #[test]
    fn the_trial_threshold_replaces_the_switch_threshold_for_trials() {
        let (s, _) = toy();
        let dp4 = Candidate::new(d(4, 1, 1), 4, 1).unwrap();
        let tp2 = Candidate::new(d(2, 2, 1), 4, 1).unwrap();
        let (t_dp4, t_tp2) = (s.throughput(&dp4).unwrap(), s.throughput(&tp2).unwrap());
        let g = expected_improvement(t_tp2, t_dp4, 0.3) / t_dp4;
        assert!((1.3..1.5).contains(&g), "{g}");
        for (trial_threshold, tried) in [(None, false), (Some(0.99 * g), true), (Some(1.01 * g), false)] {
            let rule =
                SwitchRule { explore: 0.3, trial_steps: 2, layout_cost: 0.0, layout_threshold: 1.01 * g, trial_threshold, ..no_dwell() };
            let mut p = Copus::new(s.clone(), rule).unwrap();
            let decisions: Vec<Decision> = (1..=3)
                .map(|step| {
                    p.observe_throughput(&dp4, t_dp4);
                    p.decide(&StepObservation { step, current: dp4, noise: None, remaining_secs: None })
                })
                .collect();
            let want = if tried { Decision::ChangeLayout(tp2) } else { Decision::Keep };
            assert_eq!(decisions, vec![Decision::Keep, Decision::Keep, want], "{trial_threshold:?}");
        }
        let bad = SwitchRule { trial_threshold: Some(-0.1), ..no_dwell() };
        assert!(Copus::new(s, bad).is_err());
    }

    /// tp2 at B_g 16 with B_simple 8 and |G|^2 = 1 +- 0.7: the band is [8 / 1.7, 8, 8 / 0.3] =
    /// [4.71, 8, 26.7]. By hand (tp2: B_g 4 15.38 samples/s, 8 19.05, 16 21.62; plain Goodput,
    /// b0 4): the point estimate's best is B_g 4 (15.38 against 16's 21.62 x 12/24 = 10.81), but
    /// at 26.7 it gives 15.38 against 16's 15.54, so `Point` waits. B_g 8 wins everywhere in the
    /// band, by 13.05/9.09 = 1.44, 14.29/10.81 = 1.32 and 16.85/15.54 = 1.084 (its worst, over
    /// the 2% threshold), and more than any other candidate's worst: `Robust` goes there. With a
    /// precise estimate both go to B_g 4.
    #[test]
    fn a_robust_choice_makes_the_change_that_holds_across_a_wide_band() {
        let (s, _) = toy();
        let tp2 = |b| Candidate::new(d(2, 2, 1), b, 1).unwrap();
        let rule = |choice| SwitchRule { layout_cost: 1.0, horizon: 1e4, choice, ..no_dwell() };
        let at = |se| StepObservation {
            step: 10,
            current: tp2(16),
            noise: Some(NoiseEstimate { grad_sq: 1.0, trace: 8.0, biased: false, grad_sq_se: se, trace_se: 0.0 }),
            remaining_secs: None,
        };
        let decide = |choice, se| Copus::new(s.clone(), rule(choice)).unwrap().decide(&at(se));
        assert_eq!(decide(Choice::Point, 0.7), Decision::Keep);
        assert_eq!(decide(Choice::Robust, 0.7), Decision::ChangeBatch(tp2(8)));
        assert_eq!(decide(Choice::Point, 0.0), Decision::ChangeBatch(tp2(4)));
        assert_eq!(decide(Choice::Robust, 0.0), Decision::ChangeBatch(tp2(4)));
    }

    /// A configuration the objective gives no progress: under a fixed base rate x0 = 0.5 and
    /// the sqrt rule (b0 4), B_g 128 runs at x = 0.5 sqrt(32) = 2.83 > 2, so no noise scale
    /// gives it progress. Both choices leave it for a configuration that progresses across the
    /// band.
    #[test]
    fn a_robust_choice_leaves_a_configuration_without_progress() {
        let (_, profile) = toy();
        let cands: Vec<Candidate> = [d(4, 1, 1), d(2, 2, 1)]
            .iter()
            .flat_map(|&dims| [4usize, 8, 16, 32, 64, 128].map(|b| Candidate::new(dims, b, 1).unwrap()))
            .collect();
        let objective = crate::goodput::LrAwareGoodput { x0: 0.5, rule: crate::goodput::LrRule::Sqrt };
        let s = Scorer::new(&cands, &profile, 4.0, std::sync::Arc::new(objective)).unwrap();
        let cur = Candidate::new(d(2, 2, 1), 128, 1).unwrap();
        let band = [4.0 / 1.5, 4.0, 8.0];
        assert!(band.iter().all(|&p| s.goodput(s.throughput(&cur).unwrap(), 128, p) == 0.0));
        let at = StepObservation {
            step: 10,
            current: cur,
            noise: Some(NoiseEstimate { grad_sq: 1.0, trace: 4.0, biased: false, grad_sq_se: 0.5, trace_se: 0.0 }),
            remaining_secs: None,
        };
        for choice in [Choice::Point, Choice::Robust] {
            let rule = SwitchRule { layout_cost: 1.0, horizon: 1e4, choice, ..no_dwell() };
            let target = Copus::new(s.clone(), rule).unwrap().decide(&at).target(cur);
            assert_ne!(target, cur, "{choice:?}");
            assert!(band.iter().all(|&p| s.goodput(s.throughput(&target).unwrap(), target.global_batch, p) > 0.0), "{choice:?}: {target}");
        }
    }

    /// Distance to the nearest measured (B_g, layout): B_g 32 on dp4 from B_g 4 on dp4 is three
    /// doublings, from B_g 16 on tp2 one doubling and a layout.
    #[test]
    fn the_distance_counts_doublings_and_a_layout() {
        let c = Candidate::new(d(4, 1, 1), 32, 1).unwrap();
        assert_eq!(distance(&c, &[(4, d(4, 1, 1))]), 3.0);
        assert_eq!(distance(&c, &[(4, d(4, 1, 1)), (16, d(2, 2, 1))]), 2.0);
        assert_eq!(distance(&c, &[(32, d(4, 1, 1))]), 0.0);
        assert_eq!(distance(&c, &[]), f64::INFINITY);
    }

    /// A trial the driver refuses is not proposed again.
    #[test]
    fn a_refused_trial_is_not_retried() {
        let (s, _) = toy();
        let dp4 = Candidate::new(d(4, 1, 1), 4, 1).unwrap();
        let rule = SwitchRule { explore: 0.3, trial_steps: 2, layout_cost: 0.0, ..no_dwell() };
        let mut p = Copus::new(s.clone(), rule).unwrap();
        let at = |step| StepObservation { step, current: dp4, noise: None, remaining_secs: None };
        let t = s.throughput(&dp4).unwrap();
        let mut trials = 0;
        for step in 1..30 {
            p.observe_throughput(&dp4, t);
            if p.decide(&at(step)) != Decision::Keep {
                trials += 1;
            }
        }
        assert_eq!(trials, 1, "proposed once; the run stayed on dp4 (refused) and it was not proposed again");
    }

    /// The optimism starts at `explore` and, once two candidates are measured, is their
    /// log-error about the prior shrunk towards `explore` as one pseudo-observation.
    #[test]
    fn optimism_follows_the_priors_measured_error() {
        let (s, _) = toy();
        let a = Candidate::new(d(4, 1, 1), 4, 1).unwrap();
        let b = Candidate::new(d(2, 2, 1), 8, 1).unwrap();
        let mut p = Copus::new(s.clone(), SwitchRule { explore: 0.3, ..no_dwell() }).unwrap();
        assert_eq!(p.optimism(), 0.3);
        // Both measured at their priors: no error, sqrt(0.09 / 3).
        p.observe_throughput(&a, s.throughput(&a).unwrap());
        assert_eq!(p.optimism(), 0.3, "one measurement says nothing about the spread");
        p.observe_throughput(&b, s.throughput(&b).unwrap());
        assert!((p.optimism() - (0.09f64 / 3.0).sqrt()).abs() < 1e-12, "{}", p.optimism());
        // One at e^0.5 times its prior, the other at e^-0.5: logs +-0.5 about their mean 0,
        // sample variance 0.5, so sqrt((0.09 + 2 * 0.5) / 3).
        let mut q = Copus::new(s.clone(), SwitchRule { explore: 0.3, ..no_dwell() }).unwrap();
        q.observe_throughput(&a, s.throughput(&a).unwrap() * 0.5f64.exp());
        q.observe_throughput(&b, s.throughput(&b).unwrap() * (-0.5f64).exp());
        assert!((q.optimism() - (1.09f64 / 3.0).sqrt()).abs() < 1e-12, "{}", q.optimism());
    }

    /// The closed form against its integral over the log-normal (midpoint rule on +-12
    /// standard deviations), and by hand: at median = best, `e^(s^2/2) Phi(s) - 1/2`, 0.146352
    /// for s = 0.3; without spread, the plain difference.
    #[test]
    fn expected_improvement_matches_its_integral() {
        for (median, best, s) in [(1.0, 1.0, 0.3), (0.7, 1.0, 0.25), (15.4, 6.7, 0.3), (2.0, 5.0, 0.1), (3.0, 1.0, 1.0)] {
            let n = 200_000;
            let h = 24.0 / n as f64;
            let integral: f64 = (0..n)
                .map(|i| {
                    let z = -12.0 + (i as f64 + 0.5) * h;
                    let density = (-0.5 * z * z).exp() / (2.0 * std::f64::consts::PI).sqrt();
                    (median * (s * z).exp() - best).max(0.0) * density * h
                })
                .sum();
            let closed = expected_improvement(median, best, s);
            assert!((closed - integral).abs() <= 1e-7 * best.max(median), "{median} {best} {s}: {closed} vs {integral}");
        }
        assert!((expected_improvement(1.0, 1.0, 0.3) - 0.146352).abs() < 1e-6);
        assert_eq!(expected_improvement(3.0, 1.0, 0.0), 2.0);
        assert_eq!(expected_improvement(1.0, 3.0, 0.0), 0.0);
    }

    /// A layout trial is charged both changes it may cost (there and back): with tp2's
    /// expected gain `g` over dp4 (samples/s) and the horizon `H`, it is tried when the layout
    /// cost is just under `g H / (2 dp4)` and not when it is just over (a trial charged one
    /// change would still be made there).
    #[test]
    fn a_layout_trial_must_pay_for_going_there_and_back() {
        let (s, _) = toy();
        let dp4 = Candidate::new(d(4, 1, 1), 4, 1).unwrap();
        let tp2 = Candidate::new(d(2, 2, 1), 4, 1).unwrap();
        let (t_dp4, t_tp2) = (s.throughput(&dp4).unwrap(), s.throughput(&tp2).unwrap());
        let gain = expected_improvement(t_tp2, t_dp4, 0.3);
        let horizon = 600.0;
        let break_even = gain * horizon / (2.0 * t_dp4);
        for (cost, tried) in [(0.99 * break_even, true), (1.01 * break_even, false)] {
            let rule = SwitchRule { explore: 0.3, trial_steps: 2, layout_cost: cost, horizon, ..no_dwell() };
            let mut p = Copus::new(s.clone(), rule).unwrap();
            let mut decisions = Vec::new();
            for step in 1..=3 {
                p.observe_throughput(&dp4, t_dp4);
                decisions.push(p.decide(&StepObservation { step, current: dp4, noise: None, remaining_secs: None }));
            }
            let want = if tried { Decision::ChangeLayout(tp2) } else { Decision::Keep };
            assert_eq!(decisions, vec![Decision::Keep, Decision::Keep, want], "layout cost {cost:.1} s (break-even {break_even:.1} s)");
        }
    }

    /// Two layouts on 4 ranks, B_m 1, with the given samples/s: (layout, B_g, samples/s).
    fn scorer_of(rows: &[(ParallelDims, usize, f64)]) -> Scorer {
        let entries = rows
            .iter()
            .map(|&(l, b, t)| ProfileEntry { dp: l.dp, tp: l.tp, pp: l.pp, global_batch: b, micro_batch: 1, samples_per_sec: t })
            .collect();
        let p = ThroughputProfile::new("t".into(), "t".into(), entries).unwrap();
        let cands: Vec<Candidate> = rows.iter().map(|&(l, b, _)| Candidate::new(l, b, 1).unwrap()).collect();
        Scorer::plain(&cands, &p, 4.0).unwrap()
    }

    /// From dp4 B_g 64, smaller batches win at every noise scale here, but the best target
    /// alternates with it: dp4 B_g 4 at B_simple 1 (tp2 B_g 8 does not repay leaving dp4),
    /// tp2 B_g 8 at B_simple 20 (Goodput 12 against dp4 B_g 4's 10).
    fn alternating() -> (Scorer, Candidate, Candidate, Candidate) {
        let (a, b) = (d(4, 1, 1), d(2, 2, 1));
        let s = scorer_of(&[(a, 4, 10.0), (a, 64, 12.0), (b, 8, 14.0), (b, 64, 1.0)]);
        let c = |l, g| Candidate::new(l, g, 1).unwrap();
        (s, c(a, 64), c(a, 4), c(b, 8))
    }

    #[test]
    fn direction_confirmation_counts_a_batch_change_across_the_layouts_it_alternates_between() {
        let (s, start, a4, b8) = alternating();
        let phi = |step: u64| if step % 2 == 1 { 1.0 } else { 20.0 };
        for (confirmation, made_at) in [(Confirmation::PerLayout, None), (Confirmation::Direction, Some(4))] {
            let rule = SwitchRule { layout_cost: 1.0, horizon: 100.0, confirm_steps: 4, confirmation, ..no_dwell() };
            let mut p = Copus::new(s.clone(), rule).unwrap();
            let mut made = None;
            for step in 1..=12 {
                let decision = p.decide(&noisy(start, step, phi(step), 0.0));
                if decision != Decision::Keep {
                    // The change wanted at the judgement that completes the count.
                    assert_eq!(decision.target(start), if phi(step) == 1.0 { a4 } else { b8 });
                    made = Some(step);
                    break;
                }
            }
            assert_eq!(made, made_at, "{confirmation:?}");
        }
    }

    #[test]
    fn direction_confirmation_overlaps_the_dwell_and_waits_for_its_end() {
        let (s, start, a4, _) = alternating();
        for (confirmation, made_at) in [(Confirmation::PerLayout, 14), (Confirmation::Direction, 10)] {
            let rule = SwitchRule {
                layout_cost: 1.0,
                horizon: 100.0,
                min_dwell_steps: 10,
                confirm_steps: 5,
                explore: 0.0,
                confirmation,
                ..SwitchRule::default()
            };
            let mut p = Copus::new(s.clone(), rule).unwrap();
            // Per layout: judgements from the dwell's last step (10), five in a row by 14.
            // By direction: five in a row by step 5, then the change waits for step 10.
            for step in 1..made_at {
                assert_eq!(p.decide(&noisy(start, step, 1.0, 0.0)), Decision::Keep, "{confirmation:?} step {step}");
            }
            assert_eq!(p.decide(&noisy(start, made_at, 1.0, 0.0)), Decision::ChangeBatch(a4), "{confirmation:?}");
        }
    }

    /// A 20-step dwell, a 16-step count, no exploration.
    fn dwell_20_count_16(confirmation: Confirmation, trial_steps: u64) -> SwitchRule {
        SwitchRule {
            layout_cost: 1.0,
            horizon: 100.0,
            min_dwell_steps: 20,
            confirm_steps: 16,
            explore: 0.0,
            trial_steps,
            confirmation,
            ..SwitchRule::default()
        }
    }

    #[test]
    fn sequential_confirmation_ends_early_once_the_change_holds_across_the_widened_band() {
        // From dp4 B_g 64 (12 samples/s) at B_simple 1, dp4 B_g 4 (10 samples/s) is the change
        // wanted at every judgement. Plain Goodput (b0 4): it beats B_g 64 by 2% while
        // 10 > 1.02 x 12 (phi + 4) / (phi + 64), i.e. phi < 591.04 / 2.24 = 263.9, so across a
        // band whose high end 1 / (1 - z se) (|G|^2 = 1, its standard error se) is below that:
        // z se < 0.99621. With confidence 1 and 16 confirmations the k-th judgement's band is
        // z = 4 / sqrt(k) wide: se 0.5 holds first at k = 5 (2 / sqrt(4) = 1 does not),
        // se 0.9 at k = 14 (3.6 / sqrt(13) = 0.9985, 3.6 / sqrt(14) = 0.9621). `Direction`
        // waits for the dwell (20 steps); so does `Sequential` at se 0.98, which the rule's own
        // band (z 1, high end 50) passes but no widened one does (4 x 0.98 / sqrt(15) > 1: the
        // high end is infinite, where B_g 64 wins), and under a biased estimate. The early end
        // also waits for `trial_steps` steps of the running B_g (8: se 0.5 at step 8).
        let (s, start, a4, _) = alternating();
        let cases = [
            (Confirmation::Direction, 0.5, false, 4, 20),
            (Confirmation::Sequential, 0.5, false, 4, 5),
            (Confirmation::Sequential, 0.5, false, 8, 8),
            (Confirmation::Sequential, 0.9, false, 4, 14),
            (Confirmation::Sequential, 0.98, false, 4, 20),
            (Confirmation::Sequential, 0.5, true, 4, 20),
        ];
        for (confirmation, se, biased, trial_steps, made_at) in cases {
            let mut p = Copus::new(s.clone(), dwell_20_count_16(confirmation, trial_steps)).unwrap();
            let obs = |step| {
                let mut o = noisy(start, step, 1.0, se);
                o.noise.as_mut().unwrap().biased = biased;
                o
            };
            let case = format!("{confirmation:?} se {se} biased {biased} trial_steps {trial_steps}");
            for step in 1..made_at {
                assert_eq!(p.decide(&obs(step)), Decision::Keep, "{case} step {step}");
            }
            assert_eq!(p.decide(&obs(made_at)), Decision::ChangeBatch(a4), "{case}");
        }
    }

    #[test]
    fn sequential_confirmation_does_not_end_a_layout_change_at_the_same_batch_early() {
        // tp2 B_g 16 runs twice as fast as dp4 B_g 16: it wins at every noise scale, by a margin
        // no band bounds, so only the full count (16) and the dwell (20) hold it back.
        let (a, b) = (d(4, 1, 1), d(2, 2, 1));
        let s = scorer_of(&[(a, 16, 10.0), (b, 16, 20.0)]);
        let (a16, b16) = (Candidate::new(a, 16, 1).unwrap(), Candidate::new(b, 16, 1).unwrap());
        let mut p = Copus::new(s, dwell_20_count_16(Confirmation::Sequential, 4)).unwrap();
        for step in 1..20 {
            assert_eq!(p.decide(&noisy(a16, step, 1.0, 0.1)), Decision::Keep, "step {step}");
        }
        assert_eq!(p.decide(&noisy(a16, 20, 1.0, 0.1)), Decision::ChangeLayout(b16));
    }

    #[test]
    fn a_layout_the_prior_rates_low_is_tried_with_explore_layout() {
        // The running dp4 B_g 16 is measured at its prior (10 samples/s); tp2 B_g 16's prior is
        // 5.5. With the default log-error 0.3 its expected improvement, 10 E[max(V/10 - 1, 0)]
        // for V log-normal about 5.5, is 0.03 (0.3%), below the 5% layout threshold. With
        // explore_layout 0.5 (a layout never measured): s = sqrt(0.3^2 + 0.5^2) = 0.583,
        // d = ln(0.55) / s = -1.025, EI = 5.5 e^(s^2/2) Phi(d + s) - 10 Phi(d) = 0.62 (6.2%),
        // and 0.62 x 600 s of horizon repays two 10 s layout changes at 10 samples/s.
        let (a, b) = (d(4, 1, 1), d(2, 2, 1));
        let s = scorer_of(&[(a, 16, 10.0), (b, 16, 5.5), (a, 64, 12.0), (b, 64, 7.0)]);
        let (a16, b16) = (Candidate::new(a, 16, 1).unwrap(), Candidate::new(b, 16, 1).unwrap());
        let s_c = (0.3f64 * 0.3 + 0.25).sqrt();
        let ei = expected_improvement(5.5, 10.0, s_c);
        assert!((ei - 0.619).abs() < 0.002, "{ei}");
        assert!(expected_improvement(5.5, 10.0, 0.3) < 0.05);
        for (explore_layout, want) in [(0.0, Decision::Keep), (0.5, Decision::ChangeLayout(b16))] {
            // A long dwell: only the running B_g's candidates are compared, by throughput.
            let rule = SwitchRule { min_dwell_steps: 1000, explore_layout, ..SwitchRule::default() };
            let mut p = Copus::new(s.clone(), rule).unwrap();
            let mut decisions = Vec::new();
            // The running configuration is compared after its 8 trial steps: at step 9.
            for step in 1..=9 {
                p.observe_throughput(&a16, 10.0);
                decisions.push(p.decide(&noisy(a16, step, 4.0, 0.0)));
            }
            let want_all: Vec<Decision> = (1..=9).map(|i| if i == 9 { want } else { Decision::Keep }).collect();
            assert_eq!(decisions, want_all, "explore_layout {explore_layout}");
        }
    }
}
