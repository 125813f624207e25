//! Scoring every candidate with the Copus policy: world size 32 (4 nodes of 8 H100), 12 global
//! batch sizes and 6 micro-batch sizes, Llama-2-13B, analytic cluster model.
//!
//! `cargo bench -p copus-core --bench policy`

#![forbid(unsafe_code)]

use std::hint::black_box;

use copus_core::candidates::{Candidate, CandidateSpace};
use copus_core::gns::NoiseEstimate;
use copus_core::memory::MemoryModel;
use copus_core::model::ModelSpec;
use copus_core::policy::{Copus, Policy, Scorer, StepObservation, SwitchRule};
use copus_core::schedule::ScheduleKind;
use copus_core::throughput::{ClusterModel, ClusterSpec};
use criterion::{Criterion, criterion_main};

const GLOBAL: [usize; 12] = [8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512];
const MICRO: [usize; 6] = [1, 2, 3, 4, 6, 8];

fn setup() -> (CandidateSpace, ClusterModel) {
    let cm = ClusterModel::new(ClusterSpec::h100_nvlink(4), ModelSpec::llama_2_13b());
    let space = CandidateSpace::new(32, GLOBAL.to_vec(), MICRO.to_vec(), ScheduleKind::OneFOneB, MemoryModel::mixed_bf16(), 80e9)
        .expect("valid space");
    (space, cm)
}

fn observation(current: Candidate) -> StepObservation {
    StepObservation {
        step: 100,
        current,
        noise: Some(NoiseEstimate { grad_sq: 1.0, trace: 300.0, biased: false, grad_sq_se: 0.0, trace_se: 0.0 }),
        remaining_secs: None,
    }
}

fn bench(c: &mut Criterion) {
    let (space, cm) = setup();
    let all = space.enumerate(&cm.model);
    let cands = all.feasible.clone();
    eprintln!(
        "configurations: {} ({} feasible, {} rejected)",
        all.feasible.len() + all.rejected.len(),
        all.feasible.len(),
        all.rejected.len()
    );
    let scorer = Scorer::plain(&cands, &cm, 8.0).expect("candidates");
    let current = cands[0];
    let mut policy = Copus::new(scorer, SwitchRule::default()).expect("rule");

    let mut g = c.benchmark_group("copus_world32_12x6");
    // Per step: the throughput of each candidate is known; score all and decide.
    g.bench_function("decide", |b| b.iter(|| black_box(policy.decide(black_box(&observation(current))))));
    // From nothing: enumerate all 21 x 12 x 6 configurations with memory checks, predict each
    // throughput with the cluster model, score, decide.
    g.bench_function("enumerate_predict_decide", |b| {
        b.iter(|| {
            let cands = space.enumerate(black_box(&cm.model)).feasible;
            let scorer = Scorer::plain(&cands, &cm, 8.0).expect("candidates");
            let mut p = Copus::new(scorer, SwitchRule::default()).expect("rule");
            black_box(p.decide(&observation(cands[0])))
        })
    });
    g.finish();
}

/// The group `criterion_main!` runs: [`bench`] under Criterion's defaults and the command line's
/// options. This is what `criterion_group!(benches, bench)` expands to, written out because the
/// macro's function is `pub` and cannot carry a doc comment (`missing_docs`).
fn benches() {
    let mut criterion = Criterion::default().configure_from_args();
    bench(&mut criterion);
}

criterion_main!(benches);
