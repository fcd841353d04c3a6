"""Mount wiring: pyfuse3 init/main/close, signals, the control socket, readiness.

Everything that lives as long as the mount is started here, in one nursery, and torn down
in one place: the FUSE session loop, the signal watcher (SIGINT/SIGTERM unmount cleanly),
the control socket server, and any extra tasks the caller adds (the MPI layer adds one
that watches for a cluster-wide shutdown).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket as _socket
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

import pyfuse3
import trio

from fanstore import runtime
from fanstore.errors import FanStoreError, MountError, NotFoundError
from fanstore.format.index import KIND_FILE
from fanstore.fuse.ops import FanStoreOps

log = logging.getLogger(__name__)

Handler = Callable[[dict[str, Any]], Any]


@dataclass
class MountOptions:
    cache_mb: int = 256
    threads: int = 0  # decode threads; 0 = 2 per core, at least 4
    allow_other: bool = False
    max_tasks: int = 64
    mode: str = "sync"  # or "prefetch" (fanstore/prefetch.py)
    prefetch_mb: int = 1024
    store_path: str = ""
    fsname: str = "fanstore"
    extra_handlers: dict[str, Handler] = field(default_factory=dict)

    def decode_threads(self) -> int:
        if self.threads:
            return self.threads
        return max(4, 2 * len(os.sched_getaffinity(0)))


def prepare_mountpoint(mountpoint: str) -> None:
    """Refuse bad mount points; clean a stale mount left by a crashed daemon."""
    status = runtime.mount_status(mountpoint)
    if status == "stale":
        log.warning("%s: stale mount left by a daemon that died; unmounting it", mountpoint)
        print(f"fanstore: {mountpoint}: cleaning up a stale mount left by a crashed daemon",
              flush=True, file=__import__("sys").stderr)
        ok, msg = runtime.fusermount_unmount(mountpoint, lazy=True)
        if not ok and runtime.mount_status(mountpoint) != "none":
            raise MountError(f"{mountpoint}: cannot clean up the stale mount: {msg}")
    elif status == "live":
        state = runtime.read_state(mountpoint) or {}
        pid = state.get("pid")
        if runtime.pid_alive(pid):
            raise MountError(f"{mountpoint} is already mounted by FanStore (daemon pid {pid})")
        raise MountError(f"{mountpoint} is already a mount point; unmount it first")
    if not os.path.exists(mountpoint):
        raise MountError(f"mount point {mountpoint} does not exist")
    if not os.path.isdir(mountpoint):
        raise MountError(f"mount point {mountpoint} is not a directory")


class Daemon:
    """One mounted file system: the trio side of a FanStore daemon."""

    def __init__(self, ns, store, mountpoint: str, options: MountOptions) -> None:
        self.ns = ns
        self.store = store
        self.mountpoint = mountpoint
        self.options = options
        self.handlers: dict[str, Handler] = {
            "ping": lambda req: {"ok": True, "pid": os.getpid()},
            "info": self._info_request,
            "stats": lambda req: self.store.stats.to_json(self.store.cache),
            "shutdown": self._shutdown_request,
            "prefetch": self._prefetch_request,
            "fetch": self._fetch_request,
        }
        self.handlers.update(options.extra_handlers)
        self.stopping = False
        self.stop_reason = ""
        self.on_stop: list[Callable[[str, bool], None]] = []
        self.pending_stop: str | None = None
        self.signal_stop_everywhere = False
        self._token: trio.lowlevel.TrioToken | None = None

    # ------------------------------------------------------------------ stopping
    def request_stop(self, reason: str, everywhere: bool = False) -> None:
        """Unmount and end the loop (call from the trio thread). ``everywhere`` asks the
        on-stop callbacks to stop the other nodes too (a multi-rank job)."""
        if self.stopping:
            return
        self.stopping = True
        self.stop_reason = reason
        log.info("stopping: %s", reason)
        for cb in self.on_stop:
            try:
                cb(reason, everywhere)
            except Exception:  # pragma: no cover - defensive
                log.exception("stop callback failed")
        pyfuse3.terminate()

    def request_stop_threadsafe(self, reason: str) -> None:
        """Ask for a stop from another thread (e.g. the MPI server thread)."""
        if self._token is None:
            self.pending_stop = reason  # the loop has not started: main() picks it up
            return
        try:
            trio.from_thread.run_sync(self.request_stop, reason, trio_token=self._token)
        except trio.RunFinishedError:
            pass

    def _info_request(self, req: dict[str, Any]) -> dict[str, Any]:
        return {"ok": True, "pid": os.getpid(), "store": self.options.store_path,
                "mode": self.options.mode, "mountpoint": runtime.mount_key(self.mountpoint)}

    def _resolve(self, path: str) -> int:
        entry = self.ns.index.resolve(os.fsencode(path))
        if entry is None:
            raise NotFoundError(f"{path}: no such file in the store")
        return entry

    def _prefetch_request(self, req: dict[str, Any]) -> dict[str, Any]:
        """Set the access order of the next epoch: ``paths`` (relative to the mount root)
        or ``list`` (a file with one path per line, read by the daemon). ``client`` names
        the reader (one order per training process; a new order replaces that client's)."""
        prefetcher = self.store.prefetcher
        if prefetcher is None:
            raise MountError("this mount is in sync mode; mount it with --mode prefetch")
        paths = req.get("paths")
        if paths is None and req.get("list"):
            try:
                with open(req["list"], "rb") as f:
                    paths = [os.fsdecode(line.rstrip(b"\n")) for line in f if line.strip()]
            except OSError as exc:
                raise MountError(f"{req['list']}: cannot read: {exc.strerror}") from None
        if not isinstance(paths, list):
            raise MountError("prefetch needs 'paths' (a list) or 'list' (a file of paths)")
        entries, unknown = [], 0
        for p in paths:
            entry = self.ns.index.resolve(os.fsencode(str(p)))
            if entry is None:
                unknown += 1
            else:
                entries.append(entry)
        client = str(req.get("client") or "default")
        n = prefetcher.set_order(entries, client)
        return {"ok": True, "files": n, "unknown": unknown}

    async def _fetch_request(self, req: dict[str, Any]):
        """A whole file for the Python API: raw bytes, or stored bytes the caller decodes."""
        entry = req.get("entry")
        if not isinstance(entry, int) or not 0 <= entry < self.ns.n_entries:
            entry = self._resolve(str(req.get("path", "")))
        if self.ns.kind(entry) != KIND_FILE:
            raise MountError(f"{self.ns.show(entry)}: not a regular file")
        kind, payload = await self.store.fetch_for_api(entry)
        return {"ok": True, "kind": kind, "entry": entry}, payload

    def _shutdown_request(self, req: dict[str, Any]) -> dict[str, Any]:
        self.request_stop(str(req.get("reason", "shutdown requested")),
                          everywhere=bool(req.get("everywhere", False)))
        return {"ok": True}

    # ------------------------------------------------------------------ tasks
    async def _signals(self) -> None:
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM, signal.SIGHUP) as sigs:
            async for signum in sigs:
                self.request_stop(f"signal {signal.Signals(signum).name}",
                                  everywhere=self.signal_stop_everywhere)

    async def _control_server(self, task_status=trio.TASK_STATUS_IGNORED) -> None:
        path = runtime.socket_path(self.mountpoint)
        os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        sock = trio.socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
        await sock.bind(path)
        sock.listen(64)
        task_status.started()
        try:
            async with trio.open_nursery() as nursery:
                while True:
                    conn, _ = await sock.accept()
                    nursery.start_soon(self._serve_client, conn)
        finally:
            sock.close()
            try:
                os.unlink(path)
            except OSError:
                pass

    async def _serve_client(self, conn) -> None:
        """One client connection: JSON requests, one per line; each reply is one JSON line,
        followed by ``size`` raw bytes when the reply carries data (``fetch``)."""
        stream = trio.SocketStream(conn)
        try:
            buf = bytearray()
            while True:
                while b"\n" not in buf:
                    data = await stream.receive_some(65536)
                    if not data:
                        return
                    buf += data
                    if len(buf) > (256 << 20):
                        return  # no request is that long
                line, _, rest = bytes(buf).partition(b"\n")
                buf = bytearray(rest)
                reply = await self._dispatch(line)
                payload = b""
                if isinstance(reply, tuple):
                    reply, payload = reply
                    reply["size"] = len(payload)
                await stream.send_all(json.dumps(reply).encode() + b"\n")
                if payload:
                    await stream.send_all(payload)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            pass
        finally:
            await stream.aclose()

    async def _dispatch(self, line: bytes) -> dict[str, Any]:
        try:
            req = json.loads(line)
            handler = self.handlers.get(req.get("op")) if isinstance(req, dict) else None
            if handler is None:
                return {"error": f"unknown request {line[:80]!r}"}
            out = handler(req)
            if hasattr(out, "__await__"):
                out = await out
            return out
        except FanStoreError as exc:
            return {"error": str(exc), "errno": exc.errno}
        except ValueError:
            return {"error": "malformed request"}

    # ------------------------------------------------------------------ run
    async def main(
        self,
        on_ready: Callable[[], Any] | None = None,
        extra_tasks: tuple[Callable[..., Awaitable[Any]], ...] = (),
    ) -> None:
        self._token = trio.lowlevel.current_trio_token()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._signals)
            await nursery.start(self._control_server)
            for task in extra_tasks:
                nursery.start_soon(task, self)
            if hasattr(self.store, "start"):
                self.store.start(nursery)
            # The kernel queues requests from the moment of the mount; they are served once
            # the session loop below runs, so the mount is ready now.
            runtime.write_state(self.mountpoint, phase="ready")
            if on_ready is not None:
                on_ready()
            if self.pending_stop:
                self.request_stop(self.pending_stop)
            await pyfuse3.main(min_tasks=1, max_tasks=self.options.max_tasks)
            if not self.stopping:
                self.stopping = True
                self.stop_reason = "unmounted from outside"
                for cb in self.on_stop:
                    cb(self.stop_reason, False)
            nursery.cancel_scope.cancel()


def run(
    ns,
    store,
    mountpoint: str,
    options: MountOptions,
    on_ready: Callable[[], Any] | None = None,
    extra_tasks: tuple = (),
    setup: Callable[[Daemon], Any] | None = None,
    gate: Callable[[bool], bool] | None = None,
    signal_stop_everywhere: bool = False,
) -> Daemon:
    """Mount ``store`` at ``mountpoint`` and serve until unmounted or signalled.

    Blocks; returns the daemon (its ``stop_reason`` says why it ended) after the file
    system is unmounted. ``gate(mounted)`` is called once, after this node's mount
    succeeded (True) or failed (False); in a multi-rank job it waits for every rank, and
    when it returns False the mount is undone and MountError raised, so no node serves
    unless all do.
    """
    daemon = Daemon(ns, store, mountpoint, options)
    daemon.signal_stop_everywhere = signal_stop_everywhere
    if setup is not None:
        setup(daemon)
    ops = FanStoreOps(ns, store)
    fuse_opts = set(pyfuse3.default_options)
    fuse_opts |= {"ro", f"fsname={options.fsname}", "subtype=fanstore"}
    if options.allow_other:
        fuse_opts.add("allow_other")
    try:
        prepare_mountpoint(mountpoint)
        runtime.write_state(mountpoint, pid=os.getpid(),
                            mountpoint=runtime.mount_key(mountpoint), phase="mounting")
        try:
            pyfuse3.init(ops, mountpoint, fuse_opts)
        except RuntimeError as exc:
            hint = "" if os.path.exists("/dev/fuse") else " (/dev/fuse is missing)"
            raise MountError(f"cannot mount {mountpoint}: {exc}{hint}") from exc
    except FanStoreError as exc:
        runtime.write_state(mountpoint, phase="failed", error=str(exc))
        if gate is not None:
            gate(False)
        raise
    unmounted = False
    try:
        if gate is not None and not gate(True):
            raise MountError(f"{mountpoint}: another rank failed to mount; not serving")
        trio.run(daemon.main, on_ready, extra_tasks)
        unmounted = True
    finally:
        try:
            pyfuse3.close(unmount=True)
        except Exception:  # pragma: no cover - best effort
            log.exception("pyfuse3.close failed")
        if runtime.mount_status(mountpoint) != "none":
            ok, msg = runtime.fusermount_unmount(mountpoint, lazy=True)
            if not ok:
                log.error("%s: could not unmount: %s", mountpoint, msg)
        runtime.write_state(mountpoint, phase="stopped" if unmounted else "failed")
    return daemon
