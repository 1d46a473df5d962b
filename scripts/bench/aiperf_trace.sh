#!/usr/bin/env bash
# AIPerf (an independent client, PyPI `aiperf`) and `kvstore bench trace --url` replay the
# same Mooncake slice against two fresh `kvstore serve`s, one after the other, and print
# both reports (docs/benchmarks.md, "AIPerf on the same slice").
#
#   bash scripts/bench/aiperf_trace.sh MODEL_DIR [TRACE] [WINDOW_S] [SPEED] [SCALE_DIV]
#
# MODEL_DIR: a Hugging Face folder kvstore serves (tokenizer.json inside: AIPerf uses it).
# TRACE: default ../shared/traces/mooncake-conversation-part1.jsonl. WINDOW_S: the first
# this many seconds (default 600). SPEED: time compression (default 10). SCALE_DIV: trace
# lengths and the 512-token block divided by this (default 128: 4-token blocks; 3.2 is
# --token-scale 0.3125). Makes .venv-aiperf (aiperf pinned below) on first use, unless
# AIPERF names an aiperf command to run instead (the GPU machine's offline install,
# scripts/cuda/device.sh ai); SERVE_BLOCK: kvstore's --block-size (default: the scaled trace
# block). Results go to target/aiperf/ (OUT to change).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
MODEL=$(cd "${1:?MODEL_DIR}" && pwd)
TRACE=${2:-$ROOT/../shared/traces/mooncake-conversation-part1.jsonl}
WINDOW=${3:-600}
SPEED=${4:-10}
DIV=${5:-128}
AIPERF_VERSION=0.13.0
V=$ROOT/.venv-aiperf
OUT=${OUT:-$ROOT/target/aiperf}
BIN=${KVSTORE:-$ROOT/target/release/kvstore}
[ -x "$BIN" ] || { echo "build kvstore first: cargo build --release (or set KVSTORE)" >&2; exit 1; }
if [ -z "${AIPERF:-}" ]; then
  [ -x "$V/bin/aiperf" ] || { python3 -m venv "$V" && "$V/bin/pip" install -q "aiperf==$AIPERF_VERSION"; }
  AIPERF=$V/bin/aiperf
fi
mkdir -p "$OUT"
BLOCK=$(python3 -c "import sys; b = 512 / float(sys.argv[1]); assert b == int(b), 'SCALE_DIV must divide 512'; print(int(b))" "$DIV")
SERVE_BLOCK=${SERVE_BLOCK:-$BLOCK}
# 1. The scaled slice as AIPerf reads it: lengths divided and rounded up, timestamps
#    compressed, the same hash ids.
python3 - "$TRACE" "$WINDOW" "$SPEED" "$DIV" > "$OUT/scaled.jsonl" <<'PY'
import json, math, sys
trace, window, speed, div = sys.argv[1], float(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4])
for line in open(trace):
    r = json.loads(line)
    if r["timestamp"] / 1000.0 >= window:
        continue
    r["input_length"] = math.ceil(r["input_length"] / div)
    r["output_length"] = max(1, math.ceil(r["output_length"] / div))
    r["timestamp"] = int(r["timestamp"] / speed)
    print(json.dumps(r))
PY
# 2. AIPerf's worker processes look a tokenizer up as a Hub id: lay the model's tokenizer
#    out as a Hugging Face cache entry, read offline.
HF=$OUT/hf
snap=$HF/hub/models--local--model/snapshots/0000000000000000000000000000000000000000
mkdir -p "$snap" "$HF/hub/models--local--model/refs"
cp "$MODEL"/tokenizer*.json "$MODEL"/config.json "$snap/" 2>/dev/null || true
[ -f "$MODEL/special_tokens_map.json" ] && cp "$MODEL/special_tokens_map.json" "$snap/"
printf 0000000000000000000000000000000000000000 > "$HF/hub/models--local--model/refs/main"
vocab=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['vocab_size'])" "$MODEL/config.json")
serve() { # PORT LOG: a fresh server on a fresh store (removed by stop)
  local store; store=$(mktemp -d)
  echo "$store" > "$OUT/serve.store"
  "$BIN" serve --model "$MODEL" --port "$1" --store "$store" --block-size "$SERVE_BLOCK" --max-batch ${MAX_BATCH:-8} ${SERVE_ARGS:-} > "$2" 2>&1 &
  echo $! > "$OUT/serve.pid"
  for _ in $(seq 600); do curl -sf "http://127.0.0.1:$1/health" >/dev/null && return 0; sleep 0.2; done
  echo "kvstore serve did not start: $(tail -5 "$2")" >&2; return 1
}
stop() {
  kill "$(cat "$OUT/serve.pid" 2>/dev/null)" 2>/dev/null || true; wait 2>/dev/null || true
  [ -f "$OUT/serve.store" ] && rm -rf "$(cat "$OUT/serve.store")" "$OUT/serve.store"
  return 0
}
trap stop EXIT
# 3. AIPerf against one fresh server...
serve 18934 "$OUT/serve-aiperf.log"
HF_HOME=$HF HF_HUB_OFFLINE=1 $AIPERF profile -m "$(basename "$MODEL")" --url http://127.0.0.1:18934 \
  --endpoint-type completions --streaming --input-file "$OUT/scaled.jsonl" \
  --custom-dataset-type mooncake_trace --fixed-schedule --isl-block-size "$BLOCK" \
  --tokenizer local/model --ui-type none --artifact-dir "$OUT/aiperf" > "$OUT/aiperf.log" 2>&1 || { tail -30 "$OUT/aiperf.log"; exit 1; }
curl -s http://127.0.0.1:18934/metrics | grep -E '^kvstore_(prompt|cached_prompt)_tokens_total' || true
stop
# 4. ...then bench trace against another, on the same slice.
serve 18935 "$OUT/serve-bench.log"
"$BIN" bench trace "$TRACE" --window "0..$WINDOW" --speed "$SPEED" \
  --token-scale "$(python3 -c "print(1/$DIV)")" ${BENCH_ARGS:-} --url http://127.0.0.1:18935 --vocab "$vocab" \
  --json "$OUT/bench-trace.json" > "$OUT/bench-trace.log" 2>&1 || { tail -20 "$OUT/bench-trace.log"; exit 1; }
# 5. Side by side.
python3 - "$OUT/aiperf/profile_export_aiperf.json" "$OUT/bench-trace.json" <<'PY'
import json, sys
a, b = json.load(open(sys.argv[1])), json.load(open(sys.argv[2]))
at, bt = a["time_to_first_token"], b["overall"]["ttft_s"]
print(f"TTFT P50/P90/P99 ms: AIPerf {at['p50']:.1f}/{at['p90']:.1f}/{at['p99']:.1f} "
      f"({at['count']} ok), bench trace {1e3*bt['p50']:.1f}/{1e3*bt['p90']:.1f}/{1e3*bt['p99']:.1f}; "
      f"P50 ratio {at['p50'] / (1e3 * bt['p50']):.2f}")
print(f"requests/s: AIPerf {a['request_throughput']['avg']:.2f}, "
      f"bench trace {b['throughput']['requests_per_s']:.2f}")
PY
