//! The x86 kernels of the int8 matmul: MR rows of quantized activations times one tile of
//! `PackedWeights` (16 output columns), over a range of K's blocks. For each block the
//! int32 sums are turned to float, scaled by the activations' d, and the zero points' share
//! taken off; per weight group the sum takes the tile's scales s (`Operands`, in
//! int8_matmul.rs, has the math):
//!
//!   yg += f32(Σ xq·q) · d − z · (d·Σxq)   (per block: one convert, two fmas)
//!   y  += yg · s                          (per group)
//!
//! (UNIFORM: one integer z for the whole weight, the int32 sums start at −z·Σxq and the block
//! pays one convert and one fma.)
//!
//! AVX-512 VNNI multiplies a whole tile with one `vpdpbusd` per 4 columns: each weight register
//! feeds MR = 8 dot products, whose int32 sums and float sums stay in registers (16 of the 32,
//! 24 with the second term). Measured on Zen 4, 8 rows x 1 tile ran faster than 6 x 2 or 4 x 2
//! (the broadcasts are loads, which have ports to spare; the float work per block is the same).
//! The 256-bit paths do a tile in two halves of 8 columns. AVX2 has no dot-product
//! instruction: `vpmaddubsw` (u8 × s8 pairs into saturating i16) then `vpmaddwd` by ones gives
//! the same sums, exact for 4-bit weights (2·15·127 fits i16). For 8-bit weights a pair could
//! reach 2·255·127 and saturate, so they go in as q − 128 (signed) with the sign moved onto
//! the activation (|q − 128| ≤ 128: 2·128·127 fits), and the block pays the 128·Σxq back
//! through z − 128 in place of z.
//!
//! With `Activations::Int8x2` (SPLIT) every weight register is multiplied by both int8 terms of
//! the activations, the second sum scaled by d/254 and its zero-point share in d·Σxq.

use std::arch::x86_64::*;
use std::ops::Range;

use super::int8_matmul::{Operands, Segment};
use super::packed::{CHUNK_BYTES, TILE};
use super::quantize::BLOCK;

/// acc + Σ₄ w · broadcast(4 activation bytes at `x`), per int32 lane.
macro_rules! dot512 {
    ($acc:expr, $w:expr, $x:expr) => {
        _mm512_dpbusd_epi32(
            $acc,
            $w,
            _mm512_set1_epi32(($x as *const i32).read_unaligned()),
        )
    };
}

/// One tile (16 output columns) for MR rows over `blocks` (see `Segment` for what `out` holds
/// between calls).
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
pub(super) unsafe fn gemm_avx512<
    const MR: usize,
    const BITS: u8,
    const SPLIT: bool,
    const UNIFORM: bool,
>(
    op: &Operands,
    tile: usize,
    m0: usize,
    blocks: Range<usize>,
) {
    let (w, x) = (op.w, op.x);
    let per = w.tile_block_bytes();
    let data = w.tile_data(tile).as_ptr();
    let row_bytes = x.blocks * BLOCK;
    let xs: [*const i8; MR] = std::array::from_fn(|r| x.values.as_ptr().add((m0 + r) * row_bytes));
    let rs: [*const i8; MR] = std::array::from_fn(|r| {
        if SPLIT {
            x.residuals.as_ptr().add((m0 + r) * row_bytes)
        } else {
            xs[r]
        }
    });
    let row_floats = |v: &Vec<f32>| -> [*const f32; MR] {
        std::array::from_fn(|r| v.as_ptr().wrapping_add((m0 + r) * x.blocks))
    };
    let terms = if SPLIT { 2 } else { 1 };
    let offsets: [*const i32; MR] = std::array::from_fn(|r| {
        op.zero_offsets
            .as_ptr()
            .wrapping_add((m0 + r) * x.blocks * terms)
    });
    let (ds, dr, dsums) = (
        row_floats(&x.scales),
        row_floats(&x.residual_scales),
        row_floats(&x.scaled_sums),
    );
    let mask = ((1u32 << (op.n - tile * TILE).min(TILE)) - 1) as u16;
    let out = |r: usize| op.out.get().add((m0 + r) * op.n + tile * TILE);
    let low = _mm512_set1_epi8(0x0F);
    let mut b = blocks.start;
    while b < blocks.end {
        let seg = Segment::new(w, b, blocks.end);
        let mut yg = [_mm512_setzero_ps(); MR];
        if seg.resumes {
            for (r, ygr) in yg.iter_mut().enumerate() {
                *ygr = _mm512_maskz_loadu_ps(mask, out(r));
            }
        }
        let sc = w.tile_scales(tile, seg.group).as_ptr();
        let z = _mm512_loadu_ps(sc.add(TILE));
        for bb in seg.blocks.clone() {
            // With a uniform zero point the sums start at −z·Σxq (a broadcast load).
            let start = |r: usize, term: usize| match UNIFORM {
                true => _mm512_set1_epi32(*offsets[r].add(bb * terms + term)),
                false => _mm512_setzero_si512(),
            };
            let mut acc: [__m512i; MR] = std::array::from_fn(|r| start(r, 0));
            let mut rest: [__m512i; MR] = std::array::from_fn(|r| match SPLIT {
                true => start(r, 1),
                false => _mm512_setzero_si512(),
            });
            let (tb, at) = (data.add(bb * per), bb * BLOCK);
            if BITS == 8 {
                for j in 0..8 {
                    let wv = _mm512_loadu_si512(tb.add(j * CHUNK_BYTES) as *const _);
                    for r in 0..MR {
                        acc[r] = dot512!(acc[r], wv, xs[r].add(at + 4 * j));
                        if SPLIT {
                            rest[r] = dot512!(rest[r], wv, rs[r].add(at + 4 * j));
                        }
                    }
                }
            } else {
                for j in 0..4 {
                    let raw = _mm512_loadu_si512(tb.add(j * CHUNK_BYTES) as *const _);
                    let lo = _mm512_and_si512(raw, low);
                    let hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low);
                    let (x_lo, x_hi) = (at + 4 * j, at + 4 * j + 16);
                    for r in 0..MR {
                        acc[r] = dot512!(acc[r], lo, xs[r].add(x_lo));
                        acc[r] = dot512!(acc[r], hi, xs[r].add(x_hi));
                        if SPLIT {
                            rest[r] = dot512!(rest[r], lo, rs[r].add(x_lo));
                            rest[r] = dot512!(rest[r], hi, rs[r].add(x_hi));
                        }
                    }
                }
            }
            // The scalars are broadcast from memory: loads, not vector work.
            for r in 0..MR {
                let d = _mm512_set1_ps(*ds[r].add(bb));
                yg[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r]), d, yg[r]);
                if SPLIT {
                    let d_rest = _mm512_set1_ps(*dr[r].add(bb));
                    yg[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(rest[r]), d_rest, yg[r]);
                }
                if !UNIFORM {
                    yg[r] = _mm512_fnmadd_ps(z, _mm512_set1_ps(*dsums[r].add(bb)), yg[r]);
                }
            }
        }
        if !seg.ends_group {
            for (r, ygr) in yg.iter().enumerate() {
                _mm512_mask_storeu_ps(out(r), mask, *ygr);
            }
        } else {
            let s = _mm512_loadu_ps(sc);
            for (r, ygr) in yg.iter().enumerate() {
                let prev = match seg.adds {
                    true => _mm512_maskz_loadu_ps(mask, out(r)),
                    false => _mm512_setzero_ps(),
                };
                _mm512_mask_storeu_ps(out(r), mask, _mm512_fmadd_ps(*ygr, s, prev));
            }
        }
        b = seg.blocks.end;
    }
}

#[inline]
#[target_feature(enable = "avx2")]
unsafe fn dot_avx2(acc: __m256i, unsigned: __m256i, signed: __m256i) -> __m256i {
    let pairs = _mm256_maddubs_epi16(unsigned, signed);
    _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)))
}

/// Σ (q − 128)·x for unsigned q, without `vpmaddubsw` saturating (see the module note).
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn dot_avx2_offset(acc: __m256i, unsigned: __m256i, signed: __m256i) -> __m256i {
    let centred = _mm256_xor_si256(unsigned, _mm256_set1_epi8(-128));
    let magnitude = _mm256_abs_epi8(centred);
    dot_avx2(acc, magnitude, _mm256_sign_epi8(signed, centred))
}

#[inline]
#[target_feature(enable = "avx2,avxvnni")]
unsafe fn dot_avxvnni(acc: __m256i, unsigned: __m256i, signed: __m256i) -> __m256i {
    _mm256_dpbusd_avx_epi32(acc, unsigned, signed)
}

/// Lanes [0, valid) of 8 floats at `at`, zeros past them.
#[inline(always)]
unsafe fn load_lanes(at: *const f32, valid: usize) -> __m256 {
    let mut lanes = [0f32; 8];
    std::ptr::copy_nonoverlapping(at, lanes.as_mut_ptr(), valid);
    _mm256_loadu_ps(lanes.as_ptr())
}

/// Stores lanes [0, valid) of `values` at `at`.
#[inline(always)]
unsafe fn store_lanes(at: *mut f32, values: __m256, valid: usize) {
    let mut lanes = [0f32; 8];
    _mm256_storeu_ps(lanes.as_mut_ptr(), values);
    std::ptr::copy_nonoverlapping(lanes.as_ptr(), at, valid);
}

/// A 256-bit kernel of one tile (NT = 1): `$dot8` multiplies 8-bit weights (offset by 128
/// when `$offset8`), `$dot4` 4-bit ones.
macro_rules! gemm_256 {
    ($name:ident, $features:literal, $dot4:ident, $dot8:ident, $offset8:expr) => {
        #[target_feature(enable = $features)]
        pub(super) unsafe fn $name<
            const MR: usize,
            const BITS: u8,
            const SPLIT: bool,
            const UNIFORM: bool,
        >(
            op: &Operands,
            tile: usize,
            m0: usize,
            blocks: Range<usize>,
        ) {
            let (w, x) = (op.w, op.x);
            let per = w.tile_block_bytes();
            let data = w.tile_data(tile).as_ptr();
            let low = _mm256_set1_epi8(0x0F);
            let row_bytes = x.blocks * BLOCK;
            let xs: [*const i8; MR] =
                std::array::from_fn(|r| x.values.as_ptr().add((m0 + r) * row_bytes));
            let rs: [*const i8; MR] = std::array::from_fn(|r| {
                if SPLIT {
                    x.residuals.as_ptr().add((m0 + r) * row_bytes)
                } else {
                    xs[r]
                }
            });
            let bcast = |p: *const i8| _mm256_set1_epi32((p as *const i32).read_unaligned());
            for half in 0..2 {
                let first = tile * TILE + half * 8;
                if first >= op.n {
                    break;
                }
                let valid = (op.n - first).min(8);
                let out = |r: usize| op.out.get().add((m0 + r) * op.n + first);
                let mut b = blocks.start;
                while b < blocks.end {
                    let seg = Segment::new(w, b, blocks.end);
                    let mut yg = [_mm256_setzero_ps(); MR];
                    if seg.resumes {
                        for (r, ygr) in yg.iter_mut().enumerate() {
                            *ygr = load_lanes(out(r), valid);
                        }
                    }
                    let sc = w.tile_scales(tile, seg.group).as_ptr().add(half * 8);
                    let mut z = _mm256_loadu_ps(sc.add(TILE));
                    if BITS == 8 && $offset8 {
                        z = _mm256_sub_ps(z, _mm256_set1_ps(128.0));
                    }
                    for bb in seg.blocks.clone() {
                        let tb = data.add(bb * per + half * 32);
                        let at = bb * BLOCK;
                        // A uniform zero point z (z − 128 for offset weights) is taken off
                        // the int32 sums: they start at −z·Σxq.
                        let terms = if SPLIT { 2 } else { 1 };
                        let start = |r: usize, term: usize| {
                            let zero = w.uniform_zero.unwrap_or(0)
                                - if BITS == 8 && $offset8 { 128 } else { 0 };
                            let i = ((m0 + r) * x.blocks + bb) * terms + term;
                            match UNIFORM {
                                true => _mm256_set1_epi32(-zero * *x.sums.get_unchecked(i)),
                                false => _mm256_setzero_si256(),
                            }
                        };
                        let mut acc: [__m256i; MR] = std::array::from_fn(|r| start(r, 0));
                        let mut rest: [__m256i; MR] = std::array::from_fn(|r| match SPLIT {
                            true => start(r, 1),
                            false => _mm256_setzero_si256(),
                        });
                        if BITS == 8 {
                            for j in 0..8 {
                                let wv = _mm256_loadu_si256(tb.add(j * CHUNK_BYTES) as *const _);
                                for r in 0..MR {
                                    acc[r] = $dot8(acc[r], wv, bcast(xs[r].add(at + 4 * j)));
                                    if SPLIT {
                                        rest[r] = $dot8(rest[r], wv, bcast(rs[r].add(at + 4 * j)));
                                    }
                                }
                            }
                        } else {
                            for j in 0..4 {
                                let raw = _mm256_loadu_si256(tb.add(j * CHUNK_BYTES) as *const _);
                                let lo = _mm256_and_si256(raw, low);
                                let hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);
                                for r in 0..MR {
                                    let (x_lo, x_hi) = (at + 4 * j, at + 4 * j + 16);
                                    acc[r] = $dot4(acc[r], lo, bcast(xs[r].add(x_lo)));
                                    acc[r] = $dot4(acc[r], hi, bcast(xs[r].add(x_hi)));
                                    if SPLIT {
                                        rest[r] = $dot4(rest[r], lo, bcast(rs[r].add(x_lo)));
                                        rest[r] = $dot4(rest[r], hi, bcast(rs[r].add(x_hi)));
                                    }
                                }
                            }
                        }
                        for r in 0..MR {
                            let i = (m0 + r) * x.blocks + bb;
                            let d = _mm256_set1_ps(*x.scales.get_unchecked(i));
                            yg[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[r]), d, yg[r]);
                            if SPLIT {
                                let d_rest = _mm256_set1_ps(*x.residual_scales.get_unchecked(i));
                                let f = _mm256_cvtepi32_ps(rest[r]);
                                yg[r] = _mm256_fmadd_ps(f, d_rest, yg[r]);
                            }
                            if !UNIFORM {
                                let dsum = _mm256_set1_ps(*x.scaled_sums.get_unchecked(i));
                                yg[r] = _mm256_fnmadd_ps(z, dsum, yg[r]);
                            }
                        }
                    }
                    if !seg.ends_group {
                        for (r, ygr) in yg.iter().enumerate() {
                            store_lanes(out(r), *ygr, valid);
                        }
                    } else {
                        let s = _mm256_loadu_ps(sc);
                        for (r, ygr) in yg.iter().enumerate() {
                            let prev = match seg.adds {
                                true => load_lanes(out(r), valid),
                                false => _mm256_setzero_ps(),
                            };
                            store_lanes(out(r), _mm256_fmadd_ps(*ygr, s, prev), valid);
                        }
                    }
                    b = seg.blocks.end;
                }
            }
        }
    };
}

gemm_256!(gemm_avx2, "avx2,fma", dot_avx2, dot_avx2_offset, true);
gemm_256!(
    gemm_avxvnni,
    "avx2,fma,avxvnni",
    dot_avxvnni,
    dot_avxvnni,
    false
);

const _: () = assert!(BLOCK == 32 && TILE == 16 && CHUNK_BYTES == 64);
