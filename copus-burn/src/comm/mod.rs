//! The communication wing: how ranks exchange values, whatever carries them.
//!
//! This file holds the [`Collective`] trait every backend implements, its errors and the
//! arithmetic the backends share (reduction order, chunking, partition checks), and the choice
//! of implementation: [`threads`] for ranks that are threads of one process (host buffers; the
//! default), `mpi` for ranks that are MPI processes (feature `mpi`), `process` for the
//! tensor path of a process's rank (MPI, or NCCL/RCCL on GPUs) and `gpu` for the GPU
//! libraries (features `nccl`, `rccl`; the LibTorch memory bridge with `tch`). Where a rank runs
//! (launcher environments, ranks per device) is [`placement`]. Nothing here knows the engine:
//! the engine picks a communicator per rank and calls it.
//!
//! Every reduction adds (or takes the max of) the ranks' values in rank order 0, 1, ..., n-1 for
//! every element, whichever rank computes it, so results are deterministic and bit-identical on
//! all ranks. A rank that fails calls [`Collective::abort`]; every rank waiting in a collective
//! (or a receive) of the same world then returns [`CommError::Aborted`] naming that rank and its
//! message, so nothing hangs.

#[cfg(any(feature = "nccl", feature = "rccl", feature = "tch"))]
pub mod gpu;
#[cfg(feature = "mpi")]
pub mod mpi;
pub mod placement;
#[cfg(feature = "mpi")]
pub mod process;
pub mod threads;

use std::ops::Range;
use std::sync::Arc;

use burn::tensor::{Device, Tensor, TensorData};
use thiserror::Error;

use crate::traffic;

/// How a reduction combines values.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReduceOp {
    /// Element-wise sum.
    Sum,
    /// Element-wise maximum.
    Max,
}

mod sealed {
    /// Only the crate's own element types: the in-place all-reduce relies on their layout.
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for f64 {}
}

/// A value type collectives move: `f32` (tensors) and `f64` (statistics). Sealed.
pub trait Element:
    sealed::Sealed + bytemuck::Pod + Copy + Default + PartialOrd + std::ops::Add<Output = Self> + Send + Sync + 'static
{
}
impl Element for f32 {}
impl Element for f64 {}

fn combine<T: Element>(op: ReduceOp, a: T, b: T) -> T {
    match op {
        ReduceOp::Sum => a + b,
        ReduceOp::Max => {
            if b > a {
                b
            } else {
                a
            }
        }
    }
}

/// Why a collective did not complete.
#[derive(Clone, Debug, PartialEq, Error)]
pub enum CommError {
    /// Some rank of the world failed; its message.
    #[error("rank {rank} failed: {message}")]
    Aborted {
        /// World rank that failed first.
        rank: usize,
        /// What it reported.
        message: String,
    },
    /// Ranks passed buffers that cannot be combined.
    #[error("collective `{op}`: {detail}")]
    Mismatch {
        /// Which collective.
        op: &'static str,
        /// What did not match.
        detail: String,
    },
    /// A bad rank or group argument.
    #[error("{0}")]
    Invalid(String),
    /// A wait outlasted the world's timeout: the ranks that had not arrived (world ranks).
    #[error("collective `{op}` timed out after {secs:.1} s waiting for rank(s) {missing:?}")]
    Timeout {
        /// Which collective (or `recv`).
        op: &'static str,
        /// Seconds waited.
        secs: f64,
        /// World ranks that had not arrived.
        missing: Vec<usize>,
    },
}

/// A group's tensor all-reduce as an owned handle, for where a [`Collective`] cannot go: inside
/// an operation of Burn's autodiff graph, whose backward pass runs on the rank's thread after
/// the forward call has returned (Megatron's conjugate operators, `engine::tp_graph`).
pub trait TensorSum: Send + Sync {
    /// As [`Collective::all_reduce_tensor`] of the group the handle came from.
    fn all_reduce_tensor(&self, t: Tensor<1>, op: ReduceOp) -> Result<Tensor<1>, CommError>;
}

/// Communication among the ranks of one group.
pub trait Collective: Send + Sized {
    /// This rank's index in the group.
    fn rank(&self) -> usize;
    /// Ranks in the group.
    fn size(&self) -> usize;
    /// Combines `buf` element-wise across the group; every rank gets the result.
    fn all_reduce<T: Element>(&self, buf: &mut [T], op: ReduceOp) -> Result<(), CommError>;
    /// Combines the tensor `t` element-wise across the group; every rank gets the result on
    /// `t`'s device. By default through host memory (read, [`Self::all_reduce`], uploaded
    /// back; counted as collective traffic); an in-process group combines the ranks' tensors
    /// where they lie, in rank order, so the result is the same as through host memory.
    fn all_reduce_tensor(&self, t: Tensor<1>, op: ReduceOp) -> Result<Tensor<1>, CommError> {
        let device = t.device();
        let mut v: Vec<f32> = traffic::read(t, traffic::Kind::Collective).iter::<f32>().collect();
        self.all_reduce(&mut v, op)?;
        let n = v.len();
        Ok(traffic::upload(TensorData::new(v, [n]), &device, traffic::Kind::Collective))
    }
    /// An owned handle on this group's tensor all-reduce ([`TensorSum`]), which the autodiff
    /// graph's tensor-parallel operators call (the engine's communicators, in-process and
    /// across processes, give one); `None` by default.
    fn tensor_sum(&self) -> Option<Arc<dyn TensorSum>> {
        None
    }
    /// Whether [`Self::all_reduce_tensor`] combines the tensors where they lie (an in-process
    /// group); `false` (the default) when it stages them through host memory in one buffer,
    /// where a caller that buckets large buffers should keep doing so.
    fn reduces_tensors_in_place(&self) -> bool {
        false
    }
    /// Concatenates every rank's `buf` (equal lengths) in rank order.
    fn all_gather<T: Element>(&self, buf: &[T]) -> Result<Vec<T>, CommError>;
    /// Combines `buf` (length divisible by the group size) and returns this rank's chunk.
    fn reduce_scatter<T: Element>(&self, buf: &[T], op: ReduceOp) -> Result<Vec<T>, CommError>;
    /// [`Self::reduce_scatter`] of a buffer the caller gives up: an in-process group hands it
    /// to the others as it is, where the borrowing form deposits a copy.
    fn reduce_scatter_owned<T: Element>(&self, buf: Vec<T>, op: ReduceOp) -> Result<Vec<T>, CommError> {
        self.reduce_scatter(&buf, op)
    }
    /// Whether [`Self::reduce_scatter_tensor`] and [`Self::all_gather_tensor`] work where the
    /// tensors lie (an in-process group); `false` (the default) when they stage whole buffers
    /// through host memory.
    fn scatters_tensors_in_place(&self) -> bool {
        false
    }
    /// [`Self::reduce_scatter`] of the tensor `t`: this rank's chunk on `t`'s device. By default
    /// through host memory (counted as collective traffic); an in-process group combines the
    /// ranks' chunks where they lie, in rank order, as through host memory.
    fn reduce_scatter_tensor(&self, t: Tensor<1>, op: ReduceOp) -> Result<Tensor<1>, CommError> {
        let device = t.device();
        let v: Vec<f32> = traffic::read(t, traffic::Kind::Collective).iter::<f32>().collect();
        let mine = self.reduce_scatter_owned(v, op)?;
        let n = mine.len();
        Ok(traffic::upload(TensorData::new(mine, [n]), &device, traffic::Kind::Collective))
    }
    /// [`Self::all_gather`] of the tensor `t` (equal lengths), on `t`'s device. By default
    /// through host memory; an in-process group concatenates the ranks' tensors where they lie.
    fn all_gather_tensor(&self, t: Tensor<1>) -> Result<Tensor<1>, CommError> {
        let device = t.device();
        let v: Vec<f32> = traffic::read(t, traffic::Kind::Collective).iter::<f32>().collect();
        let all = self.all_gather(&v)?;
        let n = all.len();
        Ok(traffic::upload(TensorData::new(all, [n]), &device, traffic::Kind::Collective))
    }
    /// Replaces `buf` on every rank with `root`'s.
    fn broadcast<T: Element>(&self, buf: &mut Vec<T>, root: usize) -> Result<(), CommError>;
    /// Queues `buf` for rank `to` under `tag`; never waits for the receive.
    fn send(&self, to: usize, tag: u32, buf: Vec<f32>) -> Result<(), CommError>;
    /// Waits for the next buffer rank `from` sent under `tag`.
    fn recv(&self, from: usize, tag: u32) -> Result<Vec<f32>, CommError>;
    /// Queues the tensor `t` for rank `to` under `tag`. By default through host memory (read;
    /// counted as activations, what the engine sends); an in-process group hands the tensor
    /// over where it lies.
    fn send_tensor(&self, to: usize, tag: u32, t: Tensor<1>) -> Result<(), CommError> {
        self.send(to, tag, traffic::read(t, traffic::Kind::Activations).iter::<f32>().collect())
    }
    /// Waits for the next tensor (or buffer) rank `from` sent under `tag`, on `device`.
    fn recv_tensor(&self, from: usize, tag: u32, device: &Device) -> Result<Tensor<1>, CommError> {
        let v = self.recv(from, tag)?;
        let n = v.len();
        Ok(traffic::upload(TensorData::new(v, [n]), device, traffic::Kind::Activations))
    }
    /// Waits until every rank of the group arrives.
    fn barrier(&self) -> Result<(), CommError>;
    /// Collective over this group: every rank passes the same partition of the group's ranks
    /// and gets the sub-group that holds it.
    fn split(&self, groups: &[Vec<usize>]) -> Result<Self, CommError>;
    /// Marks the whole world failed with this rank's message; wakes every waiting rank.
    fn abort(&self, message: &str);
    /// Aborts this world later, after the communicator itself has moved away (into a rank's
    /// state that then failed to build).
    fn aborter(&self) -> Aborter;
}

/// Aborts a world with a rank's message; see [`Collective::aborter`].
pub type Aborter = Box<dyn Fn(&str) + Send>;

/// Chunk `i` of `n` near-equal chunks of `len` elements.
pub fn chunk_range(len: usize, n: usize, i: usize) -> Range<usize> {
    let base = len / n;
    let extra = len % n;
    let start = i * base + i.min(extra);
    start..start + base + usize::from(i < extra)
}

/// Checks that `groups` partition the ranks `0..n` of a group being split (every backend's
/// `split` takes the same argument).
pub(crate) fn check_partition(groups: &[Vec<usize>], n: usize) -> Result<(), CommError> {
    let mut seen = vec![0usize; n];
    for g in groups {
        for &r in g {
            *seen.get_mut(r).ok_or_else(|| CommError::Invalid(format!("split: rank {r} is not in a group of {n}")))? += 1;
        }
    }
    match seen.iter().position(|&c| c != 1) {
        Some(r) => Err(CommError::Invalid(format!("split: rank {r} appears {} times; groups must partition 0..{n}", seen[r]))),
        None => Ok(()),
    }
}

/// Checks that a reduce-scatter buffer of `len` elements splits into `n` equal chunks.
pub(crate) fn check_scatter(len: usize, n: usize) -> Result<(), CommError> {
    if len.is_multiple_of(n) {
        Ok(())
    } else {
        Err(CommError::Mismatch { op: "reduce_scatter", detail: format!("{len} elements do not split into {n} equal chunks") })
    }
}

pub(crate) fn combine_into<T: Element>(acc: &mut [T], x: &[T], op: ReduceOp) {
    match op {
        ReduceOp::Sum => acc.iter_mut().zip(x).for_each(|(a, &b)| *a = *a + b),
        ReduceOp::Max => acc.iter_mut().zip(x).for_each(|(a, &b)| {
            if b > *a {
                *a = b;
            }
        }),
    }
}

/// Under Burn's fusion, runs this thread's queued operations on `device` to completion, so that
/// a tensor handed to another rank thread exists and no later operation of this thread can
/// reorder around the other thread's use of it. Fusion queues each thread's operations on a
/// stream of its own, and a tensor read on another thread's stream is ordered against writes
/// of its own stream only once both are submitted: with four rank threads (tp2 x pp2 on wgpu)
/// the fused build trained 1e-3 away from Flex, different from run to run, without this fence.
/// Without fusion a backend runs each operation as it is issued, and this does nothing.
pub(crate) fn fusion_fence(device: &Device) -> Result<(), CommError> {
    if cfg!(feature = "fusion") {
        device.sync().map_err(|e| CommError::Invalid(format!("waiting for the device's queued work: {e:?}")))?;
    }
    Ok(())
}
