//! Hostile model files (issue 21): every crafted file of tests/fixtures/hostile/ and every
//! planted folder file is refused with an error naming what is wrong, never a crash, an
//! abort or an unbounded read.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use engine::{load, EngineError, LoadOptions};

use crate::common::goldens;

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/hostile")
}

fn copy_tiny(dir: &Path) {
    for f in [
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ] {
        std::fs::copy(goldens().join("tiny-qwen3").join(f), dir.join(f)).unwrap();
    }
}

fn refusal(path: &Path) -> String {
    match load(path, &LoadOptions::default()) {
        Ok(_) => panic!("{} loaded", path.display()),
        Err(e) => e.to_string(),
    }
}

#[test]
fn every_crafted_gguf_is_refused_with_a_message_naming_the_field() {
    let expected: serde_json::Map<String, serde_json::Value> =
        serde_json::from_str(&std::fs::read_to_string(fixtures().join("expected.json")).unwrap())
            .unwrap();
    assert!(expected.len() >= 15);
    let mut wrong = Vec::new();
    for (name, phrase) in &expected {
        let path = fixtures().join(name);
        let err = refusal(&path);
        let phrase = phrase.as_str().unwrap();
        if !err.contains(phrase) || !err.contains(name.as_str()) {
            wrong.push(format!(
                "{name}: expected {phrase:?} and the file name in: {err}"
            ));
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}

#[test]
fn absurd_dimensions_in_config_json_are_refused_naming_the_field() {
    for (field, value) in [
        ("num_hidden_layers", "100000000"),
        ("hidden_size", "0"),
        ("vocab_size", "-1"),
        ("intermediate_size", "1e30"),
    ] {
        let dir = tempfile::tempdir().unwrap();
        copy_tiny(dir.path());
        let p = dir.path().join("config.json");
        let mut cfg: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
        cfg[field] = serde_json::from_str(value).unwrap();
        std::fs::write(&p, cfg.to_string()).unwrap();
        let err = load(dir.path(), &LoadOptions::default()).unwrap_err();
        assert!(matches!(err, EngineError::Config { .. }), "{field}: {err}");
        assert!(err.to_string().contains(field), "{field}: {err}");
    }
}

#[test]
fn a_tokenizer_linked_to_dev_zero_is_refused_at_once() {
    for name in ["tokenizer.json", "tokenizer_config.json", "config.json"] {
        let dir = tempfile::tempdir().unwrap();
        copy_tiny(dir.path());
        std::fs::remove_file(dir.path().join(name)).unwrap();
        std::os::unix::fs::symlink("/dev/zero", dir.path().join(name)).unwrap();
        let t = Instant::now();
        let err = load(dir.path(), &LoadOptions::default()).unwrap_err();
        assert!(
            err.to_string().contains("not a regular file"),
            "{name}: {err}"
        );
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "{name}: read for {:?}",
            t.elapsed()
        );
    }
}

#[test]
fn an_oversized_config_is_refused_before_it_is_read() {
    let dir = tempfile::tempdir().unwrap();
    copy_tiny(dir.path());
    let f = std::fs::File::create(dir.path().join("config.json")).unwrap();
    f.set_len(64 << 20).unwrap();
    let err = load(dir.path(), &LoadOptions::default()).unwrap_err();
    assert!(err.to_string().contains("more than the"), "{err}");
}

#[test]
fn safetensors_headers_that_lie_are_refused_before_mlx_reads_them() {
    let header = |h: &str, data: usize| {
        let mut b = (h.len() as u64).to_le_bytes().to_vec();
        b.extend(h.as_bytes());
        b.extend(vec![0u8; data]);
        b
    };
    let cases: Vec<(&str, Vec<u8>)> = vec![
        ("header length", {
            let mut b = (1u64 << 62).to_le_bytes().to_vec();
            b.extend(b"{}");
            b
        }),
        (
            "outside",
            header(
                r#"{"model.embed_tokens.weight":{"dtype":"F32","shape":[4],"data_offsets":[0,1099511627776]}}"#,
                16,
            ),
        ),
        (
            "overflows",
            header(
                r#"{"w":{"dtype":"F32","shape":[2147483647,2147483647,2147483647],"data_offsets":[0,16]}}"#,
                16,
            ),
        ),
        (
            "needs",
            header(
                r#"{"w":{"dtype":"F32","shape":[8],"data_offsets":[0,16]}}"#,
                16,
            ),
        ),
    ];
    for (phrase, bytes) in cases {
        let dir = tempfile::tempdir().unwrap();
        copy_tiny(dir.path());
        std::fs::write(dir.path().join("model.safetensors"), bytes).unwrap();
        let err = load(dir.path(), &LoadOptions::default()).unwrap_err();
        assert!(matches!(err, EngineError::CorruptWeights { .. }), "{err}");
        assert!(err.to_string().contains(phrase), "{phrase}: {err}");
    }
}

#[test]
fn a_weight_map_cannot_name_files_outside_the_folder() {
    let dir = tempfile::tempdir().unwrap();
    copy_tiny(dir.path());
    std::fs::write(
        dir.path().join("model.safetensors.index.json"),
        r#"{"weight_map": {"w": "../../../../etc/passwd"}}"#,
    )
    .unwrap();
    let err = load(dir.path(), &LoadOptions::default()).unwrap_err();
    assert!(
        err.to_string().contains("not a file name in this folder"),
        "{err}"
    );
}

#[test]
fn a_store_whose_parent_is_not_writable_says_why_not_that_it_does_not_exist() {
    use std::os::unix::fs::PermissionsExt;
    use std::process::Command;
    let dir = tempfile::tempdir().unwrap();
    let parent = dir.path().join("parent");
    std::fs::create_dir(&parent).unwrap();
    // As root a 0555 directory is still writable: mount a read-only tmpfs instead.
    let mounted = Command::new("mount")
        .args(["-t", "tmpfs", "-o", "size=1m,ro", "tmpfs"])
        .arg(&parent)
        .status()
        .is_ok_and(|s| s.success());
    if !mounted {
        std::fs::set_permissions(&parent, std::fs::Permissions::from_mode(0o555)).unwrap();
    }
    let (model, tok) = load(&goldens().join("tiny-qwen3"), &LoadOptions::default()).unwrap();
    let reuse = crate::common::reuse_config(parent.join("store"), 8);
    let result = engine::KvTiers::open(&model, &tok, reuse);
    if mounted {
        let _ = Command::new("umount").arg(&parent).status();
    }
    let err = result
        .err()
        .expect("a store under a read-only parent opened")
        .to_string();
    assert!(!err.contains("does not exist"), "{err}");
    assert!(
        err.contains("Read-only file system") || err.contains("Permission denied"),
        "{err}"
    );
}
