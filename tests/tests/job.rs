//! The job builder: every engine option reaches the engine, the start is chosen by the
//! throughput model, and the built driver trains.

use std::sync::Arc;

use copus_burn::comm::placement::RankDevice;
use copus_burn::{EngineConfig, EngineOptions, JobBuilder, OptimConfig};
use copus_core::candidates::{Candidate, CandidateSpace, Enumeration};
use copus_core::layout::ParallelDims;
use copus_core::memory::{Checkpointing, GIB, MemoryModel, Precision};
use copus_core::model::ModelSpec;
use copus_core::policy::CopusRule;
use copus_core::schedule::ScheduleKind;
use copus_core::throughput::{ProfileEntry, ThroughputProfile};
use copus_models::{LlamaConfig, full_params};

/// Every option away from its default.
fn all_set(device: RankDevice) -> EngineOptions {
    EngineOptions {
        schedule: ScheduleKind::GPipe,
        device,
        ranks_per_device: Some(2),
        exact_reductions: true,
        checkpointing: Checkpointing::Layers,
        precision: Precision::Bf16Mixed,
        zero1: true,
    }
}

fn spec() -> ModelSpec {
    ModelSpec { seq_len: 16, ..ModelSpec::tiny_1m() }
}

fn space() -> Enumeration {
    CandidateSpace::new(2, vec![2, 4, 64], vec![1, 2], ScheduleKind::GPipe, MemoryModel::fp32(), 64.0 * GIB).unwrap().enumerate(&spec())
}

/// A made-up profile: tp2 twice as fast as the other layouts at every batch.
fn profile(space: &Enumeration) -> ThroughputProfile {
    let entries = space.feasible.iter().map(|c| ProfileEntry::of(c, if c.dims.tp == 2 { 20.0 } else { 10.0 })).collect();
    ThroughputProfile::new("t".into(), "tiny-1m".into(), entries).unwrap()
}

fn dims(dp: usize, tp: usize, pp: usize) -> ParallelDims {
    ParallelDims::new(dp, tp, pp, dp * tp * pp).unwrap()
}

/// Each option lands in its own field, checked one by one against the values set; the
/// defaults are `EngineConfig::new`'s.
#[test]
fn every_engine_option_reaches_the_engine_configuration() {
    let c = Candidate::new(dims(2, 1, 1), 4, 2).unwrap();
    let optim = OptimConfig::new().with_b0(4);
    let ec = all_set(RankDevice::TchCpu).engine_config(&c, 16, optim.clone());
    assert_eq!((ec.dims, ec.global_batch, ec.micro_batch, ec.seq_len), (c.dims, 4, 2, 16));
    assert_eq!(ec.schedule, ScheduleKind::GPipe);
    assert_eq!(ec.devices, vec![RankDevice::TchCpu; 2]);
    assert_eq!(ec.ranks_per_device, Some(2));
    assert!(ec.exact_reductions && ec.zero1);
    assert_eq!(ec.checkpointing, Checkpointing::Layers);
    assert_eq!(ec.precision, Precision::Bf16Mixed);
    assert_eq!(ec.optim, optim);
    // Flex ranks list no devices; the defaults are the engine's own.
    assert!(all_set(RankDevice::Flex).engine_config(&c, 16, optim.clone()).devices.is_empty());
    assert_eq!(EngineOptions::default().engine_config(&c, 16, optim.clone()), EngineConfig::new(c.dims, 4, 2, 16, optim.clone()));
    // A resume keeps the saved configuration but for the precision.
    let saved = EngineConfig::new(c.dims, 4, 2, 16, optim.clone()).with_zero1(true);
    let resumed = EngineOptions { precision: Precision::Bf16Mixed, ..EngineOptions::default() }.on_resume(saved.clone());
    assert_eq!(resumed, saved.with_precision(Precision::Bf16Mixed));
}

/// The start is the fastest layout of the asked batch by the profile, or the asked layout;
/// an infeasible batch is an error; the built driver trains there with every option.
#[test]
fn the_builder_picks_the_start_and_builds_a_driver_that_trains() {
    let spec = spec();
    let cfg = LlamaConfig::from_spec(&spec);
    let device = burn::tensor::Device::flex().autodiff();
    device.seed(1);
    let full = full_params(&cfg.init(&device));
    let space = space();
    let profile = profile(&space);
    let optim = OptimConfig::new().with_b0(4).with_warmup_steps(1);
    let job = || JobBuilder::new(Arc::new(cfg.clone()), space.clone(), optim.clone()).options(all_set(RankDevice::Flex));
    let fastest = job().prior(&profile).unwrap().start_batch(4, 2, None);
    assert_eq!(fastest.start_candidate().unwrap(), Candidate::new(dims(1, 2, 1), 4, 2).unwrap());
    let on_dp2 = job().prior(&profile).unwrap().start_batch(4, 2, Some(dims(2, 1, 1)));
    assert_eq!(on_dp2.start_candidate().unwrap().dims, dims(2, 1, 1));
    let e = job().prior(&profile).unwrap().start_batch(3, 1, None).start_candidate().unwrap_err().to_string();
    assert!(e.contains("B_g 3") && e.contains("not a feasible candidate"), "{e}");
    assert!(job().start_candidate().unwrap_err().to_string().contains("no start"));
    // Copus needs the throughput model.
    assert!(job().start_batch(4, 2, None).copus(CopusRule::default()).build(&full).is_err());

    let built = fastest.copus(CopusRule::default()).build(&full).unwrap();
    let ec = built.driver.engine().config().clone();
    assert_eq!(
        (ec.schedule, ec.checkpointing, ec.precision, ec.zero1, ec.exact_reductions),
        (ScheduleKind::GPipe, Checkpointing::Layers, Precision::Bf16Mixed, true, true)
    );
    assert_eq!(ec.ranks_per_device, Some(2));
    assert_eq!(built.driver.current(), built.start);
    let (mut driver, mut source) = (built.driver, built.orchestrator.unwrap());
    let data = Counting(spec.vocab_size);
    for _ in 0..2 {
        let s = driver.step(&data, &mut source).unwrap();
        assert!(s.step.metrics.loss.is_finite());
    }
}

/// Sequences that count up by 3 from a start that varies.
struct Counting(usize);

impl copus_burn::DataSource for Counting {
    fn sequences(&self, first: u64, count: usize) -> Vec<i64> {
        (first..first + count as u64).flat_map(|i| (0..17u64).map(move |j| ((i % 5 + 3 * j) % self.0 as u64) as i64)).collect()
    }
}
