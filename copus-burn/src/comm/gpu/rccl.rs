//! RCCL through its NCCL-compatible C interface and the HIP runtime, both loaded with
//! libloading at run time (`COPUS_RCCL_LIB` and `COPUS_HIP_LIB` override the file names).

#![allow(unsafe_code)]

use std::ffi::{CStr, c_char, c_int, c_void};
use std::sync::OnceLock;

use libloading::Library;

use super::library::{GpuLibrary, Host, LibraryError};
use crate::comm::ReduceOp;

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
    match h {
        Host::F32(b) => {
            let n = b.len();
            (bytemuck::cast_slice_mut(b), n, 7)
        }
        Host::F64(b) => {
            let n = b.len();
            (bytemuck::cast_slice_mut(b), n, 8)
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
    const VISIBLE_DEVICES: &'static [&'static str] = &["HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES"];

    fn check(device: usize) -> Result<(), LibraryError> {
        let api = api()?;
        let mut count = 0;
        // SAFETY: writes the device count.
        hip_check("hipGetDeviceCount (no AMD GPU driver?)", unsafe { (api.hip_get_device_count)(&mut count) })?;
        if device >= count.max(0) as usize {
            return Err(format!("ROCm device {device} does not exist ({count} visible)").into());
        }
        Ok(())
    }

    fn unique_id() -> Result<[u8; 128], LibraryError> {
        let api = api()?;
        let mut id = UniqueId { internal: [0; 128] };
        // SAFETY: writes a unique id.
        nccl_check(api, "ncclGetUniqueId", unsafe { (api.get_unique_id)(&mut id) })?;
        Ok(id.internal.map(|c| c as u8))
    }

    fn join(id: [u8; 128], rank: usize, size: usize, device: usize) -> Result<Self, LibraryError> {
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

    fn all_reduce(&self, buf: Host<'_>, op: ReduceOp) -> Result<(), LibraryError> {
        let (bytes, count, dtype) = parts(buf);
        let d = DeviceBuf::upload(self.api, bytes)?;
        // SAFETY: in place on a device buffer of `count` elements of `dtype`.
        nccl_check(self.api, "ncclAllReduce", unsafe {
            (self.api.all_reduce)(d.ptr, d.ptr, count, dtype, op_code(op), self.comm, std::ptr::null_mut())
        })?;
        Ok(d.download(bytes)?)
    }

    fn all_gather(&self, send: Host<'_>, recv: Host<'_>) -> Result<(), LibraryError> {
        let ((sb, count, dtype), (rb, _, _)) = (parts(send), parts(recv));
        let s = DeviceBuf::upload(self.api, sb)?;
        let r = DeviceBuf::new(self.api, rb.len())?;
        // SAFETY: `r` holds size x count elements.
        nccl_check(self.api, "ncclAllGather", unsafe {
            (self.api.all_gather)(s.ptr, r.ptr, count, dtype, self.comm, std::ptr::null_mut())
        })?;
        Ok(r.download(rb)?)
    }

    fn reduce_scatter(&self, send: Host<'_>, recv: Host<'_>, op: ReduceOp) -> Result<(), LibraryError> {
        let ((sb, _, dtype), (rb, count, _)) = (parts(send), parts(recv));
        let s = DeviceBuf::upload(self.api, sb)?;
        let r = DeviceBuf::new(self.api, rb.len())?;
        // SAFETY: `s` holds size x count elements, `r` count.
        nccl_check(self.api, "ncclReduceScatter", unsafe {
            (self.api.reduce_scatter)(s.ptr, r.ptr, count, dtype, op_code(op), self.comm, std::ptr::null_mut())
        })?;
        Ok(r.download(rb)?)
    }

    fn broadcast(&self, buf: Host<'_>, root: usize) -> Result<(), LibraryError> {
        let (bytes, count, dtype) = parts(buf);
        let d = DeviceBuf::upload(self.api, bytes)?;
        // SAFETY: in place on a device buffer of `count` elements.
        nccl_check(self.api, "ncclBroadcast", unsafe {
            (self.api.broadcast)(d.ptr, d.ptr, count, dtype, root as c_int, self.comm, std::ptr::null_mut())
        })?;
        Ok(d.download(bytes)?)
    }
}
