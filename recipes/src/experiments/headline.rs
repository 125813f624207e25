//! The headline measurement: time to a held-out loss target on this machine's wall clock, the
//! main job's adaptive run (Copus as shipped: no profile, throughput learned online) against
//! fixed-batch runs, each fixed B_g of a sweep on its throughput-optimal layout and micro-batch
//! (measured here), on the same data and initial weights, over several seeds.
//!
//! Held-out loss is evaluated whenever the run's clock has advanced by `eval_every_secs`, so
//! every arm is resolved equally in time whatever its step length; evaluation time is not on
//! the clock. The report gives each arm's time to target per seed, the mean and the spread,
//! and the adaptive run's gain over the best fixed B_g.

use std::path::Path;
use std::sync::Arc;

use anyhow::{Context, anyhow};
use burn::tensor::Device;
use copus_burn::driver::{Clock, Scripted};
use copus_burn::{DecisionSource, Driver, Engine, EngineConfig};
use copus_core::candidates::Candidate;
use copus_core::throughput::{ThroughputModel, ThroughputProfile};
use copus_models::{LlamaConfig, full_params};
use serde::{Deserialize, Serialize};

use crate::prepare::{Prepared, TrainSequences, prepare};
use crate::recipe::Recipe;
use crate::report::plot::{Series, line_plot};
use crate::report::progress::Progress;

/// The headline scenario of a comparison recipe.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Headline {
    /// An adaptive training recipe (model, data, optimizer, `parallel` candidate space, the
    /// starting B_g and B_m in `train`).
    pub recipe: String,
    /// Held-out loss (nats/token) to reach.
    pub heldout_target: f64,
    /// Seeds of initialisation and data order; every arm runs each.
    #[serde(default = "default_seeds")]
    pub seeds: Vec<u64>,
    /// The fixed B_g swept (default: the recipe's `parallel.global_batches`).
    #[serde(default)]
    pub fixed_batches: Vec<usize>,
    /// Seconds of run clock between held-out evaluations.
    #[serde(default = "default_eval_every_secs")]
    pub eval_every_secs: f64,
    /// An arm that has not reached the target after this many seconds of run clock stops.
    pub max_secs: f64,
    /// Where the measured throughput of the fixed arms' candidates is kept (measured on first
    /// use).
    #[serde(default)]
    pub profile: Option<String>,
}

fn default_seeds() -> Vec<u64> {
    vec![0, 1, 2]
}

fn default_eval_every_secs() -> f64 {
    5.0
}

impl Headline {
    /// Checks the fields, naming the first bad one.
    pub fn validate(&self) -> anyhow::Result<()> {
        if !(self.heldout_target.is_finite() && self.heldout_target > 0.0) {
            return Err(anyhow!("recipe field `scenario.heldout_target` = {}: a positive loss", self.heldout_target));
        }
        if self.seeds.is_empty() {
            return Err(anyhow!("recipe field `scenario.seeds`: at least one seed"));
        }
        if !(self.eval_every_secs.is_finite() && self.eval_every_secs > 0.0) {
            return Err(anyhow!("recipe field `scenario.eval_every_secs` = {}: a positive number of seconds", self.eval_every_secs));
        }
        if !(self.max_secs.is_finite() && self.max_secs > 0.0) {
            return Err(anyhow!("recipe field `scenario.max_secs` = {}: a positive number of seconds", self.max_secs));
        }
        Ok(())
    }
}

/// One arm's run on one seed.
#[derive(Clone, Debug, Serialize)]
pub struct ArmRun {
    /// The seed.
    pub seed: u64,
    /// Run-clock seconds to the target, if reached.
    pub time_to_target: Option<f64>,
    /// Steps taken.
    pub steps: u64,
    /// (run-clock seconds, held-out loss) of each evaluation.
    pub evals: Vec<(f64, f64)>,
    /// The configurations the run went through, in order.
    pub configurations: Vec<String>,
}

/// One arm over all seeds.
#[derive(Clone, Debug, Serialize)]
pub struct Arm {
    /// `copus` or `fixed B_g=N`.
    pub name: String,
    /// The fixed arm's configuration; `None` for the adaptive arm.
    pub fixed: Option<Candidate>,
    /// Its runs, one per seed.
    pub runs: Vec<ArmRun>,
}

impl Arm {
    /// Mean and (min, max) of the time to target, when every seed reached it.
    pub fn stats(&self) -> Option<(f64, f64, f64)> {
        let t: Vec<f64> = self.runs.iter().map(|r| r.time_to_target).collect::<Option<_>>()?;
        let mean = t.iter().sum::<f64>() / t.len() as f64;
        Some((mean, t.iter().copied().fold(f64::INFINITY, f64::min), t.iter().copied().fold(0.0, f64::max)))
    }
}

/// Runs the headline comparison and writes `report.md`, `results.json` and `heldout_time.png`
/// into `folder`; returns the report.
pub fn run(name: &str, h: &Headline, folder: &Path) -> anyhow::Result<String> {
    h.validate()?;
    let base = Recipe::load(Path::new(&h.recipe))?;
    let par = base.parallel.clone().with_context(|| format!("{}: the training recipe needs a `parallel` section", h.recipe))?;
    let fixed_batches = if h.fixed_batches.is_empty() { par.global_batches.clone() } else { h.fixed_batches.clone() };
    if let Some(b) = fixed_batches.iter().find(|b| !par.global_batches.contains(b)) {
        return Err(anyhow!(
            "recipe field `scenario.fixed_batches`: {b} is not in the training recipe's parallel.global_batches {:?}",
            par.global_batches
        ));
    }
    // The fixed arms' layouts: the fastest measured candidate of each B_g (same for every seed).
    let first = prepare(&base)?;
    let cfg = LlamaConfig::from_spec(&first.spec);
    let space = par.space()?.enumerate(&first.spec);
    let swept: Vec<Candidate> = space.feasible.iter().filter(|c| fixed_batches.contains(&c.global_batch)).copied().collect();
    let profile = fixed_profile(h, &cfg, &base, &swept, first.spec.seq_len, par.profile_steps)?;
    let mut fixed = Vec::new();
    for b in &fixed_batches {
        let best = swept
            .iter()
            .filter(|c| c.global_batch == *b)
            .filter_map(|c| Some((*c, profile.samples_per_sec(c)?)))
            .max_by(|x, y| x.1.total_cmp(&y.1))
            .with_context(|| format!("B_g {b} has no feasible, profiled candidate"))?;
        fixed.push(best.0);
    }
    drop(first);

    let mut arms: Vec<Arm> = std::iter::once(Arm { name: "copus (adaptive)".into(), fixed: None, runs: Vec::new() })
        .chain(fixed.iter().map(|c| Arm {
            name: format!("fixed B_g={} ({} B_m={})", c.global_batch, c.dims, c.micro_batch),
            fixed: Some(*c),
            runs: Vec::new(),
        }))
        .collect();
    for &seed in &h.seeds {
        let mut recipe = base.clone();
        recipe.train.seed = seed;
        let prepared = prepare(&recipe)?;
        let device = Device::flex().autodiff();
        let full = crate::prepare::seeded(&device, seed, || full_params(&cfg.init(&device)));
        warm_up(&cfg, &full, &prepared, fixed[0], &recipe)?;
        for arm in &mut arms {
            let run = if let Some(c) = arm.fixed {
                one_run(
                    h,
                    &recipe,
                    &cfg,
                    &full,
                    &prepared,
                    c,
                    &mut Scripted::new([]),
                    &format!("fixed B_g={} seed {seed}", c.global_batch),
                )?
            } else {
                let s = crate::adaptive::setup(&recipe)?;
                let start = crate::adaptive::start_candidate(&recipe, &s.scorer, par.initial_dims(&s.spec)?)?;
                let mut orch = s.orch;
                one_run(h, &recipe, &cfg, &full, &prepared, start, &mut orch, &format!("copus seed {seed}"))?
            };
            tracing::info!(
                "{} seed {seed}: {}",
                arm.name,
                run.time_to_target.map_or("did not reach the target".into(), |t| format!("{t:.1} s to the target"))
            );
            arm.runs.push(run);
        }
    }
    let report = report(name, h, &base, &arms);
    let write = |file: &str, text: &str| {
        std::fs::write(folder.join(file), text).with_context(|| format!("cannot write {}", folder.join(file).display()))
    };
    write("report.md", &report)?;
    write("results.json", &serde_json::to_string_pretty(&arms)?)?;
    let curves: Vec<(String, Vec<(f64, f64)>)> =
        arms.iter().map(|a| (format!("{} seed {}", a.name, h.seeds[0]), a.runs[0].evals.clone())).collect();
    let series: Vec<Series> = curves.iter().map(|(l, p)| Series { label: l, points: p.clone() }).collect();
    if let Err(e) = line_plot(
        &folder.join("heldout_time.png"),
        &format!("Held-out loss against wall-clock time (target {})", h.heldout_target),
        "seconds",
        "held-out loss (nats/token)",
        &series,
        false,
    ) {
        tracing::warn!("plot not written: {e:#}");
    }
    Ok(report)
}

/// The measured throughput of the fixed arms' candidates, from the profile file when it holds
/// them all, else measured now (and written there).
fn fixed_profile(
    h: &Headline,
    cfg: &LlamaConfig,
    recipe: &Recipe,
    swept: &[Candidate],
    seq: usize,
    steps: usize,
) -> anyhow::Result<ThroughputProfile> {
    let path = h.profile.as_ref().map(std::path::PathBuf::from);
    if let Some(p) = path.as_ref().filter(|p| p.exists()) {
        let text = std::fs::read_to_string(p).with_context(|| format!("cannot read {}", p.display()))?;
        let profile = ThroughputProfile::from_ron(&text).map_err(|e| anyhow!("profile {}: {e}", p.display()))?;
        if swept.iter().all(|c| profile.samples_per_sec(c).is_some()) {
            return Ok(profile);
        }
        tracing::info!("profile {} lacks some candidates; measuring again", p.display());
    }
    let device = Device::flex().autodiff();
    let full = crate::prepare::seeded(&device, recipe.train.seed, || full_params(&cfg.init(&device)));
    crate::profile::measure_profile(cfg, &full, swept, seq, steps, path.as_deref())
}

/// A few untimed steps so the first arm is not charged for thread pools and allocators.
fn warm_up(cfg: &LlamaConfig, full: &copus_burn::parallel::FullParams, p: &Prepared, c: Candidate, recipe: &Recipe) -> anyhow::Result<()> {
    let ec = EngineConfig::new(c.dims, c.global_batch, c.micro_batch, p.spec.seq_len, recipe.optim.clone());
    let mut e = Engine::new(Arc::new(cfg.clone()), full, ec)?;
    for i in 0..3u64 {
        e.step(copus_burn::DataSource::sequences(&TrainSequences(&p.train), i * c.global_batch as u64, c.global_batch))?;
    }
    Ok(())
}

/// One arm on one seed: trains from `start` until the held-out loss reaches the target or the
/// clock passes `max_secs`.
#[allow(clippy::too_many_arguments)]
fn one_run(
    h: &Headline,
    recipe: &Recipe,
    cfg: &LlamaConfig,
    full: &copus_burn::parallel::FullParams,
    p: &Prepared,
    start: Candidate,
    source: &mut dyn DecisionSource,
    label: &str,
) -> anyhow::Result<ArmRun> {
    let par = recipe.parallel.as_ref().context("a `parallel` section")?;
    let space = par.space()?.enumerate(&p.spec);
    let ec = EngineConfig::new(start.dims, start.global_batch, start.micro_batch, p.spec.seq_len, recipe.optim.clone())
        .with_schedule(par.schedule);
    let mut driver = Driver::new(Engine::new(Arc::new(cfg.clone()), full, ec)?, space, Clock::Wall)?;
    let data = TrainSequences(&p.train);
    let t = &recipe.train;
    let eval = |driver: &mut Driver<LlamaConfig>| -> anyhow::Result<f64> {
        crate::adaptive::evaluate(cfg, driver.engine_mut().gather()?, &p.heldout, t.eval_sequences, t.micro_batch)
    };
    let mut run = ArmRun {
        seed: t.seed,
        time_to_target: None,
        steps: 0,
        evals: vec![(0.0, eval(&mut driver)?)],
        configurations: vec![start.to_string()],
    };
    let bar = Progress::new(label, h.max_secs.ceil() as u64);
    let mut next_eval = h.eval_every_secs;
    while driver.clock_secs() < h.max_secs {
        let s = driver.step(&data, source).map_err(|e| anyhow!("{label}: {e}"))?;
        run.steps = s.step.metrics.step;
        if let Some(w) = &s.switch {
            run.configurations.push(w.to.to_string());
        }
        bar.set_position(driver.clock_secs() as u64);
        if driver.clock_secs() >= next_eval {
            next_eval = driver.clock_secs() + h.eval_every_secs;
            let l = eval(&mut driver)?;
            run.evals.push((s.step_clock_secs, l));
            bar.set_message(format!("held-out {l:.3} | {}", driver.current()));
            if l <= h.heldout_target {
                run.time_to_target = Some(s.step_clock_secs);
                break;
            }
        }
    }
    bar.finish();
    Ok(run)
}

fn report(name: &str, h: &Headline, recipe: &Recipe, arms: &[Arm]) -> String {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let mut md = format!(
        "# {name}\n\nClock: wall clock of this machine ({cores} cores, {} in-process ranks). Training recipe: {} ({}). \
         Target: held-out loss {} (nats/token, evaluated every {} s of run clock; evaluation time is not counted). \
         Seeds: {:?}. Each arm stops at {} s.\n\n",
        recipe.parallel.as_ref().map_or(1, |p| p.world_size),
        h.recipe,
        recipe.model.preset,
        h.heldout_target,
        h.eval_every_secs,
        h.seeds,
        h.max_secs
    );
    md.push_str("| arm | time to target per seed (s) | mean (s) | spread min-max (s) | steps per seed | configurations (seed 1) |\n|---|---|---:|---:|---|---|\n");
    for a in arms {
        let per: Vec<String> = a.runs.iter().map(|r| r.time_to_target.map_or("not reached".into(), |t| format!("{t:.1}"))).collect();
        let steps: Vec<String> = a.runs.iter().map(|r| r.steps.to_string()).collect();
        let (mean, spread) = a.stats().map_or(("-".into(), "-".into()), |(m, lo, hi)| (format!("{m:.1}"), format!("{lo:.1}-{hi:.1}")));
        let configs = a.runs.first().map_or(String::new(), |r| r.configurations.join(" -> "));
        md.push_str(&format!("| {} | {} | {mean} | {spread} | {} | {configs} |\n", a.name, per.join(", "), steps.join(", ")));
    }
    let copus = arms.iter().find(|a| a.fixed.is_none()).and_then(Arm::stats);
    let best =
        arms.iter().filter(|a| a.fixed.is_some()).filter_map(|a| Some((a.stats()?.0, a.name.clone()))).min_by(|x, y| x.0.total_cmp(&y.0));
    md.push('\n');
    match (copus, best) {
        (Some((c, ..)), Some((b, bname))) => md.push_str(&format!(
            "Copus reaches the target in {c:.1} s on average; the best fixed configuration, {bname}, in {b:.1} s: Copus is {:.1}% {} (goal: at least 10% sooner).\n",
            100.0 * (1.0 - c / b).abs(),
            if c <= b { "sooner" } else { "later" }
        )),
        (None, _) => md.push_str("Copus did not reach the target on every seed.\n"),
        (_, None) => md.push_str("No fixed configuration reached the target on every seed.\n"),
    }
    md
}
