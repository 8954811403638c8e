//! A linear layer of the decoder: y (m, n) = x (m, k) · Wᵀ (+ b), W in the layout of the
//! kernel that multiplies it — dense float32 or bfloat16 (`dense_gemv` / `dense_gemm`), or
//! 4/8-bit weights repacked for the int8 dot-product kernels (`int8_matmul`, W4A8 / W8A8, the
//! activations quantized as one or two int8 terms).

use std::sync::Arc;

use super::Buffer;
use crate::kernels::dense_gemv::{dense_gemm, DenseWeights};
use crate::kernels::int8_matmul::int8_matmul;
use crate::kernels::{Activations, Isa, KernelError, PackedWeights, ThreadCount};

pub enum LinearWeights {
    F32(Buffer<f32>),
    /// bfloat16 bit patterns.
    Bf16(Buffer<u16>),
    /// Shared with the torch layer that packed it (`Int8Weights`): never copied.
    Packed(Arc<PackedWeights>, Activations),
}

pub struct Linear {
    pub n: usize,
    pub k: usize,
    pub weights: LinearWeights,
    pub bias: Option<Vec<f32>>,
}

impl Linear {
    /// Checks that the weights hold (n, k) and the bias n values.
    pub fn new(
        n: usize,
        k: usize,
        weights: LinearWeights,
        bias: Option<Vec<f32>>,
    ) -> Result<Linear, KernelError> {
        let held = match &weights {
            LinearWeights::F32(w) => (w.len() == n * k).then_some(()),
            LinearWeights::Bf16(w) => (w.len() == n * k).then_some(()),
            LinearWeights::Packed(w, _) => (w.n == n && w.k == k).then_some(()),
        };
        if held.is_none() || bias.as_ref().is_some_and(|b| b.len() != n) {
            return Err(KernelError::InvalidArgument(format!(
                "a linear layer's weights or bias do not hold ({n}, {k})"
            )));
        }
        Ok(Linear {
            n,
            k,
            weights,
            bias,
        })
    }

    /// out (m, n) = x (m, k) · Wᵀ + b.
    pub fn apply(
        &self,
        x: &[f32],
        m: usize,
        out: &mut [f32],
        isa: Isa,
        threads: ThreadCount,
    ) -> Result<(), KernelError> {
        let (n, k) = (self.n, self.k);
        match &self.weights {
            LinearWeights::F32(w) => {
                let w = DenseWeights::F32(w.as_slice());
                dense_gemm(x, m, k, w, n, out, isa, threads)?
            }
            LinearWeights::Bf16(w) => {
                let w = DenseWeights::Bf16(w.as_slice());
                dense_gemm(x, m, k, w, n, out, isa, threads)?
            }
            LinearWeights::Packed(w, activations) => {
                int8_matmul(x, m, w, out, *activations, isa, threads)?
            }
        }
        if let Some(bias) = &self.bias {
            for row in out.chunks_exact_mut(n) {
                for (y, b) in row.iter_mut().zip(bias) {
                    *y += b;
                }
            }
        }
        Ok(())
    }

    /// Bytes of the weights this layer reads per pass.
    pub fn weight_bytes(&self) -> usize {
        match &self.weights {
            LinearWeights::F32(w) => w.len() * 4,
            LinearWeights::Bf16(w) => w.len() * 2,
            LinearWeights::Packed(w, _) => w.size_bytes(),
        }
    }
}
