//! `recipes bench engine`: the in-process all-reduce against a plain memcpy of the same bytes,
//! the step time of every layout of 8 ranks against serial training of the same work, and the
//! host traffic of a steady step by kind on the layouts of 2 and 4 ranks.

use std::sync::{Arc, Barrier};
use std::time::Instant;

use burn::tensor::Device;
use copus_burn::comm::threads::ThreadComm;
use copus_burn::comm::{Collective, ReduceOp};
use copus_burn::parallel::FullParams;
use copus_burn::traffic::HostTraffic;
use copus_burn::{Engine, EngineOptions, MicroBatch, OptimConfig, Trainer};
use copus_core::layout::ParallelDims;
use copus_core::model::ModelSpec;
use copus_models::{Llama, LlamaConfig, full_params};

use crate::profile::synthetic_batch;

/// Seconds per all-reduce of `elems` f32 per rank on `world` ranks (rank 0's clock, between
/// barriers), over `reps` repetitions.
pub fn time_all_reduce(world: usize, elems: usize, reps: usize) -> f64 {
    let start = Arc::new(Barrier::new(world));
    let handles: Vec<_> = ThreadComm::world(world)
        .into_iter()
        .map(|c| {
            let start = start.clone();
            std::thread::spawn(move || {
                let mut buf: Vec<f32> = (0..elems).map(|i| (i % 7) as f32 + c.rank() as f32).collect();
                c.all_reduce(&mut buf, ReduceOp::Sum).expect("warm-up all-reduce");
                start.wait();
                let t = Instant::now();
                for _ in 0..reps {
                    c.all_reduce(&mut buf, ReduceOp::Sum).expect("all-reduce");
                }
                c.barrier().expect("barrier");
                t.elapsed().as_secs_f64() / reps as f64
            })
        })
        .collect();
    let times: Vec<f64> = handles.into_iter().map(|h| h.join().expect("rank")).collect();
    times[0]
}

/// Seconds per copy of `elems` f32 into an existing buffer.
pub fn time_memcpy(elems: usize, reps: usize) -> f64 {
    let src: Vec<f32> = (0..elems).map(|i| i as f32).collect();
    let mut dst = vec![0f32; elems];
    dst.copy_from_slice(&src);
    let t = Instant::now();
    for i in 0..reps {
        dst.copy_from_slice(&src);
        std::hint::black_box(&mut dst);
        dst[i % elems] += 1.0;
    }
    t.elapsed().as_secs_f64() / reps as f64
}

/// The steps of the engine tables: B_g and B_m.
const B_G: usize = 16;
const B_M: usize = 2;

/// The benchmark's model: tiny-1m at seq 64, initialised from seed 0 on Flex under autodiff,
/// with its full parameters and an optimizer without warm-up.
fn bench_model() -> (ModelSpec, LlamaConfig, Llama, FullParams, OptimConfig) {
    let mut spec = ModelSpec::tiny_1m();
    spec.seq_len = 64;
    let cfg = LlamaConfig::from_spec(&spec);
    let device = Device::flex().autodiff();
    device.seed(0);
    let model = cfg.init(&device);
    let full = full_params(&model);
    (spec, cfg, model, full, OptimConfig { warmup_steps: 0, ..OptimConfig::default() })
}

/// The host traffic of a steady step (the third) of tiny-1m (seq 64, B_g 16, B_m 2) on `dims`,
/// summed over the ranks, and the largest rank's total.
pub fn steady_step_traffic(dims: ParallelDims) -> (HostTraffic, u64) {
    let (spec, cfg, _, full, optim) = bench_model();
    let b_g = B_G;
    let ec = EngineOptions::default().engine_config_of(dims, (b_g, B_M), spec.seq_len, optim);
    let mut engine = Engine::new(Arc::new(cfg), &full, ec).expect("engine");
    let mut last = None;
    for i in 0..3 {
        last = Some(engine.step(synthetic_batch(b_g, spec.seq_len, spec.vocab_size, i)).expect("step"));
    }
    let step = last.expect("three steps");
    (step.host, step.host_rank_max)
}

/// Prints the tables.
pub fn run(steps: usize) {
    let elems = 1 << 20; // 4 MiB of f32
    let reps = 20;
    let copy = time_memcpy(elems, reps);
    println!("In-process all-reduce of 4 MiB per rank (fp32 sum, deterministic rank order), this machine");
    println!("| ranks | all-reduce ms | memcpy ms | all-reduce / memcpy | algorithm GB/s |");
    println!("|---:|---:|---:|---:|---:|");
    for world in [2, 4, 8] {
        let t = time_all_reduce(world, elems, reps);
        println!("| {world} | {:.2} | {:.2} | {:.2} | {:.2} |", t * 1e3, copy * 1e3, t / copy, (elems * 4) as f64 / t / 1e9);
    }
    println!();
    let (spec, cfg, model, full, optim) = bench_model();
    let (b_g, b_m) = (B_G, B_M);
    let device = Device::flex().autodiff();
    let mut trainer = Trainer::new(model, optim.clone()).expect("settings");
    let serial_step = |trainer: &mut Trainer<Llama>, i: usize| {
        let tokens = synthetic_batch(b_g, spec.seq_len, spec.vocab_size, i);
        let windows: Vec<&[i64]> = tokens.chunks(spec.seq_len + 1).collect();
        let micro: Vec<MicroBatch> = windows.chunks(b_m).map(|w| MicroBatch::from_windows(w, &device)).collect();
        trainer.step(&micro).expect("serial step");
    };
    serial_step(&mut trainer, 0);
    let t = Instant::now();
    for i in 0..steps {
        serial_step(&mut trainer, i + 1);
    }
    let serial = t.elapsed().as_secs_f64() / steps as f64;
    println!("Step time of tiny-1m (seq {}, B_g {b_g}, B_m {b_m}) on 8 in-process ranks against serial, {steps} timed steps", spec.seq_len);
    println!("| layout | s/step | / serial |");
    println!("|---|---:|---:|");
    println!("| serial (1 rank) | {serial:.3} | 1.00 |");
    for dims in ParallelDims::all(8) {
        if dims.check_model(&spec).is_err() {
            continue;
        }
        let ec = EngineOptions::default().engine_config_of(dims, (b_g, b_m), spec.seq_len, optim.clone());
        let mut engine = Engine::new(Arc::new(cfg.clone()), &full, ec).expect("engine");
        engine.step(synthetic_batch(b_g, spec.seq_len, spec.vocab_size, 0)).expect("step");
        let t = Instant::now();
        for i in 0..steps {
            engine.step(synthetic_batch(b_g, spec.seq_len, spec.vocab_size, i + 1)).expect("step");
        }
        let s = t.elapsed().as_secs_f64() / steps as f64;
        println!("| {dims} | {s:.3} | {:.2} |", s / serial);
    }
    println!();
    println!("Host traffic of a steady step of tiny-1m (seq 64, B_g 16, B_m 2), KiB summed over the ranks, by kind");
    println!(
        "(on Flex; on a device backend the probe reads only per-parameter sums, and ranks sharing the device add their gradients there, so without tp a step moves its token ids and a few hundred bytes; the goal of a device-resident step: the token ids plus 64 KiB)"
    );
    println!(
        "| layout | token ids | activations | collective staging | probe | constants | state | evaluation | beyond the token ids | largest rank |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    let kib = |b: u64| b as f64 / 1024.0;
    for (dp, tp, pp) in [(2, 1, 1), (1, 2, 1), (1, 1, 2), (2, 2, 1)] {
        let dims = ParallelDims::new(dp, tp, pp, dp * tp * pp).expect("a layout");
        let (h, max) = steady_step_traffic(dims);
        println!(
            "| {dims} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} |",
            kib(h.batch),
            kib(h.activations),
            kib(h.collective),
            kib(h.probe),
            kib(h.constants),
            kib(h.state),
            kib(h.evaluation),
            kib(h.beyond_batch()),
            kib(max)
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The meter against the transfers of a dp2 step of tiny-1m counted by hand from the
    /// model's shape: the `seq + 1` ids of each sequence (8 bytes each, uploaded once for
    /// inputs and targets, in one upload per rank for all its micro-batches); per micro-batch, the loss's scalar and nothing else of the
    /// activations (without tensor parallelism a stage is one graph on the device); per rank,
    /// the whole gradient read and written back for the data-parallel reduction; the probe's
    /// reads of it, once per micro-batch and once after the reduction. Then an evaluation read
    /// of every rank's parameters between two steps shows in the next step.
    #[test]
    fn the_host_traffic_meter_counts_a_dp2_step_by_hand() {
        let mut spec = ModelSpec::tiny_1m();
        spec.seq_len = 64;
        let (b_g, b_m, dp, ranks) = (16u64, 2u64, 2u64, 2u64);
        let s = spec.seq_len as u64;
        let p = spec.num_params();
        let micro_per_rank = b_g / (dp * b_m);
        let (h, largest) = steady_step_traffic(ParallelDims::new(2, 1, 1, 2).unwrap());
        assert_eq!(h.batch, b_g * (s + 1) * 8);
        // Four micro-batches a rank, their ids in one upload.
        assert_eq!((micro_per_rank, h.batch_uploads), (4, ranks), "one upload of token ids per rank and step");
        assert_eq!(h.activations, b_g / b_m * 4);
        assert_eq!(h.collective, ranks * 2 * p * 4);
        assert_eq!(h.probe, ranks * (micro_per_rank + 1) * p * 4);
        assert_eq!((h.constants, h.state, h.evaluation), (0, 0, 0));
        assert_eq!(largest, h.total() / 2, "the two replicas move the same");

        let (_, cfg, _, full, optim) = bench_model();
        let ec = EngineOptions::default().engine_config_of(ParallelDims::new(2, 1, 1, 2).unwrap(), (B_G, B_M), spec.seq_len, optim);
        let mut engine = Engine::new(Arc::new(cfg), &full, ec).unwrap();
        engine.step(synthetic_batch(16, spec.seq_len, spec.vocab_size, 0)).unwrap();
        engine.rank_params().unwrap();
        let next = engine.step(synthetic_batch(16, spec.seq_len, spec.vocab_size, 1)).unwrap();
        assert_eq!(next.host.evaluation, ranks * p * 4);
        assert_eq!(next.host.beyond_batch() - next.host.evaluation, h.beyond_batch());
    }
}
