//! What each parameter of a rank's stage is to the engine (tensor-sharded or replicated over tp,
//! a tied embedding's mirror or owner), and gradients by a selection of parameters: flattened to
//! one host buffer (or, on a device, one tensor there) for a collective, written back, and
//! squared norms: read in place and summed
//! in f64 where the gradients are in host memory, reduced on the device (one small read) where
//! they are not.

use std::collections::HashSet;

use burn::module::{Module, ModuleVisitor, Param, ParamId};
use burn::optim::GradientsParams;
use burn::tensor::{Device, Tensor, TensorData};

use crate::grads::{Scalar, host_device, host_diff_sq, host_sq, in_host_memory};
use crate::traffic::{self, Kind};

/// How a parameter's gradient is counted and reduced.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Role {
    /// Split across tp: each rank owns distinct elements.
    Sharded,
    /// The same on every tp rank; partial gradients are summed over tp.
    TpReplicated,
}

/// One parameter of the stage.
#[derive(Clone, Copy, Debug)]
pub(super) struct ParamInfo {
    pub(super) id: ParamId,
    pub(super) role: Role,
    /// The tied embedding on the last stage of a pipeline: a mirror of the first stage's copy.
    pub(super) mirror: bool,
    /// The tied embedding on the first stage of a pipeline: receives the last stage's share.
    pub(super) tied_owner: bool,
}

impl ParamInfo {
    /// Counted once in a whole-model norm: not a mirror, and replicated ones on tp rank 0 only.
    pub(super) fn counted(&self, tp_rank: usize) -> bool {
        !self.mirror && (self.role == Role::Sharded || tp_rank == 0)
    }
}

/// Gradients a flattening reads, or takes out.
enum Grads<'a> {
    Read(&'a GradientsParams),
    Take(&'a mut GradientsParams),
}

/// The stage's parameters in visit order.
pub(super) struct GradIndex {
    pub(super) params: Vec<ParamInfo>,
    /// Where gradients written back live when a parameter had none.
    device: Device,
}

impl GradIndex {
    pub(super) fn new(params: Vec<ParamInfo>, device: Device) -> Self {
        Self { params, device }
    }

    /// Whether any parameter matches.
    pub(super) fn any(&self, select: impl Fn(&ParamInfo) -> bool) -> bool {
        self.params.iter().any(select)
    }

    fn ids(&self, select: impl Fn(&ParamInfo) -> bool) -> HashSet<ParamId> {
        self.params.iter().filter(|p| select(p)).map(|p| p.id).collect()
    }

    /// The selected parameters' gradients, in stage visit order, as one buffer (zeros where a
    /// parameter has no gradient).
    pub(super) fn flatten<S: Module>(&self, stage: &S, g: &GradientsParams, select: impl Fn(&ParamInfo) -> bool) -> Vec<f32> {
        self.flatten_from(stage, Grads::Read(g), select)
    }

    /// [`Self::flatten`], taking each selected gradient out of `g` once copied, so that the
    /// buffer grows as `g` shrinks.
    pub(super) fn flatten_taking<S: Module>(&self, stage: &S, g: &mut GradientsParams, select: impl Fn(&ParamInfo) -> bool) -> Vec<f32> {
        self.flatten_from(stage, Grads::Take(g), select)
    }

    fn flatten_from<S: Module>(&self, stage: &S, g: Grads<'_>, select: impl Fn(&ParamInfo) -> bool) -> Vec<f32> {
        struct V<'a> {
            g: Grads<'a>,
            wanted: HashSet<ParamId>,
            out: Vec<f32>,
        }
        impl ModuleVisitor for V<'_> {
            fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<D>>) {
                if self.wanted.contains(&p.id) {
                    let t = match &mut self.g {
                        Grads::Read(g) => g.get::<D>(p.id),
                        Grads::Take(g) => g.remove::<D>(p.id),
                    };
                    match t {
                        Some(t) => self.out.extend(traffic::read(t, Kind::Collective).iter::<f32>()),
                        None => self.out.extend(std::iter::repeat_n(0f32, p.val().shape().num_elements())),
                    }
                }
            }
        }
        let mut v = V { g, wanted: self.ids(select), out: Vec::new() };
        stage.visit(&mut v);
        v.out
    }

    /// The selected parameters in stage visit order, in runs of whole parameters of at most
    /// `elems` elements each (a larger parameter alone): the buckets of a reduction on a device,
    /// so that no more than a bucket is copied beside the gradients at once. The same on every
    /// rank whose stage has the same shapes.
    pub(super) fn buckets<S: Module>(&self, stage: &S, select: impl Fn(&ParamInfo) -> bool, elems: usize) -> Vec<HashSet<ParamId>> {
        struct V {
            wanted: HashSet<ParamId>,
            elems: usize,
            buckets: Vec<(HashSet<ParamId>, usize)>,
        }
        impl ModuleVisitor for V {
            fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<D>>) {
                if self.wanted.contains(&p.id) {
                    let n = p.val().shape().num_elements();
                    match self.buckets.last_mut() {
                        Some((ids, len)) if *len + n <= self.elems => {
                            ids.insert(p.id);
                            *len += n;
                        }
                        _ => self.buckets.push((HashSet::from([p.id]), n)),
                    }
                }
            }
        }
        let mut v = V { wanted: self.ids(select), elems, buckets: Vec::new() };
        stage.visit(&mut v);
        v.buckets.into_iter().map(|(ids, _)| ids).collect()
    }

    /// The selected parameters' gradients as one tensor on the rank's device, laid out as
    /// [`Self::flatten`] (zeros where a parameter has none); `None` when the rank's device is
    /// host memory, where [`Self::flatten`] reads them without a copy to a device. Decided by the
    /// device, not by the gradients, so every rank of a group takes the same path.
    pub(super) fn flatten_on_device<S: Module>(
        &self,
        stage: &S,
        g: &GradientsParams,
        select: impl Fn(&ParamInfo) -> bool,
    ) -> Option<Tensor<1>> {
        struct V<'a> {
            g: &'a GradientsParams,
            wanted: HashSet<ParamId>,
            parts: Vec<Tensor<1>>,
            device: &'a Device,
        }
        impl ModuleVisitor for V<'_> {
            fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<D>>) {
                if self.wanted.contains(&p.id) {
                    let n = p.val().shape().num_elements();
                    self.parts.push(match self.g.get::<D>(p.id) {
                        Some(t) => t.reshape([n]),
                        None => Tensor::zeros([n], self.device),
                    });
                }
            }
        }
        if host_device(&self.device) {
            return None;
        }
        let device = self.device.clone().inner();
        let mut v = V { g, wanted: self.ids(select), parts: Vec::new(), device: &device };
        stage.visit(&mut v);
        (!v.parts.is_empty()).then(|| Tensor::cat(v.parts, 0))
    }

    /// Writes `flat` (as laid out by [`Self::flatten_on_device`]) back into `g`, on its device.
    pub(super) fn unflatten_on_device<S: Module>(
        &self,
        stage: &S,
        g: &mut GradientsParams,
        select: impl Fn(&ParamInfo) -> bool,
        flat: Tensor<1>,
    ) {
        struct V<'a> {
            g: &'a mut GradientsParams,
            wanted: HashSet<ParamId>,
            flat: Tensor<1>,
            at: usize,
        }
        impl ModuleVisitor for V<'_> {
            fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<D>>) {
                if self.wanted.contains(&p.id) {
                    let dims = p.val().dims();
                    let n: usize = dims.iter().product();
                    self.g.remove::<D>(p.id);
                    self.g.register::<D>(p.id, self.flat.clone().narrow(0, self.at, n).reshape(dims));
                    self.at += n;
                }
            }
        }
        stage.visit(&mut V { g, wanted: self.ids(select), flat, at: 0 });
    }

    /// Writes `values` (as laid out by [`Self::flatten`]) back into `g`.
    pub(super) fn unflatten<S: Module>(&self, stage: &S, g: &mut GradientsParams, select: impl Fn(&ParamInfo) -> bool, values: &[f32]) {
        struct V<'a> {
            g: &'a mut GradientsParams,
            wanted: HashSet<ParamId>,
            values: &'a [f32],
            at: usize,
            device: &'a Device,
        }
        impl ModuleVisitor for V<'_> {
            fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<D>>) {
                if self.wanted.contains(&p.id) {
                    let shape = p.val().shape();
                    let n = shape.num_elements();
                    let device = self.g.remove::<D>(p.id).map_or_else(|| self.device.clone(), |t| t.device());
                    let data = TensorData::new(self.values[self.at..self.at + n].to_vec(), shape);
                    self.g.register::<D>(p.id, traffic::upload(data, &device, Kind::Collective));
                    self.at += n;
                }
            }
        }
        let device = self.device.clone().inner();
        stage.visit(&mut V { g, wanted: self.ids(select), values, at: 0, device: &device });
    }

    /// Sum of squares of the selected parameters' gradients (of `a - b` when `b` is given),
    /// times `factor`. In host memory each tensor is read in place and summed in f64; on a
    /// device each tensor's sum is reduced where it lies (in f32), to be read back with the
    /// step's other numbers and added in f64.
    pub(super) fn sq_norm<S: Module>(
        &self,
        stage: &S,
        a: &GradientsParams,
        b: Option<&GradientsParams>,
        select: impl Fn(&ParamInfo) -> bool,
        factor: f64,
    ) -> Scalar {
        struct V<'a> {
            a: &'a GradientsParams,
            b: Option<&'a GradientsParams>,
            wanted: HashSet<ParamId>,
            acc: f64,
            on_device: Vec<Tensor<1>>,
        }
        impl ModuleVisitor for V<'_> {
            fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<D>>) {
                if !self.wanted.contains(&p.id) {
                    return;
                }
                let x = self.a.get::<D>(p.id);
                let y = self.b.and_then(|b| b.get::<D>(p.id));
                let host = x.as_ref().or(y.as_ref()).is_none_or(in_host_memory);
                match (x, y) {
                    (Some(x), Some(y)) if host => self.acc += host_diff_sq(x, y),
                    (Some(x), Some(y)) => self.on_device.push((x - y).square().sum()),
                    (Some(x), None) if host => self.acc += host_sq(x),
                    (Some(x), None) => self.on_device.push(x.square().sum()),
                    (None, Some(y)) if self.b.is_some() && host => self.acc += host_sq(y),
                    (None, Some(y)) if self.b.is_some() => self.on_device.push(y.square().sum()),
                    _ => {}
                }
            }
        }
        let mut v = V { a, b, wanted: self.ids(select), acc: 0.0, on_device: Vec::new() };
        stage.visit(&mut v);
        Scalar::new(v.acc, v.on_device, factor)
    }
}

impl GradIndex {
    /// Every parameter's gradient as a host buffer of its own (zeros where it has none), in
    /// stage visit order.
    pub(super) fn per_param<S: Module>(&self, stage: &S, g: &GradientsParams) -> Vec<(ParamId, Vec<f32>)> {
        struct V<'a> {
            g: &'a GradientsParams,
            out: Vec<(ParamId, Vec<f32>)>,
        }
        impl ModuleVisitor for V<'_> {
            fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<D>>) {
                let values = match self.g.get::<D>(p.id) {
                    Some(t) => traffic::read(t, Kind::State).iter::<f32>().collect(),
                    None => vec![0f32; p.val().shape().num_elements()],
                };
                self.out.push((p.id, values));
            }
        }
        let mut v = V { g, out: Vec::with_capacity(self.params.len()) };
        stage.visit(&mut v);
        v.out
    }
}

#[cfg(test)]
mod tests {
    use burn::nn::{Linear, LinearConfig};

    use super::*;

    /// Buckets are runs of whole parameters in visit order, each within the bound unless one
    /// parameter alone is larger; unselected parameters are left out.
    #[test]
    fn buckets_are_runs_of_whole_parameters_within_the_bound() {
        let device = Device::flex();
        // Each layer: a weight of 32 elements, then a bias of 8.
        let stage: Vec<Linear> = (0..3).map(|_| LinearConfig::new(4, 8).init(&device)).collect();
        struct Ids(Vec<(ParamId, usize)>);
        impl ModuleVisitor for Ids {
            fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<D>>) {
                self.0.push((p.id, p.val().shape().num_elements()));
            }
        }
        let mut ids = Ids(Vec::new());
        stage.visit(&mut ids);
        let sizes: Vec<usize> = ids.0.iter().map(|&(_, n)| n).collect();
        assert_eq!(sizes, [32, 8, 32, 8, 32, 8]);
        let info = |id| ParamInfo { id, role: Role::Sharded, mirror: false, tied_owner: false };
        let index = GradIndex::new(ids.0.iter().map(|&(id, _)| info(id)).collect(), device);
        // Bucket sizes in elements, in order.
        let shape = |select: &dyn Fn(&ParamInfo) -> bool, elems| {
            let buckets = index.buckets(&stage, select, elems);
            let mut seen = HashSet::new();
            let sizes: Vec<usize> = buckets
                .iter()
                .map(|b| {
                    assert!(b.iter().all(|id| seen.insert(*id)), "a parameter in two buckets");
                    ids.0.iter().filter(|(id, _)| b.contains(id)).map(|&(_, n)| n).sum()
                })
                .collect();
            (sizes, seen.len())
        };
        assert_eq!(shape(&|_| true, 40), (vec![40, 40, 40], 6));
        assert_eq!(shape(&|_| true, 100), (vec![80, 40], 6));
        assert_eq!(shape(&|_| true, 20), (vec![32, 8, 32, 8, 32, 8], 6), "a parameter over the bound alone");
        assert_eq!(shape(&|_| true, 1 << 20), (vec![120], 6));
        let first_weight = ids.0[0].0;
        assert_eq!(shape(&|p| p.id != first_weight, 16), (vec![8, 32, 8, 32, 8], 5), "unselected parameters left out");
    }
}
