"""Reads of partitions held by other ranks: the nearest live owner first, failing over.

:class:`PeerSource` is the node daemon's :class:`~fanstore.read.sources.RemoteSource`: the
placement table says who holds a partition (:mod:`fanstore.daemon.placement`), the
transport carries the request (:mod:`fanstore.daemon.transport`). A peer that does not
answer within the remote timeout is marked dead and the next owner is tried; dead peers
are probed and revived by the node.
"""

from __future__ import annotations

import logging
import threading

from fanstore.daemon import placement as pl
from fanstore.daemon.transport import RemoteTimeout
from fanstore.errors import RemoteError

log = logging.getLogger(__name__)


class PeerSource:
    """Stored bytes of other ranks' partitions, over a Transport."""

    def __init__(self, transport, table: list[list[int]], rank: int, size: int,
                 timeout: float, stats, show=str) -> None:
        self.transport = transport
        self.table = table
        self.rank = rank
        self.size = size
        self.timeout = timeout
        self.stats = stats
        self.show = show  # entry -> path for messages
        self.dead: set[int] = set()
        self.done: set[int] = set()
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ RemoteSource
    def serves(self, part: int) -> bool:
        """Another live rank holds ``part``."""
        return any(r != self.rank and r not in self.dead for r in self.table[part])

    def fetch(self, part: int, offset: int, length: int, entry: int | None = None):
        owners = [r for r in pl.preference(self.table[part], self.rank, self.size)
                  if r != self.rank]
        what = self.show(entry) if entry is not None else f"partition {part}"
        tried = []
        for owner in owners:
            if owner in self.dead:
                continue
            if tried:
                self.stats.remote_failovers += 1
            tried.append(owner)
            try:
                return self.transport.fetch(owner, part, offset, length, self.timeout)
            except RemoteTimeout as exc:
                self.mark_dead(owner, str(exc))
            except RemoteError as exc:
                log.error("%s: %s", what, exc)
        where = ", ".join(map(str, owners))
        why = "did not answer" if tried else "are unreachable"
        raise RemoteError(f"{what}: the ranks holding partition {part} ({where}) {why}")

    # ------------------------------------------------------------------ liveness
    def mark_dead(self, rank: int, why: str) -> None:
        with self._lock:
            if rank in self.dead:
                return
            self.dead.add(rank)
        log.error("rank %d is unreachable (%s); its partitions are served by replicas if any",
                  rank, why)

    def revive(self, rank: int) -> None:
        with self._lock:
            if rank in self.dead:
                self.dead.discard(rank)
                log.warning("rank %d answers again", rank)
