//! The 3D parallel layout: `ParallelDims { dp, tp, pp }` validated once, and the `RankGrid`
//! that maps a rank to its (dp, tp, pp) coordinates and back.
//!
//! Rank order is tp fastest, then dp, then pp (pp slowest), so a tp group is a run of
//! consecutive ranks (inside one node) and pipeline stages are the farthest apart:
//! `rank = tp_idx + tp * (dp_idx + dp * pp_idx)`.

use std::fmt;
use std::ops::Range;

use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::model::ModelSpec;

/// A mesh axis of the 3D layout.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Axis {
    /// Data parallel: replicas that split the batch.
    Dp,
    /// Tensor parallel: ranks that split each layer's matrices.
    Tp,
    /// Pipeline parallel: ranks that hold consecutive layer ranges.
    Pp,
}

impl fmt::Display for Axis {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Axis::Dp => "dp",
            Axis::Tp => "tp",
            Axis::Pp => "pp",
        })
    }
}

/// Why a layout is not valid (for a world size or for a model).
#[derive(Clone, Debug, PartialEq, Eq, Error, Serialize, Deserialize)]
pub enum LayoutError {
    /// One of dp, tp, pp is zero.
    #[error("{axis} must be at least 1, got 0")]
    ZeroAxis {
        /// The axis that was zero.
        axis: Axis,
    },
    /// dp * tp * pp differs from the number of ranks.
    #[error("dp * tp * pp = {dp} * {tp} * {pp} = {product} must equal the world size {world}")]
    WorldMismatch {
        /// Data-parallel degree given.
        dp: usize,
        /// Tensor-parallel degree given.
        tp: usize,
        /// Pipeline-parallel degree given.
        pp: usize,
        /// Their product.
        product: usize,
        /// The world size it should equal.
        world: usize,
    },
    /// tp does not divide the number of attention heads.
    #[error("tp = {tp} must divide the number of attention heads ({num_heads})")]
    TpHeads {
        /// Tensor-parallel degree.
        tp: usize,
        /// Attention heads of the model.
        num_heads: usize,
    },
    /// tp does not divide the number of key/value heads.
    #[error("tp = {tp} must divide the number of key/value heads ({num_kv_heads})")]
    TpKvHeads {
        /// Tensor-parallel degree.
        tp: usize,
        /// Key/value heads of the model.
        num_kv_heads: usize,
    },
    /// tp does not divide the MLP hidden size or the vocabulary.
    #[error("tp = {tp} must divide the {what} ({size})")]
    TpSize {
        /// Tensor-parallel degree.
        tp: usize,
        /// Which size (MLP hidden size, vocabulary).
        what: String,
        /// That size in the model, which `tp` must divide.
        size: usize,
    },
    /// More pipeline stages than layers.
    #[error("pp = {pp} must not exceed the number of layers ({num_layers})")]
    PpLayers {
        /// Pipeline-parallel degree.
        pp: usize,
        /// Layers of the model.
        num_layers: usize,
    },
    /// A layout of more than [`MAX_WORLD`] ranks.
    #[error("dp = {dp}, tp = {tp}, pp = {pp} make more than {MAX_WORLD} ranks")]
    TooLarge {
        /// Data-parallel degree.
        dp: usize,
        /// Tensor-parallel degree.
        tp: usize,
        /// Pipeline-parallel degree.
        pp: usize,
    },
    /// A rank outside `0..world`.
    #[error("rank {rank} is outside 0..{world}")]
    RankOutOfRange {
        /// The rank asked for.
        rank: usize,
        /// The world size.
        world: usize,
    },
}

/// The parallel degrees of one layout, validated so that `dp * tp * pp == world`. Deserialising
/// (a recipe, a checkpoint's configuration, a wire message) goes through [`ParallelDims::checked`]:
/// every degree at least 1 and a product that fits [`MAX_WORLD`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(try_from = "RawDims")]
pub struct ParallelDims {
    /// Data-parallel degree: model replicas, each taking `B_g / dp` sequences of a step.
    pub dp: usize,
    /// Tensor-parallel degree: ranks that split each layer's matrices.
    pub tp: usize,
    /// Pipeline-parallel degree: stages, each holding a run of consecutive layers.
    pub pp: usize,
}

/// The largest world a layout may have: far beyond any run, small enough that products of a
/// world size with batch and sequence sizes cannot overflow.
pub const MAX_WORLD: usize = 1 << 20;

/// The degrees as written, before validation.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawDims {
    dp: usize,
    tp: usize,
    pp: usize,
}

impl TryFrom<RawDims> for ParallelDims {
    type Error = LayoutError;
    fn try_from(r: RawDims) -> Result<Self, LayoutError> {
        Self::checked(r.dp, r.tp, r.pp)
    }
}

impl ParallelDims {
    /// Validates the degrees without a world size: each at least 1, the product at most
    /// [`MAX_WORLD`].
    pub fn checked(dp: usize, tp: usize, pp: usize) -> Result<Self, LayoutError> {
        for (axis, v) in [(Axis::Dp, dp), (Axis::Tp, tp), (Axis::Pp, pp)] {
            if v == 0 {
                return Err(LayoutError::ZeroAxis { axis });
            }
        }
        match dp.checked_mul(tp).and_then(|x| x.checked_mul(pp)) {
            Some(w) if w <= MAX_WORLD => Ok(Self { dp, tp, pp }),
            _ => Err(LayoutError::TooLarge { dp, tp, pp }),
        }
    }

    /// Validates the degrees against a world size.
    pub fn new(dp: usize, tp: usize, pp: usize, world: usize) -> Result<Self, LayoutError> {
        for (axis, v) in [(Axis::Dp, dp), (Axis::Tp, tp), (Axis::Pp, pp)] {
            if v == 0 {
                return Err(LayoutError::ZeroAxis { axis });
            }
        }
        let product = dp.checked_mul(tp).and_then(|x| x.checked_mul(pp)).unwrap_or(usize::MAX);
        if product != world {
            return Err(LayoutError::WorldMismatch { dp, tp, pp, product, world });
        }
        Ok(Self { dp, tp, pp })
    }

    /// The serial layout: one rank.
    pub const fn serial() -> Self {
        Self { dp: 1, tp: 1, pp: 1 }
    }

    /// Number of ranks, `dp * tp * pp`.
    pub fn world_size(&self) -> usize {
        self.dp * self.tp * self.pp
    }

    /// Ranks that hold one model replica, `tp * pp`.
    pub fn model_parallel_size(&self) -> usize {
        self.tp * self.pp
    }

    /// The degree of one axis.
    pub fn degree(&self, axis: Axis) -> usize {
        match axis {
            Axis::Dp => self.dp,
            Axis::Tp => self.tp,
            Axis::Pp => self.pp,
        }
    }

    /// Whether the layout shards anything across tp.
    pub fn tp_enabled(&self) -> bool {
        self.tp > 1
    }

    /// Whether the layout has more than one pipeline stage.
    pub fn pp_enabled(&self) -> bool {
        self.pp > 1
    }

    /// Checks the layout against a model: tp divides the heads, kv heads, MLP hidden size and
    /// vocabulary; pp does not exceed the layers.
    pub fn check_model(&self, model: &ModelSpec) -> Result<(), LayoutError> {
        let tp = self.tp;
        if !model.num_heads.is_multiple_of(tp) {
            return Err(LayoutError::TpHeads { tp, num_heads: model.num_heads });
        }
        if !model.num_kv_heads.is_multiple_of(tp) {
            return Err(LayoutError::TpKvHeads { tp, num_kv_heads: model.num_kv_heads });
        }
        if !model.ffn_hidden.is_multiple_of(tp) {
            return Err(LayoutError::TpSize { tp, what: "MLP hidden size".into(), size: model.ffn_hidden });
        }
        if !model.vocab_size.is_multiple_of(tp) {
            return Err(LayoutError::TpSize { tp, what: "vocabulary".into(), size: model.vocab_size });
        }
        if self.pp > model.num_layers {
            return Err(LayoutError::PpLayers { pp: self.pp, num_layers: model.num_layers });
        }
        Ok(())
    }

    /// Every layout of `world` ranks, in (dp, tp, pp) lexicographic order.
    pub fn all(world: usize) -> Vec<Self> {
        let mut out = Vec::new();
        for dp in divisors(world) {
            for tp in divisors(world / dp) {
                let pp = world / dp / tp;
                out.push(Self { dp, tp, pp });
            }
        }
        out.sort();
        out
    }
}

impl fmt::Display for ParallelDims {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "dp{},tp{},pp{}", self.dp, self.tp, self.pp)
    }
}

/// The divisors of `n` in increasing order (empty for 0).
pub fn divisors(n: usize) -> Vec<usize> {
    (1..=n).filter(|d| n.is_multiple_of(*d)).collect()
}

/// A rank's coordinates in the mesh.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Coord {
    /// Index along dp: which model replica, in `0..dp`.
    pub dp: usize,
    /// Index along tp: which slice of each split matrix, in `0..tp`.
    pub tp: usize,
    /// Index along pp (the pipeline stage).
    pub pp: usize,
}

/// Maps ranks to coordinates (tp fastest, then dp, then pp) and lists the groups of each axis.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RankGrid {
    dims: ParallelDims,
}

impl RankGrid {
    /// The grid of a validated layout.
    pub fn new(dims: ParallelDims) -> Self {
        Self { dims }
    }

    /// The layout the grid was made for.
    pub fn dims(&self) -> ParallelDims {
        self.dims
    }

    /// Number of ranks, `dp * tp * pp`.
    pub fn world_size(&self) -> usize {
        self.dims.world_size()
    }

    /// Coordinates of a rank (tp fastest, then dp, then pp); an error outside `0..world`.
    pub fn coord(&self, rank: usize) -> Result<Coord, LayoutError> {
        let world = self.world_size();
        if rank >= world {
            return Err(LayoutError::RankOutOfRange { rank, world });
        }
        let ParallelDims { dp, tp, .. } = self.dims;
        Ok(Coord { tp: rank % tp, dp: (rank / tp) % dp, pp: rank / (tp * dp) })
    }

    /// The rank at some coordinates. Coordinates must be inside the grid.
    pub fn rank(&self, c: Coord) -> usize {
        let ParallelDims { dp, tp, pp } = self.dims;
        assert!(c.dp < dp && c.tp < tp && c.pp < pp, "coordinate {c:?} outside {}", self.dims);
        c.tp + tp * (c.dp + dp * c.pp)
    }

    /// The ranks of the `axis` group that contains `rank`, ordered by their index along `axis`.
    pub fn group_of(&self, axis: Axis, rank: usize) -> Result<Vec<usize>, LayoutError> {
        let c = self.coord(rank)?;
        let n = self.dims.degree(axis);
        Ok((0..n)
            .map(|i| {
                let mut g = c;
                match axis {
                    Axis::Dp => g.dp = i,
                    Axis::Tp => g.tp = i,
                    Axis::Pp => g.pp = i,
                }
                self.rank(g)
            })
            .collect())
    }

    /// All groups of one axis; together they partition the ranks.
    pub fn groups(&self, axis: Axis) -> Vec<Vec<usize>> {
        let mut out: Vec<Vec<usize>> = Vec::new();
        for rank in 0..self.world_size() {
            let g = self.group_of(axis, rank).expect("rank in range");
            // Index 0 along the axis is the group's smallest rank: list each group once.
            if g[0] == rank {
                out.push(g);
            }
        }
        out
    }
}

/// Contiguous layer ranges of `pp` pipeline stages over `num_layers` layers; the first
/// `num_layers % pp` stages take one layer more. Requires `1 <= pp <= num_layers`.
pub fn stage_layers(num_layers: usize, pp: usize) -> Vec<Range<usize>> {
    assert!(pp >= 1 && pp <= num_layers, "pp = {pp} with {num_layers} layers");
    let base = num_layers / pp;
    let extra = num_layers % pp;
    let mut start = 0;
    (0..pp)
        .map(|s| {
            let len = base + usize::from(s < extra);
            let r = start..start + len;
            start += len;
            r
        })
        .collect()
}

/// Number of layers on `stage`, the same as `stage_layers(num_layers, pp)[stage].len()` without
/// allocating.
pub fn stage_len(num_layers: usize, pp: usize, stage: usize) -> usize {
    num_layers / pp + usize::from(stage < num_layers % pp)
}

/// The pipeline stage that holds `layer`. Panics for a layer outside `0..num_layers`.
pub fn stage_of_layer(layer: usize, num_layers: usize, pp: usize) -> usize {
    stage_layers(num_layers, pp).iter().position(|r| r.contains(&layer)).unwrap_or_else(|| panic!("layer {layer} outside 0..{num_layers}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn world_mismatch_names_the_numbers() {
        let e = ParallelDims::new(2, 2, 3, 8).unwrap_err();
        assert_eq!(e.to_string(), "dp * tp * pp = 2 * 2 * 3 = 12 must equal the world size 8");
        assert!(matches!(ParallelDims::new(0, 8, 1, 8), Err(LayoutError::ZeroAxis { axis: Axis::Dp })));
        // Overflow is an error, not a panic.
        assert!(ParallelDims::new(usize::MAX, 2, 2, 8).is_err());
    }

    #[test]
    fn deserialising_checks_every_degree_and_the_product() {
        let ok: ParallelDims = serde_json::from_str(r#"{"dp":2,"tp":1,"pp":4}"#).unwrap();
        assert_eq!(ok, ParallelDims { dp: 2, tp: 1, pp: 4 });
        let e = serde_json::from_str::<ParallelDims>(r#"{"dp":2,"tp":1,"pp":0}"#).unwrap_err().to_string();
        assert!(e.contains("pp must be at least 1"), "{e}");
        let big = format!(r#"{{"dp":{},"tp":{},"pp":2}}"#, 1u64 << 40, 1u64 << 30);
        let e = serde_json::from_str::<ParallelDims>(&big).unwrap_err().to_string();
        assert!(e.contains("make more than"), "{e}");
        let e = ron::from_str::<ParallelDims>("(dp: 0, tp: 1, pp: 1)").unwrap_err().to_string();
        assert!(e.contains("dp must be at least 1"), "{e}");
        assert!(ParallelDims::checked(MAX_WORLD, 2, 1).is_err());
        assert_eq!(ParallelDims::checked(4, 2, 1).unwrap().world_size(), 8);
    }

    #[test]
    fn all_layouts_of_eight_are_the_ten_triples() {
        let got: Vec<_> = ParallelDims::all(8).iter().map(|d| (d.dp, d.tp, d.pp)).collect();
        // Ordered triples with product 8 = 2^3: C(3+2, 2) = 10.
        assert_eq!(got.len(), 10);
        assert!(got.contains(&(2, 2, 2)) && got.contains(&(1, 4, 2)) && got.contains(&(8, 1, 1)));
    }

    #[test]
    fn rank_order_is_tp_fastest_then_dp_then_pp() {
        let g = RankGrid::new(ParallelDims::new(2, 2, 2, 8).unwrap());
        // Hand-written: rank = tp + 2 * (dp + 2 * pp).
        assert_eq!(g.coord(0).unwrap(), Coord { dp: 0, tp: 0, pp: 0 });
        assert_eq!(g.coord(1).unwrap(), Coord { dp: 0, tp: 1, pp: 0 });
        assert_eq!(g.coord(2).unwrap(), Coord { dp: 1, tp: 0, pp: 0 });
        assert_eq!(g.coord(5).unwrap(), Coord { dp: 0, tp: 1, pp: 1 });
        assert_eq!(g.groups(Axis::Tp), vec![vec![0, 1], vec![2, 3], vec![4, 5], vec![6, 7]]);
        assert_eq!(g.groups(Axis::Dp), vec![vec![0, 2], vec![1, 3], vec![4, 6], vec![5, 7]]);
        assert_eq!(g.groups(Axis::Pp), vec![vec![0, 4], vec![1, 5], vec![2, 6], vec![3, 7]]);
        assert!(g.coord(8).is_err());
    }

    #[test]
    fn model_checks_name_the_numbers() {
        let m = ModelSpec::tiny_1m();
        let d = ParallelDims::new(1, 8, 1, 8).unwrap();
        // tiny-1m has 8 heads but 4 kv heads.
        assert_eq!(d.check_model(&m), Err(LayoutError::TpKvHeads { tp: 8, num_kv_heads: 4 }));
        let d = ParallelDims::new(1, 1, 8, 8).unwrap();
        assert_eq!(d.check_model(&m), Err(LayoutError::PpLayers { pp: 8, num_layers: 4 }));
        assert!(ParallelDims::new(2, 2, 2, 8).unwrap().check_model(&m).is_ok());
    }

    #[test]
    fn stage_ranges_are_balanced() {
        assert_eq!(stage_layers(10, 4), vec![0..3, 3..6, 6..8, 8..10]);
        assert_eq!(stage_of_layer(7, 10, 4), 2);
    }

    proptest! {
        #[test]
        fn every_factorisation_is_valid_and_grids_are_bijections(world in 1usize..=64) {
            let all = ParallelDims::all(world);
            for d in &all {
                prop_assert_eq!(ParallelDims::new(d.dp, d.tp, d.pp, world).unwrap(), *d);
                let grid = RankGrid::new(*d);
                let mut seen = std::collections::HashSet::new();
                for r in 0..world {
                    let c = grid.coord(r).unwrap();
                    prop_assert_eq!(grid.rank(c), r);
                    prop_assert!(seen.insert((c.dp, c.tp, c.pp)), "two ranks share {:?}", c);
                }
                for axis in [Axis::Dp, Axis::Tp, Axis::Pp] {
                    let groups = grid.groups(axis);
                    prop_assert_eq!(groups.len(), world / d.degree(axis));
                    let mut count = vec![0; world];
                    for g in &groups {
                        prop_assert_eq!(g.len(), d.degree(axis));
                        for &r in g { count[r] += 1; }
                    }
                    prop_assert!(count.iter().all(|&c| c == 1), "groups partition the world");
                }
            }
            // Count of ordered factorisations: check against brute force.
            let brute = (1..=world).flat_map(|a| (1..=world).map(move |b| (a, b)))
                .filter(|&(a, b)| a * b <= world && world % (a * b) == 0).count();
            prop_assert_eq!(all.len(), brute);
        }

        #[test]
        fn stage_layers_cover_every_layer_once(layers in 1usize..100, pp in 1usize..100) {
            prop_assume!(pp <= layers);
            let r = stage_layers(layers, pp);
            prop_assert_eq!(r.len(), pp);
            prop_assert_eq!(r[0].start, 0);
            prop_assert_eq!(r[pp - 1].end, layers);
            for w in r.windows(2) { prop_assert_eq!(w[0].end, w[1].start); }
            for (s, range) in r.iter().enumerate() { prop_assert_eq!(stage_len(layers, pp, s), range.len()); }
            let lens: Vec<_> = r.iter().map(|x| x.len()).collect();
            prop_assert!(lens.iter().max().unwrap() - lens.iter().min().unwrap() <= 1);
        }
    }
}
