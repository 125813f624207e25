//! What a policy refuses: bad settings and candidate lists with nothing to choose from.

use thiserror::Error;

use crate::layout::ParallelDims;

/// Bad policy settings.
#[derive(Clone, Debug, PartialEq, Error)]
pub enum PolicyError {
    /// No candidate has a throughput.
    #[error("no feasible candidate has a throughput; check the world size, batch lists and memory")]
    NoCandidates,
    /// A number out of range.
    #[error("`{field}` must be {allowed}, got {value}")]
    Bad {
        /// The setting's name as a rule or recipe spells it (`horizon`, `c`, `trajectory end`).
        field: &'static str,
        /// What the setting accepts, in words (`> 0 seconds`, `in [0, 1]`).
        allowed: &'static str,
        /// The value given (NaN where there was none, as for an empty trajectory).
        value: f64,
    },
    /// The fixed layout has no candidate.
    #[error("layout {0} has no feasible candidate")]
    NoLayout(ParallelDims),
}

/// `Ok` when `ok` holds and `value` is finite, else [`PolicyError::Bad`] naming `field`.
pub(super) fn check(field: &'static str, value: f64, ok: bool, allowed: &'static str) -> Result<(), PolicyError> {
    if ok && value.is_finite() { Ok(()) } else { Err(PolicyError::Bad { field, allowed, value }) }
}
