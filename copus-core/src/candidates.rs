//! The candidate configurations (S, B_g, B_m) for a world size: every layout, global batch and
//! micro-batch with `B_g = dp * B_m * a` for a whole `a >= 1` that fits in memory. A rejected
//! candidate keeps its reason for reports.

use std::fmt;

use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::layout::{LayoutError, ParallelDims};
use crate::memory::{MemoryEstimate, MemoryModel};
use crate::model::ModelSpec;
use crate::schedule::ScheduleKind;

/// One configuration copus can run. Deserialising (a wire message, a checkpoint) goes through
/// [`Candidate::new`], with B_g at most [`MAX_GLOBAL_BATCH`] and the stored `num_micro` checked.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(try_from = "RawCandidate")]
pub struct Candidate {
    /// The layout S.
    pub dims: ParallelDims,
    /// Global batch size B_g in sequences.
    pub global_batch: usize,
    /// Micro-batch size B_m in sequences.
    pub micro_batch: usize,
    /// Micro-batches per dp rank per step, `a = B_g / (dp * B_m)`.
    pub num_micro: usize,
}

/// The largest B_g a deserialised candidate may have (no batch arithmetic on it can overflow).
pub const MAX_GLOBAL_BATCH: usize = 1 << 30;

/// A candidate as written, before validation.
#[derive(Deserialize)]
struct RawCandidate {
    dims: ParallelDims,
    global_batch: usize,
    micro_batch: usize,
    num_micro: usize,
}

impl TryFrom<RawCandidate> for Candidate {
    type Error = String;
    fn try_from(r: RawCandidate) -> Result<Self, String> {
        if r.global_batch > MAX_GLOBAL_BATCH {
            return Err(format!("global_batch {} exceeds {MAX_GLOBAL_BATCH}", r.global_batch));
        }
        let c = Candidate::new(r.dims, r.global_batch, r.micro_batch).map_err(|e| e.to_string())?;
        if c.num_micro != r.num_micro {
            return Err(format!("num_micro {} does not match B_g / (dp x B_m) = {}", r.num_micro, c.num_micro));
        }
        Ok(c)
    }
}

impl Candidate {
    /// Builds a candidate if `B_g = dp * B_m * a` for a whole `a >= 1`.
    pub fn new(dims: ParallelDims, global_batch: usize, micro_batch: usize) -> Result<Self, Rejection> {
        let per_step = dims.dp.checked_mul(micro_batch).unwrap_or(0);
        if per_step == 0 || global_batch == 0 || !global_batch.is_multiple_of(per_step) {
            return Err(Rejection::BatchNotDivisible { global_batch, dp: dims.dp, micro_batch });
        }
        Ok(Self { dims, global_batch, micro_batch, num_micro: global_batch / per_step })
    }

    /// Micro-batches in one step over all dp ranks, `n = B_g / B_m`.
    pub fn total_micro(&self) -> usize {
        self.global_batch / self.micro_batch
    }

    /// Whether going to `other` changes the layout (not only the batch).
    pub fn layout_differs(&self, other: &Candidate) -> bool {
        self.dims != other.dims
    }
}

impl fmt::Display for Candidate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} B_g={} B_m={} a={}", self.dims, self.global_batch, self.micro_batch, self.num_micro)
    }
}

/// Why a configuration is not a candidate.
#[derive(Clone, Debug, PartialEq, Error, Serialize, Deserialize)]
pub enum Rejection {
    /// The layout does not fit the world or the model.
    #[error("layout: {0}")]
    Layout(LayoutError),
    /// B_g is not a whole multiple of dp * B_m.
    #[error("B_g = {global_batch} is not a whole multiple of dp * B_m = {dp} * {micro_batch}")]
    BatchNotDivisible {
        /// B_g asked for, in sequences.
        global_batch: usize,
        /// Data-parallel degree of the layout: each dp rank takes `B_g / dp` sequences.
        dp: usize,
        /// B_m asked for, in sequences.
        micro_batch: usize,
    },
    /// The most loaded rank needs more memory than the device has.
    #[error("out of memory: stage {stage} needs {need_gib:.2} GiB of {budget_gib:.2} GiB")]
    OutOfMemory {
        /// The pipeline stage that overflows (0 without pipelining).
        stage: usize,
        /// Memory that stage's ranks need, in GiB.
        need_gib: f64,
        /// Memory one device has, in GiB.
        budget_gib: f64,
    },
}

/// A configuration that is not a candidate, and why.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Rejected {
    /// The layout S tried.
    pub dims: ParallelDims,
    /// B_g tried, in sequences.
    pub global_batch: usize,
    /// B_m tried, in sequences.
    pub micro_batch: usize,
    /// The first check it failed.
    pub reason: Rejection,
}

/// Invalid search-space settings.
#[derive(Clone, Debug, PartialEq, Error)]
pub enum SpaceError {
    /// A list is empty or holds a zero.
    #[error("`{field}` must be a non-empty list of positive sizes, got {got:?}")]
    BadList {
        /// The list at fault (`global_batches` or `micro_batches`).
        field: &'static str,
        /// The list as given.
        got: Vec<usize>,
    },
    /// A world of no ranks.
    #[error("`world_size` must be at least 1")]
    ZeroWorld,
    /// Device memory that is zero, negative or NaN; the value given.
    #[error("`device_memory_gib` must be positive, got {0}")]
    BadMemory(f64),
}

/// The search space of one run.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CandidateSpace {
    /// Ranks available; every layout uses all of them (`dp * tp * pp = world_size`).
    pub world_size: usize,
    /// Global batch sizes to consider, in sequences ([`CandidateSpace::new`] sorts and dedups).
    pub global_batches: Vec<usize>,
    /// Micro-batch sizes to consider, in sequences ([`CandidateSpace::new`] sorts and dedups).
    pub micro_batches: Vec<usize>,
    /// Pipeline schedule used when pp > 1.
    pub schedule: ScheduleKind,
    /// Bytes per weight, gradient, optimizer and activation element, for the memory check.
    pub memory: MemoryModel,
    /// Device memory per rank, in bytes.
    pub device_memory: f64,
}

/// The outcome of enumerating a space.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Enumeration {
    /// Candidates, ordered by (layout, B_g, B_m).
    pub feasible: Vec<Candidate>,
    /// Every other (layout, B_g, B_m) of the space, with the reason it was rejected.
    pub rejected: Vec<Rejected>,
}

impl CandidateSpace {
    /// A space over `world_size` ranks. Errors: a world of zero ranks, an empty batch list or
    /// one holding a zero, device memory not positive. The batch lists are sorted and deduplicated.
    pub fn new(
        world_size: usize,
        global_batches: Vec<usize>,
        micro_batches: Vec<usize>,
        schedule: ScheduleKind,
        memory: MemoryModel,
        device_memory: f64,
    ) -> Result<Self, SpaceError> {
        if world_size == 0 {
            return Err(SpaceError::ZeroWorld);
        }
        for (field, list) in [("global_batches", &global_batches), ("micro_batches", &micro_batches)] {
            if list.is_empty() || list.contains(&0) {
                return Err(SpaceError::BadList { field, got: list.clone() });
            }
        }
        if device_memory.is_nan() || device_memory <= 0.0 {
            return Err(SpaceError::BadMemory(device_memory));
        }
        let mut global_batches = global_batches;
        let mut micro_batches = micro_batches;
        global_batches.sort_unstable();
        global_batches.dedup();
        micro_batches.sort_unstable();
        micro_batches.dedup();
        Ok(Self { world_size, global_batches, micro_batches, schedule, memory, device_memory })
    }

    /// Checks one configuration; the reason if it is not a candidate.
    pub fn check(
        &self,
        model: &ModelSpec,
        dims: ParallelDims,
        global_batch: usize,
        micro_batch: usize,
    ) -> Result<(Candidate, MemoryEstimate), Rejection> {
        let dims = ParallelDims::new(dims.dp, dims.tp, dims.pp, self.world_size).map_err(Rejection::Layout)?;
        dims.check_model(model).map_err(Rejection::Layout)?;
        let c = Candidate::new(dims, global_batch, micro_batch)?;
        let mem = self.memory.estimate(model, dims, micro_batch, c.num_micro, self.schedule);
        if mem.total() > self.device_memory {
            return Err(Rejection::OutOfMemory {
                stage: mem.stage,
                need_gib: mem.total() / crate::memory::GIB,
                budget_gib: self.device_memory / crate::memory::GIB,
            });
        }
        Ok((c, mem))
    }

    /// Every configuration in the space, split into candidates and rejections.
    pub fn enumerate(&self, model: &ModelSpec) -> Enumeration {
        let mut out = Enumeration::default();
        for dims in ParallelDims::all(self.world_size) {
            for &global_batch in &self.global_batches {
                for &micro_batch in &self.micro_batches {
                    match self.check(model, dims, global_batch, micro_batch) {
                        Ok((c, _)) => out.feasible.push(c),
                        Err(reason) => out.rejected.push(Rejected { dims, global_batch, micro_batch, reason }),
                    }
                }
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::GIB;
    use proptest::prelude::*;

    fn space(world: usize, gb: Vec<usize>, mb: Vec<usize>, mem_gib: f64) -> CandidateSpace {
        CandidateSpace::new(world, gb, mb, ScheduleKind::OneFOneB, MemoryModel::fp32(), mem_gib * GIB).unwrap()
    }

    #[test]
    fn deserialised_candidates_are_checked() {
        let c = Candidate::new(ParallelDims { dp: 2, tp: 1, pp: 1 }, 8, 2).unwrap();
        let text = serde_json::to_string(&c).unwrap();
        assert_eq!(serde_json::from_str::<Candidate>(&text).unwrap(), c);
        for (bad, why) in [
            (text.replace("\"num_micro\":2", "\"num_micro\":3"), "num_micro 3"),
            (text.replace("\"global_batch\":8", "\"global_batch\":7"), "7"),
            (text.replace("\"global_batch\":8", "\"global_batch\":18446744073709551615"), "exceeds"),
            (text.replace("\"dp\":2", "\"dp\":0"), "dp must be at least 1"),
        ] {
            let e = serde_json::from_str::<Candidate>(&bad).unwrap_err().to_string();
            assert!(e.contains(why), "{bad}: {e}");
        }
    }

    #[test]
    fn reasons_are_kept() {
        let m = ModelSpec::tiny_1m();
        let e = space(8, vec![8, 12], vec![1, 2], 64.0).enumerate(&m);
        let has = |pred: &dyn Fn(&Rejection) -> bool| e.rejected.iter().any(|r| pred(&r.reason));
        assert!(has(&|r| matches!(r, Rejection::BatchNotDivisible { global_batch: 12, dp: 8, .. })));
        assert!(has(&|r| matches!(r, Rejection::Layout(LayoutError::TpKvHeads { tp: 8, .. }))));
        assert!(has(&|r| matches!(r, Rejection::Layout(LayoutError::PpLayers { pp: 8, .. }))));
        for c in &e.feasible {
            assert_eq!(c.dims.dp * c.micro_batch * c.num_micro, c.global_batch);
        }
        assert_eq!(e.feasible.len() + e.rejected.len(), 10 * 2 * 2);
    }

    #[test]
    fn memory_rejects_big_models_on_small_devices() {
        // Llama-2-7B in fp32 with AdamW needs 16 bytes/param = 100 GiB on one rank.
        let m = ModelSpec::llama_2_7b();
        let s = space(8, vec![8], vec![1], 80.0);
        let r = s.check(&m, ParallelDims { dp: 8, tp: 1, pp: 1 }, 8, 1).unwrap_err();
        assert!(matches!(r, Rejection::OutOfMemory { .. }), "{r}");
        assert!(r.to_string().contains("GiB"));
        assert!(s.check(&m, ParallelDims { dp: 1, tp: 4, pp: 2 }, 8, 1).is_ok());
    }

    #[test]
    fn huge_or_zero_sizes_are_rejections_not_panics() {
        let d = ParallelDims { dp: usize::MAX, tp: 1, pp: 1 };
        assert!(matches!(Candidate::new(d, 8, usize::MAX), Err(Rejection::BatchNotDivisible { .. })));
        assert!(Candidate::new(ParallelDims::serial(), 8, 0).is_err());
        assert!(Candidate::new(ParallelDims { dp: 0, tp: 1, pp: 1 }, 8, 1).is_err());
    }

    #[test]
    fn bad_settings_name_the_field() {
        let e = CandidateSpace::new(8, vec![], vec![1], ScheduleKind::GPipe, MemoryModel::fp32(), 1.0);
        assert_eq!(e.unwrap_err().to_string(), "`global_batches` must be a non-empty list of positive sizes, got []");
        let e = CandidateSpace::new(8, vec![4], vec![0], ScheduleKind::GPipe, MemoryModel::fp32(), 1.0);
        assert!(e.unwrap_err().to_string().contains("micro_batches"));
        assert!(CandidateSpace::new(8, vec![4], vec![1], ScheduleKind::GPipe, MemoryModel::fp32(), f64::NAN).is_err());
    }

    proptest! {
        #[test]
        fn candidates_are_exactly_the_divisible_splits(
            world in 1usize..=32,
            gb in proptest::collection::vec(1usize..=256, 1..6),
            mb in proptest::collection::vec(1usize..=16, 1..4),
        ) {
            let m = ModelSpec::tiny_1m();
            let s = space(world, gb, mb, 1.0e6);
            let e = s.enumerate(&m);
            for c in &e.feasible {
                prop_assert_eq!(c.dims.world_size(), world);
                prop_assert!(c.num_micro >= 1);
                prop_assert_eq!(c.dims.dp * c.micro_batch * c.num_micro, c.global_batch);
                prop_assert_eq!(c.total_micro() * c.micro_batch, c.global_batch);
            }
            // Brute-force reference: a configuration is feasible iff the layout suits the model
            // and dp * B_m divides B_g (memory is unlimited here).
            let mut expected = 0;
            for d in ParallelDims::all(world) {
                for &g in &s.global_batches { for &b in &s.micro_batches {
                    if d.check_model(&m).is_ok() && g % (d.dp * b) == 0 { expected += 1; }
                }}
            }
            prop_assert_eq!(e.feasible.len(), expected);
        }
    }
}
