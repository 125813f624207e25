//! Whole-model operations on gradients: squared norms, scaling, copies, differences.

use burn::module::{Module, ModuleVisitor, Param};
use burn::optim::GradientsParams;
use burn::tensor::Tensor;

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
pub fn host_sq<const D: usize>(t: Tensor<D>) -> f64 {
    let data = t.into_data().convert::<f32>();
    sum_sq(data.as_slice::<f32>().expect("f32 data"))
}

/// `|a - b|^2` of two tensors of one shape, in f64 on the host, without a difference tensor.
pub fn host_diff_sq<const D: usize>(a: Tensor<D>, b: Tensor<D>) -> f64 {
    let (a, b) = (a.into_data().convert::<f32>(), b.into_data().convert::<f32>());
    diff_sum_sq(a.as_slice::<f32>().expect("f32 data"), b.as_slice::<f32>().expect("f32 data"))
}

/// Lanes of the f64 sums: independent accumulators, so the loop vectorises.
const LANES: usize = 8;

/// `sum(x^2)` of a slice, each square and sum in f64.
pub fn sum_sq(v: &[f32]) -> f64 {
    let mut acc = [0f64; LANES];
    let chunks = v.chunks_exact(LANES);
    let rest: f64 = chunks.remainder().iter().map(|&x| f64::from(x) * f64::from(x)).sum();
    for c in chunks {
        for (a, &x) in acc.iter_mut().zip(c) {
            *a += f64::from(x) * f64::from(x);
        }
    }
    acc.iter().sum::<f64>() + rest
}

/// `sum((a - b)^2)` of two slices of one length, in f64.
pub fn diff_sum_sq(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len(), "gradients of different sizes");
    let mut acc = [0f64; LANES];
    let (ca, cb) = (a.chunks_exact(LANES), b.chunks_exact(LANES));
    let rest: f64 = ca.remainder().iter().zip(cb.remainder()).map(|(&x, &y)| (f64::from(x) - f64::from(y)).powi(2)).sum();
    for (x8, y8) in ca.zip(cb) {
        for ((a, &x), &y) in acc.iter_mut().zip(x8).zip(y8) {
            let d = f64::from(x) - f64::from(y);
            *a += d * d;
        }
    }
    acc.iter().sum::<f64>() + rest
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
fn read_sum(parts: Vec<Tensor<1>>) -> f64 {
    if parts.is_empty() {
        return 0.0;
    }
    Tensor::cat(parts, 0).into_data().iter::<f32>().map(f64::from).sum()
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
    let Some(mut acc) = acc else { return grads };
    struct V<'a> {
        acc: &'a mut GradientsParams,
        grads: GradientsParams,
    }
    impl ModuleVisitor for V<'_> {
        fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<D>>) {
            if let Some(g) = self.grads.remove::<D>(p.id) {
                let sum = match self.acc.remove::<D>(p.id) {
                    Some(a) => a + g,
                    None => g,
                };
                self.acc.register::<D>(p.id, sum);
            }
        }
    }
    module.visit(&mut V { acc: &mut acc, grads });
    acc
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::tensor::{Device, TensorData};

    #[test]
    fn lane_sums_of_squares_equal_the_plain_f64_sums() {
        for n in [0usize, 1, 7, 8, 9, 1001] {
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
}
