#!/usr/bin/env python3
"""Stage-in next to `cp` + `sync` of the same partition files, N ranks at once.

A store of 16 partitions (tools/gen_dataset.py, 2,000 small files + 12 x 320 MiB, `--codec
none`; or `--store`) staged cold by N concurrent rank processes with `stage_partitions`,
next to N concurrent `cp` (then `sync`) and `dd oflag=direct` loops, in rotating order.
`--before REV` adds the staging code of git revision REV; `--ways` also times the copy
loops that were tried. What is measured: docs/benchmarks.md, "Stage-in".

    .venv/bin/python tools/bench/stage_bench.py [--ranks 1,4] [--reps 5] [--jobs 4]
        [--before REV] [--ways [--ways-reps 3]] [--work DIR] [--store DIR] [--no-docs]
"""

from __future__ import annotations

import argparse
import fcntl
import json
import mmap
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness as h  # noqa: E402
from harness import PY, log  # noqa: E402

FANSTORE = os.path.join(os.path.dirname(PY), "fanstore")
BLOCK = 8 << 20


def busy() -> tuple[int, int]:
    """(busy, total) clock ticks of all cores together."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    idle = v[3] + v[4]
    return sum(v) - idle, sum(v)


def make_store(work: str) -> tuple[str, str]:
    """The default store (made once, reused by later runs); how it was made."""
    data, store = os.path.join(work, "data"), os.path.join(work, "store")
    how = [f"{PY} tools/gen_dataset.py WORK/data --files 2000 --classes 20 --min-kb 50 "
           "--max-kb 150 --large 12 --large-mb 320 --seed 20240601",
           f"{FANSTORE} pack WORK/data WORK/store --partitions 16 --codec none --jobs 2 "
           "--no-progress --force"]
    if not os.path.exists(os.path.join(store, "fanstore.idx")):
        subprocess.run([PY, h.GEN, data,
                        "--files", "2000", "--classes", "20", "--min-kb", "50", "--max-kb",
                        "150", "--large", "12", "--large-mb", "320", "--seed", "20240601"],
                       check=True)
        subprocess.run([FANSTORE, "pack", data, store, "--partitions", "16", "--codec", "none",
                        "--jobs", "2", "--no-progress", "--force"], check=True)
        shutil.rmtree(data, ignore_errors=True)  # only the store is read from here on
    return store, "\n".join(how)


def partition_files(store: str) -> list[str]:
    return sorted(os.path.join(store, n) for n in os.listdir(store)
                  if n.startswith("part-") and n.endswith(".fsp"))


def share(files: list[str], ranks: int, rank: int) -> list[str]:
    """Rank ``rank``'s partition files: p mod ranks == rank (placement, --replicas 1)."""
    return [f for f in files if int(os.path.basename(f)[5:10]) % ranks == rank]


# ----------------------------------------------------------------------------- one rank


def rank_main(a: argparse.Namespace) -> int:
    """A rank: load the index, say ready, wait for the go line, stage, print JSON."""
    from fanstore.daemon.staging import stage_partitions
    from fanstore.format.index import read_index

    index = read_index(a.store)
    mine = [p for p in range(len(index.partitions)) if p % a.ranks == a.rank]
    print("ready", flush=True)
    sys.stdin.readline()
    r0 = resource.getrusage(resource.RUSAGE_SELF)
    report = stage_partitions(a.store, a.local, index, mine, jobs=a.jobs,
                              who=f"rank {a.rank}", private=False)
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    cpu = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
    print(json.dumps(dict(report.to_json(), cpu=round(cpu, 3))), flush=True)
    return 0


#: the reference copies: name -> argv copying files ``s`` into directory ``d``
TOOLS = {
    "cp+sync": lambda s, d: ["cp", *s, d + "/"],
    # the disk without the page cache on the writing side (dd clears O_DIRECT for a last
    # partial block); one dd per file, one after another
    "dd oflag=direct+sync": lambda s, d: [
        "sh", "-c", 'd=$1; shift; for f in "$@"; do dd if="$f" of="$d/${f##*/}" bs=8M '
        'oflag=direct status=none || exit 1; done', "sh", d, *s],
}


def wait_rusage(proc: subprocess.Popen) -> float:
    """Wait for ``proc``; its user+sys CPU seconds."""
    _, status, ru = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    return ru.ru_utime + ru.ru_stime


def timed_sync() -> float:
    """Run ``sync``; its CPU seconds."""
    return wait_rusage(subprocess.Popen(["sync"]))


# ----------------------------------------------------------------------------- the bench


class StageBench(h.Bench):
    name = "stage_bench"

    def __init__(self, a: argparse.Namespace) -> None:
        a.fanstore = FANSTORE
        super().__init__(a)
        self.codes: dict[str, str] = {}
        self.how = ""
        self.total_bytes = self.n_parts = 0

    def cleanup(self) -> None:
        shutil.rmtree(os.path.join(self.work, "dst"), ignore_errors=True)

    def run(self) -> None:
        a = self.a
        if a.store:
            self.store, self.how = os.path.abspath(a.store), f"existing store {a.store}"
        else:
            self.store, self.how = make_store(self.work)
        files = partition_files(self.store)
        self.n_parts = len(files)
        self.total_bytes = sum(os.path.getsize(f) for f in files)
        self.codes = {"stage": h.REPO}
        if a.before:
            self.codes = {f"stage {a.before}": h.export_revision(a.before, self.work),
                          **self.codes}
        contenders = list(TOOLS) + list(self.codes)
        log(f"{self.n_parts} partitions, {self.total_bytes / 1e6:,.0f} MB; ranks {a.ranks}, "
            f"{a.reps} reps, contenders {contenders}")
        step = 0
        for rep in range(a.reps):
            for n in a.ranks:
                order = contenders[step % len(contenders):] + contenders[:step % len(contenders)]
                step += 1
                for c in order:
                    row = self.one(c, n, rep, files)
                    log(f"  rep {rep} ranks {n} {c:>14}: {row['mb_per_s']:7,.0f} MB/s, "
                        f"CPU {row['cpu_s_per_gb']:.2f} s/GB, machine "
                        f"{row['machine_cpu_s_per_gb']:.2f} s/GB")
        if a.ways:
            self.ways(files)

    def dest(self, name: str) -> str:
        d = os.path.join(self.work, "dst", name)
        shutil.rmtree(d, ignore_errors=True)
        os.makedirs(d)
        return d

    def one(self, contender: str, n: int, rep: int, files: list[str]) -> dict:
        base = self.dest("run")
        dests = [os.path.join(base, f"local{r}") for r in range(n)]
        shares = [share(files, n, r) for r in range(n)]
        nbytes = sum(os.path.getsize(f) for f in files)
        h.drop_caches()
        ranks_out: list[dict] = []
        if contender in TOOLS:
            for d in dests:
                os.makedirs(d)
            b0, t0 = busy()
            w0 = time.perf_counter()
            procs = [subprocess.Popen(TOOLS[contender](s, d)) for s, d in zip(shares, dests) if s]
            cpu = sum(wait_rusage(p) for p in procs)
            if any(p.returncode for p in procs):
                raise RuntimeError(f"{contender} failed")
            w_cp = time.perf_counter() - w0
            cpu += timed_sync()
        else:
            env = dict(os.environ, PYTHONPATH=self.codes[contender])
            procs = [subprocess.Popen([PY, __file__, "_rank", "--store", self.store, "--local",
                                       dests[r], "--ranks", str(n), "--rank", str(r),
                                       "--jobs", str(self.a.jobs)], env=env,
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
                     for r in range(n)]
            for p in procs:
                if p.stdout.readline().strip() != "ready":
                    raise RuntimeError(f"{contender}: a rank did not start")
            b0, t0 = busy()
            w0 = time.perf_counter()
            for p in procs:
                p.stdin.write("go\n")
                p.stdin.flush()
            for p in procs:
                ranks_out.append(json.loads(p.stdout.readline()))
                p.wait()
            w_cp = time.perf_counter() - w0
            cpu = sum(r["cpu"] for r in ranks_out) + timed_sync()
            staged = sum(r["staged_bytes"] for r in ranks_out)
            if staged != nbytes:
                raise RuntimeError(f"{contender}: staged {staged} bytes of {nbytes}")
        wall = time.perf_counter() - w0
        b1, t1 = busy()
        copied = sum(os.path.getsize(os.path.join(d, n)) for d in dests for n in os.listdir(d)
                     if n.endswith(".fsp"))
        if copied != nbytes:
            raise RuntimeError(f"{contender}: {copied} bytes in the local dirs, not {nbytes}")
        gb = nbytes / 1e9
        machine = (b1 - b0) / h.CLK_TCK
        shutil.rmtree(base, ignore_errors=True)
        return self.emit({
            "kind": "stage", "contender": contender, "ranks": n, "rep": rep,
            "jobs": self.a.jobs, "bytes": nbytes, "wall": round(wall, 3),
            "before_sync": round(w_cp, 3), "mb_per_s": round(nbytes / 1e6 / wall, 1),
            "cpu": round(cpu, 3), "cpu_s_per_gb": round(cpu / gb, 3),
            "machine_cpu_s_per_gb": round(machine / gb, 3),
            "loadavg1": h.loadavg1(), "ranks_out": ranks_out})

    # ------------------------------------------------------------------- ways to copy

    def ways(self, files: list[str]) -> None:
        names = list(WAYS)
        for rep in range(self.a.ways_reps):
            order = names[rep % len(names):] + names[:rep % len(names)]
            for way in order:
                d = self.dest("way")
                h.drop_caches()
                b0, t0 = busy()
                r0 = resource.getrusage(resource.RUSAGE_SELF)
                w0 = time.perf_counter()
                for f in files:
                    WAYS[way][0](f, os.path.join(d, os.path.basename(f)))
                cpu_self = resource.getrusage(resource.RUSAGE_SELF)
                cpu = (cpu_self.ru_utime - r0.ru_utime) + (cpu_self.ru_stime - r0.ru_stime)
                cpu += timed_sync()
                wall = time.perf_counter() - w0
                b1, t1 = busy()
                gb = self.total_bytes / 1e9
                machine = (b1 - b0) / h.CLK_TCK
                row = self.emit({"kind": "way", "way": way, "rep": rep,
                                 "bytes": self.total_bytes, "wall": round(wall, 3),
                                 "mb_per_s": round(self.total_bytes / 1e6 / wall, 1),
                                 "cpu_s_per_gb": round(cpu / gb, 3),
                                 "machine_cpu_s_per_gb": round(machine / gb, 3)})
                log(f"  way rep {rep} {way:>24}: {row['mb_per_s']:7,.0f} MB/s, CPU "
                    f"{row['cpu_s_per_gb']:.2f} s/GB")
                shutil.rmtree(d, ignore_errors=True)


# ----------------------------------------------------------------------------- copy loops
# Each copies src to a new dst, hashing every byte with XXH3-128, and fsyncs dst.


def _adv(fd: int, off: int, n: int, advice: int) -> None:
    try:
        os.posix_fadvise(fd, off, n, advice)
    except OSError:
        pass


def _loop(src: str, dst: str, block: int = BLOCK, drop_src: bool = False,
          direct_src: bool = False, direct_dst: bool = False, drop_dst: bool = False,
          exact: bool = False) -> str:
    """Read ``block`` at a time, hash, write. ``drop_src``: drop the source's pages after
    each block, the last 64 MiB read (as staging), or with ``exact`` only the block's own
    range."""
    import xxhash

    h = xxhash.xxh3_128()
    buf = mmap.mmap(-1, block)
    view = memoryview(buf)
    fi = os.open(src, os.O_RDONLY | (os.O_DIRECT if direct_src else 0))
    fo = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    if direct_dst:
        fcntl.fcntl(fo, fcntl.F_SETFL, fcntl.fcntl(fo, fcntl.F_GETFL) | os.O_DIRECT)
    _adv(fi, 0, 0, os.POSIX_FADV_SEQUENTIAL)
    off = 0
    while True:
        n = os.preadv(fi, [buf], off)
        if not n:
            break
        h.update(view[:n])
        if direct_dst and n % 4096:
            fcntl.fcntl(fo, fcntl.F_SETFL, fcntl.fcntl(fo, fcntl.F_GETFL) & ~os.O_DIRECT)
        w = 0
        while w < n:
            w += os.pwrite(fo, view[w:n], off + w)
        if drop_src and exact:
            _adv(fi, off, n, os.POSIX_FADV_DONTNEED)
        elif drop_src:
            behind = max(0, off + n - (64 << 20))
            _adv(fi, behind, off + n - behind, os.POSIX_FADV_DONTNEED)
        off += n
    os.fsync(fo)
    if drop_dst:
        _adv(fo, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fi)
    os.close(fo)
    view.release()
    buf.close()
    return h.hexdigest()


def _copy_range(src: str, dst: str, block: int = BLOCK) -> str:
    """copy_file_range (in the kernel, as `cp`), each range read back from dst to hash."""
    import xxhash

    h = xxhash.xxh3_128()
    buf = bytearray(block)
    view = memoryview(buf)
    fi = os.open(src, os.O_RDONLY)
    fo = os.open(dst, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    off = 0
    while True:
        n = os.copy_file_range(fi, fo, block, off, off)
        if not n:
            break
        got = os.preadv(fo, [view[:n]], off)
        h.update(view[:got])
        off += n
    os.fsync(fo)
    os.close(fi)
    os.close(fo)
    return h.hexdigest()


def _mapped(src: str, dst: str, block: int = BLOCK) -> str:
    """Hash and write straight from a read-only mapping of the source."""
    import xxhash

    h = xxhash.xxh3_128()
    fi = os.open(src, os.O_RDONLY)
    size = os.fstat(fi).st_size
    fo = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    m = mmap.mmap(fi, size, prot=mmap.PROT_READ)
    m.madvise(mmap.MADV_SEQUENTIAL)
    view = memoryview(m)
    off = 0
    while off < size:
        chunk = view[off:off + block]
        h.update(chunk)
        w = 0
        while w < len(chunk):
            w += os.write(fo, chunk[w:])
        off += len(chunk)
        chunk.release()
    view.release()
    m.close()
    os.fsync(fo)
    os.close(fi)
    os.close(fo)
    return h.hexdigest()


#: name -> (copy function, what it is)
WAYS = {
    "page cache (before)": (
        lambda s, d: _loop(s, d),
        "8 MiB read into one buffer, hash, write, fsync: both files through the page cache"),
    "+ drop both": (
        lambda s, d: _loop(s, d, drop_src=True, drop_dst=True),
        "as before, the source's pages dropped after each block, the copy's after its "
        "fsync"),
    "direct write, keep src": (
        lambda s, d: _loop(s, d, direct_dst=True),
        "O_DIRECT writes, the source's pages kept"),
    "direct write + drop src": (
        lambda s, d: _loop(s, d, drop_src=True, direct_dst=True),
        "O_DIRECT writes, the source's last 64 MiB read dropped after each block (what "
        "staging does now)"),
    "same, drop exact ranges": (
        lambda s, d: _loop(s, d, drop_src=True, direct_dst=True, exact=True),
        "the same, dropping only each block's own range of the source"),
    "same, 1 MiB blocks": (
        lambda s, d: _loop(s, d, block=1 << 20, drop_src=True, direct_dst=True),
        "the same with 1 MiB blocks"),
    "same, 1 MiB, exact ranges": (
        lambda s, d: _loop(s, d, block=1 << 20, drop_src=True, direct_dst=True, exact=True),
        "1 MiB blocks, dropping only each block's own range"),
    "same, 32 MiB blocks": (
        lambda s, d: _loop(s, d, block=32 << 20, drop_src=True, direct_dst=True),
        "the same with 32 MiB blocks"),
    "direct read + write": (
        lambda s, d: _loop(s, d, direct_src=True, direct_dst=True),
        "O_DIRECT on both sides: no page cache at all, no readahead"),
    "copy_file_range": (
        _copy_range,
        "copy_file_range per 8 MiB (the kernel copies, as `cp` does), read back to hash"),
    "mmap source": (
        _mapped,
        "hash and write from a mapping of the source (one copy fewer than read + write)"),
}


# ----------------------------------------------------------------------------- report


def cpu_cells(rs: list[dict]) -> tuple[str, str]:
    return (h.spread([r["cpu_s_per_gb"] for r in rs], 2),
            h.spread([r["machine_cpu_s_per_gb"] for r in rs], 2))


def render(bench: StageBench, label: str, shown: list[str]) -> str:
    a = bench.a
    rows = bench.rows
    runs = []
    for n in a.ranks:
        cp = {r["rep"]: r["mb_per_s"] for r in h.pick_rows(rows, kind="stage",
                                                                 contender="cp+sync", ranks=n)}
        for c in list(TOOLS) + list(bench.codes):
            rs = h.pick_rows(rows, kind="stage", contender=c, ranks=n)
            if not rs:
                continue
            mbs = [r["mb_per_s"] for r in rs]
            ratios = [r["mb_per_s"] / cp[r["rep"]] for r in rs if cp.get(r["rep"])]
            ratio = "1.00x" if c == "cp+sync" else (
                f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}–{max(ratios):.2f})"
                if ratios else "–")
            runs.append((n, c, h.spread(mbs), h.spread([m / n for m in mbs]), ratio,
                         *cpu_cells(rs)))
    w = [f"Store: {bench.n_parts} partitions, {bench.total_bytes / 1e6:,.0f} MB; "
         f"`--stage-jobs {a.jobs}`; {a.reps} repetitions; cells median (min–max).", "",
         h.table(["ranks", "contender", "MB/s (all ranks)", "MB/s per rank", "/ cp+sync",
                  "CPU s/GB", "machine CPU s/GB"], runs, "rl" + "r" * 5)]
    targets = []
    for n in a.ranks:
        cp = {r["rep"]: r["mb_per_s"] for r in h.pick_rows(rows, kind="stage",
                                                                 contender="cp+sync", ranks=n)}
        ratios = [r["mb_per_s"] / cp[r["rep"]] for r in h.pick_rows(
            rows, kind="stage", contender="stage", ranks=n) if cp.get(r["rep"])]
        if ratios:
            m = statistics.median(ratios)
            targets.append(f"{n} rank{'s' if n > 1 else ''}: {m:.2f}x "
                           f"{h.check(m >= 0.9)}")
    if targets:
        w += ["", "Target, stage-in at least 0.9x `cp`+`sync` per rank (median ratio of the "
              "repetitions): " + "; ".join(targets) + "."]
    ways = [(way, what, h.spread([r["mb_per_s"] for r in rs]), *cpu_cells(rs))
            for way, (_, what) in WAYS.items() for rs in [h.pick_rows(rows, kind="way", way=way)]
            if rs]
    if ways:
        w += ["", h.table(["way", "what", "MB/s", "CPU s/GB", "machine CPU s/GB"], ways,
                          "llrrr", f"Ways to copy and check a partition (`--ways`, "
                                   f"{a.ways_reps} reps)")]
    bench.cmd(" ".join(shown))
    for line in bench.how.replace(PY, ".venv/bin/python").replace(
            FANSTORE, ".venv/bin/fanstore").splitlines():
        bench.cmd(line)
    bench.cmd("cp STORE/part-*.fsp (this rank's partitions) WORK/dst/run/local{rank}/   "
              "# one cp per rank, concurrently; then: sync")
    bench.cmd("for f in (this rank's partitions); do dd if=$f of=WORK/dst/run/local{rank}/"
              "$(basename $f) bs=8M oflag=direct; done   # one loop per rank; then: sync")
    return h.section(bench, label, shown, ["\n".join(w)])


def main(argv: list[str] | None = None) -> int:
    raw_argv = list(sys.argv[1:] if argv is None else argv)
    if raw_argv[:1] == ["_rank"]:
        rp = argparse.ArgumentParser(prog="stage_bench.py _rank")
        rp.add_argument("--store", required=True)
        rp.add_argument("--local", required=True)
        rp.add_argument("--ranks", type=int, required=True)
        rp.add_argument("--rank", type=int, required=True)
        rp.add_argument("--jobs", type=int, required=True)
        return rank_main(rp.parse_args(raw_argv[1:]))
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=lambda t: [int(x) for x in t.split(",")], default=[1, 4])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--jobs", type=int, default=4, help="--stage-jobs of every rank")
    ap.add_argument("--before", metavar="REV", help="also stage with the code of git REV")
    ap.add_argument("--ways", action="store_true", help="also time ways to copy (1 process)")
    ap.add_argument("--ways-reps", type=int, default=3)
    ap.add_argument("--store", help="an existing store to stage (default: make one)")
    h.args(ap, "stage_bench", "/tmp/fanstore-stagebench", fanstore=False)
    a = ap.parse_args(raw_argv)
    return h.main(StageBench(a), render, raw_argv)


if __name__ == "__main__":
    sys.exit(main())
