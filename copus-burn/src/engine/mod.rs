//! The 3D-parallel engine: one worker thread per rank, each with its own device and its shard
//! of the model, training in lock-step.
//!
//! One optimizer step with layout (dp, tp, pp), global batch B_g and micro-batch B_m:
//! - dp replica `d` takes sequences `[d * a * B_m, (d + 1) * a * B_m)` of the step's batch as
//!   `a = B_g / (dp * B_m)` micro-batches, in order, so global micro-batch `d * a + k` is the
//!   same data serial training sees as its micro-batch `d * a + k`;
//! - each stage runs copus-core's pipeline schedule (1F1B or GPipe). Under tensor parallelism
//!   a micro-batch goes through *regions* whose inputs are detached leaves: the embedding, one
//!   region per residual branch, and the head. Between regions the engine sums partial outputs
//!   over the tp group (forward) and partial input gradients over the tp group (backward):
//!   Megatron's f/g pair without custom autodiff ops, through host buffers (Flex). On a
//!   device, and on Flex without tensor parallelism, the stage is one autodiff graph on the
//!   rank's device, the f/g pair its operations (`tp_graph`); on a device under activation
//!   checkpointing each checkpointed segment is a graph of its own. Activations and their gradients
//!   cross stages by send/recv (as tensors, where they lie, between stages run as one graph);
//! - the loss is the vocabulary-parallel cross entropy (at tp = 1, the plain one on the
//!   device) normalised by the step's global number of target tokens, so gradients do not
//!   depend on how B_g is split;
//! - after the last micro-batch, gradients are all-reduced over dp: as one tensor added where
//!   the ranks' gradients lie on a device, in flat host buckets where they lie in host memory
//!   (with ZeRO-1, reduce-scattered instead, each replica updating its chunk; see `zero`);
//! - the gradient-noise probe sums each micro-batch's squared gradient norm over the tp and pp
//!   shards (tp-replicated parameters and a tied embedding counted once) and the norm of the
//!   reduced gradient over the model-parallel ranks, so copus-core's estimator sees exactly the
//!   numbers serial training would give it.
//!
//! Files: [`config`] and [`error`]; `messages` (a leaf: commands, replies, a step's report,
//! the live-change messages, the MPI control header); `cluster` (rank threads, start-up and
//! verification); `rank` (one rank's state: build, resume, export); `regions` (a stage's
//! forward and backward: one graph, checkpointed segments, or Flex's tensor-parallel regions,
//! and the vocabulary-parallel loss); `executor` (one step: the
//! pipeline schedule, dp reduction, the probe, the update); `evaluate` (a held-out loss on the
//! running ranks, forward only); `grad_index` (gradients by
//! parameter selection); `live` (the rank side of live layout changes; the driver side is
//! `crate::reconfig`); `zero` (ZeRO-1: the optimizer state sharded over dp); `processes` (feature `mpi`: ranks on other processes, and what a serving
//! process runs); `fault` (faults planted by the rollback, divergence and timeout tests,
//! feature `fault-injection`). No two of them import each other.

mod cluster;
pub mod config;
pub mod error;
mod evaluate;
mod executor;
mod fault;
mod grad_index;
mod live;
pub(crate) mod messages;
#[cfg(feature = "mpi")]
mod processes;
mod rank;
mod regions;
mod tp_graph;
mod zero;

use std::collections::HashMap;
use std::sync::Arc;

use copus_core::gns::GnsEstimator;
use copus_core::model::ParamSpec;

pub use config::{EngineConfig, RankDevice};
pub use error::{EngineError, ReconfigPhase};
pub(crate) use fault::Fault;
#[cfg(feature = "mpi")]
pub use processes::{finish, serve};

use crate::parallel::{FullParams, ParallelLm};
use crate::state::TrainingState;
use crate::trainer::TrainError;
use cluster::Cluster;
use messages::{Command, Reply};
pub use messages::{EngineStep, RankParams};

/// The parallel trainer.
pub struct Engine<L: ParallelLm> {
    model: Arc<L>,
    cfg: EngineConfig,
    specs: Vec<ParamSpec>,
    cluster: Option<Cluster>,
    dead: Option<String>,
    gns: GnsEstimator,
    steps_done: u64,
    tokens_seen: u64,
    fault: Fault,
    /// Step faults planted by the tests.
    #[cfg(feature = "fault-injection")]
    planted: fault::PlantedSteps,
    /// Where an emergency checkpoint goes when a failed reconfiguration cannot roll back.
    emergency_dir: Option<std::path::PathBuf>,
    /// The caller's entries an emergency checkpoint carries (the driver's position), so it can be
    /// resumed like a whole-run checkpoint.
    emergency_extra: std::collections::BTreeMap<String, String>,
}

impl EngineConfig {
    /// Starts one worker per rank, each holding its shard of `full`.
    pub fn init<L: ParallelLm>(self, model: Arc<L>, full: &FullParams) -> Result<Engine<L>, EngineError> {
        Engine::new(model, full, self)
    }
}

impl<L: ParallelLm> Engine<L> {
    /// Starts one worker per rank of `cfg.dims`, each holding its shard of `full`.
    pub fn new(model: Arc<L>, full: &FullParams, cfg: EngineConfig) -> Result<Self, EngineError> {
        let gns = cfg.optim.gns_estimator().map_err(|e| EngineError::Train(TrainError::Gns(e)))?;
        let state = TrainingState::fresh(&model.spec(), full, gns)?;
        Self::from_state(model, &state, cfg)
    }

    /// Starts the ranks of `cfg.dims` from a staged or loaded training state (any layout's).
    pub fn from_state(model: Arc<L>, state: &TrainingState, cfg: EngineConfig) -> Result<Self, EngineError> {
        let specs = model.spec().param_specs();
        state.check(&specs)?;
        let mut engine = Self {
            model,
            cfg: cfg.clone(),
            specs,
            cluster: None,
            dead: None,
            gns: state.gns.clone(),
            steps_done: state.step,
            tokens_seen: state.tokens_seen,
            fault: Fault::none(),
            #[cfg(feature = "fault-injection")]
            planted: fault::PlantedSteps::default(),
            emergency_dir: None,
            emergency_extra: Default::default(),
        };
        engine.check_target(&cfg)?;
        engine.cluster = Some(Cluster::launch(&engine.model, &engine.specs, state, &cfg, Fault::none())?);
        Ok(engine)
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

    /// Training tokens consumed.
    pub fn tokens_seen(&self) -> u64 {
        self.tokens_seen
    }

    /// The noise-scale estimator (identical on every rank).
    pub fn gns(&self) -> &GnsEstimator {
        &self.gns
    }

    /// Makes the next layout change fail at `phase` (rollback tests).
    #[cfg(feature = "fault-injection")]
    pub fn inject_fault(&mut self, phase: Option<ReconfigPhase>) {
        self.fault = Fault::at_phase(phase);
    }

    /// Makes the next layout change fail at `phase` and the rollback after it fail too (the
    /// emergency-checkpoint test).
    #[cfg(feature = "fault-injection")]
    pub fn inject_fault_with_failed_rollback(&mut self, phase: ReconfigPhase) {
        self.fault = Fault::with_failed_rollback(phase);
    }

    /// Makes world rank `rank` hang (sleep, without ever replying) in the next step: the other
    /// ranks' waits time out (the timeout tests).
    #[cfg(feature = "fault-injection")]
    pub fn inject_stall(&mut self, rank: usize) {
        self.planted.stall = Some(rank);
    }

    /// Makes world rank `rank` panic in the middle of the step after `at_step` steps (the
    /// recovery tests).
    #[cfg(feature = "fault-injection")]
    pub fn inject_panic(&mut self, at_step: u64, rank: usize) {
        self.planted.crash = Some((at_step, rank));
    }

    /// Makes world rank `rank` panic in the step after `at_step` steps as its device is lost:
    /// from then on no launch may start more ranks than the world has now, less one.
    #[cfg(feature = "fault-injection")]
    pub fn inject_device_loss(&mut self, at_step: u64, rank: usize) {
        self.planted.crash = Some((at_step, rank));
        self.planted.max_world = Some(self.cfg.dims.world_size().saturating_sub(1));
    }

    /// The folder for an emergency checkpoint: written only when a failed layout change cannot
    /// roll back, as the one intact copy of the state (default: the system's temporary folder).
    pub fn set_emergency_dir(&mut self, dir: impl Into<std::path::PathBuf>) {
        self.emergency_dir = Some(dir.into());
    }

    /// The caller's entries the next emergency checkpoint carries beside the training state.
    pub fn set_emergency_extra(&mut self, extra: std::collections::BTreeMap<String, String>) {
        self.emergency_extra = extra;
    }

    /// The entries set by [`Engine::set_emergency_extra`].
    pub(crate) fn emergency_extra(&self) -> &std::collections::BTreeMap<String, String> {
        &self.emergency_extra
    }

    /// Where the emergency checkpoint of step `step` goes.
    pub(crate) fn emergency_path(&self, step: u64) -> std::path::PathBuf {
        let dir = self.emergency_dir.clone().unwrap_or_else(std::env::temp_dir);
        dir.join(format!("copus-emergency-step-{step:08}-{}.bpk", std::process::id()))
    }

    /// Writes a NaN into the gradient of the next `count` steps once `steps_done()` reaches
    /// `from` (divergence tests).
    #[cfg(feature = "fault-injection")]
    pub fn inject_nan_gradients(&mut self, from: u64, count: u64) {
        self.planted.poison = (from, count);
    }

    fn cluster(&mut self) -> Result<&Cluster, EngineError> {
        if let Some(d) = &self.dead {
            return Err(EngineError::Dead(d.clone()));
        }
        self.cluster.as_ref().ok_or_else(|| EngineError::Dead("no ranks are running".into()))
    }

    /// Sends every rank a command and collects the replies in rank order; a failure marks the
    /// engine dead.
    pub(crate) fn broadcast(&mut self, make: impl Fn() -> Command) -> Result<Vec<Reply>, EngineError> {
        let result = self.cluster()?.broadcast(make);
        if let Err(e) = &result {
            self.dead = Some(e.to_string());
        }
        result
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
        self.check_tokens(&batch)?;
        let batch = Arc::new(batch);
        #[cfg(feature = "fault-injection")]
        let fault = self.planted.next(self.steps_done);
        #[cfg(not(feature = "fault-injection"))]
        let fault = fault::StepFault;
        let replies = self.broadcast(|| Command::Step(batch.clone(), fault))?;
        // The ranks this process drives answer with their steps (under mpirun the other
        // processes' placeholders carry none).
        let mut steps = replies.into_iter().filter_map(|r| match r {
            Reply::Step(s) => Some(s),
            _ => None,
        });
        let Some(mut step) = steps.next() else { unreachable!("a step reply per rank") };
        for other in steps {
            step.host.add(&other.host);
            step.host_rank_max = step.host_rank_max.max(other.host_rank_max);
        }
        if step.skipped {
            tracing::warn!(
                "step {}: loss {} and gradient norm {} are not all finite; the update was skipped",
                self.steps_done + 1,
                step.metrics.loss,
                step.metrics.grad_norm
            );
            return Ok(*step);
        }
        self.gns.observe(&step.stats).map_err(|e| EngineError::Train(TrainError::Gns(e)))?;
        self.steps_done += 1;
        self.tokens_seen = step.metrics.tokens_seen;
        Ok(*step)
    }

    /// The mean loss per target token over held-out `windows` (whole sequences of `seq_len + 1`
    /// tokens, row-major, any number of them), computed by the running ranks on their devices
    /// in micro-batches of at most `micro` sequences per data-parallel replica. Nothing is
    /// trained; no parameter is gathered.
    pub fn evaluate(&mut self, windows: Vec<i64>, micro: usize) -> Result<f64, EngineError> {
        let per = self.cfg.seq_len + 1;
        if windows.is_empty() || !windows.len().is_multiple_of(per) {
            return Err(EngineError::Batch(format!("an evaluation takes whole sequences of {per} tokens; got {} values", windows.len())));
        }
        if micro == 0 {
            return Err(EngineError::Batch("an evaluation's micro-batch must hold at least one sequence".into()));
        }
        self.check_tokens(&windows)?;
        let windows = Arc::new(windows);
        let replies = self.broadcast(|| Command::Evaluate(windows.clone(), micro))?;
        // Every rank this process drives has the reduced value (placeholders from other processes).
        replies
            .into_iter()
            .find_map(|r| match r {
                Reply::Evaluated(loss) => Some(loss),
                _ => None,
            })
            .ok_or_else(|| EngineError::Dead("no rank answered the evaluation".into()))
    }

    fn check_tokens(&self, ids: &[i64]) -> Result<(), EngineError> {
        let vocab = self.model.spec().vocab_size as i64;
        match ids.iter().find(|&&t| t < 0 || t >= vocab) {
            Some(t) => Err(EngineError::Batch(format!("token id {t} is outside the vocabulary 0..{vocab}"))),
            None => Ok(()),
        }
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

    /// Stages the whole training state in host memory (the ranks keep running).
    pub fn stage_state(&mut self) -> Result<TrainingState, EngineError> {
        let replies = self.broadcast(|| Command::Export)?;
        let exports = replies
            .into_iter()
            .map(|r| match r {
                Reply::Export(e) => *e,
                _ => unreachable!("export reply"),
            })
            .collect();
        Ok(TrainingState::from_exports(exports, &self.specs, self.cfg.dims, self.model.spec().num_layers)?)
    }

    /// The full parameters, reassembled from dp replica 0's shards (through the staging path).
    pub fn gather(&mut self) -> Result<HashMap<String, Vec<f32>>, EngineError> {
        Ok(self.stage_state()?.params.into_iter().collect())
    }

    // The narrow crate API that reconfiguration and checkpoints use.

    /// The model's parameter specs.
    pub(crate) fn specs(&self) -> &[ParamSpec] {
        &self.specs
    }

    /// Checks a configuration against the model before any rank is touched.
    pub(crate) fn check_target(&self, cfg: &EngineConfig) -> Result<(), EngineError> {
        cfg.validate()?;
        cfg.dims.check_model(&self.model.spec()).map_err(|e| EngineError::Layout { dims: cfg.dims.to_string(), reason: e.to_string() })
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

    /// Stops the running ranks (their process groups go with them).
    pub(crate) fn stop_ranks(&mut self) {
        if let Some(mut c) = self.cluster.take() {
            c.stop();
        }
    }

    /// Stops the running ranks and starts those of `cfg` from `state`, verified. On success
    /// the engine runs `cfg`; on failure no rank runs.
    pub(crate) fn relaunch(&mut self, state: &TrainingState, cfg: &EngineConfig, fault: Fault) -> Result<(), EngineError> {
        self.stop_ranks();
        #[cfg(feature = "fault-injection")]
        if let Some(max) = self.planted.max_world.filter(|&m| cfg.dims.world_size() > m) {
            return Err(EngineError::Device(format!("{} ranks asked for, but only {max} devices are left", cfg.dims.world_size())));
        }
        let cluster = Cluster::launch(&self.model, &self.specs, state, cfg, fault)?;
        self.cluster = Some(cluster);
        self.cfg = cfg.clone();
        self.dead = None;
        self.gns = state.gns.clone();
        self.steps_done = state.step;
        self.tokens_seen = state.tokens_seen;
        Ok(())
    }

    /// Whether every rank is a thread of this process.
    pub(crate) fn runs_locally(&self) -> bool {
        self.dead.is_none() && self.cluster.as_ref().is_some_and(Cluster::is_local)
    }

    /// The running ranks' world communicator's abort handle (`None` without running ranks).
    pub(crate) fn rank_world(&self) -> Option<&crate::comm::threads::AbortHandle> {
        self.cluster.as_ref().and_then(Cluster::world)
    }

    /// After a live change to `target` committed: the ranks beyond its world retire and the
    /// engine runs `target`.
    pub(crate) fn adopt_live(&mut self, target: &EngineConfig) {
        if let Some(cluster) = self.cluster.as_mut() {
            cluster.retire_from(target.dims.world_size());
        }
        self.cfg = target.clone();
    }

    /// Whether an earlier failure left the engine unusable.
    pub(crate) fn is_dead(&self) -> bool {
        self.dead.is_some() || self.cluster.is_none()
    }

    /// Marks the engine unusable with a reason.
    pub(crate) fn mark_dead(&mut self, message: &str) {
        self.dead = Some(message.to_string());
    }

    /// The planted fault, consumed.
    pub(crate) fn take_fault(&mut self) -> Fault {
        std::mem::take(&mut self.fault)
    }
}
