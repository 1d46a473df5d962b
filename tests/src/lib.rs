//! Shared helpers for the end-to-end tests.

use std::path::{Path, PathBuf};
use std::process::Command;

/// The `kvstore` binary of this build (target/<profile>/kvstore), built on first use.
pub fn kvstore_bin() -> PathBuf {
    let exe = std::env::current_exe().expect("test binary path");
    let profile_dir = exe
        .parent()
        .and_then(|deps| deps.parent())
        .expect("target/<profile>");
    let bin = profile_dir.join("kvstore");
    if !bin.is_file() {
        let mut cmd = Command::new(env!("CARGO"));
        cmd.args(["build", "-p", "kvstore", "--bin", "kvstore"]);
        if profile_dir.ends_with("release") {
            cmd.arg("--release");
        }
        let status = cmd.status().expect("running cargo build");
        assert!(status.success(), "building the kvstore binary failed");
    }
    bin
}

/// Runs `kvstore generate --json` on `model` with the store `store` and `args`, quietly;
/// asserts it succeeded and returns its report.
pub fn generate_json(model: &Path, store: &Path, args: &[&str]) -> serde_json::Value {
    let out = Command::new(kvstore_bin())
        .arg("generate")
        .arg("--model")
        .arg(model)
        .arg("--store")
        .arg(store)
        .arg("--json")
        .args(args)
        .env("KVSTORE_QUIET", "1")
        .output()
        .expect("running kvstore generate");
    assert!(
        out.status.success(),
        "kvstore generate failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("kvstore generate --json prints JSON")
}

/// A model folder committed with the engine's goldens (tiny random weights).
pub fn tiny_model(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../engine/tests/goldens")
        .join(name)
}

/// The default model fetched by `scripts/setup.sh`.
pub fn smollm2() -> PathBuf {
    let p =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../models/SmolLM2-135M-Instruct.Q4_1.gguf");
    assert!(
        p.is_file(),
        "{} is missing: run `bash scripts/setup.sh`",
        p.display()
    );
    p
}

/// A throwaway `redis-server` for the remote-tier tests (shared with the store's tests).
#[path = "../../store/tests/it/redis_server.rs"]
pub mod redis_server;

pub mod prerequisite;

pub mod serve;

pub mod turns;
