#!/usr/bin/env python3
"""What a launcher killed mid-start leaves behind: ``mpiexec`` SIGKILLed N s into a start.

``mpiexec -n 32 fanstore mount STORE MNT --local-dir LOCAL`` (default options: the 32 ranks
of this host form one node, a daemon and 31 worker ranks) is SIGKILLed N seconds after it
was started, for N in ``--seconds`` (1..20), ``--reps`` times each. Measured: the seconds
from the kill until no process of the job (found by a tag in its environment, so the
kernel frontend, whose command line names no path, is found too), FUSE mount, runtime
directory, index copy or staged data is left (each run has its own ``FANSTORE_RUNTIME_DIR``
and ``FANSTORE_SHM_DIR``), and the phase the kill met (from what the start had made). Issue 42's
target: nothing left within 60 s in every run. A run that leaves something is recorded
with what was left (each process's command line, state and kernel wait channel), then
cleaned by force so the next run starts clean.

    .venv/bin/python tools/bench/launcher_kill_bench.py --parallel 2          # ~45 min
    .venv/bin/python tools/bench/launcher_kill_bench.py --reps 1 --no-docs    # a smoke run

Not CPU-timing sensitive (it may run beside other work: a busy machine stretches the start,
which moves the kills across its phases); never beside a timing benchmark.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness as h  # noqa: E402

TAG_ENV = "FANSTORE_BENCH_TAG"
LIMIT = 60.0  # the target: nothing left within this many seconds of the kill


class LauncherKillBench(h.Bench):
    name = "launcher_kill_bench"

    def run(self) -> None:
        import threading

        a = self.a
        self.make_store()
        self.lock = threading.Lock()
        streams = [threading.Thread(target=self.stream, args=(range(k, a.reps, a.parallel),))
                   for k in range(a.parallel)]
        for t in streams:
            t.start()
        for t in streams:
            t.join()

    def stream(self, reps) -> None:
        """The runs of ``reps`` one after the other (``--parallel`` streams run at once:
        a busy machine, where the leak was first seen)."""
        for rep in reps:
            for n in self.a.seconds:
                self.one(n, rep)

    def emit(self, row: dict) -> dict:
        with self.lock:
            return super().emit(row)

    def make_store(self) -> None:
        self.small_store(files=512, seed=42)

    def one(self, n: float, rep: int) -> None:
        a = self.a
        tag = f"k{n:g}-{rep}"
        job_dir = os.path.join(self.work, "jobs", tag)
        shutil.rmtree(job_dir, ignore_errors=True)
        rundir, shm = os.path.join(job_dir, "run"), os.path.join(job_dir, "shm")
        mnt, local = os.path.join(job_dir, "mnt"), os.path.join(job_dir, "local")
        for d in (rundir, shm, mnt):
            os.makedirs(d, mode=0o700, exist_ok=True)
        env = dict(os.environ, FANSTORE_RUNTIME_DIR=rundir, FANSTORE_SHM_DIR=shm,
                   PYTHONUNBUFFERED="1", **{TAG_ENV: f"{os.getpid()}-{tag}"})
        argv = [self.mpiexec, "-n", str(a.ranks), self.fanstore, "mount", self.store, mnt,
                "--local-dir", local] + a.extra
        if rep == 0 and n == a.seconds[0]:
            self.cmd([x.replace(job_dir, "JOB") for x in argv]
                     + ["# then SIGKILL of mpiexec N s later"])
        log_path = os.path.join(job_dir, "mpiexec.log")
        with open(log_path, "wb") as logf:
            proc = subprocess.Popen(argv, stdout=logf, stderr=subprocess.STDOUT, env=env,
                                    start_new_session=True)
        time.sleep(n)
        before = len(tagged(env[TAG_ENV]))
        met = phase(before, a.ranks, mnt, local, rundir)
        os.kill(proc.pid, signal.SIGKILL)
        t0 = time.monotonic()
        proc.wait()
        left = leftovers(env[TAG_ENV], mnt, local, rundir, shm)
        while any(left.values()) and time.monotonic() - t0 < LIMIT:
            time.sleep(0.2)
            left = leftovers(env[TAG_ENV], mnt, local, rundir, shm)
        took = time.monotonic() - t0
        with open(log_path, encoding="utf-8", errors="replace") as f:
            out = f.read()
        row = {"n": n, "rep": rep, "processes_at_kill": before, "phase": met,
               "gone_s": None if any(left.values()) else round(took, 2),
               "left": {k: len(v) for k, v in left.items() if v}}
        if any(left.values()):
            row["detail"] = describe(left["processes"])
            row["log_tail"] = out[-3000:]
            force_clean(left["processes"], mnt)
        h.log(f"{tag}: {row['phase']}, {before} processes at the kill: "
              + ("nothing left after %.1f s" % took if row["gone_s"] is not None
                 else f"LEFT {row['left']}"))
        self.emit(row)
        if row["gone_s"] is not None:
            shutil.rmtree(job_dir, ignore_errors=True)


def tagged(tag: str) -> list[int]:
    """Live processes whose environment carries ``tag``."""
    needle = f"{TAG_ENV}={tag}\0".encode()
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                if needle in f.read() and h.pid_alive(int(name)):
                    found.append(int(name))
        except OSError:
            continue
    return found


def leftovers(tag: str, mnt: str, local: str, rundir: str, shm: str) -> dict[str, list]:
    staged = []
    if os.path.isdir(local):
        staged = [os.path.join(d, f) for d, _, fs in os.walk(local) for f in fs]
    return {"processes": tagged(tag), "mounts": [mnt] if h.is_mounted(mnt) else [],
            "runtime_dirs": os.listdir(rundir), "copies": os.listdir(shm),
            "staged": staged}


def phase(processes: int, ranks: int, mnt: str, local: str, rundir: str) -> str:
    """How far the start had got when the launcher was killed, from what it had made: a
    mount, staged copies, runtime directories, every rank's daemon forked by its shim."""
    if h.is_mounted(mnt):
        return "serving"
    if os.path.isdir(local) and any(n.endswith(".fsp") for n in os.listdir(local)):
        return "staging"
    if os.path.isdir(rundir) and os.listdir(rundir):
        return "laid out"
    if processes >= 2 * ranks:
        return "MPI_Init"
    return "starting interpreters"


def describe(pids: list[int]) -> list[str]:
    rows = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")[:160]
            with open(f"/proc/{pid}/stat") as f:
                rest = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{pid}/wchan") as f:
                wchan = f.read()
            rows.append(f"{pid} ppid {rest[1]} state {rest[0]} wchan {wchan}: {cmd}")
        except OSError:
            continue
    return rows


def force_clean(pids: list[int], mnt: str) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    if h.is_mounted(mnt):
        subprocess.run(["fusermount3", "-u", "-z", mnt], capture_output=True)


def render(bench: LauncherKillBench, label: str | None, argv: list[str]) -> str:
    rows = h.load_rows(bench.jsonl_tmp)
    cells = []
    for n in sorted({r["n"] for r in rows}):
        rs = h.pick_rows(rows, n=n)
        bad = [r for r in rs if r["gone_s"] is None]
        phases = sorted({r["phase"] for r in rs})
        cells.append([f"{n:g}", len(rs), ", ".join(phases),
                      h.spread([r["processes_at_kill"] for r in rs]),
                      h.spread([r["gone_s"] for r in rs if r["gone_s"] is not None], 1),
                      f"**{len(bad)}**: {bad[0]['left']}" if bad else "0"])
    return h.section(bench, label, argv, [h.table(
        ["kill after (s)", "runs", "phase met", "processes at the kill",
         "nothing left after (s)", f"runs with something left after {LIMIT:g} s"], cells)])


def main(argv: list[str] | None = None) -> int:
    raw_argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=h.ints, default=list(range(1, 21)),
                    help="seconds after the start to kill mpiexec (1..20)")
    ap.add_argument("--reps", type=int, default=20, help="runs of each (20)")
    ap.add_argument("--ranks", type=int, default=32, help="ranks of the job (32)")
    ap.add_argument("--extra", type=h.words, default=[], help="more mount options")
    ap.add_argument("--parallel", type=int, default=1,
                    help="jobs started at once (each stream takes every K-th repeat)")
    h.args(ap, "launcher_kill_bench", "/tmp/fanstore-killbench")
    a = ap.parse_args(raw_argv)
    return h.main(LauncherKillBench(a), render, raw_argv)


if __name__ == "__main__":
    sys.exit(main())
