"""Where each request's time to first token went, step by step, from `kvstore bench trace
--json A.json --step-log A.steps.jsonl[.gz]` (in process).

Usage: python3 scripts/bench/ttft_steps.py A.json A.steps.jsonl[.gz] [B.json B.steps.jsonl ...]

For every answered request it finds the engine steps that started between its sending and
its first token, and splits them: steps that prefilled it (its chunks, or it as a rider)
against steps before its first chunk (decode steps and other prompts' passes it waited
behind), and in the steps that prefilled it, the prompt tokens of the others that shared
the pass. Prints the medians per place in a burst (requests with one trace timestamp), so
two arms of one slice can be read side by side. Reads nothing else; writes nothing.
"""

import json
import statistics
import sys
from bisect import bisect_left, bisect_right

from step_costs import opener  # gzipped or not, by the file's first bytes


def load_steps(path):
    with opener(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def place_name(k):
    return "1st" if k == 0 else "2nd-4th" if k < 4 else "5th-8th" if k < 8 else "9th+"


def analyse(json_path, steps_path):
    with opener(json_path) as f:
        run = json.load(f)
    by_engine = {}
    for s in load_steps(steps_path):
        by_engine.setdefault(s["engine"], []).append(s)
    for steps in by_engine.values():
        steps.sort(key=lambda s: s["t_s"])
    starts = {e: [s["t_s"] for s in steps] for e, steps in by_engine.items()}
    places, seen = {}, {}
    for r in run["requests"]:
        k = seen.get(r["timestamp_ms"], 0)
        seen[r["timestamp_ms"]] = k + 1
        places[r["index"]] = place_name(k)
    rows = {}
    for r in run["requests"]:
        if r.get("error") or r.get("ttft_s") is None or r.get("request_id") is None:
            continue
        e, rid = r.get("engine") or 0, r["request_id"]
        steps, t = by_engine.get(e, []), starts.get(e, [])
        lo, hi = bisect_left(t, r["sent_s"]), bisect_right(t, r["sent_s"] + r["ttft_s"])
        window = steps[lo:hi]
        own, before, shared, first_own = 0, 0, 0, None
        for i, s in enumerate(window):
            st = s["step"]
            mine = {st["prefilled"][0]} if st["prefilled"] else set()
            mine |= {x[0] for x in st["riders"]}
            if rid in mine:
                own += 1
                first_own = i if first_own is None else first_own
                pass_tokens = (st["prefilled"][1] if st["prefilled"] else 0) + sum(x[1] for x in st["riders"])
                mine_tokens = (st["prefilled"][1] if st["prefilled"] and st["prefilled"][0] == rid else 0) + sum(
                    x[1] for x in st["riders"] if x[0] == rid)
                shared += pass_tokens - mine_tokens
        if first_own is not None:
            before = first_own
            wait_s = window[first_own]["t_s"] - r["sent_s"]
        else:
            wait_s = r["ttft_s"]
        rows.setdefault(places[r["index"]], []).append(
            (r["ttft_s"], wait_s, before, own, shared, len(window)))
    return run.get("label") or json_path, rows


def main(argv):
    if len(argv) < 2 or len(argv) % 2:
        sys.exit(__doc__)
    print("place     requests  TTFT P50  before its first chunk: s / steps  its prefill steps  others' tokens in its passes  steps in its TTFT")
    for a in range(0, len(argv), 2):
        label, rows = analyse(argv[a], argv[a + 1])
        print(f"== {label}")
        for place in ["1st", "2nd-4th", "5th-8th", "9th+"]:
            v = rows.get(place)
            if not v:
                continue
            med = lambda i: statistics.median(x[i] for x in v)
            print(f"{place:9s} {len(v):8d}  {med(0):7.3f}s  {med(1):14.3f}s / {med(2):5.1f}  {med(3):17.1f}  {med(4):28.0f}  {med(5):17.1f}")


if __name__ == "__main__":
    main(sys.argv[1:])
