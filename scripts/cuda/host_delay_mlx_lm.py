"""mlx-lm's decode with host work added per token: the reference for KVSTORE_PROBE_HOST_US.

Usage: host_delay_mlx_lm.py MODEL_DIR PROMPT_LEN DECODE_TOKENS SPIN_US[,SPIN_US...]

For each spin, decodes DECODE_TOKENS greedy tokens after a PROMPT_LEN-token prompt through
mlx-lm's `generate_step` (the loop `stream_generate` runs: step n+1 queued with
`mx.async_eval` before token n is read) and spins SPIN_US µs of host time after each token
is read, where the device is busy with the step queued just before. Prints one JSON object a
spin: decode tok/s and the mean step. A pipelined loop hides the spin until the host's share
passes the device's (engine/src/host_probe.rs, docs/benchmarks.md session 39).
"""

import json
import sys
import time

import mlx.core as mx
from mlx_lm import load
from mlx_lm.generate import generate_step
from mlx_lm.sample_utils import make_sampler


def spin(us):
    until = time.perf_counter() + us / 1e6
    while time.perf_counter() < until:
        pass


def main():
    folder, plen, decode = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    spins = [int(x) for x in sys.argv[4].split(",")]
    model, tok = load(folder)
    base = tok.encode("The quick brown fox jumps over the lazy dog. " * 400, add_special_tokens=False)
    prompt = mx.array((base * (plen // len(base) + 1))[:plen])
    sampler = make_sampler(temp=0.0)
    for _ in generate_step(prompt[:16], model, max_tokens=4, sampler=sampler):  # warm-up
        pass
    for us in spins:
        times = []
        for n, _ in enumerate(generate_step(prompt, model, max_tokens=decode, sampler=sampler)):
            times.append(time.perf_counter())
            spin(us)
        steps = [b - a for a, b in zip(times, times[1:])]
        mean = sum(steps) / len(steps)
        print(json.dumps({"spin_us": us, "prompt_tokens": plen, "decode_tokens": len(times),
                          "decode_tok_per_s": 1 / mean, "mean_step_ms": mean * 1e3}), flush=True)


if __name__ == "__main__":
    main()
