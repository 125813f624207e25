//! The Llama family under copus's 3D parallelism: [`LlamaStage`] is what one rank holds (a
//! contiguous range of decoder layers, the embedding on the first stage, the final norm and
//! head on the last), with Megatron's tensor-parallel split: q/k/v and gate/up column-parallel
//! (whole heads per rank), o and down row-parallel, vocabulary-parallel embedding and head, norms
//! replicated.

use burn::module::Module;
use burn::nn::{Embedding, Linear};
use burn::tensor::{Device, FloatDType, Int, Tensor};
use copus_burn::parallel::{ShardError, ShardPlan, ShardSource, globalise_layer_path, vocab_parallel_embedding};
use copus_burn::{ParallelLm, ParallelPlan, StageModel};
use copus_core::memory::Precision;
use copus_core::model::ModelSpec;

use crate::llama::{Attention, DecoderLayer, LlamaConfig, Mlp, RmsNorm, Rope};

/// One rank's part of a Llama model.
#[derive(Module, Debug)]
pub struct LlamaStage {
    /// This rank's vocabulary rows of the embedding (first stage; also the last stage's head
    /// when tied).
    pub embed_tokens: Option<Embedding>,
    /// This stage's decoder layers, with this rank's heads and MLP columns.
    pub layers: Vec<DecoderLayer>,
    /// Final norm (last stage).
    pub norm: Option<RmsNorm>,
    /// This rank's vocabulary columns of the head (last stage, untied).
    pub lm_head: Option<Linear>,
    first_layer: usize,
    vocab_start: usize,
    head_dim: usize,
    rope_theta: f64,
}

/// What a Llama stage's blocks share for one sequence length: the rotary tables (none on a
/// stage without layers), and the element type of the products (`None`: f32 throughout).
#[derive(Clone, Debug)]
pub struct LlamaCtx {
    rope: Option<Rope>,
    compute: Option<FloatDType>,
}

impl LlamaCtx {
    /// `x` in the products' element type (the norms ran in f32 before).
    fn lower(&self, x: Tensor<3>) -> Tensor<3> {
        match self.compute {
            Some(dtype) => x.cast(dtype),
            None => x,
        }
    }

    /// `y` back in f32 for the residual stream, the reductions and the loss.
    fn raise(&self, y: Tensor<3>) -> Tensor<3> {
        match self.compute {
            Some(_) => y.cast(FloatDType::F32),
            None => y,
        }
    }
}

impl StageModel for LlamaStage {
    type Ctx = LlamaCtx;

    fn context(&self, seq_len: usize, precision: Precision) -> LlamaCtx {
        let compute = (precision == Precision::Bf16Mixed).then_some(FloatDType::BF16);
        let device = self.layers.first().map(|l| l.attn_norm.weight.val().device());
        let rope = device.map(|d| {
            let rope = Rope::new(seq_len, self.head_dim, self.rope_theta, &d);
            compute.map_or(rope.clone(), |dtype| rope.cast(dtype))
        });
        LlamaCtx { rope, compute }
    }

    fn embed(&self, tokens_bs: Tensor<2, Int>) -> Tensor<3> {
        let emb = self.embed_tokens.as_ref().expect("the first stage holds the embedding");
        vocab_parallel_embedding(emb.weight.val(), tokens_bs, self.vocab_start)
    }

    fn num_blocks(&self) -> usize {
        2 * self.layers.len()
    }

    fn blocks_per_layer(&self) -> usize {
        2
    }

    fn block(&self, i: usize, x_bsd: Tensor<3>, ctx: &LlamaCtx) -> Tensor<3> {
        let layer = &self.layers[i / 2];
        let y = if i.is_multiple_of(2) {
            let rope = ctx.rope.as_ref().expect("rope tables for a stage with layers");
            layer.attn.forward(ctx.lower(layer.attn_norm.forward(x_bsd)), rope)
        } else {
            layer.mlp.forward(ctx.lower(layer.mlp_norm.forward(x_bsd)))
        };
        ctx.raise(y)
    }

    fn logits(&self, x_bsd: Tensor<3>, ctx: &LlamaCtx) -> Tensor<3> {
        let h_bsd = ctx.lower(self.norm.as_ref().expect("the last stage holds the final norm").forward(x_bsd));
        let z = match (&self.lm_head, &self.embed_tokens) {
            (Some(head), _) => crate::llama::project(head, h_bsd),
            (None, Some(emb)) => {
                let [b, s, d] = h_bsd.dims();
                let w_vd = emb.weight.val().cast(h_bsd.dtype());
                let [v, _] = w_vd.dims();
                h_bsd.reshape([b * s, d]).matmul(w_vd.transpose()).reshape([b, s, v])
            }
            (None, None) => panic!("the last stage holds a head or the tied embedding"),
        };
        ctx.raise(z)
    }

    fn global_name(&self, local_path: &str) -> String {
        globalise_layer_path(local_path, self.first_layer)
    }

    fn no_decay_predicates(&self) -> Vec<String> {
        vec!["norm".into(), "embed_tokens".into()]
    }
}

impl ParallelLm for LlamaConfig {
    type Stage = LlamaStage;

    fn spec(&self) -> ModelSpec {
        LlamaConfig::spec(self, "llama")
    }

    fn describe(&self) -> Option<String> {
        Some(burn::config::config_to_json(self))
    }

    fn parallel_plan(&self) -> ParallelPlan {
        let mut tp_replicated: Vec<String> = (0..self.shape.num_layers)
            .flat_map(|i| [format!("layers.{i}.attn_norm.weight"), format!("layers.{i}.mlp_norm.weight")])
            .collect();
        tp_replicated.push("norm.weight".into());
        ParallelPlan {
            embedding: "embed_tokens.weight".into(),
            head: (!self.shape.tied_embeddings).then(|| "lm_head.weight".into()),
            tp_replicated,
        }
    }

    fn build_stage(&self, plan: &ShardPlan, src: &mut ShardSource, device: &Device) -> Result<LlamaStage, ShardError> {
        let tp = plan.dims.tp;
        let e = self.shape.hidden / self.shape.num_heads;
        let linear = |src: &mut ShardSource, name: &str, bias: bool| -> Result<Linear, ShardError> {
            Ok(Linear {
                weight: src.param::<2>(&format!("{name}.weight"), device)?,
                bias: if bias { Some(src.param::<1>(&format!("{name}.bias"), device)?) } else { None },
            })
        };
        let norm = |src: &mut ShardSource, name: &str| -> Result<RmsNorm, ShardError> {
            Ok(RmsNorm { weight: src.param::<1>(name, device)?, eps: self.norm_eps })
        };
        let mut layers = Vec::with_capacity(plan.layers.len());
        for i in plan.layers.clone() {
            let n = |s: &str| format!("layers.{i}.{s}");
            layers.push(DecoderLayer {
                attn_norm: norm(src, &n("attn_norm.weight"))?,
                attn: Attention {
                    q_proj: linear(src, &n("attn.q_proj"), self.shape.qkv_bias)?,
                    k_proj: linear(src, &n("attn.k_proj"), self.shape.qkv_bias)?,
                    v_proj: linear(src, &n("attn.v_proj"), self.shape.qkv_bias)?,
                    o_proj: linear(src, &n("attn.o_proj"), false)?,
                    num_heads: self.shape.num_heads / tp,
                    num_kv_heads: self.shape.num_kv_heads / tp,
                    head_dim: e,
                },
                mlp_norm: norm(src, &n("mlp_norm.weight"))?,
                mlp: Mlp {
                    gate_proj: linear(src, &n("mlp.gate_proj"), false)?,
                    up_proj: linear(src, &n("mlp.up_proj"), false)?,
                    down_proj: linear(src, &n("mlp.down_proj"), false)?,
                },
            });
        }
        let wants_embedding = plan.is_first() || (plan.is_last() && self.shape.tied_embeddings);
        let embed_tokens = if wants_embedding { Some(Embedding { weight: src.param::<2>("embed_tokens.weight", device)? }) } else { None };
        let (norm_w, lm_head) = if plan.is_last() {
            let head = if self.shape.tied_embeddings { None } else { Some(linear(src, "lm_head", false)?) };
            (Some(norm(src, "norm.weight")?), head)
        } else {
            (None, None)
        };
        Ok(LlamaStage {
            embed_tokens,
            layers,
            norm: norm_w,
            lm_head,
            first_layer: plan.layers.start,
            vocab_start: plan.tp_rank * (self.shape.vocab_size / tp),
            head_dim: e,
            rope_theta: self.rope_theta,
        })
    }
}
