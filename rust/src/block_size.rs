//! Token positions as (block, offset) pairs. A step maps every token it schedules to
//! its cache slot; with a power-of-two block size (every size a runner uses) that is a
//! shift and a mask instead of a 64-bit division, which costs tens of cycles.

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct BlockSize {
    size: usize,
    /// log2(size) when size is a power of two.
    shift: Option<u32>,
}

impl BlockSize {
    pub(crate) fn new(size: usize) -> Self {
        assert!(size > 0, "a block holds at least one token");
        BlockSize {
            size,
            shift: size.is_power_of_two().then(|| size.trailing_zeros()),
        }
    }

    pub(crate) fn get(self) -> usize {
        self.size
    }

    /// The block index of position `pos` and its offset in that block.
    #[inline]
    pub(crate) fn split(self, pos: usize) -> (usize, usize) {
        match self.shift {
            Some(shift) => (pos >> shift, pos & (self.size - 1)),
            None => (pos / self.size, pos % self.size),
        }
    }

    /// The offset of position `pos` in its block.
    #[inline]
    pub(crate) fn offset(self, pos: usize) -> usize {
        self.split(pos).1
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_matches_division_for_every_size() {
        for size in [1, 2, 3, 7, 16, 48, 256, 65536] {
            let bs = BlockSize::new(size);
            for pos in (0..3 * size + 5).chain([usize::MAX / 2, usize::MAX]) {
                assert_eq!(
                    bs.split(pos),
                    (pos / size, pos % size),
                    "size {size} pos {pos}"
                );
                assert_eq!(bs.offset(pos), pos % size);
            }
        }
    }
}
