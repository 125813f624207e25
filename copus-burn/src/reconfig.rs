//! In-memory reconfiguration with rollback. Two paths:
//! - *live* (the ranks are threads of this process or processes of an MPI job, and none has to
//!   be added): the ranks stay up and exchange exactly the slices of weights, AdamW moments and
//!   previous gradient that copus-core's reshard plan names, build the new layout beside the
//!   old one, and verify each piece's checksum at sender and receiver; a failure drops what was
//!   built, so rollback costs nothing (the driver side below, the rank side in
//!   `engine/live.rs`). A smaller world keeps its first ranks
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
//! It uses the engine's narrow crate API (stage, relaunch, broadcast a command to the ranks,
//! adopt a committed live change, set the batch) and its messages, never its fields.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use burn_pack::Scalar;
use copus_core::layout::ParallelDims;
use copus_core::reshard::{Placer, ReshardPlan};

use crate::engine::messages::{Agreed, Command, Handoff, LiveJob, PhaseError, Received, Reply, Sent, TAG_BASE, tag};
use crate::engine::{Engine, EngineConfig, EngineError, Fault, ReconfigPhase};
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
        let target = self.reconfig_target(&old, dims, global_batch, micro_batch)?;
        let change = Change { start, old, target };
        if dims == change.old.dims {
            self.set_batch(global_batch, micro_batch)?;
            return Ok(change.report(false, false, 0.0, 0, 0));
        }
        let fault = self.take_fault();
        // Live between in-process ranks, when no rank has to be added; a larger world starts
        // its ranks from the staged state.
        // A live change needs the ranks up, as threads of this process or an MPI job's processes.
        if !self.is_dead() && dims.world_size() <= change.old.dims.world_size() {
            return self.reconfigure_live(&change, fault);
        }
        self.reconfigure_staged(&change, fault)
    }

    /// Reconfigure, check: the configuration to switch to, `old` with `dims` and the batch sizes
    /// (its device list cut to a smaller world); refused where this run cannot change its number
    /// of ranks or the engine does not accept it.
    fn reconfig_target(
        &self,
        old: &EngineConfig,
        dims: ParallelDims,
        global_batch: usize,
        micro_batch: usize,
    ) -> Result<EngineConfig, EngineError> {
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
        Ok(target)
    }

    /// Reconfigure, live: switches with the ranks up; on a failure, reports the rollback, or where
    /// even that failed, writes the old state to the emergency checkpoint and marks the engine
    /// dead.
    fn reconfigure_live(&mut self, change: &Change, fault: Fault) -> Result<ReconfigReport, EngineError> {
        let (old, target) = (&change.old, &change.target);
        match self.switch_live(target, fault) {
            Ok(s) => {
                let r = change.report(true, true, s.send_secs, s.bytes, s.remote_bytes);
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
                tracing::warn!("reconfiguration to {} failed at {phase:?} ({message}); rolled back to {}", describe(target), describe(old));
                Err(EngineError::RolledBack { phase, message, target: describe(target), restored: describe(old) })
            }
            Err(LiveFailure::Broken((phase, message))) => {
                // The ranks still hold the old state but can no longer train together:
                // stage it (no collective needed) and write it out before giving up.
                let saved = match self.stage_state() {
                    Ok(state) => self.save_emergency(&state, old),
                    Err(e) => format!("the state could not be staged for an emergency checkpoint ({e})"),
                };
                let msg = format!("reconfiguration failed at {phase:?} ({message}) and the rollback failed too; {saved}");
                tracing::error!("{msg}");
                self.mark_dead(&msg);
                Err(EngineError::Dead(msg))
            }
        }
    }

    /// Reconfigure, staged: stages the state in host memory and restarts the ranks in the
    /// target configuration from it; on a failure restarts the old one, or where even that
    /// failed, writes the staged state to the emergency checkpoint and marks the engine dead.
    fn reconfigure_staged(&mut self, change: &Change, fault: Fault) -> Result<ReconfigReport, EngineError> {
        let (old, target) = (&change.old, &change.target);
        let state = self.stage_state()?;
        let stage_secs = change.start.elapsed().as_secs_f64();
        let attempt = if fault.hits(ReconfigPhase::AfterStaging) {
            self.stop_ranks();
            Err((ReconfigPhase::AfterStaging, "injected failure after staging".to_string()))
        } else {
            self.relaunch(&state, target, fault).map_err(|e| {
                let phase = fault.phase().unwrap_or(match e {
                    EngineError::Verify(_) => ReconfigPhase::Verify,
                    _ => ReconfigPhase::Load,
                });
                (phase, e.to_string())
            })
        };
        match attempt {
            Ok(()) => {
                let r = change.report(true, false, stage_secs, state.bytes(), state.bytes());
                tracing::debug!("reconfigured {} -> {} in {:.3} s ({} bytes staged)", r.from, r.to, r.total_secs, r.bytes);
                Ok(r)
            }
            Err((phase, message)) => match self.relaunch(&state, old, fault.for_rollback()) {
                Ok(()) => {
                    tracing::warn!(
                        "reconfiguration to {} failed at {phase:?} ({message}); rolled back to {}",
                        describe(target),
                        describe(old)
                    );
                    Err(EngineError::RolledBack { phase, message, target: describe(target), restored: describe(old) })
                }
                Err(e) => {
                    // The staged state is now the only intact copy: write it out before giving up.
                    let saved = self.save_emergency(&state, old);
                    let msg = format!("reconfiguration failed at {phase:?} ({message}) and the rollback failed too ({e}); {saved}");
                    tracing::error!("{msg}");
                    self.mark_dead(&msg);
                    Err(EngineError::Dead(msg))
                }
            },
        }
    }
}

/// A reconfiguration under way: when it started, and the configurations it goes from and to.
struct Change {
    start: Instant,
    old: EngineConfig,
    target: EngineConfig,
}

impl Change {
    /// The report of the change, ending now.
    fn report(&self, layout_changed: bool, live: bool, stage_secs: f64, bytes: u64, remote_bytes: u64) -> ReconfigReport {
        let total = self.start.elapsed().as_secs_f64();
        ReconfigReport {
            from: describe(&self.old),
            to: describe(&self.target),
            layout_changed,
            live,
            stage_secs,
            rebuild_secs: total - stage_secs,
            total_secs: total,
            bytes,
            remote_bytes,
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

// The driver side of a live layout change: the three commands to the ranks, the agreement
// on what moves, and the check of every piece (the rank side is `engine/live.rs`).

/// The step counts of every parameter, from the ranks' step-1 replies, and the pieces per move
/// they agree on.
fn agree(sent: &[Sent]) -> Result<Agreed, String> {
    let first = sent.first().ok_or("no ranks")?;
    if let Some((r, s)) = sent.iter().enumerate().find(|(_, s)| s.fields != first.fields || s.has_previous != first.has_previous) {
        return Err(format!(
            "rank {r} keeps optimizer fields {:?} (previous gradient: {}), rank 0 {:?} ({})",
            s.fields, s.has_previous, first.fields, first.has_previous
        ));
    }
    let mut scalars: HashMap<String, Vec<(String, Scalar)>> = HashMap::new();
    for s in sent {
        for (name, field, v) in &s.scalars {
            let entry = scalars.entry(name.clone()).or_default();
            match entry.iter().find(|(f, _)| f == field) {
                Some((_, w)) if w != v => return Err(format!("ranks disagree on the optimizer's `{field}` of `{name}`")),
                Some(_) => {}
                None => entry.push((field.clone(), *v)),
            }
        }
    }
    Ok(Agreed { fields: first.fields.clone(), has_previous: first.has_previous, scalars })
}

/// Checks that every piece of every move of the plan was sent once and received once, with the
/// same checksum at its source and where it landed; returns the elements moved.
fn check_pieces(moves: usize, kinds: usize, sent: &[Sent], received: &[Received]) -> Result<u64, String> {
    // Per piece: whether it was sent, its checksum at the source, and where it landed.
    #[derive(Default)]
    struct Seen {
        sent: bool,
        source: Option<u64>,
        landed: Option<u64>,
    }
    let mut sums: HashMap<u32, Seen> = HashMap::new();
    let piece = |t: u32| t - TAG_BASE;
    for (r, s) in sent.iter().enumerate() {
        for &(t, sum) in &s.sums {
            let e = sums.entry(t).or_default();
            if std::mem::replace(&mut e.sent, true) {
                return Err(format!("piece {} was sent twice (again by rank {r})", piece(t)));
            }
            e.source = sum;
        }
    }
    for (r, s) in received.iter().enumerate() {
        for &(t, sum) in &s.sums {
            let e = sums.entry(t).or_default();
            if e.landed.replace(sum).is_some() {
                return Err(format!("piece {} was received twice (again by rank {r})", piece(t)));
            }
        }
        // Source sums of pieces handed over: only for pieces sent without one, and only once.
        for &(t, sum) in &s.sources {
            match sums.get_mut(&t) {
                Some(e) if e.sent && e.source.is_none() => e.source = Some(sum),
                _ => {
                    return Err(format!(
                        "rank {r} gave a source sum of piece {}, which its sender summed or which was summed already",
                        piece(t)
                    ));
                }
            }
        }
    }
    for i in 0..moves {
        for kind in 0..kinds {
            match sums.get(&tag(i, kind, kinds)) {
                Some(Seen { sent: true, source: Some(a), landed: Some(b) }) if a == b => {}
                Some(Seen { sent: true, source: Some(_), landed: Some(_) }) => {
                    return Err(format!("move {i}, piece {kind}: the checksums at its source and where it landed differ"));
                }
                Some(Seen { sent: true, source: None, landed: Some(_) }) => {
                    return Err(format!("move {i}, piece {kind} was handed over but its source was never summed"));
                }
                _ => return Err(format!("move {i}, piece {kind} was not both sent and received")),
            }
        }
    }
    if sums.len() != moves * kinds {
        return Err(format!("{} pieces moved; the plan has {}", sums.len(), moves * kinds));
    }
    let out: u64 = sent.iter().map(|s| s.elements).sum();
    let back: u64 = received.iter().map(|s| s.elements).sum();
    if out != back {
        return Err(format!("{out} elements sent, {back} received"));
    }
    Ok(out)
}

/// What a live layout change did.
pub(crate) struct LiveSwitch {
    /// Seconds until every rank had sent its pieces.
    pub(crate) send_secs: f64,
    /// Bytes copied (weights, moments and previous gradient), within and between ranks.
    pub(crate) bytes: u64,
    /// Of them, bytes that went from one rank to another.
    pub(crate) remote_bytes: u64,
}

/// Why a live layout change did not happen.
pub(crate) enum LiveFailure {
    /// Refused before any rank was touched.
    Refused(EngineError),
    /// Failed at a phase; every rank dropped what it built and runs the old layout, untouched.
    RolledBack(PhaseError),
    /// Failed at a phase and the old layout cannot go on (its world was aborted, or a planted
    /// fault struck the rollback); every rank still holds its old state.
    Broken(PhaseError),
    /// A rank thread failed outright: the engine is dead.
    Engine(EngineError),
}

impl<L: ParallelLm> Engine<L> {
    /// Switches the running ranks to `target` (the same or a smaller world: the first ranks
    /// stay) by executing the reshard plan between them; see the module documentation.
    pub(crate) fn switch_live(&mut self, target: &EngineConfig, fault: Fault) -> Result<LiveSwitch, LiveFailure> {
        let num_layers = self.model().spec().num_layers;
        let plan = ReshardPlan::new(self.specs(), Placer { num_layers }, self.config().dims, target.dims)
            .map_err(|e| LiveFailure::Refused(EngineError::Layout { dims: target.dims.to_string(), reason: e.to_string() }))?;
        let remote = plan.remote_elements(self.specs());
        let job = Arc::new(LiveJob {
            plan,
            cfg: target.clone(),
            specs: Arc::new(self.specs().to_vec()),
            num_layers,
            fault,
            // The last rank that builds: a fault planted there is seen whatever the world size.
            fault_rank: self.config().dims.world_size().min(target.dims.world_size()) - 1,
            handoff: self.runs_locally().then(Handoff::default),
        });
        let start = Instant::now();
        let outcome = self.live_steps(&job, start);
        // No piece of this change may stay queued, whatever happened.
        if let Some(world) = self.rank_world() {
            let left = world.discard_messages(TAG_BASE) + job.handoff.as_ref().map_or(0, Handoff::clear);
            if left > 0 && outcome.is_ok() {
                tracing::warn!("{left} reshard piece(s) were sent but never received");
            }
        }
        match outcome {
            Ok((send_secs, elements, kinds)) => {
                self.broadcast(|| Command::LiveCommit).map_err(LiveFailure::Engine)?;
                self.adopt_live(target);
                Ok(LiveSwitch { send_secs, bytes: 4 * elements, remote_bytes: 4 * remote * kinds as u64 })
            }
            Err(LiveFailure::RolledBack(failure)) => {
                self.broadcast(|| Command::LiveAbort).map_err(LiveFailure::Engine)?;
                let aborted = self.rank_world().is_some_and(|w| w.is_aborted());
                if aborted {
                    Err(LiveFailure::Broken((failure.0, format!("{}; the ranks' world was aborted", failure.1))))
                } else if fault.for_rollback().phase().is_some() {
                    Err(LiveFailure::Broken((failure.0, format!("{}; injected failure of the rollback", failure.1))))
                } else {
                    Err(LiveFailure::RolledBack(failure))
                }
            }
            Err(other) => Err(other),
        }
    }

    /// Steps 1 and 2 and the check of every piece: (seconds to send, elements moved, pieces per
    /// move).
    fn live_steps(&mut self, job: &Arc<LiveJob>, start: Instant) -> Result<(f64, u64, usize), LiveFailure> {
        let failed = |phase: ReconfigPhase, m: String| LiveFailure::RolledBack((phase, m));
        // Before the build, sent pieces are still in flight. Between threads they are discarded;
        // between processes they cannot be recalled, so the processes cannot train on together.
        let local = self.runs_locally();
        let unsent = move |phase: ReconfigPhase, m: String| {
            if local { LiveFailure::RolledBack((phase, m)) } else { LiveFailure::Broken((phase, m)) }
        };
        let replies = self.broadcast(|| Command::LiveSend(job.clone())).map_err(LiveFailure::Engine)?;
        let mut sent = Vec::with_capacity(replies.len());
        for (r, reply) in replies.into_iter().enumerate() {
            match reply {
                Reply::Sent(Ok(s)) => sent.push(s),
                Reply::Sent(Err(e)) => return Err(unsent(ReconfigPhase::AfterStaging, format!("rank {r}: {e}"))),
                _ => unreachable!("send reply"),
            }
        }
        let send_secs = start.elapsed().as_secs_f64();
        if job.fault.hits(ReconfigPhase::AfterStaging) {
            return Err(unsent(ReconfigPhase::AfterStaging, "injected failure after sending".into()));
        }
        let agreed = agree(&sent).map_err(|e| unsent(ReconfigPhase::AfterStaging, e))?;
        let kinds = agreed.kinds();
        let agreed = Arc::new(agreed);
        let replies = self.broadcast(|| Command::LiveBuild(job.clone(), agreed.clone())).map_err(LiveFailure::Engine)?;
        let mut received = Vec::with_capacity(replies.len());
        let mut first: Option<PhaseError> = None;
        for (r, reply) in replies.into_iter().enumerate() {
            match reply {
                Reply::Built(Ok(x)) => received.push(x),
                // Prefer a rank's own failure over another rank's report of the abort it caused.
                Reply::Built(Err((phase, e))) => {
                    let echo = |m: &str| m.starts_with("rank ") && m.contains(" failed: ");
                    if first.as_ref().is_none_or(|f| echo(&f.1) && !echo(&e)) {
                        first = Some((phase, format!("rank {r}: {e}")));
                    }
                }
                _ => unreachable!("build reply"),
            }
        }
        if let Some((phase, e)) = first {
            // A rank fails verification only once it has received every piece sent to it; an
            // earlier failure may leave pieces in flight, which processes cannot recall.
            return Err(if phase == ReconfigPhase::Verify { failed(phase, e) } else { unsent(phase, e) });
        }
        let elements = check_pieces(job.plan.moves.len(), kinds, &sent, &received).map_err(|e| failed(ReconfigPhase::Verify, e))?;
        Ok((send_secs, elements, kinds))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pieces_sent_twice_missing_or_changed_are_caught() {
        let sent = |sums: Vec<(u32, Option<u64>)>| Sent {
            elements: 4 * sums.len() as u64,
            sums,
            scalars: vec![],
            fields: vec![],
            has_previous: false,
        };
        let got = |sums: Vec<(u32, u64)>| Received { elements: 4 * sums.len() as u64, sums, sources: vec![] };
        // A piece handed over: sent unsummed, its source summed by the receiver.
        let handed = |landed: u64, source: Vec<(u32, u64)>| Received { elements: 4, sums: vec![(tag(1, 0, 1), landed)], sources: source };
        let (a, b) = (tag(0, 0, 1), tag(1, 0, 1));
        assert_eq!(check_pieces(2, 1, &[sent(vec![(a, Some(7))]), sent(vec![(b, Some(9))])], &[got(vec![(b, 9), (a, 7)])]), Ok(8));
        let err = |sent: &[Sent], got: &[Received]| check_pieces(2, 1, sent, got).unwrap_err();
        assert!(err(&[sent(vec![(a, Some(7)), (b, Some(9))])], &[got(vec![(a, 7), (b, 8)])]).contains("differ"));
        assert!(err(&[sent(vec![(a, Some(7))])], &[got(vec![(a, 7)])]).contains("move 1"));
        assert!(
            check_pieces(1, 1, &[sent(vec![(a, Some(7))]), sent(vec![(a, Some(7))])], &[got(vec![(a, 7)])]).unwrap_err().contains("twice")
        );

        let mixed = [sent(vec![(a, Some(7)), (b, None)])];
        assert_eq!(check_pieces(2, 1, &mixed, &[got(vec![(a, 7)]), handed(9, vec![(b, 9)])]), Ok(8));
        // The landed sum differs from the source's; the source was never summed; a source summed
        // for a piece its sender summed, or twice.
        assert!(err(&mixed, &[got(vec![(a, 7)]), handed(8, vec![(b, 9)])]).contains("differ"));
        assert!(err(&mixed, &[got(vec![(a, 7)]), handed(9, vec![])]).contains("never summed"));
        assert!(err(&[sent(vec![(a, Some(7)), (b, Some(9))])], &[got(vec![(a, 7)]), handed(9, vec![(b, 9)])]).contains("source sum"));
        assert!(err(&mixed, &[got(vec![(a, 7)]), handed(9, vec![(b, 9), (b, 9)])]).contains("source sum"));
    }
}
