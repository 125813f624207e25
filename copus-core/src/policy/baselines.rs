//! The baseline policies copus is compared with: [`Static`], [`CbsFixedLayout`],
//! [`MerrillWarmup`] and [`DpOnlyGoodput`]. None of them changes the layout.

use super::copus::SwitchRule;
use super::error::{PolicyError, check};
use super::interface::{Decision, Policy, StepObservation};
use super::scorer::Scorer;
use crate::layout::ParallelDims;

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
    fn scorer(&self) -> Option<&Scorer> {
        Some(&self.scorer)
    }
    fn scorer_mut(&mut self) -> Option<&mut Scorer> {
        Some(&mut self.scorer)
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
    fn scorer(&self) -> Option<&Scorer> {
        Some(&self.scorer)
    }
    fn scorer_mut(&mut self) -> Option<&mut Scorer> {
        Some(&mut self.scorer)
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

/// AdaptDL/Pollux-like: the best Goodput over (B_g, B_m) on the current layout.
#[derive(Clone)]
pub struct DpOnlyGoodput {
    scorer: Scorer,
    rule: SwitchRule,
}

impl DpOnlyGoodput {
    /// With the batch threshold of `rule` (its other settings are checked, not used); an error
    /// if `rule` is out of range ([`SwitchRule::validate`]).
    pub fn new(scorer: Scorer, rule: SwitchRule) -> Result<Self, PolicyError> {
        rule.validate()?;
        Ok(Self { scorer, rule })
    }
}

impl Policy for DpOnlyGoodput {
    fn name(&self) -> String {
        "dp-only-goodput".into()
    }
    fn scorer(&self) -> Option<&Scorer> {
        Some(&self.scorer)
    }
    fn scorer_mut(&mut self) -> Option<&mut Scorer> {
        Some(&mut self.scorer)
    }
    fn decide(&mut self, obs: &StepObservation) -> Decision {
        let Some(phi) = obs.b_simple() else { return Decision::Keep };
        let cur = &obs.current;
        let Some(best) = self.scorer.best(phi, |c| c.dims == cur.dims) else { return Decision::Keep };
        let now = self.scorer.throughput(cur).map_or(0.0, |t| self.scorer.goodput(t, cur.global_batch, phi));
        if best.goodput > now * (1.0 + self.rule.batch_threshold) { Decision::to(cur, best.candidate) } else { Decision::Keep }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::candidates::Candidate;
    use crate::policy::Copus;
    use crate::policy::test_util::{d, obs, toy};

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
        let none = StepObservation { step: 0, current: cur, noise: None, remaining_secs: None };
        assert_eq!(Copus::new(s, SwitchRule::default()).unwrap().decide(&none), Decision::Keep);
        assert!(CbsFixedLayout::new(toy().0, d(1, 4, 1), 1.0, true).is_err());
    }
}
