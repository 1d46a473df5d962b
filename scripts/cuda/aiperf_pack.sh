#!/usr/bin/env bash
# AIPerf (PyPI `aiperf`, the version scripts/bench/aiperf_trace.sh pins) and every wheel it
# needs, for the GPU machine's Python (3.12, manylinux; it has no index to install from),
# packed as one tar split into parts of at most 40 MB, one per call's carry:
#   .cuda/xa1/aiperf.tar.part0, .cuda/xa2/aiperf.tar.part1, ...
# Carry each in its own call (`bash scripts/cuda/device.sh st`), then `device.sh ai` joins
# them, installs them offline and runs the AIPerf-beside-bench-trace replay.
#   bash scripts/cuda/aiperf_pack.sh [PYTHON_VERSION]   # default 3.12
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
PYV=${1:-3.12}
VERSION=$(sed -n 's/^AIPERF_VERSION=//p' "$ROOT/scripts/bench/aiperf_trace.sh")
[ -n "$VERSION" ] || { echo "no AIPERF_VERSION in scripts/bench/aiperf_trace.sh" >&2; exit 1; }
W=$ROOT/.cuda/aiperf-wh
rm -rf "$W" "$ROOT"/.cuda/xa[0-9]*
mkdir -p "$W"
python3 -m pip download -q "aiperf==$VERSION" -d "$W" --only-binary=:all: \
  --python-version "$PYV" --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux_2_24_x86_64 \
  --platform manylinux_2_27_x86_64 --platform any
tar -cf "$ROOT/.cuda/aiperf.tar" -C "$W" .
(cd "$ROOT/.cuda" && split -b 40000000 -d -a 1 aiperf.tar aiperf.tar.part && rm aiperf.tar)
n=0
for p in "$ROOT"/.cuda/aiperf.tar.part*; do
  n=$((n + 1))
  mkdir -p "$ROOT/.cuda/xa$n" && mv "$p" "$ROOT/.cuda/xa$n/"
done
echo "aiperf $VERSION for Python $PYV: $(ls "$W" | wc -l) wheels, $(du -sh "$W" | cut -f1), in $n parts: .cuda/xa1 .. .cuda/xa$n"
