"""Reads of partitions held by other nodes: a rank of the nearest live owner node first,
failing over to the node's other ranks, then to replica nodes.

:class:`PeerSource` is a :class:`~fanstore.read.sources.RemoteSource`: the placement table
says which *nodes* hold a partition (:mod:`fanstore.daemon.placement`), the job layout says
which *ranks* serve each node (its leader and its worker ranks, every one of which answers
for the node's partitions), the transport carries the request
(:mod:`fanstore.daemon.transport`). Readers spread over a node's ranks: a reader starts at
the rank whose position matches its own (so K readers of one node ask K different ranks of
the other), so no single process of a holder node is on every remote read. A rank that
does not answer is marked dead and the next rank, then the next owner node, is tried; a
node's ranks share one remote timeout (a dead node costs one timeout, not one per rank);
dead ranks are probed and revived by the node daemon.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

from fanstore.daemon import placement as pl
from fanstore.daemon.transport import Interrupted, RemoteTimeout
from fanstore.errors import NodeStoppingError, RemoteError

log = logging.getLogger(__name__)


class PeerSource:
    """Stored bytes of other nodes' partitions, over a Transport.

    ``table[p]``: the nodes holding partition p; ``node``: this process's node; ``nodes``:
    how many; ``ranks_of(node)``: the ranks serving a node (default: rank == node, one
    rank per node); ``me``: this process's rank (picks where a reader starts).
    """

    def __init__(self, transport, table: list[list[int]], node: int, nodes: int,
                 timeout: float, stats, show=str,
                 ranks_of: Callable[[int], list[int]] | None = None,
                 me: int | None = None) -> None:
        self.transport = transport
        self.table = table
        self.node = node
        self.nodes = nodes
        self.timeout = timeout
        self.stats = stats
        self.show = show  # entry -> path for messages
        self.ranks_of = ranks_of or (lambda n: [n])
        self.me = node if me is None else me
        self.dead: set[int] = set()  # ranks
        self.done: set[int] = set()  # nodes whose daemon has unmounted and said so
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ RemoteSource
    def serves(self, part: int) -> bool:
        """Another node with a live rank holds ``part``."""
        return any(n != self.node and not self.node_dead(n) for n in self.table[part])

    def fetch(self, part: int, offset: int, length: int, entry: int | None = None):
        owners = [n for n in pl.preference(self.table[part], self.node, self.nodes)
                  if n != self.node]
        what = self.show(entry) if entry is not None else f"partition {part}"
        tried = []
        for owner in owners:
            # A node gets the remote timeout in all, shared by its live ranks: a dead or
            # hung node costs one timeout, however many ranks serve it.
            live = [r for r in self._order(owner) if r not in self.dead]
            deadline = time.monotonic() + self.timeout
            for i, rank in enumerate(live):
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                if tried:
                    self.stats.remote_failovers += 1
                tried.append(rank)
                try:
                    return self.transport.fetch(rank, part, offset, length,
                                                left / (len(live) - i))
                except Interrupted as exc:  # this node stops: no failover, nobody to blame
                    raise NodeStoppingError(f"{what}: {exc}") from None
                except RemoteTimeout as exc:
                    self.mark_dead(rank, str(exc))
                except RemoteError as exc:
                    log.error("%s: %s", what, exc)
        where = ", ".join(map(str, owners))
        why = "did not answer" if tried else "are unreachable"
        raise RemoteError(f"{what}: the nodes holding partition {part} ({where}) {why}")

    def fetch_many(self, items: list[tuple[int, int, int, int | None]]) -> list:
        """Several ranges ``(part, offset, length, entry)`` at once, batched per holder:
        the ranges whose first choice is the same rank go to it in one exchange
        (``transport.fetch_many``). Returns, per item, its bytes or the FanStoreError it
        got; whatever a batch could not give (a dead rank, an error reply) is fetched on
        its own, with the usual failover."""
        out: list = [None] * len(items)
        batches: dict[int, list[int]] = {}
        for i, (part, _off, _n, _entry) in enumerate(items):
            owners = [n for n in pl.preference(self.table[part], self.node, self.nodes)
                      if n != self.node and not self.node_dead(n)]
            live = [r for r in self._order(owners[0]) if r not in self.dead] if owners else []
            if live and hasattr(self.transport, "fetch_many"):
                batches.setdefault(live[0], []).append(i)
        for rank, idx in batches.items():
            try:
                got = self.transport.fetch_many(
                    rank, [items[i][:3] for i in idx], self.timeout)
            except Interrupted as exc:
                for i in idx:
                    out[i] = exc
                continue
            except RemoteTimeout as exc:
                self.mark_dead(rank, str(exc))
                continue
            for i, data in zip(idx, got):
                if not isinstance(data, Exception):
                    out[i] = data
        for i, item in enumerate(items):
            if out[i] is None:
                try:
                    out[i] = self.fetch(*item)
                except RemoteError as exc:
                    out[i] = exc
        return out

    def _order(self, node: int) -> list[int]:
        ranks = self.ranks_of(node)
        k = self.me % len(ranks)
        return ranks[k:] + ranks[:k]

    # ------------------------------------------------------------------ liveness
    def node_dead(self, node: int) -> bool:
        return all(r in self.dead for r in self.ranks_of(node))

    def dead_nodes(self) -> list[int]:
        return [n for n in range(self.nodes) if n != self.node and self.node_dead(n)]

    def mark_dead(self, rank: int, why: str) -> None:
        with self._lock:
            if rank in self.dead:
                return
            self.dead.add(rank)
        self.stats.peers_marked_dead += 1
        log.error("rank %d is unreachable (%s); its node's other ranks or replicas serve its "
                  "partitions if any", rank, why)

    def probe(self, ping, timeout: float) -> None:
        """Ping the ranks marked dead; revive those that answer (``ping(rank, timeout)``)."""
        for rank in sorted(self.dead):
            if ping(rank, timeout):
                self.revive(rank)

    def revive(self, rank: int) -> None:
        with self._lock:
            if rank in self.dead:
                self.dead.discard(rank)
                log.warning("rank %d answers again", rank)
