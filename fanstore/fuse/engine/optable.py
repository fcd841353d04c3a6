"""The opcode table: what each opcode's request holds, and who answers it.

:data:`OPCODES` has a row for every opcode a handler may answer: the handler method, and
the request struct of :mod:`.proto` its body starts with (and whether a NUL-terminated name
follows it). From the rows the dispatcher derives, per opcode, the shortest request it
accepts (``IN_HEADER_SIZE + struct.size``, plus 2 for a name: one byte and its NUL) and
checks it in one place (:class:`~.dispatch.Dispatcher`), before the op function runs: a
shorter request is :class:`Malformed` (answered EIO). Op functions then read their struct at
:data:`BODY` without checking again. Opcodes answered without reading the body (the engine's
own answers: ENOSYS, EROFS, ...) accept any length.

:func:`build_ops` turns a handler into op functions, one per opcode, indexed by opcode:
``(unique, nodeid, end) -> payload | int errno | None`` where

- a bytes-like payload is a success, the payload follows the header;
- an ``int`` errno > 0 is an error reply (header only), the cheapest answer there is;
- ``None`` is no reply (FORGET, BATCH_FORGET, INTERRUPT, NOTIFY_REPLY).

Handler methods return bytes-like payloads or raise :class:`FuseErrno`; as a fast path they
may also return a positive ``int`` errno instead of raising. A READ/READDIR(PLUS) payload
larger than the size the kernel asked for is trimmed here (the kernel would refuse the whole
reply with EINVAL).

Adding an operation: its request struct in :mod:`.proto`, its row here, its op function in
one of the ``_*_ops`` groups :func:`build_ops` calls.
"""

from __future__ import annotations

import errno
import logging
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

from . import counters as C
from .proto import (
    ACCESS_IN,
    BATCH_FORGET_IN,
    FOPEN_CACHE_DIR,
    FOPEN_KEEP_CACHE,
    FORGET_IN,
    FORGET_ONE,
    GETATTR_IN,
    GETXATTR_IN,
    GETXATTR_OUT,
    IN_HEADER_SIZE,
    LSEEK_IN,
    OPEN_IN,
    READ_IN,
    READ_IN_HEAD,
    RELEASE_IN,
    WRITE_OPS,
    Op,
    pack_open_out,
    pack_statfs_out,
)
from .records import fit_records


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


def as_bytes_like(r: Any) -> tuple[Any, int]:
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


#: Where a request's body starts (after its fuse_in_header).
BODY = IN_HEADER_SIZE
#: Opcodes 0..OPS-1 have a place in the dispatch list (and a counters column); any other is
#: answered ENOSYS.
OPS = C.OP_COLS


class Row(NamedTuple):
    """One opcode's row of :data:`OPCODES`."""

    method: str  # the handler method that answers it (when the handler has one)
    body: struct.Struct | None  # the request struct its body starts with (None: none)
    name: bool = False  # a NUL-terminated name follows the struct

    @property
    def need(self) -> int:
        """The shortest request that carries this body."""
        return BODY + (self.body.size if self.body is not None else 0) + 2 * self.name


#: Every opcode a handler may answer, with what its request body holds (linux/fuse.h).
OPCODES: dict[int, Row] = {
    Op.LOOKUP: Row("lookup", None, name=True),
    Op.FORGET: Row("forget", FORGET_IN),  # answered by the engine (no reply) without one
    Op.GETATTR: Row("getattr", GETATTR_IN),
    Op.READLINK: Row("readlink", None),
    Op.OPEN: Row("open", OPEN_IN),
    Op.READ: Row("read", READ_IN),
    Op.STATFS: Row("statfs", None),
    Op.RELEASE: Row("release", RELEASE_IN),
    Op.GETXATTR: Row("getxattr", GETXATTR_IN, name=True),
    Op.LISTXATTR: Row("listxattr", GETXATTR_IN),
    Op.OPENDIR: Row("opendir", OPEN_IN),
    Op.READDIR: Row("readdir", READ_IN),
    Op.RELEASEDIR: Row("releasedir", RELEASE_IN),
    Op.ACCESS: Row("access", ACCESS_IN),
    Op.IOCTL: Row("ioctl", None),  # the handler only looks; its struct is not read
    Op.BATCH_FORGET: Row("forget", BATCH_FORGET_IN),  # count, then count fuse_forget_one
    Op.READDIRPLUS: Row("readdirplus", READ_IN),
    Op.LSEEK: Row("lseek", LSEEK_IN),
}

#: What the engine answers itself, whatever the handler: ENOSYS (the kernel stops sending
#: most of these), EROFS (WRITE_OPS), EPROTO (INIT: answered once, by the supervisor).
_ENOSYS_OPS = frozenset({
    Op.FLUSH, Op.POLL, Op.BMAP, Op.GETLK, Op.SETLK, Op.SETLKW, Op.SYNCFS,
    Op.STATX, Op.SETUPMAPPING, Op.REMOVEMAPPING, Op.FSYNC, Op.FSYNCDIR,
})

OpFunction = Callable[[int, int, int], Any]  # (unique, nodeid, end) -> payload | errno | None


class DispatchState(Protocol):
    """What the op functions use of their dispatcher (:class:`.dispatch.Dispatcher`)."""

    handler: Any
    buf: bytearray
    mv: memoryview
    options: EngineOptions
    need: list[int]
    row: Any
    destroyed: bool
    rlog: Callable[..., None]


def build_ops(d: DispatchState) -> list[OpFunction]:
    """The op function of every opcode below OPS for dispatcher ``d`` (its handler, buffer
    and options), filling ``d.need`` from :data:`OPCODES` as it goes.

    Op functions: ``(unique, nodeid, end) -> payload | int errno | None``; the body is
    ``d.buf[BODY:end]``, at least ``d.need[op]`` bytes of request long (checked before).
    """
    t = _TableBuilder(d)
    _namespace_ops(t)
    _data_ops(t)
    _open_release_ops(t)
    _xattr_ops(t)
    _forget_ops(t)
    _engine_answers(t)
    return t.table


def _const(value: Any) -> OpFunction:
    def op(unique: int, nodeid: int, end: int) -> Any:
        return value
    return op


class _TableBuilder:
    """The table being filled for one dispatcher, and what the op functions close over."""

    def __init__(self, d: DispatchState) -> None:
        self.d = d
        self.handler = d.handler
        self.buf = d.buf
        self.mv = d.mv
        self.options = d.options
        self.table: list[OpFunction] = [_const(errno.ENOSYS)] * OPS

    def method(self, op: int) -> Callable[..., Any] | None:
        """The handler's method for ``op``, if it has one."""
        m = getattr(self.handler, OPCODES[op].method, None)
        return m if callable(m) else None

    def put(self, op: int, fn: OpFunction, reads_body: bool = True) -> None:
        """``fn`` answers ``op``; if it reads the body, requests shorter than the
        opcode's row are refused before it runs."""
        self.table[op] = fn
        self.d.need[op] = OPCODES[op].need if reads_body else BODY


def _namespace_ops(t: _TableBuilder) -> None:
    """LOOKUP, GETATTR, READLINK, STATFS: answered by the handler's methods."""
    buf, mv = t.buf, t.mv
    lookup = t.method(Op.LOOKUP)
    if lookup is not None:
        def op_lookup(unique: int, nodeid: int, end: int) -> Any:
            if buf[end - 1] != 0:
                raise Malformed("LOOKUP name without its NUL")
            return lookup(nodeid, bytes(mv[BODY:end - 1]))
        t.put(Op.LOOKUP, op_lookup)

    getattr_ = t.method(Op.GETATTR)
    if getattr_ is not None:
        t.put(Op.GETATTR, lambda unique, nodeid, end: getattr_(nodeid))

    readlink = t.method(Op.READLINK)
    if readlink is not None:
        t.put(Op.READLINK, lambda unique, nodeid, end: readlink(nodeid))

    statfs = t.method(Op.STATFS)
    if statfs is not None:
        t.put(Op.STATFS, lambda unique, nodeid, end: statfs())
    else:
        t.put(Op.STATFS, _const(pack_statfs_out(blocks=0, namelen=255)), False)


def _data_ops(t: _TableBuilder) -> None:
    """READ, READDIR, READDIRPLUS (payloads trimmed to the size asked) and LSEEK."""
    d, buf = t.d, t.buf
    unpack_read = READ_IN_HEAD.unpack_from

    def sized(data: Any, size: int, what: str, nodeid: int, offset: int,
              plus: bool | None) -> Any:
        """A READ/READDIR(PLUS) payload as bytes-like, at most ``size`` bytes: a longer
        one is counted, logged and trimmed (to whole records for listings; the kernel
        would refuse the whole reply)."""
        cls = data.__class__
        if not (cls is bytes or cls is int or (cls is memoryview and data.ndim == 1
                                               and data.itemsize == 1)):
            data = as_bytes_like(data)[0]
        if data.__class__ is not int and len(data) > size:
            d.row[C.OVERSIZED] += 1
            d.rlog(f"oversized {what}", logging.WARNING,
                   "handler %s(%d, %d, %d) returned %d bytes; trimmed", what, nodeid,
                   offset, size, len(data))
            data = memoryview(data)[:size] if plus is None else fit_records(data, size,
                                                                             plus)
        return data

    read = t.method(Op.READ)
    if read is not None:
        def op_read(unique: int, nodeid: int, end: int) -> Any:
            _fh, offset, size = unpack_read(buf, BODY)
            return sized(read(nodeid, offset, size), size, "read", nodeid, offset, None)
        t.put(Op.READ, op_read)

    for opcode, plus in ((Op.READDIRPLUS, True), (Op.READDIR, False)):
        fn = t.method(opcode)
        if fn is None:
            continue
        mname = OPCODES[opcode].method

        def op_readdir(unique: int, nodeid: int, end: int, fn: Any = fn,
                       plus: bool = plus, mname: str = mname) -> Any:
            _fh, offset, size = unpack_read(buf, BODY)
            return sized(fn(nodeid, offset, size), size, mname, nodeid, offset, plus)
        t.put(opcode, op_readdir)

    lseek = t.method(Op.LSEEK)
    if lseek is not None:
        def op_lseek(unique: int, nodeid: int, end: int) -> Any:
            _fh, offset, whence, _pad = LSEEK_IN.unpack_from(buf, BODY)
            return lseek(nodeid, offset, whence)
        t.put(Op.LSEEK, op_lseek)


def _open_release_ops(t: _TableBuilder) -> None:
    """OPEN/OPENDIR, RELEASE/RELEASEDIR and ACCESS."""
    buf = t.buf
    for opcode in (Op.OPEN, Op.OPENDIR):
        fn = t.method(opcode)
        if fn is not None:
            t.put(opcode, lambda unique, nodeid, end, fn=fn:
                  fn(nodeid, OPEN_IN.unpack_from(buf, BODY)[0]))
    # no open method: ENOSYS, and the kernel switches to zero-message open (no OPEN, no
    # RELEASE again); the same for opendir unless the options answer it
    if t.method(Op.OPENDIR) is None and t.options.opendir == "cache":
        t.put(Op.OPENDIR, _const(pack_open_out(0, FOPEN_CACHE_DIR | FOPEN_KEEP_CACHE)),
              False)

    for opcode in (Op.RELEASE, Op.RELEASEDIR):
        fn = t.method(opcode)
        if fn is None:
            t.put(opcode, _const(b""), False)
        else:
            def op_release(unique: int, nodeid: int, end: int, fn: Any = fn) -> Any:
                r = fn(nodeid, RELEASE_IN.unpack_from(buf, BODY)[0])
                return b"" if r is None else r
            t.put(opcode, op_release)

    access = t.method(Op.ACCESS)
    if access is not None:
        def op_access(unique: int, nodeid: int, end: int) -> Any:
            r = access(nodeid, ACCESS_IN.unpack_from(buf, BODY)[0])
            return b"" if r is None else r
        t.put(Op.ACCESS, op_access)


def _xattr_ops(t: _TableBuilder) -> None:
    """GETXATTR/LISTXATTR: the handler's, or the ``xattr`` option's answer."""
    buf, mv = t.buf, t.mv
    getxattr = t.method(Op.GETXATTR)
    if getxattr is not None:
        def op_getxattr(unique: int, nodeid: int, end: int) -> Any:
            size = GETXATTR_IN.unpack_from(buf, BODY)[0]
            start = BODY + GETXATTR_IN.size  # a NUL-terminated name (need[] made it 2+)
            if buf[end - 1] != 0:
                raise Malformed("name without its NUL")
            return getxattr(nodeid, bytes(mv[start:end - 1]), size)
        t.put(Op.GETXATTR, op_getxattr)
    elif t.options.xattr == "empty":
        t.put(Op.GETXATTR, _const(errno.ENODATA), False)

    listxattr = t.method(Op.LISTXATTR)
    if listxattr is not None:
        t.put(Op.LISTXATTR, lambda unique, nodeid, end:
              listxattr(nodeid, GETXATTR_IN.unpack_from(buf, BODY)[0]))
    elif t.options.xattr == "empty":
        zero = GETXATTR_OUT.pack(0, 0)

        def op_listxattr_empty(unique: int, nodeid: int, end: int) -> Any:
            # size 0 asks for the length of the list: 0; else the (empty) list itself
            return zero if GETXATTR_IN.unpack_from(buf, BODY)[0] == 0 else b""
        t.put(Op.LISTXATTR, op_listxattr_empty)


def _forget_ops(t: _TableBuilder) -> None:
    """FORGET and BATCH_FORGET: never answered; passed to the handler if it listens."""
    buf, mv = t.buf, t.mv
    forget = t.method(Op.FORGET)

    def op_forget(unique: int, nodeid: int, end: int) -> None:
        if forget is not None:
            forget([(nodeid, FORGET_IN.unpack_from(buf, BODY)[0])])
    t.put(Op.FORGET, op_forget)

    first_one = BODY + BATCH_FORGET_IN.size

    def op_batch_forget(unique: int, nodeid: int, end: int) -> None:
        count = BATCH_FORGET_IN.unpack_from(buf, BODY)[0]
        stop = first_one + count * FORGET_ONE.size
        if stop > end:
            raise Malformed(f"BATCH_FORGET of {count} entries in {end} bytes")
        if forget is not None and count:
            forget(list(FORGET_ONE.iter_unpack(mv[first_one:stop])))
    t.put(Op.BATCH_FORGET, op_batch_forget)


def _engine_answers(t: _TableBuilder) -> None:
    """What the engine answers whatever the handler: INTERRUPT, NOTIFY_REPLY, DESTROY,
    IOCTL (the handler may only look), INIT, writes (EROFS) and the ENOSYS set."""
    d, table = t.d, t.table
    # INTERRUPT: every request is answered by the worker that read it, whether or not an
    # interrupt for it arrives, so an interrupt needs no answer (the kernel waits for the
    # original request's reply, or has already dropped it and ignores that reply).
    table[Op.INTERRUPT] = _const(None)
    table[Op.NOTIFY_REPLY] = _const(None)

    def op_destroy(unique: int, nodeid: int, end: int) -> Any:
        d.destroyed = True
        return b""
    table[Op.DESTROY] = op_destroy

    opts = t.options
    ioctl_errno = opts.ioctl_errno if 0 < opts.ioctl_errno < 512 else errno.ENOTTY
    ioctl = t.method(Op.IOCTL)
    if ioctl is None:
        table[Op.IOCTL] = _const(ioctl_errno)
    else:
        # A handler that wants to see ioctls (Python's open() sends one per file, a
        # sign of which file a reader is at) only looks; the answer stays the same.
        def op_ioctl(unique: int, nodeid: int, end: int) -> Any:
            r = ioctl(nodeid)
            return ioctl_errno if r is None else r
        t.put(Op.IOCTL, op_ioctl)
    table[Op.INIT] = _const(errno.EPROTO)  # INIT is answered once, by the supervisor

    for opcode in WRITE_OPS:
        table[opcode] = _const(errno.EROFS)
    for opcode in _ENOSYS_OPS:
        table[opcode] = _const(errno.ENOSYS)
