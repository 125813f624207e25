//! Collectives on GPUs through NCCL's C interface: NVIDIA's NCCL (feature `nccl`, through
//! cudarc with dynamic loading) and AMD's RCCL (feature `rccl`, which exports the same
//! interface, loaded with libloading). Both sit behind the one
//! [`Collective`](crate::comm::Collective) trait as `GpuComm` (in `group`).
//!
//! One process per GPU, started by `mpirun`: the group's rank 0 makes the library's unique id
//! and MPI broadcasts it; each group made by `Collective::split` gets its own communicator the
//! same way. Point-to-point messages (pipeline activations) and barriers go over MPI, whose
//! sends never wait for the receive, as the engine's schedules require.
//!
//! The trait's slices are host buffers, so those calls stage them to the device and back. The
//! tensor collectives (`Collective::all_reduce_tensor`, the engine's gradient and
//! tensor-parallel sums; `Collective::reduce_scatter_tensor` and
//! `Collective::all_gather_tensor`, ZeRO-1's) run in the tensors' own device memory where
//! the library reaches it, else through one host buffer: NCCL reaches LibTorch's CUDA tensors
//! (feature `tch`, all three, into fresh tensors or the all-reduce in place where the storage
//! is unshared: `tch_memory`) and CubeCL's (feature `cuda`, the all-reduce in place:
//! `cuda_tensor`). Sums follow the library's ring or tree order, so results match the
//! in-process engine to rounding, not to the bit.
//!
//! NCCL and RCCL take one rank per GPU: where ranks of the job share a device (several
//! processes on one GPU), every rank gets an error saying so, and the engine's ranks go over
//! MPI.
//!
//! Without the libraries (no driver, no NCCL/RCCL, no device) every constructor returns a
//! [`CommError`](crate::comm::CommError) saying what is missing, on every rank alike, and never panics.
//!
//! Files: `group` (`GpuComm` over a library, its host fallbacks), `library` (what a library
//! provides), `nccl`, `rccl`, `cuda_tensor` (CubeCL's CUDA memory) and `tch_memory`
//! (LibTorch's memory, also built with `tch` alone for its tests on LibTorch's CPU).

#[cfg(all(feature = "nccl", feature = "cuda"))]
pub mod cuda_tensor;
#[cfg(any(feature = "nccl", feature = "rccl"))]
mod group;
#[cfg(any(feature = "nccl", feature = "rccl"))]
mod library;
#[cfg(feature = "nccl")]
pub mod nccl;
#[cfg(feature = "rccl")]
pub mod rccl;
#[cfg(feature = "tch")]
pub mod tch_memory;

#[cfg(any(feature = "nccl", feature = "rccl"))]
pub use group::GpuComm;
#[cfg(feature = "nccl")]
pub use group::NcclComm;
#[cfg(feature = "rccl")]
pub use group::RcclComm;
#[cfg(all(feature = "nccl", feature = "cuda"))]
pub use group::cuda_all_reduce;
#[cfg(any(feature = "nccl", feature = "rccl"))]
pub use library::{GpuLibrary, Handed, Host, LibraryError};
