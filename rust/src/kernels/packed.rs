//! Quantized weights repacked once, at load, into the layout the int8 dot-product kernels read.
//!
//! From the integers the checkpoint formats unpack to — q (N, K) in 0..2^bits, scales s and
//! zero points z (N, G), the weight being w = (q − z)·s over groups of K / G columns — the rows
//! are cut into tiles of 16 and K into blocks of 32. Per (tile, block) the bytes are laid out
//! as the 16 lanes of one `vpdpbusd` want them: chunk j (0..8) holds, for each of the 16 rows,
//! the 4 consecutive weights 4j..4j+4 of the block — 64 bytes, one 512-bit register, or two
//! 256-bit halves (rows 0..8, rows 8..16). 4-bit weights keep chunk j in the low nibbles and
//! chunk j + 4 in the high nibbles of 4 such chunks (256 bytes per tile and block: 0.5 byte a
//! weight), so one `and` and one shift unpack two registers. The walk over K is one contiguous
//! stream per tile.
//!
//! Per (tile, group) the float side is 16 scales s and 16 zero points z, from which the kernel
//! makes the two vectors s and s·z it combines each block's int32 sums with (z is kept rather
//! than s·z so that the weight reads back exactly as (q − z)·s). Rows past N and columns past K
//! hold zeros.

use super::quantize::BLOCK;
use super::KernelError;

/// Output rows per tile: the 16 int32 lanes of a 512-bit register.
pub const TILE: usize = 16;
/// Bytes of 4 weights for each of 16 rows: one register's worth.
pub const CHUNK_BYTES: usize = 64;

#[derive(Debug, Clone)]
pub struct PackedWeights {
    pub n: usize,
    pub k: usize,
    pub bits: u8,
    /// Columns per group (K for channel-wise scales).
    pub group_size: usize,
    pub groups: usize,
    pub blocks: usize,
    pub tiles: usize,
    /// (tiles, blocks, bytes per tile-block) as described above.
    pub data: Vec<u8>,
    /// (tiles, groups, 2, 16): s, then z.
    pub scales: Vec<f32>,
    /// Some(z) when every zero point is the same integer z (symmetric weights): the kernels
    /// then take z·Σxq off the int32 sums, exactly and with no float work.
    pub uniform_zero: Option<i32>,
}

impl PackedWeights {
    pub fn tile_block_bytes(&self) -> usize {
        tile_block_bytes(self.bits)
    }

    pub fn group_of(&self, block: usize) -> usize {
        if self.groups == 1 {
            0
        } else {
            block * BLOCK / self.group_size
        }
    }

    pub fn tile_data(&self, tile: usize) -> &[u8] {
        let per_tile = self.blocks * self.tile_block_bytes();
        &self.data[tile * per_tile..(tile + 1) * per_tile]
    }

    /// The (s, z) vectors of one tile and group: 32 floats.
    pub fn tile_scales(&self, tile: usize, group: usize) -> &[f32] {
        let at = (tile * self.groups + group) * 2 * TILE;
        &self.scales[at..at + 2 * TILE]
    }

    /// Repacks q (n, k) row-major, with scales and zeros (n, groups) row-major.
    pub fn pack(
        q: &[u8],
        scales: &[f32],
        zeros: &[f32],
        n: usize,
        k: usize,
        bits: u8,
    ) -> Result<PackedWeights, KernelError> {
        let invalid = |m: String| Err(KernelError::InvalidArgument(m));
        if bits != 4 && bits != 8 {
            return invalid(format!("{bits}-bit weights are not supported (4 or 8)"));
        }
        if n == 0 || k == 0 || q.len() != n * k {
            return invalid(format!(
                "q holds {} values, not {n} x {k} (both > 0)",
                q.len()
            ));
        }
        if scales.is_empty() || !scales.len().is_multiple_of(n) || zeros.len() != scales.len() {
            return invalid(format!(
                "scales ({}) and zeros ({}) must both be (N = {n}, groups)",
                scales.len(),
                zeros.len()
            ));
        }
        let groups = scales.len() / n;
        let group_size = k / groups;
        if !k.is_multiple_of(groups) || (groups > 1 && !group_size.is_multiple_of(BLOCK)) {
            return invalid(format!(
                "K = {k} in {groups} groups: the group size must be a multiple of {BLOCK} \
                 (or one group per row)"
            ));
        }
        if let Some(i) = q.iter().position(|&v| bits == 4 && v > 15) {
            return invalid(format!(
                "4-bit q[{}, {}] = {} is over 15",
                i / k,
                i % k,
                q[i]
            ));
        }
        if let Some(i) = scales.iter().chain(zeros).position(|v| !v.is_finite()) {
            let what = if i < scales.len() {
                "scale"
            } else {
                "zero point"
            };
            return Err(KernelError::NotFinite(format!("a {what} is not finite")));
        }
        let blocks = k.div_ceil(BLOCK);
        let tiles = n.div_ceil(TILE);
        let per = tile_block_bytes(bits);
        let mut data = vec![0u8; tiles * blocks * per];
        let weight = |row: usize, col: usize| -> u8 {
            if row < n && col < k {
                q[row * k + col]
            } else {
                0
            }
        };
        for t in 0..tiles {
            for b in 0..blocks {
                let out = &mut data[(t * blocks + b) * per..(t * blocks + b + 1) * per];
                for r in 0..TILE {
                    for c in 0..BLOCK {
                        let (j, i) = (c / 4, c % 4);
                        let v = weight(t * TILE + r, b * BLOCK + c);
                        if bits == 8 {
                            out[j * CHUNK_BYTES + r * 4 + i] = v;
                        } else {
                            let shift = if j < 4 { 0 } else { 4 };
                            out[(j % 4) * CHUNK_BYTES + r * 4 + i] |= v << shift;
                        }
                    }
                }
            }
        }
        let mut packed_scales = vec![0f32; tiles * groups * 2 * TILE];
        for row in 0..n {
            let (t, r) = (row / TILE, row % TILE);
            for g in 0..groups {
                let at = (t * groups + g) * 2 * TILE;
                let (s, z) = (scales[row * groups + g], zeros[row * groups + g]);
                packed_scales[at + r] = s;
                packed_scales[at + TILE + r] = z;
            }
        }
        let levels = (1u32 << bits) as f32;
        let uniform_zero = zeros
            .first()
            .filter(|&&z| z.fract() == 0.0 && (0.0..levels).contains(&z))
            .filter(|&&z| zeros.iter().all(|&v| v == z))
            .map(|&z| z as i32);
        Ok(PackedWeights {
            uniform_zero,
            n,
            k,
            bits,
            group_size,
            groups,
            blocks,
            tiles,
            data,
            scales: packed_scales,
        })
    }

    /// The integer weight q[row, col] read back from the layout.
    pub fn q(&self, row: usize, col: usize) -> u8 {
        let (t, r, b, c) = (row / TILE, row % TILE, col / BLOCK, col % BLOCK);
        let (j, i) = (c / 4, c % 4);
        let tile_block = &self.tile_data(t)[b * self.tile_block_bytes()..];
        if self.bits == 8 {
            tile_block[j * CHUNK_BYTES + r * 4 + i]
        } else {
            let byte = tile_block[(j % 4) * CHUNK_BYTES + r * 4 + i];
            if j < 4 {
                byte & 0xF
            } else {
                byte >> 4
            }
        }
    }

    /// The weight (n, k) as the kernels multiply by it: (q − z)·s, read back from the layout.
    pub fn dequantize(&self) -> Vec<f32> {
        let mut out = vec![0f32; self.n * self.k];
        for (row, values) in out.chunks_mut(self.k).enumerate() {
            let (t, r) = (row / TILE, row % TILE);
            for (col, v) in values.iter_mut().enumerate() {
                let sc = self.tile_scales(t, self.group_of(col / BLOCK));
                *v = (self.q(row, col) as f32 - sc[TILE + r]) * sc[r];
            }
        }
        out
    }

    /// The bytes the layout holds: what one pass over the weights reads.
    pub fn size_bytes(&self) -> usize {
        self.data.len() + self.scales.len() * 4
    }
}

fn tile_block_bytes(bits: u8) -> usize {
    TILE * BLOCK * bits as usize / 8
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn q_reads_back_every_weight() {
        for bits in [4u8, 8] {
            let (n, k) = (21, 70);
            let q: Vec<u8> = (0..n * k)
                .map(|i| ((i * 7 + i / 3) % (1 << bits)) as u8)
                .collect();
            let s = vec![0.5f32; n];
            let z = vec![3.0f32; n];
            let p = PackedWeights::pack(&q, &s, &z, n, k, bits).unwrap();
            assert_eq!((p.tiles, p.blocks, p.groups, p.group_size), (2, 3, 1, 70));
            for r in 0..n {
                for c in 0..k {
                    assert_eq!(p.q(r, c), q[r * k + c]);
                }
            }
            assert_eq!(p.q(n, 0), 0);
            let w = p.dequantize();
            assert_eq!(w[20 * k + 3], (q[20 * k + 3] as f32 - 3.0) * 0.5);
            assert_eq!(p.tile_scales(1, 0)[4], 0.5); // row 20
            assert_eq!(p.tile_scales(1, 0)[TILE + 4], 3.0);
            assert_eq!(p.tile_scales(1, 0)[5], 0.0); // row 21 is padding
            assert_eq!(p.uniform_zero, Some(3));
            let mixed = PackedWeights::pack(&q, &s, &[&[3.0; 20][..], &[4.0]].concat(), n, k, bits);
            assert_eq!(mixed.unwrap().uniform_zero, None);
            let fraction = PackedWeights::pack(&q, &s, &[2.5; 21], n, k, bits);
            assert_eq!(fraction.unwrap().uniform_zero, None);
        }
    }

    #[test]
    fn bad_shapes_and_values_are_named() {
        let q = vec![0u8; 4 * 96];
        let ok = |g: usize| PackedWeights::pack(&q, &vec![1.0; 4 * g], &vec![0.0; 4 * g], 4, 96, 4);
        assert!(ok(1).is_ok());
        assert!(ok(3).is_ok()); // groups of 32
        assert!(ok(2).is_err()); // groups of 48
        assert!(PackedWeights::pack(&q, &[1.0; 4], &[0.0; 4], 4, 96, 3).is_err());
        let mut big = q.clone();
        big[100] = 16;
        let err = PackedWeights::pack(&big, &[1.0; 4], &[0.0; 4], 4, 96, 4).unwrap_err();
        assert!(err.to_string().contains("q[1, 4]"), "{err}");
        let err = PackedWeights::pack(&q, &[1.0, f32::NAN, 1.0, 1.0], &[0.0; 4], 4, 96, 8);
        assert!(matches!(err, Err(KernelError::NotFinite(_))));
    }
}
