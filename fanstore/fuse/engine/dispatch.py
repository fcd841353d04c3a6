"""The worker loop: read one request, check it against the opcode table, dispatch it by
opcode, write one reply.

:class:`Dispatcher` owns one preallocated receive buffer. Its loop reads a request with
``os.readv`` into that buffer, parses its ``fuse_in_header`` with a precompiled Struct,
checks its length against the opcode table (:mod:`.optable`: the shortest request each
opcode accepts), calls the op function found by indexing a list with the opcode, and hands
the result to its one reply writer (``os.writev`` of the header and the payload as two
buffers, never joined).

Robustness: a request that is too short, whose length field disagrees with what was read,
whose struct is truncated or whose name lacks its NUL is counted, logged (rate-limited) and
answered EIO when its unique id is readable (dropped otherwise). A handler exception other
than FuseErrno is logged and answered EIO. Nothing a request contains can end the loop: only
ENODEV from the device (the connection is gone: unmounted or aborted) or a BaseException
such as SystemExit.
"""

from __future__ import annotations

import errno
import logging
import os
import struct
import time
from collections.abc import Callable
from typing import Any

from . import counters as C
from .optable import (
    BODY,
    OPS,
    EngineOptions,
    FuseErrno,
    Malformed,
    OpFunction,
    as_bytes_like,
    build_ops,
)
from .proto import IN_HEADER, IN_HEADER_SIZE, OP_NAMES, OUT_HEADER, OUT_HEADER_SIZE

log = logging.getLogger(__name__)

#: The start of fuse_in_header: len, opcode, unique (what a request shorter than its header
#: may still tell).
_HEAD = struct.Struct("=IIQ")


class ConnectionGone(Exception):
    """The device said ENODEV: the file system was unmounted or the connection aborted."""


class RateLimitedLog:
    """Log at most ``burst`` messages per ``interval`` seconds per key, then a summary."""

    def __init__(self, logger: logging.Logger, burst: int = 10, interval: float = 60.0):
        self.log = logger
        self.burst = burst
        self.interval = interval
        self._state: dict[str, list[float]] = {}  # key -> [window_start, count, suppressed]

    def __call__(self, key: str, level: int, msg: str, *args: Any, exc_info: bool = False
                 ) -> None:
        now = time.monotonic()
        st = self._state.get(key)
        if st is None or now - st[0] > self.interval:
            if st is not None and st[2]:
                self.log.log(level, "%s: %d similar messages suppressed", key, int(st[2]))
            st = self._state[key] = [now, 0, 0]
        st[1] += 1
        if st[1] <= self.burst:
            self.log.log(level, msg, *args, exc_info=exc_info)
        else:
            st[2] += 1


class Dispatcher:
    """Serves requests from one /dev/fuse descriptor with one handler.

    ``row`` is this worker's counters row (a memoryview of u64, see counters.py) or None.
    The dispatcher never closes ``fd``.

    Attributes
    ----------
    table : the op function of each opcode below OPS.
    need : the shortest request accepted for each opcode below OPS (from :data:`OPCODES`).
    reply : the reply writer, ``reply(unique, payload | errno)``.
    """

    def __init__(self, fd: int, handler: Any, *, bufsize: int,
                 options: EngineOptions | None = None, row: Any = None,
                 logger: logging.Logger | None = None) -> None:
        self.fd = fd
        self.handler = handler
        self.options = options or EngineOptions()
        self.buf = bytearray(max(bufsize, 8192 + IN_HEADER_SIZE))
        self.mv = memoryview(self.buf)
        self.row = row if row is not None else memoryview(bytearray(C.COLS * 8)).cast("Q")
        self.rlog = RateLimitedLog(logger or log)
        self.destroyed = False
        self.need: list[int] = [BODY] * OPS
        self.table: list[OpFunction] = build_ops(self)
        self.reply: Callable[[int, Any], None] = self._reply_writer()

    # ----------------------------------------------------------------------------------------
    # replies: written in one place

    def _reply_writer(self) -> Callable[[int, Any], None]:
        """``reply(unique, r)``: answer request ``unique`` with ``r``, an errno (header only)
        or a bytes-like payload (its length in bytes in the header); a payload that is not
        a contiguous buffer is counted, logged and answered EIO; a failed write is counted
        (ConnectionGone when the connection is gone)."""
        fd = self.fd
        write = os.write
        writev = os.writev
        pack_out = OUT_HEADER.pack
        head = OUT_HEADER_SIZE
        EIO = errno.EIO

        def reply(unique: int, r: Any) -> None:
            cls = r.__class__
            try:
                if cls is int:
                    write(fd, pack_out(head, -r if 0 < r < 512 else -EIO, unique))
                elif cls is bytes or (cls is memoryview and r.itemsize == 1 and r.ndim == 1
                                      and r.c_contiguous) or cls is bytearray:
                    writev(fd, (pack_out(head + len(r), 0, unique), r))
                else:  # numpy arrays, wide memoryviews
                    data, nbytes = as_bytes_like(r)
                    writev(fd, (pack_out(head + nbytes, 0, unique), data))
            except OSError as exc:
                self._reply_failed(exc, unique)
            except (TypeError, ValueError, BufferError):
                self.row[C.HANDLER_ERROR] += 1
                self.rlog("handler type", logging.ERROR,
                          "handler returned %s, not a bytes-like payload (unique %d); "
                          "answered EIO", type(r).__name__, unique)
                reply(unique, EIO)

        return reply

    def _reply_failed(self, exc: OSError, unique: int) -> None:
        if exc.errno == errno.ENOENT:
            # the request was interrupted or aborted meanwhile; the kernel no longer wants it
            self.row[C.STALE_REPLY] += 1
        elif exc.errno == errno.ENODEV:
            raise ConnectionGone() from exc
        else:
            self.row[C.REPLY_ERROR] += 1
            self.rlog("reply", logging.ERROR, "reply to request %d failed: %s", unique, exc)

    # ----------------------------------------------------------------------------------------

    def _failure(self, exc: Exception, n: int, unique: int) -> int | None:
        """The errno to answer for a request whose dispatch raised ``exc`` (None: drop it)."""
        if isinstance(exc, FuseErrno):
            return exc.errno
        if isinstance(exc, Malformed):
            self.row[C.MALFORMED] += 1
            if n < _HEAD.size:
                self.rlog("malformed", logging.WARNING, "dropped a malformed request: %s", exc)
                return None
            unique = _HEAD.unpack_from(self.buf)[2]
            self.rlog("malformed", logging.WARNING,
                      "malformed request (unique %d): %s; answered EIO", unique, exc)
            return errno.EIO
        self.row[C.HANDLER_ERROR] += 1
        op = _HEAD.unpack_from(self.buf)[1] if n >= IN_HEADER_SIZE else 0
        self.rlog("handler", logging.ERROR, "handler failed on %s (unique %d); answered EIO",
                  OP_NAMES.get(op, f"op{op}"), unique, exc_info=exc)
        return errno.EIO

    def _parse_checked(self, n: int) -> tuple[int, int, int, int]:
        """(op, unique, nodeid, end) of the request in the buffer, or raise Malformed."""
        if n < IN_HEADER_SIZE:
            raise Malformed(f"request of {n} bytes, shorter than its header")
        length, op, unique, nodeid, _uid, _gid, _pid, extlen, _pad = \
            IN_HEADER.unpack_from(self.buf)
        if length != n:
            raise Malformed(f"length field {length} but {n} bytes read")
        end = n - extlen * 8
        if end < IN_HEADER_SIZE:
            raise Malformed(f"extensions of {extlen * 8} bytes in a {n}-byte request")
        return op, unique, nodeid, end

    def handle(self, n: int) -> None:
        """Dispatch the request of ``n`` bytes now in the buffer and write its reply.

        Raises ConnectionGone when the reply write says the connection is gone.
        """
        unique = 0
        try:
            op, unique, nodeid, end = self._parse_checked(n)
            if op >= OPS:
                self.row[0] += 1
                r = errno.ENOSYS
            else:
                self.row[op] += 1
                if end < self.need[op]:
                    raise Malformed(f"{OP_NAMES.get(op, f'op{op}').upper()} of {end} bytes, "
                                    f"shorter than its body ({self.need[op]})")
                r = self.table[op](unique, nodeid, end)
        except Exception as exc:  # noqa: BLE001 - a handler bug is answered EIO, logged
            r = self._failure(exc, n, unique)
            if n >= _HEAD.size:
                unique = _HEAD.unpack_from(self.buf)[2]
        if r is not None:
            self.reply(unique, r)

    def run(self) -> None:
        """Serve until the connection is gone (returns) or a BaseException escapes.

        The common case of :meth:`handle` inlined into the read loop, for speed; anything
        unusual (a short or inconsistent request, extensions, an unknown opcode) goes
        through :meth:`handle`. Both answer through :attr:`reply`.
        """
        fd = self.fd
        buf = self.buf
        bufs = [buf]
        row = self.row
        table = self.table
        need = self.need
        reply = self.reply
        readv = os.readv
        unpack_in = IN_HEADER.unpack_from
        try:
            while True:
                try:
                    n = readv(fd, bufs)
                except OSError as exc:
                    if exc.errno == errno.ENODEV:
                        return
                    if exc.errno in (errno.EINTR, errno.EAGAIN, errno.ENOENT):
                        continue  # ENOENT: the request was aborted before we could read it
                    raise
                if n < IN_HEADER_SIZE:
                    if n == 0:
                        return  # end of file: only a socket or pipe standing in for the device
                    self.handle(n)
                    continue
                length, op, unique, nodeid, _uid, _gid, _pid, extlen, _pad = unpack_in(buf)
                if length != n or extlen or op >= OPS or n < need[op]:
                    self.handle(n)
                    continue
                row[op] += 1
                try:
                    r = table[op](unique, nodeid, n)
                except FuseErrno as exc:
                    r = exc.errno
                except Exception as exc:  # noqa: BLE001 - answered EIO, logged
                    r = self._failure(exc, n, unique)
                if r is not None:
                    reply(unique, r)
        except ConnectionGone:
            return
