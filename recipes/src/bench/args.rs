//! `recipes bench [MODE]`: the modes' command line and their dispatch.

use std::path::PathBuf;

use clap::builder::TypedValueParser as _;

use super::reconfig::{Change, parse_change};
use crate::Usage;
use crate::recipe::Backend;

/// Benchmarks, each printing a table (`step` when none is named).
#[derive(clap::Args)]
pub struct BenchArgs {
    #[command(subcommand)]
    mode: Option<BenchMode>,
}

#[derive(clap::Subcommand)]
enum BenchMode {
    /// Tokenization MB/s against the Python `tokenizers` package (same files, tokenizer and
    /// threads, alternating rounds), `recipes prepare`'s MB/s, and the data loader's sequences/s
    /// against the main job's measured demand.
    Data {
        /// Threads on both sides.
        #[arg(long, default_value_t = 2)]
        threads: usize,
        /// Alternating rounds per side.
        #[arg(long, default_value_t = 5)]
        rounds: usize,
        /// Skip the Python side.
        #[arg(long)]
        no_python: bool,
    },
    /// Training-step time per phase on the reference shape and tiny-20m, against PyTorch when it
    /// is installed, and the noise-scale probe's cost.
    Step {
        /// Timed steps.
        #[arg(long, default_value_t = 5)]
        steps: usize,
        /// Untimed warm-up steps.
        #[arg(long, default_value_t = 2)]
        warmup: usize,
        /// Skip the PyTorch comparison.
        #[arg(long)]
        no_torch: bool,
        /// Threads on both sides (rayon's pool for copus, torch.set_num_threads for PyTorch).
        #[arg(long, default_value_t = 2)]
        threads: usize,
    },
    /// A device backend against Flex (losses and gradient norms of six layouts over three
    /// steps; fails on a difference above 1e-4 or a NaN), then its samples/s, model-FLOPs utilisation, memory and host
    /// bytes per step on one and several ranks, in f32 and bf16, and beside PyTorch on the same
    /// device (eager, eager with SDPA and fused AdamW, torch.compile; scripts/gpu-check.sh).
    Device(DeviceArgs),
    /// copus on LibTorch's CPU against PyTorch eager on the reference shape: operator calls per
    /// decoder layer per micro-batch (with copus's operations on LibTorch's kernels and with
    /// Burn's decomposed forms), and the step time per phase, the two sides in turn. Needs the
    /// build feature `tch` and PyTorch.
    Libtorch {
        /// Timed steps.
        #[arg(long, default_value_t = 10)]
        steps: usize,
        /// Untimed warm-up steps.
        #[arg(long, default_value_t = 3)]
        warmup: usize,
        /// Threads on both sides (LibTorch's intra-op pool, torch.set_num_threads).
        #[arg(long, default_value_t = 2)]
        threads: usize,
    },
    /// The parallel engine: all-reduce bandwidth and the step time of every layout.
    Engine {
        /// Timed steps per layout.
        #[arg(long, default_value_t = 5)]
        steps: usize,
    },
    /// In-memory reconfiguration against a real process restart from a checkpoint.
    Reconfig {
        /// Only these model presets (repeatable); tiny-5m, tiny-20m and small-100m by default.
        #[arg(long = "preset", value_parser = ["tiny-5m", "tiny-20m", "small-100m"])]
        presets: Vec<String>,
        /// Trials per layout change, each on a fresh engine; the table shows medians.
        #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u64).range(1..=50))]
        trials: u64,
        /// Only these layout changes (repeatable), as `'dp2,tp2,pp2->dp1,tp4,pp2'` (quoted: `>`
        /// is the shell's); by default
        /// three changes of 8 ranks and one from 8 to 4.
        #[arg(long = "change", value_parser = parse_change)]
        changes: Vec<Change>,
    },
    /// The restart side of `reconfig`: load a checkpoint into a layout, run one step.
    #[command(hide = true)]
    RestartChild {
        #[arg(long)]
        checkpoint: PathBuf,
        #[arg(long)]
        preset: String,
        #[arg(long)]
        seq: usize,
        #[arg(long)]
        layout: String,
        #[arg(long)]
        global_batch: usize,
        #[arg(long)]
        micro_batch: usize,
    },
    /// In-process recovery of a failed rank (a panic mid-step, a hung rank's timeout) on two
    /// ranks of tiny-5m: the failed attempt, the rebuild and the lost steps, in steady steps.
    /// Needs the build feature `fault-injection`.
    Recovery {
        /// Trials per row, each on a fresh engine.
        #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u64).range(1..=50))]
        trials: u64,
        /// Steps between the driver's snapshots.
        #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u64).range(1..))]
        snapshot_every: u64,
        /// Steps trained before the failing one.
        #[arg(long, default_value_t = 15, value_parser = clap::value_parser!(u64).range(1..))]
        fail_after: u64,
        /// The engine's wait limit in the timeout row, seconds.
        #[arg(long, default_value_t = 2.0)]
        timeout_secs: f64,
    },
    /// The learner add-on's noise probe against the same step without it.
    Probe {
        /// Timed steps.
        #[arg(long, default_value_t = 10)]
        steps: usize,
    },
    /// Peak memory of the engine's ranks per configuration (each in a child process) against
    /// the memory model's prediction.
    Memory {
        /// Only these model presets (repeatable); tiny-5m, tiny-20m and small-100m by default.
        #[arg(long = "preset", value_parser = ["tiny-5m", "tiny-20m", "small-100m"])]
        presets: Vec<String>,
        /// Only the ZeRO-1 rows and their unsharded twins.
        #[arg(long, conflicts_with = "bf16")]
        zero1: bool,
        /// Only the `Bf16Mixed` rows.
        #[arg(long)]
        bf16: bool,
        /// Where the ranks train: on a GPU backend the rows of a GPU (tiny-20m and small-100m,
        /// f32 and bf16), measured on the device.
        #[arg(long, value_parser = backend_name(), default_value = "Flex")]
        backend: Backend,
        /// Also write the model's terms beside each measurement to this CSV file (what a refit
        /// of the coefficients reads; `scripts/fit-memory.py`).
        #[arg(long)]
        csv: Option<PathBuf>,
    },
    /// The measuring side of `memory`: one configuration, its peak bytes.
    #[command(hide = true)]
    MemoryChild {
        #[arg(long)]
        preset: String,
        #[arg(long)]
        seq: usize,
        #[arg(long)]
        layout: String,
        #[arg(long)]
        micro_batch: usize,
        #[arg(long, value_parser = ["OneFOneB", "GPipe"])]
        schedule: String,
        #[arg(long, value_parser = ["None", "Layers", "Regions"])]
        checkpointing: String,
        #[arg(long, value_parser = ["F32", "Bf16Mixed"], default_value = "F32")]
        precision: String,
        #[arg(long)]
        zero1: bool,
        #[arg(long, value_parser = backend_name(), default_value = "Flex")]
        backend: Backend,
    },
}

/// `--backend`: a recipe's backend name, as the recipe spells it.
fn backend_name() -> impl clap::builder::TypedValueParser<Value = Backend> {
    clap::builder::PossibleValuesParser::new(["Flex", "Wgpu", "Cuda", "Rocm", "Tch", "TchCpu"])
        .map(|s| ron::from_str::<Backend>(&s).expect("one of the listed names"))
}

/// `--peak-tflops F32,BF16`: two positive numbers.
fn parse_peaks(s: &str) -> Result<(f64, f64), String> {
    let bad = || format!("`{s}`: expected two positive TFLOP/s figures as F32,BF16 (an H200: 67,989)");
    let (a, b) = s.split_once(',').ok_or_else(bad)?;
    let (a, b) = (a.trim().parse::<f64>().map_err(|_| bad())?, b.trim().parse::<f64>().map_err(|_| bad())?);
    if a > 0.0 && b > 0.0 && a.is_finite() && b.is_finite() { Ok((a, b)) } else { Err(bad()) }
}

/// `bench device`'s arguments.
#[derive(clap::Args)]
struct DeviceArgs {
    /// The backend under test (the build needs its feature).
    #[arg(long, value_parser = backend_name())]
    backend: Backend,
    /// Presets of the throughput table (repeatable); tiny-20m and small-100m by default.
    #[arg(long = "preset", value_parser = ["tiny-1m", "tiny-5m", "tiny-20m", "small-100m", "tinyllama-1.1b"])]
    presets: Vec<String>,
    /// Ranks sharing the device in each preset's second row.
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u64).range(1..=64))]
    ranks: u64,
    /// Sequences per step of the throughput rows (a multiple of `--ranks` x `--micro-batch`).
    #[arg(long, default_value_t = 32)]
    global_batch: usize,
    /// Sequences per micro-batch of the throughput rows.
    #[arg(long, default_value_t = 4)]
    micro_batch: usize,
    /// Sequence length of the throughput rows (default: the preset's).
    #[arg(long)]
    seq: Option<usize>,
    /// Timed steps per throughput row, after one warm-up step (and rounds per PyTorch
    /// variant).
    #[arg(long, default_value_t = 10)]
    steps: usize,
    /// The precisions of the throughput rows (repeatable); both by default.
    #[arg(long = "precision", value_parser = ["f32", "bf16"])]
    precisions: Vec<String>,
    /// Activation checkpointing of the throughput rows (each decoder layer a segment).
    #[arg(long)]
    checkpointing: bool,
    /// Skip PyTorch beside copus.
    #[arg(long)]
    no_torch: bool,
    /// The device's peak dense TFLOP/s as `F32,BF16` (an H200: `67,989`), for utilisation.
    #[arg(long, value_parser = parse_peaks)]
    peak_tflops: Option<(f64, f64)>,
    /// Only the parity table.
    #[arg(long, conflicts_with = "throughput_only")]
    parity_only: bool,
    /// Only the throughput table (and PyTorch beside it).
    #[arg(long)]
    throughput_only: bool,
}

/// `bench device`: the arguments checked, then the parts asked for.
fn device_mode(args: DeviceArgs) -> anyhow::Result<()> {
    let DeviceArgs {
        backend,
        presets,
        ranks,
        global_batch,
        micro_batch,
        seq,
        steps,
        precisions,
        checkpointing,
        no_torch,
        peak_tflops,
        parity_only,
        throughput_only,
    } = args;
    let ranks = ranks as usize;
    if global_batch == 0 || micro_batch == 0 || !global_batch.is_multiple_of(ranks * micro_batch) {
        return Err(Usage(format!(
            "--global-batch {global_batch} must be a positive multiple of --ranks {ranks} x --micro-batch {micro_batch}"
        ))
        .into());
    }
    if let Some(n) = seq
        && !(1..=copus_core::model::MAX_SIZE).contains(&n)
    {
        return Err(Usage(format!("--seq {n}: 1..={} tokens", copus_core::model::MAX_SIZE)).into());
    }
    let presets = if presets.is_empty() { vec!["tiny-20m".to_string(), "small-100m".to_string()] } else { presets };
    use copus_core::memory::{Checkpointing, Precision};
    let precisions = match precisions.as_slice() {
        [] => vec![Precision::F32, Precision::Bf16Mixed],
        names => names.iter().map(|p| if p == "f32" { Precision::F32 } else { Precision::Bf16Mixed }).collect(),
    };
    let checkpointing = if checkpointing { Checkpointing::Layers } else { Checkpointing::None };
    let opts = super::device::Options {
        presets,
        ranks,
        global_batch,
        micro_batch,
        seq,
        steps: steps.max(1),
        peak_tflops,
        precisions,
        checkpointing,
        torch: !no_torch,
    };
    match (parity_only, throughput_only) {
        (true, _) => super::device::parity(backend)?,
        (_, true) => super::device::throughput(backend, &opts)?,
        _ => super::device::run(backend, &opts)?,
    }
    Ok(())
}

impl BenchArgs {
    /// Runs the named mode (`step` with its defaults when none is named).
    pub fn exec(self) -> anyhow::Result<()> {
        match self.mode.unwrap_or(BenchMode::Step { steps: 5, warmup: 2, no_torch: false, threads: 2 }) {
            BenchMode::Step { steps, warmup, no_torch, threads } => super::step::run(steps.max(1), warmup, !no_torch, threads.max(1)),
            BenchMode::Engine { steps } => super::engine::run(steps.max(1)),
            #[cfg(feature = "tch")]
            BenchMode::Libtorch { steps, warmup, threads } => super::libtorch::run(steps.max(1), warmup, threads.max(1))?,
            #[cfg(not(feature = "tch"))]
            BenchMode::Libtorch { .. } => {
                return Err(Usage("bench libtorch needs recipes built with feature `tch` (see docs/gpu.md, \"LibTorch\")".into()).into());
            }
            BenchMode::Data { threads, rounds, no_python } => {
                super::data::run(&super::data::Options { threads: threads.max(1), rounds: rounds.max(1), no_python })?
            }
            BenchMode::Device(args) => device_mode(args)?,
            BenchMode::Reconfig { presets, trials, changes } => super::reconfig::run_reconfig(&presets, trials as usize, &changes),
            BenchMode::RestartChild { checkpoint, preset, seq, layout, global_batch, micro_batch } => {
                super::reconfig::restart_child(&checkpoint, &preset, seq, &layout, global_batch, micro_batch)?
            }
            BenchMode::Probe { steps } => super::probe::run(steps.max(1)),
            BenchMode::Recovery { trials, snapshot_every, fail_after, timeout_secs } => {
                if !(timeout_secs.is_finite() && timeout_secs > 0.0) {
                    return Err(Usage(format!("--timeout-secs {timeout_secs}: a positive number of seconds")).into());
                }
                #[cfg(feature = "fault-injection")]
                super::recovery::run(&super::recovery::Options { trials: trials as usize, snapshot_every, fail_after, timeout_secs })?;
                #[cfg(not(feature = "fault-injection"))]
                {
                    let _ = (trials, snapshot_every, fail_after);
                    return Err(Usage(
                        "`bench recovery` plants failures: build with `--features fault-injection` (cargo run --release -p recipes --features fault-injection -- bench recovery)".into(),
                    )
                    .into());
                }
            }
            BenchMode::Memory { presets, zero1, bf16, backend, csv } => {
                let group = match (zero1, bf16) {
                    (true, _) => super::memory::Group::Zero1,
                    (_, true) => super::memory::Group::Bf16,
                    _ if super::memory::on_gpu(backend) => super::memory::Group::Gpu,
                    _ => super::memory::Group::All,
                };
                super::memory::run(backend, &presets, group, csv.as_deref())?
            }
            BenchMode::MemoryChild { preset, seq, layout, micro_batch, schedule, checkpointing, precision, zero1, backend } => {
                let row = super::memory::Row {
                    preset,
                    seq,
                    dims: super::memory::parse_layout(&layout)?,
                    micro_batch,
                    schedule: ron::from_str(&schedule)?,
                    checkpointing: ron::from_str(&checkpointing)?,
                    zero1,
                    precision: ron::from_str(&precision)?,
                    held_out: false,
                    backend,
                };
                super::memory::child(&row)?
            }
        }
        Ok(())
    }
}
