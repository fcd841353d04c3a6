"""An LRU of decoded chunks with a byte budget, safe to share between threads."""

from __future__ import annotations

import threading
from collections import OrderedDict


class ChunkCache:
    """LRU of decoded chunks keyed by chunk id; ``budget`` bytes at most.

    Thread-safe: every operation takes one short lock (uncontended in a single-threaded
    worker). A value larger than the whole budget is not cached. ``hits``/``misses`` count
    the ``get`` calls made with ``count=True`` (readers' requests, not the prefetcher's).
    """

    def __init__(self, budget: int) -> None:
        self.budget = max(0, int(budget))
        self.used = 0
        self.hits = 0
        self.misses = 0
        self._d: OrderedDict[int, bytes] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: int, count: bool = True) -> bytes | None:
        with self._lock:
            v = self._d.get(key)
            if v is None:
                if count:
                    self.misses += 1
                return None
            self._d.move_to_end(key)
            if count:
                self.hits += 1
            return v

    def peek(self, key: int) -> bool:
        return key in self._d

    def put(self, key: int, value: bytes) -> None:
        n = len(value)
        if n > self.budget:
            return
        with self._lock:
            old = self._d.pop(key, None)
            if old is not None:
                self.used -= len(old)
            self._d[key] = value
            self.used += n
            while self.used > self.budget:
                _, v = self._d.popitem(last=False)
                self.used -= len(v)

    def clear(self) -> None:
        with self._lock:
            self._d.clear()
            self.used = 0

    def after_fork(self) -> None:
        """A lock held by another thread at fork time would stay held in the child."""
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._d)
