//! Fault injection for the rollback tests: a failure planted at one phase of the next layout
//! change. It can be planted only with the off-by-default feature `fault-injection`; without it
//! every check is false and compiles away.

use super::error::ReconfigPhase;

/// A planted failure, or none.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Fault(Option<ReconfigPhase>);

impl Fault {
    /// A failure at `phase` (none for `None`).
    #[cfg(feature = "fault-injection")]
    pub(crate) fn at_phase(phase: Option<ReconfigPhase>) -> Self {
        Self(phase)
    }

    /// Whether the failure is planted at `phase`.
    pub(crate) fn hits(self, phase: ReconfigPhase) -> bool {
        cfg!(feature = "fault-injection") && self.0 == Some(phase)
    }

    /// The phase it is planted at.
    pub(crate) fn phase(self) -> Option<ReconfigPhase> {
        self.0.filter(|_| cfg!(feature = "fault-injection"))
    }
}
