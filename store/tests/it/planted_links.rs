//! A symbolic link planted under each name the store opens (LOCK, journal, marker,
//! namespace.json, costs.json, blocks, tmp, quarantine), pointing outside the store: the
//! store never reads, truncates, writes or moves anything through it, and says what it found.

use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::sync::Arc;
use std::time::Duration;

use store::{format, Block, Store, StoreConfig};

use crate::common;

/// A populated, closed store under `dir/store` and its blocks.
fn populated(dir: &Path) -> (PathBuf, Vec<Block>, Vec<Vec<u32>>) {
    let root = dir.join("store");
    let d = common::desc("planted", 4);
    let (blocks, toks) = common::chain(&d, 2, 9);
    let s: Store = Store::open(StoreConfig::default().root(&root)).unwrap();
    s.register_namespace(&d).unwrap();
    for b in &blocks {
        s.insert(Arc::new(b.clone())).unwrap();
    }
    s.close().unwrap();
    (root, blocks, toks)
}

/// Replaces `path` by a symlink to `target`.
fn plant(path: &Path, target: &Path) {
    if path.is_dir() && !path.is_symlink() {
        std::fs::remove_dir_all(path).unwrap();
    } else {
        let _ = std::fs::remove_file(path);
    }
    std::os::unix::fs::symlink(target, path).unwrap();
}

/// Opens the store on another thread: an open that blocks (a FIFO) fails the test instead
/// of hanging it.
fn open_within(root: &Path, read_only: bool) -> Result<(), String> {
    let (tx, rx) = mpsc::channel();
    let root = root.to_owned();
    std::thread::spawn(move || {
        let r = Store::open(StoreConfig::default().root(&root).read_only(read_only))
            .map(drop)
            .map_err(|e| e.to_string());
        let _ = tx.send(r);
    });
    rx.recv_timeout(Duration::from_secs(20))
        .expect("opening the store hung on a planted file")
}

fn assert_refused_link(result: Result<(), String>, name: &str) {
    let err = result.expect_err("the store opened through a planted symlink");
    assert!(
        err.contains(name) && err.contains("symbolic link"),
        "the error should name {name} and say it is a link: {err}"
    );
}

#[test]
fn lock_symlink_is_refused_and_its_target_untouched() {
    let dir = tempfile::tempdir().unwrap();
    let (root, _, _) = populated(dir.path());
    let victim = dir.path().join("victim.txt");
    std::fs::write(&victim, b"precious\n").unwrap();
    plant(&root.join(format::LOCK_FILE), &victim);
    assert_refused_link(open_within(&root, false), format::LOCK_FILE);
    // GC opens a writer too.
    let gc = store::gc::gc(&root, &store::gc::GcOptions::default());
    assert!(gc.is_err(), "gc went through a planted LOCK link");
    assert_eq!(std::fs::read(&victim).unwrap(), b"precious\n");
}

#[test]
fn journal_symlink_to_a_fifo_is_refused_without_blocking() {
    let dir = tempfile::tempdir().unwrap();
    let (root, _, _) = populated(dir.path());
    let fifo = dir.path().join("fifo");
    let status = std::process::Command::new("mkfifo")
        .arg(&fifo)
        .status()
        .unwrap();
    assert!(status.success());
    plant(&root.join(format::JOURNAL_FILE), &fifo);
    assert_refused_link(open_within(&root, true), format::JOURNAL_FILE);
    assert_refused_link(open_within(&root, false), format::JOURNAL_FILE);
    // A FIFO put there directly (no link) is refused as well.
    std::fs::remove_file(root.join(format::JOURNAL_FILE)).unwrap();
    std::fs::rename(&fifo, root.join(format::JOURNAL_FILE)).unwrap();
    let err = open_within(&root, true).expect_err("opened with a FIFO as journal");
    assert!(err.contains("not a regular file"), "{err}");
}

#[test]
fn marker_symlink_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let (root, _, _) = populated(dir.path());
    // A valid marker, but outside: the store must not take it for its own.
    let outside = dir.path().join("marker.json");
    std::fs::copy(root.join(format::STORE_FILE), &outside).unwrap();
    plant(&root.join(format::STORE_FILE), &outside);
    assert_refused_link(open_within(&root, true), format::STORE_FILE);
    assert_refused_link(open_within(&root, false), format::STORE_FILE);
}

#[test]
fn namespace_json_symlink_is_not_read() {
    let dir = tempfile::tempdir().unwrap();
    let (root, blocks, _) = populated(dir.path());
    let ns_dir = root.join(blocks[0].meta.namespace.to_string());
    let outside = dir.path().join("namespace.json");
    std::fs::copy(ns_dir.join(format::NAMESPACE_FILE), &outside).unwrap();
    plant(&ns_dir.join(format::NAMESPACE_FILE), &outside);
    let report = store::inspect::inspect(&root, false).unwrap();
    let ns = &report.namespaces[0];
    assert!(ns.description.is_none(), "read through the link");
    let why = ns.description_error.as_deref().unwrap_or_default();
    assert!(why.contains("symbolic link"), "{why}");
}

#[test]
fn costs_json_symlink_is_not_read() {
    let dir = tempfile::tempdir().unwrap();
    let (root, blocks, _) = populated(dir.path());
    let ns = blocks[0].meta.namespace;
    let s: Store = Store::open(StoreConfig::default().root(&root)).unwrap();
    s.save_costs(ns, b"{\"saved\": true}").unwrap();
    assert!(s.costs(ns).is_some());
    let path = root.join(ns.to_string()).join(format::COSTS_FILE);
    let outside = dir.path().join("costs.json");
    std::fs::copy(&path, &outside).unwrap();
    plant(&path, &outside);
    assert_eq!(s.costs(ns), None, "read through the link");
    // A FIFO there does not block the read either.
    std::fs::remove_file(&path).unwrap();
    assert!(std::process::Command::new("mkfifo")
        .arg(&path)
        .status()
        .unwrap()
        .success());
    assert_eq!(s.costs(ns), None);
}

#[test]
fn block_symlink_is_not_read_by_a_read_only_store() {
    let dir = tempfile::tempdir().unwrap();
    let (root, blocks, toks) = populated(dir.path());
    let b = &blocks[1];
    let k = b.meta.key.to_string();
    let path = root
        .join(b.meta.namespace.to_string())
        .join(&k[..2])
        .join(format!("{k}.{}", format::BLOCK_EXT));
    let outside = dir.path().join("block.safetensors");
    std::fs::copy(&path, &outside).unwrap();
    plant(&path, &outside);
    // A read-only store reads by path (another process may have written the block since
    // the scan): the link must still not be followed.
    let s: Store = Store::open(StoreConfig::default().root(&root).read_only(true)).unwrap();
    let keys: Vec<_> = blocks.iter().map(|b| b.meta.key).collect();
    let loaded = s.load_prefix(b.meta.namespace, &keys, &toks);
    assert_eq!(
        loaded.blocks.len(),
        1,
        "the chain must stop before the link"
    );
    assert!(std::fs::symlink_metadata(&path).unwrap().is_symlink());
}

#[test]
fn tmp_dir_symlink_is_refused_and_nothing_is_written_or_swept_outside() {
    let dir = tempfile::tempdir().unwrap();
    let (root, _, _) = populated(dir.path());
    let outside = dir.path().join("elsewhere");
    std::fs::create_dir(&outside).unwrap();
    std::fs::write(outside.join("keep.tmp"), b"not the store's").unwrap();
    plant(&root.join(format::TMP_DIR), &outside);
    assert_refused_link(open_within(&root, false), format::TMP_DIR);
    let names: Vec<_> = std::fs::read_dir(&outside)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(names, vec![std::ffi::OsString::from("keep.tmp")]);
}

#[test]
fn quarantine_dir_symlink_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let (root, _, _) = populated(dir.path());
    let outside = dir.path().join("elsewhere");
    std::fs::create_dir(&outside).unwrap();
    plant(&root.join(format::QUARANTINE_DIR), &outside);
    assert_refused_link(open_within(&root, false), format::QUARANTINE_DIR);
    assert_eq!(std::fs::read_dir(&outside).unwrap().count(), 0);
}
