//! Bit flips and truncations on disk: always detected, quarantined, reported by verify,
//! removed by GC.

use std::sync::Arc;

use rand::{Rng, SeedableRng};
use store::{Block, BlockProblem, StopReason, Store, StoreConfig, Tier};

use crate::common;

fn filled_store(
    dir: &std::path::Path,
    n: usize,
) -> (store::NamespaceDescription, Vec<Block>, Vec<Vec<u32>>) {
    let d = common::desc("corrupt", 4);
    let s: Store = Store::open(StoreConfig::default().root(dir)).unwrap();
    s.register_namespace(&d).unwrap();
    let (blocks, toks) = common::chain(&d, n, 21);
    for b in &blocks {
        s.insert(Arc::new(b.clone())).unwrap();
    }
    s.close().unwrap();
    (d, blocks, toks)
}

fn path_of(dir: &std::path::Path, b: &Block) -> std::path::PathBuf {
    let k = b.meta.key.to_string();
    dir.join(b.meta.namespace.to_string())
        .join(&k[..2])
        .join(format!("{k}.safetensors"))
}

/// Whether the load stopped at `at` on an SSD block that failed verification.
fn stopped_at_corrupt(loaded: &store::LoadedPrefix, at: usize) -> bool {
    matches!(
        loaded.stopped,
        Some(StopReason::Invalid {
            index,
            tier: Tier::Ssd,
            problem: BlockProblem::Corrupt(_)
        }) if index == at
    )
}

#[test]
fn random_bit_flips_and_truncations_are_always_detected() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(42);
    for trial in 0..40 {
        let dir = tempfile::tempdir().unwrap();
        let (d, blocks, toks) = filled_store(dir.path(), 4);
        let victim = &blocks[2];
        let path = path_of(dir.path(), victim);
        let mut bytes = std::fs::read(&path).unwrap();
        let what = if trial % 4 == 3 {
            let len = rng.gen_range(0..bytes.len());
            bytes.truncate(len);
            format!("truncation to {len}")
        } else {
            let bit = rng.gen_range(0..bytes.len() * 8);
            bytes[bit / 8] ^= 1 << (bit % 8);
            format!("flip of bit {bit}")
        };
        std::fs::write(&path, &bytes).unwrap();

        // Reported by verify (read-only, before any read quarantines it).
        let report = store::inspect::inspect(dir.path(), true).unwrap();
        assert_eq!(
            report.corrupt.len(),
            1,
            "trial {trial} {what}: {:?}",
            report.corrupt
        );
        assert_eq!(report.corrupt[0].path, path);

        // Detected on load: the valid prefix comes back, the file goes to quarantine.
        let s: Store = Store::open(StoreConfig::default().root(dir.path())).unwrap();
        let keys: Vec<_> = blocks.iter().map(|b| b.meta.key).collect();
        let loaded = s.load_prefix(d.id(), &keys, &toks);
        assert_eq!(loaded.blocks.len(), 2, "trial {trial} {what}");
        assert!(
            matches!(
                loaded.stopped,
                Some(StopReason::Invalid {
                    index: 2,
                    tier: Tier::Ssd,
                    problem: BlockProblem::Corrupt(_)
                })
            ),
            "trial {trial} {what}: {:?}",
            loaded.stopped
        );
        let st = s.stats();
        assert_eq!(
            (st.verify_failures, st.quarantined),
            (1, 1),
            "trial {trial}"
        );
        assert!(!path.exists());
        drop(s);

        let report = store::inspect::inspect(dir.path(), true).unwrap();
        assert!(report.corrupt.is_empty());
        assert_eq!(report.quarantined.len(), 1);
        assert_eq!(
            report.namespaces[0].unreachable_blocks, 1,
            "block 3 lost its parent"
        );

        // GC removes the quarantined file and the now unreachable block 3.
        let gc = store::gc::gc(dir.path(), &Default::default()).unwrap();
        let reasons: Vec<_> = gc.deleted.iter().map(|i| i.reason).collect();
        assert!(
            reasons.contains(&store::gc::GcReason::Quarantined),
            "{reasons:?}"
        );
        assert!(
            reasons.contains(&store::gc::GcReason::Unreachable),
            "{reasons:?}"
        );
        assert!(gc.failed.is_empty());
        let report = store::inspect::inspect(dir.path(), true).unwrap();
        assert!(report.quarantined.is_empty());
        assert_eq!(report.blocks, 2);
    }
}

#[test]
fn gc_removes_corrupt_files_nobody_has_read_yet() {
    let dir = tempfile::tempdir().unwrap();
    let (_, blocks, _) = filled_store(dir.path(), 3);
    let path = path_of(dir.path(), &blocks[2]);
    let mut bytes = std::fs::read(&path).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 0x80;
    std::fs::write(&path, &bytes).unwrap();
    let gc = store::gc::gc(dir.path(), &Default::default()).unwrap();
    assert_eq!(gc.deleted.len(), 1);
    assert_eq!(gc.deleted[0].reason, store::gc::GcReason::Corrupt);
    assert!(gc.deleted[0].detail.as_ref().unwrap().contains("checksum"));
    assert!(!path.exists());
}

/// A long chain read with parallel SSD readers: blocks come back in chain order, bit for bit,
/// from the tier that holds each (some promoted into RAM by an earlier load, the rest read
/// ahead from SSD), and a corrupt file in the middle ends the prefix there even though the
/// readers have already read past it.
#[test]
fn a_long_mixed_chain_loads_in_order_and_stops_at_a_corrupt_file() {
    let dir = tempfile::tempdir().unwrap();
    let n = 64;
    let (d, blocks, toks) = filled_store(dir.path(), n);
    let keys: Vec<_> = blocks.iter().map(|b| b.meta.key).collect();
    let victim = 41;
    let path = path_of(dir.path(), &blocks[victim]);
    let mut bytes = std::fs::read(&path).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 0x40;
    std::fs::write(&path, &bytes).unwrap();

    let s: Store = Store::open(StoreConfig::default().root(dir.path())).unwrap();
    // Loads of growing prefixes promote blocks 0..=27 into RAM.
    for i in (0..30).step_by(3) {
        let one = s.load_prefix(d.id(), &keys[..=i], &toks[..=i]);
        assert_eq!(one.blocks.len(), i + 1, "{:?}", one.stopped);
    }
    let st = s.stats();
    let reads_before = st.ssd_hits;
    let loaded = s.load_prefix(d.id(), &keys, &toks);
    assert_eq!(loaded.blocks.len(), victim, "{:?}", loaded.stopped);
    assert!(stopped_at_corrupt(&loaded, victim), "{:?}", loaded.stopped);
    for (i, (b, tier)) in loaded.blocks.iter().enumerate() {
        assert_eq!(**b, blocks[i], "block {i}");
        // The earlier loads promoted blocks 0..=27 (each load takes the whole prefix).
        let expect = if i <= 27 { Tier::Ram } else { Tier::Ssd };
        assert_eq!(*tier, expect, "block {i}");
    }
    // The blocks after the corrupt one that readers may have read are intact on disk.
    assert!(path_of(dir.path(), &blocks[victim + 1]).is_file());
    assert!(s.stats().ssd_hits > reads_before);
    let report = store::inspect::inspect(dir.path(), true).unwrap();
    assert!(report.corrupt.is_empty(), "{:?}", report.corrupt);
}

#[test]
fn a_streamed_load_hands_over_each_block_before_a_corrupt_one_in_chain_order() {
    for (corrupt, readers) in [(5usize, 8usize), (5, 1), (0, 8), (7, 3)] {
        let dir = tempfile::tempdir().unwrap();
        let (d, blocks, toks) = filled_store(dir.path(), 8);
        let path = path_of(dir.path(), &blocks[corrupt]);
        let mut bytes = std::fs::read(&path).unwrap();
        let last = bytes.len() - 1;
        bytes[last] ^= 0x10;
        std::fs::write(&path, &bytes).unwrap();
        let s: Store =
            Store::open(StoreConfig::default().root(dir.path()).ssd_readers(readers)).unwrap();
        let keys: Vec<_> = blocks.iter().map(|b| b.meta.key).collect();
        // The first blocks are in RAM already: the stream mixes tiers, in chain order.
        let expect_ram = 2.min(corrupt);
        let warm = s.load_prefix(d.id(), &keys[..expect_ram], &toks[..expect_ram]);
        assert_eq!(warm.blocks.len(), expect_ram);
        let mut seen = Vec::new();
        let loaded = s.load_prefix_each(d.id(), &keys, &toks, |i, b, tier| {
            seen.push((i, b.clone(), tier));
        });
        assert_eq!(loaded.blocks.len(), corrupt, "corrupt {corrupt}");
        assert!(stopped_at_corrupt(&loaded, corrupt), "{:?}", loaded.stopped);
        // Exactly the returned blocks, in order, each handed over once, bit for bit the
        // published ones.
        assert_eq!(seen.len(), loaded.blocks.len());
        for (n, ((i, b, tier), (lb, lt))) in seen.iter().zip(&loaded.blocks).enumerate() {
            assert_eq!(*i, n);
            assert!(Arc::ptr_eq(b, lb));
            assert_eq!(tier, lt);
            assert_eq!(b.meta, blocks[n].meta);
            assert_eq!(b.planes, blocks[n].planes);
        }
        assert!(seen[..expect_ram].iter().all(|(_, _, t)| *t == Tier::Ram));
        assert!(seen[expect_ram..].iter().all(|(_, _, t)| *t == Tier::Ssd));
        assert_eq!(s.stats().verify_failures, 1);
    }
}
