//! The policies a service can run, by name: `copus`, `dp-only`, `merrill` or `static`.

use copus_core::policy::{CopusRule, DpOnlyGoodput, MerrillWarmup, Policy, PolicyError, Scorer, Static};

/// Builds a named policy over a scorer: `copus` (under `rule`, on nodes of `ranks_per_node`
/// ranks), `dp-only` (under `rule`'s switch rule, [`CopusRule::switch_rule`]), `merrill` or
/// `static`.
pub fn policy_by_name(name: PolicyName, scorer: &Scorer, rule: CopusRule, ranks_per_node: usize) -> Result<Box<dyn Policy>, PolicyError> {
    Ok(match name {
        PolicyName::Copus => rule.policy(scorer, ranks_per_node)?,
        PolicyName::DpOnly => Box::new(DpOnlyGoodput::new(scorer.clone(), rule.switch_rule())?),
        PolicyName::Merrill => Box::new(MerrillWarmup::new(scorer.clone())),
        PolicyName::Static => Box::new(Static),
    })
}

/// The policies the service can run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PolicyName {
    /// Goodput over B_g, B_m and the 3D layout.
    Copus,
    /// Goodput over B_g on data-parallel layouts only (AdaptDL/Pollux).
    DpOnly,
    /// Batch warm-up in the style of Merrill et al.
    Merrill,
    /// The initial configuration, never changed.
    Static,
}

impl PolicyName {
    /// Every policy name, in the order `--help` lists them.
    pub const ALL: [PolicyName; 4] = [PolicyName::Copus, PolicyName::DpOnly, PolicyName::Merrill, PolicyName::Static];

    /// The name on the command line and in the protocol's `Welcome`.
    pub fn as_str(self) -> &'static str {
        match self {
            PolicyName::Copus => "copus",
            PolicyName::DpOnly => "dp-only",
            PolicyName::Merrill => "merrill",
            PolicyName::Static => "static",
        }
    }
}

impl std::fmt::Display for PolicyName {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A policy name that is not one of [`PolicyName::ALL`].
#[derive(Debug, thiserror::Error)]
#[error("unknown policy `{0}`; allowed: copus, dp-only, merrill, static")]
pub struct UnknownPolicy(pub String);

impl std::str::FromStr for PolicyName {
    type Err = UnknownPolicy;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::ALL.into_iter().find(|p| p.as_str() == s).ok_or_else(|| UnknownPolicy(s.to_string()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn policy_names_round_trip_and_unknown_ones_list_the_allowed() {
        for p in PolicyName::ALL {
            assert_eq!(p.to_string().parse::<PolicyName>().unwrap(), p);
        }
        let e = "goodput".parse::<PolicyName>().unwrap_err().to_string();
        assert!(e.contains("goodput") && e.contains("dp-only"), "{e}");
    }
}
