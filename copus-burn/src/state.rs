//! The training state in host memory, independent of the layout: what a layout change stages,
//! what a checkpoint holds, and what each rank starts from and hands back (a rank's start may
//! also lie on its device: `ShardValues`). The engine,
//! reconfiguration and checkpoints all use it; it has its own error type ([`StateError`],
//! which the engine's error converts from), so it imports none of its users.

use std::collections::{BTreeMap, HashMap};
use std::hash::Hasher as _;

use burn::tensor::TensorData;
use burn_pack::Scalar;
use copus_core::gns::GnsEstimator;
use copus_core::layout::{Coord, ParallelDims, RankGrid, stage_of_layer};
use copus_core::model::{ModelSpec, ParamSpec, Placement};

use crate::parallel::{FullParams, ShardError, ShardPlan, ShardSource, holds, shard_values, unshard};

/// Why a training state cannot be built, checked or split.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum StateError {
    /// A parameter missing, of the wrong shape, or not of the model; shards that do not
    /// reassemble.
    #[error("sharding: {0}")]
    Shard(#[from] ShardError),
    /// The noise-scale estimator's settings.
    #[error("gradient noise scale: {0}")]
    Gns(copus_core::gns::GnsError),
    /// The state is not whole for the model (the message names the first tensor missing,
    /// extra or of the wrong size).
    #[error("checkpoint (training state): {0}")]
    Incomplete(String),
    /// No rank exported anything.
    #[error("the engine stopped after an earlier failure: {0}")]
    NoRanks(String),
}

/// (global name, field, local shape, values) of optimizer state tensors.
pub(crate) type OptimTensors = Vec<(String, String, Vec<usize>, Vec<f32>)>;
/// (global name, field, value) of optimizer state scalars.
pub(crate) type OptimScalars = Vec<(String, String, Scalar)>;

/// The values of a rank's shard as it starts: in host memory (a checkpoint, a layout change
/// across processes or in host memory), or a flat tensor already on the rank's device (a layout
/// change between rank threads on a device, whose pieces never leave it).
// A few per parameter, moved rather than copied; boxing the tensor would only add allocations.
#[allow(clippy::large_enum_variant)]
pub(crate) enum ShardValues {
    Host(Vec<f32>),
    Device(burn::tensor::Tensor<1>),
}

/// Optimizer state tensors a rank starts from: (global name, field, local shape, values).
pub(crate) type ResumeTensors = Vec<(String, String, Vec<usize>, ShardValues)>;

/// Training state a rank resumes with (empty for a fresh start).
#[derive(Default)]
pub(crate) struct RankResume {
    /// Optimizer state tensors of the rank's shards.
    pub(crate) optim: ResumeTensors,
    /// Optimizer state scalars.
    pub(crate) scalars: OptimScalars,
    /// Local shards of the previous step's gradient (n == 1 probe).
    pub(crate) previous: Option<HashMap<String, ShardValues>>,
    pub(crate) step: u64,
    pub(crate) tokens_seen: u64,
    pub(crate) gns: Option<GnsEstimator>,
}

/// What a rank of dp replica 0 hands back for staging (other replicas hold copies); with a
/// sharded optimizer (ZeRO-1) every replica hands back its pieces of the optimizer state.
pub(crate) struct RankExport {
    pub(crate) params: Vec<(String, Vec<f32>)>,
    pub(crate) optim: Vec<(String, String, Vec<f32>)>,
    /// With ZeRO-1: where each entry of `optim` starts in the rank's shard of its parameter
    /// (flat); the pieces of all dp replicas make the shard. `None`: whole shards.
    pub(crate) optim_offsets: Option<Vec<usize>>,
    pub(crate) scalars: OptimScalars,
    pub(crate) previous: Option<Vec<(String, Vec<f32>)>>,
    pub(crate) step: u64,
    pub(crate) tokens_seen: u64,
    pub(crate) gns: GnsEstimator,
}

#[cfg(feature = "mpi")]
#[derive(serde::Serialize, serde::Deserialize)]
struct ExportMeta {
    scalars: OptimScalars,
    /// (name, field, offset) of each piece (the tensors are not read back in the order written).
    #[serde(default)]
    optim_offsets: Option<Vec<(String, String, usize)>>,
    has_previous: bool,
    step: u64,
    tokens_seen: u64,
    gns: GnsEstimator,
}

#[cfg(feature = "mpi")]
impl RankExport {
    const KEY: &'static str = "copus.rank-export";

    /// The export as bytes, for the process that stages it.
    pub(crate) fn to_bytes(&self) -> Result<Vec<u8>, String> {
        let meta = ExportMeta {
            scalars: self.scalars.clone(),
            optim_offsets: self
                .optim_offsets
                .as_ref()
                .map(|o| self.optim.iter().zip(o).map(|((n, f, _), &at)| (n.clone(), f.clone(), at)).collect()),
            has_previous: self.previous.is_some(),
            step: self.step,
            tokens_seen: self.tokens_seen,
            gns: self.gns.clone(),
        };
        let meta = serde_json::to_string(&meta).map_err(|e| e.to_string())?;
        let flat = |key: String, v: &Vec<f32>| (key, vec![v.len()], v.clone());
        let tensors = self
            .params
            .iter()
            .map(|(n, v)| flat(format!("param/{n}"), v))
            .chain(self.optim.iter().map(|(n, f, v)| flat(format!("optim/{n}/{f}"), v)))
            .chain(self.previous.iter().flatten().map(|(n, v)| flat(format!("previous/{n}"), v)));
        crate::wire::pack(Self::KEY, &meta, tensors)
    }

    /// Reads what [`RankExport::to_bytes`] wrote.
    pub(crate) fn from_bytes(bytes: Vec<u8>) -> Result<Self, String> {
        let (meta, tensors) = crate::wire::unpack(Self::KEY, bytes)?;
        let meta: ExportMeta = serde_json::from_str(&meta).map_err(|e| e.to_string())?;
        let mut out = RankExport {
            params: Vec::new(),
            optim: Vec::new(),
            optim_offsets: None,
            scalars: meta.scalars,
            previous: meta.has_previous.then(Vec::new),
            step: meta.step,
            tokens_seen: meta.tokens_seen,
            gns: meta.gns,
        };
        for (key, _, v) in tensors {
            if let Some(n) = key.strip_prefix("param/") {
                out.params.push((n.to_string(), v));
            } else if let Some(rest) = key.strip_prefix("optim/") {
                let (n, f) = rest.rsplit_once('/').ok_or_else(|| format!("unexpected tensor {key}"))?;
                out.optim.push((n.to_string(), f.to_string(), v));
            } else if let Some(n) = key.strip_prefix("previous/") {
                out.previous.get_or_insert_with(Vec::new).push((n.to_string(), v));
            } else {
                return Err(format!("unexpected tensor {key}"));
            }
        }
        if let Some(pieces) = meta.optim_offsets {
            let at: HashMap<(String, String), usize> = pieces.into_iter().map(|(n, f, at)| ((n, f), at)).collect();
            let offsets = out
                .optim
                .iter()
                .map(|(n, f, _)| at.get(&(n.clone(), f.clone())).copied().ok_or_else(|| format!("no offset for the piece {n}/{f}")));
            out.optim_offsets = Some(offsets.collect::<Result<_, _>>()?);
        }
        Ok(out)
    }
}

/// (rank, parameter, field) of an optimizer state shard.
type ShardKey = (usize, String, String);

/// The pieces of a sharded optimizer's state in `exports` (of the layout of `grid`), stitched
/// into whole shards: (rank of dp replica 0 with the same tp and pp coordinates, parameter,
/// field) -> values. Each shard's length is its parameter's, exported by that rank; every
/// element must come from exactly one piece.
fn stitch_pieces(exports: &[RankExport], grid: &RankGrid) -> Result<HashMap<ShardKey, Vec<f32>>, StateError> {
    // Each shard and the (start, end) of the pieces written into it.
    type Tiles = Vec<(usize, usize)>;
    let mut out: HashMap<ShardKey, (Vec<f32>, Tiles)> = HashMap::new();
    for (r, e) in exports.iter().enumerate() {
        let Some(offsets) = &e.optim_offsets else { continue };
        let bad = |m: String| StateError::Incomplete(format!("sharded optimizer state of rank {r}: {m}"));
        if offsets.len() != e.optim.len() {
            return Err(bad(format!("{} offsets for {} pieces", offsets.len(), e.optim.len())));
        }
        let c = grid.coord(r).map_err(|e| bad(e.to_string()))?;
        let r0 = grid.rank(Coord { dp: 0, ..c });
        for ((n, f, v), &at) in e.optim.iter().zip(offsets) {
            let len = exports
                .get(r0)
                .and_then(|x| x.params.iter().find(|(p, _)| p == n))
                .map(|(_, p)| p.len())
                .ok_or_else(|| bad(format!("`{n}` is not a parameter of rank {r0}")))?;
            let (shard, pieces) = out.entry((r0, n.clone(), f.clone())).or_insert_with(|| (vec![0f32; len], Vec::new()));
            let dst = shard
                .get_mut(at..at + v.len())
                .ok_or_else(|| bad(format!("a piece of `{n}` at {at}+{} past its {len} elements", v.len())))?;
            dst.copy_from_slice(v);
            pieces.push((at, at + v.len()));
        }
    }
    out.into_iter()
        .map(|(key, (shard, mut pieces))| {
            // Sorted, the pieces must tile the shard: each starts where the previous ended.
            pieces.sort_unstable();
            let mut end = 0;
            for (a, b) in pieces {
                if a != end {
                    let what = if a < end { "overlap" } else { "leave a gap" };
                    return Err(StateError::Incomplete(format!("the pieces of `{}#{}` {what} at element {a}", key.1, key.2)));
                }
                end = b;
            }
            if end != shard.len() {
                return Err(StateError::Incomplete(format!(
                    "the pieces of `{}#{}` end at {end} of its {} elements",
                    key.1,
                    key.2,
                    shard.len()
                )));
            }
            Ok((key, shard))
        })
        .collect()
}

/// What a rank starts from: its shards, its resume state and the checksums it must report.
pub(crate) type RankStart = (ShardSource, RankResume, Vec<(String, u64)>);

/// A 64-bit checksum of a tensor's values: XXH3 over their little-endian bytes, so it sees
/// every bit pattern, each value's position and the length. Its AVX2 kernel (chosen at run time)
/// sums a block in cache several times faster than the block can be copied from memory, so a
/// copy can sum what it moves at little cost.
pub fn checksum(values: &[f32]) -> u64 {
    let mut sum = Checksum::new();
    sum.update(values);
    sum.finish()
}

/// [`checksum`] fed in parts: the values in order, in any split, give the same sum. A copy can
/// sum each block it has just written while the block is in cache.
pub struct Checksum(twox_hash::XxHash3_64);

impl Default for Checksum {
    fn default() -> Self {
        Self::new()
    }
}

impl std::fmt::Debug for Checksum {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Checksum({:016x})", self.finish())
    }
}

impl Checksum {
    /// The sum of no values yet.
    pub fn new() -> Self {
        Self(twox_hash::XxHash3_64::new())
    }

    /// Adds the next values.
    pub fn update(&mut self, values: &[f32]) {
        #[cfg(target_endian = "little")]
        self.0.write(bytemuck::cast_slice(values));
        #[cfg(target_endian = "big")]
        for v in values {
            self.0.write(&v.to_le_bytes());
        }
    }

    /// The sum of every value added.
    pub fn finish(&self) -> u64 {
        self.0.finish()
    }
}

/// Everything needed to continue training, in host memory, independent of the layout.
#[derive(Clone, Debug)]
pub struct TrainingState {
    /// Full parameters by global name, row-major.
    pub params: BTreeMap<String, Vec<f32>>,
    /// Optimizer state tensors (AdamW's two moments) by parameter and field, full shape.
    pub optim: BTreeMap<String, BTreeMap<String, Vec<f32>>>,
    /// Optimizer state scalars (step counts) by parameter and field.
    pub scalars: BTreeMap<String, BTreeMap<String, Scalar>>,
    /// The previous step's gradient (kept for the single-micro-batch probe).
    pub previous: Option<BTreeMap<String, Vec<f32>>>,
    /// Optimizer steps taken.
    pub step: u64,
    /// Training tokens consumed.
    pub tokens_seen: u64,
    /// The noise-scale estimator.
    pub gns: GnsEstimator,
}

impl TrainingState {
    /// The state before the first step, from full parameters.
    pub fn fresh(spec: &ModelSpec, full: &FullParams, gns: GnsEstimator) -> Result<Self, StateError> {
        let mut params = BTreeMap::new();
        for p in spec.param_specs() {
            let data = full.get(&p.name).ok_or_else(|| StateError::Shard(ShardError::Missing(p.name.clone())))?;
            if data.shape().to_vec() != p.shape {
                return Err(StateError::Shard(ShardError::Shape { name: p.name.clone(), got: data.shape().to_vec(), expected: p.shape }));
            }
            let values = data.iter::<f32>().collect();
            params.insert(p.name, values);
        }
        if let Some(extra) = full.keys().find(|k| !params.contains_key(*k)) {
            return Err(StateError::Shard(ShardError::Layout(format!("parameter `{extra}` is not part of the model"))));
        }
        Ok(Self { params, optim: BTreeMap::new(), scalars: BTreeMap::new(), previous: None, step: 0, tokens_seen: 0, gns })
    }

    /// Checks the state is whole for a model of `specs`: every parameter present with its
    /// element count and no other; optimizer state either absent everywhere (before the first
    /// step) or the same fields for every parameter, each of the parameter's size; the previous
    /// gradient, when kept, for every parameter. The error names the first tensor that is
    /// missing, extra or of the wrong size, so a partial state is never loaded (it would silently
    /// restart AdamW moments).
    pub fn check(&self, specs: &[ParamSpec]) -> Result<(), StateError> {
        let bad = StateError::Incomplete;
        let sizes: BTreeMap<&str, usize> = specs.iter().map(|s| (s.name.as_str(), s.shape.iter().product())).collect();
        // `label` names the tensor in errors; `name` is its parameter.
        let check_len = |label: String, name: &str, len: usize| -> Result<(), StateError> {
            match sizes.get(name) {
                None => Err(bad(format!("{label} is not of a parameter of the model (an extra tensor)"))),
                Some(&n) if n != len => Err(bad(format!("{label} has {len} elements, the parameter has {n}"))),
                Some(_) => Ok(()),
            }
        };
        for (name, v) in &self.params {
            check_len(format!("parameter `{name}`"), name, v.len())?;
        }
        if let Some(missing) = specs.iter().find(|s| !self.params.contains_key(&s.name)) {
            return Err(bad(format!("parameter `{}` is missing", missing.name)));
        }
        // Every parameter carries every field any parameter has (AdamW: both moments).
        let fields: std::collections::BTreeSet<&String> = self.optim.values().flat_map(|f| f.keys()).collect();
        if !fields.is_empty() {
            if fields.len() != 2 {
                return Err(bad(format!("the optimizer state has {} field(s) per parameter; AdamW keeps both moments", fields.len())));
            }
            for spec in specs {
                let Some(mine) = self.optim.get(&spec.name) else {
                    return Err(bad(format!("optimizer state of `{}` is missing", spec.name)));
                };
                if let Some(f) = fields.iter().find(|f| !mine.contains_key(f.as_str())) {
                    return Err(bad(format!("optimizer tensor `{}#{f}` is missing", spec.name)));
                }
            }
            for (name, f) in &self.optim {
                for (field, v) in f {
                    check_len(format!("optimizer tensor `{name}#{field}`"), name, v.len())?;
                }
            }
            // AdamW's step counts go with its moments.
            if let Some(spec) = specs.iter().find(|s| self.scalars.get(&s.name).is_none_or(BTreeMap::is_empty)) {
                return Err(bad(format!("the optimizer's step count of `{}` is missing", spec.name)));
            }
        } else if self.step > 0 {
            return Err(bad(format!("the optimizer state is missing although {} steps were taken", self.step)));
        }
        if let Some(prev) = &self.previous {
            for (name, v) in prev {
                check_len(format!("previous gradient `{name}`"), name, v.len())?;
            }
            if let Some(missing) = specs.iter().find(|s| !prev.contains_key(&s.name)) {
                return Err(bad(format!("previous gradient of `{}` is missing", missing.name)));
            }
        }
        Ok(())
    }

    /// Bytes of tensor data held.
    pub fn bytes(&self) -> u64 {
        let n: usize = self.params.values().map(Vec::len).sum::<usize>()
            + self.optim.values().flat_map(|f| f.values()).map(Vec::len).sum::<usize>()
            + self.previous.iter().flat_map(|p| p.values()).map(Vec::len).sum::<usize>();
        4 * n as u64
    }

    /// What the rank with `plan` starts from, and the checksums it must report after loading.
    pub(crate) fn rank_init(&self, specs: &[ParamSpec], plan: &ShardPlan) -> Result<RankStart, StateError> {
        let num_layers =
            specs.iter().filter_map(|s| if let Placement::Layer(i) = s.placement { Some(i + 1) } else { None }).max().unwrap_or(0);
        let (tp, t) = (plan.dims.tp, plan.tp_rank);
        let mut shards = HashMap::new();
        let mut resume =
            RankResume { step: self.step, tokens_seen: self.tokens_seen, gns: Some(self.gns.clone()), ..RankResume::default() };
        let mut hashes = Vec::new();
        let mut previous = self.previous.as_ref().map(|_| HashMap::new());
        for spec in specs {
            if !holds(spec, plan, num_layers) {
                continue;
            }
            let full = self.params.get(&spec.name).ok_or_else(|| StateError::Shard(ShardError::Missing(spec.name.clone())))?;
            let (shape, values) = shard_values(spec, full, tp, t)?;
            hashes.push((spec.name.clone(), checksum(&values)));
            shards.insert(spec.name.clone(), TensorData::new(values, shape.clone()));
            for (field, full) in self.optim.get(&spec.name).into_iter().flatten() {
                let (shape, values) = shard_values(spec, full, tp, t)?;
                hashes.push((format!("{}#{field}", spec.name), checksum(&values)));
                resume.optim.push((spec.name.clone(), field.clone(), shape, ShardValues::Host(values)));
            }
            for (field, v) in self.scalars.get(&spec.name).into_iter().flatten() {
                resume.scalars.push((spec.name.clone(), field.clone(), *v));
            }
            if let (Some(prev), Some(out)) = (&self.previous, previous.as_mut())
                && let Some(full) = prev.get(&spec.name)
            {
                out.insert(spec.name.clone(), ShardValues::Host(shard_values(spec, full, tp, t)?.1));
            }
        }
        resume.previous = previous;
        Ok((ShardSource::new(shards), resume, hashes))
    }

    /// Reassembles the state from the ranks' exports (in rank order) of layout `dims`.
    pub(crate) fn from_exports(
        exports: Vec<RankExport>,
        specs: &[ParamSpec],
        dims: ParallelDims,
        num_layers: usize,
    ) -> Result<Self, StateError> {
        let grid = RankGrid::new(dims);
        let first = exports.first().ok_or_else(|| StateError::NoRanks("no ranks".into()))?;
        let mut state = TrainingState {
            params: BTreeMap::new(),
            optim: BTreeMap::new(),
            scalars: BTreeMap::new(),
            previous: first.previous.as_ref().map(|_| BTreeMap::new()),
            step: first.step,
            tokens_seen: first.tokens_seen,
            gns: first.gns.clone(),
        };
        // Index each exporting rank's tensors by name.
        type Index<'a> = HashMap<&'a str, &'a Vec<f32>>;
        let params: Vec<Index> = exports.iter().map(|e| e.params.iter().map(|(n, v)| (n.as_str(), v)).collect()).collect();
        let prev: Vec<Index> = exports.iter().map(|e| e.previous.iter().flatten().map(|(n, v)| (n.as_str(), v)).collect()).collect();
        // A sharded optimizer's pieces, stitched into the shards of dp replica 0's ranks.
        let stitched = stitch_pieces(&exports, &grid)?;
        let optim = optim_fields(&exports, &stitched);
        for spec in specs {
            let stage = match spec.placement {
                Placement::Layer(i) => stage_of_layer(i, num_layers, dims.pp),
                Placement::Last => dims.pp - 1,
                Placement::First | Placement::FirstAndLast => 0,
            };
            let holders: Vec<usize> = (0..dims.tp).map(|t| grid.rank(Coord { dp: 0, tp: t, pp: stage })).collect();
            let gather = |index: &[Index], what: &str| -> Result<Option<Vec<f32>>, StateError> {
                let shards: Option<Vec<Vec<f32>>> =
                    holders.iter().map(|&r| index[r].get(spec.name.as_str()).map(|v| (*v).clone())).collect();
                match shards {
                    Some(s) => Ok(Some(unshard(spec, &s, dims.tp)?)),
                    None if what == "parameter" => Err(StateError::Shard(ShardError::Missing(format!("{} on stage {stage}", spec.name)))),
                    None => Ok(None),
                }
            };
            let full = gather(&params, "parameter")?.expect("parameters are always exported");
            state.params.insert(spec.name.clone(), full);
            if let (Some(p), Some(full)) = (state.previous.as_mut(), gather(&prev, "previous")?) {
                p.insert(spec.name.clone(), full);
            }
            state.insert_optim(spec, &holders, &optim, dims.tp)?;
            state.insert_scalars(spec, &exports, &grid, dims.dp, stage);
        }
        Ok(state)
    }

    /// From exports, optimizer state: `spec`'s optimizer fields, each unsharded from the tp
    /// ranks `holders` of its stage (`optim`: per rank, its fields by parameter).
    fn insert_optim(&mut self, spec: &ParamSpec, holders: &[usize], optim: &[Fields], tp: usize) -> Result<(), StateError> {
        if let Some(fields) = optim[holders[0]].get(spec.name.as_str()) {
            for (field, _) in fields {
                let mut shards = Vec::with_capacity(holders.len());
                for &r in holders {
                    let v = optim[r]
                        .get(spec.name.as_str())
                        .and_then(|fs| fs.iter().find(|(f, _)| f == field))
                        .ok_or_else(|| StateError::Shard(ShardError::Missing(format!("{}#{field} on rank {r}", spec.name))))?;
                    shards.push(v.1.clone());
                }
                self.optim.entry(spec.name.clone()).or_default().insert(field.to_string(), unshard(spec, &shards, tp)?);
            }
        }
        Ok(())
    }

    /// From exports, optimizer scalars: `spec`'s, from the first of the `dp` replicas of tp
    /// rank 0 on `stage` (of the layout of `grid`) that exported any.
    fn insert_scalars(&mut self, spec: &ParamSpec, exports: &[RankExport], grid: &RankGrid, dp: usize, stage: usize) {
        // (A sharded optimizer's scalars are on the replicas holding a piece.)
        let replicas = (0..dp).map(|d| grid.rank(Coord { dp: d, tp: 0, pp: stage }));
        for r in replicas {
            let mine: Vec<_> = exports[r].scalars.iter().filter(|(n, _, _)| n == &spec.name).collect();
            if !mine.is_empty() {
                for (n, f, v) in mine {
                    self.scalars.entry(n.clone()).or_default().insert(f.clone(), *v);
                }
                break;
            }
        }
    }
}

/// Per rank: parameter -> (field, values) of its optimizer state.
type Fields<'a> = HashMap<&'a str, Vec<(&'a str, &'a Vec<f32>)>>;

/// Per rank, its optimizer state by parameter: from its export where the optimizer is whole
/// there, and from the pieces `stitched` into the shards of dp replica 0's ranks.
fn optim_fields<'a>(exports: &'a [RankExport], stitched: &'a HashMap<ShardKey, Vec<f32>>) -> Vec<Fields<'a>> {
    let mut optim: Vec<Fields> = vec![HashMap::new(); exports.len()];
    for (r, e) in exports.iter().enumerate() {
        if e.optim_offsets.is_none() {
            for (n, f, v) in &e.optim {
                optim[r].entry(n.as_str()).or_default().push((f.as_str(), v));
            }
        }
    }
    for ((r, n, f), v) in stitched {
        optim[*r].entry(n.as_str()).or_default().push((f.as_str(), v));
    }
    optim
}
