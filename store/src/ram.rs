//! The RAM tier: shared immutable blocks under a byte budget, evicted leaves first, in the
//! order of the store's [`EvictionPolicy`].
//!
//! Blocks form chains (each names its parent), and a block is only reachable through its
//! ancestors: evicting a root makes every descendant useless. So the tier never evicts a
//! block while one of its children is resident. Among the blocks it may evict it takes, in
//! order: blocks whose parent is no longer resident (already cut off from their chain), then
//! leaves by the policy's [`Rank`]: under LRU least recent first. A leaf's recency is its
//! last insert, hit or [`RamTier::touch_chain`], which refreshes a chain from its last block
//! back to its root, so a chain's root is its most recent block (vLLM's rule: a finished
//! request's blocks are freed tail first). A long chain inserted root first in one burst
//! therefore keeps its prefix.
//!
//! A use (an insert or a hit, not a [`RamTier::touch_chain`]) is counted by the policy.
//! Under freq-admit a new block that would push out a leaf used as often or more, which
//! has not sat idle for a whole turnover of the tier, is not admitted: [`RamTier::insert`]
//! hands it back like an evicted block, and the [`Store`](crate::Store) spills it to the
//! SSD tier as it does evicted blocks. A cut-off victim never refuses a newcomer.

use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;

use crate::block::Block;
use crate::eviction::{EvictionPolicy, PolicyState, Rank};
use crate::key::{BlockKey, NamespaceId};
use crate::pins::Pins;

type Id = (NamespaceId, BlockKey);

/// Eviction order of an evictable block: smallest goes first. The first field is 0 for a
/// block whose parent is not resident (evicted before any attached leaf), 1 otherwise.
type Order = (u8, Rank, Id);

struct Slot {
    block: Arc<Block>,
    /// The parent's id, `None` for the first block of a chain.
    parent: Option<Id>,
    /// Recency: the tier's stamp at the last insert, hit or touch.
    stamp: u64,
    /// The policy's count ([`crate::eviction::Use::count`]).
    count: u64,
    /// The policy's use clock at the last insert or hit.
    last_use: u64,
    /// The order under which the block sits in `evictable`, while it has no resident child.
    order: Option<Order>,
}

/// A byte-bounded store of `Arc<Block>` that evicts chains leaves first. Not synchronized: the
/// [`Store`](crate::Store) wraps it in a mutex.
pub struct RamTier {
    slots: HashMap<Id, Slot>,
    /// Resident children of each id (resident or not).
    children: HashMap<Id, Vec<BlockKey>>,
    evictable: BTreeSet<Order>,
    next_stamp: u64,
    used: u64,
    budget: u64,
    /// Keys eviction skips ([`Pins`]); empty unless set.
    pins: Arc<Pins>,
    policy: PolicyState<Id>,
    /// New blocks the policy did not admit.
    not_admitted: u64,
}

fn parent_of(meta: &crate::BlockMeta) -> Option<Id> {
    (meta.parent != meta.namespace.0).then_some((meta.namespace, BlockKey(meta.parent)))
}

impl RamTier {
    /// An empty tier holding at most `budget` bytes (by [`Block::data_len`]), evicting
    /// least recently used leaves first.
    pub fn new(budget: u64) -> Self {
        RamTier::with_policy(budget, EvictionPolicy::Lru)
    }

    /// An empty tier holding at most `budget` bytes, evicting by `policy`.
    pub fn with_policy(budget: u64, policy: EvictionPolicy) -> Self {
        RamTier {
            slots: HashMap::new(),
            children: HashMap::new(),
            evictable: BTreeSet::new(),
            next_stamp: 1,
            used: 0,
            budget,
            pins: Arc::new(Pins::new()),
            policy: PolicyState::new(policy),
            not_admitted: 0,
        }
    }

    /// The eviction policy.
    pub fn policy(&self) -> EvictionPolicy {
        self.policy.policy()
    }

    /// New blocks the policy did not admit so far (handed back by [`RamTier::insert`]).
    pub fn not_admitted(&self) -> u64 {
        self.not_admitted
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

    /// Blocks the tier holds when full: the budget over the mean resident block (over
    /// `size` while empty). Exact when every block has the same size.
    fn capacity(&self, size: u64) -> u64 {
        let mean = match self.slots.len() as u64 {
            0 => size,
            n => self.used / n,
        };
        self.budget / mean.max(1)
    }

    /// The order `id` has in `evictable` now: `None` while it has a resident child.
    fn order_of(&self, id: Id) -> Option<Order> {
        let slot = self.slots.get(&id)?;
        if self.children.get(&id).is_some_and(|c| !c.is_empty()) {
            return None;
        }
        let cut = slot.parent.is_some_and(|p| !self.slots.contains_key(&p));
        Some((u8::from(!cut), self.policy.rank(slot.count, slot.stamp), id))
    }

    /// Puts `id` into `evictable` under its current order if it has no resident child, or
    /// takes it out if it has one.
    fn rerank(&mut self, id: Id) {
        let order = self.order_of(id);
        let Some(slot) = self.slots.get_mut(&id) else {
            return;
        };
        let old = std::mem::replace(&mut slot.order, order);
        if old == order {
            return;
        }
        if let Some(old) = old {
            self.evictable.remove(&old);
        }
        if let Some(order) = order {
            self.evictable.insert(order);
        }
    }

    /// Counts a use of `id` (resident or about to be) and returns its count and clock.
    /// When freq-admit halved its counts, every resident block is ranked again.
    fn record_use(&mut self, id: Id, size: u64) -> crate::eviction::Use {
        let capacity = self.capacity(size);
        let cached = self.slots.get(&id).map(|s| s.count);
        let u = self.policy.record_use(id, cached, capacity);
        if u.halved {
            let ids: Vec<Id> = self.slots.keys().copied().collect();
            for k in &ids {
                let count = self.policy.count(*k);
                if let Some(s) = self.slots.get_mut(k) {
                    s.count = count;
                }
            }
            for k in ids {
                self.rerank(k);
            }
        }
        u
    }

    /// Marks `id` as just used (`counted`: a hit, counted by the policy; else a recency
    /// refresh only). Returns whether it is resident.
    fn refresh(&mut self, id: Id, counted: bool) -> bool {
        let Some(size) = self.slots.get(&id).map(|s| s.block.data_len()) else {
            return false;
        };
        let used = counted.then(|| self.record_use(id, size));
        let stamp = self.stamp();
        if let Some(slot) = self.slots.get_mut(&id) {
            slot.stamp = stamp;
            if let Some(u) = used {
                slot.count = u.count;
                slot.last_use = u.at;
            }
        }
        self.rerank(id);
        true
    }

    fn take(&mut self, id: Id) -> Option<Arc<Block>> {
        let slot = self.slots.remove(&id)?;
        if let Some(order) = slot.order {
            self.evictable.remove(&order);
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

    /// The first block eviction would take now, other than `except` unless that one is cut
    /// off from its chain; pinned blocks are passed over.
    fn victim(&self, except: Option<Id>) -> Option<Order> {
        self.evictable
            .iter()
            .copied()
            .find(|&(cut, _, v)| (Some(v) != except || cut == 0) && !self.pins.is_pinned(v.0, v.1))
    }

    /// Inserts `block` as most recently used and returns what had to leave to keep the
    /// budget, in eviction order. A block larger than the whole budget is not admitted and
    /// comes back as the only element, as does a new block the policy does not admit
    /// (freq-admit: its first victim was used as often or more, and recently). Re-inserting
    /// a present key replaces and refreshes it. Pinned blocks never leave: when only pinned
    /// blocks (and ancestors of resident blocks) are left to evict, the new block itself
    /// leaves (it comes back last).
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
            self.refresh(id, true);
        } else {
            let capacity = self.capacity(size);
            let u = self.record_use(id, size);
            let stamp = self.stamp();
            if self.used + size > self.budget && !self.pins.is_pinned(id.0, id.1) {
                let rank = self.policy.rank(u.count, stamp);
                let refused = self.victim(None).is_some_and(|(cut, victim, v)| {
                    let last_use = self.slots.get(&v).map_or(0, |s| s.last_use);
                    cut == 1 && !self.policy.admits(rank, victim, last_use, capacity)
                });
                if refused {
                    self.not_admitted += 1;
                    return vec![block];
                }
            }
            self.slots.insert(
                id,
                Slot {
                    block,
                    parent,
                    stamp,
                    count: u.count,
                    last_use: u.at,
                    order: None,
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
            // The new block makes room by others leaving, unless it is cut off itself.
            let victim = self.victim(Some(id)).map(|(_, _, v)| v);
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

    /// The block, marked most recently used (a use, counted by the policy).
    pub fn get(&mut self, ns: NamespaceId, key: BlockKey) -> Option<Arc<Block>> {
        let p = self.slots.get(&(ns, key))?.block.clone();
        self.refresh((ns, key), true);
        Some(p)
    }

    /// Marks the resident blocks of a chain as used, from the last key back to the first,
    /// so the root ends up the most recent and the chain is evicted leaves first. `keys`
    /// runs root first (as [`chain_keys`](crate::chain_keys) returns them); absent keys are
    /// skipped. Recency only: the policy does not count it as a use.
    pub fn touch_chain(&mut self, ns: NamespaceId, keys: &[BlockKey]) {
        for &key in keys.iter().rev() {
            self.refresh((ns, key), false);
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
    /// would evict them all (ranks unchanged).
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
        let mut queue: BTreeSet<Order> = self.evictable.clone();
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
                    let rank = self.policy.rank(ps.count, ps.stamp);
                    queue.insert((u8::from(!cut), rank, parent));
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

    /// One-block chains (roots), 10 bytes each, seeds 10.. so they differ from `chain`'s.
    fn roots(n: usize) -> Vec<Arc<Block>> {
        (0..n).map(|i| chain(1, 10 + i as u32).remove(0)).collect()
    }

    fn resident(ram: &RamTier, blocks: &[Arc<Block>]) -> Vec<bool> {
        blocks
            .iter()
            .map(|b| ram.contains(b.meta.namespace, b.meta.key))
            .collect()
    }

    /// Room for 2 roots; A is used twice, then B, C, D arrive once each.
    /// lru: C evicts A (least recent), D evicts B.
    /// lfu: C evicts B (count 1 against A's 2), D evicts C.
    /// freq-admit: C would evict B (count 1, used 1 use ago): not admitted; D likewise.
    #[test]
    fn each_policy_on_a_popular_block_and_a_scan() {
        let [a, b, c, d]: [Arc<Block>; 4] = roots(4).try_into().unwrap();
        let run = |policy| {
            let mut ram = RamTier::with_policy(20, policy);
            let mut out = Vec::new();
            ram.insert(a.clone());
            ram.get(a.meta.namespace, a.meta.key).unwrap();
            for x in [&b, &c, &d] {
                out.push(
                    ram.insert(x.clone())
                        .iter()
                        .map(|e| e.meta.tokens[0])
                        .collect::<Vec<_>>(),
                );
            }
            (
                out,
                resident(&ram, &[a.clone(), b.clone(), c.clone(), d.clone()]),
                ram,
            )
        };
        let (out, res, ram) = run(EvictionPolicy::Lru);
        assert_eq!(out, vec![vec![], vec![10], vec![11]]);
        assert_eq!(res, vec![false, false, true, true]);
        assert_eq!(ram.not_admitted(), 0);
        let (out, res, _) = run(EvictionPolicy::Lfu);
        assert_eq!(out, vec![vec![], vec![11], vec![12]]);
        assert_eq!(res, vec![true, false, false, true]);
        let (out, res, ram) = run(EvictionPolicy::FreqAdmit);
        // The refused block itself comes back, for the store to spill.
        assert_eq!(out, vec![vec![], vec![12], vec![13]]);
        assert_eq!(res, vec![true, true, false, false]);
        assert_eq!(ram.not_admitted(), 2);
        assert!(ram.used_bytes() <= ram.budget());
    }

    /// Freq-admit turns over: a block left unused for more uses than the tier holds blocks
    /// gives way to any newcomer. Room for 2, every count 1: A, B, then C (refused: the
    /// victim A, the least recent, was used 2 uses ago, not more than 2), D (admitted: A
    /// is 3 uses old now and leaves), E (admitted: B is 3 uses old).
    #[test]
    fn freq_admit_lets_an_idle_block_go() {
        let blocks = roots(5);
        let mut ram = RamTier::with_policy(20, EvictionPolicy::FreqAdmit);
        let mut refused = Vec::new();
        for x in &blocks {
            let out = ram.insert(x.clone());
            refused.push(out.iter().any(|e| Arc::ptr_eq(e, x)));
        }
        assert_eq!(refused, vec![false, false, true, false, false]);
        assert_eq!(
            resident(&ram, &blocks),
            vec![false, false, false, true, true]
        );
    }

    /// A pinned newcomer is always admitted, and pinned blocks never leave, under every
    /// policy.
    #[test]
    fn pins_beat_every_policy() {
        for policy in EvictionPolicy::ALL {
            let blocks = roots(6);
            let pins = Arc::new(Pins::new());
            let mut ram = RamTier::with_policy(30, policy);
            ram.set_pins(pins.clone());
            // A popular block, then a pinned one that freq-admit would refuse.
            ram.insert(blocks[0].clone());
            ram.insert(blocks[1].clone());
            ram.insert(blocks[2].clone());
            for x in &blocks[..3] {
                ram.get(x.meta.namespace, x.meta.key);
            }
            let p = &blocks[3];
            pins.pin(
                p.meta.namespace,
                &[p.meta.key],
                std::time::Duration::from_secs(600),
                false,
            );
            let out = ram.insert(p.clone());
            assert!(!out.iter().any(|e| Arc::ptr_eq(e, p)), "{policy}");
            for x in &blocks[4..] {
                ram.insert(x.clone());
                assert!(ram.contains(p.meta.namespace, p.meta.key), "{policy}");
                assert!(ram.used_bytes() <= 30, "{policy}");
            }
        }
    }

    /// Freq-admit re-ranks every block when it halves its counts: the order follows the
    /// halved counts, and the snapshot lists blocks in that order.
    #[test]
    fn freq_admit_ranks_again_after_halving() {
        // Room for 2, so counts halve every 16 uses.
        let [a, b]: [Arc<Block>; 2] = roots(2).try_into().unwrap();
        let mut ram = RamTier::with_policy(20, EvictionPolicy::FreqAdmit);
        ram.insert(a.clone());
        ram.insert(b.clone());
        // A: 1 + 4 = 5 uses, B: 1 + 9 = 10 uses; 15 uses so far.
        for _ in 0..4 {
            ram.get(a.meta.namespace, a.meta.key);
        }
        for _ in 0..9 {
            ram.get(b.meta.namespace, b.meta.key);
        }
        let first = |ram: &RamTier| ram.snapshot().last().map(|x| x.meta.tokens[0]);
        assert_eq!(first(&ram), Some(10), "A (fewer uses) goes first");
        // The 16th use (of A) halves A 5 -> 2, B 10 -> 5, then counts A: 3 < 5.
        ram.get(a.meta.namespace, a.meta.key);
        assert_eq!(ram.policy.count((a.meta.namespace, a.meta.key)), 3);
        assert_eq!(ram.slots[&(b.meta.namespace, b.meta.key)].count, 5);
        assert_eq!(first(&ram), Some(10));
        assert_eq!(ram.evictable.len(), 2);
    }
}
