#!/usr/bin/env bash
# Packs what `device.sh v` needs beside the test binaries and the GPU image lacks, into
# .cuda/x7 (carried alone in one call before `v`; device.sh's stash keeps it in /opt/kvx):
#   redis.tar.zst  this machine's redis-server and redis-cli with the libraries ldd lists
#                  (less libc, libm, libstdc++, libgcc_s and the loader, which the image
#                  has), each behind a wrapper that sets LD_LIBRARY_PATH (the remote-tier
#                  and TLS tests start their own servers);
#   whl.tar        CPython 3.12 manylinux wheels of scripts/tests/requirements.txt and
#                  their dependencies, which `v` installs with --target behind a
#                  --system-site-packages venv (.venv-test there).
# Needs redis-server (bash scripts/setup.sh installs it) and pip with PyPI reachable.
#   bash scripts/cuda/pack_test_deps.sh
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
OUTDIR=$ROOT/.cuda/x7
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
command -v redis-server >/dev/null || { echo "no redis-server here: bash scripts/setup.sh installs it" >&2; exit 1; }
command -v zstd >/dev/null || { echo "no zstd here: apt-get install zstd" >&2; exit 1; }

mkdir -p "$WORK/redis"
for tool in redis-server redis-cli; do
  bin=$(readlink -f "$(command -v "$tool")")
  cp "$bin" "$WORK/redis/$tool.bin"
  ldd "$bin" | awk '/=> \// {print $3}' | while read -r lib; do
    case $(basename "$lib") in
      libc.so*|libm.so*|libstdc++.so*|libgcc_s.so*|ld-linux*) ;;
      *) cp -n "$lib" "$WORK/redis/" ;;
    esac
  done
  printf '#!/bin/sh\nd=$(dirname "$(readlink -f "$0")")\nLD_LIBRARY_PATH="$d${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" exec "$d/%s.bin" "$@"\n' \
    "$tool" > "$WORK/redis/$tool"
  chmod +x "$WORK/redis/$tool"
done

mkdir -p "$WORK/whl"
python3 -m pip download -q -r "$ROOT/scripts/tests/requirements.txt" -d "$WORK/whl" \
  --python-version 3.12 --implementation cp --only-binary=:all: \
  --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux_2_17_x86_64 --platform any

rm -rf "$OUTDIR" && mkdir -p "$OUTDIR"
tar -C "$WORK" -cf - redis | zstd -q -19 -T2 -o "$OUTDIR/redis.tar.zst"
tar -C "$WORK" -cf "$OUTDIR/whl.tar" whl
ls -la "$OUTDIR"
du -cb "$OUTDIR"/* | tail -1
