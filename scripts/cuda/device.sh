#!/usr/bin/env bash
# Runs on the GPU machine (the `device` tool), from the repository root there.
#   bash scripts/cuda/device.sh STEP
# Parts packed by scripts/cuda/pack.sh arrive in .cuda/x<N>/ (named in `carry`) and are
# kept in /opt/kvx, outside the synced tree, until a file is complete. The build here baked
# these absolute paths, so they are recreated there:
#   /opt/kvmlx            the unpacked mlx-cuda-13 wheel (MLX_DIR=/opt/kvmlx/mlx; rpath)
#   /opt/kvmlx/nvidia  -> python3's site-packages/nvidia (libmlx's $ORIGIN/../../nvidia rpath)
#   /work/main/target/cuda/release   the binaries (CARGO_BIN_EXE_* of the tests)
#   /work/cuda-wt, /work/wt-cuda -> this checkout (CARGO_MANIFEST_DIR of the tests)
# Steps: 1-4, mlxlm as in docs/cuda.md; a (stash, probe), b (stash, assemble MLX),
# t NAME... (some test binaries), v (every test binary, with redis-server and the openai
# client carried in x4), g / h (the 32K agent session: kvstore's arms / mlx-lm's arm, each
# its own process); pb / pc: the device-tier measurements (docs/benchmarks.md, "Device
# tier"): pb bench cache + the 8B-shaped bf16 32K prefix + 64 tokens; pc the 13-turn
# session (RUNS13=N: N times, ARMS13 its arms), then the 32K session (device arm, then mlx-lm,
# each its own process, GPU memory sampled; SKIP32=1: none); both after x1 and x2 only, on SmolLM2's shape with random weights; pd: bench
# cache's SSD read-ahead rows and bench generate (SmolLM2's shape, the 8B-shaped bf16) with
# the device sampler, after x1 and x2; pe: bench serve and the SmolLM2-shape prefill, after
# an x1 call that made $K/smollm2-rand and x2; pf: bench serve beside mlx_lm.server (peer
# wheels in x3); pg: bench trace, cache vs no cache (the trace in x3); ph: bench grammar;
# pi: Claude Code against kvstore serve (its binary in x3 and x4); pj: the ops test, bench
# cache's copy paths and the 8B 32K prefix arms (ops-test.zst in x3); pk: bench generate
# beside mlx-lm (LENS, LENS8B, CHUNK, SKIPSMOL, SKIP8B); pm: bench trace at real speed, one
# arm per process session spanning calls (ARMS, WINDOW, SPEED, SCALE, WAIT; trace in x3; each
# arm's --step-log as ARM.steps.jsonl.gz; an
# arm still running when the machine goes back, 30 s after a call ends, is lost); pn: short
# no-cache trace replays with mixed steps and MLX's CUDA graphs on and off (VARIANTS); pt: a
# short slice of the trace, full tiering then no cache, in one call (WINDOW, SCALE, ARMS:
# cache, nocache, always: --restore always, devonly: the device tier alone, no publication,
# exclusive: full tiering, --device-tier exclusive,
# ramonly: device and RAM tiers, no SSD, bigcache: full tiering with a 16 GiB MLX buffer cache;
# XARGS: more bench trace options for every arm, e.g. --prefill-chunk 2048; ARM+TAG: ARM with the
# variables of ENV_TAG and the flags of ARGS_TAG, e.g. cache+t16 with ENV_t16="KVSTORE_TRANSFER_THREADS=16"); pw: the 8B decode
# under each step wait and mlx-lm, then bench serve's interleave part under chunk budgets;
# pr: block memory's restores in place and publications written into it against the default
# (bench cache's block rows, the 32K session's RAM arm each way beside mlx-lm); st: stash a carried part only; ai: AIPerf beside bench trace --url (aiperf_pack.sh's parts);
# gg: kvstore generate's greedy tokens on the GPU for each of MODELS (after x1, x2, xm);
# ct: the 8B decode's GPU timeline through CUPTI (cupti_trace.c), kvstore (CT_VARIANTS) and
# mlx-lm (after x1, x2, xm, xc);
# nk: every kernel of the 8B decode timed by Nsight Compute, kvstore and mlx-lm (after x1, x2, xm);
# nq: Nsight Compute's sections (occupancy, warp states, memory) for kvstore's decode
# attention kernels and mlx-lm's cuDNN attention at PROMPT tokens (after x1, x2, xm);
# ns: the 8B decode's GPU timeline by Nsight Systems, kvstore and mlx-lm: where the GPU waits
# inside a step (scripts/bench/gpu_gaps.py; after x1, x2, xm);
# gs: the 8B decode beside mlx-lm under settings of MLX's CUDA graphs (GRAPHS); hd: the 8B
# decode with host work spun after each queued step, kvstore and mlx-lm (SPINS), and what a
# new attention or product shape costs MLX on the host (shape_cost_probe.py).
# "After x1 and x2" means with MLX's parts all stashed: x1, x2 and, where pack.sh made
# one, xm (MLX's rest, 0.2 MB in session 38, carried beside any call).
set -uo pipefail
# the image has no zstd: x1 carries one (x1/zt), kept in /opt/kvx/zt
if ! command -v zstd >/dev/null; then
  [ -x .cuda/x1/zt/zstd ] && mkdir -p /opt/kvx/zt && cp .cuda/x1/zt/* /opt/kvx/zt/
  zstd() { LD_LIBRARY_PATH=/opt/kvx/zt /opt/kvx/zt/zstd "$@"; }
fi
REPO=$(pwd)
K=/opt/kvx
OUT=${OUT:-/tmp/out}
BIN=/work/main/target/cuda/release
mkdir -p "$K" "$OUT"
step=${1:?step}
# the trace replays' full-tiering budgets (pm, pt): device KV, RAM, SSD (64 GiB disk there)
TIERS=${TIERS:---kv-budget 16GiB --ram-budget 48GiB --ssd-budget 36GiB}
START=$(date +%s)

settings_tag() { # a GRAPHS entry as a file-name part: `=` and spaces as `_` (the device tool
  # leaves out names with odd characters), "default" for none
  echo "${1:-default}" | tr -c 'A-Za-z0-9\n' '_' | cut -c1-60
}

ncu_path() { # Nsight Compute's ncu, or a message and failure where the machine has none
  local p
  p=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
  [ -n "$p" ] || { echo "no ncu on this machine" >&2; return 1; }
  echo "$p"
}

split_arm() { # ARM+TAG: sets base (ARM), tag (TAG or empty), EV (ENV_TAG's value), XA (ARGS_TAG's)
  base=${1%%+*}; tag=""; EV=""; XA=""
  if [ "$base" != "$1" ]; then
    tag=${1#*+}; local ev="ENV_$tag" xa="ARGS_$tag"; EV="${!ev:-}"; XA="${!xa:-}"
  fi
}

stash() { # copy the parts that came with this call (and x1's tokenizer files, to $K/tok)
  for d in .cuda/x*; do [ -d "$d" ] && find "$d" -maxdepth 1 -type f -exec cp {} "$K"/ \; ; done
  [ -d .cuda/x1/tok ] && mkdir -p "$K/tok" && cp .cuda/x1/tok/* "$K/tok/"
  ls -la "$K"
}

install_wheels() { # SITE: the wheels of the tar on stdin, installed offline into $K/SITE
  rm -rf "$K/$1-whl" && mkdir -p "$K/$1-whl" && tar -xf - -C "$K/$1-whl" &&
    python3 -m pip install -q --no-index --no-deps --no-compile --target "$K/$1" "$K/$1-whl"/*.whl 2>&1 |
    grep -v "as the 'root' user" | tail -n 3
}

env_setup() {
  SP=$(python3 -c 'import site; print(site.getsitepackages()[0])')
  export PYTHONPATH=/opt/kvmlx:$K/site
  [ -d /usr/local/cuda ] && export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
  export PATH=$BIN:$PATH
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
}

make_smollm2_rand() { # DIR: SmolLM2's shape with random f32 weights and its tokenizer
  # (random_smollm2.py; the tokenizer files x1 carries, stashed in $K/tok), made once
  [ -f "$1/config.json" ] || python3 scripts/cuda/random_smollm2.py "$1" "$K/tok" >/dev/null
  [ -f "$1/tokenizer.json" ] || cp "$K"/tok/* "$1/"
}
make_llama8b() { # the 8B-shaped bf16 checkpoint (docs/cuda.md), made once in $K/llama8b
  local tok=$K/tok
  [ -d "$tok" ] || tok=.cuda/x1/tok
  [ -f "$K/llama8b/config.json" ] || python3 scripts/cuda/random_llama.py "$K/llama8b" "$tok"
  [ -f "$K/llama8b/tokenizer.json" ] || cp "$tok"/* "$K/llama8b/"
}

assemble_mlx() {
  env_setup
  if [ ! -f /opt/kvmlx/mlx/lib/libmlx.so ]; then
    mkdir -p /opt/kvmlx
    cat "$K"/mlxcuda.tar.zst.part* | zstd -d -q | tar -x -C /opt/kvmlx || { echo "mlx parts incomplete"; return 1; }
    ln -sfn "$SP/nvidia" /opt/kvmlx/nvidia
  fi
  # mlx/include travels apart (.cuda/inc): MLX's CUDA JIT (NVRTC) reads the bundled CCCL
  # headers from <libmlx>/../include/cccl
  if [ ! -d /opt/kvmlx/mlx/include/cccl ]; then
    zstd -d -q -c "$K/include.tar.zst" | tar -x -C /opt/kvmlx || return 1
  fi
  if [ ! -x "$BIN/kvstore" ] || [ "$K/bins.tar.zst" -nt "$BIN/kvstore" ]; then
    zstd -d -q -c "$K"/bins.tar.zst | tar -x -C / || return 1; touch "$BIN/kvstore"
  fi
  if [ ! -d "$K/site/mlx_lm" ]; then
    mkdir -p "$K/site" && python3 -m zipfile -e "$K"/mlx_lm-*.whl "$K/site"
  fi
  # CARGO_MANIFEST_DIR of the tests: the worktree they were built from (docs/cuda.md)
  for w in /work/cuda-wt /work/wt-cuda /tmp/wt; do [ -e "$w" ] || { mkdir -p /work; ln -sfn "$REPO" "$w"; }; done
  ldd /opt/kvmlx/mlx/lib/libmlx.so | grep -E "not found|cuda|cublas|nccl|cudnn" | head -20
  python3 -c 'import mlx.core as mx; print("python mlx", mx.__version__, mx.default_device(), (mx.ones(4)*2).sum().item())'
}

assemble_tests() {
  if [ -f "$K/tests.tar.zst" ] && { [ ! -f "$K/tests.done" ] || [ "$K/tests.tar.zst" -nt "$K/tests.done" ]; }; then
    zstd -d -q -c "$K/tests.tar.zst" | tar -x -C / && tar -tf <(zstd -d -q -c "$K/tests.tar.zst") | grep -v '/$' | sed 's|^\.||' > "$K/tests.done"
  fi
  [ -f "$K/tests.done" ]
}

assemble_gguf() {
  local g=$REPO/models/SmolLM2-135M-Instruct.Q4_1.gguf
  if [ ! -f "$g" ]; then
    mkdir -p "$REPO/models"
    cat "$K"/gguf.zst.part* | zstd -d -q -o "$g" || { rm -f "$g"; echo "gguf parts incomplete"; return 1; }
  fi
  sha256sum "$g"
  [ -f "$K/smollm2-hf/model.safetensors" ] || python3 scripts/cuda/smollm2_hf.py "$K/smollm2-hf" 2>&1 | tail -2
  mkdir -p "$REPO/target/goldens" && ln -sfn "$K/smollm2-hf" "$REPO/target/goldens/smollm2-hf"
}

# One test thread by default: MLX's CUDA backend captures library calls into graphs in
# global capture mode, and tests that drive MLX from several threads at once abort in
# cudaStreamEndCapture (seen on the H100, session 41; docs/cuda.md "Tests on the GPU").
run_tests() { # test binaries ($@, default all), each under a time limit; rc line per binary
  local list=("$@"); [ ${#list[@]} -gt 0 ] || list=("$BIN"/deps/*)
  for t in "${list[@]}"; do
    [ -x "$t" ] && [ -f "$t" ] || continue
    if [ "$(date +%s)" -gt "${DEADLINE:-9999999999}" ]; then echo "=== skipped (deadline) $(basename "$t")"; echo "$t" >> "$K/failed.txt"; continue; fi
    case "$t" in *.so|*.d|*.rlib|*.rmeta) continue ;; esac
    echo "=== $(basename "$t")"
    (cd "$REPO" && timeout "${TEST_LIMIT:-400}" "$t" --test-threads="${TEST_THREADS:-1}" ${NOCAP:+--nocapture} ${FILTER:-} 2>&1) | tail -n "${TAIL:-60}"
    local rc=${PIPESTATUS[0]}
    echo "=== rc=$rc $(basename "$t")"
    [ "$rc" = 0 ] || echo "$t" >> "$K/failed.txt"
  done
}

case "$step" in
  1)
    stash
    nvidia-smi -L; nvidia-smi --query-gpu=driver_version,memory.total,clocks.sm,clocks.mem --format=csv
    echo "repo: $REPO"; uname -r; nproc; df -h / "$REPO" /tmp | tail -3
    env_setup; echo "site-packages: $SP"; ls "$SP/nvidia"; ls -d "$SP"/nvidia/*/lib | head -20; ls "$SP"/nvidia/cu13/lib 2>/dev/null | head -40
    which nvcc; nvcc --version | tail -2; ls /usr/local/cuda/include/cuda_runtime.h 2>&1
    python3 -c 'import transformers, tokenizers, huggingface_hub, numpy; print(transformers.__version__, tokenizers.__version__, huggingface_hub.__version__, numpy.__version__)'
    make_llama8b
    ls -la "$K/llama8b"
    ;;
  2)
    stash
    assemble_mlx || exit 1
    { "$BIN/kvstore" bench mlx 2>&1; } | tee "$OUT/bench-mlx.log"
    { "$BIN/kvstore" bench cache 2>&1; } | tee "$OUT/bench-cache.log"
    { "$BIN/kvstore" bench store --dir /opt/kvx 2>&1; } | tee "$OUT/bench-store.log"
    ;;
  3)
    stash
    assemble_mlx >/dev/null || exit 1
    assemble_gguf || exit 1
    env_setup
    { "$BIN/kvstore" bench generate --python "$(command -v python3)" --prompt-lens 512,2048,8000 --decode-tokens 128 2>&1; } | tee "$OUT/bench-generate-smollm2.log"
    { "$BIN/kvstore" bench generate --model "$K/llama8b" --keep-quantized --skip-mlx-lm --prompt-lens 512,2048,8192 --decode-tokens 64 2>&1;
      python3 scripts/goldens/bench_mlx_lm.py "$K/llama8b" 512,2048,8192 64 stored 2>&1; } | tee "$OUT/bench-generate-llama8b.log"
    { "$BIN/kvstore" bench agent --python "$(command -v python3)" --mlx-lm-model "$K/smollm2-hf" --out "$OUT/agent-smollm2" 2>&1; } | tee "$OUT/bench-agent.log"
    if assemble_tests; then
      rm -f "$K/failed.txt"; mapfile -t all < "$K/tests.done"
      { DEADLINE=$((START + ${BUDGET_S:-540})) TEST_LIMIT=150 run_tests "${all[@]}"; } > "$OUT/tests.log" 2>&1
      grep -E "^=== (rc|skipped)|^test result|FAILED|panicked" "$OUT/tests.log" | head -80
    fi
    ;;
  mlxlm) # mlx-lm's side alone (python), same prompts as step 3
    stash >/dev/null
    assemble_mlx || exit 1
    assemble_gguf || exit 1
    python3 -c 'import mlx.core as mx; a=mx.arange(10.0); print("gather", a[mx.array([1,3])].tolist())'
    { python3 scripts/goldens/bench_mlx_lm.py "$K/smollm2-hf" 512,2048,8000 128 f32 2>&1; } | tee "$OUT/mlxlm-smollm2.log"
    { python3 scripts/goldens/bench_mlx_lm.py "$K/llama8b" 512,2048,8192 64 stored 2>&1; } | tee "$OUT/mlxlm-llama8b.log"
    ;;
  4)
    stash >/dev/null
    assemble_mlx >/dev/null || exit 1
    assemble_gguf >/dev/null || exit 1
    env_setup
    # SmolLM2 weights, context raised to 64K (the GGUF says 8192), so a session can grow to 32K.
    d=$K/smollm2-64k; mkdir -p "$d"
    for f in "$K"/smollm2-hf/*; do ln -sfn "$f" "$d/"; done; rm -f "$d/config.json"
    python3 -c "import json,sys; c=json.load(open('$K/smollm2-hf/config.json')); c['max_position_embeddings']=65536; json.dump(c,open('$d/config.json','w'))"
    { timeout ${AGENT_LIMIT:-330} "$BIN/kvstore" bench agent --model "$d" --python "$(command -v python3)" --mlx-lm-model "$d" --turns "${TURNS:-110}" --out "$OUT/agent-32k" 2>&1; } | tee "$OUT/bench-agent-32k.log"
    # the test binaries not run or failed in step 3 (all of them if they came only now)
    again=()
    if [ -f "$K/tests.done" ]; then [ -f "$K/failed.txt" ] && mapfile -t again < "$K/failed.txt"
    elif assemble_tests; then mapfile -t again < "$K/tests.done"; fi
    rm -f "$K/failed.txt"
    [ ${#again[@]} -gt 0 ] && { DEADLINE=$((START + ${BUDGET_S:-540})) TEST_LIMIT=200 run_tests "${again[@]}"; } > "$OUT/tests-with-model.log" 2>&1
    grep -E "^=== rc|^test result|FAILED|panicked" "$OUT/tests-with-model.log" | head -60
    ;;
  a)
    stash >/dev/null; du -sh "$K"; nvidia-smi -L; nvidia-smi --query-gpu=driver_version,memory.total,memory.used --format=csv
    ;;
  b)
    stash >/dev/null; du -sh "$K"
    assemble_mlx || exit 1
    ;;
  t) # test binaries given as arguments (names under deps/), full logs; the GGUF only where
     # its parts came (the cache's unit tests need none); FILTER: a test-name filter
    stash >/dev/null
    assemble_mlx >/dev/null || exit 1
    assemble_gguf >/dev/null 2>&1 || echo "no GGUF here: tests that load it will fail"
    [ -e "$K/smollm2-hf" ] && mkdir -p "$REPO/target/goldens" && ln -sfn "$K/smollm2-hf" "$REPO/target/goldens/smollm2-hf"
    env_setup; assemble_tests || exit 1
    shift; list=(); for n in "$@"; do list+=("$BIN/deps/$n"); done
    NOCAP=1 TAIL=1000000 TEST_LIMIT=300 run_tests "${list[@]}" > "$OUT/tests-t.log" 2>&1
    grep -E "^=== rc|^test result|FAILED|panicked|allowed|near ties" "$OUT/tests-t.log" | head -100
    ;;
  g|h) # 32K agent session: g = kvstore's arms, h = mlx-lm's arm, separate processes
    stash >/dev/null
    assemble_mlx >/dev/null || exit 1
    assemble_gguf >/dev/null || exit 1
    env_setup
    d=$K/smollm2-64k; mkdir -p "$d"
    for f in "$K"/smollm2-hf/*; do ln -sfn "$f" "$d/"; done; rm -f "$d/config.json"
    python3 -c "import json,sys; c=json.load(open('$K/smollm2-hf/config.json')); c['max_position_embeddings']=65536; json.dump(c,open('$d/config.json','w'))"
    nvidia-smi --query-gpu=timestamp,memory.used,utilization.gpu --format=csv,noheader,nounits -lms 2000 > "$OUT/gpumem-$step.csv" 2>&1 &
    smi=$!
    if [ "$step" = g ]; then arms=cold,ram,ssd; name=kv; else arms=mlx-lm; name=mlxlm; fi
    { timeout ${LIMIT:-560} "$BIN/kvstore" bench agent --model "$d" --python "$(command -v python3)" --mlx-lm-model "$d" --arms $arms --turns "${TURNS:-75}" --out "$OUT/agent32k-$name" 2>&1; } > "$OUT/agent32k-$name.log"
    echo "rc=$? $(( $(date +%s) - START ))s"; tail -n 14 "$OUT/agent32k-$name.log"
    kill $smi
    echo "GPU memory used, max MiB: $(cut -d, -f2 "$OUT/gpumem-$step.csv" | sort -n | tail -1)"
    ;;
  pb|pc) # device-tier measurements, after x1 and x2 (no GGUF: SmolLM2's shape, random weights)
    stash >/dev/null
    assemble_mlx >/dev/null || exit 1
    env_setup
    py=$(command -v python3)
    mem() { nvidia-smi --query-gpu=timestamp,memory.used,utilization.gpu --format=csv,noheader,nounits -lms 1000 > "$OUT/gpumem-$1.csv" 2>&1 & echo $!; }
    peak() { echo "GPU memory used, max MiB ($1): $(cut -d, -f2 "$OUT/gpumem-$1.csv" | sort -n | tail -1)"; }
    if [ "$step" = pb ]; then
      { timeout 150 "$BIN/kvstore" bench cache 2>&1; } | tee "$OUT/bench-cache.log"
      make_llama8b
      s=$(mem llama8b)
      { timeout 400 "$BIN/kvstore" bench agent --model "$K/llama8b" --keep-quantized --python "$py" \
          --mlx-lm-model "$K/llama8b" --synthetic 32768,64 --arms cold,device,ram,ssd,mlx-lm \
          --kv-budget 24GiB --out "$OUT/agent-8b-32k" 2>&1; } > "$OUT/agent-8b-32k.log"
      kill $s; tail -n 14 "$OUT/agent-8b-32k.log"; peak llama8b
    else
      # SmolLM2's shape with random f32 weights and its own tokenizer (no GGUF to carry).
      d=$K/smollm2-rand
      make_smollm2_rand "$d"
      # RUNS13=N: the 13-turn session N times (agent13-1, -2, ...; ARMS13 its arms); SKIP32=1:
      # no 32K session after it
      for i in $(seq 1 "${RUNS13:-1}"); do
        tag=agent13; [ -n "${RUNS13:-}" ] && tag=agent13-$i
        { timeout 150 "$BIN/kvstore" bench agent --model "$d" --python "$py" --mlx-lm-model "$d" \
            --arms ${ARMS13:-cold,device,ram,ssd,mlx-lm} --out "$OUT/$tag" 2>&1; } > "$OUT/$tag.log"
        tail -n 26 "$OUT/$tag.log"
      done
      if [ -n "${SKIP32:-}" ]; then echo "step $step: $(( $(date +%s) - START ))s"; exit 0; fi
      s=$(mem device)
      { timeout ${LIMIT32:-300} "$BIN/kvstore" bench agent --model "$d" --python "$py" --mlx-lm-model "$d" \
          --arms ${ARMS32:-device} --turns "${TURNS:-75}" --kv-budget 4GiB --out "$OUT/agent32k-device" 2>&1; } > "$OUT/agent32k-device.log"
      kill $s; tail -n 8 "$OUT/agent32k-device.log"; peak device
      s=$(mem mlxlm)
      { timeout 200 "$BIN/kvstore" bench agent --model "$d" --python "$py" --mlx-lm-model "$d" \
          --arms mlx-lm --turns "${TURNS:-75}" --out "$OUT/agent32k-mlxlm" 2>&1; } > "$OUT/agent32k-mlxlm.log"
      kill $s; tail -n 6 "$OUT/agent32k-mlxlm.log"; peak mlxlm
    fi
    echo "step $step: $(( $(date +%s) - START ))s"
    ;;
  pr) # block memory (KVSTORE_PINNED_BLOCKS_MIB=8192): restores from RAM read in place (one
      # gather node per layer part) and publications written into it (one node), against the
      # default: bench cache's block rows with publications written in place and copied (the
      # rows check every published plane against the appended keys and values, and the staged
      # restore's bytes against the batch restore's), then the 32K session's RAM arm each way,
      # after x1 and x2 (SmolLM2's shape, random weights); PINNED: the arms (default
      # "8192 8192c 0": block memory with publications written into it and mlx-lm beside it,
      # the same with publications copied and split, none); SKIP32: bench cache only
    stash >/dev/null
    assemble_mlx >/dev/null || exit 1
    env_setup
    py=$(command -v python3)
    # pub1: publications written into block memory; pub0: copied (CopyTokenRuns, two kernels
    # for 60 parts: the race session 48 found under CUDA graphs) and split into it; off: no
    # block memory at all (the copies and the assembling restore)
    for pub in 1 0 off; do
      mib=8192; [ "$pub" = off ] && mib=0
      { KVSTORE_PINNED_BLOCKS_MIB=$mib KVSTORE_PUBLISH_IN_PLACE=${pub/off/1} timeout 150 "$BIN/kvstore" bench cache \
          --only blocks 2>&1; } | tee "$OUT/bench-cache-blocks-pub$pub.log" | tail -n 9
    done
    [ -n "${SKIP32:-}" ] && { echo "step $step: $(( $(date +%s) - START ))s"; exit 0; }
    d=$K/smollm2-rand
    make_smollm2_rand "$d"
    # an arm: MiB of block memory, "c" after it: publications copied and split as before
    for arm in ${PINNED:-8192 8192c 0}; do
      pinned=${arm%c}; pub=1; [ "$pinned" != "$arm" ] && pub=0
      arms=${ARMSR:-ram,mlx-lm}; [ "$arm" != 8192 ] && arms=ram
      { KVSTORE_PINNED_BLOCKS_MIB=$pinned KVSTORE_PUBLISH_IN_PLACE=$pub timeout ${LIMIT32:-240} "$BIN/kvstore" \
          bench agent --model "$d" --python "$py" --mlx-lm-model "$d" --arms "$arms" --turns "${TURNS:-75}" \
          --kv-budget 4GiB --out "$OUT/agent32k-pinned-$arm" 2>&1; } > "$OUT/agent32k-pinned-$arm.log"
      echo "== KVSTORE_PINNED_BLOCKS_MIB=$pinned KVSTORE_PUBLISH_IN_PLACE=$pub"; tail -n 5 "$OUT/agent32k-pinned-$arm.log"
    done
    echo "step $step: $(( $(date +%s) - START ))s"
    ;;
  pd) # SSD read-ahead and the pipelined device-sampled decode, after x1 and x2 (no GGUF)
    stash >/dev/null
    assemble_mlx >/dev/null || exit 1
    env_setup
    py=$(command -v python3)
    { timeout 120 "$BIN/kvstore" bench cache --only ssd --dir "$K" 2>&1; } | tee "$OUT/bench-cache-ssd.log"
    d=$K/smollm2-rand
    make_smollm2_rand "$d"
    { timeout 200 "$BIN/kvstore" bench generate --model "$d" --python "$py" --prompt-lens ${LENS:-512,2048,8000} \
        --decode-tokens 128 2>&1; } | tee "$OUT/bench-generate-smollm2.log" | tail -n 12
    [ -n "${SKIP8B:-}" ] && { echo "step $step: $(( $(date +%s) - START ))s"; exit 0; }
    make_llama8b
    { timeout 240 "$BIN/kvstore" bench generate --model "$K/llama8b" --keep-quantized --skip-mlx-lm \
        --prompt-lens 512,2048,8192 --decode-tokens 64 2>&1;
      timeout 200 python3 scripts/goldens/bench_mlx_lm.py "$K/llama8b" 512,2048,8192 64 stored 2>&1; } \
        | tee "$OUT/bench-generate-llama8b.log" | tail -n 20
    echo "step $step: $(( $(date +%s) - START ))s"
    ;;
  pe) # the serving engine under load (bench serve) and SmolLM2-shape prefill, after x1 and x2
    stash >/dev/null
    assemble_mlx >/dev/null || exit 1
    env_setup
    d=$K/smollm2-rand
    make_smollm2_rand "$d"
    { timeout 60 "$BIN/kvstore" bench generate --model "$d" --skip-mlx-lm --prompt-lens 2048,8000 \
        --decode-tokens 32 2>&1; } | tail -n 4
    { timeout 200 "$BIN/kvstore" bench serve --model "$d" --streams 8 --stream-tokens 256 \
        --long-prompt 8192 --sessions 16 --turns 4 --json "$OUT/bench-serve.json" 2>&1; } | tail -n 6
    echo "step $step: $(( $(date +%s) - START ))s"
    ;;
  pk) # decode and prefill beside mlx-lm (bench generate; LENS, SKIPSMOL, SKIP8B), with a
      # bench_mlx_lm.py carried in x3 when one is (a variant that prints each pass), after x1, x2
    stash >/dev/null
    assemble_mlx >/dev/null || exit 1
    env_setup
    py=$(command -v python3)
    script=scripts/goldens/bench_mlx_lm.py
    [ -f .cuda/x3/bench_mlx_lm.py ] && script=.cuda/x3/bench_mlx_lm.py
    d=$K/smollm2-rand
    if [ -z "${SKIPSMOL:-}" ]; then
      { timeout 200 "$BIN/kvstore" bench generate --model "$d" --skip-mlx-lm --prompt-lens ${LENS:-2048,8000} \
          --decode-tokens 128 ${CHUNK:+--prefill-chunk $CHUNK} 2>&1;
        timeout 200 python3 "$script" "$d" ${LENS:-2048,8000} 128 2>&1; } | tee "$OUT/bench-generate-smollm2.log" | tail -n 30
    fi
    [ -n "${SKIP8B:-}" ] && { echo "step $step: $(( $(date +%s) - START ))s"; exit 0; }
    make_llama8b
    { timeout 240 "$BIN/kvstore" bench generate --model "$K/llama8b" --keep-quantized --skip-mlx-lm \
        --prompt-lens ${LENS8B:-512,2048} --decode-tokens 64 2>&1;
      timeout 200 python3 "$script" "$K/llama8b" ${LENS8B:-512,2048} 64 stored 2>&1; } \
        | tee "$OUT/bench-generate-llama8b.log" | tail -n 30
    echo "step $step: $(( $(date +%s) - START ))s"
    ;;
  pj) # direct host<->device copies and publication off the engine thread: the mlx ops test
      # binary (carried as ops-test.zst), bench cache's blocks part (both copy paths), the
      # 8B-shaped bf16 32K prefix (arms cold,device,ram,ssd; no mlx-lm), after x1 and x2
    stash >/dev/null
    assemble_mlx >/dev/null || exit 1
    env_setup
    if [ -f "$K/ops-test.zst" ]; then
      zstd -d -q -f -o "$K/ops-test" "$K/ops-test.zst" && chmod +x "$K/ops-test"
      { timeout 120 "$K/ops-test" --test-threads 1 2>&1; } | grep -E "^test |test result|panicked" | tail -n 25
    fi
    { timeout 120 "$BIN/kvstore" bench cache --only blocks 2>&1; } | tee "$OUT/bench-cache-blocks.log"
    make_llama8b
    { timeout ${LIMIT:-300} "$BIN/kvstore" bench agent --model "$K/llama8b" --keep-quantized \
        --synthetic 32768,64 --arms cold,device,ram,ssd --kv-budget 24GiB --out "$OUT/agent-8b-32k" 2>&1; } > "$OUT/agent-8b-32k.log"
    tail -n 14 "$OUT/agent-8b-32k.log"
    echo "step $step: $(( $(date +%s) - START ))s"
    ;;
  pp) # the transfer pool's threads on bulk copies: bench cache's blocks part (publish and
      # restore in bulk, both copy paths) under each of POOLS (KVSTORE_TRANSFER_THREADS
      # values; "default": the shipped quarter of the cores), after x1 and x2
    stash >/dev/null
    assemble_mlx >/dev/null || exit 1
    env_setup
    for t in ${POOLS:-default 16}; do
      E=""; [ "$t" = default ] || E="KVSTORE_TRANSFER_THREADS=$t"
      echo "== transfer threads: $t"
      { env $E timeout ${LIMIT:-60} "$BIN/kvstore" bench cache --only blocks 2>&1; } > "$OUT/bench-cache-blocks-$t.log"
      grep -A8 "publish / restore in bulk" "$OUT/bench-cache-blocks-$t.log"
    done
    echo "step $step: $(( $(date +%s) - START ))s"
    ;;
  pl) # bulk restore and SSD -> device copies (bench cache blocks, ssd), then the trace's
      # no-cache arm with the batch arena off and on (ARENAS, default "0 1"), after x1 and x2
    stash >/dev/null
    assemble_mlx >/dev/null || exit 1
    env_setup
    { timeout 150 "$BIN/kvstore" bench cache ${CACHEPARTS:---only blocks --only ssd} --dir "$K" 2>&1; } | tee "$OUT/bench-cache-restore.log"
    d=$K/smollm2-rand
    T=$K/mooncake-conversation-part1.jsonl
    S="--window ${WINDOW:-0..60} --speed ${SPEED:-0.5} --token-scale ${SCALE:-0.125} --max-concurrency 16 --max-batch 16"
    if [ -f "$T" ]; then
      for a in ${ARENAS:-0 1}; do
        { KVSTORE_BATCH_ARENA=$a timeout 200 "$BIN/kvstore" bench trace "$T" --model "$d" $S --no-cache \
            --mlx-cache-limit "${CL:-1GiB}" --label "no cache, arena $a, MLX cache ${CL:-1GiB}" \
            --json "$OUT/trace-nocache-arena$a.json" 2>&1; } | tail -n 8
      done
    fi
    echo "step $step: $(( $(date +%s) - START ))s"
    ;;
  pf) # bench serve, in process and over HTTP beside mlx_lm.server (mlx-lm 0.32.2 and its
      # dependencies carried as .cuda/x3/peer.tar: 0.28.4's server fails on MLX 0.32.4; made
      # here with `pip download "mlx-lm==0.32.2" sentencepiece protobuf pyyaml jinja2
      # --python-version 3.12 --only-binary=:all: --platform manylinux_2_28_x86_64 --platform
      # manylinux2014_x86_64 --platform manylinux_2_17_x86_64 -d W`, numpy's wheel removed
      # (the machine has one), then `tar -cf .cuda/x3/peer.tar -C W .`),
      # after x1 (which made $K/smollm2-rand) and x2
    stash >/dev/null
    assemble_mlx >/dev/null || exit 1
    env_setup
    d=$K/smollm2-rand
    make_smollm2_rand "$d"
    [ -d "$K/peersite/mlx_lm" ] || install_wheels peersite < "$K/peer.tar"
    printf '#!/bin/sh\nPYTHONPATH=/opt/kvmlx:%s exec python3 "$@"\n' "$K/peersite" > "$K/peer-python"
    chmod +x "$K/peer-python"
    "$K/peer-python" -c 'import mlx_lm, mlx.core as mx; print("peer mlx-lm", mlx_lm.__version__, mx.default_device())' || exit 1
    { timeout ${LIMIT:-480} "$BIN/kvstore" bench serve --model "$d" --peer-python "$K/peer-python" \
        --streams 8 --stream-tokens 256 --long-prompt 8192 --sessions 16 --turns 4 \
        --json "$OUT/bench-serve.json" 2>&1; } | grep -v '^ ' | tail -n 12
    echo "step $step: $(( $(date +%s) - START ))s"
    ;;
  pg) # bench trace on the Mooncake slice (trace carried in x3), cache vs no cache, after pf
    stash >/dev/null
    assemble_mlx >/dev/null || exit 1
    env_setup
    d=$K/smollm2-rand
    T=$K/mooncake-conversation-part1.jsonl
    S="--window ${WINDOW:-0..120} --speed ${SPEED:-1} --token-scale ${SCALE:-0.25} --max-concurrency 16 --max-batch 16"
    { timeout 280 "$BIN/kvstore" bench trace "$T" --model "$d" $S --budget-tokens 1000000 \
        --label cache --json "$OUT/trace-cache.json" 2>&1; } | tail -n 14
    { timeout 280 "$BIN/kvstore" bench trace "$T" --model "$d" $S --no-cache \
        --label "no cache" --json "$OUT/trace-nocache.json" 2>&1; } | tail -n 8
    echo "step $step: $(( $(date +%s) - START ))s"
    ;;
  pm) # bench trace at real speed, one arm at a time, each in its own process session
      # (setsid: it outlives the call), so a 10-minute slice spans calls. Each call waits
      # for the running arm (at most WAIT s), starts the next arm of ARMS that has not run
      # when none runs, and copies every finished arm's log, JSON and plot to $OUT.
      # MODEL=llama8b replays with the 8B-shaped bf16 checkpoint (made in $K the first time).
      # Arms: cache (full tiering), nocache, device (device tier only), exclusive (full
      # tiering, --device-tier exclusive), arrival (full tiering, --prefill-order arrival:
      # the order before fewest-new became the default), arrivalnocache (no cache,
      # arrival); fewest and fewestnocache name fewest-new explicitly (the default now).
    stash >/dev/null
    assemble_mlx >/dev/null || exit 1
    env_setup
    d=$K/smollm2-rand
    make_smollm2_rand "$d"
    MARGS=""
    if [ "${MODEL:-smollm2}" = llama8b ]; then # the 8B-shaped bf16 checkpoint (made once)
      make_llama8b
      d=$K/llama8b; MARGS="--keep-quantized"
    fi
    T=$K/mooncake-conversation-part1.jsonl
    R=$K/trace-runs; mkdir -p "$R"
    S="--window ${WINDOW:-0..600} --speed ${SPEED:-1} --token-scale ${SCALE:-0.125} --max-concurrency ${CONC:-64} --max-batch ${BATCH:-16} --deadline ${DEADLINE_S:-630}"
    running() { [ -f "$R/pid" ] && kill -0 "$(cat "$R/pid")" 2>/dev/null; }
    # The no-cache arms get the cache arms' device KV budget (live sequences only there):
    # before session 28 they ran with bench trace's 4 GiB default against 16 GiB.
    KV=$(grep -o -- '--kv-budget [^ ]*' <<< "$TIERS")
    end=$(( $(date +%s) + ${WAIT:-540} ))
    for arm in ${ARMS:-cache nocache}; do
      [ -f "$R/$arm.started" ] && continue
      while running && [ "$(date +%s)" -lt "$end" ]; do sleep 5; done
      running && break
      # ARM+TAG runs ARM with the variables of ENV_TAG set and the bench flags of ARGS_TAG
      # added (e.g. nocache+ws with ARGS_ws="--pass-workspace 1TiB", the passes unbounded):
      # an A/B in one binary and one lease.
      split_arm "$arm"
      case "$base" in
        nocache) A="--no-cache $KV --label no-cache" ;;
        device) A="--kv-budget 16GiB --ram-budget 0 --ssd-budget 0 --label device-only" ;;
        exclusive) rm -rf "$K/tstore"; A="$TIERS --device-tier exclusive --store $K/tstore --label full-tiering-exclusive --no-flush" ;;
        fewest) rm -rf "$K/tstore"; A="$TIERS --prefill-order fewest-new --store $K/tstore --label full-tiering-fewest-new --no-flush" ;;
        fewestnocache) A="--no-cache $KV --prefill-order fewest-new --label no-cache-fewest-new" ;;
        arrival) rm -rf "$K/tstore"; A="$TIERS --prefill-order arrival --store $K/tstore --label full-tiering-arrival --no-flush" ;;
        arrivalnocache) A="--no-cache $KV --prefill-order arrival --label no-cache-arrival" ;;
        *) rm -rf "$K/tstore"; A="$TIERS --store $K/tstore --label full-tiering --no-flush" ;;
      esac
      touch "$R/$arm.started"
      A="$A $XA"
      echo "starting $arm at $(date +%T): $EV $S $A"
      # GPU memory (MiB) and utilization (%) each second beside the arm (the 5/8-scale arm of session 30 failed steps
      # with CUDA out of memory far below the GPU's size): $arm.gpumem.csv.
      setsid bash -c "nvidia-smi --query-gpu=timestamp,memory.used,utilization.gpu --format=csv,noheader,nounits -lms 1000 > '$R/$arm.gpumem.csv' 2>&1 & G=\$!; env $EV '$BIN/kvstore' bench trace '$T' --model '$d' $MARGS $S $A --json '$R/$arm.json' --svg '$R/$arm.svg' --step-log '$R/$arm.steps.jsonl' > '$R/$arm.log' 2>&1; echo rc=\$? >> '$R/$arm.log'; gzip -f '$R/$arm.steps.jsonl'; kill \$G; touch '$R/$arm.done'" </dev/null >/dev/null 2>&1 &
      echo $! > "$R/pid"
    done
    while running && [ "$(date +%s)" -lt "$end" ]; do sleep 5; done
    for f in "$R"/*.log; do [ -f "$f" ] || continue; echo "== $f"; grep -E '^request .* at ' "$f" | tail -n 1; tail -n 12 "$f"; done
    cp "$R"/*.json "$R"/*.svg "$R"/*.log "$R"/*.csv "$R"/*.steps.jsonl.gz "$OUT"/ 2>/dev/null
    running && echo "still running: $(cat "$R/pid")"
    free -g | head -2; df -h /opt | tail -1
    echo "step $step: $(( $(date +%s) - START ))s"
    ;;
  cr) # the publication node on the GPU, after x1 and x2: the same prompt published with
      # KVSTORE_COPY_RUNS=1 (one node) and =0 (a copy per part) into two stores, whose blocks
      # must be byte-identical (scripts/cuda/compare_stores.py); then the trace pair with the
      # node off as a third arm: ARMS="cache cache+parts nocache" ENV_parts="KVSTORE_COPY_RUNS=0"
      # MODEL=llama8b WINDOW=60..150 SCALE=0.125 device.sh pt
    stash >/dev/null
    assemble_mlx >/dev/null || exit 1
    env_setup
    d=$K/smollm2-rand
    make_smollm2_rand "$d"
    P="$(seq 1 ${CR_TOKENS:-1500} | tr '\n' ' ')"
    for v in 1 0; do
      rm -rf "$K/cr$v"
      KVSTORE_COPY_RUNS=$v KVSTORE_QUIET=1 timeout 120 "$BIN/kvstore" generate --model "$d" --store "$K/cr$v" \
        --prompt "$P" --max-tokens 2 --json > "$OUT/cr-$v.json" 2> "$OUT/cr-$v.err" || tail -n 20 "$OUT/cr-$v.err"
    done
    python3 scripts/cuda/compare_stores.py "$K/cr1" "$K/cr0" | tee "$OUT/cr-compare.json"
    python3 -c "import json; r=json.load(open('$OUT/cr-compare.json')); print('MATCH' if r['compared'] > 0 and r['differing_tensors'] == 0 and r['a_blocks'] == r['b_blocks'] else 'MISMATCH')"
    echo "step $step: $(( $(date +%s) - START ))s"
    ;;
  gg) # kvstore generate on the GPU for each of MODELS (space-separated paths; greedy, 8
      # tokens of --raw PROMPT_TEXT), its token ids: a model's output on the GPU against its
      # run on the CPU (after x1, x2 and xm)
    stash >/dev/null
    assemble_mlx >/dev/null || exit 1
    env_setup
    n=0
    for m in ${MODELS:?MODELS}; do
      n=$((n + 1))  # each model's output kept apart: gg-N.json, gg-N.err
      timeout 120 "$BIN/kvstore" generate --model "$m" --raw --prompt "${PROMPT_TEXT:-hello world}" \
        --max-tokens 8 --json > "$OUT/gg-$n.json" 2> "$OUT/gg-$n.err"
      echo "== $m rc=$? tokens $(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["tokens"])' "$OUT/gg-$n.json" 2>&1 | tail -n 1)"
      tail -n 3 "$OUT/gg-$n.err"
    done
    echo "step $step: $(( $(date +%s) - START ))s"
    ;;
  st) # stash only: a call that carries one more part (e.g. .cuda/xaN from aiperf_pack.sh)
    stash | tail -n 4
    ;;
  ai) # AIPerf beside bench trace --url on the same slice (scripts/bench/aiperf_trace.sh), each
      # against its own fresh kvstore serve, after x1 (smollm2-rand), x2 and every .cuda/xaN
      # part of scripts/cuda/aiperf_pack.sh (one `st` call each). WINDOW (s, default 240: both replays in one call),
      # SPEED (1), DIV (3.2: --token-scale 0.3125), SERVE_BLOCK (32), SERVE_ARGS (default:
      # the trace's tiers), BENCH_ARGS (--max-concurrency 64)
    stash >/dev/null
    assemble_mlx >/dev/null || exit 1
    env_setup
    d=$K/smollm2-rand
    make_smollm2_rand "$d"
    if [ ! -x "$K/aiperfsite/bin/aiperf" ]; then
      ls "$K"/aiperf.tar.part* >/dev/null 2>&1 || { echo "carry the .cuda/xaN parts first (st calls)"; exit 1; }
      cat "$K"/aiperf.tar.part* | install_wheels aiperfsite
    fi
    printf '#!/bin/sh\nPYTHONPATH=%s exec python3 %s "$@"\n' "$K/aiperfsite" "$K/aiperfsite/bin/aiperf" > "$K/aiperf"
    chmod +x "$K/aiperf"
    "$K/aiperf" --version || exit 1
    KVSTORE=$BIN AIPERF=$K/aiperf SERVE_BLOCK=${SERVE_BLOCK:-32} \
      SERVE_ARGS="${SERVE_ARGS:-$TIERS}" BENCH_ARGS="${BENCH_ARGS:---max-concurrency 64}" MAX_BATCH=${BATCH:-16} \
      OUT=$OUT/aiperf timeout ${LIMIT:-580} bash scripts/bench/aiperf_trace.sh "$d" "$K/mooncake-conversation-part1.jsonl" \
      "${WINDOW:-240}" "${SPEED:-1}" "${DIV:-3.2}" 2>&1 | tail -n 8
    echo "step $step: $(( $(date +%s) - START ))s"
    ;;
  pn) # where a chunk step's time goes under the trace (session 12: 149-157 ms P50 against
      # 44 ms in bench serve, mostly the host's launch): short no-cache replays, one per
      # VARIANTS entry "MIXED:GRAPHS[:CACHE]" (KVSTORE_MIXED_STEPS, MLX_USE_CUDA_GRAPHS,
      # MLX_CUDA_GRAPH_CACHE_SIZE), after x1, x2
    stash >/dev/null
    assemble_mlx >/dev/null || exit 1
    env_setup
    d=$K/smollm2-rand
    T=$K/mooncake-conversation-part1.jsonl
    for v in ${VARIANTS:-1:1 0:1 1:0 0:0}; do
      IFS=: read -r mx gr cs <<< "$v"
      echo "== mixed $mx, CUDA graphs $gr, graph cache ${cs:-default}"
      KVSTORE_MIXED_STEPS=$mx MLX_USE_CUDA_GRAPHS=$gr ${cs:+MLX_CUDA_GRAPH_CACHE_SIZE=$cs} timeout 150 "$BIN/kvstore" bench trace "$T" \
          --model "$d" --window 0..${SECS:-100} --speed 1 --token-scale ${SCALE:-0.0625} --max-concurrency 64 \
          --max-batch 16 --deadline $(( ${SECS:-100} + 10 )) --no-cache 2>&1 | grep -E "^steps|requests in|TTFT p50"
    done
    echo "step $step: $(( $(date +%s) - START ))s"
    ;;
  pt) # a short slice of the trace at real speed (or SPEED), full tiering then no cache, in the
      # foreground (WINDOW, SCALE, DRAIN, CONC, BATCH; one call), after x1 and x2; logs, JSON,
      # each arm's --step-log (gzipped) and GPU memory each second to $OUT; MODEL=llama8b:
      # the 8B-shaped bf16 model
    stash >/dev/null
    assemble_mlx >/dev/null || exit 1
    env_setup
    d=$K/smollm2-rand
    make_smollm2_rand "$d"
    MARGS=""
    if [ "${MODEL:-smollm2}" = llama8b ]; then make_llama8b; d=$K/llama8b; MARGS="--keep-quantized"; fi
    T=$K/mooncake-conversation-part1.jsonl
    W=${WINDOW:-0..100}; end=${W##*..}; start=${W%%..*}
    # SPEED: time compression (1: real speed); wall: the window's seconds at that speed
    wall=$(python3 -c "print(int(($end - $start) / ${SPEED:-1}))")
    S="--window $W --speed ${SPEED:-1} --token-scale ${SCALE:-0.0625} --max-concurrency ${CONC:-64} --max-batch ${BATCH:-16} --deadline $(( wall + 10 )) ${XARGS:-}"
    for arm in ${ARMS:-cache nocache}; do
      # ARM+TAG runs ARM with the variables of ENV_TAG set and the bench flags of ARGS_TAG
      # added (e.g. cache+t16 with ENV_t16="KVSTORE_TRANSFER_THREADS=16"): an A/B in one
      # binary and one call.
      split_arm "$arm"; arm=$base
      case "$arm" in
        nocache) A="--no-cache ${TIERS%% --ram-budget*} --label no-cache" ;;
        # ...row: the same arm with the batched decode attention off (one node per layer
        # against the row-by-row path, same binary)
        nocacherow) A="--no-cache ${TIERS%% --ram-budget*} --label no-cache-row-by-row" ;;
        cacherow) rm -rf "$K/tstore"; A="$TIERS --store $K/tstore --label full-tiering-row-by-row --no-flush" ;;
        always) rm -rf "$K/tstore"; A="$TIERS --restore always --store $K/tstore --label restore-always --no-flush" ;;
        devonly) rm -rf "$K/tstore"; A="${TIERS%% --ram-budget*} --ram-budget 0 --ssd-budget 0 --store $K/tstore --label device-tier-only --no-flush" ;;
        # full tiering with blocks exported only as their sequence leaves the device
        exclusive) rm -rf "$K/tstore"; A="$TIERS --device-tier exclusive --store $K/tstore --label full-tiering-exclusive --no-flush" ;;
        ramonly) rm -rf "$K/tstore"; A="${TIERS%% --ssd-budget*} --ssd-budget 0 --store $K/tstore --label device-and-ram --no-flush" ;;
        bigcache) rm -rf "$K/tstore"; A="$TIERS --mlx-cache-limit 16GiB --store $K/tstore --label full-tiering-mlx-cache-16GiB --no-flush" ;;
        *) rm -rf "$K/tstore"; A="$TIERS --store $K/tstore --label full-tiering --no-flush" ;;
      esac
      echo "== $arm${tag:++$tag} $EV"
      # DRAIN: seconds past the window for the requests in flight at the deadline to finish;
      # an arm that has fallen behind needs minutes (session 21 lost a report to 40 s)
      case "$arm" in *row) export KVSTORE_ROWS_KERNEL=0 ;; *) unset KVSTORE_ROWS_KERNEL ;; esac
      n=pt-$arm${tag:+-$tag}
      nvidia-smi --query-gpu=timestamp,memory.used,utilization.gpu --format=csv,noheader,nounits -lms 1000 \
        > "$OUT/$n.gpumem.csv" 2>&1 & G=$!
      env $EV timeout $(( wall + ${DRAIN:-180} )) "$BIN/kvstore" bench trace "$T" --model "$d" $MARGS $S $A \
          $XA --json "$OUT/$n.json" --step-log "$OUT/$n.steps.jsonl" > "$OUT/$n.log" 2>&1
      kill $G; gzip -f "$OUT/$n.steps.jsonl"
      echo "GPU memory used, max MiB: $(cut -d, -f2 "$OUT/$n.gpumem.csv" | sort -n | tail -1)"
      # a call brings back a limited number of files: three arms' logs, JSON and step logs
      # fill it, so the samples go once their maximum is printed (session 51 lost a step log)
      rm -f "$OUT/$n.gpumem.csv"
      grep -E "^hit share|^steps|requests in|^graph census|^TTFT|^store over|^decode attention" "$OUT/$n.log"
    done
    echo "step $step: $(( $(date +%s) - START ))s"
    ;;
  rk) # the batched decode attention against the row-by-row path: the cache crate's unit
      # tests (carried as cache-test.zst), the kernel's test required to run
    stash >/dev/null
    assemble_mlx >/dev/null || exit 1
    env_setup
    zstd -d -q -f -o "$K/cache-test" "$K/cache-test.zst" && chmod +x "$K/cache-test"
    (cd "$REPO" && KVSTORE_EXPECT_ROWS_KERNEL=1 timeout 200 "$K/cache-test" --test-threads 1 ${FILTER:-} 2>&1) \
      | grep -E "^test |test result|panicked|SKIPPED|off by|left|right" | tail -n 60
    echo "step $step: $(( $(date +%s) - START ))s"
    ;;
  ns) # the 8B-shaped bf16 decode's GPU timeline under Nsight Systems (every kernel of a CUDA
      # graph its own record, managed memory's GPU page faults), kvstore then mlx-lm, PROMPT
      # tokens then TOKENS decoded; scripts/bench/gpu_gaps.py prints per arm the median step's
      # GPU busy and idle time, the kernels either side of its gaps, its copies and host API
      # calls. The traces stay in $K (too large to bring back); the reports come back.
    stash >/dev/null
    assemble_mlx >/dev/null || exit 1
    env_setup
    nsys=$(command -v nsys || ls /opt/nvidia/nsight-systems/*/bin/nsys /usr/local/cuda/bin/nsys 2>/dev/null | head -1)
    [ -n "$nsys" ] || { echo "no nsys on this machine"; ls /opt/nvidia /usr/local 2>&1 | head; exit 1; }
    make_llama8b
    ns() { # ARM COMMAND...: COMMAND traced as $K/ns-ARM.sqlite
      local arm=$1; shift
      rm -f "$K/ns-$arm".*
      timeout "${NS_LIMIT:-240}" "$nsys" profile --trace cuda --cuda-graph-trace node \
        --cuda-um-gpu-page-faults true --sample none --cpuctxsw none -o "$K/ns-$arm" \
        --export sqlite "$@" > "$OUT/ns-$arm.out" 2>&1
      echo "== $arm rc=$?"; tail -n 4 "$OUT/ns-$arm.out"
    }
    ns kvstore "$BIN/kvstore" bench generate --model "$K/llama8b" --keep-quantized \
      --skip-mlx-lm --prompt-lens ${PROMPT:-512} --decode-tokens ${TOKENS:-64}
    ns mlxlm python3 scripts/goldens/bench_mlx_lm.py "$K/llama8b" ${PROMPT:-512} ${TOKENS:-64} stored
    python3 scripts/bench/gpu_gaps.py kvstore="$K/ns-kvstore.sqlite" mlxlm="$K/ns-mlxlm.sqlite" \
      --steps $(( ${TOKENS:-64} - 16 )) 2>&1 | tee "$OUT/ns-gaps.txt"
    echo "step $step: $(( $(date +%s) - START ))s"
    ;;
  ct) # the 8B-shaped bf16 decode's GPU timeline through CUPTI (the H100s have no Nsight
      # Systems): scripts/cuda/cupti_trace.c, injected with CUDA_INJECTION64_PATH, records
      # every kernel (with its CUDA graph), copy, memset and CUDA API call; kvstore under each
      # entry of CT_VARIANTS (";"-separated variable settings, "default" for none), then
      # mlx-lm; PROMPT tokens, TOKENS decoded. gpu_gaps.py prints each arm's median step:
      # busy and idle GPU time, idle inside / between CUDA graph launches, the kernels
      # either side of the gaps, host API calls. Traces come back gzipped. After x1, x2, xm and xc
      # (cupti_pack.sh: the library and libcupti).
    stash >/dev/null
    assemble_mlx >/dev/null || exit 1
    env_setup
    make_llama8b
    mkdir -p "$K/cupti" && cp .cuda/xc/* "$K/cupti/" 2>/dev/null
    [ -f "$K/cupti/libcupti_trace.so" ] || { echo "no .cuda/xc (scripts/cuda/cupti_pack.sh)"; exit 1; }
    ct() { # ARM COMMAND...: COMMAND traced into $OUT/ct-ARM.txt.gz
      local arm=$1; shift
      CUDA_INJECTION64_PATH="$K/cupti/libcupti_trace.so" CUPTI_TRACE_OUT="$K/ct-$arm.txt" \
        timeout "${CT_LIMIT:-200}" "$@" > "$OUT/ct-$arm.out" 2>&1
      echo "== $arm rc=$? lines=$(wc -l < "$K/ct-$arm.txt" 2>/dev/null)"
      grep -E "cupti_trace|^ +[0-9]+ |^\{" "$OUT/ct-$arm.out" | tail -n 4
      # CT_TRACES=0: the traces and outputs stay here (a call brings back few files: an A/B
      # of many variants reads its kernels from ct-gaps.txt)
      if [ "${CT_TRACES:-1}" = 0 ]; then mv "$OUT/ct-$arm.out" "$K/"; else gzip -c "$K/ct-$arm.txt" > "$OUT/ct-$arm.txt.gz"; fi
    }
    arms=()
    IFS=';' read -ra sets <<< "${CT_VARIANTS:-default}"
    for v in "${sets[@]}"; do
      [ "$v" = default ] && v=""
      tag=kvstore-$(settings_tag "$v")
      ct "$tag" env $v "$BIN/kvstore" bench generate --model "$K/llama8b" --keep-quantized \
        --skip-mlx-lm --prompt-lens ${PROMPT:-512} --decode-tokens ${TOKENS:-64}
      arms+=("$tag=$K/ct-$tag.txt")
    done
    # CT_PEER=0: kvstore's arms alone
    if [ "${CT_PEER:-1}" != 0 ]; then
      ct mlxlm python3 scripts/goldens/bench_mlx_lm.py "$K/llama8b" ${PROMPT:-512} ${TOKENS:-64} stored
      arms+=("mlxlm=$K/ct-mlxlm.txt")
    fi
    python3 scripts/bench/gpu_gaps.py "${arms[@]}" \
      --steps $(( ${TOKENS:-64} - 16 )) --head-us ${HEAD_US:-150} --kernels ${CT_KERNELS:-6} 2>&1 | tee "$OUT/ct-gaps.txt"
    echo "step $step: $(( $(date +%s) - START ))s"
    ;;
  nq) # why the decode attention takes the time it does: Nsight Compute's sections (speed of
      # light, occupancy, launch, warp states, memory, scheduler) for NQ_COUNT launches of
      # kvstore's rows_partial and rows_combine (NCU_ENV: kernel variables) and of mlx-lm's
      # cuDNN flash attention, the 8B-shaped bf16 decode at PROMPT tokens; after x1, x2, xm.
      # Each launch is replayed once per section pass (clocks locked to base by ncu's default,
      # so its durations are not a step's: compare the sections, not the times).
    stash >/dev/null
    assemble_mlx >/dev/null || exit 1
    env_setup
    make_llama8b
    ncu=$(ncu_path) || exit 1
    sections="--section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats --section MemoryWorkloadAnalysis --section SchedulerStats"
    nq() { # ARM KERNEL-REGEX SKIP COMMAND...: the sections as $OUT/nq-ARM.txt
      local arm=$1 re=$2 skip=$3; shift 3
      # shellcheck disable=SC2086
      timeout "${NQ_LIMIT:-240}" "$ncu" --kernel-name "regex:$re" --launch-skip "$skip" \
        --launch-count "${NQ_COUNT:-4}" $sections "$@" > "$OUT/nq-$arm.txt" 2>&1
      echo "== $arm rc=$?"; grep -E "^  [a-z_]|Duration|Achieved Occupancy|Registers Per|DRAM Throughput|Memory Throughput|Warp Cycles Per Issued|Eligible Warps|No Eligible" "$OUT/nq-$arm.txt" | head -n 40
    }
    # launches skipped: both programs' warm-up and mlx-lm's prefill chunks (kvstore's decode
    # kernels run only in decode steps: 64 launches a step)
    nq kvstore "rows_partial|rows_combine" "${NQ_SKIP:-384}" env ${NCU_ENV:-} "$BIN/kvstore" bench generate --model "$K/llama8b" \
      --keep-quantized --skip-mlx-lm --prompt-lens ${PROMPT:-8192} --decode-tokens ${TOKENS:-16}
    nq mlxlm "sdpa|flash" "${NQ_SKIP_PEER:-320}" python3 scripts/goldens/bench_mlx_lm.py "$K/llama8b" \
      ${PROMPT:-8192} ${TOKENS:-16} stored
    echo "step $step: $(( $(date +%s) - START ))s"
    ;;
  nk) # every kernel of the 8B-shaped bf16 decode timed by Nsight Compute (gpu__time_duration,
      # clocks left alone), kvstore then mlx-lm (PROMPT tokens, TOKENS decoded; NCU_ENV: more
      # variables for kvstore's run), each as $OUT/nk-ARM.csv.gz, then both graph censuses
      # (NK_CENSUS=0: not); after x1, x2, xm. Caches are not flushed between kernels
      # (--cache-control none), so a kernel reads what the one before left in L2, as in a
      # step. scripts/bench/kernel_steps.py splits the CSVs into decode steps.
    stash >/dev/null
    assemble_mlx >/dev/null || exit 1
    env_setup
    make_llama8b
    ncu=$(ncu_path) || exit 1
    nk() { # ARM COMMAND...: the kernels of COMMAND as $OUT/nk-ARM.csv.gz
      local arm=$1; shift
      timeout "${NK_LIMIT:-270}" "$ncu" --clock-control none --cache-control none \
        --metrics gpu__time_duration.sum --csv \
        --page raw --print-units base --log-file "$OUT/nk-$arm.csv" "$@" > "$OUT/nk-$arm.out" 2>&1
      echo "== $arm rc=$? kernels=$(grep -c '^"[0-9]' "$OUT/nk-$arm.csv" 2>/dev/null)"
      tail -n 4 "$OUT/nk-$arm.out"; gzip -f "$OUT/nk-$arm.csv"
    }
    nk kvstore env ${NCU_ENV:-} "$BIN/kvstore" bench generate --model "$K/llama8b" --keep-quantized \
      --skip-mlx-lm --prompt-lens ${PROMPT:-512} --decode-tokens ${TOKENS:-8}
    nk mlxlm python3 scripts/goldens/bench_mlx_lm.py "$K/llama8b" ${PROMPT:-512} ${TOKENS:-8} stored
    [ "${NK_CENSUS:-1}" = 0 ] && { echo "step $step: $(( $(date +%s) - START ))s"; exit 0; }
    KVSTORE_GRAPH_CENSUS=1 KVSTORE_DECODE_WAIT=drained timeout 120 "$BIN/kvstore" bench generate \
      --model "$K/llama8b" --keep-quantized --skip-mlx-lm --prompt-lens ${PROMPT:-512} \
      --decode-tokens ${TOKENS:-16} 2>&1 | grep -i census | tee "$OUT/nk-census-kvstore.log"
    timeout 120 python3 scripts/goldens/census_mlx_lm.py "$K/llama8b" ${PROMPT:-512} stored 2>&1 \
      | tail -n 3 | tee "$OUT/nk-census-mlxlm.log"
    echo "step $step: $(( $(date +%s) - START ))s"
    ;;
  hd) # the host-delay probe: the 8B-shaped bf16 decode with SPINS µs of host work spun after
      # each queued step (KVSTORE_PROBE_HOST_US; engine/src/host_probe.rs), kvstore then
      # mlx-lm (scripts/cuda/host_delay_mlx_lm.py), PROMPT tokens, TOKENS decoded; after x1, x2, xm
    stash >/dev/null
    assemble_mlx >/dev/null || exit 1
    env_setup
    make_llama8b
    for us in ${SPINS:-0 1000 2000 3000}; do
      echo "== kvstore KVSTORE_PROBE_HOST_US=$us"
      KVSTORE_PROBE_HOST_US=$us timeout 150 "$BIN/kvstore" bench generate --model "$K/llama8b" \
        --keep-quantized --skip-mlx-lm --prompt-lens ${PROMPT:-512} --decode-tokens ${TOKENS:-64} \
        > "$OUT/hd-kvstore-$us.log" 2>&1
      grep -E "decode|prefill|step" "$OUT/hd-kvstore-$us.log" | grep -v '^{' | tail -n 8
    done
    echo "== a new shape's cost (scripts/cuda/shape_cost_probe.py)"
    timeout 120 python3 scripts/cuda/shape_cost_probe.py 6 2>&1 | tee "$OUT/hd-shapes.log" | tail -n 7
    echo "== mlx-lm"
    timeout 200 python3 scripts/cuda/host_delay_mlx_lm.py "$K/llama8b" ${PROMPT:-512} ${TOKENS:-64} \
      "$(echo ${SPINS:-0 1000 2000 3000} | tr ' ' ,)" 2>&1 | tee "$OUT/hd-mlxlm.log" | grep '^{'
    echo "step $step: $(( $(date +%s) - START ))s"
    ;;
  gs) # the 8B-shaped bf16 decode, kvstore then mlx-lm, under each entry of GRAPHS (";"-separated
      # variable settings, "default" for none: e.g. MLX's CUDA graph limits
      # MLX_MAX_OPS_PER_BUFFER / MLX_MAX_MB_PER_BUFFER, or kvstore's own KVSTORE_ variables,
      # for which mlx-lm does not run again), LENS8B prompts, TOK8B tokens; after x1, x2, xm
    stash >/dev/null
    assemble_mlx >/dev/null || exit 1
    env_setup
    make_llama8b
    IFS=';' read -ra sets <<< "${GRAPHS:-default}"
    round=0
    for v in "${sets[@]}"; do
      [ "$v" = default ] && v=""
      # an entry given twice (alternations) keeps each run's log: the round in the name
      round=$((round + 1))
      tag=$round-$(settings_tag "$v")
      echo "== ${v:-default}"
      env $v timeout 150 "$BIN/kvstore" bench generate --model "$K/llama8b" --keep-quantized --skip-mlx-lm \
        --prompt-lens ${LENS8B:-512,2048} --decode-tokens ${TOK8B:-64} > "$OUT/gs-kvstore-$tag.log" 2>&1
      grep -E "^ +[0-9]+ " "$OUT/gs-kvstore-$tag.log" | tail -n 6
      # mlx-lm again only where the setting reaches it (not for KVSTORE_ variables alone);
      # GS_PEER_ONCE=1: for the first entry only
      if { [ -z "$v" ] || echo "$v" | tr ' ' '\n' | grep -qv '^KVSTORE_'; } \
        && { [ "${GS_PEER_ONCE:-0}" != 1 ] || [ -z "${peer_ran:-}" ]; }; then
        peer_ran=1
        env $v timeout 150 python3 scripts/goldens/bench_mlx_lm.py "$K/llama8b" ${LENS8B:-512,2048} ${TOK8B:-64} stored \
          > "$OUT/gs-mlxlm-$tag.log" 2>&1
        grep '^{' "$OUT/gs-mlxlm-$tag.log"
      fi
    done
    echo "step $step: $(( $(date +%s) - START ))s"
    ;;
  pw) # the 8B-shaped bf16 decode under each step wait (WAITS: KVSTORE_DECODE_WAIT values,
      # "default" for none set), then mlx-lm once; then bench serve's interleave part alone
      # (8 streams + an 8K prompt) for each entry of ILV ("none", or --itl-stretch X, or cN:
      # --prefill-chunk N), SmolLM2's shape; after x1 (smollm2-rand) and x2. SKIP8B=1: only
      # the interleave.
    stash >/dev/null
    assemble_mlx >/dev/null || exit 1
    env_setup
    [ -n "${SKIP8B:-}" ] || make_llama8b
    [ -n "${SKIP8B:-}" ] || for w in ${WAITS:-default none}; do
      echo "== KVSTORE_DECODE_WAIT=$w"
      ( [ "$w" = default ] || export KVSTORE_DECODE_WAIT=$w
        timeout 150 "$BIN/kvstore" bench generate --model "$K/llama8b" --keep-quantized --skip-mlx-lm \
          --prompt-lens ${LENS8B:-512,2048} --decode-tokens ${TOK8B:-128} 2>&1 ) | tee "$OUT/pw-8b-$w.log" | grep -v '^{'
    done
    [ -n "${SKIPPEER:-}${SKIP8B:-}" ] || timeout 150 python3 scripts/goldens/bench_mlx_lm.py "$K/llama8b" ${LENS8B:-512,2048} ${TOK8B:-128} stored 2>&1 \
      | tee "$OUT/pw-8b-mlxlm.log" | grep '^{'
    for v in ${ILV:-}; do
      case "$v" in none) a="--itl-stretch none" ;; c*) a="--prefill-chunk ${v#c}" ;; *) a="--itl-stretch $v" ;; esac
      echo "== interleave $a"
      timeout 120 "$BIN/kvstore" bench serve --model "$K/smollm2-rand" --streams 8 --stream-tokens 256 \
        --long-prompt 8192 --sessions 0 $a --json "$OUT/pw-ilv-$v.json" 2>&1 | grep -v '^ ' | tail -n 6
    done
    echo "step $step: $(( $(date +%s) - START ))s"
    ;;
  gv) # the upload node's check, after x1 and x2: a second process restores a prompt from the
      # SSD (staged, so through the node), decodes and publishes the blocks after it; a cold
      # run in another store publishes the same blocks; their tensors must agree
      # (scripts/cuda/compare_stores.py: the random model repeats one token, so its tokens
      # would prove nothing). Then a short trace slice with host tiers.
    stash >/dev/null
    assemble_mlx >/dev/null || exit 1
    env_setup
    d=$K/smollm2-rand
    make_smollm2_rand "$d"
    rm -rf "$K/gva" "$K/gvc"
    P="$(seq 1 ${GV_TOKENS:-1000} | tr '\n' ' ')"  # ~4,300 tokens: under the 256 MiB a staged run may hold
    gen() { KVSTORE_QUIET=1 timeout 120 "$BIN/kvstore" generate --model "$d" --prompt "$P" --json "$@"; }
    gen --store "$K/gva" --max-tokens 1 > "$OUT/gv-1.json" 2> "$OUT/gv-1.err" || tail -n 20 "$OUT/gv-1.err"
    gen --store "$K/gva" --restore always --max-tokens 80 > "$OUT/gv-2.json" 2> "$OUT/gv-2.err" || tail -n 20 "$OUT/gv-2.err"
    gen --store "$K/gvc" --max-tokens 80 > "$OUT/gv-3.json" 2> "$OUT/gv-3.err" || tail -n 20 "$OUT/gv-3.err"
    from=$(python3 -c "import json; print(json.load(open('$OUT/gv-1.json'))['cache']['prompt_tokens'] // 32)")
    python3 scripts/cuda/compare_stores.py "$K/gva" "$K/gvc" "$from" > "$OUT/gv-compare.json"
    python3 - "$OUT/gv-2.json" "$OUT/gv-compare.json" <<'PY'
import json, sys
c = json.load(open(sys.argv[1]))["cache"]
r = json.load(open(sys.argv[2]))
print("restored", c["cached_tokens"], "from SSD", c["cached_ssd_tokens"], "staged_s", c["staged_s"])
print("blocks after the prompt compared", r["compared"], "equal tensors", r["equal_tensors"],
      "differing", r["differing_tensors"], "max rel", r["max_rel"])
ok = c["cached_ssd_tokens"] > 0 and c["staged_s"] > 0 and r["compared"] > 0 and r["max_rel"] < 1e-3
print("MATCH" if ok else "MISMATCH")
PY
    # the batched decode attention's buffers (branch decode-alloc): cold runs with the old
    # allocations (KVSTORE_DECODE_ALLOC=0) and with the row-by-row path (KVSTORE_ROWS_KERNEL=0)
    # must publish the same decoded blocks as the default cold run (same kernels: exact; the
    # row-by-row path: within float error)
    for v in DECODE_ALLOC ROWS_KERNEL; do
      rm -rf "$K/gv$v"
      env KVSTORE_$v=0 KVSTORE_QUIET=1 timeout 120 "$BIN/kvstore" generate --model "$d" --prompt "$P" --json \
        --store "$K/gv$v" --max-tokens 80 > "$OUT/gv-$v.json" 2> "$OUT/gv-$v.err" || tail -n 20 "$OUT/gv-$v.err"
      python3 scripts/cuda/compare_stores.py "$K/gvc" "$K/gv$v" "$from" > "$OUT/gv-compare-$v.json"
      python3 -c "import json; r=json.load(open('$OUT/gv-compare-$v.json')); print('KVSTORE_$v=0 against default:', r['compared'], 'blocks, differing tensors', r['differing_tensors'], 'max rel', r['max_rel'])"
    done
    T=$K/mooncake-conversation-part1.jsonl
    if [ -f "$T" ]; then
      rm -rf "$K/gvtrace"
      timeout 100 "$BIN/kvstore" bench trace "$T" --model "$d" --window 0..40 --speed 2 --token-scale 0.125 \
        --kv-budget 1GiB --ram-budget 8GiB --ssd-budget 8GiB --store "$K/gvtrace" --no-flush \
        --json "$OUT/gv-trace.json" > "$OUT/gv-trace.log" 2>&1; echo "trace rc $?"
      grep -E "^hit share|^TTFT parts|requests in" "$OUT/gv-trace.log"
      python3 -c "import json; r=json.load(open('$OUT/gv-trace.json')); print('imports', r['overall']['imports'])"
    fi
    echo "step $step: $(( $(date +%s) - START ))s"
    ;;
  pu) # the queued issue-15/16 rows in one or two calls, after x1 and x2 (PARTS: ssd agent agentrep cachedb
      # prefill decode overlap probe census cudnn ab opsbuf): bench cache's SSD rows, the 13-turn session (cold, RAM, SSD), SmolLM2
      # prefill beside mlx-lm at 2K/8K/32K, and the 8B decode beside mlx-lm, alternated ROUNDS times
    stash >/dev/null
    assemble_mlx >/dev/null || exit 1
    env_setup
    py=$(command -v python3)
    d=$K/smollm2-rand
    make_smollm2_rand "$d"
    for part in ${PARTS:-ssd agent prefill decode}; do
      echo "== $part $(( $(date +%s) - START ))s"
      case "$part" in
        ssd) { timeout 150 "$BIN/kvstore" bench cache --only ssd --dir "$K" 2>&1; } | tee "$OUT/bench-cache-ssd.log" | tail -n 14 ;;
        agent) { timeout 150 "$BIN/kvstore" bench agent --model "$d" --python "$py" --mlx-lm-model "$d" \
                   --arms cold,ram,ssd --out "$OUT/agent13" 2>&1; } > "$OUT/agent13.log"; tail -n 24 "$OUT/agent13.log" ;;
        agentrep) # the 13-turn session with each arm run REPEAT times (default 3), each
                  # turn's median run reported (per-turn ratios out of the machine's noise)
          { timeout 420 "$BIN/kvstore" bench agent --model "$d" --python "$py" --mlx-lm-model "$d" \
              --arms ${AGENT_ARMS:-cold,ram,ssd} --repeat "${REPEAT:-3}" --out "$OUT/agent13rep" 2>&1; } > "$OUT/agent13rep.log"
          tail -n 30 "$OUT/agent13rep.log" ;;
        cachedb) # bench cache's decode-step and bulk-restore rows (paged vs contiguous at
                 # 1K-32K, restore vs one transfer)
          { timeout 200 "$BIN/kvstore" bench cache --only decode --only blocks 2>&1; } | tee "$OUT/bench-cache-db.log" | tail -n 30 ;;
        prefill)
          { timeout 200 "$BIN/kvstore" bench generate --model "$d" --skip-mlx-lm --prompt-lens ${LENS:-2048,8192,32768} \
              --decode-tokens 16 2>&1; timeout 200 python3 scripts/goldens/bench_mlx_lm.py "$d" ${LENS:-2048,8192,32768} 16 2>&1; } \
            | tee "$OUT/bench-prefill-smollm2.log" | tail -n 20 ;;
        decode)
          make_llama8b
          for r in $(seq 1 "${ROUNDS:-2}"); do
            { timeout 200 "$BIN/kvstore" bench generate --model "$K/llama8b" --keep-quantized --skip-mlx-lm \
                --prompt-lens ${LENS8B:-512,2048,8192} --decode-tokens 128 2>&1;
              timeout 200 python3 scripts/goldens/bench_mlx_lm.py "$K/llama8b" ${LENS8B:-512,2048,8192} 128 stored 2>&1; } \
              | tee "$OUT/bench-generate-llama8b-$r.log" | grep -iE "tok/s|decode|prompt" | tail -n 16
          done ;;
        overlap) # the 8B decode with each step queued at once (KVSTORE_DECODE_WAIT=none, the
                 # engine before 4480a86) and after the previous one has drained (the GPU default)
          make_llama8b
          for r in $(seq 1 "${ROUNDS:-2}"); do
            for o in 1 default; do
              echo "-- round $r, KVSTORE_DECODE_WAIT=$o"
              { if [ "$o" = 1 ]; then export KVSTORE_DECODE_WAIT=none; else unset KVSTORE_DECODE_WAIT; fi
                timeout 200 "$BIN/kvstore" bench generate --model "$K/llama8b" --keep-quantized --skip-mlx-lm \
                  --prompt-lens ${LENS8B:-512,2048,8192} --decode-tokens 128 2>&1; } \
                | tee "$OUT/bench-overlap-llama8b-$r-$o.log" | grep -E "^ +[0-9]"
            done
          done
          unset KVSTORE_DECODE_WAIT ;;
        probe) timeout 60 python3 scripts/cuda/donation_probe.py "${PROBE_GIB:-1}" 2>&1 | tee "$OUT/donation-probe.log" ;;
        census) # nodes per decode step (KVSTORE_GRAPH_CENSUS=1) beside mlx-lm's step, one row
          make_llama8b
          for m in "smollm2-rand f32" "llama8b stored"; do
            set -- $m; q=; [ "$2" = stored ] && q=--keep-quantized
            echo "-- $1"
            KVSTORE_GRAPH_CENSUS=1 timeout 200 "$BIN/kvstore" bench generate --model "$K/$1" $q --skip-mlx-lm \
              --prompt-lens 512 --decode-tokens 16 2>&1 | grep "graph census"
            timeout 200 python3 scripts/goldens/census_mlx_lm.py "$K/$1" 512 "$2" 2>&1 | tail -n 1
          done | tee "$OUT/census.log" ;;
        cudnn) # which attention kernel a decode step over a KV view gets, and its cost
               # (scripts/cuda/cudnn_decode_probe.py), then mlx-lm's 8B decode with cuDNN's
               # attention on and off (MLX_CUDA_USE_CUDNN_SDPA)
          timeout 120 python3 scripts/cuda/cudnn_decode_probe.py ${PROBE_LENS:-512,2048,8192,32768} 2>&1 | tee "$OUT/cudnn-probe.log"
          make_llama8b
          for c in 1 0; do
            echo "-- mlx-lm, MLX_CUDA_USE_CUDNN_SDPA=$c"
            MLX_CUDA_USE_CUDNN_SDPA=$c timeout 200 python3 scripts/goldens/bench_mlx_lm.py "$K/llama8b" ${LENS8B:-512,2048,8192} 128 stored 2>&1 \
              | tee "$OUT/bench-cudnn-mlxlm-$c.log" | grep decode_tok
          done ;;
        opsbuf) # the 8B decode, kvstore then mlx-lm, with MLX's CUDA backend committing a
                # graph every MLX_MAX_OPS_PER_BUFFER kernels (OPS, default "20 100 200"; MLX's
                # own default is 20), alternated ROUNDS times
          make_llama8b
          for r in $(seq 1 "${ROUNDS:-2}"); do
            for v in ${OPS:-20 100 200}; do
              echo "-- round $r, MLX_MAX_OPS_PER_BUFFER=$v"
              MLX_MAX_OPS_PER_BUFFER=$v timeout 200 "$BIN/kvstore" bench generate --model "$K/llama8b" --keep-quantized \
                --skip-mlx-lm --prompt-lens ${LENS8B:-512,2048,8192} --decode-tokens 128 2>&1 \
                | tee "$OUT/bench-opsbuf-llama8b-$r-$v.log" | grep -E "^ +[0-9]"
              MLX_MAX_OPS_PER_BUFFER=$v timeout 200 python3 scripts/goldens/bench_mlx_lm.py "$K/llama8b" ${LENS8B:-512,2048,8192} 128 stored 2>&1 \
                | tee "$OUT/bench-opsbuf-mlxlm-$r-$v.log" | grep decode_tok
            done
          done ;;
        ab) # the 8B decode: this binary with each KVSTORE_DECODE_WAIT of WAITS (default
            # "adaptive drained none") and the binary $BIN_B (e.g. the commit before; skipped
            # when unset), alternated ROUNDS times, then mlx-lm each round
          make_llama8b
          for r in $(seq 1 "${ROUNDS:-2}"); do
            for v in ${WAITS:-adaptive drained none} ${BIN_B:+old}; do
              b=$BIN/kvstore; [ "$v" = old ] && b=$BIN_B
              echo "-- round $r, $v ($b)"
              { [ "$v" != old ] && export KVSTORE_DECODE_WAIT=$v
                timeout 200 "$b" bench generate --model "$K/llama8b" --keep-quantized --skip-mlx-lm \
                  --prompt-lens ${LENS8B:-512,2048,8192} --decode-tokens 128 2>&1; unset KVSTORE_DECODE_WAIT; } \
                | tee "$OUT/bench-ab-llama8b-$r-$v.log" | grep -E "^ +[0-9]"
            done
            echo "-- round $r, mlx-lm"
            timeout 200 python3 scripts/goldens/bench_mlx_lm.py "$K/llama8b" ${LENS8B:-512,2048,8192} 128 stored 2>&1 \
              | tee "$OUT/bench-ab-mlxlm-$r.log" | grep decode_tok
          done ;;
      esac
    done
    echo "step $step: $(( $(date +%s) - START ))s"
    ;;
  ph) # bench grammar (constrained vs unconstrained decode, mask ms per token), after x1 and x2
    stash >/dev/null
    assemble_mlx >/dev/null || exit 1
    env_setup
    d=$K/smollm2-rand
    make_smollm2_rand "$d"
    { timeout 240 "$BIN/kvstore" bench grammar --model "$d" 2>&1; } | tail -n 14
    echo "step $step: $(( $(date +%s) - START ))s"
    ;;
  pi) # Claude Code (npm @anthropic-ai/claude-code-linux-x64's native binary, zstd'd and split
      # into .cuda/x3 and .cuda/x4 as claude.zst.part*) against kvstore serve for a few turns,
      # after x1 and x2; the prompt-token counters are read around every turn
    stash >/dev/null
    assemble_mlx >/dev/null || exit 1
    env_setup
    d=$K/smollm2-rand
    if [ ! -x "$K/claude" ]; then
      cat "$K"/claude.zst.part* | zstd -d -q -o "$K/claude" && chmod +x "$K/claude" || exit 1
    fi
    "$K/claude" --version
    rm -rf "$K/ccstore"; "$BIN/kvstore" serve --model "$d" --port 8765 --store "$K/ccstore" \
        --max-tokens-limit 32000 > "$OUT/cc-serve.log" 2>&1 &
    for _ in $(seq 300); do curl -sf localhost:8765/health >/dev/null && break; sleep 0.2; done
    mkdir -p /tmp/proj && cd /tmp/proj && printf 'def add(a, b):\n    return a + b\n' > calc.py
    export ANTHROPIC_BASE_URL=http://127.0.0.1:8765 ANTHROPIC_API_KEY=dummy-key \
      ANTHROPIC_MODEL=smollm2-rand ANTHROPIC_SMALL_FAST_MODEL=smollm2-rand \
      CLAUDE_CODE_MAX_OUTPUT_TOKENS=${CC_TOKENS:-128} DISABLE_TELEMETRY=1 DISABLE_AUTOUPDATER=1 \
      CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC=1 DISABLE_ERROR_REPORTING=1 HOME=/tmp/cchome
    mkdir -p /tmp/cchome
    counters() { curl -s localhost:8765/metrics | grep -E '^kvstore_(prompt_tokens_total|cached_prompt_tokens_total|requests_total)' | tr '\n' ' '; echo; }
    for t in 1 2 3 4; do
      cont=""; [ "$t" -gt 1 ] && cont="--continue"
      echo "== turn $t: before: $(counters)"
      timeout 150 "$K/claude" -p $cont --output-format json --max-turns 1 \
        "Turn $t: read calc.py and suggest one improvement." > "$OUT/cc-turn$t.json" 2> "$OUT/cc-turn$t.err"
      echo "turn $t exit $?: $(head -c 400 "$OUT/cc-turn$t.json")"
      echo "   after: $(counters)"
    done
    grep -E "/v1/messages" "$OUT/cc-serve.log" | sed 's/\x1b\[[0-9;]*m//g' | tail -n 20
    cd "$REPO"; echo "step $step: $(( $(date +%s) - START ))s"
    ;;
  e2) # engines in one process on the GPU (bench trace --engines 1, then 2, a Redis tier
      # between them), the tiny llama over a slice of the trace (WINDOW, 0..60 at 2x): whether
      # MLX's CUDA backend takes two engine threads at once; after x1, x2, xm, x6, x7
    stash >/dev/null
    assemble_mlx >/dev/null || exit 1
    env_setup
    zstd -d -q -c "$K/redis.tar.zst" | tar -x -C "$K" && export PATH=$K/redis:$PATH
    redis-server --port 6391 --save '' --appendonly no --daemonize yes >/dev/null || exit 1
    for n in 1 2; do
      timeout "${LIMIT:-200}" "$BIN/kvstore" bench trace "$K/mooncake-conversation-part1.jsonl" \
        --model engine/tests/goldens/tiny-llama --engines "$n" --remote redis://127.0.0.1:6391 \
        --window "${WINDOW:-0..60}" --speed 2 --token-scale 0.015625 --max-concurrency 16 \
        --json "$OUT/e2-$n.json" > "$OUT/e2-$n.log" 2>&1
      echo "engines $n: rc=$?"
      grep -E "requests in|what\(\)|panicked|Aborted" "$OUT/e2-$n.log" | head -5
      redis-cli -p 6391 flushall >/dev/null 2>&1  # the next run starts with no shared blocks
    done
    redis-cli -p 6391 shutdown nosave >/dev/null 2>&1
    echo "step $step: $(( $(date +%s) - START ))s"
    ;;
  v) # every test binary, with redis-server and the openai client that some tests need
    stash >/dev/null
    assemble_mlx >/dev/null || exit 1
    assemble_gguf >/dev/null || exit 1
    env_setup; assemble_tests || exit 1
    zstd -d -q -c "$K/redis.tar.zst" | tar -x -C "$K" && export PATH=$K/redis:$PATH
    command -v redis-server && redis-server --version
    mkdir -p "$K/whl" && tar -xf "$K/whl.tar" -C "$K"
    python3 -m pip install -q --no-index --no-deps --no-compile --target "$K/pysite" "$K"/whl/*.whl 2>&1 | tail -2
    python3 -m venv --system-site-packages --without-pip "$REPO/.venv-test"
    printf '%s\n%s\n' "$K/pysite" "$SP" > "$(echo "$REPO"/.venv-test/lib/python3*/site-packages)/kvx.pth"
    "$REPO/.venv-test/bin/python" -c 'import openai, httpx; print("openai", openai.__version__)'
    mapfile -t all < "$K/tests.done"
    NOCAP=1 TAIL=1000000 TEST_LIMIT=300 run_tests "${all[@]}" > "$OUT/tests.log" 2>&1
    grep -E "^=== rc|^test result|FAILED|panicked|allowed|near ties|both greedy" "$OUT/tests.log" | head -100
    ;;
esac
