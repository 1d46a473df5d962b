#!/usr/bin/env python3
"""What an online eviction policy could know on a Mooncake-format trace: its conversations,
whether they continue, and what classic policies beyond kvstore's get.

Usage: trace_conversations.py TRACE.jsonl [WINDOW_S] [CAPACITY_BLOCKS]

WINDOW_S: the first that many seconds (default: the whole file). CAPACITY_BLOCKS: the
cache's size in trace blocks (default 14563: 100 GiB of SmolLM2's f32 KV at 5/16 token
scale, the H100/H200 slice's three tiers; `kvstore bench trace --simulate` prints the
same count beside `--budget-tokens`).

Conversations: a request continues the conversation of the latest earlier request that
owns its deepest shared block past the first (every request shares the first, the system
prompt). Prints the turn-count histogram, P(another turn | k turns so far), the gaps
between turns, and P(another turn) of a first turn by its prompt and output lengths.

Policies, on trace blocks without kvstore's chain rules (a request hits its longest
cached prefix; every block it names is then used, in order): LRU, LRU-2 (the oldest
second-last use leaves first; blocks used once before all others) and ARC, beside the
ideal (unbounded) cache. `kvstore bench trace --simulate` runs kvstore's own policies
and Belady on the same requests; LRU here matches its LRU to within the re-chunking of
the last, partial block (docs/benchmarks.md, session 36).
"""

import collections
import heapq
import json
import sys
from collections import OrderedDict

BLOCK = 512  # tokens per trace block


def load(path, window_s):
    reqs = [json.loads(line) for line in open(path) if line.strip()]
    if window_s is not None:
        reqs = [r for r in reqs if r["timestamp"] < window_s * 1000]
    return reqs


def blocks(r):
    """(hash id, tokens) of each block of a request's prompt; the last may be partial."""
    n = len(r["hash_ids"])
    for d, h in enumerate(r["hash_ids"]):
        yield h, BLOCK if d < n - 1 else r["input_length"] - BLOCK * (n - 1)


def conversations(reqs):
    """Conversation id -> its turns as (arrival s, request index)."""
    owner = {}
    turns = collections.defaultdict(list)
    for i, r in enumerate(reqs):
        h = r["hash_ids"]
        cid = next((owner[h[d]] for d in range(len(h) - 1, 0, -1) if h[d] in owner), i)
        turns[cid].append((r["timestamp"] / 1000, i))
        for b in h[1:]:
            owner.setdefault(b, cid)
    return turns


def report_conversations(reqs):
    turns = conversations(reqs)
    hist = collections.Counter(min(len(t), 10) for t in turns.values())
    print(f"{len(reqs)} requests, {len(turns)} conversations; turns (10 = 10 or more):",
          dict(sorted(hist.items())))
    for k in range(1, 8):
        have = [t for t in turns.values() if len(t) >= k]
        more = sum(len(t) > k for t in have)
        print(f"  after {k} turn(s): {len(have)} conversations, P(another) = "
              f"{more / max(len(have), 1):.2f}")
    gaps = sorted(t[j + 1][0] - t[j][0] for t in turns.values() for j in range(len(t) - 1))
    if gaps:
        q = lambda p: gaps[int(p * (len(gaps) - 1))]
        print(f"  gaps between turns, s: P10 {q(0.1):.0f}, P50 {q(0.5):.0f}, "
              f"P90 {q(0.9):.0f}, max {gaps[-1]:.0f}")
    first = [(reqs[t[0][1]], len(t) > 1) for t in turns.values()]
    for field, edges in [("input_length", [0, 2000, 6000, 12000, 30000]),
                         ("output_length", [0, 10, 100, 300, 600])]:
        parts = []
        for lo, hi in zip(edges, edges[1:] + [None]):
            s = [c for r, c in first if r[field] >= lo and (hi is None or r[field] < hi)]
            label = f"{lo}+" if hi is None else f"{lo}-{hi}"
            parts.append(f"{label}: {sum(s) / max(len(s), 1):.2f} ({len(s)})")
        print(f"  first turns by {field}, P(another):", ", ".join(parts))


class Lru:
    def __init__(self, cap):
        self.cap, self.d = cap, OrderedDict()

    def has(self, h):
        return h in self.d

    def use(self, h):
        if h in self.d:
            self.d.move_to_end(h)
            return
        self.d[h] = None
        if len(self.d) > self.cap:
            self.d.popitem(last=False)


class Lru2:
    """LRU-K with K = 2: ranked by the second-last use; blocks used once rank below."""

    def __init__(self, cap):
        self.cap, self.t, self.held, self.heap, self.hist = cap, 0, set(), [], {}

    def has(self, h):
        return h in self.held

    def rank(self, h):
        a = self.hist[h]
        return (1, a[-2]) if len(a) >= 2 else (0, a[-1])

    def use(self, h):
        self.t += 1
        a = self.hist.setdefault(h, [])
        a.append(self.t)
        del a[:-2]
        self.held.add(h)
        heapq.heappush(self.heap, (self.rank(h), h))
        while len(self.held) > self.cap:
            r, x = heapq.heappop(self.heap)
            if x in self.held and self.rank(x) == r:  # else a stale entry
                self.held.remove(x)


class Arc:
    """Adaptive Replacement Cache (Megiddo and Modha, FAST'03), as the paper states it."""

    def __init__(self, cap):
        self.c, self.p = cap, 0
        self.t1, self.t2, self.b1, self.b2 = (OrderedDict() for _ in range(4))

    def has(self, h):
        return h in self.t1 or h in self.t2

    def replace(self, h):
        if self.t1 and (len(self.t1) > self.p or (h in self.b2 and len(self.t1) == self.p)):
            x, _ = self.t1.popitem(last=False)
            self.b1[x] = None
        else:
            x, _ = self.t2.popitem(last=False)
            self.b2[x] = None

    def use(self, h):
        c = self.c
        if h in self.t1:
            del self.t1[h]
            self.t2[h] = None
        elif h in self.t2:
            self.t2.move_to_end(h)
        elif h in self.b1:
            self.p = min(c, self.p + max(len(self.b2) // max(len(self.b1), 1), 1))
            self.replace(h)
            del self.b1[h]
            self.t2[h] = None
        elif h in self.b2:
            self.p = max(0, self.p - max(len(self.b1) // max(len(self.b2), 1), 1))
            self.replace(h)
            del self.b2[h]
            self.t2[h] = None
        else:
            l1 = len(self.t1) + len(self.b1)
            total = l1 + len(self.t2) + len(self.b2)
            if l1 == c:
                if len(self.t1) < c:
                    self.b1.popitem(last=False)
                    self.replace(h)
                else:
                    self.t1.popitem(last=False)
            elif total >= c:
                if total == 2 * c:
                    self.b2.popitem(last=False)
                self.replace(h)
            self.t1[h] = None


def hit_tokens(reqs, cache):
    """Prompt tokens served from the longest cached prefix of each request."""
    hit = 0
    for r in reqs:
        bl = list(blocks(r))
        for h, t in bl:
            if not cache.has(h):
                break
            hit += t
        for h, _ in bl:
            cache.use(h)
    return hit


class Unbounded:
    def __init__(self):
        self.s = set()

    def has(self, h):
        return h in self.s

    def use(self, h):
        self.s.add(h)


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    window = float(sys.argv[2]) if len(sys.argv) > 2 else None
    cap = int(sys.argv[3]) if len(sys.argv) > 3 else 14563
    reqs = load(sys.argv[1], window)
    report_conversations(reqs)
    total = sum(r["input_length"] for r in reqs)
    ideal = hit_tokens(reqs, Unbounded())
    lru = hit_tokens(reqs, Lru(cap))
    print(f"hit share of {total} prompt tokens at {cap} blocks: ideal {100 * ideal / total:.2f} %,"
          f" LRU {100 * lru / total:.2f} %")
    for name, cls in [("LRU-2", Lru2), ("ARC", Arc)]:
        h = hit_tokens(reqs, cls(cap))
        print(f"  {name} {100 * h / total:.2f} % ({h / max(lru, 1):.3f}x LRU,"
              f" {h / max(ideal, 1):.3f} of the ideal)")


if __name__ == "__main__":
    main()
