//! Megatron's conjugate pair of tensor-parallel operators as operations of Burn's autodiff
//! graph, so that a stage under tensor parallelism runs as one graph per micro-batch:
//! - [`copy_to_group`] (Megatron's f), where a replicated activation enters a split layer: the
//!   identity forward; backward, the input's gradient (partial on each rank, from its slice of
//!   the layer) summed over the tp group;
//! - [`reduce_from_group`] (g), where a split layer's partial output leaves it: the sum over the
//!   tp group forward; backward, the identity.
//!
//! The sums are the group's tensor all-reduce ([`TensorSum`]): where the tensors lie and in
//! rank order in one process; NCCL's, RCCL's or MPI's across processes. Burn traverses a graph
//! by depth, so the f operations of one micro-batch run their sums in the same order on every
//! rank of the group (their graphs have the same shape). A sum that fails inside the backward traversal cannot return its error
//! there: the gradient goes on as zeros and [`Group::failure`] hands the error to the caller
//! once `backward()` returns.

use std::sync::{Arc, Mutex};

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::NoCheckpointing;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, unary};
use burn::backend::{Autodiff, Backend, DispatchKindConversion, DispatchTensor, Flex};
use burn::tensor::Tensor;

use crate::comm::{CommError, ReduceOp, TensorSum};

/// The tp group's sum, shared by the operations of the graphs that use it, and the first
/// failure of a sum run inside a backward pass.
#[derive(Clone)]
pub(super) struct Group {
    sum: Arc<dyn TensorSum>,
    failure: Arc<Mutex<Option<CommError>>>,
}

impl std::fmt::Debug for Group {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("tp group")
    }
}

impl Group {
    pub(super) fn new(sum: Arc<dyn TensorSum>) -> Self {
        Self { sum, failure: Arc::new(Mutex::new(None)) }
    }

    /// The sum of a tensor over the group, where it lies.
    fn sum<const D: usize>(&self, t: Tensor<D>) -> Result<Tensor<D>, CommError> {
        let shape = t.dims();
        let n = shape.iter().product::<usize>();
        Ok(self.sum.all_reduce_tensor(t.reshape([n]), ReduceOp::Sum)?.reshape(shape))
    }

    /// The first sum that failed inside a backward pass since the last call, if any.
    pub(super) fn failure(&self) -> Option<CommError> {
        self.failure.lock().unwrap_or_else(|e| e.into_inner()).take()
    }

    fn fail(&self, e: CommError) {
        self.failure.lock().unwrap_or_else(|e| e.into_inner()).get_or_insert(e);
    }
}

/// Megatron's f: `x` forward; backward, its gradient summed over the group. The identity on a
/// tensor no gradient flows to.
pub(super) fn copy_to_group(x: Tensor<3>, group: &Group) -> Result<Tensor<3>, CommError> {
    if !x.is_tracked() {
        return Ok(x);
    }
    on_any_backend(x, group, Op::Copy)
}

/// Megatron's g: the sum of `x` over the group forward; backward, the identity.
pub(super) fn reduce_from_group(x: Tensor<3>, group: &Group) -> Result<Tensor<3>, CommError> {
    if !x.is_tracked() {
        return group.sum(x);
    }
    on_any_backend(x, group, Op::Reduce)
}

#[derive(Clone, Copy)]
enum Op {
    Copy,
    Reduce,
}

/// The operation on a tracked tensor of whichever backend of this build holds it.
fn on_any_backend(x: Tensor<3>, group: &Group, op: Op) -> Result<Tensor<3>, CommError> {
    let x = match attempt::<Flex>(x, group, op) {
        Ok(done) => return done,
        Err(x) => x,
    };
    #[cfg(any(feature = "wgpu", feature = "cuda", feature = "rocm"))]
    let x = match attempt::<burn::backend::Cube>(x, group, op) {
        Ok(done) => return done,
        Err(x) => x,
    };
    // Burn marks its LibTorch backend deprecated; it is the GPU backend that builds here.
    #[cfg(feature = "tch")]
    #[allow(deprecated)]
    let x = match attempt::<burn::backend::LibTorch>(x, group, op) {
        Ok(done) => return done,
        Err(x) => x,
    };
    Err(CommError::Invalid(format!(
        "a tensor-parallel operation on a tracked tensor of a backend this build does not know ({:?})",
        x.device()
    )))
}

/// `op` on `x` when it is a tracked tensor of `B`; `x` back otherwise.
// A tensor handle by value, as Burn passes them; boxing it would only add an allocation.
#[allow(clippy::result_large_err)]
fn attempt<B: Backend>(x: Tensor<3>, group: &Group, op: Op) -> Result<Result<Tensor<3>, CommError>, Tensor<3>>
where
    DispatchTensor: DispatchKindConversion<B> + DispatchKindConversion<Autodiff<B, NoCheckpointing>>,
{
    let Ok(ad) = x.clone().try_into_primitive::<Autodiff<B, NoCheckpointing>>() else { return Err(x) };
    let (p, node) = ad.into_parts();
    let out = match op {
        Op::Copy => SumGrad(group.clone()).prepare::<NoCheckpointing>([node]).compute_bound().stateless(p),
        Op::Reduce => {
            let summed = match group.sum(Tensor::<3>::from_primitive::<B>(p)) {
                Ok(s) => s,
                Err(e) => return Ok(Err(e)),
            };
            let summed = summed.try_into_primitive::<B>().expect("a sum stays on its tensor's backend");
            PassGrad.prepare::<NoCheckpointing>([node]).compute_bound().stateless(summed)
        }
    };
    Ok(Ok(Tensor::from_primitive::<Autodiff<B, NoCheckpointing>>(out)))
}

/// f's backward: the gradient summed over the group.
#[derive(Debug)]
struct SumGrad(Group);

impl<B: Backend> Backward<B, 1> for SumGrad
where
    DispatchTensor: DispatchKindConversion<B>,
{
    type State = ();

    fn backward(self, ops: Ops<(), 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let group = self.0;
        unary::<B, _>(ops.parents, ops.node, grads, |grad| {
            let grad = Tensor::<3>::from_primitive::<B>(grad);
            let summed = group.sum(grad.clone()).unwrap_or_else(|e| {
                group.fail(e);
                grad.zeros_like()
            });
            summed.try_into_primitive::<B>().expect("a sum stays on its tensor's backend")
        });
    }
}

/// g's backward: the gradient as it is.
#[derive(Debug)]
struct PassGrad;

impl<B: Backend> Backward<B, 1> for PassGrad {
    type State = ();

    fn backward(self, ops: Ops<(), 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        unary::<B, _>(ops.parents, ops.node, grads, |grad| grad);
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use burn::tensor::{Device, TensorData};

    use super::*;
    use crate::comm::Collective;
    use crate::comm::threads::ThreadComm;

    fn tensor(v: &[f32], device: &Device) -> Tensor<3> {
        Tensor::from_data(TensorData::new(v.to_vec(), [1, 1, v.len()]), device)
    }

    fn values<const D: usize>(t: Tensor<D>) -> Vec<f32> {
        t.into_data().try_to_vec::<f32>().unwrap()
    }

    /// Two ranks, each with its own weight `w_r` (1 and 2) on a shared input `x`: `y =
    /// g(f(x) * w_r)` is `x (w_0 + w_1) = 3x` on both, and the backward pass of `(y * c).sum()`
    /// gives, by hand: `dL/dx = c (w_0 + w_1) = 3c` on both ranks (f sums the two partial
    /// gradients `c w_r`), `dL/dw_r = sum(c x)` on each (g passes `c` on as it is).
    #[test]
    fn the_conjugate_operators_sum_forward_and_backward_as_by_hand() {
        let (x, c) = ([1.0f32, -2.0, 0.5], [0.25f32, 1.0, -3.0]);
        let handles: Vec<_> = ThreadComm::world(2)
            .into_iter()
            .map(|comm| {
                std::thread::spawn(move || {
                    let device = Device::flex().autodiff();
                    let group = Group::new(comm.tensor_sum().expect("an in-process group"));
                    let xt = tensor(&x, &device).require_grad();
                    let w = Tensor::<1>::from_data(TensorData::new(vec![comm.rank() as f32 + 1.0], [1]), &device).require_grad();
                    let partial = copy_to_group(xt.clone(), &group).unwrap() * w.clone().reshape([1, 1, 1]);
                    let y = reduce_from_group(partial, &group).unwrap();
                    let forward = values(y.clone());
                    let grads = (y * tensor(&c, &device)).sum().backward();
                    assert!(group.failure().is_none());
                    (forward, values(xt.grad(&grads).unwrap()), values(w.grad(&grads).unwrap()))
                })
            })
            .collect();
        let dot: f32 = x.iter().zip(&c).map(|(a, b)| a * b).sum();
        for h in handles {
            let (forward, dx, dw) = h.join().unwrap();
            assert_eq!(forward, x.map(|v| 3.0 * v).to_vec());
            assert_eq!(dx, c.map(|v| 3.0 * v).to_vec());
            assert_eq!(dw, vec![dot]);
        }
    }

    /// A sum that fails in the backward pass (the other rank has gone) is kept for the caller;
    /// the gradient goes on as zeros, and the traversal ends.
    #[test]
    fn a_sum_that_fails_in_the_backward_pass_is_reported_after_it() {
        let mut comms = ThreadComm::world_with_timeout(2, Duration::from_millis(200));
        let gone = comms.pop().unwrap();
        let comm = comms.pop().unwrap();
        let device = Device::flex().autodiff();
        let group = Group::new(comm.tensor_sum().unwrap());
        let x = tensor(&[1.0, 2.0], &device).require_grad();
        let grads = (copy_to_group(x.clone(), &group).unwrap() * 2.0).sum().backward();
        drop(gone);
        let e = group.failure().expect("the sum failed");
        assert!(matches!(e, CommError::Timeout { .. } | CommError::Aborted { .. }), "{e}");
        assert_eq!(values(x.grad(&grads).unwrap()), vec![0.0, 0.0]);
        assert!(group.failure().is_none(), "reported once");
        // Untracked tensors need no operator: f is the identity, g the sum itself.
        let plain = tensor(&[4.0], &Device::flex());
        assert_eq!(values(copy_to_group(plain, &group).unwrap()), vec![4.0]);
    }
}
