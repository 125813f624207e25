//! Peak memory against the memory model (`recipes bench memory`).
//!
//! Each row runs in a child process of this binary, so that its peak resident set is its own:
//! the child builds the engine for one configuration on Flex (every rank a thread of the
//! child), drops the initial weights it built it from, starts the kernel's peak count again
//! (`/proc/self/clear_refs`), trains a few steps and reports its peak resident set above what
//! it held before it built anything. The child's allocator returns freed memory at once
//! (`MIMALLOC_PURGE_DELAY=0`), so the resident set follows the live bytes. The table sets the
//! measurement beside the model's prediction for the whole process: the sum over the ranks of
//! their stage's [`MemoryModel::estimate_stage`].

use std::sync::Arc;

use anyhow::{Context, anyhow, bail};
use burn::tensor::Device;
use copus_burn::{Engine, EngineConfig, OptimConfig};
use copus_core::layout::ParallelDims;
use copus_core::memory::{Checkpointing, MemoryModel, Precision};
use copus_core::model::ModelSpec;
use copus_core::schedule::ScheduleKind;
use copus_models::{LlamaConfig, full_params};

use crate::profile::synthetic_batch;

/// Micro-batches per data-parallel replica in every row (two, so a pipeline holds more than one
/// in flight under GPipe).
const MICRO_PER_REPLICA: usize = 2;
/// Steps trained per row (the first allocates the optimizer's moments).
const STEPS: usize = 3;

/// One measured configuration.
#[derive(Clone, Debug, PartialEq)]
pub struct Row {
    /// The model preset.
    pub preset: String,
    /// Sequence length.
    pub seq: usize,
    /// The layout.
    pub dims: ParallelDims,
    /// Sequences per micro-batch.
    pub micro_batch: usize,
    /// The pipeline schedule.
    pub schedule: ScheduleKind,
    /// Activation checkpointing.
    pub checkpointing: Checkpointing,
    /// Not among the rows [`MemoryModel::engine_f32`] was fitted to.
    pub held_out: bool,
}

impl Row {
    fn spec(&self) -> anyhow::Result<ModelSpec> {
        Ok(ModelSpec { seq_len: self.seq, ..ModelSpec::preset(&self.preset)? })
    }

    fn global_batch(&self) -> usize {
        self.dims.dp * self.micro_batch * MICRO_PER_REPLICA
    }

    /// The model's bytes for the whole process: every rank's stage estimate, summed.
    pub fn predicted(&self, model: &MemoryModel) -> anyhow::Result<f64> {
        let spec = self.spec()?;
        let mm = MemoryModel { checkpointing: self.checkpointing, ..*model };
        let per_stage: f64 = (0..self.dims.pp)
            .map(|s| mm.estimate_stage(&spec, self.dims, self.micro_batch, MICRO_PER_REPLICA, self.schedule, s).total())
            .sum();
        Ok(per_stage * (self.dims.dp * self.dims.tp) as f64)
    }
}

/// The rows of `bench memory`: tiny-5m and tiny-20m on five layouts, B_m 2 and 8, without
/// checkpointing and with both kinds; small-100m on three layouts, B_m 1 and 4, without and with
/// `Regions` (sequence 256 throughout): the rows [`MemoryModel::engine_f32`] was fitted to. Then
/// held-out rows it was not fitted to (B_m 4, 1F1B on two stages, dp2 of small-100m).
pub fn rows(presets: &[String]) -> Vec<Row> {
    let mut out = Vec::new();
    let want = |p: &str| presets.is_empty() || presets.iter().any(|q| q == p);
    let d = |dp, tp, pp| ParallelDims { dp, tp, pp };
    let row = |preset: &str, dims: ParallelDims, micro_batch, schedule, checkpointing, held_out| Row {
        preset: preset.into(),
        seq: 256,
        dims,
        micro_batch,
        schedule,
        checkpointing,
        held_out,
    };
    let kinds = [Checkpointing::None, Checkpointing::Layers, Checkpointing::Regions];
    for preset in ["tiny-5m", "tiny-20m"].into_iter().filter(|p| want(p)) {
        for dims in [d(1, 1, 1), d(2, 1, 1), d(1, 2, 1), d(1, 1, 2), d(2, 2, 2)] {
            for micro_batch in [2, 8] {
                for ck in kinds {
                    let schedule = if dims.pp > 1 { ScheduleKind::GPipe } else { ScheduleKind::OneFOneB };
                    out.push(row(preset, dims, micro_batch, schedule, ck, false));
                }
            }
        }
    }
    if want("small-100m") {
        for dims in [d(1, 1, 1), d(1, 2, 1), d(1, 1, 2)] {
            for micro_batch in [1, 4] {
                for ck in [Checkpointing::None, Checkpointing::Regions] {
                    out.push(row("small-100m", dims, micro_batch, ScheduleKind::GPipe, ck, false));
                }
            }
        }
    }
    if want("tiny-20m") {
        for (dims, schedule) in
            [(d(1, 1, 1), ScheduleKind::OneFOneB), (d(1, 1, 2), ScheduleKind::OneFOneB), (d(2, 1, 2), ScheduleKind::GPipe)]
        {
            for ck in [Checkpointing::None, Checkpointing::Regions] {
                out.push(row("tiny-20m", dims, 4, schedule, ck, true));
            }
        }
    }
    if want("small-100m") {
        for ck in [Checkpointing::None, Checkpointing::Regions] {
            out.push(row("small-100m", d(2, 1, 1), 2, ScheduleKind::OneFOneB, ck, true));
        }
    }
    out
}

/// Measures every row in a child process and prints the table.
pub fn run(presets: &[String]) -> anyhow::Result<()> {
    let rows = rows(presets);
    let model = MemoryModel::engine_f32();
    println!(
        "Peak memory of the engine's ranks (one process, Flex, {STEPS} steps, {MICRO_PER_REPLICA} micro-batches per replica) against the memory model (MemoryModel::engine_f32)\n"
    );
    println!("| model | layout | schedule | B_m | checkpointing | fitted on | measured MiB | predicted MiB | predicted / measured |");
    println!("|---|---|---|---:|---|---|---:|---:|---:|");
    let bar = crate::report::progress::Progress::new("bench memory", rows.len() as u64);
    let (mut fitted, mut held) = (Vec::new(), Vec::new());
    for row in &rows {
        let measured = measure_in_child(row)? as f64;
        let predicted = row.predicted(&model)?;
        let ratio = predicted / measured;
        if row.held_out { &mut held } else { &mut fitted }.push(ratio);
        bar.inc(1);
        println!(
            "| {} | {} | {:?} | {} | {:?} | {} | {:.1} | {:.1} | {:.2} |",
            row.preset,
            row.dims,
            row.schedule,
            row.micro_batch,
            row.checkpointing,
            if row.held_out { "no" } else { "yes" },
            measured / MIB,
            predicted / MIB,
            ratio
        );
    }
    bar.finish();
    for (name, ratios) in [("fitted", &fitted), ("held-out", &held)] {
        if let Some((lo, hi)) = span(ratios) {
            println!("{name}: {} rows, predicted / measured from {lo:.2} to {hi:.2}", ratios.len());
        }
    }
    Ok(())
}

const MIB: f64 = 1024.0 * 1024.0;

/// The smallest and largest of `xs`; `None` if empty.
fn span(xs: &[f64]) -> Option<(f64, f64)> {
    let lo = xs.iter().copied().reduce(f64::min)?;
    Some((lo, xs.iter().copied().fold(lo, f64::max)))
}

/// Runs `row` in a child process of this binary; its peak bytes.
pub fn measure_in_child(row: &Row) -> anyhow::Result<u64> {
    measure_with(&std::env::current_exe().context("this binary's path")?, row)
}

/// Runs `row` in a child process of the `recipes` binary at `exe`; its peak bytes.
pub fn measure_with(exe: &std::path::Path, row: &Row) -> anyhow::Result<u64> {
    let out = std::process::Command::new(exe)
        .env("MIMALLOC_PURGE_DELAY", "0")
        .args(["bench", "memory-child", "--quiet", "--preset", &row.preset, "--seq", &row.seq.to_string()])
        .args(["--layout", &format!("{},{},{}", row.dims.dp, row.dims.tp, row.dims.pp)])
        .args(["--micro-batch", &row.micro_batch.to_string(), "--schedule", &format!("{:?}", row.schedule)])
        .args(["--checkpointing", &format!("{:?}", row.checkpointing)])
        .output()
        .context("starting the measuring child")?;
    let text = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        bail!("the child for {row:?} failed: {}", String::from_utf8_lossy(&out.stderr));
    }
    text.lines()
        .find_map(|l| l.strip_prefix("peak-bytes "))
        .and_then(|v| v.trim().parse().ok())
        .ok_or_else(|| anyhow!("the child for {row:?} reported no peak: {text}"))
}

/// The child's side: builds the row's engine in `precision`, trains, prints `peak-bytes N`.
pub fn child(row: &Row, precision: Precision) -> anyhow::Result<()> {
    let before = status_kib("VmRSS")?;
    let spec = row.spec()?;
    let cfg = LlamaConfig::from_spec(&spec);
    let device = Device::flex().autodiff();
    let full = full_params(&cfg.init(&device));
    let optim = OptimConfig { warmup_steps: 0, ..OptimConfig::default() };
    let ec = EngineConfig::new(row.dims, row.global_batch(), row.micro_batch, row.seq, optim)
        .with_schedule(row.schedule)
        .with_checkpointing(row.checkpointing)
        .with_precision(precision);
    let mut engine = Engine::new(Arc::new(cfg), &full, ec)?;
    drop(full);
    // The peak from here on: the engine's state and its steps.
    std::fs::write("/proc/self/clear_refs", "5").context("resetting the peak resident set (/proc/self/clear_refs)")?;
    for i in 0..STEPS {
        engine.step(synthetic_batch(row.global_batch(), row.seq, spec.vocab_size, i))?;
    }
    let peak = status_kib("VmHWM")?;
    println!("peak-bytes {}", peak.saturating_sub(before) * 1024);
    Ok(())
}

/// A `/proc/self/status` field in KiB (Linux).
fn status_kib(field: &str) -> anyhow::Result<u64> {
    let text = std::fs::read_to_string("/proc/self/status").context("reading /proc/self/status (bench memory needs Linux)")?;
    text.lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':')?.trim().strip_suffix("kB")?.trim().parse().ok())
        .ok_or_else(|| anyhow!("/proc/self/status has no {field}"))
}

/// Parses `dp,tp,pp`.
pub fn parse_layout(text: &str) -> anyhow::Result<ParallelDims> {
    let d: Vec<usize> = text.split(',').map(|p| p.trim().parse()).collect::<Result<_, _>>().context("--layout dp,tp,pp")?;
    let [dp, tp, pp] = d[..] else { bail!("--layout takes three numbers, dp,tp,pp") };
    Ok(ParallelDims::new(dp, tp, pp, dp * tp * pp)?)
}
