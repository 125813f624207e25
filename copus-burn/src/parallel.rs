//! What a model implements to run under copus's 3D parallelism, and the model-agnostic pieces
//! around it: shard plans, slicing full parameters into shards and back, name-keyed parameter
//! access, and the vocabulary-parallel embedding.
//!
//! A model is cut into *regions* whose inputs are detached leaves (see the engine):
//! - the embedding (first stage): token ids in, this rank's partial embedding out; the sum over
//!   the tp group is the full embedding (vocabulary-parallel);
//! - residual blocks: `x -> x + sum_tp(branch(x))` where `branch` is this rank's partial output
//!   (column-parallel in, row-parallel out, Megatron style); the engine adds the residual and
//!   does the sum;
//! - the head (last stage): final hidden state in, this rank's vocabulary slice of the logits
//!   out; the engine computes the vocabulary-parallel cross entropy.

use std::collections::HashMap;
use std::ops::Range;

use burn::module::{Module, ModuleVisitor, Param, ParamId};
use burn::tensor::{Device, Int, Tensor, TensorData};
use copus_core::layout::{ParallelDims, stage_layers};
use copus_core::memory::Precision;
use copus_core::model::{ModelSpec, ParamSpec, TpSplit};
use copus_core::reshard::{Placer, shard_intervals};
use thiserror::Error;

/// What one rank holds of a model under a layout.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShardPlan {
    /// The layout.
    pub dims: ParallelDims,
    /// This rank's tp index.
    pub tp_rank: usize,
    /// This rank's pipeline stage.
    pub stage: usize,
    /// Global indices of this stage's decoder layers.
    pub layers: Range<usize>,
}

impl ShardPlan {
    /// The plan of tp index `tp_rank` on stage `stage` of `dims` for a model of `num_layers`.
    pub fn new(dims: ParallelDims, tp_rank: usize, stage: usize, num_layers: usize) -> Self {
        let layers = stage_layers(num_layers, dims.pp)[stage].clone();
        Self { dims, tp_rank, stage, layers }
    }
    /// Holds the embedding.
    pub fn is_first(&self) -> bool {
        self.stage == 0
    }
    /// Holds the final norm, head and loss.
    pub fn is_last(&self) -> bool {
        self.stage + 1 == self.dims.pp
    }
}

/// Errors building or reading shards.
#[derive(Clone, Debug, PartialEq, Error)]
pub enum ShardError {
    /// A named parameter is missing from the source.
    #[error("parameter `{0}` is missing")]
    Missing(String),
    /// Data of the wrong shape.
    #[error("parameter `{name}` has shape {got:?}, expected {expected:?}")]
    Shape {
        /// Parameter.
        name: String,
        /// Shape given.
        got: Vec<usize>,
        /// Shape the spec says.
        expected: Vec<usize>,
    },
    /// The layout does not fit the parameter (from copus-core).
    #[error("{0}")]
    Layout(String),
}

/// One stage of a model on one rank: the regions the engine runs.
pub trait StageModel: Module + Clone + Send + std::fmt::Debug + 'static {
    /// Per-sequence-length data shared by the blocks (e.g. rotary tables, the arithmetic).
    type Ctx;
    /// Builds the context for sequences of `seq_len` trained in `precision`: the stage takes
    /// and returns f32 at every boundary (block inputs and outputs, logits), and computes
    /// inside in the precision's arithmetic. The engine builds it once per rank, sequence
    /// length and precision and keeps it from step to step, so it must not depend on the
    /// weights; tables it uploads should go through [`traffic::upload`](crate::traffic::upload)
    /// so that the host-traffic meter sees them.
    fn context(&self, seq_len: usize, precision: Precision) -> Self::Ctx;
    /// First stage: this rank's partial embedding `[b, s, d]` of `tokens_bs`.
    fn embed(&self, tokens_bs: Tensor<2, Int>) -> Tensor<3>;
    /// Residual blocks on this stage.
    fn num_blocks(&self) -> usize;
    /// Residual blocks per layer (2 for a transformer layer: attention, then the MLP), the
    /// unit of [`Checkpointing::Layers`](copus_core::memory::Checkpointing::Layers).
    fn blocks_per_layer(&self) -> usize {
        1
    }
    /// Block `i`'s branch output for input `x_bsd`: this rank's partial sum.
    fn block(&self, i: usize, x_bsd: Tensor<3>, ctx: &Self::Ctx) -> Tensor<3>;
    /// Last stage: this rank's vocabulary slice of the logits `[b, s, v / tp]` (f32).
    fn logits(&self, x_bsd: Tensor<3>, ctx: &Self::Ctx) -> Tensor<3>;
    /// The global parameter name of a path inside this stage module.
    fn global_name(&self, local_path: &str) -> String;
    /// Name fragments of parameters that take no weight decay.
    fn no_decay_predicates(&self) -> Vec<String> {
        Vec::new()
    }
}

/// The model's parallel plan, in the terms the engine needs; the engine names no parameter.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ParallelPlan {
    /// The vocabulary-parallel embedding (split along the vocabulary over tp).
    pub embedding: String,
    /// The vocabulary-parallel head; `None` when the head is the tied embedding.
    pub head: Option<String>,
    /// Parameters every tp rank holds whole (the norms); their partial gradients are summed
    /// over tp, and a whole-model norm counts them once.
    pub tp_replicated: Vec<String>,
}

impl ParallelPlan {
    /// Whether `name` is the embedding or the head (whose tp slice is this rank's vocabulary).
    pub fn is_vocabulary(&self, name: &str) -> bool {
        self.embedding == name || self.head.as_deref() == Some(name)
    }

    /// Checks the plan against the parameter specs: every named parameter exists, the
    /// vocabulary parameters are split over tp, and exactly the replicated specs are listed
    /// as replicated.
    pub fn check(&self, specs: &[ParamSpec]) -> Result<(), ShardError> {
        let by_name: HashMap<&str, &ParamSpec> = specs.iter().map(|s| (s.name.as_str(), s)).collect();
        let bad = |m: String| Err(ShardError::Layout(format!("the model's parallel plan: {m}")));
        for name in std::iter::once(&self.embedding).chain(&self.head) {
            match by_name.get(name.as_str()) {
                None => return bad(format!("`{name}` is not a parameter of the model")),
                Some(s) if matches!(s.tp, TpSplit::Replicated) => {
                    return bad(format!("`{name}` is the vocabulary but its spec is replicated"));
                }
                Some(_) => {}
            }
        }
        for s in specs {
            let listed = self.tp_replicated.contains(&s.name);
            let replicated = matches!(s.tp, TpSplit::Replicated);
            if listed != replicated {
                return bad(format!(
                    "`{}` is {} in the plan but {} in its spec",
                    s.name,
                    if listed { "replicated" } else { "split" },
                    if replicated { "replicated" } else { "split" }
                ));
            }
        }
        if let Some(n) = self.tp_replicated.iter().find(|n| !by_name.contains_key(n.as_str())) {
            return bad(format!("`{n}` is not a parameter of the model"));
        }
        Ok(())
    }
}

/// A model family that copus can shard.
pub trait ParallelLm: Send + Sync + 'static {
    /// The module one rank holds.
    type Stage: StageModel;
    /// The model's shape (heads, layers, parameter specs).
    fn spec(&self) -> ModelSpec;
    /// Which parameter is the embedding, which the head, which are replicated over tp.
    fn parallel_plan(&self) -> ParallelPlan;
    /// Builds the stage of `plan` on `device`, taking each parameter's local shard from
    /// `shards` (global name -> data of the local shape).
    ///
    /// Each shard is to be taken as it is (`ShardSource::param`), neither changed nor copied: a
    /// live layout change on Flex checks the built stage by the buffers it adopted.
    fn build_stage(&self, plan: &ShardPlan, shards: &mut ShardSource, device: &Device) -> Result<Self::Stage, ShardError>;
    /// The model's description for the other processes of a multi-process run (its
    /// configuration as JSON, read back by the closure given to `process::serve`); `None`: the
    /// model runs on in-process ranks only.
    fn describe(&self) -> Option<String> {
        None
    }
}

/// A parameter's id from its global name, the same under every layout (so optimizer state keyed
/// by id follows a parameter across reconfigurations).
pub fn param_id(name: &str) -> ParamId {
    // FNV-1a, 64 bit.
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in name.bytes() {
        h = (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
    }
    ParamId::from(h)
}

/// Full parameters as host data by global name.
pub type FullParams = HashMap<String, TensorData>;

/// The local shards of one rank, by global name, handed to [`ParallelLm::build_stage`]: host
/// data, or flat tensors that already lie on a device (a layout change between rank threads on a
/// device), each taken as it is.
pub struct ShardSource {
    shards: HashMap<String, TensorData>,
    tensors: HashMap<String, (Vec<usize>, Tensor<1>)>,
}

impl ShardSource {
    /// Local shards by global name.
    pub fn new(shards: HashMap<String, TensorData>) -> Self {
        Self { shards, tensors: HashMap::new() }
    }

    /// Adds the local shard of `name`, of `shape`, as the flat tensor `t` where it lies: a
    /// parameter built from it is `t` reshaped (moved only if it lies on another device), with no
    /// trip through host memory.
    pub fn insert_tensor(&mut self, name: String, shape: Vec<usize>, t: Tensor<1>) {
        self.tensors.insert(name, (shape, t));
    }

    /// Takes the local shard of `name` as a parameter with the name's id.
    pub fn param<const D: usize>(&mut self, name: &str, device: &Device) -> Result<Param<Tensor<D>>, ShardError> {
        if let Some((shape, t)) = self.tensors.remove(name) {
            let dims: [usize; D] =
                shape.clone().try_into().map_err(|_| ShardError::Shape { name: name.into(), got: shape.clone(), expected: vec![0; D] })?;
            if shape.iter().product::<usize>() != t.dims()[0] {
                return Err(ShardError::Shape { name: name.into(), got: vec![t.dims()[0]], expected: shape });
            }
            let t = if device.is_autodiff() { t.autodiff() } else { t };
            return Ok(Param::initialized(param_id(name), t.to_device(device).reshape(dims)).set_require_grad(true));
        }
        let data = self.shards.remove(name).ok_or_else(|| ShardError::Missing(name.into()))?;
        if data.shape().len() != D {
            return Err(ShardError::Shape { name: name.into(), got: data.shape().to_vec(), expected: vec![0; D] });
        }
        Ok(Param::initialized(param_id(name), crate::traffic::upload(data, device, crate::traffic::Kind::State)).set_require_grad(true))
    }

    /// Looks at a shard in host data without taking it (`None` for one that lies on a device).
    pub fn peek(&self, name: &str) -> Option<&TensorData> {
        self.shards.get(name)
    }

    /// Names not yet taken (a correct build takes all).
    pub fn remaining(&self) -> Vec<String> {
        let mut v: Vec<String> = self.shards.keys().chain(self.tensors.keys()).cloned().collect();
        v.sort();
        v
    }
}

/// The local shard of a full tensor for tp index `tp_rank`: the concatenation of its intervals
/// along the split dim (replicated parameters are returned whole).
pub fn shard_of(spec: &ParamSpec, full: &TensorData, tp: usize, tp_rank: usize) -> Result<TensorData, ShardError> {
    if full.shape().to_vec() != spec.shape {
        return Err(ShardError::Shape { name: spec.name.clone(), got: full.shape().to_vec(), expected: spec.shape.clone() });
    }
    let values = full.try_to_vec::<f32>().map_err(|e| ShardError::Layout(format!("{}: {e:?}", spec.name)))?;
    let (shape, out) = shard_values(spec, &values, tp, tp_rank)?;
    Ok(TensorData::new(out, shape))
}

/// The local shape and values of tp index `tp_rank`'s shard of `values` (the full tensor of
/// `spec`, row-major).
pub fn shard_values(spec: &ParamSpec, values: &[f32], tp: usize, tp_rank: usize) -> Result<(Vec<usize>, Vec<f32>), ShardError> {
    if values.len() != spec.numel() {
        return Err(ShardError::Shape { name: spec.name.clone(), got: vec![values.len()], expected: spec.shape.clone() });
    }
    if matches!(spec.tp, TpSplit::Replicated) || tp == 1 {
        return Ok((spec.shape.clone(), values.to_vec()));
    }
    let (dim, intervals) = shard_intervals(spec, tp, tp_rank).map_err(|e| ShardError::Layout(e.to_string()))?;
    let mut out = Vec::with_capacity(values.len() / tp);
    let mut shape = spec.shape.clone();
    shape[dim] = intervals.iter().map(|r| r.len()).sum();
    // For each index of the dims before the split dim, the shard's intervals in order.
    let outer: usize = spec.shape[..dim].iter().product();
    let inner: usize = spec.shape[dim + 1..].iter().product();
    for o in 0..outer {
        for r in &intervals {
            let base = o * spec.shape[dim] * inner;
            out.extend_from_slice(&values[base + r.start * inner..base + r.end * inner]);
        }
    }
    Ok((shape, out))
}

/// Reassembles a full tensor from the shards of tp indices `0..tp`, in order.
pub fn unshard(spec: &ParamSpec, shards: &[Vec<f32>], tp: usize) -> Result<Vec<f32>, ShardError> {
    if matches!(spec.tp, TpSplit::Replicated) || tp == 1 {
        return Ok(shards[0].clone());
    }
    let mut full = vec![0f32; spec.numel()];
    let outer_shape = &spec.shape;
    for (t, shard) in shards.iter().enumerate() {
        let (dim, intervals) = shard_intervals(spec, tp, t).map_err(|e| ShardError::Layout(e.to_string()))?;
        let outer: usize = outer_shape[..dim].iter().product();
        let inner: usize = outer_shape[dim + 1..].iter().product();
        let mut src = 0;
        for o in 0..outer {
            for r in &intervals {
                let base = o * outer_shape[dim] * inner;
                let n = r.len() * inner;
                full[base + r.start * inner..base + r.start * inner + n].copy_from_slice(&shard[src..src + n]);
                src += n;
            }
        }
    }
    Ok(full)
}

/// The local shards a rank with `plan` holds, cut from full parameters.
pub fn shards_for(specs: &[ParamSpec], full: &FullParams, plan: &ShardPlan) -> Result<ShardSource, ShardError> {
    let num_layers = full_layers(specs);
    let mut shards = HashMap::new();
    for spec in specs {
        if !holds(spec, plan, num_layers) {
            continue;
        }
        let data = full.get(&spec.name).ok_or_else(|| ShardError::Missing(spec.name.clone()))?;
        shards.insert(spec.name.clone(), shard_of(spec, data, plan.dims.tp, plan.tp_rank)?);
    }
    Ok(ShardSource::new(shards))
}

fn full_layers(specs: &[ParamSpec]) -> usize {
    specs
        .iter()
        .filter_map(|s| match s.placement {
            copus_core::model::Placement::Layer(i) => Some(i + 1),
            _ => None,
        })
        .max()
        .unwrap_or(0)
}

/// Whether a rank with `plan` holds (a shard of) `spec`.
pub fn holds(spec: &ParamSpec, plan: &ShardPlan, num_layers: usize) -> bool {
    match (Placer { num_layers }).stages(spec, plan.dims.pp) {
        Ok(stages) => stages.contains(&plan.stage),
        Err(_) => false,
    }
}

/// Every float parameter of a module with its path, id, shape and its values as a flat tensor
/// (the parameter's own buffer, without autodiff, when it is stored contiguously).
pub fn flat_params<M: Module>(module: &M) -> Vec<(String, ParamId, Vec<usize>, Tensor<1>)> {
    struct V {
        path: Vec<String>,
        out: Vec<(String, ParamId, Vec<usize>, Tensor<1>)>,
    }
    impl ModuleVisitor for V {
        fn enter_module(&mut self, name: &str, _: &str) {
            self.path.push(name.to_string());
        }
        fn exit_module(&mut self, _: &str, _: &str) {
            self.path.pop();
        }
        fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<D>>) {
            let t = p.val().inner();
            let shape = t.dims().to_vec();
            let n: usize = shape.iter().product();
            self.out.push((self.path.join("."), p.id, shape, t.reshape([n])));
        }
    }
    let mut v = V { path: Vec::new(), out: Vec::new() };
    module.visit(&mut v);
    v.out
}

/// Every float parameter of a module with its path, id, shape and host values (the reads
/// counted as state traffic).
pub fn named_params<M: Module>(module: &M) -> Vec<(String, ParamId, Vec<usize>, Vec<f32>)> {
    named_params_as(module, crate::traffic::Kind::State)
}

/// [`named_params`], the reads counted as `kind`.
pub fn named_params_as<M: Module>(module: &M, kind: crate::traffic::Kind) -> Vec<(String, ParamId, Vec<usize>, Vec<f32>)> {
    flat_params(module)
        .into_iter()
        .map(|(path, id, shape, t)| (path, id, shape, crate::traffic::read(t, kind).try_to_vec::<f32>().expect("f32 parameter")))
        .collect()
}

/// Every float parameter of a module with its path, id and shape (no data copied).
pub fn param_paths<M: Module>(module: &M) -> Vec<(String, ParamId, Vec<usize>)> {
    flat_params(module).into_iter().map(|(p, id, shape, _)| (p, id, shape)).collect()
}

/// Vocabulary-parallel embedding lookup: rows `vocab_start..vocab_start + rows` of the table are
/// local; tokens outside give zeros, so the sum over the tp group is the full embedding.
pub fn vocab_parallel_embedding(weight_vd: Tensor<2>, tokens_bs: Tensor<2, Int>, vocab_start: usize) -> Tensor<3> {
    let [rows, d] = weight_vd.dims();
    let [b, s] = tokens_bs.dims();
    let local = tokens_bs.sub_scalar(vocab_start as i64);
    let inside = local.clone().greater_equal_elem(0).bool_and(local.clone().lower_elem(rows as i64));
    let idx = local.mask_fill(inside.clone().bool_not(), 0);
    let rows_nd = weight_vd.select(0, idx.reshape([b * s]));
    let keep = inside.float().reshape([b * s, 1]);
    (rows_nd * keep).reshape([b, s, d])
}

/// The global name of a stage-local path whose layer index is local: `layers.{j}.rest` becomes
/// `layers.{first_layer + j}.rest`; other names pass through.
pub fn globalise_layer_path(local: &str, first_layer: usize) -> String {
    if let Some(rest) = local.strip_prefix("layers.")
        && let Some((j, tail)) = rest.split_once('.')
        && let Ok(j) = j.parse::<usize>()
    {
        return format!("layers.{}.{tail}", first_layer + j);
    }
    local.to_string()
}
