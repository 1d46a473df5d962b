//! Old-format fixtures: a block file written by format version 1, committed under
//! `tests/fixtures/v1/`, must keep reading and verifying; a block that claims another format
//! version is refused, naming the file. A format change bumps `FORMAT_VERSION` and adds a
//! fixture here (docs/store-format.md, version log).

use std::path::{Path, PathBuf};

use store::{Block, BlockMeta, DecodeError, ReadOutcome, SsdOptions, SsdTier};

use crate::common;

const FIXTURE_CREATED_MS: u64 = 1_700_000_000_000;

fn fixture_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/v1")
}

/// The block the v1 fixture holds: block 1 (the root's child) of a two-block chain, so the
/// parent is a real key.
fn expected() -> (store::NamespaceDescription, Block) {
    let d = common::desc("fixture-v1", 2);
    let (mut blocks, _) = common::chain(&d, 2, 11);
    let mut b = blocks.remove(1);
    b.meta = BlockMeta {
        created_unix_ms: FIXTURE_CREATED_MS,
        ..b.meta
    };
    (d, b)
}

fn copy_tree(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        let dest = to.join(e.file_name());
        if e.file_type().unwrap().is_dir() {
            copy_tree(&e.path(), &dest);
        } else {
            std::fs::copy(e.path(), &dest).unwrap();
        }
    }
}

fn open(root: &Path) -> SsdTier {
    SsdTier::open(
        root,
        SsdOptions {
            read_only: false,
            budget: 1 << 30,
        },
    )
    .unwrap()
}

/// Writes the fixture store; run with `KVSTORE_WRITE_FIXTURES=1` only when adding a fixture
/// for a new format version (never to rewrite an old one).
#[test]
#[ignore = "writes tests/fixtures; run by hand for a new format version"]
fn write_v1_fixture() {
    if std::env::var_os("KVSTORE_WRITE_FIXTURES").is_none() {
        return;
    }
    let (d, b) = expected();
    let dir = tempfile::tempdir().unwrap();
    let ssd = open(dir.path());
    ssd.write_namespace(&d).unwrap();
    ssd.put(&b).unwrap();
    drop(ssd);
    let out = fixture_dir();
    let _ = std::fs::remove_dir_all(&out);
    for rel in ["kvstore-store.json".into(), rel_block_path(&b)] {
        let dest = out.join(&rel);
        std::fs::create_dir_all(dest.parent().unwrap()).unwrap();
        std::fs::copy(dir.path().join(&rel), dest).unwrap();
    }
    let ns_json = PathBuf::from(b.meta.namespace.to_string()).join("namespace.json");
    std::fs::copy(dir.path().join(&ns_json), out.join(&ns_json)).unwrap();
}

fn rel_block_path(b: &Block) -> PathBuf {
    let k = b.meta.key.to_string();
    PathBuf::from(b.meta.namespace.to_string())
        .join(&k[..2])
        .join(format!("{k}.safetensors"))
}

#[test]
fn format_v1_fixture_still_reads_and_verifies() {
    let (_, b) = expected();
    let dir = tempfile::tempdir().unwrap();
    copy_tree(&fixture_dir(), dir.path());
    assert!(
        dir.path().join(rel_block_path(&b)).is_file(),
        "fixture missing"
    );
    let ssd = open(dir.path());
    assert_eq!(ssd.len(), 1);
    match ssd.get(b.meta.namespace, b.meta.key) {
        ReadOutcome::Hit(got) => assert_eq!(got, b),
        other => panic!("the v1 fixture no longer reads: {other:?}"),
    }
    assert_eq!(ssd.namespaces().len(), 1);
}

#[test]
fn blocks_claiming_another_format_version_are_refused_naming_the_file() {
    let (_, b) = expected();
    for version in ["0", "2"] {
        let dir = tempfile::tempdir().unwrap();
        copy_tree(&fixture_dir(), dir.path());
        let path = dir.path().join(rel_block_path(&b));
        let bytes = std::fs::read(&path).unwrap();
        let needle = b"\"kvstore.version\":\"1\"";
        let at = bytes
            .windows(needle.len())
            .position(|w| w == needle)
            .expect("fixture header names its version");
        let mut changed = bytes.clone();
        changed[at + needle.len() - 2] = version.as_bytes()[0];
        std::fs::write(&path, &changed).unwrap();

        // The offline reader (`kvstore inspect --block`) refuses it with the file's path.
        let err = store::inspect::block(dir.path(), b.meta.key).unwrap_err();
        let msg = err.to_string();
        assert!(
            msg.contains(&path.display().to_string())
                && msg.contains(&format!("block format version {version}")),
            "{msg}"
        );

        // The store treats it as a miss and quarantines it, reporting the file.
        let ssd = open(dir.path());
        match ssd.get(b.meta.namespace, b.meta.key) {
            ReadOutcome::Corrupt { path: moved, error } => {
                assert_eq!(
                    error,
                    DecodeError::UnsupportedVersion {
                        found: version.into()
                    }
                );
                let msg = format!("{}: {error}", moved.display());
                assert!(
                    msg.contains(&b.meta.key.to_string())
                        && msg.contains(&format!("block format version {version}")),
                    "{msg}"
                );
            }
            other => panic!("version {version} accepted: {other:?}"),
        }
    }
}
