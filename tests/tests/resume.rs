//! Whole-run checkpoints: a run stopped at step k and resumed from its checkpoint takes the same
//! steps, decisions and reconfigurations as the run that was never stopped.

#![forbid(unsafe_code)]

use std::collections::BTreeMap;
use std::sync::Arc;

use copus_burn::driver::Clock;
use copus_burn::run_dir::RunDirError;
use copus_burn::{Driver, Engine, EngineConfig, OptimConfig, RunDir};
use copus_core::candidates::{Candidate, CandidateSpace, Enumeration};
use copus_core::decision::{DecisionSource, Scripted};
use copus_core::memory::{GIB, MemoryModel};
use copus_core::orchestrator::Orchestrator;
use copus_core::policy::{Copus, Scorer, SwitchRule};
use copus_core::schedule::ScheduleKind;
use copus_core::throughput::ThroughputModel;
use copus_models::LlamaConfig;
use copus_tests::{IndexedSequences, SEQ, config, dims, initial_full};

fn optim() -> OptimConfig {
    OptimConfig::new().with_lr(1e-3).with_warmup_steps(2).with_total_steps(20).with_b0(8)
}

/// Four ranks; B_g in {8, 16}, B_m in {1, 2, 4}; memory is no constraint.
fn space() -> Enumeration {
    let s = CandidateSpace::new(4, vec![8, 16], vec![1, 2, 4], ScheduleKind::OneFOneB, MemoryModel::fp32(), 64.0 * GIB).unwrap();
    s.enumerate(&copus_burn::ParallelLm::spec(&config()))
}

fn cand(dp: usize, tp: usize, pp: usize, b_g: usize, b_m: usize) -> Candidate {
    Candidate::new(dims(dp, tp, pp), b_g, b_m).unwrap()
}

fn driver_at(c: Candidate, clock: Clock) -> Driver<LlamaConfig> {
    let ec = EngineConfig::new(c.dims, c.global_batch, c.micro_batch, SEQ, optim());
    Driver::new(Engine::new(Arc::new(config()), initial_full(), ec).unwrap(), space(), clock).unwrap()
}

/// (loss, configuration, whether a switch followed) of each step.
type Trace = Vec<(f64, Candidate, bool)>;

fn steps(driver: &mut Driver<LlamaConfig>, source: &mut dyn DecisionSource, n: usize) -> Trace {
    let data = IndexedSequences { vocab: config().shape.vocab_size };
    (0..n)
        .map(|_| {
            let s = driver.step(&data, source).unwrap();
            (s.step.metrics.loss, s.candidate, s.switch.is_some())
        })
        .collect()
}

fn assert_same(resumed: &Trace, whole: &Trace, params: (&mut Driver<LlamaConfig>, &mut Driver<LlamaConfig>)) {
    assert_eq!(resumed.len(), whole.len());
    for (i, (a, b)) in resumed.iter().zip(whole).enumerate() {
        assert_eq!((a.1, a.2), (b.1, b.2), "step {i}: configuration and switch");
        assert!((a.0 - b.0).abs() <= 1e-6, "step {i}: loss {} vs {}", a.0, b.0);
    }
    let (p, q) = (params.0.engine_mut().gather().unwrap(), params.1.engine_mut().gather().unwrap());
    for (k, v) in &p {
        let worst = v.iter().zip(&q[k]).map(|(x, y)| (x - y).abs()).fold(0.0f32, f32::max);
        assert!(worst <= 1e-6, "parameter {k}: off by {worst}");
    }
}

/// Scripted: a batch change before the stop, a layout change after the resume.
#[test]
fn a_resumed_run_equals_the_uninterrupted_run_through_a_reconfiguration() {
    let start = cand(2, 2, 1, 8, 2);
    let plan = [(2, cand(2, 2, 1, 16, 4)), (5, cand(1, 2, 2, 16, 2))];
    let mut whole = driver_at(start, Clock::Wall);
    let whole_trace = steps(&mut whole, &mut Scripted::new(plan), 7);

    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("step-3.bpk");
    let mut first = driver_at(start, Clock::Wall);
    let mut source = Scripted::new(plan);
    let mut trace = steps(&mut first, &mut source, 3);
    let extra = BTreeMap::from([("seed".to_string(), "11".to_string())]);
    first.save_checkpoint(&path, &source, &extra).unwrap();
    let stopped_at = first.position();
    drop(first);

    let (mut resumed, got_extra) = Driver::resume(Arc::new(config()), &path, space(), Clock::Wall, &mut source).unwrap();
    assert_eq!(got_extra, extra, "the caller's entries come back");
    assert_eq!(resumed.position().next_sample, stopped_at.next_sample);
    assert_eq!(resumed.current(), cand(2, 2, 1, 16, 4), "the layout and batch of the stop");
    trace.extend(steps(&mut resumed, &mut source, 4));
    assert_eq!(trace.iter().filter(|t| t.2).count(), 2, "both switches happened");
    assert_eq!(resumed.current(), cand(1, 2, 2, 16, 2));
    assert_eq!(resumed.next_sample(), whole.next_sample());
    assert_same(&trace, &whole_trace, (&mut resumed, &mut whole));
}

/// A throughput model under which the policy finds dp4 at B_g 16 best once noise is measured.
struct Favours;
impl ThroughputModel for Favours {
    fn samples_per_sec(&self, c: &Candidate) -> Option<f64> {
        Some(10.0 * c.dims.dp as f64 * (c.global_batch as f64).sqrt() / (1.0 + c.dims.pp as f64 * 0.1) * (c.micro_batch as f64).powf(0.1))
    }
}

/// The embedded Copus orchestrator decides; its learned throughput and switch cost are part
/// of the checkpoint, so the resumed run decides as the uninterrupted one.
#[test]
fn a_resumed_run_under_copus_keeps_what_the_policy_learned() {
    let start = cand(1, 2, 2, 8, 2);
    let feasible = space().feasible;
    let scorer = Scorer::plain(&feasible, &Favours, 8.0).unwrap();
    // A dwell time and confirmations short enough for a short run, long enough that the
    // policy's dwell and confirmation state spans the stop.
    let rule = SwitchRule { horizon: 50.0, layout_cost: 1.0, min_dwell_steps: 3, confirm_steps: 2, ..SwitchRule::default() };
    let orchestrator = || Orchestrator::new(Box::new(Copus::new(scorer.clone(), rule).unwrap()), scorer.clone());
    // The modelled clock runs every candidate at 70% of the prior: the orchestrator learns it.
    let clock = || Clock::Modelled {
        step_secs: Box::new(|c: &Candidate| c.global_batch as f64 / (0.7 * Favours.samples_per_sec(c).unwrap())),
        batch_switch_secs: 0.2,
        layout_switch_secs: 3.0,
    };
    let mut whole_source = orchestrator();
    let mut whole = driver_at(start, clock());
    let whole_trace = steps(&mut whole, &mut whole_source, 12);

    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("step-4.bpk");
    let mut source = orchestrator();
    let mut first = driver_at(start, clock());
    let mut trace = steps(&mut first, &mut source, 4);
    first.save_checkpoint(&path, &source, &BTreeMap::new()).unwrap();
    let saved = source.state();
    drop((first, source));

    let mut fresh = orchestrator();
    let (mut resumed, _) = Driver::resume(Arc::new(config()), &path, space(), clock(), &mut fresh).unwrap();
    assert_eq!(fresh.state(), saved, "the policy's learned state came back");
    assert!(!saved.measured.is_empty(), "throughput was learned before the stop");
    assert!(saved.learned.seen.is_some(), "the dwell state was saved");
    trace.extend(steps(&mut resumed, &mut fresh, 8));
    // Copus switched after the resume, and the run went on in the new configuration.
    let first_switch = trace.iter().position(|t| t.2).expect("Copus switched");
    assert!((4..11).contains(&first_switch), "switch after step {}", first_switch + 1);
    assert_ne!(trace[11].1, start);
    assert_eq!(resumed.clock_secs(), whole.clock_secs(), "the run's clock continues");
    assert_eq!(fresh.state(), whole_source.state());
    assert_same(&trace, &whole_trace, (&mut resumed, &mut whole));
}

/// A checkpoint of another policy, or a file that is not a whole-run checkpoint, is refused
/// with its reason.
#[test]
fn a_checkpoint_that_cannot_continue_the_run_is_refused() {
    let start = cand(4, 1, 1, 8, 2);
    let dir = tempfile::tempdir().unwrap();
    let feasible = space().feasible;
    let scorer = Scorer::plain(&feasible, &Favours, 8.0).unwrap();
    let copus = Orchestrator::new(Box::new(Copus::new(scorer.clone(), SwitchRule::default()).unwrap()), scorer.clone());
    let mut d = driver_at(start, Clock::Wall);
    let path = dir.path().join("c.bpk");
    d.save_checkpoint(&path, &copus, &BTreeMap::new()).unwrap();
    let mut other = Orchestrator::new(Box::new(copus_core::policy::Static), scorer);
    let err = Driver::resume(Arc::new(config()), &path, space(), Clock::Wall, &mut other).err().unwrap().to_string();
    assert!(err.contains("policy `copus`") && err.contains("static"), "{err}");
    // An engine checkpoint (no driver position) is not a whole-run checkpoint.
    let engine_only = dir.path().join("e.bpk");
    d.engine_mut().save_checkpoint(&engine_only, &BTreeMap::new()).unwrap();
    let err = Driver::resume(Arc::new(config()), &engine_only, space(), Clock::Wall, &mut Scripted::new([])).err().unwrap().to_string();
    assert!(err.contains("not a whole-run checkpoint"), "{err}");
}

// ---- The run folder ---------------------------------------------------------------------------

/// A truncated newest checkpoint: the resume falls back to the one before and renames the
/// damaged file aside, so it never counts again. The resumed run continues as the uninterrupted
/// one from there, and its next save starts the new branch; the damaged file, even made readable
/// again, is not resumed from.
#[test]
fn a_damaged_newest_checkpoint_is_set_aside_and_never_resumed() {
    let start = cand(2, 2, 1, 8, 2);
    let mut whole = driver_at(start, Clock::Wall);
    let whole_trace = steps(&mut whole, &mut Scripted::default(), 6);

    let dir = tempfile::tempdir().unwrap();
    let run = RunDir::new(dir.path());
    let mut first = driver_at(start, Clock::Wall);
    let mut source = Scripted::default();
    steps(&mut first, &mut source, 3);
    run.save(&mut first, &source, &BTreeMap::new()).unwrap();
    steps(&mut first, &mut source, 1);
    let newest = run.save(&mut first, &source, &BTreeMap::new()).unwrap();
    drop(first);
    let good = std::fs::read(&newest).unwrap();
    std::fs::write(&newest, &good[..good.len() / 2]).unwrap();

    let (mut resumed, from) = run.resume(Arc::new(config()), &space(), || Clock::Wall, &mut source).unwrap();
    assert_eq!(from, run.checkpoint_path(3));
    assert_eq!(resumed.engine().steps_done(), 3);
    let aside = newest.with_extension("bpk.bad");
    assert!(aside.exists() && !newest.exists(), "the damaged file is renamed aside");
    assert_eq!(run.checkpoints().iter().map(|c| c.0).collect::<Vec<_>>(), vec![3]);
    let rest = steps(&mut resumed, &mut source, 3);
    assert_same(&rest, &whole_trace[3..].to_vec(), (&mut resumed, &mut whole));

    // The set-aside file made whole again still does not count.
    std::fs::write(&aside, &good).unwrap();
    run.save(&mut resumed, &source, &BTreeMap::new()).unwrap();
    assert_eq!(run.checkpoints().iter().map(|c| c.0).collect::<Vec<_>>(), vec![3, 6]);
    let (again, from) = run.resume(Arc::new(config()), &space(), || Clock::Wall, &mut source).unwrap();
    assert_eq!((from, again.engine().steps_done()), (run.checkpoint_path(6), 6));
}

/// A checkpoint that is whole but cannot continue this run (another model) stops the resume
/// with its cause; it neither falls back to an older checkpoint nor is renamed.
#[test]
fn an_unusable_checkpoint_stops_the_resume_with_its_cause() {
    let dir = tempfile::tempdir().unwrap();
    let run = RunDir::new(dir.path());
    let mut source = Scripted::default();
    let mut first = driver_at(cand(2, 2, 1, 8, 2), Clock::Wall);
    steps(&mut first, &mut source, 1);
    run.save(&mut first, &source, &BTreeMap::new()).unwrap();
    steps(&mut first, &mut source, 1);
    let newest = run.save(&mut first, &source, &BTreeMap::new()).unwrap();
    drop(first);
    let other = config().with_tied_embeddings(!config().shape.tied_embeddings);
    let space = CandidateSpace::new(4, vec![8, 16], vec![1, 2, 4], ScheduleKind::OneFOneB, MemoryModel::fp32(), 64.0 * GIB)
        .unwrap()
        .enumerate(&copus_burn::ParallelLm::spec(&other));
    let err = run.resume(Arc::new(other), &space, || Clock::Wall, &mut source).err().expect("another model cannot resume");
    assert!(matches!(err, RunDirError::Unusable { ref path, .. } if *path == newest), "{err}");
    assert!(newest.exists(), "not renamed: it is not damaged");
}

/// A second process (here a second handle) cannot take a run folder while the first holds it;
/// once the first lets go, it can.
#[test]
fn a_run_folder_is_held_by_one_process_at_a_time() {
    let dir = tempfile::tempdir().unwrap();
    let run = RunDir::new(dir.path());
    let held = run.lock().unwrap();
    let err = run.lock().unwrap_err().to_string();
    assert!(err.contains("in use by another process") && err.contains(&format!("pid {}", std::process::id())), "{err}");
    drop(held);
    run.lock().unwrap();
}
