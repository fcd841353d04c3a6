#!/usr/bin/env python3
"""FanStore's single-node mount next to the raw source directory, measured in one run.

Generates (or reuses) a dataset with tools/gen_dataset.py, packs it with ``fanstore pack``
(timed after dropping the page cache; the ratio is recorded), then measures every backend
(``raw`` = the source directory, ``fanstore-<codec>`` = a FanStore mount of it) with
tools/bench/reader.py:

- small files: the same shuffled list read with 1 and 4 reader processes (open / read whole /
  close); cold = fresh mount + ``sync; echo 3 > /proc/sys/vm/drop_caches``, warm = the very
  same pass again at once on the same mount; several repetitions with different shuffles,
  backends interleaved within each repetition so drift on the shared machine hits all alike;
- metadata: ``os.walk`` of the tree and ``os.stat`` of every small file, cold and warm;
- large files: sequential 1 MiB reads of the large files, cold and warm;
- correctness: a sample of small files and one large file compared byte for byte with the
  source after the measurements.

It writes its section of docs/benchmarks.md (between ``<!-- BEGIN mount_bench -->`` and
``<!-- END mount_bench -->``; the rest of the file is kept) and every raw row to
tools/bench/results/mount_bench.jsonl. Every mount it makes is unmounted on exit, also on
errors and on Ctrl-C / SIGTERM. Run as root (drop_caches, FUSE).

    .venv/bin/python tools/bench/mount_bench.py --preset quick     # 1-2 min, a smoke run
    .venv/bin/python tools/bench/mount_bench.py --preset full      # peers' shape, ~10-15 min
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
READER = os.path.join(HERE, "reader.py")
GEN = os.path.join(common.REPO, "tools", "gen_dataset.py")
SECTION = "mount_bench"

PRESETS = {
    # A smoke run: checks the harness end to end in about two minutes; numbers are not results.
    "quick": dict(files=5000, classes=50, large=1, large_mb=128, reps=2, warm_reps=2,
                  large_reps=1),
    # The peers' shape (../shared/bench/peers-results.md): 20,000 files of 50-150 kB in 100
    # class directories + 8 x 256 MiB float32 files.
    "full": dict(files=20000, classes=100, large=8, large_mb=256, reps=3, warm_reps=3,
                 large_reps=2),
}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------ the run


class Bench(common.RowLog):
    def __init__(self, a: argparse.Namespace) -> None:
        self.a = a
        self.work = os.path.abspath(a.work)
        self.data = os.path.join(self.work, "data")
        self.lists = os.path.join(self.work, "lists")
        self.mnt_root = os.path.join(self.work, "mnt")
        self.py = sys.executable
        self.fanstore = a.fanstore or _find_fanstore()
        self.rows: list[dict] = []
        self.commands: list[str] = []
        self.mounted: set[str] = set()
        self.failed: dict[str, str] = {}
        self.run_id = time.strftime("%Y%m%dT%H%M%S")
        self.t_start = time.time()
        self.backends = ["raw"] + [backend_name(c) for c in a.codec]
        self.codec_of = {backend_name(c): c for c in a.codec}
        self.jsonl_tmp = os.path.join(self.work, f"mount_bench-{self.run_id}.jsonl")
        self.pids: dict[str, int | None] = {}

    # -------------------------------------------------------------- bookkeeping
    def cmd(self, text: str) -> None:
        if text not in self.commands:
            self.commands.append(text)

    def root_of(self, backend: str) -> str:
        return self.data if backend == "raw" else os.path.join(self.mnt_root, backend)

    def store_of(self, backend: str) -> str:
        return os.path.join(self.work, "stores", backend)

    # -------------------------------------------------------------- dataset
    def dataset(self) -> None:
        a = self.a
        want = dict(files=a.files, classes=a.classes, min_kb=a.min_kb, max_kb=a.max_kb,
                    large=a.large, large_mb=a.large_mb, seed=a.seed)
        stamp = os.path.join(self.work, "dataset.json")
        argv = [self.py, GEN, self.data, "--files", str(a.files), "--classes", str(a.classes),
                "--min-kb", str(a.min_kb), "--max-kb", str(a.max_kb), "--large", str(a.large),
                "--large-mb", str(a.large_mb), "--seed", str(a.seed), "--subdir", "small"]
        self.cmd(" ".join(shlex.quote(x) for x in argv))
        try:
            with open(stamp) as f:
                have = json.load(f)
        except (OSError, ValueError):
            have = None
        if have != want or not os.path.isdir(self.data):
            log(f"generating dataset: {a.files} small files + {a.large} x {a.large_mb} MiB")
            shutil.rmtree(self.data, ignore_errors=True)
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
        os.makedirs(self.lists, exist_ok=True)
        small, large = [], []
        kinds: dict[str, list[int]] = {}
        for top, dirs, files in os.walk(self.data):
            dirs.sort()
            for name in sorted(files):
                full = os.path.join(top, name)
                rel = os.path.relpath(full, self.data)
                size = os.path.getsize(full)
                if rel.startswith("small" + os.sep):
                    small.append(rel)
                    k = kinds.setdefault("small/*." + name.rsplit(".", 1)[-1], [0, 0])
                elif rel.startswith("large" + os.sep):
                    large.append(rel)
                    k = kinds.setdefault("large/*." + name.rsplit(".", 1)[-1], [0, 0])
                else:
                    continue
                k[0] += 1
                k[1] += size
        for name, items in (("small.txt", small), ("large.txt", large)):
            with open(os.path.join(self.lists, name), "w") as f:
                f.write("".join(p + "\n" for p in items))
        self.n_small, self.n_large = len(small), len(large)
        self.emit({"kind": "dataset", "params": want, "kinds": kinds,
                   "n_small": len(small), "n_large": len(large),
                   "dirs": sum(len(d) for _t, d, _f in os.walk(self.data))})

    # -------------------------------------------------------------- pack
    def pack(self, backend: str) -> None:
        a = self.a
        codec = self.codec_of[backend]
        dest = self.store_of(backend)
        argv = [self.fanstore, "pack", self.data, dest, "--partitions", str(a.partitions),
                "--codec", codec, "--jobs", str(a.jobs), "--no-progress", "--force"]
        self.cmd(" ".join(shlex.quote(x) for x in argv))
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        if a.reuse_store and os.path.exists(os.path.join(dest, "fanstore.idx")):
            log(f"reusing store {dest} (--reuse-store: pack not timed)")
            seconds = None
        else:
            shutil.rmtree(dest, ignore_errors=True)
            common.drop_caches()
            log(f"pack {backend}: {' '.join(argv[1:])}")
            t0 = time.perf_counter()
            p = subprocess.run(argv, capture_output=True, text=True)
            os.sync()
            seconds = time.perf_counter() - t0
            if p.returncode != 0:
                self.failed[backend] = f"pack failed: {p.stderr.strip()[-500:]}"
                self.emit({"kind": "pack", "backend": backend, "codec": codec, "ok": False,
                           "error": self.failed[backend]})
                log(f"  {self.failed[backend]}")
                return
            log("  " + " | ".join(p.stdout.strip().splitlines()))
        info = json.loads(subprocess.run([self.fanstore, "info", dest, "--json"], check=True,
                                         capture_output=True, text=True).stdout)
        counts = info.get("counts", {})
        store_bytes = common.dir_bytes(dest)
        raw = counts.get("raw_bytes") or 0
        row = self.emit({"kind": "pack", "backend": backend, "codec": codec, "ok": True,
                         "seconds": None if seconds is None else round(seconds, 3),
                         "partitions": a.partitions, "jobs": a.jobs,
                         "raw_bytes": raw, "store_bytes": store_bytes,
                         "stored_data_bytes": counts.get("stored_bytes"),
                         "index_bytes": info.get("index_bytes"),
                         "ratio": round(raw / store_bytes, 4) if store_bytes else None,
                         "files": counts.get("files"), "codec_chunks": info.get("codec_chunks")})
        if seconds is not None:
            log(f"  {seconds:.1f} s, ratio {row['ratio']:.3f}")

    # -------------------------------------------------------------- mounts
    def umount(self, backend: str) -> None:
        if backend == "raw":
            return
        mnt = self.root_of(backend)
        if not is_mounted(mnt):
            self.mounted.discard(mnt)
            return
        self.cmd(f"{self.fanstore} umount {mnt}")
        p = subprocess.run([self.fanstore, "umount", mnt], capture_output=True, text=True,
                           timeout=90)
        if p.returncode != 0 or is_mounted(mnt):
            log(f"  fanstore umount {mnt} failed ({p.stderr.strip()}); lazy fusermount3 -u -z")
            subprocess.run(["fusermount3", "-u", "-z", "--", mnt], capture_output=True)
        self._wait_gone(self.pids.get(backend))
        self.mounted.discard(mnt)

    @staticmethod
    def _wait_gone(pid: int | None, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while pid and time.monotonic() < deadline:
            try:
                os.kill(pid, 0)
            except OSError:
                return
            time.sleep(0.05)

    def cold(self, backend: str, why: str) -> bool:
        """Fresh mount (FanStore) + dropped caches. False if the backend cannot be mounted."""
        if backend in self.failed:
            return False
        self.umount(backend)
        dropped = common.drop_caches()
        if backend == "raw":
            return True
        mnt = self.root_of(backend)
        os.makedirs(mnt, exist_ok=True)
        argv = [self.fanstore, "mount", self.store_of(backend), mnt] + shlex.split(self.a.mount_opts)
        self.cmd(" ".join(shlex.quote(x) for x in argv))
        t0 = time.perf_counter()
        p = subprocess.run(argv, capture_output=True, text=True, timeout=120)
        seconds = time.perf_counter() - t0
        if p.returncode != 0 or not is_mounted(mnt):
            self.failed[backend] = f"mount failed: {p.stderr.strip()[-500:]}"
            self.emit({"kind": "mount", "backend": backend, "ok": False,
                       "error": self.failed[backend]})
            log(f"  {backend}: {self.failed[backend]}")
            return False
        self.mounted.add(mnt)
        self.pids[backend] = daemon_pid(mnt)
        self.emit({"kind": "mount", "backend": backend, "ok": True, "for": why,
                   "seconds": round(seconds, 3), "dropped_caches": dropped,
                   "daemon_pid": self.pids[backend]})
        return True

    def stats(self, backend: str) -> dict | None:
        if backend == "raw":
            return None
        p = subprocess.run([self.fanstore, "stats", self.root_of(backend), "--json"],
                           capture_output=True, text=True, timeout=30)
        if p.returncode != 0:
            return None
        try:
            return json.loads(p.stdout)
        except ValueError:
            return None

    # -------------------------------------------------------------- one pass
    def reader(self, backend: str, kind: str, phase: str, rep: int, sub: str,
               *args: str) -> dict | None:
        if backend in self.failed:
            return None
        root = self.root_of(backend)
        argv = [self.py, READER, sub, "--root", root] + list(args)
        pid = self.pids.get(backend) if backend != "raw" else None
        if pid and sub in ("read", "stat"):
            argv += ["--watch-pid", str(pid)]
        shown = [x if x != root else "ROOT" for x in argv]
        if "--watch-pid" in shown:
            k = shown.index("--watch-pid")
            del shown[k:k + 2]
        self.cmd(" ".join(shlex.quote(x) for x in shown))
        before = self.stats(backend)
        load = common.loadavg1()
        # Own session: on Ctrl-C the whole reader group (it forks) is killed, so nothing keeps
        # a file open on the mount while we unmount.
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
        try:
            out, err = proc.communicate(timeout=self.a.pass_limit + 120)
        except BaseException:
            _kill_group(proc)
            raise
        if pid and not pid_alive(pid):
            self.emit({"kind": "daemon_died", "backend": backend, "daemon_pid": pid,
                       "during": f"{kind} {sub} {phase} rep={rep}",
                       "log_tail": _log_tail(root)})
            log(f"  {backend}: the FanStore daemon (pid {pid}) DIED during {kind} {sub} {phase}")
        after = self.stats(backend)
        try:
            row = json.loads(out.strip().splitlines()[-1])
        except (ValueError, IndexError):
            row = {"op": sub, "errors": 1, "first_error": f"reader failed: {err.strip()[-300:]}"}
        row.update(kind=kind, backend=backend, phase=phase, rep=rep, load1_before=load)
        if before and after:
            row["daemon"] = {k: round(after[k] - before[k], 6) for k in after
                             if isinstance(after.get(k), (int, float))
                             and isinstance(before.get(k), (int, float))}
        self.emit(row)
        rate = row.get("files_per_s") or row.get("entries_per_s")
        mbs = row.get("MB_per_s")
        log(f"  {backend:<16} {kind:<5} {sub:<6} {phase:<4} w={row.get('workers', 1)} rep={rep}: "
            f"{rate} /s" + (f", {mbs} MB/s" if mbs is not None else "")
            + (f", {row['seconds']:.2f} s" if "seconds" in row else "")
            + (f"  ERRORS {row['errors']}: {row.get('first_error')}" if row.get("errors") else "")
            + ("  TRUNCATED" if row.get("truncated") else ""))
        return row

    # -------------------------------------------------------------- phases
    def run(self) -> None:
        a = self.a
        os.makedirs(self.mnt_root, exist_ok=True)
        self.machine = common.machine_table(self.work)
        log(f"work dir {self.work}; backends {' '.join(self.backends)}")
        self.dataset()
        for b in self.backends[1:]:
            self.pack(b)
        small = os.path.join(self.lists, "small.txt")
        large = os.path.join(self.lists, "large.txt")
        limit = ["--time-limit", str(a.pass_limit)]

        log("metadata: walk and stat, each cold (its own fresh mount) then warm")
        for b in self.backends:
            # A listing primes the dentry/attribute caches (readdirplus on FUSE), so the cold
            # stat pass gets a fresh mount of its own rather than following the walk.
            if self.cold(b, "walk"):
                self.reader(b, "meta", "cold", 1, "walk")
                self.reader(b, "meta", "warm", 1, "walk")
            if self.cold(b, "stat"):
                self.reader(b, "meta", "cold", 1, "stat", "--list", small, "--seed", "7", *limit)
                self.reader(b, "meta", "warm", 1, "stat", "--list", small, "--seed", "7", *limit)

        log(f"small files: {self.n_small} files, readers {a.workers}, {a.reps} reps")
        for w in a.workers:
            for rep in range(1, a.reps + 1):
                for b in self.backends:
                    if not self.cold(b, f"small w={w} rep={rep}"):
                        continue
                    args = ["--list", small, "--workers", str(w), "--seed", str(rep), *limit]
                    self.reader(b, "small", "cold", rep, "read", *args)
                    if rep <= a.warm_reps:
                        self.reader(b, "small", "warm", rep, "read", *args)

        if self.n_large:
            log(f"large files: {self.n_large} files, sequential 1 MiB reads")
            for rep in range(1, a.large_reps + 1):
                for b in self.backends:
                    if not self.cold(b, f"large rep={rep}"):
                        continue
                    args = ["--list", large, "--workers", "1", "--seed", "-1", "--chunk",
                            str(1 << 20), *limit]
                    self.reader(b, "large", "cold", rep, "read", *args)
                    self.reader(b, "large", "warm", rep, "read", *args)

        log("correctness: sample of small files + one large file vs the source")
        with open(os.path.join(self.lists, "verify-large.txt"), "w") as f:
            with open(large) as g:
                f.write(g.readline())
        for b in self.backends[1:]:
            if not self.cold(b, "verify"):
                continue
            self.reader(b, "check", "-", 1, "verify", "--ref", self.data, "--list", small,
                        "--sample", str(a.verify_sample))
            if self.n_large:
                self.reader(b, "check", "-", 2, "verify", "--ref", self.data, "--list",
                            os.path.join(self.lists, "verify-large.txt"))
            self.umount(b)
        self.total_seconds = time.time() - self.t_start

    def cleanup(self) -> None:
        for b in self.backends[1:]:
            try:
                self.umount(b)
            except Exception as exc:  # noqa: BLE001 - keep cleaning the others
                log(f"  cleanup of {b} failed: {exc}")
        for mnt in list(self.mounted):
            subprocess.run(["fusermount3", "-u", "-z", "--", mnt], capture_output=True)
        for b in self.backends[1:]:
            try:
                os.rmdir(self.root_of(b))
            except OSError:
                pass
        if self.a.clean:
            shutil.rmtree(self.work, ignore_errors=True)


def is_mounted(path: str) -> bool:
    """True if ``path`` is a mount point, also when its FUSE daemon has died (os.path.ismount
    then fails with ENOTCONN and says False)."""
    from fanstore import mounttable

    return os.path.abspath(path) in mounttable.mounts()


def pid_alive(pid: int | None) -> bool:
    from fanstore.process import pid_alive as alive

    return alive(pid)


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except OSError:
        pass
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        pass


def _log_tail(mnt: str, lines: int = 5) -> list[str]:
    try:
        from fanstore import runtime

        with open(runtime.MountRuntime.find(mnt).log_path) as f:
            return [x.rstrip() for x in f.readlines()[-lines:]]
    except Exception:  # noqa: BLE001 - best effort
        return []


def _find_fanstore() -> str:
    cand = os.path.join(os.path.dirname(sys.executable), "fanstore")
    if os.access(cand, os.X_OK):
        return cand
    found = shutil.which("fanstore")
    if not found:
        sys.exit("mount_bench: no 'fanstore' command (run with .venv/bin/python, or --fanstore)")
    return found


def daemon_pid(mnt: str) -> int | None:
    """The pid of the FanStore daemon serving ``mnt`` (for its CPU time), if it can be found."""
    try:
        from fanstore import runtime

        pid = (runtime.read_state(mnt) or {}).get("pid")
        if pid:
            return int(pid)
    except Exception:  # noqa: BLE001 - fall back to /proc
        pass
    target = os.path.abspath(mnt)
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if b"mount" in argv and any(os.path.abspath(x.decode(errors="replace")) == target
                                    for x in argv if x):
            return int(entry)
    return None


def backend_name(codec: str) -> str:
    return "fanstore-" + codec.replace(":", "")


# ------------------------------------------------------------------------------ report


def section(bench: Bench, label: str | None, argv: list[str]) -> str:
    rows = bench.rows
    a = bench.a
    backends = bench.backends

    pick = functools.partial(common.pick_rows, rows)
    vals = functools.partial(common.row_vals, rows)

    out: list[str] = []
    w = out.append
    w("## FanStore mount vs the raw directory (`tools/bench/mount_bench.py`)")
    w("")
    if label:
        w(f"> **{label}**")
        w("")
    w(f"Run {bench.run_id} ({common.now_utc()}), {bench.total_seconds / 60:.1f} min in all. "
      f"Both backends were measured in this same run, interleaved repetition by repetition; "
      f"compare the ratios, not the absolute numbers, with other runs. Raw rows: "
      f"`tools/bench/results/mount_bench.jsonl`. Rerun: `{' '.join(argv)}` (as root).")
    w("")
    w("### Machine")
    w("")
    w(bench.machine)
    w("")
    ds = pick(kind="dataset")[0]
    w("### Dataset")
    w("")
    p = ds["params"]
    w(f"`tools/gen_dataset.py` (seed {p['seed']}): {ds['n_small']:,} small files of "
      f"{p['min_kb']}-{p['max_kb']} kB in {p['classes']} class directories, "
      f"{ds['n_large']} large float32 file(s) of {p['large_mb']} MiB. MB = 10^6 bytes.")
    w("")
    w("| part | files | bytes |")
    w("| --- | ---: | ---: |")
    tot_f = tot_b = 0
    for name, (n, b) in sorted(ds["kinds"].items()):
        w(f"| {name} | {n:,} | {b:,} |")
        tot_f += n
        tot_b += b
    w(f"| **total** | {tot_f:,} | {tot_b:,} ({tot_b / 2**30:.2f} GiB) |")
    w("")

    w("### Pack")
    w("")
    w("Pack = wall time of `fanstore pack` from the source directory, page cache dropped "
      "first. Ratio = source bytes / store bytes on disk (partitions + index). Mount = "
      "`fanstore mount` until it returns (ready), median over the run's cold mounts.")
    w("")
    w("| backend | codec | partitions | jobs | pack s | pack MB/s | store MB | ratio | mount s |")
    w("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for b in backends[1:]:
        pr = pick(kind="pack", backend=b)
        if not pr or not pr[0].get("ok"):
            w(f"| {b} | {bench.codec_of[b]} | | | failed | | | | |")
            continue
        r = pr[0]
        secs = r.get("seconds")
        mnt = common.med([m["seconds"] for m in pick(kind="mount", backend=b, ok=True)])
        w(f"| {b} | {r['codec']} | {r['partitions']} | {r['jobs']} | {common.num(secs, 1)} | "
          f"{common.num(r['raw_bytes'] / 1e6 / secs if secs else None)} | "
          f"{common.num(r['store_bytes'] / 1e6)} | {r['ratio']:.2f} | {common.num(mnt, 2)} |")
    w("")

    w(f"### Small-file reads ({bench.n_small:,} files, every file once, shuffled)")
    w("")
    w("Cold = fresh mount + `sync; echo 3 > /proc/sys/vm/drop_caches` before the pass; warm = "
      "the same pass (same order) again at once on the same mount. Readers are separate "
      "processes, each taking a round-robin share of the shuffled list and doing "
      "`open(); f.read(); close()` per file, released together by a barrier; wall time runs "
      "from the release to the last reader finishing. Cells: median (min–max) over "
      f"{a.reps} cold / {min(a.reps, a.warm_reps)} warm passes with different shuffles. "
      "CPU = whole machine (2 cores, includes the FUSE daemon); daemon µs/file = the "
      "FanStore daemon's own CPU time per file. `vs raw` = median files/s over the raw "
      "directory's median with the same readers, same run.")
    w("")
    w("| backend | readers | cold files/s | cold MB/s | warm files/s | warm MB/s | "
      "cold p50 / p99 ms | warm p50 / p99 ms | cold CPU % | daemon µs/file cold / warm | "
      "cold vs raw | warm vs raw |")
    w("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for wk in a.workers:
        raw_c = common.med(vals("files_per_s", kind="small", backend="raw", phase="cold", workers=wk))
        raw_w = common.med(vals("files_per_s", kind="small", backend="raw", phase="warm", workers=wk))
        for b in backends:
            if b in bench.failed and not pick(kind="small", backend=b):
                w(f"| {b} | {wk} | {bench.failed[b][:60]} | | | | | | | | | |")
                continue
            q = dict(kind="small", backend=b, workers=wk)
            cf = vals("files_per_s", phase="cold", **q)
            wf = vals("files_per_s", phase="warm", **q)
            err = sum(r.get("errors") or 0 for r in pick(**q))
            trunc = any(r.get("truncated") for r in pick(**q))
            dc = vals("watched_cpu_us_per_file", phase="cold", **q)
            dw = vals("watched_cpu_us_per_file", phase="warm", **q)
            daemon = "–" if b == "raw" else f"{common.num(common.med(dc))} / {common.num(common.med(dw))}"
            note = (f" ⚠ {err} errors" if err else "") + (" ⚠ truncated" if trunc else "")
            w(f"| {b}{note} | {wk} | {common.spread(cf)} | "
              f"{common.spread(vals('MB_per_s', phase='cold', **q))} | {common.spread(wf)} | "
              f"{common.spread(vals('MB_per_s', phase='warm', **q))} | "
              f"{common.num(common.med(vals('lat_ms_p50', phase='cold', **q)), 2)} / "
              f"{common.num(common.med(vals('lat_ms_p99', phase='cold', **q)), 1)} | "
              f"{common.num(common.med(vals('lat_ms_p50', phase='warm', **q)), 2)} / "
              f"{common.num(common.med(vals('lat_ms_p99', phase='warm', **q)), 1)} | "
              f"{common.num(common.med(vals('cpu_busy_pct', phase='cold', **q)))} | {daemon} | "
              f"{common.ratio(common.med(cf), raw_c)} | {common.ratio(common.med(wf), raw_w)} |")
    w("")

    w("### Metadata")
    w("")
    w("`walk` = `os.walk` over the whole tree (readdir only); `stat` = `os.stat` of every "
      "small file in shuffled order, 1 process. Cold = fresh mount + dropped caches (walk and "
      "stat each get their own, as a listing primes the caches stat uses); warm = the same "
      "pass again at once. One pass each.")
    w("")
    w("| backend | walk cold s | walk warm s | stat cold /s | stat warm /s | stat cold vs raw | "
      "stat warm vs raw |")
    w("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    rs = {ph: common.med(vals("files_per_s", kind="meta", backend="raw", op="stat", phase=ph))
          for ph in ("cold", "warm")}
    for b in backends:
        q = dict(kind="meta", backend=b)
        sc = common.med(vals("files_per_s", op="stat", phase="cold", **q))
        sw = common.med(vals("files_per_s", op="stat", phase="warm", **q))
        w(f"| {b} | {common.num(common.med(vals('seconds', op='walk', phase='cold', **q)), 3)} | "
          f"{common.num(common.med(vals('seconds', op='walk', phase='warm', **q)), 3)} | "
          f"{common.num(sc)} | {common.num(sw)} | {common.ratio(sc, rs['cold'])} | "
          f"{common.ratio(sw, rs['warm'])} |")
    w("")

    if bench.n_large:
        w(f"### Large files ({bench.n_large} x {p['large_mb']} MiB, 1 reader, sequential "
          "1 MiB `readinto`, one file after another)")
        w("")
        w(f"Median (min–max) over {a.large_reps} cold pass(es), each followed by a warm one.")
        w("")
        w("| backend | cold MB/s | warm MB/s | cold CPU % | cold vs raw | warm vs raw |")
        w("| --- | ---: | ---: | ---: | ---: | ---: |")
        rl = {ph: common.med(vals("MB_per_s", kind="large", backend="raw", phase=ph))
              for ph in ("cold", "warm")}
        for b in backends:
            q = dict(kind="large", backend=b)
            c = vals("MB_per_s", phase="cold", **q)
            ww = vals("MB_per_s", phase="warm", **q)
            w(f"| {b} | {common.spread(c)} | {common.spread(ww)} | "
              f"{common.num(common.med(vals('cpu_busy_pct', phase='cold', **q)))} | "
              f"{common.ratio(common.med(c), rl['cold'])} | {common.ratio(common.med(ww), rl['warm'])} |")
        w("")

    w("### FanStore daemon counters per small-file pass")
    w("")
    w("Differences of `fanstore stats --json` across each pass, per file read (medians over the "
      "passes). Each FanStore open is one OPEN request to the daemon; `reads` = READ requests "
      "that reached the daemon; `decoded` = chunks decompressed; `decode µs` = time inside "
      "the codec per file.")
    w("")
    w("| backend | readers | phase | opens/file | reads/file | cache hits/file | decoded/file | "
      "decode µs/file | daemon CPU µs/file | daemon errors |")
    w("| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for b in backends[1:]:
        for wk in a.workers:
            for ph in ("cold", "warm"):
                rs_ = [r for r in pick(kind="small", backend=b, workers=wk, phase=ph)
                       if r.get("daemon") and r.get("files")]
                if not rs_:
                    continue

                def per(key, scale=1.0):
                    return common.med([r["daemon"].get(key, 0) / r["files"] * scale for r in rs_])

                errs = sum(r["daemon"].get("errors", 0) for r in rs_)
                w(f"| {b} | {wk} | {ph} | {common.num(per('opens'), 2)} | "
                  f"{common.num(per('reads'), 2)} | {common.num(per('cache_hits'), 2)} | "
                  f"{common.num(per('chunks_decoded'), 2)} | "
                  f"{common.num(per('decode_seconds', 1e6))} | "
                  f"{common.num(common.med(vals('watched_cpu_us_per_file', **dict(kind='small', backend=b, workers=wk, phase=ph))))} | "
                  f"{errs} |")
    w("")

    w("### Correctness")
    w("")
    checks = pick(kind="check")
    if checks:
        for r in checks:
            w(f"- {r['backend']}: {r['checked']} file(s) compared with the source "
              f"({r['bytes'] / 1e6:,.0f} MB): "
              + ("all identical" if r.get("ok") else f"**{r['errors']} differ**: {r.get('first_error')}"))
    errors = [r for r in rows if r.get("errors") and r.get("kind") in ("small", "large", "meta")]
    w(f"- read errors during the measurements: {sum(r['errors'] for r in errors)}"
      + (f" (first: {errors[0].get('first_error')})" if errors else ""))
    for b, msg in bench.failed.items():
        w(f"- {b}: {msg}")
    for r in pick(kind="daemon_died"):
        w(f"- **{r['backend']}: the daemon (pid {r['daemon_pid']}) died during {r['during']}**; "
          f"last log lines: {' / '.join(r.get('log_tail') or []) or '(none)'}")
    w("")

    w("### Exact commands")
    w("")
    w("```")
    w("# drop_caches = sync; echo 3 > /proc/sys/vm/drop_caches (before every pack and every cold pass)")
    w(f"# ROOT = {bench.data} (raw) or {bench.mnt_root}/<backend> (a FanStore mount)")
    for c in bench.commands:
        w(c.replace(common.REPO + "/", ""))
    w("```")
    return "\n".join(out)


# ------------------------------------------------------------------------------ main


def parse_args(argv: list[str] | None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="full",
                    help="dataset size and repetitions (default full); options below override")
    ap.add_argument("--work", default=os.environ.get("FANSTORE_BENCH_WORK", "/tmp/fanstore-bench"),
                    help="work directory: dataset, stores, mount points (default "
                         "/tmp/fanstore-bench or $FANSTORE_BENCH_WORK)")
    ap.add_argument("--files", type=int, help="small files")
    ap.add_argument("--classes", type=int, help="class directories")
    ap.add_argument("--min-kb", type=int, default=50)
    ap.add_argument("--max-kb", type=int, default=150)
    ap.add_argument("--large", type=int, help="large files")
    ap.add_argument("--large-mb", type=int, help="size of each large file in MiB")
    ap.add_argument("--seed", type=int, default=20240601, help="dataset seed")
    ap.add_argument("--codec", action="append", help="FanStore codec(s) to pack with, one "
                    "backend each (repeatable; default zstd:3)")
    ap.add_argument("--partitions", type=int, default=8)
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                    help="fanstore pack --jobs (default: all cores)")
    ap.add_argument("--mount-opts", default="", help="extra options for `fanstore mount`")
    ap.add_argument("--workers", default="1,4", help="reader process counts (default 1,4)")
    ap.add_argument("--reps", type=int, help="cold passes per backend and reader count")
    ap.add_argument("--warm-reps", type=int, help="warm passes (after the first cold ones)")
    ap.add_argument("--large-reps", type=int, help="cold+warm large-file passes")
    ap.add_argument("--pass-limit", type=float, default=600.0,
                    help="seconds after which one read pass is cut short (default 600)")
    ap.add_argument("--verify-sample", type=int, default=300)
    ap.add_argument("--reuse-store", action="store_true",
                    help="keep an existing store instead of packing again (pack is not timed)")
    ap.add_argument("--label", help="a note shown at the top of the docs section")
    ap.add_argument("--docs", default=common.DOCS, help="markdown file to write the section to")
    ap.add_argument("--results", default=os.path.join(common.RESULTS_DIR, "mount_bench.jsonl"),
                    help="where the raw JSON rows go")
    ap.add_argument("--no-docs", action="store_true", help="do not touch --docs / --results")
    ap.add_argument("--fanstore", help="the fanstore command (default: next to this python)")
    ap.add_argument("--clean", action="store_true",
                    help="delete the work directory at the end (default: keep dataset + stores)")
    a = ap.parse_args(argv)
    preset = PRESETS[a.preset]
    for key, value in preset.items():
        if getattr(a, key, None) is None:
            setattr(a, key, value)
    a.codec = a.codec or ["zstd:3"]
    a.workers = [int(x) for x in str(a.workers).split(",") if x.strip()]
    if a.label is None and a.preset == "quick":
        a.label = ("SMOKE RUN (--preset quick, small dataset, machine shared with other jobs): "
                   "it shows the harness works, the numbers are not results. "
                   "Run `--preset full` on a quiet machine for real numbers.")
    return a


def main(argv: list[str] | None = None) -> int:
    raw_argv = sys.argv[1:] if argv is None else argv
    a = parse_args(raw_argv)
    if os.geteuid() != 0:
        print("mount_bench: run as root (drop_caches and FUSE mounts)", file=sys.stderr)
        return 2
    bench = Bench(a)
    ok = common.guarded_run(bench, log, lambda: [m for m in bench.mounted if is_mounted(m)])
    return common.publish(ok, bench, a, log, SECTION, section, "tools/bench/mount_bench.py",
                          raw_argv)


if __name__ == "__main__":
    sys.exit(main())
