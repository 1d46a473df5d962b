//! `kvstore inspect` and `kvstore gc` run as a user would: the built binary on a real store.

use std::path::Path;
use std::process::{Command, Output};
use std::sync::Arc;

use store::{Block, BlockMeta, Dtype, NamespaceDescription, Plane, PlaneSpec, Store, StoreConfig};

fn kvstore(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kvstore"))
        .args(args)
        .env_remove("KVSTORE_DIR")
        .output()
        .expect("run kvstore")
}

fn json(out: &Output) -> serde_json::Value {
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "not JSON ({e}): {}\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
    })
}

/// A store with one namespace and a chain of `n` blocks; returns the block file paths.
fn make_store(root: &Path, n: usize) -> Vec<std::path::PathBuf> {
    let mut d = NamespaceDescription::new("cli-test", Dtype::F32, 2);
    d.planes = vec![PlaneSpec::new("k", Dtype::F32, vec![2, 4])];
    let s: Store = Store::open(StoreConfig::default().root(root)).unwrap();
    let ns = s.register_namespace(&d).unwrap();
    let mut parent = ns.0;
    let mut paths = Vec::new();
    for i in 0..n {
        let meta = BlockMeta::new(ns, parent, i as u32, vec![i as u32, 7]);
        parent = meta.key.0;
        paths.push(s.ssd().unwrap().block_path(ns, meta.key));
        let plane = Plane::new("k", Dtype::F32, vec![2, 4], vec![i as u8; 32]);
        s.insert(Arc::new(Block {
            meta,
            planes: vec![plane],
        }))
        .unwrap();
    }
    s.close().unwrap();
    paths
}

#[test]
fn inspect_json_describes_the_store_and_verify_flags_corruption() {
    let dir = tempfile::tempdir().unwrap();
    let paths = make_store(dir.path(), 4);
    let root = dir.path().to_str().unwrap();

    let out = kvstore(&["inspect", "--store", root, "--json"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v = json(&out);
    assert_eq!(v["schema"], "kvstore.inspect.v1");
    assert_eq!(v["blocks"], 4);
    assert_eq!(v["namespaces"][0]["longest_chain"], 4);
    assert_eq!(v["namespaces"][0]["description"]["model"], "cli-test");

    let out = kvstore(&["inspect", "--store", root]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("model cli-test") && text.contains("longest chain 4"),
        "{text}"
    );

    let mut bytes = std::fs::read(&paths[3]).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 1;
    std::fs::write(&paths[3], bytes).unwrap();
    let out = kvstore(&["inspect", "--store", root, "--verify"]);
    assert_eq!(out.status.code(), Some(1));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("CORRUPT") && text.contains("checksum"),
        "{text}"
    );
    let key = paths[3].file_stem().unwrap().to_str().unwrap();
    let out = kvstore(&["inspect", "--store", root, "--block", key, "--json"]);
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(json(&out)["position"], 3);

    let out = kvstore(&["gc", "--store", root, "--json"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v = json(&out);
    assert_eq!(v["schema"], "kvstore.gc.v1");
    assert_eq!(v["deleted"][0]["reason"], "corrupt");
    assert_eq!(v["kept_blocks"], 3);
    let out = kvstore(&["inspect", "--store", root, "--verify"]);
    assert!(out.status.success());
}

#[test]
fn gc_sizes_durations_dry_run_and_bad_input() {
    let dir = tempfile::tempdir().unwrap();
    make_store(dir.path(), 3);
    let root = dir.path().to_str().unwrap();
    let out = kvstore(&[
        "gc",
        "--store",
        root,
        "--max-bytes",
        "0B",
        "--dry-run",
        "--json",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v = json(&out);
    assert_eq!(v["dry_run"], true);
    assert_eq!(v["deleted"].as_array().unwrap().len(), 3);
    let out = kvstore(&[
        "gc",
        "--store",
        root,
        "--older-than",
        "7d",
        "--max-bytes",
        "512MiB",
    ]);
    assert!(out.status.success());
    assert!(String::from_utf8_lossy(&out.stdout).contains("kept 3 blocks"));

    let out = kvstore(&["gc", "--store", root, "--max-bytes", "lots"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--max-bytes"));
    let out = kvstore(&["gc", "--store", root, "--namespace", "../etc"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("not a namespace id"));

    let missing = dir.path().join("missing");
    let out = kvstore(&["inspect", "--store", missing.to_str().unwrap()]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("does not exist") && err.contains("missing"),
        "{err}"
    );
    assert!(!err.contains("panicked"));

    // A running writer holds the lock: gc is refused, inspect still works.
    let _w: Store = Store::open(StoreConfig::default().root(dir.path())).unwrap();
    let out = kvstore(&["gc", "--store", root]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("already open for writing"));
    assert!(kvstore(&["inspect", "--store", root]).status.success());
}

#[test]
fn default_store_comes_from_kvstore_dir() {
    let dir = tempfile::tempdir().unwrap();
    make_store(dir.path(), 1);
    let out = Command::new(env!("CARGO_BIN_EXE_kvstore"))
        .args(["inspect", "--json"])
        .env("KVSTORE_DIR", dir.path())
        .output()
        .unwrap();
    assert!(out.status.success());
    assert_eq!(json(&out)["blocks"], 1);
}
