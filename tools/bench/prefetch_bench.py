#!/usr/bin/env python3
"""Prefetch mode (kernel frontend) next to the raw directory, the sync mount and the Python API.

The benchmark of the issue "Prefetch mode that removes the input stall, on the kernel
frontend". One dataset (tools/gen_dataset.py), one store (``fanstore pack``); every mode of
a phase is measured in the same run, interleaved, every pass and epoch cold (``sync; echo 3
> /proc/sys/vm/drop_caches`` and a fresh mount before it). Modes:

- ``raw``             the source directory, ``open(); f.read(); close()`` per file;
- ``fuse-sync``       a FanStore mount in sync mode, plain file reads;
- ``fuse-prefetch``   a mount with ``--mode prefetch --prefetch-mb B`` (B a fraction of the
                      dataset); the order (the ``prefetch`` control request, what
                      ``fanstore prefetch MNT --list FILE`` sends) goes over when the readers
                      start; plain file reads;
- ``fuse-prefetched`` the same mount, the dataset's directories listed and the order given
                      *before* the timed pass, which starts once the prefetch is done (the
                      prefetch time is reported apart): what the page cache gives a reader
                      when the order was known in time;
- ``api-store``       ``fanstore.open_store(STORE).read(path)``: decoded in the readers;
- ``api-prefetch``    ``fanstore.open_store(MNT)`` on the prefetch mount, ``.prefetch(order)``
                      when the readers start.

Phases:

1. **read**: each mode with 1 and 4 reader processes released by one barrier, each taking a
   round-robin share of the epoch order (DataLoader-style).
2. **serial**: a reader that does not pipeline: one process reads the order file by file
   and sleeps a fixed compute time after each (= the sync mount's read time per file,
   measured in phase 1 with one reader); stall = time spent reading.
3. **loader**: ``DataLoader(batch_size=32, num_workers=4)`` with a fixed compute time per
   batch (factor x the calibrated sync per-batch time; 1.0 = tight, 0.5 = input-bound);
   ``fanstore.torch.PrefetchSampler`` on the prefetch modes; stall = time in ``next()``.
4. **ranks**: the serial reader on rank 0 of a 2-rank job (``mpiexec -n 2 fanstore mount
   ... --mode prefetch``, half of the files held by the other rank, fetched by rank 0's
   worker ranks), against the same reader on a 1-rank prefetch mount.

Measured besides rates: the CPU of every FanStore process per file (daemon, frontend
process, workers; in the 2-rank job every FanStore process of the job), the READ requests
that reached a worker per file, and the memory of the FanStore processes (sum of RSS and
of PSS, sampled every 50 ms) against the mount's base and ``--prefetch-mb``.

It writes its section of docs/benchmarks.md (``<!-- BEGIN prefetch_bench -->``) and the raw
rows to tools/bench/results/prefetch_bench.jsonl. Every mount and job it makes is stopped on
exit, also on errors and Ctrl-C / SIGTERM. Run as root (drop_caches, FUSE).

    .venv/bin/python tools/bench/prefetch_bench.py --preset quick   # a smoke run, ~3 min
    .venv/bin/python tools/bench/prefetch_bench.py --preset full    # ~15-20 min
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import queue as _queue
import random
import shlex
import shutil
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
import reader  # noqa: E402
from mount_bench import _find_fanstore, _kill_group, is_mounted, log, pid_alive  # noqa: E402
from mpi_bench import Job, control, ensure_dataset, pack_store, state_pid  # noqa: E402

ME = os.path.abspath(__file__)
SECTION = "prefetch_bench"
MODES = ["raw", "fuse-sync", "fuse-prefetch", "fuse-prefetched", "api-store", "api-prefetch"]
MOUNT_OF = {"fuse-sync": "sync", "fuse-prefetch": "prefetch", "fuse-prefetched": "prefetch",
            "api-prefetch": "prefetch"}
ORDER_AT_START = ("fuse-prefetch", "api-prefetch")  # the order is sent when reading starts

PRESETS = {
    # A smoke run: the harness end to end in a few minutes; numbers are not results.
    "quick": dict(files=3000, classes=30, reps=1, dl_reps=2, calib_reps=1, serial_reps=1),
    # For a quiet machine.
    "full": dict(files=10000, classes=100, reps=3, dl_reps=3, calib_reps=2, serial_reps=2),
}


# ------------------------------------------------------------------------------ readers
# (run as `prefetch_bench.py _pass|_serial|_loader ...`, own process group; one JSON row)


def _send_order(mode: str, mount: str, rels: list[str], store=None):
    """The order of the epoch, as the mode's reader gives it: (reply, seconds)."""
    t0 = time.perf_counter()
    if mode == "fuse-prefetch":
        from fanstore import control as ctl

        reply = ctl.control(mount, {"op": "prefetch", "paths": rels,
                                    "client": "prefetch_bench"}, timeout=300)
    else:
        reply = store.prefetch(rels)
    return reply, time.perf_counter() - t0


def _read_one(store, root: str, rel: str) -> int:
    if store is not None:
        return len(store.read(rel))
    with open(os.path.join(root, rel), "rb") as f:
        return len(f.read())


def _share(mode, root, rels, api_path, barrier, queue) -> None:
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
    nbytes = errors = 0
    first_error = None
    start = clock()
    for rel in rels:
        t = clock()
        try:
            nbytes += _read_one(store, root, rel)
        except Exception as exc:  # noqa: BLE001 - OSError or FanStoreError
            errors += 1
            first_error = first_error or f"{rel}: {type(exc).__name__}: {exc}"
        lat.append(clock() - t)
    queue.put({"done": len(rels), "bytes": nbytes, "errors": errors,
               "first_error": first_error, "lat": lat, "start": start, "end": clock()})


def pass_main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="prefetch_bench.py _pass")
    ap.add_argument("--mode", required=True, choices=MODES)
    ap.add_argument("--root", required=True, help="directory the list is relative to")
    ap.add_argument("--list", required=True)
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--store", help="the packed store (api-store)")
    ap.add_argument("--mount", help="the mount (order / api-prefetch)")
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
    order_s = order_reply = None
    finished = False
    try:
        cpu0 = reader.machine_cpu()
        barrier.wait(timeout=300)
        t0 = time.perf_counter()
        if a.mode in ORDER_AT_START:  # sent when the readers start: its cost is in the pass
            order_reply, order_s = _send_order(a.mode, a.mount, rels, order_client)
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
        finished = True
    except Exception as exc:  # noqa: BLE001
        setup = [r["setup_error"] for r in results if r.get("setup_error")]
        print(json.dumps({"mode": a.mode, "workers": W, "errors": 1,
                          "first_error": setup[0] if setup else f"{type(exc).__name__}: {exc}"}))
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
    row = {"mode": a.mode, "workers": W, "files": done, "bytes": nbytes,
           "seconds": round(wall, 4), "files_per_s": round(done / wall, 1),
           "MB_per_s": round(nbytes / 1e6 / wall, 2),
           "lat_ms_p50": reader._ms(reader.percentile(lat, 50)),
           "lat_ms_p99": reader._ms(reader.percentile(lat, 99)),
           "errors": sum(r["errors"] for r in results),
           "first_error": next((r["first_error"] for r in results if r["first_error"]), None),
           "cpu_busy_pct": busy, "iowait_pct": iowait,
           "order_send_s": None if order_s is None else round(order_s, 4)}
    print(json.dumps(row), flush=True)
    return 1 if row["errors"] else 0


def serial_main(argv: list[str]) -> int:
    """One process reads the order, sleeping ``--compute-ms`` after every file (a reader
    that does not pipeline). Stall = the time spent reading (and sending the order)."""
    ap = argparse.ArgumentParser(prog="prefetch_bench.py _serial")
    ap.add_argument("--mode", required=True, choices=MODES)
    ap.add_argument("--root", required=True)
    ap.add_argument("--list", required=True)
    ap.add_argument("--compute-ms", type=float, default=0.0)
    ap.add_argument("--store")
    ap.add_argument("--mount")
    a = ap.parse_args(argv)
    rels = reader.load_list(a.list)
    store = None
    if a.mode.startswith("api"):
        import fanstore

        store = fanstore.open_store(a.store if a.mode == "api-store" else a.mount)
    compute = a.compute_ms / 1e3
    clock = time.perf_counter
    t0 = clock()
    stall = order_s = 0.0
    if a.mode in ORDER_AT_START:
        _reply, order_s = _send_order(a.mode, a.mount, rels, store)
        stall += order_s
    nbytes = errors = 0
    first_error = None
    lat = []
    for rel in rels:
        t = clock()
        try:
            nbytes += _read_one(store, a.root, rel)
        except Exception as exc:  # noqa: BLE001
            errors += 1
            first_error = first_error or f"{rel}: {type(exc).__name__}: {exc}"
        dt = clock() - t
        lat.append(dt)
        stall += dt
        if compute:
            time.sleep(compute)
    total = clock() - t0
    lat.sort()
    print(json.dumps({"mode": a.mode, "files": len(rels), "bytes": nbytes, "errors": errors,
                      "first_error": first_error, "compute_ms": a.compute_ms,
                      "epoch_s": round(total, 4), "stall_s": round(stall, 4),
                      "order_send_s": round(order_s, 4),
                      "read_ms_p50": reader._ms(reader.percentile(lat, 50)),
                      "read_ms_p99": reader._ms(reader.percentile(lat, 99))}), flush=True)
    return 1 if errors else 0


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
        sampler = PrefetchSampler(base, FanStoreDataset(fanstore.open_store(a.mount),
                                                        files=files))
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
    it = iter(loader)  # forks the workers and starts sending the order (PrefetchSampler)
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
    if isinstance(sampler, PrefetchSampler):
        sampler.wait()  # (raises if sending the order failed)
    busy, _ = reader.busy_between(cpu0, reader.machine_cpu())
    waits.sort()
    print(json.dumps({
        "mode": a.mode, "batches": batches, "files": len(order), "bytes": nbytes,
        "batch": a.batch, "workers": a.workers, "compute_ms": a.compute_ms,
        "epoch_s": round(epoch, 4), "stall_s": round(stall, 4),
        "first_batch_s": round(first or 0.0, 4),
        "stall_after_first_s": round(stall - (first or 0), 4),
        "iter_s": round(t_iter, 4), "compute_s": round(batches * compute, 4),
        "wait_ms_p50": reader._ms(reader.percentile(waits, 50)),
        "wait_ms_p99": reader._ms(reader.percentile(waits, 99)),
        "files_per_s": round(len(order) / epoch, 1), "cpu_busy_pct": busy,
    }), flush=True)
    return 0


# ------------------------------------------------------------------------------ FanStore's cost


def fanstore_processes(root_pid: int | None) -> list[int]:
    """The FanStore processes to account: ``root_pid`` and its descendants (a mount's
    daemon, frontend process and workers), or, with None, every process running FanStore
    code (an MPI job: leaders, worker ranks, frontend processes)."""
    if root_pid:
        return reader.descendants(root_pid)
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            with open(f"/proc/{name}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if any(x.endswith(b"bin/fanstore") or x.startswith(b"fanstore.") for x in argv[:3]):
            out.append(int(name))
    return out


def cpu_seconds(pids: list[int]) -> float:
    return sum(reader.process_cpu_seconds(p) or 0.0 for p in pids)


def memory(pids: list[int]) -> tuple[int, int]:
    """(sum of RSS, sum of PSS) of ``pids``, bytes."""
    rss = pss = 0
    for p in pids:
        try:
            with open(f"/proc/{p}/smaps_rollup") as f:
                for line in f:
                    if line.startswith("Rss:"):
                        rss += int(line.split()[1]) * 1024
                    elif line.startswith("Pss:"):
                        pss += int(line.split()[1]) * 1024
        except OSError:
            pass
    return rss, pss


class Cost:
    """CPU and memory of FanStore processes over one measured span: ``start()``, then
    ``stop()`` gives (cpu seconds, base rss, base pss, peak rss, peak pss)."""

    def __init__(self, root_pid: int | None) -> None:
        self.root = root_pid
        self.peak = (0, 0)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self.pids = fanstore_processes(self.root)
        self.cpu0 = cpu_seconds(self.pids)
        self.base = memory(self.pids)
        self.peak = self.base
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._stop.wait(0.05):
            rss, pss = memory(fanstore_processes(self.root))
            self.peak = (max(self.peak[0], rss), max(self.peak[1], pss))

    def stop(self) -> dict:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
        pids = fanstore_processes(self.root)
        cpu = cpu_seconds(pids) - self.cpu0 if set(pids) >= set(self.pids) else None
        return {"fanstore_cpu_s": None if cpu is None else round(cpu, 3),
                "rss_base": self.base[0], "pss_base": self.base[1],
                "rss_peak": self.peak[0], "pss_peak": self.peak[1]}


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
        self.mpiexec = os.path.join(os.path.dirname(sys.executable), "mpiexec")
        self.jobs: list[Job] = []
        self.rows: list[dict] = []
        self.commands: list[str] = []
        self.mounted: dict[str, int | None] = {}
        self.run_id = time.strftime("%Y%m%dT%H%M%S")
        self.t_start = time.time()
        self.jsonl_tmp = os.path.join(self.work, f"prefetch_bench-{self.run_id}.jsonl")
        self.total_seconds = 0.0
        self.factors: list[float | None] = []
        self.serial_compute_ms: float | None = None

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
        """A fresh mount for the mode (the other one unmounted), caches dropped."""
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

    def mstats(self, mnt: str | None) -> dict | None:
        return control(mnt, {"op": "stats"}) if mnt else None

    def prefetch_before(self, mode: str, lst: str, pid: int | None) -> dict:
        """fuse-prefetched: list the directories, give the order, wait for the prefetch
        to settle (everything pushed, or no progress for a second: the window is full)."""
        mnt = self.mnt("prefetch")
        t0 = time.perf_counter()
        for _d, _dirs, _files in os.walk(mnt):
            pass
        rels = reader.load_list(lst)
        control(mnt, {"op": "prefetch", "paths": rels, "client": "prefetch_bench"},
                timeout=300)
        done_keys = ("prefetch_pushed", "prefetch_buffered", "prefetch_errors")
        last, still = -1, time.monotonic()
        while time.perf_counter() - t0 < self.a.pass_limit:
            s = self.mstats(mnt) or {}
            n = sum(s.get(k, 0) for k in done_keys)
            if n >= len(rels):
                break
            if n != last:
                last, still = n, time.monotonic()
            elif time.monotonic() - still > 1.0:
                break
            time.sleep(0.02)
        return {"prefetch_s": round(time.perf_counter() - t0, 3)}

    def measure(self, kind: str, mode: str, argv: list[str], pid: int | None, extra: dict,
                lst: str | None = None) -> dict:
        """Run one reader child with the mount's counters and FanStore's cost around it."""
        mnt = self.mnt(MOUNT_OF[mode]) if mode in MOUNT_OF else None
        pre = self.prefetch_before(mode, lst, pid) if mode == "fuse-prefetched" else {}
        before = self.mstats(mnt)
        cost = Cost(pid) if pid else None
        if cost:
            cost.start()
        load = common.loadavg1()
        row = self.run_sub(argv, timeout=self.a.pass_limit + 120)
        if cost:
            row.update(cost.stop())
        after = self.mstats(mnt)
        row.update(pre, kind=kind, mode=mode, load1_before=load, **extra)
        if before and after:
            row["daemon"] = diff_stats(after, before)
        if pid and not pid_alive(pid):
            row["daemon_died"] = True
        self.emit(row)
        return row

    # -------------------------------------------------------------- phases
    def run(self) -> None:
        a = self.a
        os.makedirs(self.mnt_root, exist_ok=True)
        self.machine = common.machine_table(self.work)
        log(f"work dir {self.work}; load average {os.getloadavg()[0]:.2f}")
        data, small, gen_cmd = ensure_dataset(self.py, self.work, a.files, a.classes, a.min_kb,
                                              a.max_kb, a.seed)
        self.data, self.files = data, small
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
        log(f"{len(small)} files, {raw / 1e6:.0f} MB raw; prefetch budget {self.prefetch_mb} "
            f"MiB ({self.prefetch_mb * 2**20 / max(1, raw):.0%} of the dataset)")
        for phase in ("read", "serial", "loader", "ranks", "model"):
            if phase in a.phases:
                getattr(self, f"phase_{phase}")()
        self.check()
        self.total_seconds = time.time() - self.t_start

    def epoch_list(self, rep: int) -> str:
        path = os.path.join(self.lists, f"epoch-{rep}.txt")
        order = list(self.files)
        random.Random(rep).shuffle(order)
        with open(path, "w") as f:
            f.write("".join(p + "\n" for p in order))
        return path

    def reader_args(self, mode: str) -> list[str]:
        kind = MOUNT_OF.get(mode)
        argv = ["--root", self.mnt(kind) if kind else self.data]
        if mode == "api-store":
            argv += ["--store", self.store]
        if kind:
            argv += ["--mount", self.mnt(kind)]
        return argv

    def phase_read(self) -> None:
        a = self.a
        log(f"read passes: {' '.join(a.modes)}, readers {a.workers}, {a.reps} reps, cold")
        for rep in range(1, a.reps + 1):
            lst = self.epoch_list(rep)
            for wk in a.workers:
                k = (rep - 1 + wk) % len(a.modes)
                for mode in a.modes[k:] + a.modes[:k]:
                    pid = self.cold(mode)
                    argv = [self.py, ME, "_pass", "--mode", mode, "--list", lst,
                            "--workers", str(wk), *self.reader_args(mode)]
                    self.cmd(" ".join(shlex.quote(x) for x in argv)
                             .replace(lst, "WORK/lists/epoch-REP.txt"))
                    row = self.measure("pass", mode, argv, pid, {"workers": wk, "rep": rep},
                                       lst)
                    d = row.get("daemon") or {}
                    log(f"  rep {rep} w={wk} {mode:<15}: {row.get('files_per_s')} files/s, "
                        f"READs {(d.get('requests_by_op') or {}).get('read', '-')}, FanStore "
                        f"CPU {row.get('fanstore_cpu_s')} s"
                        + (f"  ERRORS {row['errors']}: {row.get('first_error')}"
                           if row.get("errors") else ""))

    def phase_serial(self) -> None:
        a = self.a
        sync1 = common.row_vals(self.rows, "files_per_s", kind="pass", mode="fuse-sync",
                                workers=1)
        if a.serial_compute_ms is not None:
            ms = a.serial_compute_ms
        elif sync1:
            ms = 1e3 / common.med(sync1)
        else:  # no read phase: calibrate on a sync serial epoch without compute
            lst = self.epoch_list(200)
            pid = self.cold("fuse-sync")
            row = self.measure("serial-calib", "fuse-sync",
                               [self.py, ME, "_serial", "--mode", "fuse-sync", "--list", lst,
                                *self.reader_args("fuse-sync")], pid, {})
            ms = row["stall_s"] / max(1, row.get("files") or 1) * 1e3
        self.serial_compute_ms = round(ms, 3)
        log(f"serial reader: compute {self.serial_compute_ms} ms per file (the sync mount's "
            f"read time per file), {a.serial_reps} reps")
        for rep in range(1, a.serial_reps + 1 if a.serial_modes else 1):
            lst = self.epoch_list(300 + rep)
            k = (rep - 1) % len(a.serial_modes)
            for mode in a.serial_modes[k:] + a.serial_modes[:k]:
                pid = self.cold(mode)
                argv = [self.py, ME, "_serial", "--mode", mode, "--list", lst,
                        "--compute-ms", f"{self.serial_compute_ms:.3f}",
                        *self.reader_args(mode)]
                self.cmd(" ".join(shlex.quote(x) for x in argv)
                         .replace(lst, "WORK/lists/epoch-REP.txt")
                         .replace(f"{self.serial_compute_ms:.3f}", "C"))
                row = self.measure("serial", mode, argv, pid, {"rep": rep}, lst)
                log(f"  serial rep {rep} {mode:<15}: epoch {row.get('epoch_s')} s, stall "
                    f"{row.get('stall_s')} s")

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
        row = self.measure(tag, mode, argv, pid, {"rep": rep, "factor": factor}, lst)
        log(f"  {tag}{'' if factor is None else f' x{factor:g}'} rep {rep} {mode:<13}: "
            f"epoch {row.get('epoch_s')} s, stall {row.get('stall_s')} s (first batch "
            f"{row.get('first_batch_s')} s)"
            + (f"  ERRORS: {row.get('first_error')}" if row.get("errors") else ""))
        return row

    def phase_loader(self) -> None:
        a = self.a
        log(f"DataLoader: batch {a.batch}, {a.dl_workers} workers; calibrating the compute "
            "time on fuse-sync without compute")
        per_batch = []
        for rep in range(1, a.calib_reps + 1):
            row = self.loader_epoch("fuse-sync", 100 + rep, self.epoch_list(100 + rep), 0.0,
                                    "calib")
            if row.get("batches"):
                per_batch.append(row["epoch_s"] / row["batches"])
        if a.compute_ms is not None:
            self.factors, computes = [None], {None: a.compute_ms}
        elif per_batch:
            self.factors = list(a.compute_factors)
            computes = {f: round(common.med(per_batch) * 1e3 * f, 2) for f in self.factors}
        else:
            raise RuntimeError("calibration epoch failed; pass --compute-ms")
        for f in self.factors:
            self.emit({"kind": "compute", "compute_ms": computes[f], "factor": f,
                       "sync_per_batch_ms": [round(x * 1e3, 2) for x in per_batch]})
        for f in self.factors:
            for rep in range(1, a.dl_reps + 1):
                lst = self.epoch_list(110 + rep)
                k = (rep - 1) % len(a.dl_modes)
                for mode in a.dl_modes[k:] + a.dl_modes[:k]:
                    self.loader_epoch(mode, rep, lst, computes[f], "dl", f)

    def phase_ranks(self) -> None:
        """The serial reader on rank 0 of a 2-rank prefetch job against a 1-rank mount."""
        a = self.a
        ms = self.serial_compute_ms
        if ms is None:
            self.phase_serial_calibrate_only()
            ms = self.serial_compute_ms
        self.umount("sync")
        self.umount("prefetch")
        log(f"ranks: serial reader, compute {ms} ms per file, prefetch mode, 1 and 2 ranks")
        extra = ["--mode", "prefetch", "--prefetch-mb", str(self.prefetch_mb)]
        for rep in range(1, a.serial_reps + 1):
            lst = self.epoch_list(400 + rep)
            for ranks in ((1, 2) if rep % 2 else (2, 1)):
                job = Job(self, ranks, f"ranks{ranks}", extra)
                self.cmd(job.shown())
                common.drop_caches()
                job.start()
                try:
                    common.drop_caches()
                    mnt = job.mnt(0)
                    argv = [self.py, ME, "_serial", "--mode", "fuse-prefetch", "--list", lst,
                            "--compute-ms", f"{ms:.3f}", "--root", mnt, "--mount", mnt]
                    before = self.mstats(mnt)
                    cost = Cost(job.pids.get(0) if ranks == 1 else None)
                    cost.start()
                    row = self.run_sub(argv, timeout=a.pass_limit + 120)
                    row.update(cost.stop())
                    after = self.mstats(mnt)
                    row.update(kind="ranks", mode="fuse-prefetch", ranks=ranks, rep=rep)
                    if before and after:
                        row["daemon"] = diff_stats(after, before)
                    self.emit(row)
                    d = row.get("daemon") or {}
                    log(f"  rep {rep} {ranks} rank(s): stall {row.get('stall_s')} s, epoch "
                        f"{row.get('epoch_s')} s, remote reads {d.get('remote_reads')}, "
                        f"pushed {d.get('prefetch_pushed')}")
                finally:
                    job.stop()

    def phase_model(self) -> None:
        """``fanstore select --mode prefetch`` on the dataset: its prediction for the
        store's codec (files/s the node sustains with decoding overlapped) against the
        DataLoader epochs measured above."""
        self.umount("sync")
        self.umount("prefetch")
        argv = [self.fanstore, "select", self.data, "--mode", "prefetch", "--cores",
                str(os.cpu_count() or 1), "--reader", "mount", "--sample-mb",
                str(self.a.model_sample_mb), "--json"]
        self.cmd(" ".join(shlex.quote(x) for x in argv))
        log("model: " + " ".join(argv[1:]))
        p = subprocess.run(argv, capture_output=True, text=True, timeout=1800)
        try:
            doc = json.loads(p.stdout)
        except ValueError:
            log(f"  select failed ({p.returncode}): {p.stderr.strip()[-300:]}")
            return
        cand = {c["codec"]: c for c in doc.get("candidates", [])}
        mine = cand.get(self.a.codec) or {}
        self.emit({"kind": "model", "assumes": doc.get("assumes"), "chosen": doc.get("chosen"),
                   "codec": self.a.codec, "files_per_s": mine.get("files_per_s"),
                   "chosen_files_per_s": (doc.get("predicted") or {}).get("files_per_s"),
                   "cores": (doc.get("budget") or {}).get("cores"),
                   "reader": doc.get("reader")})
        log(f"  {self.a.codec}: {mine.get('files_per_s')} files/s predicted (prefetch); "
            f"chosen {doc.get('chosen')}")

    def phase_serial_calibrate_only(self) -> None:
        saved = self.a.serial_modes
        self.a.serial_modes = []
        try:
            self.phase_serial()
        finally:
            self.a.serial_modes = saved

    def check(self) -> None:
        """Spot-check bytes of a sample through every FanStore path against the raw files."""
        import fanstore

        sample = random.Random(3).sample(self.files, min(self.a.verify_sample, len(self.files)))
        results = {}
        for mode in ("fuse-sync", "fuse-prefetch", "api-store", "api-prefetch"):
            self.cold(mode)
            bad, err, store = 0, None, None
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
                    bad += got != want
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
        for job in list(self.jobs):
            try:
                job.stop()
            except Exception as exc:  # noqa: BLE001
                log(f"  stopping job {job.dir} failed: {exc}")
        for kind in ("sync", "prefetch"):
            try:
                self.umount(kind)
            except Exception as exc:  # noqa: BLE001
                log(f"  cleanup of {kind} failed: {exc}")
            if is_mounted(self.mnt(kind)):
                subprocess.run(["fusermount3", "-u", "-z", "--", self.mnt(kind)],
                               capture_output=True)
            try:
                os.rmdir(self.mnt(kind))
            except OSError:
                pass
        if self.a.clean:
            shutil.rmtree(self.work, ignore_errors=True)


def diff_stats(after: dict, before: dict) -> dict:
    """Numeric counters (and requests by op) of ``fanstore stats``, after - before."""
    out = {k: after[k] - before[k] for k in after
           if isinstance(after.get(k), (int, float)) and isinstance(before.get(k), (int, float))}
    ops_a, ops_b = after.get("requests_by_op") or {}, before.get("requests_by_op") or {}
    out["requests_by_op"] = {k: ops_a.get(k, 0) - ops_b.get(k, 0) for k in ops_a
                             if ops_a.get(k, 0) != ops_b.get(k, 0)}
    return out


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
    ap.add_argument("--phases", default="read,serial,loader,ranks,model",
                    help="read, serial, loader, ranks, model (default all)")
    ap.add_argument("--model-sample-mb", type=int, default=100,
                    help="sample of `fanstore select` in the model phase (MB)")
    ap.add_argument("--modes", default=",".join(MODES), help="modes of the read passes")
    ap.add_argument("--serial-modes", default="fuse-sync,fuse-prefetch,api-store,api-prefetch")
    ap.add_argument("--dl-modes", default="raw,fuse-sync,fuse-prefetch,api-prefetch,api-store",
                    help="modes of the DataLoader epochs")
    ap.add_argument("--workers", default="1,4", help="reader processes of the read passes")
    ap.add_argument("--reps", type=int, help="read-pass repetitions (one shuffle each)")
    ap.add_argument("--serial-reps", type=int)
    ap.add_argument("--serial-compute-ms", type=float,
                    help="compute per file of the serial reader (default: the sync mount's "
                         "read time per file, 1 reader)")
    ap.add_argument("--prefetch-fraction", type=float, default=0.25,
                    help="prefetch budget as a fraction of the raw dataset (default 0.25)")
    ap.add_argument("--prefetch-mb", type=int, help="prefetch budget in MiB (overrides)")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--dl-workers", type=int, default=4)
    ap.add_argument("--dl-reps", type=int, help="DataLoader repetitions per mode")
    ap.add_argument("--calib-reps", type=int, help="calibration epochs (sync, no compute)")
    ap.add_argument("--compute-factors", default="1.0,0.5",
                    help="compute per batch = factor x the calibrated sync per-batch time "
                         "(first = the tight budget; default 1.0,0.5)")
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
    a.serial_modes = [m.strip() for m in a.serial_modes.split(",") if m.strip()]
    a.dl_modes = [m.strip() for m in a.dl_modes.split(",") if m.strip()]
    bad = [m for m in a.modes + a.dl_modes + a.serial_modes if m not in MODES]
    if bad:
        ap.error(f"unknown mode(s) {bad}; known: {MODES}")
    a.phases = {x.strip() for x in a.phases.split(",") if x.strip()}
    a.compute_factors = [float(x) for x in a.compute_factors.split(",") if x.strip()]
    if a.label is None and a.preset == "quick":
        a.label = ("SMOKE RUN (--preset quick: small dataset, one repetition per cell, on a "
                   "machine shared with other jobs): it shows the harness works end to end; "
                   "the numbers are not results.")
    return a


def main(argv: list[str] | None = None) -> int:
    raw_argv = sys.argv[1:] if argv is None else argv
    sub = {"_pass": pass_main, "_serial": serial_main, "_loader": loader_main}
    if raw_argv and raw_argv[0] in sub:
        return sub[raw_argv[0]](raw_argv[1:])
    a = parse_args(raw_argv)
    if os.geteuid() != 0:
        print("prefetch_bench: run as root (drop_caches and FUSE mounts)", file=sys.stderr)
        return 2
    from prefetch_report import section

    bench = Bench(a)
    ok = common.guarded_run(
        bench, log, lambda: [k for k in ("sync", "prefetch") if is_mounted(bench.mnt(k))])
    return common.publish(ok, bench, a, log, SECTION, section, "tools/bench/prefetch_bench.py",
                          raw_argv)


if __name__ == "__main__":
    sys.exit(main())
