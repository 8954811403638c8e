//! The float32 vectors a decode row's attention works on (`paged_decode_x86.rs`): 16 lanes with
//! AVX-512, 8 with AVX2 + FMA, and the cache rows read into them. One kernel is written over
//! `Lanes`; each width is compiled into it where its wrapper enables the CPU features.

use std::arch::x86_64::*;

use super::paged_attention::{Bf16Rows, F32Rows, Int8Rows, Rows, Scale};

/// A vector of `N` float32 lanes.
pub(super) trait Lanes: Copy {
    const N: usize;
    unsafe fn zero() -> Self;
    unsafe fn splat(x: f32) -> Self;
    /// N values from `p`.
    unsafe fn load(p: *const f32) -> Self;
    /// N values to `p`.
    unsafe fn store(self, p: *mut f32);
    unsafe fn add(self, o: Self) -> Self;
    unsafe fn sub(self, o: Self) -> Self;
    unsafe fn mul(self, o: Self) -> Self;
    unsafe fn div(self, o: Self) -> Self;
    unsafe fn max(self, o: Self) -> Self;
    unsafe fn min(self, o: Self) -> Self;
    /// self · b + c, rounded once.
    unsafe fn fma(self, b: Self, c: Self) -> Self;
    /// 2^n for lanes holding whole numbers n in [-127, 128] (built in the exponent's bits).
    unsafe fn pow2(n: Self) -> Self;
    /// Lane i is the sum of `parts[i]`'s lanes (i < N; the other parts are not read).
    unsafe fn fold(parts: &[Self; 16]) -> Self;
}

/// 16 float32 lanes (AVX-512F).
#[derive(Clone, Copy)]
pub(super) struct W16(__m512);

/// 8 float32 lanes (AVX2 + FMA).
#[derive(Clone, Copy)]
pub(super) struct W8(__m256);

macro_rules! lanes_ops {
    ($w:ident, $n:literal, $features:literal, $set1:ident, $zero:ident, $loadu:ident,
     $storeu:ident, $add:ident, $sub:ident, $mul:ident, $div:ident, $max:ident, $min:ident,
     $fmadd:ident) => {
        impl Lanes for $w {
            const N: usize = $n;
            #[inline]
            #[target_feature(enable = $features)]
            unsafe fn zero() -> Self {
                $w($zero())
            }
            #[inline]
            #[target_feature(enable = $features)]
            unsafe fn splat(x: f32) -> Self {
                $w($set1(x))
            }
            #[inline]
            #[target_feature(enable = $features)]
            unsafe fn load(p: *const f32) -> Self {
                $w($loadu(p))
            }
            #[inline]
            #[target_feature(enable = $features)]
            unsafe fn store(self, p: *mut f32) {
                $storeu(p, self.0)
            }
            #[inline]
            #[target_feature(enable = $features)]
            unsafe fn add(self, o: Self) -> Self {
                $w($add(self.0, o.0))
            }
            #[inline]
            #[target_feature(enable = $features)]
            unsafe fn sub(self, o: Self) -> Self {
                $w($sub(self.0, o.0))
            }
            #[inline]
            #[target_feature(enable = $features)]
            unsafe fn mul(self, o: Self) -> Self {
                $w($mul(self.0, o.0))
            }
            #[inline]
            #[target_feature(enable = $features)]
            unsafe fn div(self, o: Self) -> Self {
                $w($div(self.0, o.0))
            }
            #[inline]
            #[target_feature(enable = $features)]
            unsafe fn max(self, o: Self) -> Self {
                $w($max(self.0, o.0))
            }
            #[inline]
            #[target_feature(enable = $features)]
            unsafe fn min(self, o: Self) -> Self {
                $w($min(self.0, o.0))
            }
            #[inline]
            #[target_feature(enable = $features)]
            unsafe fn fma(self, b: Self, c: Self) -> Self {
                $w($fmadd(self.0, b.0, c.0))
            }
            #[inline]
            #[target_feature(enable = $features)]
            unsafe fn pow2(n: Self) -> Self {
                <Self as WidthOps>::pow2_bits(n)
            }
            #[inline]
            #[target_feature(enable = $features)]
            unsafe fn fold(parts: &[Self; 16]) -> Self {
                <Self as WidthOps>::fold_lanes(parts)
            }
        }
    };
}

lanes_ops!(
    W16,
    16,
    "avx512f",
    _mm512_set1_ps,
    _mm512_setzero_ps,
    _mm512_loadu_ps,
    _mm512_storeu_ps,
    _mm512_add_ps,
    _mm512_sub_ps,
    _mm512_mul_ps,
    _mm512_div_ps,
    _mm512_max_ps,
    _mm512_min_ps,
    _mm512_fmadd_ps
);
lanes_ops!(
    W8,
    8,
    "avx2,fma",
    _mm256_set1_ps,
    _mm256_setzero_ps,
    _mm256_loadu_ps,
    _mm256_storeu_ps,
    _mm256_add_ps,
    _mm256_sub_ps,
    _mm256_mul_ps,
    _mm256_div_ps,
    _mm256_max_ps,
    _mm256_min_ps,
    _mm256_fmadd_ps
);

/// Width-specific bodies of `pow2` and `fold`.
trait WidthOps: Sized {
    unsafe fn pow2_bits(self) -> Self;
    unsafe fn fold_lanes(parts: &[Self; 16]) -> Self;
}

impl WidthOps for W16 {
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn pow2_bits(self) -> Self {
        let bits = _mm512_slli_epi32::<23>(_mm512_add_epi32(
            _mm512_cvttps_epi32(self.0),
            _mm512_set1_epi32(127),
        ));
        W16(_mm512_castsi512_ps(bits))
    }

    /// A tree of shuffles and adds (45 instructions for 16 registers).
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn fold_lanes(v: &[Self; 16]) -> Self {
        // Pairs: per 128-bit lane, register a's partial sums at 0 and 2, register b's at 1 and 3.
        let mut b = [_mm512_setzero_ps(); 8];
        for i in 0..8 {
            let (x, y) = (v[2 * i].0, v[2 * i + 1].0);
            b[i] = _mm512_add_ps(_mm512_unpacklo_ps(x, y), _mm512_unpackhi_ps(x, y));
        }
        // Fours: per 128-bit lane, registers 4i..4i+4 in order (one partial sum per 128-bit lane).
        let mut c = [_mm512_setzero_ps(); 4];
        for i in 0..4 {
            let (x, y) = (b[2 * i], b[2 * i + 1]);
            c[i] = _mm512_add_ps(
                _mm512_shuffle_ps::<0x44>(x, y),
                _mm512_shuffle_ps::<0xEE>(x, y),
            );
        }
        // Eights: 128-bit lanes of registers 8i..8i+4 and 8i+4..8i+8, their halves added.
        let mut d = [_mm512_setzero_ps(); 2];
        for i in 0..2 {
            let (x, y) = (c[2 * i], c[2 * i + 1]);
            d[i] = _mm512_add_ps(
                _mm512_shuffle_f32x4::<0x88>(x, y),
                _mm512_shuffle_f32x4::<0xDD>(x, y),
            );
        }
        W16(_mm512_add_ps(
            _mm512_shuffle_f32x4::<0x88>(d[0], d[1]),
            _mm512_shuffle_f32x4::<0xDD>(d[0], d[1]),
        ))
    }
}

impl WidthOps for W8 {
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn pow2_bits(self) -> Self {
        let bits = _mm256_slli_epi32::<23>(_mm256_add_epi32(
            _mm256_cvttps_epi32(self.0),
            _mm256_set1_epi32(127),
        ));
        W8(_mm256_castsi256_ps(bits))
    }

    /// Three rounds of horizontal adds, then the 128-bit halves added.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn fold_lanes(v: &[Self; 16]) -> Self {
        let h01 = _mm256_hadd_ps(v[0].0, v[1].0);
        let h23 = _mm256_hadd_ps(v[2].0, v[3].0);
        let h45 = _mm256_hadd_ps(v[4].0, v[5].0);
        let h67 = _mm256_hadd_ps(v[6].0, v[7].0);
        // Per 128-bit half: registers 0..4 (and 4..8), each one partial sum.
        let (lo, hi) = (_mm256_hadd_ps(h01, h23), _mm256_hadd_ps(h45, h67));
        W8(_mm256_add_ps(
            _mm256_permute2f128_ps::<0x20>(lo, hi),
            _mm256_permute2f128_ps::<0x31>(lo, hi),
        ))
    }
}

/// Cached rows read `V::N` values at a time as float32 (an int8 row unscaled; `RowScales`
/// gives its scales).
pub(super) trait LaneRows<V: Lanes>: RowScales {
    /// N values of K from element `at`.
    unsafe fn k(&self, at: usize) -> V;
    /// N values of V from element `at`.
    unsafe fn v(&self, at: usize) -> V;
}

/// A cache kind's per-row scales.
pub(super) trait RowScales: Rows {
    /// Whether rows carry scales.
    const SCALED: bool = false;
    /// Row `row`'s K and V scales (1 for a float cache).
    #[inline(always)]
    fn scales(&self, _row: usize) -> (f32, f32) {
        (1.0, 1.0)
    }
}

impl RowScales for F32Rows<'_> {}
impl RowScales for Bf16Rows<'_> {}
impl<S: Scale> RowScales for Int8Rows<'_, S> {
    const SCALED: bool = true;
    #[inline(always)]
    fn scales(&self, row: usize) -> (f32, f32) {
        (self.k_scale.at(row), self.v_scale.at(row))
    }
}

macro_rules! lane_rows {
    ($rows:ty, $w:ident, $features:literal, $read:ident) => {
        impl LaneRows<$w> for $rows {
            #[inline]
            #[target_feature(enable = $features)]
            unsafe fn k(&self, at: usize) -> $w {
                debug_assert!(at + $w::N <= self.k.len());
                $read(self.k.as_ptr().add(at))
            }
            #[inline]
            #[target_feature(enable = $features)]
            unsafe fn v(&self, at: usize) -> $w {
                debug_assert!(at + $w::N <= self.v.len());
                $read(self.v.as_ptr().add(at))
            }
        }
    };
}

/// 16 float32 values from `p`.
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn f32x16(p: *const f32) -> W16 {
    W16(_mm512_loadu_ps(p))
}

/// 16 bfloat16 values from `p` widened to float32 (bits shifted into the high half).
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn bf16x16(p: *const u16) -> W16 {
    let bits = _mm512_cvtepu16_epi32(_mm256_loadu_si256(p as *const __m256i));
    W16(_mm512_castsi512_ps(_mm512_slli_epi32::<16>(bits)))
}

/// 16 int8 values from `p` as float32.
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn i8x16(p: *const i8) -> W16 {
    W16(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(
        p as *const __m128i,
    ))))
}

/// 8 float32 values from `p`.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn f32x8(p: *const f32) -> W8 {
    W8(_mm256_loadu_ps(p))
}

/// 8 bfloat16 values from `p` widened to float32.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn bf16x8(p: *const u16) -> W8 {
    let bits = _mm256_cvtepu16_epi32(_mm_loadu_si128(p as *const __m128i));
    W8(_mm256_castsi256_ps(_mm256_slli_epi32::<16>(bits)))
}

/// 8 int8 values from `p` as float32.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn i8x8(p: *const i8) -> W8 {
    W8(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(
        p as *const __m128i,
    ))))
}

lane_rows!(F32Rows<'_>, W16, "avx512f", f32x16);
lane_rows!(Bf16Rows<'_>, W16, "avx512f", bf16x16);
lane_rows!(F32Rows<'_>, W8, "avx2,fma", f32x8);
lane_rows!(Bf16Rows<'_>, W8, "avx2,fma", bf16x8);

impl<S: Scale> LaneRows<W16> for Int8Rows<'_, S> {
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn k(&self, at: usize) -> W16 {
        debug_assert!(at + 16 <= self.k.len());
        i8x16(self.k.as_ptr().add(at))
    }
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn v(&self, at: usize) -> W16 {
        debug_assert!(at + 16 <= self.v.len());
        i8x16(self.v.as_ptr().add(at))
    }
}

impl<S: Scale> LaneRows<W8> for Int8Rows<'_, S> {
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn k(&self, at: usize) -> W8 {
        debug_assert!(at + 8 <= self.k.len());
        i8x8(self.k.as_ptr().add(at))
    }
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn v(&self, at: usize) -> W8 {
        debug_assert!(at + 8 <= self.v.len());
        i8x8(self.v.as_ptr().add(at))
    }
}

/// float32 e^x lane-wise: the same operations, in the same order, as `elementwise::exp` (so
/// each lane's result is that function's, bit for bit).
#[inline(always)]
pub(super) unsafe fn exp_lanes<V: Lanes>(x: V) -> V {
    let c = |v: f32| V::splat(v);
    let x = x.max(c(-87.0)).min(c(88.0));
    let magic = c(12_582_912.0);
    let n = x.mul(c(std::f32::consts::LOG2_E)).add(magic).sub(magic);
    let r = x.sub(n.mul(c(0.693_145_75))).sub(n.mul(c(1.428_606_8e-6)));
    let mut p = r.div(c(720.0));
    p = r.mul(c(1.0 / 120.0).add(p));
    p = r.mul(c(1.0 / 24.0).add(p));
    p = r.mul(c(1.0 / 6.0).add(p));
    p = r.mul(c(0.5).add(p));
    p = r.mul(c(1.0).add(p));
    c(1.0).add(p).mul(V::pow2(n))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::elementwise::exp;

    fn fold_sums<V: Lanes>(fold: impl Fn(&[[f32; 16]; 16]) -> [f32; 16]) {
        let values: [[f32; 16]; 16] = std::array::from_fn(|i| {
            std::array::from_fn(|l| (i * 16 + l) as f32 * 0.5 - (l * l) as f32)
        });
        let got = fold(&values);
        for (i, v) in values.iter().enumerate().take(V::N) {
            let want: f32 = v[..V::N].iter().sum();
            assert_eq!(got[i], want, "register {i} of {} lanes", V::N);
        }
    }

    #[test]
    fn each_width_folds_each_register_and_takes_exp_bit_for_bit() {
        let xs: Vec<f32> = (-2000..2000)
            .map(|i| i as f32 * 0.0537)
            .chain([f32::NAN, -1e9, 1e9])
            .collect();
        if std::arch::is_x86_feature_detected!("avx512f") {
            fold_sums::<W16>(|v| {
                // SAFETY: AVX-512F was detected above.
                unsafe {
                    let regs: [W16; 16] = std::array::from_fn(|i| W16::load(v[i].as_ptr()));
                    let mut out = [0f32; 16];
                    W16::fold(&regs).store(out.as_mut_ptr());
                    out
                }
            });
            for x in xs.chunks_exact(16) {
                let mut out = [0f32; 16];
                // SAFETY: AVX-512F was detected above.
                unsafe { exp_w16(x, &mut out) };
                for (o, &x) in out.iter().zip(x) {
                    assert_eq!(o.to_bits(), exp(x).to_bits(), "e^{x}");
                }
            }
        }
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
        {
            fold_sums::<W8>(|v| {
                // SAFETY: AVX2 and FMA were detected above.
                unsafe {
                    let regs: [W8; 16] = std::array::from_fn(|i| W8::load(v[i].as_ptr()));
                    let mut out = [0f32; 16];
                    W8::fold(&regs).store(out.as_mut_ptr());
                    out
                }
            });
            for x in xs.chunks_exact(8) {
                let mut out = [0f32; 8];
                // SAFETY: AVX2 and FMA were detected above.
                unsafe { exp_w8(x, &mut out) };
                for (o, &x) in out.iter().zip(x) {
                    assert_eq!(o.to_bits(), exp(x).to_bits(), "e^{x}");
                }
            }
        }
    }

    #[target_feature(enable = "avx512f")]
    unsafe fn exp_w16(x: &[f32], out: &mut [f32; 16]) {
        exp_lanes(W16::load(x.as_ptr())).store(out.as_mut_ptr())
    }

    #[target_feature(enable = "avx2,fma")]
    unsafe fn exp_w8(x: &[f32], out: &mut [f32; 8]) {
        exp_lanes(W8::load(x.as_ptr())).store(out.as_mut_ptr())
    }
}
