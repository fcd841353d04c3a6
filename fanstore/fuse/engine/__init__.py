"""A multi-process FUSE engine speaking the Linux kernel's FUSE protocol directly.

No libfuse, pyfuse3 or trio: requests are read from ``/dev/fuse`` with ``os.readv`` into a
preallocated buffer, parsed with precompiled structs, dispatched by opcode to a *handler*,
and answered with ``os.writev``. After INIT the supervisor forks K workers that each read
the same connection through their own cloned descriptor. This package imports nothing from
FanStore except :mod:`fanstore.errors` (MountError), :mod:`fanstore.unixsock` (the
hand-off socket's address) and :mod:`fanstore.fuseflags` (the INIT flags by name, with the
``+NAME,-NAME`` edits of them); tests/test_layers.py holds it to that.

Modules, lowest first: :mod:`.proto` (the protocol's layouts, constants and scalar
packers), :mod:`.records` (numpy packers: EntryTable, DirListing), :mod:`.counters` (per-op
request counts in shared memory), :mod:`.optable` (the opcode table: each opcode's handler
method and request struct; the op functions built from a handler), :mod:`.dispatch` (the
worker loop: one size check, one reply writer), :mod:`.notify` (NOTIFY_STORE / INVAL_*),
:mod:`.mount` (mount(2), fusermount3, unmount, stale mounts), :mod:`.handshake` (INIT),
:mod:`.handoff` (the socket that hands the connection to workers not forked here),
:mod:`.supervisor` (forked and external workers, channels, the crash loop) and
:mod:`.session` (a mount: the connection, INIT, then the supervisor). An in-memory file
system on it, with its command line, is the engine's test double: ``tests/kernel_memfs.py``.

Using it
--------
::

    from fanstore.fuse.engine import KernelSession, MountOptions, InitOptions, EngineOptions

    session = KernelSession("/mnt/x", MountOptions(fsname="fanstore", read_only=True))
    session.mount()                                  # cleans a stale mount first
    try:
        reason = session.serve(handler_factory, workers=4,
                               on_ready=lambda s: print("ready", s.conn.describe()))
    finally:
        session.close()                              # unmounts if still mounted

``serve`` blocks until the mount ends ("unmounted" from outside, or "stopped" by
SIGTERM/SIGINT/SIGHUP or ``session.stop()``); it raises MountError on a worker crash loop.
``handler_factory`` runs in each worker after the fork (open files and sockets there),
with a :class:`WorkerContext` (slot, fd, conn, notify helpers) if it takes one argument.
``session.requests`` and ``session.requests_by_op`` sum the workers' counters (pass
``counters_path`` to read them from another process with :class:`RequestCounters.attach`).

The handler interface
---------------------
A plain object; each method is called in a worker, gets node ids as the kernel sends them
(the root is 1 = :data:`proto.ROOT_ID`), and returns a ready-to-write bytes-like payload
(bytes, bytearray, memoryview, a C-contiguous numpy array of any dtype: its byte length is
what counts) or raises ``FuseErrno(errno)``. Returning a positive ``int`` errno instead of
raising is allowed as a fast path. Any other exception is logged and answered EIO. A
missing method answers ENOSYS. The fastest payloads are ``bytes`` and 1-D byte
memoryviews (slices of one prebuilt blob, as :class:`EntryTable` and :class:`DirListing`
return): they are written as they are, without a copy.

Where to build what: load the index and build the entry tables and listings *before*
``serve()`` (in the supervisor): the forked workers share those pages copy-on-write and are
ready at once. Open per-worker resources (files, sockets) in ``handler_factory``.
Requests that arrive while a worker builds its handler simply wait in the kernel's queue.
``serve()`` forks: call it before starting threads of your own (only the calling thread
exists in a worker), and keep the supervisor's work light (it must answer signals).

``lookup(parent: int, name: bytes) -> entry_out``
    A packed ``fuse_entry_out`` (128 bytes): :meth:`EntryTable.entry`, or
    :func:`proto.pack_entry_out`; :func:`proto.negative_entry` caches "no such name".
``getattr(nodeid: int) -> attr_out``
    A packed ``fuse_attr_out`` (104 bytes): :meth:`EntryTable.attr_out` /
    :func:`proto.pack_attr_out`.
``readlink(nodeid: int) -> bytes``
    The target, without a NUL.
``read(nodeid: int, offset: int, size: int) -> bytes-like``
    At most ``size`` bytes (short at EOF, empty past it; longer is trimmed and counted).
    With zero-message open (the default, no ``open`` method) there is no file handle:
    everything is keyed by nodeid.
``readdirplus(nodeid: int, offset: int, size: int) -> bytes-like``
    Packed ``fuse_direntplus`` records totalling <= ``size``, starting at the entry whose
    cookie is ``offset`` (empty = end). :meth:`DirListing.plus` does exactly this from a
    listing packed once with numpy. Entries with nodeid 0 (use it for "." and "..") give
    names without priming the kernel's caches; every other entry counts as a LOOKUP.
``readdir(nodeid, offset, size)``
    The same with ``fuse_dirent`` records (:meth:`DirListing.plain`); only used if
    DO_READDIRPLUS is switched off.
``statfs() -> bytes``
    A packed ``fuse_statfs_out`` (:func:`proto.pack_statfs_out`).
``access(nodeid: int, mask: int) -> None``
    Optional; with ``default_permissions`` (always set) the kernel checks permissions
    itself and does not send ACCESS.
``open(nodeid: int, flags: int) -> open_out`` / ``opendir(nodeid, flags)``
    Optional. Defining ``open`` turns zero-message open off: every open() then costs an
    OPEN and a RELEASE round trip. Return :func:`proto.pack_open_out` (fh, FOPEN_* flags).
``release(nodeid, fh)``, ``releasedir(nodeid, fh)``, ``forget(pairs)``, ``getxattr(nodeid,
name, size)``, ``listxattr(nodeid, size)``, ``lseek(nodeid, offset, whence)``
    Optional. ``forget`` gets a list of ``(nodeid, nlookup)``; no reply is sent.
``ioctl(nodeid: int) -> None``
    Optional: called for every FUSE_IOCTL (Python's default ``open()`` sends one per file:
    a sign of which file a reader is at); the answer stays the engine's (ENOTTY) unless it
    returns a payload or an errno.

The engine itself answers: IOCTL (ENOTTY), FLUSH/FSYNC/FSYNCDIR/POLL/LSEEK/BMAP/locks/
SYNCFS/STATX (ENOSYS, so the kernel stops sending most of them), every write opcode
(EROFS), OPENDIR (ENOSYS or cached, :class:`EngineOptions`), GETXATTR/LISTXATTR (ENOSYS or
ENODATA/empty), INTERRUPT/FORGET/BATCH_FORGET (no reply), DESTROY, and any unknown opcode
(ENOSYS).

INIT flags
----------
:data:`DEFAULT_INIT_FLAGS`: ASYNC_READ, NO_OPEN_SUPPORT, NO_OPENDIR_SUPPORT,
PARALLEL_DIROPS, MAX_PAGES (max_pages 256 = 1 MiB per READ), CACHE_SYMLINKS,
DO_READDIRPLUS (always, not READDIRPLUS_AUTO); no AUTO_INVAL_DATA, no WRITEBACK_CACHE;
time_gran 1. Configurable with :class:`InitOptions`. Protocol 7.31 or newer is accepted;
the engine answers with min(kernel minor, 38).
"""

from .counters import RequestCounters
from .dispatch import Dispatcher
from .handshake import DEFAULT_INIT_FLAGS, ConnInfo, InitOptions
from .mount import MountOptions, cleanup_stale, is_mounted, mount_state, unmount
from .notify import notify_inval_entry, notify_inval_inode, notify_store
from .optable import EngineOptions, FuseErrno
from .records import DirListing, EntryTable
from .session import KernelSession
from .supervisor import WorkerContext

__all__ = [
    "DEFAULT_INIT_FLAGS",
    "ConnInfo",
    "DirListing",
    "Dispatcher",
    "EngineOptions",
    "EntryTable",
    "FuseErrno",
    "InitOptions",
    "KernelSession",
    "MountOptions",
    "RequestCounters",
    "WorkerContext",
    "cleanup_stale",
    "is_mounted",
    "mount_state",
    "notify_inval_entry",
    "notify_inval_inode",
    "notify_store",
    "unmount",
]
