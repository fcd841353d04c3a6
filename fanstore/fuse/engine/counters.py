"""Per-worker request counters in shared memory, readable without locks.

One row of 192 unsigned 64-bit counters per slot: row 0 belongs to the supervisor (it
answers INIT), rows 1..K to the worker slots. Columns 0..63 count requests by opcode
(column 0 also takes opcodes above 63 and unassigned ones), columns 64..95 count events
(malformed requests, handler errors, replies the kernel no longer wanted, ...), columns
96..191 are the application's (APP_COL0).

Each process writes only its own row, with plain aligned 8-byte stores (atomic on the
hardware we run on), so readers sum rows without a lock and never see a torn value. A
replacement worker reuses its slot's row and keeps counting from where the dead one stopped,
so the sums include every worker that ever served.

The memory is an anonymous shared mapping, or a file (e.g. under /dev/shm) when a path is
given, so that another process (a test, a benchmark) can :meth:`RequestCounters.attach` it.
"""

from __future__ import annotations

import mmap
import os
import struct

from .proto import OP_NAMES

COLS = 192
OP_COLS = 64
APP_COL0 = 96  # columns from here on belong to the application (the handler)
MALFORMED = 64  # a request that could not be parsed (answered EIO when its id was readable)
HANDLER_ERROR = 65  # a handler raised something other than FuseErrno (answered EIO)
STALE_REPLY = 66  # a reply the kernel no longer waited for (interrupted/aborted: ENOENT)
REPLY_ERROR = 67  # any other failed reply write (logged)
OVERSIZED = 68  # a READ/READDIR reply larger than asked, trimmed by the engine
EVENT_NAMES = {MALFORMED: "malformed", HANDLER_ERROR: "handler_error",
               STALE_REPLY: "stale_reply", REPLY_ERROR: "reply_error",
               OVERSIZED: "oversized_reply"}

_HEADER = struct.Struct("=8sIII12x")  # magic version rows cols, padded to 32 bytes
_MAGIC = b"KFUSECNT"
_VERSION = 2


def column_name(col: int) -> str:
    if col == 0:
        return "unknown"
    if col < OP_COLS:
        return OP_NAMES.get(col, f"op{col}")
    return EVENT_NAMES.get(col, f"event{col}")


class RequestCounters:
    """A ``rows x 128`` table of u64 counters in shared memory (see the module docstring)."""

    def __init__(self, rows: int, path: str | None = None) -> None:
        self.rows = rows
        self.path = path
        size = _HEADER.size + rows * COLS * 8
        if path is None:
            self._mm = mmap.mmap(-1, size, flags=mmap.MAP_SHARED | mmap.MAP_ANONYMOUS)
        else:
            # A fresh file only this uid can read: never one planted at the name, never
            # through a symlink (a stale file of a killed frontend is removed first).
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                         | os.O_CLOEXEC, 0o600)
            try:
                os.ftruncate(fd, size)
                self._mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
            finally:
                os.close(fd)
        _HEADER.pack_into(self._mm, 0, _MAGIC, _VERSION, rows, COLS)
        self._table = memoryview(self._mm)[_HEADER.size:].cast("Q")

    @classmethod
    def attach(cls, path: str, writable: bool = False) -> RequestCounters:
        """Map an existing counters file read-only (another process owns it), or, for a
        worker that was not forked by the session (``writable``: it writes its own row),
        read-write; never through a symlink."""
        self = cls.__new__(cls)
        fd = os.open(path, (os.O_RDWR if writable else os.O_RDONLY) | os.O_NOFOLLOW
                     | os.O_CLOEXEC)
        try:
            if writable:
                self._mm = mmap.mmap(fd, 0, flags=mmap.MAP_SHARED)
            else:
                self._mm = mmap.mmap(fd, 0, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        magic, version, rows, cols = _HEADER.unpack_from(self._mm, 0)
        if magic != _MAGIC or version != _VERSION or cols != COLS:
            raise ValueError(f"{path}: not a request counters file")
        self.rows = rows
        self.path = path
        self._table = memoryview(self._mm)[_HEADER.size:].cast("Q")
        return self

    def row(self, slot: int) -> memoryview:
        """The writable row of ``slot`` (a memoryview of COLS u64): ``row[col] += 1``."""
        if not 0 <= slot < self.rows:
            raise IndexError(slot)
        return self._table[slot * COLS:(slot + 1) * COLS]

    def column_sums(self) -> list[int]:
        t = self._table
        return [sum(t[r * COLS + c] for r in range(self.rows)) for c in range(COLS)]

    def column_max(self, col: int) -> int:
        """The largest value of column ``col`` over the rows (a gauge every worker copies)."""
        t = self._table
        return max(t[r * COLS + col] for r in range(self.rows))

    @property
    def requests(self) -> int:
        """Total requests served (by every process, replaced workers included)."""
        return sum(self.column_sums()[:OP_COLS])

    @property
    def requests_by_op(self) -> dict[str, int]:
        """Non-zero request counts by lower-case op name: {"lookup": n, "read": n, ...}."""
        sums = self.column_sums()
        return {column_name(c): sums[c] for c in range(OP_COLS) if sums[c]}

    @property
    def events(self) -> dict[str, int]:
        """Non-zero event counts: malformed, handler_error, stale_reply, ..."""
        sums = self.column_sums()
        return {column_name(c): sums[c] for c in range(OP_COLS, APP_COL0) if sums[c]}

    def snapshot(self) -> dict[str, int]:
        """requests_by_op and events in one dict (for before/after differences)."""
        sums = self.column_sums()
        return {column_name(c): sums[c] for c in range(COLS) if sums[c]}

    def close(self) -> None:
        try:
            self._table.release()
            self._mm.close()
        except (BufferError, ValueError):
            pass


def diff(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    """Non-zero differences of two snapshots."""
    keys = set(after) | set(before)
    return {k: after.get(k, 0) - before.get(k, 0) for k in sorted(keys)
            if after.get(k, 0) != before.get(k, 0)}
