//! A decode row's paged attention with SIMD lanes (16 with AVX-512, 8 with AVX2 + FMA; the
//! lanes in `decode_lanes.rs`): one query token of one request against its context, up to N
//! query heads (a tile) at a time, 16 positions at a time.
//!
//! - K is read in the cache's address order: at each position the rows of the tile's KV heads
//!   lie side by side (a block is (position, KV head, D)), so the hardware's stream prefetcher
//!   follows the reads through a block. (Read head by head, a head's rows a position's width
//!   apart, one thread drew 7 GB/s from memory; in address order 11.5.)
//! - At each position the tile's dot products (each summed lane-wise in one register) are
//!   folded into one vector of scores, lane j holding head j, by a tree of shuffles and adds:
//!   the softmax's running max, exponentials and sums are then lane-wise operations on
//!   whole vectors, once per 16 positions.
//! - V rows are requested while K is read, then read head by head over the 16 positions from
//!   the nearer caches, each head's output (D values) in registers.
//!
//! With AVX-512, each head's sums are taken in the order of the kernel this one replaced (a
//! dot product's lanes by the fold's tree, positions in order) and `exp_lanes` repeats `exp`'s
//! operations lane-wise, so the results are that kernel's bit for bit; against the portable
//! path only the order of the additions differs. Rows are named by their index in the (block,
//! offset, KV head) grid, so an int8 cache's scale is read without a division.

use super::decode_lanes::{exp_lanes, LaneRows, Lanes, W16, W8};

/// One decode row against its context for `span` consecutive KV heads and their query heads.
/// `rows[i]` is the cache row (in the (block, offset, KV head) grid) of the first KV head at
/// the i-th visible position (the span's rows follow it); `qs` holds the query heads' queries
/// already multiplied by the score scale (heads x D). Leaves each head's softmax state: its
/// running max and sum in `max` and `sum` (heads) and its unnormalised output in `acc`
/// (heads x D). D must be N · NV.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn attend_token<V: Lanes, R: LaneRows<V>, const NV: usize>(
    rows: &[usize],
    span: usize,
    qs: &[f32],
    cache: &R,
    softcap: Option<f32>,
    max: &mut [f32],
    sum: &mut [f32],
    acc: &mut [f32],
) {
    let d = V::N * NV;
    let heads = max.len();
    let group = heads / span;
    debug_assert!(qs.len() == heads * d && acc.len() == heads * d);
    acc.fill(0.0);
    for first in (0..heads).step_by(V::N) {
        let last = (first + V::N).min(heads);
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
        attend_tile::<V, R, NV>(rows, &tile, &qs[first * d..last * d], cache, softcap, state);
    }
}

/// A `pub(super)` entry to `attend_token` compiled for one width's instructions.
macro_rules! compiled_with {
    ($(#[$doc:meta])* $name:ident, $features:literal, $lanes:ty) => {
        $(#[$doc])*
        #[target_feature(enable = $features)]
        #[allow(clippy::too_many_arguments)]
        pub(super) unsafe fn $name<R: LaneRows<$lanes>, const NV: usize>(
            rows: &[usize],
            span: usize,
            qs: &[f32],
            cache: &R,
            softcap: Option<f32>,
            max: &mut [f32],
            sum: &mut [f32],
            acc: &mut [f32],
        ) {
            attend_token::<$lanes, R, NV>(rows, span, qs, cache, softcap, max, sum, acc)
        }
    };
}

compiled_with!(
    /// `attend_token` with 16 lanes.
    attend_token_avx512,
    "avx512f",
    W16
);
compiled_with!(
    /// `attend_token` with 8 lanes.
    attend_token_avx2,
    "avx2,fma",
    W8
);

/// Up to N query heads of a decode row: the first (within the row's span), how many, and the
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
#[inline(always)]
unsafe fn attend_tile<V: Lanes, R: LaneRows<V>, const NV: usize>(
    rows: &[usize],
    tile: &Tile,
    qs: &[f32],
    cache: &R,
    softcap: Option<f32>,
    state: TileState,
) {
    let d = V::N * NV;
    let count = tile.count;
    let (kv_first, kv_len) = (tile.kv(0), tile.kv(count - 1) + 1 - tile.kv(0));
    let mut max = V::splat(f32::NEG_INFINITY);
    let mut sum = V::zero();
    let mut scores = [V::zero(); 16];
    // weights[j][i]: head j's weight of the chunk's i-th position (times V's scale).
    let mut weights = [[0f32; 16]; 16];
    let mut rescale = [0f32; 16];
    for keys in rows.chunks(16) {
        for (score, &r) in scores.iter_mut().zip(keys) {
            cache.prefetch_v((r + kv_first) * d, kv_len * d);
            *score = tile_scores::<V, R, NV>(r, tile, qs, cache, softcap);
        }
        let n = keys.len();
        let mut new_max = max;
        for s in &scores[..n] {
            new_max = new_max.max(*s);
        }
        let r = exp_lanes(max.sub(new_max));
        let mut total = V::zero();
        let mut chunk = [[0f32; 16]; 16];
        for ((s, w), &row) in scores.iter().zip(chunk.iter_mut()).zip(keys) {
            let p = exp_lanes(s.sub(new_max));
            total = total.add(p);
            let p = if R::SCALED {
                let mut vscale = [1f32; 16];
                for (j, v) in vscale[..count].iter_mut().enumerate() {
                    *v = cache.scales(row + tile.kv(j)).1;
                }
                p.mul(V::load(vscale.as_ptr()))
            } else {
                p
            };
            p.store(w.as_mut_ptr());
        }
        sum = sum.mul(r).add(total);
        max = new_max;
        r.store(rescale.as_mut_ptr());
        transpose_into(&chunk, n, count, &mut weights);
        for (j, w) in weights[..count].iter().enumerate() {
            let out = state.acc.as_mut_ptr().add(j * d);
            let scale = V::splat(rescale[j]);
            let mut o = [V::zero(); NV];
            for (c, o) in o.iter_mut().enumerate() {
                *o = scale.mul(V::load(out.add(V::N * c)));
            }
            let kv = tile.kv(j);
            for (&p, &row) in w.iter().zip(keys) {
                let (p, at) = (V::splat(p), (row + kv) * d);
                for (c, o) in o.iter_mut().enumerate() {
                    *o = p.fma(cache.v(at + V::N * c), *o);
                }
            }
            for (c, o) in o.iter().enumerate() {
                o.store(out.add(V::N * c));
            }
        }
    }
    let (mut m, mut s) = ([0f32; 16], [0f32; 16]);
    max.store(m.as_mut_ptr());
    sum.store(s.as_mut_ptr());
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
unsafe fn tile_scores<V: Lanes, R: LaneRows<V>, const NV: usize>(
    row: usize,
    tile: &Tile,
    qs: &[f32],
    cache: &R,
    softcap: Option<f32>,
) -> V {
    let d = V::N * NV;
    let mut parts = [V::zero(); 16];
    for (j, part) in parts.iter_mut().enumerate().take(tile.count) {
        let (q, at) = (qs.as_ptr().add(j * d), (row + tile.kv(j)) * d);
        let mut a = V::load(q).mul(cache.k(at));
        for c in 1..NV {
            a = V::load(q.add(V::N * c)).fma(cache.k(at + V::N * c), a);
        }
        *part = a;
    }
    let mut s = V::fold(&parts);
    if R::SCALED {
        let mut kscale = [1f32; 16];
        for (j, k) in kscale[..tile.count].iter_mut().enumerate() {
            *k = cache.scales(row + tile.kv(j)).0;
        }
        s = s.mul(V::load(kscale.as_ptr()));
    }
    if let Some(cap) = softcap {
        let mut x = [0f32; 16];
        s.store(x.as_mut_ptr());
        for v in x.iter_mut() {
            *v = cap * (*v / cap).tanh();
        }
        s = V::load(x.as_ptr());
    }
    s
}
