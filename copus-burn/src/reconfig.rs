//! In-memory reconfiguration with rollback. A layout change stages the whole training state in
//! host memory ([`TrainingState`]), stops the old ranks (dropping their process groups), starts
//! the new ones from the staged state and verifies element counts and checksums of every
//! parameter and optimizer tensor each rank loaded. Any failure after staging restarts the old
//! configuration from the staged state, so nothing is lost. A change of B_g or B_m alone only
//! changes the data split, the accumulation count and the learning rate.
//!
//! It uses the engine's narrow crate API (stage, relaunch, set the batch), never its fields.

use std::time::Instant;

use copus_core::layout::ParallelDims;

use crate::engine::{Engine, EngineConfig, EngineError, ReconfigPhase};
use crate::parallel::ParallelLm;

/// What a reconfiguration did and how long it took.
#[derive(Clone, Debug, PartialEq)]
pub struct ReconfigReport {
    /// Configuration before, `dp2,tp2,pp2 B_g=16 B_m=2`.
    pub from: String,
    /// Configuration after.
    pub to: String,
    /// Whether the layout changed (otherwise only B_g / B_m).
    pub layout_changed: bool,
    /// Seconds to stage the state in host memory.
    pub stage_secs: f64,
    /// Seconds to stop the old ranks, start the new ones, load and verify.
    pub rebuild_secs: f64,
    /// Seconds in all.
    pub total_secs: f64,
    /// Bytes staged.
    pub bytes: u64,
}

fn describe(cfg: &EngineConfig) -> String {
    format!("{} B_g={} B_m={}", cfg.dims, cfg.global_batch, cfg.micro_batch)
}

impl<L: ParallelLm> Engine<L> {
    /// Switches to layout `dims` with `global_batch` and `micro_batch` between steps, keeping
    /// weights, optimizer state, counters and the estimator. Invalid targets are refused with
    /// the engine untouched; a failure after staging rolls back to the old configuration.
    pub fn reconfigure(&mut self, dims: ParallelDims, global_batch: usize, micro_batch: usize) -> Result<ReconfigReport, EngineError> {
        let start = Instant::now();
        let old = self.config().clone();
        let target = EngineConfig { dims, global_batch, micro_batch, ..old.clone() };
        self.check_target(&target)?;
        if dims.world_size() != old.dims.world_size() {
            return Err(EngineError::Layout {
                dims: dims.to_string(),
                reason: format!("has {} ranks; this engine runs {}", dims.world_size(), old.dims.world_size()),
            });
        }
        let report = |layout_changed: bool, stage_secs: f64, bytes: u64| {
            let total = start.elapsed().as_secs_f64();
            ReconfigReport {
                from: describe(&old),
                to: describe(&target),
                layout_changed,
                stage_secs,
                rebuild_secs: total - stage_secs,
                total_secs: total,
                bytes,
            }
        };
        if dims == old.dims {
            self.set_batch(global_batch, micro_batch)?;
            return Ok(report(false, 0.0, 0));
        }
        let state = self.stage_state()?;
        let stage_secs = start.elapsed().as_secs_f64();
        let fault = self.take_fault();
        let attempt = if fault.hits(ReconfigPhase::AfterStaging) {
            self.stop_ranks();
            Err((ReconfigPhase::AfterStaging, "injected failure after staging".to_string()))
        } else {
            self.relaunch(&state, &target, fault).map_err(|e| {
                let phase = fault.phase().unwrap_or(match e {
                    EngineError::Verify(_) => ReconfigPhase::Verify,
                    _ => ReconfigPhase::Load,
                });
                (phase, e.to_string())
            })
        };
        match attempt {
            Ok(()) => {
                let r = report(true, stage_secs, state.bytes());
                tracing::debug!("reconfigured {} -> {} in {:.3} s ({} bytes staged)", r.from, r.to, r.total_secs, r.bytes);
                Ok(r)
            }
            Err((phase, message)) => match self.relaunch(&state, &old, fault.for_rollback()) {
                Ok(()) => {
                    tracing::warn!(
                        "reconfiguration to {} failed at {phase:?} ({message}); rolled back to {}",
                        describe(&target),
                        describe(&old)
                    );
                    Err(EngineError::RolledBack { phase, message, target: describe(&target), restored: describe(&old) })
                }
                Err(e) => {
                    // The staged state is now the only intact copy: write it out before giving up.
                    let path = self.emergency_path(state.step);
                    let saved = match state.save(&path, self.specs(), &old, &Default::default()) {
                        Ok(()) => format!("the state is saved to the emergency checkpoint {}", path.display()),
                        Err(w) => format!("the emergency checkpoint could not be written either ({w})"),
                    };
                    let msg = format!("reconfiguration failed at {phase:?} ({message}) and the rollback failed too ({e}); {saved}");
                    tracing::error!("{msg}");
                    self.mark_dead(&msg);
                    Err(EngineError::Dead(msg))
                }
            },
        }
    }
}
