//! A decode row's paged attention with AVX-512: one query token of one request against its
//! context, for the G query heads that share a KV head, 16 keys at a time.
//!
//! - Each key's D products are summed lane-wise in one register, and the 16 registers of a
//!   group of keys are folded into one vector of 16 scores by a tree of shuffles and adds
//!   (45 instructions per 16 keys) instead of a horizontal sum per key.
//! - The softmax's running max and sum are updated once per 16 keys, its exponentials taken
//!   on a whole vector.
//! - A head's output (D values) stays in registers while the 16 keys' V rows are added to it.
//! - Each K/V row is requested `AHEAD` positions before its use: a head's rows lie a
//!   position's width apart (H_kv · D values) and its blocks anywhere in the pool, which no
//!   hardware prefetcher follows; without the hint every row costs a miss's full latency.
//!
//! Rows are named by their index in the (block, offset, KV head) grid, so an int8 cache's
//! scale is read without a division. The arithmetic is float32 throughout, like the portable
//! path; only the order of the additions differs.

use std::arch::x86_64::*;

use super::elementwise::exp;
use super::paged_attention::{Bf16Rows, F32Rows, Int8Rows, Rows, Scale, AHEAD};

/// Reads cached rows 16 values at a time as float32 (an int8 row unscaled; `scales` gives its
/// K and V scale).
pub(super) trait Rows16: Rows {
    /// 16 values of K from element `at`.
    unsafe fn k16(&self, at: usize) -> __m512;
    /// 16 values of V from element `at`.
    unsafe fn v16(&self, at: usize) -> __m512;
    /// Whether rows carry scales.
    const SCALED: bool = false;
    /// Row `row`'s K and V scales (1 for a float cache).
    #[inline(always)]
    fn scales(&self, _row: usize) -> (f32, f32) {
        (1.0, 1.0)
    }
}

impl Rows16 for F32Rows<'_> {
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn k16(&self, at: usize) -> __m512 {
        debug_assert!(at + 16 <= self.k.len());
        _mm512_loadu_ps(self.k.as_ptr().add(at))
    }
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn v16(&self, at: usize) -> __m512 {
        debug_assert!(at + 16 <= self.v.len());
        _mm512_loadu_ps(self.v.as_ptr().add(at))
    }
}

/// 16 bfloat16 values from `p` widened to float32 (bits shifted into the high half).
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn widen_bf16(p: *const u16) -> __m512 {
    let bits = _mm512_cvtepu16_epi32(_mm256_loadu_si256(p as *const __m256i));
    _mm512_castsi512_ps(_mm512_slli_epi32::<16>(bits))
}

impl Rows16 for Bf16Rows<'_> {
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn k16(&self, at: usize) -> __m512 {
        debug_assert!(at + 16 <= self.k.len());
        widen_bf16(self.k.as_ptr().add(at))
    }
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn v16(&self, at: usize) -> __m512 {
        debug_assert!(at + 16 <= self.v.len());
        widen_bf16(self.v.as_ptr().add(at))
    }
}

/// 16 int8 values from `p` as float32.
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn widen_i8(p: *const i8) -> __m512 {
    _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(p as *const __m128i)))
}

impl<S: Scale> Rows16 for Int8Rows<'_, S> {
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn k16(&self, at: usize) -> __m512 {
        debug_assert!(at + 16 <= self.k.len());
        widen_i8(self.k.as_ptr().add(at))
    }
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn v16(&self, at: usize) -> __m512 {
        debug_assert!(at + 16 <= self.v.len());
        widen_i8(self.v.as_ptr().add(at))
    }
    const SCALED: bool = true;
    #[inline(always)]
    fn scales(&self, row: usize) -> (f32, f32) {
        (self.k_scale.at(row), self.v_scale.at(row))
    }
}

/// Lane i of the result is the sum of v[i]'s 16 lanes.
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn fold16(v: &[__m512; 16]) -> __m512 {
    // Pairs of keys: per 128-bit lane, key a's partial sums at 0 and 2, key b's at 1 and 3.
    let mut b = [_mm512_setzero_ps(); 8];
    for i in 0..8 {
        let (x, y) = (v[2 * i], v[2 * i + 1]);
        b[i] = _mm512_add_ps(_mm512_unpacklo_ps(x, y), _mm512_unpackhi_ps(x, y));
    }
    // Fours: per 128-bit lane, keys 4i..4i+4 in order (one partial sum per 128-bit lane).
    let mut c = [_mm512_setzero_ps(); 4];
    for i in 0..4 {
        let (x, y) = (b[2 * i], b[2 * i + 1]);
        c[i] = _mm512_add_ps(
            _mm512_shuffle_ps::<0x44>(x, y),
            _mm512_shuffle_ps::<0xEE>(x, y),
        );
    }
    // Eights: 128-bit lanes (keys 8i..8i+4: half of the sums, the other half; keys 8i+4..8i+8: ...).
    let mut d = [_mm512_setzero_ps(); 2];
    for i in 0..2 {
        let (x, y) = (c[2 * i], c[2 * i + 1]);
        d[i] = _mm512_add_ps(
            _mm512_shuffle_f32x4::<0x88>(x, y),
            _mm512_shuffle_f32x4::<0xDD>(x, y),
        );
    }
    _mm512_add_ps(
        _mm512_shuffle_f32x4::<0x88>(d[0], d[1]),
        _mm512_shuffle_f32x4::<0xDD>(d[0], d[1]),
    )
}

/// One head's softmax state and output between groups of keys.
struct HeadState<'a> {
    max: &'a mut f32,
    sum: &'a mut f32,
    acc: &'a mut [f32],
}

/// One decode row against its context for `span` consecutive KV heads and their query heads.
/// `rows[i]` is the cache row (in the (block, offset, KV head) grid) of the first KV head at
/// the i-th visible position (the span's rows follow it); `qs` holds the query heads' queries
/// already multiplied by the score scale (heads x D). Leaves each head's softmax state: its
/// running max and sum in `max` and `sum` (heads) and its unnormalised output in `acc`
/// (heads x D). D must be 16 · NV.
#[target_feature(enable = "avx512f")]
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn attend_token_avx512<R: Rows16, const NV: usize>(
    rows: &[usize],
    span: usize,
    qs: &[f32],
    cache: &R,
    softcap: Option<f32>,
    max: &mut [f32],
    sum: &mut [f32],
    acc: &mut [f32],
) {
    let d = 16 * NV;
    let heads = max.len();
    let group = heads / span;
    debug_assert!(qs.len() == heads * d && acc.len() == heads * d);
    max.fill(f32::NEG_INFINITY);
    sum.fill(0.0);
    acc.fill(0.0);
    for r in rows.iter().take(AHEAD) {
        cache.prefetch(r * d, span * d);
    }
    let mut kscale = [1f32; 16];
    let mut vscale = [1f32; 16];
    let mut kv_rows = [0usize; 16];
    for (c, keys) in rows.chunks(16).enumerate() {
        let n = keys.len();
        for r in rows.iter().skip(c * 16 + AHEAD).take(16) {
            cache.prefetch(r * d, span * d);
        }
        for s in 0..span {
            for (k, &r) in kv_rows.iter_mut().zip(keys) {
                *k = r + s;
            }
            if R::SCALED {
                for (i, &r) in kv_rows[..n].iter().enumerate() {
                    (kscale[i], vscale[i]) = cache.scales(r);
                }
            }
            for h in s * group..(s + 1) * group {
                let q = &qs[h * d..(h + 1) * d];
                let state = HeadState {
                    max: &mut max[h],
                    sum: &mut sum[h],
                    acc: &mut acc[h * d..(h + 1) * d],
                };
                attend_keys::<R, NV>(&kv_rows[..n], q, cache, softcap, &kscale, &vscale, state);
            }
        }
    }
}

/// Up to 16 keys (the rows `keys`) for one head: scores, the softmax update, V rows added.
#[inline]
#[target_feature(enable = "avx512f")]
#[allow(clippy::too_many_arguments)]
unsafe fn attend_keys<R: Rows16, const NV: usize>(
    keys: &[usize],
    q: &[f32],
    cache: &R,
    softcap: Option<f32>,
    kscale: &[f32; 16],
    vscale: &[f32; 16],
    state: HeadState,
) {
    let d = 16 * NV;
    let n = keys.len();
    let mut qv = [_mm512_setzero_ps(); NV];
    for (c, v) in qv.iter_mut().enumerate() {
        *v = _mm512_loadu_ps(q.as_ptr().add(16 * c));
    }
    let mut parts = [_mm512_setzero_ps(); 16];
    for (part, &row) in parts.iter_mut().zip(keys) {
        let at = row * d;
        let mut a = _mm512_mul_ps(qv[0], cache.k16(at));
        for (c, &qc) in qv.iter().enumerate().skip(1) {
            a = _mm512_fmadd_ps(qc, cache.k16(at + 16 * c), a);
        }
        *part = a;
    }
    let mut s = [0f32; 16];
    _mm512_storeu_ps(s.as_mut_ptr(), fold16(&parts));
    if R::SCALED {
        for (x, k) in s.iter_mut().zip(kscale) {
            *x *= k;
        }
    }
    if let Some(cap) = softcap {
        for x in s.iter_mut() {
            *x = cap * (*x / cap).tanh();
        }
    }
    let mut new_max = *state.max;
    for &x in &s[..n] {
        new_max = new_max.max(x);
    }
    let rescale = exp(*state.max - new_max);
    let mut p = [0f32; 16];
    for (pi, &x) in p.iter_mut().zip(&s) {
        *pi = exp(x - new_max);
    }
    let mut total = 0f32;
    for (i, pi) in p.iter_mut().enumerate() {
        if i >= n {
            *pi = 0.0;
        }
        total += *pi;
    }
    *state.sum = *state.sum * rescale + total;
    *state.max = new_max;
    if R::SCALED {
        for (x, v) in p.iter_mut().zip(vscale) {
            *x *= v;
        }
    }
    let mut out = [_mm512_setzero_ps(); NV];
    let r = _mm512_set1_ps(rescale);
    for (c, o) in out.iter_mut().enumerate() {
        *o = _mm512_mul_ps(r, _mm512_loadu_ps(state.acc.as_ptr().add(16 * c)));
    }
    for (&pi, &row) in p.iter().zip(keys) {
        let (w, at) = (_mm512_set1_ps(pi), row * d);
        for (c, o) in out.iter_mut().enumerate() {
            *o = _mm512_fmadd_ps(w, cache.v16(at + 16 * c), *o);
        }
    }
    for (c, o) in out.iter().enumerate() {
        _mm512_storeu_ps(state.acc.as_mut_ptr().add(16 * c), *o);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fold16_sums_each_register() {
        if !std::arch::is_x86_feature_detected!("avx512f") {
            return;
        }
        let values: Vec<[f32; 16]> = (0..16)
            .map(|i| std::array::from_fn(|l| (i * 16 + l) as f32 * 0.5 - (l * l) as f32))
            .collect();
        // SAFETY: AVX-512F was detected above.
        let got = unsafe {
            let regs: [__m512; 16] = std::array::from_fn(|i| _mm512_loadu_ps(values[i].as_ptr()));
            let mut out = [0f32; 16];
            _mm512_storeu_ps(out.as_mut_ptr(), fold16(&regs));
            out
        };
        for (i, v) in values.iter().enumerate() {
            assert_eq!(got[i], v.iter().sum::<f32>(), "register {i}");
        }
    }
}
