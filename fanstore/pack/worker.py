"""Compress partitions in worker processes: the workers of the planned pack.

Each worker process owns whole partitions (a :class:`PartTask`): it reads its files in
chunks, checksums, compresses (keeping the raw bytes where compression does not shrink
them), appends to its partition file and returns only the chunk rows (a
:class:`PartResult`). Nothing bulky crosses the process boundary. Files for solid blocks
are appended to an open block per (codec, block size, kind) and the block is compressed as
one chunk when the next file would not fit (format v2). :func:`run_tasks` runs the tasks on
a pool (``--jobs``) with a progress bar on a terminal; an MPI pack runs each rank's share
the same way (``fanstore.daemon.mpipack``).
"""

from __future__ import annotations

import contextlib
import errno
import multiprocessing as mp
import os
import signal
import sys
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import xxhash

from compressors import CodecError, get_codec
from fanstore.errors import FanStoreError, PackError
from fanstore.format.partition import PartitionWriter
from fanstore.pack.access import PRIVATE_FILE_MODE
from fanstore.pack.options import PackOptions
from fanstore.pack.scan import show

# Set in each worker by the pool initializer.
_progress: Any = None


def _init_worker(progress) -> None:
    global _progress
    _progress = progress
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles ^C and terminates us
    with contextlib.suppress(Exception):  # blosc2 is optional
        import blosc2

        blosc2.set_nthreads(1)


@dataclass
class PartTask:
    number: int
    path: str
    #: (entry, abs path, size, codec slot, solid block size or 0, block group). Files with a
    #: block size go into solid blocks: one open block per (slot, block size, group), where
    #: the group is the file's kind (similar files compress best together).
    files: list[tuple[int, bytes, int, int, int, int]]
    codecs: list[dict[str, Any]]  # codec table (slot -> config); slot 0 is "none"
    chunk_size: int


@dataclass
class PartResult:
    number: int
    size: int = 0
    checksum: str = ""
    entries: np.ndarray | None = None  # entry id per file, in partition order
    file_sums: np.ndarray | None = None
    chunk_counts: np.ndarray | None = None
    chunk_firsts: np.ndarray | None = None  # first chunk of each file (partition-relative)
    data_offsets: np.ndarray | None = None  # offset in the first chunk (solid blocks)
    chunks: dict[str, np.ndarray] | None = None
    raw_bytes: int = 0
    error: str | None = None


class _WriteError(OSError):
    """An OSError from writing a partition (reported as such, not as a source read error)."""


class _Rows:
    """The chunk rows a worker appends to its partition."""

    def __init__(self, writer: PartitionWriter, n_est: int) -> None:
        self.writer = writer
        self.k = 0
        self.cols = {
            "offset": np.zeros(n_est, "<u8"),
            "stored": np.zeros(n_est, "<u4"),
            "raw": np.zeros(n_est, "<u4"),
            "codec": np.zeros(n_est, "<u2"),
            "checksum": np.zeros(n_est, "<u8"),
        }

    def add(self, raw, slot: int, codec) -> int:
        """Compress (or keep raw) and append one chunk; returns its row."""
        n = len(raw)
        stored = codec.encode(raw) if slot else raw
        use = slot
        if len(stored) >= n:
            stored, use = raw, 0
        k = self.k
        if k == len(self.cols["offset"]):  # more chunks than estimated (cannot happen)
            for name, arr in self.cols.items():
                self.cols[name] = np.concatenate((arr, np.zeros_like(arr)))
        try:
            self.cols["offset"][k] = self.writer.append(stored)
        except OSError as exc:  # writing the partition, not reading a source file
            raise _WriteError(exc.errno, exc.strerror) from exc
        self.cols["stored"][k] = len(stored)
        self.cols["raw"][k] = n
        self.cols["codec"][k] = use
        self.cols["checksum"][k] = xxhash.xxh3_64_intdigest(raw)
        self.k += 1
        return k


def _progress_add(n: int) -> None:
    if _progress is not None:
        with _progress.get_lock():
            _progress.value += n


def _pack_partition(task: PartTask) -> PartResult:
    codecs = [get_codec(cfg) for cfg in task.codecs]
    res = PartResult(task.number)
    n_est = sum(max(1, -(-size // task.chunk_size)) for _, _, size, *_ in task.files)
    n_files = len(task.files)
    entries = np.zeros(n_files, "<u4")
    sums = np.zeros(n_files, "<u8")
    counts = np.zeros(n_files, "<u4")
    firsts = np.zeros(n_files, "<u8")
    offsets = np.zeros(n_files, "<u4")
    writer = PartitionWriter(task.path, task.number, mode=PRIVATE_FILE_MODE)
    rows = _Rows(writer, n_est)
    buf = bytearray(task.chunk_size)
    view = memoryview(buf)
    # Open solid blocks: (slot, block size, group) -> [files (index, data)], fill
    blocks: dict[tuple[int, int, int], tuple[list[tuple[int, bytes]], list[int]]] = {}

    def flush(key: tuple[int, int, int]) -> None:
        members, _ = blocks.pop(key)
        slot = key[0]
        raw = members[0][1] if len(members) == 1 else b"".join(d for _, d in members)
        try:
            k = rows.add(raw, slot, codecs[slot])
        except CodecError as exc:
            raise PackError(f"{show(task.files[members[0][0]][1])} and the files packed with "
                            f"it: compression failed: {exc}") from exc
        pos = 0
        for i, data in members:
            firsts[i], counts[i], offsets[i] = k, 1, pos
            pos += len(data)

    try:
        for i, (entry, path, size, slot, solid, group) in enumerate(task.files):
            codec = codecs[slot]
            entries[i] = entry
            if solid and 0 < size <= solid:
                data = _read_small(path, size, solid)
                sums[i] = xxhash.xxh3_64_intdigest(data)
                key = (slot, solid, group)
                if key in blocks and blocks[key][1][0] + size > solid:
                    flush(key)
                members, fill = blocks.setdefault(key, ([], [0]))
                members.append((i, data))
                fill[0] += size
                res.raw_bytes += size
                _progress_add(size)
                continue
            whole = xxhash.xxh3_64()
            got = 0
            firsts[i] = rows.k
            try:
                with open(path, "rb", buffering=0) as f:
                    while True:
                        n = f.readinto(buf)
                        if not n:
                            break
                        # Short reads happen (pipes, network FS): fill the chunk before coding.
                        while n < len(buf):
                            m = f.readinto(view[n:])
                            if not m:
                                break
                            n += m
                        got += n
                        if got > size:
                            raise PackError(f"{show(path)}: file grew while being packed")
                        raw = view[:n]
                        whole.update(raw)
                        rows.add(raw, slot, codec)
                        counts[i] += 1
                        _progress_add(n)
                        if n < len(buf):
                            break
            except _WriteError:
                raise
            except OSError as exc:
                raise PackError(f"{show(path)}: cannot read: {exc.strerror}") from exc
            except CodecError as exc:
                raise PackError(f"{show(path)}: compression failed: {exc}") from exc
            if got != size:
                raise PackError(
                    f"{show(path)}: file changed size while being packed ({size} -> {got} bytes)"
                )
            if not counts[i]:
                firsts[i] = 0
            sums[i] = whole.intdigest()
            res.raw_bytes += size
        for key in list(blocks):
            flush(key)
        res.checksum = writer.close()
        res.size = writer.size
    except FanStoreError as exc:  # a source problem, or object storage failing
        writer.abort()
        res.error = str(exc)
        return res
    except OSError as exc:
        writer.abort()
        if exc.errno == errno.ENOSPC:
            res.error = f"no space left on device while writing {task.path}"
        else:
            res.error = f"cannot write {task.path}: {exc.strerror}"
        return res
    res.entries, res.file_sums, res.chunk_counts = entries, sums, counts
    res.chunk_firsts, res.data_offsets = firsts, offsets
    res.chunks = {name: arr[: rows.k] for name, arr in rows.cols.items()}
    res.chunks["part"] = np.full(rows.k, task.number, "<u4")
    return res


def _read_small(path: bytes, size: int, limit: int) -> bytes:
    """A whole small file (at most ``limit`` bytes), checked against its scanned size."""
    parts, got = [], 0
    try:
        with open(path, "rb", buffering=0) as f:
            while got <= limit:  # short reads happen: read until EOF or past the limit
                more = f.read(limit + 1 - got)
                if not more:
                    break
                parts.append(more)
                got += len(more)
    except OSError as exc:
        raise PackError(f"{show(path)}: cannot read: {exc.strerror}") from exc
    data = parts[0] if len(parts) == 1 else b"".join(parts)
    if len(data) > size:
        raise PackError(f"{show(path)}: file grew while being packed")
    if len(data) != size:
        raise PackError(
            f"{show(path)}: file changed size while being packed ({size} -> {len(data)} bytes)")
    return data


def run_tasks(tasks: list[PartTask], options: PackOptions, total: int) -> list[PartResult]:
    """Compress ``tasks`` with a pool of worker processes (one partition per task)."""
    if not tasks:
        return []
    jobs = options.jobs or len(os.sched_getaffinity(0))
    jobs = max(1, min(jobs, len(tasks)))
    show_bar = sys.stderr.isatty() if options.progress is None else options.progress
    ctx = mp.get_context("fork")  # before any thread exists: the bar starts after the pool
    progress = ctx.Value("q", 0)
    # Biggest partitions first so the workers finish together.
    order = sorted(tasks, key=lambda t: -sum(f[2] for f in t.files))
    pool = ctx.Pool(jobs, initializer=_init_worker, initargs=(progress,))
    bar = None
    try:
        pending = [pool.apply_async(_pack_partition, (t,)) for t in order]
        if show_bar:
            from tqdm import tqdm

            tqdm.monitor_interval = 0
            bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1000,
                       desc="packing", file=sys.stderr, smoothing=0.1)
        results = []
        last = 0
        while pending:
            still = []
            for r in pending:
                if r.ready():
                    results.append(r.get())
                else:
                    still.append(r)
            pending = still
            if bar is not None:
                now = progress.value
                bar.update(now - last)
                last = now
            if pending:
                time.sleep(0.1)
        if bar is not None:
            bar.update(progress.value - last)
        pool.close()
        pool.join()
    except BaseException:
        pool.terminate()
        pool.join()
        raise
    finally:
        if bar is not None:
            bar.close()
    return sorted(results, key=lambda r: r.number)
