"""Which ranks hold which partitions: a pure function of the partition table and the job.

    owners(p) = every rank                              if p is a broadcast partition
              = [(p + j) mod n  for j in 0..k-1]        otherwise (k = min(replicas, n))

Partition p's primary owner is rank p mod n and its replicas are the next ranks round the
ring, so a node's partitions are spread evenly and each node holds about
``k * stored_bytes / n`` bytes plus the broadcast partitions. A reader picks the nearest
live owner: the first owner at or after itself going round the ring (itself if it owns
the partition), so readers on different nodes spread their load over the replicas.
"""

from __future__ import annotations


def owners(part: int, n_ranks: int, replicas: int = 1, broadcast: bool = False) -> list[int]:
    if n_ranks < 1:
        raise ValueError("need at least one rank")
    if broadcast:
        return list(range(n_ranks))
    k = max(1, min(replicas, n_ranks))
    return [(part + j) % n_ranks for j in range(k)]


def placement(broadcast_flags: list[bool], n_ranks: int, replicas: int = 1) -> list[list[int]]:
    """Owners of every partition (index = partition number)."""
    return [owners(p, n_ranks, replicas, bc) for p, bc in enumerate(broadcast_flags)]


def local_partitions(table: list[list[int]], rank: int) -> list[int]:
    return [p for p, who in enumerate(table) if rank in who]


def preference(owner_list: list[int], rank: int, n_ranks: int) -> list[int]:
    """Owners in the order a reader on ``rank`` tries them: nearest round the ring first."""
    return sorted(owner_list, key=lambda r: (r - rank) % n_ranks)
