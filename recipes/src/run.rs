//! A training run from a recipe: data, tokenizer, model, trainer, progress, held-out
//! evaluation, and the run folder (metrics.jsonl, eval.jsonl, summary, plots, weights).

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::time::Instant;

use crate::progress::Progress;
use burn::module::Module;
use burn::tensor::Device;
use copus_burn::{MicroBatch, StepMetrics, Trainer};
use copus_models::{Llama, LlamaConfig};
use serde::Serialize;

use crate::data::{self, PackedDataset};
use crate::plot::{self, Series};
use crate::recipe::{Recipe, TokenizerRecipe};

/// What a run reports at the end (summary.json).
#[derive(Clone, Debug, Serialize)]
pub struct Summary {
    /// Recipe name.
    pub name: String,
    /// The clock the times are on.
    pub clock: &'static str,
    /// Model preset and parameter count.
    pub model: String,
    /// Parameters.
    pub num_params: u64,
    /// sha256 over the corpus (play names and texts).
    pub corpus_sha256: String,
    /// Steps done.
    pub steps: u64,
    /// Target tokens trained on.
    pub tokens: u64,
    /// Wall seconds of training (evaluations excluded).
    pub train_secs: f64,
    /// Training tokens per second.
    pub tokens_per_sec: f64,
    /// Mean training loss of the first and last 10 steps.
    pub first_loss: f64,
    /// See `first_loss`.
    pub last_loss: f64,
    /// Held-out loss before training.
    pub initial_eval_loss: f64,
    /// Held-out loss at the end.
    pub final_eval_loss: f64,
    /// Smoothed B_simple at the end (sequences).
    pub final_b_simple: Option<f64>,
    /// Why training stopped.
    pub stopped: String,
    /// The batch row of summary.md when it is not the recipe's fixed B_g (adaptive runs).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub batch: Option<String>,
    /// Stopped by Ctrl-C; the run folder's last checkpoint continues it.
    pub interrupted: bool,
}

/// A run that failed; what was written so far stays in the run folder.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    /// Recipe problems.
    #[error(transparent)]
    Recipe(#[from] crate::recipe::RecipeError),
    /// Data problems.
    #[error(transparent)]
    Data(#[from] data::DataError),
    /// Training problems.
    #[error("training: {0}")]
    Train(#[from] copus_burn::TrainError),
    /// The recipe's backend is not usable here.
    #[error("backend: {0}")]
    Device(String),
    /// `init_from` could not be used.
    #[error("{0}")]
    Init(String),
    /// Outputs at the end of a run that could not be written (the rest were).
    #[error("{folder}: {failed}")]
    Output {
        /// The run folder.
        folder: String,
        /// What failed.
        failed: String,
    },
    /// Writing the run folder.
    #[error("{path}: {err}")]
    Io {
        /// File.
        path: String,
        /// Error.
        err: std::io::Error,
    },
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> RunError + '_ {
    move |err| RunError::Io { path: path.display().to_string(), err }
}

/// A fresh run folder: `dir/name`, or `dir/name-2`, `-3`, ... if taken (nothing is overwritten).
pub fn run_folder(dir: &Path, name: &str) -> Result<PathBuf, RunError> {
    std::fs::create_dir_all(dir).map_err(io(dir))?;
    for i in 1.. {
        let p = if i == 1 { dir.join(name) } else { dir.join(format!("{name}-{i}")) };
        match std::fs::create_dir(&p) {
            Ok(()) => return Ok(p),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
            Err(e) => return Err(io(&p)(e)),
        }
    }
    unreachable!()
}

/// Mean held-out loss per token over the first `count` held-out sequences (in stream order).
pub fn evaluate(model: &Llama, heldout: &PackedDataset, count: usize, micro: usize) -> f64 {
    let eval = model.valid();
    let device = eval.embed_tokens.weight.device();
    heldout_loss(heldout, count, micro, &device, |b| f64::from(eval.loss_sum(b.inputs, b.targets).into_scalar::<f32>()))
}

/// Mean loss per token over the first `count` held-out sequences in micro-batches of `micro`,
/// `loss_sum` giving a micro-batch's summed loss.
pub fn heldout_loss(heldout: &PackedDataset, count: usize, micro: usize, device: &Device, loss_sum: impl Fn(MicroBatch) -> f64) -> f64 {
    let count = count.min(heldout.num_seqs());
    let (mut sum, mut tokens) = (0.0, 0usize);
    let idx: Vec<usize> = (0..count).collect();
    for chunk in idx.chunks(micro.max(1)) {
        let seqs: Vec<&[u32]> = chunk.iter().map(|&i| heldout.sequence(i)).collect();
        sum += loss_sum(MicroBatch::from_windows(&seqs, device));
        tokens += chunk.len() * heldout.seq_len();
    }
    sum / tokens.max(1) as f64
}

/// The training split as the driver's data source: sequence `i` of the run's sample order.
pub struct TrainSequences<'a>(pub &'a PackedDataset);

impl copus_burn::DataSource for TrainSequences<'_> {
    fn sequences(&self, first: u64, count: usize) -> Vec<i64> {
        (first..first + count as u64).flat_map(|i| self.0.sample(i).iter().map(|&t| i64::from(t))).collect()
    }
}

/// Options from the command line.
#[derive(Clone, Debug, Default)]
pub struct RunOptions {
    /// Override of the recipe's step count (smoke tests).
    pub max_steps: Option<u64>,
}

/// A recipe's data and model shape: the vocabulary follows the tokenizer, rounded up to a
/// multiple of 64 so tensor parallelism can split it.
pub struct Prepared {
    /// The model shape.
    pub spec: copus_core::model::ModelSpec,
    /// Training sequences.
    pub train: PackedDataset,
    /// Held-out sequences.
    pub heldout: PackedDataset,
    /// sha256 of the corpus.
    pub checksum: String,
    /// The tokenizer (runs save it as `tokenizer.json`).
    pub tokenizer: tokenizers::Tokenizer,
}

/// Fetches the corpus, trains or loads the tokenizer, and packs both splits.
pub fn prepare(recipe: &Recipe) -> Result<Prepared, RunError> {
    let mut spec = recipe.model_spec()?;
    let cache = data::cache_dir();
    let plays = data::load_plays(&cache)?;
    let corpus = data::split(plays, &recipe.data.heldout_plays)?;
    let train_texts: Vec<&str> = corpus.train.iter().map(|p| p.text.as_str()).collect();
    let heldout_texts: Vec<&str> = corpus.heldout.iter().map(|p| p.text.as_str()).collect();
    let tokenizer = match &recipe.data.tokenizer {
        TokenizerRecipe::Bpe { vocab_size } => {
            tracing::info!("tokenizer: byte-level BPE, {vocab_size} tokens, trained on {} plays (cached)", corpus.train.len());
            data::bpe_tokenizer(&train_texts, *vocab_size, &cache)?
        }
        TokenizerRecipe::File(path) => {
            tokenizers::Tokenizer::from_file(path).map_err(|e| data::DataError::Tokenizer(format!("`data.tokenizer` file {path}: {e}")))?
        }
    };
    // The embedding covers the tokenizer, rounded up to a multiple of 64 for sharding.
    spec.vocab_size = crate::interop::vocab_of(&tokenizer);
    let t = &recipe.train;
    let train = PackedDataset::new(data::encode(&tokenizer, &train_texts)?, spec.seq_len, t.seed, "training")?;
    let heldout = PackedDataset::new(data::encode(&tokenizer, &heldout_texts)?, spec.seq_len, t.seed, "held-out")?;
    tracing::info!(
        "data: {} training sequences, {} held-out ({}) of {} tokens",
        train.num_seqs(),
        heldout.num_seqs(),
        recipe.data.heldout_plays.join(", "),
        spec.seq_len
    );
    Ok(Prepared { spec, train, heldout, checksum: corpus.checksum.clone(), tokenizer })
}

/// Seeds `device` and runs `f` (an initialisation) while no other caller in the process does
/// the same: the device's random generator is shared, so two initialisations at once (tests
/// run in parallel; a comparison starts several runs) would interleave their draws.
pub fn seeded<T>(device: &burn::tensor::Device, seed: u64, f: impl FnOnce() -> T) -> T {
    static INIT: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _one_at_a_time = INIT.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    device.seed(seed);
    f()
}

/// Runs a recipe to the end, under Copus when it is adaptive; returns the run folder and its
/// summary.
pub fn run_any(recipe: &Recipe, opts: &RunOptions) -> anyhow::Result<(PathBuf, Summary)> {
    #[cfg(feature = "mpi")]
    if let copus_burn::mpi::Role::Driver { size } = copus_burn::mpi::role()
        && !recipe.is_adaptive()
    {
        return Err(anyhow::anyhow!(
            "recipe `{}` trains a fixed batch on one rank; run it without mpirun (the {size} processes would idle)",
            recipe.name
        ));
    }
    if recipe.is_adaptive() { crate::adaptive::run(recipe, opts) } else { Ok(run(recipe, opts)?) }
}

/// Continues the run in `run_dir` (a run folder of `recipe` with checkpoints) to the recipe's
/// end. Only runs on the engine (adaptive recipes) write checkpoints.
pub fn resume_any(recipe: &Recipe, run_dir: &Path, opts: &RunOptions) -> anyhow::Result<(PathBuf, Summary)> {
    if !recipe.is_adaptive() {
        return Err(anyhow::anyhow!(
            "recipe `{}` trains a fixed batch on one rank, which writes no checkpoints; resume needs a run on the engine (a `parallel` section, `adaptive` not false)",
            recipe.name
        ));
    }
    crate::adaptive::resume(recipe, run_dir, opts)
}

/// Runs a recipe's fixed single-rank training to the end; returns the run folder and its
/// summary.
pub fn run(recipe: &Recipe, opts: &RunOptions) -> Result<(PathBuf, Summary), RunError> {
    let Prepared { spec, train, heldout, checksum, tokenizer } = prepare(recipe)?;
    let t = &recipe.train;
    // The one rank trains on the recipe's backend, initialised there with the recipe's seed (or
    // from `init_from`).
    let device = recipe.backend.rank_device(0).device().map_err(|e| RunError::Device(e.to_string()))?.autodiff();
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

pub fn summary_markdown(s: &Summary, r: &Recipe) -> String {
    format!(
        "# {name}\n\nClock: {clock}.\n\n| | |\n|---|---|\n| model | {model}, {params:.2}M parameters |\n\
         | batch | {batch}; sequences of {seq} tokens |\n| steps | {steps} ({stopped}) |\n\
         | tokens | {tokens} |\n| training time | {secs:.1} s |\n| throughput | {tps:.0} tokens/s |\n\
         | training loss | {fl:.3} (first 10 steps) -> {ll:.3} (last 10) |\n\
         | held-out loss | {il:.3} -> {el:.3} |\n| B_simple at the end | {bs} sequences |\n\
         | corpus sha256 | {sha} |\n",
        name = s.name,
        clock = s.clock,
        model = s.model,
        params = s.num_params as f64 / 1e6,
        batch = s.batch.clone().unwrap_or_else(|| format!("B_g {} sequences, B_m {}", r.train.global_batch, r.train.micro_batch)),
        seq = r.model_spec().map(|m| m.seq_len).unwrap_or(0),
        steps = s.steps,
        stopped = s.stopped,
        tokens = s.tokens,
        secs = s.train_secs,
        tps = s.tokens_per_sec,
        fl = s.first_loss,
        ll = s.last_loss,
        il = s.initial_eval_loss,
        el = s.final_eval_loss,
        bs = s.final_b_simple.map_or("not measured".into(), |b| format!("{b:.1}")),
        sha = s.corpus_sha256,
    )
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
        let (folder, s) = run(&recipe, &RunOptions { max_steps: None }).unwrap();
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
        let (again, _) = run(&recipe, &RunOptions { max_steps: Some(1) }).unwrap();
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
        let e = run(&recipe, &RunOptions { max_steps: None }).unwrap_err().to_string();
        assert!(e.contains("tokenizer.json"), "{e}");
        assert!(!out.path().join("runs").exists(), "no run folder for a run that could not start");
    }
}
