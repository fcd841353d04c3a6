#!/usr/bin/env python3
"""N nodes of K ranks on one machine: start-up, memory, idle cost, a remote read storm,
and how the job ends (one SIGTERM to the launcher, a SIGKILL of it or of one daemon).

Every shape (``--shapes 16x1,64x1,...``: N nodes of K ranks, one machine simulating
the nodes with ``--ranks-per-node K``) is a real job ``mpiexec -n N*K fanstore mount
STORE WORK/mnt{rank} --local-dir WORK/local{rank} --ranks-per-node K --workers 1``. Per
shape:

  start   seconds until every node's runtime state says ready; each rank's CPU seconds by
          then (daemons, worker ranks, frontend processes); what each daemon received in
          the start-up's layout and gates (``startup_received_*`` of its stats; the index
          broadcast apart) and the index bytes.
  memory  PSS per rank and per node, with /dev/shm counted whole once (the index copy and
          MPI's segments: a tmpfs page is memory of the node whoever maps it); the
          processes' PSS of shared memory is left out so that nothing is counted twice.
  idle    CPU of every process of the job over ``--idle`` seconds, per rank.
  storm   ``--storm-nodes`` nodes (spread over the job) each read ``--storm-files`` files
          that other nodes hold, all at once, compared with the source byte for byte.
  stop    one SIGTERM to mpiexec: seconds until no process, mount, staged file or index
          copy of the job is left.

``--kills`` runs, per listed shape, a SIGKILL of mpiexec and a SIGKILL of one daemon,
each ``--kill-after`` seconds into the start: seconds until nothing is left.

Oversubscribed ranks on a 2-core machine: rates and seconds here are of this machine; the
per-rank CPU and bytes are what project to a real cluster (docs/benchmarks.md, "512 nodes").

    .venv/bin/python tools/bench/nodes_bench.py --shapes 16x1,64x1,128x1,256x1,128x2,128x4
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness as h  # noqa: E402
from harness import log  # noqa: E402


def shm_files() -> dict[str, int]:
    """/dev/shm files of FanStore and MPICH: name -> bytes."""
    out = {}
    for name in os.listdir("/dev/shm"):
        if name.startswith(("fanstore-", "mpich_shm_")):
            try:
                out[name] = os.stat(os.path.join("/dev/shm", name)).st_size
            except OSError:
                pass
    return out


def _median(values: list[int]) -> int:
    """The middle value (the upper one of an even count); 0 for none."""
    return sorted(values)[len(values) // 2] if values else 0


def ppid(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def private_pss(pid: int) -> int:
    """PSS of ``pid`` less its share of shared-memory (tmpfs) pages, in bytes."""
    pss = shmem = 0
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    pss = int(line.split()[1]) * 1024
                elif line.startswith("Pss_Shmem:"):
                    shmem = int(line.split()[1]) * 1024
    except OSError:
        return 0
    return pss - shmem


def job_pids(work: str) -> list[int]:
    """Live processes of a job whose command line names ``work``, with their children
    (the kernel frontend's processes name no path)."""
    roots = []
    needle = work.encode()
    for name in os.listdir("/proc"):
        if name.isdigit() and int(name) != os.getpid():
            try:
                with open(f"/proc/{name}/cmdline", "rb") as f:
                    if needle in f.read():
                        roots.append(int(name))
            except OSError:
                pass
    out = set()
    for pid in roots:
        out.update(h.descendants(pid))
    return sorted(p for p in out if h.pid_alive(p))


class NodesBench(h.Bench):
    name = "nodes_bench"

    def __init__(self, a: argparse.Namespace) -> None:
        super().__init__(a)
        self.data, self.small, gen = h.ensure_dataset(self.work, a.files, a.classes,
                                                      a.min_kb, a.max_kb)
        self.cmd(gen)
        self.info, packed = h.pack_store(self.fanstore, self.data, self.store, a.partitions,
                                         a.codec, 2, True)
        self.cmd(packed)

    # -------------------------------------------------------------- one job
    def job(self, nodes: int, per_node: int, tag: str, extra: list[str] = ()) -> h.Job:
        job = h.Job(self, nodes, tag, ["--workers", "1", *extra], per_node=per_node)
        self.cmd(job.shown())
        return job

    def popen(self, job: h.Job) -> None:
        """Start ``job``'s mpiexec in a session of its own, without waiting for anything
        (harness.Job.start waits with ``fanstore wait`` per node: too slow at 256)."""
        import shutil

        shutil.rmtree(job.dir, ignore_errors=True)
        for r in range(job.ranks):
            os.makedirs(job.mnt(r), exist_ok=True)
        self.jobs.append(job)
        job._logf = open(job.log_path, "ab")
        job.proc = subprocess.Popen(job.argv(), stdout=job._logf, stderr=subprocess.STDOUT,
                                    env=job.env, start_new_session=True)

    def launch(self, job: h.Job) -> float:
        """Start ``job`` and return the seconds until every node's state says ready."""
        t0 = time.perf_counter()
        self.popen(job)
        from fanstore import runtime

        waiting = set(range(job.ranks))
        deadline = time.monotonic() + self.a.start_limit
        while waiting:
            if time.monotonic() > deadline or job.proc.poll() is not None:
                raise RuntimeError(f"nodes {sorted(waiting)[:10]} not ready "
                                   f"(mpiexec {job.proc.poll()}): {job.output()[-600:]}")
            for r in list(waiting):
                if (runtime.read_state(job.mnt(r)) or {}).get("phase") == "ready":
                    waiting.discard(r)
            time.sleep(0.5)
        seconds = time.perf_counter() - t0
        job._remember_pids()
        return seconds

    def roles(self, job: h.Job) -> dict[int, str]:
        """pid -> daemon / worker / frontend / shim for every process of the job (a shim:
        the process hydra started, which forked the rank after its imports)."""
        from fanstore import runtime

        out = {}
        for r in range(job.ranks):
            state = runtime.read_state(job.mnt(r)) or {}
            pid = state.get("pid")
            if pid:
                for p in h.descendants(pid):
                    out[p] = "frontend"
                out[pid] = "daemon"
            for p in state.get("worker_pids", []):
                out[p] = "worker"
        mine = set(job_pids(job.dir))
        for pid in [p for p, role in out.items() if role in ("daemon", "worker")]:
            parent = ppid(pid)
            if parent and parent in mine and parent not in out:
                out[parent] = "shim"
        return out

    # -------------------------------------------------------------- phases
    def shape(self, nodes: int, per_node: int) -> None:
        before = set(shm_files())
        job = self.job(nodes, per_node, f"{nodes}x{per_node}")
        row = {"kind": "shape", "nodes": nodes, "per_node": per_node,
               "ranks": nodes * per_node}
        try:
            row["ready_s"] = round(self.launch(job), 1)
        except RuntimeError as exc:
            row["error"] = str(exc)[-400:]
            self.emit(row)
            log(f"  {nodes}x{per_node}: {row['error']}")
            job.stop()
            return
        roles = self.roles(job)
        row.update(self.start_costs(job, roles))
        row.update(self.memory(roles, before, nodes))
        row.update(self.idle(roles, nodes * per_node))
        row.update(self.storm(job, nodes))
        row.update(self.stop(job, nodes, before))
        self.emit(row)
        log(f"  {nodes}x{per_node}: ready {row['ready_s']} s, start CPU "
            f"{row['start_cpu_s_daemon']} s/daemon, received {row['received_bytes_max']} B, "
            f"node {row['node_mb']} MB, idle {row['idle_pct_per_rank']}%/rank, storm "
            f"{row['storm_files']} files {row['storm_mismatches']} wrong, stopped in "
            f"{row['stop_s']} s, left {row['left']}")

    def start_costs(self, job: h.Job, roles: dict[int, str]) -> dict:
        """CPU seconds of each rank by the time all were ready (its shim's included: the
        imports ran there before the fork), averaged by role."""
        by_role: dict[str, list[float]] = {}
        for pid, role in roles.items():
            if role == "shim":
                continue
            cpu = h.proc_cpu(pid) or 0.0
            parent = ppid(pid)
            if roles.get(parent) == "shim":
                cpu += h.proc_cpu(parent) or 0.0
            by_role.setdefault(role, []).append(cpu)
        out = {f"start_cpu_s_{role}": round(sum(v) / len(v), 3) for role, v in by_role.items()}
        received, messages = [], []
        for r in range(job.ranks):
            stats = job.stats(r) or {}
            received.append(stats.get("startup_received_bytes", 0))
            messages.append(stats.get("startup_received_messages", 0))
        out.update(received_bytes_max=max(received), received_bytes_node0=received[0],
                   received_bytes_other_median=_median(received[1:]),
                   received_messages_other=_median(messages[1:]),
                   received_messages_max=max(messages), received_messages_node0=messages[0],
                   index_bytes=self.info.get("index_bytes"))
        return out

    def memory(self, roles: dict[int, str], before: set[str], nodes: int) -> dict:
        pss = {role: [] for role in ("daemon", "worker", "frontend", "shim")}
        for pid, role in roles.items():
            pss[role].append(private_pss(pid))
        shm = sum(size for name, size in shm_files().items() if name not in before)
        total = sum(sum(v) for v in pss.values()) + shm
        out = {f"pss_mb_{role}": round(sum(v) / len(v) / 1e6, 1) for role, v in pss.items()
               if v}
        out.update(shm_mb=round(shm / 1e6, 1), node_mb=round(total / nodes / 1e6, 1),
                   processes=len(roles))
        return out

    def idle(self, roles: dict[int, str], ranks: int) -> dict:
        pids = list(roles)
        cpu0, t0 = h.cpu_seconds(pids), time.perf_counter()
        time.sleep(self.a.idle)
        spent = h.cpu_seconds(pids) - cpu0
        return {"idle_pct_per_rank": round(100 * spent / (time.perf_counter() - t0) / ranks, 3)}

    def storm(self, job: h.Job, nodes: int) -> dict:
        """Sampled nodes read files other nodes hold, all at once; bytes compared."""
        held = h.placement_sets(self.store, nodes)
        picks = sorted(set(range(0, nodes, max(1, nodes // self.a.storm_nodes))))
        rng = random.Random(nodes)
        results = {"files": 0, "wrong": 0, "errors": 0}
        lock = threading.Lock()

        def read(node: int) -> None:
            others = [f for n, files in held.items() if n != node for f in files]
            files = rng.sample(others, min(self.a.storm_files, len(others)))
            wrong = errors = 0
            for rel in files:
                try:
                    with open(os.path.join(job.mnt(node), rel), "rb") as f:
                        got = f.read()
                except OSError:
                    errors += 1
                    continue
                with open(os.path.join(self.data, rel), "rb") as f:
                    wrong += got != f.read()
            with lock:
                results["files"] += len(files)
                results["wrong"] += wrong
                results["errors"] += errors

        t0 = time.perf_counter()
        threads = [threading.Thread(target=read, args=(n,)) for n in picks]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - t0
        return {"storm_nodes": len(picks), "storm_files": results["files"],
                "storm_mismatches": results["wrong"], "storm_errors": results["errors"],
                "storm_files_per_s": round(results["files"] / wall)}

    def leftovers(self, job: h.Job, nodes: int, before: set[str]) -> dict:
        return {"processes": len(job_pids(job.dir)),
                "mounts": sum(h.is_mounted(job.mnt(r)) for r in range(nodes)),
                "local": sum(os.path.exists(os.path.join(job.dir, f"local{r}"))
                             for r in range(nodes)),
                "copies": len([n for n in shm_files() if n.startswith("fanstore-")
                               and n not in before])}

    def until_clean(self, job: h.Job, nodes: int, before: set[str], t0: float,
                    limit: float) -> tuple[float | None, dict]:
        while time.perf_counter() - t0 < limit:
            left = self.leftovers(job, nodes, before)
            if not any(left.values()):
                return round(time.perf_counter() - t0, 1), left
            time.sleep(0.5)
        return None, self.leftovers(job, nodes, before)

    def stop(self, job: h.Job, nodes: int, before: set[str]) -> dict:
        """One SIGTERM to mpiexec: seconds until nothing is left, and the machine's busy
        core-seconds meanwhile per node (what a node's stop costs: on 2 cores N nodes'
        stops queue behind each other)."""
        cpu0 = h.machine_cpu()
        t0 = time.perf_counter()
        os.kill(job.proc.pid, signal.SIGTERM)
        seconds, left = self.until_clean(job, nodes, before, t0, self.a.stop_limit)
        cpu1 = h.machine_cpu()
        busy = None
        if cpu0 and cpu1:
            busy = ((cpu1[0] - cpu0[0]) - (cpu1[1] - cpu0[1])) / os.sysconf("SC_CLK_TCK")
        job.proc.wait(30)
        out = {"stop_s": seconds, "left": left, "mpiexec_rc": job.proc.returncode,
               "stop_cpu_s_per_node": round(busy / nodes, 3) if busy is not None else None}
        job.stop()
        return out

    def kill(self, nodes: int, per_node: int, victim: str) -> None:
        """SIGKILL of mpiexec (``launcher``) or of node 1's daemon (``daemon``) after
        ``--kill-after`` seconds of the start."""
        before = set(shm_files())
        job = self.job(nodes, per_node, f"kill-{victim}-{nodes}x{per_node}")
        self.popen(job)
        time.sleep(self.a.kill_after)
        from fanstore import runtime

        phases = [(runtime.read_state(job.mnt(r)) or {}).get("phase") for r in range(nodes)]
        if victim == "launcher":
            os.kill(job.proc.pid, signal.SIGKILL)
        else:  # node 1's daemon, once it has said it is starting (a live pid)
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                pid = (runtime.read_state(job.mnt(1)) or {}).get("pid")
                if pid and h.pid_alive(pid):
                    os.kill(pid, signal.SIGKILL)
                    break
                time.sleep(0.05)
            phases = [(runtime.read_state(job.mnt(r)) or {}).get("phase")
                      for r in range(nodes)]
        t0 = time.perf_counter()
        seconds, left = self.until_clean(job, nodes, before, t0, self.a.stop_limit)
        row = {"kind": "kill", "victim": victim, "nodes": nodes, "per_node": per_node,
               "after_s": self.a.kill_after,
               "phases": {p: phases.count(p) for p in set(phases)},
               "clean_s": seconds, "left": left,
               "messages": sorted({ln.split("error: ", 1)[1][:160] for ln in
                                   job.output().splitlines() if "fanstore: error:" in ln})[:3]}
        self.emit(row)
        log(f"  SIGKILL {victim} at {self.a.kill_after} s of {nodes}x{per_node}: clean in "
            f"{seconds} s, left {left}")
        job.stop()

    def run(self) -> None:
        for spec in h.words(self.a.shapes):
            n, k = (int(x) for x in spec.split("x"))
            self.shape(n, k)
        for spec in h.words(self.a.kills or ""):
            n, k = (int(x) for x in spec.split("x"))
            self.kill(n, k, "launcher")
            self.kill(n, k, "daemon")


def fit(rows: list[dict], key: str) -> tuple[float, float] | None:
    """Least squares ``value = a + b * nodes`` over ``rows``; None with fewer than 2."""
    pts = [(r["nodes"], r[key]) for r in rows if r.get(key) is not None]
    if len(pts) < 2:
        return None
    n = len(pts)
    mx, my = sum(p[0] for p in pts) / n, sum(p[1] for p in pts) / n
    sxx = sum((p[0] - mx) ** 2 for p in pts)
    b = sum((p[0] - mx) * (p[1] - my) for p in pts) / sxx if sxx else 0.0
    return my - b * mx, b


def render(bench: NodesBench, label: str, argv: list[str]) -> str:
    rows = bench.pick(kind="shape")
    ok = [r for r in rows if "error" not in r]
    out = [f"{len(bench.small):,} files of {bench.a.min_kb}-{bench.a.max_kb} kB in "
           f"{bench.a.partitions} partitions ({bench.a.codec}); every node `--workers 1`; "
           f"N nodes of K ranks on this 2-core machine (`--ranks-per-node K`)."]
    out.append(h.table(
        ["N x K", "ranks", "ready s", "start CPU s / daemon", "/ worker rank",
         "received B: node 0 (other daemons)", "msgs: node 0 (others)", "PSS MB / daemon", "/ worker rank",
         "/ frontend", "/ shim", "/dev/shm MB (whole)", "node MB", "idle % core / rank",
         "storm files (wrong, errors)", "SIGTERM: clean s", "stop CPU s / node", "left",
         "error"],
        [(f"{r['nodes']}x{r['per_node']}", r["ranks"], r.get("ready_s"),
          r.get("start_cpu_s_daemon"), r.get("start_cpu_s_worker", "-"),
          f"{r.get('received_bytes_node0', '-')} ({r.get('received_bytes_other_median', '-')})",
          f"{r.get('received_messages_node0', '-')} ({r.get('received_messages_other', '-')})",
          r.get("pss_mb_daemon"), r.get("pss_mb_worker", "-"), r.get("pss_mb_frontend", "-"),
          r.get("pss_mb_shim", "-"), r.get("shm_mb"), r.get("node_mb"), r.get("idle_pct_per_rank"),
          f"{r.get('storm_files')} ({r.get('storm_mismatches')}, {r.get('storm_errors')})",
          r.get("stop_s"), r.get("stop_cpu_s_per_node", "-"), json.dumps(r.get("left")),
          r.get("error", "")[:80])
         for r in rows]))
    kills = bench.pick(kind="kill")
    if kills:
        out.append(h.table(
            ["SIGKILL of", "N x K", "after s", "phases then", "clean s", "left",
             "what the nodes said"],
            [(r["victim"], f"{r['nodes']}x{r['per_node']}", r["after_s"],
              json.dumps(r["phases"]), r["clean_s"], json.dumps(r["left"]),
              " / ".join(r["messages"])) for r in kills]))
    ones = [r for r in ok if r["per_node"] == 1]
    fits = []
    for key, what in (("start_cpu_s_daemon", "start CPU s per daemon"),
                      ("received_bytes_max", "bytes received per daemon"),
                      ("received_bytes_node0", "bytes received by node 0"),
                      ("node_mb", "node MB"), ("idle_pct_per_rank", "idle % core per rank")):
        f = fit(ones, key)
        if f:
            a, b = f
            fits.append((what, h.num(a, 3), h.num(b, 5), h.num(a + b * 512, 3),
                         h.num(a + b * 4096, 3)))
    if fits:
        out.append(h.table(["one-rank nodes: cost", "a (fixed)", "b (per node)", "N = 512",
                            "N = 4,096"], fits,
                           title="Linear fits a + b·N over the one-rank shapes"))
    return h.section(bench, label, argv, out)


def main(argv: list[str] | None = None) -> int:
    raw = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    h.args(p, "nodes_bench", "/work/nodes")
    p.add_argument("--shapes", default="16x1,64x1,128x1,256x1,128x2,128x4",
                   help="N x K shapes to run, in this order")
    p.add_argument("--kills", default="32x1", help="shapes for the SIGKILL runs ('' none)")
    p.add_argument("--kill-after", type=float, default=5.0)
    p.add_argument("--files", type=int, default=4096)
    p.add_argument("--classes", type=int, default=64)
    p.add_argument("--min-kb", type=int, default=1)
    p.add_argument("--max-kb", type=int, default=8)
    p.add_argument("--partitions", type=int, default=256)
    p.add_argument("--codec", default="zstd:3")
    p.add_argument("--idle", type=float, default=20.0, help="seconds of the idle phase")
    p.add_argument("--storm-nodes", type=int, default=8)
    p.add_argument("--storm-files", type=int, default=50)
    p.add_argument("--start-limit", type=float, default=900.0)
    p.add_argument("--stop-limit", type=float, default=180.0)
    a = p.parse_args(raw)
    return h.main(NodesBench(a), render, raw)


if __name__ == "__main__":
    sys.exit(main())
