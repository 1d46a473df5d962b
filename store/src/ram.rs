//! The RAM tier: shared immutable blocks under a byte budget, evicted leaves first.
//!
//! Blocks form chains (each names its parent), and a block is only reachable through its
//! ancestors: evicting a root makes every descendant useless. So the tier never evicts a
//! block while one of its children is resident. Among the blocks it may evict it takes, in
//! order: blocks whose parent is no longer resident (already cut off from their chain), then
//! leaves by recency, least recent first. A leaf's recency is its last insert, hit or
//! [`RamTier::touch_chain`], which refreshes a chain from its last block back to its root, so
//! a chain's root is its most recent block (vLLM's rule: a finished request's blocks are freed
//! tail first). A long chain inserted root first in one burst therefore keeps its prefix.

use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;

use crate::block::Block;
use crate::key::{BlockKey, NamespaceId};
use crate::pins::Pins;

type Id = (NamespaceId, BlockKey);

/// Eviction rank of an evictable block: smallest goes first. `cut` is 0 for a block whose
/// parent is not resident (evicted before any attached leaf), 1 otherwise.
type Rank = (u8, u64, Id);

struct Slot {
    block: Arc<Block>,
    /// The parent's id, `None` for the first block of a chain.
    parent: Option<Id>,
    stamp: u64,
    /// The rank under which the block sits in `evictable`, while it has no resident child.
    rank: Option<Rank>,
}

/// A byte-bounded store of `Arc<Block>` that evicts chains leaves first. Not synchronized: the
/// [`Store`](crate::Store) wraps it in a mutex.
pub struct RamTier {
    slots: HashMap<Id, Slot>,
    /// Resident children of each id (resident or not).
    children: HashMap<Id, Vec<BlockKey>>,
    evictable: BTreeSet<Rank>,
    next_stamp: u64,
    used: u64,
    budget: u64,
    /// Keys eviction skips ([`Pins`]); empty unless set.
    pins: Arc<Pins>,
}

fn parent_of(meta: &crate::BlockMeta) -> Option<Id> {
    (meta.parent != meta.namespace.0).then_some((meta.namespace, BlockKey(meta.parent)))
}

impl RamTier {
    /// An empty tier holding at most `budget` bytes (by [`Block::data_len`]).
    pub fn new(budget: u64) -> Self {
        RamTier {
            slots: HashMap::new(),
            children: HashMap::new(),
            evictable: BTreeSet::new(),
            next_stamp: 1,
            used: 0,
            budget,
            pins: Arc::new(Pins::new()),
        }
    }

    /// Sets the pins eviction spares (the store's, shared with its other tiers).
    pub fn set_pins(&mut self, pins: Arc<Pins>) {
        self.pins = pins;
    }

    /// Bytes of the resident blocks pinned now.
    pub fn pinned_bytes(&self) -> u64 {
        self.pins
            .pinned()
            .iter()
            .filter_map(|id| self.slots.get(id))
            .map(|s| s.block.data_len())
            .sum()
    }

    fn stamp(&mut self) -> u64 {
        self.next_stamp += 1;
        self.next_stamp
    }

    /// Puts `id` into `evictable` under its current rank if it has no resident child, or
    /// takes it out if it has one.
    fn rerank(&mut self, id: Id) {
        let has_child = self.children.get(&id).is_some_and(|c| !c.is_empty());
        let Some(slot) = self.slots.get(&id) else {
            return;
        };
        let rank = (!has_child).then(|| {
            let cut = slot.parent.is_some_and(|p| !self.slots.contains_key(&p));
            (u8::from(!cut), slot.stamp, id)
        });
        let old = slot.rank;
        if old == rank {
            return;
        }
        if let Some(old) = old {
            self.evictable.remove(&old);
        }
        if let Some(rank) = rank {
            self.evictable.insert(rank);
        }
        if let Some(slot) = self.slots.get_mut(&id) {
            slot.rank = rank;
        }
    }

    fn refresh(&mut self, id: Id) -> bool {
        let stamp = self.stamp();
        match self.slots.get_mut(&id) {
            Some(slot) => {
                slot.stamp = stamp;
                self.rerank(id);
                true
            }
            None => false,
        }
    }

    fn take(&mut self, id: Id) -> Option<Arc<Block>> {
        let slot = self.slots.remove(&id)?;
        if let Some(rank) = slot.rank {
            self.evictable.remove(&rank);
        }
        self.used -= slot.block.data_len();
        if let Some(parent) = slot.parent {
            if let Some(c) = self.children.get_mut(&parent) {
                c.retain(|k| *k != id.1);
                if c.is_empty() {
                    self.children.remove(&parent);
                }
            }
            self.rerank(parent);
        }
        // Children left behind are cut off from their chain now.
        for child in self.children.get(&id).cloned().unwrap_or_default() {
            self.rerank((id.0, child));
        }
        Some(slot.block)
    }

    /// Inserts `block` as most recently used and returns what had to leave to keep the
    /// budget, in eviction order. A block larger than the whole budget is not admitted and
    /// comes back as the only element. Re-inserting a present key replaces and refreshes it.
    /// Pinned blocks never leave: when only pinned blocks (and ancestors of resident
    /// blocks) are left to evict, the new block itself leaves (it comes back last).
    pub fn insert(&mut self, block: Arc<Block>) -> Vec<Arc<Block>> {
        let size = block.data_len();
        if size > self.budget {
            return vec![block];
        }
        let meta = &block.meta;
        let id = (meta.namespace, meta.key);
        let parent = parent_of(meta);
        if let Some(slot) = self.slots.get_mut(&id) {
            self.used = self.used - slot.block.data_len() + size;
            slot.block = block;
            self.refresh(id);
        } else {
            let stamp = self.stamp();
            self.slots.insert(
                id,
                Slot {
                    block,
                    parent,
                    stamp,
                    rank: None,
                },
            );
            self.used += size;
            if let Some(p) = parent {
                self.children.entry(p).or_default().push(id.1);
                self.rerank(p);
            }
            self.rerank(id);
            for child in self.children.get(&id).cloned().unwrap_or_default() {
                self.rerank((id.0, child));
            }
        }
        let mut evicted = Vec::new();
        while self.used > self.budget {
            let victim = self
                .evictable
                .iter()
                .map(|&(_, _, id)| id)
                .find(|&(ns, key)| !self.pins.is_pinned(ns, key));
            // Nothing unpinned can go: the new block does not stay beside the pins.
            match self.take(victim.unwrap_or(id)) {
                Some(p) => evicted.push(p),
                None => break,
            }
            if victim.is_none() {
                break;
            }
        }
        evicted
    }

    /// The block, marked most recently used.
    pub fn get(&mut self, ns: NamespaceId, key: BlockKey) -> Option<Arc<Block>> {
        let p = self.slots.get(&(ns, key))?.block.clone();
        self.refresh((ns, key));
        Some(p)
    }

    /// Marks the resident blocks of a chain as used, from the last key back to the first,
    /// so the root ends up the most recent and the chain is evicted leaves first. `keys`
    /// runs root first (as [`chain_keys`](crate::chain_keys) returns them); absent keys are
    /// skipped.
    pub fn touch_chain(&mut self, ns: NamespaceId, keys: &[BlockKey]) {
        for &key in keys.iter().rev() {
            self.refresh((ns, key));
        }
    }

    /// Whether the key is present, without changing recency.
    pub fn contains(&self, ns: NamespaceId, key: BlockKey) -> bool {
        self.slots.contains_key(&(ns, key))
    }

    /// Removes a block.
    pub fn remove(&mut self, ns: NamespaceId, key: BlockKey) -> Option<Arc<Block>> {
        self.take((ns, key))
    }

    /// Number of payloads.
    pub fn len(&self) -> usize {
        self.slots.len()
    }

    /// Whether the tier is empty.
    pub fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }

    /// Bytes held.
    pub fn used_bytes(&self) -> u64 {
        self.used
    }

    /// The byte budget.
    pub fn budget(&self) -> u64 {
        self.budget
    }

    /// Every block, last to be evicted first: the reverse of the order in which the tier
    /// would evict them all (recency unchanged).
    pub fn snapshot(&self) -> Vec<Arc<Block>> {
        // Replay eviction on a copy of the bookkeeping: leaves leave first, and a parent
        // becomes evictable once its last resident child has gone.
        let mut remaining: HashMap<Id, usize> = self
            .children
            .iter()
            .filter(|(id, _)| self.slots.contains_key(id))
            .map(|(id, c)| (*id, c.len()))
            .collect();
        let mut gone: std::collections::HashSet<Id> = std::collections::HashSet::new();
        let mut queue: BTreeSet<Rank> = self.evictable.clone();
        let mut order = Vec::with_capacity(self.slots.len());
        while let Some((_, _, id)) = queue.pop_first() {
            let Some(slot) = self.slots.get(&id) else {
                continue;
            };
            gone.insert(id);
            order.push(slot.block.clone());
            let Some(parent) = slot.parent else {
                continue;
            };
            let Some(n) = remaining.get_mut(&parent) else {
                continue;
            };
            *n -= 1;
            if *n == 0 {
                if let Some(ps) = self.slots.get(&parent) {
                    let cut = ps
                        .parent
                        .is_some_and(|g| !self.slots.contains_key(&g) || gone.contains(&g));
                    queue.insert((u8::from(!cut), ps.stamp, parent));
                }
            }
        }
        order.reverse();
        order
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::block::{Block, BlockMeta};

    fn chain(n: usize, seed: u32) -> Vec<Arc<Block>> {
        let ns = NamespaceId([7; 32]);
        let mut parent = ns.0;
        (0..n)
            .map(|i| {
                let meta = BlockMeta::new(ns, parent, i as u32, vec![seed, i as u32]);
                parent = meta.key.0;
                Arc::new(Block {
                    meta,
                    planes: vec![crate::Plane::new(
                        "k",
                        crate::Dtype::U8,
                        vec![10],
                        vec![0; 10],
                    )],
                })
            })
            .collect()
    }

    #[test]
    fn a_burst_longer_than_the_budget_keeps_the_chains_prefix() {
        let blocks = chain(10, 0);
        let mut ram = RamTier::new(40);
        let mut evicted = Vec::new();
        for b in &blocks {
            evicted.extend(ram.insert(b.clone()));
        }
        for (i, b) in blocks.iter().enumerate() {
            assert_eq!(
                ram.contains(b.meta.namespace, b.meta.key),
                i < 4,
                "block {i}"
            );
        }
        let order: Vec<u32> = evicted.iter().map(|b| b.meta.position).collect();
        assert_eq!(order, vec![4, 5, 6, 7, 8, 9]);
        let snap: Vec<u32> = ram.snapshot().iter().map(|b| b.meta.position).collect();
        assert_eq!(snap, vec![0, 1, 2, 3]);
    }

    #[test]
    fn touch_chain_makes_a_chain_the_last_to_go() {
        let ns = NamespaceId([7; 32]);
        let a = chain(3, 1);
        let b = chain(3, 2);
        let mut ram = RamTier::new(1000);
        for x in a.iter().chain(&b) {
            ram.insert(x.clone());
        }
        let keys: Vec<_> = a.iter().map(|x| x.meta.key).collect();
        ram.touch_chain(ns, &keys);
        let order: Vec<_> = ram.snapshot().iter().rev().map(|x| x.meta.key).collect();
        let expected: Vec<_> = b
            .iter()
            .rev()
            .chain(a.iter().rev())
            .map(|x| x.meta.key)
            .collect();
        assert_eq!(order, expected);
    }
}
