//! Row kernels on host slices: a vectorised `e^x`, row max and sum of exponentials, softmax
//! rows, and the cross entropy's per-row pieces that the vocabulary-parallel loss shares
//! (`row_stats`, `rescale_sums`, `picked`, `softmax_grad_in_place`).

use rayon::prelude::*;

/// Below this many logits one thread does the work: spawning tasks costs more.
pub(super) const PARALLEL_MIN: usize = 1 << 15;

/// Lanes of the vectorised reductions.
pub(super) const LANES: usize = 8;

/// `e^x` in f32 with a relative error of about 1e-7, free of branches and of float-to-int
/// conversions so that loops over slices vectorise. Range reduction `x = n ln 2 + r` with
/// `|r| <= ln 2 / 2` (ln 2 split in two parts so `n ln 2` is exact), a degree-6 polynomial for
/// `e^r`, and `2^n` built from its bits (`n` read from the mantissa of `x log2 e + 1.5 * 2^23`).
/// Returns 0 below -87.3 (where `e^x` leaves the normal range), saturates near 88, gives NaN
/// for NaN and +inf.
#[inline(always)]
pub(crate) fn exp(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    // 1.5 * 2^23: adding it rounds to an integer held in the low mantissa bits.
    const ROUND: f32 = 12_582_912.0;
    const ROUND_BITS: u32 = 0x4B40_0000;
    let c = x.clamp(-87.0, 88.0);
    let t = c * LOG2E + ROUND;
    let n = t - ROUND;
    let r = c - n * LN2_HI - n * LN2_LO;
    let p = 1.987_569_2e-4;
    let p = p * r + 1.398_2e-3;
    let p = p * r + 8.333_452e-3;
    let p = p * r + 4.166_579_6e-2;
    let p = p * r + 0.166_666_65;
    let p = p * r + 0.5;
    let y = p * r * r + r + 1.0;
    let scale = f32::from_bits(t.to_bits().wrapping_sub(ROUND_BITS).wrapping_add(127) << 23);
    // `x * 0` is 0, or NaN for NaN and infinities.
    if x < -87.3 { 0.0 } else { y * scale + x * 0.0 }
}

/// Largest value of a row (NaN values are skipped here; they reach the sum through `exp`).
pub(super) fn row_max(row: &[f32]) -> f32 {
    let mut acc = [f32::NEG_INFINITY; LANES];
    let chunks = row.chunks_exact(LANES);
    let mut m = chunks.remainder().iter().fold(f32::NEG_INFINITY, |m, &x| if x > m { x } else { m });
    for c in chunks {
        for (a, &x) in acc.iter_mut().zip(c) {
            *a = if x > *a { x } else { *a };
        }
    }
    for a in acc {
        m = if a > m { a } else { m };
    }
    m
}

/// `sum(e^(x - max))` of a row.
pub(super) fn row_sum_exp(row: &[f32], max: f32) -> f32 {
    let mut acc = [0f32; LANES];
    let chunks = row.chunks_exact(LANES);
    let mut s: f32 = chunks.remainder().iter().map(|&x| exp(x - max)).sum();
    for c in chunks {
        for (a, &x) in acc.iter_mut().zip(c) {
            *a += exp(x - max);
        }
    }
    s += acc.iter().sum::<f32>();
    s
}

/// Replaces each `x` by `e^(x - max)`; returns their sum (in lanes, so the loop vectorises).
pub(super) fn exp_in_place(row: &mut [f32], max: f32) -> f32 {
    let mut acc = [0f32; LANES];
    let mut chunks = row.chunks_exact_mut(LANES);
    for c in &mut chunks {
        for (a, x) in acc.iter_mut().zip(c.iter_mut()) {
            *x = exp(*x - max);
            *a += *x;
        }
    }
    let mut s = 0f32;
    for x in chunks.into_remainder() {
        *x = exp(*x - max);
        s += *x;
    }
    s + acc.iter().sum::<f32>()
}

/// Writes `e^(x - max)` of each `x` of `src` into `dst`; returns their sum (in lanes, as
/// [`exp_in_place`]).
pub(super) fn exp_into(dst: &mut [f32], src: &[f32], max: f32) -> f32 {
    let mut acc = [0f32; LANES];
    let (mut d8, s8) = (dst.chunks_exact_mut(LANES), src.chunks_exact(LANES));
    let rest_src = s8.remainder();
    for (d, s) in (&mut d8).zip(s8) {
        for ((a, y), &x) in acc.iter_mut().zip(d.iter_mut()).zip(s) {
            *y = exp(x - max);
            *a += *y;
        }
    }
    let mut sum = 0f32;
    for (y, &x) in d8.into_remainder().iter_mut().zip(rest_src) {
        *y = exp(x - max);
        sum += *y;
    }
    sum + acc.iter().sum::<f32>()
}

/// A row replaced by its softmax.
pub(super) fn softmax_row(row: &mut [f32]) {
    let m = row_max(row);
    let k = 1.0 / exp_in_place(row, m);
    row.iter_mut().for_each(|x| *x *= k);
}

/// `sum(a * b)` in independent lanes, so the loop vectorises.
pub(super) fn lane_dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; LANES];
    let (ca, cb) = (a.chunks_exact(LANES), b.chunks_exact(LANES));
    let rest: f32 = ca.remainder().iter().zip(cb.remainder()).map(|(x, y)| x * y).sum();
    for (x8, y8) in ca.zip(cb) {
        for ((a, x), y) in acc.iter_mut().zip(x8).zip(y8) {
            *a += x * y;
        }
    }
    acc.iter().sum::<f32>() + rest
}

/// Rows per parallel task, so that each task holds about `PARALLEL_MIN` logits.
pub(super) fn rows_per_task(v: usize) -> usize {
    (PARALLEL_MIN / v.max(1)).max(1)
}

/// `(max, sum of e^(x - max))` of each row of `z` (rows of `v` logits), in one pass: each row
/// is read once from memory and twice from cache.
pub(crate) fn row_stats(z: &[f32], v: usize) -> (Vec<f32>, Vec<f32>) {
    assert!(v > 0 && z.len().is_multiple_of(v), "{} logits are not rows of {v}", z.len());
    let one = |row: &[f32]| {
        let m = row_max(row);
        (m, row_sum_exp(row, m))
    };
    let stats: Vec<(f32, f32)> = if z.len() < PARALLEL_MIN {
        z.chunks(v).map(one).collect()
    } else {
        z.par_chunks(v).with_min_len(rows_per_task(v)).map(one).collect()
    };
    stats.into_iter().unzip()
}

/// Rescales each row's `sum_exp` from its local `max` to the agreed `global` max (vocabulary
/// parallelism: each rank's sum is over its own slice; after this, the ranks' sums add up).
pub(crate) fn rescale_sums(sum_exp: &mut [f32], max: &[f32], global: &[f32]) {
    for ((s, &m), &g) in sum_exp.iter_mut().zip(max).zip(global) {
        // A slice whose max is -inf (all logits -inf) contributes nothing; one of NaNs keeps its NaN.
        *s = if m == f32::NEG_INFINITY && !s.is_nan() { 0.0 } else { *s * exp(m - g) };
    }
}

/// The target's logit of each row, for targets in `start..start + v`, else 0 (the slice of
/// another rank).
pub(crate) fn picked(z: &[f32], v: usize, targets: &[i64], start: i64) -> Vec<f32> {
    targets
        .iter()
        .enumerate()
        .map(|(i, &t)| {
            let local = t - start;
            if (0..v as i64).contains(&local) { z[i * v + local as usize] } else { 0.0 }
        })
        .collect()
}

/// Overwrites the logits `z` with `scale * (softmax(z) - onehot(target))` row by row, from the
/// agreed `max` and `sum_exp` of each row; targets outside `start..start + v` belong to another
/// slice and take no one-hot term here.
pub(crate) fn softmax_grad_in_place(z: &mut [f32], v: usize, max: &[f32], sum_exp: &[f32], targets: &[i64], start: i64, scale: f32) {
    assert!(v > 0 && z.len() == v * max.len() && max.len() == sum_exp.len() && max.len() == targets.len());
    let one = |(i, row): (usize, &mut [f32])| {
        let (m, k) = (max[i], scale / sum_exp[i]);
        for x in row.iter_mut() {
            *x = exp(*x - m) * k;
        }
        let local = targets[i] - start;
        if (0..v as i64).contains(&local) {
            row[local as usize] -= scale;
        }
    };
    if z.len() < PARALLEL_MIN {
        z.chunks_mut(v).enumerate().for_each(one);
    } else {
        z.par_chunks_mut(v).with_min_len(rows_per_task(v)).enumerate().for_each(one);
    }
}

/// Summed cross entropy of the rows of `z` against `targets` (the sum in f64), and its gradient
/// `softmax(z) - onehot(target)` written into `g`: row by row, so each row of logits is read
/// from memory once and each exponential taken once. Errors name a target outside the
/// vocabulary.
pub(crate) fn cross_entropy_grad(z: &[f32], g: &mut [f32], v: usize, targets: &[i64]) -> Result<f64, String> {
    if v == 0 || z.len() != v * targets.len() || g.len() != z.len() {
        return Err(format!("{} logits and {} gradients are not {} rows of {v}", z.len(), g.len(), targets.len()));
    }
    if let Some(t) = targets.iter().find(|&&t| !(0..v as i64).contains(&t)) {
        return Err(format!("target token id {t} is outside the vocabulary of {v} logits"));
    }
    let one = |(t, (zr, gr)): (&i64, (&[f32], &mut [f32]))| {
        let m = row_max(zr);
        let k = 1.0 / exp_into(gr, zr, m);
        gr.iter_mut().for_each(|x| *x *= k);
        let t = *t as usize;
        gr[t] -= 1.0;
        // -log softmax(z)[t] = ln(sum e^(z - m)) + m - z[t], and 1 / k is that sum.
        f64::from((1.0 / k).ln() + m - zr[t])
    };
    let losses: Vec<f64> = if z.len() < PARALLEL_MIN {
        targets.iter().zip(z.chunks(v).zip(g.chunks_mut(v))).map(one).collect()
    } else {
        targets.par_iter().zip(z.par_chunks(v).zip(g.par_chunks_mut(v))).with_min_len(rows_per_task(v)).map(one).collect()
    };
    Ok(losses.iter().sum())
}
