//! The adaptive loop used directly: the 3D-parallel engine on two in-process ranks, a
//! `Driver` over the run's candidate space, and copus-core's embedded orchestrator running the
//! Copus policy. Each step hands the measured noise scale and samples/s to the policy; a
//! decision is checked against the candidate space and carried out in memory at the step
//! boundary. A small Llama-style model learns next bytes of real text on the CPU.
//!
//! ```text
//! cargo run --release -p copus-burn --example driver [-- TEXT_FILE [STEPS]]
//! ```
//!
//! The text is any UTF-8 file (by default this repository's README.md), read as bytes.

use std::path::PathBuf;
use std::sync::Arc;

use copus_burn::{DataSource, JobBuilder, OptimConfig};
use copus_core::memory::{GIB, MemoryModel};
use copus_core::model::ModelSpec;
use copus_core::policy::Rule;
use copus_core::schedule::ScheduleKind;
use copus_core::{CandidateSpace, ClusterModel, ClusterSpec, CopusRule};
use copus_models::{LlamaConfig, full_params};

/// Tokens per sequence the model reads.
const SEQ: usize = 64;

/// Sequence `i` of the run: `SEQ + 1` bytes of the text from a start that is a fixed
/// pseudo-random function of `i`, so any step's batch can be drawn again after a resume.
struct TextWindows(Vec<u8>);

impl DataSource for TextWindows {
    fn sequences(&self, first: u64, count: usize) -> Vec<i64> {
        let starts = (self.0.len() - SEQ - 1) as u64;
        (first..first + count as u64)
            .flat_map(|i| {
                let start = (i.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 11) % starts;
                self.0[start as usize..start as usize + SEQ + 1].iter().map(|&b| i64::from(b))
            })
            .collect()
    }
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let path = args.next().map_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../README.md"), PathBuf::from);
    let steps: u64 = args.next().map(|s| s.parse()).transpose()?.unwrap_or(40);
    let text = std::fs::read(&path).map_err(|e| format!("{}: {e}", path.display()))?;
    if text.len() < 4 * (SEQ + 1) {
        return Err(format!("{}: {} bytes is too little text", path.display(), text.len()).into());
    }
    let data = TextWindows(text);

    // The model, its starting weights and the candidate space: 2 ranks, B_g in {2, 4, ..., 32},
    // B_m in {1, 2, 4}, every layout of 2 ranks whose numbers divide and that fits in memory.
    let spec = ModelSpec { name: "bytes-1m".into(), vocab_size: 256, seq_len: SEQ, ..ModelSpec::tiny_1m() };
    let cfg = LlamaConfig::from_spec(&spec);
    let device = burn::tensor::Device::flex().autodiff();
    device.seed(0);
    let full = full_params(&cfg.init(&device));
    let space = CandidateSpace::new(2, vec![2, 4, 8, 16, 32], vec![1, 2, 4], ScheduleKind::OneFOneB, MemoryModel::fp32(), 8.0 * GIB)?
        .enumerate(&spec);
    // Throughput prior: the analytic model of CPU ranks on this machine, learned online from
    // what each step measures. The job starts at B_g 8, B_m 4 on the layout the prior rates
    // fastest, under the Copus policy.
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let prior = ClusterModel { memory: MemoryModel::fp32(), ..ClusterModel::new(ClusterSpec::cpu_ranks(2, cores), spec.clone()) };
    let job =
        JobBuilder::new(Arc::new(cfg), space, OptimConfig::new().with_lr(3e-3).with_b0(8).with_warmup_steps(0).with_total_steps(steps))
            .prior(&prior)?
            .start_batch(8, 4, None)
            // A short run: judged every 4 steps, a change of B_g after 8 steps of it.
            .copus(CopusRule::Learning {
                rule: Rule { window: 4, dwell_steps: 8, horizon: 60.0, layout_cost: 1.0, ..Rule::default() },
                belief: copus_core::belief::FamilyPriors::measured(),
            })
            .build(&full)?;
    let (mut driver, mut source) = (job.driver, job.orchestrator.ok_or("the Copus orchestrator")?);
    println!("policy {} from {}", source.policy_name(), job.start);

    println!("| step | configuration | loss | B_simple | samples/s | decision |\n|---:|---|---:|---:|---:|---|");
    for _ in 0..steps {
        let s = driver.step(&data, &mut source)?;
        let decision = match &s.decision {
            None => String::new(),
            Some(d) if d.applied => format!("-> {}", d.proposed),
            Some(d) => format!("refused {}: {}", d.proposed, d.refused.as_deref().unwrap_or("")),
        };
        let b = s.step.metrics.b_simple.map_or("-".into(), |b| format!("{b:.1}"));
        println!(
            "| {} | {} | {:.3} | {b} | {:.1} | {decision} |",
            s.step.metrics.step, s.candidate, s.step.metrics.loss, s.samples_per_sec
        );
    }
    println!("\nended at {} after {:.1} s on the wall clock", driver.current(), driver.clock_secs());
    Ok(())
}
