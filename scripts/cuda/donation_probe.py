"""Does MLX update a KV arena in place while the step before is still in flight?

Usage: donation_probe.py [GIB]
A decode loop writes one token's keys into a GIB-sized arena (`a[:, i] = v`, MLX's
slice_update) and reads a reduction over the arena, three ways: each step evaluated and
waited for before the next is built (synchronous), each step queued with async_eval while
the previous one's result is read (pipelined, as kvstore's engine and mlx-lm decode), and
pipelined with an explicit wait for the previous step's arena before the write. If MLX
cannot donate the arena (a kernel in flight still holds it), every write copies the whole
arena: the step time grows with GIB (~0.3 ms per GiB on an H200) and the peak memory is
twice the arena. Prints one JSON line per way.
"""

import json
import sys
import time

import mlx.core as mx

gib = float(sys.argv[1]) if len(sys.argv) > 1 else 1.0
H, D = 4, 64
T = int(gib * (1 << 30) / (H * D * 4))
STEPS = 64


def run(way):
    a = mx.zeros((H, T, D), dtype=mx.float32)
    mx.eval(a)
    mx.synchronize()
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    prev = None
    t0 = time.perf_counter()
    for i in range(STEPS):
        v = mx.full((H, 1, D), float(i + 1))
        if way == "pipelined+wait" and prev is not None:
            mx.eval(prev)
        a[:, i : i + 1, :] = v
        y = a[:, : i + 1, :].sum()
        if way == "synchronous":
            mx.eval(y)
            y.item()
        else:
            mx.async_eval(y)
            if prev is not None:
                prev.item()
            prev = y
    if prev is not None:
        prev.item()
    mx.synchronize()
    dt = (time.perf_counter() - t0) / STEPS
    want = sum(range(1, STEPS + 1)) * H * D
    got = a.sum().item()
    print(json.dumps({"way": way, "arena_gib": gib, "step_ms": round(dt * 1e3, 3),
                      "peak_over_arena": round((mx.get_peak_memory() - base) / (H * T * D * 4), 2),
                      "correct": abs(got - want) < 1e-3 * want, "device": str(mx.default_device())}),
          flush=True)


for way in ("synchronous", "pipelined", "pipelined+wait", "synchronous", "pipelined"):
    run(way)
