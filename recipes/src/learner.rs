//! `recipes learner RECIPE`: a Burn `SupervisedTraining` run on the recipe's Shakespeare data and
//! model, with copus's adaptive batching switched on (or `--fixed` for the plain Learner, or
//! `--compare` for both, then a table).
//!
//! Everything here is what a Burn user already writes (dataset, batcher, train/valid steps,
//! optimizer, scheduler, `SupervisedTraining`), except the lines marked `copus:`.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use anyhow::anyhow;
use burn::data::dataloader::DataLoaderBuilder;
use burn::data::dataset::{Dataset, DatasetError};
use burn::optim::lr_scheduler::cosine::CosineAnnealingLrSchedulerConfig;
use burn::optim::lr_scheduler::module_lr_scheduler::ModuleLrScheduler;
use burn::tensor::Device;
use burn::train::metric::{LearningRateMetric, LossMetric};
use burn::train::{Learner, SupervisedTraining, TrainingStrategy};
use copus_burn::learner::{CopusBatching, CopusBatchingConfig, CopusTrainingExt};
use copus_burn::trainer::CausalLm;
use copus_models::LlamaConfig;
use copus_models::learner::{LanguageModel, TokenBatcher};

use crate::data::PackedDataset;
use crate::prepare::{Prepared, prepare, run_folder};
use crate::recipe::{Recipe, TrainRecipe};

/// Sequences of a packed split as a Burn dataset: the training stream's order (item `i` is the
/// stream's `i`-th sample) or stream order (held-out).
struct Sequences {
    data: Arc<PackedDataset>,
    len: usize,
    shuffled: bool,
}

impl Dataset<Vec<u32>> for Sequences {
    fn get(&self, index: usize) -> Result<Vec<u32>, DatasetError> {
        if index >= self.len {
            return Err(DatasetError::new(std::io::Error::other(format!("sequence {index} of {}", self.len))));
        }
        Ok(if self.shuffled { self.data.sample(index as u64) } else { self.data.sequence(index) }.into_owned())
    }
    fn len(&self) -> usize {
        self.len
    }
}

/// The prepared corpus, shared by the runs.
struct Data {
    spec: copus_core::model::ModelSpec,
    train: Arc<PackedDataset>,
    heldout: Arc<PackedDataset>,
}

/// One run's outcome.
pub struct LearnerRun {
    /// "copus" or "fixed".
    pub label: &'static str,
    /// Optimizer steps.
    pub steps: u64,
    /// Training sequences consumed.
    pub samples: u64,
    /// Batch at the end (sequences).
    pub final_batch: usize,
    /// Smoothed noise scale at the end.
    pub b_simple: Option<f64>,
    /// Mean held-out loss per token after training.
    pub heldout_loss: f64,
    /// Wall-clock seconds of `launch`.
    pub seconds: f64,
    /// Burn's run directory (metric logs).
    pub dir: PathBuf,
}

/// Trains on the recipe's data with `SupervisedTraining`; `adaptive` switches copus on.
fn train(recipe: &Recipe, data: &Data, adaptive: bool, max_samples: Option<usize>, folder: &Path) -> anyhow::Result<LearnerRun> {
    let t = &recipe.train;
    let device = Device::flex().autodiff();
    let (train, heldout) = (data.train.clone(), data.heldout.clone());
    // The same data budget as the recipe: max_steps at its global batch.
    let samples = max_samples.unwrap_or(t.max_steps as usize * t.global_batch);
    let eval = t.eval_sequences.min(heldout.num_seqs());
    let llama = crate::prepare::seeded(&device, t.seed, || LlamaConfig::from_spec(&data.spec).init(&device));
    let no_decay = llama.no_decay_predicates();
    let model = LanguageModel { llama };
    let optim = recipe.optim.init(&no_decay);
    let schedule = lr_schedule(recipe)?;
    let dir = folder.join(if adaptive { "copus" } else { "fixed" });
    let valid = DataLoaderBuilder::new(TokenBatcher).batch_size(t.micro_batch).build(Sequences {
        data: heldout.clone(),
        len: eval,
        shuffled: false,
    });

    let started = Instant::now();
    let (result, copus) = if adaptive {
        let copus = copus_batching(t)?;
        let loader =
            DataLoaderBuilder::new(TokenBatcher).batch_size(t.micro_batch).build(Sequences { data: train, len: samples, shuffled: true });
        let learner = copus.learner(model, optim, schedule); // copus: the scaled scheduler
        let result = SupervisedTraining::new(&dir, loader, valid)
            .with_copus(&copus, device.clone()) // copus: strategy and metrics
            .metric_train_numeric(LossMetric::new())
            .metric_valid_numeric(LossMetric::new())
            .metric_train_numeric(LearningRateMetric::new())
            .with_application_logger(None)
            .summary()
            .launch(learner);
        (result, Some(copus))
    } else {
        let loader =
            DataLoaderBuilder::new(TokenBatcher).batch_size(t.global_batch).build(Sequences { data: train, len: samples, shuffled: true });
        let learner = Learner::new(model, optim, schedule);
        let result = SupervisedTraining::new(&dir, loader, valid)
            .with_training_strategy(TrainingStrategy::Default(burn::train::ExecutionStrategy::single(device.clone())))
            .metric_train_numeric(LossMetric::new())
            .metric_valid_numeric(LossMetric::new())
            .metric_train_numeric(LearningRateMetric::new())
            .with_application_logger(None)
            .summary()
            .launch(learner);
        (result, None)
    };
    let seconds = started.elapsed().as_secs_f64();
    if let Some(e) = result.error {
        return Err(anyhow!("training failed: {e}"));
    }
    let model = result.model;
    let heldout_loss = crate::eval::evaluate(&model.llama, &heldout, eval, t.micro_batch);
    let (steps, final_batch, b_simple) = match &copus {
        Some(c) => copus_outcome(c, &dir)?,
        None => (samples.div_ceil(t.global_batch) as u64, t.global_batch, None),
    };
    Ok(LearnerRun {
        label: if adaptive { "copus" } else { "fixed" },
        steps,
        samples: samples as u64,
        final_batch,
        b_simple,
        heldout_loss,
        seconds,
        dir,
    })
}

/// The recipe's learning-rate schedule: cosine annealing from `optim.lr` to
/// `optim.lr x optim.min_lr_ratio` over `optim.total_steps`.
fn lr_schedule(recipe: &Recipe) -> anyhow::Result<ModuleLrScheduler> {
    CosineAnnealingLrSchedulerConfig::new(recipe.optim.lr, recipe.optim.total_steps.max(1) as usize)
        .with_min_lr(recipe.optim.lr * recipe.optim.min_lr_ratio)
        .init()
        .map_err(|e| anyhow!("learning-rate schedule: {e}"))
}

/// copus's batching for the recipe: loader batches are micro-batches; B0 = the recipe's global
/// batch, at most 8 times it.
fn copus_batching(t: &TrainRecipe) -> anyhow::Result<CopusBatching> {
    Ok(CopusBatchingConfig::new(t.micro_batch)
        .with_initial_accumulation(t.global_batch / t.micro_batch)
        .with_max_accumulation(8 * t.global_batch / t.micro_batch)
        .init()?)
}

/// Writes every optimizer step as copus ran it (plan, norms, B_simple, LR factor, time) to
/// `dir/copus-steps.jsonl`; returns the steps, the final batch and B_simple.
fn copus_outcome(c: &CopusBatching, dir: &Path) -> anyhow::Result<(u64, usize, Option<f64>)> {
    let path = dir.join("copus-steps.jsonl");
    let lines: Vec<String> = c.history().iter().filter_map(|r| serde_json::to_string(r).ok()).collect();
    std::fs::write(&path, lines.join("\n") + "\n").map_err(|e| anyhow!("{}: {e}", path.display()))?;
    let s = c.snapshot();
    Ok((s.steps, s.plan.batch(), s.b_simple))
}

/// Train the recipe's model and data with Burn's `SupervisedTraining` and copus's adaptive
/// batching (the Learner add-on); `--fixed` for the plain Learner, `--compare` for both.
#[derive(clap::Args)]
pub struct LearnerArgs {
    /// The recipe (RON), e.g. recipes/shakespeare-tiny.ron.
    recipe: PathBuf,
    /// The plain Learner at the recipe's global batch.
    #[arg(long, conflicts_with = "compare")]
    fixed: bool,
    /// Both runs, then a table.
    #[arg(long)]
    compare: bool,
    /// Training sequences (default: the recipe's max_steps x global_batch).
    #[arg(long)]
    max_samples: Option<usize>,
}

impl LearnerArgs {
    /// `recipes learner`: runs it and prints the table and where Burn's logs are.
    pub fn exec(self) -> anyhow::Result<()> {
        println!("{}", run(&self.recipe, self.fixed, self.compare, self.max_samples)?);
        Ok(())
    }
}

/// The `learner` subcommand.
pub fn run(recipe_path: &Path, fixed: bool, compare: bool, max_samples: Option<usize>) -> anyhow::Result<String> {
    let recipe = Recipe::load(recipe_path)?;
    let (runs, summary) = run_recipe(&recipe, fixed, compare, max_samples)?;
    let dirs: Vec<String> = runs.iter().map(|r| format!("- {}: Burn's logs in {}", r.label, r.dir.display())).collect();
    Ok(format!("{}\n{}\nsummary: {}", table(&runs), dirs.join("\n"), summary.display()))
}

fn table(runs: &[LearnerRun]) -> String {
    let mut table = String::from(
        "| run | optimizer steps | sequences | final batch | B_simple | held-out loss | wall s |\n|---|---|---|---|---|---|---|\n",
    );
    for r in runs {
        table += &format!(
            "| {} | {} | {} | {} | {} | {:.4} | {:.1} |\n",
            r.label,
            r.steps,
            r.samples,
            r.final_batch,
            r.b_simple.map_or("-".into(), |b| format!("{b:.1}")),
            r.heldout_loss,
            r.seconds
        );
    }
    table
}

/// Runs the chosen modes on a parsed recipe; returns the runs and the summary file.
pub fn run_recipe(recipe: &Recipe, fixed: bool, compare: bool, max_samples: Option<usize>) -> anyhow::Result<(Vec<LearnerRun>, PathBuf)> {
    let t = &recipe.train;
    if t.micro_batch == 0 || !t.global_batch.is_multiple_of(t.micro_batch) {
        return Err(anyhow!("`train.micro_batch` ({}) must divide `train.global_batch` ({})", t.micro_batch, t.global_batch));
    }
    if max_samples == Some(0) {
        return Err(anyhow!("`--max-samples` must be 1 or more"));
    }
    let Prepared { spec, train: train_data, heldout, .. } = prepare(recipe)?;
    let data = Data { spec, train: Arc::new(train_data), heldout: Arc::new(heldout) };
    let folder = run_folder(Path::new(&recipe.output_dir), &format!("{}-learner", recipe.name))?;
    let modes: Vec<bool> = if compare { vec![false, true] } else { vec![!fixed] };
    let mut runs = Vec::new();
    for adaptive in modes {
        runs.push(train(recipe, &data, adaptive, max_samples, &folder)?);
    }
    let summary = folder.join("summary.md");
    let dirs: Vec<String> = runs.iter().map(|r| format!("- {}: Burn's logs in {}", r.label, r.dir.display())).collect();
    std::fs::write(&summary, format!("{}\n{}\n", table(&runs), dirs.join("\n"))).map_err(|e| anyhow!("{}: {e}", summary.display()))?;
    Ok((runs, summary))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Both runs on the real corpus in miniature: the same sequences, Burn's logs with copus's
    /// metrics, a held-out loss below the uniform guess.
    #[test]
    fn the_learner_example_trains_with_and_without_copus() {
        let out = tempfile::tempdir().unwrap();
        let text = format!(
            r#"(
                name: "learner-smoke",
                output_dir: "{}",
                model: (preset: "tiny-1m", seq_len: Some(32)),
                data: (heldout_plays: ["macbeth"], tokenizer: Bpe(vocab_size: 512)),
                train: (global_batch: 8, micro_batch: 4, max_steps: 12, eval_sequences: 16),
                optim: (lr: 3e-3, b0: 8, warmup_steps: 2, total_steps: 40),
            )"#,
            out.path().display()
        );
        let recipe = Recipe::parse(&text, "learner-smoke").unwrap();
        let (runs, summary) = run_recipe(&recipe, false, true, Some(256)).unwrap();
        assert_eq!(runs.len(), 2);
        assert!(summary.exists());
        let uniform = (512f64).ln();
        for r in &runs {
            assert_eq!(r.samples, 256);
            assert!(r.heldout_loss.is_finite() && r.heldout_loss < uniform - 0.5, "{}: {}", r.label, r.heldout_loss);
        }
        let (fixed, copus) = (&runs[0], &runs[1]);
        assert_eq!((fixed.label, copus.label), ("fixed", "copus"));
        assert_eq!(fixed.steps, 32);
        assert!(copus.steps >= 1 && copus.steps <= 32, "{} steps", copus.steps);
        assert!(copus.b_simple.is_some(), "the noise scale was measured");
        let steps = std::fs::read_to_string(copus.dir.join("copus-steps.jsonl")).unwrap();
        assert_eq!(steps.lines().count() as u64, copus.steps);
        let log = std::fs::read_to_string(copus.dir.join("train/epoch-1/Batch_Size.log")).expect("copus metric in Burn's logs");
        assert_eq!(log.lines().filter(|l| !l.ends_with(",final")).count(), 256 / 4);
        assert!(!fixed.dir.join("train/epoch-1/Batch_Size.log").exists());
        assert!(fixed.dir.join("train/epoch-1/Loss.log").exists());
    }

    #[test]
    fn bad_arguments_are_refused() {
        let text = r#"(
            name: "x",
            model: (preset: "tiny-1m", seq_len: Some(32)),
            data: (heldout_plays: ["macbeth"], tokenizer: Bpe(vocab_size: 512)),
            train: (global_batch: 8, micro_batch: 4, max_steps: 1),
            optim: (lr: 3e-3, b0: 8, warmup_steps: 0, total_steps: 1),
        )"#;
        let recipe = Recipe::parse(text, "x").unwrap();
        let e = run_recipe(&recipe, false, false, Some(0)).err().unwrap().to_string();
        assert!(e.contains("--max-samples"), "{e}");
    }
}
