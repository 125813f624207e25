//! Fixtures shared by the cross-crate tests: the tiny-1m Llama at a short sequence length, its
//! initial weights, and deterministic token batches; and the mutation fuzzer of the fuzz tests.

#![forbid(unsafe_code)]

use burn::tensor::Device;
use copus_core::layout::ParallelDims;
use copus_core::model::ModelSpec;
use copus_models::{Llama, LlamaConfig};

pub mod device;
pub mod fuzz;

/// Tokens per training sequence in these tests.
pub const SEQ: usize = 32;

/// tiny-1m (4 layers, 8 heads, 4 kv heads, tied embedding) at [`SEQ`].
pub fn config() -> LlamaConfig {
    let mut spec = ModelSpec::tiny_1m();
    spec.seq_len = SEQ;
    LlamaConfig::from_spec(&spec)
}

/// The initial weights of `config`, the same for every test (seeded). The device's generator is
/// shared by the tests a binary runs in parallel, so the seed and the draws happen under one
/// lock: two tests drawing at once would each get the other's numbers (the held-out check of
/// `an_untied_head_matches_serial_training`, whose two means differ by little more than its
/// margin, failed that way). Burn draws a parameter's values on its first use, not in `init`,
/// so every parameter is read here, under the lock, in one fixed order: a lock around `init`
/// alone left the draws to whichever test first touched the model.
pub fn initial_of(config: &LlamaConfig) -> Llama {
    static DRAWS: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _one_at_a_time = DRAWS.lock().unwrap_or_else(|e| e.into_inner());
    let device = Device::flex().autodiff();
    device.seed(11);
    let model = config.init(&device);
    let _drawn = copus_models::full_params(&model);
    model
}

/// The initial weights of [`config`] as host data, drawn once per test binary: the device RNG
/// is shared by the tests running in parallel, so drawing per test could interleave.
pub fn initial_full() -> &'static copus_burn::parallel::FullParams {
    static INIT: std::sync::OnceLock<copus_burn::parallel::FullParams> = std::sync::OnceLock::new();
    INIT.get_or_init(|| copus_models::full_params(&initial_of(&config())))
}

/// A layout of `dp * tp * pp` ranks.
pub fn dims(dp: usize, tp: usize, pp: usize) -> ParallelDims {
    ParallelDims::new(dp, tp, pp, dp * tp * pp).expect("a valid layout")
}

/// Step `step`'s batch of `sequences` sequences of `SEQ + 1` tokens, mostly following a
/// learnable rule (`t -> 7t + 3`) with random jumps: a pure function of its arguments.
pub fn structured_batch(step: usize, vocab: usize, sequences: usize) -> Vec<i64> {
    let mut x = 0x9e37_79b9_u64 ^ (step as u64).wrapping_mul(0x2545_f491_4f6c_dd1d);
    let mut out = Vec::with_capacity(sequences * (SEQ + 1));
    for _ in 0..sequences {
        x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        let mut t = (x >> 33) as usize % vocab;
        for _ in 0..=SEQ {
            out.push(t as i64);
            x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            t = if (x >> 60) < 12 { (7 * t + 3) % vocab } else { (x >> 20) as usize % vocab };
        }
    }
    out
}

/// Sequence `i` is [`structured_batch`]`(i, vocab, 1)`: a pure function of its index.
pub struct IndexedSequences {
    /// Vocabulary size.
    pub vocab: usize,
}

impl copus_burn::DataSource for IndexedSequences {
    fn sequences(&self, first: u64, count: usize) -> Vec<i64> {
        (first..first + count as u64).flat_map(|i| structured_batch(i as usize, self.vocab, 1)).collect()
    }
}

/// Relative difference of `a` from `b`.
pub fn rel(a: f64, b: f64) -> f64 {
    (a - b).abs() / b.abs().max(1e-30)
}
