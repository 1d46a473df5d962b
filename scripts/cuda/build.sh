#!/usr/bin/env bash
# Builds kvstore and its test binaries against the CUDA libmlx of the mlx-cuda-13 wheel,
# on a machine that has no CUDA libraries (the binaries run on the GPU machine).
#   bash scripts/cuda/build.sh [SRC_DIR]
# SRC_DIR: the checkout to build (default: this one; a `git worktree` of HEAD keeps other
# people's uncommitted edits out). Output: target/cuda/release of this checkout; log:
# .cuda/build.log (scripts/cuda/pack.sh reads the test executables' names from it).
# TESTS="-p kvstore-cache": build only those crates' tests (with NOTESTS unset).
#
# - The wheel is unpacked to .cuda/wheel and reached through the fixed path /opt/kvmlx, so
#   the rpath baked into the binaries (/opt/kvmlx/mlx/lib) is the same on both machines.
# - libmlx.so NEEDs libcuda, cuBLASLt, cuDNN, NCCL, ... which are absent here: GNU ld checks
#   a shared library's own undefined symbols when linking an executable, so
#   `-Wl,--allow-shlib-undefined` is passed through RUSTFLAGS. No code change is needed.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
SRC=${1:-$ROOT}
C=$ROOT/.cuda
mkdir -p "$C/dl"
whl=$C/dl/cuda/mlx_cuda_13-0.32.4-py3-none-manylinux_2_35_x86_64.whl
[ -f "$whl" ] || python3 -m pip download -q --no-deps --only-binary=:all: --platform manylinux_2_35_x86_64 \
  --python-version 3.12 --implementation cp -d "$C/dl/cuda" mlx-cuda-13==0.32.4
py=$(ls "$C"/dl/py312/mlx-0.32.4-cp312-*.whl 2>/dev/null || true)
[ -n "$py" ] || python3 -m pip download -q --no-deps --only-binary=:all: --platform manylinux_2_35_x86_64 \
  --python-version 3.12 --implementation cp -d "$C/dl/py312" mlx==0.32.4 mlx-lm==0.28.4
if [ ! -f "$C/wheel/mlx/lib/libmlx.so" ]; then
  python3 -m zipfile -e "$whl" "$C/wheel"
  python3 -m zipfile -e "$C"/dl/py312/mlx-0.32.4-cp312-*.whl "$C/wheel"   # python's mlx.core, for mlx-lm
fi
[ -e /opt/kvmlx ] || ln -sfn "$C/wheel" /opt/kvmlx
[ -f "$C/mlxcuda.tar.zst" ] || tar -C "$C/wheel" -cf - --exclude=mlx/include . | zstd -q -17 -T2 --long=27 -o "$C/mlxcuda.tar.zst"
# The batched decode attention (mlx/src/rows_attention.cc) compiles against the CUDA backend's
# headers, which need the CUDA runtime's headers (PyPI wheels) and fmt's (Debian).
H=$C/cudart/nvidia/cu13/include
if [ ! -f "$H/crt/host_config.h" ]; then
  python3 -m pip download -q --no-deps --only-binary=:all: --platform manylinux2014_x86_64 \
    --python-version 3.12 --implementation cp -d "$C/dl/cudart" nvidia-cuda-runtime==13.5.37 nvidia-cuda-crt==13.5.37
  for w in "$C"/dl/cudart/*.whl; do python3 -m zipfile -e "$w" "$C/cudart"; done
fi
[ -f /usr/include/fmt/format.h ] || apt-get install -y -q libfmt-dev >/dev/null
export KVSTORE_CUDA_INCLUDE=$H
cd "$SRC"
export CARGO_TARGET_DIR=$ROOT/target/cuda MLX_DIR=/opt/kvmlx/mlx CARGO_PROFILE_RELEASE_DEBUG=0
export RUSTFLAGS="-C link-arg=-Wl,--allow-shlib-undefined"
# NOTESTS=1: the kvstore binary only (benchmark runs; pack.sh with NOTESTS=1 too).
{ cargo build --release -j2 -p kvstore &&
  if [ -z "${NOTESTS:-}" ]; then
    cargo test --release --no-run -j2 ${TESTS:--p kvstore-mlx -p kvstore-store -p kvstore-cache -p kvstore-engine -p kvstore-tests}
  fi; } 2>&1 | tee "$C/build.log"
