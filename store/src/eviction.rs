//! Eviction policies of the store's tiers (`--eviction`): which block leaves a full tier,
//! and whether a newcomer may take its place at all.
//!
//! A policy ranks the blocks a tier may evict (the smallest [`Rank`] leaves first) and, for
//! [`EvictionPolicy::FreqAdmit`], gates newcomers. The tiers keep their own structure around
//! it (the RAM tier evicts only the leaves of its chains, cut-off blocks first; the SSD tier
//! keeps its recency across restarts) and ask a [`PolicyState`] for counts, ranks and
//! admission. Only the RAM tier gates: a block it does not admit is spilled to the SSD tier
//! like an evicted one; the SSD tier, the last local tier, admits every block and uses the
//! policy's order only. `kvstore bench trace --simulate` runs the same [`PolicyState`] over a trace,
//! so the simulated policy is the shipped one. docs/prefix-reuse.md ("Eviction") explains
//! the default and what "not admitted" means in each tier.
//!
//! Cost: a use is one hash-map update, O(1); the tiers keep ranks in ordered sets, O(log n)
//! per use. Freq-admit halves every count once per [`HALVING_PERIOD`] × capacity uses and
//! the tier re-ranks its blocks then: O(n log n) every 8n uses, O(log n) amortized.

use std::collections::HashMap;
use std::hash::Hash;

use serde::{Deserialize, Serialize};

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
}
