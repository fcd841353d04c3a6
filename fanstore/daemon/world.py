"""This process's place in the job: which node it serves, and the communicators it uses.

``World.solo()`` is a single node without MPI. Under an MPI launcher the ranks are grouped
into *nodes* (:func:`group_nodes`): the ranks of one node share its mount, its node-local
partitions and its remote service. Each node has a *leader* (its lowest rank: the node
daemon, :mod:`fanstore.daemon.node`) and *worker ranks* that answer other nodes' reads of
this node's partitions directly over MPI and, with the kernel frontend, serve the mount's
FUSE requests (:mod:`fanstore.workerrank`): no single process of a node is on the remote
path. Worker ranks are either launched with the leader (``srun
--ntasks-per-node=K``, or ``mpiexec -n N*K ... --ranks-per-node K``) or, when each node
was launched with one rank under MPICH's hydra (``mpiexec -n N``), spawned by the leaders
at start (``MPI_Comm_spawn_multiple``, placed on the leader's host).

Three communicators, all ``Dup``/``Split`` of the job's world, so nothing the user's code
does on COMM_WORLD can match FanStore's messages:

- ``World.comm``: the leaders (one rank per node): index broadcast and start-up gates.
- ``Job.comm``: every rank: the data plane (requests and replies) and control messages.
- ``Job.node_comm``: the ranks of this node: the leader hands its workers what to serve
  and, at the end, when to exit.

Collectives here never spin: every wait is a ``Test`` with back-off (MPICH's blocking calls
busy-poll a core).
"""

from __future__ import annotations

import os
import socket
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fanstore.daemon.jobenv import choose_netmod, group_nodes, node_key, slurm_tasks, under_hydra
from fanstore.daemon.pacing import Backoff, wait_request
from fanstore.errors import MountError


@dataclass
class Job:
    """Every rank of the job and the node each serves (see the module docstring).

    Attributes: ``comm`` (all ranks), ``rank`` (this process in it), ``node_of`` (rank ->
    node index), ``leaders`` (node index -> its leader's rank), ``node_comm`` (this node's
    ranks, the leader first), ``spawned`` (worker ranks were spawned by the leaders).
    """

    comm: Any
    rank: int
    node_of: list[int]
    leaders: list[int]
    node_comm: Any
    spawned: bool = False
    _ranks: dict[int, list[int]] = field(default_factory=dict)

    @property
    def size(self) -> int:
        return len(self.node_of)

    @property
    def node(self) -> int:
        return self.node_of[self.rank]

    @property
    def nodes(self) -> int:
        return len(self.leaders)

    @property
    def is_leader(self) -> bool:
        return self.leaders[self.node] == self.rank

    def ranks_of(self, node: int) -> list[int]:
        """The ranks serving ``node`` (its leader first)."""
        ranks = self._ranks.get(node)
        if ranks is None:
            ranks = sorted((r for r, n in enumerate(self.node_of) if n == node),
                           key=lambda r: (r != self.leaders[node], r))
            self._ranks[node] = ranks
        return ranks

    def workers_of(self, node: int) -> list[int]:
        return self.ranks_of(node)[1:]

    def servers_of(self, node: int) -> list[int]:
        """The ranks other nodes read ``node``'s partitions from: its worker ranks when it
        has any (the daemon stays free for its control socket, probes and stats), else
        its daemon."""
        return self.workers_of(node) or self.ranks_of(node)


class World:
    """The node-level world a node daemon sees: ``rank`` is this node's index, ``size`` the
    number of nodes, ``comm`` the leaders' communicator, and collective helpers over it
    that never spin. ``job`` is the rank-level layout (None for a world of one)."""

    def __init__(self, rank: int = 0, size: int = 1, comm=None, mpi=None,
                 job: Job | None = None) -> None:
        self.rank = rank
        self.size = size
        self.comm = comm
        self.MPI = mpi
        self.job = job

    @classmethod
    def solo(cls) -> World:
        return cls()

    @classmethod
    def from_mpi(cls, ranks_per_node: str | int = "auto", spawn_workers: int = 0,
                 spawn_command: list[str] | None = None) -> World:
        """Initialise MPI, group the launched ranks into nodes and, when every node was
        launched with one rank under hydra and ``spawn_workers`` > 0, spawn that many
        worker ranks per node running ``spawn_command`` (argv after the interpreter)."""
        MPI = _init_mpi()
        world = MPI.COMM_WORLD
        expected = slurm_tasks()
        if expected is not None and world.Get_size() != expected:
            raise MountError(
                f"MPI world size is {world.Get_size()} but Slurm started {expected} tasks: "
                "launch with 'srun --mpi=pmi2' (without an MPI plugin every task is its own "
                "1-rank world and would silently serve only its own partitions)")
        launched = world.Dup()
        rank, n = launched.Get_rank(), launched.Get_size()
        key = node_key(ranks_per_node) or f"rank{rank}"
        keys = _allgather_str(launched, key, MPI)
        fixed = ranks_per_node if isinstance(ranks_per_node, int) else None
        node_of = group_nodes(keys, fixed)
        nodes = max(node_of) + 1
        one_each = nodes == n
        spawned = bool(spawn_workers and one_each and n > 1 and under_hydra())
        link = None
        if spawned:
            comm, link = _spawn(launched, spawn_workers, spawn_command or [], MPI)
            launched.Free()
            node_of = node_of + [node for node in range(nodes) for _ in range(spawn_workers)]
        else:
            comm = launched
        return cls._from_layout(comm, MPI, node_of, spawned, link)

    @classmethod
    def for_spawned_worker(cls) -> World:
        """A worker rank started by :meth:`from_mpi`'s spawn: join the parents' job."""
        MPI = _init_mpi()
        parent = MPI.Comm.Get_parent()
        if parent == MPI.COMM_NULL:
            raise MountError("this worker rank was not spawned by a FanStore node")
        merged = parent.Merge(high=True)
        comm = merged.Dup()
        merged.Free()
        node_of = _allgather_int(comm, -1, MPI)  # the parents say; children send -1
        return cls._from_layout(comm, MPI, _fill_spawned(node_of), True, parent)

    @classmethod
    def _from_layout(cls, comm, MPI, node_of: list[int], spawned: bool,
                     link=None) -> World:
        rank = comm.Get_rank()
        leaders: list[int] = []
        for r, node in enumerate(node_of):
            if node == len(leaders):
                leaders.append(r)
        node = node_of[rank]
        is_leader = leaders[node] == rank
        leaders_comm = comm.Split(0 if is_leader else MPI.UNDEFINED, rank)
        node_comm = comm.Split(node, 0 if is_leader else 1 + rank)
        job = Job(comm, rank, node_of, leaders, node_comm, spawned)
        if is_leader:
            world = cls(leaders_comm.Get_rank(), leaders_comm.Get_size(), leaders_comm, MPI,
                        job)
        else:
            world = cls(node, len(leaders), None, MPI, job)
        world._link = link  # the spawn's intercommunicator (parents and children)
        return world

    @property
    def is_mpi(self) -> bool:
        return self.comm is not None

    def _wait(self, req) -> None:
        wait_request(req, None, Backoff(50e-6, 5e-3))

    def all_ok(self, ok: bool) -> bool:
        """Collective: True if every rank passed ``ok=True``."""
        if not self.is_mpi:
            return ok
        mine = np.array([1 if ok else 0], dtype=np.int32)
        out = np.zeros(1, dtype=np.int32)
        self._wait(self.comm.Iallreduce(mine, out, op=self.MPI.MIN))
        return bool(out[0])

    def all_min(self, value: int) -> int:
        """Collective: the smallest ``value`` any rank passed (an int64 all-reduce)."""
        if not self.is_mpi:
            return value
        mine = np.array([value], dtype=np.int64)
        out = np.zeros(1, dtype=np.int64)
        self._wait(self.comm.Iallreduce(mine, out, op=self.MPI.MIN))
        return int(out[0])

    def bcast_bytes(self, data: bytes | None) -> bytes | bytearray:
        """Broadcast bytes from rank 0 (in pieces, so sizes above 2 GiB work)."""
        if not self.is_mpi:
            assert data is not None
            return data
        n = np.array([len(data) if data is not None else 0], dtype=np.int64)
        self._wait(self.comm.Ibcast(n, root=0))
        size = int(n[0])
        buf = bytearray(data) if self.rank == 0 and data is not None else bytearray(size)
        view = memoryview(buf)
        for start in range(0, size, _PIECE):
            self._wait(self.comm.Ibcast([view[start : start + _PIECE], self.MPI.BYTE], root=0))
        return buf  # no second copy: the index is parsed straight from this buffer


    _link = None

    def release(self) -> None:
        """Before MPI_Finalize: free every communicator and disconnect the spawn link.
        MPICH's hydra ends the whole job (SIGKILL) when a process finalizes and exits while
        it still holds communicators shared with processes that run on (measured with
        MPICH 5.0.2: ranks exiting a second apart were killed unless they freed their
        duplicates first, and spawned ranks unless both sides disconnected)."""
        comms = [self.comm]
        if self.job is not None:
            comms += [self.job.node_comm, self.job.comm]
        for c in comms:
            if c is not None:
                try:
                    c.Free()
                except Exception:  # noqa: BLE001, S110 - freeing is a courtesy
                    pass
        self.comm = None
        if self._link is not None:
            try:
                self._link.Disconnect()  # collective with the other side of the spawn
            except Exception:  # noqa: BLE001, S110 - a courtesy too
                pass
            self._link = None

    def end_job(self, timeout: float = 30.0) -> bool:
        """Every rank of the job meets here before MPI_Finalize, once it has stopped its
        transport (no receive from ANY_SOURCE left posted): a process that finalizes and
        exits while another still waits on such a receive makes that receive fail in
        MPICH, and spawned ranks share no MPI_COMM_WORLD barrier with their parents.
        False when not every rank came within ``timeout`` (some left without finalizing:
        the caller must not finalize either)."""
        if self.job is None or self.MPI is None or self.MPI.Is_finalized():
            return True
        return wait_request(self.job.comm.Ibarrier(), time.monotonic() + timeout,
                            Backoff(100e-6, 20e-3))

    def finish_job(self) -> bool:
        """The end of a rank that served: meet every rank (:meth:`end_job`), release the
        communicators, MPI_Finalize. False (and nothing finalized) when not every rank
        came: the caller exits without MPI_Finalize."""
        if self.MPI is None or self.MPI.Is_finalized():
            return True
        import logging
        lg = logging.getLogger("fanstore.world")
        lg.debug("end of job: barrier")
        if not self.end_job():
            return False
        lg.debug("end of job: release")
        self.release()
        lg.debug("end of job: finalize")
        self.MPI.Finalize()
        lg.debug("end of job: finalized")
        return True

    def finalize(self) -> None:
        """End MPI once every rank got here: a polled barrier first, so that no rank leaves
        while a peer's last message to it is still in flight (with MPICH's OFI netmod a send
        completes only once the receiver acknowledges it), then MPI_Finalize."""
        if not self.is_mpi or self.MPI.Is_finalized():
            return
        self._wait(self.comm.Ibarrier())
        self.release()
        self.MPI.Finalize()

    def gather_bytes(self, data: bytes) -> list[bytes] | None:
        """Rank 0 receives every rank's bytes (in rank order); others get None."""
        if not self.is_mpi:
            return [data]
        MPI = self.MPI
        if self.rank != 0:
            n = np.array([len(data)], dtype=np.int64)
            self._wait(self.comm.Isend(n, dest=0, tag=_GATHER_TAG))
            view = memoryview(data)
            for start in range(0, len(data), _PIECE):
                self._wait(self.comm.Isend([view[start : start + _PIECE], MPI.BYTE], dest=0,
                                           tag=_GATHER_TAG))
            return None
        out = [data]
        for src in range(1, self.size):
            n = np.zeros(1, dtype=np.int64)
            self._wait(self.comm.Irecv(n, source=src, tag=_GATHER_TAG))
            buf = bytearray(int(n[0]))
            view = memoryview(buf)
            for start in range(0, len(buf), _PIECE):
                self._wait(self.comm.Irecv([view[start : start + _PIECE], MPI.BYTE], source=src,
                                           tag=_GATHER_TAG))
            out.append(bytes(buf))
        return out


_GATHER_TAG = 21
_PIECE = 1 << 30


def _init_mpi():
    try:
        import mpi4py
    except ImportError:
        raise MountError("running under an MPI launcher but mpi4py is not installed: pip "
                         "install 'fanstore[mpi]' (on clusters, build it against the site "
                         "MPI)") from None
    mpi4py.rc.initialize = False  # MPI_Init below, once the netmod is chosen
    mpi4py.rc.finalize = False  # we finalize ourselves, and only when every peer is alive
    from mpi4py import MPI

    if not MPI.Is_initialized():
        netmod = choose_netmod(MPI.Get_library_version(), os.environ)
        if netmod:
            os.environ["MPIR_CVAR_CH4_NETMOD"] = netmod
        provided = MPI.Init_thread(MPI.THREAD_MULTIPLE)
    else:
        provided = MPI.Query_thread()
    if provided < MPI.THREAD_MULTIPLE:
        names = {MPI.THREAD_SINGLE: "SINGLE", MPI.THREAD_FUNNELED: "FUNNELED",
                 MPI.THREAD_SERIALIZED: "SERIALIZED"}
        raise MountError(
            f"the MPI library provides only MPI_THREAD_{names.get(provided, provided)}; "
            "FanStore needs MPI_THREAD_MULTIPLE (its server thread and its readers call "
            "MPI at the same time): use an MPI built with thread support")
    return MPI


def _wait(req) -> None:
    wait_request(req, None, Backoff(50e-6, 5e-3))


def _allgather_int(comm, value: int, MPI) -> list[int]:
    mine = np.array([value], dtype=np.int64)
    out = np.zeros(comm.Get_size(), dtype=np.int64)
    _wait(comm.Iallgather(mine, out))
    return [int(v) for v in out]


def _allgather_str(comm, text: str, MPI, width: int = 256) -> list[str]:
    raw = text.encode()[:width].ljust(width, b"\0")
    mine = np.frombuffer(raw, dtype=np.uint8).copy()
    out = np.zeros(comm.Get_size() * width, dtype=np.uint8)
    _wait(comm.Iallgather(mine, out))
    return [bytes(out[i * width:(i + 1) * width]).rstrip(b"\0").decode()
            for i in range(comm.Get_size())]


def _spawn(launched, per_node: int, command: list[str], MPI):
    """Spawn ``per_node`` worker ranks for every launched rank (each a node), on the
    launched rank's host; returns the merged communicator (launched ranks first, then
    node 0's workers, node 1's, ...). Collective over ``launched``."""
    hosts = _allgather_str(launched, socket.gethostname(), MPI)
    n = launched.Get_size()
    infos = []
    for host in hosts:
        info = MPI.Info.Create()
        info.Set("host", host)
        infos.append(info)
    try:
        inter = launched.Spawn_multiple([sys.executable] * n, [command] * n, [per_node] * n,
                                        infos, root=0)
    except MPI.Exception as exc:
        raise MountError(f"could not start {per_node} worker ranks per node "
                         f"(MPI_Comm_spawn_multiple: {exc.Get_error_string()}); launch "
                         "with --ranks-per-node, or mount with --workers 0") from None
    finally:
        for info in infos:
            info.Free()
    merged = inter.Merge(high=False)
    comm = merged.Dup()
    merged.Free()
    node_of = list(range(n))  # the parents: one node each, in rank order
    _allgather_int(comm, node_of[comm.Get_rank()] if comm.Get_rank() < n else -1, MPI)
    return comm, inter


def _fill_spawned(node_of: list[int]) -> list[int]:
    """The node of every rank after a spawn: parents said theirs, children sent -1 and
    come in node order, ``per_node`` each."""
    parents = [x for x in node_of if x >= 0]
    children = len(node_of) - len(parents)
    per_node = children // max(1, len(parents))
    out = list(node_of)
    k = 0
    for i, x in enumerate(out):
        if x < 0:
            out[i] = k // per_node
            k += 1
    return out
