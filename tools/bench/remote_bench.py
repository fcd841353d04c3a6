#!/usr/bin/env python3
"""Remote reads against local reads, with the CPU of every FanStore process of the job.

The targets of the issue "Remote reads at local speed", measured with real
``mpiexec -n N fanstore mount STORE JOB/mnt{rank} --local-dir JOB/local{rank}`` jobs on this
machine (every node is a set of processes of this machine: "remote" means another node's
processes, reached over MPI shared memory). Two shapes of the same code in one run:

- ``ranks``: a node's FUSE workers are MPI ranks of their own (each node's daemon spawns
  ``--workers`` of them): a remote chunk goes straight from a worker rank of the reading
  node to a rank of the holder node;
- ``relay``: ``--no-worker-ranks``: forked FUSE workers ask the node's daemon over
  its control socket, which fetches over MPI from the holder's daemon (the shape before).

Phases (every pass cold: page cache dropped, fresh job per repetition):

1. ``lr``: rank 0's mount, 2- and 4-node jobs; the files whose partitions node 0 holds
   (local) and as many held by the other nodes (remote), each read once, 1 and 4 reader
   processes. Per pass: files/s, and the CPU seconds of EVERY FanStore process of the job
   (daemons, kernel frontend processes, worker ranks: ``--watch-pid``) per file, split by
   role; the busiest process's share of it.
2. ``dist``: a 2-node job with 1 and 2 worker ranks per node, a remote pass with 4
   readers: the share of the remote path's CPU the busiest process carries (target: at
   most 1/K + 10% with K workers).
3. ``agg``: every node's mount read at once (1, 2 and 4 nodes, 2 readers per node, a file
   local with probability 1/n), aggregate files/s against 1 node.
4. ``idle``: CPU of every process of an idle mounted 4-node job over 10 s, per node.
5. ``auto``: a 4-node job with ``--replicas auto``: remote reads after reading everything.

Writes its section of docs/benchmarks.md (``remote_bench``) and the raw rows to
tools/bench/results/remote_bench.jsonl. Every job is torn down on exit (also Ctrl-C).
Run as root (drop_caches, FUSE):

    .venv/bin/python tools/bench/remote_bench.py --preset quick   # a smoke run (~3 min)
    .venv/bin/python tools/bench/remote_bench.py --preset full    # quiet machine (~25 min)
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import shutil
import signal
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
from mount_bench import _find_fanstore, _kill_group, is_mounted, log, pid_alive  # noqa: E402
from mpi_bench import ensure_dataset, pack_store, placement_sets  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
READER = os.path.join(HERE, "reader.py")
SECTION = "remote_bench"

PRESETS = {
    "quick": dict(files=2000, classes=20, partitions=8, reps=1, lr_ranks="2",
                  readers="1,4", agg_ranks="1,2", idle_seconds=5),
    "full": dict(files=8000, classes=80, partitions=16, reps=3, lr_ranks="2,4",
                 readers="1,4", agg_ranks="1,2,4", idle_seconds=10),
}


def state(mnt: str) -> dict:
    from fanstore import runtime

    return runtime.read_state(mnt) or {}


def children(pid: int) -> list[int]:
    out = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                out += [int(c) for c in f.read().split()]
    except OSError:
        pass
    return out


def cpu_seconds(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


class Job:
    """One ``mpiexec -n N fanstore mount`` job (or a plain mount for one node)."""

    def __init__(self, bench: "Bench", nodes: int, tag: str, mode: str,
                 extra: list[str] | None = None) -> None:
        self.bench = bench
        self.nodes = nodes
        self.mode = mode
        self.dir = os.path.join(bench.work, "jobs", tag)
        self.extra = list(extra or [])
        self.proc: subprocess.Popen | None = None
        self.log_path = os.path.join(self.dir, "mpiexec.log")
        self.roles: dict[int, str] = {}
        self._logf = None

    def mnt(self, r: int) -> str:
        return os.path.join(self.dir, f"mnt{r}")

    def argv(self) -> list[str]:
        b = self.bench
        common_args = ["--workers", str(b.a.workers)] + self.extra \
            + (["--no-worker-ranks"] if self.mode == "relay" else [])
        if self.nodes == 1:
            return [b.fanstore, "mount", b.store, self.mnt(0), "--local-dir",
                    os.path.join(self.dir, "local0")] + common_args
        return [b.mpiexec, "-n", str(self.nodes), b.fanstore, "mount", b.store,
                os.path.join(self.dir, "mnt{rank}"), "--local-dir",
                os.path.join(self.dir, "local{rank}")] + common_args

    def env(self) -> dict[str, str]:
        return dict(os.environ, PYTHONUNBUFFERED="1", FANSTORE_FRONTEND="kernel")

    def shown(self) -> str:
        text = " ".join(shlex.quote(x) for x in self.argv()).replace(self.dir, "JOB")
        return text

    def start(self, timeout: float = 180.0) -> None:
        b = self.bench
        shutil.rmtree(self.dir, ignore_errors=True)
        for r in range(self.nodes):
            os.makedirs(self.mnt(r), exist_ok=True)
        b.jobs.append(self)
        self._logf = open(self.log_path, "ab")
        if self.nodes == 1:
            p = subprocess.run(self.argv(), stdout=self._logf, stderr=subprocess.STDOUT,
                               env=self.env(), timeout=timeout)
            if p.returncode != 0:
                raise RuntimeError(f"fanstore mount failed: {self.output()[-800:]}")
        else:
            self.proc = subprocess.Popen(self.argv(), stdout=self._logf,
                                         stderr=subprocess.STDOUT, env=self.env(),
                                         start_new_session=True)
            for r in range(self.nodes):
                w = subprocess.run([b.fanstore, "wait", self.mnt(r), "--timeout",
                                    str(int(timeout))], capture_output=True, text=True)
                if w.returncode != 0:
                    raise RuntimeError(f"node {r} not ready: {w.stderr.strip()}\n"
                                       f"{self.output()[-800:]}")
        self.find_roles()

    def find_roles(self) -> None:
        """pid -> role for every FanStore process: nN.daemon, nN.frontend, nN.fworker (a
        forked FUSE worker), nN.rank (a worker rank)."""
        self.roles = {}
        for r in range(self.nodes):
            st = state(self.mnt(r))
            pid = st.get("pid")
            if not pid:
                continue
            self.roles[pid] = f"n{r}.daemon"
            for c in children(pid):
                self.roles[c] = f"n{r}.frontend"
                for w in children(c):
                    self.roles[w] = f"n{r}.fworker"
            for w in st.get("worker_pids") or []:
                self.roles[w] = f"n{r}.rank"

    def stats(self, r: int) -> dict:
        p = subprocess.run([self.bench.fanstore, "stats", self.mnt(r), "--json"],
                           capture_output=True, text=True, timeout=60)
        return json.loads(p.stdout) if p.returncode == 0 else {}

    def output(self) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read()
        except OSError:
            return ""

    def stop(self) -> None:
        b = self.bench
        daemons = [p for p, role in self.roles.items() if role.endswith(".daemon")]
        if self.nodes == 1:
            subprocess.run([b.fanstore, "umount", self.mnt(0)], capture_output=True,
                           timeout=90)
        for pid in daemons:
            if pid_alive(pid):
                try:
                    os.kill(pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and any(pid_alive(p) for p in self.roles):
            time.sleep(0.05)
        if self.proc is not None:
            try:
                self.proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _kill_group(self.proc)
        for pid in self.roles:
            if pid_alive(pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for r in range(self.nodes):
            if is_mounted(self.mnt(r)):
                subprocess.run(["fusermount3", "-u", "-z", "--", self.mnt(r)],
                               capture_output=True)
        shutil.rmtree(self.dir, ignore_errors=True)
        if self._logf is not None:
            self._logf.close()
            self._logf = None
        if self in b.jobs:
            b.jobs.remove(self)


class Bench(common.RowLog):
    def __init__(self, a: argparse.Namespace) -> None:
        self.a = a
        self.work = os.path.abspath(a.work)
        self.lists = os.path.join(self.work, "lists")
        self.store = os.path.join(self.work, "store")
        self.py = common.python()
        self.fanstore = _find_fanstore()
        self.mpiexec = os.path.join(os.path.dirname(self.py), "mpiexec")
        self.jobs: list[Job] = []
        self.rows: list[dict] = []
        self.commands: list[str] = []
        self.run_id = time.strftime("%Y%m%dT%H%M%S")
        self.jsonl_tmp = os.path.join(self.work, f"remote_bench-{self.run_id}.jsonl")
        self.t_start = time.time()
        self.total_seconds = 0.0

    def cmd(self, text: str) -> None:
        if text not in self.commands:
            self.commands.append(text)

    def write_list(self, name: str, items: list[str]) -> str:
        os.makedirs(self.lists, exist_ok=True)
        path = os.path.join(self.lists, name)
        with open(path, "w") as f:
            f.write("".join(p + "\n" for p in items))
        return path

    def read_pass(self, root: str, list_path: str, readers: int, job: Job, tags: dict) -> dict:
        argv = [self.py, READER, "read", "--root", root, "--list", list_path, "--workers",
                str(readers), "--seed", "-1", "--time-limit", str(self.a.pass_limit)]
        for pid in job.roles:
            argv += ["--watch-pid", str(pid)]
        self.cmd(" ".join(shlex.quote(x) for x in argv[:argv.index("--time-limit")])
                 .replace(root, "ROOT").replace(os.path.basename(list_path), "LIST.txt"))
        proc = subprocess.run(argv, capture_output=True, text=True,
                              timeout=self.a.pass_limit + 120)
        try:
            row = json.loads(proc.stdout.strip().splitlines()[-1])
        except (ValueError, IndexError):
            row = {"errors": 1, "first_error": proc.stderr.strip()[-300:]}
        row.update(tags)
        spent = {int(k): v for k, v in (row.get("watched_cpu_s") or {}).items()
                 if v is not None}
        files = row.get("files") or 0
        if files and spent:
            by_role: dict[str, float] = {}
            for pid, sec in spent.items():
                role = job.roles.get(pid, "?").split(".", 1)
                key = ("reader node " if role[0] == "n0" else "other nodes ") + role[-1]
                by_role[key] = by_role.get(key, 0.0) + sec
            total = sum(spent.values())
            row["cpu_us_per_file"] = round(total / files * 1e6, 1)
            row["cpu_us_by_role"] = {k: round(v / files * 1e6, 1) for k, v in
                                     sorted(by_role.items())}
            row["busiest_share"] = round(max(spent.values()) / total, 3) if total else None
            row["processes"] = len(spent)
        return row

    # -------------------------------------------------------------- phases
    def run(self) -> None:
        a = self.a
        os.makedirs(self.work, exist_ok=True)
        self.machine = common.machine_table(self.work)
        data, _small, gen_cmd = ensure_dataset(self.py, self.work, a.files, a.classes, 50,
                                               150, a.seed)
        self.cmd(gen_cmd)
        info, pack_cmd = pack_store(self.fanstore, data, self.store, a.partitions, a.codec,
                                    os.cpu_count() or 1, True)
        self.cmd(pack_cmd)
        self.emit({"kind": "store", "ratio": info.get("ratio"),
                   "files": info.get("counts", {}).get("files")})
        for phase in a.phases:
            getattr(self, f"phase_{phase}")()
        self.total_seconds = time.time() - self.t_start

    def phase_lr(self) -> None:
        a = self.a
        for rep in range(1, a.reps + 1):
            for n in a.lr_ranks:
                sets = placement_sets(self.store, n)
                local = sets[0]
                remote = [p for r in range(1, n) for p in sets[r]]
                k = min(len(local), len(remote), a.lr_files)
                for mode in (("ranks", "relay") if rep % 2 else ("relay", "ranks")):
                    for readers in a.readers:
                        rng = random.Random(97 * rep + readers)
                        lists = {w: self.write_list(f"lr-{n}-{rep}-{readers}-{w}.txt",
                                                    rng.sample(src, k))
                                 for w, src in (("local", local), ("remote", remote))}
                        common.drop_caches()
                        job = Job(self, n, f"lr-{mode}-{n}-{rep}-{readers}", mode)
                        self.cmd(job.shown())
                        try:
                            job.start()
                            for which in (("local", "remote") if readers % 2
                                          else ("remote", "local")):
                                before = job.stats(0)
                                common.drop_caches()
                                row = self.read_pass(job.mnt(0), lists[which], readers, job,
                                                     dict(kind="lr", mode=mode, nodes=n,
                                                          rep=rep, readers=readers,
                                                          which=which))
                                after = job.stats(0)
                                row["remote_reads"] = (after.get("remote_reads", 0)
                                                       - before.get("remote_reads", 0))
                                self.emit(row)
                                log(f"  lr {mode:5} n={n} r={readers} {which:6}: "
                                    f"{row.get('files_per_s')} files/s, "
                                    f"{row.get('cpu_us_per_file')} us/file CPU, busiest "
                                    f"{row.get('busiest_share')}, remote reads "
                                    f"{row['remote_reads']}")
                        finally:
                            job.stop()

    def phase_dist(self) -> None:
        a = self.a
        sets = placement_sets(self.store, 2)
        remote = sets[1][: a.lr_files]
        lst = self.write_list("dist.txt", remote)
        for rep in range(1, a.reps + 1):
            for k in (1, 2):
                common.drop_caches()
                job = Job(self, 2, f"dist-{k}-{rep}", "ranks", ["--workers", str(k)])
                try:
                    job.start()
                    common.drop_caches()
                    row = self.read_pass(job.mnt(0), lst, 4, job,
                                         dict(kind="dist", workers=k, rep=rep))
                    self.emit(row)
                    log(f"  dist K={k}: busiest process {row.get('busiest_share')} of "
                        f"{row.get('cpu_us_per_file')} us/file ({row.get('files_per_s')} "
                        "files/s)")
                finally:
                    job.stop()

    def phase_agg(self) -> None:
        a = self.a
        files = sorted(p for ps in placement_sets(self.store, 1).values() for p in ps)
        for rep in range(1, a.reps + 1):
            for mode in ("ranks", "relay"):
                for n in a.agg_ranks:
                    if n == 1 and mode == "relay":
                        continue  # one node has no remote path: the same job either way
                    order = list(files)
                    random.Random(31 * rep).shuffle(order)
                    rel = [f"mnt{i % n}/{p}" for i, p in enumerate(order)]
                    lst = self.write_list(f"agg-{n}-{rep}.txt", rel)
                    common.drop_caches()
                    job = Job(self, n, f"agg-{mode}-{n}-{rep}", mode)
                    try:
                        job.start()
                        common.drop_caches()
                        row = self.read_pass(job.dir, lst, n * a.agg_readers, job,
                                             dict(kind="agg", mode=mode, nodes=n, rep=rep))
                        row["remote_reads"] = sum(job.stats(r).get("remote_reads", 0)
                                                  for r in range(n))
                        self.emit(row)
                        log(f"  agg {mode} n={n}: {row.get('files_per_s')} files/s, "
                            f"{row.get('cpu_us_per_file')} us/file, remote reads "
                            f"{row['remote_reads']}")
                    finally:
                        job.stop()

    def phase_idle(self) -> None:
        job = Job(self, 4, "idle", "ranks")
        try:
            job.start()
            time.sleep(3)  # let the start-up settle and the pollers cool down
            before = {p: cpu_seconds(p) for p in job.roles}
            t0 = time.monotonic()
            time.sleep(self.a.idle_seconds)
            wall = time.monotonic() - t0
            after = {p: cpu_seconds(p) for p in job.roles}
            per_node: dict[str, float] = {}
            for p, role in job.roles.items():
                if before.get(p) is None or after.get(p) is None:
                    continue
                node = role.split(".")[0]
                per_node[node] = per_node.get(node, 0.0) + (after[p] - before[p]) / wall
            row = self.emit({"kind": "idle", "nodes": 4, "seconds": round(wall, 2),
                             "core_share_per_node": {k: round(v, 4) for k, v in
                                                     sorted(per_node.items())},
                             "processes_per_node": len(job.roles) // 4})
            log(f"  idle: {row['core_share_per_node']} of a core per node")
        finally:
            job.stop()

    def phase_auto(self) -> None:
        files = sorted(p for ps in placement_sets(self.store, 1).values() for p in ps)
        lst = self.write_list("auto.txt", files[: self.a.lr_files])
        job = Job(self, 4, "auto", "ranks", ["--replicas", "auto"])
        try:
            job.start()
            common.drop_caches()
            row = self.read_pass(job.mnt(0), lst, 4, job, dict(kind="auto", nodes=4))
            st = job.stats(0)
            row["remote_reads"] = st.get("remote_reads")
            row["local_reads"] = st.get("local_reads")
            row["replicas"] = st.get("replicas")
            self.emit(row)
            log(f"  auto: replicas {row['replicas']}, remote reads {row['remote_reads']}, "
                f"local reads {row['local_reads']}, {row.get('files_per_s')} files/s")
        finally:
            job.stop()

    def cleanup(self) -> None:
        for job in list(self.jobs):
            try:
                job.stop()
            except Exception as exc:  # noqa: BLE001 - cleanup goes on
                log(f"cleanup of {job.dir} failed: {exc}")


# ------------------------------------------------------------------------------ the section


def render(bench: Bench, label: str | None, argv: list[str]) -> str:
    rows = bench.rows
    med, num = common.med, common.num
    out = [f"Run {bench.run_id}" + (f" ({label})" if label else "")
           + f", commit {common.git_commit()}; `{' '.join(argv)}`. {bench.a.files} files of "
           f"50-150 kB, {bench.a.codec}, {bench.a.workers} FUSE workers per node; every pass "
           "cold; medians of the repetitions. CPU = every FanStore process of the job "
           "(daemons, kernel frontend processes, worker ranks or forked workers), per file "
           "read.", ""]
    lr = [r for r in rows if r.get("kind") == "lr"]
    if lr:
        out += ["### Local vs remote through rank 0's mount", "",
                "| shape | nodes | readers | local files/s | remote files/s | remote/local | "
                "CPU us/file local | remote | remote/local | busiest process (remote) |",
                "|---|---|---|---|---|---|---|---|---|---|"]
        for mode in ("relay", "ranks"):
            for n in sorted({r["nodes"] for r in lr}):
                for w in sorted({r["readers"] for r in lr}):
                    q = dict(kind="lr", mode=mode, nodes=n, readers=w)
                    loc = med(common.row_vals(rows, "files_per_s", which="local", **q))
                    rem = med(common.row_vals(rows, "files_per_s", which="remote", **q))
                    cl = med(common.row_vals(rows, "cpu_us_per_file", which="local", **q))
                    cr = med(common.row_vals(rows, "cpu_us_per_file", which="remote", **q))
                    busy = med(common.row_vals(rows, "busiest_share", which="remote", **q))
                    if loc is None and rem is None:
                        continue
                    out.append(f"| {mode} | {n} | {w} | {num(loc)} | {num(rem)} | "
                               f"{common.ratio(rem, loc)} | {num(cl)} | {num(cr)} | "
                               f"{common.ratio(cr, cl)} | {num(busy, 2)} |")
        cr4 = [med(common.row_vals(rows, "cpu_us_per_file", which="remote", kind="lr",
                                   mode="ranks", nodes=n, readers=max(r["readers"] for r in lr)))
               for n in sorted({r["nodes"] for r in lr})]
        cr4 = [c for c in cr4 if c]
        if cr4:
            c = max(cr4)
            out += ["", f"Projection to a 64-core node (an extrapolation): a remote file costs "
                    f"{num(c)} us of CPU summed over both sides (ranks shape, the most readers, "
                    f"the worst node count); in a symmetric job each node pays both sides, and "
                    f"the path is spread over the node's worker ranks (next table), so a node "
                    f"with 64 cores given to FanStore would read about {num(64e6 / c)} remote "
                    f"files/s ({num(32e6 / c)} with half of them), if MPI's shared-memory and "
                    f"network transfers are not the limit. The issue's example, an 8-GPU node "
                    f"needing 40,000 files/s, needs {num(40000 * c / 1e6)} cores at this cost."]
        out += ["", "Per-process split of the CPU per remote file (first repetition):", ""]
        for r in lr:
            if r.get("which") == "remote" and r.get("rep") == 1 and r.get("cpu_us_by_role"):
                parts = ", ".join(f"{k} {v}" for k, v in r["cpu_us_by_role"].items())
                out.append(f"- {r['mode']}, {r['nodes']} nodes, {r['readers']} readers: "
                           f"{parts} us/file")
        out.append("")
    dist = [r for r in rows if r.get("kind") == "dist"]
    if dist:
        out += ["### Spread of the remote path over a node's processes", "",
                "| worker ranks per node | remote files/s (4 readers) | CPU us/file | "
                "busiest process's share | target (1/K + 10%) |", "|---|---|---|---|---|"]
        for k in (1, 2):
            q = dict(kind="dist", workers=k)
            out.append(f"| {k} | {num(med(common.row_vals(rows, 'files_per_s', **q)))} | "
                       f"{num(med(common.row_vals(rows, 'cpu_us_per_file', **q)))} | "
                       f"{num(med(common.row_vals(rows, 'busiest_share', **q)), 2)} | "
                       f"{1 / k + 0.1:.2f} |")
        out.append("")
    agg = [r for r in rows if r.get("kind") == "agg"]
    if agg:
        one = med(common.row_vals(rows, "files_per_s", kind="agg", mode="ranks", nodes=1))
        out += ["### Aggregate: every node's mount read at once", "",
                "| shape | nodes | files/s | vs 1 node | CPU us/file | remote reads |",
                "|---|---|---|---|---|---|"]
        for mode in ("ranks", "relay"):
            for n in sorted({r["nodes"] for r in agg}):
                q = dict(kind="agg", mode=mode, nodes=n)
                fps = med(common.row_vals(rows, "files_per_s", **q))
                if fps is None:
                    continue
                out.append(f"| {mode} | {n} | {num(fps)} | {common.ratio(fps, one)} | "
                           f"{num(med(common.row_vals(rows, 'cpu_us_per_file', **q)))} | "
                           f"{num(med(common.row_vals(rows, 'remote_reads', **q)))} |")
        out.append("")
    for r in rows:
        if r.get("kind") == "idle":
            out += ["### Idle", "", f"A mounted 4-node job doing nothing for {r['seconds']} s "
                    f"({r['processes_per_node']} processes per node): share of one core per "
                    f"node {r['core_share_per_node']} (target < 0.05).", ""]
        if r.get("kind") == "auto":
            out += ["### --replicas auto", "", f"4 nodes, a store that fits: replicas "
                    f"{r.get('replicas')}, {r.get('local_reads')} local and "
                    f"{r.get('remote_reads')} remote reads after {r.get('files')} files "
                    f"({num(r.get('files_per_s'))} files/s, 4 readers).", ""]
    out += ["Commands:", "", "```"] + bench.commands + ["```", "", bench.machine]
    return "\n".join(out)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def parse_args(argv: list[str] | None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="quick")
    ap.add_argument("--work", default="/tmp/fanstore-remotebench")
    ap.add_argument("--phases", default="lr,dist,agg,idle,auto")
    ap.add_argument("--workers", type=int, default=2, help="FUSE workers per node")
    ap.add_argument("--codec", default="zstd:3")
    ap.add_argument("--seed", type=int, default=11)
    ap.add_argument("--lr-files", type=int, default=1500, help="files per pass at most")
    ap.add_argument("--agg-readers", type=int, default=2)
    ap.add_argument("--pass-limit", type=float, default=120)
    ap.add_argument("--label")
    ap.add_argument("--no-docs", action="store_true")
    ap.add_argument("--docs", default=common.DOCS)
    ap.add_argument("--results", default=os.path.join(common.RESULTS_DIR,
                                                      "remote_bench.jsonl"))
    a = ap.parse_args(argv)
    for k, v in PRESETS[a.preset].items():
        setattr(a, k, v)
    a.lr_ranks = _ints(str(a.lr_ranks))
    a.readers = _ints(str(a.readers))
    a.agg_ranks = _ints(str(a.agg_ranks))
    a.phases = [p for p in a.phases.split(",") if p]
    return a


def main(argv: list[str] | None = None) -> int:
    raw = list(sys.argv[1:] if argv is None else argv)
    a = parse_args(raw)
    bench = Bench(a)

    def still_mounted() -> list[str]:
        return [j.mnt(r) for j in bench.jobs for r in range(j.nodes) if is_mounted(j.mnt(r))]

    ok = common.guarded_run(bench, log, still_mounted)
    return common.publish(ok, bench, a, log, SECTION, render, "tools/bench/remote_bench.py",
                          raw)


if __name__ == "__main__":
    sys.exit(main())
