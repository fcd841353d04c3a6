"""Benchmark of the kernel-protocol FUSE engine (fanstore/fuse/engine) with its memfs.

Per worker count and reader mode (``default`` = ``open(p, "rb")``, ``raw`` = buffering=0),
a fresh memfs mount read cold and warm by R readers in a shuffled order, next to the same
files in a raw directory; files/s, daemon CPU per request and per file (schedstat), reader
CPU per file. Also: ping-pong against a pipe, READDIRPLUS of a 10,000-entry directory,
relisting with either opendir answer, clone fd vs one shared fd; --repeat rounds,
interleaved, medians (min-max). Prints a table; appends a JSON line to --results.

    .venv/bin/python tools/bench/kernel_engine_bench.py [--files 20000 --size 100000]
        [--readers 4] [--workers 1,2] [--modes default,raw] [--workdir DIR] [--no-raw]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "tests"))  # kernel_memfs: the engine's test file system

import kernel_memfs as memfs

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness as h  # noqa: E402

from fanstore.fuse.engine.counters import RequestCounters, diff
from fanstore.fuse.engine.mount import is_mounted

READER = r"""
import os, sys, time, json
paths = json.load(open(sys.argv[1])); mode = sys.argv[2]; size = int(sys.argv[3])
sys.stdout.write("ready\n"); sys.stdout.flush()
sys.stdin.readline()
bad = 0
c0 = time.process_time(); t0 = time.monotonic()
if mode == "raw":
    for p in paths:
        with open(p, "rb", buffering=0) as f:
            if len(f.read()) != size: bad += 1
else:
    for p in paths:
        with open(p, "rb") as f:
            if len(f.read()) != size: bad += 1
t1 = time.monotonic(); c1 = time.process_time()
print(json.dumps({"n": len(paths), "t0": t0, "t1": t1, "cpu": c1 - c0, "bad": bad}))
"""

LISTER = r"""
import os, sys, time, json
d = sys.argv[1]; reps = int(sys.argv[2])
c0 = time.process_time(); t0 = time.monotonic(); n = 0
for _ in range(reps):
    n += len(os.listdir(d))
print(json.dumps({"n": n, "wall": time.monotonic() - t0, "cpu": time.process_time() - c0}))
"""


def proc_cpu(pid: int) -> float:
    """Seconds on a CPU (user + kernel) of one process so far, to the nanosecond
    (/proc/PID/schedstat; /proc/PID/stat only counts 10 ms ticks). 0 if gone."""
    try:
        with open(f"/proc/{pid}/schedstat") as f:
            return int(f.read().split()[0]) / 1e9
    except OSError:
        return 0.0


class Server:
    """memfs served in a subprocess; CPU of its workers and its request counters."""

    def __init__(self, mnt: str, work: str, gen: str | None, spec: dict | None,
                 workers: int, extra: list[str]) -> None:
        self.mnt = mnt
        os.makedirs(mnt, exist_ok=True)
        self.cnt_path = os.path.join(work, "counters")
        args = [sys.executable, memfs.__file__, mnt, "--workers",
                str(workers), "--counters", self.cnt_path, *extra]
        if gen:
            args += ["--generate", gen]
        else:
            spec_path = os.path.join(work, "spec.json")
            with open(spec_path, "w") as f:
                json.dump(spec, f)
            args += ["--spec", spec_path]
        self.proc = subprocess.Popen(args, stdout=subprocess.PIPE, text=True, cwd=REPO)
        line = self.proc.stdout.readline()
        if not line.startswith("READY"):
            self.stop()
            raise SystemExit(f"memfs did not start: {line!r}")
        self.sup = int(line.split()[1])
        self.counters = RequestCounters.attach(self.cnt_path)

    def cpu(self) -> float:
        return sum(proc_cpu(p) for p in h.children(self.sup)) + proc_cpu(self.sup)

    def snap(self) -> dict[str, int]:
        return self.counters.snapshot()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if is_mounted(self.mnt):
            subprocess.run(["umount", "-l", "--", self.mnt], check=False)


def read_pass(paths: list[str], readers: int, mode: str, size: int, work: str) -> dict:
    """R readers over a shuffled split of ``paths``, started together."""
    rng = random.Random(len(paths) * 7 + readers)
    order = list(paths)
    rng.shuffle(order)
    procs = []
    for k in range(readers):
        lst = os.path.join(work, f"paths{k}.json")
        with open(lst, "w") as f:
            json.dump(order[k::readers], f)
        procs.append(subprocess.Popen([sys.executable, "-c", READER, lst, mode, str(size)],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True))
    for p in procs:
        assert p.stdout.readline().strip() == "ready"
    for p in procs:
        p.stdin.write("go\n")
        p.stdin.flush()
    res = [json.loads(p.communicate(timeout=3600)[0]) for p in procs]
    n = sum(r["n"] for r in res)
    wall = max(r["t1"] for r in res) - min(r["t0"] for r in res)
    bad = sum(r["bad"] for r in res)
    if bad:
        raise SystemExit(f"{bad} files had the wrong size")
    return {"files": n, "wall": wall, "files_s": n / wall, "reader_cpu": sum(r["cpu"] for r in res)}


def fuse_passes(args, work: str, workers: int, mode: str, extra: list[str]) -> list[dict]:
    mnt = os.path.join(work, "mnt")
    srv = Server(mnt, work, f"{args.files},{args.size},{args.dirs}", None, workers, extra)
    rows = []
    try:
        paths = [os.path.join(mnt, r) for r in memfs.generated_paths(args.files, args.dirs)]
        for which in ("cold", "warm"):
            c0, s0 = srv.cpu(), srv.snap()
            r = read_pass(paths, args.readers, mode, args.size, work)
            c1, s1 = srv.cpu(), srv.snap()
            d = diff(s1, s0)
            nreq = sum(v for k, v in d.items() if k not in (
                "malformed", "handler_error", "stale_reply", "reply_error", "oversized_reply"))
            r.update(fs="fuse", workers=workers, mode=mode, pass_=which, extra=" ".join(extra),
                     daemon_cpu=c1 - c0, requests=nreq, by_op=d,
                     us_per_req=(c1 - c0) / nreq * 1e6 if nreq else None,
                     daemon_us_per_file=(c1 - c0) / r["files"] * 1e6,
                     reader_us_per_file=r["reader_cpu"] / r["files"] * 1e6)
            rows.append(r)
            print(fmt(r), flush=True)
    finally:
        srv.stop()
    return rows


def raw_passes(args, work: str, mode: str) -> list[dict]:
    root = os.path.join(work, "raw")
    rels = memfs.generated_paths(args.files, args.dirs)
    if not os.path.exists(os.path.join(root, rels[-1])):
        for rel in rels:
            p = os.path.join(root, rel)
            os.makedirs(os.path.dirname(p), exist_ok=True)
            with open(p, "wb") as f:
                f.write(memfs.content_for(rel, args.size))
        os.sync()
    paths = [os.path.join(root, r) for r in rels]
    for p in paths:  # evict these files (only these) from the page cache
        fd = os.open(p, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
    rows = []
    for which in ("cold", "warm"):
        r = read_pass(paths, args.readers, mode, args.size, work)
        r.update(fs="raw", workers=0, mode=mode, pass_=which, extra="",
                 reader_us_per_file=r["reader_cpu"] / r["files"] * 1e6)
        rows.append(r)
        print(fmt(r), flush=True)
    return rows


def readdir_bench(args, work: str) -> list[dict]:
    """READDIRPLUS of a 10,000-entry directory; relisting with either opendir answer."""
    import numpy as np

    from fanstore.fuse.engine import records as R

    n = 10_000
    names = [f"entry-{i:06d}-with-a-longer-name".encode() for i in range(n)]
    attrs = R.make_attrs(np.arange(2, n + 2), np.full(n, 100_000), np.full(n, 0o100644))
    t0 = time.process_time()
    reps = 20
    for _ in range(reps):
        R.DirListing(names, R.EntryTable(attrs).entries)
    pack_ms = (time.process_time() - t0) / reps * 1e3
    rows = [{"what": "pack 10,000-entry listing (EntryTable + DirListing)", "ms": pack_ms}]
    print(f"  numpy packing of a 10,000-entry listing: {pack_ms:.1f} ms CPU", flush=True)
    for opendir in ("enosys", "cache"):
        mnt = os.path.join(work, "mnt")
        srv = Server(mnt, work, None, {"big_dirs": {"big": n}}, 1, ["--opendir", opendir])
        try:
            d = os.path.join(mnt, "big")
            c0, s0 = srv.cpu(), srv.snap()
            first = subprocess.run([sys.executable, "-c", LISTER, d, "1"], capture_output=True,
                                   text=True, check=True)
            c1, s1 = srv.cpu(), srv.snap()
            rel = 200
            again = subprocess.run([sys.executable, "-c", LISTER, d, str(rel)],
                                   capture_output=True, text=True, check=True)
            time.sleep(0.3)  # background RELEASEDIRs
            c2, s2 = srv.cpu(), srv.snap()
            d1, d2 = diff(s1, s0), diff(s2, s1)
            f1, f2 = json.loads(first.stdout), json.loads(again.stdout)
            row = {"what": f"readdir opendir={opendir}", "first_by_op": d1,
                   "first_daemon_ms": (c1 - c0) * 1e3,
                   "first_us_per_readdirplus": (c1 - c0) / max(1, d1.get("readdirplus", 0)) * 1e6,
                   "first_us_per_entry": (c1 - c0) / n * 1e6,
                   "first_lister_ms": f1["cpu"] * 1e3,
                   "relist_by_op": d2, "relist_daemon_us_per_listing": (c2 - c1) / rel * 1e6,
                   "relist_lister_us_per_listing": f2["cpu"] / rel * 1e6}
            rows.append(row)
            print(f"  opendir={opendir}: first listing {d1} daemon {row['first_daemon_ms']:.1f} "
                  f"ms ({row['first_us_per_readdirplus']:.0f} us/readdirplus, "
                  f"{row['first_us_per_entry']:.2f} us/entry); relist x{rel}: {d2}, lister "
                  f"{row['relist_lister_us_per_listing']:.0f} us/listing, daemon "
                  f"{row['relist_daemon_us_per_listing']:.1f} us/listing", flush=True)
        finally:
            srv.stop()
    return rows


PINGPONG = r"""
import errno, fcntl, json, os, sys, termios, time
mnt, what, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
buf = bytearray(64)
if what == "ioctl":
    fd = os.open(os.path.join(mnt, "a.txt"), os.O_RDONLY)
    def one():
        try:
            fcntl.ioctl(fd, termios.TCGETS, buf)
        except OSError:
            pass
else:
    p = os.path.join(mnt, "no-such-file")
    def one():
        try:
            os.stat(p)
        except FileNotFoundError:
            pass
for _ in range(200):
    one()
sys.stdout.write("ready\n"); sys.stdout.flush(); sys.stdin.readline()
c0 = time.process_time(); t0 = time.monotonic()
for _ in range(n):
    one()
print(json.dumps({"cpu": time.process_time() - c0, "wall": time.monotonic() - t0}))
"""

PIPE_PINGPONG = r"""
import json, os, time, sys
n = int(sys.argv[1])
r1, w1 = os.pipe(); r2, w2 = os.pipe()
pid = os.fork()
if pid == 0:
    for _ in range(n):
        os.read(r1, 1); os.write(w2, b"y")
    os._exit(0)
def sched(p):
    return int(open(f"/proc/{p}/schedstat").read().split()[0]) / 1e9
c0 = time.process_time(); s0 = sched(pid); t0 = time.monotonic()
for _ in range(n):
    os.write(w1, b"x"); os.read(r2, 1)
wall = time.monotonic() - t0; cpu = time.process_time() - c0; srv = sched(pid) - s0
os.waitpid(pid, 0)
print(json.dumps({"cpu": cpu, "server": srv, "wall": wall}))
"""


def pingpong_bench(work: str, n: int = 20_000) -> list[dict]:
    """One client, one request at a time: the engine's cost per request without contention,
    next to a pipe ping-pong between two processes (the context-switch floor)."""
    rows = []
    out = json.loads(subprocess.run([sys.executable, "-c", PIPE_PINGPONG, str(n)],
                                    capture_output=True, text=True, check=True).stdout)
    rows.append({"what": "pipe ping-pong", "client_us": out["cpu"] / n * 1e6,
                 "server_us": out["server"] / n * 1e6, "rtt_us": out["wall"] / n * 1e6})
    for w in (1, 2):
        mnt = os.path.join(work, "mnt")
        srv = Server(mnt, work, None, {"files": {"a.txt": 10}}, w, [])
        try:
            for what in ("ioctl", "lookup-enoent"):
                p = subprocess.Popen([sys.executable, "-c", PINGPONG, mnt, what, str(n)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
                assert p.stdout.readline().strip() == "ready"
                c0, s0 = srv.cpu(), srv.snap()
                p.stdin.write("go\n")
                p.stdin.flush()
                out = json.loads(p.communicate(timeout=600)[0])
                c1, s1 = srv.cpu(), srv.snap()
                nreq = sum(diff(s1, s0).values())
                rows.append({"what": f"{what} ping-pong, workers={w}",
                             "client_us": out["cpu"] / n * 1e6,
                             "server_us": (c1 - c0) / max(1, nreq) * 1e6,
                             "rtt_us": out["wall"] / n * 1e6, "requests": nreq})
        finally:
            srv.stop()
    for r in rows:
        print(f"  {r['what']:30} client {r['client_us']:5.1f} us  server {r['server_us']:5.1f} "
              f"us/request  round trip {r['rtt_us']:5.1f} us", flush=True)
    return rows


def fmt(r: dict) -> str:
    s = (f"  {r['fs']:4} w={r['workers']} {r['mode']:7} {r['pass_']:4} {r.get('extra', ''):10} "
         f"{r['files_s']:9.0f} files/s  reader {r['reader_us_per_file']:6.1f} us/file")
    if r["fs"] == "fuse":
        upr = f"{r['us_per_req']:.1f}" if r["us_per_req"] else "-"
        s += (f"  daemon {r['daemon_us_per_file']:6.1f} us/file, {upr} us/req, "
              f"{r['requests']} req {dict(sorted(r['by_op'].items()))}")
    return s


def _med(values: list[float]) -> str:
    v = sorted(x for x in values if x is not None)
    if not v:
        return "-"
    mid = v[len(v) // 2] if len(v) % 2 else (v[len(v) // 2 - 1] + v[len(v) // 2]) / 2
    if len(v) == 1:
        return f"{mid:,.0f}" if mid >= 100 else f"{mid:.1f}"
    f = (lambda x: f"{x:,.0f}") if mid >= 100 else (lambda x: f"{x:.1f}")
    return f"{f(mid)} ({f(v[0])}-{f(v[-1])})"


def summary(rows: list[dict]) -> str:
    keyed: dict[tuple, list[dict]] = {}
    for r in rows:
        if "fs" in r:
            keyed.setdefault((r["fs"], r["workers"], r["mode"], r["extra"], r["pass_"]),
                             []).append(r)
    lines = []
    for (fs, w, mode, extra, which), rs in keyed.items():
        fuse = fs == "fuse"
        lines.append((f"{fs} {extra}".strip() if fuse else "raw ext4 dir", w if fuse else "-",
                      "rb, buffering=0" if mode == "raw" else "rb (default)", which,
                      *(_med([r[k] for r in rs]) for k in ("files_s", "reader_us_per_file")),
                      *((_med([r[k] for r in rs]) for k in ("daemon_us_per_file", "us_per_req"))
                        if fuse else ("-", "-")),
                      _med([r["requests"] / r["files"] for r in rs]) if fuse else "-"))
    return h.table(["fs", "workers", "reader open()", "pass", "files/s", "reader CPU us/file",
                    "daemon CPU us/file", "daemon CPU us/request", "requests/file"], lines,
                   "l" * 9)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--files", type=int, default=20_000)
    ap.add_argument("--size", type=int, default=100_000)
    ap.add_argument("--dirs", type=int, default=20)
    ap.add_argument("--readers", type=int, default=4)
    ap.add_argument("--workers", default="1,2")
    ap.add_argument("--modes", default="default,raw")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--no-raw", action="store_true")
    ap.add_argument("--no-readdir", action="store_true")
    ap.add_argument("--no-pingpong", action="store_true")
    ap.add_argument("--no-clone-compare", action="store_true")
    ap.add_argument("--results", default=os.path.join(REPO, "tools", "bench", "results",
                                                      "kernel_engine_bench.jsonl"))
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("kernel_engine_bench: needs root (mount(2))", file=sys.stderr)
        return 1
    work = args.workdir or tempfile.mkdtemp(prefix="kfbench-")
    os.makedirs(work, exist_ok=True)
    rows: list[dict] = []
    extra_rows: list[dict] = []
    print(f"{args.files} files x {args.size} B in {args.dirs} dirs, {args.readers} readers, "
          f"{os.cpu_count()} CPUs, {args.repeat} rounds; work dir {work}", flush=True)
    try:
        for rnd in range(args.repeat):
            print(f"round {rnd + 1}", flush=True)
            for mode in args.modes.split(","):
                for w in (int(x) for x in args.workers.split(",")):
                    rows += fuse_passes(args, work, w, mode, [])
                if not args.no_raw:
                    rows += raw_passes(args, work, mode)
            if not args.no_clone_compare:
                rows += fuse_passes(args, work, 2, "default", ["--no-clone"])
        if not args.no_pingpong:
            extra_rows += pingpong_bench(work)
        if not args.no_readdir:
            extra_rows += readdir_bench(args, work)
    finally:
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)
    print("\nmedians (min-max) over rounds; uptime:", os.getloadavg())
    print(summary(rows))
    with open(args.results, "a") as f:
        f.write(json.dumps({"time": time.time(), "args": vars(args), "rows": rows,
                            "extra": extra_rows, "loadavg": os.getloadavg()}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
