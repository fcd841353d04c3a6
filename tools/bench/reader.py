#!/usr/bin/env python3
"""The benchmark reader: read a list of files under a directory, print one JSON row.

  read    N forked readers, the (shuffled) list dealt round-robin; each file opened, read
          whole (``--chunk 0``) or in ``--chunk`` bytes with ``readinto``, and closed; the
          readers start together behind a barrier (start-up is never timed).
  stat    ``os.stat`` of every listed file, N processes, same split.
  walk    ``os.walk`` of the tree under --root, one process.
  verify  listed files (or a sample) under --root against --ref (CRC32 + size).

    reader.py read --root /mnt/fs --list small.txt --workers 4 --seed 1
    reader.py read --root /mnt/fs --list large.txt --seed -1 --chunk 1048576

A read/stat row: files, truncated (cut by --time-limit), bytes, seconds, files_per_s,
MB_per_s, lat_ms_p50/p90/p99/max, errors, first_error, cpu_busy_pct / iowait_pct (the
whole machine), and with --watch-pid the CPU seconds of those processes. Exit status 1 if a
file failed (the row is printed anyway).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
import zlib

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness as h  # noqa: E402


def shuffled(items: list[str], seed: int) -> list[str]:
    """A seeded shuffle; seed < 0 keeps the list order."""
    items = list(items)
    if seed >= 0:
        random.Random(seed).shuffle(items)
    return items


def read_whole(path: str, buf) -> int:
    with open(path, "rb") as f:
        return len(f.read())


def read_whole_unbuffered(path: str, buf) -> int:
    """buffering=0: no isatty() probe, so no FUSE_IOCTL per file (as C code reads)."""
    with open(path, "rb", buffering=0) as f:
        return len(f.readall())


def read_chunked(path: str, buf) -> int:
    n = 0
    with open(path, "rb", buffering=0) as f:
        while True:
            k = f.readinto(buf)
            if not k:
                return n
            n += k


def stat_only(path: str, buf) -> int:
    os.stat(path)
    return 0


def _setup(job):
    fn, paths, chunk, time_limit = job
    buf = bytearray(chunk) if chunk else None

    def work() -> dict:
        clock, lat, nbytes, errors, first_error = time.perf_counter, [], 0, 0, None
        deadline = clock() + time_limit if time_limit > 0 else None
        for path in paths:
            t = clock()
            if deadline is not None and t > deadline:
                break
            try:
                nbytes += fn(path, buf)
            except OSError as exc:
                errors += 1
                first_error = first_error or f"{path}: {exc}"
            lat.append(clock() - t)
        return {"done": len(lat), "bytes": nbytes, "errors": errors,
                "first_error": first_error, "lat": lat}

    return work


def do_items(a) -> dict:
    """``--workers`` processes over the (shuffled) list, dealt round-robin; one row."""
    op, workers, chunk = a.cmd, a.workers, getattr(a, "chunk", 0)
    unbuffered = bool(getattr(a, "unbuffered", False))
    paths = [os.path.join(a.root, p) for p in shuffled(h.load_list(a.list), a.seed)]
    watch_pids = tuple(a.watch_pid)
    if getattr(a, "watch_tree", False):
        watch_pids = tuple(q for p in watch_pids for q in h.descendants(p))
    fn = stat_only if op == "stat" else read_chunked if chunk else \
        read_whole_unbuffered if unbuffered else read_whole
    watched0 = {pid: h.proc_cpu(pid) for pid in watch_pids}
    got = h.fork_pass(_setup, [(fn, paths[i::workers], chunk, a.time_limit)
                               for i in range(workers)], timeout=120)
    watched1 = {pid: h.proc_cpu(pid) for pid in watch_pids}
    res, wall = got["results"], got["wall"]
    lat = sorted(x for r in res for x in r["lat"])
    done = sum(r["done"] for r in res)
    nbytes = sum(r["bytes"] for r in res)
    row = {
        "op": op, "workers": workers, "chunk": chunk if op == "read" else None,
        "files": done, "files_listed": len(paths), "truncated": done < len(paths),
        "bytes": nbytes, "seconds": round(wall, 4), "files_per_s": round(done / wall, 1),
        "MB_per_s": round(nbytes / 1e6 / wall, 2) if op == "read" else None,
        "lat_ms_p50": h.percentile_ms(lat, 50), "lat_ms_p90": h.percentile_ms(lat, 90),
        "lat_ms_p99": h.percentile_ms(lat, 99), "lat_ms_max": h.percentile_ms(lat, 100),
        "errors": sum(r["errors"] for r in res),
        "first_error": next((r["first_error"] for r in res if r["first_error"]), None),
        "cpu_busy_pct": got["busy"], "iowait_pct": got["iowait"],
    }
    if watch_pids:
        spent = {str(p): (round(watched1[p] - watched0[p], 3)
                          if watched0[p] is not None and watched1[p] is not None else None)
                 for p in watch_pids}
        row["watched_cpu_s"] = spent
        total = [v for v in spent.values() if v is not None]
        if total and done:
            row["watched_cpu_us_per_file"] = round(sum(total) / done * 1e6, 1)
    row.update(unbuffered=unbuffered, root=a.root, list=os.path.basename(a.list), seed=a.seed)
    return row


def do_walk(a) -> dict:
    cpu0 = h.machine_cpu()
    t0 = time.perf_counter()
    dirs = files = 0
    for _top, dnames, fnames in os.walk(a.root):
        dirs += len(dnames)
        files += len(fnames)
    wall = max(time.perf_counter() - t0, 1e-9)
    busy, iowait = h.busy_between(cpu0, h.machine_cpu())
    return {"op": "walk", "root": a.root, "dirs": dirs, "files": files,
            "seconds": round(wall, 4), "entries_per_s": round((dirs + files) / wall, 1),
            "cpu_busy_pct": busy, "iowait_pct": iowait, "errors": 0}


def _crc(path: str) -> tuple[int, int]:
    crc = size = 0
    with open(path, "rb") as f:
        while True:
            block = f.read(1 << 20)
            if not block:
                return size, crc
            crc = zlib.crc32(block, crc)
            size += len(block)


def do_verify(a) -> dict:
    items = h.load_list(a.list)
    if a.sample and a.sample < len(items):
        items = random.Random(a.seed).sample(items, a.sample)
    bad: list[str] = []
    nbytes = 0
    t0 = time.perf_counter()
    for rel in items:
        try:
            got = _crc(os.path.join(a.root, rel))
        except OSError as exc:
            bad.append(f"{rel}: {exc}")
            continue
        want = _crc(os.path.join(a.ref, rel))
        nbytes += got[0]
        if got != want:
            bad.append(f"{rel}: size/crc {got[0]}/{got[1]:08x}, expected {want[0]}/{want[1]:08x}")
    return {"op": "verify", "root": a.root, "ref": a.ref, "checked": len(items),
            "bytes": nbytes, "errors": len(bad), "first_error": bad[0] if bad else None,
            "bad_examples": bad[:3], "seconds": round(time.perf_counter() - t0, 3),
            "ok": not bad}


# ------------------------------------------------------------------------------ main


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)

    def common(p):
        p.add_argument("--root", required=True, help="directory the list is relative to")

    for name in ("read", "stat"):
        p = sub.add_parser(name)
        common(p)
        p.add_argument("--list", required=True, help="paths relative to --root, one a line")
        p.add_argument("--workers", type=int, default=1, help="reader processes (default 1)")
        p.add_argument("--seed", type=int, default=0,
                       help="shuffle seed (default 0); -1 keeps the list order")
        p.add_argument("--time-limit", type=float, default=0.0,
                       help="cut each reader off after this many seconds (0 = never)")
        p.add_argument("--watch-tree", action="store_true",
                       help="count the CPU of every process below each --watch-pid too")
        p.add_argument("--watch-pid", type=int, action="append", default=[],
                       help="report this process's CPU seconds during the pass (repeatable)")
        if name == "read":
            p.add_argument("--unbuffered", action="store_true",
                           help="open(path, 'rb', buffering=0): no isatty() ioctl per file")
            p.add_argument("--chunk", type=int, default=0,
                           help="0: f.read() whole files; N: readinto N-byte buffer (large files)")
    common(sub.add_parser("walk"))
    p = sub.add_parser("verify")
    common(p)
    p.add_argument("--ref", required=True, help="reference directory with the same paths")
    p.add_argument("--list", required=True)
    p.add_argument("--sample", type=int, default=0, help="check N random files (0 = all)")
    p.add_argument("--seed", type=int, default=3)
    return ap


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    if getattr(a, "workers", 1) < 1:
        print("reader.py: --workers must be at least 1", file=sys.stderr)
        return 2
    if a.cmd in ("read", "stat"):
        row = do_items(a)
    elif a.cmd == "walk":
        row = do_walk(a)
    else:
        row = do_verify(a)
    print(json.dumps(row), flush=True)
    return 1 if row.get("errors") else 0


if __name__ == "__main__":
    sys.exit(main())
