#!/usr/bin/env python3
"""Generate a deterministic deep-learning-like dataset for demos, tests and benchmarks.

Kinds, in the proportions of the peers' benchmark: 25% random bytes (.bin, a stand-in for
JPEG), 12.5% numeric CSV, 12.5% JSON records, 50% float32 .npy arrays of smooth noise with
the low mantissa bits zeroed (as sensor data or quantised features are). Files are spread
over class directories; sizes are uniform in [--min-kb, --max-kb]. Optional large float32
files go to large/.

    python tools/gen_dataset.py OUT --files 2000 --classes 20 [--large 1 --large-mb 48]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np


def npy_bytes(arr: np.ndarray) -> bytes:
    header = {"descr": arr.dtype.str, "fortran_order": False, "shape": arr.shape}
    text = repr(header).encode("latin1")
    pad = 64 - (10 + len(text) + 1) % 64
    text += b" " * pad + b"\n"
    return b"\x93NUMPY\x01\x00" + len(text).to_bytes(2, "little") + text + arr.tobytes()


def smooth_float32(rng: np.random.Generator, n: int) -> np.ndarray:
    steps = rng.standard_normal(n).astype(np.float32) * 0.01
    arr = np.cumsum(steps, dtype=np.float32) + np.float32(rng.uniform(-1, 1))
    # Zero the low 12 mantissa bits: smooth data with limited precision.
    bits = arr.view(np.uint32) & np.uint32(0xFFFFF000)
    return bits.view(np.float32)


def make_file(kind: str, size: int, rng: np.random.Generator) -> bytes:
    if kind == "bin":
        return rng.bytes(size)
    if kind == "csv":
        rows = []
        total = 0
        while total < size:
            vals = rng.normal(0, 100, 6)
            row = ",".join(f"{v:.4f}" for v in vals) + "\n"
            rows.append(row)
            total += len(row)
        return "".join(rows).encode()[:size]
    if kind == "json":
        out = []
        total = 0
        i = 0
        while total < size:
            rec = {"id": int(rng.integers(0, 1 << 30)), "label": int(rng.integers(0, 1000)),
                   "score": round(float(rng.random()), 6),
                   "tags": [f"t{int(x)}" for x in rng.integers(0, 50, 3)],
                   "bbox": [int(x) for x in rng.integers(0, 512, 4)], "seq": i}
            line = json.dumps(rec) + "\n"
            out.append(line)
            total += len(line)
            i += 1
        return "".join(out).encode()[:size]
    if kind == "npy":
        n = max(1, (size - 128) // 4)
        return npy_bytes(smooth_float32(rng, n))
    raise ValueError(kind)


KINDS = ["bin", "csv", "json", "npy", "npy", "bin", "npy", "npy"]  # 2/8 bin, 1/8 csv, ...


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out")
    p.add_argument("--files", type=int, default=2000)
    p.add_argument("--classes", type=int, default=20)
    p.add_argument("--min-kb", type=int, default=50)
    p.add_argument("--max-kb", type=int, default=150)
    p.add_argument("--large", type=int, default=0, help="number of large float32 files")
    p.add_argument("--large-mb", type=int, default=64)
    p.add_argument("--seed", type=int, default=20240601)
    p.add_argument("--subdir", default="train", help="directory for the small files")
    a = p.parse_args(argv)
    rng = np.random.default_rng(a.seed)
    root = os.path.join(a.out, a.subdir)
    total = 0
    for c in range(a.classes):
        os.makedirs(os.path.join(root, f"class{c:03d}"), exist_ok=True)
    for i in range(a.files):
        kind = KINDS[i % len(KINDS)]
        size = int(rng.integers(a.min_kb * 1000, a.max_kb * 1000 + 1))
        data = make_file(kind, size, rng)
        path = os.path.join(root, f"class{i % a.classes:03d}", f"{i:07d}.{kind}")
        with open(path, "wb") as f:
            f.write(data)
        total += len(data)
    if a.large:
        os.makedirs(os.path.join(a.out, "large"), exist_ok=True)
        for j in range(a.large):
            n = a.large_mb * (1 << 20) // 4
            data = smooth_float32(rng, n).tobytes()
            with open(os.path.join(a.out, "large", f"big{j:02d}.f32"), "wb") as f:
                f.write(data)
            total += len(data)
    print(f"generated {a.files} small files{f' and {a.large} large' if a.large else ''} "
          f"({total / 1e6:.1f} MB) in {a.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
