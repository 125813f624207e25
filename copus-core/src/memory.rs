//! Bytes per rank: weights, gradients, AdamW state, and the activations of the micro-batches a
//! pipeline schedule keeps in flight, against a device memory budget.
//!
//! Saved activations per token and layer (elements), Megatron-style TP without sequence
//! parallelism (h = hidden, k = kv width, f = ffn hidden, a = heads, s = sequence, t = tp):
//! replicated `4h` (two norm inputs, two norm outputs), sharded `(2h + 2k + 4f) / t`
//! (q, k, v, attention output, gate, up, silu(gate), gate*up), and without fused attention the
//! scores and probabilities `2 a s / t`. The last stage also holds fp32 logits and their
//! gradient for one micro-batch, `2 V / t` per token.

use serde::{Deserialize, Serialize};

use crate::layout::{ParallelDims, stage_len};
use crate::model::ModelSpec;
use crate::schedule::ScheduleKind;

/// Bytes per element of each kind of state, and what the runtime adds.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct MemoryModel {
    /// Bytes per weight element (2 for bf16 weights).
    pub weight_bytes: f64,
    /// Bytes per gradient element (2 for bf16 gradients).
    pub grad_bytes: f64,
    /// Optimizer bytes per parameter (AdamW: two fp32 moments = 8, plus an fp32 master copy = 12).
    pub optimizer_bytes: f64,
    /// Bytes per activation element saved for the backward pass.
    pub activation_bytes: f64,
    /// Fused (flash) attention: no `s x s` score matrix is kept.
    pub fused_attention: bool,
    /// Optimizer state sharded over dp (ZeRO stage 1).
    pub zero1: bool,
    /// Fixed bytes per rank (runtime, workspace, fragmentation).
    pub overhead_bytes: f64,
}

impl MemoryModel {
    /// Plain fp32 training with AdamW, unfused attention (what the CPU engine runs).
    pub fn fp32() -> Self {
        Self {
            weight_bytes: 4.0,
            grad_bytes: 4.0,
            optimizer_bytes: 8.0,
            activation_bytes: 4.0,
            fused_attention: false,
            zero1: false,
            overhead_bytes: 0.0,
        }
    }

    /// bf16 weights, gradients and activations with fp32 master weights and moments, fused
    /// attention, 2 GiB runtime overhead (GPU training).
    pub fn mixed_bf16() -> Self {
        Self {
            weight_bytes: 2.0,
            grad_bytes: 2.0,
            optimizer_bytes: 12.0,
            activation_bytes: 2.0,
            fused_attention: true,
            zero1: false,
            overhead_bytes: 2.0 * GIB,
        }
    }

    /// Parameters held by a rank on `stage`, computed from the per-layer counts.
    pub fn params_on_stage(model: &ModelSpec, dims: ParallelDims, stage: usize) -> f64 {
        let c = model.param_counts();
        let t = dims.tp as f64;
        let h = model.hidden as f64;
        let layers = stage_len(model.num_layers, dims.pp, stage) as f64;
        let replicated_per_layer = 2.0 * h; // two RMSNorm weights
        let sharded_per_layer = c.per_layer as f64 - replicated_per_layer;
        let mut n = layers * (replicated_per_layer + sharded_per_layer / t);
        let first = stage == 0;
        let last = stage + 1 == dims.pp;
        if first || (last && model.tied_embeddings) {
            n += c.embedding as f64 / t;
        }
        if last {
            n += c.final_norm as f64 + c.lm_head as f64 / t;
        }
        n
    }

    /// Saved activation elements per token of one layer under `tp`.
    pub fn activation_elems_per_token_layer(&self, model: &ModelSpec, tp: usize) -> f64 {
        let h = model.hidden as f64;
        let k = model.kv_dim() as f64;
        let f = model.ffn_hidden as f64;
        let t = tp as f64;
        let scores = if self.fused_attention { 0.0 } else { 2.0 * model.num_heads as f64 * model.seq_len as f64 / t };
        4.0 * h + (2.0 * h + 2.0 * k + 4.0 * f) / t + scores
    }

    /// Memory of the most loaded stage for a layout, micro-batch size and accumulation count.
    pub fn estimate(
        &self,
        model: &ModelSpec,
        dims: ParallelDims,
        micro_batch: usize,
        num_micro: usize,
        schedule: ScheduleKind,
    ) -> MemoryEstimate {
        let tokens = (micro_batch * model.seq_len) as f64;
        let per_layer = self.activation_elems_per_token_layer(model, dims.tp) * self.activation_bytes;
        let mut worst = MemoryEstimate::default();
        for stage in 0..dims.pp {
            let params = Self::params_on_stage(model, dims, stage);
            let in_flight = schedule.max_in_flight(stage, dims.pp, num_micro) as f64;
            let layers = stage_len(model.num_layers, dims.pp, stage) as f64;
            let mut activations = in_flight * tokens * layers * per_layer;
            if stage + 1 == dims.pp {
                activations += tokens * 2.0 * model.vocab_size as f64 / dims.tp as f64 * 4.0;
            }
            let optimizer_share = if self.zero1 { dims.dp as f64 } else { 1.0 };
            let e = MemoryEstimate {
                stage,
                weights: params * self.weight_bytes,
                grads: params * self.grad_bytes,
                optimizer: params * self.optimizer_bytes / optimizer_share,
                activations,
                overhead: self.overhead_bytes,
            };
            if e.total() > worst.total() {
                worst = e;
            }
        }
        worst
    }
}

/// One GiB in bytes.
pub const GIB: f64 = 1024.0 * 1024.0 * 1024.0;

/// Bytes on the most loaded rank of a layout.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct MemoryEstimate {
    /// The pipeline stage this is for: the one that needs the most.
    pub stage: usize,
    /// Bytes of the weights of this rank's tp slice of the stage.
    pub weights: f64,
    /// Bytes of their gradients.
    pub grads: f64,
    /// Bytes of their optimizer state (divided over dp with ZeRO-1).
    pub optimizer: f64,
    /// Saved activations of the micro-batches in flight (and logits on the last stage).
    pub activations: f64,
    /// Fixed runtime overhead, [`MemoryModel::overhead_bytes`].
    pub overhead: f64,
}

impl MemoryEstimate {
    /// Bytes the rank needs in all: weights, gradients, optimizer state, activations, overhead.
    pub fn total(&self) -> f64 {
        self.weights + self.grads + self.optimizer + self.activations + self.overhead
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::stage_layers;
    use crate::model::Placement;

    /// Independent reference: sum the sharded sizes of the parameter specs on one stage.
    fn params_on_stage_from_specs(model: &ModelSpec, dims: ParallelDims, stage: usize) -> f64 {
        let ranges = stage_layers(model.num_layers, dims.pp);
        model
            .param_specs()
            .iter()
            .filter(|p| match p.placement {
                Placement::Layer(l) => ranges[stage].contains(&l),
                Placement::First => stage == 0,
                Placement::Last => stage + 1 == dims.pp,
                Placement::FirstAndLast => stage == 0 || stage + 1 == dims.pp,
            })
            .map(|p| match p.tp {
                crate::model::TpSplit::Replicated => p.numel() as f64,
                crate::model::TpSplit::Split { .. } => p.numel() as f64 / dims.tp as f64,
            })
            .sum()
    }

    #[test]
    fn stage_params_agree_with_the_specs() {
        for name in ModelSpec::PRESETS {
            let m = ModelSpec::preset(name).unwrap();
            for d in ParallelDims::all(8) {
                if d.check_model(&m).is_err() {
                    continue;
                }
                for s in 0..d.pp {
                    let a = MemoryModel::params_on_stage(&m, d, s);
                    let b = params_on_stage_from_specs(&m, d, s);
                    assert!((a - b).abs() < 1e-6 * b, "{name} {d} stage {s}: {a} vs {b}");
                }
            }
        }
    }

    #[test]
    fn serial_fp32_state_is_sixteen_bytes_per_param() {
        let m = ModelSpec::tiny_5m();
        let e = MemoryModel::fp32().estimate(&m, ParallelDims::serial(), 1, 1, ScheduleKind::OneFOneB);
        let n = m.num_params() as f64;
        assert!((e.weights + e.grads + e.optimizer - 16.0 * n).abs() < 1.0);
    }

    #[test]
    fn activations_by_hand_for_tiny_1m() {
        // tiny-1m: h 128, kv 64, f 344, 8 heads, s 128; unfused: 4*128 + (256 + 128 + 1376) + 2*8*128.
        let m = ModelSpec::tiny_1m();
        let per_token = MemoryModel::fp32().activation_elems_per_token_layer(&m, 1);
        assert_eq!(per_token, 512.0 + 1760.0 + 2048.0);
        // Serial, micro-batch 2: 4 layers, one micro-batch in flight, plus logits 2 * 2048 fp32.
        let e = MemoryModel::fp32().estimate(&m, ParallelDims::serial(), 2, 4, ScheduleKind::OneFOneB);
        let tokens = 256.0;
        assert_eq!(e.activations, tokens * 4.0 * per_token * 4.0 + tokens * 2.0 * 2048.0 * 4.0);
    }

    #[test]
    fn one_f_one_b_holds_less_than_gpipe_and_tp_shards_state() {
        let m = ModelSpec::llama_3_2_3b();
        let mm = MemoryModel::mixed_bf16();
        let d = ParallelDims { dp: 1, tp: 1, pp: 4 };
        let g = mm.estimate(&m, d, 1, 16, ScheduleKind::GPipe);
        let f = mm.estimate(&m, d, 1, 16, ScheduleKind::OneFOneB);
        assert!(f.activations < g.activations / 3.0);
        let t1 = mm.estimate(&m, ParallelDims::serial(), 1, 1, ScheduleKind::OneFOneB);
        let t4 = mm.estimate(&m, ParallelDims { dp: 1, tp: 4, pp: 1 }, 1, 1, ScheduleKind::OneFOneB);
        assert!(t4.weights < t1.weights / 3.0 && t4.weights > t1.weights / 4.0);
    }
}
