//! What every policy shares: the observation it decides on ([`StepObservation`]), its answer
//! ([`Decision`]), the [`Policy`] trait and what a policy learned during a run
//! ([`PolicyState`]). The policies build on this file; it imports none of them.

use serde::{Deserialize, Serialize};

use super::scorer::Scorer;
use crate::candidates::Candidate;
use crate::gns::NoiseEstimate;
use crate::layout::ParallelDims;

/// What a policy sees after a step.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct StepObservation {
    /// Optimizer steps done.
    pub step: u64,
    /// Configuration that ran the step.
    pub current: Candidate,
    /// Smoothed noise estimate, once there is one.
    pub noise: Option<NoiseEstimate>,
    /// Seconds the run has left, where the run knows: its time budget less the time spent, or
    /// its remaining samples at the current rate. The horizon over which a change must repay
    /// its cost; policies that do not weigh costs ignore it. Absent in older observations.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub remaining_secs: Option<f64>,
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
    /// The decision that takes `current` to `target`: keep, a batch change or a layout change.
    pub(super) fn to(current: &Candidate, target: Candidate) -> Self {
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
///
/// A policy that scores candidates with a [`Scorer`] hands it out through [`Policy::scorer`] and
/// [`Policy::scorer_mut`]; the default [`Policy::observe_throughput`], [`Policy::learned`] and
/// [`Policy::restore_learned`] then learn, save and restore its measured throughput, so a policy
/// only overrides them to learn more than that (as [`Copus`](super::Copus) does for switch costs and
/// hysteresis).
pub trait Policy: Send {
    /// Name for reports.
    fn name(&self) -> String;
    /// The decision after a step.
    fn decide(&mut self, obs: &StepObservation) -> Decision;
    /// Tells the policy what a reconfiguration really cost, in seconds on the run's clock.
    fn observe_reconfiguration(&mut self, _seconds: f64, _layout_changed: bool) {}
    /// The candidates and throughputs the policy decides by, if it keeps a [`Scorer`]; `None`
    /// (the default) for a policy that learns nothing from throughput.
    fn scorer(&self) -> Option<&Scorer> {
        None
    }
    /// [`Policy::scorer`], mutable: where the default [`Policy::observe_throughput`] and
    /// [`Policy::restore_learned`] put what they learn.
    fn scorer_mut(&mut self) -> Option<&mut Scorer> {
        None
    }
    /// Tells the policy the samples/s a step of `candidate` achieved on the run's clock; a
    /// policy with a [`Scorer`] learns from it ([`Scorer::observe_throughput`]).
    fn observe_throughput(&mut self, candidate: &Candidate, samples_per_sec: f64) {
        if let Some(scorer) = self.scorer_mut() {
            scorer.observe_throughput(candidate, samples_per_sec);
        }
    }
    /// What the policy has learned during the run (measured throughput, switch costs), for a
    /// whole-run checkpoint. Settings given at construction are not part of it. By default the
    /// scorer's measurements, if the policy has a scorer.
    fn learned(&self) -> PolicyState {
        learned_by_scorer(self.scorer())
    }
    /// Continues from a [`Policy::learned`] of the same policy over the same candidates. By
    /// default restores the scorer's measurements, if the policy has a scorer.
    fn restore_learned(&mut self, state: &PolicyState) {
        restore_scorer(self.scorer_mut(), state);
    }
}

/// The part of [`Policy::learned`] every policy shares: the measurements of its scorer, if it
/// has one, and nothing else. An override that saves more starts from it.
pub(super) fn learned_by_scorer(scorer: Option<&Scorer>) -> PolicyState {
    PolicyState {
        measured: scorer.map(Scorer::measured).unwrap_or_default(),
        measured_counts: scorer.map(Scorer::measurement_counts).unwrap_or_default(),
        ..PolicyState::default()
    }
}

/// The part of [`Policy::restore_learned`] every policy shares: puts the measurements of `state`
/// back into the scorer, if the policy has one.
pub(super) fn restore_scorer(scorer: Option<&mut Scorer>, state: &PolicyState) {
    if let Some(scorer) = scorer {
        scorer.set_measured(&state.measured);
        scorer.set_measurement_counts(&state.measured_counts);
    }
}

/// What a policy learned during a run; see [`Policy::learned`].
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct PolicyState {
    /// Smoothed measured samples/s of the candidates the run has run.
    #[serde(default)]
    pub measured: Vec<(Candidate, f64)>,
    /// How many measurements each of `measured` averages ([`Scorer::measurement_counts`]);
    /// absent from older checkpoints, whose measurements then count as settled.
    #[serde(default)]
    pub measured_counts: Vec<(Candidate, u32)>,
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
    /// and that step ([`Learning`](super::Learning) confirms a batch direction only: its
    /// layout is the running one's).
    #[serde(default)]
    pub winning: Option<(ParallelDims, i8, u64)>,
    /// The candidate on trial and the step its trial was decided at (exploration;
    /// [`Learning`](super::Learning) keeps the candidate its trial left in `left`).
    #[serde(default)]
    pub trial: Option<(Candidate, u64)>,
    /// The hysteresis state (`left`, `left_layout`) from before the trial running.
    #[serde(default)]
    pub before_trial: Option<(Option<Candidate>, Option<ParallelDims>)>,
    /// The candidates tried so far (exploration).
    #[serde(default)]
    pub tried: Vec<Candidate>,
    /// The B_g running and the step it started at (dwell time).
    #[serde(default)]
    pub batch_seen: Option<(usize, u64)>,
    /// The structured belief's measurements ([`Learning`](super::Learning)): each measured
    /// candidate's step count, mean and sum of squared deviations of `ln(measured / prior)`.
    #[serde(default)]
    pub belief: Vec<(Candidate, f64, f64, f64)>,
    /// The rule that learned it where the policy's name does not tell: `Some("learning")` for
    /// [`Learning`](super::Learning), absent for the switch rule (and for every state saved
    /// before the two shared the name `copus`). A resume refuses a state of the other rule.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rule: Option<String>,
}
