//! Text generation: greedy or nucleus (top-p) sampling with temperature, with or without a KV
//! cache, seeded so a run can be repeated.

use burn::tensor::{Int, Tensor, TensorData};

use crate::llama::{KvCache, Llama};

/// How the next token is chosen.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Sampling {
    /// Softmax temperature; 0 takes the most likely token (greedy).
    pub temperature: f64,
    /// Nucleus: sample among the most likely tokens whose probabilities sum to at least this.
    pub top_p: f64,
    /// Seed of the sampler's random numbers.
    pub seed: u64,
}

impl Sampling {
    /// Always the most likely token.
    pub const GREEDY: Sampling = Sampling { temperature: 0.0, top_p: 1.0, seed: 0 };

    /// Checks the settings; the error names the bad one.
    pub fn validate(&self) -> Result<(), SamplingError> {
        if !(self.temperature.is_finite() && self.temperature >= 0.0) {
            return Err(SamplingError::Temperature(self.temperature));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(SamplingError::TopP(self.top_p));
        }
        Ok(())
    }
}

/// A sampling setting out of range.
#[derive(Clone, Copy, Debug, PartialEq, thiserror::Error)]
pub enum SamplingError {
    /// The temperature is negative or not a number.
    #[error("temperature {0} must be a number >= 0")]
    Temperature(f64),
    /// Top-p is outside (0, 1].
    #[error("top-p {0} must be in (0, 1]")]
    TopP(f64),
}

/// A small seeded generator (splitmix64): uniform numbers in [0, 1).
struct Rng(u64);

impl Rng {
    fn next_f64(&mut self) -> f64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^= z >> 31;
        (z >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// The next token from one position's logits.
fn choose(logits: &[f32], s: &Sampling, rng: &mut Rng) -> u32 {
    let argmax = || logits.iter().enumerate().fold((0, f32::NEG_INFINITY), |b, (i, &x)| if x > b.1 { (i, x) } else { b }).0 as u32;
    let max = logits.iter().copied().filter(|x| !x.is_nan()).fold(f32::NEG_INFINITY, f32::max) as f64;
    if s.temperature == 0.0 || !max.is_finite() {
        return argmax();
    }
    // A NaN logit weighs nothing.
    let weight = |x: f32| if x.is_nan() { 0.0 } else { ((x as f64 - max) / s.temperature).exp() };
    let mut probs: Vec<(u32, f64)> = logits.iter().enumerate().map(|(i, &x)| (i as u32, weight(x))).collect();
    let total: f64 = probs.iter().map(|p| p.1).sum();
    probs.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    let mut kept = 0.0;
    let mut cut = probs.len();
    for (i, p) in probs.iter().enumerate() {
        kept += p.1 / total;
        if kept >= s.top_p {
            cut = i + 1;
            break;
        }
    }
    let probs = &probs[..cut];
    let mass: f64 = probs.iter().map(|p| p.1).sum();
    let mut u = rng.next_f64() * mass;
    for p in probs {
        u -= p.1;
        if u <= 0.0 {
            return p.0;
        }
    }
    probs.last().map_or_else(argmax, |p| p.0)
}

fn last_logits(logits_bsv: Tensor<3>) -> Vec<f32> {
    let [_, s, v] = logits_bsv.dims();
    logits_bsv.narrow(1, s - 1, 1).reshape([v]).into_data().iter::<f32>().collect()
}

/// Continues `prompt` (token ids, at least one) by up to `max_tokens` tokens among ids below
/// `allowed` (the tokenizer's, when the embedding is padded), stopping early at `stop` or at the
/// model's longest sequence. With `cache` each new token costs one position;
/// without it every token runs the whole sequence again (the reference the cache is tested
/// against). Returns the new tokens only.
#[allow(clippy::too_many_arguments)]
pub fn generate(
    model: &Llama,
    prompt: &[u32],
    max_tokens: usize,
    max_len: usize,
    allowed: usize,
    s: &Sampling,
    stop: Option<u32>,
    cache: bool,
) -> Vec<u32> {
    let device = model.embed_tokens.weight.device();
    let ids = |t: &[u32]| {
        Tensor::<2, Int>::from_data(TensorData::new(t.iter().map(|&x| i64::from(x)).collect::<Vec<_>>(), [1, t.len()]), &device)
    };
    let mut rng = Rng(s.seed);
    let mut seq: Vec<u32> = prompt.to_vec();
    let mut out = Vec::new();
    let mut kv = KvCache::new();
    let mut pending: Vec<u32> = prompt.to_vec();
    while out.len() < max_tokens && seq.len() < max_len && !prompt.is_empty() {
        let logits = if cache { model.forward_cached(ids(&pending), &mut kv) } else { model.forward(ids(&seq)) };
        let logits = last_logits(logits);
        let next = choose(&logits[..allowed.clamp(1, logits.len())], s, &mut rng);
        out.push(next);
        seq.push(next);
        pending = vec![next];
        if Some(next) == stop {
            break;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::LlamaConfig;
    use burn::tensor::Device;
    use copus_core::model::ModelSpec;

    fn model() -> Llama {
        let device = Device::flex();
        device.seed(7);
        let mut spec = ModelSpec::tiny_1m();
        spec.seq_len = 64;
        LlamaConfig::from_spec(&spec).init(&device)
    }

    /// Greedy decoding of 32 tokens with the KV cache equals decoding that runs the whole
    /// sequence for every token; and the cached logits equal the full forward's.
    #[test]
    fn the_kv_cache_changes_nothing_but_the_cost() {
        let m = model();
        let prompt = [5u32, 17, 3, 99, 42];
        let with = generate(&m, &prompt, 32, 64, usize::MAX, &Sampling::GREEDY, None, true);
        let without = generate(&m, &prompt, 32, 64, usize::MAX, &Sampling::GREEDY, None, false);
        assert_eq!(with.len(), 32);
        assert_eq!(with, without);
        // Logits of a prompt in two pieces through the cache against one full pass.
        let device = Device::flex();
        let ids = |t: &[i64]| Tensor::<2, Int>::from_data(TensorData::new(t.to_vec(), [1, t.len()]), &device);
        let all: Vec<i64> = vec![5, 17, 3, 99, 42, 7, 1000, 12];
        let full: Vec<f32> = m.forward(ids(&all)).into_data().iter::<f32>().collect();
        let mut kv = KvCache::new();
        let a: Vec<f32> = m.forward_cached(ids(&all[..5]), &mut kv).into_data().iter::<f32>().collect();
        let b: Vec<f32> = m.forward_cached(ids(&all[5..]), &mut kv).into_data().iter::<f32>().collect();
        assert_eq!(kv.len(), 8);
        for (i, (x, y)) in a.iter().chain(&b).zip(&full).enumerate() {
            assert!((x - y).abs() <= 1e-4 * y.abs().max(1.0), "logit {i}: cached {x}, full {y}");
        }
    }

    #[test]
    fn sampling_is_seeded_and_respects_top_p() {
        let m = model();
        let s = Sampling { temperature: 1.0, top_p: 0.9, seed: 3 };
        let a = generate(&m, &[1, 2, 3], 16, 64, usize::MAX, &s, None, true);
        assert_eq!(a, generate(&m, &[1, 2, 3], 16, 64, usize::MAX, &s, None, true), "same seed, same text");
        assert_ne!(a, generate(&m, &[1, 2, 3], 16, 64, usize::MAX, &Sampling { seed: 4, ..s }, None, true));
        // A tiny nucleus keeps only the most likely token: greedy.
        let narrow = Sampling { temperature: 1.0, top_p: 1e-9, seed: 9 };
        assert_eq!(
            generate(&m, &[1, 2, 3], 8, 64, usize::MAX, &narrow, None, true),
            generate(&m, &[1, 2, 3], 8, 64, usize::MAX, &Sampling::GREEDY, None, true)
        );
        // The sequence never exceeds the model's length, and a stop token ends it.
        assert_eq!(generate(&m, &[1, 2, 3], 100, 10, usize::MAX, &Sampling::GREEDY, None, true).len(), 7);
        let first = generate(&m, &[1, 2, 3], 1, 64, usize::MAX, &Sampling::GREEDY, None, true)[0];
        assert_eq!(generate(&m, &[1, 2, 3], 10, 64, usize::MAX, &Sampling::GREEDY, Some(first), true), vec![first]);
        assert!(Sampling { temperature: -1.0, ..s }.validate().unwrap_err().to_string().contains("temperature"));
        assert!(Sampling { top_p: 0.0, ..s }.validate().unwrap_err().to_string().contains("top-p"));
        // Only allowed ids are chosen; NaN or all -inf logits do not break the choice.
        assert!(generate(&m, &[1, 2, 3], 8, 64, 5, &s, None, true).iter().all(|&t| t < 5));
        let mut rng = Rng(1);
        assert_eq!(choose(&[f32::NEG_INFINITY; 4], &s, &mut rng), 0);
        assert_eq!(choose(&[0.0, f32::NAN, 50.0, 0.0], &Sampling { temperature: 0.01, ..s }, &mut rng), 2);
    }
}
