"""Prefetch mode: the prefetch thread of one worker (see :mod:`fanstore.fuse.kernelfs.orders` for
the whole picture).

The thread takes its stripe of each client's order (the indices i with i % K == slot - 1),
in order, within the window past the furthest file the readers were seen at: it fetches
(local pread with the next files' stored bytes asked for ahead; other nodes' files
REMOTE_BATCH at a time, one exchange per holder), decodes and checks (the read core),
and pushes each file into its page cache with FUSE_NOTIFY_STORE. When the kernel does not
hold the inode (ENOENT) it lists the file's directory through the mount once and pushes
again; what is still refused, or what a READ is waiting for, goes to the worker's
:class:`~fanstore.fuse.kernelfs.slab.Slab` of the shared buffer. Without any order, a READ of a file
whose predecessor in its directory was read prefetches the next DIRECTORY_AHEAD files.

Stores come only from this thread, which serves no requests (notify.py's deadlock rule);
it runs at nice PREFETCH_NICE and yields after every file, so readers and the training
loop get the cores first.
"""

from __future__ import annotations

import collections
import errno
import logging
import os
import select
import socket
import sys
import threading
import time

import numpy as np

from fanstore.errors import FanStoreError
from fanstore.format.index import KIND_FILE
from fanstore.fuse.engine.notify import notify_store
from fanstore.fuse.kernelfs.stats import COL
from fanstore.fuse.kernelfs.orders import MSG, MSG_MAGIC, ORDER, PUSH_PIECE, PrefetchHooks
from fanstore.fuse.kernelfs.slab import Slab
from fanstore.read.window import (
    CLIENTS,
    INFLIGHT,
    LISTED,
    NONE,
    ORDERS,
    PUSHED,
    PUSHING,
    READING,
    WANTED,
    WINDOW,
    SharedWindow,
    read_order,
)

log = logging.getLogger(__name__)

ADVISE_AHEAD = 8  # next files of a stripe whose stored bytes the disk is asked to read ahead
REMOTE_BATCH = 16  # other nodes' files fetched in one exchange (per holder)
DIRECTORY_AHEAD = 16  # files after a file read with no order, in its directory
SWITCH_INTERVAL = 2e-4  # seconds a worker's threads may hold the interpreter in a row
PREFETCH_NICE = 10  # the prefetch threads' nice value (spare cycles first)


class _Stream:
    """A worker's stripe of one client's order, and how far it has got."""

    __slots__ = ("advised", "next", "order")

    def __init__(self, order) -> None:
        self.order = order
        self.next = 0  # the next place of the stripe to consider
        self.advised = 0  # the stored bytes up to here were asked for (WILLNEED)




class Prefetcher:
    """The prefetch thread of one worker (see the module docstring).

    ``reader``: the worker's read core (this node's partitions, other nodes' through its
    remote source); ``fd``: its descriptor on the FUSE connection (stores are written to
    it); ``channel``: orders from the frontend process; ``row``: its counters row.
    """

    def __init__(self, window: SharedWindow, reader, ns, slot: int, slots: int, fd: int,
                 channel: socket.socket, mountpoint: str, row,
                 stat_ahead: bool = True, publish=None) -> None:
        self.window = window
        self.reader = reader
        self.ns = ns
        self.slot = slot
        self.slots = slots
        self.fd = fd
        self.channel = channel
        channel.setblocking(False)  # (socket.recv_fds ignores its flags before 3.12)
        self.mountpoint = os.fsencode(mountpoint)
        self.row = row
        self.publish = publish or (lambda: None)  # the read core's counters to the row
        self.stat_ahead = stat_ahead  # (--no-prefetch-lookup: no look-ups, for comparisons)
        self.sizes = ns.index.entries["size"]
        self._kinds = ns.index.entries["kind"]
        self.streams: dict[int, _Stream] = {}
        self._turn = 0
        self._dir_queue: collections.deque[int] = collections.deque(maxlen=64)
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.slab = Slab(window, slot, row, self.sizes)  # files the kernel would not take
        self.hooks = PrefetchHooks(self)

    # ------------------------------------------------------------------ thread
    def start(self) -> None:
        # The main thread answers requests: when it wakes up, it must not wait the default
        # 5 ms for this thread to give up the interpreter.
        sys.setswitchinterval(SWITCH_INTERVAL)
        self._thread = threading.Thread(target=self._run, name="fanstore-prefetch",
                                        daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._wake()
        if self._thread is not None:
            self._thread.join(timeout)

    def directory_ahead(self, entry: int) -> None:
        """(main thread) A file was read with no order: prefetch what follows it."""
        self._dir_queue.append(entry)
        self._wake()

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"w")
        except OSError:  # full (it is woken already) or closed
            pass

    def _run(self) -> None:
        # Spare cycles first: a reader waiting for a file now goes before a file wanted
        # later (the readers, and the workers' main threads, keep the normal priority).
        # (not SCHED_IDLE: a thread starved while it holds the interpreter lock would hold
        # up the main thread of its worker, which answers the readers' requests)
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), PREFETCH_NICE)
        except OSError:
            pass
        try:
            while not self._stop.is_set():
                entry = self._next()
                if entry is not None:
                    if self.reader.is_local(entry) or int(self.sizes[entry]) > PUSH_PIECE:
                        self._prefetch(entry)
                    else:  # another node's: fetch the next ones held there with it
                        self._prefetch_remote([entry, *self._more_remote()])
                    self.publish()
                    # a file at a time: whoever waits for a core (a reader, the training
                    # loop) gets it now, not at the end of this thread's time slice
                    os.sched_yield()
                    continue
                if self._dir_queue:
                    self._directory(self._dir_queue.popleft())
                    self.publish()
                    continue
                waiting = any(s.next < len(s.order.entries) for s in self.streams.values())
                self._receive(0.002 if waiting else 0.25)
        except Exception:  # a prefetcher must never take the worker down
            log.exception("worker slot %d: the prefetch thread failed; reads go on without it",
                          self.slot)

    # ------------------------------------------------------------------ orders
    def _receive(self, timeout: float) -> None:
        """Take the channel's messages, waiting up to ``timeout`` for the first."""
        ready, _, _ = select.select([self.channel, self._wake_r], [], [], timeout)
        if self._wake_r in ready:
            try:
                os.read(self._wake_r, 4096)
            except OSError:
                pass
        ready = [r for r in ready if r is self.channel]
        while ready:
            try:
                msg, fds, _f, _a = socket.recv_fds(self.channel, MSG.size, 1)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                self._stop.set()
                return
            if not msg:
                self._stop.set()  # the frontend process is gone
                return
            try:
                self._message(msg, fds)
            finally:
                for fd in fds:
                    os.close(fd)

    def _message(self, msg: bytes, fds: list[int]) -> None:
        magic, kind_, client, _generation, _n = MSG.unpack(msg)
        if magic != MSG_MAGIC or client >= CLIENTS:
            return
        self.streams.pop(client, None)
        if kind_ != ORDER or not fds:
            return
        try:
            order = read_order(fds[0], self.slot, self.slots, self.window.n)
        except (OSError, ValueError) as exc:
            log.warning("ignoring a prefetch order: %s", exc)
            return
        w = self.window
        w.begin_order(order.client, order.generation)
        w.mark_order(order.client, order.generation, order.entries, order.indices)
        self.streams[client] = _Stream(order)
        w.ctl[ORDERS] += 1
        self.row[COL["prefetch_orders"]] += 1
        self.row[COL["prefetch_window_bytes"]] = int(w.ctl[WINDOW])

    def _next(self) -> int | None:
        """The next file to prefetch: each client's order in turn, the first file of this
        worker's stripe that nobody has started (a reader that got to a file first keeps
        it) and that ends within the window past the furthest file the readers were seen
        at. In order: a DataLoader wants its batches in order too."""
        streams = list(self.streams.values())
        if not streams:
            return None
        w = self.window
        window = int(w.ctl[WINDOW])
        state = w.state
        for k in range(len(streams)):
            s = streams[(self._turn + k) % len(streams)]
            o = s.order
            n = len(o.entries)
            if s.next >= n:
                continue
            pos = w.position(o.client, o.generation)
            base = 0
            if pos:
                j = int(np.searchsorted(o.indices, pos))
                base = int(o.before[j]) if j < n else int(o.after[-1])
            while s.next < n:
                i = s.next
                if int(o.after[i]) - base > window:
                    break  # ahead of the window: wait for the readers
                s.next += 1
                entry = int(o.entries[i])
                kind_ = int(state[entry]) & 7
                if kind_ == READING:
                    self.row[COL["prefetch_skipped"]] += 1
                elif kind_ == NONE and int(self.sizes[entry]) > 0:
                    self._advise(s)
                    self._turn = (self._turn + k + 1) % len(streams)
                    return entry
        return None

    def _advise(self, s: _Stream) -> None:
        """Ask the disk for the stored bytes of the next files of the stripe, so that their
        reads overlap this one's decoding (one pread at a time per thread otherwise)."""
        o = s.order
        stop = min(len(o.entries), s.next + ADVISE_AHEAD)
        for t in range(max(s.advised, s.next), stop):
            self.reader.advise(int(o.entries[t]))
        s.advised = max(s.advised, stop)

    def _directory(self, entry: int) -> None:
        ns = self.ns
        if not 0 <= entry < ns.n_entries:
            return
        siblings = ns.children(ns.parent(entry))
        state = self.window.state
        done = 0
        for e in siblings[entry - siblings.start + 1:]:
            if done >= DIRECTORY_AHEAD or self._stop.is_set():
                return
            if int(self._kinds[e]) != KIND_FILE or int(state[e]) & 7 != NONE \
                    or int(self.sizes[e]) == 0:
                continue
            self._prefetch(e)
            done += 1

    # ------------------------------------------------------------------ one file
    def _prefetch(self, entry: int) -> None:
        state = self.window.state
        row = self.row
        state[entry] = INFLIGHT
        size = int(self.sizes[entry])
        row[COL["prefetch_files"]] += 1
        try:
            if size <= PUSH_PIECE:
                if self._deliver(entry, self.reader.read(entry, 0, size, keep_whole=False)):
                    return
            else:
                state[entry] = PUSHING
                if self._push_pieces(entry) == 0:
                    state[entry] = PUSHED
                    return
        except FanStoreError as exc:
            row[COL["prefetch_errors"]] += 1
            log.debug("prefetch of %s: %s", self.ns.show(entry), exc)
        if int(state[entry]) & 7 in (INFLIGHT, PUSHING):
            state[entry] = NONE

    def _more_remote(self) -> list[int]:
        """Up to REMOTE_BATCH - 1 more files of the stream ``_next`` just took from, next
        in its stripe, that are other nodes' too (small enough for one chunk): they go in
        the same exchange."""
        streams = list(self.streams.values())
        if not streams:
            return []
        s = streams[(self._turn - 1) % len(streams)]
        o = s.order
        state = self.window.state
        more: list[int] = []
        limit = int(self.window.ctl[WINDOW])
        base = int(o.before[s.next]) if s.next < len(o.entries) else 0
        while s.next < len(o.entries) and len(more) < REMOTE_BATCH - 1:
            i = s.next
            entry = int(o.entries[i])
            size = int(self.sizes[entry])
            if int(o.after[i]) - base > limit or self.reader.is_local(entry) \
                    or size > PUSH_PIECE:
                break
            s.next += 1
            if int(state[entry]) & 7 == NONE and size > 0:
                more.append(entry)
        return more

    def _prefetch_remote(self, entries: list[int]) -> None:
        """Files of other nodes, fetched together (one exchange per holder), then each
        decoded, checked and delivered."""
        state = self.window.state
        for e in entries:
            state[e] = INFLIGHT
        self.row[COL["prefetch_files"]] += len(entries)
        for entry, data in zip(entries, self.reader.read_files(entries)):
            if isinstance(data, FanStoreError):
                self.row[COL["prefetch_errors"]] += 1
                log.debug("prefetch of %s: %s", self.ns.show(entry), data)
                state[entry] = NONE
            elif not self._deliver(entry, data) and int(state[entry]) & 7 in (INFLIGHT,
                                                                               PUSHING):
                state[entry] = NONE

    def _deliver(self, entry: int, data) -> bool:
        """A decoded file into the page cache, else the buffer (to a READ waiting for it
        first); False if neither took it."""
        state = self.window.state
        # a READ waits for it (PrefetchHooks._wait_for): hand it over in the buffer
        if self.window.marks[entry] & WANTED and self.slab.put(entry, data):
            return True
        state[entry] = PUSHING
        if self._push(entry, 0, data) == 0:
            state[entry] = PUSHED
            return True
        return self.slab.put(entry, data)

    def _push(self, entry: int, offset: int, data) -> int:
        """Store ``data`` at ``offset`` of the file. When the kernel does not hold its inode,
        list its directory through the mount (one READDIRPLUS gives the kernel every inode
        of it: the readers' opens then send no LOOKUP either), or, if that was done this
        epoch already, look the file itself up; then try once more."""
        nodeid = entry + 1
        err = notify_store(self.fd, nodeid, offset, data)
        if err == errno.ENOENT and self.stat_ahead:
            if not self._list_directory(self.ns.parent(entry)):
                self.row[COL["prefetch_lookups_ahead"]] += 1
                try:
                    os.lstat(self.mountpoint + b"/" + self.ns.path(entry))
                except OSError:
                    pass
            err = notify_store(self.fd, nodeid, offset, data)
        if err == 0:
            self.row[COL["prefetch_pushed"]] += offset == 0
            self.row[COL["prefetch_bytes_pushed"]] += len(data)
        else:
            self.row[COL["prefetch_push_refused"]] += offset == 0
        return err

    def _list_directory(self, d: int) -> bool:
        """List directory ``d`` through the mount unless a worker did this epoch."""
        marks = self.window.marks
        if marks[d] & LISTED:
            return False
        marks[d] |= LISTED
        self.row[COL["prefetch_listings"]] += 1
        try:
            os.listdir(self.mountpoint + b"/" + self.ns.path(d))
        except OSError:
            pass
        return True

    def _push_pieces(self, entry: int) -> int:
        """A big file in page-aligned pieces of at most PUSH_PIECE bytes (never more than
        one piece held at a time)."""
        pending = bytearray()
        offset = 0
        for piece in self.reader.iter_file(entry, keep=False):
            pending += piece
            while len(pending) >= PUSH_PIECE:
                err = self._push(entry, offset, memoryview(pending)[:PUSH_PIECE])
                if err:
                    return err
                del pending[:PUSH_PIECE]
                offset += PUSH_PIECE
            if self._stop.is_set():
                return errno.ECANCELED
        if pending:
            return self._push(entry, offset, pending)
        return 0


def wait_started(prefetcher: Prefetcher, timeout: float = 5.0) -> bool:
    """(tests) True once the thread runs."""
    deadline = time.monotonic() + timeout
    while prefetcher._thread is None or not prefetcher._thread.is_alive():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True
