"""Prefetch mode: fetch and decode files ahead of the reader, in the order it will read them.

Training reads files in an order known before the epoch starts (the sampler's
permutation). Given that order (``set_order``), the prefetcher keeps fetching (locally or
from peers) and decoding the files the reader will want next, several at a time and out of
order, into a buffer of at most ``budget`` bytes. A READ of a buffered file is served from
memory (a *hit*); a READ that finds its file still being fetched waits for that fetch (a
*late* hit); a READ of a file of the order that was not started yet is a *miss*.

The reader's position is the furthest order index read so far. Files more than ``lag``
places behind it that were never read are dropped when the buffer is full or a new order
arrives, and counted as ``prefetch_bytes_evicted_unused``. Several DataLoader workers read
an order slightly out of sequence; the lag keeps their files.

Without an order, prefetch mode reads ahead within directories: the first READ of a file
schedules the files after it in the same directory (name order).

Everything here runs on the trio loop; fetching and decoding go through
``ChunkStore.get_chunks`` (worker threads, one fetch per chunk at a time).
"""

from __future__ import annotations

import logging
from collections import OrderedDict, deque

import trio

from fanstore.errors import FanStoreError
from fanstore.format.index import KIND_FILE

log = logging.getLogger(__name__)


class Prefetcher:
    def __init__(self, store, budget: int, inflight: int = 8, lag: int = 256,
                 directory_ahead: int = 16) -> None:
        self.store = store
        self.ns = store.ns
        self.stats = store.stats
        self.budget = budget
        self.inflight_max = max(1, inflight)
        self.lag = lag
        self.directory_ahead = directory_ahead
        # entry -> (order index, decoded chunks); insertion order = completion order
        self.buffer: OrderedDict[int, tuple[int, list[bytes]]] = OrderedDict()
        self.used = 0  # bytes in the buffer
        self.reserved = 0  # bytes of fetches in flight
        self.inflight: dict[int, int] = {}  # entry -> order index
        self.order: list[int] = []
        self.positions: dict[int, deque[int]] = {}
        self.next_i = 0
        self.consumed = 0
        self.generation = 0
        self._wake = trio.Event()
        self._nursery: trio.Nursery | None = None
        s = self.stats.extra
        s.setdefault("prefetch_hits", 0)
        s.setdefault("prefetch_late", 0)
        s.setdefault("prefetch_misses", 0)
        s.setdefault("prefetch_files", 0)
        s.setdefault("prefetch_bytes_evicted_unused", 0)
        s["prefetch_buffer_bytes"] = lambda: self.used
        s["prefetch_budget"] = budget
        s["prefetch_order_length"] = lambda: len(self.order)
        s["prefetch_position"] = lambda: self.consumed

    def _count(self, key: str, n: int = 1) -> None:
        self.stats.extra[key] += n

    # ------------------------------------------------------------------ the order
    def set_order(self, entries: list[int]) -> None:
        """Replace the access order (a new epoch). Unread buffered files are dropped."""
        self.generation += 1
        self._evict(lambda idx: True)
        self.order = [e for e in entries if self.ns.kind(e) == KIND_FILE]
        self.positions = {}
        for i, e in enumerate(self.order):
            self.positions.setdefault(e, deque()).append(i)
        self.next_i = 0
        self.consumed = 0
        log.info("prefetch order of %d files", len(self.order))
        self._wake.set()

    # ------------------------------------------------------------------ reads
    def take(self, entry: int) -> list[bytes] | None:
        """A READ (or an API fetch) of ``entry``: its decoded chunks if buffered, else None.

        Also moves the reader's position forward.
        """
        pos = self.positions.get(entry)
        in_order = bool(pos)  # a read of a file the order still expects
        if pos:
            idx = pos.popleft()
            if idx + 1 > self.consumed:
                self.consumed = idx + 1
                self._wake.set()
        got = self.buffer.pop(entry, None)
        if got is not None:
            _idx, chunks = got
            self.used -= sum(len(c) for c in chunks)
            self._count("prefetch_hits")
            self._wake.set()
            return chunks
        if entry in self.inflight:
            self._count("prefetch_late")
        elif in_order:
            self._count("prefetch_misses")
        if not self.order:
            self._ahead_in_directory(entry)
        return None

    def _ahead_in_directory(self, entry: int) -> None:
        parent = self.ns.parent(entry)
        children = self.ns.children(parent)
        start = entry - children.start + 1
        added = 0
        for e in children[start:]:
            if added >= self.directory_ahead:
                break
            if self.ns.kind(e) != KIND_FILE or e in self.buffer or e in self.inflight:
                continue
            if not self._start(e, -1):
                break
            added += 1

    # ------------------------------------------------------------------ the scheduler
    async def run(self, task_status=trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            task_status.started()
            while True:
                await self._wake.wait()
                self._wake = trio.Event()
                self._schedule()

    def _schedule(self) -> None:
        while self.next_i < len(self.order) and len(self.inflight) < self.inflight_max:
            entry = self.order[self.next_i]
            if self.next_i < self.consumed or entry in self.buffer or entry in self.inflight:
                self.next_i += 1
                continue
            size = self.ns.size(entry)
            if size > self.budget:
                self.next_i += 1  # bigger than the whole buffer: leave it to the reads
                continue
            if self.used + self.reserved + size > self.budget:
                # Make room from files the reader has passed by and never read.
                self._evict(lambda idx: idx < self.consumed - self.lag)
                if self.used + self.reserved + size > self.budget:
                    return  # full: wait for reads to consume
            self._start(entry, self.next_i)
            self.next_i += 1

    def _start(self, entry: int, idx: int) -> bool:
        size = self.ns.size(entry)
        if self._nursery is None or size == 0:
            return False
        if self.used + self.reserved + size > self.budget:
            if idx < 0:
                self._evict(lambda i: i < 0, oldest_only=True)
            if self.used + self.reserved + size > self.budget:
                return False
        self.inflight[entry] = idx
        self.reserved += size
        self._count("prefetch_files")
        self._nursery.start_soon(self._fetch, entry, idx, size, self.generation)
        return True

    async def _fetch(self, entry: int, idx: int, size: int, generation: int) -> None:
        first, count = self.ns.chunks(entry)
        try:
            chunks = await self.store.get_chunks(entry, first, first + count, counted=False,
                                                 keep=False)
        except FanStoreError:
            chunks = None  # the read that follows fetches again and reports the error
        finally:
            self.inflight.pop(entry, None)
            self.reserved -= size
        self._wake.set()
        if chunks is None or generation != self.generation or entry in self.buffer:
            return
        if idx >= 0 and idx not in self.positions.get(entry, ()):
            return  # the reader got there first (it waited for this very fetch)
        self.buffer[entry] = (idx, chunks)
        self.used += sum(len(c) for c in chunks)

    def _evict(self, pred, oldest_only: bool = False) -> None:
        for entry in list(self.buffer):
            idx, chunks = self.buffer[entry]
            if pred(idx):
                del self.buffer[entry]
                n = sum(len(c) for c in chunks)
                self.used -= n
                self._count("prefetch_bytes_evicted_unused", n)
                if oldest_only:
                    return
