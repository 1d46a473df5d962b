#!/usr/bin/env bash
# Fuzz smoke: builds every cargo-fuzz target under fuzz/ and runs each for a short while
# over its committed corpus and seeds; fails on any crash, timeout or out-of-memory.
# The long runs are in docs/reliability.md ("Fuzzing").
#
#   FUZZ_SMOKE_SECS   seconds per target (default 30)
#   FUZZ_TARGETS      targets to run (default: all of `cargo fuzz list`); the engine targets
#                     (chat_template, http_request) build the engine and libmlx bindings first,
#                     model_file only the libmlx bindings
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
secs=${FUZZ_SMOKE_SECS:-30}

if ! cargo fuzz --version >/dev/null 2>&1; then
    cargo install cargo-fuzz --locked
fi
# cargo-fuzz passes nightly-only flags (-Zsanitizer, sancov); stable accepts them with this.
export RUSTC_BOOTSTRAP=1
# Scoped reader threads that exit just after their join look like leaks (fuzz/lsan.supp).
export LSAN_OPTIONS="suppressions=$PWD/fuzz/lsan.supp"

cd fuzz
targets=${FUZZ_TARGETS:-$(cargo fuzz list)}
features() {
    case $1 in
    chat_template | http_request) echo --features=engine ;;
    model_file) echo --features=model ;;
    esac
}
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
for t in $targets; do
    cargo fuzz build -O $(features "$t") "$t"
done
for t in $targets; do
    mkdir -p "$scratch/$t"
    echo "fuzz smoke: $t for ${secs}s"
    # New inputs go to the scratch directory; the committed corpus is only read.
    if ! cargo fuzz run -O $(features "$t") "$t" "$scratch/$t" "corpus/$t" "seeds/$t" -- \
        -max_total_time="$secs" -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 \
        >"$scratch/$t.log" 2>&1; then
        tail -n 80 "$scratch/$t.log"
        echo "fuzz smoke: $t failed; the input is in fuzz/artifacts/$t"
        exit 1
    fi
    grep -E '^stat::(number_of_executed_units|average_exec_per_sec)' "$scratch/$t.log"
done
