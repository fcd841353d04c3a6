"""How many copies of a store fit in the node-local budget (``--replicas auto``).

With k copies, placement (:mod:`fanstore.daemon.placement`) puts partition p on the nodes
(p + j) mod n for j < k, and a broadcast partition on every node. So node r holds

    bytes(r, k) = B + sum over j < k of T[(r - j) mod n]

where B is the total of the broadcast partitions and T[c] the total of the other partitions
p with p mod n == c. bytes(r, k) only grows with k, and the copies that fit in a capacity C
per node are the largest k (at most n) with bytes(r, k) <= C on *every* node: the fullest
node decides, not the average. (8 partitions of 10, 10, 10, 10, 10, 10, 10, 50 on 4 nodes:
the average with one copy is 30, but node 3 holds 60.) At k = n every node holds every
partition, and no read leaves the node.

The functions here are pure (no MPI, no disk) except :func:`local_room` (free space of a
local directory) and :func:`decide`, which a mount calls once: every rank works out how
many copies fit on its own node and the job takes the smallest answer (one all-reduce).
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass
from itertools import islice
from typing import TYPE_CHECKING, Protocol

import numpy as np

from fanstore.errors import StageError
from fanstore.units import show_size

if TYPE_CHECKING:
    from fanstore.format.index import Index


class Agreement(Protocol):
    """What the decision needs of the job (a :class:`fanstore.daemon.world.World`, or a
    stand-in in tests): the smallest of every rank's value, the same on every rank."""

    def all_min(self, value: int) -> int: ...

log = logging.getLogger(__name__)

#: ``--replicas auto`` without ``--local-capacity`` leaves this much of the local file
#: system free: 5% of its size, at most 1 GiB (room for staging's .ok records and for
#: whatever else the job writes there).
RESERVE_FRACTION = 0.05
RESERVE_MAX = 1 << 30

ADVICE = ("use more nodes, a bigger --local-dir (or --local-capacity), or a stronger codec "
          "(fanstore select)")


def _totals(sizes: Sequence[int], broadcast: Sequence[bool], nodes: int,
            skip: Collection[int] = ()) -> tuple[int, list[int]]:
    """(B, T): the broadcast partitions' total and the others' totals by p mod n."""
    if nodes < 1:
        raise ValueError("need at least one node")
    if len(sizes) != len(broadcast):
        raise ValueError("one broadcast flag per partition")
    shared = 0
    totals = [0] * nodes
    for p, (size, bc) in enumerate(zip(sizes, broadcast)):
        if p in skip:
            continue
        if bc:
            shared += int(size)
        else:
            totals[p % nodes] += int(size)
    return shared, totals


def node_bytes(sizes: Sequence[int], broadcast: Sequence[bool], nodes: int, node: int,
               skip: Collection[int] = ()) -> list[int]:
    """What node ``node`` of ``nodes`` holds with k = 1..n copies (item k-1), leaving out
    the partitions in ``skip`` (copies it already has, which cost no new space)."""
    shared, totals = _totals(sizes, broadcast, nodes, skip)
    out, held = [], shared
    for j in range(nodes):
        held += totals[(node - j) % nodes]
        out.append(held)
    return out


def _fullest(shared: int, totals: list[int]) -> Iterator[int]:
    """What the fullest node holds with k = 1, 2, ..., n copies."""
    t = np.array(totals, dtype=np.int64)  # index sizes are < 2**62: sums fit (format/index)
    held = np.zeros(len(totals), dtype=np.int64)
    for j in range(len(totals)):
        held += np.roll(t, j)  # roll(t, j)[r] == t[(r - j) % n]
        yield shared + int(held.max())


def fullest_bytes(sizes: Sequence[int], broadcast: Sequence[bool], nodes: int,
                  upto: int | None = None) -> list[int]:
    """What the fullest of ``nodes`` nodes holds with k = 1..upto copies (item k-1;
    ``upto`` defaults to n)."""
    return list(islice(_fullest(*_totals(sizes, broadcast, nodes)), upto or nodes))


def copies_that_fit(needs: Sequence[int], capacity: int) -> int:
    """The largest k with ``needs[k-1] <= capacity`` (``needs`` grows with k); 0: none."""
    k = 0
    for need in needs:
        if need > capacity:
            break
        k += 1
    return k


@dataclass(frozen=True)
class Fit:
    """How many copies of a store fit in ``capacity`` bytes per node on ``nodes`` nodes.

    ``replicas``: the largest k that fits (0: not even one copy); ``node_bytes``: what the
    fullest node then holds (with one copy when nothing fits); ``one_copy``: what the
    fullest node holds with one copy; ``next_bytes``: with one copy more than fits (None
    when every partition is on every node); ``broadcast``: the broadcast partitions' total.
    """

    nodes: int
    capacity: int
    replicas: int
    node_bytes: int
    one_copy: int
    next_bytes: int | None
    broadcast: int

    @property
    def everywhere(self) -> bool:
        """Every partition on every node: every read is local."""
        return self.replicas == self.nodes

    def to_json(self) -> dict:
        return {"nodes": self.nodes, "replicas": self.replicas, "node_bytes": self.node_bytes,
                "one_copy_node_bytes": self.one_copy, "next_copy_node_bytes": self.next_bytes,
                "every_partition_on_every_node": self.everywhere}


def fit(sizes: Sequence[int], broadcast: Sequence[bool], nodes: int, capacity: int) -> Fit:
    """The copies of a store (partition ``sizes``, ``broadcast`` flags) that fit in
    ``capacity`` bytes on each of ``nodes`` nodes; see the module docstring."""
    shared, totals = _totals(sizes, broadcast, nodes)
    one = shared + max(totals)
    whole = shared + sum(totals)
    if whole <= capacity:  # every partition on every node (no need to try every k)
        return Fit(nodes, capacity, nodes, whole, one, None, shared)
    k, held = 0, one
    for need in _fullest(shared, totals):  # stops at the first k that does not fit
        if need > capacity:
            return Fit(nodes, capacity, k, held, one, need, shared)
        k, held = k + 1, need
    raise AssertionError("unreachable: the whole store did not fit")


def nodes_needed(sizes: Sequence[int], broadcast: Sequence[bool], capacity: int,
                 start: int = 1) -> int | None:
    """The fewest nodes (at least ``start``) on which one copy fits in ``capacity`` per
    node; None when no node count does (the largest partition plus the broadcast ones is
    already too big: more nodes than partitions change nothing)."""
    flags = np.asarray(broadcast, dtype=bool)
    size = np.asarray(sizes, dtype=np.int64)
    shared = int(size[flags].sum())
    number = np.flatnonzero(~flags)
    size = size[~flags]
    for n in range(max(1, start), max(start, len(number)) + 1):
        totals = np.zeros(n, dtype=np.int64)
        np.add.at(totals, number % n, size)
        if shared + int(totals.max(initial=0)) <= capacity:
            return n
    return None


def explain_no_fit(sizes: Sequence[int], broadcast: Sequence[bool], nodes: int, need: int,
                   capacity: int, where: str, node: int | None = None) -> str:
    """Why not even one copy fits: what is needed against what is available, and what to
    do. ``need``: what the fullest node needs with one copy, or node ``node`` if given;
    ``where``: how ``capacity`` was found (e.g. ``"free in /local"``)."""
    shared = sum(int(s) for s, bc in zip(sizes, broadcast) if bc)
    on = (f"on the fullest of {nodes} node{'s' if nodes != 1 else ''}" if node is None
          else "on this node" + (f" (one of {nodes})" if nodes > 1 else ""))
    needed, there = show_size(need), show_size(capacity)
    if needed == there:  # too close for rounded figures
        needed, there = f"{need:,} bytes", f"{capacity:,} bytes"
    text = f"the store does not fit: one copy needs {needed} {on}"
    if shared:
        text += f" ({show_size(shared)} of it broadcast to every node)"
    text += f", {there} {where}; "
    if shared > capacity:
        return text + ("the broadcast partitions alone do not fit: pack with fewer --broadcast "
                       "directories, or use a bigger --local-dir (or --local-capacity) or a "
                       "stronger codec (fanstore select)")
    more = nodes_needed(sizes, broadcast, capacity, nodes + 1)
    if more is not None:
        text += f"one copy fits on {more} nodes; "
    else:
        text += "no node count fits (a single partition is too big: pack more partitions); "
    return text + ADVICE


# --------------------------------------------------------------------------- a mount


def local_room(local_dir: str, who: str = "node") -> tuple[int, int]:
    """(free bytes, bytes to keep free) of the file system ``local_dir`` is (or will be)
    on; a directory not made yet is measured at its nearest existing parent."""
    path = os.path.abspath(local_dir)
    while True:
        try:
            usage = shutil.disk_usage(path)
            break
        except FileNotFoundError:
            parent = os.path.dirname(path)
            if parent == path:
                raise
            path = parent
        except OSError as exc:
            raise StageError(f"{who}: cannot measure the free space of {local_dir}: "
                             f"{exc.strerror}") from None
    return usage.free, min(RESERVE_MAX, int(usage.total * RESERVE_FRACTION))


def decide(requested: int | str, index: Index, world: Agreement, node: int, nodes: int,
           local_dir: str | None = None, capacity: int | None = None,
           who: str = "node") -> int:
    """The number of copies a job keeps: ``requested`` (capped at ``nodes``) or, for
    ``"auto"``, as many as fit on every node (see the module docstring).

    Collective for ``"auto"`` with a local directory (every rank must call it): each rank
    counts what fits on its node, in ``capacity`` bytes (``--local-capacity``) or else in
    the free space of ``local_dir`` (less a reserve, see RESERVE_FRACTION) plus what valid
    copies already there save, and ``world.all_min`` makes the job agree on the smallest
    answer. Raises StageError when not even one copy fits (on every rank, with the numbers
    on the ranks that lack the room).
    """
    if requested != "auto":
        k = int(requested)
        if k > nodes:
            log.warning("--replicas %d is more than the %d ranks; using %d", k, nodes, nodes)
            k = nodes
        return k
    if not local_dir:
        log.info("%s: replicas auto: 1 copy (no --local-dir: nothing is staged, partitions "
                 "are read in place from the store)", who)
        return 1
    error: Exception | None = None
    here = -1
    try:
        sizes = [p.size for p in index.partitions]
        flags = [p.broadcast for p in index.partitions]
        if capacity is not None:
            reused: dict[int, int] = {}
            room, where = capacity, "available (--local-capacity)"
        else:
            from fanstore.daemon.stagecheck import staged_copies

            free, keep = local_room(local_dir, who)
            reused = staged_copies(local_dir, index)
            room = max(0, free - keep)
            where = f"free in {local_dir}" + (f" (keeping {show_size(keep)})" if keep else "")
        needs = node_bytes(sizes, flags, nodes, node, skip=reused)
        here = copies_that_fit(needs, room)
    except Exception as exc:  # noqa: BLE001 - raised after the collective, which no rank skips
        error = exc
    k = world.all_min(here)  # every rank gets here, even after an error of its own
    if error is not None:
        raise error
    if k < 0:
        raise StageError(f"{who}: another rank could not size its local storage (see its "
                         "message)")
    if k == 0:
        if here == 0:
            raise StageError(f"{who}: replicas auto: " + explain_no_fit(
                sizes, flags, nodes, needs[0], room, where, node))
        raise StageError(f"{who}: replicas auto: another rank has no room for one copy of "
                         "its share (see its message)")
    total = node_bytes(sizes, flags, nodes, node)[k - 1]
    if k == nodes:
        why = "every partition on every node"
    elif here > k:
        why = "another rank has room for no more"
    else:
        why = f"{k + 1} would need {show_size(needs[k])} here"
    saved = total - needs[k - 1]
    saved_text = f", {show_size(saved)} of it already staged" if saved else ""
    log.info("%s: replicas auto: %d cop%s (%s): %s here%s, %s %s", who, k,
             "y" if k == 1 else "ies", why, show_size(total), saved_text, show_size(room), where)
    return k
