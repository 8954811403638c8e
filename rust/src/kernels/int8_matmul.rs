//! y = x Wᵀ for W4A8 / W8A8 layers: activations quantized per block of 32 (`quantize`), the
//! weights in `PackedWeights`' layout, int32 sums per block, float scales.
//!
//! Work is cut by weight tiles (16 output rows) across the pool's threads, so each thread
//! streams its own share of the weights. Activation rows go through a tile MR at a time (the
//! GEMV for M ≤ MR reads every weight byte once); for larger M the rows are taken in panels
//! of `PANEL_ROWS`, so a panel of quantized activations stays in L2 while each tile's weights
//! are read once per panel (a tiled GEMM).

use std::cell::RefCell;

use super::isa::Isa;
use super::packed::{PackedWeights, TILE};
use super::pool::{split, ThreadCount};
use super::quantize::{
    quantize_rows, Activations, QuantizedRows, SharedMut, BLOCK, RESIDUAL_STEPS,
};
use super::KernelError;

/// Rows of activations per GEMM panel (64 rows x K bytes of int8: L2-resident).
pub const PANEL_ROWS: usize = 64;

/// A tile kernel: 16 output columns of MR rows, written at out[(m0 + r) * n + tile * 16 ..].
type TileFn = unsafe fn(&PackedWeights, usize, &QuantizedRows, usize, *mut f32, usize);

/// The largest MR the path holds in registers (the tile's accumulators).
pub fn max_rows(isa: Isa) -> usize {
    match isa {
        Isa::Avx2 | Isa::AvxVnni => 4,
        Isa::Scalar | Isa::Avx512Vnni => 8,
    }
}

/// The portable tile kernel: the same layout and arithmetic as the SIMD ones, one lane at a
/// time.
unsafe fn tile_scalar<const MR: usize, const BITS: u8, const SPLIT: bool>(
    w: &PackedWeights,
    tile: usize,
    x: &QuantizedRows,
    m0: usize,
    out: *mut f32,
    n: usize,
) {
    let per = w.tile_block_bytes();
    let data = w.tile_data(tile);
    let valid = (n - tile * TILE).min(TILE);
    for r in 0..MR {
        let mut y = [0f32; TILE];
        for b in 0..w.blocks {
            let tb = &data[b * per..(b + 1) * per];
            let at = ((m0 + r) * x.blocks + b) * BLOCK;
            let xs = &x.values[at..at + BLOCK];
            let rs = if SPLIT {
                &x.residuals[at..at + BLOCK]
            } else {
                xs
            };
            let (mut acc, mut rest) = ([0i32; TILE], [0i32; TILE]);
            for (c, (&xv, &rv)) in xs.iter().zip(rs).enumerate() {
                let (j, i) = (c / 4, c % 4);
                for (lane, a) in acc.iter_mut().enumerate() {
                    let q = if BITS == 8 {
                        tb[j * 64 + lane * 4 + i]
                    } else {
                        let byte = tb[(j % 4) * 64 + lane * 4 + i];
                        if j < 4 {
                            byte & 0xF
                        } else {
                            byte >> 4
                        }
                    };
                    *a += q as i32 * xv as i32;
                    rest[lane] += q as i32 * rv as i32;
                }
            }
            let sc = w.tile_scales(tile, w.group_of(b));
            let i = (m0 + r) * x.blocks + b;
            let (d, sum) = (x.scales[i], x.sums[i]);
            for lane in 0..TILE {
                y[lane] = (acc[lane] as f32).mul_add(sc[lane] * d, y[lane]);
                if SPLIT {
                    let sd_rest = sc[lane] * (d / RESIDUAL_STEPS);
                    y[lane] = (rest[lane] as f32).mul_add(sd_rest, y[lane]);
                }
                y[lane] -= (sc[lane] * sc[TILE + lane]) * (d * sum);
            }
        }
        std::ptr::copy_nonoverlapping(y.as_ptr(), out.add((m0 + r) * n + tile * TILE), valid);
    }
}

macro_rules! by_rows {
    ($f:ident, $rows:expr, $bits:literal, $split:literal $(, $nt:literal)?) => {
        match $rows {
            1 => $f::<1, $bits, $split $(, $nt)?> as TileFn,
            2 => $f::<2, $bits, $split $(, $nt)?>,
            3 => $f::<3, $bits, $split $(, $nt)?>,
            4 => $f::<4, $bits, $split $(, $nt)?>,
            5 => $f::<5, $bits, $split $(, $nt)?>,
            6 => $f::<6, $bits, $split $(, $nt)?>,
            7 => $f::<7, $bits, $split $(, $nt)?>,
            _ => $f::<8, $bits, $split $(, $nt)?>,
        }
    };
}

macro_rules! pick {
    ($f:ident, $rows:expr, $bits:expr, $split:expr $(, $nt:literal)?) => {
        match ($bits, $split) {
            (4, false) => by_rows!($f, $rows, 4, false $(, $nt)?),
            (4, true) => by_rows!($f, $rows, 4, true $(, $nt)?),
            (_, false) => by_rows!($f, $rows, 8, false $(, $nt)?),
            (_, true) => by_rows!($f, $rows, 8, true $(, $nt)?),
        }
    };
}

/// Rows of a panel the two-tile AVX-512 kernel takes at once (2·MR accumulators, twice that
/// with the second activation term, and 2·MR outputs in 32 registers).
const PAIR_ROWS: usize = 4;

/// The two-tile kernel for the GEMM (M past the GEMV's rows), where the ISA has one.
fn pair_fn(isa: Isa, rows: usize, bits: u8, split: bool) -> Option<TileFn> {
    #[cfg(target_arch = "x86_64")]
    if isa == Isa::Avx512Vnni {
        use super::int8_x86::tile_avx512;
        return Some(pick!(tile_avx512, rows, bits, split, 2));
    }
    let _ = (isa, rows, bits, split);
    None
}

fn tile_fn(isa: Isa, rows: usize, bits: u8, split: bool) -> TileFn {
    #[cfg(target_arch = "x86_64")]
    {
        use super::int8_x86::{tile_avx2, tile_avx512, tile_avxvnni};
        match isa {
            Isa::Avx512Vnni => return pick!(tile_avx512, rows, bits, split, 1),
            Isa::AvxVnni => return pick!(tile_avxvnni, rows, bits, split),
            Isa::Avx2 => return pick!(tile_avx2, rows, bits, split),
            Isa::Scalar => {}
        }
    }
    pick!(tile_scalar, rows, bits, split)
}

/// out (m, n) = x (m, k) · Wᵀ, on `isa` (which must be supported: `Isa::supported`), the
/// activations quantized as `activations` says.
pub fn int8_matmul(
    x: &[f32],
    m: usize,
    w: &PackedWeights,
    out: &mut [f32],
    activations: Activations,
    isa: Isa,
    threads: ThreadCount,
) -> Result<(), KernelError> {
    thread_local! {
        static SCRATCH: RefCell<QuantizedRows> = RefCell::new(QuantizedRows::default());
    }
    if !isa.supported() {
        return Err(KernelError::InvalidArgument(format!(
            "this CPU cannot run {isa}"
        )));
    }
    if out.len() != m * w.n {
        return Err(KernelError::InvalidArgument(format!(
            "the output holds {} values, not {m} x {}",
            out.len(),
            w.n
        )));
    }
    if m == 0 {
        return Ok(());
    }
    SCRATCH.with_borrow_mut(|xq| {
        quantize_rows(x, m, w.k, activations, threads, xq)?;
        matmul_quantized(xq, w, out, isa, threads);
        Ok(())
    })
}

/// The matmul over already quantized activations.
pub fn matmul_quantized(
    x: &QuantizedRows,
    w: &PackedWeights,
    out: &mut [f32],
    isa: Isa,
    threads: ThreadCount,
) {
    assert!(isa.supported() && x.blocks == w.blocks && out.len() == x.rows * w.n);
    let (m, n, mr) = (x.rows, w.n, max_rows(isa));
    let out = SharedMut::new(out.as_mut_ptr());
    let pairs = m > mr && pair_fn(isa, 1, w.bits, x.split()).is_some();
    // Threads take whole pairs of tiles when the GEMM kernel pairs them.
    let unit = if pairs { 2 } else { 1 };
    split(threads, w.tiles.div_ceil(unit), |units| {
        let tiles = units.start * unit..(units.end * unit).min(w.tiles);
        for panel in (0..m).step_by(PANEL_ROWS) {
            let panel_end = (panel + PANEL_ROWS).min(m);
            for tile in tiles.clone().step_by(unit) {
                let paired = pairs && tile + 1 < tiles.end; // else a last, lone tile
                let step = if paired { PAIR_ROWS } else { mr };
                for m0 in (panel..panel_end).step_by(step) {
                    let rows = step.min(panel_end - m0);
                    let kernel = match paired {
                        true => pair_fn(isa, rows, w.bits, x.split()).expect("checked above"),
                        false => tile_fn(isa, rows, w.bits, x.split()),
                    };
                    // SAFETY: `isa` is supported; the kernel writes rows m0..m0+rows of columns
                    // tile*16.. (< n; a pair only where tile + 1 exists) of `out`, a part no
                    // other thread writes.
                    unsafe { kernel(w, tile, x, m0, out.get(), n) };
                }
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A small deterministic generator (xorshift), so the tests need no crate.
    struct Rng(u64);

    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0
        }
        fn below(&mut self, n: u64) -> u64 {
            self.next() % n
        }
        fn normal(&mut self) -> f32 {
            let u = (self.below(1 << 24) as f32 + 0.5) / (1 << 24) as f32;
            let v = (self.below(1 << 24) as f32 + 0.5) / (1 << 24) as f32;
            (-2.0 * u.ln()).sqrt() * (std::f32::consts::TAU * v).cos()
        }
    }

    struct Case {
        n: usize,
        k: usize,
        bits: u8,
        groups: usize,
        symmetric: bool,
    }

    struct Weights {
        q: Vec<u8>,
        s: Vec<f32>,
        z: Vec<f32>,
    }

    fn weights(case: &Case, rng: &mut Rng) -> Weights {
        let levels = 1u64 << case.bits;
        let q = (0..case.n * case.k)
            .map(|_| rng.below(levels) as u8)
            .collect();
        let count = case.n * case.groups;
        let s = (0..count)
            .map(|_| 0.01 + rng.below(1000) as f32 * 1e-4)
            .collect();
        let z = (0..count)
            .map(|_| {
                if case.symmetric {
                    (levels / 2) as f32
                } else {
                    rng.below(levels) as f32
                }
            })
            .collect();
        Weights { q, s, z }
    }

    /// The quantized math in f64, from the unpacked integers: y and Σ|terms| (for the bound).
    fn reference(x: &QuantizedRows, w: &Weights, case: &Case) -> (Vec<f64>, Vec<f64>) {
        let (n, k) = (case.n, case.k);
        let group = k / case.groups;
        let mut y = vec![0f64; x.rows * n];
        let mut magnitude = vec![0f64; x.rows * n];
        for m in 0..x.rows {
            for o in 0..n {
                for c in 0..k {
                    let (b, g) = (c / BLOCK, c / group);
                    let at = (m * x.blocks + b) * BLOCK + c % BLOCK;
                    let mut xv = x.values[at] as f64;
                    if x.split() {
                        xv += x.residuals[at] as f64 / RESIDUAL_STEPS as f64;
                    }
                    let d = x.scales[m * x.blocks + b] as f64;
                    let (s, z) = (
                        w.s[o * case.groups + g] as f64,
                        w.z[o * case.groups + g] as f64,
                    );
                    let term = d * xv * (w.q[o * k + c] as f64 - z) * s;
                    y[m * n + o] += term;
                    magnitude[m * n + o] += term.abs();
                }
            }
        }
        (y, magnitude)
    }

    fn check(case: Case, m: usize, rng: &mut Rng, x: Option<Vec<f32>>) {
        let w = weights(&case, rng);
        let packed = PackedWeights::pack(&w.q, &w.s, &w.z, case.n, case.k, case.bits).unwrap();
        let x = x.unwrap_or_else(|| (0..m * case.k).map(|_| rng.normal()).collect());
        let mut xq = QuantizedRows::default();
        for activations in [Activations::Int8, Activations::Int8x2] {
            quantize_rows(&x, m, case.k, activations, ThreadCount::new(1), &mut xq).unwrap();
            let (want, magnitude) = reference(&xq, &w, &case);
            for isa in Isa::supported_paths() {
                for threads in [1, 2, 3] {
                    let mut got = vec![f32::NAN; m * case.n];
                    let t = ThreadCount::new(threads);
                    int8_matmul(&x, m, &packed, &mut got, activations, isa, t).unwrap();
                    for i in 0..m * case.n {
                        let bound = 1e-5 * magnitude[i] + 1e-6;
                        assert!(
                        (got[i] as f64 - want[i]).abs() <= bound,
                        "{isa} {activations:?} n={} k={} bits={} groups={} sym={} m={m} threads={threads}: \
                         y[{}, {}] = {} want {}",
                        case.n,
                        case.k,
                        case.bits,
                        case.groups,
                        case.symmetric,
                        i / case.n,
                        i % case.n,
                        got[i],
                        want[i]
                    );
                    }
                }
            }
        }
    }

    #[test]
    fn every_path_matches_the_reference_on_random_shapes() {
        let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
        for bits in [4u8, 8] {
            for symmetric in [true, false] {
                for (k, groups) in [(96, 3), (128, 2), (256, 2), (64, 1), (200, 1), (37, 1)] {
                    let n = 1 + rng.below(40) as usize;
                    for m in [1, 2, 3, 5, 8, 9, 13] {
                        check(
                            Case {
                                n,
                                k,
                                bits,
                                groups,
                                symmetric,
                            },
                            m,
                            &mut rng,
                            None,
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn large_m_crosses_panels() {
        let mut rng = Rng(7);
        for m in [65, 130, 512] {
            let case = Case {
                n: 33,
                k: 128,
                bits: 4,
                groups: 4,
                symmetric: false,
            };
            check(case, m, &mut rng, None);
        }
        let case = Case {
            n: 19,
            k: 160,
            bits: 8,
            groups: 5,
            symmetric: true,
        };
        check(case, 200, &mut rng, None);
    }

    #[test]
    fn saturating_and_zero_inputs() {
        let mut rng = Rng(3);
        let k = 96;
        // Every activation at ±max: xq = ±127 in every block; extreme weights 0 and 2^b − 1.
        let x: Vec<f32> = (0..2 * k)
            .map(|i| if i % 3 == 0 { -4.0 } else { 4.0 })
            .collect();
        for bits in [4u8, 8] {
            check(
                Case {
                    n: 17,
                    k,
                    bits,
                    groups: 3,
                    symmetric: false,
                },
                2,
                &mut rng,
                Some(x.clone()),
            );
            check(
                Case {
                    n: 17,
                    k,
                    bits,
                    groups: 1,
                    symmetric: true,
                },
                2,
                &mut rng,
                Some(vec![0.0; 2 * k]),
            );
        }
        // The weight extremes, against the largest activations.
        let (n, bits) = (16, 8u8);
        let q: Vec<u8> = (0..n * k)
            .map(|i| if i % 2 == 0 { 255 } else { 0 })
            .collect();
        let packed = PackedWeights::pack(&q, &[1.0; 16], &[0.0; 16], n, k, bits).unwrap();
        let x = vec![-1.0f32; k];
        for isa in Isa::supported_paths() {
            let mut y = vec![0f32; n];
            int8_matmul(
                &x,
                1,
                &packed,
                &mut y,
                Activations::Int8,
                isa,
                ThreadCount::new(1),
            )
            .unwrap();
            // Σ over 48 columns of 255 · (−127 · d), d = 1/127.
            assert!(
                y.iter().all(|&v| (v + 48.0 * 255.0).abs() < 1e-2),
                "{isa}: {y:?}"
            );
        }
    }

    #[test]
    fn close_to_the_float_product() {
        // |x − xq·d| ≤ d/2 per value, so |y − x·wᵀ| ≤ Σ_k d_b/2 · |w_k|.
        let mut rng = Rng(11);
        let case = Case {
            n: 24,
            k: 160,
            bits: 4,
            groups: 5,
            symmetric: false,
        };
        let w = weights(&case, &mut rng);
        let packed = PackedWeights::pack(&w.q, &w.s, &w.z, case.n, case.k, 4).unwrap();
        let x: Vec<f32> = (0..3 * case.k).map(|_| rng.normal()).collect();
        let mut xq = QuantizedRows::default();
        quantize_rows(
            &x,
            3,
            case.k,
            Activations::Int8,
            ThreadCount::new(1),
            &mut xq,
        )
        .unwrap();
        let mut y = vec![0f32; 3 * case.n];
        int8_matmul(
            &x,
            3,
            &packed,
            &mut y,
            Activations::Int8,
            Isa::best(),
            ThreadCount::new(2),
        )
        .unwrap();
        for m in 0..3 {
            for o in 0..case.n {
                let (mut exact, mut bound) = (0f64, 1e-4);
                for c in 0..case.k {
                    let g = c / 32;
                    let wv = (w.q[o * case.k + c] as f64 - w.z[o * 5 + g] as f64)
                        * w.s[o * 5 + g] as f64;
                    exact += x[m * case.k + c] as f64 * wv;
                    bound += xq.scales[m * xq.blocks + c / BLOCK] as f64 / 2.0 * wv.abs();
                }
                assert!((y[m * case.n + o] as f64 - exact).abs() <= bound);
            }
        }
    }

    #[test]
    fn non_finite_activations_and_bad_shapes_are_errors() {
        let packed = PackedWeights::pack(&[1; 64], &[1.0; 2], &[0.0; 2], 2, 32, 8).unwrap();
        let mut x = vec![0.5f32; 32];
        x[7] = f32::INFINITY;
        let mut y = vec![0f32; 2];
        let err = int8_matmul(
            &x,
            1,
            &packed,
            &mut y,
            Activations::Int8,
            Isa::Scalar,
            ThreadCount::new(1),
        );
        assert!(matches!(err, Err(KernelError::NotFinite(_))));
        x[7] = 0.5;
        let mut short = vec![0f32; 1];
        assert!(int8_matmul(
            &x,
            1,
            &packed,
            &mut short,
            Activations::Int8,
            Isa::Scalar,
            ThreadCount::new(1)
        )
        .is_err());
        assert!(int8_matmul(
            &x[..31],
            1,
            &packed,
            &mut y,
            Activations::Int8,
            Isa::Scalar,
            ThreadCount::new(1)
        )
        .is_err());
    }
}
