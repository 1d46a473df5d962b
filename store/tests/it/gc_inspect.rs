//! GC by reachability and LRU under the writer lock; inspect's view of a store.

use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use store::gc::{gc, GcOptions, GcReason};
use store::{Block, Store, StoreConfig};

use crate::common;

/// The wall clock now, Unix milliseconds (what access times are recorded in).
fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64
}

fn store_with_chains(
    dir: &std::path::Path,
) -> (store::NamespaceDescription, Vec<Block>, Vec<Block>) {
    let d = common::desc("gc", 4);
    let s: Store = Store::open(StoreConfig::default().root(dir)).unwrap();
    s.register_namespace(&d).unwrap();
    let (a, _) = common::chain(&d, 5, 1);
    let (b, _) = common::chain(&d, 3, 2);
    for blk in a.iter().chain(&b) {
        s.insert(Arc::new(blk.clone())).unwrap();
        std::thread::sleep(Duration::from_millis(2));
    }
    s.close().unwrap();
    (d, a, b)
}

#[test]
fn inspect_reports_namespaces_chains_and_budget() {
    let dir = tempfile::tempdir().unwrap();
    let before = now_ms();
    let (d, _, _) = store_with_chains(dir.path());
    let after = now_ms();
    let r = store::inspect::inspect(dir.path(), false).unwrap();
    assert_eq!(r.blocks, 8);
    assert_eq!(r.namespaces.len(), 1);
    let n = &r.namespaces[0];
    assert_eq!(n.id, d.id());
    assert_eq!(n.description.as_ref().unwrap().model, "gc");
    assert_eq!(n.longest_chain, 5);
    assert_eq!(n.unreachable_blocks, 0);
    // Access times of this run: the inserts' (2 ms apart), not the close's that wrote the
    // RAM tier's blocks to the SSD.
    let (oldest, newest) = (
        n.oldest_access_unix_ms.unwrap(),
        n.newest_access_unix_ms.unwrap(),
    );
    assert!(
        before <= oldest && oldest < newest && newest <= after,
        "{before} <= {oldest} <= {newest} <= {after}"
    );
    assert_eq!(r.ssd_budget_bytes, Some(StoreConfig::default().ssd_budget));
    assert!(!r.verified && r.corrupt.is_empty());
}

#[test]
fn gc_by_size_removes_least_recent_and_their_descendants() {
    let dir = tempfile::tempdir().unwrap();
    let (_, a, b) = store_with_chains(dir.path());
    let per_block = common::physical(dir.path()) / 8;
    // Dry run deletes nothing.
    let opts = GcOptions {
        max_bytes: Some(3 * per_block),
        dry_run: true,
        ..Default::default()
    };
    let plan = gc(dir.path(), &opts).unwrap();
    assert_eq!(common::block_files(dir.path()).len(), 8);
    assert_eq!(plan.kept_blocks, 3);
    let report = gc(
        dir.path(),
        &GcOptions {
            dry_run: false,
            ..opts
        },
    )
    .unwrap();
    assert_eq!(report.deleted.len(), plan.deleted.len());
    assert!(report.failed.is_empty());
    assert!(common::physical(dir.path()) <= 3 * per_block);
    // Chain a (older) went first; chain b (most recent) stays whole.
    for blk in &b {
        assert!(dir.path().join(blk.meta.namespace.to_string()).exists());
    }
    let left = common::block_files(dir.path());
    assert_eq!(left.len(), 3);
    for blk in &b {
        let k = blk.meta.key.to_string();
        assert!(
            left.iter().any(|p| p.to_string_lossy().contains(&k)),
            "chain b block missing"
        );
    }
    assert_eq!(report.freed_bytes, 5 * per_block);
    let _ = a;
}

/// Durable pins (pins.json) hold against both GC rules: with room for nothing, the pinned
/// chain stays whole and everything else goes; an age rule that every block is past keeps
/// the pinned chain too.
#[test]
fn gc_keeps_pinned_blocks_under_size_and_age_rules() {
    let dir = tempfile::tempdir().unwrap();
    let (d, a, b) = store_with_chains(dir.path());
    let keys: Vec<_> = a.iter().map(|blk| blk.meta.key).collect();
    store::Pins::open(dir.path()).pin(d.id(), &keys, Duration::from_secs(3600), true);
    let per_block = common::physical(dir.path()) / 8;
    let kept_is_a = |dir: &std::path::Path| {
        let left = common::block_files(dir);
        assert_eq!(left.len(), a.len(), "{left:?}");
        for blk in &a {
            let k = blk.meta.key.to_string();
            assert!(left.iter().any(|p| p.to_string_lossy().contains(&k)));
        }
    };
    let r = gc(
        dir.path(),
        &GcOptions {
            older_than: Some(Duration::ZERO),
            dry_run: false,
            ..Default::default()
        },
    )
    .unwrap();
    assert_eq!(r.deleted.len(), b.len());
    kept_is_a(dir.path());
    let r = gc(
        dir.path(),
        &GcOptions {
            max_bytes: Some(0),
            dry_run: false,
            ..Default::default()
        },
    )
    .unwrap();
    assert!(r.deleted.is_empty(), "{:?}", r.deleted);
    kept_is_a(dir.path());
    assert!(common::physical(dir.path()) >= a.len() as u64 * per_block);
}

#[test]
fn gc_removes_unreachable_orphans_foreign_and_old() {
    let dir = tempfile::tempdir().unwrap();
    let (d, a, _) = store_with_chains(dir.path());
    let ns_dir = dir.path().join(d.id().to_string());
    // A broken chain: delete a[1], so a[2..] can never be hit.
    let k = a[1].meta.key.to_string();
    std::fs::remove_file(ns_dir.join(&k[..2]).join(format!("{k}.safetensors"))).unwrap();
    std::fs::write(ns_dir.join("stray.bin"), b"x").unwrap();
    std::fs::write(dir.path().join("tmp").join("half.tmp"), b"x").unwrap();
    let r = gc(dir.path(), &GcOptions::default()).unwrap();
    let count = |reason| r.deleted.iter().filter(|i| i.reason == reason).count();
    assert_eq!(count(GcReason::Unreachable), 3);
    assert_eq!(count(GcReason::Foreign), 1);
    assert_eq!(count(GcReason::Orphan), 1);
    assert_eq!(r.kept_blocks, 4);

    // Age: everything was accessed within the last minute, nothing is older than 1h.
    let r = gc(
        dir.path(),
        &GcOptions {
            older_than: Some(Duration::from_secs(3600)),
            ..Default::default()
        },
    )
    .unwrap();
    assert!(r.deleted.is_empty());
    std::thread::sleep(Duration::from_millis(20));
    let r = gc(
        dir.path(),
        &GcOptions {
            older_than: Some(Duration::from_millis(10)),
            ..Default::default()
        },
    )
    .unwrap();
    assert_eq!(r.deleted.len(), 4);
    assert!(r.deleted.iter().all(|i| i.reason == GcReason::Age));
    assert!(common::block_files(dir.path()).is_empty());
}

#[test]
fn gc_removes_blocks_of_a_foreign_format_version() {
    let dir = tempfile::tempdir().unwrap();
    let (d, a, _) = store_with_chains(dir.path());
    let k = a[4].meta.key.to_string();
    let path = dir
        .path()
        .join(d.id().to_string())
        .join(&k[..2])
        .join(format!("{k}.safetensors"));
    let bytes = std::fs::read(&path).unwrap();
    let text = String::from_utf8_lossy(&bytes).into_owned();
    let needle = format!("\"kvstore.version\":\"{}\"", store::format::FORMAT_VERSION);
    assert!(text.contains(&needle));
    let patched: Vec<u8> = {
        let pos = bytes
            .windows(needle.len())
            .position(|w| w == needle.as_bytes())
            .unwrap();
        let mut b = bytes.clone();
        b[pos + needle.len() - 2] = b'7';
        b
    };
    std::fs::write(&path, patched).unwrap();
    let r = gc(dir.path(), &GcOptions::default()).unwrap();
    assert_eq!(r.deleted.len(), 1);
    assert_eq!(r.deleted[0].reason, GcReason::ForeignFormat);
    assert!(r.deleted[0].detail.as_ref().unwrap().contains("version 7"));
}

/// A block's recorded access is its last use, not the moment it reached the SSD: a
/// write-back store writes its RAM blocks at close and spills evicted ones later, and
/// `inspect` and `gc --older-than` read these times.
#[test]
fn access_times_are_last_uses_not_writes() {
    let dir = tempfile::tempdir().unwrap();
    let d = common::desc("gc", 4);
    let (a, _) = common::chain(&d, 3, 1);
    let (b, _) = common::chain(&d, 3, 2);
    let (c, _) = common::chain(&d, 3, 3);
    let block_bytes = a[0].data_len();
    // Room for six blocks: c's insert pushes a's out of RAM (spilled to the SSD then).
    let s: Store = Store::open(
        StoreConfig::default()
            .root(dir.path())
            .ram_budget(6 * block_bytes),
    )
    .unwrap();
    s.register_namespace(&d).unwrap();
    let insert = |chain: &[Block]| {
        for blk in chain {
            s.insert(Arc::new(blk.clone())).unwrap();
        }
    };
    insert(&a);
    let a_used = now_ms();
    std::thread::sleep(Duration::from_millis(40));
    insert(&b);
    let b_used = now_ms();
    std::thread::sleep(Duration::from_millis(40));
    let c_first = now_ms();
    insert(&c);
    std::thread::sleep(Duration::from_millis(40));
    let closing = now_ms();
    s.close().unwrap();

    let ssd = store::SsdTier::open(
        dir.path(),
        store::SsdOptions {
            read_only: true,
            budget: 1 << 30,
        },
    )
    .unwrap();
    let access = |blk: &Block| {
        ssd.entries()
            .into_iter()
            .find(|e| e.key == blk.meta.key)
            .map(|e| e.last_access_unix_ms)
            .expect("every block reached the SSD")
    };
    for blk in &a {
        // Spilled when c came, after c_first: recorded as used before b.
        assert!(access(blk) <= a_used, "{} > {a_used}", access(blk));
    }
    for blk in &b {
        // Written by the flush at close, after closing: recorded as used before c.
        let t = access(blk);
        assert!(a_used <= t && t <= b_used, "{a_used} <= {t} <= {b_used}");
    }
    for blk in &c {
        let t = access(blk);
        assert!(
            c_first <= t && t <= closing,
            "{c_first} <= {t} <= {closing}"
        );
    }
}
