//! Training sequences cut from a split's token stream and the order a run visits them in.
//!
//! Sequence `k` is ids `k L ..= k L + L` of the stream (L the sequence length): documents are
//! packed across their boundaries, each ended by the end-of-text id. Sample `i` of a run is
//! sequence `perm_e(i mod N)` of epoch `e = i / N` (N sequences): which data a step sees is a
//! function of its global sample indices only, whatever B_g, layout or number of ranks read
//! them, and a resumed run that starts at sample `i` reads what the uninterrupted one would.
//! Epoch `e` is samples `eN .. (e+1)N`, each sequence once, in its own order.

use std::borrow::Cow;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use rand::SeedableRng;
use rand::rngs::StdRng;
use rand::seq::SliceRandom;

use super::error::DataError;
use super::tokens::TokenStore;

/// How an epoch's sequences are ordered.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Order {
    /// A shuffled list of the epoch's sequence numbers (4 bytes per sequence), as the
    /// Shakespeare runs have always been ordered: kept for that corpus so its runs resume.
    Listed,
    /// A keyed bijection of `0..N` (a Feistel network over the next power of four, walked until
    /// it lands inside), computed per sample: no index in memory whatever the corpus size.
    Keyed,
}

/// Sequences of `seq_len + 1` ids cut from a stream with stride `seq_len`, visited in a seeded
/// order.
pub struct PackedDataset {
    store: TokenStore,
    seq_len: usize,
    num_seqs: usize,
    seed: u64,
    order: Order,
    perms: Mutex<HashMap<u64, Arc<Vec<u32>>>>,
}

impl PackedDataset {
    /// Packs ids held in memory, in the listed order; errors if they are shorter than one
    /// sequence.
    pub fn new(tokens: Vec<u32>, seq_len: usize, seed: u64, split: &'static str) -> Result<Self, DataError> {
        Self::from_store(TokenStore::in_memory(tokens), seq_len, seed, Order::Listed, split)
    }

    /// Packs a stream; errors if it is shorter than one sequence.
    pub fn from_store(store: TokenStore, seq_len: usize, seed: u64, order: Order, split: &'static str) -> Result<Self, DataError> {
        let len = store.len() as usize;
        if len < seq_len + 1 {
            return Err(DataError::TooShort { split, tokens: len, need: seq_len + 1 });
        }
        let num_seqs = (len - 1) / seq_len;
        if order == Order::Listed && u32::try_from(num_seqs).is_err() {
            return Err(DataError::Input(format!("{split}: {num_seqs} sequences are too many for a listed order")));
        }
        Ok(Self { store, seq_len, num_seqs, seed, order, perms: Mutex::new(HashMap::new()) })
    }

    /// Sequences in one epoch.
    pub fn num_seqs(&self) -> usize {
        self.num_seqs
    }

    /// Tokens per sequence (inputs; targets are shifted by one).
    pub fn seq_len(&self) -> usize {
        self.seq_len
    }

    /// Ids in the stream.
    pub fn tokens(&self) -> u64 {
        self.store.len()
    }

    /// Sequence `idx` in stream order, `seq_len + 1` ids.
    pub fn sequence(&self, idx: usize) -> Cow<'_, [u32]> {
        let (start, count) = ((idx * self.seq_len) as u64, self.seq_len + 1);
        match self.store.slice(start, count) {
            Some(s) => Cow::Borrowed(s),
            None => {
                let mut out = Vec::with_capacity(count);
                self.store.read(start, count, &mut out);
                Cow::Owned(out)
            }
        }
    }

    fn listed(&self, epoch: u64) -> Arc<Vec<u32>> {
        let mut cache = self.perms.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if cache.len() > 4 {
            cache.clear();
        }
        cache
            .entry(epoch)
            .or_insert_with(|| {
                let mut p: Vec<u32> = (0..self.num_seqs as u32).collect();
                let mut rng = StdRng::seed_from_u64(self.seed ^ epoch.wrapping_mul(0x9E37_79B9_7F4A_7C15));
                p.shuffle(&mut rng);
                Arc::new(p)
            })
            .clone()
    }

    /// The sequence that sample `index` of training reads.
    pub fn sequence_of_sample(&self, index: u64) -> usize {
        let n = self.num_seqs as u64;
        let (epoch, k) = (index / n, index % n);
        match self.order {
            Order::Listed => self.listed(epoch)[k as usize] as usize,
            Order::Keyed => keyed_permutation(n, self.seed, epoch, k) as usize,
        }
    }

    /// The `index`-th sample of training.
    pub fn sample(&self, index: u64) -> Cow<'_, [u32]> {
        self.sequence(self.sequence_of_sample(index))
    }
}

fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Position `k` of epoch `epoch`'s permutation of `0..n`: six Feistel rounds over `2^(2h)`
/// values (the smallest power of four at or above `n`, under 4n), repeated until the value falls
/// below `n` (cycle walking keeps it a bijection of `0..n`; under 4 rounds on average).
pub fn keyed_permutation(n: u64, seed: u64, epoch: u64, k: u64) -> u64 {
    assert!(k < n, "position {k} of a permutation of {n}");
    let bits = (64 - (n - 1).max(1).leading_zeros()).max(2);
    let half = bits.div_ceil(2);
    let mask = (1u64 << half) - 1;
    let key = mix(seed ^ mix(epoch));
    let mut x = k;
    loop {
        let (mut l, mut r) = (x >> half, x & mask);
        for round in 0..6u64 {
            let f = mix(key ^ (round << 56) ^ r) & mask;
            (l, r) = (r, l ^ f);
        }
        x = (l << half) | r;
        if x < n {
            return x;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sample_order_is_a_pure_function_and_a_permutation_per_epoch() {
        let tokens: Vec<u32> = (0..1001).collect();
        let a = PackedDataset::new(tokens.clone(), 10, 7, "train").unwrap();
        let b = PackedDataset::new(tokens, 10, 7, "train").unwrap();
        assert_eq!(a.num_seqs(), 100);
        // Same (seed, index) -> same sample, whatever was asked before.
        let _ = b.sample(250);
        for i in [0u64, 5, 99, 100, 123, 250] {
            assert_eq!(a.sample(i), b.sample(i));
        }
        // Each epoch visits every sequence once.
        let mut starts: Vec<u32> = (0..100).map(|i| a.sample(i)[0]).collect();
        starts.sort();
        assert_eq!(starts, (0..100).map(|i| i * 10).collect::<Vec<_>>());
        // Windows overlap by one token: inputs and next-token targets.
        assert_eq!(&*a.sequence(3), &(30..41).collect::<Vec<u32>>()[..]);
        assert!(PackedDataset::new(vec![1, 2, 3], 8, 0, "heldout").is_err());
    }

    #[test]
    fn the_keyed_order_is_a_bijection_per_epoch_and_differs_between_epochs_and_seeds() {
        for n in [1u64, 2, 3, 5, 64, 1000, 4097] {
            let mut seen: Vec<u64> = (0..n).map(|k| keyed_permutation(n, 11, 0, k)).collect();
            seen.sort_unstable();
            assert_eq!(seen, (0..n).collect::<Vec<_>>(), "n = {n}");
        }
        let order = |seed, epoch| (0..1000).map(|k| keyed_permutation(1000, seed, epoch, k)).collect::<Vec<_>>();
        assert_ne!(order(11, 0), order(11, 1));
        assert_ne!(order(11, 0), order(12, 0));
        assert_eq!(order(11, 3), order(11, 3));
        // Shuffled, not shifted: few sequences keep their place, and neighbours scatter.
        let o = order(11, 0);
        assert!(o.iter().enumerate().filter(|(k, v)| *k as u64 == **v).count() < 10);
        let gaps = o.windows(2).filter(|w| w[0].abs_diff(w[1]) < 5).count();
        assert!(gaps < 30, "{gaps} neighbours within 5");
    }
}
