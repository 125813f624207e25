//! Divergence: a step with a non-finite gradient changes nothing; after too many in a row the
//! driver goes back to its snapshot at half the learning rate, and stops with a clear error when
//! that keeps failing. NaN gradients are injected with copus-burn's `fault-injection` feature.

#![forbid(unsafe_code)]

use std::sync::Arc;

use copus_burn::driver::{Clock, Divergence};
use copus_burn::{DataSource, Driver, DriverError, Engine, EngineConfig, OptimConfig, TrainingState};
use copus_core::candidates::{CandidateSpace, Enumeration};
use copus_core::decision::Scripted;
use copus_core::memory::{GIB, MemoryModel};
use copus_core::schedule::ScheduleKind;
use copus_models::LlamaConfig;
use copus_tests::{IndexedSequences, SEQ, config, dims, initial_full};

const B_G: usize = 8;

fn engine() -> Engine<LlamaConfig> {
    let optim = OptimConfig::new().with_lr(2e-3).with_warmup_steps(1).with_total_steps(20).with_b0(B_G);
    Engine::new(Arc::new(config()), initial_full(), EngineConfig::new(dims(2, 2, 1), B_G, 2, SEQ, optim)).unwrap()
}

fn space() -> Enumeration {
    CandidateSpace::new(4, vec![B_G], vec![2], ScheduleKind::OneFOneB, MemoryModel::fp32(), 64.0 * GIB)
        .unwrap()
        .enumerate(&copus_burn::ParallelLm::spec(&config()))
}

fn assert_same(a: &TrainingState, b: &TrainingState, what: &str) {
    assert_eq!((a.step, a.tokens_seen), (b.step, b.tokens_seen), "{what}: counters");
    let same = |x: &[f32], y: &[f32]| x.len() == y.len() && x.iter().zip(y).all(|(p, q)| p.to_bits() == q.to_bits());
    assert_eq!(a.params.len(), b.params.len(), "{what}");
    for (k, v) in &a.params {
        assert!(same(v, &b.params[k]), "{what}: parameter {k}");
    }
    assert_eq!(a.optim.len(), b.optim.len(), "{what}");
    for (k, fields) in &a.optim {
        for (f, v) in fields {
            assert!(same(v, &b.optim[k][f]), "{what}: {k} {f}");
        }
    }
    assert_eq!(a.scalars, b.scalars, "{what}: optimizer step counts");
    assert_eq!(a.previous.is_some(), b.previous.is_some(), "{what}: probe memory");
    assert_eq!(a.gns.observations(), b.gns.observations(), "{what}: estimator");
}

#[test]
fn a_non_finite_gradient_skips_the_update_and_changes_nothing() {
    let data = IndexedSequences { vocab: config().shape.vocab_size };
    let mut e = engine();
    for s in 0..2u64 {
        assert!(!e.step(data.sequences(s * B_G as u64, B_G)).unwrap().skipped);
    }
    e.inject_nan_gradients(2, 1);
    let before = e.stage_state().unwrap();
    let bad = e.step(data.sequences(16, B_G)).unwrap();
    assert!(bad.skipped && bad.metrics.grad_norm.is_nan(), "{:?}", bad.metrics);
    assert_same(&before, &e.stage_state().unwrap(), "after the skipped step");
    assert_eq!(e.steps_done(), 2);
    // The engine trains on.
    let good = e.step(data.sequences(24, B_G)).unwrap();
    assert!(!good.skipped && good.metrics.loss.is_finite());
    assert_eq!(e.steps_done(), 3);
}

#[test]
fn after_too_many_bad_steps_the_driver_goes_back_to_its_snapshot_at_half_the_learning_rate() {
    let data = IndexedSequences { vocab: config().shape.vocab_size };
    let divergence = Divergence { max_bad_steps: 2, snapshot_every: 2, max_restores: 2 };
    let mut driver = Driver::new(engine(), space(), Clock::Wall).unwrap().with_divergence(divergence);
    let mut keep = Scripted::new([]);
    driver.engine_mut().inject_nan_gradients(3, 2);
    let mut restored = Vec::new();
    for _ in 0..5 {
        let s = driver.step(&data, &mut keep).unwrap();
        restored.push(s.restored);
    }
    // Steps 1-3 train (a snapshot after step 2), the next two are bad, the second bad one restores.
    assert_eq!(restored, vec![None, None, None, None, Some(2)]);
    assert_eq!(driver.next_sample(), 2 * B_G as u64, "the data position goes back with the state");
    assert_eq!(driver.engine().config().optim.lr, 1e-3, "half of 2e-3");
    // The state is the one of a run stopped after step 2.
    let mut reference = engine();
    for s in 0..2u64 {
        reference.step(data.sequences(s * B_G as u64, B_G)).unwrap();
    }
    assert_same(&reference.stage_state().unwrap(), &driver.engine_mut().stage_state().unwrap(), "restored");
    let next = driver.step(&data, &mut keep).unwrap();
    assert!(!next.step.skipped && next.step.metrics.step == 3);
}

#[test]
fn training_that_keeps_diverging_stops_with_a_clear_error() {
    let data = IndexedSequences { vocab: config().shape.vocab_size };
    let divergence = Divergence { max_bad_steps: 2, snapshot_every: 2, max_restores: 2 };
    let mut driver = Driver::new(engine(), space(), Clock::Wall).unwrap().with_divergence(divergence);
    driver.engine_mut().inject_nan_gradients(1, 1000);
    let mut keep = Scripted::new([]);
    let mut restores = 0;
    let error = loop {
        match driver.step(&data, &mut keep) {
            Ok(s) => restores += usize::from(s.restored.is_some()),
            Err(e) => break e,
        }
    };
    assert_eq!(restores, 2);
    assert!(matches!(error, DriverError::Diverged { restores: 2, .. }), "{error}");
    let text = error.to_string();
    assert!(text.contains("diverged") && text.contains("optim.lr") && text.contains("5e-4"), "{text}");
}
