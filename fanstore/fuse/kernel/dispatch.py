"""The worker loop: read one request, dispatch it by opcode, write one reply.

:class:`Dispatcher` owns one preallocated receive buffer. Its loop reads a request with
``os.readv`` into that buffer, parses the 40-byte header with a precompiled Struct, calls the
op function found by indexing a list with the opcode, and writes the reply with ``os.writev``
(header and payload as two buffers, never joined).

Op functions (engine-internal) return one of:

- a bytes-like payload: success, the payload follows the header;
- an ``int`` errno > 0: an error reply (header only), the cheapest answer there is;
- ``None``: no reply (FORGET, BATCH_FORGET, INTERRUPT, NOTIFY_REPLY).

Handler methods return bytes-like payloads or raise :class:`FuseErrno`; as a fast path they
may also return a positive ``int`` errno instead of raising.

Robustness: a request that is too short, whose length field disagrees with what was read,
whose struct is truncated or whose name lacks its NUL is counted, logged (rate-limited) and
answered EIO when its unique id is readable (dropped otherwise). A handler exception other
than FuseErrno is logged and answered EIO. A READ/READDIR(PLUS) payload larger than the size
the kernel asked for is trimmed (the kernel would refuse the whole reply with EINVAL).
Nothing a request contains can end the loop: only ENODEV from the device (the connection is
gone: unmounted or aborted) or a BaseException such as SystemExit.
"""

from __future__ import annotations

import errno
import logging
import os
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from . import counters as C
from .proto import (
    ACCESS_IN,
    BATCH_FORGET_IN,
    FOPEN_CACHE_DIR,
    FOPEN_KEEP_CACHE,
    FORGET_IN,
    FORGET_ONE,
    GETXATTR_IN,
    GETXATTR_OUT,
    IN_HEADER,
    IN_HEADER_SIZE,
    OP_NAMES,
    OPEN_IN,
    OUT_HEADER,
    WRITE_OPS,
    Op,
    pack_open_out,
    pack_statfs_out,
)
from .records import fit_records

log = logging.getLogger(__name__)


class FuseErrno(Exception):
    """Raised by a handler to answer a request with an errno (e.g. ``FuseErrno(ENOENT)``)."""

    __slots__ = ("errno",)

    def __init__(self, errno_: int) -> None:
        super().__init__(errno_)
        # The kernel refuses error replies outside 1..511 (and then never ends the request).
        self.errno = errno_ if 0 < errno_ < 512 else errno.EIO

    def __str__(self) -> str:
        return f"[Errno {self.errno}] {os.strerror(self.errno)}"


class Malformed(Exception):
    """A request the engine cannot parse (answered EIO)."""


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


@dataclass
class EngineOptions:
    """Engine behaviour that is not negotiated with the kernel.

    Attributes
    ----------
    opendir : "enosys" (zero-message opendir: the kernel then caches listings itself with
        FOPEN_CACHE_DIR|FOPEN_KEEP_CACHE), or "cache" (answer every OPENDIR with those flags).
        A handler ``opendir`` method overrides both.
    ioctl_errno : the answer to every FUSE_IOCTL (ENOTTY: "not a terminal", what isatty()
        wants to hear; the kernel forwards every ioctl regardless of earlier answers).
    xattr : "enosys" (the kernel stops asking and reports EOPNOTSUPP itself) or "empty"
        (GETXATTR -> ENODATA, LISTXATTR -> an empty list, every time). Handler
        ``getxattr``/``listxattr`` methods override both.
    """

    opendir: str = "enosys"
    ioctl_errno: int = errno.ENOTTY
    xattr: str = "enosys"

    def __post_init__(self) -> None:
        if self.opendir not in ("enosys", "cache"):
            raise ValueError(f"opendir must be 'enosys' or 'cache', not {self.opendir!r}")
        if self.xattr not in ("enosys", "empty"):
            raise ValueError(f"xattr must be 'enosys' or 'empty', not {self.xattr!r}")


def _as_bytes_like(r: Any) -> tuple[Any, int]:
    """(buffer, its length in bytes) for a payload that is not bytes, bytearray or int.

    A memoryview or numpy array may hold items wider than a byte: the reply header needs
    bytes (a wrong length makes the kernel refuse the reply without ending the request, and
    its caller would wait forever). Non-contiguous buffers raise TypeError (answered EIO).
    """
    mv = r if r.__class__ is memoryview else memoryview(r)
    if not mv.c_contiguous:
        raise TypeError("a reply payload must be a contiguous buffer")
    if mv.itemsize != 1 or mv.ndim != 1:
        mv = mv.cast("B")
    return mv, mv.nbytes


_READ_HEAD = struct.Struct("=QQI")  # fh offset size (of fuse_read_in)
_U64 = struct.Struct("=Q")
_RELEASE_HEAD = struct.Struct("=Q")  # fh
_NO_HANDLER = errno.ENOSYS

#: What the engine answers for each opcode when nothing else is defined for it.
_ENOSYS_OPS = frozenset({
    Op.FLUSH, Op.POLL, Op.LSEEK, Op.BMAP, Op.GETLK, Op.SETLK, Op.SETLKW, Op.SYNCFS,
    Op.STATX, Op.SETUPMAPPING, Op.REMOVEMAPPING, Op.FSYNC, Op.FSYNCDIR,
})


class Dispatcher:
    """Serves requests from one /dev/fuse descriptor with one handler.

    ``row`` is this worker's counters row (a memoryview of u64, see counters.py) or None.
    The dispatcher never closes ``fd``.
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
        self.table: list[Callable[[int, int, int], Any]] = self._build_table()

    # ----------------------------------------------------------------------------------------
    # op functions: (unique, nodeid, end) -> payload | int errno | None; the body is buf[40:end]

    def _build_table(self) -> list[Callable[[int, int, int], Any]]:
        h = self.handler
        buf = self.buf
        mv = self.mv
        opts = self.options
        unpack_read = _READ_HEAD.unpack_from

        def method(name: str) -> Callable[..., Any] | None:
            m = getattr(h, name, None)
            return m if callable(m) else None

        def name_at(start: int, end: int) -> bytes:
            # a NUL-terminated name occupying buf[start:end]
            if end <= start + 1 or buf[end - 1] != 0:
                raise Malformed("name without its NUL")
            return bytes(mv[start:end - 1])

        def const(value: Any) -> Callable[[int, int, int], Any]:
            def op(unique: int, nodeid: int, end: int) -> Any:
                return value
            return op

        table: list[Callable[[int, int, int], Any]] = [const(errno.ENOSYS)] * 64

        lookup = method("lookup")
        if lookup is not None:
            def op_lookup(unique: int, nodeid: int, end: int) -> Any:
                if end <= 41 or buf[end - 1] != 0:
                    raise Malformed("LOOKUP name without its NUL")
                return lookup(nodeid, bytes(mv[40:end - 1]))
            table[Op.LOOKUP] = op_lookup

        getattr_ = method("getattr")
        if getattr_ is not None:
            def op_getattr(unique: int, nodeid: int, end: int) -> Any:
                if end < 56:
                    raise Malformed("GETATTR shorter than fuse_getattr_in")
                return getattr_(nodeid)
            table[Op.GETATTR] = op_getattr

        readlink = method("readlink")
        if readlink is not None:
            table[Op.READLINK] = lambda unique, nodeid, end: readlink(nodeid)

        def sized(data: Any, size: int, what: str, nodeid: int, offset: int,
                  plus: bool | None) -> Any:
            """A READ/READDIR(PLUS) payload as bytes-like, at most ``size`` bytes: a longer
            one is counted, logged and trimmed (to whole records for listings; the kernel
            would refuse the whole reply)."""
            cls = data.__class__
            if not (cls is bytes or cls is int or (cls is memoryview and data.ndim == 1
                                                   and data.itemsize == 1)):
                data = _as_bytes_like(data)[0]
            if data.__class__ is not int and len(data) > size:
                self.row[C.OVERSIZED] += 1
                self.rlog(f"oversized {what}", logging.WARNING,
                          "handler %s(%d, %d, %d) returned %d bytes; trimmed", what, nodeid,
                          offset, size, len(data))
                data = memoryview(data)[:size] if plus is None else fit_records(data, size,
                                                                                 plus)
            return data

        read = method("read")
        if read is not None:
            def op_read(unique: int, nodeid: int, end: int) -> Any:
                if end < 80:
                    raise Malformed("READ shorter than fuse_read_in")
                _fh, offset, size = unpack_read(buf, 40)
                return sized(read(nodeid, offset, size), size, "read", nodeid, offset, None)
            table[Op.READ] = op_read

        for opcode, mname, plus in ((Op.READDIRPLUS, "readdirplus", True),
                                    (Op.READDIR, "readdir", False)):
            fn = method(mname)
            if fn is None:
                continue

            def op_readdir(unique: int, nodeid: int, end: int, fn: Any = fn,
                           plus: bool = plus, mname: str = mname) -> Any:
                if end < 80:
                    raise Malformed("READDIR shorter than fuse_read_in")
                _fh, offset, size = unpack_read(buf, 40)
                return sized(fn(nodeid, offset, size), size, mname, nodeid, offset, plus)
            table[opcode] = op_readdir

        statfs = method("statfs")
        if statfs is not None:
            table[Op.STATFS] = lambda unique, nodeid, end: statfs()
        else:
            table[Op.STATFS] = const(pack_statfs_out(blocks=0, namelen=255))

        open_ = method("open")
        if open_ is not None:
            def op_open(unique: int, nodeid: int, end: int) -> Any:
                if end < 48:
                    raise Malformed("OPEN shorter than fuse_open_in")
                return open_(nodeid, OPEN_IN.unpack_from(buf, 40)[0])
            table[Op.OPEN] = op_open
        # else ENOSYS: the kernel switches to zero-message open (no OPEN, no RELEASE again)

        opendir = method("opendir")
        if opendir is not None:
            def op_opendir(unique: int, nodeid: int, end: int) -> Any:
                if end < 48:
                    raise Malformed("OPENDIR shorter than fuse_open_in")
                return opendir(nodeid, OPEN_IN.unpack_from(buf, 40)[0])
            table[Op.OPENDIR] = op_opendir
        elif opts.opendir == "cache":
            table[Op.OPENDIR] = const(pack_open_out(0, FOPEN_CACHE_DIR | FOPEN_KEEP_CACHE))

        for opcode, mname in ((Op.RELEASE, "release"), (Op.RELEASEDIR, "releasedir")):
            fn = method(mname)
            if fn is None:
                table[opcode] = const(b"")
            else:
                def op_release(unique: int, nodeid: int, end: int, fn: Any = fn) -> Any:
                    if end < 48:
                        raise Malformed("RELEASE shorter than fuse_release_in")
                    r = fn(nodeid, _RELEASE_HEAD.unpack_from(buf, 40)[0])
                    return b"" if r is None else r
                table[opcode] = op_release

        access = method("access")
        if access is not None:
            def op_access(unique: int, nodeid: int, end: int) -> Any:
                if end < 48:
                    raise Malformed("ACCESS shorter than fuse_access_in")
                r = access(nodeid, ACCESS_IN.unpack_from(buf, 40)[0])
                return b"" if r is None else r
            table[Op.ACCESS] = op_access

        getxattr = method("getxattr")
        if getxattr is not None:
            def op_getxattr(unique: int, nodeid: int, end: int) -> Any:
                if end < 49:
                    raise Malformed("GETXATTR shorter than fuse_getxattr_in")
                size = GETXATTR_IN.unpack_from(buf, 40)[0]
                return getxattr(nodeid, name_at(48, end), size)
            table[Op.GETXATTR] = op_getxattr
        elif opts.xattr == "empty":
            table[Op.GETXATTR] = const(errno.ENODATA)
        listxattr = method("listxattr")
        if listxattr is not None:
            def op_listxattr(unique: int, nodeid: int, end: int) -> Any:
                if end < 48:
                    raise Malformed("LISTXATTR shorter than fuse_getxattr_in")
                return listxattr(nodeid, GETXATTR_IN.unpack_from(buf, 40)[0])
            table[Op.LISTXATTR] = op_listxattr
        elif opts.xattr == "empty":
            zero = GETXATTR_OUT.pack(0, 0)

            def op_listxattr_empty(unique: int, nodeid: int, end: int) -> Any:
                if end < 48:
                    raise Malformed("LISTXATTR shorter than fuse_getxattr_in")
                # size 0 asks for the length of the list: 0; else the (empty) list itself
                return zero if GETXATTR_IN.unpack_from(buf, 40)[0] == 0 else b""
            table[Op.LISTXATTR] = op_listxattr_empty

        forget = method("forget")

        def op_forget(unique: int, nodeid: int, end: int) -> None:
            if end < 48:
                raise Malformed("FORGET shorter than fuse_forget_in")
            if forget is not None:
                forget([(nodeid, FORGET_IN.unpack_from(buf, 40)[0])])
        table[Op.FORGET] = op_forget

        def op_batch_forget(unique: int, nodeid: int, end: int) -> None:
            if end < 48:
                raise Malformed("BATCH_FORGET shorter than fuse_batch_forget_in")
            count = BATCH_FORGET_IN.unpack_from(buf, 40)[0]
            if 48 + count * 16 > end:
                raise Malformed(f"BATCH_FORGET of {count} entries in {end} bytes")
            if forget is not None and count:
                forget(list(FORGET_ONE.iter_unpack(mv[48:48 + count * 16])))
        table[Op.BATCH_FORGET] = op_batch_forget

        # INTERRUPT: every request is answered by the worker that read it, whether or not an
        # interrupt for it arrives, so an interrupt needs no answer (the kernel waits for the
        # original request's reply, or has already dropped it and ignores that reply).
        table[Op.INTERRUPT] = const(None)
        table[Op.NOTIFY_REPLY] = const(None)

        def op_destroy(unique: int, nodeid: int, end: int) -> Any:
            self.destroyed = True
            return b""
        table[Op.DESTROY] = op_destroy

        ioctl_errno = opts.ioctl_errno if 0 < opts.ioctl_errno < 512 else errno.ENOTTY
        ioctl = method("ioctl")
        if ioctl is None:
            table[Op.IOCTL] = const(ioctl_errno)
        else:
            # A handler that wants to see ioctls (Python's open() sends one per file, a
            # sign of which file a reader is at) only looks; the answer stays the same.
            def op_ioctl(unique: int, nodeid: int, end: int) -> Any:
                r = ioctl(nodeid)
                return ioctl_errno if r is None else r
            table[Op.IOCTL] = op_ioctl
        table[Op.INIT] = const(errno.EPROTO)  # INIT is answered once, by the supervisor

        for opcode in WRITE_OPS:
            table[opcode] = const(errno.EROFS)
        lseek = method("lseek")
        for opcode in _ENOSYS_OPS:
            table[opcode] = const(errno.ENOSYS)
        if lseek is not None:
            def op_lseek(unique: int, nodeid: int, end: int) -> Any:
                if end < 64:
                    raise Malformed("LSEEK shorter than fuse_lseek_in")
                _fh, offset, whence, _pad = struct.unpack_from("=QQII", buf, 40)
                return lseek(nodeid, offset, whence)
            table[Op.LSEEK] = op_lseek
        return table

    # ----------------------------------------------------------------------------------------

    def _failure(self, exc: Exception, n: int, unique: int) -> int | None:
        """The errno to answer for a request whose dispatch raised ``exc`` (None: drop it)."""
        if isinstance(exc, FuseErrno):
            return exc.errno
        if isinstance(exc, Malformed):
            self.row[C.MALFORMED] += 1
            if n < 16:
                self.rlog("malformed", logging.WARNING, "dropped a malformed request: %s", exc)
                return None
            unique = _U64.unpack_from(self.buf, 8)[0]
            self.rlog("malformed", logging.WARNING,
                      "malformed request (unique %d): %s; answered EIO", unique, exc)
            return errno.EIO
        self.row[C.HANDLER_ERROR] += 1
        op = IN_HEADER.unpack_from(self.buf)[1] if n >= IN_HEADER_SIZE else 0
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
            self.row[op if op < 64 else 0] += 1
            r = self.table[op](unique, nodeid, end) if op < 64 else errno.ENOSYS
        except Exception as exc:  # noqa: BLE001 - a handler bug is answered EIO, logged
            r = self._failure(exc, n, unique)
            if n >= 16:
                unique = _U64.unpack_from(self.buf, 8)[0]
        if r is None:
            return
        self._reply(unique, r)

    def _reply(self, unique: int, r: Any) -> None:
        try:
            if r.__class__ is int:
                os.write(self.fd, OUT_HEADER.pack(16, -(r if 0 < r < 512 else errno.EIO),
                                                  unique))
            elif r.__class__ is bytes or r.__class__ is bytearray:
                os.writev(self.fd, (OUT_HEADER.pack(16 + len(r), 0, unique), r))
            else:
                buf, nbytes = _as_bytes_like(r)
                os.writev(self.fd, (OUT_HEADER.pack(16 + nbytes, 0, unique), buf))
        except OSError as exc:
            self._reply_failed(exc, unique)
        except (TypeError, ValueError, BufferError):
            self.row[C.HANDLER_ERROR] += 1
            self.rlog("handler type", logging.ERROR,
                      "handler returned %s, not a bytes-like payload (unique %d); answered EIO",
                      type(r).__name__, unique)
            self._reply(unique, errno.EIO)

    def _reply_failed(self, exc: OSError, unique: int) -> None:
        if exc.errno == errno.ENOENT:
            # the request was interrupted or aborted meanwhile; the kernel no longer wants it
            self.row[C.STALE_REPLY] += 1
        elif exc.errno == errno.ENODEV:
            raise ConnectionGone() from exc
        else:
            self.row[C.REPLY_ERROR] += 1
            self.rlog("reply", logging.ERROR, "reply to request %d failed: %s", unique, exc)

    def run(self) -> None:
        """Serve until the connection is gone (returns) or a BaseException escapes.

        The common case of :meth:`handle` inlined into the read loop, for speed; anything
        unusual (a short or inconsistent request, extensions) goes through :meth:`handle`.
        """
        fd = self.fd
        buf = self.buf
        bufs = [buf]
        row = self.row
        table = self.table
        readv = os.readv
        write = os.write
        writev = os.writev
        unpack_in = IN_HEADER.unpack_from
        pack_out = OUT_HEADER.pack
        ENOSYS = errno.ENOSYS
        EIO = errno.EIO
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
                if length != n or extlen:
                    self.handle(n)
                    continue
                row[op if op < 64 else 0] += 1
                try:
                    r = table[op](unique, nodeid, n) if op < 64 else ENOSYS
                except FuseErrno as exc:
                    r = exc.errno
                except Exception as exc:  # noqa: BLE001 - answered EIO, logged
                    r = self._failure(exc, n, unique)
                if r is None:
                    continue
                cls = r.__class__
                try:
                    if cls is int:
                        write(fd, pack_out(16, -r if 0 < r < 512 else -EIO, unique))
                    elif cls is bytes or (cls is memoryview and r.itemsize == 1
                                          and r.ndim == 1 and r.c_contiguous):
                        writev(fd, (pack_out(16 + len(r), 0, unique), r))
                    else:
                        self._reply(unique, r)  # numpy arrays, wide memoryviews, errors
                except OSError as exc:
                    self._reply_failed(exc, unique)
        except ConnectionGone:
            return
