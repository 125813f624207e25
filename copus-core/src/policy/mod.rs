//! Policies: after each optimizer step, keep the configuration, change the batch (same layout),
//! or change the layout. All choose among the feasible candidates only, so a decision is always
//! something copus-core accepted.
//!
//! One job per file, re-exported here (no two of the files import each other):
//!
//! - `error.rs`: [`PolicyError`], what a policy refuses.
//! - `scorer.rs`: [`Scorer`] and [`Score`], candidates with predicted (then measured) throughput,
//!   scored by Goodput.
//! - `interface.rs`: what every policy shares: the [`Policy`] trait, what it sees
//!   ([`StepObservation`]) and answers ([`Decision`]) and what it learns ([`PolicyState`]).
//! - `baselines.rs`: the policies copus is compared with:
//!   - [`Static`]: never changes.
//!   - [`CbsFixedLayout`]: B_g near `c * B_simple` on a fixed layout.
//!   - [`MerrillWarmup`]: doubles B_g when the critical batch passes `2 * B_g` (sqrt LR rule).
//!   - [`DpOnlyGoodput`]: AdaptDL-like: best Goodput over (B_g, B_m) on a fixed layout.
//! - `copus.rs`: [`Copus`], best Goodput over all candidates, with switch thresholds and a payback
//!   test for layout changes, and its [`SwitchRule`].
//! - `learning.rs`: [`Learning`], Copus on a structured throughput belief
//!   ([`crate::belief`]) with knowledge-gradient trials and one decision rule of six
//!   settings, [`Rule`].
//! - `choice.rs`: [`CopusRule`], which of the two decides a run (a recipe's `rule`), and the
//!   policy it builds.
//! - `oracle.rs`: [`hindsight_oracle`], the best [`Schedule`] for a known noise [`Trajectory`], by
//!   dynamic programming, and [`schedule_time`] to cost any schedule on the same terms (regret).
//! - `lineup.rs`: [`lineup()`], the baselines and Copus with their starting configurations, as a
//!   comparison runs them, and [`Named`] to run a policy under another name.

mod baselines;
mod choice;
mod copus;
mod error;
mod interface;
mod learning;
mod lineup;
mod oracle;
mod scorer;
#[cfg(test)]
mod test_util;

pub use baselines::{CbsFixedLayout, DpOnlyGoodput, MerrillWarmup, Static};
pub use choice::CopusRule;
pub use copus::{Choice, Confirmation, Copus, ExploreNoise, SwitchRule};
pub use error::PolicyError;
pub use interface::{Decision, Policy, PolicyState, StepObservation};
pub use learning::{Learning, Rule};
pub use lineup::{Entry, Lineup, Named, lineup, smallest_on};
pub use oracle::{Schedule, SwitchCosts, Trajectory, hindsight_oracle, schedule_time};
pub use scorer::{Score, Scorer};

#[cfg(test)]
mod tests {
    use super::test_util::{d, no_dwell, toy};
    use super::*;
    use crate::candidates::Candidate;

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
