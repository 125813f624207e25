//! The burn-train add-on on a task with a known noise scale: least squares with Gaussian inputs.
//!
//! `y = w* . x + sigma e`, `x ~ N(0, I_d)`, loss `(w . x - y)^2`. With `delta = w - w*` the
//! per-sample gradient `2 (delta . x - sigma e) x` has mean `G = 2 delta` and
//! `tr(Sigma) = 4 ((d + 1) |delta|^2 + d sigma^2)`, so
//! `B_simple = ((d + 1) |delta|^2 + d sigma^2) / |delta|^2`: it grows as training closes in.

#![forbid(unsafe_code)]

use std::sync::{Arc, Mutex};

use burn::data::dataloader::batcher::Batcher;
use burn::data::dataloader::{BatchDataLoader, DataLoader, DataLoaderBuilder, MultiThreadDataLoader};
use burn::data::dataset::InMemDataset;
use burn::module::{Module, Param};
use burn::optim::lr_scheduler::constant::ConstantLr;
use burn::optim::{AdamConfig, ModuleOptimizer, SgdConfig};
use burn::tensor::{Device, Tensor, TensorData};
use burn::train::{
    ExecutionStrategy, InferenceStep, Interrupter, Learner, RegressionOutput, SupervisedTraining, TrainOutput, TrainStep, TrainingStrategy,
};
use copus_burn::learner::{CopusBatching, CopusBatchingConfig, CopusTrainingExt, StepRecord};
use copus_core::accumulation::{Plan, StepCost, best_plan};
use copus_core::goodput::{LrRule, PlainGoodput};
use rand::{Rng, SeedableRng, rngs::StdRng};

const D: usize = 16;
const SIGMA: f64 = 1.0;

fn w_star() -> Vec<f32> {
    let mut rng = StdRng::seed_from_u64(123);
    (0..D).map(|_| normal(&mut rng) as f32).collect()
}

fn normal(rng: &mut StdRng) -> f64 {
    // Box-Muller, so the test needs no distribution crate.
    let u: f64 = rng.random::<f64>().max(1e-300);
    let v: f64 = rng.random();
    (-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos()
}

fn true_b_simple(delta_sq: f64) -> f64 {
    ((D as f64 + 1.0) * delta_sq + D as f64 * SIGMA * SIGMA) / delta_sq
}

#[derive(Clone, Debug)]
struct Sample {
    x: Vec<f32>,
    y: f32,
}

fn samples(n: usize, seed: u64) -> Vec<Sample> {
    let ws = w_star();
    let mut rng = StdRng::seed_from_u64(seed);
    (0..n)
        .map(|_| {
            let x: Vec<f32> = (0..D).map(|_| normal(&mut rng) as f32).collect();
            let y = x.iter().zip(&ws).map(|(a, b)| f64::from(a * b)).sum::<f64>() + SIGMA * normal(&mut rng);
            Sample { x, y: y as f32 }
        })
        .collect()
}

#[derive(Clone, Debug)]
struct Batch {
    x: Tensor<2>,
    y: Tensor<2>,
}

#[derive(Clone)]
struct RegBatcher;

impl Batcher<Sample, Batch> for RegBatcher {
    fn batch(&self, items: Vec<Sample>, device: &Device) -> Batch {
        let n = items.len();
        let x: Vec<f32> = items.iter().flat_map(|s| s.x.iter().copied()).collect();
        let y: Vec<f32> = items.iter().map(|s| s.y).collect();
        Batch { x: Tensor::from_data(TensorData::new(x, [n, D]), device), y: Tensor::from_data(TensorData::new(y, [n, 1]), device) }
    }
}

/// What the model sees at each training step: `|w - w*|^2` before the step's update, and an
/// interrupter to stop at a target.
#[derive(Default)]
struct ProbeState {
    delta_sq: Vec<f64>,
    target: Option<f64>,
    interrupter: Option<Interrupter>,
    hit_at_micro_batch: Option<usize>,
}

#[derive(Clone, Default)]
struct Probe(Arc<Mutex<ProbeState>>);

impl std::fmt::Debug for Probe {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Probe")
    }
}

#[derive(Module, Debug)]
struct Regression {
    w: Param<Tensor<2>>,
    #[module(skip)]
    probe: Probe,
}

impl Regression {
    fn new(device: &Device, probe: Probe) -> Self {
        let w = Tensor::zeros([D, 1], device);
        Self { w: Param::from_tensor(w), probe }
    }

    fn weights(&self) -> Vec<f32> {
        self.w.val().into_data().try_to_vec::<f32>().unwrap()
    }

    fn forward(&self, b: Batch) -> RegressionOutput {
        let pred = b.x.matmul(self.w.val());
        let loss = (pred.clone() - b.y.clone()).powi_scalar(2).mean();
        RegressionOutput { loss, output: pred, targets: b.y }
    }
}

fn delta_sq(w: &[f32]) -> f64 {
    w.iter().zip(w_star()).map(|(a, b)| f64::from(a - b).powi(2)).sum()
}

impl TrainStep for Regression {
    type Input = Batch;
    type Output = RegressionOutput;

    fn step(&self, b: Batch) -> TrainOutput<RegressionOutput> {
        let d = delta_sq(&self.weights());
        {
            let mut p = self.probe.0.lock().unwrap();
            p.delta_sq.push(d);
            if let Some(t) = p.target
                && d <= t
                && p.hit_at_micro_batch.is_none()
            {
                p.hit_at_micro_batch = Some(p.delta_sq.len());
                if let Some(i) = &p.interrupter {
                    i.stop(Some("target reached"));
                }
            }
        }
        let out = self.forward(b);
        let grads = out.loss.backward();
        TrainOutput::new(self, grads, out)
    }
}

impl InferenceStep for Regression {
    type Input = Batch;
    type Output = RegressionOutput;

    fn step(&self, b: Batch) -> RegressionOutput {
        self.forward(b)
    }
}

fn device() -> Device {
    Device::flex().autodiff()
}

#[derive(Clone, Copy)]
enum Optim {
    Sgd,
    Adam,
}

fn optimizer(o: &Optim) -> ModuleOptimizer {
    match o {
        Optim::Sgd => SgdConfig::new().init(),
        Optim::Adam => AdamConfig::new().init(),
    }
}

struct RunOut {
    copus: CopusBatching,
    history: Vec<StepRecord>,
    probe: ProbeState,
    weights: Vec<f32>,
    /// Where burn-train's file logger wrote the metrics.
    dir: tempfile::TempDir,
}

/// Trains through `SupervisedTraining` with the copus strategy and returns what happened.
fn run(cfg: CopusBatchingConfig, lr: f64, optim: Optim, data: Vec<Sample>, target: Option<f64>, adaptive_loader: bool) -> RunOut {
    run_on(cfg, lr, optim, data, target, adaptive_loader, 1)
}

fn run_on(
    cfg: CopusBatchingConfig,
    lr: f64,
    optim: Optim,
    data: Vec<Sample>,
    target: Option<f64>,
    adaptive_loader: bool,
    devices: usize,
) -> RunOut {
    let copus = cfg.init().expect("valid settings");
    let dev = device();
    let probe = Probe::default();
    let model = Regression::new(&dev, probe.clone());
    let train: Arc<dyn DataLoader<Batch>> = if adaptive_loader {
        Arc::new(BatchDataLoader::new(
            Box::new(copus.batch_strategy()),
            Arc::new(InMemDataset::new(data)),
            Arc::new(RegBatcher),
            dev.clone(),
            None,
        ))
    } else {
        DataLoaderBuilder::new(RegBatcher).batch_size(cfg.micro_batch).build(InMemDataset::new(data))
    };
    let valid = DataLoaderBuilder::new(RegBatcher).batch_size(64).build(InMemDataset::new(samples(64, 999)));
    let dir = tempfile::tempdir().unwrap();
    let training = SupervisedTraining::new(dir.path(), train, valid)
        .with_application_logger(None)
        .with_training_strategy(if devices == 1 {
            copus.training_strategy(dev.clone())
        } else {
            copus.training_strategy_multi(vec![dev.clone(); devices]).expect("valid device count")
        })
        .metric_train_numeric(copus.noise_scale_metric())
        .metric_train_numeric(copus.batch_size_metric())
        .metric_train_numeric(copus.efficiency_metric())
        .num_epochs(1);
    {
        let mut p = probe.0.lock().unwrap();
        p.target = target;
        p.interrupter = Some(training.interrupter());
    }
    let learner = Learner::new(model, optimizer(&optim), copus.lr_scheduler(ConstantLr::from(lr)));
    let result = training.launch(learner);
    assert!(result.error.is_none(), "training failed: {:?}", result.error);
    let weights = result.model.weights();
    drop(result);
    let probe = std::mem::take(&mut *probe.0.lock().unwrap());
    RunOut { history: copus.history(), copus, probe, weights, dir }
}

/// (optimizer steps, samples) to reach the target: the steps before the micro-batch that saw it.
fn steps_and_samples(out: &RunOut) -> Option<(u64, u64)> {
    let hit = out.probe.hit_at_micro_batch?;
    let mut micro = 0;
    for r in &out.history {
        if micro + 1 >= hit {
            break;
        }
        micro += r.micro_batches;
        if micro + 1 >= hit {
            return Some((r.step, r.samples_total));
        }
    }
    (hit == 1).then_some((0, 0))
}

const COST: StepCost = StepCost { per_micro_batch: 0.0, per_sample: 1.0, per_step: 2.0 };

fn adaptive(micro: usize, k0: usize, kmax: usize) -> CopusBatchingConfig {
    CopusBatchingConfig::new(micro)
        .with_initial_accumulation(k0)
        .with_max_accumulation(kmax)
        .with_lr_rule(LrRule::Sqrt)
        .with_adapt_every(5)
        .with_cost(Some(COST))
}

#[test]
fn batch_grows_with_the_measured_noise_scale() {
    let out = run(adaptive(2, 2, 64), 0.01, Optim::Sgd, samples(24_000, 1), None, false);
    let h = &out.history;
    assert!(h.len() > 300, "{} steps", h.len());
    let b0 = out.copus.b0() as f64;

    // The estimate tracks the closed form while the noise scale rises from ~20 to the hundreds.
    let mut micro = 0;
    let mut ratios = Vec::new();
    for r in h {
        micro += r.micro_batches;
        let d = out.probe.delta_sq[micro.min(out.probe.delta_sq.len() - 1)];
        let truth = true_b_simple(d);
        if let Some(est) = r.b_simple
            && r.step > 20
            && truth < 400.0
        {
            ratios.push(est / truth);
        }
    }
    ratios.sort_by(f64::total_cmp);
    let median = ratios[ratios.len() / 2];
    println!(
        "B_simple estimate / closed form: median {median:.3}, quartiles {:.3} {:.3}",
        ratios[ratios.len() / 4],
        ratios[3 * ratios.len() / 4]
    );
    assert!(ratios.len() > 50 && (0.7..1.4).contains(&median), "median estimate / truth {median} over {} steps", ratios.len());

    // Every decision is the Goodput optimum at the measured noise scale, so the batch follows it.
    let mut plan = Plan { micro_batch: 2, accumulation: 2 };
    let mut batches = vec![plan.batch()];
    for r in h {
        if let Some(next) = r.switched_to {
            let phi = r.b_simple.unwrap_or(1e12);
            let best = best_plan(&COST, &PlainGoodput, phi, b0, &[2], 64, 4).unwrap();
            assert_eq!(next, best.plan, "step {}: phi {phi}", r.step);
            assert!(next != plan);
            plan = next;
            batches.push(plan.batch());
        }
    }
    let first_phi = h.iter().find_map(|r| r.b_simple).unwrap();
    let last_phi = h.iter().rev().find_map(|r| r.b_simple).unwrap();
    let last = *batches.last().unwrap();
    println!("noise scale {first_phi:.1} -> {last_phi:.1}; batches {batches:?}");
    assert!(last_phi > 5.0 * first_phi);
    assert!(last >= 8 * batches[0], "batch {} -> {last}", batches[0]);
    // Mostly upward: a step down is at most one decision's noise.
    let downs = batches.windows(2).filter(|w| w[1] < w[0]).count();
    assert!(downs * 3 <= batches.len(), "{batches:?}");
    // Samples per step match the plan, and the LR factor follows the sqrt rule.
    for r in h {
        if r.step < h.len() as u64 {
            assert_eq!(r.samples, r.plan.batch(), "step {}", r.step);
        }
        let expected = (r.plan.batch() as f64 / b0).sqrt();
        assert!((r.lr_factor - expected).abs() < 1e-12, "step {}: factor {} under {:?}", r.step, r.lr_factor, r.plan);
    }
    let snap = out.copus.snapshot();
    assert_eq!(snap.plan, plan);
    let eff = snap.efficiency.unwrap();
    let phi = snap.b_simple.unwrap_or(1e12);
    assert!((eff - (phi + b0) / (phi + plan.batch() as f64)).abs() < 1e-9);
}

#[test]
fn adaptive_reaches_the_target_in_fewer_steps_than_b0_and_fewer_samples_than_the_big_batch() {
    let target = 0.15;
    let lr0 = 0.01;
    let (micro, k0, kbig) = (2, 2, 32);
    let mut table = Vec::new();
    for seed in [11, 12, 13] {
        let data = samples(6_000, seed);
        let small = run(adaptive(micro, k0, k0).with_frozen(true), lr0, Optim::Sgd, data.clone(), Some(target), false);
        // The big batch uses the same rule's learning rate for its size.
        let big_lr = lr0 * ((micro * kbig) as f64 / (micro * k0) as f64).sqrt();
        let big = run(adaptive(micro, kbig, kbig).with_frozen(true), big_lr, Optim::Sgd, data.clone(), Some(target), false);
        let adapt = run(adaptive(micro, k0, kbig), lr0, Optim::Sgd, data, Some(target), false);
        let s = steps_and_samples(&small).expect("B0 run reaches the target");
        let b = steps_and_samples(&big).expect("big-batch run reaches the target");
        let a = steps_and_samples(&adapt).expect("adaptive run reaches the target");
        println!(
            "seed {seed}: steps/samples to |w - w*|^2 <= {target}: B0=4 {s:?}, B=64 {b:?}, adaptive {a:?} (final batch {})",
            adapt.copus.snapshot().plan.batch()
        );
        table.push((s, b, a));
        assert!(a.0 < s.0, "adaptive {a:?} vs B0 {s:?}");
        assert!(a.1 <= b.1, "adaptive {a:?} vs big {b:?}");
    }
}

#[test]
fn optimizer_state_is_kept_across_batch_changes() {
    let data = samples(3_000, 5);
    let lr = 0.02;
    let cfg = adaptive(2, 2, 16).with_adapt_every(3).with_min_observations(3);
    let out = run(cfg, lr, Optim::Adam, data.clone(), None, true);
    let switches = out.history.iter().filter(|r| r.switched_to.is_some()).count();
    assert!(switches >= 2, "the run must change batch to test anything ({switches} changes)");

    // Replay the same steps by hand: one Adam whose state lives through every change.
    let replay = |fresh_optimizer_on_change: bool| -> Vec<f32> {
        let dev = device();
        let mut model = Regression::new(&dev, Probe::default());
        let mut optim = optimizer(&Optim::Adam);
        let mut next = 0;
        let mut prev_batch = None;
        for r in &out.history {
            if fresh_optimizer_on_change && prev_batch.is_some_and(|b| b != r.samples) {
                optim = optimizer(&Optim::Adam);
            }
            prev_batch = Some(r.samples);
            let mut sum: Option<burn::optim::GradientsParams> = None;
            for _ in 0..r.micro_batches {
                let b = RegBatcher.batch(data[next..next + 2].to_vec(), &dev);
                next += 2;
                let o = TrainStep::step(&model, b);
                sum = Some(copus_burn::grads::add(&model, sum, o.grads));
            }
            let mean = copus_burn::grads::scaled(&model, &sum.unwrap(), 1.0 / r.micro_batches as f64);
            model = optim.step(lr * r.lr_factor, model, mean);
        }
        model.weights()
    };
    let kept = replay(false);
    let reset = replay(true);
    let diff = |a: &[f32], b: &[f32]| a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0f32, f32::max);
    assert!(diff(&out.weights, &kept) < 1e-5, "copus vs replay with kept state: {}", diff(&out.weights, &kept));
    assert!(diff(&out.weights, &reset) > 1e-3, "a reset optimizer must be told apart: {}", diff(&out.weights, &reset));

    // Burn's file logger holds one batch-size entry per micro-batch: the batch of its step.
    let logged = std::fs::read_to_string(out.dir.path().join("train/epoch-1/Batch_Size.log")).expect("metric log");
    let logged: Vec<f64> =
        logged.lines().filter(|l| !l.ends_with(",final")).map(|l| l.split(',').next().unwrap().parse().unwrap()).collect();
    let expected: Vec<f64> = out.history.iter().flat_map(|r| std::iter::repeat_n(r.plan.batch() as f64, r.micro_batches)).collect();
    assert!(logged == expected, "logged {} entries, {} expected", logged.len(), expected.len());
    let noise = std::fs::read_to_string(out.dir.path().join("train/epoch-1/Noise_Scale_(B_simple).log")).expect("metric log");
    let noise: Vec<f64> = noise.lines().filter(|l| !l.ends_with(",final")).map(|l| l.split(',').next().unwrap().parse().unwrap()).collect();
    // Logged only while measured (from the first step, and not while |G|^2 reads <= 0).
    assert!(noise.len() > expected.len() / 4 && noise.len() <= expected.len(), "{} B_simple entries", noise.len());
    assert!(noise.iter().all(|&v| v.is_finite() && v >= 0.0));
}

#[test]
fn two_devices_match_a_replay_of_their_rounds() {
    // Burn's multi-device step on two (CPU) devices: each round is one micro-batch from each
    // half of the data, and steps hold whole rounds.
    let data = samples(3_000, 9);
    let lr = 0.02;
    let cfg = adaptive(2, 2, 16).with_adapt_every(3).with_min_observations(3);
    let out = run_on(cfg, lr, Optim::Adam, data.clone(), None, false, 2);
    assert!(out.history.iter().all(|r| r.plan.accumulation % 2 == 0 && r.micro_batches % 2 == 0));
    assert!(out.history.iter().filter(|r| r.switched_to.is_some()).count() >= 1, "the batch changed");
    assert_eq!(out.history.iter().map(|r| r.samples).sum::<usize>(), 3_000);

    let dev = device();
    let mut model = Regression::new(&dev, Probe::default());
    let mut optim = optimizer(&Optim::Adam);
    let (mut a, mut b) = (0, 1_500);
    for r in &out.history {
        let mut sum: Option<burn::optim::GradientsParams> = None;
        for _ in 0..r.micro_batches / 2 {
            for at in [&mut a, &mut b] {
                let o = TrainStep::step(&model, RegBatcher.batch(data[*at..*at + 2].to_vec(), &dev));
                *at += 2;
                sum = Some(copus_burn::grads::add(&model, sum, o.grads));
            }
        }
        let mean = copus_burn::grads::scaled(&model, &sum.unwrap(), 1.0 / r.micro_batches as f64);
        model = optim.step(lr * r.lr_factor, model, mean);
    }
    let diff = out.weights.iter().zip(model.weights()).map(|(x, y)| (x - y).abs()).fold(0.0f32, f32::max);
    assert!(diff < 1e-5, "two devices vs replay: {diff}");
}

#[test]
fn device_counts_the_plan_cannot_fill_are_refused() {
    let copus = adaptive(2, 3, 16).init().unwrap();
    let e = copus.training_strategy_multi::<Regression>(vec![device(); 2]).err().unwrap().to_string();
    assert!(e.contains("`initial_accumulation`") && e.contains("multiple of the 2 devices"), "{e}");
    let copus = adaptive(2, 1, 1).init().unwrap();
    let e = copus.training_strategy_multi::<Regression>(vec![device(); 2]).err().unwrap().to_string();
    assert!(e.contains("`initial_accumulation`") || e.contains("`max_accumulation`"), "{e}");
    assert!(copus.training_strategy_multi::<Regression>(Vec::new()).is_err());
}

#[test]
fn micro_batch_changes_reach_the_loader() {
    // A fixed cost per micro-batch makes bigger micro-batches pay off once the noise allows it.
    let cost = StepCost { per_micro_batch: 8.0, per_sample: 1.0, per_step: 2.0 };
    let cfg = adaptive(2, 2, 16).with_micro_batch_options(vec![2, 4, 8]).with_cost(Some(cost));
    let out = run(cfg, 0.01, Optim::Sgd, samples(6_000, 7), None, true);
    let final_plan = out.copus.snapshot().plan;
    assert!(final_plan.micro_batch > 2, "{final_plan:?}");
    // The loader followed: each step after the change holds micro-batches of the new size.
    let mut plan = Plan { micro_batch: 2, accumulation: 2 };
    for r in &out.history {
        if r.micro_batches == plan.accumulation && r.step > 1 {
            assert_eq!(r.samples, plan.batch(), "step {} under {plan:?}", r.step);
        }
        if let Some(p) = r.switched_to {
            plan = p;
        }
    }
}

#[test]
fn a_loader_that_ignores_micro_batch_changes_keeps_its_size() {
    // Options [2, 8] with a cost that favours 8, but a plain loader of 2: after three steps of
    // the wrong size copus falls back to adapting the accumulation count at micro-batch 2.
    let cost = StepCost { per_micro_batch: 8.0, per_sample: 1.0, per_step: 2.0 };
    let cfg = adaptive(2, 2, 16).with_micro_batch_options(vec![2, 8]).with_cost(Some(cost));
    let out = run(cfg, 0.01, Optim::Sgd, samples(4_000, 8), None, false);
    let to_eight = out.history.iter().position(|r| r.switched_to.is_some_and(|p| p.micro_batch == 8));
    let to_eight = to_eight.expect("copus tried the bigger micro-batch");
    // Every step really ran micro-batches of 2.
    assert!(out.history.iter().all(|r| r.samples == 2 * r.micro_batches));
    let back = out.history[to_eight + 1..].iter().position(|r| r.plan.micro_batch == 2).expect("fell back") + to_eight + 1;
    assert!(back - to_eight <= 4, "fell back after {} steps", back - to_eight);
    assert!(out.history[back..].iter().all(|r| r.plan.micro_batch == 2 && r.switched_to.is_none_or(|p| p.micro_batch == 2)));
    assert_eq!(out.copus.micro_batch_options(), vec![2]);
    // The fallback keeps about the batch it left, at that batch's LR factor (sqrt rule, B0 = 4).
    let fallen = out.history[back];
    let left = out.history[back - 1].plan;
    assert!(fallen.plan.batch().abs_diff(left.batch()) <= 2, "{:?} after {left:?}", fallen.plan);
    let want = (fallen.plan.batch() as f64 / 4.0).sqrt();
    assert!((fallen.lr_factor - want).abs() < 1e-9, "LR factor {} at B = {}, the rule gives {want}", fallen.lr_factor, fallen.plan.batch());
}

#[test]
fn bad_settings_name_the_field() {
    let e = CopusBatchingConfig::new(0).init().err().unwrap().to_string();
    assert!(e.contains("`micro_batch`") && e.contains("1 or more"), "{e}");
    let e = CopusBatchingConfig::new(4).with_initial_accumulation(9).with_max_accumulation(8).init().err().unwrap().to_string();
    assert!(e.contains("`initial_accumulation`") && e.contains("1..=8"), "{e}");
    let e = CopusBatchingConfig::new(4).with_micro_batch_options(vec![8, 16]).init().err().unwrap().to_string();
    assert!(e.contains("`micro_batch_options`"), "{e}");
    let e = CopusBatchingConfig::new(4).with_smoothing(1.0).init().err().unwrap().to_string();
    assert!(e.contains("`smoothing`"), "{e}");
    let bad_cost = StepCost { per_micro_batch: f64::NAN, per_sample: 1.0, per_step: 0.0 };
    let e = CopusBatchingConfig::new(4).with_cost(Some(bad_cost)).init().err().unwrap().to_string();
    assert!(e.contains("`cost`") && e.contains("per_micro_batch"), "{e}");
}

/// A short run of 64 samples in loader batches of `batch`, with Burn's own gradient
/// accumulation when `burn_accumulation` is set.
fn launch_small(copus: &CopusBatching, batch: usize, burn_accumulation: Option<usize>) -> burn::train::LearningResult<Regression> {
    let dev = device();
    let data = samples(64, 3);
    let train = DataLoaderBuilder::new(RegBatcher).batch_size(batch).build(InMemDataset::new(data.clone()));
    let valid = DataLoaderBuilder::new(RegBatcher).batch_size(batch).build(InMemDataset::new(data));
    let dir = tempfile::tempdir().unwrap();
    let mut training = SupervisedTraining::new(dir.path(), train, valid)
        .with_application_logger(None)
        .with_training_strategy(copus.training_strategy(dev.clone()));
    if let Some(k) = burn_accumulation {
        training = training.grads_accumulation(k);
    }
    training.launch(Learner::new(
        Regression::new(&dev, Probe::default()),
        optimizer(&Optim::Sgd),
        copus.lr_scheduler(ConstantLr::from(0.01)),
    ))
}

#[test]
fn a_loader_that_disagrees_with_the_micro_batch_is_refused() {
    let copus = adaptive(2, 2, 4).init().unwrap();
    let result = launch_small(&copus, 8, None);
    let e = result.error.expect("refused").to_string();
    assert!(e.contains("[8]") && e.contains("micro_batch is 2"), "{e}");
    assert!(copus.history().is_empty(), "no optimizer step was taken");
    assert!(result.model.weights().iter().all(|&w| w == 0.0), "the weights are untouched");
}

#[test]
fn burn_grad_accumulation_is_refused() {
    let copus = adaptive(2, 2, 4).init().unwrap();
    let e = launch_small(&copus, 2, Some(4)).error.expect("refused").to_string();
    assert!(e.contains("grads_accumulation"), "{e}");
}

/// Trains 64 samples in loader batches of 4 (16 steps, no shuffling) with burn-train's own
/// single-device loop, or with the add-on frozen at one micro-batch per step; returns the
/// `|w - w*|^2` each step saw and the final weights.
fn single_device_run(optim: Optim, copus: Option<&CopusBatching>) -> (Vec<f64>, Vec<f32>) {
    let dev = device();
    let data = samples(64, 5);
    let train = DataLoaderBuilder::new(RegBatcher).batch_size(4).build(InMemDataset::new(data.clone()));
    let valid = DataLoaderBuilder::new(RegBatcher).batch_size(4).build(InMemDataset::new(data));
    let dir = tempfile::tempdir().unwrap();
    let probe = Probe::default();
    let model = Regression::new(&dev, probe.clone());
    let training = SupervisedTraining::new(dir.path(), train, valid).with_application_logger(None);
    let result =
        match copus {
            Some(c) => training.with_copus(c, dev.clone()).launch(c.learner(model, optimizer(&optim), ConstantLr::from(0.01))),
            None => training
                .with_training_strategy(TrainingStrategy::Default(ExecutionStrategy::single(dev.clone())))
                .launch(Learner::new(model, optimizer(&optim), ConstantLr::from(0.01))),
        };
    assert!(result.error.is_none(), "{:?}", result.error.map(|e| e.to_string()));
    let seen = probe.0.lock().unwrap().delta_sq.clone();
    (seen, result.model.weights())
}

/// With adaptation frozen at one micro-batch per step and the probe on, the add-on takes the very
/// steps of burn-train's own single-device loop, for SGD and for Adam.
#[test]
fn frozen_at_one_micro_batch_equals_burns_single_device_loop() {
    for optim in [Optim::Sgd, Optim::Adam] {
        let name = match optim {
            Optim::Sgd => "SGD",
            Optim::Adam => "Adam",
        };
        let (burn_seen, burn_w) = single_device_run(optim, None);
        let copus = CopusBatchingConfig::new(4).with_frozen(true).init().unwrap();
        assert_eq!(copus.b0(), 4, "the default is one micro-batch per step");
        let (seen, w) = single_device_run(optim, Some(&copus));
        assert_eq!(seen.len(), 16, "{name}");
        assert_eq!(seen.len(), burn_seen.len(), "{name}");
        for (i, (a, b)) in seen.iter().zip(&burn_seen).enumerate() {
            assert!((a - b).abs() <= 1e-6 * b.max(1.0), "{name} step {i}: |w - w*|^2 {a} under copus, {b} under burn-train");
        }
        for (a, b) in w.iter().zip(&burn_w) {
            assert!((a - b).abs() <= 1e-6, "{name}: final weight {a} under copus, {b} under burn-train");
        }
        // The probe measured every step (the one-micro-batch fallback differences consecutive steps).
        let h = copus.history();
        assert_eq!(h.len(), 16);
        assert!(h.iter().all(|r| r.grad_sq_norm.is_finite() && r.grad_sq_norm > 0.0), "{name}");
        assert!(h.last().unwrap().b_simple.is_some(), "{name}: the noise scale was measured");
    }
}

/// A Learner built without copus's scheduler would train at an unscaled rate: it is refused,
/// with the fix named, before any step.
#[test]
fn a_learner_without_the_scaled_scheduler_is_refused() {
    let dev = device();
    let data = samples(16, 5);
    let train = DataLoaderBuilder::new(RegBatcher).batch_size(4).build(InMemDataset::new(data.clone()));
    let valid = DataLoaderBuilder::new(RegBatcher).batch_size(4).build(InMemDataset::new(data));
    let dir = tempfile::tempdir().unwrap();
    let copus = CopusBatchingConfig::new(4).init().unwrap();
    let result = SupervisedTraining::new(dir.path(), train, valid)
        .with_application_logger(None)
        .with_copus(&copus, dev.clone())
        .launch(Learner::new(Regression::new(&dev, Probe::default()), optimizer(&Optim::Sgd), ConstantLr::from(0.01)));
    let e = result.error.expect("refused").to_string();
    assert!(e.contains("copus.learner(model, optim, scheduler)"), "{e}");
    assert!(copus.history().is_empty());
    assert!(result.model.weights().iter().all(|&w| w == 0.0));
}

/// burn-train's loop with `grads_accumulation(k)` (which sums the k gradients) at learning rate
/// `lr`, or the add-on frozen at k micro-batches (which averages them) at `copus_lr`.
fn accumulated_run(adam: bool, k: usize, lr: f64, copus: Option<&CopusBatching>) -> (Vec<f64>, Vec<f32>) {
    let dev = device();
    let data = samples(64, 7);
    let train = DataLoaderBuilder::new(RegBatcher).batch_size(4).build(InMemDataset::new(data.clone()));
    let valid = DataLoaderBuilder::new(RegBatcher).batch_size(4).build(InMemDataset::new(data));
    let dir = tempfile::tempdir().unwrap();
    let probe = Probe::default();
    let model = Regression::new(&dev, probe.clone());
    // A negligible epsilon makes Adam exactly invariant to the gradient's scale.
    let optim = if adam { AdamConfig::new().with_epsilon(1e-20).init() } else { SgdConfig::new().init() };
    let training = SupervisedTraining::new(dir.path(), train, valid).with_application_logger(None);
    let result = match copus {
        Some(c) => training.with_copus(c, dev.clone()).launch(c.learner(model, optim, ConstantLr::from(lr))),
        None => training
            .with_training_strategy(TrainingStrategy::Default(ExecutionStrategy::single(dev.clone())))
            .grads_accumulation(k)
            .launch(Learner::new(model, optim, ConstantLr::from(lr))),
    };
    assert!(result.error.is_none(), "{:?}", result.error.map(|e| e.to_string()));
    let seen = probe.0.lock().unwrap().delta_sq.clone();
    (seen, result.model.weights())
}

/// The add-on averages the k accumulated gradients where burn-train's `grads_accumulation(k)`
/// sums them. Frozen at k = 4 it therefore equals Burn's loop at the learning rate divided by k
/// for SGD, and at the same learning rate for Adam (invariant to the gradient's scale).
#[test]
fn fixed_accumulation_equals_burns_grads_accumulation_under_mean_semantics() {
    let k = 4;
    for (adam, burn_lr) in [(false, 0.02 / k as f64), (true, 0.02)] {
        let name = if adam { "Adam" } else { "SGD" };
        let (burn_seen, burn_w) = accumulated_run(adam, k, burn_lr, None);
        let copus = CopusBatchingConfig::new(4).with_initial_accumulation(k).with_frozen(true).init().unwrap();
        let (seen, w) = accumulated_run(adam, k, 0.02, Some(&copus));
        assert_eq!(seen.len(), 16, "{name}");
        assert_eq!(copus.history().len(), 16 / k, "{name}: 4 optimizer steps of {k} micro-batches");
        for (i, (a, b)) in seen.iter().zip(&burn_seen).enumerate() {
            assert!((a - b).abs() <= 1e-6 * b.max(1.0), "{name} micro-batch {i}: |w - w*|^2 {a} under copus, {b} under burn-train");
        }
        for (a, b) in w.iter().zip(&burn_w) {
            assert!((a - b).abs() <= 1e-6, "{name}: final weight {a} under copus, {b} under burn-train");
        }
    }
}

/// A loader that prefetches (two workers, up to 100 batches queued) hands out batches of the old
/// micro-batch for a while after each change. Steps close by samples, so those batches count
/// fully; copus never mistakes the loader for one that ignores changes, and every step holds
/// its planned batch.
#[test]
fn a_prefetching_loader_follows_micro_batch_changes() {
    let cost = StepCost { per_micro_batch: 8.0, per_sample: 1.0, per_step: 2.0 };
    let copus = adaptive(2, 2, 16).with_micro_batch_options(vec![2, 4, 8]).with_cost(Some(cost)).init().unwrap();
    let dev = device();
    let train: Arc<dyn DataLoader<Batch>> = Arc::new(MultiThreadDataLoader::new(
        Box::new(copus.batch_strategy()),
        Arc::new(InMemDataset::new(samples(6_000, 7))),
        Arc::new(RegBatcher),
        2,
        dev.clone(),
        None,
    ));
    let valid = DataLoaderBuilder::new(RegBatcher).batch_size(2).build(InMemDataset::new(samples(64, 1)));
    let dir = tempfile::tempdir().unwrap();
    let result = SupervisedTraining::new(dir.path(), train, valid)
        .with_application_logger(None)
        .with_copus(&copus, dev.clone())
        .launch(copus.learner(Regression::new(&dev, Probe::default()), optimizer(&Optim::Sgd), ConstantLr::from(0.01)));
    assert!(result.error.is_none(), "{:?}", result.error.map(|e| e.to_string()));
    let h = copus.history();
    let last = copus.snapshot().plan;
    assert!(last.micro_batch > 2, "copus moved to a bigger micro-batch: {last:?}");
    assert_eq!(h.iter().map(|r| r.samples).sum::<usize>(), 6_000, "every sample trained once");
    // Each step but the epoch's last holds its planned batch, plus less than one micro-batch.
    for r in &h[..h.len() - 1] {
        assert!(r.samples >= r.plan.batch() && r.samples < r.plan.batch() + 8, "step {}: {} samples under {:?}", r.step, r.samples, r.plan);
    }
    // Batches of the new size arrived after each change (the loader follows), and copus kept
    // every option: no fallback to a fixed micro-batch.
    assert_eq!(copus.micro_batch_options(), vec![2, 4, 8], "no fallback to a fixed micro-batch");
    let sizes: std::collections::BTreeSet<usize> =
        h.iter().filter(|r| r.samples == r.plan.batch() && r.micro_batches == r.plan.accumulation).map(|r| r.plan.micro_batch).collect();
    assert!(sizes.len() >= 2, "steps ran at several micro-batch sizes: {sizes:?}");
}

/// Trains `epochs` epochs of 256 samples with Burn's default checkpointers in `dir`, resuming
/// from epoch `from` when given; returns copus's step records and the final weights.
fn checkpointed_run(dir: &std::path::Path, epochs: usize, from: Option<usize>) -> (Vec<StepRecord>, Vec<f32>, CopusBatching) {
    let cost = StepCost { per_micro_batch: 4.0, per_sample: 1.0, per_step: 8.0 };
    let copus = adaptive(2, 2, 16).with_cost(Some(cost)).with_adapt_every(2).with_min_observations(2).init().unwrap();
    let dev = device();
    let data = samples(256, 11);
    let train = DataLoaderBuilder::new(RegBatcher).batch_size(2).build(InMemDataset::new(data.clone()));
    let valid = DataLoaderBuilder::new(RegBatcher).batch_size(2).build(InMemDataset::new(samples(16, 2)));
    let mut training = SupervisedTraining::new(dir, train, valid)
        .with_application_logger(None)
        .with_default_checkpointers()
        .num_epochs(epochs)
        .with_copus(&copus, dev.clone());
    if let Some(n) = from {
        training = training.checkpoint(n);
    }
    let result = training.launch(copus.learner(Regression::new(&dev, Probe::default()), optimizer(&Optim::Adam), ConstantLr::from(0.05)));
    assert!(result.error.is_none(), "{:?}", result.error.map(|e| e.to_string()));
    (copus.history(), result.model.weights(), copus)
}

/// copus's state (noise estimate, plan, cost model, LR factor, schedule position) travels in
/// the scheduler record of Burn's checkpoints: a run stopped after epoch 2 and resumed with
/// `.checkpoint(2)` takes the very steps of a run that never stopped.
#[test]
fn a_run_resumed_from_burns_checkpoint_continues_with_the_same_plan_and_lr() {
    let whole_dir = tempfile::tempdir().unwrap();
    let (whole, whole_w, _) = checkpointed_run(whole_dir.path(), 3, None);
    let dir = tempfile::tempdir().unwrap();
    let (first, _, _) = checkpointed_run(dir.path(), 2, None);
    let (rest, w, _) = checkpointed_run(dir.path(), 3, Some(2));
    // The first two epochs changed the plan, so the resumed run has something to restore.
    assert!(first.iter().any(|r| r.switched_to.is_some()), "copus switched in the first two epochs");
    assert_eq!(first.len() + rest.len(), whole.len());
    // Everything but the measured seconds.
    let key = |r: &StepRecord| (r.step, r.plan, r.micro_batches, r.samples, r.samples_total, r.lr_factor, r.b_simple, r.switched_to);
    assert_eq!(whole[..first.len()].iter().map(key).collect::<Vec<_>>(), first.iter().map(key).collect::<Vec<_>>());
    for (a, b) in rest.iter().zip(&whole[first.len()..]) {
        assert_eq!((a.step, a.plan, a.samples_total), (b.step, b.plan, b.samples_total));
        assert!((a.lr_factor - b.lr_factor).abs() <= 1e-12, "step {}: LR factor {} resumed, {} whole", a.step, a.lr_factor, b.lr_factor);
        assert!(a.b_simple.zip(b.b_simple).is_none_or(|(x, y)| (x - y).abs() <= 1e-6 * y.abs()), "step {}", a.step);
    }
    for (a, b) in w.iter().zip(&whole_w) {
        assert!((a - b).abs() <= 1e-6, "final weight {a} resumed, {b} whole");
    }
}

/// The scaled scheduler's record holds the schedule's own keys, unchanged, plus copus's state:
/// held by a Learner (one group), a plain Burn schedule loads a copus checkpoint's position, and
/// the other way round.
#[test]
fn the_scheduler_record_is_compatible_with_the_inner_schedulers() {
    use burn::optim::lr_scheduler::cosine::CosineAnnealingLrSchedulerConfig;
    use burn::optim::lr_scheduler::module_lr_scheduler::ModuleLrScheduler;
    let cosine = || CosineAnnealingLrSchedulerConfig::new(0.1, 100).init().unwrap();
    // What a Learner holds: the schedule as given, or copus's wrapper as its one group.
    let with_copus = || ModuleLrScheduler::new(CopusBatchingConfig::new(4).with_frozen(true).init().unwrap().lr_scheduler(cosine()));
    let mut scaled = with_copus();
    for _ in 0..7 {
        scaled.step();
    }
    // copus -> plain: the plain schedule continues where the scaled one stands.
    let mut plain = cosine().load_record(scaled.to_record());
    let (a, b) = (plain.step().base(), scaled.step().base());
    assert!((a - b).abs() <= 1e-12, "plain {a}, scaled {b} (factor 1 at B0)");
    // plain -> copus: the scaled schedule continues the plain one's position.
    let mut plain = cosine();
    for _ in 0..20 {
        plain.step();
    }
    let mut scaled = with_copus().load_record(plain.to_record());
    let (a, b) = (plain.step().base(), scaled.step().base());
    assert!((a - b).abs() <= 1e-12, "plain {a}, scaled {b}");
    // Every key of the plain record is in the copus one.
    let (p, w) = (format!("{:?}", plain.to_record()), format!("{:?}", scaled.to_record()));
    for key in p.split('"').skip(1).step_by(2) {
        assert!(w.contains(&format!("\"{key}\"")), "key {key} of the plain record is missing from {w}");
    }
    assert!(w.contains("copus"), "{w}");
}
