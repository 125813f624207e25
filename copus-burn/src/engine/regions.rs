//! The tensor-parallel regions of one micro-batch on one rank: the embedding, one region per
//! residual branch and the head, each a sub-graph whose input is a detached leaf. Between
//! regions the partial outputs (forward) and partial input gradients (backward) are summed over
//! the tp group, and the vocabulary-parallel cross entropy is computed across the tp group's
//! slices of the logits.

use burn::optim::GradientsParams;
use burn::tensor::{Int, Tensor, TensorData};

use super::rank::{RankError, RankState};
use crate::collective::{Collective, ReduceOp};
use crate::fused;
use crate::grads;
use crate::parallel::{ParallelLm, StageModel};
use crate::traffic::{self, Kind};

/// What a micro-batch leaves on a stage between its forward and backward.
#[derive(Default)]
pub(super) struct InFlight {
    pub(super) embed_out: Option<Tensor<3>>,
    pub(super) blocks: Vec<(Tensor<3>, Tensor<3>)>,
    pub(super) head: Option<(Tensor<3>, Tensor<3>, Vec<f32>)>,
    pub(super) activation_in: Option<Vec<f32>>,
    pub(super) activation_out: Option<Vec<f32>>,
    pub(super) grad_in: Option<Vec<f32>>,
    pub(super) grad_out: Option<Vec<f32>>,
}

fn host(t: Tensor<3>) -> Vec<f32> {
    traffic::read(t, Kind::Activations).try_to_vec::<f32>().expect("f32 activations")
}

impl<L: ParallelLm, C: Collective> RankState<L, C> {
    fn tokens(&self, batch: &[i64], mb: usize, inputs: bool) -> Tensor<2, Int> {
        let (bm, s) = (self.cfg.micro_batch, self.cfg.seq_len);
        traffic::upload(TensorData::new(self.token_rows(batch, mb, inputs), [bm, s]), &self.device, Kind::Batch)
    }

    /// Micro-batch `mb`'s input (or target) tokens, row-major `[B_m, seq]`.
    fn token_rows(&self, batch: &[i64], mb: usize, inputs: bool) -> Vec<i64> {
        let (bm, s) = (self.cfg.micro_batch, self.cfg.seq_len);
        let a = self.cfg.num_micro_per_replica();
        let first_row = (self.dp_rank * a + mb) * bm;
        let mut v = Vec::with_capacity(bm * s);
        for row in first_row..first_row + bm {
            let seq = &batch[row * (s + 1)..(row + 1) * (s + 1)];
            v.extend_from_slice(if inputs { &seq[..s] } else { &seq[1..] });
        }
        v
    }

    fn leaf(&self, v: &[f32]) -> Tensor<3> {
        let shape = [self.cfg.micro_batch, self.cfg.seq_len, self.d_model];
        traffic::upload::<3, _>(TensorData::new(v.to_vec(), shape), &self.device, Kind::Activations).require_grad()
    }

    fn constant(&self, v: Vec<f32>, shape: [usize; 3]) -> Tensor<3> {
        traffic::upload(TensorData::new(v, shape), &self.device, Kind::Activations)
    }

    /// Forward of one micro-batch through this stage; returns the loss share (last stage).
    pub(super) fn forward(
        &self,
        batch: &[i64],
        mb: usize,
        fl: &mut InFlight,
        ctx: &<L::Stage as StageModel>::Ctx,
    ) -> Result<f64, RankError> {
        let stage = self.stage();
        let mut h = if self.plan.is_first() {
            let out = stage.embed(self.tokens(batch, mb, true));
            let mut v = host(out.clone());
            self.tp.all_reduce(&mut v, ReduceOp::Sum)?;
            fl.embed_out = Some(out);
            v
        } else {
            fl.activation_in.take().expect("activation received before forward")
        };
        for i in 0..stage.num_blocks() {
            let x = self.leaf(&h);
            let y = stage.block(i, x.clone(), ctx);
            let mut yv = host(y.clone());
            self.tp.all_reduce(&mut yv, ReduceOp::Sum)?;
            for (a, b) in h.iter_mut().zip(&yv) {
                *a += b;
            }
            fl.blocks.push((x, y));
        }
        if !self.plan.is_last() {
            fl.activation_out = Some(h);
            return Ok(0.0);
        }
        let x = self.leaf(&h);
        let z = stage.logits(x.clone());
        let (loss, dz) = self.vocab_parallel_cross_entropy(host(z.clone()), batch, mb)?;
        fl.head = Some((x, z, dz));
        Ok(loss)
    }

    /// Loss share of one micro-batch (summed cross entropy over the step's global target
    /// tokens) and its gradient with respect to this rank's logits slice.
    fn vocab_parallel_cross_entropy(&self, z: Vec<f32>, batch: &[i64], mb: usize) -> Result<(f64, Vec<f32>), RankError> {
        let v = self.vocab_local;
        let rows = z.len() / v;
        let targets = self.token_rows(batch, mb, false);
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
        let global_tokens = (self.cfg.global_batch * self.cfg.seq_len) as f32;
        let loss: f64 = (0..rows).map(|i| f64::from(sum_exp[i].ln() + max[i] - picked[i])).sum();
        let mut dz = z;
        fused::softmax_grad_in_place(&mut dz, v, &max, sum_exp, &targets, start, 1.0 / global_tokens);
        Ok((loss / f64::from(global_tokens), dz))
    }

    /// Backward of one micro-batch through this stage; returns its parameter gradients.
    pub(super) fn backward(&self, fl: &mut InFlight) -> Result<GradientsParams, RankError> {
        let stage = self.stage();
        let mut acc: Option<GradientsParams> = None;
        let add = |g: GradientsParams, acc: &mut Option<GradientsParams>| {
            *acc = Some(grads::add(stage, acc.take(), g));
        };
        let shape = [self.cfg.micro_batch, self.cfg.seq_len, self.d_model];
        let mut g: Vec<f32> = if let Some((x, z, dz)) = fl.head.take() {
            let dims = z.dims();
            let seed = self.constant(dz, dims);
            let grads = (z * seed).sum().backward();
            let dx = x.grad(&grads).map(host);
            add(GradientsParams::from_grads(grads, stage), &mut acc);
            let mut dx = dx.unwrap_or_else(|| vec![0.0; shape.iter().product()]);
            self.tp.all_reduce(&mut dx, ReduceOp::Sum)?;
            dx
        } else {
            fl.grad_in.take().expect("gradient received before backward")
        };
        for (x, y) in fl.blocks.drain(..).rev() {
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
            fl.grad_out = Some(g);
        }
        Ok(acc.unwrap_or_default())
    }
}
