"""One epoch, measured: reader processes read a list of files the way a budget is defined.

``fanstore select`` decides with it (its finalists, :mod:`.trial`; its reader calibration,
:mod:`.calibrate`) and ``fanstore select --check`` validates a choice with it, so that a
prediction and its check read the same way:

* ``readers`` processes are started (fresh interpreters, ``fanstore.select.epochreader``,
  by fork-and-exec: the caller may have threads); each opens what it reads through
  (nothing for a mount, ``fanstore.open_store`` for the Python API), says it is ready and
  waits. The clock starts when all are told to go and stops when the last one is done:
  process start-up and index loads are never timed.
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
import json
import logging
import mmap
import os
import select
import subprocess
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


# --------------------------------------------------------------------------- a pass

#: The frames between a pass and its readers (``fanstore.select.epochreader``, which
#: imports them from here; ``fanstore.process.write_frame``): pass -> reader JOB, GO;
#: reader -> pass READY, RESULT, FAILED.
JOB, GO, READY, RESULT, FAILED = 1, 2, 3, 4, 5


# --------------------------------------------------------------------------- a reader
# (run in the reader processes, ``fanstore.select.epochreader``)


def read_mount(path: str, buf: bytearray) -> int:
    """Read a file whole through the mount (buffered, as training code opens files)."""
    n = 0
    with open(path, "rb") as f:
        while True:
            k = f.readinto(buf)
            if not k:
                return n
            n += k


def open_target(job: dict):
    """What a reader of ``job`` reads through: None for a mount (plain files), an open
    store for the Python API."""
    if job["reader"] == "api":
        from fanstore.api import open_store  # the reader users call

        return open_store(job["root"], cache_mb=job["cache_mb"])
    return None


def read_share(job: dict, store, buf: bytearray) -> dict:
    """A reader's timed share of a pass: files ``slot, slot+step, ...`` of the list."""
    rels, slot, step, root = job["rels"], job["slot"], job["step"], job["root"]
    view = memoryview(buf)
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
                nbytes += read_mount(os.path.join(root, rel), buf)
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
    return {"lat": lat, "bytes": nbytes, "errors": errors, "first_error": first_error,
            "start": start, "end": clock(), "cpu": time.process_time() - cpu0}


# --------------------------------------------------------------------------- the pass


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
    counted (None: none). Raises :class:`PassError` if a reader cannot start, dies or the
    pass takes longer than ``timeout``; files that fail to read are counted in the result
    (``errors``, ``first_error``)."""
    from fanstore.process import cpu_seconds

    rels = list(rels)
    if not rels:
        raise PassError("nothing to read")
    n = max(1, min(int(readers), len(rels)))
    pids = mount_pids(watch) if watch else []
    group = _Readers(time.monotonic() + timeout, timeout)
    finished = False
    try:
        for i in range(n):
            group.start({"reader": target.reader, "root": target.root,
                         "cache_mb": target.cache_mb, "rels": rels, "slot": i, "step": n,
                         "warmup": list(warmup)[i::n]})
        group.collect(READY, "get ready")
        cpu0 = cpu_seconds(pids) if pids else None
        t0 = time.perf_counter()
        group.go()
        order_s = _send_order(target, rels) if target.order_to is not None else None
        got = [json.loads(body) for body in group.collect(RESULT, "finish")]
        cpu1 = cpu_seconds(pids) if pids else None
        finished = True
    finally:
        group.close(abandon=not finished)
    latency = [0.0] * len(rels)
    for slot, r in enumerate(got):
        latency[slot::n] = r["lat"]
    start = min([t0] + [r["start"] for r in got])
    seconds = max(max(r["end"] for r in got) - start, 1e-9)
    return PassResult(
        files=len(rels), bytes=sum(r["bytes"] for r in got), readers=n, seconds=seconds,
        latency=latency, reader_cpu=sum(r["cpu"] for r in got),
        mount_cpu=None if cpu0 is None or cpu1 is None else max(0.0, cpu1 - cpu0),
        errors=sum(r["errors"] for r in got),
        first_error=next((r["first_error"] for r in got if r["first_error"]), None),
        order_seconds=order_s)


class _Readers:
    """The reader processes of a pass (``fanstore.select.epochreader``), each with a pipe
    of its own each way: nothing shared that a dying reader could leave locked, and a
    reader's death is its pipe closing. Every wait ends by ``deadline`` (``timeout`` seconds
    after the pass began)."""

    def __init__(self, deadline: float, timeout: float) -> None:
        self.deadline = deadline
        self.timeout = timeout
        self.procs: list[subprocess.Popen] = []
        self.cmds: list[int] = []
        self.results: list[int] = []

    def start(self, job: dict) -> None:
        from fanstore.process import spawn_piped, write_frame

        proc, cmd_w, res_r = spawn_piped("fanstore.select.epochreader")
        self.procs.append(proc)
        self.cmds.append(cmd_w)
        self.results.append(res_r)
        try:
            write_frame(cmd_w, JOB, json.dumps(job).encode())
        except BrokenPipeError:
            raise PassError(self._gone(len(self.procs) - 1)) from None

    def collect(self, kind: int, what: str) -> list[bytes]:
        """One frame of ``kind`` from every reader, in reader order."""
        from fanstore.process import read_frame

        out = []
        for i, fd in enumerate(self.results):
            left = self.deadline - time.monotonic()
            ready, _, _ = select.select([fd], [], [], max(0.0, left))
            if not ready:
                raise PassError(f"the readers did not {what} in {self.timeout:.0f} s")
            got = read_frame(fd)
            if got is None:
                raise PassError(self._gone(i))
            if got[0] == FAILED:
                raise PassError(f"a reader could not start: "
                                f"{got[1].decode('utf-8', 'replace')}")
            if got[0] != kind:
                raise PassError(f"internal error: reader {i} sent frame {got[0]}")
            out.append(got[1])
        return out

    def go(self) -> None:
        from fanstore.process import write_frame

        for i, fd in enumerate(self.cmds):
            try:
                write_frame(fd, GO)
            except BrokenPipeError:
                raise PassError(self._gone(i)) from None

    def _gone(self, i: int) -> str:
        try:
            code = self.procs[i].wait(timeout=5)
        except subprocess.TimeoutExpired:
            code = None
        how = (f"killed by signal {-code}" if code is not None and code < 0 else
               f"exit status {code}")
        return f"a reader died ({how})"

    def close(self, abandon: bool = False) -> None:
        """End the readers: those that answered exit by themselves; when the pass is
        ``abandon``-ed (a reader failed, hung or the deadline passed) every one is killed
        at once, since a hung one would otherwise cost 5 s, one reader after another."""
        for fd in self.cmds:
            os.close(fd)  # a reader still waiting for the start ends
        if abandon:
            for proc in self.procs:
                proc.kill()
        for proc in self.procs:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for fd in self.results:
            os.close(fd)
        self.procs, self.cmds, self.results = [], [], []


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
