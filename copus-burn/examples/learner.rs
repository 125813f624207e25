//! copus's adaptive batching added to a burn-train `SupervisedTraining` run, as a Burn user
//! would add it: a small Llama-style model learns next bytes of real text on two Flex devices
//! (two worker threads on the CPU), and copus grows the batch as the gradient noise scale
//! grows.
//!
//! ```text
//! cargo run --release -p copus-burn --example learner --features learner [-- TEXT_FILE [SAMPLES]]
//! ```
//!
//! The text is any UTF-8 file, read as bytes (the vocabulary is the 256 byte values, so no
//! tokenizer is needed); by default it is this repository's README.md followed by every
//! docs/*.md in sorted order, about 250 KB. One epoch draws SAMPLES windows of it (default
//! 13000, nearly all of the default text). A progress bar shows training on a terminal; the
//! epoch's metrics and copus's batch schedule are printed at the end. Everything but the lines
//! marked `copus:` is what a burn-train user already writes.

use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use burn::data::dataloader::{BatchDataLoader, DataLoaderBuilder};
use burn::data::dataset::transform::{PartialDataset, ShuffledDataset};
use burn::data::dataset::{Dataset, DatasetError};
use burn::optim::lr_scheduler::cosine::CosineAnnealingLrSchedulerConfig;
use burn::tensor::Device;
use burn::train::logger::{EvaluationProgressLogger, TrainingProgressLogger};
use burn::train::metric::{LearningRateMetric, LossMetric, MetricDefinition, MetricId, NumericEntry};
use burn::train::renderer::{EvaluationName, MetricState, MetricsRenderer, MetricsRendererEvaluation, MetricsRendererTraining};
use burn::train::{LearnerSummary, SupervisedTraining};
use copus_burn::learner::{CopusBatchingConfig, StepRecord};
use copus_burn::{CausalLm, OptimConfig};
use copus_core::model::ModelSpec;
use copus_models::LlamaConfig;
use copus_models::learner::{LanguageModel, TokenBatcher};
use indicatif::{ProgressBar, ProgressStyle};

/// Bytes per training window (the model reads `SEQ`, predicts the next byte at each place).
/// Short windows make a sample cheap next to the fixed cost of running a micro-batch, the
/// regime where a larger batch buys throughput.
const SEQ: usize = 16;

/// Windows of `SEQ + 1` bytes of the text, at a stride of `SEQ`.
struct Windows {
    bytes: Arc<Vec<u8>>,
    count: usize,
    /// The first window (the held-out split starts after the training one).
    first: usize,
}

impl Dataset<Vec<u32>> for Windows {
    fn get(&self, index: usize) -> Result<Vec<u32>, DatasetError> {
        if index >= self.count {
            return Err(DatasetError::new(std::io::Error::other(format!("window {index} of {}", self.count))));
        }
        let start = (self.first + index) * SEQ;
        Ok(self.bytes[start..start + SEQ + 1].iter().map(|&b| u32::from(b)).collect())
    }

    fn len(&self) -> usize {
        self.count
    }
}

/// The default text: the repository's README.md, then docs/*.md in sorted order.
fn default_text() -> std::io::Result<(String, Vec<u8>)> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut docs = Vec::new();
    for entry in std::fs::read_dir(root.join("docs"))? {
        let path: PathBuf = entry?.path();
        if path.extension().is_some_and(|x| x == "md") {
            docs.push(path);
        }
    }
    docs.sort();
    let mut bytes = std::fs::read(root.join("README.md"))?;
    for doc in &docs {
        bytes.extend(std::fs::read(doc)?);
    }
    Ok((format!("README.md + {} docs/*.md", docs.len()), bytes))
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let (name, bytes) = match args.next() {
        Some(path) => (path.clone(), std::fs::read(&path).map_err(|e| format!("{path}: {e}"))?),
        None => default_text()?,
    };
    let samples: usize = args.next().map(|s| s.parse()).transpose()?.unwrap_or(13_000);
    let bytes = Arc::new(bytes);
    let windows = bytes.len().saturating_sub(1) / SEQ;
    if windows < 20 {
        return Err(format!("{name}: {} bytes is too little text (at least {} needed)", bytes.len(), 20 * SEQ + 1).into());
    }
    // A tenth of the windows, at the end of the text, are held out; training draws its samples
    // at random from the rest.
    let heldout = windows / 10;
    let train = Windows { bytes: bytes.clone(), count: windows - heldout, first: 0 };
    let valid = Windows { bytes: bytes.clone(), count: heldout.min(256), first: windows - heldout };
    let samples = samples.clamp(1, train.count);
    println!("{name}: {} bytes; {samples} of {} training windows of {SEQ} bytes, {} held out", bytes.len(), train.count, valid.count);
    let train = PartialDataset::new(ShuffledDataset::new(train, 0u64), 0, samples);

    let device = Device::flex().autodiff();
    device.seed(0);
    let spec = ModelSpec { name: "bytes-1m".into(), vocab_size: 256, seq_len: SEQ, ..ModelSpec::tiny_1m() };
    let llama = LlamaConfig::from_spec(&spec).init(&device);
    let no_decay = llama.no_decay_predicates();
    let optim_cfg = OptimConfig::new().with_lr(3e-3).with_warmup_steps(0);
    let optim = optim_cfg.init(&no_decay);
    // The cosine decay spans the run in steps of the reference batch of 4.
    let schedule = CosineAnnealingLrSchedulerConfig::new(optim_cfg.lr, samples.div_ceil(4)).with_min_lr(optim_cfg.lr * 0.1).init()?;

    // copus: a micro-batch of 2 on each of the two devices makes the first step's batch of 4,
    // the batch the learning rate is set for (B0). copus may switch the loader to micro-batches
    // of 4 to 32 and run two rounds per step; the noise scale is smoothed over ~20 steps.
    let copus = CopusBatchingConfig::new(2)
        .with_initial_accumulation(2)
        .with_micro_batch_options(vec![2, 4, 8, 16, 32])
        .with_max_accumulation(4)
        .with_smoothing(0.95)
        .init()?;
    // copus: the training loader cuts batches of copus's current micro-batch.
    let train =
        Arc::new(BatchDataLoader::new(Box::new(copus.batch_strategy()), Arc::new(train), Arc::new(TokenBatcher), device.clone(), None));
    let valid = DataLoaderBuilder::new(TokenBatcher).batch_size(64).build(valid);
    let dir = std::env::temp_dir().join(format!("copus-learner-example-{}", std::process::id()));
    let learner = copus.learner(LanguageModel { llama }, optim, schedule); // copus: the batch-scaled scheduler
    let started = Instant::now();
    let result = SupervisedTraining::new(&dir, train, valid)
        .metric_train_numeric(LossMetric::new())
        .metric_valid_numeric(LossMetric::new())
        .metric_train_numeric(LearningRateMetric::new())
        .with_training_strategy(copus.training_strategy_multi(vec![device.clone(); 2])?) // copus: the strategy, on two devices
        .metric_train_numeric(copus.noise_scale_metric()) // copus: its three metrics
        .metric_train_numeric(copus.batch_size_metric())
        .metric_train_numeric(copus.efficiency_metric())
        .renderer(Box::new(ProgressBarRenderer::default()))
        .with_application_logger(None)
        .num_epochs(1)
        .launch(learner);
    let seconds = started.elapsed().as_secs_f64();
    let _ = std::fs::remove_dir_all(&dir);
    if let Some(e) = result.error {
        return Err(format!("training failed: {e}").into());
    }
    print_schedule(&copus.history(), copus.b0(), seconds);
    Ok(())
}

/// One row per plan copus ran, with the reason it was chosen: the start, the first run of a
/// micro-batch size (its cost is measured before the cost model is trusted), or Goodput at
/// the noise scale measured when copus decided.
fn print_schedule(history: &[StepRecord], b0: usize, seconds: f64) {
    println!("\nbatch schedule (B0 = {b0}; B_m: micro-batch per device, k: micro-batches per step):");
    println!("| steps | samples | B_m x k = batch | chosen | LR factor |");
    println!("|---|---|---|---|---:|");
    let b_simple = |r: &StepRecord| r.b_simple.map_or("not measured".into(), |b| format!("B_simple {b:.1}"));
    let mut seen = BTreeSet::new();
    let (mut measuring, mut goodput) = (0, 0);
    let mut start = 0;
    for end in 0..history.len() {
        if history.get(end + 1).is_some_and(|next| next.plan == history[start].plan) {
            continue;
        }
        let (first, last) = (&history[start], &history[end]);
        // A batch change, not only a new split of the same batch.
        let changed = start > 0 && history[start - 1].plan.batch() != first.plan.batch();
        let chosen = match start.checked_sub(1) {
            None => "at the start (B0)".to_string(),
            Some(_) if !seen.contains(&first.plan.micro_batch) => {
                measuring += usize::from(changed);
                format!("to measure B_m = {}", first.plan.micro_batch)
            }
            Some(before) => {
                goodput += usize::from(changed);
                format!("Goodput at {}", b_simple(&history[before]))
            }
        };
        seen.insert(first.plan.micro_batch);
        println!(
            "| {}-{} | {}-{} | {} x {} = {} | {chosen} | {:.3} |",
            first.step,
            last.step,
            first.samples_total - first.samples as u64,
            last.samples_total,
            first.plan.micro_batch,
            first.plan.accumulation,
            first.plan.batch(),
            first.lr_factor
        );
        start = end + 1;
    }
    let (steps, samples) = history.last().map_or((0, 0), |r| (r.step, r.samples_total));
    let last = history.last().map_or("not measured".into(), b_simple);
    println!(
        "\n{steps} optimizer steps over {samples} samples in {seconds:.0} s; the batch changed {} times ({measuring} to measure a \
         micro-batch size, {goodput} on Goodput); final {last}",
        measuring + goodput
    );
}

/// burn-train's metrics as one progress bar (on stderr, drawn only on a terminal): the split,
/// its samples, the epoch's mean loss so far, and the latest batch and noise scale. The
/// epoch's metrics are printed when training ends.
#[derive(Default)]
struct ProgressBarRenderer {
    bar: Option<ProgressBar>,
    names: HashMap<MetricId, String>,
    /// Each metric by split, in the order first seen: (latest value, sum, count) of the epoch.
    values: Vec<(MetricKey, Tally)>,
}

/// A metric of a split: (split, metric name).
type MetricKey = (&'static str, String);

/// A metric's latest value, and the sum and count of its values in the epoch.
type Tally = (f64, f64, usize);

impl ProgressBarRenderer {
    fn record(&mut self, split: &'static str, state: MetricState) {
        let MetricState::Numeric(entry, Some(value)) = state else { return };
        let Some(name) = self.names.get(&entry.metric_id) else { return };
        let (value, last) = match value {
            NumericEntry::Value(v) => (v, false),
            NumericEntry::Final(v) => (v, true),
            NumericEntry::Aggregated { aggregated_value, .. } => (aggregated_value, false),
        };
        if !value.is_finite() {
            return; // not measured yet
        }
        let key = (split, name.clone());
        let i = self.values.iter().position(|(k, _)| *k == key).unwrap_or_else(|| {
            self.values.push((key, (0.0, 0.0, 0)));
            self.values.len() - 1
        });
        let (latest, sum, count) = &mut self.values[i].1;
        // The epoch's final value is its mean.
        (*latest, *sum, *count) = if last { (value, value, 1) } else { (value, *sum + value, *count + 1) };
        if let Some(bar) = &self.bar {
            let get = |metric: &str| self.values.iter().find(|((s, n), _)| *s == split && n == metric).map(|(_, v)| *v);
            let mut message = get("Loss").map_or(String::new(), |(_, sum, n)| format!("loss {:.3}", sum / n as f64));
            if let Some((v, ..)) = get("Batch Size") {
                message += &format!("  batch {v:.0}");
            }
            if let Some((v, ..)) = get("Noise Scale (B_simple)") {
                message += &format!("  B_simple {v:.1}");
            }
            bar.set_message(message);
        }
    }
}

impl MetricsRendererTraining for ProgressBarRenderer {
    fn update_train(&mut self, state: MetricState) {
        self.record("train", state);
    }

    fn update_valid(&mut self, state: MetricState) {
        self.record("valid", state);
    }

    fn on_train_end(&mut self, _summary: Option<LearnerSummary>) -> Result<(), Box<dyn std::error::Error>> {
        println!("\nmetrics (means over the epoch):");
        for ((split, name), (_, sum, count)) in &self.values {
            let mean = sum / *count as f64;
            let mean = if mean.abs() < 1e-2 { format!("{mean:.2e}") } else { format!("{mean:.3}") };
            println!("  {split}  {name:<24} {mean}");
        }
        Ok(())
    }
}

impl TrainingProgressLogger for ProgressBarRenderer {
    fn start(&mut self, _epochs: usize, _starting_epoch: usize, _items: Option<usize>, _label: Option<&str>) {}

    fn update_epoch(&mut self, _epoch: usize) {}

    fn start_split(&mut self, split: &str, total_items: usize) {
        let bar = self.bar.get_or_insert_with(|| {
            let style = ProgressStyle::with_template("{prefix:>5} [{elapsed_precise}] {bar:30} {pos}/{len} samples  {msg}");
            ProgressBar::new(total_items as u64).with_style(style.expect("a valid template"))
        });
        bar.set_prefix(split.to_string());
        bar.set_length(total_items as u64);
        bar.set_position(0);
    }

    fn update_split(&mut self, items_processed: usize) {
        if let Some(bar) = &self.bar {
            bar.set_position(items_processed as u64);
        }
    }

    fn end_split(&mut self) {}

    fn end(&mut self) {
        if let Some(bar) = self.bar.take() {
            bar.finish_and_clear();
        }
    }

    fn log_event_training(&mut self, _event: String) {}
}

impl EvaluationProgressLogger for ProgressBarRenderer {
    fn start_global_progress(&mut self, _total_tests: usize) {}

    fn start_test(&mut self, _name: &str, _total_items: usize) {}

    fn update_test_progress(&mut self, _items_processed: usize) {}

    fn end_test(&mut self) {}

    fn end_global_progress(&mut self) {}

    fn log_event_evaluation(&mut self, _event: String) {}
}

impl MetricsRendererEvaluation for ProgressBarRenderer {
    fn update_test(&mut self, _name: EvaluationName, _state: MetricState) {}
}

impl MetricsRenderer for ProgressBarRenderer {
    fn manual_close(&mut self) {}

    fn register_metric(&mut self, definition: MetricDefinition) {
        self.names.insert(definition.metric_id, definition.name.to_string());
    }
}
