"""One epoch, measured: reader processes read a list of files the way a budget is defined.

``fanstore select`` decides with it (its finalists, :mod:`.trial`; its reader calibration,
:mod:`.calibrate`) and ``fanstore select --check`` validates a choice with it, so that a
prediction and its check read the same way:

* ``readers`` processes are forked; each opens what it reads through (nothing for a mount,
  ``fanstore.open_store`` for the Python API) and waits on a barrier. The clock starts
  when the barrier releases them and stops when the last one is done: process start-up
  and index loads are never timed.
* Reader ``i`` takes files ``i, i+n, i+2n, ...`` of the list, in list order (DataLoader
  workers deal an epoch's batches the same way); the list is the epoch's order, shuffled
  by the caller.
* A file is opened, read whole in 1 MiB ``readinto`` calls into one reused buffer and
  closed: ``open(path, "rb")`` through a mount (buffered, as PIL, numpy and most training
  code open files), ``store.open(path)`` through the API.
* Prefetch mode: as soon as the readers are released the whole order goes to the mount's
  daemon (the ``prefetch`` control request, what ``fanstore prefetch`` and
  ``fanstore.torch.PrefetchSampler`` send at the start of an epoch); its cost is in the
  pass.
* Per file, the wall time of its open, reads and close (``latency``): a caller can
  attribute the pass to groups of files (:mod:`.trial` does). Per pass, the CPU seconds of
  the readers and of the mount's processes (the daemon found through its control socket,
  and every process below it): what projects the pass to a node with more cores.

Cold passes: :func:`drop_page_cache` evicts a store's files from the page cache (they are
synced first, so freshly packed partitions are evictable too) and then asks the kernel
which of their pages are still there (``mincore``): where the drop did nothing (a store on
a tmpfs, whose pages are its storage; a file the drop could not open) the caller says its
pass was not cold instead of reporting it as cold. A fresh mount has no page cache of its
own.
"""

from __future__ import annotations

import ctypes
import gc
import logging
import mmap
import multiprocessing as mp
import os
import queue as _queue
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from fanstore.errors import FanStoreError

log = logging.getLogger(__name__)

#: One read call's size: larger files are read in pieces of this many bytes.
READ_BYTES = 1 << 20
#: Seconds a pass may take before it is abandoned (a mount that stopped answering).
TIMEOUT = 900.0
#: The client name under which a pass hands its order to a prefetch-mode mount.
ORDER_CLIENT = "fanstore-select"


class PassError(FanStoreError):
    """A measured pass could not run (a reader died, the mount stopped answering)."""


@dataclass(frozen=True)
class Target:
    """What the readers read through: ``reader`` "mount" (plain files under ``root``, a
    mount point) or "api" (``fanstore.open_store(root, cache_mb)``: a store, or a mount
    whose window the API maps); ``order_to``: the mount point to hand the epoch's order to
    (prefetch mode), or None."""

    reader: str
    root: str
    order_to: str | None = None
    cache_mb: int = 64  # the API's decoded-chunk cache per reader process

    def __post_init__(self) -> None:
        if self.reader not in ("mount", "api"):
            raise ValueError(f"unknown reader {self.reader!r}")


@dataclass
class PassResult:
    """One pass. ``latency[i]`` is file ``i``'s open-to-close seconds (in list order);
    ``seconds`` the wall time from the release to the last reader done; ``reader_cpu``
    and ``mount_cpu`` CPU seconds spent meanwhile (``mount_cpu`` None without a mount)."""

    files: int
    bytes: int
    readers: int
    seconds: float
    latency: list[float] = field(repr=False)
    reader_cpu: float
    mount_cpu: float | None
    errors: int = 0
    first_error: str | None = None
    order_seconds: float | None = None
    #: the store's pages in the page cache when the pass began, as a fraction (the caller's
    #: :func:`drop_page_cache`; None: not checked)
    resident: float | None = None

    @property
    def files_per_s(self) -> float:
        return self.files / self.seconds if self.seconds > 0 else 0.0

    @property
    def bytes_per_s(self) -> float:
        return self.bytes / self.seconds if self.seconds > 0 else 0.0

    @property
    def cpu(self) -> float:
        """CPU seconds of every process of the pass (readers and mount)."""
        return self.reader_cpu + (self.mount_cpu or 0.0)

    @property
    def concurrency(self) -> float:
        """Files in flight on average: the sum of latencies over the wall time (about the
        reader count when every reader was busy all along)."""
        total = sum(self.latency)
        return total / self.seconds if self.seconds > 0 and total > 0 else float(self.readers)


# --------------------------------------------------------------------------- readers


def _read_mount(path: str, buf: bytearray) -> int:
    n = 0
    with open(path, "rb") as f:
        while True:
            k = f.readinto(buf)
            if not k:
                return n
            n += k


def _reader(target: Target, rels: Sequence[str], slot: int, step: int, barrier,
            results, warmup: Sequence[str] = ()) -> None:
    """One reader process: files ``slot, slot+step, ...`` of ``rels`` (after its share of
    ``warmup``, untimed)."""
    gc.disable()  # a collection would walk (and copy) the parent's heap: see run_pass
    store = None
    try:
        if target.reader == "api":
            from fanstore.api import open_store  # the reader users call

            store = open_store(target.root, cache_mb=target.cache_mb)
        buf = bytearray(READ_BYTES)
        view = memoryview(buf)
        root = target.root
        for i in range(slot, len(warmup), step):
            if store is None:
                _read_mount(os.path.join(root, warmup[i]), buf)
            else:
                store.read(warmup[i])
        barrier.wait(TIMEOUT)
    except Exception as exc:  # noqa: BLE001 - reported by the parent
        results.put({"slot": slot, "setup_error": f"{type(exc).__name__}: {exc}"})
        try:
            barrier.abort()
        except Exception:  # noqa: BLE001
            pass
        return
    clock = time.perf_counter
    cpu0 = time.process_time()
    lat: list[float] = []
    nbytes = errors = 0
    first_error = None
    start = clock()
    for i in range(slot, len(rels), step):
        rel = rels[i]
        t = clock()
        try:
            if store is None:
                nbytes += _read_mount(os.path.join(root, rel), buf)
            else:
                with store.open(rel) as f:
                    while True:
                        k = f.readinto(view)
                        if not k:
                            break
                        nbytes += k
        except (OSError, FanStoreError) as exc:
            errors += 1
            if first_error is None:
                first_error = f"{rel}: {exc}"
        lat.append(clock() - t)
    end = clock()
    results.put({"slot": slot, "lat": lat, "bytes": nbytes, "errors": errors,
                 "first_error": first_error, "start": start, "end": end,
                 "cpu": time.process_time() - cpu0})
    if store is not None:
        store.close()


# --------------------------------------------------------------------------- a pass


def mount_pids(mountpoint: str) -> list[int]:
    """The processes serving ``mountpoint``: its daemon (the control socket's peer) and
    every process below it; empty when no FanStore daemon answers there."""
    from fanstore.control import ControlClient
    from fanstore.process import descendants

    client = ControlClient(mountpoint, timeout=30.0)
    try:
        client.request({"op": "stats"})
        pid = client.server[0] if client.server else 0
    except FanStoreError:
        return []
    finally:
        client.close()
    return descendants(pid) if pid > 0 else []


def run_pass(target: Target, rels: Sequence[str], readers: int,
             watch: str | None = None, timeout: float = TIMEOUT,
             warmup: Sequence[str] = ()) -> PassResult:
    """Read ``rels`` (relative to ``target.root``, in this order) with ``readers``
    processes; see the module docstring. ``watch``: a mount point whose processes' CPU is
    counted (None: none). Raises :class:`PassError` if a reader cannot start or dies; files
    that fail to read are counted in the result (``errors``, ``first_error``)."""
    from fanstore.process import cpu_seconds

    rels = list(rels)
    if not rels:
        raise PassError("nothing to read")
    n = max(1, min(int(readers), len(rels)))
    ctx = mp.get_context("fork")
    barrier = ctx.Barrier(n + 1)
    results = ctx.Queue()
    pids = mount_pids(watch) if watch else []
    procs = [ctx.Process(target=_reader, args=(target, rels, i, n, barrier, results, list(warmup)),
                         daemon=True) for i in range(n)]
    got: list[dict] = []
    order_s = None
    # The readers are forked from the caller, whose heap can be large (a selection holds
    # its sample and every candidate's measurements): a garbage collection in a reader
    # walks every object it inherited, copying their pages. Frozen objects are not walked,
    # and the readers collect nothing anyway. Without it, the trials of a selection read
    # 60,000 small files at 9,000-11,000 files/s, where the same trial from a small
    # process read them at 17,000-19,000 and the whole set at 15,000-17,000.
    gc.freeze()
    try:
        for p in procs:
            p.start()
        try:
            barrier.wait(timeout)
        except Exception:  # noqa: BLE001 - a reader failed to start: its message follows
            raise PassError(_setup_error(results) or "a reader failed to start") from None
        cpu0 = cpu_seconds(pids) if pids else None
        t0 = time.perf_counter()
        if target.order_to is not None:
            order_s = _send_order(target, rels)
        deadline = time.monotonic() + timeout
        while len(got) < n:
            try:
                got.append(results.get(timeout=0.5))
            except _queue.Empty:
                if time.monotonic() > deadline:
                    raise PassError(f"the readers did not finish in {timeout:.0f} s") from None
                dead = [p for p in procs if p.exitcode not in (None, 0)]
                if dead:
                    raise PassError(f"a reader died (exit status {dead[0].exitcode})") from None
        cpu1 = cpu_seconds(pids) if pids else None
    finally:
        gc.unfreeze()
        for p in procs:
            if p.is_alive() and len(got) < n:
                p.kill()
            p.join(5)
        results.close()
    setup = [r["setup_error"] for r in got if "setup_error" in r]
    if setup:
        raise PassError(f"a reader could not start: {setup[0]}")
    got.sort(key=lambda r: r["slot"])
    latency = [0.0] * len(rels)
    for r in got:
        latency[r["slot"]::n] = r["lat"]
    start = min([t0] + [r["start"] for r in got])
    seconds = max(max(r["end"] for r in got) - start, 1e-9)
    return PassResult(
        files=len(rels), bytes=sum(r["bytes"] for r in got), readers=n, seconds=seconds,
        latency=latency, reader_cpu=sum(r["cpu"] for r in got),
        mount_cpu=None if cpu0 is None or cpu1 is None else max(0.0, cpu1 - cpu0),
        errors=sum(r["errors"] for r in got),
        first_error=next((r["first_error"] for r in got if r["first_error"]), None),
        order_seconds=order_s)


def _setup_error(results) -> str | None:
    try:
        r = results.get(timeout=5)
    except _queue.Empty:
        return None
    return r.get("setup_error")


def _send_order(target: Target, rels: list[str]) -> float:
    """Hand the epoch's order to the prefetch-mode mount: seconds it took."""
    from fanstore.control import control

    t0 = time.perf_counter()
    control(target.order_to, {"op": "prefetch", "paths": rels, "client": ORDER_CLIENT},
            timeout=300.0)
    return time.perf_counter() - t0


# --------------------------------------------------------------------------- cold

#: A pass is cold when at most this fraction of its store's pages are in the page cache
#: after the drop (on a disk they are all gone: 0.0; on a tmpfs all stay: 1.0).
COLD_RESIDENT = 0.05
#: mincore(2) is asked about this many bytes of a file at a time (its answer is one byte
#: per page).
_WINDOW = 256 << 20
_LOW_BIT = bytes(b & 1 for b in range(256))  # mincore's byte per page: bit 0 = resident


@dataclass(frozen=True)
class Residency:
    """How many of some files' pages are in the page cache (``mincore``); ``pages`` 0
    with ``known`` False when the kernel could not be asked."""

    resident: int
    pages: int
    known: bool = True

    @property
    def fraction(self) -> float | None:
        if not self.known:
            return None
        return self.resident / self.pages if self.pages else 0.0

    @property
    def cold(self) -> bool | None:
        """Whether a pass that starts now reads cold (None: unknown)."""
        fraction = self.fraction
        return None if fraction is None else fraction <= COLD_RESIDENT


def _files_of(paths: Sequence[str]) -> list[str]:
    files: list[str] = []
    for p in paths:
        if os.path.isdir(p):
            files.extend(os.path.join(p, name) for name in sorted(os.listdir(p))
                         if os.path.isfile(os.path.join(p, name)))
        else:
            files.append(p)
    return files


def drop_page_cache(paths: Sequence[str]) -> Residency:
    """Evict ``paths`` (files, or every file directly in a directory) from the page cache:
    synced first (pages not yet written back cannot be evicted), then
    ``posix_fadvise(DONTNEED)``. Needs no privilege; files that vanished are skipped.
    Returns what is still resident afterwards (:func:`resident_pages`)."""
    files = _files_of(paths)
    for path in files:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError as exc:
            log.debug("cannot drop %s from the page cache: %s", path, exc)
            continue
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        except OSError as exc:
            log.debug("cannot drop %s from the page cache: %s", path, exc)
        finally:
            os.close(fd)
    return resident_pages(files)


def resident_pages(paths: Sequence[str]) -> Residency:
    """The pages of ``paths`` (files, or the files directly in a directory) that are in the
    page cache: each file mapped (nothing is read) and ``mincore(2)`` asked about it. The
    kernel answers for the page cache only about files the caller owns or may write (Linux
    5.0 and later; else about its own mappings): true of every store a selection or a
    check packs or is given by its owner. Files that vanished count nothing."""
    libc = _libc()
    if libc is None:
        return Residency(0, 0, known=False)
    page = mmap.PAGESIZE
    resident = pages = 0
    for path in _files_of(paths):
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            size = os.fstat(fd).st_size
            for offset in range(0, size, _WINDOW):
                length = min(_WINDOW, size - offset)
                got = _mincore(libc, fd, offset, length, page)
                if got is None:
                    return Residency(0, 0, known=False)
                resident += got
                pages += -(-length // page)
        finally:
            os.close(fd)
    return Residency(resident, pages)


def _libc():
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                              ctypes.c_int, ctypes.c_long)
        libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
        libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t,
                                 ctypes.POINTER(ctypes.c_ubyte))
    except (OSError, AttributeError) as exc:  # not Linux
        log.debug("no mincore here: %s", exc)
        return None
    return libc


def _mincore(libc, fd: int, offset: int, length: int, page: int) -> int | None:
    """Resident pages of ``length`` bytes of ``fd`` from ``offset`` (page-aligned), or None
    when the kernel refuses."""
    addr = libc.mmap(None, length, mmap.PROT_READ, mmap.MAP_SHARED, fd, offset)
    if addr in (None, ctypes.c_void_p(-1).value):
        log.debug("mmap for mincore failed: %s", os.strerror(ctypes.get_errno()))
        return None
    try:
        vec = (ctypes.c_ubyte * (-(-length // page)))()
        if libc.mincore(addr, length, vec) != 0:
            log.debug("mincore failed: %s", os.strerror(ctypes.get_errno()))
            return None
        return bytes(vec).translate(_LOW_BIT).count(1)
    finally:
        libc.munmap(addr, length)


__all__ = ["COLD_RESIDENT", "ORDER_CLIENT", "PassError", "PassResult", "Residency", "Target",
           "drop_page_cache", "mount_pids", "resident_pages", "run_pass"]
