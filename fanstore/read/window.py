"""The prefetch window shared by one node's kernel-frontend workers, and the orders it follows.

Prefetch mode (:mod:`fanstore.fuse.kernelfs.orders`) runs a prefetch thread in every worker
process of the mount. They coordinate through two anonymous shared-memory files made by the
frontend process before it starts its workers (``memfd_create``: no name anyone could open;
forked workers inherit them, worker ranks receive them with their /dev/fuse descriptor):

*state* (:class:`SharedWindow`)::

    header   64 bytes   magic "FSWINDOW", version, entries, clients, slots, arena and slab size
    ctl      u64[512]   window (bytes) [0], its ceiling [1] and floor [2]; per client c:
                        generation [GEN+c], readers' position [POS+c] = (gen16 << 32) | (i+1)
    pos_of   u64[n]     where an entry is in an order: (client+1) << 48 | gen16 << 32 | index
    state    u64[n]     NONE | INFLIGHT (being decoded) | PUSHING | PUSHED | BUFFERED (+ slab
                        page and a sequence) | READING (a reader got to it first: leave it)
    marks    u8[n]      SERVED: a READ was answered from the buffer (counts "evicted
                        unused"); LISTED (directories): listed through the mount this epoch;
                        READ_AT_0: a READ of the file's start reached a worker; WANTED: a
                        READ waits for the file being decoded (buffer it, do not push)

*arena*: ``--prefetch-mb`` (less what the threads may hold in flight) split in one slab per
worker slot. Only the slab's owner writes it (through its mapping, so its pages count in
that process's RSS); any worker reads a buffered file with ``pread`` under a sequence check
(:meth:`SharedWindow.read_buffered`).

Concurrency rules (every writer is a different process; nothing here takes a lock):

- ``ctl`` words and ``pos_of`` are hints (where readers are); a lost or stale update only
  changes what is prefetched when, never which bytes a reader gets.
- ``state`` is written blindly with NONE, INFLIGHT, PUSHED, READING by anyone, but a BUFFERED
  value only by the slab's owner, right after it wrote the bytes, and cleared by the owner
  (if still its value) before the space is reused. A reader copies a buffered file, then
  checks that ``state`` still holds the value it started from: each value carries a
  sequence number, so the copy is served only if the space was not reused meanwhile.

*order* files (made by the node daemon, one per ``prefetch`` request, sent to the frontend
process and on to every worker as a descriptor): a header (magic "FSORDER1", client slot,
generation, length n), the entries ``u32[n]``, and ``u64[n+1]`` cumulative sizes (bytes
before the i-th file of the order). Worker slot s of K takes the indices i with i % K == s-1.
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass

import numpy as np

from fanstore.errors import MountError

PAGE = 4096
CLIENTS = 64  # orders of this many training processes at once (the oldest one is dropped)

# ctl words
WINDOW, WINDOW_MAX, WINDOW_MIN = 0, 1, 2
ORDERS = 3  # orders the workers have received (0: directory read-ahead may run)
GEN = 64  # GEN + client: the client's current order generation (low 16 bits compared)
POS = GEN + CLIENTS  # POS + client: (gen16 << 32) | (furthest index read + 1)
CTL_WORDS = 512

# state values
NONE, INFLIGHT, PUSHED, BUFFERED, READING, PUSHING = 0, 1, 2, 3, 4, 5
# marks bits
SERVED, LISTED, READ_AT_0, WANTED = 1, 2, 4, 8
_KIND = 7
_PAGE_SHIFT, _PAGE_BITS = 8, 32
_SEQ_SHIFT = 40

_HEADER = struct.Struct("=8sIIQIIQQ")  # magic version clients n_entries slots pad arena slab
_MAGIC = b"FSWINDOW"
_VERSION = 1

ORDER_HEADER = struct.Struct("=8sIIIIQ")  # magic version client generation pad n
ORDER_MAGIC = b"FSORDER1"
ORDER_DATA = 64  # where the entries start


def kind(value: int) -> int:
    return value & _KIND


def _align(n: int, a: int = PAGE) -> int:
    return (n + a - 1) // a * a


class SharedWindow:
    """The shared state of one mount's prefetch window (see the module docstring).

    Attributes: ``ctl``, ``pos_of``, ``state`` (u64 arrays), ``marks`` (u8), ``n``
    (entries), ``slots`` (worker slots), ``slab`` (bytes per slot), ``state_fd`` and
    ``arena_fd`` (the two memfds).
    """

    def __init__(self, state_fd: int, arena_fd: int = -1) -> None:
        self.state_fd = state_fd
        self.arena_fd = arena_fd
        head = os.pread(state_fd, _HEADER.size, 0)
        if len(head) != _HEADER.size:
            raise MountError("the prefetch window's shared memory is too short")
        magic, version, clients, n, slots, _pad, arena, slab = _HEADER.unpack(head)
        if magic != _MAGIC or version != _VERSION or clients != CLIENTS:
            raise MountError("not a prefetch window (magic or version)")
        self.n, self.slots, self.arena_bytes, self.slab = int(n), int(slots), int(arena), \
            int(slab)
        size = os.fstat(state_fd).st_size
        self._mm = mmap.mmap(state_fd, size, flags=mmap.MAP_SHARED)
        off = PAGE
        self.ctl = np.frombuffer(self._mm, np.uint64, CTL_WORDS, off)
        off += _align(CTL_WORDS * 8)
        self.pos_of = np.frombuffer(self._mm, np.uint64, self.n, off)
        off += _align(self.n * 8)
        self.state = np.frombuffer(self._mm, np.uint64, self.n, off)
        off += _align(self.n * 8)
        self.marks = np.frombuffer(self._mm, np.uint8, self.n, off)
        self._arena_mm: mmap.mmap | None = None

    @classmethod
    def create(cls, n_entries: int, slots: int, arena_bytes: int) -> SharedWindow:
        """Two new memfds sized for ``n_entries`` and ``slots`` slabs of the arena
        (sparse: pages exist once written)."""
        slab = max(PAGE, arena_bytes // max(1, slots) // PAGE * PAGE)
        size = PAGE + _align(CTL_WORDS * 8) + 2 * _align(n_entries * 8) + _align(n_entries)
        state_fd = os.memfd_create("fanstore-window", os.MFD_CLOEXEC)
        arena_fd = os.memfd_create("fanstore-prefetch-buffer", os.MFD_CLOEXEC)
        try:
            os.ftruncate(state_fd, size)
            os.ftruncate(arena_fd, slab * slots)
            os.pwrite(state_fd, _HEADER.pack(_MAGIC, _VERSION, CLIENTS, n_entries, slots, 0,
                                             slab * slots, slab), 0)
        except OSError:
            os.close(state_fd)
            os.close(arena_fd)
            raise
        return cls(state_fd, arena_fd)

    def close(self) -> None:
        for name in ("ctl", "pos_of", "state", "marks"):
            setattr(self, name, None)
        for mm in (self._arena_mm, self._mm):
            if mm is not None:
                try:
                    mm.close()
                except BufferError:
                    pass

    # ------------------------------------------------------------------ the window
    def set_bounds(self, floor: int, ceiling: int) -> None:
        """The window may shrink to ``floor`` and grow to ``ceiling`` bytes; a window not
        set yet (or above the new ceiling) starts at the ceiling."""
        ctl = self.ctl
        ceiling = max(floor, ceiling)
        ctl[WINDOW_MIN] = floor
        ctl[WINDOW_MAX] = ceiling
        if int(ctl[WINDOW]) == 0 or int(ctl[WINDOW]) > ceiling:
            ctl[WINDOW] = ceiling

    def scale_window(self, factor: float) -> None:
        ctl = self.ctl
        w = int(int(ctl[WINDOW]) * factor)
        ctl[WINDOW] = max(int(ctl[WINDOW_MIN]), min(int(ctl[WINDOW_MAX]), w))

    # ------------------------------------------------------------------ positions
    def mark_order(self, client: int, generation: int, entries: np.ndarray,
                   indices: np.ndarray) -> None:
        """Record where ``entries`` stand in ``client``'s order (a worker, for its
        stripe) and forget that they were pushed (a new epoch pushes them again)."""
        code = ((client + 1) << 48) | ((generation & 0xFFFF) << 32)
        self.pos_of[entries] = np.uint64(code) | indices.astype(np.uint64)
        k = self.state[entries] & np.uint64(_KIND)
        done = entries[(k == PUSHED) | (k == READING)]
        self.state[done] = NONE  # only NONE is written: never a stale BUFFERED value

    def begin_order(self, client: int, generation: int) -> None:
        self.ctl[GEN + client] = generation & 0xFFFF
        cur = int(self.ctl[POS + client])
        if cur >> 32 != generation & 0xFFFF:
            self.ctl[POS + client] = (generation & 0xFFFF) << 32

    def seen(self, entry: int) -> int:
        """A reader is at ``entry``: move its client's position on. Returns the order
        index + 1 of the entry in a current order, or 0 if no current order has it."""
        p = int(self.pos_of[entry])
        if not p:
            return 0
        client = (p >> 48) - 1
        gen = (p >> 32) & 0xFFFF
        ctl = self.ctl
        if int(ctl[GEN + client]) != gen:
            return 0
        i = (p & 0xFFFFFFFF) + 1
        cur = int(ctl[POS + client])
        if cur >> 32 != gen or i > (cur & 0xFFFFFFFF):
            ctl[POS + client] = (gen << 32) | i
        return i

    def position(self, client: int, generation: int) -> int:
        """How many files of ``client``'s order (generation) the readers have passed."""
        cur = int(self.ctl[POS + client])
        return cur & 0xFFFFFFFF if cur >> 32 == generation & 0xFFFF else 0

    # ------------------------------------------------------------------ the buffer
    def arena_view(self, slot: int) -> memoryview:
        """The writable slab of worker ``slot`` (1..slots): only its owner maps it."""
        if self._arena_mm is None:
            self._arena_mm = mmap.mmap(self.arena_fd, self.slab * self.slots,
                                       flags=mmap.MAP_SHARED)
        start = (slot - 1) * self.slab
        return memoryview(self._arena_mm)[start:start + self.slab]

    @staticmethod
    def buffered_value(page: int, seq: int) -> int:
        return BUFFERED | (page << _PAGE_SHIFT) | ((seq & 0xFFFFFF) << _SEQ_SHIFT)

    def read_buffered(self, entry: int, offset: int, size: int, file_size: int) -> bytes | None:
        """Bytes of a buffered file, or None if it is not buffered (or its space was
        reused while we copied)."""
        v = int(self.state[entry])
        if v & _KIND != BUFFERED:
            return None
        page = (v >> _PAGE_SHIFT) & ((1 << _PAGE_BITS) - 1)
        size = max(0, min(size, file_size - offset))
        data = os.pread(self.arena_fd, size, page * PAGE + offset) if size else b""
        if int(self.state[entry]) != v or len(data) != size:
            return None
        self.marks[entry] |= SERVED
        return data

    def forget_listings(self) -> None:
        """A new epoch: the kernel may have dropped what earlier listings gave it."""
        self.marks &= np.uint8(0xFF ^ LISTED)


@dataclass
class Order:
    """One order file, as a worker sees it: its stripe of the order."""

    client: int
    generation: int
    length: int
    entries: np.ndarray  # u32: this worker's entries, in order
    indices: np.ndarray  # u32: their places in the order
    before: np.ndarray  # u64: bytes of the order before each of them
    after: np.ndarray  # u64: ... and up to their end


def write_order(client: int, generation: int, entries: np.ndarray, sizes: np.ndarray) -> int:
    """A new memfd holding an order (entries and their sizes); returns its descriptor."""
    n = len(entries)
    cum = np.zeros(n + 1, np.uint64)
    np.cumsum(sizes.astype(np.uint64), out=cum[1:])
    fd = os.memfd_create("fanstore-order", os.MFD_CLOEXEC)
    try:
        head = ORDER_HEADER.pack(ORDER_MAGIC, 1, client, generation & 0xFFFFFFFF, 0, n)
        body = entries.astype(np.uint32).tobytes()
        pad = b"\0" * (_align(ORDER_DATA + len(body), 8) - ORDER_DATA - len(body))
        data = [head.ljust(ORDER_DATA, b"\0"), body, pad, cum.tobytes()]
        total = sum(len(d) for d in data)
        if os.writev(fd, data) != total:
            raise OSError("short write of a prefetch order")
    except OSError:
        os.close(fd)
        raise
    return fd


def read_order(fd: int, slot: int, slots: int, n_entries: int) -> Order:
    """The stripe of worker ``slot`` (1..slots) of the order in ``fd``."""
    size = os.fstat(fd).st_size
    head = os.pread(fd, ORDER_HEADER.size, 0)
    if len(head) != ORDER_HEADER.size:
        raise ValueError("a prefetch order shorter than its header")
    magic, version, client, generation, _pad, n = ORDER_HEADER.unpack(head)
    body = _align(ORDER_DATA + 4 * n, 8)
    if magic != ORDER_MAGIC or version != 1 or client >= CLIENTS \
            or size < body + 8 * (n + 1):
        raise ValueError("not a prefetch order (magic, version, client or size)")
    mm = mmap.mmap(fd, size, prot=mmap.PROT_READ)
    try:
        all_entries = np.frombuffer(mm, np.uint32, n, ORDER_DATA)
        cum = np.frombuffer(mm, np.uint64, n + 1, body)
        start = slot - 1
        entries = all_entries[start::slots].copy()
        indices = np.arange(start, n, slots, dtype=np.uint32)
        before = cum[start:n:slots].copy()
        after = cum[start + 1:n + 1:slots].copy()
        del all_entries, cum
    finally:
        mm.close()
    if len(entries) and int(entries.max()) >= n_entries:
        raise ValueError("a prefetch order names entries the store does not have")
    return Order(int(client), int(generation), int(n), entries, indices, before, after)
