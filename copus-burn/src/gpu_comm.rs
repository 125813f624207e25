//! Collectives on GPUs through NCCL's C interface: NVIDIA's NCCL (feature `nccl`, through
//! cudarc with dynamic loading) and AMD's RCCL (feature `rccl`, which exports the same
//! interface, loaded with libloading). Both sit behind the one [`Collective`] trait as
//! [`GpuComm`].
//!
//! One process per GPU, started by `mpirun`: the group's rank 0 makes the library's unique id
//! and MPI broadcasts it; each group made by [`Collective::split`] gets its own communicator the
//! same way. Point-to-point messages (pipeline activations) and barriers go over MPI, whose
//! sends never wait for the receive, as the engine's schedules require.
//!
//! The trait works on host slices, so each call stages its buffer to the device and back; the
//! in-place path for Burn CUDA tensors is [`cuda_tensor`] (feature `cuda`). Sums follow the
//! library's ring or tree order, so results match the in-process engine to rounding, not to
//! the bit.
//!
//! Without the libraries (no driver, no NCCL/RCCL, no device) every constructor returns a
//! [`CommError`] saying what is missing, on every rank alike, and never panics.

#![allow(unsafe_code)]

use std::any::TypeId;

use crate::collective::{Aborter, Collective, CommError, Element, ReduceOp, check_scatter, chunk_range};
use crate::mpi::MpiComm;

/// A host buffer of one of the two element types a collective moves.
pub enum Host<'a> {
    /// Tensors.
    F32(&'a mut [f32]),
    /// Statistics.
    F64(&'a mut [f64]),
}

fn host<T: Element>(buf: &mut [T]) -> Host<'_> {
    // SAFETY: `Element` is sealed to f32 and f64; the TypeId check picks the one `T` is.
    unsafe {
        if TypeId::of::<T>() == TypeId::of::<f32>() {
            Host::F32(std::slice::from_raw_parts_mut(buf.as_mut_ptr().cast(), buf.len()))
        } else {
            Host::F64(std::slice::from_raw_parts_mut(buf.as_mut_ptr().cast(), buf.len()))
        }
    }
}

/// What one GPU collective library provides, on host buffers staged through its device.
pub trait GpuLibrary: Sized {
    /// The library's name, for messages.
    const NAME: &'static str;
    /// Checks that the driver, the library and a device are there.
    fn check(device: usize) -> Result<(), String>;
    /// A fresh unique id (on the group's rank 0).
    fn unique_id() -> Result<[u8; 128], String>;
    /// Joins the communicator of `id` as `rank` of `size` on `device` (collective).
    fn join(id: [u8; 128], rank: usize, size: usize, device: usize) -> Result<Self, String>;
    /// Combines `buf` across the group; every rank gets the result.
    fn all_reduce(&self, buf: Host<'_>, op: ReduceOp) -> Result<(), String>;
    /// `recv` (n x len) gets every rank's `send` (len) in rank order.
    fn all_gather(&self, send: Host<'_>, recv: Host<'_>) -> Result<(), String>;
    /// `recv` (len / n) gets this rank's chunk of the combined `send`.
    fn reduce_scatter(&self, send: Host<'_>, recv: Host<'_>, op: ReduceOp) -> Result<(), String>;
    /// Replaces `buf` with `root`'s.
    fn broadcast(&self, buf: Host<'_>, root: usize) -> Result<(), String>;
}

/// A rank's communicator on a GPU collective library, with MPI beside it for ids,
/// point-to-point messages and barriers.
pub struct GpuComm<G: GpuLibrary> {
    lib: G,
    mpi: MpiComm,
    device: usize,
}

impl<G: GpuLibrary> std::fmt::Debug for GpuComm<G> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "GpuComm<{}>(rank {} of {}, device {})", G::NAME, self.mpi.rank(), self.mpi.size(), self.device)
    }
}

/// NVIDIA's NCCL (feature `nccl`).
#[cfg(feature = "nccl")]
pub type NcclComm = GpuComm<nccl::Nccl>;
/// AMD's RCCL (feature `rccl`).
#[cfg(feature = "rccl")]
pub type RcclComm = GpuComm<rccl::Rccl>;

impl<G: GpuLibrary> GpuComm<G> {
    /// The library's communicator over `mpi`'s group, this rank on GPU `device` (collective
    /// over the group). When any rank lacks the driver, the library or the device, every rank
    /// gets the error (the first failing rank's reason).
    pub fn new(mpi: MpiComm, device: usize) -> Result<Self, CommError> {
        let checked = G::check(device);
        Self::agree(&mpi, checked.as_ref().err())?;
        let mut id = vec![0f64; 16];
        if mpi.rank() == 0 {
            let made = G::unique_id();
            if let Ok(bytes) = &made {
                for (slot, chunk) in id.iter_mut().zip(bytes.chunks_exact(8)) {
                    *slot = f64::from_bits(u64::from_le_bytes(chunk.try_into().expect("8 bytes")));
                }
            }
            Self::agree(&mpi, made.as_ref().err())?;
        } else {
            Self::agree(&mpi, None)?;
        }
        mpi.broadcast(&mut id, 0)?;
        let mut bytes = [0u8; 128];
        for (chunk, v) in bytes.chunks_exact_mut(8).zip(&id) {
            chunk.copy_from_slice(&v.to_bits().to_le_bytes());
        }
        let joined = G::join(bytes, mpi.rank(), mpi.size(), device);
        Self::agree(&mpi, joined.as_ref().err())?;
        Ok(Self { lib: joined.map_err(CommError::Invalid)?, mpi, device })
    }

    /// Every rank learns whether some rank failed, and the lowest failing rank's reason.
    fn agree(mpi: &MpiComm, failure: Option<&String>) -> Result<(), CommError> {
        let me = mpi.rank() as f64;
        let mut first = vec![if failure.is_some() { -me } else { f64::NEG_INFINITY }];
        mpi.all_reduce(&mut first, ReduceOp::Max)?;
        if first[0] == f64::NEG_INFINITY {
            return Ok(());
        }
        let rank = (-first[0]) as usize;
        let mut text: Vec<f64> = failure.map(|m| m.bytes().map(f64::from).collect()).unwrap_or_default();
        mpi.broadcast(&mut text, rank)?;
        let reason = String::from_utf8_lossy(&text.iter().map(|&b| b as u8).collect::<Vec<u8>>()).into_owned();
        Err(CommError::Invalid(format!("{} on rank {rank}: {reason}", G::NAME)))
    }

    /// Every rank passed `len` elements (the libraries would hang or overrun otherwise).
    fn same_len(&self, op: &'static str, len: usize) -> Result<(), CommError> {
        let all = self.mpi.all_gather(&[len as f64])?;
        match all.iter().position(|&l| l != len as f64) {
            None => Ok(()),
            Some(r) => Err(CommError::Mismatch { op, detail: format!("rank {r} passed {} elements, this rank {len}", all[r]) }),
        }
    }

    fn lib_err(e: String) -> CommError {
        CommError::Invalid(format!("{}: {e}", G::NAME))
    }
}

// SAFETY: the library communicator and the MPI communicator are used by the one rank that owns
// them, from one thread at a time (MPI runs at MPI_THREAD_SERIALIZED or above).
unsafe impl<G: GpuLibrary> Send for GpuComm<G> {}

impl<G: GpuLibrary> Collective for GpuComm<G> {
    fn rank(&self) -> usize {
        self.mpi.rank()
    }

    fn size(&self) -> usize {
        self.mpi.size()
    }

    fn all_reduce<T: Element>(&self, buf: &mut [T], op: ReduceOp) -> Result<(), CommError> {
        self.same_len("all_reduce", buf.len())?;
        self.lib.all_reduce(host(buf), op).map_err(Self::lib_err)
    }

    fn all_gather<T: Element>(&self, buf: &[T]) -> Result<Vec<T>, CommError> {
        self.same_len("all_gather", buf.len())?;
        let mut send = buf.to_vec();
        let mut out = vec![T::default(); buf.len() * self.size()];
        self.lib.all_gather(host(&mut send), host(&mut out)).map_err(Self::lib_err)?;
        Ok(out)
    }

    fn reduce_scatter<T: Element>(&self, buf: &[T], op: ReduceOp) -> Result<Vec<T>, CommError> {
        let n = self.size();
        check_scatter(buf.len(), n)?;
        self.same_len("reduce_scatter", buf.len())?;
        let mut send = buf.to_vec();
        let mut out = vec![T::default(); chunk_range(buf.len(), n, self.rank()).len()];
        self.lib.reduce_scatter(host(&mut send), host(&mut out), op).map_err(Self::lib_err)?;
        Ok(out)
    }

    fn broadcast<T: Element>(&self, buf: &mut Vec<T>, root: usize) -> Result<(), CommError> {
        // The length travels over MPI, the data through the library.
        let mut len = vec![buf.len() as f64];
        self.mpi.broadcast(&mut len, root)?;
        buf.resize(len[0] as usize, T::default());
        self.lib.broadcast(host(buf), root).map_err(Self::lib_err)
    }

    fn send(&self, to: usize, tag: u32, buf: Vec<f32>) -> Result<(), CommError> {
        self.mpi.send(to, tag, buf)
    }

    fn recv(&self, from: usize, tag: u32) -> Result<Vec<f32>, CommError> {
        self.mpi.recv(from, tag)
    }

    fn barrier(&self) -> Result<(), CommError> {
        self.mpi.barrier()
    }

    fn split(&self, groups: &[Vec<usize>]) -> Result<Self, CommError> {
        Self::new(self.mpi.split(groups)?, self.device)
    }

    fn abort(&self, message: &str) {
        self.mpi.abort(message)
    }

    fn aborter(&self) -> Aborter {
        self.mpi.aborter()
    }
}

#[cfg(feature = "nccl")]
pub mod nccl {
    //! NCCL through cudarc (dynamic loading: nothing is linked at build time).

    use std::sync::Arc;

    use cudarc::driver::{CudaContext, CudaStream};
    use cudarc::nccl::safe::{Comm, Id, ReduceOp as NcclOp};

    use super::{GpuLibrary, Host};
    use crate::collective::ReduceOp;

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

        fn check(device: usize) -> Result<(), String> {
            // SAFETY: these only try to open the shared libraries.
            if !unsafe { cudarc::driver::sys::is_culib_present() } {
                return Err("the CUDA driver library (libcuda.so) was not found: this machine has no NVIDIA driver".into());
            }
            if !unsafe { cudarc::nccl::sys::is_culib_present() } {
                return Err("libnccl.so was not found: install NCCL (Debian/Ubuntu: libnccl2) or add its folder to LD_LIBRARY_PATH".into());
            }
            let count = CudaContext::device_count().map_err(|e| format!("the CUDA driver did not start: {e:?}"))?;
            if device >= count.max(0) as usize {
                return Err(format!("CUDA device {device} does not exist ({count} visible)"));
            }
            Ok(())
        }

        fn unique_id() -> Result<[u8; 128], String> {
            let id = Id::new().map_err(|e| format!("ncclGetUniqueId: {e:?}"))?;
            Ok(id.internal().map(|c| c as u8))
        }

        fn join(id: [u8; 128], rank: usize, size: usize, device: usize) -> Result<Self, String> {
            let ctx = CudaContext::new(device).map_err(|e| format!("CUDA device {device}: {e:?}"))?;
            let stream = ctx.default_stream();
            let comm = Comm::from_rank(stream.clone(), rank, size, Id::uninit(id.map(|b| b as _)))
                .map_err(|e| format!("ncclCommInitRank: {e:?}"))?;
            Ok(Self { comm, stream })
        }

        fn all_reduce(&self, buf: Host<'_>, o: ReduceOp) -> Result<(), String> {
            staged!(self, buf, |d| self.comm.all_reduce_in_place(&mut d, &op(o)));
            Ok(())
        }

        fn all_gather(&self, send: Host<'_>, recv: Host<'_>) -> Result<(), String> {
            pair!(self, send, recv, |s, r| self.comm.all_gather(&s, &mut r));
            Ok(())
        }

        fn reduce_scatter(&self, send: Host<'_>, recv: Host<'_>, o: ReduceOp) -> Result<(), String> {
            pair!(self, send, recv, |s, r| self.comm.reduce_scatter(&s, &mut r, &op(o)));
            Ok(())
        }

        fn broadcast(&self, buf: Host<'_>, root: usize) -> Result<(), String> {
            staged!(self, buf, |d| self.comm.broadcast_in_place(&mut d, root as i32));
            Ok(())
        }
    }

    impl Nccl {
        /// All-reduces `len` f32 at device address `ptr` in place, on this communicator's
        /// stream, and waits for it. The memory must stay allocated and untouched by other
        /// streams until this returns.
        #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
        pub(crate) fn all_reduce_device(&self, ptr: u64, len: usize, o: ReduceOp) -> Result<(), String> {
            // SAFETY: the caller keeps `len` f32 at `ptr` alive and idle; the slice is leaked
            // back (not freed) once the stream is done with it.
            let mut slice = unsafe { self.stream.upgrade_device_ptr::<f32>(ptr, len) };
            let done = self.comm.all_reduce_in_place(&mut slice, &op(o)).map(drop).map_err(|e| format!("{e:?}"));
            let synced = self.stream.synchronize().map_err(|e| format!("{e:?}"));
            slice.leak();
            done.and(synced)
        }
    }
}

/// Burn CUDA tensors to device pointers: the in-place all-reduce of a tensor's memory, without
/// a host copy (features `nccl` and `cuda`).
#[cfg(all(feature = "nccl", feature = "cuda"))]
pub mod cuda_tensor {
    use burn::backend::Cuda;
    use burn::cubecl::Device as CubeDevice;
    use burn::cubecl::cuda::CudaRuntime;
    use burn::tensor::{DType, Tensor};
    use cubecl_runtime::runtime::Runtime;

    use super::NcclComm;
    use crate::collective::{CommError, ReduceOp};

    type CudaServer = <CudaRuntime as Runtime>::Server;

    /// All-reduces a float tensor on a CUDA device in place across `comm`'s group: NCCL reads
    /// and writes the tensor's device memory directly. Returns the reduced tensor (the input
    /// is flattened, and copied when it was not contiguous or shared its buffer).
    pub fn all_reduce<const D: usize>(comm: &NcclComm, t: Tensor<D>, op: ReduceOp) -> Result<Tensor<D>, CommError> {
        let dims = t.dims();
        let n: usize = dims.iter().product();
        let was_autodiff = t.is_autodiff();
        // Rank 1 is never padded; the reshape is a view when the tensor is contiguous.
        let flat: Tensor<1> = t.inner().reshape([n]);
        let device = flat.device();
        let mut cube = flat
            .try_into_primitive::<Cuda>()
            .map_err(|_| CommError::Invalid("the tensor is not on a CUDA device of Burn's CubeCL backend".into()))?;
        let CubeDevice::Cuda(cuda) = &cube.device else {
            return Err(CommError::Invalid("the tensor is on a CubeCL device that is not CUDA".into()));
        };
        if cuda.index != comm.device {
            return Err(CommError::Invalid(format!("the tensor is on CUDA device {}, the communicator on {}", cuda.index, comm.device)));
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
        device.sync().map_err(|e| CommError::Invalid(format!("waiting for Burn's CUDA work: {e:?}")))?;
        comm.lib.all_reduce_device(ptr, n, op).map_err(|e| CommError::Invalid(format!("NCCL: {e}")))?;
        drop(resource);
        let out = Tensor::<1>::from_primitive::<Cuda>(cube).reshape(dims);
        Ok(if was_autodiff { out.autodiff() } else { out })
    }
}

#[cfg(feature = "rccl")]
pub mod rccl {
    //! RCCL through its NCCL-compatible C interface and the HIP runtime, both loaded with
    //! libloading at run time (`COPUS_RCCL_LIB` and `COPUS_HIP_LIB` override the file names).

    use std::ffi::{CStr, c_char, c_int, c_void};
    use std::sync::OnceLock;

    use libloading::Library;

    use super::{GpuLibrary, Host};
    use crate::collective::ReduceOp;

    /// NCCL's reduction operator codes (`ncclRedOp_t`), which RCCL shares.
    fn op_code(op: ReduceOp) -> c_int {
        match op {
            ReduceOp::Sum => 0,
            ReduceOp::Max => 2,
        }
    }

    #[repr(C)]
    #[derive(Clone, Copy)]
    struct UniqueId {
        internal: [c_char; 128],
    }

    type Comm = *mut c_void;
    type Stream = *mut c_void;

    /// The entry points used, resolved once.
    struct Api {
        _rccl: Library,
        _hip: Library,
        get_unique_id: unsafe extern "C" fn(*mut UniqueId) -> c_int,
        comm_init_rank: unsafe extern "C" fn(*mut Comm, c_int, UniqueId, c_int) -> c_int,
        comm_destroy: unsafe extern "C" fn(Comm) -> c_int,
        get_error_string: unsafe extern "C" fn(c_int) -> *const c_char,
        all_reduce: unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, c_int, Comm, Stream) -> c_int,
        all_gather: unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, Comm, Stream) -> c_int,
        reduce_scatter: unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, c_int, Comm, Stream) -> c_int,
        broadcast: unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, c_int, Comm, Stream) -> c_int,
        hip_set_device: unsafe extern "C" fn(c_int) -> c_int,
        hip_get_device_count: unsafe extern "C" fn(*mut c_int) -> c_int,
        hip_malloc: unsafe extern "C" fn(*mut *mut c_void, usize) -> c_int,
        hip_free: unsafe extern "C" fn(*mut c_void) -> c_int,
        hip_memcpy: unsafe extern "C" fn(*mut c_void, *const c_void, usize, c_int) -> c_int,
        hip_device_synchronize: unsafe extern "C" fn() -> c_int,
    }

    const HOST_TO_DEVICE: c_int = 1;
    const DEVICE_TO_HOST: c_int = 2;

    fn open(env: &str, names: &[&str], what: &str) -> Result<Library, String> {
        let names: Vec<String> = std::env::var(env).into_iter().chain(names.iter().map(|s| s.to_string())).collect();
        for n in &names {
            // SAFETY: loading runs the library's initialisers; these are the vendor's
            // libraries, loaded once.
            if let Ok(lib) = unsafe { Library::new(n) } {
                return Ok(lib);
            }
        }
        Err(format!("{what} was not found (tried {}); install ROCm or set {env} to the file", names.join(", ")))
    }

    fn load() -> Result<Api, String> {
        let rccl = open("COPUS_RCCL_LIB", &["librccl.so.1", "librccl.so"], "RCCL (librccl.so)")?;
        let hip = open("COPUS_HIP_LIB", &["libamdhip64.so.6", "libamdhip64.so.5", "libamdhip64.so"], "the HIP runtime (libamdhip64.so)")?;
        macro_rules! sym {
            ($lib:ident, $name:literal) => {
                // SAFETY: the symbol has the C signature of NCCL's (RCCL's) or HIP's header
                // that the field's type spells out.
                *unsafe { $lib.get($name) }.map_err(|e| format!("{}: {e}", String::from_utf8_lossy(&$name[..$name.len() - 1])))?
            };
        }
        Ok(Api {
            get_unique_id: sym!(rccl, b"ncclGetUniqueId\0"),
            comm_init_rank: sym!(rccl, b"ncclCommInitRank\0"),
            comm_destroy: sym!(rccl, b"ncclCommDestroy\0"),
            get_error_string: sym!(rccl, b"ncclGetErrorString\0"),
            all_reduce: sym!(rccl, b"ncclAllReduce\0"),
            all_gather: sym!(rccl, b"ncclAllGather\0"),
            reduce_scatter: sym!(rccl, b"ncclReduceScatter\0"),
            broadcast: sym!(rccl, b"ncclBroadcast\0"),
            hip_set_device: sym!(hip, b"hipSetDevice\0"),
            hip_get_device_count: sym!(hip, b"hipGetDeviceCount\0"),
            hip_malloc: sym!(hip, b"hipMalloc\0"),
            hip_free: sym!(hip, b"hipFree\0"),
            hip_memcpy: sym!(hip, b"hipMemcpy\0"),
            hip_device_synchronize: sym!(hip, b"hipDeviceSynchronize\0"),
            _rccl: rccl,
            _hip: hip,
        })
    }

    fn api() -> Result<&'static Api, String> {
        static API: OnceLock<Result<Api, String>> = OnceLock::new();
        API.get_or_init(load).as_ref().map_err(Clone::clone)
    }

    fn nccl_check(api: &Api, what: &str, code: c_int) -> Result<(), String> {
        if code == 0 {
            return Ok(());
        }
        // SAFETY: ncclGetErrorString returns a static C string for any code.
        let text = unsafe { CStr::from_ptr((api.get_error_string)(code)) }.to_string_lossy().into_owned();
        Err(format!("{what}: {text} ({code})"))
    }

    fn hip_check(what: &str, code: c_int) -> Result<(), String> {
        if code == 0 { Ok(()) } else { Err(format!("{what} failed with HIP error {code}")) }
    }

    /// A device buffer, freed on drop.
    struct DeviceBuf {
        api: &'static Api,
        ptr: *mut c_void,
    }

    impl DeviceBuf {
        fn new(api: &'static Api, bytes: usize) -> Result<Self, String> {
            let mut ptr = std::ptr::null_mut();
            // SAFETY: hipMalloc writes a device pointer of `bytes` bytes (at least 1).
            hip_check("hipMalloc", unsafe { (api.hip_malloc)(&mut ptr, bytes.max(1)) })?;
            Ok(Self { api, ptr })
        }

        fn upload(api: &'static Api, data: &[u8]) -> Result<Self, String> {
            let d = Self::new(api, data.len())?;
            // SAFETY: `d` holds at least `data.len()` bytes.
            hip_check("hipMemcpy to the device", unsafe { (api.hip_memcpy)(d.ptr, data.as_ptr().cast(), data.len(), HOST_TO_DEVICE) })?;
            Ok(d)
        }

        fn download(&self, out: &mut [u8]) -> Result<(), String> {
            // SAFETY: the collective that wrote this buffer ran on the null stream, which
            // hipDeviceSynchronize drains; the buffer holds at least `out.len()` bytes.
            unsafe {
                hip_check("hipDeviceSynchronize", (self.api.hip_device_synchronize)())?;
                hip_check("hipMemcpy to the host", (self.api.hip_memcpy)(out.as_mut_ptr().cast(), self.ptr, out.len(), DEVICE_TO_HOST))
            }
        }
    }

    impl Drop for DeviceBuf {
        fn drop(&mut self) {
            // SAFETY: `ptr` came from hipMalloc and is freed once.
            unsafe {
                (self.api.hip_free)(self.ptr);
            }
        }
    }

    /// Bytes, element count and NCCL data type of a host buffer.
    fn parts<'a>(h: Host<'a>) -> (&'a mut [u8], usize, c_int) {
        // SAFETY: f32 and f64 slices viewed as their bytes.
        unsafe {
            match h {
                Host::F32(b) => (std::slice::from_raw_parts_mut(b.as_mut_ptr().cast(), b.len() * 4), b.len(), 7),
                Host::F64(b) => (std::slice::from_raw_parts_mut(b.as_mut_ptr().cast(), b.len() * 8), b.len(), 8),
            }
        }
    }

    /// RCCL's communicator.
    pub struct Rccl {
        api: &'static Api,
        comm: Comm,
    }

    impl Drop for Rccl {
        fn drop(&mut self) {
            // SAFETY: the communicator was made by ncclCommInitRank and is destroyed once.
            unsafe {
                (self.api.comm_destroy)(self.comm);
            }
        }
    }

    impl GpuLibrary for Rccl {
        const NAME: &'static str = "RCCL";

        fn check(device: usize) -> Result<(), String> {
            let api = api()?;
            let mut count = 0;
            // SAFETY: writes the device count.
            hip_check("hipGetDeviceCount (no AMD GPU driver?)", unsafe { (api.hip_get_device_count)(&mut count) })?;
            if device >= count.max(0) as usize {
                return Err(format!("ROCm device {device} does not exist ({count} visible)"));
            }
            Ok(())
        }

        fn unique_id() -> Result<[u8; 128], String> {
            let api = api()?;
            let mut id = UniqueId { internal: [0; 128] };
            // SAFETY: writes a unique id.
            nccl_check(api, "ncclGetUniqueId", unsafe { (api.get_unique_id)(&mut id) })?;
            Ok(id.internal.map(|c| c as u8))
        }

        fn join(id: [u8; 128], rank: usize, size: usize, device: usize) -> Result<Self, String> {
            let api = api()?;
            let mut comm = std::ptr::null_mut();
            // SAFETY: selects the device, then joins the communicator of `id`.
            unsafe {
                hip_check("hipSetDevice", (api.hip_set_device)(device as c_int))?;
                let id = UniqueId { internal: id.map(|b| b as c_char) };
                nccl_check(api, "ncclCommInitRank", (api.comm_init_rank)(&mut comm, size as c_int, id, rank as c_int))?;
            }
            Ok(Self { api, comm })
        }

        fn all_reduce(&self, buf: Host<'_>, op: ReduceOp) -> Result<(), String> {
            let (bytes, count, dtype) = parts(buf);
            let d = DeviceBuf::upload(self.api, bytes)?;
            // SAFETY: in place on a device buffer of `count` elements of `dtype`.
            nccl_check(self.api, "ncclAllReduce", unsafe {
                (self.api.all_reduce)(d.ptr, d.ptr, count, dtype, op_code(op), self.comm, std::ptr::null_mut())
            })?;
            d.download(bytes)
        }

        fn all_gather(&self, send: Host<'_>, recv: Host<'_>) -> Result<(), String> {
            let ((sb, count, dtype), (rb, _, _)) = (parts(send), parts(recv));
            let s = DeviceBuf::upload(self.api, sb)?;
            let r = DeviceBuf::new(self.api, rb.len())?;
            // SAFETY: `r` holds size x count elements.
            nccl_check(self.api, "ncclAllGather", unsafe {
                (self.api.all_gather)(s.ptr, r.ptr, count, dtype, self.comm, std::ptr::null_mut())
            })?;
            r.download(rb)
        }

        fn reduce_scatter(&self, send: Host<'_>, recv: Host<'_>, op: ReduceOp) -> Result<(), String> {
            let ((sb, _, dtype), (rb, count, _)) = (parts(send), parts(recv));
            let s = DeviceBuf::upload(self.api, sb)?;
            let r = DeviceBuf::new(self.api, rb.len())?;
            // SAFETY: `s` holds size x count elements, `r` count.
            nccl_check(self.api, "ncclReduceScatter", unsafe {
                (self.api.reduce_scatter)(s.ptr, r.ptr, count, dtype, op_code(op), self.comm, std::ptr::null_mut())
            })?;
            r.download(rb)
        }

        fn broadcast(&self, buf: Host<'_>, root: usize) -> Result<(), String> {
            let (bytes, count, dtype) = parts(buf);
            let d = DeviceBuf::upload(self.api, bytes)?;
            // SAFETY: in place on a device buffer of `count` elements.
            nccl_check(self.api, "ncclBroadcast", unsafe {
                (self.api.broadcast)(d.ptr, d.ptr, count, dtype, root as c_int, self.comm, std::ptr::null_mut())
            })?;
            d.download(bytes)
        }
    }
}

#[cfg(test)]
mod tests {
    /// Without the libraries (this machine has no GPU driver), constructing a communicator
    /// is a clear error naming what is missing, not a panic. Needs MPI (a singleton world).
    #[test]
    #[cfg(any(feature = "nccl", feature = "rccl"))]
    fn missing_libraries_are_a_clear_error() {
        crate::mpi::init().expect("MPI starts as a singleton");
        #[cfg(feature = "nccl")]
        {
            let e = super::NcclComm::new(crate::mpi::MpiComm::world().unwrap(), 0).unwrap_err().to_string();
            assert!(e.starts_with("NCCL on rank 0: "), "{e}");
            assert!(e.contains("libcuda.so") || e.contains("libnccl.so") || e.contains("CUDA device"), "{e}");
        }
        #[cfg(feature = "rccl")]
        {
            let e = super::RcclComm::new(crate::mpi::MpiComm::world().unwrap(), 0).unwrap_err().to_string();
            assert!(e.starts_with("RCCL on rank 0: "), "{e}");
            assert!(e.contains("librccl.so") || e.contains("libamdhip64.so") || e.contains("ROCm device"), "{e}");
        }
    }
}
