"""The kernels of a decode step, from Nsight Compute's per-kernel times (`device.sh nk`).

Usage: kernel_steps.py ARM=nk-ARM.csv.gz [ARM=...] [--lm-head-us 150]

Each CSV is `ncu --metrics gpu__time_duration.sum --csv --page raw --print-units base` of a
run that prefilled a prompt and then decoded tokens one at a time (one row). A decode step
ends with the LM head's product, the only kernel of a step that takes longer than
--lm-head-us; the steps are the runs of kernels between two of them, after the last kernel
of the prefill (which has longer ones). Prints, per arm, the median step's kernel time and
count, and the time per kernel kind (the kernel's name without its template arguments and
its arguments) per step, the kinds that differ most between the arms first.
"""

import csv
import gzip
import re
import statistics
import sys


def kernels(path):
    """(name, ns) of every kernel in launch order."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", errors="replace") as f:
        lines = [l for l in f if l.startswith('"')]
    rows = list(csv.reader(lines))
    head = rows[0]
    names = [c for c in ("Kernel Name", "Function Name", "Name") if c in head]
    if not names or "gpu__time_duration.sum" not in head:
        sys.exit(f"{path}: no kernel name or gpu__time_duration.sum column in {head}")
    name, dur = head.index(names[0]), head.index("gpu__time_duration.sum")
    ident = head.index("ID")
    out = []
    for r in rows[1:]:
        if not r[ident].isdigit():
            continue  # the units row
        out.append((r[name], float(r[dur].replace(",", ""))))
    return out


def kind(name):
    """A kernel's name without template arguments and arguments ("void " dropped)."""
    name = re.sub(r"^void ", "", name)
    depth, short = 0, []
    for c in name:
        if c in "<(":
            depth += 1
        elif c in ">)":
            depth -= 1
        elif depth == 0:
            short.append(c)
    return "".join(short).strip() or name[:60]


def steps(ks, lm_head_ns):
    """The decode steps: kernels after each LM-head product up to and with the next one."""
    heads = [i for i, (_, ns) in enumerate(ks) if ns >= lm_head_ns]
    out = []
    for a, b in zip(heads, heads[1:]):
        out.append(ks[a + 1 : b + 1])
    # Segments before the decode settles (prefill, warm-up) are far longer: keep the
    # steps of the modal kernel count.
    if not out:
        return out
    out = [s for s in out if len(s) >= 8]  # runs of the prefill's long kernels
    if not out:
        return out
    counts = [len(s) for s in out]
    mode = statistics.mode(counts)
    return [s for s in out if len(s) == mode]


def main():
    args = sys.argv[1:]
    lm_head_us = 150.0
    if "--lm-head-us" in args:
        i = args.index("--lm-head-us")
        lm_head_us = float(args[i + 1])
        del args[i : i + 2]
    arms = {}
    for a in args:
        arm, path = a.split("=", 1)
        st = steps(kernels(path), lm_head_us * 1000)
        if not st:
            sys.exit(f"{arm}: no decode steps found in {path}")
        per_kind = {}
        for s in st:
            tally = {}
            for n, ns in s:
                k = kind(n)
                t, c = tally.get(k, (0.0, 0))
                tally[k] = (t + ns, c + 1)
            for k, (t, c) in tally.items():
                per_kind.setdefault(k, []).append((t, c))
        total = statistics.median(sum(ns for _, ns in s) for s in st)
        arms[arm] = (len(st), len(st[0]), total, per_kind)
        print(f"{arm}: {len(st)} steps of {len(st[0])} kernels, median kernel time "
              f"{total / 1e3:.1f} us a step")
    kinds = sorted({k for _, _, _, pk in arms.values() for k in pk})

    def cell(arm, k):
        pk = arms[arm][3].get(k)
        if not pk:
            return 0.0, 0
        return (statistics.median(t for t, _ in pk) / 1e3, round(statistics.median(c for _, c in pk)))

    names = list(arms)
    rows = []
    for k in kinds:
        cells = [cell(a, k) for a in names]
        spread = max(c[0] for c in cells) - min(c[0] for c in cells)
        rows.append((spread, k, cells))
    rows.sort(key=lambda r: (-r[0], r[1]))
    print("| kernel kind | " + " | ".join(f"{a} us/step (count)" for a in names) + " |")
    print("|---|" + "---:|" * len(names))
    for _, k, cells in rows:
        print(f"| {k[:70]} | " + " | ".join(f"{t:.1f} ({c})" for t, c in cells) + " |")


if __name__ == "__main__":
    main()
