//! Fault injection for the rollback tests: a failure planted at one phase of the next layout
//! change. It can be planted only with the off-by-default feature `fault-injection`; without it
//! every check is false and compiles away.

use super::error::ReconfigPhase;

/// A planted failure, or none.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Fault(Option<ReconfigPhase>, bool);

impl Fault {
    /// A failure at `phase` (none for `None`).
    #[cfg(feature = "fault-injection")]
    pub(crate) fn at_phase(phase: Option<ReconfigPhase>) -> Self {
        Self(phase, false)
    }

    /// A failure at `phase` that strikes the rollback too.
    #[cfg(feature = "fault-injection")]
    pub(crate) fn with_failed_rollback(phase: ReconfigPhase) -> Self {
        Self(Some(phase), true)
    }

    /// What the rollback after this fault meets: the same fault when it strikes the rollback
    /// too, else none.
    pub(crate) fn for_rollback(self) -> Self {
        if cfg!(feature = "fault-injection") && self.1 { self } else { Self::default() }
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
