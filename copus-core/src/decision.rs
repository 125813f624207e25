//! Who decides the next configuration: the tensor-free interface between a training loop and
//! what chooses its batch size and layout.
//!
//! A [`DecisionSource`] is handed each finished step's observation and measured samples/s and
//! answers with a [`Decision`]; it is told what each carried-out switch cost, and may save and
//! restore what it learned with a run's checkpoints. The embedded [`Orchestrator`], a client of
//! a remote orchestrator service (copus-service) and a fixed [`Scripted`] plan are all decision
//! sources. The training loop that calls them (copus-burn's driver) checks every decision
//! against its own candidate space before applying it.

use std::collections::BTreeMap;

use thiserror::Error;

use crate::candidates::Candidate;
use crate::orchestrator::Orchestrator;
use crate::policy::{Decision, StepObservation};

/// A decision source's saved state that it cannot continue from.
#[derive(Debug, Error)]
pub enum SourceStateError {
    /// The saved state is not the JSON this source writes.
    #[error("the saved orchestrator state does not parse: {0}")]
    Parse(#[from] serde_json::Error),
    /// The state parses but belongs to another source (another policy, say).
    #[error("{0}")]
    Mismatch(String),
}

/// Who decides the next configuration.
pub trait DecisionSource {
    /// For logs and reports.
    fn name(&self) -> String;
    /// The decision after a finished step; `samples_per_sec` is what the step measured.
    fn on_step(&mut self, obs: &StepObservation, samples_per_sec: f64) -> Decision;
    /// A decision was carried out and took `seconds` (as the run's clock counts them).
    fn on_reconfigured(&mut self, seconds: f64, layout_changed: bool);
    /// What the source learned so far (JSON), saved with each whole-run checkpoint; `None`
    /// when it keeps nothing here (a scripted plan, a remote service that keeps its own).
    fn save_state(&self) -> Option<String> {
        None
    }
    /// Continues from a [`DecisionSource::save_state`].
    fn restore_state(&mut self, _state: &str) -> Result<(), SourceStateError> {
        Ok(())
    }
}

impl DecisionSource for Orchestrator {
    fn name(&self) -> String {
        self.policy_name()
    }
    fn on_step(&mut self, obs: &StepObservation, samples_per_sec: f64) -> Decision {
        self.on_step_measured(obs, samples_per_sec)
    }
    fn on_reconfigured(&mut self, seconds: f64, layout_changed: bool) {
        Orchestrator::on_reconfigured(self, seconds, layout_changed);
    }
    fn save_state(&self) -> Option<String> {
        serde_json::to_string(&self.state()).ok()
    }
    fn restore_state(&mut self, state: &str) -> Result<(), SourceStateError> {
        let state = serde_json::from_str(state)?;
        self.restore(&state).map_err(|e| SourceStateError::Mismatch(e.to_string()))
    }
}

/// Decisions fixed in advance: after step `s` (1-based, as [`StepObservation::step`]), go to
/// the listed configuration. For tests and replays.
#[derive(Clone, Debug, Default)]
pub struct Scripted {
    plan: BTreeMap<u64, Candidate>,
    /// Reconfiguration costs reported back, in order.
    pub reported: Vec<(f64, bool)>,
}

impl Scripted {
    /// Goes to `target` after each listed step.
    pub fn new(plan: impl IntoIterator<Item = (u64, Candidate)>) -> Self {
        Self { plan: plan.into_iter().collect(), reported: Vec::new() }
    }
}

impl DecisionSource for Scripted {
    fn name(&self) -> String {
        "scripted".into()
    }
    fn on_step(&mut self, obs: &StepObservation, _samples_per_sec: f64) -> Decision {
        match self.plan.get(&obs.step) {
            Some(&t) if t != obs.current && t.dims != obs.current.dims => Decision::ChangeLayout(t),
            Some(&t) if t != obs.current => Decision::ChangeBatch(t),
            _ => Decision::Keep,
        }
    }
    fn on_reconfigured(&mut self, seconds: f64, layout_changed: bool) {
        self.reported.push((seconds, layout_changed));
    }
}
