#!/usr/bin/env python3
"""Prefetch mode (kernel frontend) next to the raw directory, the sync mount and the Python API.

One dataset, one store; the modes (raw, fuse-sync, fuse-prefetch, fuse-prefetched, api-store,
api-prefetch) measured in one run, interleaved, every pass cold, in phases: read (1 and 4
readers), serial (a reader that does not pipeline), loader (DataLoader with a fixed compute
time), ranks (2-rank prefetch job), model (`fanstore select --mode prefetch`). What each
mode and phase is: docs/benchmarks.md, "Prefetch mode on the kernel frontend".

    .venv/bin/python tools/bench/prefetch_bench.py --preset quick   # a smoke run, ~3 min
    .venv/bin/python tools/bench/prefetch_bench.py --preset full    # ~15-20 min
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness as h  # noqa: E402
from harness import load_list, med, num, ratio  # noqa: E402

ME = os.path.abspath(__file__)
MB = 1e6
MODES = ["raw", "fuse-sync", "fuse-prefetch", "fuse-prefetched", "api-store", "api-prefetch"]
MOUNT_OF = {"fuse-sync": "sync", "fuse-prefetch": "prefetch", "fuse-prefetched": "prefetch",
            "api-prefetch": "prefetch"}
ORDER_AT_START = ("fuse-prefetch", "api-prefetch")  # the order is sent when reading starts
REF = {"fuse-prefetch": "fuse-sync", "api-prefetch": "api-store"}
PRESETS = {
    "quick": dict(files=3000, classes=30, reps=1, dl_reps=2, calib_reps=1, serial_reps=1),
    "full": dict(files=10000, classes=100, reps=3, dl_reps=3, calib_reps=2, serial_reps=2),
}


# ------------------------------------------------------------------------------ readers
# (run as `prefetch_bench.py _pass|_serial|_loader ...`, own process group; one JSON row)


def _send_order(mode: str, mount: str, rels: list[str], store=None) -> float:
    """Give the epoch's order as the mode's reader does; the seconds it took."""
    t0 = time.perf_counter()
    if mode == "fuse-prefetch":
        from fanstore import control as ctl

        ctl.control(mount, {"op": "prefetch", "paths": rels, "client": "prefetch_bench"},
                    timeout=300)
    else:
        store.prefetch(rels)
    return time.perf_counter() - t0


def _open(mode: str, a):
    if not mode.startswith("api"):
        return None
    import fanstore

    return fanstore.open_store(a.store if mode == "api-store" else a.mount)


def _read_list(store, root: str, rels: list[str], compute_s: float = 0.0) -> tuple:
    """Read ``rels`` in order (through ``store``, else plain files under ``root``), sleeping
    ``compute_s`` after each: (bytes, errors, first error, seconds of each read)."""
    clock, lat, nbytes, errors, first = time.perf_counter, [], 0, 0, None
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
            first = first or f"{rel}: {type(exc).__name__}: {exc}"
        lat.append(clock() - t)
        if compute_s:
            time.sleep(compute_s)
    return nbytes, errors, first, lat


def _share(job):
    a, rels = job
    store = _open(a.mode, a)  # before the barrier: not timed

    def work() -> dict:
        nbytes, errors, first, lat = _read_list(store, a.root, rels)
        return {"done": len(rels), "bytes": nbytes, "errors": errors, "first_error": first,
                "lat": lat}

    return work


def _reader_args(prog: str) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=f"prefetch_bench.py {prog}")
    ap.add_argument("--mode", required=True, choices=MODES)
    ap.add_argument("--root", help="directory the list is relative to")
    ap.add_argument("--list", help="the epoch order (paths)")
    ap.add_argument("--store", help="the packed store (api-store)")
    ap.add_argument("--mount", help="the mount (order / api-prefetch)")
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--compute-ms", type=float, default=0.0)
    return ap


def pass_main(argv: list[str]) -> int:
    a = _reader_args("_pass").parse_args(argv)
    rels, W = load_list(a.list), a.workers
    client = _open(a.mode, a) if a.mode == "api-prefetch" else None  # index load untimed
    try:
        got = h.fork_pass(_share, [(a, rels[i::W]) for i in range(W)],
                          on_release=(lambda: _send_order(a.mode, a.mount, rels, client))
                          if a.mode in ORDER_AT_START else None)
    except Exception as exc:  # noqa: BLE001
        print(json.dumps({"mode": a.mode, "workers": W, "errors": 1, "first_error": str(exc)}))
        return 1
    res, wall = got["results"], got["wall"]
    lat = sorted(x for r in res for x in r["lat"])
    done, nbytes = sum(r["done"] for r in res), sum(r["bytes"] for r in res)
    row = {"mode": a.mode, "workers": W, "files": done, "bytes": nbytes,
           "seconds": round(wall, 4), "files_per_s": round(done / wall, 1),
           "MB_per_s": round(nbytes / MB / wall, 2), "lat_ms_p50": h.percentile_ms(lat, 50),
           "lat_ms_p99": h.percentile_ms(lat, 99), "errors": sum(r["errors"] for r in res),
           "first_error": next((r["first_error"] for r in res if r["first_error"]), None),
           "cpu_busy_pct": got["busy"], "iowait_pct": got["iowait"],
           "order_send_s": None if got["released"] is None else round(got["released"], 4)}
    print(json.dumps(row), flush=True)
    return 1 if row["errors"] else 0


def serial_main(argv: list[str]) -> int:
    """One process reads the order, sleeping ``--compute-ms`` after every file. Stall = the
    time spent reading (and sending the order)."""
    a = _reader_args("_serial").parse_args(argv)
    rels, store = load_list(a.list), _open(a.mode, a)
    t0 = time.perf_counter()
    order_s = _send_order(a.mode, a.mount, rels, store) if a.mode in ORDER_AT_START else 0.0
    nbytes, errors, first, lat = _read_list(store, a.root, rels, a.compute_ms / 1e3)
    stall = order_s + sum(lat)
    lat.sort()
    print(json.dumps({"mode": a.mode, "files": len(rels), "bytes": nbytes, "errors": errors,
                      "first_error": first, "compute_ms": a.compute_ms,
                      "epoch_s": round(time.perf_counter() - t0, 4), "stall_s": round(stall, 4),
                      "order_send_s": round(order_s, 4),
                      "read_ms_p50": h.percentile_ms(lat, 50),
                      "read_ms_p99": h.percentile_ms(lat, 99)}), flush=True)
    return 1 if errors else 0


class _PathDataset:
    """Map-style dataset of plain files: item i = open(root/files[i]).read()."""

    def __init__(self, root: str, files: list[str]) -> None:
        self.root, self.files = root, files

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int) -> bytes:
        with open(os.path.join(self.root, self.files[i]), "rb") as f:
            return f.read()


def _collate_sizes(batch: list[bytes]) -> int:
    return sum(len(x) for x in batch)


def loader_main(argv: list[str]) -> int:
    ap = _reader_args("_loader")
    ap.add_argument("--files", required=True, help="the dataset's files, sorted (indices)")
    ap.add_argument("--batch", type=int, default=32)
    a = ap.parse_args(argv)
    import torch.utils.data as tud

    import fanstore
    from fanstore.torch import FanStoreDataset, PrefetchSampler

    files = load_list(a.files)
    pos = {p: i for i, p in enumerate(files)}
    order = [pos[p] for p in load_list(a.list)]
    if a.mode in ("raw", "fuse-sync"):
        ds, sampler = _PathDataset(a.root, files), order
    elif a.mode == "fuse-prefetch":  # plain reads; the order goes to the daemon per epoch
        ds = _PathDataset(a.mount, files)
        sampler = PrefetchSampler(order, FanStoreDataset(fanstore.open_store(a.mount),
                                                         files=files))
    elif a.mode == "api-prefetch":
        ds = FanStoreDataset(fanstore.open_store(a.mount), files=files)
        sampler = PrefetchSampler(order, ds)
    else:  # api-store
        ds, sampler = FanStoreDataset(fanstore.open_store(a.store), files=files), order
    loader = tud.DataLoader(ds, batch_size=a.batch, sampler=sampler, num_workers=a.workers,
                            collate_fn=_collate_sizes)
    compute, clock = a.compute_ms / 1e3, time.perf_counter
    cpu0, t0 = h.machine_cpu(), clock()
    it = iter(loader)  # forks the workers and starts sending the order (PrefetchSampler)
    t_iter = stall = clock() - t0
    first, batches, nbytes, waits = None, 0, 0, []
    while True:
        t = clock()
        try:
            got = next(it)
        except StopIteration:
            stall += clock() - t
            break
        dt = clock() - t
        stall += dt
        first = t_iter + dt if first is None else first
        waits.append(dt)
        batches, nbytes = batches + 1, nbytes + got
        if compute:
            time.sleep(compute)
    epoch = clock() - t0
    if isinstance(sampler, PrefetchSampler):
        sampler.wait()  # (raises if sending the order failed)
    waits.sort()
    print(json.dumps({
        "mode": a.mode, "batches": batches, "files": len(order), "bytes": nbytes,
        "batch": a.batch, "workers": a.workers, "compute_ms": a.compute_ms,
        "epoch_s": round(epoch, 4), "stall_s": round(stall, 4),
        "first_batch_s": round(first or 0.0, 4),
        "stall_after_first_s": round(stall - (first or 0), 4),
        "iter_s": round(t_iter, 4), "compute_s": round(batches * compute, 4),
        "wait_ms_p50": h.percentile_ms(waits, 50), "wait_ms_p99": h.percentile_ms(waits, 99),
        "files_per_s": round(len(order) / epoch, 1),
        "cpu_busy_pct": h.busy_between(cpu0, h.machine_cpu())[0]}), flush=True)
    return 0


# ------------------------------------------------------------------------------ the run


class Cost:
    """CPU and memory of FanStore processes over one span: ``start()``, then ``stop()``
    gives their CPU seconds and base / peak RSS and PSS (sampled every 50 ms)."""

    def __init__(self, root_pid: int | None) -> None:
        self.root = root_pid
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def start(self) -> "Cost":
        self.pids = h.fanstore_processes(self.root)
        self.cpu0 = h.cpu_seconds(self.pids)
        self.base = self.peak = h.memory(self.pids)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.05):
            rss, pss = h.memory(h.fanstore_processes(self.root))
            self.peak = (max(self.peak[0], rss), max(self.peak[1], pss))

    def stop(self) -> dict:
        self._stop.set()
        self._thread.join(5)
        pids = h.fanstore_processes(self.root)
        cpu = h.cpu_seconds(pids) - self.cpu0 if set(pids) >= set(self.pids) else None
        return {"fanstore_cpu_s": None if cpu is None else round(cpu, 3),
                "rss_base": self.base[0], "pss_base": self.base[1],
                "rss_peak": self.peak[0], "pss_peak": self.peak[1]}


class PrefetchBench(h.Bench):
    name = "prefetch_bench"

    def __init__(self, a: argparse.Namespace) -> None:
        super().__init__(a)
        self.factors: list[float | None] = []
        self.serial_compute_ms: float | None = None

    def mnt(self, kind: str) -> str:
        return os.path.join(self.mnt_root, kind)

    def cold(self, mode: str) -> int | None:
        """A fresh mount for the mode (the other one unmounted), caches dropped."""
        kind, pid = MOUNT_OF.get(mode), None
        for other in ("sync", "prefetch"):
            if other != kind:
                self.umount(self.mnt(other))
        if kind:
            extra = ["--mode", "prefetch", "--prefetch-mb", str(self.prefetch_mb)] \
                if kind == "prefetch" else []
            pid = self.mount(self.store, self.mnt(kind), extra)
        h.drop_caches()
        return pid

    def prefetch_before(self, lst: str) -> dict:
        """fuse-prefetched: list the directories, give the order, wait for the prefetch to
        settle (everything pushed, or no progress for a second: the window is full)."""
        mnt, t0 = self.mnt("prefetch"), time.perf_counter()
        for _d in os.walk(mnt):
            pass
        rels = load_list(lst)
        h.control(mnt, {"op": "prefetch", "paths": rels, "client": "prefetch_bench"}, 300)
        last, still = -1, time.monotonic()
        while time.perf_counter() - t0 < self.a.pass_limit:
            s = h.control(mnt, {"op": "stats"}) or {}
            n = sum(s.get(k, 0) for k in ("prefetch_pushed", "prefetch_buffered",
                                           "prefetch_errors"))
            if n >= len(rels) or (n == last and time.monotonic() - still > 1.0):
                break
            if n != last:
                last, still = n, time.monotonic()
            time.sleep(0.02)
        return {"prefetch_s": round(time.perf_counter() - t0, 3)}

    def measure(self, kind: str, mode: str, argv: list[str], pid: int | None, extra: dict,
                lst: str, mnt: str | None = None, shown: dict | None = None) -> dict:
        """One reader child with the mount's counters and FanStore's cost around it."""
        self.cmd(argv, **(shown or {}))
        mnt = mnt or (self.mnt(MOUNT_OF[mode]) if mode in MOUNT_OF else None)
        pre = self.prefetch_before(lst) if mode == "fuse-prefetched" else {}
        before = h.control(mnt, {"op": "stats"})
        cost = Cost(pid).start() if pid or kind == "ranks" else None
        load = h.loadavg1()
        row = self.sub(argv)
        if cost:
            row.update(cost.stop())
        row.update(pre, kind=kind, mode=mode, load1_before=load, **extra)
        row["daemon"] = h.diff_stats(h.control(mnt, {"op": "stats"}), before)
        if pid and not h.pid_alive(pid):
            row["daemon_died"] = True
        return self.emit(row)

    def run(self) -> None:
        a = self.a
        self.data, self.files, gen = h.ensure_dataset(self.work, a.files, a.classes, a.min_kb,
                                                      a.max_kb, a.seed)
        self.cmd(gen)
        info, pack = h.pack_store(self.fanstore, self.data, self.store, a.partitions, a.codec,
                                  a.jobs, a.reuse_store)
        self.cmd(pack)
        counts = info.get("counts") or {}
        raw = counts.get("raw_bytes") or 0
        self.prefetch_mb = a.prefetch_mb or max(16, int(raw / 2**20 * a.prefetch_fraction))
        self.emit({"kind": "store", "files": len(self.files), "raw_bytes": raw,
                   "stored_bytes": counts.get("stored_bytes"), "ratio": info.get("ratio"),
                   "pack_seconds": info.get("pack_seconds"), "prefetch_mb": self.prefetch_mb,
                   "params": dict(files=a.files, classes=a.classes, min_kb=a.min_kb,
                                  max_kb=a.max_kb, seed=a.seed, partitions=a.partitions,
                                  codec=a.codec)})
        self.files_list = self.write_list("files.txt", self.files)
        h.log(f"{len(self.files)} files, {raw / MB:.0f} MB raw; prefetch budget "
              f"{self.prefetch_mb} MiB")
        for phase in ("read", "serial", "loader", "ranks", "model"):
            if phase in a.phases:
                getattr(self, f"phase_{phase}")()
        self.check()

    def epoch_list(self, rep: int) -> str:
        order = list(self.files)
        random.Random(rep).shuffle(order)
        return self.write_list(f"epoch-{rep}.txt", order)

    def reader(self, sub: str, mode: str, lst: str, *extra: str) -> list[str]:
        """The argv of a reader child: where it reads from, as the mode does."""
        kind = MOUNT_OF.get(mode)
        argv = [self.py, ME, sub, "--mode", mode, "--list", lst, *extra]
        if sub != "_loader" or mode in ("raw", "fuse-sync"):
            argv += ["--root", self.mnt(kind) if kind else self.data]
        if mode == "api-store":
            argv += ["--store", self.store]
        elif kind and (sub != "_loader" or mode not in ("raw", "fuse-sync")):
            argv += ["--mount", self.mnt(kind)]
        return argv

    @staticmethod
    def rotate(items: list, k: int) -> list:
        k %= max(1, len(items))
        return items[k:] + items[:k]

    def phase_read(self) -> None:
        a = self.a
        for rep in range(1, a.reps + 1):
            lst = self.epoch_list(rep)
            for wk in a.workers:
                for mode in self.rotate(a.modes, rep - 1 + wk):
                    pid = self.cold(mode)
                    row = self.measure("pass", mode, self.reader("_pass", mode, lst,
                                                                 "--workers", str(wk)),
                                       pid, {"workers": wk, "rep": rep}, lst,
                                       shown={"WORK/lists/epoch-REP.txt": lst})
                    h.log(f"  rep {rep} w={wk} {mode:<15}: {row.get('files_per_s')} files/s, "
                          f"FanStore CPU {row.get('fanstore_cpu_s')} s"
                          + (f"  ERRORS: {row.get('first_error')}" if row.get("errors") else ""))

    def phase_serial(self, modes: list[str] | None = None) -> None:
        a = self.a
        modes = a.serial_modes if modes is None else modes
        sync1 = self.vals("files_per_s", kind="pass", mode="fuse-sync", workers=1)
        if a.serial_compute_ms is not None:
            ms = a.serial_compute_ms
        elif sync1:
            ms = 1e3 / med(sync1)
        else:  # no read phase: calibrate on a sync serial epoch without compute
            lst = self.epoch_list(200)
            row = self.measure("serial-calib", "fuse-sync", self.reader(
                "_serial", "fuse-sync", lst), self.cold("fuse-sync"), {}, lst)
            ms = row["stall_s"] / max(1, row.get("files") or 1) * 1e3
        self.serial_compute_ms = round(ms, 3)
        c = f"{self.serial_compute_ms:.3f}"
        for rep in range(1, a.serial_reps + 1 if modes else 1):
            lst = self.epoch_list(300 + rep)
            for mode in self.rotate(modes, rep - 1):
                pid = self.cold(mode)
                row = self.measure("serial", mode, self.reader("_serial", mode, lst,
                                                               "--compute-ms", c),
                                   pid, {"rep": rep}, lst,
                                   shown={"WORK/lists/epoch-REP.txt": lst, "C": c})
                h.log(f"  serial rep {rep} {mode:<15}: stall {row.get('stall_s')} s")

    def loader_epoch(self, mode: str, rep: int, lst: str, compute_ms: float, tag: str,
                     factor: float | None = None) -> dict:
        pid = self.cold(mode)
        c = f"{compute_ms:.3f}"
        argv = self.reader("_loader", mode, lst, "--files", self.files_list, "--batch",
                           str(self.a.batch), "--workers", str(self.a.dl_workers),
                           "--compute-ms", c)
        row = self.measure(tag, mode, argv, pid, {"rep": rep, "factor": factor}, lst,
                           shown={"WORK/lists/epoch-REP.txt": lst,
                                  ("C" if tag == "dl" else "0.000"): c})
        h.log(f"  {tag} rep {rep} {mode:<13}: epoch {row.get('epoch_s')} s, stall "
              f"{row.get('stall_s')} s" + (f"  ERRORS: {row.get('first_error')}"
                                           if row.get("errors") else ""))
        return row

    def phase_loader(self) -> None:
        a, per_batch = self.a, []
        for rep in range(1, a.calib_reps + 1):  # the sync epoch without compute
            row = self.loader_epoch("fuse-sync", 100 + rep, self.epoch_list(100 + rep), 0.0,
                                    "calib")
            if row.get("batches"):
                per_batch.append(row["epoch_s"] / row["batches"])
        if a.compute_ms is not None:
            self.factors, computes = [None], {None: a.compute_ms}
        elif per_batch:
            self.factors = list(a.compute_factors)
            computes = {f: round(med(per_batch) * 1e3 * f, 2) for f in self.factors}
        else:
            raise RuntimeError("calibration epoch failed; pass --compute-ms")
        for f in self.factors:
            self.emit({"kind": "compute", "compute_ms": computes[f], "factor": f,
                       "sync_per_batch_ms": [round(x * 1e3, 2) for x in per_batch]})
        for f in self.factors:
            for rep in range(1, a.dl_reps + 1):
                lst = self.epoch_list(110 + rep)
                for mode in self.rotate(a.dl_modes, rep - 1):
                    self.loader_epoch(mode, rep, lst, computes[f], "dl", f)

    def phase_ranks(self) -> None:
        """The serial reader on rank 0 of a 2-rank prefetch job against a 1-rank mount."""
        if self.serial_compute_ms is None:
            self.phase_serial(modes=[])
        ms = f"{self.serial_compute_ms:.3f}"
        for kind in ("sync", "prefetch"):
            self.umount(self.mnt(kind))
        extra = ["--mode", "prefetch", "--prefetch-mb", str(self.prefetch_mb)]
        for rep in range(1, self.a.serial_reps + 1):
            lst = self.epoch_list(400 + rep)
            for ranks in ((1, 2) if rep % 2 else (2, 1)):
                job = h.Job(self, ranks, f"ranks{ranks}", extra)
                self.cmd(job.shown())
                h.drop_caches()
                job.start()
                try:
                    h.drop_caches()
                    mnt = job.mnt(0)
                    argv = [self.py, ME, "_serial", "--mode", "fuse-prefetch", "--list", lst,
                            "--compute-ms", ms, "--root", mnt, "--mount", mnt]
                    row = self.measure("ranks", "fuse-prefetch", argv,
                                       job.pids.get(0) if ranks == 1 else None,
                                       {"ranks": ranks, "rep": rep}, lst, mnt=mnt,
                                       shown={"WORK/lists/epoch-REP.txt": lst, "C": ms})
                    d = row.get("daemon") or {}
                    h.log(f"  rep {rep} {ranks} rank(s): stall {row.get('stall_s')} s, remote "
                          f"reads {d.get('remote_reads')}")
                finally:
                    job.stop()

    def phase_model(self) -> None:
        """``fanstore select --mode prefetch``: its prediction for the store's codec."""
        for kind in ("sync", "prefetch"):
            self.umount(self.mnt(kind))
        argv = [self.fanstore, "select", self.data, "--mode", "prefetch", "--cores",
                str(os.cpu_count() or 1), "--reader", "mount", "--sample-mb",
                str(self.a.model_sample_mb), "--json"]
        self.cmd(argv)
        p = subprocess.run(argv, capture_output=True, text=True, timeout=1800)
        try:
            doc = json.loads(p.stdout)
        except ValueError:
            h.log(f"  select failed ({p.returncode}): {p.stderr.strip()[-300:]}")
            return
        mine = {c["codec"]: c for c in doc.get("candidates", [])}.get(self.a.codec) or {}
        self.emit({"kind": "model", "assumes": doc.get("assumes"), "chosen": doc.get("chosen"),
                   "codec": self.a.codec, "files_per_s": mine.get("files_per_s"),
                   "chosen_files_per_s": (doc.get("predicted") or {}).get("files_per_s"),
                   "cores": (doc.get("budget") or {}).get("cores"), "reader": doc.get("reader")})

    def check(self) -> None:
        """Spot-check a sample through every FanStore path against the raw files."""
        import fanstore

        sample = random.Random(3).sample(self.files, min(self.a.verify_sample, len(self.files)))
        results = {}
        for mode in ("fuse-sync", "fuse-prefetch", "api-store", "api-prefetch"):
            self.cold(mode)
            bad, err, store = 0, None, None
            try:
                if mode.startswith("api"):
                    store = fanstore.open_store(self.store if mode == "api-store"
                                                else self.mnt("prefetch"))
                if mode == "api-prefetch":
                    store.prefetch(sample)
                elif mode == "fuse-prefetch":
                    h.control(self.mnt("prefetch"), {"op": "prefetch", "paths": sample,
                                                     "client": "check"})
                root = self.mnt(MOUNT_OF[mode])
                for rel in sample:
                    with open(os.path.join(self.data, rel), "rb") as f:
                        want = f.read()
                    if store is not None:
                        bad += store.read(rel) != want
                    else:
                        with open(os.path.join(root, rel), "rb") as f:
                            bad += f.read() != want
            except Exception as exc:  # noqa: BLE001
                err = f"{type(exc).__name__}: {exc}"
            finally:
                if store is not None:
                    store.close()
            results[mode] = {"checked": len(sample), "differ": bad, "error": err}
        for kind in ("sync", "prefetch"):
            self.umount(self.mnt(kind))
        self.emit({"kind": "check", "results": results})
        h.log(f"correctness: {results}")


# ------------------------------------------------------------------------------ the section


def fx(f: float | None) -> str:
    return "–" if f is None else f"x{f:g}"


def _reads_per_file(rs):
    return med([((r.get("daemon") or {}).get("requests_by_op") or {}).get("read", 0)
                / r["files"] for r in rs if r.get("files")])


def _cpu_us(rs):
    return med([r["fanstore_cpu_s"] / r["files"] * 1e6 for r in rs
                if r.get("fanstore_cpu_s") is not None and r.get("files")])


def _reads(rs, mode=None):
    return num(_reads_per_file(rs), 3) if mode is None or mode in MOUNT_OF else "–"


def _dmed(rs, key, scale=1.0):
    return med([(r.get("daemon") or {}).get(key, 0) / scale for r in rs if r.get("daemon")])


def _memory_rows(bench: PrefetchBench) -> list[dict]:
    """The rows of prefetch mounts with a memory reading."""
    return [r for r in bench.rows if MOUNT_OF.get(r.get("mode")) == "prefetch"
            and r.get("rss_peak") and r.get("kind") in ("pass", "serial", "dl")]


def _stall_targets(bench: PrefetchBench) -> list[tuple]:
    vals, factors = bench.vals, bench.factors or [None]
    out = []
    for f in factors:
        for mode, ref in REF.items():
            s, s0 = (med(vals("stall_s", kind="dl", mode=m, factor=f)) for m in (mode, ref))
            if s is not None and s0:
                out.append((f"DataLoader, {'tight' if f == factors[0] else 'input-bound'} "
                            f"(compute {fx(f)}): {mode} stall <= {ref} stall",
                            f"{s:.3f} s vs {s0:.3f} s ({s / s0:.2f}x)", "<= 1.00x",
                            h.check(s <= s0)))
    s_sync = med(vals("stall_s", kind="serial", mode="fuse-sync"))
    for mode in REF:
        s = med(vals("stall_s", kind="serial", mode=mode))
        if s is not None and s_sync:
            out.append((f"serial reader: {mode} removes >= 80% of the sync stall",
                        f"{1 - s / s_sync:.0%} ({s:.2f} s vs {s_sync:.2f} s)", ">= 80%",
                        h.check(1 - s / s_sync >= 0.8)))
    return out


def _targets(bench: PrefetchBench, budget: float) -> list[tuple]:
    pick, vals = bench.pick, bench.vals
    targets = _stall_targets(bench)
    pre4 = pick(kind="pass", mode="fuse-prefetched", workers=4)
    sync4 = med(vals("files_per_s", kind="pass", mode="fuse-sync", workers=4))
    if pre4 and sync4:
        fps, share = med(vals("files_per_s", kind="pass", mode="fuse-prefetched",
                              workers=4)), _reads_per_file(pre4)
        targets += [("prefetched pass, 4 readers: files/s >= the sync mount's",
                     f"{fps / sync4:.2f}x ({fps:,.0f} vs {sync4:,.0f})", ">= 1.0x",
                     h.check(fps >= sync4)),
                    ("same pass: READ requests that reach a worker per file", f"{share:.1%}",
                     "<= 5%", h.check(share <= 0.05))]
    r1, r2 = (med(vals("stall_s", kind="ranks", ranks=n)) for n in (1, 2))
    if r1 and r2 is not None:
        targets.append(("2 ranks, rank 0's prefetched epoch: stall <= 1.2x the 1-rank epoch",
                        f"{r2 / r1:.2f}x ({r2:.2f} s vs {r1:.2f} s)", "<= 1.2x",
                        h.check(r2 <= 1.2 * r1)))
    targets += [t for t, _row in _predictions(bench)]
    mem = _memory_rows(bench)
    if mem:
        w = max(mem, key=lambda r: r["rss_peak"] - r["rss_base"])
        over = w["rss_peak"] - w["rss_base"]
        targets.append(("memory: FanStore RSS <= base + `--prefetch-mb` + 10% (worst)",
                        f"base {w['rss_base'] / MB:,.0f} MB, peak {w['rss_peak'] / MB:,.0f} MB:"
                        f" +{over / MB:,.0f} MB (PSS +{(w['pss_peak'] - w['pss_base']) / MB:,.0f}"
                        f" MB)", f"<= +{budget * 1.1 / MB:,.0f} MB", h.check(over <= budget * 1.1)))
    return targets


def _predictions(bench: PrefetchBench) -> list[tuple[tuple, tuple]]:
    """Per compute factor: (the target row, the predicted-stall row) of the select model."""
    pick, vals = bench.pick, bench.vals
    x = (pick(kind="model") or [{}])[0].get("files_per_s")
    comp_ms = {r.get("factor"): r["compute_ms"] for r in pick(kind="compute")}
    out = []
    for f in bench.factors or [None]:
        q = dict(kind="dl", mode="fuse-prefetch", factor=f)
        nb, nf, s = med(vals("batches", **q)), med(vals("files", **q)), med(vals("stall_s", **q))
        if x and nb and nf and s is not None and comp_ms.get(f) is not None:
            pred = max(0.0, nf / x - nb * comp_ms[f] / 1e3)
            out.append(((f"`fanstore select --mode prefetch` ({x:,.0f} files/s) vs the "
                         f"DataLoader, compute {fx(f)}: predicted vs measured stall",
                         f"{pred:.2f} s vs {s:.2f} s", "–", "(info)"),
                        (f"{num(comp_ms[f], 1)} ms ({fx(f)})", f"{pred:.2f}", f"{s:.2f}",
                         num(med(vals("stall_after_first_s", **q)), 2))))
    return out


def _passes(bench: PrefetchBench) -> list[tuple]:
    a, pick, vals = bench.a, bench.pick, bench.vals
    passes = []
    for wk in a.workers:
        raw, sync = (med(vals("files_per_s", kind="pass", mode=m, workers=wk))
                     for m in ("raw", "fuse-sync"))
        for mode in a.modes:
            q = dict(kind="pass", mode=mode, workers=wk)
            rs = pick(**q)
            if rs:
                fps = med(vals("files_per_s", **q))
                extra = num(med(vals("order_send_s", **q)), 3) if mode in ORDER_AT_START else \
                    num(med(vals("prefetch_s", **q)), 2) if mode == "fuse-prefetched" else "–"
                passes.append((mode + h.err_tag(rs), wk, *bench.cells(
                    q, "spread:files_per_s", "spread:MB_per_s", "p:lat_ms", "med:cpu_busy_pct"),
                    num(_cpu_us(rs)), _reads(rs, mode), extra, ratio(fps, raw),
                    ratio(fps, sync)))
    return passes


def _counters(bench: PrefetchBench) -> list[tuple]:
    a = bench.a
    groups = [("pass", m, {"workers": wk}, wk) for wk in a.workers for m in a.modes] + \
        [("serial", m, {}, 1) for m in a.serial_modes] + \
        [("dl", m, {"factor": f}, fx(f)) for f in bench.factors or [None] for m in a.dl_modes]
    counters = []
    for kind, mode, extra, shown in groups:
        rs = [r for r in bench.pick(kind=kind, mode=mode, **extra)
              if r.get("daemon") and r.get("files")]
        if MOUNT_OF.get(mode) == "prefetch" and rs:
            counters.append((kind, mode, shown, *(num(med([r["daemon"].get(k, 0) / r["files"]
                                                           for r in rs]), 2) for k in (
                "prefetch_pushed", "prefetch_buffered", "prefetch_served_from_buffer",
                "prefetch_late", "prefetch_missed", "prefetch_skipped", "prefetch_listings")),
                _reads(rs), num(_dmed(rs, "prefetch_bytes_evicted_unused", MB), 1)))
    return counters


def _serial(bench: PrefetchBench) -> list[tuple]:
    s_sync = med(bench.vals("stall_s", kind="serial", mode="fuse-sync"))
    serial = []
    for mode in bench.a.serial_modes:
        q = dict(kind="serial", mode=mode)
        rs, s = bench.pick(**q), med(bench.vals("stall_s", **q))
        if rs:
            serial.append((mode, *bench.cells(q, "spread:epoch_s:2", "spread:stall_s:2",
                                              "p:read_ms"), num(_cpu_us(rs)), _reads(rs, mode),
                           f"{1 - s / s_sync:.0%}" if s is not None and s_sync else "–"))
    return serial


def _loader_table(bench: PrefetchBench, f: float | None) -> str:
    pick, vals = bench.pick, bench.vals
    lines = []
    for mode in bench.a.dl_modes:
        q = dict(kind="dl", mode=mode, factor=f)
        rs = pick(**q)
        if not rs:
            continue
        s, r0 = med(vals("stall_s", **q)), REF.get(mode)
        s0 = med(vals("stall_s", kind="dl", mode=r0, factor=f)) if r0 else None
        err = [r.get("first_error") for r in rs if r.get("errors")]
        lines.append((mode + (" ⚠ " + str(err[0])[:80] if err else ""), HOW[mode],
                      *bench.cells(q, "spread:epoch_s:2", "spread:stall_s:3",
                                   "med:first_batch_s:3", "p:wait_ms:1:0", "med:cpu_busy_pct"),
                      num(_cpu_us(rs)), _reads(rs, mode),
                      f"{s / s0:.2f}x {r0}" if s is not None and s0 else "–"))
    calib = (pick(kind="compute") or [{}])[0].get("sync_per_batch_ms") or []
    comp_ms = {r.get("factor"): r["compute_ms"] for r in pick(kind="compute")}
    nb, cm = med(vals("batches", kind="dl", factor=f)), comp_ms.get(f)
    return h.table(
        ["mode", "dataset / reads", "epoch s", "stall s", "first batch s",
         "wait p50 / p99 ms", "CPU %", "FanStore µs/file", "READs/file", "stall vs"], lines,
        "ll" + "r" * 8, f"DataLoader, compute {num(cm, 1)} ms per batch ({fx(f)}"
        + (", tight" if f == (bench.factors or [None])[0] else "") + f"; calibration "
        f"{', '.join(f'{c:.1f}' for c in calib)} ms/batch); ideal epoch "
        f"{num((nb or 0) * (cm or 0) / 1e3, 2)} s")


def _ranks(bench: PrefetchBench) -> list[tuple]:
    ranks = []
    for n in (1, 2):
        q = dict(kind="ranks", ranks=n)
        rs = bench.pick(**q)
        if rs:
            ranks.append((n, *bench.cells(q, "spread:epoch_s:2", "spread:stall_s:2", "p:read_ms"),
                          num(_dmed(rs, "remote_reads")), num(_dmed(rs, "prefetch_pushed")),
                          _reads(rs), num(_cpu_us(rs))))
    return ranks


def _memory(bench: PrefetchBench, budget: float) -> list[tuple]:
    mem, memory = _memory_rows(bench), []
    for kind in ("pass", "serial", "dl"):
        for mode in ("fuse-prefetch", "fuse-prefetched", "api-prefetch"):
            rs = [r for r in mem if r["kind"] == kind and r["mode"] == mode]
            if rs:
                def m(key, rs=rs):
                    return num(med([r[key] / MB for r in rs]))

                memory.append((kind, mode, m("rss_base"), m("rss_peak"), "+" + num(med(
                    [(r["rss_peak"] - r["rss_base"]) / MB for r in rs])), m("pss_base"),
                    m("pss_peak"), num(budget / MB)))
    return memory


def _checks(bench: PrefetchBench) -> list[str]:
    rows = bench.rows
    checks = [f"- {mode}: {res['checked']} files compared with the raw files: "
              + (f"**error: {res['error']}**" if res.get("error") else
                 "all identical" if not res["differ"] else f"**{res['differ']} differ**")
              for r in bench.pick(kind="check") for mode, res in r["results"].items()]
    errs = [r for r in rows if r.get("errors") and r.get("kind") in
            ("pass", "serial", "dl", "calib", "ranks")]
    checks.append(f"- passes or epochs with errors: {len(errs)}"
                  + (f" (first: {errs[0].get('first_error')})" if errs else ""))
    return checks + [f"- **the daemon died during {r['kind']} {r.get('mode')} rep "
                     f"{r.get('rep')}**" for r in rows if r.get("daemon_died")]


def _caption(bench: PrefetchBench, st: dict, budget: float) -> str:
    p, model = st["params"], (bench.pick(kind="model") or [{}])[0]
    return (f"{st['files']:,} files of {p['min_kb']}-{p['max_kb']} kB "
            f"({st['raw_bytes'] / MB:,.0f} MB), `--partitions {p['partitions']} --codec "
            f"{p['codec']}` ({(st.get('stored_bytes') or 0) / MB:,.0f} MB stored, ratio "
            f"{st.get('ratio') or 0:.2f}); `--prefetch-mb {st['prefetch_mb']}` = "
            f"{budget / max(1, st['raw_bytes']):.0%} of the dataset; serial compute "
            f"{num(bench.serial_compute_ms, 3)} ms per file; model: `{model.get('chosen')}` "
            f"chosen ({num(model.get('chosen_files_per_s'))} files/s), "
            f"{num(model.get('files_per_s'))} files/s for `{model.get('codec')}`.")


def render(bench: PrefetchBench, label: str | None, argv: list[str]) -> str:
    a, st = bench.a, bench.pick(kind="store")[0]
    budget = st["prefetch_mb"] * 2**20
    serial, ranks, memory = _serial(bench), _ranks(bench), _memory(bench, budget)
    predicted = [row for _t, row in _predictions(bench)]
    loaders = [_loader_table(bench, f) for f in (bench.factors or [None])
               if bench.pick(kind="compute")]
    return h.section(bench, label, argv, [
        _caption(bench, st, budget),
        h.table(["target", "measured", "goal", "status"], _targets(bench, budget), "llrl",
                "Targets"),
        h.table(["mode", "readers", "files/s", "MB/s", "p50 / p99 ms", "CPU %",
                 "FanStore µs/file", "READs/file", "order s / prefetch s", "vs raw",
                 "vs fuse-sync"], _passes(bench),
                title=f"Read passes ({a.reps} repetition(s), cold)"),
        h.table(["phase", "mode", "readers / factor", "pushed", "buffered", "from buffer",
                 "late", "missed", "skipped", "listed", "READs", "MB evicted unused"],
                _counters(bench), "ll" + "r" * 10, "Prefetch counters per file read"),
        h.table(["mode", "epoch s", "stall s", "read p50 / p99 ms", "FanStore µs/file",
                 "READs/file", "removed"], serial,
                title=f"A reader that does not pipeline ({a.serial_reps} repetition(s))")
        if serial else "",
        *loaders,
        h.table(["ranks", "epoch s", "stall s", "read p50 / p99 ms", "remote reads", "pushed",
                 "READs/file", "FanStore µs/file"], ranks, "r" * 8,
                "Two ranks: rank 0's prefetched epoch with half of the files remote")
        if ranks else "",
        h.table(["compute per batch", "predicted stall s", "measured fuse-prefetch stall s",
                 "after the first batch s"], predicted,
                title="What `fanstore select --mode prefetch` predicted") if predicted else "",
        h.table(["phase", "mode", "base RSS MB", "peak RSS MB", "peak - base", "base PSS MB",
                 "peak PSS MB", "budget MB"], memory, "ll" + "r" * 6,
                "Memory of the FanStore processes (prefetch mounts)") if memory else "",
        "### Correctness and errors\n\n" + "\n".join(_checks(bench))])


HOW = {"raw": "plain files, `open().read()`", "fuse-sync": "sync mount, `open().read()`",
       "fuse-prefetch": "prefetch mount, `open().read()`, `PrefetchSampler`",
       "api-prefetch": "`FanStoreDataset(open_store(MNT))`, `PrefetchSampler`",
       "api-store": "`FanStoreDataset(open_store(STORE))`"}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="full")
    h.args(ap, "prefetch_bench", os.environ.get("FANSTORE_PREFETCHBENCH_WORK",
                                                "/tmp/fanstore-prefetchbench"))
    h.dataset_args(ap, pass_limit=900.0)
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
    ap.add_argument("--verify-sample", type=int, default=200)
    a = h.presets(ap.parse_args(argv), PRESETS)
    a.workers = h.ints(a.workers)
    a.modes, a.serial_modes, a.dl_modes = (h.words(x) for x in (a.modes, a.serial_modes,
                                                                a.dl_modes))
    bad = [m for m in a.modes + a.dl_modes + a.serial_modes if m not in MODES]
    if bad:
        ap.error(f"unknown mode(s) {bad}; known: {MODES}")
    a.phases = set(h.words(a.phases))
    a.compute_factors = [float(x) for x in h.words(a.compute_factors)]
    return a


def main(argv: list[str] | None = None) -> int:
    raw = sys.argv[1:] if argv is None else argv
    sub = {"_pass": pass_main, "_serial": serial_main, "_loader": loader_main}
    if raw and raw[0] in sub:
        return sub[raw[0]](raw[1:])
    return h.main(PrefetchBench(parse_args(raw)), render, raw)


if __name__ == "__main__":
    sys.exit(main())
