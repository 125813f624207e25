//! Rotary position embedding as one custom operation whose backward applies the inverse
//! rotation.

use burn::tensor::{Tensor, TensorData};
use rayon::prelude::*;

use super::glue::*;
use super::rows::*;

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
        let (c, sn): (Tensor<4>, Tensor<4>) = (cos.clone().cast(x.dtype()).unsqueeze(), sin.clone().cast(x.dtype()).unsqueeze());
        x * c + rotated * sn
    };
    let device = x.device();
    let shape = x.dims();
    let [_, _, s, e] = shape;
    #[cfg(feature = "tch")]
    if e % 2 == 0
        && cos.dims() == [s, e]
        && sin.dims() == [s, e]
        && let Some(y) = super::torch::rope(&x, cos, sin)
    {
        return y;
    }
    if !fusable(&x) || e % 2 != 0 || shape.contains(&0) || cos.dims() != [s, e] || sin.dims() != [s, e] {
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
pub(super) type RowRotation = fn(&mut [f32], &[f32], &[f32], &[f32]);

/// `row` applied to each row of `e` values of `input`, with the cos and sin tables (`[2, s, e]`)
/// of the row's position (row index modulo `s`), in parallel over rows.
pub(super) fn rotate_rows(input: &[f32], tables: &[f32], s: usize, e: usize, row: RowRotation) -> Vec<f32> {
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
pub(super) fn rotate(y: &mut [f32], x: &[f32], c: &[f32], s: &[f32]) {
    let h = x.len() / 2;
    for j in 0..h {
        y[j] = x[j] * c[j] - x[j + h] * s[j];
        y[j + h] = x[j + h] * c[j + h] + x[j] * s[j + h];
    }
}

/// One row of [`rope`]'s backward pass: `dx_j = dy_j c_j + dy_(j+h) s_(j+h)` in the first half,
/// `dx_j = dy_j c_j - dy_(j-h) s_(j-h)` in the second.
pub(super) fn rotate_back(dx: &mut [f32], dy: &[f32], c: &[f32], s: &[f32]) {
    let h = dy.len() / 2;
    for j in 0..h {
        dx[j] = dy[j] * c[j] + dy[j + h] * s[j + h];
        dx[j + h] = dy[j + h] * c[j + h] - dy[j] * s[j];
    }
}
