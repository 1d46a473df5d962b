#!/usr/bin/env python3
"""Does a layout of fewer, larger files read faster than a file per block on this disk?
Without kvstore: the same 1,024 x 1.51 MB (a 32K-token SmolLM2 prefix) as (a) a file per
block, (b) 16 segment files of 64 blocks each, read a block at a time, (b16) the same
segments read 16 blocks at a time, (c) one file read a block at a time, (c8) one file read
in 8 large pieces; each buffered (fresh memory per read) and with O_DIRECT (page-aligned
memory), on 1 and 8 threads, page cache dropped before each pass (needs root), beside
`dd iflag=direct bs=4M` of the one file right before. Two rounds.
Usage: ssd_layout_probe.py DIR mk   (writes 4.5 GB under DIR), then ssd_layout_probe.py DIR run
"""
import mmap
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor

root = os.path.join(sys.argv[1], "layout-probe")
BS = 1_510_000
N = 1024
def mk():
    os.makedirs(root+"/a", exist_ok=True); os.makedirs(root+"/b", exist_ok=True)
    data = os.urandom(BS)
    for i in range(N):
        with open(f"{root}/a/{i:04d}", "wb") as f: f.write(data)
    for s in range(16):
        with open(f"{root}/b/{s:02d}", "wb") as f:
            for i in range(64): f.write(data)
    with open(f"{root}/c", "wb") as f:
        for i in range(N): f.write(data)
    os.sync()
def drop():
    os.sync(); open("/proc/sys/vm/drop_caches","w").write("3\n")
def dd():
    drop(); t=time.time(); os.system(f"dd if={root}/c of=/dev/null bs=4M iflag=direct status=none"); return N*BS/(time.time()-t)/1e9
def rd_buffered(path, off, ln):
    fd = os.open(path, os.O_RDONLY)
    try:
        b = bytearray(ln); mv = memoryview(b); got = 0
        while got < ln:
            n = os.preadv(fd, [mv[got:]], off+got)
            if n == 0: break
            got += n
        return got
    finally: os.close(fd)
def rd_direct(path, off, ln):
    fd = os.open(path, os.O_RDONLY|os.O_DIRECT)
    try:
        al = 4096; s = off//al*al; e = (off+ln+al-1)//al*al
        m = mmap.mmap(-1, e-s); got = 0
        while got < e-s:
            n = os.preadv(fd, [memoryview(m)[got:]], s+got)
            if n == 0: break
            got += n
        return ln
    finally: os.close(fd)
def jobs(kind):
    if kind=="a": return [(f"{root}/a/{i:04d}",0,BS) for i in range(N)]
    if kind=="b": return [(f"{root}/b/{s:02d}",i*BS,BS) for s in range(16) for i in range(64)]
    if kind=="b16": return [(f"{root}/b/{s:02d}",i*BS*16,BS*16) for s in range(16) for i in range(4)]
    if kind=="c8": return [(f"{root}/c",i*BS*128,BS*128) for i in range(8)]
    if kind=="c": return [(f"{root}/c",i*BS,BS) for i in range(N)]
def run(kind, fn, th):
    drop(); t=time.time()
    with ThreadPoolExecutor(th) as ex: tot=sum(ex.map(lambda j: fn(*j), jobs(kind)))
    return tot/(time.time()-t)/1e9
if sys.argv[2] == "mk":
    mk()
else:
    for rep in range(2):
        for kind in ["a","b","b16","c","c8"]:
            for name,fn in [("buf",rd_buffered),("dir",rd_direct)]:
                for th in [1,8]:
                    d = dd(); r = run(kind, fn, th)
                    print(f"{kind:4s} {name} th={th} {r:.2f} GB/s  dd {d:.2f}  ratio {r/d:.2f}", flush=True)
