"""How a rank reaches its peers: the :class:`Transport` interface, its errors, and the
in-process :class:`LocalTransport` (no MPI here).

The real transport is :class:`fanstore.daemon.mpitransport.MpiTransport` (the daemon's MPI
world); :class:`LocalTransport` connects ranks living in one process, so routing, failover
and the drain are testable without mpiexec. Both answer from a rank's local partitions
(``parts``: ``has``, ``size_of``, ``read_into``/``fetch``) and hand control messages
(SHUTDOWN, DONE) to ``on_control``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Protocol

from fanstore.daemon import protocol as P
from fanstore.errors import FanStoreError, NodeStoppingError, RemoteError


class RemoteTimeout(RemoteError):
    """A peer did not answer within the remote timeout."""


class Interrupted(NodeStoppingError):
    """This rank's node stops serving its mount: a remote read not answered within
    STOP_GRACE of that gives up, with no failover and no peer marked dead (the peer may
    have done nothing wrong)."""


#: seconds a read of a peer may still take once its node stops serving (a live peer,
#: draining, answers in milliseconds; one that died never does)
STOP_GRACE = 1.0


class ReadsEnd:
    """When a transport's reads of its peers give up (``Transport.interrupt``): never
    until :meth:`set`, then ``grace`` seconds later. Safe to set in a signal handler (two
    stores, the reason last)."""

    __slots__ = ("at", "reason")

    def __init__(self) -> None:
        self.reason: str | None = None
        self.at = 0.0

    def set(self, reason: str, grace: float = STOP_GRACE) -> None:
        if self.reason is None:
            self.at = time.monotonic() + grace
            self.reason = reason

    def left(self, now: float) -> float | None:
        """Seconds a read may still wait (None: no end set)."""
        return None if self.reason is None else self.at - now

    def passed(self) -> bool:
        return self.reason is not None and time.monotonic() >= self.at

    def error(self, owner: int) -> Interrupted:
        return Interrupted(f"rank {owner} not asked further: {self.reason}")


class PeerUnreachable(RemoteTimeout):
    """MPI could not reach a peer at all (its process is gone): treated like a timeout,
    the peer is marked dead and its replicas are tried."""


class Transport(Protocol):
    """How a rank reaches its peers: stored bytes, pings and control messages.

    :class:`~fanstore.daemon.mpitransport.MpiTransport` is the real one;
    :class:`LocalTransport` connects ranks living in one process (tests of routing,
    failover and the drain without mpiexec).
    """

    rank: int
    size: int

    def start(self) -> None: ...

    def stop(self, timeout: float = 10.0) -> None: ...

    @property
    def running(self) -> bool: ...

    def fetch(self, owner: int, part: int, offset: int, length: int, timeout: float):
        """Stored bytes of ``part`` from rank ``owner``; RemoteTimeout / RemoteError."""

    def ping(self, owner: int, timeout: float) -> bool: ...

    def interrupt(self, reason: str, grace: float = STOP_GRACE) -> None:
        """This rank's reads of its peers (waiting or new) end ``grace`` seconds from now
        at the latest, with Interrupted; its pings, control messages and service go on."""

    def send_control(self, kind: int, ranks, reason: str = "", timeout: float = 2.0) -> None:
        ...


class LocalHub:
    """Ranks of one process, wired to each other: what :class:`LocalTransport` talks over.
    ``down`` holds ranks that do not answer (a hung or dead peer)."""

    def __init__(self) -> None:
        self.ranks: dict[int, LocalTransport] = {}
        self.down: set[int] = set()


class LocalTransport:
    """An in-process :class:`Transport`: each rank's ``parts`` serve the others directly.

    A rank in ``hub.down`` behaves like a peer that never answers: a fetch or ping of it
    waits ``timeout`` seconds (capped at ``max_wait``, so tests stay quick) and fails."""

    def __init__(self, hub: LocalHub, rank: int, size: int, parts,
                 on_control: Callable[[P.ControlMsg], None] | None = None,
                 max_wait: float = 0.05) -> None:
        self.hub = hub
        self.rank = rank
        self.size = size
        self.parts = parts
        self.on_control = on_control or (lambda msg: None)
        self.max_wait = max_wait
        self.served_requests = 0
        self.served_bytes = 0
        self._running = False
        self.reads_end = ReadsEnd()
        hub.ranks[rank] = self

    def start(self) -> None:
        self._running = True

    def stop(self, timeout: float = 10.0) -> None:
        self._running = False

    @property
    def running(self) -> bool:
        return self._running

    def _peer(self, owner: int, timeout: float) -> LocalTransport:
        peer = self.hub.ranks.get(owner)
        if peer is None or owner in self.hub.down or not peer._running:
            time.sleep(min(timeout, self.max_wait))
            raise RemoteTimeout(f"rank {owner} did not answer within {timeout:g} s")
        return peer

    def interrupt(self, reason: str, grace: float = STOP_GRACE) -> None:
        self.reads_end.set(reason, grace)

    def fetch(self, owner: int, part: int, offset: int, length: int, timeout: float):
        if self.reads_end.passed():
            raise self.reads_end.error(owner)
        peer = self._peer(owner, timeout)
        if peer.parts is None or not peer.parts.has(part):
            raise RemoteError(f"rank {owner} could not serve partition {part}: not here")
        try:
            data = peer.parts.fetch(part, offset, length)
        except (OSError, FanStoreError) as exc:
            raise RemoteError(f"rank {owner} could not serve partition {part}: "
                              f"io error ({exc})") from None
        peer.served_requests += 1
        peer.served_bytes += length
        return data

    def fetch_many(self, owner: int, ranges, timeout: float):
        out = []
        for part, offset, length in ranges:
            try:
                out.append(self.fetch(owner, part, offset, length, timeout))
            except (RemoteTimeout, Interrupted):
                raise
            except RemoteError as exc:
                out.append(exc)
        return out

    def ping(self, owner: int, timeout: float) -> bool:
        try:
            self._peer(owner, timeout)
        except RemoteTimeout:
            return False
        return True

    def send_control(self, kind: int, ranks, reason: str = "", timeout: float = 2.0) -> None:
        msg = P.ControlMsg(kind, self.rank, reason)
        for r in ranks:
            peer = self.hub.ranks.get(r)
            if r != self.rank and peer is not None and r not in self.hub.down:
                peer.on_control(msg)
