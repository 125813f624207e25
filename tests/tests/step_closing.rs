//! The shared step closing under a 1 -> several -> 1 micro-batch sequence: the engine's ranks
//! hand the estimator exactly what serial training does. After a step of several micro-batches
//! the previous gradient must be forgotten, so the next one-micro-batch step has nothing to
//! difference against (it is not compared with a stale gradient from before).

#![forbid(unsafe_code)]

use std::sync::Arc;

use burn::tensor::Device;
use copus_burn::{Engine, EngineConfig, MicroBatch, OptimConfig, Trainer};
use copus_models::full_params;
use copus_tests::{SEQ, config, dims, initial_of, rel, structured_batch};

/// (B_g, B_m) of each step: one micro-batch, one, four, one, one.
const SPLITS: [(usize, usize); 5] = [(4, 4), (4, 4), (4, 1), (4, 4), (4, 4)];

fn optim() -> OptimConfig {
    OptimConfig { lr: 1e-3, warmup_steps: 1, total_steps: 10, b0: 4, ..OptimConfig::default() }
}

#[test]
fn one_then_several_then_one_micro_batch_matches_serial_training() {
    let cfg = config();
    let vocab = cfg.shape.vocab_size;
    let initial = initial_of(&cfg);
    let device = Device::flex().autodiff();
    let mut serial = Trainer::new(initial.clone(), optim()).unwrap();
    // tp2,pp2: the probe's norms are sums over four shards, the previous gradient is sharded.
    let (b_g, b_m) = SPLITS[0];
    let mut engine =
        Engine::new(Arc::new(cfg.clone()), &full_params(&initial), EngineConfig::new(dims(1, 2, 2), b_g, b_m, SEQ, optim())).unwrap();
    for (step, &(b_g, b_m)) in SPLITS.iter().enumerate() {
        let tokens = structured_batch(step, vocab, b_g);
        let windows: Vec<&[i64]> = tokens.chunks(SEQ + 1).collect();
        let micro: Vec<MicroBatch> = windows.chunks(b_m).map(|w| MicroBatch::from_windows(w, &device)).collect();
        let want = serial.step(&micro).unwrap();
        let want_stats = *serial.last_stats().unwrap();
        if engine.config().micro_batch != b_m {
            engine.reconfigure(engine.config().dims, b_g, b_m).unwrap();
        }
        let got = engine.step(tokens).unwrap();
        let what = format!("step {step} (B_m {b_m})");
        assert_eq!(got.stats.num_micro, want_stats.num_micro, "{what}");
        // The differencing fallback: present exactly where serial training has it.
        match (got.stats.diff_sq_norm, want_stats.diff_sq_norm) {
            (None, None) => {}
            (Some(g), Some(w)) => assert!(rel(g, w) < 1e-4, "{what}: |g - g_prev|^2 {g} vs serial {w}"),
            (g, w) => panic!("{what}: the engine differenced against {g:?}, serial {w:?}"),
        }
        assert!(rel(got.stats.grad_sq_norm, want_stats.grad_sq_norm) < 1e-5, "{what}: T");
        assert!(rel(got.stats.mean_micro_sq_norm, want_stats.mean_micro_sq_norm) < 1e-5, "{what}: L");
        assert!(rel(got.metrics.loss, want.loss) < 1e-5, "{what}: loss {} vs {}", got.metrics.loss, want.loss);
        match (got.metrics.trace, want.trace) {
            (Some(g), Some(w)) => assert!(rel(g, w) < 1e-3, "{what}: tr(Sigma) {g} vs serial {w}"),
            (g, w) => assert_eq!(g.is_some(), w.is_some(), "{what}: an estimate on one side only"),
        }
    }
    // Steps 0 and 3 (the first, and the one after four micro-batches) gave no estimate.
    assert_eq!(serial.gns().observations(), 3, "serial reference");
    assert_eq!(engine.gns().observations(), 3, "engine");
}
