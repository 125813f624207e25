//! Softmax over the last dimension, and causal softmax of scaled attention scores with the
//! scale and the mask folded in.

use burn::tensor::{Device, Int, Tensor, TensorData};
use rayon::prelude::*;

use super::glue::*;
use super::rows::*;

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
pub(super) fn visible(row: usize, rows: usize, keys: usize, causal: Option<(usize, usize)>) -> usize {
    causal.map_or(keys, |(s, start)| (start + (row % rows) % s.max(1) + 1).min(keys))
}

/// [`softmax`] and [`causal_softmax`]: rows of the last dimension, scaled, the keys past each
/// row's visible ones (if `causal`) given probability 0.
pub(super) fn masked_softmax<const D: usize>(x: Tensor<D>, scale: f64, causal: Option<(usize, usize)>) -> Tensor<D> {
    let device = x.device();
    let last = D - 1;
    let decomposed = |x: Tensor<D>| {
        let x = if scale == 1.0 { x } else { x.mul_scalar(scale) };
        let x = match causal {
            Some((s, start)) => {
                let mask = causal_mask::<D>(x.dims(), s, start, &x.device()).cast(x.dtype());
                x + mask
            }
            None => x,
        };
        burn::tensor::activation::softmax(x, last)
    };
    if !fusable(&x) {
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
/// broadcast over the leading dimensions. Built on `device` from two [`index_range`]s (row `r`
/// sees keys `k <= start + r % s`), which are uploaded once and kept, so nothing is uploaded
/// per call.
pub(super) fn causal_mask<const D: usize>(shape: [usize; D], s: usize, start: usize, device: &Device) -> Tensor<D> {
    let (rows, keys) = (if D >= 2 { shape[D - 2] } else { 1 }, shape[D - 1]);
    let last_seen =
        index_range(rows, device).remainder_scalar(s.max(1) as i64).add_scalar(start as i64).reshape([rows, 1]).expand([rows, keys]);
    let key = index_range(keys, device).reshape([1, keys]).expand([rows, keys]);
    let mask = Tensor::<2>::zeros([rows, keys], device).mask_fill(key.greater(last_seen), -1e30);
    let mut mask_shape = [1; D];
    mask_shape[D - 1] = keys;
    if D >= 2 {
        mask_shape[D - 2] = rows;
    }
    mask.reshape(mask_shape)
}

/// `0, 1, .., n - 1` on `device`: a view of a range uploaded once per thread and device (counted
/// as [`Kind::Constants`](crate::traffic::Kind::Constants)) and kept, uploaded again, twice as
/// long, only when a longer one is asked for (a decoder's growing keys), so a steady step
/// uploads none. Burn's `arange` uploads its range with every call on backends that do not
/// override it (CubeCL's wgpu and CUDA without fusion), and a running sum of ones on the device
/// costs `n^2 / 2` additions there (CubeCL's cumulative sum), too many for a vocabulary slice.
/// Per thread, because a rank thread's fused operations run on a stream of its own (a thread
/// that mixes autodiff checkpointing strategies on one device should not share a range
/// between them).
pub(crate) fn index_range(n: usize, device: &Device) -> Tensor<1, Int> {
    thread_local! {
        static RANGES: std::cell::RefCell<Vec<(Device, Tensor<1, Int>)>> = const { std::cell::RefCell::new(Vec::new()) };
    }
    if n == 0 {
        // As Burn's `arange(0..0)`.
        return Tensor::from_data(TensorData::new(Vec::<i64>::new(), [0]), device);
    }
    RANGES.with(|ranges| {
        let mut ranges = ranges.borrow_mut();
        let at = ranges.iter().position(|(d, _)| d == device);
        let have = at.map_or(0, |i| ranges[i].1.dims()[0]);
        if have < n {
            let len = n.max(2 * have);
            let data = TensorData::new((0..len as i64).collect::<Vec<_>>(), [len]);
            let t = crate::traffic::upload(data, device, crate::traffic::Kind::Constants);
            match at {
                Some(i) => ranges[i].1 = t,
                None => ranges.push((device.clone(), t)),
            }
        }
        let (_, t) = ranges.iter().find(|(d, _)| d == device).expect("a range for the device");
        if n == t.dims()[0] { t.clone() } else { t.clone().narrow(0, 0, n) }
    })
}
