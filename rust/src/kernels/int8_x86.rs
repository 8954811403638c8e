//! The x86 tile kernels of the int8 matmul: 16 output rows (one tile of `PackedWeights`) for
//! MR rows of quantized activations, walking K block by block. Each block's int32 sums are
//! turned to float and combined with the tile's scales s and s·z and the activations' (d, Σxq):
//!
//!   y += f32(Σ xq·q) · (s·d) − (s·z) · (d·Σxq)
//!
//! AVX-512 VNNI does a whole tile with one `vpdpbusd` per 4 columns; the 256-bit paths do it in
//! two halves of 8 rows. AVX2 has no dot-product instruction: `vpmaddubsw` (u8 × s8 pairs into
//! saturating i16) then `vpmaddwd` by ones gives the same sums, exact for 4-bit weights
//! (2·15·127 fits i16). For 8-bit weights a pair could reach 2·255·127 and saturate, so they go
//! in as q − 128 (signed) with the sign moved onto the activation (|q − 128| ≤ 128: 2·128·127
//! fits), and the block pays the 128·Σxq back through s·(z − 128) in place of s·z.
//!
//! With `Activations::Int8x2` (SPLIT) every weight register is multiplied by both int8 terms of
//! the activations, the second sum scaled by 1/254; the sums of both are in Σxq.

use std::arch::x86_64::*;

use super::packed::{PackedWeights, CHUNK_BYTES, TILE};
use super::quantize::{QuantizedRows, BLOCK, RESIDUAL_STEPS};

/// Stores lanes [0, valid) of `values` at `out`.
unsafe fn store_lanes(out: *mut f32, values: &[f32], valid: usize) {
    std::ptr::copy_nonoverlapping(values.as_ptr(), out, valid);
}

/// The activations' 4 bytes j (columns 4j..4j+4 of the block) of a row, to broadcast.
#[inline(always)]
unsafe fn x_dword(x: &QuantizedRows, row: usize, block: usize, j: usize) -> i32 {
    (x.value_ptr(row, block) as *const i32)
        .add(j)
        .read_unaligned()
}

/// The same 4 bytes of the second terms (`Activations::Int8x2`).
#[inline(always)]
unsafe fn r_dword(x: &QuantizedRows, row: usize, block: usize, j: usize) -> i32 {
    (x.residual_ptr(row, block) as *const i32)
        .add(j)
        .read_unaligned()
}

/// acc + Σ₄ w · broadcast(4 activation bytes), per int32 lane.
macro_rules! dot512 {
    ($acc:expr, $w:expr, $x:expr) => {
        _mm512_dpbusd_epi32($acc, $w, _mm512_set1_epi32($x))
    };
}

/// NT consecutive tiles (16·NT output columns) for MR rows: each broadcast activation feeds NT
/// dot products and each weight register MR (NT = 2 for the GEMM's panels, 1 for the GEMV).
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
pub(super) unsafe fn tile_avx512<
    const MR: usize,
    const BITS: u8,
    const SPLIT: bool,
    const NT: usize,
>(
    w: &PackedWeights,
    tile: usize,
    x: &QuantizedRows,
    m0: usize,
    out: *mut f32,
    n: usize,
) {
    let per = w.tile_block_bytes();
    let data: [*const u8; NT] = std::array::from_fn(|t| w.tile_data(tile + t).as_ptr());
    let low = _mm512_set1_epi8(0x0F);
    let mut y = [[_mm512_setzero_ps(); NT]; MR];
    for b in 0..w.blocks {
        let mut acc = [[_mm512_setzero_si512(); NT]; MR];
        let mut rest = [[_mm512_setzero_si512(); NT]; MR];
        if BITS == 8 {
            for j in 0..8 {
                let wv: [__m512i; NT] = std::array::from_fn(|t| {
                    _mm512_loadu_si512(data[t].add(b * per + j * CHUNK_BYTES) as *const _)
                });
                for r in 0..MR {
                    let xv = x_dword(x, m0 + r, b, j);
                    for t in 0..NT {
                        acc[r][t] = dot512!(acc[r][t], wv[t], xv);
                    }
                    if SPLIT {
                        let rv = r_dword(x, m0 + r, b, j);
                        for t in 0..NT {
                            rest[r][t] = dot512!(rest[r][t], wv[t], rv);
                        }
                    }
                }
            }
        } else {
            for j in 0..4 {
                let raw: [__m512i; NT] = std::array::from_fn(|t| {
                    _mm512_loadu_si512(data[t].add(b * per + j * CHUNK_BYTES) as *const _)
                });
                let lo: [__m512i; NT] = std::array::from_fn(|t| _mm512_and_si512(raw[t], low));
                let hi: [__m512i; NT] =
                    std::array::from_fn(|t| _mm512_and_si512(_mm512_srli_epi16(raw[t], 4), low));
                for r in 0..MR {
                    let (x_lo, x_hi) = (x_dword(x, m0 + r, b, j), x_dword(x, m0 + r, b, j + 4));
                    for t in 0..NT {
                        acc[r][t] = dot512!(acc[r][t], lo[t], x_lo);
                        acc[r][t] = dot512!(acc[r][t], hi[t], x_hi);
                    }
                    if SPLIT {
                        let (r_lo, r_hi) = (r_dword(x, m0 + r, b, j), r_dword(x, m0 + r, b, j + 4));
                        for t in 0..NT {
                            rest[r][t] = dot512!(rest[r][t], lo[t], r_lo);
                            rest[r][t] = dot512!(rest[r][t], hi[t], r_hi);
                        }
                    }
                }
            }
        }
        let group = w.group_of(b);
        for t in 0..NT {
            let sc = w.tile_scales(tile + t, group).as_ptr();
            let s = _mm512_loadu_ps(sc);
            let sz = _mm512_mul_ps(s, _mm512_loadu_ps(sc.add(TILE)));
            for r in 0..MR {
                let i = (m0 + r) * x.blocks + b;
                let (d, sum) = (*x.scales.get_unchecked(i), *x.sums.get_unchecked(i));
                let sd = _mm512_mul_ps(s, _mm512_set1_ps(d));
                y[r][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r][t]), sd, y[r][t]);
                if SPLIT {
                    let sd_rest = _mm512_mul_ps(s, _mm512_set1_ps(d / RESIDUAL_STEPS));
                    y[r][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(rest[r][t]), sd_rest, y[r][t]);
                }
                y[r][t] = _mm512_fnmadd_ps(sz, _mm512_set1_ps(d * sum), y[r][t]);
            }
        }
    }
    for t in 0..NT {
        let first = (tile + t) * TILE;
        let valid = (n - first).min(TILE);
        let mask = ((1u32 << valid) - 1) as u16;
        for (r, yr) in y.iter().enumerate() {
            _mm512_mask_storeu_ps(out.add((m0 + r) * n + first), mask, yr[t]);
        }
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

/// A 256-bit tile kernel: `$dot8` multiplies 8-bit weights (offset by 128 when `$offset8`),
/// `$dot4` 4-bit ones.
macro_rules! tile_256 {
    ($name:ident, $features:literal, $dot4:ident, $dot8:ident, $offset8:expr) => {
        #[target_feature(enable = $features)]
        pub(super) unsafe fn $name<const MR: usize, const BITS: u8, const SPLIT: bool>(
            w: &PackedWeights,
            tile: usize,
            x: &QuantizedRows,
            m0: usize,
            out: *mut f32,
            n: usize,
        ) {
            let per = w.tile_block_bytes();
            let data = w.tile_data(tile).as_ptr();
            let low = _mm256_set1_epi8(0x0F);
            for half in 0..2 {
                let first = tile * TILE + half * 8;
                if first >= n {
                    break;
                }
                let mut y = [_mm256_setzero_ps(); MR];
                for b in 0..w.blocks {
                    let tb = data.add(b * per + half * 32);
                    let mut acc = [_mm256_setzero_si256(); MR];
                    let mut rest = [_mm256_setzero_si256(); MR];
                    let bcast = _mm256_set1_epi32;
                    if BITS == 8 {
                        for j in 0..8 {
                            let wv = _mm256_loadu_si256(tb.add(j * CHUNK_BYTES) as *const _);
                            for r in 0..MR {
                                acc[r] = $dot8(acc[r], wv, bcast(x_dword(x, m0 + r, b, j)));
                                if SPLIT {
                                    let xr = bcast(r_dword(x, m0 + r, b, j));
                                    rest[r] = $dot8(rest[r], wv, xr);
                                }
                            }
                        }
                    } else {
                        for j in 0..4 {
                            let raw = _mm256_loadu_si256(tb.add(j * CHUNK_BYTES) as *const _);
                            let lo = _mm256_and_si256(raw, low);
                            let hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);
                            for r in 0..MR {
                                acc[r] = $dot4(acc[r], lo, bcast(x_dword(x, m0 + r, b, j)));
                                acc[r] = $dot4(acc[r], hi, bcast(x_dword(x, m0 + r, b, j + 4)));
                                if SPLIT {
                                    let (r_lo, r_hi) =
                                        (r_dword(x, m0 + r, b, j), r_dword(x, m0 + r, b, j + 4));
                                    rest[r] = $dot4(rest[r], lo, bcast(r_lo));
                                    rest[r] = $dot4(rest[r], hi, bcast(r_hi));
                                }
                            }
                        }
                    }
                    let sc = w.tile_scales(tile, w.group_of(b)).as_ptr().add(half * 8);
                    let s = _mm256_loadu_ps(sc);
                    let mut z = _mm256_loadu_ps(sc.add(TILE));
                    if BITS == 8 && $offset8 {
                        z = _mm256_sub_ps(z, _mm256_set1_ps(128.0));
                    }
                    let sz = _mm256_mul_ps(s, z);
                    for r in 0..MR {
                        let i = (m0 + r) * x.blocks + b;
                        let (d, sum) = (*x.scales.get_unchecked(i), *x.sums.get_unchecked(i));
                        let sd = _mm256_mul_ps(s, _mm256_set1_ps(d));
                        y[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[r]), sd, y[r]);
                        if SPLIT {
                            let sd_rest = _mm256_mul_ps(s, _mm256_set1_ps(d / RESIDUAL_STEPS));
                            y[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(rest[r]), sd_rest, y[r]);
                        }
                        y[r] = _mm256_fnmadd_ps(sz, _mm256_set1_ps(d * sum), y[r]);
                    }
                }
                let valid = (n - first).min(8);
                let mut lanes = [0f32; 8];
                for (r, yr) in y.iter().enumerate() {
                    _mm256_storeu_ps(lanes.as_mut_ptr(), *yr);
                    store_lanes(out.add((m0 + r) * n + first), &lanes, valid);
                }
            }
        }
    };
}

tile_256!(tile_avx2, "avx2,fma", dot_avx2, dot_avx2_offset, true);
tile_256!(
    tile_avxvnni,
    "avx2,fma,avxvnni",
    dot_avxvnni,
    dot_avxvnni,
    false
);

const _: () = assert!(BLOCK == 32 && TILE == 16 && CHUNK_BYTES == 64);
