//! The paged KV-cache block pool: a fixed number of blocks of `block_size` token
//! slots, reference counted, with prefix caching.
//!
//! A full block is named by a hash chained from its parent block's hash and its
//! token ids. A lookup hit is confirmed token for token, and the parent must be
//! the very block (id and generation) the lookup matched one step earlier, so two
//! different prefixes can never share a block even if their hashes collide.
//! Freed cached blocks stay in the index until they are evicted, least recently
//! freed first; uncached freed blocks are handed out before any cached one.
//!
//! An allocation is a [`TableLease`]: an owned value whose `Drop` returns its
//! blocks. The pool keeps no tokens of a table: its holder does, and passes them
//! to `commit`. A [`BlockTable`] is a lease with its tokens, for use alone.

use std::sync::Arc;

use parking_lot::{Mutex, MutexGuard};
use rustc_hash::FxHashMap;
use std::collections::hash_map::Entry;

use crate::error::{CoreError, Result};
use crate::free_list::FreeList;
use crate::prefix_hash::{chain_hash, HashFn, ROOT_HASH};

/// Identity of a cached block: its id and the generation it was cached in.
type BlockIdentity = (u32, u32);

#[derive(Debug, Clone)]
struct CachedBlock {
    hash: u64,
    parent_hash: u64,
    parent: Option<BlockIdentity>,
}

/// What the pool knows of one block, in one record so a block's bookkeeping
/// touches one cache line.
#[derive(Debug, Clone, Default)]
struct BlockState {
    ref_count: u32,
    /// Bumped each time its cached contents are dropped.
    generation: u32,
    cached: Option<CachedBlock>,
}

#[derive(Debug, Clone)]
pub(crate) struct TableState {
    pub(crate) blocks: Vec<u32>,
    /// Leading blocks already hashed (registered in the index or found there).
    hashed_blocks: usize,
    /// Chain hash of the last hashed block (ROOT_HASH when none).
    last_hash: u64,
    pub(crate) num_cached_tokens: usize,
}

/// Counters and gauges of a pool.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PoolStats {
    pub num_blocks: usize,
    pub block_size: usize,
    /// Blocks no live table holds (cached-but-evictable ones included).
    pub num_free_blocks: usize,
    /// Blocks whose contents are in the prefix index (held or evictable).
    pub num_cached_blocks: usize,
    /// Fraction of blocks held by live tables.
    pub usage: f64,
    /// Tokens looked up in the prefix cache.
    pub prefix_cache_queries: u64,
    /// Of those, tokens found cached.
    pub prefix_cache_hits: u64,
    /// Cached blocks whose contents were dropped to reuse the block.
    pub evictions: u64,
}

pub(crate) struct PoolInner {
    block_size: usize,
    num_blocks: usize,
    prefix_caching: bool,
    block: Vec<BlockState>,
    free: FreeList,
    /// Token ids of each cached block, `block_size` per block.
    block_tokens: Vec<u32>,
    index: FxHashMap<u64, u32>,
    tables: Vec<Option<TableState>>,
    free_table_ids: Vec<u32>,
    hash_fn: HashFn,
    prefix_cache_queries: u64,
    prefix_cache_hits: u64,
    evictions: u64,
}

/// A pool of KV blocks, shared by the tables allocated from it.
#[derive(Clone)]
pub struct BlockPool {
    inner: Arc<Mutex<PoolInner>>,
}

/// Blocks held for a token sequence that the holder keeps; dropping it returns
/// them to the pool.
pub(crate) struct TableLease {
    id: u32,
    pool: Arc<Mutex<PoolInner>>,
    live: bool,
}

/// Blocks held for one token sequence; dropping it returns them to the pool.
pub struct BlockTable {
    lease: TableLease,
    tokens: Vec<u32>,
}

impl BlockPool {
    pub fn new(num_blocks: usize, block_size: usize, enable_prefix_caching: bool) -> Result<Self> {
        Self::with_hash(num_blocks, block_size, enable_prefix_caching, chain_hash)
    }

    pub(crate) fn with_hash(
        num_blocks: usize,
        block_size: usize,
        enable_prefix_caching: bool,
        hash_fn: HashFn,
    ) -> Result<Self> {
        if num_blocks == 0 || num_blocks >= u32::MAX as usize {
            return Err(CoreError::InvalidArgument(format!(
                "num_blocks must be in [1, {}), got {num_blocks}",
                u32::MAX
            )));
        }
        if block_size == 0 || block_size > 1 << 16 {
            return Err(CoreError::InvalidArgument(format!(
                "block_size must be in [1, 65536], got {block_size}"
            )));
        }
        let cache_tokens = if enable_prefix_caching {
            num_blocks * block_size
        } else {
            0
        };
        let inner = PoolInner {
            block_size,
            num_blocks,
            prefix_caching: enable_prefix_caching,
            block: vec![BlockState::default(); num_blocks],
            free: FreeList::full(num_blocks),
            block_tokens: vec![0; cache_tokens],
            // Room for every block from the start: the index never rehashes mid-step.
            index: FxHashMap::with_capacity_and_hasher(
                if enable_prefix_caching { num_blocks } else { 0 },
                Default::default(),
            ),
            tables: Vec::new(),
            free_table_ids: Vec::new(),
            hash_fn,
            prefix_cache_queries: 0,
            prefix_cache_hits: 0,
            evictions: 0,
        };
        Ok(BlockPool {
            inner: Arc::new(Mutex::new(inner)),
        })
    }

    pub(crate) fn lock(&self) -> MutexGuard<'_, PoolInner> {
        self.inner.lock()
    }

    pub fn block_size(&self) -> usize {
        self.inner.lock().block_size
    }

    pub fn num_blocks(&self) -> usize {
        self.inner.lock().num_blocks
    }

    pub fn prefix_caching(&self) -> bool {
        self.inner.lock().prefix_caching
    }

    pub fn stats(&self) -> PoolStats {
        self.inner.lock().stats()
    }

    pub fn check_invariants(&self) -> Result<()> {
        self.inner
            .lock()
            .check_invariants()
            .map_err(CoreError::State)
    }

    /// A table for `tokens`: every cached full block of its longest cached prefix
    /// is reused (at most `len - 1` tokens, so one is always left to compute),
    /// and new blocks are taken for the rest. All or nothing.
    pub fn allocate(&self, tokens: &[u32]) -> Result<BlockTable> {
        let mut inner = self.inner.lock();
        let lease = self.wrap(inner.open_table(tokens, tokens.len(), true));
        match inner.reserve(lease.id, tokens.len()) {
            Ok(()) => {
                inner.debug_check();
                Ok(BlockTable {
                    lease,
                    tokens: tokens.to_vec(),
                })
            }
            Err(e) => {
                lease.release_in(&mut inner);
                Err(e)
            }
        }
    }

    /// The lease of a table opened under the lock.
    pub(crate) fn wrap(&self, id: u32) -> TableLease {
        TableLease {
            id,
            pool: Arc::clone(&self.inner),
            live: true,
        }
    }
}

impl BlockTable {
    /// Extends the sequence by `tokens`, taking new blocks as needed; all or nothing.
    pub fn append(&mut self, tokens: &[u32]) -> Result<()> {
        let mut inner = self.lease.pool.lock();
        inner.reserve(self.lease.id, self.tokens.len() + tokens.len())?;
        self.tokens.extend_from_slice(tokens);
        Ok(())
    }

    /// Marks the first `num_computed` tokens as holding valid KV: their full
    /// blocks become findable by later allocations.
    pub fn commit(&mut self, num_computed: usize) {
        let mut inner = self.lease.pool.lock();
        inner.commit(self.lease.id, &self.tokens, num_computed);
        inner.debug_check_table(self.lease.id, &self.tokens);
    }

    pub fn block_ids(&self) -> Vec<u32> {
        self.lease.pool.lock().table(self.lease.id).blocks.clone()
    }

    pub fn num_tokens(&self) -> usize {
        self.tokens.len()
    }

    pub fn num_cached_tokens(&self) -> usize {
        self.lease
            .pool
            .lock()
            .table(self.lease.id)
            .num_cached_tokens
    }
}

impl TableLease {
    pub(crate) fn id(&self) -> u32 {
        self.id
    }

    /// Frees the table under a lock the caller already holds.
    pub(crate) fn release_in(mut self, inner: &mut PoolInner) {
        debug_assert!(std::ptr::eq(
            self.pool.data_ptr().cast_const(),
            inner as *const PoolInner
        ));
        inner.free_table(self.id);
        self.live = false;
    }
}

impl Drop for TableLease {
    fn drop(&mut self) {
        if self.live {
            let mut inner = self.pool.lock();
            inner.free_table(self.id);
            inner.debug_check();
        }
    }
}

impl PoolInner {
    pub(crate) fn table(&self, id: u32) -> &TableState {
        self.tables[id as usize].as_ref().expect("live table")
    }

    fn table_mut(&mut self, id: u32) -> &mut TableState {
        self.tables[id as usize].as_mut().expect("live table")
    }

    fn cached_tokens(&self, block: u32) -> &[u32] {
        let start = block as usize * self.block_size;
        &self.block_tokens[start..start + self.block_size]
    }

    /// A table holding the cached prefix of `tokens` (none with `read_cache` false; no new
    /// blocks yet), with room for the blocks of `max_len` tokens (its sequence's longest), so
    /// that growing to them never reallocates its block list.
    pub(crate) fn open_table(&mut self, tokens: &[u32], max_len: usize, read_cache: bool) -> u32 {
        let mut state = TableState {
            blocks: Vec::with_capacity(max_len.max(tokens.len()).div_ceil(self.block_size)),
            hashed_blocks: 0,
            last_hash: ROOT_HASH,
            num_cached_tokens: 0,
        };
        if read_cache && self.prefix_caching && !tokens.is_empty() {
            self.take_cached_prefix(&mut state, tokens);
        }
        match self.free_table_ids.pop() {
            Some(id) => {
                self.tables[id as usize] = Some(state);
                id
            }
            None => {
                self.tables.push(Some(state));
                (self.tables.len() - 1) as u32
            }
        }
    }

    fn take_cached_prefix(&mut self, state: &mut TableState, tokens: &[u32]) {
        let bs = self.block_size;
        let max_blocks = (tokens.len() - 1) / bs;
        let mut parent: Option<BlockIdentity> = None;
        for chunk in tokens.chunks_exact(bs).take(max_blocks) {
            let hash = (self.hash_fn)(state.last_hash, chunk);
            let Some(&block) = self.index.get(&hash) else {
                break;
            };
            let entry = self.block[block as usize]
                .cached
                .as_ref()
                .expect("indexed block is cached");
            if entry.parent != parent || self.cached_tokens(block) != chunk {
                break;
            }
            if self.block[block as usize].ref_count == 0 {
                self.free.remove(block);
            }
            self.block[block as usize].ref_count += 1;
            state.blocks.push(block);
            state.last_hash = hash;
            parent = Some((block, self.block[block as usize].generation));
        }
        state.hashed_blocks = state.blocks.len();
        state.num_cached_tokens = state.blocks.len() * bs;
        self.prefix_cache_queries += tokens.len() as u64;
        self.prefix_cache_hits += state.num_cached_tokens as u64;
    }

    /// Blocks needed so that table `id` can hold `num_slots` tokens.
    pub(crate) fn blocks_needed(&self, id: u32, num_slots: usize) -> usize {
        num_slots
            .div_ceil(self.block_size)
            .saturating_sub(self.table(id).blocks.len())
    }

    /// Grows table `id` to hold `num_slots` tokens; all or nothing.
    pub(crate) fn reserve(&mut self, id: u32, num_slots: usize) -> Result<()> {
        if num_slots <= self.table(id).blocks.len() * self.block_size {
            return Ok(());
        }
        let need = self.blocks_needed(id, num_slots);
        if need > self.free.len() {
            return Err(CoreError::OutOfBlocks(format!(
                "need {need} free blocks for {num_slots} tokens, {} are free",
                self.free.len()
            )));
        }
        for _ in 0..need {
            let block = self.take_free_block();
            self.table_mut(id).blocks.push(block);
        }
        Ok(())
    }

    fn take_free_block(&mut self) -> u32 {
        let block = self.free.pop_front().expect("a free block was counted");
        let state = &mut self.block[block as usize];
        if let Some(entry) = state.cached.take() {
            state.generation = state.generation.wrapping_add(1);
            self.index.remove(&entry.hash);
            self.evictions += 1;
        }
        self.block[block as usize].ref_count = 1;
        block
    }

    /// Marks the first `num_computed` of `tokens`, the sequence of table `id`, as
    /// holding valid KV: its full blocks become findable.
    pub(crate) fn commit(&mut self, id: u32, tokens: &[u32], num_computed: usize) {
        let bs = self.block_size;
        if !self.prefix_caching || num_computed < (self.table(id).hashed_blocks + 1) * bs {
            return;
        }
        // The fields borrowed apart: the table is updated in place, not moved out and back.
        let PoolInner {
            block: block_state,
            block_tokens,
            index,
            tables,
            hash_fn,
            ..
        } = self;
        let state = tables[id as usize].as_mut().expect("live table");
        let full = num_computed.min(tokens.len()).min(state.blocks.len() * bs) / bs;
        for i in state.hashed_blocks..full {
            let chunk = &tokens[i * bs..(i + 1) * bs];
            let hash = hash_fn(state.last_hash, chunk);
            let block = state.blocks[i];
            // Indexed unless it already is, or another block holds the same contents.
            let indexed = block_state[block as usize].cached.is_none()
                && match index.entry(hash) {
                    Entry::Vacant(slot) => {
                        slot.insert(block);
                        true
                    }
                    Entry::Occupied(_) => false,
                };
            if indexed {
                let parent = (i > 0).then(|| {
                    let p = state.blocks[i - 1];
                    (p, block_state[p as usize].generation)
                });
                block_state[block as usize].cached = Some(CachedBlock {
                    hash,
                    parent_hash: state.last_hash,
                    parent,
                });
                let start = block as usize * bs;
                block_tokens[start..start + bs].copy_from_slice(chunk);
            }
            state.last_hash = hash;
        }
        state.hashed_blocks = state.hashed_blocks.max(full);
    }

    /// Gives back the blocks of table `id` past the first `num_slots` slots' (the lookahead
    /// of rejected speculative tokens: never committed, so never cached); their KV is garbage.
    pub(crate) fn release_tail(&mut self, id: u32, num_slots: usize) {
        let keep = num_slots.div_ceil(self.block_size);
        let state = self.tables[id as usize].as_mut().expect("live table");
        if state.blocks.len() <= keep || state.hashed_blocks > keep {
            return;
        }
        let tail = state.blocks.split_off(keep);
        for block in tail.into_iter().rev() {
            let rc = &mut self.block[block as usize].ref_count;
            *rc -= 1;
            if *rc == 0 {
                if self.block[block as usize].cached.is_some() {
                    self.free.push_back(block);
                } else {
                    self.free.push_front(block);
                }
            }
        }
    }

    pub(crate) fn free_table(&mut self, id: u32) {
        let state = self.tables[id as usize].take().expect("table freed once");
        self.free_table_ids.push(id);
        // Last blocks first: a sequence's tail is the least likely to be shared,
        // so it is evicted before its prefix.
        for &block in state.blocks.iter().rev() {
            let rc = &mut self.block[block as usize].ref_count;
            *rc -= 1;
            if *rc == 0 {
                if self.block[block as usize].cached.is_some() {
                    self.free.push_back(block);
                } else {
                    self.free.push_front(block);
                }
            }
        }
    }

    pub(crate) fn stats(&self) -> PoolStats {
        let free = self.free.len();
        PoolStats {
            num_blocks: self.num_blocks,
            block_size: self.block_size,
            num_free_blocks: free,
            num_cached_blocks: self.index.len(),
            usage: (self.num_blocks - free) as f64 / self.num_blocks as f64,
            prefix_cache_queries: self.prefix_cache_queries,
            prefix_cache_hits: self.prefix_cache_hits,
            evictions: self.evictions,
        }
    }

    /// In debug builds, panics if an invariant is broken.
    pub(crate) fn debug_check(&self) {
        #[cfg(debug_assertions)]
        if let Err(e) = self.check_invariants() {
            panic!("block pool invariant violated: {e}");
        }
    }

    /// In debug builds, panics if table `id` disagrees with its sequence `tokens`.
    pub(crate) fn debug_check_table(&self, id: u32, tokens: &[u32]) {
        #[cfg(debug_assertions)]
        if let Err(e) = self.check_table(id, tokens) {
            panic!("block table invariant violated: {e}");
        }
        let _ = (id, tokens);
    }

    /// Table `id` holds its cached tokens, and each cached block of it holds the
    /// tokens of `tokens` it stands for.
    pub(crate) fn check_table(&self, id: u32, tokens: &[u32]) -> std::result::Result<(), String> {
        let bs = self.block_size;
        let state = self.table(id);
        if state.blocks.len() * bs < state.num_cached_tokens {
            return Err("a table holds fewer slots than its cached tokens".into());
        }
        for (block, chunk) in state.blocks.iter().zip(tokens.chunks_exact(bs)) {
            if self.block[*block as usize].cached.is_some() && self.cached_tokens(*block) != chunk {
                return Err(format!(
                    "cached block {block} holds other tokens than its table"
                ));
            }
        }
        Ok(())
    }

    pub(crate) fn check_invariants(&self) -> std::result::Result<(), String> {
        let mut holders = vec![0u32; self.num_blocks];
        for state in self.tables.iter().flatten() {
            for &block in &state.blocks {
                holders[block as usize] += 1;
            }
        }
        let mut in_use = 0;
        for (block, (state, &held)) in self.block.iter().zip(&holders).enumerate() {
            let rc = state.ref_count;
            if rc != held {
                return Err(format!(
                    "block {block}: ref count {rc} but {held} live tables hold it"
                ));
            }
            if (rc == 0) != self.free.contains(block as u32) {
                return Err(format!(
                    "block {block}: ref count {rc} disagrees with the free list"
                ));
            }
            in_use += usize::from(rc > 0);
        }
        if self.free.len() + in_use != self.num_blocks
            || self.free.iter().count() != self.free.len()
        {
            return Err(format!(
                "free {} + in use {in_use} != total {}",
                self.free.len(),
                self.num_blocks
            ));
        }
        for (&hash, &block) in &self.index {
            let Some(entry) = &self.block[block as usize].cached else {
                return Err(format!("index points at uncached block {block}"));
            };
            if entry.hash != hash
                || (self.hash_fn)(entry.parent_hash, self.cached_tokens(block)) != hash
            {
                return Err(format!(
                    "block {block} does not hold the tokens its hash names"
                ));
            }
        }
        let cached = self.block.iter().filter(|b| b.cached.is_some()).count();
        if cached != self.index.len() {
            return Err(format!(
                "{cached} cached blocks but {} index entries",
                self.index.len()
            ));
        }
        let live = self.tables.iter().filter(|t| t.is_some()).count();
        if live + self.free_table_ids.len() != self.tables.len() {
            return Err("table slots are lost".into());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seq(start: u32, n: usize) -> Vec<u32> {
        (start..start + n as u32).collect()
    }

    #[test]
    fn allocate_and_drop_return_blocks() {
        let pool = BlockPool::new(8, 4, true).unwrap();
        let t = pool.allocate(&seq(0, 10)).unwrap();
        assert_eq!(t.block_ids().len(), 3);
        assert_eq!(pool.stats().num_free_blocks, 5);
        pool.check_invariants().unwrap();
        drop(t);
        assert_eq!(pool.stats().num_free_blocks, 8);
        pool.check_invariants().unwrap();
    }

    #[test]
    fn allocation_is_all_or_nothing() {
        let pool = BlockPool::new(4, 4, true).unwrap();
        let _a = pool.allocate(&seq(0, 8)).unwrap();
        let err = pool.allocate(&seq(100, 12)).err().unwrap();
        assert!(matches!(err, CoreError::OutOfBlocks(_)), "{err}");
        assert_eq!(pool.stats().num_free_blocks, 2);
        let mut b = pool.allocate(&seq(100, 8)).unwrap();
        assert!(b.append(&[1]).is_err());
        assert_eq!(b.num_tokens(), 8);
        pool.check_invariants().unwrap();
    }

    #[test]
    fn committed_prefix_is_reused_and_counted() {
        let pool = BlockPool::new(16, 4, true).unwrap();
        let mut a = pool.allocate(&seq(0, 10)).unwrap();
        a.commit(10);
        let b = pool.allocate(&seq(0, 13)).unwrap();
        assert_eq!(b.num_cached_tokens(), 8);
        assert_eq!(b.block_ids()[..2], a.block_ids()[..2]);
        assert_ne!(b.block_ids()[2], a.block_ids()[2]);
        let s = pool.stats();
        assert_eq!((s.prefix_cache_queries, s.prefix_cache_hits), (23, 8));
        pool.check_invariants().unwrap();
    }

    #[test]
    fn uncommitted_blocks_are_not_shared() {
        let pool = BlockPool::new(16, 4, true).unwrap();
        let a = pool.allocate(&seq(0, 10)).unwrap();
        let b = pool.allocate(&seq(0, 10)).unwrap();
        assert_eq!(b.num_cached_tokens(), 0);
        drop((a, b));
        pool.check_invariants().unwrap();
    }

    #[test]
    fn exact_multiple_leaves_the_last_block_to_compute() {
        let pool = BlockPool::new(16, 4, true).unwrap();
        let mut a = pool.allocate(&seq(0, 8)).unwrap();
        a.commit(8);
        let b = pool.allocate(&seq(0, 8)).unwrap();
        assert_eq!(b.num_cached_tokens(), 4);
        assert_eq!(b.block_ids().len(), 2);
        pool.check_invariants().unwrap();
    }

    #[test]
    fn freed_cached_blocks_stay_reusable_until_evicted_lru() {
        let pool = BlockPool::new(4, 2, true).unwrap();
        let mut a = pool.allocate(&seq(0, 4)).unwrap(); // blocks for [0,1] [2,3]
        a.commit(4);
        let a_blocks = a.block_ids();
        drop(a);
        let mut b = pool.allocate(&seq(10, 4)).unwrap();
        b.commit(4);
        drop(b);
        assert_eq!(pool.stats().num_cached_blocks, 4);
        // A hit on the freed prefix: still cached.
        let c = pool.allocate(&seq(0, 3)).unwrap();
        assert_eq!(c.num_cached_tokens(), 2);
        assert_eq!(c.block_ids()[0], a_blocks[0]);
        drop(c);
        // Eviction order: b's blocks (tail first), then a's tail, then a's head
        // which was freed last.
        let d = pool.allocate(&seq(50, 2)).unwrap();
        assert_eq!(pool.stats().evictions, 1);
        let b_again = pool.allocate(&seq(10, 3)).unwrap();
        assert_eq!(
            b_again.num_cached_tokens(),
            2,
            "b's head survived, its tail went first"
        );
        drop((d, b_again));
        pool.check_invariants().unwrap();
    }

    #[test]
    fn uncached_free_blocks_are_used_before_evicting() {
        let pool = BlockPool::new(4, 2, true).unwrap();
        let mut a = pool.allocate(&seq(0, 4)).unwrap();
        a.commit(4);
        let scratch = pool.allocate(&seq(100, 4)).unwrap(); // never committed
        drop(a);
        drop(scratch);
        let _x = pool.allocate(&seq(200, 4)).unwrap();
        assert_eq!(pool.stats().evictions, 0);
        assert_eq!(pool.stats().num_cached_blocks, 2);
    }

    fn colliding_hash(_parent: u64, _tokens: &[u32]) -> u64 {
        7
    }

    #[test]
    fn hash_collisions_never_share_blocks() {
        let pool = BlockPool::with_hash(16, 2, true, colliding_hash).unwrap();
        let mut a = pool.allocate(&[1, 2, 3, 4, 5]).unwrap();
        a.commit(5);
        // Same hash, different tokens: a miss.
        let b = pool.allocate(&[9, 9, 3, 4, 5]).unwrap();
        assert_eq!(b.num_cached_tokens(), 0);
        // Same first block: a hit on it only; the second block's hash names a's
        // first block, whose parent is not the matched block.
        let c = pool.allocate(&[1, 2, 1, 2, 5]).unwrap();
        assert_eq!(c.num_cached_tokens(), 2);
        pool.check_invariants().unwrap();
    }

    #[test]
    fn evicted_parent_invalidates_children() {
        // A parent evicted and reused for other tokens must not chain to the
        // old child, even when the new content hashes the same.
        let pool = BlockPool::with_hash(3, 2, true, colliding_hash).unwrap();
        let mut a = pool.allocate(&[1, 2, 3, 4, 0]).unwrap();
        a.commit(4);
        drop(a);
        let _ = pool.allocate(&[7, 7]).unwrap();
        pool.check_invariants().unwrap();
    }

    #[test]
    fn prefix_caching_off_never_hits() {
        let pool = BlockPool::new(8, 2, false).unwrap();
        let mut a = pool.allocate(&seq(0, 6)).unwrap();
        a.commit(6);
        let b = pool.allocate(&seq(0, 6)).unwrap();
        assert_eq!(b.num_cached_tokens(), 0);
        assert_eq!(pool.stats().num_cached_blocks, 0);
    }

    #[test]
    fn bad_sizes_are_refused() {
        assert!(BlockPool::new(0, 16, true).is_err());
        assert!(BlockPool::new(4, 0, true).is_err());
    }

    #[test]
    fn append_and_commit_grow_the_cache() {
        let pool = BlockPool::new(8, 2, true).unwrap();
        let mut a = pool.allocate(&[1]).unwrap();
        for t in 2..=6 {
            a.append(&[t]).unwrap();
            a.commit(t as usize - 1);
        }
        assert_eq!(a.block_ids().len(), 3);
        let b = pool.allocate(&[1, 2, 3, 4, 5, 6, 7]).unwrap();
        assert_eq!(
            b.num_cached_tokens(),
            4,
            "blocks [1,2] and [3,4] were committed"
        );
        pool.check_invariants().unwrap();
    }
}
