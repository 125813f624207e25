//! The comparison recipe (`recipes/compare-NAME.ron`): its RON schema, defaults and checks;
//! every error names the field, the value and what is allowed.

use std::path::Path;
use std::sync::Arc;

use anyhow::anyhow;
use copus_core::goodput::ObjectiveKind;
use copus_core::model::ModelSpec;
use copus_core::policy::{SwitchCosts, SwitchRule, Trajectory};
use copus_core::sim::{LossCurve, SimConfig, SimNoise};
use copus_core::throughput::ClusterSpec;
use serde::{Deserialize, Serialize};

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
    Headline(crate::experiments::headline::Headline),
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
    pub(crate) fn spec(&self) -> anyhow::Result<ClusterSpec> {
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
    /// noisier). The default, 18.5, is calibrated on the main recipe (docs/policy.md, "Noise in the
    /// simulation").
    #[serde(default = "default_p_eff")]
    pub p_eff: f64,
    /// The progress model's statistical efficiency (the truth the clock charges). Default:
    /// `LrTuned(rule: Sqrt)`, training under the sqrt LR rule from a rate tuned at B0, which
    /// differs from the policies' default objective (`Plain`); a scenario that wants them
    /// matched names both.
    #[serde(default = "default_truth")]
    pub truth: ObjectiveKind,
    /// The true throughput's error against the analytic model the policies hold: each
    /// candidate's samples/s times `exp(throughput_error * z)`, z standard normal, drawn once
    /// per candidate and seed (0: the policies' model is the truth).
    #[serde(default = "default_throughput_error")]
    pub throughput_error: f64,
    /// Standard deviation of the natural log of each step's time (0: none).
    #[serde(default = "default_jitter")]
    pub jitter: f64,
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

fn default_truth() -> ObjectiveKind {
    ObjectiveKind::LrTuned { rule: copus_core::goodput::LrRule::Sqrt }
}

fn default_throughput_error() -> f64 {
    0.25
}

fn default_jitter() -> f64 {
    0.15
}

impl Synthetic {
    /// The simulation's settings on `costs` with `seed`.
    pub(crate) fn sim_config(&self, costs: SwitchCosts, seed: u64) -> SimConfig {
        SimConfig {
            costs,
            truth: Arc::from(self.truth.build()),
            b0: self.b0,
            noise: match self.estimate_error {
                Some(error) => SimNoise::LogNormal { error },
                None => SimNoise::Estimator { p_eff: self.p_eff, theta: 0.95, memory: copus_core::gns::Memory::Fixed },
            },
            warmup_steps: self.warmup_steps,
            // A run that needs more has stalled (the longest shipped scenario takes under 1M).
            max_steps: 5_000_000,
            seed,
            record_steps: true,
            jitter: self.jitter,
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
        if !(self.throughput_error.is_finite() && self.throughput_error >= 0.0) {
            return Err(anyhow!("recipe field `{at}.throughput_error` = {}: >= 0 (0: the model is the truth)", self.throughput_error));
        }
        if !(self.jitter.is_finite() && self.jitter >= 0.0) {
            return Err(anyhow!("recipe field `{at}.jitter` = {}: >= 0 (0: every step takes its mean time)", self.jitter));
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
    pub(crate) fn rule(&self) -> SwitchRule {
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
