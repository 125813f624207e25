//! The adaptive loop: the driver with a scripted decision source against the engine driven by
//! hand, and decisions outside the candidate space refused while training goes on unchanged.

#![forbid(unsafe_code)]

use std::sync::Arc;

use copus_burn::driver::Clock;
use copus_burn::{DataSource, Driver, Engine, EngineConfig, OptimConfig};
use copus_core::candidates::{Candidate, CandidateSpace, Enumeration};
use copus_core::decision::Scripted;
use copus_core::memory::{GIB, MemoryModel};
use copus_core::schedule::ScheduleKind;
use copus_models::LlamaConfig;
use copus_tests::{IndexedSequences, SEQ, config, dims, initial_full};

fn optim() -> OptimConfig {
    OptimConfig::new().with_lr(1e-3).with_warmup_steps(1).with_total_steps(20).with_b0(8)
}

/// Four ranks; B_g in {8, 16}, B_m in {1, 2, 4}; memory is no constraint.
fn space() -> Enumeration {
    let s = CandidateSpace::new(4, vec![8, 16], vec![1, 2, 4], ScheduleKind::OneFOneB, MemoryModel::fp32(), 64.0 * GIB).unwrap();
    s.enumerate(&copus_burn::ParallelLm::spec(&config()))
}

fn engine_at(c: Candidate) -> Engine<LlamaConfig> {
    Engine::new(Arc::new(config()), initial_full(), EngineConfig::new(c.dims, c.global_batch, c.micro_batch, SEQ, optim())).unwrap()
}

fn cand(dp: usize, tp: usize, pp: usize, b_g: usize, b_m: usize) -> Candidate {
    Candidate::new(dims(dp, tp, pp), b_g, b_m).unwrap()
}

#[test]
fn a_scripted_run_equals_the_engine_driven_by_hand() {
    let data = IndexedSequences { vocab: config().shape.vocab_size };
    let start = cand(2, 2, 1, 8, 2);
    // dp2,tp2 B_g 8 -> (batch) B_g 16 B_m 4 -> (layout) dp1,tp2,pp2 B_g 16 B_m 2.
    let batch_change = cand(2, 2, 1, 16, 4);
    let layout_change = cand(1, 2, 2, 16, 2);
    let mut source = Scripted::new([(2, batch_change), (4, layout_change)]);
    let mut driver = Driver::new(engine_at(start), space(), Clock::Wall).unwrap();
    let mut driven = Vec::new();
    for _ in 0..6 {
        let s = driver.step(&data, &mut source).unwrap();
        driven.push((s.step.metrics.loss, s.candidate));
    }
    assert_eq!(source.reported.iter().map(|r| r.1).collect::<Vec<_>>(), vec![false, true], "one batch change, then one layout change");

    let mut by_hand = engine_at(start);
    let mut sample = 0u64;
    let mut manual = Vec::new();
    for step in 1..=6u64 {
        let c = by_hand.config().clone();
        let loss = by_hand.step(data.sequences(sample, c.global_batch)).unwrap().metrics.loss;
        sample += c.global_batch as u64;
        manual.push((loss, cand(c.dims.dp, c.dims.tp, c.dims.pp, c.global_batch, c.micro_batch)));
        let next = match step {
            2 => Some(batch_change),
            4 => Some(layout_change),
            _ => None,
        };
        if let Some(t) = next {
            by_hand.reconfigure(t.dims, t.global_batch, t.micro_batch).unwrap();
        }
    }
    // The same operations in the same order: bit-identical losses and parameters.
    for (i, ((a, ca), (b, cb))) in driven.iter().zip(&manual).enumerate() {
        assert_eq!(ca, cb, "step {i}: configuration");
        assert_eq!(a.to_bits(), b.to_bits(), "step {i}: loss {a} vs {b}");
    }
    let (p, q) = (driver.engine_mut().gather().unwrap(), by_hand.gather().unwrap());
    for (k, v) in &p {
        assert!(v.iter().zip(&q[k]).all(|(x, y)| x.to_bits() == y.to_bits()), "parameter {k}");
    }
    assert_eq!(driver.next_sample(), sample);
}

#[test]
fn decisions_outside_the_candidate_space_are_refused_and_training_goes_on() {
    let data = IndexedSequences { vocab: config().shape.vocab_size };
    let start = cand(4, 1, 1, 8, 2);
    let huge = Candidate { global_batch: 1 << 40, num_micro: (1 << 40) / 8, ..start };
    let off_list = cand(2, 2, 1, 16, 8);
    // Eight ranks on a four-rank run.
    let too_wide = Candidate::new(dims(2, 4, 1), 16, 2).unwrap();
    let bad_split = Candidate { num_micro: 3, ..start };
    let mut source = Scripted::new([(1, huge), (2, off_list), (3, too_wide), (4, bad_split)]);
    let mut driver = Driver::new(engine_at(start), space(), Clock::Wall).unwrap();
    let mut refused = Vec::new();
    let mut losses = Vec::new();
    for _ in 0..5 {
        let s = driver.step(&data, &mut source).unwrap();
        assert_eq!(s.candidate, start, "the configuration never changed");
        losses.push(s.step.metrics.loss);
        if let Some(d) = s.decision {
            assert!(!d.applied);
            refused.push(d.refused.expect("a reason"));
        }
    }
    assert!(source.reported.is_empty(), "nothing was reconfigured");
    assert_eq!(refused.len(), 4, "{refused:?}");
    assert!(refused[0].contains("1099511627776") && refused[0].contains("global batch list"), "{}", refused[0]);
    assert!(refused[1].contains("B_m = 8") && refused[1].contains("micro-batch list"), "{}", refused[1]);
    assert!(refused[2].contains("layout") && refused[2].contains("not a layout of the run"), "{}", refused[2]);
    assert!(refused[3].contains("a = 3"), "{}", refused[3]);
    // The same steps with no decisions at all: identical losses.
    let mut quiet = Driver::new(engine_at(start), space(), Clock::Wall).unwrap();
    let mut keep = Scripted::new([]);
    for (i, want) in losses.iter().enumerate() {
        let got = quiet.step(&data, &mut keep).unwrap().step.metrics.loss;
        assert_eq!(got.to_bits(), want.to_bits(), "step {i}");
    }
}

/// Records what each step's observation told it.
#[derive(Default)]
struct Seen(Vec<Option<f64>>);

impl copus_core::decision::DecisionSource for Seen {
    fn name(&self) -> String {
        "seen".into()
    }
    fn on_step(&mut self, obs: &copus_core::policy::StepObservation, _samples_per_sec: f64) -> copus_core::policy::Decision {
        self.0.push(obs.remaining_secs);
        copus_core::policy::Decision::Keep
    }
    fn on_reconfigured(&mut self, _seconds: f64, _layout_changed: bool) {}
}

/// The time budget reaches the decision source as the seconds left on the run's clock after
/// each step (the horizon a change must repay its cost over); without one, nothing is said.
#[test]
fn the_decision_source_is_told_the_seconds_left_of_the_budget() {
    let data = IndexedSequences { vocab: config().shape.vocab_size };
    let start = cand(2, 2, 1, 8, 2);
    let mut silent = Driver::new(engine_at(start), space(), Clock::Wall).unwrap();
    let mut seen = Seen::default();
    silent.step(&data, &mut seen).unwrap();
    assert_eq!(seen.0, vec![None]);
    let mut driver = Driver::new(engine_at(start), space(), Clock::Wall).unwrap();
    driver.set_time_budget(Some(1000.0));
    let mut seen = Seen::default();
    let mut clocks = Vec::new();
    for _ in 0..3 {
        driver.step(&data, &mut seen).unwrap();
        clocks.push(driver.clock_secs());
    }
    for (told, clock) in seen.0.iter().zip(&clocks) {
        assert!(*clock > 0.0);
        assert_eq!(*told, Some(1000.0 - clock), "clock {clock}");
    }
    // Past the budget the source hears zero, never a negative time.
    driver.set_time_budget(Some(clocks[2] / 2.0));
    driver.step(&data, &mut seen).unwrap();
    assert_eq!(seen.0[3], Some(0.0));
}
