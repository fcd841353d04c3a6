"""Prefetch mode: fetch and decode files ahead of the readers, in the order they will read.

Training reads files in an order known before the epoch starts (the sampler's
permutation). Each training process on the node (one per GPU, say) hands the daemon its
order for the epoch (``set_order(entries, client)``); the prefetcher keeps fetching
(locally or from peers) and decoding the files those readers will want next, several at a
time and out of order, into a buffer of at most ``budget`` bytes shared by all of them,
taking from the clients' orders in turn. A READ of a buffered file is served from memory
(a *hit*); a READ that finds its file still being fetched waits for that fetch (*late*); a
READ of a file an order still expects but that was not started yet is a *miss*.

Each client's position is the furthest index of its order read so far. Files more than
``lag`` places behind it that were never read are dropped when the buffer is full or the
client sends a new order, and counted as ``prefetch_bytes_evicted_unused``. (DataLoader
workers read an order slightly out of sequence; the lag keeps their files.)

Without any order, prefetch mode reads ahead within directories: the first READ of a file
schedules the files after it in the same directory (name order).

Everything here runs on the trio loop; fetching and decoding go through
``ChunkStore.get_chunks`` (worker threads, one fetch per chunk at a time).
"""

from __future__ import annotations

import heapq
import logging
from collections import OrderedDict, deque
from dataclasses import dataclass, field

import trio

from fanstore.errors import FanStoreError
from fanstore.format.index import KIND_FILE

log = logging.getLogger(__name__)

NO_ORDER = ""  # the client of directory read-ahead


@dataclass
class _Stream:
    """One client's order for the epoch."""

    order: list[int]
    positions: dict[int, deque] = field(default_factory=dict)  # entry -> unread indices
    next_i: int = 0  # next index to consider starting
    consumed: int = 0  # 1 + the furthest index read
    generation: int = 0
    buffered: list = field(default_factory=list)  # heap of (index, entry) in the buffer


class Prefetcher:
    def __init__(self, store, budget: int, inflight: int = 8, lag: int = 256,
                 directory_ahead: int = 16, max_clients: int = 64) -> None:
        self.store = store
        self.ns = store.ns
        self.stats = store.stats
        self.budget = budget
        self.inflight_max = max(1, inflight)
        self.lag = lag
        self.directory_ahead = directory_ahead
        self.max_clients = max_clients
        self.streams: OrderedDict[str, _Stream] = OrderedDict()
        # entry -> (client, order index, decoded chunks); insertion order = completion order
        self.buffer: OrderedDict[int, tuple[str, int, list[bytes]]] = OrderedDict()
        self.used = 0  # bytes in the buffer
        self.reserved = 0  # bytes of fetches in flight
        self.inflight: dict[int, tuple[str, int]] = {}
        self._generation = 0
        self._turn = 0
        self._wake = trio.Event()
        self._nursery: trio.Nursery | None = None
        s = self.stats.extra
        for key in ("prefetch_hits", "prefetch_late", "prefetch_misses", "prefetch_files",
                    "prefetch_bytes_evicted_unused"):
            s.setdefault(key, 0)
        s["prefetch_buffer_bytes"] = lambda: self.used
        s["prefetch_budget"] = budget
        s["prefetch_clients"] = lambda: len(self.streams)
        s["prefetch_order_length"] = lambda: sum(len(x.order) for x in self.streams.values())
        s["prefetch_position"] = lambda: sum(x.consumed for x in self.streams.values())

    @property
    def order(self) -> bool:
        """True while some client has an order."""
        return any(x.order for x in self.streams.values())

    def _count(self, key: str, n: int = 1) -> None:
        self.stats.extra[key] += n

    # ------------------------------------------------------------------ orders
    def set_order(self, entries: list[int], client: str = "default") -> int:
        """Replace ``client``'s access order (a new epoch); its unread files are dropped."""
        self._generation += 1
        self._evict(lambda c, idx: c == client)
        order = [e for e in entries if self.ns.kind(e) == KIND_FILE]
        stream = _Stream(order, generation=self._generation)
        for i, e in enumerate(order):
            stream.positions.setdefault(e, deque()).append(i)
        self.streams.pop(client, None)
        self.streams[client] = stream
        while len(self.streams) > self.max_clients:  # forget the oldest client
            old, _ = self.streams.popitem(last=False)
            self._evict(lambda c, idx, old=old: c == old)
        log.info("prefetch order of %d files from %s", len(order), client or "a reader")
        self._wake.set()
        return len(order)

    # ------------------------------------------------------------------ reads
    def take(self, entry: int) -> list[bytes] | None:
        """A READ (or an API fetch) of ``entry``: its decoded chunks if buffered, else None.

        Also moves forward the position of every client whose order expects the file.
        """
        expected = False
        for stream in self.streams.values():
            pos = stream.positions.get(entry)
            if pos:
                expected = True
                idx = pos.popleft()
                if idx + 1 > stream.consumed:
                    stream.consumed = idx + 1
                    self._wake.set()
        got = self.buffer.pop(entry, None)
        if got is not None:
            self.used -= sum(len(c) for c in got[2])
            self._count("prefetch_hits")
            self._wake.set()
            return got[2]
        if entry in self.inflight:
            self._count("prefetch_late")
        elif expected:
            self._count("prefetch_misses")
        if not self.order:
            self._ahead_in_directory(entry)
        return None

    def _ahead_in_directory(self, entry: int) -> None:
        children = self.ns.children(self.ns.parent(entry))
        added = 0
        for e in children[entry - children.start + 1:]:
            if added >= self.directory_ahead:
                break
            if self.ns.kind(e) != KIND_FILE or e in self.buffer or e in self.inflight:
                continue
            if not self._start(e, NO_ORDER, -1, 0):
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
        """Start fetches, taking the next file of each client's order in turn."""
        while len(self.inflight) < self.inflight_max:
            clients = [c for c, s in self.streams.items() if s.next_i < len(s.order)]
            if not clients:
                return
            started = False
            for k in range(len(clients)):
                client = clients[(self._turn + k) % len(clients)]
                if self._advance(client, self.streams[client]):
                    self._turn = (self._turn + k + 1) % max(1, len(clients))
                    started = True
                    break
            if not started:
                return  # every order is waiting for room in the buffer

    def _advance(self, client: str, s: _Stream) -> bool:
        """Start the next file of one order; False if the buffer has no room for it."""
        while s.next_i < len(s.order):
            i = s.next_i
            entry = s.order[i]
            size = self.ns.size(entry)
            if (i < s.consumed or entry in self.buffer or entry in self.inflight
                    or size > self.budget or size == 0):
                s.next_i += 1  # read already, on its way, or too big for the buffer
                continue
            if self.used + self.reserved + size > self.budget:
                self._evict_passed()  # make room from files readers passed and never read
                if self.used + self.reserved + size > self.budget:
                    return False
            s.next_i += 1
            return self._start(entry, client, i, s.generation)
        return False

    def _start(self, entry: int, client: str, idx: int, generation: int) -> bool:
        size = self.ns.size(entry)
        if self._nursery is None or size == 0:
            return False
        if self.used + self.reserved + size > self.budget:
            if client == NO_ORDER:  # directory read-ahead recycles its own oldest files
                self._evict(lambda c, i: c == NO_ORDER, oldest_only=True)
            if self.used + self.reserved + size > self.budget:
                return False
        self.inflight[entry] = (client, idx)
        self.reserved += size
        self._count("prefetch_files")
        self._nursery.start_soon(self._fetch, entry, client, idx, size, generation)
        return True

    async def _fetch(self, entry: int, client: str, idx: int, size: int,
                     generation: int) -> None:
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
        if chunks is None or entry in self.buffer:
            return
        if client != NO_ORDER:
            stream = self.streams.get(client)
            if stream is None or stream.generation != generation:
                return  # that order was replaced meanwhile
            if idx not in stream.positions.get(entry, ()):
                return  # the reader got there first (it waited for this very fetch)
            heapq.heappush(stream.buffered, (idx, entry))
        self.buffer[entry] = (client, idx, chunks)
        self.used += sum(len(c) for c in chunks)

    def _evict_passed(self) -> None:
        """Drop buffered files that their reader has passed by more than ``lag`` places.

        Each client keeps a heap of its buffered (index, entry): only the files that are
        actually evictable are looked at, so a full buffer costs nothing per read.
        """
        for stream in self.streams.values():
            limit = stream.consumed - self.lag
            heap = stream.buffered
            while heap and heap[0][0] < limit:
                idx, entry = heapq.heappop(heap)
                got = self.buffer.get(entry)
                if got is not None and got[1] == idx:
                    del self.buffer[entry]
                    n = sum(len(c) for c in got[2])
                    self.used -= n
                    self._count("prefetch_bytes_evicted_unused", n)

    def _evict(self, pred, oldest_only: bool = False) -> None:
        for entry in list(self.buffer):
            client, idx, chunks = self.buffer[entry]
            if pred(client, idx):
                del self.buffer[entry]
                n = sum(len(c) for c in chunks)
                self.used -= n
                self._count("prefetch_bytes_evicted_unused", n)
                if oldest_only:
                    return
