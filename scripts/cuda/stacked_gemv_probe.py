"""Times one-row bf16 products on the GPU: stacked projection weights (q|k|v, gate|up, as
kvstore loads them) against the separate weights mlx-lm multiplies, Llama-3-8B's shapes.
Usage: python3 stacked_gemv_probe.py [REPS]  (after device.sh's env_setup)."""
import sys, time
import mlx.core as mx

reps = int(sys.argv[1]) if len(sys.argv) > 1 else 200
H, I, KV = 4096, 14336, 1024
x = mx.random.normal((1, 1, H)).astype(mx.bfloat16)
xi = mx.random.normal((1, 1, I)).astype(mx.bfloat16)
def w(o, i):
    return (mx.random.normal((o, i)) * 0.02).astype(mx.bfloat16)
cases = {
    "qkv stacked [6144x4096]": [w(H + 2 * KV, H)],
    "q,k,v separate": [w(H, H), w(KV, H), w(KV, H)],
    "gate|up stacked [28672x4096]": [w(2 * I, H)],
    "gate, up separate": [w(I, H), w(I, H)],
    "o [4096x4096]": [w(H, H)],
    "down [4096x14336]": [w(H, I)],
    "lm_head [128256x4096]": [w(128256, H)],
}
mx.eval(x, xi, *[a for ws in cases.values() for a in ws])
def layer_ms(ws, n=32):
    # n layers' worth of products chained through a dependency, one eval per rep
    best = 1e9
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(reps // 5):
            outs = []
            for _ in range(n):
                outs += [(xi if a.shape[1] == I else x) @ a.T for a in ws]
            mx.eval(*outs)
        best = min(best, (time.perf_counter() - t) / (reps // 5) / n * 1e3)
    return best
for name, ws in cases.items():
    ms = layer_ms(ws)
    gb = sum(a.nbytes for a in ws) / 1e9
    print(f"{name:32s} {ms*1e3:8.1f} us  {gb/ms*1e3:7.0f} GB/s")
