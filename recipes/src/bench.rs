//! `recipes bench`: training-step throughput of the reference shape (d_model 256, 4 layers,
//! 8 heads, 4 kv heads, ffn 688, vocab 4096, sequence 256, micro-batch 8, fp32, AdamW) on the
//! Flex CPU backend, and PyTorch eager on the same shape in the same run when torch is installed.

use std::path::Path;
use std::process::Command;
use std::time::Instant;

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

/// Seconds of each timed step of copus on Flex.
pub fn time_copus(steps: usize, warmup: usize) -> Vec<f64> {
    let s = spec();
    let device = Device::flex().autodiff();
    device.seed(0);
    let model = LlamaConfig::from_spec(&s).init(&device);
    let cfg = OptimConfig { warmup_steps: 0, clip_norm: None, ..OptimConfig::default() };
    let mut trainer = Trainer::new(model, cfg).expect("valid settings");
    let n = MICRO_BATCH * s.seq_len;
    let mut times = Vec::new();
    for i in 0..warmup + steps {
        let ids: Vec<i64> = (0..n).map(|j| ((j * 31 + i * 7) % s.vocab_size) as i64).collect();
        let tgt: Vec<i64> = (0..n).map(|j| ((j * 17 + i) % s.vocab_size) as i64).collect();
        let mb = MicroBatch {
            inputs: Tensor::<2, Int>::from_data(TensorData::new(ids, [MICRO_BATCH, s.seq_len]), &device),
            targets: Tensor::<2, Int>::from_data(TensorData::new(tgt, [MICRO_BATCH, s.seq_len]), &device),
        };
        let t = Instant::now();
        trainer.step(&[mb]).expect("bench step");
        if i >= warmup {
            times.push(t.elapsed().as_secs_f64());
        }
    }
    times
}

/// PyTorch's step times from `bench/torch_step.py`, or why there are none.
pub fn time_torch(steps: usize, warmup: usize) -> Result<Vec<f64>, String> {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("bench/torch_step.py");
    let out = Command::new("python3")
        .arg(&script)
        .args(["--steps", &steps.to_string(), "--warmup", &warmup.to_string()])
        .output()
        .map_err(|e| format!("cannot run python3: {e}"))?;
    if !out.status.success() {
        let err = String::from_utf8_lossy(&out.stderr);
        return Err(err.lines().last().unwrap_or("failed").to_string());
    }
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).map_err(|e| e.to_string())?;
    Ok(v["step_secs"].as_array().ok_or("no step_secs")?.iter().filter_map(|x| x.as_f64()).collect())
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
    println!("{:<28} {:>10} {:>10} {:>12}", "implementation", "mean s", "min s", "tokens/s");
    let row = |name: &str, t: &[f64]| {
        let mean = t.iter().sum::<f64>() / t.len().max(1) as f64;
        let min = t.iter().cloned().fold(f64::INFINITY, f64::min);
        println!("{name:<28} {mean:>10.3} {min:>10.3} {:>12.0}", tokens / mean);
        mean
    };
    let ours = row("copus (Burn 0.22 Flex)", &time_copus(steps, warmup));
    if torch {
        match time_torch(steps, warmup) {
            Ok(t) => {
                let theirs = row("PyTorch eager", &t);
                println!("ratio (PyTorch time / copus time): {:.2}", theirs / ours);
            }
            Err(e) => println!("PyTorch eager: not measured ({e})"),
        }
    }
}
