//! Whole-model operations on gradients: squared norms, scaling, copies, differences.

use burn::module::{Module, ModuleVisitor, Param};
use burn::optim::GradientsParams;
use burn::tensor::Tensor;

/// Sum over parameters of `|grad|^2`, accumulated on the device and read back once.
pub fn sq_norm<M: Module>(module: &M, grads: &GradientsParams) -> f64 {
    struct V<'a> {
        grads: &'a GradientsParams,
        acc: Option<Tensor<1>>,
    }
    impl ModuleVisitor for V<'_> {
        fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<D>>) {
            if let Some(g) = self.grads.get::<D>(p.id) {
                let s = g.square().sum();
                self.acc = Some(match self.acc.take() {
                    None => s,
                    Some(a) => a + s,
                });
            }
        }
    }
    let mut v = V { grads, acc: None };
    module.visit(&mut v);
    v.acc.map_or(0.0, |t| f64::from(t.into_scalar::<f32>()))
}

/// `|a - b|^2` over the parameters present in both.
pub fn diff_sq_norm<M: Module>(module: &M, a: &GradientsParams, b: &GradientsParams) -> f64 {
    struct V<'a> {
        a: &'a GradientsParams,
        b: &'a GradientsParams,
        acc: Option<Tensor<1>>,
    }
    impl ModuleVisitor for V<'_> {
        fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<D>>) {
            if let (Some(x), Some(y)) = (self.a.get::<D>(p.id), self.b.get::<D>(p.id)) {
                let s = (x - y).square().sum();
                self.acc = Some(match self.acc.take() {
                    None => s,
                    Some(a) => a + s,
                });
            }
        }
    }
    let mut v = V { a, b, acc: None };
    module.visit(&mut v);
    v.acc.map_or(0.0, |t| f64::from(t.into_scalar::<f32>()))
}

/// `grads * factor`, a new container.
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
