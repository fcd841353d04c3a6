#!/usr/bin/env python3
"""FanStore across ranks: local vs remote reads, aggregate files/s, stage-in, metadata scale.

The Benchmark section of the issue "One global namespace across nodes", measured with real
``mpiexec -n N fanstore mount STORE MNT{rank} --local-dir LOCAL{rank}`` jobs on this machine
(every rank is a process of the same machine: "remote" means another daemon here, reached
over MPI shared memory, not over a network):

1. **Local vs remote** (one job of ``--lr-ranks`` ranks per repetition and reader count):
   rank 0's mount; the files whose partition rank 0 holds (partition p lives on rank
   p mod n) and an equally large random sample of the files held by other ranks, each read
   once, cold (dropped page cache; the two sets are disjoint, so the daemon's chunk cache
   holds nothing of the second set), in alternating order, with 1 and 4 reader processes.
2. **Aggregate files/s with 1, 2, 4 ranks**: a fresh job per rank count, repetition and
   readers per rank; every rank's mount is read at the same time, each rank a disjoint
   round-robin share of one shuffled list (so a file is local with probability 1/n), all
   readers released by one barrier. The 1-rank case is ``fanstore mount --local-dir``
   without a launcher (the same node code, staging included).
3. **Stage-in**: each of those jobs stages cold (dropped caches before the launch);
   ``stage_mb_per_s`` / ``stage_seconds`` / ``staged_bytes`` from ``fanstore stats`` of every
   rank, next to a plain ``cp`` of the same partitions into a local directory (one ``cp``
   per rank, concurrently, cold), timed with and without the final ``sync``; interleaved.
4. **Metadata**: bytes per entry in memory (``fanstore stats``/``info``) for the dataset;
   for synthetic namespaces of ``--meta-files`` files (an index built in-process with
   ``IndexBuilder``/``encode_index``, no file data): encoded size, ``read_index_bytes``
   (parse + validate) time, ``Namespace`` build time, resident memory, and the daemon's own
   ``World.bcast_bytes`` (``Ibcast``) of the index bytes across 4 local ranks.
5. A projection of the design to 512 nodes and 10 million files from those measurements
   (metadata memory, index size and broadcast time, stage-in time per node, limits), with
   its assumptions printed next to it.

It writes its section of docs/benchmarks.md (between ``<!-- BEGIN mpi_bench -->`` and
``<!-- END mpi_bench -->``) and the raw rows to tools/bench/results/mpi_bench.jsonl. Every
job it starts is torn down on exit, also on errors and Ctrl-C / SIGTERM: SIGTERM to its own
daemons (by pid), then SIGKILL of what is left, lazy unmount of its own mount points,
removal of its own local directories. Run as root (drop_caches, FUSE).

    .venv/bin/python tools/bench/mpi_bench.py --preset quick   # ~1 min, a smoke run
    .venv/bin/python tools/bench/mpi_bench.py --preset full    # ~12-15 min, quiet machine
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import random
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
from mount_bench import (  # noqa: E402
    _find_fanstore,
    _kill_group,
    is_mounted,
    log,
    pid_alive,
)

HERE = os.path.dirname(os.path.abspath(__file__))
READER = os.path.join(HERE, "reader.py")
GEN = os.path.join(common.REPO, "tools", "gen_dataset.py")
SECTION = "mpi_bench"

PRESETS = {
    # A smoke run: the harness end to end; the numbers are not results.
    "quick": dict(files=3000, classes=30, partitions=8, lr_ranks=4, lr_reps=2,
                  agg_ranks="1,2,4", agg_readers="2", agg_reps=1, meta_files="100000",
                  bcast_reps=2),
    # For a quiet machine.
    "full": dict(files=20000, classes=100, partitions=16, lr_ranks=4, lr_reps=3,
                 agg_ranks="1,2,4", agg_readers="1,2", agg_reps=3, meta_files="250000,1000000",
                 bcast_reps=3),
}


# ------------------------------------------------------------------------------ dataset


def ensure_dataset(py: str, work: str, files: int, classes: int, min_kb: int, max_kb: int,
                   seed: int, large: int = 0, large_mb: int = 64) -> tuple[str, list[str], str]:
    """Generate (or reuse) a tools/gen_dataset.py dataset under WORK/data.

    Returns (data dir, sorted relative paths of the small files, the generating command).
    A stamp file records the parameters, so a dataset is reused only if they match.
    """
    data = os.path.join(work, "data")
    want = dict(files=files, classes=classes, min_kb=min_kb, max_kb=max_kb, seed=seed,
                large=large, large_mb=large_mb)
    argv = [py, GEN, data, "--files", str(files), "--classes", str(classes), "--min-kb",
            str(min_kb), "--max-kb", str(max_kb), "--seed", str(seed), "--subdir", "small"]
    if large:
        argv += ["--large", str(large), "--large-mb", str(large_mb)]
    stamp = os.path.join(work, "dataset.json")
    try:
        with open(stamp) as f:
            have = json.load(f)
    except (OSError, ValueError):
        have = None
    if have != want or not os.path.isdir(data):
        log(f"generating dataset: {files} files of {min_kb}-{max_kb} kB")
        shutil.rmtree(data, ignore_errors=True)
        if os.path.exists(stamp):
            os.unlink(stamp)
        t0 = time.time()
        subprocess.run(argv, check=True, stdout=subprocess.DEVNULL)
        os.sync()
        with open(stamp, "w") as f:
            json.dump(want, f)
        log(f"  generated in {time.time() - t0:.0f} s")
    else:
        log("dataset present with the same parameters, reusing it")
    small = []
    for top, dirs, names in os.walk(os.path.join(data, "small")):
        dirs.sort()
        for name in sorted(names):
            small.append(os.path.relpath(os.path.join(top, name), data))
    return data, small, " ".join(shlex.quote(x) for x in argv)


def pack_store(fanstore: str, data: str, dest: str, partitions: int, codec: str, jobs: int,
               reuse: bool) -> tuple[dict, str]:
    """Pack ``data`` into ``dest`` (unless a matching store exists and ``reuse``)."""
    argv = [fanstore, "pack", data, dest, "--partitions", str(partitions), "--codec", codec,
            "--jobs", str(jobs), "--no-progress", "--force"]
    stamp = dest + ".params.json"
    want = dict(partitions=partitions, codec=codec, data=data)
    try:
        with open(stamp) as f:
            have = json.load(f)
    except (OSError, ValueError):
        have = None
    seconds = None
    if not (reuse and have == want and os.path.exists(os.path.join(dest, "fanstore.idx"))):
        shutil.rmtree(dest, ignore_errors=True)
        common.drop_caches()
        log(f"pack: {' '.join(argv[1:])}")
        t0 = time.perf_counter()
        subprocess.run(argv, check=True, capture_output=True, text=True)
        os.sync()
        seconds = time.perf_counter() - t0
        with open(stamp, "w") as f:
            json.dump(want, f)
    info = json.loads(subprocess.run([fanstore, "info", dest, "--json"], check=True,
                                     capture_output=True, text=True).stdout)
    info["pack_seconds"] = seconds
    return info, " ".join(shlex.quote(x) for x in argv)


# ------------------------------------------------------------------------------ MPI jobs


def control(mnt: str, req: dict, timeout: float = 30.0) -> dict | None:
    """One request on a mount's control socket (what `fanstore stats --json` sends)."""
    from fanstore import control

    try:
        return control.control(mnt, req, timeout=timeout)
    except Exception:  # noqa: BLE001 - a dead daemon: the caller reports it
        return None


def state_pid(mnt: str) -> int | None:
    from fanstore import runtime

    try:
        pid = (runtime.read_state(mnt) or {}).get("pid")
        return int(pid) if pid else None
    except Exception:  # noqa: BLE001
        return None


class Job:
    """``mpiexec -n N fanstore mount STORE DIR/mnt{rank} --local-dir DIR/local{rank}``.

    With one rank: ``fanstore mount STORE DIR/mnt0 --local-dir DIR/local0`` (no launcher;
    the same node code with staging, in the background). ``stop()`` always tears down
    what this job started, by pid and by its own paths only.
    """

    def __init__(self, bench: "Bench", ranks: int, tag: str, extra: list[str] | None = None):
        self.bench = bench
        self.ranks = ranks
        self.dir = os.path.join(bench.work, "jobs", tag)
        self.extra = list(extra or [])
        self.proc: subprocess.Popen | None = None
        self.pids: dict[int, int] = {}
        self.log_path = os.path.join(self.dir, "mpiexec.log")
        self._logf = None
        self.ready_seconds: float | None = None

    def mnt(self, r: int) -> str:
        return os.path.join(self.dir, f"mnt{r}")

    def local(self, r: int) -> str:
        return os.path.join(self.dir, f"local{r}")

    def argv(self) -> list[str]:
        b = self.bench
        if self.ranks == 1:
            return [b.fanstore, "mount", b.store, self.mnt(0), "--local-dir",
                    self.local(0)] + self.extra
        return [b.mpiexec, "-n", str(self.ranks), b.fanstore, "mount", b.store,
                os.path.join(self.dir, "mnt{rank}"), "--local-dir",
                os.path.join(self.dir, "local{rank}")] + self.extra

    def shown(self) -> str:
        text = " ".join(shlex.quote(x) for x in self.argv())
        return text.replace(self.dir, "JOB")

    def start(self, timeout: float = 180.0) -> None:
        b = self.bench
        shutil.rmtree(self.dir, ignore_errors=True)
        for r in range(self.ranks):
            os.makedirs(self.mnt(r), exist_ok=True)
        b.jobs.append(self)
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        t0 = time.perf_counter()
        self._logf = open(self.log_path, "ab")
        if self.ranks == 1:
            p = subprocess.run(self.argv(), stdout=self._logf, stderr=subprocess.STDOUT, env=env,
                               timeout=timeout)
            if p.returncode != 0:
                raise RuntimeError(f"fanstore mount failed: {self.output()[-800:]}")
        else:
            # Own session: hydra and its proxies are ours to kill if the daemons do not stop.
            self.proc = subprocess.Popen(self.argv(), stdout=self._logf,
                                         stderr=subprocess.STDOUT, env=env,
                                         start_new_session=True)
            for r in range(self.ranks):
                left = max(1.0, timeout - (time.perf_counter() - t0))
                w = subprocess.run([b.fanstore, "wait", self.mnt(r), "--timeout", f"{left:.0f}"],
                                   capture_output=True, text=True)
                if w.returncode != 0:
                    self._remember_pids()
                    raise RuntimeError(f"rank {r} not ready: {w.stderr.strip()}\n"
                                       f"{self.output()[-800:]}")
        self.ready_seconds = time.perf_counter() - t0
        self._remember_pids()

    def _remember_pids(self) -> None:
        for r in range(self.ranks):
            pid = state_pid(self.mnt(r))
            if pid:
                self.pids[r] = pid

    def pid_list(self) -> list[int]:
        return [self.pids[r] for r in sorted(self.pids)]

    def stats(self, r: int) -> dict | None:
        return control(self.mnt(r), {"op": "stats"})

    def output(self) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read()
        except OSError:
            return ""

    def alive(self) -> bool:
        return all(pid_alive(p) for p in self.pids.values()) and len(self.pids) == self.ranks

    def stop(self) -> None:
        """SIGTERM our daemons (one stops every rank), wait; then force what is left."""
        self._remember_pids()
        b = self.bench
        if self.ranks == 1 and self.pids.get(0) and pid_alive(self.pids[0]):
            subprocess.run([b.fanstore, "umount", self.mnt(0)], capture_output=True, timeout=90)
        for pid in self.pids.values():
            if pid_alive(pid):
                try:
                    os.kill(pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and any(pid_alive(p) for p in self.pids.values()):
            time.sleep(0.05)
        if self.proc is not None:
            try:
                self.proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _kill_group(self.proc)
        for pid in self.pids.values():
            if pid_alive(pid):
                log(f"  daemon pid {pid} did not stop on SIGTERM; SIGKILL")
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for r in range(self.ranks):
            if is_mounted(self.mnt(r)):
                subprocess.run(["fusermount3", "-u", "-z", "--", self.mnt(r)], capture_output=True)
            shutil.rmtree(self.local(r), ignore_errors=True)
        if self._logf is not None:
            self._logf.close()
            self._logf = None
        if self in b.jobs:
            b.jobs.remove(self)


# ------------------------------------------------------------------------------ the run


def placement_sets(store: str, ranks: int) -> dict[int, list[str]]:
    """Files (relative paths) by the rank holding their partition (p mod n, replicas 1)."""
    from fanstore.format.index import read_index

    index = read_index(store)
    part = index.chunks["part"]
    first = index.entries["first"]
    out: dict[int, list[str]] = {r: [] for r in range(ranks)}
    for entry in index.file_entries().tolist():
        if int(index.entries["count"][entry]) == 0:
            continue
        p = int(part[int(first[entry])])
        if index.partitions[p].broadcast:
            continue
        out[p % ranks].append(os.fsdecode(index.path(entry)))
    return out


def partitions_of(store: str, ranks: int) -> dict[int, list[str]]:
    """Partition file paths each rank stages (the same placement the daemons use)."""
    from fanstore.daemon import placement as pl
    from fanstore.format.index import read_index

    index = read_index(store)
    table = pl.placement([p.broadcast for p in index.partitions], ranks, 1)
    return {r: [os.path.join(store, index.partitions[p].name)
                for p in pl.local_partitions(table, r)] for r in range(ranks)}


class Bench(common.RowLog):
    def __init__(self, a: argparse.Namespace) -> None:
        self.a = a
        self.work = os.path.abspath(a.work)
        self.lists = os.path.join(self.work, "lists")
        self.py = sys.executable
        self.fanstore = a.fanstore or _find_fanstore()
        self.mpiexec = a.mpiexec or os.path.join(os.path.dirname(sys.executable), "mpiexec")
        self.store = os.path.join(self.work, "store")
        self.rows: list[dict] = []
        self.commands: list[str] = []
        self.jobs: list[Job] = []
        self.run_id = time.strftime("%Y%m%dT%H%M%S")
        self.t_start = time.time()
        self.jsonl_tmp = os.path.join(self.work, f"mpi_bench-{self.run_id}.jsonl")
        self.total_seconds = 0.0

    def cmd(self, text: str) -> None:
        text = text.replace(self.work, "WORK")
        if text not in self.commands:
            self.commands.append(text)

    def write_list(self, name: str, items: list[str]) -> str:
        os.makedirs(self.lists, exist_ok=True)
        path = os.path.join(self.lists, name)
        with open(path, "w") as f:
            f.write("".join(p + "\n" for p in items))
        return path

    # -------------------------------------------------------------- one read pass
    def read_pass(self, root: str, list_path: str, workers: int, pids: list[int],
                  tags: dict) -> dict:
        argv = [self.py, READER, "read", "--root", root, "--list", list_path, "--workers",
                str(workers), "--seed", "-1", "--time-limit", str(self.a.pass_limit)]
        for pid in pids:
            argv += ["--watch-pid", str(pid)]
        shown = [x for x in argv[:argv.index("--time-limit")]]
        self.cmd(" ".join(shlex.quote(x) for x in shown).replace(root, "ROOT")
                 .replace(os.path.basename(list_path), "LIST.txt"))
        load = common.loadavg1()
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
        try:
            out, err = proc.communicate(timeout=self.a.pass_limit + 120)
        except BaseException:
            _kill_group(proc)
            raise
        try:
            row = json.loads(out.strip().splitlines()[-1])
        except (ValueError, IndexError):
            row = {"op": "read", "errors": 1, "first_error": f"reader failed: {err.strip()[-300:]}"}
        row.update(tags, load1_before=load)
        return row

    # -------------------------------------------------------------- phases
    def run(self) -> None:
        a = self.a
        os.makedirs(self.work, exist_ok=True)
        self.machine = common.machine_table(self.work)
        log(f"work dir {self.work}; load average {os.getloadavg()[0]:.2f}")
        data, small, gen_cmd = ensure_dataset(self.py, self.work, a.files, a.classes, a.min_kb,
                                              a.max_kb, a.seed)
        self.cmd(gen_cmd)
        self.n_small = len(small)
        info, pack_cmd = pack_store(self.fanstore, data, self.store, a.partitions, a.codec,
                                    a.jobs, a.reuse_store)
        self.cmd(pack_cmd)
        self.emit({"kind": "store", "files": len(small), "info": {
            k: info.get(k) for k in ("counts", "index_bytes", "index_bytes_per_entry",
                                     "memory_bytes_per_entry", "ratio", "pack_seconds")},
            "partition_sizes": [p["size"] for p in info["partitions"]],
            "params": dict(files=a.files, classes=a.classes, min_kb=a.min_kb, max_kb=a.max_kb,
                           seed=a.seed, partitions=a.partitions, codec=a.codec)})
        self.cmd(f"{self.fanstore} info WORK/store --json")

        if "lr" in a.phases:
            self.local_remote()
        if "agg" in a.phases:
            self.aggregate()
        if "meta" in a.phases:
            self.metadata()
        self.total_seconds = time.time() - self.t_start

    # ---- 1. local vs remote
    def local_remote(self) -> None:
        a = self.a
        n = a.lr_ranks
        sets = placement_sets(self.store, n)
        local_all = sets[0]
        remote_all = [p for r in range(1, n) for p in sets[r]]
        k = min(len(local_all), len(remote_all))
        log(f"local vs remote: {n}-rank jobs, rank 0 holds {len(local_all)} files, others "
            f"{len(remote_all)}; {k} of each per pass; readers {a.lr_readers}, {a.lr_reps} reps")
        for rep in range(1, a.lr_reps + 1):
            for wi, w in enumerate(a.lr_readers):
                rng = random.Random(1000 * rep + w)
                loc = rng.sample(local_all, k)
                rem = rng.sample(remote_all, k)
                lists = {"local": self.write_list(f"lr-local-r{rep}-w{w}.txt", loc),
                         "remote": self.write_list(f"lr-remote-r{rep}-w{w}.txt", rem)}
                order = ["local", "remote"] if (rep + wi) % 2 else ["remote", "local"]
                common.drop_caches()
                job = Job(self, n, f"lr-n{n}-r{rep}-w{w}")
                self.cmd(job.shown())
                try:
                    job.start()
                    st0 = job.stats(0)
                    self.emit({"kind": "lr_job", "ranks": n, "rep": rep, "workers": w,
                               "ready_seconds": round(job.ready_seconds, 3),
                               "stats0": st0})
                    for which in order:
                        before = job.stats(0)
                        common.drop_caches()
                        row = self.read_pass(job.mnt(0), lists[which], w, job.pid_list(),
                                             dict(kind="lr", which=which, ranks=n, rep=rep,
                                                  order=order.index(which)))
                        after = job.stats(0)
                        row["daemon0"] = _diff(before, after)
                        row["remote_latency_ms_p50"] = (after or {}).get("remote_latency_ms_p50")
                        row["remote_latency_ms_p99"] = (after or {}).get("remote_latency_ms_p99")
                        if not job.alive():
                            row["daemon_died"] = True
                            row["log_tail"] = job.output()[-600:]
                        self.emit(row)
                        d = row.get("daemon0") or {}
                        log(f"  rep {rep} w={w} {which:<6}: {row.get('files_per_s')} files/s, "
                            f"p50 {row.get('lat_ms_p50')} ms (local_reads "
                            f"{d.get('local_reads')}, remote_reads {d.get('remote_reads')})"
                            + (f"  ERRORS {row['errors']}: {row.get('first_error')}"
                               if row.get("errors") else ""))
                finally:
                    job.stop()

    # ---- 2 + 3. aggregate files/s and stage-in vs cp
    def aggregate(self) -> None:
        a = self.a
        log(f"aggregate + stage-in: ranks {a.agg_ranks}, readers per rank {a.agg_readers}, "
            f"{a.agg_reps} reps, {self.n_small} files per pass")
        files = [p for r, ps in placement_sets(self.store, 1).items() for p in ps]
        files.sort()
        step = 0
        for rep in range(1, a.agg_reps + 1):
            for rpr in a.agg_readers:
                for n in a.agg_ranks:
                    step += 1
                    cp_first = step % 2 == 1
                    if cp_first:
                        self.cp_reference(n, rep, rpr)
                    self.aggregate_job(n, rep, rpr, files)
                    if not cp_first:
                        self.cp_reference(n, rep, rpr)

    def aggregate_job(self, n: int, rep: int, rpr: int, files: list[str]) -> None:
        order = list(files)
        random.Random(7919 * rep + rpr).shuffle(order)
        # Reader w of W = n * rpr takes items w, w+W, ...: all of rank (w mod n)'s share.
        rel = [f"mnt{k % n}/{p}" for k, p in enumerate(order)]
        job = Job(self, n, f"agg-n{n}-r{rep}-rpr{rpr}")
        lst = self.write_list(f"agg-n{n}-r{rep}-rpr{rpr}.txt", rel)
        self.cmd(job.shown())
        common.drop_caches()  # cold stage-in
        try:
            job.start()
            per_rank = [job.stats(r) or {} for r in range(n)]
            stage = [{k: s.get(k) for k in ("rank", "stage_seconds", "staged_bytes",
                                             "stage_mb_per_s", "staged_partitions",
                                             "index_broadcast_seconds", "metadata_bytes",
                                             "metadata_bytes_per_entry", "local_partitions")}
                     for s in per_rank]
            total_b = sum(s.get("staged_bytes") or 0 for s in stage)
            wall = max((s.get("stage_seconds") or 0) for s in stage) or None
            self.emit({"kind": "stage", "ranks": n, "rep": rep, "rpr": rpr,
                       "ready_seconds": round(job.ready_seconds, 3), "per_rank": stage,
                       "bytes": total_b, "seconds_max": wall,
                       "agg_MB_per_s": round(total_b / 1e6 / wall, 1) if wall else None})
            log(f"  n={n} rep {rep}: ready in {job.ready_seconds:.1f} s, staged "
                f"{total_b / 1e6:.0f} MB, slowest rank {wall} s"
                + (f" ({total_b / 1e6 / wall:.0f} MB/s aggregate)" if wall else ""))
            before = [job.stats(r) for r in range(n)]
            common.drop_caches()
            row = self.read_pass(job.dir, lst, n * rpr, job.pid_list(),
                                 dict(kind="agg", ranks=n, rep=rep, rpr=rpr))
            after = [job.stats(r) for r in range(n)]
            diffs = [_diff(b, c) for b, c in zip(before, after)]
            row["daemons"] = diffs
            row["local_reads"] = sum((d or {}).get("local_reads", 0) for d in diffs)
            row["remote_reads"] = sum((d or {}).get("remote_reads", 0) for d in diffs)
            if not job.alive():
                row["daemon_died"] = True
                row["log_tail"] = job.output()[-600:]
            self.emit(row)
            log(f"  n={n} rpr={rpr} rep {rep}: {row.get('files_per_s')} files/s total, CPU "
                f"{row.get('cpu_busy_pct')} %, local/remote reads {row['local_reads']}/"
                f"{row['remote_reads']}"
                + (f"  ERRORS {row['errors']}: {row.get('first_error')}" if row.get("errors")
                   else ""))
        finally:
            job.stop()

    def cp_reference(self, n: int, rep: int, rpr: int) -> None:
        parts = partitions_of(self.store, n)
        base = os.path.join(self.work, "cp")
        shutil.rmtree(base, ignore_errors=True)
        dests = {}
        for r in range(n):
            dests[r] = os.path.join(base, f"local{r}")
            os.makedirs(dests[r], exist_ok=True)
        total = sum(os.path.getsize(p) for ps in parts.values() for p in ps)
        self.cmd("cp STORE/part-*.fsp (this rank's partitions) WORK/cp/local{rank}/   "
                 "# one cp per rank, concurrently; then: sync")
        common.drop_caches()
        t0 = time.perf_counter()
        procs = [subprocess.Popen(["cp"] + parts[r] + [dests[r] + "/"], start_new_session=True)
                 for r in range(n) if parts[r]]
        try:
            codes = [p.wait() for p in procs]
        except BaseException:
            for p in procs:
                _kill_group(p)
            raise
        t_cp = time.perf_counter() - t0
        os.sync()
        t_sync = time.perf_counter() - t0
        shutil.rmtree(base, ignore_errors=True)
        ok = all(c == 0 for c in codes)
        self.emit({"kind": "cp", "ranks": n, "rep": rep, "rpr": rpr, "bytes": total, "ok": ok,
                   "seconds": round(t_cp, 4), "seconds_with_sync": round(t_sync, 4),
                   "MB_per_s": round(total / 1e6 / t_cp, 1),
                   "MB_per_s_with_sync": round(total / 1e6 / t_sync, 1)})
        log(f"  cp n={n}: {total / 1e6:.0f} MB in {t_cp:.2f} s ({total / 1e6 / t_cp:.0f} MB/s), "
            f"with sync {t_sync:.2f} s ({total / 1e6 / t_sync:.0f} MB/s)")

    # ---- 4. metadata at scale
    def metadata(self) -> None:
        a = self.a
        synth_dir = os.path.join(self.work, "synth")
        os.makedirs(synth_dir, exist_ok=True)
        me = os.path.abspath(__file__)
        for nfiles in a.meta_files:
            path = os.path.join(synth_dir, f"synth-{nfiles}.idx")
            log(f"metadata: synthetic index of {nfiles:,} files")
            argv = [self.py, me, "_synth", "--files", str(nfiles), "--out", path,
                    "--files-per-dir", str(a.files_per_dir), "--partitions",
                    str(a.synth_partitions)]
            self.cmd(" ".join(shlex.quote(x) for x in argv).replace(str(nfiles), "N"))
            row = _json_run(argv, timeout=1800)
            row.update(kind="synth", files=nfiles)
            self.emit(row)
            log(f"  built {row.get('entries'):,} entries: index {row.get('index_bytes', 0) / 1e6:.1f} "
                f"MB ({row.get('index_bytes_per_entry')} B/entry), lookup table "
                f"{row.get('lookup_seconds')} s, encode {row.get('encode_seconds')} s")
            argv = [self.py, me, "_parse", "--index", path, "--reps", "3"]
            self.cmd(" ".join(shlex.quote(x) for x in argv).replace(str(nfiles), "N"))
            row = _json_run(argv, timeout=1800)
            row.update(kind="parse", files=nfiles)
            self.emit(row)
            log(f"  parse+validate {row.get('parse_seconds')} s, Namespace "
                f"{row.get('namespace_seconds')} s, {row.get('metadata_bytes_per_entry')} B/entry "
                f"(formula), RSS {row.get('rss_bytes_per_entry')} B/entry")
            for rep in range(1, a.bcast_reps + 1):
                argv = [self.mpiexec, "-n", str(a.bcast_ranks), self.py, me, "_bcast", "--index",
                        path]
                self.cmd(" ".join(shlex.quote(x) for x in argv).replace(str(nfiles), "N"))
                row = _json_run(argv, timeout=600, new_session=True)
                row.update(kind="bcast", files=nfiles, rep=rep)
                self.emit(row)
                log(f"  Ibcast of {row.get('bytes', 0) / 1e6:.1f} MB over {a.bcast_ranks} local "
                    f"ranks: {row.get('bcast_seconds_max')} s; parse on every rank at once "
                    f"{row.get('parse_seconds_max')} s")
            if not a.keep_synth:
                os.unlink(path)

    def cleanup(self) -> None:
        for job in list(self.jobs):
            try:
                job.stop()
            except Exception as exc:  # noqa: BLE001 - keep cleaning
                log(f"  cleanup of {job.dir} failed: {exc}")
        shutil.rmtree(os.path.join(self.work, "cp"), ignore_errors=True)
        shutil.rmtree(os.path.join(self.work, "jobs"), ignore_errors=True)
        if self.a.clean:
            shutil.rmtree(self.work, ignore_errors=True)


def _diff(before: dict | None, after: dict | None) -> dict | None:
    if not before or not after:
        return None
    return {k: round(after[k] - before[k], 6) for k in after
            if isinstance(after.get(k), (int, float)) and isinstance(before.get(k), (int, float))
            and not isinstance(after.get(k), bool)}


def _json_run(argv: list[str], timeout: float, new_session: bool = True) -> dict:
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=new_session)
    try:
        out, err = proc.communicate(timeout=timeout)
    except BaseException:
        _kill_group(proc)
        raise
    for line in reversed(out.strip().splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except ValueError:
                break
    return {"error": f"exit {proc.returncode}: {err.strip()[-500:]}"}


# ------------------------------------------------------------------------------ helpers run
# as subprocesses (fresh processes: clean memory numbers, and MPI for the broadcast)


def synth_index_bytes(n_files: int, files_per_dir: int = 1000, partitions: int = 512,
                      seed: int = 0) -> tuple[bytes, dict]:
    """An index for ``n_files`` files (ImageNet-like names, 50-150 kB, one chunk each), built
    with the packer's own IndexBuilder/encode_index, without any file data."""
    import numpy as np

    from fanstore.format.index import (
        KIND_DIR,
        KIND_FILE,
        IndexBuilder,
        PartitionInfo,
        encode_index,
    )
    from fanstore.format.partition import PARTITION_HEADER_SIZE

    t0 = time.perf_counter()
    rng = np.random.default_rng(seed)
    n_dirs = max(1, math.ceil(n_files / files_per_dir))
    n = 1 + n_dirs + n_files
    b = IndexBuilder(n, n_files)
    e, c = b.entries, b.chunks
    dirs = np.arange(1, n_dirs + 1)
    counts = np.full(n_dirs, files_per_dir, dtype=np.int64)
    counts[-1] = n_files - files_per_dir * (n_dirs - 1)
    files = np.arange(1 + n_dirs, n)
    e["kind"][0] = KIND_DIR
    e["first"][0], e["count"][0] = 1, n_dirs
    e["kind"][dirs] = KIND_DIR
    e["parent"][dirs] = 0
    e["first"][dirs] = 1 + n_dirs + np.concatenate(([0], np.cumsum(counts)[:-1]))
    e["count"][dirs] = counts
    e["mode"][: 1 + n_dirs] = 0o755
    e["kind"][files] = KIND_FILE
    e["mode"][files] = 0o644
    e["parent"][files] = np.repeat(dirs, counts)
    sizes = rng.integers(50_000, 150_001, n_files)
    e["size"][files] = sizes
    e["mtime_ns"][:] = 1_700_000_000 * 10**9 + rng.integers(0, 3600 * 10**9, n)
    e["first"][files] = np.arange(n_files)
    e["count"][files] = 1
    e["checksum"][files] = rng.integers(1, 2**63, n_files, dtype=np.int64).astype(np.uint64)
    # names: directories "n%08d", files "n%08d_%06d.JPEG" (ImageNet-like lengths)
    names = [b""] + [b"n%08d" % d for d in range(n_dirs)]
    for d in range(n_dirs):
        names.extend(b"n%08d_%06d.JPEG" % (d, k) for k in range(int(counts[d])))
    lens = np.fromiter((len(x) for x in names), dtype=np.int64, count=n)
    e["name_len"][:] = lens
    e["name_off"][:] = np.concatenate(([0], np.cumsum(lens)[:-1]))
    b.names = bytearray(b"".join(names))
    del names
    # chunks: one per file, partitions dealt round-robin, packed back to back in each
    part = (np.arange(n_files) % partitions).astype(np.int64)
    stored = (sizes * rng.uniform(0.45, 0.75, n_files)).astype(np.int64) + 1
    order = np.argsort(part, kind="stable")
    cs = np.cumsum(stored[order])
    starts = np.searchsorted(part[order], np.arange(partitions))
    base = np.concatenate(([0], cs))[starts]
    offset = np.empty(n_files, dtype=np.int64)
    grp = part[order]
    offset[order] = PARTITION_HEADER_SIZE + cs - stored[order] - base[grp]
    c["part"][:] = part
    c["offset"][:] = offset
    c["stored"][:] = stored
    c["raw"][:] = sizes
    c["codec"][:] = 1
    c["checksum"][:] = rng.integers(1, 2**63, n_files, dtype=np.int64).astype(np.uint64)
    per_part_stored = np.bincount(part, weights=stored, minlength=partitions).astype(np.int64)
    per_part_raw = np.bincount(part, weights=sizes, minlength=partitions).astype(np.int64)
    per_part_files = np.bincount(part, minlength=partitions)
    parts = [PartitionInfo(number=p, size=int(PARTITION_HEADER_SIZE + per_part_stored[p]),
                           checksum="0" * 32, files=int(per_part_files[p]),
                           raw_bytes=int(per_part_raw[p])) for p in range(partitions)]
    t_arrays = time.perf_counter() - t0
    t1 = time.perf_counter()
    lookup = b.build_lookup()
    t_lookup = time.perf_counter() - t1
    meta = {
        "chunk_size": 1 << 20,
        "codecs": [{"id": "none"}, {"id": "zstd", "level": 3}],
        "partitions": [p.to_json() for p in parts],
        "counts": {"files": n_files, "dirs": n_dirs, "symlinks": 0,
                   "raw_bytes": int(sizes.sum()), "stored_bytes": int(per_part_stored.sum())},
        "pack": {"source": "synthetic", "partitions": partitions, "broadcast": [],
                 "chunk_size": 1 << 20, "tool": "tools/bench/mpi_bench.py _synth"},
    }
    t2 = time.perf_counter()
    data = encode_index(meta, b.entries, b.chunks, lookup, bytes(b.names), b"")
    t_encode = time.perf_counter() - t2
    return data, {"entries": n, "dirs": n_dirs, "partitions": partitions,
                  "names_bytes": len(b.names), "arrays_seconds": round(t_arrays, 3),
                  "lookup_seconds": round(t_lookup, 3), "encode_seconds": round(t_encode, 3),
                  "index_bytes": len(data), "index_bytes_per_entry": round(len(data) / n, 2)}


def _rss() -> tuple[int, int]:
    """(VmRSS, VmHWM) of this process in bytes."""
    rss = hwm = 0
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1]) * 1024
            elif line.startswith("VmHWM:"):
                hwm = int(line.split()[1]) * 1024
    return rss, hwm


def metadata_bytes(index) -> int:
    """The daemon's ``metadata_bytes`` (fanstore/daemon/node.py ``_static_stats``)."""
    memory = sum(a.nbytes for a in index.entries.values()) + sum(a.nbytes for a in index.chunks.values())
    memory += index.lk_hash.nbytes + index.lk_entry.nbytes + len(index.names)
    return memory + len(index.targets)


def main_synth(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="mpi_bench.py _synth")
    ap.add_argument("--files", type=int, required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--files-per-dir", type=int, default=1000)
    ap.add_argument("--partitions", type=int, default=512)
    a = ap.parse_args(argv)
    data, row = synth_index_bytes(a.files, a.files_per_dir, a.partitions)
    with open(a.out, "wb") as f:
        f.write(data)
    print(json.dumps(row), flush=True)
    return 0


def main_parse(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="mpi_bench.py _parse")
    ap.add_argument("--index", required=True)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--lookups", type=int, default=20000)
    a = ap.parse_args(argv)
    import gc

    import numpy as np

    from fanstore.format.index import read_index_bytes
    from fanstore.namespace import Namespace

    with open(a.index, "rb") as f:
        data = f.read()
    gc.collect()
    rss0, _ = _rss()
    t0 = time.perf_counter()
    index = read_index_bytes(data, where=a.index)
    t_parse = [time.perf_counter() - t0]
    rss1, _ = _rss()
    t0 = time.perf_counter()
    ns = Namespace(index)
    t_ns = [time.perf_counter() - t0]
    gc.collect()
    rss2, hwm = _rss()
    n = index.n_entries
    mem = metadata_bytes(index)
    # lookups of random existing paths (the FUSE LOOKUP path: one per component)
    rng = np.random.default_rng(1)
    files = index.file_entries()
    pick = rng.choice(files, size=min(a.lookups, len(files)), replace=False)
    paths = [index.path(int(e)) for e in pick]
    t0 = time.perf_counter()
    for p in paths:
        ns.resolve(p)
    t_lookup = (time.perf_counter() - t0) / max(1, len(paths))
    del ns, index
    for _ in range(a.reps - 1):
        gc.collect()
        t0 = time.perf_counter()
        index = read_index_bytes(data, where=a.index)
        t_parse.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        ns = Namespace(index)
        t_ns.append(time.perf_counter() - t0)
        del ns, index
    print(json.dumps({
        "entries": n, "index_bytes": len(data),
        "parse_seconds": round(statistics.median(t_parse), 4), "parse_all": [round(x, 4) for x in t_parse],
        "namespace_seconds": round(statistics.median(t_ns), 4),
        "parse_us_per_entry": round(statistics.median(t_parse) / n * 1e6, 3),
        "metadata_bytes": mem, "metadata_bytes_per_entry": round(mem / n, 1),
        "rss_index_bytes": rss1 - rss0, "rss_total_bytes": rss2 - rss0,
        "rss_bytes_per_entry": round((rss2 - rss0) / n, 1),
        "peak_rss_bytes": hwm, "lookup_us": round(t_lookup * 1e6, 2),
    }), flush=True)
    return 0


def main_bcast(argv: list[str]) -> int:
    """Under mpiexec: rank 0 reads the index; the daemon's own World.bcast_bytes sends it;
    every rank parses and validates it. Rank 0 prints one JSON line."""
    ap = argparse.ArgumentParser(prog="mpi_bench.py _bcast")
    ap.add_argument("--index", required=True)
    a = ap.parse_args(argv)
    from fanstore.daemon.world import World
    from fanstore.format.index import read_index_bytes

    world = World.from_mpi()
    data = None
    if world.rank == 0:
        with open(a.index, "rb") as f:
            data = f.read()
    world.all_ok(True)  # a barrier that does not spin
    t0 = time.perf_counter()
    data = world.bcast_bytes(data)
    t_bcast = time.perf_counter() - t0
    world.all_ok(True)
    t1 = time.perf_counter()
    index = read_index_bytes(data, where=a.index)
    t_parse = time.perf_counter() - t1
    world.all_ok(True)
    t_all = time.perf_counter() - t0
    mine = json.dumps({"rank": world.rank, "bcast": t_bcast, "parse": t_parse,
                       "all": t_all, "entries": index.n_entries}).encode()
    got = world.gather_bytes(mine)
    if world.rank == 0:
        rows = [json.loads(x) for x in got]
        print(json.dumps({
            "ranks": world.size, "bytes": len(data), "entries": index.n_entries,
            "bcast_seconds_max": round(max(r["bcast"] for r in rows), 4),
            "bcast_seconds": [round(r["bcast"], 4) for r in rows],
            "parse_seconds_max": round(max(r["parse"] for r in rows), 4),
            "load_seconds_max": round(max(r["all"] for r in rows), 4),
            "bcast_MB_per_s": round(len(data) / 1e6 / max(r["bcast"] for r in rows), 1),
        }), flush=True)
    world.comm.Free()
    world.MPI.Finalize()
    return 0


# ------------------------------------------------------------------------------ report


def section(bench: Bench, label: str | None, argv: list[str]) -> str:
    rows = bench.rows
    a = bench.a

    pick = functools.partial(common.pick_rows, rows)
    vals = functools.partial(common.row_vals, rows)

    out: list[str] = []
    w = out.append
    w("## FanStore across ranks: local vs remote, aggregate, stage-in, metadata "
      "(`tools/bench/mpi_bench.py`)")
    w("")
    if label:
        w(f"> **{label}**")
        w("")
    w(f"Run {bench.run_id} ({common.now_utc()}), {bench.total_seconds / 60:.1f} min in all. "
      "Every rank is a process of **this one 2-core machine**: \"remote\" means another "
      "daemon on the same machine reached through MPI (MPICH shared memory), not another "
      "node, and all ranks, readers and daemons share the same 2 cores and the same disk. "
      "Only compare rows of this one run (the machine is shared; cold passes spread by about "
      "±20%). Raw rows: `tools/bench/results/mpi_bench.jsonl`. Rerun: "
      f"`{' '.join(argv)}` (as root).")
    w("")
    w("### Machine")
    w("")
    w(bench.machine)
    w("")
    st = pick(kind="store")[0]
    p = st["params"]
    info = st["info"]
    counts = info.get("counts") or {}
    w("### Dataset and store")
    w("")
    w(f"`tools/gen_dataset.py` (seed {p['seed']}): {st['files']:,} files of "
      f"{p['min_kb']}-{p['max_kb']} kB in {p['classes']} class directories "
      f"({counts.get('raw_bytes', 0) / 1e6:,.0f} MB), packed with `--partitions "
      f"{p['partitions']} --codec {p['codec']}`: {counts.get('stored_bytes', 0) / 1e6:,.0f} MB "
      f"stored (ratio {info.get('ratio', 0):.2f}), index {info.get('index_bytes', 0):,} bytes. "
      "Partition p is placed on rank p mod n (`--replicas 1`). MB = 10^6 bytes.")
    w("")

    # ---- targets
    lr_rows = pick(kind="lr")
    ratios = {}
    for wk in a.lr_readers:
        loc = common.med(vals("files_per_s", kind="lr", which="local", workers=wk))
        rem = common.med(vals("files_per_s", kind="lr", which="remote", workers=wk))
        ratios[wk] = (loc, rem)
    w("### Target")
    w("")
    w("| target | readers | local files/s | remote files/s | remote / local | goal | status |")
    w("| --- | ---: | ---: | ---: | ---: | ---: | --- |")
    for wk, (loc, rem) in ratios.items():
        r = rem / loc if loc and rem else None
        w(f"| remote reads at least 0.7x local (rank 0's mount, {a.lr_ranks} ranks) | {wk} | "
          f"{common.num(loc)} | {common.num(rem)} | {common.ratio(rem, loc)} | ≥ 0.70 | "
          f"{common.check(None if r is None else r >= 0.7)} |")
    w("")

    # ---- local vs remote
    w(f"### Local vs remote reads (rank 0 of a {a.lr_ranks}-rank job)")
    w("")
    w("A fresh job per repetition and reader count. `local` = files whose partition rank 0 "
      "holds, `remote` = an equally large random sample of the files other ranks hold; each "
      "set read once through rank 0's mount, cold (page cache dropped before each set; the "
      "sets are disjoint, so the daemon's chunk cache holds nothing of the second), in "
      "alternating order. Reader processes take round-robin shares and do "
      "`open(); f.read(); close()` per file (`tools/bench/reader.py`). Cells: median "
      "(min–max) over the repetitions. CPU = whole machine. Remote latency = rank 0's "
      "`remote_latency_ms_p50/p99` (one MPI fetch of a file's stored bytes, in the daemon). "
      "Daemon CPU = CPU time of all the job's daemons per file read.")
    w("")
    w("| set | readers | files/pass | files/s | MB/s | p50 / p99 ms | CPU % | daemons' CPU µs/file "
      "| local / remote reads per pass | remote fetch p50 / p99 ms | vs local |")
    w("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for wk in a.lr_readers:
        loc_med = ratios[wk][0]
        for which in ("local", "remote"):
            q = dict(kind="lr", which=which, workers=wk)
            rs = pick(**q)
            if not rs:
                continue
            fs = vals("files_per_s", **q)
            d = [r.get("daemon0") or {} for r in rs]
            err = sum(r.get("errors") or 0 for r in rs)
            w(f"| {which}{' ⚠ %d errors' % err if err else ''} | {wk} | "
              f"{common.num(common.med([r.get('files') for r in rs]))} | {common.spread(fs)} | "
              f"{common.spread(vals('MB_per_s', **q))} | "
              f"{common.num(common.med(vals('lat_ms_p50', **q)), 2)} / "
              f"{common.num(common.med(vals('lat_ms_p99', **q)), 1)} | "
              f"{common.num(common.med(vals('cpu_busy_pct', **q)))} | "
              f"{common.num(common.med(vals('watched_cpu_us_per_file', **q)))} | "
              f"{common.num(common.med([x.get('local_reads') for x in d]))} / "
              f"{common.num(common.med([x.get('remote_reads') for x in d]))} | "
              + (f"{common.num(common.med(vals('remote_latency_ms_p50', **q)), 2)} / "
                 f"{common.num(common.med(vals('remote_latency_ms_p99', **q)), 1)}"
                 if which == "remote" else "–")
              + f" | {common.ratio(common.med(fs), loc_med)} |")
    w("")

    # ---- aggregate
    w("### Aggregate files/s with 1, 2 and 4 ranks")
    w("")
    w(f"A fresh job per rank count, readers per rank and repetition; every rank's mount read "
      f"at the same time, each rank a disjoint round-robin share of one shuffled list of all "
      f"{bench.n_small:,} files (a file is local to its reader's rank with probability 1/n), "
      "all reader processes released by one barrier; cold (caches dropped after the mount). "
      "**Caveat: on this 2-core machine every rank, daemon and reader competes for the same "
      "two cores and one disk, so more ranks cannot add throughput the way more nodes do**; "
      "the table shows the cost of the extra ranks and of remote reads, not the scaling of "
      "a cluster. CPU = whole machine during the pass.")
    w("")
    w("| ranks | readers per rank | files/s (total) | MB/s | p50 / p99 ms | CPU % | "
      "daemons' CPU µs/file | remote share of reads | vs 1 rank |")
    w("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for rpr in a.agg_readers:
        one = common.med(vals("files_per_s", kind="agg", ranks=1, rpr=rpr))
        for n in a.agg_ranks:
            q = dict(kind="agg", ranks=n, rpr=rpr)
            rs = pick(**q)
            if not rs:
                continue
            fs = vals("files_per_s", **q)
            share = common.med([r["remote_reads"] / max(1, r["remote_reads"] + r["local_reads"])
                                for r in rs if "remote_reads" in r])
            err = sum(r.get("errors") or 0 for r in rs)
            w(f"| {n}{' ⚠ %d errors' % err if err else ''} | {rpr} | {common.spread(fs)} | "
              f"{common.spread(vals('MB_per_s', **q))} | "
              f"{common.num(common.med(vals('lat_ms_p50', **q)), 2)} / "
              f"{common.num(common.med(vals('lat_ms_p99', **q)), 1)} | "
              f"{common.num(common.med(vals('cpu_busy_pct', **q)))} | "
              f"{common.num(common.med(vals('watched_cpu_us_per_file', **q)))} | "
              f"{'–' if share is None else f'{share:.0%}'} | {common.ratio(common.med(fs), one)} |")
    w("")

    # ---- stage-in
    w("### Stage-in vs `cp`")
    w("")
    w("Stage-in of the same jobs (caches dropped before each launch): each rank copies its "
      "own partitions from the store into its `--local-dir` (8 MiB reads, XXH3-128 checked "
      "while written, fsync, rename; `--stage-jobs 4`). `stage` = the ranks' "
      "`staged_bytes` summed over the slowest rank's `stage_seconds`; per rank = median of the "
      "ranks' own `stage_mb_per_s`. `cp` = one `cp` per rank of exactly that rank's "
      "partition files into a local directory, all ranks' `cp` at once, caches dropped first, "
      "in the same run (alternating before/after the job); `cp+sync` includes the final "
      "`sync` (staging fsyncs every file, plain `cp` does not). The store and the local "
      "directories are on the same disk here, so reads and writes share it, and \"cold\" is "
      "guest-cold: the host may still cache the virtual disk.")
    w("")
    w("| ranks | MB staged | stage MB/s (all ranks) | stage MB/s per rank | cp MB/s | "
      "cp+sync MB/s | stage / cp+sync | mount ready s |")
    w("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for n in a.agg_ranks:
        srs = pick(kind="stage", ranks=n)
        if not srs:
            continue
        agg = [r.get("agg_MB_per_s") for r in srs]
        per = [x.get("stage_mb_per_s") for r in srs for x in r["per_rank"]]
        cps = vals("MB_per_s", kind="cp", ranks=n)
        cps2 = vals("MB_per_s_with_sync", kind="cp", ranks=n)
        w(f"| {n} | {common.num(common.med([r['bytes'] / 1e6 for r in srs]))} | "
          f"{common.spread(agg)} | {common.num(common.med(per))} | {common.spread(cps)} | "
          f"{common.spread(cps2)} | {common.ratio(common.med(agg), common.med(cps2))} | "
          f"{common.spread([r.get('ready_seconds') for r in srs], 1)} |")
    w("")

    # ---- metadata
    w("### Metadata per entry")
    w("")
    per_entry = common.med([x.get("metadata_bytes_per_entry") for r in pick(kind="stage")
                            for x in r["per_rank"]])
    w(f"- Benchmark dataset ({counts.get('files', 0):,} files, {counts.get('dirs', 0):,} "
      f"directories): `fanstore info` says {info.get('index_bytes_per_entry', 0):.1f} B/entry "
      f"on disk (the compressed index) and {info.get('memory_bytes_per_entry', 0):.1f} B/entry "
      f"in memory; every rank's `fanstore stats` reports `metadata_bytes_per_entry` = "
      f"{common.num(per_entry, 1)} (the same arrays). Index broadcast in these jobs: "
      f"{common.spread([x.get('index_broadcast_seconds') for r in pick(kind='stage') for x in r['per_rank'] if r['ranks'] > 1], 4)} s "
      "(includes each rank's parse + validate of the received bytes).")
    synth = pick(kind="synth")
    parse = pick(kind="parse")
    if synth:
        w(f"- Synthetic namespaces (`mpi_bench.py _synth`): ImageNet-like names "
          f"(`n%08d/n%08d_%06d.JPEG`, {a.files_per_dir} files per directory), sizes 50-150 kB, "
          f"one chunk per file, {a.synth_partitions} partitions, random checksums; the index "
          "is built with the packer's `IndexBuilder` + `encode_index` without writing file "
          "data. Parse = `read_index_bytes` (zstd + parse + full validation), one process, "
          "median of 3; RSS = resident memory added by the loaded index + `Namespace` "
          "(measured in a fresh process); Ibcast = the daemon's `World.bcast_bytes` over "
          f"{a.bcast_ranks} ranks of this machine (shared memory), max over ranks, median over "
          f"{a.bcast_reps} runs; parse on all ranks = every rank validating at once (2 cores).")
        w("")
        w("| files | entries | index MB (disk) | B/entry disk | B/entry in memory (formula) | "
          "B/entry RSS | parse+validate s | µs/entry | Namespace s | lookup µs | build lookup "
          "table s | Ibcast s (4 ranks) | parse on all ranks s |")
        w("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
        for s in synth:
            nf = s["files"]
            pr = next((x for x in parse if x["files"] == nf), {})
            bc = pick(kind="bcast", files=nf)
            w(f"| {nf:,} | {s.get('entries', 0):,} | {s.get('index_bytes', 0) / 1e6:,.1f} | "
              f"{s.get('index_bytes_per_entry')} | {pr.get('metadata_bytes_per_entry')} | "
              f"{pr.get('rss_bytes_per_entry')} | {pr.get('parse_seconds')} | "
              f"{pr.get('parse_us_per_entry')} | {pr.get('namespace_seconds')} | "
              f"{pr.get('lookup_us')} | {s.get('lookup_seconds')} | "
              f"{common.num(common.med([b.get('bcast_seconds_max') for b in bc]), 3)} | "
              f"{common.num(common.med([b.get('parse_seconds_max') for b in bc]), 2)} |")
        w("")
    w(projection(bench, synth, parse))

    # ---- correctness / problems
    w("### Errors and problems seen in this run")
    w("")
    errs = [r for r in rows if r.get("errors") and r.get("kind") in ("lr", "agg")]
    w(f"- read errors during the measurements: {sum(r['errors'] for r in errs)}"
      + (f" (first: {errs[0].get('first_error')})" if errs else ""))
    for r in rows:
        if r.get("daemon_died"):
            w(f"- **a daemon died during {r['kind']} n={r.get('ranks')} rep={r.get('rep')}**: "
              f"{(r.get('log_tail') or '').strip()[-300:]}")
        if r.get("error"):
            w(f"- {r['kind']}: {r['error'][:300]}")
    w("")
    w("### Exact commands")
    w("")
    w("```")
    w("# drop_caches = sync; echo 3 > /proc/sys/vm/drop_caches (before every launch, every "
      "cp and every read pass)")
    w("# WORK = the work directory; JOB = WORK/jobs/<job>; ROOT = JOB/mnt0 (local vs remote) "
      "or JOB (aggregate: the list holds mnt<rank>/<path>)")
    for c in bench.commands:
        w(c.replace(common.REPO + "/", ""))
    w("```")
    return "\n".join(out)


def projection(bench: Bench, synth: list[dict], parse: list[dict]) -> str:
    a = bench.a
    out: list[str] = []
    w = out.append
    nodes, nfiles = a.proj_nodes, a.proj_files
    # per-entry numbers from the largest synthetic namespace measured
    if synth and parse:
        s = max(synth, key=lambda r: r["files"])
        pr = next((x for x in parse if x["files"] == s["files"]), {})
        bc = [b for b in bench.rows if b.get("kind") == "bcast" and b.get("files") == s["files"]]
        basis = f"the {s['files']:,}-file synthetic namespace"
        disk_pe = s["index_bytes"] / s["entries"]
        mem_pe = pr.get("metadata_bytes_per_entry") or 0
        rss_pe = pr.get("rss_bytes_per_entry") or mem_pe
        parse_pe = (pr.get("parse_seconds") or 0) / s["entries"]
        ns_pe = (pr.get("namespace_seconds") or 0) / s["entries"]
        lookup_pe = (s.get("lookup_seconds") or 0) / s["entries"]
        bc_rate = common.med([b.get("bcast_MB_per_s") for b in bc])
    else:
        return "(no metadata measurements in this run: no projection)\n"
    entries = nfiles * (1 + 1 / a.files_per_dir) + 1
    idx_bytes = disk_pe * entries
    mem = mem_pe * entries
    rss = rss_pe * entries
    net = a.proj_net_gbps * 1e9 / 8  # bytes/s per link
    steps = math.ceil(math.log2(nodes))
    t_tree = steps * idx_bytes / net
    t_pipe = 2 * idx_bytes / net
    t_parse = parse_pe * entries
    t_ns = ns_pe * entries
    t_read = idx_bytes / (a.proj_pfs_stream_gbs * 1e9)
    stored = a.proj_raw_tb * 1e12 / a.proj_ratio
    agg_fps = [r for r in bench.rows if r.get("kind") == "agg" and r.get("ranks") == 1
               and r.get("watched_cpu_us_per_file")]
    daemon_us = common.med([r["watched_cpu_us_per_file"] for r in agg_fps])
    # A remote read costs daemon CPU on both sides (all of the job's daemons are watched).
    remote_us = common.med([r["watched_cpu_us_per_file"] for r in bench.rows
                            if r.get("kind") == "lr" and r.get("which") == "remote"
                            and r.get("watched_cpu_us_per_file") and not r.get("errors")])
    remote_ms = common.med([r.get("remote_latency_ms_p50") for r in bench.rows
                            if r.get("kind") == "lr" and r.get("which") == "remote"
                            and r.get("workers") == 1 and r.get("remote_latency_ms_p50")])

    w(f"### Projection: {nodes} nodes, {nfiles / 1e6:.0f} million files (an extrapolation)")
    w("")
    w(f"**Everything here is extrapolated linearly** from {basis} measured above (per-entry "
      "costs), plus the stated assumptions; nothing was run at this scale. Assumptions: "
      f"{a.files_per_dir} files per directory ({entries / 1e6:,.2f} M entries); a "
      f"{a.proj_net_gbps:g} Gb/s fabric ({net / 1e9:.1f} GB/s per link, latency ignored); "
      f"rank 0 reads the index from the PFS at {a.proj_pfs_stream_gbs:g} GB/s (one stream); "
      f"a dataset of {a.proj_raw_tb:g} TB raw stored at ratio {a.proj_ratio:g} "
      f"({stored / 1e12:g} TB of partitions); node-local NVMe writing {a.proj_nvme_gbs:g} GB/s; "
      f"the PFS delivering {a.proj_pfs_gbs:g} GB/s in aggregate to all nodes together.")
    w("")
    w("| quantity | per node | how |")
    w("| --- | ---: | --- |")
    w(f"| metadata in memory | {mem / 2**30:,.2f} GiB ({rss / 2**30:,.2f} GiB resident) | "
      f"{mem_pe:.1f} B/entry (`metadata_bytes_per_entry`) or {rss_pe:.1f} B/entry RSS x "
      f"{entries / 1e6:,.2f} M entries; every node holds the whole namespace |")
    w(f"| index size (compressed, broadcast) | {idx_bytes / 1e6:,.0f} MB | {disk_pe:.1f} B/entry "
      "on disk |")
    w(f"| transient memory while loading | about {(idx_bytes * 2 + mem) / 2**30:,.2f} GiB | "
      "the received bytes (held twice: the receive buffer and its `bytes` copy in "
      "`World.bcast_bytes`) + the decompressed body |")
    w(f"| index read by rank 0 | {t_read:,.1f} s | {idx_bytes / 1e6:,.0f} MB at "
      f"{a.proj_pfs_stream_gbs:g} GB/s |")
    w(f"| broadcast, binomial tree | {t_tree:,.2f} s | ceil(log2 {nodes}) = {steps} steps x "
      f"size / link bandwidth |")
    w(f"| broadcast, pipelined (scatter + allgather) | {t_pipe:,.2f} s | about 2 x size / link "
      f"bandwidth (what MPI libraries use for large messages); here, shared memory: "
      f"{common.num(bc_rate)} MB/s |")
    w(f"| parse + validate (single thread) | {t_parse:,.1f} s, twice | {parse_pe * 1e6:.2f} "
      "µs/entry; rank 0 validates before sending, then every rank after receiving, so it is "
      "on the start-up path twice |")
    w(f"| `Namespace` build | {t_ns:,.2f} s | {ns_pe * 1e9:.0f} ns/entry |")
    w(f"| start-up before staging | about {t_read + 2 * t_parse + t_ns + t_tree:,.0f} s "
      f"(tree) / {t_read + 2 * t_parse + t_ns + t_pipe:,.0f} s (pipelined) | read + parse "
      "(rank 0) + broadcast + parse (all) + Namespace |")
    w(f"| building the lookup table at pack time | {lookup_pe * entries:,.0f} s | "
      f"`IndexBuilder.build_lookup` is a Python loop: {lookup_pe * 1e6:.2f} µs/entry "
      "(pack time, once) |")
    for r in (1, 2):
        share = r * stored / nodes
        t_nvme = share / (a.proj_nvme_gbs * 1e9)
        t_pfs = r * stored / (a.proj_pfs_gbs * 1e9)
        w(f"| stage-in, `--replicas {r}` | {share / 1e9:,.1f} GB, "
          f"{max(t_nvme, t_pfs):,.0f} s | per-node share = {r} x {stored / 1e12:g} TB / "
          f"{nodes}; NVMe alone {t_nvme:,.0f} s; the PFS must deliver {r * stored / 1e12:g} TB: "
          f"{t_pfs:,.0f} s at {a.proj_pfs_gbs:g} GB/s; the larger wins |")
    per_node_files = nfiles / nodes
    w(f"| files read per node per epoch | {per_node_files:,.0f} | {nfiles / 1e6:.0f} M / "
      f"{nodes}; {1 - 1 / nodes:.1%} of them remote with a random shuffle and one replica |")
    if remote_us:
        w(f"| daemon CPU per epoch | {per_node_files * remote_us / 1e6:,.1f} core-s | "
          f"{remote_us:,.0f} µs of daemon CPU per remote file read, reader and server side "
          "together (local-vs-remote table, cold, this machine)"
          + (f"; {daemon_us:,.0f} µs for a local read (1-rank aggregate)" if daemon_us else "")
          + " |")
    elif daemon_us:
        w(f"| daemon CPU per epoch | {per_node_files * daemon_us / 1e6:,.1f} core-s | "
          f"{daemon_us:,.0f} µs of daemon CPU per file (1-rank aggregate pass above, cold, "
          "this machine) |")
    w("")
    w("What limits it:")
    w("")
    w(f"- **PFS aggregate bandwidth during stage-in.** {nodes} nodes x "
      f"{a.proj_nvme_gbs:g} GB/s of NVMe could absorb {nodes * a.proj_nvme_gbs / 1e3:g} TB/s, "
      f"but all of it comes from the shared file system: at {a.proj_pfs_gbs:g} GB/s stage-in "
      f"takes {stored / (a.proj_pfs_gbs * 1e9):,.0f} s per replica however many nodes there "
      "are. Staging is one sequential pass with large reads, which is the best case for a "
      "PFS; replicas multiply it (a replica could instead be copied node to node over the "
      "fabric, which FanStore does not do).")
    w(f"- **Index parse + validate is single-threaded** ({parse_pe * 1e6:.2f} µs/entry: "
      f"{t_parse:,.0f} s at {nfiles / 1e6:.0f} M files, paid by rank 0 before the broadcast "
      "and by every rank after it) and the broadcast cannot start before rank 0 finishes. "
      "It is numpy-vectorised; decompression (one zstd frame) is serial.")
    w(f"- **Metadata memory**: {mem / 2**30:,.1f}-{rss / 2**30:,.1f} GiB on every node for "
      f"{nfiles / 1e6:.0f} M files, plus the transient copies while loading; it competes "
      "with the training job's host memory and grows linearly with the file count, not with "
      "the node count.")
    w("- **MPI_THREAD_MULTIPLE contention**: every remote read is an MPI request/response "
      "from one of the daemon's remote-fetch threads, and one server thread answers all "
      "peers. At 512 nodes almost every read is remote, so per-node files/s is bounded by "
      "the server thread (one thread, its Python per-request cost) and the MPI library's "
      "internal locking under THREAD_MULTIPLE; polling with back-off (no busy waits) adds "
      "up to the back-off step of latency per message"
      + (f" (measured here: a remote fetch of one file's stored bytes takes {remote_ms:.2f} ms "
         "at the median over shared memory, with one reader)" if remote_ms else "") + ".")
    w("- **Per-file FUSE cost**: every file costs LOOKUP + OPEN + READ(s) + RELEASE in the "
      "kernel and the daemon" + (f" ({daemon_us:,.0f} µs of daemon CPU per file here, cold)"
         if daemon_us else "") + "; the Python API (`fanstore.open_store`) avoids it.")
    w("")
    return "\n".join(out)


# ------------------------------------------------------------------------------ main


def _ints(text: str) -> list[int]:
    return [int(x) for x in str(text).split(",") if x.strip()]


def parse_args(argv: list[str] | None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="full",
                    help="dataset size and repetitions (default full); options below override")
    ap.add_argument("--work", default=os.environ.get("FANSTORE_MPIBENCH_WORK",
                                                     "/tmp/fanstore-mpibench"),
                    help="work directory: dataset, store, jobs (default /tmp/fanstore-mpibench)")
    ap.add_argument("--files", type=int, help="small files in the dataset")
    ap.add_argument("--classes", type=int, help="class directories")
    ap.add_argument("--min-kb", type=int, default=50)
    ap.add_argument("--max-kb", type=int, default=150)
    ap.add_argument("--seed", type=int, default=20240601, help="dataset seed")
    ap.add_argument("--codec", default="zstd:3")
    ap.add_argument("--partitions", type=int, help="store partitions")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="fanstore pack --jobs")
    ap.add_argument("--phases", default="lr,agg,meta",
                    help="which parts to run: lr (local vs remote), agg (aggregate + stage-in), "
                         "meta (metadata at scale); default all")
    ap.add_argument("--lr-ranks", type=int, help="ranks of the local-vs-remote jobs")
    ap.add_argument("--lr-readers", default="1,4", help="reader processes (default 1,4)")
    ap.add_argument("--lr-reps", type=int, help="local-vs-remote repetitions")
    ap.add_argument("--agg-ranks", help="rank counts of the aggregate jobs (default 1,2,4)")
    ap.add_argument("--agg-readers", help="reader processes per rank")
    ap.add_argument("--agg-reps", type=int, help="aggregate repetitions")
    ap.add_argument("--meta-files", help="synthetic namespace sizes (comma separated)")
    ap.add_argument("--files-per-dir", type=int, default=1000)
    ap.add_argument("--synth-partitions", type=int, default=512)
    ap.add_argument("--bcast-ranks", type=int, default=4)
    ap.add_argument("--bcast-reps", type=int)
    ap.add_argument("--keep-synth", action="store_true", help="keep the synthetic index files")
    ap.add_argument("--pass-limit", type=float, default=600.0,
                    help="seconds after which a read pass is cut short (default 600)")
    g = ap.add_argument_group("projection assumptions")
    g.add_argument("--proj-nodes", type=int, default=512)
    g.add_argument("--proj-files", type=float, default=10e6)
    g.add_argument("--proj-net-gbps", type=float, default=100.0, help="link speed, Gb/s")
    g.add_argument("--proj-nvme-gbs", type=float, default=2.0, help="NVMe write GB/s per node")
    g.add_argument("--proj-pfs-gbs", type=float, default=100.0, help="PFS aggregate GB/s")
    g.add_argument("--proj-pfs-stream-gbs", type=float, default=1.0,
                   help="PFS GB/s of one stream (rank 0 reading the index)")
    g.add_argument("--proj-raw-tb", type=float, default=10.0)
    g.add_argument("--proj-ratio", type=float, default=2.0)
    ap.add_argument("--reuse-store", action="store_true",
                    help="keep an existing store packed with the same parameters")
    ap.add_argument("--label", help="a note shown at the top of the docs section")
    ap.add_argument("--docs", default=common.DOCS)
    ap.add_argument("--results", default=os.path.join(common.RESULTS_DIR, "mpi_bench.jsonl"))
    ap.add_argument("--no-docs", action="store_true", help="do not touch --docs / --results")
    ap.add_argument("--fanstore", help="the fanstore command (default: next to this python)")
    ap.add_argument("--mpiexec", help="mpiexec (default: next to this python)")
    ap.add_argument("--clean", action="store_true", help="delete the work directory at the end")
    a = ap.parse_args(argv)
    for key, value in PRESETS[a.preset].items():
        if getattr(a, key, None) is None:
            setattr(a, key, value)
    a.lr_readers = _ints(a.lr_readers)
    a.agg_ranks = _ints(a.agg_ranks)
    a.agg_readers = _ints(a.agg_readers)
    a.meta_files = _ints(a.meta_files)
    a.phases = {x.strip() for x in a.phases.split(",") if x.strip()}
    if a.label is None and a.preset == "quick":
        a.label = ("SMOKE RUN (--preset quick: small dataset, one repetition of most cells, on a "
                   "machine shared with other jobs and test suites): it shows the harness works "
                   "end to end; the numbers are not results. Run `--preset full` on a quiet "
                   "machine for real numbers.")
    return a


def main(argv: list[str] | None = None) -> int:
    raw_argv = sys.argv[1:] if argv is None else argv
    if raw_argv and raw_argv[0] in ("_synth", "_parse", "_bcast"):
        return {"_synth": main_synth, "_parse": main_parse, "_bcast": main_bcast}[raw_argv[0]](
            raw_argv[1:])
    a = parse_args(raw_argv)
    if os.geteuid() != 0:
        print("mpi_bench: run as root (drop_caches and FUSE mounts)", file=sys.stderr)
        return 2
    bench = Bench(a)
    ok = common.guarded_run(bench, log, lambda: [
        ln.split()[1] for ln in open("/proc/self/mounts")
        if len(ln.split()) > 1 and ln.split()[1].startswith(bench.work + "/")],
        doing="stopping jobs and cleaning up")
    return common.publish(ok, bench, a, log, SECTION, section, "tools/bench/mpi_bench.py",
                          raw_argv)


if __name__ == "__main__":
    sys.exit(main())
