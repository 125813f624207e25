//! The engine across processes (feature `mpi`): process 0's view of the serving processes
//! ([`Remote`]), and what a serving process runs ([`serve`]).
//!
//! Process 0 broadcasts each engine command on the control communicator; every serving
//! process carries it out on its rank and, for the commands that return data (parameters,
//! exports, start-up checksums, reshard pieces' checksums), answers process 0. Starting a
//! layout sends the whole staged training state in the checkpoint format; each process cuts its
//! own shards from it. A layout change between running ranks sends only the reshard plan: the
//! processes then exchange the plan's slices among themselves (`engine/live.rs`).

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;

use super::error::{EngineError, ReconfigPhase};
use super::fault::Fault;
use super::messages::{
    Agreed, Command, EngineStep, Header, LiveJob, LiveOrder, PhaseError, RankParams, Received, Reply, Sent, decode, encode,
};
use super::rank::{RankState, panic_message, rank_init};
use crate::comm::mpi::{self, Role};
use crate::comm::process::ProcessComm;
use crate::parallel::ParallelLm;
use crate::state::{RankExport, TrainingState};

fn comm_err(message: String) -> EngineError {
    EngineError::Dead(format!("MPI control channel: {message}"))
}

/// Process 0's handle on the serving processes of the running layout.
pub(super) struct Remote {
    size: usize,
}

impl Remote {
    /// `Some` on process 0 of a multi-process run whose size matches the layout's `world`.
    pub(super) fn for_launch(world: usize, dims: &str) -> Result<Option<Self>, EngineError> {
        match mpi::role() {
            Role::Single => Ok(None),
            Role::Driver { size } if size == world => Ok(Some(Self { size })),
            Role::Driver { size } => Err(EngineError::Layout {
                dims: dims.to_string(),
                reason: format!(
                    "the layout has {world} ranks but the MPI job has {size} processes; start it with `mpirun -np {world}` or use a layout of {size} ranks"
                ),
            }),
            Role::Worker { rank, .. } => Err(EngineError::Dead(format!("process {rank} serves ranks; only process 0 starts engines"))),
        }
    }

    fn send(&self, header: &Header, payload: &[u8]) -> Result<(), EngineError> {
        mpi::control_broadcast(Some(encode(header, payload))).map(drop).map_err(comm_err)
    }

    /// Every serving process starts its rank of the state's configuration.
    pub(super) fn launch(&self, model: String, state: Vec<u8>) -> Result<(), EngineError> {
        self.send(&Header::Launch { model }, &state)
    }

    /// The serving processes' start-up checksums, in rank order.
    pub(super) fn ready(&self) -> Result<Vec<(usize, Checksums)>, EngineError> {
        // Every answer is read before any is judged, so none is left queued for a later read.
        let answers: Vec<(usize, Vec<u8>)> =
            (1..self.size).map(|r| mpi::control_receive(r).map(|b| (r, b)).map_err(comm_err)).collect::<Result<_, _>>()?;
        Ok(answers
            .into_iter()
            .map(|(r, bytes)| match serde_json::from_slice(&bytes) {
                Ok(ready) => (r, ready),
                Err(e) => mpi::abort_job(&format!("process {r}'s start-up answer does not parse: {e}")),
            })
            .collect())
    }

    /// Sends an engine command to the serving processes.
    pub(super) fn command(&self, command: &Command) -> Result<(), EngineError> {
        match command {
            Command::Step(batch, fault) => {
                let bytes: Vec<u8> = batch.iter().flat_map(|t| t.to_le_bytes()).collect();
                self.send(&Header::Step { fault: *fault }, &bytes)
            }
            Command::Evaluate(windows, micro) => {
                let bytes: Vec<u8> = windows.iter().flat_map(|t| t.to_le_bytes()).collect();
                self.send(&Header::Evaluate { micro: *micro }, &bytes)
            }
            Command::Params => self.send(&Header::Params, &[]),
            Command::Export => self.send(&Header::Export, &[]),
            Command::SetBatch { global_batch, micro_batch } => {
                self.send(&Header::SetBatch { global_batch: *global_batch, micro_batch: *micro_batch }, &[])
            }
            Command::Stop => self.send(&Header::Stop, &[]),
            Command::LiveSend(job) => {
                let order = LiveOrder { plan: job.plan.clone(), cfg: job.cfg.clone(), num_layers: job.num_layers };
                self.send(&Header::LiveSend, &serde_json::to_vec(&order).expect("plans serialise"))
            }
            Command::LiveBuild(_, agreed) => self.send(&Header::LiveBuild, &serde_json::to_vec(&**agreed).expect("agreements serialise")),
            Command::LiveCommit => self.send(&Header::LiveCommit, &[]),
            Command::LiveAbort => self.send(&Header::LiveAbort, &[]),
        }
    }

    /// The serving ranks' replies to `command`, in rank order (placeholders where the engine
    /// reads only rank 0's reply).
    pub(super) fn replies(&self, command: &Command) -> Result<Vec<Reply>, EngineError> {
        if !matches!(command, Command::Params | Command::Export | Command::LiveSend(_) | Command::LiveBuild(..)) {
            return Ok((1..self.size).map(|_| Reply::Done).collect());
        }
        // Every answer is read before any is decoded, so none is left queued for a later read;
        // one that does not decode means the processes disagree, which nothing can repair.
        let answers: Vec<Vec<u8>> = (1..self.size).map(|r| mpi::control_receive(r).map_err(comm_err)).collect::<Result<_, _>>()?;
        Ok(answers
            .into_iter()
            .zip(1..)
            .map(|(bytes, r)| match command {
                Command::LiveSend(_) => match serde_json::from_slice::<Result<Sent, String>>(&bytes) {
                    Ok(sent) => Reply::Sent(sent),
                    Err(e) => mpi::abort_job(&format!("process {r}'s reshard answer does not decode: {e}")),
                },
                Command::LiveBuild(..) => match serde_json::from_slice::<Result<Received, PhaseError>>(&bytes) {
                    Ok(built) => Reply::Built(built),
                    Err(e) => mpi::abort_job(&format!("process {r}'s reshard answer does not decode: {e}")),
                },
                Command::Params => match crate::wire::unpack(PARAMS_KEY, bytes) {
                    Ok((_, tensors)) => Reply::Params(tensors),
                    Err(e) => mpi::abort_job(&format!("process {r}'s parameters do not decode: {e}")),
                },
                _ => match RankExport::from_bytes(bytes) {
                    Ok(export) => Reply::Export(Box::new(export)),
                    Err(e) => mpi::abort_job(&format!("process {r}'s export does not decode: {e}")),
                },
            })
            .collect())
    }

    /// The serving processes stop their ranks.
    pub(super) fn stop(self) {
        if let Err(e) = self.send(&Header::Stop, &[]) {
            tracing::warn!("{e}");
        }
    }
}

const PARAMS_KEY: &str = "copus.rank-params";

/// `(tensor, checksum)` of everything a rank loaded: a serving process's start-up answer (one
/// that cannot start ends the job instead).
type Checksums = Vec<(String, u64)>;

/// Ends a run started with `mpirun`: process 0 tells the serving processes to exit, and MPI is
/// finalised. Later calls do nothing.
pub fn finish() {
    if let Role::Driver { .. } = mpi::role() {
        let _ = mpi::control_broadcast(Some(super::messages::exit_message()));
    }
    mpi::finish();
}

/// Runs this process's rank of every layout process 0 starts, until the run ends. Call it on
/// every process whose [`mpi::init`] role is [`Role::Worker`]; `decode` rebuilds the model
/// from its [`ParallelLm::describe`] text.
///
/// A rank that fails (to start, or during a step) aborts the job with its message: the other
/// ranks may be waiting for it inside a collective.
pub fn serve<L: ParallelLm, E: std::fmt::Display>(decode_model: impl Fn(&str) -> Result<L, E>) -> Result<(), EngineError> {
    let Role::Worker { rank, .. } = mpi::role() else {
        return Err(EngineError::Dead("serve runs on processes 1.. of an MPI job (call copus_burn::comm::mpi::init first)".into()));
    };
    let mut server = Server { rank, running: None, model: None, job: None, pending: None };
    loop {
        let msg = mpi::control_broadcast(None).map_err(comm_err)?;
        let (header, payload) = decode(&msg).map_err(comm_err)?;
        match header {
            Header::Launch { model: text } => server.launch(&decode_model, text, payload)?,
            Header::Step { fault } => server.step(payload, fault)?,
            Header::Evaluate { micro } => server.evaluate(payload, micro)?,
            Header::Params => server.params()?,
            Header::Export => server.export()?,
            Header::SetBatch { global_batch, micro_batch } => {
                if let Some(s) = server.running.as_mut() {
                    s.set_batch(global_batch, micro_batch);
                }
            }
            Header::LiveSend => server.live_send(payload)?,
            Header::LiveBuild => server.live_build(payload)?,
            Header::LiveCommit => server.live_commit(),
            Header::LiveAbort => {
                server.job = None;
                server.pending = None;
            }
            Header::Stop => server.running = None,
            Header::Exit => return Ok(()),
        }
    }
}

/// Answers process 0.
fn reply(bytes: Vec<u8>) -> Result<(), EngineError> {
    mpi::control_reply(&bytes).map_err(comm_err)
}

/// What a serving process keeps between commands.
struct Server<L: ParallelLm> {
    /// This process's rank.
    rank: usize,
    /// The rank of the running layout.
    running: Option<RankState<L, ProcessComm>>,
    /// The model's describe text and the model rebuilt from it.
    model: Option<(String, Arc<L>)>,
    /// A live layout change in progress: its plan, and the state step 2 built.
    job: Option<Arc<LiveJob>>,
    pending: Option<RankState<L, ProcessComm>>,
}

impl<L: ParallelLm> Server<L> {
    /// Launch: starts this process's rank of the layout whose training state is `payload`
    /// (rebuilding the model from `text` unless it is the one already kept) and answers what
    /// the rank loaded.
    fn launch<E: std::fmt::Display>(
        &mut self,
        decode_model: &impl Fn(&str) -> Result<L, E>,
        text: String,
        payload: &[u8],
    ) -> Result<(), EngineError> {
        let rank = self.rank;
        drop(self.running.take());
        let l = match &self.model {
            Some((t, l)) if *t == text => Ok(l.clone()),
            _ => decode_model(&text).map(Arc::new).map_err(|e| format!("process {rank} cannot rebuild the model: {e}")),
        };
        let started = l.and_then(|l| {
            self.model = Some((text, l.clone()));
            start(&l, rank, payload.to_vec())
        });
        // The other ranks may be waiting for this one in a collective: a failure ends
        // the job, as it does for a rank thread of process 0.
        let answer: Checksums = match started {
            Ok((s, hashes)) => {
                self.running = Some(s);
                hashes
            }
            Err(e) => mpi::abort_job(&format!("rank {rank} could not start: {e}")),
        };
        reply(serde_json::to_vec(&answer).expect("answers serialise"))
    }

    /// Step: one optimizer step on the batch in `payload`; a failure ends the job.
    fn step(&mut self, payload: &[u8], fault: super::fault::StepFault) -> Result<(), EngineError> {
        let rank = self.rank;
        let s = self.running.as_mut().ok_or_else(|| comm_err("a step before any layout started".into()))?;
        let batch: Vec<i64> = payload.chunks_exact(8).map(|c| i64::from_le_bytes(c.try_into().expect("8 bytes"))).collect();
        let step: Result<EngineStep, _> = s.step(&batch, fault);
        if let Err(e) = step {
            mpi::abort_job(&format!("rank {rank}: {e}"));
        }
        Ok(())
    }

    /// Evaluate: the held-out evaluation of the sequences in `payload`; a failure ends the job.
    fn evaluate(&mut self, payload: &[u8], micro: usize) -> Result<(), EngineError> {
        let rank = self.rank;
        let s = self.running.as_mut().ok_or_else(|| comm_err("an evaluation before any layout started".into()))?;
        let windows: Vec<i64> = payload.chunks_exact(8).map(|c| i64::from_le_bytes(c.try_into().expect("8 bytes"))).collect();
        if let Err(e) = s.evaluate(&windows, micro) {
            mpi::abort_job(&format!("rank {rank}: {e}"));
        }
        Ok(())
    }

    /// Params: answers the rank's parameters.
    fn params(&self) -> Result<(), EngineError> {
        let s = self.running.as_ref().ok_or_else(|| comm_err("parameters asked before any layout started".into()))?;
        let params: RankParams = s.params();
        reply(crate::wire::pack(PARAMS_KEY, "{}", params).map_err(comm_err)?)
    }

    /// Export: answers the rank's export; a failure to export ends the job.
    fn export(&self) -> Result<(), EngineError> {
        let rank = self.rank;
        let s = self.running.as_ref().ok_or_else(|| comm_err("an export asked before any layout started".into()))?;
        let bytes = match s.export() {
            Ok(e) => e.to_bytes().map_err(comm_err)?,
            Err(e) => mpi::abort_job(&format!("rank {rank}: {e}")),
        };
        reply(bytes)
    }

    /// Live change, step 1: sends the rank's pieces of the plan in `payload`, keeps the plan,
    /// and answers what it sent.
    fn live_send(&mut self, payload: &[u8]) -> Result<(), EngineError> {
        let s = self.running.as_ref().ok_or_else(|| comm_err("a layout change before any layout started".into()))?;
        let l = self.model.as_ref().map(|(_, l)| l.clone()).ok_or_else(|| comm_err("a layout change before any model".into()))?;
        let order: LiveOrder = serde_json::from_slice(payload).map_err(|e| comm_err(format!("a reshard plan that does not parse: {e}")))?;
        let j = Arc::new(LiveJob {
            plan: order.plan,
            cfg: order.cfg,
            specs: Arc::new(l.spec().param_specs()),
            num_layers: order.num_layers,
            fault: Fault::none(),
            fault_rank: usize::MAX,
            handoff: None,
        });
        let sent = catch_unwind(AssertUnwindSafe(|| s.live_send(&j))).unwrap_or_else(|p| Err(panic_message(&p)));
        self.job = Some(j);
        self.pending = None;
        reply(serde_json::to_vec(&sent).expect("answers serialise"))
    }

    /// Live change, step 2: receives the rank's pieces and builds its new state as agreed in
    /// `payload`, keeps it pending, and answers what it received.
    fn live_build(&mut self, payload: &[u8]) -> Result<(), EngineError> {
        let s = self.running.as_ref().ok_or_else(|| comm_err("a layout change before any layout started".into()))?;
        let l = self.model.as_ref().map(|(_, l)| l.clone()).ok_or_else(|| comm_err("a layout change before any model".into()))?;
        let j = self.job.clone().ok_or_else(|| comm_err("a reshard build before its plan".into()))?;
        let agreed: Agreed =
            serde_json::from_slice(payload).map_err(|e| comm_err(format!("a reshard agreement that does not parse: {e}")))?;
        let built = catch_unwind(AssertUnwindSafe(|| s.live_build(&j, &agreed, &*l)))
            .unwrap_or_else(|p| Err((ReconfigPhase::Load, panic_message(&p))));
        let answer = built.map(|(next, received)| {
            self.pending = next;
            received
        });
        reply(serde_json::to_vec(&answer).expect("answers serialise"))
    }

    /// Live change, step 3: switches to the state step 2 built; with none built, ends the job.
    fn live_commit(&mut self) {
        self.job = None;
        match self.pending.take() {
            Some(next) => self.running = Some(next),
            None => mpi::abort_job(&format!("rank {}: a layout change committed with nothing built", self.rank)),
        }
    }
}

/// Starts this process's rank from a launch payload; a failure or panic becomes its message
/// (and the caller ends the job, so no other rank waits for this one in a collective).
fn start<L: ParallelLm>(model: &Arc<L>, rank: usize, state: Vec<u8>) -> Result<(RankState<L, ProcessComm>, Checksums), String> {
    let built = catch_unwind(AssertUnwindSafe(|| -> Result<_, EngineError> {
        let (state, cfg, _) = TrainingState::from_bytes(state)?;
        // The layout's world communicator: the GPU's collective library for a GPU rank.
        let device = mpi::on_this_node(cfg.devices.get(rank).copied().unwrap_or_default(), cfg.ranks_per_device);
        let comm =
            ProcessComm::world_for(device, cfg.exact_reductions).map_err(|e| EngineError::Dead(format!("the world communicator: {e}")))?;
        let specs = model.spec().param_specs();
        let parallel = model.parallel_plan();
        parallel.check(&specs)?;
        let (init, _) = rank_init(&**model, &specs, &state, &cfg, &Arc::new(parallel), rank, Fault::none())?;
        RankState::start(rank, comm, init, &**model, specs, cfg)
    }));
    match built {
        Ok(r) => r.map_err(|e| e.to_string()),
        Err(p) => Err(panic_message(&p)),
    }
}
