#!/usr/bin/env bash
# The long fault-injection run (docs/reliability.md): 200 SIGKILLs of a serving process,
# 5,000 bit flips and truncations, and the disk cases, with their figures.
#   bash scripts/faults.sh            # KILLS=200 FLIPS=5000 by default
#   KILLS=50 FLIPS=1000 SEED=7 bash scripts/faults.sh
# Needs scripts/setup.sh once. The disk cases mount tmpfs and need root (else they print
# SKIPPED, or fail under CI=1).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export KVSTORE_FAULT_KILLS="${KILLS:-200}" KVSTORE_FAULT_FLIPS="${FLIPS:-5000}"
[ -n "${SEED:-}" ] && export KVSTORE_FAULT_SEED="$SEED"
cargo build -p kvstore
log="target/faults-$(date +%Y%m%d-%H%M%S).log"
cargo test -p kvstore-tests --test e2e -- faults:: bitflips:: --nocapture --test-threads 1 2>&1 | tee "$log"
echo "figures:"
grep '^FIGURES' "$log" | sed 's/^FIGURES //'
