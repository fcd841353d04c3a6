"""The workers of a mount and the process that watches them.

After INIT, a :class:`Supervisor` starts K workers and then only supervises until the mount
ends (:meth:`Supervisor.run`):

- each forked worker gets its own descriptor on the connection (FUSE_DEV_IOC_CLONE, made by
  the supervisor per worker slot; the shared fd if the kernel refuses), builds its handler
  with ``handler_factory(ctx)`` *after* the fork, and serves requests with a
  :class:`~.dispatch.Dispatcher` until the device says ENODEV;
- a worker that dies unexpectedly is replaced (logged). The requests it had read but not
  answered are requeued with FUSE_NOTIFY_RESEND when the kernel has it (6.9+), else they
  fail with ECONNABORTED when its descriptor is closed, never hang. ``crash_limit`` deaths
  within ``crash_window`` seconds stop the mount (a crash loop);
- :meth:`Supervisor.stop` (a signal to the supervisor, or another thread) unmounts and
  stops every worker; an unmount from outside (``umount``, ``fusermount3 -u``) makes every
  worker see ENODEV and exit;
- workers never outlive the supervisor: PR_SET_PDEATHSIG(SIGKILL) plus a parent check right
  after fork;
- channels: with ``channels=True`` every worker has a message channel from the supervisor
  (a SOCK_SEQPACKET pair, descriptors may ride along: :meth:`Supervisor.send`); watched
  descriptors are polled with the workers and their callbacks run in the supervisor.

External workers (:meth:`Supervisor.accept`, :meth:`Supervisor.run_external`) are
processes the supervisor must not fork (MPI ranks): they connect to a handoff socket
(:mod:`.handoff`) and get their descriptor there; that connection is their channel, and
its end (a worker's "U", or EOF) is how the supervisor learns they are gone.

Why the supervisor serves no requests: it must stay responsive to signals and worker deaths
(it sleeps in one poll() on pidfds and a wake-up pipe), and a handler that crashes the
process (a segfault in a codec) must not take the mount holder with it. Its cost is one
sleeping process.
"""

from __future__ import annotations

import contextlib
import ctypes
import inspect
import logging
import os
import select
import signal
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fanstore.errors import MountError

from . import notify as _notify
from .dispatch import Dispatcher
from .handoff import HandoffServer
from .handshake import Connection, ConnInfo

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
_libc = ctypes.CDLL(None, use_errno=True)

#: A worker's exit status: its connection is gone (unmounted), it crashed, its
#: handler_factory failed, or its supervisor was gone before it started.
EXIT_CONN_GONE = 0
EXIT_CRASH = 70
EXIT_FACTORY = 71
EXIT_ORPHAN = 72

Watch = dict[int, Callable[[], bool]]  # fd -> callback run when readable (False: unwatch)


@dataclass
class WorkerContext:
    """Handed to ``handler_factory(ctx)`` in each worker, after the fork.

    Attributes
    ----------
    slot : 1..K, stable across replacements of the worker in that slot.
    fd : this worker's descriptor on the connection (for notifications; never read it).
    conn : the negotiated :class:`~.handshake.ConnInfo`.
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
class Slot:
    """A worker's place: its descriptor, its process, its channel; kept across
    replacements."""

    index: int
    fd: int = -1  # the clone (or shared) fd this slot's worker serves
    pid: int = 0
    pidfd: int = -1
    generation: int = 0
    cloned: bool = False
    channel: socket.socket | None = None  # the supervisor's end of the worker's channel


@dataclass
class Exit:
    """Why supervision ended."""

    reason: str = "stopped"  # "stopped" | "unmounted" | "crash-loop"
    message: str = ""


class Supervisor:
    """The workers of ``session`` (its connection, negotiated limits, counters and engine
    options) and the loop that watches them; see the module docstring.

    Attributes
    ----------
    slots : the forked workers' slots (1..K).
    external : the handoff server while external workers serve, else None.
    """

    def __init__(self, session: Connection, *, watch: Watch | None = None,
                 on_worker_start: Callable[[int], None] | None = None) -> None:
        self.session = session
        self.watch: Watch = dict(watch or {})
        self.on_worker_start = on_worker_start
        self.slots: list[Slot] = []
        self.external: HandoffServer | None = None
        self.stop_requested = False
        self._deaths: list[float] = []
        self._channels = False
        self._granted: list[int] = []
        self._pid = os.getpid()
        self._wake_r, self._wake_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)

    # ----------------------------------------------------------------------------------------
    # forked workers

    def start(self, factory: Callable[..., Any], workers: int, channels: bool) -> None:
        """Fork ``workers`` workers that serve with ``factory``'s handlers."""
        self._channels = channels
        self._takes_ctx = factory_takes_context(factory)
        self.slots = [Slot(i) for i in range(1, workers + 1)]
        for slot in self.slots:
            self._start_worker(slot, factory)
        for slot in self.slots:
            self._worker_started(slot.index)

    def run(self, factory: Callable[..., Any]) -> Exit:
        """Supervise the forked workers until the mount ends (replacing dead ones)."""
        s = self.session
        poller = select.poll()
        poller.register(self._wake_r, select.POLLIN)
        for fd in self.watch:
            poller.register(fd, select.POLLIN)
        by_pidfd: dict[int, Slot] = {}
        for slot in self.slots:
            poller.register(slot.pidfd, select.POLLIN)
            by_pidfd[slot.pidfd] = slot
        while True:
            if self.stop_requested:
                self.shutdown_workers(unmount=True)
                return Exit("stopped")
            for fd, _ev in poller.poll():
                if fd == self._wake_r:
                    self._drain_wake()
                    continue
                if fd in self.watch:
                    self._run_watch(poller, fd)
                    continue
                slot = by_pidfd.pop(fd)
                poller.unregister(fd)
                status = self._reap(slot)
                if self.stop_requested:
                    continue
                if os.WIFEXITED(status) and os.WEXITSTATUS(status) == EXIT_CONN_GONE:
                    log.info("%s: unmounted from outside; stopping the workers",
                             s.mountpoint)
                    s.mounted = False
                    self.shutdown_workers(unmount=False)
                    return Exit("unmounted")
                if os.WIFEXITED(status) and os.WEXITSTATUS(status) == EXIT_ORPHAN:
                    continue
                how = (f"signal {signal.Signals(os.WTERMSIG(status)).name}"
                       if os.WIFSIGNALED(status) else f"exit status {os.WEXITSTATUS(status)}")
                now = time.monotonic()
                self._deaths = [t for t in self._deaths if now - t < s.crash_window]
                self._deaths.append(now)
                self._recover_requests(slot)
                if len(self._deaths) >= s.crash_limit:
                    msg = (f"{s.mountpoint}: {len(self._deaths)} workers died within "
                           f"{s.crash_window:g} s (last: {how}); unmounting")
                    log.error("%s", msg)
                    self.shutdown_workers(unmount=True)
                    return Exit("crash-loop", msg)
                log.warning("%s: worker %d (slot %d) died (%s); starting a replacement",
                            s.mountpoint, slot.pid, slot.index, how)
                slot.generation += 1
                slot.pid = 0
                self._start_worker(slot, factory)
                poller.register(slot.pidfd, select.POLLIN)
                by_pidfd[slot.pidfd] = slot
                self._worker_started(slot.index)

    def _start_worker(self, slot: Slot, factory: Callable[..., Any]) -> None:
        s = self.session
        if slot.fd < 0:
            fd = s.clone() if s.clone_fd else -1
            slot.cloned = fd >= 0
            slot.fd = fd if fd >= 0 else s.fd
        worker_end = None
        if self._channels:
            if slot.channel is not None:
                slot.channel.close()  # a fresh channel: nothing stale for the replacement
            slot.channel, worker_end = socket.socketpair(
                socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
            slot.channel.setblocking(False)
        pid = os.fork()
        if pid == 0:  # worker: never returns
            self._worker_main(slot, factory, worker_end)
        if worker_end is not None:
            worker_end.close()
        slot.pid = pid
        slot.pidfd = os.pidfd_open(pid)
        os.set_inheritable(slot.pidfd, False)
        log.debug("worker %d started in slot %d (generation %d, fd %s)", pid, slot.index,
                  slot.generation, "clone" if slot.cloned else "shared")

    def _worker_main(self, slot: Slot, factory: Callable[..., Any],
                     channel: socket.socket | None = None) -> None:
        s = self.session
        code = EXIT_CRASH
        try:
            _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
            if os.getppid() != self._pid:
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
            for other in self.slots:
                if other.pidfd >= 0:
                    os.close(other.pidfd)
                if other is not slot and other.fd >= 0 and other.fd != s.fd:
                    os.close(other.fd)
                if other.channel is not None:
                    other.channel.close()  # the supervisor's ends, ours included
            for fd in self.watch:
                with contextlib.suppress(OSError):
                    os.close(fd)
            ctx = WorkerContext(slot.index, slot.fd, s.conn, slot.generation,
                                workers=len(self.slots), channel=channel)
            try:
                handler = factory(ctx) if self._takes_ctx else factory()
            except Exception:
                log.exception("worker slot %d: handler_factory failed", slot.index)
                code = EXIT_FACTORY
                return
            assert s.counters is not None
            Dispatcher(slot.fd, handler, bufsize=s.bufsize(), options=s.engine,
                       row=s.counters.row(slot.index)).run()
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

    def _reap(self, slot: Slot) -> int:
        try:
            _pid, status = os.waitpid(slot.pid, 0)
        except ChildProcessError:
            status = 0
        os.close(slot.pidfd)
        slot.pidfd = -1
        return status

    def _recover_requests(self, slot: Slot) -> None:
        """After a worker death: requeue (or at least end) the requests it held."""
        s = self.session
        if s.conn.kernel_flags & _notify.HAS_RESEND:
            err = _notify.notify_resend(s.fd)
            if err:
                log.warning("FUSE_NOTIFY_RESEND failed: %s", os.strerror(err))
        if slot.cloned:
            # closing the last reference to the clone ends whatever is left on it
            # (ECONNABORTED to its callers); the replacement gets a fresh clone
            os.close(slot.fd)
            slot.fd = -1

    def shutdown_workers(self, unmount: bool) -> None:
        """Unmount (if asked), let workers see ENODEV, kill stragglers, close fds."""
        s = self.session
        if unmount:
            s.unmount_quietly()
        live = [slot for slot in self.slots if slot.pid and slot.pidfd >= 0]
        deadline = time.monotonic() + s.stop_timeout
        for slot in live:
            left = max(0.0, deadline - time.monotonic())
            r, _, _ = select.select([slot.pidfd], [], [], left)
            if not r:
                log.warning("worker %d did not exit; killing it", slot.pid)
                try:
                    os.kill(slot.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            self._reap(slot)
            slot.pid = 0
        for slot in self.slots:
            if slot.fd >= 0 and slot.fd != s.fd:
                os.close(slot.fd)
            slot.fd = -1
            if slot.channel is not None:
                slot.channel.close()
                slot.channel = None

    # ----------------------------------------------------------------------------------------
    # external workers

    def accept(self, socket_path: str, workers: int, info: dict[str, Any], timeout: float,
               extra_fds: list[int]) -> None:
        """Wait for ``workers`` external workers at ``socket_path`` and hand each its
        descriptor (``info`` is added to every grant; ``extra_fds`` go with it)."""
        self.external = HandoffServer(socket_path)
        self.external.accept(workers, self._grant, info, timeout,
                             stop=lambda: self.stop_requested, extra_fds=extra_fds)

    def _grant(self, slot: int) -> int:
        """A descriptor for an external worker (sent, then closed here: the worker holds
        the only reference, so its death ends what it had read)."""
        s = self.session
        fd = s.clone() if s.clone_fd else -1
        if fd < 0:
            fd = os.dup(s.fd)
        self._granted.append(fd)
        return fd

    def run_external(self) -> str:
        """Supervise the external workers until the mount ends: "unmounted" (a worker says
        its connection is gone) or "stopped"; MountError when every one of them is gone."""
        s = self.session
        server = self.external
        assert server is not None
        for fd in self._granted:
            os.close(fd)  # sent: the workers hold them now
        self._granted.clear()
        poller = select.poll()
        poller.register(self._wake_r, select.POLLIN)
        for fd in self.watch:
            poller.register(fd, select.POLLIN)
        by_fd = {}
        for slot, conn in server.workers.items():
            poller.register(conn.fileno(), select.POLLIN)
            by_fd[conn.fileno()] = (slot, conn)
        while True:
            if self.stop_requested:
                s.unmount_quietly()
                return "stopped"
            for fd, _ev in poller.poll():
                if fd == self._wake_r:
                    self._drain_wake()
                    continue
                if fd in self.watch:
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
                    log.info("%s: unmounted from outside", s.mountpoint)
                    s.mounted = False
                    return "unmounted"
                log.warning("%s: worker rank in slot %d is gone", s.mountpoint, slot)
                if s.conn.kernel_flags & _notify.HAS_RESEND:
                    _notify.notify_resend(s.fd)
                if not by_fd:
                    s.unmount_quietly()
                    raise MountError(f"{s.mountpoint}: every worker rank is gone; "
                                     "unmounted")

    # ----------------------------------------------------------------------------------------
    # messages to the workers, watched descriptors, stopping

    def send(self, slot: int, data: bytes, fds: list[int] | tuple[int, ...] = ()) -> bool:
        """Send one message (and descriptors) to the worker in ``slot`` on its channel,
        without blocking: False if it could not be sent now (logged)."""
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
        slots = (list(self.external.workers) if self.external is not None
                 else [s.index for s in self.slots])
        return sum(self.send(slot, data, fds) for slot in slots)

    def _channel(self, slot: int) -> socket.socket | None:
        if self.external is not None:
            return self.external.workers.get(slot)
        for s in self.slots:
            if s.index == slot:
                return s.channel
        return None

    def _worker_started(self, slot: int) -> None:
        if self.on_worker_start is not None:
            try:
                self.on_worker_start(slot)
            except Exception:  # the supervisor must keep supervising
                log.exception("on_worker_start(%d) failed", slot)

    def _run_watch(self, poller: select.poll, fd: int) -> None:
        try:
            keep = self.watch[fd]()
        except Exception:  # the supervisor must keep supervising
            log.exception("watch callback for fd %d failed", fd)
            keep = False
        if keep is False:
            poller.unregister(fd)
            del self.watch[fd]

    def _drain_wake(self) -> None:
        with contextlib.suppress(BlockingIOError):
            while os.read(self._wake_r, 64):
                pass

    def stop(self) -> None:
        """Ask :meth:`run` or :meth:`run_external` to unmount and stop (thread- and
        signal-safe)."""
        self.stop_requested = True
        if self._wake_w >= 0:
            try:
                os.write(self._wake_w, b"s")
            except OSError:
                pass

    def close(self) -> None:
        """The wake-up pipe and the handoff server (after supervision ended)."""
        if self.external is not None:
            self.external.close()
            self.external = None
        for fd in (self._wake_r, self._wake_w):
            if fd >= 0:
                os.close(fd)
        self._wake_r = self._wake_w = -1


def factory_takes_context(factory: Callable[..., Any]) -> bool:
    """True if ``handler_factory`` takes a :class:`WorkerContext` (one required argument)."""
    try:
        sig = inspect.signature(factory)
    except (TypeError, ValueError):
        return False
    params = [p for p in sig.parameters.values()
              if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL)
              and p.default is p.empty]
    return len(params) >= 1
