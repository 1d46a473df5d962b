#!/usr/bin/env bash
# Packs what the GPU machine needs into .cuda/x1 .cuda/x2 ... (ignored through
# .git/info/exclude), each under the 64 MiB a `device` call may carry with the tree:
#   x1: first part of the mlx-cuda-13 wheel (zstd tar, include/ left out), tokenizer files, zstd
#   x2: the rest of the wheel, the kvstore binary, the mlx-lm wheel, the GGUF's first part
#   x3, x4, ...: the rest of the GGUF in parts, then the test binaries (only `v` and the
#   tests need the GGUF and the tests: the benchmark steps take x1 and x2)
# Inputs: .cuda/mlxcuda.tar.zst (tar -C <unpacked wheel> --exclude=mlx/include . | zstd),
# the build (scripts/cuda/build.sh), .cuda/dl/py312/mlx_lm-*.whl, models/, and
# target/goldens/smollm2-hf/tokenizer*.json.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
C=$ROOT/.cuda
# Bytes a part may take: the 64 MiB a call carries, less the tree that travels with every
# call (its tracked files: ~17 MB in session 37, with the raw results under docs/h200), 1 KiB
# a file for the archive it travels in (a header and padding: 4.4 MB for 4,261 files; a
# call with 47.9 MB of parts and 17.2 MB of tree was refused in session 38) and 0.5 MB of
# slack; BUDGET overrides it.
TREE=$(git -C "$ROOT" ls-files -z | xargs -0 stat -c %s 2>/dev/null | awk '{s+=$1+1024} END {print s+0}')
BUDGET=${BUDGET:-$(( 67108864 - TREE - 500000 ))}
BIN=$ROOT/target/cuda/release
rm -rf "$C"/x1 "$C"/x2 "$C"/x3 "$C"/x4 "$C"/x5 && mkdir -p "$C"/x1/tok "$C"/x2 "$C"/x3 "$C"/x4
cp "$ROOT"/target/goldens/smollm2-hf/{tokenizer.json,tokenizer_config.json,chat_template.jinja} "$C"/x1/tok/
# zstd for the GPU machine (its image has none): the binary and the compression libs it links
mkdir -p "$C/x1/zt" && cp /usr/bin/zstd "$C/x1/zt/"
for l in $(ldd /usr/bin/zstd | awk '/=>/{print $3}' | grep -E "zstd|lzma|lz4|libz"); do cp -L "$l" "$C/x1/zt/"; done
# mlx/include (headers: MLX's CUDA JIT needs include/cccl at run time), apart, in x2
tar -C "$C/wheel" -cf - mlx/include | zstd -q -12 -T2 -f -o "$C/include.tar.zst"
# binaries, stripped, at their absolute paths: kvstore (x2), the test executables cargo
# listed (tests.tar.zst: x3 if it fits beside the GGUF's rest, else x4)
pack_bins() { # OUT FILE...
  local out=$1; shift; local stage; stage=$(mktemp -d)
  for f in "$@"; do mkdir -p "$stage$(dirname "$f")"; cp "$f" "$stage$f"; strip "$stage$f"; done
  tar -C "$stage" -cf - . | zstd -q -10 -T2 -f -o "$out"; rm -rf "$stage"
}
pack_bins "$C/bins.tar.zst" "$BIN/kvstore"
mapfile -t tests < <(grep -o 'Executable [^(]*(\([^)]*\))' "$C/build.log" 2>/dev/null | sed 's/.*(\(.*\))/\1/' | sort -u)
if [ -z "${NOTESTS:-}" ] && [ ${#tests[@]} -gt 0 ]; then pack_bins "$C/tests.tar.zst" "${tests[@]}"; else rm -f "$C/tests.tar.zst"; fi
cp "$C"/dl/py312/mlx_lm-*.whl "$C/include.tar.zst" "$C"/x2/
cp "$C/bins.tar.zst" "$C"/x2/
tok=$(du -cb "$C"/x1/tok "$C"/x1/zt | tail -1 | cut -f1)
first=$((BUDGET - tok))
head -c "$first" "$C/mlxcuda.tar.zst" > "$C/x1/mlxcuda.tar.zst.part1"
# The rest beside x2's files; what does not fit there goes alone into xm (small: it travels
# beside the call that needs MLX, with x6 or any part; device.sh joins part*).
rm -rf "$C/xm"
second=$((BUDGET - $(du -cb "$C"/x2 | tail -1 | cut -f1)))
dd if="$C/mlxcuda.tar.zst" of="$C/x2/mlxcuda.tar.zst.part2" bs=1M skip="$first" count="$second" \
  iflag=skip_bytes,count_bytes status=none
if [ "$(stat -c %s "$C/mlxcuda.tar.zst")" -gt $((first + second)) ]; then
  mkdir -p "$C/xm"
  tail -c +$((first + second + 1)) "$C/mlxcuda.tar.zst" > "$C/xm/mlxcuda.tar.zst.part3"
fi
[ -f "$C/gguf.zst" ] || zstd -q -10 -T2 -c "$ROOT/models/SmolLM2-135M-Instruct.Q4_1.gguf" > "$C/gguf.zst"
# The GGUF: what fits beside x2's parts, the rest in parts of at most BUDGET in x3, x4, ...
# (device.sh joins gguf.zst.part*); the test binaries beside its last part if they fit.
size=$(stat -c %s "$C/gguf.zst")
cap=$((BUDGET - $(du -cb "$C"/x2 | tail -1 | cut -f1)))
off=0; n=1; d=2
while [ "$off" -lt "$size" ]; do
  if [ "$cap" -gt 0 ]; then
    take=$(( cap < size - off ? cap : size - off ))
    mkdir -p "$C/x$d"
    dd if="$C/gguf.zst" of="$C/x$d/gguf.zst.part$n" bs=1M skip="$off" count="$take" \
      iflag=skip_bytes,count_bytes status=none
    off=$((off + take)); n=$((n + 1)); cap=$((cap - take))
  fi
  [ "$off" -lt "$size" ] && { d=$((d + 1)); cap=$BUDGET; }
done
if [ -f "$C/tests.tar.zst" ]; then
  if [ $(( $(du -cb "$C/x$d" | tail -1 | cut -f1) + $(stat -c %s "$C/tests.tar.zst") )) -gt "$BUDGET" ]; then
    d=$((d + 1)); mkdir -p "$C/x$d"; fi
  cp "$C/tests.tar.zst" "$C/x$d/"
fi
du -sb "$C"/x[0-9m]*
