//! A linear layer, `y = x W + b`, as one custom operation on Flex. Its three products (`x W`
//! forward, `dy W^T` and `x^T dy` backward) each go straight into a fresh buffer through
//! [`product_new`], where Flex's matmul first zero-fills its output and copies it once more to
//! align it: two passes over every output, the largest share of the memory traffic outside the
//! GEMM kernels in a training step. The leading dimensions of `x` fold into the rows, so the
//! weight gradient is one product over all positions.

use super::gemm::{Mat, product_new};
use super::glue::{Ad, ad_parts, contiguous, flex, values};
use burn::backend::Flex;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::NoCheckpointing;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::flex::FlexTensor;
use burn::tensor::{DType, Tensor};

/// `x W + b` for `x` `[..., d_in]`, `weight` `[d_in, d_out]` and `bias` `[d_out]` (Burn's
/// `linear`, the weight not transposed). Fused on Flex for f32 values (see the module docs):
/// one custom operation under autodiff without checkpointing, the product alone without
/// autodiff. Elsewhere, and for shapes that do not fit, Burn's `linear`.
pub fn linear<const D: usize>(x: Tensor<D>, weight: Tensor<2>, bias: Option<Tensor<1>>) -> Tensor<D> {
    let dims = x.dims();
    let [d_in, d_out] = weight.dims();
    let fits = D >= 2 && dims[D - 1] == d_in && bias.as_ref().is_none_or(|b| b.dims() == [d_out]);
    let rows: usize = dims[..D.saturating_sub(1)].iter().product();
    #[cfg(feature = "tch")]
    if fits && let Some(y) = super::torch::linear(&x, &weight, bias.as_ref()) {
        return y;
    }
    if fits && rows * d_in * d_out > 0 {
        let geo = Geometry { rows, d_in, d_out, x_dims: dims.to_vec() };
        if let Some(y) = tracked(&geo, &x, &weight, bias.as_ref()).or_else(|| plain(&geo, &x, &weight, bias.as_ref())) {
            return y;
        }
    }
    burn::tensor::module::linear(x, weight, bias)
}

/// The custom operation, when every operand is an f32 tensor of [`Ad`].
fn tracked<const D: usize>(geo: &Geometry, x: &Tensor<D>, weight: &Tensor<2>, bias: Option<&Tensor<1>>) -> Option<Tensor<D>> {
    let ((xf, nx), (wf, nw)) = (ad_parts(x)?, ad_parts(weight)?);
    let bias = match bias {
        Some(b) => Some(ad_parts(b)?),
        None => None,
    };
    let out = geo.forward(&xf, &wf, bias.as_ref().map(|(b, _)| b));
    // x is needed only for the weight's gradient, the weight only for x's.
    let state = (weight.is_tracked().then_some(xf), x.is_tracked().then_some(wf));
    let geo = LinearBackward(geo.clone());
    let out = match bias {
        None => match geo.prepare::<NoCheckpointing>([nx, nw]).compute_bound().stateful() {
            OpsKind::Tracked(prep) => prep.finish(state, out),
            OpsKind::UnTracked(prep) => prep.finish(out),
        },
        Some((_, nb)) => match geo.prepare::<NoCheckpointing>([nx, nw, nb]).compute_bound().stateful() {
            OpsKind::Tracked(prep) => prep.finish(state, out),
            OpsKind::UnTracked(prep) => prep.finish(out),
        },
    };
    #[cfg(test)]
    tests::FUSED.with(|n| n.set(n.get() + 1));
    Some(Tensor::from_primitive::<Ad>(out))
}

/// The product alone, when every operand is an f32 tensor of plain Flex (no autodiff).
fn plain<const D: usize>(geo: &Geometry, x: &Tensor<D>, weight: &Tensor<2>, bias: Option<&Tensor<1>>) -> Option<Tensor<D>> {
    fn part<const E: usize>(t: &Tensor<E>) -> Option<FlexTensor> {
        let p = t.clone().try_into_primitive::<Flex>().ok()?;
        (p.dtype() == DType::F32).then(|| contiguous(p))
    }
    let (xf, wf) = (part(x)?, part(weight)?);
    let bias = match bias {
        Some(b) => Some(part(b)?),
        None => None,
    };
    #[cfg(test)]
    tests::FUSED.with(|n| n.set(n.get() + 1));
    Some(Tensor::from_primitive::<Flex>(geo.forward(&xf, &wf, bias.as_ref())))
}

/// The sizes of one linear call; `x_dims` is the shape of `x`.
#[derive(Clone, Debug)]
struct Geometry {
    rows: usize,
    d_in: usize,
    d_out: usize,
    x_dims: Vec<usize>,
}

impl Geometry {
    /// `x W + b`, shaped like `x` with `d_out` last.
    fn forward(&self, x: &FlexTensor, w: &FlexTensor, b: Option<&FlexTensor>) -> FlexTensor {
        let Geometry { rows, d_in, d_out, .. } = *self;
        let mut y = product_new(Mat::of(values(x), d_in, 1), Mat::of(values(w), d_out, 1), rows, d_out, d_in);
        if let Some(b) = b {
            let b = values(b);
            y.chunks_mut(d_out).for_each(|row| row.iter_mut().zip(b).for_each(|(y, b)| *y += b));
        }
        let mut dims = self.x_dims.clone();
        *dims.last_mut().expect("x has a last dimension") = d_out;
        flex(y, dims)
    }
}

/// The linear node, with parents `x`, the weight and (when `N` is 3) the bias; kept are `x` when
/// the weight takes a gradient and the weight when `x` does.
#[derive(Debug)]
struct LinearBackward(Geometry);

impl<const N: usize> Backward<Flex, N> for LinearBackward {
    type State = (Option<FlexTensor>, Option<FlexTensor>);

    fn backward(self, ops: Ops<Self::State, N>, grads: &mut Gradients, _: &mut Checkpointer) {
        let Geometry { rows, d_in, d_out, x_dims } = self.0;
        let dy_t = contiguous(grads.consume::<Flex>(&ops.node));
        let dy_v = values(&dy_t);
        let dy = Mat::of(dy_v, d_out, 1);
        let (x, w) = ops.state;
        if let (Some(node), Some(w)) = (&ops.parents[0], &w) {
            // dx = dy W^T.
            let dx = product_new(dy, Mat::of(values(w), d_out, 1).t(), rows, d_in, d_out);
            grads.register::<Flex>(node.id, flex(dx, x_dims.as_slice()));
        }
        if let (Some(node), Some(x)) = (&ops.parents[1], &x) {
            // dW = x^T dy, one product over every position.
            let dw = product_new(Mat::of(values(x), d_in, 1).t(), dy, d_in, d_out, rows);
            grads.register::<Flex>(node.id, flex(dw, [d_in, d_out]));
        }
        if let Some(Some(node)) = ops.parents.get(2) {
            // db = the sum of dy over the rows.
            let mut db = vec![0f32; d_out];
            for row in dy_v.chunks(d_out).take(rows) {
                db.iter_mut().zip(row).for_each(|(d, g)| *d += g);
            }
            grads.register::<Flex>(node.id, flex(db, [d_out]));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::tensor::{Device, Distribution, TensorData};
    use std::cell::Cell;

    thread_local! {
        /// Fused linear nodes built on this thread (each test runs on its own thread).
        pub(super) static FUSED: Cell<usize> = const { Cell::new(0) };
    }

    /// The same product with Burn's batched matmul and broadcast add alone.
    fn reference<const D: usize>(x: Tensor<D>, w: Tensor<2>, b: Option<Tensor<1>>) -> Tensor<D> {
        let y = x.matmul(w.unsqueeze::<D>());
        match b {
            Some(b) => y + b.unsqueeze::<D>(),
            None => y,
        }
    }

    type Values = Vec<f32>;

    /// The value of `linear`-like `f` and the gradients of `sum(f * r)` (`r` fixed random
    /// weights) for the inputs marked in `track` (fresh leaves holding `x`, `w`, `b`).
    fn value_and_grads<const D: usize>(
        f: fn(Tensor<D>, Tensor<2>, Option<Tensor<1>>) -> Tensor<D>,
        (x, w, b): (&Tensor<D>, &Tensor<2>, Option<&Tensor<1>>),
        r: &Tensor<D>,
        track: [bool; 3],
    ) -> (Values, [Option<Values>; 3]) {
        fn leaf<const E: usize>(t: &Tensor<E>, on: bool) -> Tensor<E> {
            let t = Tensor::<E>::from_data(t.to_data(), &t.device());
            if on { t.require_grad() } else { t }
        }
        let (x, w, b) = (leaf(x, track[0]), leaf(w, track[1]), b.map(|b| leaf(b, track[2])));
        let y = f(x.clone(), w.clone(), b.clone());
        let value = y.to_data().try_into_vec::<f32>().unwrap();
        let grads = (y * r.clone()).sum().backward();
        let gx = track[0].then(|| x.grad(&grads).unwrap()).map(|t| t.into_data().try_into_vec::<f32>().unwrap());
        let gw = track[1].then(|| w.grad(&grads).unwrap()).map(|t| t.into_data().try_into_vec::<f32>().unwrap());
        let gb = b.filter(|_| track[2]).map(|b| b.grad(&grads).unwrap().into_data().try_into_vec::<f32>().unwrap());
        (value, [gx, gw, gb])
    }

    /// Each of `a` within 1e-5 of `b`, relative to `b`'s largest magnitude.
    fn close(a: &[f32], b: &[f32], what: &str) {
        assert_eq!(a.len(), b.len(), "{what}: lengths");
        let big = b.iter().fold(0f32, |m, y| m.max(y.abs())).max(1e-3);
        for (i, (x, y)) in a.iter().zip(b).enumerate() {
            assert!((x - y).abs() <= 1e-5 * big, "{what}[{i}]: {x} vs {y}");
        }
    }

    /// `linear` against [`reference`] for `x` of shape `dims` and a `[dims[D-1], d_out]` weight,
    /// on both autodiff devices (the fused node under plain autodiff, Burn's ops under
    /// checkpointing, counted) and without autodiff.
    fn check<const D: usize>(dims: [usize; D], d_out: usize, bias: bool, seed: u64) {
        let d_in = dims[D - 1];
        for (d, device) in [Device::flex().autodiff(), Device::flex().autodiff().gradient_checkpointing()].into_iter().enumerate() {
            device.seed(seed);
            let x: Tensor<D> = Tensor::random(dims, Distribution::Normal(0.0, 1.0), &device);
            let w: Tensor<2> = Tensor::random([d_in, d_out], Distribution::Normal(0.0, 0.5), &device);
            let b: Option<Tensor<1>> = bias.then(|| Tensor::random([d_out], Distribution::Normal(0.0, 1.0), &device));
            let mut out_dims = dims;
            out_dims[D - 1] = d_out;
            let r: Tensor<D> = Tensor::random(out_dims, Distribution::Normal(0.0, 1.0), &device);
            for track in [[true; 3], [true, false, false], [false, true, true], [false, false, true]] {
                if !(track[0] || track[1] || bias && track[2]) {
                    continue; // nothing to differentiate
                }
                let before = FUSED.with(Cell::get);
                let (va, ga) = value_and_grads(linear, (&x, &w, b.as_ref()), &r, track);
                assert_eq!(FUSED.with(Cell::get) - before, usize::from(d == 0), "device {d}: which path ran");
                let (vr, gr) = value_and_grads(reference, (&x, &w, b.as_ref()), &r, track);
                let case = format!("x {dims:?} d_out {d_out} bias {bias} device {d} {track:?}");
                close(&va, &vr, &format!("{case}: value"));
                for (i, (a, r)) in ga.iter().zip(&gr).enumerate() {
                    assert_eq!(a.is_some(), r.is_some(), "{case}: gradient {i} present");
                    if let (Some(a), Some(r)) = (a, r) {
                        close(a, r, &format!("{case}: gradient of input {i}"));
                    }
                }
            }
        }
        // Without autodiff (generation), the product alone.
        let plain = Device::flex();
        plain.seed(seed);
        let x: Tensor<D> = Tensor::random(dims, Distribution::Normal(0.0, 1.0), &plain);
        let w: Tensor<2> = Tensor::random([d_in, d_out], Distribution::Normal(0.0, 0.5), &plain);
        let b: Option<Tensor<1>> = bias.then(|| Tensor::random([d_out], Distribution::Normal(0.0, 1.0), &plain));
        let before = FUSED.with(Cell::get);
        let a = linear(x.clone(), w.clone(), b.clone()).into_data().try_into_vec::<f32>().unwrap();
        assert_eq!(FUSED.with(Cell::get) - before, 1, "without autodiff: the fused product ran");
        close(&a, &reference(x, w, b).into_data().try_into_vec::<f32>().unwrap(), "without autodiff");
    }

    #[test]
    fn the_fused_linear_equals_burns_matmul_in_value_and_every_gradient() {
        check([1, 1, 1], 1, false, 1);
        check([2, 5, 7], 3, false, 2);
        check([2, 5, 7], 3, true, 3);
        check([3, 1], 4, true, 4);
        check([2, 3, 4, 9], 13, true, 5);
        // Large enough for the products on rayon's pool: 512 rows x 128 x 256.
        check([8, 64, 128], 256, false, 6);
        check([8, 64, 256], 128, true, 7);
    }

    #[test]
    fn column_and_row_shards_give_the_unsplit_linear_and_gradients() {
        // Tensor parallelism splits a weight by columns (q, k, v, gate, up: each rank's outputs
        // side by side, their input gradients summed) and by rows (o, down: each rank's input
        // slice, outputs summed). Both must give the unsplit layer's output and gradients.
        let (b, s, d_in, d_out) = (2, 9, 10, 6);
        let device = Device::flex().autodiff();
        device.seed(11);
        let x: Tensor<3> = Tensor::random([b, s, d_in], Distribution::Normal(0.0, 1.0), &device);
        let w: Tensor<2> = Tensor::random([d_in, d_out], Distribution::Normal(0.0, 0.5), &device);
        let r: Tensor<3> = Tensor::random([b, s, d_out], Distribution::Normal(0.0, 1.0), &device);
        let (full, [gx, gw, _]) = value_and_grads(linear, (&x, &w, None), &r, [true; 3]);
        let (gx, gw) = (gx.unwrap(), gw.unwrap());
        let own = |t: Tensor<3>| Tensor::<3>::from_data(t.to_data(), &device);
        let own2 = |t: Tensor<2>| Tensor::<2>::from_data(t.to_data(), &device);
        let back3 = |v: Vec<f32>, d: [usize; 3]| Tensor::<3>::from_data(TensorData::new(v, d), &device);
        let back2 = |v: Vec<f32>, d: [usize; 2]| Tensor::<2>::from_data(TensorData::new(v, d), &device);

        // Columns: outputs side by side, weight gradients side by side, x gradients summed.
        let half = d_out / 2;
        let (mut outs, mut gws, mut gx_sum) = (Vec::new(), Vec::new(), None::<Tensor<3>>);
        for shard in 0..2 {
            let ws = own2(w.clone().narrow(1, shard * half, half));
            let rs = own(r.clone().narrow(2, shard * half, half));
            let (o, [gxs, gws_, _]) = value_and_grads(linear, (&x, &ws, None), &rs, [true; 3]);
            outs.push(back3(o, [b, s, half]));
            gws.push(back2(gws_.unwrap(), [d_in, half]));
            let gxs = back3(gxs.unwrap(), [b, s, d_in]);
            gx_sum = Some(gx_sum.map_or(gxs.clone(), |a| a + gxs));
        }
        let vals3 = |t: Tensor<3>| t.into_data().try_into_vec::<f32>().unwrap();
        close(&vals3(Tensor::cat(outs, 2)), &full, "columns: output");
        close(&Tensor::cat(gws, 1).into_data().try_into_vec::<f32>().unwrap(), &gw, "columns: weight gradient");
        close(&vals3(gx_sum.unwrap()), &gx, "columns: input gradient");

        // Rows: each shard its slice of x and of the weight's rows; outputs summed, weight
        // gradients stacked, input gradients side by side.
        let half = d_in / 2;
        let (mut sum, mut gws, mut gxs) = (None::<Tensor<3>>, Vec::new(), Vec::new());
        for shard in 0..2 {
            let xs = own(x.clone().narrow(2, shard * half, half));
            let ws = own2(w.clone().narrow(0, shard * half, half));
            let (o, [gx_, gw_, _]) = value_and_grads(linear, (&xs, &ws, None), &r, [true; 3]);
            let o = back3(o, [b, s, d_out]);
            sum = Some(sum.map_or(o.clone(), |a| a + o));
            gws.push(back2(gw_.unwrap(), [half, d_out]));
            gxs.push(back3(gx_.unwrap(), [b, s, half]));
        }
        close(&vals3(sum.unwrap()), &full, "rows: output");
        close(&Tensor::cat(gws, 0).into_data().try_into_vec::<f32>().unwrap(), &gw, "rows: weight gradient");
        close(&vals3(Tensor::cat(gxs, 2)), &gx, "rows: input gradient");
    }
}
