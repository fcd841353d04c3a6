#!/usr/bin/env python3
"""FanStore's benchmark reader: read a list of files under any directory, print one JSON line.

The directory can be a plain directory, a FanStore mount or any other mount; the file list
holds paths relative to it, one per line. Every pass prints ONE JSON object on stdout (and
appends it to ``--out``), so drivers can collect rows without parsing text.

Passes
  read    N reader processes; the (shuffled) list is dealt round-robin, reader i takes items
          i, i+N, i+2N, ... (as DataLoader workers do). Each file is opened, read whole with
          ``f.read()`` and closed (``--chunk 0``, small-file mode), or read sequentially in
          ``--chunk`` bytes with ``readinto`` into one reused buffer (large-file mode; use
          ``--seed -1`` to keep the list order). The readers start together: each one forks,
          opens nothing, and waits on a barrier; the clock starts when the barrier releases
          them and stops when the last one finishes. Process start-up is never timed.
  stat    ``os.stat`` of every listed file, N processes, same split.
  walk    ``os.walk`` of the whole tree under --root (readdir only), one process.
  verify  compare listed files (or a random sample) under --root with the same paths under
          --ref byte for byte (CRC32 + size); reports mismatches.

Examples
  reader.py read --root /mnt/fs --list small.txt --workers 4 --seed 1
  reader.py read --root /mnt/fs --list large.txt --workers 1 --seed -1 --chunk 1048576
  reader.py stat --root /mnt/fs --list small.txt --workers 1 --seed 7
  reader.py walk --root /mnt/fs
  reader.py verify --root /mnt/fs --ref /data --list small.txt --sample 300

Fields of a read/stat row: files (done), files_listed, truncated (a --time-limit cut the pass
short; rates are then over the files done), bytes, seconds (wall, barrier release to last
reader done), files_per_s, MB_per_s (MB = 10^6 bytes), lat_ms_p50/p90/p99/max (one file's
open+read+close, or one stat), errors, first_error, cpu_busy_pct and iowait_pct (the whole
machine during the pass, from /proc/stat: includes any FUSE daemon), and with --watch-pid
the CPU seconds that process (e.g. the FUSE daemon) spent during the pass. The exit status
is 1 if any file failed (the row is printed anyway), 2 on bad usage.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import queue as _queue
import random
import sys
import time
import zlib

CLK_TCK = os.sysconf("SC_CLK_TCK")


# ------------------------------------------------------------------------------ helpers


def load_list(path: str) -> list[str]:
    with open(path) as f:
        return [line.rstrip("\n") for line in f if line.strip()]


def shuffled(items: list[str], seed: int) -> list[str]:
    """A seeded shuffle; seed < 0 keeps the list order."""
    items = list(items)
    if seed >= 0:
        random.Random(seed).shuffle(items)
    return items


def machine_cpu() -> tuple[int, int, int] | None:
    """(total, idle, iowait) jiffies of the whole machine from /proc/stat."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except OSError:
        return None
    # user nice system idle iowait irq softirq steal (guest time is already in user)
    return sum(fields[:8]), fields[3], fields[4] if len(fields) > 4 else 0


def busy_between(a, b) -> tuple[float | None, float | None]:
    if a is None or b is None or b[0] <= a[0]:
        return None, None
    total = b[0] - a[0]
    idle, iowait = b[1] - a[1], b[2] - a[2]
    return round(100.0 * (total - idle - iowait) / total, 1), round(100.0 * iowait / total, 1)


def process_cpu_seconds(pid: int) -> float | None:
    """utime + stime of a process (and its threads) in seconds, or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return None
    # the command name may contain spaces: fields start after the last ')'
    rest = text[text.rindex(")") + 2:].split()
    return (int(rest[11]) + int(rest[12])) / CLK_TCK


def percentile(sorted_values: list[float], p: float) -> float | None:
    if not sorted_values:
        return None
    k = round(p / 100.0 * (len(sorted_values) - 1))
    return sorted_values[min(len(sorted_values) - 1, max(0, k))]


# ------------------------------------------------------------------------------ one reader


def read_whole(path: str, buf) -> int:
    with open(path, "rb") as f:
        return len(f.read())


def read_whole_unbuffered(path: str, buf) -> int:
    """open(..., buffering=0): no isatty() probe, so no FUSE_IOCTL per file (what numpy's
    fromfile, cat and most C code do)."""
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


def run_share(op: str, paths: list[str], chunk: int, time_limit: float,
              unbuffered: bool = False) -> dict:
    """One reader's share: returns counts, per-file latencies and its start/end clock."""
    if op == "stat":
        fn = stat_only
    elif chunk:
        fn = read_chunked
    else:
        fn = read_whole_unbuffered if unbuffered else read_whole
    buf = bytearray(chunk) if chunk else None
    clock = time.perf_counter
    lat: list[float] = []
    append = lat.append
    nbytes = errors = done = 0
    first_error = None
    start = clock()
    deadline = start + time_limit if time_limit > 0 else None
    for path in paths:
        t = clock()
        if deadline is not None and t > deadline:
            break
        try:
            nbytes += fn(path, buf)
        except OSError as exc:
            errors += 1
            if first_error is None:
                first_error = f"{path}: {exc}"
        append(clock() - t)
        done += 1
    return {"done": done, "bytes": nbytes, "errors": errors, "first_error": first_error,
            "lat": lat, "start": start, "end": clock()}


def _child(op, paths, chunk, time_limit, unbuffered, barrier, queue) -> None:
    try:
        barrier.wait()
    except Exception:  # noqa: BLE001 - a broken barrier: the parent reports it
        return
    queue.put(run_share(op, paths, chunk, time_limit, unbuffered))


def descendants(pid: int) -> list[int]:
    """``pid`` and every process below it (a FUSE daemon and its worker processes)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    todo.extend(int(c) for c in f.read().split())
        except OSError:
            pass
    return out


def run_pass(op: str, paths: list[str], workers: int, chunk: int = 0,
             time_limit: float = 0.0, watch_pids: tuple[int, ...] = (),
             unbuffered: bool = False) -> dict:
    """Run ``workers`` reader processes over ``paths`` (dealt round-robin); one result dict."""
    ctx = mp.get_context("fork")
    barrier = ctx.Barrier(workers + 1)
    queue = ctx.Queue()
    procs = [ctx.Process(target=_child, daemon=True,
                         args=(op, paths[i::workers], chunk, time_limit, unbuffered, barrier,
                               queue))
             for i in range(workers)]
    for p in procs:
        p.start()
    results: list[dict] = []
    finished = False
    try:
        cpu0 = machine_cpu()
        watched0 = {pid: process_cpu_seconds(pid) for pid in watch_pids}
        barrier.wait(timeout=120)
        t0 = time.perf_counter()
        while len(results) < workers:
            try:
                results.append(queue.get(timeout=1.0))
            except _queue.Empty:
                dead = [p for p in procs if p.exitcode not in (None, 0)]
                if dead:
                    raise RuntimeError(f"reader process died (exit code {dead[0].exitcode})")
        # perf_counter is CLOCK_MONOTONIC, comparable across processes. The parent may be
        # scheduled only after the readers have run for a while (2 cores, N+1 processes), so
        # the clock starts at the earliest moment any party saw the barrier open.
        t0 = min([t0] + [r["start"] for r in results])
        t1 = max(r["end"] for r in results)
        cpu1 = machine_cpu()
        watched1 = {pid: process_cpu_seconds(pid) for pid in watch_pids}
        finished = True
    finally:
        for p in procs:
            if not finished and p.is_alive():
                p.terminate()
            p.join(timeout=30)
    wall = max(t1 - t0, 1e-9)
    lat = sorted(x for r in results for x in r["lat"])
    done = sum(r["done"] for r in results)
    nbytes = sum(r["bytes"] for r in results)
    errors = sum(r["errors"] for r in results)
    busy, iowait = busy_between(cpu0, cpu1)
    row = {
        "op": op, "workers": workers, "chunk": chunk if op == "read" else None,
        "files": done, "files_listed": len(paths), "truncated": done < len(paths),
        "bytes": nbytes, "seconds": round(wall, 4),
        "files_per_s": round(done / wall, 1),
        "MB_per_s": round(nbytes / 1e6 / wall, 2) if op == "read" else None,
        "lat_ms_p50": _ms(percentile(lat, 50)), "lat_ms_p90": _ms(percentile(lat, 90)),
        "lat_ms_p99": _ms(percentile(lat, 99)), "lat_ms_max": _ms(lat[-1] if lat else None),
        "errors": errors,
        "first_error": next((r["first_error"] for r in results if r["first_error"]), None),
        "cpu_busy_pct": busy, "iowait_pct": iowait,
    }
    if watch_pids:
        spent = {str(pid): (round(watched1[pid] - watched0[pid], 3)
                            if watched0[pid] is not None and watched1[pid] is not None else None)
                 for pid in watch_pids}
        row["watched_cpu_s"] = spent
        total = [v for v in spent.values() if v is not None]
        if total and done:
            row["watched_cpu_us_per_file"] = round(sum(total) / done * 1e6, 1)
    return row


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1e3, 3)


# ------------------------------------------------------------------------------ passes


def do_items(a) -> dict:
    items = shuffled(load_list(a.list), a.seed)
    if a.limit:
        items = items[:a.limit]
    paths = [os.path.join(a.root, p) for p in items]
    pids = tuple(a.watch_pid)
    if getattr(a, "watch_tree", False):
        pids = tuple(q for p in pids for q in descendants(p))
    row = run_pass(a.cmd, paths, a.workers, getattr(a, "chunk", 0), a.time_limit, pids,
                   getattr(a, "unbuffered", False))
    row.update(unbuffered=bool(getattr(a, "unbuffered", False)))
    row.update(root=a.root, list=os.path.basename(a.list), seed=a.seed)
    return row


def do_walk(a) -> dict:
    cpu0 = machine_cpu()
    t0 = time.perf_counter()
    dirs = files = 0
    for _top, dnames, fnames in os.walk(a.root):
        dirs += len(dnames)
        files += len(fnames)
    wall = max(time.perf_counter() - t0, 1e-9)
    busy, iowait = busy_between(cpu0, machine_cpu())
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
    items = load_list(a.list)
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
        p.add_argument("--tag", action="append", default=[], metavar="KEY=VALUE",
                       help="extra field copied into the JSON row (repeatable)")
        p.add_argument("--out", help="also append the JSON row to this file")

    for name in ("read", "stat"):
        p = sub.add_parser(name)
        common(p)
        p.add_argument("--list", required=True, help="paths relative to --root, one a line")
        p.add_argument("--workers", type=int, default=1, help="reader processes (default 1)")
        p.add_argument("--seed", type=int, default=0,
                       help="shuffle seed (default 0); -1 keeps the list order")
        p.add_argument("--limit", type=int, default=0, help="only the first N after shuffling")
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
    for kv in a.tag:
        key, _, value = kv.partition("=")
        row[key] = value
    line = json.dumps(row)
    print(line, flush=True)
    if a.out:
        with open(a.out, "a") as f:
            f.write(line + "\n")
    return 1 if row.get("errors") else 0


if __name__ == "__main__":
    sys.exit(main())
