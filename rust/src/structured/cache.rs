//! Compiled grammars kept for reuse, bounded by count and by estimated bytes; the least
//! recently used go first.

use std::hash::Hash;
use std::sync::Arc;

use rustc_hash::FxHashMap;

pub struct LruCache<K, V> {
    entries: FxHashMap<K, Entry<V>>,
    max_entries: usize,
    max_bytes: usize,
    bytes: usize,
    clock: u64,
}

struct Entry<V> {
    value: Arc<V>,
    bytes: usize,
    last_used: u64,
}

impl<K: Hash + Eq + Clone, V> LruCache<K, V> {
    pub fn new(max_entries: usize, max_bytes: usize) -> Self {
        LruCache {
            entries: FxHashMap::default(),
            max_entries,
            max_bytes,
            bytes: 0,
            clock: 0,
        }
    }

    pub fn get(&mut self, key: &K) -> Option<Arc<V>> {
        self.clock += 1;
        let entry = self.entries.get_mut(key)?;
        entry.last_used = self.clock;
        Some(Arc::clone(&entry.value))
    }

    /// Keeps `value` (of about `bytes`) unless it alone is over the byte budget, evicting the
    /// least recently used entries until both bounds hold.
    pub fn insert(&mut self, key: K, value: Arc<V>, bytes: usize) {
        if bytes > self.max_bytes {
            return;
        }
        self.clock += 1;
        if let Some(old) = self.entries.remove(&key) {
            self.bytes -= old.bytes;
        }
        while !self.entries.is_empty()
            && (self.entries.len() >= self.max_entries || self.bytes + bytes > self.max_bytes)
        {
            self.evict_oldest();
        }
        self.bytes += bytes;
        let last_used = self.clock;
        self.entries.insert(
            key,
            Entry {
                value,
                bytes,
                last_used,
            },
        );
    }

    fn evict_oldest(&mut self) {
        let oldest = self
            .entries
            .iter()
            .min_by_key(|(_, e)| e.last_used)
            .map(|(k, _)| k.clone());
        if let Some(entry) = oldest.and_then(|k| self.entries.remove(&k)) {
            self.bytes -= entry.bytes;
        }
    }

    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    #[cfg(test)]
    pub fn bytes(&self) -> usize {
        self.bytes
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn evicts_the_least_recently_used_to_stay_within_both_bounds() {
        let mut cache = LruCache::new(3, 100);
        for (k, bytes) in [("a", 10), ("b", 10), ("c", 10)] {
            cache.insert(k, Arc::new(k), bytes);
        }
        assert!(cache.get(&"a").is_some()); // b is now the oldest
        cache.insert("d", Arc::new("d"), 10);
        assert!(cache.get(&"b").is_none());
        assert_eq!((cache.len(), cache.bytes()), (3, 30));
        cache.insert("e", Arc::new("e"), 85); // c and a go, the two oldest
        assert!(cache.get(&"d").is_some() && cache.get(&"e").is_some());
        assert_eq!((cache.len(), cache.bytes()), (2, 95));
        cache.insert("huge", Arc::new("huge"), 101); // over the budget alone: not kept
        assert!(cache.get(&"huge").is_none());
        assert_eq!(cache.len(), 2);
        cache.insert("e", Arc::new("e2"), 20); // replaced, its bytes counted once
        assert_eq!((cache.len(), cache.bytes()), (2, 30));
        assert_eq!(*cache.get(&"e").unwrap(), "e2");
    }
}
