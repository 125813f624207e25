//! What a comparison records of each policy's run, on either clock: its steps, its switches
//! and its time to target; and how the report writes times and configurations.

use copus_core::candidates::Candidate;
use serde::Serialize;

/// One policy's run on either clock.
#[derive(Clone, Debug, Serialize)]
pub struct PolicyRun {
    /// Name.
    pub name: String,
    /// Whether it is a baseline (Copus and the oracle are not).
    pub baseline: bool,
    /// (time, loss, B_g, layout, throughput, efficiency) per step.
    pub steps: Vec<StepRecord>,
    /// Configuration changes.
    pub switches: Vec<SwitchRecord>,
    /// Seconds to the target, if reached.
    pub time_to_target: Option<f64>,
}

/// One step of a policy run.
#[derive(Clone, Debug, Serialize)]
pub struct StepRecord {
    /// Step.
    pub step: u64,
    /// Clock seconds at the end of the step.
    pub time: f64,
    /// Loss (smoothed training loss in real runs, the model's loss in synthetic ones).
    pub loss: f64,
    /// B_g.
    pub global_batch: usize,
    /// B_m.
    pub micro_batch: usize,
    /// Layout.
    pub layout: String,
    /// Samples/s (predicted for the step's configuration).
    pub throughput: f64,
    /// Statistical efficiency at the noise of the step.
    pub efficiency: f64,
    /// B_simple (true or estimated).
    pub b_simple: Option<f64>,
}

/// One configuration change.
#[derive(Clone, Debug, Serialize)]
pub struct SwitchRecord {
    /// After this step.
    pub step: u64,
    /// Clock seconds when it started.
    pub time: f64,
    /// From.
    pub from: String,
    /// To.
    pub to: String,
    /// Seconds it cost on the run's clock.
    pub cost: f64,
    /// Whether the layout changed.
    pub layout: bool,
}

/// Seconds with four significant digits.
pub(crate) fn secs(t: f64) -> String {
    if t >= 1000.0 { format!("{t:.0}") } else { format!("{t:.*}", (3 - t.abs().max(1e-12).log10().floor() as i64).clamp(0, 9) as usize) }
}

pub(crate) fn describe(c: &Candidate) -> String {
    format!("{} B_g={} B_m={}", c.dims, c.global_batch, c.micro_batch)
}

pub(crate) type Compared = (Vec<PolicyRun>, Option<f64>, String, String, Option<String>);
