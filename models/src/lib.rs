//! copus-models: the Llama family on Burn 0.22, built from copus-core [`ModelSpec`] shapes.
//!
//! Parameter names follow copus-core's [`ModelSpec::param_specs`] (`embed_tokens.weight`,
//! `layers.{i}.attn.q_proj.weight`, `layers.{i}.mlp.gate_proj.weight`, `norm.weight`,
//! `lm_head.weight`, ...), so the sharding spec, checkpoints and resharding name the same tensors.

#![forbid(unsafe_code)]

pub mod generate;
pub mod hf;
#[cfg(feature = "learner")]
pub mod learner;
pub mod llama;
pub mod stage;

use std::path::Path;

use burn::store::{ModuleSnapshot, SafetensorsStore};
use thiserror::Error;

pub use copus_core::model::ModelSpec;
pub use llama::{KvCache, Llama, LlamaConfig};
pub use stage::LlamaStage;

/// Saving or loading weights failed.
#[derive(Debug, Error)]
pub enum WeightsError {
    /// The safetensors store reported an error.
    #[error("safetensors `{path}`: {message}")]
    Store {
        /// File.
        path: String,
        /// What the store said.
        message: String,
    },
    /// The file does not hold every parameter of the model, or holds others.
    #[error("safetensors `{path}` does not match the model: missing {missing:?}, unused {unused:?}")]
    Mismatch {
        /// File.
        path: String,
        /// Parameters the file lacks.
        missing: Vec<String>,
        /// Tensors the model has no place for.
        unused: Vec<String>,
    },
}

/// The model's parameters as host data under their global names: the input of
/// [`copus_burn::Engine::new`].
pub fn full_params(model: &Llama) -> copus_burn::parallel::FullParams {
    copus_burn::parallel::named_params(model)
        .into_iter()
        .map(|(name, _, shape, values)| (name, burn::tensor::TensorData::new(values, shape)))
        .collect()
}

/// Writes the model's weights to a safetensors file under their Llama-style names.
pub fn save_safetensors(model: &Llama, path: &Path) -> Result<(), WeightsError> {
    let mut store = SafetensorsStore::from_file(path).overwrite(true);
    model.save_into(&mut store).map_err(|e| WeightsError::Store { path: path.display().to_string(), message: e.to_string() })
}

/// Loads weights saved by [`save_safetensors`] (or any file with the same names and shapes).
pub fn load_safetensors(model: &mut Llama, path: &Path) -> Result<(), WeightsError> {
    let mut store = SafetensorsStore::from_file(path).allow_partial(true);
    let result =
        model.load_from(&mut store).map_err(|e| WeightsError::Store { path: path.display().to_string(), message: e.to_string() })?;
    if !result.missing.is_empty() || !result.unused.is_empty() || !result.errors.is_empty() {
        let mut missing: Vec<String> = result.missing.iter().map(|m| format!("{m:?}")).collect();
        missing.extend(result.errors.iter().map(|e| format!("{e:?}")));
        return Err(WeightsError::Mismatch {
            path: path.display().to_string(),
            missing,
            unused: result.unused.iter().map(|u| u.to_string()).collect(),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::llama::Rope;
    use burn::module::Module;
    use burn::tensor::{Device, Distribution, Int, Tensor, TensorData};

    fn device() -> Device {
        Device::flex()
    }

    fn tokens(data: Vec<i64>, b: usize, s: usize) -> Tensor<2, Int> {
        Tensor::from_data(TensorData::new(data, [b, s]), &device())
    }

    fn to_vec<const D: usize>(t: Tensor<D>) -> Vec<f32> {
        t.into_data().try_to_vec::<f32>().unwrap()
    }

    #[test]
    fn output_shapes() {
        let cfg = LlamaConfig::from_spec(&ModelSpec::tiny_1m());
        let model = cfg.init(&device());
        let logits = model.forward(tokens((0..24).collect(), 2, 12));
        assert_eq!(logits.dims(), [2, 12, 2048]);
        let loss = model.loss_sum(tokens((0..24).collect(), 2, 12), tokens((1..25).collect(), 2, 12));
        assert_eq!(loss.dims(), [1]);
        // At initialisation the mean loss is close to ln(vocab).
        let mean = loss.into_scalar::<f32>() / 24.0;
        assert!((mean - (2048f32).ln()).abs() < 0.5, "{mean}");
    }

    #[test]
    fn causal_logits_ignore_future_tokens() {
        let model = LlamaConfig::from_spec(&ModelSpec::tiny_1m()).init(&device());
        let a: Vec<i64> = vec![5, 17, 3, 99, 42, 7, 1000, 12];
        let mut b = a.clone();
        b[5] = 1;
        b[6] = 2;
        b[7] = 3;
        let la = to_vec(model.forward(tokens(a, 1, 8)));
        let lb = to_vec(model.forward(tokens(b, 1, 8)));
        let v = 2048;
        // Positions 0..=4 see only tokens 0..=4, which are equal: bit-identical logits.
        assert_eq!(&la[..5 * v], &lb[..5 * v]);
        // Position 5 sees the changed token 5.
        assert_ne!(&la[5 * v..6 * v], &lb[5 * v..6 * v]);
    }

    #[test]
    fn rope_scores_depend_only_on_relative_position() {
        let e = 16;
        let s = 12;
        let rope = Rope::new(s, e, 10000.0, &device());
        // The same q and k vectors at every position.
        let q: Tensor<1> = Tensor::random([e], Distribution::Normal(0.0, 1.0), &device());
        let k: Tensor<1> = Tensor::random([e], Distribution::Normal(0.0, 1.0), &device());
        let at_all = |v: Tensor<1>| -> Tensor<4> { v.unsqueeze::<2>().expand([s, e]).unsqueeze::<4>() };
        let qr = rope.apply(at_all(q.clone())).reshape([s, e]);
        let kr = rope.apply(at_all(k.clone())).reshape([s, e]);
        let scores = to_vec(qr.clone().matmul(kr.transpose())); // [s, s], row m = query position
        let at = |m: usize, n: usize| scores[m * s + n];
        for (m, n) in [(3, 1), (7, 2), (11, 0), (2, 9)] {
            for shift in 1..(s - m.max(n)) {
                assert!((at(m, n) - at(m + shift, n + shift)).abs() < 1e-4, "({m},{n}) vs shift {shift}");
            }
        }
        // And they do depend on the offset (not a constant).
        assert!((at(3, 1) - at(3, 2)).abs() > 1e-3);
        // Position 0 is not rotated.
        let q0 = to_vec(qr.narrow(0, 0, 1));
        assert_eq!(q0, to_vec(q));
    }

    #[test]
    fn attention_matches_a_head_by_head_reference() {
        // Reference: for each query head i, kv head i / (h / k), masked softmax(q k^T / sqrt(e)) v,
        // heads concatenated, then o_proj. tiny-1m: 8 heads over 4 kv heads, e = 16.
        use burn::tensor::activation::softmax;
        let model = LlamaConfig::from_spec(&ModelSpec::tiny_1m()).init(&device());
        let attn = &model.layers[1].attn;
        let (b, s, h, k, e) = (2, 7, 8, 4, 16);
        let x: Tensor<3> = Tensor::random([b, s, 128], Distribution::Normal(0.0, 1.0), &device());
        let rope = model.rope(s);
        let got = to_vec(attn.forward(x.clone(), &rope));
        let q = rope.apply(attn.q_proj.forward(x.clone()).reshape([b, s, h, e]).swap_dims(1, 2));
        let kk = rope.apply(attn.k_proj.forward(x.clone()).reshape([b, s, k, e]).swap_dims(1, 2));
        let v = attn.v_proj.forward(x).reshape([b, s, k, e]).swap_dims(1, 2);
        let mut mask = vec![0f32; s * s];
        for r in 0..s {
            for c in r + 1..s {
                mask[r * s + c] = -1e30;
            }
        }
        let mask: Tensor<3> = Tensor::<2>::from_data(TensorData::new(mask, [s, s]), &device()).unsqueeze();
        let heads: Vec<Tensor<3>> = (0..h)
            .map(|i| {
                let qi: Tensor<3> = q.clone().narrow(1, i, 1).reshape([b, s, e]);
                let kj: Tensor<3> = kk.clone().narrow(1, i / (h / k), 1).reshape([b, s, e]);
                let vj: Tensor<3> = v.clone().narrow(1, i / (h / k), 1).reshape([b, s, e]);
                let p = softmax(qi.matmul(kj.swap_dims(1, 2)).mul_scalar(0.25) + mask.clone(), 2);
                p.matmul(vj)
            })
            .collect();
        let want = to_vec(attn.o_proj.forward(Tensor::cat(heads, 2)));
        let worst = got.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
        assert!(worst < 1e-5, "max difference {worst}");
    }

    #[test]
    fn built_models_hold_exactly_the_copus_core_parameters() {
        for spec in [ModelSpec::tiny_1m(), ModelSpec::tiny_5m(), ModelSpec::tiny_20m()] {
            let cfg = LlamaConfig::from_spec(&spec);
            let model = cfg.init(&device());
            assert_eq!(model.num_params() as u64, spec.num_params(), "{}", spec.name);
            let mut got: Vec<(String, Vec<usize>)> =
                model.collect(None, None, true).into_iter().map(|t| (t.name.clone(), t.shape.to_vec())).collect();
            let mut want: Vec<(String, Vec<usize>)> = spec.param_specs().into_iter().map(|p| (p.name, p.shape)).collect();
            got.sort();
            want.sort();
            assert_eq!(got, want, "{}", spec.name);
        }
    }

    fn flat_params(model: &Llama) -> Vec<f32> {
        struct V(Vec<f32>);
        impl burn::module::ModuleVisitor for V {
            fn visit_float<const D: usize>(&mut self, p: &burn::module::Param<Tensor<D>>) {
                self.0.extend(p.val().into_data().try_to_vec::<f32>().unwrap());
            }
        }
        let mut v = V(Vec::new());
        model.visit(&mut v);
        v.0
    }

    #[test]
    fn one_step_is_the_same_for_every_micro_batch_split() {
        // B_g = 8 sequences of 16 tokens as 1x8, 2x4, 4x2 and 8x1 micro-batches.
        use copus_burn::{MicroBatch, OptimConfig, Trainer};
        let dev = device().autodiff();
        let mut spec = ModelSpec::tiny_1m();
        spec.seq_len = 16;
        let model = LlamaConfig::from_spec(&spec).init(&dev);
        let data: Vec<i64> = (0..8 * 17).map(|i| (i * 7919 % 2048) as i64).collect();
        let split = |b_m: usize| -> Vec<MicroBatch> {
            let windows: Vec<&[i64]> = data.chunks(17).collect();
            windows.chunks(b_m).map(|w| MicroBatch::from_windows(w, &dev)).collect()
        };
        // The gradient must not depend on the split (to fp32 summation order).
        let whole = copus_burn::trainer::accumulate(&model, &split(8)).unwrap();
        for b_m in [4, 2, 1] {
            let part = copus_burn::trainer::accumulate(&model, &split(b_m)).unwrap();
            let diff = copus_burn::grads::diff_sq_norm(&model, &part.grads, &whole.grads).sqrt();
            assert!(diff < 1e-5 * whole.grad_sq_norm.sqrt(), "B_m {b_m}: |g - g_whole| = {diff}");
        }
        // AdamW's first update is lr * g / (|g| + eps): for entries whose gradient is near eps a
        // different fp32 summation order moves the update by up to a few percent of lr, so the
        // parameter check uses lr = 1e-4, where that stays below the 1e-5 tolerance.
        let cfg = OptimConfig { lr: 1e-4, warmup_steps: 0, ..OptimConfig::default() };
        let run = |b_m: usize| {
            let mut t = Trainer::new(model.clone(), cfg.clone()).unwrap();
            let m = t.step(&split(b_m)).unwrap();
            (m, flat_params(t.model()))
        };
        let (m8, p8) = run(8);
        let before = flat_params(&model);
        assert!(before.iter().zip(&p8).any(|(a, b)| (a - b).abs() > 5e-5), "the step moved the weights");
        for b_m in [4, 2, 1] {
            let (m, p) = run(b_m);
            assert_eq!((m.micro_batch, m.num_micro, m.global_batch), (b_m, 8 / b_m, 8));
            assert!((m.loss - m8.loss).abs() < 1e-5 * m8.loss, "loss {} vs {}", m.loss, m8.loss);
            assert!((m.grad_norm - m8.grad_norm).abs() < 1e-5 * m8.grad_norm);
            let worst = p.iter().zip(&p8).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
            assert!(worst < 1e-5, "B_m {b_m}: max parameter difference {worst}");
        }
    }

    #[test]
    fn large_presets_report_counts_without_allocating() {
        for (spec, published) in [
            (ModelSpec::llama_3_2_3b(), 3.21e9),
            (ModelSpec::llama_2_7b(), 6.74e9),
            (ModelSpec::llama_2_13b(), 13.0e9),
            (ModelSpec::qwen2_5_32b(), 32.8e9),
        ] {
            let n = LlamaConfig::from_spec(&spec).num_params() as f64;
            assert!((n / published - 1.0).abs() < 0.01, "{}: {n}", spec.name);
        }
    }

    #[test]
    fn weights_round_trip_through_safetensors_with_llama_names() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("model.safetensors");
        let cfg = LlamaConfig::from_spec(&ModelSpec::tiny_1m());
        let a = cfg.init(&device());
        save_safetensors(&a, &path).unwrap();
        // The file's header names the tensors as copus-core does.
        let bytes = std::fs::read(&path).unwrap();
        let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
        let header = std::str::from_utf8(&bytes[8..8 + n]).unwrap();
        for name in [
            "embed_tokens.weight",
            "layers.3.attn.k_proj.weight",
            "layers.0.mlp.down_proj.weight",
            "layers.2.mlp_norm.weight",
            "norm.weight",
        ] {
            assert!(header.contains(&format!("\"{name}\"")), "{name} missing from {header:.300}");
        }
        let mut b = cfg.init(&device());
        let input = tokens(vec![1, 2, 3, 4, 5, 6], 1, 6);
        assert_ne!(to_vec(a.forward(input.clone())), to_vec(b.forward(input.clone())));
        load_safetensors(&mut b, &path).unwrap();
        assert_eq!(to_vec(a.forward(input.clone())), to_vec(b.forward(input)));
        // A file from another shape is an error naming what does not fit.
        let mut other = LlamaConfig::from_spec(&ModelSpec::tiny_5m()).init(&device());
        assert!(load_safetensors(&mut other, &path).is_err());
    }
}
