//! A small mutation fuzzer for the parsers that read what a user or a peer hands copus (recipes,
//! service frames, checkpoints, Hugging Face configs and weights): inputs mutated from valid
//! seeds, each run under `catch_unwind`, for a time budget. A panic fails the run with the input
//! that caused it. Together with a capped allocator in the test binary, an input that makes a
//! parser allocate without bound aborts the run.
//!
//! `COPUS_FUZZ_SECS` sets each target's budget (default 3 s, what CI runs); `COPUS_FUZZ_SEED`
//! fixes the generator's seed (default: from the clock, printed so a finding can be replayed).

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::time::{Duration, Instant};

/// Values that often break length and number handling.
const INTERESTING: [u64; 10] = [0, 1, 0x7f, 0x80, 0xff, 0xffff, 0x7fff_ffff, 0xffff_ffff, 1 << 40, u64::MAX];

/// Text that often breaks parsers of numbers and structure.
const TOKENS: [&str; 14] = ["0", "-1", "99999999999999999999", "1e309", "NaN", "inf", "\"", "(", ")", "[", "]", ",", "Some(", "\u{0}"];

/// A splitmix64 generator.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: usize) -> usize {
        if n == 0 { 0 } else { (self.next() % n as u64) as usize }
    }
}

/// One mutation of `input` (possibly splicing in part of `other`).
fn mutate(rng: &mut Rng, input: &mut Vec<u8>, other: &[u8]) {
    let len = input.len();
    match rng.below(9) {
        0 if len > 0 => {
            let i = rng.below(len);
            input[i] ^= 1 << rng.below(8);
        }
        1 if len > 0 => {
            let i = rng.below(len);
            input[i] = INTERESTING[rng.below(INTERESTING.len())] as u8;
        }
        2 if len >= 4 => {
            let i = rng.below(len - 3);
            let v = INTERESTING[rng.below(INTERESTING.len())] as u32;
            let bytes = if rng.below(2) == 0 { v.to_le_bytes() } else { v.to_be_bytes() };
            input[i..i + 4].copy_from_slice(&bytes);
        }
        3 if len >= 8 => {
            let i = rng.below(len - 7);
            input[i..i + 8].copy_from_slice(&INTERESTING[rng.below(INTERESTING.len())].to_le_bytes());
        }
        4 if len > 0 => {
            let (a, n) = (rng.below(len), 1 + rng.below(16));
            input.drain(a..(a + n).min(len));
        }
        5 => {
            let at = rng.below(len + 1);
            let n = 1 + rng.below(16);
            let bytes: Vec<u8> = (0..n).map(|_| rng.next() as u8).collect();
            input.splice(at..at, bytes);
        }
        6 => {
            let at = rng.below(len + 1);
            let t = TOKENS[rng.below(TOKENS.len())].as_bytes().to_vec();
            input.splice(at..at, t);
        }
        7 if !other.is_empty() => {
            let (a, b) = (rng.below(other.len()), rng.below(other.len()));
            let (a, b) = (a.min(b), a.max(b));
            let at = rng.below(len + 1);
            input.splice(at..at, other[a..b].iter().copied());
        }
        _ => input.truncate(rng.below(len + 1)),
    }
}

/// The time budget of one target (`COPUS_FUZZ_SECS`, default 3 s).
pub fn budget() -> Duration {
    Duration::from_secs_f64(std::env::var("COPUS_FUZZ_SECS").ok().and_then(|s| s.parse().ok()).unwrap_or(3.0))
}

/// Runs `target` on inputs mutated from `seeds` (1 to 4 mutations each, seeds included) for
/// `budget`, each under `catch_unwind`; panics with the input of the first run that panicked.
/// Returns the number of executions.
pub fn fuzz(name: &str, seeds: &[Vec<u8>], budget: Duration, target: impl Fn(&[u8])) -> u64 {
    assert!(!seeds.is_empty(), "{name}: no seed");
    let seed = std::env::var("COPUS_FUZZ_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(1, |d| d.as_nanos() as u64));
    let mut rng = Rng(seed);
    // The panic hook would print every caught panic; the finding is reported below instead.
    let hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(|_| {}));
    let started = Instant::now();
    let mut runs = 0u64;
    let mut found = None;
    while found.is_none() && (runs < seeds.len() as u64 || started.elapsed() < budget) {
        let base = &seeds[rng.below(seeds.len())];
        let mut input = base.clone();
        if runs >= seeds.len() as u64 {
            for _ in 0..1 + rng.below(4) {
                let other = &seeds[rng.below(seeds.len())];
                mutate(&mut rng, &mut input, other);
            }
        }
        runs += 1;
        if let Err(p) = catch_unwind(AssertUnwindSafe(|| target(&input))) {
            let why = p.downcast_ref::<String>().cloned().or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string())).unwrap_or_default();
            found = Some((input, why));
        }
    }
    std::panic::set_hook(hook);
    eprintln!("fuzz {name}: {runs} executions in {:.1} s (seed {seed})", started.elapsed().as_secs_f64());
    if let Some((input, why)) = found {
        panic!(
            "fuzz {name}: panicked ({why}) on a {}-byte input (seed {seed}); as text: {:?}",
            input.len(),
            String::from_utf8_lossy(&input[..input.len().min(2000)])
        );
    }
    runs
}
