//! Pins: a pinned prefix survives forced eviction in RAM and on SSD (and a restart, when
//! durable); an expired pin protects nothing; a block that does not fit beside the pins is
//! refused, never a pin evicted.

use std::sync::Arc;
use std::time::Duration;

use store::{Block, BlockKey, EvictionPolicy, Store, StoreConfig, Tier, WriteError};

use crate::common;

fn keys(blocks: &[Block]) -> Vec<BlockKey> {
    blocks.iter().map(|b| b.meta.key).collect()
}

/// A store with room for `ram` blocks in RAM and `ssd` block files on SSD, evicting least
/// recently used blocks (the order these tests reason about; `eviction.rs` checks pins
/// under every policy).
fn open(root: &std::path::Path, d: &store::NamespaceDescription, ram: u64, ssd: u64) -> Store {
    let file = common::per_block(d);
    Store::open(
        StoreConfig::default()
            .root(root)
            .ram_budget(ram * 256)
            .ssd_budget(ssd * file + file / 2)
            .queue_capacity(64)
            .eviction(EvictionPolicy::Lru),
    )
    .unwrap()
}

fn insert_all(s: &Store, blocks: &[Block]) {
    for b in blocks {
        s.insert(Arc::new(b.clone())).unwrap();
    }
    s.touch_chain(blocks[0].meta.namespace, &keys(blocks));
}

#[test]
fn a_pinned_prefix_survives_forced_eviction_in_ram_and_on_ssd() {
    let dir = tempfile::tempdir().unwrap();
    let d = common::desc("pins", 4); // 256 bytes of planes per block
    let s = open(dir.path(), &d, 4, 4);
    let ns = s.register_namespace(&d).unwrap();
    let (pinned, _) = common::chain(&d, 3, 1);
    s.pins()
        .pin(ns, &keys(&pinned), Duration::from_secs(300), false);
    insert_all(&s, &pinned);
    s.flush().unwrap();

    // Other traffic: three chains, each larger than either tier.
    for seed in 2..5 {
        let (other, _) = common::chain(&d, 6, seed);
        insert_all(&s, &other);
        s.flush().unwrap();
    }
    let hit = s.lookup(ns, &keys(&pinned));
    assert_eq!(hit.blocks(), 3, "the pinned prefix was evicted: {hit:?}");
    assert_eq!(&hit.tiers[..], &[Tier::Ram; 3]);
    let p = s.pinned_bytes();
    assert_eq!(p.keys, 3);
    assert_eq!(p.ram_bytes, 3 * 256);
    assert!(p.ssd_bytes > 0, "{p:?}");
    assert!(s.stats().ram_bytes <= 4 * 256, "RAM over budget");
    assert!(
        s.stats().ssd_bytes <= s.config().ssd_budget,
        "SSD over budget"
    );
}

#[test]
fn an_expired_pin_does_not_protect() {
    let dir = tempfile::tempdir().unwrap();
    let d = common::desc("pins-expired", 4);
    let s = open(dir.path(), &d, 3, 3);
    let ns = s.register_namespace(&d).unwrap();
    let (pinned, _) = common::chain(&d, 3, 1);
    s.pins()
        .pin(ns, &keys(&pinned), Duration::from_millis(30), false);
    insert_all(&s, &pinned);
    s.flush().unwrap();
    std::thread::sleep(Duration::from_millis(60));
    for seed in 2..4 {
        let (other, _) = common::chain(&d, 4, seed);
        insert_all(&s, &other);
        s.flush().unwrap();
    }
    assert_eq!(
        s.lookup(ns, &keys(&pinned)).blocks(),
        0,
        "an expired pin still protected its blocks"
    );
    assert_eq!(s.pinned_bytes().keys, 0);
}

#[test]
fn a_block_that_does_not_fit_beside_the_pins_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let d = common::desc("pins-full", 4);
    let file = common::per_block(&d);
    let s = open(dir.path(), &d, 0, 2);
    let ns = s.register_namespace(&d).unwrap();
    let (pinned, _) = common::chain(&d, 2, 1);
    s.pins()
        .pin(ns, &keys(&pinned), Duration::from_secs(300), false);
    insert_all(&s, &pinned);
    s.flush().unwrap();
    let ssd = s.ssd().unwrap();
    let (other, _) = common::chain(&d, 1, 2);
    match ssd.put(&other[0]) {
        Err(WriteError::Pinned { pinned, .. }) => assert_eq!(pinned, 2 * file),
        r => panic!("a put over pinned blocks was not refused: {r:?}"),
    }
    assert_eq!(s.lookup(ns, &keys(&pinned)).blocks(), 2);
    assert!(ssd.used_bytes() <= ssd.budget());
}

#[test]
fn a_durable_pin_keeps_its_blocks_through_a_restart_with_a_smaller_budget() {
    let dir = tempfile::tempdir().unwrap();
    let d = common::desc("pins-durable", 4);
    let (pinned, toks) = common::chain(&d, 2, 1);
    {
        let s = open(dir.path(), &d, 0, 8);
        let ns = s.register_namespace(&d).unwrap();
        s.pins()
            .pin(ns, &keys(&pinned), Duration::from_secs(86_400), true);
        insert_all(&s, &pinned);
        let (other, _) = common::chain(&d, 6, 2);
        insert_all(&s, &other);
        s.flush().unwrap();
        // The other chain is the most recent: LRU alone would keep it, not the pinned one.
        s.touch_chain(ns, &keys(&other));
        s.flush().unwrap();
    }
    let s = open(dir.path(), &d, 0, 2);
    let ns = d.id();
    let loaded = s.load_prefix(ns, &keys(&pinned), &toks);
    assert_eq!(loaded.blocks.len(), 2, "{:?}", loaded.stopped);
    assert!(s.stats().ssd_bytes <= s.config().ssd_budget);
}
