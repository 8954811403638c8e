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

pub mod dense_gemv;
pub mod elementwise;
mod isa;
mod packed;
pub mod paged_attention;
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
pub use packed::PackedWeights;
pub use pool::ThreadCount;
pub use quantize::{quantize_rows, Activations, QuantizedRows, BLOCK};

use thiserror::Error;

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
