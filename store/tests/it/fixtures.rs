//! Format fixtures: a store written by format version 2 (a snapshot block of a hybrid
//! model's namespace), committed under `tests/fixtures/v2/`, must keep reading and
//! verifying; the version 1 store under `tests/fixtures/v1/` is refused at open with its
//! version named; a block that claims another format version is refused, naming the file.
//! A format change bumps `FORMAT_VERSION` and adds a fixture here (docs/store-format.md,
//! version log).

use std::path::{Path, PathBuf};

use store::{
    Block, BlockMeta, DecodeError, Dtype, OpenError, Plane, PlaneSpec, ReadOutcome, SsdOptions,
    SsdTier,
};

use crate::common;

const FIXTURE_CREATED_MS: u64 = 1_700_000_000_000;

fn fixture_dir(version: u32) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("tests/fixtures/v{version}"))
}

/// The block the v2 fixture holds: block 1 (the root's child) of a two-block chain, so the
/// parent is a real key, in a namespace with a state plane, as a snapshot block (its K/V
/// planes, then the state plane).
fn expected() -> (store::NamespaceDescription, Block) {
    let mut d = common::desc("fixture-v2", 2);
    let state = PlaneSpec::new("states.0.0", Dtype::F32, vec![2, 8]);
    d.state_planes = vec![state.clone()];
    let (mut blocks, _) = common::chain(&d, 2, 11);
    let mut b = blocks.remove(1);
    b.meta = BlockMeta {
        created_unix_ms: FIXTURE_CREATED_MS,
        ..b.meta
    };
    let bytes = common::bytes(77, state.byte_len().unwrap() as usize);
    b.planes
        .push(Plane::new(state.name, state.dtype, state.shape, bytes));
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
fn write_v2_fixture() {
    if std::env::var_os("KVSTORE_WRITE_FIXTURES").is_none() {
        return;
    }
    let (d, b) = expected();
    let dir = tempfile::tempdir().unwrap();
    let ssd = open(dir.path());
    ssd.write_namespace(&d).unwrap();
    ssd.put(&b).unwrap();
    drop(ssd);
    let out = fixture_dir(2);
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
fn format_v2_fixture_with_a_snapshot_block_reads_and_verifies() {
    let (_, b) = expected();
    let dir = tempfile::tempdir().unwrap();
    copy_tree(&fixture_dir(2), dir.path());
    assert!(
        dir.path().join(rel_block_path(&b)).is_file(),
        "fixture missing"
    );
    let ssd = open(dir.path());
    assert_eq!(ssd.len(), 1);
    match ssd.get(b.meta.namespace, b.meta.key) {
        ReadOutcome::Hit(got) => assert_eq!(got, b),
        other => panic!("the v2 fixture no longer reads: {other:?}"),
    }
    assert_eq!(ssd.namespaces().len(), 1);
}

/// Version 1 stores are refused whole at open, naming the marker and both versions: their
/// namespaces (which hash the format version) are not this build's anyway.
#[test]
fn format_v1_store_is_refused_at_open_naming_its_version() {
    let dir = tempfile::tempdir().unwrap();
    copy_tree(&fixture_dir(1), dir.path());
    let options = SsdOptions {
        read_only: false,
        budget: 1 << 30,
    };
    match SsdTier::open(dir.path(), options) {
        Err(e @ OpenError::IncompatibleFormat { .. }) => {
            let msg = e.to_string();
            assert!(
                msg.contains("version 1") && msg.contains("reads format version 2"),
                "{msg}"
            );
        }
        other => panic!("a v1 store opened: {:?}", other.map(|_| ())),
    }
}

#[test]
fn blocks_claiming_another_format_version_are_refused_naming_the_file() {
    let (_, b) = expected();
    for version in ["1", "3"] {
        let dir = tempfile::tempdir().unwrap();
        copy_tree(&fixture_dir(2), dir.path());
        let path = dir.path().join(rel_block_path(&b));
        let bytes = std::fs::read(&path).unwrap();
        let needle = b"\"kvstore.version\":\"2\"";
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
