//! In-memory reconfiguration with rollback. Two paths:
//! - *live* (the ranks are threads of this process or processes of an MPI job, and none has to
//!   be added): the ranks stay up and exchange exactly the slices of weights, AdamW moments and
//!   previous gradient that copus-core's reshard plan names, build the new layout beside the
//!   old one, and verify each piece's checksum at sender and receiver; a failure drops what was
//!   built, so rollback costs nothing (`engine/live.rs`). A smaller world keeps its first ranks
//!   and retires the others once the change commits;
//! - *staged* (a larger world of in-process ranks): the whole training state is staged in host
//!   memory ([`TrainingState`]), the old ranks stop, the new ones start from it and verify
//!   element counts and checksums of every tensor they loaded; a failure restarts the old
//!   configuration from the staged state.
//!
//! Either way nothing is lost; when even the rollback fails, the state goes to an emergency
//! checkpoint. A change of B_g or B_m alone only changes the data split, the accumulation count
//! and the learning rate.
//!
//! It uses the engine's narrow crate API (stage, relaunch, switch live, set the batch), never its
//! fields.

use std::time::Instant;

use copus_core::layout::ParallelDims;

use crate::engine::{Engine, EngineConfig, EngineError, LiveFailure, ReconfigPhase};
use crate::parallel::ParallelLm;
use crate::state::TrainingState;

/// What a reconfiguration did and how long it took.
#[derive(Clone, Debug, PartialEq)]
pub struct ReconfigReport {
    /// Configuration before, `dp2,tp2,pp2 B_g=16 B_m=2`.
    pub from: String,
    /// Configuration after.
    pub to: String,
    /// Whether the layout changed (otherwise only B_g / B_m).
    pub layout_changed: bool,
    /// Whether the ranks stayed up and exchanged only their shards' slices (otherwise the state
    /// was staged on the host and the ranks restarted).
    pub live: bool,
    /// Seconds to send every rank's pieces (live) or to stage the state in host memory.
    pub stage_secs: f64,
    /// Seconds to receive, build the new layout and verify (live), or to stop the old ranks,
    /// start the new ones, load and verify.
    pub rebuild_secs: f64,
    /// Seconds in all.
    pub total_secs: f64,
    /// Bytes copied: the plan's pieces (live) or the staged state.
    pub bytes: u64,
    /// Of them, bytes that went from one rank to another (live); the staged state otherwise.
    pub remote_bytes: u64,
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
        let mut target = EngineConfig { dims, global_batch, micro_batch, ..old.clone() };
        let (ranks, now) = (dims.world_size(), old.dims.world_size());
        if ranks != now {
            let refuse = |reason: String| Err(EngineError::Layout { dims: dims.to_string(), reason });
            if !self.runs_locally() {
                return refuse(format!("has {ranks} ranks; this run's {now} processes are fixed when it starts"));
            }
            if !target.devices.is_empty() {
                if ranks > now {
                    return refuse(format!("has {ranks} ranks; `devices` names devices for {now} only"));
                }
                target.devices.truncate(ranks);
            }
        }
        self.check_target(&target)?;
        let report = |layout_changed: bool, live: bool, stage_secs: f64, bytes: u64, remote_bytes: u64| {
            let total = start.elapsed().as_secs_f64();
            ReconfigReport {
                from: describe(&old),
                to: describe(&target),
                layout_changed,
                live,
                stage_secs,
                rebuild_secs: total - stage_secs,
                total_secs: total,
                bytes,
                remote_bytes,
            }
        };
        if dims == old.dims {
            self.set_batch(global_batch, micro_batch)?;
            return Ok(report(false, false, 0.0, 0, 0));
        }
        let fault = self.take_fault();
        // Live between in-process ranks, when no rank has to be added; a larger world starts
        // its ranks from the staged state.
        if self.can_switch_live() && ranks <= now {
            return match self.switch_live(&target, fault) {
                Ok(s) => {
                    let r = report(true, true, s.send_secs, s.bytes, s.remote_bytes);
                    tracing::debug!(
                        "reconfigured {} -> {} live in {:.3} s ({} bytes moved, {} between ranks)",
                        r.from,
                        r.to,
                        r.total_secs,
                        r.bytes,
                        r.remote_bytes
                    );
                    Ok(r)
                }
                Err(LiveFailure::Refused(e) | LiveFailure::Engine(e)) => Err(e),
                Err(LiveFailure::RolledBack((phase, message))) => {
                    tracing::warn!(
                        "reconfiguration to {} failed at {phase:?} ({message}); rolled back to {}",
                        describe(&target),
                        describe(&old)
                    );
                    Err(EngineError::RolledBack { phase, message, target: describe(&target), restored: describe(&old) })
                }
                Err(LiveFailure::Broken((phase, message))) => {
                    // The ranks still hold the old state but can no longer train together:
                    // stage it (no collective needed) and write it out before giving up.
                    let saved = match self.stage_state() {
                        Ok(state) => self.save_emergency(&state, &old),
                        Err(e) => format!("the state could not be staged for an emergency checkpoint ({e})"),
                    };
                    let msg = format!("reconfiguration failed at {phase:?} ({message}) and the rollback failed too; {saved}");
                    tracing::error!("{msg}");
                    self.mark_dead(&msg);
                    Err(EngineError::Dead(msg))
                }
            };
        }
        let state = self.stage_state()?;
        let stage_secs = start.elapsed().as_secs_f64();
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
                let r = report(true, false, stage_secs, state.bytes(), state.bytes());
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
                    let saved = self.save_emergency(&state, &old);
                    let msg = format!("reconfiguration failed at {phase:?} ({message}) and the rollback failed too ({e}); {saved}");
                    tracing::error!("{msg}");
                    self.mark_dead(&msg);
                    Err(EngineError::Dead(msg))
                }
            },
        }
    }
}

impl<L: ParallelLm> Engine<L> {
    /// Writes `state` (of configuration `cfg`) to the emergency checkpoint; says where, or why
    /// it could not.
    fn save_emergency(&self, state: &TrainingState, cfg: &EngineConfig) -> String {
        let path = self.emergency_path(state.step);
        match state.save(&path, self.specs(), cfg, self.emergency_extra()) {
            Ok(()) => format!("the state is saved to the emergency checkpoint {}", path.display()),
            Err(w) => format!("the emergency checkpoint could not be written either ({w})"),
        }
    }
}
