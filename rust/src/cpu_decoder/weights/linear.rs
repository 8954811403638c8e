//! A linear layer of the decoder: y (m, n) = x (m, k) · Wᵀ (+ b), W in the layout of the
//! kernel that multiplies it — dense float32 or bfloat16 (`dense_gemv` / `dense_gemm`), or
//! 4/8-bit weights repacked for the int8 dot-product kernels (`int8_matmul`, W4A8 / W8A8, the
//! activations quantized as one or two int8 terms).

use std::sync::Arc;

use super::Buffer;
use crate::kernels::dense_gemv::{dense_gemm, DenseWeights};
use crate::kernels::int8_matmul::{int8_matmul, matmul_quantized};
use crate::kernels::{Activations, Isa, KernelError, PackedWeights, QuantizedRows, ThreadCount};

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
        self.add_bias(out);
        Ok(())
    }

    /// How the int8 kernels of this layer take their activations, for a caller that quantizes
    /// them itself (`rms_norm_quantize`); None for float weights, which read float32 rows.
    pub fn quantized_activations(&self) -> Option<Activations> {
        match &self.weights {
            LinearWeights::Packed(_, activations) => Some(*activations),
            LinearWeights::F32(_) | LinearWeights::Bf16(_) => None,
        }
    }

    /// out (m, n) = x · Wᵀ + b, x (m, k) already quantized as `quantized_activations` says.
    pub fn apply_quantized(
        &self,
        x: &QuantizedRows,
        out: &mut [f32],
        isa: Isa,
        threads: ThreadCount,
    ) -> Result<(), KernelError> {
        let LinearWeights::Packed(w, activations) = &self.weights else {
            return Err(KernelError::InvalidArgument(
                "a linear layer of float weights takes float32 rows, not quantized ones".into(),
            ));
        };
        let split = *activations == Activations::Int8x2;
        if x.blocks != w.blocks || x.split() != split || out.len() != x.rows * self.n {
            return Err(KernelError::InvalidArgument(format!(
                "quantized rows ({} of {} blocks, second terms: {}) and an output of {} values \
                 do not fit a ({}, {}) layer taking {activations:?}",
                x.rows,
                x.blocks,
                x.split(),
                out.len(),
                self.n,
                self.k
            )));
        }
        if !isa.supported() {
            return Err(KernelError::InvalidArgument(format!(
                "this CPU cannot run {isa}"
            )));
        }
        if x.rows > 0 {
            matmul_quantized(x, w, out, isa, threads);
        }
        self.add_bias(out);
        Ok(())
    }

    fn add_bias(&self, out: &mut [f32]) {
        if let Some(bias) = &self.bias {
            for row in out.chunks_exact_mut(self.n) {
                for (y, b) in row.iter_mut().zip(bias) {
                    *y += b;
                }
            }
        }
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
