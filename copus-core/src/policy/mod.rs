//! Policies: after each optimizer step, keep the configuration, change the batch (same layout),
//! or change the layout. All choose among the feasible candidates only, so a decision is always
//! something copus-core accepted.
//!
//! The module itself holds what every policy shares: the [`Policy`] trait, what it sees
//! ([`StepObservation`]) and answers ([`Decision`]) and what it learns ([`PolicyState`]). The
//! rest, one job per file, is re-exported here:
//!
//! - `error.rs`: [`PolicyError`], what a policy refuses.
//! - `scorer.rs`: [`Scorer`] and [`Score`], candidates with predicted (then measured) throughput,
//!   scored by Goodput.
//! - `baselines.rs`: the policies copus is compared with:
//!   - [`Static`]: never changes.
//!   - [`CbsFixedLayout`]: B_g near `c * B_simple` on a fixed layout.
//!   - [`MerrillWarmup`]: doubles B_g when the critical batch passes `2 * B_g` (sqrt LR rule).
//!   - [`DpOnlyGoodput`]: AdaptDL-like: best Goodput over (B_g, B_m) on a fixed layout.
//! - `copus.rs`: [`Copus`], best Goodput over all candidates, with switch thresholds and a payback
//!   test for layout changes, and its [`SwitchRule`].
//! - `oracle.rs`: [`hindsight_oracle`], the best [`Schedule`] for a known noise [`Trajectory`], by
//!   dynamic programming, and [`schedule_time`] to cost any schedule on the same terms (regret).
//! - `lineup.rs`: [`lineup()`], the baselines and Copus with their starting configurations, as a
//!   comparison runs them, and [`Named`] to run a policy under another name.

mod baselines;
mod copus;
mod error;
mod lineup;
mod oracle;
mod scorer;
#[cfg(test)]
mod test_util;

use serde::{Deserialize, Serialize};

use crate::candidates::Candidate;
use crate::gns::NoiseEstimate;
use crate::layout::ParallelDims;

pub use baselines::{CbsFixedLayout, DpOnlyGoodput, MerrillWarmup, Static};
pub use copus::{Copus, SwitchRule};
pub use error::PolicyError;
use error::check;
pub use lineup::{Entry, Lineup, Named, lineup, smallest_on};
pub use oracle::{Schedule, SwitchCosts, Trajectory, hindsight_oracle, schedule_time};
pub use scorer::{Score, Scorer};

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
    /// The decision that takes `current` to `target`: keep, a batch change or a layout change.
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
///
/// A policy that scores candidates with a [`Scorer`] hands it out through [`Policy::scorer`] and
/// [`Policy::scorer_mut`]; the default [`Policy::observe_throughput`], [`Policy::learned`] and
/// [`Policy::restore_learned`] then learn, save and restore its measured throughput, so a policy
/// only overrides them to learn more than that (as [`Copus`] does for switch costs and
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
fn learned_by_scorer(scorer: Option<&Scorer>) -> PolicyState {
    PolicyState { measured: scorer.map(Scorer::measured).unwrap_or_default(), ..PolicyState::default() }
}

/// The part of [`Policy::restore_learned`] every policy shares: puts the measurements of `state`
/// back into the scorer, if the policy has one.
fn restore_scorer(scorer: Option<&mut Scorer>, state: &PolicyState) {
    if let Some(scorer) = scorer {
        scorer.set_measured(&state.measured);
    }
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
    /// The candidate on trial and the step its trial was decided at (exploration).
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
}

#[cfg(test)]
mod tests {
    use super::test_util::{d, no_dwell, toy};
    use super::*;

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
    fn every_policy_with_a_scorer_learns_saves_and_restores_its_measurements() {
        let (s, _) = toy();
        let cur = Candidate::new(d(4, 1, 1), 8, 1).unwrap();
        let make = |s: Scorer| -> Vec<Box<dyn Policy>> {
            vec![
                Box::new(CbsFixedLayout::new(s.clone(), d(4, 1, 1), 1.0, true).unwrap()),
                Box::new(MerrillWarmup::new(s.clone())),
                Box::new(DpOnlyGoodput::new(s.clone(), SwitchRule::default()).unwrap()),
                Box::new(Copus::new(s, SwitchRule::default()).unwrap()),
            ]
        };
        for (mut p, mut fresh) in make(s.clone()).into_iter().zip(make(s.clone())) {
            p.observe_throughput(&cur, 7.0);
            assert_eq!(p.scorer().unwrap().throughput(&cur), Some(7.0), "{}", p.name());
            assert_eq!(p.learned().measured, vec![(cur, 7.0)], "{}", p.name());
            fresh.restore_learned(&p.learned());
            assert_eq!(fresh.learned(), p.learned(), "{}", p.name());
            assert_eq!(fresh.scorer().unwrap().throughput(&cur), Some(7.0), "{}", p.name());
        }
        // A policy without a scorer learns nothing and saves nothing.
        let mut st = Static;
        st.observe_throughput(&cur, 7.0);
        st.restore_learned(&PolicyState { measured: vec![(cur, 7.0)], ..PolicyState::default() });
        assert!(st.scorer().is_none());
        assert_eq!(st.learned(), PolicyState::default());
    }
}
