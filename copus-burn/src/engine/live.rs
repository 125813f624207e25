//! Live layout changes between running ranks, threads of this process and MPI processes
//! alike, the rank side (the driver side, which sends the three commands, agrees on what moves
//! and checks every piece, is `crate::reconfig`; `processes.rs` carries the commands to other
//! processes): the ranks stay up and exchange exactly the slices copus-core's
//! [`ReshardPlan`](copus_core::reshard::ReshardPlan) names, of the weights, both AdamW
//! moments and the probe's previous gradient, point to point through the world communicator.
//! Nothing is gathered in one place.
//!
//! Three commands, each run by every rank in parallel:
//! 1. *send*: each rank offers the plan's moves whose source it is. Between threads of this
//!    process a piece is neither copied nor read: the receiver gets a shared handle to the
//!    sender's shard and where the piece lies in it
//!    ([`Handoff`](super::messages::Handoff)); on a device, a view of the shard there. Between
//!    processes the piece is cut and sent (a send never blocks), with its checksum taken as it
//!    is cut;
//! 2. *build*: each rank splits its new process groups from the world, takes the moves whose
//!    destination it is (all already offered), assembles its new shards (each value written
//!    once, straight from where it lies, and summed as it lands), builds the new stage and
//!    optimizer beside the old ones and checks what it loaded against what it received (on
//!    Flex by the buffer the stage adopted, elsewhere piece by piece). A piece handed over
//!    between threads is compared bit for bit with the sender's shard as each block is copied;
//!    where all matched, its checksum at the source is the one taken where it landed. On a
//!    device the pieces are joined there and each compared, element by element, with what it
//!    became; the counts of differing elements are read back at once, and a piece's checksums
//!    (which name it) agree where its count is zero ([`device_sum`]). The built stage takes
//!    the joined weights as they are;
//! 3. *commit* or *abort*: the driver compares every piece's checksum at its source (the sender's
//!    shard, or the piece as cut) and at its destination, and checks that each move of the plan
//!    went exactly once; then every rank swaps to the new state, or drops it and keeps the old
//!    one (rollback costs nothing).
//!
//! A failure on a rank in steps 1-2 is reported as a reply, not as a rank failure: the world is
//! not aborted and the old state keeps training.

use std::collections::{HashMap, HashSet};
use std::time::Instant;

use burn::backend::flex::FlexTensor;
use burn::tensor::{Device, Int, Tensor, TensorData};
use copus_core::layout::RankGrid;
use copus_core::model::{ParamSpec, TpSplit};

use super::error::ReconfigPhase;
use super::messages::{Agreed, LiveJob, PhaseError, Received, Sent, Shared, kinds, tag, tags_fit};
use super::rank::{Groups, RankState};
use crate::comm::Collective;
use crate::grads::with_values;
use crate::optim as adamw;
use crate::parallel::{ParallelLm, ShardPlan, ShardSource, holds};
use crate::state::{Checksum, RankResume, ShardValues, checksum};
use crate::traffic::{self, Kind};

/// The Flex handle of a contiguous f32 tensor (under autodiff, of its value), whose values can
/// be read in place.
fn flex_values(t: &Tensor<1>) -> Option<FlexTensor> {
    adamw::contiguous_f32(&t.clone().inner())
}

/// The local shape of a rank's shard of `spec` under `tp`.
fn local_shape(spec: &ParamSpec, tp: usize) -> Vec<usize> {
    let mut shape = spec.shape.clone();
    if let TpSplit::Split { dim, .. } = spec.tp {
        shape[dim] /= tp;
    }
    shape
}

/// (outer, extent, inner) of a row-major tensor of `shape` around `dim`.
fn around(shape: &[usize], dim: usize) -> (usize, usize, usize) {
    let outer = shape[..dim].iter().product();
    let inner = shape[dim + 1..].iter().product();
    (outer, shape[dim], inner)
}

/// Elements copied between two checksum updates: small enough that the block just written is
/// still in cache when it is summed.
const BLOCK: usize = 1 << 13;

/// Appends `row` to `out` block by block, summing each block just written while it is in cache
/// into `sum`. With `same`, each block written is also compared, bit for bit, with the block it
/// was copied from, and `same` turns false at the first difference: where every block matched,
/// the source's checksum is the landed one, with no second pass of the hash.
fn push_summed(out: &mut Vec<f32>, row: &[f32], sum: &mut Checksum, mut same: Option<&mut bool>) {
    for block in row.chunks(BLOCK) {
        out.extend_from_slice(block);
        let written = &out[out.len() - block.len()..];
        sum.update(written);
        if let Some(same) = same.as_deref_mut() {
            // Compared as bits (a NaN equals itself, -0.0 differs from +0.0).
            // `black_box`: the compiler may not assume the copy it just made equals its source.
            *same &= bytemuck::cast_slice::<f32, u32>(std::hint::black_box(written)) == bytemuck::cast_slice::<f32, u32>(block);
        }
    }
}

/// The rows of entries `[offset, offset + len)` along `dim` of `values` (row-major, `shape`):
/// one contiguous run per index of the dims before `dim`.
fn rows_along<'a>(
    values: &'a [f32],
    shape: &[usize],
    dim: usize,
    offset: usize,
    len: usize,
) -> Result<impl Iterator<Item = &'a [f32]> + use<'a>, String> {
    let (outer, extent, inner) = around(shape, dim);
    if offset + len > extent || values.len() != outer * extent * inner {
        return Err(format!("slice {offset}..{} along dim {dim} of a {shape:?} shard of {} values", offset + len, values.len()));
    }
    let row = len * inner;
    Ok((0..outer).map(move |o| {
        let base = (o * extent + offset) * inner;
        &values[base..base + row]
    }))
}

/// Entries `[offset, offset + len)` along `dim` of `values` (row-major, `shape`), and their
/// checksum, taken in the same pass.
pub(super) fn slice_along(values: &[f32], shape: &[usize], dim: usize, offset: usize, len: usize) -> Result<(Vec<f32>, u64), String> {
    let rows = rows_along(values, shape, dim, offset, len)?;
    let mut out = Vec::with_capacity(values.len() / shape[dim].max(1) * len);
    let mut sum = Checksum::new();
    for row in rows {
        push_summed(&mut out, row, &mut sum, None);
    }
    Ok((out, sum.finish()))
}

/// A piece as it arrived: its own values (through the communicator), still in the sender's
/// shard (handed over between threads in host memory), or a tensor on a device (handed over
/// between threads there), `[outer, len, inner]` around the split dim.
enum Piece {
    Owned(Vec<f32>),
    Shared(Shared),
    // Boxed: a tensor handle is some hundreds of bytes under wgpu.
    Device(Box<Tensor<3>>),
}

impl Piece {
    /// The piece's rows along `dim` (`len` entries of the receiver's `shape` there), as
    /// [`rows_along`] gives them.
    fn rows<'a>(&'a self, shape: &[usize], dim: usize, len: usize) -> Result<impl Iterator<Item = &'a [f32]> + use<'a>, String> {
        match self {
            Piece::Owned(v) => {
                let mut own = shape.to_vec();
                own[dim] = len;
                rows_along(v, &own, dim, 0, len)
            }
            Piece::Shared(p) => {
                let (outer, _, inner) = around(shape, dim);
                let (o, _, i) = around(&p.shape, p.dim);
                if p.dim != dim || p.len != len || (o, i) != (outer, inner) {
                    return Err(format!(
                        "a piece of {} entries along dim {} of a {:?} shard does not fit {len} along dim {dim} of a {shape:?} shard",
                        p.len, p.dim, p.shape
                    ));
                }
                let values = p.values.as_slice::<f32>().ok_or("a handed-over shard is no longer contiguous")?;
                rows_along(values, &p.shape, p.dim, p.offset, p.len)
            }
            Piece::Device(_) => Err("a piece on a device has no rows in host memory".into()),
        }
    }

    /// Elements held.
    fn len(&self) -> usize {
        match self {
            Piece::Owned(v) => v.len(),
            Piece::Shared(p) => {
                let (outer, _, inner) = around(&p.shape, p.dim);
                outer * p.len * inner
            }
            Piece::Device(t) => t.dims().iter().product(),
        }
    }
}

/// That pieces `(offset, len)` along `dim`, in order, tile a shard of `shape` exactly.
fn check_tiling(shape: &[usize], dim: usize, pieces: impl Iterator<Item = (usize, usize)>) -> Result<(), String> {
    let mut at = 0;
    for (offset, len) in pieces {
        if offset != at {
            return Err(format!("pieces along dim {dim} of a {shape:?} shard leave a gap or overlap at {at}"));
        }
        at += len;
    }
    if at != shape[dim] {
        return Err(format!("pieces along dim {dim} of a {shape:?} shard cover {at} of {} entries", shape[dim]));
    }
    Ok(())
}

/// The elements of `a` and `b` (one shape) that differ, as a one-element count where they lie (a
/// NaN equals a NaN, and, as values, -0.0 equals +0.0: a copy that flipped only a zero's sign
/// goes unseen, where the host path compares bits).
fn mismatches<const D: usize>(a: Tensor<D>, b: Tensor<D>) -> Tensor<1, Int> {
    let (a, b) = (a.inner(), b.inner());
    let same = a.clone().equal(b.clone()).bool_or(a.is_nan().bool_and(b.is_nan()));
    same.bool_not().int().sum()
}

/// A shard joined on its device, and per piece its tag, its elements and the count of those
/// that differ where it landed, not yet read.
type Joined = (Tensor<1>, Vec<(u32, usize, Tensor<1, Int>)>);

/// A shard joined on its device from pieces `(offset, len, tag, piece)` along `dim`, sorted by
/// offset, that must tile it exactly (each `[outer, len, inner]` of the shard's `shape`, moved to
/// `device` if they lie elsewhere): the flat shard, and per piece its tag, its elements and the
/// count of those that differ where it landed, not yet read.
fn join_on_device(shape: &[usize], dim: usize, pieces: Vec<(usize, usize, u32, Tensor<3>)>, device: &Device) -> Result<Joined, String> {
    check_tiling(shape, dim, pieces.iter().map(|p| (p.0, p.1)))?;
    let (outer, _, inner) = around(shape, dim);
    for (_, len, _, t) in &pieces {
        if t.dims() != [outer, *len, inner] {
            return Err(format!("a piece of shape {:?} does not fit {len} along dim {dim} of a {shape:?} shard", t.dims()));
        }
    }
    let moved: Vec<(usize, usize, u32, Tensor<3>)> = pieces.into_iter().map(|(o, l, tag, t)| (o, l, tag, t.to_device(device))).collect();
    let joined = Tensor::cat(moved.iter().map(|p| p.3.clone()).collect(), 1);
    let checks = moved.into_iter().map(|(o, l, tag, t)| (tag, outer * l * inner, mismatches(joined.clone().narrow(1, o, l), t))).collect();
    Ok((joined.reshape([outer * shape[dim] * inner]), checks))
}

/// The checksum a piece handed over on a device reports, at its source and where it landed: its
/// content is compared there, element by element, not hashed, so the sum names the piece (its
/// tag and length); where the comparison found a difference, the source's sum differs from the
/// landed one, and the driver refuses the change.
fn device_sum(tag: u32, len: usize, differing: i64) -> (u64, u64) {
    let landed = (u64::from(tag) << 32) ^ len as u64;
    (landed, if differing == 0 { landed } else { landed ^ 1 })
}

/// A shard built by [`assemble`].
#[derive(Debug)]
struct Assembled {
    values: Vec<f32>,
    /// Per piece: its checksum as it landed, and, for a piece handed over between threads, its
    /// checksum at the sender's shard.
    sums: Vec<(u64, Option<u64>)>,
}

/// Builds a shard of `shape` from pieces `(offset, len, piece)` along `dim`, sorted by offset,
/// that must tile it exactly. Each value is written once, in order, with no zero-fill first, and
/// each piece summed as it lands, in the same pass. A piece handed over is compared with its
/// source as it is copied: its source checksum is the landed one where every bit matched, and is
/// taken from the source in a pass of its own where one did not.
fn assemble(shape: &[usize], dim: usize, pieces: &[(usize, usize, Piece)]) -> Result<Assembled, String> {
    let (outer, extent, inner) = around(shape, dim);
    check_tiling(shape, dim, pieces.iter().map(|p| (p.0, p.1)))?;
    let mut rows = pieces.iter().map(|(_, len, p)| p.rows(shape, dim, *len)).collect::<Result<Vec<_>, _>>()?;
    // Per piece: the landed checksum, and for a piece handed over whether its copy matched so far.
    let mut sums: Vec<(Checksum, Option<bool>)> =
        pieces.iter().map(|(_, _, p)| (Checksum::new(), matches!(p, Piece::Shared(_)).then_some(true))).collect();
    let mut out = Vec::with_capacity(outer * extent * inner);
    for _ in 0..outer {
        for (r, (sum, same)) in rows.iter_mut().zip(&mut sums) {
            let row = r.next().ok_or("a piece ran short")?;
            push_summed(&mut out, row, sum, same.as_mut());
        }
    }
    let mut done = Vec::with_capacity(pieces.len());
    for ((sum, same), (_, len, piece)) in sums.iter().zip(pieces) {
        let landed = sum.finish();
        let source = match same {
            None => None,
            Some(true) => Some(landed),
            // A copy that differs from its source: the source's own checksum, which the driver
            // then finds unequal to the landed one.
            Some(false) => {
                let mut s = Checksum::new();
                piece.rows(shape, dim, *len)?.for_each(|row| s.update(row));
                Some(s.finish())
            }
        };
        done.push((landed, source));
    }
    Ok(Assembled { values: out, sums: done })
}

/// A new weight shard as it was assembled: its pieces' landed checksums along `dim`, and the
/// buffer (address, values) it was assembled in.
struct Landed {
    shape: Vec<usize>,
    dim: usize,
    pieces: Vec<(usize, usize, u64)>,
    buffer: (usize, usize),
}

impl Landed {
    /// Whether the built stage's tensor `t` holds these values. A stage that keeps the very buffer
    /// it was given (Flex adopts host buffers as they are) holds them with nothing read: a buffer
    /// of the same address and length alive in the stage is the one assembled, unless the builder
    /// freed it and filled a new allocation that landed in its place, which a stage builder (it
    /// takes each shard as it is) does not do. Otherwise each piece is summed again where it lies
    /// in `t` and compared with its landed checksum.
    fn held_by(&self, t: &Tensor<1>) -> bool {
        if let Some(f) = flex_values(t)
            && let Some(v) = f.as_slice::<f32>()
            && (v.as_ptr() as usize, v.len()) == self.buffer
        {
            return true;
        }
        with_values(t, Kind::State, |v| {
            self.pieces.iter().all(|&(offset, len, sum)| {
                rows_along(v, &self.shape, self.dim, offset, len).is_ok_and(|rows| {
                    let mut c = Checksum::new();
                    rows.for_each(|row| c.update(row));
                    c.finish() == sum
                })
            })
        })
    }
}

/// A piece of a new shard as it arrived: its offset and length along the split dim, its tag.
type Arrival = (usize, usize, u32, Piece);

/// A new shard's local shape and, per kind, its values once a piece has arrived.
type NewShard = (Vec<usize>, Vec<Option<ShardValues>>);

impl<L: ParallelLm, C: Collective> RankState<L, C> {
    /// Step 1: sends this rank's pieces of the plan.
    pub(super) fn live_send(&self, job: &LiveJob) -> Result<Sent, String> {
        let me = self.rank;
        let clock = Instant::now();
        // This rank's shards by name: the local shape, then the weights, each optimizer moment
        // and the previous gradient, as tensors read where they lie.
        let super::rank::FlatState { shards: local, scalars, stepped, has_previous } = self.flat_state()?;
        let fields: Vec<String> = if stepped { vec![adamw::MOMENT_1.to_string(), adamw::MOMENT_2.to_string()] } else { Vec::new() };
        let kinds = kinds(&fields, has_previous);
        if !tags_fit(job.plan.moves.len(), kinds) {
            return Err(format!("{} moves of {kinds} pieces do not fit the message tags", job.plan.moves.len()));
        }
        let mut sums = Vec::new();
        let mut elements = 0u64;
        for (i, m) in job.plan.moves.iter().enumerate().filter(|(_, m)| m.src_rank == me) {
            let name = &job.specs[m.param].name;
            let (shape, tensors) =
                local.get(name).ok_or_else(|| format!("the plan sends `{name}` from rank {me}, which holds none of it"))?;
            for (kind, t) in tensors.iter().enumerate() {
                let piece_tag = tag(i, kind, kinds);
                // Between threads, a contiguous f32 shard is handed over as it lies, unread (the
                // receiver compares it with its source as it copies); otherwise the piece is cut and
                // sent.
                if let Some((handoff, values)) = job.handoff.as_ref().zip(flex_values(t)) {
                    // The piece must lie within the shard; its rows are read by the receiver.
                    let all = values.as_slice::<f32>().expect("contiguous");
                    rows_along(all, shape, m.dim, m.src_offset, m.len).map(drop).map_err(|e| format!("`{name}`: {e}"))?;
                    let (outer, _, inner) = around(shape, m.dim);
                    sums.push((piece_tag, None));
                    elements += (outer * m.len * inner) as u64;
                    handoff.put(piece_tag, Shared { values, shape: shape.clone(), dim: m.dim, offset: m.src_offset, len: m.len });
                    continue;
                }
                // Between threads on devices, the piece is cut where it lies (a view of the
                // shard) and handed over there; the receiver compares it with what landed.
                if let Some(handoff) = job.handoff.as_ref().filter(|_| self.device_resident()) {
                    let (outer, extent, inner) = around(shape, m.dim);
                    if m.len == 0 || m.src_offset + m.len > extent || t.dims()[0] != outer * extent * inner {
                        return Err(format!(
                            "`{name}`: slice {}..{} along dim {} of a {shape:?} shard of {} values",
                            m.src_offset,
                            m.src_offset + m.len,
                            m.dim,
                            t.dims()[0]
                        ));
                    }
                    let piece = t.clone().reshape([outer, extent, inner]).narrow(1, m.src_offset, m.len);
                    sums.push((piece_tag, None));
                    elements += (outer * m.len * inner) as u64;
                    handoff.put_tensor(piece_tag, piece);
                    continue;
                }
                let (piece, sum) = with_values(t, Kind::State, |v| slice_along(v, shape, m.dim, m.src_offset, m.len))
                    .map_err(|e| format!("`{name}`: {e}"))?;
                sums.push((piece_tag, Some(sum)));
                elements += piece.len() as u64;
                self.world.send(m.dst_rank, piece_tag, piece).map_err(|e| e.to_string())?;
            }
        }
        if job.handoff.is_some() && self.device_resident() {
            // The pieces handed over are read on the receivers' threads (see `fusion_fence`).
            crate::comm::fusion_fence(&self.device).map_err(|e| e.to_string())?;
        }
        tracing::debug!("rank {me}: offered {elements} values in {:.3} s", clock.elapsed().as_secs_f64());
        Ok(Sent { sums, elements, scalars, fields, has_previous })
    }

    /// Step 2: receives this rank's pieces and builds its state in the new layout beside the
    /// current one.
    pub(super) fn live_build(&self, job: &LiveJob, agreed: &Agreed, model: &L) -> Result<(Option<Self>, Received), PhaseError> {
        let me = self.rank;
        let clock = Instant::now();
        let struck = |phase: ReconfigPhase| me == job.fault_rank && job.fault.hits(phase);
        let Some((groups, plan)) = self.live_groups(job)? else {
            return Ok((None, Received { sums: Vec::new(), sources: Vec::new(), elements: 0 }));
        };
        if struck(ReconfigPhase::GroupRebuild) {
            return Err((ReconfigPhase::GroupRebuild, "injected failure while building process groups".into()));
        }
        let Arrivals { mut shards, arrived, elements } = self.live_receive(job, agreed, &plan)?;
        let mut placement = self.live_place(job, &mut shards, arrived)?;
        let placed = clock.elapsed().as_secs_f64();
        if struck(ReconfigPhase::Load) {
            return Err(load("injected failure while loading shards".into()));
        }
        let (mut source, resume) = self.live_resume(job, agreed, shards)?;
        let cfg = job.cfg.clone();
        let mut state = RankState::build(
            me,
            groups,
            plan,
            &mut source,
            resume,
            model,
            &job.specs,
            &self.parallel,
            self.d_model,
            cfg,
            self.device.clone(),
        )
        .map_err(|e| load(e.to_string()))?;
        state.shard_optimizer().map_err(|e| load(e.to_string()))?;
        let built = clock.elapsed().as_secs_f64();
        placement.verify(me, state.named_weights())?;
        let Placement { mut sums, sources, .. } = placement;
        if struck(ReconfigPhase::Verify)
            && let Some(first) = sums.first_mut()
        {
            first.1 ^= 1;
        }
        tracing::debug!(
            "rank {me}: received and placed {elements} values by {placed:.3} s, built by {built:.3} s, checked by {:.3} s",
            clock.elapsed().as_secs_f64()
        );
        Ok((Some(state), Received { sums, sources, elements }))
    }

    /// Build, plan: splits the new process groups from the world and plans this rank's stage;
    /// `None` on a rank the new layout retires.
    fn live_groups(&self, job: &LiveJob) -> Result<Option<(Groups<C>, ShardPlan)>, PhaseError> {
        let me = self.rank;
        let dims = job.cfg.dims;
        // Process groups first: every rank makes these collective calls, whatever fails later.
        // A smaller world keeps the first ranks; the others retire once the change commits.
        let (old, new) = (self.world.size(), dims.world_size());
        let mut parts = vec![(0..new.min(old)).collect::<Vec<usize>>()];
        if old > new {
            parts.push((new..old).collect());
        }
        let world = self.world.split(&parts).map_err(|e| (ReconfigPhase::GroupRebuild, e.to_string()))?;
        if me >= new {
            return Ok(None);
        }
        let grid = RankGrid::new(dims);
        let c = grid.coord(me).map_err(|e| (ReconfigPhase::GroupRebuild, e.to_string()))?;
        let plan = ShardPlan::new(dims, c.tp, c.pp, job.num_layers);
        let groups = Groups::split(world, &grid).map_err(|e| (ReconfigPhase::GroupRebuild, e.to_string()))?;
        Ok(Some((groups, plan)))
    }

    /// Build, receive: takes every piece sent to this rank, handed over or through the world,
    /// and sorts them by the new shard and kind they belong to.
    fn live_receive(&self, job: &LiveJob, agreed: &Agreed, plan: &ShardPlan) -> Result<Arrivals, PhaseError> {
        let me = self.rank;
        let kinds = agreed.kinds();
        // Each new shard, per kind: assembled from its pieces once all have arrived, or a single
        // piece sent whole, taken as it arrived.
        let mut shards: HashMap<usize, NewShard> = HashMap::new();
        for (p, spec) in job.specs.iter().enumerate() {
            if holds(spec, plan, job.num_layers) {
                shards.insert(p, (local_shape(spec, job.cfg.dims.tp), (0..kinds).map(|_| None).collect()));
            }
        }
        let mut elements = 0u64;
        // Every piece sent here is received, even after a failure: none may stay in flight (an
        // MPI send of a large piece completes only once it is received).
        let mut failure: Option<PhaseError> = None;
        // Per new shard and kind: the split dim and the pieces, assembled once all are here.
        let mut arrived: HashMap<(usize, usize), (usize, Vec<Arrival>)> = HashMap::new();
        for (i, m) in job.plan.moves.iter().enumerate().filter(|(_, m)| m.dst_rank == me) {
            let name = &job.specs[m.param].name;
            for kind in 0..kinds {
                let t = tag(i, kind, kinds);
                let handed = job
                    .handoff
                    .as_ref()
                    .and_then(|h| h.take_tensor(t).map(|x| Piece::Device(Box::new(x))).or_else(|| h.take(t).map(Piece::Shared)));
                let piece = match handed {
                    Some(p) => p,
                    None => Piece::Owned(self.world.recv(m.src_rank, t).map_err(|e| load(e.to_string()))?),
                };
                elements += piece.len() as u64;
                if !shards.contains_key(&m.param) {
                    failure.get_or_insert_with(|| load(format!("the plan sends `{name}` to rank {me}, which does not hold it")));
                    continue;
                }
                let (d, pieces) = arrived.entry((m.param, kind)).or_insert_with(|| (m.dim, Vec::new()));
                if *d != m.dim {
                    failure.get_or_insert_with(|| load(format!("`{name}` arrives split along dims {d} and {}", m.dim)));
                }
                pieces.push((m.dst_offset, m.len, t, piece));
            }
        }
        if let Some(f) = failure {
            return Err(f);
        }
        Ok(Arrivals { shards, arrived, elements })
    }

    /// Build, place: puts each new shard's pieces together, in host memory or on the device, and
    /// records what the built stage is to be checked against.
    fn live_place(
        &self,
        job: &LiveJob,
        shards: &mut HashMap<usize, NewShard>,
        arrived: HashMap<(usize, usize), (usize, Vec<Arrival>)>,
    ) -> Result<Placement, PhaseError> {
        // Each new shard: a single piece that is the whole shard is taken as it arrived; others
        // are copied into place once, each piece summed as it lands. What the built stage is
        // checked against is recorded for the weights: each piece's landed sum and the buffer.
        // On a device the pieces are joined there, and each is compared with what landed where
        // both lie; the counts of differing elements are read at once, after the build (the
        // weights joined are kept by name, to find each in the built stage).
        let mut placement = Placement::default();
        for ((p, kind), (dim, pieces)) in arrived {
            let name = &job.specs[p].name;
            let (shape, bufs) = shards.get_mut(&p).expect("checked on arrival");
            let n: usize = shape.iter().product();
            let mut pieces = pieces;
            pieces.sort_by_key(|p| p.0);
            if pieces.iter().any(|p| matches!(p.3, Piece::Device(_))) {
                let mut tensors = Vec::with_capacity(pieces.len());
                for (o, l, t, piece) in pieces {
                    let Piece::Device(x) = piece else {
                        return Err(load(format!("`{name}`: pieces arrived both on a device and in host memory")));
                    };
                    tensors.push((o, l, t, *x));
                }
                // On this rank's device, without autodiff (the state's flat tensors have none;
                // a weight becomes a parameter in the new stage).
                let (joined, checked) = join_on_device(shape, dim, tensors, &self.device).map_err(|e| load(format!("`{name}`: {e}")))?;
                placement.checks.extend(checked);
                if kind == 0 {
                    placement.on_device.insert(name.clone());
                }
                bufs[kind] = Some(ShardValues::Device(joined));
                continue;
            }
            let whole = matches!(pieces.as_slice(), [(0, len, _, Piece::Owned(v))] if *len == shape[dim] && v.len() == n);
            let (values, landed) = if whole {
                let Some((_, _, t, Piece::Owned(v))) = pieces.into_iter().next() else { unreachable!("one owned piece") };
                let sum = checksum(&v);
                placement.sums.push((t, sum));
                (v, vec![(0, shape[dim], sum)])
            } else {
                let (tags, parts): (Vec<u32>, Vec<(usize, usize, Piece)>) = pieces.into_iter().map(|(o, l, t, x)| (t, (o, l, x))).unzip();
                let built = assemble(shape, dim, &parts).map_err(|e| load(format!("`{name}`: {e}")))?;
                let mut landed = Vec::with_capacity(parts.len());
                for ((t, (landed_sum, source)), (offset, len, _)) in tags.into_iter().zip(built.sums).zip(&parts) {
                    placement.sums.push((t, landed_sum));
                    placement.sources.extend(source.map(|s| (t, s)));
                    landed.push((*offset, *len, landed_sum));
                }
                (built.values, landed)
            };
            if kind == 0 {
                let buffer = (values.as_ptr() as usize, values.len());
                placement.expected.insert(name.clone(), Landed { shape: shape.clone(), dim, pieces: landed, buffer });
            }
            bufs[kind] = Some(ShardValues::Host(values));
        }
        Ok(placement)
    }

    /// Build, hand over: turns the placed shards into what the new stage is built from, the
    /// weights by name and the rest of the training state to resume.
    fn live_resume(
        &self,
        job: &LiveJob,
        agreed: &Agreed,
        shards: HashMap<usize, NewShard>,
    ) -> Result<(ShardSource, RankResume), PhaseError> {
        let me = self.rank;
        // What the new stage must hold once built: the weights that arrived, summed above. (The
        // optimizer tensors are checked piece by piece, by the driver, at source and landing.)
        let (mut host, mut joined) = (HashMap::new(), Vec::new());
        let mut resume = RankResume {
            step: self.step,
            tokens_seen: self.tokens_seen,
            gns: Some(self.closer.gns().clone()),
            previous: agreed.has_previous.then(HashMap::new),
            ..RankResume::default()
        };
        for (p, (shape, bufs)) in shards {
            let name = job.specs[p].name.clone();
            let mut bufs: Vec<ShardValues> =
                bufs.into_iter().collect::<Option<_>>().ok_or_else(|| load(format!("no piece of `{name}` arrived at rank {me}")))?;
            if let Some(prev) = resume.previous.as_mut() {
                prev.insert(name.clone(), bufs.pop().expect("a previous-gradient piece"));
            }
            let mut bufs = bufs.into_iter();
            match bufs.next().expect("a weight piece") {
                ShardValues::Host(values) => drop(host.insert(name.clone(), TensorData::new(values, shape.clone()))),
                ShardValues::Device(t) => joined.push((name.clone(), shape.clone(), t)),
            }
            for (field, values) in agreed.fields.iter().zip(bufs) {
                resume.optim.push((name.clone(), field.clone(), shape.clone(), values));
            }
            for (field, v) in agreed.scalars.get(&name).into_iter().flatten() {
                resume.scalars.push((name.clone(), field.clone(), *v));
            }
        }
        let mut source = ShardSource::new(host);
        for (name, shape, t) in joined {
            source.insert_tensor(name, shape, t);
        }
        Ok((source, resume))
    }
}

/// A load failure.
fn load(e: String) -> PhaseError {
    (ReconfigPhase::Load, e)
}

/// The pieces that arrived at a rank: its new shards (with no values yet), the pieces per new
/// shard and kind with their split dim, and the elements received.
struct Arrivals {
    shards: HashMap<usize, NewShard>,
    arrived: HashMap<(usize, usize), (usize, Vec<Arrival>)>,
    elements: u64,
}

/// What placing a rank's new shards leaves to check: the pieces' checksums where they landed and
/// at their sources, the weights assembled in host memory by name, those joined on the device,
/// and the device pieces' counts of differing elements `(tag, len, count)`, not yet read.
#[derive(Default)]
struct Placement {
    sums: Vec<(u32, u64)>,
    sources: Vec<(u32, u64)>,
    expected: HashMap<String, Landed>,
    on_device: HashSet<String>,
    checks: Vec<(u32, usize, Tensor<1, Int>)>,
}

impl Placement {
    /// Build, verify: checks that the built stage's `weights` hold what rank `me` received, and
    /// adds the device pieces' checksums, where they landed and at their sources.
    fn verify(&mut self, me: usize, weights: Vec<(String, Tensor<1>)>) -> Result<(), PhaseError> {
        // The built stage's weights: where they were assembled in host memory, by buffer or sums;
        // where they were joined on the device, the stage took each joined tensor as it is (a
        // reshaped view, which a comparison would only compare with itself): that it took
        // every one.
        for (name, t) in weights {
            if self.on_device.remove(&name) {
                continue;
            }
            let ok = self.expected.remove(&name).is_some_and(|want| want.held_by(&t));
            if !ok {
                return Err((ReconfigPhase::Verify, format!("rank {me}: the loaded {name} does not match what it received")));
            }
        }
        if let Some(name) = self.expected.keys().chain(self.on_device.iter()).min() {
            return Err((ReconfigPhase::Verify, format!("rank {me}: the built stage lacks {name}, which it received")));
        }
        // Every piece's count of differing elements, read back together.
        if !self.checks.is_empty() {
            let read = traffic::read(Tensor::cat(self.checks.iter().map(|c| c.2.clone()).collect(), 0), Kind::State);
            for ((tag, len, _), differing) in self.checks.iter().zip(read.iter::<i64>()) {
                let (landed, source) = device_sum(*tag, *len, differing);
                self.sums.push((*tag, landed));
                self.sources.push((*tag, source));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_slice_placed_back_restores_the_tensor() {
        // [2, 6, 3] split along dim 1: entries 1..4 of each of the two outer rows.
        let shape = [2, 6, 3];
        let values: Vec<f32> = (0..36).map(|v| v as f32).collect();
        let (piece, sent) = slice_along(&values, &shape, 1, 1, 3).unwrap();
        // Hand-computed: outer 0 takes values 3..12, outer 1 values 21..30.
        let want: Vec<f32> = (3..12).chain(21..30).map(|v| v as f32).collect();
        assert_eq!(piece, want);
        assert_eq!(sent, checksum(&want));
        assert!(slice_along(&values, &shape, 1, 4, 3).is_err());
    }

    /// A piece `[offset, offset + len)` along dim 1 of `values` (shape [2, 6, 3]), still in
    /// that shard, as a thread hands it over.
    fn shared(values: &[f32], offset: usize, len: usize) -> Piece {
        let values = FlexTensor::from_data(TensorData::new(values.to_vec(), [values.len()]));
        Piece::Shared(Shared { values, shape: vec![2, 6, 3], dim: 1, offset, len })
    }

    #[test]
    fn pieces_owned_and_handed_over_assemble_into_the_shard() {
        let shape = [2, 6, 3];
        let values: Vec<f32> = (0..36).map(|v| v as f32 * 0.5 - 4.0).collect();
        // Three pieces along dim 1, [0, 1), [1, 4), [4, 6): the middle one cut and sent, the
        // others read where they lie in the sender's shard.
        let (middle, middle_sum) = slice_along(&values, &shape, 1, 1, 3).unwrap();
        let pieces = vec![(0, 1, shared(&values, 0, 1)), (1, 3, Piece::Owned(middle)), (4, 2, shared(&values, 4, 2))];
        let built = assemble(&shape, 1, &pieces).unwrap();
        assert_eq!(built.values, values);
        // Each piece's sum where it landed is the one of the values it holds, cut by hand; a
        // piece handed over also has its source's sum, equal to the landed one.
        let expect = |o, l| checksum(&slice_along(&values, &shape, 1, o, l).unwrap().0);
        let (first, last) = (expect(0, 1), expect(4, 2));
        assert_eq!(built.sums, vec![(first, Some(first)), (middle_sum, None), (last, Some(last))]);
        let by_hand: Vec<f32> = [0, 1, 2, 18, 19, 20].iter().map(|&i| values[i]).collect();
        assert_eq!(first, checksum(&by_hand));

        // A gap, an overlap, a short cover and a piece of another shard's geometry are refused.
        let gap = vec![(0, 1, shared(&values, 0, 1)), (2, 4, shared(&values, 2, 4))];
        assert!(assemble(&shape, 1, &gap).unwrap_err().contains("gap"));
        let overlap = vec![(0, 2, shared(&values, 0, 2)), (1, 5, shared(&values, 1, 5))];
        assert!(assemble(&shape, 1, &overlap).is_err());
        let short = vec![(0, 4, shared(&values, 0, 4))];
        assert!(assemble(&shape, 1, &short).unwrap_err().contains("cover 4 of 6"));
        assert!(assemble(&[3, 6, 2], 1, &[(0, 6, shared(&values, 0, 6))]).is_err());
        assert!(assemble(&shape, 1, &[(0, 6, Piece::Owned(vec![0.0; 35]))]).is_err());
    }

    /// Pieces of a `[2, 6, 3]` shard along dim 1, as tensors: joined in offset order into the
    /// shard, each found equal to what landed; a gap or a piece of the wrong extent refused; a
    /// changed value counted (a NaN equal to a NaN); the sums agree only where nothing differed.
    #[test]
    fn pieces_on_a_device_join_into_the_shard_and_are_compared_where_they_landed() {
        let device = Device::flex();
        let shape = [2, 6, 3];
        let values: Vec<f32> = (0..36).map(|v| v as f32 * 0.5 - 4.0).collect();
        let whole = Tensor::<3>::from_data(TensorData::new(values.clone(), shape), &device);
        let piece = |o: usize, l: usize, tag: u32| (o, l, tag, whole.clone().narrow(1, o, l));
        let read = |t: Tensor<1, Int>| t.into_data().iter::<i64>().collect::<Vec<_>>();
        let (joined, checks) = join_on_device(&shape, 1, vec![piece(0, 1, 7), piece(1, 3, 8), piece(4, 2, 9)], &device).unwrap();
        assert_eq!(joined.into_data().iter::<f32>().collect::<Vec<_>>(), values);
        assert_eq!(checks.iter().map(|c| (c.0, c.1)).collect::<Vec<_>>(), vec![(7, 6), (8, 18), (9, 12)]);
        for (_, _, c) in checks {
            assert_eq!(read(c), vec![0]);
        }
        assert!(join_on_device(&shape, 1, vec![piece(0, 1, 7), piece(2, 4, 8)], &device).unwrap_err().contains("gap"));
        let short = (0, 6, 7, whole.clone().narrow(1, 0, 5));
        assert!(join_on_device(&shape, 1, vec![short], &device).unwrap_err().contains("does not fit"));

        let t = |v: Vec<f32>| Tensor::<1>::from_data(TensorData::new(v.clone(), [v.len()]), &device);
        let mut changed = values.clone();
        changed[5] = f32::from_bits(changed[5].to_bits() ^ 1);
        changed[30] = -changed[30];
        assert_eq!(read(mismatches(t(values.clone()), t(changed))), vec![2]);
        let nan = vec![f32::NAN, 1.0, 0.0];
        assert_eq!(read(mismatches(t(nan.clone()), t(nan))), vec![0]);
        assert_eq!(read(mismatches(t(vec![f32::NAN, 1.0]), t(vec![1.0, 1.0]))), vec![1]);
        let (landed, source) = device_sum(tag(3, 1, 4), 18, 0);
        assert_eq!(landed, source);
        assert_ne!(landed, device_sum(tag(3, 2, 4), 18, 0).0, "pieces are told apart");
        let (landed, source) = device_sum(tag(3, 1, 4), 18, 1);
        assert_ne!(landed, source, "a difference reaches the driver");
    }

    #[test]
    fn a_built_weight_is_checked_by_its_buffer_or_by_its_pieces() {
        let shape = [2, 6, 3];
        let values: Vec<f32> = (0..36).map(|v| v as f32 * 0.25 - 1.0).collect();
        let pieces = vec![(0, 2, shared(&values, 0, 2)), (2, 4, shared(&values, 2, 4))];
        let built = assemble(&shape, 1, &pieces).unwrap();
        let landed =
            |buffer| Landed { shape: shape.to_vec(), dim: 1, pieces: vec![(0, 2, built.sums[0].0), (2, 4, built.sums[1].0)], buffer };
        let tensor = |v: Vec<f32>| {
            let n = v.len();
            Tensor::<1>::from_data(TensorData::new(v, [n]), &burn::tensor::Device::flex())
        };
        // The very buffer assembled, adopted by the tensor: held, with nothing read.
        let assembled = built.values.clone();
        let at = assembled.as_ptr() as usize;
        let adopted = tensor(assembled);
        assert_eq!(flex_values(&adopted).unwrap().as_slice::<f32>().unwrap().as_ptr() as usize, at, "Flex adopts the buffer");
        assert!(landed((at, 36)).held_by(&adopted));
        // Another buffer: held when every piece sums as it landed, not when one value differs.
        let elsewhere = (at + 4, 36);
        assert!(landed(elsewhere).held_by(&tensor(values.clone())));
        let mut changed = values.clone();
        changed[20] = f32::from_bits(changed[20].to_bits() ^ 1);
        assert!(!landed(elsewhere).held_by(&tensor(changed)));
        // The assembled buffer's address with another length is not taken for it: the values
        // are summed (and here they are right).
        assert!(landed((at, 35)).held_by(&adopted));
        assert!(!landed(elsewhere).held_by(&tensor(vec![0.0; 36])));
        assert!(!landed(elsewhere).held_by(&tensor(vec![0.0; 30])));
    }

    #[test]
    fn the_checksum_sees_a_flipped_bit_a_swap_and_a_length() {
        let v: Vec<f32> = (0..1000).map(|i| i as f32 * 0.37 - 3.0).collect();
        let base = checksum(&v);
        assert_eq!(base, checksum(&v.clone()));
        for i in [0, 7, 8, 63, 64, 999] {
            let mut w = v.clone();
            w[i] = f32::from_bits(w[i].to_bits() ^ 1);
            assert_ne!(checksum(&w), base, "bit flip at {i}");
        }
        // Neighbours, and values far apart.
        for (a, b) in [(0, 8), (0, 1), (3, 999), (100, 612)] {
            let mut w = v.clone();
            w.swap(a, b);
            assert_ne!(checksum(&w), base, "swap {a} <-> {b}");
        }
        assert_ne!(checksum(&v[..999]), base);
        // Fed in parts, at every kind of split (inside and across the hash's internal blocks),
        // the sum is the same.
        for cuts in [vec![0, 1000], vec![3, 1000], vec![1, 9, 10, 1000], vec![64, 65, 300, 1000], vec![5, 6, 7, 700, 1000]] {
            let mut sum = Checksum::new();
            let mut at = 0;
            for c in cuts {
                sum.update(&v[at..c]);
                at = c;
            }
            assert_eq!(sum.finish(), base);
        }
        assert_ne!(checksum(&[]), checksum(&[0.0]));
        assert_ne!(checksum(&[0.0]), checksum(&[-0.0]));
        // XXH3-64 (seed 0) of no bytes, as published with the algorithm: checkpoints store these.
        assert_eq!(checksum(&[]), 0x2d06_8005_38d3_94c2);
    }
}
