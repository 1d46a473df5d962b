//! One writer per root; read-only openers alongside.

use std::sync::Arc;

use store::{OpenError, Store, StoreConfig};

use crate::common;

#[test]
fn second_writer_is_refused_and_a_reader_works_meanwhile() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = StoreConfig::default().root(dir.path()).ssd_budget(1 << 24);
    let w: Store = Store::open(cfg.clone()).unwrap();
    let d = common::desc("lock", 2);
    let ns = w.register_namespace(&d).unwrap();
    let (blocks, toks) = common::chain(&d, 3, 1);
    for b in &blocks {
        w.insert(Arc::new(b.clone())).unwrap();
    }
    w.flush().unwrap();

    let err = Store::open(cfg.clone())
        .err()
        .expect("second writer refused");
    assert!(matches!(err, OpenError::Locked { .. }), "{err:?}");
    let msg = err.to_string();
    assert!(msg.contains("already open for writing"), "{msg}");
    assert!(
        msg.contains(&format!("pid {}", std::process::id())),
        "{msg}"
    );
    assert!(msg.contains("read-only"), "message suggests the fix: {msg}");

    let r: Store = Store::open(cfg.clone().read_only(true)).unwrap();
    let keys: Vec<_> = blocks.iter().map(|b| b.meta.key).collect();
    let loaded = r.load_prefix(ns, &keys, &toks);
    assert_eq!(loaded.blocks.len(), 3, "{:?}", loaded.stopped);
    for ((p, _), b) in loaded.blocks.iter().zip(&blocks) {
        assert_eq!(**p, *b);
    }
    // A read-only store never writes.
    assert!(r.ssd().unwrap().put(&blocks[0]).is_err());
    // GC is a writer too.
    let gc = store::gc::gc(dir.path(), &Default::default());
    assert!(matches!(gc, Err(OpenError::Locked { .. })));

    drop(w);
    let again: Store = Store::open(cfg).unwrap();
    assert_eq!(again.stats().ssd_blocks, 3);
}

#[test]
fn foreign_directories_and_versions_are_refused_with_the_path() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("notes.txt"), "mine").unwrap();
    let err = Store::open(StoreConfig::default().root(dir.path()))
        .err()
        .unwrap();
    assert!(matches!(err, OpenError::NotAStore { .. }), "{err}");
    assert!(err.to_string().contains(&dir.path().display().to_string()));
    assert_eq!(
        std::fs::read_to_string(dir.path().join("notes.txt")).unwrap(),
        "mine"
    );

    let dir = tempfile::tempdir().unwrap();
    drop(Store::open(StoreConfig::default().root(dir.path())).unwrap());
    let marker = dir.path().join(store::format::STORE_FILE);
    let text = std::fs::read_to_string(&marker).unwrap();
    let current = format!("\"version\": {}", store::format::FORMAT_VERSION);
    assert!(text.contains(&current), "{text}");
    std::fs::write(&marker, text.replace(&current, "\"version\": 99")).unwrap();
    let err = Store::open(StoreConfig::default().root(dir.path()))
        .err()
        .unwrap();
    assert!(matches!(err, OpenError::IncompatibleFormat { .. }), "{err}");
    assert!(err.to_string().contains("version 99"), "{err}");

    let missing = dir.path().join("nope");
    let err = Store::open(StoreConfig::default().root(&missing).read_only(true))
        .err()
        .unwrap();
    assert!(matches!(err, OpenError::NotFound { .. }), "{err}");
}

#[test]
fn files_and_directories_are_private() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("s");
    let s: Store = Store::open(StoreConfig::default().root(&root)).unwrap();
    let d = common::desc("perm", 1);
    s.register_namespace(&d).unwrap();
    for b in common::chain(&d, 2, 3).0 {
        s.insert(Arc::new(b)).unwrap();
    }
    s.flush().unwrap();
    drop(s);
    let mut seen = 0;
    for p in common::files(&root) {
        let mode = std::fs::metadata(&p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600, "{}", p.display());
        let parent = p.parent().unwrap();
        let dmode = std::fs::metadata(parent).unwrap().permissions().mode() & 0o777;
        assert_eq!(dmode, 0o700, "{}", parent.display());
        seen += 1;
    }
    assert!(seen >= 5);
}
