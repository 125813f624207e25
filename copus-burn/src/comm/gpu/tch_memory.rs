//! LibTorch tensors' memory for a collective library that reads and writes device addresses
//! (NCCL, through `comm::gpu` with features `nccl` and `tch`): the input's address and a fresh
//! output's, or the input's alone where it may be written in place, with LibTorch's queued work
//! on the device finished first. An input whose storage other tensors share (a view, a clone)
//! is never changed under them.
//!
//! The same path runs on LibTorch's CPU, where the addresses are host memory: the tests drive it
//! there with a collective written by hand.

#![allow(unsafe_code)]
// Burn marks its LibTorch backend deprecated; it is the GPU backend that builds here.
#![allow(deprecated)]

use burn::tensor::Tensor;

use crate::comm::CommError;

type Torch = burn::backend::LibTorch;

/// Runs `collective(input, output)` on the device addresses of the flat f32 tensor `t` (LibTorch,
/// on CUDA device `cuda`, or with `None` on LibTorch's CPU) and of a fresh f32 output of
/// `out_len` elements on the same device, and returns the output. `Ok(Err(t))` gives back,
/// untouched, a tensor this cannot hand over (another backend, a tensor under autodiff, one on
/// another device, not f32 or not flat), for a caller's other path, which every rank of the
/// group takes with the same collective call.
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
    on_device_memory(t, cuda, out_len, false, collective)
}

/// [`out_of_place`], but where the output is as long as the input and the input's storage is its
/// own (no other tensor, view or clone shares it), the collective writes the input itself
/// (`collective(address, address)`) and it is returned: an all-reduce of a freshly flattened
/// gradient then needs no second buffer of its size.
pub fn in_place_where_unshared(
    t: Tensor<1>,
    cuda: Option<usize>,
    collective: impl FnOnce(u64, u64) -> Result<(), String>,
) -> Result<Result<Tensor<1>, Tensor<1>>, CommError> {
    let len = t.dims()[0];
    on_device_memory(t, cuda, len, true, collective)
}

fn on_device_memory(
    t: Tensor<1>,
    cuda: Option<usize>,
    out_len: usize,
    reuse: bool,
    collective: impl FnOnce(u64, u64) -> Result<(), String>,
) -> Result<Result<Tensor<1>, Tensor<1>>, CommError> {
    let keep = t.clone();
    let Ok(primitive) = t.try_into_primitive::<Torch>() else { return Ok(Err(keep)) };
    drop(keep);
    let device = cuda.map_or(tch::Device::Cpu, tch::Device::Cuda);
    // A tensor on another device, of another kind or not flat is given back too: refused here,
    // it would leave the other ranks waiting in the collective; the caller's path takes it.
    let x = &primitive.tensor;
    if x.device() != device || x.kind() != tch::Kind::Float || x.dim() != 1 {
        return Ok(Err(Tensor::<1>::from_primitive::<Torch>(primitive)));
    }
    let wait = || {
        if let tch::Device::Cuda(i) = device {
            tch::Cuda::synchronize(i as i64);
        }
    };
    if reuse && out_len == x.numel() && x.is_contiguous() && primitive.can_mut() {
        wait();
        let at = primitive.tensor.data_ptr() as u64;
        collective(at, at).map_err(CommError::Invalid)?;
        return Ok(Ok(Tensor::<1>::from_primitive::<Torch>(primitive)));
    }
    let x = primitive.tensor;
    let x = if x.is_contiguous() { x } else { x.contiguous() };
    let out = tch::Tensor::empty([out_len as i64], (tch::Kind::Float, device));
    wait();
    collective(x.data_ptr() as u64, out.data_ptr() as u64).map_err(CommError::Invalid)?;
    // The input lives until the collective is done with it.
    drop(x);
    Ok(Ok(Tensor::<1>::from_primitive::<Torch>(burn::backend::libtorch::TchTensor::new(out))))
}
