//! Ranks on Burn's wgpu backend (Mesa's lavapipe Vulkan driver on a CPU machine) train like
//! ranks on Flex. Run with `cargo test --profile gpu-test -p copus-tests --features wgpu --test wgpu` (the
//! `gpu-test` profile leaves dependencies unoptimised: a fifth of the build time). The checks
//! and their bounds are `copus_tests::device`'s.

#![cfg(feature = "wgpu")]

use std::sync::Arc;

use copus_burn::{Engine, EngineConfig, OptimConfig, RankDevice};
use copus_tests::device;
use copus_tests::{SEQ, config, dims, initial_full};

#[test]
fn wgpu_ranks_train_like_flex_ranks() {
    device::ranks_train_like_flex_ranks(RankDevice::Wgpu);
}

#[test]
fn tensor_collectives_on_wgpu_match_the_host_ones_bit_for_bit() {
    device::tensor_collectives_match_the_host_ones(RankDevice::Wgpu);
}

#[test]
fn a_layout_change_on_wgpu_trains_like_one_on_flex() {
    device::a_layout_change_trains_like_one_on_flex(RankDevice::Wgpu);
}

/// bf16 mixed precision needs bf16 arithmetic, which wgpu's shaders lack: the engine refuses it
/// on wgpu ranks with an error that names the device and the precision, before any step.
#[test]
fn bf16_mixed_precision_is_refused_on_wgpu() {
    let optim = OptimConfig { warmup_steps: 0, ..OptimConfig::default() };
    let ec = EngineConfig::new(dims(1, 1, 1), 2, 2, SEQ, optim)
        .with_devices(vec![RankDevice::Wgpu])
        .with_precision(copus_core::memory::Precision::Bf16Mixed);
    let e = Engine::new(Arc::new(config()), initial_full(), ec).err().expect("refused").to_string();
    assert!(e.contains("Wgpu") && e.contains("Bf16Mixed") && e.contains("bf16 arithmetic"), "{e}");
}
