//! Shapes of Llama-style decoders: parameter and FLOP counts, presets, and the declarative
//! sharding spec of every parameter (the one source that slicing, checkpoints and resharding
//! share).
//!
//! Weights follow Burn's `Linear` convention `[d_input, d_output]`: a column-parallel weight
//! splits dim 1, a row-parallel weight dim 0; the embedding `[vocab, hidden]` splits dim 0.

use serde::{Deserialize, Serialize};
use thiserror::Error;

/// The largest value any one model size (layers, widths, vocabulary, sequence length) may take:
/// far beyond any model trained here, small enough that parameter counts, activation sizes and
/// `batch x seq_len` products stay inside 64 bits.
pub const MAX_SIZE: usize = 1 << 20;

/// Why a model description is not usable.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum ModelError {
    /// A size beyond [`MAX_SIZE`] (products of sizes could overflow).
    #[error("model field `{field}` = {value} exceeds the limit of {MAX_SIZE}")]
    TooLarge {
        /// The [`ModelSpec`] field at fault (`hidden`, `vocab_size`, ...).
        field: &'static str,
        /// The value it has.
        value: usize,
    },
    /// A size that must be positive is zero.
    #[error("model field `{field}` must be at least 1, got 0")]
    Zero {
        /// The [`ModelSpec`] field that is zero.
        field: &'static str,
    },
    /// hidden is not a multiple of the number of heads.
    #[error("hidden ({hidden}) must be a multiple of num_heads ({num_heads})")]
    HeadDim {
        /// The model width (`hidden`) given.
        hidden: usize,
        /// The number of query heads given.
        num_heads: usize,
    },
    /// The query heads are not a multiple of the key/value heads (grouped-query attention).
    #[error("num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")]
    Groups {
        /// The number of query heads given.
        num_heads: usize,
        /// The number of key/value heads given.
        num_kv_heads: usize,
    },
    /// The head dimension must be even for rotary embeddings.
    #[error("head dimension hidden / num_heads = {head_dim} must be even for rotary embeddings")]
    OddHeadDim {
        /// `hidden / num_heads`, the odd head dimension.
        head_dim: usize,
    },
    /// No preset has this name.
    #[error("unknown model preset `{name}`; allowed: {allowed}")]
    UnknownPreset {
        /// The name asked for.
        name: String,
        /// The preset names there are, comma-separated ([`ModelSpec::PRESETS`]).
        allowed: String,
    },
}

/// The shape of a Llama-style decoder (RMSNorm, RoPE, grouped-query attention, SwiGLU MLP).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ModelSpec {
    /// Preset or user name, for reports.
    pub name: String,
    /// Number of decoder layers (what pipeline stages divide among themselves).
    pub num_layers: usize,
    /// Model width (d_model).
    pub hidden: usize,
    /// Number of query heads; `hidden / num_heads` is the head dimension.
    pub num_heads: usize,
    /// Key/value heads (grouped-query attention; equal to `num_heads` for plain MHA).
    pub num_kv_heads: usize,
    /// SwiGLU inner width (the gate, up and down projections' other side).
    pub ffn_hidden: usize,
    /// Number of token ids: rows of the embedding, outputs of the LM head.
    pub vocab_size: usize,
    /// Training sequence length in tokens.
    pub seq_len: usize,
    /// Whether the LM head shares the embedding matrix.
    pub tied_embeddings: bool,
    /// Whether q/k/v projections carry biases (Qwen2 family).
    pub qkv_bias: bool,
}

/// Where a parameter lives along the pipeline.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Placement {
    /// Inside decoder layer `i`: on the stage that holds that layer.
    Layer(usize),
    /// Before the first layer (token embedding): stage 0.
    First,
    /// After the last layer (final norm, LM head): the last stage.
    Last,
    /// On the first and the last stage (a tied embedding under pipeline parallelism).
    FirstAndLast,
}

/// How one parameter is split across the tp axis.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum TpSplit {
    /// Every tp rank holds the whole tensor.
    Replicated,
    /// The tensor is split along `dim`; with `chunks > 1` the dim is first cut into `chunks`
    /// equal contiguous blocks (a fused weight such as q|k|v) and each block is split across tp.
    Split {
        /// The tensor dimension that is split.
        dim: usize,
        /// Contiguous blocks of a fused weight (1 for a plain weight).
        chunks: usize,
    },
}

/// The sharding spec of one parameter.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ParamSpec {
    /// Llama-style name, e.g. `layers.3.attn.q_proj.weight`.
    pub name: String,
    /// Full (unsharded) shape.
    pub shape: Vec<usize>,
    /// How the tensor is split across the tp ranks, or replicated on them.
    pub tp: TpSplit,
    /// Which pipeline stages hold the parameter.
    pub placement: Placement,
}

impl ParamSpec {
    /// Number of elements of the full tensor.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
}

/// Parameter counts of a model.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ParamCounts {
    /// Parameters of the token embedding, `vocab_size * hidden`.
    pub embedding: u64,
    /// Parameters of one decoder layer: attention, MLP and its two norms.
    pub per_layer: u64,
    /// Parameters of the final norm, `hidden`.
    pub final_norm: u64,
    /// Parameters of the LM head (0 when tied to the embedding).
    pub lm_head: u64,
    /// Parameters of the whole model, each counted once.
    pub total: u64,
}

impl ModelSpec {
    /// Checks the shape is a usable Llama-style decoder.
    pub fn validate(&self) -> Result<(), ModelError> {
        for (field, v) in [
            ("num_layers", self.num_layers),
            ("hidden", self.hidden),
            ("num_heads", self.num_heads),
            ("num_kv_heads", self.num_kv_heads),
            ("ffn_hidden", self.ffn_hidden),
            ("vocab_size", self.vocab_size),
            ("seq_len", self.seq_len),
        ] {
            if v == 0 {
                return Err(ModelError::Zero { field });
            }
            if v > MAX_SIZE {
                return Err(ModelError::TooLarge { field, value: v });
            }
        }
        if !self.hidden.is_multiple_of(self.num_heads) {
            return Err(ModelError::HeadDim { hidden: self.hidden, num_heads: self.num_heads });
        }
        if !self.num_heads.is_multiple_of(self.num_kv_heads) {
            return Err(ModelError::Groups { num_heads: self.num_heads, num_kv_heads: self.num_kv_heads });
        }
        if !self.head_dim().is_multiple_of(2) {
            return Err(ModelError::OddHeadDim { head_dim: self.head_dim() });
        }
        Ok(())
    }

    /// Width of one attention head.
    pub fn head_dim(&self) -> usize {
        self.hidden / self.num_heads
    }

    /// Width of the key (and value) projection output, `num_kv_heads * head_dim`.
    pub fn kv_dim(&self) -> usize {
        self.num_kv_heads * self.head_dim()
    }

    /// Parameter counts, from the shapes.
    pub fn param_counts(&self) -> ParamCounts {
        let h = self.hidden as u64;
        let kv = self.kv_dim() as u64;
        let f = self.ffn_hidden as u64;
        let v = self.vocab_size as u64;
        let attn = h * h + 2 * h * kv + h * h + if self.qkv_bias { h + 2 * kv } else { 0 };
        let mlp = 3 * h * f;
        let per_layer = attn + mlp + 2 * h;
        let embedding = v * h;
        let lm_head = if self.tied_embeddings { 0 } else { v * h };
        let total = embedding + per_layer * self.num_layers as u64 + h + lm_head;
        ParamCounts { embedding, per_layer, final_norm: h, lm_head, total }
    }

    /// Parameters of the whole model, each counted once ([`ParamCounts::total`]).
    pub fn num_params(&self) -> u64 {
        self.param_counts().total
    }

    /// Training FLOPs per token: 6 per weight that multiplies an activation (every matrix
    /// including the LM head, not the embedding lookup) plus attention scores and values,
    /// `6 * 2 * layers * seq * hidden` halved for the causal mask (forward 1/3, backward 2/3).
    pub fn train_flops_per_token(&self) -> f64 {
        let c = self.param_counts();
        let h = self.hidden as f64;
        let matmul_params = (c.per_layer * self.num_layers as u64) as f64 + (self.vocab_size as f64) * h;
        let attention = 6.0 * self.num_layers as f64 * self.seq_len as f64 * h;
        6.0 * matmul_params + attention
    }

    /// The sharding spec of every parameter, in model order. The element counts add up to
    /// [`ModelSpec::num_params`] (a tied embedding is listed once).
    pub fn param_specs(&self) -> Vec<ParamSpec> {
        let h = self.hidden;
        let kv = self.kv_dim();
        let f = self.ffn_hidden;
        let v = self.vocab_size;
        let col = TpSplit::Split { dim: 1, chunks: 1 };
        let row = TpSplit::Split { dim: 0, chunks: 1 };
        let vec_split = TpSplit::Split { dim: 0, chunks: 1 };
        let p = |name: String, shape: Vec<usize>, tp, placement| ParamSpec { name, shape, tp, placement };
        let mut out = vec![p(
            "embed_tokens.weight".into(),
            vec![v, h],
            TpSplit::Split { dim: 0, chunks: 1 },
            if self.tied_embeddings { Placement::FirstAndLast } else { Placement::First },
        )];
        for i in 0..self.num_layers {
            let at = Placement::Layer(i);
            let n = |s: &str| format!("layers.{i}.{s}");
            out.push(p(n("attn_norm.weight"), vec![h], TpSplit::Replicated, at));
            out.push(p(n("attn.q_proj.weight"), vec![h, h], col, at));
            out.push(p(n("attn.k_proj.weight"), vec![h, kv], col, at));
            out.push(p(n("attn.v_proj.weight"), vec![h, kv], col, at));
            if self.qkv_bias {
                out.push(p(n("attn.q_proj.bias"), vec![h], vec_split, at));
                out.push(p(n("attn.k_proj.bias"), vec![kv], vec_split, at));
                out.push(p(n("attn.v_proj.bias"), vec![kv], vec_split, at));
            }
            out.push(p(n("attn.o_proj.weight"), vec![h, h], row, at));
            out.push(p(n("mlp_norm.weight"), vec![h], TpSplit::Replicated, at));
            out.push(p(n("mlp.gate_proj.weight"), vec![h, f], col, at));
            out.push(p(n("mlp.up_proj.weight"), vec![h, f], col, at));
            out.push(p(n("mlp.down_proj.weight"), vec![f, h], row, at));
        }
        out.push(p("norm.weight".into(), vec![h], TpSplit::Replicated, Placement::Last));
        if !self.tied_embeddings {
            out.push(p("lm_head.weight".into(), vec![h, v], col, Placement::Last));
        }
        out
    }

    /// Names of the presets accepted by [`ModelSpec::preset`].
    pub const PRESETS: [&'static str; 9] =
        ["tiny-1m", "tiny-5m", "tiny-20m", "small-100m", "tinyllama-1.1b", "llama-3.2-3b", "llama-2-7b", "llama-2-13b", "qwen2.5-32b"];

    /// A preset by name.
    pub fn preset(name: &str) -> Result<Self, ModelError> {
        Ok(match name {
            "tiny-1m" => Self::tiny_1m(),
            "tiny-5m" => Self::tiny_5m(),
            "tiny-20m" => Self::tiny_20m(),
            "small-100m" => Self::small_100m(),
            "tinyllama-1.1b" => Self::tinyllama_1_1b(),
            "llama-3.2-3b" => Self::llama_3_2_3b(),
            "llama-2-7b" => Self::llama_2_7b(),
            "llama-2-13b" => Self::llama_2_13b(),
            "qwen2.5-32b" => Self::qwen2_5_32b(),
            _ => {
                return Err(ModelError::UnknownPreset { name: name.to_string(), allowed: Self::PRESETS.join(", ") });
            }
        })
    }

    /// A Llama-style shape (no qkv bias): layers, width, heads, key/value heads, SwiGLU width,
    /// vocabulary, sequence length and whether the embeddings are tied.
    #[allow(clippy::too_many_arguments)]
    pub fn shape(
        name: &str,
        num_layers: usize,
        hidden: usize,
        num_heads: usize,
        num_kv_heads: usize,
        ffn_hidden: usize,
        vocab_size: usize,
        seq_len: usize,
        tied_embeddings: bool,
    ) -> Self {
        Self {
            name: name.into(),
            num_layers,
            hidden,
            num_heads,
            num_kv_heads,
            ffn_hidden,
            vocab_size,
            seq_len,
            tied_embeddings,
            qkv_bias: false,
        }
    }

    /// About 1M parameters: 4 layers, width 128, 8 heads, 4 kv heads, tied (CPU tests).
    pub fn tiny_1m() -> Self {
        Self::shape("tiny-1m", 4, 128, 8, 4, 344, 2048, 128, true)
    }

    /// About 5M parameters: 4 layers, width 256, 8 heads, 4 kv heads, untied, vocab 4096.
    pub fn tiny_5m() -> Self {
        Self::shape("tiny-5m", 4, 256, 8, 4, 688, 4096, 256, false)
    }

    /// About 22M parameters: 6 layers, width 512, 8 heads, 4 kv heads, untied, vocab 4096.
    pub fn tiny_20m() -> Self {
        Self::shape("tiny-20m", 6, 512, 8, 4, 1376, 4096, 256, false)
    }

    /// About 100M parameters: 12 layers, width 768, 12 heads, 4 kv heads, untied, vocab 8192.
    pub fn small_100m() -> Self {
        Self::shape("small-100m", 12, 768, 12, 4, 2048, 8192, 512, false)
    }

    /// TinyLlama-1.1B's shape: 1.10B parameters, 22 layers, width 2048, 32 heads, 4 kv heads,
    /// SwiGLU 5632, vocab 32000, sequence 2048, untied.
    pub fn tinyllama_1_1b() -> Self {
        Self::shape("tinyllama-1.1b", 22, 2048, 32, 4, 5632, 32_000, 2048, false)
    }

    /// Llama-3.2-3B: 3.21B parameters, tied embeddings.
    pub fn llama_3_2_3b() -> Self {
        Self::shape("llama-3.2-3b", 28, 3072, 24, 8, 8192, 128_256, 4096, true)
    }

    /// Llama-2-7B: 6.74B parameters.
    pub fn llama_2_7b() -> Self {
        Self::shape("llama-2-7b", 32, 4096, 32, 32, 11_008, 32_000, 4096, false)
    }

    /// Llama-2-13B: 13.0B parameters.
    pub fn llama_2_13b() -> Self {
        Self::shape("llama-2-13b", 40, 5120, 40, 40, 13_824, 32_000, 4096, false)
    }

    /// Qwen2.5-32B: 32.8B parameters, q/k/v biases.
    pub fn qwen2_5_32b() -> Self {
        Self { qkv_bias: true, ..Self::shape("qwen2.5-32b", 64, 5120, 40, 8, 27_648, 152_064, 4096, false) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn within(got: u64, published: f64, rel: f64) -> bool {
        ((got as f64 - published) / published).abs() <= rel
    }

    #[test]
    fn presets_match_published_parameter_counts() {
        // Published totals (model cards): 3.21B, 6.74B, 13.0B, 32.8B; within 1%.
        for (spec, published) in [
            (ModelSpec::llama_3_2_3b(), 3.21e9),
            (ModelSpec::llama_2_7b(), 6.74e9),
            (ModelSpec::llama_2_13b(), 13.0e9),
            (ModelSpec::qwen2_5_32b(), 32.8e9),
        ] {
            spec.validate().unwrap();
            let n = spec.num_params();
            assert!(within(n, published, 0.01), "{}: {n} vs {published}", spec.name);
        }
    }

    #[test]
    fn llama_2_7b_count_by_hand() {
        // 32 * (4 * 4096^2 + 3 * 4096 * 11008 + 2 * 4096) + 2 * 32000 * 4096 + 4096.
        let by_hand: u64 = 32 * (4 * 4096 * 4096 + 3 * 4096 * 11008 + 2 * 4096) + 2 * 32000 * 4096 + 4096;
        assert_eq!(ModelSpec::llama_2_7b().num_params(), by_hand);
        assert_eq!(by_hand, 6_738_415_616);
    }

    /// TinyLlama-1.1B's published count, 1,100,048,384, by hand: 22 layers of q and o
    /// (2048^2 each), k and v (2048 x 256 each: 4 kv heads of 64), SwiGLU (3 x 2048 x 5632) and
    /// two norms, the untied embedding and head, the final norm.
    #[test]
    fn tinyllama_count_by_hand() {
        let layer: u64 = 2 * 2048 * 2048 + 2 * 2048 * 256 + 3 * 2048 * 5632 + 2 * 2048;
        let by_hand = 22 * layer + 2 * 32_000 * 2048 + 2048;
        assert_eq!(by_hand, 1_100_048_384);
        assert_eq!(ModelSpec::tinyllama_1_1b().num_params(), by_hand);
        ModelSpec::preset("tinyllama-1.1b").unwrap().validate().unwrap();
    }

    #[test]
    fn tiny_presets_are_about_their_names() {
        for (spec, target) in
            [(ModelSpec::tiny_1m(), 1e6), (ModelSpec::tiny_5m(), 5e6), (ModelSpec::tiny_20m(), 20e6), (ModelSpec::small_100m(), 100e6)]
        {
            spec.validate().unwrap();
            let n = spec.num_params() as f64;
            assert!(n > 0.75 * target && n < 1.25 * target, "{}: {n}", spec.name);
        }
    }

    #[test]
    fn param_specs_add_up_to_the_count() {
        for name in ModelSpec::PRESETS {
            let m = ModelSpec::preset(name).unwrap();
            let sum: u64 = m.param_specs().iter().map(|p| p.numel() as u64).sum();
            assert_eq!(sum, m.num_params(), "{name}");
        }
    }

    #[test]
    fn bad_shapes_and_names_are_errors() {
        let mut m = ModelSpec::tiny_1m();
        m.num_kv_heads = 3;
        assert_eq!(m.validate(), Err(ModelError::Groups { num_heads: 8, num_kv_heads: 3 }));
        m.num_kv_heads = 0;
        assert_eq!(m.validate(), Err(ModelError::Zero { field: "num_kv_heads" }));
        let huge = ModelSpec { seq_len: usize::MAX, ..ModelSpec::tiny_1m() };
        assert_eq!(huge.validate(), Err(ModelError::TooLarge { field: "seq_len", value: usize::MAX }));
        let e = ModelSpec::preset("llama-9").unwrap_err().to_string();
        assert!(e.contains("llama-9") && e.contains("tiny-5m"), "{e}");
    }

    #[test]
    fn flops_per_token_is_about_six_n() {
        // For a large model with a short context the 6N rule dominates.
        let m = ModelSpec::llama_2_7b();
        let ratio = m.train_flops_per_token() / (6.0 * m.num_params() as f64);
        assert!((0.95..1.2).contains(&ratio), "{ratio}");
    }
}
