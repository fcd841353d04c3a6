"""Prefetch mode on the kernel frontend: files of the readers' order, decoded ahead and pushed
into the page cache, so that reading them sends no request at all.

Who does what (one node)::

    node daemon          control request "prefetch" (paths) -> entries -> an order file
         |                (window.write_order), sent with its descriptor to the frontend
         v
    frontend process     OrderRelay: keeps the newest order of each client (training
         |                process) and hands it to every worker on its channel
         v
    worker 1..K          main thread: serves FUSE requests (PrefetchHooks on READ, LOOKUP
                          and IOCTL: where the readers are, answers from the buffer)
                         prefetch thread (Prefetcher): its stripe of every order (the
                          indices i with i % K == slot - 1), in order, within the window:
                          fetch (local pread or another node), decode and check (the read
                          core), push with FUSE_NOTIFY_STORE into the file's page cache;
                          when the kernel does not hold the inode (ENOENT) it looks the file
                          up through the mount once and pushes again, and when that fails
                          too it keeps the file in its slab of the shared buffer, which any
                          worker serves a READ from.

Why a thread in every worker: decoding spreads over the node's cores as the workers do
(the codecs release the GIL), and a worker rank's thread reaches other nodes over MPI
itself. Stores come from a thread that serves no requests: a store waiting for a page lock
held by a reader waits for that reader's READ, which a worker's main thread answers
without ever waiting for a prefetch thread (notify.py's deadlock rule).

The window: how many bytes of the order, past the furthest file the readers were seen at,
may be pushed or buffered ahead. Readers are seen at their READs (files not pushed), their
LOOKUPs and the FUSE_IOCTL Python's ``open()`` sends for every file. The window starts at
half of the node's available memory (at least ``--prefetch-mb``): the page cache is the
kernel's to reclaim. It grows when the readers catch up with the files being prefetched
(a READ finds its file not yet pushed: late or missed) and shrinks when a file already
pushed is read through a READ (the kernel dropped it before it was read: too far ahead).
``--prefetch-mb`` bounds what FanStore itself holds: the buffer plus what the threads hold
decoded before pushing (one piece each).

Without any order, a READ of a file at offset 0 prefetches the next files of its
directory (``DIRECTORY_AHEAD``).

Modules: this one (the messages on the channels; the frontend process's OrderRelay; what a
worker's main thread does, PrefetchHooks), :mod:`fanstore.fuse.kernelfs.prefetcher` (the prefetch
thread), :mod:`fanstore.fuse.kernelfs.slab` (a worker's slab of the shared buffer); the shared state
itself is :mod:`fanstore.read.window`, the counters :mod:`fanstore.fuse.kernelfs.stats`.
"""

from __future__ import annotations

import logging
import os
import socket
import struct
import time
from typing import Any, Protocol

from fanstore.fuse.kernelfs.stats import COL
from fanstore.read.window import (
    BUFFERED,
    CLIENTS,
    INFLIGHT,
    NONE,
    ORDERS,
    PUSHED,
    PUSHING,
    READ_AT_0,
    READING,
    WANTED,
    SharedWindow,
)

log = logging.getLogger(__name__)

#: messages on a worker's channel: magic, kind, client, generation, order length
MSG = struct.Struct("=4sIIIQ")
MSG_MAGIC = b"FSPO"
ORDER, DROP = 1, 2

#: the largest single store (a big file is pushed in page-aligned pieces of this size): what
#: each prefetch thread may hold decoded at a time, out of --prefetch-mb
PUSH_PIECE = 1 << 20


def encode(kind_: int, client: int, generation: int, length: int = 0) -> bytes:
    return MSG.pack(MSG_MAGIC, kind_, client, generation & 0xFFFFFFFF, length)


# --------------------------------------------------------------------------- the frontend


class OrderRelay:
    """In the frontend process: orders from the daemon (``sock``: the frontend's end of a
    SOCK_SEQPACKET pair) to every worker of ``session``; the newest order of each client
    is kept for workers that start later (replacements)."""

    def __init__(self, session, sock: socket.socket, window: SharedWindow, floor: int) -> None:
        self.session = session
        self.sock = sock
        self.window = window
        self.floor = floor
        self.orders: dict[int, tuple[bytes, int]] = {}  # client -> (message, order fd)
        sock.setblocking(False)

    def on_readable(self) -> bool:
        try:
            msg, fds, _flags, _addr = socket.recv_fds(self.sock, MSG.size, 1)
        except (BlockingIOError, InterruptedError):
            return True
        except OSError:
            msg, fds = b"", []
        if not msg:
            return False  # the daemon is gone: the session ends with it
        try:
            magic, kind_, client, _gen, _n = MSG.unpack(msg)
        except struct.error:
            magic, kind_, client = b"", 0, 0
        if magic != MSG_MAGIC or client >= CLIENTS or kind_ not in (ORDER, DROP) \
                or (kind_ == ORDER and len(fds) != 1):
            log.warning("ignoring a malformed prefetch message from the daemon")
            for fd in fds:
                os.close(fd)
            return True
        old = self.orders.pop(client, None)
        if old is not None:
            os.close(old[1])
        if kind_ == ORDER:
            self.orders[client] = (msg, fds[0])
            self.window.set_bounds(self.floor, max(self.floor, available_memory() // 2))
            self.window.forget_listings()
        self.session.broadcast(msg, fds)
        return True

    def resend(self, slot: int) -> None:
        for msg, fd in self.orders.values():
            self.session.send(slot, msg, [fd])

    def close(self) -> None:
        for _msg, fd in self.orders.values():
            os.close(fd)
        self.orders.clear()


def available_memory() -> int:
    """MemAvailable of /proc/meminfo, in bytes (0 if unknown)."""
    try:
        with open("/proc/meminfo", "rb") as f:
            for line in f:
                if line.startswith(b"MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0



class PrefetchThread(Protocol):
    """What the hooks use of their worker's prefetch thread
    (:class:`fanstore.fuse.kernelfs.prefetcher.Prefetcher`)."""

    window: SharedWindow
    row: Any
    sizes: Any
    ns: Any

    def directory_ahead(self, entry: int) -> None: ...


class PrefetchHooks:
    """What a worker's main thread does in prefetch mode (called by the FUSE handler)."""

    def __init__(self, prefetcher: PrefetchThread) -> None:
        self.p = prefetcher
        self.window = prefetcher.window
        self.row = prefetcher.row
        self._state = prefetcher.window.state
        self._sizes = prefetcher.sizes

    def seen(self, entry: int) -> None:
        """LOOKUP or IOCTL of ``entry``: a reader is there (unless the file is being
        prefetched: then the LOOKUP may be the prefetch thread's own, see _push); a file
        nobody prefetched yet is left to that reader."""
        if 0 <= entry < self.window.n:
            k = int(self._state[entry]) & 7
            if k == NONE:
                self._state[entry] = READING
            if k not in (INFLIGHT, PUSHING):
                self.window.seen(entry)

    def read(self, entry: int, offset: int, size: int) -> bytes | None:
        """A READ reached this worker: answer it from the buffer if the file is there (or
        is being decoded: then wait for it); else count why it was not pushed (and adapt
        the window), and return None."""
        w = self.window
        v = int(self._state[entry])
        k = v & 7
        if k == BUFFERED:
            data = w.read_buffered(entry, offset, size, int(self._sizes[entry]))
            if data is not None:
                self.row[COL["prefetch_served_from_buffer"]] += 1
                w.seen(entry)
                return data
        in_order = w.seen(entry)
        if offset != 0:
            return None
        if in_order:
            if k == PUSHED:  # the kernel dropped it before it was read: too far ahead
                self.row[COL["prefetch_read_after_push"]] += 1
                w.scale_window(0.8)
            elif k in (INFLIGHT, PUSHING):
                self.row[COL["prefetch_late"]] += 1
                w.scale_window(1.25)
                data = self._wait_for(entry, size) if k == INFLIGHT else None
                if data is not None:
                    self.row[COL["prefetch_served_from_buffer"]] += 1
                    return data
            else:
                self.row[COL["prefetch_missed"]] += 1
                w.scale_window(1.25)
                if k == NONE:
                    self._state[entry] = READING  # the prefetch passes it by
        elif k in (NONE, READING) and not int(w.ctl[ORDERS]):
            # no reader ever gave an order: read ahead in the directory of a reader that
            # goes through it in name order (the file before this one was read already)
            marks = w.marks
            marks[entry] |= READ_AT_0
            if entry and marks[entry - 1] & READ_AT_0 \
                    and self.p.ns.parent(entry - 1) == self.p.ns.parent(entry):
                self.p.directory_ahead(entry)
        return None

    def _wait_for(self, entry: int, size: int, limit: float = 2e-3) -> bytes | None:
        """A READ of a file a prefetch thread is decoding: ask for it (WANTED: the thread
        then buffers it instead of pushing, since a push would wait for the very pages
        this READ's reader holds) and wait, rather than decode it a second time. Gives up
        (None: decode here) if the thread has started pushing anyway, or after ``limit``:
        short, because that thread may itself wait in a push for a page whose READ only
        this worker's main thread, waiting here, would answer (with two workers both main
        threads can be waiting so)."""
        w = self.window
        w.marks[entry] |= WANTED
        state = self._state
        deadline = time.monotonic() + limit
        nap = 50e-6
        while True:
            k = int(state[entry]) & 7
            if k == BUFFERED:
                return w.read_buffered(entry, 0, size, int(self._sizes[entry]))
            if k != INFLIGHT or time.monotonic() > deadline:
                return None
            time.sleep(nap)
            nap = min(nap * 1.5, 1e-3)
