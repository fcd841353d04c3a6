#!/usr/bin/env python3
"""Python-API reads of a live N-rank mount, for two FanStore builds in one run.

For each build (``--build NAME=VENV_BIN``), in interleaved repetitions: an ``mpiexec -n
RANKS fanstore mount`` of that build, then ``--readers`` processes reading, with
``fanstore.open_store(MNT0).read(path)``, every file rank 0 holds, cold and warm. Reports
files/s and CPU per file of the readers and of rank 0's daemon (docs/benchmarks.md).

    .venv/bin/python tools/bench/api_bench.py --store S --build old=/work/wt-old/.venv/bin \\
        --build new=.venv/bin
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

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness as h  # noqa: E402
from harness import log  # noqa: E402

READER = r"""
import json, os, sys, time, resource
import fanstore
mnt, listing, k, n = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
paths = [p for p in open(listing).read().split("\n") if p][k::n]
s = fanstore.open_store(mnt)
r0 = resource.getrusage(resource.RUSAGE_SELF)
print("ready", flush=True)
sys.stdin.readline()
t0 = time.perf_counter()
nbytes = 0
for p in paths:
    nbytes += len(s.read(p))
t1 = time.perf_counter()
r1 = resource.getrusage(resource.RUSAGE_SELF)
print(json.dumps({"files": len(paths), "bytes": nbytes, "start": t0, "end": t1,
                  "cpu": r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime}), flush=True)
"""


class ApiBench(h.Bench):
    name = "api_bench"

    def __init__(self, a) -> None:
        a.fanstore = "fanstore"  # each build's own, from --build
        super().__init__(a)
        self.builds = {n: os.path.abspath(d) for n, d in (b.split("=", 1) for b in a.build)}
        self.job: subprocess.Popen | None = None

    def mnt(self, r: int) -> str:
        return os.path.join(self.work, f"mnt{r}")

    def start_job(self, bin_dir: str) -> None:
        for r in range(self.a.ranks):
            os.makedirs(self.mnt(r), exist_ok=True)
        argv = [os.path.join(bin_dir, "mpiexec"), "-n", str(self.a.ranks),
                os.path.join(bin_dir, "fanstore"), "mount", self.a.store,
                os.path.join(self.work, "mnt{rank}"), "--local-dir",
                os.path.join(self.work, "local{rank}")]
        self.job_log = open(os.path.join(self.work, "job.log"), "ab")
        self.job = subprocess.Popen(argv, stdout=self.job_log, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        for r in range(self.a.ranks):
            subprocess.run([os.path.join(bin_dir, "fanstore"), "wait", self.mnt(r),
                            "--timeout", "120"], check=True)

    def stop_job(self, bin_dir: str) -> None:
        if self.job is None:
            return
        try:
            os.killpg(self.job.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            self.job.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(self.job.pid, signal.SIGKILL)
            self.job.wait()
        self.job = None
        for r in range(self.a.ranks):
            subprocess.run(["fusermount3", "-u", "-z", "--", self.mnt(r)], capture_output=True)

    def local_files(self) -> list[str]:
        from fanstore.format.index import KIND_FILE, read_index

        index = read_index(self.a.store)
        nparts = len(index.partitions)
        mine = {p for p in range(nparts) if p % self.a.ranks == 0}
        out = []
        for e in index.file_entries().tolist():
            first, count = int(index.entries["first"][e]), int(index.entries["count"][e])
            if count and int(index.chunks["part"][first]) in mine and \
                    int(index.entries["kind"][e]) == KIND_FILE:
                out.append(os.fsdecode(index.path(e)))
        return out

    def one_pass(self, build: str, phase: str, listing: str) -> dict:
        bin_dir = self.builds[build]
        py = os.path.join(bin_dir, "python")
        procs = [subprocess.Popen([py, "-c", READER, self.mnt(0), listing, str(k),
                                   str(self.a.readers)], stdin=subprocess.PIPE, cwd=self.work,
                                  stdout=subprocess.PIPE, text=True)
                 for k in range(self.a.readers)]
        for p in procs:
            assert p.stdout.readline().strip() == "ready"
        pid = h.state_pid(self.mnt(0))
        d0 = h.cpu_seconds(h.descendants(pid))
        for p in procs:
            p.stdin.write("go\n")
            p.stdin.flush()
        res = [json.loads(p.stdout.readline()) for p in procs]
        for p in procs:
            p.wait(60)
        d1 = h.cpu_seconds(h.descendants(pid))
        files = sum(r["files"] for r in res)
        wall = max(r["end"] for r in res) - min(r["start"] for r in res)
        row = {"build": build, "phase": phase, "files": files,
               "files_per_s": round(files / wall, 1),
               "reader_cpu_us_per_file": round(sum(r["cpu"] for r in res) / files * 1e6, 1),
               "daemon_cpu_us_per_file": round((d1 - d0) / files * 1e6, 1)}
        return self.emit(row)

    def run(self) -> None:
        files = self.local_files()
        random.Random(3).shuffle(files)
        listing = os.path.join(self.work, "local-files.txt")
        with open(listing, "w") as f:
            f.write("\n".join(files) + "\n")
        log(f"{len(files)} files held by rank 0 of {self.a.ranks}")
        names = list(self.builds)
        for rep in range(self.a.reps):
            for build in names[rep % 2:] + names[:rep % 2]:
                self.start_job(self.builds[build])
                try:
                    h.drop_caches()
                    for phase in ("cold", "warm"):
                        row = self.one_pass(build, phase, listing)
                        log(f"  {build} {phase}: {row['files_per_s']:,.0f} files/s, readers "
                            f"{row['reader_cpu_us_per_file']} us/file, daemon "
                            f"{row['daemon_cpu_us_per_file']} us/file")
                finally:
                    self.stop_job(self.builds[build])

    def cleanup(self) -> None:
        if self.job is not None:
            self.stop_job(next(iter(self.builds.values())))
        for r in range(self.a.ranks):
            shutil.rmtree(os.path.join(self.work, f"local{r}"), ignore_errors=True)


def render(bench: ApiBench, label: str, shown: list[str]) -> str:
    names = list(bench.builds)
    runs = [(build, phase, *bench.cells(
                dict(build=build, phase=phase), "spread:files_per_s",
                "med:reader_cpu_us_per_file", "med:daemon_cpu_us_per_file"))
            for phase in ("cold", "warm") for build in names
            if bench.vals("files_per_s", build=build, phase=phase)]
    out = [f"### Python API on a live {bench.a.ranks}-rank mount: rank 0's local files, "
           f"{bench.a.readers} reader processes", "", label or "",
           f"`{' '.join(shown)}` (commit {h.git_commit()}, {h.now_utc()})", "",
           h.table(["build", "phase", "files/s (median, min-max)", "reader CPU us/file",
                    "daemon CPU us/file"], runs, "l" * 5)]
    if len(names) == 2:
        out += [f"\n{phase}: {names[1]} / {names[0]} = " + h.ratio(
            *(h.med(bench.vals("files_per_s", build=n, phase=phase)) for n in names[::-1]))
            for phase in ("cold", "warm")]
    return "\n".join(out)


def main() -> int:
    raw_argv = sys.argv[1:]
    p = argparse.ArgumentParser()
    p.add_argument("--store", required=True)
    p.add_argument("--build", action="append", required=True, metavar="NAME=VENV_BIN")
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--readers", type=int, default=4)
    p.add_argument("--reps", type=int, default=2)
    h.args(p, "api_bench", "/tmp/api-bench", fanstore=False)
    a = p.parse_args(raw_argv)
    return h.main(ApiBench(a), render, raw_argv)


if __name__ == "__main__":
    sys.exit(main())
