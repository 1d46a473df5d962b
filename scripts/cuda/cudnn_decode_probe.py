"""Which attention kernel does MLX's CUDA backend run for a decode step over a KV view, and
what does it cost?

Usage: cudnn_decode_probe.py [TOKENS,TOKENS...]
One attention layer of an 8B model's decode (8 kv heads of 128 dims, bf16; 32 query heads):
one query attends over the first `t` tokens of preallocated K and V buffers through a view,
as kvstore's pools and mlx-lm's KVCache hand them to MLX's fused SDPA. MLX 0.32 takes
cuDNN's kernel for it only when the buffer's length is a multiple of 256 tokens (mlx-lm's
cache step) and its own vector kernel otherwise. Prints one JSON line per buffer kind and
length: microseconds per call (a chain of 64 calls, each one's output feeding the next
query), then one line saying whether a view that starts past its buffer's first token
gives the same output as a copy of it (MLX's cuDNN decode path re-derives the buffer from
the view and assumes it starts there).
"""

import json
import sys
import time

import mlx.core as mx

H, HQ, D, CALLS = 8, 32, 128, 64
SCALE = D**-0.5


def timed(buffer_tokens, t):
    k = mx.random.normal((1, H, buffer_tokens, D)).astype(mx.bfloat16)
    v = mx.random.normal((1, H, buffer_tokens, D)).astype(mx.bfloat16)
    q = mx.random.normal((1, HQ, 1, D)).astype(mx.bfloat16)
    mx.eval(k, v, q)
    best = None
    for _ in range(3):
        mx.synchronize()
        t0 = time.perf_counter()
        x = q
        for _ in range(CALLS):
            # The slice is computed in the same graph as the attention, as in a decode step.
            x = mx.fast.scaled_dot_product_attention(
                x, k[:, :, :t, :], v[:, :, :t, :], scale=SCALE
            )
        mx.eval(x)
        mx.synchronize()
        us = (time.perf_counter() - t0) / CALLS * 1e6
        best = us if best is None else min(best, us)
    return best


def offset_view_agrees():
    n, start, t = 1024, 256, 512
    k = mx.random.normal((1, H, n, D)).astype(mx.bfloat16)
    v = mx.random.normal((1, H, n, D)).astype(mx.bfloat16)
    q = mx.random.normal((1, HQ, 1, D)).astype(mx.bfloat16)
    mx.eval(k, v, q)
    view = mx.fast.scaled_dot_product_attention(
        q, k[:, :, start : start + t, :], v[:, :, start : start + t, :], scale=SCALE
    )
    kc = mx.contiguous(k[:, :, start : start + t, :])
    vc = mx.contiguous(v[:, :, start : start + t, :])
    mx.eval(kc, vc)
    copy = mx.fast.scaled_dot_product_attention(q, kc, vc, scale=SCALE)
    diff = mx.abs(view.astype(mx.float32) - copy.astype(mx.float32)).max().item()
    return diff


def main():
    lens = [int(x) for x in (sys.argv[1] if len(sys.argv) > 1 else "512,2048,8192,32768").split(",")]
    for t in lens:
        aligned = (t + 1 + 255) // 256 * 256
        for kind, n in (("buffer a multiple of 256 (cuDNN)", aligned), ("buffer of 256k+1 (MLX vector)", aligned + 1)):
            print(json.dumps({"tokens": t, "buffer": n, "kind": kind, "us_per_call": round(timed(n, t), 2)}), flush=True)
    try:
        diff = offset_view_agrees()
        print(json.dumps({"offset_view": "tokens 256..768 of a 1024-token buffer", "max_abs_diff_vs_copy": diff}))
    except Exception as e:  # the misread may also fault
        print(json.dumps({"offset_view": "tokens 256..768 of a 1024-token buffer", "error": str(e)}))


if __name__ == "__main__":
    main()
