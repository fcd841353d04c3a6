#!/usr/bin/env python3
"""Write the store of a ``tools/gen_tree.py`` tree directly, without reading the tree.

    .venv/bin/python tools/bench/synth_store.py STORE --files 10000000 [--partitions 8]

The store holds exactly the files ``gen_tree.py --files N`` writes (same names, same bytes,
the same stamp file), each one chunk compressed with zstd level 3, in format v3, built with
FanStore's own index builder and partition writer. What it saves is the pack's reading of
the source: 10 million tiny files read cold from this machine's disk take over two hours,
while the serving side (mount, memory, listing, reads) does not care how the store was
made. ``fanstore verify`` and reads through a mount check it like any store.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from multiprocessing import Pool

import numpy as np
import xxhash
import zstandard

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))  # the project
sys.path.insert(0, os.path.dirname(HERE))  # tools/: gen_tree

import gen_tree  # noqa: E402

from fanstore.format.index import (  # noqa: E402
    INDEX_NAME,
    KIND_DIR,
    KIND_FILE,
    IndexBuilder,
    PartitionInfo,
    encode_index,
    write_index,
)
from fanstore.format.partition import PartitionWriter, partition_name  # noqa: E402

_state: dict = {}


def _init(seed: int) -> None:
    _state["text"] = gen_tree._corpus(seed)
    _state["seed"] = seed


def _partition(job: tuple[str, int, list[tuple[int, int]]]) -> dict:
    """Write partition ``number`` holding the directories ``dirs`` ((d, files)); its chunk
    rows, in file order."""
    path, number, dirs = job
    text = _state["text"]
    cctx = zstandard.ZstdCompressor(level=3)
    h64 = xxhash.xxh3_64_intdigest
    n = sum(k for _, k in dirs)
    offset, stored, raw, codec, checksum = (np.zeros(n, dt) for dt in ("<u8", "<u4", "<u4",
                                                                      "<u2", "<u8"))
    w = PartitionWriter(path, number)
    i = 0
    for d, k in dirs:
        starts, lengths = gen_tree.file_windows(_state["seed"], d, k, len(text))
        for s, ln in zip(starts.tolist(), lengths.tolist()):
            data = text[s : s + ln]
            z = cctx.compress(data)
            if len(z) < len(data):
                offset[i], codec[i] = w.append(z), 1
                stored[i] = len(z)
            else:
                offset[i] = w.append(data)
                stored[i] = len(data)
            raw[i], checksum[i] = len(data), h64(data)
            i += 1
    return {"number": number, "offset": offset, "stored": stored, "raw": raw, "codec": codec,
            "checksum": checksum, "size": w.size, "hash": w.close(),
            "raw_bytes": int(raw.sum())}


def build(store: str, files: int, per_dir: int, seed: int, partitions: int,
          jobs: int, v1: bool = False) -> None:
    n_dirs = (files + per_dir - 1) // per_dir
    counts = [min(per_dir, files - d * per_dir) for d in range(n_dirs)]
    os.makedirs(store)
    stamp = json.dumps({"files": files, "per_dir": per_dir, "seed": seed}).encode()
    # entries: root, .gen_tree.json, train, the class directories, their files
    n_entries = 3 + n_dirs + files
    b = IndexBuilder(n_entries, files + 1)
    e = b.entries
    first_dir, first_file = 3, 3 + n_dirs
    e["kind"][:] = KIND_FILE
    e["kind"][[0, 2]] = KIND_DIR
    e["kind"][first_dir:first_file] = KIND_DIR
    e["mode"][:] = 0o644
    e["mode"][e["kind"] == KIND_DIR] = 0o755
    e["mtime_ns"][:] = time.time_ns()
    e["parent"][first_dir:first_file] = 2
    e["parent"][first_file:] = np.repeat(np.arange(first_dir, first_file), counts)
    e["first"][0], e["count"][0] = 1, 2
    e["first"][2], e["count"][2] = first_dir, n_dirs
    e["first"][first_dir:first_file] = first_file + np.concatenate(([0], np.cumsum(counts)[:-1]))
    e["count"][first_dir:first_file] = counts
    names = [b".gen_tree.json", b"train"] + [f"n{d:08d}".encode() for d in range(n_dirs)]
    names += [f"n{d:08d}_{i:06d}.txt".encode() for d in range(n_dirs) for i in range(counts[d])]
    b.set_names(names)
    # contiguous runs of directories, one per partition
    bounds = np.linspace(0, n_dirs, partitions + 1).astype(int)
    jobs_ = [(os.path.join(store, partition_name(p)), p,
              [(d, counts[d]) for d in range(bounds[p], bounds[p + 1])])
             for p in range(partitions)]
    with Pool(jobs, initializer=_init, initargs=(seed,)) as pool:
        results = pool.map(_partition, jobs_, chunksize=1)
    c, row, parts = b.chunks, 0, []
    for r in results:
        k = len(r["raw"])
        c["part"][row : row + k] = r["number"]
        for col in ("offset", "stored", "raw", "codec", "checksum"):
            c[col][row : row + k] = r[col]
        row += k
        parts.append(PartitionInfo(number=r["number"], size=r["size"], checksum=r["hash"],
                                   files=k, raw_bytes=r["raw_bytes"]))
    # the stamp file: the last chunk, in the last partition (appended after it was closed,
    # so it gets a partition of its own instead)
    w = PartitionWriter(os.path.join(store, partition_name(partitions)), partitions)
    c["part"][files], c["offset"][files] = partitions, w.append(stamp)
    c["stored"][files], c["raw"][files] = len(stamp), len(stamp)
    c["checksum"][files] = xxhash.xxh3_64_intdigest(stamp)
    parts.append(PartitionInfo(number=partitions, size=w.size, checksum=w.close(), files=1,
                               raw_bytes=len(stamp)))
    e["size"][1], e["first"][1], e["count"][1] = len(stamp), files, 1
    e["checksum"][1] = xxhash.xxh3_64_intdigest(stamp)
    e["size"][first_file:] = c["raw"][:files]
    e["first"][first_file:] = np.arange(files)
    e["count"][first_file:] = 1
    e["checksum"][first_file:] = c["checksum"][:files]
    raw_bytes = int(c["raw"].sum())
    meta = {"chunk_size": 1 << 20, "codecs": [{"id": "none"}, {"id": "zstd", "level": 3}],
            "partitions": [p.to_json() for p in parts],
            "counts": {"files": files + 1, "dirs": n_dirs + 1, "symlinks": 0,
                       "raw_bytes": raw_bytes, "stored_bytes": sum(p.size for p in parts)},
            "pack": {"source": f"gen_tree --files {files} --seed {seed}",
                     "partitions": partitions, "broadcast": [], "chunk_size": 1 << 20,
                     "tool": "tools/bench/synth_store.py"},
            "access": "shared"}
    write_index(os.path.join(store, INDEX_NAME),
                encode_index(meta, e, c, b.build_lookup() if v1 else None, bytes(b.names),
                             b""))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("store")
    gen_tree.tree_args(p)
    p.add_argument("--partitions", type=int, default=8)
    p.add_argument("--v1", action="store_true", help="format v1, with a lookup table (what "
                   "FanStore before format v3 wrote and reads)")
    a = p.parse_args(argv)
    t0 = time.perf_counter()
    build(a.store, a.files, a.per_dir, a.seed, a.partitions, a.jobs, a.v1)
    print(f"{a.store}: {a.files:,} files in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
