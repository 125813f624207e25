//! The benchmarks (`recipes bench step|engine|reconfig|recovery|probe|memory|device|data|libtorch`), each printing a table, and what
//! they share: the reference shapes, the synthetic tokens every side of a comparison sees, and
//! medians.

pub mod args;
pub mod data;
pub mod device;
pub mod engine;
#[cfg(feature = "tch")]
pub mod libtorch;
pub mod memory;
pub mod probe;
pub mod reconfig;
#[cfg(feature = "fault-injection")]
pub mod recovery;
pub mod step;

use burn::tensor::{Device, Int, Tensor, TensorData};
use copus_core::model::ModelSpec;

/// The reference shape.
pub fn spec() -> ModelSpec {
    ModelSpec { name: "bench-5m".into(), ..ModelSpec::tiny_5m() }
}

/// Micro-batch of the reference step.
pub const MICRO_BATCH: usize = 8;

/// A benchmarked shape: the model (its `seq_len` is the sequence) and the micro-batch.
#[derive(Clone)]
pub struct Shape {
    /// The model.
    pub spec: ModelSpec,
    /// Sequences per step.
    pub micro_batch: usize,
}

/// The reference shape and tiny-20m at sequence 256, both at micro-batch 8.
pub fn shapes() -> Vec<Shape> {
    vec![
        Shape { spec: spec(), micro_batch: MICRO_BATCH },
        Shape { spec: ModelSpec { seq_len: 256, ..ModelSpec::tiny_20m() }, micro_batch: 8 },
    ]
}

/// Tokens of step `i` (inputs, targets), the same on both sides of every comparison.
pub(crate) fn tokens(s: &ModelSpec, micro_batch: usize, i: usize) -> (Vec<i64>, Vec<i64>) {
    let n = micro_batch * s.seq_len;
    ((0..n).map(|j| ((j * 31 + i * 7) % s.vocab_size) as i64).collect(), (0..n).map(|j| ((j * 17 + i) % s.vocab_size) as i64).collect())
}

/// Token ids as a `[rows, cols]` integer tensor on `device`.
pub(crate) fn int2(v: Vec<i64>, shape: [usize; 2], device: &Device) -> Tensor<2, Int> {
    Tensor::<2, Int>::from_data(TensorData::new(v, shape), device)
}

/// The median (of an even count, the mean of the two middle values); NaN when empty.
pub(crate) fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    let h = v.len() / 2;
    match v.len() {
        0 => f64::NAN,
        n if n.is_multiple_of(2) => (v[h - 1] + v[h]) / 2.0,
        _ => v[h],
    }
}
