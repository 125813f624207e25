//! The in-process backend of [`Collective`]: each rank is a thread of one process, and
//! collectives meet in shared memory.
//!
//! This module's `unsafe` code is the in-place all-reduce, where ranks read and write each
//! other's buffers (the crate's other unsafe modules are listed in its root doc). It is sound
//! from the safe API: [`Element`] is sealed (only `f32`
//! and `f64`), each deposit is typed by its element (ranks passing different types get
//! [`CommError::Mismatch`] before any buffer is touched), and a guard keeps every rank in the
//! window until all have finished, also while one unwinds from a panic.

#![allow(unsafe_code)]

use std::any::Any;
use std::collections::{HashMap, VecDeque};
use std::marker::PhantomData;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use burn::tensor::{Device, Tensor, TensorData};

use super::{
    Aborter, Collective, CommError, Element, ReduceOp, TensorSum, check_partition, check_scatter, chunk_range, combine, combine_into,
    fusion_fence,
};
use crate::traffic;

type Payload = Arc<dyn Any + Send + Sync>;

/// One reusable rendezvous: every rank deposits a payload; once all have, each reads them all.
struct Exchange {
    state: Mutex<ExchangeState>,
    cv: Condvar,
}

struct ExchangeState {
    deposits: Vec<Option<Payload>>,
    arrived: usize,
    published: Option<Arc<Vec<Payload>>>,
    readers_left: usize,
    /// Group ranks that have not yet read the published round.
    unread: Vec<bool>,
    generation: u64,
}

impl Exchange {
    fn new(n: usize) -> Self {
        Self {
            state: Mutex::new(ExchangeState {
                deposits: vec![None; n],
                arrived: 0,
                published: None,
                readers_left: 0,
                unread: vec![false; n],
                generation: 0,
            }),
            cv: Condvar::new(),
        }
    }
}

const POLL: Duration = Duration::from_millis(20);

/// A sub-group: (parent group id, split sequence number, members).
type GroupKey = (u64, u64, Vec<usize>);

/// How long a wait lasts when the world was built without a timeout.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(1800);

struct World {
    size: usize,
    /// The longest any wait lasts.
    timeout: Duration,
    aborted: AtomicBool,
    failure: Mutex<Option<(usize, String)>>,
    mailboxes: Mutex<HashMap<(usize, usize, u32), Arc<Mailbox>>>,
    /// Sub-groups' rendezvous by (parent group id, split sequence number, members).
    groups: Mutex<HashMap<GroupKey, Arc<Exchange>>>,
}

#[derive(Default)]
struct Mailbox {
    queue: Mutex<VecDeque<Letter>>,
    cv: Condvar,
}

/// What one send queues: a host buffer, or a tensor handed over where it lies.
enum Letter {
    Host(Vec<f32>),
    Tensor(Box<Tensor<1>>),
}

impl World {
    fn check(&self) -> Result<(), CommError> {
        if !self.aborted.load(Ordering::Acquire) {
            return Ok(());
        }
        let (rank, message) = lock(&self.failure).clone().unwrap_or((usize::MAX, "unknown failure".into()));
        Err(CommError::Aborted { rank, message })
    }

    fn mailbox(&self, from: usize, to: usize, tag: u32) -> Arc<Mailbox> {
        lock(&self.mailboxes).entry((from, to, tag)).or_default().clone()
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A rank that panicked while holding a lock leaves plain data behind; keep using it (the
    // abort flag already tells everyone the world failed).
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// A rank of an in-process world (one thread per rank), or of a sub-group of it.
pub struct ThreadComm {
    world: Arc<World>,
    /// World ranks of this group's members, in group-rank order.
    members: Vec<usize>,
    rank: usize,
    exchange: Arc<Exchange>,
    group_id: u64,
    splits: AtomicU64,
}

impl std::fmt::Debug for ThreadComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ThreadComm(rank {} of {:?})", self.rank, self.members)
    }
}

impl ThreadComm {
    /// A world of `size` ranks: hand element `i` to the thread that runs rank `i`. Waits last
    /// at most [`DEFAULT_TIMEOUT`].
    pub fn world(size: usize) -> Vec<ThreadComm> {
        Self::world_with_timeout(size, DEFAULT_TIMEOUT)
    }

    /// A world whose every wait (collective or receive) ends with [`CommError::Timeout`] after
    /// `timeout`.
    pub fn world_with_timeout(size: usize, timeout: Duration) -> Vec<ThreadComm> {
        let world = Arc::new(World {
            size,
            timeout,
            aborted: AtomicBool::new(false),
            failure: Mutex::new(None),
            mailboxes: Mutex::new(HashMap::new()),
            groups: Mutex::new(HashMap::new()),
        });
        let exchange = Arc::new(Exchange::new(size));
        (0..size)
            .map(|rank| ThreadComm {
                world: world.clone(),
                members: (0..size).collect(),
                rank,
                exchange: exchange.clone(),
                group_id: 0,
                splits: AtomicU64::new(0),
            })
            .collect()
    }

    /// Queues `letter` for rank `to` under `tag`; never waits for the receive.
    fn post(&self, to: usize, tag: u32, letter: Letter) -> Result<(), CommError> {
        let dst = *self.members.get(to).ok_or_else(|| CommError::Invalid(format!("send to rank {to} of a group of {}", self.size())))?;
        self.world.check()?;
        let mb = self.world.mailbox(self.world_rank(), dst, tag);
        lock(&mb.queue).push_back(letter);
        mb.cv.notify_all();
        Ok(())
    }

    /// Waits for the next letter rank `from` sent under `tag`.
    fn letter(&self, from: usize, tag: u32) -> Result<Letter, CommError> {
        let src =
            *self.members.get(from).ok_or_else(|| CommError::Invalid(format!("receive from rank {from} of a group of {}", self.size())))?;
        let mb = self.world.mailbox(src, self.world_rank(), tag);
        let start = Instant::now();
        let mut q = lock(&mb.queue);
        loop {
            if let Some(v) = q.pop_front() {
                return Ok(v);
            }
            self.world.check()?;
            if start.elapsed() > self.world.timeout {
                let err = self.timed_out("recv", start, std::iter::once(from));
                drop(q);
                self.abort(&err.to_string());
                return Err(err);
            }
            q = mb.cv.wait_timeout(q, POLL).unwrap_or_else(|e| e.into_inner()).0;
        }
    }

    /// This rank's index in the whole world.
    pub fn world_rank(&self) -> usize {
        self.members[self.rank]
    }

    /// World ranks of this group, in group order.
    pub fn members(&self) -> &[usize] {
        &self.members
    }

    /// Whether some rank of the world has aborted.
    pub fn is_aborted(&self) -> bool {
        self.world.aborted.load(Ordering::Acquire)
    }

    /// The timeout error of `op` after waiting since `start` for the group ranks `missing`.
    fn timed_out(&self, op: &'static str, start: Instant, missing: impl Iterator<Item = usize>) -> CommError {
        CommError::Timeout { op, secs: start.elapsed().as_secs_f64(), missing: missing.map(|r| self.members[r]).collect() }
    }

    /// Deposits `mine` and returns every rank's deposit in rank order.
    fn exchange(&self, op: &'static str, mine: Payload) -> Result<Arc<Vec<Payload>>, CommError> {
        let ex = &self.exchange;
        let n = self.members.len();
        let start = Instant::now();
        let mut st = lock(&ex.state);
        // Wait until the previous round has been read by everyone.
        while st.published.is_some() {
            self.world.check()?;
            if start.elapsed() > self.world.timeout {
                let err = self.timed_out(op, start, (0..n).filter(|&r| st.unread[r]));
                drop(st);
                self.abort(&err.to_string());
                return Err(err);
            }
            st = ex.cv.wait_timeout(st, POLL).unwrap_or_else(|e| e.into_inner()).0;
        }
        self.world.check()?;
        st.deposits[self.rank] = Some(mine);
        st.arrived += 1;
        let generation = st.generation;
        if st.arrived == n {
            let all: Vec<Payload> = st.deposits.iter_mut().map(|d| d.take().expect("every rank deposited")).collect();
            st.published = Some(Arc::new(all));
            st.arrived = 0;
            st.readers_left = n;
            st.unread.iter_mut().for_each(|u| *u = true);
            st.generation += 1;
            ex.cv.notify_all();
        } else {
            while st.generation == generation {
                self.world.check()?;
                if start.elapsed() > self.world.timeout {
                    // Take the deposit back before anyone else can complete the round with it
                    // (an in-place all-reduce deposits this rank's buffer address), then fail the
                    // world so every rank stops waiting.
                    let err = self.timed_out(op, start, (0..n).filter(|&r| st.deposits[r].is_none()));
                    st.deposits[self.rank] = None;
                    st.arrived -= 1;
                    drop(st);
                    self.abort(&err.to_string());
                    return Err(err);
                }
                st = ex.cv.wait_timeout(st, POLL).unwrap_or_else(|e| e.into_inner()).0;
            }
        }
        let out = st.published.clone().expect("published for this generation");
        st.unread[self.rank] = false;
        st.readers_left -= 1;
        if st.readers_left == 0 {
            st.published = None;
            ex.cv.notify_all();
        }
        Ok(out)
    }

    fn exchange_vec<T: Element>(&self, op: &'static str, v: Vec<T>) -> Result<Vec<Arc<Vec<T>>>, CommError> {
        let all = self.exchange(op, Arc::new(Arc::new(v)))?;
        all.iter()
            .map(|p| {
                p.downcast_ref::<Arc<Vec<T>>>()
                    .cloned()
                    .ok_or_else(|| CommError::Mismatch { op, detail: "ranks passed different element types".into() })
            })
            .collect()
    }

    fn check_lengths<T>(op: &'static str, all: &[Arc<Vec<T>>], len: usize) -> Result<(), CommError> {
        if let Some((r, v)) = all.iter().enumerate().find(|(_, v)| v.len() != len) {
            return Err(CommError::Mismatch { op, detail: format!("rank {r} passed {} elements, this rank {len}", v.len()) });
        }
        Ok(())
    }

    fn reduce_range<T: Element>(all: &[Arc<Vec<T>>], range: Range<usize>, op: ReduceOp) -> Vec<T> {
        let mut out = all[0][range.clone()].to_vec();
        for other in &all[1..] {
            for (o, &x) in out.iter_mut().zip(&other[range.clone()]) {
                *o = combine(op, *o, x);
            }
        }
        out
    }
}

/// What a rank deposits for an in-place all-reduce: its buffer's address and length, typed by
/// element, and the window all ranks share (rank 0's is used).
struct InPlace<T: Element> {
    addr: usize,
    len: usize,
    window: Arc<Window>,
    _element: PhantomData<fn() -> T>,
}

/// The ranks of one in-place all-reduce while they may touch each other's buffers.
struct Window {
    state: Mutex<WindowState>,
    cv: Condvar,
}

struct WindowState {
    /// Ranks that stopped touching other ranks' buffers.
    left: usize,
    /// The group rank that left by unwinding, if any.
    failed: Option<usize>,
}

/// Held while a rank is in the window. Dropping it (normally or while unwinding) records that
/// the rank left and waits until every rank has: no buffer's owner returns (and frees it) while
/// another rank may still write to it. Once addresses are exchanged no rank can block before it
/// leaves, so the wait ends.
struct InWindow<'a> {
    window: &'a Window,
    ranks: usize,
    rank: usize,
}

impl InWindow<'_> {
    /// Leaves normally; the error names a rank that unwound inside the window.
    fn leave(self, world_rank_of: impl Fn(usize) -> usize) -> Result<(), CommError> {
        let window = self.window;
        drop(self);
        match lock(&window.state).failed {
            None => Ok(()),
            Some(r) => Err(CommError::Aborted { rank: world_rank_of(r), message: "panicked inside an all-reduce".into() }),
        }
    }
}

impl Drop for InWindow<'_> {
    fn drop(&mut self) {
        let mut st = lock(&self.window.state);
        st.left += 1;
        if std::thread::panicking() {
            st.failed.get_or_insert(self.rank);
        }
        self.window.cv.notify_all();
        while st.left < self.ranks {
            st = self.window.cv.wait(st).unwrap_or_else(|e| e.into_inner());
        }
    }
}

#[cfg(test)]
thread_local! {
    /// Test hooks: panic, or sleep, on entering the window.
    static WINDOW_HOOK: std::cell::Cell<(bool, u64)> = const { std::cell::Cell::new((false, 0)) };
}

/// Elements reduced per block: small enough to stay in cache while every rank's block is added.
const BLOCK: usize = 1 << 12;

impl ThreadComm {
    /// Large all-reduce without staging copies: ranks exchange buffer addresses; rank `r`
    /// reduces chunk `r` of every buffer block by block (adding the ranks in order 0..n) and
    /// writes the result into every buffer; then all wait until every chunk is written. Each
    /// rank reads and writes about one buffer's worth.
    ///
    /// Safety argument: each owner keeps its buffer borrowed (`&mut`) and does not return until
    /// every rank has left the window ([`InWindow`], which also holds while unwinding). Every
    /// deposit is checked to be an `InPlace<T>` of this rank's `T` and length before the window
    /// opens; the checks see the same deposits on every rank, so either all ranks enter or none
    /// does. Chunks are disjoint, so no two ranks touch the same element, and no rank reads or
    /// writes its own buffer through the `&mut` while others may access it.
    fn all_reduce_in_place<T: Element>(&self, buf: &mut [T], op: ReduceOp) -> Result<(), CommError> {
        let n = self.size();
        let len = buf.len();
        let window = Arc::new(Window { state: Mutex::new(WindowState { left: 0, failed: None }), cv: Condvar::new() });
        let mine = InPlace::<T> { addr: buf.as_mut_ptr() as usize, len, window, _element: PhantomData };
        let all = self.exchange("all_reduce", Arc::new(mine))?;
        let mut views: Vec<&InPlace<T>> = Vec::with_capacity(n);
        for (r, p) in all.iter().enumerate() {
            // Every rank sees the same deposits, so every rank returns here or none does.
            let Some(v) = p.downcast_ref::<InPlace<T>>() else {
                return Err(CommError::Mismatch {
                    op: "all_reduce",
                    detail: format!("rank {r} passed another element type or a small buffer"),
                });
            };
            if v.len != len {
                return Err(CommError::Mismatch {
                    op: "all_reduce",
                    detail: format!("rank {r} passed {} elements, this rank {len}", v.len),
                });
            }
            views.push(v);
        }
        let guard = InWindow { window: &views[0].window, ranks: n, rank: self.rank };
        #[cfg(test)]
        {
            let (panic, sleep_ms) = WINDOW_HOOK.with(|h| h.get());
            std::thread::sleep(Duration::from_millis(sleep_ms));
            assert!(!panic, "test hook: panic inside the window");
        }
        let chunk = chunk_range(len, n, self.rank);
        let mut acc: Vec<T> = Vec::with_capacity(BLOCK.min(chunk.len()));
        let mut start = chunk.start;
        while start < chunk.end {
            let end = (start + BLOCK).min(chunk.end);
            // SAFETY: `start..end` lies in this rank's chunk, which no other rank touches, of
            // buffers of `len` elements of `T` whose owners stay in the window (see above).
            unsafe {
                let slice = |v: &InPlace<T>| std::slice::from_raw_parts((v.addr as *const T).add(start), end - start);
                acc.clear();
                acc.extend_from_slice(slice(views[0]));
                for v in &views[1..] {
                    combine_into(&mut acc, slice(v), op);
                }
                for v in &views {
                    std::slice::from_raw_parts_mut((v.addr as *mut T).add(start), end - start).copy_from_slice(&acc);
                }
            }
            start = end;
        }
        guard.leave(|r| self.members[r])
    }
}

/// Buffers up to this many elements are reduced whole by every rank (one rendezvous); larger
/// ones are reduced chunk-wise, each rank its chunk, then gathered (two rendezvous, ~1/n of the
/// arithmetic per rank).
const SMALL: usize = 1 << 14;

impl ThreadComm {
    /// The elements `range` of every rank's tensor combined in rank order, on `t`'s device
    /// (`None`: concatenated in rank order); rank `r`'s tensor must have `len_of(r)` elements.
    /// Every rank's tensor is taken and combined while the exchange still holds them all: on
    /// wgpu, combining clones after the exchange had let go of the other ranks' handles gave
    /// wrong sums now and then.
    fn combine_tensors(
        &self,
        op: &'static str,
        t: Tensor<1>,
        how: Option<ReduceOp>,
        range: Range<usize>,
        len_of: impl Fn(usize) -> usize,
    ) -> Result<Tensor<1>, CommError> {
        let (device, n) = (t.device(), t.dims()[0]);
        let whole = range.start == 0 && range.end == n;
        fusion_fence(&device)?;
        let all = self.exchange(op, Arc::new(Mutex::new(t)))?;
        let mut out: Option<Tensor<1>> = None;
        let mut parts = Vec::new();
        for (r, p) in all.iter().enumerate() {
            let t = p
                .downcast_ref::<Mutex<Tensor<1>>>()
                .map(|m| lock(m).clone())
                .ok_or_else(|| CommError::Mismatch { op, detail: "ranks passed different kinds of buffer".into() })?;
            if t.dims()[0] != len_of(r) {
                return Err(CommError::Mismatch {
                    op,
                    detail: format!("rank {r} passed {} elements where {} were due (this rank {n})", t.dims()[0], len_of(r)),
                });
            }
            let t = if whole { t } else { t.narrow(0, range.start, range.len()) };
            let t = t.to_device(&device);
            let Some(how) = how else {
                parts.push(t);
                continue;
            };
            out = Some(match (out, how) {
                (None, _) => t,
                (Some(acc), ReduceOp::Sum) => acc + t,
                // As on the host: the later rank's value where it is greater.
                (Some(acc), ReduceOp::Max) => acc.clone().mask_where(acc.lower(t.clone()), t),
            });
        }
        let out = match how {
            Some(_) => out.expect("a group has at least one rank"),
            None => Tensor::cat(parts, 0),
        };
        if cfg!(feature = "fusion") {
            // No rank lets go of its deposit, or writes over it, before every rank's reads of
            // it have run.
            fusion_fence(&device)?;
            drop(all);
            self.exchange_vec::<f32>("fence", Vec::new())?;
        }
        Ok(out)
    }
}

/// [`ThreadComm::tensor_sum`]'s handle: the rank's place in the group's exchange, for tensor
/// all-reduces only (a copy of the communicator that never splits, so its sub-group ids
/// cannot collide with the original's).
struct ThreadSum(ThreadComm);

impl TensorSum for ThreadSum {
    fn all_reduce_tensor(&self, t: Tensor<1>, op: ReduceOp) -> Result<Tensor<1>, CommError> {
        self.0.all_reduce_tensor(t, op)
    }
}

impl Collective for ThreadComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.members.len()
    }

    fn all_reduce<T: Element>(&self, buf: &mut [T], op: ReduceOp) -> Result<(), CommError> {
        let n = self.size();
        if n == 1 {
            return Ok(());
        }
        if buf.len() <= SMALL {
            let all = self.exchange_vec("all_reduce", buf.to_vec())?;
            Self::check_lengths("all_reduce", &all, buf.len())?;
            buf.copy_from_slice(&Self::reduce_range(&all, 0..buf.len(), op));
            return Ok(());
        }
        self.all_reduce_in_place(buf, op)
    }

    fn reduces_tensors_in_place(&self) -> bool {
        true
    }

    fn tensor_sum(&self) -> Option<Arc<dyn TensorSum>> {
        Some(Arc::new(ThreadSum(ThreadComm {
            world: self.world.clone(),
            members: self.members.clone(),
            rank: self.rank,
            exchange: self.exchange.clone(),
            group_id: self.group_id,
            splits: AtomicU64::new(self.splits.load(Ordering::Relaxed)),
        })))
    }

    fn scatters_tensors_in_place(&self) -> bool {
        true
    }

    fn all_reduce_tensor(&self, t: Tensor<1>, op: ReduceOp) -> Result<Tensor<1>, CommError> {
        if self.size() == 1 {
            return Ok(t);
        }
        let (n, size) = (t.dims()[0], self.size());
        // From three ranks on, each combines its chunk of every rank's tensor and the chunks
        // are gathered: per rank, size - 1 additions of a 1/size chunk and one copy of the
        // whole, where combining the whole on every rank takes size - 1 additions of the whole
        // (8 ranks on one GPU: about 2 tensors' worth of work each against 7). Per element the same sums in
        // the same rank order, so the same bits. Small tensors take one rendezvous instead of two.
        if size < 3 || n < SMALL {
            return self.combine_tensors("all_reduce_tensor", t, Some(op), 0..n, |_| n);
        }
        let mine = self.combine_tensors("all_reduce_tensor", t, Some(op), chunk_range(n, size, self.rank), |_| n)?;
        let len = mine.dims()[0];
        self.combine_tensors("all_reduce_tensor", mine, None, 0..len, |r| chunk_range(n, size, r).len())
    }

    fn reduce_scatter_tensor(&self, t: Tensor<1>, op: ReduceOp) -> Result<Tensor<1>, CommError> {
        let (n, size) = (t.dims()[0], self.size());
        check_scatter(n, size)?;
        if size == 1 {
            return Ok(t);
        }
        self.combine_tensors("reduce_scatter_tensor", t, Some(op), chunk_range(n, size, self.rank), |_| n)
    }

    fn all_gather_tensor(&self, t: Tensor<1>) -> Result<Tensor<1>, CommError> {
        if self.size() == 1 {
            return Ok(t);
        }
        let n = t.dims()[0];
        self.combine_tensors("all_gather_tensor", t, None, 0..n, |_| n)
    }

    fn all_gather<T: Element>(&self, buf: &[T]) -> Result<Vec<T>, CommError> {
        let all = self.exchange_vec("all_gather", buf.to_vec())?;
        Self::check_lengths("all_gather", &all, buf.len())?;
        Ok(all.iter().flat_map(|v| v.iter().copied()).collect())
    }

    fn reduce_scatter<T: Element>(&self, buf: &[T], op: ReduceOp) -> Result<Vec<T>, CommError> {
        self.reduce_scatter_owned(buf.to_vec(), op)
    }

    fn reduce_scatter_owned<T: Element>(&self, buf: Vec<T>, op: ReduceOp) -> Result<Vec<T>, CommError> {
        let (n, len) = (self.size(), buf.len());
        check_scatter(len, n)?;
        let all = self.exchange_vec("reduce_scatter", buf)?;
        Self::check_lengths("reduce_scatter", &all, len)?;
        Ok(Self::reduce_range(&all, chunk_range(len, n, self.rank), op))
    }

    fn broadcast<T: Element>(&self, buf: &mut Vec<T>, root: usize) -> Result<(), CommError> {
        if root >= self.size() {
            return Err(CommError::Invalid(format!("broadcast root {root} is not a rank of a group of {}", self.size())));
        }
        let mine = if self.rank == root { buf.clone() } else { Vec::new() };
        let all = self.exchange_vec("broadcast", mine)?;
        if self.rank != root {
            *buf = all[root].as_ref().clone();
        }
        Ok(())
    }

    fn send(&self, to: usize, tag: u32, buf: Vec<f32>) -> Result<(), CommError> {
        self.post(to, tag, Letter::Host(buf))
    }

    fn recv(&self, from: usize, tag: u32) -> Result<Vec<f32>, CommError> {
        Ok(match self.letter(from, tag)? {
            Letter::Host(v) => v,
            Letter::Tensor(t) => traffic::read(*t, traffic::Kind::Activations).iter::<f32>().collect(),
        })
    }

    fn send_tensor(&self, to: usize, tag: u32, t: Tensor<1>) -> Result<(), CommError> {
        fusion_fence(&t.device())?;
        self.post(to, tag, Letter::Tensor(Box::new(t)))
    }

    fn recv_tensor(&self, from: usize, tag: u32, device: &Device) -> Result<Tensor<1>, CommError> {
        Ok(match self.letter(from, tag)? {
            Letter::Tensor(t) => t.to_device(device),
            Letter::Host(v) => {
                let n = v.len();
                traffic::upload(TensorData::new(v, [n]), device, traffic::Kind::Activations)
            }
        })
    }

    fn barrier(&self) -> Result<(), CommError> {
        if self.size() > 1 {
            self.exchange_vec::<f32>("barrier", Vec::new())?;
        }
        Ok(())
    }

    fn split(&self, groups: &[Vec<usize>]) -> Result<Self, CommError> {
        check_partition(groups, self.size())?;
        let seq = self.splits.fetch_add(1, Ordering::Relaxed);
        let mine = groups.iter().find(|g| g.contains(&self.rank)).expect("partition holds every rank");
        let members: Vec<usize> = mine.iter().map(|&r| self.members[r]).collect();
        let key = (self.group_id, seq, members.clone());
        let exchange = lock(&self.world.groups).entry(key).or_insert_with(|| Arc::new(Exchange::new(members.len()))).clone();
        let rank = mine.iter().position(|&r| r == self.rank).expect("in own group");
        // Group ids only need to be unique per (parent, seq, members); derive one deterministically.
        let group_id = {
            let mut h = self.group_id.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ seq.wrapping_add(1).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            for &m in &members {
                h = (h ^ m as u64).wrapping_mul(0x94d0_49bb_1331_11eb);
            }
            h
        };
        Ok(ThreadComm { world: self.world.clone(), members, rank, exchange, group_id, splits: AtomicU64::new(0) })
    }

    fn abort(&self, message: &str) {
        let mut f = lock(&self.world.failure);
        if f.is_none() {
            *f = Some((self.world_rank(), message.to_string()));
        }
        self.world.aborted.store(true, Ordering::Release);
        drop(f);
        for mb in lock(&self.world.mailboxes).values() {
            mb.cv.notify_all();
        }
        for ex in lock(&self.world.groups).values() {
            ex.cv.notify_all();
        }
        self.exchange.cv.notify_all();
    }

    fn aborter(&self) -> Aborter {
        let handle = self.abort_handle();
        Box::new(move |m| handle.abort(m))
    }
}

/// Lets a rank's thread abort its world after the communicator itself was moved away.
pub struct AbortHandle {
    world: Arc<World>,
    rank: usize,
}

impl AbortHandle {
    /// Marks the world failed with this rank's message.
    pub fn abort(&self, message: &str) {
        let mut f = lock(&self.world.failure);
        if f.is_none() {
            *f = Some((self.rank, message.to_string()));
        }
        self.world.aborted.store(true, Ordering::Release);
    }

    /// Whether some rank of the world has aborted.
    pub fn is_aborted(&self) -> bool {
        self.world.aborted.load(Ordering::Acquire)
    }

    /// Drops every queued message whose tag is at least `from`, and the mailboxes that held
    /// them; returns how many messages there were. Only for when no rank sends or receives such
    /// tags any more.
    pub fn discard_messages(&self, from: u32) -> usize {
        let mut boxes = lock(&self.world.mailboxes);
        let mut dropped = 0;
        boxes.retain(|&(_, _, tag), mb| {
            if tag < from {
                return true;
            }
            dropped += lock(&mb.queue).len();
            false
        });
        dropped
    }
}

impl ThreadComm {
    /// A handle that can abort this world later.
    pub fn abort_handle(&self) -> AbortHandle {
        AbortHandle { world: self.world.clone(), rank: self.world_rank() }
    }

    /// World size (all ranks, not just this group).
    pub fn world_size(&self) -> usize {
        self.world.size
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::thread;

    fn run<R: Send + 'static>(n: usize, f: impl Fn(ThreadComm) -> R + Send + Sync + 'static) -> Vec<R> {
        let f = Arc::new(f);
        let handles: Vec<_> = ThreadComm::world(n)
            .into_iter()
            .map(|c| {
                let f = f.clone();
                thread::spawn(move || f(c))
            })
            .collect();
        handles.into_iter().map(|h| h.join().expect("rank thread")).collect()
    }

    #[test]
    fn chunks_cover_the_buffer() {
        for len in [0, 1, 7, 8, 100] {
            for n in 1..6 {
                let total: usize = (0..n).map(|i| chunk_range(len, n, i).len()).sum();
                assert_eq!(total, len);
                for i in 1..n {
                    assert_eq!(chunk_range(len, n, i - 1).end, chunk_range(len, n, i).start);
                }
            }
        }
    }

    #[test]
    fn all_reduce_sums_in_rank_order_small_and_large() {
        for len in [5, SMALL + 3, 3 * SMALL + 1] {
            let out = run(4, move |c| {
                let r = c.rank() as f32;
                let mut v: Vec<f32> = (0..len).map(|i| r * 1e-3 + (i % 13) as f32 * (r + 1.0)).collect();
                c.all_reduce(&mut v, ReduceOp::Sum).unwrap();
                let mut m: Vec<f64> = (0..len).map(|i| ((i * (c.rank() + 1)) % 17) as f64).collect();
                c.all_reduce(&mut m, ReduceOp::Max).unwrap();
                (v, m)
            });
            for i in 0..len {
                // The reference: a serial sum in rank order, in f32.
                let mut s = 0f32;
                for r in 0..4 {
                    let x = r as f32 * 1e-3 + (i % 13) as f32 * (r as f32 + 1.0);
                    s = if r == 0 { x } else { s + x };
                }
                let mx = (0..4).map(|r| ((i * (r + 1)) % 17) as f64).fold(f64::MIN, f64::max);
                for (v, m) in &out {
                    assert_eq!(v[i].to_bits(), s.to_bits(), "len {len} element {i}");
                    assert_eq!(m[i], mx);
                }
            }
        }
    }

    /// A group that takes every collective from an in-process one except the tensor
    /// all-reduce, which it leaves to the trait's default: through host memory.
    struct ThroughHost(ThreadComm);

    impl Collective for ThroughHost {
        fn rank(&self) -> usize {
            self.0.rank()
        }
        fn size(&self) -> usize {
            self.0.size()
        }
        fn all_reduce<T: Element>(&self, buf: &mut [T], op: ReduceOp) -> Result<(), CommError> {
            self.0.all_reduce(buf, op)
        }
        fn all_gather<T: Element>(&self, buf: &[T]) -> Result<Vec<T>, CommError> {
            self.0.all_gather(buf)
        }
        fn reduce_scatter<T: Element>(&self, buf: &[T], op: ReduceOp) -> Result<Vec<T>, CommError> {
            self.0.reduce_scatter(buf, op)
        }
        fn broadcast<T: Element>(&self, buf: &mut Vec<T>, root: usize) -> Result<(), CommError> {
            self.0.broadcast(buf, root)
        }
        fn send(&self, to: usize, tag: u32, buf: Vec<f32>) -> Result<(), CommError> {
            self.0.send(to, tag, buf)
        }
        fn recv(&self, from: usize, tag: u32) -> Result<Vec<f32>, CommError> {
            self.0.recv(from, tag)
        }
        fn barrier(&self) -> Result<(), CommError> {
            self.0.barrier()
        }
        fn split(&self, groups: &[Vec<usize>]) -> Result<Self, CommError> {
            self.0.split(groups).map(ThroughHost)
        }
        fn abort(&self, message: &str) {
            self.0.abort(message)
        }
        fn aborter(&self) -> Aborter {
            self.0.aborter()
        }
    }

    #[test]
    fn tensor_all_reduce_matches_the_host_all_reduce_bit_for_bit() {
        let len = 3 * SMALL + 5;
        let out = run(3, move |c| {
            let r = c.rank() as f32;
            let v: Vec<f32> = (0..len).map(|i| (i as f32 * 0.37 + r).sin() * 10f32.powi(i as i32 % 7 - 3)).collect();
            let tensor = |v: &[f32]| Tensor::<1>::from_data(TensorData::new(v.to_vec(), [len]), &Default::default());
            let bits = |t: Tensor<1>| t.into_data().iter::<f32>().map(f32::to_bits).collect::<Vec<_>>();
            let mut results = Vec::new();
            for op in [ReduceOp::Sum, ReduceOp::Max] {
                let mut host = v.clone();
                c.all_reduce(&mut host, op).unwrap();
                let device = bits(c.all_reduce_tensor(tensor(&v), op).unwrap());
                results.push((host.iter().map(|x| x.to_bits()).collect::<Vec<_>>(), device));
            }
            // The trait's default, through host memory, counts what it moves.
            let comm = ThroughHost(c);
            traffic::take();
            let through_host = bits(comm.all_reduce_tensor(tensor(&v), ReduceOp::Sum).unwrap());
            let moved = traffic::take().collective;
            // Lengths that differ are an error on every rank, not a hang.
            let short = if comm.rank() == 2 { &v[..len - 1] } else { &v[..] };
            let n = short.len();
            let mismatch =
                comm.0.all_reduce_tensor(Tensor::<1>::from_data(TensorData::new(short.to_vec(), [n]), &Default::default()), ReduceOp::Sum);
            (results, through_host, moved, mismatch.err().map(|e| e.to_string()))
        });
        for (results, through_host, moved, mismatch) in &out {
            for (host, device) in results {
                assert_eq!(host, device, "the tensor all-reduce differs from the host one");
            }
            assert_eq!(through_host, &results[0].0);
            assert_eq!(*moved, 2 * 4 * len as u64, "read once and uploaded once");
            assert!(mismatch.as_deref().is_some_and(|m| m.contains("elements")), "{mismatch:?}");
        }
        assert_eq!(out[0].0, out[1].0);
    }

    /// The tensor reduce-scatter and all-gather (where the tensors lie, and the trait's defaults
    /// through host memory) give the host collectives' values to the bit.
    #[test]
    fn tensor_reduce_scatter_and_all_gather_match_the_host_ones_bit_for_bit() {
        let len = 3 * 1000;
        let out = run(3, move |c| {
            let r = c.rank() as f32;
            let v: Vec<f32> = (0..len).map(|i| (i as f32 * 0.37 + r).sin() * 10f32.powi(i as i32 % 7 - 3)).collect();
            let tensor = |v: &[f32]| Tensor::<1>::from_data(TensorData::new(v.to_vec(), [v.len()]), &Default::default());
            let bits = |t: Tensor<1>| t.into_data().iter::<f32>().map(f32::to_bits).collect::<Vec<_>>();
            let host_bits = |v: Vec<f32>| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            let host = host_bits(c.reduce_scatter(&v, ReduceOp::Sum).unwrap());
            let in_place = bits(c.reduce_scatter_tensor(tensor(&v), ReduceOp::Sum).unwrap());
            let gathered = host_bits(c.all_gather(&v[..7]).unwrap());
            let gathered_in_place = bits(c.all_gather_tensor(tensor(&v[..7])).unwrap());
            let comm = ThroughHost(c);
            let through_host = (
                bits(comm.reduce_scatter_tensor(tensor(&v), ReduceOp::Sum).unwrap()),
                bits(comm.all_gather_tensor(tensor(&v[..7])).unwrap()),
            );
            // A length that does not split into equal chunks is an error.
            let uneven = comm.0.reduce_scatter_tensor(tensor(&v[..len - 1]), ReduceOp::Sum).err().map(|e| e.to_string());
            (host, in_place, gathered, gathered_in_place, through_host, uneven)
        });
        for (host, in_place, gathered, gathered_in_place, through_host, uneven) in &out {
            assert_eq!(host.len(), len / 3);
            assert_eq!(host, in_place, "the tensor reduce-scatter differs from the host one");
            assert_eq!(gathered, gathered_in_place, "the tensor all-gather differs from the host one");
            assert_eq!((&through_host.0, &through_host.1), (host, gathered));
            assert!(uneven.as_deref().is_some_and(|m| m.contains("equal chunks")), "{uneven:?}");
        }
        assert_ne!(out[0].0, out[1].0, "each rank gets its own chunk");
    }

    #[test]
    fn gather_scatter_broadcast_send_recv_and_split() {
        let out = run(6, |c| {
            let r = c.rank();
            let g = c.all_gather(&[r as f32, 10.0 * r as f32]).unwrap();
            let rs = c.reduce_scatter(&(0..12).map(|i| (i + r) as f64).collect::<Vec<_>>(), ReduceOp::Sum).unwrap();
            let mut b = if r == 2 { vec![7.0f32, 8.0] } else { vec![] };
            c.broadcast(&mut b, 2).unwrap();
            // Ring: send to the next rank under two tags, in opposite orders.
            c.send((r + 1) % 6, 1, vec![r as f32]).unwrap();
            c.send((r + 1) % 6, 2, vec![100.0 + r as f32]).unwrap();
            let two = c.recv((r + 5) % 6, 2).unwrap();
            let one = c.recv((r + 5) % 6, 1).unwrap();
            // Odd and even ranks form two groups; sum world ranks within them.
            let sub = c.split(&[vec![0, 2, 4], vec![5, 3, 1]]).unwrap();
            let mut s = vec![r as f32];
            sub.all_reduce(&mut s, ReduceOp::Sum).unwrap();
            sub.barrier().unwrap();
            (g, rs, b, one[0], two[0], s[0], sub.rank(), sub.size())
        });
        for (r, (g, rs, b, one, two, s, sub_rank, sub_size)) in out.into_iter().enumerate() {
            assert_eq!(g, (0..6).flat_map(|q| [q as f32, 10.0 * q as f32]).collect::<Vec<_>>());
            let expect: Vec<f64> = (2 * r..2 * r + 2).map(|i| (0..6).map(|q| (i + q) as f64).sum()).collect();
            assert_eq!(rs, expect);
            assert_eq!(b, vec![7.0, 8.0]);
            assert_eq!(one, ((r + 5) % 6) as f32);
            assert_eq!(two, 100.0 + ((r + 5) % 6) as f32);
            assert_eq!(s, if r % 2 == 0 { 6.0 } else { 9.0 });
            assert_eq!(sub_size, 3);
            let order: &[usize] = if r % 2 == 0 { &[0, 2, 4] } else { &[5, 3, 1] };
            assert_eq!(order[sub_rank], r);
        }
    }

    #[test]
    fn bad_arguments_are_errors() {
        let out = run(2, |c| {
            let e1 = c.split(&[vec![0, 0, 1]]).err();
            let e2 = c.send(5, 0, vec![]).err();
            let e3 = c.reduce_scatter(&[1.0f32, 2.0, 3.0], ReduceOp::Sum).err();
            (e1, e2, e3)
        });
        for (e1, e2, e3) in out {
            assert!(e1.unwrap().to_string().contains("appears 2 times"));
            assert!(e2.unwrap().to_string().contains("send to rank 5"));
            assert!(e3.unwrap().to_string().contains("3 elements"));
        }
    }

    #[test]
    fn a_rank_that_never_arrives_times_out_every_wait_naming_it() {
        let world = ThreadComm::world_with_timeout(4, Duration::from_millis(300));
        let started = std::time::Instant::now();
        let handles: Vec<_> = world
            .into_iter()
            .map(|c| {
                thread::spawn(move || match c.rank() {
                    // Rank 3 hangs (it outlives the others' timeout, then leaves).
                    3 => {
                        thread::sleep(Duration::from_millis(1500));
                        None
                    }
                    // Rank 2 waits for a message rank 3 never sends.
                    2 => c.recv(3, 7).err(),
                    // Ranks 0 and 1 wait for rank 3 in an all-reduce, small and in place.
                    0 => c.all_reduce(&mut [1.0f32; 4], ReduceOp::Sum).err(),
                    _ => c.all_reduce(&mut [1.0f32; 4], ReduceOp::Sum).err(),
                })
            })
            .collect();
        let out: Vec<Option<CommError>> = handles.into_iter().map(|h| h.join().unwrap()).collect();
        // The first rank to time out fails the world; the others either time out themselves or
        // are released by that failure, whose message is the timeout.
        let mut timeouts = 0;
        for (r, e) in out.iter().enumerate().take(3) {
            match e {
                Some(CommError::Timeout { op: "all_reduce", secs, missing }) => {
                    // Rank 2 is in a receive, rank 3 nowhere: neither arrived (the other
                    // all-reduce rank may have timed out and left first).
                    let named = missing.contains(&2) && missing.contains(&3) && !missing.contains(&r);
                    assert!(r < 2 && named && *secs >= 0.3, "rank {r}: {e:?}");
                    timeouts += 1;
                }
                Some(CommError::Timeout { op: "recv", missing, .. }) => {
                    assert!(r == 2 && missing == &vec![3], "rank {r}: {e:?}");
                    timeouts += 1;
                }
                Some(CommError::Aborted { message, .. }) => assert!(message.contains("timed out"), "rank {r}: {message}"),
                other => panic!("rank {r}: {other:?}"),
            }
        }
        assert!(timeouts >= 1);
        let e = out.iter().flatten().find(|e| matches!(e, CommError::Timeout { op: "all_reduce", .. })).map(ToString::to_string);
        if let Some(e) = e {
            assert!(e.contains("all_reduce") && e.contains("3]") && e.contains("timed out"), "{e}");
        }
        assert!(started.elapsed() < Duration::from_secs(10));
    }

    #[test]
    fn an_aborting_rank_releases_everyone_with_its_message() {
        let out = run(4, |c| {
            if c.rank() == 2 {
                c.abort("out of memory in layer 3");
                return None;
            }
            // Ranks 0 and 1 wait in a collective that can never complete; rank 3 in a receive.
            if c.rank() == 3 { c.recv(2, 0).err() } else { c.all_reduce(&mut [1.0f32], ReduceOp::Sum).err() }
        });
        for (r, e) in out.into_iter().enumerate() {
            if r != 2 {
                assert_eq!(e, Some(CommError::Aborted { rank: 2, message: "out of memory in layer 3".into() }));
            }
        }
    }

    #[test]
    fn different_element_types_above_the_in_place_threshold_are_a_mismatch() {
        let out = run(2, |c| {
            if c.rank() == 0 {
                let mut v = vec![1f32; SMALL + 10];
                (c.all_reduce(&mut v, ReduceOp::Sum).err(), v.iter().all(|&x| x == 1.0))
            } else {
                let mut v = vec![1f64; SMALL + 10];
                (c.all_reduce(&mut v, ReduceOp::Sum).err(), v.iter().all(|&x| x == 1.0))
            }
        });
        for (e, untouched) in out {
            assert!(matches!(e, Some(CommError::Mismatch { op: "all_reduce", .. })), "{e:?}");
            assert!(untouched, "a refused all-reduce must not touch the buffer");
        }
    }

    #[test]
    fn a_small_and_a_large_buffer_are_a_mismatch_not_a_panic() {
        let out = run(2, |c| {
            let mut v = vec![1f32; if c.rank() == 0 { 8 } else { SMALL + 8 }];
            c.all_reduce(&mut v, ReduceOp::Sum).err()
        });
        for e in out {
            assert!(matches!(e, Some(CommError::Mismatch { .. })), "{e:?}");
        }
    }

    #[test]
    fn a_rank_that_panics_inside_the_window_waits_for_the_others_to_leave() {
        // Rank 1 panics on entering the window; rank 3 sleeps 300 ms there before it writes its
        // chunk into every buffer, rank 1's included. Rank 1's buffer must outlive those writes:
        // its unwinding takes at least the sleep, and the others report rank 1's failure.
        const SLEEP_MS: u64 = 300;
        let out = run(4, |c| {
            let r = c.rank();
            WINDOW_HOOK.with(|h| h.set((r == 1, if r == 3 { SLEEP_MS } else { 0 })));
            let mut v = vec![r as f32; 3 * SMALL];
            let started = std::time::Instant::now();
            let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| c.all_reduce(&mut v, ReduceOp::Sum)));
            let elapsed = started.elapsed();
            drop(v);
            (result.map_err(|_| ()), elapsed)
        });
        for (r, (result, elapsed)) in out.into_iter().enumerate() {
            if r == 1 {
                assert!(result.is_err(), "rank 1 panicked");
                assert!(elapsed >= Duration::from_millis(SLEEP_MS), "rank 1 returned after {elapsed:?}, before rank 3 left");
            } else {
                let e = result.expect("no panic").err();
                assert_eq!(e, Some(CommError::Aborted { rank: 1, message: "panicked inside an all-reduce".into() }), "rank {r}");
            }
        }
    }
}
