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

/// Faults planted in one step: a NaN written into the gradient (divergence tests) and the world
/// rank that hangs instead of stepping (timeout tests). Without `fault-injection` it holds
/// nothing, so neither the step command nor the MPI step header carries a hook.
#[cfg(feature = "fault-injection")]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub(crate) struct StepFault {
    poison: bool,
    stall: Option<usize>,
}

/// Faults planted in one step: none without `fault-injection`.
#[cfg(not(feature = "fault-injection"))]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub(crate) struct StepFault;

impl StepFault {
    /// Whether the step's gradient gets a NaN.
    pub(crate) fn poison(self) -> bool {
        #[cfg(feature = "fault-injection")]
        return self.poison;
        #[cfg(not(feature = "fault-injection"))]
        false
    }

    /// Whether world rank `rank` hangs instead of stepping.
    pub(crate) fn stalls(self, rank: usize) -> bool {
        #[cfg(feature = "fault-injection")]
        return self.stall == Some(rank);
        #[cfg(not(feature = "fault-injection"))]
        {
            let _ = rank;
            false
        }
    }
}

/// The step faults planted on an engine: NaN gradients for `poison.1` steps from step
/// `poison.0` on, and a rank that hangs in the next step.
#[cfg(feature = "fault-injection")]
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct PlantedSteps {
    pub(crate) poison: (u64, u64),
    pub(crate) stall: Option<usize>,
}

#[cfg(feature = "fault-injection")]
impl PlantedSteps {
    /// The faults of the step after `steps_done` steps, consumed.
    pub(crate) fn next(&mut self, steps_done: u64) -> StepFault {
        let poison = steps_done >= self.poison.0 && self.poison.1 > 0;
        if poison {
            self.poison.1 -= 1;
        }
        StepFault { poison, stall: self.stall.take() }
    }
}
