//! RMSNorm as one custom operation, with the gradients of the input and of the weight in one
//! backward pass.

use burn::backend::Flex;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::NoCheckpointing;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::flex::FlexTensor;
use burn::tensor::{Tensor, TensorData};
use rayon::prelude::*;

use super::glue::*;
use super::rows::*;

/// RMSNorm over the last dimension, `x / sqrt(mean(x^2) + eps) * weight`, fused on Flex: one
/// host pass forward, keeping each row's `1 / rms`, and one backward pass for each input that
/// takes a gradient. Elsewhere (other devices, checkpointing) the decomposed form.
pub fn rms_norm<const D: usize>(x: Tensor<D>, weight: Tensor<1>, eps: f64) -> Tensor<D> {
    let decomposed = |x: Tensor<D>, weight: Tensor<1>| {
        let rms = (x.clone().square().mean_dim(D - 1) + eps).sqrt();
        let weight = weight.cast(x.dtype());
        (x / rms) * weight.unsqueeze()
    };
    let device = x.device();
    let shape = x.dims();
    let d = shape[D - 1];
    #[cfg(feature = "tch")]
    if d > 0
        && weight.dims() == [d]
        && let Some(y) = super::torch::rms_norm(&x, &weight, eps)
    {
        return y;
    }
    if !fusable(&x) || d == 0 || shape.contains(&0) || weight.dims() != [d] {
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
        super::glue::CUSTOM_OPS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
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
pub(super) struct RmsBackward;

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
