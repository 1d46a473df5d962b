#!/usr/bin/env bash
# Creates .venv-peer with mlx_lm.server (scripts/bench/peer-requirements.txt), the peer of
# `kvstore bench serve --peer-python .venv-peer/bin/python`. On Linux its CPU matmul goes
# through the system OpenBLAS, as the engine's does (docs/benchmarks.md, "MLX").
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
V=$ROOT/.venv-peer
[ -x "$V/bin/python" ] || python3 -m venv "$V"
"$V/bin/pip" install -q -r "$ROOT/scripts/bench/peer-requirements.txt"
blas=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0
for f in "$V"/lib/python3*/site-packages/mlx_cpu.libs/libblas-*.so.3.10.0; do
  [ -e "$f" ] && [ ! -L "$f" ] && [ -e "$blas" ] && mv "$f" "$f.orig" && ln -s "$blas" "$f"
done
"$V/bin/python" -c 'import mlx_lm, mlx.core as mx; print("peer: mlx-lm", mlx_lm.__version__, "mlx", mx.__version__)'
