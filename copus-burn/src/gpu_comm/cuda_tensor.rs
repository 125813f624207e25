//! Burn CUDA tensors to device pointers: the in-place all-reduce of a tensor's memory, without
//! a host copy (features `nccl` and `cuda`).

use burn::backend::Cuda;
use burn::cubecl::Device as CubeDevice;
use burn::cubecl::cuda::CudaRuntime;
use burn::tensor::{DType, Tensor};
use cubecl_runtime::runtime::Runtime;

use crate::collective::CommError;

type CudaServer = <CudaRuntime as Runtime>::Server;

/// Runs `reduce` (a collective in place on the device address and element count it is given)
/// on a flat f32 tensor on CUDA `device`, and returns the tensor; `Ok(Err(t))` gives back a
/// tensor of another backend untouched. The NCCL communicator's all-reduce
/// ([`super::cuda_all_reduce`], and the engine's tensor all-reduce) comes through here.
pub(super) fn in_place(
    device: usize,
    flat: Tensor<1>,
    reduce: impl FnOnce(u64, usize) -> Result<(), String>,
) -> Result<Result<Tensor<1>, Tensor<1>>, CommError> {
    let n = flat.dims()[0];
    let burn_device = flat.device();
    // A handle kept to give the tensor back; dropped before the buffer is asked to be unique.
    let keep = flat.clone();
    let Ok(mut cube) = flat.try_into_primitive::<Cuda>() else { return Ok(Err(keep)) };
    drop(keep);
    let CubeDevice::Cuda(cuda) = &cube.device else {
        return Err(CommError::Invalid("the tensor is on a CubeCL device that is not CUDA".into()));
    };
    if cuda.index != device {
        return Err(CommError::Invalid(format!("the tensor is on CUDA device {}, the communicator on {device}", cuda.index)));
    }
    if cube.dtype != DType::F32 {
        return Err(CommError::Invalid(format!("NCCL tensors here are f32, not {:?}", cube.dtype)));
    }
    if !cube.is_contiguous() {
        return Err(CommError::Invalid("the flattened tensor is not contiguous".into()));
    }
    if !cube.can_mut() {
        // Another tensor shares the buffer: reduce a copy.
        cube = cube.copy();
    }
    // Holds the allocation in place; the pointer includes the view's offset.
    let resource = cube
        .client
        .get_resource::<CudaServer>(cube.handle.clone())
        .map_err(|e| CommError::Invalid(format!("the tensor's CUDA buffer: {e:?}")))?;
    let ptr = resource.resource().ptr;
    // After resolving the buffer: wait for Burn's kernels that write it.
    burn_device.sync().map_err(|e| CommError::Invalid(format!("waiting for Burn's CUDA work: {e:?}")))?;
    reduce(ptr, n).map_err(|e| CommError::Invalid(format!("NCCL: {e}")))?;
    drop(resource);
    Ok(Ok(Tensor::<1>::from_primitive::<Cuda>(cube)))
}
