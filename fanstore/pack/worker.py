"""Compress partitions in worker processes: the workers of the planned pack.

Each worker process owns whole partitions (a :class:`PartTask`): it reads its files in
chunks, checksums, compresses (keeping the raw bytes where compression does not shrink
them), appends to its partition file and returns only the chunk rows (a
:class:`PartResult`). Nothing bulky crosses the process boundary. Files for solid blocks
are appended to an open block per (codec, block size, kind) and the block is compressed as
one chunk when the next file would not fit (format v2). :func:`run_tasks` runs the tasks on
worker processes (``fanstore.pack.pool``, ``--jobs``) with a progress bar on a terminal;
an MPI pack runs each rank's share the same way (``fanstore.daemon.mpipack``).
"""

from __future__ import annotations

import errno
import os
import sys
from typing import Any, Callable

import numpy as np
import xxhash

from compressors import CodecError, DeclinedError, get_codec
from fanstore.errors import FanStoreError, PackError
from fanstore.format.partition import PartitionWriter
from fanstore.pack import wire
from fanstore.pack.access import PRIVATE_FILE_MODE
from fanstore.pack.options import PackOptions
from fanstore.pack.pool import PART, WorkerPool
from fanstore.pack.wire import PartResult, PartTask
from fanstore.pack.scan import show

class _WriteError(OSError):
    """An OSError from writing a partition (reported as such, not as a source read error)."""


class _Rows:
    """The chunk rows a worker appends to its partition."""

    def __init__(self, writer: PartitionWriter, n_est: int) -> None:
        self.writer = writer
        self.n_rows = 0
        self.cols = {
            "offset": np.zeros(n_est, "<u8"),
            "stored": np.zeros(n_est, "<u4"),
            "raw": np.zeros(n_est, "<u4"),
            "codec": np.zeros(n_est, "<u2"),
            "checksum": np.zeros(n_est, "<u8"),
        }

    def add(self, raw, slot: int, codec) -> int:
        """Compress (or keep raw) and append one chunk; returns its row."""
        raw_len = len(raw)
        try:
            stored = codec.encode(raw) if slot else raw
        except DeclinedError:  # not an input this codec takes (jpegxl: not a whole JPEG)
            stored = raw
        use = slot
        if len(stored) >= raw_len:
            stored, use = raw, 0
        row = self.n_rows
        if row == len(self.cols["offset"]):  # more chunks than estimated (cannot happen)
            for name, arr in self.cols.items():
                self.cols[name] = np.concatenate((arr, np.zeros_like(arr)))
        try:
            self.cols["offset"][row] = self.writer.append(stored)
        except OSError as exc:  # writing the partition, not reading a source file
            raise _WriteError(exc.errno, exc.strerror) from exc
        self.cols["stored"][row] = len(stored)
        self.cols["raw"][row] = raw_len
        self.cols["codec"][row] = use
        self.cols["checksum"][row] = xxhash.xxh3_64_intdigest(raw)
        self.n_rows += 1
        return row


def pack_partition(task: PartTask, progress: Callable[[int], None] = lambda n: None
                   ) -> PartResult:
    """Pack one partition (in a worker process); ``progress(n)``: n more bytes packed."""
    codecs = [get_codec(cfg) for cfg in task.codecs]
    res = PartResult(task.number)
    writer = PartitionWriter(task.path, task.number, mode=PRIVATE_FILE_MODE)
    packer = _PartitionPacker(task, codecs, writer, res, progress)
    try:
        packer.pack_files()
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
    res.entries, res.file_sums, res.chunk_counts = packer.entries, packer.sums, packer.counts
    res.chunk_firsts, res.data_offsets = packer.firsts, packer.offsets
    rows = packer.rows
    res.chunks = {name: arr[: rows.n_rows] for name, arr in rows.cols.items()}
    res.chunks["part"] = np.full(rows.n_rows, task.number, "<u4")
    return res


class _PartitionPacker:
    """The files of one partition task going into its partition: the chunk rows, one row of
    the per-file columns for each file (in task order), and the open solid blocks."""

    def __init__(self, task: PartTask, codecs: list, writer: PartitionWriter,
                 result: PartResult, progress: Callable[[int], None]) -> None:
        self.task = task
        self.progress = progress
        self.codecs = codecs
        self.result = result  # counts raw_bytes as files are packed
        n_files = len(task.files)
        self.entries = np.zeros(n_files, "<u4")
        self.sums = np.zeros(n_files, "<u8")  # XXH3-64 of each file
        self.counts = np.zeros(n_files, "<u4")  # chunks of each file
        self.firsts = np.zeros(n_files, "<u8")  # first chunk of each file
        self.offsets = np.zeros(n_files, "<u4")  # offset in the first chunk (solid blocks)
        n_est = sum(max(1, -(-size // task.chunk_size)) for _, _, size, *_ in task.files)
        self.rows = _Rows(writer, n_est)
        self.buf = bytearray(task.chunk_size)
        self.view = memoryview(self.buf)
        # Open solid blocks: (slot, block size, group) -> [files (index, data)], fill
        self.blocks: dict[tuple[int, int, int], tuple[list[tuple[int, bytes]], list[int]]] = {}

    def pack_files(self) -> None:
        """Pack every file of the task, then the solid blocks still open."""
        for file_no, (entry, path, size, slot, solid, group) in enumerate(self.task.files):
            codec = self.codecs[slot]
            self.entries[file_no] = entry
            if solid and 0 < size <= solid:
                self._add_to_block(file_no, path, size, slot, solid, group)
            else:
                self._add_chunked(file_no, path, size, slot, codec)
        for key in list(self.blocks):
            self._flush(key)

    def _add_to_block(
        self, file_no: int, path: bytes, size: int, slot: int, solid: int, group: int
    ) -> None:
        """Append small file ``file_no`` to the open block of its (slot, block size ``solid``,
        group), compressing that block first if the file would not fit."""
        data = _read_small(path, size, solid)
        self.sums[file_no] = xxhash.xxh3_64_intdigest(data)
        key = (slot, solid, group)
        if key in self.blocks and self.blocks[key][1][0] + size > solid:
            self._flush(key)
        members, fill = self.blocks.setdefault(key, ([], [0]))
        members.append((file_no, data))
        fill[0] += size
        self.result.raw_bytes += size
        self.progress(size)

    def _flush(self, key: tuple[int, int, int]) -> None:
        """Compress the open block ``key`` as one chunk; its files point into it."""
        members, _ = self.blocks.pop(key)
        slot = key[0]
        raw = members[0][1] if len(members) == 1 else b"".join(d for _, d in members)
        try:
            chunk = self.rows.add(raw, slot, self.codecs[slot])
        except CodecError as exc:
            raise PackError(f"{show(self.task.files[members[0][0]][1])} and the files packed "
                            f"with it: compression failed: {exc}") from exc
        pos = 0
        for file_no, data in members:
            self.firsts[file_no], self.counts[file_no], self.offsets[file_no] = chunk, 1, pos
            pos += len(data)

    def _add_chunked(self, file_no: int, path: bytes, size: int, slot: int, codec: Any) -> None:
        """Pack file ``file_no`` in chunks of its own, checking it keeps its scanned ``size``."""
        self.firsts[file_no] = self.rows.n_rows
        try:
            got, whole = self._append_chunks(file_no, path, size, slot, codec)
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
        if not self.counts[file_no]:
            self.firsts[file_no] = 0
        self.sums[file_no] = whole.intdigest()
        self.result.raw_bytes += size

    def _append_chunks(
        self, file_no: int, path: bytes, size: int, slot: int, codec: Any
    ) -> tuple[int, Any]:
        """Read file ``file_no`` a chunk at a time and append each (compressed by ``codec``, table
        slot ``slot``); return the bytes read and the running hash of the whole file."""
        buf, view = self.buf, self.view
        whole = xxhash.xxh3_64()
        got = 0
        with open(path, "rb", buffering=0) as source:
            while True:
                filled = source.readinto(buf)
                if not filled:
                    break
                # Short reads happen (pipes, network FS): fill the chunk before coding.
                while filled < len(buf):
                    more = source.readinto(view[filled:])
                    if not more:
                        break
                    filled += more
                got += filled
                if got > size:
                    raise PackError(f"{show(path)}: file grew while being packed")
                raw = view[:filled]
                whole.update(raw)
                self.rows.add(raw, slot, codec)
                self.counts[file_no] += 1
                self.progress(filled)
                if filled < len(buf):
                    break
        return got, whole


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


#: A pack of a directory of fewer bytes than this, with ``--jobs`` left at its default,
#: compresses in the calling process, with no worker process. Starting one is a fresh
#: interpreter importing numpy and the codecs: about 0.2 s of CPU each, a second of wall
#: time on a loaded machine. 8 MiB of JSON took 0.05 s of one core's CPU at zstd:3, 1.9 s
#: at zstd:13 (the default for small files, in solid blocks) and 5.0 s at zstd:19, so 2 MiB
#: takes about 0.01, 0.5 and 1.2 s: no more CPU than the workers' starts, and at most
#: about half a second more wall time than two workers (zstd:19). An explicit
#: ``--jobs N`` always gets its N.
INLINE_BYTES = 2 << 20


def compress_inline(options: PackOptions, raw_bytes: int) -> bool:
    """Whether a pack of ``raw_bytes`` compresses in this process (see
    :data:`INLINE_BYTES`)."""
    return not options.jobs and raw_bytes < INLINE_BYTES


def run_tasks(tasks: list[PartTask], options: PackOptions, total: int,
              pool: WorkerPool | None = None, inline: bool = False) -> list[PartResult]:
    """Compress ``tasks`` on worker processes (one partition per task; ``pool``, else a
    pool of ``options.jobs`` made here), or in this process with ``inline`` (see
    :data:`INLINE_BYTES`), with a progress bar on a terminal."""
    if not tasks:
        return []
    if pool is None and not inline:
        with WorkerPool(worker_count(options, len(tasks))) as own:
            return run_tasks(tasks, options, total, own)
    show_bar = sys.stderr.isatty() if options.progress is None else options.progress
    # Biggest partitions first so the workers finish together.
    order = sorted(tasks, key=lambda t: -sum(f[2] for f in t.files))
    bar = None
    if show_bar:
        from tqdm import tqdm

        tqdm.monitor_interval = 0  # no monitor thread
        bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1000,
                   desc="packing", file=sys.stderr, smoothing=0.1)
    progress = bar.update if bar is not None else None
    try:
        if inline:
            results = [pack_partition(t, progress or (lambda n: None)) for t in order]
        else:
            bodies = pool.run(PART, [wire.encode_task(t) for t in order],
                              [f"compressing partition {t.number}" for t in order], progress)
            results = [wire.decode_result(b)[0] for b in bodies]
    finally:
        if bar is not None:
            bar.close()
    return sorted(results, key=lambda r: r.number)


def worker_count(options: PackOptions, tasks: int) -> int:
    """The workers of a pack: ``--jobs`` (0: the CPUs this process may run on), at most
    one per task."""
    jobs = options.jobs or len(os.sched_getaffinity(0))
    return max(1, min(jobs, tasks))
