//! Ranks on Burn's LibTorch backend (`RankDevice::TchCpu`: libtorch on the CPU, the code path a
//! `backend: Tch` run takes on a GPU) train like ranks on Flex: the parity, host-traffic and
//! layout-change checks of `copus_tests::device`, with its bounds; bf16 mixed precision on
//! LibTorch against bf16 on Flex. Needs a PyTorch installation to build and run against; see
//! docs/gpu.md, "Backends":
//!
//! ```text
//! LIBTORCH_USE_PYTORCH=1 LIBTORCH_BYPASS_VERSION_CHECK=1 \
//!   cargo test --profile gpu-test -p copus-tests --features tch --test tch
//! ```

#![cfg(feature = "tch")]

use std::sync::Arc;

use copus_burn::{Engine, EngineConfig, OptimConfig, RankDevice};
use copus_core::memory::{Checkpointing, Precision};
use copus_tests::device;
use copus_tests::{SEQ, config, dims, initial_full, rel, structured_batch};

#[test]
fn libtorch_ranks_train_like_flex_ranks() {
    device::ranks_train_like_flex_ranks(RankDevice::TchCpu);
}

#[test]
fn tensor_collectives_on_libtorch_match_the_host_ones_bit_for_bit() {
    device::tensor_collectives_match_the_host_ones(RankDevice::TchCpu);
}

#[test]
fn a_layout_change_on_libtorch_trains_like_one_on_flex() {
    device::a_layout_change_trains_like_one_on_flex(RankDevice::TchCpu);
}

/// Five steps of bf16 mixed precision on dp2 x tp2: losses per step on `devices`.
fn bf16_losses(devices: Vec<RankDevice>) -> Vec<f64> {
    let optim = OptimConfig { lr: 1e-3, warmup_steps: 1, total_steps: 10, b0: 4, ..OptimConfig::default() };
    let ec = EngineConfig::new(dims(2, 2, 1), 4, 2, SEQ, optim).with_devices(devices).with_precision(Precision::Bf16Mixed);
    let mut engine = Engine::new(Arc::new(config()), initial_full(), ec).unwrap();
    (0..5).map(|s| engine.step(structured_batch(s, config().shape.vocab_size, 4)).unwrap().metrics.loss).collect()
}

/// bf16 mixed precision on LibTorch (its layers on LibTorch's own kernels, attention on
/// `scaled_dot_product_attention`): the same products in bf16 as on Flex, each accumulated in
/// f32 and rounded once to bf16 (a relative step of 2^-8), so the two differ where a sum in
/// another order rounds to the neighbouring bf16 value, and the loss, a mean over every token,
/// averages that out: measured here at most 5.7e-5 over five steps of dp2 x tp2; the bound,
/// 1e-3, is about 17 times that and a tenth of what a product left in f32 or a reduction in
/// bf16 would move (bf16 against f32 on Flex: 0.5%, `bf16_mixed_precision_trains_like_f32`).
#[test]
fn bf16_mixed_precision_on_libtorch_trains_like_on_flex() {
    let flex = bf16_losses(Vec::new());
    let before = copus_burn::fused::libtorch_operations();
    let tch = bf16_losses(vec![RankDevice::TchCpu; 4]);
    // The ranks' layers ran on LibTorch's own kernels (attention, norms, linear, loss), not on
    // Burn's decomposed forms.
    assert!(copus_burn::fused::libtorch_operations() > before, "no operation on LibTorch's kernels was built");
    for (s, (f, t)) in flex.iter().zip(&tch).enumerate() {
        eprintln!("bf16 step {s}: loss {t} on LibTorch, {f} on Flex, rel {:.2e}", rel(*t, *f));
        assert!(t.is_finite() && rel(*t, *f) <= 1e-3, "bf16 step {s}: loss {t} on LibTorch, {f} on Flex");
    }
}

/// Five steps' losses and gradient norms on `devices` (empty: Flex) with `checkpointing`.
fn checkpointed_losses(devices: Vec<RankDevice>, dims: copus_core::layout::ParallelDims, checkpointing: Checkpointing) -> Vec<(f64, f64)> {
    let optim = OptimConfig { lr: 1e-3, warmup_steps: 1, total_steps: 10, b0: 4, ..OptimConfig::default() };
    let ec = EngineConfig::new(dims, 4, 2, SEQ, optim).with_devices(devices).with_checkpointing(checkpointing);
    let mut engine = Engine::new(Arc::new(config()), initial_full(), ec).unwrap();
    (0..5)
        .map(|s| {
            let m = engine.step(structured_batch(s, config().shape.vocab_size, 4)).unwrap().metrics;
            (m.loss, m.grad_norm)
        })
        .collect()
}

/// Activation checkpointing on a device: the forward without a graph, each segment run again
/// as a graph of its own with Megatron's operators at its blocks' edges. pp2, tp2 and tp2 x pp2
/// with Regions and Layers checkpointing on LibTorch against Flex without checkpointing, over
/// five steps: losses within 1e-6 relative (the module `copus_tests::device` gives the bound),
/// gradient norms within 1e-5 (a gradient summed twice over tp would double them, where Adam's
/// update, scale-free, might hide it in the losses).
#[test]
fn checkpointed_segments_on_libtorch_train_like_flex() {
    for (tp, pp) in [(1, 2), (2, 1), (2, 2)] {
        let flex = checkpointed_losses(Vec::new(), dims(1, tp, pp), Checkpointing::None);
        for checkpointing in [Checkpointing::Regions, Checkpointing::Layers] {
            let tch = checkpointed_losses(vec![RankDevice::TchCpu; tp * pp], dims(1, tp, pp), checkpointing);
            for (s, ((f, fg), (t, tg))) in flex.iter().zip(&tch).enumerate() {
                let what = format!("tp{tp} pp{pp} {checkpointing:?} step {s}");
                eprintln!("{what}: loss rel {:.2e}, grad norm rel {:.2e}", rel(*t, *f), rel(*tg, *fg));
                assert!(rel(*t, *f) <= 1e-6, "{what}: loss {t} on LibTorch, {f} on Flex");
                assert!(rel(*tg, *fg) <= 1e-5, "{what}: gradient norm {tg} on LibTorch, {fg} on Flex");
            }
        }
    }
}

/// The memory a collective library (NCCL on a GPU) reads and writes for LibTorch tensors, driven
/// on LibTorch's CPU (where the addresses are host memory) by collectives written by hand: the
/// input's address starts at the view's first value, the output is fresh (the input and the
/// tensor it is a view of stay as they were), a strided view is read in its own order, an
/// all-reduce writes a tensor in place only where its storage is its own, and tensors that
/// cannot be handed over are given back.
#[test]
fn a_collective_reads_and_writes_libtorch_memory_where_the_tensor_lies() {
    use burn::tensor::{Tensor, TensorData};
    use copus_burn::comm::gpu::tch_memory::out_of_place;

    let device = RankDevice::TchCpu.device().unwrap();
    let base: Vec<f32> = (0..12).map(|i| i as f32 * 0.5 - 1.0).collect();
    let whole = Tensor::<1>::from_data(TensorData::new(base.clone(), [12]), &device);
    let values = |t: Tensor<1>| t.into_data().try_to_vec::<f32>().unwrap();

    // "All-gather" of two ranks by hand: the input, then the input doubled. A view of values 3..8.
    #[allow(unsafe_code)]
    let gather = |len: usize| {
        move |src: u64, dst: u64| {
            // SAFETY: `out_of_place` hands over `len` f32 at `src` and `2 len` at `dst`, alive
            // until this returns.
            let (input, out) =
                unsafe { (std::slice::from_raw_parts(src as *const f32, len), std::slice::from_raw_parts_mut(dst as *mut f32, 2 * len)) };
            for (i, v) in input.iter().enumerate() {
                out[i] = *v;
                out[len + i] = 2.0 * v;
            }
            Ok(())
        }
    };
    let view = whole.clone().slice(3..8);
    let out = out_of_place(view.clone(), None, 10, gather(5)).unwrap().expect("a LibTorch tensor");
    let want: Vec<f32> = base[3..8].iter().copied().chain(base[3..8].iter().map(|v| 2.0 * v)).collect();
    assert_eq!(values(out), want);
    assert_eq!(values(view), base[3..8].to_vec(), "the input is left as it was");
    assert_eq!(values(whole.clone()), base, "and so is the tensor it is a view of");

    // A strided view (every other value): copied to contiguous memory first, read in order.
    let strided = whole.clone().slice(burn::tensor::s![0..12;2]);
    let out = out_of_place(strided, None, 12, gather(6)).unwrap().unwrap();
    let evens: Vec<f32> = base.iter().step_by(2).copied().collect();
    assert_eq!(values(out), evens.iter().copied().chain(evens.iter().map(|v| 2.0 * v)).collect::<Vec<_>>());

    // In place where the storage is the tensor's own (a fresh tensor: one address, written);
    // into a fresh output where another tensor shares it (`whole`'s clone: `whole` unchanged).
    #[allow(unsafe_code)]
    let double = |src: u64, dst: u64| {
        // SAFETY: 12 f32 at each address, alive until this returns (the same buffer when equal).
        let (input, out) =
            unsafe { (std::slice::from_raw_parts(src as *const f32, 12).to_vec(), std::slice::from_raw_parts_mut(dst as *mut f32, 12)) };
        out.iter_mut().zip(input).for_each(|(o, v)| *o = 2.0 * v);
        Ok(())
    };
    let doubled: Vec<f32> = base.iter().map(|v| 2.0 * v).collect();
    let fresh = Tensor::<1>::from_data(TensorData::new(base.clone(), [12]), &device);
    let mut addresses = None;
    let out = copus_burn::comm::gpu::tch_memory::in_place_where_unshared(fresh, None, |s, d| {
        addresses = Some((s, d));
        double(s, d)
    });
    let (s, d) = addresses.unwrap();
    assert_eq!(s, d, "a tensor whose storage is its own is written in place");
    assert_eq!(values(out.unwrap().unwrap()), doubled);
    let mut addresses = None;
    let out = copus_burn::comm::gpu::tch_memory::in_place_where_unshared(whole.clone(), None, |s, d| {
        addresses = Some((s, d));
        double(s, d)
    });
    let (s, d) = addresses.unwrap();
    assert_ne!(s, d, "a shared storage is not written");
    assert_eq!(values(out.unwrap().unwrap()), doubled);
    assert_eq!(values(whole.clone()), base);

    // A failure of the collective is the caller's error.
    let e = out_of_place(whole.clone(), None, 12, |_, _| Err("the ring broke".into())).unwrap_err();
    assert!(e.to_string().contains("the ring broke"), "{e}");

    // Tensors it cannot hand over come back untouched, for the caller's host path: one on
    // another device than the communicator's, Flex's, and one under autodiff.
    let flex = Tensor::<1>::from_data(TensorData::new(base.clone(), [12]), &RankDevice::Flex.device().unwrap());
    for other in [whole.clone(), flex, whole.autodiff()] {
        let back = out_of_place(other, Some(0), 12, |_, _| panic!("must not run")).unwrap().expect_err("given back");
        assert_eq!(values(back), base);
    }
}

/// A layout change between LibTorch ranks (its pieces cut, joined and checked on the device)
/// that fails at any phase, its checks included, rolls back with nothing lost: the state read
/// back bit for bit as before, the next loss bit for bit the one of a run that never tried, and
/// the change then goes through.
#[test]
fn a_failed_change_on_libtorch_rolls_back_with_nothing_lost() {
    use copus_burn::{EngineError, ReconfigPhase};
    let optim = OptimConfig { lr: 1e-3, warmup_steps: 1, total_steps: 10, b0: 4, ..OptimConfig::default() };
    let engine = || {
        let ec = EngineConfig::new(dims(2, 1, 1), 4, 2, SEQ, optim.clone()).with_devices(vec![RankDevice::TchCpu; 2]);
        Engine::new(Arc::new(config()), initial_full(), ec).unwrap()
    };
    let loss = |e: &mut Engine<copus_models::LlamaConfig>, s: usize| {
        e.step(structured_batch(s, config().shape.vocab_size, 4)).unwrap().metrics.loss
    };
    let mut reference = engine();
    let want: Vec<f64> = (0..3).map(|s| loss(&mut reference, s)).collect();
    for phase in [ReconfigPhase::GroupRebuild, ReconfigPhase::Load, ReconfigPhase::Verify] {
        let mut e = engine();
        for s in 0..2 {
            loss(&mut e, s);
        }
        let before = e.stage_state().unwrap();
        e.inject_fault(Some(phase));
        match e.reconfigure(dims(1, 2, 1), 4, 2) {
            Err(EngineError::RolledBack { phase: p, .. }) => assert_eq!(p, phase),
            other => panic!("{phase:?}: expected a rollback, got {other:?}"),
        }
        let after = e.stage_state().unwrap();
        for (name, v) in &before.params {
            assert!(v.iter().zip(&after.params[name]).all(|(a, b)| a.to_bits() == b.to_bits()), "{phase:?}: {name} changed");
        }
        for (name, fields) in &before.optim {
            for (field, v) in fields {
                assert!(
                    v.iter().zip(&after.optim[name][field]).all(|(a, b)| a.to_bits() == b.to_bits()),
                    "{phase:?}: {name} {field} changed"
                );
            }
        }
        assert_eq!(loss(&mut e, 2).to_bits(), want[2].to_bits(), "{phase:?}: the next loss");
        e.reconfigure(dims(1, 2, 1), 4, 2).unwrap();
        assert!(loss(&mut e, 3).is_finite());
    }
}

/// The fused operations on LibTorch's own kernels (`copus_burn::fused`: attention on
/// `scaled_dot_product_attention`, RMSNorm, RoPE, SwiGLU, linear, the chunked cross entropy) against Burn's
/// decomposed forms of the same functions on the same LibTorch CPU (what
/// `gradient_checkpointing()` devices run), in value and in the gradient of every input.
mod fused_on_libtorch {
    use burn::tensor::{DType, Device, Int, Tensor, TensorData};
    use copus_burn::fused;
    use copus_burn::{OptimConfig, RankDevice};

    /// LibTorch under autodiff (the fused operations) and Burn's decomposed forms on it.
    fn devices() -> (Device, Device) {
        let d = RankDevice::TchCpu.device().unwrap();
        (d.clone().autodiff(), d.autodiff().gradient_checkpointing())
    }

    fn values<const D: usize>(t: Tensor<D>) -> Vec<f32> {
        t.into_data().convert::<f32>().try_into_vec::<f32>().unwrap()
    }

    /// The largest difference of `a` from `b`, relative to `b`'s largest magnitude.
    fn worst(a: &[f32], b: &[f32]) -> f64 {
        assert_eq!(a.len(), b.len());
        let scale = b.iter().fold(0f64, |m, &x| m.max(f64::from(x).abs())).max(1e-30);
        a.iter().zip(b).fold(0f64, |m, (&x, &y)| m.max(f64::from(x - y).abs())) / scale
    }

    /// `f` on fresh leaves holding `inputs` on `device` (cast to `dtype`): its values and the
    /// gradient of `sum(f * w)` for each input, with a fixed weighting `w` so no gradient is
    /// trivial.
    fn run<const D: usize, const E: usize>(
        inputs: &[Vec<f32>],
        shapes: &[[usize; D]],
        dtype: DType,
        device: &Device,
        f: impl Fn(&[Tensor<D>]) -> Tensor<E>,
    ) -> (Vec<f32>, Vec<Vec<f32>>) {
        let leaves: Vec<Tensor<D>> = inputs
            .iter()
            .zip(shapes)
            .map(|(v, s)| Tensor::<D>::from_data(TensorData::new(v.clone(), *s), device).cast(dtype).require_grad())
            .collect();
        let y = f(&leaves);
        let n = y.shape().num_elements();
        let w =
            Tensor::<1>::from_data(TensorData::new((0..n).map(|i| ((i * 7919) % 13) as f32 / 13.0 - 0.4).collect::<Vec<_>>(), [n]), device)
                .reshape(y.dims())
                .cast(y.dtype());
        let grads = (y.clone() * w).sum().backward();
        let gs = leaves.iter().map(|l| values(l.grad(&grads).expect("every input has a gradient"))).collect();
        (values(y), gs)
    }

    /// `n` values in [-1.5, 1.5) from a seeded xorshift generator.
    fn random(n: usize, seed: u64) -> Vec<f32> {
        let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        (0..n)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                ((x >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 3.0
            })
            .collect()
    }

    /// Compares the fused and the decomposed form of `f` (values and every input's gradient)
    /// within `tol`, and checks that the fused form built operations on LibTorch's kernels.
    fn check<const D: usize, const E: usize>(
        what: &str,
        shapes: &[[usize; D]],
        dtype: DType,
        tol: f64,
        f: impl Fn(&[Tensor<D>]) -> Tensor<E>,
    ) {
        let inputs: Vec<Vec<f32>> = shapes.iter().enumerate().map(|(i, s)| random(s.iter().product(), 17 + i as u64)).collect();
        let (fused_dev, decomposed_dev) = devices();
        let before = fused::libtorch_operations();
        let (y, gs) = run(&inputs, shapes, dtype, &fused_dev, &f);
        assert!(fused::libtorch_operations() > before, "{what}: no operation on LibTorch's kernels was built");
        let (want, want_gs) = run(&inputs, shapes, dtype, &decomposed_dev, &f);
        let d = worst(&y, &want);
        eprintln!("{what}: values {d:.2e}");
        assert!(d <= tol, "{what}: values differ by {d:.2e} (bound {tol:.0e})");
        for (i, (g, w)) in gs.iter().zip(&want_gs).enumerate() {
            let d = worst(g, w);
            eprintln!("{what}: gradient of input {i} {d:.2e}");
            assert!(d <= tol, "{what}: the gradient of input {i} differs by {d:.2e} (bound {tol:.0e})");
        }
    }

    /// f32: LibTorch's kernels and Burn's decomposition add in different orders, a few ulps per
    /// value; bf16: one rounding of 2^-8 on either side, a few times over.
    const F32: f64 = 1e-5;
    const BF16: f64 = 2e-2;

    #[test]
    fn attention_on_scaled_dot_product_attention_matches_the_decomposed_form() {
        // Grouped-query heads (4 query heads on 2 kv heads), one kv head per query head, and an
        // odd sequence length.
        for (h, k) in [(4, 2), (2, 2)] {
            for (dtype, tol) in [(DType::F32, F32), (DType::BF16, BF16)] {
                let shapes = [[2, h, 7, 8], [2, k, 7, 8], [2, k, 7, 8]];
                check(&format!("attention h{h} k{k} {dtype:?}"), &shapes, dtype, tol, |x| {
                    fused::grouped_causal_attention(x[0].clone(), x[1].clone(), x[2].clone(), 0.35, 0)
                });
            }
        }
    }

    #[test]
    fn rms_norm_rope_swiglu_and_linear_match_the_decomposed_forms() {
        for (dtype, tol) in [(DType::F32, F32), (DType::BF16, BF16)] {
            // RMSNorm's weight stays f32 (its gradient too) while x takes `dtype`.
            check(&format!("rms_norm {dtype:?}"), &[[2, 5, 16], [1, 1, 16]], dtype, tol, |x| {
                fused::rms_norm(x[0].clone(), x[1].clone().cast(DType::F32).reshape([16]), 1e-5)
            });
            check(&format!("linear {dtype:?}"), &[[2, 5, 16], [1, 16, 12]], dtype, tol, |x| {
                fused::linear(x[0].clone(), x[1].clone().reshape([16, 12]), None)
            });
            check(&format!("linear with a bias {dtype:?}"), &[[2, 5, 16], [1, 16, 12], [1, 1, 12]], dtype, tol, |x| {
                fused::linear(x[0].clone(), x[1].clone().reshape([16, 12]), Some(x[2].clone().reshape([12])))
            });
            check(&format!("swiglu {dtype:?}"), &[[3, 4, 10], [3, 4, 10]], dtype, tol, |x| fused::swiglu(x[0].clone(), x[1].clone()));
            check(&format!("rope {dtype:?}"), &[[2, 3, 5, 8]], dtype, tol, |x| {
                let (cos, sin) = rope_tables(5, 8, &x[0].device());
                fused::rope(x[0].clone(), &cos, &sin)
            });
        }
    }

    /// Rotary tables `[s, e]` of the rotate-half form, f32.
    fn rope_tables(s: usize, e: usize, device: &Device) -> (Tensor<2>, Tensor<2>) {
        let angle = |p: usize, i: usize| p as f32 / 10_000f32.powf((2 * (i % (e / 2))) as f32 / e as f32);
        let table = |f: fn(f32) -> f32| {
            let v: Vec<f32> = (0..s).flat_map(|p| (0..e).map(move |i| f(angle(p, i)))).collect();
            Tensor::<2>::from_data(TensorData::new(v, [s, e]), device)
        };
        (table(f32::cos), table(f32::sin))
    }

    /// The cross entropy against the decomposed form, with one chunk of rows and with two (more
    /// than 2^24 logits: the f32 copy exists a chunk at a time), in f32 and from bf16 logits.
    #[test]
    fn the_chunked_cross_entropy_matches_the_decomposed_form() {
        for (b, s, v) in [(2, 5, 11), (2, 2100, 4099)] {
            for (dtype, tol) in [(DType::F32, F32), (DType::BF16, BF16)] {
                let targets: Vec<i64> = (0..b * s).map(|i| ((i * 2_654_435_761) % v) as i64).collect();
                check(&format!("cross entropy {b}x{s}x{v} {dtype:?}"), &[[b, s, v]], dtype, tol, |x| {
                    let targets = Tensor::<2, Int>::from_data(TensorData::new(targets.clone(), [b, s]), &x[0].device());
                    fused::cross_entropy_sum(x[0].clone(), targets).cast(DType::F32)
                });
            }
        }
    }

    /// Without autodiff (evaluation, a checkpointed segment's forward pass) the operations run
    /// without recording and give the same values.
    #[test]
    fn without_autodiff_the_operations_give_the_same_values() {
        let plain = RankDevice::TchCpu.device().unwrap();
        let (tracked, _) = devices();
        let q = random(2 * 4 * 6 * 8, 3);
        let kv = random(2 * 2 * 6 * 8, 4);
        let at = |d: &Device| {
            let t = |v: &Vec<f32>, h: usize| Tensor::<4>::from_data(TensorData::new(v.clone(), [2, h, 6, 8]), d);
            values(fused::grouped_causal_attention(t(&q, 4), t(&kv, 2), t(&kv, 2), 0.35, 0))
        };
        assert_eq!(at(&plain), at(&tracked));
    }

    /// A model of a dozen parameters (embedding, linear weights and biases) for the optimizer.
    #[derive(burn::module::Module, Debug)]
    struct Net {
        emb: burn::nn::Embedding,
        layers: Vec<burn::nn::Linear>,
    }

    /// AdamW on LibTorch over all parameters at once (`_foreach_` operations, grouped by step
    /// count and decay) gives the values and moments of the update one parameter at a time to
    /// the bit: over five steps, with weight decay on the linear layers and none on the
    /// embedding, a zero learning rate, and a parameter that joins after the first step (so two
    /// step counts are grouped apart).
    #[test]
    fn adamw_over_all_parameters_at_once_is_the_per_parameter_update_to_the_bit() {
        use burn::module::{Module, ModuleVisitor, Param, ParamId};
        use burn::nn::{EmbeddingConfig, LinearConfig};
        use burn::optim::GradientsParams;

        let (device, _) = devices();
        device.seed(7);
        let net = Net {
            emb: EmbeddingConfig::new(11, 6).init(&device),
            layers: (0..5).map(|i| LinearConfig::new(6, 6).with_bias(i % 2 == 0).init(&device)).collect(),
        };
        let cfg = OptimConfig { weight_decay: 0.1, ..OptimConfig::default() };
        let (mut grouped, mut single) = (cfg.adamw(&["emb".to_string()]), cfg.adamw(&["emb".to_string()]));
        single.set_foreach(false);
        /// Every parameter's id and the bits of its values.
        fn bits(net: &Net) -> Vec<(ParamId, Vec<u32>)> {
            struct V(Vec<(ParamId, Vec<u32>)>);
            impl ModuleVisitor for V {
                fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<D>>) {
                    self.0.push((p.id, values(p.val()).iter().map(|x| x.to_bits()).collect()));
                }
            }
            let mut v = V(Vec::new());
            net.visit(&mut v);
            v.0
        }
        // Gradients for every parameter, the embedding's only from the second step on.
        let grads = |net: &Net, step: usize| {
            struct G(GradientsParams, u64, bool, Device);
            impl ModuleVisitor for G {
                fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<D>>) {
                    let dims = p.val().dims();
                    if dims[..] == [11, 6] && !self.2 {
                        return;
                    }
                    self.1 += 1;
                    let v = random(dims.iter().product(), self.1);
                    self.0.register::<D>(p.id, Tensor::<D>::from_data(TensorData::new(v, dims), &self.3));
                }
            }
            let mut g = G(GradientsParams::new(), 100 * step as u64, step > 0, device.clone().inner());
            net.visit(&mut g);
            g.0
        };
        let (mut a, mut b) = (net.clone(), net);
        for (step, lr) in [3e-3, 1e-3, 0.0, 2.5e-2, 7e-4].into_iter().enumerate() {
            let (ga, gb) = (grads(&a, step), grads(&b, step));
            a = grouped.step(lr, a, ga);
            b = single.step(lr, b, gb);
            assert_eq!(bits(&a), bits(&b), "parameters after step {step}");
            assert!(a.layers[0].weight.val().is_require_grad(), "still a trainable parameter");
        }
        // Step 0: one group (the linear layers); then two a step (the layers and the embedding,
        // a step count apart): nine calls, and none on the per-parameter side.
        assert_eq!((grouped.grouped_updates(), single.grouped_updates()), (9, 0), "the grouped path ran");
        for id in single.ids() {
            let (x, y) = (grouped.moments(id).unwrap(), single.moments(id).unwrap());
            assert_eq!((x.time, &x.shape), (y.time, &y.shape));
            assert_eq!(values(x.m1.clone()), values(y.m1.clone()));
            assert_eq!(values(x.m2.clone()), values(y.m2.clone()));
        }
        assert_eq!(grouped.len(), single.len());
    }
}
