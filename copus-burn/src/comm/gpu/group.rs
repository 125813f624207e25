//! [`GpuComm`]: a rank's communicator on a GPU collective library (NCCL, RCCL), with MPI beside
//! it for ids, point-to-point messages and barriers.

#![allow(unsafe_code)]

use burn::tensor::{Tensor, TensorData};

use crate::comm::mpi::MpiComm;
use crate::comm::{Aborter, Collective, CommError, Element, ReduceOp, check_scatter, chunk_range};
use crate::traffic;

use super::library::{GpuLibrary, LibraryError, host};

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
pub type NcclComm = GpuComm<super::nccl::Nccl>;
/// AMD's RCCL (feature `rccl`).
#[cfg(feature = "rccl")]
pub type RcclComm = GpuComm<super::rccl::Rccl>;

impl<G: GpuLibrary> GpuComm<G> {
    /// The library's communicator over `mpi`'s group, this rank on GPU `device` (collective
    /// over the group). When any rank lacks the driver, the library or the device, every rank
    /// gets the error (the first failing rank's reason).
    pub fn new(mpi: MpiComm, device: usize) -> Result<Self, CommError> {
        let checked = match Self::shared_device(&mpi, device)? {
            Some(shared) => Err(shared),
            None => G::check(device),
        };
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
        Ok(Self { lib: joined.map_err(|e| CommError::Invalid(e.0))?, mpi, device })
    }

    /// The first two ranks of the group on the same device of the same node, if any (the
    /// libraries take one rank per device), found alike on every rank. A device is named by its
    /// node (MPI's processor name), its entry in the first visible-devices list set
    /// ([`GpuLibrary::VISIBLE_DEVICES`]; the index itself where none is set, the whole list and
    /// the index where the list is shorter) and every other list set (RCCL's HIP list indexes
    /// into ROCR's), so ranks that each see one GPU of the node as their device 0 are told apart
    /// by the GPU each was given. Two names of one GPU (`0,1` with device 1 and `1` with device
    /// 0) are not matched here; NCCL's own refusal at joining then falls back alike.
    fn shared_device(mpi: &MpiComm, device: usize) -> Result<Option<LibraryError>, CommError> {
        let node = ::mpi::environment::processor_name().unwrap_or_default();
        let lists: Vec<String> = G::VISIBLE_DEVICES.iter().filter_map(|v| std::env::var(v).ok()).collect();
        let entry = match lists.first() {
            Some(list) => list.split(',').nth(device).map_or_else(|| format!("{list}#{device}"), |e| e.trim().to_string()),
            None => device.to_string(),
        };
        let name = [node, entry].into_iter().chain(lists.into_iter().skip(1)).collect::<Vec<_>>().join("\n");
        // 48 bits of FNV-1a of the name, exact in an f64 and the same on every build.
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        for b in name.bytes() {
            h = (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
        }
        let all = mpi.all_gather(&[(h >> 16) as f64])?;
        Ok(first_shared(&all)
            .map(|(i, j)| format!("ranks {i} and {j} share one device of their node, and {} takes one rank per device", G::NAME).into()))
    }

    /// Every rank learns whether some rank failed, and the lowest failing rank's reason.
    fn agree(mpi: &MpiComm, failure: Option<&LibraryError>) -> Result<(), CommError> {
        let me = mpi.rank() as f64;
        let mut first = vec![if failure.is_some() { -me } else { f64::NEG_INFINITY }];
        mpi.all_reduce(&mut first, ReduceOp::Max)?;
        if first[0] == f64::NEG_INFINITY {
            return Ok(());
        }
        let rank = (-first[0]) as usize;
        let mut text: Vec<f64> = failure.map(|m| m.0.bytes().map(f64::from).collect()).unwrap_or_default();
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

    fn lib_err(e: LibraryError) -> CommError {
        CommError::Invalid(format!("{}: {e}", G::NAME))
    }

    /// [`Collective::all_gather`] once the ranks agreed on the length.
    fn gather_agreed<T: Element>(&self, buf: &[T]) -> Result<Vec<T>, CommError> {
        let mut send = buf.to_vec();
        let mut out = vec![T::default(); buf.len() * self.size()];
        self.lib.all_gather(host(&mut send), host(&mut out)).map_err(Self::lib_err)?;
        Ok(out)
    }

    /// [`Collective::reduce_scatter`] once the ranks agreed on the length and that it divides.
    fn scatter_agreed<T: Element>(&self, buf: &[T], op: ReduceOp) -> Result<Vec<T>, CommError> {
        let mut send = buf.to_vec();
        let mut out = vec![T::default(); chunk_range(buf.len(), self.size(), self.rank()).len()];
        self.lib.reduce_scatter(host(&mut send), host(&mut out), op).map_err(Self::lib_err)?;
        Ok(out)
    }
}

/// `f` on the values of `t` read into host memory, its result uploaded back to `t`'s device
/// (both counted as collective traffic): the path of a tensor the library cannot reach.
fn through_host(t: Tensor<1>, f: impl FnOnce(Vec<f32>) -> Result<Vec<f32>, CommError>) -> Result<Tensor<1>, CommError> {
    let device = t.device();
    let out = f(traffic::read(t, traffic::Kind::Collective).iter::<f32>().collect())?;
    let n = out.len();
    Ok(traffic::upload(TensorData::new(out, [n]), &device, traffic::Kind::Collective))
}

/// `f` on `t`, or, for a tensor of the autodiff kind (a detached activation, the loss's maxima
/// and sums), on its inner tensor, which the library can take in device memory, the result
/// wrapped again: a collective's output is no part of a graph either way.
fn unwrapped(t: Tensor<1>, f: impl FnOnce(Tensor<1>) -> Result<Tensor<1>, CommError>) -> Result<Tensor<1>, CommError> {
    if !t.is_autodiff() {
        return f(t);
    }
    Ok(f(t.inner())?.autodiff())
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

    fn all_reduce_tensor(&self, t: Tensor<1>, op: ReduceOp) -> Result<Tensor<1>, CommError> {
        // One length check, then one library all-reduce on either path, so ranks that took
        // different paths still meet in the same calls.
        self.same_len("all_reduce_tensor", t.dims()[0])?;
        unwrapped(t, |t| match self.lib.all_reduce_tensor(t, op, self.device).map_err(Self::lib_err)? {
            Ok(reduced) => Ok(reduced),
            Err(t) => through_host(t, |mut v| {
                self.lib.all_reduce(host(&mut v), op).map_err(Self::lib_err)?;
                Ok(v)
            }),
        })
    }

    fn reduces_tensors_in_place(&self) -> bool {
        G::TENSORS_IN_PLACE
    }

    fn scatters_tensors_in_place(&self) -> bool {
        G::SCATTERS_TENSORS
    }

    fn reduce_scatter_tensor(&self, t: Tensor<1>, op: ReduceOp) -> Result<Tensor<1>, CommError> {
        let n = self.size();
        // Lengths agreed first: then every rank finds the same answer to whether they divide.
        self.same_len("reduce_scatter_tensor", t.dims()[0])?;
        check_scatter(t.dims()[0], n)?;
        unwrapped(t, |t| match self.lib.reduce_scatter_tensor(t, op, self.device, n).map_err(Self::lib_err)? {
            Ok(mine) => Ok(mine),
            Err(t) => through_host(t, |v| self.scatter_agreed(&v, op)),
        })
    }

    fn all_gather_tensor(&self, t: Tensor<1>) -> Result<Tensor<1>, CommError> {
        let n = self.size();
        self.same_len("all_gather_tensor", t.dims()[0])?;
        unwrapped(t, |t| match self.lib.all_gather_tensor(t, self.device, n).map_err(Self::lib_err)? {
            Ok(all) => Ok(all),
            Err(t) => through_host(t, |v| self.gather_agreed(&v)),
        })
    }

    fn all_gather<T: Element>(&self, buf: &[T]) -> Result<Vec<T>, CommError> {
        self.same_len("all_gather", buf.len())?;
        self.gather_agreed(buf)
    }

    fn reduce_scatter<T: Element>(&self, buf: &[T], op: ReduceOp) -> Result<Vec<T>, CommError> {
        self.same_len("reduce_scatter", buf.len())?;
        check_scatter(buf.len(), self.size())?;
        self.scatter_agreed(buf, op)
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

/// The first pair of ranks `(i, j)`, `i < j`, with the same name of a device in `places`, by `j`.
fn first_shared<T: PartialEq>(places: &[T]) -> Option<(usize, usize)> {
    places.iter().enumerate().find_map(|(j, b)| places[..j].iter().position(|a| a == b).map(|i| (i, j)))
}

/// All-reduces a float tensor on a CUDA device in place across `comm`'s group: NCCL reads
/// and writes the tensor's device memory directly. Returns the reduced tensor (the input
/// is flattened, and copied when it was not contiguous or shared its buffer). The engine's
/// ranks reach it through [`crate::comm::Collective::all_reduce_tensor`].
#[cfg(all(feature = "nccl", feature = "cuda"))]
pub fn cuda_all_reduce<const D: usize>(
    comm: &NcclComm,
    t: burn::tensor::Tensor<D>,
    op: ReduceOp,
) -> Result<burn::tensor::Tensor<D>, CommError> {
    let dims = t.dims();
    let n: usize = dims.iter().product();
    let was_autodiff = t.is_autodiff();
    // Rank 1 is never padded; the reshape is a view when the tensor is contiguous.
    let flat: burn::tensor::Tensor<1> = t.inner().reshape([n]);
    let reduce = |ptr, len| comm.lib.device_op(ptr, ptr, len, len, super::nccl::DeviceOp::AllReduce(op));
    match super::cuda_tensor::in_place(comm.device, flat, reduce)? {
        Ok(out) => {
            let out = out.reshape(dims);
            Ok(if was_autodiff { out.autodiff() } else { out })
        }
        Err(_) => Err(CommError::Invalid("the tensor is not on a CUDA device of Burn's CubeCL backend".into())),
    }
}

#[cfg(test)]
mod tests {
    /// One rank per device: 8 ranks on one GPU, and a second node's device 0, by hand.
    #[test]
    fn ranks_that_share_a_device_are_found() {
        use super::first_shared;
        assert_eq!(first_shared::<(u64, usize)>(&[]), None);
        assert_eq!(first_shared(&[(7, 0), (7, 1), (9, 0), (9, 1)]), None, "two nodes, two GPUs each");
        assert_eq!(first_shared(&[(7, 0); 8]), Some((0, 1)), "eight ranks on one GPU");
        assert_eq!(first_shared(&[(7, 0), (7, 1), (9, 0), (9, 1), (9, 0)]), Some((2, 4)));
        assert_eq!(first_shared(&[(7, 0), (7, 1), (7, 2), (7, 1), (7, 0)]), Some((1, 3)), "the first pair closed");
    }

    /// Without the libraries (this machine has no GPU driver), constructing a communicator
    /// is a clear error naming what is missing, not a panic. Needs MPI (a singleton world).
    #[test]
    #[cfg(any(feature = "nccl", feature = "rccl"))]
    fn missing_libraries_are_a_clear_error() {
        crate::comm::mpi::init().expect("MPI starts as a singleton");
        #[cfg(feature = "nccl")]
        {
            let e = super::NcclComm::new(crate::comm::mpi::MpiComm::world().unwrap(), 0).unwrap_err().to_string();
            assert!(e.starts_with("NCCL on rank 0: "), "{e}");
            assert!(e.contains("libcuda.so") || e.contains("libnccl.so") || e.contains("CUDA device"), "{e}");
        }
        #[cfg(feature = "rccl")]
        {
            let e = super::RcclComm::new(crate::comm::mpi::MpiComm::world().unwrap(), 0).unwrap_err().to_string();
            assert!(e.starts_with("RCCL on rank 0: "), "{e}");
            assert!(e.contains("librccl.so") || e.contains("libamdhip64.so") || e.contains("ROCm device"), "{e}");
        }
    }
}
