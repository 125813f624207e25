//! `recipes bench libtorch` (feature `tch`): copus on LibTorch's CPU against PyTorch eager
//! (`bench/torch_step.py`) on the reference shape, f32, the same threads on both sides:
//! - operator calls per decoder layer per micro-batch (forward, loss and backward; LibTorch's
//!   `aten::` calls, nested calls included, the events PyTorch's profiler records): copus with
//!   its operations on LibTorch's kernels, copus with Burn's decomposed forms, and PyTorch eager
//!   with the masked softmax written out and with `scaled_dot_product_attention`. A layer's count
//!   is the count of a two-layer model less that of a one-layer model, on each side;
//! - the training step's time per phase, the two sides stepping in turn.

use anyhow::{Context, anyhow};
use burn::tensor::Device;
use copus_burn::RankDevice;

use super::step::{CopusStep, Torch, alternate, phase_table};
use super::{Shape, shapes};

/// Operator calls of one micro-batch's forward, loss and backward of copus on `shape`, on
/// LibTorch's CPU under autodiff.
fn copus_calls(shape: &Shape, device: &Device) -> u64 {
    let step = CopusStep::on(shape, device.clone());
    let (inputs, targets) = step.micro_batch(0);
    copus_burn::fused::count_operator_calls(|| step.forward_backward(inputs, targets)).1
}

/// `shape` with `layers` decoder layers.
fn with_layers(shape: &Shape, layers: usize) -> Shape {
    let mut s = shape.clone();
    s.spec.num_layers = layers;
    s
}

/// Prints both tables.
pub fn run(steps: usize, warmup: usize, threads: usize) -> anyhow::Result<()> {
    let device = RankDevice::TchCpu.device().map_err(|e| anyhow!("{e}"))?.autodiff();
    copus_burn::fused::set_libtorch_threads(threads);
    let shape = shapes().remove(0);
    let s = &shape.spec;
    println!(
        "{}: d_model {}, {} layers, {} heads, {} kv heads, ffn {}, vocab {}, seq {}, micro-batch {}, fp32; {threads} threads on both sides",
        s.name, s.hidden, s.num_layers, s.num_heads, s.num_kv_heads, s.ffn_hidden, s.vocab_size, s.seq_len, shape.micro_batch
    );
    let (one, two) = (with_layers(&shape, 1), with_layers(&shape, 2));
    let ours = |fused: bool| {
        copus_burn::fused::use_libtorch_operations(fused);
        let (a, b) = (copus_calls(&one, &device), copus_calls(&two, &device));
        copus_burn::fused::use_libtorch_operations(true);
        (b.saturating_sub(a), a)
    };
    let theirs = |options: &[&str]| -> anyhow::Result<(u64, u64)> {
        let a = Torch::start_with(&one, threads, options)?.operator_calls()?;
        let b = Torch::start_with(&two, threads, options)?.operator_calls()?;
        Ok((b.saturating_sub(a), a))
    };
    let rows = [
        ("copus on LibTorch, its operations on LibTorch's kernels", Ok(ours(true))),
        ("copus on LibTorch, Burn's decomposed forms", Ok(ours(false))),
        ("PyTorch eager, masked softmax written out", theirs(&["--attention", "manual"])),
        ("PyTorch eager, scaled_dot_product_attention", theirs(&["--attention", "sdpa"])),
    ];
    let reference = rows[2].1.as_ref().ok().map(|(layer, _)| *layer as f64);
    println!(
        "\n| side | operator calls per decoder layer per micro-batch | per micro-batch, one-layer model | per layer / PyTorch eager (masked softmax) |\n|---|---:|---:|---:|"
    );
    for (name, counted) in &rows {
        match (counted, reference) {
            (Ok((layer, total)), Some(r)) => println!("| {name} | {layer} | {total} | {:.2} |", *layer as f64 / r),
            (Ok((layer, total)), None) => println!("| {name} | {layer} | {total} | |"),
            (Err(e), _) => println!("| {name} | not measured ({e}) | | |"),
        }
    }
    println!("\nstep time, f32, {threads} threads; medians of {steps} steps after {warmup} warm-up");
    for (name, options) in [("PyTorch eager, masked softmax", ["--attention", "manual"]), ("PyTorch eager, SDPA", ["--attention", "sdpa"])]
    {
        println!("\ncopus on LibTorch against {name}:");
        let server = Torch::start_with(&shape, threads, &options).context("starting PyTorch");
        phase_table(&shape, alternate(CopusStep::on(&shape, device.clone()), Some(server), steps, warmup));
    }
    Ok(())
}
