//! One optimizer step on one rank: the stage's pipeline schedule over its micro-batches, the
//! tied embedding's gradient between the first and last stage, the probe's per-micro-batch
//! norms, the bucketed dp all-reduce, and the shared step closing (estimator, clipping, LR)
//! before the update.

use std::time::Instant;

use burn::optim::GradientsParams;
use copus_core::gns::{NoiseEstimate, StepStats};
use copus_core::schedule::{Action, build as build_schedule};

use super::fault::StepFault;
use super::grad_index::{ParamInfo, Role};
use super::messages::EngineStep;
use super::rank::{RankError, RankState};
use super::regions::{Boundary, InFlight};
use super::zero::Chunk;
use crate::comm::{Collective, ReduceOp};
use crate::grads::{self, Deferred};
use crate::parallel::ParallelLm;
use crate::traffic::Kind;
use crate::trainer::{StepMetrics, TrainError};

const TAG_ACT: u32 = 1;
const TAG_GRAD: u32 = 2;
const TAG_TIED: u32 = 3;
const TAG_TIED_SUM: u32 = 4;

impl<L: ParallelLm, C: Collective> RankState<L, C> {
    /// One optimizer step on `batch` (the whole step's sequences; this rank takes its share).
    /// `fault`: what the tests planted (world rank 0 writing a NaN into its gradient); nothing
    /// without `fault-injection`.
    pub(super) fn step(&mut self, batch: &[i64], fault: StepFault) -> Result<EngineStep, RankError> {
        let start = Instant::now();
        let n_total = self.cfg.global_batch / self.cfg.micro_batch;
        let tp_rank = self.plan.tp_rank;
        let Scheduled { loss, mut micro_sq, acc } = self.run_schedule(batch, n_total)?;
        if fault.crashes(self.rank) {
            panic!("a planted panic on rank {} in the middle of a step", self.rank);
        }
        let mut acc = acc.unwrap_or_default();
        self.return_tied_sum(&mut acc)?;
        // Per-micro-batch norms and the loss, summed over every rank.
        micro_sq[n_total] = if self.plan.is_last() && tp_rank == 0 { loss } else { 0.0 };
        self.world.all_reduce(&mut micro_sq, ReduceOp::Sum)?;
        let loss = micro_sq[n_total];
        let mean_micro_sq_norm = micro_sq[..n_total].iter().sum::<f64>() / n_total as f64;
        #[cfg(not(feature = "fault-injection"))]
        let _ = fault;
        #[cfg(feature = "fault-injection")]
        if fault.poison()
            && self.rank == 0
            && let Some(first) = self.index.params.first().map(|p| p.id)
        {
            let mut g = self.index.flatten(self.stage(), &acc, |p| p.id == first);
            g[0] = f32::NAN;
            self.index.unflatten(self.stage(), &mut acc, |p| p.id == first, &g);
        }
        let zero_chunk = self.reduce_dp(&mut acc)?;
        let (sq, has_previous) = self.probe_norms(&acc, zero_chunk.as_ref(), n_total)?;
        let stats = StepStats {
            micro_batch: self.cfg.micro_batch,
            num_micro: n_total,
            mean_micro_sq_norm,
            grad_sq_norm: sq[0],
            diff_sq_norm: has_previous.then_some(sq[1]),
        };
        self.close_and_update(loss, stats, acc, zero_chunk, start)
    }

    /// The stage's pipeline schedule over its micro-batches: the forward and backward passes in
    /// order, the stage boundaries sent and received, the gradients accumulated. Returns this
    /// rank's loss share, each micro-batch's |g|^2 by its slot (slot `n_total` left for the loss)
    /// and the accumulated gradient.
    fn run_schedule(&mut self, batch: &[i64], n_total: usize) -> Result<Scheduled, RankError> {
        let dims = self.cfg.dims;
        let a = self.cfg.num_micro_per_replica();
        let actions = build_schedule(self.cfg.schedule, dims.pp, a).map_err(|e| TrainError::Batch(e.to_string()))?;
        let my_actions = actions[self.plan.stage].clone();
        let (key, ctx) = self.take_context(self.cfg.seq_len);
        // The step's tokens in one upload, each micro-batch's a view of it.
        let mut flights: Vec<InFlight> =
            self.step_tokens(batch, a).into_iter().map(|tokens| InFlight { tokens, ..InFlight::default() }).collect();
        let (prev, next) = (self.plan.stage.wrapping_sub(1), self.plan.stage + 1);
        // Each micro-batch's loss share and |g|^2, read back together after the last backward
        // pass (on a device: one wait for it per step, not two per micro-batch).
        let mut deferred = Deferred::default();
        let (mut losses, mut micro) = (Vec::new(), Vec::new());
        let mut micro_sq = vec![0f64; n_total + 1];
        let mut acc: Option<GradientsParams> = None;
        let tp_rank = self.plan.tp_rank;
        // Each micro-batch's loss is its share of the step's mean over target tokens.
        let scale = 1.0 / (self.cfg.global_batch * self.cfg.seq_len) as f64;
        for action in my_actions {
            match action {
                Action::RecvActivation { mb } => flights[mb].activation_in = Some(self.receive(prev, TAG_ACT)?),
                Action::Forward { mb } => {
                    let mut fl = std::mem::take(&mut flights[mb]);
                    let share = self.forward(self.micro_rows(batch, mb), scale, &mut fl, &ctx)?;
                    losses.push(deferred.push(Kind::Activations, share));
                    flights[mb] = fl;
                }
                Action::SendActivation { mb } => {
                    let v = flights[mb].activation_out.take().expect("forward before send");
                    self.hand_on(next, TAG_ACT, v)?;
                }
                Action::RecvGrad { mb } => flights[mb].grad_in = Some(self.receive(next, TAG_GRAD)?),
                Action::Backward { mb } => {
                    let mut fl = std::mem::take(&mut flights[mb]);
                    let mut g = self.backward(&mut fl, &ctx)?;
                    flights[mb].grad_out = fl.grad_out.take();
                    self.combine_micro_grads(&mut g)?;
                    // This micro-batch's gradient is its share of the step mean: its own mean
                    // gradient is n_total times it (equal tokens per micro-batch).
                    let sq = self.index.sq_norm(self.stage(), &g, None, |p| p.counted(tp_rank), (n_total * n_total) as f64);
                    micro.push((self.dp_rank * a + mb, deferred.push(Kind::Probe, sq)));
                    acc = Some(grads::add(self.stage(), acc.take(), g));
                }
                Action::SendGrad { mb } => {
                    let v = flights[mb].grad_out.take().expect("backward before send");
                    self.hand_on(prev, TAG_GRAD, v)?;
                }
            }
        }
        self.keep_context((key, ctx));
        let values = deferred.read();
        let loss = losses.iter().fold(0f64, |sum, &i| sum + values[i]);
        for (slot, i) in micro {
            micro_sq[slot] = values[i];
        }
        Ok(Scheduled { loss, micro_sq, acc })
    }

    /// A micro-batch's gradient combined across ranks as soon as it is taken: the tp-replicated
    /// parameters' partial gradients summed over tp, and a tied embedding's last-stage share
    /// moved to the first stage.
    fn combine_micro_grads(&self, g: &mut GradientsParams) -> Result<(), RankError> {
        let dims = self.cfg.dims;
        // tp-replicated parameters: sum the partial gradients over tp.
        if dims.tp > 1 && self.index.any(|p| p.role == Role::TpReplicated) {
            let replicated = |p: &ParamInfo| p.role == Role::TpReplicated;
            let sum = match self.flat(g, replicated) {
                Boundary::Host(mut rep) => {
                    self.tp.all_reduce(&mut rep, ReduceOp::Sum)?;
                    Boundary::Host(rep)
                }
                Boundary::Device(rep) => Boundary::Device(self.tp.all_reduce_tensor(rep, ReduceOp::Sum)?),
            };
            self.write_back(g, replicated, sum);
        }
        // A tied embedding across stages: the last stage's share goes to the first.
        if self.index.any(|p| p.mirror) {
            let share = self.flat(g, |p| p.mirror);
            let zeros = share.zeros_like();
            self.hand_on(0, TAG_TIED, share)?;
            self.write_back(g, |p| p.mirror, zeros);
        }
        if self.index.any(|p| p.tied_owner) {
            let sum = match self.flat(g, |p| p.tied_owner) {
                Boundary::Host(mut own) => {
                    let share = self.pp.recv(dims.pp - 1, TAG_TIED)?;
                    for (o, s) in own.iter_mut().zip(&share) {
                        *o += s;
                    }
                    Boundary::Host(own)
                }
                Boundary::Device(own) => Boundary::Device(own + self.pp.recv_tensor(dims.pp - 1, TAG_TIED, &self.device)?),
            };
            self.write_back(g, |p| p.tied_owner, sum);
        }
        Ok(())
    }

    /// Sends the tied embedding's summed gradient from the first stage back to the mirror.
    fn return_tied_sum(&self, acc: &mut GradientsParams) -> Result<(), RankError> {
        // The tied embedding's summed gradient goes back to the mirror.
        if self.index.any(|p| p.tied_owner) {
            let full = self.flat(acc, |p| p.tied_owner);
            self.hand_on(self.cfg.dims.pp - 1, TAG_TIED_SUM, full)?;
        }
        if self.index.any(|p| p.mirror) {
            let full = if self.device_resident() {
                Boundary::Device(self.pp.recv_tensor(0, TAG_TIED_SUM, &self.device)?)
            } else {
                Boundary::Host(self.pp.recv(0, TAG_TIED_SUM)?)
            };
            self.write_back(acc, |p| p.mirror, full);
        }
        Ok(())
    }

    /// The data-parallel reduction of the step's gradient: with ZeRO-1 reduce-scattered, this
    /// rank's chunk returned (and `acc` left empty); otherwise all-reduced in place in `acc`.
    fn reduce_dp(&self, acc: &mut GradientsParams) -> Result<Option<Chunk>, RankError> {
        // ZeRO-1: the gradient reduce-scattered over dp; this rank's chunk of the sum.
        let zero_chunk = match &self.zero {
            Some(z) => {
                // On the ranks' devices where the job is device-resident and the group combines
                // tensors where they lie (as the dp all-reduce below).
                let on_device = self.device_resident() && self.dp.scatters_tensors_in_place();
                let bucket = self.cfg.bucket_elems;
                Some(z.reduce(self.stage(), &self.index, std::mem::take(acc), &self.dp, on_device, bucket)?)
            }
            None => None,
        };
        // Data parallel: the gradients all-reduced in buckets of `bucket_elems`, flattened
        // where they lie on a device (each bucket one tensor there, so no more than a bucket is
        // copied beside the gradients at once), through host buffers where they lie in host
        // memory (where MPI ranks keep the buckets too: one all-reduce of the whole gradient
        // would stage dp copies of it).
        if self.cfg.dims.dp > 1 && zero_chunk.is_none() {
            let in_place = self.device_resident() && self.dp.reduces_tensors_in_place() && !grads::host_device(&self.device);
            if in_place {
                for bucket in self.index.buckets(self.stage(), |_| true, self.cfg.bucket_elems) {
                    let select = |p: &ParamInfo| bucket.contains(&p.id);
                    let flat = self.index.flatten_on_device(self.stage(), acc, select).expect("gradients on a device");
                    let sum = self.dp.all_reduce_tensor(flat, ReduceOp::Sum)?;
                    self.index.unflatten_on_device(self.stage(), acc, select, sum);
                }
            } else {
                let mut flat = self.index.flatten(self.stage(), acc, |_| true);
                for chunk in flat.chunks_mut(self.cfg.bucket_elems) {
                    self.dp.all_reduce(chunk, ReduceOp::Sum)?;
                }
                self.index.unflatten(self.stage(), acc, |_| true, &flat);
            }
        }
        Ok(zero_chunk)
    }

    /// The probe's norms of the reduced gradient: `[|g|^2, |g - g_prev|^2]`, and whether there
    /// was a previous gradient (else the second is 0).
    fn probe_norms(&self, acc: &GradientsParams, zero_chunk: Option<&Chunk>, n_total: usize) -> Result<([f64; 2], bool), RankError> {
        // |g|^2 of the reduced gradient and, for a one-micro-batch step, |g - g_prev|^2, each
        // summed over the model-parallel ranks (with ZeRO-1, |g|^2 of each chunk summed over
        // the world; a step over dp > 1 has several micro-batches, so no previous gradient).
        let tp_rank = self.plan.tp_rank;
        let counted = |p: &super::grad_index::ParamInfo| p.counted(tp_rank);
        let previous = self.closer.memory().previous(n_total);
        let has_previous = previous.is_some();
        let sq = if let (Some(z), Some(chunk)) = (&self.zero, zero_chunk) {
            debug_assert!(!has_previous, "dp > 1 gives every step several micro-batches");
            let mut sq = [z.sq_norm(chunk), 0.0];
            self.world.all_reduce(&mut sq, ReduceOp::Sum)?;
            sq
        } else {
            let mut norms = Deferred::default();
            norms.push(Kind::Probe, self.index.sq_norm(self.stage(), acc, None, counted, 1.0));
            if let Some(p) = previous {
                norms.push(Kind::Probe, self.index.sq_norm(self.stage(), acc, Some(p), counted, 1.0));
            }
            let norms = norms.read();
            let mut sq = [norms[0], norms.get(1).copied().unwrap_or(0.0)];
            self.mp.all_reduce(&mut sq, ReduceOp::Sum)?;
            sq
        };
        Ok((sq, has_previous))
    }

    /// The step's close and update: skipped where it diverged; else the shared closing
    /// (estimator, clipping, LR) and the optimizer step, on the whole gradient or, with ZeRO-1,
    /// on this rank's chunk.
    fn close_and_update(
        &mut self,
        loss: f64,
        stats: StepStats,
        acc: GradientsParams,
        zero_chunk: Option<Chunk>,
        start: Instant,
    ) -> Result<EngineStep, RankError> {
        if !(loss.is_finite() && stats.grad_sq_norm.is_finite()) {
            // Diverged: skip the update. Weights, optimizer state, estimator, probe memory and
            // counters stay as they were (every rank sees the same reduced loss and norm).
            let lr = self.cfg.optim.lr_at(self.step, self.samples_seen(), self.cfg.global_batch, self.closer.gns().b_simple());
            let metrics = self.metrics(loss, lr, stats.grad_sq_norm.sqrt(), None, start);
            return Ok(finished(metrics, stats, true));
        }
        let stage = self.stage.take().expect("stage present");
        let closed = match self.closer.close(&stage, &self.cfg.optim, self.step, self.samples_seen(), self.cfg.global_batch, &stats, acc) {
            Ok(c) => c,
            Err(e) => {
                self.stage = Some(stage);
                return Err(e.into());
            }
        };
        self.stage = Some(match (&self.zero, zero_chunk) {
            (Some(z), Some(chunk)) => {
                let factor = crate::closing::clip_factor(&self.cfg.optim, closed.grad_norm);
                z.update(&mut self.optim, stage, chunk, factor, closed.lr, &self.dp)?
            }
            _ => self.optim.step(closed.lr, stage, closed.grads),
        });
        self.step += 1;
        self.tokens_seen += (self.cfg.global_batch * self.cfg.seq_len) as u64;
        let metrics = self.metrics(loss, closed.lr, closed.grad_norm, closed.estimate, start);
        Ok(finished(metrics, stats, false))
    }

    /// The selected gradients as one tensor on the device when the job is device-resident,
    /// else as a host buffer.
    fn flat(&self, g: &GradientsParams, select: impl Fn(&ParamInfo) -> bool + Copy) -> Boundary {
        let on_device = if self.device_resident() { self.index.flatten_on_device(self.stage(), g, select) } else { None };
        match on_device {
            Some(t) => Boundary::Device(t),
            None => Boundary::Host(self.index.flatten(self.stage(), g, select)),
        }
    }

    /// Writes what [`Self::flat`] laid out back into `g`.
    fn write_back(&self, g: &mut GradientsParams, select: impl Fn(&ParamInfo) -> bool, b: Boundary) {
        match b {
            Boundary::Host(v) => self.index.unflatten(self.stage(), g, select, &v),
            Boundary::Device(t) => self.index.unflatten_on_device(self.stage(), g, select, t),
        }
    }

    /// Sends a stage boundary's values to pipeline rank `to`: a tensor where it lies, a buffer
    /// from host memory.
    pub(super) fn hand_on(&self, to: usize, tag: u32, b: Boundary) -> Result<(), RankError> {
        match b {
            Boundary::Host(v) => self.pp.send(to, tag, v)?,
            Boundary::Device(t) => self.pp.send_tensor(to, tag, t)?,
        }
        Ok(())
    }

    /// Receives a stage boundary's values from pipeline rank `from`: as a tensor on this rank's
    /// device when a stage runs as one graph (tp = 1) or on a device, else (Flex's
    /// tensor-parallel regions) into host memory.
    pub(super) fn receive(&self, from: usize, tag: u32) -> Result<Boundary, RankError> {
        Ok(if self.cfg.dims.tp == 1 || self.device_resident() {
            Boundary::Device(self.pp.recv_tensor(from, tag, &self.device)?)
        } else {
            Boundary::Host(self.pp.recv(from, tag)?)
        })
    }

    /// Sequences trained on so far (the schedule's clock).
    fn samples_seen(&self) -> u64 {
        self.tokens_seen / self.cfg.seq_len.max(1) as u64
    }

    /// The step's metrics in the current configuration and counters.
    fn metrics(&self, loss: f64, lr: f64, grad_norm: f64, est: Option<NoiseEstimate>, start: Instant) -> StepMetrics {
        StepMetrics {
            step: self.step,
            loss,
            lr,
            global_batch: self.cfg.global_batch,
            micro_batch: self.cfg.micro_batch,
            num_micro: self.cfg.global_batch / self.cfg.micro_batch,
            tokens_seen: self.tokens_seen,
            step_time: start.elapsed().as_secs_f64(),
            grad_norm,
            grad_sq: est.map(|e| e.grad_sq),
            trace: est.map(|e| e.trace),
            b_simple: est.and_then(|e| e.b_simple()),
            gns_biased: est.is_some_and(|e| e.biased),
        }
    }
}

/// What a rank's pipeline schedule leaves: its share of the step's loss, each micro-batch's
/// |g|^2 by its slot (the last slot left for the loss), and the gradient accumulated over its
/// micro-batches (none where the stage ran no backward pass).
struct Scheduled {
    loss: f64,
    micro_sq: Vec<f64>,
    acc: Option<GradientsParams>,
}

/// A step's reply, with this rank's host traffic since its previous step.
fn finished(metrics: StepMetrics, stats: StepStats, skipped: bool) -> EngineStep {
    let host = crate::traffic::take();
    EngineStep { metrics, stats, skipped, host, host_rank_max: host.total() }
}
