//! Eviction policies of the store's tiers (`--eviction`): which block leaves a full tier,
//! and whether a newcomer may take its place at all.
//!
//! A policy ranks the blocks a tier may evict (the smallest [`Rank`] leaves first) and, for
//! [`EvictionPolicy::FreqAdmit`], gates newcomers. The tiers keep their own structure around
//! it (the RAM tier evicts only the leaves of its chains, cut-off blocks first; the SSD tier
//! keeps its recency across restarts) and ask a [`PolicyState`] for counts, ranks and
//! admission. Only the RAM tier gates: a block it does not admit is spilled to the SSD tier
//! like an evicted one; the SSD tier, the last local tier, has no gate and evicts in LRU's
//! order under `lru` and `freq-admit`, LFU's under `lfu`. Both tiers stamp recency with the
//! store's [`UseClock`], so a block leaves RAM with a recency the SSD ranks it by. `kvstore bench trace --simulate` runs the same [`PolicyState`] over a trace,
//! so the simulated policy is the shipped one. docs/prefix-reuse.md ("Eviction") explains
//! the default and what "not admitted" means in each tier.
//!
//! Cost: a use is one hash-map update, O(1); the tiers keep ranks in ordered sets, O(log n)
//! per use. Freq-admit halves every count once per [`HALVING_PERIOD`] × capacity uses and
//! the tier re-ranks its blocks then: O(n log n) every 8n uses, O(log n) amortized.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::hash::Hash;

use serde::{Deserialize, Serialize};

use crate::clock::UseClock;

/// Which block a full tier gives up.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum EvictionPolicy {
    /// Least recently used first: the store's order before `--eviction` existed (in the RAM
    /// tier among the leaves of its chains; in the SSD tier over all blocks, persisted).
    Lru,
    /// Least frequently used while cached first (ties: least recent); every newcomer is
    /// admitted.
    Lfu,
    /// Frequency-gated admission (TinyLFU's idea): every block's uses are counted, cached or
    /// not, and halved every [`HALVING_PERIOD`] × capacity uses so old popularity fades; a
    /// full tier evicts its least-used block (ties: least recent) for a newcomer used more
    /// often, or for any newcomer once that block sat unused through a whole turnover of
    /// the tier (more uses than it holds blocks); else the newcomer is not admitted.
    #[default]
    FreqAdmit,
}

impl EvictionPolicy {
    /// Every policy, in the order reports list them.
    pub const ALL: [EvictionPolicy; 3] = [
        EvictionPolicy::Lru,
        EvictionPolicy::Lfu,
        EvictionPolicy::FreqAdmit,
    ];

    /// The name on the command line and in reports.
    pub fn name(self) -> &'static str {
        match self {
            EvictionPolicy::Lru => "lru",
            EvictionPolicy::Lfu => "lfu",
            EvictionPolicy::FreqAdmit => "freq-admit",
        }
    }
}

impl std::fmt::Display for EvictionPolicy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// A name that is not an [`EvictionPolicy`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown eviction policy {0:?}: one of lru, lfu, freq-admit")]
pub struct UnknownPolicy(pub String);

impl std::str::FromStr for EvictionPolicy {
    type Err = UnknownPolicy;

    fn from_str(s: &str) -> Result<Self, UnknownPolicy> {
        EvictionPolicy::ALL
            .into_iter()
            .find(|p| p.name() == s)
            .ok_or_else(|| UnknownPolicy(s.to_string()))
    }
}

/// A block's place in the eviction order, smallest first: (count, recency) for the
/// frequency policies, (recency, 0) for LRU. Recency is the tier's own stamp.
pub type Rank = (u64, u64);

/// Freq-admit halves every count once per this many uses per block of capacity.
pub const HALVING_PERIOD: u64 = 8;

/// What [`PolicyState::record_use`] recorded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Use {
    /// The block's count under the policy (LFU: uses while cached; freq-admit: uses seen,
    /// cached or not; LRU: 0).
    pub count: u64,
    /// The use clock at this use (keep it as the block's last use).
    pub at: u64,
    /// Freq-admit halved every count just before this use: the counts the caller keeps for
    /// its cached blocks are stale, re-read them with [`PolicyState::count`].
    pub halved: bool,
}

/// A policy's bookkeeping beside the cached blocks: a clock that ticks once per block use
/// (a hit or an insert; a recency refresh is not a use) and, for freq-admit, how often every
/// block seen was used. `K` names a block.
#[derive(Debug, Clone)]
pub struct PolicyState<K> {
    policy: EvictionPolicy,
    clock: u64,
    since_halving: u64,
    seen: HashMap<K, u64>,
}

impl<K: Copy + Eq + Hash> PolicyState<K> {
    /// No use recorded yet.
    pub fn new(policy: EvictionPolicy) -> Self {
        PolicyState {
            policy,
            clock: 0,
            since_halving: 0,
            seen: HashMap::new(),
        }
    }

    /// The policy.
    pub fn policy(&self) -> EvictionPolicy {
        self.policy
    }

    /// Uses recorded so far.
    pub fn clock(&self) -> u64 {
        self.clock
    }

    /// Records a use of `key`. `cached`: the count the tier keeps for it while cached,
    /// `None` when the tier does not hold it; `capacity`: the blocks the tier holds when
    /// full (at least 1 is assumed).
    pub fn record_use(&mut self, key: K, cached: Option<u64>, capacity: u64) -> Use {
        self.clock += 1;
        let at = self.clock;
        match self.policy {
            EvictionPolicy::Lru => Use {
                count: 0,
                at,
                halved: false,
            },
            EvictionPolicy::Lfu => Use {
                count: cached.map_or(1, |c| c + 1),
                at,
                halved: false,
            },
            EvictionPolicy::FreqAdmit => {
                self.since_halving += 1;
                let halved = self.since_halving >= HALVING_PERIOD.saturating_mul(capacity.max(1));
                if halved {
                    self.since_halving = 0;
                    self.seen.retain(|_, n| {
                        *n /= 2;
                        *n > 0
                    });
                }
                let n = self.seen.entry(key).or_insert(0);
                *n += 1;
                Use {
                    count: *n,
                    at,
                    halved,
                }
            }
        }
    }

    /// Freq-admit's count of `key` now (0 for the other policies and unseen blocks).
    pub fn count(&self, key: K) -> u64 {
        self.seen.get(&key).copied().unwrap_or(0)
    }

    /// The rank of a block with `count` (from [`Use::count`]) and the tier's `recency`
    /// stamp (larger: more recent).
    pub fn rank(&self, count: u64, recency: u64) -> Rank {
        match self.policy {
            EvictionPolicy::Lru => (recency, 0),
            EvictionPolicy::Lfu | EvictionPolicy::FreqAdmit => (count, recency),
        }
    }

    /// Whether a newcomer of rank `newcomer` (its use just recorded) may take the place of
    /// the tier's first victim, of rank `victim` and last used at clock `victim_last_use`,
    /// in a full tier of `capacity` blocks. Always for LRU and LFU; for freq-admit when the
    /// newcomer was used more often, or the victim sat unused for more than `capacity` uses.
    pub fn admits(
        &self,
        newcomer: Rank,
        victim: Rank,
        victim_last_use: u64,
        capacity: u64,
    ) -> bool {
        self.policy != EvictionPolicy::FreqAdmit
            || newcomer.0 > victim.0
            || self.clock.saturating_sub(victim_last_use) > capacity
    }

    /// Blocks whose counts are kept (freq-admit: every block used since its count last
    /// halved to 0).
    pub fn tracked(&self) -> usize {
        self.seen.len()
    }
}

/// Where a held block sits in a [`ChainOrder`]'s eviction order, smallest first: 0 for a
/// block cut off from its chain (its parent not held), else 1; the policy's [`Rank`]; the
/// block.
pub type Order<K> = (u8, Rank, K);

#[derive(Debug, Clone)]
struct Node<K> {
    parent: Option<K>,
    /// Recency: the [`UseClock`] stamp of the last use or refresh.
    stamp: u64,
    /// The latest stamp of a descendant that left the order before this block (0: none).
    below: u64,
    count: u64,
    last_use: u64,
    /// The order under which the block sits in `evictable`, while it has no held child.
    order: Option<Order<K>>,
}

/// The eviction order of blocks that form chains (each names its parent), under a policy.
/// A block with a held child is never a victim (evicting it would cut the child off from
/// its chain); blocks already cut off go first, then leaves by the policy's [`Rank`]. It
/// holds no payloads: the RAM tier keeps its blocks and bytes beside it, and `kvstore bench
/// trace --simulate` runs it bare, so the simulated policy is the tier's, rule for rule.
///
/// The caller drives it as a tier is used: [`used`](Self::used) for a hit or an insert
/// (counted by the policy), [`touch`](Self::touch) for a recency refresh, then for a block
/// not held [`admits`](Self::admits) (freq-admit's gate, when the tier is full),
/// [`insert`](Self::insert), and [`victim`](Self::victim) / [`remove`](Self::remove) until
/// the tier fits its budget.
///
/// Recency stamps come from a [`UseClock`]: the RAM tier shares the store's with the SSD
/// tier, so the stamp a block leaves with ([`leaving_stamp`](Self::leaving_stamp)) ranks it
/// among the SSD tier's blocks.
#[derive(Debug, Clone)]
pub struct ChainOrder<K> {
    nodes: HashMap<K, Node<K>>,
    /// Held children of each block (held or not).
    children: HashMap<K, Vec<K>>,
    evictable: BTreeSet<Order<K>>,
    clock: UseClock,
    policy: PolicyState<K>,
}

impl<K: Copy + Eq + Hash + Ord> ChainOrder<K> {
    /// Nothing held yet, stamping recency with a clock of its own.
    pub fn new(policy: EvictionPolicy) -> Self {
        ChainOrder::with_clock(policy, UseClock::default())
    }

    /// Nothing held yet, stamping recency with `clock` (shared with other tiers).
    pub fn with_clock(policy: EvictionPolicy, clock: UseClock) -> Self {
        ChainOrder {
            nodes: HashMap::new(),
            children: HashMap::new(),
            evictable: BTreeSet::new(),
            clock,
            policy: PolicyState::new(policy),
        }
    }

    /// The clock recency is stamped with.
    pub fn clock(&self) -> &UseClock {
        &self.clock
    }

    /// The policy.
    pub fn policy(&self) -> EvictionPolicy {
        self.policy.policy()
    }

    /// Whether `key` is held.
    pub fn contains(&self, key: K) -> bool {
        self.nodes.contains_key(&key)
    }

    /// Blocks held.
    pub fn len(&self) -> usize {
        self.nodes.len()
    }

    /// Whether nothing is held.
    pub fn is_empty(&self) -> bool {
        self.nodes.is_empty()
    }

    /// The policy's count of `key` (held: the count it is ranked by; else freq-admit's
    /// count of a block seen, 0 otherwise).
    pub fn count(&self, key: K) -> u64 {
        self.nodes
            .get(&key)
            .map_or_else(|| self.policy.count(key), |n| n.count)
    }

    fn stamp(&mut self) -> u64 {
        self.clock.tick()
    }

    /// The recency `key` leaves the order with: the stamp of its last use or refresh, or a
    /// later one of a descendant that left before it, so a chain's blocks leave no older
    /// than the blocks below them (`None` when not held).
    pub fn leaving_stamp(&self, key: K) -> Option<u64> {
        self.nodes.get(&key).map(|n| n.stamp.max(n.below))
    }

    fn order_of(&self, key: K) -> Option<Order<K>> {
        let n = self.nodes.get(&key)?;
        if self.children.get(&key).is_some_and(|c| !c.is_empty()) {
            return None;
        }
        let cut = n.parent.is_some_and(|p| !self.nodes.contains_key(&p));
        Some((u8::from(!cut), self.policy.rank(n.count, n.stamp), key))
    }

    /// Puts `key` into `evictable` under its current order, or takes it out.
    fn rerank(&mut self, key: K) {
        let order = self.order_of(key);
        let Some(n) = self.nodes.get_mut(&key) else {
            return;
        };
        let old = std::mem::replace(&mut n.order, order);
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

    /// Records a use of `key` (a hit or an insert) in a tier of `capacity` blocks when
    /// full. A held block is counted and becomes the most recent; for a block not held the
    /// use is only counted (pass the result to [`admits`](Self::admits) and
    /// [`insert`](Self::insert)). When freq-admit halves its counts every held block is
    /// ranked again.
    pub fn used(&mut self, key: K, capacity: u64) -> Use {
        let cached = self.nodes.get(&key).map(|n| n.count);
        let u = self.policy.record_use(key, cached, capacity);
        if u.halved {
            let keys: Vec<K> = self.nodes.keys().copied().collect();
            for k in &keys {
                let count = self.policy.count(*k);
                if let Some(n) = self.nodes.get_mut(k) {
                    n.count = count;
                }
            }
            for k in keys {
                self.rerank(k);
            }
        }
        if self.nodes.contains_key(&key) {
            let stamp = self.stamp();
            if let Some(n) = self.nodes.get_mut(&key) {
                n.stamp = stamp;
                n.count = u.count;
                n.last_use = u.at;
            }
            self.rerank(key);
        }
        u
    }

    /// Makes a held block the most recent, without counting a use. Returns whether it is
    /// held.
    pub fn touch(&mut self, key: K) -> bool {
        if !self.nodes.contains_key(&key) {
            return false;
        }
        let stamp = self.stamp();
        self.touch_at(key, stamp)
    }

    /// Makes a held block at least as recent as `stamp` (from the order's clock), without
    /// counting a use. Returns whether it is held.
    pub fn touch_at(&mut self, key: K, stamp: u64) -> bool {
        let Some(n) = self.nodes.get_mut(&key) else {
            return false;
        };
        n.stamp = n.stamp.max(stamp);
        self.rerank(key);
        true
    }

    /// The first block eviction takes now: cut-off blocks, then leaves by rank, passing over
    /// `except` (unless it is cut off itself) and the blocks `skip` names (pinned).
    pub fn victim(&self, except: Option<K>, skip: impl Fn(&K) -> bool) -> Option<K> {
        self.first(except, skip).map(|(_, _, k)| k)
    }

    fn first(&self, except: Option<K>, skip: impl Fn(&K) -> bool) -> Option<Order<K>> {
        self.evictable
            .iter()
            .find(|&&(cut, _, k)| (Some(k) != except || cut == 0) && !skip(&k))
            .copied()
    }

    /// Whether a block not held, whose use [`used`](Self::used) returned as `u`, may enter
    /// a full tier of `capacity` blocks: always, unless freq-admit's gate refuses it
    /// against the first victim ([`PolicyState::admits`]; a cut-off victim never refuses).
    pub fn admits(&self, u: Use, capacity: u64, skip: impl Fn(&K) -> bool) -> bool {
        match self.first(None, skip) {
            Some((1, rank, k)) => {
                let last_use = self.nodes.get(&k).map_or(0, |n| n.last_use);
                self.policy
                    .admits(self.policy.rank(u.count, 0), rank, last_use, capacity)
            }
            _ => true,
        }
    }

    /// Holds `key` (child of `parent`, `None` for a chain's first block) as the most
    /// recent block, with the use [`used`](Self::used) returned. A held key is only
    /// refreshed.
    pub fn insert(&mut self, key: K, parent: Option<K>, u: Use) {
        if self.touch(key) {
            return;
        }
        let stamp = self.stamp();
        self.nodes.insert(
            key,
            Node {
                parent,
                stamp,
                below: 0,
                count: u.count,
                last_use: u.at,
                order: None,
            },
        );
        if let Some(p) = parent {
            self.children.entry(p).or_default().push(key);
            self.rerank(p);
        }
        self.rerank(key);
        for child in self.children.get(&key).cloned().unwrap_or_default() {
            self.rerank(child);
        }
    }

    /// Forgets `key`; returns whether it was held.
    pub fn remove(&mut self, key: K) -> bool {
        let Some(n) = self.nodes.remove(&key) else {
            return false;
        };
        if let Some(order) = n.order {
            self.evictable.remove(&order);
        }
        if let Some(parent) = n.parent {
            if let Some(c) = self.children.get_mut(&parent) {
                c.retain(|k| *k != key);
                if c.is_empty() {
                    self.children.remove(&parent);
                }
            }
            if let Some(p) = self.nodes.get_mut(&parent) {
                p.below = p.below.max(n.stamp).max(n.below);
            }
            self.rerank(parent);
        }
        // Children left behind are cut off from their chain now.
        for child in self.children.get(&key).cloned().unwrap_or_default() {
            self.rerank(child);
        }
        true
    }

    /// Every held block in the order eviction would take them all (nothing changes).
    pub fn eviction_order(&self) -> Vec<K> {
        self.eviction_order_stamped()
            .into_iter()
            .map(|(k, _)| k)
            .collect()
    }

    /// [`eviction_order`](Self::eviction_order), each block with the stamp it would leave
    /// with ([`leaving_stamp`](Self::leaving_stamp), its held descendants leaving first).
    pub fn eviction_order_stamped(&self) -> Vec<(K, u64)> {
        // Replay eviction on a copy of the bookkeeping: leaves leave first, and a parent
        // becomes evictable once its last held child has gone.
        let mut remaining: HashMap<K, usize> = self
            .children
            .iter()
            .filter(|(k, _)| self.nodes.contains_key(k))
            .map(|(k, c)| (*k, c.len()))
            .collect();
        let mut gone: HashSet<K> = HashSet::new();
        let mut below: HashMap<K, u64> = HashMap::new();
        let mut queue: BTreeSet<Order<K>> = self.evictable.clone();
        let mut order = Vec::with_capacity(self.nodes.len());
        while let Some((_, _, k)) = queue.pop_first() {
            let Some(n) = self.nodes.get(&k) else {
                continue;
            };
            gone.insert(k);
            let stamp = n.stamp.max(n.below).max(below.remove(&k).unwrap_or(0));
            order.push((k, stamp));
            let Some(parent) = n.parent else {
                continue;
            };
            let b = below.entry(parent).or_insert(0);
            *b = (*b).max(stamp);
            let Some(left) = remaining.get_mut(&parent) else {
                continue;
            };
            *left -= 1;
            if *left == 0 {
                if let Some(p) = self.nodes.get(&parent) {
                    let cut = p
                        .parent
                        .is_some_and(|g| !self.nodes.contains_key(&g) || gone.contains(&g));
                    let rank = self.policy.rank(p.count, p.stamp);
                    queue.insert((u8::from(!cut), rank, parent));
                }
            }
        }
        order
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_unknown_names_are_refused() {
        for p in EvictionPolicy::ALL {
            assert_eq!(p.name().parse::<EvictionPolicy>(), Ok(p));
            let json = serde_json::to_string(&p).unwrap();
            assert_eq!(json, format!("\"{}\"", p.name()));
        }
        let e = "lru-leaf".parse::<EvictionPolicy>().unwrap_err();
        assert!(e.to_string().contains("one of lru, lfu, freq-admit"), "{e}");
        assert_eq!(EvictionPolicy::default(), EvictionPolicy::FreqAdmit);
    }

    #[test]
    fn lru_ranks_by_recency_and_admits_everything() {
        let mut s = PolicyState::new(EvictionPolicy::Lru);
        let u = s.record_use(1u32, None, 4);
        assert_eq!(
            u,
            Use {
                count: 0,
                at: 1,
                halved: false
            }
        );
        assert_eq!(s.rank(u.count, 7), (7, 0));
        assert!(s.admits((0, 9), (100, 0), u.at, 4));
        assert_eq!(s.tracked(), 0);
    }

    #[test]
    fn lfu_counts_uses_while_cached() {
        let mut s = PolicyState::new(EvictionPolicy::Lfu);
        assert_eq!(s.record_use(1u32, None, 4).count, 1);
        assert_eq!(s.record_use(1, Some(1), 4).count, 2);
        // Evicted and back: it starts again.
        assert_eq!(s.record_use(1, None, 4).count, 1);
        assert_eq!(s.rank(2, 5), (2, 5));
        assert!(s.admits((1, 9), (5, 0), 3, 4));
    }

    #[test]
    fn freq_admit_counts_every_use_and_halves_each_period() {
        // Capacity 1: counts are halved every 8 uses.
        let mut s = PolicyState::new(EvictionPolicy::FreqAdmit);
        for i in 1..=7u64 {
            let u = s.record_use(1u32, None, 1);
            assert_eq!((u.count, u.halved), (i, false));
        }
        // The 8th use halves 7 to 3 first, then counts itself.
        let u = s.record_use(1, None, 1);
        assert_eq!((u.count, u.at, u.halved), (4, 8, true));
        assert_eq!(s.count(1), 4);
        // A block used once is forgotten at the next halving (1 / 2 = 0).
        s.record_use(2, None, 1);
        for _ in 0..7 {
            s.record_use(1, None, 1);
        }
        assert_eq!(s.count(2), 0);
        assert_eq!(s.tracked(), 1);
    }

    #[test]
    fn freq_admit_gate_and_turnover_rule() {
        let mut s = PolicyState::new(EvictionPolicy::FreqAdmit);
        let victim_used_at = s.record_use(1u32, None, 2).at; // clock 1
        s.record_use(1, None, 2); // clock 2: victim count 2
        let u = s.record_use(3, None, 2); // clock 3, count 1
        let newcomer = s.rank(u.count, 30);
        let victim = s.rank(2, 20);
        // Used less often, and the victim was used 1 use ago (not a turnover of 2): refused.
        assert!(!s.admits(newcomer, victim, 2, 2));
        // Used more often: admitted.
        assert!(s.admits(s.rank(3, 30), victim, 2, 2));
        // The victim idle for 2 uses (= capacity): still refused; for 3: admitted.
        s.record_use(4, None, 2); // clock 4
        assert!(!s.admits(newcomer, victim, 2, 2));
        assert!(s.admits(newcomer, victim, victim_used_at, 2));
    }

    /// A parent is never a victim while its child is held; a block cut off from its chain
    /// goes before every other; `except` is passed over unless it is cut off itself.
    #[test]
    fn chain_order_evicts_leaves_and_cut_off_blocks_first() {
        let mut o: ChainOrder<u32> = ChainOrder::new(EvictionPolicy::Lru);
        for (k, parent) in [(1, None), (2, Some(1)), (3, None)] {
            let u = o.used(k, 3);
            o.insert(k, parent, u);
        }
        // 1 is the least recent but holds 2: the leaves 2 then 3 go first.
        assert_eq!(o.eviction_order(), vec![2, 1, 3]);
        assert_eq!(o.victim(None, |_| false), Some(2));
        assert_eq!(o.victim(Some(2), |_| false), Some(3));
        assert_eq!(o.victim(None, |k| *k == 2), Some(3));
        // Without 1, 2 is cut off: first, even as `except`, and even though 3 is older.
        o.used(3, 3);
        assert!(o.remove(1));
        assert_eq!(o.victim(Some(2), |_| false), Some(2));
        assert_eq!(o.eviction_order(), vec![2, 3]);
        assert!(!o.remove(1));
        assert_eq!(o.len(), 2);
    }

    /// A block leaves with the latest stamp of itself and of the descendants that left
    /// before it, so a chain's root is never older than its leaves; the stamped eviction
    /// order counts held children the same way. Stamps come from the shared clock.
    #[test]
    fn chain_order_stamps_a_parent_no_older_than_its_leaves() {
        let clock = UseClock::default();
        let mut o: ChainOrder<u32> = ChainOrder::with_clock(EvictionPolicy::Lru, clock.clone());
        for (k, parent) in [(1, None), (2, Some(1)), (3, Some(2)), (4, None)] {
            let u = o.used(k, 4);
            o.insert(k, parent, u);
        }
        assert_eq!(clock.last(), 4);
        assert_eq!(
            o.eviction_order_stamped(),
            vec![(3, 3), (2, 3), (1, 3), (4, 4)]
        );
        assert!(o.remove(3));
        assert_eq!(o.leaving_stamp(2), Some(3));
        assert_eq!(o.leaving_stamp(1), Some(1));
        assert!(o.remove(2));
        assert_eq!(o.leaving_stamp(1), Some(3));
        // A later touch wins, and never moves a block back.
        assert!(o.touch(1));
        assert_eq!(o.leaving_stamp(1), Some(5));
        assert!(o.touch_at(1, 2));
        assert_eq!(o.leaving_stamp(1), Some(5));
        assert_eq!(o.leaving_stamp(9), None);
    }

    /// Freq-admit's gate in a full order: a newcomer used less often than the first
    /// victim is refused until that victim is idle for more than `capacity` uses.
    #[test]
    fn chain_order_gate() {
        let mut o: ChainOrder<u32> = ChainOrder::new(EvictionPolicy::FreqAdmit);
        for k in [1, 2] {
            let u = o.used(k, 2);
            o.insert(k, None, u);
            o.used(k, 2);
        }
        // Counts 2 and 2; block 1 last used at clock 2, now 5.
        let u = o.used(9, 2);
        assert_eq!((u.count, u.at), (1, 5));
        assert!(o.admits(u, 2, |_| false), "1 is idle for 3 uses > 2");
        o.used(1, 2);
        o.used(2, 2);
        // Counts 3 and 3, used at clocks 6 and 7; now 8.
        let u = o.used(9, 2);
        assert_eq!(u.count, 2);
        assert!(
            !o.admits(u, 2, |_| false),
            "9 counts 2 < 3; 1 is idle for 2 uses"
        );
        // A large capacity: only a higher count admits.
        let u = o.used(9, 100);
        assert!(!o.admits(u, 100, |_| false), "9 counts 3 = 3");
        let u = o.used(9, 100);
        assert!(o.admits(u, 100, |_| false), "9 counts 4 > 3");
    }
}
