"""A mount served by K forked worker processes: mount, INIT, supervise, unmount.

Life of a :class:`KernelSession`::

    session = KernelSession(mountpoint, MountOptions(...), InitOptions(...))
    session.mount()                      # /dev/fuse connected; stale mounts cleaned first
    session.serve(handler_factory, workers=K, on_ready=callback)   # blocks
    session.close()

``serve`` answers INIT in the calling process (the *supervisor*), forks K workers, calls
``on_ready(session)``, and then only supervises until the mount ends:

- each worker gets its own descriptor on the connection (FUSE_DEV_IOC_CLONE, made by the
  supervisor per worker slot; the shared fd if the kernel refuses), builds its handler with
  ``handler_factory(ctx)`` *after* the fork, and serves requests with a
  :class:`~.dispatch.Dispatcher` until the device says ENODEV;
- a worker that dies unexpectedly is replaced (logged). The requests it had read but not
  answered are requeued with FUSE_NOTIFY_RESEND when the kernel has it (6.9+), else they
  fail with ECONNABORTED when its descriptor is closed, never hang. ``crash_limit`` deaths
  within ``crash_window`` seconds stop the mount and raise MountError;
- SIGTERM, SIGINT or SIGHUP to the supervisor (when ``serve`` runs in the main thread), or
  :meth:`KernelSession.stop` from another thread, unmount and stop every worker;
- an unmount from outside (``umount``, ``fusermount3 -u``) makes every worker see ENODEV
  and exit; ``serve`` then returns;
- workers never outlive the supervisor: PR_SET_PDEATHSIG(SIGKILL) plus a parent check
  right after fork. If the supervisor is SIGKILLed the mount is left stale (ENOTCONN); the
  next :meth:`KernelSession.mount` on it, or :func:`~.mount.cleanup_stale`, removes it.

Why the supervisor serves no requests: it must stay responsive to signals and worker deaths
(it sleeps in one poll() on pidfds and a wake-up pipe), and a handler that crashes the
process (a segfault in a codec) must not take the mount holder with it. Its cost is one
sleeping process.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import inspect
import logging
import os
import select
import signal
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Self

from fanstore.errors import MountError

from . import mount as _mount
from . import notify as _notify
from .counters import RequestCounters
from .dispatch import Dispatcher
from .optable import EngineOptions
from .proto import (
    ASYNC_READ,
    CACHE_SYMLINKS,
    DO_READDIRPLUS,
    FUSE_DEV_IOC_CLONE,
    IN_HEADER,
    IN_HEADER_SIZE,
    INIT_EXT,
    INIT_FLAG_NAMES,
    INIT_IN,
    INIT_IN_V1,
    KERNEL_MINOR_VERSION,
    KERNEL_VERSION,
    MAX_PAGES,
    MIN_KERNEL_MINOR,
    NO_OPEN_SUPPORT,
    NO_OPENDIR_SUPPORT,
    OUT_HEADER,
    PAGE_SIZE,
    PARALLEL_DIROPS,
    Op,
    flag_names,
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

_PR_SET_PDEATHSIG = 1
_libc = ctypes.CDLL(None, use_errno=True)


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


def parse_flags(text: str, base: int) -> int:
    """``+NAME,-NAME`` edits of an INIT flag word (names as in proto, e.g. -NO_OPEN_SUPPORT)."""
    flags = base
    by_name = {v: k for k, v in INIT_FLAG_NAMES.items()}
    for item in filter(None, (s.strip() for s in text.split(","))):
        sign, name = item[0], item[1:].upper()
        if sign not in "+-" or name not in by_name:
            raise ValueError(f"bad flag edit {item!r} (use +NAME or -NAME)")
        flags = flags | by_name[name] if sign == "+" else flags & ~by_name[name]
    return flags


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


@dataclass
class WorkerContext:
    """Handed to ``handler_factory(ctx)`` in each worker, after the fork.

    Attributes
    ----------
    slot : 1..K, stable across replacements of the worker in that slot.
    fd : this worker's descriptor on the connection (for notifications; never read it).
    conn : the negotiated :class:`ConnInfo`.
    generation : how many workers this slot has had before this one.
    workers : how many worker slots the session has.
    channel : with ``serve(channels=True)``, this worker's end of a message channel from
        the supervisor (a SOCK_SEQPACKET socket: one message per ``recvmsg``, descriptors
        may ride along; see :meth:`KernelSession.send`), else None.
    """

    slot: int
    fd: int
    conn: ConnInfo
    generation: int = 0
    workers: int = 1
    channel: socket.socket | None = None

    def notify_store(self, nodeid: int, offset: int, data: bytes | memoryview) -> int:
        return _notify.notify_store(self.fd, nodeid, offset, data)

    def notify_inval_inode(self, nodeid: int, offset: int = 0, length: int = 0) -> int:
        return _notify.notify_inval_inode(self.fd, nodeid, offset, length)


@dataclass
class _Slot:
    index: int
    fd: int = -1  # the clone (or shared) fd this slot's worker serves
    pid: int = 0
    pidfd: int = -1
    generation: int = 0
    cloned: bool = False
    channel: socket.socket | None = None  # the supervisor's end of the worker's channel


@dataclass
class _Exit:
    reason: str = "stopped"  # "stopped" | "unmounted" | "crash-loop" | "error"
    message: str = ""


EXIT_CONN_GONE = 0
EXIT_CRASH = 70
EXIT_FACTORY = 71
EXIT_ORPHAN = 72


class KernelSession:
    """One FUSE mount served by forked workers. See the module docstring.

    Attributes
    ----------
    mountpoint : absolute path.
    conn : :class:`ConnInfo` once INIT is answered.
    counters : :class:`RequestCounters` (rows: supervisor + worker slots) once serving.
    worker_pids : current worker pids by slot (1..K).
    exit_reason : why :meth:`serve` returned ("unmounted", "stopped"), or None.
    """

    def __init__(self, mountpoint: str, options: _mount.MountOptions | None = None,
                 init: InitOptions | None = None, engine: EngineOptions | None = None,
                 *, counters_path: str | None = None, clone_fd: bool = True,
                 crash_limit: int = 5, crash_window: float = 10.0,
                 stop_timeout: float = 5.0) -> None:
        self.mountpoint = os.path.abspath(mountpoint)
        self.options = options or _mount.MountOptions()
        self.init = init or InitOptions()
        self.engine = engine or EngineOptions()
        self.counters_path = counters_path
        self.clone_fd = clone_fd
        self.crash_limit = crash_limit
        self.crash_window = crash_window
        self.stop_timeout = stop_timeout
        self.fd = -1
        self.conn = ConnInfo()
        self.counters: RequestCounters | None = None
        self.exit_reason: str | None = None
        self._slots: list[_Slot] = []
        self._deaths: list[float] = []
        self._wake_r = -1
        self._wake_w = -1
        self._stop_requested = False
        self._serving = False
        self._supervisor_pid = 0
        self._mounted = False
        self._granted: list[int] = []
        self._channels = False
        self._external: Any = None  # the HandoffServer while serving external workers
        self._on_worker_start: Callable[[int], None] | None = None
        self._watch: dict[int, Callable[[], bool]] = {}

    # ----------------------------------------------------------------------------------------
    # mount / unmount

    def mount(self) -> int:
        """Clean a stale mount left on the mount point, then mount; returns the fd."""
        if self.fd >= 0:
            raise MountError(f"{self.mountpoint}: this session is already mounted")
        _mount.cleanup_stale(self.mountpoint)
        self.fd = _mount.mount(self.mountpoint, self.options)
        self._mounted = True
        return self.fd

    def unmount(self, lazy: bool = False) -> None:
        """Unmount (from the supervisor side); workers then see ENODEV and exit."""
        if self._mounted:
            _mount.unmount(self.mountpoint, lazy=lazy,
                           use_fusermount=None if os.geteuid() != 0 else False)
            self._mounted = False

    @property
    def worker_pids(self) -> dict[int, int]:
        return {s.index: s.pid for s in self._slots if s.pid}

    @property
    def requests(self) -> int:
        return self.counters.requests if self.counters else 0

    @property
    def requests_by_op(self) -> dict[str, int]:
        return self.counters.requests_by_op if self.counters else {}

    # ----------------------------------------------------------------------------------------
    # INIT

    def _read_request(self, buf: bytearray, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise MountError(f"{self.mountpoint}: no INIT from the kernel in {timeout:.0f} s")
            r, _, _ = select.select([self.fd], [], [], left)
            if not r:
                continue
            try:
                return os.readv(self.fd, [buf])
            except OSError as exc:
                if exc.errno in (errno.EINTR, errno.EAGAIN, errno.ENOENT):
                    continue
                if exc.errno == errno.ENODEV:
                    raise MountError(f"{self.mountpoint}: unmounted before INIT") from exc
                raise MountError(f"{self.mountpoint}: reading INIT: {exc.strerror}") from exc

    def negotiate(self, timeout: float = 30.0) -> ConnInfo:
        """Read the kernel's INIT and answer it (done by :meth:`serve`; public for tests)."""
        if self.fd < 0:
            raise MountError("mount() first")
        buf = bytearray(max(self._bufsize(), 65536))
        while True:
            n = self._read_request(buf, timeout)
            if n < IN_HEADER_SIZE + INIT_IN_V1.size:
                raise MountError(f"{self.mountpoint}: short first request ({n} bytes)")
            _len, op, unique = IN_HEADER.unpack_from(buf)[:3]
            if op != Op.INIT:
                self._reply_error(unique, errno.EIO)
                continue
            major, minor, max_ra, flags = INIT_IN_V1.unpack_from(buf, IN_HEADER_SIZE)
            if major > KERNEL_VERSION:
                # an 8-byte reply with our major asks the kernel to retry INIT with it
                os.write(self.fd, OUT_HEADER.pack(24, 0, unique)
                         + struct.pack("=II", KERNEL_VERSION, 0))
                continue
            break
        flags2 = 0
        if flags & INIT_EXT and n >= IN_HEADER_SIZE + INIT_IN.size:
            flags2 = INIT_IN.unpack_from(buf, IN_HEADER_SIZE)[4]
        kflags = flags | (flags2 << 32)
        c = self.conn = ConnInfo(kernel_major=major, kernel_minor=minor, kernel_flags=kflags,
                                 kernel_max_readahead=max_ra)
        if major < KERNEL_VERSION or minor < self.init.min_minor:
            self._reply_error(unique, errno.EPROTO)
            raise MountError(f"{self.mountpoint}: kernel FUSE protocol {major}.{minor} is older "
                             f"than the 7.{self.init.min_minor} this engine needs")
        want = self.init.flags & ~INIT_EXT
        granted = want & kflags
        if kflags & INIT_EXT:
            granted |= INIT_EXT  # we read flags2, and our reply carries flags2
        else:
            granted &= 0xFFFFFFFF
        c.minor = min(minor, self.init.max_minor)
        c.flags = granted & ~INIT_EXT
        c.max_readahead = min(max_ra, self.init.max_readahead)
        c.max_pages = max(1, min(self.init.max_pages, 65535)) if granted & MAX_PAGES else 32
        c.max_write = max(PAGE_SIZE, self.init.max_write)
        c.max_background = max(1, min(self.init.max_background, 65535))
        c.congestion_threshold = max(1, min(self.init.congestion_threshold, c.max_background))
        c.time_gran = self.init.time_gran
        out = pack_init_out(minor=c.minor, max_readahead=c.max_readahead, flags=granted,
                            max_background=c.max_background,
                            congestion_threshold=c.congestion_threshold,
                            max_write=c.max_write, time_gran=c.time_gran,
                            max_pages=c.max_pages)
        try:
            os.writev(self.fd, [OUT_HEADER.pack(16 + len(out), 0, unique), out])
        except OSError as exc:
            raise MountError(f"{self.mountpoint}: INIT reply refused: {exc.strerror}") from exc
        log.info("%s: %s", self.mountpoint, c.describe())
        return c

    def _reply_error(self, unique: int, err: int) -> None:
        try:
            os.write(self.fd, OUT_HEADER.pack(16, -err, unique))
        except OSError:
            pass

    def _bufsize(self) -> int:
        # header + fuse_write_in + max_write, plus a page for names and slack
        return IN_HEADER_SIZE + 40 + max(self.conn.max_write, self.init.max_write) + PAGE_SIZE

    # ----------------------------------------------------------------------------------------
    # serving

    def serve(self, handler_factory: Callable[..., Any], workers: int | None = None, *,
              on_ready: Callable[[KernelSession], None] | None = None,
              handle_signals: bool | None = None, channels: bool = False,
              watch: dict[int, Callable[[], bool]] | None = None,
              on_worker_start: Callable[[int], None] | None = None) -> str:
        """Answer INIT, fork ``workers`` workers, supervise until the mount ends.

        ``handler_factory`` is called in each worker after the fork, with a
        :class:`WorkerContext` if it accepts one argument, else with none. ``workers``
        defaults to the number of CPUs this process may run on. ``on_ready(session)`` runs
        in the supervisor once INIT is answered and the workers are forked.
        ``handle_signals`` (default: when called in the main thread) installs SIGTERM,
        SIGINT and SIGHUP handlers that stop the session, restored on return.

        ``channels``: give every worker a message channel from the supervisor
        (``ctx.channel``; :meth:`send`, :meth:`broadcast`). ``watch``: descriptors the
        supervisor also polls, each with a callback run in the supervisor when it is
        readable (it returns False to stop watching). ``on_worker_start(slot)`` runs in the
        supervisor after each worker starts, replacements included (to send it the state
        the others already have).

        Returns "unmounted" (the mount was removed from outside) or "stopped" (signal or
        :meth:`stop`). Raises MountError on a crash loop, after unmounting.
        """
        if self.fd < 0:
            raise MountError("mount() first")
        if self._serving:
            raise MountError("serve() is already running")
        nworkers = workers if workers is not None else len(os.sched_getaffinity(0))
        if nworkers < 1:
            raise MountError(f"workers must be at least 1, not {nworkers}")
        in_main = threading.current_thread() is threading.main_thread()
        if handle_signals is None:
            handle_signals = in_main
        if handle_signals and not in_main:
            raise MountError("signal handling needs serve() in the main thread")
        takes_ctx = _factory_takes_context(handler_factory)
        self._serving = True
        self._stop_requested = False
        self._supervisor_pid = os.getpid()
        self._channels = channels
        self._watch = dict(watch or {})
        self._on_worker_start = on_worker_start
        self._wake_r, self._wake_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        old_handlers: dict[int, Any] = {}
        result = _Exit()
        try:
            if handle_signals:
                for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
                    old_handlers[sig] = signal.signal(sig, self._on_signal)
            self.negotiate()
            self.counters = RequestCounters(1 + nworkers, self.counters_path)
            self.counters.row(0)[Op.INIT] += 1
            self._slots = [_Slot(i) for i in range(1, nworkers + 1)]
            for slot in self._slots:
                self._start_worker(slot, handler_factory, takes_ctx)
            for slot in self._slots:
                self._worker_started(slot.index)
            self._set_read_ahead()
            if on_ready is not None:
                on_ready(self)
            result = self._supervise(handler_factory, takes_ctx)
        except BaseException:
            self._shutdown_workers(unmount=True)
            raise
        finally:
            for sig, h in old_handlers.items():
                signal.signal(sig, h)
            for fd in (self._wake_r, self._wake_w):
                os.close(fd)
            self._wake_r = self._wake_w = -1
            self._serving = False
        self.exit_reason = result.reason
        if result.reason == "crash-loop":
            raise MountError(result.message)
        return result.reason

    def serve_external(self, socket_path: str, workers: int, *,
                       on_ready: Callable[[KernelSession], None] | None = None,
                       handle_signals: bool | None = None,
                       connect_timeout: float = 300.0,
                       extra_fds: list[int] | None = None,
                       grant_info: dict[str, Any] | None = None,
                       watch: dict[int, Callable[[], bool]] | None = None) -> str:
        """Answer INIT, then hand the connection to ``workers`` processes that connect to
        ``socket_path`` (:mod:`.handoff`: processes this one must not fork, such as MPI
        ranks), and supervise them until the mount ends.

        Returns "unmounted" (removed from outside: a worker says its connection is gone),
        or "stopped" (signal or :meth:`stop`). Raises MountError when the workers do not
        all connect within ``connect_timeout`` or every one of them is gone.

        ``extra_fds`` are sent to every worker with its descriptor (shared memory, say) and
        ``grant_info`` is added to its grant; the handoff connection is each worker's
        channel (:meth:`send`); ``watch`` as in :meth:`serve`.
        """
        from .handoff import HandoffServer

        if self.fd < 0:
            raise MountError("mount() first")
        if workers < 1:
            raise MountError(f"workers must be at least 1, not {workers}")
        in_main = threading.current_thread() is threading.main_thread()
        handle_signals = in_main if handle_signals is None else handle_signals
        self._serving = True
        self._stop_requested = False
        self._watch = dict(watch or {})
        self._wake_r, self._wake_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        old_handlers: dict[int, Any] = {}
        server = None
        try:
            if handle_signals:
                for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
                    old_handlers[sig] = signal.signal(sig, self._on_signal)
            self.negotiate()
            self.counters = RequestCounters(1 + workers, self.counters_path)
            self.counters.row(0)[Op.INIT] += 1
            server = HandoffServer(socket_path)
            info = dict(grant_info or {}, bufsize=self._bufsize(),
                        counters=self.counters_path, minor=self.conn.minor,
                        flags=self.conn.flags, workers=workers)
            server.accept(workers, self._grant, info, connect_timeout,
                          stop=lambda: self._stop_requested, extra_fds=extra_fds or [])
            self._external = server
            self._set_read_ahead()
            if on_ready is not None:
                on_ready(self)
            reason = self._supervise_external(server)
        except BaseException:
            if self._mounted:
                with contextlib.suppress(MountError):
                    self.unmount(lazy=True)
            raise
        finally:
            self._external = None
            if server is not None:
                server.close()
            for sig, h in old_handlers.items():
                signal.signal(sig, h)
            for fd in (self._wake_r, self._wake_w):
                os.close(fd)
            self._wake_r = self._wake_w = -1
            self._serving = False
        self.exit_reason = reason
        return reason

    def _grant(self, slot: int) -> int:
        """A descriptor for an external worker (sent, then closed here: the worker holds
        the only reference, so its death ends what it had read)."""
        fd = self._clone() if self.clone_fd else -1
        if fd < 0:
            fd = os.dup(self.fd)
        self._granted.append(fd)
        return fd

    def _supervise_external(self, server) -> str:
        for fd in self._granted:
            os.close(fd)  # sent: the workers hold them now
        self._granted.clear()
        poller = select.poll()
        poller.register(self._wake_r, select.POLLIN)
        self._register_watch(poller)
        by_fd = {}
        for slot, conn in server.workers.items():
            poller.register(conn.fileno(), select.POLLIN)
            by_fd[conn.fileno()] = (slot, conn)
        while True:
            if self._stop_requested:
                self.unmount_quietly()
                return "stopped"
            for fd, _ev in poller.poll():
                if fd == self._wake_r:
                    with contextlib.suppress(BlockingIOError):
                        while os.read(self._wake_r, 64):
                            pass
                    continue
                if fd in self._watch:
                    self._run_watch(poller, fd)
                    continue
                slot, conn = by_fd[fd]
                try:
                    data = conn.recv(16)
                except BlockingIOError:
                    continue
                except OSError:
                    data = b""
                poller.unregister(fd)
                del by_fd[fd]
                if data.startswith(b"U"):
                    log.info("%s: unmounted from outside", self.mountpoint)
                    self._mounted = False
                    return "unmounted"
                log.warning("%s: worker rank in slot %d is gone", self.mountpoint, slot)
                if self.conn.kernel_flags & _notify.HAS_RESEND:
                    _notify.notify_resend(self.fd)
                if not by_fd:
                    self.unmount_quietly()
                    raise MountError(f"{self.mountpoint}: every worker rank is gone; "
                                     "unmounted")

    def unmount_quietly(self) -> None:
        if self._mounted:
            try:
                self.unmount()
            except MountError as exc:
                log.warning("%s; unmounting lazily", exc)
                with contextlib.suppress(MountError):
                    self.unmount(lazy=True)

    def _set_read_ahead(self) -> None:
        kb = self.init.read_ahead_kb
        if kb is None:
            return
        if kb < 0:
            kb = self.conn.max_pages * PAGE_SIZE // 1024
        # the device number from mountinfo: a stat() would send a request from here
        dev = _mount.mount_device(self.mountpoint)
        path = f"/sys/class/bdi/{dev}/read_ahead_kb"
        if dev is None or not os.path.exists(path):
            log.debug("%s: no bdi for the mount (%s); read-ahead left as is",
                      self.mountpoint, dev)
            return
        try:
            with open(path, "w") as f:
                f.write(str(int(kb)))
            self.conn.read_ahead_kb = int(kb)
        except OSError as exc:
            log.debug("%s: cannot set %s (%s); read-ahead stays %d KiB", self.mountpoint,
                      path, exc.strerror, self.conn.max_readahead // 1024)

    def stop(self) -> None:
        """Ask a running :meth:`serve` to unmount and stop (thread- and signal-safe)."""
        self._stop_requested = True
        if self._wake_w >= 0:
            try:
                os.write(self._wake_w, b"s")
            except OSError:
                pass

    def _on_signal(self, signum: int, _frame: Any) -> None:
        log.info("%s: %s received; unmounting", self.mountpoint, signal.Signals(signum).name)
        self.stop()

    def notify_fd(self) -> int:
        """A new descriptor on this connection for notifications from outside the workers
        (a prefetch thread or process); the caller closes it. See notify.py's deadlock note.
        """
        if self.fd < 0:
            raise MountError("not mounted")
        fd = self._clone()
        return fd if fd >= 0 else os.dup(self.fd)

    def _clone(self) -> int:
        try:
            fd = os.open("/dev/fuse", os.O_RDWR | os.O_CLOEXEC)
        except OSError as exc:
            log.warning("cannot open /dev/fuse for a clone: %s", exc)
            return -1
        try:
            fcntl.ioctl(fd, FUSE_DEV_IOC_CLONE, struct.pack("=I", self.fd))
        except OSError as exc:
            os.close(fd)
            log.warning("FUSE_DEV_IOC_CLONE refused (%s); workers share one fd", exc)
            return -1
        return fd

    def _start_worker(self, slot: _Slot, factory: Callable[..., Any], takes_ctx: bool) -> None:
        if slot.fd < 0:
            fd = self._clone() if self.clone_fd else -1
            slot.cloned = fd >= 0
            slot.fd = fd if fd >= 0 else self.fd
        worker_end = None
        if self._channels:
            if slot.channel is not None:
                slot.channel.close()  # a fresh channel: nothing stale for the replacement
            slot.channel, worker_end = socket.socketpair(
                socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
            slot.channel.setblocking(False)
        pid = os.fork()
        if pid == 0:  # worker: never returns
            self._worker_main(slot, factory, takes_ctx, worker_end)
        if worker_end is not None:
            worker_end.close()
        slot.pid = pid
        slot.pidfd = os.pidfd_open(pid)
        os.set_inheritable(slot.pidfd, False)
        log.debug("worker %d started in slot %d (generation %d, fd %s)", pid, slot.index,
                  slot.generation, "clone" if slot.cloned else "shared")

    def _worker_main(self, slot: _Slot, factory: Callable[..., Any], takes_ctx: bool,
                     channel: socket.socket | None = None) -> None:
        code = EXIT_CRASH
        try:
            _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
            if os.getppid() != self._supervisor_pid:
                code = EXIT_ORPHAN
                return
            for sig in (signal.SIGINT, signal.SIGHUP):
                signal.signal(sig, signal.SIG_IGN)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            signal.signal(signal.SIGPIPE, signal.SIG_DFL)
            try:
                signal.set_wakeup_fd(-1)
            except ValueError:
                pass
            for fd in (self._wake_r, self._wake_w):
                os.close(fd)
            for other in self._slots:
                if other.pidfd >= 0:
                    os.close(other.pidfd)
                if other is not slot and other.fd >= 0 and other.fd != self.fd:
                    os.close(other.fd)
                if other.channel is not None:
                    other.channel.close()  # the supervisor's ends, ours included
            for fd in self._watch:
                with contextlib.suppress(OSError):
                    os.close(fd)
            ctx = WorkerContext(slot.index, slot.fd, self.conn, slot.generation,
                                workers=len(self._slots), channel=channel)
            try:
                handler = factory(ctx) if takes_ctx else factory()
            except Exception:
                log.exception("worker slot %d: handler_factory failed", slot.index)
                code = EXIT_FACTORY
                return
            assert self.counters is not None
            Dispatcher(slot.fd, handler, bufsize=self._bufsize(), options=self.engine,
                       row=self.counters.row(slot.index)).run()
            code = EXIT_CONN_GONE
        except BaseException:
            with contextlib.suppress(BaseException):
                log.exception("worker slot %d crashed", slot.index)
        finally:
            with contextlib.suppress(BaseException):
                sys.stdout.flush()
                sys.stderr.flush()
                for h in logging.getLogger().handlers:
                    h.flush()
            os._exit(code)

    def _supervise(self, factory: Callable[..., Any], takes_ctx: bool) -> _Exit:
        poller = select.poll()
        poller.register(self._wake_r, select.POLLIN)
        self._register_watch(poller)
        by_pidfd: dict[int, _Slot] = {}
        for s in self._slots:
            poller.register(s.pidfd, select.POLLIN)
            by_pidfd[s.pidfd] = s
        while True:
            if self._stop_requested:
                self._shutdown_workers(unmount=True)
                return _Exit("stopped")
            events = poller.poll()
            for fd, _ev in events:
                if fd == self._wake_r:
                    try:
                        while os.read(self._wake_r, 64):
                            pass
                    except BlockingIOError:
                        pass
                    continue
                if fd in self._watch:
                    self._run_watch(poller, fd)
                    continue
                slot = by_pidfd.pop(fd)
                poller.unregister(fd)
                status = self._reap(slot)
                if self._stop_requested:
                    continue
                if os.WIFEXITED(status) and os.WEXITSTATUS(status) == EXIT_CONN_GONE:
                    log.info("%s: unmounted from outside; stopping the workers",
                             self.mountpoint)
                    self._mounted = False
                    self._shutdown_workers(unmount=False)
                    return _Exit("unmounted")
                if os.WIFEXITED(status) and os.WEXITSTATUS(status) == EXIT_ORPHAN:
                    continue
                how = (f"signal {signal.Signals(os.WTERMSIG(status)).name}"
                       if os.WIFSIGNALED(status) else f"exit status {os.WEXITSTATUS(status)}")
                now = time.monotonic()
                self._deaths = [t for t in self._deaths if now - t < self.crash_window]
                self._deaths.append(now)
                self._recover_requests(slot)
                if len(self._deaths) >= self.crash_limit:
                    msg = (f"{self.mountpoint}: {len(self._deaths)} workers died within "
                           f"{self.crash_window:g} s (last: {how}); unmounting")
                    log.error("%s", msg)
                    self._shutdown_workers(unmount=True)
                    return _Exit("crash-loop", msg)
                log.warning("%s: worker %d (slot %d) died (%s); starting a replacement",
                            self.mountpoint, slot.pid, slot.index, how)
                slot.generation += 1
                slot.pid = 0
                self._start_worker(slot, factory, takes_ctx)
                poller.register(slot.pidfd, select.POLLIN)
                by_pidfd[slot.pidfd] = slot
                self._worker_started(slot.index)

    # ----------------------------------------------------------------------------------------
    # the supervisor's messages to its workers, and what else it watches

    def send(self, slot: int, data: bytes, fds: list[int] | tuple[int, ...] = ()) -> bool:
        """Send one message (and descriptors) to the worker in ``slot`` on its channel,
        without blocking: False if it could not be sent now (logged). Supervisor only."""
        chan = self._channel(slot)
        if chan is None:
            return False
        try:
            socket.send_fds(chan, [data], list(fds))
        except (BlockingIOError, InterruptedError):
            log.warning("worker slot %d is not reading its channel; a message was dropped",
                        slot)
            return False
        except OSError as exc:  # the worker is gone; its replacement gets the state anew
            log.debug("worker slot %d: channel: %s", slot, exc)
            return False
        return True

    def broadcast(self, data: bytes, fds: list[int] | tuple[int, ...] = ()) -> int:
        """:meth:`send` to every worker; returns how many took it."""
        slots = (list(self._external.workers) if self._external is not None
                 else [s.index for s in self._slots])
        return sum(self.send(slot, data, fds) for slot in slots)

    def _channel(self, slot: int) -> socket.socket | None:
        if self._external is not None:
            return self._external.workers.get(slot)
        for s in self._slots:
            if s.index == slot:
                return s.channel
        return None

    def _worker_started(self, slot: int) -> None:
        if self._on_worker_start is not None:
            try:
                self._on_worker_start(slot)
            except Exception:  # the supervisor must keep supervising
                log.exception("on_worker_start(%d) failed", slot)

    def _register_watch(self, poller) -> None:
        for fd in self._watch:
            poller.register(fd, select.POLLIN)

    def _run_watch(self, poller, fd: int) -> None:
        try:
            keep = self._watch[fd]()
        except Exception:  # the supervisor must keep supervising
            log.exception("watch callback for fd %d failed", fd)
            keep = False
        if keep is False:
            poller.unregister(fd)
            del self._watch[fd]

    def _reap(self, slot: _Slot) -> int:
        try:
            _pid, status = os.waitpid(slot.pid, 0)
        except ChildProcessError:
            status = 0
        os.close(slot.pidfd)
        slot.pidfd = -1
        return status

    def _recover_requests(self, slot: _Slot) -> None:
        """After a worker death: requeue (or at least end) the requests it held."""
        if self.conn.kernel_flags & _notify.HAS_RESEND:
            err = _notify.notify_resend(self.fd)
            if err:
                log.warning("FUSE_NOTIFY_RESEND failed: %s", os.strerror(err))
        if slot.cloned:
            # closing the last reference to the clone ends whatever is left on it
            # (ECONNABORTED to its callers); the replacement gets a fresh clone
            os.close(slot.fd)
            slot.fd = -1

    def _shutdown_workers(self, unmount: bool) -> None:
        """Unmount (if asked), let workers see ENODEV, kill stragglers, close fds."""
        if unmount and self._mounted:
            try:
                self.unmount()
            except MountError as exc:
                log.warning("%s; unmounting lazily", exc)
                try:
                    self.unmount(lazy=True)
                except MountError as exc2:
                    log.error("%s", exc2)
        live = [s for s in self._slots if s.pid and s.pidfd >= 0]
        deadline = time.monotonic() + self.stop_timeout
        for s in live:
            left = max(0.0, deadline - time.monotonic())
            r, _, _ = select.select([s.pidfd], [], [], left)
            if not r:
                log.warning("worker %d did not exit; killing it", s.pid)
                try:
                    os.kill(s.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            self._reap(s)
            s.pid = 0
        for s in self._slots:
            if s.fd >= 0 and s.fd != self.fd:
                os.close(s.fd)
            s.fd = -1
            if s.channel is not None:
                s.channel.close()
                s.channel = None

    def close(self) -> None:
        """Unmount if still mounted, close the connection fd and the counters."""
        if self._serving:
            raise MountError("close() while serve() runs; call stop() first")
        if self._mounted:
            try:
                self.unmount()
            except MountError:
                self.unmount(lazy=True)
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _factory_takes_context(factory: Callable[..., Any]) -> bool:
    try:
        sig = inspect.signature(factory)
    except (TypeError, ValueError):
        return False
    params = [p for p in sig.parameters.values()
              if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL)
              and p.default is p.empty]
    return len(params) >= 1
