//! One micro-batch's forward and backward pass through this rank's stage.
//!
//! On a device (every rank of the job on one), a stage is one autodiff graph from its input
//! (the tokens, or the activation received from the previous stage) to its output (the loss,
//! or the activation sent on); only the pipeline's boundaries and the loss's scalar leave the
//! device. Under tensor parallelism the graph has Megatron's conjugate operators at the
//! blocks' edges ([`super::tp_graph`]): the sums of the forward pass (g) and of the backward
//! pass (f) run inside it, on the tp group's tensor all-reduce (in-process or NCCL/RCCL/MPI
//! across processes), and the vocabulary-parallel loss seeds it with its gradient. Under
//! activation checkpointing the forward runs without a graph and keeps the residual stream at
//! each segment's start; the backward pass runs each segment again as a graph of its own (with
//! the same operators), last first.
//!
//! In host memory (Flex), without tensor parallelism or checkpointing, the stage is one graph
//! too. Otherwise it runs as regions: the embedding, one region per residual branch and the
//! head, each a sub-graph whose input is a detached leaf; between regions the partial outputs
//! (forward) and partial input gradients (backward) are summed over the tp group in host
//! buffers, and the vocabulary-parallel cross entropy runs on them with the fused passes.

use burn::optim::GradientsParams;
use burn::tensor::{Int, Tensor, TensorData};

use super::config::Checkpointing;
use super::rank::{RankError, RankState};
use super::tp_graph::{Group, copy_to_group, reduce_from_group};
use crate::comm::placement::RankDevice;
use crate::comm::{Collective, CommError, ReduceOp};
use crate::fused;
use crate::grads::{self, Scalar};
use crate::parallel::{ParallelLm, StageModel};
use crate::traffic::{self, Kind};

/// What a micro-batch leaves on a stage between its forward and backward.
#[derive(Default)]
pub(super) struct InFlight {
    /// A forward pass with no backward pass after it (an evaluation): it records no graph.
    /// Burn keeps a recorded graph, activations and all, until the next backward pass.
    pub(super) evaluation: bool,
    pub(super) embed_out: Option<Tensor<3>>,
    pub(super) blocks: Vec<(Tensor<3>, Tensor<3>)>,
    pub(super) head: Option<(Tensor<3>, Tensor<3>, Boundary)>,
    pub(super) activation_in: Option<Boundary>,
    pub(super) activation_out: Option<Boundary>,
    pub(super) grad_in: Option<Boundary>,
    pub(super) grad_out: Option<Boundary>,
    /// A stage run as one graph: its input leaf (after the first stage) and its output, the
    /// loss on the last stage.
    pub(super) whole: Option<(Option<Tensor<3>>, Output)>,
    /// Under tensor parallelism, the group whose sums the graph's operators run (and where a
    /// sum that failed in the backward pass is kept).
    pub(super) group: Option<Group>,
    /// Under activation checkpointing on a device, the last stage's head as a graph from its
    /// input leaf.
    pub(super) last: Option<(Tensor<3>, Output)>,
    /// Under activation checkpointing: each segment of blocks `[start, end)` and the residual
    /// stream at its start (no graph), from which the backward pass recomputes the segment.
    pub(super) saved: Vec<(usize, usize, Boundary)>,
    /// This stage's tokens of the micro-batch (inputs on the first stage, targets on the
    /// last), views of the step's one upload ([`RankState::step_tokens`]); absent, the forward
    /// pass uploads the micro-batch's own.
    pub(super) tokens: Option<StageTokens>,
}

/// A stage's tokens of a micro-batch on its device: the inputs on the first stage, the targets
/// on the last, `[B_m, seq]` each.
pub(super) type StageTokens = (Option<Tensor<2, Int>>, Option<Tensor<2, Int>>);

/// An activation or its gradient at a pipeline stage boundary, or the residual stream kept at
/// a checkpoint: a host buffer (Flex's tensor-parallel regions sum them there), or a tensor
/// where it lies (a stage run as one graph, or as checkpointed segments).
// A few per micro-batch, moved rather than copied; boxing the tensor would only add allocations.
#[allow(clippy::large_enum_variant)]
pub(super) enum Boundary {
    Host(Vec<f32>),
    Device(Tensor<1>),
}

impl Boundary {
    /// Zeros of the same length, where these values lie.
    pub(super) fn zeros_like(&self) -> Self {
        match self {
            Self::Host(v) => Self::Host(vec![0.0; v.len()]),
            Self::Device(t) => Self::Device(t.zeros_like()),
        }
    }

    /// The values in host memory (read back if on a device).
    fn into_host(self) -> Vec<f32> {
        match self {
            Self::Host(v) => v,
            Self::Device(t) => traffic::read(t, Kind::Activations).iter::<f32>().collect(),
        }
    }
}

/// The output of a stage run as one graph.
// One per micro-batch, moved rather than copied; boxing the tensors would only add allocations.
#[allow(clippy::large_enum_variant)]
pub(super) enum Output {
    /// The last stage's loss share, `[1]`.
    Loss(Tensor<1>),
    /// The last stage's logits slice under tensor parallelism and the vocabulary-parallel
    /// loss's gradient with respect to it, the seed of the backward pass.
    Seeded(Tensor<3>, Tensor<3>),
    /// The residual stream handed to the next stage.
    Activation(Tensor<3>),
}

fn host(t: Tensor<3>) -> Vec<f32> {
    traffic::read(t, Kind::Activations).try_to_vec::<f32>().expect("f32 activations")
}

/// `t` as a graph's input leaf, whose gradient the backward pass reads; `t` as it is in an
/// evaluation, which has no backward pass (a tracked leaf would record the graph).
fn input_leaf(t: Tensor<3>, fl: &InFlight) -> Tensor<3> {
    if fl.evaluation { t } else { t.require_grad() }
}

/// Megatron's f over `group` where a replicated stream enters a split layer; the identity
/// without tensor parallelism.
fn enter(h: Tensor<3>, group: Option<&Group>) -> Result<Tensor<3>, CommError> {
    match group {
        Some(g) => copy_to_group(h, g),
        None => Ok(h),
    }
}

/// Megatron's g over `group` where a split layer's partial output joins the stream; the
/// identity without tensor parallelism.
fn join(y: Tensor<3>, group: Option<&Group>) -> Result<Tensor<3>, CommError> {
    match group {
        Some(g) => reduce_from_group(y, g),
        None => Ok(y),
    }
}

impl<L: ParallelLm, C: Collective> RankState<L, C> {
    /// Sequences in a micro-batch's rows (`seq + 1` ids each).
    fn rows_len(&self, rows: &[i64]) -> usize {
        rows.len() / (self.cfg.seq_len + 1)
    }

    /// Micro-batch `mb` of this rank's data-parallel share of `batch`: its `B_m` sequences of
    /// `seq + 1` ids each.
    pub(super) fn micro_rows<'b>(&self, batch: &'b [i64], mb: usize) -> &'b [i64] {
        let (bm, s) = (self.cfg.micro_batch, self.cfg.seq_len);
        let first_row = (self.dp_rank * self.cfg.num_micro_per_replica() + mb) * bm;
        &batch[first_row * (s + 1)..(first_row + bm) * (s + 1)]
    }

    fn tokens(&self, rows: &[i64], inputs: bool) -> Tensor<2, Int> {
        let (bm, s) = (self.rows_len(rows), self.cfg.seq_len);
        traffic::upload(TensorData::new(self.token_rows(rows, inputs), [bm, s]), &self.device, Kind::Batch)
    }

    /// This stage's tokens of a micro-batch on its device: the inputs on the first stage, the
    /// targets on the last. A stage that is both uploads the `seq + 1` ids of each sequence once
    /// and takes both as views.
    fn stage_tokens(&self, rows: &[i64]) -> StageTokens {
        let (first, last) = (self.plan.is_first(), self.plan.is_last());
        if !(first && last) {
            return (first.then(|| self.tokens(rows, true)), last.then(|| self.tokens(rows, false)));
        }
        let (bm, s) = (self.rows_len(rows), self.cfg.seq_len);
        let rows: Tensor<2, Int> = traffic::upload(TensorData::new(rows.to_vec(), [bm, s + 1]), &self.device, Kind::Batch);
        (Some(rows.clone().narrow(1, 0, s)), Some(rows.narrow(1, 1, s)))
    }

    /// This stage's tokens of each of the step's `micro` micro-batches of `batch`, uploaded in
    /// one copy for the whole step (the stage's ids of this rank's data-parallel share, the same
    /// bytes as one upload per micro-batch) and handed out as views of it: one transfer, and
    /// on a device one wait for it, instead of one per micro-batch. A stage that reads no tokens
    /// uploads nothing; where the forward pass reads its tokens otherwise (Flex's regions), each
    /// micro-batch gets `None`.
    pub(super) fn step_tokens(&self, batch: &[i64], micro: usize) -> Vec<Option<StageTokens>> {
        let (first, last) = (self.plan.is_first(), self.plan.is_last());
        if !(first || last) || micro == 0 || !self.runs_as_graphs() {
            return vec![None; micro];
        }
        let bm = self.cfg.micro_batch;
        let rows: Vec<i64> = (0..micro).flat_map(|mb| self.micro_rows(batch, mb).iter().copied()).collect();
        let (inputs, targets) = self.stage_tokens(&rows);
        let view = |t: &Option<Tensor<2, Int>>, mb: usize| t.as_ref().map(|t| t.clone().narrow(0, mb * bm, bm));
        (0..micro).map(|mb| Some((view(&inputs, mb), view(&targets, mb)))).collect()
    }

    /// A micro-batch's input (or target) tokens, row-major `[B_m, seq]`.
    fn token_rows(&self, rows: &[i64], inputs: bool) -> Vec<i64> {
        let s = self.cfg.seq_len;
        let mut v = Vec::with_capacity(self.rows_len(rows) * s);
        for seq in rows.chunks_exact(s + 1) {
            v.extend_from_slice(if inputs { &seq[..s] } else { &seq[1..] });
        }
        v
    }

    /// Whether every rank of the job trains on a device (none in host memory): then a step keeps
    /// its activations, sums and loss there. Decided for the whole job, not per rank, so the
    /// ranks of a group always take the same path through their collectives.
    pub(super) fn device_resident(&self) -> bool {
        !self.cfg.devices.is_empty() && self.cfg.devices.iter().all(|d| *d != RankDevice::Flex)
    }

    /// `[B_m, seq, d]`: the residual stream of one training micro-batch.
    fn residual_shape(&self) -> [usize; 3] {
        [self.cfg.micro_batch, self.cfg.seq_len, self.d_model]
    }

    /// The residual stream's shape for a micro-batch of these rows.
    fn shape_of(&self, rows: &[i64]) -> [usize; 3] {
        [self.rows_len(rows), self.cfg.seq_len, self.d_model]
    }

    fn constant(&self, v: Vec<f32>, shape: [usize; 3]) -> Tensor<3> {
        traffic::upload(TensorData::new(v, shape), &self.device, Kind::Activations)
    }

    /// Forward of one micro-batch (`rows`: its sequences of `seq + 1` ids) through this stage;
    /// returns the loss share on the last stage: the summed cross entropy times `scale` (one
    /// over the step's target tokens in training, 1 for an evaluation's sum), on a device still
    /// there, to be read with the step's other numbers.
    pub(super) fn forward(
        &self,
        rows: &[i64],
        scale: f64,
        fl: &mut InFlight,
        ctx: &<L::Stage as StageModel>::Ctx,
    ) -> Result<Scalar, RankError> {
        if self.device_resident() {
            let group = self.tp_group()?;
            return match self.cfg.checkpointing {
                Checkpointing::None => self.forward_whole(rows, scale, fl, ctx, group),
                _ => self.forward_segments(rows, scale, fl, ctx, group),
            };
        }
        if self.runs_as_graphs() {
            return self.forward_whole(rows, scale, fl, ctx, None);
        }
        let stage = self.stage();
        let shape = self.shape_of(rows);
        let mut h = if self.plan.is_first() {
            let out = stage.embed(self.tokens(rows, true));
            let mut v = host(out.clone());
            self.tp.all_reduce(&mut v, ReduceOp::Sum)?;
            fl.embed_out = Some(out);
            v
        } else {
            fl.activation_in.take().expect("activation received before forward").into_host()
        };
        let untracked = self.untracked();
        for i in 0..stage.num_blocks() {
            if let Some(end) = self.checkpoint_at(i) {
                fl.saved.push((i, end, Boundary::Host(h.clone())));
            }
            let (x, y) = match &untracked {
                Some(plain) => {
                    let x = self.constant(h.clone(), shape);
                    (x.clone(), plain.block(i, x, ctx))
                }
                None => {
                    let x = input_leaf(self.constant(h.clone(), shape), fl);
                    (x.clone(), stage.block(i, x, ctx))
                }
            };
            let mut yv = host(y.clone());
            self.tp.all_reduce(&mut yv, ReduceOp::Sum)?;
            for (a, b) in h.iter_mut().zip(&yv) {
                *a += b;
            }
            self.keep(fl, x, y);
        }
        if !self.plan.is_last() {
            fl.activation_out = Some(Boundary::Host(h));
            return Ok(Scalar::host(0.0));
        }
        let x = input_leaf(self.constant(h, shape), fl);
        let z = stage.logits(x.clone(), ctx);
        let (loss, dz) = self.vocab_parallel_cross_entropy(host(z.clone()), rows, scale)?;
        fl.head = Some((x, z, Boundary::Host(dz)));
        Ok(Scalar::host(loss))
    }

    /// Whether the forward pass runs the stage as graphs on its device (device-resident, or one
    /// graph in host memory without tensor parallelism or checkpointing), which take the step's
    /// one upload of tokens; otherwise Flex's regions upload each micro-batch's inputs and read
    /// its targets on the host.
    fn runs_as_graphs(&self) -> bool {
        self.device_resident() || (self.cfg.checkpointing == Checkpointing::None && self.cfg.dims.tp == 1)
    }

    /// Under checkpointing, the end of the segment that starts at block `i`, if one does.
    fn checkpoint_at(&self, i: usize) -> Option<usize> {
        let per = match self.cfg.checkpointing {
            Checkpointing::None => return None,
            Checkpointing::Layers => self.stage().blocks_per_layer().max(1),
            Checkpointing::Regions => 1,
        };
        i.is_multiple_of(per).then(|| (i + per).min(self.stage().num_blocks()))
    }

    /// Under checkpointing, the stage with its parameters untracked: its forward records no
    /// graph (one recorded and dropped would stay in the autodiff graph until the next backward
    /// pass, activations and all), and runs the same kernels as the tracked recomputation, so
    /// the values agree bit for bit.
    fn untracked(&self) -> Option<L::Stage> {
        (self.cfg.checkpointing != Checkpointing::None).then(|| self.plain_stage())
    }

    /// The stage with its parameters untracked (a copy of its handles).
    fn plain_stage(&self) -> L::Stage {
        burn::module::Module::no_grad(self.stage().clone())
    }

    /// Keeps a region's graph for the backward pass, unless checkpointing recomputes it (then
    /// the graph goes now, with its activations).
    fn keep(&self, fl: &mut InFlight, x: Tensor<3>, y: Tensor<3>) {
        if self.cfg.checkpointing == Checkpointing::None {
            fl.blocks.push((x, y));
        }
    }

    /// The next region in backward order: those the forward kept, last first; under
    /// checkpointing, the last saved segment recomputed from its checkpoint when those run out.
    /// The recomputation is the forward's own arithmetic (the same tensor-parallel sums between
    /// the segment's regions), so it gives the forward's values bit for bit.
    fn next_region(&self, fl: &mut InFlight, ctx: &<L::Stage as StageModel>::Ctx) -> Result<Option<(Tensor<3>, Tensor<3>)>, RankError> {
        if fl.blocks.is_empty()
            && let Some((start, end, h0)) = fl.saved.pop()
        {
            let stage = self.stage();
            let mut h = self.residual(h0, self.residual_shape());
            for i in start..end {
                let x = h.clone().require_grad();
                let y = stage.block(i, x.clone(), ctx);
                if i + 1 < end {
                    h = h + self.sum_over_tp(y.clone().detach())?;
                }
                fl.blocks.push((x, y));
            }
        }
        Ok(fl.blocks.pop())
    }

    /// The sum over the tp group of a residual-stream tensor, where it lies.
    fn sum_over_tp(&self, t: Tensor<3>) -> Result<Tensor<3>, RankError> {
        let shape = t.dims();
        Ok(self.tp.all_reduce_tensor(t.reshape([shape.iter().product::<usize>()]), ReduceOp::Sum)?.reshape(shape))
    }

    /// A boundary's values as a residual-stream tensor on this rank's device.
    fn residual(&self, b: Boundary, shape: [usize; 3]) -> Tensor<3> {
        match b {
            Boundary::Device(t) => t.reshape(shape),
            Boundary::Host(v) => self.constant(v, shape),
        }
    }

    /// [`Self::vocab_parallel_cross_entropy`] where the logits lie: the max, the sums of
    /// exponentials and the target logits combined over the tp group as tensors; the loss a
    /// scalar on the device.
    fn vocab_parallel_cross_entropy_on_device(
        &self,
        z: Tensor<3>,
        targets: Tensor<2, Int>,
        scale: f64,
    ) -> Result<(Scalar, Tensor<3>), RankError> {
        let [bm, s, v] = z.dims();
        let rows = bm * s;
        let device = z.device();
        // The target's index in this rank's slice, and whether it falls in the slice.
        let local = targets.sub_scalar(self.vocab_start as i64);
        let inside = local.clone().greater_equal_elem(0).bool_and(local.clone().lower_elem(v as i64)).unsqueeze_dim::<3>(2);
        let index = local.clamp(0, v as i64 - 1).unsqueeze_dim::<3>(2);
        let max = self.tp.all_reduce_tensor(z.clone().max_dim(2).reshape([rows]), ReduceOp::Max)?.reshape([bm, s, 1]);
        let exp = (z.clone() - max.clone()).exp();
        let picked = z.gather(2, index.clone()).mask_fill(inside.clone().bool_not(), 0.0);
        let both = Tensor::cat(vec![exp.clone().sum_dim(2).reshape([rows]), picked.reshape([rows])], 0);
        let both = self.tp.all_reduce_tensor(both, ReduceOp::Sum)?;
        let sum = both.clone().narrow(0, 0, rows).reshape([bm, s, 1]);
        let picked = both.narrow(0, rows, rows).reshape([bm, s, 1]);
        let loss = (sum.clone().log() + max - picked).sum();
        let loss = Scalar::new(0.0, vec![loss], scale);
        // d loss / d z = (softmax - onehot(target)) / tokens, the one-hot only where the target
        // is in this rank's slice.
        let classes = fused::index_range(v, &device).reshape([1, 1, v]).expand([bm, s, v]);
        let onehot = classes.equal(index.expand([bm, s, v])).bool_and(inside.expand([bm, s, v])).float();
        Ok((loss, (exp / sum - onehot).mul_scalar(scale)))
    }

    /// The tp group whose sums a device-resident stage's graphs run as Megatron's operators;
    /// `None` without tensor parallelism.
    fn tp_group(&self) -> Result<Option<Group>, RankError> {
        if self.cfg.dims.tp == 1 {
            return Ok(None);
        }
        let sum = self
            .tp
            .tensor_sum()
            .ok_or_else(|| CommError::Invalid("this communicator cannot run its tensor sums inside an autodiff graph".into()))?;
        Ok(Some(Group::new(sum)))
    }

    /// [`Self::forward`] as one graph: without tensor parallelism (`group` `None`), or with
    /// its sums as the graph's operators over `group` (g where a block's or the embedding's
    /// partial output joins the residual stream, f where the stream enters a block or the
    /// head; the loss vocabulary-parallel, its gradient kept as the backward pass's seed).
    fn forward_whole(
        &self,
        rows: &[i64],
        scale: f64,
        fl: &mut InFlight,
        ctx: &<L::Stage as StageModel>::Ctx,
        group: Option<Group>,
    ) -> Result<Scalar, RankError> {
        let stage = self.stage();
        let shape = self.shape_of(rows);
        let (inputs, targets) = fl.tokens.take().unwrap_or_else(|| self.stage_tokens(rows));
        let g = group.as_ref();
        let (input, mut h) = if let Some(inputs) = inputs {
            (None, join(stage.embed(inputs), g)?)
        } else {
            let x = input_leaf(self.residual(fl.activation_in.take().expect("activation received before forward"), shape), fl);
            (Some(x.clone()), x)
        };
        for i in 0..stage.num_blocks() {
            h = self.block(stage, i, h, ctx, g)?;
        }
        fl.group = group.clone();
        if !self.plan.is_last() {
            let n = h.shape().num_elements();
            fl.activation_out = Some(Boundary::Device(h.clone().detach().reshape([n])));
            fl.whole = Some((input, Output::Activation(h)));
            return Ok(Scalar::host(0.0));
        }
        let (value, out) = self.head(h, targets, scale, ctx, group.as_ref())?;
        fl.whole = Some((input, out));
        Ok(value)
    }

    /// Block `i` of `stage` on the residual stream `h` (the stream plus the block's output),
    /// under tensor parallelism with Megatron's operators at the block's edges.
    fn block(
        &self,
        stage: &L::Stage,
        i: usize,
        h: Tensor<3>,
        ctx: &<L::Stage as StageModel>::Ctx,
        group: Option<&Group>,
    ) -> Result<Tensor<3>, RankError> {
        let y = join(stage.block(i, enter(h.clone(), group)?, ctx), group)?;
        Ok(h + y)
    }

    /// The last stage's head on the residual stream `h` as a graph: the loss share and the
    /// graph's output (the loss, or under tensor parallelism the logits slice with the
    /// vocabulary-parallel loss's gradient as its seed).
    fn head(
        &self,
        h: Tensor<3>,
        targets: Option<Tensor<2, Int>>,
        scale: f64,
        ctx: &<L::Stage as StageModel>::Ctx,
        group: Option<&Group>,
    ) -> Result<(Scalar, Output), RankError> {
        let targets = targets.expect("the last stage has its targets");
        let z = self.stage().logits(enter(h, group)?, ctx);
        if group.is_some() {
            let (loss, dz) = self.vocab_parallel_cross_entropy_on_device(z.clone().detach(), targets, scale)?;
            return Ok((loss, Output::Seeded(z, dz)));
        }
        let loss = fused::cross_entropy_sum(z, targets).mul_scalar(scale);
        Ok((Scalar::new(0.0, vec![loss.clone()], 1.0), Output::Loss(loss)))
    }

    /// [`Self::backward`] of a stage run as one graph; under tensor parallelism, an error when a
    /// sum of the graph's backward pass failed.
    fn backward_whole(&self, input: Option<Tensor<3>>, out: Output, fl: &mut InFlight) -> Result<GradientsParams, RankError> {
        let group = fl.group.take();
        let seed = match &out {
            Output::Activation(h) => Some(self.residual(fl.grad_in.take().expect("gradient received before backward"), h.dims())),
            Output::Loss(_) | Output::Seeded(..) => None,
        };
        let (grads, dx) = self.backprop(out, seed, input.as_ref(), group.as_ref())?;
        if let Some(dx) = dx {
            let n = dx.shape().num_elements();
            fl.grad_out = Some(Boundary::Device(dx.reshape([n])));
        }
        Ok(grads)
    }

    /// The backward pass of one graph from `input` (a leaf, or none) to `out`, an activation
    /// seeded with `seed`: the stage's parameter gradients and `input`'s gradient (zeros where
    /// none reached it); an error when a sum of the pass over `group` failed.
    fn backprop(
        &self,
        out: Output,
        seed: Option<Tensor<3>>,
        input: Option<&Tensor<3>>,
        group: Option<&Group>,
    ) -> Result<(GradientsParams, Option<Tensor<3>>), RankError> {
        let grads = match out {
            Output::Loss(loss) => loss.backward(),
            Output::Seeded(z, dz) => (z * dz).sum().backward(),
            Output::Activation(h) => (h * seed.expect("an activation's graph is seeded")).sum().backward(),
        };
        if let Some(e) = group.and_then(Group::failure) {
            return Err(e.into());
        }
        let dx = input.map(|x| x.grad(&grads).unwrap_or_else(|| Tensor::zeros(x.dims(), &self.device)));
        Ok((GradientsParams::from_grads(grads, self.stage()), dx))
    }

    /// [`Self::forward`] on a device under activation checkpointing: the blocks run without a
    /// graph, the residual stream kept at the start of each segment (a layer, or a region),
    /// from which [`Self::backward_segments`] runs the segment again as a graph. The embedding
    /// and the head are graphs of their own. Under tensor parallelism every graph has
    /// Megatron's operators at its blocks' edges; the forward's sums and the recomputation's
    /// are the same group's (a library takes the inner tensors of both), the blocks the same
    /// kernels (tracked or not), so the recomputation gives the forward's values.
    fn forward_segments(
        &self,
        rows: &[i64],
        scale: f64,
        fl: &mut InFlight,
        ctx: &<L::Stage as StageModel>::Ctx,
        group: Option<Group>,
    ) -> Result<Scalar, RankError> {
        let stage = self.stage();
        let shape = self.shape_of(rows);
        let n = shape.iter().product::<usize>();
        let (inputs, targets) = fl.tokens.take().unwrap_or_else(|| self.stage_tokens(rows));
        let g = group.as_ref();
        let mut h = if let Some(inputs) = inputs {
            let e = join(stage.embed(inputs), g)?;
            let h = e.clone().detach();
            fl.embed_out = Some(e);
            h
        } else {
            self.residual(fl.activation_in.take().expect("activation received before forward"), shape)
        };
        let plain = self.plain_stage();
        for i in 0..stage.num_blocks() {
            if let Some(end) = self.checkpoint_at(i) {
                fl.saved.push((i, end, Boundary::Device(h.clone().reshape([n]))));
            }
            h = self.block(&plain, i, h, ctx, g)?;
        }
        fl.group = group.clone();
        if !self.plan.is_last() {
            fl.activation_out = Some(Boundary::Device(h.reshape([n])));
            return Ok(Scalar::host(0.0));
        }
        let x = input_leaf(h, fl);
        let (value, out) = self.head(x.clone(), targets, scale, ctx, g)?;
        fl.last = Some((x, out));
        Ok(value)
    }

    /// [`Self::backward`] of [`Self::forward_segments`]: the head's graph, then each segment's,
    /// last first, each seeded with the gradient of the stream at its end, then the
    /// embedding's (or the gradient handed to the previous stage).
    fn backward_segments(&self, fl: &mut InFlight, ctx: &<L::Stage as StageModel>::Ctx) -> Result<GradientsParams, RankError> {
        let stage = self.stage();
        let group = fl.group.take();
        let g = group.as_ref();
        let shape = self.residual_shape();
        let mut acc: Option<GradientsParams> = None;
        let mut add = |p: GradientsParams| acc = Some(grads::add(stage, acc.take(), p));
        let mut seed = match fl.last.take() {
            Some((x, out)) => {
                let (p, dx) = self.backprop(out, None, Some(&x), g)?;
                add(p);
                dx.expect("the head's input has a gradient")
            }
            None => self.residual(fl.grad_in.take().expect("gradient received before backward"), shape),
        };
        while let Some((start, end, h0)) = fl.saved.pop() {
            let x = self.residual(h0, shape).require_grad();
            let mut h = x.clone();
            for i in start..end {
                let y = stage.block(i, enter(h.clone(), g)?, ctx);
                // The segment's last sum (g) would change only the output's value, which
                // nothing reads; its backward passes the seed on as it is, so it is left out
                // (on every rank alike).
                h = h + if i + 1 < end { join(y, g)? } else { y };
            }
            let (p, dx) = self.backprop(Output::Activation(h), Some(seed), Some(&x), g)?;
            add(p);
            seed = dx.expect("a segment's input has a gradient");
        }
        if let Some(e) = fl.embed_out.take() {
            add(self.backprop(Output::Activation(e), Some(seed), None, g)?.0);
        } else {
            fl.grad_out = Some(Boundary::Device(seed.reshape([shape.iter().product::<usize>()])));
        }
        Ok(acc.unwrap_or_default())
    }

    /// Loss share of one micro-batch (its summed cross entropy times `scale`) and its gradient
    /// with respect to this rank's logits slice.
    fn vocab_parallel_cross_entropy(&self, z: Vec<f32>, micro: &[i64], scale: f64) -> Result<(f64, Vec<f32>), RankError> {
        let v = self.vocab_local;
        let rows = z.len() / v;
        let targets = self.token_rows(micro, false);
        let start = self.vocab_start as i64;
        // One pass over this rank's slice: its max and sum of exponentials per row. The ranks
        // agree on the max, rescale their sums to it, then add sums and target logits at once.
        let (local_max, mut sum_exp) = fused::row_stats(&z, v);
        let mut max = local_max.clone();
        self.tp.all_reduce(&mut max, ReduceOp::Max)?;
        fused::rescale_sums(&mut sum_exp, &local_max, &max);
        let mut both = sum_exp;
        both.extend(fused::picked(&z, v, &targets, start));
        self.tp.all_reduce(&mut both, ReduceOp::Sum)?;
        let (sum_exp, picked) = both.split_at(rows);
        let loss: f64 = (0..rows).map(|i| f64::from(sum_exp[i].ln() + max[i] - picked[i])).sum();
        let mut dz = z;
        fused::softmax_grad_in_place(&mut dz, v, &max, sum_exp, &targets, start, scale as f32);
        Ok((loss * scale, dz))
    }

    /// Backward of one micro-batch through this stage; returns its parameter gradients.
    pub(super) fn backward(&self, fl: &mut InFlight, ctx: &<L::Stage as StageModel>::Ctx) -> Result<GradientsParams, RankError> {
        if let Some((input, out)) = fl.whole.take() {
            return self.backward_whole(input, out, fl);
        }
        if self.device_resident() {
            return self.backward_segments(fl, ctx);
        }
        let stage = self.stage();
        let mut acc: Option<GradientsParams> = None;
        let add = |g: GradientsParams, acc: &mut Option<GradientsParams>| {
            *acc = Some(grads::add(stage, acc.take(), g));
        };
        let shape = [self.cfg.micro_batch, self.cfg.seq_len, self.d_model];
        let mut g: Vec<f32> = if let Some((x, z, dz)) = fl.head.take() {
            let seed = self.residual(dz, z.dims());
            let grads = (z * seed).sum().backward();
            let dx = x.grad(&grads).map(host);
            add(GradientsParams::from_grads(grads, stage), &mut acc);
            let mut dx = dx.unwrap_or_else(|| vec![0.0; shape.iter().product()]);
            self.tp.all_reduce(&mut dx, ReduceOp::Sum)?;
            dx
        } else {
            fl.grad_in.take().expect("gradient received before backward").into_host()
        };
        while let Some((x, y)) = self.next_region(fl, ctx)? {
            let seed = self.constant(g.clone(), shape);
            let grads = (y * seed).sum().backward();
            let dx = x.grad(&grads).map(host);
            add(GradientsParams::from_grads(grads, stage), &mut acc);
            if let Some(mut dx) = dx {
                self.tp.all_reduce(&mut dx, ReduceOp::Sum)?;
                for (a, b) in g.iter_mut().zip(&dx) {
                    *a += b;
                }
            } else {
                self.tp.all_reduce(&mut vec![0f32; g.len()], ReduceOp::Sum)?;
            }
        }
        if let Some(out) = fl.embed_out.take() {
            let seed = self.constant(g, shape);
            let grads = (out * seed).sum().backward();
            add(GradientsParams::from_grads(grads, stage), &mut acc);
        } else {
            fl.grad_out = Some(Boundary::Host(g));
        }
        Ok(acc.unwrap_or_default())
    }
}
