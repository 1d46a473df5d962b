"""Compares the blocks two kvstore stores share, tensor by tensor (`device.sh gv`).

    python3 compare_stores.py STORE_A STORE_B [FROM_POSITION]

A block is a safetensors file whose path is its key, so two stores hold the same block at
the same relative path. For every block present in both (and at chain position
FROM_POSITION or later), every tensor is compared: equal bytes, else the largest absolute
difference and that difference relative to the largest magnitude of the tensor. Prints one
JSON object. Pure Python (no numpy on the GPU machine): F32, F16 and BF16 tensors.
"""

import array
import json
import os
import struct
import sys


def load(path):
    with open(path, "rb") as f:
        raw = f.read()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    return header, raw[8 + n :]


def floats(data, dtype):
    if dtype == "F32":
        a = array.array("f")
        a.frombytes(data)
        return a
    if dtype == "F16":
        return array.array("f", struct.unpack(f"<{len(data) // 2}e", data))
    if dtype == "BF16":
        h = array.array("H")
        h.frombytes(data)
        return array.array("f", struct.unpack(f"<{len(h)}f", struct.pack(f"<{len(h)}I", *(x << 16 for x in h))))
    raise ValueError(f"no comparison for {dtype}")


def blocks(root):
    out = {}
    for d, _, files in os.walk(root):
        for f in files:
            if f.endswith(".safetensors"):
                p = os.path.join(d, f)
                out[os.path.relpath(p, root)] = p
    return out


def main():
    a_root, b_root = sys.argv[1], sys.argv[2]
    start = int(sys.argv[3]) if len(sys.argv) > 3 else 0
    a, b = blocks(a_root), blocks(b_root)
    common = sorted(set(a) & set(b))
    report = {"a_blocks": len(a), "b_blocks": len(b), "common": len(common), "compared": 0,
              "equal_tensors": 0, "differing_tensors": 0, "max_abs": 0.0, "max_rel": 0.0, "positions": []}
    for rel in common:
        ha, da = load(a[rel])
        hb, db = load(b[rel])
        pos = int(ha.get("__metadata__", {}).get("kvstore.position", -1))
        if pos < start:
            continue
        report["compared"] += 1
        report["positions"].append(pos)
        for name, spec in ha.items():
            if name == "__metadata__":
                continue
            s, e = spec["data_offsets"]
            s2, e2 = hb[name]["data_offsets"]
            x, y = da[s:e], db[s2:e2]
            if x == y:
                report["equal_tensors"] += 1
                continue
            report["differing_tensors"] += 1
            fx, fy = floats(x, spec["dtype"]), floats(y, hb[name]["dtype"])
            diff = max(abs(p - q) for p, q in zip(fx, fy))
            scale = max(max(abs(p) for p in fx), 1e-30)
            report["max_abs"] = max(report["max_abs"], diff)
            report["max_rel"] = max(report["max_rel"], diff / scale)
    report["positions"] = sorted(report["positions"])
    print(json.dumps(report))


if __name__ == "__main__":
    main()
