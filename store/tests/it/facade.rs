//! The facade: lookup, load with validation, promotion, write-behind, flush, queue-full.

use std::sync::Arc;
use std::time::{Duration, Instant};

use store::{
    Block, BlockProblem, EvictionPolicy, InsertError, NamespaceId, StopReason, Store, StoreConfig,
    StoreStats, Tier, WritePolicy,
};

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

/// Inserts `n` blocks of 256 bytes into a store whose RAM holds one, with the SSD writer
/// paused, and returns the store, its namespace, the blocks and the stats then.
fn burst(
    dir: &std::path::Path,
    n: usize,
    queue_bytes: Option<u64>,
) -> (Store, NamespaceId, Vec<Block>, Vec<Vec<u32>>, StoreStats) {
    let d = common::desc("burst", 4);
    let mut cfg = StoreConfig::default()
        .root(dir)
        .ram_budget(256)
        .write_policy(WritePolicy::WriteBack);
    if let Some(b) = queue_bytes {
        cfg = cfg.queue_bytes(b);
    }
    let s = Store::open(cfg).unwrap();
    let ns = s.register_namespace(&d).unwrap();
    let (blocks, toks) = common::chain(&d, n, 9);
    assert_eq!(blocks[0].data_len(), 256);
    let st = {
        let _paused = s.pause_writes();
        for b in &blocks {
            s.insert(Arc::new(b.clone())).unwrap();
        }
        s.stats()
    };
    (s, ns, blocks, toks, st)
}

#[test]
fn a_burst_of_spills_within_the_queue_bytes_is_written_whole() {
    // 100 blocks leave RAM at once while the writer is busy: more than the 64 jobs the
    // queue held before it was bounded by bytes, far less than its default 1 GiB.
    let dir = tempfile::tempdir().unwrap();
    let (s, ns, blocks, toks, st) = burst(dir.path(), 101, None);
    assert_eq!(st.ram_evictions, 100, "{st:?}");
    assert_eq!((st.spills, st.skipped_queue_full), (100, 0), "{st:?}");
    s.flush().unwrap();
    assert_eq!(s.stats().ssd_blocks, 101, "{:?}", s.stats());
    let loaded = s.load_prefix(ns, &keys(&blocks), &toks);
    assert_eq!(loaded.blocks.len(), 101, "{:?}", loaded.stopped);
}

#[test]
fn spills_past_the_queue_bytes_are_skipped_and_a_lone_block_always_fits() {
    let dir = tempfile::tempdir().unwrap();
    // Room for three 256-byte blocks: the one the paused worker holds counts until it is
    // written, so exactly three of the seven evictions are queued.
    let (_s, _, _, _, st) = burst(dir.path(), 8, Some(3 * 256));
    assert_eq!(st.ram_evictions, 7, "{st:?}");
    assert_eq!((st.spills, st.skipped_queue_full), (3, 4), "{st:?}");
    // A bound below one block still takes a block into an empty queue.
    let dir = tempfile::tempdir().unwrap();
    let (s, _, _, _, st) = burst(dir.path(), 8, Some(100));
    assert_eq!((st.spills, st.skipped_queue_full), (1, 6), "{st:?}");
    s.flush().unwrap();
    // The spilled block and the one RAM holds.
    assert_eq!(s.stats().ssd_blocks, 2, "{:?}", s.stats());
}

#[test]
fn a_re_published_block_between_spills_does_not_split_their_group_commit() {
    let dir = tempfile::tempdir().unwrap();
    let d = common::desc("regroup", 4);
    let cfg = StoreConfig::default()
        .root(dir.path())
        .ram_budget(256)
        .eviction(EvictionPolicy::Lru)
        .write_policy(WritePolicy::WriteBack);
    let s = Store::open(cfg).unwrap();
    s.register_namespace(&d).unwrap();
    // Unrelated one-block chains: RAM holds one, so each insert spills the one before.
    let r: Vec<Arc<Block>> = (0..7)
        .map(|seed| Arc::new(common::chain(&d, 1, 100 + seed).0.remove(0)))
        .collect();
    for i in [6, 0, 1] {
        s.insert(r[i].clone()).unwrap();
    }
    s.flush().unwrap();
    let before = s.stats();
    assert_eq!(before.ssd_blocks, 3, "{before:?}");
    {
        // The worker waits holding the first spill; the rest queue behind it: spills of
        // r2 and r3 (new) and of r1 and r0 (stored), with the re-publications of r0 and r6
        // (stored: recency refreshes) between them.
        let _paused = s.pause_writes();
        for i in [2, 3, 0, 6] {
            s.insert(r[i].clone()).unwrap();
        }
    }
    s.flush().unwrap();
    let st = s.stats();
    assert_eq!(st.ssd_blocks, 5, "{st:?}");
    assert_eq!(st.blocks_written - before.blocks_written, 2, "{st:?}");
    // r2 and r3 in one group commit: the refreshes between them were applied in passing.
    assert_eq!(st.group_commits - before.group_commits, 1, "{st:?}");
    assert!(st.write_busy_us > before.write_busy_us, "{st:?}");
    // The commit's fsyncs are a part of the time it took.
    let synced = st.write_sync_us - before.write_sync_us;
    assert!(synced > 0, "{st:?}");
    assert!(synced <= st.write_busy_us - before.write_busy_us, "{st:?}");
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
    // One reader: the files are read on the loading thread, one after another.
    let s: Store = Store::open(StoreConfig::default().root(dir2.path()).ssd_readers(1)).unwrap();
    let t = std::time::Instant::now();
    let loaded = s.load_prefix(ns, &keys(&blocks), &toks);
    let wall_us = t.elapsed().as_micros() as u64;
    assert_eq!(loaded.blocks.len(), 5);
    // Every block came from the SSD, and reading the files was a part of the load's time.
    let st = s.stats();
    assert_eq!(st.ssd_hits, 5, "{st:?}");
    assert!(
        st.ssd_read_us > 0 && st.ssd_read_us <= wall_us,
        "{st:?}, load {wall_us} µs"
    );
    // The load's phases follow one another within its wall time; with one reader every
    // file is read while the walk waits for it.
    let p = st.load_phases;
    let phases = p.plan_us + p.start_us + p.wait_us + p.promote_us + p.join_us + p.touch_us;
    assert!(
        phases <= p.loads_us && p.loads_us <= wall_us,
        "{p:?}, load {wall_us} µs"
    );
    assert!(p.wait_us >= st.ssd_read_us, "{p:?}, {st:?}");
}

/// A namespace whose blocks may leave out their "window" layer (`l1.*`): whole blocks
/// carry `l0.k, l0.v, l1.k, l1.v`, trimmed ones `l0.k, l0.v`.
fn windowed() -> store::NamespaceDescription {
    let mut d = common::desc("windowed", 64);
    d.layers = vec!["global".into(), "window(8)".into()];
    let l1: Vec<store::PlaneSpec> = d
        .planes
        .iter()
        .map(|p| store::PlaneSpec::new(p.name.replace("l0", "l1"), p.dtype, p.shape.clone()))
        .collect();
    d.trimmed_planes = d.planes.clone();
    d.planes.extend(l1);
    d
}

fn trimmed(b: &Block) -> Block {
    let mut t = b.clone();
    t.planes.truncate(2);
    t
}

#[test]
fn a_replacing_insert_swaps_whole_and_trimmed_copies_in_ram_and_on_ssd() {
    for policy in [WritePolicy::WriteThrough, WritePolicy::WriteBack] {
        let dir = tempfile::tempdir().unwrap();
        let d = windowed();
        let cfg = StoreConfig::default().root(dir.path()).write_policy(policy);
        let (blocks, toks) = common::chain(&d, 3, 4);
        let planes = |s: &Store, ns| -> Vec<usize> {
            let loaded = s.load_prefix(ns, &keys(&blocks), &toks);
            assert!(loaded.stopped.is_none(), "{:?}", loaded.stopped);
            loaded.blocks.iter().map(|(b, _)| b.planes.len()).collect()
        };
        let ns;
        {
            let s: Store = Store::open(cfg.clone()).unwrap();
            ns = s.register_namespace(&d).unwrap();
            for b in &blocks {
                s.insert(Arc::new(b.clone())).unwrap();
            }
            s.flush().unwrap();
            // A plain insert of a trimmed copy changes nothing on SSD; a replacing one
            // does, in RAM at once.
            s.insert_replacing(Arc::new(trimmed(&blocks[0]))).unwrap();
            s.insert_replacing(Arc::new(trimmed(&blocks[1]))).unwrap();
            assert_eq!(planes(&s, ns), [2, 2, 4], "{policy:?}");
            s.flush().unwrap();
        }
        let whole = blocks.iter().map(Block::data_len).sum::<u64>();
        {
            let s: Store = Store::open(cfg.clone()).unwrap();
            assert_eq!(s.register_namespace(&d).unwrap(), ns);
            assert_eq!(planes(&s, ns), [2, 2, 4], "{policy:?} after a restart");
            // The SSD tier counts the smaller files: less than the three whole blocks.
            assert!(s.stats().ssd_bytes < whole + 3 * 4096, "{policy:?}");
            // Back to whole (a tail needed again), and an identical whole copy: touched only.
            s.insert_replacing(Arc::new(blocks[1].clone())).unwrap();
            s.insert_replacing(Arc::new(blocks[2].clone())).unwrap();
            s.flush().unwrap();
        }
        let s: Store = Store::open(cfg).unwrap();
        s.register_namespace(&d).unwrap();
        assert_eq!(
            planes(&s, ns),
            [2, 4, 4],
            "{policy:?} after the second restart"
        );
        assert_eq!(s.stats().ssd_blocks, 3);
        drop(s);
        // `kvstore inspect` tells the trimmed blocks and the bytes they leave out.
        let r = store::inspect::inspect(dir.path(), true).unwrap();
        let n = r.namespaces.iter().find(|n| n.id == ns).unwrap();
        assert_eq!((n.blocks, n.window_trimmed_blocks), (3, 1));
        assert_eq!(n.window_trimmed_bytes, d.trimmed_bytes_per_block());
        assert_eq!(n.window_trimmed_bytes, 2 * 64 * 8 * 4);
        assert!(r.corrupt.is_empty());
    }
}

#[test]
fn a_namespace_whose_trimmed_planes_are_not_a_subsequence_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let s: Store = Store::open(StoreConfig::default().root(dir.path())).unwrap();
    let mut d = windowed();
    d.trimmed_planes.reverse();
    assert!(s.register_namespace(&d).is_err());
    let mut d = windowed();
    d.trimmed_planes
        .push(store::PlaneSpec::new("l9.k", store::Dtype::F32, vec![1]));
    assert!(s.register_namespace(&d).is_err());
}

/// The store's SSD readers are shared by its loads: loads from several threads at once, on
/// three readers, each get their whole chain from the SSD, block for block the bytes that
/// were written, and a store dropped right after its loads ends its readers.
#[test]
fn concurrent_loads_share_the_stores_readers() {
    let dir = tempfile::tempdir().unwrap();
    let d = common::desc("readers", 2);
    let chains: Vec<_> = (0..4)
        .map(|seed| common::chain(&d, 24, 40 + seed))
        .collect();
    {
        let s: Store = Store::open(
            StoreConfig::default()
                .root(dir.path())
                .write_policy(WritePolicy::WriteThrough),
        )
        .unwrap();
        s.register_namespace(&d).unwrap();
        for (blocks, _) in &chains {
            for b in blocks {
                s.insert(Arc::new(b.clone())).unwrap();
            }
        }
        s.flush().unwrap();
    }
    // A fresh process's store: the RAM tier is empty, every block is on the SSD.
    let s: Store = Store::open(StoreConfig::default().root(dir.path()).ssd_readers(3)).unwrap();
    let ns = d.id();
    std::thread::scope(|scope| {
        for (blocks, toks) in &chains {
            let s = &s;
            scope.spawn(move || {
                for _ in 0..3 {
                    let loaded = s.load_prefix(ns, &keys(blocks), toks);
                    assert_eq!(loaded.stopped, None);
                    assert_eq!(loaded.blocks.len(), blocks.len());
                    for ((got, _), want) in loaded.blocks.iter().zip(blocks) {
                        assert_eq!(got.meta.key, want.meta.key);
                        assert_eq!(got.planes, want.planes);
                    }
                }
            });
        }
    });
    let st = s.stats();
    // Each chain's first load read all of it from the SSD (the later ones may find blocks
    // promoted into RAM).
    assert!(st.ssd_hits >= 4 * 24, "{st:?}");
    drop(s);
}
