//! y = x Wᵀ for W4A8 / W8A8 layers: activations quantized per block of 32 (`quantize`), the
//! weights in `PackedWeights`' layout, int32 sums per block, float scales.
//!
//! A kernel call multiplies MR rows of activations by one weight tile (16 output columns) over
//! a range of K's blocks, its int32 and float sums held in registers. The activations are
//! quantized once per call, and the work cut into units of (a panel of rows, a tile), shared
//! out among the pool's threads: over N, and over M as well when N has few tiles. The GEMV
//! (M ≤ MR) reads every weight byte once. The GEMM (larger M) is blocked like BLIS: K in chunks
//! whose tile of weights (16 KiB) stays in L1 while every MR-row step of the panel reads it,
//! the panel's activations in L2, the output summed across the chunks in place.

use std::cell::RefCell;
use std::ops::Range;

use super::isa::Isa;
use super::packed::{PackedWeights, TILE};
use super::pool::{split, ThreadCount};
use super::quantize::{quantize_rows, Activations, QuantizedRows, SharedMut, BLOCK};
use super::KernelError;

/// Rows of activations per panel, at most: the panel's int8 rows stay in L2 (192 x K bytes)
/// while each tile's weights pass by.
const PANEL_ROWS: usize = 192;
/// Bytes of a tile's weights per chunk of K: half of L1, read by every MR-row step of the
/// panel, the other half for the activations and outputs streaming past.
const CHUNK_BYTES: usize = 16 * 1024;

/// The operands of one matmul, shared by the kernels. Per output, the kernels sum
///
///   y[m, n] = Σ_groups s · Σ_blocks (f32(Σ xq·q) · d − z · (d · Σxq))
///
/// the inner sum (`yg`, in units of the weight's steps) per block, with one convert and two
/// fmas; the scale s once per group. The zero point is taken off block by block, so the float
/// sums never grow much past the block's own size (weights whose q sits near a large z, as
/// min-max quantization makes them beside outlier channels, would cancel badly otherwise).
///
/// With one integer zero point for the whole weight (`PackedWeights::uniform_zero`), the
/// kernels start each block's int32 sums at −z·Σxq instead (exact, and no float work: the
/// weight's zero point is most often the same z = 2^(bits−1) everywhere).
pub(super) struct Operands<'a> {
    pub w: &'a PackedWeights,
    pub x: &'a QuantizedRows,
    /// With a uniform zero point: (rows, blocks, terms) −z·Σxq (then −z·Σxr), the AVX-512 and
    /// portable kernels' start of each block (the 256-bit ones offset z by 128); else empty.
    pub zero_offsets: &'a [i32],
    /// (rows, n) float32.
    pub out: SharedMut<f32>,
    pub n: usize,
}

/// The blocks of one weight group a kernel call covers from block `b` on, and what the output
/// holds around them. Between calls `out` holds the finished groups' sum; a call may also stop
/// inside the first group (a chunk of K shorter than the group), and then `out` holds that
/// group's unscaled Σ f32(Σ xq·q)·d until the call that finishes it.
pub(super) struct Segment {
    pub blocks: Range<usize>,
    pub group: usize,
    /// The group began in an earlier call: its unscaled sums are in `out`.
    pub resumes: bool,
    /// The group ends here: scale it and add it to `out`; else store its unscaled sums.
    pub ends_group: bool,
    /// Groups before this one are summed in `out`.
    pub adds: bool,
}

impl Segment {
    #[inline(always)]
    pub fn new(w: &PackedWeights, b: usize, end: usize) -> Segment {
        let group = w.group_of(b);
        let start = group * blocks_per_group(w);
        let group_end = (start + blocks_per_group(w)).min(w.blocks);
        let stop = group_end.min(end);
        debug_assert!(start == 0 || (b == start && stop == group_end));
        Segment {
            blocks: b..stop,
            group,
            resumes: b > start,
            ends_group: stop == group_end,
            adds: start > 0,
        }
    }
}

fn blocks_per_group(w: &PackedWeights) -> usize {
    if w.groups == 1 {
        w.blocks
    } else {
        w.group_size / BLOCK
    }
}

/// A kernel: MR rows from m0, the tile `tile`, over a range of blocks (see `Segment`).
type KernelFn = unsafe fn(&Operands, usize, usize, Range<usize>);

/// The rows a kernel call takes: its sums in registers (2·MR of AVX-512's 32, 3·MR with the
/// second term).
fn max_rows(isa: Isa) -> usize {
    match isa {
        Isa::Avx2 | Isa::AvxVnni => 4,
        Isa::Scalar | Isa::Avx512Vnni => 8,
    }
}

/// The portable kernel: the same layout and arithmetic as the SIMD ones, one lane at a time.
unsafe fn gemm_scalar<const MR: usize, const BITS: u8, const SPLIT: bool, const UNIFORM: bool>(
    op: &Operands,
    tile: usize,
    m0: usize,
    blocks: Range<usize>,
) {
    let (w, x) = (op.w, op.x);
    let per = w.tile_block_bytes();
    let data = w.tile_data(tile);
    let valid = (op.n - tile * TILE).min(TILE);
    for row in m0..m0 + MR {
        let out = std::slice::from_raw_parts_mut(op.out.get().add(row * op.n + tile * TILE), valid);
        let mut b = blocks.start;
        while b < blocks.end {
            let seg = Segment::new(w, b, blocks.end);
            let mut yg = [0f32; TILE];
            if seg.resumes {
                yg[..valid].copy_from_slice(out);
            }
            let sc = w.tile_scales(tile, seg.group);
            for bb in seg.blocks.clone() {
                let tb = &data[bb * per..(bb + 1) * per];
                let at = (row * x.blocks + bb) * BLOCK;
                let xs = &x.values[at..at + BLOCK];
                let rs = if SPLIT {
                    &x.residuals[at..at + BLOCK]
                } else {
                    xs
                };
                let i = row * x.blocks + bb;
                let (mut acc, mut rest) = ([0i32; TILE], [0i32; TILE]);
                if UNIFORM {
                    let terms = if SPLIT { 2 } else { 1 };
                    acc = [op.zero_offsets[i * terms]; TILE];
                    if SPLIT {
                        rest = [op.zero_offsets[i * 2 + 1]; TILE];
                    }
                }
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
                let (d, dsum) = (x.scales[i], x.scaled_sums[i]);
                for lane in 0..TILE {
                    yg[lane] = (acc[lane] as f32).mul_add(d, yg[lane]);
                    if SPLIT {
                        yg[lane] = (rest[lane] as f32).mul_add(x.residual_scales[i], yg[lane]);
                    }
                    if !UNIFORM {
                        yg[lane] = (-sc[TILE + lane]).mul_add(dsum, yg[lane]);
                    }
                }
            }
            if !seg.ends_group {
                out.copy_from_slice(&yg[..valid]);
            } else {
                for (lane, y) in out.iter_mut().enumerate() {
                    let prev = if seg.adds { *y } else { 0.0 };
                    *y = yg[lane].mul_add(sc[lane], prev);
                }
            }
            b = seg.blocks.end;
        }
    }
}

macro_rules! by_rows {
    ($f:ident, $rows:expr, $($c:tt),*) => {
        match $rows {
            1 => $f::<1, $($c),*> as KernelFn,
            2 => $f::<2, $($c),*>,
            3 => $f::<3, $($c),*>,
            4 => $f::<4, $($c),*>,
            5 => $f::<5, $($c),*>,
            6 => $f::<6, $($c),*>,
            7 => $f::<7, $($c),*>,
            _ => $f::<8, $($c),*>,
        }
    };
}

macro_rules! pick {
    ($f:ident, $rows:expr, $bits:expr, $split:expr, $uniform:expr) => {
        match ($bits, $split, $uniform) {
            (4, false, false) => by_rows!($f, $rows, 4, false, false),
            (4, true, false) => by_rows!($f, $rows, 4, true, false),
            (_, false, false) => by_rows!($f, $rows, 8, false, false),
            (_, true, false) => by_rows!($f, $rows, 8, true, false),
            (4, false, true) => by_rows!($f, $rows, 4, false, true),
            (4, true, true) => by_rows!($f, $rows, 4, true, true),
            (_, false, true) => by_rows!($f, $rows, 8, false, true),
            (_, true, true) => by_rows!($f, $rows, 8, true, true),
        }
    };
}

/// The kernel of `rows` rows on `isa`; `uniform`: the weight has one integer zero point.
fn kernel(isa: Isa, rows: usize, bits: u8, split: bool, uniform: bool) -> KernelFn {
    #[cfg(target_arch = "x86_64")]
    {
        use super::int8_x86::{gemm_avx2, gemm_avx512, gemm_avxvnni};
        match isa {
            Isa::Avx512Vnni => return pick!(gemm_avx512, rows, bits, split, uniform),
            Isa::AvxVnni => return pick!(gemm_avxvnni, rows, bits, split, uniform),
            Isa::Avx2 => return pick!(gemm_avx2, rows, bits, split, uniform),
            Isa::Scalar => {}
        }
    }
    pick!(gemm_scalar, rows, bits, split, uniform)
}

/// How a call's work is cut: kernel calls of `rows` rows and one tile, K in chunks of `chunk`
/// blocks, M in panels of `panel` rows; the units (panel, tile) are shared among the threads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Blocking {
    rows: usize,
    chunk: usize,
    panel: usize,
}

impl Blocking {
    fn new(isa: Isa, m: usize, w: &PackedWeights, threads: ThreadCount) -> Blocking {
        let rows = max_rows(isa);
        if m <= rows {
            // The GEMV: every weight byte read once, whole rows of K.
            return Blocking {
                rows,
                chunk: w.blocks,
                panel: rows,
            };
        }
        // K in balanced chunks of whole groups (or of blocks, with one group per row).
        let tile_block = TILE * BLOCK * w.bits as usize / 8;
        let per_group = if w.groups == 1 {
            1
        } else {
            blocks_per_group(w)
        };
        let most = (CHUNK_BYTES / tile_block / per_group).max(1);
        let units = w.blocks.div_ceil(per_group);
        let chunk = units.div_ceil(units.div_ceil(most)) * per_group;
        // M in balanced panels, enough of them for every thread to have two units.
        let wanted = (2 * threads.get()).div_ceil(w.tiles);
        let panels = m.div_ceil(PANEL_ROWS).max(wanted).min(m.div_ceil(rows));
        let panel = m.div_ceil(panels).next_multiple_of(rows);
        Blocking { rows, chunk, panel }
    }
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
    thread_local! {
        static ZERO_OFFSETS: RefCell<Vec<i32>> = const { RefCell::new(Vec::new()) };
    }
    assert!(isa.supported() && x.blocks == w.blocks && out.len() == x.rows * w.n);
    ZERO_OFFSETS.with_borrow_mut(|offsets| {
        offsets.clear();
        if let Some(z) = w.uniform_zero {
            offsets.extend(x.sums.iter().map(|s| -z * s));
        }
        let op = Operands {
            w,
            x,
            zero_offsets: offsets,
            out: SharedMut::new(out.as_mut_ptr()),
            n: w.n,
        };
        run(&op, isa, threads);
    })
}

fn run(op: &Operands, isa: Isa, threads: ThreadCount) {
    let (w, m) = (op.w, op.x.rows);
    let plan = Blocking::new(isa, m, w, threads);
    let panels = m.div_ceil(plan.panel);
    split(threads, panels * w.tiles, |units| {
        for unit in units {
            let (panel, tile) = (unit / w.tiles, unit % w.tiles);
            let rows = panel * plan.panel..((panel + 1) * plan.panel).min(m);
            for k0 in (0..w.blocks).step_by(plan.chunk) {
                let chunk = k0..(k0 + plan.chunk).min(w.blocks);
                for m0 in rows.clone().step_by(plan.rows) {
                    let mr = plan.rows.min(rows.end - m0);
                    let uniform = w.uniform_zero.is_some();
                    let f = kernel(isa, mr, w.bits, op.x.split(), uniform);
                    // SAFETY: `isa` is supported; the kernel writes rows m0..m0+mr of tile
                    // `tile`'s columns (< n) of `out`, a part no other unit writes; chunks of K
                    // end inside a group only when there is one group (`Segment`).
                    unsafe { f(op, tile, m0, chunk.clone()) };
                }
            }
        }
    });
}
#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::quantize::RESIDUAL_STEPS;

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
    fn chunks_of_k_panels_and_partial_tiles() {
        // K long enough to be cut in chunks: one group per row (a chunk ends inside it), and
        // groups of 128 and 64 (chunks of whole groups); M past the panel and the kernel's rows;
        // N not a multiple of the tile; K not a multiple of the block where there is one group.
        let mut rng = Rng(21);
        let cases = [(8u8, 1100, 1), (8, 1152, 9), (4, 2240, 35), (4, 2100, 1)];
        for (bits, k, groups) in cases {
            for (m, n) in [(9, 40), (203, 17)] {
                let symmetric = groups == 1;
                let case = Case {
                    n,
                    k,
                    bits,
                    groups,
                    symmetric,
                };
                check(case, m, &mut rng, None);
            }
        }
    }

    #[test]
    fn blocking_keeps_groups_whole_and_every_thread_busy() {
        let q = |n: usize, k: usize| vec![0u8; n * k];
        let pack = |n: usize, k: usize, groups: usize, bits: u8| {
            let s = vec![1.0; n * groups];
            PackedWeights::pack(&q(n, k), &s, &vec![0.0; n * groups], n, k, bits).unwrap()
        };
        let two = ThreadCount::new(2);
        // One group: balanced chunks of at most 16 KiB of a tile (32 blocks at 8 bits).
        let w = pack(768, 2048, 1, 8);
        let plan = Blocking::new(Isa::Scalar, 128, &w, two);
        assert_eq!((plan.rows, plan.chunk, plan.panel), (8, 32, 128));
        // Groups of 4 blocks: chunks hold whole groups.
        let w = pack(64, 1152, 9, 8);
        assert_eq!(Blocking::new(Isa::Scalar, 64, &w, two).chunk, 20);
        let w = pack(64, 4864, 38, 4);
        assert_eq!(Blocking::new(Isa::Scalar, 64, &w, two).chunk % 4, 0);
        // One tile: M is cut in two units for each thread; the GEMV reads K whole.
        let w = pack(16, 256, 1, 4);
        assert_eq!(Blocking::new(Isa::Scalar, 64, &w, two).panel, 16);
        let gemv = Blocking::new(Isa::Scalar, 8, &w, two);
        assert_eq!((gemv.chunk, gemv.panel), (w.blocks, 8));
    }

    #[test]
    fn a_row_does_not_depend_on_the_batch() {
        // The GEMM (chunks of K, panels) and the GEMV (whole K) add the same terms in the same
        // order: a prompt's rows and a decode step's give the same bits.
        let mut rng = Rng(5);
        for (bits, k, groups, symmetric) in [(8u8, 1100, 1, true), (4, 2240, 35, false)] {
            let case = Case {
                n: 20,
                k,
                bits,
                groups,
                symmetric,
            };
            let w = weights(&case, &mut rng);
            let packed = PackedWeights::pack(&w.q, &w.s, &w.z, case.n, k, bits).unwrap();
            let m = 30;
            let x: Vec<f32> = (0..m * k).map(|_| rng.normal()).collect();
            for activations in [Activations::Int8, Activations::Int8x2] {
                for isa in Isa::supported_paths() {
                    let t = ThreadCount::new(2);
                    let mut all = vec![0f32; m * case.n];
                    int8_matmul(&x, m, &packed, &mut all, activations, isa, t).unwrap();
                    for (row, want) in all.chunks(case.n).enumerate() {
                        let mut one = vec![0f32; case.n];
                        let xr = &x[row * k..(row + 1) * k];
                        int8_matmul(xr, 1, &packed, &mut one, activations, isa, t).unwrap();
                        assert_eq!(one, want, "{isa} {activations:?} bits={bits} row {row}");
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
