"""A worker's slab of prefetch mode's shared buffer: files the kernel would not take.

The shared window's arena (:class:`fanstore.read.window.SharedWindow`) holds one slab per
worker slot. Its owner, the worker's prefetch thread, keeps there the decoded files whose
push was refused (or that a READ waits for), as a ring of pages: a file takes the next
pages after the last one (wrapping to the start when it would not fit before the end), and
the oldest files are evicted first to make room. Only the owner writes a slab and its
files' BUFFERED state values (page and sequence number, written after the bytes); any
worker answers a READ from it (``SharedWindow.read_buffered``, sequence-checked).
"""

from __future__ import annotations

import collections

from fanstore.fuse.kernelfs.stats import COL
from fanstore.read.window import NONE, PAGE, SERVED, WANTED, SharedWindow

BUFFER_MAX_FILE = 64 << 20  # larger files are never buffered (a READ decodes them)


class Slab:
    """The ring of pages of worker ``slot``'s slab; ``row``: its counters row, ``sizes``:
    the files' sizes (the index's)."""

    def __init__(self, window: SharedWindow, slot: int, row, sizes) -> None:
        self.window = window
        self.row = row
        self.sizes = sizes
        self._view = window.arena_view(slot)
        self._pages = len(self._view) // PAGE
        self._first_page = (slot - 1) * window.slab // PAGE  # in the whole arena
        # the files held, oldest first: (entry, first page, pages, the state value written)
        self._fifo: collections.deque[tuple[int, int, int, int]] = collections.deque()
        self._head = 0  # next free page (the ring's write position)
        self._used = 0  # pages held
        self._seq = 0

    def put(self, entry: int, data) -> bool:
        """Keep a decoded file (BUFFERED from now on); False if it does not fit."""
        n = len(data)
        pages = (n + PAGE - 1) // PAGE or 1
        if n > BUFFER_MAX_FILE or pages > self._pages:
            return False
        if self._head + pages > self._pages:
            self._free_until_wrap()
        while self._used and self._overlaps(self._head, pages):
            self._evict_oldest()
        start = self._head
        self._view[start * PAGE:start * PAGE + n] = data
        self._seq += 1
        value = SharedWindow.buffered_value(self._first_page + start, self._seq)
        w = self.window
        w.marks[entry] &= ~(SERVED | WANTED) & 0xFF
        w.state[entry] = value
        self._fifo.append((entry, start, pages, value))
        self._head = start + pages
        self._used += pages
        self.row[COL["prefetch_buffered"]] += 1
        self.row[COL["prefetch_buffer_bytes"]] = self._used * PAGE
        return True

    def _overlaps(self, start: int, pages: int) -> bool:
        if not self._fifo:
            return False
        _e, first, n, _v = self._fifo[0]
        return first < start + pages and start < first + n

    def _free_until_wrap(self) -> None:
        """The ring wraps: drop what lies between the head and the slab's end."""
        while self._fifo and self._fifo[0][1] >= self._head:
            self._evict_oldest()
        self._head = 0

    def _evict_oldest(self) -> None:
        entry, _first, pages, value = self._fifo.popleft()
        state = self.window.state
        if int(state[entry]) == value:
            state[entry] = NONE
        if not self.window.marks[entry] & SERVED:
            self.row[COL["prefetch_bytes_evicted_unused"]] += int(self.sizes[entry])
        self._used -= pages
        self.row[COL["prefetch_buffer_bytes"]] = self._used * PAGE
