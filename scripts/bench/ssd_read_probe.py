#!/usr/bin/env python3
"""What reading the SSD tier's layout can reach on a machine, without kvstore: N files of
one block's size (default 1,024 x 1.47 MB, a 32K-token SmolLM2 prefix), page cache dropped
before each pass (needs root), read buffered or with O_DIRECT (one request a file into a
page-aligned buffer), on 1/8/16 threads, against `dd iflag=direct` of one file of the same
total size. Prints GB/s per pass. Usage: ssd_read_probe.py DIR [files] [file_bytes]."""
import mmap, os, subprocess, sys, threading, time

d = sys.argv[1]
n = int(sys.argv[2]) if len(sys.argv) > 2 else 1024
size = int(sys.argv[3]) if len(sys.argv) > 3 else 1_474_560 + 1_000
os.makedirs(d, exist_ok=True)
paths = [os.path.join(d, f"probe-{i:05}.bin") for i in range(n)]
chunk = os.urandom(size)
for p in paths:
    if not (os.path.exists(p) and os.path.getsize(p) == size):
        with open(p, "wb") as f:
            f.write(chunk)
big = os.path.join(d, "probe-one.bin")
if not (os.path.exists(big) and os.path.getsize(big) == n * size):
    with open(big, "wb") as f:
        for _ in range(n):
            f.write(chunk)
os.sync()

def drop():
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")

def read_buffered(p):
    with open(p, "rb", buffering=0) as f:
        return len(f.read())

def read_direct(p):
    aligned = (size + 4095) // 4096 * 4096
    buf = mmap.mmap(-1, aligned)
    fd = os.open(p, os.O_RDONLY | os.O_DIRECT)
    try:
        return os.preadv(fd, [buf], 0)
    finally:
        os.close(fd)
        buf.close()

def run(reader, threads):
    drop()
    it = iter(paths)
    lock = threading.Lock()
    total = [0]
    def work():
        while True:
            with lock:
                p = next(it, None)
            if p is None:
                return
            got = reader(p)
            with lock:
                total[0] += got
    t = time.perf_counter()
    ts = [threading.Thread(target=work) for _ in range(threads)]
    for x in ts: x.start()
    for x in ts: x.join()
    return total[0] / (time.perf_counter() - t) / 1e9

def dd():
    drop()
    out = subprocess.run(["dd", f"if={big}", "of=/dev/null", "bs=4M", "iflag=direct"],
                         capture_output=True, text=True).stderr.strip().splitlines()[-1]
    return out

for rnd in range(2):
    print("dd:", dd(), flush=True)
    for name, reader in [("buffered", read_buffered), ("O_DIRECT", read_direct)]:
        for threads in (1, 8, 16):
            print(f"round {rnd}: {n} files x {size} B, {name}, {threads} threads: {run(reader, threads):.2f} GB/s", flush=True)
