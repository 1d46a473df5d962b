//! What the store trusts on disk: only canonical lowercase-hex names it derived itself,
//! regular files (never a symlink), private modes, and bounded headers.

use std::os::unix::fs::PermissionsExt;
use std::sync::Arc;

use store::{Block, Store, StoreConfig};

use crate::common;

fn shard_path(root: &std::path::Path, b: &Block) -> std::path::PathBuf {
    let k = b.meta.key.to_string();
    root.join(b.meta.namespace.to_string()).join(&k[..2])
}

#[test]
fn only_canonical_regular_block_files_are_indexed_and_everything_is_private() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("store");
    let d = common::desc("security", 4);
    let (blocks, toks) = common::chain(&d, 3, 5);
    {
        let s: Store = Store::open(StoreConfig::default().root(&root)).unwrap();
        s.register_namespace(&d).unwrap();
        for b in &blocks {
            s.insert(Arc::new(b.clone())).unwrap();
        }
        s.close().unwrap();
    }
    // Private: directories 0700, files 0600.
    for f in common::files(&root) {
        let mode = std::fs::metadata(&f).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600, "{}", f.display());
        let dir_mode = std::fs::metadata(f.parent().unwrap())
            .unwrap()
            .permissions()
            .mode()
            & 0o777;
        assert_eq!(dir_mode, 0o700, "{}", f.parent().unwrap().display());
    }

    // Plant look-alikes: the third block's file moved aside and linked back by a symlink,
    // an uppercase-hex copy of the first, and a name with a path in it.
    let third = &blocks[2];
    let shard = shard_path(&root, third);
    let name = format!("{}.safetensors", third.meta.key);
    let outside = dir.path().join("outside.safetensors");
    std::fs::rename(shard.join(&name), &outside).unwrap();
    std::os::unix::fs::symlink(&outside, shard.join(&name)).unwrap();
    let first = &blocks[0];
    let first_shard = shard_path(&root, first);
    let first_name = format!("{}.safetensors", first.meta.key);
    std::fs::copy(
        first_shard.join(&first_name),
        first_shard.join(
            first_name
                .to_uppercase()
                .replace("SAFETENSORS", "safetensors"),
        ),
    )
    .unwrap();
    std::fs::write(first_shard.join("..%2f..%2fetc.safetensors"), b"x").unwrap();

    let s: Store = Store::open(StoreConfig::default().root(&root)).unwrap();
    let ns = s.register_namespace(&d).unwrap();
    let ssd = s.ssd().unwrap();
    let indexed: Vec<_> = ssd.entries().into_iter().map(|e| e.key).collect();
    assert_eq!(indexed.len(), 2, "{indexed:?}");
    assert!(!indexed.contains(&third.meta.key), "a symlink was indexed");
    // The chain stops before the symlinked block: it is never read through the link.
    let keys: Vec<_> = blocks.iter().map(|b| b.meta.key).collect();
    let loaded = s.load_prefix(ns, &keys, &toks);
    assert_eq!(loaded.blocks.len(), 2);
    drop(s);
    let report = store::inspect::inspect(&root, false).unwrap();
    assert_eq!(report.foreign_files.len(), 3, "{:?}", report.foreign_files);
    // The symlink's target was never touched.
    assert!(outside.is_file());
}
