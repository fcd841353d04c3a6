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
"""

from __future__ import annotations

import collections
import errno
import logging
import os
import select
import socket
import struct
import sys
import threading
import time

import numpy as np

from fanstore.errors import FanStoreError
from fanstore.format.index import KIND_FILE
from fanstore.fuse.kernel.notify import notify_store
from fanstore.read.window import (
    BUFFERED,
    CLIENTS,
    INFLIGHT,
    LISTED,
    NONE,
    ORDERS,
    PAGE,
    PUSHED,
    PUSHING,
    READ_AT_0,
    READING,
    SERVED,
    WANTED,
    WINDOW,
    SharedWindow,
    kind,
    read_order,
)

log = logging.getLogger(__name__)

#: messages on a worker's channel: magic, kind, client, generation, order length
MSG = struct.Struct("=4sIIIQ")
MSG_MAGIC = b"FSPO"
ORDER, DROP = 1, 2

PUSH_PIECE = 1 << 20  # largest single store (page-aligned pieces of a big file)
ADVISE_AHEAD = 8  # next files of a stripe whose stored bytes the disk is asked to read ahead
REMOTE_BATCH = 16  # other nodes' files fetched in one exchange (per holder)
DIRECTORY_AHEAD = 16  # files after a file read with no order, in its directory
BUFFER_MAX_FILE = 64 << 20  # larger files are never buffered (a READ decodes them)
SWITCH_INTERVAL = 2e-4  # seconds a worker's threads may hold the interpreter in a row
PREFETCH_NICE = 10  # the prefetch threads' nice value (spare cycles first)

#: the prefetch counters, in each worker's row of the shared counters table (COL0 on);
#: every one is summed over the workers except the window, which is the same for all
COLUMNS = ("prefetch_files", "prefetch_pushed", "prefetch_bytes_pushed",
           "prefetch_push_refused", "prefetch_lookups_ahead", "prefetch_buffered",
           "prefetch_served_from_buffer", "prefetch_late", "prefetch_missed",
           "prefetch_read_after_push", "prefetch_bytes_evicted_unused", "prefetch_errors",
           "prefetch_skipped", "prefetch_buffer_bytes", "prefetch_window_bytes",
           "prefetch_orders", "prefetch_listings")
COL0 = 120
COL = {name: COL0 + i for i, name in enumerate(COLUMNS)}
MAX_COLUMNS = ("prefetch_window_bytes",)


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


# --------------------------------------------------------------------------- a worker


class _Stream:
    """A worker's stripe of one client's order, and how far it has got."""

    __slots__ = ("advised", "next", "order")

    def __init__(self, order) -> None:
        self.order = order
        self.next = 0  # the next place of the stripe to consider
        self.advised = 0  # the stored bytes up to here were asked for (WILLNEED)


class PrefetchHooks:
    """What a worker's main thread does in prefetch mode (called by the FUSE handler)."""

    def __init__(self, prefetcher: Prefetcher) -> None:
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


class Prefetcher:
    """The prefetch thread of one worker (see the module docstring).

    ``reader``: the worker's read core (this node's partitions, other nodes' through its
    remote source); ``fd``: its descriptor on the FUSE connection (stores are written to
    it); ``channel``: orders from the frontend process; ``row``: its counters row.
    """

    def __init__(self, window: SharedWindow, reader, ns, slot: int, slots: int, fd: int,
                 channel: socket.socket, mountpoint: str, row,
                 stat_ahead: bool | None = None, publish=None) -> None:
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
        if stat_ahead is None:  # FANSTORE_PREFETCH_LOOKUP=0: no look-ups (tests, benchmarks)
            stat_ahead = os.environ.get("FANSTORE_PREFETCH_LOOKUP", "1") != "0"
        self.stat_ahead = stat_ahead
        self.sizes = ns.index.e["size"]
        self._kinds = ns.index.e["kind"]
        self.streams: dict[int, _Stream] = {}
        self._turn = 0
        self._dir_queue: collections.deque[int] = collections.deque(maxlen=64)
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        # the slab: a FIFO of (entry, first page, pages, the state value written)
        self._slab = window.arena_view(slot)
        self._slab_pages = len(self._slab) // PAGE
        self._fifo: collections.deque[tuple[int, int, int, int]] = collections.deque()
        self._head = 0  # next free page (the ring's write position)
        self._used = 0  # pages held
        self._seq = 0
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
        except Exception:  # noqa: BLE001 - a prefetcher must never take the worker down
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
        magic, kind_, client, generation, _n = MSG.unpack(msg)
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
        if self.window.marks[entry] & WANTED and self._buffer(entry, data):
            return True
        state[entry] = PUSHING
        if self._push(entry, 0, data) == 0:
            state[entry] = PUSHED
            return True
        return self._buffer(entry, data)

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

    # ------------------------------------------------------------------ the buffer
    def _buffer(self, entry: int, data) -> bool:
        """Keep a file the kernel would not take in this worker's slab; False if it does
        not fit."""
        n = len(data)
        pages = (n + PAGE - 1) // PAGE or 1
        if n > BUFFER_MAX_FILE or pages > self._slab_pages:
            return False
        if self._head + pages > self._slab_pages:
            self._free_until_wrap()
        while self._used and self._overlaps(self._head, pages):
            self._evict_oldest()
        start = self._head
        self._slab[start * PAGE:start * PAGE + n] = data
        self._seq += 1
        page = (self._slab_index() * self.window.slab // PAGE) + start
        value = SharedWindow.buffered_value(page, self._seq)
        self.window.marks[entry] &= ~(SERVED | WANTED) & 0xFF
        self.window.state[entry] = value
        self._fifo.append((entry, start, pages, value))
        self._head = start + pages
        self._used += pages
        self.row[COL["prefetch_buffered"]] += 1
        self.row[COL["prefetch_buffer_bytes"]] = self._used * PAGE
        return True

    def _slab_index(self) -> int:
        return self.slot - 1

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


def wait_started(prefetcher: Prefetcher, timeout: float = 5.0) -> bool:
    """(tests) True once the thread runs."""
    deadline = time.monotonic() + timeout
    while prefetcher._thread is None or not prefetcher._thread.is_alive():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


__all__ = ["COLUMNS", "COL", "OrderRelay", "Prefetcher", "PrefetchHooks", "encode",
           "kind", "BUFFERED", "DROP", "ORDER"]
