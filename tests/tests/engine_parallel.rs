//! The 3D-parallel engine against serial training, on 8 in-process ranks with the tiny-1m
//! preset (4 layers, 8 heads, 4 kv heads, tied embedding).

#![forbid(unsafe_code)]

use std::collections::HashMap;
use std::sync::Arc;

use burn::module::Module;
use burn::tensor::{Device, Int, Tensor};
use copus_burn::parallel::{ShardError, ShardPlan, ShardSource};
use copus_burn::{Engine, EngineConfig, EngineError, MicroBatch, OptimConfig, ParallelLm, ParallelPlan, StageModel, Trainer};
use copus_core::layout::{Coord, ParallelDims, RankGrid};
use copus_core::memory::Precision;
use copus_core::model::{ModelSpec, TpSplit};
use copus_core::schedule::ScheduleKind;
use copus_models::{LlamaConfig, LlamaStage, full_params};
use copus_tests::{SEQ, config, initial_of, rel, structured_batch};

const B_G: usize = 16;
const B_M: usize = 2;
const STEPS: usize = 5;

fn optim() -> OptimConfig {
    optim_at(1e-3)
}

fn optim_at(lr: f64) -> OptimConfig {
    OptimConfig { lr, warmup_steps: 2, total_steps: 10, b0: B_G, ..OptimConfig::default() }
}

/// One training setup: model, batch sizes, steps.
struct Setup {
    config: LlamaConfig,
    global_batch: usize,
    micro_batch: usize,
    steps: usize,
    /// Compare |G|^2 on the scale of the measured |g|^2 (for runs where it is near zero).
    cancellation_floor: bool,
    /// Peak learning rate.
    lr: f64,
}

impl Setup {
    fn standard() -> Self {
        Self { config: config(), global_batch: B_G, micro_batch: B_M, steps: STEPS, cancellation_floor: false, lr: 1e-3 }
    }
}

/// Step `step`'s batch: B_G sequences of SEQ + 1 tokens with some structure to learn.
fn batch(step: usize, vocab: usize) -> Vec<i64> {
    batch_of(step, vocab, B_G)
}

fn batch_of(step: usize, vocab: usize, sequences: usize) -> Vec<i64> {
    structured_batch(step, vocab, sequences)
}

struct Serial {
    stats: Vec<copus_core::gns::StepStats>,
    losses: Vec<f64>,
    grad_sq: Vec<f64>,
    trace: Vec<f64>,
    params: HashMap<String, Vec<f32>>,
    /// The trained model's mean loss per token on each of [`heldout`]'s sequences.
    heldout_losses: Vec<f64>,
}

/// Held-out sequences for the evaluation check: 11 of them, so that micro-batches of 2 leave a
/// short one and, on 8 replicas, some replicas without any.
fn heldout(vocab: usize) -> Vec<i64> {
    structured_batch(1000, vocab, 11)
}

/// The whole model's mean loss per token on each sequence of `windows`, one at a time (a
/// grouping unlike the engine's).
fn whole_model_losses(model: &copus_models::Llama, windows: &[i64]) -> Vec<f64> {
    let device = Device::flex();
    let model = model.valid();
    windows
        .chunks(SEQ + 1)
        .map(|w| {
            let b = MicroBatch::from_windows(&[w], &device);
            f64::from(model.loss_sum(b.inputs, b.targets).into_scalar::<f32>()) / SEQ as f64
        })
        .collect()
}

fn mean(v: &[f64]) -> f64 {
    v.iter().sum::<f64>() / v.len() as f64
}

fn serial(initial: &copus_models::Llama, setup: &Setup) -> Serial {
    let device = Device::flex().autodiff();
    let vocab = setup.config.shape.vocab_size;
    let mut trainer = Trainer::new(initial.clone(), optim_at(setup.lr)).unwrap();
    let (mut losses, mut grad_sq, mut trace, mut stats) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for step in 0..setup.steps {
        let tokens = batch_of(step, vocab, setup.global_batch);
        let windows: Vec<&[i64]> = tokens.chunks(SEQ + 1).collect();
        let micro: Vec<MicroBatch> = windows.chunks(setup.micro_batch).map(|w| MicroBatch::from_windows(w, &device)).collect();
        let m = trainer.step(&micro).unwrap();
        losses.push(m.loss);
        stats.push(*trainer.last_stats().unwrap());
        // With one micro-batch the first step has no estimate yet (differencing needs two).
        grad_sq.push(m.grad_sq.unwrap_or(f64::NAN));
        trace.push(m.trace.unwrap_or(f64::NAN));
    }
    let params = full_params(trainer.model()).into_iter().map(|(k, v)| (k, v.try_to_vec::<f32>().unwrap())).collect();
    let heldout_losses = whole_model_losses(trainer.model(), &heldout(vocab));
    Serial { stats, losses, grad_sq, trace, params, heldout_losses }
}

fn initial_model() -> copus_models::Llama {
    initial_of(&config())
}

#[test]
fn every_layout_of_8_ranks_matches_serial_training() {
    let layouts = [(8, 1, 1), (4, 2, 1), (4, 1, 2), (2, 4, 1), (2, 2, 2), (2, 1, 4), (1, 4, 2), (1, 2, 4)];
    check_against_serial(&Setup::standard(), &layouts);
}

/// Untied, the embedding's gradient is a sum over positions that cancels to near zero in some
/// elements; there AdamW's update `lr * m / (sqrt(v) + eps)` turns last-bit differences of the
/// summation order into differences of up to `lr`. This check therefore runs at lr 1e-4 (the
/// losses and noise statistics are compared as everywhere else).
#[test]
fn an_untied_head_matches_serial_training() {
    let setup = Setup { config: config().with_tied_embeddings(false), steps: 3, cancellation_floor: true, lr: 1e-4, ..Setup::standard() };
    check_against_serial(&setup, &[(2, 2, 2), (1, 4, 2), (2, 1, 4)]);
}

#[test]
fn one_micro_batch_per_step_uses_the_differencing_fallback_like_serial() {
    let setup = Setup { global_batch: 2, micro_batch: 2, steps: 4, ..Setup::standard() };
    check_against_serial(&setup, &[(1, 2, 4), (1, 4, 2)]);
}

fn check_against_serial(setup: &Setup, layouts: &[(usize, usize, usize)]) {
    let initial = initial_of(&setup.config);
    let reference = serial(&initial, setup);
    let full = full_params(&initial);
    for &(dp, tp, pp) in layouts {
        for schedule in [ScheduleKind::OneFOneB, ScheduleKind::GPipe] {
            if schedule == ScheduleKind::GPipe && pp == 1 {
                continue;
            }
            let dims = ParallelDims::new(dp, tp, pp, 8).unwrap();
            let name = format!("{dims} {schedule:?}");
            let mut ec = EngineConfig::new(dims, setup.global_batch, setup.micro_batch, SEQ, optim_at(setup.lr));
            ec.schedule = schedule;
            let mut engine = Engine::new(Arc::new(setup.config.clone()), &full, ec).unwrap();
            for step in 0..setup.steps {
                let out = engine.step(batch_of(step, setup.config.shape.vocab_size, setup.global_batch)).unwrap();
                let m = &out.metrics;
                assert!(
                    rel(m.loss, reference.losses[step]) < 1e-5,
                    "{name} step {step}: loss {} vs serial {}",
                    m.loss,
                    reference.losses[step]
                );
                // What the probe measured: the mean micro-batch |g_k|^2 and the step's |g|^2.
                let (want, got) = (&reference.stats[step], &out.stats);
                assert!(rel(got.mean_micro_sq_norm, want.mean_micro_sq_norm) < 1e-5, "{name} step {step}: L {got:?} vs {want:?}");
                assert!(rel(got.grad_sq_norm, want.grad_sq_norm) < 1e-5, "{name} step {step}: T {got:?} vs {want:?}");
                let (g, t) = (m.grad_sq.unwrap_or(f64::NAN), m.trace.unwrap_or(f64::NAN));
                if reference.grad_sq[step].is_nan() {
                    assert!(g.is_nan() && t.is_nan(), "{name} step {step}: an estimate where serial has none");
                    continue;
                }
                // |G|^2 = (n T - L) / (n - 1) cancels: where it is small next to T, compare on T's scale.
                let floor = if setup.cancellation_floor { want.grad_sq_norm } else { 0.0 };
                assert!(
                    (g - reference.grad_sq[step]).abs() <= 1e-4 * reference.grad_sq[step].abs().max(floor),
                    "{name} step {step}: |G|^2 {g} vs serial {}",
                    reference.grad_sq[step]
                );
                assert!(rel(t, reference.trace[step]) < 1e-4, "{name} step {step}: tr(Sigma) {t} vs serial {}", reference.trace[step]);
                assert_eq!(out.stats.num_micro, setup.global_batch / setup.micro_batch);
            }
            // The held-out loss on the ranks (forward only, each replica its share, no parameter
            // gathered) against the serially trained whole model.
            // All 11 sequences in micro-batches of 2, then the first 5 in micro-batches of 3.
            let windows = heldout(setup.config.shape.vocab_size);
            for (count, micro) in [(11, 2), (5, 3)] {
                let got = engine.evaluate(windows[..count * (SEQ + 1)].to_vec(), micro).unwrap();
                let want = mean(&reference.heldout_losses[..count]);
                assert!(rel(got, want) < 1e-5, "{name}: held-out loss of {count} sequences {got} vs serial {want}");
            }
            let (all, part) = (mean(&reference.heldout_losses), mean(&reference.heldout_losses[..5]));
            // (Ten times the tolerance apart: a replica's share lost or counted twice shows.)
            assert!(rel(all, part) > 1e-4, "the check needs sequences whose losses differ: {all} vs {part}");
            // Parameters after 5 steps.
            let params = engine.gather().unwrap();
            assert_eq!(params.len(), reference.params.len());
            for (k, want) in &reference.params {
                let got = &params[k];
                let worst = got.iter().zip(want).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
                assert!(worst <= 1e-4, "{name}: parameter {k} differs from serial by {worst}");
            }
            // Copies of a parameter on different ranks are bit-identical.
            let per_rank = engine.rank_params().unwrap();
            let grid = RankGrid::new(dims);
            let specs = setup.config.spec("t").param_specs();
            let mut seen: HashMap<(String, usize), &Vec<f32>> = HashMap::new();
            for (r, list) in per_rank.iter().enumerate() {
                let c = grid.coord(r).unwrap();
                for (n, _, v) in list {
                    let split = specs.iter().find(|s| &s.name == n).map(|s| !matches!(s.tp, TpSplit::Replicated)).unwrap();
                    let key = (n.clone(), if split { c.tp } else { 0 });
                    match seen.get(&key) {
                        Some(first) => assert!(
                            first.iter().zip(v.iter()).all(|(a, b)| a.to_bits() == b.to_bits()),
                            "{name}: copies of {n} differ on rank {r}"
                        ),
                        None => {
                            seen.insert(key, v);
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn layouts_that_do_not_fit_are_errors_naming_the_numbers() {
    let full = full_params(&initial_model());
    let try_dims = |dp, tp, pp| {
        let dims = ParallelDims { dp, tp, pp };
        Engine::new(Arc::new(config()), &full, EngineConfig::new(dims, B_G, B_M, SEQ, optim())).err().unwrap().to_string()
    };
    let e = try_dims(1, 8, 1);
    assert!(e.contains("tp = 8") && e.contains("(4)"), "{e}");
    let e = try_dims(1, 1, 8);
    assert!(e.contains('8') && e.contains('4'), "{e}");
    assert!(ParallelDims::new(2, 2, 1, 8).unwrap_err().to_string().contains('8'));
    let dims = ParallelDims::new(4, 2, 1, 8).unwrap();
    let e = Engine::new(Arc::new(config()), &full, EngineConfig::new(dims, 12, 2, SEQ, optim())).err().unwrap().to_string();
    assert!(e.contains("12") && e.contains("4 x 2"), "{e}");
    let mut engine = Engine::new(Arc::new(config()), &full, EngineConfig::new(dims, B_G, B_M, SEQ, optim())).unwrap();
    let e = engine.step(vec![0; 5]).unwrap_err().to_string();
    assert!(e.contains("16 sequences of 33 tokens"), "{e}");
    let mut bad = batch(0, 2048);
    bad[7] = 5000;
    assert!(engine.step(bad).unwrap_err().to_string().contains("5000"));
    // An evaluation's input too: whole sequences, a micro-batch of one at least, the vocabulary.
    let e = engine.evaluate(vec![0; SEQ + 2], 2).unwrap_err().to_string();
    assert!(e.contains("whole sequences of 33 tokens"), "{e}");
    assert!(engine.evaluate(Vec::new(), 2).is_err());
    assert!(engine.evaluate(vec![0; SEQ + 1], 0).unwrap_err().to_string().contains("at least one"));
    let mut bad = heldout(2048);
    bad[3] = -1;
    assert!(engine.evaluate(bad, 2).unwrap_err().to_string().contains("-1"));
    // Bad input is refused before any rank runs: the engine still trains and evaluates.
    engine.step(batch(0, 2048)).unwrap();
    assert!(engine.evaluate(heldout(2048), 2).unwrap().is_finite());
}

/// Llama whose stage on one rank panics in its third block.
struct Faulty {
    inner: LlamaConfig,
    tp_rank: usize,
    stage: usize,
}

#[derive(Module, Debug)]
struct FaultyStage {
    inner: LlamaStage,
    fail: bool,
}

impl StageModel for FaultyStage {
    type Ctx = <LlamaStage as StageModel>::Ctx;
    fn context(&self, s: usize, p: Precision) -> Self::Ctx {
        self.inner.context(s, p)
    }
    fn embed(&self, t: Tensor<2, Int>) -> Tensor<3> {
        self.inner.embed(t)
    }
    fn num_blocks(&self) -> usize {
        self.inner.num_blocks()
    }
    fn block(&self, i: usize, x: Tensor<3>, ctx: &Self::Ctx) -> Tensor<3> {
        assert!(!(self.fail && i == 2), "injected fault in block {i}");
        self.inner.block(i, x, ctx)
    }
    fn logits(&self, x: Tensor<3>, ctx: &Self::Ctx) -> Tensor<3> {
        self.inner.logits(x, ctx)
    }
    fn global_name(&self, p: &str) -> String {
        self.inner.global_name(p.strip_prefix("inner.").unwrap_or(p))
    }
}

impl ParallelLm for Faulty {
    type Stage = FaultyStage;
    fn spec(&self) -> ModelSpec {
        ParallelLm::spec(&self.inner)
    }
    fn parallel_plan(&self) -> ParallelPlan {
        self.inner.parallel_plan()
    }
    fn build_stage(&self, plan: &ShardPlan, src: &mut ShardSource, device: &Device) -> Result<FaultyStage, ShardError> {
        let inner = self.inner.build_stage(plan, src, device)?;
        Ok(FaultyStage { inner, fail: plan.tp_rank == self.tp_rank && plan.stage == self.stage })
    }
}

#[test]
fn a_panicking_rank_fails_the_step_with_its_message() {
    let full = full_params(&initial_model());
    let dims = ParallelDims::new(2, 2, 2, 8).unwrap();
    let model = Arc::new(Faulty { inner: config(), tp_rank: 1, stage: 1 });
    let mut engine = Engine::new(model, &full, EngineConfig::new(dims, B_G, B_M, SEQ, optim())).unwrap();
    let e = engine.step(batch(0, 2048)).unwrap_err();
    let grid = RankGrid::new(dims);
    let failing = [grid.rank(Coord { dp: 0, tp: 1, pp: 1 }), grid.rank(Coord { dp: 1, tp: 1, pp: 1 })];
    match &e {
        EngineError::Rank { rank, message } => {
            assert!(failing.contains(rank), "{e}");
            assert!(message.contains("injected fault in block 2"), "{e}");
        }
        other => panic!("expected a rank failure, got {other}"),
    }
    // The engine says it is stopped rather than hanging or training on.
    assert!(matches!(engine.step(batch(1, 2048)), Err(EngineError::Dead(_))));
}

/// Activation checkpointing drops a micro-batch's activations after its forward pass and
/// recomputes them in the backward pass: on each kind of layout (serial, dp with pp under GPipe,
/// tp with pp under 1F1B, dp with tp) five steps train as without it. Under tensor parallelism (the region path either way) the recomputation
/// repeats the forward's arithmetic, so the numbers are bit-equal; at tp = 1 the run without
/// checkpointing is one autodiff graph, which adds the same terms in another order: losses
/// within 1e-6, weights within 1e-5 of their norm and each within 1e-4.
#[test]
fn checkpointed_training_matches_training_without() {
    use copus_burn::engine::config::Checkpointing;
    let run = |dims: ParallelDims, schedule: ScheduleKind, ck: Checkpointing| {
        let ec = EngineConfig::new(dims, 8, B_M, SEQ, optim()).with_schedule(schedule).with_checkpointing(ck);
        let mut engine = Engine::new(Arc::new(config()), copus_tests::initial_full(), ec).unwrap();
        let losses: Vec<f64> = (0..STEPS).map(|s| engine.step(batch_of(s, 2048, 8)).unwrap().metrics.loss).collect();
        (losses, engine.gather().unwrap())
    };
    for (dp, tp, pp, schedule) in [
        (1, 1, 1, ScheduleKind::OneFOneB),
        (2, 1, 2, ScheduleKind::GPipe),
        (1, 2, 2, ScheduleKind::OneFOneB),
        (2, 2, 1, ScheduleKind::OneFOneB),
    ] {
        let dims = copus_tests::dims(dp, tp, pp);
        let (want, want_w) = run(dims, schedule, Checkpointing::None);
        for ck in [Checkpointing::Layers, Checkpointing::Regions] {
            let name = format!("{dims} {schedule:?} {ck:?}");
            let (got, got_w) = run(dims, schedule, ck);
            for (s, (a, b)) in got.iter().zip(&want).enumerate() {
                if tp > 1 {
                    assert_eq!(a.to_bits(), b.to_bits(), "{name} step {s}: loss {a} vs {b} without checkpointing");
                } else {
                    assert!(rel(*a, *b) <= 1e-6, "{name} step {s}: loss {a} vs {b} without checkpointing");
                }
            }
            let (mut worst, mut diff_sq, mut norm_sq) = (0f64, 0f64, 0f64);
            for (k, w) in &want_w {
                for (p, q) in w.iter().zip(&got_w[k]) {
                    let d = f64::from(p - q);
                    (worst, diff_sq, norm_sq) = (worst.max(d.abs()), diff_sq + d * d, norm_sq + f64::from(*p) * f64::from(*p));
                }
            }
            if tp > 1 {
                assert_eq!(worst, 0.0, "{name}: weights differ by {worst}");
            }
            assert!((diff_sq / norm_sq).sqrt() <= 1e-5 && worst <= 1e-4, "{name}: weights differ by {worst} at most");
        }
    }
}

/// bf16 mixed precision on Flex against f32: 20 steps of tiny-1m, serial (two batches in turn). bf16 rounds every
/// product's inputs to 8 bits of mantissa (relative error up to 2^-9), so the losses differ, but
/// by little: every step's within 2% of f32's, the first within 0.5%, and the run learns (its
/// loss falls by at least half as much as f32's). Then 5 steps on dp2 x tp2 x pp2 with
/// checkpointing by region (the recomputation and the untracked forms in bf16) against the
/// serial bf16 run, and the held-out loss of both precisions. The master weights stay f32: the
/// gather reads every parameter as f32 strictly (it refuses another element type).
#[test]
fn bf16_mixed_precision_trains_like_f32() {
    use copus_burn::engine::config::Checkpointing;
    const N: usize = 20;
    let run = |dims: ParallelDims, precision: Precision, ck: Checkpointing, steps: usize| {
        let optim = OptimConfig { lr: 5e-3, warmup_steps: 2, total_steps: N as u64, b0: 8, ..OptimConfig::default() };
        let ec =
            EngineConfig::new(dims, 8, B_M, SEQ, optim).with_schedule(ScheduleKind::GPipe).with_checkpointing(ck).with_precision(precision);
        let mut engine = Engine::new(Arc::new(config()), copus_tests::initial_full(), ec).unwrap();
        // Two batches in turn, so that 20 steps learn something.
        let losses: Vec<f64> = (0..steps).map(|s| engine.step(batch_of(s % 2, 2048, 8)).unwrap().metrics.loss).collect();
        let eval = engine.evaluate(batch_of(1000, 2048, 6), 2).unwrap();
        let weights = engine.gather().unwrap();
        (losses, eval, weights)
    };
    let serial = copus_tests::dims(1, 1, 1);
    let (f32_losses, f32_eval, _) = run(serial, Precision::F32, Checkpointing::None, N);
    let (bf16_losses, bf16_eval, bf16_w) = run(serial, Precision::Bf16Mixed, Checkpointing::None, N);
    let report = format!("f32 {f32_losses:?}\nbf16 {bf16_losses:?}");
    let worst = f32_losses.iter().zip(&bf16_losses).map(|(a, b)| rel(*b, *a)).fold(0.0, f64::max);
    eprintln!("{report}\nlargest relative difference {worst:.4}; held-out f32 {f32_eval} bf16 {bf16_eval}");
    assert!(f32_losses.iter().zip(&bf16_losses).any(|(a, b)| a != b), "bf16 ran as f32: {report}");
    assert!(rel(bf16_losses[0], f32_losses[0]) <= 5e-3, "{report}");
    for (s, (b, a)) in bf16_losses.iter().zip(&f32_losses).enumerate() {
        assert!(rel(*b, *a) <= 0.02, "step {s}: {report}");
    }
    let (drop_f32, drop_bf16) = (f32_losses[0] - f32_losses[N - 1], bf16_losses[0] - bf16_losses[N - 1]);
    assert!(drop_f32 > 0.5 && drop_bf16 >= 0.5 * drop_f32, "{report}");
    assert!(rel(bf16_eval, f32_eval) <= 0.02, "held-out {bf16_eval} vs {f32_eval}");
    assert!(bf16_w.values().flatten().all(|w| w.is_finite()));

    let (par_losses, par_eval, _) = run(copus_tests::dims(2, 2, 2), Precision::Bf16Mixed, Checkpointing::Regions, STEPS);
    eprintln!("dp2,tp2,pp2 bf16 {par_losses:?}");
    for (s, (p, b)) in par_losses.iter().zip(&bf16_losses).enumerate() {
        assert!(rel(*p, *b) <= 0.01, "dp2,tp2,pp2 bf16 step {s}: {p} vs serial {b}");
    }
    let (_, serial_eval_5, _) = run(serial, Precision::Bf16Mixed, Checkpointing::None, STEPS);
    assert!(rel(par_eval, serial_eval_5) <= 0.01, "held-out {par_eval} vs {serial_eval_5}");
}
