//! The RMSNorm that feeds an int8 linear layer, fused with quantizing its output: per row, one
//! pass adds the residual branch into x (when given) and sums the squares, and a second pass
//! (over the row, now in L1) computes each block of 32 normed values into a block-sized buffer
//! and quantizes it straight away. The normed row is never written in float32: the linear reads the
//! int8 rows (`QuantizedRows`, exactly as `quantize_rows` writes them) with
//! `int8_matmul::matmul_quantized`.
//!
//! The bits are those of `add_rms_norm` followed by `quantize_rows` (the same float operations in
//! the same order, on every row path: `elementwise::add_inverse_rms` and `rms_normed` are the
//! norm's arithmetic for both).

use super::elementwise::{add_inverse_rms, inverse_rms, rms_normed};
use super::pool::ThreadCount;
use super::quantize::{
    check_finite, quantize_rows_from, Activations, BlockFn, QuantizedRows, RowPath, RowQuantizer,
    RowSource, SharedMut, BLOCK,
};
use super::KernelError;

/// One row of the norm as a source of blocks: x += branch, then its normed values 32 at a time.
struct NormedRow<'a> {
    x: &'a mut [f32],
    branch: Option<&'a [f32]>,
    weight: &'a [f32],
    eps: f32,
}

impl RowSource for NormedRow<'_> {
    #[inline(always)]
    fn blocks<B: BlockFn>(self, row: &mut RowQuantizer<'_, B>) {
        let inverse = add_inverse_rms(self.x, self.branch, self.eps);
        let mut buffer = [0f32; BLOCK];
        for (b, (x, weight)) in self
            .x
            .chunks(BLOCK)
            .zip(self.weight.chunks(BLOCK))
            .enumerate()
        {
            let normed = &mut buffer[..x.len()];
            for ((o, &a), &w) in normed.iter_mut().zip(x).zip(weight) {
                *o = rms_normed(a, w, inverse);
            }
            row.block(b, normed);
        }
    }
}

/// Per row of `weight.len()` values: x += branch (when given), then the row's RMSNorm,
/// weight · x / sqrt(mean(x²) + eps), quantized as `activations` says into `out` — the bytes
/// and scales `add_rms_norm` then `quantize_rows` give. A row whose normed values are not all
/// finite is named in a `NotFinite` error (x still holds the sums).
pub fn rms_norm_quantize(
    x: &mut [f32],
    branch: Option<&[f32]>,
    weight: &[f32],
    eps: f32,
    activations: Activations,
    threads: ThreadCount,
    out: &mut QuantizedRows,
) -> Result<(), KernelError> {
    rms_norm_quantize_on(
        RowPath::best(),
        x,
        branch,
        weight,
        eps,
        activations,
        threads,
        out,
    )
}

#[allow(clippy::too_many_arguments)]
fn rms_norm_quantize_on(
    path: RowPath,
    x: &mut [f32],
    branch: Option<&[f32]>,
    weight: &[f32],
    eps: f32,
    activations: Activations,
    threads: ThreadCount,
    out: &mut QuantizedRows,
) -> Result<(), KernelError> {
    let k = weight.len();
    if k == 0 || !x.len().is_multiple_of(k) || branch.is_some_and(|b| b.len() != x.len()) {
        return Err(KernelError::InvalidArgument(format!(
            "rms_norm_quantize: x of {} values, a branch of {:?} and a weight of {k} do not fit",
            x.len(),
            branch.map(<[f32]>::len)
        )));
    }
    let m = x.len() / k;
    let xs = SharedMut::new(x.as_mut_ptr());
    let finite = quantize_rows_from(path, m, k, activations, threads, out, |r| NormedRow {
        // SAFETY: `quantize_rows_from` asks for each row once, on the one thread that
        // quantizes it; the rows are disjoint.
        x: unsafe { std::slice::from_raw_parts_mut(xs.get().add(r * k), k) },
        branch: branch.map(|b| &b[r * k..(r + 1) * k]),
        weight,
        eps,
    });
    if finite {
        return Ok(());
    }
    // The normed rows again, to name the first value that is not finite (x holds the sums).
    check_finite(
        x.chunks_exact(k).flat_map(|row| {
            let inverse = inverse_rms(row, eps);
            row.iter()
                .zip(weight)
                .map(move |(&a, &w)| rms_normed(a, w, inverse))
        }),
        k,
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::elementwise::add_rms_norm;
    use crate::kernels::quantize::quantize_rows;

    fn values(n: usize, seed: u64) -> Vec<f32> {
        let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        (0..n)
            .map(|_| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                // Mostly small, now and then an outlier that sets its block's scale.
                let v = (state >> 40) as f32 / (1u64 << 24) as f32 * 4.0 - 2.0;
                if state.is_multiple_of(61) {
                    v * 40.0
                } else {
                    v
                }
            })
            .collect()
    }

    /// Every field of the rows as integers, floats as their bits.
    fn bits(q: &QuantizedRows) -> Vec<Vec<i64>> {
        let ints = |v: &[i8]| v.iter().map(|&b| b as i64).collect();
        let floats = |v: &[f32]| v.iter().map(|f| f.to_bits() as i64).collect();
        vec![
            vec![q.rows as i64, q.blocks as i64],
            ints(&q.values),
            ints(&q.residuals),
            floats(&q.scales),
            floats(&q.residual_scales),
            floats(&q.scaled_sums),
            q.sums.iter().map(|&s| s as i64).collect(),
        ]
    }

    #[test]
    fn fused_norm_gives_the_bits_of_norm_then_quantize_on_every_path() {
        // Odd lengths (partial last blocks), one block, one token and many, and enough rows
        // (70 x 32 blocks) for the rows to be split over two threads.
        let shapes = [(1, 7), (1, 576), (3, 33), (5, 100), (2, 1000), (70, 1000)];
        for (i, &(m, k)) in shapes.iter().enumerate() {
            let x0 = values(m * k, 3 * i as u64 + 1);
            let branch = values(m * k, 3 * i as u64 + 2);
            let weight: Vec<f32> = values(k, 3 * i as u64 + 3)
                .iter()
                .map(|v| 1.0 + 0.1 * v)
                .collect();
            for activations in [Activations::Int8, Activations::Int8x2] {
                for add in [false, true] {
                    for threads in [1, 2] {
                        let threads = ThreadCount::new(threads);
                        let b = add.then_some(branch.as_slice());
                        let (mut want_x, mut h) = (x0.clone(), vec![0f32; m * k]);
                        add_rms_norm(&mut want_x, b, &weight, 1e-6, &mut h, threads).unwrap();
                        let mut want = QuantizedRows::default();
                        quantize_rows(&h, m, k, activations, threads, &mut want).unwrap();
                        for path in RowPath::available() {
                            let mut x = x0.clone();
                            let mut got = QuantizedRows::default();
                            rms_norm_quantize_on(
                                path,
                                &mut x,
                                b,
                                &weight,
                                1e-6,
                                activations,
                                threads,
                                &mut got,
                            )
                            .unwrap();
                            let case = format!("{path:?} {m}x{k} {activations:?} add {add}");
                            assert_eq!(x, want_x, "{case}: the residual sums");
                            assert_eq!(bits(&got), bits(&want), "{case}");
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn a_row_normed_to_a_non_finite_value_is_named_as_quantize_rows_names_it() {
        let (m, k) = (3, 40);
        let weight = vec![1.0f32; k];
        for bad in [f32::NAN, f32::INFINITY] {
            let mut x = values(m * k, 9);
            x[k + 13] = bad;
            let (mut hx, mut h) = (x.clone(), vec![0f32; m * k]);
            add_rms_norm(&mut hx, None, &weight, 1e-6, &mut h, ThreadCount::new(1)).unwrap();
            let mut q = QuantizedRows::default();
            let want = quantize_rows(&h, m, k, Activations::Int8, ThreadCount::new(1), &mut q)
                .unwrap_err();
            for path in RowPath::available() {
                let got = rms_norm_quantize_on(
                    path,
                    &mut x.clone(),
                    None,
                    &weight,
                    1e-6,
                    Activations::Int8,
                    ThreadCount::new(1),
                    &mut q,
                )
                .unwrap_err();
                assert!(matches!(got, KernelError::NotFinite(_)), "{got}");
                assert_eq!(got, want);
            }
        }
    }

    #[test]
    fn shapes_that_do_not_fit_are_refused() {
        let mut q = QuantizedRows::default();
        let one = ThreadCount::new(1);
        let a = Activations::Int8;
        let mut x = vec![0f32; 10];
        assert!(rms_norm_quantize(&mut x, None, &[1.0; 4], 1e-6, a, one, &mut q).is_err());
        assert!(rms_norm_quantize(&mut x, None, &[], 1e-6, a, one, &mut q).is_err());
        let short = [0f32; 5];
        let err = rms_norm_quantize(&mut x, Some(&short), &[1.0; 5], 1e-6, a, one, &mut q);
        assert!(matches!(err, Err(KernelError::InvalidArgument(_))));
    }
}
