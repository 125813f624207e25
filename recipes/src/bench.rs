//! `recipes bench`: training-step throughput of the reference shape (d_model 256, 4 layers,
//! 8 heads, 4 kv heads, ffn 688, vocab 4096, sequence 256, micro-batch 8, fp32, AdamW) on the
//! Flex CPU backend, and PyTorch eager on the same shape in the same run when torch is installed.

use std::path::Path;
use std::process::Command;
use std::time::Instant;

use anyhow::{Context, anyhow};
use burn::module::Module;
use burn::tensor::{Device, Int, Tensor, TensorData};
use copus_burn::{MicroBatch, OptimConfig, Trainer};
use copus_core::model::ModelSpec;
use copus_models::LlamaConfig;

/// The reference shape.
pub fn spec() -> ModelSpec {
    ModelSpec { name: "bench-5m".into(), ..ModelSpec::tiny_5m() }
}

/// Micro-batch of the reference step.
pub const MICRO_BATCH: usize = 8;

/// Seconds per timed step of copus on Flex: forward only (no autodiff), forward + backward
/// with the probe's gradient norms, and the whole optimizer step.
pub struct CopusTimes {
    /// Forward and loss on a plain (non-autodiff) copy.
    pub forward: Vec<f64>,
    /// Forward, backward and the per-micro-batch squared norms.
    pub forward_backward: Vec<f64>,
    /// Everything a training step does, AdamW included.
    pub step: Vec<f64>,
}

/// Times the reference step.
pub fn time_copus(steps: usize, warmup: usize) -> CopusTimes {
    let s = spec();
    let device = Device::flex().autodiff();
    device.seed(0);
    let model = LlamaConfig::from_spec(&s).init(&device);
    let cfg = OptimConfig { warmup_steps: 0, clip_norm: None, ..OptimConfig::default() };
    let mut trainer = Trainer::new(model, cfg).expect("valid settings");
    let n = MICRO_BATCH * s.seq_len;
    let mut out = CopusTimes { forward: Vec::new(), forward_backward: Vec::new(), step: Vec::new() };
    for i in 0..warmup + steps {
        let ids: Vec<i64> = (0..n).map(|j| ((j * 31 + i * 7) % s.vocab_size) as i64).collect();
        let tgt: Vec<i64> = (0..n).map(|j| ((j * 17 + i) % s.vocab_size) as i64).collect();
        let on = |d: &Device| MicroBatch {
            inputs: Tensor::<2, Int>::from_data(TensorData::new(ids.clone(), [MICRO_BATCH, s.seq_len]), d),
            targets: Tensor::<2, Int>::from_data(TensorData::new(tgt.clone(), [MICRO_BATCH, s.seq_len]), d),
        };
        let plain = trainer.model().valid();
        let mb = on(&plain.embed_tokens.weight.device());
        let t = Instant::now();
        let _ = plain.loss_sum(mb.inputs, mb.targets).into_scalar::<f32>();
        let fwd = t.elapsed().as_secs_f64();
        let t = Instant::now();
        let acc = copus_burn::accumulate(trainer.model(), &[on(&device)]).expect("bench step");
        let fwd_bwd = t.elapsed().as_secs_f64();
        drop(acc);
        let t = Instant::now();
        trainer.step(&[on(&device)]).expect("bench step");
        if i >= warmup {
            out.forward.push(fwd);
            out.forward_backward.push(fwd_bwd);
            out.step.push(t.elapsed().as_secs_f64());
        }
    }
    out
}

/// The learner add-on's noise probe against the same step without it, on the reference shape:
/// seconds per step (forward, backward, AdamW) and seconds of the probe's work at one
/// micro-batch per step (the squared norm of the gradient and of its difference from the
/// previous step's, each reduced on the device with one small readback), medians over `steps`.
pub fn probe_overhead(steps: usize, warmup: usize) -> (f64, f64) {
    use burn::optim::GradientsParams;
    use copus_burn::grads;
    let s = spec();
    let device = Device::flex().autodiff();
    device.seed(0);
    let mut model = LlamaConfig::from_spec(&s).init(&device);
    let cfg = OptimConfig { warmup_steps: 0, clip_norm: None, ..OptimConfig::default() };
    let mut optim = copus_burn::adamw_optimizer(&cfg, &[]);
    let n = MICRO_BATCH * s.seq_len;
    let (mut step_secs, mut probe_secs) = (Vec::new(), Vec::new());
    let mut previous: Option<GradientsParams> = None;
    for i in 0..warmup + steps {
        let ids: Vec<i64> = (0..n).map(|j| ((j * 31 + i * 7) % s.vocab_size) as i64).collect();
        let tgt: Vec<i64> = (0..n).map(|j| ((j * 17 + i) % s.vocab_size) as i64).collect();
        let inputs = Tensor::<2, Int>::from_data(TensorData::new(ids, [MICRO_BATCH, s.seq_len]), &device);
        let targets = Tensor::<2, Int>::from_data(TensorData::new(tgt, [MICRO_BATCH, s.seq_len]), &device);
        let t = Instant::now();
        let loss = model.loss_sum(inputs, targets).div_scalar(n as f64);
        let g = GradientsParams::from_grads(loss.backward(), &model);
        let p = Instant::now();
        let sq = grads::sq_norm_on_device(&model, &g);
        let diff = previous.as_ref().map(|prev| grads::diff_sq_norm_on_device(&model, &g, prev));
        let probe = p.elapsed().as_secs_f64();
        assert!(sq.is_finite() && diff.is_none_or(f64::is_finite));
        previous = Some(grads::scaled(&model, &g, 1.0));
        model = optim.step(1e-3, model, g);
        // The step is done once its weights can be read.
        let _ = model.embed_tokens.weight.val().slice([0..1, 0..1]).into_data();
        if i >= warmup {
            step_secs.push(t.elapsed().as_secs_f64() - probe);
            probe_secs.push(probe);
        }
    }
    let median = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    (median(step_secs), median(probe_secs))
}

/// GFLOP/s of the LM-head GEMM of the reference step, `[2048, 256] x [256, 4096]` in fp32,
/// on the plain Flex device (the kernel every linear layer runs on).
pub fn gemm_gflops(reps: usize) -> f64 {
    let device = Device::flex();
    let a: Tensor<2> = Tensor::random([2048, 256], burn::tensor::Distribution::Default, &device);
    let b: Tensor<2> = Tensor::random([256, 4096], burn::tensor::Distribution::Default, &device);
    let _ = a.clone().matmul(b.clone()).sum().into_scalar::<f32>();
    let t = Instant::now();
    for _ in 0..reps {
        let _ = a.clone().matmul(b.clone()).sum().into_scalar::<f32>();
    }
    2.0 * 2048.0 * 256.0 * 4096.0 * reps as f64 / t.elapsed().as_secs_f64() / 1e9
}

/// PyTorch's step times and GEMM GFLOP/s from `bench/torch_step.py`, or why there are none.
pub fn time_torch(steps: usize, warmup: usize) -> anyhow::Result<(Vec<f64>, f64)> {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("bench/torch_step.py");
    let out = Command::new("python3")
        .arg(&script)
        .args(["--steps", &steps.to_string(), "--warmup", &warmup.to_string()])
        .output()
        .map_err(|e| anyhow!("cannot run python3: {e}"))?;
    if !out.status.success() {
        let err = String::from_utf8_lossy(&out.stderr);
        return Err(anyhow!("{}", err.lines().last().unwrap_or("failed")));
    }
    let v: serde_json::Value = serde_json::from_slice(&out.stdout)?;
    let steps = v["step_secs"].as_array().context("no step_secs")?.iter().filter_map(|x| x.as_f64()).collect();
    Ok((steps, v["gemm_gflops"].as_f64().unwrap_or(f64::NAN)))
}

/// Prints the table.
pub fn run(steps: usize, warmup: usize, torch: bool) {
    let s = spec();
    let tokens = (MICRO_BATCH * s.seq_len) as f64;
    println!(
        "training step: d_model {}, {} layers, {} heads, {} kv heads, ffn {}, vocab {}, seq {}, micro-batch {}, fp32, AdamW, {} threads",
        s.hidden,
        s.num_layers,
        s.num_heads,
        s.num_kv_heads,
        s.ffn_hidden,
        s.vocab_size,
        s.seq_len,
        MICRO_BATCH,
        std::thread::available_parallelism().map_or(1, |n| n.get())
    );
    println!("{:<28} {:>10} {:>10} {:>12}", "what", "mean s", "min s", "tokens/s");
    let row = |name: &str, t: &[f64]| {
        let mean = t.iter().sum::<f64>() / t.len().max(1) as f64;
        let min = t.iter().cloned().fold(f64::INFINITY, f64::min);
        println!("{name:<28} {mean:>10.3} {min:>10.3} {:>12.0}", tokens / mean);
        mean
    };
    let t = time_copus(steps, warmup);
    row("copus: forward only", &t.forward);
    row("copus: forward + backward", &t.forward_backward);
    let ours = row("copus: training step", &t.step);
    let gemm = gemm_gflops(5);
    if torch {
        match time_torch(steps, warmup) {
            Ok((t, torch_gemm)) => {
                let theirs = row("PyTorch eager: training step", &t);
                println!("ratio (PyTorch step time / copus step time): {:.2}", theirs / ours);
                println!("GEMM [2048,256]x[256,4096] fp32: copus/Flex {gemm:.1} GFLOP/s, PyTorch {torch_gemm:.1} GFLOP/s");
            }
            Err(e) => {
                println!("PyTorch eager: not measured ({e})");
                println!("GEMM [2048,256]x[256,4096] fp32: copus/Flex {gemm:.1} GFLOP/s");
            }
        }
    } else {
        println!("GEMM [2048,256]x[256,4096] fp32: copus/Flex {gemm:.1} GFLOP/s");
    }
}
