//! `recipes bench probe` and the probe rows of `recipes bench step`: the noise-scale probe's
//! cost, as whole steps with the probe on and off and as the probe's own work.

use std::time::Instant;

use burn::optim::GradientsParams;
use burn::tensor::Device;
use copus_burn::{MicroBatch, OptimConfig, Trainer, grads};
use copus_models::LlamaConfig;

use super::{MICRO_BATCH, Shape, int2, median, spec, tokens};

/// Median seconds per trainer step with the probe on and off, for `num_micro` micro-batches of
/// `shape.micro_batch / num_micro` sequences; the two trainers step alternately so that drift
/// on a shared machine falls on both.
pub fn probe_on_off(shape: &Shape, num_micro: usize, steps: usize, warmup: usize) -> (f64, f64) {
    let s = &shape.spec;
    let device = Device::flex().autodiff();
    device.seed(0);
    let model = LlamaConfig::from_spec(s).init(&device);
    let cfg = OptimConfig { warmup_steps: 0, clip_norm: None, ..OptimConfig::default() };
    let mut on = Trainer::new(model.clone(), cfg.clone()).expect("valid settings");
    let mut off = Trainer::new(model, cfg).expect("valid settings").without_probe();
    let b = shape.micro_batch / num_micro.max(1);
    let (mut t_on, mut t_off) = (Vec::new(), Vec::new());
    for i in 0..warmup + steps {
        let (ids, tgt) = tokens(s, shape.micro_batch, i);
        let row = b * s.seq_len;
        let micro: Vec<MicroBatch> = (0..num_micro)
            .map(|k| MicroBatch {
                inputs: int2(ids[k * row..(k + 1) * row].to_vec(), [b, s.seq_len], &device),
                targets: int2(tgt[k * row..(k + 1) * row].to_vec(), [b, s.seq_len], &device),
            })
            .collect();
        for (trainer, times) in [(&mut on, &mut t_on), (&mut off, &mut t_off)] {
            let t = Instant::now();
            trainer.step(&micro).expect("bench step");
            let _ = trainer.model().embed_tokens.weight.val().slice([0..1, 0..1]).into_data();
            if i >= warmup {
                times.push(t.elapsed().as_secs_f64());
            }
        }
    }
    (median(t_on), median(t_off))
}

/// The probe's own work in a trainer step of `num_micro` micro-batches, timed apart from the
/// forward and backward passes (whose noise on a shared machine hides a 1% difference in whole
/// steps): median seconds with the probe on and off, over `reps` steps. At one micro-batch the
/// probe's work is `|g - g_prev|^2` and keeping `g` (off: nothing). At several it is each
/// micro-batch's `|g_k|^2`, summed while the micro-batch gradients are added up: on is that
/// accumulation measuring, off the same accumulation without.
pub fn probe_work(shape: &Shape, num_micro: usize, reps: usize) -> (f64, f64) {
    let s = &shape.spec;
    let device = Device::flex().autodiff();
    device.seed(0);
    let model = LlamaConfig::from_spec(s).init(&device);
    let b = shape.micro_batch / num_micro.max(1);
    let total = (shape.micro_batch * s.seq_len) as f64;
    let gradients = |i: usize| -> Vec<GradientsParams> {
        let (ids, tgt) = tokens(s, shape.micro_batch, i);
        let row = b * s.seq_len;
        (0..num_micro)
            .map(|k| {
                let inputs = int2(ids[k * row..(k + 1) * row].to_vec(), [b, s.seq_len], &device);
                let targets = int2(tgt[k * row..(k + 1) * row].to_vec(), [b, s.seq_len], &device);
                GradientsParams::from_grads(model.loss_sum(inputs, targets).div_scalar(total).backward(), &model)
            })
            .collect()
    };
    let (mut on, mut off) = (Vec::new(), Vec::new());
    let mut previous = None;
    for i in 0..reps + 1 {
        for measure in [true, false] {
            let gs = gradients(i);
            let t = Instant::now();
            if num_micro == 1 {
                let g = gs.into_iter().next().expect("one micro-batch");
                if measure {
                    let diff = previous.as_ref().map(|p| grads::diff_sq_norm(&model, &g, p));
                    assert!(diff.is_none_or(f64::is_finite));
                    previous = Some(grads::scaled(&model, &g, 1.0));
                }
            } else {
                let mut acc = None;
                let mut sq = 0.0;
                for g in gs {
                    let (sum, g_sq) = grads::add_measured(&model, acc, g, measure);
                    acc = Some(sum);
                    sq += g_sq;
                }
                assert!(sq.is_finite());
            }
            let elapsed = t.elapsed().as_secs_f64();
            if i > 0 {
                if measure { on.push(elapsed) } else { off.push(elapsed) }
            }
        }
    }
    (median(on), median(off))
}

/// The learner add-on's noise probe against the same step without it, on the reference shape:
/// seconds per step (forward, backward, AdamW) and seconds of the probe's work at one
/// micro-batch per step (the squared norm of the gradient and of its difference from the
/// previous step's, each reduced on the device with one small readback), medians over `steps`.
pub fn probe_overhead(steps: usize, warmup: usize) -> (f64, f64) {
    let s = spec();
    let device = Device::flex().autodiff();
    device.seed(0);
    let mut model = LlamaConfig::from_spec(&s).init(&device);
    let cfg = OptimConfig { warmup_steps: 0, clip_norm: None, ..OptimConfig::default() };
    let mut optim = cfg.init(&[]);
    let n = MICRO_BATCH * s.seq_len;
    let (mut step_secs, mut probe_secs) = (Vec::new(), Vec::new());
    let mut previous: Option<GradientsParams> = None;
    for i in 0..warmup + steps {
        let (ids, tgt) = tokens(&s, MICRO_BATCH, i);
        let (inputs, targets) = (int2(ids, [MICRO_BATCH, s.seq_len], &device), int2(tgt, [MICRO_BATCH, s.seq_len], &device));
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
    (median(step_secs), median(probe_secs))
}

/// Prints `recipes bench probe`'s table: the reference step with the probe off and the probe's
/// own work, medians over `steps`.
pub fn run(steps: usize) {
    let (step, probe) = probe_overhead(steps, 2);
    println!("| reference step (bench-5m, B_m = 8, one micro-batch per step) | seconds |\n|---|---:|");
    println!("| forward, backward, AdamW (probe off) | {step:.4} |\n| the probe: |g|^2 and |g - g_prev|^2 on the device | {probe:.4} |");
    println!("\nprobe overhead: {:.2}% of the step", 100.0 * probe / step);
}
