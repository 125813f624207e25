//! The fused operations on LibTorch (feature `tch`): each is one node of Burn's autodiff graph
//! whose forward pass runs LibTorch's own kernels, and whose backward pass LibTorch computes.
//!
//! Burn's autodiff decomposes every operation into the backend's primitives and records a node
//! for each, so on LibTorch a decoder layer launched about 215 kernels per micro-batch and causal
//! attention materialised its `[b, h, s, s]` scores several times. Here an operation hands its
//! inputs to LibTorch as they are (the same tensors, no copy):
//! - where the operation is a composition of LibTorch functions ([`attention`], [`rms_norm`],
//!   [`rope`], [`swiglu`], [`linear`]), the forward pass runs them with LibTorch's own autograd
//!   recording, and the node's backward pass asks LibTorch's autograd for the input gradients
//!   in one call seeded with the incoming gradient ([`TorchBackward`], through `copus_vjp` of
//!   cpp/torch_glue.cpp: tch's C interface seeds a backward pass with ones only). Attention
//!   runs `scaled_dot_product_attention`, so on CUDA LibTorch picks its flash or
//!   memory-efficient kernel, and grouped-query heads are read without repeating the keys and
//!   values;
//! - the cross entropy ([`cross_entropy_sum`]) writes its own backward pass, so that its f32
//!   copy of the logits exists one chunk of rows at a time, forward and backward, and only each
//!   row's log-sum-exp is kept between them.
//!
//! Every input the node keeps is held as Burn's handle too, so Burn never writes over a buffer
//! LibTorch's saved graph still reads. Without autodiff (evaluation, the forward pass of a
//! checkpointed segment) the same LibTorch functions run without recording.

// Burn marks its LibTorch backend deprecated; it is the GPU backend that builds without LLVM.
#![allow(deprecated)]

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::NoCheckpointing;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, NodeGuard, Ops, OpsKind};
use burn::backend::libtorch::TchTensor;
use burn::backend::{Autodiff, LibTorch};
use burn::tensor::{Int, Tensor};
use std::ffi::{c_char, c_void};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use tch::Kind;

/// LibTorch under autodiff without Burn's gradient checkpointing (the engine checkpoints by
/// segments of its own, each an ordinary graph).
type Tad = Autodiff<LibTorch, NoCheckpointing>;

/// Rows of the cross entropy's f32 logits at a time: at most this many f32 values.
const LOSS_CHUNK_VALUES: i64 = 1 << 24;

/// Operations of this module built so far under autodiff, in this process.
static BUILT: AtomicUsize = AtomicUsize::new(0);

/// Operations on LibTorch's own kernels built so far under autodiff in this process: the check
/// that a model on LibTorch runs them rather than Burn's decomposed forms.
pub fn built() -> usize {
    BUILT.load(Ordering::Relaxed)
}

/// Whether the operations take LibTorch's kernels; off, Burn's decomposed forms run.
static ENABLED: AtomicBool = AtomicBool::new(true);

/// Lets the fused operations on LibTorch run (the default), or not: off, Burn's decomposed forms
/// run instead, for benchmarks that compare the two in one process.
pub fn set_enabled(on: bool) {
    ENABLED.store(on, Ordering::Relaxed);
}

/// Sets the threads of LibTorch's CPU kernels (its intra-op pool).
pub fn set_threads(threads: usize) {
    tch::set_num_threads(i32::try_from(threads).unwrap_or(i32::MAX));
}

/// An operation's float input on LibTorch: its tensor, and its node where it is a tensor of
/// [`Tad`].
struct Input {
    tensor: TchTensor,
    node: Option<NodeGuard>,
}

/// `x` on LibTorch, under autodiff or not; `None` on other backends.
fn input<const D: usize>(x: &Tensor<D>) -> Option<Input> {
    if !ENABLED.load(Ordering::Relaxed) {
        return None;
    }
    if let Ok(ad) = x.clone().try_into_primitive::<Tad>() {
        let (tensor, node) = ad.into_parts();
        return Some(Input { tensor, node: Some(node) });
    }
    let tensor = x.clone().try_into_primitive::<LibTorch>().ok()?;
    Some(Input { tensor, node: None })
}

/// Whether `t` is a LibTorch tensor outside autodiff, and the operations on LibTorch's kernels
/// are on.
pub(crate) fn on_libtorch<const D: usize>(t: &Tensor<D>) -> bool {
    ENABLED.load(Ordering::Relaxed) && t.clone().try_into_primitive::<LibTorch>().is_ok()
}

/// An integer tensor on LibTorch (under autodiff or not).
fn int_input<const D: usize>(x: &Tensor<D, Int>) -> Option<TchTensor> {
    if !ENABLED.load(Ordering::Relaxed) {
        return None;
    }
    x.clone().try_into_primitive::<Tad>().or_else(|_| x.clone().try_into_primitive::<LibTorch>()).ok()
}

/// A shallow handle on the same LibTorch tensor (same storage, same autograd history).
fn handle(t: &TchTensor) -> tch::Tensor {
    t.tensor.shallow_clone()
}

/// A LibTorch tensor outside autodiff.
fn plain<const E: usize>(out: tch::Tensor) -> Tensor<E> {
    Tensor::from_primitive::<LibTorch>(TchTensor::new(out))
}

/// A constant of an operation (a table no gradient reaches): its LibTorch tensor, detached.
fn constant<const D: usize>(x: &Tensor<D>) -> Option<tch::Tensor> {
    input(x).map(|i| i.tensor.tensor.detach())
}

/// What a [`TorchBackward`] node keeps: the inputs as Burn holds them (so Burn never writes over
/// them in place), LibTorch's leaves for them and its output with the recorded graph, and the
/// handle on the output Burn was given (for the same reason).
#[derive(Clone, Debug)]
struct Recorded<const N: usize> {
    _inputs: [TchTensor; N],
    leaves: [TchTensor; N],
    out: TchTensor,
    _given: TchTensor,
}

/// The backward pass of an operation LibTorch's autograd recorded: the gradients of the inputs
/// that take one, from LibTorch's graph, seeded with the incoming gradient.
#[derive(Debug)]
struct TorchBackward;

impl<const N: usize> Backward<LibTorch, N> for TorchBackward {
    type State = Recorded<N>;

    fn backward(self, ops: Ops<Self::State, N>, grads: &mut Gradients, _: &mut Checkpointer) {
        let grad = grads.consume::<LibTorch>(&ops.node);
        let Recorded { leaves, out, .. } = ops.state;
        let wanted: Vec<_> = ops.parents.iter().zip(&leaves).filter_map(|(p, l)| p.as_ref().map(|p| (p.clone(), handle(l)))).collect();
        if wanted.is_empty() {
            return;
        }
        let leaves: Vec<_> = wanted.iter().map(|(_, l)| l.shallow_clone()).collect();
        let gs = vjp(&out.tensor, &grad.tensor.to_kind(out.tensor.kind()), &leaves);
        for ((parent, leaf), g) in wanted.into_iter().zip(gs) {
            let g = if g.defined() { g } else { leaf.zeros_like() };
            grads.register::<LibTorch>(parent.id, TchTensor::new(g));
        }
    }
}

/// Runs `f` on the inputs' LibTorch tensors as one operation: recorded by LibTorch's autograd
/// and one node of Burn's when any input takes a gradient. `None` unless every input is a
/// LibTorch tensor, all under autodiff or none.
fn recorded<const N: usize, const E: usize>(
    inputs: [Option<Input>; N],
    f: impl FnOnce(&[tch::Tensor; N]) -> tch::Tensor,
) -> Option<Tensor<E>> {
    if inputs.iter().any(Option::is_none) {
        return None;
    }
    let inputs = inputs.map(|i| i.expect("checked above"));
    let autodiff = inputs.iter().all(|i| i.node.is_some());
    if !autodiff && inputs.iter().any(|i| i.node.is_some()) {
        return None;
    }
    let tensors: [TchTensor; N] = inputs.each_ref().map(|i| i.tensor.clone());
    if !autodiff {
        return Some(plain(tch::no_grad(|| f(&tensors.each_ref().map(handle)))));
    }
    let nodes = inputs.map(|i| i.node.expect("checked above"));
    match TorchBackward.prepare::<NoCheckpointing>(nodes).compute_bound().stateful() {
        OpsKind::Tracked(prep) => {
            let leaves = tensors.each_ref().map(|t| {
                let leaf = t.tensor.detach();
                if leaf.is_floating_point() { leaf.set_requires_grad(true) } else { leaf }
            });
            let out = tch::with_grad(|| f(&leaves));
            let given = TchTensor::new(out.detach());
            let state = Recorded { _inputs: tensors, leaves: leaves.map(TchTensor::new), out: TchTensor::new(out), _given: given.clone() };
            BUILT.fetch_add(1, Ordering::Relaxed);
            Some(Tensor::from_primitive::<Tad>(prep.finish(state, given)))
        }
        OpsKind::UnTracked(prep) => {
            let out = tch::no_grad(|| f(&tensors.each_ref().map(handle)));
            Some(Tensor::from_primitive::<Tad>(prep.finish(TchTensor::new(out))))
        }
    }
}

/// `x w (+ b)`, `w` `[d_in, d_out]`, as one operation. `None` off LibTorch.
pub(super) fn linear<const D: usize>(x: &Tensor<D>, weight: &Tensor<2>, bias: Option<&Tensor<1>>) -> Option<Tensor<D>> {
    match bias {
        None => recorded([input(x), input(weight)], |[x, w]| x.matmul(w)),
        Some(b) => recorded([input(x), input(weight), input(b)], |[x, w, b]| x.matmul(w) + b),
    }
}

/// Causal attention with grouped-query heads, `[b, s, h * e]`, on LibTorch's
/// `scaled_dot_product_attention`: `q_bhse` is `[b, h, s, e]`, `k_bkse` and `v_bkse` are
/// `[b, k, s, e]` with `h` a multiple of `k` (query head `i` reads kv head `i / (h / k)`).
/// `None` off LibTorch.
pub(super) fn attention(q_bhse: &Tensor<4>, k_bkse: &Tensor<4>, v_bkse: &Tensor<4>, scale: f64) -> Option<Tensor<3>> {
    let [b, h, s, e] = q_bhse.dims().map(|n| n as i64);
    let kv = k_bkse.dims()[1] as i64;
    recorded([input(q_bhse), input(k_bkse), input(v_bkse)], |[q, k, v]| {
        let out = tch::Tensor::scaled_dot_product_attention(q, k, v, None::<tch::Tensor>, 0.0, true, scale, h != kv);
        out.transpose(1, 2).reshape([b, s, h * e])
    })
}

/// RMSNorm over the last dimension, the weight taking `x`'s element type inside the operation
/// (its gradient reaches the weight in the weight's own type). `None` off LibTorch.
pub(super) fn rms_norm<const D: usize>(x: &Tensor<D>, weight: &Tensor<1>, eps: f64) -> Option<Tensor<D>> {
    let d = x.dims()[D - 1] as i64;
    recorded([input(x), input(weight)], |[x, w]| x.rms_norm([d], Some(w.to_kind(x.kind())), eps))
}

/// The rotary embedding of `x` `[b, h, s, e]` by the tables `cos`, `sin` `[s, e]` (rotate-half
/// form). `None` off LibTorch.
pub(super) fn rope(x: &Tensor<4>, cos: &Tensor<2>, sin: &Tensor<2>) -> Option<Tensor<4>> {
    let half = (x.dims()[3] / 2) as i64;
    let (c, sn) = (constant(cos)?, constant(sin)?);
    recorded([input(x)], |[x]| {
        let (c, sn) = (c.to_kind(x.kind()), sn.to_kind(x.kind()));
        let rotated = tch::Tensor::cat(&[x.narrow(3, half, half).neg(), x.narrow(3, 0, half)], 3);
        x * c + rotated * sn
    })
}

/// `silu(gate) * up`. `None` off LibTorch.
pub(super) fn swiglu<const D: usize>(gate: &Tensor<D>, up: &Tensor<D>) -> Option<Tensor<D>> {
    recorded([input(gate), input(up)], |[g, u]| g.silu() * u)
}

/// The summed cross entropy of `logits_bsv` against `targets_bs`, `[1]` in f32, as one
/// operation with its own backward pass (see the module docs). `None` off LibTorch.
pub(super) fn cross_entropy_sum(logits_bsv: &Tensor<3>, targets_bs: &Tensor<2, Int>) -> Option<Tensor<1>> {
    let z = input(logits_bsv)?;
    let targets = int_input(targets_bs)?;
    let v = logits_bsv.dims()[2] as i64;
    let rows_z = z.tensor.tensor.reshape([-1, v]);
    let rows_t = targets.tensor.reshape([-1, 1]);
    let chunk = (LOSS_CHUNK_VALUES / v.max(1)).max(1);
    // Per chunk of rows: the f32 logits, their log-sum-exp (kept), the loss summed.
    let forward = || {
        let (mut loss, mut lse) = (Vec::new(), Vec::new());
        for (zc, tc) in rows_z.split(chunk, 0).iter().zip(rows_t.split(chunk, 0)) {
            let zc = zc.to_kind(Kind::Float);
            let l = zc.logsumexp([1], false);
            loss.push((&l - zc.gather(1, &tc, false).squeeze_dim(1)).sum(Kind::Float));
            lse.push(l);
        }
        (tch::Tensor::stack(&loss, 0).sum(Kind::Float).reshape([1]), tch::Tensor::cat(&lse, 0))
    };
    let Some(node) = z.node else {
        return Some(plain(tch::no_grad(forward).0));
    };
    let (loss, lse) = tch::no_grad(forward);
    let out = match LossBackward.prepare::<NoCheckpointing>([node]).compute_bound().stateful() {
        OpsKind::Tracked(prep) => prep.finish((z.tensor, targets, TchTensor::new(lse)), TchTensor::new(loss)),
        OpsKind::UnTracked(prep) => prep.finish(TchTensor::new(loss)),
    };
    BUILT.fetch_add(1, Ordering::Relaxed);
    Some(Tensor::from_primitive::<Tad>(out))
}

/// The cross entropy's backward pass: per chunk of rows, `(softmax(z) - onehot(target)) * dloss`
/// from the kept log-sum-exp, written in the logits' element type.
#[derive(Debug)]
struct LossBackward;

impl Backward<LibTorch, 1> for LossBackward {
    type State = (TchTensor, TchTensor, TchTensor);

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let dloss = grads.consume::<LibTorch>(&ops.node).tensor.to_kind(Kind::Float).reshape([1, 1]);
        let [Some(parent)] = ops.parents else { return };
        let (z, targets, lse) = ops.state;
        let shape = z.tensor.size();
        let v = *shape.last().expect("logits have a vocabulary dimension");
        let chunk = (LOSS_CHUNK_VALUES / v.max(1)).max(1);
        let rows_z = z.tensor.reshape([-1, v]);
        let rows_t = targets.tensor.reshape([-1, 1]);
        let dz = tch::no_grad(|| {
            let parts: Vec<_> = rows_z
                .split(chunk, 0)
                .iter()
                .zip(rows_t.split(chunk, 0))
                .zip(lse.tensor.split(chunk, 0))
                .map(|((zc, tc), lc)| {
                    let mut p = (zc.to_kind(Kind::Float) - lc.unsqueeze(1)).exp();
                    let _ = p.scatter_add_(1, &tc, &tch::Tensor::full([tc.size()[0], 1], -1.0, (Kind::Float, p.device())));
                    (p * &dloss).to_kind(z.tensor.kind())
                })
                .collect();
            tch::Tensor::cat(&parts, 0).reshape(shape.as_slice())
        });
        grads.register::<LibTorch>(parent.id, TchTensor::new(dz));
    }
}

// cpp/torch_glue.cpp, built by build.rs with feature `tch`.
#[allow(unsafe_code)]
unsafe extern "C" {
    fn copus_operator_count_start();
    fn copus_operator_count() -> u64;
    fn copus_adamw_foreach(
        p: *const *mut c_void,
        g: *const *mut c_void,
        m1: *const *mut c_void,
        m2: *const *mut c_void,
        n: i32,
        k: *const f64,
        first: i32,
        decay: i32,
        out_p: *mut *mut c_void,
        out_m1: *mut *mut c_void,
        out_m2: *mut *mut c_void,
        err: *mut c_char,
        err_len: usize,
    ) -> i32;
    fn copus_vjp(
        out: *mut c_void,
        grad: *mut c_void,
        inputs: *const *mut c_void,
        n: i32,
        results: *mut *mut c_void,
        err: *mut c_char,
        err_len: usize,
    ) -> i32;
}

/// The gradients of `inputs` (leaves of the graph LibTorch recorded up to `out`) given `out`'s
/// gradient `grad`: LibTorch's autograd run once, seeded with `grad`, the graph then released.
/// An input the graph does not reach gets an undefined tensor.
fn vjp(out: &tch::Tensor, grad: &tch::Tensor, inputs: &[tch::Tensor]) -> Vec<tch::Tensor> {
    // tch's handles (`at::Tensor*`), which the C++ side only reads.
    let handle = |t: &tch::Tensor| t.as_ptr().cast_mut().cast::<c_void>();
    let handles: Vec<*mut c_void> = inputs.iter().map(handle).collect();
    let mut results = vec![std::ptr::null_mut::<c_void>(); inputs.len()];
    let mut err = [0 as c_char; 512];
    let n = i32::try_from(inputs.len()).expect("a handful of inputs");
    #[allow(unsafe_code)]
    // SAFETY: every handle is a live tensor of tch's (an `at::Tensor*`) borrowed for the call;
    // the C++ side reads them, writes `n` fresh handles to `results` (owned by the tensors
    // made from them below, which tch frees) and at most `err.len()` bytes to `err`.
    let failed = unsafe { copus_vjp(handle(out), handle(grad), handles.as_ptr(), n, results.as_mut_ptr(), err.as_mut_ptr(), err.len()) };
    if failed != 0 {
        // SAFETY: the C++ side wrote a NUL-terminated message within the buffer.
        #[allow(unsafe_code)]
        let msg = unsafe { std::ffi::CStr::from_ptr(err.as_ptr()) }.to_string_lossy().into_owned();
        panic!("LibTorch's backward pass of a fused operation failed: {msg}");
    }
    #[allow(unsafe_code)]
    // SAFETY: each result is a fresh `at::Tensor*` the C++ side allocated for us alone.
    results.into_iter().map(|p| unsafe { tch::Tensor::from_ptr(p.cast()) }).collect()
}

/// `f`'s result and the LibTorch operator calls made while it ran (`aten::` functions, nested
/// calls included: the events PyTorch's profiler records), counted over every thread of the
/// process, so nothing else should run LibTorch meanwhile.
pub fn count_operator_calls<T>(f: impl FnOnce() -> T) -> (T, u64) {
    #[allow(unsafe_code)]
    // SAFETY: the two functions take no arguments; the first registers LibTorch's callback
    // once, the second reads an atomic counter.
    let before = unsafe {
        copus_operator_count_start();
        copus_operator_count()
    };
    let out = f();
    #[allow(unsafe_code)]
    // SAFETY: as above.
    let after = unsafe { copus_operator_count() };
    (out, after - before)
}

/// The scalars of one AdamW update, as the per-parameter form uses them (f32, Burn's).
#[derive(Clone, Copy, Debug)]
pub(crate) struct AdamwScalars {
    /// beta_1, 1 - beta_1, beta_2, 1 - beta_2, the two bias corrections, epsilon, the decay's
    /// `1 - lr * weight_decay` (unused without decay) and the learning rate.
    pub k: [f32; 9],
    /// The first update: the moments start from the gradient alone.
    pub first: bool,
    /// Whether the weights decay (by `k[7]`).
    pub decay: bool,
}

/// AdamW over many flat parameters on LibTorch in `_foreach_` operations (each of Burn's
/// per-parameter operations once over the whole list: on CUDA a few multi-tensor kernels
/// instead of about ten launches per parameter): the new values and moments, or `None` where a
/// tensor is not a LibTorch tensor outside autodiff or the lists differ in length (the caller
/// then updates parameter by parameter). `moments` is absent on the first update.
#[allow(clippy::type_complexity)]
pub(crate) fn adamw_foreach(
    params: &[Tensor<1>],
    grads: &[Tensor<1>],
    moments: Option<(&[Tensor<1>], &[Tensor<1>])>,
    k: AdamwScalars,
) -> Option<(Vec<Tensor<1>>, Vec<Tensor<1>>, Vec<Tensor<1>>)> {
    let n = params.len();
    if !ENABLED.load(Ordering::Relaxed) || grads.len() != n || moments.is_some_and(|(a, b)| a.len() != n || b.len() != n) {
        return None;
    }
    let tch = |ts: &[Tensor<1>]| -> Option<Vec<TchTensor>> { ts.iter().map(|t| t.clone().try_into_primitive::<LibTorch>().ok()).collect() };
    let (p, g) = (tch(params)?, tch(grads)?);
    let (m1, m2) = match moments {
        Some((a, b)) => (tch(a)?, tch(b)?),
        None => (Vec::new(), Vec::new()),
    };
    let handle = |t: &TchTensor| t.tensor.as_ptr().cast_mut().cast::<c_void>();
    let handles = |ts: &[TchTensor]| ts.iter().map(handle).collect::<Vec<_>>();
    let (hp, hg, h1, h2) = (handles(&p), handles(&g), handles(&m1), handles(&m2));
    let (mut op, mut o1, mut o2) = (vec![std::ptr::null_mut::<c_void>(); n], vec![std::ptr::null_mut(); n], vec![std::ptr::null_mut(); n]);
    let scalars: Vec<f64> = k.k.iter().map(|&x| f64::from(x)).collect();
    let mut err = [0 as c_char; 512];
    #[allow(unsafe_code)]
    // SAFETY: every handle is a live tensor of tch's (an `at::Tensor*`) borrowed for the call
    // (`m1` and `m2` are read only when `first` is 0, and then hold `n` each); `scalars` holds
    // the 9 values read; the C++ side writes `n` fresh handles to each output (owned by the
    // tensors made from them below, which tch frees) and at most `err.len()` bytes to `err`.
    let failed = unsafe {
        copus_adamw_foreach(
            hp.as_ptr(),
            hg.as_ptr(),
            h1.as_ptr(),
            h2.as_ptr(),
            i32::try_from(n).ok()?,
            scalars.as_ptr(),
            i32::from(k.first),
            i32::from(k.decay),
            op.as_mut_ptr(),
            o1.as_mut_ptr(),
            o2.as_mut_ptr(),
            err.as_mut_ptr(),
            err.len(),
        )
    };
    if failed != 0 {
        // SAFETY: the C++ side wrote a NUL-terminated message within the buffer.
        #[allow(unsafe_code)]
        let msg = unsafe { std::ffi::CStr::from_ptr(err.as_ptr()) }.to_string_lossy().into_owned();
        panic!("LibTorch's AdamW over the parameters failed: {msg}");
    }
    #[allow(unsafe_code)]
    // SAFETY: each output is a fresh `at::Tensor*` the C++ side allocated for us alone.
    let take = |hs: Vec<*mut c_void>| hs.into_iter().map(|h| plain(unsafe { tch::Tensor::from_ptr(h.cast()) })).collect();
    Some((take(op), take(o1), take(o2)))
}
