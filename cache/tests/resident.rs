//! The device tier ([`ResidentPool`]) against a simple model: random admit / extend / fork /
//! finish / evict / restore sequences, with every token's keys and values a known function
//! of its id and position, so any block served from the wrong place, freed while in use or
//! overwritten by another sequence shows up as a wrong byte. Admissions may share a
//! resident prefix (the cache reads the entry's arenas) instead of forking it: a referenced
//! entry must never be freed or overwritten, and its count of sharers must always equal the
//! caches that read it.

use std::collections::HashMap;
use std::sync::Arc;

use cache::{Chain, KvCache, KvFormat, PagedConfig, PagedKvCache, ResidentPool};
use mlx::fast::AttentionMask;
use mlx::Array;
use proptest::prelude::*;
use store::{Block, BlockKey, NamespaceId};

const BS: usize = 4;
const H: usize = 1;
const D: usize = 4;

/// Keys of `tokens` at positions `start..`: `[1, H, n, D]`, a function of (id, position).
fn kv(tokens: &[u32], start: usize) -> (Array, Array) {
    let mut k = Vec::new();
    for h in 0..H {
        for (i, &t) in tokens.iter().enumerate() {
            for d in 0..D {
                k.push(t as f32 * 0.25 + (start + i) as f32 * 16.0 + d as f32 + h as f32 * 0.5);
            }
        }
    }
    let v: Vec<f32> = k.iter().map(|x| -x - 1.0).collect();
    let shape = [1, H as i32, tokens.len() as i32, D as i32];
    (
        Array::from_slice(&k, &shape).unwrap(),
        Array::from_slice(&v, &shape).unwrap(),
    )
}

fn config() -> PagedConfig {
    PagedConfig {
        block_size: BS,
        format: KvFormat::Float,
        initial_blocks: 2,
        max_blocks: 256,
    }
}

fn append(cache: &mut PagedKvCache, tokens: &[u32], start: usize) {
    if tokens.is_empty() {
        return;
    }
    let (k, v) = kv(tokens, start);
    cache.update_and_fetch(0, &k, &v).unwrap();
}

/// The cache holds exactly the keys and values of `tokens`.
fn assert_holds(cache: &PagedKvCache, tokens: &[u32]) {
    assert_eq!(cache.offset(), tokens.len());
    if tokens.is_empty() {
        return;
    }
    let (k, v) = cache.fetch(0).unwrap().unwrap();
    let (ek, ev) = kv(tokens, 0);
    assert_eq!(
        k.to_bytes().unwrap(),
        ek.to_bytes().unwrap(),
        "keys of {tokens:?}"
    );
    assert_eq!(
        v.to_bytes().unwrap(),
        ev.to_bytes().unwrap(),
        "values of {tokens:?}"
    );
}

#[derive(Debug, Clone)]
enum Op {
    /// A request: a prompt built from a resident (or published) sequence's first `keep`
    /// tokens (index into what exists, modulo) plus `fresh` new tokens; it stays live.
    Admit {
        base: usize,
        keep: usize,
        fresh: Vec<u32>,
        /// Whether a device hit that is not a handover shares the prefix (else it forks).
        share: bool,
    },
    /// A live request generates `n` tokens and finishes (publish + park).
    Finish { which: usize, n: usize },
    /// A live request is dropped without parking (cancelled).
    Drop { which: usize },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (0usize..8, 0usize..40, prop::collection::vec(0u32..3, 1..12), any::<bool>())
            .prop_map(|(base, keep, fresh, share)| Op::Admit { base, keep, fresh, share }),
        3 => (0usize..4, 0usize..9).prop_map(|(which, n)| Op::Finish { which, n }),
        1 => (0usize..4).prop_map(|which| Op::Drop { which }),
    ]
}

struct Live {
    tokens: Vec<u32>,
    chain: Chain,
    cache: PagedKvCache,
    reserve: u64,
}

fn run(ops: Vec<Op>, budget_blocks: u64) {
    let ns = NamespaceId([3; 32]);
    let block_bytes = (2 * H * BS * D * 4) as u64;
    let mut pool = ResidentPool::new(budget_blocks * block_bytes);
    // The host tier: every block ever published, by key.
    let mut host: HashMap<BlockKey, Arc<Block>> = HashMap::new();
    let mut known: Vec<Vec<u32>> = vec![vec![0; 9]];
    let mut live: Vec<Live> = Vec::new();
    for op in ops {
        match op {
            Op::Admit {
                base,
                keep,
                fresh,
                share,
            } => {
                pool.set_share_min_tokens(if share { 1 } else { usize::MAX });
                let base = &known[base % known.len()];
                let mut prompt = base[..keep.min(base.len())].to_vec();
                prompt.extend(fresh);
                let limit = prompt.len() - 1;
                let chain = Chain::of(ns, BS, &prompt[..limit]);
                // What the pool holds right now, to check its answer against.
                let resident: Vec<Vec<u32>> =
                    pool.sequences(ns).iter().map(|s| s.to_vec()).collect();
                let best = resident
                    .iter()
                    .map(|s| {
                        s.iter()
                            .zip(&prompt[..limit])
                            .take_while(|(a, b)| a == b)
                            .count()
                    })
                    .max()
                    .unwrap_or(0);
                let hit = pool.take(&chain, &prompt, limit).unwrap();
                let (mut cache, got) = match hit {
                    Some(h) => {
                        assert_eq!(h.tokens, best, "match length");
                        if h.shared {
                            let (entry, tokens) = h.cache.shared_prefix().unwrap();
                            assert_eq!(tokens, h.tokens, "shared prefix length");
                            assert!(pool.sharers(entry).unwrap() >= 1, "an unreferenced share");
                        }
                        if h.handed_over {
                            // Handed over: all but at most a quarter of a sequence matched.
                            assert!(resident.iter().any(
                                |s| s.len() >= h.tokens && (s.len() - h.tokens) * 4 <= s.len()
                            ));
                        }
                        (h.cache, h.tokens)
                    }
                    None => {
                        assert!(best < BS, "a resident prefix of {best} tokens was missed");
                        (PagedKvCache::new(1, config()).unwrap(), 0)
                    }
                };
                assert_holds(&cache, &prompt[..got]);
                // Blocks after the device hit come from the host tier, in bulk.
                let first = got / BS;
                let more: Vec<Arc<Block>> = chain.keys()[first..]
                    .iter()
                    .map_while(|k| host.get(k).cloned())
                    .collect();
                if (first + more.len()) * BS > got {
                    cache.trim(got - first * BS).unwrap();
                    let r = cache.restore_onto(&more).unwrap();
                    assert_eq!(r.blocks, more.len(), "{:?}", r.stopped);
                    cache = r.cache;
                }
                let held = cache.offset();
                assert_holds(&cache, &prompt[..held]);
                append(&mut cache, &prompt[held..], held);
                // A sharer's own pools hold what follows the prefix (one block more where
                // the prefix ends inside a block); the prefix is the entry's, counted once.
                let shared = cache.shared_prefix().map_or(0, |(_, m)| m);
                let own_blocks = (prompt.len() + 8 - shared).div_ceil(BS) + usize::from(shared > 0);
                let reserve = own_blocks as u64 * block_bytes;
                if !pool.reserve(reserve) {
                    // Admission refused: it does not fit beside what the pool must keep.
                    pool.release(reserve);
                    continue;
                }
                live.push(Live {
                    tokens: prompt,
                    chain,
                    cache,
                    reserve,
                });
            }
            Op::Finish { which, n } => {
                if live.is_empty() {
                    continue;
                }
                let mut l = live.remove(which % live.len());
                let generated: Vec<u32> = (0..n as u32).map(|i| 3 + i % 2).collect();
                let start = l.tokens.len();
                append(&mut l.cache, &generated, start);
                l.tokens.extend(generated);
                assert_holds(&l.cache, &l.tokens);
                for b in l.cache.publish(&mut l.chain, &l.tokens).unwrap() {
                    host.insert(b.meta.key, Arc::new(b));
                }
                pool.release(l.reserve);
                known.push(l.tokens.clone());
                pool.park(l.chain, l.tokens, l.cache);
            }
            Op::Drop { which } => {
                if !live.is_empty() {
                    let l = live.remove(which % live.len());
                    pool.release(l.reserve);
                }
            }
        }
        let s = pool.stats();
        assert!(
            s.resident_bytes + s.live_bytes <= s.budget_bytes,
            "over budget: {s:?}"
        );
        assert_share_counts(&pool, live.iter().map(|l| &l.cache));
        // Live sequences were never altered by anything the pool did.
        for l in &live {
            assert_holds(&l.cache, &l.tokens);
        }
    }
    for l in live.drain(..) {
        pool.release(l.reserve);
    }
    assert_eq!(pool.stats().live_bytes, 0, "reservations leaked");
    // Only parked sharers still reference entries; evicting everything brings every count
    // back to zero (a source goes once its parked sharers went).
    assert_share_counts(&pool, std::iter::empty());
    let kept = pool.stats().sequences;
    let probe_pool = pool.stats().budget_bytes;
    if kept > 0 {
        assert!(
            pool.reserve(probe_pool),
            "all but shared sequences are evictable"
        );
        assert_eq!(pool.stats().sequences, 0, "a sequence outlived its sharers");
        pool.release(probe_pool);
    }
    // Every sequence still resident holds exactly its tokens: handing over the last one
    // returns it intact.
    let resident: Vec<Vec<u32>> = pool.sequences(ns).iter().map(|s| s.to_vec()).collect();
    for s in resident {
        if s.len() < BS + 1 {
            continue;
        }
        let chain = Chain::of(ns, BS, &s);
        let mut probe = s.clone();
        probe.push(99);
        if let Some(h) = pool.take(&chain, &probe, s.len()).unwrap() {
            assert_holds(&h.cache, &probe[..h.tokens]);
        }
    }
}

/// Every resident entry's count of sharers equals the caches that read it: the `live`
/// ones and the resident sequences whose cache is a sharer; a live cache's source is
/// resident.
fn assert_share_counts<'a>(pool: &ResidentPool, live: impl Iterator<Item = &'a PagedKvCache>) {
    let mut want: HashMap<u64, usize> = HashMap::new();
    for c in live {
        if let Some((entry, _)) = c.shared_prefix() {
            assert!(
                pool.sharers(entry).is_some(),
                "a referenced entry was freed"
            );
            *want.entry(entry).or_default() += 1;
        }
    }
    let counts = pool.share_counts();
    for c in &counts {
        if let Some(source) = c.source {
            *want.entry(source).or_default() += 1;
        }
    }
    for c in &counts {
        assert_eq!(
            c.sharers,
            want.remove(&c.entry).unwrap_or(0),
            "sharers of {}",
            c.entry
        );
    }
    assert!(want.is_empty(), "sharers of entries not resident: {want:?}");
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    #[test]
    fn the_pool_serves_exact_prefixes_and_stays_in_budget(
        ops in prop::collection::vec(op(), 1..40),
        budget_blocks in 4u64..64,
    ) {
        run(ops, budget_blocks);
    }
}

#[test]
fn a_whole_match_hands_the_arenas_over_and_a_partial_one_forks() {
    let ns = NamespaceId([5; 32]);
    let mut pool = ResidentPool::new(1 << 20);
    let tokens: Vec<u32> = (0..10).collect();
    let mut cache = PagedKvCache::new(1, config()).unwrap();
    append(&mut cache, &tokens, 0);
    cache.pool(0).unwrap().arrays()[0].eval().unwrap();
    let arena = cache.pool(0).unwrap().arrays()[0].data_addr().unwrap();
    pool.park(Chain::new(ns, BS), tokens.clone(), cache);

    // A prompt that leaves the sequence at token 6 (mid-block) forks it; so does a second
    // one arriving at the same time. Each gets a pool of its own holding the matched
    // blocks, copied once at the hit and sized for them, never the resident sequence's
    // buffer or its whole capacity.
    let mut fork_prompt = tokens[..6].to_vec();
    fork_prompt.extend([40, 41, 42]);
    let chain = Chain::of(ns, BS, &fork_prompt);
    let fork = pool.take(&chain, &fork_prompt, 8).unwrap().unwrap();
    assert_eq!((fork.tokens, fork.handed_over), (6, false));
    let other = pool.take(&chain, &fork_prompt, 8).unwrap().unwrap();
    for c in [&fork.cache, &other.cache] {
        let own = &c.pool(0).unwrap().arrays()[0];
        own.eval().unwrap();
        assert_ne!(own.data_addr().unwrap(), arena, "a copy of its own");
        assert_holds(c, &tokens[..6]);
    }
    let mut other = other.cache;
    append(&mut other, &[50, 51], 6);
    assert_holds(&other, &[0, 1, 2, 3, 4, 5, 50, 51]);
    let mut fork = fork.cache;
    append(&mut fork, &fork_prompt[6..], 6);
    assert_holds(&fork, &fork_prompt);
    assert_eq!(pool.stats().sequences, 1);

    // The whole sequence plus new tokens takes its arenas as they are: same buffer.
    let mut next = tokens.clone();
    next.extend([7, 7, 7]);
    let chain = Chain::of(ns, BS, &next);
    let hit = pool.take(&chain, &next, next.len() - 1).unwrap().unwrap();
    assert_eq!((hit.tokens, hit.handed_over), (10, true));
    assert_eq!(
        hit.cache.pool(0).unwrap().arrays()[0].data_addr().unwrap(),
        arena
    );
    assert_holds(&hit.cache, &tokens);
    assert_eq!(pool.stats().sequences, 0);
    let s = pool.stats();
    assert_eq!((s.handovers, s.forks, s.hits), (1, 2, 3));
}

/// The device tier counts its sequences' arenas (what the budget bounds) and the MLX
/// buffers behind them (at least as many bytes; what MLX's active memory sees), and both
/// go back to zero as sequences leave.
#[test]
fn resident_buffers_are_at_least_the_arenas_and_leave_with_them() {
    let ns = NamespaceId([9; 32]);
    let mut pool = ResidentPool::new(1 << 30);
    for t in 0..3u32 {
        park(&mut pool, ns, &[40 + t; 8]);
        let s = pool.stats();
        assert_eq!(s.sequences, t as usize + 1);
        assert!(s.resident_bytes > 0);
        assert!(
            s.resident_buffer_bytes >= s.resident_bytes,
            "{} buffer bytes behind {} arena bytes",
            s.resident_buffer_bytes,
            s.resident_bytes
        );
    }
    // Each parked cache's buffers as the cache itself counts them.
    let mut cache = PagedKvCache::new(1, config()).unwrap();
    append(&mut cache, &[50; 8], 0);
    assert!(cache.buffer_bytes() >= cache.device_bytes());
    // A reservation of the whole budget evicts them all.
    assert!(pool.reserve(1 << 30));
    let s = pool.stats();
    assert_eq!(
        (s.sequences, s.resident_bytes, s.resident_buffer_bytes),
        (0, 0, 0)
    );
}

/// A resident sequence of `tokens` (one layer, evaluated) parked in `pool`.
fn park(pool: &mut ResidentPool, ns: NamespaceId, tokens: &[u32]) -> usize {
    let mut cache = PagedKvCache::new(1, config()).unwrap();
    append(&mut cache, tokens, 0);
    pool.park(Chain::new(ns, BS), tokens.to_vec(), cache)
}

#[test]
fn a_pinned_sequence_survives_eviction_until_its_pin_expires() {
    let ns = NamespaceId([6; 32]);
    let pins = Arc::new(store::Pins::new());
    // Measure one sequence's device bytes, then allow two.
    let mut probe = ResidentPool::new(1 << 30);
    park(&mut probe, ns, &[1; 8]);
    let one = probe.stats().resident_bytes;
    let mut pool = ResidentPool::new(2 * one);
    pool.set_pins(pins.clone());

    let pinned: Vec<u32> = (100..108).collect();
    let keys = Chain::of(ns, BS, &pinned).keys().to_vec();
    pins.pin(
        ns,
        &keys[..1],
        std::time::Duration::from_millis(1500),
        false,
    );
    park(&mut pool, ns, &pinned);
    // Newer traffic, least recently used last: only the unpinned sequences go.
    for i in 0..4u32 {
        park(&mut pool, ns, &[200 + i; 8]);
    }
    let chain = Chain::of(ns, BS, &pinned);
    assert_eq!(
        pool.peek(&chain, &pinned, 8),
        8,
        "the pinned sequence was evicted"
    );
    assert_eq!(pool.pinned_bytes(), one);
    assert!(pool.stats().resident_bytes <= 2 * one);

    // A live reservation outranks the pin.
    assert!(pool.reserve(2 * one));
    assert_eq!(pool.stats().sequences, 0);
    pool.release(2 * one);

    // Expired, the pin protects nothing.
    park(&mut pool, ns, &pinned);
    std::thread::sleep(std::time::Duration::from_millis(1600));
    for i in 0..2u32 {
        park(&mut pool, ns, &[300 + i; 8]);
    }
    assert_eq!(pool.peek(&chain, &pinned, 8), 0, "an expired pin protected");
    assert_eq!(pool.pinned_bytes(), 0);
}

/// Float keys and values of every element `x`, to read a cache's attention against.
fn attend_reference(cache: &PagedKvCache, q: &Array) -> Vec<f32> {
    let (k, v) = cache.fetch(0).unwrap().unwrap();
    let o =
        mlx::fast::mlx_scaled_dot_product_attention(q, &k, &v, 0.5, AttentionMask::Causal).unwrap();
    o.to_vec::<f32>().unwrap()
}

#[test]
fn two_live_requests_share_the_physical_blocks_of_a_resident_prefix() {
    let ns = NamespaceId([5; 32]);
    let block_bytes = (2 * H * BS * D * 4) as u64;
    let mut pool = ResidentPool::new(1000 * block_bytes);
    pool.set_share_min_tokens(1);
    let base: Vec<u32> = (0..20).map(|i| i % 3).collect();
    let mut parked = PagedKvCache::new(1, config()).unwrap();
    append(&mut parked, &base, 0);
    let mut chain = Chain::of(ns, BS, &[]);
    let published = parked.publish(&mut chain, &base).unwrap();
    parked.pool(0).unwrap().arrays()[0].eval().unwrap();
    let arena = parked.pool(0).unwrap().arrays()[0].data_addr().unwrap();
    pool.park(chain, base.clone(), parked);
    let entry_bytes = pool.stats().resident_bytes;
    // Two prompts branch from the resident sequence after 10 tokens (inside block 2).
    let prompts: Vec<Vec<u32>> = [7, 8]
        .iter()
        .map(|&t| base[..10].iter().copied().chain([t, t, 1, t, 0]).collect())
        .collect();
    let mut caches = Vec::new();
    for p in &prompts {
        let limit = p.len() - 1;
        let hit = pool
            .take(&Chain::of(ns, BS, &p[..limit]), p, limit)
            .unwrap()
            .unwrap();
        assert_eq!((hit.tokens, hit.shared, hit.handed_over), (10, true, false));
        caches.push(hit.cache);
    }
    let entry = caches[0].shared_prefix().unwrap().0;
    assert_eq!(caches[1].shared_prefix(), Some((entry, 10)));
    assert_eq!(pool.sharers(entry), Some(2));
    assert_eq!(pool.stats().shares, 2);
    // Each request computes its own tokens and attends over the prefix and them.
    for (c, p) in caches.iter_mut().zip(&prompts) {
        let (k, v) = kv(&p[10..], 10);
        let q = k.mul_scalar(0.01).unwrap();
        let got = c
            .update_and_attend(0, &q, &k, &v, 0.5, AttentionMask::Causal)
            .unwrap();
        let want = attend_reference(c, &q);
        for (g, w) in got.to_vec::<f32>().unwrap().iter().zip(&want) {
            assert!((g - w).abs() <= 1e-4 * w.abs().max(1.0), "{g} vs {w}");
        }
        assert_holds(c, p);
    }
    // Both still read the resident arena itself: the same device buffer, never copied.
    for c in &caches {
        let view = &c.prefix_parts(0).unwrap()[0];
        view.eval().unwrap();
        assert_eq!(
            view.data_addr().unwrap(),
            arena,
            "the prefix is the entry's buffer"
        );
        // Own bytes only: the prefix is counted once, resident.
        assert!(c.device_bytes() < entry_bytes);
    }
    assert_eq!(pool.stats().resident_bytes, entry_bytes);
    assert_eq!(pool.entry_bytes(entry), Some(entry_bytes));
    // Shared: neither evicted by a reservation that needs its room nor handed over.
    assert!(!pool.reserve(1000 * block_bytes));
    assert_eq!(pool.stats().sequences, 1);
    pool.release(1000 * block_bytes);
    let mut whole = base.clone();
    whole.push(9);
    let hit = pool
        .take(&Chain::of(ns, BS, &base), &whole, base.len())
        .unwrap()
        .unwrap();
    assert_eq!((hit.tokens, hit.handed_over, hit.shared), (20, false, true));
    assert_holds(&hit.cache, &base);
    drop(hit);
    // A sharer's full blocks, the one straddling the prefix's end included, publish as the
    // blocks of its tokens: a fresh cache restored from them holds exactly those tokens.
    let mut c = caches.pop().unwrap();
    let p = prompts[1].clone();
    let mut chain = Chain::of(ns, BS, &[]);
    let blocks = c.publish(&mut chain, &p).unwrap();
    assert_eq!(
        blocks.len(),
        3 - 2,
        "blocks 0 and 1 were published by the entry"
    );
    let mut all: Vec<Block> = published[..2].to_vec();
    all.extend(blocks);
    let restored = PagedKvCache::restore(1, config(), &all).unwrap();
    assert_eq!(restored.blocks, 3, "{:?}", restored.stopped);
    assert_holds(&restored.cache, &p[..12]);
    // Trimming into the prefix cuts the view; appending after it continues exactly.
    c.trim(8).unwrap();
    assert_eq!(c.shared_prefix(), Some((entry, 7)));
    append(&mut c, &[2, 2, 2], 7);
    let mut want = base[..7].to_vec();
    want.extend([2, 2, 2]);
    assert_holds(&c, &want);
    // A parked sharer keeps its source referenced (and resident) while it is resident.
    let mut chain = Chain::of(ns, BS, &[]);
    c.publish(&mut chain, &want).unwrap();
    pool.park(chain, want.clone(), c);
    assert_eq!(pool.sharers(entry), Some(2));
    drop(caches);
    assert_eq!(pool.sharers(entry), Some(1));
    // Evicting everything: the parked sharer goes, then its source; counts are back at 0.
    assert!(pool.reserve(1000 * block_bytes));
    assert_eq!(pool.stats().sequences, 0);
    pool.release(1000 * block_bytes);
}

/// A pool that keeps what eviction takes hands back exactly the sequences it evicted,
/// least recently used first, each with its tokens, its chain and a cache still holding its
/// KV; nothing is kept unless asked, and sequences that only leave (handed over,
/// superseded) are not evictions.
#[test]
fn a_pool_that_keeps_evictions_hands_them_back_whole() {
    let ns = NamespaceId([7; 32]);
    let mut probe = ResidentPool::new(1 << 30);
    park(&mut probe, ns, &[1; 8]);
    let one = probe.stats().resident_bytes;

    let mut small = ResidentPool::new(2 * one);
    for t in 10..13 {
        park(&mut small, ns, &[t; 8]);
    }
    assert_eq!(small.stats().evictions, 1);
    assert!(small.take_evicted().is_empty(), "kept without being asked");

    let mut pool = ResidentPool::new(8 * one);
    pool.set_keep_evicted(true);
    park(&mut pool, ns, &[10; 8]);
    park(&mut pool, ns, &[11; 8]);
    // Superseded (extended by a new sequence), then handed over: no eviction.
    let mut longer = vec![11u32; 8];
    longer.extend([13; 4]);
    park(&mut pool, ns, &longer);
    let chain = Chain::of(ns, BS, &longer);
    let hit = pool.take(&chain, &longer, 12).unwrap().unwrap();
    assert!(hit.handed_over);
    assert_eq!(pool.stats().evictions, 0);
    assert!(pool.take_evicted().is_empty());

    // A live reservation of 7 sequences' bytes evicts the two least recently used of the
    // three resident: [10; 8], then [20; 8].
    park(&mut pool, ns, &[20; 8]);
    park(&mut pool, ns, &[21; 8]);
    assert!(pool.reserve(7 * one));
    let evicted = pool.take_evicted();
    let held: Vec<Vec<u32>> = evicted.iter().map(|e| e.tokens.clone()).collect();
    assert_eq!(held, vec![vec![10u32; 8], vec![20u32; 8]]);
    for e in &evicted {
        assert_holds(&e.cache, &e.tokens);
        assert_eq!(e.chain.keys(), Chain::of(ns, BS, &e.tokens).keys());
    }
    assert!(pool.take_evicted().is_empty(), "taken once");
    assert_eq!(pool.stats().sequences, 1);
}

/// With the engine's configuration set, a fork gets pools with room for the prompt it is
/// made for: a short prompt branching from a long resident sequence holds neither the
/// source's capacity nor a pool too small for its own prefill, and the long one's fork
/// needs no growth to take its whole prompt.
#[test]
fn a_fork_has_room_for_its_own_prompt() {
    let ns = NamespaceId([6; 32]);
    let mut pool = ResidentPool::new(1 << 24);
    pool.set_fork_config(config());
    let long: Vec<u32> = (0..200).collect();
    let mut cache = PagedKvCache::new(1, config().with_room_for(long.len())).unwrap();
    append(&mut cache, &long, 0);
    let source_capacity = cache.pool(0).unwrap().capacity();
    pool.park(Chain::new(ns, BS), long.clone(), cache);
    for extra in [10usize, 150] {
        let mut prompt = long[..8].to_vec();
        prompt.extend((0..extra as u32).map(|t| 1000 + t));
        let chain = Chain::of(ns, BS, &prompt);
        let hit = pool
            .take(&chain, &prompt, prompt.len() - 1)
            .unwrap()
            .unwrap();
        assert_eq!((hit.tokens, hit.handed_over), (8, false));
        let mut fork = hit.cache;
        let capacity = fork.pool(0).unwrap().capacity();
        assert_eq!(
            capacity,
            config().with_room_for(prompt.len()).initial_blocks
        );
        assert!(capacity < source_capacity);
        append(&mut fork, &prompt[8..], 8);
        assert_eq!(
            fork.pool(0).unwrap().capacity(),
            capacity,
            "grown in the prefill"
        );
        assert_holds(&fork, &prompt);
    }
}
