//! The fused operations against Burn's own forms and against definitions, in value and gradient.

use super::activation::*;
use super::glue::CUSTOM_OPS;
use super::loss::*;
use super::norm::*;
use super::rope::*;
use super::rows::*;
use super::softmax::*;
use burn::tensor::Distribution;
use burn::tensor::{Device, Int, Tensor, TensorData};
use std::sync::atomic::Ordering;

/// Flex under autodiff: as the trainer uses it (the custom operations), and with gradient
/// checkpointing (Burn's decomposed forms).
fn autodiff_devices() -> [Device; 2] {
    [Device::flex().autodiff(), Device::flex().autodiff().gradient_checkpointing()]
}

/// The values of `f(x)` and the gradient of `sum(f(x) * w)` with respect to `x`, for a fresh
/// leaf `x` holding `data` (the weighting `w` keeps the gradient from being trivial).
fn value_and_grad<const D: usize>(data: &Tensor<D>, w: &Tensor<D>, f: impl FnOnce(Tensor<D>) -> Tensor<D>) -> (Vec<f32>, Vec<f32>) {
    let x = Tensor::<D>::from_data(data.to_data(), &data.device()).require_grad();
    let y = f(x.clone());
    let values = y.to_data().try_into_vec::<f32>().unwrap();
    let grads = (y * w.clone()).sum().backward();
    (values, x.grad(&grads).unwrap().into_data().try_into_vec::<f32>().unwrap())
}

/// Relative difference, with a floor so values near 0 compare absolutely.
fn rel(a: f64, b: f64) -> f64 {
    (a - b).abs() / b.abs().max(1e-3)
}

#[test]
fn exp_matches_std_to_a_few_ulps_and_handles_the_edges() {
    let mut worst = 0f64;
    let mut x = -87.0f32;
    while x < 88.0 {
        let (a, b) = (f64::from(exp(x)), f64::from(x).exp());
        worst = worst.max((a - b).abs() / b);
        x += 0.003_7;
    }
    assert!(worst < 3e-7, "worst relative error {worst}");
    assert_eq!(exp(0.0), 1.0);
    assert_eq!(exp(-100.0), 0.0);
    assert_eq!(exp(f32::NEG_INFINITY), 0.0);
    assert!(exp(f32::NAN).is_nan());
    assert!(exp(1000.0).is_finite());
}

/// Logits and targets with a seeded generator; `spread` widens the logits.
fn case(rows: usize, v: usize, spread: f32, seed: u64) -> (Vec<f32>, Vec<i64>) {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut next = || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    let z = (0..rows * v).map(|_| ((next() >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * spread).collect();
    let t = (0..rows).map(|_| (next() % v as u64) as i64).collect();
    (z, t)
}

/// Loss and gradient in f64, written out from the definition.
fn by_definition(z: &[f32], v: usize, t: &[i64]) -> (f64, Vec<f64>) {
    let mut loss = 0.0;
    let mut g = Vec::with_capacity(z.len());
    for (row, &ti) in z.chunks(v).zip(t) {
        let m = row.iter().fold(f64::NEG_INFINITY, |m, &x| m.max(f64::from(x)));
        let s: f64 = row.iter().map(|&x| (f64::from(x) - m).exp()).sum();
        loss += s.ln() + m - f64::from(row[ti as usize]);
        for (j, &x) in row.iter().enumerate() {
            g.push((f64::from(x) - m).exp() / s - if j as i64 == ti { 1.0 } else { 0.0 });
        }
    }
    (loss, g)
}

#[test]
fn row_kernels_match_the_definition_on_odd_sizes() {
    // Rows and vocabularies below, at and above the lane width and the parallel threshold.
    for (k, &(rows, v, spread)) in
        [(1, 1, 1.0), (3, 7, 4.0), (5, 9, 30.0), (17, 33, 8.0), (9, 4097, 12.0), (40, 1031, 2.0), (2, 70_001, 6.0)].iter().enumerate()
    {
        let (z, t) = case(rows, v, spread, k as u64 + 1);
        let (want_loss, want_g) = by_definition(&z, v, &t);
        let mut g = vec![f32::NAN; z.len()];
        let loss = cross_entropy_grad(&z, &mut g, v, &t).unwrap();
        assert!(rel(loss, want_loss) < 1e-5, "rows {rows} v {v}: loss {loss} vs {want_loss}");
        let worst = g.iter().zip(&want_g).map(|(&a, &b)| (f64::from(a) - b).abs()).fold(0f64, f64::max);
        // Gradients lie in [-1, 1]: compare absolutely at 1e-5 of that range.
        assert!(worst < 1e-6, "rows {rows} v {v}: gradient off by {worst}");
    }
}

#[test]
fn a_vocabulary_split_over_ranks_gives_the_unsplit_loss_and_gradient() {
    // The engine's tensor-parallel order: local stats, max all-reduce, rescale, sum
    // all-reduce, then each slice's gradient; simulated here over uneven slices.
    let (rows, v) = (6, 101);
    let (z, t) = case(rows, v, 10.0, 42);
    let (want_loss, want_g) = by_definition(&z, v, &t);
    for cuts in [vec![0, 50, 101], vec![0, 1, 60, 101], vec![0, 25, 50, 75, 101]] {
        let slices: Vec<(usize, Vec<f32>)> =
            cuts.windows(2).map(|w| (w[0], z.chunks(v).flat_map(|r| r[w[0]..w[1]].to_vec()).collect::<Vec<f32>>())).collect();
        let widths: Vec<usize> = cuts.windows(2).map(|w| w[1] - w[0]).collect();
        let stats: Vec<(Vec<f32>, Vec<f32>)> = slices.iter().zip(&widths).map(|((_, s), &w)| row_stats(s, w)).collect();
        let global: Vec<f32> = (0..rows).map(|i| stats.iter().map(|(m, _)| m[i]).fold(f32::NEG_INFINITY, f32::max)).collect();
        let mut sums = vec![0f32; rows];
        let mut picks = vec![0f32; rows];
        for (((start, s), &w), (m, se)) in slices.iter().zip(&widths).zip(&stats) {
            let mut se = se.clone();
            rescale_sums(&mut se, m, &global);
            let p = picked(s, w, &t, *start as i64);
            for i in 0..rows {
                sums[i] += se[i];
                picks[i] += p[i];
            }
        }
        let loss: f64 = (0..rows).map(|i| f64::from(sums[i].ln() + global[i] - picks[i])).sum();
        assert!(rel(loss, want_loss) < 1e-5, "cuts {cuts:?}: {loss} vs {want_loss}");
        for ((start, s), &w) in slices.iter().zip(&widths) {
            let mut g = s.clone();
            softmax_grad_in_place(&mut g, w, &global, &sums, &t, *start as i64, 1.0);
            for i in 0..rows {
                for j in 0..w {
                    let want = want_g[i * v + start + j];
                    assert!((f64::from(g[i * w + j]) - want).abs() < 1e-6, "cuts {cuts:?} row {i} col {}", start + j);
                }
            }
        }
    }
}

#[test]
fn a_target_outside_the_vocabulary_is_named() {
    let (z, mut g) = (vec![0f32; 8], vec![0f32; 8]);
    let err = cross_entropy_grad(&z, &mut g, 4, &[1, 4]).unwrap_err();
    assert!(err.contains("target token id 4") && err.contains("vocabulary of 4"), "{err}");
    assert!(cross_entropy_grad(&z, &mut g, 3, &[0, 1]).is_err());
    assert!(cross_entropy_grad(&z, &mut g[..6], 3, &[0, 1]).is_err());
}

#[test]
fn the_fused_loss_equals_log_softmax_in_value_and_gradient_under_autodiff() {
    for device in autodiff_devices() {
        device.seed(5);
        for &(b, s, v) in &[(1, 1, 2), (2, 3, 7), (3, 5, 33), (2, 9, 4099)] {
            let data: Tensor<3> = Tensor::random([b, s, v], Distribution::Normal(0.0, 3.0), &device);
            let tgt: Tensor<2, Int> = Tensor::random([b, s], Distribution::Uniform(0.0, v as f64), &device);
            let a = Tensor::<3>::from_data(data.to_data(), &device).require_grad();
            let c = Tensor::<3>::from_data(data.to_data(), &device).require_grad();
            // A downstream scale, as the trainer's division by the token count.
            let la = cross_entropy_sum(a.clone(), tgt.clone()).div_scalar(7.0);
            let lc = cross_entropy_sum_reference(c.clone(), tgt).div_scalar(7.0);
            let (va, vc) = (f64::from(la.clone().into_scalar::<f32>()), f64::from(lc.clone().into_scalar::<f32>()));
            assert!(rel(va, vc) < 1e-5, "[{b},{s},{v}]: {va} vs {vc}");
            let (ga, gc) = (la.backward(), lc.backward());
            let ga: Vec<f32> = a.grad(&ga).unwrap().into_data().try_into_vec::<f32>().unwrap();
            let gc: Vec<f32> = c.grad(&gc).unwrap().into_data().try_into_vec::<f32>().unwrap();
            let worst = ga.iter().zip(&gc).map(|(&x, &y)| (x - y).abs()).fold(0f32, f32::max);
            let scale = gc.iter().fold(0f32, |m, &y| m.max(y.abs()));
            assert!(worst <= 1e-5 * scale, "[{b},{s},{v}]: gradient off by {worst} (largest {scale})");
        }
    }
}

#[test]
fn the_fused_silu_equals_burns_in_value_and_gradient() {
    for device in autodiff_devices() {
        device.seed(11);
        // Odd sizes, below and above one parallel chunk; a spread that reaches deep into both
        // tails of the sigmoid.
        for dims in [[1, 1, 1], [3, 5, 7], [2, 9, 1031], [1, 17, 2000]] {
            let data: Tensor<3> = Tensor::random(dims, Distribution::Normal(0.0, 6.0), &device);
            // A downstream weighting, so the gradient is not just silu' everywhere.
            let w: Tensor<3> = Tensor::random(dims, Distribution::Normal(0.0, 1.0), &device);
            let (va, ga) = value_and_grad(&data, &w, silu);
            let (vb, gb) = value_and_grad(&data, &w, burn::tensor::activation::silu);
            for (x, y) in va.iter().zip(&vb) {
                assert!((x - y).abs() <= 1e-5 * y.abs().max(1e-2), "{dims:?}: {x} vs {y}");
            }
            for (x, y) in ga.iter().zip(&gb) {
                assert!((x - y).abs() <= 1e-5 * y.abs().max(1e-1), "{dims:?}: gradient {x} vs {y}");
            }
        }
    }
    // Without autodiff, the plain value.
    let x: Tensor<2> = Tensor::random([4, 33], Distribution::Normal(0.0, 4.0), &Device::flex());
    let a: Vec<f32> = silu(x.clone()).into_data().try_into_vec::<f32>().unwrap();
    let b: Vec<f32> = burn::tensor::activation::silu(x).into_data().try_into_vec::<f32>().unwrap();
    assert!(a.iter().zip(&b).all(|(x, y)| (x - y).abs() <= 1e-5 * y.abs().max(1e-2)));
}

#[test]
fn the_fused_softmax_equals_burns_in_value_and_gradient_with_masked_entries() {
    for device in autodiff_devices() {
        device.seed(13);
        for dims in [[1, 1, 1, 1], [2, 3, 5, 7], [1, 2, 33, 257], [2, 1, 64, 1031]] {
            let n: usize = dims.iter().product();
            let raw: Tensor<4> = Tensor::random(dims, Distribution::Normal(0.0, 3.0), &device);
            // A causal-style mask: every column past the row's index (mod the width) is masked,
            // column 0 never is.
            let last = dims[3];
            let rows = n / last;
            let mask: Vec<f32> = (0..n).map(|i| if i % last > (i / last) % last { -1e30 } else { 0.0 }).collect();
            let mask = Tensor::<4>::from_data(TensorData::new(mask, dims), &device);
            let data = raw + mask;
            let w: Tensor<4> = Tensor::random(dims, Distribution::Normal(0.0, 1.0), &device);
            let (va, ga) = value_and_grad(&data, &w, softmax);
            let (vb, gb) = value_and_grad(&data, &w, |x| burn::tensor::activation::softmax(x, 3));
            for (x, y) in va.iter().zip(&vb) {
                assert!((x - y).abs() <= 1e-5 * y.abs().max(1e-3), "{dims:?}: {x} vs {y}");
            }
            // Rows sum to one.
            for r in va.chunks(last) {
                assert!((r.iter().sum::<f32>() - 1.0).abs() < 1e-5, "{dims:?} over {rows} rows");
            }
            let scale = gb.iter().fold(0f32, |m, y| m.max(y.abs()));
            for (x, y) in ga.iter().zip(&gb) {
                assert!((x - y).abs() <= 1e-5 * scale.max(1e-3), "{dims:?}: gradient {x} vs {y}");
            }
        }
    }
    let x: Tensor<2> = Tensor::random([3, 45], Distribution::Normal(0.0, 4.0), &Device::flex());
    let a: Vec<f32> = softmax(x.clone()).into_data().try_into_vec::<f32>().unwrap();
    let b: Vec<f32> = burn::tensor::activation::softmax(x, 1).into_data().try_into_vec::<f32>().unwrap();
    assert!(a.iter().zip(&b).all(|(x, y)| (x - y).abs() <= 1e-5 * y.abs().max(1e-3)));
}

#[test]
fn the_fused_loss_without_autodiff_is_the_plain_value() {
    let device = Device::flex();
    device.seed(9);
    let z: Tensor<3> = Tensor::random([2, 4, 11], Distribution::Normal(0.0, 1.0), &device);
    let t: Tensor<2, Int> = Tensor::random([2, 4], Distribution::Uniform(0.0, 11.0), &device);
    let a = f64::from(cross_entropy_sum(z.clone(), t.clone()).into_scalar::<f32>());
    let b = f64::from(cross_entropy_sum_reference(z, t).into_scalar::<f32>());
    assert!(rel(a, b) < 1e-5, "{a} vs {b}");
}

#[test]
fn fused_ops_inside_a_graph_with_infinite_masks_match_burns_ops() {
    // softmax of a masked, scaled input, then SiLU, then the loss: each custom operation
    // receives a gradient from the next and passes one to an operation before it.
    let device = Device::flex().autodiff();
    device.seed(17);
    let (b, s, v) = (2, 5, 6);
    let data: Tensor<3> = Tensor::random([b, s, v], Distribution::Normal(0.0, 2.0), &device);
    let mask: Vec<f32> = (0..b * s * v).map(|i| if i % v > (i / v) % s { f32::NEG_INFINITY } else { 0.0 }).collect();
    let mask = Tensor::<3>::from_data(TensorData::new(mask, [b, s, v]), &device);
    let tgt: Tensor<2, Int> = Tensor::random([b, s], Distribution::Uniform(0.0, v as f64), &device);
    let run = |fused: bool| {
        let x = Tensor::<3>::from_data(data.to_data(), &device).require_grad();
        let z = x.clone().mul_scalar(1.5) + mask.clone();
        let loss = if fused {
            cross_entropy_sum(silu(softmax(z)).mul_scalar(4.0), tgt.clone())
        } else {
            let y = burn::tensor::activation::silu(burn::tensor::activation::softmax(z, 2)).mul_scalar(4.0);
            cross_entropy_sum_reference(y, tgt.clone())
        };
        let value = f64::from(loss.clone().into_scalar::<f32>());
        let grad: Vec<f32> = x.grad(&loss.backward()).unwrap().into_data().try_into_vec::<f32>().unwrap();
        (value, grad)
    };
    let before = CUSTOM_OPS.load(Ordering::Relaxed);
    let (va, ga) = run(true);
    assert!(CUSTOM_OPS.load(Ordering::Relaxed) >= before + 3, "the fused ops took Burn's forms");
    let (vb, gb) = run(false);
    assert!(va.is_finite() && rel(va, vb) < 1e-5, "{va} vs {vb}");
    let scale = gb.iter().fold(0f32, |m, y| m.max(y.abs()));
    assert!(ga.iter().all(|g| g.is_finite()));
    for (x, y) in ga.iter().zip(&gb) {
        assert!((x - y).abs() <= 1e-5 * scale, "gradient {x} vs {y}");
    }
}

/// The causal mask built on the device is the one written out by hand: row `r` of a block of
/// `s` rows, `start` keys already cached, sees keys up to `start + r % s`.
#[test]
fn the_device_built_causal_mask_matches_the_definition() {
    for (rows, keys, s, start) in [(4, 4, 4, 0), (6, 5, 3, 2), (8, 3, 4, 0), (1, 7, 1, 6)] {
        let got: Vec<f32> = causal_mask([2, rows, keys], s, start, &Device::flex()).into_data().try_into_vec::<f32>().unwrap();
        let mut want = Vec::new();
        for r in 0..rows {
            for k in 0..keys {
                want.push(if k <= start + r % s { 0.0 } else { -1e30 });
            }
        }
        assert_eq!(got, want, "rows {rows} keys {keys} s {s} start {start}");
    }
}

#[test]
fn the_causal_softmax_equals_scaling_masking_and_burns_softmax() {
    // Grouped heads (rows = g * s), a KV cache (keys = start + s), odd sizes; value and
    // gradient on both autodiff devices, and the value without autodiff.
    for (k, &(b, heads, g, s, start)) in
        [(1, 1, 1, 1, 0), (2, 2, 3, 5, 0), (1, 3, 2, 7, 4), (2, 1, 1, 33, 0), (1, 2, 4, 9, 30)].iter().enumerate()
    {
        let (rows, keys) = (g * s, start + s);
        let dims = [b, heads, rows, keys];
        let scale = 0.3;
        for device in autodiff_devices() {
            device.seed(20 + k as u64);
            let data: Tensor<4> = Tensor::random(dims, Distribution::Normal(0.0, 3.0), &device);
            let w: Tensor<4> = Tensor::random(dims, Distribution::Normal(0.0, 1.0), &device);
            let (va, ga) = value_and_grad(&data, &w, |x| causal_softmax(x, scale, s, start));
            // The reference, written out: query row r sits at position start + r % s.
            let mask: Vec<f32> = (0..rows * keys).map(|i| if i % keys <= start + (i / keys) % s { 0.0 } else { -1e30 }).collect();
            let mask = Tensor::<4>::from_data(TensorData::new(mask, [1, 1, rows, keys]), &device);
            let (vc, gc) = value_and_grad(&data, &w, |x| burn::tensor::activation::softmax(x.mul_scalar(scale) + mask, 3));
            for (x, y) in va.iter().zip(&vc) {
                assert!((x - y).abs() <= 1e-5 * y.abs().max(1e-3), "{dims:?}: {x} vs {y}");
            }
            let big = gc.iter().fold(0f32, |m, y| m.max(y.abs()));
            for (x, y) in ga.iter().zip(&gc) {
                assert!((x - y).abs() <= 1e-5 * big.max(1e-3), "{dims:?}: gradient {x} vs {y}");
            }
        }
        let plain = Device::flex();
        plain.seed(40 + k as u64);
        let x: Tensor<4> = Tensor::random(dims, Distribution::Normal(0.0, 3.0), &plain);
        let mask: Vec<f32> = (0..rows * keys).map(|i| if i % keys <= start + (i / keys) % s { 0.0 } else { -1e30 }).collect();
        let mask = Tensor::<4>::from_data(TensorData::new(mask, [1, 1, rows, keys]), &plain);
        let a: Vec<f32> = causal_softmax(x.clone(), scale, s, start).into_data().try_into_vec::<f32>().unwrap();
        let c: Vec<f32> = burn::tensor::activation::softmax(x.mul_scalar(scale) + mask, 3).into_data().try_into_vec::<f32>().unwrap();
        assert!(a.iter().zip(&c).all(|(x, y)| (x - y).abs() <= 1e-5 * y.abs().max(1e-3)), "{dims:?} without autodiff");
    }
}

#[test]
fn the_fused_rms_norm_equals_the_decomposed_one_in_value_and_both_gradients() {
    for (k, dims) in [[1, 1, 1], [2, 3, 5], [3, 7, 33], [2, 70, 257]].into_iter().enumerate() {
        let d = dims[2];
        for device in autodiff_devices() {
            device.seed(60 + k as u64);
            let data: Tensor<3> = Tensor::random(dims, Distribution::Normal(0.5, 2.0), &device);
            let wd: Tensor<1> = Tensor::random([d], Distribution::Normal(1.0, 0.5), &device);
            let up: Tensor<3> = Tensor::random(dims, Distribution::Normal(0.0, 1.0), &device);
            let run = |fused: bool| {
                let x = Tensor::<3>::from_data(data.to_data(), &device).require_grad();
                let w = Tensor::<1>::from_data(wd.to_data(), &device).require_grad();
                let y = if fused {
                    rms_norm(x.clone(), w.clone(), 1e-5)
                } else {
                    let rms = (x.clone().square().mean_dim(2) + 1e-5).sqrt();
                    (x.clone() / rms) * w.clone().unsqueeze()
                };
                let value: Vec<f32> = y.to_data().try_into_vec::<f32>().unwrap();
                let g = (y * up.clone()).sum().backward();
                let gx: Vec<f32> = x.grad(&g).unwrap().into_data().try_into_vec::<f32>().unwrap();
                let gw: Vec<f32> = w.grad(&g).unwrap().into_data().try_into_vec::<f32>().unwrap();
                (value, gx, gw)
            };
            let (a, b) = (run(true), run(false));
            for (name, x, y) in [("value", &a.0, &b.0), ("dx", &a.1, &b.1), ("dw", &a.2, &b.2)] {
                let big = y.iter().fold(0f32, |m, v| m.max(v.abs()));
                for (p, q) in x.iter().zip(y) {
                    assert!((p - q).abs() <= 1e-5 * big.max(1e-3), "{dims:?} {name}: {p} vs {q}");
                }
            }
        }
    }
    let before = CUSTOM_OPS.load(Ordering::Relaxed);
    let device = Device::flex().autodiff();
    let x: Tensor<2> = Tensor::random([3, 4], Distribution::Default, &device).require_grad();
    let _ = rms_norm(x, Tensor::ones([4], &device).require_grad(), 1e-5);
    assert!(CUSTOM_OPS.load(Ordering::Relaxed) > before, "the fused RMSNorm took the decomposed form");
    // Without autodiff, the plain value.
    let plain = Device::flex();
    let x: Tensor<2> = Tensor::random([5, 9], Distribution::Normal(0.0, 3.0), &plain);
    let w: Tensor<1> = Tensor::random([9], Distribution::Normal(1.0, 0.5), &plain);
    let a: Vec<f32> = rms_norm(x.clone(), w.clone(), 1e-5).into_data().try_into_vec::<f32>().unwrap();
    let rms = (x.clone().square().mean_dim(1) + 1e-5).sqrt();
    let b: Vec<f32> = ((x / rms) * w.unsqueeze()).into_data().try_into_vec::<f32>().unwrap();
    assert!(a.iter().zip(&b).all(|(x, y)| (x - y).abs() <= 1e-5 * y.abs().max(1e-2)));
}

#[test]
fn the_fused_swiglu_equals_silu_times_up_in_value_and_both_gradients() {
    for (k, dims) in [[1, 1, 1], [2, 3, 5], [3, 7, 33], [2, 70, 689]].into_iter().enumerate() {
        for device in autodiff_devices() {
            device.seed(80 + k as u64);
            let gd: Tensor<3> = Tensor::random(dims, Distribution::Normal(0.0, 3.0), &device);
            let ud: Tensor<3> = Tensor::random(dims, Distribution::Normal(0.5, 2.0), &device);
            let wd: Tensor<3> = Tensor::random(dims, Distribution::Normal(0.0, 1.0), &device);
            // Both inputs tracked, then each alone (the other a constant).
            for (track_g, track_u) in [(true, true), (true, false), (false, true)] {
                let run = |fused: bool| {
                    let leaf = |d: &Tensor<3>, t: bool| {
                        let x = Tensor::<3>::from_data(d.to_data(), &device);
                        if t { x.require_grad() } else { x }
                    };
                    let (g, u) = (leaf(&gd, track_g), leaf(&ud, track_u));
                    // `up` as an intermediate that the op alone holds (as in the MLP), so the
                    // backward pass writes over it in place.
                    let y = if fused {
                        swiglu(g.clone(), u.clone().mul_scalar(1.0))
                    } else {
                        burn::tensor::activation::silu(g.clone()) * u.clone().mul_scalar(1.0)
                    };
                    let value: Vec<f32> = y.to_data().try_into_vec::<f32>().unwrap();
                    let grads = (y * wd.clone()).sum().backward();
                    let grad = |x: &Tensor<3>, t: bool| {
                        if t { x.grad(&grads).unwrap().into_data().try_into_vec::<f32>().unwrap() } else { Vec::new() }
                    };
                    (value, grad(&g, track_g), grad(&u, track_u))
                };
                let (a, b) = (run(true), run(false));
                for (name, x, y) in [("value", &a.0, &b.0), ("d gate", &a.1, &b.1), ("d up", &a.2, &b.2)] {
                    assert_eq!(x.len(), y.len(), "{dims:?} {name}");
                    let big = y.iter().fold(0f32, |m, v| m.max(v.abs()));
                    for (p, q) in x.iter().zip(y) {
                        assert!((p - q).abs() <= 1e-5 * big.max(1e-3), "{dims:?} {name} ({track_g}, {track_u}): {p} vs {q}");
                    }
                }
            }
        }
    }
    // The tensor-parallel split: gate and up are column shards, and each rank's product is
    // its columns of the whole product, gradients included.
    let device = Device::flex().autodiff();
    device.seed(90);
    let (rows, f) = (9, 34);
    let gd: Tensor<2> = Tensor::random([rows, f], Distribution::Normal(0.0, 3.0), &device);
    let ud: Tensor<2> = Tensor::random([rows, f], Distribution::Normal(0.0, 2.0), &device);
    let whole = |g: Tensor<2>, u: Tensor<2>| swiglu(g, u);
    let split = |g: Tensor<2>, u: Tensor<2>| {
        let cut = |x: Tensor<2>| [x.clone().slice([0..rows, 0..13]), x.slice([0..rows, 13..f])];
        let ([g0, g1], [u0, u1]) = (cut(g), cut(u));
        Tensor::cat(vec![swiglu(g0, u0), swiglu(g1, u1)], 1)
    };
    let run = |f: &dyn Fn(Tensor<2>, Tensor<2>) -> Tensor<2>| {
        let g = Tensor::<2>::from_data(gd.to_data(), &device).require_grad();
        let u = Tensor::<2>::from_data(ud.to_data(), &device).require_grad();
        let y = f(g.clone(), u.clone());
        let value: Vec<f32> = y.to_data().try_into_vec::<f32>().unwrap();
        let grads = y.mul_scalar(0.5).sum().backward();
        let grad = |x: &Tensor<2>| x.grad(&grads).unwrap().into_data().try_into_vec::<f32>().unwrap();
        (value, grad(&g), grad(&u))
    };
    let (a, b) = (run(&whole), run(&split));
    for (x, y) in [(&a.0, &b.0), (&a.1, &b.1), (&a.2, &b.2)] {
        assert!(x.iter().zip(y).all(|(p, q)| (p - q).abs() <= 1e-6 * q.abs().max(1.0)));
    }
    // One tensor as both inputs: its gradient is the sum of the two.
    let before = CUSTOM_OPS.load(Ordering::Relaxed);
    let run = |fused: bool| {
        let x = Tensor::<2>::from_data(gd.to_data(), &device).require_grad();
        let y = if fused { swiglu(x.clone(), x.clone()) } else { burn::tensor::activation::silu(x.clone()) * x.clone() };
        let value: Vec<f32> = y.to_data().try_into_vec::<f32>().unwrap();
        let grads = y.sum().backward();
        (value, x.grad(&grads).unwrap().into_data().try_into_vec::<f32>().unwrap())
    };
    let (a, b) = (run(true), run(false));
    for (x, y) in [(&a.0, &b.0), (&a.1, &b.1)] {
        assert!(x.iter().zip(y).all(|(p, q)| (p - q).abs() <= 1e-5 * q.abs().max(1.0)));
    }
    assert!(CUSTOM_OPS.load(Ordering::Relaxed) > before, "the fused SwiGLU took the decomposed form");
    // Without autodiff, the plain value.
    let plain = Device::flex();
    let g: Tensor<2> = Tensor::random([5, 9], Distribution::Normal(0.0, 3.0), &plain);
    let u: Tensor<2> = Tensor::random([5, 9], Distribution::Normal(0.0, 1.0), &plain);
    let a: Vec<f32> = swiglu(g.clone(), u.clone()).into_data().try_into_vec::<f32>().unwrap();
    let b: Vec<f32> = (burn::tensor::activation::silu(g) * u).into_data().try_into_vec::<f32>().unwrap();
    assert!(a.iter().zip(&b).all(|(x, y)| (x - y).abs() <= 1e-5 * y.abs().max(1e-2)));
}

#[test]
fn the_fused_rope_equals_the_decomposed_rotation_in_value_and_gradient() {
    for (k, [b, h, s, e]) in [[1, 1, 1, 2], [2, 3, 5, 8], [1, 2, 33, 6], [2, 4, 70, 32]].into_iter().enumerate() {
        let angles = |p: usize, j: usize| (p as f32 + 1.0) * 0.37f32.powi((j % (e / 2)) as i32);
        let table = |f: fn(f32) -> f32, device: &Device| {
            let v: Vec<f32> = (0..s * e).map(|i| f(angles(i / e, i % e))).collect();
            Tensor::<2>::from_data(TensorData::new(v, [s, e]), device)
        };
        for device in autodiff_devices() {
            device.seed(80 + k as u64);
            let (cos, sin) = (table(f32::cos, &device), table(f32::sin, &device));
            let data: Tensor<4> = Tensor::random([b, s, h, e], Distribution::Normal(0.0, 1.0), &device);
            let up: Tensor<4> = Tensor::random([b, h, s, e], Distribution::Normal(0.0, 1.0), &device);
            let run = |fused: bool| {
                let x0 = Tensor::<4>::from_data(data.to_data(), &device).require_grad();
                // As the model calls it: on a swap of dims, not contiguous.
                let x = x0.clone().swap_dims(1, 2);
                let y = if fused {
                    rope(x, &cos, &sin)
                } else {
                    let half = e / 2;
                    let rotated = Tensor::cat(vec![x.clone().narrow(3, half, half).neg(), x.clone().narrow(3, 0, half)], 3);
                    x * cos.clone().unsqueeze::<4>() + rotated * sin.clone().unsqueeze::<4>()
                };
                let value: Vec<f32> = y.to_data().try_into_vec::<f32>().unwrap();
                let g = (y * up.clone()).sum().backward();
                (value, x0.grad(&g).unwrap().into_data().try_into_vec::<f32>().unwrap())
            };
            let (a, c) = (run(true), run(false));
            for (name, x, y) in [("value", &a.0, &c.0), ("dx", &a.1, &c.1)] {
                for (p, q) in x.iter().zip(y) {
                    assert!((p - q).abs() <= 1e-5 * q.abs().max(1.0), "{:?} {name}: {p} vs {q}", [b, h, s, e]);
                }
            }
        }
    }
}

/// Index ranges are views of one range per thread and device, uploaded with the first call and
/// again, twice as long, only when a longer one is asked for; the meter sees each upload.
#[test]
fn index_ranges_are_uploaded_once_and_grow_by_doubling() {
    use crate::traffic;
    let device = Device::flex();
    let values = |t: Tensor<1, Int>| t.into_data().iter::<i64>().collect::<Vec<_>>();
    let _ = traffic::take();
    let expect = |n: i64, uploaded: i64| {
        assert_eq!(values(index_range(n as usize, &device)), (0..n).collect::<Vec<_>>());
        assert_eq!(traffic::take().constants, 8 * uploaded as u64, "after asking for {n}");
    };
    expect(5, 5);
    expect(3, 0);
    expect(5, 0);
    expect(7, 10);
    expect(10, 0);
    expect(25, 25);
    expect(0, 0);
}
