//! aieng's CPU kernels: int8 dot-product matmul for W4A8/W8A8 layers (weights repacked once,
//! activations quantized per block of 32), dispatched on the CPU features found at run time,
//! on a thread pool sized to the engine's thread count.
//!
//! The math of the quantized matmul, for an output y[m, n] = Σ_k x[m, k] w[n, k] with
//! w = (q − z)·s per weight group and x ≈ xq·d per activation block of 32:
//!
//!   y[m, n] = Σ_blocks d[m, b] · (s[n, g] · Σ_k xq·q − s[n, g]·z[n, g] · Σ_k xq)
//!
//! q is unsigned (0..16 or 0..256) and xq signed (−127..127), exactly the operands of
//! `vpdpbusd` (unsigned × signed bytes summed four at a time into int32): no −128 edge, the zero
//! point leaves the int8 loop and is paid once per block with the activation sum.

#[cfg(target_arch = "x86_64")]
mod decode_lanes;
pub mod dense_gemv;
pub mod elementwise;
mod isa;
mod norm_quantize;
mod packed;
pub mod paged_attention;
#[cfg(target_arch = "x86_64")]
mod paged_decode_x86;
pub mod peak;
mod pool;
mod quantize;

pub mod int8_matmul;
#[cfg(target_arch = "x86_64")]
mod int8_x86;
#[cfg(feature = "python")]
pub(crate) mod py;
#[cfg(feature = "python")]
mod py_elementwise;

pub use isa::{Isa, ISA_ENV};
pub use norm_quantize::rms_norm_quantize;
pub use packed::PackedWeights;
pub use pool::{pool_stats, PoolStats, ThreadCount};
pub use quantize::{quantize_rows, Activations, QuantizedRows, BLOCK};

use thiserror::Error;

/// `x` rounded to the nearest integer, ties to even, for |x| < 2²² (the kernels round values
/// of at most a few hundred): adding and subtracting 1.5 · 2²³ leaves the integer part in the
/// float's mantissa under the default rounding mode. Unlike `f32::round_ties_even` it is two
/// additions on every instruction set, so a loop around it vectorises even where the code is
/// not compiled for SSE4.1 (there `round_ties_even` is a call to libm's `rintf` per value).
/// NaN and ±∞ pass through as they are.
#[inline(always)]
pub(crate) fn round_small(x: f32) -> f32 {
    const MAGIC: f32 = 12_582_912.0; // 1.5 · 2²³
    (x + MAGIC) - MAGIC
}

#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum KernelError {
    /// A shape, dtype or value the kernel cannot take; the message names it.
    #[error("{0}")]
    InvalidArgument(String),
    /// NaN or an infinity in an input.
    #[error("{0}")]
    NotFinite(String),
}

impl From<KernelError> for crate::error::CoreError {
    fn from(err: KernelError) -> Self {
        crate::error::CoreError::InvalidArgument(err.to_string())
    }
}

#[cfg(test)]
mod round_tests {
    use super::round_small;

    #[test]
    fn round_small_is_round_ties_even_where_it_applies() {
        for i in -2_000_000..2_000_000 {
            let x = i as f32 / 1000.0; // every tie of ±0.5 steps up to ±2000 among them
            assert_eq!(round_small(x), x.round_ties_even(), "{x}");
        }
        for x in [0.5f32, 1.5, 2.5, -0.5, -1.5, 126.5, -126.5, 4_194_303.5] {
            assert_eq!(round_small(x), x.round_ties_even(), "{x}");
        }
        assert!(round_small(f32::NAN).is_nan());
        assert_eq!(round_small(f32::INFINITY), f32::INFINITY);
        assert_eq!(round_small(f32::NEG_INFINITY), f32::NEG_INFINITY);
    }
}
