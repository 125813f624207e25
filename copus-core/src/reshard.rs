//! Reshard plans: from each parameter's [`ParamSpec`] and two layouts, the moves (source rank,
//! destination rank, slice) that give every rank of the new layout exactly the elements its
//! shards need. Every rank computes the same plan from the same metadata; the executor in
//! copus-burn only copies slices. The same plan moves AdamW moments, which share the spec.
//!
//! A shard under tp splits one tensor dim; all other dims are whole, so a slice is an interval
//! along that dim. A fused weight (`chunks > 1`) is cut into `chunks` blocks, each split across
//! tp, so a shard is `chunks` intervals, stored contiguously in the shard in block order.

use std::ops::Range;

use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::layout::{Coord, ParallelDims, RankGrid, stage_of_layer};
use crate::model::{ParamSpec, Placement, TpSplit};

/// A plan that cannot be made.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum ReshardError {
    /// A split dim does not divide into `chunks * tp` equal parts.
    #[error("parameter `{param}`: dim {dim} of size {size} does not split into {parts} equal parts (chunks x tp)")]
    NotDivisible {
        /// The parameter's name ([`ParamSpec::name`]).
        param: String,
        /// The tensor dimension its spec splits.
        dim: usize,
        /// That dimension's length.
        size: usize,
        /// `chunks * tp`, the number of equal parts it must split into.
        parts: usize,
    },
    /// The split dim is not a dim of the tensor.
    #[error("parameter `{param}`: split dim {dim} but the tensor has {rank} dims")]
    BadDim {
        /// The parameter's name ([`ParamSpec::name`]).
        param: String,
        /// The tensor dimension its spec splits.
        dim: usize,
        /// The number of dimensions the tensor has.
        rank: usize,
    },
    /// A layer index past the model's layers, or more stages than layers.
    #[error("parameter `{param}` sits in layer {layer} but the model has {num_layers} layers (pp = {pp})")]
    BadLayer {
        /// The parameter's name ([`ParamSpec::name`]).
        param: String,
        /// The decoder layer its placement names.
        layer: usize,
        /// Decoder layers of the model.
        num_layers: usize,
        /// Pipeline stages of the layout.
        pp: usize,
    },
}

/// Copy `len` entries along `dim` of parameter `param`, from `src_offset` in the source rank's
/// shard to `dst_offset` in the destination rank's shard (other dims whole).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Move {
    /// Index into the parameter specs the plan was made from.
    pub param: usize,
    /// Rank in the old layout that holds the data.
    pub src_rank: usize,
    /// Rank in the new layout that needs it.
    pub dst_rank: usize,
    /// The split dim (0 for a replicated parameter).
    pub dim: usize,
    /// Start in the source shard along `dim`.
    pub src_offset: usize,
    /// Start in the destination shard along `dim`.
    pub dst_offset: usize,
    /// Entries along `dim` to copy.
    pub len: usize,
    /// Start in the full tensor along `dim`.
    pub global_start: usize,
}

/// The moves of one layout change.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ReshardPlan {
    /// The layout the shards are in before the change.
    pub from: ParallelDims,
    /// The layout they are in after it.
    pub to: ParallelDims,
    /// Moves, grouped by parameter, then destination rank.
    pub moves: Vec<Move>,
}

/// The layout-independent facts the planner needs about a model.
#[derive(Clone, Copy, Debug)]
pub struct Placer {
    /// Decoder layers of the model, which the pipeline stages divide among themselves.
    pub num_layers: usize,
}

impl Placer {
    /// Stages (of `pp`) that hold a parameter.
    pub fn stages(&self, spec: &ParamSpec, pp: usize) -> Result<Vec<usize>, ReshardError> {
        Ok(match spec.placement {
            Placement::Layer(layer) => {
                if layer >= self.num_layers || pp > self.num_layers {
                    return Err(ReshardError::BadLayer { param: spec.name.clone(), layer, num_layers: self.num_layers, pp });
                }
                vec![stage_of_layer(layer, self.num_layers, pp)]
            }
            Placement::First => vec![0],
            Placement::Last => vec![pp - 1],
            Placement::FirstAndLast if pp == 1 => vec![0],
            Placement::FirstAndLast => vec![0, pp - 1],
        })
    }
}

/// The split dim of a parameter and the global intervals along it held by tp index `t` of
/// `tp`, in shard order.
pub fn shard_intervals(spec: &ParamSpec, tp: usize, t: usize) -> Result<(usize, Vec<Range<usize>>), ReshardError> {
    match spec.tp {
        TpSplit::Replicated => Ok((0, std::iter::once(0..spec.shape.first().copied().unwrap_or(1)).collect())),
        TpSplit::Split { dim, chunks } => {
            let size =
                *spec.shape.get(dim).ok_or_else(|| ReshardError::BadDim { param: spec.name.clone(), dim, rank: spec.shape.len() })?;
            let parts = chunks.max(1) * tp;
            if size % parts != 0 {
                return Err(ReshardError::NotDivisible { param: spec.name.clone(), dim, size, parts });
            }
            let block = size / chunks.max(1);
            let piece = size / parts;
            Ok((dim, (0..chunks.max(1)).map(|j| j * block + t * piece..j * block + (t + 1) * piece).collect()))
        }
    }
}

/// Ranks of a layout that hold a parameter, with their coordinates.
fn owners(spec: &ParamSpec, grid: &RankGrid, placer: &Placer) -> Result<Vec<(usize, Coord)>, ReshardError> {
    let dims = grid.dims();
    let stages = placer.stages(spec, dims.pp)?;
    let mut out = Vec::new();
    for &pp in &stages {
        for dp in 0..dims.dp {
            for tp in 0..dims.tp {
                let c = Coord { dp, tp, pp };
                out.push((grid.rank(c), c));
            }
        }
    }
    Ok(out)
}

impl ReshardPlan {
    /// Plans the moves from layout `from` to layout `to` for `specs`. The source of each piece
    /// is the destination rank itself when it already holds it (a local copy), otherwise the old
    /// replica with the destination's dp index modulo the old dp (spreading the sends).
    pub fn new(specs: &[ParamSpec], placer: Placer, from: ParallelDims, to: ParallelDims) -> Result<Self, ReshardError> {
        let old = RankGrid::new(from);
        let new = RankGrid::new(to);
        let mut moves = Vec::new();
        for (param, spec) in specs.iter().enumerate() {
            let old_owners = owners(spec, &old, &placer)?;
            // Old shards by tp index: their global intervals.
            let old_shards: Vec<(usize, Vec<Range<usize>>)> =
                (0..from.tp).map(|t| shard_intervals(spec, from.tp, t)).collect::<Result<_, _>>()?;
            for (dst_rank, dc) in owners(spec, &new, &placer)? {
                let (dim, need) = shard_intervals(spec, to.tp, dc.tp)?;
                let mut dst_offset = 0;
                for want in need {
                    // Walk the old shards' intervals that overlap `want`.
                    for (t_old, (_, have)) in old_shards.iter().enumerate() {
                        // A replicated parameter is whole on every old tp rank: take it once,
                        // from the destination's own tp index where there is one.
                        if spec.tp == TpSplit::Replicated && t_old != dc.tp % from.tp {
                            continue;
                        }
                        let mut src_offset = 0;
                        for iv in have {
                            let lo = iv.start.max(want.start);
                            let hi = iv.end.min(want.end);
                            if lo < hi {
                                let src_rank = pick_source(&old_owners, t_old, dst_rank, dc.dp);
                                moves.push(Move {
                                    param,
                                    src_rank,
                                    dst_rank,
                                    dim,
                                    src_offset: src_offset + (lo - iv.start),
                                    dst_offset: dst_offset + (lo - want.start),
                                    len: hi - lo,
                                    global_start: lo,
                                });
                            }
                            src_offset += iv.len();
                        }
                    }
                    dst_offset += want.len();
                }
            }
        }
        // Within a destination's interval the walk above is by old shard, not by offset: sort so
        // the moves of one (param, destination) are in destination order.
        moves.sort_by_key(|m| (m.param, m.dst_rank, m.dst_offset));
        Ok(Self { from, to, moves })
    }

    /// Elements that cross between different ranks, given each parameter's element count per
    /// entry of its split dim.
    pub fn remote_elements(&self, specs: &[ParamSpec]) -> u64 {
        self.moves.iter().filter(|m| m.src_rank != m.dst_rank).map(|m| (m.len * row_elems(&specs[m.param], m.dim)) as u64).sum()
    }

    /// Elements copied within a rank (from its old shard to its new one), given each
    /// parameter's element count per entry of its split dim.
    pub fn local_elements(&self, specs: &[ParamSpec]) -> u64 {
        self.moves.iter().filter(|m| m.src_rank == m.dst_rank).map(|m| (m.len * row_elems(&specs[m.param], m.dim)) as u64).sum()
    }
}

/// Elements of one entry along `dim` (the product of the other dims).
pub fn row_elems(spec: &ParamSpec, dim: usize) -> usize {
    spec.shape.iter().enumerate().filter(|(i, _)| *i != dim).map(|(_, s)| s).product()
}

fn pick_source(old_owners: &[(usize, Coord)], t_old: usize, dst_rank: usize, dst_dp: usize) -> usize {
    let holders: Vec<&(usize, Coord)> = old_owners.iter().filter(|(_, c)| c.tp == t_old).collect();
    if let Some((r, _)) = holders.iter().find(|(r, _)| *r == dst_rank) {
        return *r;
    }
    let old_dp = holders.iter().map(|(_, c)| c.dp).max().map_or(1, |m| m + 1);
    let want = dst_dp % old_dp;
    holders.iter().find(|(_, c)| c.dp == want).map_or(holders[0].0, |(r, _)| *r)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::ModelSpec;
    use proptest::prelude::*;

    /// Independent check: for every parameter and every rank of the new layout, count how many
    /// moves deliver each global entry along the split dim; it must be exactly 1 where the rank
    /// needs the entry and 0 elsewhere. Also the source must hold what it sends, at the offset
    /// the move names.
    fn verify(specs: &[ParamSpec], placer: Placer, plan: &ReshardPlan) -> Result<(), String> {
        let (old, new) = (RankGrid::new(plan.from), RankGrid::new(plan.to));
        for (p, spec) in specs.iter().enumerate() {
            let dim = match spec.tp {
                TpSplit::Replicated => 0,
                TpSplit::Split { dim, .. } => dim,
            };
            let size = spec.shape[dim];
            let new_stages = placer.stages(spec, plan.to.pp).unwrap();
            let old_stages = placer.stages(spec, plan.from.pp).unwrap();
            for r in 0..plan.to.world_size() {
                let c = new.coord(r).unwrap();
                let mut count = vec![0u32; size];
                let mut needed = vec![false; size];
                if new_stages.contains(&c.pp) {
                    // Local index -> global index of this rank's shard.
                    let (_, ivs) = shard_intervals(spec, plan.to.tp, c.tp).unwrap();
                    let local: Vec<usize> = ivs.iter().flat_map(|iv| iv.clone()).collect();
                    for &g in &local {
                        needed[g] = true;
                    }
                    for m in plan.moves.iter().filter(|m| m.param == p && m.dst_rank == r) {
                        let sc = old.coord(m.src_rank).unwrap();
                        if !old_stages.contains(&sc.pp) {
                            return Err(format!("{}: source rank {} is not on a stage that holds it", spec.name, m.src_rank));
                        }
                        let (_, src_ivs) = shard_intervals(spec, plan.from.tp, sc.tp).unwrap();
                        let src_local: Vec<usize> = src_ivs.iter().flat_map(|iv| iv.clone()).collect();
                        for k in 0..m.len {
                            let g = m.global_start + k;
                            if local.get(m.dst_offset + k) != Some(&g) || src_local.get(m.src_offset + k) != Some(&g) {
                                return Err(format!("{}: move {m:?} has wrong offsets", spec.name));
                            }
                            count[g] += 1;
                        }
                    }
                } else if plan.moves.iter().any(|m| m.param == p && m.dst_rank == r) {
                    return Err(format!("{}: rank {r} receives a parameter it does not hold", spec.name));
                }
                for g in 0..size {
                    let want = u32::from(needed[g]);
                    if count[g] != want {
                        return Err(format!("{}: rank {r} gets entry {g} {} times, wants {want}", spec.name, count[g]));
                    }
                }
            }
        }
        Ok(())
    }

    fn tiny() -> (Vec<ParamSpec>, Placer) {
        let m = ModelSpec::tiny_1m();
        (m.param_specs(), Placer { num_layers: m.num_layers })
    }

    #[test]
    fn same_layout_is_all_local() {
        let (specs, placer) = tiny();
        let d = ParallelDims { dp: 2, tp: 2, pp: 2 };
        let plan = ReshardPlan::new(&specs, placer, d, d).unwrap();
        verify(&specs, placer, &plan).unwrap();
        assert_eq!(plan.remote_elements(&specs), 0);
        // Each rank re-copies exactly what it holds: per dp replica, a split parameter once, a
        // replicated one on each of the 2 tp ranks, the tied embedding on both stages.
        let m = ModelSpec::tiny_1m();
        let h = m.hidden as u64;
        let replicated = (2 * m.num_layers as u64 + 1) * h; // two norms per layer + final norm
        let embed = (m.vocab_size * m.hidden) as u64;
        let per_replica = m.num_params() + replicated + embed;
        assert_eq!(plan.local_elements(&specs), 2 * per_replica);
    }

    #[test]
    fn tp2_pp1_to_tp1_pp2_by_hand() {
        // tp2,pp1 -> tp1,pp2 on 4 ranks (dp 2 both). q_proj of layer 0 [128, 128] split on dim 1:
        // new rank 0 (dp0, stage 0) gathers columns 0..64 from old rank 0 and 64..128 from rank 1.
        let (specs, placer) = tiny();
        let from = ParallelDims { dp: 2, tp: 2, pp: 1 };
        let to = ParallelDims { dp: 2, tp: 1, pp: 2 };
        let plan = ReshardPlan::new(&specs, placer, from, to).unwrap();
        verify(&specs, placer, &plan).unwrap();
        let q = specs.iter().position(|s| s.name == "layers.0.attn.q_proj.weight").unwrap();
        let to_rank0: Vec<_> = plan.moves.iter().filter(|m| m.param == q && m.dst_rank == 0).collect();
        assert_eq!(to_rank0.len(), 2);
        assert_eq!((to_rank0[0].src_rank, to_rank0[0].dst_offset, to_rank0[0].len), (0, 0, 64));
        assert_eq!((to_rank0[1].src_rank, to_rank0[1].dst_offset, to_rank0[1].len), (1, 64, 64));
        // Layer 3 lives on stage 1 = ranks 2 and 3 of the new layout; no move sends it to 0 or 1.
        let l3 = specs.iter().position(|s| s.name == "layers.3.attn.q_proj.weight").unwrap();
        assert!(plan.moves.iter().filter(|m| m.param == l3).all(|m| m.dst_rank >= 2));
    }

    #[test]
    fn fused_chunks_keep_block_order() {
        // A fused [8, 12] weight with 3 chunks on dim 1: tp2 shard 0 holds columns 0..2, 4..6, 8..10.
        let spec =
            ParamSpec { name: "qkv".into(), shape: vec![8, 12], tp: TpSplit::Split { dim: 1, chunks: 3 }, placement: Placement::Layer(0) };
        assert_eq!(shard_intervals(&spec, 2, 0).unwrap(), (1, vec![0..2, 4..6, 8..10]));
        let placer = Placer { num_layers: 1 };
        let plan = ReshardPlan::new(
            std::slice::from_ref(&spec),
            placer,
            ParallelDims { dp: 1, tp: 2, pp: 1 },
            ParallelDims { dp: 2, tp: 1, pp: 1 },
        )
        .unwrap();
        verify(std::slice::from_ref(&spec), placer, &plan).unwrap();
        let bad = ParamSpec { shape: vec![8, 10], ..spec };
        let e = ReshardPlan::new(&[bad], placer, ParallelDims::serial(), ParallelDims::serial()).unwrap_err();
        assert_eq!(e.to_string(), "parameter `qkv`: dim 1 of size 10 does not split into 3 equal parts (chunks x tp)");
    }

    fn arb_specs() -> impl Strategy<Value = (Vec<ParamSpec>, usize)> {
        // Shapes divisible by up to 8-way tp times up to 3 chunks; a few layers.
        (1usize..5, proptest::collection::vec((0usize..4, 1usize..4, 1usize..3, 0usize..4), 1..6)).prop_map(|(layers, raw)| {
            let specs = raw
                .into_iter()
                .enumerate()
                .map(|(i, (kind, chunks, mult, place))| {
                    let placement = match place {
                        0 => Placement::First,
                        1 => Placement::Last,
                        2 => Placement::FirstAndLast,
                        _ => Placement::Layer(i % layers),
                    };
                    let (shape, tp) = match kind {
                        0 => (vec![3, 24 * mult * chunks], TpSplit::Split { dim: 1, chunks }),
                        1 => (vec![24 * mult, 2], TpSplit::Split { dim: 0, chunks: 1 }),
                        2 => (vec![5 * mult], TpSplit::Replicated),
                        _ => (vec![2, 2, 48 * mult], TpSplit::Split { dim: 2, chunks: 1 }),
                    };
                    ParamSpec { name: format!("p{i}"), shape, tp, placement }
                })
                .collect();
            (specs, layers)
        })
    }

    proptest! {
        #[test]
        fn every_element_reaches_every_rank_that_needs_it_exactly_once(
            (specs, layers) in arb_specs(),
            world in prop::sample::select(vec![1usize, 2, 4, 6, 8]),
            a in 0usize..64,
            b in 0usize..64,
        ) {
            let all: Vec<ParallelDims> = ParallelDims::all(world).into_iter().filter(|d| d.pp <= layers && d.tp <= 8).collect();
            let from = all[a % all.len()];
            let to = all[b % all.len()];
            let placer = Placer { num_layers: layers };
            let plan = ReshardPlan::new(&specs, placer, from, to).unwrap();
            prop_assert!(verify(&specs, placer, &plan).is_ok(), "{:?}", verify(&specs, placer, &plan));
        }

        #[test]
        fn every_layout_pair_of_eight_for_tiny(a in 0usize..10, b in 0usize..10) {
            let (specs, placer) = tiny();
            let m = ModelSpec::tiny_1m();
            let all: Vec<ParallelDims> = ParallelDims::all(8).into_iter().filter(|d| d.check_model(&m).is_ok()).collect();
            let (from, to) = (all[a % all.len()], all[b % all.len()]);
            let plan = ReshardPlan::new(&specs, placer, from, to).unwrap();
            prop_assert!(verify(&specs, placer, &plan).is_ok(), "{from} -> {to}: {:?}", verify(&specs, placer, &plan));
        }
    }
}
