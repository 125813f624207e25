//! Ranks on Burn's wgpu backend (Mesa's lavapipe Vulkan driver on a CPU machine) train like
//! ranks on Flex. Run with `cargo test --profile gpu-test -p copus-tests --features wgpu --test wgpu` (the
//! `gpu-test` profile leaves dependencies unoptimised: a fifth of the build time).
//!
//! Tolerance: per-step losses within 1e-6 relative; gradient norms and the probe's |g|^2 within
//! 1e-5 relative. Both backends compute in f32 from the same weights and batches; they differ
//! only in the order of floating-point sums (wgpu's tiled matmuls and tree reductions against
//! Flex's blocked loops) and in exp/log approximations of a few ulps, about 1e-7 relative per
//! operation. Adam turns those into weight differences of order lr x 1e-7 / sqrt(v), larger
//! where a gradient is near zero. After three steps the loss, a mean over every token, moves by
//! about 1e-8 (5e-8 measured), while gradient norms, sums over parameters that include
//! near-zero ones, move by up to about 1e-6 (1.6e-6 measured, with wgpu's squared norms summed
//! in f32 on the device per parameter and the sums added in f64). The bounds are 6 to 20 times
//! what this machine measures; the test prints the differences. The probe's reads on wgpu are
//! a few sums per step, a hundredth or less of Flex's whole-gradient reads; every other
//! transfer is the same on both.

#![cfg(feature = "wgpu")]

use std::sync::Arc;

use copus_burn::traffic::HostTraffic;
use copus_burn::{Engine, EngineConfig, OptimConfig, RankDevice};
use copus_tests::{SEQ, config, dims, initial_full, rel, structured_batch};

const STEPS: usize = 3;

/// Per step (loss, gradient norm, mean micro-batch |g|^2), and the last step's host traffic.
fn run(devices: Vec<RankDevice>, dp: usize, tp: usize) -> (Vec<(f64, f64, f64)>, HostTraffic) {
    let optim = OptimConfig { lr: 1e-3, warmup_steps: 1, total_steps: 10, b0: 4, ..OptimConfig::default() };
    let ec = EngineConfig::new(dims(dp, tp, 1), 4, 2, SEQ, optim).with_devices(devices);
    let mut engine = Engine::new(Arc::new(config()), initial_full(), ec).unwrap();
    let mut host = HostTraffic::default();
    let steps = (0..STEPS)
        .map(|s| {
            let out = engine.step(structured_batch(s, config().shape.vocab_size, 4)).unwrap();
            assert!(!out.skipped);
            host = out.host;
            (out.metrics.loss, out.metrics.grad_norm, out.stats.mean_micro_sq_norm)
        })
        .collect();
    (steps, host)
}

#[test]
fn wgpu_ranks_train_like_flex_ranks() {
    for (dp, tp) in [(1, 1), (1, 2)] {
        let (flex, flex_host) = run(Vec::new(), dp, tp);
        let (wgpu, wgpu_host) = run(vec![RankDevice::Wgpu; dp * tp], dp, tp);
        eprintln!("dp{dp} tp{tp} host traffic of a step, bytes: Flex {flex_host:?}; wgpu {wgpu_host:?}");
        // The probe's norms are reduced on the device: a few sums read back, against the whole
        // gradient read per micro-batch where it lies in host memory.
        assert!(wgpu_host.probe * 100 <= flex_host.probe, "probe bytes: wgpu {}, Flex {}", wgpu_host.probe, flex_host.probe);
        assert_eq!(wgpu_host.beyond_batch() - wgpu_host.probe, flex_host.beyond_batch() - flex_host.probe);
        for (s, (f, w)) in flex.iter().zip(&wgpu).enumerate() {
            eprintln!(
                "dp{dp} tp{tp} step {s}: loss rel {:.2e}, grad norm rel {:.2e}, |g|^2 rel {:.2e}",
                rel(w.0, f.0),
                rel(w.1, f.1),
                rel(w.2, f.2)
            );
            assert!(rel(w.0, f.0) <= 1e-6, "dp{dp} tp{tp} step {s}: loss {} on wgpu, {} on Flex", w.0, f.0);
            assert!(rel(w.1, f.1) <= 1e-5, "dp{dp} tp{tp} step {s}: gradient norm {} on wgpu, {} on Flex", w.1, f.1);
            assert!(rel(w.2, f.2) <= 1e-5, "dp{dp} tp{tp} step {s}: |g|^2 {} on wgpu, {} on Flex", w.2, f.2);
        }
    }
}
