"""Where a paged decode step's constant ~11 us over a contiguous cache goes on a GPU.

`kvstore bench cache --only decode` on the H200 measures the paged step (arena
[H, cap, D], written with slice_update, read as a slice with a leading axis added) 11-14 us
slower than mlx-lm's contiguous cache ([1, H, cap, D]) at every context (1K-32K), which
points at something per step, not per byte. This probe times, with MLX's Python API and
no kvstore, one step (write one token, attend over the prefix) of SmolLM2's attention
shape (9 query heads, 3 kv heads, d 64, f32) four ways:

  contiguous : [1, H, cap, D] arrays, slice_update, slice view            (mlx-lm)
  paged      : [H, cap, D] arrays, the token reshaped to [H, 1, D], slice, expand_dims
  paged-rs   : as paged, the view reshaped to [1, H, n, D] instead of expand_dims
  paged-4d   : [1, H, cap, D] arrays reached through the paged bookkeeping's slices

Usage: python3 paged_view_probe.py [LENS]   (default 1024,4096,16384,32768)
"""
import sys
import time

import mlx.core as mx

H, HQ, D = 3, 9, 64
SCALE = 1.0 / D ** 0.5
STEPS = 60


def run(kind, n):
    cap = n + STEPS + 64
    four = kind in ("contiguous", "paged-4d")
    shape = (1, H, cap, D) if four else (H, cap, D)
    k_arena, v_arena = mx.zeros(shape), mx.zeros(shape)
    pk, pv = mx.random.normal((1, H, n, D)), mx.random.normal((1, H, n, D))
    if four:
        k_arena[:, :, :n, :] = pk
        v_arena[:, :, :n, :] = pv
    else:
        k_arena[:, :n, :] = pk[0]
        v_arena[:, :n, :] = pv[0]
    q = mx.random.normal((1, HQ, 1, D))
    sk, sv = mx.random.normal((1, H, 1, D)), mx.random.normal((1, H, 1, D))
    mx.eval(k_arena, v_arena, q, sk, sv)
    times = []
    length = n
    for _ in range(STEPS):
        t = time.perf_counter()
        if four:
            k_arena[:, :, length:length + 1, :] = sk
            v_arena[:, :, length:length + 1, :] = sv
            k, v = k_arena[:, :, :length + 1, :], v_arena[:, :, :length + 1, :]
        else:
            k_arena[:, length:length + 1, :] = sk.reshape(H, 1, D)
            v_arena[:, length:length + 1, :] = sv.reshape(H, 1, D)
            kv = k_arena[:, :length + 1, :], v_arena[:, :length + 1, :]
            if kind == "paged":
                k, v = (mx.expand_dims(a, 0) for a in kv)
            else:
                k, v = (a.reshape(1, H, length + 1, D) for a in kv)
        out = mx.fast.scaled_dot_product_attention(q, k, v, scale=SCALE)
        mx.eval(out)
        times.append(time.perf_counter() - t)
        length += 1
    times = sorted(times[5:])
    return times[len(times) // 2] * 1e3


def main():
    lens = [int(x) for x in (sys.argv[1] if len(sys.argv) > 1 else "1024,4096,16384,32768").split(",")]
    print(f"mlx {mx.__version__} {mx.default_device()}")
    kinds = ["contiguous", "paged", "paged-rs", "paged-4d"]
    print("tokens " + " ".join(f"{k:>11}" for k in kinds) + "   (ms, median of a step)")
    for rnd in range(2):
        for n in lens:
            ms = [run(k, n) for k in kinds]
            print(f"{n:>6} " + " ".join(f"{m:>11.4f}" for m in ms) + f"   round {rnd + 1}")


if __name__ == "__main__":
    main()
