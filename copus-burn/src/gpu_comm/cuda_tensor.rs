//! Burn CUDA tensors to device pointers: the in-place all-reduce of a tensor's memory, without
//! a host copy (features `nccl` and `cuda`).

use burn::backend::Cuda;
use burn::cubecl::Device as CubeDevice;
use burn::cubecl::cuda::CudaRuntime;
use burn::tensor::{DType, Tensor};
use cubecl_runtime::runtime::Runtime;

use super::NcclComm;
use super::nccl::Nccl;
use crate::collective::{CommError, ReduceOp};

type CudaServer = <CudaRuntime as Runtime>::Server;

/// All-reduces a float tensor on a CUDA device in place across `comm`'s group: NCCL reads
/// and writes the tensor's device memory directly. Returns the reduced tensor (the input
/// is flattened, and copied when it was not contiguous or shared its buffer). The engine's
/// ranks reach it through [`crate::collective::Collective::all_reduce_tensor`].
pub fn all_reduce<const D: usize>(comm: &NcclComm, t: Tensor<D>, op: ReduceOp) -> Result<Tensor<D>, CommError> {
    let dims = t.dims();
    let n: usize = dims.iter().product();
    let was_autodiff = t.is_autodiff();
    // Rank 1 is never padded; the reshape is a view when the tensor is contiguous.
    let flat: Tensor<1> = t.inner().reshape([n]);
    match in_place(&comm.lib, comm.device, flat, op)? {
        Ok(out) => {
            let out = out.reshape(dims);
            Ok(if was_autodiff { out.autodiff() } else { out })
        }
        Err(_) => Err(CommError::Invalid("the tensor is not on a CUDA device of Burn's CubeCL backend".into())),
    }
}

/// [`all_reduce`] of a flat tensor on `nccl`'s `device`; `Ok(Err(t))` gives back a tensor of
/// another backend untouched.
pub(super) fn in_place(nccl: &Nccl, device: usize, flat: Tensor<1>, op: ReduceOp) -> Result<Result<Tensor<1>, Tensor<1>>, CommError> {
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
    nccl.all_reduce_device(ptr, n, op).map_err(|e| CommError::Invalid(format!("NCCL: {e}")))?;
    drop(resource);
    Ok(Ok(Tensor::<1>::from_primitive::<Cuda>(cube)))
}
