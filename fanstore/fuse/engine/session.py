"""A mount served by K worker processes: mount, INIT, serve, unmount.

Life of a :class:`KernelSession`::

    session = KernelSession(mountpoint, MountOptions(...), InitOptions(...))
    session.mount()                      # /dev/fuse connected; stale mounts cleaned first
    session.serve(handler_factory, workers=K, on_ready=callback)   # blocks
    session.close()

A session owns the connection (the /dev/fuse descriptor, its clones, the mount) and
composes the two other parts of serving: ``serve`` answers INIT in the calling process
(:mod:`.handshake`), then hands the connection to a :class:`~.supervisor.Supervisor` that
forks K workers, calls ``on_ready(session)``, and only supervises until the mount ends
(:mod:`.supervisor`: replacements, the crash loop, channels, watched descriptors).
``serve_external`` does the same for workers it must not fork (MPI ranks, :mod:`.handoff`).

- SIGTERM, SIGINT or SIGHUP to the supervisor (when ``serve`` runs in the main thread), or
  :meth:`KernelSession.stop` from another thread, unmount and stop every worker;
- an unmount from outside (``umount``, ``fusermount3 -u``) makes every worker see ENODEV
  and exit; ``serve`` then returns;
- ``crash_limit`` worker deaths within ``crash_window`` seconds stop the mount and raise
  MountError;
- if the supervisor is SIGKILLed its workers die with it (PR_SET_PDEATHSIG) and the mount
  is left stale (ENOTCONN); the next :meth:`KernelSession.mount` on it, or
  :func:`~.mount.cleanup_stale`, removes it.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import signal
import struct
import threading
from collections.abc import Callable
from typing import Any, Self

from fanstore.errors import MountError

from . import mount as _mount
from .counters import RequestCounters
from .handshake import ConnInfo, InitOptions, negotiate, request_bufsize, set_read_ahead
from .optable import EngineOptions
from .proto import FUSE_DEV_IOC_CLONE, Op
from .supervisor import Exit, Supervisor, Watch

log = logging.getLogger(__name__)


class KernelSession:
    """One FUSE mount served by worker processes. See the module docstring.

    Attributes
    ----------
    mountpoint : absolute path.
    fd : the connection's descriptor once mounted (-1 before).
    mounted : whether this session's mount is (as far as it knows) still in place.
    conn : :class:`~.handshake.ConnInfo` once INIT is answered.
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
        self.mounted = False
        self.conn = ConnInfo()
        self.counters: RequestCounters | None = None
        self.exit_reason: str | None = None
        self._serving = False
        self._supervisor: Supervisor | None = None

    # ----------------------------------------------------------------------------------------
    # the connection: mount, clones, unmount

    def mount(self) -> int:
        """Clean a stale mount left on the mount point, then mount; returns the fd."""
        if self.fd >= 0:
            raise MountError(f"{self.mountpoint}: this session is already mounted")
        _mount.cleanup_stale(self.mountpoint)
        self.fd = _mount.mount(self.mountpoint, self.options)
        self.mounted = True
        return self.fd

    def unmount(self, lazy: bool = False) -> None:
        """Unmount (from the supervisor side); workers then see ENODEV and exit."""
        if self.mounted:
            _mount.unmount(self.mountpoint, lazy=lazy,
                           use_fusermount=None if os.geteuid() != 0 else False)
            self.mounted = False

    def unmount_quietly(self) -> None:
        """Unmount, lazily if a plain unmount fails; failures are logged, never raised."""
        if self.mounted:
            try:
                self.unmount()
            except MountError as exc:
                log.warning("%s; unmounting lazily", exc)
                try:
                    self.unmount(lazy=True)
                except MountError as exc2:
                    log.error("%s", exc2)

    def notify_fd(self) -> int:
        """A new descriptor on this connection for notifications from outside the workers
        (a prefetch thread or process); the caller closes it. See notify.py's deadlock note.
        """
        if self.fd < 0:
            raise MountError("not mounted")
        fd = self.clone()
        return fd if fd >= 0 else os.dup(self.fd)

    def clone(self) -> int:
        """A new descriptor on this connection (FUSE_DEV_IOC_CLONE), or -1 if refused."""
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

    def bufsize(self) -> int:
        """The receive buffer every worker needs (from what INIT negotiated)."""
        return request_bufsize(self.init, self.conn)

    @property
    def worker_pids(self) -> dict[int, int]:
        sup = self._supervisor
        return {s.index: s.pid for s in sup.slots if s.pid} if sup is not None else {}

    @property
    def requests(self) -> int:
        return self.counters.requests if self.counters else 0

    @property
    def requests_by_op(self) -> dict[str, int]:
        return self.counters.requests_by_op if self.counters else {}

    def negotiate(self, timeout: float = 30.0) -> ConnInfo:
        """Read the kernel's INIT and answer it (done by :meth:`serve`; public for tests)."""
        if self.fd < 0:
            raise MountError("mount() first")
        self.conn = negotiate(self.fd, self.init, self.mountpoint, timeout)
        return self.conn

    # ----------------------------------------------------------------------------------------
    # serving

    def serve(self, handler_factory: Callable[..., Any], workers: int | None = None, *,
              on_ready: Callable[[KernelSession], None] | None = None,
              handle_signals: bool | None = None, channels: bool = False,
              watch: Watch | None = None,
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
        handle_signals = self._signals_wanted(handle_signals)
        sup = self._begin(watch, on_worker_start)
        old_handlers = self._install_signals(handle_signals)
        result = Exit()
        try:
            self._init_counters(nworkers)
            sup.start(handler_factory, nworkers, channels)
            set_read_ahead(self.mountpoint, self.init, self.conn)
            if on_ready is not None:
                on_ready(self)
            result = sup.run(handler_factory)
        except BaseException:
            sup.shutdown_workers(unmount=True)
            raise
        finally:
            self._end(old_handlers)
        self.exit_reason = result.reason
        if result.reason == "crash-loop":
            raise MountError(result.message)
        return result.reason

    def serve_external(self, socket_path: str, workers: int, *,
                       on_ready: Callable[[KernelSession], None] | None = None,
                       handle_signals: bool | None = None,
                       connect_timeout: float = 300.0,
                       extra_fds: list[int] | None = None,
                       watch: Watch | None = None) -> str:
        """Answer INIT, then hand the connection to ``workers`` processes that connect to
        ``socket_path`` (:mod:`.handoff`: processes this one must not fork, such as MPI
        ranks), and supervise them until the mount ends.

        Returns "unmounted" (removed from outside: a worker says its connection is gone),
        or "stopped" (signal or :meth:`stop`). Raises MountError when the workers do not
        all connect within ``connect_timeout`` or every one of them is gone.

        ``extra_fds`` are sent to every worker with its descriptor (shared memory, say; the
        grant says nothing else of the application: what they are, the worker knows); the
        handoff connection is each worker's channel (:meth:`send`); ``watch`` as in
        :meth:`serve`.
        """
        if self.fd < 0:
            raise MountError("mount() first")
        if workers < 1:
            raise MountError(f"workers must be at least 1, not {workers}")
        sup = self._begin(watch, None)
        old_handlers = self._install_signals(self._signals_wanted(handle_signals, check=False))
        try:
            self._init_counters(workers)
            info = dict(bufsize=self.bufsize(), counters=self.counters_path,
                        minor=self.conn.minor, flags=self.conn.flags, workers=workers)
            sup.accept(socket_path, workers, info, connect_timeout, extra_fds or [])
            set_read_ahead(self.mountpoint, self.init, self.conn)
            if on_ready is not None:
                on_ready(self)
            reason = sup.run_external()
        except BaseException:
            if self.mounted:
                with contextlib.suppress(MountError):
                    self.unmount(lazy=True)
            raise
        finally:
            self._end(old_handlers)
        self.exit_reason = reason
        return reason

    def _signals_wanted(self, handle_signals: bool | None, check: bool = True) -> bool:
        in_main = threading.current_thread() is threading.main_thread()
        if handle_signals is None:
            return in_main
        if check and handle_signals and not in_main:
            raise MountError("signal handling needs serve() in the main thread")
        return handle_signals

    def _begin(self, watch: Watch | None,
               on_worker_start: Callable[[int], None] | None) -> Supervisor:
        self._serving = True
        self._supervisor = Supervisor(self, watch=watch, on_worker_start=on_worker_start)
        return self._supervisor

    def _install_signals(self, handle_signals: bool) -> dict[int, Any]:
        old: dict[int, Any] = {}
        if handle_signals:
            for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
                old[sig] = signal.signal(sig, self._on_signal)
        return old

    def _init_counters(self, workers: int) -> None:
        """INIT answered, then the counters table: a row for this process and each slot."""
        self.negotiate()
        self.counters = RequestCounters(1 + workers, self.counters_path)
        self.counters.row(0)[Op.INIT] += 1

    def _end(self, old_handlers: dict[int, Any]) -> None:
        for sig, h in old_handlers.items():
            signal.signal(sig, h)
        if self._supervisor is not None:
            self._supervisor.close()
        self._serving = False

    def stop(self) -> None:
        """Ask a running :meth:`serve` to unmount and stop (thread- and signal-safe)."""
        if self._supervisor is not None:
            self._supervisor.stop()

    def _on_signal(self, signum: int, _frame: Any) -> None:
        log.info("%s: %s received; unmounting", self.mountpoint, signal.Signals(signum).name)
        self.stop()

    # ----------------------------------------------------------------------------------------
    # the supervisor's messages to its workers

    def send(self, slot: int, data: bytes, fds: list[int] | tuple[int, ...] = ()) -> bool:
        """Send one message (and descriptors) to the worker in ``slot`` on its channel,
        without blocking: False if it could not be sent now (logged). Supervisor only."""
        sup = self._supervisor
        return sup.send(slot, data, fds) if sup is not None else False

    def broadcast(self, data: bytes, fds: list[int] | tuple[int, ...] = ()) -> int:
        """:meth:`send` to every worker; returns how many took it."""
        sup = self._supervisor
        return sup.broadcast(data, fds) if sup is not None else 0

    def close(self) -> None:
        """Unmount if still mounted, close the connection fd and the counters."""
        if self._serving:
            raise MountError("close() while serve() runs; call stop() first")
        if self.mounted:
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
