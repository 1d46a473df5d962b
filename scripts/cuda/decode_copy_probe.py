"""Does a decode step's one-token KV write copy the whole arena on this device?

Usage: decode_copy_probe.py [TOKENS,TOKENS...]
A loop shaped like one attention layer of an 8B model's decode (8 kv heads of 128 dims,
bf16; 32 query heads): each step writes the step's key and value into preallocated
arenas (`slice_update`, as kvstore's pools and mlx-lm's KVCache do) and attends one query
over the arenas' first `t` tokens through a view (MLX's fused SDPA). Three ways of queueing:
- `at-once`: step n+1 is queued while step n runs (mlx-lm's generate loop);
- `after-eval`: step n+1 is queued once step n's output is computed (kvstore's GPU default);
- `after-sync`: step n+1 is queued once the stream is synchronized (every kernel and its
  completion handler done).
If MLX cannot update an arena in place because a kernel in flight still holds it, each
write copies the whole arena: the step time grows with the arena (TOKENS). Prints one JSON
line per way and size: ms per step, peak memory over the arenas.
"""

import json
import sys
import time

import mlx.core as mx

H, HQ, D, LAYERS, STEPS = 8, 32, 128, 8, 48


def run(way, tokens):
    ks = [mx.zeros((1, H, tokens, D), dtype=mx.bfloat16) for _ in range(LAYERS)]
    vs = [mx.zeros((1, H, tokens, D), dtype=mx.bfloat16) for _ in range(LAYERS)]
    mx.eval(ks, vs)
    mx.synchronize()
    arenas = 2 * LAYERS * H * tokens * D * 2
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    start = tokens - STEPS - 1
    x = mx.ones((1, HQ, 1, D), dtype=mx.bfloat16)
    prev = None
    t0 = time.perf_counter()
    for i in range(STEPS):
        t = start + i
        h = x if prev is None else x * prev
        for layer in range(LAYERS):
            k = h[:, :H] * 0.5
            ks[layer][:, :, t : t + 1, :] = k
            vs[layer][:, :, t : t + 1, :] = k
            h = mx.fast.scaled_dot_product_attention(
                h, ks[layer][:, :, : t + 1], vs[layer][:, :, : t + 1], scale=D**-0.5
            )
        y = h.sum(axis=-1, keepdims=True)
        if way == "after-eval" and prev is not None:
            mx.eval(prev)
        if way == "after-sync" and prev is not None:
            mx.synchronize()
        mx.async_eval(y)
        prev = y
    mx.eval(prev)
    mx.synchronize()
    dt = (time.perf_counter() - t0) / STEPS
    print(json.dumps({"way": way, "tokens": tokens, "layers": LAYERS, "step_ms": round(dt * 1e3, 3),
                      "peak_over_arenas": round((mx.get_peak_memory() - base) / arenas, 2),
                      "device": str(mx.default_device())}), flush=True)


sizes = [int(s) for s in (sys.argv[1] if len(sys.argv) > 1 else "4096,16384,65536").split(",")]
for rep in range(2):
    for tokens in sizes:
        for way in ("at-once", "after-eval", "after-sync"):
            run(way, tokens)
