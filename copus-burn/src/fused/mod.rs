//! Fused softmax cross entropy, causal softmax, softmax, RMSNorm, RoPE, SiLU and SwiGLU: each
//! reads its input once on the host, computes its value (and what its backward needs) in one
//! parallel pass over rows (rayon, the pool Flex's GEMM already uses), and is one custom
//! operation of Burn's autodiff graph, whose hand-written backward is one more host pass:
//! - [`cross_entropy_sum`] never materialises probabilities or log-probabilities as tensors; its
//!   forward pass leaves `softmax(z) - onehot(target)` behind, and its backward scales that by the
//!   incoming gradient;
//! - [`softmax`] keeps `y` and returns `y * (dy - sum(dy * y))` per row;
//! - [`causal_softmax`] is [`softmax`] of scaled attention scores under a causal mask, with
//!   the scale and the mask folded in;
//! - [`rms_norm`] keeps `x` and each row's `1 / rms`, and returns the gradients of the input
//!   and of the weight;
//! - [`rope`] keeps its tables and applies the inverse rotation to `dy`;
//! - [`silu`] keeps `silu'(x)` and returns `dy * silu'(x)`;
//! - [`swiglu`] (`silu(gate) * up`, two inputs) keeps both inputs and returns both gradients in
//!   one pass, written over the incoming gradient and the kept `up`;
//! - [`causal_attention`] (`softmax(scale * q k^T + mask) v` per kv head, three inputs) runs its
//!   products block by block, skipping the keys no query of a block sees, and writes its output
//!   in the layout the output projection reads (see its module);
//! - [`linear`] (`x W + b`) writes each of its three products straight into a fresh buffer,
//!   where Flex's matmul zero-fills and copies every output first (see its module).
//!
//! The custom operations need Flex under autodiff without gradient checkpointing (what
//! `Device::flex().autodiff()` gives) and f32 values; without autodiff, the host pass alone.
//!
//! On LibTorch (feature `tch`) the same functions are each one operation on LibTorch's own
//! kernels, in any element type: attention on `scaled_dot_product_attention` (flash or
//! memory-efficient kernels on CUDA), RMSNorm, RoPE and SwiGLU with the backward pass LibTorch's
//! autograd records, and the cross entropy chunked over rows with a backward pass of its own
//! (see its module, `torch`). `count_operator_calls` counts LibTorch's operator calls. On
//! other devices, or under Burn's gradient checkpointing, Burn's decomposed forms run.
//!
//! The engine's vocabulary-parallel loss runs the same row kernels around its all-reduces: each
//! rank computes `(max, sum of exp)` of its vocabulary slice in one pass (`row_stats`), the
//! ranks agree on the global max and rescale their sums (`rescale_sums`), and each rank
//! writes its slice's gradient in a second pass (`softmax_grad_in_place`).

mod activation;
mod attention;
mod gemm;
mod glue;
mod linear;
mod loss;
mod norm;
mod rope;
mod rows;
mod softmax;
#[cfg(test)]
mod tests;
#[cfg(feature = "tch")]
mod torch;

pub use activation::{silu, swiglu};
pub use attention::{causal_attention, grouped_causal_attention};
pub use linear::linear;
pub use loss::cross_entropy_sum;
pub use norm::rms_norm;
pub use rope::rope;
pub(crate) use rows::{picked, rescale_sums, row_stats, softmax_grad_in_place};
pub(crate) use softmax::index_range;
pub use softmax::{causal_softmax, softmax};
#[cfg(feature = "tch")]
pub(crate) use torch::{AdamwScalars, adamw_foreach, on_libtorch};
#[cfg(feature = "tch")]
pub use torch::{
    built as libtorch_operations, count_operator_calls, set_enabled as use_libtorch_operations, set_threads as set_libtorch_threads,
};
