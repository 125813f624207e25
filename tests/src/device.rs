//! Ranks on a device backend (wgpu, LibTorch) against ranks on Flex: the shared body of the
//! `wgpu` and `tch` tests.
//!
//! Tolerance, over five steps on dp1, dp2, pp2, tp2, dp2xtp2 and tp2xpp2 (two micro-batches a
//! step), on dp1 and tp2 with one micro-batch a step (the probe differencing against the
//! previous step's gradient, kept on the device) and across layout changes:
//! per-step losses within 1e-6 relative; gradient norms and the probe's |g|^2 within 1e-5
//! relative, the estimator's tr(Sigma) within 1e-4 and its |G|^2 within 1e-4 or 1e-5 of the
//! probe's |g|^2 (see [`assert_estimate_close`]); the weights after the last step within
//! 1e-5 of their norm and each within 1e-4 (see [`assert_weights_close`]). Both backends
//! compute in f32 from the same weights and batches; they differ only in the order of
//! floating-point sums (a device's tiled matmuls and tree reductions against Flex's blocked
//! loops) and in exp/log approximations of a few ulps, about 1e-7 relative per operation. Adam
//! turns those into weight differences of order lr x 1e-7 / sqrt(v), larger where a gradient is
//! near zero. After a few steps the loss, a mean over every token, moves by about 1e-8 (4.5e-8
//! measured on wgpu), while gradient norms, sums over parameters that include near-zero ones,
//! move by up to about 1e-6 (7.7e-7 measured on wgpu, with its squared norms summed in f32 on
//! the device per parameter and the sums added in f64); the weights by 9e-7 of their norm,
//! 1.9e-5 at most. The bounds are 5 to 20 times what this machine measures; the tests print
//! the differences.
//!
//! Host traffic: the probe's reads on a device are a few sums per step, a hundredth or less of
//! Flex's whole-gradient reads. Ranks sharing the device add their gradients there (the
//! data-parallel reduction, tp-replicated parameters, a tied embedding's sum across pipeline
//! stages) and their tensor-parallel regions' outputs and input gradients, and compute the
//! vocabulary-parallel cross entropy there, where Flex's ranks use host buffers; a pipeline's
//! stages hand activations to each other where they lie on both. A device step moves at most
//! the batch's token ids and 64 KiB (each micro-batch's loss scalar and the probe's sums):
//! every rank that reads the ids uploads its rows of them (the first and last stages of each
//! tensor-parallel rank), a few KiB at tiny-1m's sequence length.

use std::sync::Arc;

use copus_burn::traffic::HostTraffic;
use copus_burn::{Engine, EngineConfig, OptimConfig, RankDevice};

use crate::{SEQ, config, dims, initial_full, rel, structured_batch};

/// Steps each comparison trains.
pub const STEPS: usize = 5;

/// One step's numbers: loss, gradient norm, mean micro-batch |g|^2, the estimator's |G|^2 and
/// tr(Sigma), and |g - g_prev|^2 (a step of one micro-batch after another).
type Step = (f64, f64, f64, Option<f64>, Option<f64>, Option<f64>);

/// A layout and its batch arithmetic: dp, tp, pp, sequences a step, sequences a micro-batch.
/// Two sequences a micro-batch throughout.
#[derive(Clone, Copy)]
struct Layout {
    dp: usize,
    tp: usize,
    pp: usize,
    global: usize,
    micro: usize,
}

impl Layout {
    /// `dp x tp x pp` (dp at most 2) with two micro-batches a step (one per replica on dp2).
    const fn split(dp: usize, tp: usize, pp: usize) -> Self {
        Self { dp, tp, pp, global: 4, micro: 2 }
    }

    /// `1 x tp x 1` with one micro-batch a step.
    const fn whole(tp: usize) -> Self {
        Self { dp: 1, tp, pp: 1, global: 2, micro: 2 }
    }

    /// One micro-batch a step: the probe differences against the previous step's gradient.
    fn one_micro(&self) -> bool {
        self.global == self.micro
    }

    fn ranks(&self) -> usize {
        self.dp * self.tp * self.pp
    }

    /// The bytes of a step's token ids (i64 on the host), once.
    fn ids(&self) -> u64 {
        (self.global * (SEQ + 1) * 8) as u64
    }
}

impl std::fmt::Display for Layout {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let Self { dp, tp, pp, global, micro } = self;
        write!(f, "dp{dp} tp{tp} pp{pp} ({global}/{micro})")
    }
}

/// Held-out sequences evaluated after the steps: an odd count, so a micro-batch is short.
const EVAL_SEQS: usize = 7;

/// A run's results: per step its numbers, the first step's host traffic and the last step's
/// (without the evaluation's), the weights after the last step, the held-out loss on the ranks
/// before the last step, and the evaluation's host bytes.
struct Run {
    steps: Vec<Step>,
    first: HostTraffic,
    host: HostTraffic,
    weights: Weights,
    eval_loss: f64,
    eval_bytes: u64,
}

fn run(devices: Vec<RankDevice>, l: Layout) -> Run {
    let optim = OptimConfig { lr: 1e-3, warmup_steps: 1, total_steps: 10, b0: 4, ..OptimConfig::default() };
    // Buckets of 64 Ki elements: the data-parallel reduction of tiny-1m's gradient in several.
    let ec = EngineConfig::new(dims(l.dp, l.tp, l.pp), l.global, l.micro, SEQ, optim).with_devices(devices).with_bucket_elems(1 << 16);
    let mut engine = Engine::new(Arc::new(config()), initial_full(), ec).unwrap();
    let (mut first, mut host, mut eval_loss) = (HostTraffic::default(), HostTraffic::default(), f64::NAN);
    let steps = (0..STEPS)
        .map(|s| {
            if s + 1 == STEPS {
                // Before the last step; its bytes are reported with that step, as `evaluation`.
                eval_loss = engine.evaluate(structured_batch(100, config().shape.vocab_size, EVAL_SEQS), 2).unwrap();
            }
            let out = engine.step(structured_batch(s, config().shape.vocab_size, l.global)).unwrap();
            assert!(!out.skipped);
            assert_eq!(out.metrics.gns_biased, l.one_micro() && s > 0, "{l} step {s}: the probe's mode");
            if s == 0 {
                first = out.host;
            }
            host = out.host;
            let m = &out.metrics;
            (m.loss, m.grad_norm, out.stats.mean_micro_sq_norm, m.grad_sq, m.trace, out.stats.diff_sq_norm)
        })
        .collect();
    let weights = engine.gather().unwrap();
    let eval_bytes = std::mem::take(&mut host.evaluation);
    Run { steps, first, host, weights, eval_loss, eval_bytes }
}

/// How far the weights `b` are from `a`: the difference's norm over `a`'s, and the largest
/// single difference. Adam divides each gradient by its own running scale, so where a gradient
/// is near zero the backends' rounding differences reach the update almost whole (up to lr =
/// 1e-3 a step): single weights may differ by some 1e-5, the whole weight vector by far less.
/// Bounds: the difference's norm within 1e-5 of the weights' norm, and every weight within
/// 1e-4 (the engine's bound against serial training on Flex).
pub fn assert_weights_close(a: &Weights, b: &Weights, what: &str) {
    let (mut worst, mut diff_sq, mut norm_sq) = (0f64, 0f64, 0f64);
    assert_eq!(a.len(), b.len());
    for (name, x) in a {
        for (p, q) in x.iter().zip(&b[name]) {
            let d = f64::from(p - q);
            worst = worst.max(d.abs());
            diff_sq += d * d;
            norm_sq += f64::from(*p) * f64::from(*p);
        }
    }
    let relative = (diff_sq / norm_sq).sqrt();
    eprintln!("{what}: weights differ by {relative:.2e} of their norm, at most {worst:.2e}");
    assert!(relative <= 1e-5, "{what}: weights differ by {relative} of their norm");
    assert!(worst <= 1e-4, "{what}: a weight differs by {worst}");
}

/// Ranks on `device` against ranks on Flex over [`STEPS`] steps of dp1, dp2, pp2, tp2, dp2xtp2
/// and tp2xpp2, and of dp1 and tp2 with one micro-batch a step (the module's bounds), and their
/// host traffic: a step on `device` moves the batch's token ids and at most 64 KiB more, its
/// evaluation the same.
pub fn ranks_train_like_flex_ranks(device: RankDevice) {
    let layouts = [
        Layout::split(1, 1, 1),
        Layout::split(2, 1, 1),
        Layout::split(1, 1, 2),
        Layout::split(1, 2, 1),
        Layout::split(2, 2, 1),
        Layout::split(1, 2, 2),
        Layout::whole(1),
        Layout::whole(2),
    ];
    for l in layouts {
        let (f, w) = (run(Vec::new(), l), run(vec![device; l.ranks()], l));
        let (flex, flex_host, flex_weights) = (f.steps, f.host, f.weights);
        let (dev, dev_host, dev_weights) = (w.steps, w.host, w.weights);
        // The held-out loss on the ranks' devices; what leaves them is the ranks' token ids and
        // each micro-batch's loss scalar.
        eprintln!(
            "{device:?} {l} evaluation: loss rel {:.2e}; host bytes Flex {}, {device:?} {}",
            rel(w.eval_loss, f.eval_loss),
            f.eval_bytes,
            w.eval_bytes
        );
        assert!(rel(w.eval_loss, f.eval_loss) <= 1e-6, "{l}: held-out loss {} on {device:?}, {} on Flex", w.eval_loss, f.eval_loss);
        let eval_ids = (EVAL_SEQS * (SEQ + 1) * 8) as u64;
        assert!(w.eval_bytes <= eval_ids + (64 << 10), "{l}: the evaluation moved {} bytes", w.eval_bytes);
        eprintln!("{l} host traffic of a step, bytes: Flex {flex_host:?}; {device:?} {dev_host:?}");
        // The probe's norms are reduced on the device: a few sums read back, against the whole
        // gradient read per micro-batch where it lies in host memory.
        assert!(dev_host.probe * 100 <= flex_host.probe, "probe bytes: {device:?} {}, Flex {}", dev_host.probe, flex_host.probe);
        // Gradient sums (dp, tp-replicated parameters, a tied embedding across stages) and
        // activations stay on the device: the step moves its token ids, each micro-batch's
        // loss scalar and the probe's sums. Every id is uploaded, by each rank that reads it.
        assert_eq!(flex_host.collective > 0, l.ranks() > 1);
        assert_eq!(dev_host.collective, 0, "{l}: gradients staged on the host");
        assert!((l.ids()..=l.ids() * (l.tp * l.pp) as u64).contains(&dev_host.batch), "{l}: token ids {dev_host:?}");
        // One upload of token ids a step on each rank of the first and the last stage, whatever
        // its number of micro-batches.
        let reading = (l.dp * l.tp * l.pp.min(2)) as u64;
        assert_eq!(dev_host.batch_uploads, reading, "{l}: uploads of token ids in a step");
        assert!(dev_host.beyond_batch() <= 64 << 10, "{l}: {dev_host:?} beyond the token ids");
        assert!(dev_host.total() <= l.ids() + (64 << 10), "{l}: {dev_host:?} in all, the batch's ids {}", l.ids());
        // What is built on the host once (the rotary tables, the mask's index ranges) is
        // uploaded with the first step, and kept.
        assert!(w.first.constants > 0, "{l}: {:?} in the first step", w.first);
        assert_eq!(dev_host.constants, 0, "{l}: constants uploaded by a steady step");
        for (s, (f, w)) in flex.iter().zip(&dev).enumerate() {
            eprintln!(
                "{l} step {s}: loss rel {:.2e}, grad norm rel {:.2e}, |g|^2 rel {:.2e}, |G|^2 rel {:.2e}, tr(Sigma) rel {:.2e}",
                rel(w.0, f.0),
                rel(w.1, f.1),
                rel(w.2, f.2),
                rel(w.3.unwrap_or(f64::NAN), f.3.unwrap_or(f64::NAN)),
                rel(w.4.unwrap_or(f64::NAN), f.4.unwrap_or(f64::NAN)),
            );
            assert!(rel(w.0, f.0) <= 1e-6, "{l} step {s}: loss {} on {device:?}, {} on Flex", w.0, f.0);
            assert!(rel(w.1, f.1) <= 1e-5, "{l} step {s}: gradient norm {} on {device:?}, {} on Flex", w.1, f.1);
            assert!(rel(w.2, f.2) <= 1e-5, "{l} step {s}: |g|^2 {} on {device:?}, {} on Flex", w.2, f.2);
            // The estimator's |G|^2 and tr(Sigma): from the second step of one micro-batch on (the
            // first has no gradient to difference against), from the first of several.
            let estimated = s > 0 || !l.one_micro();
            // With one micro-batch, every step after the first differences against the
            // previous step's gradient, kept on the device.
            assert_eq!(w.5.is_some(), l.one_micro() && s > 0, "{l} step {s}: |g - g_prev|^2 {:?} on {device:?}", w.5);
            assert_eq!(w.5.is_some(), f.5.is_some(), "{l} step {s}: |g - g_prev|^2 {:?} on {device:?}, {:?} on Flex", w.5, f.5);
            if let (Some(dw), Some(df)) = (w.5, f.5) {
                assert!(rel(dw, df) <= 1e-4, "{l} step {s}: |g - g_prev|^2 {dw} on {device:?}, {df} on Flex");
            }
            let (Some(gw), Some(gf), Some(tw), Some(tf)) = (w.3, f.3, w.4, f.4) else {
                assert!(!estimated && [w.3, f.3, w.4, f.4].iter().all(Option::is_none), "{l} step {s}: {w:?} on {device:?}, {f:?} on Flex");
                continue;
            };
            assert!(estimated, "{l} step {s}: an estimate without a previous gradient");
            assert_estimate_close(gw, gf, f.2, &format!("{l} step {s}"));
            assert!(rel(tw, tf) <= 1e-4, "{l} step {s}: tr(Sigma) {tw} on {device:?}, {tf} on Flex");
        }
        assert_weights_close(&flex_weights, &dev_weights, &format!("{l} after {STEPS} steps"));
    }
}

/// The estimator's |G|^2 `w` against `f`: within 1e-4 relative, or within 1e-5 of `g2`, the
/// mean micro-batch |g|^2, whichever is looser. The estimate is a difference of squared norms,
/// (B |G_B|^2 - b |g_b|^2) / (B - b), and where noise dominates it is a hundredth of them or
/// less: the norms' rounding differences (1e-7 relative) reach it scaled by the norms, not by
/// the difference (8.4e-5 relative measured on LibTorch's CPU with |g|^2 within 8.3e-7).
pub fn assert_estimate_close(w: f64, f: f64, g2: f64, what: &str) {
    let bound = (1e-4 * f.abs()).max(1e-5 * g2.abs());
    assert!((w - f).abs() <= bound, "{what}: |G|^2 {w} on the device, {f} on Flex (bound {bound:.3e})");
}

/// Full parameters by name.
pub type Weights = std::collections::HashMap<String, Vec<f32>>;

/// A step's loss, mean micro-batch |g|^2, the smoothed estimate's |G|^2 and tr(Sigma), and
/// |g - g_prev|^2.
type Estimated = (f64, f64, Option<f64>, Option<f64>, Option<f64>);

/// Trains two steps on `from`, changes the layout to `to` in memory, trains two more: per step
/// (loss, the probe's |g|^2, the smoothed estimate's |G|^2 and tr(Sigma)), the weights at the end, the host traffic of
/// the second step (on `from`) and of the third (the change's, with the step after it).
/// `zero1`: the optimizer sharded over dp (its moments gathered for the change).
fn run_with_switch(devices: Vec<RankDevice>, from: Layout, to: Layout, zero1: bool) -> (Vec<Estimated>, Weights, HostTraffic, HostTraffic) {
    let optim = OptimConfig { lr: 1e-3, warmup_steps: 1, total_steps: 10, b0: 4, ..OptimConfig::default() };
    let ec =
        EngineConfig::new(dims(from.dp, from.tp, from.pp), from.global, from.micro, SEQ, optim).with_devices(devices).with_zero1(zero1);
    let mut engine = Engine::new(Arc::new(config()), initial_full(), ec).unwrap();
    let (mut steps, mut host, mut switch) = (Vec::new(), HostTraffic::default(), HostTraffic::default());
    for s in 0..4 {
        let l = if s < 2 { from } else { to };
        if s == 2 {
            engine.reconfigure(dims(to.dp, to.tp, to.pp), to.global, to.micro).unwrap();
        }
        let out = engine.step(structured_batch(s, config().shape.vocab_size, l.global)).unwrap();
        assert!(!out.skipped);
        match s {
            1 => host = out.host,
            2 => switch = out.host,
            // The step after the change's uploads nothing the change's step built.
            3 => assert_eq!(out.host.constants, 0, "step {s} after the change: {:?}", out.host),
            _ => {}
        }
        let m = &out.metrics;
        steps.push((m.loss, out.stats.mean_micro_sq_norm, m.grad_sq, m.trace, out.stats.diff_sq_norm));
    }
    (steps, engine.gather().unwrap(), host, switch)
}

/// Two steps on dp2, a live change to tp2, two more steps, on `device` against Flex: also with
/// ZeRO-1 on the `device` ranks (the reduce-scatter, the pieces' updates and the
/// all-gather on the device: a dp2 step stages no gradient or weight on the host), against the
/// unsharded Flex run (ZeRO-1 on Flex matches it within 1e-6:
/// `zero1_trains_as_the_unsharded_optimizer`). Then the same from tp2 to pp2 with one
/// micro-batch a step, where the probe's previous gradient, kept on the device, is cut and
/// handed over with the weights, and the step after the change differences against it.
pub fn a_layout_change_trains_like_one_on_flex(device: RankDevice) {
    let one_pp2 = Layout { pp: 2, ..Layout::whole(1) };
    for (from, to, zero1s) in [(Layout::split(2, 1, 1), Layout::split(1, 2, 1), &[false, true][..]), (Layout::whole(2), one_pp2, &[false])]
    {
        let (flex, flex_weights, _, flex_switch) = run_with_switch(Vec::new(), from, to, false);
        for &zero1 in zero1s {
            let what = format!("{from} -> {to}, zero1 {zero1}");
            let (dev, dev_weights, host, switch) = run_with_switch(vec![device; from.ranks()], from, to, zero1);
            eprintln!("{device:?} {what}: host traffic of a step before the change {host:?}");
            assert_eq!(host.collective, 0, "{what}: gradients or weights staged on the host");
            assert!(host.beyond_batch() <= 64 << 10, "{what}: {host:?} beyond the token ids");
            // The change's pieces (weights, moments, the previous gradient) are cut, handed over,
            // joined and checked where they lie: what it reads back is a count per piece.
            eprintln!("{device:?} {what}: host traffic of the change and the step after it {switch:?} (Flex {flex_switch:?})");
            assert!(switch.state <= 64 << 10, "{what}: the change staged {} bytes of state on the host", switch.state);
            assert!(switch.beyond_batch() <= 128 << 10, "{what}: {switch:?} beyond the token ids");
            // The new ranks build their context (the rotary tables) once, with the change's step.
            assert_eq!(host.constants, 0, "{what}: constants uploaded by a steady step");
            assert!(switch.constants > 0, "{what}: no context built after the change");
            for (s, (f, w)) in flex.iter().zip(&dev).enumerate() {
                assert!(rel(w.0, f.0) <= 1e-6, "{what} step {s}: loss {} on {device:?}, {} on Flex", w.0, f.0);
                // The estimator's |G|^2 and tr(Sigma), from the probe's norms of every step so
                // far (with one micro-batch, from the second step on).
                // The step after the change differences against the gradient handed over.
                assert_eq!(w.4.is_some(), from.one_micro() && s > 0, "{what} step {s}: |g - g_prev|^2 {:?}", w.4);
                assert_eq!(w.4.is_some(), f.4.is_some(), "{what} step {s}: |g - g_prev|^2 {:?} on {device:?}, {:?} on Flex", w.4, f.4);
                if let (Some(dw), Some(df)) = (w.4, f.4) {
                    assert!(rel(dw, df) <= 1e-4, "{what} step {s}: |g - g_prev|^2 {dw} on {device:?}, {df} on Flex");
                }
                if from.one_micro() && s == 0 {
                    assert_eq!((w.2, w.3, f.2, f.3), (None, None, None, None), "{what} step 0: an estimate without a previous gradient");
                    continue;
                }
                let (Some(gw), Some(gf), Some(tw), Some(tf)) = (w.2, f.2, w.3, f.3) else {
                    panic!("{what} step {s}: no noise estimate ({w:?} on {device:?}, {f:?} on Flex)")
                };
                eprintln!(
                    "{what} step {s}: loss rel {:.2e}, |G|^2 rel {:.2e}, tr(Sigma) rel {:.2e}",
                    rel(w.0, f.0),
                    rel(gw, gf),
                    rel(tw, tf)
                );
                assert_estimate_close(gw, gf, f.1, &format!("{what} step {s}"));
                assert!(rel(tw, tf) <= 1e-4, "{what} step {s}: tr(Sigma) {tw} on {device:?}, {tf} on Flex");
            }
            assert_weights_close(&flex_weights, &dev_weights, &format!("{what}: after the change and four steps"));
        }
    }
}

/// The in-process collectives on tensors of `device` give the host collectives' values to the
/// bit, for groups of 2, 3 and 4 rank threads: the all-reduce (sums and maxima; from three ranks
/// on, of lengths past `collective`'s small-buffer bound, each rank combines its chunk and the
/// chunks are gathered), the reduce-scatter and the all-gather. A group of 3 or 4 does not occur
/// in the parity layouts above, and five steps of dp3 differ from Flex by more than the weights'
/// bounds allow for reasons of their own (Adam on near-zero gradients), so the chunked path is
/// checked here, against the host's rank-order sums, rather than through training.
pub fn tensor_collectives_match_the_host_ones(device: RankDevice) {
    use burn::tensor::{Tensor, TensorData};
    use copus_burn::comm::threads::ThreadComm;
    use copus_burn::comm::{Collective, ReduceOp};
    let bits = |t: Tensor<1>| t.into_data().iter::<f32>().map(f32::to_bits).collect::<Vec<_>>();
    let host_bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    for size in [2, 3, 4] {
        // Past 2^14 elements, and not a multiple of the group size for the all-reduce.
        let len = 3 * (1 << 14) + 5;
        let handles: Vec<_> = ThreadComm::world(size)
            .into_iter()
            .map(|c| {
                std::thread::spawn(move || {
                    let dev = device.device().expect("the backend is built");
                    let r = c.rank() as f32;
                    let v: Vec<f32> = (0..len).map(|i| (i as f32 * 0.37 + r).sin() * 10f32.powi(i as i32 % 7 - 3)).collect();
                    let tensor = |v: &[f32]| Tensor::<1>::from_data(TensorData::new(v.to_vec(), [v.len()]), &dev);
                    for op in [ReduceOp::Sum, ReduceOp::Max] {
                        let mut host = v.clone();
                        c.all_reduce(&mut host, op).unwrap();
                        let on_device = bits(c.all_reduce_tensor(tensor(&v), op).unwrap());
                        assert_eq!(on_device, host_bits(&host), "{device:?}, {size} ranks: the {op:?} all-reduce differs from the host's");
                    }
                    let even = &v[..len - len % size];
                    let host = c.reduce_scatter(even, ReduceOp::Sum).unwrap();
                    assert_eq!(
                        bits(c.reduce_scatter_tensor(tensor(even), ReduceOp::Sum).unwrap()),
                        host_bits(&host),
                        "{size} ranks: reduce-scatter"
                    );
                    let host = c.all_gather(&v[..1000]).unwrap();
                    assert_eq!(bits(c.all_gather_tensor(tensor(&v[..1000])).unwrap()), host_bits(&host), "{size} ranks: all-gather");
                })
            })
            .collect();
        for h in handles {
            h.join().expect("a rank thread failed; its message is above");
        }
    }
}
