"""What a new shape costs MLX's CUDA backend on the host: causal SDPA (cuDNN for bf16) and
matmuls of the 8B's widths, each shape run twice, timed around `mx.eval`.

Usage: shape_cost_probe.py [REPEATS]

A prefill pass under the Mooncake trace meets a new (query, key) length pair in most steps
(docs/benchmarks.md, session 39: steps with a prompt length not seen before took ~105 ms of
the engine thread's CPU to launch, repeated lengths ~35 ms). MLX caches a cuDNN SDPA graph
per exact shape and a cuBLASLt plan per matmul shape; this probe times the first call of a
shape against its second, for attention and for the products apart.
"""

import json
import sys
import time

import mlx.core as mx


def timed(f):
    t = time.perf_counter()
    mx.eval(f())
    mx.synchronize()
    return (time.perf_counter() - t) * 1e3


def main():
    reps = int(sys.argv[1]) if len(sys.argv) > 1 else 6
    dt = mx.bfloat16
    hq, hkv, d, hidden, inter = 32, 8, 128, 4096, 14336
    w_qkv = mx.random.normal((hq * d + 2 * hkv * d, hidden)).astype(dt)
    w_up = mx.random.normal((2 * inter, hidden)).astype(dt)
    mx.eval(w_qkv, w_up)
    # warm-up of each path with one shape
    q = mx.random.normal((1, hq, 64, d)).astype(dt)
    k = mx.random.normal((1, hkv, 512, d)).astype(dt)
    timed(lambda: mx.fast.scaled_dot_product_attention(q, k, k, scale=d ** -0.5, mask="causal"))
    x = mx.random.normal((1, 64, hidden)).astype(dt)
    timed(lambda: x @ w_qkv.T)
    rows = []
    for i in range(reps):
        ql, kl = 100 + 37 * i, 1000 + 391 * i  # lengths no earlier call used
        q = mx.random.normal((1, hq, ql, d)).astype(dt)
        k = mx.random.normal((1, hkv, kl, d)).astype(dt)
        v = mx.random.normal((1, hkv, kl, d)).astype(dt)
        x = mx.random.normal((1, ql, hidden)).astype(dt)
        mx.eval(q, k, v, x)
        sd = lambda: mx.fast.scaled_dot_product_attention(q, k, v, scale=d ** -0.5, mask="causal")
        mm = lambda: [x @ w_qkv.T, x @ w_up.T]
        rows.append({"q_len": ql, "k_len": kl,
                     "sdpa_first_ms": timed(sd), "sdpa_again_ms": timed(sd),
                     "matmuls_first_ms": timed(mm), "matmuls_again_ms": timed(mm)})
        print(json.dumps(rows[-1]), flush=True)
    med = lambda key: sorted(r[key] for r in rows)[len(rows) // 2]
    print(json.dumps({k: med(k) for k in rows[0] if k.endswith("_ms")} | {"median_of": len(rows)}))


if __name__ == "__main__":
    main()
