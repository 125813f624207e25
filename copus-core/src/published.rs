//! The analytic cluster model against published, measured training throughput: each point
//! is a model shape, a cluster, a layout and batch as its source ran them, and the tokens/s per
//! GPU it measured. [`check`] gives the model's prediction beside each, so the constants of
//! [`ClusterSpec`] are judged on numbers the model was not built from.
//!
//! Sources (read from the public repositories):
//! - torchtitan `benchmarks/llama3_h100_202412_torchtitan.md`, Table 1: Llama 3.1 8B, FSDP on 8
//!   H100 (96 GB HBM2e, 500 W), local batch 2, sequence 8192 (the `llama3_8b.toml` of the
//!   benchmark's commit), bf16, selective activation checkpointing, no torch.compile:
//!   5,762 tokens/s per GPU.
//! - Megatron-LM `README.md` / `images/model_table.png` (Megatron-Core r0.8.0): GPT 7.1B
//!   (30 layers, width 4096, 32 heads, vocab 131072, sequence 4096) on 96 H100, TP 2, DP 48,
//!   global batch 192: 465.9 TFLOP/s per GPU by Megatron's count, which has no recomputation
//!   (45.5 GFLOP per token): 10,240 tokens/s per GPU.
//! - The same table: GPT 1.7B (24 layers, width 2048, 16 heads) on 48 H100, DP 48, global
//!   batch 192: 408.8 TFLOP/s per GPU, 36,260 tokens/s per GPU.
//!
//! What the model does not know is said per point: FSDP is modelled as data parallelism with
//! the same gradient traffic and its memory is not checked (ZeRO-3 shards what the memory
//! model would count whole); Megatron's GPT MLP (two `4h` matrices) is given as the SwiGLU
//! width with the same FLOPs, `8h/3`; micro-batch sizes the sources do not state are 1.

use serde::Serialize;

use crate::candidates::Candidate;
use crate::layout::ParallelDims;
use crate::model::ModelSpec;
use crate::throughput::{ClusterModel, ClusterSpec, ThroughputModel};

/// One published point and the model's prediction of it.
#[derive(Clone, Debug, Serialize)]
pub struct PublishedPoint {
    /// What was run, and where it is published.
    pub name: &'static str,
    /// Measured tokens/s per GPU.
    pub measured: f64,
    /// Whether the source ran a tuned Megatron-class stack (fused kernels, overlapped
    /// communication), which the model's H100 constants describe; torchtitan's eager FSDP row
    /// reaches 34% MFU on a power-capped H100 variant, the Megatron rows 41-47%.
    pub tuned_stack: bool,
    /// The analytic model's tokens/s per GPU.
    pub predicted: f64,
}

impl PublishedPoint {
    /// predicted / measured - 1.
    pub fn error(&self) -> f64 {
        self.predicted / self.measured - 1.0
    }
}

/// A model of `spec` on `cluster` whose memory check passes everything (the points ran; their
/// sharding is not what this model's memory counts).
fn unchecked(cluster: ClusterSpec, spec: ModelSpec) -> ClusterModel {
    ClusterModel::new(ClusterSpec { memory_bytes: f64::INFINITY, ..cluster }, spec)
}

/// Tokens/s per GPU of a configuration; NaN where the model cannot run it (the cluster given to
/// [`check_on`] does not have the points' GPUs).
fn predict(model: &ClusterModel, dims: ParallelDims, global_batch: usize, micro_batch: usize) -> f64 {
    let samples = Candidate::new(dims, global_batch, micro_batch).ok().and_then(|c| model.samples_per_sec(&c));
    samples.map_or(f64::NAN, |s| s * model.model.seq_len as f64 / model.cluster.world_size() as f64)
}

/// The published points with the model's predictions, on the shipped H100 constants.
pub fn check() -> Vec<PublishedPoint> {
    check_on(ClusterSpec::h100_nvlink)
}

/// [`check`] on H100 nodes made by `h100` (to try other constants); a prediction is NaN where
/// the nodes it makes cannot run the point.
pub fn check_on(h100: impl Fn(usize) -> ClusterSpec) -> Vec<PublishedPoint> {
    let llama_8b = ModelSpec::shape("llama-3.1-8b", 32, 4096, 32, 8, 14_336, 128_256, 8192, false);
    let gpt_7b = ModelSpec::shape("gpt-7.1b", 30, 4096, 32, 32, 8 * 4096 / 3, 131_072, 4096, false);
    let gpt_2b = ModelSpec::shape("gpt-1.7b", 24, 2048, 16, 16, 8 * 2048 / 3, 131_072, 4096, false);
    let d = |dp, tp| ParallelDims { dp, tp, pp: 1 };
    vec![
        PublishedPoint {
            name: "torchtitan: Llama 3.1 8B, FSDP 8 x H100, local batch 2, seq 8192",
            measured: 5762.0,
            tuned_stack: false,
            predicted: predict(&unchecked(h100(1), llama_8b), d(8, 1), 16, 2),
        },
        PublishedPoint {
            name: "Megatron-Core: GPT 7.1B, 96 x H100, TP 2 DP 48, global batch 192, seq 4096",
            measured: 10_240.0,
            tuned_stack: true,
            predicted: predict(&unchecked(h100(12), gpt_7b), d(48, 2), 192, 1),
        },
        PublishedPoint {
            name: "Megatron-Core: GPT 1.7B, 48 x H100, DP 48, global batch 192, seq 4096",
            measured: 36_260.0,
            tuned_stack: true,
            predicted: predict(&unchecked(h100(6), gpt_2b), d(48, 1), 192, 1),
        },
    ]
}

/// The check as a Markdown table.
pub fn table(points: &[PublishedPoint]) -> String {
    let mut md = String::from("| published run | stack | measured tokens/s per GPU | model | error |\n|---|---|---:|---:|---:|\n");
    for p in points {
        let stack = if p.tuned_stack { "tuned" } else { "eager" };
        md.push_str(&format!("| {} | {stack} | {:.0} | {:.0} | {:+.1}% |\n", p.name, p.measured, p.predicted, 100.0 * p.error()));
    }
    md
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The shipped constants predict the published points of a tuned stack within 25%. The
    /// eager torchtitan row is a known miss (the model is 40-60% above it), kept in the table
    /// and bounded here so a change of constants that moves it is seen.
    #[test]
    fn the_cluster_model_predicts_published_throughput() {
        let points = check();
        println!("{}", table(&points));
        assert_eq!(points.iter().filter(|p| p.tuned_stack).count(), 2);
        for p in &points {
            assert!(p.predicted.is_finite() && p.predicted > 0.0, "{}", p.name);
            if p.tuned_stack {
                assert!(p.error().abs() <= 0.25, "{}: model {:.0} vs measured {:.0}", p.name, p.predicted, p.measured);
            } else {
                assert!((0.3..0.7).contains(&p.error()), "{}: the known miss moved: {:+.2}", p.name, p.error());
            }
        }
    }
}
