//! Bad input becomes a typed error, never a panic.

use engine::{load, EngineError, LoadOptions};

use crate::common::goldens;

fn copy_tiny(dir: &std::path::Path) {
    for f in [
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ] {
        std::fs::copy(goldens().join("tiny-qwen3").join(f), dir.join(f)).unwrap();
    }
}

#[test]
fn a_missing_path_is_an_io_error() {
    let err = load("/nonexistent/model.gguf".as_ref(), &LoadOptions::default()).unwrap_err();
    assert!(matches!(err, EngineError::Io { .. }), "{err}");
}

#[test]
fn a_folder_without_config_is_not_a_model() {
    let dir = tempfile::tempdir().unwrap();
    let err = load(dir.path(), &LoadOptions::default()).unwrap_err();
    assert!(matches!(err, EngineError::NotAModel(_)), "{err}");
}

#[test]
fn corrupt_safetensors_are_reported_with_the_path() {
    let dir = tempfile::tempdir().unwrap();
    copy_tiny(dir.path());
    std::fs::write(
        dir.path().join("model.safetensors"),
        b"\x10\0\0\0\0\0\0\0{not json",
    )
    .unwrap();
    let err = load(dir.path(), &LoadOptions::default()).unwrap_err();
    assert!(matches!(err, EngineError::CorruptWeights { .. }), "{err}");
}

#[test]
fn a_truncated_gguf_is_corrupt() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("broken.gguf");
    std::fs::write(&p, b"GGUF\x03\0\0\0truncated").unwrap();
    let err = load(&p, &LoadOptions::default()).unwrap_err();
    assert!(matches!(err, EngineError::CorruptWeights { .. }), "{err}");
}

#[test]
fn an_unsupported_architecture_is_named() {
    let dir = tempfile::tempdir().unwrap();
    copy_tiny(dir.path());
    let cfg = std::fs::read_to_string(dir.path().join("config.json")).unwrap();
    std::fs::write(
        dir.path().join("config.json"),
        cfg.replace("\"qwen3\"", "\"mamba\""),
    )
    .unwrap();
    let err = load(dir.path(), &LoadOptions::default()).unwrap_err();
    assert!(
        matches!(&err, EngineError::UnsupportedArchitecture(a) if a == "mamba"),
        "{err}"
    );
}

#[test]
fn a_config_that_disagrees_with_the_tensors_is_a_shape_mismatch() {
    let dir = tempfile::tempdir().unwrap();
    copy_tiny(dir.path());
    let cfg = std::fs::read_to_string(dir.path().join("config.json")).unwrap();
    std::fs::write(
        dir.path().join("config.json"),
        cfg.replace("\"intermediate_size\": 64", "\"intermediate_size\": 96"),
    )
    .unwrap();
    let err = load(dir.path(), &LoadOptions::default()).unwrap_err();
    assert!(matches!(err, EngineError::ShapeMismatch { .. }), "{err}");
}

#[test]
fn a_missing_tensor_is_named() {
    let dir = tempfile::tempdir().unwrap();
    copy_tiny(dir.path());
    let cfg = std::fs::read_to_string(dir.path().join("config.json")).unwrap();
    std::fs::write(
        dir.path().join("config.json"),
        cfg.replace("\"num_hidden_layers\": 2", "\"num_hidden_layers\": 3"),
    )
    .unwrap();
    let err = load(dir.path(), &LoadOptions::default()).unwrap_err();
    assert!(
        matches!(&err, EngineError::MissingTensor(t) if t.contains("layers.2")),
        "{err}"
    );
}
