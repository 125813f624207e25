//! A held-out evaluation on the running ranks: each data-parallel replica takes its share of
//! the sequences, each stage runs its forward on its own device (the same regions, collectives
//! and pipeline hand-overs as a training step, no backward, and no autodiff graph recorded),
//! and the summed loss is reduced over the world. No parameter leaves its rank.
//!
//! Sequences are dealt in rounds of `dp * micro`: in round `k` replica `d` takes sequences
//! `[k * dp * micro + d * micro, .. + micro)`, fewer (or none) in the last round, so any count
//! works on any layout. The ranks of one replica (its tp and pp ranks) always hold the same
//! sequences, so they take the same path through their collectives.

use super::rank::{RankError, RankState};
use super::regions::InFlight;
use crate::comm::{Collective, ReduceOp};
use crate::grads::Deferred;
use crate::parallel::ParallelLm;
use crate::traffic::Kind;

/// The pipeline tag of an evaluation's activations (a step's tags are below it, a live
/// change's far above).
const TAG_EVAL: u32 = 5;

impl<L: ParallelLm, C: Collective> RankState<L, C> {
    /// The mean loss per target token over `windows` (whole sequences of `seq + 1` ids), in
    /// micro-batches of at most `micro` sequences per replica. Every rank returns the same value.
    pub(super) fn evaluate(&mut self, windows: &[i64], micro: usize) -> Result<f64, RankError> {
        // The stage's parameters untracked while it runs, its inputs plain tensors
        // (`InFlight::evaluation`): nothing is recorded for a backward pass that never comes.
        let tracked = self.stage.take();
        self.stage = tracked.as_ref().map(|s| burn::module::Module::no_grad(s.clone()));
        let loss = crate::traffic::counted_as(crate::traffic::Kind::Evaluation, || self.evaluate_here(windows, micro));
        self.stage = tracked;
        loss
    }

    fn evaluate_here(&mut self, windows: &[i64], micro: usize) -> Result<f64, RankError> {
        let s = self.cfg.seq_len;
        let count = windows.len() / (s + 1);
        let micro = micro.max(1);
        let (key, ctx) = self.take_context(s);
        let (prev, next) = (self.plan.stage.wrapping_sub(1), self.plan.stage + 1);
        // Each micro-batch's summed loss, read back together at the end.
        let mut deferred = Deferred::default();
        for round in windows.chunks(self.cfg.dims.dp * micro * (s + 1)) {
            let Some(rows) = round.chunks(micro * (s + 1)).nth(self.dp_rank) else { continue };
            let mut fl = InFlight { evaluation: true, ..InFlight::default() };
            if !self.plan.is_first() {
                fl.activation_in = Some(self.receive(prev, TAG_EVAL)?);
            }
            deferred.push(Kind::Evaluation, self.forward(rows, 1.0, &mut fl, &ctx)?);
            if let Some(out) = fl.activation_out.take() {
                self.hand_on(next, TAG_EVAL, out)?;
            }
        }
        self.keep_context((key, ctx));
        let sum = deferred.read().into_iter().fold(0f64, |sum, l| sum + l);
        let mut total = [if self.plan.is_last() && self.plan.tp_rank == 0 { sum } else { 0.0 }];
        self.world.all_reduce(&mut total, ReduceOp::Sum)?;
        Ok(total[0] / (count * s).max(1) as f64)
    }
}
