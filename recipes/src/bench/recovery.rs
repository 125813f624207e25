//! `recipes bench recovery`: what a failed rank costs a run that recovers in the process
//! (`train.max_recoveries`), for tiny-5m on two in-process ranks. A panic is planted on rank 1
//! in the middle of a step, or rank 1 hangs until the collective times out; the driver rebuilds
//! the engine from its last snapshot and trains the lost steps again. Needs the build feature
//! `fault-injection` (the hooks that plant the failures).

use std::sync::Arc;
use std::time::Instant;

use burn::tensor::Device;
use copus_burn::driver::{Clock, Divergence, RecoveryRecord};
use copus_burn::{DataSource, Driver, Engine, EngineConfig, OptimConfig};
use copus_core::candidates::CandidateSpace;
use copus_core::decision::Scripted;
use copus_core::layout::ParallelDims;
use copus_core::memory::{GIB, MemoryModel};
use copus_core::model::ModelSpec;
use copus_core::schedule::ScheduleKind;
use copus_models::{LlamaConfig, full_params};

use super::median;
use crate::profile::synthetic_batch;

/// The benchmark's settings.
pub struct Options {
    /// Trials per row, each on a fresh engine.
    pub trials: usize,
    /// Steps between the driver's snapshots.
    pub snapshot_every: u64,
    /// Steps trained before the failing one.
    pub fail_after: u64,
    /// The engine's wait limit in the timeout row, seconds.
    pub timeout_secs: f64,
}

/// Sequences per step and per micro-batch.
const BATCH: (usize, usize) = (16, 4);

/// The default snapshot cadence of a run (`Divergence::default`).
const RUN_SNAPSHOT_EVERY: u64 = 50;

/// How the step fails.
#[derive(Clone, Copy)]
enum Failure {
    Panic,
    Hang,
}

/// Synthetic sequences by index.
struct Synthetic {
    seq: usize,
    vocab: usize,
}

impl DataSource for Synthetic {
    fn sequences(&self, first: u64, count: usize) -> Vec<i64> {
        synthetic_batch(count, self.seq, self.vocab, first as usize)
    }
}

/// One trial's measurements.
struct Trial {
    step_secs: f64,
    recovery_secs: f64,
    record: RecoveryRecord,
}

/// Prints the table.
pub fn run(opts: &Options) -> anyhow::Result<()> {
    if opts.fail_after == 0 || opts.snapshot_every == 0 {
        anyhow::bail!("--fail-after and --snapshot-every must be at least 1");
    }
    let mut spec = ModelSpec::preset("tiny-5m")?;
    spec.seq_len = 128;
    let cfg = LlamaConfig::from_spec(&spec);
    let device = Device::flex().autodiff();
    device.seed(0);
    let full = full_params(&cfg.init(&device));
    let mean_lost = (RUN_SNAPSHOT_EVERY - 1) as f64 / 2.0;
    println!(
        "In-process recovery of a failed rank: tiny-5m (seq {}), B_g {} B_m {}, two ranks, this machine.",
        spec.seq_len, BATCH.0, BATCH.1
    );
    println!(
        "A trial trains {} steps (a snapshot every {}), then the next step fails; recovery: from",
        opts.fail_after, opts.snapshot_every
    );
    println!("the start of that step until the run has trained it again, less one steady step, in");
    println!("steady steps. It is the failed attempt + the rebuild + the lost steps trained again. At a");
    println!("run's default snapshot cadence ({RUN_SNAPSHOT_EVERY} steps) a failure loses {mean_lost} steps in the mean: the");
    println!("last column is failed attempt + rebuild + {mean_lost} steps. Medians of {} trial(s).", opts.trials);
    println!(
        "| failure | layout | step s | failed attempt s | rebuild s | lost steps | recovery s | recovery steps | at cadence {RUN_SNAPSHOT_EVERY}, steps |"
    );
    println!("|---|---|---:|---:|---:|---:|---:|---:|---:|");
    let rows = [
        (Failure::Panic, ParallelDims { dp: 2, tp: 1, pp: 1 }),
        (Failure::Panic, ParallelDims { dp: 1, tp: 2, pp: 1 }),
        (Failure::Panic, ParallelDims { dp: 1, tp: 1, pp: 2 }),
        (Failure::Hang, ParallelDims { dp: 2, tp: 1, pp: 1 }),
    ];
    for (failure, dims) in rows {
        let trials = (0..opts.trials).map(|_| trial(&cfg, &spec, &full, dims, failure, opts)).collect::<anyhow::Result<Vec<_>>>()?;
        let m = |f: &dyn Fn(&Trial) -> f64| median(trials.iter().map(f).collect());
        let step = m(&|t| t.step_secs);
        let (failed, rebuild) = (m(&|t| t.record.failed_step_secs), m(&|t| t.record.measured_secs));
        let (lost, recovery) = (m(&|t| t.record.lost_steps as f64), m(&|t| t.recovery_secs));
        let name = match failure {
            Failure::Panic => "rank 1 panics mid-step".to_string(),
            Failure::Hang => format!("rank 1 hangs (timeout {} s)", opts.timeout_secs),
        };
        println!(
            "| {name} | {dims} | {step:.3} | {failed:.3} | {rebuild:.3} | {lost} | {recovery:.3} | {:.1} | {:.1} |",
            recovery / step,
            (failed + rebuild) / step + mean_lost
        );
    }
    Ok(())
}

/// One trial: a fresh driver, `fail_after` steps, the failing step and its recovery.
fn trial(
    cfg: &LlamaConfig,
    spec: &ModelSpec,
    full: &copus_burn::parallel::FullParams,
    dims: ParallelDims,
    failure: Failure,
    opts: &Options,
) -> anyhow::Result<Trial> {
    let (b, m) = BATCH;
    let optim = OptimConfig { warmup_steps: 1, total_steps: 1000, b0: b, ..OptimConfig::default() };
    let engine_cfg = EngineConfig::new(dims, b, m, spec.seq_len, optim).with_timeout_secs(opts.timeout_secs);
    let engine = Engine::new(Arc::new(cfg.clone()), full, engine_cfg)?;
    let space = CandidateSpace::new(2, vec![b], vec![m], ScheduleKind::OneFOneB, MemoryModel::fp32(), 64.0 * GIB)?.enumerate(spec);
    let divergence = Divergence { snapshot_every: opts.snapshot_every, ..Divergence::default() };
    let mut driver = Driver::new(engine, space, Clock::Wall)?.with_divergence(divergence).with_recoveries(1);
    let data = Synthetic { seq: spec.seq_len, vocab: spec.vocab_size };
    let mut keep = Scripted::new([]);
    let mut times = Vec::new();
    for _ in 0..opts.fail_after {
        let t = Instant::now();
        driver.step(&data, &mut keep)?;
        times.push(t.elapsed().as_secs_f64());
    }
    // The first step warms up.
    let step_secs = median(times.split_off(1.min(times.len() - 1)));
    match failure {
        Failure::Panic => driver.engine_mut().inject_panic(opts.fail_after, 1),
        Failure::Hang => driver.engine_mut().inject_stall(1),
    }
    let started = Instant::now();
    let mut record = None;
    while driver.engine().steps_done() <= opts.fail_after {
        let s = driver.step(&data, &mut keep)?;
        record = record.or(s.recovered.into_iter().next());
    }
    let recovery_secs = (started.elapsed().as_secs_f64() - step_secs).max(0.0);
    let record = record.ok_or_else(|| anyhow::anyhow!("the planted failure did not fail the step"))?;
    Ok(Trial { step_secs, recovery_secs, record })
}
