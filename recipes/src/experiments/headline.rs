//! The headline measurement: time to held-out loss targets on this machine's wall clock, the
//! main job's adaptive run (Copus as shipped: no profile, throughput learned online) against
//! every fixed B_g of a sweep, each on its throughput-optimal layout and micro-batch (measured
//! here), and optionally a scripted ceiling, on the same data order and initial weights per
//! seed, over several seeds with the arm order shuffled per seed.
//!
//! Held-out loss is evaluated whenever the run's clock has advanced by `eval_every_secs`
//! (evaluation time is not on the clock), and each crossing time is interpolated between the
//! evaluations around it. The report gives, per target, every arm's times, Copus's paired time
//! ratio to each arm with a bootstrap interval over seeds, the best fixed arm chosen on half the
//! seeds and judged on the rest, and in hindsight; the goals at the last target; and the fit of
//! the candidate objectives to the fixed sweep (also in `sweep.json`).

use std::path::Path;

use anyhow::{Context, anyhow};
use burn::tensor::Device;
use copus_burn::Driver;
use copus_core::candidates::Candidate;
use copus_core::decision::{DecisionSource, Scripted};
use copus_core::throughput::{ThroughputModel, ThroughputProfile};
use copus_models::{LlamaConfig, full_params};
use serde::{Deserialize, Serialize};

use rand::SeedableRng;
use rand::rngs::StdRng;
use rand::seq::SliceRandom;

use super::stats::{SweepPoint, candidate_objectives, crossing_time, fit_objectives, geometric_mean, paired_ratio};
use crate::prepare::{Prepared, TrainSequences, prepare};
use crate::recipe::{ParallelRecipe, Recipe, ScriptedSwitch};
use crate::report::plot::{Series, line_plot};
use crate::report::progress::Progress;

/// The headline scenario of a comparison recipe: a pre-registered experiment. Everything that
/// decides the outcome (arms, seeds, targets, evaluation cadence, Copus's objective and
/// thresholds in the training recipe) is in the recipe files before the run.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Headline {
    /// An adaptive training recipe (model, data, optimizer, `parallel` candidate space, the
    /// starting B_g and B_m in `train`, Copus's objective and rule).
    pub recipe: String,
    /// Held-out losses (nats/token) to reach, in decreasing order; the last is the goal's.
    pub targets: Vec<f64>,
    /// Seeds of initialisation and data order; every arm runs each.
    #[serde(default = "default_seeds")]
    pub seeds: Vec<u64>,
    /// The fixed B_g swept (default: every B_g of the recipe's `parallel.global_batches`).
    #[serde(default)]
    pub fixed_batches: Vec<usize>,
    /// Seconds of run clock between held-out evaluations (off the clock); the crossing time is
    /// interpolated between the evaluations around it.
    #[serde(default = "default_eval_every_secs")]
    pub eval_every_secs: f64,
    /// An arm that has not reached the last target after this many seconds of run clock stops.
    pub max_secs: f64,
    /// Where the measured throughput of the fixed arms' candidates is kept (measured on first
    /// use).
    #[serde(default)]
    pub profile: Option<String>,
    /// A scripted arm (the ceiling: the best few-phase schedule read off an earlier sweep):
    /// its first entry (`after_step: 0`) is where it starts, the others are its switches.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ceiling: Vec<ScriptedSwitch>,
    /// Run the arms in an order shuffled per seed (default), so no arm always runs first.
    #[serde(default = "default_true")]
    pub shuffle: bool,
    /// Bootstrap resamples of the intervals.
    #[serde(default = "default_reps")]
    pub bootstrap_reps: usize,
}

fn default_seeds() -> Vec<u64> {
    vec![0, 1, 2, 3, 4]
}

fn default_eval_every_secs() -> f64 {
    2.0
}

fn default_true() -> bool {
    true
}

fn default_reps() -> usize {
    4000
}

impl Headline {
    /// Checks the fields, naming the first bad one.
    pub fn validate(&self) -> anyhow::Result<()> {
        if self.targets.is_empty() || self.targets.iter().any(|t| !(t.is_finite() && *t > 0.0)) {
            return Err(anyhow!("recipe field `scenario.targets` = {:?}: one or more positive losses", self.targets));
        }
        if self.targets.windows(2).any(|w| w[1] >= w[0]) {
            return Err(anyhow!("recipe field `scenario.targets` = {:?}: in decreasing order", self.targets));
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
        if self.bootstrap_reps == 0 {
            return Err(anyhow!("recipe field `scenario.bootstrap_reps` = 0: at least 1"));
        }
        if self.ceiling.first().is_some_and(|c| c.after_step != 0) {
            return Err(anyhow!("recipe field `scenario.ceiling`: its first entry is the start, with after_step: 0"));
        }
        Ok(())
    }
}

/// One arm's run on one seed.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ArmRun {
    /// The seed.
    pub seed: u64,
    /// Run-clock seconds to each target (interpolated), `None` where not reached.
    pub crossings: Vec<Option<f64>>,
    /// Steps taken.
    pub steps: u64,
    /// (run-clock seconds, held-out loss) of each evaluation.
    pub evals: Vec<(f64, f64)>,
    /// The configurations the run went through, in order.
    pub configurations: Vec<String>,
    /// Mean samples/s over the run's clock.
    pub samples_per_sec: f64,
    /// The position of the arm in this seed's running order (0: first).
    pub order: usize,
}

/// What an arm is.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub enum ArmKind {
    /// Copus as shipped.
    Copus,
    /// A fixed configuration.
    Fixed(Candidate),
    /// The scripted ceiling.
    Ceiling,
}

/// One arm over all seeds.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Arm {
    /// `copus`, `fixed B_g=N (...)` or `ceiling`.
    pub name: String,
    /// What the arm is.
    pub kind: ArmKind,
    /// Its runs, one per seed, in seed order.
    pub runs: Vec<ArmRun>,
}

impl Arm {
    /// The time to target `k` of every seed, when every seed reached it.
    pub fn times(&self, k: usize) -> Option<Vec<f64>> {
        self.runs.iter().map(|r| r.crossings.get(k).copied().flatten()).collect()
    }

    /// Mean and (min, max) of the time to target `k`, when every seed reached it.
    pub fn stats(&self, k: usize) -> Option<(f64, f64, f64)> {
        let t = self.times(k)?;
        let mean = t.iter().sum::<f64>() / t.len() as f64;
        Some((mean, t.iter().copied().fold(f64::INFINITY, f64::min), t.iter().copied().fold(0.0, f64::max)))
    }

    /// Mean time to target `k` over the seeds at `idx`, when each of them reached it.
    fn mean_over(&self, k: usize, idx: &[usize]) -> Option<f64> {
        let t: Vec<f64> = idx.iter().map(|&i| self.runs.get(i)?.crossings.get(k).copied().flatten()).collect::<Option<_>>()?;
        (!t.is_empty()).then(|| t.iter().sum::<f64>() / t.len() as f64)
    }
}

/// The order the arms run in on `seed`: shuffled (Fisher-Yates on a generator seeded by the
/// seed) when `shuffle`, else as listed.
fn running_order(n: usize, seed: u64, shuffle: bool) -> Vec<usize> {
    let mut order: Vec<usize> = (0..n).collect();
    if shuffle {
        let mut rng = StdRng::seed_from_u64(seed ^ 0x0bde_5eed);
        order.shuffle(&mut rng);
    }
    order
}

/// Runs the headline comparison and writes `report.md`, `results.json` and `heldout_time.png`
/// into `folder`; returns the report.
pub fn run(name: &str, h: &Headline, folder: &Path) -> anyhow::Result<String> {
    h.validate()?;
    let base = Recipe::load(Path::new(&h.recipe))?;
    let par = base.parallel.clone().with_context(|| format!("{}: the training recipe needs a `parallel` section", h.recipe))?;
    if !base.is_adaptive() {
        return Err(anyhow!("{}: the headline's Copus arm needs an adaptive training recipe (`adaptive` not false)", h.recipe));
    }
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
    let ceiling = if h.ceiling.is_empty() {
        None
    } else {
        let start = ParallelRecipe { script: vec![ScriptedSwitch { after_step: 1, ..h.ceiling[0] }], ..par.clone() };
        let start = start.scripted(&first.spec).map_err(|e| anyhow!("recipe field `scenario.ceiling` [0]: {e}"))?[0].1;
        let rest = ParallelRecipe { script: h.ceiling[1..].to_vec(), ..par.clone() };
        Some((start, rest.scripted(&first.spec).map_err(|e| anyhow!("recipe field `scenario.ceiling`: {e}"))?))
    };
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

    let mut arms = arms(&fixed, ceiling.is_some());
    let plan = Plan { h, cfg: &cfg, fixed: &fixed, ceiling: &ceiling };
    for &seed in &h.seeds {
        plan.one_seed(&base, seed, &mut arms)?;
        // After every seed, the report so far: a stopped experiment keeps the seeds it ran.
        write_results(name, h, &base, &arms, &profile, folder)?;
    }
    let report = write_results(name, h, &base, &arms, &profile, folder)?;
    let curves: Vec<(String, Vec<(f64, f64)>)> =
        arms.iter().map(|a| (format!("{} seed {}", a.name, h.seeds[0]), a.runs[0].evals.clone())).collect();
    let series: Vec<Series> = curves.iter().map(|(l, p)| Series { label: l, points: p.clone() }).collect();
    if let Err(e) = line_plot(
        &folder.join("heldout_time.png"),
        &format!("Held-out loss against wall-clock time (targets {:?})", h.targets),
        "seconds",
        "held-out loss (nats/token)",
        &series,
        false,
    ) {
        tracing::warn!("plot not written: {e:#}");
    }
    Ok(report)
}

/// The arms: Copus, one fixed arm per B_g on its fastest layout, and the scripted ceiling
/// when there is one.
fn arms(fixed: &[Candidate], ceiling: bool) -> Vec<Arm> {
    std::iter::once(Arm { name: "copus".into(), kind: ArmKind::Copus, runs: Vec::new() })
        .chain(fixed.iter().map(|c| Arm {
            name: format!("fixed B_g={} ({} B_m={})", c.global_batch, c.dims, c.micro_batch),
            kind: ArmKind::Fixed(*c),
            runs: Vec::new(),
        }))
        .chain(ceiling.then_some(()).iter().map(|_| Arm { name: "ceiling (scripted)".into(), kind: ArmKind::Ceiling, runs: Vec::new() }))
        .collect()
}

/// What every seed of the headline runs: the settings, the model, the fixed arms' candidates
/// and the ceiling's start and plan.
struct Plan<'a> {
    h: &'a Headline,
    cfg: &'a LlamaConfig,
    fixed: &'a [Candidate],
    ceiling: &'a Option<(Candidate, Vec<(u64, Candidate)>)>,
}

impl Plan<'_> {
    /// Every arm on `seed`, in the seed's shuffled order.
    fn one_seed(&self, base: &Recipe, seed: u64, arms: &mut [Arm]) -> anyhow::Result<()> {
        let (h, cfg, fixed, ceiling) = (self.h, self.cfg, self.fixed, self.ceiling);
        let mut recipe = base.clone();
        recipe.train.seed = seed;
        let prepared = prepare(&recipe)?;
        let device = Device::flex().autodiff();
        let full = crate::prepare::seeded(&device, seed, || full_params(&cfg.init(&device)));
        warm_up(cfg, &full, &prepared, fixed[0], &recipe)?;
        for (position, i) in running_order(arms.len(), seed, h.shuffle).into_iter().enumerate() {
            let arm = &mut arms[i];
            let label = format!("{} seed {seed}", arm.name);
            let mut run = match arm.kind {
                ArmKind::Fixed(c) => one_run(h, &recipe, cfg, &full, &prepared, c, &mut Scripted::new([]), &label)?,
                ArmKind::Ceiling => {
                    let (start, plan) = ceiling.clone().context("a ceiling")?;
                    one_run(h, &recipe, cfg, &full, &prepared, start, &mut Scripted::new(plan), &label)?
                }
                ArmKind::Copus => {
                    let s = crate::adaptive::setup(&recipe)?;
                    let start = crate::adaptive::fresh_job(&recipe, &s)?.start_candidate()?;
                    let mut orch = s.orch;
                    one_run(h, &recipe, cfg, &full, &prepared, start, &mut orch, &label)?
                }
            };
            run.order = position;
            tracing::info!(
                "{label}: {}",
                run.crossings
                    .iter()
                    .zip(&h.targets)
                    .map(|(c, t)| format!("{t}: {}", c.map_or("-".into(), |c| format!("{c:.1} s"))))
                    .collect::<Vec<_>>()
                    .join(", ")
            );
            arm.runs.push(run);
        }
        Ok(())
    }
}

/// Writes `report.md` and `results.json` for the seeds run so far; returns the report.
fn write_results(
    name: &str,
    h: &Headline,
    base: &Recipe,
    arms: &[Arm],
    profile: &ThroughputProfile,
    folder: &Path,
) -> anyhow::Result<String> {
    let done = arms.iter().map(|a| a.runs.len()).min().unwrap_or(0);
    let ran = Headline { seeds: h.seeds[..done].to_vec(), ..h.clone() };
    let mut report = report(name, &ran, base, arms, profile);
    if done < h.seeds.len() {
        report.push_str(&format!("\n(Seeds run so far: {:?} of {:?}.)\n", ran.seeds, h.seeds));
    }
    let write = |file: &str, text: &str| {
        std::fs::write(folder.join(file), text).with_context(|| format!("cannot write {}", folder.join(file).display()))
    };
    write("report.md", &report)?;
    write("results.json", &serde_json::to_string_pretty(&arms)?)?;
    write("sweep.json", &serde_json::to_string_pretty(&sweep_json(&ran, base, arms, profile))?)?;
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
    crate::profile::measure_profile(cfg, &full, swept, (seq, steps), &recipe.engine_options(), path.as_deref())
}

/// A few untimed steps so the first arm is not charged for thread pools and allocators.
fn warm_up(cfg: &LlamaConfig, full: &copus_burn::parallel::FullParams, p: &Prepared, c: Candidate, recipe: &Recipe) -> anyhow::Result<()> {
    let space = recipe.parallel.as_ref().context("a `parallel` section")?.space()?.enumerate(&p.spec);
    let mut e = crate::prepare::job(recipe, cfg, space).start_at(c).engine(full)?;
    for i in 0..3u64 {
        e.step(copus_burn::DataSource::sequences(&TrainSequences(&p.train), i * c.global_batch as u64, c.global_batch))?;
    }
    Ok(())
}

/// The job of one arm: the recipe's job (every engine option it sets) starting at `start`.
pub(crate) fn arm_job(
    recipe: &Recipe,
    cfg: &LlamaConfig,
    spec: &copus_core::model::ModelSpec,
    start: Candidate,
) -> anyhow::Result<copus_burn::JobBuilder<LlamaConfig>> {
    let space = recipe.parallel.as_ref().context("a `parallel` section")?.space()?.enumerate(spec);
    Ok(crate::prepare::job(recipe, cfg, space).start_at(start))
}

/// One arm on one seed: trains from `start` until the held-out loss reaches the last target or
/// the clock passes `max_secs`.
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
    let mut driver = arm_job(recipe, cfg, &p.spec, start)?.build(full)?.driver;
    // As in the main job: Copus's horizon is what is left of the recipe's time budget (240 s
    // for the main recipe), not of the arm's cap (`max_secs`), which only ends the measurement:
    // the run under test is the main job as a user runs it.
    driver.set_time_budget(recipe.train.time_budget_secs);
    let data = TrainSequences(&p.train);
    let t = &recipe.train;
    let eval = |driver: &mut Driver<LlamaConfig>| -> anyhow::Result<f64> {
        crate::adaptive::evaluate(driver.engine_mut(), &p.heldout, t.eval_sequences, t.micro_batch)
    };
    let mut evals = vec![(0.0, eval(&mut driver)?)];
    let mut configurations = vec![start.to_string()];
    let last = *h.targets.last().context("a target")?;
    let bar = Progress::new(label, h.max_secs.ceil() as u64);
    let mut next_eval = h.eval_every_secs;
    let (mut steps, mut samples) = (0u64, 0u64);
    while driver.clock_secs() < h.max_secs {
        let s = driver.step(&data, source).map_err(|e| anyhow!("{label}: {e}"))?;
        steps = s.step.metrics.step;
        samples += s.step.metrics.global_batch as u64;
        if let Some(w) = &s.switch {
            configurations.push(w.to.to_string());
        }
        bar.set_position(driver.clock_secs() as u64);
        if driver.clock_secs() >= next_eval {
            next_eval = driver.clock_secs() + h.eval_every_secs;
            let l = eval(&mut driver)?;
            evals.push((s.step_clock_secs, l));
            bar.set_message(format!("held-out {l:.3} | {}", driver.current()));
            if l <= last {
                break;
            }
        }
    }
    bar.finish();
    // Stopped by the clock between evaluations: one more, so a crossing in the last stretch
    // counts.
    if evals.last().is_some_and(|e| e.1 > last && e.0 < driver.clock_secs()) {
        evals.push((driver.clock_secs(), eval(&mut driver)?));
    }
    let crossings = h.targets.iter().map(|&target| crossing_time(&evals, target)).collect();
    let samples_per_sec = samples as f64 / driver.clock_secs().max(1e-9);
    Ok(ArmRun { seed: t.seed, crossings, steps, evals, configurations, samples_per_sec, order: 0 })
}

fn pct(x: f64) -> String {
    format!("{:+.1}%", 100.0 * (x - 1.0))
}

/// The report: per target, every arm's times and Copus's paired ratio to it with a bootstrap
/// interval; the best fixed arm chosen on the first half of the seeds and judged on the rest,
/// and in hindsight; the goals at the last target; the objective fit on the fixed sweep.
fn report(name: &str, h: &Headline, recipe: &Recipe, arms: &[Arm], profile: &ThroughputProfile) -> String {
    let mut md = report_header(name, h, recipe);
    let copus = arms.iter().find(|a| a.kind == ArmKind::Copus);
    for (k, target) in h.targets.iter().enumerate() {
        md.push_str(&format!(
            "## Target {target}\n\n| arm | time per seed (s) | mean (s) | min-max (s) | Copus / arm (geo. mean) | 95% CI |\n|---|---|---:|---:|---:|---|\n"
        ));
        target_rows(&mut md, h, arms, k, copus);
        md.push('\n');
        best_fixed_lines(&mut md, h, arms, k, copus);
        md.push('\n');
    }
    goals(&mut md, h, recipe, arms, copus);
    objective_fit(&mut md, h, recipe, arms, profile);
    md
}

/// The report's title and the paragraph on how it was measured.
fn report_header(name: &str, h: &Headline, recipe: &Recipe) -> String {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let par = recipe.parallel.as_ref();
    format!(
        "# {name}\n\nClock: wall clock of this machine ({cores} cores, {} in-process ranks). Training recipe: {} ({}). \
         Targets: held-out loss {:?} (nats/token), evaluated every {} s of run clock off the clock, crossing times \
         interpolated between evaluations. Seeds: {:?}, arm order {} per seed; the same data order and initial weights \
         for every arm of a seed. Each arm stops at {} s. Copus's objective: {:?}; its rule: {:?}.\n\n",
        par.map_or(1, |p| p.world_size),
        h.recipe,
        recipe.model.preset,
        h.targets,
        h.eval_every_secs,
        h.seeds,
        if h.shuffle { "shuffled" } else { "fixed" },
        h.max_secs,
        par.map(|p| p.objective(&recipe.optim)),
        par.map(|p| p.copus_rule(recipe.train.time_budget_secs)),
    )
}

/// Target `k`'s table rows: every arm's times per seed, mean and spread, and Copus's paired
/// ratio to it with its interval.
fn target_rows(md: &mut String, h: &Headline, arms: &[Arm], k: usize, copus: Option<&Arm>) {
    let n = h.seeds.len();
    for a in arms {
        let per: Vec<String> =
            a.runs.iter().map(|r| r.crossings.get(k).copied().flatten().map_or("-".into(), |t| format!("{t:.1}"))).collect();
        let (mean, spread) = a.stats(k).map_or(("-".into(), "-".into()), |(m, lo, hi)| (format!("{m:.1}"), format!("{lo:.1}-{hi:.1}")));
        let ratio = copus
            .filter(|c| c.kind != a.kind)
            .and_then(|c| paired_ratio(&ratios(c, a, k, &(0..n).collect::<Vec<_>>())?, h.bootstrap_reps, 1));
        let (r, ci) = ratio.map_or(("-".into(), "-".into()), |r| (format!("{:.3}", r.ratio), format!("{:.3}-{:.3}", r.low, r.high)));
        md.push_str(&format!("| {} | {} | {mean} | {spread} | {r} | {ci} |\n", a.name, per.join(", ")));
    }
}

/// Target `k`'s lines on the best fixed arm: in hindsight, chosen on the first half of the
/// seeds and judged on the rest, and the scripted ceiling against it.
fn best_fixed_lines(md: &mut String, h: &Headline, arms: &[Arm], k: usize, copus: Option<&Arm>) {
    let n = h.seeds.len();
    let (pick, judge): (Vec<usize>, Vec<usize>) = (0..n).partition(|i| *i < n.div_ceil(2));
    let fixed = || arms.iter().filter(|a| matches!(a.kind, ArmKind::Fixed(_)));
    let hindsight = fixed().filter_map(|a| Some((a.stats(k)?.0, a))).min_by(|x, y| x.0.total_cmp(&y.0));
    let picked = fixed().filter_map(|a| Some((a.mean_over(k, &pick)?, a))).min_by(|x, y| x.0.total_cmp(&y.0));
    if let (Some(c), Some((_, best))) = (copus, hindsight) {
        let r = ratios(c, best, k, &(0..n).collect::<Vec<_>>()).and_then(|x| paired_ratio(&x, h.bootstrap_reps, 2));
        md.push_str(&format!(
            "Best fixed arm in hindsight: {}; Copus / it: {}.\n",
            best.name,
            r.map_or("-".into(), |r| format!("{:.3} (95% CI {:.3}-{:.3}, {})", r.ratio, r.low, r.high, pct(r.ratio)))
        ));
    }
    if let (Some(c), Some((_, best)), false) = (copus, picked, judge.is_empty()) {
        let r = ratios(c, best, k, &judge).and_then(|x| paired_ratio(&x, h.bootstrap_reps, 3));
        md.push_str(&format!(
            "Best fixed arm on seeds {:?}: {}; Copus / it on seeds {:?}: {}.\n",
            pick.iter().map(|&i| h.seeds[i]).collect::<Vec<_>>(),
            best.name,
            judge.iter().map(|&i| h.seeds[i]).collect::<Vec<_>>(),
            r.map_or("-".into(), |r| format!("{:.3} (95% CI {:.3}-{:.3})", r.ratio, r.low, r.high))
        ));
    }
    if let (Some(ceil), Some((_, best))) = (arms.iter().find(|a| a.kind == ArmKind::Ceiling), hindsight) {
        let r = ratios(ceil, best, k, &(0..n).collect::<Vec<_>>()).and_then(|x| paired_ratio(&x, h.bootstrap_reps, 4));
        let reading = match &r {
            Some(r) if r.ratio < 1.0 => "below 1: what a schedule could win over the best fixed arm",
            Some(_) => "not below 1: the scripted schedule did not beat the best fixed arm, so it bounds nothing",
            None => "not measured",
        };
        md.push_str(&format!(
            "Ceiling / best fixed: {} ({reading}).\n",
            r.map_or("-".into(), |r| format!("{:.3} (95% CI {:.3}-{:.3})", r.ratio, r.low, r.high))
        ));
    }
}

/// The goals at the last target: Copus against the fixed arm at the recipe's starting B_g and
/// against the best fixed arm in hindsight.
fn goals(md: &mut String, h: &Headline, recipe: &Recipe, arms: &[Arm], copus: Option<&Arm>) {
    let k = h.targets.len() - 1;
    let default = arms.iter().find(|a| matches!(a.kind, ArmKind::Fixed(c) if c.global_batch == recipe.train.global_batch));
    let all: Vec<usize> = (0..h.seeds.len()).collect();
    let fixed_best = arms
        .iter()
        .filter(|a| matches!(a.kind, ArmKind::Fixed(_)))
        .filter_map(|a| Some((a.stats(k)?.0, a)))
        .min_by(|x, y| x.0.total_cmp(&y.0));
    md.push_str("## Goals at the last target\n\n");
    match (copus, default) {
        (Some(c), Some(d)) => match ratios(c, d, k, &all) {
            Some(r) => {
                let r = geometric_mean(&r);
                md.push_str(&format!(
                    "- Copus at least 20% sooner than {} (ratio <= 0.80): {:.3}, {}.\n",
                    d.name,
                    r,
                    if r <= 0.80 { "met" } else { "missed" }
                ));
            }
            None => md.push_str(&format!("- Copus vs {}: not every seed of both reached the target.\n", d.name)),
        },
        _ => md.push_str("- No fixed arm at the training recipe's starting B_g.\n"),
    }
    if let (Some(c), Some((_, b))) = (copus, fixed_best) {
        match ratios(c, b, k, &all) {
            Some(r) => {
                let r = geometric_mean(&r);
                md.push_str(&format!(
                    "- Copus ahead of the best fixed arm in hindsight, {} (ratio <= 1.00; before 2026-12-07 the goal was <= 1.02): {:.3}, {}.\n",
                    b.name,
                    r,
                    if r <= 1.0 { "met" } else { "missed" }
                ));
            }
            None => md.push_str("- Copus vs the best fixed arm: not every seed reached the target.\n"),
        }
    }
}

/// The fit of the candidate objectives to the fixed sweep, per target.
fn objective_fit(md: &mut String, h: &Headline, recipe: &Recipe, arms: &[Arm], profile: &ThroughputProfile) {
    md.push_str("\n## Objective fit on the fixed sweep\n\n");
    let b0 = recipe.optim.b0 as f64;
    for (target, sweep) in h.targets.iter().zip(sweeps(arms, h.targets.len(), profile)) {
        match fit_objectives(&sweep, b0, &candidate_objectives()) {
            Some(fits) => {
                let line: Vec<String> = fits
                    .iter()
                    .map(|f| format!("{:?}: rms log error {:.3} at B_simple {:.1}", f.objective, f.rms_log_error, f.phi))
                    .collect();
                md.push_str(&format!("- target {target}: {}\n", line.join("; ")));
            }
            None => md.push_str(&format!("- target {target}: fewer than three fixed arms reached it on every seed\n")),
        }
    }
}

/// The fixed arms as a sweep per target: B_g, the profile's samples/s of the arm's
/// configuration (what the objective fit scores throughput by) and the mean time to the target
/// over the seeds, for the arms that reached it on every seed.
fn sweeps(arms: &[Arm], targets: usize, profile: &ThroughputProfile) -> Vec<Vec<SweepPoint>> {
    (0..targets)
        .map(|k| {
            arms.iter()
                .filter_map(|a| match a.kind {
                    ArmKind::Fixed(c) => Some(SweepPoint {
                        global_batch: c.global_batch,
                        samples_per_sec: profile.samples_per_sec(&c)?,
                        time_to_target: a.stats(k)?.0,
                    }),
                    _ => None,
                })
                .collect()
        })
        .collect()
}

/// `sweep.json`: the fixed sweep and the objective fits per target, the numbers a test can fit
/// again.
fn sweep_json(h: &Headline, recipe: &Recipe, arms: &[Arm], profile: &ThroughputProfile) -> serde_json::Value {
    let b0 = recipe.optim.b0 as f64;
    let targets: Vec<serde_json::Value> = h
        .targets
        .iter()
        .zip(sweeps(arms, h.targets.len(), profile))
        .map(|(loss, sweep)| {
            let fits = fit_objectives(&sweep, b0, &candidate_objectives()).unwrap_or_default();
            serde_json::json!({"loss": loss, "sweep": sweep, "fits": fits})
        })
        .collect();
    serde_json::json!({"b0": b0, "targets": targets})
}

/// Copus's time over `arm`'s, per seed at `idx`, at target `k`; `None` unless both reached it
/// on every one of those seeds.
fn ratios(copus: &Arm, arm: &Arm, k: usize, idx: &[usize]) -> Option<Vec<f64>> {
    idx.iter()
        .map(|&i| {
            let (cr, ar) = (copus.runs.get(i)?, arm.runs.get(i)?);
            if cr.seed != ar.seed {
                return None;
            }
            Some(cr.crossings.get(k).copied().flatten()? / ar.crossings.get(k).copied().flatten()?)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The headline in miniature on the real corpus (fetched on first use): two seeds, Copus,
    /// two fixed arms and a scripted ceiling on the 1M preset, a few seconds each. Every arm
    /// runs every seed once, in a shuffled order that differs between the seeds, its crossings
    /// are the interpolated ones of its own evaluations, and the report and results are
    /// written.
    #[test]
    fn a_miniature_headline_runs_every_arm_on_every_seed() {
        let dir = tempfile::tempdir().unwrap();
        let train = dir.path().join("train.ron");
        std::fs::write(
            &train,
            format!(
                r#"(
                    name: "mini-train",
                    output_dir: "{}",
                    model: (preset: "tiny-1m", seq_len: Some(32)),
                    data: (heldout_plays: ["macbeth"], tokenizer: Bpe(vocab_size: 512)),
                    train: (global_batch: 4, micro_batch: 2, max_steps: 100000, eval_every: 0, eval_sequences: 8),
                    optim: (lr: 3e-3, b0: 4, warmup_steps: 2, total_steps: 200),
                    parallel: (world_size: 2, global_batches: [2, 4, 8], micro_batches: [1, 2]),
                )"#,
                dir.path().display()
            ),
        )
        .unwrap();
        let h = Headline {
            recipe: train.display().to_string(),
            targets: vec![6.0, 5.8],
            seeds: vec![3, 4],
            fixed_batches: vec![2, 8],
            eval_every_secs: 0.5,
            max_secs: 2.5,
            profile: None,
            ceiling: vec![
                ScriptedSwitch {
                    after_step: 0,
                    layout: crate::recipe::LayoutRecipe { dp: 2, tp: 1, pp: 1 },
                    global_batch: 2,
                    micro_batch: 1,
                },
                ScriptedSwitch {
                    after_step: 10,
                    layout: crate::recipe::LayoutRecipe { dp: 2, tp: 1, pp: 1 },
                    global_batch: 8,
                    micro_batch: 2,
                },
            ],
            shuffle: true,
            bootstrap_reps: 200,
        };
        let folder = dir.path().join("out");
        std::fs::create_dir_all(&folder).unwrap();
        let report = run("mini", &h, &folder).unwrap();
        let arms: Vec<Arm> = serde_json::from_str(&std::fs::read_to_string(folder.join("results.json")).unwrap()).unwrap();
        assert_eq!(arms.len(), 4, "copus, two fixed arms, the ceiling");
        assert_eq!(arms.iter().filter(|a| matches!(a.kind, ArmKind::Fixed(_))).count(), 2);
        for a in &arms {
            assert_eq!(a.runs.iter().map(|r| r.seed).collect::<Vec<_>>(), vec![3, 4], "{}", a.name);
            for r in &a.runs {
                assert!(r.steps > 0 && r.samples_per_sec > 0.0, "{}", a.name);
                assert_eq!(r.evals[0].0, 0.0);
                // As logged (JSON keeps f64 to within an ulp).
                for (got, &t) in r.crossings.iter().zip(&h.targets) {
                    match (got, crossing_time(&r.evals, t)) {
                        (Some(g), Some(w)) => assert!((g - w).abs() <= 1e-12 * w.max(1.0), "{}: {g} vs {w}", a.name),
                        (g, w) => assert_eq!(*g, w, "{}", a.name),
                    }
                }
            }
        }
        // The running order of each seed is a permutation of the arms, and the seeds' orders
        // are the shuffles their seeds give.
        for (i, &seed) in h.seeds.iter().enumerate() {
            let mut order: Vec<usize> = arms.iter().map(|a| a.runs[i].order).collect();
            let want = running_order(arms.len(), seed, true);
            for (arm, at) in order.iter().enumerate() {
                assert_eq!(want[*at], arm);
            }
            order.sort_unstable();
            assert_eq!(order, vec![0, 1, 2, 3]);
        }
        assert_ne!(running_order(4, 3, true), running_order(4, 4, true));
        assert_eq!(running_order(4, 3, false), vec![0, 1, 2, 3]);
        // The ceiling followed its script.
        let ceiling = arms.iter().find(|a| a.kind == ArmKind::Ceiling).unwrap();
        for r in &ceiling.runs {
            assert!(r.configurations[0].contains("B_g=2"), "{:?}", r.configurations);
            if r.steps > 10 {
                assert_eq!(r.configurations.len(), 2, "{:?}", r.configurations);
                assert!(r.configurations[1].contains("B_g=8") && r.configurations[1].contains("B_m=2"), "{:?}", r.configurations);
            }
        }
        assert!(folder.join("sweep.json").exists());
        assert!(report.contains("## Target 6") && report.contains("## Goals at the last target") && report.contains("## Objective fit"));
        assert!(folder.join("report.md").exists());
        // Bad settings name their field.
        let bad = Headline { targets: vec![5.0, 6.0], ..h.clone() };
        assert!(bad.validate().unwrap_err().to_string().contains("scenario.targets"));
        let bad = Headline { ceiling: vec![ScriptedSwitch { after_step: 3, ..h.ceiling[0] }], ..h };
        assert!(bad.validate().unwrap_err().to_string().contains("scenario.ceiling"));
    }
}
