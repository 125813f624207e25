//! The summed softmax cross entropy as one custom operation, and its decomposed and
//! `log_softmax` forms (what runs elsewhere, and the reference it is tested against).

use burn::tensor::{Int, Tensor, TensorData};
use rayon::prelude::*;

use super::activation::CHUNK;
use super::glue::*;
use super::rows::*;

/// `-sum log softmax(logits)[target]` over all positions, `[1]`, fused (see the module docs).
/// On devices other than Flex it takes the decomposed form, which keeps the logits on the device.
///
/// # Panics
/// If a target id is outside the vocabulary, like the gather of the decomposed form.
pub fn cross_entropy_sum(logits_bsv: Tensor<3>, targets_bs: Tensor<2, Int>) -> Tensor<1> {
    let device = logits_bsv.device();
    #[cfg(feature = "tch")]
    if let Some(loss) = super::torch::cross_entropy_sum(&logits_bsv, &targets_bs) {
        return loss;
    }
    if !fusable(&logits_bsv) {
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

/// The loss as `sum(logsumexp(logits)) - sum(logits[target])` in tensor ops, with the max used
/// for stability detached (the shift cancels in value and gradient).
pub(crate) fn cross_entropy_sum_decomposed(logits_bsv: Tensor<3>, targets_bs: Tensor<2, Int>) -> Tensor<1> {
    let max_bs1 = logits_bsv.clone().detach().max_dim(2);
    let lse_bs1 = (logits_bsv.clone() - max_bs1.clone()).exp().sum_dim(2).log() + max_bs1;
    let picked_bs1 = logits_bsv.gather(2, targets_bs.unsqueeze_dim::<3>(2));
    lse_bs1.sum() - picked_bs1.sum()
}

/// The same loss through `log_softmax`: the reference the fused form is tested against.
#[cfg(test)]
pub(crate) fn cross_entropy_sum_reference(logits_bsv: Tensor<3>, targets_bs: Tensor<2, Int>) -> Tensor<1> {
    burn::tensor::activation::log_softmax(logits_bsv, 2).gather(2, targets_bs.unsqueeze_dim::<3>(2)).sum().neg()
}
