//! The small float32 ops of a decoder layer in one call each, where torch needs a chain of
//! them: the residual add with the RMSNorm after it, SiLU(gate)·up, rotate-half RoPE, and the
//! step's new K/V written into their cache slots. At decode every one of these is a few hundred
//! elements, so torch's cost is its per-op dispatch (5–10 ops, ~25 µs a norm on this project's
//! CPUs), not the arithmetic; here each is one call. The arithmetic is torch's, op for op, in
//! float32 (the norm's sum of squares in another order: ulp-level differences).
//!
//! Calls over fewer than [`PARALLEL_MIN`] elements run on the calling thread; larger ones
//! (prefill) split their rows over the pool.

use std::ops::Range;

use super::pool::{split, ThreadCount};
use super::quantize::SharedMut;
use super::KernelError;

/// Elements below which a call runs on one thread (waking a worker costs more).
pub const PARALLEL_MIN: usize = 1 << 15;

fn invalid<T>(message: String) -> Result<T, KernelError> {
    Err(KernelError::InvalidArgument(message))
}

fn over_rows(threads: ThreadCount, rows: usize, width: usize, work: impl Fn(Range<usize>) + Sync) {
    let threads = if rows * width < PARALLEL_MIN {
        ThreadCount::new(1)
    } else {
        threads
    };
    split(threads, rows, work)
}

/// Per row of `hidden` values: x += branch (when given), then out = weight · (x / rms(x)),
/// rms(x) = sqrt(mean(x²) + eps).
pub fn add_rms_norm(
    x: &mut [f32],
    branch: Option<&[f32]>,
    weight: &[f32],
    eps: f32,
    out: &mut [f32],
    threads: ThreadCount,
) -> Result<(), KernelError> {
    let hidden = weight.len();
    if hidden == 0 || !x.len().is_multiple_of(hidden) || out.len() != x.len() {
        return invalid(format!(
            "rms_norm: x of {} values, out of {} and a weight of {hidden} do not fit",
            x.len(),
            out.len()
        ));
    }
    if let Some(b) = branch {
        if b.len() != x.len() {
            return invalid(format!(
                "rms_norm: the branch has {} values, x {}",
                b.len(),
                x.len()
            ));
        }
    }
    let rows = x.len() / hidden;
    let (xs, outs) = (
        SharedMut::new(x.as_mut_ptr()),
        SharedMut::new(out.as_mut_ptr()),
    );
    over_rows(threads, rows, hidden, |range| {
        for r in range {
            // SAFETY: each row belongs to one range of one thread.
            let x = unsafe { std::slice::from_raw_parts_mut(xs.get().add(r * hidden), hidden) };
            let out = unsafe { std::slice::from_raw_parts_mut(outs.get().add(r * hidden), hidden) };
            let inverse = add_inverse_rms(x, branch.map(|b| &b[r * hidden..][..hidden]), eps);
            for ((o, &a), &w) in out.iter_mut().zip(x.iter()).zip(weight) {
                *o = rms_normed(a, w, inverse);
            }
        }
    });
    Ok(())
}

/// One row of the norm: x += branch (when given), then 1 / rms(x). The norm's arithmetic
/// lives here and in [`rms_normed`] only: `add_rms_norm` and the norm that writes quantized rows
/// (`quantize::rms_norm_quantize`) give the same bits.
#[inline(always)]
pub(crate) fn add_inverse_rms(x: &mut [f32], branch: Option<&[f32]>, eps: f32) -> f32 {
    if let Some(b) = branch {
        for (a, b) in x.iter_mut().zip(b) {
            *a += b;
        }
    }
    inverse_rms(x, eps)
}

/// 1 / rms(x) = 1 / sqrt(mean(x²) + eps).
#[inline(always)]
pub(crate) fn inverse_rms(x: &[f32], eps: f32) -> f32 {
    1.0 / (sum_of_squares(x) / x.len() as f32 + eps).sqrt()
}

/// One normed value: weight · (x / rms(x)).
#[inline(always)]
pub(crate) fn rms_normed(x: f32, weight: f32, inverse: f32) -> f32 {
    weight * (x * inverse)
}

#[inline(always)]
fn sum_of_squares(x: &[f32]) -> f32 {
    let mut lanes = [0f32; 16];
    let chunks = x.chunks_exact(16);
    let tail: f32 = chunks.remainder().iter().map(|v| v * v).sum();
    for c in chunks {
        for i in 0..16 {
            lanes[i] += c[i] * c[i];
        }
    }
    lanes.iter().sum::<f32>() + tail
}

/// e^x, vectorisable: 2^n · e^r with |r| ≤ ln2 / 2, e^r to degree 6 (relative error under
/// 2e-7); x is clamped to [−87, 88], where the result stays a normal float (NaN to −87). (The attention's
/// softmax uses it too.)
#[inline(always)]
pub(crate) fn exp(x: f32) -> f32 {
    #[allow(clippy::manual_clamp)] // clamp keeps NaN; max and min turn it into −87
    let x = x.max(-87.0).min(88.0);
    let n = super::round_small(x * std::f32::consts::LOG2_E);
    let r = x - n * 0.693_145_75 - n * 1.428_606_8e-6;
    let p = 1.0
        + r * (1.0
            + r * (0.5 + r * (1.0 / 6.0 + r * (1.0 / 24.0 + r * (1.0 / 120.0 + r / 720.0)))));
    p * f32::from_bits(((n as i32 + 127) as u32) << 23)
}

/// x (rows, 2·I) = [gate | up] → out (rows, I) = silu(gate) · up, silu(g) = g / (1 + e^−g);
/// `width` is I.
pub fn silu_and_mul(
    x: &[f32],
    out: &mut [f32],
    width: usize,
    rows: usize,
    threads: ThreadCount,
) -> Result<(), KernelError> {
    gated_and_mul("silu_and_mul", x, out, width, rows, threads, |g| {
        g / (1.0 + exp(-g))
    })
}

/// x (rows, 2·I) = [gate | up] → out (rows, I) = gelu_tanh(gate) · up, GELU's tanh
/// approximation as torch computes it: 0.5·g·(1 + tanh(√(2/π)·(g + 0.044715·g³))) (Gemma's
/// GeGLU); `width` is I.
pub fn gelu_tanh_and_mul(
    x: &[f32],
    out: &mut [f32],
    width: usize,
    rows: usize,
    threads: ThreadCount,
) -> Result<(), KernelError> {
    const BETA: f32 = std::f32::consts::SQRT_2 * std::f32::consts::FRAC_2_SQRT_PI * 0.5;
    gated_and_mul("gelu_tanh_and_mul", x, out, width, rows, threads, |g| {
        0.5 * g * (1.0 + (BETA * (g + 0.044715 * (g * g * g))).tanh())
    })
}

/// The gated MLP's shared loop: out[r] = act(gate[r]) · up[r] over rows split between threads.
fn gated_and_mul(
    name: &str,
    x: &[f32],
    out: &mut [f32],
    width: usize,
    rows: usize,
    threads: ThreadCount,
    act: impl Fn(f32) -> f32 + Sync,
) -> Result<(), KernelError> {
    if width == 0 || out.len() != rows * width || x.len() != 2 * rows * width {
        return invalid(format!(
            "{name}: x of {} values and out of {} are not {rows} rows of 2 × {width}",
            x.len(),
            out.len()
        ));
    }
    let outs = SharedMut::new(out.as_mut_ptr());
    over_rows(threads, rows, width, |range| {
        for r in range {
            let (gate, up) = x[2 * r * width..][..2 * width].split_at(width);
            // SAFETY: each row belongs to one range of one thread.
            let out = unsafe { std::slice::from_raw_parts_mut(outs.get().add(r * width), width) };
            for ((o, &g), &u) in out.iter_mut().zip(gate).zip(up) {
                *o = act(g) * u;
            }
        }
    });
    Ok(())
}

/// A (T, H, D) float32 tensor as strided rows: element [t, h, i] at t·row + h·head + i.
#[derive(Debug, Clone, Copy)]
pub struct Heads<'a> {
    pub data: &'a [f32],
    pub tokens: usize,
    pub heads: usize,
    pub head_dim: usize,
    pub row_stride: usize,
    pub head_stride: usize,
}

impl Heads<'_> {
    /// Elements from the first to one past the last of (tokens, heads, head_dim) at these
    /// strides (0 when there are none).
    pub fn extent(
        tokens: usize,
        heads: usize,
        head_dim: usize,
        row_stride: usize,
        head_stride: usize,
    ) -> usize {
        if tokens == 0 || heads == 0 {
            return 0;
        }
        (tokens - 1) * row_stride + (heads - 1) * head_stride + head_dim
    }

    fn check(&self, what: &str) -> Result<(), KernelError> {
        let Heads {
            data,
            tokens,
            heads,
            head_dim,
            row_stride,
            head_stride,
        } = *self;
        if tokens == 0 || heads == 0 {
            return Ok(());
        }
        let last = Self::extent(tokens, heads, head_dim, row_stride, head_stride);
        if head_dim == 0 || data.len() < last {
            return invalid(format!(
                "{what}: ({tokens}, {heads}, {head_dim}) with strides ({row_stride}, \
                 {head_stride}, 1) reaches element {last} of {}",
                data.len()
            ));
        }
        Ok(())
    }

    #[inline(always)]
    fn head(&self, t: usize, h: usize) -> &[f32] {
        &self.data[t * self.row_stride + h * self.head_stride..][..self.head_dim]
    }
}

/// Rotate-half RoPE: out (T, H, D) contiguous, from x with cos and sin (T, D/2):
/// out[.., i] = x1·cos − x2·sin and out[.., i + D/2] = x2·cos + x1·sin, x1 and x2 x's halves.
pub fn rotary(
    x: Heads,
    cos: &[f32],
    sin: &[f32],
    out: &mut [f32],
    threads: ThreadCount,
) -> Result<(), KernelError> {
    x.check("rotary")?;
    let (t, h, d) = (x.tokens, x.heads, x.head_dim);
    let half = d / 2;
    if !d.is_multiple_of(2)
        || cos.len() != t * half
        || sin.len() != cos.len()
        || out.len() != t * h * d
    {
        return invalid(format!(
            "rotary: x ({t}, {h}, {d}), cos {} and sin {} values (want {t} × {half}), out {}",
            cos.len(),
            sin.len(),
            out.len()
        ));
    }
    let outs = SharedMut::new(out.as_mut_ptr());
    over_rows(threads, t, h * d, |range| {
        for token in range {
            let (c, s) = (&cos[token * half..][..half], &sin[token * half..][..half]);
            for head in 0..h {
                let src = x.head(token, head);
                let (x1, x2) = src.split_at(half);
                // SAFETY: each token's rows belong to one range of one thread.
                let dst = unsafe {
                    std::slice::from_raw_parts_mut(outs.get().add((token * h + head) * d), d)
                };
                let (o1, o2) = dst.split_at_mut(half);
                for i in 0..half {
                    o1[i] = x1[i] * c[i] - x2[i] * s[i];
                    o2[i] = x2[i] * c[i] + x1[i] * s[i];
                }
            }
        }
    });
    Ok(())
}

/// A KV cache (num_blocks, block_size, H_kv, D) as written: float32, or bfloat16's bits.
pub enum CacheMut<'a> {
    F32(&'a mut [f32]),
    Bf16(&'a mut [u16]),
}

impl CacheMut<'_> {
    fn len(&self) -> usize {
        match self {
            CacheMut::F32(c) => c.len(),
            CacheMut::Bf16(c) => c.len(),
        }
    }

    fn write(&mut self, at: usize, values: &[f32]) {
        match self {
            CacheMut::F32(c) => c[at..][..values.len()].copy_from_slice(values),
            CacheMut::Bf16(c) => {
                for (o, &v) in c[at..][..values.len()].iter_mut().zip(values) {
                    *o = to_bf16(v);
                }
            }
        }
    }
}

/// float32 → bfloat16 bits, rounded to nearest even as torch's conversion (NaN stays NaN).
#[inline(always)]
pub(crate) fn to_bf16(x: f32) -> u16 {
    let bits = x.to_bits();
    if x.is_nan() {
        return ((bits >> 16) | 0x40) as u16;
    }
    let round = 0x7fff + ((bits >> 16) & 1);
    (bits.wrapping_add(round) >> 16) as u16
}

/// Token t's K and V (H_kv, D) into slot `slots[t]` of the caches (slot = block · block_size +
/// offset, so the slot's row starts at slot · H_kv · D).
pub fn kv_write(
    k: Heads,
    v: Heads,
    slots: &[i64],
    mut k_cache: CacheMut,
    mut v_cache: CacheMut,
) -> Result<(), KernelError> {
    k.check("kv_write k")?;
    v.check("kv_write v")?;
    let row = k.heads * k.head_dim;
    if (v.tokens, v.heads, v.head_dim) != (k.tokens, k.heads, k.head_dim)
        || slots.len() != k.tokens
        || row == 0
        || k_cache.len() != v_cache.len()
        || !k_cache.len().is_multiple_of(row)
    {
        return invalid(format!(
            "kv_write: k ({}, {}, {}), v ({}, {}, {}), {} slots and caches of {} and {} values \
             do not fit together",
            k.tokens,
            k.heads,
            k.head_dim,
            v.tokens,
            v.heads,
            v.head_dim,
            slots.len(),
            k_cache.len(),
            v_cache.len()
        ));
    }
    let capacity = k_cache.len() / row;
    if let Some(bad) = slots.iter().find(|&&s| s < 0 || s as usize >= capacity) {
        return invalid(format!(
            "kv_write: slot {bad} is outside the cache's {capacity}"
        ));
    }
    for (t, &slot) in slots.iter().enumerate() {
        for h in 0..k.heads {
            let at = slot as usize * row + h * k.head_dim;
            k_cache.write(at, k.head(t, h));
            v_cache.write(at, v.head(t, h));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn values(n: usize, seed: u32) -> Vec<f32> {
        let mut state = seed.wrapping_mul(2654435761).wrapping_add(1);
        (0..n)
            .map(|_| {
                state = state.wrapping_mul(1664525).wrapping_add(1013904223);
                (state >> 8) as f32 / (1u32 << 24) as f32 * 4.0 - 2.0
            })
            .collect()
    }

    fn close(a: &[f32], b: &[f32], tolerance: f32) {
        assert_eq!(a.len(), b.len());
        for (i, (x, y)) in a.iter().zip(b).enumerate() {
            assert!(
                (x - y).abs() <= tolerance * (1.0 + y.abs()),
                "element {i}: {x} against {y}"
            );
        }
    }

    #[test]
    fn rms_norm_with_and_without_the_residual_add_on_one_and_many_threads() {
        for (rows, hidden) in [(1, 7), (3, 64), (300, 256)] {
            let weight = values(hidden, 1);
            let x0 = values(rows * hidden, 2);
            let branch = values(rows * hidden, 3);
            for threads in [1, 2, 3] {
                for add in [false, true] {
                    let mut x = x0.clone();
                    let mut out = vec![0.0; x.len()];
                    let b = add.then_some(branch.as_slice());
                    add_rms_norm(
                        &mut x,
                        b,
                        &weight,
                        1e-5,
                        &mut out,
                        ThreadCount::new(threads),
                    )
                    .unwrap();
                    let mut want_sum = x0.clone();
                    if add {
                        for (a, b) in want_sum.iter_mut().zip(&branch) {
                            *a += b;
                        }
                    }
                    assert_eq!(x, want_sum);
                    let mut want = vec![0.0; x.len()];
                    for r in 0..rows {
                        let row = &want_sum[r * hidden..][..hidden];
                        let ms = row.iter().map(|v| (v * v) as f64).sum::<f64>() / hidden as f64;
                        let inv = 1.0 / (ms + 1e-5).sqrt();
                        for i in 0..hidden {
                            want[r * hidden + i] = (weight[i] as f64 * row[i] as f64 * inv) as f32;
                        }
                    }
                    close(&out, &want, 1e-5);
                }
            }
        }
    }

    #[test]
    fn silu_and_mul_matches_the_formula_over_rows_and_extremes() {
        let (rows, width) = (70, 600);
        let mut x = values(rows * 2 * width, 4);
        x[0] = -100.0;
        x[1] = 100.0;
        x[2] = 0.0;
        let mut out = vec![0.0; rows * width];
        silu_and_mul(&x, &mut out, width, rows, ThreadCount::new(2)).unwrap();
        for r in 0..rows {
            for i in 0..width {
                let (g, u) = (
                    x[r * 2 * width + i] as f64,
                    x[r * 2 * width + width + i] as f64,
                );
                let want = (g / (1.0 + (-g).exp()) * u) as f32;
                let got = out[r * width + i];
                assert!(
                    (got - want).abs() <= 1e-6 * (1.0 + want.abs()),
                    "{got} vs {want}"
                );
            }
        }
        assert!(silu_and_mul(&x, &mut out, width, rows + 1, ThreadCount::new(1)).is_err());
    }

    #[test]
    fn gelu_tanh_and_mul_matches_the_formula() {
        let (rows, width) = (3, 50);
        let x = values(rows * 2 * width, 11);
        let mut out = vec![0.0; rows * width];
        gelu_tanh_and_mul(&x, &mut out, width, rows, ThreadCount::new(2)).unwrap();
        for r in 0..rows {
            for i in 0..width {
                let (g, u) = (
                    x[r * 2 * width + i] as f64,
                    x[r * 2 * width + width + i] as f64,
                );
                let inner = (2.0 / std::f64::consts::PI).sqrt() * (g + 0.044715 * g * g * g);
                let want = (0.5 * g * (1.0 + inner.tanh()) * u) as f32;
                let got = out[r * width + i];
                assert!(
                    (got - want).abs() <= 1e-6 * (1.0 + want.abs()),
                    "{got} vs {want}"
                );
            }
        }
        assert!(gelu_tanh_and_mul(&x, &mut out, width, rows + 1, ThreadCount::new(1)).is_err());
    }

    #[test]
    fn rotary_reads_strided_rows_and_rotates_each_half() {
        let (t, h, d, row) = (5, 3, 8, 40); // rows of 40 values: heads at 0, 8, 16
        let data = values(t * row, 5);
        let x = Heads {
            data: &data,
            tokens: t,
            heads: h,
            head_dim: d,
            row_stride: row,
            head_stride: d,
        };
        let (cos, sin) = (values(t * d / 2, 6), values(t * d / 2, 7));
        let mut out = vec![0.0; t * h * d];
        rotary(x, &cos, &sin, &mut out, ThreadCount::new(2)).unwrap();
        for tok in 0..t {
            for head in 0..h {
                for i in 0..d / 2 {
                    let x1 = data[tok * row + head * d + i];
                    let x2 = data[tok * row + head * d + i + d / 2];
                    let (c, s) = (cos[tok * d / 2 + i], sin[tok * d / 2 + i]);
                    let at = (tok * h + head) * d + i;
                    assert_eq!(out[at], x1 * c - x2 * s);
                    assert_eq!(out[at + d / 2], x2 * c + x1 * s);
                }
            }
        }
        let short = Heads {
            data: &data[..100],
            ..x
        };
        assert!(rotary(short, &cos, &sin, &mut out, ThreadCount::new(1)).is_err());
    }

    #[test]
    fn kv_write_fills_named_slots_in_float32_and_bfloat16() {
        let (t, h, d) = (3, 2, 4);
        let (kd, vd) = (values(t * h * d, 8), values(t * h * d, 9));
        let heads = |data| Heads {
            data,
            tokens: t,
            heads: h,
            head_dim: d,
            row_stride: h * d,
            head_stride: d,
        };
        let slots = [5i64, 0, 9];
        let (mut kc, mut vc) = (vec![0f32; 10 * h * d], vec![0f32; 10 * h * d]);
        kv_write(
            heads(&kd),
            heads(&vd),
            &slots,
            CacheMut::F32(&mut kc),
            CacheMut::F32(&mut vc),
        )
        .unwrap();
        for (i, &s) in slots.iter().enumerate() {
            let s = s as usize;
            assert_eq!(kc[s * h * d..][..h * d], kd[i * h * d..][..h * d]);
            assert_eq!(vc[s * h * d..][..h * d], vd[i * h * d..][..h * d]);
        }
        let (mut kb, mut vb) = (vec![0u16; 10 * h * d], vec![0u16; 10 * h * d]);
        kv_write(
            heads(&kd),
            heads(&vd),
            &slots,
            CacheMut::Bf16(&mut kb),
            CacheMut::Bf16(&mut vb),
        )
        .unwrap();
        let back = f32::from_bits((kb[5 * h * d] as u32) << 16);
        assert!((back - kd[0]).abs() <= kd[0].abs() / 128.0);
        let bad = [5i64, 0, 10];
        assert!(kv_write(
            heads(&kd),
            heads(&vd),
            &bad,
            CacheMut::F32(&mut kc),
            CacheMut::F32(&mut vc)
        )
        .is_err());
    }

    #[test]
    fn bfloat16_rounds_to_nearest_even() {
        assert_eq!(to_bf16(1.0), 0x3f80);
        assert_eq!(to_bf16(f32::from_bits(0x3f80_8000)), 0x3f80); // tie, even stays
        assert_eq!(to_bf16(f32::from_bits(0x3f81_8000)), 0x3f82); // tie, odd rounds up
        assert_eq!(to_bf16(f32::from_bits(0x3f80_8001)), 0x3f81);
        assert!(f32::from_bits((to_bf16(f32::NAN) as u32) << 16).is_nan());
    }
}
