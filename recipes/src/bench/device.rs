//! `recipes bench device`: a device backend checked and measured, for a GPU machine
//! (`scripts/gpu-check.sh` runs it) and, on LibTorch's CPU or lavapipe, here.
//!
//! 1. Parity: tiny-1m (seq 64, B_g 8, B_m 2) trained three steps on the device and on Flex from
//!    the same weights and batches, on serial, dp2, tp2, pp2, dp2 x tp2 and tp2 x pp2; the largest relative
//!    difference of a step's loss and of its gradient norm, the host bytes of the last step
//!    beyond its token ids. Fails on a NaN or on a difference above [`PARITY_TOLERANCE`].
//! 2. Throughput: each preset on one rank and on `ranks` ranks sharing the device (data
//!    parallel), in f32 and bf16 mixed precision: samples/s from the median step (each timed
//!    to the device's completion, `Device::sync`) after a warm-up step, model-FLOPs utilisation
//!    against the peak given, the device memory in use (`nvidia-smi`, on a GPU), host bytes per
//!    step beyond the token ids. Fails on a non-finite loss.
//! 3. Beside PyTorch (one rank, unless `--no-torch`): `bench/torch_step.py` on the same device,
//!    model shape, batch split and precision (bf16 autocast with f32 master weights for
//!    `Bf16Mixed`), as eager PyTorch with the masked softmax written out (what Burn's own
//!    overhead is measured against), eager with `scaled_dot_product_attention` and fused AdamW
//!    (what a user runs), and `torch.compile`; each stepping in turn with copus, so the
//!    machine's drift falls on both. Its tokens/s, utilisation (the same FLOP formula), peak
//!    memory (its caching allocator's reserved peak) and copus / PyTorch in tokens/s, the
//!    median of the rounds and their range.

use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, bail};
use burn::tensor::Device;
use copus_burn::{Engine, EngineOptions, OptimConfig};
use copus_core::layout::ParallelDims;
use copus_core::memory::{Checkpointing, Precision};
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
    /// The precisions measured.
    pub precisions: Vec<Precision>,
    /// Activation checkpointing of the throughput rows.
    pub checkpointing: Checkpointing,
    /// Whether PyTorch runs beside copus (part 3).
    pub torch: bool,
}

/// PyTorch's variants of part 3: a name and torch_step.py's options.
const TORCH_VARIANTS: [(&str, &[&str]); 3] = [
    ("PyTorch eager, masked softmax", &["--attention", "manual"]),
    ("PyTorch eager, SDPA, fused AdamW", &["--attention", "sdpa", "--fused-adamw"]),
    ("torch.compile, SDPA, fused AdamW", &["--attention", "sdpa", "--fused-adamw", "--compile"]),
];

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

/// One throughput configuration on copus's side: its engine, stepped and timed one step at a
/// time to the device's completion.
struct CopusRun {
    engine: Engine<LlamaConfig>,
    device: Device,
    spec: ModelSpec,
    global_batch: usize,
    next: usize,
}

impl CopusRun {
    fn new(backend: Backend, spec: &ModelSpec, ranks: usize, precision: Precision, opts: &Options) -> anyhow::Result<Self> {
        let (cfg, full) = model(spec);
        let dims = ParallelDims::new(ranks, 1, 1, ranks)?;
        let optim = OptimConfig { warmup_steps: 0, b0: opts.global_batch, ..OptimConfig::default() };
        let options = EngineOptions { precision, checkpointing: opts.checkpointing, ..on_one_device(backend, ranks) };
        let ec = options.engine_config_of(dims, (opts.global_batch, opts.micro_batch), spec.seq_len, optim);
        let engine = Engine::new(Arc::new(cfg), &full, ec).with_context(|| format!("{} on {ranks} {backend:?} ranks", spec.name))?;
        let device = backend.rank_device().device().map_err(|e| anyhow::anyhow!("{e}"))?;
        Ok(Self { engine, device, spec: spec.clone(), global_batch: opts.global_batch, next: 0 })
    }

    /// One step: its seconds to the device's completion, its loss and its host bytes beyond the
    /// token ids.
    fn step(&mut self) -> anyhow::Result<(f64, f64, u64)> {
        let batch = synthetic_batch(self.global_batch, self.spec.seq_len, self.spec.vocab_size, self.next);
        self.next += 1;
        let t = Instant::now();
        let out = self.engine.step(batch).context("a step")?;
        self.device.sync().map_err(|e| anyhow::anyhow!("waiting for the device: {e:?}"))?;
        Ok((t.elapsed().as_secs_f64(), out.metrics.loss, out.host.beyond_batch()))
    }
}

/// One throughput row of copus: the median step's seconds, the last loss, host bytes per step,
/// and the run itself for part 3.
fn throughput_run(
    backend: Backend,
    spec: &ModelSpec,
    ranks: usize,
    precision: Precision,
    opts: &Options,
) -> anyhow::Result<(f64, f64, u64, CopusRun)> {
    let mut run = CopusRun::new(backend, spec, ranks, precision, opts)?;
    run.step().context("the warm-up step")?;
    let (mut secs, mut loss, mut host) = (Vec::new(), f64::NAN, 0);
    for _ in 0..opts.steps {
        let (t, l, h) = run.step()?;
        secs.push(t);
        (loss, host) = (l, h);
    }
    Ok((super::median(secs), loss, host, run))
}

/// The figures of one row: samples/s, tokens/s, model TFLOP/s and the utilisation.
fn figures(spec: &ModelSpec, global_batch: usize, step_secs: f64, precision: Precision, opts: &Options) -> String {
    let samples = global_batch as f64 / step_secs;
    let tflops = samples * spec.seq_len as f64 * spec.train_flops_per_token() / 1e12;
    let mfu = opts.peak_tflops.map_or("-".to_string(), |(f32_peak, bf16_peak)| {
        let peak = if precision == Precision::F32 { f32_peak } else { bf16_peak };
        format!("{:.1}%", 100.0 * tflops / peak)
    });
    format!("{samples:.1} | {:.0} | {tflops:.2} | {mfu}", samples * spec.seq_len as f64)
}

/// Bytes as MiB, or `-`.
fn mib(bytes: Option<u64>) -> String {
    bytes.map_or("-".to_string(), |b| format!("{:.0} MiB", b as f64 / (1u64 << 20) as f64))
}

/// Part 3 for one configuration: each PyTorch variant stepping in turn with `copus`.
fn beside_pytorch(backend: Backend, copus: &mut CopusRun, precision: Precision, opts: &Options) {
    let spec = copus.spec.clone();
    let shape = super::Shape { spec: spec.clone(), micro_batch: opts.micro_batch };
    let device = if matches!(backend, Backend::Tch | Backend::Cuda) { "cuda" } else { "cpu" };
    let dtype = if precision == Precision::F32 { "f32" } else { "bf16" };
    let accum = (opts.global_batch / opts.micro_batch).to_string();
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    for (name, variant) in TORCH_VARIANTS {
        let mut options = vec!["--device", device, "--dtype", dtype, "--accum", &accum];
        options.extend_from_slice(variant);
        let row = |cells: String| println!("| {} | {} | 1 | {precision:?} | {name} | {cells} |", spec.name, spec.seq_len);
        let mut torch = match super::step::Torch::start_with(&shape, threads, &options) {
            Ok(t) => t,
            Err(e) => {
                row(format!("not measured: {e} | | | | | | |"));
                continue;
            }
        };
        let mut rounds = || -> anyhow::Result<(Vec<f64>, Vec<f64>)> {
            // Two warm-up steps (torch.compile compiles in the first).
            for _ in 0..2 {
                torch.step()?;
            }
            let (mut theirs, mut ratios) = (Vec::new(), Vec::new());
            for round in 0..opts.steps {
                let t_first = if round % 2 == 1 { Some(torch.step()?.step()) } else { None };
                let (ours, _, _) = copus.step()?;
                let t = match t_first {
                    Some(t) => t,
                    None => torch.step()?.step(),
                };
                theirs.push(t);
                ratios.push(t / ours);
            }
            Ok((theirs, ratios))
        };
        match rounds() {
            Ok((theirs, ratios)) => {
                let (lo, hi) = ratios.iter().fold((f64::INFINITY, 0f64), |(lo, hi), &r| (lo.min(r), hi.max(r)));
                row(format!(
                    "{} | {} | | | {:.2} ({lo:.2}-{hi:.2})",
                    figures(&spec, opts.global_batch, super::median(theirs), precision, opts),
                    mib(Some(torch.peak_bytes).filter(|&b| b > 0)),
                    super::median(ratios.clone())
                ));
            }
            Err(e) => row(format!("failed: {e} | | | | | | |")),
        }
    }
}

/// Parts 2 and 3; an error names the rows whose loss was not finite.
pub fn throughput(backend: Backend, opts: &Options) -> anyhow::Result<()> {
    built(backend)?;
    println!(
        "Throughput on {backend:?}: B_g {}, B_m {}, checkpointing {:?}, the median of {} timed steps after one warm-up; {}",
        opts.global_batch,
        opts.micro_batch,
        opts.checkpointing,
        opts.steps,
        if opts.ranks == 1 { "1 rank".to_string() } else { format!("1 rank and {} ranks sharing the device (data parallel)", opts.ranks) }
    );
    if opts.peak_tflops.is_none() {
        println!("(no --peak-tflops: utilisation not computed)");
    }
    println!(
        "| preset | seq | ranks | precision | side | samples/s | tokens/s | model TFLOP/s | MFU | peak memory | host bytes/step beyond token ids | last loss | copus / side, tokens/s (range) |"
    );
    println!("|---|---:|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|");
    let gpu = super::memory::on_gpu(backend);
    let mut failed = Vec::new();
    for name in &opts.presets {
        let mut spec = ModelSpec::preset(name).map_err(|e| anyhow::anyhow!("--preset {name}: {e}"))?;
        if let Some(s) = opts.seq {
            spec.seq_len = s;
        }
        let rank_rows = if opts.ranks == 1 { vec![1] } else { vec![1, opts.ranks] };
        for ranks in rank_rows {
            for &precision in &opts.precisions {
                if precision == Precision::Bf16Mixed && backend == Backend::Wgpu {
                    println!(
                        "| {name} | {} | {ranks} | Bf16Mixed | copus | (wgpu's shaders have no bf16 arithmetic) | | | | | | | |",
                        spec.seq_len
                    );
                    continue;
                }
                let before = gpu.then(super::memory::gpu_memory_used).and_then(Result::ok);
                let (secs, loss, host, mut run) = throughput_run(backend, &spec, ranks, precision, opts)?;
                let after = gpu.then(super::memory::gpu_memory_used).and_then(Result::ok);
                let used = before.zip(after).map(|(b, a)| a.saturating_sub(b));
                println!(
                    "| {name} | {} | {ranks} | {precision:?} | copus | {} | {} | {host} | {loss:.4} | |",
                    spec.seq_len,
                    figures(&spec, opts.global_batch, secs, precision, opts),
                    mib(used)
                );
                if !loss.is_finite() {
                    failed.push(format!("{name} on {ranks} ranks in {precision:?}"));
                }
                if ranks == 1 && opts.torch {
                    beside_pytorch(backend, &mut run, precision, opts);
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
