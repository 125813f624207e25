//! What a GPU collective library provides ([`GpuLibrary`]) and the host buffers it moves: the
//! leaf that [`super::GpuComm`] and the libraries (NCCL, RCCL) both build on.

use std::any::TypeId;

use burn::tensor::Tensor;

use crate::comm::{Element, ReduceOp};

/// A host buffer of one of the two element types a collective moves.
pub enum Host<'a> {
    /// Tensors.
    F32(&'a mut [f32]),
    /// Statistics.
    F64(&'a mut [f64]),
}

pub(super) fn host<T: Element>(buf: &mut [T]) -> Host<'_> {
    // `Element` is sealed to f32 and f64; the TypeId check picks the one `T` is, so the cast
    // keeps the element size and never fails.
    if TypeId::of::<T>() == TypeId::of::<f32>() {
        Host::F32(bytemuck::cast_slice_mut(buf))
    } else {
        Host::F64(bytemuck::cast_slice_mut(buf))
    }
}

/// What a GPU collective library reported, in its words (a missing library, a failed call).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct LibraryError(pub String);

impl From<String> for LibraryError {
    fn from(message: String) -> Self {
        Self(message)
    }
}

impl From<&str> for LibraryError {
    fn from(message: &str) -> Self {
        Self(message.to_string())
    }
}

/// A tensor collective's outcome: the result (`Ok(Ok)`), the tensor given back untouched for
/// the host path (`Ok(Err)`), or the library's error.
pub type Handed = Result<Result<Tensor<1>, Tensor<1>>, LibraryError>;

/// What one GPU collective library provides, on host buffers staged through its device.
pub trait GpuLibrary: Sized {
    /// The library's name, for messages.
    const NAME: &'static str;
    /// The environment variables that list the devices a process may use, first found first.
    const VISIBLE_DEVICES: &'static [&'static str];
    /// Checks that the driver, the library and a device are there.
    fn check(device: usize) -> Result<(), LibraryError>;
    /// A fresh unique id (on the group's rank 0).
    fn unique_id() -> Result<[u8; 128], LibraryError>;
    /// Joins the communicator of `id` as `rank` of `size` on `device` (collective).
    fn join(id: [u8; 128], rank: usize, size: usize, device: usize) -> Result<Self, LibraryError>;
    /// Combines `buf` across the group; every rank gets the result.
    fn all_reduce(&self, buf: Host<'_>, op: ReduceOp) -> Result<(), LibraryError>;
    /// `recv` (n x len) gets every rank's `send` (len) in rank order.
    fn all_gather(&self, send: Host<'_>, recv: Host<'_>) -> Result<(), LibraryError>;
    /// `recv` (len / n) gets this rank's chunk of the combined `send`.
    fn reduce_scatter(&self, send: Host<'_>, recv: Host<'_>, op: ReduceOp) -> Result<(), LibraryError>;
    /// Replaces `buf` with `root`'s.
    fn broadcast(&self, buf: Host<'_>, root: usize) -> Result<(), LibraryError>;
    /// Whether this build reaches tensors' device memory ([`Self::all_reduce_tensor`]).
    const TENSORS_IN_PLACE: bool = false;
    /// Combines the f32 tensor `t` across the group in its own device memory on `device`,
    /// where this build can reach it; gives `t` back untouched (`Ok(Err(t))`) where it cannot
    /// (another backend or device, a tensor under autodiff or not of f32, or a build without it),
    /// for the host path, which every rank takes with the same one collective. The default
    /// cannot.
    fn all_reduce_tensor(&self, t: Tensor<1>, _op: ReduceOp, _device: usize) -> Handed {
        Ok(Err(t))
    }
    /// Whether this build reduce-scatters and all-gathers tensors in their device memory
    /// ([`Self::reduce_scatter_tensor`], [`Self::all_gather_tensor`]).
    const SCATTERS_TENSORS: bool = false;
    /// This rank's chunk (`len / n` of `n` ranks) of the f32 tensor `t` combined across the
    /// group, in device memory on `device` where this build reaches it; `t` back otherwise.
    fn reduce_scatter_tensor(&self, t: Tensor<1>, _op: ReduceOp, _device: usize, _n: usize) -> Handed {
        Ok(Err(t))
    }
    /// Every rank's f32 tensor `t` in rank order (`n` times its length), in device memory on
    /// `device` where this build reaches it; `t` back otherwise.
    fn all_gather_tensor(&self, t: Tensor<1>, _device: usize, _n: usize) -> Handed {
        Ok(Err(t))
    }
}
