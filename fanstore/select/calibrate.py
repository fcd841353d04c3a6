"""Calibrate the read path a job will use: what a reader pays per file and per chunk.

The selector's model (``policy.py``) multiplies per-byte codec costs; a real reader also pays
per file (FUSE: LOOKUP, OPEN, READs, RELEASE through the kernel and the daemon; the Python
API: the namespace lookup, a ``pread``, Python calls) and per chunk (a fetch, a decode call,
for the mount one READ request per 128 KiB). On small files that cost, not the codec,
decides how many files per second a reader gets. ``fanstore select --reader mount|api``
measures it on this node before choosing, with the public interfaces only, so it measures
whichever frontend serves the mount:

1. A few hundred files of the source (seeded random choice; each cut to one chunk; kept in
   as many directories as they come from, up to ``MAX_DIRS``), plus
   one larger file of several chunks per reader, are copied to a temporary directory and
   packed there with ``--codec none`` (the codec's cost is measured separately, per
   candidate); the partition files are read once so that the page cache holds them.
2. ``readers`` processes (the ``--cores`` of the selection) read them, started together:
   first the small files (a share each, in random order; in three rounds of different
   files, of which the median counts), then one large file each,
   through ``fanstore mount STORE MNT`` (a temporary mount, ``open/read/close`` per file;
   ``fanstore umount`` afterwards, whatever happens) or through
   ``fanstore.open_store(STORE).read`` in each process.
3. With ``n`` readers, the time per file of one reader is ``n x wall / files``. Taking off
   the copy and checksum that ``none`` costs (measured, per byte), what is left is the read
   path's cost per file of one chunk (``per_file``) and, from the large files, per extra
   chunk (``per_chunk``).

The model then charges every candidate ``per_file + (chunks - 1) x per_chunk`` per file of a
kind (one chunk per file in a solid block), on top of its decode, checksum and storage time;
docs/selection.md "Reader" has the formula.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import numpy as np

from fanstore.errors import FanStoreError, UsageError

log = logging.getLogger(__name__)

READERS = ("mount", "api")
#: Calibration set: at most this many small files and bytes, at least this many files
#: (copies are repeated when the source has fewer), and chunks per large file.
MAX_FILES = 900
#: the small files are read in this many rounds of different files; the median round counts
#: (one round of 300 files lasts ~10 ms through a mount: a single one varied 1.7x from run to
#: run, and the first also pays for the workers' first requests)
ROUNDS = 3
MAX_BYTES = 48 << 20
MIN_FILES = 64
#: the calibration files keep the source's directories apart, up to this many, as a
#: reader meets them: lookups in one directory wait for each other in the kernel when the
#: frontend has no parallel directory operations (pyfuse3, 2 readers: 750 µs per file with
#: every file in one directory, 632 over the 60,000-file set's directories)
MAX_DIRS = 64
BIG_CHUNKS = 8
MAX_BIG_BYTES = 128 << 20
TIMEOUT = 120.0


class CalibrationError(FanStoreError):
    """The read path could not be calibrated (no FUSE, a mount that failed, ...)."""


@dataclass
class ReaderCost:
    """The calibrated read path. Times are seconds of one reader (of ``readers`` reading
    concurrently) per file and per extra chunk, beyond decode and checksum."""

    reader: str
    per_file: float
    per_chunk: float
    readers: int
    files: int
    big_chunks: int
    chunk_size: int
    seconds: float
    files_per_s_raw: float  # what the readers got from the stored-raw small files

    def file_cost(self, chunks: float) -> float:
        """Seconds of one reader per file of ``chunks`` chunks (at least one)."""
        return self.per_file + max(0.0, chunks - 1.0) * self.per_chunk

    def describe(self) -> str:
        how = "a temporary mount" if self.reader == "mount" else "the Python API on a " \
                                                              "temporary store"
        return (f"{self.reader}: {self.per_file * 1e6:,.0f} µs per file + "
                f"{self.per_chunk * 1e6:,.0f} µs per further chunk (calibrated on "
                f"{self.files} files and {self.readers} of {self.big_chunks} chunks through "
                f"{how}, {self.readers} reader{'s' if self.readers != 1 else ''}, "
                f"{self.seconds:.1f} s)")

    def to_json(self) -> dict:
        return {"reader": self.reader, "per_file_us": round(self.per_file * 1e6, 1),
                "per_chunk_us": round(self.per_chunk * 1e6, 1), "readers": self.readers,
                "files": self.files, "big_chunks": self.big_chunks,
                "raw_files_per_s": round(self.files_per_s_raw, 1),
                "seconds": round(self.seconds, 2)}


def check_reader(reader: str) -> None:
    if reader not in READERS:
        raise UsageError(f"--reader must be one of {', '.join(READERS)}, got {reader!r}")


def calibrate(files, reader: str, readers: int, chunk_size: int, seed: int = 0,
              workdir: str | None = None) -> ReaderCost:
    """Measure ``reader``'s cost per file and per chunk (see the module docstring).

    ``files`` are the source's :class:`~fanstore.select.sample.SourceFile` entries.
    Everything it creates (a directory under ``workdir`` or the temp directory, a mount)
    is removed before it returns or raises.
    """
    check_reader(reader)
    if reader == "mount":
        _check_fuse()
    t0 = time.monotonic()
    readers = max(1, readers)
    tmp = tempfile.mkdtemp(prefix="fanstore-calibrate-", dir=workdir)
    mnt = os.path.join(tmp, "mnt")
    mounted = False
    try:
        small, big, big_chunks = _make_source(files, os.path.join(tmp, "src"), chunk_size,
                                              readers, seed)
        store = os.path.join(tmp, "store")
        _pack(os.path.join(tmp, "src"), store, chunk_size)
        _warm(store)
        if reader == "mount":
            os.mkdir(mnt)
            _cli("mount", "--", store, mnt)
            mounted = True
            root = mnt
        else:
            root = store
        rng = np.random.default_rng([seed, 11])
        order = [small[i] for i in rng.permutation(len(small))]
        n = min(readers, len(order))
        rounds = [order[k::ROUNDS] for k in range(ROUNDS) if order[k::ROUNDS]]
        per_round = sorted(_timed_pass(reader, root, [part[r::n] for r in range(n)])
                           / len(part) for part in rounds if len(part) >= n)
        t_small = per_round[len(per_round) // 2] * len(small)  # the median round's pace
        t_big = _timed_pass(reader, root, [[b] for b in big])
    finally:
        if mounted and _cli("umount", "--", mnt, check=False) != 0:
            _cli("umount", "--lazy", "--", mnt, check=False)  # never leave a mount behind
        if not os.path.ismount(mnt):  # (never delete through a mount)
            shutil.rmtree(tmp, ignore_errors=True)
    per_byte = _copy_and_checksum_cost()
    small_bytes = sum(s for _, s in small) / len(small)
    big_bytes = big_chunks * chunk_size
    per_file_small = n * t_small / len(small)  # one reader's seconds per file
    per_file = max(0.0, per_file_small - small_bytes * per_byte)
    per_chunk = max(0.0, (t_big - big_bytes * per_byte - per_file) / (big_chunks - 1))
    return ReaderCost(reader, per_file, per_chunk, n, len(small), big_chunks, chunk_size,
                      time.monotonic() - t0, len(small) / t_small if t_small > 0 else 0.0)


# --------------------------------------------------------------------------- the set


def _make_source(files, src: str, chunk_size: int, readers: int, seed: int):
    """Copy the calibration set; returns ([(rel, size)] small, [rel] big, chunks per big)."""
    os.makedirs(os.path.join(src, "s"))
    os.makedirs(os.path.join(src, "b"))
    nonempty = [f for f in files if f.size]
    rng = np.random.default_rng([seed, 10])
    small: list[tuple[str, int]] = []
    total = 0
    order = rng.permutation(len(nonempty)).tolist() if nonempty else []
    pieces: list[bytes] = []
    dirs: dict[str, int] = {}  # the source's directories (up to MAX_DIRS), as s/<n>/
    for i in order:
        if len(small) >= MAX_FILES or total >= MAX_BYTES:
            break
        f = nonempty[i]
        try:
            with open(f.path, "rb") as fh:
                data = fh.read(min(f.size, chunk_size))
        except OSError:
            continue
        if not data:
            continue
        d = dirs.setdefault(os.path.dirname(f.rel), len(dirs)) % MAX_DIRS
        os.makedirs(os.path.join(src, "s", str(d)), exist_ok=True)
        rel = f"s/{d}/{len(small):05d}"
        _write(os.path.join(src, rel), data)
        small.append((rel, len(data)))
        pieces.append(data)
        total += len(data)
    k = 0
    while len(small) < MIN_FILES:  # few files in the source: repeat them (or zeros)
        data = pieces[k % len(pieces)] if pieces else b"\0" * 4096
        rel = f"s/{len(small):05d}"
        _write(os.path.join(src, rel), data)
        small.append((rel, len(data)))
        k += 1
    big = []
    size = min(BIG_CHUNKS * chunk_size, MAX_BIG_BYTES // readers)
    big_chunks = max(2, -(-size // chunk_size))
    for r in range(readers):
        rel = f"b/{r:03d}"
        _write(os.path.join(src, rel), rng.bytes(big_chunks * chunk_size))
        big.append(rel)
    return small, big, big_chunks


def _write(path: str, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)


def _pack(src: str, dest: str, chunk_size: int) -> None:
    from compressors import parse_spec
    from fanstore.pack import CodecPolicy, PackOptions, pack

    pack(src, dest, CodecPolicy(parse_spec("none")),
         PackOptions(partitions=1, jobs=1, chunk_size=chunk_size, progress=False))


def _warm(store: str) -> None:
    """Read the store's files once: the calibration measures the read path, not the disk
    (the model adds the storage time separately)."""
    for name in os.listdir(store):
        with open(os.path.join(store, name), "rb", buffering=0) as f:
            while f.read(8 << 20):
                pass


# --------------------------------------------------------------------------- the mount


def fuse_problem() -> str | None:
    """Why a mount cannot be calibrated here, or None. The mount itself runs as a
    subprocess (the CLI), which checks the rest; what it needs first is the device."""
    if not os.path.exists("/dev/fuse"):
        return "/dev/fuse does not exist on this machine"
    return None


def _check_fuse() -> None:
    problem = fuse_problem()
    if problem:
        raise CalibrationError(f"--reader mount needs FUSE ({problem}); use --reader api")


def _cli(*args: str, check: bool = True) -> int:
    """The public CLI, as a user would run it (``fanstore mount`` / ``fanstore umount``);
    returns its exit status."""
    cmd = [sys.executable, "-m", "fanstore.cli", *args]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT,
                              check=False)
    except subprocess.TimeoutExpired:
        if not check:
            return 1
        raise CalibrationError(f"calibration: 'fanstore {' '.join(args)}' did not finish in "
                               f"{TIMEOUT:.0f} s") from None
    if check and proc.returncode != 0:
        line = (proc.stderr.strip().splitlines() or ["(no message)"])[-1]
        raise CalibrationError(f"calibration: 'fanstore {args[0]}' of a temporary store "
                               f"failed: {line.removeprefix('fanstore: error: ')}")
    return proc.returncode


# --------------------------------------------------------------------------- reading


def _read_plain(path: str) -> int:
    with open(path, "rb", buffering=0) as f:
        n = 0
        while True:
            b = f.read(1 << 20)
            if not b:
                return n
            n += len(b)


def _reader(kind: str, root: str, rels: list, barrier, results, slot: int) -> None:
    try:
        if kind == "api":
            from fanstore.api import open_store  # the reader users call

            store = open_store(root)

            def read(rel: str) -> None:
                store.read(rel)
        else:
            def read(rel: str) -> None:
                _read_plain(os.path.join(root, rel))
        barrier.wait(TIMEOUT)
        t0 = time.perf_counter()
        for rel in rels:
            read(rel[0] if isinstance(rel, tuple) else rel)
        results[slot] = time.perf_counter() - t0
    except BaseException:  # noqa: BLE001 - reported by the parent as a failed pass
        results[slot] = -1.0
        try:
            barrier.abort()
        except Exception:  # noqa: BLE001
            pass


def _timed_pass(kind: str, root: str, shares: list[list]) -> float:
    """Seconds until the slowest of ``len(shares)`` concurrent reader processes is done."""
    ctx = mp.get_context("fork")
    barrier = ctx.Barrier(len(shares))
    results = ctx.Array("d", len(shares))
    procs = [ctx.Process(target=_reader, args=(kind, root, share, barrier, results, i),
                         daemon=True) for i, share in enumerate(shares)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + TIMEOUT
    for p in procs:
        p.join(max(0.1, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    times = list(results)
    if any(t <= 0 for t in times) or any(p.exitcode != 0 for p in procs):
        raise CalibrationError(f"calibration: a reader through the {kind} failed")
    return max(times)


def _copy_and_checksum_cost() -> float:
    """Seconds per byte of what ``none`` costs a read (a copy and the XXH3 check)."""
    from fanstore.select import bench

    units = [np.random.default_rng(3).bytes(64 << 10) for _ in range(64)]
    base = bench.baseline(units)
    return base.copy + base.checksum


__all__ = ["READERS", "ReaderCost", "CalibrationError", "calibrate", "check_reader"]
