"""The INIT handshake: what the engine asks the kernel for, and what the kernel grants.

The first request on a new connection is INIT. :func:`negotiate` reads it, answers it with
the :class:`InitOptions` the kernel offered (never more), and returns the :class:`ConnInfo`
both sides agreed on; a newer kernel major is asked to retry with ours, an older protocol
than ``min_minor`` is refused (EPROTO and MountError). After INIT, :func:`set_read_ahead`
raises the mount's read-ahead window through sysfs (the kernel offers only 128 KiB in
INIT), and :func:`request_bufsize` sizes every worker's receive buffer from what was
negotiated. :class:`Connection` is what a negotiated connection offers the supervisor.
"""

from __future__ import annotations

import errno
import logging
import os
import select
import time
from dataclasses import dataclass
from typing import Any, Protocol

from fanstore.errors import MountError

from . import mount as _mount
from .proto import (
    ASYNC_READ,
    CACHE_SYMLINKS,
    DO_READDIRPLUS,
    IN_HEADER,
    IN_HEADER_SIZE,
    INIT_EXT,
    INIT_IN,
    INIT_IN_V1,
    INIT_OUT_VERSION,
    KERNEL_MINOR_VERSION,
    KERNEL_VERSION,
    MAX_PAGES,
    MIN_KERNEL_MINOR,
    NO_OPEN_SUPPORT,
    NO_OPENDIR_SUPPORT,
    PAGE_SIZE,
    PARALLEL_DIROPS,
    WRITE_IN,
    Op,
    flag_names,
    out_header,
    pack_init_out,
)

log = logging.getLogger(__name__)

#: The INIT flags a read-only file system wants (see docs in the package docstring):
#: asynchronous (parallel) reads, zero-message open and opendir, parallel lookups/readdir,
#: up to max_pages per request, cached symlinks, READDIRPLUS always (not "auto").
#: Deliberately absent: AUTO_INVAL_DATA (GETATTR storms), WRITEBACK_CACHE, POSIX_LOCKS,
#: FLOCK_LOCKS (the kernel handles locks locally), EXPORT_SUPPORT, POSIX_ACL, SPLICE_*.
DEFAULT_INIT_FLAGS = (ASYNC_READ | NO_OPEN_SUPPORT | NO_OPENDIR_SUPPORT | PARALLEL_DIROPS
                      | MAX_PAGES | CACHE_SYMLINKS | DO_READDIRPLUS)


@dataclass
class InitOptions:
    """What to ask for in the INIT reply (the kernel grants at most what it offered).

    Attributes
    ----------
    flags : 64-bit INIT flag word (bits 32..63 go to flags2 with FUSE_INIT_EXT).
    max_pages : pages per request (256 = one 1 MiB READ; the kernel caps it with the sysctl
        fs.fuse.max_pages_limit).
    max_readahead : bytes; the kernel uses min(this, what it offered).
    max_write : bytes; also sizes the receive buffer (the kernel refuses to hand a request
        to a buffer smaller than header + fuse_write_in + max_write).
    max_background, congestion_threshold : in-flight asynchronous (read-ahead) requests.
    time_gran : timestamp granularity in ns.
    min_minor : oldest kernel protocol minor accepted.
    max_minor : newest minor we answer with (the layouts we know).
    read_ahead_kb : the mount's read-ahead window, written to
        /sys/class/bdi/<dev>/read_ahead_kb after INIT (root only; None leaves the kernel's).
        The kernel offers only 128 KiB in INIT and max_readahead can only lower it, so
        without this a 1 MiB read() costs eight 128 KiB READs (measured); default:
        max_pages pages (one READ per 1 MiB read()).
    """

    flags: int = DEFAULT_INIT_FLAGS
    max_pages: int = 256
    max_readahead: int = 1 << 20
    max_write: int = 1 << 20
    max_background: int = 64
    congestion_threshold: int = 48
    time_gran: int = 1
    min_minor: int = MIN_KERNEL_MINOR
    max_minor: int = KERNEL_MINOR_VERSION
    read_ahead_kb: int | None = -1  # -1: max_pages * 4 KiB


@dataclass
class ConnInfo:
    """What INIT negotiated (available to on_ready and, through ctx, to handlers)."""

    kernel_major: int = 0
    kernel_minor: int = 0
    kernel_flags: int = 0  # 64-bit: what the kernel offered
    kernel_max_readahead: int = 0
    minor: int = 0  # what we answered with
    flags: int = 0  # 64-bit: what we asked for and the kernel offered
    max_readahead: int = 0
    max_write: int = 0
    max_pages: int = 0
    max_background: int = 0
    congestion_threshold: int = 0
    time_gran: int = 1
    read_ahead_kb: int = 0  # set through sysfs after INIT (0: the kernel's max_readahead)

    def has(self, flag: int) -> bool:
        return bool(self.flags & flag)

    def describe(self) -> str:
        return (f"protocol 7.{self.minor} (kernel 7.{self.kernel_minor}), "
                f"flags {'|'.join(flag_names(self.flags)) or '0'}, max_pages {self.max_pages}, "
                f"max_readahead {self.max_readahead}"
                + (f", read_ahead_kb {self.read_ahead_kb}" if self.read_ahead_kb else ""))


def negotiate(fd: int, init: InitOptions, where: str, timeout: float = 30.0) -> ConnInfo:
    """Read the kernel's INIT from the connection ``fd`` and answer it (``where``: the mount
    point, for messages). Requests other than INIT before it are answered EIO."""
    buf = bytearray(max(request_bufsize(init), 65536))
    while True:
        n = _read_request(fd, buf, timeout, where)
        if n < IN_HEADER_SIZE + INIT_IN_V1.size:
            raise MountError(f"{where}: short first request ({n} bytes)")
        _len, op, unique = IN_HEADER.unpack_from(buf)[:3]
        if op != Op.INIT:
            _reply_error(fd, unique, errno.EIO)
            continue
        major, minor, max_ra, flags = INIT_IN_V1.unpack_from(buf, IN_HEADER_SIZE)
        if major > KERNEL_VERSION:
            # a reply of only major and minor, ours, asks the kernel to retry INIT with it
            os.write(fd, out_header(INIT_OUT_VERSION.size, 0, unique)
                     + INIT_OUT_VERSION.pack(KERNEL_VERSION, 0))
            continue
        break
    flags2 = 0
    if flags & INIT_EXT and n >= IN_HEADER_SIZE + INIT_IN.size:
        flags2 = INIT_IN.unpack_from(buf, IN_HEADER_SIZE)[4]
    kflags = flags | (flags2 << 32)
    c = ConnInfo(kernel_major=major, kernel_minor=minor, kernel_flags=kflags,
                 kernel_max_readahead=max_ra)
    if major < KERNEL_VERSION or minor < init.min_minor:
        _reply_error(fd, unique, errno.EPROTO)
        raise MountError(f"{where}: kernel FUSE protocol {major}.{minor} is older "
                         f"than the 7.{init.min_minor} this engine needs")
    want = init.flags & ~INIT_EXT
    granted = want & kflags
    if kflags & INIT_EXT:
        granted |= INIT_EXT  # we read flags2, and our reply carries flags2
    else:
        granted &= 0xFFFFFFFF
    c.minor = min(minor, init.max_minor)
    c.flags = granted & ~INIT_EXT
    c.max_readahead = min(max_ra, init.max_readahead)
    c.max_pages = max(1, min(init.max_pages, 65535)) if granted & MAX_PAGES else 32
    c.max_write = max(PAGE_SIZE, init.max_write)
    c.max_background = max(1, min(init.max_background, 65535))
    c.congestion_threshold = max(1, min(init.congestion_threshold, c.max_background))
    c.time_gran = init.time_gran
    out = pack_init_out(minor=c.minor, max_readahead=c.max_readahead, flags=granted,
                        max_background=c.max_background,
                        congestion_threshold=c.congestion_threshold,
                        max_write=c.max_write, time_gran=c.time_gran,
                        max_pages=c.max_pages)
    try:
        os.writev(fd, [out_header(len(out), 0, unique), out])
    except OSError as exc:
        raise MountError(f"{where}: INIT reply refused: {exc.strerror}") from exc
    log.info("%s: %s", where, c.describe())
    return c


def _read_request(fd: int, buf: bytearray, timeout: float, where: str) -> int:
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise MountError(f"{where}: no INIT from the kernel in {timeout:.0f} s")
        r, _, _ = select.select([fd], [], [], left)
        if not r:
            continue
        try:
            return os.readv(fd, [buf])
        except OSError as exc:
            if exc.errno in (errno.EINTR, errno.EAGAIN, errno.ENOENT):
                continue
            if exc.errno == errno.ENODEV:
                raise MountError(f"{where}: unmounted before INIT") from exc
            raise MountError(f"{where}: reading INIT: {exc.strerror}") from exc


def _reply_error(fd: int, unique: int, err: int) -> None:
    try:
        os.write(fd, out_header(0, -err, unique))
    except OSError:
        pass


def request_bufsize(init: InitOptions, conn: ConnInfo | None = None) -> int:
    """The receive buffer a worker needs: the kernel refuses to hand a request to a buffer
    smaller than header + fuse_write_in + max_write; a page more for names and slack."""
    max_write = max(conn.max_write if conn is not None else 0, init.max_write)
    return IN_HEADER_SIZE + WRITE_IN.size + max_write + PAGE_SIZE


def set_read_ahead(mountpoint: str, init: InitOptions, conn: ConnInfo) -> None:
    """Raise the mount's read-ahead window to ``init.read_ahead_kb`` (default: max_pages
    pages) through /sys/class/bdi (root only; recorded in ``conn.read_ahead_kb``)."""
    kb = init.read_ahead_kb
    if kb is None:
        return
    if kb < 0:
        kb = conn.max_pages * PAGE_SIZE // 1024
    # the device number from mountinfo: a stat() would send a request from here
    dev = _mount.mount_device(mountpoint)
    path = f"/sys/class/bdi/{dev}/read_ahead_kb"
    if dev is None or not os.path.exists(path):
        log.debug("%s: no bdi for the mount (%s); read-ahead left as is", mountpoint, dev)
        return
    try:
        with open(path, "w") as f:
            f.write(str(int(kb)))
        conn.read_ahead_kb = int(kb)
    except OSError as exc:
        log.debug("%s: cannot set %s (%s); read-ahead stays %d KiB", mountpoint, path,
                  exc.strerror, conn.max_readahead // 1024)


class Connection(Protocol):
    """What the supervisor uses of its session (:class:`.session.KernelSession`): the
    connection, the negotiated limits, the counters and the policies it supervises by."""

    mountpoint: str
    fd: int
    conn: ConnInfo
    counters: Any
    engine: Any
    clone_fd: bool
    crash_limit: int
    crash_window: float
    stop_timeout: float
    mounted: bool

    def bufsize(self) -> int: ...

    def clone(self) -> int: ...

    def unmount_quietly(self) -> None: ...
