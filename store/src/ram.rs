//! The RAM tier: shared immutable payloads under an LRU bounded in bytes.

use std::sync::Arc;

use lru::LruCache;

use crate::block::Payload;
use crate::key::{BlockKey, NamespaceId};

/// A byte-bounded LRU of `Arc<P>`. Not synchronized: the [`Store`](crate::Store) wraps it
/// in a mutex.
pub struct RamTier<P> {
    lru: LruCache<(NamespaceId, BlockKey), Arc<P>>,
    used: u64,
    budget: u64,
}

impl<P: Payload> RamTier<P> {
    /// An empty tier holding at most `budget` bytes (by [`Payload::byte_size`]).
    pub fn new(budget: u64) -> Self {
        RamTier {
            lru: LruCache::unbounded(),
            used: 0,
            budget,
        }
    }

    /// Inserts `payload` as most recently used and returns what had to leave to keep the
    /// budget, least recent first. A payload larger than the whole budget is not admitted
    /// and comes back as the only element. Re-inserting a present key refreshes it.
    pub fn insert(&mut self, payload: Arc<P>) -> Vec<Arc<P>> {
        let size = payload.byte_size();
        if size > self.budget {
            return vec![payload];
        }
        let meta = payload.meta();
        let k = (meta.namespace, meta.key);
        if let Some(old) = self.lru.put(k, payload) {
            self.used -= old.byte_size();
        }
        self.used += size;
        let mut evicted = Vec::new();
        while self.used > self.budget {
            match self.lru.pop_lru() {
                Some((_, p)) => {
                    self.used -= p.byte_size();
                    evicted.push(p);
                }
                None => break,
            }
        }
        evicted
    }

    /// The payload, marked most recently used.
    pub fn get(&mut self, ns: NamespaceId, key: BlockKey) -> Option<Arc<P>> {
        self.lru.get(&(ns, key)).cloned()
    }

    /// Whether the key is present, without changing recency.
    pub fn contains(&self, ns: NamespaceId, key: BlockKey) -> bool {
        self.lru.contains(&(ns, key))
    }

    /// Removes a payload.
    pub fn remove(&mut self, ns: NamespaceId, key: BlockKey) -> Option<Arc<P>> {
        let p = self.lru.pop(&(ns, key))?;
        self.used -= p.byte_size();
        Some(p)
    }

    /// Number of payloads.
    pub fn len(&self) -> usize {
        self.lru.len()
    }

    /// Whether the tier is empty.
    pub fn is_empty(&self) -> bool {
        self.lru.is_empty()
    }

    /// Bytes held.
    pub fn used_bytes(&self) -> u64 {
        self.used
    }

    /// The byte budget.
    pub fn budget(&self) -> u64 {
        self.budget
    }

    /// Every payload, most recently used first (recency unchanged).
    pub fn snapshot(&self) -> Vec<Arc<P>> {
        self.lru.iter().map(|(_, p)| p.clone()).collect()
    }
}
