//! Activations quantized to int8 per block of 32 values with a float scale: x ≈ xq · d, d =
//! max|x| / 127, xq in −127..=127 (never −128, so a negated value still fits). Each block also
//! keeps Σ xq, which carries the weights' zero points out of the int8 loop.
//!
//! `Activations::Int8x2` adds a second int8 term for what the first one rounded away:
//! x ≈ d · (xq + xr / 254), xr = round((x/d − xq) · 254) in −127..=127. The kernels then run two
//! dot products per weight byte, and the activations keep about 15 bits (|error| ≤ d / 508
//! against d / 2): the precision of bfloat16 activations and better, at the int8 instructions'
//! speed where the weights' bandwidth, not the arithmetic, bounds the time (decode).

use std::sync::atomic::{AtomicBool, Ordering};

use super::pool::{split, ThreadCount};
use super::KernelError;

/// Values per activation block (and per weight block of the packed layout).
pub const BLOCK: usize = 32;
/// Blocks to quantize below which one thread does them all.
const PARALLEL_BLOCKS: usize = 4096;
/// The second term's steps per step of the first: |x/d − xq| ≤ 1/2 maps onto ±127.
pub const RESIDUAL_STEPS: f32 = 254.0;

/// How the activations are quantized.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Activations {
    /// One int8 per value (W4A8, W8A8).
    Int8,
    /// Two int8 per value: the first and what it rounded away (see the module note).
    Int8x2,
}

/// M rows of K activations, quantized. Rows are padded with zeros to whole blocks.
#[derive(Debug, Clone, Default)]
pub struct QuantizedRows {
    pub rows: usize,
    pub blocks: usize,
    /// (rows, blocks, 32) int8 values.
    pub values: Vec<i8>,
    /// Int8x2: (rows, blocks, 32) the second terms; empty otherwise.
    pub residuals: Vec<i8>,
    /// (rows, blocks) scales d.
    pub scales: Vec<f32>,
    /// (rows, blocks) Σ xq (+ Σ xr / 254 with the second terms), as float.
    pub sums: Vec<f32>,
}

impl QuantizedRows {
    pub fn split(&self) -> bool {
        !self.residuals.is_empty()
    }

    pub fn value_ptr(&self, row: usize, block: usize) -> *const i8 {
        self.values[(row * self.blocks + block) * BLOCK..].as_ptr()
    }

    pub fn residual_ptr(&self, row: usize, block: usize) -> *const i8 {
        self.residuals[(row * self.blocks + block) * BLOCK..].as_ptr()
    }
}

/// One row's share of the outputs.
struct RowOut<'a> {
    values: &'a mut [i8],
    residuals: Option<&'a mut [i8]>,
    scales: &'a mut [f32],
    sums: &'a mut [f32],
}

/// Quantizes one block; returns (d, Σ). `residuals`: the second terms, when wanted. Inlined
/// into the AVX2 copy of the row loop, where rounding is one instruction (not a call to libm's
/// `rintf`, which took a sixth of a 128-token prefill).
#[inline(always)]
fn quantize_block(x: &[f32], out: &mut [i8], residuals: Option<&mut [i8]>) -> (f32, f32) {
    // f32::max skips NaN: a block holding a NaN or an infinity gets a NaN scale, and its row
    // is then reported as not finite.
    let finite = x.iter().fold(true, |f, v| f & v.is_finite());
    let amax = x.iter().fold(0.0f32, |a, v| a.max(v.abs())) + if finite { 0.0 } else { f32::NAN };
    let inverse = if amax > 0.0 { 127.0 / amax } else { 0.0 };
    let mut sum = 0i32;
    for (o, v) in out.iter_mut().zip(x) {
        let q = super::round_small(v * inverse).clamp(-127.0, 127.0) as i8;
        sum += q as i32;
        *o = q;
    }
    out[x.len()..].fill(0);
    let Some(residuals) = residuals else {
        return (amax / 127.0, sum as f32);
    };
    let mut residual_sum = 0i32;
    for ((r, v), &q) in residuals.iter_mut().zip(x).zip(out.iter()) {
        let rest = (v * inverse - q as f32) * RESIDUAL_STEPS;
        let q = super::round_small(rest).clamp(-127.0, 127.0) as i8;
        residual_sum += q as i32;
        *r = q;
    }
    residuals[x.len()..].fill(0);
    (
        amax / 127.0,
        sum as f32 + residual_sum as f32 / RESIDUAL_STEPS,
    )
}

/// Returns false when the row holds a NaN or an infinity.
#[inline(always)]
fn quantize_row(x: &[f32], out: RowOut<'_>) -> bool {
    let RowOut {
        values,
        mut residuals,
        scales,
        sums,
    } = out;
    let mut finite = true;
    for (b, chunk) in x.chunks(BLOCK).enumerate() {
        let block = b * BLOCK..(b + 1) * BLOCK;
        let rest = residuals.as_deref_mut().map(|r| &mut r[block.clone()]);
        let (scale, sum) = quantize_block(chunk, &mut values[block], rest);
        finite &= scale.is_finite();
        scales[b] = scale;
        sums[b] = sum;
    }
    finite
}

/// The same loop compiled for AVX2 (rounding and the max vectorise there).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn quantize_row_avx2(x: &[f32], out: RowOut<'_>) -> bool {
    quantize_row(x, out)
}

fn check_finite(x: &[f32], k: usize) -> Result<(), KernelError> {
    match x.iter().position(|v| !v.is_finite()) {
        None => Ok(()),
        Some(i) => Err(KernelError::NotFinite(format!(
            "activation row {} column {} is {} (the int8 kernels take finite inputs only)",
            i / k,
            i % k,
            x[i]
        ))),
    }
}

/// x (m, k) row-major float32 -> its int8 blocks, into `out` (reused across calls).
pub fn quantize_rows(
    x: &[f32],
    m: usize,
    k: usize,
    activations: Activations,
    threads: ThreadCount,
    out: &mut QuantizedRows,
) -> Result<(), KernelError> {
    if x.len() != m * k {
        return Err(KernelError::InvalidArgument(format!(
            "activations hold {} values, not {m} x {k}",
            x.len()
        )));
    }
    let blocks = k.div_ceil(BLOCK);
    let split_terms = activations == Activations::Int8x2;
    out.rows = m;
    out.blocks = blocks;
    out.values.resize(m * blocks * BLOCK, 0);
    out.residuals
        .resize(if split_terms { m * blocks * BLOCK } else { 0 }, 0);
    out.scales.resize(m * blocks, 0.0);
    out.sums.resize(m * blocks, 0.0);
    let avx2 = super::Isa::Avx2.supported();
    let values = SharedMut::new(out.values.as_mut_ptr());
    let residuals = SharedMut::new(out.residuals.as_mut_ptr());
    let scales = SharedMut::new(out.scales.as_mut_ptr());
    let sums = SharedMut::new(out.sums.as_mut_ptr());
    let finite = AtomicBool::new(true);
    // A few rows take microseconds: not worth waking the pool (and yielding a core) for.
    let threads = if m * blocks < PARALLEL_BLOCKS {
        ThreadCount::new(1)
    } else {
        threads
    };
    split(threads, m, |rows| {
        for r in rows {
            let per_row = blocks * BLOCK;
            // SAFETY: each row's slices are disjoint, and every row goes to one thread only.
            let row_out = unsafe {
                RowOut {
                    values: std::slice::from_raw_parts_mut(values.get().add(r * per_row), per_row),
                    residuals: split_terms.then(|| {
                        std::slice::from_raw_parts_mut(residuals.get().add(r * per_row), per_row)
                    }),
                    scales: std::slice::from_raw_parts_mut(scales.get().add(r * blocks), blocks),
                    sums: std::slice::from_raw_parts_mut(sums.get().add(r * blocks), blocks),
                }
            };
            let row = &x[r * k..(r + 1) * k];
            #[cfg(target_arch = "x86_64")]
            let ok = if avx2 {
                // SAFETY: AVX2 and FMA were detected.
                unsafe { quantize_row_avx2(row, row_out) }
            } else {
                quantize_row(row, row_out)
            };
            #[cfg(not(target_arch = "x86_64"))]
            let ok = {
                let _ = avx2;
                quantize_row(row, row_out)
            };
            if !ok {
                finite.store(false, Ordering::Relaxed);
            }
        }
    });
    if finite.load(Ordering::Relaxed) {
        Ok(())
    } else {
        check_finite(x, k)
    }
}

/// A raw pointer handed to the pool's threads, each of which writes a disjoint part.
#[derive(Clone, Copy)]
pub(crate) struct SharedMut<T>(*mut T);

// SAFETY: only used to write disjoint ranges from the threads of one `split` call, which
// returns after they are done.
unsafe impl<T> Send for SharedMut<T> {}
unsafe impl<T> Sync for SharedMut<T> {}

impl<T> SharedMut<T> {
    pub(crate) fn new(ptr: *mut T) -> Self {
        SharedMut(ptr)
    }

    pub(crate) fn get(self) -> *mut T {
        self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn quantize(
        x: &[f32],
        m: usize,
        k: usize,
        a: Activations,
    ) -> Result<QuantizedRows, KernelError> {
        let mut out = QuantizedRows::default();
        quantize_rows(x, m, k, a, ThreadCount::new(2), &mut out).map(|_| out)
    }

    #[test]
    fn round_trip_within_half_a_step() {
        let k = 70; // not a multiple of the block
        let x: Vec<f32> = (0..2 * k)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 7.0)
            .collect();
        for activations in [Activations::Int8, Activations::Int8x2] {
            let q = quantize(&x, 2, k, activations).unwrap();
            assert_eq!(
                (q.blocks, q.split()),
                (3, activations == Activations::Int8x2)
            );
            for r in 0..2 {
                for c in 0..k {
                    let (b, i) = (c / BLOCK, (r * 3 + c / BLOCK) * BLOCK + c % BLOCK);
                    let d = q.scales[r * 3 + b];
                    let mut back = q.values[i] as f32;
                    let mut step = 0.5;
                    if q.split() {
                        back += q.residuals[i] as f32 / RESIDUAL_STEPS;
                        step /= RESIDUAL_STEPS;
                    }
                    assert!((back * d - x[r * k + c]).abs() <= d * step * 1.01 + 1e-6);
                }
                for b in 0..3 {
                    let at = (r * 3 + b) * BLOCK..(r * 3 + b + 1) * BLOCK;
                    let sum: i32 = q.values[at.clone()].iter().map(|&v| v as i32).sum();
                    let rest: i32 = q
                        .residuals
                        .get(at)
                        .map_or(0, |r| r.iter().map(|&v| v as i32).sum());
                    let want = sum as f32 + rest as f32 / RESIDUAL_STEPS;
                    assert!((want - q.sums[r * 3 + b]).abs() < 1e-3);
                }
            }
            // The padding past K is zero.
            assert!(q.values[2 * BLOCK + 6..3 * BLOCK].iter().all(|&v| v == 0));
        }
    }

    #[test]
    fn extremes_saturate_at_127_and_zeros_stay_zero() {
        let mut x = vec![0.0f32; 64];
        x[0] = -3.0;
        x[1] = 3.0;
        x[2] = -2.9999;
        let q = quantize(&x, 1, 64, Activations::Int8x2).unwrap();
        assert_eq!(&q.values[..3], &[-127, 127, -127]);
        assert!(q.values.iter().chain(&q.residuals).all(|&v| v >= -127));
        assert_eq!(q.scales[1], 0.0);
        assert_eq!(q.sums[1], 0.0);
        assert!(q.residuals[32..].iter().all(|&v| v == 0));
    }

    #[test]
    fn non_finite_input_is_named() {
        let mut x = vec![1.0f32; 40];
        x[33] = f32::NAN;
        let err = quantize(&x, 2, 20, Activations::Int8).unwrap_err();
        assert!(err.to_string().contains("row 1 column 13"), "{err}");
        x[33] = f32::INFINITY;
        assert!(matches!(
            quantize(&x, 2, 20, Activations::Int8x2),
            Err(KernelError::NotFinite(_))
        ));
    }

    #[test]
    fn wrong_length_is_refused() {
        assert!(quantize(&[0.0; 5], 2, 3, Activations::Int8).is_err());
    }
}
