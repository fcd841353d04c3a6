#!/usr/bin/env python3
"""FanStore's single-node mount next to the raw source directory, measured in one run.

A tools/gen_dataset.py dataset packed with ``fanstore pack`` (timed, caches dropped), then
every backend (``raw``, ``fanstore-<codec>``) read with tools/bench/reader.py: small files
with 1 and 4 readers cold and warm, walk and stat, large files, and a byte-for-byte check.
What is measured and how: docs/benchmarks.md, "FanStore mount vs the raw directory".

    .venv/bin/python tools/bench/mount_bench.py --preset quick     # 1-2 min, a smoke run
    .venv/bin/python tools/bench/mount_bench.py --preset full      # ~10-15 min
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness as h  # noqa: E402
from harness import med, num, ratio, spread  # noqa: E402

PRESETS = {
    "quick": dict(files=5000, classes=50, large=1, large_mb=128, reps=2, warm_reps=2,
                  large_reps=1),
    # the peers' shape: 20,000 files of 50-150 kB in 100 classes + 8 x 256 MiB float32
    "full": dict(files=20000, classes=100, large=8, large_mb=256, reps=3, warm_reps=3,
                 large_reps=2),
}


class MountBench(h.Bench):
    name = "mount_bench"

    def __init__(self, a: argparse.Namespace) -> None:
        super().__init__(a)
        self.codec_of = {"fanstore-" + c.replace(":", ""): c for c in a.codec}
        self.backends = ["raw"] + list(self.codec_of)
        self.failed: dict[str, str] = {}
        self.pids: dict[str, int | None] = {}

    def root_of(self, b: str) -> str:
        return self.data if b == "raw" else os.path.join(self.mnt_root, b)

    def store_of(self, b: str) -> str:
        return os.path.join(self.work, "stores", b)

    def dataset(self) -> None:
        a = self.a
        self.data, small, gen = h.ensure_dataset(self.work, a.files, a.classes, a.min_kb,
                                                 a.max_kb, a.seed, a.large, a.large_mb)
        self.cmd(gen)
        large = sorted(os.path.relpath(os.path.join(t, n), self.data)
                       for t, _d, ns in os.walk(os.path.join(self.data, "large")) for n in ns)
        kinds: dict[str, list[int]] = {}
        for rel in small + large:
            k = kinds.setdefault(rel.split(os.sep)[0] + "/*." + rel.rsplit(".", 1)[-1], [0, 0])
            k[0] += 1
            k[1] += os.path.getsize(os.path.join(self.data, rel))
        self.small, self.large = self.write_list("small.txt", small), \
            self.write_list("large.txt", large)
        self.n_small, self.n_large = len(small), len(large)
        self.emit({"kind": "dataset", "params": dict(
            files=a.files, classes=a.classes, min_kb=a.min_kb, max_kb=a.max_kb, large=a.large,
            large_mb=a.large_mb, seed=a.seed), "kinds": kinds, "n_small": len(small),
            "n_large": len(large), "dirs": sum(len(d) for _t, d, _f in os.walk(self.data))})

    def pack(self, b: str) -> None:
        a, dest = self.a, self.store_of(b)
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        try:
            info, argv = h.pack_store(self.fanstore, self.data, dest, a.partitions,
                                      self.codec_of[b], a.jobs, a.reuse_store)
        except subprocess.CalledProcessError as exc:
            self.failed[b] = f"pack failed: {(exc.stderr or '').strip()[-500:]}"
            self.emit({"kind": "pack", "backend": b, "ok": False, "error": self.failed[b]})
            return
        self.cmd(argv)
        counts, store_bytes = info.get("counts", {}), h.dir_bytes(dest)
        raw, secs = counts.get("raw_bytes") or 0, info["pack_seconds"]
        row = self.emit({"kind": "pack", "backend": b, "codec": self.codec_of[b], "ok": True,
                         "seconds": None if secs is None else round(secs, 3),
                         "partitions": a.partitions, "jobs": a.jobs, "raw_bytes": raw,
                         "store_bytes": store_bytes, "index_bytes": info.get("index_bytes"),
                         "stored_data_bytes": counts.get("stored_bytes"),
                         "ratio": round(raw / store_bytes, 4) if store_bytes else None,
                         "files": counts.get("files"), "codec_chunks": info.get("codec_chunks")})
        h.log(f"  {b}: pack {secs} s, ratio {row['ratio']}")

    def cold(self, b: str, why: str) -> bool:
        """A fresh mount (FanStore) and dropped caches; False if ``b`` cannot be mounted."""
        if b in self.failed:
            return False
        mnt = self.root_of(b)
        if b != "raw":
            self.umount(mnt)
        dropped = h.drop_caches()
        if b == "raw":
            return True
        t0 = time.perf_counter()
        try:
            self.pids[b] = self.mount(self.store_of(b), mnt, shlex.split(self.a.mount_opts))
        except (RuntimeError, subprocess.TimeoutExpired) as exc:
            self.failed[b] = str(exc)
            self.emit({"kind": "mount", "backend": b, "ok": False, "error": str(exc)})
            return False
        self.emit({"kind": "mount", "backend": b, "ok": True, "for": why,
                   "seconds": round(time.perf_counter() - t0, 3),
                   "dropped_caches": dropped, "daemon_pid": self.pids[b]})
        return True

    def reader(self, b: str, kind: str, phase: str, rep: int, sub: str, *args: str) -> None:
        if b in self.failed:
            return
        root, pid = self.root_of(b), self.pids.get(b) if b != "raw" else None
        argv = [self.py, h.READER, sub, "--root", root, *args]
        self.cmd(argv, ROOT=root)
        if pid and sub in ("read", "stat"):
            argv += ["--watch-pid", str(pid)]
        mnt = root if b != "raw" else None
        before, load = h.control(mnt, {"op": "stats"}), h.loadavg1()
        row = self.sub(argv)
        if pid and not h.pid_alive(pid):
            row["daemon_died"] = f"{kind} {sub} {phase} rep={rep}"
            h.log(f"  {b}: the daemon (pid {pid}) DIED during {kind} {sub} {phase}")
        row.update(kind=kind, backend=b, phase=phase, rep=rep, load1_before=load)
        row["daemon"] = h.diff_stats(h.control(mnt, {"op": "stats"}), before)
        self.emit(row)
        h.log(f"  {b:<16} {kind:<5} {sub:<6} {phase:<4} w={row.get('workers', 1)} rep={rep}: "
              f"{row.get('files_per_s') or row.get('entries_per_s')} /s, "
              f"{row.get('MB_per_s')} MB/s" + (f"  ERRORS {row['errors']}: "
                                               f"{row.get('first_error')}"
                                               if row.get("errors") else ""))

    def run(self) -> None:
        a = self.a
        self.dataset()
        for b in self.backends[1:]:
            self.pack(b)
        limit = ["--time-limit", str(a.pass_limit)]
        h.log("metadata: walk and stat, each cold (its own fresh mount) then warm")
        for b in self.backends:
            # a listing primes the caches stat uses: the cold stat gets a fresh mount
            if self.cold(b, "walk"):
                for phase in ("cold", "warm"):
                    self.reader(b, "meta", phase, 1, "walk")
            if self.cold(b, "stat"):
                for phase in ("cold", "warm"):
                    self.reader(b, "meta", phase, 1, "stat", "--list", self.small, "--seed",
                                "7", *limit)
        for w in a.workers:
            for rep in range(1, a.reps + 1):
                for b in self.backends:
                    if self.cold(b, f"small w={w} rep={rep}"):
                        args = ["--list", self.small, "--workers", str(w), "--seed", str(rep),
                                *limit]
                        self.reader(b, "small", "cold", rep, "read", *args)
                        if rep <= a.warm_reps:
                            self.reader(b, "small", "warm", rep, "read", *args)
        for rep in range(1, a.large_reps + 1 if self.n_large else 1):
            for b in self.backends:
                if self.cold(b, f"large rep={rep}"):
                    for phase in ("cold", "warm"):
                        self.reader(b, "large", phase, rep, "read", "--list", self.large,
                                    "--seed", "-1", "--chunk", str(1 << 20), *limit)
        with open(self.large) as f:
            one_large = self.write_list("verify-large.txt", f.read().splitlines()[:1])
        for b in self.backends[1:]:
            if self.cold(b, "verify"):
                self.reader(b, "check", "-", 1, "verify", "--ref", self.data, "--list",
                            self.small, "--sample", str(a.verify_sample))
                if self.n_large:
                    self.reader(b, "check", "-", 2, "verify", "--ref", self.data, "--list",
                                one_large)
                self.umount(self.root_of(b))


def _dataset(ds: dict) -> str:
    kinds = ds["kinds"]
    return h.table(["part", "files", "bytes"], [
        (k, f"{n:,}", f"{b:,}") for k, (n, b) in sorted(kinds.items())] + [(
            "**total**", f"{sum(n for n, _ in kinds.values()):,}",
            f"{sum(b for _, b in kinds.values()):,}")], title="Dataset")


def _packs(bench: MountBench) -> list[tuple]:
    packs = []
    for b in bench.backends[1:]:
        r = (bench.pick(kind="pack", backend=b) or [{}])[0]
        if not r.get("ok"):
            packs.append((b, bench.codec_of[b], "", "", "failed", "", "", "", ""))
            continue
        s = r.get("seconds")
        packs.append((b, r["codec"], r["partitions"], r["jobs"], num(s, 1),
                      num(r["raw_bytes"] / 1e6 / s if s else None),
                      num(r["store_bytes"] / 1e6), f"{r['ratio']:.2f}",
                      num(med(bench.vals("seconds", kind="mount", backend=b, ok=True)), 2)))
    return packs


def _small(bench: MountBench) -> list[tuple]:
    vals, small = bench.vals, []
    for wk in bench.a.workers:
        raw = {ph: med(vals("files_per_s", kind="small", backend="raw", phase=ph, workers=wk))
               for ph in ("cold", "warm")}
        for b in bench.backends:
            q = dict(kind="small", backend=b, workers=wk)
            if b in bench.failed and not bench.pick(**q):
                small.append((b, wk, bench.failed[b][:60]) + ("",) * 9)
                continue
            c, w = dict(q, phase="cold"), dict(q, phase="warm")
            fc, fw = (med(vals("files_per_s", **x)) for x in (c, w))
            small.append((b + h.err_tag(bench.pick(**q)), wk,
                          *bench.cells(c, "spread:files_per_s", "spread:MB_per_s"),
                          *bench.cells(w, "spread:files_per_s", "spread:MB_per_s"),
                          *bench.cells(c, "p:lat_ms"), *bench.cells(w, "p:lat_ms"),
                          *bench.cells(c, "med:cpu_busy_pct"), "–" if b == "raw" else " / ".join(
                              bench.cells(c, "med:watched_cpu_us_per_file")
                              + bench.cells(w, "med:watched_cpu_us_per_file")),
                          ratio(fc, raw["cold"]), ratio(fw, raw["warm"])))
    return small


def _meta_large(bench: MountBench) -> tuple[list[tuple], list[tuple]]:
    vals, bs = bench.vals, bench.backends
    rs = {ph: med(vals("files_per_s", kind="meta", backend="raw", op="stat", phase=ph))
          for ph in ("cold", "warm")}
    meta = []
    for b in bs:
        q = dict(kind="meta", backend=b)
        sc, sw = (med(vals("files_per_s", op="stat", phase=ph, **q)) for ph in ("cold", "warm"))
        meta.append((b, num(med(vals("seconds", op="walk", phase="cold", **q)), 3),
                     num(med(vals("seconds", op="walk", phase="warm", **q)), 3), num(sc),
                     num(sw), ratio(sc, rs["cold"]), ratio(sw, rs["warm"])))
    rl = {ph: med(vals("MB_per_s", kind="large", backend="raw", phase=ph))
          for ph in ("cold", "warm")}
    large = [(b, spread(c), spread(w), num(med(vals("cpu_busy_pct", kind="large", backend=b,
                                                    phase="cold"))),
              ratio(med(c), rl["cold"]), ratio(med(w), rl["warm"]))
             for b in bs for c, w in [[vals("MB_per_s", kind="large", backend=b, phase=ph)
                                       for ph in ("cold", "warm")]]]
    return meta, large


def _counters(bench: MountBench) -> list[tuple]:
    counters = []
    for b in bench.backends[1:]:
        for wk in bench.a.workers:
            for ph in ("cold", "warm"):
                rr = [r for r in bench.pick(kind="small", backend=b, workers=wk, phase=ph)
                      if r.get("daemon") and r.get("files")]
                if rr:
                    def per(key, scale=1.0, rr=rr):
                        return med([r["daemon"].get(key, 0) / r["files"] * scale for r in rr])

                    counters.append((b, wk, ph, num(per("opens"), 2), num(per("reads"), 2),
                                     num(per("cache_hits"), 2), num(per("chunks_decoded"), 2),
                                     num(per("decode_seconds", 1e6)),
                                     num(med(r.get("watched_cpu_us_per_file") for r in rr)),
                                     sum(r["daemon"].get("errors", 0) for r in rr)))
    return counters


def _checks(bench: MountBench) -> list[str]:
    checks = [f"- {r['backend']}: {r['checked']} file(s) compared with the source "
              f"({r['bytes'] / 1e6:,.0f} MB): " + ("all identical" if r.get("ok") else
                                                    f"**{r['errors']} differ**: "
                                                    f"{r.get('first_error')}")
              for r in bench.pick(kind="check")]
    checks.append(h.errors_line(bench.rows, ("small", "large", "meta")))
    checks += [f"- {b}: {msg}" for b, msg in bench.failed.items()]
    return checks + [f"- **{r['backend']}: the daemon died during {r['daemon_died']}**"
                     for r in bench.rows if r.get("daemon_died")]


def render(bench: MountBench, label: str | None, argv: list[str]) -> str:
    a, ds = bench.a, bench.pick(kind="dataset")[0]
    meta, large = _meta_large(bench)
    return h.section(bench, label, argv, [
        _dataset(ds),
        h.table(["backend", "codec", "partitions", "jobs", "pack s", "pack MB/s", "store MB",
                 "ratio", "mount s"], _packs(bench), "ll" + "r" * 7, "Pack"),
        h.table(["backend", "readers", "cold files/s", "cold MB/s", "warm files/s", "warm MB/s",
                 "cold p50 / p99 ms", "warm p50 / p99 ms", "cold CPU %",
                 "daemon µs/file cold / warm", "cold vs raw", "warm vs raw"], _small(bench),
                title=f"Small-file reads ({bench.n_small:,} files, every file once, shuffled; "
                      f"{a.reps} cold / {min(a.reps, a.warm_reps)} warm passes)"),
        h.table(["backend", "walk cold s", "walk warm s", "stat cold /s", "stat warm /s",
                 "stat cold vs raw", "stat warm vs raw"], meta, title="Metadata"),
        h.table(["backend", "cold MB/s", "warm MB/s", "cold CPU %", "cold vs raw",
                 "warm vs raw"], large, title=f"Large files ({bench.n_large} x "
                                              f"{ds['params']['large_mb']} MiB, "
                                              f"{a.large_reps} passes)")
        if bench.n_large else "",
        h.table(["backend", "readers", "phase", "opens/file", "reads/file", "cache hits/file",
                 "decoded/file", "decode µs/file", "daemon CPU µs/file", "daemon errors"],
                _counters(bench), "lrl" + "r" * 7, "FanStore daemon counters per small-file pass"),
        "### Correctness\n\n" + "\n".join(_checks(bench))])


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="full",
                    help="dataset size and repetitions (default full); options below override")
    h.args(ap, "mount_bench", os.environ.get("FANSTORE_BENCH_WORK", "/tmp/fanstore-bench"))
    h.dataset_args(ap, codec=None)
    ap.add_argument("--large", type=int, help="large files")
    ap.add_argument("--large-mb", type=int, help="size of each large file in MiB")
    ap.add_argument("--codec", action="append", help="FanStore codec(s) to pack with, one "
                    "backend each (repeatable; default zstd:3)")
    ap.add_argument("--mount-opts", default="", help="extra options for `fanstore mount`")
    ap.add_argument("--workers", default="1,4", help="reader process counts (default 1,4)")
    ap.add_argument("--reps", type=int, help="cold passes per backend and reader count")
    ap.add_argument("--warm-reps", type=int, help="warm passes (after the first cold ones)")
    ap.add_argument("--large-reps", type=int, help="cold+warm large-file passes")
    ap.add_argument("--verify-sample", type=int, default=300)
    a = h.presets(ap.parse_args(argv), PRESETS)
    a.codec = a.codec or ["zstd:3"]
    a.workers = h.ints(a.workers)
    return a


def main(argv: list[str] | None = None) -> int:
    raw = sys.argv[1:] if argv is None else argv
    return h.main(MountBench(parse_args(raw)), render, raw)


if __name__ == "__main__":
    sys.exit(main())
