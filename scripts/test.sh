#!/usr/bin/env bash
# The whole test suite on a fresh machine: set-up, then every test of the workspace.
# Under CI (CI=1, set by .ci/run) set-up also fetches Gemma 3 270M (about 2 minutes), and
# a test whose prerequisite is missing fails instead of printing SKIPPED.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
with_gemma=""
case "${CI:-}" in "" | 0 | false) ;; *) with_gemma=--with-gemma ;; esac
# shellcheck disable=SC2086
# Each phase's minutes go to stderr, so a CI log shows where its time went.
phase() {
    local name=$1 t=$SECONDS
    shift
    "$@"
    echo "test.sh: $name took $(((SECONDS - t) / 60)) min $(((SECONDS - t) % 60)) s" >&2
}
phase set-up bash scripts/setup.sh $with_gemma
# mlx_lm.server, the serving peer `kvstore bench serve --peer-python` is tested against.
phase "the serving peer's set-up" bash scripts/bench/setup_peer.sh
phase "cargo test" cargo test --workspace --all-targets "$@"
phase "doc tests" cargo test --workspace --doc
# The parity tests against mlx-lm once more with prefill attention padded to a few shapes
# (mlx::padded_attention: CUDA's default, off on the CPU unless forced as here): the
# kept-quantized bf16 model's prompt takes that path, and its greedy ids and logits must
# still match.
KVSTORE_PADDED_ATTENTION=1 phase "parity, padded attention" \
    cargo test -p kvstore-engine --test it parity
# Fuzz smoke over the committed corpora. The store targets build in a few minutes and the
# model-file target adds about 40 s of CPU (the MLX binding); the engine targets (a much
# longer instrumented build) run when FUZZ_TARGETS names them; their corpora replay in
# `cargo test` above either way.
FUZZ_TARGETS=${FUZZ_TARGETS:-"block_file journal store_key model_file"} phase "fuzz smoke" bash scripts/fuzz_smoke.sh
