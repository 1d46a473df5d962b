//! The facade: lookup, load with validation, promotion, write-behind, flush, queue-full.

use std::sync::Arc;
use std::time::{Duration, Instant};

use store::{Block, BlockProblem, InsertError, StopReason, Store, StoreConfig, Tier, WritePolicy};

use crate::common;

fn keys(blocks: &[Block]) -> Vec<store::BlockKey> {
    blocks.iter().map(|b| b.meta.key).collect()
}

#[test]
fn ram_evictions_spill_to_ssd_and_hits_promote_back() {
    let dir = tempfile::tempdir().unwrap();
    let d = common::desc("spill", 4); // 2 planes x 4x8 f32 = 256 bytes per block
    let s: Store = Store::open(
        StoreConfig::default()
            .root(dir.path())
            .ram_budget(3 * 256)
            .ssd_budget(1 << 24),
    )
    .unwrap();
    let ns = s.register_namespace(&d).unwrap();
    let (blocks, toks) = common::chain(&d, 6, 7);
    for b in &blocks {
        s.insert(Arc::new(b.clone())).unwrap();
    }
    s.flush().unwrap();
    let st = s.stats();
    assert_eq!(st.ram_blocks, 3);
    assert!(st.ram_bytes <= 3 * 256);
    assert_eq!(st.ram_evictions, 3);
    assert_eq!(st.spills, 3);
    assert_eq!(st.ssd_blocks, 6, "flush writes RAM-resident blocks too");

    // The RAM tier evicted the chain's leaves and kept its prefix.
    let hit = s.lookup(ns, &keys(&blocks));
    assert_eq!((hit.ram_blocks, hit.ssd_blocks), (3, 3));
    assert_eq!(&hit.tiers[..3], &[Tier::Ram; 3]);
    assert_eq!(&hit.tiers[3..], &[Tier::Ssd; 3]);

    let loaded = s.load_prefix(ns, &keys(&blocks), &toks);
    assert!(loaded.stopped.is_none(), "{:?}", loaded.stopped);
    let tiers: Vec<Tier> = loaded.blocks.iter().map(|(_, t)| *t).collect();
    assert_eq!(&tiers[..3], &[Tier::Ram; 3]);
    assert_eq!(&tiers[3..], &[Tier::Ssd; 3]);
    for ((p, _), b) in loaded.blocks.iter().zip(&blocks) {
        assert_eq!(**p, *b);
    }
    // Blocks 3-5 were promoted and, as leaves past a full RAM tier, went straight back out.
    let st = s.stats();
    let from_ssd = tiers.iter().filter(|t| **t == Tier::Ssd).count() as u64;
    assert_eq!(from_ssd, 3);
    assert_eq!(st.ssd_hits, from_ssd);
    assert_eq!(st.promotions, from_ssd);
    assert_eq!(st.ram_blocks, 3);
    assert!(st.ram_bytes <= 3 * 256);

    // Reopen: everything comes back from SSD alone.
    drop(s);
    let s: Store = Store::open(StoreConfig::default().root(dir.path())).unwrap();
    let loaded = s.load_prefix(ns, &keys(&blocks), &toks);
    assert_eq!(loaded.blocks.len(), 6);
    assert!(loaded.blocks.iter().all(|(_, t)| *t == Tier::Ssd));
}

#[test]
fn lookup_stops_at_the_first_gap() {
    let d = common::desc("gap", 1);
    let s: Store = Store::open(StoreConfig::default()).unwrap();
    let ns = s.register_namespace(&d).unwrap();
    let (blocks, toks) = common::chain(&d, 4, 1);
    for i in [0, 1, 3] {
        s.insert(Arc::new(blocks[i].clone())).unwrap();
    }
    assert_eq!(s.lookup(ns, &keys(&blocks)).blocks(), 2);
    let loaded = s.load_prefix(ns, &keys(&blocks), &toks);
    assert_eq!(loaded.blocks.len(), 2);
    assert_eq!(loaded.stopped, Some(StopReason::Missing { index: 2 }));
}

#[test]
fn load_validates_tokens_and_returns_the_valid_prefix() {
    let d = common::desc("val", 1);
    let s: Store = Store::open(StoreConfig::default()).unwrap();
    let ns = s.register_namespace(&d).unwrap();
    let (blocks, mut toks) = common::chain(&d, 3, 2);
    for b in &blocks {
        s.insert(Arc::new(b.clone())).unwrap();
    }
    toks[1][0] ^= 1;
    let loaded = s.load_prefix(ns, &keys(&blocks), &toks);
    assert_eq!(loaded.blocks.len(), 1);
    assert!(matches!(
        loaded.stopped,
        Some(StopReason::Invalid {
            index: 1,
            problem: BlockProblem::Tokens,
            ..
        })
    ));
    // Wrong namespace: nothing is returned.
    let other = common::desc("other", 1).id();
    let loaded = s.load_prefix(other, &keys(&blocks), &toks);
    assert!(loaded.blocks.is_empty());
    assert_eq!(loaded.stopped, Some(StopReason::UnknownNamespace));
}

#[test]
fn insert_rejects_wrong_layout_key_and_namespace() {
    let d = common::desc("rej", 1);
    let s: Store = Store::open(StoreConfig::default()).unwrap();
    let (blocks, _) = common::chain(&d, 1, 3);
    let err = s.insert(Arc::new(blocks[0].clone())).unwrap_err();
    assert!(matches!(err, InsertError::UnknownNamespace(_)), "{err}");
    s.register_namespace(&d).unwrap();

    let mut b = blocks[0].clone();
    b.planes[1].shape = vec![8, 1];
    let err = s.insert(Arc::new(b)).unwrap_err();
    assert!(matches!(err, InsertError::Layout { .. }), "{err}");

    let mut b = blocks[0].clone();
    b.meta.tokens[0] += 1;
    let err = s.insert(Arc::new(b)).unwrap_err();
    assert!(matches!(err, InsertError::Key { .. }), "{err}");
    assert_eq!(s.stats().ram_blocks, 0);
}

#[test]
fn a_full_queue_never_blocks_insert_and_counts_what_it_skips() {
    let dir = tempfile::tempdir().unwrap();
    let d = common::desc("queue", 4);
    let s = Store::open(
        StoreConfig::default()
            .root(dir.path())
            .ram_budget(256)
            .queue_capacity(1)
            .write_policy(WritePolicy::WriteBack),
    )
    .unwrap();
    let ns = s.register_namespace(&d).unwrap();
    let (blocks, toks) = common::chain(&d, 8, 5);
    // The worker takes the first write and waits at the paused gate.
    let paused = s.pause_writes();
    let t = Instant::now();
    for b in &blocks {
        s.insert(Arc::new(b.clone())).unwrap();
    }
    assert!(
        t.elapsed() < Duration::from_secs(2),
        "insert blocked on a stuck worker"
    );
    let st = s.stats();
    assert_eq!(st.ram_evictions, 7);
    // One job in the worker, one in the queue; the rest were skipped and counted.
    // (The second may have been skipped too if the worker had not yet taken the first.)
    assert!(st.skipped_queue_full >= 5, "{st:?}");
    assert!((1..=2).contains(&st.spills), "{st:?}");
    assert_eq!(st.spills + st.skipped_queue_full, 7, "{st:?}");
    // Blocks queued but not yet written still serve as RAM hits.
    let hit = s.lookup(ns, &keys(&blocks[..1]));
    assert_eq!(hit.blocks(), 1);
    drop(paused);
    s.flush().unwrap();
    let loaded = s.load_prefix(ns, &keys(&blocks), &toks);
    // Every spilled block and the RAM-resident one reached SSD; the skipped ones did not.
    assert_eq!(s.stats().ssd_blocks, st.spills + 1, "{:?}", s.stats());
    assert_eq!(s.stats().write_errors, 0);
    // Block 0 stayed in RAM (the root outlives its leaves) and flush wrote it; block 1 was
    // taken by the worker first, so the prefix is at least two blocks long.
    let n = loaded.blocks.len();
    assert!((2..=3).contains(&n), "{:?}", loaded.stopped);
    assert_eq!(loaded.stopped, Some(StopReason::Missing { index: n }));
}

#[test]
fn write_through_persists_without_eviction_and_flush_is_durable() {
    let dir = tempfile::tempdir().unwrap();
    let d = common::desc("wt", 2);
    let cfg = StoreConfig::default()
        .root(dir.path())
        .write_policy(WritePolicy::WriteThrough);
    let s: Store = Store::open(cfg.clone()).unwrap();
    let ns = s.register_namespace(&d).unwrap();
    let (blocks, toks) = common::chain(&d, 5, 9);
    for b in &blocks {
        s.insert(Arc::new(b.clone())).unwrap();
    }
    s.flush().unwrap();
    assert_eq!(s.stats().ssd_blocks, 5);
    assert_eq!(s.stats().ram_evictions, 0);
    // Simulate a crash after flush: skip Drop's orderly shutdown.
    std::mem::forget(s);
    let dir2 = tempfile::tempdir().unwrap();
    for f in common::files(dir.path()) {
        if f.file_name().unwrap() == "LOCK" {
            continue;
        }
        let rel = f.strip_prefix(dir.path()).unwrap();
        std::fs::create_dir_all(dir2.path().join(rel).parent().unwrap()).unwrap();
        std::fs::copy(&f, dir2.path().join(rel)).unwrap();
    }
    let s: Store = Store::open(StoreConfig::default().root(dir2.path())).unwrap();
    let loaded = s.load_prefix(ns, &keys(&blocks), &toks);
    assert_eq!(loaded.blocks.len(), 5);
}
