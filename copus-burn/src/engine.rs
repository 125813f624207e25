//! The 3D-parallel engine: one worker thread per rank, each with its own device and its shard
//! of the model, training in lock-step.
//!
//! One optimizer step with layout (dp, tp, pp), global batch B_g and micro-batch B_m:
//! - dp replica `d` takes sequences `[d * a * B_m, (d + 1) * a * B_m)` of the step's batch as
//!   `a = B_g / (dp * B_m)` micro-batches, in order, so global micro-batch `d * a + k` is the
//!   same data serial training sees as its micro-batch `d * a + k`;
//! - each stage runs copus-core's pipeline schedule (1F1B or GPipe). A micro-batch goes
//!   through *regions* whose inputs are detached leaves: the embedding, one region per residual
//!   branch, and the head. Between regions the engine sums partial outputs over the tp group
//!   (forward) and partial input gradients over the tp group (backward): Megatron's f/g pair
//!   without custom autodiff ops. Activations and their gradients cross stages by send/recv;
//! - the loss is the vocabulary-parallel cross entropy normalised by the step's global number
//!   of target tokens, so gradients do not depend on how B_g is split;
//! - after the last micro-batch, gradients are all-reduced over dp in flat buckets;
//! - the gradient-noise probe sums each micro-batch's squared gradient norm over the tp and pp
//!   shards (tp-replicated parameters and a tied embedding counted once) and the norm of the
//!   reduced gradient over the model-parallel ranks, so copus-core's estimator sees exactly the
//!   numbers serial training would give it.

use std::collections::HashMap;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;
use std::sync::mpsc::{Receiver, Sender, channel};
use std::thread::JoinHandle;
use std::time::Instant;

use burn::module::{Module, ModuleVisitor, Param, ParamId};
use burn::optim::{GradientsParams, ModuleOptimizer};
use burn::tensor::{Device, Int, Tensor, TensorData};
use copus_core::gns::{GnsEstimator, StepStats};
use copus_core::layout::{Axis, ParallelDims, RankGrid};
use copus_core::model::{ParamSpec, Placement, TpSplit};
use copus_core::schedule::{Action, ScheduleKind, build as build_schedule};
use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::collective::{Collective, CommError, ReduceOp, ThreadComm};
use crate::grads;
use crate::parallel::{FullParams, ParallelLm, ShardError, ShardPlan, ShardSource, StageModel};
use crate::trainer::{OptimConfig, StepMetrics, TrainError, adamw_optimizer};

/// How the engine runs.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct EngineConfig {
    /// The layout.
    pub dims: ParallelDims,
    /// Sequences per optimizer step, B_g.
    pub global_batch: usize,
    /// Sequences per micro-batch, B_m.
    pub micro_batch: usize,
    /// Tokens per sequence (inputs; each sequence in a batch has `seq_len + 1` tokens).
    pub seq_len: usize,
    /// Pipeline schedule.
    pub schedule: ScheduleKind,
    /// Optimizer, LR schedule and probe settings.
    pub optim: OptimConfig,
    /// Elements per dp all-reduce bucket.
    pub bucket_elems: usize,
}

impl EngineConfig {
    /// A configuration with the 1F1B schedule and 1 Mi-element buckets.
    pub fn new(dims: ParallelDims, global_batch: usize, micro_batch: usize, seq_len: usize, optim: OptimConfig) -> Self {
        Self { dims, global_batch, micro_batch, seq_len, schedule: ScheduleKind::OneFOneB, optim, bucket_elems: 1 << 20 }
    }

    /// Micro-batches per dp replica per step, `a = B_g / (dp * B_m)`.
    pub fn num_micro_per_replica(&self) -> usize {
        self.global_batch / (self.dims.dp * self.micro_batch)
    }

    pub(crate) fn validate(&self) -> Result<(), EngineError> {
        let (b, m, dp) = (self.global_batch, self.micro_batch, self.dims.dp);
        if m == 0 || b == 0 || self.seq_len == 0 {
            return Err(EngineError::Batch(format!(
                "global batch ({b}), micro-batch ({m}) and sequence length ({}) must be at least 1",
                self.seq_len
            )));
        }
        if !b.is_multiple_of(dp * m) {
            return Err(EngineError::Batch(format!(
                "global batch {b} is not a multiple of dp x micro-batch = {dp} x {m} = {}",
                dp * m
            )));
        }
        if self.bucket_elems == 0 {
            return Err(EngineError::Batch("bucket_elems must be at least 1".into()));
        }
        self.optim.validate().map_err(EngineError::Train)
    }
}

/// Why the engine could not train.
#[derive(Clone, Debug, PartialEq, Error)]
pub enum EngineError {
    /// The layout does not fit the model or the world.
    #[error("layout {dims}: {reason}")]
    Layout {
        /// The layout asked for.
        dims: String,
        /// What does not fit.
        reason: String,
    },
    /// Batch arithmetic or batch data.
    #[error("batch: {0}")]
    Batch(String),
    /// Building shards.
    #[error("sharding: {0}")]
    Shard(#[from] ShardError),
    /// Optimizer settings or a non-finite loss.
    #[error(transparent)]
    Train(TrainError),
    /// A rank failed (panicked or reported an error); the step did not happen.
    #[error("rank {rank} failed: {message}")]
    Rank {
        /// The first failing rank.
        rank: usize,
        /// Its message.
        message: String,
    },
    /// A rank's loaded state does not match the staged state.
    #[error("verification failed: {0}")]
    Verify(String),
    /// A reconfiguration failed at `phase` and the engine went back to its old configuration.
    #[error("reconfiguration to {target} failed at {phase:?} ({message}); rolled back to {restored}, nothing lost")]
    RolledBack {
        /// Where it failed.
        phase: ReconfigPhase,
        /// The error.
        message: String,
        /// The configuration asked for.
        target: String,
        /// The configuration running again.
        restored: String,
    },
    /// Reading or writing a checkpoint.
    #[error("checkpoint {path}: {message}")]
    Checkpoint {
        /// File.
        path: String,
        /// What went wrong.
        message: String,
    },
    /// The engine failed earlier and must be rebuilt.
    #[error("the engine stopped after an earlier failure: {0}")]
    Dead(String),
}

/// What a step reports.
#[derive(Clone, Debug, PartialEq)]
pub struct EngineStep {
    /// The usual trainer metrics.
    pub metrics: StepMetrics,
    /// What the probe measured this step (before smoothing).
    pub stats: StepStats,
}

/// One rank's parameters as `(global name, shape, values)`.
pub type RankParams = Vec<(String, Vec<usize>, Vec<f32>)>;

enum Command {
    Step(Arc<Vec<i64>>),
    Params,
    Export,
    SetBatch { global_batch: usize, micro_batch: usize },
    Stop,
}

enum Reply {
    Step(Box<EngineStep>),
    Params(RankParams),
    Export(Box<RankExport>),
    Done,
}

/// A rank's failure: `origin` is false when it only saw another rank's abort.
struct RankFailure {
    origin: bool,
    message: String,
}

struct WorkerHandle {
    commands: Sender<Command>,
    thread: Option<JoinHandle<()>>,
}

type Replies = Receiver<(usize, Result<Reply, RankFailure>)>;

/// The running ranks of one layout.
pub(crate) struct Cluster {
    workers: Vec<WorkerHandle>,
    replies: Replies,
}

impl Cluster {
    fn stop(&mut self) {
        for w in &self.workers {
            let _ = w.commands.send(Command::Stop);
        }
        for w in &mut self.workers {
            if let Some(t) = w.thread.take() {
                let _ = t.join();
            }
        }
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Where a reconfiguration can fail (for tests of the rollback).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ReconfigPhase {
    /// After the state is staged in host memory and the old ranks are stopped.
    AfterStaging,
    /// While the new ranks build their process groups.
    GroupRebuild,
    /// While the new ranks load their shards and optimizer state.
    Load,
    /// When the loaded state is checked against the staged one.
    Verify,
}

/// What a rank starts from.
pub(crate) struct RankInit {
    pub(crate) plan: ShardPlan,
    pub(crate) source: ShardSource,
    pub(crate) resume: RankResume,
    pub(crate) fault: Option<ReconfigPhase>,
}

/// Training state a rank resumes with (empty for a fresh start).
#[derive(Default)]
pub(crate) struct RankResume {
    /// (global name, field, local shape, values) of optimizer state tensors.
    pub(crate) optim: Vec<(String, String, Vec<usize>, Vec<f32>)>,
    /// (global name, field, value) of optimizer state scalars.
    pub(crate) scalars: Vec<(String, String, burn_pack::Scalar)>,
    /// Local shards of the previous step's gradient (n == 1 probe).
    pub(crate) previous: Option<HashMap<String, Vec<f32>>>,
    pub(crate) step: u64,
    pub(crate) tokens_seen: u64,
    pub(crate) gns: Option<GnsEstimator>,
}

/// What a rank of dp replica 0 hands back for staging (other replicas hold copies).
pub(crate) struct RankExport {
    pub(crate) params: Vec<(String, Vec<f32>)>,
    pub(crate) optim: Vec<(String, String, Vec<f32>)>,
    pub(crate) scalars: Vec<(String, String, burn_pack::Scalar)>,
    pub(crate) previous: Option<Vec<(String, Vec<f32>)>>,
    pub(crate) step: u64,
    pub(crate) tokens_seen: u64,
    pub(crate) gns: GnsEstimator,
}

/// The parallel trainer.
pub struct Engine<L: ParallelLm> {
    pub(crate) model: Arc<L>,
    pub(crate) cfg: EngineConfig,
    pub(crate) specs: Vec<ParamSpec>,
    cluster: Option<Cluster>,
    pub(crate) dead: Option<String>,
    pub(crate) gns: GnsEstimator,
    pub(crate) steps_done: u64,
    pub(crate) tokens_seen: u64,
    pub(crate) fault: Option<ReconfigPhase>,
}

impl<L: ParallelLm> Engine<L> {
    /// Starts one worker per rank of `cfg.dims`, each holding its shard of `full`.
    pub fn new(model: Arc<L>, full: &FullParams, cfg: EngineConfig) -> Result<Self, EngineError> {
        let state = crate::reconfig::TrainingState::fresh(&model.spec(), full, cfg.optim.gns_theta)?;
        Self::from_state(model, &state, cfg)
    }

    /// Starts the ranks of `cfg.dims` from a staged or loaded training state (any layout's).
    pub fn from_state(model: Arc<L>, state: &crate::reconfig::TrainingState, cfg: EngineConfig) -> Result<Self, EngineError> {
        let specs = model.spec().param_specs();
        let mut engine = Self {
            model,
            cfg,
            specs,
            cluster: None,
            dead: None,
            gns: state.gns.clone(),
            steps_done: state.step,
            tokens_seen: state.tokens_seen,
            fault: None,
        };
        let cluster = engine.launch(state, &engine.cfg.clone(), None)?;
        engine.cluster = Some(cluster);
        Ok(engine)
    }

    /// Checks `cfg` against the model and starts its ranks from `state`; verifies what each rank
    /// loaded against `state` (element counts and checksums of every parameter and optimizer
    /// tensor).
    pub(crate) fn launch(
        &self,
        state: &crate::reconfig::TrainingState,
        cfg: &EngineConfig,
        fault: Option<ReconfigPhase>,
    ) -> Result<Cluster, EngineError> {
        cfg.validate()?;
        let spec = self.model.spec();
        let dims = cfg.dims;
        dims.check_model(&spec).map_err(|e| EngineError::Layout { dims: dims.to_string(), reason: e.to_string() })?;
        let grid = RankGrid::new(dims);
        let world = dims.world_size();
        let mut inits = Vec::with_capacity(world);
        let mut expected = Vec::with_capacity(world);
        for r in 0..world {
            let c = grid.coord(r).map_err(|e| EngineError::Layout { dims: dims.to_string(), reason: e.to_string() })?;
            let plan = ShardPlan::new(dims, c.tp, c.pp, spec.num_layers);
            let (source, resume, hashes) = state.rank_init(&self.specs, &plan)?;
            expected.push(hashes);
            // Inject a fault on the last rank only: the others must be released, not hang.
            let fault = fault.filter(|_| r + 1 == world);
            inits.push(RankInit { plan, source, resume, fault });
        }
        let (reply_tx, replies) = channel();
        let comms = ThreadComm::world(world);
        let (ready_tx, ready_rx) = channel();
        let mut workers = Vec::with_capacity(world);
        for ((r, comm), init) in comms.into_iter().enumerate().zip(inits) {
            let (tx, rx) = channel::<Command>();
            let model = self.model.clone();
            let cfg = cfg.clone();
            let specs = self.specs.clone();
            let reply_tx = reply_tx.clone();
            let ready_tx = ready_tx.clone();
            let thread = std::thread::Builder::new()
                .name(format!("copus-rank-{r}"))
                .spawn(move || {
                    let aborter = comm.abort_handle();
                    let built = catch_unwind(AssertUnwindSafe(|| RankState::<L>::start(r, comm, init, &*model, specs, cfg)));
                    let state = match built {
                        Ok(Ok((s, hashes))) => {
                            let _ = ready_tx.send((r, Ok(hashes)));
                            s
                        }
                        Ok(Err(e)) => {
                            aborter.abort(&e.to_string());
                            let _ = ready_tx.send((r, Err(e)));
                            return;
                        }
                        Err(p) => {
                            let message = panic_message(&p);
                            aborter.abort(&message);
                            let _ = ready_tx.send((r, Err(EngineError::Rank { rank: r, message })));
                            return;
                        }
                    };
                    worker_loop(state, rx, reply_tx);
                })
                .map_err(|e| EngineError::Rank { rank: r, message: format!("could not start its thread: {e}") })?;
            workers.push(WorkerHandle { commands: tx, thread: Some(thread) });
        }
        drop(ready_tx);
        let cluster = Cluster { workers, replies };
        let mut first_error: Option<EngineError> = None;
        let mut first_secondary = false;
        let mut reported: Vec<Option<Vec<(String, u64)>>> = vec![None; world];
        for _ in 0..world {
            match ready_rx.recv() {
                Ok((r, Ok(h))) => reported[r] = Some(h),
                Ok((_, Err(e))) => {
                    // Prefer a rank's own failure over another rank's report of the abort.
                    let secondary = matches!(&e, EngineError::Rank { message, .. } if message.starts_with("rank ") && message.contains(" failed: "));
                    if first_error.is_none() || (first_secondary && !secondary) {
                        first_error = Some(e);
                        first_secondary = secondary;
                    }
                }
                Err(_) => {
                    first_error.get_or_insert(EngineError::Dead("a rank thread exited while starting".into()));
                    break;
                }
            }
        }
        if let Some(e) = first_error {
            return Err(e); // dropping `cluster` stops the ranks that did start
        }
        for (r, (want, got)) in expected.iter_mut().zip(&reported).enumerate() {
            let mut got = got.clone().unwrap_or_default();
            if fault == Some(ReconfigPhase::Verify) && r + 1 == world {
                if let Some(first) = got.first_mut() {
                    first.1 ^= 1;
                }
            }
            got.sort();
            want.sort();
            if &got != want {
                let diff = want.iter().find(|w| !got.contains(w)).map(|w| w.0.clone()).unwrap_or_else(|| "an extra tensor".into());
                return Err(EngineError::Verify(format!("rank {r}: {diff} does not match the staged state")));
            }
        }
        Ok(cluster)
    }

    /// The configuration.
    pub fn config(&self) -> &EngineConfig {
        &self.cfg
    }

    /// The model family.
    pub fn model(&self) -> &Arc<L> {
        &self.model
    }

    /// Optimizer steps taken.
    pub fn steps_done(&self) -> u64 {
        self.steps_done
    }

    /// The noise-scale estimator (identical on every rank).
    pub fn gns(&self) -> &GnsEstimator {
        &self.gns
    }

    /// Makes the next layout change fail at `phase` (tests of the rollback).
    #[doc(hidden)]
    pub fn inject_fault(&mut self, phase: Option<ReconfigPhase>) {
        self.fault = phase;
    }

    fn broadcast(&mut self, make: impl Fn() -> Command) -> Result<Vec<Reply>, EngineError> {
        if let Some(d) = &self.dead {
            return Err(EngineError::Dead(d.clone()));
        }
        let Some(cluster) = self.cluster.as_ref() else { return Err(EngineError::Dead("no ranks are running".into())) };
        for (r, w) in cluster.workers.iter().enumerate() {
            if w.commands.send(make()).is_err() {
                let msg = format!("rank {r} is gone");
                self.dead = Some(msg.clone());
                return Err(EngineError::Dead(msg));
            }
        }
        let n = cluster.workers.len();
        let mut out: Vec<Option<Reply>> = (0..n).map(|_| None).collect();
        let mut failure: Option<(usize, RankFailure)> = None;
        for _ in 0..n {
            match cluster.replies.recv() {
                Ok((r, Ok(reply))) => out[r] = Some(reply),
                Ok((r, Err(f))) => {
                    let better = match &failure {
                        None => true,
                        Some((_, old)) => f.origin && !old.origin,
                    };
                    if better {
                        failure = Some((r, f));
                    }
                }
                Err(_) => {
                    failure.get_or_insert((usize::MAX, RankFailure { origin: true, message: "a rank thread vanished".into() }));
                    break;
                }
            }
        }
        if let Some((rank, f)) = failure {
            let e = EngineError::Rank { rank, message: f.message };
            self.dead = Some(e.to_string());
            return Err(e);
        }
        Ok(out.into_iter().map(|o| o.expect("every rank replied")).collect())
    }

    /// One optimizer step on `batch`: `B_g` sequences of `seq_len + 1` tokens, row-major.
    pub fn step(&mut self, batch: Vec<i64>) -> Result<EngineStep, EngineError> {
        let want = self.cfg.global_batch * (self.cfg.seq_len + 1);
        if batch.len() != want {
            return Err(EngineError::Batch(format!(
                "expected {} sequences of {} tokens ({want} values), got {} values",
                self.cfg.global_batch,
                self.cfg.seq_len + 1,
                batch.len()
            )));
        }
        let vocab = self.model.spec().vocab_size as i64;
        if let Some(t) = batch.iter().find(|&&t| t < 0 || t >= vocab) {
            return Err(EngineError::Batch(format!("token id {t} is outside the vocabulary 0..{vocab}")));
        }
        let batch = Arc::new(batch);
        let replies = self.broadcast(|| Command::Step(batch.clone()))?;
        let Some(Reply::Step(step)) = replies.into_iter().next() else { unreachable!("step reply") };
        if !step.metrics.loss.is_finite() {
            let e = EngineError::Train(TrainError::NonFinite(step.metrics.loss, self.steps_done));
            self.dead = Some(e.to_string());
            return Err(e);
        }
        self.gns.observe(&step.stats).map_err(|e| EngineError::Train(TrainError::Gns(e)))?;
        self.steps_done += 1;
        self.tokens_seen = step.metrics.tokens_seen;
        Ok(*step)
    }

    /// Every rank's parameters, in rank order.
    pub fn rank_params(&mut self) -> Result<Vec<RankParams>, EngineError> {
        let replies = self.broadcast(|| Command::Params)?;
        Ok(replies
            .into_iter()
            .map(|r| match r {
                Reply::Params(p) => p,
                _ => unreachable!("params reply"),
            })
            .collect())
    }

    /// Every rank's staging export, in rank order.
    pub(crate) fn export(&mut self) -> Result<Vec<RankExport>, EngineError> {
        let replies = self.broadcast(|| Command::Export)?;
        Ok(replies
            .into_iter()
            .map(|r| match r {
                Reply::Export(e) => *e,
                _ => unreachable!("export reply"),
            })
            .collect())
    }

    /// Changes B_g and B_m without touching the layout: only the data split, the accumulation
    /// count and the learning rate (through the LR rule) change; weights and every optimizer
    /// moment stay where they are.
    pub(crate) fn set_batch(&mut self, global_batch: usize, micro_batch: usize) -> Result<(), EngineError> {
        let cfg = EngineConfig { global_batch, micro_batch, ..self.cfg.clone() };
        cfg.validate()?;
        self.broadcast(|| Command::SetBatch { global_batch, micro_batch })?;
        self.cfg = cfg;
        Ok(())
    }

    /// The rank grid of the running layout.
    pub(crate) fn grid(&self) -> RankGrid {
        RankGrid::new(self.cfg.dims)
    }

    /// Stops the running ranks.
    pub(crate) fn stop_cluster(&mut self) {
        if let Some(mut c) = self.cluster.take() {
            c.stop();
        }
    }

    pub(crate) fn set_cluster(&mut self, c: Cluster) {
        self.cluster = Some(c);
        self.dead = None;
    }

    /// The full parameters, reassembled from dp replica 0's shards (through the staging path).
    pub fn gather(&mut self) -> Result<HashMap<String, Vec<f32>>, EngineError> {
        Ok(self.stage_state()?.params.into_iter().collect())
    }
}

fn panic_message(p: &Box<dyn std::any::Any + Send>) -> String {
    if let Some(s) = p.downcast_ref::<&str>() {
        format!("panicked: {s}")
    } else if let Some(s) = p.downcast_ref::<String>() {
        format!("panicked: {s}")
    } else {
        "panicked".into()
    }
}

fn worker_loop<L: ParallelLm>(mut state: RankState<L>, rx: Receiver<Command>, tx: Sender<(usize, Result<Reply, RankFailure>)>) {
    let r = state.rank;
    while let Ok(cmd) = rx.recv() {
        let result = match cmd {
            Command::Stop => return,
            Command::Step(batch) => catch_unwind(AssertUnwindSafe(|| state.step(&batch).map(|s| Reply::Step(Box::new(s))))),
            Command::Params => catch_unwind(AssertUnwindSafe(|| Ok(Reply::Params(state.params())))),
            Command::Export => catch_unwind(AssertUnwindSafe(|| state.export().map(|e| Reply::Export(Box::new(e))))),
            Command::SetBatch { global_batch, micro_batch } => {
                state.cfg.global_batch = global_batch;
                state.cfg.micro_batch = micro_batch;
                Ok(Ok(Reply::Done))
            }
        };
        let out = match result {
            Ok(Ok(reply)) => Ok(reply),
            Ok(Err(RankError::Comm(CommError::Aborted { rank, message }))) if rank != r => {
                Err(RankFailure { origin: false, message: format!("rank {rank} failed: {message}") })
            }
            Ok(Err(e)) => {
                let message = e.to_string();
                state.world.abort(&message);
                Err(RankFailure { origin: true, message })
            }
            Err(p) => {
                let message = panic_message(&p);
                state.world.abort(&message);
                Err(RankFailure { origin: true, message })
            }
        };
        let failed = out.is_err();
        if tx.send((r, out)).is_err() || failed {
            // After a failure the world is aborted; this rank can do nothing more.
            return;
        }
    }
}

#[derive(Debug, Error)]
enum RankError {
    #[error(transparent)]
    Comm(#[from] CommError),
    #[error(transparent)]
    Train(#[from] TrainError),
    #[error("gradient noise scale: {0}")]
    Gns(#[from] copus_core::gns::GnsError),
}

/// How a parameter's gradient is counted and reduced.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Role {
    /// Split across tp: each rank owns distinct elements.
    Sharded,
    /// The same on every tp rank; partial gradients are summed over tp.
    TpReplicated,
}

#[derive(Clone, Copy, Debug)]
struct ParamInfo {
    id: ParamId,
    role: Role,
    /// The tied embedding on the last stage of a pipeline: a mirror of the first stage's copy.
    mirror: bool,
    /// The tied embedding on the first stage of a pipeline: receives the last stage's share.
    tied_owner: bool,
}

impl ParamInfo {
    fn counted(&self, tp_rank: usize) -> bool {
        !self.mirror && (self.role == Role::Sharded || tp_rank == 0)
    }
}

const TAG_ACT: u32 = 1;
const TAG_GRAD: u32 = 2;
const TAG_TIED: u32 = 3;
const TAG_TIED_SUM: u32 = 4;

struct RankState<L: ParallelLm> {
    rank: usize,
    world: ThreadComm,
    tp: ThreadComm,
    dp: ThreadComm,
    pp: ThreadComm,
    /// tp x pp ranks of this dp replica.
    mp: ThreadComm,
    plan: ShardPlan,
    dp_rank: usize,
    stage: Option<L::Stage>,
    params: Vec<ParamInfo>,
    names: HashMap<ParamId, String>,
    /// Each parameter's path inside the stage module.
    paths: HashMap<ParamId, String>,
    optim: ModuleOptimizer,
    cfg: EngineConfig,
    gns: GnsEstimator,
    step: u64,
    tokens_seen: u64,
    previous: Option<GradientsParams>,
    device: Device,
    d_model: usize,
    vocab_start: usize,
    vocab_local: usize,
}

/// What a micro-batch leaves on a stage between its forward and backward.
#[derive(Default)]
struct InFlight {
    embed_out: Option<Tensor<3>>,
    blocks: Vec<(Tensor<3>, Tensor<3>)>,
    head: Option<(Tensor<3>, Tensor<3>, Vec<f32>)>,
    activation_in: Option<Vec<f32>>,
    activation_out: Option<Vec<f32>>,
    grad_in: Option<Vec<f32>>,
    grad_out: Option<Vec<f32>>,
}

fn host(t: Tensor<3>) -> Vec<f32> {
    t.into_data().try_to_vec::<f32>().expect("f32 activations")
}

impl<L: ParallelLm> RankState<L> {
    /// Builds this rank: process groups, the stage from its shards, the optimizer and the rest
    /// of the training state; returns checksums of what it loaded.
    fn start(
        rank: usize,
        world: ThreadComm,
        init: RankInit,
        model: &L,
        specs: Vec<ParamSpec>,
        cfg: EngineConfig,
    ) -> Result<(Self, Vec<(String, u64)>), EngineError> {
        let RankInit { plan, mut source, resume, fault } = init;
        let dims = cfg.dims;
        let grid = RankGrid::new(dims);
        let comm_err = |e: CommError| EngineError::Rank { rank, message: e.to_string() };
        if fault == Some(ReconfigPhase::GroupRebuild) {
            return Err(EngineError::Rank { rank, message: "injected failure while building process groups".into() });
        }
        let split = |axis: Axis| world.split(&grid.groups(axis));
        let tp = split(Axis::Tp).map_err(comm_err)?;
        let dp = split(Axis::Dp).map_err(comm_err)?;
        let pp = split(Axis::Pp).map_err(comm_err)?;
        let mp_groups: Vec<Vec<usize>> =
            (0..dims.dp).map(|d| (0..dims.world_size()).filter(|&r| grid.coord(r).map(|c| c.dp) == Ok(d)).collect()).collect();
        let mp = world.split(&mp_groups).map_err(comm_err)?;
        if fault == Some(ReconfigPhase::Load) {
            return Err(EngineError::Rank { rank, message: "injected failure while loading shards".into() });
        }
        let device = Device::flex().autodiff();
        let stage = model.build_stage(&plan, &mut source, &device)?;
        let left = source.remaining();
        if !left.is_empty() {
            return Err(EngineError::Shard(ShardError::Layout(format!("the model's stage builder did not take {left:?}"))));
        }
        let mut state = Self::new(rank, world, (tp, dp, pp, mp), plan, stage, specs, cfg, device)?;
        state.resume(resume)?;
        let hashes = state.checksums()?;
        Ok((state, hashes))
    }

    #[allow(clippy::too_many_arguments)]
    fn new(
        rank: usize,
        world: ThreadComm,
        (tp, dp, pp, mp): (ThreadComm, ThreadComm, ThreadComm, ThreadComm),
        plan: ShardPlan,
        stage: L::Stage,
        specs: Vec<ParamSpec>,
        cfg: EngineConfig,
        device: Device,
    ) -> Result<Self, EngineError> {
        let dims = cfg.dims;
        let grid = RankGrid::new(dims);
        let dp_rank = grid.coord(rank).map_err(|e| EngineError::Layout { dims: dims.to_string(), reason: e.to_string() })?.dp;
        let by_name: HashMap<&str, &ParamSpec> = specs.iter().map(|s| (s.name.as_str(), s)).collect();
        let mut params = Vec::new();
        let mut names = HashMap::new();
        let mut paths = HashMap::new();
        let mut vocab_start = 0;
        let mut vocab_local = 0;
        let d_model = specs.iter().find(|s| s.name == "norm.weight").map_or(0, |s| s.shape[0]);
        for (local, id, shape) in crate::parallel::param_paths(&stage) {
            let name = stage.global_name(&local);
            let spec = by_name
                .get(name.as_str())
                .ok_or_else(|| EngineError::Shard(ShardError::Missing(format!("spec for stage parameter `{name}`"))))?;
            let role = match spec.tp {
                TpSplit::Split { .. } => Role::Sharded,
                TpSplit::Replicated => Role::TpReplicated,
            };
            let tied = matches!(spec.placement, Placement::FirstAndLast) && dims.pp > 1;
            params.push(ParamInfo { id, role, mirror: tied && plan.is_last(), tied_owner: tied && plan.is_first() });
            if name == "embed_tokens.weight" || name == "lm_head.weight" {
                // Vocabulary slice: rows of the embedding, columns of the head.
                let rows = if name == "embed_tokens.weight" { shape[0] } else { shape[1] };
                vocab_local = rows;
                vocab_start = plan.tp_rank * rows;
            }
            paths.insert(id, local.clone());
            names.insert(id, name);
        }
        let optim = adamw_optimizer(&cfg.optim, &stage.no_decay_predicates());
        let gns = GnsEstimator::new(cfg.optim.gns_theta).map_err(|e| EngineError::Train(TrainError::Gns(e)))?;
        Ok(Self {
            rank,
            world,
            tp,
            dp,
            pp,
            mp,
            plan,
            dp_rank,
            stage: Some(stage),
            params,
            names,
            paths,
            optim,
            cfg,
            gns,
            step: 0,
            tokens_seen: 0,
            previous: None,
            device,
            d_model,
            vocab_start,
            vocab_local,
        })
    }

    /// Restores optimizer state, counters, the estimator and the previous gradient.
    fn resume(&mut self, r: RankResume) -> Result<(), EngineError> {
        self.step = r.step;
        self.tokens_seen = r.tokens_seen;
        if let Some(g) = r.gns {
            self.gns = g;
        }
        let ids: HashMap<String, ParamId> = self.names.iter().map(|(id, n)| (n.clone(), *id)).collect();
        let id_of = |name: &str| {
            ids.get(name).copied().ok_or_else(|| EngineError::Shard(ShardError::Missing(format!("optimizer state for `{name}` has no parameter here"))))
        };
        if !r.optim.is_empty() || !r.scalars.is_empty() {
            let mut tensors = Vec::with_capacity(r.optim.len());
            for (name, field, shape, values) in r.optim {
                let id = id_of(&name)?.val();
                let (bytes, shape, dtype) = TensorData::new(values, shape).into_parts();
                tensors.push(burn_pack::Tensor::new(format!("{id}.{field}"), dtype, shape, Some(id), bytes));
            }
            let mut w = burn_pack::Writer::new(tensors);
            for (name, field, v) in r.scalars {
                w = w.with_scalar(&format!("{}.{field}", id_of(&name)?.val()), v);
            }
            for (id, path) in &self.paths {
                w = w.with_metadata(&id.val().to_string(), path);
            }
            let bytes = w.into_bytes().map_err(|e| EngineError::Rank { rank: self.rank, message: format!("optimizer state: {e:?}") })?;
            let fresh = adamw_optimizer(&self.cfg.optim, &self.stage().no_decay_predicates());
            self.optim = fresh.from_bytes(bytes).map_err(|e| EngineError::Rank { rank: self.rank, message: format!("optimizer state: {e}") })?;
        }
        if let Some(prev) = r.previous {
            let mut g = GradientsParams::new();
            for (name, values) in prev {
                let id = id_of(&name)?;
                self.register_named(&mut g, id, values);
            }
            self.previous = Some(g);
        }
        Ok(())
    }

    fn register_named(&self, g: &mut GradientsParams, id: ParamId, values: Vec<f32>) {
        struct V<'a> {
            g: &'a mut GradientsParams,
            id: ParamId,
            values: Option<Vec<f32>>,
            device: Device,
        }
        impl ModuleVisitor for V<'_> {
            fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<D>>) {
                if p.id == self.id {
                    if let Some(v) = self.values.take() {
                        let data = TensorData::new(v, p.val().shape());
                        self.g.register::<D>(p.id, Tensor::from_data(data, &self.device));
                    }
                }
            }
        }
        let device = self.device.clone().inner();
        self.stage().visit(&mut V { g, id, values: Some(values), device });
    }

    /// Optimizer state as (global name, field, shape, values) tensors and (name, field, value)
    /// scalars.
    #[allow(clippy::type_complexity)]
    fn optim_entries(&self) -> Result<(Vec<(String, String, Vec<usize>, Vec<f32>)>, Vec<(String, String, burn_pack::Scalar)>), RankError> {
        let fail = |e: String| RankError::Train(TrainError::Batch(format!("optimizer state: {e}")));
        let bytes = self.optim.into_bytes().map_err(|e| fail(e.to_string()))?;
        let reader = burn_pack::Reader::from_bytes(bytes).map_err(|e| fail(format!("{e:?}")))?;
        let name_of = |key: &str| -> Result<(String, String), RankError> {
            let (id, field) = key.split_once('.').ok_or_else(|| fail(format!("unexpected key {key}")))?;
            let id = ParamId::from(id.parse::<u64>().map_err(|_| fail(format!("unexpected key {key}")))?);
            let name = self.names.get(&id).ok_or_else(|| fail(format!("state for an unknown parameter {key}")))?;
            Ok((name.clone(), field.to_string()))
        };
        let mut scalars = Vec::new();
        for (k, v) in reader.scalars() {
            let (name, field) = name_of(k)?;
            scalars.push((name, field, *v));
        }
        let mut tensors = Vec::new();
        for t in reader.into_tensors().map_err(|e| fail(format!("{e:?}")))? {
            let (key, dtype, shape, _, bytes) = t.into_parts().map_err(|e| fail(format!("{e:?}")))?;
            let (name, field) = name_of(&key)?;
            let data = TensorData::from_bytes(bytes, shape, dtype);
            let shape = data.shape().to_vec();
            let values: Vec<f32> = data.iter::<f32>().collect();
            tensors.push((name, field, shape, values));
        }
        Ok((tensors, scalars))
    }

    /// Checksums of the loaded parameters and optimizer tensors, keyed `name` and
    /// `name#field`.
    fn checksums(&self) -> Result<Vec<(String, u64)>, EngineError> {
        let mut out: Vec<(String, u64)> = self.params().into_iter().map(|(n, _, v)| (n, crate::reconfig::checksum(&v))).collect();
        let (tensors, _) = self.optim_entries().map_err(|e| EngineError::Rank { rank: self.rank, message: e.to_string() })?;
        out.extend(tensors.into_iter().map(|(n, f, _, v)| (format!("{n}#{f}"), crate::reconfig::checksum(&v))));
        Ok(out)
    }

    /// This rank's state for staging (data only from dp replica 0).
    fn export(&self) -> Result<RankExport, RankError> {
        let exported = self.dp_rank == 0;
        let mut out = RankExport {
            params: Vec::new(),
            optim: Vec::new(),
            scalars: Vec::new(),
            previous: None,
            step: self.step,
            tokens_seen: self.tokens_seen,
            gns: self.gns.clone(),
        };
        if exported {
            out.params = self.params().into_iter().map(|(n, _, v)| (n, v)).collect();
            let (tensors, scalars) = self.optim_entries()?;
            out.optim = tensors.into_iter().map(|(n, f, _, v)| (n, f, v)).collect();
            out.scalars = scalars;
            if let Some(prev) = &self.previous {
                let mut v = Vec::new();
                for p in &self.params {
                    let values = self.flatten(prev, |q| q.id == p.id);
                    v.push((self.names[&p.id].clone(), values));
                }
                out.previous = Some(v);
            }
        }
        Ok(out)
    }

    fn stage(&self) -> &L::Stage {
        self.stage.as_ref().expect("stage present between steps")
    }

    fn params(&self) -> RankParams {
        crate::parallel::named_params(self.stage())
            .into_iter()
            .map(|(path, _, shape, values)| (self.stage().global_name(&path), shape, values))
            .collect()
    }

    fn tokens(&self, batch: &[i64], mb: usize, inputs: bool) -> Tensor<2, Int> {
        let (bm, s) = (self.cfg.micro_batch, self.cfg.seq_len);
        Tensor::from_data(TensorData::new(self.token_rows(batch, mb, inputs), [bm, s]), &self.device)
    }

    /// Micro-batch `mb`'s input (or target) tokens, row-major `[B_m, seq]`.
    fn token_rows(&self, batch: &[i64], mb: usize, inputs: bool) -> Vec<i64> {
        let (bm, s) = (self.cfg.micro_batch, self.cfg.seq_len);
        let a = self.cfg.num_micro_per_replica();
        let first_row = (self.dp_rank * a + mb) * bm;
        let mut v = Vec::with_capacity(bm * s);
        for row in first_row..first_row + bm {
            let seq = &batch[row * (s + 1)..(row + 1) * (s + 1)];
            v.extend_from_slice(if inputs { &seq[..s] } else { &seq[1..] });
        }
        v
    }

    fn leaf(&self, v: &[f32]) -> Tensor<3> {
        let shape = [self.cfg.micro_batch, self.cfg.seq_len, self.d_model];
        Tensor::<3>::from_data(TensorData::new(v.to_vec(), shape), &self.device).require_grad()
    }

    fn constant(&self, v: Vec<f32>, shape: [usize; 3]) -> Tensor<3> {
        Tensor::<3>::from_data(TensorData::new(v, shape), &self.device)
    }

    /// Forward of one micro-batch through this stage; returns the loss share (last stage).
    fn forward(&self, batch: &[i64], mb: usize, fl: &mut InFlight, ctx: &<L::Stage as StageModel>::Ctx) -> Result<f64, RankError> {
        let stage = self.stage();
        let mut h = if self.plan.is_first() {
            let out = stage.embed(self.tokens(batch, mb, true));
            let mut v = host(out.clone());
            self.tp.all_reduce(&mut v, ReduceOp::Sum)?;
            fl.embed_out = Some(out);
            v
        } else {
            fl.activation_in.take().expect("activation received before forward")
        };
        for i in 0..stage.num_blocks() {
            let x = self.leaf(&h);
            let y = stage.block(i, x.clone(), ctx);
            let mut yv = host(y.clone());
            self.tp.all_reduce(&mut yv, ReduceOp::Sum)?;
            for (a, b) in h.iter_mut().zip(&yv) {
                *a += b;
            }
            fl.blocks.push((x, y));
        }
        if !self.plan.is_last() {
            fl.activation_out = Some(h);
            return Ok(0.0);
        }
        let x = self.leaf(&h);
        let z = stage.logits(x.clone());
        let (loss, dz) = self.vocab_parallel_cross_entropy(host(z.clone()), batch, mb)?;
        fl.head = Some((x, z, dz));
        Ok(loss)
    }

    /// Loss share of one micro-batch (summed cross entropy over the step's global target
    /// tokens) and its gradient with respect to this rank's logits slice.
    fn vocab_parallel_cross_entropy(&self, z: Vec<f32>, batch: &[i64], mb: usize) -> Result<(f64, Vec<f32>), RankError> {
        let v = self.vocab_local;
        let rows = z.len() / v;
        let targets = self.token_rows(batch, mb, false);
        let mut max: Vec<f32> = z.chunks(v).map(|r| r.iter().copied().fold(f32::NEG_INFINITY, f32::max)).collect();
        self.tp.all_reduce(&mut max, ReduceOp::Max)?;
        let mut sum_exp: Vec<f32> = z.chunks(v).zip(&max).map(|(r, &m)| r.iter().map(|&x| (x - m).exp()).sum()).collect();
        let mut picked = vec![0f32; rows];
        for (i, &t) in targets.iter().enumerate() {
            let local = t - self.vocab_start as i64;
            if (0..v as i64).contains(&local) {
                picked[i] = z[i * v + local as usize];
            }
        }
        let mut both: Vec<f32> = sum_exp.iter().chain(&picked).copied().collect();
        self.tp.all_reduce(&mut both, ReduceOp::Sum)?;
        sum_exp.copy_from_slice(&both[..rows]);
        let global_tokens = (self.cfg.global_batch * self.cfg.seq_len) as f32;
        let mut loss = 0f64;
        for i in 0..rows {
            loss += f64::from(sum_exp[i].ln() + max[i] - both[rows + i]);
        }
        let mut dz = z;
        for (i, row) in dz.chunks_mut(v).enumerate() {
            let (m, s) = (max[i], sum_exp[i]);
            for x in row.iter_mut() {
                *x = (*x - m).exp() / s / global_tokens;
            }
            let local = targets[i] - self.vocab_start as i64;
            if (0..v as i64).contains(&local) {
                row[local as usize] -= 1.0 / global_tokens;
            }
        }
        Ok((loss / f64::from(global_tokens), dz))
    }

    /// Backward of one micro-batch through this stage; returns its parameter gradients.
    fn backward(&self, fl: &mut InFlight) -> Result<GradientsParams, RankError> {
        let stage = self.stage();
        let mut acc: Option<GradientsParams> = None;
        let add = |g: GradientsParams, acc: &mut Option<GradientsParams>| {
            *acc = Some(grads::add(stage, acc.take(), g));
        };
        let shape = [self.cfg.micro_batch, self.cfg.seq_len, self.d_model];
        let mut g: Vec<f32> = if let Some((x, z, dz)) = fl.head.take() {
            let dims = z.dims();
            let seed = self.constant(dz, dims);
            let grads = (z * seed).sum().backward();
            let dx = x.grad(&grads).map(|t| t.into_data().try_to_vec::<f32>().expect("f32"));
            add(GradientsParams::from_grads(grads, stage), &mut acc);
            let mut dx = dx.unwrap_or_else(|| vec![0.0; shape.iter().product()]);
            self.tp.all_reduce(&mut dx, ReduceOp::Sum)?;
            dx
        } else {
            fl.grad_in.take().expect("gradient received before backward")
        };
        for (x, y) in fl.blocks.drain(..).rev() {
            let seed = self.constant(g.clone(), shape);
            let grads = (y * seed).sum().backward();
            let dx = x.grad(&grads).map(|t| t.into_data().try_to_vec::<f32>().expect("f32"));
            add(GradientsParams::from_grads(grads, stage), &mut acc);
            if let Some(mut dx) = dx {
                self.tp.all_reduce(&mut dx, ReduceOp::Sum)?;
                for (a, b) in g.iter_mut().zip(&dx) {
                    *a += b;
                }
            } else {
                self.tp.all_reduce(&mut vec![0f32; g.len()], ReduceOp::Sum)?;
            }
        }
        if let Some(out) = fl.embed_out.take() {
            let seed = self.constant(g, shape);
            let grads = (out * seed).sum().backward();
            add(GradientsParams::from_grads(grads, stage), &mut acc);
        } else {
            fl.grad_out = Some(g);
        }
        Ok(acc.unwrap_or_default())
    }

    /// Flattens the gradients of the selected parameters, in stage visit order.
    fn flatten(&self, g: &GradientsParams, select: impl Fn(&ParamInfo) -> bool) -> Vec<f32> {
        let wanted: Vec<ParamId> = self.params.iter().filter(|p| select(p)).map(|p| p.id).collect();
        struct V<'a> {
            g: &'a GradientsParams,
            wanted: &'a [ParamId],
            out: Vec<f32>,
        }
        impl ModuleVisitor for V<'_> {
            fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<D>>) {
                if self.wanted.contains(&p.id) {
                    match self.g.get::<D>(p.id) {
                        Some(t) => self.out.extend(t.into_data().try_to_vec::<f32>().expect("f32 gradient")),
                        None => self.out.extend(std::iter::repeat_n(0f32, p.val().shape().num_elements())),
                    }
                }
            }
        }
        let mut v = V { g, wanted: &wanted, out: Vec::new() };
        self.stage().visit(&mut v);
        v.out
    }

    /// Writes `values` (as laid out by [`Self::flatten`]) back into `g`.
    fn unflatten(&self, g: &mut GradientsParams, select: impl Fn(&ParamInfo) -> bool, values: &[f32]) {
        let wanted: Vec<ParamId> = self.params.iter().filter(|p| select(p)).map(|p| p.id).collect();
        struct V<'a> {
            g: &'a mut GradientsParams,
            wanted: &'a [ParamId],
            values: &'a [f32],
            at: usize,
            device: Device,
        }
        impl ModuleVisitor for V<'_> {
            fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<D>>) {
                if self.wanted.contains(&p.id) {
                    let shape = p.val().shape();
                    let n = shape.num_elements();
                    let device = self.g.remove::<D>(p.id).map_or_else(|| self.device.clone(), |t| t.device());
                    let data = TensorData::new(self.values[self.at..self.at + n].to_vec(), shape);
                    self.g.register::<D>(p.id, Tensor::from_data(data, &device));
                    self.at += n;
                }
            }
        }
        let device = self.device.clone().inner();
        let mut v = V { g, wanted: &wanted, values, at: 0, device };
        self.stage().visit(&mut v);
    }

    /// Squared norm of the counted parameters' gradients on this rank.
    fn local_sq_norm(&self, g: &GradientsParams) -> f64 {
        let tp_rank = self.plan.tp_rank;
        self.flatten(g, |p| p.counted(tp_rank)).iter().map(|&x| f64::from(x) * f64::from(x)).sum()
    }

    fn step(&mut self, batch: &[i64]) -> Result<EngineStep, RankError> {
        let start = Instant::now();
        let dims = self.cfg.dims;
        let a = self.cfg.num_micro_per_replica();
        let n_total = self.cfg.global_batch / self.cfg.micro_batch;
        let actions = build_schedule(self.cfg.schedule, dims.pp, a).map_err(|e| TrainError::Batch(e.to_string()))?;
        let my_actions = actions[self.plan.stage].clone();
        let ctx = self.stage().context(self.cfg.seq_len);
        let mut flights: Vec<InFlight> = (0..a).map(|_| InFlight::default()).collect();
        let (prev, next) = (self.plan.stage.wrapping_sub(1), self.plan.stage + 1);
        let mut loss = 0f64;
        let mut micro_sq = vec![0f64; n_total + 1];
        let mut acc: Option<GradientsParams> = None;
        let tp_rank = self.plan.tp_rank;
        for action in my_actions {
            match action {
                Action::RecvActivation { mb } => flights[mb].activation_in = Some(self.pp.recv(prev, TAG_ACT)?),
                Action::Forward { mb } => {
                    let mut fl = std::mem::take(&mut flights[mb]);
                    loss += self.forward(batch, mb, &mut fl, &ctx)?;
                    flights[mb] = fl;
                }
                Action::SendActivation { mb } => {
                    let v = flights[mb].activation_out.take().expect("forward before send");
                    self.pp.send(next, TAG_ACT, v)?;
                }
                Action::RecvGrad { mb } => flights[mb].grad_in = Some(self.pp.recv(next, TAG_GRAD)?),
                Action::Backward { mb } => {
                    let mut fl = std::mem::take(&mut flights[mb]);
                    let mut g = self.backward(&mut fl)?;
                    flights[mb].grad_out = fl.grad_out.take();
                    // tp-replicated parameters: sum the partial gradients over tp.
                    if dims.tp > 1 {
                        let mut rep = self.flatten(&g, |p| p.role == Role::TpReplicated);
                        if !rep.is_empty() {
                            self.tp.all_reduce(&mut rep, ReduceOp::Sum)?;
                            self.unflatten(&mut g, |p| p.role == Role::TpReplicated, &rep);
                        }
                    }
                    // A tied embedding across stages: the last stage's share goes to the first.
                    if self.params.iter().any(|p| p.mirror) {
                        let share = self.flatten(&g, |p| p.mirror);
                        let zeros = vec![0.0; share.len()];
                        self.pp.send(0, TAG_TIED, share)?;
                        self.unflatten(&mut g, |p| p.mirror, &zeros);
                    }
                    if self.params.iter().any(|p| p.tied_owner) {
                        let share = self.pp.recv(dims.pp - 1, TAG_TIED)?;
                        let mut own = self.flatten(&g, |p| p.tied_owner);
                        for (o, s) in own.iter_mut().zip(&share) {
                            *o += s;
                        }
                        self.unflatten(&mut g, |p| p.tied_owner, &own);
                    }
                    // This micro-batch's gradient is its share of the step mean: its own mean
                    // gradient is n_total times it (equal tokens per micro-batch).
                    micro_sq[self.dp_rank * a + mb] = self.local_sq_norm(&g) * (n_total * n_total) as f64;
                    acc = Some(grads::add(self.stage(), acc.take(), g));
                }
                Action::SendGrad { mb } => {
                    let v = flights[mb].grad_out.take().expect("backward before send");
                    self.pp.send(prev, TAG_GRAD, v)?;
                }
            }
        }
        let mut acc = acc.unwrap_or_default();
        // The tied embedding's summed gradient goes back to the mirror.
        if self.params.iter().any(|p| p.tied_owner) {
            let full = self.flatten(&acc, |p| p.tied_owner);
            self.pp.send(dims.pp - 1, TAG_TIED_SUM, full)?;
        }
        if self.params.iter().any(|p| p.mirror) {
            let full = self.pp.recv(0, TAG_TIED_SUM)?;
            self.unflatten(&mut acc, |p| p.mirror, &full);
        }
        // Per-micro-batch norms and the loss, summed over every rank.
        micro_sq[n_total] = if self.plan.is_last() && tp_rank == 0 { loss } else { 0.0 };
        self.world.all_reduce(&mut micro_sq, ReduceOp::Sum)?;
        let loss = micro_sq[n_total];
        let mean_micro_sq_norm = micro_sq[..n_total].iter().sum::<f64>() / n_total as f64;
        // Data parallel: bucketed all-reduce of the flattened gradients.
        if dims.dp > 1 {
            let mut flat = self.flatten(&acc, |_| true);
            for chunk in flat.chunks_mut(self.cfg.bucket_elems) {
                self.dp.all_reduce(chunk, ReduceOp::Sum)?;
            }
            self.unflatten(&mut acc, |_| true, &flat);
        }
        let mut sq = [self.local_sq_norm(&acc), 0.0];
        if n_total == 1 {
            if let Some(p) = &self.previous {
                let now = self.flatten(&acc, |q| q.counted(tp_rank));
                let before = self.flatten(p, |q| q.counted(tp_rank));
                sq[1] = now.iter().zip(&before).map(|(x, y)| f64::from(x - y) * f64::from(x - y)).sum();
            }
        }
        self.mp.all_reduce(&mut sq, ReduceOp::Sum)?;
        let grad_sq_norm = sq[0];
        let diff = (n_total == 1 && self.previous.is_some()).then_some(sq[1]);
        let stats = StepStats {
            micro_batch: self.cfg.micro_batch,
            num_micro: n_total,
            mean_micro_sq_norm,
            grad_sq_norm,
            diff_sq_norm: diff,
        };
        if !loss.is_finite() {
            return Err(TrainError::NonFinite(loss, self.step).into());
        }
        self.gns.observe(&stats)?;
        let stage = self.stage.take().expect("stage present");
        if n_total == 1 {
            self.previous = Some(grads::scaled(&stage, &acc, 1.0));
        }
        let grad_norm = grad_sq_norm.sqrt();
        let grads = match self.cfg.optim.clip_norm {
            Some(c) if grad_norm > c => grads::scaled(&stage, &acc, c / grad_norm),
            _ => acc,
        };
        let est = self.gns.estimate();
        let phi = est.and_then(|e| e.b_simple());
        let lr = self.cfg.optim.lr_at(self.step, self.cfg.global_batch, phi);
        self.stage = Some(self.optim.step(lr, stage, grads));
        self.step += 1;
        self.tokens_seen += (self.cfg.global_batch * self.cfg.seq_len) as u64;
        Ok(EngineStep {
            metrics: StepMetrics {
                step: self.step,
                loss,
                lr,
                global_batch: self.cfg.global_batch,
                micro_batch: self.cfg.micro_batch,
                num_micro: n_total,
                tokens_seen: self.tokens_seen,
                step_time: start.elapsed().as_secs_f64(),
                grad_norm,
                grad_sq: est.map(|e| e.grad_sq),
                trace: est.map(|e| e.trace),
                b_simple: phi,
                gns_biased: est.is_some_and(|e| e.biased),
            },
            stats,
        })
    }
}
