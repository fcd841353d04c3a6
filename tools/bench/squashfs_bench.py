#!/usr/bin/env python3
"""Capacity, pack time and cold reads against squashfs: what a user compares a store with.

For each data set (``--set NAME=DIR``, repeatable), in one run:

* **capacity and pack time**: ``fanstore pack`` (the default on all cores, and with
  ``--jobs N`` for each N of ``--jobs-list``, to show how it scales; ``--best SET,..`` also
  the full selector's most compact choice under a lax budget, ``--codec auto
  --files-per-sec 1``), ``mksquashfs -comp zstd`` at its default level (15, the anchor), at
  ``-Xcompression-level 3`` (``--no-z3`` leaves it out), and ``-comp xz`` (``--no-xz``),
  each from a cold page cache; bytes on disk (index included), wall seconds, CPU seconds
  (the packer and its children) and per file, the peak RSS of the packer's whole process
  tree (sampled every 0.1 s: the sum over its processes, what the machine must hold), and
  for FanStore the phases its summary reports;
* **cold shuffled reads** (``--reads SET,...``): the default store mounted by ``fanstore mount``
  and the default-level image by ``squashfuse_ll``, every file (or ``--read-files`` of
  them) read once in a seeded shuffle by ``--readers`` processes after dropping the page
  cache, ``--passes`` passes each, alternating; files/s and the machine's busy CPU per file.

    python tools/bench/squashfs_bench.py --set small60k=/data/small60k --set real=/data/real \\
        --reads real --best real --jobs-list 1 --jobs-on small60k

Rows go to ``tools/bench/results/squashfs_bench.jsonl``; the section ``squashfs`` of
docs/benchmarks.md holds the tables. Run it alone on the machine (it times packs).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import shutil
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import harness as h  # noqa: E402

FSREAD = os.path.join(os.path.dirname(h.REPO), "shared", "bench", "fsread.py")


def _run_sampled(argv: list[str]) -> tuple[subprocess.CompletedProcess, int]:
    """Run ``argv``; its result and the peak, over 0.1 s samples, of the summed RSS of its
    process tree (a pack's workers included)."""
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peak = 0
    out: list[str] = []
    reader = threading.Thread(target=lambda: out.extend(proc.communicate()), daemon=True)
    reader.start()
    while reader.is_alive():
        tree = h.descendants(proc.pid)
        rss = 0
        for pid in tree:
            try:
                with open(f"/proc/{pid}/statm") as f:
                    rss += int(f.read().split()[1]) * PAGE
            except (OSError, IndexError, ValueError):
                pass
        peak = max(peak, rss)
        reader.join(0.1)
    return subprocess.CompletedProcess(argv, proc.returncode, *out), peak


PAGE = os.sysconf("SC_PAGE_SIZE")


class SquashfsBench(h.Bench):
    name = "squashfs"

    def __init__(self, a) -> None:
        super().__init__(a)
        self.files: dict[str, int] = {}

    def tools(self, name: str, src: str, out: str) -> list[tuple[str, list[str], str]]:
        """(label, argv, output path) of each packer to time on ``src``."""
        fs = self.fanstore
        rows = [("fanstore default", [fs, "pack", src, out + ".fs", "--no-progress"],
                 out + ".fs")]
        jobs_sets = self.a.jobs_on.split(",") if self.a.jobs_on else None
        for jobs in (int(j) for j in self.a.jobs_list.split(",") if j):
            if jobs_sets is not None and name not in jobs_sets:
                continue
            rows.append((f"fanstore default --jobs {jobs}",
                         [fs, "pack", src, out + f".j{jobs}", "--no-progress", "--jobs",
                          str(jobs)], out + f".j{jobs}"))
        if name in self.a.reads.split(","):  # the layout before solid blocks, read beside
            rows.append(("fanstore --solid-kb 0", [fs, "pack", src, out + ".single",
                                                   "--no-progress", "--solid-kb", "0"],
                         out + ".single"))
        if name in self.a.best.split(","):
            rows.append(("fanstore best", [fs, "pack", src, out + ".best", "--no-progress",
                                           "--codec", "auto", "--files-per-sec", "1"],
                         out + ".best"))
        sq = ["mksquashfs", src]
        rows.append(("mksquashfs zstd (default 15)",
                     sq + [out + ".sqfs", "-comp", "zstd", "-quiet", "-no-progress"],
                     out + ".sqfs"))
        if not self.a.no_z3:
            rows.append(("mksquashfs zstd -Xcompression-level 3",
                         sq + [out + ".z3.sqfs", "-comp", "zstd", "-Xcompression-level", "3",
                               "-quiet", "-no-progress"], out + ".z3.sqfs"))
        if not self.a.no_xz:
            rows.append(("mksquashfs xz", sq + [out + ".xz.sqfs", "-comp", "xz", "-quiet",
                                                "-no-progress"], out + ".xz.sqfs"))
        return rows

    def pack(self, name: str, src: str, raw: int, label: str, argv: list[str],
             out: str) -> None:
        for path in (out,):
            if os.path.isdir(path):
                shutil.rmtree(path)
            elif os.path.exists(path):
                os.unlink(path)
        h.drop_caches()
        self.cmd(argv, SRC=src)
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.monotonic()
        p, peak = _run_sampled(argv)
        wall = time.monotonic() - t0
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
        if p.returncode != 0:
            raise RuntimeError(f"{label} failed: {p.stderr.strip()[-400:]}")
        size = h.dir_bytes(out) if os.path.isdir(out) else os.path.getsize(out)
        chosen = ""
        phases = ""
        if label.startswith("fanstore"):
            info = json.loads(subprocess.run([self.fanstore, "info", out, "--json"],
                                             capture_output=True, text=True).stdout)
            chosen = (info.get("selection") or {}).get("chosen", "")
            phases = next((line.partition("(")[2].rstrip(")") for line in p.stdout.splitlines()
                           if line.startswith("time ")), "")
        h.log(f"  {name} {label}: {size / 1e6:,.1f} MB ({raw / size:.2f}x) in {wall:.1f} s, "
              f"{cpu:.1f} CPU s, peak RSS {peak / 1e6:,.0f} MB {chosen} {phases}")
        self.emit({"kind": "pack", "set": name, "tool": label, "bytes": size, "raw": raw,
                   "ratio": raw / size, "seconds": wall, "cpu_s": cpu, "chosen": chosen,
                   "files": self.files[name], "peak_rss": peak, "phases": phases,
                   "load1": h.loadavg1()})

    def mount_squashfs(self, img: str, mnt: str) -> subprocess.Popen:
        os.makedirs(mnt, exist_ok=True)
        self.cmd(["squashfuse_ll", "-f", img, mnt])
        proc = subprocess.Popen(["squashfuse_ll", "-f", img, mnt],
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 30
        while not h.is_mounted(mnt):
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError("squashfuse_ll did not mount")
            time.sleep(0.05)
        self.mounted[mnt] = proc.pid
        return proc

    def read_pass(self, name: str, backend: str, mnt: str, files: str, seed: int) -> None:
        argv = [self.py, FSREAD, "read", "--root", mnt, "--list", files, "--workers",
                str(self.a.readers), "--seed", str(seed), "--drop-caches"]
        self.cmd(argv)
        row = self.sub(argv)
        busy = row.get("cpu_busy_pct")  # the whole machine while the files were read
        cpu_us = (busy / 100 * row["seconds"] * os.cpu_count() * 1e6 / max(1, row["files"])
                  if busy is not None else None)
        h.log(f"  {name} {backend} seed {seed}: {row['files_per_s']:,.0f} files/s "
              f"({row.get('errors', 0)} errors), busy CPU {cpu_us or 0:,.0f} us/file")
        self.emit({"kind": "read", "set": name, "backend": backend, "seed": seed,
                   "files": row["files"], "files_per_s": row["files_per_s"],
                   "mb_per_s": row["MB_per_s"], "errors": row.get("errors", 0),
                   "cpu_us_per_file": cpu_us, "readers": self.a.readers})

    def reads(self, name: str, src: str, out: str) -> None:
        rels = sorted(os.path.relpath(os.path.join(d, f), src)
                      for d, _, fs in os.walk(src) for f in fs
                      if os.path.isfile(os.path.join(d, f))
                      and not os.path.islink(os.path.join(d, f)))
        if self.a.read_files and len(rels) > self.a.read_files:
            rels = sorted(random.Random(0).sample(rels, self.a.read_files))
        files = self.write_list(f"{name}.txt", rels)
        fs_mnt, sq_mnt = (os.path.join(self.mnt_root, f"{name}-{b}") for b in ("fs", "sq"))
        for k in range(self.a.passes):
            for backend, store in (("fanstore", ".fs"), ("fanstore --solid-kb 0", ".single")):
                self.mount(out + store, fs_mnt)
                self.read_pass(name, backend, fs_mnt, files, k + 1)
                self.umount(fs_mnt)
            proc = self.mount_squashfs(out + ".sqfs", sq_mnt)
            self.read_pass(name, "squashfuse_ll", sq_mnt, files, k + 1)
            subprocess.run(["fusermount3", "-u", "--", sq_mnt], capture_output=True)
            proc.wait(timeout=30)
            self.mounted.pop(sq_mnt, None)

    def run(self) -> None:
        for spec in self.a.set:
            name, _, src = spec.partition("=")
            src = os.path.abspath(src)
            sizes = [os.lstat(os.path.join(d, f)).st_size for d, _, fs in os.walk(src)
                     for f in fs if os.path.isfile(os.path.join(d, f))
                     and not os.path.islink(os.path.join(d, f))]
            raw = sum(sizes)
            self.files[name] = len(sizes)
            out = os.path.join(self.work, name)
            h.log(f"{name}: {src} ({raw / 1e6:,.1f} MB in regular files)")
            for label, argv, path in self.tools(name, src, out):
                self.pack(name, src, raw, label, argv, path)
            if name in self.a.reads.split(","):
                self.reads(name, src, out)


def render(bench: SquashfsBench, label: str | None, argv: list[str]) -> str:
    parts = []
    sets = list(dict.fromkeys(r["set"] for r in bench.rows))
    rows = []
    for s in sets:
        anchor = bench.pick(kind="pack", set=s, tool="mksquashfs zstd (default 15)")
        a = anchor[0] if anchor else None
        for r in bench.pick(kind="pack", set=s):
            rows.append([s, r["tool"] + (f" ({r['chosen']})" if r["chosen"] else ""),
                         f"{r['bytes'] / 1e6:,.1f}", f"{r['ratio']:.2f}x",
                         h.ratio(a["bytes"], r["bytes"]) if a else "", f"{r['seconds']:.1f}",
                         h.ratio(r["seconds"], a["seconds"]) if a else "",
                         f"{r['cpu_s']:.1f}",
                         f"{r['cpu_s'] / max(1, r.get('files', 0)) * 1e6:,.0f}"
                         if r.get("files") else "",
                         f"{r['peak_rss'] / 1e6:,.0f}" if r.get("peak_rss") else ""])
    parts.append(h.table(["set", "packer", "MB on disk", "ratio", "capacity vs mksquashfs "
                          "default", "pack s", "time vs mksquashfs default", "CPU s",
                          "CPU µs/file", "peak RSS MB (all processes)"], rows,
                         title="**Capacity and pack time** (cold page cache, all cores; "
                               "capacity = mksquashfs default's bytes / these bytes)"))
    rows = []
    for s in sets:
        f = bench.vals("files_per_s", kind="read", set=s, backend="fanstore")
        b = bench.vals("files_per_s", kind="read", set=s, backend="fanstore --solid-kb 0")
        q = bench.vals("files_per_s", kind="read", set=s, backend="squashfuse_ll")
        if not f:
            continue
        us = [h.num(h.med(bench.vals("cpu_us_per_file", kind="read", set=s, backend=x)))
              for x in ("fanstore", "fanstore --solid-kb 0", "squashfuse_ll")]
        rows.append([s, h.spread(f), us[0], h.spread(b), us[1], h.spread(q), us[2],
                     h.ratio(h.med(f), h.med(b)), h.ratio(h.med(f), h.med(q))])
    if rows:
        parts.append(h.table(["set", "FanStore default files/s", "busy µs/file",
                              "--solid-kb 0 files/s", "busy µs/file", "squashfuse_ll files/s",
                              "busy µs/file", "default / --solid-kb 0", "default / sqfs"],
                             rows, title=f"**Cold shuffled reads** ({bench.a.readers} readers, "
                                         "page cache dropped before each pass; median "
                                         "(min-max) over the passes)"))
    rows = [[r["set"], r["tool"], r["phases"]] for r in bench.pick(kind="pack")
            if r.get("phases")]
    if rows:
        parts.append(h.table(["set", "packer", "phases (the pack's summary)"], rows,
                             title="**Where a FanStore pack's time goes** (wall seconds per "
                                   "phase; the selection runs while the workers search for "
                                   "duplicates)"))
    return h.section(bench, label, argv, parts)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    h.args(ap, "squashfs_bench", "/tmp/squashfs-bench")
    ap.add_argument("--set", action="append", required=True, metavar="NAME=DIR")
    ap.add_argument("--best", default="", metavar="SET,...",
                    help="on these sets also --codec auto (minutes each)")
    ap.add_argument("--no-xz", action="store_true", help="leave mksquashfs xz out")
    ap.add_argument("--no-z3", action="store_true", help="leave mksquashfs zstd level 3 out")
    ap.add_argument("--jobs-list", default="", metavar="N,...",
                    help="also the default pack with --jobs N, for each N")
    ap.add_argument("--jobs-on", default="", metavar="SET,...",
                    help="--jobs-list on these sets only (default: every set)")
    ap.add_argument("--reads", default="", metavar="SET,...",
                    help="on these sets cold shuffled reads too")
    ap.add_argument("--readers", type=int, default=2)
    ap.add_argument("--passes", type=int, default=2)
    ap.add_argument("--read-files", type=int, default=30000,
                    help="files read per pass (a seeded sample; 0: all)")
    raw = sys.argv[1:] if argv is None else argv
    a = ap.parse_args(raw)
    return h.main(SquashfsBench(a), render, raw)


if __name__ == "__main__":
    sys.exit(main())
