#!/usr/bin/env python3
"""The two FUSE frontends next to squashfuse_ll and the raw directory, in one run.

Backends (``--backends``): raw, squashfuse_ll (zstd-3), pyfuse3, kernel, kernel-wN (N
workers), kernel-noplus / kernel-plus / kernel-autoplus (READDIRPLUS off / on / auto),
pyfuse3-old (another build, ``--old-fanstore``). Passes (``--passes``): read (cold, warm,
warm unbuffered), find, findread. Datasets (``--preset``): quick, peers, small300k,
small1280k. What is measured: docs/benchmarks.md, "FUSE frontends".

    .venv/bin/python tools/bench/fuse_bench.py --preset peers --work /tmp/fuse-bench
    .venv/bin/python tools/bench/fuse_bench.py --preset small300k --passes find,read
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness as h  # noqa: E402
from harness import GEN, READER, log  # noqa: E402

PRESETS = {
    "quick": dict(kind="peers", files=2000, classes=20, reps=1),
    "peers": dict(kind="peers", files=20000, classes=100, reps=3),
    "small300k": dict(kind="text", files=300_000, classes=1000, reps=2),
    "small1280k": dict(kind="text", files=1_280_000, classes=1000, reps=1),
}

#: --fuse-flags of the READDIRPLUS backends: plain READDIR instead of READDIRPLUS (the
#: default), READDIRPLUS for every listing, the kernel's pick per call
FUSE_FLAGS = {"kernel-noplus": "-DO_READDIRPLUS", "kernel-plus": "+DO_READDIRPLUS",
              "kernel-autoplus": "+DO_READDIRPLUS,+READDIRPLUS_AUTO"}
WORDS = ("the a of to and in is for on with by at from as model image label train data "
         "batch loss layer value score class sample epoch feature vector token text caption "
         "red green blue small large fast slow left right up down north south cat dog car "
         "tree house river cloud stone light dark").split()


def make_text_tree(root: str, files: int, classes: int, seed: int = 12) -> None:
    """``files`` captions-like text files of 1-4.2 kB (mean ~2.6 kB) in ``classes`` dirs."""
    rng = random.Random(seed)
    for c in range(classes):
        os.makedirs(os.path.join(root, f"c{c:04d}"), exist_ok=True)
    for i in range(files):
        n = rng.randint(1000, 4200)
        words = []
        size = 0
        while size < n:
            w = rng.choice(WORDS)
            words.append(w)
            size += len(w) + 1
            if rng.random() < 0.08:
                words.append(f"{rng.randint(0, 99999)}")
        text = (" ".join(words)[:n] + "\n").encode()
        with open(os.path.join(root, f"c{i % classes:04d}", f"t{i:07d}.txt"), "wb") as f:
            f.write(text)


class FuseBench(h.Bench):
    name = "fuse_bench"

    def __init__(self, a: argparse.Namespace) -> None:
        super().__init__(a)
        self.p = PRESETS[a.preset]
        self.data = os.path.join(self.work, f"data-{a.preset}")
        self.procs: dict[str, subprocess.Popen] = {}
        self.fuse_mounts: set[str] = set()
        self.backends = a.backends.split(",")

    # -------------------------------------------------------------- data and images
    def dataset(self) -> None:
        stamp, want = self.data + ".json", dict(self.p, preset=self.a.preset)
        if not (h.stamped(stamp, want) and os.path.isdir(self.data)):
            shutil.rmtree(self.data, ignore_errors=True)
            log(f"generating {self.p['files']:,} files ({self.p['kind']})")
            t = time.time()
            if self.p["kind"] == "peers":
                subprocess.run([sys.executable, GEN, self.data, "--files", str(self.p["files"]),
                                "--classes", str(self.p["classes"]), "--subdir", "small"],
                               check=True, stdout=subprocess.DEVNULL)
            else:
                make_text_tree(os.path.join(self.data, "small"), self.p["files"],
                               self.p["classes"])
            os.sync()
            with open(stamp, "w") as f:
                json.dump(want, f)
            log(f"  {time.time() - t:.0f} s")
        self.files = []
        for top, dirs, names in os.walk(self.data):
            dirs.sort()
            for n in sorted(names):
                self.files.append(os.path.relpath(os.path.join(top, n), self.data))
        self.list = os.path.join(self.work, f"list-{self.a.preset}.txt")
        with open(self.list, "w") as f:
            f.write("\n".join(self.files) + "\n")
        self.raw_bytes = h.dir_bytes(self.data)

    def images(self) -> None:
        self.img = os.path.join(self.work, f"img-{self.a.preset}.sqfs")
        self.store = os.path.join(self.work, f"store-{self.a.preset}")
        if "squashfuse_ll" in self.backends:
            self.build("squashfuse_ll", self.img, self.img, [
                "mksquashfs", self.data, self.img, "-comp", "zstd", "-Xcompression-level", "3",
                "-noappend", "-no-progress", "-quiet"])
        if any(b.startswith(("pyfuse3", "kernel")) for b in self.backends):
            self.build("fanstore", self.store, os.path.join(self.store, "fanstore.idx"), [
                self.fanstore, "pack", self.data, self.store, "--codec", "zstd:3",
                "--partitions", "8", "--force", "--no-progress"])

    def build(self, backend: str, out: str, done: str, argv: list[str]) -> None:
        """``argv`` writes ``out`` (timed) unless ``done`` exists and is newer than the data."""
        if os.path.exists(done) and os.path.getmtime(out) >= os.path.getmtime(
                self.data + ".json"):
            return
        log(f"building the {backend} image: {h.shown(argv)}")
        t = time.time()
        subprocess.run(argv, check=True, stdout=subprocess.DEVNULL)
        self.emit({"kind": "build", "backend": backend, "seconds": round(time.time() - t, 1),
                   "bytes": h.dir_bytes(out)})

    # -------------------------------------------------------------- mounts
    def root_of(self, b: str) -> str:
        return self.data if b == "raw" else os.path.join(self.mnt_root, b)

    def mount(self, b: str) -> int | None:
        """Mount backend ``b`` freshly; return the pid of its serving process (None: raw)."""
        if b == "raw":
            return None
        mnt = self.root_of(b)
        os.makedirs(mnt, exist_ok=True)
        if b == "squashfuse_ll":
            proc = subprocess.Popen(["squashfuse_ll", "-f", self.img, mnt],
                                    stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            self.procs[b] = proc
            deadline = time.time() + 20
            while not os.path.ismount(mnt):
                if proc.poll() is not None or time.time() > deadline:
                    raise RuntimeError(f"squashfuse_ll did not mount: {proc.stderr.read()}")
                time.sleep(0.05)
            self.fuse_mounts.add(mnt)
            return proc.pid
        if b == "pyfuse3-old":  # another FanStore build (--old-fanstore), as it mounts
            subprocess.run([self.a.old_fanstore, "mount", self.store, mnt], check=True)
            self.fuse_mounts.add(mnt)
            return h.state_pid(mnt)
        argv = [self.fanstore, "mount", self.store, mnt, "--frontend",
                "pyfuse3" if b == "pyfuse3" else "kernel"]
        if b.startswith("kernel-w"):
            argv += ["--workers", b[len("kernel-w"):]]
        if b in FUSE_FLAGS:
            argv.append(f"--fuse-flags={FUSE_FLAGS[b]}")
        subprocess.run(argv, check=True)
        self.fuse_mounts.add(mnt)
        return h.state_pid(mnt)

    def umount(self, b: str) -> None:
        if b == "raw":
            return
        mnt = self.root_of(b)
        if b == "squashfuse_ll":
            subprocess.run(["fusermount3", "-u", "--", mnt], capture_output=True)
            proc = self.procs.pop(b, None)
            if proc is not None:
                proc.wait(30)
        else:
            subprocess.run([self.fanstore, "umount", mnt], capture_output=True)
        self.fuse_mounts.discard(mnt)

    def stats(self, b: str) -> dict | None:
        if b not in ("raw", "squashfuse_ll", "pyfuse3-old"):
            return h.control(self.root_of(b), {"op": "stats"})
        return None

    # -------------------------------------------------------------- passes
    def read_pass(self, b: str, pid: int | None, seed: int, unbuffered: bool) -> dict:
        argv = [sys.executable, READER, "read", "--root", self.root_of(b), "--list", self.list,
                "--workers", str(self.a.readers), "--seed", str(seed)]
        if unbuffered:
            argv.append("--unbuffered")
        if pid:
            argv += ["--watch-pid", str(pid), "--watch-tree"]
        before = self.stats(b)
        out = subprocess.run(argv, capture_output=True, text=True)
        row = json.loads(out.stdout.strip().splitlines()[-1])
        d = h.diff_stats(self.stats(b), before)
        if d:
            row["requests"] = d["requests_by_op"]
            if "requests" in d:  # the kernel frontend counts requests; pyfuse3 does not
                row["requests_total"] = d["requests"]
            row["chunks_decoded"] = d.get("chunks_decoded", 0)
        return row

    def find(self, b: str) -> float:
        t = time.perf_counter()
        subprocess.run(["find", self.root_of(b)], stdout=subprocess.DEVNULL, check=True)
        return time.perf_counter() - t

    def one(self, b: str, rep: int) -> None:
        passes = self.a.passes.split(",")
        if "find" in passes:
            pid = self.mount(b)
            h.drop_caches()
            cold = self.find(b)
            warm = self.find(b)
            self.emit({"kind": "find", "backend": b, "rep": rep, "cold_s": round(cold, 3),
                       "warm_s": round(warm, 3), "files": len(self.files)})
            log(f"  {b}: find cold {cold:.2f} s warm {warm:.2f} s")
            self.umount(b)
        if "findread" in passes:  # list the tree, then read every file (ImageFolder-like)
            pid = self.mount(b)
            h.drop_caches()
            listed = self.find(b)
            row = self.read_pass(b, pid, 300 + rep, False)
            row.update(kind="findread", backend=b, rep=rep, find_s=round(listed, 3),
                       total_s=round(listed + row["seconds"], 3))
            self.emit(row)
            log(f"  {b}: find {listed:.2f} s + cold read {row['seconds']:.2f} s "
                f"({row['files_per_s']:,.0f} files/s, requests {row.get('requests_total', '-')})")
            self.umount(b)
        if "read" in passes:
            pid = self.mount(b)
            h.drop_caches()
            seed = 100 + rep
            for phase, unbuffered in (("cold", False), ("warm", False),
                                      ("warm-unbuffered", True)):
                row = self.read_pass(b, pid, seed, unbuffered)
                row.update(kind="read", backend=b, rep=rep, phase=phase)
                if pid:
                    row["server_pss_kb"] = h.memory(h.descendants(pid))[1] // 1024
                    row["server_processes"] = len(h.descendants(pid))
                self.emit(row)
                log(f"  {b} {phase}: {row['files_per_s']:,.0f} files/s, server "
                    f"{row.get('watched_cpu_us_per_file', '-')} us/file, requests "
                    f"{row.get('requests_total', '-')}")
            self.umount(b)

    def run(self) -> None:
        self.dataset()
        self.images()
        for rep in range(self.a.reps or self.p["reps"]):
            order = self.backends[rep % len(self.backends):] + \
                self.backends[:rep % len(self.backends)]
            log(f"repetition {rep + 1}: {', '.join(order)}")
            for b in order:
                self.one(b, rep)

    def cleanup(self) -> None:
        for mnt in list(self.fuse_mounts):
            subprocess.run(["fusermount3", "-u", "-z", "--", mnt], capture_output=True)
        for proc in self.procs.values():
            proc.kill()


def render(bench: FuseBench, label: str, shown: list[str]) -> str:
    rows, files, bs = bench.rows, len(bench.files), bench.backends
    phases = ("cold", "warm", "warm-unbuffered")

    def vals(b, phase, key):
        return h.row_vals(rows, key, kind="read", backend=b, phase=phase)

    reads = []
    for phase in phases:
        base_sq, base_raw = (h.med(vals(b, phase, "files_per_s"))
                             for b in ("squashfuse_ll", "raw"))
        for b in bs:
            fps, rs = vals(b, phase, "files_per_s"), h.pick_rows(rows, kind="read", backend=b,
                                                                 phase=phase)
            if fps:
                reads.append((b, phase, h.spread(fps), h.ratio(h.med(fps), base_sq),
                               h.ratio(h.med(fps), base_raw),
                               h.num(h.med(vals(b, phase, "watched_cpu_us_per_file"))),
                               h.num(h.med([r["requests_total"] / max(1, r["files"]) for r in rs
                                            if "requests_total" in r]), 3),
                               h.num(h.med([r["server_pss_kb"] * 1024 / max(1, files)
                                            for r in rs if r.get("server_pss_kb")]))))
    out = [f"### FUSE frontends, {bench.a.preset}: {files:,} files, {bench.a.readers} readers",
           "", label or "", "", f"`{' '.join(shown)}` (commit {h.git_commit()}, "
           f"{h.now_utc()}, load average at the end {h.loadavg1()})", "",
           h.table(["backend", "phase", "files/s (median, min-max)", "x squashfuse_ll", "x raw",
                    "server CPU us/file", "requests/file", "PSS B/file"], reads, "l" * 8)]
    # A per-file CPU model: what a node needs to serve the 40,000 files/s of 8 GPUs.
    model = [(b, phase, h.num(cpu), h.num(1e6 / cpu) if cpu > 0 else "no limit",
              h.num(40_000 * cpu / 1e6, 1), h.num(64e6 / cpu) if cpu > 0 else "no limit")
             for b in bs if b != "raw" for phase in phases
             for cpu in [h.med(vals(b, phase, "watched_cpu_us_per_file"))] if cpu is not None]
    if model:
        out += ["", "Per-file CPU model: files/s one core serves, cores for 40,000 files/s, "
                "files/s on 64 cores.", "",
                h.table(["backend", "phase", "server CPU us/file", "files/s per core",
                         "cores for 40,000 files/s", "files/s on 64 cores"], model, "l" * 6)]
    findread = []
    for b in bs:
        mine = h.pick_rows(rows, kind="findread", backend=b)
        if mine:
            tot, fnd = (h.med([r[k] for r in mine]) for k in ("total_s", "find_s"))
            findread.append((b, f"{h.num(tot, 2)} ({h.num(fnd, 2)} + {h.num(tot - fnd, 2)})",
                             h.num(h.med([r["files_per_s"] for r in mine])),
                             h.num(h.med([r.get("requests_total", 0) / max(1, r["files"])
                                          for r in mine]), 2)))
    if findread:
        out += ["", h.table(["backend", "find, then cold read of every file: s (find + read)",
                             "files/s of the read", "requests/file"], findread, "l" * 4)]
    finds = h.pick_rows(rows, kind="find")
    if finds:
        sq = [[r[k] for r in finds if r["backend"] == "squashfuse_ll"]
              for k in ("cold_s", "warm_s")]
        found = [(b, *(h.spread(x, 2) for x in (c, w)),
                  f"{h.ratio(h.med(c), h.med(sq[0]))} / {h.ratio(h.med(w), h.med(sq[1]))}")
                 for b in bs for c, w in [[[r[k] for r in finds if r["backend"] == b]
                                            for k in ("cold_s", "warm_s")]] if c]
        out += ["", h.table(["backend", "find cold s", "find warm s",
                             "x squashfuse_ll cold / warm"], found, "l" * 4)]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    raw_argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="quick")
    p.add_argument("--work", default="/tmp/fuse-bench")
    p.add_argument("--backends", default="raw,squashfuse_ll,pyfuse3,kernel")
    p.add_argument("--passes", default="read,find")
    p.add_argument("--readers", type=int, default=4)
    p.add_argument("--old-fanstore", help="the fanstore command of another build, mounted "
                   "as backend pyfuse3-old (e.g. the commit before a change, for before/after)")
    p.add_argument("--reps", type=int, default=0, help="repetitions (default: the preset's)")
    p.add_argument("--label", default="")
    p.add_argument("--section", default="",
                   help="section of docs/benchmarks.md and results file name (default "
                        "fuse_bench-PRESET); lets runs of one preset with other backends or "
                        "passes keep their own table")
    p.add_argument("--no-docs", action="store_true")
    p.add_argument("--docs", default=h.DOCS)
    p.add_argument("--results", default=None)
    p.add_argument("--fanstore", help="the fanstore command (default: next to python)")
    a = p.parse_args(raw_argv)
    a.section = a.section or f"fuse_bench-{a.preset}"
    a.results = a.results or os.path.join(h.RESULTS_DIR, f"{a.section}.jsonl")
    return h.main(FuseBench(a), render, raw_argv, section_name=a.section)


if __name__ == "__main__":
    sys.exit(main())
