//! One rank's state: its process groups, its stage of the model, its optimizer and probe; how it
//! is built from its shards (and resumed), and what it hands back for staging.

use std::collections::HashMap;
use std::sync::Arc;

use burn::module::{Module, ModuleVisitor, Param, ParamId};
use burn::optim::GradientsParams;
use burn::tensor::{Device, Tensor, TensorData};
use copus_core::layout::{Axis, RankGrid};
use copus_core::memory::Precision;
use copus_core::model::{ParamSpec, Placement, TpSplit};
use thiserror::Error;

use super::config::EngineConfig;
use super::error::{EngineError, ReconfigPhase};
use super::fault::Fault;
use super::grad_index::{GradIndex, ParamInfo, Role};
use super::messages::RankParams;
use super::zero::ZeroPlan;
use crate::closing::StepCloser;
use crate::comm::threads::ThreadComm;
use crate::comm::{Collective, CommError};
use crate::grads::with_values;
use crate::optim::{self as adamw, AdamW, Moments};
use crate::parallel::{ParallelLm, ParallelPlan, ShardError, ShardPlan, ShardSource, StageModel};
use crate::state::{OptimScalars, OptimTensors, RankExport, RankResume, ShardValues, TrainingState, checksum};
use crate::traffic::{self, Kind};
use crate::trainer::TrainError;

/// Why a rank could not do what it was asked.
#[derive(Debug, Error)]
pub(super) enum RankError {
    #[error(transparent)]
    Comm(#[from] CommError),
    #[error(transparent)]
    Train(#[from] TrainError),
    #[error("gradient noise scale: {0}")]
    Gns(#[from] copus_core::gns::GnsError),
}

/// What a rank starts from.
pub(super) struct RankInit {
    pub(super) plan: ShardPlan,
    pub(super) source: ShardSource,
    pub(super) resume: RankResume,
    pub(super) fault: Fault,
    /// The rank's autodiff device.
    pub(super) device: Device,
    /// Model width (activations crossing regions are `[B_m, seq, hidden]`).
    pub(super) hidden: usize,
    /// The model's parallel plan.
    pub(super) parallel: Arc<ParallelPlan>,
}

/// One rank between steps.
pub(super) struct RankState<L: ParallelLm, C: Collective = ThreadComm> {
    pub(super) rank: usize,
    pub(super) world: C,
    pub(super) tp: C,
    pub(super) dp: C,
    pub(super) pp: C,
    /// tp x pp ranks of this dp replica.
    pub(super) mp: C,
    pub(super) plan: ShardPlan,
    pub(super) dp_rank: usize,
    pub(super) stage: Option<L::Stage>,
    pub(super) index: GradIndex,
    names: HashMap<ParamId, String>,
    pub(super) optim: AdamW,
    pub(super) cfg: EngineConfig,
    pub(super) closer: StepCloser,
    pub(super) step: u64,
    pub(super) tokens_seen: u64,
    pub(super) device: Device,
    pub(super) d_model: usize,
    pub(super) vocab_start: usize,
    pub(super) vocab_local: usize,
    /// The model's parallel plan (a layout change builds the next stage with it).
    pub(super) parallel: Arc<ParallelPlan>,
    /// With ZeRO-1 over dp > 1: how this rank's optimizer state is sharded.
    pub(super) zero: Option<ZeroPlan>,
    /// The stage's context ([`StageModel::context`]) and the sequence length and precision it
    /// was built for, kept from one step (or evaluation) to the next: it depends on neither the
    /// weights nor the step, and building it may upload tables (a Llama's rotary tables), which
    /// a steady step should not.
    ctx: Option<(CtxKey, <L::Stage as StageModel>::Ctx)>,
}

/// What a stage's context is built for: a sequence length and a precision.
type CtxKey = (usize, Precision);

impl<L: ParallelLm, C: Collective> RankState<L, C> {
    /// Builds this rank: process groups, the stage from its shards, the optimizer and the rest
    /// of the training state; returns checksums of what it loaded.
    pub(super) fn start(
        rank: usize,
        world: C,
        init: RankInit,
        model: &L,
        specs: Vec<ParamSpec>,
        cfg: EngineConfig,
    ) -> Result<(Self, Vec<(String, u64)>), EngineError> {
        let RankInit { plan, mut source, resume, fault, device, hidden, parallel } = init;
        let grid = RankGrid::new(cfg.dims);
        let comm_err = |e: CommError| EngineError::Rank { rank, message: e.to_string() };
        if fault.hits(ReconfigPhase::GroupRebuild) {
            return Err(EngineError::Rank { rank, message: "injected failure while building process groups".into() });
        }
        let groups = Groups::split(world, &grid).map_err(comm_err)?;
        if fault.hits(ReconfigPhase::Load) {
            return Err(EngineError::Rank { rank, message: "injected failure while loading shards".into() });
        }
        let mut state = Self::build(rank, groups, plan, &mut source, resume, model, &specs, &parallel, hidden, cfg, device)?;
        let hashes = state.checksums()?;
        state.shard_optimizer()?;
        Ok((state, hashes))
    }

    /// Builds this rank's stage from its shards in `source` with process groups `groups`, then
    /// restores `resume`. The optimizer's moments stay whole until
    /// [`Self::shard_optimizer`] (ZeRO-1).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn build(
        rank: usize,
        groups: Groups<C>,
        plan: ShardPlan,
        source: &mut ShardSource,
        resume: RankResume,
        model: &L,
        specs: &[ParamSpec],
        parallel: &Arc<ParallelPlan>,
        hidden: usize,
        cfg: EngineConfig,
        device: Device,
    ) -> Result<Self, EngineError> {
        let stage = model.build_stage(&plan, source, &device)?;
        let left = source.remaining();
        if !left.is_empty() {
            return Err(EngineError::Shard(ShardError::Layout(format!("the model's stage builder did not take {left:?}"))));
        }
        let dims = cfg.dims;
        let grid = RankGrid::new(dims);
        let dp_rank = grid.coord(rank).map_err(|e| EngineError::Layout { dims: dims.to_string(), reason: e.to_string() })?.dp;
        let by_name: HashMap<&str, &ParamSpec> = specs.iter().map(|s| (s.name.as_str(), s)).collect();
        let mut params = Vec::new();
        let mut names = HashMap::new();
        let mut vocab = None;
        for (local, id, shape) in crate::parallel::param_paths(&stage) {
            let name = stage.global_name(&local);
            let spec = by_name
                .get(name.as_str())
                .ok_or_else(|| EngineError::Shard(ShardError::Missing(format!("spec for stage parameter `{name}`"))))?;
            let role = if parallel.tp_replicated.contains(&name) { Role::TpReplicated } else { Role::Sharded };
            let tied = matches!(spec.placement, Placement::FirstAndLast) && dims.pp > 1;
            params.push(ParamInfo { id, role, mirror: tied && plan.is_last(), tied_owner: tied && plan.is_first() });
            if parallel.is_vocabulary(&name) {
                // This rank's vocabulary slice: the local extent of the split dim.
                let rows = match spec.tp {
                    TpSplit::Split { dim, .. } => shape[dim],
                    TpSplit::Replicated => shape[0],
                };
                vocab = Some(rows);
            }
            names.insert(id, name);
        }
        let vocab_local = vocab.unwrap_or(0);
        let optim = cfg.optim.adamw(&stage.no_decay_predicates());
        let gns = cfg.optim.gns_estimator().map_err(|e| EngineError::Train(TrainError::Gns(e)))?;
        let closer = StepCloser::with_estimator(gns);
        let Groups { world, tp, dp, pp, mp } = groups;
        let mut state = Self {
            rank,
            world,
            tp,
            dp,
            pp,
            mp,
            dp_rank,
            index: GradIndex::new(params, device.clone()),
            vocab_start: plan.tp_rank * vocab_local,
            plan,
            stage: Some(stage),
            names,
            optim,
            cfg,
            closer,
            step: 0,
            tokens_seen: 0,
            device,
            d_model: hidden,
            vocab_local,
            parallel: parallel.clone(),
            zero: None,
            ctx: None,
        };
        state.resume(resume)?;
        Ok(state)
    }

    /// With ZeRO-1 over dp > 1: plans the shards and keeps this rank's pieces of the moments.
    pub(super) fn shard_optimizer(&mut self) -> Result<(), EngineError> {
        let dp = self.cfg.dims.dp;
        if !self.cfg.zero1 || dp == 1 {
            return Ok(());
        }
        let plan = ZeroPlan::new(self.stage(), &self.index, self.plan.tp_rank, dp, self.dp_rank);
        let device = self.device.clone().inner();
        let on_device = self.device_resident();
        plan.shard(&mut self.optim, &device, on_device)
            .map_err(|message| EngineError::Rank { rank: self.rank, message: format!("optimizer state: {message}") })?;
        self.zero = Some(plan);
        Ok(())
    }

    /// Every parameter's whole moments: this rank's own, or with ZeRO-1 all-gathered over dp
    /// (a collective: every rank of the dp group calls it).
    pub(super) fn whole_moments(&self) -> Result<Vec<(ParamId, Moments)>, CommError> {
        match &self.zero {
            Some(z) => {
                let on_device = self.device_resident() && self.dp.scatters_tensors_in_place();
                z.gather(&self.optim, &self.dp, &self.device.clone().inner(), on_device)
            }
            None => Ok(self.optim.ids().map(|id| (id, self.optim.moments(id).expect("listed").clone())).collect()),
        }
    }

    /// Restores optimizer state, counters, the estimator and the previous gradient.
    fn resume(&mut self, r: RankResume) -> Result<(), EngineError> {
        self.step = r.step;
        self.tokens_seen = r.tokens_seen;
        if let Some(g) = r.gns {
            self.closer.set_gns(g);
        }
        let ids: HashMap<String, ParamId> = self.names.iter().map(|(id, n)| (n.clone(), *id)).collect();
        let id_of = |name: &str| {
            ids.get(name)
                .copied()
                .ok_or_else(|| EngineError::Shard(ShardError::Missing(format!("optimizer state for `{name}` has no parameter here"))))
        };
        if !r.optim.is_empty() || !r.scalars.is_empty() {
            let fail = |message: String| EngineError::Rank { rank: self.rank, message: format!("optimizer state: {message}") };
            // name -> (shape, first moment, second moment, updates taken)
            type Parts = (Vec<usize>, Option<ShardValues>, Option<ShardValues>, Option<usize>);
            let mut parts: HashMap<String, Parts> = HashMap::new();
            for (name, field, shape, values) in r.optim {
                let entry = parts.entry(name.clone()).or_insert_with(|| (shape.clone(), None, None, None));
                let slot = match field.as_str() {
                    adamw::MOMENT_1 => &mut entry.1,
                    adamw::MOMENT_2 => &mut entry.2,
                    other => {
                        return Err(fail(format!(
                            "`{name}` has a field `{other}`; AdamW keeps `{}` and `{}`",
                            adamw::MOMENT_1,
                            adamw::MOMENT_2
                        )));
                    }
                };
                if entry.0 != shape || slot.replace(values).is_some() {
                    return Err(fail(format!("`{name}` has `{field}` twice, or moments of two shapes")));
                }
            }
            for (name, field, v) in r.scalars {
                if field == adamw::TIME {
                    let time = usize::try_from(v).map_err(|_| fail(format!("`{name}`'s `{field}` is not a step count: {v:?}")))?;
                    parts.entry(name).or_insert_with(|| (Vec::new(), None, None, None)).3 = Some(time);
                }
            }
            let device = self.device.clone().inner();
            let tensor = |v: ShardValues| match v {
                ShardValues::Host(v) => {
                    let n = v.len();
                    traffic::upload::<1, _>(TensorData::new(v, [n]), &device, Kind::State)
                }
                ShardValues::Device(t) => t.to_device(&device),
            };
            for (name, (shape, m1, m2, time)) in parts {
                let id = id_of(&name)?;
                let (Some(m1), Some(m2), Some(time)) = (m1, m2, time) else {
                    return Err(fail(format!("`{name}` lacks a moment or its step count")));
                };
                let moments = Moments::from_tensors(time, shape, tensor(m1), tensor(m2)).map_err(|e| fail(format!("`{name}`: {e}")))?;
                self.optim.set_moments(id, moments);
            }
        }
        if let Some(prev) = r.previous {
            let mut g = GradientsParams::new();
            for (name, values) in prev {
                let id = id_of(&name)?;
                self.register_named(&mut g, id, values);
            }
            self.closer.memory_mut().set(Some(g));
        }
        Ok(())
    }

    fn register_named(&self, g: &mut GradientsParams, id: ParamId, values: ShardValues) {
        struct V<'a> {
            g: &'a mut GradientsParams,
            id: ParamId,
            values: Option<ShardValues>,
            device: Device,
        }
        impl ModuleVisitor for V<'_> {
            fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<D>>) {
                if p.id == self.id
                    && let Some(v) = self.values.take()
                {
                    let t = match v {
                        ShardValues::Host(v) => traffic::upload(TensorData::new(v, p.val().shape()), &self.device, Kind::State),
                        ShardValues::Device(t) => t.to_device(&self.device).reshape(p.val().shape()),
                    };
                    self.g.register::<D>(p.id, t);
                }
            }
        }
        let device = self.device.clone().inner();
        self.stage().visit(&mut V { g, id, values: Some(values), device });
    }

    /// Optimizer state as (global name, field, shape, values) tensors and (name, field, value)
    /// scalars.
    pub(super) fn optim_entries(&self) -> Result<(OptimTensors, OptimScalars), RankError> {
        let mut tensors = Vec::new();
        let mut scalars = Vec::new();
        for (id, m) in &self.whole_moments()? {
            let name = self
                .names
                .get(id)
                .ok_or_else(|| RankError::Train(TrainError::Batch(format!("optimizer state for an unknown parameter {id}"))))?;
            for (field, t) in [(adamw::MOMENT_1, &m.m1), (adamw::MOMENT_2, &m.m2)] {
                tensors.push((name.clone(), field.to_string(), m.shape.clone(), with_values(t, Kind::State, <[f32]>::to_vec)));
            }
            for (field, v) in m.scalars() {
                scalars.push((name.clone(), field.to_string(), v));
            }
        }
        Ok((tensors, scalars))
    }

    /// Checksums of the loaded parameters and optimizer tensors, keyed `name` and
    /// `name#field`.
    fn checksums(&self) -> Result<Vec<(String, u64)>, EngineError> {
        let mut out = self.param_sums();
        for id in self.optim.ids() {
            let name = self
                .names
                .get(&id)
                .ok_or_else(|| EngineError::Rank { rank: self.rank, message: "optimizer state for an unknown parameter".into() })?;
            let m = self.optim.moments(id).expect("listed");
            for (field, t) in [(adamw::MOMENT_1, &m.m1), (adamw::MOMENT_2, &m.m2)] {
                out.push((format!("{name}#{field}"), with_values(t, Kind::State, checksum)));
            }
        }
        Ok(out)
    }

    /// Checksums of this rank's parameters by global name, read where they lie.
    pub(super) fn param_sums(&self) -> Vec<(String, u64)> {
        self.named_weights().into_iter().map(|(name, t)| (name, with_values(&t, Kind::State, checksum))).collect()
    }

    /// This rank's parameters by global name, flat, as they lie.
    pub(super) fn named_weights(&self) -> Vec<(String, Tensor<1>)> {
        crate::parallel::flat_params(self.stage()).into_iter().map(|(path, _, _, t)| (self.stage().global_name(&path), t)).collect()
    }

    /// This rank's state as flat tensors, read where it lies (see [`FlatState`]).
    pub(super) fn flat_state(&self) -> Result<FlatState, String> {
        let moments: HashMap<ParamId, Moments> = self.whole_moments().map_err(|e| e.to_string())?.into_iter().collect();
        let stepped = !moments.is_empty();
        let previous = self.closer.memory().get();
        let mut out = HashMap::new();
        let mut scalars = Vec::new();
        let prev = previous.map(|g| flat_grads(self.stage(), g));
        for (i, (path, id, shape, w)) in crate::parallel::flat_params(self.stage()).into_iter().enumerate() {
            let name = self.stage().global_name(&path);
            let mut kinds = vec![w];
            if stepped {
                let m = moments.get(&id).ok_or_else(|| format!("`{name}` has no optimizer moments"))?;
                kinds.push(m.m1.clone());
                kinds.push(m.m2.clone());
                for (field, v) in m.scalars() {
                    scalars.push((name.clone(), field.to_string(), v));
                }
            }
            if let Some(prev) = &prev {
                let (pid, g) = &prev[i];
                debug_assert_eq!(*pid, id);
                kinds.push(g.clone());
            }
            out.insert(name, (shape, kinds));
        }
        Ok(FlatState { shards: out, scalars, stepped, has_previous: prev.is_some() })
    }

    /// This rank's state for staging (data only from dp replica 0, but for a sharded
    /// optimizer's pieces, which every replica hands back).
    pub(super) fn export(&self) -> Result<RankExport, RankError> {
        let mut out = RankExport {
            params: Vec::new(),
            optim: Vec::new(),
            optim_offsets: None,
            scalars: Vec::new(),
            previous: None,
            step: self.step,
            tokens_seen: self.tokens_seen,
            gns: self.closer.gns().clone(),
        };
        // With ZeRO-1 every dp rank hands back its pieces of the moments (no collective: a
        // world that can no longer communicate still stages its state).
        if let Some(z) = &self.zero {
            let (optim, offsets, scalars) = z.pieces_for_export(&self.optim, &self.names);
            (out.optim, out.optim_offsets, out.scalars) = (optim, Some(offsets), scalars);
        }
        if self.dp_rank == 0 {
            out.params = self.params_as(Kind::State).into_iter().map(|(n, _, v)| (n, v)).collect();
            if self.zero.is_none() {
                let (tensors, scalars) = self.optim_entries()?;
                out.optim = tensors.into_iter().map(|(n, f, _, v)| (n, f, v)).collect();
                out.scalars = scalars;
            }
            if let Some(prev) = self.closer.memory().get() {
                let v =
                    self.index.per_param(self.stage(), prev).into_iter().map(|(id, values)| (self.names[&id].clone(), values)).collect();
                out.previous = Some(v);
            }
        }
        Ok(out)
    }

    pub(super) fn stage(&self) -> &L::Stage {
        self.stage.as_ref().expect("stage present between steps")
    }

    /// The stage's context for sequences of `seq_len` in the configured precision: the one kept
    /// from before where it was built for the same, otherwise a new one (its uploads counted as
    /// [`Kind::Constants`]). Hand it back with [`keep_context`](Self::keep_context) when done.
    pub(super) fn take_context(&mut self, seq_len: usize) -> (CtxKey, <L::Stage as StageModel>::Ctx) {
        let key = (seq_len, self.cfg.precision);
        match self.ctx.take() {
            Some((k, ctx)) if k == key => (key, ctx),
            _ => (key, traffic::counted_as(Kind::Constants, || self.stage().context(seq_len, key.1))),
        }
    }

    /// Keeps a context from [`take_context`](Self::take_context) for the next step.
    pub(super) fn keep_context(&mut self, ctx: (CtxKey, <L::Stage as StageModel>::Ctx)) {
        self.ctx = Some(ctx);
    }

    /// This rank's parameters by global name (read for an evaluation or a report).
    pub(super) fn params(&self) -> RankParams {
        self.params_as(Kind::Evaluation)
    }

    /// This rank's parameters by global name, the reads counted as `kind`.
    fn params_as(&self, kind: Kind) -> RankParams {
        crate::parallel::named_params_as(self.stage(), kind)
            .into_iter()
            .map(|(path, _, shape, values)| (self.stage().global_name(&path), shape, values))
            .collect()
    }

    /// A new B_g and B_m for the next steps.
    pub(super) fn set_batch(&mut self, global_batch: usize, micro_batch: usize) {
        self.cfg.global_batch = global_batch;
        self.cfg.micro_batch = micro_batch;
    }
}

/// Every parameter of a rank by global name: its shape, then as flat tensors (no values copied
/// where they are stored contiguously) its weights, its two AdamW moments when the optimizer
/// has stepped, and the previous gradient when the probe keeps one (zeros for a parameter it
/// has none of).
pub(super) struct FlatState {
    pub(super) shards: HashMap<String, (Vec<usize>, Vec<Tensor<1>>)>,
    /// The optimizer's scalars of every parameter.
    pub(super) scalars: OptimScalars,
    /// Whether the optimizer has moments (it has stepped).
    pub(super) stepped: bool,
    pub(super) has_previous: bool,
}

/// Every parameter's gradient in `g` as a flat tensor, in stage visit order (zeros where it has
/// none).
fn flat_grads<S: Module>(stage: &S, g: &GradientsParams) -> Vec<(ParamId, Tensor<1>)> {
    struct V<'a> {
        g: &'a GradientsParams,
        out: Vec<(ParamId, Tensor<1>)>,
    }
    impl ModuleVisitor for V<'_> {
        fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<D>>) {
            let n = p.val().shape().num_elements();
            let t = match self.g.get::<D>(p.id) {
                Some(t) => t.reshape([n]),
                None => Tensor::zeros([n], &p.val().inner().device()),
            };
            self.out.push((p.id, t));
        }
    }
    let mut v = V { g, out: Vec::new() };
    stage.visit(&mut v);
    v.out
}

/// A rank's process groups.
pub(super) struct Groups<C> {
    world: C,
    tp: C,
    dp: C,
    pp: C,
    mp: C,
}

impl<C: Collective> Groups<C> {
    /// The tp, dp, pp and model-parallel groups of `grid`'s layout, split from `world` (a
    /// collective call: every rank of `world` makes it).
    pub(super) fn split(world: C, grid: &RankGrid) -> Result<Self, CommError> {
        let dims = grid.dims();
        let split = |axis: Axis| world.split(&grid.groups(axis));
        let tp = split(Axis::Tp)?;
        let dp = split(Axis::Dp)?;
        let pp = split(Axis::Pp)?;
        let mp_groups: Vec<Vec<usize>> =
            (0..dims.dp).map(|d| (0..dims.world_size()).filter(|&r| grid.coord(r).map(|c| c.dp) == Ok(d)).collect()).collect();
        let mp = world.split(&mp_groups)?;
        Ok(Self { world, tp, dp, pp, mp })
    }
}

/// What world rank `r` of `cfg` starts from, and the checksums it must report.
pub(super) fn rank_init<L: ParallelLm>(
    model: &L,
    specs: &[ParamSpec],
    state: &TrainingState,
    cfg: &EngineConfig,
    parallel: &Arc<crate::parallel::ParallelPlan>,
    r: usize,
    fault: Fault,
) -> Result<(RankInit, Vec<(String, u64)>), EngineError> {
    let spec = model.spec();
    let dims = cfg.dims;
    let c = RankGrid::new(dims).coord(r).map_err(|e| EngineError::Layout { dims: dims.to_string(), reason: e.to_string() })?;
    let plan = ShardPlan::new(dims, c.tp, c.pp, spec.num_layers);
    let (source, resume, hashes) = state.rank_init(specs, &plan)?;
    let device = cfg.devices.get(r).copied().unwrap_or_default();
    // Under mpirun a GPU rank takes its node's GPU; this process only builds its own rank's.
    #[cfg(feature = "mpi")]
    let device = crate::comm::mpi::on_this_node(device, cfg.ranks_per_device);
    let device = device.device_for(cfg.precision)?.autodiff();
    Ok((RankInit { plan, source, resume, fault, device, hidden: spec.hidden, parallel: parallel.clone() }, hashes))
}

pub(super) fn panic_message(p: &Box<dyn std::any::Any + Send>) -> String {
    if let Some(s) = p.downcast_ref::<&str>() {
        format!("panicked: {s}")
    } else if let Some(s) = p.downcast_ref::<String>() {
        format!("panicked: {s}")
    } else {
        "panicked".into()
    }
}
