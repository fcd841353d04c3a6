"""Decoded chunks shared by one node's reader processes: a few recent ones per process.

The kernel frontend's workers each decode the chunks of the READs they get. For a file read
at random offsets, the first READ in a chunk makes one worker decode it and spill the rest
into the page cache (:mod:`fanstore.fuse.kernelfs.spill`); a READ for another page of that
chunk that reaches a different worker before the spill has landed (an LMDB get faults a leaf
page and then its overflow pages, back to back) used to decode the chunk a second time. With
this table that worker copies the chunk the first one decoded instead.

Layout: two anonymous shared-memory files made before the workers start
(``memfd_create``: no name anyone could open; forked workers inherit them, worker ranks
receive them with their /dev/fuse descriptor):

- *table*: ``u64[slots, 3]``: per slot a sequence number (odd while its owner writes), the
  chunk number + 1 (0: empty), and the chunk's length;
- *arena*: ``slots`` x ``chunk_size`` bytes. Worker ``w`` (1..K) owns slots
  ``(w-1)*per_worker .. w*per_worker-1`` and reuses them round robin.

A worker that is about to decode a chunk claims a slot for it first (odd sequence number,
the chunk's number); another worker that wants the same chunk meanwhile waits for it, up to
:data:`WAIT`, instead of decoding it too. Only a slot's owner writes it. A reader copies a slot's bytes and keeps them only if the
sequence number is even and the same before and after the copy, and, whatever the memory
model of the machine, only if the copy passes the chunk's XXH3 checksum from the index:
what a reader gets from here is exactly what decoding would have given, or nothing.
"""

from __future__ import annotations

import mmap
import os
import time

import numpy as np
import xxhash

from fanstore.errors import MountError

#: shared bytes per process at most (slots of one chunk each, at least one slot)
BYTES_PER_PROCESS = 8 << 20
#: how long a reader waits for a chunk another process is decoding before decoding it too
#: (a 1 MiB chunk decodes in ~1-2 ms; a waiter never waits for a slow remote fetch long)
WAIT = 0.003


class SharedChunks:
    """One process's view of the node's shared chunk table (see the module docstring)."""

    def __init__(self, table_fd: int, arena_fd: int, slot: int = 0) -> None:
        try:
            size = os.fstat(table_fd).st_size
            self._table_map = mmap.mmap(table_fd, size)
            head = np.frombuffer(self._table_map, dtype=np.uint64, count=3)
            self.slots, self.per_worker, self.chunk_size = (int(x) for x in head)
            self.table = np.frombuffer(self._table_map, dtype=np.uint64, offset=24,
                                       count=self.slots * 3).reshape(self.slots, 3)
            self._arena_map = mmap.mmap(arena_fd, self.slots * self.chunk_size)
        except (OSError, ValueError) as exc:
            raise MountError(f"shared chunk table: {exc}") from exc
        self.table_fd, self.arena_fd = table_fd, arena_fd
        self.arena = memoryview(self._arena_map)
        self.worker = 0
        self._next = 0
        if slot:
            self.set_worker(slot)

    @classmethod
    def create(cls, workers: int, chunk_size: int) -> SharedChunks:
        """The table and arena for ``workers`` processes (slots 1..workers)."""
        per_worker = max(1, BYTES_PER_PROCESS // max(1, chunk_size))
        slots = per_worker * workers
        table_fd = os.memfd_create("fanstore-chunks", os.MFD_CLOEXEC)
        arena_fd = os.memfd_create("fanstore-chunk-arena", os.MFD_CLOEXEC)
        try:
            os.ftruncate(table_fd, 24 + slots * 24)
            os.ftruncate(arena_fd, slots * chunk_size)
            os.pwrite(table_fd, np.array([slots, per_worker, chunk_size],
                                         dtype=np.uint64).tobytes(), 0)
            return cls(table_fd, arena_fd)
        except (OSError, MountError):  # as SharedWindow.create: no descriptor left open
            os.close(table_fd)
            os.close(arena_fd)
            raise

    def set_worker(self, slot: int) -> None:
        """This process writes the slots of worker ``slot`` (1..K)."""
        if not 1 <= slot <= self.slots // self.per_worker:
            raise MountError(f"shared chunk table: no worker slot {slot}")
        self.worker = slot

    def close(self) -> None:
        self.arena.release()
        self.table = None  # type: ignore[assignment]
        for m in (self._arena_map, self._table_map):
            try:
                m.close()
            except BufferError:  # a view still out: the mapping goes with the process
                pass

    def claim(self, chunk: int) -> int | None:
        """Say that this worker is decoding ``chunk`` (others wait for it a little, rather
        than decode it too): this worker's next slot, odd until :meth:`fill` or
        :meth:`abandon`. None if this process has no slots."""
        if not self.worker:
            return None
        row = (self.worker - 1) * self.per_worker + self._next
        self._next = (self._next + 1) % self.per_worker
        t = self.table
        t[row, 0] += 1  # odd: being written
        t[row, 1] = chunk + 1
        t[row, 2] = 0
        return row

    def fill(self, row: int, data) -> None:
        """Publish the decoded chunk of a :meth:`claim`."""
        if len(data) > self.chunk_size:
            self.abandon(row)
            return
        start = row * self.chunk_size
        self.arena[start:start + len(data)] = data
        self.table[row, 2] = len(data)
        self.table[row, 0] += 1  # even: readable

    def abandon(self, row: int) -> None:
        """A :meth:`claim` that will not be filled (the decode failed)."""
        self.table[row, 1] = 0
        self.table[row, 0] += 1

    def put(self, chunk: int, data) -> None:
        """Publish decoded ``chunk`` in this worker's next slot (only its owner writes it)."""
        row = self.claim(chunk)
        if row is not None:
            self.fill(row, data)

    def get(self, chunk: int, checksum: int, wait: float = 0.0) -> bytes | None:
        """A copy of ``chunk`` if some process published it and it is still there, whole
        and matching ``checksum`` (the XXH3-64 of its decoded bytes); else None. While
        another process is decoding it (claimed), wait up to ``wait`` seconds for it."""
        deadline = None
        while True:
            pending = False
            t = self.table
            for row in np.flatnonzero(t[:, 1] == chunk + 1):
                seq = int(t[row, 0])
                if seq & 1:
                    pending = True
                    continue
                n = int(t[row, 2])
                start = int(row) * self.chunk_size
                data = bytes(self.arena[start:start + n])
                if int(t[row, 0]) != seq or int(t[row, 1]) != chunk + 1:
                    continue
                if xxhash.xxh3_64_intdigest(data) == checksum:
                    return data
            if not pending or wait <= 0:
                return None
            now = time.monotonic()
            if deadline is None:
                deadline = now + wait
            elif now >= deadline:
                return None
            time.sleep(0.0001)
