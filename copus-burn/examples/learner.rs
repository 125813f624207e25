//! copus's adaptive batching added to a burn-train `SupervisedTraining` run, as a Burn user
//! would add it: a small Llama-style model learns next bytes of real text on the CPU, and the
//! batch schedule copus chose is printed at the end.
//!
//! ```text
//! cargo run --release -p copus-burn --example learner --features learner [-- TEXT_FILE [SAMPLES]]
//! ```
//!
//! The text is any UTF-8 file (by default this repository's README.md), read as bytes: the
//! vocabulary is the 256 byte values, so no tokenizer is needed. Everything but the lines marked
//! `copus:` is what a burn-train user already writes.

use std::path::PathBuf;
use std::sync::Arc;

use burn::data::dataloader::DataLoaderBuilder;
use burn::data::dataset::{Dataset, DatasetError};
use burn::optim::lr_scheduler::cosine::CosineAnnealingLrSchedulerConfig;
use burn::tensor::Device;
use burn::train::SupervisedTraining;
use burn::train::metric::{LearningRateMetric, LossMetric};
use copus_burn::learner::{CopusBatchingConfig, CopusTrainingExt};
use copus_burn::{CausalLm, OptimConfig};
use copus_core::model::ModelSpec;
use copus_models::LlamaConfig;
use copus_models::learner::{LanguageModel, TokenBatcher};

/// Tokens per training window (the model reads `SEQ`, predicts the next byte at each place).
const SEQ: usize = 64;

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

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let path = args.next().map_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../README.md"), PathBuf::from);
    let samples: usize = args.next().map(|s| s.parse()).transpose()?.unwrap_or(1536);
    let bytes = Arc::new(std::fs::read(&path).map_err(|e| format!("{}: {e}", path.display()))?);
    let windows = bytes.len().saturating_sub(1) / SEQ;
    if windows < 20 {
        return Err(format!("{}: {} bytes is too little text (at least {} needed)", path.display(), bytes.len(), 20 * SEQ + 1).into());
    }
    // A tenth of the windows, at the end of the text, are held out.
    let heldout = windows / 10;
    let train = Windows { bytes: bytes.clone(), count: windows - heldout, first: 0 };
    let valid = Windows { bytes, count: heldout.min(64), first: windows - heldout };
    println!("{}: {} training windows of {SEQ} bytes, {} held out; {samples} training samples", path.display(), train.count, valid.count);

    let device = Device::flex().autodiff();
    device.seed(0);
    let spec = ModelSpec { name: "bytes-1m".into(), vocab_size: 256, seq_len: SEQ, ..ModelSpec::tiny_1m() };
    let llama = LlamaConfig::from_spec(&spec).init(&device);
    let no_decay = llama.no_decay_predicates();
    let optim_cfg = OptimConfig::new().with_lr(3e-3).with_warmup_steps(0);
    let optim = optim_cfg.init(&no_decay);
    let schedule = CosineAnnealingLrSchedulerConfig::new(optim_cfg.lr, 200).with_min_lr(optim_cfg.lr * 0.1).init()?;

    // copus: the loader's batch of 4 is the micro-batch; 4 of them make the first step's batch
    // of 16, the batch the learning rate is set for (B0).
    let copus = CopusBatchingConfig::new(4).with_initial_accumulation(4).with_max_accumulation(16).init()?;
    let train = DataLoaderBuilder::new(TokenBatcher).batch_size(4).shuffle(0).build(Windows { count: samples.min(train.count), ..train });
    let valid = DataLoaderBuilder::new(TokenBatcher).batch_size(4).build(valid);
    let dir = std::env::temp_dir().join(format!("copus-learner-example-{}", std::process::id()));
    let learner = copus.learner(LanguageModel { llama }, optim, schedule); // copus: the batch-scaled scheduler
    let result = SupervisedTraining::new(&dir, train, valid)
        .with_copus(&copus, device) // copus: the training strategy and its three metrics
        .metric_train_numeric(LossMetric::new())
        .metric_valid_numeric(LossMetric::new())
        .metric_train_numeric(LearningRateMetric::new())
        .with_application_logger(None)
        .num_epochs(1)
        .launch(learner);
    if let Some(e) = result.error {
        return Err(format!("training failed: {e}").into());
    }

    println!(
        "\nbatch schedule (one line per change):\n| step | samples so far | B_m x accumulation = batch | B_simple | LR factor |\n|---:|---:|---|---:|---:|"
    );
    let history = copus.history();
    let mut last = None;
    for r in &history {
        if last != Some(r.plan) || r.step == 1 {
            let b = r.b_simple.map_or("-".into(), |b| format!("{b:.1}"));
            println!(
                "| {} | {} | {} x {} = {} | {b} | {:.3} |",
                r.step,
                r.samples_total,
                r.plan.micro_batch,
                r.plan.accumulation,
                r.plan.batch(),
                r.lr_factor
            );
            last = Some(r.plan);
        }
    }
    let s = copus.snapshot();
    println!(
        "\n{} optimizer steps over {} samples; final batch {}, B_simple {}",
        s.steps,
        s.samples,
        s.plan.batch(),
        s.b_simple.map_or("not measured".into(), |b| format!("{b:.1}"))
    );
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}
