//! LibTorch tensors' memory for a collective library that reads and writes device addresses
//! (NCCL, through `gpu_comm` with features `nccl` and `tch`): the input's address and a fresh
//! output's, with LibTorch's queued work on the device finished first. The collective writes
//! only the output, so an input whose storage other tensors share (a view, a clone) is never
//! changed under them.
//!
//! The same path runs on LibTorch's CPU, where the addresses are host memory: the tests drive it
//! there with a collective written by hand.

#![allow(unsafe_code)]
// Burn marks its LibTorch backend deprecated; it is the GPU backend that builds here.
#![allow(deprecated)]

use burn::tensor::Tensor;

use crate::collective::CommError;

type Torch = burn::backend::LibTorch;

/// Runs `collective(input, output)` on the device addresses of the flat f32 tensor `t` (LibTorch,
/// on CUDA device `cuda`, or with `None` on LibTorch's CPU) and of a fresh f32 output of
/// `out_len` elements on the same device, and returns the output. `Ok(Err(t))` gives back,
/// untouched, a tensor LibTorch does not hold (another backend, or a tensor under autodiff),
/// for a caller's other path.
///
/// Before `collective` runs, LibTorch's work on the device has finished (on a CUDA device, every
/// stream of it), so the input is written; `collective` must have finished with both addresses
/// when it returns. A non-contiguous input is copied first; the addresses include the tensors'
/// offsets into their storage.
pub fn out_of_place(
    t: Tensor<1>,
    cuda: Option<usize>,
    out_len: usize,
    collective: impl FnOnce(u64, u64) -> Result<(), String>,
) -> Result<Result<Tensor<1>, Tensor<1>>, CommError> {
    let keep = t.clone();
    let Ok(primitive) = t.try_into_primitive::<Torch>() else { return Ok(Err(keep)) };
    drop(keep);
    let x = primitive.tensor;
    let device = cuda.map_or(tch::Device::Cpu, tch::Device::Cuda);
    if x.device() != device {
        return Err(CommError::Invalid(format!("the tensor is on LibTorch's {:?}, the communicator on {device:?}", x.device())));
    }
    if x.kind() != tch::Kind::Float {
        return Err(CommError::Invalid(format!("collectives on LibTorch tensors here are f32, not {:?}", x.kind())));
    }
    if x.dim() != 1 {
        return Err(CommError::Invalid(format!("a collective takes a flat tensor, not one of shape {:?}", x.size())));
    }
    let x = if x.is_contiguous() { x } else { x.contiguous() };
    let out = tch::Tensor::empty([out_len as i64], (tch::Kind::Float, device));
    if let tch::Device::Cuda(i) = device {
        tch::Cuda::synchronize(i as i64);
    }
    collective(x.data_ptr() as u64, out.data_ptr() as u64).map_err(CommError::Invalid)?;
    // The input lives until the collective is done with it.
    drop(x);
    Ok(Ok(Tensor::<1>::from_primitive::<Torch>(burn::backend::libtorch::TchTensor::new(out))))
}
