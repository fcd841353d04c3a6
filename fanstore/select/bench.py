"""Measurements on the sample: compressed size, encode time, single-core decode time.

Each unit is handled as pack and the store handle it: pack keeps a chunk raw when the codec
does not shrink it, and the store decodes every chunk with ``codec.decode(view, raw_size)``
on a memoryview of the fetched bytes (raw chunks through the ``none`` codec, a copy), then
verifies its XXH3-64. The copy and checksum costs are properties of the data, not of the
codec: they are measured once per kind and charged to every candidate.

Timing: one core, the calling thread (blosc2 is pinned to one thread by its codec), timed
with the thread's CPU clock (``time.thread_time``): on a shared node other processes
stretch the wall clock but not the CPU seconds a decode needs, which is what the model
multiplies by the cores. A
verification pass over a few units warms up contexts and checks the round trip, then at
least :data:`MIN_PASSES` timed passes over the kind's units (more while under
:data:`MIN_SECONDS`), and the median pass counts. Encoding a kind stops once its share of the
candidate's encode time budget is spent (after at least a few units): slow encoders
(zstd:19, zlib, lz4hc:12) are measured on a random prefix of the sample, the others on all.
"""

from __future__ import annotations

import mmap
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import xxhash

from compressors import Codec, DeclinedError, NullCodec
from fanstore.errors import FanStoreError

MIN_PASSES = 3
MAX_PASSES = 25
MIN_SECONDS = 0.05
_MIN_ENCODE_UNITS = 16
_NULL = NullCodec()
#: CPU seconds of the calling thread (falls back to the wall clock where unsupported).
_clock = getattr(time, "thread_time", time.perf_counter)


@dataclass
class KindMeasure:
    """One candidate on one kind's units (a prefix of them if encoding was cut short).

    Attributes: ``raw_bytes``/``units`` measured; ``stored_bytes`` what pack would store
    (raw units count in full); ``raw_units``/``raw_unit_bytes`` the units kept raw;
    ``encode_s`` encode time; ``decode_s`` median decode pass over the compressed units
    only (raw ones are charged at the kind's copy cost).
    """

    raw_bytes: int
    stored_bytes: int
    units: int
    raw_units: int
    raw_unit_bytes: int
    encode_s: float
    decode_s: float
    #: solid blocks: (raw bytes, files) of each measured block (a unit larger than a block
    #: is a block of one); empty otherwise
    blocks: list[tuple[int, int]] = field(default_factory=list)
    #: units the codec declined (``Codec.declines``: jpegxl given a non-JPEG, a JPEG it
    #: cannot transcode, a piece of a file), kept raw as pack keeps them; among ``raw_units``
    declined: int = 0

    @property
    def amplification(self) -> float:
        """Bytes decoded per byte a reader gets when every file read decodes its whole block
        (no cache keeps it: the most a random-order read can cost; ``readorder`` models the
        caches)."""
        total = sum(raw for raw, _ in self.blocks)
        return sum(n * raw for raw, n in self.blocks) / total if total else 1.0


@dataclass
class KindBaseline:
    """Per-kind costs every candidate pays, in seconds per raw byte on one core."""

    copy: float  # a raw chunk through the none codec
    checksum: float  # xxh3_64 of the decoded bytes


def median_pass(fn: Callable[[], None], min_passes: int = MIN_PASSES,
                min_seconds: float = MIN_SECONDS, max_passes: int = MAX_PASSES) -> float:
    times: list[float] = []
    spent = 0.0
    while len(times) < min_passes or (spent < min_seconds and len(times) < max_passes):
        t0 = _clock()
        fn()
        dt = _clock() - t0
        times.append(dt)
        spent += dt
    return statistics.median(times)


def baseline(units: list[bytes]) -> KindBaseline:
    total = sum(len(u) for u in units)
    views = [(memoryview(u), len(u)) for u in units]
    digest = xxhash.xxh3_64_intdigest
    decode = _NULL.decode

    def copy() -> None:
        for v, n in views:
            decode(v, n)

    def checksum() -> None:
        for v, _ in views:
            digest(v)

    copy()
    return KindBaseline(copy=median_pass(copy) / total, checksum=median_pass(checksum) / total)


def measure(codec: Codec, units: list[bytes], encode_budget: float) -> KindMeasure:
    """Encode a prefix of ``units`` within ``encode_budget`` seconds, then time decoding."""
    stored: list[tuple[memoryview, int, int]] = []
    raw_bytes = stored_bytes = raw_units = raw_unit_bytes = 0
    encode = codec.encode
    t0 = _clock()
    done = declined = 0
    for unit in units:
        try:
            blob = encode(unit)
        except DeclinedError:  # pack keeps such a unit raw (fanstore.pack.fallback)
            blob = unit
            declined += 1
        n = len(unit)
        if len(blob) >= n:
            raw_units += 1
            raw_unit_bytes += n
            stored_bytes += n
        else:
            stored.append((memoryview(blob), n, done))
            stored_bytes += len(blob)
        raw_bytes += n
        done += 1
        if done >= _MIN_ENCODE_UNITS and _clock() - t0 >= encode_budget:
            break
    encode_s = _clock() - t0
    decode = codec.decode
    # Warm-up, and a round-trip check on the first few compressed units.
    for view, n, i in stored[:4]:
        if decode(view, n) != units[i]:
            raise FanStoreError(f"codec {codec.spec} does not round-trip the sample")

    def decode_all() -> None:
        for view, n, _ in stored:
            decode(view, n)

    decode_s = median_pass(decode_all) if stored else 0.0
    return KindMeasure(raw_bytes, stored_bytes, done, raw_units, raw_unit_bytes, encode_s,
                       decode_s, declined=declined)


def solid_blocks(units: list[bytes], block: int) -> tuple[list[bytes], list[int]]:
    """The units as the packer would store them with solid blocks of ``block`` bytes: units
    no larger than a block (whole small files) appended back to back in sample order, a new
    block when the next does not fit; larger units alone. Returns the blocks and the number
    of units in each."""
    blocks: list[bytes] = []
    members: list[int] = []
    cur: list[bytes] = []
    fill = 0

    def close() -> None:
        nonlocal cur, fill
        if cur:
            blocks.append(cur[0] if len(cur) == 1 else b"".join(cur))
            members.append(len(cur))
            cur, fill = [], 0

    for u in units:
        if len(u) > block:
            blocks.append(u)
            members.append(1)
            continue
        if fill + len(u) > block:
            close()
        cur.append(u)
        fill += len(u)
    close()
    return blocks, members


def measure_solid(codec: Codec, units: list[bytes], encode_budget: float,
                  block: int) -> KindMeasure:
    """:func:`measure` on the solid blocks of ``units`` (see :func:`solid_blocks`), keeping
    the size and file count of each measured block: each file read decodes (and checks) its
    whole block unless a cache still holds it (``fanstore.select.readorder``)."""
    blocks, members = solid_blocks(units, block)
    m = measure(codec, blocks, encode_budget)
    # encoding may have been cut short: the blocks measured
    m.blocks = [(len(b), n) for b, n in zip(blocks[: m.units], members)]
    return m


# --------------------------------------------------------------------------- storage

STORAGE_TEST_BYTES = 128 << 20
#: Random reads per reader when the storage's access latency is measured.
RANDOM_READS = 256
_BLOCK = 4 << 20
_PAGE = 4096


def measure_storage(directory: str | None = None,
                    size: int = STORAGE_TEST_BYTES) -> tuple[float, str]:
    """Sequential read bandwidth (bytes/s) of the file system holding ``directory``.

    Writes a temporary file of ``size`` bytes, syncs it, and reads it back in 4 MiB blocks
    with ``O_DIRECT`` (bypassing the page cache). Where ``O_DIRECT`` is refused (tmpfs,
    some network file systems) the pages are dropped with ``posix_fadvise(DONTNEED)`` and
    read normally, which the returned description says.
    """
    rate, _latency, how = measure_storage_access(directory, 0, size)
    return rate, how


def measure_storage_access(directory: str | None = None, readers: int = 1,
                           size: int = STORAGE_TEST_BYTES,
                           reads: int = RANDOM_READS) -> tuple[float, float, str]:
    """(sequential read bytes/s, one reader's seconds per random read, description) of the
    file system holding ``directory``: :func:`measure_storage`, then ``readers`` threads
    each make ``reads`` random 4 KiB reads of the same file at once (``O_DIRECT``, or after
    ``DONTNEED``), as ``readers`` processes reading files in random order from their
    partitions would. ``readers=0``: no random reads (latency 0)."""
    directory = directory or tempfile.gettempdir()
    block = os.urandom(_BLOCK)
    size = max(_BLOCK, size // _BLOCK * _BLOCK)
    fd, path = tempfile.mkstemp(prefix=".fanstore-select-", dir=directory)
    latency = 0.0
    try:
        try:
            for _ in range(size // _BLOCK):
                os.write(fd, block)
            os.fsync(fd)
        finally:
            os.close(fd)
        method = "O_DIRECT"
        try:
            seconds = _read_direct(path, size)
        except OSError:
            method = "buffered after posix_fadvise(DONTNEED)"
            seconds = _read_dropped(path, size)
        how = f"measured: {method} read of {size >> 20} MiB in {directory}"
        if readers > 0:
            latency = _random_reads(path, size, readers, reads, method == "O_DIRECT")
            how += (f"; random 4 KiB reads, {readers} at once: {latency * 1e6:,.0f} us each "
                    "per reader")
    except OSError as exc:
        raise FanStoreError(f"cannot measure the storage in {directory}: "
                            f"{exc.strerror or exc}; pass --storage-mb-per-sec") from None
    finally:
        try:
            os.unlink(path)
        except OSError:
            pass
    return size / seconds, latency, how


def _random_reads(path: str, size: int, readers: int, reads: int, direct: bool) -> float:
    """One reader's wall seconds per random 4 KiB read, ``readers`` threads at once."""
    import random
    import threading

    pages = size // _PAGE
    rng = random.Random(0)
    plans = [[rng.randrange(pages) * _PAGE for _ in range(reads)] for _ in range(readers)]
    flags = os.O_RDONLY | (getattr(os, "O_DIRECT", 0) if direct else 0)
    fds = [os.open(path, flags) for _ in range(readers)]
    failed: list[BaseException] = []
    try:
        if not direct and hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fds[0], 0, 0, os.POSIX_FADV_DONTNEED)

        def run(fd: int, offsets: list[int]) -> None:
            buf = mmap.mmap(-1, _PAGE)  # page-aligned, as O_DIRECT needs
            try:
                for off in offsets:
                    os.preadv(fd, [buf], off)
            except OSError as exc:
                failed.append(exc)
            finally:
                buf.close()

        threads = [threading.Thread(target=run, args=(fd, plan))
                   for fd, plan in zip(fds, plans)]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - t0
    finally:
        for fd in fds:
            os.close(fd)
    if failed:
        raise failed[0]
    return wall / reads


def _read_direct(path: str, size: int) -> float:
    flag = getattr(os, "O_DIRECT", None)
    if flag is None:
        raise OSError("no O_DIRECT")
    buf = mmap.mmap(-1, _BLOCK)  # page-aligned, as O_DIRECT needs
    fd = os.open(path, os.O_RDONLY | flag)
    try:
        t0 = time.perf_counter()
        got = 0
        while got < size:
            n = os.readv(fd, [buf])
            if n <= 0:
                break
            got += n
        return max(time.perf_counter() - t0, 1e-9)
    finally:
        os.close(fd)
        buf.close()


def _read_dropped(path: str, size: int) -> float:
    fd = os.open(path, os.O_RDONLY)
    try:
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        t0 = time.perf_counter()
        got = 0
        while got < size:
            data = os.read(fd, _BLOCK)
            if not data:
                break
            got += len(data)
        return max(time.perf_counter() - t0, 1e-9)
    finally:
        os.close(fd)
