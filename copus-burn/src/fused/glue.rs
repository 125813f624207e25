//! What every custom operation shares: a tensor's host values, the Flex-under-autodiff
//! backend they run on, contiguous f32 buffers, and registering one operation with its
//! hand-written backward in Burn's autodiff graph.

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::NoCheckpointing;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, NodeGuard, Ops, OpsKind, unary};
use burn::backend::flex::FlexTensor;
use burn::backend::{Autodiff, Flex};
use burn::tensor::{DType, Device, Tensor, TensorData};

/// A float tensor's values as f32 on the host, without its autodiff graph.
pub(super) fn host_values<const D: usize>(t: &Tensor<D>) -> Vec<f32> {
    t.clone().inner().into_data().convert::<f32>().try_into_vec::<f32>().expect("f32 values")
}

/// Whether tensors on `device` live in host memory, where the fused kernels read them without a
/// transfer.
pub(super) fn on_host(device: &Device) -> bool {
    device.clone().inner() == Device::flex()
}

/// Whether the fused host kernels take `x`: an f32 tensor on Flex. Other element types (bf16
/// under mixed precision) take the decomposed forms, which keep their type.
pub(super) fn fusable<const D: usize>(x: &Tensor<D>) -> bool {
    x.dtype() == DType::F32 && on_host(&x.device())
}

/// Flex under autodiff without gradient checkpointing: the backend of the custom operations.
pub(super) type Ad = Autodiff<Flex, NoCheckpointing>;

/// The backward pass of a custom operation: from what the forward pass kept, the gradient of
/// the output and the operation's scalar parameter, the gradient of the input (written over
/// either, where it holds its buffer alone).
pub(super) type HostGrad = fn(FlexTensor, FlexTensor, f32) -> FlexTensor;

/// A custom operation's node in the autodiff graph: its backward pass and scalar parameter.
#[derive(Debug)]
pub(super) struct HostBackward(HostGrad, f32);

impl Backward<Flex, 1> for HostBackward {
    type State = FlexTensor;

    fn backward(self, ops: Ops<FlexTensor, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let kept = ops.state;
        unary::<Flex, _>(ops.parents, ops.node, grads, |grad| (self.0)(kept, grad, self.1));
    }
}

/// A tensor's values in one contiguous f32 slice: itself, or a contiguous copy.
pub(super) fn contiguous(t: FlexTensor) -> FlexTensor {
    if t.as_slice::<f32>().is_some() { t } else { t.to_contiguous() }
}

/// A contiguous f32 tensor's values to overwrite: in its own buffer when it holds that alone,
/// else in a copy.
pub(super) fn values_mut(t: &mut FlexTensor) -> &mut [f32] {
    let (start, end) = t.layout().contiguous_offsets().expect("contiguous");
    &mut t.storage_mut::<f32>()[start..end]
}

/// A contiguous f32 tensor's values.
pub(super) fn values(x: &FlexTensor) -> &[f32] {
    x.as_slice::<f32>().expect("contiguous f32")
}

/// A Flex tensor of `shape` holding `values`.
pub(super) fn flex(values: Vec<f32>, shape: impl Into<burn::tensor::Shape>) -> FlexTensor {
    FlexTensor::from_data(TensorData::new(values, shape.into()))
}

/// Runs a custom operation on `x`, tracked by autodiff: `forward` maps the input's values to the
/// output and what `backward` needs. Gives `x` back when it is not a tracked f32 tensor of
/// [`Ad`].
// A tensor handle by value, as Burn passes them; boxing it would only add an allocation.
#[allow(clippy::result_large_err)]
pub(super) fn custom_op<const D: usize, const E: usize>(
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
    super::glue::CUSTOM_OPS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    Ok(Tensor::from_primitive::<Ad>(out))
}

/// An input of a custom operation: its values as a contiguous Flex tensor and its node in the
/// autodiff graph, or `None` unless it is an f32 tensor of [`Ad`].
pub(super) fn ad_parts<const D: usize>(x: &Tensor<D>) -> Option<(FlexTensor, NodeGuard)> {
    let ad = x.clone().try_into_primitive::<Ad>().ok()?;
    (ad.primitive().dtype() == DType::F32).then(|| {
        let (p, node) = ad.into_parts();
        (contiguous(p), node)
    })
}

/// The inputs of a two-input custom operation ([`ad_parts`] of each), or `None` unless both
/// are f32 tensors of [`Ad`].
pub(super) fn binary_parts<const D: usize, const E: usize>(a: &Tensor<D>, b: &Tensor<E>) -> Option<[(FlexTensor, NodeGuard); 2]> {
    Some([ad_parts(a)?, ad_parts(b)?])
}

/// Custom operations built so far (all tests of this process).
#[cfg(test)]
pub(crate) static CUSTOM_OPS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
