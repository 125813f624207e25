//! Which Copus decides a run: [`CopusRule`], the rule on the structured belief ([`Learning`],
//! the default: a recipe without a `rule`, the service, the evidence comparison) or the switch
//! rule of earlier waves ([`Copus`]), which the main recipes write explicitly (it won their
//! headline; `Learning` has not yet) and the simulated suite's and the real comparison's
//! line-ups run beside their baselines.

use serde::{Deserialize, Serialize};

use super::copus::{Copus, SwitchRule};
use super::error::PolicyError;
use super::interface::Policy;
use super::learning::{Learning, Rule};
use super::scorer::Scorer;
use crate::belief::FamilyPriors;

/// The Copus rule of a run, as a recipe writes it: `Learning(rule: (...), belief: (...))` or
/// `Switch((...))`.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub enum CopusRule {
    /// [`Learning`]: its six settings, and the prior standard deviations of its belief's
    /// families (how far the throughput prior may err, family by family).
    Learning {
        /// The decision rule.
        rule: Rule,
        /// The belief's family sizes ([`FamilyPriors::measured`] where a recipe is silent).
        #[serde(default = "FamilyPriors::measured")]
        belief: FamilyPriors,
    },
    /// [`Copus`] with a [`SwitchRule`]: the rule the earlier headlines were judged under.
    Switch(SwitchRule),
}

impl Default for CopusRule {
    fn default() -> Self {
        Self::Learning { rule: Rule::default(), belief: FamilyPriors::measured() }
    }
}

impl CopusRule {
    /// The default rule for a run of `horizon` seconds whose first guess of a layout change's
    /// cost is `layout_cost` (the run's remaining time, once it says, replaces the horizon).
    pub fn for_run(horizon: f64, layout_cost: f64) -> Self {
        Self::Learning { rule: Rule { horizon, layout_cost, ..Rule::default() }, belief: FamilyPriors::measured() }
    }

    /// Checks the settings; the error names the first one out of range.
    pub fn validate(&self) -> Result<(), PolicyError> {
        match self {
            Self::Learning { rule, .. } => rule.validate(),
            Self::Switch(rule) => rule.validate(),
        }
    }

    /// The policy over `scorer`'s candidates, on nodes of `ranks_per_node` ranks (the belief's
    /// data-parallel span family tells within a node from across nodes). Named `copus` either
    /// way: a resume checks the recipe, which names the rule.
    pub fn policy(&self, scorer: &Scorer, ranks_per_node: usize) -> Result<Box<dyn Policy>, PolicyError> {
        Ok(match self {
            Self::Learning { rule, belief } => Box::new(Learning::new(scorer.clone(), *rule, belief, ranks_per_node.max(1))?),
            Self::Switch(rule) => Box::new(Copus::new(scorer.clone(), *rule)?),
        })
    }

    /// The switch rule a data-parallel-only baseline runs beside this Copus: this one's own, or
    /// the default with the Learning rule's horizon and first layout cost.
    pub fn switch_rule(&self) -> SwitchRule {
        match self {
            Self::Learning { rule, .. } => SwitchRule { horizon: rule.horizon, layout_cost: rule.layout_cost, ..SwitchRule::default() },
            Self::Switch(rule) => *rule,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::test_util::toy;

    #[test]
    fn a_recipe_writes_either_rule_and_a_silent_belief_is_the_measured_one() {
        let learning: CopusRule = ron::from_str(
            "Learning(rule: (confidence: 1.0, threshold: 0.02, horizon: 60.0, layout_cost: 1.0, dwell_steps: 20, window: 8))",
        )
        .unwrap();
        assert_eq!(learning, CopusRule::for_run(60.0, 1.0));
        let switch: CopusRule =
            ron::from_str("Switch((batch_threshold: 0.02, layout_threshold: 0.05, horizon: 60.0, layout_cost: 1.0, cost_smoothing: 0.5))")
                .unwrap();
        let by_hand = SwitchRule {
            batch_threshold: 0.02,
            layout_threshold: 0.05,
            horizon: 60.0,
            layout_cost: 1.0,
            cost_smoothing: 0.5,
            ..SwitchRule::default()
        };
        assert_eq!(switch, CopusRule::Switch(by_hand));
        let e = ron::from_str::<CopusRule>(
            "Learning(rule: (confidence: 1.0, threshold: 0.02, horizon: 60.0, layout_cost: 1.0, dwell_steps: 20, window: 8), beleif: ())",
        );
        assert!(e.unwrap_err().to_string().contains("beleif"));
        let text = ron::to_string(&learning).unwrap();
        assert_eq!(ron::from_str::<CopusRule>(&text).unwrap(), learning);
    }

    #[test]
    fn each_rule_builds_its_policy_and_refuses_bad_settings() {
        let (s, _) = toy();
        assert!(CopusRule::default().policy(&s, 2).is_ok());
        assert!(CopusRule::Switch(SwitchRule::default()).policy(&s, 2).is_ok());
        let bad = CopusRule::for_run(0.0, 1.0);
        assert!(matches!(bad.validate(), Err(PolicyError::Bad { field: "horizon", .. })));
        assert!(bad.policy(&s, 2).is_err());
        assert_eq!(CopusRule::for_run(90.0, 3.0).switch_rule().horizon, 90.0);
        assert_eq!(CopusRule::for_run(90.0, 3.0).switch_rule().layout_cost, 3.0);
    }
}
