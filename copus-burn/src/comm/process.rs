//! The communicator of a rank that is an MPI process (feature `mpi`): MPI itself, or, for a
//! rank on a GPU, the GPU's collective library (NCCL for CUDA ranks, CubeCL's or LibTorch's,
//! with feature `nccl`; RCCL for ROCm with feature `rccl`) with MPI beside it for ids and
//! point-to-point messages.
//!
//! [`ProcessComm::world_for`] picks: a CUDA or ROCm rank takes the library when this build has
//! it and every rank of the job could start it, one rank per device (the library's constructor
//! agrees on that over MPI, so all ranks pick alike), and MPI otherwise, with a warning naming
//! why.

use std::sync::{Arc, Mutex, MutexGuard};

use burn::tensor::{Device, Tensor};

use super::placement::RankDevice;
use crate::comm::mpi::MpiComm;
use crate::comm::{Aborter, Collective, CommError, Element, ReduceOp, TensorSum};

/// One rank's communicator across processes: the library it uses, behind a lock so that its
/// tensor all-reduce can be handed to the autodiff graph's tensor-parallel operators
/// ([`Collective::tensor_sum`]). The graph's sums run inside the rank's own forward and
/// backward passes, between its other calls, so calls never overlap and the lock is never
/// contended; it only makes sharing the communicator safe.
#[derive(Debug)]
pub struct ProcessComm(Arc<Mutex<Library>>);

#[derive(Debug)]
enum Library {
    /// MPI for everything (host buffers; the bit-exact mode the parity tests use).
    Mpi(MpiComm),
    /// NCCL for collectives on CUDA devices.
    #[cfg(feature = "nccl")]
    Nccl(crate::comm::gpu::NcclComm),
    /// RCCL for collectives on ROCm devices.
    #[cfg(feature = "rccl")]
    Rccl(crate::comm::gpu::RcclComm),
}

/// `$body` with `$c` bound to whichever communicator `$lib` (a [`Library`]) holds.
macro_rules! each {
    ($lib:expr, |$c:ident| $body:expr) => {
        match $lib {
            Library::Mpi($c) => $body,
            #[cfg(feature = "nccl")]
            Library::Nccl($c) => $body,
            #[cfg(feature = "rccl")]
            Library::Rccl($c) => $body,
        }
    };
}

impl Library {
    fn shared(self) -> ProcessComm {
        ProcessComm(Arc::new(Mutex::new(self)))
    }
}

/// A [`ProcessComm`]'s tensor all-reduce, for the graph's operators.
struct ProcessSum(Arc<Mutex<Library>>);

impl TensorSum for ProcessSum {
    fn all_reduce_tensor(&self, t: Tensor<1>, op: ReduceOp) -> Result<Tensor<1>, CommError> {
        each!(&*lock(&self.0), |c| c.all_reduce_tensor(t, op))
    }
}

/// The library, whether or not a call that panicked holding it poisoned the lock (a
/// communicator keeps no state a panic could leave half-written that a later call reads).
fn lock(lib: &Mutex<Library>) -> MutexGuard<'_, Library> {
    lib.lock().unwrap_or_else(|e| e.into_inner())
}

impl ProcessComm {
    /// A fresh communicator over all processes for a rank on `device` (collective: every
    /// process calls it, with a device of the same kind); MPI's reductions exact or native as
    /// [`MpiComm::exact`] says, and with exact reductions MPI for GPU ranks too.
    pub fn world_for(device: RankDevice, exact_reductions: bool) -> Result<Self, CommError> {
        let fallback = match device {
            // The libraries sum in their own ring or tree order; exact reductions add in rank
            // order, as the in-process engine does (bit parity asked for), which MPI gives.
            RankDevice::Cuda(_) | RankDevice::TchCuda(_) | RankDevice::Rocm(_) if exact_reductions => {
                Some("`exact_reductions` asks for sums in rank order, which NCCL and RCCL do not give".to_string())
            }
            #[cfg(feature = "nccl")]
            RankDevice::Cuda(i) | RankDevice::TchCuda(i) => match crate::comm::gpu::NcclComm::new(MpiComm::world()?, i) {
                Ok(c) => return Ok(Library::Nccl(c).shared()),
                Err(e) => Some(e.to_string()),
            },
            #[cfg(feature = "rccl")]
            RankDevice::Rocm(i) => match crate::comm::gpu::RcclComm::new(MpiComm::world()?, i) {
                Ok(c) => return Ok(Library::Rccl(c).shared()),
                Err(e) => Some(e.to_string()),
            },
            #[cfg(not(feature = "nccl"))]
            RankDevice::Cuda(_) | RankDevice::TchCuda(_) => Some("this build has no NCCL (feature `nccl`)".to_string()),
            #[cfg(not(feature = "rccl"))]
            RankDevice::Rocm(_) => Some("this build has no RCCL (feature `rccl`)".to_string()),
            RankDevice::Flex | RankDevice::Wgpu | RankDevice::TchCpu => None,
        };
        if let Some(why) = fallback {
            tracing::warn!("collectives of the {device:?} ranks go over MPI through host memory: {why}");
        }
        Ok(Library::Mpi(MpiComm::world()?.exact(exact_reductions)).shared())
    }

    /// The collective library in use, for logs.
    pub fn library(&self) -> &'static str {
        match &*self.lib() {
            Library::Mpi(_) => "MPI",
            #[cfg(feature = "nccl")]
            Library::Nccl(_) => "NCCL",
            #[cfg(feature = "rccl")]
            Library::Rccl(_) => "RCCL",
        }
    }

    fn lib(&self) -> MutexGuard<'_, Library> {
        lock(&self.0)
    }
}

impl Collective for ProcessComm {
    fn rank(&self) -> usize {
        each!(&*self.lib(), |c| c.rank())
    }

    fn size(&self) -> usize {
        each!(&*self.lib(), |c| c.size())
    }

    fn all_reduce<T: Element>(&self, buf: &mut [T], op: ReduceOp) -> Result<(), CommError> {
        each!(&*self.lib(), |c| c.all_reduce(buf, op))
    }

    fn all_reduce_tensor(&self, t: Tensor<1>, op: ReduceOp) -> Result<Tensor<1>, CommError> {
        each!(&*self.lib(), |c| c.all_reduce_tensor(t, op))
    }

    fn tensor_sum(&self) -> Option<Arc<dyn TensorSum>> {
        Some(Arc::new(ProcessSum(self.0.clone())))
    }

    fn reduces_tensors_in_place(&self) -> bool {
        each!(&*self.lib(), |c| c.reduces_tensors_in_place())
    }

    fn all_gather<T: Element>(&self, buf: &[T]) -> Result<Vec<T>, CommError> {
        each!(&*self.lib(), |c| c.all_gather(buf))
    }

    fn reduce_scatter<T: Element>(&self, buf: &[T], op: ReduceOp) -> Result<Vec<T>, CommError> {
        each!(&*self.lib(), |c| c.reduce_scatter(buf, op))
    }

    fn reduce_scatter_owned<T: Element>(&self, buf: Vec<T>, op: ReduceOp) -> Result<Vec<T>, CommError> {
        each!(&*self.lib(), |c| c.reduce_scatter_owned(buf, op))
    }

    fn scatters_tensors_in_place(&self) -> bool {
        each!(&*self.lib(), |c| c.scatters_tensors_in_place())
    }

    fn reduce_scatter_tensor(&self, t: Tensor<1>, op: ReduceOp) -> Result<Tensor<1>, CommError> {
        each!(&*self.lib(), |c| c.reduce_scatter_tensor(t, op))
    }

    fn all_gather_tensor(&self, t: Tensor<1>) -> Result<Tensor<1>, CommError> {
        each!(&*self.lib(), |c| c.all_gather_tensor(t))
    }

    fn broadcast<T: Element>(&self, buf: &mut Vec<T>, root: usize) -> Result<(), CommError> {
        each!(&*self.lib(), |c| c.broadcast(buf, root))
    }

    fn send(&self, to: usize, tag: u32, buf: Vec<f32>) -> Result<(), CommError> {
        each!(&*self.lib(), |c| c.send(to, tag, buf))
    }

    fn recv(&self, from: usize, tag: u32) -> Result<Vec<f32>, CommError> {
        each!(&*self.lib(), |c| c.recv(from, tag))
    }

    fn send_tensor(&self, to: usize, tag: u32, t: Tensor<1>) -> Result<(), CommError> {
        each!(&*self.lib(), |c| c.send_tensor(to, tag, t))
    }

    fn recv_tensor(&self, from: usize, tag: u32, device: &Device) -> Result<Tensor<1>, CommError> {
        each!(&*self.lib(), |c| c.recv_tensor(from, tag, device))
    }

    fn barrier(&self) -> Result<(), CommError> {
        each!(&*self.lib(), |c| c.barrier())
    }

    fn split(&self, groups: &[Vec<usize>]) -> Result<Self, CommError> {
        let lib = match &*self.lib() {
            Library::Mpi(c) => Library::Mpi(c.split(groups)?),
            #[cfg(feature = "nccl")]
            Library::Nccl(c) => Library::Nccl(c.split(groups)?),
            #[cfg(feature = "rccl")]
            Library::Rccl(c) => Library::Rccl(c.split(groups)?),
        };
        Ok(lib.shared())
    }

    // Every library stops the job through MPI, which needs no communicator: not through the
    // lock, which a collective blocked in another call may hold.
    fn abort(&self, message: &str) {
        crate::comm::mpi::abort_job(message)
    }

    fn aborter(&self) -> Aborter {
        Box::new(|m| crate::comm::mpi::abort_job(m))
    }
}
