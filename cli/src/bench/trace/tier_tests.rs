//! The store's RAM tier, replaying a trace, gets exactly the hits `sim::simulate` predicts
//! for the same policy and capacity.
//!
//! The setting where the tier's granularity is the simulator's: one namespace, one token
//! per block (a trace block's id is its token, so kvstore's chained keys name the same
//! blocks as the simulator's chain ids), whole blocks only (every prompt ends at a block
//! boundary), every block the same size (a byte budget of `C` blocks holds `C` blocks),
//! no SSD tier. Each request is driven as the engine drives the store: load the longest
//! cached prefix (`load_prefix`: a use of each block it returns, then the chain's recency
//! refreshed root last), then insert the rest of the prompt's blocks root first (a use
//! each). The tier's `lru` is the simulator's `lru-leaf` (a chain's root is its most
//! recent block); `lfu` and `freq-admit` run the same [`store::eviction::PolicyState`].
//!
//! Where they must differ: the tier never evicts a block whose child is resident (evicting
//! it would cut the child off), the simulator may. That shows when one request holds more
//! blocks than the cache: the tier keeps the prompt's first blocks, the simulator keeps
//! the first ones but one and the last. [`a_request_longer_than_the_cache`] pins it down.

use std::sync::Arc;

use store::{
    chain_keys, Block, BlockMeta, Dtype, EvictionPolicy, NamespaceDescription, Plane, PlaneSpec,
    Store, StoreConfig,
};

use super::parse::TraceRequest;
use super::scale::TokenScale;
use super::sim::{self, Policy, SimTrace};

/// Bytes of every block's one plane.
const BLOCK_BYTES: u64 = 64;

/// The simulator's policy the tier's `policy` is.
fn simulated(policy: EvictionPolicy) -> Policy {
    match policy {
        EvictionPolicy::Lru => Policy::LruLeaf,
        EvictionPolicy::Lfu => Policy::Lfu,
        EvictionPolicy::FreqAdmit => Policy::FreqAdmit,
    }
}

/// Requests of whole 1-token blocks (`--token-scale 1/512`): ids as given.
pub(super) fn requests(trace: &[Vec<u64>]) -> Vec<TraceRequest> {
    trace
        .iter()
        .map(|ids| TraceRequest {
            timestamp: 0,
            input_length: ids.len() * 512,
            output_length: 1,
            hash_ids: ids.clone(),
        })
        .collect()
}

fn simulate(trace: &[Vec<u64>], policy: Policy, capacity: usize) -> Vec<usize> {
    let scale = TokenScale::new(1.0 / 512.0).unwrap();
    let t = SimTrace::new(&requests(trace), &scale);
    assert_eq!(t.block, 1);
    sim::simulate(&t, policy, capacity)
}

/// Replays `trace` through a RAM-only store holding `capacity` blocks; the hit of each
/// request in blocks (= tokens).
fn replay(trace: &[Vec<u64>], policy: EvictionPolicy, capacity: usize) -> Vec<usize> {
    let store: Store = Store::open(
        StoreConfig::default()
            .ram_budget(capacity as u64 * BLOCK_BYTES)
            .eviction(policy),
    )
    .unwrap();
    let mut desc = NamespaceDescription::new("tier-vs-simulator", Dtype::U8, 1);
    desc.planes = vec![PlaneSpec::new("k", Dtype::U8, vec![BLOCK_BYTES])];
    let ns = store.register_namespace(&desc).unwrap();
    let mut hits = Vec::with_capacity(trace.len());
    for ids in trace {
        let tokens: Vec<Vec<u32>> = ids.iter().map(|&i| vec![i as u32]).collect();
        let flat: Vec<u32> = tokens.iter().flatten().copied().collect();
        let keys = chain_keys(ns, &flat, 1);
        let hit = store.load_prefix(ns, &keys, &tokens).blocks.len();
        for i in hit..ids.len() {
            let parent = if i == 0 { ns.0 } else { keys[i - 1].0 };
            let meta = BlockMeta::new(ns, parent, i as u32, tokens[i].clone());
            let plane = Plane::new("k", Dtype::U8, vec![BLOCK_BYTES], vec![7; 64]);
            store
                .insert(Arc::new(Block {
                    meta,
                    planes: vec![plane],
                }))
                .unwrap();
        }
        let st = store.stats();
        assert!(st.ram_bytes <= capacity as u64 * BLOCK_BYTES, "{st:?}");
        hits.push(hit);
    }
    hits
}

/// A conversation-shaped trace: a shared first block (the system prompt), conversations
/// that come back with their history and one new block a turn (a few popular ones much
/// more often), and one-off prompts that share nothing past the first block. Deterministic
/// (xorshift), no prompt longer than `max_len` blocks.
pub(super) fn conversations(requests: usize, max_len: usize, seed: u64) -> Vec<Vec<u64>> {
    let mut x = seed | 1;
    let mut next = move |n: u64| {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x % n
    };
    let mut turns = [0u64; 24];
    let mut fresh = 1_000_000u64;
    (0..requests)
        .map(|_| {
            let roll = next(10);
            if roll == 0 {
                fresh += 1;
                return vec![0, fresh, fresh + 500_000];
            }
            // Conversations 0..4 half the time, the other 20 evenly otherwise.
            let c = if roll < 5 { next(4) } else { 4 + next(20) } as usize;
            turns[c] = (turns[c] + 1) % (max_len as u64 - 1);
            let mut ids = vec![0];
            ids.extend((0..=turns[c]).map(|t| 1 + c as u64 * 1000 + t));
            ids
        })
        .collect()
}

/// Blocks of 1 token, requests [A B], [A C], [X], [A B], [A C], [X] (A=1, B=2, C=3, X=9),
/// room for 3 blocks: tier and simulator agree under every policy, and by hand:
#[test]
fn a_hand_made_trace_gives_the_simulators_hits() {
    let trace: Vec<Vec<u64>> = vec![
        vec![1, 2],
        vec![1, 3],
        vec![9],
        vec![1, 2],
        vec![1, 3],
        vec![9],
    ];
    for p in EvictionPolicy::ALL {
        let want = simulate(&trace, simulated(p), 3);
        assert_eq!(replay(&trace, p, 3), want, "{p}");
    }
    // By hand. lru: r2's X evicts B (leaf, least recent: A was refreshed by r1 after B);
    // r3 hits A, B evicts C; r4 hits A, C evicts X; r5 misses X.
    assert_eq!(
        replay(&trace, EvictionPolicy::Lru, 3),
        vec![0, 1, 0, 1, 1, 0]
    );
    // freq-admit: A counts 2 after r1, B and C 1. r2's X (count 1) would evict B (count
    // 1, the least recent leaf), used 2 uses ago, not more than the 3 the cache holds:
    // refused. r3 hits A B, r4 A C; r5's X (count 2) would evict B (count 2, used 3 uses
    // ago: not stale) and is refused again.
    assert_eq!(
        replay(&trace, EvictionPolicy::FreqAdmit, 3),
        vec![0, 1, 0, 2, 2, 0]
    );
}

/// The strong check: a few thousand block uses through the real tier, at capacities from
/// a tenth to a half of the distinct blocks, give the simulator's hits request by request
/// under every policy; freq-admit halves its counts many times on the way (every 8 ×
/// capacity uses).
#[test]
fn a_conversation_trace_gives_the_simulators_hits_at_every_capacity() {
    let trace = conversations(1500, 10, 0x5eed);
    let uses: usize = trace.iter().map(Vec::len).sum();
    assert!(uses > 6000, "{uses}");
    let ideal: usize = simulate(&trace, Policy::Lru, usize::MAX).iter().sum();
    for capacity in [12, 24, 48, 96] {
        for p in EvictionPolicy::ALL {
            let want = simulate(&trace, simulated(p), capacity);
            let got = replay(&trace, p, capacity);
            let first_difference = got.iter().zip(&want).position(|(a, b)| a != b);
            assert_eq!(first_difference, None, "{p} at {capacity} blocks");
            let hits: usize = got.iter().sum();
            assert!(
                hits > 0 && hits < ideal,
                "{p} at {capacity}: {hits} of {ideal}"
            );
        }
    }
}

/// The difference: with room for 3 blocks, a 5-block prompt sent twice. The tier refuses
/// to cut a chain (block 3's child arrives while it is the least recent leaf): it keeps
/// blocks 1 2 3 and the second request hits 3. The simulator under lru-leaf keeps 1 2 and
/// the last block (5), which no prefix reaches: 2.
#[test]
fn a_request_longer_than_the_cache() {
    let trace: Vec<Vec<u64>> = vec![vec![1, 2, 3, 4, 5], vec![1, 2, 3, 4, 5]];
    assert_eq!(replay(&trace, EvictionPolicy::Lru, 3), vec![0, 3]);
    assert_eq!(simulate(&trace, Policy::LruLeaf, 3), vec![0, 2]);
}
