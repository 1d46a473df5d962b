//! Eviction policies through the tiers: each policy's order on SSD (which admits every
//! block), a block the RAM tier does not admit reaching the SSD tier,
//! and, for every policy, random operations that never exceed a budget, evict a pinned
//! block or lose a block the SSD tier acknowledged.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use proptest::prelude::*;
use store::{
    Block, EvictionPolicy, ReadOutcome, SsdOptions, SsdTier, Store, StoreConfig, Tier, UsedAt,
    WriteOutcome,
};

use crate::common;

/// Four one-block chains (A B C D) of a 256-byte layout.
fn roots() -> (store::NamespaceDescription, Vec<Block>) {
    let d = common::desc("eviction", 4);
    let blocks = (1..=4)
        .map(|s| common::chain(&d, 1, s).0.remove(0))
        .collect();
    (d, blocks)
}

/// An SSD tier with room for two of `d`'s block files, evicting by `policy`.
fn ssd(dir: &std::path::Path, d: &store::NamespaceDescription, policy: EvictionPolicy) -> SsdTier {
    let file = common::per_block(d);
    let mut t = SsdTier::open(
        dir,
        SsdOptions {
            read_only: false,
            budget: 2 * file + file / 2,
        },
    )
    .unwrap();
    t.set_eviction(policy);
    t
}

/// The SSD tier's blocks, least recent first.
fn recency(t: &SsdTier) -> Vec<store::BlockKey> {
    t.entries().iter().map(|e| e.key).collect()
}

fn on_disk(t: &SsdTier, blocks: &[Block]) -> Vec<bool> {
    blocks
        .iter()
        .map(|b| t.contains(b.meta.namespace, b.meta.key))
        .collect()
}

/// A written and read back (2 uses), B written, then C and D. lru and freq-admit (whose
/// gate is the RAM tier's; the SSD keeps recency order): C evicts A, D evicts B. lfu: C
/// evicts B (1 use against A's 2), D evicts C. Every block is written (the SSD tier admits
/// everything).
#[test]
fn each_policy_on_the_ssd_tier() {
    let (d, blocks) = roots();
    let run = |policy| {
        let dir = tempfile::tempdir().unwrap();
        let t = ssd(dir.path(), &d, policy);
        let a = &blocks[0];
        t.put(a).unwrap();
        assert!(matches!(
            t.get(a.meta.namespace, a.meta.key),
            ReadOutcome::Hit(_)
        ));
        let outs: Vec<WriteOutcome> = blocks[1..].iter().map(|b| t.put(b).unwrap()).collect();
        let written = outs
            .iter()
            .map(|o| matches!(o, WriteOutcome::Written { .. }))
            .collect::<Vec<_>>();
        assert!(t.used_bytes() <= t.budget());
        assert_eq!(t.used_bytes(), common::physical(dir.path()));
        (written, on_disk(&t, &blocks), t.stats())
    };
    for policy in [EvictionPolicy::Lru, EvictionPolicy::FreqAdmit] {
        let (written, disk, st) = run(policy);
        assert_eq!(written, vec![true; 3], "{policy}");
        assert_eq!(disk, vec![false, false, true, true], "{policy}");
        assert_eq!(st.ssd_evictions, 2, "{policy}");
    }
    let (written, disk, st) = run(EvictionPolicy::Lfu);
    assert_eq!(written, vec![true; 3]);
    assert_eq!(disk, vec![true, false, false, true]);
    assert_eq!(st.ssd_evictions, 2);
}

/// Counts live in memory: after a restart every block counts 0 and the frequency
/// policies evict in recency order, which the journal kept. A (read back twice before
/// the restart) is the least recent block after it, so lfu evicts it first.
#[test]
fn ssd_counts_start_again_after_a_restart() {
    let (d, blocks) = roots();
    let dir = tempfile::tempdir().unwrap();
    {
        let t = ssd(dir.path(), &d, EvictionPolicy::Lfu);
        t.put(&blocks[0]).unwrap();
        for _ in 0..2 {
            t.get(blocks[0].meta.namespace, blocks[0].meta.key);
        }
        t.put(&blocks[1]).unwrap();
        t.sync().unwrap();
    }
    let t = ssd(dir.path(), &d, EvictionPolicy::Lfu);
    t.put(&blocks[2]).unwrap();
    assert_eq!(on_disk(&t, &blocks[..3]), vec![false, true, true]);
}

/// Freq-admit in the RAM tier refuses a new block (room for 2: A used twice, B once; C
/// would evict B, used 1 use ago); the store spills it to the SSD tier like an evicted
/// block, and a later load finds it there.
#[test]
fn a_block_the_ram_tier_refuses_reaches_the_ssd_tier() {
    let (d, blocks) = roots();
    let dir = tempfile::tempdir().unwrap();
    let s: Store = Store::open(
        StoreConfig::default()
            .root(dir.path())
            .ram_budget(2 * 256)
            .eviction(EvictionPolicy::FreqAdmit),
    )
    .unwrap();
    let ns = s.register_namespace(&d).unwrap();
    let a = &blocks[0];
    s.insert(Arc::new(a.clone())).unwrap();
    let got = s.load_prefix(ns, &[a.meta.key], std::slice::from_ref(&a.meta.tokens));
    assert_eq!(got.blocks.len(), 1);
    s.insert(Arc::new(blocks[1].clone())).unwrap();
    let c = &blocks[2];
    s.insert(Arc::new(c.clone())).unwrap();
    let st = s.stats();
    assert_eq!((st.ram_not_admitted, st.ram_blocks), (1, 2), "{st:?}");
    s.flush().unwrap();
    assert_eq!(s.lookup(ns, &[c.meta.key]).tiers, vec![Tier::Ssd]);
    let got = s.load_prefix(ns, &[c.meta.key], std::slice::from_ref(&c.meta.tokens));
    assert_eq!(got.blocks.len(), 1);
    assert_eq!(&*got.blocks[0].0, c);
    assert_eq!(got.blocks[0].1, Tier::Ssd);
}

/// `put_at` ranks a block by its stamp, not as the newest: in a full tier (room for 2) a
/// block older than every stored one is not written (it would be the first to go), one
/// older than B but newer than A takes A's place and stays less recent than B, across a
/// restart (the journal's records are replayed last-record-wins, not by stamp). Under lfu
/// every block is admitted.
#[test]
fn put_at_ranks_a_block_by_its_stamp() {
    let (d, blocks) = roots();
    let [a, b, c, _] = &blocks[..] else {
        unreachable!()
    };
    let dir = tempfile::tempdir().unwrap();
    {
        let t = ssd(dir.path(), &d, EvictionPolicy::FreqAdmit);
        let older = t.clock().tick();
        t.put(a).unwrap();
        let between = t.clock().tick();
        t.put(b).unwrap();
        assert_eq!(
            t.put_at(c, UsedAt::now(older)).unwrap(),
            WriteOutcome::NotAdmitted
        );
        assert_eq!(on_disk(&t, &blocks), vec![true, true, false, false]);
        assert_eq!(t.stats().ssd_evictions, 1);
        assert!(matches!(
            t.put_at(c, UsedAt::now(between)).unwrap(),
            WriteOutcome::Written { .. }
        ));
        assert_eq!(recency(&t), vec![c.meta.key, b.meta.key]);
        // A stored block is only made more recent, never less.
        assert_eq!(
            t.put_at(b, UsedAt::now(1)).unwrap(),
            WriteOutcome::AlreadyPresent
        );
        assert_eq!(recency(&t), vec![c.meta.key, b.meta.key]);
        t.sync().unwrap();
    }
    let t = ssd(dir.path(), &d, EvictionPolicy::FreqAdmit);
    assert_eq!(recency(&t), vec![c.meta.key, b.meta.key], "after reopen");
    // Under lfu the SSD admits every block, whatever its stamp.
    let dir = tempfile::tempdir().unwrap();
    let t = ssd(dir.path(), &d, EvictionPolicy::Lfu);
    t.put(a).unwrap();
    t.put(b).unwrap();
    assert!(matches!(
        t.put_at(c, UsedAt::now(0)).unwrap(),
        WriteOutcome::Written { .. }
    ));
    assert_eq!(t.len(), 2);
}

/// The journal's last record of a block is its recency, even when an earlier record (of a
/// copy since removed) had a larger stamp: A touched at 6, removed, written again at 3,
/// is older than X (5) after a restart (by the largest stamp it would be newer).
#[test]
fn journal_replay_takes_each_blocks_last_record() {
    let (d, blocks) = roots();
    let (a, x) = (&blocks[0], &blocks[1]);
    let dir = tempfile::tempdir().unwrap();
    {
        let t = ssd(dir.path(), &d, EvictionPolicy::Lru);
        t.put(a).unwrap(); // 1
        for _ in 0..3 {
            t.clock().tick(); // 2..4
        }
        t.put(x).unwrap(); // 5
        t.touch(a.meta.namespace, a.meta.key); // 6
        assert!(t.remove(a.meta.namespace, a.meta.key).unwrap());
        t.put_at(a, UsedAt::now(3)).unwrap();
        t.sync().unwrap();
    }
    let t = ssd(dir.path(), &d, EvictionPolicy::Lru);
    assert_eq!(recency(&t), vec![a.meta.key, x.meta.key]);
}

/// Issue 18's eviction defect. Under freq-admit: a full SSD (S1 then S2), RAM (room for
/// 2) holding A then B, and X, which RAM's gate refuses, spilled at once (evicting S1).
/// The write-back flush then writes A and B with their RAM recency, older than X's: they
/// take S2's place, then B takes A's (the oldest), and X survives. Written as the newest
/// blocks (before the use clock), A evicted S2 and B evicted X. The order survives a
/// restart: B is still the next to go.
#[test]
fn a_flush_keeps_a_refused_block_newer_than_older_ram_blocks() {
    let d = common::desc("eviction", 4);
    let [s1, s2, a, b, x]: [Block; 5] = (1..=5)
        .map(|s| common::chain(&d, 1, s).0.remove(0))
        .collect::<Vec<_>>()
        .try_into()
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let file = common::per_block(&d);
    {
        let t = ssd(dir.path(), &d, EvictionPolicy::FreqAdmit);
        t.put(&s1).unwrap();
        t.put(&s2).unwrap();
        t.sync().unwrap();
    }
    let cfg = StoreConfig::default()
        .root(dir.path())
        .ram_budget(2 * 256)
        .ssd_budget(2 * file + file / 2)
        .eviction(EvictionPolicy::FreqAdmit);
    let s: Store = Store::open(cfg.clone()).unwrap();
    let ns = s.register_namespace(&d).unwrap();
    for blk in [&a, &b, &x] {
        s.insert(Arc::new(blk.clone())).unwrap();
    }
    let st = s.stats();
    assert_eq!((st.ram_not_admitted, st.ram_blocks), (1, 2), "{st:?}");
    s.flush().unwrap();
    let present = |s: &Store| -> Vec<bool> {
        [&s1, &s2, &a, &b, &x]
            .iter()
            .map(|blk| s.lookup(ns, &[blk.meta.key]).blocks() == 1)
            .collect()
    };
    assert_eq!(
        recency(s.ssd().unwrap()),
        vec![b.meta.key, x.meta.key],
        "SSD, least recent first"
    );
    assert_eq!(present(&s), vec![false, false, true, true, true]);
    drop(s);

    // After a restart X is still more recent than B: a new block evicts B.
    let s: Store = Store::open(cfg).unwrap();
    assert_eq!(
        recency(s.ssd().unwrap()),
        vec![b.meta.key, x.meta.key],
        "SSD after reopen, least recent first"
    );
    let y = common::chain(&d, 1, 6).0.remove(0);
    s.ssd().unwrap().put(&y).unwrap();
    assert_eq!(present(&s), vec![false, false, false, false, true]);
    assert_eq!(s.lookup(ns, &[y.meta.key]).blocks(), 1);
}

#[derive(Debug, Clone)]
enum Op {
    Insert(usize),
    Load(usize),
    Flush,
    Reopen,
}

fn ops() -> impl Strategy<Value = Vec<Op>> {
    prop::collection::vec(
        prop_oneof![
            5 => (0usize..24).prop_map(Op::Insert),
            4 => (0usize..24).prop_map(Op::Load),
            2 => Just(Op::Flush),
            1 => Just(Op::Reopen),
        ],
        1..60,
    )
}

fn policy() -> impl Strategy<Value = EvictionPolicy> {
    prop_oneof![
        Just(EvictionPolicy::Lru),
        Just(EvictionPolicy::Lfu),
        Just(EvictionPolicy::FreqAdmit),
    ]
}

/// Blocks of three sizes, the first two of each size pinned.
fn universe() -> (Vec<store::NamespaceDescription>, Vec<Block>) {
    let ds = vec![
        common::desc("e1", 64),
        common::desc("e2", 128),
        common::desc("e3", 192),
    ];
    let blocks = (0..24)
        .map(|i| {
            let d = &ds[i % 3];
            common::block(d, d.id().0, 0, common::tokens(i as u64, 0, 4), i as u64)
        })
        .collect();
    (ds, blocks)
}

const PINNED: [usize; 2] = [0, 1];
const RAM: u64 = 40_000;
const SSD: u64 = 64 * 1024;

proptest! {
    #![proptest_config(ProptestConfig { cases: 32, .. ProptestConfig::default() })]

    /// Every policy, random inserts, loads, flushes and restarts over a RAM tier and an SSD
    /// tier that hold a few blocks each: the RAM bytes and the SSD's physical bytes stay
    /// within their budgets after every operation; a pinned block, once inserted, is found
    /// after every operation; a block on SSD at one quiet point (after a flush) and gone
    /// at the next was evicted by the SSD budget (counted), never lost, and a restart
    /// keeps every block the SSD held.
    #[test]
    fn no_policy_exceeds_a_budget_evicts_a_pin_or_loses_an_acknowledged_block(
        ops in ops(),
        policy in policy(),
    ) {
        let dir = tempfile::tempdir().unwrap();
        let (ds, blocks) = universe();
        let cfg = StoreConfig::default()
            .root(dir.path())
            .ram_budget(RAM)
            .ssd_budget(SSD)
            .eviction(policy);
        let open = || {
            let s: Store = Store::open(cfg.clone()).unwrap();
            for d in &ds {
                s.register_namespace(d).unwrap();
            }
            for &i in &PINNED {
                let m = &blocks[i].meta;
                s.pin(m.namespace, &[m.key], Duration::from_secs(3600), true);
            }
            s
        };
        let on_ssd = |s: &Store| -> HashSet<usize> {
            let ssd = s.ssd().unwrap();
            (0..blocks.len())
                .filter(|&i| ssd.contains(blocks[i].meta.namespace, blocks[i].meta.key))
                .collect()
        };
        let mut s = open();
        let mut inserted = HashSet::new();
        let mut quiet = (HashSet::new(), 0u64);
        for op in ops {
            match op {
                Op::Insert(i) => {
                    s.insert(Arc::new(blocks[i].clone())).unwrap();
                    inserted.insert(i);
                }
                Op::Load(i) => {
                    let b = &blocks[i];
                    let got = s.load_prefix(b.meta.namespace, &[b.meta.key], std::slice::from_ref(&b.meta.tokens));
                    if let Some((p, _)) = got.blocks.first() {
                        prop_assert!(inserted.contains(&i));
                        prop_assert_eq!(&**p, b);
                    }
                }
                Op::Flush => {
                    s.flush().unwrap();
                    let now = on_ssd(&s);
                    let evictions = s.stats().ssd_evictions;
                    let vanished = quiet.0.difference(&now).count() as u64;
                    prop_assert!(
                        vanished <= evictions - quiet.1,
                        "{} blocks left the SSD, {} evicted", vanished, evictions - quiet.1
                    );
                    quiet = (now, evictions);
                }
                Op::Reopen => {
                    s.flush().unwrap();
                    let before = on_ssd(&s);
                    drop(s);
                    s = open();
                    prop_assert_eq!(&on_ssd(&s), &before, "a restart lost blocks");
                    quiet = (before, 0);
                }
            }
            let st = s.stats();
            prop_assert!(st.ram_bytes <= RAM, "{:?}", st);
            prop_assert!(common::physical(dir.path()) <= SSD);
            for &i in PINNED.iter().filter(|i| inserted.contains(i)) {
                let m = &blocks[i].meta;
                prop_assert_eq!(s.lookup(m.namespace, &[m.key]).blocks(), 1, "pinned block {} gone", i);
            }
        }
    }
}
