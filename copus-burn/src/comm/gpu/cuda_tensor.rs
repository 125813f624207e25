//! Burn CUDA tensors to device pointers: the in-place all-reduce of a tensor's memory, without
//! a host copy (features `nccl` and `cuda`). Under Burn's kernel fusion (feature `fusion`) a
//! CUDA tensor is a fusion handle: its queued work runs and its CubeCL tensor is taken out of
//! the fusion server first, and the reduced tensor is registered with it again after.

use burn::backend::Cuda;
use burn::cubecl::Device as CubeDevice;
use burn::cubecl::cuda::CudaRuntime;
use burn::tensor::{DType, Tensor};
use cubecl_runtime::runtime::Runtime;

use crate::comm::CommError;

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
    let Ok(primitive) = flat.try_into_primitive::<Cuda>() else { return Ok(Err(keep)) };
    drop(keep);
    let mut cube = fusion::resolve(primitive);
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
    Ok(Ok(Tensor::<1>::from_primitive::<Cuda>(fusion::register(cube))))
}

/// Burn's `Cuda` primitive to and from the CubeCL tensor: the same tensor without fusion.
#[cfg(not(feature = "fusion"))]
mod fusion {
    use burn::backend::Cuda;
    use burn::backend::tensor::FloatTensor;

    pub(super) fn resolve(t: FloatTensor<Cuda>) -> FloatTensor<Cuda> {
        t
    }

    pub(super) fn register(t: FloatTensor<Cuda>) -> FloatTensor<Cuda> {
        t
    }
}

/// Burn's `Cuda` primitive (a fusion handle) to and from the CubeCL tensor under it.
#[cfg(feature = "fusion")]
mod fusion {
    use burn::backend::Cuda;
    use burn::backend::fusion::custom::{OperationIr, OperationOutput, StreamId};
    use burn::backend::fusion::{NoOp, get_client};
    use burn::backend::ir::{BackendIr, InitOperationIr};
    use burn::backend::tensor::FloatTensor;
    use burn_cubecl::CubeBackend;

    type Cube = FloatTensor<CubeBackend>;

    /// Runs the fusion stream's queued work on the tensor and takes its CubeCL tensor out (with
    /// its buffer alone where no other handle shares it).
    pub(super) fn resolve(t: FloatTensor<Cuda>) -> Cube {
        let client = t.client.clone();
        client.resolve_tensor_float::<CubeBackend>(t)
    }

    /// Registers a CubeCL tensor with the fusion server of its device, as Burn registers a
    /// tensor made from data.
    pub(super) fn register(cube: Cube) -> FloatTensor<Cuda> {
        let client = get_client::<CubeBackend>(&cube.device);
        let (shape, dtype) = (burn::backend::TensorMetadata::shape(&cube), cube.dtype);
        let handle = CubeBackend::float_tensor_handle(cube);
        let desc = InitOperationIr::create(shape, dtype, || client.register_tensor_handle(handle));
        client.register(StreamId::current(), OperationIr::Init(desc), NoOp::<CubeBackend>::new()).output()
    }
}
