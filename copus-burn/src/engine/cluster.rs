//! The running ranks of one layout: a thread per rank, the commands the engine sends them and
//! their replies, start-up with verification against the staged state, and failure handling
//! (the first rank to fail aborts the world, so no rank waits forever on it).

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;
use std::sync::mpsc::{Receiver, Sender, channel};
use std::thread::JoinHandle;

use copus_core::model::ParamSpec;

use super::config::EngineConfig;
use super::error::{EngineError, ReconfigPhase};
use super::fault::Fault;
use super::messages::{Command, Reply};
use super::rank::{RankError, RankInit, RankState, panic_message, rank_init};
use crate::comm::threads::{AbortHandle, ThreadComm};
use crate::comm::{Collective, CommError};
use crate::parallel::ParallelLm;
use crate::state::TrainingState;
use std::time::{Duration, Instant};

/// A rank's failure: `origin` is false when it only saw another rank's abort.
pub(super) struct RankFailure {
    origin: bool,
    message: String,
    /// The rank to blame when it is not the one reporting: the first rank a timed-out wait
    /// was waiting for.
    culprit: Option<usize>,
}

impl RankFailure {
    /// This rank's own failure, the world aborted with its message so the others stop waiting.
    fn origin<C: Collective>(world: &C, message: String, culprit: Option<usize>) -> Self {
        world.abort(&message);
        Self { origin: true, message, culprit }
    }

    /// A hung rank's, found by the engine's wait (no rank reported it).
    fn hung(missing: &[usize], waited_secs: f64) -> Self {
        Self { origin: true, message: format!("no answer within {waited_secs:.1} s from rank(s) {missing:?} (hung)"), culprit: None }
    }
}

/// The rank a failed wait was waiting for, to blame instead of the rank that waited.
fn culprit_of(e: &RankError) -> Option<usize> {
    match e {
        RankError::Comm(CommError::Timeout { missing, .. }) => missing.first().copied(),
        _ => None,
    }
}

struct WorkerHandle {
    commands: Sender<Command>,
    thread: Option<JoinHandle<()>>,
}

type Replies = Receiver<(usize, Result<Reply, RankFailure>)>;

/// How long the other ranks get once one has failed, and how long stopping waits for a rank.
const GRACE: Duration = Duration::from_secs(4);

/// The running ranks of one layout.
pub(super) struct Cluster {
    workers: Vec<WorkerHandle>,
    replies: Replies,
    /// The longest the engine waits for a rank's reply.
    timeout: Duration,
    /// Aborts the in-process world (releases ranks waiting in collectives when stopping).
    abort: Option<AbortHandle>,
    /// The other processes of a multi-process run, seen from process 0.
    #[cfg(feature = "mpi")]
    remote: Option<super::processes::Remote>,
}

impl Drop for Cluster {
    fn drop(&mut self) {
        self.stop();
    }
}

impl Cluster {
    /// Starts the ranks of `cfg` from `state` and verifies what each loaded against it
    /// (element counts and checksums of every parameter and optimizer tensor). On process 0 of
    /// a multi-process run (feature `mpi`), rank 0 starts here and ranks 1.. on the other
    /// processes.
    pub(super) fn launch<L: ParallelLm>(
        model: &Arc<L>,
        specs: &[ParamSpec],
        state: &TrainingState,
        cfg: &EngineConfig,
        fault: Fault,
    ) -> Result<Self, EngineError> {
        let dims = cfg.dims;
        let world = dims.world_size();
        let parallel = model.parallel_plan();
        parallel.check(specs)?;
        let parallel = Arc::new(parallel);
        #[cfg(feature = "mpi")]
        let remote = super::processes::Remote::for_launch(world, &dims.to_string())?;
        #[cfg(feature = "mpi")]
        let local_ranks = if remote.is_some() { 1 } else { world };
        #[cfg(not(feature = "mpi"))]
        let local_ranks = world;
        let (inits, mut expected) = rank_inits(&**model, specs, state, cfg, &parallel, local_ranks, fault)?;
        let (reply_tx, replies) = channel();
        let (ready_tx, ready_rx) = channel();
        let abort: Option<AbortHandle>;
        #[cfg(feature = "mpi")]
        let workers = match &remote {
            Some(remote) => {
                abort = None;
                let describe = model.describe().ok_or_else(|| {
                    EngineError::Dead("this model cannot run across processes: it does not describe itself (`ParallelLm::describe`)".into())
                })?;
                remote.launch(describe, state.to_bytes(specs, cfg, &Default::default())?)?;
                // The serving processes are now starting their ranks and wait for this one in
                // collectives: a failure here cannot be rolled back.
                let device = crate::comm::mpi::on_this_node(cfg.devices.first().copied().unwrap_or_default(), cfg.ranks_per_device);
                let comm = crate::comm::process::ProcessComm::world_for(device, cfg.exact_reductions)
                    .unwrap_or_else(|e| crate::comm::mpi::abort_job(&format!("rank 0: {e}")));
                spawn_ranks(vec![(0, comm)], inits, model, specs, cfg, &reply_tx, &ready_tx)
                    .unwrap_or_else(|e| crate::comm::mpi::abort_job(&e.to_string()))
            }
            None => {
                let comms = ThreadComm::world_with_timeout(world, cfg.timeout());
                abort = comms.first().map(ThreadComm::abort_handle);
                spawn_ranks(comms.into_iter().enumerate().collect(), inits, model, specs, cfg, &reply_tx, &ready_tx)?
            }
        };
        #[cfg(not(feature = "mpi"))]
        let workers = {
            let comms = ThreadComm::world_with_timeout(world, cfg.timeout());
            abort = comms.first().map(ThreadComm::abort_handle);
            spawn_ranks(comms.into_iter().enumerate().collect(), inits, model, specs, cfg, &reply_tx, &ready_tx)?
        };
        drop(ready_tx);
        let timeout = cfg.timeout();
        #[cfg(feature = "mpi")]
        let cluster = Cluster { workers, replies, timeout, abort, remote };
        #[cfg(not(feature = "mpi"))]
        let cluster = Cluster { workers, replies, timeout, abort };
        #[allow(unused_mut)]
        let (mut reported, first_error) = await_ready(&ready_rx, local_ranks, world, cfg);
        #[cfg(feature = "mpi")]
        if let Some(remote) = &cluster.remote {
            for (r, hashes) in remote.ready()? {
                reported[r] = Some(hashes);
            }
        }
        if let Some(e) = first_error {
            return Err(e); // dropping `cluster` stops the ranks that did start
        }
        check_loaded(&mut expected, &reported, world, fault)?;
        Ok(cluster)
    }

    /// Sends every rank a command and collects the replies in rank order. A rank's own failure
    /// is reported in preference to the other ranks' reports of its abort.
    pub(super) fn broadcast(&self, make: impl Fn() -> Command) -> Result<Vec<Reply>, EngineError> {
        #[cfg(feature = "mpi")]
        let remote = match &self.remote {
            Some(remote) => {
                let command = make();
                remote.command(&command)?;
                Some((remote, command))
            }
            None => None,
        };
        for (r, w) in self.workers.iter().enumerate() {
            if w.commands.send(make()).is_err() {
                return Err(EngineError::Dead(format!("rank {r} is gone")));
            }
        }
        let n = self.workers.len();
        let mut out: Vec<Option<Reply>> = (0..n).map(|_| None).collect();
        let mut failure: Option<(usize, RankFailure)> = None;
        let mut answered = vec![false; n];
        // Every reply within twice the timeout (a step is compute plus waits; a rank's own
        // collective timeout fires first and names the missing ranks); once one rank has failed,
        // the others (released by its abort) within a short grace, so a hung rank cannot hold
        // the engine.
        let mut deadline = Instant::now() + 2 * self.timeout;
        for _ in 0..n {
            let reply = match self.replies.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
                Ok(x) => Ok(x),
                Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
                    let missing: Vec<usize> = (0..n).filter(|&r| !answered[r]).collect();
                    if let Some(abort) = &self.abort {
                        abort.abort(&format!("rank(s) {missing:?} did not answer"));
                    }
                    if failure.is_none() {
                        failure = Some((missing[0], RankFailure::hung(&missing, 2.0 * self.timeout.as_secs_f64())));
                    }
                    break;
                }
                Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => Err(()),
            };
            if let Ok((r, _)) = &reply {
                answered[*r] = true;
            }
            match reply {
                Ok((r, Ok(reply))) => out[r] = Some(reply),
                Ok((r, Err(f))) => {
                    let better = match &failure {
                        None => true,
                        Some((_, old)) => f.origin && !old.origin,
                    };
                    if better {
                        failure = Some((f.culprit.unwrap_or(r), f));
                    }
                    deadline = deadline.min(Instant::now() + GRACE.min(self.timeout));
                }
                Err(_) => {
                    failure
                        .get_or_insert((usize::MAX, RankFailure { origin: true, message: "a rank thread vanished".into(), culprit: None }));
                    break;
                }
            }
        }
        if let Some((rank, f)) = failure {
            return Err(EngineError::Rank { rank, message: f.message });
        }
        #[allow(unused_mut)]
        let mut out: Vec<Reply> = out.into_iter().map(|o| o.expect("every rank replied")).collect();
        #[cfg(feature = "mpi")]
        if let Some((remote, command)) = remote {
            out.extend(remote.replies(&command)?);
        }
        Ok(out)
    }

    /// Whether every rank runs in this process (a live layout change needs that).
    pub(super) fn is_local(&self) -> bool {
        #[cfg(feature = "mpi")]
        if self.remote.is_some() {
            return false;
        }
        self.abort.is_some()
    }

    /// Ends the ranks from `size` on, after a committed layout change left them no place (they
    /// return once they have replied to the commit).
    pub(super) fn retire_from(&mut self, size: usize) {
        for mut w in self.workers.drain(size.min(self.workers.len())..) {
            if let Some(t) = w.thread.take() {
                let _ = t.join();
            }
        }
    }

    /// The in-process world's handle (local clusters only).
    pub(super) fn world(&self) -> Option<&AbortHandle> {
        self.abort.as_ref()
    }

    /// Stops every rank and joins its thread. A rank that does not end within a short grace
    /// (hung) is left behind, detached, so stopping never hangs.
    pub(super) fn stop(&mut self) {
        #[cfg(feature = "mpi")]
        if let Some(remote) = self.remote.take() {
            remote.stop();
        }
        for w in &self.workers {
            let _ = w.commands.send(Command::Stop);
        }
        let deadline = Instant::now() + GRACE.min(self.timeout);
        let mut released = false;
        for (r, w) in self.workers.iter_mut().enumerate() {
            let Some(t) = w.thread.take() else { continue };
            while !t.is_finished() && Instant::now() < deadline {
                if !released && Instant::now() + GRACE / 2 > deadline {
                    // Ranks still inside a collective wait for a hung one: release them.
                    if let Some(abort) = &self.abort {
                        abort.abort("the engine is stopping");
                    }
                    released = true;
                }
                std::thread::sleep(Duration::from_millis(5));
            }
            if t.is_finished() {
                let _ = t.join();
            } else {
                tracing::warn!("rank {r} did not stop within {:.1} s; its thread is left behind", GRACE.as_secs_f64());
            }
        }
    }
}

type Ready = Sender<(usize, Result<Vec<(String, u64)>, EngineError>)>;

/// What a rank loaded (or must load): each tensor's name and checksum.
type Hashes = Vec<(String, u64)>;

/// Launch, stage: each rank's start-up state from `state`, kept for the first `local_ranks`
/// ranks (those started here), and what every rank of the world must load.
fn rank_inits<L: ParallelLm>(
    model: &L,
    specs: &[ParamSpec],
    state: &TrainingState,
    cfg: &EngineConfig,
    parallel: &Arc<crate::parallel::ParallelPlan>,
    local_ranks: usize,
    fault: Fault,
) -> Result<(Vec<RankInit>, Vec<Hashes>), EngineError> {
    let world = cfg.dims.world_size();
    let mut inits = Vec::with_capacity(local_ranks);
    let mut expected = Vec::with_capacity(world);
    for r in 0..world {
        // Plant a fault on the last rank only: the others must be released, not hang.
        let fault = if r + 1 == world { fault } else { Fault::none() };
        let (init, hashes) = rank_init(model, specs, state, cfg, parallel, r, fault)?;
        expected.push(hashes);
        if r < local_ranks {
            inits.push(init);
        }
    }
    Ok((inits, expected))
}

/// Launch, wait: the local ranks' start-up reports within `cfg`'s timeout, what each loaded by
/// world rank (of `world`), and the first failure, a rank's own preferred over another rank's
/// report of the abort.
fn await_ready(
    ready_rx: &Receiver<(usize, Result<Hashes, EngineError>)>,
    local_ranks: usize,
    world: usize,
    cfg: &EngineConfig,
) -> (Vec<Option<Hashes>>, Option<EngineError>) {
    let mut first_error: Option<EngineError> = None;
    let mut first_secondary = false;
    let mut reported: Vec<Option<Hashes>> = vec![None; world];
    let deadline = Instant::now() + cfg.timeout();
    for _ in 0..local_ranks {
        match ready_rx.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
            Ok((r, Ok(h))) => reported[r] = Some(h),
            Ok((_, Err(e))) => {
                // Prefer a rank's own failure over another rank's report of the abort.
                let secondary =
                    matches!(&e, EngineError::Rank { message, .. } if message.starts_with("rank ") && message.contains(" failed: "));
                if first_error.is_none() || (first_secondary && !secondary) {
                    first_error = Some(e);
                    first_secondary = secondary;
                }
            }
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
                let missing: Vec<usize> = (0..local_ranks).filter(|&r| reported[r].is_none()).collect();
                first_error.get_or_insert(EngineError::Dead(format!(
                    "rank(s) {missing:?} did not finish starting within {:.1} s",
                    cfg.timeout().as_secs_f64()
                )));
                break;
            }
            Err(_) => {
                first_error.get_or_insert(EngineError::Dead("a rank thread exited while starting".into()));
                break;
            }
        }
    }
    (reported, first_error)
}

/// Launch, verify: what each of the `world` ranks reported it loaded against what it must
/// load (a planted `Verify` fault flips the last rank's first checksum).
fn check_loaded(expected: &mut [Hashes], reported: &[Option<Hashes>], world: usize, fault: Fault) -> Result<(), EngineError> {
    for (r, (want, got)) in expected.iter_mut().zip(reported).enumerate() {
        let mut got = got.clone().unwrap_or_default();
        if r + 1 == world
            && fault.hits(ReconfigPhase::Verify)
            && let Some(first) = got.first_mut()
        {
            first.1 ^= 1;
        }
        got.sort();
        want.sort();
        if &got != want {
            let diff = want.iter().find(|w| !got.contains(w)).map(|w| w.0.clone()).unwrap_or_else(|| "an extra tensor".into());
            return Err(EngineError::Verify(format!("rank {r}: {diff} does not match the staged state")));
        }
    }
    Ok(())
}

/// Starts a thread per local rank `(world rank, its world communicator)`.
fn spawn_ranks<L: ParallelLm, C: Collective + 'static>(
    comms: Vec<(usize, C)>,
    inits: Vec<RankInit>,
    model: &Arc<L>,
    specs: &[ParamSpec],
    cfg: &EngineConfig,
    reply_tx: &Sender<(usize, Result<Reply, RankFailure>)>,
    ready_tx: &Ready,
) -> Result<Vec<WorkerHandle>, EngineError> {
    let mut workers = Vec::with_capacity(comms.len());
    for ((r, comm), init) in comms.into_iter().zip(inits) {
        let (tx, rx) = channel::<Command>();
        let model = model.clone();
        let cfg = cfg.clone();
        let specs = specs.to_vec();
        let reply_tx = reply_tx.clone();
        let ready_tx = ready_tx.clone();
        let thread = std::thread::Builder::new()
            .name(format!("copus-rank-{r}"))
            .spawn(move || {
                let aborter = comm.aborter();
                let built = catch_unwind(AssertUnwindSafe(|| RankState::<L, C>::start(r, comm, init, &*model, specs, cfg)));
                let state = match built {
                    Ok(Ok((s, hashes))) => {
                        let _ = ready_tx.send((r, Ok(hashes)));
                        s
                    }
                    Ok(Err(e)) => {
                        aborter(&e.to_string());
                        let _ = ready_tx.send((r, Err(e)));
                        return;
                    }
                    Err(p) => {
                        let message = panic_message(&p);
                        aborter(&message);
                        let _ = ready_tx.send((r, Err(EngineError::Rank { rank: r, message })));
                        return;
                    }
                };
                worker_loop(state, &*model, rx, reply_tx);
            })
            .map_err(|e| EngineError::Rank { rank: r, message: format!("could not start its thread: {e}") })?;
        workers.push(WorkerHandle { commands: tx, thread: Some(thread) });
    }
    Ok(workers)
}

fn worker_loop<L: ParallelLm, C: Collective>(
    mut state: RankState<L, C>,
    model: &L,
    rx: Receiver<Command>,
    tx: Sender<(usize, Result<Reply, RankFailure>)>,
) {
    let r = state.rank;
    // The state a live layout change built, until the driver commits or aborts it: `Some(None)`
    // when the new layout has no place for this rank, which then retires on commit.
    let mut pending: Option<Option<RankState<L, C>>> = None;
    while let Ok(cmd) = rx.recv() {
        let mut retire = false;
        let result = match cmd {
            // A live layout change reports its failures as replies: the old state trains on.
            Command::LiveSend(job) => {
                let sent = catch_unwind(AssertUnwindSafe(|| state.live_send(&job))).unwrap_or_else(|p| Err(panic_message(&p)));
                Ok(Ok(Reply::Sent(sent)))
            }
            Command::LiveBuild(job, agreed) => {
                let built = catch_unwind(AssertUnwindSafe(|| state.live_build(&job, &agreed, model)))
                    .unwrap_or_else(|p| Err((ReconfigPhase::Load, panic_message(&p))));
                pending = None;
                let reply = built.map(|(next, received)| {
                    pending = Some(next);
                    received
                });
                Ok(Ok(Reply::Built(reply)))
            }
            Command::LiveCommit => match pending.take() {
                Some(Some(next)) => {
                    state = next;
                    Ok(Ok(Reply::Done))
                }
                Some(None) => {
                    retire = true;
                    Ok(Ok(Reply::Done))
                }
                None => Ok(Err(RankError::Train(crate::trainer::TrainError::Batch("no layout change to commit".into())))),
            },
            Command::LiveAbort => {
                pending = None;
                Ok(Ok(Reply::Done))
            }
            Command::Stop => return,
            Command::Step(_, fault) if fault.stalls(r) => loop {
                // A hung rank: it never replies and never returns.
                std::thread::sleep(std::time::Duration::from_secs(3600));
            },
            Command::Step(batch, fault) => catch_unwind(AssertUnwindSafe(|| state.step(&batch, fault).map(|s| Reply::Step(Box::new(s))))),
            Command::Evaluate(windows, micro) => catch_unwind(AssertUnwindSafe(|| state.evaluate(&windows, micro).map(Reply::Evaluated))),
            Command::Params => catch_unwind(AssertUnwindSafe(|| Ok(Reply::Params(state.params())))),
            Command::Export => catch_unwind(AssertUnwindSafe(|| state.export().map(|e| Reply::Export(Box::new(e))))),
            Command::SetBatch { global_batch, micro_batch } => {
                state.set_batch(global_batch, micro_batch);
                Ok(Ok(Reply::Done))
            }
        };
        let out = match result {
            Ok(Ok(reply)) => Ok(reply),
            Ok(Err(RankError::Comm(CommError::Aborted { rank, message }))) if rank != r => {
                Err(RankFailure { origin: false, message: format!("rank {rank} failed: {message}"), culprit: None })
            }
            Ok(Err(e)) => Err(RankFailure::origin(&state.world, e.to_string(), culprit_of(&e))),
            Err(p) => Err(RankFailure::origin(&state.world, panic_message(&p), None)),
        };
        let failed = out.is_err();
        if tx.send((r, out)).is_err() || failed || retire {
            // After a failure the world is aborted; this rank can do nothing more.
            return;
        }
    }
}
