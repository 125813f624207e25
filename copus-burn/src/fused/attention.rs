//! Causal grouped-query attention as one custom operation on Flex: `softmax(scale * q k^T + mask) v`
//! per kv head, where the `g` query heads that share a kv head are stacked along the rows
//! (`q` is `[b, kv heads, g * s, e]`, row `r` the query at position `start + r % s`).
//!
//! Rows go in blocks of [`BLOCK`] positions of one query head. A block multiplies only the keys
//! its last row sees, so of `N` blocks per head a share `(N - 1) / 2N` of the products is never
//! computed (37.5% at `s = 256`, towards half as `s` grows), in the forward and in the backward
//! pass. The scores are computed in place in the rows of the probabilities, which the backward
//! pass keeps; the gradient of a block's scores lives in one block-sized buffer per task. The
//! output is written straight in `[b, s, h * e]`, the layout the output projection reads, so the
//! usual transpose and copy after attention disappear, and the gradient reaching it is read in
//! that layout too.
//! Each `(batch, kv head)` is one parallel task on rayon's pool; every product is a
//! single-threaded call of the `gemm` crate (the crate under Flex's matmul).

#![allow(unsafe_code)]

use super::gemm::{Mat, gemm_raw, product};
use super::glue::{Ad, ad_parts, contiguous, flex, fusable, host_values, values};
use super::rows::{lane_dot, softmax_row};
use burn::backend::Flex;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::NoCheckpointing;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::flex::FlexTensor;
use burn::tensor::{Tensor, TensorData};
use rayon::prelude::*;

/// Query positions per block.
const BLOCK: usize = 64;

/// Causal grouped-query attention, `[b, s, h * e]`: `q_bkre` is `[b, k, g * s, e]` (the `g`
/// query heads of each of the `k` kv heads stacked along the rows, after RoPE), `k_bkte` and
/// `v_bkte` are `[b, k, t, e]` with `t = start + s` keys (a KV cache holds the first `start`).
/// Query head `i * g + j` is row block `j` of kv head `i`; the output is
/// `softmax(scale * q k^T + causal mask) v` with its heads side by side along the last
/// dimension. Fused on Flex (see the module docs); elsewhere, under gradient checkpointing, for
/// other element types or shapes that do not fit, the same product as Burn's matmuls around
/// [`super::causal_softmax`].
pub fn causal_attention(q_bkre: Tensor<4>, k_bkte: Tensor<4>, v_bkte: Tensor<4>, scale: f64, s: usize, start: usize) -> Tensor<3> {
    let [b, kv, r, e] = q_bkre.dims();
    let t = k_bkte.dims()[2];
    let g = r / s.max(1);
    let decomposed = |q: Tensor<4>, k: Tensor<4>, v: Tensor<4>| {
        let probs = super::softmax::causal_softmax(q.matmul(k.swap_dims(2, 3)), scale, s, start);
        probs.matmul(v).reshape([b, kv * g, s, e]).swap_dims(1, 2).reshape([b, s, kv * g * e])
    };
    let geo = Geometry { b, kv, g, s, t, e, start, scale: scale as f32 };
    let fits = s > 0
        && g > 0
        && r == g * s
        && k_bkte.dims() == [b, kv, t, e]
        && v_bkte.dims() == [b, kv, t, e]
        && t >= start + s
        && [b, kv, e].iter().all(|&n| n > 0);
    if !fusable(&q_bkre) || !fits {
        return decomposed(q_bkre, k_bkte, v_bkte);
    }
    let tracked = q_bkre.is_tracked() || k_bkte.is_tracked() || v_bkte.is_tracked();
    if !tracked {
        let (q, k, v) = (host_values(&q_bkre), host_values(&k_bkte), host_values(&v_bkte));
        let (out, _) = geo.forward(&q, &k, &v);
        return Tensor::from_data(TensorData::new(out, [b, s, kv * g * e]), &q_bkre.device());
    }
    let (Some((q, nq)), Some((k, nk)), Some((v, nv))) = (ad_parts(&q_bkre), ad_parts(&k_bkte), ad_parts(&v_bkte)) else {
        return decomposed(q_bkre, k_bkte, v_bkte);
    };
    let (out, probs) = geo.forward(values(&q), values(&k), values(&v));
    let out = flex(out, [b, s, kv * g * e]);
    let out = match AttentionBackward(geo).prepare::<NoCheckpointing>([nq, nk, nv]).compute_bound().stateful() {
        OpsKind::Tracked(prep) => prep.finish((q, k, v, probs), out),
        OpsKind::UnTracked(prep) => prep.finish(out),
    };
    #[cfg(test)]
    tests::FUSED.with(|n| n.set(n.get() + 1));
    Tensor::from_primitive::<Ad>(out)
}

/// Causal grouped-query attention from query heads as the projection gives them, `[b, s, h * e]`:
/// `q_bhse` is `[b, h, s, e]` (after RoPE), `k_bkte` and `v_bkte` are `[b, k, t, e]` as for
/// [`causal_attention`], `h` a multiple of `k` (query head `i` reads kv head `i / (h / k)`). On
/// LibTorch, without a KV cache, one operation on LibTorch's `scaled_dot_product_attention`
/// (its flash or memory-efficient kernel on CUDA), which reads the heads in place; elsewhere the
/// `h / k` query heads of each kv head are folded into the rows and [`causal_attention`] runs.
pub fn grouped_causal_attention(q_bhse: Tensor<4>, k_bkte: Tensor<4>, v_bkte: Tensor<4>, scale: f64, start: usize) -> Tensor<3> {
    let [b, h, s, e] = q_bhse.dims();
    let k = k_bkte.dims()[1];
    #[cfg(feature = "tch")]
    if start == 0
        && k > 0
        && h % k == 0
        && k_bkte.dims() == [b, k, s, e]
        && v_bkte.dims() == [b, k, s, e]
        && let Some(out) = super::torch::attention(&q_bhse, &k_bkte, &v_bkte, scale)
    {
        return out;
    }
    let g = h / k.max(1);
    causal_attention(q_bhse.reshape([b, k, g * s, e]), k_bkte, v_bkte, scale, s, start)
}

/// The sizes of one attention call.
#[derive(Clone, Copy, Debug)]
struct Geometry {
    b: usize,
    kv: usize,
    g: usize,
    s: usize,
    t: usize,
    e: usize,
    start: usize,
    scale: f32,
}

/// One block of rows: query head `j` of its kv head, positions `p0..p1`, which see at most the
/// first `keys` keys.
struct Block {
    j: usize,
    p0: usize,
    rows: usize,
    keys: usize,
}

impl Geometry {
    fn heads(&self) -> usize {
        self.kv * self.g
    }

    /// Keys position `p` sees.
    fn visible(&self, p: usize) -> usize {
        (self.start + p + 1).min(self.t)
    }

    fn blocks(&self) -> impl Iterator<Item = Block> + '_ {
        (0..self.g).flat_map(move |j| {
            (0..self.s).step_by(BLOCK).map(move |p0| {
                let rows = BLOCK.min(self.s - p0);
                Block { j, p0, rows, keys: self.visible(p0 + rows - 1) }
            })
        })
    }

    /// Offset in `[b, s, h * e]` of the first value of block `blk` of task `(bi, ki)`; rows are
    /// `h * e` apart.
    fn out_offset(&self, bi: usize, ki: usize, blk: &Block) -> usize {
        ((bi * self.s + blk.p0) * self.heads() + ki * self.g + blk.j) * self.e
    }

    /// The output `[b, s, h * e]` and the probabilities `[b, k, g * s, t]` (zero where masked).
    fn forward(&self, q: &[f32], k: &[f32], v: &[f32]) -> (Vec<f32>, FlexTensor) {
        let Geometry { b, kv, g, s, t, e, .. } = *self;
        let (r, h) = (g * s, self.heads());
        assert!(q.len() == b * kv * r * e && k.len() == b * kv * t * e && v.len() == k.len(), "attention operand sizes");
        let mut out = vec![0f32; b * s * h * e];
        let mut probs = vec![0f32; b * kv * r * t];
        let out_ptr = SharedOut(out.as_mut_ptr(), out.len());
        probs.par_chunks_mut(r * t).enumerate().for_each(|(task, p)| {
            let (bi, ki) = (task / kv, task % kv);
            let (q, k, v) = (&q[task * r * e..][..r * e], &k[task * t * e..][..t * e], &v[task * t * e..][..t * e]);
            for blk in self.blocks() {
                let row0 = blk.j * s + blk.p0;
                // Scaled scores of the visible keys, in place in the probabilities' rows.
                let p_blk = &mut p[row0 * t..];
                product(p_blk, t, false, Mat::of(&q[row0 * e..], e, 1), Mat::of(k, 1, e), blk.rows, blk.keys, e, self.scale);
                for (i, row) in p_blk.chunks_mut(t).take(blk.rows).enumerate() {
                    let seen = self.visible(blk.p0 + i);
                    softmax_row(&mut row[..seen]);
                    row[seen..blk.keys].fill(0.0);
                }
                // This block's output rows, in their place in [b, s, h * e].
                let p_blk = &p[row0 * t..];
                // SAFETY: task (bi, ki) alone writes the heads of kv head ki at batch bi, and
                // `gemm_into` checks the block lies inside the buffer.
                unsafe {
                    out_ptr.gemm_into(self.out_offset(bi, ki, &blk), h * e, Mat::of(p_blk, t, 1), Mat::of(v, e, 1), blk.rows, e, blk.keys);
                }
            }
        });
        (out, flex(probs, [b, kv, r, t]))
    }
}

/// The output buffer, written by many tasks at places no two share.
#[derive(Clone, Copy)]
struct SharedOut(*mut f32, usize);

// SAFETY: the tasks that share it write disjoint elements (see its uses).
unsafe impl Send for SharedOut {}
// SAFETY: as for `Send`: no two tasks touch the same element, and none reads another's.
unsafe impl Sync for SharedOut {}

impl SharedOut {
    /// `out[offset..]` at row stride `rs` = `lhs * rhs` (`m x n`, inner size `k`).
    ///
    /// # Safety
    /// No other task may access these elements during the call.
    #[allow(clippy::too_many_arguments)]
    unsafe fn gemm_into(self, offset: usize, rs: usize, lhs: Mat, rhs: Mat, m: usize, n: usize, k: usize) {
        lhs.check(m, k);
        rhs.check(k, n);
        assert!(m == 0 || n == 0 || offset + (m - 1) * rs + n <= self.1, "output block out of bounds");
        if m == 0 || n == 0 {
            return;
        }
        // SAFETY: inside the buffer (checked above); exclusive by the caller's contract.
        unsafe { gemm_raw(self.0.add(offset), rs, false, lhs, rhs, [m, n, k], 1.0, ::gemm::Parallelism::None) }
    }
}

/// The attention node: kept are `q`, `k`, `v` and the probabilities.
#[derive(Debug)]
struct AttentionBackward(Geometry);

impl Backward<Flex, 3> for AttentionBackward {
    type State = (FlexTensor, FlexTensor, FlexTensor, FlexTensor);

    fn backward(self, ops: Ops<Self::State, 3>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [to_q, to_k, to_v] = ops.parents;
        let (q, k, v, probs) = ops.state;
        let dout = contiguous(grads.consume::<Flex>(&ops.node));
        let geo = self.0;
        let Geometry { b, kv, g, s, t, e, .. } = geo;
        let (r, h) = (g * s, geo.heads());
        let (qv, kv_, vv, pv, dov) = (values(&q), values(&k), values(&v), values(&probs), values(&dout));
        let (mut dq, mut dk, mut dv) = (vec![0f32; b * kv * r * e], vec![0f32; b * kv * t * e], vec![0f32; b * kv * t * e]);
        dq.par_chunks_mut(r * e).zip(dk.par_chunks_mut(t * e)).zip(dv.par_chunks_mut(t * e)).enumerate().for_each(
            |(task, ((dq, dk), dv))| {
                let (bi, ki) = (task / kv, task % kv);
                let (q, k, v, p) = (
                    &qv[task * r * e..][..r * e],
                    &kv_[task * t * e..][..t * e],
                    &vv[task * t * e..][..t * e],
                    &pv[task * r * t..][..r * t],
                );
                // The gradient of one block's probabilities, then of its scores, [rows, keys].
                let mut ds = vec![0f32; BLOCK * t];
                for blk in geo.blocks() {
                    let (row0, n) = (blk.j * s + blk.p0, blk.keys);
                    let p_blk = Mat::of(&p[row0 * t..], t, 1);
                    let do_blk = Mat::of(&dov[geo.out_offset(bi, ki, &blk)..], h * e, 1);
                    // dP = dO v^T.
                    product(&mut ds, n, false, do_blk, Mat::of(v, e, 1).t(), blk.rows, n, e, 1.0);
                    // dS = P * (dP - sum(dP * P)) per row (the scale goes into the products
                    // below); masked keys have P = 0, so dS = 0 there.
                    for (i, d) in ds.chunks_mut(n).take(blk.rows).enumerate() {
                        let y = &p[(row0 + i) * t..][..n];
                        let dot = lane_dot(d, y);
                        d.iter_mut().zip(y).for_each(|(d, &y)| *d = y * (*d - dot));
                    }
                    let ds_blk = Mat::of(&ds, n, 1);
                    // dq = scale dS k; dk += scale dS^T q; dv += P^T dO.
                    product(&mut dq[row0 * e..], e, false, ds_blk, Mat::of(k, e, 1), blk.rows, e, n, geo.scale);
                    product(dk, e, true, ds_blk.t(), Mat::of(&q[row0 * e..], e, 1), n, e, blk.rows, geo.scale);
                    product(dv, e, true, p_blk.t(), do_blk, n, e, blk.rows, 1.0);
                }
            },
        );
        for (node, grad, shape) in [(to_q, dq, [b, kv, r, e]), (to_k, dk, [b, kv, t, e]), (to_v, dv, [b, kv, t, e])] {
            if let Some(node) = node {
                grads.register::<Flex>(node.id, flex(grad, shape));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::tensor::activation::softmax;
    use burn::tensor::{Device, Distribution};
    use std::cell::Cell;

    thread_local! {
        /// Fused attention nodes built on this thread (each test runs on its own thread, and
        /// the node is built on the caller's).
        pub(super) static FUSED: Cell<usize> = const { Cell::new(0) };
    }

    /// The reference, written out with Burn's ops alone: scaled scores, an additive causal mask,
    /// Burn's softmax, the product with `v`, the heads side by side.
    fn reference(q: Tensor<4>, k: Tensor<4>, v: Tensor<4>, scale: f64, s: usize, start: usize) -> Tensor<3> {
        let [b, kv, r, e] = q.dims();
        let (t, g) = (k.dims()[2], r / s);
        let mask: Vec<f32> = (0..r * t).map(|i| if i % t <= start + (i / t) % s { 0.0 } else { -1e30 }).collect();
        let mask = Tensor::<4>::from_data(TensorData::new(mask, [1, 1, r, t]), &q.device());
        let probs = softmax(q.matmul(k.swap_dims(2, 3)).mul_scalar(scale) + mask, 3);
        probs.matmul(v).reshape([b, kv * g, s, e]).swap_dims(1, 2).reshape([b, s, kv * g * e])
    }

    type Attend = fn(Tensor<4>, Tensor<4>, Tensor<4>, f64, usize, usize) -> Tensor<3>;

    /// The value of `f` and the gradients of `sum(f * w)` for the inputs marked in `track`
    /// (fresh leaves holding `inputs`).
    fn value_and_grads(
        f: Attend,
        inputs: &[Tensor<4>; 3],
        w: &Tensor<3>,
        track: [bool; 3],
        s: usize,
        start: usize,
    ) -> (Vec<f32>, Vec<Option<Vec<f32>>>) {
        let leaves: Vec<Tensor<4>> = inputs
            .iter()
            .zip(track)
            .map(|(x, on)| {
                let x = Tensor::<4>::from_data(x.to_data(), &x.device());
                if on { x.require_grad() } else { x }
            })
            .collect();
        let y = f(leaves[0].clone(), leaves[1].clone(), leaves[2].clone(), 0.37, s, start);
        let value = y.to_data().try_into_vec::<f32>().unwrap();
        let grads = (y * w.clone()).sum().backward();
        let g = leaves
            .iter()
            .zip(track)
            .map(|(x, on)| on.then(|| x.grad(&grads).unwrap().into_data().try_into_vec::<f32>().unwrap()))
            .collect();
        (value, g)
    }

    /// Each of `a` within 1e-5 of `b`, relative to `b`'s largest magnitude.
    fn close(a: &[f32], b: &[f32], what: &str) {
        assert_eq!(a.len(), b.len(), "{what}: lengths");
        let big = b.iter().fold(0f32, |m, y| m.max(y.abs())).max(1e-3);
        for (i, (x, y)) in a.iter().zip(b).enumerate() {
            assert!((x - y).abs() <= 1e-5 * big, "{what}[{i}]: {x} vs {y}");
        }
    }

    fn inputs(device: &Device, b: usize, kv: usize, g: usize, s: usize, e: usize, start: usize) -> [Tensor<4>; 3] {
        let t = start + s;
        [
            Tensor::random([b, kv, g * s, e], Distribution::Normal(0.0, 1.5), device),
            Tensor::random([b, kv, t, e], Distribution::Normal(0.0, 1.5), device),
            Tensor::random([b, kv, t, e], Distribution::Normal(0.0, 1.0), device),
        ]
    }

    #[test]
    fn the_fused_attention_equals_burns_ops_in_value_and_every_gradient() {
        // (b, kv heads, query heads per kv head, s, e, start): odd sizes, several row blocks
        // (s > 64, and one position past a block), a KV cache under autodiff.
        // The last two: several blocks with a cache, and the head size of the real shapes.
        let cases = [
            (1, 1, 1, 1, 1, 0),
            (2, 3, 2, 7, 5, 0),
            (1, 2, 3, 70, 8, 0),
            (2, 1, 4, 65, 3, 0),
            (1, 2, 2, 9, 4, 30),
            (1, 1, 2, 130, 16, 0),
            (1, 2, 2, 70, 4, 10),
            (1, 2, 2, 20, 64, 0),
        ];
        for (n, &(b, kv, g, s, e, start)) in cases.iter().enumerate() {
            for (d, device) in [Device::flex().autodiff(), Device::flex().autodiff().gradient_checkpointing()].into_iter().enumerate() {
                device.seed(70 + n as u64);
                let x = inputs(&device, b, kv, g, s, e, start);
                let w: Tensor<3> = Tensor::random([b, s, kv * g * e], Distribution::Normal(0.0, 1.0), &device);
                for track in [[true; 3], [true, false, false], [false, true, true]] {
                    let before = FUSED.with(Cell::get);
                    let (va, ga) = value_and_grads(causal_attention, &x, &w, track, s, start);
                    // Fused under plain autodiff; Burn's ops under checkpointing.
                    assert_eq!(FUSED.with(Cell::get) - before, usize::from(d == 0), "device {d}: which path ran");
                    let (vr, gr) = value_and_grads(reference, &x, &w, track, s, start);
                    let case = format!("b{b} kv{kv} g{g} s{s} e{e} start{start} device {d} {track:?}");
                    close(&va, &vr, &format!("{case}: value"));
                    for (i, (a, r)) in ga.iter().zip(&gr).enumerate() {
                        if let (Some(a), Some(r)) = (a, r) {
                            close(a, r, &format!("{case}: gradient of input {i}"));
                        }
                    }
                }
            }
            // Without autodiff (generation), the value alone.
            let plain = Device::flex();
            plain.seed(90 + n as u64);
            let [q, k, v] = inputs(&plain, b, kv, g, s, e, start);
            let a = causal_attention(q.clone(), k.clone(), v.clone(), 0.37, s, start).into_data().try_into_vec::<f32>().unwrap();
            let r = reference(q, k, v, 0.37, s, start).into_data().try_into_vec::<f32>().unwrap();
            close(&a, &r, "without autodiff");
        }
    }

    #[test]
    fn kv_heads_split_over_two_shards_give_the_unsplit_attention_and_gradients() {
        // Tensor parallelism gives each rank whole kv heads with their query heads: the shards'
        // outputs side by side, and their inputs' gradients stacked, are the unsplit ones.
        let (b, kv, g, s, e) = (2, 4, 2, 67, 6);
        let device = Device::flex().autodiff();
        device.seed(5);
        let x = inputs(&device, b, kv, g, s, e, 0);
        let w: Tensor<3> = Tensor::random([b, s, kv * g * e], Distribution::Normal(0.0, 1.0), &device);
        let (full, full_grads) = value_and_grads(causal_attention, &x, &w, [true; 3], s, 0);
        let half = kv / 2;
        let mut outs = Vec::new();
        let mut grads: Vec<Vec<Tensor<4>>> = vec![Vec::new(); 3];
        for shard in 0..2 {
            let part = |t: &Tensor<4>| Tensor::<4>::from_data(t.clone().narrow(1, shard * half, half).to_data(), &device);
            let xs = [part(&x[0]), part(&x[1]), part(&x[2])];
            let ws = w.clone().narrow(2, shard * half * g * e, half * g * e);
            let (out, g_s) = value_and_grads(causal_attention, &xs, &ws, [true; 3], s, 0);
            outs.push(Tensor::<3>::from_data(TensorData::new(out, [b, s, half * g * e]), &device));
            for (i, gi) in g_s.into_iter().enumerate() {
                grads[i].push(Tensor::<4>::from_data(TensorData::new(gi.unwrap(), xs[i].dims()), &device));
            }
        }
        close(&Tensor::cat(outs, 2).into_data().try_into_vec::<f32>().unwrap(), &full, "output");
        for (i, parts) in grads.into_iter().enumerate() {
            let joined = Tensor::cat(parts, 1).into_data().try_into_vec::<f32>().unwrap();
            close(&joined, full_grads[i].as_ref().unwrap(), &format!("gradient of input {i}"));
        }
    }
}
