//! NCCL through cudarc (dynamic loading: nothing is linked at build time).

#![allow(unsafe_code)]

use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaStream};
use cudarc::nccl::safe::{Comm, Id, ReduceOp as NcclOp};

use super::library::{GpuLibrary, Host, LibraryError};
use crate::comm::ReduceOp;

/// NCCL's communicator and the CUDA stream its calls run on.
pub struct Nccl {
    comm: Comm,
    stream: Arc<CudaStream>,
}

fn op(op: ReduceOp) -> NcclOp {
    match op {
        ReduceOp::Sum => NcclOp::Sum,
        ReduceOp::Max => NcclOp::Max,
    }
}

/// Stages `buf` to the device, runs `f` on the device copy and copies the result back.
macro_rules! staged {
    ($self:ident, $buf:expr, |$d:ident| $body:expr) => {
        match $buf {
            Host::F32(b) => {
                let mut $d = $self.stream.clone_htod(&*b).map_err(|e| format!("{e:?}"))?;
                $body.map_err(|e| format!("{e:?}"))?;
                $self.stream.memcpy_dtoh(&$d, b).map_err(|e| format!("{e:?}"))?;
            }
            Host::F64(b) => {
                let mut $d = $self.stream.clone_htod(&*b).map_err(|e| format!("{e:?}"))?;
                $body.map_err(|e| format!("{e:?}"))?;
                $self.stream.memcpy_dtoh(&$d, b).map_err(|e| format!("{e:?}"))?;
            }
        }
    };
}

/// Runs a send/receive pair on the device: stage `send`, run `f` into a device `recv`, copy
/// `recv` back.
macro_rules! pair {
    ($self:ident, $send:expr, $recv:expr, |$s:ident, $r:ident| $body:expr) => {
        match ($send, $recv) {
            (Host::F32(sb), Host::F32(rb)) => {
                let $s = $self.stream.clone_htod(&*sb).map_err(|e| format!("{e:?}"))?;
                let mut $r = $self.stream.alloc_zeros::<f32>(rb.len()).map_err(|e| format!("{e:?}"))?;
                $body.map_err(|e| format!("{e:?}"))?;
                $self.stream.memcpy_dtoh(&$r, rb).map_err(|e| format!("{e:?}"))?;
            }
            (Host::F64(sb), Host::F64(rb)) => {
                let $s = $self.stream.clone_htod(&*sb).map_err(|e| format!("{e:?}"))?;
                let mut $r = $self.stream.alloc_zeros::<f64>(rb.len()).map_err(|e| format!("{e:?}"))?;
                $body.map_err(|e| format!("{e:?}"))?;
                $self.stream.memcpy_dtoh(&$r, rb).map_err(|e| format!("{e:?}"))?;
            }
            _ => return Err("send and receive buffers of different element types".into()),
        }
    };
}

impl GpuLibrary for Nccl {
    const NAME: &'static str = "NCCL";
    const VISIBLE_DEVICES: &'static [&'static str] = &["CUDA_VISIBLE_DEVICES"];

    fn check(device: usize) -> Result<(), LibraryError> {
        // SAFETY: these only try to open the shared libraries.
        if !unsafe { cudarc::driver::sys::is_culib_present() } {
            return Err("the CUDA driver library (libcuda.so) was not found: this machine has no NVIDIA driver".into());
        }
        // SAFETY: as above: it only tries to open libnccl.
        if !unsafe { cudarc::nccl::sys::is_culib_present() } {
            return Err("libnccl.so was not found: install NCCL (Debian/Ubuntu: libnccl2) or add its folder to LD_LIBRARY_PATH; PyTorch's NCCL (pip's nvidia-nccl) ships only libnccl.so.2, so link it as libnccl.so in a folder on LD_LIBRARY_PATH".into());
        }
        let count = CudaContext::device_count().map_err(|e| format!("the CUDA driver did not start: {e:?}"))?;
        if device >= count.max(0) as usize {
            return Err(format!("CUDA device {device} does not exist ({count} visible)").into());
        }
        Ok(())
    }

    fn unique_id() -> Result<[u8; 128], LibraryError> {
        let id = Id::new().map_err(|e| format!("ncclGetUniqueId: {e:?}"))?;
        Ok(id.internal().map(|c| c as u8))
    }

    fn join(id: [u8; 128], rank: usize, size: usize, device: usize) -> Result<Self, LibraryError> {
        let ctx = CudaContext::new(device).map_err(|e| format!("CUDA device {device}: {e:?}"))?;
        let stream = ctx.default_stream();
        let comm =
            Comm::from_rank(stream.clone(), rank, size, Id::uninit(id.map(|b| b as _))).map_err(|e| format!("ncclCommInitRank: {e:?}"))?;
        Ok(Self { comm, stream })
    }

    fn all_reduce(&self, buf: Host<'_>, o: ReduceOp) -> Result<(), LibraryError> {
        staged!(self, buf, |d| self.comm.all_reduce_in_place(&mut d, &op(o)));
        Ok(())
    }

    fn all_gather(&self, send: Host<'_>, recv: Host<'_>) -> Result<(), LibraryError> {
        pair!(self, send, recv, |s, r| self.comm.all_gather(&s, &mut r));
        Ok(())
    }

    fn reduce_scatter(&self, send: Host<'_>, recv: Host<'_>, o: ReduceOp) -> Result<(), LibraryError> {
        pair!(self, send, recv, |s, r| self.comm.reduce_scatter(&s, &mut r, &op(o)));
        Ok(())
    }

    fn broadcast(&self, buf: Host<'_>, root: usize) -> Result<(), LibraryError> {
        staged!(self, buf, |d| self.comm.broadcast_in_place(&mut d, root as i32));
        Ok(())
    }

    #[cfg(any(feature = "cuda", feature = "tch"))]
    const TENSORS_IN_PLACE: bool = true;

    #[cfg(any(feature = "cuda", feature = "tch"))]
    fn all_reduce_tensor(&self, t: burn::tensor::Tensor<1>, o: ReduceOp, device: usize) -> super::library::Handed {
        #[cfg(feature = "tch")]
        let t = {
            let n = t.dims()[0];
            // In place where the tensor's storage is its own (a freshly flattened gradient).
            let reduce = |src, dst| self.device_op(src, dst, n, n, DeviceOp::AllReduce(o));
            match crate::comm::gpu::tch_memory::in_place_where_unshared(t, Some(device), reduce).map_err(|e| LibraryError(e.to_string()))? {
                Ok(reduced) => return Ok(Ok(reduced)),
                Err(t) => t,
            }
        };
        #[cfg(feature = "cuda")]
        let t = match super::cuda_tensor::in_place(device, t, |ptr, n| self.device_op(ptr, ptr, n, n, DeviceOp::AllReduce(o)))
            .map_err(|e| LibraryError(e.to_string()))?
        {
            Ok(reduced) => return Ok(Ok(reduced)),
            Err(t) => t,
        };
        Ok(Err(t))
    }

    #[cfg(feature = "tch")]
    const SCATTERS_TENSORS: bool = true;

    #[cfg(feature = "tch")]
    fn reduce_scatter_tensor(&self, t: burn::tensor::Tensor<1>, o: ReduceOp, device: usize, n: usize) -> super::library::Handed {
        let len = t.dims()[0] / n.max(1);
        self.on_torch(t, device, len, DeviceOp::ReduceScatter(o))
    }

    #[cfg(feature = "tch")]
    fn all_gather_tensor(&self, t: burn::tensor::Tensor<1>, device: usize, n: usize) -> super::library::Handed {
        let len = t.dims()[0] * n;
        self.on_torch(t, device, len, DeviceOp::AllGather)
    }
}

/// A collective from one device buffer into another (or, for an all-reduce, the same one).
/// Without `tch` only the all-reduce is used (CubeCL's tensors, in place).
#[cfg_attr(not(feature = "tch"), allow(dead_code))]
#[derive(Clone, Copy, Debug)]
pub(crate) enum DeviceOp {
    AllReduce(ReduceOp),
    ReduceScatter(ReduceOp),
    AllGather,
}

impl Nccl {
    /// `op` from `len` f32 at device address `src` into `out_len` f32 at `dst` (another
    /// buffer, or for an all-reduce the same one), on this communicator's stream, and waits for
    /// it. Both buffers must stay allocated, and untouched by other streams, until this returns.
    #[cfg_attr(not(any(feature = "cuda", feature = "tch")), allow(dead_code))]
    pub(crate) fn device_op(&self, src: u64, dst: u64, len: usize, out_len: usize, o: DeviceOp) -> Result<(), String> {
        // SAFETY: the caller keeps both buffers alive and idle; the slices are leaked back (not
        // freed) once the stream is done with them.
        let send = unsafe { self.stream.upgrade_device_ptr::<f32>(src, len) };
        // SAFETY: as above.
        let mut recv = unsafe { self.stream.upgrade_device_ptr::<f32>(dst, out_len) };
        let done = match o {
            DeviceOp::AllReduce(r) => self.comm.all_reduce(&send, &mut recv, &op(r)),
            DeviceOp::ReduceScatter(r) => self.comm.reduce_scatter(&send, &mut recv, &op(r)),
            DeviceOp::AllGather => self.comm.all_gather(&send, &mut recv),
        }
        .map(drop)
        .map_err(|e| format!("{e:?}"));
        let synced = self.stream.synchronize().map_err(|e| format!("{e:?}"));
        send.leak();
        recv.leak();
        done.and(synced)
    }

    /// `op` on a LibTorch tensor on CUDA `device`, into a fresh tensor of `out_len` elements
    /// ([`crate::comm::gpu::tch_memory::out_of_place`]); the tensor back where it cannot be handed over
    /// (another backend or device, autodiff, not f32).
    #[cfg(feature = "tch")]
    fn on_torch(&self, t: burn::tensor::Tensor<1>, device: usize, out_len: usize, o: DeviceOp) -> super::library::Handed {
        let len = t.dims()[0];
        crate::comm::gpu::tch_memory::out_of_place(t, Some(device), out_len, |src, dst| self.device_op(src, dst, len, out_len, o))
            .map_err(|e| LibraryError(e.to_string()))
    }
}
