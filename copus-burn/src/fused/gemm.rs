//! The `gemm` crate's f32 products (the crate under Flex's matmul) on slices, behind bounds
//! checks: an operand is a slice with row and column strides, checked to hold its matrix before
//! any pointer reaches `gemm`, so a wrong size panics instead of reading or writing out of bounds.
//!
//! [`product_new`] writes into a fresh buffer that is never zero-filled first: `gemm` overwrites
//! every element when told not to read the destination. (Flex's matmul zero-fills its output and
//! then copies it once more to align it, two passes over the output before the product starts.)

#![allow(unsafe_code)]

/// Products below this many multiply-adds run on the calling thread (Flex's threshold).
const PARALLEL_MIN: usize = 192 * 192 * 192;

/// A read-only operand: values from `data[0]` with row and column strides.
#[derive(Clone, Copy)]
pub(super) struct Mat<'a> {
    data: &'a [f32],
    rs: usize,
    cs: usize,
}

impl<'a> Mat<'a> {
    pub(super) fn of(data: &'a [f32], rs: usize, cs: usize) -> Self {
        Self { data, rs, cs }
    }

    /// The transpose, in place.
    pub(super) fn t(self) -> Self {
        Self { data: self.data, rs: self.cs, cs: self.rs }
    }

    /// Panics unless an `m x n` matrix fits; the offset of its last element is computed with
    /// checked arithmetic (a stride so large the offset overflows does not fit), and strides must
    /// fit gemm's `isize`.
    pub(super) fn check(&self, m: usize, n: usize) {
        assert!(isize::try_from(self.rs).is_ok() && isize::try_from(self.cs).is_ok(), "operand stride overflows isize");
        if m == 0 || n == 0 {
            return;
        }
        let last = (m - 1).checked_mul(self.rs).and_then(|r| (n - 1).checked_mul(self.cs).and_then(|c| r.checked_add(c)));
        assert!(last.is_some_and(|l| l < self.data.len()), "operand out of bounds");
    }
}

/// `dst = (accumulate ? dst : 0) + beta * lhs * rhs` for `lhs` `m x k` and `rhs` `k x n`, `dst`'s
/// rows `rs` apart, on this thread. Panics if an operand does not hold its matrix.
#[allow(clippy::too_many_arguments)]
pub(super) fn product(dst: &mut [f32], rs: usize, accumulate: bool, lhs: Mat, rhs: Mat, m: usize, n: usize, k: usize, beta: f32) {
    lhs.check(m, k);
    rhs.check(k, n);
    Mat::of(dst, rs, 1).check(m, n);
    if m == 0 || n == 0 {
        return;
    }
    // SAFETY: each operand was checked to hold its matrix at its strides, and `dst` is borrowed
    // mutably, so nothing else reads or writes it.
    unsafe { gemm_raw(dst.as_mut_ptr(), rs, accumulate, lhs, rhs, [m, n, k], beta, ::gemm::Parallelism::None) }
}

/// `lhs * rhs` (`lhs` `m x k`, `rhs` `k x n`) in a new row-major `m x n` buffer, on rayon's pool
/// when the product is large. Panics if an operand does not hold its matrix.
pub(super) fn product_new(lhs: Mat, rhs: Mat, m: usize, n: usize, k: usize) -> Vec<f32> {
    lhs.check(m, k);
    rhs.check(k, n);
    let len = m.checked_mul(n).expect("product size overflows");
    assert!(isize::try_from(n).is_ok() && len.checked_mul(k).is_some(), "product size overflows");
    // Apple's AMX kernels (`gemm`'s `experimental-apple-amx`, which `burn/apple-amx` turns on)
    // may read the destination even when told not to accumulate: where they can be compiled in,
    // the buffer starts zeroed, so it is never read uninitialised.
    if AMX_POSSIBLE {
        let mut out = vec![0.0f32; len];
        if len > 0 {
            let parallelism = parallelism_for(len, k);
            // SAFETY: `out` holds the `m x n` matrix at row stride `n`, initialised, and nothing
            // else holds it; the operands were checked.
            unsafe { gemm_raw(out.as_mut_ptr(), n, false, lhs, rhs, [m, n, k], 1.0, parallelism) };
        }
        return out;
    }
    let mut out = Vec::with_capacity(len);
    if len > 0 {
        let parallelism = parallelism_for(len, k);
        // SAFETY: `out` has room for the `m x n` matrix at row stride `n` and nothing else holds
        // it; the operands were checked. With `accumulate` false, gemm writes every element of
        // the destination without reading it (zeros when `k` is 0), so all `len` are initialised.
        unsafe {
            gemm_raw(out.as_mut_ptr(), n, false, lhs, rhs, [m, n, k], 1.0, parallelism);
            out.set_len(len);
        }
    }
    out
}

/// Whether `gemm`'s Apple AMX kernels can be in this build: they exist only for aarch64 macOS.
const AMX_POSSIBLE: bool = cfg!(all(target_os = "macos", target_arch = "aarch64"));

/// The pool for a product of `len` outputs over an inner size `k`: rayon's when it is large.
fn parallelism_for(len: usize, k: usize) -> ::gemm::Parallelism {
    if len.saturating_mul(k) >= PARALLEL_MIN { ::gemm::Parallelism::Rayon(rayon::current_num_threads()) } else { ::gemm::Parallelism::None }
}

/// `dst = (accumulate ? dst : 0) + beta * lhs * rhs` on a destination given by pointer, `mnk` the
/// sizes (gemm itself zero-fills when `k` is 0).
///
/// # Safety
/// `dst` must be valid for writes of the `m x n` matrix with rows `rs` apart (and for reads where
/// `accumulate`), nothing else may access those elements during the call, and `lhs` and `rhs` must
/// hold their matrices ([`Mat::check`]).
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn gemm_raw(
    dst: *mut f32,
    rs: usize,
    accumulate: bool,
    lhs: Mat,
    rhs: Mat,
    [m, n, k]: [usize; 3],
    beta: f32,
    parallelism: ::gemm::Parallelism,
) {
    let i = |x: usize| x as isize;
    // SAFETY: the caller's contract for `dst`; `lhs` and `rhs` hold their matrices.
    unsafe {
        ::gemm::gemm(
            m,
            n,
            k,
            dst,
            1,
            i(rs),
            accumulate,
            lhs.data.as_ptr(),
            i(lhs.cs),
            i(lhs.rs),
            rhs.data.as_ptr(),
            i(rhs.cs),
            i(rhs.rs),
            1.0,
            beta,
            false,
            false,
            false,
            parallelism,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn naive(a: &[f32], b: &[f32], m: usize, n: usize, k: usize) -> Vec<f32> {
        (0..m * n).map(|e| (0..k).map(|j| a[(e / n) * k + j] * b[j * n + e % n]).sum()).collect()
    }

    #[test]
    fn a_fresh_product_equals_the_definition_also_with_no_inner_dimension() {
        for (m, n, k) in [(3, 5, 7), (1, 1, 1), (17, 9, 33), (4, 6, 0)] {
            let a: Vec<f32> = (0..m * k).map(|i| ((i * 7) % 11) as f32 - 5.0).collect();
            let b: Vec<f32> = (0..k * n).map(|i| ((i * 5) % 13) as f32 - 6.0).collect();
            let got = product_new(Mat::of(&a, k.max(1), 1), Mat::of(&b, n, 1), m, n, k);
            assert_eq!(got, naive(&a, &b, m, n, k), "{m}x{n}x{k}");
        }
    }

    #[test]
    #[should_panic(expected = "out of bounds")]
    fn a_stride_whose_offset_overflows_is_refused_not_wrapped() {
        let data = [0.0f32; 4];
        // (m - 1) * rs = 5 * (2^62 - 1) overflows usize; unchecked it would wrap to a small offset.
        Mat::of(&data, usize::MAX / 4, 1).check(6, 1);
    }

    #[test]
    #[should_panic(expected = "overflows isize")]
    fn a_stride_beyond_isize_is_refused() {
        let data = [0.0f32; 4];
        Mat::of(&data, usize::MAX, 1).check(1, 1);
    }
}
