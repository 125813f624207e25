//! One way to assemble a run: a model, a candidate space, a throughput prior or profile, a
//! policy or decision source and the engine's options become a ready [`Driver`].
//!
//! Every entry point (a recipe's main job and its resume, comparisons, profiles, benchmarks,
//! the examples) builds its engine through [`EngineOptions::engine_config`], the one place where
//! the options meet the engine's configuration, so an option set once reaches every engine a
//! run starts. [`JobBuilder`] adds the rest of a run: it scores the candidates by the throughput
//! model, picks the start candidate itself where asked (the fastest layout for a batch), builds
//! the Copus orchestrator where asked, and starts the engine and the driver, fresh or resumed
//! from a run folder.
//!
//! ```no_run
//! # use std::sync::Arc;
//! # fn demo<L: copus_burn::ParallelLm>(model: L, full: &copus_burn::parallel::FullParams,
//! #         space: copus_core::candidates::Enumeration,
//! #         prior: &dyn copus_core::throughput::ThroughputModel) -> Result<(), Box<dyn std::error::Error>> {
//! use copus_burn::{JobBuilder, OptimConfig};
//! use copus_core::policy::CopusRule;
//!
//! let job = JobBuilder::new(Arc::new(model), space, OptimConfig::new().with_b0(8))
//!     .prior(prior)?
//!     .start_batch(8, 4, None)
//!     .copus(CopusRule::default())
//!     .build(full)?;
//! let (mut driver, mut source) = (job.driver, job.orchestrator.expect("asked for"));
//! # let _ = (&mut driver, &mut source);
//! # Ok(()) }
//! ```

use std::path::PathBuf;
use std::sync::Arc;

use copus_core::candidates::{Candidate, Enumeration};
use copus_core::decision::DecisionSource;
use copus_core::layout::ParallelDims;
use copus_core::memory::{Checkpointing, Precision};
use copus_core::orchestrator::Orchestrator;
use copus_core::policy::{CopusRule, PolicyError, Scorer};
use copus_core::schedule::ScheduleKind;
use copus_core::throughput::ThroughputModel;
use thiserror::Error;

use crate::comm::placement::RankDevice;
use crate::driver::{Clock, Driver, DriverError};
use crate::engine::{Engine, EngineConfig, EngineError};
use crate::optim::OptimConfig;
use crate::parallel::{FullParams, ParallelLm};
use crate::run_dir::{RunDir, RunDirError};

/// How the engine runs besides its candidate: every option a run may set. The defaults are
/// [`EngineConfig::new`]'s.
#[derive(Clone, Debug, PartialEq)]
pub struct EngineOptions {
    /// Pipeline schedule.
    pub schedule: ScheduleKind,
    /// The kind of device every rank trains on; spread over the visible devices of that kind
    /// by [`RankDevice::for_ranks`]. Flex (the default) on every rank otherwise.
    pub device: RankDevice,
    /// How many ranks share one device (see [`EngineConfig::ranks_per_device`]).
    pub ranks_per_device: Option<usize>,
    /// Rank-order reductions across processes (see [`EngineConfig::exact_reductions`]).
    pub exact_reductions: bool,
    /// Activation checkpointing.
    pub checkpointing: Checkpointing,
    /// f32, or bf16 products with f32 master weights.
    pub precision: Precision,
    /// ZeRO stage 1 over the data-parallel replicas.
    pub zero1: bool,
}

impl Default for EngineOptions {
    fn default() -> Self {
        Self {
            schedule: ScheduleKind::OneFOneB,
            device: RankDevice::Flex,
            ranks_per_device: None,
            exact_reductions: false,
            checkpointing: Checkpointing::None,
            precision: Precision::F32,
            zero1: false,
        }
    }
}

impl EngineOptions {
    /// The engine's configuration for candidate `c`: the one place where the options are
    /// applied.
    pub fn engine_config(&self, c: &Candidate, seq_len: usize, optim: OptimConfig) -> EngineConfig {
        self.engine_config_of(c.dims, (c.global_batch, c.micro_batch), seq_len, optim)
    }

    /// [`EngineOptions::engine_config`] for a layout and (B_g, B_m) that need not be a
    /// candidate of a space (benchmarks).
    pub fn engine_config_of(
        &self,
        dims: ParallelDims,
        (global_batch, micro_batch): (usize, usize),
        seq_len: usize,
        optim: OptimConfig,
    ) -> EngineConfig {
        EngineConfig::new(dims, global_batch, micro_batch, seq_len, optim)
            .with_schedule(self.schedule)
            .with_devices(self.devices(dims.world_size()))
            .with_ranks_per_device(self.ranks_per_device)
            .with_exact_reductions(self.exact_reductions)
            .with_checkpointing(self.checkpointing)
            .with_precision(self.precision)
            .with_zero1(self.zero1)
    }

    /// The device of each of `world` ranks; empty (Flex on every rank) for Flex.
    pub fn devices(&self, world: usize) -> Vec<RankDevice> {
        if self.device == RankDevice::Flex { Vec::new() } else { self.device.for_ranks(world, self.ranks_per_device) }
    }

    /// What a resumed run takes from the options: the saved configuration holds the rest, and
    /// only the precision may change on a resume (the checkpoint's master weights and moments
    /// are f32 under either), and the devices of a run that grows back to its whole world.
    pub fn on_resume(&self, saved: EngineConfig) -> EngineConfig {
        // A run resumed in more ranks than it saved (after losing a device) gets a device each.
        let world = saved.dims.world_size();
        let devices = if saved.devices.is_empty() || saved.devices.len() == world { saved.devices.clone() } else { self.devices(world) };
        saved.with_precision(self.precision).with_devices(devices)
    }
}

/// Why a job could not be assembled.
#[derive(Debug, Error)]
pub enum JobError {
    /// No candidate matches the start asked for.
    #[error("{0}")]
    Start(String),
    /// The scorer or the policy refused its inputs.
    #[error(transparent)]
    Policy(#[from] PolicyError),
    /// The engine could not start.
    #[error(transparent)]
    Engine(#[from] EngineError),
    /// The driver refused the engine's configuration.
    #[error(transparent)]
    Driver(#[from] DriverError),
    /// No checkpoint of the run folder could be resumed.
    #[error(transparent)]
    RunDir(#[from] RunDirError),
}

/// Where a job starts.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Start {
    /// Exactly this candidate.
    At(Candidate),
    /// The candidate of this B_g and B_m (on `layout` when given) the scorer rates fastest.
    Batch { global_batch: usize, micro_batch: usize, layout: Option<ParallelDims> },
}

/// A ready run: the driver, where it started, and what decides when asked for.
pub struct Job<L: ParallelLm> {
    /// The loop over the engine.
    pub driver: Driver<L>,
    /// The candidate the engine started in (for a resume, the checkpoint's).
    pub start: Candidate,
    /// The candidates scored by the throughput model, when one was given.
    pub scorer: Option<Scorer>,
    /// The Copus policy's orchestrator, when asked for with [`JobBuilder::copus`].
    pub orchestrator: Option<Orchestrator>,
    /// The checkpoint a resumed job continues from.
    pub resumed_from: Option<PathBuf>,
}

/// Assembles a [`Job`]: see the module documentation.
pub struct JobBuilder<L: ParallelLm> {
    model: Arc<L>,
    space: Enumeration,
    optim: OptimConfig,
    options: EngineOptions,
    clock: Option<Clock>,
    scorer: Option<Scorer>,
    start: Option<Start>,
    rule: Option<CopusRule>,
}

impl<L: ParallelLm> JobBuilder<L> {
    /// A job of `model` over the candidate space `space` with optimizer settings `optim`; the
    /// engine's options at their defaults, on the wall clock.
    pub fn new(model: Arc<L>, space: Enumeration, optim: OptimConfig) -> Self {
        Self { model, space, optim, options: EngineOptions::default(), clock: None, scorer: None, start: None, rule: None }
    }

    /// The engine's options.
    pub fn options(mut self, options: EngineOptions) -> Self {
        self.options = options;
        self
    }

    /// The run's clock for [`JobBuilder::build`] (the wall clock when not given).
    pub fn clock(mut self, clock: Clock) -> Self {
        self.clock = Some(clock);
        self
    }

    /// Scores the feasible candidates by a throughput prior or a measured profile with plain
    /// Goodput at the optimizer's `b0`.
    pub fn prior(self, throughput: &dyn ThroughputModel) -> Result<Self, JobError> {
        let scorer = Scorer::plain(&self.space.feasible, throughput, self.optim.b0 as f64)?;
        Ok(self.scorer(scorer))
    }

    /// Scores the candidates with a scorer made elsewhere (another objective, say).
    pub fn scorer(mut self, scorer: Scorer) -> Self {
        self.scorer = Some(scorer);
        self
    }

    /// Starts at exactly `c`.
    pub fn start_at(mut self, c: Candidate) -> Self {
        self.start = Some(Start::At(c));
        self
    }

    /// Starts at B_g `global_batch` and B_m `micro_batch` on `layout`, or, without one, on the
    /// layout the scorer rates fastest.
    pub fn start_batch(mut self, global_batch: usize, micro_batch: usize, layout: Option<ParallelDims>) -> Self {
        self.start = Some(Start::Batch { global_batch, micro_batch, layout });
        self
    }

    /// Decides by the Copus policy with `rule` ([`CopusRule::default`]: the rule on the
    /// structured belief), over the scorer's candidates; the engine's ranks are taken as one
    /// machine's.
    pub fn copus(mut self, rule: CopusRule) -> Self {
        self.rule = Some(rule);
        self
    }

    /// The candidate the job starts in.
    pub fn start_candidate(&self) -> Result<Candidate, JobError> {
        match self.start {
            Some(Start::At(c)) => Ok(c),
            Some(Start::Batch { global_batch: b, micro_batch: m, layout }) => {
                let fits = |c: &Candidate| c.global_batch == b && c.micro_batch == m && layout.is_none_or(|d| c.dims == d);
                let best = match &self.scorer {
                    Some(s) => s.candidates().filter(|(c, _)| fits(c)).max_by(|x, y| x.1.total_cmp(&y.1)).map(|(c, _)| *c),
                    None => self.space.feasible.iter().find(|c| fits(c)).copied(),
                };
                best.ok_or_else(|| {
                    let on = layout.map_or(String::new(), |d| format!(" on layout {d}"));
                    JobError::Start(format!("B_g {b} with B_m {m}{on} is not a feasible candidate of the space"))
                })
            }
            None => Err(JobError::Start("no start given: call start_at or start_batch".into())),
        }
    }

    /// The engine configuration the job starts with.
    pub fn engine_config(&self) -> Result<EngineConfig, JobError> {
        let start = self.start_candidate()?;
        Ok(self.options.engine_config(&start, self.model.spec().seq_len, self.optim.clone()))
    }

    /// Starts only the engine, from the full parameters `full` (profiles and benchmarks step
    /// it without a driver).
    pub fn engine(&self, full: &FullParams) -> Result<Engine<L>, JobError> {
        Ok(Engine::new(self.model.clone(), full, self.engine_config()?)?)
    }

    /// Starts the engine from the full parameters `full` and the driver over it.
    pub fn build(mut self, full: &FullParams) -> Result<Job<L>, JobError> {
        let start = self.start_candidate()?;
        let engine = self.engine(full)?;
        let orchestrator = self.orchestrator()?;
        let driver = Driver::new(engine, self.space, self.clock.take().unwrap_or(Clock::Wall))?;
        Ok(Job { driver, start, scorer: self.scorer, orchestrator, resumed_from: None })
    }

    /// Continues the run in `dir` from its newest checkpoint that loads, in the checkpoint's
    /// configuration (its precision from the options), on the clock `clock` makes (once per
    /// checkpoint tried); `source` takes back what it learned, unless it is `None` and the
    /// job's own orchestrator takes it.
    pub fn resume(self, dir: &RunDir, source: Option<&mut dyn DecisionSource>, clock: impl FnMut() -> Clock) -> Result<Job<L>, JobError> {
        let mut orchestrator = self.orchestrator()?;
        let mut keep = copus_core::decision::Scripted::default();
        let source: &mut dyn DecisionSource = match (source, orchestrator.as_mut()) {
            (Some(s), _) => s,
            (None, Some(o)) => o,
            (None, None) => &mut keep,
        };
        let options = self.options.clone();
        let (driver, path) = dir.resume_with(self.model.clone(), &self.space, clock, source, &|cfg| options.on_resume(cfg))?;
        let start = driver.current();
        Ok(Job { driver, start, scorer: self.scorer, orchestrator, resumed_from: Some(path) })
    }

    /// The Copus orchestrator, when a rule was given (it needs the scorer).
    fn orchestrator(&self) -> Result<Option<Orchestrator>, JobError> {
        let Some(rule) = self.rule else { return Ok(None) };
        let scorer = self.scorer.clone().ok_or_else(|| JobError::Start("the Copus policy needs a throughput prior or profile".into()))?;
        let ranks = self.space.feasible.first().map_or(1, |c| c.dims.dp * c.dims.tp * c.dims.pp);
        Ok(Some(Orchestrator::new(rule.policy(&scorer, ranks)?, scorer)))
    }
}
