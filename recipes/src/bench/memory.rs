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
//!
//! On a GPU (`--backend Tch`, or `Wgpu` where `nvidia-smi` answers) the child measures the
//! device instead: the memory in use on the GPU (`nvidia-smi`) once the backend has started
//! and holds one small tensor, and again after the steps. Both backends keep what they free in
//! their own pools (LibTorch's caching allocator, cubecl's memory pages) and hand nothing back
//! to the driver within a run, so the second reading is the run's peak of those pools: the
//! difference is the engine's peak as the device sees it, the CUDA context excluded (printed
//! apart), allocator slack included.

use std::sync::Arc;

use anyhow::{Context, anyhow, bail};
use burn::tensor::Device;
use copus_burn::{Engine, EngineOptions, OptimConfig};
use copus_core::layout::ParallelDims;
use copus_core::memory::{Checkpointing, GPU_CONTEXT_BYTES, MemoryEstimate, MemoryModel, Precision};
use copus_core::model::ModelSpec;
use copus_core::schedule::ScheduleKind;
use copus_models::{LlamaConfig, full_params};

use crate::profile::synthetic_batch;
use crate::recipe::Backend;

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
    /// ZeRO-1: the optimizer state sharded over dp.
    pub zero1: bool,
    /// The arithmetic.
    pub precision: Precision,
    /// Not among the rows its model was fitted to ([`MemoryModel::engine_f32`] on Flex,
    /// [`MemoryModel::engine_gpu`] on a GPU).
    pub held_out: bool,
    /// Where the ranks train (all on the backend's first device).
    pub backend: Backend,
}

impl Row {
    fn spec(&self) -> anyhow::Result<ModelSpec> {
        Ok(ModelSpec { seq_len: self.seq, ..ModelSpec::preset(&self.preset)? })
    }

    fn global_batch(&self) -> usize {
        self.dims.dp * self.micro_batch * MICRO_PER_REPLICA
    }

    /// The engine's memory model for this row, for where the row is measured (the GPU model
    /// when it is measured on a GPU, else the host one; wgpu on lavapipe is measured in host
    /// memory), in its precision, with its checkpointing and ZeRO-1.
    pub fn model(&self) -> MemoryModel {
        MemoryModel::measured(self.precision, on_gpu(self.backend), self.checkpointing, self.zero1)
    }

    /// The model's bytes for the whole process: every rank's stage estimate, summed, less the
    /// CUDA context a GPU model counts per rank (the measurement leaves the process's one
    /// context out).
    pub fn predicted(&self) -> anyhow::Result<f64> {
        let ranks = (self.dims.dp * self.dims.tp) as f64;
        let stages = self.stage_estimates(&self.model())?.iter().map(MemoryEstimate::total).sum::<f64>();
        Ok((stages - self.context_per_rank() * self.dims.pp as f64) * ranks)
    }

    /// The CUDA context the row's model counts per rank: [`GPU_CONTEXT_BYTES`] on a GPU.
    fn context_per_rank(&self) -> f64 {
        if on_gpu(self.backend) { GPU_CONTEXT_BYTES } else { 0.0 }
    }

    /// `model`'s estimate of a rank on each pipeline stage.
    fn stage_estimates(&self, model: &MemoryModel) -> anyhow::Result<Vec<MemoryEstimate>> {
        let spec = self.spec()?;
        Ok((0..self.dims.pp)
            .map(|s| model.estimate_stage(&spec, self.dims, self.micro_batch, MICRO_PER_REPLICA, self.schedule, s))
            .collect())
    }

    /// The model's terms per stage as CSV lines (for refitting its coefficients): the row's
    /// `index`, the stage, its ranks, the measured bytes of the whole process, the rank's
    /// parameters, and the other terms at the model's coefficients, with the activations split into the part proportional to
    /// [`MemoryModel::activation_bytes`] (per byte) and the rest (the f32 logits).
    fn csv_lines(&self, index: usize, measured: f64) -> anyhow::Result<Vec<String>> {
        let model = self.model();
        let at = |b: f64| self.stage_estimates(&MemoryModel { activation_bytes: b, ..model });
        let (one, two) = (at(1.0)?, at(2.0)?);
        let ranks = self.dims.dp * self.dims.tp;
        Ok(self
            .stage_estimates(&model)?
            .iter()
            .zip(one.iter().zip(&two))
            .map(|(e, (a, b))| {
                let per_byte = b.activations - a.activations;
                let rest = a.activations - per_byte;
                format!(
                    "{index},{},{ranks},{measured},{},{},{},{per_byte},{rest},{},{},{},\"{}\",{},{:?},{:?},{},{}",
                    e.stage,
                    e.weights / model.weight_bytes,
                    e.grads,
                    e.optimizer,
                    e.step_transient,
                    e.overhead - self.context_per_rank(),
                    self.preset,
                    self.dims,
                    self.micro_batch,
                    self.checkpointing,
                    self.precision,
                    self.zero1,
                    self.held_out
                )
            })
            .collect())
    }
}

/// The header of [`Row::csv_lines`].
const CSV_HEADER: &str = "row,stage,ranks,measured,params,grads,optimizer,activation_per_byte,activation_rest,step_transient,overhead,preset,layout,micro_batch,checkpointing,precision,zero1,held_out";

/// Which rows `bench memory` measures.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Group {
    /// Every row.
    All,
    /// The ZeRO-1 rows and their unsharded twins.
    Zero1,
    /// The `Bf16Mixed` rows.
    Bf16,
    /// The rows for a GPU: small-100m, then tiny-20m, in f32 and bf16 mixed on the layouts and
    /// micro-batches [`Group::All`] has for them, fewer of them.
    Gpu,
}

/// The rows of `bench memory`: tiny-5m and tiny-20m on five layouts, B_m 2 and 8, without
/// checkpointing and with both kinds; small-100m on three layouts, B_m 1 and 4, without and with
/// `Regions` (sequence 256 throughout): the rows [`MemoryModel::engine_f32`] was fitted to. Then
/// held-out rows it was not fitted to (B_m 4, 1F1B on two stages, dp2 of small-100m), and
/// the ZeRO-1 rows, each beside its unsharded twin (held out too), and the `Bf16Mixed` rows
/// (tiny-5m and tiny-20m serial, tp2 and pp2, B_m 2 and 8, without checkpointing and with
/// `Regions`; held out: dp2), as `group` selects.
pub fn rows(presets: &[String], group: Group) -> Vec<Row> {
    let want = |p: &str| presets.is_empty() || presets.iter().any(|q| q == p);
    if group == Group::Gpu {
        return gpu_rows(&want);
    }
    let zero_pairs = zero1_rows(&want);
    let bf16 = bf16_rows(&want);
    match group {
        Group::Zero1 => return zero_pairs,
        Group::Bf16 => return bf16,
        Group::All | Group::Gpu => {}
    }
    let mut out = fitted_rows(&want);
    out.extend(held_out_rows(&want));
    out.extend(zero_pairs);
    out.extend(bf16);
    out
}

/// A layout: dp x tp x pp.
fn d(dp: usize, tp: usize, pp: usize) -> ParallelDims {
    ParallelDims { dp, tp, pp }
}

/// The pipeline schedule of a row on `dims` unless it names one: GPipe on several stages.
fn schedule_of(dims: ParallelDims) -> ScheduleKind {
    if dims.pp > 1 { ScheduleKind::GPipe } else { ScheduleKind::OneFOneB }
}

/// A row at sequence 256 in f32 on Flex without ZeRO-1.
fn row(preset: &str, dims: ParallelDims, micro_batch: usize, schedule: ScheduleKind, checkpointing: Checkpointing, held_out: bool) -> Row {
    Row {
        preset: preset.into(),
        seq: 256,
        dims,
        micro_batch,
        schedule,
        checkpointing,
        zero1: false,
        precision: Precision::F32,
        held_out,
        backend: Backend::Flex,
    }
}

/// [`Group::Gpu`]'s rows of the wanted presets.
fn gpu_rows(want: &dyn Fn(&str) -> bool) -> Vec<Row> {
    // Serial at both micro-batches with and without checkpointing, then tp2, pp2 and dp2
    // (with and without ZeRO-1) at the larger; each in both precisions. The GPU model
    // (`MemoryModel::engine_gpu`) was fitted to the small-100m rows, tiny-20m's held out.
    let mut gpu = Vec::new();
    for (preset, small, large) in [("small-100m", 1, 4), ("tiny-20m", 2, 8)].into_iter().filter(|(p, ..)| want(p)) {
        let mut plain = Vec::new();
        for micro_batch in [small, large] {
            for ck in [Checkpointing::None, Checkpointing::Regions] {
                plain.push(row(preset, d(1, 1, 1), micro_batch, ScheduleKind::OneFOneB, ck, preset == "tiny-20m"));
            }
        }
        plain.push(row(preset, d(1, 2, 1), large, ScheduleKind::OneFOneB, Checkpointing::None, preset == "tiny-20m"));
        plain.push(row(preset, d(1, 1, 2), large, ScheduleKind::GPipe, Checkpointing::None, preset == "tiny-20m"));
        let dp2 = row(preset, d(2, 1, 1), large, ScheduleKind::OneFOneB, Checkpointing::None, preset == "tiny-20m");
        plain.push(Row { zero1: true, ..dp2.clone() });
        plain.push(dp2);
        for precision in [Precision::F32, Precision::Bf16Mixed] {
            gpu.extend(plain.iter().map(|r| Row { precision, ..r.clone() }));
        }
    }
    gpu
}

/// The ZeRO-1 rows, each after its unsharded twin (all held out).
fn zero1_rows(want: &dyn Fn(&str) -> bool) -> Vec<Row> {
    let mut zero_pairs = Vec::new();
    for (preset, dims, micro_batch, ck) in [
        ("tiny-20m", d(2, 1, 1), 2, Checkpointing::None),
        ("tiny-20m", d(4, 1, 1), 2, Checkpointing::Regions),
        ("tiny-20m", d(2, 2, 2), 2, Checkpointing::None),
        ("small-100m", d(2, 1, 1), 1, Checkpointing::Regions),
        ("small-100m", d(4, 1, 1), 1, Checkpointing::Regions),
    ] {
        if want(preset) {
            let plain = row(preset, dims, micro_batch, schedule_of(dims), ck, true);
            zero_pairs.push(plain.clone());
            zero_pairs.push(Row { zero1: true, ..plain });
        }
    }
    zero_pairs
}

/// The `Bf16Mixed` rows: tiny-5m and tiny-20m serial, tp2 and pp2 at B_m 2 and 8, dp2 (held
/// out) at B_m 2, without checkpointing and with `Regions`.
fn bf16_rows(want: &dyn Fn(&str) -> bool) -> Vec<Row> {
    let mut bf16 = Vec::new();
    for preset in ["tiny-5m", "tiny-20m"].into_iter().filter(|p| want(p)) {
        for (dims, held_out) in [(d(1, 1, 1), false), (d(1, 2, 1), false), (d(1, 1, 2), false), (d(2, 1, 1), true)] {
            for micro_batch in if held_out { [2].as_slice() } else { [2, 8].as_slice() } {
                for ck in [Checkpointing::None, Checkpointing::Regions] {
                    bf16.push(Row { precision: Precision::Bf16Mixed, ..row(preset, dims, *micro_batch, schedule_of(dims), ck, held_out) });
                }
            }
        }
    }
    bf16
}

/// The f32 rows [`MemoryModel::engine_f32`] was fitted to.
fn fitted_rows(want: &dyn Fn(&str) -> bool) -> Vec<Row> {
    let mut out = Vec::new();
    let kinds = [Checkpointing::None, Checkpointing::Layers, Checkpointing::Regions];
    for preset in ["tiny-5m", "tiny-20m"].into_iter().filter(|p| want(p)) {
        for dims in [d(1, 1, 1), d(2, 1, 1), d(1, 2, 1), d(1, 1, 2), d(2, 2, 2)] {
            for micro_batch in [2, 8] {
                for ck in kinds {
                    out.push(row(preset, dims, micro_batch, schedule_of(dims), ck, false));
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
    out
}

/// The f32 rows it was not fitted to: B_m 4 and 1F1B on two stages of tiny-20m, dp2 of
/// small-100m.
fn held_out_rows(want: &dyn Fn(&str) -> bool) -> Vec<Row> {
    let mut out = Vec::new();
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

/// Measures every row of `group` in a child process and prints the table; with `csv`, writes
/// the model's terms beside each measurement there too (what a refit reads).
pub fn run(backend: Backend, presets: &[String], group: Group, csv: Option<&std::path::Path>) -> anyhow::Result<()> {
    if !backend.rank_device().built() {
        bail!("this build has no {backend:?} backend: build recipes with `--features {}`", backend.feature());
    }
    let rows: Vec<Row> = rows(presets, group).into_iter().map(|r| Row { backend, ..r }).collect();
    let mut lines = vec![CSV_HEADER.to_string()];
    let what = if on_gpu(backend) {
        "on the GPU, read with nvidia-smi after the steps, less the backend's context"
    } else {
        "the process's peak resident set"
    };
    println!(
        "Peak memory of the engine's ranks (one process, {backend:?}: {what}; {STEPS} steps, {MICRO_PER_REPLICA} micro-batches per replica) against the memory model (MemoryModel::engine in the row's precision)\n"
    );
    println!(
        "| model | layout | schedule | B_m | checkpointing | precision | ZeRO-1 | fitted on | measured MiB | predicted MiB | predicted / measured |"
    );
    println!("|---|---|---|---:|---|---|---|---|---:|---:|---:|");
    let bar = crate::report::progress::Progress::new("bench memory", rows.len() as u64);
    let (mut fitted, mut held) = (Vec::new(), Vec::new());
    for (i, row) in rows.iter().enumerate() {
        let measured = measure_in_child(row)? as f64;
        let predicted = row.predicted()?;
        lines.extend(row.csv_lines(i, measured)?);
        if let Some(path) = csv {
            // After every row, so an interrupted run keeps what it measured.
            std::fs::write(path, lines.join("\n") + "\n").with_context(|| format!("writing {}", path.display()))?;
        }
        let ratio = predicted / measured;
        if row.held_out { &mut held } else { &mut fitted }.push(ratio);
        bar.inc(1);
        println!(
            "| {} | {} | {:?} | {} | {:?} | {:?} | {} | {} | {:.1} | {:.1} | {:.2} |",
            row.preset,
            row.dims,
            row.schedule,
            row.micro_batch,
            row.checkpointing,
            row.precision,
            if row.zero1 { "yes" } else { "no" },
            if row.held_out { "no" } else { "yes" },
            measured / MIB,
            predicted / MIB,
            ratio
        );
    }
    bar.finish();
    if on_gpu(backend) {
        let context = CONTEXT_BYTES.load(std::sync::atomic::Ordering::Relaxed) as f64;
        println!("the backend's context on the GPU (not in the rows): {:.0} MiB", context / MIB);
    }
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
        .args(row.zero1.then_some("--zero1"))
        .args(["--precision", &format!("{:?}", row.precision)])
        .args(["--backend", &format!("{:?}", row.backend)])
        .output()
        .context("starting the measuring child")?;
    let text = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        bail!("the child for {row:?} failed: {}", String::from_utf8_lossy(&out.stderr));
    }
    if let Some(context) = text.lines().find_map(|l| l.strip_prefix("context-bytes ")) {
        CONTEXT_BYTES.store(context.trim().parse().unwrap_or(0), std::sync::atomic::Ordering::Relaxed);
    }
    text.lines()
        .find_map(|l| l.strip_prefix("peak-bytes "))
        .and_then(|v| v.trim().parse().ok())
        .ok_or_else(|| anyhow!("the child for {row:?} reported no peak: {text}"))
}

/// The CUDA context's bytes the last GPU child reported (0 before one has).
static CONTEXT_BYTES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Whether `backend`'s rows are measured on an NVIDIA GPU: LibTorch's CUDA, or wgpu where
/// `nvidia-smi` answers (else wgpu is lavapipe, in this process's memory).
pub fn on_gpu(backend: Backend) -> bool {
    match backend {
        Backend::Tch | Backend::Cuda => true,
        Backend::Wgpu => gpu_memory_used().is_ok(),
        _ => false,
    }
}

/// Bytes in use on the GPU the ranks use (the first of `CUDA_VISIBLE_DEVICES`, else GPU 0), as
/// `nvidia-smi` reports them (MiB resolution). nvidia-smi numbers GPUs in PCI order, as CUDA
/// does with `CUDA_DEVICE_ORDER=PCI_BUS_ID`; a GPU's UUID names the same one either way.
pub(crate) fn gpu_memory_used() -> anyhow::Result<u64> {
    let index = std::env::var("CUDA_VISIBLE_DEVICES")
        .ok()
        .and_then(|l| l.split(',').next().map(|s| s.trim().to_string()))
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "0".to_string());
    let out = std::process::Command::new("nvidia-smi")
        .args(["--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", &index])
        .output()
        .context("running nvidia-smi")?;
    let text = String::from_utf8_lossy(&out.stdout);
    let mib: u64 = text.trim().parse().map_err(|_| anyhow!("nvidia-smi -i {index} gave no memory figure: {text}"))?;
    Ok(mib << 20)
}

/// The child's side: builds the row's engine, trains, prints `peak-bytes N` (and on a GPU
/// `context-bytes N`, the backend's own).
pub fn child(row: &Row) -> anyhow::Result<()> {
    let gpu = on_gpu(row.backend);
    let before = if gpu {
        let idle = gpu_memory_used()?;
        // The backend started and holding one small tensor: its context and pools exist.
        let device = row.backend.rank_device().device()?;
        let one = burn::tensor::Tensor::<1>::ones([1], &device).into_data();
        anyhow::ensure!(one.try_to_vec::<f32>().map_err(|e| anyhow!("{e:?}"))? == vec![1.0], "the device gave back a wrong value");
        let started = gpu_memory_used()?;
        println!("context-bytes {}", started.saturating_sub(idle));
        started
    } else {
        status_kib("VmRSS")? * 1024
    };
    let spec = row.spec()?;
    let cfg = LlamaConfig::from_spec(&spec);
    let device = Device::flex().autodiff();
    let full = full_params(&cfg.init(&device));
    let optim = OptimConfig { warmup_steps: 0, ..OptimConfig::default() };
    let options = EngineOptions {
        schedule: row.schedule,
        device: row.backend.rank_device(),
        ranks_per_device: Some(row.dims.world_size()),
        checkpointing: row.checkpointing,
        precision: row.precision,
        zero1: row.zero1,
        ..EngineOptions::default()
    };
    let ec = options.engine_config_of(row.dims, (row.global_batch(), row.micro_batch), row.seq, optim);
    let mut engine = Engine::new(Arc::new(cfg), &full, ec)?;
    drop(full);
    if !gpu {
        // The peak from here on: the engine's state and its steps.
        std::fs::write("/proc/self/clear_refs", "5").context("resetting the peak resident set (/proc/self/clear_refs)")?;
    }
    for i in 0..STEPS {
        engine.step(synthetic_batch(row.global_batch(), row.seq, spec.vocab_size, i))?;
    }
    let peak = if gpu { gpu_memory_used()? } else { status_kib("VmHWM")? * 1024 };
    println!("peak-bytes {}", peak.saturating_sub(before));
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
