"""What the engine thread's steps cost in a `kvstore bench trace` run, from its step log.

Usage: python3 scripts/bench/step_costs.py A.json[.gz] A.steps.jsonl[.gz] [B.json B.steps ...]

For each run (a `--json` report and the `--step-log` of the same run) it prints:

- new lengths: the steps with prompt tokens whose chunk or riders had a token count no
  earlier step had, against those whose counts had all been seen, with the median launch
  CPU of each (MLX's CUDA backend builds a cuDNN attention graph per new shape: session
  39 found ~105 ms against ~35 ms; docs/cuda.md);
- prompt steps: over every step with prompt tokens, the sums of its wall time, launch,
  launch CPU, publication, admission and prefill parts, the prompt tokens they ran and
  the wall time per token, and the P90 / P99 / max step;
- mixed steps by size: over the steps that decoded rows and ran prompt tokens in one pass,
  the median wall time per prompt token less the step's publication and admission, by the
  step's prompt tokens (under 512, 512-1,023, ..., 2,048 and more): the pass's own cost, to
  compare arms whose engine threads publish and admit differently;
- engine thread: over every step of the run, the seconds the engine thread was busy and
  how they split into launches, reading and emitting picks, the prefill part, admission
  (restores inside it) and the rest, against the run's wall time, and the publication
  within those parts (taken as prefills finish and as rows retire):
  what a cache's hits saved in launches, against what its restores and publication cost
  (docs/benchmarks.md, session 43);
- first in burst: for the requests first in their burst (the first of those sharing a
  trace timestamp, so they wait for no other prompt), the medians of their TTFT and of the
  parts of the step that prefilled them (admission's CPU time and the time inside the
  admissions themselves from session 51's step logs on: 0 in older ones).

Reads nothing else; writes nothing. docs/benchmarks.md, session 40, has its figures.
"""

import gzip
import json
import statistics
import sys


def opener(path):
    # By its first bytes, not its name: `bench trace --step-log X.jsonl.gz` writes plain
    # JSON lines whatever the name (device.sh gzips the file afterwards).
    with open(path, "rb") as f:
        gzipped = f.read(2) == b"\x1f\x8b"
    return gzip.open(path, "rt") if gzipped else open(path)


def prompt_tokens(step):
    own = step["prefilled"][1] if step.get("prefilled") else 0
    return own + sum(r[1] for r in step.get("riders") or [])


def lengths(step):
    out = [step["prefilled"][1]] if step.get("prefilled") else []
    return out + [r[1] for r in step.get("riders") or []]


def pct(values, p):
    values = sorted(values)
    return values[int(p * (len(values) - 1))]


def analyse(json_path, steps_path):
    with opener(json_path) as f:
        run = json.load(f)
    with opener(steps_path) as f:
        steps = [json.loads(line)["step"] for line in f if line.strip()]
    name = steps_path.rsplit("/", 1)[-1]
    print(f"== {name}")

    seen, novel, repeated = set(), [], []
    for s in steps:
        ls = lengths(s)
        if not ls:
            continue
        new = any(n not in seen for n in ls)
        seen.update(ls)
        (novel if new else repeated).append(s["launch_cpu_us"] / 1e3)
    if novel and repeated:
        print(
            f"new lengths: {len(novel)} steps, launch CPU median {statistics.median(novel):.1f} ms;"
            f" repeated: {len(repeated)} steps, {statistics.median(repeated):.1f} ms"
        )

    prompt = [s for s in steps if prompt_tokens(s) > 0]
    if prompt:
        total = lambda key: sum(s[key] for s in prompt) / 1e6  # noqa: E731
        tokens = sum(prompt_tokens(s) for s in prompt)
        walls = [s["step_us"] / 1e3 for s in prompt]
        print(
            f"prompt steps: {len(prompt)}, {tokens} tokens; wall {total('step_us'):.1f} s"
            f" ({total('step_us') * 1e6 / tokens:.1f} µs a token), launch {total('launch_us'):.1f} s"
            f" (CPU {total('launch_cpu_us'):.1f}), publish {total('publish_us'):.2f} s,"
            f" admit {total('admit_us'):.2f} s, prefill part {total('prefill_us'):.2f} s;"
            f" step P90 / P99 / max {pct(walls, 0.9):.0f} / {pct(walls, 0.99):.0f} / {max(walls):.0f} ms"
        )

    buckets = {}
    for s in prompt:
        if s.get("decoded"):
            n = prompt_tokens(s)
            own = s["step_us"] - s["publish_us"] - s["admit_us"]
            buckets.setdefault(min(n // 512, 4), []).append(own / n)
    if buckets:
        parts = [
            f"{k * 512}{'+' if k == 4 else f'-{k * 512 + 511}'}: {statistics.median(v):.1f} ({len(v)})"
            for k, v in sorted(buckets.items())
        ]
        print("mixed steps, µs a prompt token less publication and admission (steps): " + ", ".join(parts))

    total_all = lambda key: sum(s.get(key, 0) or 0 for s in steps) / 1e6  # noqa: E731
    busy = total_all("step_us")
    parts = ["launch_us", "emit_us", "prefill_us", "admit_us"]
    rest = busy - sum(total_all(k) for k in parts)
    wall = run.get("wall_s") or 0
    print(
        f"engine thread: busy {busy:.1f} s" + (f" of {wall:.1f} s wall ({busy / wall:.0%})" if wall else "")
        + f": launch {total_all('launch_us'):.1f}, emit {total_all('emit_us'):.1f},"
        f" prefill part {total_all('prefill_us'):.1f}, admission {total_all('admit_us'):.1f},"
        f" the rest {rest:.1f} s; publication, within those parts, {total_all('publish_us'):.1f} s"
    )

    prefilled_in = {}
    for s in steps:
        ids = ([s["prefilled"][0]] if s.get("prefilled") else []) + [
            r[0] for r in s.get("riders") or []
        ]
        for i in ids:
            prefilled_in.setdefault(i, s)
    seen_ts, firsts = set(), []
    for r in sorted(run["requests"], key=lambda r: (r["timestamp_ms"], r["index"])):
        first = r["timestamp_ms"] not in seen_ts
        seen_ts.add(r["timestamp_ms"])
        if first and r.get("ttft_s") and r.get("request_id") in prefilled_in:
            firsts.append((r, prefilled_in[r["request_id"]]))
    if firsts:
        med = lambda f: statistics.median(f(r, s) for r, s in firsts)  # noqa: E731
        print(
            f"first in burst: {len(firsts)} requests, TTFT {med(lambda r, s: r['ttft_s']):.3f} s;"
            f" their step {med(lambda r, s: s['step_us']) / 1e3:.1f} ms: publish"
            f" {med(lambda r, s: s['publish_us']) / 1e3:.1f}, admit {med(lambda r, s: s['admit_us']) / 1e3:.1f}"
            # step logs before session 51 lack admission's CPU and its admissions' own time
            f" (CPU {med(lambda r, s: s.get('admit_cpu_us', 0)) / 1e3:.1f},"
            f" in the admissions {med(lambda r, s: s.get('begin_us', 0)) / 1e3:.1f}),"
            f" prefill part {med(lambda r, s: s['prefill_us']) / 1e3:.1f} ms;"
            f" {med(lambda r, s: prompt_tokens(s)):.0f} prompt tokens in it"
        )


def main(args):
    if not args or len(args) % 2:
        sys.exit(__doc__)
    for i in range(0, len(args), 2):
        analyse(args[i], args[i + 1])


if __name__ == "__main__":
    main(sys.argv[1:])
