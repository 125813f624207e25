//! The orchestrator service deciding a real run through the driver (copus-service with
//! copus-burn and the Llama family; the service crate itself links no tensor library).

use std::sync::Arc;
use std::time::Duration;

use copus_burn::driver::Clock;
use copus_burn::{DataSource, Driver, Engine, EngineConfig, OptimConfig};
use copus_core::candidates::{Candidate, CandidateSpace};
use copus_core::decision::DecisionSource;
use copus_core::layout::ParallelDims;
use copus_core::memory::{GIB, MemoryModel};
use copus_core::model::ModelSpec;
use copus_core::orchestrator::{Orchestrator, RunFingerprint};
use copus_core::policy::{CopusRule, Scorer, SwitchRule};
use copus_core::schedule::ScheduleKind;
use copus_core::throughput::{ProfileEntry, ThroughputProfile};
use copus_models::{LlamaConfig, full_params};
use copus_service::{BACKOFF, Client, MakeOrchestrator, PolicyName, RemoteSource, ServiceConfig, policy_by_name, spawn};

const TOKEN: &str = "0123456789abcdef-test";

/// Short real runs through the driver on a modelled clock: decided by the service on
/// 127.0.0.1, by the service killed after step 3 and started again after step 5 (the
/// embedded orchestrator decides meanwhile and hands its state over on reconnecting), and
/// in process. All give the same decisions at the same steps and the same losses.
#[test]
fn a_run_decided_by_the_service_equals_one_decided_in_process_also_across_a_killed_service() {
    struct Tokens(usize);
    impl DataSource for Tokens {
        fn sequences(&self, first: u64, count: usize) -> Vec<i64> {
            // Every sequence counts up by 3 from a start that varies: a shared, learnable rule.
            (first..first + count as u64).flat_map(|i| (0..33u64).map(move |j| ((i % 5 + 3 * j) % self.0 as u64) as i64)).collect()
        }
    }
    let mut spec = ModelSpec::tiny_1m();
    spec.seq_len = 32;
    let cfg = LlamaConfig::from_spec(&spec);
    let device = burn::tensor::Device::flex().autodiff();
    let full = {
        device.seed(3);
        full_params(&cfg.init(&device))
    };
    let space = CandidateSpace::new(2, vec![2, 4], vec![1, 2], ScheduleKind::OneFOneB, MemoryModel::fp32(), 64.0 * GIB).unwrap();
    let enumeration = space.enumerate(&spec);
    let fp = RunFingerprint::new(&spec, &space);
    // A made-up profile on a modelled clock, so decisions do not depend on this machine.
    let entries: Vec<ProfileEntry> = enumeration
        .feasible
        .iter()
        .map(|c| ProfileEntry::of(c, if c.dims.tp == 2 { 40.0 } else { 10.0 } * c.global_batch as f64 / (1.0 + c.micro_batch as f64)))
        .collect();
    let profile = ThroughputProfile::new("t".into(), "tiny-1m".into(), entries).unwrap();
    let scorer = Scorer::plain(&enumeration.feasible, &profile, 2.0).unwrap();
    let rule = SwitchRule { layout_cost: 0.0, min_dwell_steps: 1, confirm_steps: 1, ..SwitchRule::default() };
    let orchestrator = {
        let s = scorer.clone();
        move || Orchestrator::new(policy_by_name(PolicyName::Copus, &s, CopusRule::Switch(rule), 2).unwrap(), s.clone())
    };
    const STEPS: usize = 8;
    let run = |source: &mut dyn DecisionSource, between: &mut dyn FnMut(usize)| {
        let start = Candidate::new(ParallelDims { dp: 2, tp: 1, pp: 1 }, 2, 1).unwrap();
        let ec = EngineConfig::new(start.dims, 2, 1, 32, OptimConfig::new().with_b0(2).with_warmup_steps(1));
        let engine = Engine::new(Arc::new(cfg.clone()), &full, ec).unwrap();
        let p = profile.clone();
        let clock = Clock::Modelled {
            step_secs: Box::new(move |c: &Candidate| {
                c.global_batch as f64 / copus_core::throughput::ThroughputModel::samples_per_sec(&p, c).unwrap_or(1.0)
            }),
            batch_switch_secs: 0.1,
            layout_switch_secs: 1.0,
        };
        let mut driver = Driver::new(engine, enumeration.clone(), clock).unwrap();
        let mut out = Vec::new();
        for i in 0..STEPS {
            let s = driver.step(&Tokens(spec.vocab_size), source).unwrap();
            out.push((s.step.metrics.loss, s.step.metrics.b_simple, s.decision));
            between(i + 1);
        }
        out
    };
    let make: MakeOrchestrator = Arc::new(orchestrator.clone());
    let cfg_of = || ServiceConfig::new(TOKEN.into(), fp.clone());
    let in_process = run(&mut orchestrator(), &mut |_| {});
    assert!(in_process.iter().any(|(_, _, d)| d.as_ref().is_some_and(|d| d.applied)), "the policy switched at least once: {in_process:?}");

    let service = spawn("127.0.0.1:0".parse().unwrap(), cfg_of(), make.clone()).unwrap();
    let addr = service.addr;
    let client = Client::connect(addr, TOKEN, "test", fp.clone(), "copus").unwrap();
    let mut remote = RemoteSource::synchronous(client, orchestrator(), Duration::from_secs(10));
    let by_service = run(&mut remote, &mut |_| {});
    assert_eq!(by_service, in_process);
    assert!(remote.unavailable().is_none());
    assert_eq!(remote.fallback_steps(), 0);

    let client = Client::connect(addr, TOKEN, "test", fp.clone(), "copus").unwrap();
    let mut remote = RemoteSource::synchronous(client, orchestrator(), Duration::from_secs(10));
    let mut service = Some(service);
    let mut restarted = None;
    let across = run(&mut remote, &mut |done| {
        if done == 3 {
            drop(service.take().expect("running"));
        }
        if done == 5 {
            restarted = Some(spawn(addr, cfg_of(), make.clone()).expect("the port is free again"));
            // Past the first reconnection backoff, so step 6 reconnects.
            std::thread::sleep(BACKOFF.0 * 2);
        }
    });
    assert_eq!(across, in_process, "decisions across the outage");
    assert!(remote.unavailable().is_some());
    // Steps 4 (connection lost) and 5 (nobody listening) were decided in process; from step 6
    // on the restarted service, handed the run's state, decides.
    assert_eq!(remote.fallback_steps(), 2, "{:?}", remote.unavailable());
    drop(restarted.expect("restarted"));
}
