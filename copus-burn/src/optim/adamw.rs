//! AdamW whose moments copus holds itself, as tensors.
//!
//! Burn's `ModuleOptimizer` keeps its state private. Outside Burn the state can only be reached
//! as a serialised burnpack record, so every layout change and every checkpoint serialised and
//! parsed both moments of every parameter. Here the moments are plain tensors. A layout change
//! slices them where they lie, and a restore hands the received values over without a copy.
//!
//! The update is one pass per parameter on the host when the parameter, its gradient and both
//! moments are contiguous f32 tensors on Flex. Each element's parameter, gradient and moments
//! are read once and written once, where Burn's AdamW runs about ten element-wise tensor
//! operations, each over the whole tensor. Elsewhere (another device, another dtype, a strided
//! gradient) the same update runs as Burn tensor operations.
//!
//! Both paths do Burn 0.22's AdamW arithmetic operation for operation, in f32 and in its order,
//! so they give Burn's results to the bit (tested against `ModuleOptimizer`). The state is named
//! as Burn's record names it (`momentum.moment_1`, `momentum.moment_2`, the scalars
//! `momentum.time` and `__rank`), so checkpoints written through either read with the other.

use std::collections::HashMap;

use burn::backend::Flex;
use burn::backend::flex::FlexTensor;
use burn::module::{Module, ModuleMapper, Param, ParamGroup, ParamId};
use burn::optim::GradientsParams;
use burn::tensor::{DType, Device, Tensor, TensorData};
use burn_pack::Scalar;
use rayon::prelude::*;

/// The record name of the first moment.
pub(crate) const MOMENT_1: &str = "momentum.moment_1";
/// The record name of the second moment.
pub(crate) const MOMENT_2: &str = "momentum.moment_2";
/// The record name of the step count.
pub(crate) const TIME: &str = "momentum.time";
/// The record name of the parameter's number of dimensions.
pub(super) const RANK: &str = "__rank";

/// Elements per task of the host update: elementwise, so the split changes no result.
const PART: usize = 1 << 16;

/// The moments of one parameter.
#[derive(Clone, Debug)]
pub struct Moments {
    /// Updates taken.
    pub time: usize,
    /// The parameter's shape; the moments are its values flattened.
    pub shape: Vec<usize>,
    /// First moment.
    pub m1: Tensor<1>,
    /// Second moment.
    pub m2: Tensor<1>,
}

impl Moments {
    /// Moments from host values, on `device`.
    pub(crate) fn from_values(time: usize, shape: Vec<usize>, m1: Vec<f32>, m2: Vec<f32>, device: &Device) -> Result<Self, String> {
        let n: usize = shape.iter().product();
        if m1.len() != n || m2.len() != n {
            return Err(format!("moments of {} and {} values for a parameter of shape {shape:?}", m1.len(), m2.len()));
        }
        let t = |v: Vec<f32>| crate::traffic::upload::<1, _>(TensorData::new(v, [n]), device, crate::traffic::Kind::State);
        Ok(Self { time, shape, m1: t(m1), m2: t(m2) })
    }

    /// Moments from flat tensors, taken as they are.
    pub(crate) fn from_tensors(time: usize, shape: Vec<usize>, m1: Tensor<1>, m2: Tensor<1>) -> Result<Self, String> {
        let n: usize = shape.iter().product();
        let (a, b) = (m1.dims()[0], m2.dims()[0]);
        if a != n || b != n {
            return Err(format!("moments of {a} and {b} values for a parameter of shape {shape:?}"));
        }
        Ok(Self { time, shape, m1, m2 })
    }

    /// The record scalars of this parameter's state: (name, value).
    pub fn scalars(&self) -> [(&'static str, Scalar); 2] {
        [(TIME, Scalar::from(self.time)), (RANK, Scalar::from(self.shape.len()))]
    }
}

/// AdamW with decoupled weight decay; parameters whose module path contains one of the
/// `no_decay` predicates take none.
#[derive(Clone, Debug)]
pub struct AdamW {
    beta_1: f32,
    beta_2: f32,
    eps: f32,
    weight_decay: f32,
    no_decay: Vec<ParamGroup>,
    moments: HashMap<ParamId, Moments>,
    /// Whether parameters on LibTorch are updated together (feature `tch`).
    foreach: bool,
    /// Calls that updated parameters together so far.
    grouped: usize,
}

/// The scalars of one update.
#[derive(Clone, Copy, Debug)]
struct Coeffs {
    beta_1: f32,
    beta_2: f32,
    factor_1: f32,
    factor_2: f32,
    correct_1: f32,
    correct_2: f32,
    eps: f32,
    /// `1 - lr * weight_decay`, when there is any decay.
    keep: Option<f32>,
    lr: f32,
    first: bool,
}

impl AdamW {
    /// AdamW with Burn's arguments: betas, epsilon and weight decay as f32, as Burn's config
    /// holds them.
    pub(crate) fn new(beta_1: f32, beta_2: f32, eps: f32, weight_decay: f32, no_decay: &[String]) -> Self {
        let no_decay =
            if weight_decay > 0.0 { no_decay.iter().map(|p| ParamGroup::from_predicate(p.clone())).collect() } else { Vec::new() };
        Self { beta_1, beta_2, eps, weight_decay, no_decay, moments: HashMap::new(), foreach: true, grouped: 0 }
    }

    /// Updates every parameter of `module` that has a gradient in `grads` at learning rate `lr`.
    /// With feature `tch`, where every such parameter and gradient is a LibTorch tensor, the
    /// parameters that share a step count and a weight decay are updated together, each
    /// operation once over all of them ([`AdamW::set_foreach`]); elsewhere one by one.
    pub fn step<M: Module>(&mut self, lr: f64, module: M, grads: GradientsParams) -> M {
        #[cfg(feature = "tch")]
        let (module, grads) = match self.foreach.then(|| foreach::collect(self, &module, &grads)).flatten() {
            Some(list) => return foreach::step(self, lr, module, grads, list),
            None => (module, grads),
        };
        module.map(&mut Stepper { optim: self, grads, lr, path: Vec::new() })
    }

    /// Whether [`AdamW::step`] updates the parameters on LibTorch together (the default), each
    /// of Burn's operations once over all of them (PyTorch's `_foreach_` functions: on CUDA a few
    /// multi-tensor kernels instead of about ten launches per parameter), or one by one as on
    /// every other backend (for benchmarks that compare the two). The values are the same (to
    /// the bit on LibTorch's CPU, tested; on CUDA the grouped form divides by a scalar as the
    /// per-parameter form does there, untested without a GPU). ZeRO-1's sharded update
    /// ([`crate::EngineConfig`]'s `zero1`) updates its pieces one by one.
    pub fn set_foreach(&mut self, on: bool) {
        self.foreach = on;
    }

    /// The calls so far that updated parameters together ([`AdamW::set_foreach`]; none
    /// without feature `tch`): one per group of parameters that share a step count and a
    /// decay in each step, more for a group larger than 2^26 elements.
    pub fn grouped_updates(&self) -> usize {
        self.grouped
    }

    /// The moments of parameter `id`, once it has been updated or restored.
    pub fn moments(&self, id: ParamId) -> Option<&Moments> {
        self.moments.get(&id)
    }

    /// Parameters that have moments.
    pub fn ids(&self) -> impl Iterator<Item = ParamId> + '_ {
        self.moments.keys().copied()
    }

    /// Sets the moments of parameter `id`.
    pub fn set_moments(&mut self, id: ParamId, moments: Moments) {
        self.moments.insert(id, moments);
    }

    /// Takes the moments of parameter `id` out.
    pub(crate) fn take_moments(&mut self, id: ParamId) -> Option<Moments> {
        self.moments.remove(&id)
    }

    /// Updates a flat piece `p` of the parameter `id` at module path `path` with its gradient
    /// `g` (of the same length): the new values. The piece's moments are kept under `id`, of
    /// the piece's length; a sharded optimizer (ZeRO-1) updates the part of each parameter a
    /// rank owns this way, element for element as [`AdamW::step`] updates the whole.
    pub(crate) fn update_piece(&mut self, id: ParamId, path: &str, p: Tensor<1>, g: Tensor<1>, lr: f64) -> Tensor<1> {
        self.update(id, path, p, g, lr)
    }

    /// Parameters with moments.
    pub fn len(&self) -> usize {
        self.moments.len()
    }

    /// Whether no parameter has moments yet.
    pub fn is_empty(&self) -> bool {
        self.moments.is_empty()
    }

    /// The weight decay of the parameter at `path`.
    fn decay(&self, id: ParamId, path: &str) -> f32 {
        if self.no_decay.iter().any(|g| g.matches(&id, Some(path))) { 0.0 } else { self.weight_decay }
    }

    /// One parameter's update: the new (non-autodiff) value.
    fn update<const D: usize>(&mut self, id: ParamId, path: &str, p: Tensor<D>, g: Tensor<D>, lr: f64) -> Tensor<D> {
        let dims = p.dims();
        let n = p.shape().num_elements();
        let state = self.moments.remove(&id);
        let (time, k) = self.coeffs(id, path, state.as_ref(), lr);
        let (p, m1, m2) = match host_update(p, g, state, n, &k) {
            Ok(done) => done,
            Err((p, g, state)) => device_update(p, g, state, n, &k),
        };
        self.moments.insert(id, Moments { time, shape: dims.to_vec(), m1, m2 });
        p
    }
}

impl AdamW {
    /// The scalars of the update of parameter `id` at `path` at learning rate `lr`, with the
    /// moments it has (`None` before its first update).
    fn coeffs(&self, id: ParamId, path: &str, state: Option<&Moments>, lr: f64) -> (usize, Coeffs) {
        let time = state.map_or(1, |s| s.time + 1);
        let decay_rate = lr * f64::from(self.decay(id, path));
        let k = Coeffs {
            beta_1: self.beta_1,
            beta_2: self.beta_2,
            factor_1: 1.0 - self.beta_1,
            factor_2: 1.0 - self.beta_2,
            correct_1: 1f32 - self.beta_1.powi(time as i32),
            correct_2: 1f32 - self.beta_2.powi(time as i32),
            eps: self.eps,
            keep: (decay_rate != 0.0).then_some((1.0 - decay_rate) as f32),
            lr: lr as f32,
            first: state.is_none(),
        };
        (time, k)
    }
}

/// What the host update hands back when it cannot run: its inputs.
type NotOnHost<const D: usize> = (Tensor<D>, Tensor<D>, Option<Moments>);

/// The update in one pass on the host, when every tensor is a contiguous f32 tensor on Flex.
// Tensor handles by value, as Burn passes them; boxing them would only add allocations.
#[allow(clippy::result_large_err)]
fn host_update<const D: usize>(
    p: Tensor<D>,
    g: Tensor<D>,
    state: Option<Moments>,
    n: usize,
    k: &Coeffs,
) -> Result<(Tensor<D>, Tensor<1>, Tensor<1>), NotOnHost<D>> {
    let (Some(fp), Some(fg)) = (contiguous_f32(&p), contiguous_f32(&g)) else { return Err((p, g, state)) };
    let len = |f: &FlexTensor| f.as_slice::<f32>().map_or(0, <[f32]>::len);
    if len(&fp) != n
        || len(&fg) != n
        || state.as_ref().is_some_and(|s| s.m1.shape().num_elements() != n || s.m2.shape().num_elements() != n)
    {
        // Sizes that disagree: the tensor operations refuse them loudly.
        return Err((p, g, state));
    }
    let moments = match &state {
        Some(s) => match (contiguous_f32(&s.m1), contiguous_f32(&s.m2)) {
            (Some(a), Some(b)) => Some((a, b)),
            _ => return Err((p, g, state)),
        },
        None => None,
    };
    // The clones above are the handles from here on: each holds its buffer alone once the
    // originals are gone, and is then written in place.
    drop((p, state));
    let (mut fp, mut m1, mut m2) = match moments {
        Some((a, b)) => (fp, a, b),
        None => (fp, flex_zeros(n), flex_zeros(n)),
    };
    {
        let gv = fg.as_slice::<f32>().expect("contiguous");
        let pv = writable(&mut fp);
        let (a, b) = (writable(&mut m1), writable(&mut m2));
        pv.par_chunks_mut(PART).zip(a.par_chunks_mut(PART)).zip(b.par_chunks_mut(PART)).zip(gv.par_chunks(PART)).for_each(
            |(((p, a), b), g)| {
                for (((p, a), b), &g) in p.iter_mut().zip(a.iter_mut()).zip(b.iter_mut()).zip(g) {
                    adamw_element(p, a, b, g, k);
                }
            },
        );
    }
    drop(g);
    Ok((Tensor::from_primitive::<Flex>(fp), Tensor::from_primitive::<Flex>(m1), Tensor::from_primitive::<Flex>(m2)))
}

/// The Flex handle of a contiguous f32 tensor on Flex.
pub(crate) fn contiguous_f32<const D: usize>(t: &Tensor<D>) -> Option<FlexTensor> {
    t.clone().try_into_primitive::<Flex>().ok().filter(|f| f.dtype() == DType::F32 && f.as_slice::<f32>().is_some())
}

/// A contiguous f32 Flex tensor's values, in its own buffer when it holds that alone, else in a
/// copy it then holds.
fn writable(t: &mut FlexTensor) -> &mut [f32] {
    let (start, end) = t.layout().contiguous_offsets().expect("contiguous");
    &mut t.storage_mut::<f32>()[start..end]
}

/// A Flex tensor of `n` zeros.
fn flex_zeros(n: usize) -> FlexTensor {
    FlexTensor::from_data(TensorData::new(vec![0f32; n], [n]))
}

/// One element of Burn's AdamW, operation for operation.
#[inline(always)]
fn adamw_element(p: &mut f32, m1: &mut f32, m2: &mut f32, g: f32, k: &Coeffs) {
    if k.first {
        *m1 = g * k.factor_1;
        *m2 = (g * g) * k.factor_2;
    } else {
        *m1 = *m1 * k.beta_1 + g * k.factor_1;
        *m2 = *m2 * k.beta_2 + (g * g) * k.factor_2;
    }
    let delta = (*m1 / k.correct_1) / ((*m2 / k.correct_2).sqrt() + k.eps);
    let decayed = match k.keep {
        Some(keep) => *p * keep,
        None => *p,
    };
    *p = decayed - delta * k.lr;
}

/// The update as Burn tensor operations (any device), in Burn's AdamW's order.
fn device_update<const D: usize>(
    p: Tensor<D>,
    g: Tensor<D>,
    state: Option<Moments>,
    n: usize,
    k: &Coeffs,
) -> (Tensor<D>, Tensor<1>, Tensor<1>) {
    let dims = p.dims();
    let (p, g) = (p.reshape([n]), g.reshape([n]));
    let (m1, m2) = match state {
        Some(s) => (
            s.m1.mul_scalar(k.beta_1).add(g.clone().mul_scalar(k.factor_1)),
            s.m2.mul_scalar(k.beta_2).add(g.square().mul_scalar(k.factor_2)),
        ),
        None => (g.clone().mul_scalar(k.factor_1), g.square().mul_scalar(k.factor_2)),
    };
    let delta = m1.clone().div_scalar(k.correct_1).div(m2.clone().div_scalar(k.correct_2).sqrt().add_scalar(k.eps));
    let decayed = match k.keep {
        Some(keep) => p.mul_scalar(keep),
        None => p,
    };
    ((decayed - delta.mul_scalar(k.lr)).reshape(dims), m1, m2)
}

/// The update of many parameters at once on LibTorch (feature `tch`).
#[cfg(feature = "tch")]
mod foreach {
    use std::collections::{BTreeMap, HashMap};

    use burn::module::{Module, ModuleMapper, ModuleVisitor, Param, ParamId};
    use burn::optim::GradientsParams;
    use burn::tensor::Tensor;

    use crate::fused::{AdamwScalars, adamw_foreach};
    use crate::optim::adamw::{AdamW, Coeffs, Moments, marked_as};

    /// What the parameters updated together share: step count, first update, and the bits of
    /// the decay factor (none without decay).
    type GroupKey = (usize, bool, Option<u32>);

    /// A parameter to update: its id, module path, shape, and flat value and gradient.
    pub(super) struct Entry {
        id: ParamId,
        path: String,
        shape: Vec<usize>,
        value: Tensor<1>,
        grad: Tensor<1>,
    }

    /// Every parameter of `module` with a gradient in `grads`, when each is a LibTorch tensor
    /// with its gradient on the same device and moments (if any) of its size; else `None`.
    pub(super) fn collect<M: Module>(optim: &AdamW, module: &M, grads: &GradientsParams) -> Option<Vec<Entry>> {
        struct V<'a> {
            optim: &'a AdamW,
            grads: &'a GradientsParams,
            path: Vec<String>,
            entries: Option<Vec<Entry>>,
        }
        impl ModuleVisitor for V<'_> {
            fn enter_module(&mut self, name: &str, _container_type: &str) {
                self.path.push(name.to_string());
            }
            fn exit_module(&mut self, _name: &str, _container_type: &str) {
                self.path.pop();
            }
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
                let (Some(entries), Some(grad)) = (self.entries.as_mut(), self.grads.get::<D>(param.id)) else { return };
                let value = param.val().inner();
                let n = value.shape().num_elements();
                use crate::fused::on_libtorch as on;
                let fits =
                    self.optim.moments.get(&param.id).is_none_or(|m| m.m1.dims()[0] == n && m.m2.dims()[0] == n && on(&m.m1) && on(&m.m2));
                if grad.device() != value.device() || grad.shape().num_elements() != n || !fits || !on(&value) || !on(&grad) {
                    self.entries = None;
                    return;
                }
                let shape = value.dims().to_vec();
                entries.push(Entry { id: param.id, path: self.path.join("."), shape, value: value.reshape([n]), grad: grad.reshape([n]) });
            }
        }
        let mut v = V { optim, grads, path: Vec::new(), entries: Some(Vec::new()) };
        module.visit(&mut v);
        v.entries.filter(|e| !e.is_empty())
    }

    /// Elements of the parameters updated in one call at most: the call's intermediates are a
    /// few lists of this size (2^26 f32 values, 256 MiB each), whatever the model's size.
    const CHUNK: usize = 1 << 26;

    /// The update of `list` (from [`collect`]): the parameters that share a step count and a
    /// decay updated together, in calls of at most [`CHUNK`] elements, then written into
    /// `module`. A call that cannot run (a tensor that left LibTorch meanwhile) updates its
    /// parameters one by one instead.
    pub(super) fn step<M: Module>(optim: &mut AdamW, lr: f64, module: M, grads: GradientsParams, list: Vec<Entry>) -> M {
        // Every gradient is in `list`.
        drop(grads);
        // Grouped by (step count, first update, decay factor's bits): the scalars of one update.
        let mut groups: BTreeMap<GroupKey, Vec<(Entry, Coeffs)>> = BTreeMap::new();
        for e in list {
            let (time, k) = optim.coeffs(e.id, &e.path, optim.moments.get(&e.id), lr);
            groups.entry((time, k.first, k.keep.map(f32::to_bits))).or_default().push((e, k));
        }
        let mut updated = HashMap::new();
        for ((time, _, _), group) in groups {
            let k = group[0].1;
            let scalars = AdamwScalars {
                k: [k.beta_1, k.factor_1, k.beta_2, k.factor_2, k.correct_1, k.correct_2, k.eps, k.keep.unwrap_or(1.0), k.lr],
                first: k.first,
                decay: k.keep.is_some(),
            };
            for chunk in chunks(group.into_iter().map(|(e, _)| e).collect()) {
                let (p, g): (Vec<Tensor<1>>, Vec<Tensor<1>>) = chunk.iter().map(|e| (e.value.clone(), e.grad.clone())).unzip();
                let (m1, m2): (Vec<Tensor<1>>, Vec<Tensor<1>>) =
                    chunk.iter().filter_map(|e| optim.moments.get(&e.id)).map(|s| (s.m1.clone(), s.m2.clone())).unzip();
                let moments = (!k.first).then_some((&m1[..], &m2[..]));
                let Some((np, n1, n2)) = adamw_foreach(&p, &g, moments, scalars) else {
                    drop((p, g, m1, m2));
                    for e in chunk {
                        let value = optim.update(e.id, &e.path, e.value, e.grad, lr);
                        if let Some(m) = optim.moments.get_mut(&e.id) {
                            m.shape = e.shape;
                        }
                        updated.insert(e.id, value);
                    }
                    continue;
                };
                optim.grouped += 1;
                for (((e, np), n1), n2) in chunk.into_iter().zip(np).zip(n1).zip(n2) {
                    optim.moments.insert(e.id, Moments { time, shape: e.shape, m1: n1, m2: n2 });
                    updated.insert(e.id, np);
                }
            }
        }
        module.map(&mut Assign { updated })
    }

    /// `entries` in runs of at most [`CHUNK`] elements (a larger parameter alone).
    fn chunks(entries: Vec<Entry>) -> Vec<Vec<Entry>> {
        let mut out: Vec<Vec<Entry>> = Vec::new();
        let mut size = 0;
        for e in entries {
            let n = e.value.shape().num_elements();
            match out.last_mut() {
                Some(last) if size + n <= CHUNK => last.push(e),
                _ => {
                    size = 0;
                    out.push(vec![e]);
                }
            }
            size += n;
        }
        out
    }

    /// Writes the updated values into their parameters, marked as the old ones were.
    struct Assign {
        updated: HashMap<ParamId, Tensor<1>>,
    }

    impl ModuleMapper for Assign {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
            let (id, tensor, mapper) = param.consume();
            let Some(value) = self.updated.remove(&id) else { return Param::from_mapped_value(id, tensor, mapper) };
            let dims: [usize; D] = tensor.dims();
            let mark = marked_as(id, &tensor);
            drop(tensor);
            Param::from_mapped_value(id, mark(value.reshape(dims)), mapper)
        }
    }
}

/// Walks a module, updating each parameter that has a gradient.
struct Stepper<'a> {
    optim: &'a mut AdamW,
    grads: GradientsParams,
    lr: f64,
    path: Vec<String>,
}

impl ModuleMapper for Stepper<'_> {
    fn enter_module(&mut self, name: &str, _container_type: &str) {
        self.path.push(name.to_string());
    }

    fn exit_module(&mut self, _name: &str, _container_type: &str) {
        self.path.pop();
    }

    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        let (id, tensor, mapper) = param.consume();
        let Some(grad) = self.grads.remove::<D>(id) else {
            return Param::from_mapped_value(id, tensor, mapper);
        };
        let grad = if grad.device() != tensor.device() { grad.to_device(&tensor.device()) } else { grad };
        let path = self.path.join(".");
        let mark = marked_as(id, &tensor);
        let updated = self.optim.update(id, &path, tensor.inner(), grad, self.lr);
        Param::from_mapped_value(id, mark(updated), mapper)
    }
}

/// What makes a new value of the parameter `id` the parameter `old` was: marked trainable,
/// checkpointed and distributed as `old` is (read before `old` is consumed, so an update can
/// write `old`'s buffer in place).
pub(crate) fn marked_as<const D: usize>(id: ParamId, old: &Tensor<D>) -> impl FnOnce(Tensor<D>) -> Tensor<D> + use<D> {
    let checkpointing = old.gradient_checkpointing_strategy();
    let require_grad = old.is_require_grad();
    let distributed = old.is_distributed();
    move |updated| {
        let mut tensor = Tensor::from_inner(updated);
        if let Some(strategy) = checkpointing {
            tensor = tensor.with_gradient_checkpointing_strategy(strategy);
        }
        if require_grad {
            tensor = tensor.require_grad();
        }
        if distributed {
            tensor = tensor.set_distributed(id);
        }
        tensor
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::nn::{Embedding, EmbeddingConfig, Linear, LinearConfig};
    use burn::optim::ModuleOptimizer;
    use burn::tensor::Distribution;

    #[derive(Module, Debug)]
    struct Net {
        emb: Embedding,
        lin: Linear,
    }

    /// Every parameter's values, by id.
    fn values(net: &Net) -> Vec<(ParamId, Vec<u32>)> {
        struct V(Vec<(ParamId, Vec<u32>)>);
        impl burn::module::ModuleVisitor for V {
            fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<D>>) {
                let v = p.val().into_data().convert::<f32>().try_to_vec::<f32>().unwrap();
                self.0.push((p.id, v.iter().map(|x| x.to_bits()).collect()));
            }
        }
        let mut v = V(Vec::new());
        net.visit(&mut v);
        v.0
    }

    /// `n` pseudo-random values of scale `scale` (a pure function of `salt`).
    fn pseudo(n: usize, salt: u64, scale: f32) -> Vec<f32> {
        let mut x = 0x2545_f491_4f6c_dd1d_u64 ^ salt.wrapping_mul(0x9e37_79b9_7f4a_7c15);
        (0..n)
            .map(|_| {
                x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                ((x >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * scale
            })
            .collect()
    }

    /// Gradients for every parameter; the linear weight's is stored transposed (a strided
    /// tensor) on odd steps, and the bias's holds zeros, a negative zero and a tiny value.
    fn grads(net: &Net, step: usize, device: &Device) -> GradientsParams {
        let mut g = GradientsParams::new();
        let inner = device.clone().inner();
        let t2 = |shape: [usize; 2], salt: u64, scale: f32| {
            Tensor::<2>::from_data(TensorData::new(pseudo(shape[0] * shape[1], salt, scale), shape), &inner)
        };
        let salt = 10 * step as u64;
        g.register::<2>(net.emb.weight.id, t2(net.emb.weight.val().dims(), salt, 2.0));
        let w = net.lin.weight.val().dims();
        let wg = if step % 2 == 1 { t2([w[1], w[0]], salt + 1, 0.2).transpose() } else { t2(w, salt + 1, 0.2) };
        g.register::<2>(net.lin.weight.id, wg);
        let b = net.lin.bias.as_ref().unwrap();
        let bg = Tensor::<1>::from_data(TensorData::new(vec![0.0, -0.0, 1e-30, -3.0, 2.5], [5]), &inner);
        g.register::<1>(b.id, bg);
        g
    }

    /// Burn's record of `optim`: (parameter id, field, values as bits) and (key, scalar).
    /// (key, shape, value bits) of each state tensor, and (key, value) of each scalar, sorted.
    type Record = (Vec<(String, Vec<usize>, Vec<u32>)>, Vec<(String, Scalar)>);

    fn burn_record(optim: &ModuleOptimizer) -> Record {
        let reader = burn_pack::Reader::from_bytes(optim.into_bytes().unwrap()).unwrap();
        let mut scalars: Vec<(String, Scalar)> = reader.scalars().iter().map(|(k, v)| (k.to_string(), *v)).collect();
        let mut tensors = Vec::new();
        for t in reader.into_tensors().unwrap() {
            let (key, dtype, shape, _, bytes) = t.into_parts().unwrap();
            let data = TensorData::from_bytes(bytes, shape, dtype);
            let shape = data.shape().to_vec();
            tensors.push((key, shape, data.iter::<f32>().map(f32::to_bits).collect()));
        }
        tensors.sort_by(|a, b| a.0.cmp(&b.0));
        scalars.sort_by(|a, b| a.0.cmp(&b.0));
        (tensors, scalars)
    }

    /// The same record, from this optimizer's moments.
    fn our_record(optim: &AdamW) -> Record {
        let (mut tensors, mut scalars) = (Vec::new(), Vec::new());
        for id in optim.ids() {
            let m = optim.moments(id).unwrap();
            for (field, t) in [(MOMENT_1, &m.m1), (MOMENT_2, &m.m2)] {
                let v = t.clone().into_data().try_to_vec::<f32>().unwrap();
                tensors.push((format!("{}.{field}", id.val()), m.shape.clone(), v.iter().map(|x| x.to_bits()).collect()));
            }
            for (name, v) in m.scalars() {
                scalars.push((format!("{}.{name}", id.val()), v));
            }
        }
        tensors.sort_by(|a, b| a.0.cmp(&b.0));
        scalars.sort_by(|a, b| a.0.cmp(&b.0));
        (tensors, scalars)
    }

    fn check_against_burn(device: &Device) {
        device.seed(3);
        let net = Net { emb: EmbeddingConfig::new(7, 5).init(device), lin: LinearConfig::new(5, 5).init(device) };
        let cfg = crate::OptimConfig { weight_decay: 0.1, ..crate::OptimConfig::default() };
        let no_decay = vec!["emb".to_string()];
        let mut burn_optim = cfg.init(&no_decay);
        let mut ours = AdamW::new(cfg.beta1 as f32, cfg.beta2 as f32, cfg.eps as f32, cfg.weight_decay as f32, &no_decay);
        let (mut a, mut b) = (net.clone(), net);
        for (step, lr) in [3e-3, 1e-3, 0.0, 2.5e-2, 7e-4].into_iter().enumerate() {
            let (ga, gb) = (grads(&a, step, device), grads(&b, step, device));
            a = burn_optim.step(lr, a, ga);
            b = ours.step(lr, b, gb);
            assert_eq!(values(&a), values(&b), "parameters after step {step}");
            assert!(b.lin.weight.val().is_require_grad(), "still a trainable parameter");
        }
        let (burn_t, burn_s) = burn_record(&burn_optim);
        let (our_t, our_s) = our_record(&ours);
        assert_eq!(burn_t, our_t, "moments");
        assert_eq!(burn_s, our_s, "step counts and ranks");
    }

    #[test]
    fn the_fused_host_update_is_burns_adamw_to_the_bit() {
        check_against_burn(&Device::flex().autodiff());
    }

    #[test]
    fn the_tensor_operations_and_the_host_pass_agree_to_the_bit() {
        // Other devices run the tensor operations; here both run on the same inputs.
        let device = Device::flex().autodiff();
        device.seed(5);
        let p = Tensor::<2>::random([6, 4], Distribution::Normal(0.0, 1.0), &device.clone().inner());
        let k = Coeffs {
            beta_1: 0.9,
            beta_2: 0.95,
            factor_1: 1.0 - 0.9,
            factor_2: 1.0 - 0.95,
            correct_1: 1f32 - 0.9f32.powi(1),
            correct_2: 1f32 - 0.95f32.powi(1),
            eps: 1e-8,
            keep: Some((1.0 - 1e-3 * 0.1f64) as f32),
            lr: 1e-3,
            first: true,
        };
        let mut state = None;
        let (mut a, mut b) = (p.clone(), p.clone().add_scalar(0.0));
        for step in 0..3 {
            let g = Tensor::<2>::random([6, 4], Distribution::Normal(0.0, 1.0), &device.clone().inner());
            let k = Coeffs { first: step == 0, correct_1: 1f32 - 0.9f32.powi(step + 1), correct_2: 1f32 - 0.95f32.powi(step + 1), ..k };
            let (x, m1, m2) = device_update(a, g.clone(), state.clone(), 24, &k);
            let Ok((y, _, _)) = host_update(b, g, state, 24, &k) else { panic!("contiguous Flex tensors take the host pass") };
            let bits = |t: &Tensor<2>| t.clone().into_data().try_to_vec::<f32>().unwrap().iter().map(|v| v.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&x), bits(&y), "step {step}");
            state = Some(Moments { time: step as usize + 1, shape: vec![6, 4], m1, m2 });
            a = x.clone();
            b = x;
        }
    }
}
