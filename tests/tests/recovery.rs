//! In-process recovery: a rank that panics in the middle of a step, a collective that times out
//! (a hung rank), a device that is gone, and training that diverges past its restores. The
//! driver rebuilds the engine from its last snapshot and redoes the lost steps from the same
//! data positions; from the snapshot on, the run must take the steps an uninterrupted run takes,
//! bit for bit (the same layout, data and seeds), or, after a device is lost, the steps of a run
//! that moved to the smaller layout at the snapshot. Faults are planted with copus-burn's
//! `fault-injection` feature.

#![forbid(unsafe_code)]

use std::sync::Arc;

use copus_burn::driver::{Clock, Divergence, RecoveryCause, RecoveryRecord};
use copus_burn::{DataSource, Driver, DriverError, Engine, EngineConfig, OptimConfig, TrainingState};
use copus_core::candidates::{CandidateSpace, Enumeration};
use copus_core::decision::Scripted;
use copus_core::layout::ParallelDims;
use copus_core::memory::{GIB, MemoryModel};
use copus_core::schedule::ScheduleKind;
use copus_models::LlamaConfig;
use copus_tests::{IndexedSequences, SEQ, config, dims, initial_full};

const B_G: usize = 8;
const LR: f64 = 2e-3;

fn engine(d: ParallelDims, timeout_secs: f64) -> Engine<LlamaConfig> {
    let optim = OptimConfig::new().with_lr(LR).with_warmup_steps(1).with_total_steps(20).with_b0(B_G);
    let cfg = EngineConfig::new(d, B_G, 2, SEQ, optim).with_timeout_secs(timeout_secs);
    Engine::new(Arc::new(config()), initial_full(), cfg).unwrap()
}

fn space(world: usize) -> Enumeration {
    CandidateSpace::new(world, vec![B_G], vec![2], ScheduleKind::OneFOneB, MemoryModel::fp32(), 64.0 * GIB)
        .unwrap()
        .enumerate(&copus_burn::ParallelLm::spec(&config()))
}

/// A driver on `d` that snapshots every 2 steps and may recover `recoveries` times.
fn driver(d: ParallelDims, recoveries: u32, timeout_secs: f64) -> Driver<LlamaConfig> {
    let divergence = Divergence { max_bad_steps: 2, snapshot_every: 2, max_restores: 1 };
    Driver::new(engine(d, timeout_secs), space(d.world_size()), Clock::Wall)
        .unwrap()
        .with_divergence(divergence)
        .with_recoveries(recoveries)
}

fn data() -> IndexedSequences {
    IndexedSequences { vocab: config().shape.vocab_size }
}

/// Steps until `steps_done` reaches `until`; each returned step's number, loss bits and
/// recoveries.
fn run_to(d: &mut Driver<LlamaConfig>, until: u64) -> (Vec<(u64, u64)>, Vec<RecoveryRecord>) {
    let (mut steps, mut recovered) = (Vec::new(), Vec::new());
    let mut keep = Scripted::new([]);
    while d.engine().steps_done() < until {
        let s = d.step(&data(), &mut keep).unwrap();
        recovered.extend(s.recovered);
        if !s.step.skipped {
            steps.push((s.step.metrics.step, s.step.metrics.loss.to_bits()));
        }
    }
    (steps, recovered)
}

fn assert_same(a: &TrainingState, b: &TrainingState, what: &str) {
    assert_eq!((a.step, a.tokens_seen), (b.step, b.tokens_seen), "{what}: counters");
    let same = |x: &[f32], y: &[f32]| x.len() == y.len() && x.iter().zip(y).all(|(p, q)| p.to_bits() == q.to_bits());
    for (k, v) in &a.params {
        assert!(same(v, &b.params[k]), "{what}: parameter {k}");
    }
    for (k, fields) in &a.optim {
        for (f, v) in fields {
            assert!(same(v, &b.optim[k][f]), "{what}: {k} {f}");
        }
    }
    assert_eq!(a.gns.observations(), b.gns.observations(), "{what}: estimator");
}

/// The steps of the faulted run from the snapshot on are the reference's: the last time each
/// step number after `back_to` was trained (a lost step is trained again), with the
/// reference's loss bits, in order.
fn assert_matches_reference(faulted: &[(u64, u64)], reference: &[(u64, u64)], back_to: u64) {
    let mut last: Vec<(u64, u64)> = Vec::new();
    for &(s, l) in faulted.iter().filter(|x| x.0 > back_to) {
        last.retain(|x| x.0 != s);
        last.push((s, l));
    }
    let want: Vec<_> = reference.iter().filter(|x| x.0 > back_to).copied().collect();
    assert!(!want.is_empty());
    assert_eq!(last, want, "losses from the snapshot on");
}

#[test]
fn a_rank_that_panics_mid_step_is_recovered_and_the_run_matches_an_uninterrupted_one() {
    let mut reference = driver(dims(2, 2, 1), 0, 60.0);
    let (want, none) = run_to(&mut reference, 6);
    assert!(none.is_empty());

    let mut faulted = driver(dims(2, 2, 1), 2, 60.0);
    // Step 4 fails on rank 3 after its backward passes; the last snapshot is after step 2.
    faulted.engine_mut().inject_panic(3, 3);
    let (got, recovered) = run_to(&mut faulted, 6);
    assert_eq!(recovered.len(), 1, "{recovered:?}");
    let r = &recovered[0];
    assert_eq!((r.failed_step, r.back_to_step, r.lost_steps, r.recovery), (4, 2, 1, 1), "{r:?}");
    match &r.cause {
        RecoveryCause::Rank { rank, message } => assert!(*rank == 3 && message.contains("planted panic"), "{r:?}"),
        other => panic!("{other:?}"),
    }
    assert_eq!((r.from, r.to), (reference.current(), reference.current()), "the same layout");
    assert_eq!(r.lr, LR, "a failed rank does not change the learning rate");
    assert!(r.measured_secs > 0.0 && r.clock_secs == r.measured_secs, "{r:?}");
    // Steps 1-3, then 3 again (step 3 was lost), then 4-6, each as the uninterrupted run's.
    let numbers: Vec<u64> = got.iter().map(|x| x.0).collect();
    assert_eq!(numbers, vec![1, 2, 3, 3, 4, 5, 6]);
    assert_eq!(got[2], got[3], "the redone step is the lost one");
    assert_matches_reference(&got, &want, 2);
    assert_eq!(faulted.next_sample(), reference.next_sample());
    assert_eq!(faulted.recoveries(), 1);
    assert_eq!(faulted.position().recoveries, 1, "a checkpoint keeps the count");
    assert_same(&reference.engine_mut().stage_state().unwrap(), &faulted.engine_mut().stage_state().unwrap(), "after 6 steps");
}

#[test]
fn a_collective_timeout_is_recovered_and_the_run_matches_an_uninterrupted_one() {
    let mut reference = driver(dims(2, 1, 1), 0, 3.0);
    let (want, _) = run_to(&mut reference, 5);

    let mut faulted = driver(dims(2, 1, 1), 1, 3.0);
    let (mut got, _) = run_to(&mut faulted, 3);
    // Rank 1 hangs in step 4: rank 0's collective times out after three seconds.
    faulted.engine_mut().inject_stall(1);
    let started = std::time::Instant::now();
    let (more, recovered) = run_to(&mut faulted, 5);
    got.extend(more);
    assert!(started.elapsed().as_secs_f64() < 30.0, "{:?}", started.elapsed());
    assert_eq!(recovered.len(), 1, "{recovered:?}");
    let r = &recovered[0];
    assert_eq!((r.failed_step, r.back_to_step, r.lost_steps), (4, 2, 1), "{r:?}");
    let text = r.cause.to_string();
    assert!(text.contains("timed out") || text.contains("no answer"), "{text}");
    // Rank 0 reported the timeout; the rank it waited for is the one to blame.
    assert!(matches!(r.cause, RecoveryCause::Rank { rank: 1, .. }), "{r:?}");
    assert!(r.failed_step_secs >= 3.0, "the wait is on the clock: {r:?}");
    assert_matches_reference(&got, &want, 2);
    assert_same(&reference.engine_mut().stage_state().unwrap(), &faulted.engine_mut().stage_state().unwrap(), "after 5 steps");
}

#[test]
fn a_lost_device_moves_the_run_to_a_layout_of_fewer_ranks_from_the_snapshot() {
    let mut faulted = driver(dims(2, 1, 1), 1, 60.0).with_smaller_worlds(Box::new(space));
    faulted.engine_mut().inject_device_loss(3, 1);
    let (got, recovered) = run_to(&mut faulted, 6);
    assert_eq!(recovered.len(), 1, "{recovered:?}");
    let r = &recovered[0];
    assert_eq!((r.failed_step, r.back_to_step), (4, 2), "{r:?}");
    assert_eq!((r.from.dims, r.to.dims), (dims(2, 1, 1), dims(1, 1, 1)), "{r:?}");
    assert_eq!((r.to.global_batch, r.to.micro_batch, r.to.num_micro), (B_G, 2, 4), "same B_g, twice the micro-batches");
    assert_eq!(faulted.current(), r.to);
    // The reference: two steps on dp2, then the state moved to one rank and trained on.
    let mut reference = engine(dims(2, 1, 1), 60.0);
    let seqs = |i: u64| data().sequences(i * B_G as u64, B_G);
    let mut want: Vec<(u64, u64)> = (0..2).map(|i| (i + 1, reference.step(seqs(i)).unwrap().metrics.loss.to_bits())).collect();
    let state = reference.stage_state().unwrap();
    let mut cfg = reference.config().clone();
    cfg.dims = dims(1, 1, 1);
    let mut serial = Engine::from_state(reference.model().clone(), &state, cfg).unwrap();
    want.extend((2..6).map(|i| (i + 1, serial.step(seqs(i)).unwrap().metrics.loss.to_bits())));
    assert_matches_reference(&got, &want, 2);
    assert_same(&serial.stage_state().unwrap(), &faulted.engine_mut().stage_state().unwrap(), "after 6 steps");
    // Decisions are checked against the smaller world's space from now on.
    assert!(faulted.check(&r.to).is_ok() && faulted.check(&r.from).is_err());
    // Its checkpoint resumes in the whole world again (the device is back), with its state.
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("after-fallback.bpk");
    let mut keep = Scripted::new([]);
    faulted.save_checkpoint(&path, &keep, &Default::default()).unwrap();
    let (mut resumed, _) = Driver::resume(faulted.engine().model().clone(), &path, space(2), Clock::Wall, &mut keep).unwrap();
    assert_eq!(resumed.current().dims, dims(2, 1, 1));
    assert_same(&faulted.engine_mut().stage_state().unwrap(), &resumed.engine_mut().stage_state().unwrap(), "resumed in dp2");
    assert!(!resumed.step(&data(), &mut keep).unwrap().step.skipped);
}

#[test]
fn a_lost_device_without_smaller_worlds_stops_with_the_devices_error() {
    let mut faulted = driver(dims(2, 1, 1), 1, 60.0);
    faulted.engine_mut().inject_device_loss(1, 1);
    let mut keep = Scripted::new([]);
    faulted.step(&data(), &mut keep).unwrap();
    let e = faulted.step(&data(), &mut keep).expect_err("no layout can start");
    assert!(e.to_string().contains("devices are left"), "{e}");
}

#[test]
fn past_its_recoveries_a_failing_rank_stops_the_run_naming_the_bound() {
    let mut faulted = driver(dims(2, 1, 1), 1, 60.0);
    faulted.engine_mut().inject_panic(1, 0);
    let (_, recovered) = run_to(&mut faulted, 3);
    assert_eq!(recovered.len(), 1);
    faulted.engine_mut().inject_panic(3, 1);
    let mut keep = Scripted::new([]);
    let e = faulted.step(&data(), &mut keep).expect_err("no recovery left");
    assert!(matches!(&e, DriverError::Unrecovered { recoveries: 1, .. }), "{e}");
    let text = e.to_string();
    assert!(text.contains("rank 1") && text.contains("train.max_recoveries"), "{text}");
    // Without recoveries the rank's error is the step's, as before.
    let mut plain = driver(dims(2, 1, 1), 0, 60.0);
    plain.engine_mut().inject_panic(0, 1);
    assert!(matches!(plain.step(&data(), &mut keep), Err(DriverError::Engine(copus_burn::EngineError::Rank { rank: 1, .. }))));
}

#[test]
fn divergence_past_its_restores_is_recovered_at_a_halved_learning_rate() {
    let mut faulted = driver(dims(2, 1, 1), 1, 60.0);
    // Steps 1-2 train (a snapshot after step 2); then NaN gradients: two bad steps restore
    // (lr / 2), two more find no restore left and recover (lr / 4).
    faulted.engine_mut().inject_nan_gradients(2, 4);
    let mut keep = Scripted::new([]);
    let mut recovered = Vec::new();
    let mut restored = Vec::new();
    for _ in 0..7 {
        let s = faulted.step(&data(), &mut keep).unwrap();
        restored.push(s.restored);
        recovered.extend(s.recovered);
    }
    assert_eq!(restored, vec![None, None, None, Some(2), None, Some(2), None], "restore, then recovery");
    assert_eq!(recovered.len(), 1, "{recovered:?}");
    let r = &recovered[0];
    assert_eq!((&r.cause, r.back_to_step, r.lr), (&RecoveryCause::Diverged, 2, LR / 4.0), "{r:?}");
    assert_eq!(faulted.engine().config().optim.lr, LR / 4.0);
    assert_eq!(faulted.engine().steps_done(), 3, "training goes on after the recovery");
    assert_eq!(faulted.next_sample(), 3 * B_G as u64, "step 3 trained on the sequences after the snapshot's");
}
