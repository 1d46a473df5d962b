#!/usr/bin/env bash
# The whole test suite on a fresh machine: set-up, then every test of the workspace.
# Under CI (CI=1, set by .ci/run) set-up also fetches Gemma 3 270M (about 2 minutes), and
# a test whose prerequisite is missing fails instead of printing SKIPPED.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
with_gemma=""
case "${CI:-}" in "" | 0 | false) ;; *) with_gemma=--with-gemma ;; esac
# shellcheck disable=SC2086
bash scripts/setup.sh $with_gemma
# mlx_lm.server, the serving peer `kvstore bench serve --peer-python` is tested against.
bash scripts/bench/setup_peer.sh
cargo test --workspace --all-targets "$@"
cargo test --workspace --doc
# Fuzz smoke over the committed corpora. The store targets build in a few minutes and the
# model-file target adds about 40 s of CPU (the MLX binding); the engine targets (a much
# longer instrumented build) run when FUZZ_TARGETS names them; their corpora replay in
# `cargo test` above either way.
FUZZ_TARGETS=${FUZZ_TARGETS:-"block_file journal store_key model_file"} bash scripts/fuzz_smoke.sh
