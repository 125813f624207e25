//! A Llama-style decoder: token embedding, RMSNorm, rotary position embedding (rotate-half, as
//! in Llama checkpoints), grouped-query causal attention, SwiGLU MLP, final norm, LM head (tied
//! or untied). No biases except optional q/k/v biases (Qwen2).
//!
//! Shape legend: b batch, s sequence, d hidden, h query heads, k kv heads, e head dim,
//! f MLP hidden, v vocabulary.

use burn::config::Config;
use burn::module::{Module, Param};
use burn::nn::{Embedding, EmbeddingConfig, Initializer, Linear, LinearConfig};
use burn::tensor::{Device, Int, Tensor, TensorData};
use copus_burn::fused::{grouped_causal_attention, linear, rms_norm, rope, swiglu};
use copus_burn::{CausalLm, cross_entropy_sum, traffic};
use copus_core::model::{ModelSpec, ParamSpec};

/// Configuration of a [`Llama`] model: a copus-core [`ModelSpec`] (every shape field, defined
/// once there) and what only the Burn model needs (RoPE base, norm epsilon, initialisation).
#[derive(Config, Debug)]
pub struct LlamaConfig {
    /// The shape: layers, width, heads, kv heads, SwiGLU width, vocabulary, the longest
    /// sequence (`seq_len`), a tied head and q/k/v biases.
    pub shape: ModelSpec,
    /// RoPE base.
    #[config(default = 10000.0)]
    pub rope_theta: f64,
    /// RMSNorm epsilon.
    #[config(default = 1e-5)]
    pub norm_eps: f64,
    /// Standard deviation of the normal initialisation of matrices.
    #[config(default = 0.02)]
    pub init_std: f64,
}

impl LlamaConfig {
    /// The configuration of a copus-core shape.
    pub fn from_spec(spec: &ModelSpec) -> Self {
        Self::new(spec.clone())
    }

    /// The same shape with a tied (or untied) LM head.
    pub fn with_tied_embeddings(mut self, tied: bool) -> Self {
        self.shape.tied_embeddings = tied;
        self
    }

    /// The copus-core shape of this configuration, under `name`.
    pub fn spec(&self, name: &str) -> ModelSpec {
        ModelSpec { name: name.into(), ..self.shape.clone() }
    }

    /// Every parameter's name and shape, without allocating anything (the same list the built
    /// model holds).
    pub fn param_specs(&self) -> Vec<ParamSpec> {
        self.spec("llama").param_specs()
    }

    /// Parameter count, without allocating.
    pub fn num_params(&self) -> u64 {
        self.spec("llama").num_params()
    }

    fn linear(&self, d_in: usize, d_out: usize, bias: bool, device: &Device) -> Linear {
        LinearConfig::new(d_in, d_out).with_bias(bias).with_initializer(Initializer::Normal { mean: 0.0, std: self.init_std }).init(device)
    }

    /// Builds the model on `device` (use `device.autodiff()` to train it).
    pub fn init(&self, device: &Device) -> Llama {
        self.spec("llama").validate().unwrap_or_else(|e| panic!("invalid Llama configuration: {e}"));
        let d = self.shape.hidden;
        let e = d / self.shape.num_heads;
        let kv = self.shape.num_kv_heads * e;
        let layers = (0..self.shape.num_layers)
            .map(|_| DecoderLayer {
                attn_norm: RmsNorm::new(d, self.norm_eps, device),
                attn: Attention {
                    q_proj: self.linear(d, d, self.shape.qkv_bias, device),
                    k_proj: self.linear(d, kv, self.shape.qkv_bias, device),
                    v_proj: self.linear(d, kv, self.shape.qkv_bias, device),
                    o_proj: self.linear(d, d, false, device),
                    num_heads: self.shape.num_heads,
                    num_kv_heads: self.shape.num_kv_heads,
                    head_dim: e,
                },
                mlp_norm: RmsNorm::new(d, self.norm_eps, device),
                mlp: Mlp {
                    gate_proj: self.linear(d, self.shape.ffn_hidden, false, device),
                    up_proj: self.linear(d, self.shape.ffn_hidden, false, device),
                    down_proj: self.linear(self.shape.ffn_hidden, d, false, device),
                },
            })
            .collect();
        Llama {
            embed_tokens: EmbeddingConfig::new(self.shape.vocab_size, d)
                .with_initializer(Initializer::Normal { mean: 0.0, std: self.init_std })
                .init(device),
            layers,
            norm: RmsNorm::new(d, self.norm_eps, device),
            lm_head: (!self.shape.tied_embeddings).then(|| self.linear(d, self.shape.vocab_size, false, device)),
            rope_theta: self.rope_theta,
        }
    }
}

/// Root-mean-square normalisation with a learned scale, `x / sqrt(mean(x^2) + eps) * weight`.
#[derive(Module, Debug)]
pub struct RmsNorm {
    /// Scale, `[d]`, initialised to ones.
    pub weight: Param<Tensor<1>>,
    pub(crate) eps: f64,
}

impl RmsNorm {
    fn new(d: usize, eps: f64, device: &Device) -> Self {
        Self { weight: Param::from_tensor(Tensor::ones([d], device)), eps }
    }

    /// Normalises the last dim.
    pub fn forward<const D: usize>(&self, x: Tensor<D>) -> Tensor<D> {
        rms_norm(x, self.weight.val(), self.eps)
    }
}

/// Rotary position embedding tables for one sequence length.
#[derive(Clone, Debug)]
pub struct Rope {
    cos_se: Tensor<2>,
    sin_se: Tensor<2>,
}

impl Rope {
    /// Tables for positions `0..seq_len` and head dim `head_dim` (rotate-half layout:
    /// frequency i applies to dims i and i + e/2).
    pub fn new(seq_len: usize, head_dim: usize, theta: f64, device: &Device) -> Self {
        Self::positions(0, seq_len, head_dim, theta, device)
    }

    /// Tables for positions `start..start + len` (decoding with a KV cache).
    pub fn positions(start: usize, len: usize, head_dim: usize, theta: f64, device: &Device) -> Self {
        let (seq_len, half) = (len, head_dim / 2);
        let mut cos = Vec::with_capacity(seq_len * head_dim);
        let mut sin = Vec::with_capacity(seq_len * head_dim);
        for pos in start..start + len {
            for j in 0..head_dim {
                let i = j % half;
                let inv_freq = theta.powf(-((2 * i) as f64) / head_dim as f64);
                let angle = pos as f64 * inv_freq;
                cos.push(angle.cos() as f32);
                sin.push(angle.sin() as f32);
            }
        }
        let t = |v: Vec<f32>| traffic::upload(TensorData::new(v, [seq_len, head_dim]), device, traffic::Kind::Constants);
        Self { cos_se: t(cos), sin_se: t(sin) }
    }

    /// The tables in element type `dtype` (for products in bf16).
    pub fn cast(self, dtype: burn::tensor::FloatDType) -> Self {
        Self { cos_se: self.cos_se.cast(dtype), sin_se: self.sin_se.cast(dtype) }
    }

    /// The device of the tables.
    pub fn device(&self) -> Device {
        self.cos_se.device()
    }

    /// Rotates `x_bhse` by position.
    pub fn apply(&self, x_bhse: Tensor<4>) -> Tensor<4> {
        rope(x_bhse, &self.cos_se, &self.sin_se)
    }
}

/// `layer` applied to `x`, through the fused linear operation (one product per pass, written
/// straight into its output; Burn's `linear` where the fused one does not apply).
/// The weights take `x`'s element type (bf16 products under mixed precision; the cast's
/// backward pass returns their gradients in f32).
pub(crate) fn project<const D: usize>(layer: &Linear, x: Tensor<D>) -> Tensor<D> {
    let dtype = x.dtype();
    linear(x, layer.weight.val().cast(dtype), layer.bias.as_ref().map(|b| b.val().cast(dtype)))
}

/// Grouped-query causal self-attention.
#[derive(Module, Debug)]
pub struct Attention {
    /// `[d, h*e]`.
    pub q_proj: Linear,
    /// `[d, k*e]`.
    pub k_proj: Linear,
    /// `[d, k*e]`.
    pub v_proj: Linear,
    /// `[h*e, d]`.
    pub o_proj: Linear,
    pub(crate) num_heads: usize,
    pub(crate) num_kv_heads: usize,
    pub(crate) head_dim: usize,
}

impl Attention {
    /// Attention of `x_bsd` over itself with a causal mask. Head counts are those of this
    /// module's weights (a tensor-parallel shard holds fewer heads).
    pub fn forward(&self, x_bsd: Tensor<3>, rope: &Rope) -> Tensor<3> {
        self.attend(x_bsd, rope, 0, None)
    }

    /// Attention of `s` positions starting at `start` (`rope` holds their tables) over
    /// themselves and, with `cache`, the cached keys and values before them; appends this
    /// call's keys and values to the cache.
    fn attend(&self, x_bsd: Tensor<3>, rope: &Rope, start: usize, cache: Option<&mut Option<(Tensor<4>, Tensor<4>)>>) -> Tensor<3> {
        let [b, s, _] = x_bsd.dims();
        let e = self.head_dim;
        let [_, q_width] = self.q_proj.weight.dims();
        let [_, kv_width] = self.k_proj.weight.dims();
        let (h, k) = (q_width / e, kv_width / e);
        let q_bhse = rope.apply(project(&self.q_proj, x_bsd.clone()).reshape([b, s, h, e]).swap_dims(1, 2));
        let k_bkse = rope.apply(project(&self.k_proj, x_bsd.clone()).reshape([b, s, k, e]).swap_dims(1, 2));
        let v_bkse = project(&self.v_proj, x_bsd).reshape([b, s, k, e]).swap_dims(1, 2);
        // With a cache, the keys and values of every position so far, [b, k, start + s, e].
        let (k_bkte, v_bkte) = match cache {
            None => (k_bkse, v_bkse),
            Some(cache) => {
                let kv = match cache.take() {
                    Some((kc, vc)) => (Tensor::cat(vec![kc, k_bkse], 2), Tensor::cat(vec![vc, v_bkse], 2)),
                    None => (k_bkse, v_bkse),
                };
                *cache = Some(kv.clone());
                kv
            }
        };
        // Query head i reads kv head i / (h / k): each kv head's keys and values serve its query
        // heads without being copied (see `grouped_causal_attention`).
        project(&self.o_proj, grouped_causal_attention(q_bhse, k_bkte, v_bkte, 1.0 / (e as f64).sqrt(), start))
    }
}

/// Keys and values of the positions decoded so far, per layer (after RoPE), for generation.
#[derive(Clone, Debug, Default)]
pub struct KvCache {
    layers: Vec<Option<(Tensor<4>, Tensor<4>)>>,
    len: usize,
}

impl KvCache {
    /// An empty cache.
    pub fn new() -> Self {
        Self::default()
    }

    /// Positions held.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether no position is held.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// SwiGLU MLP, `down(silu(gate(x)) * up(x))`.
#[derive(Module, Debug)]
pub struct Mlp {
    /// `[d, f]`.
    pub gate_proj: Linear,
    /// `[d, f]`.
    pub up_proj: Linear,
    /// `[f, d]`.
    pub down_proj: Linear,
}

impl Mlp {
    /// Applies the MLP.
    pub fn forward(&self, x_bsd: Tensor<3>) -> Tensor<3> {
        project(&self.down_proj, swiglu(project(&self.gate_proj, x_bsd.clone()), project(&self.up_proj, x_bsd)))
    }
}

/// One pre-norm decoder layer.
#[derive(Module, Debug)]
pub struct DecoderLayer {
    /// Norm before attention.
    pub attn_norm: RmsNorm,
    /// Self-attention.
    pub attn: Attention,
    /// Norm before the MLP.
    pub mlp_norm: RmsNorm,
    /// MLP.
    pub mlp: Mlp,
}

impl DecoderLayer {
    /// `x + attn(norm(x))`, then `h + mlp(norm(h))`.
    pub fn forward(&self, x_bsd: Tensor<3>, rope: &Rope) -> Tensor<3> {
        self.forward_from(x_bsd, rope, 0, None)
    }

    /// [`DecoderLayer::forward`] of positions from `start`, attending to `cache` too.
    fn forward_from(&self, x_bsd: Tensor<3>, rope: &Rope, start: usize, cache: Option<&mut Option<(Tensor<4>, Tensor<4>)>>) -> Tensor<3> {
        let h_bsd = x_bsd.clone() + self.attn.attend(self.attn_norm.forward(x_bsd), rope, start, cache);
        h_bsd.clone() + self.mlp.forward(self.mlp_norm.forward(h_bsd))
    }
}

/// The decoder.
#[derive(Module, Debug)]
pub struct Llama {
    /// Token embedding `[v, d]`.
    pub embed_tokens: Embedding,
    /// Decoder layers.
    pub layers: Vec<DecoderLayer>,
    /// Final norm.
    pub norm: RmsNorm,
    /// LM head `[d, v]`; `None` when tied to the embedding.
    pub lm_head: Option<Linear>,
    rope_theta: f64,
}

impl Llama {
    /// RoPE tables for a sequence length on this model's device.
    pub fn rope(&self, seq_len: usize) -> Rope {
        let e = self.layers.first().map_or(2, |l| l.attn.head_dim);
        Rope::new(seq_len, e, self.rope_theta, &self.embed_tokens.weight.device())
    }

    /// Hidden states after the final norm, `[b, s, d]`.
    pub fn hidden(&self, tokens_bs: Tensor<2, Int>) -> Tensor<3> {
        let [_, s] = tokens_bs.dims();
        let rope = self.rope(s);
        let mut x_bsd = self.embed_tokens.forward(tokens_bs);
        for layer in &self.layers {
            x_bsd = layer.forward(x_bsd, &rope);
        }
        self.norm.forward(x_bsd)
    }

    /// Projects hidden states to logits `[b, s, v]`.
    pub fn head(&self, x_bsd: Tensor<3>) -> Tensor<3> {
        match &self.lm_head {
            Some(head) => project(head, x_bsd),
            None => {
                let [b, s, d] = x_bsd.dims();
                let w_vd = self.embed_tokens.weight.val();
                let [v, _] = w_vd.dims();
                x_bsd.reshape([b * s, d]).matmul(w_vd.transpose()).reshape([b, s, v])
            }
        }
    }

    /// Logits `[b, s, v]` of next-token prediction.
    pub fn forward(&self, tokens_bs: Tensor<2, Int>) -> Tensor<3> {
        self.head(self.hidden(tokens_bs))
    }

    /// Logits `[b, s, v]` of `tokens_bs`, which follow the positions `cache` holds; adds their
    /// keys and values to it. Equal to the last `s` positions of [`Llama::forward`] over the
    /// whole sequence, at the cost of the new positions only.
    pub fn forward_cached(&self, tokens_bs: Tensor<2, Int>, cache: &mut KvCache) -> Tensor<3> {
        let [_, s] = tokens_bs.dims();
        let start = cache.len;
        let e = self.layers.first().map_or(2, |l| l.attn.head_dim);
        let rope = Rope::positions(start, s, e, self.rope_theta, &self.embed_tokens.weight.device());
        cache.layers.resize(self.layers.len(), None);
        let mut x_bsd = self.embed_tokens.forward(tokens_bs);
        for (layer, kv) in self.layers.iter().zip(cache.layers.iter_mut()) {
            x_bsd = layer.forward_from(x_bsd, &rope, start, Some(kv));
        }
        cache.len += s;
        self.head(self.norm.forward(x_bsd))
    }

    /// A model from its parts (the HF import builds one from named weights).
    pub(crate) fn assemble(
        embed_tokens: Embedding,
        layers: Vec<DecoderLayer>,
        norm: RmsNorm,
        lm_head: Option<Linear>,
        rope_theta: f64,
    ) -> Self {
        Self { embed_tokens, layers, norm, lm_head, rope_theta }
    }

    /// Summed next-token cross entropy over every position, `[1]`: divide by the number of
    /// target tokens of the whole step to get the mean.
    pub fn loss_sum(&self, inputs_bs: Tensor<2, Int>, targets_bs: Tensor<2, Int>) -> Tensor<1> {
        cross_entropy_sum(self.forward(inputs_bs), targets_bs)
    }
}

impl CausalLm for Llama {
    fn loss_sum(&self, inputs: Tensor<2, Int>, targets: Tensor<2, Int>) -> Tensor<1> {
        Llama::loss_sum(self, inputs, targets)
    }
    fn no_decay_predicates(&self) -> Vec<String> {
        vec!["norm".into(), "embed_tokens".into()]
    }
}
