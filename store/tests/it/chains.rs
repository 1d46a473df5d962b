//! Chains are evicted leaves first: what survives of a chain in either tier, across reopen
//! and under `gc --max-bytes`, is a prefix that starts at its root.

use std::path::Path;
use std::sync::Arc;

use store::gc::{gc, GcOptions};
use store::{Block, BlockKey, SsdOptions, SsdTier, Store, StoreConfig, Tier};

use crate::common;

fn keys(blocks: &[Block]) -> Vec<BlockKey> {
    blocks.iter().map(|b| b.meta.key).collect()
}

/// Which blocks of `blocks` have a file under `root`.
fn on_disk(root: &Path, blocks: &[Block]) -> Vec<bool> {
    let files = common::block_files(root);
    blocks
        .iter()
        .map(|b| {
            let k = b.meta.key.to_string();
            files.iter().any(|p| p.to_string_lossy().contains(&k))
        })
        .collect()
}

/// Asserts that exactly the first `n` entries are set.
fn assert_prefix(present: &[bool], n: usize, what: &str) {
    let expected: Vec<bool> = (0..present.len()).map(|i| i < n).collect();
    assert_eq!(
        present,
        &expected[..],
        "{what}: not the chain's first {n} blocks"
    );
}

#[test]
fn eviction_keeps_chain_roots_longer_than_their_leaves() {
    let dir = tempfile::tempdir().unwrap();
    let d = common::desc("chains", 4); // 256 bytes of planes per block
    let file = common::per_block(&d);
    let n = 16;
    let half = 8;
    let cfg = StoreConfig::default()
        .root(dir.path())
        .ram_budget(half as u64 * 256)
        .ssd_budget(half as u64 * file + file / 2)
        .queue_capacity(4 * n);
    let s: Store = Store::open(cfg.clone()).unwrap();
    let ns = s.register_namespace(&d).unwrap();
    let (chain, toks) = common::chain(&d, n, 1);
    let all = keys(&chain);

    // What an engine does after a turn: insert the new blocks, then touch the whole chain.
    for b in &chain {
        s.insert(Arc::new(b.clone())).unwrap();
    }
    s.touch_chain(ns, &all);
    s.flush().unwrap();

    // RAM: the root and its first descendants stayed; the leaves went to SSD.
    let hit = s.lookup(ns, &all);
    assert_eq!(hit.blocks(), half, "{hit:?}");
    assert_eq!(&hit.tiers[..], &[Tier::Ram; 8][..]);
    assert_eq!(s.stats().ram_blocks, half as u64);
    // SSD (half the chain fits): writing the prefix on flush evicted the spilled leaves.
    assert!(s.stats().ssd_bytes <= cfg.ssd_budget);
    assert_prefix(&on_disk(dir.path(), &chain), half, "SSD after flush");

    // Pressure from another conversation: RAM gives up this chain's leaves, not its root.
    let (other, _) = common::chain(&d, 4, 2);
    for b in &other {
        s.insert(Arc::new(b.clone())).unwrap();
    }
    s.touch_chain(ns, &keys(&other));
    let hit = s.lookup(ns, &all);
    assert_eq!(hit.blocks(), half, "{hit:?}");
    assert_eq!(&hit.tiers[..4], &[Tier::Ram; 4], "{hit:?}");
    assert_eq!(&hit.tiers[4..], &[Tier::Ssd; 4], "{hit:?}");
    drop(s);

    // Reopen with room for a quarter: the access journal kept the order, so the SSD keeps
    // the chain's first quarter.
    let quarter = n / 4;
    let s: Store = Store::open(cfg.clone().ssd_budget(quarter as u64 * file + file / 2)).unwrap();
    assert_prefix(&on_disk(dir.path(), &chain), quarter, "SSD after reopen");
    let loaded = s.load_prefix(ns, &all, &toks);
    assert_eq!(loaded.blocks.len(), quarter, "{:?}", loaded.stopped);
    drop(s);

    // gc --max-bytes keeps a prefix too.
    let report = gc(
        dir.path(),
        &GcOptions {
            max_bytes: Some(2 * file),
            ..Default::default()
        },
    )
    .unwrap();
    assert!(report.failed.is_empty(), "{:?}", report.failed);
    assert_prefix(&on_disk(dir.path(), &chain), 2, "after gc");
}

#[test]
fn gc_by_size_keeps_a_prefix_even_when_the_root_is_least_recent() {
    // Blocks written root first and never touched: the root is the least recently used
    // block, yet gc removes leaves before their ancestors.
    let dir = tempfile::tempdir().unwrap();
    let d = common::desc("gc-chain", 4);
    let file = common::per_block(&d);
    {
        let ssd = SsdTier::open(
            dir.path(),
            SsdOptions {
                read_only: false,
                budget: 1 << 30,
            },
        )
        .unwrap();
        std::fs::create_dir_all(dir.path().join(d.id().to_string())).unwrap();
        ssd.write_namespace(&d).unwrap();
        let (a, _) = common::chain(&d, 6, 3);
        let (b, _) = common::chain(&d, 3, 4);
        for blk in a.iter().chain(&b) {
            ssd.put(blk).unwrap();
        }
        ssd.sync().unwrap();
    }
    let (a, _) = common::chain(&d, 6, 3);
    let (b, _) = common::chain(&d, 3, 4);
    let report = gc(
        dir.path(),
        &GcOptions {
            max_bytes: Some(5 * file),
            ..Default::default()
        },
    )
    .unwrap();
    assert!(report.failed.is_empty(), "{:?}", report.failed);
    // Chain a is older: it loses its leaves (4 blocks) down to a two-block prefix; chain b,
    // more recent, stays whole.
    assert_prefix(&on_disk(dir.path(), &a), 2, "chain a");
    assert_prefix(&on_disk(dir.path(), &b), 3, "chain b");
}
