//! Cache simulations over a trace's blocks, with prefix semantics: a request's hit is the
//! longest prefix of its blocks all present in the cache, counted in (scaled) tokens.
//!
//! Blocks are named by their chain (the block's id after its parent's chain), as kvstore
//! names its own blocks, so equal ids at different positions never alias. A block remembers
//! how many of its tokens it holds: a request whose prompt ends inside a block caches only
//! that part, and a later request sharing the block hits only that part (and no further).
//! After a request, every one of its blocks is in the cache (admitted or refreshed), as a
//! prefill publishes all of them; a capacity of `C` blocks holds `C` of them whatever their
//! fill. The ideal is a cache without a capacity.
//!
//! LFU and freq-admit run the store's own [`ChainOrder`] (counts, halving, ranks, admission
//! gate, chains evicted leaves first), the RAM tier's code; the simulator only adds the
//! fills. The tier's LRU is `lru-leaf` here. `tier_tests.rs` replays traces through the real
//! RAM tier and checks it gets exactly these hits. S3-FIFO and W-TinyLFU are references the
//! simulator runs on its own, block by block, as Belady is (the store has neither:
//! docs/benchmarks.md, "Eviction policies at the H200 slice's budgets").

use std::collections::{BTreeSet, HashMap, VecDeque};

use store::eviction::{ChainOrder, EvictionPolicy, PolicyState};

use super::parse::TraceRequest;
use super::scale::TokenScale;

/// A request as the simulator sees it: its blocks' chain ids and its (scaled) length.
#[derive(Debug, Clone)]
pub struct SimRequest {
    /// Chain id of each block, first block first.
    pub chain: Vec<u32>,
    /// Prompt tokens.
    pub len: usize,
    /// Completion tokens.
    pub out: usize,
    /// Arrival in seconds of the trace's clock (its `timestamp`).
    pub at_s: f64,
}

/// The requests with their blocks named by chain; `block` tokens per block.
#[derive(Debug, Clone)]
pub struct SimTrace {
    /// Requests in arrival order.
    pub requests: Vec<SimRequest>,
    /// Tokens per block.
    pub block: usize,
}

impl SimTrace {
    /// Names every block of `requests` by its chain (parent chain, hash id).
    pub fn new(requests: &[TraceRequest], scale: &TokenScale) -> SimTrace {
        let mut ids: HashMap<(u32, u64), u32> = HashMap::new();
        let requests = requests
            .iter()
            .map(|r| {
                let mut parent = u32::MAX;
                let chain = r
                    .hash_ids
                    .iter()
                    .map(|&h| {
                        let next = ids.len() as u32;
                        parent = *ids.entry((parent, h)).or_insert(next);
                        parent
                    })
                    .collect();
                SimRequest {
                    chain,
                    len: scale.prompt_len(r),
                    out: scale.output_len(r),
                    at_s: r.timestamp as f64 / 1000.0,
                }
            })
            .collect();
        SimTrace {
            requests,
            block: scale.block(),
        }
    }

    /// Prompt tokens of every request together.
    pub fn prompt_tokens(&self) -> usize {
        self.requests.iter().map(|r| r.len).sum()
    }

    /// Tokens of request `r` inside its block `i`.
    pub(super) fn tokens_in(&self, r: &SimRequest, i: usize) -> usize {
        self.block.min(r.len - i * self.block)
    }

    /// For each request and block: the index of the next request holding that block
    /// (`u64::MAX`: none). What Belady's rule looks ahead at.
    fn next_uses(&self) -> Vec<Vec<u64>> {
        let mut next: HashMap<u32, u64> = HashMap::new();
        let mut out = vec![Vec::new(); self.requests.len()];
        for (j, r) in self.requests.iter().enumerate().rev() {
            out[j] = r
                .chain
                .iter()
                .map(|c| next.insert(*c, j as u64).unwrap_or(u64::MAX))
                .collect();
        }
        out
    }
}

/// For every request that an unbounded cache serves two blocks or more: how long ago, in
/// requests and in ms of trace time (`times_ms`, one per request), the deepest of those
/// blocks was last used. What a recency cache must span to get the hit.
pub fn reuse_gaps(t: &SimTrace, times_ms: &[u64]) -> Vec<(usize, u64)> {
    let mut last: HashMap<u32, usize> = HashMap::new();
    let mut out = Vec::new();
    for (j, r) in t.requests.iter().enumerate() {
        let held = r.chain.iter().take_while(|c| last.contains_key(c)).count();
        if held >= 2 {
            let i = last[&r.chain[held - 1]];
            out.push((j - i, times_ms[j].saturating_sub(times_ms[i])));
        }
        for c in &r.chain {
            last.insert(*c, j);
        }
    }
    out
}

/// Which block leaves a full cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Policy {
    /// Least recently used, blocks touched in prompt order: a request's first block is its
    /// least recent, as in a store tier that publishes blocks in order.
    Lru,
    /// Least recently used, touched leaf first: a request's last block is its least recent
    /// (vLLM's free queue order, SGLang's leaf eviction), so a cached set stays
    /// prefix-closed.
    LruLeaf,
    /// Least frequently used while cached (ties: leaf-first recency): the store's
    /// [`EvictionPolicy::Lfu`].
    Lfu,
    /// Frequency-gated admission, the store's [`EvictionPolicy::FreqAdmit`] (ties:
    /// leaf-first recency): every block's uses are counted, cached or not (halved every
    /// 8 × capacity uses, so old popularity fades); a full cache evicts its least-used
    /// block for a block used more often, or for any block once the victim sat unused
    /// through a whole turnover of the cache (more block uses than it holds blocks); else
    /// the new block is not cached. When conversations come back after more traffic than
    /// the cache holds, it keeps the ones that fit instead of each request flushing the
    /// oldest.
    FreqAdmit,
    /// Belady's rule, offline: evict the block whose next use is furthest away, and admit
    /// no block used later than every cached one. A block is never used before its parent,
    /// and ties go leaf first, so the cached set stays prefix-closed and prefix hits equal
    /// block hits: the optimum for block hits at this capacity (up to partial blocks
    /// counting fewer tokens), the ceiling for the other policies.
    Belady,
    /// S3-FIFO, simulator only, block by block (no chain rule: a block whose parent left
    /// only wastes its room): a small FIFO of a tenth of the capacity takes new blocks, a
    /// main FIFO the rest, and a ghost list remembers as many blocks as the cache holds.
    /// Each block counts its hits (up to 3). Room is made from the small FIFO while it
    /// holds its tenth: its oldest block moves to the main FIFO if it was hit there, else
    /// leaves for the ghost list; else from the main FIFO, whose oldest block goes back to
    /// the front with one hit less, or leaves when it has none. A block the ghost list
    /// remembers enters the main FIFO directly. A request's blocks enter leaf first.
    S3Fifo,
    /// W-TinyLFU, simulator only, block by block: a recency window of a hundredth of the
    /// capacity in front of a segmented LRU (probation, and protected for blocks hit in
    /// probation, at most 80 % of the rest). The window's least recent block enters
    /// probation while there is room, else only if used more often (every use counted,
    /// cached or not, halved every 8 × capacity uses, as freq-admit) than probation's least
    /// recent block, which then leaves. Recency is leaf first, as `lru-leaf`.
    WTinyLfu,
}

impl Policy {
    /// Every policy, in report order.
    pub const ALL: [Policy; 7] = [
        Policy::Lru,
        Policy::LruLeaf,
        Policy::Lfu,
        Policy::FreqAdmit,
        Policy::S3Fifo,
        Policy::WTinyLfu,
        Policy::Belady,
    ];

    /// The name used in reports and on the command line.
    pub fn name(self) -> &'static str {
        match self {
            Policy::Lru => "lru",
            Policy::LruLeaf => "lru-leaf",
            Policy::Lfu => "lfu",
            Policy::FreqAdmit => "freq-admit",
            Policy::Belady => "belady",
            Policy::S3Fifo => "s3-fifo",
            Policy::WTinyLfu => "w-tinylfu",
        }
    }

    /// The simulated policy the store's `policy` is.
    pub fn of_store(policy: EvictionPolicy) -> Policy {
        match policy {
            EvictionPolicy::Lru => Policy::Lru,
            EvictionPolicy::Lfu => Policy::Lfu,
            EvictionPolicy::FreqAdmit => Policy::FreqAdmit,
        }
    }

    /// The store's policy this one is (LRU for the recency orders and the policies the
    /// simulator runs on its own).
    fn shared(self) -> EvictionPolicy {
        match self {
            Policy::Lru | Policy::LruLeaf | Policy::Belady | Policy::S3Fifo | Policy::WTinyLfu => {
                EvictionPolicy::Lru
            }
            Policy::Lfu => EvictionPolicy::Lfu,
            Policy::FreqAdmit => EvictionPolicy::FreqAdmit,
        }
    }
}

/// Eviction order: the smallest key leaves first.
type Prio = (u64, u64);

struct Slot {
    fill: usize,
    prio: Prio,
}

/// Hit tokens of every request with an unbounded cache.
pub fn ideal(t: &SimTrace) -> Vec<usize> {
    simulate(t, Policy::Lru, usize::MAX)
}

/// Hit tokens of every request with a cache of `capacity` blocks under `policy`.
pub fn simulate(t: &SimTrace, policy: Policy, capacity: usize) -> Vec<usize> {
    match policy {
        Policy::Lfu | Policy::FreqAdmit => simulate_tier(t, policy.shared(), capacity),
        Policy::Lru | Policy::LruLeaf | Policy::Belady => simulate_order(t, policy, capacity),
        Policy::S3Fifo => simulate_s3_fifo(t, capacity),
        Policy::WTinyLfu => simulate_w_tinylfu(t, capacity),
    }
}

/// The hit of request `r` against the blocks held: the longest run of present blocks, each
/// held as far as the request reads it; a block held only in part ends the run.
fn hit(t: &SimTrace, r: &SimRequest, fill: impl Fn(u32) -> Option<usize>) -> usize {
    let mut hit = 0;
    for (i, c) in r.chain.iter().enumerate() {
        let want = t.tokens_in(r, i);
        let got = fill(*c).map_or(0, |f| f.min(want));
        hit += got;
        if got < want {
            break;
        }
    }
    hit
}

/// The recency orders and Belady: one ordered set over every cached block.
fn simulate_order(t: &SimTrace, policy: Policy, capacity: usize) -> Vec<usize> {
    let next = match policy {
        Policy::Belady => t.next_uses(),
        _ => Vec::new(),
    };
    let mut slots: HashMap<u32, Slot> = HashMap::new();
    let mut order: BTreeSet<(Prio, u32)> = BTreeSet::new();
    let mut clock = 0u64;
    let mut hits = Vec::with_capacity(t.requests.len());
    for (j, r) in t.requests.iter().enumerate() {
        hits.push(hit(t, r, |c| slots.get(&c).map(|s| s.fill)));
        // Every block of the request is refreshed or admitted.
        let n = r.chain.len() as u64;
        for (i, &c) in r.chain.iter().enumerate() {
            let root_first = clock + i as u64;
            let leaf_first = clock + (n - 1 - i as u64);
            let prio = match policy {
                Policy::Lru => (root_first, 0),
                Policy::Belady => (u64::MAX - next[j][i], leaf_first),
                _ => (leaf_first, 0),
            };
            let fill = t.tokens_in(r, i);
            if let Some(s) = slots.get_mut(&c) {
                order.remove(&(s.prio, c));
                s.fill = s.fill.max(fill);
                s.prio = prio;
                order.insert((prio, c));
                continue;
            }
            if capacity == 0 {
                continue;
            }
            if slots.len() >= capacity {
                let Some(&(victim_prio, victim)) = order.first() else {
                    continue;
                };
                if policy == Policy::Belady && prio <= victim_prio {
                    continue;
                }
                order.remove(&(victim_prio, victim));
                slots.remove(&victim);
            }
            slots.insert(c, Slot { fill, prio });
            order.insert((prio, c));
        }
        clock += n;
    }
    hits
}

/// S3-FIFO's small queue: this share of the capacity.
const S3_SMALL_SHARE: f64 = 0.1;
/// S3-FIFO's cap on a block's hit count.
const S3_MAX_HITS: u8 = 3;

/// [`Policy::S3Fifo`].
fn simulate_s3_fifo(t: &SimTrace, capacity: usize) -> Vec<usize> {
    let small_max = ((capacity as f64 * S3_SMALL_SHARE) as usize).max(1);
    // Each cached block: its fill and hits since it entered its queue.
    let mut slots: HashMap<u32, (usize, u8)> = HashMap::new();
    let mut small: VecDeque<u32> = VecDeque::new();
    let mut main: VecDeque<u32> = VecDeque::new();
    // The ghost list in eviction order, each block with the number it left under (a block
    // can leave, come back and leave again: only its latest entry counts).
    let mut ghost: VecDeque<(u32, u64)> = VecDeque::new();
    let mut ghosts: HashMap<u32, u64> = HashMap::new();
    let mut left = 0u64;
    let mut hits = Vec::with_capacity(t.requests.len());
    for r in &t.requests {
        hits.push(hit(t, r, |c| slots.get(&c).map(|s| s.0)));
        for (i, &c) in r.chain.iter().enumerate().rev() {
            let fill = t.tokens_in(r, i);
            if let Some(s) = slots.get_mut(&c) {
                s.0 = s.0.max(fill);
                s.1 = (s.1 + 1).min(S3_MAX_HITS);
                continue;
            }
            if capacity == 0 {
                continue;
            }
            while slots.len() >= capacity {
                if small.len() >= small_max || main.is_empty() {
                    let Some(v) = small.pop_front() else { break };
                    if slots[&v].1 > 0 {
                        slots.insert(v, (slots[&v].0, 0));
                        main.push_back(v);
                        continue;
                    }
                    slots.remove(&v);
                    left += 1;
                    ghost.push_back((v, left));
                    ghosts.insert(v, left);
                    while ghosts.len() > capacity {
                        let Some((g, n)) = ghost.pop_front() else {
                            break;
                        };
                        if ghosts.get(&g) == Some(&n) {
                            ghosts.remove(&g);
                        }
                    }
                } else if let Some(v) = main.pop_front() {
                    let s = slots.get_mut(&v).expect("main holds cached blocks");
                    if s.1 > 0 {
                        s.1 -= 1;
                        main.push_back(v);
                    } else {
                        slots.remove(&v);
                    }
                }
            }
            slots.insert(c, (fill, 0));
            if ghosts.remove(&c).is_some() {
                main.push_back(c);
            } else {
                small.push_back(c);
            }
        }
    }
    hits
}

/// W-TinyLFU's window: this share of the capacity.
const W_WINDOW_SHARE: f64 = 0.01;
/// W-TinyLFU's protected segment: at most this share of the main cache.
const W_PROTECTED_SHARE: f64 = 0.8;

/// [`Policy::WTinyLfu`].
fn simulate_w_tinylfu(t: &SimTrace, capacity: usize) -> Vec<usize> {
    const WINDOW: usize = 0;
    const PROBATION: usize = 1;
    const PROTECTED: usize = 2;
    let window_max = ((capacity as f64 * W_WINDOW_SHARE) as usize).max(1);
    let protected_max = (capacity.saturating_sub(window_max) as f64 * W_PROTECTED_SHARE) as usize;
    let mut fills: HashMap<u32, usize> = HashMap::new();
    // Each cached block: its segment and recency.
    let mut seg: HashMap<u32, (usize, u64)> = HashMap::new();
    let mut lists: [BTreeSet<(u64, u32)>; 3] = Default::default();
    let mut counts: PolicyState<u32> = PolicyState::new(EvictionPolicy::FreqAdmit);
    let cap = capacity as u64;
    let mut clock = 0u64;
    let mut hits = Vec::with_capacity(t.requests.len());
    for r in &t.requests {
        hits.push(hit(t, r, |c| fills.get(&c).copied()));
        let n = r.chain.len() as u64;
        for (i, &c) in r.chain.iter().enumerate() {
            counts.record_use(c, None, cap);
            let stamp = clock + (n - 1 - i as u64);
            let fill = t.tokens_in(r, i);
            if capacity == 0 {
                continue;
            }
            if let Some(&(s, old)) = seg.get(&c) {
                lists[s].remove(&(old, c));
                let s = if s == PROBATION { PROTECTED } else { s };
                lists[s].insert((stamp, c));
                seg.insert(c, (s, stamp));
                fills.insert(c, fills[&c].max(fill));
                while lists[PROTECTED].len() > protected_max {
                    let Some((at, d)) = lists[PROTECTED].pop_first() else {
                        break;
                    };
                    lists[PROBATION].insert((at, d));
                    seg.insert(d, (PROBATION, at));
                }
                continue;
            }
            lists[WINDOW].insert((stamp, c));
            seg.insert(c, (WINDOW, stamp));
            fills.insert(c, fill);
            while lists[WINDOW].len() > window_max {
                let Some((at, cand)) = lists[WINDOW].pop_first() else {
                    break;
                };
                let victim = lists[PROBATION]
                    .first()
                    .or_else(|| lists[PROTECTED].first())
                    .copied();
                let admit = match victim {
                    Some((v_at, v)) if fills.len() > capacity => {
                        let won = counts.count(cand) > counts.count(v);
                        let gone = if won { v } else { cand };
                        if won {
                            lists[seg[&v].0].remove(&(v_at, v));
                        }
                        seg.remove(&gone);
                        fills.remove(&gone);
                        won
                    }
                    _ => true,
                };
                if admit {
                    lists[PROBATION].insert((at, cand));
                    seg.insert(cand, (PROBATION, at));
                }
            }
            while fills.len() > capacity {
                let Some(s) = (PROBATION..=PROTECTED)
                    .chain([WINDOW])
                    .find(|&s| !lists[s].is_empty())
                else {
                    break;
                };
                if let Some((_, v)) = lists[s].pop_first() {
                    seg.remove(&v);
                    fills.remove(&v);
                }
            }
        }
        clock += n;
    }
    hits
}

/// The store's policies as the RAM tier runs them: its [`ChainOrder`] (a block with a
/// cached child is never evicted, cut-off blocks go first, freq-admit's gate), driven as
/// the store is: the request's run of cached blocks is used root first (a load), then
/// refreshed leaf first (so its root is the most recent), then its other blocks are used
/// root first (publication: a cached one is refreshed, a new one admitted or refused).
fn simulate_tier(t: &SimTrace, policy: EvictionPolicy, capacity: usize) -> Vec<usize> {
    let mut order: ChainOrder<u32> = ChainOrder::new(policy);
    let mut fills: HashMap<u32, usize> = HashMap::new();
    let cap = capacity as u64;
    let mut hits = Vec::with_capacity(t.requests.len());
    for r in &t.requests {
        hits.push(hit(t, r, |c| order.contains(c).then(|| fills[&c])));
        let run = r.chain.iter().take_while(|c| order.contains(**c)).count();
        for (i, &c) in r.chain[..run].iter().enumerate() {
            order.used(c, cap);
            let f = fills.entry(c).or_insert(0);
            *f = (*f).max(t.tokens_in(r, i));
        }
        for &c in r.chain[..run].iter().rev() {
            order.touch(c);
        }
        for (i, &c) in r.chain.iter().enumerate().skip(run) {
            let fill = t.tokens_in(r, i);
            let u = order.used(c, cap);
            if order.contains(c) {
                let f = fills.entry(c).or_insert(0);
                *f = (*f).max(fill);
                continue;
            }
            if capacity == 0 || (order.len() >= capacity && !order.admits(u, cap, |_| false)) {
                continue;
            }
            let parent = i.checked_sub(1).map(|p| r.chain[p]);
            order.insert(c, parent, u);
            fills.insert(c, fill);
            while order.len() > capacity {
                let victim = order.victim(Some(c), |_| false).unwrap_or(c);
                order.remove(victim);
                fills.remove(&victim);
                if victim == c {
                    break;
                }
            }
        }
    }
    hits
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A request of `tokens` scaled tokens (the trace length is tokens × 1/F).
    fn req(ids: &[u64], tokens: usize, scale: &TokenScale) -> TraceRequest {
        TraceRequest {
            timestamp: 0,
            input_length: (tokens as f64 / scale.factor()).round() as usize,
            output_length: 1,
            hash_ids: ids.to_vec(),
        }
    }

    fn trace(reqs: &[(&[u64], usize)], factor: f64) -> SimTrace {
        let s = TokenScale::new(factor).unwrap();
        let r: Vec<TraceRequest> = reqs.iter().map(|(i, n)| req(i, *n, &s)).collect();
        let t = SimTrace::new(&r, &s);
        for (a, b) in t.requests.iter().zip(reqs) {
            assert_eq!(a.len, b.1);
        }
        t
    }

    /// Blocks of 2 tokens; ids A=1, B=2, C=3, D=4.
    ///   r0 [A B]   4 tokens: nothing cached                          -> 0
    ///   r1 [A C]   3 tokens: A (2); C is new                         -> 2 (C cached with 1 token)
    ///   r2 [A B D] 6 tokens: A, B (4); D is new                      -> 4
    ///   r3 [A C]   4 tokens: A (2), then C holds 1 of the 2 wanted   -> 3
    ///   r4 [C]     2 tokens: a C at the root is another chain        -> 0
    /// Ideal: 9 of 19 prompt tokens.
    #[test]
    fn ideal_counts_prefixes_and_partial_blocks() {
        let t = trace(
            &[
                (&[1, 2], 4),
                (&[1, 3], 3),
                (&[1, 2, 4], 6),
                (&[1, 3], 4),
                (&[3], 2),
            ],
            1.0 / 256.0,
        );
        assert_eq!(t.block, 2);
        assert_eq!(ideal(&t), vec![0, 2, 4, 3, 0]);
        assert_eq!(t.prompt_tokens(), 19);
        // With room for every block, every policy is the ideal.
        for p in Policy::ALL {
            assert_eq!(simulate(&t, p, 100), ideal(&t), "{p:?}");
        }
        // No room at all: no hits.
        for p in Policy::ALL {
            assert_eq!(simulate(&t, p, 0), vec![0; 5], "{p:?}");
        }
    }

    /// Blocks of 1 token, capacity 2 blocks; A=1, B=2 (a two-block conversation), X=3.
    ///   requests: [A B], [X], [A B], [X], [A B]           ideal: 0, 0, 2, 1, 2 = 5 of 7
    /// lru (root first): r0 caches A(t0) B(t1); r1 X evicts A (oldest); r2 misses A, so
    ///   nothing; re-admitting A evicts B, B evicts X; r3 misses X (evicts A); r4 misses A.
    ///   = 0 of 7: the first block leaves first and every later block is useless.
    /// lru-leaf: r0 caches B(t0) A(t1); X(t2) evicts B; r2 hits A only (1), B evicts X;
    ///   r3 misses X (evicts B: A was refreshed at r2); r4 hits A (1) = 2 of 7.
    /// lfu: the same as lru-leaf here (every count is 1 or 2 and A's is highest) = 2 of 7.
    /// belady: r1's X is next used at r3, after A and B (r2): not admitted; r2 hits A B (2);
    ///   r3's X is never used again: not admitted; r4 hits A B (2) = 4 of 7.
    #[test]
    fn lru_leaf_lfu_belady_by_hand() {
        let t = trace(
            &[
                (&[1, 2], 2),
                (&[3], 1),
                (&[1, 2], 2),
                (&[3], 1),
                (&[1, 2], 2),
            ],
            1.0 / 512.0,
        );
        assert_eq!(ideal(&t), vec![0, 0, 2, 1, 2]);
        assert_eq!(simulate(&t, Policy::Lru, 2), vec![0, 0, 0, 0, 0]);
        assert_eq!(simulate(&t, Policy::LruLeaf, 2), vec![0, 0, 1, 0, 1]);
        assert_eq!(simulate(&t, Policy::Lfu, 2), vec![0, 0, 1, 0, 1]);
        assert_eq!(simulate(&t, Policy::Belady, 2), vec![0, 0, 2, 0, 2]);
    }

    /// Blocks of 1 token, capacity 2; requests [A], [A], [B], [C], [A].
    ///   lru: A is hit at r1; B and C fill the cache, C evicts A (older than B); r4 misses
    ///   = 1 of 5.
    ///   lfu: A has count 2, B count 1: C evicts B; r4 hits A = 2 of 5 (= belady = ideal).
    #[test]
    fn lfu_keeps_the_popular_block_that_lru_drops() {
        let t = trace(
            &[(&[1], 1), (&[1], 1), (&[2], 1), (&[3], 1), (&[1], 1)],
            1.0 / 512.0,
        );
        assert_eq!(ideal(&t), vec![0, 1, 0, 0, 1]);
        assert_eq!(simulate(&t, Policy::Lru, 2), vec![0, 1, 0, 0, 0]);
        assert_eq!(simulate(&t, Policy::LruLeaf, 2), vec![0, 1, 0, 0, 0]);
        assert_eq!(simulate(&t, Policy::Lfu, 2), vec![0, 1, 0, 0, 1]);
        assert_eq!(simulate(&t, Policy::Belady, 2), vec![0, 1, 0, 0, 1]);
    }

    /// Requests [A B] at 0 ms, [A C] at 10, [X] at 20, [A B D] at 50, [A C] at 70: the
    /// fourth is served A B, last used by the first (3 requests, 50 ms ago); the fifth A C,
    /// last used by the second (3 requests, 60 ms); the second is served A only (not
    /// counted).
    #[test]
    fn reuse_gaps_by_hand() {
        let t = trace(
            &[
                (&[1, 2], 2),
                (&[1, 3], 2),
                (&[9], 1),
                (&[1, 2, 4], 3),
                (&[1, 3], 2),
            ],
            1.0 / 512.0,
        );
        assert_eq!(reuse_gaps(&t, &[0, 10, 20, 50, 70]), vec![(3, 50), (3, 60)]);
    }

    /// Blocks of 1 token, capacity 2; A B C requested in a loop three times. LRU (either
    /// order) always evicts the block that comes next: 0 hits. freq-admit does not let C
    /// push out A or B (used as often, and not idle for a turnover of the cache) and keeps
    /// hitting them: r3 r4 r6 r7 = 4 of 9, Belady's 4 (the ideal is 6).
    #[test]
    fn freq_admit_keeps_part_of_a_loop_lru_flushes() {
        let t = trace(
            &[
                (&[1], 1),
                (&[2], 1),
                (&[3], 1),
                (&[1], 1),
                (&[2], 1),
                (&[3], 1),
                (&[1], 1),
                (&[2], 1),
                (&[3], 1),
            ],
            1.0 / 512.0,
        );
        assert_eq!(ideal(&t).iter().sum::<usize>(), 6);
        assert_eq!(simulate(&t, Policy::Lru, 2).iter().sum::<usize>(), 0);
        assert_eq!(simulate(&t, Policy::LruLeaf, 2).iter().sum::<usize>(), 0);
        assert_eq!(
            simulate(&t, Policy::FreqAdmit, 2),
            vec![0, 0, 0, 1, 1, 0, 1, 1, 0]
        );
        assert_eq!(simulate(&t, Policy::Belady, 2).iter().sum::<usize>(), 4);
    }

    /// freq-admit still turns over: a block unused for a whole turnover of the cache gives
    /// way to a newcomer even when it was used more often. Capacity 1, blocks of 1 token:
    /// A, A, B, C, A: B is refused (A was used twice and sat idle for one use only); C
    /// replaces A (idle for two uses now, more than the cache's one block), so A misses
    /// when it comes back.
    #[test]
    fn freq_admit_lets_an_idle_block_go() {
        let t = trace(
            &[(&[1], 1), (&[1], 1), (&[2], 1), (&[3], 1), (&[1], 1)],
            1.0 / 512.0,
        );
        assert_eq!(simulate(&t, Policy::FreqAdmit, 1), vec![0, 1, 0, 0, 0]);
    }

    /// Requests of one block of 1 token each.
    fn one_block_each(ids: &[u64]) -> SimTrace {
        let blocks: Vec<[u64; 1]> = ids.iter().map(|&id| [id]).collect();
        let reqs: Vec<(&[u64], usize)> = blocks.iter().map(|b| (&b[..], 1)).collect();
        trace(&reqs, 1.0 / 512.0)
    }

    /// S3-FIFO, blocks of 1 token, capacity 2 (a small FIFO of 1 block); requests A, A, B,
    /// C, A, B, C, A, B:
    ///   r1 hits A; r3's C makes room from the small FIFO [A B]: A was hit, moves to the
    ///   main FIFO; B was not, leaves for the ghost list; C enters the small FIFO.
    ///   r4 hits A (in main); r5's B evicts C (small, not hit: ghost), and B, remembered by
    ///   the ghost list, enters main directly: main [A B].
    ///   r6's C: the small FIFO is empty, so main: A goes back with its hit spent, B (no
    ///   hit) leaves; C (a ghost) enters main [A C]. r7 hits A; r8 misses B (main's
    ///   evictions leave no ghost) = 3 of 9. lru-leaf keeps the two latest: 1 (r1).
    #[test]
    fn s3_fifo_by_hand() {
        let t = one_block_each(&[1, 1, 2, 3, 1, 2, 3, 1, 2]);
        assert_eq!(
            simulate(&t, Policy::S3Fifo, 2),
            vec![0, 1, 0, 0, 1, 0, 0, 1, 0]
        );
        assert_eq!(simulate(&t, Policy::LruLeaf, 2).iter().sum::<usize>(), 1);
    }

    /// W-TinyLFU, blocks of 1 token, capacity 3: a window of 1, protected at most 1;
    /// requests A B C A D C E C B A (10 uses: no halving, which comes every 24).
    ///   A B C fill the cache (window C, probation A B); r3 hits A (to protected).
    ///   r4's D pushes C out of the window; C (count 1) does not beat probation's least
    ///   recent B (count 1): C leaves. r5's C (count 2) pushes D out: D (1) loses to B (1).
    ///   r6's E pushes C out: C (2) beats B (1), B leaves, C enters probation.
    ///   r7 hits C: protected [A C] is over 1, A goes back to probation.
    ///   r8's B (count 2) pushes E out: E (1) loses to A (2). r9 hits A = 3 of 10.
    #[test]
    fn w_tinylfu_by_hand() {
        let t = one_block_each(&[1, 2, 3, 1, 4, 3, 5, 3, 2, 1]);
        assert_eq!(
            simulate(&t, Policy::WTinyLfu, 3),
            vec![0, 0, 0, 1, 0, 0, 0, 1, 0, 1]
        );
    }

    /// The same id under different parents is a different block.
    #[test]
    fn chains_do_not_alias_equal_ids() {
        let t = trace(&[(&[1, 2], 2), (&[2], 1), (&[5, 2], 2)], 1.0 / 512.0);
        assert_eq!(t.requests[0].chain[1], 1);
        assert_ne!(t.requests[0].chain[1], t.requests[1].chain[0]);
        assert_ne!(t.requests[0].chain[1], t.requests[2].chain[1]);
        assert_eq!(ideal(&t), vec![0, 0, 0]);
    }
}
