//! `recipes bench device`: a device backend checked and measured, for a GPU machine
//! (`scripts/gpu-check.sh` runs it) and, on LibTorch's CPU or lavapipe, here.
//!
//! 1. Parity: tiny-1m (seq 64, B_g 8, B_m 2) trained three steps on the device and on Flex from
//!    the same weights and batches, on serial, dp2, tp2, pp2, dp2 x tp2 and tp2 x pp2; the largest relative
//!    difference of a step's loss and of its gradient norm, the host bytes of the last step
//!    beyond its token ids. Fails on a NaN or on a difference above [`PARITY_TOLERANCE`].
//! 2. Throughput: each preset on one rank and on `ranks` ranks sharing the device (data
//!    parallel), in f32 and bf16 mixed precision: samples/s over the timed steps after a
//!    warm-up step, model-FLOPs utilisation against the peak given, host bytes per step beyond
//!    the token ids. Fails on a non-finite loss.

use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, bail};
use burn::tensor::Device;
use copus_burn::{Engine, EngineOptions, OptimConfig};
use copus_core::layout::ParallelDims;
use copus_core::memory::Precision;
use copus_core::model::ModelSpec;
use copus_models::{LlamaConfig, full_params};

use crate::profile::synthetic_batch;
use crate::recipe::Backend;

/// The largest relative difference of a step's loss, or of its gradient norm, between the
/// device and Flex that passes. Both compute in f32 from the same weights; sums in another
/// order and a GPU's exp/log differ by a few ulps per operation (1e-7 relative), which three
/// steps of AdamW grow to about 1e-6 (`copus_tests::device` bounds lavapipe and LibTorch's CPU
/// at 1e-6 for losses and 1e-5 for gradient norms over five steps; an H200 measured 3.4e-8 for
/// losses). Neither GPU backend rounds f32 matmuls through TF32 (LibTorch's default since
/// PyTorch 1.12; wgpu has no TF32). The gradient norm is compared because AdamW hides a
/// gradient's scale from the loss: a reduction that summed twice would train the same losses
/// and double the norm.
pub const PARITY_TOLERANCE: f64 = 1e-4;

/// What the throughput part measures.
pub struct Options {
    /// Presets measured for throughput.
    pub presets: Vec<String>,
    /// Ranks sharing the device in the second row of each preset (data parallel).
    pub ranks: usize,
    /// Global batch and micro-batch of the throughput rows.
    pub global_batch: usize,
    /// Sequences per micro-batch.
    pub micro_batch: usize,
    /// Sequence length (the preset's when `None`).
    pub seq: Option<usize>,
    /// Timed steps after one warm-up step.
    pub steps: usize,
    /// The device's peak dense TFLOP/s in f32 and in bf16, for the utilisation column.
    pub peak_tflops: Option<(f64, f64)>,
}

/// A built model: its spec, configuration and initial weights (seed 0, drawn on Flex).
fn model(spec: &ModelSpec) -> (LlamaConfig, copus_burn::parallel::FullParams) {
    let cfg = LlamaConfig::from_spec(spec);
    let device = Device::flex().autodiff();
    device.seed(0);
    let full = full_params(&cfg.init(&device));
    (cfg, full)
}

fn relative(a: f64, b: f64) -> f64 {
    (a - b).abs() / b.abs().max(1e-12)
}

/// The rank devices of `ranks` ranks of `backend` in one process (all on its first device).
/// Every rank on the backend's first device.
fn on_one_device(backend: Backend, ranks: usize) -> EngineOptions {
    EngineOptions { device: backend.rank_device(), ranks_per_device: Some(ranks), ..EngineOptions::default() }
}

/// Losses and gradient norms of three steps, and the last step's host bytes beyond its token
/// ids.
fn parity_run(backend: Backend, dims: ParallelDims) -> anyhow::Result<(Vec<(f64, f64)>, u64)> {
    let mut spec = ModelSpec::tiny_1m();
    spec.seq_len = 64;
    let (cfg, full) = model(&spec);
    let optim = OptimConfig { lr: 1e-3, warmup_steps: 1, total_steps: 10, b0: 8, ..OptimConfig::default() };
    let ec = on_one_device(backend, dims.world_size()).engine_config_of(dims, (8, 2), spec.seq_len, optim);
    let mut engine = Engine::new(Arc::new(cfg), &full, ec).with_context(|| format!("an engine on {backend:?} ({dims})"))?;
    let (mut losses, mut host) = (Vec::new(), 0);
    for i in 0..3 {
        let out = engine
            .step(synthetic_batch(8, spec.seq_len, spec.vocab_size, i))
            .with_context(|| format!("step {i} on {backend:?} ({dims})"))?;
        losses.push((out.metrics.loss, out.metrics.grad_norm));
        host = out.host.beyond_batch();
    }
    Ok((losses, host))
}

/// Part 1; an error names the layouts that failed.
pub fn parity(backend: Backend) -> anyhow::Result<()> {
    built(backend)?;
    println!("Parity on {backend:?} against Flex: tiny-1m (seq 64, B_g 8, B_m 2), 3 steps, same weights and batches");
    println!(
        "| layout | loss after 3 steps ({backend:?}) | (Flex) | largest rel. difference: loss | gradient norm | host bytes beyond token ids, last step ({backend:?}) | (Flex) |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|");
    let mut failed = Vec::new();
    for (dp, tp, pp) in [(1, 1, 1), (2, 1, 1), (1, 2, 1), (1, 1, 2), (2, 2, 1), (1, 2, 2)] {
        let dims = ParallelDims::new(dp, tp, pp, dp * tp * pp)?;
        let (dev, dev_host) = parity_run(backend, dims)?;
        let (flex, flex_host) = parity_run(Backend::Flex, dims)?;
        // A non-finite value on either side fails (f64::max would pass over a NaN).
        let worst = |pick: fn(&(f64, f64)) -> f64| {
            dev.iter()
                .zip(&flex)
                .map(|(d, f)| (pick(d), pick(f)))
                .map(|(d, f)| if d.is_finite() && f.is_finite() { relative(d, f) } else { f64::INFINITY })
                .fold(0.0, f64::max)
        };
        let (loss, norm) = (worst(|s| s.0), worst(|s| s.1));
        println!("| {dims} | {:.6} | {:.6} | {loss:.2e} | {norm:.2e} | {dev_host} | {flex_host} |", dev[2].0, flex[2].0);
        if loss.max(norm) > PARITY_TOLERANCE {
            failed.push(format!("{dims} (loss {loss:.2e}, gradient norm {norm:.2e})"));
        }
    }
    if !failed.is_empty() {
        bail!("{backend:?} differs from Flex by more than {PARITY_TOLERANCE:e} (or gave NaN) on {}", failed.join(", "));
    }
    Ok(())
}

/// One throughput row: samples/s, the last step's loss, host bytes per step beyond the token ids.
fn throughput_run(
    backend: Backend,
    spec: &ModelSpec,
    ranks: usize,
    precision: Precision,
    opts: &Options,
) -> anyhow::Result<(f64, f64, u64)> {
    let (cfg, full) = model(spec);
    let dims = ParallelDims::new(ranks, 1, 1, ranks)?;
    let optim = OptimConfig { warmup_steps: 0, b0: opts.global_batch, ..OptimConfig::default() };
    let options = EngineOptions { precision, ..on_one_device(backend, ranks) };
    let ec = options.engine_config_of(dims, (opts.global_batch, opts.micro_batch), spec.seq_len, optim);
    let mut engine = Engine::new(Arc::new(cfg), &full, ec).with_context(|| format!("{} on {ranks} {backend:?} ranks", spec.name))?;
    let batch = |i| synthetic_batch(opts.global_batch, spec.seq_len, spec.vocab_size, i);
    engine.step(batch(0)).context("the warm-up step")?;
    let (mut loss, mut host) = (f64::NAN, 0);
    let t = Instant::now();
    for i in 0..opts.steps {
        let out = engine.step(batch(i + 1)).context("a timed step")?;
        (loss, host) = (out.metrics.loss, out.host.beyond_batch());
    }
    let secs = t.elapsed().as_secs_f64();
    Ok(((opts.global_batch * opts.steps) as f64 / secs, loss, host))
}

/// Part 2; an error names the rows whose loss was not finite.
pub fn throughput(backend: Backend, opts: &Options) -> anyhow::Result<()> {
    built(backend)?;
    println!(
        "Throughput on {backend:?}: B_g {}, B_m {}, {} timed steps after one warm-up; 1 rank and {} ranks sharing the device (data parallel)",
        opts.global_batch, opts.micro_batch, opts.steps, opts.ranks
    );
    if opts.peak_tflops.is_none() {
        println!("(no --peak-tflops: utilisation not computed)");
    }
    println!(
        "| preset | seq | ranks | precision | samples/s | tokens/s | model TFLOP/s | MFU | host bytes/step beyond token ids | last loss |"
    );
    println!("|---|---:|---:|---|---:|---:|---:|---:|---:|---:|");
    let mut failed = Vec::new();
    for name in &opts.presets {
        let mut spec = ModelSpec::preset(name).map_err(|e| anyhow::anyhow!("--preset {name}: {e}"))?;
        if let Some(s) = opts.seq {
            spec.seq_len = s;
        }
        for ranks in [1, opts.ranks] {
            for precision in [Precision::F32, Precision::Bf16Mixed] {
                if precision == Precision::Bf16Mixed && backend == Backend::Wgpu {
                    println!("| {name} | {} | {ranks} | Bf16Mixed | (wgpu's shaders have no bf16 arithmetic) | | | | | |", spec.seq_len);
                    continue;
                }
                let (samples, loss, host) = throughput_run(backend, &spec, ranks, precision, opts)?;
                let tflops = samples * spec.seq_len as f64 * spec.train_flops_per_token() / 1e12;
                let mfu = opts.peak_tflops.map_or("-".to_string(), |(f32_peak, bf16_peak)| {
                    let peak = if precision == Precision::F32 { f32_peak } else { bf16_peak };
                    format!("{:.1}%", 100.0 * tflops / peak)
                });
                println!(
                    "| {name} | {} | {ranks} | {precision:?} | {samples:.1} | {:.0} | {tflops:.2} | {mfu} | {host} | {loss:.4} |",
                    spec.seq_len,
                    samples * spec.seq_len as f64
                );
                if !loss.is_finite() {
                    failed.push(format!("{name} on {ranks} ranks in {precision:?}"));
                }
            }
        }
    }
    if !failed.is_empty() {
        bail!("a non-finite loss on {backend:?}: {}", failed.join(", "));
    }
    Ok(())
}

/// An error naming the feature when this build lacks `backend`.
fn built(backend: Backend) -> anyhow::Result<()> {
    if !backend.rank_device().built() {
        bail!("this build has no {backend:?} backend: build recipes with `--features {}`", backend.feature());
    }
    Ok(())
}

/// Both parts.
pub fn run(backend: Backend, opts: &Options) -> anyhow::Result<()> {
    parity(backend)?;
    println!();
    throughput(backend, opts)
}
