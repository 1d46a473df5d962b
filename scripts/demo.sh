#!/usr/bin/env bash
# kvstore's main job on a fresh machine: set-up, a release build, then the demo.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
cargo build --release -p kvstore
# Until the multi-turn agent demo lands (`kvstore demo`), the main job measures MLX's
# building blocks from Rust.
./target/release/kvstore bench mlx "$@"
