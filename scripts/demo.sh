#!/usr/bin/env bash
# kvstore's main job on a fresh machine: set-up, a release build, then the multi-turn agent
# demo on the default model (SmolLM2-135M): per-turn prompt/cached tokens and TTFT, a
# restart that restores the conversation from SSD, and an inspect summary of the store.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
cargo build --release -p kvstore
./target/release/kvstore demo "$@"
