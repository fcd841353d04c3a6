"""The node daemon's control socket: protocol, server, and the one client.

Wire format (a Unix stream socket at :func:`fanstore.runtime.socket_path`): each request
is one JSON object on one line; each reply is one JSON object on one line, followed by
``size`` raw bytes when the reply carries data (``"size"`` key). Errors come back as
``{"error": message, "errno": n, "kind": class name}`` and the client raises the same
FanStoreError class with the same message, so a caller sees the daemon's error as if it
had happened in-process.

Requests served by a node daemon (:mod:`fanstore.daemon.service`):

| op | request fields | reply |
|---|---|---|
| ``ping`` | | ``{"ok": true, "pid": n}`` |
| ``info`` | | store, mode, data dir, local partitions, placement (what a reader process needs to read local partitions itself) |
| ``stats`` | | the node's counters (``fanstore stats``) |
| ``shutdown`` | ``reason``, ``everywhere`` | ``{"ok": true}`` |
| ``prefetch`` | ``paths`` or ``list``, ``client`` | ``{"ok": true, "files": n, "unknown": n}`` |
| ``fetch`` | ``entry`` or ``path`` | the whole file, decoded and checked (payload) |
| ``read_stored`` | ``part``, ``offset``, ``length``, ``entry`` | stored bytes of a partition held by another node (payload) |

:class:`NodeSource` is the read core's remote source in every process of a node other
than the daemon: it asks the daemon for the stored bytes of partitions held elsewhere.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
from typing import Any, Callable

from fanstore import errors as E
from fanstore.errors import FanStoreError, MountError

log = logging.getLogger(__name__)

Handler = Callable[[dict[str, Any]], Any]

#: Longest request line accepted (a prefetch order of millions of paths fits).
MAX_LINE = 256 << 20

_KINDS: dict[str, type[FanStoreError]] = {
    cls.__name__: cls for cls in (
        E.FanStoreError, E.UsageError, E.FormatError, E.CorruptDataError, E.NotFoundError,
        E.IsADirectoryError_, E.NotADirectoryError_, E.SymlinkLoopError, E.MountError,
        E.RemoteError)
}


def error_reply(exc: FanStoreError) -> dict[str, Any]:
    return {"error": str(exc), "errno": exc.errno, "kind": type(exc).__name__}


def raise_for(reply: dict[str, Any]) -> None:
    """Raise the FanStoreError an error reply describes (MountError when unknown)."""
    cls = _KINDS.get(str(reply.get("kind")), MountError)
    if reply.get("kind") not in _KINDS and reply.get("errno") == 5:
        cls = E.CorruptDataError
    raise cls(str(reply["error"]))


# --------------------------------------------------------------------------- server


class ControlServer:
    """Serves ``handlers`` (op name -> callable(request) -> dict or (dict, payload bytes))
    on a Unix socket, one thread per connection. A handler raises FanStoreError for an
    error reply; anything else is logged and answered as an internal error."""

    def __init__(self, path: str, handlers: dict[str, Handler]) -> None:
        self.path = path
        self.handlers = handlers
        self._sock: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._closing = False

    def start(self) -> None:
        os.makedirs(os.path.dirname(self.path), mode=0o700, exist_ok=True)
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(self.path)
        sock.listen(128)
        self._sock = sock
        self._thread = threading.Thread(target=self._accept, name="fanstore-control",
                                        daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._closing = True
        sock, self._sock = self._sock, None
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()
        try:
            os.unlink(self.path)
        except OSError:
            pass
        if self._thread is not None:
            self._thread.join(2.0)

    def _accept(self) -> None:
        while not self._closing and self._sock is not None:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), name="fanstore-control-client",
                             daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        rfile = conn.makefile("rb")
        try:
            while True:
                line = rfile.readline(MAX_LINE)
                if not line or not line.endswith(b"\n"):
                    return
                reply = self.dispatch(line)
                payload = b""
                if isinstance(reply, tuple):
                    reply, payload = reply
                    reply["size"] = len(payload)
                conn.sendall(json.dumps(reply).encode() + b"\n")
                if payload:
                    conn.sendall(payload)
        except OSError:
            pass
        finally:
            rfile.close()
            conn.close()

    def dispatch(self, line: bytes):
        try:
            req = json.loads(line)
        except ValueError:
            return {"error": "malformed request", "errno": 22, "kind": "UsageError"}
        handler = self.handlers.get(req.get("op")) if isinstance(req, dict) else None
        if handler is None:
            return {"error": f"unknown request {line[:80]!r}", "errno": 22, "kind": "UsageError"}
        try:
            return handler(req)
        except FanStoreError as exc:
            return error_reply(exc)
        except (KeyError, TypeError, ValueError) as exc:
            return {"error": f"malformed request ({exc})", "errno": 22, "kind": "UsageError"}
        except Exception as exc:  # noqa: BLE001 - a request must never kill the daemon
            log.exception("control request %r failed", req.get("op"))
            return {"error": f"internal error: {type(exc).__name__}: {exc}", "errno": 5,
                    "kind": "FanStoreError"}


# --------------------------------------------------------------------------- client


class ControlClient:
    """Requests to the daemon serving ``mountpoint``; one connection per thread and
    process (safe after ``fork``: a child opens its own)."""

    def __init__(self, mountpoint: str, timeout: float = 120.0, path: str | None = None) -> None:
        from fanstore import runtime

        self.mountpoint = mountpoint
        self.timeout = timeout
        self.path = path or runtime.socket_path(mountpoint)
        self._local = threading.local()

    def _conn(self):
        conn = getattr(self._local, "conn", None)
        if conn is None or self._local.pid != os.getpid():
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.settimeout(self.timeout)
            try:
                s.connect(self.path)
            except (FileNotFoundError, ConnectionRefusedError):
                s.close()
                raise MountError(f"{self.mountpoint}: no FanStore daemon serves this mount "
                                 "point") from None
            except OSError as exc:
                s.close()
                raise MountError(f"{self.mountpoint}: cannot reach the daemon: "
                                 f"{exc.strerror}") from None
            conn = (s, s.makefile("rb"))
            self._local.conn = conn
            self._local.pid = os.getpid()
        return conn

    def drop(self) -> None:
        conn = getattr(self._local, "conn", None)
        self._local.conn = None
        if conn is not None and getattr(self._local, "pid", None) == os.getpid():
            try:
                conn[1].close()
                conn[0].close()
            except OSError:
                pass

    def request(self, req: dict[str, Any]) -> tuple[dict[str, Any], bytes]:
        """Send one request; return (reply, payload). Raises the daemon's error."""
        sock, rfile = self._conn()
        try:
            sock.sendall(json.dumps(req).encode() + b"\n")
            line = rfile.readline()
            if not line:
                raise MountError(f"{self.mountpoint}: the daemon closed the connection")
            reply = json.loads(line)
            size = reply.get("size", 0) if isinstance(reply, dict) else 0
            payload = rfile.read(size) if size else b""
            if len(payload) != size:
                raise MountError(f"{self.mountpoint}: the daemon sent a short reply")
        except socket.timeout:
            self.drop()
            raise MountError(f"{self.mountpoint}: the daemon did not answer within "
                             f"{self.timeout:g} s") from None
        except (OSError, ValueError) as exc:
            self.drop()
            if isinstance(exc, FanStoreError):
                raise
            raise MountError(f"{self.mountpoint}: talking to the daemon failed: {exc}") from None
        if not isinstance(reply, dict):
            raise MountError(f"{self.mountpoint}: the daemon sent a malformed reply")
        if "error" in reply:
            raise_for(reply)
        return reply, payload

    def close(self) -> None:
        self.drop()


def control(mountpoint: str, request: dict[str, Any], timeout: float = 10.0) -> dict[str, Any]:
    """One request to the daemon serving ``mountpoint`` on a fresh connection."""
    client = ControlClient(mountpoint, timeout)
    try:
        return client.request(request)[0]
    finally:
        client.close()


class NodeSource:
    """The read core's remote source in a reader process of a node: partitions held by
    other nodes are read through the node daemon (which fetches them over MPI)."""

    def __init__(self, client: ControlClient, remote_parts: set[int],
                 replicated: set[int]) -> None:
        self.client = client
        self._remote = remote_parts  # partitions this node does not hold
        self._replicated = replicated  # local partitions another node also holds

    def serves(self, part: int) -> bool:
        return part in self._remote or part in self._replicated

    def fetch(self, part: int, offset: int, length: int, entry: int | None = None):
        _, payload = self.client.request({"op": "read_stored", "part": part, "offset": offset,
                                          "length": length, "entry": entry})
        if len(payload) != length:
            raise E.RemoteError(f"partition {part}: the daemon sent {len(payload)} bytes, "
                                f"asked for {length}")
        return payload
