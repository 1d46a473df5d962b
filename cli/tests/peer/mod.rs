//! The serving peer the benchmarks' peer arms start: mlx-lm's `mlx_lm.server` from
//! `.venv-peer` (made by `bash scripts/bench/setup_peer.sh`, which the test script runs).

use std::path::{Path, PathBuf};

#[path = "../../../tests/src/prerequisite.rs"]
mod prerequisite;

/// `.venv-peer`'s Python, or `None` after saying the test cannot run (under CI: failing it).
pub fn python() -> Option<PathBuf> {
    let python = Path::new(env!("CARGO_MANIFEST_DIR")).join("../.venv-peer/bin/python");
    if python.exists() {
        return Some(python);
    }
    prerequisite::missing(
        "no .venv-peer (mlx_lm.server, the serving peer)",
        "bash scripts/bench/setup_peer.sh",
    );
    None
}
