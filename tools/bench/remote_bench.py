#!/usr/bin/env python3
"""Remote reads against local reads, with the CPU of every FanStore process of the job.

Real ``mpiexec -n N fanstore mount ... --frontend kernel`` jobs on this machine, in two
shapes: ``ranks`` (a node's FUSE workers are MPI ranks of their own) and ``relay``
(one rank per node: forked workers ask the node's daemon). Phases: lr (local vs remote
through rank 0's mount), dist (spread over worker ranks), agg (every node at once), idle,
auto (``--replicas auto``). What each measures: docs/benchmarks.md, "Remote reads".

    .venv/bin/python tools/bench/remote_bench.py --preset quick   # a smoke run (~3 min)
    .venv/bin/python tools/bench/remote_bench.py --preset full    # quiet machine (~25 min)
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness as h  # noqa: E402

PRESETS = {
    "quick": dict(files=2000, classes=20, partitions=8, reps=1, lr_ranks="2",
                  readers="1,4", agg_ranks="1,2", idle_seconds=5),
    "full": dict(files=8000, classes=80, partitions=16, reps=3, lr_ranks="2,4",
                 readers="1,4", agg_ranks="1,2,4", idle_seconds=10),
}


def job_(bench: "RemoteBench", nodes: int, tag: str, mode: str, extra: list[str] = (),
         workers: int | None = None) -> h.Job:
    """A job of ``nodes`` nodes in the ``ranks`` shape (each node its daemon and
    ``workers`` worker ranks, default ``--workers``) or the ``relay`` shape (one rank per
    node: that many forked FUSE workers whose remote reads go through the daemon)."""
    workers = workers or bench.a.workers
    args = ["--frontend", "kernel", "--workers", str(workers), *extra]
    per_node = workers + 1 if mode == "ranks" else 1
    return h.Job(bench, nodes, tag, args, per_node=per_node)


def job_roles(job: h.Job) -> dict[int, str]:
    """pid -> role of every FanStore process of ``job``: nN.daemon, nN.frontend, nN.fworker
    (a forked FUSE worker), nN.rank (a worker rank)."""
    from fanstore import runtime

    out = {}
    for r in range(job.ranks):
        st = runtime.read_state(job.mnt(r)) or {}
        if st.get("pid"):
            out[st["pid"]] = f"n{r}.daemon"
            for c in h.descendants(st["pid"])[1:]:
                out[c] = f"n{r}.frontend" if c in h.children(st["pid"]) else f"n{r}.fworker"
            for w in st.get("worker_pids") or []:
                out[w] = f"n{r}.rank"
    return out


class RemoteBench(h.Bench):
    name = "remote_bench"

    def read_pass(self, root: str, lst: str, readers: int, jb: h.Job, tags: dict) -> dict:
        roles = job_roles(jb)
        argv = [self.py, h.READER, "read", "--root", root, "--list", lst, "--workers",
                str(readers), "--seed", "-1"]
        self.cmd(argv, ROOT=root, **{"LIST.txt": os.path.basename(lst)})
        argv += ["--time-limit", str(self.a.pass_limit)]
        for pid in roles:
            argv += ["--watch-pid", str(pid)]
        row = self.sub(argv)
        row.update(tags)
        spent = {int(k): v for k, v in (row.get("watched_cpu_s") or {}).items()
                 if v is not None}
        files = row.get("files") or 0
        if files and spent:
            by_role: dict[str, float] = {}
            for pid, sec in spent.items():
                role = roles.get(pid, "?").split(".", 1)
                key = ("reader node " if role[0] == "n0" else "other nodes ") + role[-1]
                by_role[key] = by_role.get(key, 0.0) + sec
            total = sum(spent.values())
            row["cpu_us_per_file"] = round(total / files * 1e6, 1)
            row["cpu_us_by_role"] = {k: round(v / files * 1e6, 1) for k, v in
                                     sorted(by_role.items())}
            row["busiest_share"] = round(max(spent.values()) / total, 3) if total else None
            row["processes"] = len(spent)
        return row

    def run(self) -> None:
        a = self.a
        data, _small, gen = h.ensure_dataset(self.work, a.files, a.classes, 50, 150, a.seed)
        self.cmd(gen)
        info, pack = h.pack_store(self.fanstore, data, self.store, a.partitions, a.codec,
                                  os.cpu_count() or 1, True)
        self.cmd(pack)
        self.emit({"kind": "store", "ratio": info.get("ratio"),
                   "files": info.get("counts", {}).get("files")})
        for phase in a.phases:
            getattr(self, f"phase_{phase}")()

    def phase_lr(self) -> None:
        a = self.a
        for rep in range(1, a.reps + 1):
            for n in a.lr_ranks:
                sets = h.placement_sets(self.store, n)
                local = sets[0]
                remote = [p for r in range(1, n) for p in sets[r]]
                k = min(len(local), len(remote), a.lr_files)
                for mode in (("ranks", "relay") if rep % 2 else ("relay", "ranks")):
                    for readers in a.readers:
                        rng = random.Random(97 * rep + readers)
                        lists = {w: self.write_list(f"lr-{n}-{rep}-{readers}-{w}.txt",
                                                    rng.sample(src, k))
                                 for w, src in (("local", local), ("remote", remote))}
                        h.drop_caches()
                        job = job_(self, n, f"lr-{mode}-{n}-{rep}-{readers}", mode)
                        self.cmd(job.shown())
                        try:
                            job.start()
                            for which in (("local", "remote") if readers % 2
                                          else ("remote", "local")):
                                before = (job.stats(0) or {})
                                h.drop_caches()
                                row = self.read_pass(job.mnt(0), lists[which], readers, job,
                                                     dict(kind="lr", mode=mode, nodes=n,
                                                          rep=rep, readers=readers,
                                                          which=which))
                                after = (job.stats(0) or {})
                                row["remote_reads"] = (after.get("remote_reads", 0)
                                                       - before.get("remote_reads", 0))
                                self.emit(row)
                                h.log(f"  lr {mode:5} n={n} r={readers} {which:6}: "
                                    f"{row.get('files_per_s')} files/s, "
                                    f"{row.get('cpu_us_per_file')} us/file CPU, busiest "
                                    f"{row.get('busiest_share')}, remote reads "
                                    f"{row['remote_reads']}")
                        finally:
                            job.stop()

    def phase_dist(self) -> None:
        a = self.a
        sets = h.placement_sets(self.store, 2)
        remote = sets[1][: a.lr_files]
        lst = self.write_list("dist.txt", remote)
        for rep in range(1, a.reps + 1):
            for k in (1, 2):
                h.drop_caches()
                job = job_(self, 2, f"dist-{k}-{rep}", "ranks", workers=k)
                try:
                    job.start()
                    h.drop_caches()
                    row = self.read_pass(job.mnt(0), lst, 4, job,
                                         dict(kind="dist", workers=k, rep=rep))
                    self.emit(row)
                    h.log(f"  dist K={k}: busiest process {row.get('busiest_share')} of "
                        f"{row.get('cpu_us_per_file')} us/file ({row.get('files_per_s')} "
                        "files/s)")
                finally:
                    job.stop()

    def phase_agg(self) -> None:
        a = self.a
        files = sorted(p for ps in h.placement_sets(self.store, 1).values() for p in ps)
        for rep in range(1, a.reps + 1):
            for mode in ("ranks", "relay"):
                for n in a.agg_ranks:
                    if n == 1 and mode == "relay":
                        continue  # one node has no remote path: the same job either way
                    order = list(files)
                    random.Random(31 * rep).shuffle(order)
                    rel = [f"mnt{i % n}/{p}" for i, p in enumerate(order)]
                    lst = self.write_list(f"agg-{n}-{rep}.txt", rel)
                    h.drop_caches()
                    job = job_(self, n, f"agg-{mode}-{n}-{rep}", mode)
                    try:
                        job.start()
                        h.drop_caches()
                        row = self.read_pass(job.dir, lst, n * a.agg_readers, job,
                                             dict(kind="agg", mode=mode, nodes=n, rep=rep))
                        row["remote_reads"] = sum((job.stats(r) or {}).get("remote_reads", 0)
                                                  for r in range(n))
                        self.emit(row)
                        h.log(f"  agg {mode} n={n}: {row.get('files_per_s')} files/s, "
                            f"{row.get('cpu_us_per_file')} us/file, remote reads "
                            f"{row['remote_reads']}")
                    finally:
                        job.stop()

    def phase_idle(self) -> None:
        job = job_(self, 4, "idle", "ranks")
        try:
            job.start()
            time.sleep(3)  # let the start-up settle and the pollers cool down
            roles = job_roles(job)
            before = {p: h.proc_cpu(p) for p in roles}
            t0 = time.monotonic()
            time.sleep(self.a.idle_seconds)
            wall = time.monotonic() - t0
            after = {p: h.proc_cpu(p) for p in roles}
            per_node: dict[str, float] = {}
            for p, role in roles.items():
                if before.get(p) is None or after.get(p) is None:
                    continue
                node = role.split(".")[0]
                per_node[node] = per_node.get(node, 0.0) + (after[p] - before[p]) / wall
            row = self.emit({"kind": "idle", "nodes": 4, "seconds": round(wall, 2),
                             "core_share_per_node": {k: round(v, 4) for k, v in
                                                     sorted(per_node.items())},
                             "processes_per_node": len(roles) // 4})
            h.log(f"  idle: {row['core_share_per_node']} of a core per node")
        finally:
            job.stop()

    def phase_auto(self) -> None:
        files = sorted(p for ps in h.placement_sets(self.store, 1).values() for p in ps)
        lst = self.write_list("auto.txt", files[: self.a.lr_files])
        job = job_(self, 4, "auto", "ranks", ["--replicas", "auto"])
        try:
            job.start()
            h.drop_caches()
            row = self.read_pass(job.mnt(0), lst, 4, job, dict(kind="auto", nodes=4))
            st = (job.stats(0) or {})
            row["remote_reads"] = st.get("remote_reads")
            row["local_reads"] = st.get("local_reads")
            row["replicas"] = st.get("replicas")
            self.emit(row)
            h.log(f"  auto: replicas {row['replicas']}, remote reads {row['remote_reads']}, "
                f"local reads {row['local_reads']}, {row.get('files_per_s')} files/s")
        finally:
            job.stop()


# ------------------------------------------------------------------------------ the section


def render(bench: RemoteBench, label: str | None, argv: list[str]) -> str:
    rows, vals = bench.rows, bench.vals
    med, num = h.med, h.num
    out = [f"{bench.a.files} files of 50-150 kB, {bench.a.codec}, {bench.a.workers} FUSE "
           "workers per node; every pass cold; medians of the repetitions.", ""]
    lr = bench.pick(kind="lr")
    if lr:
        local_remote = []
        for mode, n, w in ((m, n, w) for m in ("relay", "ranks")
                           for n in sorted({r["nodes"] for r in lr})
                           for w in sorted({r["readers"] for r in lr})):
            q = dict(kind="lr", mode=mode, nodes=n, readers=w)
            loc, rem, cl, cr = (med(vals(k, which=wh, **q)) for k in ("files_per_s",
                                "cpu_us_per_file") for wh in ("local", "remote"))
            if loc is not None or rem is not None:
                local_remote.append((mode, n, w, num(loc), num(rem), h.ratio(rem, loc), num(cl),
                                     num(cr), h.ratio(cr, cl),
                                     num(med(vals("busiest_share", which="remote", **q)), 2)))
        out += [h.table(["shape", "nodes", "readers", "local files/s", "remote files/s",
                         "remote/local", "CPU us/file local", "remote", "remote/local",
                         "busiest process (remote)"], local_remote, "l" * 10,
                        "Local vs remote through rank 0's mount")]
        cr4 = [med(vals("cpu_us_per_file", which="remote", kind="lr", mode="ranks", nodes=n,
                        readers=max(r["readers"] for r in lr)))
               for n in sorted({r["nodes"] for r in lr})]
        cr4 = [c for c in cr4 if c]
        if cr4:
            c = max(cr4)
            out += ["", h.table(["remote file: CPU µs (both sides)", "remote files/s on 64 "
                                 "cores", "with 32 cores", "cores for 40,000 files/s"],
                                [(num(c), num(64e6 / c), num(32e6 / c), num(40000 * c / 1e6))],
                                title="Projection to a 64-core node (an extrapolation)")]
        out += ["", "Per-process split of the CPU per remote file (first repetition):", ""]
        out += [f"- {r['mode']}, {r['nodes']} nodes, {r['readers']} readers: "
                + ", ".join(f"{k} {v}" for k, v in r["cpu_us_by_role"].items()) + " us/file"
                for r in lr if r.get("which") == "remote" and r.get("rep") == 1
                and r.get("cpu_us_by_role")]
        out.append("")
    if bench.pick(kind="dist"):
        dist = [(k, *bench.cells(dict(kind="dist", workers=k), "med:files_per_s",
                                 "med:cpu_us_per_file", "med:busiest_share:2"),
                 f"{1 / k + 0.1:.2f}") for k in (1, 2)]
        out += [h.table(["worker ranks per node", "remote files/s (4 readers)", "CPU us/file",
                         "busiest process's share", "target (1/K + 10%)"], dist, "l" * 5,
                        "Spread of the remote path over a node's processes"), ""]
    agg = bench.pick(kind="agg")
    if agg:
        one, aggs = med(vals("files_per_s", kind="agg", mode="ranks", nodes=1)), []
        for mode, n in ((m, n) for m in ("ranks", "relay") for n in sorted({r["nodes"]
                                                                            for r in agg})):
            q = dict(kind="agg", mode=mode, nodes=n)
            fps = med(vals("files_per_s", **q))
            if fps is not None:
                aggs.append((mode, n, num(fps), h.ratio(fps, one),
                             *bench.cells(q, "med:cpu_us_per_file", "med:remote_reads")))
        out += [h.table(["shape", "nodes", "files/s", "vs 1 node", "CPU us/file",
                         "remote reads"], aggs, "l" * 6,
                        "Aggregate: every node's mount read at once"), ""]
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
    return h.section(bench, label, argv, ["\n".join(out)])


def parse_args(argv: list[str] | None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="quick")
    h.args(ap, "remote_bench", "/tmp/fanstore-remotebench")
    ap.add_argument("--phases", default="lr,dist,agg,idle,auto")
    ap.add_argument("--workers", type=int, default=2, help="FUSE workers per node")
    ap.add_argument("--codec", default="zstd:3")
    ap.add_argument("--seed", type=int, default=11)
    ap.add_argument("--lr-files", type=int, default=1500, help="files per pass at most")
    ap.add_argument("--agg-readers", type=int, default=2)
    ap.add_argument("--pass-limit", type=float, default=120)
    a = ap.parse_args(argv)
    for k, v in PRESETS[a.preset].items():
        setattr(a, k, v)
    a.lr_ranks, a.readers, a.agg_ranks = (h.ints(x) for x in (a.lr_ranks, a.readers,
                                                               a.agg_ranks))
    a.phases = h.words(a.phases)
    return a


def main(argv: list[str] | None = None) -> int:
    raw = list(sys.argv[1:] if argv is None else argv)
    return h.main(RemoteBench(parse_args(raw)), render, raw)


if __name__ == "__main__":
    sys.exit(main())
