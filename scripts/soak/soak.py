#!/usr/bin/env python3
"""Soak test: `kvstore serve` under a bounded mixed load on loopback, sampled over time.

Starts the server on a fresh store with small tier budgets (so eviction, spills and SSD
reads happen all the time), runs client threads until the deadline, and every
`--interval` seconds records the server's resident memory, open file descriptors, threads,
the store's bytes on disk, MLX's live bytes and the request counters. Writes
`soak.csv`, `soak.json` (summary + verdict) and `soak.svg` (the plot) to `--out`.

Flat means: after the warm-up (the first 10 % of the run), the last quarter's mean RSS is
within 10 % of the second quarter's, open fds never exceed the warm-up's maximum by more
than the clients' connections, the store's accounted block bytes stay within the SSD budget
at every sample and the block files within it after exit, and no request failed with a 5xx,
a transport error or a wrong answer. Exit status 1 otherwise.

Standard library only. Usage (from the repository root, after `cargo build --release`):

    python3 scripts/soak/soak.py --minutes 30 --out docs/soak
"""

import argparse
import csv
import http.client
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

TOPICS = [
    "the block store", "a paged KV cache", "prefix reuse", "the write-behind queue",
    "checksums", "eviction", "the scheduler", "continuous batching", "restarts",
]


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--minutes", type=float, default=30.0)
    p.add_argument("--interval", type=float, default=10.0, help="seconds between samples")
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--model", default=os.path.join(ROOT, "engine/tests/goldens/tiny-qwen3"))
    p.add_argument("--bin", default=os.path.join(ROOT, "target/release/kvstore"))
    p.add_argument("--ram-budget", default="2MiB")
    p.add_argument("--ssd-budget", default="16MiB")
    p.add_argument("--out", default=os.path.join(ROOT, "target/soak"))
    return p.parse_args()


class Stats:
    def __init__(self):
        self.lock = threading.Lock()
        self.counts = {}
        self.failures = []

    def add(self, key, n=1):
        with self.lock:
            self.counts[key] = self.counts.get(key, 0) + n

    def fail(self, what):
        print(f"FAILURE {what}", file=sys.stderr, flush=True)
        with self.lock:
            self.failures.append(what)
            self.counts["failures"] = self.counts.get("failures", 0) + 1

    def snapshot(self):
        with self.lock:
            return dict(self.counts)


def request(port, method, path, body=None, timeout=120, read=True):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    data = None if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
    conn.request(method, path, body=data, headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    if not read:
        return resp, conn
    text = resp.read().decode("utf-8", "replace")
    conn.close()
    return resp.status, text


def client(port, seed, deadline, stats, answers):
    """One client: a mix of multi-turn chats, streams, cancellations and bad requests."""
    rng = random.Random(seed)
    history = []
    tenant = None
    while time.time() < deadline:
        kind = rng.choices(
            ["turn", "stream", "completion", "cancel", "bad", "metrics"],
            weights=[40, 20, 15, 10, 10, 5],
        )[0]
        try:
            if kind in ("turn", "stream"):
                if not history or len(history) > 10:
                    history = [{"role": "system", "content": "You are a terse agent. Answer in a line."}]
                    tenant = rng.choice([None, "tenant-a", "tenant-b"])
                topic = rng.choice(TOPICS)
                history.append({"role": "user", "content": f"Tell me about {topic}, briefly."})
                body = {"messages": history, "max_tokens": rng.randint(4, 16), "temperature": 0}
                if tenant:
                    body["cache_salt"] = tenant
                if kind == "stream":
                    body["stream"] = True
                    body["stream_options"] = {"include_usage": True}
                status, text = request(port, "POST", "/v1/chat/completions", body)
                if status == 400 and "context_length_exceeded" in text:
                    stats.add("context_full")  # the conversation outgrew the model: start over
                    history = []
                    continue
                if status != 200:
                    stats.fail(f"{kind}: {status} {text[:200]}")
                    history = []
                    continue
                if kind == "stream":
                    if "[DONE]" not in text:
                        stats.fail(f"stream without [DONE]: {text[-200:]}")
                        history = []
                        continue
                    content = "".join(
                        (json.loads(l[6:]).get("choices") or [{}])[0].get("delta", {}).get("content") or ""
                        for l in text.splitlines()
                        if l.startswith("data: {")
                    )
                else:
                    content = json.loads(text)["choices"][0]["message"]["content"]
                # Greedy output depends only on the prompt: the same prompt must give the same
                # text whether it was cached, restored from SSD, or computed cold.
                key = json.dumps([tenant, body["messages"], body["max_tokens"]])
                with stats.lock:
                    seen = answers.setdefault(key, content)
                if seen != content:
                    stats.fail(f"wrong answer for {key[:120]}: {content!r} vs {seen!r}")
                history.append({"role": "assistant", "content": content})
                stats.add("ok")
            elif kind == "completion":
                prompt = " ".join(rng.choice(TOPICS) for _ in range(rng.randint(4, 20)))
                status, text = request(port, "POST", "/v1/completions",
                                       {"prompt": prompt, "max_tokens": rng.randint(1, 12), "temperature": 0})
                if status == 200:
                    stats.add("ok")
                elif status == 400 and "context_length_exceeded" in text:
                    stats.add("context_full")
                else:
                    stats.fail(f"completion: {status} {text[:200]}")
            elif kind == "cancel":
                body = {"messages": [{"role": "user", "content": "Count slowly to one hundred."}],
                        "max_tokens": 200, "stream": True}
                resp, conn = request(port, "POST", "/v1/chat/completions", body, read=False)
                resp.read1(64) if hasattr(resp, "read1") else resp.read(64)
                conn.close()  # hang up mid-stream: the server must cancel and free the row
                stats.add("cancelled")
            elif kind == "bad":
                choice = rng.randrange(4)
                if choice == 0:
                    status, _ = request(port, "POST", "/v1/chat/completions", b"{not json")
                elif choice == 1:
                    status, _ = request(port, "POST", "/v1/chat/completions",
                                        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 10**9})
                elif choice == 2:
                    status, _ = request(port, "POST", "/v1/chat/completions",
                                        {"messages": [{"role": "user", "content": "hi"}], "cache_salt": ""})
                else:
                    status, _ = request(port, "POST", "/v1/completions", {"prompt": [10**9]})
                stats.add("rejected") if 400 <= status < 500 else stats.fail(f"bad request got {status}")
            else:
                status, _ = request(port, "GET", rng.choice(["/metrics", "/v1/cache", "/health"]))
                stats.add("ok") if status == 200 else stats.fail(f"metrics: {status}")
        except (OSError, http.client.HTTPException, ValueError, KeyError) as e:
            stats.fail(f"{kind}: {type(e).__name__}: {e}")
            history = []


def rss_bytes(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def threads(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("Threads:"):
                return int(line.split()[1])
    return 0


def disk_bytes(path, blocks_only=False):
    """Allocated bytes under `path` (only block files with `blocks_only`)."""
    total = 0
    for dirpath, _, files in os.walk(path):
        for name in files:
            if blocks_only and not name.endswith(".safetensors"):
                continue
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_blocks * 512
            except FileNotFoundError:
                pass
    return total


def gauge(port, name):
    status, text = request(port, "GET", "/metrics", timeout=30)
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return float("nan")


def svg_plot(rows, path, title):
    """Four panels (RSS MiB, open fds, store MiB, requests/s) against minutes."""
    panels = [
        ("RSS (MiB)", [r["rss"] / 2**20 for r in rows]),
        ("open fds", [r["fds"] for r in rows]),
        ("store on disk (MiB)", [r["disk"] / 2**20 for r in rows]),
        ("MLX live (MiB)", [r["mlx_active"] / 2**20 for r in rows]),
    ]
    xs = [r["t"] / 60 for r in rows]
    w, ph, pad = 760, 150, 50
    h = len(panels) * (ph + 40) + 40
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="11">',
           f'<rect width="{w}" height="{h}" fill="white"/>',
           f'<text x="{w / 2}" y="20" text-anchor="middle" font-size="14">{title}</text>']
    xmax = max(xs) if xs and max(xs) > 0 else 1
    for i, (name, ys) in enumerate(panels):
        top = 40 + i * (ph + 40)
        ymax = max(ys) * 1.15 if ys and max(ys) > 0 else 1
        out.append(f'<text x="{pad}" y="{top - 6}">{name}</text>')
        out.append(f'<rect x="{pad}" y="{top}" width="{w - 2 * pad}" height="{ph}" fill="none" stroke="#999"/>')
        for frac in (0, 0.5, 1):
            y = top + ph - frac * ph
            out.append(f'<text x="{pad - 4}" y="{y + 4}" text-anchor="end">{ymax * frac:.0f}</text>')
        for m in range(0, int(xmax) + 1, max(1, int(xmax) // 6 or 1)):
            x = pad + m / xmax * (w - 2 * pad)
            out.append(f'<text x="{x}" y="{top + ph + 14}" text-anchor="middle">{m} min</text>')
        pts = " ".join(
            f"{pad + x / xmax * (w - 2 * pad):.1f},{top + ph - y / ymax * ph:.1f}" for x, y in zip(xs, ys)
        )
        out.append(f'<polyline points="{pts}" fill="none" stroke="#1f77b4" stroke-width="1.5"/>')
    out.append("</svg>")
    with open(path, "w") as f:
        f.write("\n".join(out))


def main():
    a = parse_args()
    if not os.path.isfile(a.bin):
        sys.exit(f"{a.bin} is missing: run `cargo build --release -p kvstore` first")
    os.makedirs(a.out, exist_ok=True)
    store = tempfile.mkdtemp(prefix="kvstore-soak-")
    log = open(os.path.join(tempfile.gettempdir(), "kvstore-soak-server.log"), "w")
    server = subprocess.Popen(
        [a.bin, "serve", "--model", a.model, "--store", store, "--port", "0",
         "--block-size", "8", "--ram-budget", a.ram_budget, "--ssd-budget", a.ssd_budget,
         "--max-batch", "8"],
        stdout=log, stderr=subprocess.PIPE, text=True,
    )
    port = None
    for line in server.stderr:
        log.write(line)
        m = re.search(r"listening on http://127\.0\.0\.1:(\d+)", line)
        if m:
            port = int(m.group(1))
            break
    if port is None:
        sys.exit("kvstore serve did not start; see the server log")
    threading.Thread(target=lambda: shutil.copyfileobj(server.stderr, log), daemon=True).start()

    stats, answers = Stats(), {}
    start = time.time()
    deadline = start + a.minutes * 60
    workers = [threading.Thread(target=client, args=(port, i, deadline, stats, answers), daemon=True)
               for i in range(a.clients)]
    for t in workers:
        t.start()
    rows = []
    budget = None
    while True:
        now = time.time()
        counts = stats.snapshot()
        try:
            budget = budget or gauge(port, 'kvstore_cache_budget_bytes{tier="ssd"}')
            mlx_active = gauge(port, "kvstore_mlx_active_bytes")
            mlx_cache = gauge(port, "kvstore_mlx_cache_bytes")
            accounted = gauge(port, 'kvstore_cache_bytes{tier="ssd"}')
        except OSError:
            mlx_active = mlx_cache = accounted = float("nan")
        row = {
            "t": round(now - start, 1),
            "rss": rss_bytes(server.pid),
            "fds": len(os.listdir(f"/proc/{server.pid}/fd")),
            "threads": threads(server.pid),
            "disk": disk_bytes(store),
            # A walk racing the writer can count an evicted file and its replacement both;
            # the store's own accounting is `ssd_accounted`, and a quiescent walk ends the run.
            "block_bytes": disk_bytes(store, blocks_only=True),
            "ssd_accounted": accounted,
            "mlx_active": mlx_active,
            "mlx_cache": mlx_cache,
            "ok": counts.get("ok", 0),
            "cancelled": counts.get("cancelled", 0),
            "rejected": counts.get("rejected", 0),
            "failures": counts.get("failures", 0),
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
        if now >= deadline:
            break
        time.sleep(min(a.interval, max(0.0, deadline - now)))
    for t in workers:
        t.join(timeout=180)
    server.send_signal(signal.SIGTERM)
    exit_code = server.wait(timeout=120)
    final_block_bytes = disk_bytes(store, blocks_only=True)

    with open(os.path.join(a.out, "soak.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    n = len(rows)
    warm = [r for r in rows if r["t"] >= 0.1 * a.minutes * 60] or rows
    q = max(1, len(warm) // 4)
    early, late = warm[q:2 * q] or warm[:1], warm[-q:]
    mean = lambda xs: sum(xs) / len(xs)
    rss_early, rss_late = mean([r["rss"] for r in early]), mean([r["rss"] for r in late])
    fd_warm = max(r["fds"] for r in rows[: max(1, n // 10)])
    summary = {
        "minutes": a.minutes,
        "samples": n,
        "clients": a.clients,
        "requests": stats.snapshot(),
        "rss_mib_second_quarter": round(rss_early / 2**20, 1),
        "rss_mib_last_quarter": round(rss_late / 2**20, 1),
        "rss_growth": round(rss_late / rss_early - 1, 4),
        "fds_min_max": [min(r["fds"] for r in rows), max(r["fds"] for r in rows)],
        "threads_min_max": [min(r["threads"] for r in rows), max(r["threads"] for r in rows)],
        "disk_mib_max": round(max(r["disk"] for r in rows) / 2**20, 2),
        "block_file_mib_max_walk": round(max(r["block_bytes"] for r in rows) / 2**20, 2),
        "ssd_accounted_mib_max": round(max(r["ssd_accounted"] for r in rows) / 2**20, 3),
        "block_file_mib_after_exit": round(final_block_bytes / 2**20, 3),
        "mlx_cache_mib_min_max": [round(min(r["mlx_cache"] for r in rows) / 2**20, 1),
                                  round(max(r["mlx_cache"] for r in rows) / 2**20, 1)],
        "ssd_budget_mib": round((budget or 0) / 2**20, 2),
        "server_exit": exit_code,
        "failures": stats.failures[:20],
    }
    flat = (
        (rss_late - rss_early) <= 0.10 * rss_early
        and max(r["fds"] for r in warm) <= fd_warm + 2 * a.clients
        and (budget is None or max(r["ssd_accounted"] for r in rows) <= budget)
        and (budget is None or final_block_bytes <= budget)
        and not stats.failures
        and exit_code == 0
    )
    summary["flat"] = flat
    with open(os.path.join(a.out, "soak.json"), "w") as f:
        json.dump(summary, f, indent=2)
    svg_plot(rows, os.path.join(a.out, "soak.svg"),
             f"kvstore serve soak: {a.minutes:g} min, {a.clients} clients, tiny-qwen3, "
             f"{stats.snapshot().get('ok', 0)} answered")
    shutil.rmtree(store, ignore_errors=True)
    print(json.dumps(summary, indent=2))
    sys.exit(0 if flat else 1)


if __name__ == "__main__":
    main()
