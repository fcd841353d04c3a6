#!/usr/bin/env python3
"""FanStore at scale: a tree of millions of tiny files next to mksquashfs + squashfuse_ll.

The tree comes from ``tools/gen_tree.py`` (ImageNet-like names, ~1,000 files a directory).
Passes (``--passes``, in this order):

  pack    ``fanstore pack`` (defaults), page cache dropped first: wall time, CPU, size.
  mksquashfs  the same for ``mksquashfs`` (zstd 3, as the peer benchmark).
  mount   for each ``--workers`` value, a fresh mount (no staging): time to ready, PSS of
          every FanStore process after the mount, after a cold ``find MNT -type f`` and
          after a cold shuffled read of ``--reads`` files; the find's wall time, its own
          kernel time and the FanStore processes' CPU; the read's files/s.
  sqfs    the same find and read through squashfuse_ll on the mksquashfs image.
  old     the same as ``mount`` with another FanStore build (``--old-fanstore``) on a store
          it can read (``--old-store``): today's figures next to the new ones, one run.
  noplus  the same as ``mount`` (last --workers value only) with plain READDIR (``--fuse-flags=-DO_READDIRPLUS``): a
          listing creates no inodes in the kernel, every later open costs a LOOKUP.

Many nodes (N one-rank nodes, N x K ranks) are ``tools/bench/nodes_bench.py``'s.

    .venv/bin/python tools/gen_tree.py /work/data/tree10m --files 10000000
    .venv/bin/python tools/bench/scale_bench.py --data /work/data/tree10m --work /work/scale
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness as h  # noqa: E402
from harness import READER, log  # noqa: E402

MKSQUASHFS = ["-comp", "zstd", "-Xcompression-level", "3", "-processors", "2", "-noappend",
              "-no-progress", "-quiet"]


def _children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def _children_sys() -> float:
    return resource.getrusage(resource.RUSAGE_CHILDREN).ru_stime


class ScaleBench(h.Bench):
    name = "scale_bench"

    def __init__(self, a: argparse.Namespace) -> None:
        super().__init__(a)
        with open(os.path.join(a.data, ".gen_tree.json")) as f:
            self.tree = json.load(f)
        self.files = int(self.tree["files"])
        self.img = os.path.join(self.work, "tree.sqfs")
        self.sq_procs: list[subprocess.Popen] = []

    # -------------------------------------------------------------- the tree
    def sample(self) -> str:
        """A list of ``--reads`` files of the tree, shuffled (paths follow gen_tree)."""
        per = int(self.tree["per_dir"])
        rng = random.Random(29)
        picks = rng.sample(range(self.files), min(self.a.reads, self.files))
        return self.write_list("reads.txt", [
            f"train/n{i // per:08d}/n{i // per:08d}_{i % per:06d}.txt" for i in picks])

    # -------------------------------------------------------------- pack
    def timed(self, argv: list[str], what: str) -> dict:
        h.drop_caches()
        self.cmd(argv)
        cpu0, t0 = _children_cpu(), time.perf_counter()
        p = subprocess.run(argv, capture_output=True, text=True)
        wall, cpu = time.perf_counter() - t0, _children_cpu() - cpu0
        if p.returncode != 0:
            raise RuntimeError(f"{what} failed: {p.stderr.strip()[-400:]}")
        return {"wall_s": round(wall, 2), "cpu_s": round(cpu, 2),
                "cpu_us_per_file": round(cpu / self.files * 1e6, 2)}

    def pack(self) -> None:
        row = self.timed([self.fanstore, "pack", self.a.data, self.store, "--no-progress",
                          "--force"], "fanstore pack")
        info = json.loads(subprocess.run([self.fanstore, "info", self.store, "--json"],
                                         capture_output=True, text=True, check=True).stdout)
        self.emit(dict(row, kind="pack", tool="fanstore", bytes=h.dir_bytes(self.store),
                       index_bytes=info.get("index_bytes"),
                       format_version=info.get("format_version")))
        log(f"  fanstore pack: {row['wall_s']} s, {h.dir_bytes(self.store) / 1e6:,.0f} MB")

    def mksquashfs(self) -> None:
        row = self.timed(["mksquashfs", self.a.data, self.img, *MKSQUASHFS], "mksquashfs")
        self.emit(dict(row, kind="pack", tool="mksquashfs", bytes=os.path.getsize(self.img)))
        log(f"  mksquashfs: {row['wall_s']} s, {os.path.getsize(self.img) / 1e6:,.0f} MB")

    # -------------------------------------------------------------- mounts
    def pss(self, pid: int | None) -> int:
        return h.memory(h.fanstore_processes(pid))[1]

    def find(self, mnt: str) -> dict:
        h.drop_caches()
        sys0, t0 = _children_sys(), time.perf_counter()
        p = subprocess.run(f"find {mnt} -type f | wc -l", shell=True, capture_output=True,
                           text=True)
        return {"find_s": round(time.perf_counter() - t0, 2),
                "find_sys_s": round(_children_sys() - sys0, 2),
                "found": int(p.stdout.strip() or 0)}

    def read(self, mnt: str, pid: int | None) -> dict:
        argv = [sys.executable, READER, "read", "--root", mnt, "--list", self.list,
                "--workers", "4", "--seed", "-1"]
        if pid:
            argv += ["--watch-pid", str(pid), "--watch-tree"]
        self.cmd(argv)
        row = self.sub(argv)
        return {k: row.get(k) for k in ("files", "files_per_s", "errors",
                                        "watched_cpu_us_per_file", "lat_ms_p50", "lat_ms_p99")}

    def fanstore_pass(self, backend: str, fanstore: str, store: str, workers: int,
                      extra: tuple[str, ...] = ()) -> None:
        mnt = os.path.join(self.mnt_root, backend)
        os.makedirs(mnt, exist_ok=True)
        h.drop_caches()
        argv = [fanstore, "mount", store, mnt, "--workers", str(workers), *extra]
        self.cmd(argv)
        t0 = time.perf_counter()
        p = subprocess.run(argv, capture_output=True, text=True, timeout=900)
        ready = time.perf_counter() - t0
        if p.returncode != 0:
            raise RuntimeError(f"{backend}: mount failed: {p.stderr.strip()[-400:]}")
        pid = h.state_pid(mnt)
        self.mounted[mnt] = pid
        row = {"kind": "mount", "backend": backend, "workers": workers,
               "ready_s": round(ready, 2), "processes": len(h.fanstore_processes(pid)),
               "pss_mount": self.pss(pid)}
        cpu0 = h.cpu_seconds(h.fanstore_processes(pid))
        row.update(self.find(mnt))
        row["find_server_cpu_s"] = round(h.cpu_seconds(h.fanstore_processes(pid)) - cpu0, 2)
        row["pss_find"] = self.pss(pid)
        row.update(self.read(mnt, pid))
        row["pss_read"] = self.pss(pid)
        self.emit(row)
        log(f"  {backend} w{workers}: ready {ready:.1f} s, find {row['find_s']} s, read "
            f"{row['files_per_s']} files/s, PSS B/file {row['pss_find'] / self.files:.0f}")
        self.umount(mnt)

    def sqfs_pass(self) -> None:
        mnt = os.path.join(self.mnt_root, "squashfuse_ll")
        os.makedirs(mnt, exist_ok=True)
        self.cmd(["squashfuse_ll", "-f", self.img, mnt])
        proc = subprocess.Popen(["squashfuse_ll", "-f", self.img, mnt],
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        self.sq_procs.append(proc)
        deadline = time.time() + 60
        while not os.path.ismount(mnt):
            if proc.poll() is not None or time.time() > deadline:
                raise RuntimeError("squashfuse_ll did not mount")
            time.sleep(0.05)
        row = {"kind": "mount", "backend": "squashfuse_ll", "workers": 1}
        row.update(self.find(mnt))
        row.update(self.read(mnt, proc.pid))
        row["pss_read"] = h.memory([proc.pid])[1]
        self.emit(row)
        log(f"  squashfuse_ll: find {row['find_s']} s, read {row['files_per_s']} files/s")
        subprocess.run(["fusermount3", "-u", "--", mnt], capture_output=True)
        proc.wait(60)

    def run(self) -> None:
        passes = self.a.passes.split(",")
        if self.a.pack_rows:  # an earlier run's pack rows (their own run id), shown here
            with open(self.a.pack_rows) as f:
                for line in f:
                    row = json.loads(line)
                    if row.get("kind") == "pack":
                        self.rows.append(row)
                        with open(self.jsonl_tmp, "a") as out:
                            out.write(json.dumps(row) + "\n")
        self.list = self.sample()
        if "pack" in passes:
            self.pack()
        if "mksquashfs" in passes:
            self.mksquashfs()
        if "sqfs" in passes:
            self.sqfs_pass()
        for w in h.ints(self.a.workers):
            if "mount" in passes:
                self.fanstore_pass("fanstore", self.fanstore, self.store, w)
            if "old" in passes:
                self.fanstore_pass("fanstore-before", self.a.old_fanstore, self.a.old_store, w)
            if "noplus" in passes and w == h.ints(self.a.workers)[-1]:  # one is enough
                self.fanstore_pass("fanstore-noplus", self.fanstore, self.store, w,
                                   ("--fuse-flags=-DO_READDIRPLUS",))

    def cleanup(self) -> None:
        super().cleanup()
        for proc in self.sq_procs:
            if proc.poll() is None:
                subprocess.run(["fusermount3", "-u", "-z", "--", os.path.join(
                    self.mnt_root, "squashfuse_ll")], capture_output=True)
                proc.kill()


def render(bench: ScaleBench, label: str, argv: list[str]) -> str:
    n = bench.files
    rows = bench.rows
    out = [f"{n:,} files of `tools/gen_tree.py` ({bench.tree['per_dir']:,} per directory); "
           f"reads: {bench.a.reads:,} files, shuffled, 4 readers, after the find."]
    packs = h.pick_rows(rows, kind="pack")
    sq = (h.pick_rows(packs, tool="mksquashfs") or [{}])[0]
    if packs:
        out.append(h.table(
            ["pack", "wall s", "CPU s", "CPU µs/file", "stored MB", "time x mksquashfs",
             "capacity x mksquashfs"],
            [(r["tool"] + (f" (format v{r['format_version']})" if r.get("format_version")
                           else "") + (f", run {r['run_id']}" if r.get("run_id") != bench.run_id
                                       else ""), r["wall_s"], r["cpu_s"], r["cpu_us_per_file"],
              h.num(r["bytes"] / 1e6), h.ratio(r["wall_s"], sq.get("wall_s")),
              h.ratio(sq.get("bytes"), r["bytes"])) for r in packs]))
    mounts = h.pick_rows(rows, kind="mount")
    base = (h.pick_rows(mounts, backend="squashfuse_ll") or [{}])[0]

    def per_file(r, key):
        return h.num(r[key] / n, 1) if r.get(key) else "–"

    out.append(h.table(
        ["backend", "workers", "ready s", "PSS B/file: mounted / after find / after reads",
         "processes"],
        [(r["backend"], r["workers"], r.get("ready_s", "–"),
          f"{per_file(r, 'pss_mount')} / {per_file(r, 'pss_find')} / "
          f"{per_file(r, 'pss_read')}", r.get("processes", 1)) for r in mounts]))
    out.append(h.table(
        ["backend", "workers", "cold find s", "x squashfuse_ll", "find's kernel s",
         "server CPU s (µs/entry)", "found"],
        [(r["backend"], r["workers"], r["find_s"], h.ratio(r["find_s"], base.get("find_s")),
          r["find_sys_s"], (f"{r['find_server_cpu_s']} ({r['find_server_cpu_s'] / n * 1e6:.2f})"
                            if "find_server_cpu_s" in r else "–"), f"{r['found']:,}")
         for r in mounts]))
    out.append(h.table(
        ["backend", "workers", "cold read files/s", "x squashfuse_ll", "server CPU µs/file",
         "p50 / p99 ms", "errors"],
        [(r["backend"], r["workers"], h.num(r["files_per_s"]),
          h.ratio(r["files_per_s"], base.get("files_per_s")),
          h.num(r.get("watched_cpu_us_per_file")), f"{r['lat_ms_p50']} / {r['lat_ms_p99']}",
          r.get("errors") or 0) for r in mounts]))
    return h.section(bench, label, argv, out)


def main(argv: list[str] | None = None) -> int:
    raw = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    h.args(p, "scale_bench", "/work/scale")
    p.add_argument("--data", help="a tree made by tools/gen_tree.py")
    p.add_argument("--passes", default="pack,mksquashfs,sqfs,mount")
    p.add_argument("--workers", default="1,3", help="FanStore worker counts to mount with")
    p.add_argument("--reads", type=int, default=100_000)
    p.add_argument("--old-fanstore", help="another build's fanstore command (pass old)")
    p.add_argument("--old-store", help="a store that build reads (pass old)")
    p.add_argument("--pack-rows", help="JSONL of an earlier run whose pack rows this run's "
                   "tables show (they keep their run id)")
    p.add_argument("--section", default="", help="docs section (default scale_bench-N)")
    a = p.parse_args(raw)
    if not a.data:
        p.error("--data is required")
    a.data = os.path.abspath(a.data)
    bench = ScaleBench(a)
    section = a.section or f"scale_bench-{bench.files // 1000}k"
    bench.name = section  # the docs section and its raw rows, one file per section
    if "--results" not in " ".join(raw):
        a.results = os.path.join(h.RESULTS_DIR, f"{section}.jsonl")
    return h.main(bench, render, raw, section_name=section)


if __name__ == "__main__":
    sys.exit(main())
