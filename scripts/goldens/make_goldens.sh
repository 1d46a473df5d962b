#!/usr/bin/env bash
# Regenerates the engine's parity goldens (engine/tests/goldens/) with mlx-lm and
# transformers in a private venv (.venv-goldens, not committed). Needs PyPI once and the
# default model from `bash scripts/setup.sh`. The same venv runs mlx-lm for
# `kvstore bench generate`.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
VENV="$ROOT/.venv-goldens"
HERE="$ROOT/scripts/goldens"

[ -f "$ROOT/models/SmolLM2-135M-Instruct.Q4_1.gguf" ] || {
  echo "make_goldens: run 'bash scripts/setup.sh' first (it fetches the default model)" >&2; exit 1; }
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install --quiet -r "$HERE/requirements.txt"
fi
# Same BLAS as the engine: Debian's OpenBLAS behind the wheel's libmlx (see setup.sh).
openblas="/usr/lib/$(uname -m)-linux-gnu/openblas-pthread/libopenblas.so.0"
if [ -e "$openblas" ]; then
  for blas in "$VENV"/lib/python3*/site-packages/mlx_cpu.libs/libblas-*.so.*; do
    case "$blas" in *.orig) continue ;; esac
    [ -e "$blas" ] || continue
    if [ ! -L "$blas" ]; then mv "$blas" "$blas.orig"; ln -s "$openblas" "$blas"; fi
  done
fi
# --gemma: only the Gemma 3 goldens (make_gemma_goldens.py).
if [ "${1:-}" = --gemma ]; then
  shift
  exec "$VENV/bin/python" "$HERE/make_gemma_goldens.py" "$@"
fi
# --hybrid: only the hybrid models' goldens (make_hybrid_goldens.py).
if [ "${1:-}" = --hybrid ]; then
  shift
  exec "$VENV/bin/python" "$HERE/make_hybrid_goldens.py" "$@"
fi
exec "$VENV/bin/python" "$HERE/make_goldens.py" "$@"
