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
/// Blocks to quantize below which one thread does them all: about 25 µs of AVX-512 work, more
/// than a decode step's 8 rows hold and less than a 128-token prompt's.
const PARALLEL_BLOCKS: usize = 2048;
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
    /// Int8x2: (rows, blocks) d / 254, the second terms' scales; empty otherwise.
    pub residual_scales: Vec<f32>,
    /// (rows, blocks) d · Σ xq (+ d · Σ xr / 254 with the second terms): what the weights'
    /// zero points multiply.
    pub scaled_sums: Vec<f32>,
    /// (rows, blocks, terms) Σ xq, then Σ xr with the second terms (terms = 2).
    pub sums: Vec<i32>,
}

impl QuantizedRows {
    pub fn split(&self) -> bool {
        !self.residuals.is_empty()
    }
}

/// Where a row's values come from, block by block: a row of x as it is, or values computed as
/// they are quantized (`norm_quantize`: the RMSNorm's output, never written in float32).
/// Inlined into the row path's instructions (`RowPath`), with everything it computes.
pub(super) trait RowSource {
    /// Hands each block b of the row, in order, to `row.block(b, values)` (the last block may
    /// be short).
    fn blocks<B: BlockFn>(self, row: &mut RowQuantizer<'_, B>);
}

impl RowSource for &[f32] {
    #[inline(always)]
    fn blocks<B: BlockFn>(self, row: &mut RowQuantizer<'_, B>) {
        for (b, chunk) in self.chunks(BLOCK).enumerate() {
            row.block(b, chunk);
        }
    }
}

/// Quantizes one block as `quantize_block` does (values, second terms when wanted).
pub(super) trait BlockFn: Fn(&[f32], &mut [i8], Option<&mut [i8]>) -> BlockSums {}

impl<F: Fn(&[f32], &mut [i8], Option<&mut [i8]>) -> BlockSums> BlockFn for F {}

/// A row's outputs, filled block by block (`RowSource::blocks`).
pub(super) struct RowQuantizer<'a, B> {
    out: RowOut<'a>,
    terms: usize,
    finite: bool,
    quantize: B,
}

impl<B: BlockFn> RowQuantizer<'_, B> {
    /// Quantizes block `b` of the row, `chunk` its values.
    #[inline(always)]
    pub(super) fn block(&mut self, b: usize, chunk: &[f32]) {
        let out = &mut self.out;
        let terms = self.terms;
        let at = b * BLOCK..(b + 1) * BLOCK;
        let rest = out.residuals.as_deref_mut().map(|r| &mut r[at.clone()]);
        let BlockSums {
            scale,
            sum,
            residual_sum,
        } = (self.quantize)(chunk, &mut out.values[at], rest);
        self.finite &= scale.is_finite();
        out.scales[b] = scale;
        out.sums[b * terms] = sum;
        if let Some(r) = out.residual_scales.as_deref_mut() {
            r[b] = scale / RESIDUAL_STEPS;
            out.sums[b * terms + 1] = residual_sum;
            out.scaled_sums[b] = scale * (sum as f32 + residual_sum as f32 / RESIDUAL_STEPS);
        } else {
            out.scaled_sums[b] = scale * sum as f32;
        }
    }
}

/// One row's share of the outputs.
pub(super) struct RowOut<'a> {
    values: &'a mut [i8],
    residuals: Option<&'a mut [i8]>,
    scales: &'a mut [f32],
    residual_scales: Option<&'a mut [f32]>,
    scaled_sums: &'a mut [f32],
    sums: &'a mut [i32],
}

/// A block's scale d and the sums of its int8 terms (Σ xr = 0 without the second terms).
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct BlockSums {
    scale: f32,
    sum: i32,
    residual_sum: i32,
}

/// Quantizes one block. `residuals`: the second terms, when wanted. Inlined into the
/// AVX2 copy of the row loop (no call per value where it is compiled for the baseline).
#[inline(always)]
fn quantize_block(x: &[f32], out: &mut [i8], residuals: Option<&mut [i8]>) -> BlockSums {
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
    let scale = amax / 127.0;
    let Some(residuals) = residuals else {
        return BlockSums {
            scale,
            sum,
            residual_sum: 0,
        };
    };
    let mut residual_sum = 0i32;
    for ((r, v), &q) in residuals.iter_mut().zip(x).zip(out.iter()) {
        let rest = (v * inverse - q as f32) * RESIDUAL_STEPS;
        let q = super::round_small(rest).clamp(-127.0, 127.0) as i8;
        residual_sum += q as i32;
        *r = q;
    }
    residuals[x.len()..].fill(0);
    BlockSums {
        scale,
        sum,
        residual_sum,
    }
}

/// Returns false when the row holds a NaN or an infinity. `block` quantizes one block as
/// `quantize_block` does.
#[inline(always)]
fn quantize_row<S: RowSource>(x: S, out: RowOut<'_>, block: impl BlockFn) -> bool {
    let terms = if out.residuals.is_some() { 2 } else { 1 };
    let mut row = RowQuantizer {
        out,
        terms,
        finite: true,
        quantize: block,
    };
    x.blocks(&mut row);
    row.finite
}

/// The instructions a row is quantized with: every path gives the same bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum RowPath {
    Portable,
    /// The portable loop compiled for AVX2 (rounding and the max vectorise there).
    Avx2,
    /// `x86::quantize_block_avx512`: a block is two registers.
    Avx512,
}

impl RowPath {
    pub(super) fn best() -> RowPath {
        if super::Isa::Avx512Vnni.supported() {
            RowPath::Avx512
        } else if super::Isa::Avx2.supported() {
            RowPath::Avx2
        } else {
            RowPath::Portable
        }
    }

    /// Every path available on this CPU, the portable one first.
    #[cfg(test)]
    pub(super) fn available() -> Vec<RowPath> {
        let mut paths = vec![RowPath::Portable];
        if super::Isa::Avx2.supported() {
            paths.push(RowPath::Avx2);
        }
        if super::Isa::Avx512Vnni.supported() {
            paths.push(RowPath::Avx512);
        }
        paths
    }

    fn quantize<S: RowSource>(self, x: S, out: RowOut<'_>) -> bool {
        match self {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `best` found AVX-512 F and BW (AVX-512 VNNI implies them).
            RowPath::Avx512 => unsafe { x86::quantize_row_avx512(x, out) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `best` found AVX2 and FMA.
            RowPath::Avx2 => unsafe { x86::quantize_row_avx2(x, out) },
            _ => quantize_row(x, out, quantize_block),
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::{quantize_block, quantize_row, BlockSums, RowOut, RowSource, RESIDUAL_STEPS};

    #[target_feature(enable = "avx2,fma")]
    pub(super) fn quantize_row_avx2<S: RowSource>(x: S, out: RowOut<'_>) -> bool {
        quantize_row(x, out, quantize_block)
    }

    #[target_feature(enable = "avx512f,avx512bw")]
    pub(super) fn quantize_row_avx512<S: RowSource>(x: S, out: RowOut<'_>) -> bool {
        // SAFETY: this function has the block's features.
        quantize_row(x, out, |x, o, r| unsafe { quantize_block_avx512(x, o, r) })
    }

    /// `quantize_block` with the same operations in the same order, 16 lanes at a time; a
    /// block holding a NaN or an infinity goes to `quantize_block` itself.
    #[target_feature(enable = "avx512f,avx512bw")]
    unsafe fn quantize_block_avx512(
        x: &[f32],
        out: &mut [i8],
        residuals: Option<&mut [i8]>,
    ) -> BlockSums {
        let lanes = |from: usize| match x.len().saturating_sub(from) {
            0 => 0u16,
            n if n >= 16 => u16::MAX,
            n => (1u16 << n) - 1,
        };
        let v = [
            _mm512_maskz_loadu_ps(lanes(0), x.as_ptr()),
            _mm512_maskz_loadu_ps(lanes(16), x.as_ptr().wrapping_add(16)),
        ];
        let magnitude = [_mm512_abs_ps(v[0]), _mm512_abs_ps(v[1])];
        // Ordered compares: false for a NaN, which `max` would drop.
        let infinity = _mm512_set1_ps(f32::INFINITY);
        let finite = _mm512_cmp_ps_mask::<_CMP_LT_OQ>(magnitude[0], infinity)
            & _mm512_cmp_ps_mask::<_CMP_LT_OQ>(magnitude[1], infinity);
        if finite != u16::MAX {
            return quantize_block(x, out, residuals);
        }
        let amax = _mm512_reduce_max_ps(_mm512_max_ps(magnitude[0], magnitude[1]));
        let inverse = _mm512_set1_ps(if amax > 0.0 { 127.0 / amax } else { 0.0 });
        let (low, high) = (_mm512_set1_epi32(-127), _mm512_set1_epi32(127));
        let round = |v: __m512| {
            let q =
                _mm512_cvt_roundps_epi32::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(v);
            _mm512_max_epi32(_mm512_min_epi32(q, high), low)
        };
        let scaled = [_mm512_mul_ps(v[0], inverse), _mm512_mul_ps(v[1], inverse)];
        let q = [round(scaled[0]), round(scaled[1])];
        let out = out[..32].as_mut_ptr() as *mut __m128i;
        _mm_storeu_si128(out, _mm512_cvtepi32_epi8(q[0]));
        _mm_storeu_si128(out.add(1), _mm512_cvtepi32_epi8(q[1]));
        let sum = _mm512_reduce_add_epi32(_mm512_add_epi32(q[0], q[1]));
        let scale = amax / 127.0;
        let Some(residuals) = residuals else {
            return BlockSums {
                scale,
                sum,
                residual_sum: 0,
            };
        };
        let steps = _mm512_set1_ps(RESIDUAL_STEPS);
        let rest = [0, 1].map(|i| {
            let lost = _mm512_sub_ps(scaled[i], _mm512_cvtepi32_ps(q[i]));
            round(_mm512_mul_ps(lost, steps))
        });
        let residuals = residuals[..32].as_mut_ptr() as *mut __m128i;
        _mm_storeu_si128(residuals, _mm512_cvtepi32_epi8(rest[0]));
        _mm_storeu_si128(residuals.add(1), _mm512_cvtepi32_epi8(rest[1]));
        let residual_sum = _mm512_reduce_add_epi32(_mm512_add_epi32(rest[0], rest[1]));
        BlockSums {
            scale,
            sum,
            residual_sum,
        }
    }
}

/// The error for the first value of `x` (rows of `k`) that is not finite (Ok if none is).
pub(super) fn check_finite(x: impl Iterator<Item = f32>, k: usize) -> Result<(), KernelError> {
    match x.enumerate().find(|(_, v)| !v.is_finite()) {
        None => Ok(()),
        Some((i, v)) => Err(KernelError::NotFinite(format!(
            "activation row {} column {} is {v} (the int8 kernels take finite inputs only)",
            i / k,
            i % k,
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
    let path = RowPath::best();
    if quantize_rows_from(path, m, k, activations, threads, out, |r| {
        &x[r * k..(r + 1) * k]
    }) {
        Ok(())
    } else {
        check_finite(x.iter().copied(), k)
    }
}

/// Rows 0..m of k values, row r's from `row(r)` (called once per row, on the thread that
/// quantizes it), quantized on `path` into `out`. Returns false when a row is not finite.
pub(super) fn quantize_rows_from<S: RowSource>(
    path: RowPath,
    m: usize,
    k: usize,
    activations: Activations,
    threads: ThreadCount,
    out: &mut QuantizedRows,
    row: impl Fn(usize) -> S + Sync,
) -> bool {
    let blocks = k.div_ceil(BLOCK);
    let split_terms = activations == Activations::Int8x2;
    out.rows = m;
    out.blocks = blocks;
    out.values.resize(m * blocks * BLOCK, 0);
    out.residuals
        .resize(if split_terms { m * blocks * BLOCK } else { 0 }, 0);
    out.scales.resize(m * blocks, 0.0);
    out.residual_scales
        .resize(if split_terms { m * blocks } else { 0 }, 0.0);
    out.scaled_sums.resize(m * blocks, 0.0);
    let terms = if split_terms { 2 } else { 1 };
    out.sums.resize(m * blocks * terms, 0);
    let values = SharedMut::new(out.values.as_mut_ptr());
    let residuals = SharedMut::new(out.residuals.as_mut_ptr());
    let scales = SharedMut::new(out.scales.as_mut_ptr());
    let residual_scales = SharedMut::new(out.residual_scales.as_mut_ptr());
    let scaled_sums = SharedMut::new(out.scaled_sums.as_mut_ptr());
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
                    residual_scales: split_terms.then(|| {
                        std::slice::from_raw_parts_mut(
                            residual_scales.get().add(r * blocks),
                            blocks,
                        )
                    }),
                    scaled_sums: std::slice::from_raw_parts_mut(
                        scaled_sums.get().add(r * blocks),
                        blocks,
                    ),
                    sums: std::slice::from_raw_parts_mut(
                        sums.get().add(r * blocks * terms),
                        blocks * terms,
                    ),
                }
            };
            if !path.quantize(row(r), row_out) {
                finite.store(false, Ordering::Relaxed);
            }
        }
    });
    finite.load(Ordering::Relaxed)
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
                    let d = q.scales[r * 3 + b];
                    assert!((want * d - q.scaled_sums[r * 3 + b]).abs() < 1e-3 * d);
                    let terms = if q.split() { 2 } else { 1 };
                    assert_eq!(q.sums[(r * 3 + b) * terms], sum);
                    if q.split() {
                        assert_eq!(q.sums[(r * 3 + b) * 2 + 1], rest);
                    }
                    if q.split() {
                        assert_eq!(q.residual_scales[r * 3 + b], d / RESIDUAL_STEPS);
                    }
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
        assert_eq!(q.scaled_sums[1], 0.0);
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

    /// One row through `path`: its bytes, and the bits of its scales, second scales and sums.
    fn row_with(path: RowPath, x: &[f32], split: bool) -> (Vec<i8>, Vec<i8>, Vec<Vec<u32>>) {
        let blocks = x.len().div_ceil(BLOCK);
        let (mut values, mut residuals) = (vec![1i8; blocks * BLOCK], vec![1i8; blocks * BLOCK]);
        let mut floats = [vec![0f32; blocks], vec![0f32; blocks], vec![0f32; blocks]];
        let [scales, residual_scales, scaled_sums] = &mut floats;
        let mut sums = vec![0i32; 2 * blocks];
        let out = RowOut {
            values: &mut values,
            residuals: split.then_some(&mut residuals[..]),
            scales,
            residual_scales: split.then_some(&mut residual_scales[..]),
            scaled_sums,
            sums: &mut sums,
        };
        assert!(path.quantize(x, out));
        let mut bits: Vec<Vec<u32>> = floats
            .map(|v| v.into_iter().map(f32::to_bits).collect())
            .to_vec();
        bits.push(sums.into_iter().map(|v| v as u32).collect());
        (values, residuals, bits)
    }

    #[test]
    fn every_row_path_gives_the_same_bytes() {
        let k = 3 * BLOCK + 11; // a partial last block
        let mut x: Vec<f32> = (0..k)
            .map(|i| ((i * 7919 % 1009) as f32 - 504.0) * 0.0137)
            .collect();
        x[BLOCK..2 * BLOCK].fill(0.0);
        // Ties: amax 127 makes the scale 1, so these sit half-way between two steps.
        let ties = [127.0, 2.5, -3.5, 0.5, -0.5, 126.5, -126.5, 1.5];
        x[2 * BLOCK..2 * BLOCK + ties.len()].copy_from_slice(&ties);
        x[7] = 3.0e30;
        let paths = RowPath::available();
        for split in [false, true] {
            for len in [k, 5, BLOCK, 17] {
                let want = row_with(RowPath::Portable, &x[..len], split);
                for &path in &paths {
                    assert_eq!(row_with(path, &x[..len], split), want, "{path:?} {len}");
                }
            }
        }
    }
}
