#!/usr/bin/env python3
"""FanStore across ranks: local vs remote reads, aggregate files/s, stage-in, metadata scale.

Real ``mpiexec -n N fanstore mount STORE MNT{rank} --local-dir LOCAL{rank}`` jobs on this
machine (every rank a process here: "remote" = another daemon over MPI shared memory):
1. local vs remote reads through rank 0's mount; 2. aggregate files/s with 1, 2, 4 ranks;
3. stage-in next to ``cp`` of the same partitions; 4. metadata per entry on synthetic
namespaces (index size, parse, Namespace, Ibcast). What each part measures: docs/benchmarks.md,
"FanStore across ranks" (its projection to 512 nodes is retired: "Retired studies" there).

    .venv/bin/python tools/bench/mpi_bench.py --preset quick   # ~1 min, a smoke run
    .venv/bin/python tools/bench/mpi_bench.py --preset full    # ~12-15 min, quiet machine
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness as h  # noqa: E402
from harness import med, num, ratio, spread  # noqa: E402

ME = os.path.abspath(__file__)
PRESETS = {
    "quick": dict(files=3000, classes=30, partitions=8, lr_ranks=4, lr_reps=2,
                  agg_ranks="1,2,4", agg_readers="2", agg_reps=1, meta_files="100000",
                  bcast_reps=2),
    "full": dict(files=20000, classes=100, partitions=16, lr_ranks=4, lr_reps=3,
                 agg_ranks="1,2,4", agg_readers="1,2", agg_reps=3, meta_files="250000,1000000",
                 bcast_reps=3),
}


def partitions_of(store: str, ranks: int) -> dict[int, list[str]]:
    """Partition file paths each rank stages (the same placement the daemons use)."""
    from fanstore.daemon import placement as pl
    from fanstore.format.index import read_index

    index = read_index(store)
    table = pl.placement([p.broadcast for p in index.partitions], ranks, 1)
    return {r: [os.path.join(store, index.partitions[p].name)
                for p in pl.local_partitions(table, r)] for r in range(ranks)}


class MpiBench(h.Bench):
    name = "mpi_bench"

    def read_pass(self, root: str, lst: str, workers: int, job: h.Job, tags: dict) -> dict:
        argv = [self.py, h.READER, "read", "--root", root, "--list", lst, "--workers",
                str(workers), "--seed", "-1"]
        self.cmd(argv, ROOT=root, **{"LIST.txt": os.path.basename(lst)})
        argv += ["--time-limit", str(self.a.pass_limit)]
        for pid in job.pid_list():
            argv += ["--watch-pid", str(pid)]
        load = h.loadavg1()
        row = self.sub(argv)
        row.update(tags, load1_before=load)
        if not job.alive():
            row["daemon_died"], row["log_tail"] = True, job.output()[-600:]
        return row

    def run(self) -> None:
        a = self.a
        data, small, gen = h.ensure_dataset(self.work, a.files, a.classes, a.min_kb, a.max_kb,
                                            a.seed)
        self.cmd(gen)
        self.n_small = len(small)
        info, pack = h.pack_store(self.fanstore, data, self.store, a.partitions, a.codec,
                                  a.jobs, a.reuse_store)
        self.cmd(pack)
        self.emit({"kind": "store", "files": len(small), "info": {
            k: info.get(k) for k in ("counts", "index_bytes", "index_bytes_per_entry",
                                     "memory_bytes_per_entry", "ratio", "pack_seconds")},
            "partition_sizes": [p["size"] for p in info["partitions"]],
            "params": dict(files=a.files, classes=a.classes, min_kb=a.min_kb, max_kb=a.max_kb,
                           seed=a.seed, partitions=a.partitions, codec=a.codec)})
        self.cmd(f"{self.fanstore} info WORK/store --json")
        for phase, fn in (("lr", self.local_remote), ("agg", self.aggregate),
                          ("meta", self.metadata)):
            if phase in a.phases:
                fn()

    def local_remote(self) -> None:
        """Rank 0's own files and as many of the others', each read once, cold."""
        a, n = self.a, self.a.lr_ranks
        sets = h.placement_sets(self.store, n)
        remote_all = [p for r in range(1, n) for p in sets[r]]
        k = min(len(sets[0]), len(remote_all))
        for rep in range(1, a.lr_reps + 1):
            for wi, w in enumerate(a.lr_readers):
                rng = random.Random(1000 * rep + w)
                lists = {"local": self.write_list(f"lr-local-r{rep}-w{w}.txt",
                                                  rng.sample(sets[0], k)),
                         "remote": self.write_list(f"lr-remote-r{rep}-w{w}.txt",
                                                   rng.sample(remote_all, k))}
                order = ["local", "remote"] if (rep + wi) % 2 else ["remote", "local"]
                h.drop_caches()
                job = h.Job(self, n, f"lr-n{n}-r{rep}-w{w}")
                self.cmd(job.shown())
                try:
                    job.start()
                    self.emit({"kind": "lr_job", "ranks": n, "rep": rep, "workers": w,
                               "ready_seconds": round(job.ready_seconds, 3),
                               "stats0": job.stats(0)})
                    for which in order:
                        before = job.stats(0)
                        h.drop_caches()
                        row = self.read_pass(job.mnt(0), lists[which], w, job, dict(
                            kind="lr", which=which, ranks=n, rep=rep, order=order.index(which)))
                        after = job.stats(0) or {}
                        row["daemon0"] = h.diff_stats(after, before)
                        for q in ("p50", "p99"):
                            row[f"remote_latency_ms_{q}"] = after.get(f"remote_latency_ms_{q}")
                        self.emit(row)
                        h.log(f"  rep {rep} w={w} {which:<6}: {row.get('files_per_s')} files/s")
                finally:
                    job.stop()

    def aggregate(self) -> None:
        """Every rank's mount read at once (and stage-in next to cp), per rank count."""
        a = self.a
        files = sorted(p for ps in h.placement_sets(self.store, 1).values() for p in ps)
        step = 0
        for rep in range(1, a.agg_reps + 1):
            for rpr in a.agg_readers:
                for n in a.agg_ranks:
                    step += 1
                    if step % 2:
                        self.cp_reference(n, rep, rpr)
                    self.aggregate_job(n, rep, rpr, files)
                    if not step % 2:
                        self.cp_reference(n, rep, rpr)

    def aggregate_job(self, n: int, rep: int, rpr: int, files: list[str]) -> None:
        order = list(files)
        random.Random(7919 * rep + rpr).shuffle(order)
        # Reader w of W = n * rpr takes items w, w+W, ...: all of rank (w mod n)'s share.
        lst = self.write_list(f"agg-n{n}-r{rep}-rpr{rpr}.txt",
                              [f"mnt{k % n}/{p}" for k, p in enumerate(order)])
        job = h.Job(self, n, f"agg-n{n}-r{rep}-rpr{rpr}")
        self.cmd(job.shown())
        h.drop_caches()  # cold stage-in
        try:
            job.start()
            keys = ("rank", "stage_seconds", "staged_bytes", "stage_mb_per_s",
                    "staged_partitions", "index_broadcast_seconds", "metadata_bytes",
                    "metadata_bytes_per_entry", "local_partitions")
            stage = [{k: (job.stats(r) or {}).get(k) for k in keys} for r in range(n)]
            total = sum(s.get("staged_bytes") or 0 for s in stage)
            wall = max((s.get("stage_seconds") or 0) for s in stage) or None
            self.emit({"kind": "stage", "ranks": n, "rep": rep, "rpr": rpr,
                       "ready_seconds": round(job.ready_seconds, 3), "per_rank": stage,
                       "bytes": total, "seconds_max": wall,
                       "agg_MB_per_s": round(total / 1e6 / wall, 1) if wall else None})
            before = [job.stats(r) for r in range(n)]
            h.drop_caches()
            row = self.read_pass(job.dir, lst, n * rpr, job, dict(kind="agg", ranks=n, rep=rep,
                                                                  rpr=rpr))
            diffs = [h.diff_stats(job.stats(r), b) or {} for r, b in enumerate(before)]
            row["daemons"] = diffs
            row["local_reads"] = sum(d.get("local_reads", 0) for d in diffs)
            row["remote_reads"] = sum(d.get("remote_reads", 0) for d in diffs)
            self.emit(row)
            h.log(f"  n={n} rpr={rpr} rep {rep}: {row.get('files_per_s')} files/s, staged "
                  f"{total / 1e6:.0f} MB in {wall} s")
        finally:
            job.stop()

    def cp_reference(self, n: int, rep: int, rpr: int) -> None:
        parts, base = partitions_of(self.store, n), os.path.join(self.work, "cp")
        shutil.rmtree(base, ignore_errors=True)
        dests = [os.path.join(base, f"local{r}") for r in range(n)]
        for d in dests:
            os.makedirs(d)
        total = sum(os.path.getsize(p) for ps in parts.values() for p in ps)
        self.cmd("cp STORE/part-*.fsp (this rank's partitions) WORK/cp/local{rank}/   "
                 "# one cp per rank, concurrently; then: sync")
        h.drop_caches()
        t0 = time.perf_counter()
        procs = [subprocess.Popen(["cp"] + parts[r] + [dests[r] + "/"], start_new_session=True)
                 for r in range(n) if parts[r]]
        try:
            codes = [p.wait() for p in procs]
        except BaseException:
            for p in procs:
                h.kill_group(p)
            raise
        t_cp = time.perf_counter() - t0
        os.sync()
        t_sync = time.perf_counter() - t0
        shutil.rmtree(base, ignore_errors=True)
        self.emit({"kind": "cp", "ranks": n, "rep": rep, "rpr": rpr, "bytes": total,
                   "ok": all(c == 0 for c in codes), "seconds": round(t_cp, 4),
                   "seconds_with_sync": round(t_sync, 4),
                   "MB_per_s": round(total / 1e6 / t_cp, 1),
                   "MB_per_s_with_sync": round(total / 1e6 / t_sync, 1)})

    def metadata(self) -> None:
        """Synthetic namespaces: index size, parse, Namespace, Ibcast across local ranks."""
        a = self.a
        synth_dir = os.path.join(self.work, "synth")
        os.makedirs(synth_dir, exist_ok=True)
        for nfiles in a.meta_files:
            path = os.path.join(synth_dir, f"synth-{nfiles}.idx")
            runs = [("synth", [self.py, ME, "_synth", "--files", str(nfiles), "--out", path,
                               "--files-per-dir", str(a.files_per_dir), "--partitions",
                               str(a.synth_partitions)], {}),
                    ("parse", [self.py, ME, "_parse", "--index", path, "--reps", "3"], {})]
            runs += [("bcast", [self.mpiexec, "-n", str(a.bcast_ranks), self.py, ME, "_bcast",
                                "--index", path], {"rep": rep})
                     for rep in range(1, a.bcast_reps + 1)]
            for kind, argv, extra in runs:
                self.cmd(h.shown(argv).replace(str(nfiles), "N"))
                row = h.run_json(argv, timeout=1800)
                if row.get("first_error"):
                    row["error"] = row.pop("first_error")
                    row.pop("errors", None)
                self.emit(dict(row, kind=kind, files=nfiles, **extra))
                h.log(f"  {kind} {nfiles:,} files: {row}"[:200])
            if not a.keep_synth:
                os.unlink(path)

    def cleanup(self) -> None:
        super().cleanup()
        for d in ("cp", "jobs"):
            shutil.rmtree(os.path.join(self.work, d), ignore_errors=True)


# ------------------------------------------------------------------------------ helpers run
# as subprocesses (fresh processes: clean memory numbers, and MPI for the broadcast)


def _synth_entries(b, rng, n_files: int, files_per_dir: int) -> tuple[int, object]:
    """Fill ``b``'s entries and names: a root, its directories "n%08d" of
    ``files_per_dir`` files "n%08d_%06d.JPEG" each (ImageNet-like lengths), 50-150 kB,
    one chunk each. Returns (directories, file sizes)."""
    import numpy as np

    from fanstore.format.index import KIND_DIR, KIND_FILE

    e = b.entries
    n_dirs = max(1, math.ceil(n_files / files_per_dir))
    n = 1 + n_dirs + n_files
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
    names = [b""] + [b"n%08d" % d for d in range(n_dirs)]
    for d in range(n_dirs):
        names.extend(b"n%08d_%06d.JPEG" % (d, k) for k in range(int(counts[d])))
    lens = np.fromiter((len(x) for x in names), dtype=np.int64, count=n)
    e["name_len"][:] = lens
    e["name_off"][:] = np.concatenate(([0], np.cumsum(lens)[:-1]))
    b.names = bytearray(b"".join(names))
    return n_dirs, sizes


def _synth_chunks(c, rng, sizes, partitions: int) -> list:
    """Fill the chunk table: one chunk per file, partitions dealt round-robin, packed back to
    back in each. Returns the partitions' PartitionInfo."""
    import numpy as np

    from fanstore.format.index import PartitionInfo
    from fanstore.format.partition import PARTITION_HEADER_SIZE

    n_files = len(sizes)
    part = (np.arange(n_files) % partitions).astype(np.int64)
    stored = (sizes * rng.uniform(0.45, 0.75, n_files)).astype(np.int64) + 1
    order = np.argsort(part, kind="stable")
    cs = np.cumsum(stored[order])
    starts = np.searchsorted(part[order], np.arange(partitions))
    base = np.concatenate(([0], cs))[starts]
    offset = np.empty(n_files, dtype=np.int64)
    offset[order] = PARTITION_HEADER_SIZE + cs - stored[order] - base[part[order]]
    c["part"][:], c["offset"][:], c["stored"][:], c["raw"][:] = part, offset, stored, sizes
    c["codec"][:] = 1
    c["checksum"][:] = rng.integers(1, 2**63, n_files, dtype=np.int64).astype(np.uint64)
    per_stored = np.bincount(part, weights=stored, minlength=partitions).astype(np.int64)
    per_raw = np.bincount(part, weights=sizes, minlength=partitions).astype(np.int64)
    per_files = np.bincount(part, minlength=partitions)
    return [PartitionInfo(number=p, size=int(PARTITION_HEADER_SIZE + per_stored[p]),
                          checksum="0" * 32, files=int(per_files[p]), raw_bytes=int(per_raw[p]))
            for p in range(partitions)]


def synth_index_bytes(n_files: int, files_per_dir: int = 1000, partitions: int = 512,
                      seed: int = 0) -> tuple[bytes, dict]:
    """An index for ``n_files`` files (ImageNet-like names, 50-150 kB, one chunk each), built
    with the packer's own IndexBuilder/encode_index, without any file data."""
    import numpy as np

    from fanstore.format.index import IndexBuilder, encode_index

    t0 = time.perf_counter()
    rng = np.random.default_rng(seed)
    n = 1 + max(1, math.ceil(n_files / files_per_dir)) + n_files
    b = IndexBuilder(n, n_files)
    n_dirs, sizes = _synth_entries(b, rng, n_files, files_per_dir)
    parts = _synth_chunks(b.chunks, rng, sizes, partitions)
    t_arrays = time.perf_counter() - t0
    t1 = time.perf_counter()
    lookup = None  # format v3: no lookup table to build (v1/v2 had one: 0.75 µs/entry)
    t_lookup = time.perf_counter() - t1
    meta = {
        "chunk_size": 1 << 20,
        "codecs": [{"id": "none"}, {"id": "zstd", "level": 3}],
        "partitions": [p.to_json() for p in parts],
        "counts": {"files": n_files, "dirs": n_dirs, "symlinks": 0,
                   "raw_bytes": int(sizes.sum()), "stored_bytes": int(b.chunks["stored"].sum())},
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
    from fanstore.namespace import Namespace, metadata_bytes  # the daemon's metadata_bytes

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
        "parse_seconds": round(statistics.median(t_parse), 4),
        "parse_all": [round(x, 4) for x in t_parse],
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

    world = World.from_mpi(ranks_per_node=1)
    data = None
    if world.rank == 0:
        with open(a.index, "rb") as f:
            data = f.read()
    world.gate("bench")  # a barrier that does not spin
    t0 = time.perf_counter()
    data = world.bcast_bytes(data)
    t_bcast = time.perf_counter() - t0
    world.gate("bench")
    t1 = time.perf_counter()
    index = read_index_bytes(data, where=a.index)
    t_parse = time.perf_counter() - t1
    world.gate("bench")
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


# ------------------------------------------------------------------------------ the section


def _local_remote(bench: MpiBench) -> tuple[list[tuple], list[tuple]]:
    """(the target rows, the local-vs-remote rows)."""
    a, vals, lr, targets = bench.a, bench.vals, [], []
    for wk in a.lr_readers:
        loc = med(vals("files_per_s", kind="lr", which="local", workers=wk))
        rem = med(vals("files_per_s", kind="lr", which="remote", workers=wk))
        targets.append((f"remote reads at least 0.7x local (rank 0's mount, {a.lr_ranks} "
                        "ranks)", wk, num(loc), num(rem), ratio(rem, loc), "≥ 0.70",
                        h.check(None if not (loc and rem) else rem / loc >= 0.7)))
        for which in ("local", "remote"):
            q = dict(kind="lr", which=which, workers=wk)
            rs = bench.pick(**q)
            if not rs:
                continue
            d = [r.get("daemon0") or {} for r in rs]
            lr.append((which + h.err_tag(rs), wk, num(med(r.get("files") for r in rs)),
                       *bench.cells(q, "spread:files_per_s", "spread:MB_per_s", "p:lat_ms",
                                    "med:cpu_busy_pct", "med:watched_cpu_us_per_file"),
                       f"{num(med(x.get('local_reads') for x in d))} / "
                       f"{num(med(x.get('remote_reads') for x in d))}",
                       bench.cells(q, "p:remote_latency_ms")[0] if which == "remote" else "–",
                       ratio(med(vals("files_per_s", **q)), loc)))
    return targets, lr


def _aggregate(bench: MpiBench) -> list[tuple]:
    agg = []
    for rpr in bench.a.agg_readers:
        one = med(bench.vals("files_per_s", kind="agg", ranks=1, rpr=rpr))
        for n in bench.a.agg_ranks:
            q = dict(kind="agg", ranks=n, rpr=rpr)
            rs = bench.pick(**q)
            if rs:
                share = med([r["remote_reads"] / max(1, r["remote_reads"] + r["local_reads"])
                             for r in rs if "remote_reads" in r])
                agg.append((f"{n}" + h.err_tag(rs), rpr, *bench.cells(
                    q, "spread:files_per_s", "spread:MB_per_s", "p:lat_ms", "med:cpu_busy_pct",
                    "med:watched_cpu_us_per_file"), "–" if share is None else f"{share:.0%}",
                    ratio(med(bench.vals("files_per_s", **q)), one)))
    return agg


def _stage(bench: MpiBench) -> list[tuple]:
    stage = []
    for n in bench.a.agg_ranks:
        srs = bench.pick(kind="stage", ranks=n)
        if srs:
            rates = [r.get("agg_MB_per_s") for r in srs]
            cps2 = bench.vals("MB_per_s_with_sync", kind="cp", ranks=n)
            stage.append((n, num(med(r["bytes"] / 1e6 for r in srs)), spread(rates),
                          num(med(x.get("stage_mb_per_s") for r in srs for x in r["per_rank"])),
                          spread(bench.vals("MB_per_s", kind="cp", ranks=n)), spread(cps2),
                          ratio(med(rates), med(cps2)),
                          spread([r.get("ready_seconds") for r in srs], 1)))
    return stage


def _metadata(bench: MpiBench) -> list[tuple]:
    meta, parse = [], bench.pick(kind="parse")
    for s in bench.pick(kind="synth"):
        pr = next((x for x in parse if x["files"] == s["files"]), {})
        bc = bench.pick(kind="bcast", files=s["files"])
        meta.append((f"{s['files']:,}", f"{s.get('entries', 0):,}",
                     f"{s.get('index_bytes', 0) / 1e6:,.1f}", s.get("index_bytes_per_entry"),
                     pr.get("metadata_bytes_per_entry"), pr.get("rss_bytes_per_entry"),
                     pr.get("parse_seconds"), pr.get("parse_us_per_entry"),
                     pr.get("namespace_seconds"), pr.get("lookup_us"), s.get("lookup_seconds"),
                     num(med(b.get("bcast_seconds_max") for b in bc), 3),
                     num(med(b.get("parse_seconds_max") for b in bc), 2)))
    return meta


def _caption(bench: MpiBench) -> str:
    st = bench.pick(kind="store")[0]
    info, p = st["info"], st["params"]
    counts = info.get("counts") or {}
    staged = [x for r in bench.pick(kind="stage") for x in r["per_rank"]]
    bcast = [x.get("index_broadcast_seconds") for r in bench.pick(kind="stage")
             if r["ranks"] > 1 for x in r["per_rank"]]
    return (f"{st['files']:,} files of {p['min_kb']}-{p['max_kb']} kB "
            f"({counts.get('raw_bytes', 0) / 1e6:,.0f} MB), `--partitions {p['partitions']} "
            f"--codec {p['codec']}`: {counts.get('stored_bytes', 0) / 1e6:,.0f} MB stored (ratio "
            f"{info.get('ratio', 0):.2f}), index {info.get('index_bytes', 0):,} bytes; "
            f"{info.get('index_bytes_per_entry', 0):.1f} B/entry on disk, "
            f"{info.get('memory_bytes_per_entry', 0):.1f} B/entry in memory (`fanstore info`), "
            f"{num(med(x.get('metadata_bytes_per_entry') for x in staged), 1)} "
            f"(`fanstore stats`); index broadcast in the jobs {spread(bcast, 4)} s.")


def render(bench: MpiBench, label: str | None, argv: list[str]) -> str:
    a, (targets, lr), meta = bench.a, _local_remote(bench), _metadata(bench)
    notes = [h.errors_line(bench.rows, ("lr", "agg"))]
    notes += [f"- **a daemon died during {r['kind']} n={r.get('ranks')} rep={r.get('rep')}**: "
              f"{(r.get('log_tail') or '').strip()[-300:]}" for r in bench.rows
              if r.get("daemon_died")]
    notes += [f"- {r['kind']}: {r['error'][:300]}" for r in bench.rows if r.get("error")]
    return h.section(bench, label, argv, [
        _caption(bench),
        h.table(["target", "readers", "local files/s", "remote files/s", "remote / local",
                 "goal", "status"], targets, "lrrrrrl", "Target"),
        h.table(["set", "readers", "files/pass", "files/s", "MB/s", "p50 / p99 ms", "CPU %",
                 "daemons' CPU µs/file", "local / remote reads per pass",
                 "remote fetch p50 / p99 ms", "vs local"], lr,
                title=f"Local vs remote reads (rank 0 of a {a.lr_ranks}-rank job)"),
        h.table(["ranks", "readers per rank", "files/s (total)", "MB/s", "p50 / p99 ms",
                 "CPU %", "daemons' CPU µs/file", "remote share of reads", "vs 1 rank"],
                _aggregate(bench), "r" * 9, "Aggregate files/s with 1, 2 and 4 ranks"),
        h.table(["ranks", "MB staged", "stage MB/s (all ranks)", "stage MB/s per rank",
                 "cp MB/s", "cp+sync MB/s", "stage / cp+sync", "mount ready s"], _stage(bench),
                "r" * 8, "Stage-in vs `cp`"),
        h.table(["files", "entries", "index MB (disk)", "B/entry disk",
                 "B/entry in memory (formula)", "B/entry RSS", "parse+validate s", "µs/entry",
                 "Namespace s", "lookup µs", "build lookup table s",
                 f"Ibcast s ({a.bcast_ranks} ranks)", "parse on all ranks s"], meta, "r" * 13,
                "Metadata per entry (synthetic namespaces)") if meta else "",
        "### Errors and problems seen in this run\n\n" + "\n".join(notes)])


# ------------------------------------------------------------------------------ main


def parse_args(argv: list[str] | None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="full",
                    help="dataset size and repetitions (default full); options below override")
    h.args(ap, "mpi_bench", os.environ.get("FANSTORE_MPIBENCH_WORK", "/tmp/fanstore-mpibench"))
    h.dataset_args(ap, partitions=None)
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
    ap.add_argument("--mpiexec", help="mpiexec (default: next to this python)")
    a = h.presets(ap.parse_args(argv), PRESETS)
    a.lr_readers, a.agg_ranks, a.agg_readers, a.meta_files = (
        h.ints(x) for x in (a.lr_readers, a.agg_ranks, a.agg_readers, a.meta_files))
    a.phases = set(h.words(a.phases))
    return a


def main(argv: list[str] | None = None) -> int:
    raw = sys.argv[1:] if argv is None else argv
    sub = {"_synth": main_synth, "_parse": main_parse, "_bcast": main_bcast}
    if raw and raw[0] in sub:
        return sub[raw[0]](raw[1:])
    return h.main(MpiBench(parse_args(raw)), render, raw)


if __name__ == "__main__":
    sys.exit(main())
