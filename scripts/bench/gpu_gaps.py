"""Where a decode step's GPU time goes, from an Nsight Systems trace (`device.sh ns`) or a
CUPTI trace (`device.sh ct`, scripts/cuda/cupti_trace.c).

Usage: gpu_gaps.py ARM=RUN.sqlite|RUN.txt[.gz] [ARM=...] [--steps 48] [--head-us 200]
       [--kernels 6]

Each file is `nsys export --type sqlite` of a run that prefilled a prompt and then decoded
one row, traced with `--trace cuda --cuda-graph-trace node` (every kernel of a CUDA graph is
its own record), or the text lines cupti_trace.c writes (the same records, and the graph
launch each kernel ran in: gaps are then also split by whether they fall inside one launch
or between two). A decode step ends with the LM head's product, the longest kernel of a
step; the last --steps kernels longer than --head-us of one name (the longest of those)
mark the last steps (the prefill's kernels come before them). Per arm it prints the median
step: its wall time (one LM head's end to the next), the --kernels kernels with the most
time a step (each kernel name's median), the time some GPU work ran (kernels,
copies and memsets merged), the time the GPU sat idle and in how many gaps, the largest
gaps with the kernels on either side, the copies and memsets a step (and their directions), the CUDA API calls the host made between
two LM heads (graph launches, synchronizations, allocations) with their host time, and the
GPU page faults of managed memory where the trace has them. Reads the trace only: the
question it answers is whether the GPU waits, and on what, not how long a kernel takes
(kernel_steps.py has that, from Nsight Compute).
"""

import bisect
import gzip
import sqlite3
import statistics
import sys
from collections import Counter, defaultdict

COPY_KINDS = {1: "HtoD", 2: "DtoH", 8: "DtoD", 10: "PtoP"}


def tables(db):
    return {r[0] for r in db.execute("select name from sqlite_master where type='table'")}


def strings(db):
    return dict(db.execute("select id, value from StringIds"))


def kernels(db, names):
    """(start, end, name) of every kernel, in start order."""
    rows = db.execute(
        "select start, end, coalesce(shortName, demangledName) from CUPTI_ACTIVITY_KIND_KERNEL"
        " order by start"
    )
    return [(s, e, names.get(n, str(n))) for s, e, n in rows]


def activity(db, have, table, label):
    """(start, end, label) of a table's records, if the trace has the table."""
    if table not in have:
        return []
    cols = {r[1] for r in db.execute(f"pragma table_info({table})")}
    if "copyKind" in cols:
        rows = db.execute(f"select start, end, copyKind, bytes from {table}")
        return [(s, e, f"{label} {COPY_KINDS.get(k, k)} {b}B") for s, e, k, b in rows]
    return [(s, e, label) for s, e in db.execute(f"select start, end from {table}")]


def api_calls(db, have, names):
    """(start, end, name) of the CUDA runtime and driver calls the host made."""
    out = []
    for t in ("CUPTI_ACTIVITY_KIND_RUNTIME", "CUPTI_ACTIVITY_KIND_DRIVER"):
        if t in have:
            out += [(s, e, names.get(n, str(n))) for s, e, n in
                    db.execute(f"select start, end, nameId from {t}")]
    return sorted(out)


def page_faults(db, have):
    """Start times of GPU page faults of managed memory, if traced."""
    for t in ("CUDA_UM_GPU_PAGE_FAULT_EVENTS", "CUPTI_ACTIVITY_KIND_UNIFIED_MEMORY_COUNTER"):
        if t in have:
            cols = {r[1] for r in db.execute(f"pragma table_info({t})")}
            if "start" in cols:
                return sorted(r[0] for r in db.execute(f"select start from {t}"))
    return None


def merged_busy(intervals, lo, hi):
    """Time within [lo, hi) covered by at least one interval, and the gaps between them."""
    spans = sorted((max(s, lo), min(e, hi)) for s, e, _ in intervals if e > lo and s < hi)
    busy, gaps, cur_s, cur_e = 0, [], None, None
    for s, e in spans:
        if cur_e is None:
            cur_s, cur_e = s, e
            if s > lo:
                gaps.append((lo, s))
        elif s > cur_e:
            busy += cur_e - cur_s
            gaps.append((cur_e, s))
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        busy += cur_e - cur_s
        if cur_e < hi:
            gaps.append((cur_e, hi))
    return busy, gaps


def short(name, n=48):
    return name if len(name) <= n else name[: n - 1] + "…"


def load_sqlite(path):
    """Kernels, copies and memsets, API calls, page faults and (None) graph ids of an nsys
    export."""
    db = sqlite3.connect(path)
    have = tables(db)
    if "CUPTI_ACTIVITY_KIND_KERNEL" not in have:
        return None
    names = strings(db)
    others = activity(db, have, "CUPTI_ACTIVITY_KIND_MEMCPY", "copy") + activity(
        db, have, "CUPTI_ACTIVITY_KIND_MEMSET", "memset")
    return kernels(db, names), others, api_calls(db, have, names), page_faults(db, have), None


def load_cupti_text(path):
    """The same from cupti_trace.c's lines, with each kernel's CUDA graph launch: the
    correlation id of the launch call (0: not in a graph). Not the graph id, which MLX's
    reuse of one instantiated graph for layers of the same topology repeats from launch to
    launch."""
    opener = gzip.open if path.endswith(".gz") else open
    ks, others, api, call_names = [], [], [], {}
    with opener(path, "rt", errors="replace") as f:
        for line in f:
            p = line.split()
            if not p or p[0] == "#":
                continue
            if p[0] == "K":
                launch = int(p[6]) if int(p[3]) != 0 else 0
                ks.append((int(p[1]), int(p[2]), " ".join(p[7:]), launch))
            elif p[0] == "A":
                api.append((int(p[1]), int(p[2]), (p[3], p[4])))
            elif p[0] == "N":
                call_names[(p[1], p[2])] = p[3] if len(p) > 3 else "?"
            elif p[0] == "C":
                kind = COPY_KINDS.get(int(p[3]), p[3])
                others.append((int(p[1]), int(p[2]), f"copy {kind} {p[4]}B"))
            elif p[0] == "M":
                others.append((int(p[1]), int(p[2]), "memset"))
    if not ks:
        return None
    ks.sort()
    api = sorted((s, e, call_names.get(k, f"{k[0]}{k[1]}")) for s, e, k in api)
    return [k[:3] for k in ks], others, api, None, [k[3] for k in ks]


def arm_report(label, path, steps, head_us, kernels_shown=6):
    loaded = load_sqlite(path) if path.endswith(".sqlite") else load_cupti_text(path)
    if loaded is None:
        print(f"== {label}: {path} has no kernel records")
        return None
    ks, others, api, faults, launches = loaded
    heads = [k for k in ks if (k[1] - k[0]) > head_us * 1000]
    if len(heads) < 3:
        print(f"== {label}: only {len(heads)} kernels over {head_us} µs: no decode steps found")
        return None
    # Only the LM head marks a step: of the kernels over --head-us in the decode's part, the
    # one with the longest median (another long kernel once a step, such as an embedding
    # gather waiting on managed memory, would otherwise split each step in two).
    by_name = defaultdict(list)
    for k in heads[-(steps + 1):]:
        by_name[k[2]].append(k[1] - k[0])
    head_name = max(by_name, key=lambda n: (statistics.median(by_name[n]), len(by_name[n])))
    heads = [k for k in heads if k[2] == head_name]
    if len(heads) < 3:
        print(f"== {label}: only {len(heads)} LM heads ({short(head_name)}): no decode steps found")
        return None
    heads = heads[-(steps + 1):]
    everything = ks + others
    starts = [k[0] for k in ks]
    walls, busies, gap_counts, idle, ksums, by_kernel = [], [], [], [], [], []
    gap_sites = Counter()
    # idle a step inside one CUDA graph launch / between two; launches a step
    within_graph, between_graphs, graph_changes = [], [], []
    copies, api_count, api_time = Counter(), Counter(), defaultdict(int)
    fault_n = []
    for a, b in zip(heads, heads[1:]):
        lo, hi = a[1], b[1]
        busy, gaps = merged_busy(everything, lo, hi)
        walls.append(hi - lo)
        # every kernel from the LM head that opens the step on, clipped to the step
        step_ks = ks[bisect.bisect_left(starts, a[0]):bisect.bisect_left(starts, hi)]
        ksums.append(sum(min(e, hi) - max(s, lo) for s, e, _ in step_ks if e > lo))
        per_name = defaultdict(int)
        for s, e, name in step_ks:
            if e > lo:
                per_name[name] += min(e, hi) - max(s, lo)
        by_kernel.append(per_name)
        busies.append(busy)
        idle.append(hi - lo - busy)
        gap_counts.append(sum(1 for g in gaps if g[1] - g[0] > 5000))
        if launches is not None:
            i0, i1 = bisect.bisect_left(starts, lo), bisect.bisect_left(starts, hi)
            graph_changes.append(
                sum(1 for i in range(i0 + 1, i1) if launches[i] != launches[i - 1]))
        w = b2 = 0
        for gs, ge in gaps:
            i = bisect.bisect_right(starts, gs) - 1
            j = bisect.bisect_left(starts, ge)
            if launches is not None:
                if 0 <= i and j < len(ks) and launches[i] == launches[j] != 0:
                    w += ge - gs
                else:
                    b2 += ge - gs
            if ge - gs <= 5000:
                continue
            before = ks[i] if i >= 0 else None
            after = ks[j] if j < len(ks) else None
            site = (short(before[2]) if before else "-", short(after[2]) if after else "-")
            gap_sites[site] += ge - gs
        within_graph.append(w)
        between_graphs.append(b2)
        for s, e, n in others:
            if lo <= s < hi:
                copies[n.rsplit(" ", 1)[0]] += 1
        for s, e, n in api:
            if lo <= s < hi:
                api_count[n] += 1
                api_time[n] += e - s
        if faults is not None:
            fault_n.append(sum(1 for t in faults if lo <= t < hi))
    n = len(walls)
    med = statistics.median
    print(f"== {label}: {n} decode steps ({path})")
    print(f"   step wall median {med(walls) / 1e3:.0f} µs, mean {statistics.mean(walls) / 1e3:.0f};"
          f" GPU busy median {med(busies) / 1e3:.0f} µs ({med(busies) / med(walls):.0%});"
          f" idle median {med(idle) / 1e3:.0f} µs in {med(gap_counts):.0f} gaps over 5 µs")
    print(f"   kernel time a step, summed: median {med(ksums) / 1e3:.0f} µs (over the busy time:"
          f" kernels that ran side by side)")
    names = set().union(*by_kernel)
    per_kernel = {k: med([d.get(k, 0) for d in by_kernel]) for k in names}
    print("   kernel time a step by kernel (median µs, the largest):")
    for k in sorted(per_kernel, key=lambda k: -per_kernel[k])[:kernels_shown]:
        print(f"     {per_kernel[k] / 1e3:8.1f}  {short(k)}")
    print(f"   kernels a step: {sum(1 for k in ks if heads[0][1] < k[0] <= heads[-1][1]) / n:.0f}")
    if launches is not None:
        print(f"   CUDA graph launches a step (runs of kernels): median {med(graph_changes) + 1:.0f};"
              f" idle inside a launch median {med(within_graph) / 1e3:.0f} µs, between launches"
              f" {med(between_graphs) / 1e3:.0f} µs")
    print("   where the GPU waited (idle µs a step, summed over gaps over 5 µs, by the kernels"
          " on either side):")
    for (before, after), t in gap_sites.most_common(8):
        print(f"     {t / n / 1e3:8.1f}  after {before}  before {after}")
    if copies:
        print("   copies and memsets a step: " + ", ".join(
            f"{k} {v / n:.1f}" for k, v in copies.most_common(6)))
    print("   host API calls a step (count, host µs):")
    for k, v in sorted(api_count.items(), key=lambda kv: -api_time[kv[0]])[:10]:
        print(f"     {v / n:7.1f}  {api_time[k] / n / 1e3:8.1f}  {k}")
    # runtime calls only: each also shows up as the driver call it makes
    graph_calls = {w: sum(v for k, v in api_count.items() if k.startswith("cuda") and w in k.lower())
                   for w in ("graphlaunch", "graphexecupdate", "graphinstantiate")}
    print("   CUDA graph launches / exec updates / instantiations a step: "
          + " / ".join(f"{graph_calls[w] / n:.1f}" for w in graph_calls))
    if faults is not None:
        print(f"   GPU page faults of managed memory a step: median {med(fault_n)}")
    else:
        print("   (no page-fault records in this trace)")
    return med(walls), med(busies)


def main(argv):
    steps, head_us, kernels_shown, arms = 48, 200.0, 6, []
    it = iter(argv)
    for a in it:
        if a == "--steps":
            steps = int(next(it))
        elif a == "--head-us":
            head_us = float(next(it))
        elif a == "--kernels":
            kernels_shown = int(next(it))
        elif "=" in a:
            arms.append(a.split("=", 1))
        else:
            sys.exit(__doc__)
    if not arms:
        sys.exit(__doc__)
    for label, path in arms:
        arm_report(label, path, steps, head_us, kernels_shown)


if __name__ == "__main__":
    main(sys.argv[1:])
