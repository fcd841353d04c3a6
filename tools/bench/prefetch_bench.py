#!/usr/bin/env python3
"""Prefetch mode and the FUSE-free Python API next to the raw directory and the sync mount.

The Benchmark section of the issue "Prefetch mode and a FUSE-free Python / PyTorch
reader". One dataset (tools/gen_dataset.py), one store (``fanstore pack``), and per
repetition ONE shuffled epoch order that every mode reads in the same order:

- ``raw``           the source directory, ``open(); f.read(); close()`` per file;
- ``fuse-sync``     a FanStore mount in the default (sync) mode, plain file reads;
- ``fuse-prefetch`` a mount with ``--mode prefetch --prefetch-mb B`` (B a fraction of the
                    dataset, so eviction and ordering matter); the order is handed over
                    (the ``prefetch`` control request, what ``fanstore prefetch MNT --list
                    FILE`` sends) when the readers are released, then plain file reads;
- ``api-store``     ``fanstore.open_store(STORE).read(path)``: the packed store read and
                    decoded in the reader processes, no daemon, no FUSE;
- ``api-prefetch``  ``fanstore.open_store(MNT)`` on the prefetch mount, order given with
                    ``.prefetch(order)`` when the readers are released.

1. **Read passes**: every mode cold (``sync; echo 3 > /proc/sys/vm/drop_caches`` and a
   fresh mount before each pass) with 1 and 4 reader processes released by one barrier;
   each process takes a round-robin share of the epoch order (API readers open the store
   before the barrier). Modes interleaved within a repetition, their order rotated.
2. **DataLoader**: ``torch.utils.data.DataLoader(dataset, batch_size=B, num_workers=4)``
   with the same order (a fixed-order sampler) over (a) the raw files, (b) the sync mount
   (plain file reads), (c) the prefetch mount with ``fanstore.torch.PrefetchSampler``
   (plain file reads), (c') ``FanStoreDataset`` on the prefetch mount with
   ``PrefetchSampler``, (d) ``FanStoreDataset`` on the store. The loop sleeps a fixed
   compute time per batch; the input stall is the time spent waiting in ``next()`` (worker
   start-up included). The compute time is calibrated first: a sync-mode epoch without
   compute gives the per-batch read time T, and each of ``--compute-factors`` (default
   1.0 and 0.5) gives one set of epochs with compute = factor x T (1.0 = "tight": compute
   close to the input time, where the target is judged; 0.5 = input-bound). Reported: epoch
   time, stall, and the share of the sync stall each mode removes, 1 - stall/stall_sync;
   median over repetitions.

It writes its section of docs/benchmarks.md (between ``<!-- BEGIN prefetch_bench -->`` and
``<!-- END prefetch_bench -->``) and the raw rows to tools/bench/results/prefetch_bench.jsonl.
Every mount it makes is unmounted on exit, also on errors and Ctrl-C / SIGTERM. Run as
root (drop_caches, FUSE).

    .venv/bin/python tools/bench/prefetch_bench.py --preset quick   # ~2-3 min, a smoke run
    .venv/bin/python tools/bench/prefetch_bench.py --preset full    # ~10-15 min, quiet machine
"""

from __future__ import annotations

import argparse
import functools
import json
import multiprocessing as mp
import os
import queue as _queue
import random
import shlex
import shutil
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
import reader  # noqa: E402
from mount_bench import _find_fanstore, _kill_group, is_mounted, log, pid_alive  # noqa: E402
from mpi_bench import control, ensure_dataset, pack_store, state_pid  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ME = os.path.abspath(__file__)
SECTION = "prefetch_bench"
MODES = ["raw", "fuse-sync", "fuse-prefetch", "api-store", "api-prefetch"]
MOUNT_OF = {"fuse-sync": "sync", "fuse-prefetch": "prefetch", "api-prefetch": "prefetch"}
PREFETCH_KEYS = ("prefetch_hits", "prefetch_late", "prefetch_misses", "prefetch_files",
                 "prefetch_bytes_evicted_unused")

PRESETS = {
    # A smoke run: the harness end to end in about 2-3 minutes; numbers are not results.
    "quick": dict(files=3000, classes=30, reps=1, dl_reps=2, calib_reps=1),
    # For a quiet machine.
    "full": dict(files=10000, classes=100, reps=3, dl_reps=3, calib_reps=2),
}


# ------------------------------------------------------------------------------ a read pass
# (run as `prefetch_bench.py _pass ...` in its own process group; prints one JSON row)


def _share(mode: str, root: str, rels: list[str], api_path: str | None, barrier, queue) -> None:
    store = None
    try:
        if mode.startswith("api"):
            import fanstore

            store = fanstore.open_store(api_path)  # before the barrier: not timed
    except Exception as exc:  # noqa: BLE001 - reported by the parent
        queue.put({"setup_error": f"{type(exc).__name__}: {exc}"})
        barrier.abort()
        return
    try:
        barrier.wait()
    except Exception:  # noqa: BLE001 - a broken barrier: the parent reports it
        return
    clock = time.perf_counter
    lat: list[float] = []
    nbytes = errors = done = 0
    first_error = None
    start = clock()
    for rel in rels:
        t = clock()
        try:
            if store is not None:
                nbytes += len(store.read(rel))
            else:
                with open(os.path.join(root, rel), "rb") as f:
                    nbytes += len(f.read())
        except Exception as exc:  # noqa: BLE001 - OSError or FanStoreError
            errors += 1
            if first_error is None:
                first_error = f"{rel}: {type(exc).__name__}: {exc}"
        lat.append(clock() - t)
        done += 1
    queue.put({"done": done, "bytes": nbytes, "errors": errors, "first_error": first_error,
               "lat": lat, "start": start, "end": clock()})


def pass_main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="prefetch_bench.py _pass")
    ap.add_argument("--mode", required=True, choices=MODES)
    ap.add_argument("--root", required=True, help="directory the list is relative to")
    ap.add_argument("--list", required=True)
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--store", help="the packed store (api-store)")
    ap.add_argument("--mount", help="the mount (order / api-prefetch)")
    ap.add_argument("--watch-pid", type=int, action="append", default=[])
    a = ap.parse_args(argv)
    rels = reader.load_list(a.list)
    api_path = a.store if a.mode == "api-store" else a.mount
    order_client = None
    if a.mode == "api-prefetch":
        import fanstore

        order_client = fanstore.open_store(a.mount)  # the index load is not timed
    ctx = mp.get_context("fork")
    W = a.workers
    barrier = ctx.Barrier(W + 1)
    queue = ctx.Queue()
    procs = [ctx.Process(target=_share, daemon=True,
                         args=(a.mode, a.root, rels[i::W], api_path, barrier, queue))
             for i in range(W)]
    for p in procs:
        p.start()
    results: list[dict] = []
    order_s = None
    order_reply = None
    finished = False
    try:
        cpu0 = reader.machine_cpu()
        w0 = {pid: reader.process_cpu_seconds(pid) for pid in a.watch_pid}
        barrier.wait(timeout=300)
        t0 = time.perf_counter()
        # The order goes over when the readers are released: its cost is in the pass.
        if a.mode == "fuse-prefetch":
            from fanstore import control

            order_reply = control.control(a.mount, {"op": "prefetch", "paths": rels,
                                                    "client": "prefetch_bench"}, timeout=300)
            order_s = time.perf_counter() - t0
        elif a.mode == "api-prefetch":
            order_reply = order_client.prefetch(rels)
            order_s = time.perf_counter() - t0
        while len(results) < W:
            try:
                results.append(queue.get(timeout=1.0))
            except _queue.Empty:
                dead = [p for p in procs if p.exitcode not in (None, 0)]
                if dead:
                    raise RuntimeError(f"reader process died (exit code {dead[0].exitcode})")
        t0 = min([t0] + [r["start"] for r in results])
        t1 = max(r["end"] for r in results)
        cpu1 = reader.machine_cpu()
        w1 = {pid: reader.process_cpu_seconds(pid) for pid in a.watch_pid}
        finished = True
    except Exception as exc:  # noqa: BLE001
        setup = [r.get("setup_error") for r in results if r.get("setup_error")]
        try:
            while True:
                r = queue.get_nowait()
                if r.get("setup_error"):
                    setup.append(r["setup_error"])
        except Exception:  # noqa: BLE001
            pass
        print(json.dumps({"mode": a.mode, "workers": W, "errors": 1,
                          "first_error": (setup[0] if setup else f"{type(exc).__name__}: {exc}")}))
        return 1
    finally:
        for p in procs:
            if not finished and p.is_alive():
                p.terminate()
            p.join(timeout=30)
    wall = max(t1 - t0, 1e-9)
    lat = sorted(x for r in results for x in r["lat"])
    done = sum(r["done"] for r in results)
    nbytes = sum(r["bytes"] for r in results)
    busy, iowait = reader.busy_between(cpu0, cpu1)
    row = {"mode": a.mode, "workers": W, "files": done, "files_listed": len(rels),
           "bytes": nbytes, "seconds": round(wall, 4), "files_per_s": round(done / wall, 1),
           "MB_per_s": round(nbytes / 1e6 / wall, 2),
           "lat_ms_p50": reader._ms(reader.percentile(lat, 50)),
           "lat_ms_p99": reader._ms(reader.percentile(lat, 99)),
           "errors": sum(r["errors"] for r in results),
           "first_error": next((r["first_error"] for r in results if r["first_error"]), None),
           "cpu_busy_pct": busy, "iowait_pct": iowait,
           "order_send_s": None if order_s is None else round(order_s, 4),
           "order_reply": order_reply if isinstance(order_reply, dict) else None}
    if a.watch_pid:
        spent = [w1[p] - w0[p] for p in a.watch_pid if w0[p] is not None and w1[p] is not None]
        if spent and done:
            row["daemon_cpu_us_per_file"] = round(sum(spent) / done * 1e6, 1)
    print(json.dumps(row), flush=True)
    return 1 if row["errors"] else 0


# ------------------------------------------------------------------------------ a DataLoader
# epoch (run as `prefetch_bench.py _loader ...`, a fresh process per epoch; one JSON row)


class _PathDataset:
    """Map-style dataset of plain files: item i = open(root/files[i]).read()."""

    def __init__(self, root: str, files: list[str]) -> None:
        self.root = root
        self.files = files

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int) -> bytes:
        with open(os.path.join(self.root, self.files[i]), "rb") as f:
            return f.read()


class _FixedOrder:
    """A sampler that yields one given order (the epoch's shuffled indices)."""

    def __init__(self, order: list[int]) -> None:
        self.order = order

    def __iter__(self):
        return iter(self.order)

    def __len__(self) -> int:
        return len(self.order)


def _collate_sizes(batch: list[bytes]) -> int:
    return sum(len(x) for x in batch)


def loader_main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="prefetch_bench.py _loader")
    ap.add_argument("--mode", required=True, choices=MODES)
    ap.add_argument("--root", help="raw directory or mount point (file-read modes)")
    ap.add_argument("--store", help="the packed store (api-store)")
    ap.add_argument("--mount", help="the prefetch mount (fuse-prefetch, api-prefetch)")
    ap.add_argument("--files", required=True, help="the dataset's files, sorted (indices)")
    ap.add_argument("--order", required=True, help="the epoch order (paths)")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--compute-ms", type=float, default=0.0)
    a = ap.parse_args(argv)
    import torch.utils.data as tud

    import fanstore
    from fanstore.torch import FanStoreDataset, PrefetchSampler

    files = reader.load_list(a.files)
    pos = {p: i for i, p in enumerate(files)}
    order = [pos[p] for p in reader.load_list(a.order)]
    base = _FixedOrder(order)
    if a.mode in ("raw", "fuse-sync"):
        ds, sampler = _PathDataset(a.root, files), base
    elif a.mode == "fuse-prefetch":
        # Plain file reads through the mount; the order goes to the daemon per epoch.
        ds = _PathDataset(a.mount, files)
        sampler = PrefetchSampler(base, FanStoreDataset(fanstore.open_store(a.mount), files=files))
    elif a.mode == "api-prefetch":
        ds = FanStoreDataset(fanstore.open_store(a.mount), files=files)
        sampler = PrefetchSampler(base, ds)
    else:  # api-store
        ds = FanStoreDataset(fanstore.open_store(a.store), files=files)
        sampler = base
    loader = tud.DataLoader(ds, batch_size=a.batch, sampler=sampler, num_workers=a.workers,
                            collate_fn=_collate_sizes)
    compute = a.compute_ms / 1e3
    cpu0 = reader.machine_cpu()
    clock = time.perf_counter
    t0 = clock()
    it = iter(loader)  # forks the workers and hands the order over (PrefetchSampler)
    t_iter = clock() - t0
    stall = t_iter
    first = None
    batches = nbytes = 0
    waits = []
    while True:
        t = clock()
        try:
            got = next(it)
        except StopIteration:
            stall += clock() - t
            break
        dt = clock() - t
        stall += dt
        if first is None:
            first = t_iter + dt
        waits.append(dt)
        batches += 1
        nbytes += got
        if compute:
            time.sleep(compute)
    epoch = clock() - t0
    busy, _ = reader.busy_between(cpu0, reader.machine_cpu())
    waits.sort()
    print(json.dumps({
        "mode": a.mode, "batches": batches, "files": len(order), "bytes": nbytes,
        "batch": a.batch, "workers": a.workers, "compute_ms": a.compute_ms,
        "epoch_s": round(epoch, 4), "stall_s": round(stall, 4),
        "first_batch_s": round(first or 0.0, 4), "stall_after_first_s": round(stall - (first or 0), 4),
        "iter_s": round(t_iter, 4), "compute_s": round(batches * compute, 4),
        "wait_ms_p50": reader._ms(reader.percentile(waits, 50)),
        "wait_ms_p99": reader._ms(reader.percentile(waits, 99)),
        "files_per_s": round(len(order) / epoch, 1), "cpu_busy_pct": busy,
    }), flush=True)
    return 0


# ------------------------------------------------------------------------------ the run


class Bench(common.RowLog):
    def __init__(self, a: argparse.Namespace) -> None:
        self.a = a
        self.work = os.path.abspath(a.work)
        self.lists = os.path.join(self.work, "lists")
        self.store = os.path.join(self.work, "store")
        self.mnt_root = os.path.join(self.work, "mnt")
        self.py = sys.executable
        self.fanstore = a.fanstore or _find_fanstore()
        self.rows: list[dict] = []
        self.commands: list[str] = []
        self.mounted: dict[str, int | None] = {}
        self.run_id = time.strftime("%Y%m%dT%H%M%S")
        self.t_start = time.time()
        self.jsonl_tmp = os.path.join(self.work, f"prefetch_bench-{self.run_id}.jsonl")
        self.total_seconds = 0.0
        self.factors: list[float | None] = []

    def cmd(self, text: str) -> None:
        text = text.replace(self.work, "WORK")
        if text not in self.commands:
            self.commands.append(text)

    # -------------------------------------------------------------- mounts
    def mnt(self, kind: str) -> str:
        return os.path.join(self.mnt_root, kind)

    def mount(self, kind: str) -> int | None:
        """A fresh mount of the store (``sync`` or ``prefetch``); returns the daemon pid."""
        self.umount(kind)
        mnt = self.mnt(kind)
        os.makedirs(mnt, exist_ok=True)
        argv = [self.fanstore, "mount", self.store, mnt]
        if kind == "prefetch":
            argv += ["--mode", "prefetch", "--prefetch-mb", str(self.prefetch_mb)]
        self.cmd(" ".join(shlex.quote(x) for x in argv))
        p = subprocess.run(argv, capture_output=True, text=True, timeout=120)
        if p.returncode != 0 or not is_mounted(mnt):
            raise RuntimeError(f"fanstore mount failed: {p.stderr.strip()[-500:]}")
        pid = state_pid(mnt)
        self.mounted[kind] = pid
        return pid

    def umount(self, kind: str) -> None:
        mnt = self.mnt(kind)
        pid = self.mounted.pop(kind, None)
        if not is_mounted(mnt):
            return
        self.cmd(f"{self.fanstore} umount {mnt}")
        p = subprocess.run([self.fanstore, "umount", mnt], capture_output=True, text=True,
                           timeout=90)
        if p.returncode != 0 or is_mounted(mnt):
            log(f"  fanstore umount {mnt} failed ({p.stderr.strip()}); lazy fusermount3 -u -z")
            subprocess.run(["fusermount3", "-u", "-z", "--", mnt], capture_output=True)
        deadline = time.monotonic() + 30
        while pid and pid_alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)

    def cold(self, mode: str) -> int | None:
        """Fresh mount for the mode (if it needs one; the other mount is unmounted) and
        dropped caches."""
        kind = MOUNT_OF.get(mode)
        for other in ("sync", "prefetch"):
            if other != kind:
                self.umount(other)
        pid = self.mount(kind) if kind else None
        common.drop_caches()
        return pid

    def run_sub(self, argv: list[str], timeout: float) -> dict:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
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
        return {"errors": 1, "first_error": f"exit {proc.returncode}: {err.strip()[-400:]}"}

    def pstats(self, mode: str) -> dict | None:
        kind = MOUNT_OF.get(mode)
        return control(self.mnt(kind), {"op": "stats"}) if kind else None

    # -------------------------------------------------------------- phases
    def run(self) -> None:
        a = self.a
        os.makedirs(self.mnt_root, exist_ok=True)
        self.machine = common.machine_table(self.work)
        log(f"work dir {self.work}; load average {os.getloadavg()[0]:.2f}")
        data, small, gen_cmd = ensure_dataset(self.py, self.work, a.files, a.classes, a.min_kb,
                                              a.max_kb, a.seed)
        self.data = data
        self.files = small
        self.cmd(gen_cmd)
        info, pack_cmd = pack_store(self.fanstore, data, self.store, a.partitions, a.codec,
                                    a.jobs, a.reuse_store)
        self.cmd(pack_cmd)
        raw = (info.get("counts") or {}).get("raw_bytes") or 0
        self.prefetch_mb = a.prefetch_mb or max(16, int(raw / 2**20 * a.prefetch_fraction))
        self.emit({"kind": "store", "files": len(small), "raw_bytes": raw,
                   "stored_bytes": (info.get("counts") or {}).get("stored_bytes"),
                   "ratio": info.get("ratio"), "pack_seconds": info.get("pack_seconds"),
                   "prefetch_mb": self.prefetch_mb,
                   "params": dict(files=a.files, classes=a.classes, min_kb=a.min_kb,
                                  max_kb=a.max_kb, seed=a.seed, partitions=a.partitions,
                                  codec=a.codec)})
        os.makedirs(self.lists, exist_ok=True)
        self.files_list = os.path.join(self.lists, "files.txt")
        with open(self.files_list, "w") as f:
            f.write("".join(p + "\n" for p in small))
        log(f"{len(small)} files, {raw / 1e6:.0f} MB raw; prefetch budget {self.prefetch_mb} MiB "
            f"({self.prefetch_mb * 2**20 / max(1, raw):.0%} of the dataset)")
        if "read" in a.phases:
            self.read_passes()
        if "loader" in a.phases:
            self.loader_epochs()
        self.check()
        self.total_seconds = time.time() - self.t_start

    def epoch_list(self, rep: int) -> str:
        path = os.path.join(self.lists, f"epoch-{rep}.txt")
        order = list(self.files)
        random.Random(rep).shuffle(order)
        with open(path, "w") as f:
            f.write("".join(p + "\n" for p in order))
        return path

    def read_passes(self) -> None:
        a = self.a
        log(f"read passes: modes {' '.join(a.modes)}, readers {a.workers}, {a.reps} reps, cold")
        for rep in range(1, a.reps + 1):
            lst = self.epoch_list(rep)
            for wk in a.workers:
                k = (rep - 1 + wk) % len(a.modes)
                for mode in a.modes[k:] + a.modes[:k]:
                    self.one_pass(mode, wk, rep, lst)

    def one_pass(self, mode: str, workers: int, rep: int, lst: str) -> None:
        pid = self.cold(mode)
        kind = MOUNT_OF.get(mode)
        root = self.mnt(kind) if kind else self.data
        argv = [self.py, ME, "_pass", "--mode", mode, "--root", root, "--list", lst,
                "--workers", str(workers)]
        if mode == "api-store":
            argv += ["--store", self.store]
        if kind:
            argv += ["--mount", self.mnt(kind)]
        shown = " ".join(shlex.quote(x) for x in argv).replace(lst, "WORK/lists/epoch-REP.txt")
        self.cmd(shown)
        if pid:
            argv += ["--watch-pid", str(pid)]
        before = self.pstats(mode)
        load = common.loadavg1()
        row = self.run_sub(argv, timeout=a_timeout(self.a))
        after = self.pstats(mode)
        row.update(kind="pass", mode=mode, workers=workers, rep=rep, load1_before=load)
        if before and after:
            row["daemon"] = {k: after[k] - before[k] for k in after
                             if isinstance(after.get(k), (int, float))
                             and isinstance(before.get(k), (int, float))}
        if pid and not pid_alive(pid):
            row["daemon_died"] = True
        self.emit(row)
        d = row.get("daemon") or {}
        pf = (f", prefetch hits/late/misses {d.get('prefetch_hits')}/{d.get('prefetch_late')}/"
              f"{d.get('prefetch_misses')}" if "prefetch_hits" in d else "")
        log(f"  rep {rep} w={workers} {mode:<13}: {row.get('files_per_s')} files/s, "
            f"CPU {row.get('cpu_busy_pct')} %{pf}"
            + (f"  ERRORS {row['errors']}: {row.get('first_error')}" if row.get("errors") else ""))

    def loader_epoch(self, mode: str, rep: int, lst: str, compute_ms: float, tag: str,
                     factor: float | None = None) -> dict:
        pid = self.cold(mode)
        kind = MOUNT_OF.get(mode)
        argv = [self.py, ME, "_loader", "--mode", mode, "--files", self.files_list, "--order",
                lst, "--batch", str(self.a.batch), "--workers", str(self.a.dl_workers),
                "--compute-ms", f"{compute_ms:.3f}"]
        if mode in ("raw", "fuse-sync"):
            argv += ["--root", self.mnt(kind) if kind else self.data]
        elif mode == "api-store":
            argv += ["--store", self.store]
        else:
            argv += ["--mount", self.mnt(kind)]
        self.cmd(" ".join(shlex.quote(x) for x in argv)
                 .replace(lst, "WORK/lists/epoch-REP.txt")
                 .replace(f"{compute_ms:.3f}", "C" if tag == "dl" else "0.000"))
        before = self.pstats(mode)
        load = common.loadavg1()
        cpu0 = reader.process_cpu_seconds(pid) if pid else None
        row = self.run_sub(argv, timeout=a_timeout(self.a))
        cpu1 = reader.process_cpu_seconds(pid) if pid else None
        after = self.pstats(mode)
        row.update(kind=tag, mode=mode, rep=rep, load1_before=load, factor=factor)
        if cpu0 is not None and cpu1 is not None:
            row["daemon_cpu_s"] = round(cpu1 - cpu0, 3)
        if before and after:
            row["daemon"] = {k: after[k] - before[k] for k in after
                             if isinstance(after.get(k), (int, float))
                             and isinstance(before.get(k), (int, float))}
        if pid and not pid_alive(pid):
            row["daemon_died"] = True
        self.emit(row)
        d = row.get("daemon") or {}
        pf = (f", prefetch hits/late/misses {d.get('prefetch_hits')}/{d.get('prefetch_late')}/"
              f"{d.get('prefetch_misses')}" if "prefetch_hits" in d else "")
        log(f"  {tag}{'' if factor is None else f' x{factor:g}'} rep {rep} {mode:<13}: epoch {row.get('epoch_s')} s, stall "
            f"{row.get('stall_s')} s (first batch {row.get('first_batch_s')} s){pf}"
            + (f"  ERRORS: {row.get('first_error')}" if row.get("errors") else ""))
        return row

    def loader_epochs(self) -> None:
        a = self.a
        log(f"DataLoader: batch {a.batch}, {a.dl_workers} workers; calibrating the compute time "
            "on fuse-sync without compute")
        base_rep = 100
        per_batch = []
        for rep in range(1, a.calib_reps + 1):
            lst = self.epoch_list(base_rep + rep)
            row = self.loader_epoch("fuse-sync", base_rep + rep, lst, 0.0, "calib")
            if row.get("batches"):
                per_batch.append(row["epoch_s"] / row["batches"])
        if a.compute_ms is not None:
            self.factors = [None]
            computes = {None: a.compute_ms}
        elif per_batch:
            self.factors = list(a.compute_factors)
            computes = {f: round(common.med(per_batch) * 1e3 * f, 2) for f in self.factors}
        else:
            raise RuntimeError("calibration epoch failed; pass --compute-ms")
        for f in self.factors:
            self.emit({"kind": "compute", "compute_ms": computes[f], "factor": f,
                       "sync_per_batch_ms": [round(x * 1e3, 2) for x in per_batch]})
        log("  compute per batch: " + ", ".join(f"{computes[f]} ms" + ("" if f is None else
                                                 f" (x{f:g})") for f in self.factors))
        for f in self.factors:
            for rep in range(1, a.dl_reps + 1):
                lst = self.epoch_list(base_rep + 10 + rep)
                k = (rep - 1) % len(a.dl_modes)
                for mode in a.dl_modes[k:] + a.dl_modes[:k]:
                    self.loader_epoch(mode, rep, lst, computes[f], "dl", f)

    def check(self) -> None:
        """Spot-check bytes of a sample through every FanStore path against the raw files."""
        import fanstore

        sample = random.Random(3).sample(self.files, min(self.a.verify_sample, len(self.files)))
        results = {}
        for mode in ("fuse-sync", "fuse-prefetch", "api-store", "api-prefetch"):
            if mode not in self.a.modes and mode not in self.a.dl_modes:
                continue
            self.cold(mode)
            bad, err = 0, None
            store = None
            try:
                if mode == "api-store":
                    store = fanstore.open_store(self.store)
                elif mode == "api-prefetch":
                    store = fanstore.open_store(self.mnt("prefetch"))
                    store.prefetch(sample)
                elif mode == "fuse-prefetch":
                    control(self.mnt("prefetch"), {"op": "prefetch", "paths": sample,
                                                   "client": "check"})
                for rel in sample:
                    with open(os.path.join(self.data, rel), "rb") as f:
                        want = f.read()
                    if store is not None:
                        got = store.read(rel)
                    else:
                        with open(os.path.join(self.mnt(MOUNT_OF[mode]), rel), "rb") as f:
                            got = f.read()
                    if got != want:
                        bad += 1
            except Exception as exc:  # noqa: BLE001
                err = f"{type(exc).__name__}: {exc}"
            finally:
                if store is not None:
                    store.close()
            results[mode] = {"checked": len(sample), "differ": bad, "error": err}
        for kind in ("sync", "prefetch"):
            self.umount(kind)
        self.emit({"kind": "check", "results": results})
        log(f"correctness: {results}")

    def cleanup(self) -> None:
        for kind in ("sync", "prefetch"):
            try:
                self.umount(kind)
            except Exception as exc:  # noqa: BLE001
                log(f"  cleanup of {kind} failed: {exc}")
            if is_mounted(self.mnt(kind)):
                subprocess.run(["fusermount3", "-u", "-z", "--", self.mnt(kind)], capture_output=True)
            try:
                os.rmdir(self.mnt(kind))
            except OSError:
                pass
        if self.a.clean:
            shutil.rmtree(self.work, ignore_errors=True)


def a_timeout(a) -> float:
    return a.pass_limit + 120


# ------------------------------------------------------------------------------ report


def section(bench: Bench, label: str | None, argv: list[str]) -> str:
    rows = bench.rows
    a = bench.a

    pick = functools.partial(common.pick_rows, rows)
    vals = functools.partial(common.row_vals, rows)

    def dsum(rs: list[dict], key: str) -> list[float]:
        return [(r.get("daemon") or {}).get(key) for r in rs if (r.get("daemon") or {}).get(key)
                is not None]

    out: list[str] = []
    w = out.append
    w("## Prefetch mode and the Python API (`tools/bench/prefetch_bench.py`)")
    w("")
    if label:
        w(f"> **{label}**")
        w("")
    st = pick(kind="store")[0]
    p = st["params"]
    w(f"Run {bench.run_id} ({common.now_utc()}), {bench.total_seconds / 60:.1f} min in all. "
      "Every mode was measured in this same run, interleaved (the order of the modes rotates "
      "from repetition to repetition); **only compare rows of this one run** (the machine is "
      "shared: cold passes spread by about ±20%, treat smaller differences as noise). Raw "
      "rows: `tools/bench/results/prefetch_bench.jsonl`. Rerun: "
      f"`{' '.join(argv)}` (as root).")
    w("")
    w("### Machine")
    w("")
    w(bench.machine)
    w("")
    w("### Dataset")
    w("")
    w(f"`tools/gen_dataset.py` (seed {p['seed']}): {st['files']:,} files of "
      f"{p['min_kb']}-{p['max_kb']} kB in {p['classes']} class directories "
      f"({st['raw_bytes'] / 1e6:,.0f} MB), packed with `--partitions {p['partitions']} --codec "
      f"{p['codec']}` ({(st.get('stored_bytes') or 0) / 1e6:,.0f} MB stored, ratio "
      f"{st.get('ratio') or 0:.2f}). Prefetch mounts: `--mode prefetch --prefetch-mb "
      f"{st['prefetch_mb']}` = {st['prefetch_mb'] * 2**20 / max(1, st['raw_bytes']):.0%} of the "
      "dataset, so the buffer cannot hold the epoch: ordering and eviction matter. MB = 10^6 "
      "bytes.")
    w("")

    # ---- targets
    comp = pick(kind="compute")
    factors = bench.factors or [None]
    tight = factors[0]
    w("### Targets")
    w("")
    w("| target | measured | goal | status |")
    w("| --- | --- | ---: | --- |")
    for wk in a.workers:
        api = common.med(vals("files_per_s", kind="pass", mode="api-store", workers=wk))
        raw = common.med(vals("files_per_s", kind="pass", mode="raw", workers=wk))
        if api and raw:
            w(f"| Python API on the store at least as fast as the raw directory, cold, {wk} "
              f"reader(s) | {api / raw:.2f}x ({api:,.0f} vs {raw:,.0f} files/s) | ≥ 1.0 | "
              f"{common.check(api >= raw)} |")
    for f in factors:
        stall_sync = common.med(vals("stall_s", kind="dl", mode="fuse-sync", factor=f))
        steady_sync = common.med(vals("stall_after_first_s", kind="dl", mode="fuse-sync",
                                      factor=f))
        budget = ("tight budget" if f == tight else "input-bound") + (
            "" if f is None else f", compute = {f:g} x sync per-batch time")
        for mode in ("fuse-prefetch", "api-prefetch"):
            s = common.med(vals("stall_s", kind="dl", mode=mode, factor=f))
            if s is not None and stall_sync:
                removed = 1 - s / stall_sync
                w(f"| {mode} removes at least 80% of the sync-mode stall (DataLoader, {budget}) "
                  f"| {removed:.0%} ({s:.2f} s vs {stall_sync:.2f} s) | ≥ 80% | "
                  + (common.check(removed >= 0.8) if f == tight else "(info)") + " |")
            s2 = common.med(vals("stall_after_first_s", kind="dl", mode=mode, factor=f))
            if s2 is not None and steady_sync:
                removed = 1 - s2 / steady_sync
                w(f"| (same, stall after the first batch only: worker start-up left out) "
                  f"| {removed:.0%} ({s2:.2f} s vs {steady_sync:.2f} s) | ≥ 80% | "
                  + (common.check(removed >= 0.8) if f == tight else "(info)") + " |")
    w("")

    # ---- read passes
    w("### Files/s for the same shuffled epoch (cold)")
    w("")
    w("Each pass reads every file once in the repetition's shuffled order; reader processes "
      "take round-robin shares (DataLoader-style) and start together behind a barrier, wall "
      "time from the release to the last reader done. Cold = `drop_caches` and a fresh mount "
      "before every pass. API readers open the store (or the mount) before the barrier; the "
      "prefetch order is sent when the readers are released, inside the timed pass (its "
      "cost is the `order s` column). CPU = whole machine (2 cores, daemon included); daemon "
      f"µs/file = the FanStore daemon's CPU per file. Cells: median (min–max) over {a.reps} "
      "repetition(s). `vs raw` = median files/s over raw's, same readers.")
    w("")
    w("| mode | readers | files/s | MB/s | p50 / p99 ms | CPU % | daemon µs/file | order s | "
      "prefetch hits / late / misses | vs raw | vs fuse-sync |")
    w("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for wk in a.workers:
        raw = common.med(vals("files_per_s", kind="pass", mode="raw", workers=wk))
        sync = common.med(vals("files_per_s", kind="pass", mode="fuse-sync", workers=wk))
        for mode in a.modes:
            q = dict(kind="pass", mode=mode, workers=wk)
            rs = pick(**q)
            if not rs:
                continue
            fs = vals("files_per_s", **q)
            err = sum(r.get("errors") or 0 for r in rs)
            pf = "–"
            if MOUNT_OF.get(mode) == "prefetch":
                pf = (f"{common.num(common.med(dsum(rs, 'prefetch_hits')))} / "
                      f"{common.num(common.med(dsum(rs, 'prefetch_late')))} / "
                      f"{common.num(common.med(dsum(rs, 'prefetch_misses')))}")
            note = f" ⚠ {err} errors: {next(r.get('first_error') for r in rs if r.get('errors'))}"[:120] \
                if err else ""
            w(f"| {mode}{note} | {wk} | {common.spread(fs)} | "
              f"{common.spread(vals('MB_per_s', **q))} | "
              f"{common.num(common.med(vals('lat_ms_p50', **q)), 2)} / "
              f"{common.num(common.med(vals('lat_ms_p99', **q)), 1)} | "
              f"{common.num(common.med(vals('cpu_busy_pct', **q)))} | "
              f"{common.num(common.med(vals('daemon_cpu_us_per_file', **q)))} | "
              f"{common.num(common.med(vals('order_send_s', **q)), 3)} | {pf} | "
              f"{common.ratio(common.med(fs), raw)} | {common.ratio(common.med(fs), sync)} |")
    w("")

    # ---- daemon counters
    w("### FanStore daemon counters per file read (read passes)")
    w("")
    w("Differences of the mount's `fanstore stats` across each pass, divided by the files "
      "read (medians over the passes). `opens` / `reads` = OPEN and READ requests that reached "
      "the daemon (API reads arrive as `reads`); `pushed` = files decoded at OPEN and pushed "
      "into the page cache (`pushed_at_open`); `decoded` = chunks decompressed in the daemon "
      "(the API on the store decodes in the readers instead); `prefetched` = files the "
      "prefetcher fetched (`prefetch_files`); `hits` = reads served from its buffer.")
    w("")
    w("| mode | readers | opens | reads | pushed | decoded | prefetched | hits | late | misses "
      "| MB evicted unused |")
    w("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for wk in a.workers:
        for mode in a.modes:
            rs = [r for r in pick(kind="pass", mode=mode, workers=wk)
                  if r.get("daemon") and r.get("files")]
            if not rs:
                continue

            def per(key, rs=rs):
                v = [(r["daemon"].get(key) or 0) / r["files"] for r in rs]
                return common.num(common.med(v), 2)

            ev = common.med([(r["daemon"].get("prefetch_bytes_evicted_unused") or 0) / 1e6
                             for r in rs])
            pfm = MOUNT_OF.get(mode) == "prefetch"
            w(f"| {mode} | {wk} | {per('opens')} | {per('reads')} | {per('pushed_at_open')} | "
              f"{per('chunks_decoded')} | {per('prefetch_files') if pfm else '–'} | "
              f"{per('prefetch_hits') if pfm else '–'} | {per('prefetch_late') if pfm else '–'} | "
              f"{per('prefetch_misses') if pfm else '–'} | "
              f"{common.num(ev, 1) if pfm else '–'} |")
    w("")

    # ---- DataLoader
    w("### DataLoader with a fixed compute time per batch")
    w("")
    calib = comp[0]["sync_per_batch_ms"] if comp else []
    cms = {r.get("factor"): r["compute_ms"] for r in comp}
    w(f"`DataLoader(dataset, batch_size={a.batch}, num_workers={a.dl_workers})` (default "
      "prefetch_factor 2, fork), the epoch order given by a fixed-order sampler, "
      "`collate_fn` = the batch's byte count (no tensor work). The loop sleeps a fixed "
      "compute time per batch, a multiple of the per-batch time of a cold sync-mode epoch "
      "with no compute (calibration: "
      f"{', '.join(f'{x:.1f}' for x in calib) or '–'} ms/batch): x1 = the tight budget, where "
      "the sync pipeline just keeps up (the target is judged there; the sleeping loop leaves "
      "the CPU to the workers, so the 4 workers hide most of the input time already); x0.5 = "
      "input-bound, where the input pipeline is the bottleneck and the stall shows how fast "
      "each mode delivers. Stall = time the loop waits in `next()` (including "
      "`iter(loader)`, which forks the workers and, with `PrefetchSampler`, sends the "
      "order); ideal epoch = batches x compute. Every epoch cold (dropped caches, fresh "
      "mount), a fresh process per epoch. Cells: median (min–max) over "
      f"{a.dl_reps} repetition(s). `removed` = 1 - stall / stall of fuse-sync (medians, same "
      "compute); `removed after 1st batch` leaves out the first batch (worker start-up, "
      "which no storage mode can hide).")
    w("")
    how = {"raw": "plain files, `open().read()`",
           "fuse-sync": "sync mount, `open().read()`",
           "fuse-prefetch": "prefetch mount, `open().read()`, `PrefetchSampler`",
           "api-prefetch": "`FanStoreDataset(open_store(MNT))`, `PrefetchSampler`",
           "api-store": "`FanStoreDataset(open_store(STORE))`"}
    for f in factors:
        cm = cms.get(f)
        nb = common.med(vals("batches", kind="dl", factor=f))
        stall_sync = common.med(vals("stall_s", kind="dl", mode="fuse-sync", factor=f))
        steady_sync = common.med(vals("stall_after_first_s", kind="dl", mode="fuse-sync",
                                      factor=f))
        w(f"**Compute {common.num(cm, 1)} ms per batch"
          + ("" if f is None else f" (x{f:g}" + (", tight budget)" if f == tight else ")"))
          + f"**; ideal epoch {common.num((nb or 0) * (cm or 0) / 1e3, 2)} s.")
        w("")
        w("| mode | dataset / reads | epoch s | stall s | stall after 1st batch s | first "
          "batch s | wait p50 / p99 ms | CPU % | daemon CPU s | prefetch hits / late / misses "
          "| MB evicted unused | removed | removed after 1st batch |")
        w("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: "
          "| ---: |")
        for mode in a.dl_modes:
            q = dict(kind="dl", mode=mode, factor=f)
            rs = pick(**q)
            if not rs:
                continue
            s = common.med(vals("stall_s", **q))
            s2 = common.med(vals("stall_after_first_s", **q))
            err = [r.get("first_error") for r in rs if r.get("errors")]
            pf, ev = "–", "–"
            if MOUNT_OF.get(mode) == "prefetch":
                pf = (f"{common.num(common.med(dsum(rs, 'prefetch_hits')))} / "
                      f"{common.num(common.med(dsum(rs, 'prefetch_late')))} / "
                      f"{common.num(common.med(dsum(rs, 'prefetch_misses')))}")
                ev = common.num(common.med(
                    [x / 1e6 for x in dsum(rs, "prefetch_bytes_evicted_unused")] or [0]), 1)
            w(f"| {mode}{' ⚠ ' + str(err[0])[:100] if err else ''} | {how[mode]} | "
              f"{common.spread(vals('epoch_s', **q), 2)} | "
              f"{common.spread(vals('stall_s', **q), 2)} | {common.num(s2, 2)} | "
              f"{common.num(common.med(vals('first_batch_s', **q)), 2)} | "
              f"{common.num(common.med(vals('wait_ms_p50', **q)), 1)} / "
              f"{common.num(common.med(vals('wait_ms_p99', **q)), 0)} | "
              f"{common.num(common.med(vals('cpu_busy_pct', **q)))} | "
              f"{common.num(common.med(vals('daemon_cpu_s', **q)), 2)} | {pf} | {ev} | "
              + (f"{1 - s / stall_sync:.0%}" if s is not None and stall_sync else "–") + " | "
              + (f"{1 - s2 / steady_sync:.0%}" if s2 is not None and steady_sync else "–")
              + " |")
        w("")

    # ---- correctness
    w("### Correctness and errors")
    w("")
    for r in pick(kind="check"):
        for mode, res in r["results"].items():
            w(f"- {mode}: {res['checked']} files compared with the raw files: "
              + ("**error: " + res["error"] + "**" if res.get("error") else
                 ("all identical" if not res["differ"] else f"**{res['differ']} differ**")))
    errs = [r for r in rows if r.get("errors") and r.get("kind") in ("pass", "dl", "calib")]
    w(f"- passes or epochs with errors: {len(errs)}"
      + (f" (first: {errs[0].get('first_error')})" if errs else ""))
    for r in rows:
        if r.get("daemon_died"):
            w(f"- **the daemon died during {r['kind']} {r.get('mode')} rep {r.get('rep')}**")
    w("")
    w("### Exact commands")
    w("")
    w("```")
    w("# drop_caches = sync; echo 3 > /proc/sys/vm/drop_caches (before every pass and epoch, "
      "after the fresh mount); WORK = the work directory")
    w("# fuse-prefetch: the order goes over as {\"op\": \"prefetch\", \"paths\": ORDER} on the "
      "mount's control socket, what `fanstore prefetch WORK/mnt/prefetch --list "
      "WORK/lists/epoch-REP.txt` sends")
    for c in bench.commands:
        w(c.replace(common.REPO + "/", ""))
    w("```")
    return "\n".join(out)


# ------------------------------------------------------------------------------ main


def parse_args(argv: list[str] | None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="full")
    ap.add_argument("--work", default=os.environ.get("FANSTORE_PREFETCHBENCH_WORK",
                                                     "/tmp/fanstore-prefetchbench"),
                    help="work directory (default /tmp/fanstore-prefetchbench)")
    ap.add_argument("--files", type=int)
    ap.add_argument("--classes", type=int)
    ap.add_argument("--min-kb", type=int, default=50)
    ap.add_argument("--max-kb", type=int, default=150)
    ap.add_argument("--seed", type=int, default=20240601)
    ap.add_argument("--codec", default="zstd:3")
    ap.add_argument("--partitions", type=int, default=8)
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--phases", default="read,loader", help="read, loader (default both)")
    ap.add_argument("--modes", default=",".join(MODES), help="modes of the read passes")
    ap.add_argument("--dl-modes", default="raw,fuse-sync,fuse-prefetch,api-prefetch,api-store",
                    help="modes of the DataLoader epochs")
    ap.add_argument("--workers", default="1,4", help="reader processes of the read passes")
    ap.add_argument("--reps", type=int, help="read-pass repetitions (one shuffle each)")
    ap.add_argument("--prefetch-fraction", type=float, default=0.25,
                    help="prefetch budget as a fraction of the raw dataset (default 0.25)")
    ap.add_argument("--prefetch-mb", type=int, help="prefetch budget in MiB (overrides)")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--dl-workers", type=int, default=4)
    ap.add_argument("--dl-reps", type=int, help="DataLoader repetitions per mode")
    ap.add_argument("--calib-reps", type=int, help="calibration epochs (sync, no compute)")
    ap.add_argument("--compute-factors", default="1.0,0.5",
                    help="compute per batch = factor x the calibrated sync per-batch time; "
                         "one set of DataLoader epochs per factor; the first is the tight "
                         "budget the target is judged on (default 1.0,0.5)")
    ap.add_argument("--compute-ms", type=float,
                    help="fixed compute per batch (one set; skips the calibration)")
    ap.add_argument("--pass-limit", type=float, default=900.0)
    ap.add_argument("--verify-sample", type=int, default=200)
    ap.add_argument("--reuse-store", action="store_true")
    ap.add_argument("--label")
    ap.add_argument("--docs", default=common.DOCS)
    ap.add_argument("--results", default=os.path.join(common.RESULTS_DIR, "prefetch_bench.jsonl"))
    ap.add_argument("--no-docs", action="store_true")
    ap.add_argument("--fanstore")
    ap.add_argument("--clean", action="store_true")
    a = ap.parse_args(argv)
    for key, value in PRESETS[a.preset].items():
        if getattr(a, key, None) is None:
            setattr(a, key, value)
    a.workers = [int(x) for x in a.workers.split(",") if x.strip()]
    a.modes = [m.strip() for m in a.modes.split(",") if m.strip()]
    a.dl_modes = [m.strip() for m in a.dl_modes.split(",") if m.strip()]
    bad = [m for m in a.modes + a.dl_modes if m not in MODES]
    if bad:
        ap.error(f"unknown mode(s) {bad}; known: {MODES}")
    a.phases = {x.strip() for x in a.phases.split(",") if x.strip()}
    a.compute_factors = [float(x) for x in a.compute_factors.split(",") if x.strip()]
    if a.label is None and a.preset == "quick":
        a.label = ("SMOKE RUN (--preset quick: small dataset, 1 read pass and 2 DataLoader "
                   "epochs per cell, on a machine shared with other jobs and test suites): it "
                   "shows the harness works end to end; the numbers are not results. Run "
                   "`--preset full` on a quiet machine for real numbers.")
    return a


def main(argv: list[str] | None = None) -> int:
    raw_argv = sys.argv[1:] if argv is None else argv
    if raw_argv and raw_argv[0] == "_pass":
        return pass_main(raw_argv[1:])
    if raw_argv and raw_argv[0] == "_loader":
        return loader_main(raw_argv[1:])
    a = parse_args(raw_argv)
    if os.geteuid() != 0:
        print("prefetch_bench: run as root (drop_caches and FUSE mounts)", file=sys.stderr)
        return 2
    bench = Bench(a)
    ok = common.guarded_run(
        bench, log, lambda: [k for k in ("sync", "prefetch") if is_mounted(bench.mnt(k))])
    return common.publish(ok, bench, a, log, SECTION, section, "tools/bench/prefetch_bench.py",
                          raw_argv)


if __name__ == "__main__":
    sys.exit(main())
