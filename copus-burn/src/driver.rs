//! The adaptive training loop, written once: step -> observe -> decide -> validate ->
//! reconfigure at the step boundary -> next step.
//!
//! A [`Driver`] owns the engine, the run's candidate space and the position in the data. Each
//! [`Driver::step`] takes the next B_g sequences from a [`DataSource`] (by sample index, so a run
//! is a pure function of its seed), trains one step, hands the measured noise estimate and
//! samples/s to a [`DecisionSource`], checks the decision against the candidate space (a target
//! outside it is refused with its reason, and training goes on unchanged), reconfigures, and
//! reports the measured cost of the switch back to the source. The embedded orchestrator, a
//! remote service client and a scripted list of decisions are all decision sources.
//!
//! Divergence: a step whose loss or gradient norm is not finite changes nothing (the engine
//! skips the update) and is counted. After [`Divergence::max_bad_steps`] such steps in a row the
//! driver goes back to its last snapshot of the training state (taken every
//! [`Divergence::snapshot_every`] steps, in host memory, and at every whole-run checkpoint),
//! halves the learning rate and goes on; when that has happened [`Divergence::max_restores`]
//! times it stops with [`DriverError::Diverged`].
//!
//! Recovery: a step that fails because a rank failed (a panic, a collective that timed out, a
//! process gone) leaves the engine dead. With [`Driver::with_recoveries`] the driver then
//! rebuilds the engine from its last snapshot, in the snapshot's layout or, when that cannot
//! start (a device gone), in a layout of fewer ranks ([`Driver::with_smaller_worlds`]), redoes
//! the lost steps from the snapshot's data position and reports a [`RecoveryRecord`]. Training
//! that keeps diverging past its restores is recovered the same way, at a halved learning rate.
//! The recoveries are bounded; past the bound the failure is the step's error.
//!
//! Whole-run checkpoints ([`Driver::save_checkpoint`], [`Driver::resume`]) hold the training
//! state in its layout, the engine configuration (with the learning rate reached), the run's
//! [`Position`] (data, clock, divergence counters) and what the decision source learned, so a
//! resumed run takes the same steps and decisions as one that was never stopped.

use std::collections::BTreeMap;
use std::time::Instant;

use copus_core::candidates::{Candidate, Enumeration};
use copus_core::decision::DecisionSource;
use copus_core::policy::StepObservation;
use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::engine::{Engine, EngineConfig, EngineError, EngineStep, Fault};
use crate::parallel::ParallelLm;
use crate::state::TrainingState;

/// Where the sequences come from: sequence `i` of the run's sample order, always the same.
pub trait DataSource {
    /// Sequences `first..first + count`, each `seq_len + 1` tokens, row-major.
    fn sequences(&self, first: u64, count: usize) -> Vec<i64>;
}

/// Why the driver refuses a configuration: the candidate space's reason.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
#[error("{0}")]
pub struct Refusal(pub String);

/// How the run's time is counted.
pub enum Clock {
    /// What this machine took.
    Wall,
    /// A throughput model: a step of candidate `c` takes `step_secs(c)`; switches cost the given
    /// seconds (batch-only, layout). The training math is real either way.
    Modelled {
        /// Seconds per step of a candidate.
        step_secs: Box<dyn Fn(&Candidate) -> f64>,
        /// Seconds a batch-only change costs.
        batch_switch_secs: f64,
        /// Seconds a layout change costs.
        layout_switch_secs: f64,
    },
}

/// How the driver handles steps whose loss or gradient norm is not finite.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Divergence {
    /// Skipped steps in a row that trigger a restore.
    pub max_bad_steps: u32,
    /// Steps between snapshots of the training state (in host memory).
    pub snapshot_every: u64,
    /// Restores before the run stops.
    pub max_restores: u32,
}

impl Default for Divergence {
    fn default() -> Self {
        Self { max_bad_steps: 3, snapshot_every: 50, max_restores: 2 }
    }
}

/// Where a run stands besides its training state; saved in each whole-run checkpoint.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Position {
    /// The index of the next sequence of the data source.
    pub next_sample: u64,
    /// The run's clock, seconds.
    pub clock_secs: f64,
    /// Divergence restores done.
    pub restores: u32,
    /// Recoveries from failed ranks or past-bound divergence done.
    #[serde(default)]
    pub recoveries: u32,
    /// Non-finite steps in a row at the time of saving.
    pub bad_in_row: u32,
}

/// Keys of the driver's entries in a checkpoint's `extra` map.
const POSITION_KEY: &str = "copus.driver.position";
const SOURCE_KEY: &str = "copus.driver.source";

/// The state the driver goes back to when training diverges.
struct Snapshot {
    state: TrainingState,
    candidate: Candidate,
    next_sample: u64,
}

/// A decision and what became of it; one line of `decisions.jsonl`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DecisionRecord {
    /// The step after which it was made.
    pub step: u64,
    /// The configuration that ran the step.
    pub current: Candidate,
    /// What the source asked for.
    pub proposed: Candidate,
    /// Whether the run now runs `proposed`.
    pub applied: bool,
    /// Why not, when it was refused or failed.
    pub refused: Option<String>,
}

/// Why the driver rebuilt the engine from its snapshot.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum RecoveryCause {
    /// A rank failed: it panicked, reported an error, timed out or vanished.
    Rank {
        /// The first failing rank (`usize::MAX` when not known).
        rank: usize,
        /// What it reported.
        message: String,
    },
    /// The engine failed otherwise (it stopped, or a rank's channel closed).
    Engine(String),
    /// Non-finite steps went on after every divergence restore.
    Diverged,
}

impl std::fmt::Display for RecoveryCause {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Rank { rank, message } => write!(f, "rank {rank} failed: {message}"),
            Self::Engine(message) => write!(f, "the engine failed: {message}"),
            Self::Diverged => write!(f, "non-finite steps past every divergence restore"),
        }
    }
}

/// A recovery: the engine rebuilt from the last snapshot. One line of `decisions.jsonl`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RecoveryRecord {
    /// The step that failed (steps done then, plus one).
    pub failed_step: u64,
    /// Why.
    pub cause: RecoveryCause,
    /// The snapshot's step: training goes on from the step after it.
    pub back_to_step: u64,
    /// Steps trained since the snapshot, done again.
    pub lost_steps: u64,
    /// The configuration that failed.
    pub from: Candidate,
    /// The configuration the engine was rebuilt in (the snapshot's, or one of fewer ranks).
    pub to: Candidate,
    /// Seconds the rebuild took on this machine.
    pub measured_secs: f64,
    /// Seconds the rebuild charged to the run's clock (the lost steps' time is on it already).
    pub clock_secs: f64,
    /// Seconds the failed step charged to the run's clock before it failed (a timeout's wait).
    #[serde(default)]
    pub failed_step_secs: f64,
    /// The learning rate after it (halved after divergence).
    pub lr: f64,
    /// Recoveries done in the run, this one included.
    pub recovery: u32,
}

/// A carried-out switch; one line of `reconfigurations.csv`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SwitchRecord {
    /// The step after which it happened.
    pub step: u64,
    /// Before.
    pub from: Candidate,
    /// After.
    pub to: Candidate,
    /// Whether the layout changed (else only B_g / B_m).
    pub layout_changed: bool,
    /// Seconds measured on this machine.
    pub measured_secs: f64,
    /// Seconds charged to the run's clock.
    pub clock_secs: f64,
    /// Bytes copied: the reshard plan's pieces (live) or the staged state.
    pub bytes: u64,
    /// Whether the ranks stayed up and exchanged only their slices (else the state was staged).
    pub live: bool,
}

/// What one driver step did.
#[derive(Clone, Debug, PartialEq)]
pub struct DriverStep {
    /// The engine's step.
    pub step: EngineStep,
    /// The configuration that ran it.
    pub candidate: Candidate,
    /// The run's clock at the end of the step.
    pub step_clock_secs: f64,
    /// The run's clock after the step and the switch that followed it, if any.
    pub clock_secs: f64,
    /// Samples/s of the step on the run's clock (measured on the wall clock).
    pub samples_per_sec: f64,
    /// The decision that followed, unless it was to keep the configuration.
    pub decision: Option<DecisionRecord>,
    /// The switch that followed, if one was carried out.
    pub switch: Option<SwitchRecord>,
    /// After too many non-finite steps in a row: the step of the snapshot the run went back
    /// to, with the learning rate halved.
    pub restored: Option<u64>,
    /// The recoveries of this step, in order: the engine rebuilt from its snapshot after a
    /// failed attempt (the step is then the first one trained after them), or after this
    /// skipped step when the divergence restores were used up.
    pub recovered: Vec<RecoveryRecord>,
}

/// Why the loop stopped.
#[derive(Debug, Error)]
pub enum DriverError {
    /// The starting configuration is not one of the run's candidates.
    #[error("the starting configuration {candidate} is not a candidate of the run: {reason}")]
    Start {
        /// The configuration.
        candidate: Candidate,
        /// Why not.
        reason: String,
    },
    /// The engine failed (a failed switch that rolled back is not an error).
    #[error(transparent)]
    Engine(#[from] EngineError),
    /// A whole-run checkpoint cannot continue this run.
    #[error("cannot resume from {path}: {reason}")]
    Resume {
        /// The checkpoint.
        path: String,
        /// Why not.
        reason: String,
    },
    /// A rank failed again after every recovery the run allows.
    #[error("{error} (after {recoveries} recoveries, the most the run allows; raise train.max_recoveries to allow more)")]
    Unrecovered {
        /// The last failure.
        error: EngineError,
        /// Recoveries done.
        recoveries: u32,
    },
    /// Training kept diverging after restores at halved learning rates.
    #[error(
        "training diverged: {bad} steps in a row with a non-finite loss or gradient, again after {restores} restores of the last snapshot at a halved learning rate (now {lr:e}); lower optim.lr or set optim.clip_norm"
    )]
    Diverged {
        /// Bad steps in a row.
        bad: u32,
        /// Restores done.
        restores: u32,
        /// The learning rate reached.
        lr: f64,
    },
}

/// The run's candidate space over a given number of ranks (fewer than it started with).
pub type SmallerWorlds = Box<dyn Fn(usize) -> Enumeration>;

/// The loop's state: engine, candidate space, data position, clock.
pub struct Driver<L: ParallelLm> {
    engine: Engine<L>,
    space: Enumeration,
    current: Candidate,
    next_sample: u64,
    clock: Clock,
    clock_secs: f64,
    divergence: Divergence,
    snapshot: Option<Snapshot>,
    bad_in_row: u32,
    restores: u32,
    recoveries: u32,
    max_recoveries: u32,
    smaller_worlds: Option<SmallerWorlds>,
    /// The next step is the first after a relaunch: its wall time includes warm-up, so its
    /// samples/s are not reported as a measurement.
    warming_up: bool,
    /// The run's time budget on its clock, told to the decision source as the seconds left.
    time_budget_secs: Option<f64>,
}

impl<L: ParallelLm> Driver<L> {
    /// A driver for `engine`, whose configuration must be one of `space.feasible`.
    pub fn new(engine: Engine<L>, space: Enumeration, clock: Clock) -> Result<Self, DriverError> {
        let c = engine.config();
        let current = Candidate::new(c.dims, c.global_batch, c.micro_batch).map_err(|e| DriverError::Start {
            candidate: Candidate { dims: c.dims, global_batch: c.global_batch, micro_batch: c.micro_batch, num_micro: 0 },
            reason: e.to_string(),
        })?;
        let mut driver = Self {
            engine,
            space,
            current,
            next_sample: 0,
            clock,
            clock_secs: 0.0,
            divergence: Divergence::default(),
            snapshot: None,
            bad_in_row: 0,
            restores: 0,
            recoveries: 0,
            max_recoveries: 0,
            smaller_worlds: None,
            warming_up: false,
            time_budget_secs: None,
        };
        driver.check(&current).map_err(|Refusal(reason)| DriverError::Start { candidate: current, reason })?;
        driver.take_snapshot()?;
        Ok(driver)
    }

    /// Writes a whole-run checkpoint to `path` (atomically): the training state in the current
    /// layout, the engine configuration (learning rate included), the run's [`Position`], what
    /// `source` learned, and the caller's `extra` entries. The state written is also the point
    /// a divergence goes back to. Returns the bytes of tensor data written.
    pub fn save_checkpoint(
        &mut self,
        path: &std::path::Path,
        source: &dyn DecisionSource,
        extra: &BTreeMap<String, String>,
    ) -> Result<u64, DriverError> {
        let started = Instant::now();
        let state = self.engine.stage_state()?;
        // Staging is on the clock of the run that continues from this checkpoint too.
        if matches!(self.clock, Clock::Wall) {
            self.clock_secs += started.elapsed().as_secs_f64();
        }
        let writing = Instant::now();
        let extra = self.whole_run_extra(source, extra);
        state.save(path, self.engine.specs(), self.engine.config(), &extra)?;
        let bytes = state.bytes();
        self.snapshot = Some(Snapshot { state, candidate: self.current, next_sample: self.next_sample });
        if matches!(self.clock, Clock::Wall) {
            self.clock_secs += writing.elapsed().as_secs_f64();
        }
        Ok(bytes)
    }

    /// Continues the run saved by [`Driver::save_checkpoint`]: the engine in the saved layout
    /// and configuration, the position, and `source` restored to what it had learned. `space`
    /// and `clock` are the run's (not saved). Returns the caller's `extra` entries too.
    pub fn resume(
        model: std::sync::Arc<L>,
        path: &std::path::Path,
        space: Enumeration,
        clock: Clock,
        source: &mut dyn DecisionSource,
    ) -> Result<(Self, BTreeMap<String, String>), DriverError> {
        Self::resume_with(model, path, space, clock, source, &|cfg| cfg)
    }

    /// [`Driver::resume`] with the saved engine configuration passed through `adjust` first
    /// (for what a resume may change, such as the precision: the saved state is f32 either way).
    pub fn resume_with(
        model: std::sync::Arc<L>,
        path: &std::path::Path,
        space: Enumeration,
        clock: Clock,
        source: &mut dyn DecisionSource,
        adjust: &dyn Fn(EngineConfig) -> EngineConfig,
    ) -> Result<(Self, BTreeMap<String, String>), DriverError> {
        let fail = |reason: String| DriverError::Resume { path: path.display().to_string(), reason };
        let (state, cfg, mut extra) = TrainingState::load(path)?;
        let position: Position = extra
            .remove(POSITION_KEY)
            .ok_or_else(|| fail("not a whole-run checkpoint (no driver position)".into()))
            .and_then(|p| serde_json::from_str(&p).map_err(|e| fail(format!("driver position: {e}"))))?;
        match extra.remove(SOURCE_KEY) {
            Some(s) => source.restore_state(&s).map_err(|e| fail(e.to_string()))?,
            None if source.save_state().is_some() => {
                tracing::warn!("{}: the checkpoint holds no decision state; the policy starts afresh", source.name())
            }
            None => {}
        }
        let engine = Engine::from_state(model, &state, adjust(regrown(cfg, &space)))?;
        let mut driver = Self::new(engine, space, clock)?;
        driver.next_sample = position.next_sample;
        driver.clock_secs = position.clock_secs;
        driver.restores = position.restores;
        driver.recoveries = position.recoveries;
        driver.bad_in_row = position.bad_in_row;
        driver.warming_up = true;
        driver.snapshot = Some(Snapshot { state, candidate: driver.current, next_sample: position.next_sample });
        Ok((driver, extra))
    }

    /// The caller's `extra` entries with the run's position and what `source` learned: what a
    /// whole-run checkpoint holds beside the training state.
    fn whole_run_extra(&self, source: &dyn DecisionSource, extra: &BTreeMap<String, String>) -> BTreeMap<String, String> {
        let mut extra = extra.clone();
        extra.insert(POSITION_KEY.into(), serde_json::to_string(&self.position()).expect("a position serialises"));
        if let Some(s) = source.save_state() {
            extra.insert(SOURCE_KEY.into(), s);
        }
        extra
    }

    /// Where the run stands: the next sample, the clock and the divergence counters.
    pub fn position(&self) -> Position {
        Position {
            next_sample: self.next_sample,
            clock_secs: self.clock_secs,
            restores: self.restores,
            bad_in_row: self.bad_in_row,
            recoveries: self.recoveries,
        }
    }

    /// How non-finite steps are handled.
    pub fn with_divergence(mut self, divergence: Divergence) -> Self {
        self.divergence = divergence;
        self
    }

    /// How many times a failed engine may be rebuilt from the snapshot (none by default: a
    /// failed rank is the step's error).
    pub fn with_recoveries(mut self, max_recoveries: u32) -> Self {
        self.max_recoveries = max_recoveries;
        self
    }

    /// The run's candidate space over fewer ranks, for a recovery whose layout cannot start
    /// again (a device gone): the engine is rebuilt in a layout of the largest smaller world
    /// with the same B_g that starts, and the run goes on in that space.
    pub fn with_smaller_worlds(mut self, smaller: SmallerWorlds) -> Self {
        self.smaller_worlds = Some(smaller);
        self
    }

    /// Recoveries done.
    pub fn recoveries(&self) -> u32 {
        self.recoveries
    }

    /// Stages the state as the point to go back to; its time counts on the wall clock.
    fn take_snapshot(&mut self) -> Result<(), DriverError> {
        let started = Instant::now();
        let state = self.engine.stage_state()?;
        self.snapshot = Some(Snapshot { state, candidate: self.current, next_sample: self.next_sample });
        if matches!(self.clock, Clock::Wall) {
            self.clock_secs += started.elapsed().as_secs_f64();
        }
        Ok(())
    }

    /// Goes back to the last snapshot with the learning rate halved; returns its step. Past
    /// the restores allowed, a recovery (while any is left) does the same.
    fn restore(&mut self, recovered: &mut Vec<RecoveryRecord>) -> Result<u64, DriverError> {
        let lr = self.engine.config().optim.lr;
        if self.restores >= self.divergence.max_restores {
            if self.recoveries >= self.max_recoveries {
                return Err(DriverError::Diverged { bad: self.bad_in_row, restores: self.restores, lr });
            }
            let record = self.recover(RecoveryCause::Diverged, 0.5, None, 0.0)?;
            let back = record.back_to_step;
            recovered.push(record);
            return Ok(back);
        }
        let (c, _, _) = self.back_to_snapshot(lr / 2.0, None)?;
        self.restores += 1;
        let step = self.snapshot_step();
        tracing::warn!("training diverged; back to step {step} in {c} at learning rate {:e} (restore {})", lr / 2.0, self.restores);
        Ok(step)
    }

    /// The step of the last snapshot.
    fn snapshot_step(&self) -> u64 {
        self.snapshot.as_ref().map_or(0, |s| s.state.step)
    }

    /// Rebuilds the engine from the last snapshot at learning rate `lr`: in the snapshot's
    /// configuration, or, when that cannot start and smaller worlds are known, in one of fewer
    /// ranks without `failed_rank`'s device. Sets the data position and the clock; returns the
    /// configuration it runs and the seconds measured and charged.
    fn back_to_snapshot(&mut self, lr: f64, failed_rank: Option<usize>) -> Result<(Candidate, f64, f64), DriverError> {
        let snap = self.snapshot.take().expect("a snapshot is taken at the start");
        let snapshot_world = snap.candidate.dims.world_size();
        let started = Instant::now();
        let result = self.relaunch_from(&snap, lr, failed_rank);
        let measured = started.elapsed().as_secs_f64();
        let next_sample = snap.next_sample;
        self.snapshot = Some(snap);
        let c = result?;
        let charged = match &self.clock {
            Clock::Wall => measured,
            Clock::Modelled { layout_switch_secs, .. } => *layout_switch_secs,
        };
        self.clock_secs += charged;
        self.current = c;
        self.warming_up = true;
        self.next_sample = next_sample;
        self.bad_in_row = 0;
        if c.dims.world_size() != snapshot_world {
            // The old snapshot's layout no longer fits the devices: the point to go back to is
            // the same state in the new layout.
            self.take_snapshot()?;
        }
        Ok((c, measured, charged))
    }

    /// The relaunch of [`Driver::back_to_snapshot`]; returns the configuration that runs.
    fn relaunch_from(&mut self, snap: &Snapshot, lr: f64, failed_rank: Option<usize>) -> Result<Candidate, DriverError> {
        let c = snap.candidate;
        let mut cfg = self.engine.config().clone();
        (cfg.dims, cfg.global_batch, cfg.micro_batch) = (c.dims, c.global_batch, c.micro_batch);
        cfg.optim.lr = lr;
        let first = match self.engine.relaunch(&snap.state, &cfg, Fault::none()) {
            Ok(()) => return Ok(c),
            Err(e) => e,
        };
        let Some(smaller) = &self.smaller_worlds else { return Err(first.into()) };
        let world = c.dims.world_size();
        let mut devices = cfg.devices.clone();
        if devices.len() == world {
            devices.remove(failed_rank.filter(|&r| r < world).unwrap_or(world - 1));
        }
        for w in (1..world).rev() {
            let space = smaller(w);
            let Some(t) = nearest_layout(&space, &c) else { continue };
            (cfg.dims, cfg.micro_batch) = (t.dims, t.micro_batch);
            cfg.devices = devices.iter().take(w).cloned().collect();
            match self.engine.relaunch(&snap.state, &cfg, Fault::none()) {
                Ok(()) => {
                    tracing::warn!("{c} cannot start again ({first}); the run goes on in {t}, {w} of {world} ranks");
                    self.space = space;
                    return Ok(t);
                }
                Err(e) => tracing::warn!("recovery in {t} failed: {e}"),
            }
        }
        Err(first.into())
    }

    /// After a failed step (which charged `failed_step_secs`) or a divergence past its
    /// restores: the engine rebuilt from the snapshot at the learning rate times `lr_factor`,
    /// counted and reported.
    fn recover(
        &mut self,
        cause: RecoveryCause,
        lr_factor: f64,
        failed_rank: Option<usize>,
        failed_step_secs: f64,
    ) -> Result<RecoveryRecord, DriverError> {
        let from = self.current;
        let failed_step = self.engine.steps_done() + 1;
        let lr = self.engine.config().optim.lr * lr_factor;
        let (to, measured_secs, clock_secs) = self.back_to_snapshot(lr, failed_rank)?;
        self.recoveries += 1;
        let back_to_step = self.snapshot_step();
        let record = RecoveryRecord {
            failed_step,
            cause,
            back_to_step,
            lost_steps: failed_step - 1 - back_to_step,
            from,
            to,
            measured_secs,
            clock_secs,
            failed_step_secs,
            lr,
            recovery: self.recoveries,
        };
        tracing::warn!(
            "step {failed_step}: {}; rebuilt from step {back_to_step} in {to} in {measured_secs:.2} s, {} steps to redo (recovery {} of {})",
            record.cause,
            record.lost_steps,
            self.recoveries,
            self.max_recoveries
        );
        Ok(record)
    }

    /// Trains the next step, recovering from failed ranks while recoveries are left: the
    /// step's configuration, the step and its samples/s.
    fn train_recovering(
        &mut self,
        data: &dyn DataSource,
        recovered: &mut Vec<RecoveryRecord>,
    ) -> Result<(Candidate, EngineStep, f64), DriverError> {
        loop {
            let candidate = self.current;
            // Ranks in other processes cannot be rebuilt from here: under mpirun a failed rank
            // ends the job (`MPI_Abort`), and the supervisor (`--max-restarts`) takes over.
            let local = self.engine.runs_locally();
            let started = Instant::now();
            let error = match self.train_step(data) {
                Ok((step, samples_per_sec)) => return Ok((candidate, step, samples_per_sec)),
                Err(DriverError::Engine(e)) if self.engine.is_dead() && local => e,
                Err(e) => return Err(e),
            };
            // The failed step's time is lost; on the wall clock it counts.
            let failed_secs = match &self.clock {
                Clock::Wall => started.elapsed().as_secs_f64(),
                Clock::Modelled { step_secs, .. } => step_secs(&candidate),
            };
            self.clock_secs += failed_secs;
            if self.recoveries >= self.max_recoveries {
                return Err(if self.max_recoveries == 0 {
                    error.into()
                } else {
                    DriverError::Unrecovered { error, recoveries: self.recoveries }
                });
            }
            let (cause, rank) = match error {
                EngineError::Rank { rank, message } => (RecoveryCause::Rank { rank, message }, Some(rank)),
                other => (RecoveryCause::Engine(other.to_string()), None),
            };
            recovered.push(self.recover(cause, 1.0, rank, failed_secs)?);
        }
    }

    /// The engine.
    pub fn engine(&self) -> &Engine<L> {
        &self.engine
    }

    /// The engine, mutably (checkpoints, parameters).
    pub fn engine_mut(&mut self) -> &mut Engine<L> {
        &mut self.engine
    }

    /// The configuration of the next step.
    pub fn current(&self) -> Candidate {
        self.current
    }

    /// The index of the next sequence the data source will be asked for.
    pub fn next_sample(&self) -> u64 {
        self.next_sample
    }

    /// The run's clock, seconds.
    pub fn clock_secs(&self) -> f64 {
        self.clock_secs
    }

    /// The run's time budget on its clock: each step's observation then tells the decision
    /// source the seconds left ([`StepObservation::remaining_secs`]), the horizon over which a
    /// change must repay its cost. `None` (the default): the source keeps its own horizon.
    pub fn set_time_budget(&mut self, secs: Option<f64>) {
        self.time_budget_secs = secs.filter(|s| s.is_finite() && *s > 0.0);
    }

    /// Continues from a saved position (sample index and clock) after a resume.
    pub fn set_position(&mut self, next_sample: u64, clock_secs: f64) -> Result<(), DriverError> {
        self.next_sample = next_sample;
        self.clock_secs = clock_secs;
        // A divergence restore must come back here, not to the position the driver started at.
        self.take_snapshot()
    }

    /// Whether `target` may run: one of the feasible candidates. A refusal names the reason
    /// the enumeration gave, or why it is outside the space.
    pub fn check(&self, target: &Candidate) -> Result<(), Refusal> {
        if self.space.feasible.contains(target) {
            return Ok(());
        }
        let same = |r: &&copus_core::candidates::Rejected| {
            r.dims == target.dims && r.global_batch == target.global_batch && r.micro_batch == target.micro_batch
        };
        if let Some(r) = self.space.rejected.iter().find(same) {
            return Err(Refusal(r.reason.to_string()));
        }
        let mut why = Vec::new();
        let batches: Vec<usize> = self.space.feasible.iter().map(|c| c.global_batch).collect();
        let micros: Vec<usize> = self.space.feasible.iter().map(|c| c.micro_batch).collect();
        if !batches.contains(&target.global_batch) {
            why.push(format!("B_g = {} is not in the run's global batch list", target.global_batch));
        }
        if !micros.contains(&target.micro_batch) {
            why.push(format!("B_m = {} is not in the run's micro-batch list", target.micro_batch));
        }
        if !self.space.feasible.iter().any(|c| c.dims == target.dims) {
            why.push(format!("layout {} is not a layout of the run", target.dims));
        }
        if target.num_micro * target.dims.dp * target.micro_batch != target.global_batch {
            why.push(format!("a = {} does not give B_g = dp * B_m * a", target.num_micro));
        }
        if why.is_empty() {
            why.push("not a candidate of the run".into());
        }
        Err(Refusal(why.join("; ")))
    }

    /// One step on the next B_g sequences, then the decision and, if valid, the switch.
    pub fn step(&mut self, data: &dyn DataSource, source: &mut dyn DecisionSource) -> Result<DriverStep, DriverError> {
        let mut recovered = Vec::new();
        let (candidate, step, samples_per_sec) = self.train_recovering(data, &mut recovered)?;
        let mut out = DriverStep {
            step,
            candidate,
            step_clock_secs: self.clock_secs,
            clock_secs: self.clock_secs,
            samples_per_sec,
            decision: None,
            switch: None,
            restored: None,
            recovered,
        };
        if out.step.skipped {
            self.bad_in_row += 1;
            if self.bad_in_row >= self.divergence.max_bad_steps {
                // The restore is charged to the clock: the step ends after it.
                out.restored = Some(self.restore(&mut out.recovered)?);
                (out.step_clock_secs, out.clock_secs) = (self.clock_secs, self.clock_secs);
            }
            return Ok(out);
        }
        self.bad_in_row = 0;
        if out.step.metrics.step.is_multiple_of(self.divergence.snapshot_every.max(1)) {
            self.take_snapshot()?;
        }
        let remaining_secs = self.time_budget_secs.map(|b| (b - self.clock_secs).max(0.0));
        let obs = StepObservation { step: out.step.metrics.step, current: candidate, noise: self.engine.gns().estimate(), remaining_secs };
        // 0: not measured (the first step after a relaunch pays for warm-up on the wall clock).
        let warm_up = std::mem::take(&mut self.warming_up) && matches!(self.clock, Clock::Wall);
        let proposed = source.on_step(&obs, if warm_up { 0.0 } else { samples_per_sec }).target(candidate);
        if proposed == candidate {
            return Ok(out);
        }
        let mut record = DecisionRecord { step: obs.step, current: candidate, proposed, applied: false, refused: None };
        match self.check(&proposed) {
            Err(Refusal(why)) => {
                tracing::warn!("{}: refused the decision {proposed} after step {}: {why}", source.name(), obs.step);
                record.refused = Some(why);
            }
            Ok(()) => match self.switch(obs.step, proposed, source)? {
                Ok(switch) => {
                    record.applied = true;
                    out.clock_secs = self.clock_secs;
                    out.switch = Some(switch);
                }
                Err(why) => record.refused = Some(why),
            },
        }
        out.decision = Some(record);
        Ok(out)
    }

    /// Trains one step of the current candidate on the next B_g sequences and advances the
    /// data and the clock; returns the step and its samples/s on the run's clock.
    fn train_step(&mut self, data: &dyn DataSource) -> Result<(EngineStep, f64), DriverError> {
        let b = self.current.global_batch;
        let tokens = data.sequences(self.next_sample, b);
        let started = Instant::now();
        let step = self.engine.step(tokens)?;
        let secs = started.elapsed().as_secs_f64();
        self.next_sample += b as u64;
        // Seconds of the step on the run's clock; the decision source sees samples/s on it too.
        let step_secs = match &self.clock {
            Clock::Wall => secs,
            Clock::Modelled { step_secs, .. } => step_secs(&self.current),
        };
        self.clock_secs += step_secs;
        Ok((step, b as f64 / step_secs.max(1e-12)))
    }

    /// Carries out a checked decision after step `step`: the switch's record, or why it failed
    /// (refused before anything changed, or rolled back: the run goes on as it was). An engine
    /// that could not roll back is an error.
    fn switch(
        &mut self,
        step: u64,
        proposed: Candidate,
        source: &mut dyn DecisionSource,
    ) -> Result<Result<SwitchRecord, String>, DriverError> {
        let candidate = self.current;
        let started = Instant::now();
        // Should the change fail and its rollback fail too, the emergency checkpoint continues
        // the run with `Driver::resume` from here, as a whole-run checkpoint would.
        self.engine.set_emergency_extra(self.whole_run_extra(source, &BTreeMap::new()));
        let report = match self.engine.reconfigure(proposed.dims, proposed.global_batch, proposed.micro_batch) {
            Ok(report) => report,
            Err(e) if self.engine.is_dead() => return Err(e.into()),
            Err(e) => {
                tracing::warn!("step {step}: the switch to {proposed} failed, continuing in {candidate}: {e}");
                return Ok(Err(e.to_string()));
            }
        };
        let measured_secs = started.elapsed().as_secs_f64();
        let clock_secs = match &self.clock {
            Clock::Wall => measured_secs,
            Clock::Modelled { batch_switch_secs, layout_switch_secs, .. } => {
                if report.layout_changed {
                    *layout_switch_secs
                } else {
                    *batch_switch_secs
                }
            }
        };
        self.clock_secs += clock_secs;
        source.on_reconfigured(clock_secs, report.layout_changed);
        tracing::info!("step {step}: {candidate} -> {proposed} in {measured_secs:.3} s");
        self.current = proposed;
        self.warming_up = report.layout_changed;
        Ok(Ok(SwitchRecord {
            step,
            from: candidate,
            to: proposed,
            layout_changed: report.layout_changed,
            measured_secs,
            clock_secs,
            bytes: report.bytes,
            live: report.live,
        }))
    }
}

/// A saved configuration of fewer ranks than `space`'s layouts (a run that went on in a
/// smaller world after losing a device) moved to the layout of `space` nearest it: a resume
/// starts the run's whole world again. Any other configuration is left as saved.
fn regrown(mut cfg: EngineConfig, space: &Enumeration) -> EngineConfig {
    let Ok(saved) = Candidate::new(cfg.dims, cfg.global_batch, cfg.micro_batch) else { return cfg };
    let world = space.feasible.first().map_or(0, |c| c.dims.world_size());
    if saved.dims.world_size() >= world || space.feasible.contains(&saved) {
        return cfg;
    }
    if let Some(t) = nearest_layout(space, &saved) {
        tracing::warn!("the run went on in {saved} after losing a device; it resumes in {t}, on all {world} ranks");
        (cfg.dims, cfg.micro_batch) = (t.dims, t.micro_batch);
    }
    cfg
}

/// The candidate of `space` closest to `c`: the same B_g, then the same tp and pp, then the
/// same B_m.
fn nearest_layout(space: &Enumeration, c: &Candidate) -> Option<Candidate> {
    space
        .feasible
        .iter()
        .filter(|t| t.global_batch == c.global_batch)
        .min_by_key(|t| (t.dims.tp != c.dims.tp, t.dims.pp != c.dims.pp, t.micro_batch != c.micro_batch, t.dims.pp, t.dims.tp))
        .copied()
}
