//! A decode row's paged attention with AVX-512: one query token of one request against its
//! context, up to 16 query heads (a tile) at a time, 16 positions at a time.
//!
//! - K is read in the cache's address order: at each position the rows of the tile's KV heads
//!   lie side by side (a block is (position, KV head, D)), so the hardware's stream prefetcher
//!   follows the reads through a block. (Read head by head, a head's rows a position's width
//!   apart, one thread drew 7 GB/s from memory; in address order 11.5, with the same sums.)
//! - At each position the tile's dot products (each summed lane-wise in one register) are
//!   folded into one vector of scores, lane j holding head j, by a tree of shuffles and adds:
//!   the softmax's running max, exponentials and sums are then lane-wise operations on
//!   whole vectors, once per 16 positions.
//! - V rows are requested while K is read, then read head by head over the 16 positions from
//!   the nearer caches, each head's output (D values) in registers.
//!
//! Each head's sums are taken in the order of the kernel this one replaced (a dot product's
//! lanes by the fold's tree, positions in order) and `exp16` repeats `exp`'s operations
//! lane-wise, so the results are that kernel's bit for bit; against the portable path only the
//! order of the additions differs. Rows are named by their index in the (block, offset, KV
//! head) grid, so an int8 cache's scale is read without a division.

use std::arch::x86_64::*;

use super::paged_attention::{Bf16Rows, F32Rows, Int8Rows, Rows, Scale};

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

/// float32 e^x on 16 lanes: the same operations, in the same order, as `elementwise::exp`
/// (so each lane's result is that function's, bit for bit).
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn exp16(x: __m512) -> __m512 {
    let x = _mm512_min_ps(
        _mm512_max_ps(x, _mm512_set1_ps(-87.0)),
        _mm512_set1_ps(88.0),
    );
    let magic = _mm512_set1_ps(12_582_912.0);
    let t = _mm512_mul_ps(x, _mm512_set1_ps(std::f32::consts::LOG2_E));
    let n = _mm512_sub_ps(_mm512_add_ps(t, magic), magic);
    let r = _mm512_sub_ps(
        _mm512_sub_ps(x, _mm512_mul_ps(n, _mm512_set1_ps(0.693_145_75))),
        _mm512_mul_ps(n, _mm512_set1_ps(1.428_606_8e-6)),
    );
    let c = |v: f32| _mm512_set1_ps(v);
    let mut p = _mm512_div_ps(r, c(720.0));
    p = _mm512_mul_ps(r, _mm512_add_ps(c(1.0 / 120.0), p));
    p = _mm512_mul_ps(r, _mm512_add_ps(c(1.0 / 24.0), p));
    p = _mm512_mul_ps(r, _mm512_add_ps(c(1.0 / 6.0), p));
    p = _mm512_mul_ps(r, _mm512_add_ps(c(0.5), p));
    p = _mm512_mul_ps(r, _mm512_add_ps(c(1.0), p));
    p = _mm512_add_ps(c(1.0), p);
    let bits = _mm512_slli_epi32::<23>(_mm512_add_epi32(
        _mm512_cvttps_epi32(n),
        _mm512_set1_epi32(127),
    ));
    _mm512_mul_ps(p, _mm512_castsi512_ps(bits))
}

/// One decode row against its context for `span` consecutive KV heads and their query heads.
/// `rows[i]` is the cache row (in the (block, offset, KV head) grid) of the first KV head at
/// the i-th visible position (the span's rows follow it); `qs` holds the query heads' queries
/// already multiplied by the score scale (heads x D). Leaves each head's softmax state: its
/// running max and sum in `max` and `sum` (heads) and its unnormalised output in `acc`
/// (heads x D). D must be 16 · NV.
///
/// The query heads are taken 16 at a time (a tile); a tile reads its positions in the cache's
/// address order — at each position the rows of its KV heads, which lie side by side — so the
/// hardware's stream prefetcher follows the reads within a block.
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
    acc.fill(0.0);
    for first in (0..heads).step_by(16) {
        let last = (first + 16).min(heads);
        let tile = Tile {
            first,
            count: last - first,
            group,
        };
        let state = TileState {
            max: &mut max[first..last],
            sum: &mut sum[first..last],
            acc: &mut acc[first * d..last * d],
        };
        attend_tile::<R, NV>(rows, &tile, &qs[first * d..last * d], cache, softcap, state);
    }
}

/// Up to 16 query heads of a decode row: the first (within the row's span), how many, and the
/// query heads per KV head.
struct Tile {
    first: usize,
    count: usize,
    group: usize,
}

impl Tile {
    /// The KV head (within the span) of the tile's j-th query head.
    #[inline(always)]
    fn kv(&self, j: usize) -> usize {
        (self.first + j) / self.group
    }
}

/// A tile's softmax state: per head its running max and sum, and its output (count x D).
struct TileState<'a> {
    max: &'a mut [f32],
    sum: &'a mut [f32],
    acc: &'a mut [f32],
}

/// One tile's heads against every position of `rows`, 16 positions at a time. K is read in
/// the cache's address order: at each position the tile's dot products are folded into one
/// vector of scores (lane j: head j), so the softmax's max, exponentials and sums are taken
/// lane-wise on whole vectors, and the position's V rows are requested meanwhile. V is then
/// read head by head over the 16 positions (from the nearer caches), each head's output in
/// registers.
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn attend_tile<R: Rows16, const NV: usize>(
    rows: &[usize],
    tile: &Tile,
    qs: &[f32],
    cache: &R,
    softcap: Option<f32>,
    state: TileState,
) {
    let d = 16 * NV;
    let count = tile.count;
    let (kv_first, kv_len) = (tile.kv(0), tile.kv(count - 1) + 1 - tile.kv(0));
    let mut max = _mm512_set1_ps(f32::NEG_INFINITY);
    let mut sum = _mm512_setzero_ps();
    let mut scores = [_mm512_setzero_ps(); 16];
    // weights[j][i]: head j's weight of the chunk's i-th position (times V's scale).
    let mut weights = [[0f32; 16]; 16];
    let mut rescale = [0f32; 16];
    for keys in rows.chunks(16) {
        for (score, &r) in scores.iter_mut().zip(keys) {
            cache.prefetch_v((r + kv_first) * d, kv_len * d);
            *score = tile_scores::<R, NV>(r, tile, qs, cache, softcap);
        }
        let n = keys.len();
        let mut new_max = max;
        for s in &scores[..n] {
            new_max = _mm512_max_ps(new_max, *s);
        }
        let r = exp16(_mm512_sub_ps(max, new_max));
        let mut total = _mm512_setzero_ps();
        let mut chunk = [[0f32; 16]; 16];
        for ((s, w), &row) in scores.iter().zip(chunk.iter_mut()).zip(keys) {
            let p = exp16(_mm512_sub_ps(*s, new_max));
            total = _mm512_add_ps(total, p);
            let p = if R::SCALED {
                let mut vscale = [1f32; 16];
                for (j, v) in vscale[..count].iter_mut().enumerate() {
                    *v = cache.scales(row + tile.kv(j)).1;
                }
                _mm512_mul_ps(p, _mm512_loadu_ps(vscale.as_ptr()))
            } else {
                p
            };
            _mm512_storeu_ps(w.as_mut_ptr(), p);
        }
        sum = _mm512_add_ps(_mm512_mul_ps(sum, r), total);
        max = new_max;
        _mm512_storeu_ps(rescale.as_mut_ptr(), r);
        transpose_into(&chunk, n, count, &mut weights);
        for (j, w) in weights[..count].iter().enumerate() {
            let out = state.acc.as_mut_ptr().add(j * d);
            let scale = _mm512_set1_ps(rescale[j]);
            let mut o = [_mm512_setzero_ps(); NV];
            for (c, o) in o.iter_mut().enumerate() {
                *o = _mm512_mul_ps(scale, _mm512_loadu_ps(out.add(16 * c)));
            }
            let kv = tile.kv(j);
            for (&p, &row) in w.iter().zip(keys) {
                let (p, at) = (_mm512_set1_ps(p), (row + kv) * d);
                for (c, o) in o.iter_mut().enumerate() {
                    *o = _mm512_fmadd_ps(p, cache.v16(at + 16 * c), *o);
                }
            }
            for (c, o) in o.iter().enumerate() {
                _mm512_storeu_ps(out.add(16 * c), *o);
            }
        }
    }
    let (mut m, mut s) = ([0f32; 16], [0f32; 16]);
    _mm512_storeu_ps(m.as_mut_ptr(), max);
    _mm512_storeu_ps(s.as_mut_ptr(), sum);
    state.max.copy_from_slice(&m[..count]);
    state.sum.copy_from_slice(&s[..count]);
}

/// `to[j][i] = from[i][j]` for the first `n` positions i and `count` heads j.
#[inline(always)]
fn transpose_into(from: &[[f32; 16]; 16], n: usize, count: usize, to: &mut [[f32; 16]; 16]) {
    for (j, t) in to[..count].iter_mut().enumerate() {
        for (i, f) in from[..n].iter().enumerate() {
            t[i] = f[j];
        }
    }
}

/// The tile's scores at one position (cache row `row` of the span's first KV head): lane j is
/// query head j's dot product with its KV head's K row (times the row's scale, soft-capped).
#[inline(always)]
unsafe fn tile_scores<R: Rows16, const NV: usize>(
    row: usize,
    tile: &Tile,
    qs: &[f32],
    cache: &R,
    softcap: Option<f32>,
) -> __m512 {
    let d = 16 * NV;
    let mut parts = [_mm512_setzero_ps(); 16];
    for (j, part) in parts.iter_mut().enumerate().take(tile.count) {
        let (q, at) = (qs.as_ptr().add(j * d), (row + tile.kv(j)) * d);
        let mut a = _mm512_mul_ps(_mm512_loadu_ps(q), cache.k16(at));
        for c in 1..NV {
            a = _mm512_fmadd_ps(_mm512_loadu_ps(q.add(16 * c)), cache.k16(at + 16 * c), a);
        }
        *part = a;
    }
    let mut s = fold16(&parts);
    if R::SCALED {
        let mut kscale = [1f32; 16];
        for (j, k) in kscale[..tile.count].iter_mut().enumerate() {
            *k = cache.scales(row + tile.kv(j)).0;
        }
        s = _mm512_mul_ps(s, _mm512_loadu_ps(kscale.as_ptr()));
    }
    if let Some(cap) = softcap {
        let mut x = [0f32; 16];
        _mm512_storeu_ps(x.as_mut_ptr(), s);
        for v in x.iter_mut() {
            *v = cap * (*v / cap).tanh();
        }
        s = _mm512_loadu_ps(x.as_ptr());
    }
    s
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
