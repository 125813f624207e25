//! SiLU and SwiGLU (`silu(gate) * up`) as custom operations.

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

/// Chunk of element-wise host kernels per parallel task.
pub(super) const CHUNK: usize = 1 << 14;

/// SiLU `x * sigmoid(x)`, fused on Flex (see the module docs): the forward pass keeps
/// `silu'(x)`, so the backward pass is one multiply. Elsewhere Burn's `silu`.
pub fn silu<const D: usize>(x: Tensor<D>) -> Tensor<D> {
    let device = x.device();
    if !fusable(&x) {
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
    #[cfg(feature = "tch")]
    if up.dims() == shape
        && up.dtype() == gate.dtype()
        && let Some(y) = super::torch::swiglu(&gate, &up)
    {
        return y;
    }
    if !fusable(&gate) || up.dims() != shape || up.dtype() != gate.dtype() {
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
        super::glue::CUSTOM_OPS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
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
pub(super) struct SwigluBackward;

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

/// `1 / (1 + e^-x)` with [`exp`].
#[inline(always)]
fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + exp(-x))
}
