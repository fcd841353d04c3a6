#!/usr/bin/env python3
"""How long a job takes to leave nothing behind after one of its processes is SIGKILLed.

An ``mpiexec`` job of N nodes (``--ranks-per-node 1``; 2 for the worker-rank fault) mounts a
small store; once every node serves, one process of node 1 is SIGKILLed: its daemon (and,
as a variant, a SIGTERM to ``mpiexec`` 5 s later), its hydra shim, its kernel frontend, or
one of its worker ranks. Measured: the seconds from the kill until ``mpiexec`` has exited
and no process of the job, FUSE mount, runtime directory or index copy is left (each job
has its own ``FANSTORE_RUNTIME_DIR`` and ``FANSTORE_SHM_DIR``, so anything in them is the
job's), and whether the log names node 1. Issue 44's target: 30 s. What happens and why:
docs/reliability.md, "A process of a serving job killed".

    .venv/bin/python tools/bench/death_bench.py --nodes 4,16            # ~5 min
    .venv/bin/python tools/bench/death_bench.py --nodes 4 --no-docs     # a smoke run

Not CPU-timing sensitive: the times are dominated by the 5 s ping that finds a dead node.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness as h  # noqa: E402

VICTIM = 1
#: fault -> (what is killed, SIGTERM to mpiexec 5 s later, ranks per node)
FAULTS = {
    "daemon": ("daemon", False, 1),
    "daemon+sigterm": ("daemon", True, 1),
    "shim": ("shim", False, 1),
    "frontend": ("frontend", False, 1),
    "worker-rank": ("worker rank", False, 2),
}
LIMIT = 120.0  # seconds after the kill the bench gives up waiting (the target is 30)


class DeathBench(h.Bench):
    name = "death_bench"

    def run(self) -> None:
        a = self.a
        self.make_store()
        for nodes in a.nodes:
            for fault in a.faults:
                for rep in range(a.reps):
                    self.one(nodes, fault, rep)

    def make_store(self) -> None:
        self.small_store(files=256, seed=44)

    def one(self, nodes: int, fault: str, rep: int) -> None:
        what, sigterm, per_node = FAULTS[fault]
        tag = f"n{nodes}-{fault}-{rep}"
        state = os.path.join(self.work, "state", tag)
        rundir, shm = os.path.join(state, "run"), os.path.join(state, "shm")
        for d in (rundir, shm):
            os.makedirs(d, mode=0o700, exist_ok=True)
        # here, not only in the job's environment: `fanstore wait` looks there too
        os.environ.update(FANSTORE_RUNTIME_DIR=rundir, FANSTORE_SHM_DIR=shm)
        job = h.Job(self, nodes, tag, extra=["--workers", "1"], per_node=per_node)
        if rep == 0:
            self.cmd(job.shown() + f"   # then SIGKILL of node {VICTIM}'s {what}"
                     + (", SIGTERM to mpiexec 5 s later" if sigterm else ""))
        h.log(f"{tag}: starting {nodes} nodes")
        job.start(timeout=180)
        pid = victim(job, what, rundir)
        os.kill(pid, signal.SIGKILL)
        t0 = time.monotonic()
        if sigterm:
            time.sleep(5.0)
            os.kill(job.proc.pid, signal.SIGTERM)
        left = leftovers(job, rundir, shm)
        while any(left.values()) and time.monotonic() - t0 < LIMIT:
            time.sleep(0.1)
            left = leftovers(job, rundir, shm)
        took = time.monotonic() - t0
        try:  # (the last check may have seen mpiexec exit after its poll)
            job.proc.wait(5)
        except subprocess.TimeoutExpired:
            pass
        out = job.output()
        row = {"nodes": nodes, "fault": fault, "rep": rep, "ready_s": job.ready_seconds,
               "gone_s": None if any(left.values()) else took,
               "left": {k: len(v) for k, v in left.items() if v},
               "named": named(out, what, nodes),
               "mpiexec_status": job.proc.returncode}
        h.log(f"{tag}: {'nothing left after %.1f s' % took if row['gone_s'] else left}")
        self.emit(row)
        job.stop()


def named(out: str, what: str, nodes: int) -> bool:
    """Whether the job's log names node 1 as the one whose process died (every line of
    node 1 carries "fanstore[node 1/N]": that alone says nothing)."""
    mine = f"fanstore[node {VICTIM}/{nodes}] ERROR: "
    if what == "daemon":
        return f"node {VICTIM} died" in out or f"{mine}kernel frontend: the node's daemon" in out
    if what == "shim":
        return f"the MPI launcher ended rank {VICTIM}'s process" in out
    if what == "frontend":
        return f"{mine}rank {VICTIM} (" in out and "the kernel frontend failed" in out
    return f"of node {VICTIM} died" in out


def victim(job: h.Job, what: str, rundir: str) -> int:
    """The pid of node 1's process to kill (from its state, then /proc)."""
    import json

    for name in os.listdir(rundir):
        try:
            with open(os.path.join(rundir, name, "state.json")) as f:
                state = json.load(f)
        except OSError:
            continue
        if state.get("rank") != VICTIM:
            continue
        daemon = state["pid"]
        if what == "daemon":
            return daemon
        if what == "worker rank":
            return state["worker_pids"][0]
        if what == "shim":
            with open(f"/proc/{daemon}/stat") as f:
                return int(f.read().rsplit(")", 1)[1].split()[1])
        with open(f"/proc/{daemon}/task/{daemon}/children") as f:
            for child in f.read().split():
                with open(f"/proc/{child}/cmdline", "rb") as c:
                    if b"fanstore.fuse.kernelfs.process" in c.read():
                        return int(child)
    raise RuntimeError(f"node {VICTIM}'s {what} not found in {rundir}")


def leftovers(job: h.Job, rundir: str, shm: str) -> dict[str, list]:
    """What of the job is still there (its own runtime and index-copy directories)."""
    job.proc.poll()  # reap mpiexec (ours): a zombie is gone, and its status is wanted
    needle = os.fsencode(job.dir)
    procs = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/cmdline", "rb") as f:
                if needle in f.read() and h.pid_alive(int(name)):
                    procs.append(int(name))
        except OSError:
            continue
    return {"processes": procs,
            "mounts": [m for m in range(job.ranks) if h.is_mounted(job.mnt(m))],
            "runtime_dirs": os.listdir(rundir), "copies": os.listdir(shm)}


def render(bench: DeathBench, label: str | None, argv: list[str]) -> str:
    rows = h.load_rows(bench.jsonl_tmp)
    body = []
    for nodes in sorted({r["nodes"] for r in rows}):
        cells = []
        for fault in FAULTS:
            rs = h.pick_rows(rows, nodes=nodes, fault=fault)
            if not rs:
                continue
            gone = [r["gone_s"] for r in rs]
            cells.append([fault, len(rs),
                          h.spread(gone, 1) if None not in gone else
                          f"**not within {LIMIT:g} s** ({rs[0]['left']})",
                          "yes" if all(r["named"] for r in rs) else "**no**",
                          ", ".join(sorted({str(r["mpiexec_status"]) for r in rs})),
                          h.spread([r["ready_s"] for r in rs], 1)])
        body.append(h.table(["SIGKILL of node 1's", "runs", "nothing left after (s)",
                             "log names node 1", "mpiexec status", "job ready after (s)"],
                            cells, title=f"{nodes} nodes"))
    return h.section(bench, label, argv, body)


def main(argv: list[str] | None = None) -> int:
    raw_argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=h.ints, default=[4, 16], help="node counts (4,16)")
    ap.add_argument("--faults", type=h.words, default=list(FAULTS),
                    help=f"which processes to kill ({','.join(FAULTS)})")
    ap.add_argument("--reps", type=int, default=1, help="runs of each")
    h.args(ap, "death_bench", "/tmp/fanstore-deathbench")
    a = ap.parse_args(raw_argv)
    bad = [f for f in a.faults if f not in FAULTS]
    if bad:
        ap.error(f"unknown fault(s) {bad}; choose from {','.join(FAULTS)}")
    return h.main(DeathBench(a), render, raw_argv)


if __name__ == "__main__":
    sys.exit(main())
