//! `recipes compare recipes/compare-NAME.ron`: every policy on the same data, seed and model,
//! side by side, with the clock each report names:
//! - `Synthetic`: a known noise-scale trajectory and McCandlish's progress model on the
//!   simulated clock of an analytic cluster model; seconds for a whole comparison, and sweeps of
//!   the switch threshold, the CBS constant c and the objective;
//! - `Real`: a tiny model trained for real on the Shakespeare text on in-process ranks, with
//!   the noise scale measured online. The clock is the wall clock (a throughput profile
//!   measured here tells the policies what each configuration costs), or the simulated clock of
//!   an analytic cluster model.
//!
//! Output: a time-to-target table with each policy's speedup over the fastest baseline and its
//! regret against the hindsight oracle, loss against time with Copus's layout regions shaded,
//! the B_g schedules, Copus's Goodput split into throughput and efficiency, and the list of
//! reconfigurations with their costs (PNG, CSV, JSONL, Markdown).

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::progress::Progress;
use anyhow::{Context, anyhow};
use burn::tensor::Device;
use copus_burn::driver::Clock as RunClock;
use copus_burn::{DecisionSource, Driver, Engine, EngineConfig};
use copus_core::candidates::{Candidate, CandidateSpace};
use copus_core::goodput::{Objective, ObjectiveKind, PlainGoodput};
use copus_core::layout::ParallelDims;
use copus_core::memory::{GIB, MemoryModel};
use copus_core::model::ModelSpec;
use copus_core::orchestrator::Orchestrator;
use copus_core::policy::{
    CbsFixedLayout, Copus, DpOnlyGoodput, MerrillWarmup, Policy, Scorer, Static, StepObservation, SwitchCosts, SwitchRule, Trajectory,
    hindsight_oracle,
};
use copus_core::schedule::ScheduleKind;
use copus_core::sim::{LossCurve, SimConfig, SimNoise, SimRun, simulate};
use copus_core::throughput::{ClusterModel, ClusterSpec, ThroughputModel, ThroughputProfile};
use copus_models::{LlamaConfig, full_params};
use serde::{Deserialize, Serialize};

use crate::plot::{Series, line_plot, region_plot};
use crate::recipe::Recipe;

/// A comparison recipe.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct CompareRecipe {
    /// Run folder name.
    pub name: String,
    /// Where run folders go.
    #[serde(default = "default_output_dir")]
    pub output_dir: String,
    /// What is compared.
    pub scenario: Scenario,
    /// Modelled seconds of a batch-only and a layout change (the simulated clocks; Copus's
    /// initial estimate of a layout change's cost).
    #[serde(default = "default_costs")]
    pub costs: SwitchCosts,
    /// Copus's and DP-only's switch rule (default: thresholds 5% / 10%, horizon 3600 s).
    #[serde(default)]
    pub rule: Option<SwitchRule>,
    /// CBS's constant: target B_g = c * B_simple.
    #[serde(default = "default_c")]
    pub cbs_c: f64,
    /// The objective the Goodput policies maximise.
    #[serde(default = "default_objective")]
    pub objective: ObjectiveKind,
    /// Synthetic scenarios only: sweeps over settings of Copus.
    #[serde(default)]
    pub sweeps: Option<Sweeps>,
}

/// Reads a RON file (`Some` implicit); errors name the file.
pub(crate) fn read_ron<T: serde::de::DeserializeOwned>(path: &Path) -> anyhow::Result<T> {
    let text = std::fs::read_to_string(path).map_err(|e| anyhow!("cannot read {}: {e}", path.display()))?;
    ron::Options::default()
        .with_default_extension(ron::extensions::Extensions::IMPLICIT_SOME)
        .from_str(&text)
        .map_err(|e| anyhow!("{}: {e}", path.display()))
}

/// The Goodput policies' rule when a recipe gives none: a layout change is assumed to cost 30 s
/// until one is measured, and must repay within an hour.
pub(crate) fn default_rule() -> SwitchRule {
    SwitchRule { layout_cost: 30.0, horizon: 3600.0, ..SwitchRule::default() }
}

fn default_output_dir() -> String {
    "runs".into()
}
fn default_costs() -> SwitchCosts {
    SwitchCosts { batch: 1.0, layout: 20.0 }
}
fn default_c() -> f64 {
    1.0
}
fn default_objective() -> ObjectiveKind {
    ObjectiveKind::Plain
}

/// The two evaluation modes.
#[derive(Clone, Debug, Deserialize, Serialize)]
pub enum Scenario {
    /// Known noise trajectory and progress model, simulated clock.
    Synthetic(Synthetic),
    /// Real training of a recipe's model on the Shakespeare text.
    Real(Real),
    /// Time to a held-out loss target on the wall clock: the adaptive main job against a sweep
    /// of fixed B_g over several seeds.
    Headline(crate::headline::Headline),
}

/// A cluster of the analytic model.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ClusterRecipe {
    /// `h100` (8 per node, NVLink), `mi210` (8 per node) or `h200` (one GPU).
    pub preset: String,
    /// Nodes.
    #[serde(default = "one_node")]
    pub nodes: usize,
}

fn one_node() -> usize {
    1
}

impl ClusterRecipe {
    fn spec(&self) -> anyhow::Result<ClusterSpec> {
        if self.nodes == 0 {
            return Err(anyhow!("cluster.nodes must be at least 1"));
        }
        match self.preset.as_str() {
            "h100" => Ok(ClusterSpec::h100_nvlink(self.nodes)),
            "mi210" => Ok(ClusterSpec::mi210(self.nodes)),
            "h200" if self.nodes == 1 => Ok(ClusterSpec::h200()),
            "h200" => Err(anyhow!("cluster preset h200 is a single GPU; nodes must be 1")),
            other => Err(anyhow!("cluster.preset = {other:?}: one of \"h100\", \"mi210\", \"h200\"")),
        }
    }
}

/// The synthetic scenario.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Synthetic {
    /// Model preset (its shape drives the analytic throughput).
    pub model: String,
    /// Cluster of the analytic model.
    pub cluster: ClusterRecipe,
    /// B_g values.
    pub global_batches: Vec<usize>,
    /// B_m values.
    pub micro_batches: Vec<usize>,
    /// Reference batch of statistical efficiency.
    pub b0: f64,
    /// (progress, B_simple) points: the noise scale from each progress on.
    pub trajectory: Vec<(f64, f64)>,
    /// Progress (reference-batch samples) at which the target loss is reached.
    pub end: f64,
    /// Loss over progress (for plots and the target loss).
    pub loss: LossCurve,
    /// The old noise model: the true noise scale times a log-normal error of this relative
    /// size each step. When absent (the default), the simulation draws gradient statistics and
    /// runs the real estimator (`p_eff`).
    #[serde(default)]
    pub estimate_error: Option<f64>,
    /// Effective dimension of the gradient noise of the estimator-driven simulation (smaller:
    /// noisier). The default, 18.5, is calibrated on the main recipe (README, "Noise in the
    /// simulation").
    #[serde(default = "default_p_eff")]
    pub p_eff: f64,
    /// The progress model's statistical efficiency (the truth the clock charges): `Plain`, or
    /// `LrAware` for training under the sqrt LR rule at the reference-tuned rate.
    #[serde(default = "default_objective")]
    pub truth: ObjectiveKind,
    /// Steps before the first estimate.
    #[serde(default = "default_warmup")]
    pub warmup_steps: u64,
    /// Seed of the estimate error.
    #[serde(default)]
    pub seed: u64,
}

fn default_p_eff() -> f64 {
    18.5
}

impl Synthetic {
    /// The simulation's settings on `costs` with `seed`.
    fn sim_config(&self, costs: SwitchCosts, seed: u64) -> SimConfig {
        SimConfig {
            costs,
            truth: Arc::from(self.truth.build()),
            b0: self.b0,
            noise: match self.estimate_error {
                Some(error) => SimNoise::LogNormal { error },
                None => SimNoise::Estimator { p_eff: self.p_eff, theta: 0.95 },
            },
            warmup_steps: self.warmup_steps,
            // A run that needs more has stalled (the longest shipped scenario takes under 1M).
            max_steps: 5_000_000,
            seed,
            record_steps: true,
        }
    }

    /// Checks the fields, naming the first bad one (`at` prefixes the field names).
    pub fn validate(&self, at: &str) -> anyhow::Result<()> {
        ModelSpec::preset(&self.model).map_err(|e| anyhow!("recipe field `{at}.model`: {e}"))?;
        self.cluster.spec()?;
        Trajectory::new(self.trajectory.clone(), self.end).map_err(|e| anyhow!("recipe field `{at}.trajectory`: {e}"))?;
        if !positive(self.b0) {
            return Err(anyhow!("recipe field `{at}.b0` = {}: a positive batch size", self.b0));
        }
        if !(self.loss.a > 0.0 && self.loss.p0 > 0.0 && self.loss.alpha > 0.0) {
            return Err(anyhow!("recipe field `{at}.loss`: a, p0 and alpha must be positive"));
        }
        if let Some(e) = self.estimate_error
            && !(positive(e) || e == 0.0)
        {
            return Err(anyhow!("recipe field `{at}.estimate_error` = {e}: >= 0 (or absent for the estimator-driven simulation)"));
        }
        if !(self.p_eff.is_finite() && self.p_eff >= 1.0) {
            return Err(anyhow!("recipe field `{at}.p_eff` = {}: at least 1 (an effective dimension)", self.p_eff));
        }
        Ok(())
    }
}
fn default_warmup() -> u64 {
    10
}

/// The real-statistics scenario.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Real {
    /// A training recipe with a `parallel` section (model, data, optimizer, candidate space).
    pub recipe: String,
    /// Which clock.
    pub clock: Clock,
    /// Target of the smoothed training loss.
    pub target_loss: f64,
    /// Steps per policy at most.
    pub max_steps: u64,
    /// EMA factor of the smoothed training loss.
    #[serde(default = "default_loss_ema")]
    pub loss_ema: f64,
    /// Address of an orchestrator service (`recipes orchestrator`) that decides for the Copus
    /// run instead of the embedded one; the token comes from COPUS_ORCHESTRATOR_TOKEN.
    #[serde(default)]
    pub service: Option<String>,
    /// With `service`: wait (up to 30 s) for each step's decision, so the run decides exactly as
    /// the embedded orchestrator would; otherwise decisions apply as they arrive.
    #[serde(default)]
    pub service_synchronous: bool,
}

fn default_loss_ema() -> f64 {
    0.9
}

/// The clock of a real-statistics comparison.
#[derive(Clone, Debug, Deserialize, Serialize)]
pub enum Clock {
    /// This machine's wall clock; the policies see a throughput profile measured here (from
    /// `profile` if given and present, else measured now and written there).
    Wall {
        /// Profile file.
        #[serde(default)]
        profile: Option<String>,
    },
    /// Simulated: each step costs what the analytic model of `cluster` says, each switch what
    /// `costs` says.
    Analytic {
        /// The cluster.
        cluster: ClusterRecipe,
        /// The model shape whose step times the clock charges (default: the trained model). A
        /// larger shape gives a proxy clock: real noise statistics of the small model, step and
        /// switch times of the large one.
        #[serde(default)]
        model: Option<String>,
    },
}

/// Sweeps of the synthetic scenario.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Sweeps {
    /// Layout-switch thresholds of Copus.
    #[serde(default)]
    pub layout_thresholds: Vec<f64>,
    /// CBS constants.
    #[serde(default)]
    pub cbs_c: Vec<f64>,
    /// Objectives of Copus.
    #[serde(default)]
    pub objectives: Vec<ObjectiveKind>,
}

/// `x > 0` (false for NaN).
fn positive(x: f64) -> bool {
    x > 0.0
}

impl CompareRecipe {
    /// Reads and checks a comparison recipe.
    pub fn load(path: &Path) -> anyhow::Result<Self> {
        let r: Self = read_ron(path)?;
        r.validate().map_err(|e| anyhow!("{}: {e}", path.display()))?;
        Ok(r)
    }

    /// Copus's rule; its layout cost is a prior it corrects from measured switches, not the
    /// clock's cost.
    fn rule(&self) -> SwitchRule {
        self.rule.unwrap_or(default_rule())
    }

    fn validate(&self) -> anyhow::Result<()> {
        if self.name.is_empty() || self.name.contains(['/', '\\']) {
            return Err(anyhow!("recipe field `name` = {:?}: a non-empty folder name without slashes", self.name));
        }
        if !(self.costs.batch >= 0.0 && self.costs.layout >= 0.0) {
            return Err(anyhow!("recipe field `costs`: batch and layout must be >= 0 seconds"));
        }
        if !positive(self.cbs_c) {
            return Err(anyhow!("recipe field `cbs_c` = {}: a positive number", self.cbs_c));
        }
        self.rule().validate().map_err(|e| anyhow!("recipe field `rule`: {e}"))?;
        match &self.scenario {
            Scenario::Synthetic(s) => s.validate("scenario")?,
            Scenario::Headline(h) => {
                if self.sweeps.is_some() {
                    return Err(anyhow!("recipe field `sweeps`: only synthetic scenarios sweep settings"));
                }
                h.validate()?;
            }
            Scenario::Real(r) => {
                if self.sweeps.is_some() {
                    return Err(anyhow!("recipe field `sweeps`: only synthetic scenarios sweep settings"));
                }
                if r.max_steps == 0 {
                    return Err(anyhow!("recipe field `scenario.max_steps`: at least 1"));
                }
                if !(0.0..1.0).contains(&r.loss_ema) {
                    return Err(anyhow!("recipe field `scenario.loss_ema` = {}: in [0, 1)", r.loss_ema));
                }
                if let Clock::Analytic { cluster, model } = &r.clock {
                    cluster.spec()?;
                    if let Some(m) = model {
                        ModelSpec::preset(m).map_err(|e| anyhow!("recipe field `scenario.clock.model`: {e}"))?;
                    }
                }
            }
        }
        Ok(())
    }
}

/// One policy's run on either clock.
#[derive(Clone, Debug, Serialize)]
pub struct PolicyRun {
    /// Name.
    pub name: String,
    /// Whether it is a baseline (Copus and the oracle are not).
    pub baseline: bool,
    /// (time, loss, B_g, layout, throughput, efficiency) per step.
    pub steps: Vec<StepRecord>,
    /// Configuration changes.
    pub switches: Vec<SwitchRecord>,
    /// Seconds to the target, if reached.
    pub time_to_target: Option<f64>,
}

/// One step of a policy run.
#[derive(Clone, Debug, Serialize)]
pub struct StepRecord {
    /// Step.
    pub step: u64,
    /// Clock seconds at the end of the step.
    pub time: f64,
    /// Loss (smoothed training loss in real runs, the model's loss in synthetic ones).
    pub loss: f64,
    /// B_g.
    pub global_batch: usize,
    /// B_m.
    pub micro_batch: usize,
    /// Layout.
    pub layout: String,
    /// Samples/s (predicted for the step's configuration).
    pub throughput: f64,
    /// Statistical efficiency at the noise of the step.
    pub efficiency: f64,
    /// B_simple (true or estimated).
    pub b_simple: Option<f64>,
}

/// One configuration change.
#[derive(Clone, Debug, Serialize)]
pub struct SwitchRecord {
    /// After this step.
    pub step: u64,
    /// Clock seconds when it started.
    pub time: f64,
    /// From.
    pub from: String,
    /// To.
    pub to: String,
    /// Seconds it cost on the run's clock.
    pub cost: f64,
    /// Whether the layout changed.
    pub layout: bool,
}

/// Seconds with four significant digits.
fn secs(t: f64) -> String {
    if t >= 1000.0 { format!("{t:.0}") } else { format!("{t:.*}", (3 - t.abs().max(1e-12).log10().floor() as i64).clamp(0, 9) as usize) }
}

fn describe(c: &Candidate) -> String {
    format!("{} B_g={} B_m={}", c.dims, c.global_batch, c.micro_batch)
}

/// The baselines and Copus, each with its starting configuration.
struct Lineup {
    policies: Vec<(Box<dyn Policy>, Candidate, bool)>,
    copus_start: Candidate,
}

fn best_at(scorer: &Scorer, b: usize) -> Option<Candidate> {
    scorer.candidates().filter(|(c, _)| c.global_batch == b).max_by(|x, y| x.1.total_cmp(&y.1)).map(|(c, _)| *c)
}

fn smallest_on(scorer: &Scorer, dims: ParallelDims) -> Option<Candidate> {
    let b = scorer.candidates().filter(|(c, _)| c.dims == dims).map(|(c, _)| c.global_batch).min()?;
    scorer.fastest(dims, b)
}

fn lineup(scorer: &Scorer, rule: SwitchRule, cbs_c: f64) -> anyhow::Result<Lineup> {
    let mut batches: Vec<usize> = scorer.candidates().map(|(c, _)| c.global_batch).collect();
    batches.sort_unstable();
    batches.dedup();
    let (b_min, b_max) = (batches[0], batches[batches.len() - 1]);
    let start = best_at(scorer, b_min).expect("a candidate at the smallest B_g");
    let large = best_at(scorer, b_max).expect("a candidate at the largest B_g");
    let mut policies: Vec<(Box<dyn Policy>, Candidate, bool)> = Vec::new();
    for &b in &batches {
        let c = best_at(scorer, b).expect("listed B_g has a candidate");
        policies.push((Box::new(Named(format!("static B_g={b} ({})", c.dims), Box::new(Static))), c, true));
    }
    for (label, layout) in [("pessimistic", start.dims), ("optimistic", large.dims)] {
        let p = CbsFixedLayout::new(scorer.clone(), layout, cbs_c, true)?;
        let s = smallest_on(scorer, layout).expect("the layout has candidates");
        policies.push((Box::new(Named(format!("cbs {label} ({layout})"), Box::new(p))), s, true));
    }
    policies.push((Box::new(Named(format!("merrill warmup ({})", start.dims), Box::new(MerrillWarmup::new(scorer.clone())))), start, true));
    // The widest dp; among equally wide layouts the fastest at the smallest B_g they all run.
    let widest = scorer.candidates().map(|(c, _)| c.dims.dp).max().expect("candidates");
    let wide: Vec<ParallelDims> = {
        let mut v: Vec<ParallelDims> = scorer.candidates().filter(|(c, _)| c.dims.dp == widest).map(|(c, _)| c.dims).collect();
        v.sort_by_key(|d| (d.tp, d.pp));
        v.dedup();
        v
    };
    let common = wide.iter().filter_map(|d| scorer.candidates().filter(|(c, _)| c.dims == *d).map(|(c, _)| c.global_batch).min()).max();
    let dp_layout = *wide
        .iter()
        .max_by(|a, b| {
            let t = |d: &ParallelDims| common.and_then(|b| scorer.fastest(*d, b)).and_then(|c| scorer.throughput(&c)).unwrap_or(0.0);
            t(a).total_cmp(&t(b))
        })
        .expect("candidates");
    let dp = DpOnlyGoodput::new(scorer.clone(), rule)?;
    policies.push((
        Box::new(Named(format!("dp-only goodput ({dp_layout})"), Box::new(dp))),
        smallest_on(scorer, dp_layout).expect("layout"),
        true,
    ));
    let copus = Copus::new(scorer.clone(), rule)?;
    policies.push((Box::new(copus), start, false));
    Ok(Lineup { policies, copus_start: start })
}

/// A policy under another name.
struct Named(String, Box<dyn Policy>);

impl Policy for Named {
    fn name(&self) -> String {
        self.0.clone()
    }
    fn decide(&mut self, obs: &StepObservation) -> copus_core::policy::Decision {
        self.1.decide(obs)
    }
    fn observe_reconfiguration(&mut self, seconds: f64, layout_changed: bool) {
        self.1.observe_reconfiguration(seconds, layout_changed);
    }
    fn observe_throughput(&mut self, candidate: &Candidate, samples_per_sec: f64) {
        self.1.observe_throughput(candidate, samples_per_sec);
    }
    fn learned(&self) -> copus_core::policy::PolicyState {
        self.1.learned()
    }
    fn restore_learned(&mut self, state: &copus_core::policy::PolicyState) {
        self.1.restore_learned(state);
    }
}

/// What a comparison produced.
pub struct Outcome {
    /// Folder written.
    pub folder: PathBuf,
    /// The summary (Markdown).
    pub summary: String,
}

/// Runs a comparison recipe and writes its report.
pub fn run(recipe: &CompareRecipe) -> anyhow::Result<Outcome> {
    let folder = crate::run::run_folder(Path::new(&recipe.output_dir), &recipe.name)?;
    if let Scenario::Headline(h) = &recipe.scenario {
        let summary = crate::headline::run(&recipe.name, h, &folder)?;
        return Ok(Outcome { folder, summary });
    }
    let (runs, oracle, clock, target, sweeps) = match &recipe.scenario {
        Scenario::Synthetic(s) => synthetic(recipe, s)?,
        Scenario::Real(r) => real(recipe, r)?,
        Scenario::Headline(_) => unreachable!("handled above"),
    };
    let summary = report(recipe, &folder, &runs, oracle, &clock, &target, sweeps.as_deref())?;
    Ok(Outcome { folder, summary })
}

type Compared = (Vec<PolicyRun>, Option<f64>, String, String, Option<String>);

fn synthetic_scorer(s: &Synthetic, objective: ObjectiveKind) -> anyhow::Result<(Scorer, usize)> {
    let spec = ModelSpec::preset(&s.model)?;
    let cluster = s.cluster.spec()?;
    let world = cluster.gpus_per_node * cluster.num_nodes;
    let space = CandidateSpace::new(
        world,
        s.global_batches.clone(),
        s.micro_batches.clone(),
        ScheduleKind::OneFOneB,
        MemoryModel::mixed_bf16(),
        cluster.memory_bytes,
    )
    .map_err(|e| anyhow!("recipe field `scenario`: {e}"))?;
    let feasible = space.enumerate(&spec).feasible;
    if feasible.is_empty() {
        return Err(anyhow!("no feasible candidate in the scenario's space"));
    }
    let model = ClusterModel::new(cluster, spec);
    let objective: Arc<dyn Objective> = Arc::from(objective.build());
    Ok((Scorer::new(&feasible, &model, s.b0, objective)?, world))
}

/// AdaptDL's Goodput batch adaptation on each layout, from its smallest B_g: one run per
/// layout, in layout order, each named `goodput on the best layout (L)` (the name it carries
/// when it is the one picked).
pub(crate) fn goodput_per_layout(
    scorer: &Scorer,
    truth: &Scorer,
    trajectory: &Trajectory,
    cfg: &SimConfig,
    rule: SwitchRule,
) -> anyhow::Result<Vec<SimRun>> {
    let mut layouts: Vec<ParallelDims> = scorer.candidates().map(|(c, _)| c.dims).collect();
    layouts.sort_by_key(|d| (d.dp, d.tp, d.pp));
    layouts.dedup();
    let mut out = Vec::new();
    for l in layouts {
        let Some(start) = smallest_on(scorer, l) else { continue };
        let mut p = Named(format!("goodput on the best layout ({l})"), Box::new(DpOnlyGoodput::new(scorer.clone(), rule)?));
        out.push(simulate(&mut p, truth, trajectory, start, cfg)?);
    }
    Ok(out)
}

/// The fastest of `runs` (the layout best in hindsight).
pub(crate) fn fastest_run(runs: &[SimRun]) -> Option<&SimRun> {
    runs.iter()
        .filter(|r| r.time_to_target.is_some())
        .min_by(|a, b| a.time_to_target.unwrap_or(f64::INFINITY).total_cmp(&b.time_to_target.unwrap_or(f64::INFINITY)))
}

/// The truth scorer (throughput and the scenario's progress model), the policies' scorer and
/// the trajectory of a synthetic scenario.
pub(crate) fn synthetic_setup(s: &Synthetic, objective: ObjectiveKind) -> anyhow::Result<(Scorer, Scorer, Trajectory, usize)> {
    let (scorer, world) = synthetic_scorer(s, objective)?;
    let (truth, _) = synthetic_scorer(s, s.truth)?;
    Ok((scorer, truth, Trajectory::new(s.trajectory.clone(), s.end)?, world))
}

/// One seed of a synthetic scenario: every policy of the line-up as (run, whether a
/// baseline), Goodput batch adaptation on each layout, and Copus's starting configuration.
pub(crate) struct Simulated {
    pub(crate) runs: Vec<(SimRun, bool)>,
    pub(crate) per_layout: Vec<SimRun>,
    pub(crate) start: Candidate,
}

pub(crate) fn simulate_lineup(
    s: &Synthetic,
    objective: ObjectiveKind,
    costs: SwitchCosts,
    rule: SwitchRule,
    cbs_c: f64,
    seed: u64,
    record_steps: bool,
) -> anyhow::Result<Simulated> {
    let (scorer, truth, trajectory, _) = synthetic_setup(s, objective)?;
    let cfg = SimConfig { record_steps, ..s.sim_config(costs, seed) };
    let lineup = lineup(&scorer, rule, cbs_c)?;
    let mut runs = Vec::new();
    for (mut policy, start, baseline) in lineup.policies {
        runs.push((simulate(policy.as_mut(), &truth, &trajectory, start, &cfg)?, baseline));
    }
    let per_layout = goodput_per_layout(&scorer, &truth, &trajectory, &cfg, rule)?;
    Ok(Simulated { runs, per_layout, start: lineup.copus_start })
}

fn synthetic(recipe: &CompareRecipe, s: &Synthetic) -> anyhow::Result<Compared> {
    let (_, truth, trajectory, world) = synthetic_setup(s, recipe.objective)?;
    let cfg = s.sim_config(recipe.costs, s.seed);
    let Simulated { runs: mut sims, per_layout, start: copus_start } =
        simulate_lineup(s, recipe.objective, recipe.costs, recipe.rule(), recipe.cbs_c, s.seed, true)?;
    if let Some(best) = fastest_run(&per_layout) {
        // Next to the other baselines, before Copus.
        sims.insert(sims.len() - 1, (best.clone(), true));
    }
    let mut runs = Vec::new();
    for (sim, baseline) in sims {
        // Keep plots light: at most ~2000 points per run.
        let every = (sim.steps.len() / 2000).max(1);
        let steps = sim
            .steps
            .iter()
            .enumerate()
            .filter(|(i, _)| i % every == 0 || *i + 1 == sim.steps.len())
            .map(|(_, x)| StepRecord {
                step: x.step,
                time: x.time,
                loss: s.loss.loss(x.progress),
                global_batch: x.candidate.global_batch,
                micro_batch: x.candidate.micro_batch,
                layout: x.candidate.dims.to_string(),
                throughput: x.throughput,
                efficiency: x.efficiency,
                b_simple: Some(x.b_simple),
            })
            .collect();
        let switches = sim
            .switches
            .iter()
            .map(|w| SwitchRecord {
                step: w.step,
                time: w.time,
                from: describe(&w.from),
                to: describe(&w.to),
                cost: w.cost,
                layout: w.from.dims != w.to.dims,
            })
            .collect();
        tracing::info!("{}: {}", sim.policy, sim.time_to_target.map_or("did not reach the target".into(), |t| format!("{t:.0} s")));
        runs.push(PolicyRun { name: sim.policy, baseline, steps, switches, time_to_target: sim.time_to_target });
    }
    let oracle = hindsight_oracle(&trajectory, &truth, recipe.costs, Some(copus_start)).time;
    let clock = format!(
        "simulated: analytic model of {} x{} GPUs ({}), switch costs {} s (batch) / {} s (layout)",
        s.cluster.preset, world, s.model, recipe.costs.batch, recipe.costs.layout
    );
    let target = format!("progress {:.3e} reference samples (loss {:.3})", s.end, s.loss.loss(s.end));
    let sweeps = recipe.sweeps.as_ref().map(|sw| sweep_table(recipe, s, sw, &truth, &trajectory, &cfg)).transpose()?;
    Ok((runs, Some(oracle), clock, target, sweeps))
}

/// Copus's time under each setting, against the fastest baseline of the main comparison.
fn sweep_table(
    recipe: &CompareRecipe,
    s: &Synthetic,
    sw: &Sweeps,
    truth: &Scorer,
    traj: &Trajectory,
    cfg: &SimConfig,
) -> anyhow::Result<String> {
    let (scorer, _) = synthetic_scorer(s, recipe.objective)?;
    let base = lineup(&scorer, recipe.rule(), recipe.cbs_c)?;
    let mut fastest = f64::INFINITY;
    for (mut p, start, baseline) in base.policies {
        if baseline && let Some(t) = simulate(p.as_mut(), truth, traj, start, cfg)?.time_to_target {
            fastest = fastest.min(t);
        }
    }
    let oracle = hindsight_oracle(traj, truth, recipe.costs, Some(base.copus_start)).time;
    let mut out = String::from("| setting | value | Copus s | vs fastest baseline | regret vs oracle |\n|---|---|---:|---:|---:|\n");
    let mut row = |setting: &str, value: String, t: Option<f64>| {
        let t = t.unwrap_or(f64::INFINITY);
        let _ =
            writeln!(out, "| {setting} | {value} | {t:.0} | {:+.1}% | {:+.1}% |", 100.0 * (fastest / t - 1.0), 100.0 * (t / oracle - 1.0));
    };
    for &th in &sw.layout_thresholds {
        let rule = SwitchRule { layout_threshold: th, ..recipe.rule() };
        let mut p = Copus::new(scorer.clone(), rule)?;
        row("layout threshold", format!("{th}"), simulate(&mut p, truth, traj, base.copus_start, cfg)?.time_to_target);
    }
    for &c in &sw.cbs_c {
        // c scales Copus's noise estimate the way it scales CBS's target batch.
        let rule = recipe.rule();
        let mut p = Scaled(c, Copus::new(scorer.clone(), rule)?);
        row("calibration c (B_simple x c)", format!("{c}"), simulate(&mut p, truth, traj, base.copus_start, cfg)?.time_to_target);
    }
    for &o in &sw.objectives {
        let (sc, _) = synthetic_scorer(s, o)?;
        let mut p = Copus::new(sc, recipe.rule())?;
        row("objective", format!("{o:?}"), simulate(&mut p, truth, traj, base.copus_start, cfg)?.time_to_target);
    }
    Ok(out)
}

/// Copus seeing `c` times the measured noise scale.
struct Scaled(f64, Copus);

impl Policy for Scaled {
    fn name(&self) -> String {
        format!("copus(c={})", self.0)
    }
    fn decide(&mut self, obs: &StepObservation) -> copus_core::policy::Decision {
        let mut o = *obs;
        if let Some(n) = o.noise.as_mut() {
            n.trace *= self.0;
        }
        self.1.decide(&o)
    }
    fn observe_reconfiguration(&mut self, s: f64, l: bool) {
        self.1.observe_reconfiguration(s, l);
    }
    fn observe_throughput(&mut self, c: &Candidate, samples_per_sec: f64) {
        self.1.observe_throughput(c, samples_per_sec);
    }
}

fn real(recipe: &CompareRecipe, r: &Real) -> anyhow::Result<Compared> {
    let train_recipe = Recipe::load(Path::new(&r.recipe))?;
    let par = train_recipe.parallel.clone().with_context(|| format!("{}: the training recipe needs a `parallel` section", r.recipe))?;
    let prepared = crate::run::prepare(&train_recipe)?;
    let spec = prepared.spec.clone();
    let space = CandidateSpace::new(
        par.world_size,
        par.global_batches.clone(),
        par.micro_batches.clone(),
        par.schedule,
        MemoryModel::fp32(),
        par.device_memory_gib * GIB,
    )?;
    let enumeration = space.enumerate(&spec);
    let feasible = enumeration.feasible.clone();
    if feasible.is_empty() {
        return Err(anyhow!("no feasible candidate in the training recipe's space"));
    }
    let cfg = LlamaConfig::from_spec(&spec);
    let device = Device::flex().autodiff();
    let full = crate::run::seeded(&device, train_recipe.train.seed, || full_params(&cfg.init(&device)));
    // The throughput the policies believe, and the clock.
    let (model, clock): (Box<dyn ThroughputModel>, String) = match &r.clock {
        Clock::Wall { profile } => {
            let path = profile.as_ref().map(PathBuf::from);
            let loaded = path.as_ref().filter(|p| p.exists()).map(|p| {
                std::fs::read_to_string(p)
                    .map_err(|e| e.to_string())
                    .and_then(|t| ThroughputProfile::from_ron(&t).map_err(|e| e.to_string()))
            });
            let profile = match loaded {
                Some(p) => p.map_err(|e| anyhow!("profile {}: {e}", path.as_ref().map_or(String::new(), |p| p.display().to_string())))?,
                None => measure_profile(&cfg, &full, &feasible, spec.seq_len, par.profile_steps, path.as_deref())?,
            };
            (
                Box::new(profile),
                format!(
                    "wall clock of this machine ({} in-process ranks); the policies use a throughput profile measured here",
                    par.world_size
                ),
            )
        }
        Clock::Analytic { cluster, model } => {
            let cs = cluster.spec()?;
            let clock_spec = match model {
                Some(m) => ModelSpec::preset(m)?,
                None => spec.clone(),
            };
            (
                Box::new(ClusterModel::new(cs, clock_spec.clone())),
                format!(
                    "simulated: analytic model of {} x{} GPUs charging each step as {} (the training math is {}, real), switch costs {} s (batch) / {} s (layout)",
                    cluster.preset, par.world_size, clock_spec.name, spec.name, recipe.costs.batch, recipe.costs.layout
                ),
            )
        }
    };
    let objective: Arc<dyn Objective> = Arc::from(recipe.objective.build());
    let b0 = train_recipe.optim.b0 as f64;
    let scorer = Scorer::new(&feasible, model.as_ref(), b0, objective)?;
    let plain = Scorer::new(&feasible, model.as_ref(), b0, Arc::new(PlainGoodput))?;
    let lineup = lineup(&scorer, recipe.rule(), recipe.cbs_c)?;
    let wall = matches!(r.clock, Clock::Wall { .. });
    if wall {
        // Warm the process up (thread pools, allocator) so the first policy is not charged for it.
        let c = lineup.copus_start;
        let ec =
            EngineConfig::new(c.dims, c.global_batch, c.micro_batch, spec.seq_len, train_recipe.optim.clone()).with_schedule(par.schedule);
        let mut e = Engine::new(Arc::new(cfg.clone()), &full, ec)?;
        for i in 0..5u64 {
            let tokens: Vec<i64> =
                (0..c.global_batch as u64).flat_map(|j| prepared.train.sample(i * 64 + j).iter().map(|&t| i64::from(t))).collect();
            e.step(tokens)?;
        }
    }
    let mut runs = Vec::new();
    let mut copus_trajectory: Vec<(f64, f64)> = Vec::new();
    let mut copus_progress = 0.0;
    let data = crate::run::TrainSequences(&prepared.train);
    let clock_of = || match wall {
        true => RunClock::Wall,
        false => {
            let s = scorer.clone();
            RunClock::Modelled {
                step_secs: Box::new(move |c: &Candidate| c.global_batch as f64 / s.throughput(c).unwrap_or(f64::NAN)),
                batch_switch_secs: recipe.costs.batch,
                layout_switch_secs: recipe.costs.layout,
            }
        }
    };
    for (policy, start, baseline) in lineup.policies {
        let name = policy.name();
        let mut orch = Orchestrator::new(policy, scorer.clone());
        let mut remote = match (&r.service, baseline) {
            (Some(addr), false) => {
                let addr: std::net::SocketAddr = addr.parse().map_err(|e| anyhow!("recipe field `scenario.service` = {addr:?}: {e}"))?;
                let token = std::env::var("COPUS_ORCHESTRATOR_TOKEN").unwrap_or_default();
                let fingerprint = copus_core::orchestrator::RunFingerprint::new(&spec, &space);
                let client = crate::service::Client::connect(addr, &token, &recipe.name, fingerprint, &orch.policy_name())?;
                // The embedded orchestrator decides while the service is away.
                let embedded = std::mem::replace(&mut orch, Orchestrator::new(Box::new(copus_core::policy::Static), scorer.clone()));
                Some(if r.service_synchronous {
                    crate::service::RemoteSource::synchronous(client, embedded, std::time::Duration::from_secs(30))
                } else {
                    crate::service::RemoteSource::new(client, embedded)
                })
            }
            _ => None,
        };
        let ec = EngineConfig::new(start.dims, start.global_batch, start.micro_batch, spec.seq_len, train_recipe.optim.clone())
            .with_schedule(par.schedule);
        let mut driver = Driver::new(Engine::new(Arc::new(cfg.clone()), &full, ec)?, enumeration.clone(), clock_of())?;
        let bar = Progress::new(&name, r.max_steps);
        let mut ema = None::<f64>;
        let mut run = PolicyRun { name: name.clone(), baseline, steps: Vec::new(), switches: Vec::new(), time_to_target: None };
        let mut progress = 0.0;
        let mut trajectory = Vec::new();
        for _ in 0..r.max_steps {
            let source: &mut dyn DecisionSource = match remote.as_mut() {
                Some(x) => x,
                None => &mut orch,
            };
            let s = driver.step(&data, source).map_err(|e| anyhow!("{name}: {e}"))?;
            let (cur, b) = (s.candidate, s.candidate.global_batch);
            let loss = s.step.metrics.loss;
            let smoothed = ema.map_or(loss, |e| r.loss_ema * e + (1.0 - r.loss_ema) * loss);
            ema = Some(smoothed);
            let phi = s.step.metrics.b_simple;
            let efficiency = phi.map_or(1.0, |p| PlainGoodput.efficiency(b as f64, b0, p));
            progress += b as f64 * efficiency;
            if let Some(p) = phi {
                trajectory.push((progress, p));
            }
            run.steps.push(StepRecord {
                step: s.step.metrics.step,
                time: s.step_clock_secs,
                loss: smoothed,
                global_batch: b,
                micro_batch: cur.micro_batch,
                layout: cur.dims.to_string(),
                throughput: s.samples_per_sec,
                efficiency,
                b_simple: phi,
            });
            bar.set_message(format!("loss {smoothed:.3} B_g {b} {}", cur.dims));
            bar.inc(1);
            if smoothed <= r.target_loss {
                run.time_to_target = Some(s.step_clock_secs);
                break;
            }
            if let Some(w) = s.switch {
                run.switches.push(SwitchRecord {
                    step: w.step,
                    time: s.step_clock_secs,
                    from: describe(&w.from),
                    to: describe(&w.to),
                    cost: w.clock_secs,
                    layout: w.layout_changed,
                });
            }
        }
        bar.finish();
        if let Some(remote) = remote.as_ref().filter(|r| r.fallback_steps() > 0) {
            run.name = format!(
                "{name} ({} steps decided in process while the orchestrator service was away: {})",
                remote.fallback_steps(),
                remote.unavailable().unwrap_or("unavailable")
            );
        }
        tracing::info!("{name}: {}", run.time_to_target.map_or("did not reach the target".into(), |t| format!("{} s", secs(t))));
        if !baseline {
            copus_trajectory = trajectory;
            copus_progress = progress;
        }
        runs.push(run);
    }
    // The oracle on Copus's measured noise trajectory, on the policies' throughput model.
    let oracle = oracle_from(&copus_trajectory, copus_progress, &plain, recipe.costs, lineup.copus_start);
    let target = format!("smoothed training loss {:.3} (EMA {})", r.target_loss, r.loss_ema);
    Ok((runs, oracle, clock, target, None))
}

/// Compresses a measured (progress, B_simple) series to at most 64 segments and runs the oracle.
fn oracle_from(points: &[(f64, f64)], end: f64, scorer: &Scorer, costs: SwitchCosts, start: Candidate) -> Option<f64> {
    if points.len() < 2 || end <= 0.0 {
        return None;
    }
    let every = points.len().div_ceil(64);
    let mut pts: Vec<(f64, f64)> = vec![(0.0, points[0].1)];
    for chunk in points.chunks(every).skip(1) {
        let p = chunk[0].0;
        let phi = chunk.iter().map(|x| x.1).sum::<f64>() / chunk.len() as f64;
        if p > pts.last().expect("non-empty").0 && p < end {
            pts.push((p, phi.max(0.0)));
        }
    }
    let traj = Trajectory::new(pts, end).ok()?;
    Some(hindsight_oracle(&traj, scorer, costs, Some(start)).time)
}

/// Measures the throughput of `feasible` on this machine and writes the profile to `out`.
pub(crate) fn measure_profile(
    cfg: &LlamaConfig,
    full: &copus_burn::parallel::FullParams,
    feasible: &[Candidate],
    seq: usize,
    steps: usize,
    out: Option<&Path>,
) -> anyhow::Result<ThroughputProfile> {
    let entries = crate::profile::measure(cfg, full, feasible, seq, steps, &[])?;
    let p = ThroughputProfile::new("this machine (in-process ranks)".into(), "compare".into(), entries)?;
    if let Some(path) = out {
        if let Some(d) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(d).map_err(|e| anyhow!("{}: {e}", d.display()))?;
        }
        std::fs::write(path, p.to_ron()).map_err(|e| anyhow!("{}: {e}", path.display()))?;
    }
    Ok(p)
}

fn report(
    recipe: &CompareRecipe,
    folder: &Path,
    runs: &[PolicyRun],
    oracle: Option<f64>,
    clock: &str,
    target: &str,
    sweeps: Option<&str>,
) -> anyhow::Result<String> {
    let write =
        |name: &str, text: &str| std::fs::write(folder.join(name), text).map_err(|e| anyhow!("{}: {e}", folder.join(name).display()));
    let fastest =
        runs.iter().filter(|r| r.baseline).filter_map(|r| r.time_to_target.map(|t| (t, r.name.clone()))).min_by(|a, b| a.0.total_cmp(&b.0));
    let mut md = format!("# {}\n\nClock: {clock}.\nTarget: {target}.\n\n", recipe.name);
    md.push_str("| policy | time to target (s) | speedup vs fastest baseline | regret vs oracle | steps | layout switches | batch switches |\n|---|---:|---:|---:|---:|---:|---:|\n");
    let mut csv = csv::Writer::from_writer(Vec::new());
    let row = |csv: &mut csv::Writer<Vec<u8>>, fields: &[String]| csv.write_record(fields).map_err(anyhow::Error::from);
    row(
        &mut csv,
        &[
            "policy",
            "baseline",
            "time_to_target_s",
            "speedup_vs_fastest_baseline",
            "regret_vs_oracle",
            "steps",
            "layout_switches",
            "batch_switches",
        ]
        .map(String::from),
    )?;
    for r in runs {
        let t = r.time_to_target;
        let speed = match (t, &fastest) {
            (Some(t), Some((f, _))) => Some(f / t - 1.0),
            _ => None,
        };
        let regret = match (t, oracle) {
            (Some(t), Some(o)) if o > 0.0 => Some(t / o - 1.0),
            _ => None,
        };
        let (ls, bs) = (r.switches.iter().filter(|s| s.layout).count(), r.switches.iter().filter(|s| !s.layout).count());
        let steps = r.steps.last().map_or(0, |s| s.step);
        let pct = |x: Option<f64>| x.map_or("-".into(), |v| format!("{:+.1}%", 100.0 * v));
        let _ = writeln!(
            md,
            "| {} | {} | {} | {} | {steps} | {ls} | {bs} |",
            r.name,
            t.map_or("not reached".into(), secs),
            pct(speed),
            pct(regret)
        );
        row(
            &mut csv,
            &[
                r.name.clone(),
                r.baseline.to_string(),
                t.map_or(String::new(), |t| format!("{t}")),
                speed.map_or(String::new(), |v| format!("{v}")),
                regret.map_or(String::new(), |v| format!("{v}")),
                steps.to_string(),
                ls.to_string(),
                bs.to_string(),
            ],
        )?;
    }
    if let Some(o) = oracle {
        let _ = writeln!(
            md,
            "| hindsight oracle | {} | {} | 0.0% | | | |",
            secs(o),
            fastest.as_ref().map_or("-".into(), |(f, _)| format!("{:+.1}%", 100.0 * (f / o - 1.0)))
        );
        row(
            &mut csv,
            &[
                "hindsight oracle".into(),
                "false".into(),
                format!("{o}"),
                String::new(),
                "0".into(),
                String::new(),
                String::new(),
                String::new(),
            ],
        )?;
    }
    if let Some((f, n)) = &fastest {
        let _ = writeln!(md, "\nFastest baseline: {n} ({} s).", secs(*f));
    }
    md.push_str("\n## Reconfigurations\n\n| policy | after step | at (s) | from | to | cost (s) |\n|---|---:|---:|---|---|---:|\n");
    let mut rcsv = csv::Writer::from_writer(Vec::new());
    row(&mut rcsv, &["policy", "step", "time_s", "from", "to", "cost_s", "layout"].map(String::from))?;
    for r in runs {
        for s in &r.switches {
            let _ = writeln!(md, "| {} | {} | {:.1} | {} | {} | {:.2} |", r.name, s.step, s.time, s.from, s.to, s.cost);
            row(
                &mut rcsv,
                &[
                    r.name.clone(),
                    s.step.to_string(),
                    s.time.to_string(),
                    s.from.clone(),
                    s.to.clone(),
                    s.cost.to_string(),
                    s.layout.to_string(),
                ],
            )?;
        }
    }
    if let Some(sw) = sweeps {
        md.push_str("\n## Sweeps (Copus, synthetic statistics)\n\n");
        md.push_str(sw);
    }
    let text = |w: csv::Writer<Vec<u8>>| w.into_inner().map_err(|e| anyhow!("{e}")).map(|b| String::from_utf8_lossy(&b).into_owned());
    write("results.csv", &text(csv)?)?;
    write("reconfigurations.csv", &text(rcsv)?)?;
    let mut jsonl = String::new();
    for r in runs {
        for s in &r.steps {
            let mut v = serde_json::to_value(s)?;
            v["policy"] = serde_json::Value::String(r.name.clone());
            jsonl.push_str(&v.to_string());
            jsonl.push('\n');
        }
    }
    write("steps.jsonl", &jsonl)?;
    // Plots; a missing font is reported, the data files are written anyway.
    let mut notes = Vec::new();
    let copus = runs.iter().find(|r| !r.baseline);
    let mut shown: Vec<&PolicyRun> = runs.iter().filter(|r| !r.baseline).collect();
    if let Some((_, n)) = &fastest {
        shown.extend(runs.iter().filter(|r| &r.name == n));
    }
    shown.extend(runs.iter().filter(|r| r.baseline && r.name.starts_with("dp-only")));
    shown.extend(runs.iter().filter(|r| r.baseline && r.name.starts_with("cbs optimistic")));
    shown.dedup_by(|a, b| a.name == b.name);
    let series = |f: &dyn Fn(&StepRecord) -> f64| -> Vec<Series<'_>> {
        shown.iter().map(|r| Series { label: &r.name, points: r.steps.iter().map(|s| (s.time, f(s))).collect() }).collect()
    };
    let regions: Vec<(f64, f64, String)> = copus.map_or(Vec::new(), |c| {
        let mut out: Vec<(f64, f64, String)> = Vec::new();
        let mut prev = 0.0;
        for s in &c.steps {
            match out.last_mut() {
                Some(last) if last.2 == s.layout => last.1 = s.time,
                _ => out.push((prev, s.time, s.layout.clone())),
            }
            prev = s.time;
        }
        out
    });
    let mut plot = |r: anyhow::Result<()>| {
        if let Err(e) = r {
            notes.push(e);
        }
    };
    plot(region_plot(
        &folder.join("loss_time.png"),
        "Loss against time (shaded: Copus's layout)",
        "seconds",
        "loss",
        &series(&|s| s.loss),
        &regions,
        &[],
    ));
    plot(line_plot(
        &folder.join("batch_schedule.png"),
        "Global batch size B_g",
        "seconds",
        "B_g (sequences)",
        &series(&|s| s.global_batch as f64),
        true,
    ));
    if let Some(c) = copus {
        let tmax = c.steps.iter().map(|s| s.throughput).fold(0.0, f64::max).max(1e-12);
        let gmax = c.steps.iter().map(|s| s.throughput * s.efficiency).fold(0.0, f64::max).max(1e-12);
        let split = vec![
            Series { label: "throughput / max", points: c.steps.iter().map(|s| (s.time, s.throughput / tmax)).collect() },
            Series { label: "statistical efficiency", points: c.steps.iter().map(|s| (s.time, s.efficiency)).collect() },
            Series { label: "goodput / max", points: c.steps.iter().map(|s| (s.time, s.throughput * s.efficiency / gmax)).collect() },
        ];
        plot(line_plot(
            &folder.join("goodput_split.png"),
            "Copus: Goodput = throughput x efficiency",
            "seconds",
            "relative",
            &split,
            false,
        ));
    }
    if !notes.is_empty() {
        md.push_str("\nPlots not written: ");
        md.push_str(&notes.iter().map(|e: &anyhow::Error| e.to_string()).collect::<Vec<_>>().join("; "));
        md.push('\n');
    }
    write("summary.md", &md)?;
    let recipe_text = ron::ser::to_string_pretty(recipe, ron::ser::PrettyConfig::default())?;
    write("recipe.ron", &recipe_text)?;
    Ok(md)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_shipped_comparison_recipes_parse() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR"));
        let mut n = 0;
        for e in std::fs::read_dir(dir).unwrap() {
            let p = e.unwrap().path();
            if p.file_name().is_some_and(|f| f.to_string_lossy().starts_with("compare-")) {
                CompareRecipe::load(&p).unwrap_or_else(|e| panic!("{e}"));
                n += 1;
            }
        }
        assert!(n >= 2);
    }

    #[test]
    fn a_synthetic_comparison_writes_its_report_and_copus_beats_the_fixed_layouts() {
        let dir = tempfile::tempdir().unwrap();
        let mut r = CompareRecipe::load(&Path::new(env!("CARGO_MANIFEST_DIR")).join("compare-synthetic-13b.ron")).unwrap();
        r.output_dir = dir.path().display().to_string();
        let out = run(&r).unwrap();
        for f in ["summary.md", "results.csv", "reconfigurations.csv", "steps.jsonl", "recipe.ron"] {
            assert!(out.folder.join(f).exists(), "{f}");
        }
        let rows: Vec<csv::StringRecord> =
            csv::Reader::from_path(out.folder.join("results.csv")).unwrap().records().map(|r| r.unwrap()).collect();
        let time =
            |prefix: &str| -> Vec<f64> { rows.iter().filter(|r| r[0].starts_with(prefix)).map(|r| r[2].parse::<f64>().unwrap()).collect() };
        let copus = time("copus")[0];
        let oracle = time("hindsight oracle")[0];
        // Every baseline here keeps one layout; Copus changes layout and is faster than all,
        // under the estimator-driven noise at the calibrated level.
        for prefix in ["static", "cbs", "merrill", "dp-only", "goodput on the best layout"] {
            assert!(!time(prefix).is_empty(), "{prefix} ran");
            for t in time(prefix) {
                assert!(copus < t, "copus {copus} vs {prefix} {t}");
            }
        }
        assert!(oracle <= copus * 1.001);
        assert!(out.summary.contains("Clock: simulated"), "the report names its clock");
        let switches: Vec<csv::StringRecord> =
            csv::Reader::from_path(out.folder.join("reconfigurations.csv")).unwrap().records().map(|r| r.unwrap()).collect();
        assert!(switches.iter().any(|r| &r[0] == "copus" && &r[6] == "true"), "Copus changed layout at least once");
    }

    /// The best-layout Goodput baseline is AdaptDL's batch adaptation on the layout that is
    /// fastest in hindsight: checked against each layout run on its own.
    #[test]
    fn the_best_layout_baseline_picks_the_hindsight_best_layout() {
        let r = CompareRecipe::load(&Path::new(env!("CARGO_MANIFEST_DIR")).join("compare-synthetic-3b.ron")).unwrap();
        let Scenario::Synthetic(mut s) = r.scenario.clone() else { panic!("synthetic") };
        // A shorter run of the same shape, so the test stays quick.
        s.trajectory = vec![(0.0, 2.0), (1.0e4, 16.0), (2.0e4, 128.0)];
        s.end = 3.0e4;
        let (scorer, truth, traj, _) = synthetic_setup(&s, ObjectiveKind::Plain).unwrap();
        let cfg = s.sim_config(r.costs, 3);
        let rule = r.rule();
        let per_layout = goodput_per_layout(&scorer, &truth, &traj, &cfg, rule).unwrap();
        let picked = fastest_run(&per_layout).unwrap();
        let mut layouts: Vec<ParallelDims> = scorer.candidates().map(|(c, _)| c.dims).collect();
        layouts.dedup();
        layouts.sort_by_key(|d| (d.dp, d.tp, d.pp));
        layouts.dedup();
        let mut each: Vec<(f64, ParallelDims)> = Vec::new();
        for l in layouts {
            let start = smallest_on(&scorer, l).unwrap();
            let mut p = DpOnlyGoodput::new(scorer.clone(), rule).unwrap();
            let run = simulate(&mut p, &truth, &traj, start, &cfg).unwrap();
            each.push((run.time_to_target.unwrap(), l));
        }
        let best = each.iter().min_by(|a, b| a.0.total_cmp(&b.0)).unwrap();
        assert!(each.len() > 1);
        assert_eq!(picked.time_to_target, Some(best.0));
        assert!(picked.policy.contains(&best.1.to_string()), "{} vs {}", picked.policy, best.1);
        // The run never leaves its layout.
        assert!(picked.switches.iter().all(|w| w.from.dims == w.to.dims));
    }

    #[test]
    fn bad_comparison_recipes_name_the_field() {
        let dir = tempfile::tempdir().unwrap();
        let base = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("compare-synthetic-13b.ron")).unwrap();
        let check = |text: String, field: &str| {
            let p = dir.path().join("c.ron");
            std::fs::write(&p, text).unwrap();
            let e = CompareRecipe::load(&p).unwrap_err().to_string();
            assert!(e.contains(field), "{e}");
        };
        check(base.replace("\"h100\"", "\"tpu\""), "cluster.preset");
        check(base.replace("llama-2-13b", "llama-9"), "scenario.model");
        check(base.replace("b0: 16.0", "b0: -1.0"), "scenario.b0");
        check(base.replace("(0.0, 4.0)", "(5.0, 4.0)"), "scenario.trajectory");
        check(base.replace("objective: Plain", "objective: Fast"), "Fast");
    }
}
