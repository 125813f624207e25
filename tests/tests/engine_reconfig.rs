//! Reconfiguration between layouts, world sizes and batch sizes, rollback, and checkpoints, on 8
//! (and 4) in-process ranks with tiny-1m (tied embedding, 4 layers, 8 heads, 4 kv heads).

#![forbid(unsafe_code)]

use std::collections::BTreeMap;
use std::sync::{Arc, OnceLock};

use burn::tensor::Device;
use copus_burn::{Engine, EngineConfig, EngineError, OptimConfig, ReconfigPhase, TrainingState};
use copus_core::layout::ParallelDims;

use copus_models::{LlamaConfig, full_params};
use copus_tests::{SEQ, config, dims};

fn optim() -> OptimConfig {
    OptimConfig { lr: 1e-3, warmup_steps: 2, total_steps: 20, b0: 16, ..OptimConfig::default() }
}

/// Step `step`'s batch of `b` sequences (a pure function of both).
fn batch(step: usize, b: usize) -> Vec<i64> {
    let vocab = config().shape.vocab_size;
    let mut x = 0x51_7cc1_b727_220a_u64 ^ (step as u64 + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    (0..b * (SEQ + 1))
        .map(|_| {
            x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((x >> 33) % vocab as u64) as i64
        })
        .collect()
}

/// The initial weights, drawn once: the device RNG is shared by the tests running in parallel,
/// so drawing per engine could give two engines of one test different weights.
fn initial() -> &'static copus_burn::parallel::FullParams {
    static INIT: OnceLock<copus_burn::parallel::FullParams> = OnceLock::new();
    INIT.get_or_init(|| {
        let device = Device::flex().autodiff();
        device.seed(5);
        full_params(&config().init(&device))
    })
}

fn engine(d: ParallelDims, b_g: usize, b_m: usize) -> Engine<LlamaConfig> {
    Engine::new(Arc::new(config()), initial(), EngineConfig::new(d, b_g, b_m, SEQ, optim())).unwrap()
}

/// Trains steps `from..to` at the engine's current B_g; returns the losses.
fn train(e: &mut Engine<LlamaConfig>, from: usize, to: usize) -> Vec<f64> {
    (from..to).map(|s| e.step(batch(s, e.config().global_batch)).unwrap().metrics.loss).collect()
}

fn assert_same_state(a: &TrainingState, b: &TrainingState, what: &str) {
    assert_eq!(a.params.len(), b.params.len(), "{what}");
    for (k, v) in &a.params {
        assert!(v.iter().zip(&b.params[k]).all(|(x, y)| x.to_bits() == y.to_bits()), "{what}: parameter {k} changed");
    }
    assert_eq!(a.optim.len(), b.optim.len(), "{what}: optimizer state of {} vs {} parameters", a.optim.len(), b.optim.len());
    for (k, fields) in &a.optim {
        for (f, v) in fields {
            let w = &b.optim[k][f];
            assert!(v.len() == w.len() && v.iter().zip(w).all(|(x, y)| x.to_bits() == y.to_bits()), "{what}: {k} {f} changed");
        }
    }
    assert_eq!(a.scalars, b.scalars, "{what}: optimizer step counts");
    assert_eq!((a.step, a.tokens_seen), (b.step, b.tokens_seen), "{what}: counters");
}

/// Trains k steps in `a`, switches to `b` (maybe with new batch sizes), trains m more, and
/// compares with the same run that stays in `a` (switching only the batch sizes).
fn switch_matches_staying(a: ParallelDims, b: ParallelDims, (g1, m1): (usize, usize), (g2, m2): (usize, usize)) {
    let name = format!("{a} B_g={g1} B_m={m1} -> {b} B_g={g2} B_m={m2}");
    let (k, m) = (2, 2);
    let mut stay = engine(a, g1, m1);
    train(&mut stay, 0, k);
    stay.reconfigure(a, g2, m2).unwrap();
    let want = train(&mut stay, k, k + m);
    let want_params = stay.gather().unwrap();

    let mut moved = engine(a, g1, m1);
    train(&mut moved, 0, k);
    let before = moved.stage_state().unwrap();
    // Every parameter carries AdamW state: two moments and a step count.
    assert_eq!(before.optim.len(), before.params.len(), "{name}");
    assert!(
        before.optim.values().all(|f| f.len() == 2),
        "{name}: {:?}",
        before.optim.values().next().map(|f| f.keys().collect::<Vec<_>>())
    );
    assert!(before.scalars.values().all(|f| !f.is_empty()), "{name}");
    let report = moved.reconfigure(b, g2, m2).unwrap();
    assert_eq!(report.layout_changed, a != b, "{name}");
    assert_eq!(moved.config().dims, b);
    // Weights, both AdamW moments and step counts arrive bit-exactly.
    assert_same_state(&before, &moved.stage_state().unwrap(), &name);
    let got = train(&mut moved, k, k + m);
    for (i, (x, y)) in got.iter().zip(&want).enumerate() {
        assert!((x - y).abs() <= 1e-5 * y.abs(), "{name}: loss of step {} is {x}, staying gives {y}", k + i);
    }
    let got_params = moved.gather().unwrap();
    for (p, w) in &want_params {
        let worst = got_params[p].iter().zip(w).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max);
        assert!(worst <= 1e-5, "{name}: {p} differs by {worst}");
    }
}

#[test]
fn switching_layouts_changes_nothing_but_the_layout() {
    // dp8,tp1,pp1 -> dp2,tp2,pp2
    switch_matches_staying(dims(8, 1, 1), dims(2, 2, 2), (16, 2), (16, 2));
    // tp4,pp1 -> tp1,pp4 (dp2)
    switch_matches_staying(dims(2, 4, 1), dims(2, 1, 4), (16, 2), (16, 2));
    // tp2,pp4 -> tp4,pp1, dp1 -> dp2
    switch_matches_staying(dims(1, 2, 4), dims(2, 4, 1), (16, 2), (16, 2));
}

/// Bytes a layout must receive: every rank's shards of every parameter it holds, `kinds`
/// tensors each (weights, two AdamW moments, maybe the previous gradient). Computed from the
/// parameter specs alone, not from the reshard plan.
fn bytes_held(specs: &[copus_core::model::ParamSpec], d: ParallelDims, kinds: u64) -> u64 {
    use copus_core::model::{Placement, TpSplit};
    let mut elements = 0u64;
    for s in specs {
        let stages: u64 = match s.placement {
            Placement::FirstAndLast if d.pp > 1 => 2,
            Placement::Layer(_) | Placement::First | Placement::Last | Placement::FirstAndLast => 1,
        };
        // Every rank of a holding stage has a shard: dp * tp ranks per stage; a split parameter
        // gives each of them numel / tp, a replicated one numel.
        let per_rank = match s.tp {
            TpSplit::Split { .. } => s.numel() as u64 / d.tp as u64,
            TpSplit::Replicated => s.numel() as u64,
        };
        elements += stages * (d.dp * d.tp) as u64 * per_rank;
    }
    4 * elements * kinds
}

#[test]
fn a_live_switch_moves_every_piece_of_the_plan_exactly_once() {
    let spec = config();
    let specs = spec.param_specs();
    for (a, b) in [(dims(2, 2, 2), dims(1, 4, 2)), (dims(8, 1, 1), dims(2, 1, 4)), (dims(1, 2, 4), dims(4, 2, 1))] {
        let mut e = engine(a, 16, 2);
        train(&mut e, 0, 2);
        let before = e.stage_state().unwrap();
        let kinds = 3 + u64::from(before.previous.is_some());
        let r = e.reconfigure(b, 16, 2).unwrap();
        assert!(r.live && r.layout_changed, "{a} -> {b}: {r:?}");
        assert_eq!(r.bytes, bytes_held(&specs, b, kinds), "{a} -> {b}: bytes moved");
        // What crosses between ranks is what the new rank did not hold at the same place before.
        let plan =
            copus_core::reshard::ReshardPlan::new(&specs, copus_core::reshard::Placer { num_layers: spec.shape.num_layers }, a, b).unwrap();
        assert_eq!(r.remote_bytes, 4 * kinds * plan.remote_elements(&specs), "{a} -> {b}");
        assert!(r.remote_bytes < r.bytes, "{a} -> {b}: some pieces stay on their rank");
        assert_same_state(&before, &e.stage_state().unwrap(), &format!("{a} -> {b}"));
    }
}

#[test]
fn changing_the_world_size_changes_nothing_but_the_layout() {
    // 8 ranks -> 4, live: the first four ranks stay and receive, the other four send and retire.
    let spec = config();
    let specs = spec.param_specs();
    for (a, b) in [(dims(2, 2, 2), dims(1, 2, 2)), (dims(2, 4, 1), dims(1, 2, 2)), (dims(1, 2, 4), dims(2, 1, 2))] {
        switch_matches_staying(a, b, (16, 2), (16, 2));
        let mut e = engine(a, 16, 2);
        train(&mut e, 0, 2);
        let before = e.stage_state().unwrap();
        let r = e.reconfigure(b, 16, 2).unwrap();
        assert!(r.live, "{a} -> {b}: {r:?}");
        assert_eq!(r.bytes, bytes_held(&specs, b, 3 + u64::from(before.previous.is_some())), "{a} -> {b}: bytes moved");
        assert_same_state(&before, &e.stage_state().unwrap(), &format!("{a} -> {b}"));
        // A later change can grow the world again (staged: new ranks start from the state).
        let r = e.reconfigure(a, 16, 2).unwrap();
        assert!(!r.live && r.layout_changed, "{b} -> {a}: {r:?}");
        assert_same_state(&before, &e.stage_state().unwrap(), &format!("{a} -> {b} -> {a}"));
        train(&mut e, 2, 3);
    }
    // 4 ranks -> 8, compared with staying.
    switch_matches_staying(dims(1, 2, 2), dims(2, 2, 2), (16, 2), (16, 2));
}

#[test]
fn a_failed_shrink_rolls_back_with_every_rank_kept() {
    let mut reference = engine(dims(2, 2, 2), 16, 2);
    let want = train(&mut reference, 0, 3);
    for phase in [ReconfigPhase::GroupRebuild, ReconfigPhase::Load, ReconfigPhase::Verify] {
        let mut e = engine(dims(2, 2, 2), 16, 2);
        train(&mut e, 0, 2);
        let before = e.stage_state().unwrap();
        e.inject_fault(Some(phase));
        let err = e.reconfigure(dims(1, 2, 2), 16, 2).unwrap_err();
        assert!(matches!(&err, EngineError::RolledBack { phase: p, .. } if *p == phase), "{phase:?}: {err}");
        assert_eq!(e.config().dims, dims(2, 2, 2));
        assert_same_state(&before, &e.stage_state().unwrap(), &format!("shrink rolled back at {phase:?}"));
        let next = train(&mut e, 2, 3)[0];
        assert_eq!(next.to_bits(), want[2].to_bits(), "{phase:?}: all eight ranks train on");
    }
}

#[test]
fn switching_layout_and_batch_together_matches_a_batch_only_switch() {
    // dp1,tp4,pp2 -> dp4,tp2,pp1 with B_g 16 -> 32 and B_m 2 -> 4
    switch_matches_staying(dims(1, 4, 2), dims(4, 2, 1), (16, 2), (32, 4));
    // tp2,pp2 -> tp2,pp4 (dp2 -> dp1) with B_m 2 -> 1
    switch_matches_staying(dims(2, 2, 2), dims(1, 2, 4), (16, 2), (16, 1));
    // dp4,tp1,pp2 -> dp8,tp1,pp1 with B_g 16 -> 8 and B_m 2 -> 1
    switch_matches_staying(dims(4, 1, 2), dims(8, 1, 1), (16, 2), (8, 1));
}

#[test]
fn a_batch_only_change_keeps_every_moment_and_takes_effect() {
    let mut e = engine(dims(2, 2, 2), 16, 2);
    train(&mut e, 0, 2);
    let before = e.stage_state().unwrap();
    let r = e.reconfigure(dims(2, 2, 2), 32, 4).unwrap();
    assert!(!r.layout_changed && r.bytes == 0);
    assert_same_state(&before, &e.stage_state().unwrap(), "batch-only");
    let out = e.step(batch(2, 32)).unwrap();
    assert_eq!((out.metrics.global_batch, out.metrics.micro_batch, out.stats.num_micro), (32, 4, 8));
    // The sqrt LR rule sees the new batch: lr(32) / lr(16) = sqrt(2) at the same schedule point
    // (step 2, after 32 samples: the end of the warmup either way).
    let factor = optim().lr_at(2, 32, 32, None) / optim().lr_at(2, 32, 16, None);
    assert!((factor - 2f64.sqrt()).abs() < 1e-12);
    assert!((out.metrics.lr - optim().lr_at(2, 32, 32, None)).abs() < 1e-15);
}

#[test]
fn invalid_targets_are_refused_and_the_engine_trains_on() {
    let mut e = engine(dims(2, 2, 2), 16, 2);
    train(&mut e, 0, 1);
    let err = e.reconfigure(ParallelDims { dp: 1, tp: 1, pp: 8 }, 16, 2).unwrap_err().to_string();
    assert!(err.contains("pp") && err.contains('8') && err.contains('4'), "{err}");
    let err = e.reconfigure(dims(4, 2, 1), 12, 2).unwrap_err().to_string();
    assert!(err.contains("12"), "{err}");
    assert_eq!(e.config().dims, dims(2, 2, 2));
    train(&mut e, 1, 2);
}

#[test]
fn a_failure_at_any_phase_rolls_back_with_nothing_lost() {
    let mut reference = engine(dims(2, 2, 2), 16, 2);
    let want = train(&mut reference, 0, 3);
    for phase in [ReconfigPhase::AfterStaging, ReconfigPhase::GroupRebuild, ReconfigPhase::Load, ReconfigPhase::Verify] {
        let mut e = engine(dims(2, 2, 2), 16, 2);
        train(&mut e, 0, 2);
        let before = e.stage_state().unwrap();
        e.inject_fault(Some(phase));
        let err = e.reconfigure(dims(1, 4, 2), 16, 2).unwrap_err();
        match &err {
            EngineError::RolledBack { phase: p, restored, .. } => {
                assert_eq!(*p, phase);
                assert!(restored.starts_with("dp2,tp2,pp2"), "{err}");
            }
            other => panic!("{phase:?}: expected a rollback, got {other}"),
        }
        assert_eq!(e.config().dims, dims(2, 2, 2));
        assert_same_state(&before, &e.stage_state().unwrap(), &format!("rollback at {phase:?}"));
        // Trainable, and exactly where it was: the next loss is bit-identical.
        let next = train(&mut e, 2, 3)[0];
        assert_eq!(next.to_bits(), want[2].to_bits(), "{phase:?}: {next} vs {}", want[2]);
        // And the next reconfiguration (without a fault) works.
        e.reconfigure(dims(1, 4, 2), 16, 2).unwrap();
        train(&mut e, 3, 4);
    }
}

#[test]
fn a_checkpoint_resumes_bit_exactly_and_loads_into_any_layout() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("state.bpk");
    let mut e = engine(dims(2, 2, 2), 16, 2);
    train(&mut e, 0, 3);
    let extra: BTreeMap<String, String> = [("data_position".to_string(), "48".to_string())].into();
    e.save_checkpoint(&path, &extra).unwrap();
    let uninterrupted = train(&mut e, 3, 5);
    let final_params = e.gather().unwrap();
    drop(e);

    let (mut resumed, got_extra) = Engine::resume(Arc::new(config()), &path, None).unwrap();
    assert_eq!(got_extra, extra);
    assert_eq!(resumed.config().dims, dims(2, 2, 2));
    assert_eq!(resumed.steps_done(), 3);
    let again = train(&mut resumed, 3, 5);
    for (a, b) in again.iter().zip(&uninterrupted) {
        assert_eq!(a.to_bits(), b.to_bits(), "resumed {a} vs uninterrupted {b}");
    }
    let params = resumed.gather().unwrap();
    for (k, v) in &final_params {
        assert!(v.iter().zip(&params[k]).all(|(x, y)| x.to_bits() == y.to_bits()), "{k}");
    }
    drop(resumed);

    // Into another layout and another world size.
    for d in [dims(1, 2, 4), dims(2, 1, 2)] {
        let cfg = EngineConfig::new(d, 16, 2, SEQ, optim());
        let (mut other, _) = Engine::resume(Arc::new(config()), &path, Some(cfg)).unwrap();
        let losses = train(&mut other, 3, 5);
        for (a, b) in losses.iter().zip(&uninterrupted) {
            assert!((a - b).abs() <= 1e-5 * b.abs(), "{d}: {a} vs {b}");
        }
    }

    // Bad files are errors naming the file.
    let bad = dir.path().join("bad.bpk");
    std::fs::write(&bad, b"not a checkpoint").unwrap();
    let err = Engine::<LlamaConfig>::resume(Arc::new(config()), &bad, None).err().unwrap().to_string();
    assert!(err.contains("bad.bpk"), "{err}");
    let err = Engine::<LlamaConfig>::resume(Arc::new(config()), &dir.path().join("missing.bpk"), None).err().unwrap().to_string();
    assert!(err.contains("missing.bpk"), "{err}");
}

/// ZeRO-1 against the unsharded optimizer, step for step: on dp2, on dp2 x tp2, and across
/// layout changes of every kind: from dp2 x pp2 (a tied embedding mirrored on the last stage)
/// to dp4 x tp2 (more ranks: started from the staged state, the moments stitched from the
/// replicas' pieces), live to dp2 x tp2 x pp2 (the moments gathered over dp and moved through
/// the reshard plan), then live to dp4 on fewer ranks (the chunks padded). Clipping is on and
/// binding. The losses, the probe's |g|^2, and the staged weights and moments after each phase
/// are compared: within 1e-6 (the arithmetic is the same: the reduce-scatter adds in rank
/// order as the all-reduce does, and AdamW runs element for element).
#[test]
fn zero1_trains_as_the_unsharded_optimizer() {
    let run = |zero1: bool, phases: &[(ParallelDims, usize)]| {
        let optim = OptimConfig { clip_norm: Some(0.5), ..optim() };
        let ec = EngineConfig::new(phases[0].0, 16, 2, SEQ, optim).with_zero1(zero1);
        let mut e = Engine::new(Arc::new(config()), initial(), ec).unwrap();
        let (mut losses, mut norms, mut states, mut step) = (Vec::new(), Vec::new(), Vec::new(), 0);
        for (i, &(d, n)) in phases.iter().enumerate() {
            if i > 0 {
                e.reconfigure(d, 16, 2).unwrap();
            }
            for _ in 0..n {
                let out = e.step(batch(step, 16)).unwrap();
                losses.push(out.metrics.loss);
                norms.push(out.stats.grad_sq_norm);
                step += 1;
            }
            states.push(e.stage_state().unwrap());
        }
        (losses, norms, states)
    };
    let close = |a: &[f32], b: &[f32]| a.len() == b.len() && a.iter().zip(b).all(|(x, y)| (x - y).abs() <= 1e-6 * y.abs().max(1.0));
    for phases in [
        vec![(dims(2, 1, 1), 5)],
        vec![(dims(2, 2, 1), 5)],
        vec![(dims(2, 1, 2), 2), (dims(4, 2, 1), 2), (dims(2, 2, 2), 1), (dims(4, 1, 1), 1)],
    ] {
        let name = phases.iter().map(|(d, n)| format!("{d} x{n}")).collect::<Vec<_>>().join(" -> ");
        let (want_l, want_n, want_s) = run(false, &phases);
        let (got_l, got_n, got_s) = run(true, &phases);
        for (s, ((a, b), (x, y))) in got_l.iter().zip(&want_l).zip(got_n.iter().zip(&want_n)).enumerate() {
            assert!((a - b).abs() <= 1e-6 * b.abs(), "{name} step {s}: loss {a} vs {b} unsharded");
            assert!((x - y).abs() <= 1e-6 * y.abs(), "{name} step {s}: |g|^2 {x} vs {y} unsharded");
        }
        assert!(want_n.iter().any(|n| n.sqrt() > 0.5), "{name}: clipping never bound ({want_n:?})");
        for (p, (got, want)) in got_s.iter().zip(&want_s).enumerate() {
            assert_eq!(got.params.len(), want.params.len());
            for (k, v) in &want.params {
                assert!(close(&got.params[k], v), "{name} phase {p}: parameter {k}");
            }
            assert_eq!(got.optim.len(), want.optim.len(), "{name} phase {p}: optimizer state of every parameter");
            for (k, fields) in &want.optim {
                for (f, v) in fields {
                    assert!(close(&got.optim[k][f], v), "{name} phase {p}: {k} {f}");
                }
            }
            assert_eq!(got.scalars, want.scalars, "{name} phase {p}: step counts");
            assert_eq!((got.step, got.tokens_seen), (want.step, want.tokens_seen));
        }
    }
}
