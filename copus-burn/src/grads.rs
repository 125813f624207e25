//! Whole-model operations on gradients: squared norms, scaling, copies, differences.

use burn::backend::Flex;
use burn::backend::flex::FlexTensor;
use burn::module::{Module, ModuleVisitor, Param};
use burn::optim::GradientsParams;
use burn::tensor::DType;
use burn::tensor::Tensor;
use rayon::prelude::*;

use crate::traffic::{self, Kind};

/// Sum over parameters of `|grad|^2`, in f64 (see [`host_sq`]).
pub fn sq_norm<M: Module>(module: &M, grads: &GradientsParams) -> f64 {
    struct V<'a> {
        grads: &'a GradientsParams,
        acc: f64,
    }
    impl ModuleVisitor for V<'_> {
        fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<D>>) {
            if let Some(g) = self.grads.get::<D>(p.id) {
                self.acc += host_sq(g);
            }
        }
    }
    let mut v = V { grads, acc: 0.0 };
    module.visit(&mut v);
    v.acc
}

/// Sum of squares of a tensor's values, accumulated in f64 on the host: the noise-scale
/// estimate subtracts two nearly equal norms, so f32 accumulation error would be amplified.
/// A tensor in host memory is read in place, in the order it is stored (see `stored`).
pub fn host_sq<const D: usize>(t: Tensor<D>) -> f64 {
    let t = t.inner();
    traffic::count(Kind::Probe, 4 * t.shape().num_elements());
    if let Ok(p) = t.clone().try_into_primitive::<Flex>()
        && let Some((values, _)) = stored(&p)
    {
        return sum_sq(values);
    }
    values(&t, sum_sq)
}

/// `|a - b|^2` of two tensors of one shape, in f64 on the host, without a difference tensor
/// and, for tensors in host memory stored alike, without a copy.
pub fn host_diff_sq<const D: usize>(a: Tensor<D>, b: Tensor<D>) -> f64 {
    let (a, b) = (a.inner(), b.inner());
    traffic::count(Kind::Probe, 4 * (a.shape().num_elements() + b.shape().num_elements()));
    if a.dims() == b.dims()
        && let (Ok(pa), Ok(pb)) = (a.clone().try_into_primitive::<Flex>(), b.clone().try_into_primitive::<Flex>())
        && let (Some((x, sx)), Some((y, sy))) = (stored(&pa), stored(&pb))
        && sx == sy
    {
        return diff_sum_sq(x, y);
    }
    values(&a, |x| values(&b, |y| diff_sum_sq(x, y)))
}

/// The values of a Flex f32 tensor in the order they are stored, with its strides, when they
/// fill one range of its buffer: contiguous, or any permutation of its dimensions (a gradient
/// computed as a transposed product). Order-free reductions read them without a copy; two
/// tensors of one shape and equal strides pair their elements in that order.
fn stored(p: &FlexTensor) -> Option<(&[f32], &[isize])> {
    if p.dtype() != DType::F32 {
        return None;
    }
    let layout = p.layout();
    let mut dims: Vec<(isize, usize)> =
        layout.strides().iter().zip(layout.shape().iter()).filter(|&(_, &n)| n != 1).map(|(&s, &n)| (s, n)).collect();
    dims.sort_unstable();
    let mut expected = 1isize;
    for (stride, n) in dims {
        if stride != expected {
            return None;
        }
        expected = expected.checked_mul(n as isize)?;
    }
    let start = layout.start_offset();
    let values = p.storage::<f32>().get(start..start + layout.num_elements())?;
    Some((values, layout.strides()))
}

/// Whether the tensor lives in host memory (Flex), where its values are read in place.
pub(crate) fn in_host_memory<const D: usize>(t: &Tensor<D>) -> bool {
    host_device(&t.device())
}

/// Whether tensors on `device` lie in host memory (Flex, with or without autodiff).
pub(crate) fn host_device(device: &burn::tensor::Device) -> bool {
    device.clone().inner() == burn::tensor::Device::flex()
}

/// Calls `f` with the tensor's values as f32, in logical order. A contiguous f32 tensor on Flex
/// (host memory) is read in place, shared, without a copy; any other is read back first. The
/// host-traffic meter counts its bytes as `kind` either way (what a device backend moves).
pub fn with_values<const D: usize, R>(t: &Tensor<D>, kind: Kind, f: impl FnOnce(&[f32]) -> R) -> R {
    traffic::count(kind, 4 * t.shape().num_elements());
    values(t, f)
}

/// [`with_values`] without counting (the caller has).
fn values<const D: usize, R>(t: &Tensor<D>, f: impl FnOnce(&[f32]) -> R) -> R {
    let t = t.clone().inner();
    if let Ok(p) = t.clone().try_into_primitive::<Flex>()
        && let Some(values) = p.as_slice::<f32>()
    {
        return f(values);
    }
    let data = t.into_data().convert::<f32>();
    f(data.as_slice::<f32>().expect("f32 data"))
}

/// Lanes of the f64 sums: independent accumulators, so the loop vectorises.
const LANES: usize = 8;

/// Elements per part of a long sum. Parts are summed on the pool and their sums added in order,
/// so a result depends on the values only, never on the number of threads.
const PART: usize = 1 << 16;

/// `sum(x^2)` of a slice, each square and sum in f64.
pub fn sum_sq(v: &[f32]) -> f64 {
    if v.len() <= PART {
        let mut acc = [0f64; LANES];
        let chunks = v.chunks_exact(LANES);
        let rest: f64 = chunks.remainder().iter().map(|&x| f64::from(x) * f64::from(x)).sum();
        for c in chunks {
            for (s, &x) in acc.iter_mut().zip(c) {
                *s += f64::from(x) * f64::from(x);
            }
        }
        return acc.iter().sum::<f64>() + rest;
    }
    let parts: Vec<f64> = v.par_chunks(PART).map(sum_sq).collect();
    parts.iter().sum()
}

/// `sum((a - b)^2)` of two slices of one length, in f64.
pub fn diff_sum_sq(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len(), "gradients of different sizes");
    if a.len() <= PART {
        let d = |x: f32, y: f32| f64::from(x) - f64::from(y);
        let mut acc = [0f64; LANES];
        let (ca, cb) = (a.chunks_exact(LANES), b.chunks_exact(LANES));
        let rest: f64 = ca.remainder().iter().zip(cb.remainder()).map(|(&x, &y)| d(x, y) * d(x, y)).sum();
        for (x8, y8) in ca.zip(cb) {
            for ((s, &x), &y) in acc.iter_mut().zip(x8).zip(y8) {
                *s += d(x, y) * d(x, y);
            }
        }
        return acc.iter().sum::<f64>() + rest;
    }
    let parts: Vec<f64> = a.par_chunks(PART).zip(b.par_chunks(PART)).map(|(x, y)| diff_sum_sq(x, y)).collect();
    parts.iter().sum()
}

/// Sum over parameters of `|grad|^2`, computed where the gradients live: each parameter's sum
/// of squares is reduced on its device, and only those sums (one number per parameter tensor)
/// are read back, together, and added in f64 on the host. For the learner add-on's probe, which
/// then costs one small transfer per micro-batch instead of a model-sized one.
pub fn sq_norm_on_device<M: Module>(module: &M, grads: &GradientsParams) -> f64 {
    struct V<'a> {
        grads: &'a GradientsParams,
        parts: Vec<Tensor<1>>,
    }
    impl ModuleVisitor for V<'_> {
        fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<D>>) {
            if let Some(g) = self.grads.get::<D>(p.id) {
                self.parts.push(g.square().sum());
            }
        }
    }
    let mut v = V { grads, parts: Vec::new() };
    module.visit(&mut v);
    read_sum(v.parts)
}

/// `|a - b|^2` over parameters present in both, reduced on the device like
/// [`sq_norm_on_device`].
pub fn diff_sq_norm_on_device<M: Module>(module: &M, a: &GradientsParams, b: &GradientsParams) -> f64 {
    struct V<'a> {
        a: &'a GradientsParams,
        b: &'a GradientsParams,
        parts: Vec<Tensor<1>>,
    }
    impl ModuleVisitor for V<'_> {
        fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<D>>) {
            if let (Some(x), Some(y)) = (self.a.get::<D>(p.id), self.b.get::<D>(p.id)) {
                self.parts.push((x - y).square().sum());
            }
        }
    }
    let mut v = V { a, b, parts: Vec::new() };
    module.visit(&mut v);
    read_sum(v.parts)
}

/// One readback of the per-parameter sums, added in f64.
pub(crate) fn read_sum(parts: Vec<Tensor<1>>) -> f64 {
    Scalar::new(0.0, parts, 1.0).read(Kind::Probe)
}

/// A number that may lie partly on a device: `(host + the sum of the parts' elements) x
/// factor`, the elements added in f64 in order. Built where it is computed, read back later
/// with others ([`Deferred`]) so that a step waits for its device once rather than at every
/// micro-batch.
pub(crate) struct Scalar {
    host: f64,
    parts: Vec<Tensor<1>>,
    factor: f64,
}

impl Scalar {
    pub(crate) fn new(host: f64, parts: Vec<Tensor<1>>, factor: f64) -> Self {
        // The parts go into one f32 tensor: plain (not autodiff) tensors, in f32.
        let parts =
            parts.into_iter().map(|t| if t.is_autodiff() { t.inner() } else { t }).map(|t| t.cast(burn::tensor::FloatDType::F32)).collect();
        Self { host, parts, factor }
    }

    /// A value already in host memory.
    pub(crate) fn host(value: f64) -> Self {
        Self { host: value, parts: Vec::new(), factor: 1.0 }
    }

    /// Its value now (one readback, counted as `kind`, where it has parts).
    pub(crate) fn read(self, kind: Kind) -> f64 {
        let mut d = Deferred::default();
        d.push(kind, self);
        d.read()[0]
    }
}

/// [`Scalar`]s read back together: every part of every one in one transfer.
#[derive(Default)]
pub(crate) struct Deferred {
    /// Each scalar's kind (for the host-traffic meter), host part, element count and factor.
    entries: Vec<(Kind, f64, usize, f64)>,
    parts: Vec<Tensor<1>>,
}

impl Deferred {
    /// Adds `s`, whose value is `read()[i]` for the `i` returned.
    pub(crate) fn push(&mut self, kind: Kind, s: Scalar) -> usize {
        let count = s.parts.iter().map(|t| t.dims()[0]).sum();
        self.parts.extend(s.parts);
        self.entries.push((kind, s.host, count, s.factor));
        self.entries.len() - 1
    }

    /// The values, in the order they were pushed; the bytes counted by kind.
    pub(crate) fn read(self) -> Vec<f64> {
        let values: Vec<f32> =
            if self.parts.is_empty() { Vec::new() } else { Tensor::cat(self.parts, 0).into_data().iter::<f32>().collect() };
        let mut at = 0;
        self.entries
            .into_iter()
            .map(|(kind, host, count, factor)| {
                traffic::count(kind, 4 * count);
                let device: f64 = values[at..at + count].iter().map(|&x| f64::from(x)).sum();
                at += count;
                (host + device) * factor
            })
            .collect()
    }
}

/// `|a - b|^2` over parameters present in both, in f64.
pub fn diff_sq_norm<M: Module>(module: &M, a: &GradientsParams, b: &GradientsParams) -> f64 {
    struct V<'a> {
        a: &'a GradientsParams,
        b: &'a GradientsParams,
        acc: f64,
    }
    impl ModuleVisitor for V<'_> {
        fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<D>>) {
            if let (Some(x), Some(y)) = (self.a.get::<D>(p.id), self.b.get::<D>(p.id)) {
                self.acc += host_diff_sq(x, y);
            }
        }
    }
    let mut v = V { a, b, acc: 0.0 };
    module.visit(&mut v);
    v.acc
}

/// A copy of `grads` with every gradient of `module` multiplied by `factor` (the probe keeps
/// the previous step's gradient this way, and the trainer averages accumulated sums).
pub fn scaled<M: Module>(module: &M, grads: &GradientsParams, factor: f64) -> GradientsParams {
    struct V<'a> {
        grads: &'a GradientsParams,
        out: GradientsParams,
        factor: f64,
    }
    impl ModuleVisitor for V<'_> {
        fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<D>>) {
            if let Some(g) = self.grads.get::<D>(p.id) {
                let g = if self.factor == 1.0 { g } else { g.mul_scalar(self.factor) };
                self.out.register::<D>(p.id, g);
            }
        }
    }
    let mut v = V { grads, out: GradientsParams::new(), factor };
    module.visit(&mut v);
    v.out
}

/// `acc + grads`, parameter by parameter (missing entries count as zero).
pub fn add<M: Module>(module: &M, acc: Option<GradientsParams>, grads: GradientsParams) -> GradientsParams {
    add_measured(module, acc, grads, false).0
}

/// `acc + grads` as [`add`], and, if `measure`, `|grads|^2` as [`sq_norm`] computes it (to the
/// bit), in the same pass: a parameter stored alike in both, in host memory, is added into
/// `acc`'s buffer while its squares are summed, so the norm costs no read of its own.
pub fn add_measured<M: Module>(module: &M, acc: Option<GradientsParams>, grads: GradientsParams, measure: bool) -> (GradientsParams, f64) {
    let Some(mut acc) = acc else {
        let sq = if measure { sq_norm(module, &grads) } else { 0.0 };
        return (grads, sq);
    };
    struct V<'a> {
        acc: &'a mut GradientsParams,
        grads: GradientsParams,
        measure: bool,
        sq: f64,
    }
    impl ModuleVisitor for V<'_> {
        fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<D>>) {
            if let Some(g) = self.grads.remove::<D>(p.id) {
                let sum = match self.acc.remove::<D>(p.id) {
                    Some(a) => match add_in_place(a, &g, self.measure) {
                        Ok((sum, sq)) => {
                            self.sq += sq;
                            sum
                        }
                        Err(a) => {
                            if self.measure {
                                self.sq += host_sq(g.clone());
                            }
                            a + g
                        }
                    },
                    None => {
                        if self.measure {
                            self.sq += host_sq(g.clone());
                        }
                        g
                    }
                };
                self.acc.register::<D>(p.id, sum);
            }
        }
    }
    let mut v = V { acc: &mut acc, grads, measure, sq: 0.0 };
    module.visit(&mut v);
    let sq = v.sq;
    (acc, sq)
}

/// `a += g` in `a`'s own buffer, with `sum(g^2)` if `measure` (as [`sum_sq`] computes it), when
/// both are Flex f32 tensors of one shape stored alike and `a` holds its buffer alone; else `a`
/// back, untouched.
// A tensor handle by value, as Burn passes them; boxing it would only add an allocation.
#[allow(clippy::result_large_err)]
fn add_in_place<const D: usize>(a: Tensor<D>, g: &Tensor<D>, measure: bool) -> Result<(Tensor<D>, f64), Tensor<D>> {
    if a.is_autodiff() || g.is_autodiff() || a.dims() != g.dims() {
        return Err(a);
    }
    let Ok(pg) = g.clone().try_into_primitive::<Flex>() else { return Err(a) };
    let Some((gv, gs)) = stored(&pg) else { return Err(a) };
    let Ok(mut pa) = a.clone().try_into_primitive::<Flex>() else { return Err(a) };
    // `a` was cloned above: the clone, `pa`, is the sole owner once `a` is gone.
    let alike = stored(&pa).is_some_and(|(_, s)| s == gs);
    if !alike {
        return Err(a);
    }
    drop(a);
    let (start, n) = (pa.layout().start_offset(), pa.layout().num_elements());
    let Some(buffer) = pa.try_storage_mut::<f32>() else {
        return Err(Tensor::from_primitive::<Flex>(pa));
    };
    let values = &mut buffer[start..start + n];
    let sq = add_sum_sq(values, gv, measure);
    Ok((Tensor::from_primitive::<Flex>(pa), sq))
}

/// `a += g` element by element, returning `sum(g^2)` if `measure` (else 0), summed exactly as
/// [`sum_sq`] sums.
fn add_sum_sq(a: &mut [f32], g: &[f32], measure: bool) -> f64 {
    assert_eq!(a.len(), g.len(), "gradients of different sizes");
    if a.len() <= PART {
        a.iter_mut().zip(g).for_each(|(a, &g)| *a += g);
        return if measure { sum_sq(g) } else { 0.0 };
    }
    let parts: Vec<f64> = a.par_chunks_mut(PART).zip(g.par_chunks(PART)).map(|(a, g)| add_sum_sq(a, g, measure)).collect();
    parts.iter().sum()
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::tensor::{Device, TensorData};

    #[test]
    fn lane_sums_of_squares_equal_the_plain_f64_sums() {
        for n in [0usize, 1, 7, 8, 9, 1001, 3 * PART + 5] {
            let a: Vec<f32> = (0..n).map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.013).collect();
            let b: Vec<f32> = (0..n).map(|i| ((i * 53 % 97) as f32 - 48.0) * 0.011).collect();
            let sq: f64 = a.iter().map(|&x| f64::from(x) * f64::from(x)).sum();
            let dsq: f64 = a.iter().zip(&b).map(|(&x, &y)| (f64::from(x) - f64::from(y)).powi(2)).sum();
            assert!((sum_sq(&a) - sq).abs() <= 1e-12 * sq.max(1.0), "n {n}");
            assert!((diff_sum_sq(&a, &b) - dsq).abs() <= 1e-12 * dsq.max(1.0), "n {n}");
            if n == 0 {
                continue;
            }
            let device = Device::flex();
            let t = |v: &[f32]| Tensor::<1>::from_data(TensorData::new(v.to_vec(), [n]), &device);
            assert!((host_sq(t(&a)) - sq).abs() <= 1e-12 * sq.max(1.0));
            assert!((host_diff_sq(t(&a), t(&b)) - dsq).abs() <= 1e-12 * dsq.max(1.0));
        }
    }

    #[test]
    fn long_sums_are_the_same_on_one_thread_and_on_the_pool() {
        let n = 5 * PART + 3;
        let a: Vec<f32> = (0..n).map(|i| ((i * 37 % 1009) as f32 - 500.0) * 1e-3).collect();
        let b: Vec<f32> = (0..n).map(|i| ((i * 53 % 997) as f32 - 480.0) * 1e-3).collect();
        let one = rayon::ThreadPoolBuilder::new().num_threads(1).build().unwrap();
        let (sq1, d1) = one.install(|| (sum_sq(&a), diff_sum_sq(&a, &b)));
        assert_eq!(sum_sq(&a).to_bits(), sq1.to_bits());
        assert_eq!(diff_sum_sq(&a, &b).to_bits(), d1.to_bits());
    }

    #[test]
    fn values_read_in_place_equal_the_values_read_back() {
        let device = Device::flex();
        let m = Tensor::<2>::from_data(TensorData::new((0..35).map(|i| i as f32 * 0.5 - 3.0).collect::<Vec<_>>(), [5, 7]), &device);
        let views = [
            m.clone(),
            m.clone().transpose(),
            m.clone().slice([1..4, 0..7]),
            m.clone().slice([1..4, 2..5]),
            Tensor::<2>::from_data(m.to_data(), &device.clone().autodiff()).require_grad() * 2.0,
        ];
        for (k, t) in views.into_iter().enumerate() {
            let expected = t.to_data().convert::<f32>().try_to_vec::<f32>().unwrap();
            assert_eq!(with_values(&t, Kind::State, |v| v.to_vec()), expected, "view {k}");
        }
    }

    #[test]
    fn norms_of_permuted_and_sliced_views_equal_those_of_their_values() {
        // Views stored in another order (a transpose, a permutation), views that skip part of
        // their buffer (a column slice) or repeat it (a broadcast), against the same values
        // read back in order; differences of views stored alike and unlike.
        let device = Device::flex();
        let values = |n: usize, k: usize| (0..n).map(|i| ((i * k % 31) as f32 - 15.0) * 0.1).collect::<Vec<f32>>();
        let a = Tensor::<3>::from_data(TensorData::new(values(60, 7), [3, 4, 5]), &device);
        let b = Tensor::<3>::from_data(TensorData::new(values(60, 11), [3, 4, 5]), &device);
        let c = Tensor::<3>::from_data(TensorData::new(values(60, 13), [5, 4, 3]), &device);
        let plain = |t: &Tensor<3>| t.to_data().convert::<f32>().try_to_vec::<f32>().unwrap();
        let sq = |v: &[f32]| v.iter().map(|&x| f64::from(x) * f64::from(x)).sum::<f64>();
        let dsq = |x: &[f32], y: &[f32]| x.iter().zip(y).map(|(&x, &y)| (f64::from(x) - f64::from(y)).powi(2)).sum::<f64>();
        let close = |x: f64, y: f64| (x - y).abs() <= 1e-12 * y.max(1.0);
        let views = [
            a.clone(),
            a.clone().swap_dims(0, 2),
            a.clone().permute([1, 2, 0]),
            a.clone().slice([0..3, 0..4, 1..4]),
            Tensor::<3>::from_data(TensorData::new(values(5, 3), [1, 1, 5]), &device).expand([3, 4, 5]),
        ];
        for (k, v) in views.iter().enumerate() {
            assert!(close(host_sq(v.clone()), sq(&plain(v))), "view {k}");
        }
        // Stored alike: both transposed the same way; unlike: one transposed, one fresh.
        let (at, bt) = (a.clone().swap_dims(0, 2), b.clone().swap_dims(0, 2));
        assert!(close(host_diff_sq(at.clone(), bt.clone()), dsq(&plain(&at), &plain(&bt))));
        assert!(close(host_diff_sq(at.clone(), c.clone()), dsq(&plain(&at), &plain(&c))));
        assert!(close(host_diff_sq(c.clone(), at.clone()), dsq(&plain(&c), &plain(&at))));
    }

    #[test]
    fn adding_in_place_equals_burns_add_and_measures_the_addend_to_the_bit() {
        let device = Device::flex();
        let n = 7 * (PART / 2 + 3);
        let values = |k: usize| (0..n).map(|i| ((i * k % 1013) as f32 - 500.0) * 1e-3).collect::<Vec<f32>>();
        let t = |k: usize| Tensor::<2>::from_data(TensorData::new(values(k), [n / 7, 7]), &device);
        let read = |t: Tensor<2>| t.into_data().try_to_vec::<f32>().unwrap();
        // Contiguous, and both transposed alike.
        for transpose in [false, true] {
            let view = |t: Tensor<2>| if transpose { t.transpose() } else { t };
            let (a, g) = (view(t(3)), view(t(5)));
            let want = read(a.clone() + g.clone());
            let want_sq = host_sq(g.clone());
            let a = view(t(3));
            let (sum, sq) = add_in_place(a, &g, true).unwrap_or_else(|_| panic!("in place (transposed: {transpose})"));
            assert_eq!(read(sum), want, "transposed: {transpose}");
            assert_eq!(sq.to_bits(), want_sq.to_bits());
            let (_, none) = add_in_place(view(t(3)), &g, false).ok().unwrap();
            assert_eq!(none, 0.0);
        }
        // Stored unlike, or a shared buffer: left alone.
        let fresh = Tensor::<2>::from_data(TensorData::new(values(5), [7, n / 7]), &device);
        assert!(add_in_place(t(3).transpose(), &fresh, true).is_err());
        let shared = t(3);
        let keep = shared.clone();
        assert!(add_in_place(shared, &t(5), true).is_err());
        assert_eq!(read(keep), values(3));
    }
}
