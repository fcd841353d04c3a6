"""The node daemon's control socket: protocol, server, and the one client.

Wire format (a Unix stream socket, ``ctl.sock`` in the mount's private runtime directory:
:class:`fanstore.runtime.MountRuntime`): each request is one JSON object on one line; each reply is one JSON object on one line, followed by
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
| ``shutdown`` (owner) | ``reason``, ``everywhere`` | ``{"ok": true}`` |
| ``prefetch`` (owner) | ``paths`` (a list, read by the client) or ``entries`` (index entries), ``client`` | ``{"ok": true, "files": n, "unknown": n}`` |
| ``window`` (owner) | | prefetch mode: the window's shared state, a descriptor passed with the reply (SCM_RIGHTS) |
| ``read_stored`` | ``part``, ``offset``, ``length``, ``entry`` | stored bytes of a partition held by another node (payload) |

Who may ask: the server serves only peers of its own uid and root (``SO_PEERCRED``); the
client talks only to a daemon of its own uid or root. Requests are bounded (size, JSON
depth, a string ``op``, a time to finish the line) and every field is type-checked by its
handler; whatever is malformed gets an error reply and the daemon keeps serving. The
client checks that a reply carries no more bytes than it asked for.

:class:`NodeSource` is the read core's remote source in every process of a node other
than the daemon: it asks the daemon for the stored bytes of partitions held elsewhere;
:func:`node_reader` builds such a process's whole read core (the kernel frontend's workers,
the API's mount reader).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import struct
import threading
import time
from typing import Any, Callable

from fanstore import errors as E
from fanstore.errors import FanStoreError, MountError, UnsafePathError
from fanstore.unixsock import address

log = logging.getLogger(__name__)

Handler = Callable[[dict[str, Any]], Any]

_KINDS: dict[str, type[FanStoreError]] = {
    cls.__name__: cls for cls in (
        E.FanStoreError, E.UsageError, E.FormatError, E.CorruptDataError, E.NotFoundError,
        E.IsADirectoryError_, E.NotADirectoryError_, E.SymlinkLoopError, E.MountError,
        E.RemoteError, E.NodeStoppingError, E.UnsafePathError, E.StageError,
        E.PermissionDeniedError, E.OutsideStoreError)
}


def error_reply(exc: FanStoreError) -> dict[str, Any]:
    return {"error": str(exc), "errno": exc.errno, "kind": type(exc).__name__}


def raise_for(reply: dict[str, Any]) -> None:
    """Raise the FanStoreError an error reply describes (MountError when unknown)."""
    cls = _KINDS.get(str(reply.get("kind")), MountError)
    if reply.get("kind") not in _KINDS and reply.get("errno") == 5:
        cls = E.CorruptDataError
    raise cls(str(reply["error"]))


# --------------------------------------------------------------------------- peers


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end of a Unix socket (SO_PEERCRED)."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size)
    return _CRED.unpack(raw)


_CRED = struct.Struct("3i")


def trusted_uid(uid: int) -> bool:
    """The uids a daemon and its clients accept at the other end: our own, and root."""
    return uid == os.geteuid() or uid == 0


# --------------------------------------------------------------------------- server

#: Longest request line accepted (a prefetch order of a few million paths fits).
MAX_LINE = 256 << 20
#: Deepest JSON nesting accepted (requests are flat objects of scalars and lists).
MAX_DEPTH = 4
#: Once a request has started, the rest of its line must arrive within this many seconds.
REQUEST_TIMEOUT = 30.0
#: Connections served at once (each has a thread: readers keep one per thread).
MAX_CONNECTIONS = 512


def _depth(value: Any, limit: int) -> int:
    """Nesting depth of a decoded JSON value, counting no further than ``limit`` + 1."""
    todo = [(value, 1)]
    deepest = 0
    while todo:
        v, d = todo.pop()
        if d > deepest:
            deepest = d
            if deepest > limit:
                return deepest
        if isinstance(v, dict):
            todo.extend((x, d + 1) for x in v.values() if isinstance(x, (dict, list)))
        elif isinstance(v, list):
            todo.extend((x, d + 1) for x in v if isinstance(x, (dict, list)))
    return deepest


def _usage(message: str) -> dict[str, Any]:
    return {"error": message, "errno": 22, "kind": "UsageError"}


class ControlServer:
    """Serves ``handlers`` (op name -> callable(request) -> dict or (dict, payload bytes))
    on a Unix socket, one thread per connection (at most MAX_CONNECTIONS).

    Only processes of this uid (and root) are served (SO_PEERCRED); ops in ``owner_ops``
    only when the peer's uid is the daemon's own or root (the socket's directory is
    private too: this is the second wall). Every request is bounded (MAX_LINE bytes,
    MAX_DEPTH levels of JSON, an object with a string ``op``, REQUEST_TIMEOUT to finish a
    line once started); a malformed one gets an error reply and the connection goes on. A
    handler raises FanStoreError for an error reply; anything else is logged and answered
    as an internal error. A request carries the peer's uid to the handler as ``_uid``.

    A reply dict may carry ``"_fds"``: descriptors sent with the reply line (SCM_RIGHTS;
    read with :meth:`ControlClient.request_fds`).
    """

    def __init__(self, path: str, handlers: dict[str, Handler],
                 owner_ops: frozenset[str] | set[str] = frozenset()) -> None:
        self.path = path
        self.handlers = handlers
        self.owner_ops = frozenset(owner_ops)
        self._sock: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._closing = False
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self.refused = 0  # connections from other uids, or over the limit

    def start(self) -> None:
        try:
            os.unlink(self.path)  # a socket a killed daemon left; the directory is private
        except FileNotFoundError:
            pass
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)  # the socket file itself 0600
        try:
            with address(self.path) as where:
                sock.bind(where)
        finally:
            os.umask(old)
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
            try:
                pid, uid, _gid = peer_credentials(conn)
            except OSError:
                conn.close()
                continue
            if not trusted_uid(uid):
                self.refused += 1
                # the first few, then one in a thousand: a refused peer cannot flood the log
                if self.refused <= 10 or self.refused % 1000 == 0:
                    log.warning("control socket: refused a connection from uid %d (pid %d)"
                                " (%d refused so far)", uid, pid, self.refused)
                conn.close()
                continue
            if not self._slots.acquire(blocking=False):
                self.refused += 1
                self._send_and_close(conn, {"error": f"the daemon serves at most "
                                            f"{MAX_CONNECTIONS} connections at once",
                                            "errno": 11, "kind": "MountError"})
                continue
            threading.Thread(target=self._serve, args=(conn, uid),
                             name="fanstore-control-client", daemon=True).start()

    @staticmethod
    def _send_and_close(conn: socket.socket, reply: dict[str, Any]) -> None:
        try:
            conn.settimeout(1.0)
            conn.sendall(json.dumps(reply).encode() + b"\n")
        except OSError:
            pass
        conn.close()

    def _serve(self, conn: socket.socket, uid: int) -> None:
        try:
            for line in _lines(conn):
                if line is None:  # too long or too slow: answered, then dropped
                    conn.sendall(json.dumps(_usage(
                        f"request longer than {MAX_LINE} bytes or not finished within "
                        f"{REQUEST_TIMEOUT:g} s")).encode() + b"\n")
                    return
                reply = self.dispatch(line, uid)
                payload = b""
                if isinstance(reply, tuple):
                    reply, payload = reply
                    reply["size"] = len(payload)
                fds = reply.pop("_fds", None) if isinstance(reply, dict) else None
                conn.settimeout(REQUEST_TIMEOUT)  # a client that stops reading is dropped
                data = json.dumps(reply).encode() + b"\n"
                if fds:
                    sent = socket.send_fds(conn, [data], list(fds))
                    data = data[sent:]
                conn.sendall(data)
                if payload:
                    conn.sendall(payload)
        except OSError:
            pass
        finally:
            conn.close()
            self._slots.release()

    def dispatch(self, line: bytes, uid: int | None = None):
        """The reply to one request line from a peer of ``uid`` (None: in-process)."""
        try:
            req = json.loads(line)
        except (ValueError, RecursionError):
            return _usage("malformed request (not JSON)")
        if not isinstance(req, dict) or not isinstance(req.get("op"), str):
            return _usage("malformed request (an object with a string 'op' is expected)")
        if _depth(req, MAX_DEPTH) > MAX_DEPTH:
            return _usage(f"malformed request (nested deeper than {MAX_DEPTH} levels)")
        op = req["op"]
        handler = self.handlers.get(op)
        if handler is None:
            return _usage(f"unknown request {op[:40]!r}")
        if op in self.owner_ops and uid is not None and not trusted_uid(uid):
            return {"error": f"{op}: only the mount's owner may ask this", "errno": 1,
                    "kind": "MountError"}
        req["_uid"] = os.geteuid() if uid is None else uid
        try:
            return handler(req)
        except FanStoreError as exc:
            return error_reply(exc)
        except (KeyError, TypeError, ValueError, OverflowError) as exc:
            return _usage(f"malformed request ({type(exc).__name__}: {exc})")
        except Exception as exc:  # noqa: BLE001 - a request must never kill the daemon
            log.exception("control request %r failed", op)
            return {"error": f"internal error: {type(exc).__name__}: {exc}", "errno": 5,
                    "kind": "FanStoreError"}


def _lines(conn: socket.socket):
    """Request lines from ``conn`` (without the newline); None once a line is too long or
    too slow to arrive (the caller answers and drops the connection). An idle connection
    (no partial line) may wait for its next request as long as it likes."""
    buf = bytearray()
    started = 0.0
    conn.settimeout(REQUEST_TIMEOUT / 4)
    while True:
        nl = buf.find(b"\n")
        if nl >= 0:
            line = bytes(buf[:nl])
            del buf[: nl + 1]
            started = time.monotonic() if buf else 0.0
            yield line
            conn.settimeout(REQUEST_TIMEOUT / 4)
            continue
        if len(buf) > MAX_LINE or (started and time.monotonic() - started > REQUEST_TIMEOUT):
            yield None
            return
        try:
            chunk = conn.recv(1 << 20)
        except socket.timeout:
            continue
        if not chunk:
            return
        if not buf:
            started = time.monotonic()
        buf += chunk


# --------------------------------------------------------------------------- client

#: Largest payload a reply may carry unless the request says what to expect.
MAX_REPLY = 64 << 20


class ControlClient:
    """Requests to the daemon serving ``mountpoint``; one connection per thread and
    process (safe after ``fork``: a child opens its own). The daemon at the other end must
    run as this uid or root (SO_PEERCRED), and no reply may carry more bytes than asked."""

    def __init__(self, mountpoint: str, timeout: float = 120.0, path: str | None = None) -> None:
        from fanstore import runtime

        self.mountpoint = mountpoint
        self.timeout = timeout
        self.path = path or runtime.socket_path(mountpoint) or ""
        self._local = threading.local()
        #: (pid, uid) of the daemon last connected to
        self.server: tuple[int, int] | None = None

    def _conn(self):
        conn = getattr(self._local, "conn", None)
        if conn is None or self._local.pid != os.getpid():
            if not self.path:
                raise MountError(f"{self.mountpoint}: no FanStore daemon serves this mount "
                                 "point")
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.settimeout(self.timeout)
            try:
                with address(self.path) as where:
                    s.connect(where)
                pid, uid, _ = peer_credentials(s)
            except (FileNotFoundError, ConnectionRefusedError):
                s.close()
                raise MountError(f"{self.mountpoint}: no FanStore daemon serves this mount "
                                 "point") from None
            except OSError as exc:
                s.close()
                raise MountError(f"{self.mountpoint}: cannot reach the daemon: "
                                 f"{exc.strerror}") from None
            if not trusted_uid(uid):
                s.close()
                raise UnsafePathError(f"{self.mountpoint}: the control socket {self.path} is "
                                      f"served by uid {uid}, not by this user: refusing it")
            self.server = (pid, uid)
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

    def request(self, req: dict[str, Any], expect: int | None = None,
                limit: int = MAX_REPLY) -> tuple[dict[str, Any], bytes]:
        """Send one request; return (reply, payload). Raises the daemon's error. The
        payload must be exactly ``expect`` bytes when given, else at most ``limit``."""
        sock, rfile = self._conn()
        try:
            sock.sendall(json.dumps(req).encode() + b"\n")
            line = rfile.readline(1 << 20)
            if not line.endswith(b"\n"):
                raise MountError(f"{self.mountpoint}: the daemon closed the connection")
            reply = json.loads(line)
            if not isinstance(reply, dict):
                raise MountError(f"{self.mountpoint}: the daemon sent a malformed reply")
            size = reply.get("size", 0)
            if (not isinstance(size, int) or isinstance(size, bool) or size < 0
                    or size > (limit if expect is None else expect)
                    or (expect is not None and "error" not in reply and size != expect)):
                want = f"expected {expect}" if expect is not None else f"at most {limit}"
                raise MountError(f"{self.mountpoint}: the daemon announced {size!r} bytes, "
                                 f"{want}")
            payload = rfile.read(size) if size else b""
            if len(payload) != size:
                raise MountError(f"{self.mountpoint}: the daemon sent a short reply")
        except socket.timeout:
            self.drop()
            raise MountError(f"{self.mountpoint}: the daemon did not answer within "
                             f"{self.timeout:g} s") from None
        except (OSError, ValueError, RecursionError, FanStoreError) as exc:
            self.drop()
            if isinstance(exc, FanStoreError):
                raise
            raise MountError(f"{self.mountpoint}: talking to the daemon failed: {exc}") from None
        if "error" in reply:
            raise_for(reply)
        return reply, payload

    def request_fds(self, req: dict[str, Any], maxfds: int = 4) -> tuple[dict[str, Any], list[int]]:
        """One request whose reply carries descriptors (SCM_RIGHTS), on a connection of its
        own; returns (reply, fds). The caller owns the descriptors."""
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(self.timeout)
        fds: list[int] = []
        try:
            with address(self.path) as where:
                s.connect(where)
            _pid, uid, _ = peer_credentials(s)
            if not trusted_uid(uid):
                raise UnsafePathError(f"{self.mountpoint}: the control socket {self.path} is "
                                      f"served by uid {uid}, not by this user: refusing it")
            s.sendall(json.dumps(req).encode() + b"\n")
            buf = b""
            while not buf.endswith(b"\n") and len(buf) < (1 << 20):
                data, got, _flags, _addr = socket.recv_fds(s, 65536, maxfds)
                fds.extend(got)
                if not data:
                    break
                buf += data
            reply = json.loads(buf)
            if not isinstance(reply, dict):
                raise ValueError("not an object")
        except (OSError, ValueError) as exc:
            for fd in fds:
                os.close(fd)
            raise MountError(f"{self.mountpoint}: talking to the daemon failed: {exc}") from None
        finally:
            s.close()
        if "error" in reply:
            for fd in fds:
                os.close(fd)
            raise_for(reply)
        return reply, fds

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
                                          "length": length, "entry": entry}, expect=length)
        return payload


def node_reader(index, client: ControlClient, data_dir: str, local_parts, replicated,
                cache_bytes: int):
    """The read core of a reader process of a node other than its daemon: the partitions
    ``local_parts`` read from ``data_dir`` here (pread, decoded in this process), every other
    one through the daemon (:class:`NodeSource`, ``replicated``: local partitions another
    node also holds, re-read from there when damaged here). What the daemon's ``info`` (or
    the node's share of the mount spec) says. The caller closes ``reader.source.local``."""
    from fanstore.read import ChunkReader, LocalPartitions, RoutedSource

    local = [int(p) for p in local_parts]
    parts = LocalPartitions(data_dir, index, local)
    remote = set(range(len(index.partitions))) - set(local)
    source = RoutedSource(parts, NodeSource(client, remote, {int(p) for p in replicated}))
    return ChunkReader(index, source, cache_bytes=cache_bytes)
