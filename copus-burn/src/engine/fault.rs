//! Fault injection for the rollback, divergence, timeout and recovery tests: a failure planted
//! at one phase of the next layout change, a NaN gradient, a hung rank, a panicking rank, a lost
//! device. They can be planted only with
//! the off-by-default feature `fault-injection`; without it the types hold nothing, every check
//! is a constant `false`, and the hooks compile away.

use super::error::ReconfigPhase;

/// A planted failure, or none: the phase, and whether the rollback fails too.
#[cfg(feature = "fault-injection")]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Fault(Option<ReconfigPhase>, bool);

/// No failure can be planted without `fault-injection`: the value holds nothing.
#[cfg(not(feature = "fault-injection"))]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Fault;

#[cfg(feature = "fault-injection")]
impl Fault {
    /// No failure.
    pub(crate) fn none() -> Self {
        Self(None, false)
    }

    /// A failure at `phase` (none for `None`).
    pub(crate) fn at_phase(phase: Option<ReconfigPhase>) -> Self {
        Self(phase, false)
    }

    /// A failure at `phase` that strikes the rollback too.
    pub(crate) fn with_failed_rollback(phase: ReconfigPhase) -> Self {
        Self(Some(phase), true)
    }

    /// What the rollback after this fault meets: the same fault when it strikes the rollback
    /// too, else none.
    pub(crate) fn for_rollback(self) -> Self {
        if self.1 { self } else { Self::none() }
    }

    /// Whether the failure is planted at `phase`.
    pub(crate) fn hits(self, phase: ReconfigPhase) -> bool {
        self.0 == Some(phase)
    }

    /// The phase it is planted at.
    pub(crate) fn phase(self) -> Option<ReconfigPhase> {
        self.0
    }
}

#[cfg(not(feature = "fault-injection"))]
impl Fault {
    /// No failure: the only value.
    pub(crate) fn none() -> Self {
        Self
    }

    /// None.
    pub(crate) fn for_rollback(self) -> Self {
        self
    }

    /// Never.
    pub(crate) fn hits(self, _phase: ReconfigPhase) -> bool {
        false
    }

    /// None.
    pub(crate) fn phase(self) -> Option<ReconfigPhase> {
        None
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
    crash: Option<usize>,
}

/// Faults planted in one step: none without `fault-injection`.
#[cfg(not(feature = "fault-injection"))]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub(crate) struct StepFault;

#[cfg(feature = "fault-injection")]
impl StepFault {
    /// Whether the step's gradient gets a NaN.
    pub(crate) fn poison(self) -> bool {
        self.poison
    }

    /// Whether world rank `rank` panics in the middle of the step (after its backward passes,
    /// before the reductions).
    pub(crate) fn crashes(self, rank: usize) -> bool {
        self.crash == Some(rank)
    }

    /// Whether world rank `rank` hangs instead of stepping.
    pub(crate) fn stalls(self, rank: usize) -> bool {
        self.stall == Some(rank)
    }
}

#[cfg(not(feature = "fault-injection"))]
impl StepFault {
    /// Never.
    pub(crate) fn crashes(self, _rank: usize) -> bool {
        false
    }

    /// Never.
    pub(crate) fn stalls(self, _rank: usize) -> bool {
        false
    }
}

/// The step faults planted on an engine: NaN gradients for `poison.1` steps from step
/// `poison.0` on, a rank that hangs in the next step, a rank that panics in the step after
/// `crash.0` steps (`crash.1`), and the most ranks a launch may start once a device is gone.
#[cfg(feature = "fault-injection")]
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct PlantedSteps {
    pub(crate) poison: (u64, u64),
    pub(crate) stall: Option<usize>,
    pub(crate) crash: Option<(u64, usize)>,
    pub(crate) max_world: Option<usize>,
}

#[cfg(feature = "fault-injection")]
impl PlantedSteps {
    /// The faults of the step after `steps_done` steps, consumed.
    pub(crate) fn next(&mut self, steps_done: u64) -> StepFault {
        let poison = steps_done >= self.poison.0 && self.poison.1 > 0;
        if poison {
            self.poison.1 -= 1;
        }
        let crash = match self.crash {
            Some((at, rank)) if steps_done >= at => {
                self.crash = None;
                Some(rank)
            }
            _ => None,
        };
        StepFault { poison, stall: self.stall.take(), crash }
    }
}
