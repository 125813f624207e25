//! The policy line-up of a comparison: every baseline and Copus, each with the configuration it
//! starts from, built from one scorer; and [`Named`], a policy under another name.

use super::baselines::{CbsFixedLayout, DpOnlyGoodput, MerrillWarmup, Static};
use super::copus::{Copus, SwitchRule};
use super::error::PolicyError;
use super::interface::{Decision, Policy, PolicyState, StepObservation};
use super::scorer::Scorer;
use crate::candidates::Candidate;
use crate::layout::ParallelDims;

/// A policy under another name: every call but [`Policy::name`] goes to the wrapped policy,
/// throughput learning and checkpoints included.
pub struct Named {
    name: String,
    policy: Box<dyn Policy>,
}

impl Named {
    /// `policy`, reported as `name`.
    pub fn new(name: impl Into<String>, policy: Box<dyn Policy>) -> Self {
        Self { name: name.into(), policy }
    }
}

impl Policy for Named {
    fn name(&self) -> String {
        self.name.clone()
    }
    fn decide(&mut self, obs: &StepObservation) -> Decision {
        self.policy.decide(obs)
    }
    fn observe_reconfiguration(&mut self, seconds: f64, layout_changed: bool) {
        self.policy.observe_reconfiguration(seconds, layout_changed);
    }
    fn scorer(&self) -> Option<&Scorer> {
        self.policy.scorer()
    }
    fn scorer_mut(&mut self) -> Option<&mut Scorer> {
        self.policy.scorer_mut()
    }
    // Forwarded too, not left to the defaults: the wrapped policy may learn without a scorer, or
    // more than its scorer's measurements.
    fn observe_throughput(&mut self, candidate: &Candidate, samples_per_sec: f64) {
        self.policy.observe_throughput(candidate, samples_per_sec);
    }
    fn learned(&self) -> PolicyState {
        self.policy.learned()
    }
    fn restore_learned(&mut self, state: &PolicyState) {
        self.policy.restore_learned(state);
    }
}

/// One policy of a [`Lineup`] and where it starts.
pub struct Entry {
    /// The policy, named for reports (a baseline's name says its layout and batch).
    pub policy: Box<dyn Policy>,
    /// The configuration the run starts from under this policy.
    pub start: Candidate,
    /// `true` for every baseline, `false` for Copus.
    pub baseline: bool,
}

/// The baselines and Copus, each with its starting configuration; see [`lineup()`].
pub struct Lineup {
    /// In report order: one static policy per global batch (ascending), CBS pessimistic and
    /// optimistic, Merrill warmup, dp-only Goodput, and Copus last.
    pub entries: Vec<Entry>,
    /// Where Copus starts: the fastest candidate at the smallest global batch.
    pub copus_start: Candidate,
}

/// The fastest candidate at global batch `b`.
fn best_at(scorer: &Scorer, b: usize) -> Option<Candidate> {
    scorer.candidates().filter(|(c, _)| c.global_batch == b).max_by(|x, y| x.1.total_cmp(&y.1)).map(|(c, _)| *c)
}

/// The fastest candidate at the smallest global batch `dims` runs.
pub fn smallest_on(scorer: &Scorer, dims: ParallelDims) -> Option<Candidate> {
    let b = scorer.candidates().filter(|(c, _)| c.dims == dims).map(|(c, _)| c.global_batch).min()?;
    scorer.fastest(dims, b)
}

/// Every baseline and Copus over `scorer`'s candidates, in report order:
///
/// - `static B_g=<b> (<layout>)` for each global batch `b`, from the fastest candidate at `b`;
/// - `cbs pessimistic (<layout>)` and `cbs optimistic (<layout>)`: [`CbsFixedLayout`] with
///   `cbs_c`, monotone, on the layout of the fastest candidate at the smallest and at the largest
///   global batch, each from the smallest global batch on its layout;
/// - `merrill warmup (<layout>)`: [`MerrillWarmup`] from Copus's start;
/// - `dp-only goodput (<layout>)`: [`DpOnlyGoodput`] with `rule` on the widest data-parallel
///   layout (among equally wide ones the fastest at the smallest global batch they all run), from
///   the smallest global batch on it;
/// - [`Copus`] with `rule`, from the fastest candidate at the smallest global batch.
///
/// Errors: [`PolicyError::NoCandidates`] for a scorer without candidates, and the policies' own
/// errors for bad settings (`cbs_c`, `rule`).
pub fn lineup(scorer: &Scorer, rule: SwitchRule, cbs_c: f64) -> Result<Lineup, PolicyError> {
    let mut batches: Vec<usize> = scorer.candidates().map(|(c, _)| c.global_batch).collect();
    batches.sort_unstable();
    batches.dedup();
    let (Some(&b_min), Some(&b_max)) = (batches.first(), batches.last()) else { return Err(PolicyError::NoCandidates) };
    // Every listed B_g and layout below comes from a candidate, so the look-ups that follow
    // cannot miss; they still answer with an error rather than a panic.
    let start = best_at(scorer, b_min).ok_or(PolicyError::NoCandidates)?;
    let large = best_at(scorer, b_max).ok_or(PolicyError::NoCandidates)?;
    let mut entries = Vec::new();
    let baseline = |name: String, policy: Box<dyn Policy>, start: Candidate| Entry {
        policy: Box::new(Named::new(name, policy)),
        start,
        baseline: true,
    };
    for &b in &batches {
        let c = best_at(scorer, b).ok_or(PolicyError::NoCandidates)?;
        entries.push(baseline(format!("static B_g={b} ({})", c.dims), Box::new(Static), c));
    }
    for (label, layout) in [("pessimistic", start.dims), ("optimistic", large.dims)] {
        let p = CbsFixedLayout::new(scorer.clone(), layout, cbs_c, true)?;
        let s = smallest_on(scorer, layout).ok_or(PolicyError::NoLayout(layout))?;
        entries.push(baseline(format!("cbs {label} ({layout})"), Box::new(p), s));
    }
    entries.push(baseline(format!("merrill warmup ({})", start.dims), Box::new(MerrillWarmup::new(scorer.clone())), start));
    let dp_layout = widest_dp_layout(scorer).ok_or(PolicyError::NoCandidates)?;
    let dp = DpOnlyGoodput::new(scorer.clone(), rule)?;
    let dp_start = smallest_on(scorer, dp_layout).ok_or(PolicyError::NoLayout(dp_layout))?;
    entries.push(baseline(format!("dp-only goodput ({dp_layout})"), Box::new(dp), dp_start));
    let copus = Copus::new(scorer.clone(), rule)?;
    entries.push(Entry { policy: Box::new(copus), start, baseline: false });
    Ok(Lineup { entries, copus_start: start })
}

/// The widest dp; among equally wide layouts the fastest at the smallest B_g they all run (the
/// last of equally fast ones in (tp, pp) order). `None` without candidates.
fn widest_dp_layout(scorer: &Scorer) -> Option<ParallelDims> {
    let widest = scorer.candidates().map(|(c, _)| c.dims.dp).max()?;
    let mut wide: Vec<ParallelDims> = scorer.candidates().filter(|(c, _)| c.dims.dp == widest).map(|(c, _)| c.dims).collect();
    wide.sort_by_key(|d| (d.tp, d.pp));
    wide.dedup();
    let common = wide.iter().filter_map(|d| scorer.candidates().filter(|(c, _)| c.dims == *d).map(|(c, _)| c.global_batch).min()).max();
    let t = |d: &ParallelDims| common.and_then(|b| scorer.fastest(*d, b)).and_then(|c| scorer.throughput(&c)).unwrap_or(0.0);
    wide.into_iter().max_by(|a, b| t(a).total_cmp(&t(b)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::test_util::{d, obs, toy};

    fn c(dims: ParallelDims, b: usize) -> Candidate {
        Candidate::new(dims, b, 1).unwrap()
    }

    #[test]
    fn the_lineup_on_the_toy_scorer_names_orders_and_starts_every_policy() {
        // By hand on the toy profile: tp2 is fastest up to B_g 32, dp4 from 64 on (step time dp4
        // 0.5 + 0.025 B_g, tp2 0.1 + 0.04 B_g: equal at B_g 26.7). dp4 is the widest dp.
        let (s, _) = toy();
        let (dp4, tp2) = (d(4, 1, 1), d(2, 2, 1));
        let l = lineup(&s, SwitchRule::default(), 1.0).unwrap();
        let got: Vec<(String, Candidate, bool)> = l.entries.iter().map(|e| (e.policy.name(), e.start, e.baseline)).collect();
        let want = vec![
            ("static B_g=4 (dp2,tp2,pp1)".to_string(), c(tp2, 4), true),
            ("static B_g=8 (dp2,tp2,pp1)".into(), c(tp2, 8), true),
            ("static B_g=16 (dp2,tp2,pp1)".into(), c(tp2, 16), true),
            ("static B_g=32 (dp4,tp1,pp1)".into(), c(dp4, 32), true),
            ("static B_g=64 (dp4,tp1,pp1)".into(), c(dp4, 64), true),
            ("static B_g=128 (dp4,tp1,pp1)".into(), c(dp4, 128), true),
            ("cbs pessimistic (dp2,tp2,pp1)".into(), c(tp2, 4), true),
            ("cbs optimistic (dp4,tp1,pp1)".into(), c(dp4, 4), true),
            ("merrill warmup (dp2,tp2,pp1)".into(), c(tp2, 4), true),
            ("dp-only goodput (dp4,tp1,pp1)".into(), c(dp4, 4), true),
            ("copus".into(), c(tp2, 4), false),
        ];
        assert_eq!(got, want);
        assert_eq!(l.copus_start, c(tp2, 4));
    }

    #[test]
    fn a_lineup_without_candidates_is_an_error_not_a_panic() {
        assert_eq!(lineup(&Scorer::empty_for_tests(), SwitchRule::default(), 1.0).err(), Some(PolicyError::NoCandidates));
        // The way a user gets there: an empty candidate list is refused when the scorer is built.
        let empty: [Candidate; 0] = [];
        let built = Scorer::plain(&empty, &toy().1, 4.0).and_then(|s| lineup(&s, SwitchRule::default(), 1.0));
        assert!(matches!(built, Err(PolicyError::NoCandidates)));
        // Bad settings are the policies' own errors.
        assert!(matches!(lineup(&toy().0, SwitchRule::default(), 0.0), Err(PolicyError::Bad { field: "c", .. })));
    }

    #[test]
    fn named_forwards_everything_but_its_name() {
        let (s, _) = toy();
        let cur = c(d(4, 1, 1), 8);
        let mut plain = MerrillWarmup::new(s.clone());
        let mut named = Named::new("warmup", Box::new(MerrillWarmup::new(s)));
        assert_eq!(named.name(), "warmup");
        assert_eq!(named.decide(&obs(cur, 20.0)), plain.decide(&obs(cur, 20.0)));
        // Throughput learning reaches the wrapped policy's scorer and its checkpoint.
        named.observe_throughput(&cur, 7.0);
        plain.observe_throughput(&cur, 7.0);
        assert_eq!(named.scorer().unwrap().throughput(&cur), Some(7.0));
        assert_eq!(named.learned(), plain.learned());
        let mut restored = Named::new("warmup", Box::new(MerrillWarmup::new(toy().0)));
        restored.restore_learned(&plain.learned());
        assert_eq!(restored.learned().measured, vec![(cur, 7.0)]);
        assert!(named.scorer_mut().is_some());
    }
}
