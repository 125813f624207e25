//! Ranks as processes: the [`Collective`] over MPI, and the process roles of a run started
//! with `mpirun -np N` (feature `mpi`).
//!
//! Process 0 drives: it runs the training loop, the policy and the reports, and its engine
//! places rank 0 on itself and ranks 1..N on the other processes. Those serve: they wait for
//! the engine's commands (start a layout, step, export, a live layout change, stop) on a
//! control communicator and run their rank (`engine::serve`, in `engine/processes.rs`). A
//! layout change keeps every process running: process 0 sends the reshard plan, the processes
//! exchange the plan's slices among themselves (`engine/live.rs`) and rebuild their
//! communicators by split; nobody restarts.
//!
//! Reductions gather every rank's buffer and add the ranks in order 0, 1, ..., n-1, as the
//! in-process [`ThreadComm`](crate::comm::threads::ThreadComm) does, so a layout trains to the same
//! bits on threads and on processes. That costs about n/2 times the traffic of a ring
//! all-reduce; it is the reference path, chosen for exact parity (see docs/scale-out.md, the scale-out
//! notes).
//!
//! A rank that fails while starting a layout or during a step, a broken control message, and
//! any panic abort the whole job (`MPI_Abort`) after printing the message: the other processes
//! may be inside a collective with the failing one and cannot be released otherwise; the newest
//! checkpoint stays usable with `--resume`. A live layout change that fails in its send or build
//! step is an answer, not a failure: every process drops what it built and keeps training in the
//! old layout, as threads do.

#![allow(unsafe_code)]

use std::cell::RefCell;
use std::sync::Mutex;

use mpi::collective::SystemOperation;
use mpi::datatype::Equivalence;
use mpi::ffi;
use mpi::raw::AsRaw;
use mpi::topology::{Color, SimpleCommunicator};
use mpi::traits::{Communicator, CommunicatorCollectives, Destination, Root, Source};

use super::placement::{RankDevice, node_place, placed_on_node};
use crate::comm::{Aborter, Collective, CommError, Element, ReduceOp, check_partition, check_scatter, chunk_range, combine_into};

/// Tag of replies from the serving processes to process 0 on the control communicator.
const REPLY_TAG: i32 = 7;

/// This process's part in a run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    /// The only process (not started by `mpirun`, or `-np 1`).
    Single,
    /// Process 0 of `size`: runs the loop and drives the others.
    Driver {
        /// Processes in the run.
        size: usize,
    },
    /// Process `rank` of `size`: serves its rank (`engine::serve`).
    Worker {
        /// This process's rank.
        rank: usize,
        /// Processes in the run.
        size: usize,
    },
}

struct Mpi {
    universe: Option<mpi::environment::Universe>,
    control: SimpleCommunicator,
    rank: usize,
    size: usize,
}

// SAFETY: MPI runs at MPI_THREAD_MULTIPLE when there are several processes (checked in
// `init`), so MPI handles may be used from any thread; the control communicator is only used
// through this mutex.
unsafe impl Send for Mpi {}

static MPI: Mutex<Option<Mpi>> = Mutex::new(None);

fn with_mpi<R>(f: impl FnOnce(&mut Mpi) -> R) -> Option<R> {
    MPI.lock().unwrap_or_else(|e| e.into_inner()).as_mut().map(f)
}

/// Why MPI could not be set up for copus.
#[derive(Debug, thiserror::Error)]
pub enum MpiInitError {
    /// Another library in the process initialised MPI first.
    #[error("MPI was already initialised by someone else")]
    AlreadyInitialised,
    /// The MPI library cannot run ranks on several threads of one process.
    #[error("the MPI library gives thread level {0}; copus needs MPI_THREAD_MULTIPLE for several processes")]
    ThreadLevel(String),
}

/// Initialises MPI (once per process) and says this process's role. Call it first thing in
/// `main`, and [`finish`] before returning.
pub fn init() -> Result<Role, MpiInitError> {
    let mut slot = MPI.lock().unwrap_or_else(|e| e.into_inner());
    if slot.is_none() {
        let (universe, level) = mpi::initialize_with_threading(mpi::Threading::Multiple).ok_or(MpiInitError::AlreadyInitialised)?;
        let world = universe.world();
        let (rank, size) = (world.rank() as usize, world.size() as usize);
        // Process 0 talks to the others on its main thread while its rank runs on another.
        if size > 1 && level != mpi::Threading::Multiple {
            return Err(MpiInitError::ThreadLevel(format!("{level:?}")));
        }
        let control = world.duplicate();
        if size > 1 {
            // A panic anywhere leaves the other processes waiting in a collective: end the job.
            let default = std::panic::take_hook();
            std::panic::set_hook(Box::new(move |info| {
                default(info);
                eprintln!("copus: process {rank} panicked; aborting the MPI job");
                SimpleCommunicator::world().abort(101);
            }));
        }
        *slot = Some(Mpi { universe: Some(universe), control, rank, size });
    }
    let m = slot.as_ref().expect("initialised above");
    Ok(role_of(m.rank, m.size))
}

fn role_of(rank: usize, size: usize) -> Role {
    match (rank, size) {
        (_, 0 | 1) => Role::Single,
        (0, size) => Role::Driver { size },
        (rank, size) => Role::Worker { rank, size },
    }
}

/// This process's role; [`Role::Single`] when [`init`] was not called.
pub fn role() -> Role {
    with_mpi(|m| role_of(m.rank, m.size)).unwrap_or(Role::Single)
}

/// Finalises MPI (the engine's `finish` first tells the serving processes to exit). Later
/// calls do nothing.
pub fn finish() {
    let universe = with_mpi(|m| {
        m.rank = 0;
        m.size = 1;
        m.universe.take()
    });
    drop(universe.flatten()); // MPI_Finalize
}

/// The device a GPU rank of a multi-process run uses: [`placed_on_node`] with this process's
/// place on its node from the launcher's environment ([`node_place`]: Open MPI, MPICH, PMI,
/// Slurm) and the devices the node shows. Other devices, and single-process runs, stay as they
/// are.
pub fn on_this_node(device: RankDevice, ranks_per_device: Option<usize>) -> RankDevice {
    if role() == Role::Single {
        return device;
    }
    placed_on_node(device, node_place(|k| std::env::var(k).ok()), device.visible(), ranks_per_device)
}

/// Aborts the whole job with `message` (printed first).
pub fn abort_job(message: &str) -> ! {
    eprintln!("copus: process {} failed: {message}; aborting the MPI job", with_mpi(|m| m.rank).unwrap_or(0));
    SimpleCommunicator::world().abort(1)
}

/// Control messages travel in pieces of at most this many bytes (MPI counts are 32-bit).
const PIECE: usize = 1 << 30;

/// Process 0 sends `bytes` to every process; the others pass `None` and get them.
pub(crate) fn control_broadcast(bytes: Option<Vec<u8>>) -> Result<Vec<u8>, String> {
    with_mpi(|m| {
        let root = m.control.process_at_rank(0);
        let mut len = bytes.as_ref().map_or(0u64, |b| b.len() as u64);
        root.broadcast_into(&mut len);
        let mut buf = bytes.unwrap_or_else(|| vec![0; len as usize]);
        for piece in buf.chunks_mut(PIECE) {
            root.broadcast_into(piece);
        }
        buf
    })
    .ok_or_else(|| "MPI is not initialised".to_string())
}

/// A serving process answers process 0.
pub(crate) fn control_reply(bytes: &[u8]) -> Result<(), String> {
    with_mpi(|m| {
        let to = m.control.process_at_rank(0);
        to.send_with_tag(&(bytes.len() as u64), REPLY_TAG);
        for piece in bytes.chunks(PIECE) {
            to.send_with_tag(piece, REPLY_TAG);
        }
    })
    .ok_or_else(|| "MPI is not initialised".to_string())
}

/// Process 0 waits for process `from`'s answer.
pub(crate) fn control_receive(from: usize) -> Result<Vec<u8>, String> {
    with_mpi(|m| {
        let source = m.control.process_at_rank(from as i32);
        let (len, _) = source.receive_with_tag::<u64>(REPLY_TAG);
        let mut out = Vec::with_capacity(len as usize);
        while out.len() < len as usize {
            out.extend(source.receive_vec_with_tag::<u8>(REPLY_TAG).0);
        }
        out
    })
    .ok_or_else(|| "MPI is not initialised".to_string())
}

/// One rank's communicator over MPI: the world of a layout, or a group split from it.
///
/// Reductions run in one of two modes. Exact (the default of [`MpiComm::world`]): every rank's
/// buffer is gathered and added in rank order, so results are bit-equal to the in-process
/// engine's (what the parity tests compare), at about `n / 2` times a ring's traffic. Native
/// ([`MpiComm::exact`] `false`): `MPI_Allreduce`, the library's ring or tree, equal to the
/// in-process engine to rounding.
pub struct MpiComm {
    comm: SimpleCommunicator,
    exact: bool,
    /// Sends not yet known to be complete, with the buffers they read from.
    pending: RefCell<Vec<(ffi::MPI_Request, Vec<f32>)>>,
}

// SAFETY: MPI runs at MPI_THREAD_MULTIPLE when there are several processes (checked in
// `init`); a communicator is owned by one rank, which uses it from one thread at a time.
unsafe impl Send for MpiComm {}

impl std::fmt::Debug for MpiComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "MpiComm(rank {} of {})", self.comm.rank(), self.comm.size())
    }
}

impl MpiComm {
    /// A fresh communicator over all processes (collective: every process calls it).
    pub fn world() -> Result<Self, CommError> {
        let comm = with_mpi(|m| m.control.duplicate()).ok_or_else(|| CommError::Invalid("MPI is not initialised".into()))?;
        Ok(Self { comm, exact: true, pending: RefCell::new(Vec::new()) })
    }

    /// This communicator with exact (`true`) or native (`false`) reductions; groups split from
    /// it keep the mode.
    pub fn exact(mut self, exact: bool) -> Self {
        self.exact = exact;
        self
    }

    /// The library's own all-reduce of `buf` (after the lengths are checked to agree).
    fn native_all_reduce<T: Element>(&self, buf: &mut [T], op: ReduceOp) -> Result<(), CommError> {
        let n = self.size();
        let mut lens = vec![0u64; n];
        self.comm.all_gather_into(&(buf.len() as u64), &mut lens[..]);
        if let Some((r, l)) = lens.iter().enumerate().find(|(_, l)| **l != buf.len() as u64) {
            return Err(CommError::Mismatch { op: "all_reduce", detail: format!("rank {r} passed {l} elements, this rank {}", buf.len()) });
        }
        fn run<E: Equivalence + Copy>(comm: &SimpleCommunicator, buf: &mut [E], op: ReduceOp) {
            let send = buf.to_vec();
            match op {
                ReduceOp::Sum => comm.all_reduce_into(&send[..], buf, SystemOperation::sum()),
                ReduceOp::Max => comm.all_reduce_into(&send[..], buf, SystemOperation::max()),
            }
        }
        // `Element` is f32 or f64; the size tells which.
        if std::mem::size_of::<T>() == 4 {
            run::<f32>(&self.comm, bytemuck::cast_slice_mut(buf), op);
        } else {
            run::<f64>(&self.comm, bytemuck::cast_slice_mut(buf), op);
        }
        Ok(())
    }

    /// Frees the buffers of sends that completed.
    fn progress(&self) {
        self.pending.borrow_mut().retain_mut(|(req, _)| {
            let mut done = 0;
            // SAFETY: `req` is a live request of this communicator; a completed one is set to
            // MPI_REQUEST_NULL by MPI_Test and its buffer may then go.
            unsafe {
                ffi::MPI_Test(req, &mut done, ffi::RSMPI_STATUS_IGNORE);
            }
            done == 0
        });
    }

    /// Every rank's buffer, in rank order; lengths must agree.
    fn gather_all<T: Element>(&self, op: &'static str, buf: &[T]) -> Result<Vec<T>, CommError> {
        let n = self.size();
        let mut lens = vec![0u64; n];
        self.comm.all_gather_into(&(buf.len() as u64), &mut lens[..]);
        if let Some((r, l)) = lens.iter().enumerate().find(|(_, l)| **l != buf.len() as u64) {
            return Err(CommError::Mismatch { op, detail: format!("rank {r} passed {l} elements, this rank {}", buf.len()) });
        }
        let mut out = vec![T::default(); n * buf.len()];
        self.comm.all_gather_into(as_bytes(buf), as_bytes_mut(&mut out));
        Ok(out)
    }
}

impl Drop for MpiComm {
    fn drop(&mut self) {
        for (mut req, buf) in self.pending.get_mut().drain(..) {
            // SAFETY: waits until MPI no longer reads `buf`, then lets it go.
            unsafe {
                ffi::MPI_Wait(&mut req, ffi::RSMPI_STATUS_IGNORE);
            }
            drop(buf);
        }
    }
}

/// The bytes of a slice of `f32` or `f64` (plain data, no padding).
fn as_bytes<T: Element>(v: &[T]) -> &[u8] {
    bytemuck::cast_slice(v)
}

/// The bytes of a mutable slice of `f32` or `f64`; every byte pattern is a valid value.
fn as_bytes_mut<T: Element>(v: &mut [T]) -> &mut [u8] {
    bytemuck::cast_slice_mut(v)
}

/// Rows `0..n` of `all` (each `len` long) combined over `range`, adding in rank order.
fn combine_rows<T: Element>(all: &[T], n: usize, len: usize, range: std::ops::Range<usize>, op: ReduceOp) -> Vec<T> {
    let mut out = all[range.clone()].to_vec();
    for r in 1..n {
        combine_into(&mut out, &all[r * len + range.start..r * len + range.end], op);
    }
    out
}

impl Collective for MpiComm {
    fn rank(&self) -> usize {
        self.comm.rank() as usize
    }

    fn size(&self) -> usize {
        self.comm.size() as usize
    }

    fn all_reduce<T: Element>(&self, buf: &mut [T], op: ReduceOp) -> Result<(), CommError> {
        let n = self.size();
        if n == 1 {
            return Ok(());
        }
        self.progress();
        if !self.exact {
            return self.native_all_reduce(buf, op);
        }
        let all = self.gather_all("all_reduce", buf)?;
        let len = buf.len();
        buf.copy_from_slice(&combine_rows(&all, n, len, 0..len, op));
        Ok(())
    }

    fn all_gather<T: Element>(&self, buf: &[T]) -> Result<Vec<T>, CommError> {
        self.progress();
        self.gather_all("all_gather", buf)
    }

    fn reduce_scatter<T: Element>(&self, buf: &[T], op: ReduceOp) -> Result<Vec<T>, CommError> {
        let n = self.size();
        check_scatter(buf.len(), n)?;
        self.progress();
        let all = self.gather_all("reduce_scatter", buf)?;
        Ok(combine_rows(&all, n, buf.len(), chunk_range(buf.len(), n, self.rank()), op))
    }

    fn broadcast<T: Element>(&self, buf: &mut Vec<T>, root: usize) -> Result<(), CommError> {
        if root >= self.size() {
            return Err(CommError::Invalid(format!("broadcast root {root} is not a rank of a group of {}", self.size())));
        }
        self.progress();
        let from = self.comm.process_at_rank(root as i32);
        let mut len = buf.len() as u64;
        from.broadcast_into(&mut len);
        if self.rank() != root {
            *buf = vec![T::default(); len as usize];
        }
        from.broadcast_into(as_bytes_mut(&mut buf[..]));
        Ok(())
    }

    fn send(&self, to: usize, tag: u32, buf: Vec<f32>) -> Result<(), CommError> {
        if to >= self.size() {
            return Err(CommError::Invalid(format!("send to rank {to} of a group of {}", self.size())));
        }
        let tag = i32::try_from(tag).map_err(|_| CommError::Invalid(format!("tag {tag} is too large for MPI")))?;
        let count =
            i32::try_from(buf.len()).map_err(|_| CommError::Invalid(format!("{} elements are too many for one MPI send", buf.len())))?;
        self.progress();
        let mut req = std::mem::MaybeUninit::<ffi::MPI_Request>::uninit();
        // SAFETY: `buf`'s heap storage stays in `pending` (moving a Vec does not move it) until
        // MPI_Test or MPI_Wait reports the send complete.
        let req = unsafe {
            ffi::MPI_Isend(
                buf.as_ptr().cast(),
                count,
                f32::equivalent_datatype().as_raw(),
                to as i32,
                tag,
                self.comm.as_raw(),
                req.as_mut_ptr(),
            );
            req.assume_init()
        };
        self.pending.borrow_mut().push((req, buf));
        Ok(())
    }

    fn recv(&self, from: usize, tag: u32) -> Result<Vec<f32>, CommError> {
        if from >= self.size() {
            return Err(CommError::Invalid(format!("receive from rank {from} of a group of {}", self.size())));
        }
        let tag = i32::try_from(tag).map_err(|_| CommError::Invalid(format!("tag {tag} is too large for MPI")))?;
        self.progress();
        Ok(self.comm.process_at_rank(from as i32).receive_vec_with_tag::<f32>(tag).0)
    }

    fn barrier(&self) -> Result<(), CommError> {
        self.progress();
        self.comm.barrier();
        Ok(())
    }

    fn split(&self, groups: &[Vec<usize>]) -> Result<Self, CommError> {
        check_partition(groups, self.size())?;
        let me = self.rank();
        let (color, key) = groups
            .iter()
            .enumerate()
            .find_map(|(i, g)| g.iter().position(|&r| r == me).map(|k| (i, k)))
            .expect("the partition holds every rank");
        let comm = self
            .comm
            .split_by_color_with_key(Color::with_value(color as i32), key as i32)
            .ok_or_else(|| CommError::Invalid("split: MPI returned no communicator".into()))?;
        Ok(Self { comm, exact: self.exact, pending: RefCell::new(Vec::new()) })
    }

    fn abort(&self, message: &str) {
        abort_job(message)
    }

    fn aborter(&self) -> Aborter {
        Box::new(|m| abort_job(m))
    }
}
