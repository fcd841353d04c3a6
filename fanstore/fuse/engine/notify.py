"""Kernel notifications: push data into a file's page cache, invalidate cached state.

A notification is written to any descriptor of the connection (the session fd or a worker's
clone) as ``fuse_out_header{len, error=<notify code>, unique=0}`` followed by its struct.
The write itself returns the kernel's verdict: these functions return 0, or the positive
errno the kernel gave (ENOENT: the inode is not in the kernel's inode cache, so there is
nothing to store into or invalidate).

Deadlock hazard of NOTIFY_STORE
-------------------------------
To store, the kernel locks each page it fills. A reader that misses the page cache locks the
pages of its read-ahead window first and then waits for the READ reply with the pages still
locked. If the process that writes the store is also the only one that would answer that
READ (for example: a worker storing, from inside a handler, the range of the very READ it is
serving; or a single-process server storing while a READ for the same pages sits unread in
the queue), the store waits for the page lock, the READ waits for the store, and both hang
forever.

How the multi-process engine avoids it: every worker answers requests on its own, and
stores are written by a process or thread that serves no requests (FanStore's prefetch
threads, one per worker: fanstore/fuse/kernelfs/orders.py; a dedicated thread with
:meth:`KernelSession.notify_fd`). A store that meets a locked page waits until some worker's
main thread answers the READ holding it, which it always does, because no main thread ever
waits on a store for long (FanStore's waits for a file being decoded are capped at 2 ms). Rules for handlers: never store from
inside ``read()`` into the range being read (it is locked by the request you are serving),
never store beyond the file's size (the kernel would grow the cached size), and prefer
stores from outside the workers.
"""

from __future__ import annotations

import errno
import os

from .proto import (
    NOTIFY_INVAL_ENTRY_OUT,
    NOTIFY_INVAL_INODE_OUT,
    NOTIFY_STORE_OUT,
    OUT_HEADER,
    Notify,
)

#: FUSE_NOTIFY_RESEND (kernel 6.9+, flags2 bit FUSE_HAS_RESEND): requeue every request that
#: was read but not answered yet. Not in the 7.38 header.
NOTIFY_RESEND = 7
HAS_RESEND = 1 << 39  # 64-bit INIT flag (flags2 bit 7)


def _send(fd: int, code: int, parts: list[bytes | memoryview]) -> int:
    size = OUT_HEADER.size + sum(len(p) for p in parts)
    try:
        os.writev(fd, [OUT_HEADER.pack(size, code, 0), *parts])
    except OSError as exc:
        return exc.errno or errno.EIO
    return 0


def notify_store(fd: int, nodeid: int, offset: int, data: bytes | memoryview) -> int:
    """Push ``data`` into the page cache of ``nodeid`` at ``offset`` (NOTIFY_STORE).

    See the module docstring for the deadlock hazard. Returns 0 or the kernel's errno.
    """
    return _send(fd, Notify.STORE, [NOTIFY_STORE_OUT.pack(nodeid, offset, len(data), 0), data])


def notify_inval_inode(fd: int, nodeid: int, offset: int = 0, length: int = 0) -> int:
    """Drop cached attributes and the data pages ``[offset, offset+length)`` of ``nodeid``.

    ``length == 0`` means to the end of the file; a negative ``offset`` invalidates only the
    attributes.
    """
    return _send(fd, Notify.INVAL_INODE, [NOTIFY_INVAL_INODE_OUT.pack(nodeid, offset, length)])


def notify_inval_entry(fd: int, parent: int, name: bytes) -> int:
    """Drop the kernel's cached dentry ``name`` in directory ``parent``."""
    return _send(fd, Notify.INVAL_ENTRY,
                 [NOTIFY_INVAL_ENTRY_OUT.pack(parent, len(name), 0), name + b"\0"])


def notify_resend(fd: int) -> int:
    """Ask the kernel to requeue every request read but not yet answered (6.9+).

    Used by the supervisor after a worker died holding requests. Requests other workers are
    still serving are requeued too; their late replies then fail with ENOENT (counted as
    stale replies) and the requeued copies are served again: harmless for a read-only file
    system.
    """
    return _send(fd, NOTIFY_RESEND, [])
