"""Serving a mount from processes the session did not fork ("external workers").

The supervisor of a :class:`~.session.KernelSession` normally forks its workers. When the
workers must be processes of their own (MPI ranks, which must not be forked after
MPI_Init), the supervisor instead listens on a Unix socket and hands each worker that
connects its descriptor on the connection (a FUSE_DEV_IOC_CLONE, or the session fd) with
``SCM_RIGHTS``, plus what it needs to serve: its slot (its counters row), the negotiated
limits (the receive buffer size) and the counters file.

Protocol (one SOCK_SEQPACKET connection per worker, kept open while it serves; every
send is one message):

1. worker -> supervisor: ``b"W"`` (hello).
2. supervisor -> worker: one JSON line ``{"slot", "workers", "bufsize", "counters",
   "minor", "flags"}`` (the engine's own fields, read into a :class:`Grant`) with the
   descriptor attached, then any extra descriptors the session shares with its workers
   (e.g. shared memory: what they are is the application's, which both sides know).
3. supervisor -> worker, any time after: the application's messages (the connection is the
   worker's channel, :meth:`KernelSession.send`).
4. worker -> supervisor, when its Dispatcher stops: ``b"U"`` (the connection is gone: the
   mount was removed) before it closes; a worker that dies says nothing (EOF).

Only processes of the supervisor's own uid are accepted (``SO_PEERCRED``); the socket lives
in the mount's private runtime directory.
"""

from __future__ import annotations

import json
import os
import select
import socket
import struct
import time
from dataclasses import dataclass

from fanstore.errors import MountError
from fanstore.unixsock import address

_CRED = struct.Struct("3i")


def peer_uid(sock: socket.socket) -> int:
    return _CRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                        _CRED.size))[1]


@dataclass
class Grant:
    """What a worker gets: its slot, its descriptor and the session's limits."""

    slot: int
    fd: int
    bufsize: int
    counters: str | None
    minor: int
    flags: int
    workers: int = 1
    extra_fds: tuple[int, ...] = ()


class HandoffServer:
    """The supervisor's side: a listening socket, the connected workers."""

    def __init__(self, path: str) -> None:
        self.path = path
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        old = os.umask(0o177)
        try:
            with address(path) as where:
                self.sock.bind(where)
        finally:
            os.umask(old)
        self.sock.listen(64)
        self.workers: dict[int, socket.socket] = {}  # slot -> connection

    def accept(self, n: int, grant_fd, info: dict, timeout: float, stop=lambda: False,
               extra_fds: list[int] | None = None) -> None:
        """Accept ``n`` workers (slots 1..n); ``grant_fd(slot)`` makes each one's fd;
        ``extra_fds`` go to every worker after it."""
        deadline = time.monotonic() + timeout
        slot = 0
        while slot < n:
            if stop():
                raise MountError("stopped while waiting for the worker ranks")
            left = deadline - time.monotonic()
            if left <= 0:
                raise MountError(f"only {slot} of {n} worker ranks connected within "
                                 f"{timeout:g} s")
            r, _, _ = select.select([self.sock], [], [], min(left, 0.5))
            if not r:
                continue
            conn, _ = self.sock.accept()
            if peer_uid(conn) != os.geteuid():
                conn.close()
                continue
            conn.settimeout(10)
            try:
                if conn.recv(1) != b"W":
                    conn.close()
                    continue
                slot += 1
                fd = grant_fd(slot)
                head = json.dumps(dict(info, slot=slot)).encode() + b"\n"
                socket.send_fds(conn, [head], [fd, *(extra_fds or [])])
            except OSError:
                conn.close()
                continue
            conn.setblocking(False)
            self.workers[slot] = conn

    def fds(self) -> dict[int, socket.socket]:
        return dict(self.workers)

    def close(self) -> None:
        for conn in self.workers.values():
            conn.close()
        self.workers.clear()
        self.sock.close()
        try:
            os.unlink(self.path)
        except OSError:
            pass


def join(path: str, timeout: float, alive=lambda: True) -> tuple[Grant, socket.socket]:
    """The worker's side: connect (retrying until the socket exists, ``timeout`` s, while
    ``alive()``), say hello, receive the grant. The returned socket stays open while the
    worker serves (closing it tells the supervisor the worker is gone)."""
    deadline = time.monotonic() + timeout
    while True:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        try:
            with address(path) as where:
                s.connect(where)
            break
        except (FileNotFoundError, ConnectionRefusedError):
            s.close()
            if time.monotonic() > deadline or not alive():
                raise MountError(f"the kernel frontend's worker socket {path} did not "
                                 f"answer within {timeout:g} s") from None
            time.sleep(0.05)
    if peer_uid(s) != os.geteuid():
        s.close()
        raise MountError(f"{path} is served by another user; refusing it")
    s.settimeout(max(1.0, deadline - time.monotonic()))
    s.sendall(b"W")
    msg, fds, _flags, _addr = socket.recv_fds(s, 65536, 16)
    if not fds or not msg.endswith(b"\n"):
        for fd in fds:
            os.close(fd)
        s.close()
        raise MountError("the kernel frontend sent no descriptor")
    info = json.loads(msg)
    s.settimeout(None)
    return Grant(int(info["slot"]), fds[0], int(info["bufsize"]), info.get("counters"),
                 int(info.get("minor", 0)), int(info.get("flags", 0)),
                 int(info.get("workers", 1)), tuple(fds[1:])), s


def say_gone(s: socket.socket) -> None:
    try:
        s.sendall(b"U")
    except OSError:
        pass
    s.close()
