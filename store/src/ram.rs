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
//!
//! Recency is stamped by a [`UseClock`], the store's, shared with the SSD tier: a block that
//! leaves ([`Evicted`]) and a block a flush writes ([`RamTier::snapshot_stamped`]) carry the
//! stamp of their last use here, which the SSD tier ranks them by, and its wall-clock time,
//! which the SSD tier records as the block's last access.

use std::collections::HashMap;
use std::sync::Arc;

use crate::block::{now_unix_ms, Block};
use crate::clock::{UseClock, UsedAt};
use crate::eviction::{ChainOrder, EvictionPolicy};
use crate::key::{BlockKey, NamespaceId};
use crate::pins::Pins;

type Id = (NamespaceId, BlockKey);

/// A block that left the RAM tier (evicted, or a new block not admitted), with its last
/// use there: the [`UseClock`] stamp it leaves with
/// ([`ChainOrder::leaving_stamp`](crate::eviction::ChainOrder::leaving_stamp)) and the
/// wall-clock time of its last use (for a block not admitted, its refused insert).
#[derive(Debug, Clone)]
pub struct Evicted {
    /// The block.
    pub block: Arc<Block>,
    /// Its recency when it left, and when it was last used.
    pub used: UsedAt,
}

/// A resident block and the wall-clock time of its last use (insert, get or touch), Unix
/// milliseconds.
struct Slot {
    block: Arc<Block>,
    used_ms: u64,
}

impl Slot {
    fn new(block: Arc<Block>) -> Self {
        Slot {
            block,
            used_ms: now_unix_ms(),
        }
    }
}

/// A byte-bounded store of `Arc<Block>` that evicts chains leaves first. Not synchronized: the
/// [`Store`](crate::Store) wraps it in a mutex.
pub struct RamTier {
    slots: HashMap<Id, Slot>,
    /// Which block leaves next.
    order: ChainOrder<Id>,
    used: u64,
    budget: u64,
    /// Keys eviction skips ([`Pins`]); empty unless set.
    pins: Arc<Pins>,
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
        RamTier::with_clock(budget, policy, UseClock::default())
    }

    /// An empty tier holding at most `budget` bytes, evicting by `policy`, stamping recency
    /// with `clock` (the store's, shared with the SSD tier).
    pub fn with_clock(budget: u64, policy: EvictionPolicy, clock: UseClock) -> Self {
        RamTier {
            slots: HashMap::new(),
            order: ChainOrder::with_clock(policy, clock),
            used: 0,
            budget,
            pins: Arc::new(Pins::new()),
            not_admitted: 0,
        }
    }

    /// The eviction policy.
    pub fn policy(&self) -> EvictionPolicy {
        self.order.policy()
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

    /// Blocks the tier holds when full: the budget over the mean resident block (over
    /// `size` while empty). Exact when every block has the same size.
    fn capacity(&self, size: u64) -> u64 {
        let mean = match self.slots.len() as u64 {
            0 => size,
            n => self.used / n,
        };
        self.budget / mean.max(1)
    }

    fn take(&mut self, id: Id) -> Option<Slot> {
        let slot = self.slots.remove(&id)?;
        self.order.remove(id);
        self.used -= slot.block.data_len();
        Some(slot)
    }

    /// Takes `id` out as an [`Evicted`] block, with the stamp it leaves with.
    fn evict(&mut self, id: Id) -> Option<Evicted> {
        let stamp = self.order.leaving_stamp(id)?;
        let Slot { block, used_ms } = self.take(id)?;
        Some(Evicted {
            block,
            used: UsedAt {
                stamp,
                unix_ms: used_ms,
            },
        })
    }

    /// Inserts `block` as most recently used and returns what had to leave to keep the
    /// budget, in eviction order. A block larger than the whole budget is not admitted and
    /// comes back as the only element, as does a new block the policy does not admit
    /// (freq-admit: its first victim was used as often or more, and recently). Re-inserting
    /// a present key replaces and refreshes it. Pinned blocks never leave, and a pinned new
    /// block is always admitted: when only pinned blocks (and ancestors of resident
    /// blocks) are left to evict, the new block itself leaves (it comes back last).
    pub fn insert(&mut self, block: Arc<Block>) -> Vec<Evicted> {
        let size = block.data_len();
        if size > self.budget {
            let used = UsedAt::now(self.order.clock().tick());
            return vec![Evicted { block, used }];
        }
        let meta = &block.meta;
        let id = (meta.namespace, meta.key);
        let parent = parent_of(meta);
        let capacity = self.capacity(size);
        let pins = self.pins.clone();
        let pinned = move |k: &Id| pins.is_pinned(k.0, k.1);
        if let Some(old) = self.slots.get(&id) {
            self.used = self.used - old.block.data_len() + size;
            self.slots.insert(id, Slot::new(block));
            self.order.used(id, capacity);
        } else {
            let u = self.order.used(id, capacity);
            let full = self.used + size > self.budget;
            if full && !pinned(&id) && !self.order.admits(u, capacity, &pinned) {
                self.not_admitted += 1;
                let used = UsedAt::now(self.order.clock().tick());
                return vec![Evicted { block, used }];
            }
            self.slots.insert(id, Slot::new(block));
            self.used += size;
            self.order.insert(id, parent, u);
        }
        let mut evicted = Vec::new();
        while self.used > self.budget {
            // The new block makes room by others leaving, unless it is cut off itself.
            let victim = self.order.victim(Some(id), &pinned);
            // Nothing unpinned can go: the new block does not stay beside the pins.
            match self.evict(victim.unwrap_or(id)) {
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
        let slot = self.slots.get_mut(&(ns, key))?;
        slot.used_ms = now_unix_ms();
        let p = slot.block.clone();
        let capacity = self.capacity(p.data_len());
        self.order.used((ns, key), capacity);
        Some(p)
    }

    /// Marks the resident blocks of a chain as used, from the last key back to the first,
    /// so the root ends up the most recent and the chain is evicted leaves first. `keys`
    /// runs root first (as [`chain_keys`](crate::chain_keys) returns them); absent keys are
    /// skipped. Recency only: the policy does not count it as a use.
    pub fn touch_chain(&mut self, ns: NamespaceId, keys: &[BlockKey]) {
        let now = now_unix_ms();
        for &key in keys.iter().rev() {
            if let Some(slot) = self.slots.get_mut(&(ns, key)) {
                slot.used_ms = now;
            }
            self.order.touch((ns, key));
        }
    }

    /// Makes a resident block at least as recent as `used` (a stamp of the tier's clock and
    /// its time) without counting a use; returns whether it is resident.
    pub(crate) fn touch_at(&mut self, ns: NamespaceId, key: BlockKey, used: UsedAt) -> bool {
        if let Some(slot) = self.slots.get_mut(&(ns, key)) {
            slot.used_ms = slot.used_ms.max(used.unix_ms);
        }
        self.order.touch_at((ns, key), used.stamp)
    }

    /// Whether the key is present, without changing recency.
    pub fn contains(&self, ns: NamespaceId, key: BlockKey) -> bool {
        self.slots.contains_key(&(ns, key))
    }

    /// Removes a block.
    pub fn remove(&mut self, ns: NamespaceId, key: BlockKey) -> Option<Arc<Block>> {
        self.take((ns, key)).map(|s| s.block)
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
        self.snapshot_stamped()
            .into_iter()
            .map(|e| e.block)
            .collect()
    }

    /// [`RamTier::snapshot`], each block with the stamp it would leave with
    /// ([`ChainOrder::eviction_order_stamped`](crate::eviction::ChainOrder::eviction_order_stamped))
    /// and the time of its last use: what a write-back flush writes to the SSD tier.
    pub fn snapshot_stamped(&self) -> Vec<Evicted> {
        let mut order: Vec<Evicted> = self
            .order
            .eviction_order_stamped()
            .into_iter()
            .filter_map(|(id, stamp)| {
                let slot = self.slots.get(&id)?;
                Some(Evicted {
                    block: slot.block.clone(),
                    used: UsedAt {
                        stamp,
                        unix_ms: slot.used_ms,
                    },
                })
            })
            .collect();
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
        let order: Vec<u32> = evicted.iter().map(|e| e.block.meta.position).collect();
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

    /// A block leaves (evicted, or written by a flush) with the time of its last use: its
    /// last get, not its insert; a touch of its chain counts too.
    #[test]
    fn blocks_leave_with_the_time_of_their_last_use() {
        let ns = NamespaceId([7; 32]);
        let a = chain(1, 1);
        let b = chain(1, 2);
        let mut ram = RamTier::new(20);
        ram.insert(a[0].clone());
        ram.insert(b[0].clone());
        let inserted = now_unix_ms();
        std::thread::sleep(std::time::Duration::from_millis(5));
        let got = now_unix_ms();
        ram.get(ns, a[0].meta.key).unwrap();
        std::thread::sleep(std::time::Duration::from_millis(5));
        let touched = now_unix_ms();
        ram.touch_chain(ns, &[b[0].meta.key]);
        let snap = ram.snapshot_stamped();
        let at = |key| snap.iter().find(|e| e.block.meta.key == key).unwrap().used;
        assert!(at(a[0].meta.key).unix_ms >= got && at(a[0].meta.key).unix_ms < touched);
        assert!(at(b[0].meta.key).unix_ms >= touched);
        // Evicted by a newcomer: a (the least recent) leaves with its get's time.
        let c = chain(1, 3);
        let out = ram.insert(c[0].clone());
        assert_eq!(out.len(), 1);
        assert_eq!(out[0].block.meta.key, a[0].meta.key);
        assert!(out[0].used.unix_ms >= got && out[0].used.unix_ms > inserted);
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
                        .map(|e| e.block.meta.tokens[0])
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
            refused.push(out.iter().any(|e| Arc::ptr_eq(&e.block, x)));
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
            assert!(!out.iter().any(|e| Arc::ptr_eq(&e.block, p)), "{policy}");
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
        assert_eq!(ram.order.count((a.meta.namespace, a.meta.key)), 3);
        assert_eq!(ram.order.count((b.meta.namespace, b.meta.key)), 5);
        assert_eq!(first(&ram), Some(10));
    }
}
