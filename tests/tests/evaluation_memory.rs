//! A held-out evaluation records no autodiff graph. Burn keeps a recorded graph, the
//! activations its backward pass would need included, until the next backward pass, so an
//! evaluation that recorded one per micro-batch would hold every micro-batch's activations
//! until the next training step. Measured by the resident set of this test's own process (its
//! binary holds this one test), on Linux.

use std::sync::Arc;

use copus_burn::{Engine, EngineConfig, OptimConfig};
use copus_tests::{SEQ, config, dims, initial_full, structured_batch};

/// This process's resident set in bytes (`VmRSS` of `/proc/self/status`).
fn resident() -> f64 {
    let status = std::fs::read_to_string("/proc/self/status").expect("/proc/self/status (Linux)");
    let kib: f64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("a VmRSS line");
    kib * 1024.0
}

/// Ten evaluations of 64 sequences, one sequence per micro-batch, between two training steps,
/// on one rank (the stage as one graph) and on tp2 (Flex's regions). Had their graphs been
/// recorded, they would hold the activations of 640 micro-batches at once; the logits alone,
/// `SEQ x vocab` floats per sequence, are 160 MiB of tiny-1m. Bound: the resident set grows by
/// less than that after the first evaluation (which warms the allocator). Measured: it grew by
/// 1,098 MiB on one rank when evaluations recorded graphs, and now by 0-64 MiB (the 64 a
/// single step of the allocator's, on one evaluation of the ten).
#[cfg(target_os = "linux")]
#[test]
fn evaluations_between_steps_hold_no_activations() {
    const MIB: f64 = 1024.0 * 1024.0;
    let shape = config().shape;
    let (evaluations, sequences) = (10, 64);
    let logits = (evaluations * sequences * SEQ * shape.vocab_size * 4) as f64 / MIB;
    for (tp, what) in [(1, "one rank"), (2, "tp2")] {
        let optim = OptimConfig { lr: 1e-3, warmup_steps: 1, total_steps: 10, b0: 4, ..OptimConfig::default() };
        let ec = EngineConfig::new(dims(1, tp, 1), 4, 2, SEQ, optim);
        let mut engine = Engine::new(Arc::new(config()), initial_full(), ec).unwrap();
        engine.step(structured_batch(0, shape.vocab_size, 4)).unwrap();
        let held_out = structured_batch(100, shape.vocab_size, sequences);
        let first = engine.evaluate(held_out.clone(), 1).unwrap();
        let before = resident();
        for _ in 0..evaluations {
            assert_eq!(engine.evaluate(held_out.clone(), 1).unwrap(), first, "{what}: an evaluation changes nothing");
        }
        let grown = (resident() - before) / MIB;
        eprintln!("{what}: the resident set grew by {grown:.1} MiB over {evaluations} evaluations (logits: {logits:.0} MiB)");
        assert!(grown < logits, "{what}: {evaluations} evaluations between two steps grew the resident set by {grown:.1} MiB");
        engine.step(structured_batch(1, shape.vocab_size, 4)).unwrap();
    }
}
