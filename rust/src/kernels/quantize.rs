//! Activations quantized to int8 per block of 32 values with a float scale: x ≈ xq · d, d =
//! max|x| / 127, xq in −127..=127 (never −128, so a negated value still fits). Each block also
//! keeps Σ xq, which carries the weights' zero points out of the int8 loop.

use std::sync::atomic::{AtomicBool, Ordering};

use super::pool::{split, ThreadCount};
use super::KernelError;

/// Values per activation block (and per weight block of the packed layout).
pub const BLOCK: usize = 32;

/// M rows of K activations, quantized. Rows are padded with zeros to whole blocks.
#[derive(Debug, Clone, Default)]
pub struct QuantizedRows {
    pub rows: usize,
    pub blocks: usize,
    /// (rows, blocks, 32) int8 values.
    pub values: Vec<i8>,
    /// (rows, blocks) scales d.
    pub scales: Vec<f32>,
    /// (rows, blocks) Σ xq, as float (exact: at most 32 · 127).
    pub sums: Vec<f32>,
}

impl QuantizedRows {
    pub fn value_ptr(&self, row: usize, block: usize) -> *const i8 {
        self.values[(row * self.blocks + block) * BLOCK..].as_ptr()
    }
}

fn quantize_block(x: &[f32], out: &mut [i8]) -> (f32, f32) {
    // f32::max skips NaN: a block holding a NaN or an infinity gets a NaN scale, and its row
    // is then reported as not finite.
    let finite = x.iter().fold(true, |f, v| f & v.is_finite());
    let amax = x.iter().fold(0.0f32, |a, v| a.max(v.abs())) + if finite { 0.0 } else { f32::NAN };
    let inverse = if amax > 0.0 { 127.0 / amax } else { 0.0 };
    let mut sum = 0i32;
    for (o, v) in out.iter_mut().zip(x) {
        let q = (v * inverse).round_ties_even().clamp(-127.0, 127.0) as i8;
        sum += q as i32;
        *o = q;
    }
    out[x.len()..].fill(0);
    (amax / 127.0, sum as f32)
}

/// Returns false when the row holds a NaN or an infinity.
fn quantize_row(x: &[f32], values: &mut [i8], scales: &mut [f32], sums: &mut [f32]) -> bool {
    let mut finite = true;
    for (b, chunk) in x.chunks(BLOCK).enumerate() {
        let (scale, sum) = quantize_block(chunk, &mut values[b * BLOCK..(b + 1) * BLOCK]);
        finite &= scale.is_finite();
        scales[b] = scale;
        sums[b] = sum;
    }
    finite
}

/// The same loop compiled for AVX2 (rounding and the max vectorise there).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn quantize_row_avx2(x: &[f32], values: &mut [i8], scales: &mut [f32], sums: &mut [f32]) -> bool {
    quantize_row(x, values, scales, sums)
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
    out.rows = m;
    out.blocks = blocks;
    out.values.resize(m * blocks * BLOCK, 0);
    out.scales.resize(m * blocks, 0.0);
    out.sums.resize(m * blocks, 0.0);
    let avx2 = super::Isa::Avx2.supported();
    let values = SharedMut::new(out.values.as_mut_ptr());
    let scales = SharedMut::new(out.scales.as_mut_ptr());
    let sums = SharedMut::new(out.sums.as_mut_ptr());
    let finite = AtomicBool::new(true);
    split(threads, m, |rows| {
        for r in rows {
            // SAFETY: each row's slices are disjoint, and every row goes to one thread only.
            let (v, s, u) = unsafe {
                (
                    std::slice::from_raw_parts_mut(
                        values.get().add(r * blocks * BLOCK),
                        blocks * BLOCK,
                    ),
                    std::slice::from_raw_parts_mut(scales.get().add(r * blocks), blocks),
                    std::slice::from_raw_parts_mut(sums.get().add(r * blocks), blocks),
                )
            };
            let row = &x[r * k..(r + 1) * k];
            #[cfg(target_arch = "x86_64")]
            if avx2 {
                // SAFETY: AVX2 and FMA were detected.
                if !unsafe { quantize_row_avx2(row, v, s, u) } {
                    finite.store(false, Ordering::Relaxed);
                }
                continue;
            }
            let _ = avx2;
            if !quantize_row(row, v, s, u) {
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

    fn quantize(x: &[f32], m: usize, k: usize) -> Result<QuantizedRows, KernelError> {
        let mut out = QuantizedRows::default();
        quantize_rows(x, m, k, ThreadCount::new(2), &mut out).map(|_| out)
    }

    #[test]
    fn round_trip_within_half_a_step() {
        let k = 70; // not a multiple of the block
        let x: Vec<f32> = (0..2 * k)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 7.0)
            .collect();
        let q = quantize(&x, 2, k).unwrap();
        assert_eq!(q.blocks, 3);
        for r in 0..2 {
            for c in 0..k {
                let b = c / BLOCK;
                let d = q.scales[r * 3 + b];
                let back = q.values[(r * 3 + b) * BLOCK + c % BLOCK] as f32 * d;
                assert!((back - x[r * k + c]).abs() <= d * 0.5 + 1e-6);
            }
            for b in 0..3 {
                let block = &q.values[(r * 3 + b) * BLOCK..(r * 3 + b + 1) * BLOCK];
                let sum: i32 = block.iter().map(|&v| v as i32).sum();
                assert_eq!(sum as f32, q.sums[r * 3 + b]);
            }
        }
        // The padding past K is zero.
        assert!(q.values[2 * BLOCK + 6..3 * BLOCK].iter().all(|&v| v == 0));
    }

    #[test]
    fn extremes_saturate_at_127_and_zeros_stay_zero() {
        let mut x = vec![0.0f32; 64];
        x[0] = -3.0;
        x[1] = 3.0;
        x[2] = -2.9999;
        let q = quantize(&x, 1, 64).unwrap();
        assert_eq!(&q.values[..3], &[-127, 127, -127]);
        assert!(q.values.iter().all(|&v| v >= -127));
        assert_eq!(q.scales[1], 0.0);
        assert_eq!(q.sums[1], 0.0);
    }

    #[test]
    fn non_finite_input_is_named() {
        let mut x = vec![1.0f32; 40];
        x[33] = f32::NAN;
        let err = quantize(&x, 2, 20).unwrap_err();
        assert!(err.to_string().contains("row 1 column 13"), "{err}");
        x[33] = f32::INFINITY;
        assert!(matches!(
            quantize(&x, 2, 20),
            Err(KernelError::NotFinite(_))
        ));
    }

    #[test]
    fn wrong_length_is_refused() {
        assert!(quantize(&[0.0; 5], 2, 3).is_err());
    }
}
