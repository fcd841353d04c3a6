"""Chunk spill: the rest of a chunk decoded for a partial READ goes into the page cache.

A reader at random offsets of a large file (an LMDB through ``mmap``, HDF5 rows, a
``numpy.memmap``) asks the kernel for a page or a few; each READ that misses the page cache
makes a worker decode the whole chunk (1 MiB by default) around it. Without spill the rest
of that chunk is thrown away (or held in one worker's LRU, where the other workers cannot
use it), so a random pass decoded each chunk dozens of times.

With spill, the worker answers the READ as before and hands the decoded chunk to its spill
thread, which writes the chunk's other pages into the file's page cache
(``FUSE_NOTIFY_STORE``): every later read in that chunk, by any process of the node,
through ``read()`` or a memory map, is a page-cache hit that sends no request at all. A
chunk is decoded once per node while the kernel keeps its pages (the page cache is the
kernel's to reclaim: FanStore holds no second copy).

Rules this follows (:mod:`fanstore.fuse.engine.notify`, "Deadlock hazard"): the store is
written by a thread that serves no requests; it never covers the READ's own range (locked
until the worker replies); it never goes past the file's size; the pages it fills are whole
(the chunk starts on a page boundary and ends on one or at the end of the file). Only a
file's own chunks are spilled, never a solid block shared with other files. The queue is
bounded: when the thread falls behind, an offer is dropped (counted), never waited for.
"""

from __future__ import annotations

import errno
import logging
import threading
from collections import deque

from fanstore.fuse.engine import notify

log = logging.getLogger(__name__)

#: decoded chunks waiting for the spill thread, per worker (1 MiB each by default)
MAX_QUEUED = 16


class ChunkSpill:
    """One worker's spill thread (see the module docstring). ``offer`` is called from the
    worker's request loop and never blocks; ``stats`` (the worker's
    :class:`~fanstore.read.ReadStats`) gets ``spill_chunks``, ``spill_bytes``,
    ``spill_dropped`` and ``spill_refused``."""

    def __init__(self, fd: int, stats, max_queued: int = MAX_QUEUED) -> None:
        self.fd = fd
        self.stats = stats
        self.max_queued = max_queued
        self._queue: deque = deque()
        self._queued: set[tuple[int, int]] = set()
        self._cv = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="fanstore-spill", daemon=True)
        self._thread.start()

    def offer(self, nodeid: int, chunk_offset: int, chunk, read_offset: int,
              read_end: int) -> None:
        """Spill ``chunk`` (decoded, at byte ``chunk_offset`` of the file ``nodeid``) except
        the READ's range [read_offset, read_end), later, on the spill thread."""
        key = (nodeid, chunk_offset)
        with self._cv:
            if key in self._queued:
                return
            if len(self._queue) >= self.max_queued or self._stopping:
                self.stats.spill_dropped += 1
                return
            self._queued.add(key)
            self._queue.append((nodeid, chunk_offset, chunk, read_offset, read_end))
            self._cv.notify()

    def stop(self, timeout: float = 5.0) -> None:
        with self._cv:
            self._stopping = True
            self._queue.clear()
            self._queued.clear()
            self._cv.notify()
        self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._stopping:
                    self._cv.wait()
                if self._stopping:
                    return
                item = self._queue.popleft()
            nodeid, start, chunk, read_offset, read_end = item
            try:
                self._spill(nodeid, start, memoryview(chunk), read_offset, read_end)
            except Exception:  # a spill is an optimisation: log it, keep serving
                log.exception("chunk spill failed")
            finally:
                with self._cv:
                    self._queued.discard((nodeid, start))

    def _spill(self, nodeid: int, start: int, view: memoryview, read_offset: int,
               read_end: int) -> None:
        end = start + len(view)
        pushed = 0
        for lo, hi in ((start, min(read_offset, end)), (max(read_end, start), end)):
            if hi <= lo:
                continue
            err = notify.notify_store(self.fd, nodeid, lo, view[lo - start:hi - start])
            if err:
                if err not in (errno.ENOENT, errno.EBADF, errno.ENODEV):
                    log.debug("spill of node %d at %d: %s", nodeid, lo, errno.errorcode.get(
                        err, err))
                self.stats.spill_refused += 1
                return
            pushed += hi - lo
        if pushed:
            self.stats.spill_chunks += 1
            self.stats.spill_bytes += pushed
