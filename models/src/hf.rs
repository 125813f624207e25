//! The Hugging Face Llama layout: export a model as a directory `LlamaForCausalLM` loads
//! (`config.json`, `model.safetensors` under HF names with `[out, in]` linear weights), and
//! import such a directory into a copus [`Llama`].
//!
//! Names map one to one: `embed_tokens.weight` -> `model.embed_tokens.weight`,
//! `layers.{i}.attn.{q,k,v,o}_proj.*` -> `model.layers.{i}.self_attn.{q,k,v,o}_proj.*`,
//! `layers.{i}.attn_norm.weight` -> `model.layers.{i}.input_layernorm.weight`,
//! `layers.{i}.mlp_norm.weight` -> `model.layers.{i}.post_attention_layernorm.weight`,
//! `layers.{i}.mlp.*` -> `model.layers.{i}.mlp.*`, `norm.weight` -> `model.norm.weight`,
//! `lm_head.weight` -> `lm_head.weight`. Linear weights are stored `[d_in, d_out]` in Burn and
//! `[out, in]` in HF, so they are transposed both ways; the embedding is `[v, d]` in both. RoPE
//! is rotate-half in both, so q/k rows need no permutation.

use std::collections::HashMap;
use std::path::Path;

use burn::tensor::{Device, TensorData};
use copus_burn::ParallelLm;
use copus_burn::parallel::{ShardError, ShardPlan, ShardSource};
use copus_core::layout::ParallelDims;
use copus_core::model::ModelSpec;
use thiserror::Error;

use crate::llama::{Llama, LlamaConfig};

/// Why an export or import failed.
#[derive(Debug, Error)]
pub enum HfError {
    /// Reading or writing a file.
    #[error("{path}: {message}")]
    Io {
        /// File.
        path: String,
        /// What went wrong.
        message: String,
    },
    /// A `config.json` field that is missing or not what a supported Llama has.
    #[error("config.json field `{field}`: {message}")]
    Config {
        /// The field.
        field: String,
        /// What is wrong.
        message: String,
    },
    /// A weight that is missing, extra, or of the wrong shape or type.
    #[error("model.safetensors tensor `{name}`: {message}")]
    Tensor {
        /// HF name.
        name: String,
        /// What is wrong.
        message: String,
    },
    /// The model cannot be written in this layout.
    #[error("{0}")]
    Unsupported(String),
}

fn io(path: &Path) -> impl Fn(std::io::Error) -> HfError + '_ {
    move |e| HfError::Io { path: path.display().to_string(), message: e.to_string() }
}

/// The HF name of a copus parameter, and whether its values are transposed on the way.
pub fn hf_name(name: &str) -> Option<(String, bool)> {
    if name == "embed_tokens.weight" || name == "norm.weight" {
        return Some((format!("model.{name}"), false));
    }
    if name == "lm_head.weight" {
        return Some((name.into(), true));
    }
    let rest = name.strip_prefix("layers.")?;
    let (i, rest) = rest.split_once('.')?;
    i.parse::<usize>().ok()?;
    let (hf, transpose) = match rest {
        "attn_norm.weight" => ("input_layernorm.weight".to_string(), false),
        "mlp_norm.weight" => ("post_attention_layernorm.weight".to_string(), false),
        r if r.starts_with("attn.") && r.ends_with(".weight") => (format!("self_attn.{}", &r[5..]), true),
        r if r.starts_with("attn.") && r.ends_with(".bias") => (format!("self_attn.{}", &r[5..]), false),
        r if r.starts_with("mlp.") && r.ends_with(".weight") => (r.to_string(), true),
        _ => return None,
    };
    Some((format!("model.layers.{i}.{hf}"), transpose))
}

fn transpose(values: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    let mut out = vec![0f32; values.len()];
    for r in 0..rows {
        for c in 0..cols {
            out[c * rows + r] = values[r * cols + c];
        }
    }
    out
}

/// The `config.json` of a model of `cfg` (`eos`: the end-of-text token id, when the tokenizer
/// has one; it also serves as bos).
pub fn hf_config(cfg: &LlamaConfig, eos: Option<u32>) -> Result<serde_json::Value, HfError> {
    if cfg.shape.qkv_bias {
        return Err(HfError::Unsupported(
            "a model with q/k/v biases (`qkv_bias`) is Qwen2-style; HF Llama's `attention_bias` would also add one to o_proj".into(),
        ));
    }
    let mut c = serde_json::json!({
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": cfg.shape.hidden,
        "intermediate_size": cfg.shape.ffn_hidden,
        "num_hidden_layers": cfg.shape.num_layers,
        "num_attention_heads": cfg.shape.num_heads,
        "num_key_value_heads": cfg.shape.num_kv_heads,
        "head_dim": cfg.shape.hidden / cfg.shape.num_heads,
        "vocab_size": cfg.shape.vocab_size,
        "max_position_embeddings": cfg.shape.seq_len,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "tie_word_embeddings": cfg.shape.tied_embeddings,
        "hidden_act": "silu",
        "attention_bias": false,
        "mlp_bias": false,
        "torch_dtype": "float32",
    });
    // Without an end-of-text token, null (HF's Llama defaults of 1 and 2 would be wrong).
    let id = eos.map_or(serde_json::Value::Null, serde_json::Value::from);
    c["bos_token_id"] = id.clone();
    c["eos_token_id"] = id;
    Ok(c)
}

/// The copus configuration of an HF `config.json`; an unsupported architecture or a missing
/// field is an error naming the field.
pub fn config_from_hf(c: &serde_json::Value) -> Result<LlamaConfig, HfError> {
    let bad = |field: &str, message: String| HfError::Config { field: field.into(), message };
    let uint = |field: &str| -> Result<usize, HfError> {
        c.get(field).and_then(|v| v.as_u64()).map(|v| v as usize).ok_or_else(|| bad(field, "missing or not a whole number".into()))
    };
    let archs = c.get("architectures").and_then(|a| a.as_array());
    if !archs.is_some_and(|a| a.iter().any(|x| x == "LlamaForCausalLM")) {
        return Err(bad("architectures", format!("{:?}; only LlamaForCausalLM is supported", c.get("architectures"))));
    }
    if let Some(act) = c.get("hidden_act").and_then(|v| v.as_str())
        && act != "silu"
    {
        return Err(bad("hidden_act", format!("{act:?}; the model's MLP is SwiGLU (`silu`)")));
    }
    for flag in ["attention_bias", "mlp_bias"] {
        if c.get(flag).and_then(|v| v.as_bool()) == Some(true) {
            return Err(bad(flag, "true; this model has no attention or MLP biases".into()));
        }
    }
    if let Some(s) = c.get("rope_scaling").filter(|v| !v.is_null()) {
        return Err(bad("rope_scaling", format!("{s}; only plain RoPE is supported")));
    }
    let (hidden, heads) = (uint("hidden_size")?, uint("num_attention_heads")?);
    if let Some(e) = c.get("head_dim").and_then(|v| v.as_u64())
        && heads > 0
        && (e as usize).checked_mul(heads) != Some(hidden)
    {
        return Err(bad("head_dim", format!("{e}; this model needs hidden_size / num_attention_heads = {}", hidden / heads)));
    }
    // Newer configs keep RoPE settings under `rope_parameters`.
    let rope = c.get("rope_parameters").filter(|v| v.is_object());
    if let Some(t) = rope.and_then(|r| r.get("rope_type")).and_then(|v| v.as_str())
        && t != "default"
    {
        return Err(bad("rope_parameters.rope_type", format!("{t:?}; only plain RoPE (`default`) is supported")));
    }
    let rope_theta = rope.and_then(|r| r.get("rope_theta")).or_else(|| c.get("rope_theta")).and_then(|v| v.as_f64()).unwrap_or(10000.0);
    let kv = c.get("num_key_value_heads").and_then(|v| v.as_u64()).map_or(heads, |v| v as usize);
    let shape = ModelSpec {
        name: "llama".into(),
        num_layers: uint("num_hidden_layers")?,
        hidden,
        num_heads: heads,
        num_kv_heads: kv,
        ffn_hidden: uint("intermediate_size")?,
        vocab_size: uint("vocab_size")?,
        seq_len: uint("max_position_embeddings")?,
        tied_embeddings: c.get("tie_word_embeddings").and_then(|v| v.as_bool()).unwrap_or(false),
        qkv_bias: false,
    };
    let cfg =
        LlamaConfig::new(shape).with_rope_theta(rope_theta).with_norm_eps(c.get("rms_norm_eps").and_then(|v| v.as_f64()).unwrap_or(1e-6));
    cfg.spec("llama").validate().map_err(|e| bad("(shape)", e.to_string()))?;
    Ok(cfg)
}

/// Every parameter of `model` as `(copus name, shape, values)`.
fn params(model: &Llama) -> Vec<(String, Vec<usize>, Vec<f32>)> {
    copus_burn::parallel::named_params(model).into_iter().map(|(n, _, s, v)| (n, s, v)).collect()
}

/// Writes `config.json` and `model.safetensors` (f32, HF names and orientation) to `dir`.
pub fn export(model: &Llama, cfg: &LlamaConfig, dir: &Path, eos: Option<u32>) -> Result<(), HfError> {
    let config = hf_config(cfg, eos)?;
    std::fs::create_dir_all(dir).map_err(io(dir))?;
    let mut tensors: Vec<(String, Vec<usize>, Vec<u8>)> = Vec::new();
    for (name, shape, values) in params(model) {
        let (hf, t) = hf_name(&name).ok_or_else(|| HfError::Unsupported(format!("parameter `{name}` has no HF Llama name")))?;
        let (shape, values) = if t { (vec![shape[1], shape[0]], transpose(&values, shape[0], shape[1])) } else { (shape, values) };
        tensors.push((hf, shape, values.iter().flat_map(|v| v.to_le_bytes()).collect()));
    }
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = tensors
        .iter()
        .map(|(n, s, b)| {
            let view = safetensors::tensor::TensorView::new(safetensors::Dtype::F32, s.clone(), b)
                .map_err(|e| HfError::Tensor { name: n.clone(), message: e.to_string() })?;
            Ok((n.clone(), view))
        })
        .collect::<Result<_, HfError>>()?;
    let meta = HashMap::from([("format".to_string(), "pt".to_string())]);
    let path = dir.join("model.safetensors");
    safetensors::serialize_to_file(views, Some(meta), &path)
        .map_err(|e| HfError::Io { path: path.display().to_string(), message: e.to_string() })?;
    let cpath = dir.join("config.json");
    let text =
        serde_json::to_string_pretty(&config).map_err(|e| HfError::Io { path: cpath.display().to_string(), message: e.to_string() })?;
    std::fs::write(&cpath, text + "\n").map_err(io(&cpath))
}

/// The values of a safetensors tensor as f32 (f32, bf16 and f16 are read).
fn to_f32(name: &str, view: &safetensors::tensor::TensorView<'_>) -> Result<Vec<f32>, HfError> {
    let data = view.data();
    let out = match view.dtype() {
        safetensors::Dtype::F32 => data.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect(),
        safetensors::Dtype::BF16 => data.chunks_exact(2).map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
        safetensors::Dtype::F16 => data.chunks_exact(2).map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
        other => return Err(HfError::Tensor { name: name.into(), message: format!("dtype {other:?}; F32, BF16 or F16 expected") }),
    };
    Ok(out)
}

/// Reads an HF Llama directory (`config.json`, `model.safetensors`) into a model on `device`.
/// Every parameter must be present with its shape, and nothing else (a `rotary_emb.inv_freq`
/// buffer, which some exports carry, is ignored).
pub fn import(dir: &Path, device: &Device) -> Result<(LlamaConfig, Llama), HfError> {
    let cpath = dir.join("config.json");
    let text = std::fs::read_to_string(&cpath).map_err(io(&cpath))?;
    let config: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| HfError::Io { path: cpath.display().to_string(), message: e.to_string() })?;
    let cfg = config_from_hf(&config)?;
    let path = dir.join("model.safetensors");
    let bytes = std::fs::read(&path).map_err(io(&path))?;
    let st = safetensors::SafeTensors::deserialize(&bytes)
        .map_err(|e| HfError::Io { path: path.display().to_string(), message: e.to_string() })?;
    let mut by_hf: HashMap<String, (String, bool, Vec<usize>)> = HashMap::new();
    for p in cfg.param_specs() {
        let (hf, t) = hf_name(&p.name).ok_or_else(|| HfError::Unsupported(format!("parameter `{}` has no HF Llama name", p.name)))?;
        by_hf.insert(hf, (p.name, t, p.shape));
    }
    let mut shards = HashMap::new();
    for (name, view) in st.tensors() {
        // RoPE buffers some exports carry, and a tied head written out anyway.
        if name.ends_with("rotary_emb.inv_freq") || (cfg.shape.tied_embeddings && name == "lm_head.weight") {
            continue;
        }
        let Some((copus, t, shape)) = by_hf.remove(&name) else {
            return Err(HfError::Tensor { name, message: "not a parameter of a model of this config.json (an extra tensor)".into() });
        };
        let want: Vec<usize> = if t { vec![shape[1], shape[0]] } else { shape.clone() };
        if view.shape() != want.as_slice() {
            return Err(HfError::Tensor { name, message: format!("shape {:?}; config.json implies {want:?}", view.shape()) });
        }
        let values = to_f32(&name, &view)?;
        let values = if t { transpose(&values, want[0], want[1]) } else { values };
        shards.insert(copus, TensorData::new(values, shape));
    }
    if let Some(missing) = by_hf.keys().min() {
        return Err(HfError::Tensor { name: missing.clone(), message: "missing".into() });
    }
    let model = from_params(&cfg, shards, device).map_err(|e| HfError::Unsupported(e.to_string()))?;
    Ok((cfg, model))
}

/// Builds a model of `cfg` from full parameters by copus name: the serial layout's one stage
/// (the engine's own builder) as a whole model.
pub fn from_params(cfg: &LlamaConfig, params: HashMap<String, TensorData>, device: &Device) -> Result<Llama, ShardError> {
    let mut src = ShardSource::new(params);
    let plan = ShardPlan::new(ParallelDims::serial(), 0, 0, cfg.shape.num_layers);
    let stage = cfg.build_stage(&plan, &mut src, device)?;
    if let Some(extra) = src.remaining().first() {
        return Err(ShardError::Layout(format!("parameter `{extra}` is not part of the model")));
    }
    let (Some(embed_tokens), Some(norm)) = (stage.embed_tokens, stage.norm) else {
        return Err(ShardError::Layout("the serial stage holds the embedding and the final norm".into()));
    };
    Ok(Llama::assemble(embed_tokens, stage.layers, norm, stage.lm_head, cfg.rope_theta))
}

#[cfg(test)]
mod tests {
    use super::*;
    use copus_core::model::ModelSpec;

    fn small(tied: bool) -> (LlamaConfig, Llama) {
        let device = Device::flex();
        device.seed(21);
        let spec = ModelSpec { num_layers: 2, tied_embeddings: tied, seq_len: 32, ..ModelSpec::tiny_1m() };
        let cfg = LlamaConfig::from_spec(&spec);
        let model = cfg.init(&device);
        (cfg, model)
    }

    fn bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|x| x.to_bits()).collect()
    }

    #[test]
    fn export_then_import_round_trips_every_tensor_bit_exactly() {
        for tied in [false, true] {
            let dir = tempfile::tempdir().unwrap();
            let (cfg, model) = small(tied);
            export(&model, &cfg, dir.path(), Some(3)).unwrap();
            let (back_cfg, back) = import(dir.path(), &Device::flex()).unwrap();
            assert_eq!(back_cfg.param_specs(), cfg.param_specs(), "tied {tied}");
            let (a, b) = (params(&model), params(&back));
            assert_eq!(a.len(), b.len());
            let b: HashMap<String, (Vec<usize>, Vec<f32>)> = b.into_iter().map(|(n, s, v)| (n, (s, v))).collect();
            for (name, shape, values) in a {
                assert_eq!(b[&name].0, shape, "{name}");
                assert_eq!(bits(&b[&name].1), bits(&values), "{name} changed");
            }
        }
    }

    /// The names, shapes and config an HF `LlamaForCausalLM` expects, written out here from the
    /// published naming scheme, against what `export` wrote.
    #[test]
    fn the_export_follows_the_hf_llama_layout() {
        let dir = tempfile::tempdir().unwrap();
        let (cfg, model) = small(false);
        export(&model, &cfg, dir.path(), Some(7)).unwrap();
        // tiny-1m: hidden 128, 8 heads of 16, 4 kv heads, MLP 344, vocabulary 2048.
        let (d, kv, f, v) = (128usize, 64usize, 344usize, 2048usize);
        let mut want: Vec<(String, Vec<usize>)> = vec![
            ("model.embed_tokens.weight".into(), vec![v, d]),
            ("model.norm.weight".into(), vec![d]),
            ("lm_head.weight".into(), vec![v, d]),
        ];
        for i in 0..2 {
            let l = |s: &str| format!("model.layers.{i}.{s}");
            want.extend([
                (l("input_layernorm.weight"), vec![d]),
                (l("post_attention_layernorm.weight"), vec![d]),
                (l("self_attn.q_proj.weight"), vec![d, d]),
                (l("self_attn.k_proj.weight"), vec![kv, d]),
                (l("self_attn.v_proj.weight"), vec![kv, d]),
                (l("self_attn.o_proj.weight"), vec![d, d]),
                (l("mlp.gate_proj.weight"), vec![f, d]),
                (l("mlp.up_proj.weight"), vec![f, d]),
                (l("mlp.down_proj.weight"), vec![d, f]),
            ]);
        }
        want.sort();
        let bytes = std::fs::read(dir.path().join("model.safetensors")).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let mut got: Vec<(String, Vec<usize>)> = st.tensors().into_iter().map(|(n, t)| (n, t.shape().to_vec())).collect();
        got.sort();
        assert_eq!(got, want);
        assert!(st.tensors().iter().all(|(_, t)| t.dtype() == safetensors::Dtype::F32));
        // q_proj is [out, in]: row r of HF's weight is column r of Burn's.
        let q = params(&model).into_iter().find(|p| p.0 == "layers.0.attn.q_proj.weight").unwrap().2;
        let hf_q = to_f32("q", &st.tensor("model.layers.0.self_attn.q_proj.weight").unwrap()).unwrap();
        assert_eq!(hf_q[5 * d + 9].to_bits(), q[9 * d + 5].to_bits());
        let c: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(dir.path().join("config.json")).unwrap()).unwrap();
        let expect = serde_json::json!({
            "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 128, "intermediate_size": 344,
            "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 16, "vocab_size": 2048,
            "max_position_embeddings": 32, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": false,
            "hidden_act": "silu", "attention_bias": false, "mlp_bias": false, "torch_dtype": "float32",
            "bos_token_id": 7, "eos_token_id": 7
        });
        assert_eq!(c, expect);
    }

    #[test]
    fn mismatches_are_errors_naming_the_field_or_tensor() {
        let dir = tempfile::tempdir().unwrap();
        let (cfg, model) = small(false);
        export(&model, &cfg, dir.path(), None).unwrap();
        let cpath = dir.path().join("config.json");
        let good: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&cpath).unwrap()).unwrap();
        let with = |k: &str, v: serde_json::Value| {
            let mut c = good.clone();
            c[k] = v;
            std::fs::write(&cpath, c.to_string()).unwrap();
            import(dir.path(), &Device::flex()).err().unwrap().to_string()
        };
        assert!(with("architectures", serde_json::json!(["GPT2LMHeadModel"])).contains("`architectures`"));
        assert!(with("hidden_act", serde_json::json!("gelu")).contains("`hidden_act`"));
        assert!(with("rope_scaling", serde_json::json!({"type": "linear", "factor": 2.0})).contains("`rope_scaling`"));
        let e = with("rope_parameters", serde_json::json!({"rope_type": "llama3", "rope_theta": 500000.0}));
        assert!(e.contains("`rope_parameters.rope_type`"), "{e}");
        let nested = {
            let mut c = good.clone();
            c["rope_parameters"] = serde_json::json!({"rope_type": "default", "rope_theta": 500000.0});
            config_from_hf(&c).unwrap()
        };
        assert_eq!(nested.rope_theta, 500000.0);
        let e = with("intermediate_size", serde_json::json!(512));
        assert!(e.contains("_proj.weight") && e.contains("344") && e.contains("512"), "{e}");
        let e = with("num_hidden_layers", serde_json::json!(3));
        assert!(e.contains("model.layers.2.") && e.contains("missing"), "{e}");
        let mut c = good.clone();
        c.as_object_mut().unwrap().remove("vocab_size");
        std::fs::write(&cpath, c.to_string()).unwrap();
        assert!(import(dir.path(), &Device::flex()).err().unwrap().to_string().contains("`vocab_size`"));
        // A Qwen2-style model (q/k/v biases) is not exported as Llama.
        let qwen = LlamaConfig { shape: ModelSpec { qkv_bias: true, ..cfg.shape.clone() }, ..cfg };
        assert!(matches!(hf_config(&qwen, None), Err(HfError::Unsupported(_))));
    }

    /// Checkpoints in bf16 (as most published ones are) load, rounded as bf16 rounds.
    #[test]
    fn bf16_weights_import() {
        let dir = tempfile::tempdir().unwrap();
        let (cfg, model) = small(true);
        export(&model, &cfg, dir.path(), None).unwrap();
        let path = dir.path().join("model.safetensors");
        let bytes = std::fs::read(&path).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let halves: Vec<(String, Vec<usize>, Vec<u8>)> = st
            .tensors()
            .into_iter()
            .map(|(n, t)| {
                let v = to_f32(&n, &t).unwrap();
                (n, t.shape().to_vec(), v.iter().flat_map(|x| half::bf16::from_f32(*x).to_le_bytes()).collect())
            })
            .collect();
        let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = halves
            .iter()
            .map(|(n, s, b)| (n.clone(), safetensors::tensor::TensorView::new(safetensors::Dtype::BF16, s.clone(), b).unwrap()))
            .collect();
        safetensors::serialize_to_file(views, None, &path).unwrap();
        let (_, back) = import(dir.path(), &Device::flex()).unwrap();
        let want: HashMap<String, Vec<f32>> = params(&model).into_iter().map(|(n, _, v)| (n, v)).collect();
        for (n, _, v) in params(&back) {
            for (x, y) in v.iter().zip(&want[&n]) {
                assert_eq!(x.to_bits(), half::bf16::from_f32(*y).to_f32().to_bits(), "{n}");
            }
        }
    }
}
