"""Which ranks of the job form a node: one shape under every launcher, no spawned ranks.

Every process of a FanStore job is a rank the launcher started (``srun``, MPICH's
``mpiexec``, a site's ``mpirun``); the ranks of one node share its mount, its node-local
partitions and its remote service. They are grouped

- by node (``--ranks-per-node auto``, the default): the ranks with the same node name (the
  Slurm node name under ``srun``, a test cluster may run several ``slurmd`` on one machine;
  else the host name). ``MPI_Comm_split`` on a hash of the name, then the few ranks of one
  colour compare the names themselves. (``MPI_Comm_split_type(COMM_TYPE_SHARED)`` was the
  first choice; under this machine's local Slurm, PMI2 gave MPICH no locality and every
  rank came out a node of its own.)
- or in blocks of K consecutive ranks (``--ranks-per-node K``): how one machine simulates
  many nodes, and a site whose launcher places ranks in blocks.

A node's leader is its lowest rank. What a rank receives to learn the layout does not grow
with the number of ranks when the layout is regular (every node K consecutive ranks, as
``srun`` and ``mpiexec -ppn K`` place them): one small all-reduce says so and every rank
computes ``node_of``. Otherwise every rank sends its node index (4 bytes) to all.
"""

from __future__ import annotations

import zlib

import numpy as np

from fanstore.daemon.jobenv import node_name
from fanstore.errors import UsageError


def regular_node_of(ranks: int, per_node: int) -> list[int]:
    """``node_of`` when every node is ``per_node`` consecutive ranks."""
    if per_node < 1 or ranks % per_node:
        raise UsageError(f"--ranks-per-node {per_node} does not divide the {ranks} ranks "
                         "of this job")
    return [r // per_node for r in range(ranks)]


def split_nodes(comm, MPI, ranks_per_node: str | int, wait, received: list[int]
                ) -> tuple[object, object, list[int]]:
    """Group the ranks of ``comm`` into nodes. Returns (node_comm: this node's ranks, its
    leader first; leaders_comm: one rank per node, or COMM_NULL on the others; node_of:
    rank -> node index). ``wait(request, what)`` completes a nonblocking call (with the
    start-up deadline); ``received`` [messages, bytes] counts what this rank received
    (the communicator splits themselves apart)."""
    rank, size = comm.Get_rank(), comm.Get_size()
    if isinstance(ranks_per_node, int):
        node_of = regular_node_of(size, ranks_per_node)
        node_comm = comm.Split(node_of[rank], rank)
    else:
        # by the node's name, hashed to a split colour; the few ranks of one colour then
        # compare the names themselves (two names with one hash become two nodes)
        name = node_name()
        same = comm.Split(zlib.crc32(name.encode()) & 0x7FFFFFFF, rank)
        node_comm = _split_by_name(same, MPI, name, wait)
        received[0] += 1
        received[1] += 256 * same.Get_size()
        same.Free()
        node_of = None
    local = node_comm.Get_rank()
    leaders = comm.Split(0 if local == 0 else MPI.UNDEFINED, rank)
    if node_of is None:
        node_of = _node_of(comm, node_comm, leaders, MPI, wait, received)
    return node_comm, leaders, node_of


def _split_by_name(shared, MPI, name: str, wait):
    """Split the ranks of one hash colour by node name (only they exchange names: a node's
    ranks, and another node's only when two names share a hash)."""
    width = 256
    raw = name.encode()[:width].ljust(width, b"\0")
    out = np.zeros(shared.Get_size() * width, dtype=np.uint8)
    wait(shared.Iallgather(np.frombuffer(raw, dtype=np.uint8).copy(), out),
         "the node-name exchange on this machine")
    names = sorted({bytes(out[i * width:(i + 1) * width]) for i in range(shared.Get_size())})
    return shared.Split(names.index(raw), shared.Get_rank())


def _node_of(comm, node_comm, leaders, MPI, wait, received: list[int]) -> list[int]:
    """rank -> node index, for a layout found by name: computed when it is regular,
    else exchanged (4 bytes per rank)."""
    rank, size = comm.Get_rank(), comm.Get_size()
    here = np.zeros(1, dtype=np.int64)
    if leaders != MPI.COMM_NULL:
        here[0] = leaders.Get_rank()
    wait(node_comm.Ibcast(here, root=0), "the node index from this node's leader")
    node, k = int(here[0]), node_comm.Get_size()
    irregular = rank != node * k + node_comm.Get_rank()
    mine = np.array([-k, k, 1 if irregular else 0], dtype=np.int64)
    agreed = np.zeros(3, dtype=np.int64)
    wait(comm.Iallreduce(mine, agreed, op=MPI.MAX), "the layout check")
    received[0] += 2
    received[1] += here.nbytes + agreed.nbytes
    if -agreed[0] == agreed[1] and not agreed[2]:
        return regular_node_of(size, k)
    out = np.zeros(size, dtype=np.int32)
    wait(comm.Iallgather(np.array([node], dtype=np.int32), out), "the layout exchange")
    received[0] += 1
    received[1] += out.nbytes
    return [int(x) for x in out]


__all__ = ["regular_node_of", "split_nodes"]
