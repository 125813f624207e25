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
    t.into_data().iter::<f32>().map(|x| f64::from(x) * f64::from(x)).sum()
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
                self.acc += host_sq(x - y);
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
