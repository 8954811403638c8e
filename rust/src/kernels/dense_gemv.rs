//! y (M, N) = x (M, K) · Wᵀ for dense float32 or bfloat16 weights W (N, K), row-major as torch
//! holds them, for M ≤ 8: every weight byte is read once and used for all M rows, so the time
//! is the weights' bytes over the memory bandwidth. Each thread takes a contiguous range of
//! output rows and walks R of them at once (R streams, M·R accumulators in registers); bfloat16
//! weights are widened to float32 in registers (a 16-bit shift), and the sums are float32.

use super::isa::Isa;
use super::pool::{split, ThreadCount};
use super::quantize::SharedMut;
use super::KernelError;

/// The most rows of x one pass over the weights serves.
pub const DENSE_MAX_M: usize = 8;

/// The weight's element type, with its (N, K) row-major values.
#[derive(Clone, Copy)]
pub enum DenseWeights<'a> {
    F32(&'a [f32]),
    /// bfloat16 bit patterns.
    Bf16(&'a [u16]),
}

impl DenseWeights<'_> {
    fn len(&self) -> usize {
        match self {
            DenseWeights::F32(w) => w.len(),
            DenseWeights::Bf16(w) => w.len(),
        }
    }

    fn at(&self, i: usize) -> f32 {
        match self {
            DenseWeights::F32(w) => w[i],
            DenseWeights::Bf16(w) => f32::from_bits((w[i] as u32) << 16),
        }
    }
}

/// Rows [n0, n0 + R) of the output for all M rows of x: the portable path.
fn rows_scalar(x: &[f32], m: usize, k: usize, w: DenseWeights, n0: usize, rows: usize) -> Vec<f32> {
    let mut y = vec![0f32; m * rows];
    for r in 0..rows {
        for mi in 0..m {
            let xs = &x[mi * k..(mi + 1) * k];
            y[mi * rows + r] = xs
                .iter()
                .enumerate()
                .map(|(c, v)| v * w.at((n0 + r) * k + c))
                .sum();
        }
    }
    y
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    /// Rows [n0, n0 + R) for MR rows of x, AVX-512: 16 columns a step, the tail in scalar code.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn rows_avx512<const MR: usize, const R: usize, const BF16: bool>(
        x: *const f32,
        k: usize,
        w: *const u8,
        n0: usize,
        out: *mut f32,
        n: usize,
    ) {
        let mut acc = [[_mm512_setzero_ps(); R]; MR];
        let whole = k / 16 * 16;
        let row = |r: usize| (n0 + r) * k;
        for c in (0..whole).step_by(16) {
            let mut wv = [_mm512_setzero_ps(); R];
            for (r, v) in wv.iter_mut().enumerate() {
                *v = if BF16 {
                    let half = _mm256_loadu_si256(w.cast::<u16>().add(row(r) + c).cast());
                    _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16))
                } else {
                    _mm512_loadu_ps(w.cast::<f32>().add(row(r) + c))
                };
            }
            for (mi, a) in acc.iter_mut().enumerate() {
                let xv = _mm512_loadu_ps(x.add(mi * k + c));
                for r in 0..R {
                    a[r] = _mm512_fmadd_ps(wv[r], xv, a[r]);
                }
            }
        }
        for (mi, a) in acc.iter().enumerate() {
            for (r, v) in a.iter().enumerate() {
                let mut sum = _mm512_reduce_add_ps(*v);
                for c in whole..k {
                    sum += *x.add(mi * k + c) * weight::<BF16>(w, row(r) + c);
                }
                *out.add(mi * n + n0 + r) = sum;
            }
        }
    }

    /// The same with 8 columns a step, AVX2 + FMA.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn rows_avx2<const MR: usize, const R: usize, const BF16: bool>(
        x: *const f32,
        k: usize,
        w: *const u8,
        n0: usize,
        out: *mut f32,
        n: usize,
    ) {
        let mut acc = [[_mm256_setzero_ps(); R]; MR];
        let whole = k / 8 * 8;
        let row = |r: usize| (n0 + r) * k;
        for c in (0..whole).step_by(8) {
            let mut wv = [_mm256_setzero_ps(); R];
            for (r, v) in wv.iter_mut().enumerate() {
                *v = if BF16 {
                    let half = _mm_loadu_si128(w.cast::<u16>().add(row(r) + c).cast());
                    _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16))
                } else {
                    _mm256_loadu_ps(w.cast::<f32>().add(row(r) + c))
                };
            }
            for (mi, a) in acc.iter_mut().enumerate() {
                let xv = _mm256_loadu_ps(x.add(mi * k + c));
                for r in 0..R {
                    a[r] = _mm256_fmadd_ps(wv[r], xv, a[r]);
                }
            }
        }
        for (mi, a) in acc.iter().enumerate() {
            for (r, v) in a.iter().enumerate() {
                let halves = _mm_add_ps(_mm256_castps256_ps128(*v), _mm256_extractf128_ps(*v, 1));
                let pairs = _mm_add_ps(halves, _mm_movehl_ps(halves, halves));
                let one = _mm_add_ss(pairs, _mm_shuffle_ps(pairs, pairs, 1));
                let mut sum = _mm_cvtss_f32(one);
                for c in whole..k {
                    sum += *x.add(mi * k + c) * weight::<BF16>(w, row(r) + c);
                }
                *out.add(mi * n + n0 + r) = sum;
            }
        }
    }

    #[inline(always)]
    unsafe fn weight<const BF16: bool>(w: *const u8, i: usize) -> f32 {
        if BF16 {
            f32::from_bits((*w.cast::<u16>().add(i) as u32) << 16)
        } else {
            *w.cast::<f32>().add(i)
        }
    }
}

/// A row-group kernel: rows [n0, n0 + R) of out for MR rows of x.
#[cfg(target_arch = "x86_64")]
type RowsFn = unsafe fn(*const f32, usize, *const u8, usize, *mut f32, usize);

#[cfg(target_arch = "x86_64")]
macro_rules! by_m {
    ($f:ident, $m:expr, $bf16:literal, $r_small:literal, $r_large:literal) => {
        match $m {
            1 => $f::<1, $r_small, $bf16> as RowsFn,
            2 => $f::<2, $r_small, $bf16>,
            3 => $f::<3, $r_small, $bf16>,
            4 => $f::<4, $r_small, $bf16>,
            5 => $f::<5, $r_large, $bf16>,
            6 => $f::<6, $r_large, $bf16>,
            7 => $f::<7, $r_large, $bf16>,
            _ => $f::<8, $r_large, $bf16>,
        }
    };
}

/// The kernel and its R (output rows per pass) for M rows on `isa`; None: the portable path.
#[cfg(target_arch = "x86_64")]
fn rows_fn(isa: Isa, m: usize, bf16: bool) -> Option<(RowsFn, usize)> {
    use x86::{rows_avx2, rows_avx512};
    // AVX-512: 32 registers, M·R ≤ 16 accumulators; AVX2: 16 registers, M·R ≤ 8.
    match (isa, bf16) {
        (Isa::Avx512Vnni, false) => Some((
            by_m!(rows_avx512, m, false, 4, 2),
            if m <= 4 { 4 } else { 2 },
        )),
        (Isa::Avx512Vnni, true) => Some((
            by_m!(rows_avx512, m, true, 4, 2),
            if m <= 4 { 4 } else { 2 },
        )),
        (Isa::Avx2 | Isa::AvxVnni, false) => {
            Some((by_m!(rows_avx2, m, false, 2, 1), if m <= 4 { 2 } else { 1 }))
        }
        (Isa::Avx2 | Isa::AvxVnni, true) => {
            Some((by_m!(rows_avx2, m, true, 2, 1), if m <= 4 { 2 } else { 1 }))
        }
        (Isa::Scalar, _) => None,
    }
}

/// The checks `dense_gemv` and `dense_gemm` share: the CPU runs `isa`, x (m, k), W (n, k) and
/// out (m, n) hold their shapes, and every activation is finite.
#[allow(clippy::too_many_arguments)]
fn check_dense_call(
    op: &str,
    x: &[f32],
    m: usize,
    k: usize,
    w_len: usize,
    n: usize,
    out_len: usize,
    isa: Isa,
) -> Result<(), KernelError> {
    if !isa.supported() {
        return Err(KernelError::InvalidArgument(format!(
            "this CPU cannot run {isa}"
        )));
    }
    if x.len() != m * k || w_len != n * k || out_len != m * n {
        return Err(KernelError::InvalidArgument(format!(
            "dense {op}: x ({}), W ({w_len}) and out ({out_len}) do not hold ({m}, {k}), ({n}, {k}), ({m}, {n})",
            x.len()
        )));
    }
    if let Some(i) = x.iter().position(|v| !v.is_finite()) {
        return Err(KernelError::NotFinite(format!(
            "activation row {} column {} is {} (the dense {op} takes finite inputs only)",
            i / k,
            i % k,
            x[i]
        )));
    }
    Ok(())
}

/// out (m, n) = x (m, k) · Wᵀ for m ≤ DENSE_MAX_M, on `isa` (supported).
#[allow(clippy::too_many_arguments)]
pub fn dense_gemv(
    x: &[f32],
    m: usize,
    k: usize,
    w: DenseWeights,
    n: usize,
    out: &mut [f32],
    isa: Isa,
    threads: ThreadCount,
) -> Result<(), KernelError> {
    if m > DENSE_MAX_M {
        return Err(KernelError::InvalidArgument(format!(
            "dense GEMV takes at most {DENSE_MAX_M} rows, got {m}"
        )));
    }
    check_dense_call("GEMV", x, m, k, w.len(), n, out.len(), isa)?;
    if m == 0 || n == 0 {
        return Ok(());
    }
    let out_ptr = SharedMut::new(out.as_mut_ptr());
    #[cfg(target_arch = "x86_64")]
    if let Some((kernel, r)) = rows_fn(isa, m, matches!(w, DenseWeights::Bf16(_))) {
        let w_ptr = match w {
            DenseWeights::F32(w) => w.as_ptr().cast::<u8>(),
            DenseWeights::Bf16(w) => w.as_ptr().cast::<u8>(),
        } as usize;
        let groups = n / r;
        split(threads, groups, |range| {
            for g in range {
                // SAFETY: the ISA is supported; rows [g·r, g·r + r) < n are in bounds, and this
                // thread alone writes those columns of out.
                unsafe { kernel(x.as_ptr(), k, w_ptr as *const u8, g * r, out_ptr.get(), n) };
            }
        });
        write_rows(x, m, k, w, groups * r, n - groups * r, out_ptr, n);
        return Ok(());
    }
    split(threads, n, |range| {
        write_rows(x, m, k, w, range.start, range.len(), out_ptr, n);
    });
    Ok(())
}

/// Weight bytes of one panel of `dense_gemm`: rows of W read once for every row of x while
/// they stay in L2.
const GEMM_PANEL_BYTES: usize = 1 << 17;

/// out (m, n) = x (m, k) · Wᵀ for any m (prefill): the output rows are split over the threads
/// in groups of 4; each thread walks its rows a panel at a time (about `GEMM_PANEL_BYTES` of
/// weights) and runs every DENSE_MAX_M rows of x over the panel, so the weights are read from
/// memory once per call rather than once per DENSE_MAX_M rows. m ≤ DENSE_MAX_M is `dense_gemv`.
#[allow(clippy::too_many_arguments)]
pub fn dense_gemm(
    x: &[f32],
    m: usize,
    k: usize,
    w: DenseWeights,
    n: usize,
    out: &mut [f32],
    isa: Isa,
    threads: ThreadCount,
) -> Result<(), KernelError> {
    if m <= DENSE_MAX_M {
        return dense_gemv(x, m, k, w, n, out, isa, threads);
    }
    check_dense_call("GEMM", x, m, k, w.len(), n, out.len(), isa)?;
    if n == 0 {
        return Ok(());
    }
    let out_ptr = SharedMut::new(out.as_mut_ptr());
    #[cfg(target_arch = "x86_64")]
    if rows_fn(isa, 1, false).is_some() {
        const GROUP: usize = 4; // every kernel's R divides it
        let bf16 = matches!(w, DenseWeights::Bf16(_));
        let w_ptr = match w {
            DenseWeights::F32(w) => w.as_ptr().cast::<u8>(),
            DenseWeights::Bf16(w) => w.as_ptr().cast::<u8>(),
        } as usize;
        let row_bytes = k * if bf16 { 2 } else { 4 };
        let panel = (GEMM_PANEL_BYTES / (GROUP * row_bytes).max(1)).max(1);
        let groups = n / GROUP;
        split(threads, groups, |range| {
            let mut start = range.start;
            while start < range.end {
                let end = (start + panel).min(range.end);
                for m0 in (0..m).step_by(DENSE_MAX_M) {
                    let rows = DENSE_MAX_M.min(m - m0);
                    let (kernel, r) = rows_fn(isa, rows, bf16).expect("checked above");
                    for n0 in (start * GROUP..end * GROUP).step_by(r) {
                        // SAFETY: the ISA is supported; rows m0..m0 + rows of x and output
                        // columns [n0, n0 + r) < n are in bounds, and only this thread writes
                        // those columns.
                        unsafe {
                            kernel(
                                x.as_ptr().add(m0 * k),
                                k,
                                w_ptr as *const u8,
                                n0,
                                out_ptr.get().add(m0 * n),
                                n,
                            )
                        };
                    }
                }
                start = end;
            }
        });
        write_rows(x, m, k, w, groups * GROUP, n - groups * GROUP, out_ptr, n);
        return Ok(());
    }
    split(threads, n, |range| {
        write_rows(x, m, k, w, range.start, range.len(), out_ptr, n);
    });
    Ok(())
}

/// The portable path for output rows [n0, n0 + rows), written into out (m, n).
#[allow(clippy::too_many_arguments)]
fn write_rows(
    x: &[f32],
    m: usize,
    k: usize,
    w: DenseWeights,
    n0: usize,
    rows: usize,
    out: SharedMut<f32>,
    n: usize,
) {
    let y = rows_scalar(x, m, k, w, n0, rows);
    for mi in 0..m {
        for r in 0..rows {
            // SAFETY: out holds m·n values; these columns belong to this caller alone.
            unsafe { *out.get().add(mi * n + n0 + r) = y[mi * rows + r] };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn values(count: usize, seed: u32) -> Vec<f32> {
        (0..count)
            .map(|i| (((i as u32).wrapping_mul(2654435761) ^ seed) % 2001) as f32 / 1000.0 - 1.0)
            .collect()
    }

    #[test]
    fn every_path_matches_the_f64_sum() {
        for (n, k) in [(1, 1), (7, 33), (37, 200), (64, 1000), (5, 16)] {
            for m in 1..=DENSE_MAX_M {
                let x = values(m * k, 1);
                let w32 = values(n * k, 2);
                let w16: Vec<u16> = w32.iter().map(|v| (v.to_bits() >> 16) as u16).collect();
                for (w, bf16) in [
                    (DenseWeights::F32(&w32), false),
                    (DenseWeights::Bf16(&w16), true),
                ] {
                    for isa in Isa::supported_paths() {
                        for threads in [1, 3] {
                            let mut y = vec![f32::NAN; m * n];
                            dense_gemv(&x, m, k, w, n, &mut y, isa, ThreadCount::new(threads))
                                .unwrap();
                            for mi in 0..m {
                                for o in 0..n {
                                    let (mut want, mut mag) = (0f64, 0f64);
                                    for c in 0..k {
                                        let wv = w.at(o * k + c) as f64;
                                        want += x[mi * k + c] as f64 * wv;
                                        mag += (x[mi * k + c] as f64 * wv).abs();
                                    }
                                    let got = y[mi * n + o] as f64;
                                    assert!(
                                        (got - want).abs() <= 1e-5 * mag + 1e-6,
                                        "{isa} bf16={bf16} n={n} k={k} m={m}: y[{mi}, {o}] = {got}, want {want}"
                                    );
                                }
                            }
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn gemm_matches_the_gemv_row_chunks() {
        for (m, n, k) in [(9, 7, 33), (20, 37, 200), (17, 64, 1000)] {
            let x = values(m * k, 3);
            let w32 = values(n * k, 4);
            let w16: Vec<u16> = w32.iter().map(|v| (v.to_bits() >> 16) as u16).collect();
            for w in [DenseWeights::F32(&w32), DenseWeights::Bf16(&w16)] {
                for isa in Isa::supported_paths() {
                    let mut want = vec![0f32; m * n];
                    for m0 in (0..m).step_by(DENSE_MAX_M) {
                        let rows = DENSE_MAX_M.min(m - m0);
                        let (xs, ys) = (
                            &x[m0 * k..(m0 + rows) * k],
                            &mut want[m0 * n..(m0 + rows) * n],
                        );
                        dense_gemv(xs, rows, k, w, n, ys, isa, ThreadCount::new(1)).unwrap();
                    }
                    for threads in [1, 3] {
                        let mut y = vec![f32::NAN; m * n];
                        dense_gemm(&x, m, k, w, n, &mut y, isa, ThreadCount::new(threads)).unwrap();
                        for (i, (a, b)) in y.iter().zip(&want).enumerate() {
                            assert!(
                                (a - b).abs() <= 1e-4 * (1.0 + b.abs()),
                                "{isa} m={m} n={n} k={k} [{i}]: {a} against {b}"
                            );
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn bad_arguments_are_named() {
        let w = vec![0f32; 8];
        let mut y = vec![0f32; 9 * 2];
        let x = vec![0f32; 9 * 4];
        let err = dense_gemv(
            &x,
            9,
            4,
            DenseWeights::F32(&w),
            2,
            &mut y,
            Isa::Scalar,
            ThreadCount::new(1),
        );
        assert!(err.unwrap_err().to_string().contains("at most 8"));
        let mut x = vec![0f32; 4];
        x[3] = f32::NAN;
        let err = dense_gemv(
            &x,
            1,
            4,
            DenseWeights::F32(&w),
            2,
            &mut y[..2],
            Isa::Scalar,
            ThreadCount::new(1),
        );
        assert!(matches!(err, Err(KernelError::NotFinite(_))));
    }
}
