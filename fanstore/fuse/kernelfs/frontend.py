"""The kernel frontend, the node daemon's side: start the frontend process, wait until it
serves, stop it, read its counters, hand it prefetch orders.

The daemon never forks after MPI_Init: :meth:`KernelFrontend.mount` starts the frontend
process (:mod:`fanstore.fuse.kernelfs.process`) with ``subprocess`` (fork + exec at once, the
environment cleaned of PMI variables), hands it a :class:`~fanstore.fuse.kernelfs.start.
FrontendStart` (the node's share of the mount, as it is) through a pipe and waits for
"ready" (or the error) on another. The frontend process ends with the daemon and cleans up
after it (``process.DaemonWatch``); if the frontend dies first, :meth:`KernelFrontend.serve`
says so and the node ends the job (fanstore.daemon.node).
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import threading
from collections import OrderedDict
from typing import Any

import numpy as np

from fanstore import strictjson
from fanstore.errors import FanStoreError, MountError
from fanstore.format.index import KIND_FILE
from fanstore.frontend import UNMOUNTED, MountContext
from fanstore.fuse.engine import RequestCounters
from fanstore.fuse.kernelfs.start import FrontendStart
from fanstore.fuse.kernelfs.stats import summed_stats
from fanstore.fuse.kernelfs.orders import DROP, ORDER, PUSH_PIECE, encode
from fanstore.process import ReadyTimeout, own_environment, read_ready
from fanstore.read.window import CLIENTS, SharedWindow, write_order

log = logging.getLogger(__name__)

#: seconds the daemon waits for its frontend process to say it is ready: the frontend's
#: own steps have deadlines (the worker ranks joining 300 s, fusermount 60 s, the kernel's
#: INIT 30 s); past them it is stuck, and is stopped.
READY_TIMEOUT = 300.0 + 60.0 + 30.0 + 30.0


class KernelFrontend:
    """The node daemon's side of the kernel frontend: starts the frontend process, waits
    for it to be ready, stops it, reads its counters."""

    def __init__(self, ctx: MountContext) -> None:
        self.ctx = ctx
        self.proc: subprocess.Popen | None = None
        rt = ctx.runtime  # made and checked once by the node (fanstore.runtime)
        if rt is None:
            raise ValueError("the kernel frontend needs the mount's runtime directory")
        self.counters_path = rt.counters_path
        self._counters = None
        self._reason: str | None = None
        # Every read is served by the workers, whose caches share --cache-mb; the daemon's
        # own reader keeps none of its own.
        ctx.reader.cache.budget = 0
        self._orders = None  # prefetch mode: the daemon's end of the order channel
        self.window = None  # prefetch mode: the shared window (fanstore.read.window)
        self._order_lock = threading.Lock()
        self._clients: OrderedDict[str, int] = OrderedDict()  # client name -> slot
        self._generation = 0

    # ------------------------------------------------------------------ Frontend
    def mount(self) -> None:
        ctx = self.ctx
        r, w = os.pipe()
        spec_r, spec_w = os.pipe()
        theirs = None
        if ctx.spec.prefetch:
            self._orders, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            slots = ctx.share.fuse_workers
            # made here, handed down: the daemon gives the state to the node's API readers
            self.window = SharedWindow.create(
                ctx.index.n_entries, slots,
                prefetch_buffer_bytes(ctx.spec.prefetch_mb << 20, slots))
        try:
            start = self._start(w, theirs)
        except FanStoreError:
            for fd in (r, w, spec_r, spec_w):
                os.close(fd)
            if theirs is not None:
                theirs.close()
            raise
        if ctx.runtime is not None:
            ctx.runtime.new_counters_file()  # the frontend creates it anew, exclusively
        env = own_environment({
            k: v for k, v in os.environ.items()
            if not k.startswith(("PMI_", "PMIX_", "HYDI_", "HYDRA_", "MPIR_", "OMPI_"))})
        fds = (w, spec_r) if theirs is None else (w, spec_r, theirs.fileno(),
                                                  self.window.state_fd, self.window.arena_fd)
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "fanstore.fuse.kernelfs.process", "--spec-fd", str(spec_r)],
                pass_fds=fds, env=env, stdin=subprocess.DEVNULL)
        finally:
            os.close(w)
            os.close(spec_r)
            if theirs is not None:
                theirs.close()
        try:  # the start goes through a pipe: nothing on disk for anyone to read or swap
            with open(spec_w, "wb", closefd=True) as f:
                f.write(strictjson.to_json(start))
        except BrokenPipeError:
            pass  # the frontend died at once: the ready pipe below says so
        try:
            text = read_ready(r, READY_TIMEOUT,
                              f"{ctx.mountpoint}: the kernel frontend (pid {self.proc.pid})",
                              alive=ctx.alive)
        except ReadyTimeout as exc:
            self.stop("it did not start")
            self._wait(10)
            raise MountError(str(exc)) from None
        finally:
            os.close(r)
        if text != "ready":
            self._wait(10)
            raise MountError(text[len("error: "):] if text.startswith("error: ") else
                             f"{ctx.mountpoint}: the kernel frontend exited before the mount "
                             f"was ready (status {self.proc.returncode})")

    def _start(self, ready_fd: int, orders: socket.socket | None) -> FrontendStart:
        """What the frontend process is told: the node's share, and its wiring."""
        return FrontendStart(
            share=self.ctx.share, counters_path=self.counters_path, ready_fd=ready_fd,
            daemon_pid=os.getpid(), debug=logging.getLogger().level <= logging.DEBUG,
            log_format=_log_format(), order_fd=None if orders is None else orders.fileno(),
            window_fds=None if orders is None else (self.window.state_fd,
                                                    self.window.arena_fd))

    def unmount(self) -> None:
        self.stop("another rank failed")
        self._wait(30)

    def serve(self) -> str:
        proc = self.proc
        assert proc is not None
        code = proc.wait()
        self._cleanup_mount()
        if self._reason is not None:
            return self._reason
        if code == 0:
            return UNMOUNTED
        why = f"signal {signal.Signals(-code).name}" if code < 0 else f"status {code}"
        log.error("%s: the kernel frontend ended with %s", self.ctx.mountpoint, why)
        return f"the kernel frontend failed ({why})"

    def stop(self, reason: str) -> None:
        if self._reason is None:
            self._reason = reason
        proc = self.proc
        if proc is not None and proc.returncode is None:
            try:
                os.kill(proc.pid, signal.SIGTERM)  # async-signal-safe
            except ProcessLookupError:
                pass

    def stats(self) -> dict[str, Any]:
        if self._counters is None:
            try:
                self._counters = RequestCounters.attach(self.counters_path)
            except (OSError, ValueError):
                return {}
        out = summed_stats(self._counters, prefetch=self._orders is not None)
        out["workers"] = self.ctx.share.fuse_workers
        if self._orders is not None:
            out["prefetch_budget"] = self.ctx.spec.prefetch_mb << 20
            out["prefetch_clients"] = len(self._clients)
        return out

    def prefetch_window(self) -> int:
        """The descriptor of the shared window's state (prefetch mode), for the node's API
        readers: they read it to know what was pushed and mark what they decode
        themselves."""
        if self.window is None:
            raise MountError("this mount is in sync mode; mount it with --mode prefetch")
        return self.window.state_fd

    def set_order(self, entries: list[int], client: str) -> int:
        """A client's order for its next epoch (replacing its last one): its regular files,
        with their sizes, in an order file handed to the frontend process."""
        if self._orders is None:
            raise MountError("this mount is in sync mode; mount it with --mode prefetch")
        index = self.ctx.index
        arr = np.asarray(entries, dtype=np.int64)
        if len(arr):
            arr = arr[(arr >= 0) & (arr < index.n_entries)]
            arr = arr[index.entries["kind"][arr] == KIND_FILE]
        with self._order_lock:
            slot = self._clients.pop(client, None)
            if slot is None and len(self._clients) >= CLIENTS:
                # forget the client heard from longest ago
                _old, slot = self._clients.popitem(last=False)
                self._send(encode(DROP, slot, 0))
            if slot is None:
                used = set(self._clients.values())
                slot = next(i for i in range(CLIENTS) if i not in used)
            self._clients[client] = slot
            self._generation += 1
            fd = write_order(slot, self._generation, arr, index.entries["size"][arr])
            try:
                self._send(encode(ORDER, slot, self._generation, len(arr)), [fd])
            finally:
                os.close(fd)
        log.info("prefetch order of %d files from %s", len(arr), client or "a reader")
        return len(arr)

    def _send(self, msg: bytes, fds: list[int] | None = None) -> None:
        try:
            socket.send_fds(self._orders, [msg], fds or [])
        except OSError as exc:
            raise MountError(f"{self.ctx.mountpoint}: the kernel frontend is not taking "
                             f"orders ({exc.strerror})") from None

    # ------------------------------------------------------------------ internals
    def _wait(self, timeout: float) -> None:
        proc = self.proc
        if proc is None:
            return
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        self._cleanup_mount()

    def _cleanup_mount(self) -> None:
        """A frontend that died without unmounting leaves a stale mount: remove it."""
        from fanstore import mounttable

        mnt = self.ctx.mountpoint
        if mounttable.mount_status(mnt) != "none":
            ok, msg = mounttable.fusermount_unmount(mnt, lazy=True)
            if not ok:
                log.error("%s: could not unmount: %s", mnt, msg)


def prefetch_buffer_bytes(budget: int, slots: int) -> int:
    """The shared buffer's share of ``--prefetch-mb``: what is left once every worker's
    prefetch thread holds one piece decoded before pushing it (at least half)."""
    return max(budget // 2, budget - slots * PUSH_PIECE)


def _log_format() -> str | None:
    """The daemon's log line format, so the frontend's lines look the same (rank prefix)."""
    for h in logging.getLogger().handlers:
        if h.formatter is not None:
            return h.formatter._fmt
    return None


def create(ctx: MountContext) -> KernelFrontend:
    return KernelFrontend(ctx)
