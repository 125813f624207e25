//! Fused softmax cross entropy, causal softmax, softmax, RMSNorm, RoPE, SiLU and SwiGLU: each
//! reads its input once on the host, computes its value (and what its backward needs) in one
//! parallel pass over rows (rayon, the pool Flex's GEMM already uses), and is one custom
//! operation of Burn's autodiff graph, whose hand-written backward is one more host pass:
//! - [`cross_entropy_sum`] never materialises probabilities or log-probabilities as tensors; its
//!   forward pass leaves `softmax(z) - onehot(target)` behind, and its backward scales that by the
//!   incoming gradient;
//! - [`softmax`] keeps `y` and returns `y * (dy - sum(dy * y))` per row;
//! - [`causal_softmax`] is [`softmax`] of scaled attention scores under a causal mask, with
//!   the scale and the mask folded in;
//! - [`rms_norm`] keeps `x` and each row's `1 / rms`, and returns the gradients of the input
//!   and of the weight;
//! - [`rope`] keeps its tables and applies the inverse rotation to `dy`;
//! - [`silu`] keeps `silu'(x)` and returns `dy * silu'(x)`;
//! - [`swiglu`] (`silu(gate) * up`, two inputs) keeps both inputs and returns both gradients in
//!   one pass, written over the incoming gradient and the kept `up`;
//! - [`causal_attention`] (`softmax(scale * q k^T + mask) v` per kv head, three inputs) runs its
//!   products block by block, skipping the keys no query of a block sees, and writes its output
//!   in the layout the output projection reads (see its module);
//! - [`linear`] (`x W + b`) writes each of its three products straight into a fresh buffer,
//!   where Flex's matmul zero-fills and copies every output first (see its module).
//!
//! The custom operations need Flex under autodiff without gradient checkpointing (what
//! `Device::flex().autodiff()` gives) and f32 values. On other devices, with checkpointing, or
//! for other element types, Burn's decomposed forms run instead; without autodiff, the host pass
//! alone.
//!
//! The engine's vocabulary-parallel loss runs the same row kernels around its all-reduces: each
//! rank computes `(max, sum of exp)` of its vocabulary slice in one pass ([`row_stats`]), the
//! ranks agree on the global max and rescale their sums ([`rescale_sums`]), and each rank
//! writes its slice's gradient in a second pass ([`softmax_grad_in_place`]).

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::NoCheckpointing;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, NodeGuard, Ops, OpsKind, unary};
use burn::backend::flex::FlexTensor;
use burn::backend::{Autodiff, Flex};
use burn::tensor::activation::log_softmax;
use burn::tensor::{DType, Device, Int, Tensor, TensorData};
use rayon::prelude::*;

mod attention;
mod gemm;
mod linear;
pub use attention::causal_attention;
pub use linear::linear;

/// Below this many logits one thread does the work: spawning tasks costs more.
const PARALLEL_MIN: usize = 1 << 15;

/// Lanes of the vectorised reductions.
const LANES: usize = 8;

/// `e^x` in f32 with a relative error of about 1e-7, free of branches and of float-to-int
/// conversions so that loops over slices vectorise. Range reduction `x = n ln 2 + r` with
/// `|r| <= ln 2 / 2` (ln 2 split in two parts so `n ln 2` is exact), a degree-6 polynomial for
/// `e^r`, and `2^n` built from its bits (`n` read from the mantissa of `x log2 e + 1.5 * 2^23`).
/// Returns 0 below -87.3 (where `e^x` leaves the normal range), saturates near 88, gives NaN
/// for NaN and +inf.
#[inline(always)]
pub fn exp(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    // 1.5 * 2^23: adding it rounds to an integer held in the low mantissa bits.
    const ROUND: f32 = 12_582_912.0;
    const ROUND_BITS: u32 = 0x4B40_0000;
    let c = x.clamp(-87.0, 88.0);
    let t = c * LOG2E + ROUND;
    let n = t - ROUND;
    let r = c - n * LN2_HI - n * LN2_LO;
    let p = 1.987_569_2e-4;
    let p = p * r + 1.398_2e-3;
    let p = p * r + 8.333_452e-3;
    let p = p * r + 4.166_579_6e-2;
    let p = p * r + 0.166_666_65;
    let p = p * r + 0.5;
    let y = p * r * r + r + 1.0;
    let scale = f32::from_bits(t.to_bits().wrapping_sub(ROUND_BITS).wrapping_add(127) << 23);
    // `x * 0` is 0, or NaN for NaN and infinities.
    if x < -87.3 { 0.0 } else { y * scale + x * 0.0 }
}

/// Largest value of a row (NaN values are skipped here; they reach the sum through `exp`).
fn row_max(row: &[f32]) -> f32 {
    let mut acc = [f32::NEG_INFINITY; LANES];
    let chunks = row.chunks_exact(LANES);
    let mut m = chunks.remainder().iter().fold(f32::NEG_INFINITY, |m, &x| if x > m { x } else { m });
    for c in chunks {
        for (a, &x) in acc.iter_mut().zip(c) {
            *a = if x > *a { x } else { *a };
        }
    }
    for a in acc {
        m = if a > m { a } else { m };
    }
    m
}

/// `sum(e^(x - max))` of a row.
fn row_sum_exp(row: &[f32], max: f32) -> f32 {
    let mut acc = [0f32; LANES];
    let chunks = row.chunks_exact(LANES);
    let mut s: f32 = chunks.remainder().iter().map(|&x| exp(x - max)).sum();
    for c in chunks {
        for (a, &x) in acc.iter_mut().zip(c) {
            *a += exp(x - max);
        }
    }
    s += acc.iter().sum::<f32>();
    s
}

/// Replaces each `x` by `e^(x - max)`; returns their sum (in lanes, so the loop vectorises).
fn exp_in_place(row: &mut [f32], max: f32) -> f32 {
    let mut acc = [0f32; LANES];
    let mut chunks = row.chunks_exact_mut(LANES);
    for c in &mut chunks {
        for (a, x) in acc.iter_mut().zip(c.iter_mut()) {
            *x = exp(*x - max);
            *a += *x;
        }
    }
    let mut s = 0f32;
    for x in chunks.into_remainder() {
        *x = exp(*x - max);
        s += *x;
    }
    s + acc.iter().sum::<f32>()
}

/// Writes `e^(x - max)` of each `x` of `src` into `dst`; returns their sum (in lanes, as
/// [`exp_in_place`]).
fn exp_into(dst: &mut [f32], src: &[f32], max: f32) -> f32 {
    let mut acc = [0f32; LANES];
    let (mut d8, s8) = (dst.chunks_exact_mut(LANES), src.chunks_exact(LANES));
    let rest_src = s8.remainder();
    for (d, s) in (&mut d8).zip(s8) {
        for ((a, y), &x) in acc.iter_mut().zip(d.iter_mut()).zip(s) {
            *y = exp(x - max);
            *a += *y;
        }
    }
    let mut sum = 0f32;
    for (y, &x) in d8.into_remainder().iter_mut().zip(rest_src) {
        *y = exp(x - max);
        sum += *y;
    }
    sum + acc.iter().sum::<f32>()
}

/// A row replaced by its softmax.
fn softmax_row(row: &mut [f32]) {
    let m = row_max(row);
    let k = 1.0 / exp_in_place(row, m);
    row.iter_mut().for_each(|x| *x *= k);
}

/// `sum(a * b)` in independent lanes, so the loop vectorises.
fn lane_dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; LANES];
    let (ca, cb) = (a.chunks_exact(LANES), b.chunks_exact(LANES));
    let rest: f32 = ca.remainder().iter().zip(cb.remainder()).map(|(x, y)| x * y).sum();
    for (x8, y8) in ca.zip(cb) {
        for ((a, x), y) in acc.iter_mut().zip(x8).zip(y8) {
            *a += x * y;
        }
    }
    acc.iter().sum::<f32>() + rest
}

/// Rows per parallel task, so that each task holds about `PARALLEL_MIN` logits.
fn rows_per_task(v: usize) -> usize {
    (PARALLEL_MIN / v.max(1)).max(1)
}

/// `(max, sum of e^(x - max))` of each row of `z` (rows of `v` logits), in one pass: each row
/// is read once from memory and twice from cache.
pub fn row_stats(z: &[f32], v: usize) -> (Vec<f32>, Vec<f32>) {
    assert!(v > 0 && z.len().is_multiple_of(v), "{} logits are not rows of {v}", z.len());
    let one = |row: &[f32]| {
        let m = row_max(row);
        (m, row_sum_exp(row, m))
    };
    let stats: Vec<(f32, f32)> = if z.len() < PARALLEL_MIN {
        z.chunks(v).map(one).collect()
    } else {
        z.par_chunks(v).with_min_len(rows_per_task(v)).map(one).collect()
    };
    stats.into_iter().unzip()
}

/// Rescales each row's `sum_exp` from its local `max` to the agreed `global` max (vocabulary
/// parallelism: each rank's sum is over its own slice; after this, the ranks' sums add up).
pub fn rescale_sums(sum_exp: &mut [f32], max: &[f32], global: &[f32]) {
    for ((s, &m), &g) in sum_exp.iter_mut().zip(max).zip(global) {
        // A slice whose max is -inf (all logits -inf) contributes nothing; one of NaNs keeps its NaN.
        *s = if m == f32::NEG_INFINITY && !s.is_nan() { 0.0 } else { *s * exp(m - g) };
    }
}

/// The target's logit of each row, for targets in `start..start + v`, else 0 (the slice of
/// another rank).
pub fn picked(z: &[f32], v: usize, targets: &[i64], start: i64) -> Vec<f32> {
    targets
        .iter()
        .enumerate()
        .map(|(i, &t)| {
            let local = t - start;
            if (0..v as i64).contains(&local) { z[i * v + local as usize] } else { 0.0 }
        })
        .collect()
}

/// Overwrites the logits `z` with `scale * (softmax(z) - onehot(target))` row by row, from the
/// agreed `max` and `sum_exp` of each row; targets outside `start..start + v` belong to another
/// slice and take no one-hot term here.
pub fn softmax_grad_in_place(z: &mut [f32], v: usize, max: &[f32], sum_exp: &[f32], targets: &[i64], start: i64, scale: f32) {
    assert!(v > 0 && z.len() == v * max.len() && max.len() == sum_exp.len() && max.len() == targets.len());
    let one = |(i, row): (usize, &mut [f32])| {
        let (m, k) = (max[i], scale / sum_exp[i]);
        for x in row.iter_mut() {
            *x = exp(*x - m) * k;
        }
        let local = targets[i] - start;
        if (0..v as i64).contains(&local) {
            row[local as usize] -= scale;
        }
    };
    if z.len() < PARALLEL_MIN {
        z.chunks_mut(v).enumerate().for_each(one);
    } else {
        z.par_chunks_mut(v).with_min_len(rows_per_task(v)).enumerate().for_each(one);
    }
}

/// Summed cross entropy of the rows of `z` against `targets` (the sum in f64), and its gradient
/// `softmax(z) - onehot(target)` written into `g`: row by row, so each row of logits is read
/// from memory once and each exponential taken once. Errors name a target outside the
/// vocabulary.
pub fn cross_entropy_grad(z: &[f32], g: &mut [f32], v: usize, targets: &[i64]) -> Result<f64, String> {
    if v == 0 || z.len() != v * targets.len() || g.len() != z.len() {
        return Err(format!("{} logits and {} gradients are not {} rows of {v}", z.len(), g.len(), targets.len()));
    }
    if let Some(t) = targets.iter().find(|&&t| !(0..v as i64).contains(&t)) {
        return Err(format!("target token id {t} is outside the vocabulary of {v} logits"));
    }
    let one = |(t, (zr, gr)): (&i64, (&[f32], &mut [f32]))| {
        let m = row_max(zr);
        let k = 1.0 / exp_into(gr, zr, m);
        gr.iter_mut().for_each(|x| *x *= k);
        let t = *t as usize;
        gr[t] -= 1.0;
        // -log softmax(z)[t] = ln(sum e^(z - m)) + m - z[t], and 1 / k is that sum.
        f64::from((1.0 / k).ln() + m - zr[t])
    };
    let losses: Vec<f64> = if z.len() < PARALLEL_MIN {
        targets.iter().zip(z.chunks(v).zip(g.chunks_mut(v))).map(one).collect()
    } else {
        targets.par_iter().zip(z.par_chunks(v).zip(g.par_chunks_mut(v))).with_min_len(rows_per_task(v)).map(one).collect()
    };
    Ok(losses.iter().sum())
}

/// A float tensor's values as f32 on the host, without its autodiff graph.
fn host_values<const D: usize>(t: &Tensor<D>) -> Vec<f32> {
    t.clone().inner().into_data().convert::<f32>().try_into_vec::<f32>().expect("f32 values")
}

/// Whether tensors on `device` live in host memory, where the fused kernels read them without a
/// transfer.
fn on_host(device: &Device) -> bool {
    device.clone().inner() == Device::flex()
}

/// Flex under autodiff without gradient checkpointing: the backend of the custom operations.
type Ad = Autodiff<Flex, NoCheckpointing>;

/// The backward pass of a custom operation: from what the forward pass kept, the gradient of
/// the output and the operation's scalar parameter, the gradient of the input (written over
/// either, where it holds its buffer alone).
type HostGrad = fn(FlexTensor, FlexTensor, f32) -> FlexTensor;

/// A custom operation's node in the autodiff graph: its backward pass and scalar parameter.
#[derive(Debug)]
struct HostBackward(HostGrad, f32);

impl Backward<Flex, 1> for HostBackward {
    type State = FlexTensor;

    fn backward(self, ops: Ops<FlexTensor, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let kept = ops.state;
        unary::<Flex, _>(ops.parents, ops.node, grads, |grad| (self.0)(kept, grad, self.1));
    }
}

/// A tensor's values in one contiguous f32 slice: itself, or a contiguous copy.
fn contiguous(t: FlexTensor) -> FlexTensor {
    if t.as_slice::<f32>().is_some() { t } else { t.to_contiguous() }
}

/// A contiguous f32 tensor's values to overwrite: in its own buffer when it holds that alone,
/// else in a copy.
fn values_mut(t: &mut FlexTensor) -> &mut [f32] {
    let (start, end) = t.layout().contiguous_offsets().expect("contiguous");
    &mut t.storage_mut::<f32>()[start..end]
}

/// A contiguous f32 tensor's values.
fn values(x: &FlexTensor) -> &[f32] {
    x.as_slice::<f32>().expect("contiguous f32")
}

/// A Flex tensor of `shape` holding `values`.
fn flex(values: Vec<f32>, shape: impl Into<burn::tensor::Shape>) -> FlexTensor {
    FlexTensor::from_data(TensorData::new(values, shape.into()))
}

/// Runs a custom operation on `x`, tracked by autodiff: `forward` maps the input's values to the
/// output and what `backward` needs. Gives `x` back when it is not a tracked f32 tensor of
/// [`Ad`].
// A tensor handle by value, as Burn passes them; boxing it would only add an allocation.
#[allow(clippy::result_large_err)]
fn custom_op<const D: usize, const E: usize>(
    x: Tensor<D>,
    forward: impl FnOnce(&[f32]) -> (FlexTensor, FlexTensor),
    backward: HostGrad,
    param: f32,
) -> Result<Tensor<E>, Tensor<D>> {
    if !x.is_tracked() {
        return Err(x);
    }
    let Ok(ad) = x.clone().try_into_primitive::<Ad>() else { return Err(x) };
    if ad.primitive().dtype() != DType::F32 {
        return Err(x);
    }
    let (input, guard) = ad.into_parts();
    let input = contiguous(input);
    let (out, kept) = forward(input.as_slice::<f32>().expect("contiguous f32"));
    let out = match HostBackward(backward, param).prepare::<NoCheckpointing>([guard]).compute_bound().stateful() {
        OpsKind::Tracked(prep) => prep.finish(kept, out),
        OpsKind::UnTracked(prep) => prep.finish(out),
    };
    #[cfg(test)]
    tests::CUSTOM_OPS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    Ok(Tensor::from_primitive::<Ad>(out))
}

/// An input of a custom operation: its values as a contiguous Flex tensor and its node in the
/// autodiff graph, or `None` unless it is an f32 tensor of [`Ad`].
fn ad_parts<const D: usize>(x: &Tensor<D>) -> Option<(FlexTensor, NodeGuard)> {
    let ad = x.clone().try_into_primitive::<Ad>().ok()?;
    (ad.primitive().dtype() == DType::F32).then(|| {
        let (p, node) = ad.into_parts();
        (contiguous(p), node)
    })
}

/// The inputs of a two-input custom operation ([`ad_parts`] of each), or `None` unless both
/// are f32 tensors of [`Ad`].
fn binary_parts<const D: usize, const E: usize>(a: &Tensor<D>, b: &Tensor<E>) -> Option<[(FlexTensor, NodeGuard); 2]> {
    Some([ad_parts(a)?, ad_parts(b)?])
}

/// `-sum log softmax(logits)[target]` over all positions, `[1]`, fused (see the module docs).
/// On devices other than Flex it takes the decomposed form, which keeps the logits on the device.
///
/// # Panics
/// If a target id is outside the vocabulary, like the gather of the decomposed form.
pub fn cross_entropy_sum(logits_bsv: Tensor<3>, targets_bs: Tensor<2, Int>) -> Tensor<1> {
    let device = logits_bsv.device();
    if !on_host(&device) {
        return cross_entropy_sum_decomposed(logits_bsv, targets_bs);
    }
    let [b, s, v] = logits_bsv.dims();
    let targets: Vec<i64> = targets_bs.clone().into_data().convert::<i64>().try_into_vec::<i64>().expect("i64 targets");
    let forward = |z: &[f32]| {
        // The loss, and d loss / d z = softmax(z) - onehot(target) kept for the backward pass.
        let mut g = vec![0f32; z.len()];
        let loss = cross_entropy_grad(z, &mut g, v, &targets).unwrap_or_else(|e| panic!("cross entropy: {e}"));
        (flex(vec![loss as f32], [1]), flex(g, [b, s, v]))
    };
    // The kept gradient, scaled in its own buffer by the gradient reaching the loss.
    let backward: HostGrad = |mut g, d, _| {
        let k = contiguous(d).as_slice::<f32>().expect("contiguous f32")[0];
        values_mut(&mut g).par_chunks_mut(CHUNK).for_each(|c| c.iter_mut().for_each(|x| *x *= k));
        g
    };
    match custom_op(logits_bsv, forward, backward, 1.0) {
        Ok(loss) => loss,
        Err(z) if z.is_tracked() => cross_entropy_sum_decomposed(z, targets_bs),
        Err(z) => {
            let z = host_values(&z);
            let loss = cross_entropy_grad(&z, &mut vec![0f32; z.len()], v, &targets).unwrap_or_else(|e| panic!("cross entropy: {e}"));
            Tensor::<1>::from_data(TensorData::new(vec![loss as f32], [1]), &device)
        }
    }
}

/// Chunk of element-wise host kernels per parallel task.
const CHUNK: usize = 1 << 14;

/// SiLU `x * sigmoid(x)`, fused on Flex (see the module docs): the forward pass keeps
/// `silu'(x)`, so the backward pass is one multiply. Elsewhere Burn's `silu`.
pub fn silu<const D: usize>(x: Tensor<D>) -> Tensor<D> {
    let device = x.device();
    if !on_host(&device) {
        return burn::tensor::activation::silu(x);
    }
    let shape = x.dims();
    let forward = |v: &[f32]| {
        let (mut y, mut d) = (vec![0f32; v.len()], vec![0f32; v.len()]);
        v.par_chunks(CHUNK).zip(y.par_chunks_mut(CHUNK)).zip(d.par_chunks_mut(CHUNK)).for_each(|((x, y), d)| {
            for ((&x, y), d) in x.iter().zip(y.iter_mut()).zip(d.iter_mut()) {
                let s = sigmoid(x);
                *y = x * s;
                *d = s * (1.0 + x * (1.0 - s));
            }
        });
        (flex(y, shape), flex(d, shape))
    };
    // dy * silu'(x), written over dy.
    let backward: HostGrad = |kept, dy, _| {
        let mut dx = contiguous(dy);
        let d = kept.as_slice::<f32>().expect("contiguous f32");
        values_mut(&mut dx).par_chunks_mut(CHUNK).zip(d.par_chunks(CHUNK)).for_each(|(dx, d)| {
            dx.iter_mut().zip(d).for_each(|(dx, &d)| *dx *= d);
        });
        dx
    };
    match custom_op(x, forward, backward, 1.0) {
        Ok(y) => y,
        Err(x) if x.is_tracked() => burn::tensor::activation::silu(x),
        Err(x) => {
            let mut y = host_values(&x);
            y.par_chunks_mut(CHUNK).for_each(|c| c.iter_mut().for_each(|x| *x *= sigmoid(*x)));
            Tensor::<D>::from_data(TensorData::new(y, shape), &device)
        }
    }
}

/// SwiGLU's gated product `silu(gate) * up`, fused on Flex: one host pass forward, keeping both
/// inputs; one backward pass gives both gradients, written over the incoming gradient and the
/// kept `up` where they hold their buffers alone (`sigmoid(gate)` is computed again rather than
/// kept). Elsewhere (other devices, checkpointing, shapes that differ) [`silu`] times `up`.
pub fn swiglu<const D: usize>(gate: Tensor<D>, up: Tensor<D>) -> Tensor<D> {
    let device = gate.device();
    let shape = gate.dims();
    if !on_host(&device) || up.dims() != shape {
        return silu(gate) * up;
    }
    let forward = |g: &[f32], u: &[f32]| {
        let mut y = vec![0f32; g.len()];
        y.par_chunks_mut(CHUNK).zip(g.par_chunks(CHUNK)).zip(u.par_chunks(CHUNK)).for_each(|((y, g), u)| {
            for ((y, &g), &u) in y.iter_mut().zip(g).zip(u) {
                *y = g * sigmoid(g) * u;
            }
        });
        y
    };
    let tracked = gate.is_tracked() || up.is_tracked();
    if tracked && let Some([(pg, to_g), (pu, to_u)]) = binary_parts(&gate, &up) {
        let y = flex(forward(pg.as_slice::<f32>().expect("contiguous f32"), pu.as_slice::<f32>().expect("contiguous f32")), shape);
        let out = match SwigluBackward.prepare::<NoCheckpointing>([to_g, to_u]).compute_bound().stateful() {
            OpsKind::Tracked(prep) => prep.finish((pg, pu), y),
            OpsKind::UnTracked(prep) => prep.finish(y),
        };
        #[cfg(test)]
        tests::CUSTOM_OPS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        return Tensor::from_primitive::<Ad>(out);
    }
    if tracked {
        return silu(gate) * up;
    }
    let y = forward(&host_values(&gate), &host_values(&up));
    Tensor::<D>::from_data(TensorData::new(y, shape), &device)
}

/// SwiGLU's node: kept are `gate` and `up`.
#[derive(Debug)]
struct SwigluBackward;

impl Backward<Flex, 2> for SwigluBackward {
    type State = (FlexTensor, FlexTensor);

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [to_g, to_u] = ops.parents;
        let (g, mut u) = ops.state;
        // d gate = dy * up * silu'(gate) over dy's buffer, d up = dy * silu(gate) over up's, in
        // one pass.
        let mut dg = contiguous(grads.consume::<Flex>(&ops.node));
        let gv = g.as_slice::<f32>().expect("contiguous f32");
        match (&to_g, &to_u) {
            (Some(_), Some(_)) => {
                values_mut(&mut dg).par_chunks_mut(CHUNK).zip(values_mut(&mut u).par_chunks_mut(CHUNK)).zip(gv.par_chunks(CHUNK)).for_each(
                    |((dy, u), g)| {
                        for ((dy, u), &g) in dy.iter_mut().zip(u.iter_mut()).zip(g) {
                            let s = sigmoid(g);
                            let (d, up) = (*dy, *u);
                            *dy = d * up * s * (1.0 + g * (1.0 - s));
                            *u = d * g * s;
                        }
                    },
                );
            }
            (Some(_), None) => {
                let uv = u.as_slice::<f32>().expect("contiguous f32");
                values_mut(&mut dg).par_chunks_mut(CHUNK).zip(uv.par_chunks(CHUNK)).zip(gv.par_chunks(CHUNK)).for_each(|((dy, u), g)| {
                    for ((dy, &u), &g) in dy.iter_mut().zip(u).zip(g) {
                        let s = sigmoid(g);
                        *dy *= u * s * (1.0 + g * (1.0 - s));
                    }
                });
            }
            (None, Some(_)) => {
                let dyv = dg.as_slice::<f32>().expect("contiguous f32");
                values_mut(&mut u).par_chunks_mut(CHUNK).zip(dyv.par_chunks(CHUNK)).zip(gv.par_chunks(CHUNK)).for_each(|((u, dy), g)| {
                    for ((u, &dy), &g) in u.iter_mut().zip(dy).zip(g) {
                        *u = dy * g * sigmoid(g);
                    }
                });
            }
            (None, None) => return,
        }
        if let Some(node) = to_g {
            grads.register::<Flex>(node.id, dg);
        }
        if let Some(node) = to_u {
            grads.register::<Flex>(node.id, u);
        }
    }
}

/// Softmax over the last dimension, fused on Flex (see the module docs): the forward pass keeps
/// `y`, and the backward pass is `y * (dy - sum(dy * y))` per row, one pass. Masked entries may
/// be -inf or large negative numbers. Elsewhere Burn's `softmax`.
pub fn softmax<const D: usize>(x: Tensor<D>) -> Tensor<D> {
    masked_softmax(x, 1.0, None)
}

/// Causal attention probabilities, `softmax(scale * scores + mask)` over the last dimension,
/// fused on Flex: `scores` is `[.., rows, keys]`, and row `r` of the last-but-one dimension is
/// the query at position `start + r % s`, which sees keys `0..=start + r % s` (grouped heads
/// stack their `s` queries along the rows). The scale and the mask cost no pass of their own;
/// masked keys are never exponentiated and get probability 0, and the backward pass is
/// `scale * y * (dy - sum(dy * y))` per row. Elsewhere the decomposed form with an additive
/// `-1e30` mask.
pub fn causal_softmax<const D: usize>(scores: Tensor<D>, scale: f64, s: usize, start: usize) -> Tensor<D> {
    masked_softmax(scores, scale, Some((s, start)))
}

/// Keys that row `row` sees: all, or with `causal = Some((s, start))` those up to its position.
fn visible(row: usize, rows: usize, keys: usize, causal: Option<(usize, usize)>) -> usize {
    causal.map_or(keys, |(s, start)| (start + (row % rows) % s.max(1) + 1).min(keys))
}

/// [`softmax`] and [`causal_softmax`]: rows of the last dimension, scaled, the keys past each
/// row's visible ones (if `causal`) given probability 0.
fn masked_softmax<const D: usize>(x: Tensor<D>, scale: f64, causal: Option<(usize, usize)>) -> Tensor<D> {
    let device = x.device();
    let last = D - 1;
    let decomposed = |x: Tensor<D>| {
        let x = if scale == 1.0 { x } else { x.mul_scalar(scale) };
        let x = match causal {
            Some((s, start)) => {
                let mask = causal_mask::<D>(x.dims(), s, start, &x.device());
                x + mask
            }
            None => x,
        };
        burn::tensor::activation::softmax(x, last)
    };
    if !on_host(&device) {
        return decomposed(x);
    }
    let shape = x.dims();
    let v = shape[last];
    if v == 0 || shape.contains(&0) {
        return x;
    }
    let rows = if D >= 2 { shape[D - 2] } else { 1 };
    let per_task = rows_per_task(v);
    let scale = scale as f32;
    let forward = |x: &[f32]| {
        let mut y = x.to_vec();
        y.par_chunks_mut(v * per_task).enumerate().for_each(|(task, ys)| {
            for (i, row) in ys.chunks_mut(v).enumerate() {
                let seen = visible(task * per_task + i, rows, v, causal);
                let (row, hidden) = row.split_at_mut(seen);
                if scale != 1.0 {
                    row.iter_mut().for_each(|x| *x *= scale);
                }
                softmax_row(row);
                hidden.fill(0.0);
            }
        });
        y
    };
    // scale * y * (dy - sum(dy * y)) per row, written over dy.
    let backward: HostGrad = |kept, dy, scale| {
        let v = *kept.layout().shape().last().expect("a last dimension");
        let mut dx = contiguous(dy);
        let y = kept.as_slice::<f32>().expect("contiguous f32");
        let per_task = rows_per_task(v);
        values_mut(&mut dx).par_chunks_mut(v * per_task).zip(y.par_chunks(v * per_task)).for_each(|(dxs, ys)| {
            for (dx, y) in dxs.chunks_mut(v).zip(ys.chunks(v)) {
                let r = lane_dot(dx, y);
                for (g, &p) in dx.iter_mut().zip(y) {
                    *g = scale * p * (*g - r);
                }
            }
        });
        dx
    };
    let tracked = |x: &[f32]| {
        // The output is also what the backward pass keeps: one buffer, shared.
        let y = flex(forward(x), shape);
        (y.clone(), y)
    };
    match custom_op(x, tracked, backward, scale) {
        Ok(y) => y,
        Err(x) if x.is_tracked() => decomposed(x),
        Err(x) => Tensor::<D>::from_data(TensorData::new(forward(&host_values(&x)), shape), &device),
    }
}

/// The additive causal mask of [`causal_softmax`] for scores of `shape`: 0 where a row sees the
/// key, -1e30 where it does not (finite, so that no `0 * -inf` appears in a backward pass),
/// broadcast over the leading dimensions.
fn causal_mask<const D: usize>(shape: [usize; D], s: usize, start: usize, device: &Device) -> Tensor<D> {
    let (rows, keys) = (if D >= 2 { shape[D - 2] } else { 1 }, shape[D - 1]);
    let mask: Vec<f32> =
        (0..rows * keys).map(|i| if i % keys < visible(i / keys, rows, keys, Some((s, start))) { 0.0 } else { -1e30 }).collect();
    let mut mask_shape = [1; D];
    mask_shape[D - 1] = keys;
    if D >= 2 {
        mask_shape[D - 2] = rows;
    }
    Tensor::<D>::from_data(TensorData::new(mask, mask_shape), device)
}

/// RMSNorm over the last dimension, `x / sqrt(mean(x^2) + eps) * weight`, fused on Flex: one
/// host pass forward, keeping each row's `1 / rms`, and one backward pass for each input that
/// takes a gradient. Elsewhere (other devices, checkpointing) the decomposed form.
pub fn rms_norm<const D: usize>(x: Tensor<D>, weight: Tensor<1>, eps: f64) -> Tensor<D> {
    let decomposed = |x: Tensor<D>, weight: Tensor<1>| {
        let rms = (x.clone().square().mean_dim(D - 1) + eps).sqrt();
        (x / rms) * weight.unsqueeze()
    };
    let device = x.device();
    let shape = x.dims();
    let d = shape[D - 1];
    if !on_host(&device) || d == 0 || shape.contains(&0) || weight.dims() != [d] {
        return decomposed(x, weight);
    }
    let eps = eps as f32;
    // y = x * r * w per row, r = 1 / sqrt(mean(x^2) + eps); r kept per row.
    let forward = |x: &[f32], w: &[f32]| {
        let mut y = vec![0f32; x.len()];
        let mut r = vec![0f32; x.len() / d];
        let per_task = rows_per_task(d);
        y.par_chunks_mut(d * per_task).zip(x.par_chunks(d * per_task)).zip(r.par_chunks_mut(per_task)).for_each(|((ys, xs), rs)| {
            for ((y, x), r) in ys.chunks_mut(d).zip(xs.chunks(d)).zip(rs.iter_mut()) {
                *r = 1.0 / (lane_dot(x, x) / d as f32 + eps).sqrt();
                for ((y, &x), &w) in y.iter_mut().zip(x).zip(w) {
                    *y = x * *r * w;
                }
            }
        });
        (y, r)
    };
    let tracked = x.is_tracked() || weight.is_tracked();
    if tracked && let Some([(px, gx), (pw, gw)]) = binary_parts(&x, &weight) {
        let (y, r) = forward(px.as_slice::<f32>().expect("contiguous f32"), pw.as_slice::<f32>().expect("contiguous f32"));
        let rows = r.len();
        let (y, r) = (flex(y, shape), flex(r, [rows]));
        let out = match RmsBackward.prepare::<NoCheckpointing>([gx, gw]).compute_bound().stateful() {
            OpsKind::Tracked(prep) => prep.finish((px, r, pw), y),
            OpsKind::UnTracked(prep) => prep.finish(y),
        };
        #[cfg(test)]
        tests::CUSTOM_OPS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        return Tensor::from_primitive::<Ad>(out);
    }
    if tracked {
        return decomposed(x, weight);
    }
    let (y, _) = forward(&host_values(&x), &host_values(&weight));
    Tensor::<D>::from_data(TensorData::new(y, shape), &device)
}

/// RMSNorm's node: kept are `x`, each row's `1 / rms` and the weight.
#[derive(Debug)]
struct RmsBackward;

impl Backward<Flex, 2> for RmsBackward {
    type State = (FlexTensor, FlexTensor, FlexTensor);

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [to_x, to_w] = ops.parents;
        let dy = contiguous(grads.consume::<Flex>(&ops.node));
        let (x, r, w) = ops.state;
        let shape = x.layout().shape().clone();
        let (xv, rv, wv, dyv) = (
            x.as_slice::<f32>().expect("contiguous f32"),
            r.as_slice::<f32>().expect("contiguous f32"),
            w.as_slice::<f32>().expect("contiguous f32"),
            dy.as_slice::<f32>().expect("contiguous f32"),
        );
        let d = wv.len();
        let per_task = rows_per_task(d);
        if let Some(node) = to_w {
            // dw = sum over rows of dy * x * r: partial sums per task, added in order.
            let parts: Vec<Vec<f32>> = xv
                .par_chunks(d * per_task)
                .zip(dyv.par_chunks(d * per_task))
                .zip(rv.par_chunks(per_task))
                .map(|((xs, dys), rs)| {
                    let mut acc = vec![0f32; d];
                    for ((x, dy), &r) in xs.chunks(d).zip(dys.chunks(d)).zip(rs) {
                        for ((a, &x), &g) in acc.iter_mut().zip(x).zip(dy) {
                            *a += g * x * r;
                        }
                    }
                    acc
                })
                .collect();
            let mut dw = vec![0f32; d];
            for part in parts {
                dw.iter_mut().zip(part).for_each(|(a, p)| *a += p);
            }
            grads.register::<Flex>(node.id, flex(dw, [d]));
        }
        if let Some(node) = to_x {
            // dx = r * (dy * w - x * r * c), c = mean(dy * w * x * r) over the row.
            let mut dx = vec![0f32; xv.len()];
            dx.par_chunks_mut(d * per_task)
                .zip(xv.par_chunks(d * per_task))
                .zip(dyv.par_chunks(d * per_task))
                .zip(rv.par_chunks(per_task))
                .for_each(|(((dxs, xs), dys), rs)| {
                    for (((dx, x), dy), &r) in dxs.chunks_mut(d).zip(xs.chunks(d)).zip(dys.chunks(d)).zip(rs) {
                        let c = x.iter().zip(dy).zip(wv).map(|((&x, &g), &w)| g * w * x).sum::<f32>() * r / d as f32;
                        for (((dx, &x), &g), &w) in dx.iter_mut().zip(x).zip(dy).zip(wv) {
                            *dx = r * (g * w - x * r * c);
                        }
                    }
                });
            grads.register::<Flex>(node.id, flex(dx, shape));
        }
    }
}

/// Rotary position embedding in the rotate-half layout, `x * cos + rotate_half(x) * sin` with
/// `rotate_half([x1, x2]) = [-x2, x1]` over the last dimension, for `x` `[b, h, s, e]` and
/// tables `[s, e]`; fused on Flex (one host pass each way, the tables kept for the backward
/// pass). Elsewhere (other devices, checkpointing) the decomposed form.
pub fn rope(x: Tensor<4>, cos: &Tensor<2>, sin: &Tensor<2>) -> Tensor<4> {
    let decomposed = |x: Tensor<4>| {
        let [_, _, _, e] = x.dims();
        let half = e / 2;
        let x1 = x.clone().narrow(3, 0, half);
        let x2 = x.clone().narrow(3, half, half);
        let rotated = Tensor::cat(vec![x2.neg(), x1], 3);
        let (c, sn): (Tensor<4>, Tensor<4>) = (cos.clone().unsqueeze(), sin.clone().unsqueeze());
        x * c + rotated * sn
    };
    let device = x.device();
    let shape = x.dims();
    let [_, _, s, e] = shape;
    if !on_host(&device) || e % 2 != 0 || shape.contains(&0) || cos.dims() != [s, e] || sin.dims() != [s, e] {
        return decomposed(x);
    }
    // The tables, cos then sin, `[2, s, e]`.
    let mut tables = host_values(cos);
    tables.extend(host_values(sin));
    let forward = |x: &[f32], tables: &[f32]| rotate_rows(x, tables, s, e, rotate);
    // dx = dy * cos + rotate_half^T(dy * sin).
    let backward: HostGrad = |tables, dy, _| {
        let shape = tables.layout().shape().clone();
        let dy = contiguous(dy);
        let tables = tables.as_slice::<f32>().expect("contiguous f32");
        let dx = rotate_rows(dy.as_slice::<f32>().expect("contiguous f32"), tables, shape[1], shape[2], rotate_back);
        flex(dx, dy.layout().shape().clone())
    };
    let tracked = |x: &[f32]| {
        let y = forward(x, &tables);
        (flex(y, shape), flex(tables.clone(), [2, s, e]))
    };
    match custom_op(x, tracked, backward, 1.0) {
        Ok(y) => y,
        Err(x) if x.is_tracked() => decomposed(x),
        Err(x) => Tensor::<4>::from_data(TensorData::new(forward(&host_values(&x), &tables), shape), &device),
    }
}

/// One row of a rotation: `(out, input, cos, sin)`.
type RowRotation = fn(&mut [f32], &[f32], &[f32], &[f32]);

/// `row` applied to each row of `e` values of `input`, with the cos and sin tables (`[2, s, e]`)
/// of the row's position (row index modulo `s`), in parallel over rows.
fn rotate_rows(input: &[f32], tables: &[f32], s: usize, e: usize, row: RowRotation) -> Vec<f32> {
    let (c, sn) = tables.split_at(s * e);
    let mut out = vec![0f32; input.len()];
    let rows = rows_per_task(e);
    out.par_chunks_mut(e * rows).zip(input.par_chunks(e * rows)).enumerate().for_each(|(task, (outs, ins))| {
        for (i, (o, x)) in outs.chunks_mut(e).zip(ins.chunks(e)).enumerate() {
            let p = (task * rows + i) % s;
            row(o, x, &c[p * e..(p + 1) * e], &sn[p * e..(p + 1) * e]);
        }
    });
    out
}

/// One row of [`rope`]: `y = x * c + rotate_half(x) * s`.
fn rotate(y: &mut [f32], x: &[f32], c: &[f32], s: &[f32]) {
    let h = x.len() / 2;
    for j in 0..h {
        y[j] = x[j] * c[j] - x[j + h] * s[j];
        y[j + h] = x[j + h] * c[j + h] + x[j] * s[j + h];
    }
}

/// One row of [`rope`]'s backward pass: `dx_j = dy_j c_j + dy_(j+h) s_(j+h)` in the first half,
/// `dx_j = dy_j c_j - dy_(j-h) s_(j-h)` in the second.
fn rotate_back(dx: &mut [f32], dy: &[f32], c: &[f32], s: &[f32]) {
    let h = dy.len() / 2;
    for j in 0..h {
        dx[j] = dy[j] * c[j] + dy[j + h] * s[j + h];
        dx[j + h] = dy[j + h] * c[j + h] - dy[j] * s[j];
    }
}

/// `1 / (1 + e^-x)` with [`exp`].
#[inline(always)]
fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + exp(-x))
}

/// The loss as `sum(logsumexp(logits)) - sum(logits[target])` in tensor ops, with the max used
/// for stability detached (the shift cancels in value and gradient).
pub fn cross_entropy_sum_decomposed(logits_bsv: Tensor<3>, targets_bs: Tensor<2, Int>) -> Tensor<1> {
    let max_bs1 = logits_bsv.clone().detach().max_dim(2);
    let lse_bs1 = (logits_bsv.clone() - max_bs1.clone()).exp().sum_dim(2).log() + max_bs1;
    let picked_bs1 = logits_bsv.gather(2, targets_bs.unsqueeze_dim::<3>(2));
    lse_bs1.sum() - picked_bs1.sum()
}

/// The same loss through `log_softmax`: the reference the fused form is tested against.
pub fn cross_entropy_sum_reference(logits_bsv: Tensor<3>, targets_bs: Tensor<2, Int>) -> Tensor<1> {
    log_softmax(logits_bsv, 2).gather(2, targets_bs.unsqueeze_dim::<3>(2)).sum().neg()
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::tensor::Distribution;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// Custom operations built so far (all tests of this process).
    pub(super) static CUSTOM_OPS: AtomicUsize = AtomicUsize::new(0);

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
}
