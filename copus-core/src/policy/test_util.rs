//! Test helpers shared by the policy files: a toy two-layout scorer and observations.

use super::copus::SwitchRule;
use super::interface::StepObservation;
use super::scorer::Scorer;
use crate::candidates::Candidate;
use crate::gns::NoiseEstimate;
use crate::layout::ParallelDims;
use crate::throughput::{ProfileEntry, ThroughputProfile};

/// The default rule without a dwell time, confirmation or exploration (these tests judge
/// single decisions).
pub(super) fn no_dwell() -> SwitchRule {
    SwitchRule { min_dwell_steps: 1, confirm_steps: 1, explore: 0.0, ..SwitchRule::default() }
}

/// Shorthand for a layout.
pub(super) fn d(dp: usize, tp: usize, pp: usize) -> ParallelDims {
    ParallelDims { dp, tp, pp }
}

/// A precise estimate of B_simple `phi` (|G|^2 = 1, no standard errors) at step 10.
pub(super) fn obs(current: Candidate, phi: f64) -> StepObservation {
    StepObservation {
        step: 10,
        current,
        noise: Some(NoiseEstimate { grad_sq: 1.0, trace: phi, biased: false, grad_sq_se: 0.0, trace_se: 0.0 }),
        remaining_secs: None,
    }
}

/// Two layouts on 4 ranks, B_m = 1: tp2 is faster at small B_g, dp4 at large B_g.
/// Step time dp4 = 0.5 + 0.1 * B_g / 4; tp2 (dp2) = 0.1 + 0.1 * B_g / 2 * 0.8.
pub(super) fn toy() -> (Scorer, ThroughputProfile) {
    let mut rows = Vec::new();
    for b in [4usize, 8, 16, 32, 64, 128] {
        let t_dp = 0.5 + 0.1 * b as f64 / 4.0;
        let t_tp = 0.1 + 0.08 * b as f64 / 2.0;
        rows.push(ProfileEntry { dp: 4, tp: 1, pp: 1, global_batch: b, micro_batch: 1, samples_per_sec: b as f64 / t_dp });
        rows.push(ProfileEntry { dp: 2, tp: 2, pp: 1, global_batch: b, micro_batch: 1, samples_per_sec: b as f64 / t_tp });
    }
    let p = ThroughputProfile::new("toy".into(), "toy".into(), rows).unwrap();
    let cands: Vec<Candidate> = [d(4, 1, 1), d(2, 2, 1)]
        .iter()
        .flat_map(|&dims| [4usize, 8, 16, 32, 64, 128].map(|b| Candidate::new(dims, b, 1).unwrap()))
        .collect();
    (Scorer::plain(&cands, &p, 4.0).unwrap(), p)
}
