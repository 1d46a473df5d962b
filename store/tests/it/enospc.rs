//! ENOSPC on a tiny tmpfs: the SSD tier shrinks its budget to the file system and keeps
//! writing, the RAM tier keeps serving, nothing corrupt is left on disk.

use std::process::Command;
use std::sync::Arc;

use store::{ReadOutcome, Store, StoreConfig, Tier, WritePolicy};

use crate::{common, prerequisite};

#[test]
fn enospc_shrinks_the_ssd_tier_and_ram_keeps_serving() {
    if !common::is_root() {
        prerequisite::missing("mounting a 2 MiB tmpfs needs root", "run it as root");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let mnt = dir.path().join("mnt");
    std::fs::create_dir(&mnt).unwrap();
    let status = Command::new("mount")
        .args(["-t", "tmpfs", "-o", "size=2m", "tmpfs"])
        .arg(&mnt)
        .status();
    if !matches!(status, Ok(s) if s.success()) {
        prerequisite::missing(
            &format!("`mount -t tmpfs` failed ({status:?})"),
            "run it as root where mounts are allowed (not in an unprivileged container)",
        );
        return;
    }
    struct Unmount(std::path::PathBuf);
    impl Drop for Unmount {
        fn drop(&mut self) {
            let _ = Command::new("umount").arg(&self.0).status();
        }
    }
    let _guard = Unmount(mnt.clone());
    let root = mnt.join("store");

    let d = common::desc("enospc", 2048); // 2 x 64 KiB planes: 128 KiB per block
    let s: Store = Store::open(
        StoreConfig::default()
            .root(&root)
            .ram_budget(64 << 20)
            .ssd_budget(1 << 30) // the file system, not the budget, runs out
            .write_policy(WritePolicy::WriteThrough),
    )
    .unwrap();
    let ns = s.register_namespace(&d).unwrap();
    let (blocks, toks) = common::chain(&d, 24, 11); // 3 MiB > 2 MiB
    for b in &blocks {
        s.insert(Arc::new(b.clone())).unwrap();
    }
    // The file system fills before the budget: the tier lowers its budget to what fits,
    // evicts its oldest blocks and keeps writing, so the flush succeeds.
    s.flush()
        .expect("a full file system shrinks the SSD tier instead of failing");
    let st = s.stats();
    assert!(st.blocks_written == 24 && st.ssd_evictions > 0, "{st:?}");
    assert!(st.ssd_budget < 2 << 20, "budget not shrunk: {st:?}");
    assert!(st.ssd_bytes <= st.ssd_budget, "{st:?}");

    // The RAM tier serves every block.
    let keys: Vec<_> = blocks.iter().map(|b| b.meta.key).collect();
    let loaded = s.load_prefix(ns, &keys, &toks);
    assert_eq!(loaded.blocks.len(), 24);
    assert!(loaded.blocks.iter().all(|(_, t)| *t == Tier::Ram));

    // What reached the disk verifies; no temp files; nothing partial.
    assert!(
        common::temp_files(&root).is_empty(),
        "{:?}",
        common::temp_files(&root)
    );
    let ssd = s.ssd().unwrap();
    assert_eq!(ssd.len(), common::block_files(&root).len());
    for e in ssd.entries() {
        assert!(matches!(ssd.get(e.namespace, e.key), ReadOutcome::Hit(_)));
    }
    drop(s);
    let report = store::inspect::inspect(&root, true).unwrap();
    assert!(report.corrupt.is_empty(), "{:?}", report.corrupt);
}
