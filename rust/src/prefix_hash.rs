//! The chained hash that names a full block: hash(parent block's hash, token ids).
//! A hit is always confirmed token for token, so this hash only has to spread well.

use std::hash::Hasher;

use rustc_hash::FxHasher;

/// The parent hash of a sequence's first block.
pub(crate) const ROOT_HASH: u64 = 0x9e37_79b9_7f4a_7c15;

pub(crate) type HashFn = fn(u64, &[u32]) -> u64;

pub(crate) fn chain_hash(parent: u64, tokens: &[u32]) -> u64 {
    let mut h = FxHasher::default();
    h.write_u64(parent);
    h.write_usize(tokens.len());
    for &t in tokens {
        h.write_u32(t);
    }
    h.finish()
}
