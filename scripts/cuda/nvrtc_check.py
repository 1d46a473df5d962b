#!/usr/bin/env python3
"""Compiles the batched decode attention's CUDA source (mlx/src/rows_attention.cu.h) with
NVRTC for every variant the shim can ask for, and the kernel source of every other shim file
that embeds one (`kSource = R"(...)"`: copy_runs.cc, host_upload.cc where present), on a
machine without a GPU.

    python3 scripts/cuda/nvrtc_check.py

NVRTC needs no GPU: the `nvidia-cuda-nvrtc` wheel (PyPI, the version libmlx's CUDA build
loads at run time) is downloaded once into .cuda/nvrtc. The source is wrapped the way
mlx/src/rows_attention.cc wraps it (`T`, `LOAD`, `STORE`, `D`, `NREP`, `MG`, `KPW` and the optional `XSUM`, `MINB`, `PREF`, `PACK`, `BAL` defined in front) and
compiled for the H200 (compute_90) with the options the shim uses. Exits non-zero on the
first variant that does not compile, printing NVRTC's log. A kernel edit that passes here
still has to pass `device.sh rk` on the GPU (numerics are not checked here).
"""
import ctypes
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
WHEEL_DIR = ROOT / ".cuda" / "nvrtc"
LIB = WHEEL_DIR / "nvidia" / "cu13" / "lib" / "libnvrtc.so.13"
VERSION = "13.5.37"

# (element type, its load and store helpers): f32, bf16, f16 as the shim names them.
DTYPES = [
    ("float", "f32_load", "f32_store"),
    ("unsigned short", "bf16_load", "bf16_store"),
    ("unsigned short", "f16_load", "f16_store"),
]
# Head dimensions the kernel takes (multiples of 32 up to 256) and q heads per kv head (1-8).
HEAD_DIMS = [32, 64, 96, 128, 192, 256]
REPS = [1, 2, 3, 4, 8]


def fetch_nvrtc():
    if LIB.exists():
        return
    dl = ROOT / ".cuda" / "dl" / "nvrtc"
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
         "--platform", "manylinux2014_x86_64", "--python-version", "3.12",
         "--implementation", "cp", "-d", str(dl), f"nvidia-cuda-nvrtc=={VERSION}"],
        check=True,
    )
    for whl in dl.glob("nvidia_cuda_nvrtc-*.whl"):
        subprocess.run([sys.executable, "-m", "zipfile", "-e", str(whl), str(WHEEL_DIR)],
                       check=True)


def kernel_body():
    src = (ROOT / "mlx" / "src" / "rows_attention.cu.h").read_text()
    start, end = src.index('R"KVSRC(') + len('R"KVSRC('), src.rindex(')KVSRC"')
    return src[start:end]


def embedded_sources():
    """(file name, kernel source) of every shim file with a `kSource = R"(...)"` string."""
    out = []
    for path in sorted((ROOT / "mlx" / "src").glob("*.cc")):
        text = path.read_text()
        mark = 'kSource = R"('
        if mark in text:
            start = text.index(mark) + len(mark)
            out.append((path.name, text[start:text.index(')";', start)]))
    return out


def compile_source(lib, full, name=b"rows_attention.cu"):
    prog = ctypes.c_void_p()
    if lib.nvrtcCreateProgram(ctypes.byref(prog), full.encode(), name, 0,
                              None, None) != 0:
        return False, "nvrtcCreateProgram failed"
    opts = (ctypes.c_char_p * 2)(b"--gpu-architecture=compute_90", b"--std=c++17")
    rc = lib.nvrtcCompileProgram(prog, 2, opts)
    size = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetProgramLog(prog, log)
    lib.nvrtcDestroyProgram(ctypes.byref(prog))
    return rc == 0, log.value.decode(errors="replace")


def merge_groups(d):
    """The merge kernel's split groups at head dimension d: rows_attention.cc's
    merge_groups, which the source requires as MG (it has no default of its own)."""
    return 2 if d > 128 else (4 if d > 64 else 8)


def keys_per_load(d):
    """Keys a warp loads at once at head dimension d: rows_attention.cc's keys_per_load
    (without its variable), which the source requires as KPW."""
    return 2 if d > 128 else 4


def compile_variant(lib, body, t, load, store, d, nrep, extra):
    if "#define KPW" not in extra:
        extra += f"#define KPW {keys_per_load(d)}\n"
    full = (f"{extra}#define T {t}\n#define LOAD {load}\n#define STORE {store}\n"
            f"#define D {d}\n#define NREP {nrep}\n" + body)
    return compile_source(lib, full)


def main():
    fetch_nvrtc()
    lib = ctypes.CDLL(str(LIB))
    body = kernel_body()
    count = 0
    for t, load, store in DTYPES:
        for d in HEAD_DIMS:
            for nrep in REPS:
                # the shim's defaults for D, then the serial merge (MG 1) with the dot
                # products summed together (XSUM 1), a floor of 6 blocks an SM and the next
                # pass loaded ahead (PREF 1), then balanced runs of keys (BAL 1)
                extras = [f"#define MG {merge_groups(d)}\n",
                          "#define MG 1\n#define XSUM 1\n#define MINB 6\n#define PREF 1\n",
                          f"#define BAL 1\n#define MG {merge_groups(d)}\n"]
                # 16-bit words kept until used (PACK, where the shim sets it: 16-bit rows of
                # a multiple of 64 elements), with 4, 8 and 16 keys a pass and the next loaded ahead
                if t == "unsigned short" and d % 64 == 0:
                    extras += [f"#define PACK 1\n#define MG {merge_groups(d)}\n",
                               f"#define PACK 1\n#define KPW 8\n#define MG {merge_groups(d)}\n",
                               f"#define PACK 1\n#define KPW 16\n#define PREF 1\n#define MG {merge_groups(d)}\n"]
                for extra in extras:
                    ok, log = compile_variant(lib, body, t, load, store, d, nrep, extra)
                    if not ok:
                        print(f"FAILED: T={t} LOAD={load} D={d} NREP={nrep} {extra!r}\n{log}")
                        return 1
                    count += 1
    print(f"rows_attention.cu.h: {count} variants compile with NVRTC {VERSION} (compute_90)")
    for name, source in embedded_sources():
        ok, log = compile_source(lib, source, name.encode())
        if not ok:
            print(f"FAILED: {name}\n{log}")
            return 1
        print(f"{name}: its kernel source compiles with NVRTC {VERSION} (compute_90)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
