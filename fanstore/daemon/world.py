"""This process's place in the job: which node it serves, and the communicators it uses.

``World.solo()`` is a single node without MPI. Under an MPI launcher every process is a
rank the launcher started, grouped into *nodes* (:mod:`fanstore.daemon.layout`: by
node name, or ``--ranks-per-node K`` consecutive ranks): the ranks of one node share its
mount, its node-local partitions and its remote service. Each node has a *leader* (its
lowest rank: the node daemon, :mod:`fanstore.daemon.node`) and *worker ranks* that answer
other nodes' reads of this node's partitions directly over MPI and, with the kernel
frontend, serve the mount's FUSE requests (:mod:`fanstore.workerrank`). A node launched
with one rank serves its mount with worker processes of its own instead. Nothing is
spawned: the same shape under ``srun``, ``mpiexec -ppn K`` and a site's ``mpirun``.

Three communicators, all ``Dup``/``Split`` of the job's world, so nothing the user's code
does on COMM_WORLD can match FanStore's messages:

- ``World.comm``: the leaders (one rank per node): index broadcast and start-up gates.
- ``Job.comm``: every rank: the data plane (requests and replies) and control messages.
- ``Job.node_comm``: the ranks of this node: the leader hands its workers what to serve
  and, at the end, when to exit.

Collectives here never spin: every wait is a ``Test`` with back-off (MPICH's blocking calls
busy-poll a core). Every wait of the start-up has a deadline (``--start-timeout``) and
ends at once when the launcher is gone; the start-up gates (:meth:`World.gate`) are a
roll call at node 0, so a node that fails names its reason to every node and a node that
does not arrive is named.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fanstore.daemon import launcher
from fanstore.daemon.jobenv import choose_netmod, node_name, slurm_tasks
from fanstore.daemon.layout import split_nodes
from fanstore.daemon.mpirequests import AllOf
from fanstore.daemon.pacing import Backoff, wait_request
from fanstore.errors import MountError


@dataclass
class Job:
    """Every rank of the job and the node each serves (see the module docstring).

    Attributes: ``comm`` (all ranks), ``rank`` (this process in it), ``node_of`` (rank ->
    node index), ``leaders`` (node index -> its leader's rank), ``node_comm`` (this node's
    ranks, the leader first).
    """

    comm: Any
    rank: int
    node_of: list[int]
    leaders: list[int]
    node_comm: Any
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
    that never spin. ``job`` is the rank-level layout (None for a world of one).

    ``timeout``: seconds any one wait on the other nodes may take (None: no limit);
    ``alive()``: whether the launcher is still there (a wait ends at once when it is
    not); ``interrupted()``: a reason to give up now (a signal), or None."""

    def __init__(self, rank: int = 0, size: int = 1, comm=None, mpi=None,
                 job: Job | None = None, timeout: float | None = None,
                 alive: Callable[[], bool] = lambda: True) -> None:
        self.rank = rank
        self.size = size
        self.comm = comm
        self.MPI = mpi
        self.job = job
        self.timeout = timeout
        self.alive = alive
        self.interrupted: Callable[[], str | None] = lambda: None
        #: a gate ended without every node (one did not arrive): the job cannot meet again,
        #: so no rank waits for the others at the end (finish_job) and none finalizes
        self.incomplete = False
        #: bytes and messages this rank received in the start-up's collectives and gates
        #: (the index broadcast apart): what grows with the job's size (benchmarks)
        self.received = [0, 0]

    @classmethod
    def solo(cls) -> World:
        return cls()

    @classmethod
    def from_mpi(cls, ranks_per_node: str | int = "auto", timeout: float | None = None,
                 alive: Callable[[], bool] = lambda: True) -> World:
        """Initialise MPI and group the launched ranks into nodes
        (:func:`fanstore.daemon.layout.split_nodes`)."""
        MPI = _init_mpi(timeout)
        launcher.mpi_started()  # the waits below watch the launcher themselves
        world = MPI.COMM_WORLD
        expected = slurm_tasks()
        if expected is not None and world.Get_size() != expected:
            raise MountError(
                f"MPI world size is {world.Get_size()} but Slurm started {expected} tasks: "
                "launch with 'srun --mpi=pmi2' (without an MPI plugin every task is its own "
                "1-rank world and would silently serve only its own partitions)")
        probe = cls(timeout=timeout, alive=alive, mpi=MPI)
        # Dup and Split are blocking, and MPICH's blocking calls spin: a rank that never
        # reaches them (hung after MPI_Init) left the others spinning a core each until
        # their lifeline's grace ran out, 15 s after the launcher left. Every rank is known
        # to be here first, in a wait that watches the launcher and the deadline.
        probe.wait(world.Ibarrier(), "every rank's arrival after MPI_Init")
        comm = world.Dup()
        rank = comm.Get_rank()
        node_comm, leaders_comm, node_of = split_nodes(comm, MPI, ranks_per_node,
                                                       probe.wait, probe.received)
        leaders: list[int] = []
        for r, node in enumerate(node_of):
            if node == len(leaders):
                leaders.append(r)
        job = Job(comm, rank, node_of, leaders, node_comm)
        if leaders_comm != MPI.COMM_NULL:
            out = cls(leaders_comm.Get_rank(), leaders_comm.Get_size(), leaders_comm, MPI,
                      job, timeout, alive)
        else:
            out = cls(node_of[rank], len(leaders), None, MPI, job, timeout, alive)
        out.received = probe.received
        return out

    @property
    def is_mpi(self) -> bool:
        return self.comm is not None

    def wait(self, req, what: str, timeout: float | None = None,
             late: str | None = None) -> None:
        """Complete a nonblocking call, or raise MountError naming ``what`` when the
        deadline passes (``timeout``, else the world's; the message is ``late`` when
        given), the launcher is gone or the start-up is interrupted. Never spins (a
        growing sleep between tests)."""
        timeout = self.timeout if timeout is None else timeout
        deadline = None if timeout is None else time.monotonic() + timeout
        backoff = _start_backoff()
        checked = 0.0
        while not req.Test():
            now = time.monotonic()
            if deadline is not None and now > deadline:
                self.incomplete = True
                raise MountError(late or f"{what} did not complete within {timeout:g} s "
                                 "(--start-timeout)")
            if now - checked > 0.5:
                checked = now
                self._go_on(what)
            backoff.sleep()

    def _go_on(self, what: str) -> None:
        """Raise MountError when a start-up wait must end now: the launcher is gone, or
        the start-up is interrupted (a signal, a dead process of the job)."""
        reason = None if self.alive() else "the MPI launcher is gone"
        reason = reason or self.interrupted()
        if reason:
            self.incomplete = True
            raise MountError(f"{reason} (during {what})")

    def _wait(self, req) -> None:
        self.wait(req, "a collective of the nodes")

    def gate(self, what: str, error: str | None = None) -> str | None:
        """A start-up gate: every node says whether its step ``what`` went well (``error``
        None) and learns whether every node's did. Returns None when all did, else one
        line naming the nodes that failed (with their reasons) or did not arrive within
        the timeout. A roll call at node 0: it receives one message per node and sends
        each one verdict, so a node receives O(1) bytes here whatever the job's size, and
        a node that never arrives is named instead of leaving everyone waiting."""
        if not self.is_mpi:
            return None
        note = f"{node_name()}\0{error or ''}".encode("utf-8", "replace")[:_NOTE_MAX]
        # 2: failed, and a rank of this node is missing (no rank may wait for it at the end)
        mine = bytes([(2 if self.incomplete else 0) if error else 1]) + note
        if self.rank == 0:
            return self._gate_root(what, mine)
        self.wait(self.comm.Isend([mine, self.MPI.BYTE], dest=0, tag=_ROLL_TAG),
                  f"the {what} gate (sending to node 0)")
        buf = bytearray(_VERDICT_MAX)
        timeout = late = None
        if self.timeout is not None:
            timeout = self.timeout + _VERDICT_SLACK
            late = (f"the {what} gate: node 0 did not answer within {self.timeout:g} s "
                    "(--start-timeout)")
        self.wait(self.comm.Irecv([buf, self.MPI.BYTE], source=0, tag=_VERDICT_TAG),
                  f"the {what} gate", timeout=timeout, late=late)
        self.received[0] += 1
        raw = bytes(buf).rstrip(b"\0")
        self.received[1] += len(raw) + 1
        if raw[:1] == b"M":
            self.incomplete = True
        verdict = raw[1:].decode("utf-8", "replace")
        return verdict or None

    def _gate_root(self, what: str, mine: bytes) -> str | None:
        MPI = self.MPI
        bufs = {src: bytearray(_NOTE_MAX + 1) for src in range(1, self.size)}
        reqs = {src: self.comm.Irecv([buf, MPI.BYTE], source=src, tag=_ROLL_TAG)
                for src, buf in bufs.items()}
        notes = {0: mine}
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        backoff = _start_backoff()
        checked = 0.0
        while reqs:
            for src in [s for s, rq in reqs.items() if rq.Test()]:
                notes[src] = bytes(bufs[src])
                del reqs[src]
                self.received[0] += 1
                self.received[1] += len(notes[src].rstrip(b"\0"))
            now = time.monotonic()
            if not reqs or (deadline is not None and now > deadline):
                break
            if now - checked > 0.5:
                checked = now
                self._go_on(f"the {what} gate")
            backoff.sleep()
        verdict = _verdict(what, notes, sorted(reqs), self.timeout)
        self.incomplete = bool(reqs) or any(n[:1] == b"\x02" for n in notes.values())
        out = ((b"M" if self.incomplete else b"F") + (verdict or "").encode("utf-8", "replace")
               )[:_VERDICT_MAX] if verdict else b""
        self._sent = [self.comm.Isend([out, MPI.BYTE], dest=dst, tag=_VERDICT_TAG)
                      for dst in range(1, self.size)]
        # the sends complete as the nodes take them; one that never arrives never will
        wait_request(AllOf(self._sent), time.monotonic() + 5.0, Backoff(50e-6, 20e-3))
        return verdict

    def all_min(self, value: int) -> int:
        """Collective: the smallest ``value`` any rank passed (an int64 all-reduce)."""
        if not self.is_mpi:
            return value
        mine = np.array([value], dtype=np.int64)
        out = np.zeros(1, dtype=np.int64)
        self.wait(self.comm.Iallreduce(mine, out, op=self.MPI.MIN), "the nodes' agreement "
                  "on the number of copies (--replicas auto)")
        self.received[0] += 1
        self.received[1] += 8
        return int(out[0])

    def bcast_bytes(self, data: bytes | None) -> bytes | bytearray:
        """Broadcast bytes from rank 0 (in pieces, so sizes above 2 GiB work)."""
        if not self.is_mpi:
            assert data is not None
            return data
        n = np.array([len(data) if data is not None else 0], dtype=np.int64)
        self.wait(self.comm.Ibcast(n, root=0), "the index broadcast from node 0")
        size = int(n[0])
        buf = bytearray(data) if self.rank == 0 and data is not None else bytearray(size)
        view = memoryview(buf)
        for start in range(0, size, _PIECE):
            self.wait(self.comm.Ibcast([view[start : start + _PIECE], self.MPI.BYTE], root=0),
                      "the index broadcast from node 0")
        return buf  # no second copy: the index is parsed straight from this buffer

    def release(self) -> None:
        """Before MPI_Finalize: free every communicator. MPICH's hydra ends the whole job
        (SIGKILL) when a process finalizes and exits while it still holds communicators
        shared with processes that run on (measured with MPICH 5.0.2: ranks exiting a
        second apart were killed unless they freed their duplicates first)."""
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

    def end_job(self, timeout: float = 30.0) -> bool:
        """Every rank of the job meets here before MPI_Finalize, once it has stopped its
        transport (no receive from ANY_SOURCE left posted): a process that finalizes and
        exits while another still waits on such a receive makes that receive fail in
        MPICH. False when not every rank came within ``timeout`` (some left without finalizing:
        the caller must not finalize either)."""
        if self.job is None or self.MPI is None or self.MPI.Is_finalized():
            return True
        req = self.job.comm.Ibarrier()
        deadline = time.monotonic() + timeout
        backoff = Backoff(100e-6, 20e-3)
        while not req.Test():
            if time.monotonic() > deadline or not self.alive():
                return False  # a launcher that is gone will never see the others come
            backoff.sleep()
        return True

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
_ROLL_TAG = 22
_VERDICT_TAG = 23
_PIECE = 1 << 30
#: a node's roll-call note (its host name and error) and the verdict, at most
_NOTE_MAX = 1024
_VERDICT_MAX = 4096
#: a node waits for node 0's verdict this much longer than node 0 waits for the nodes
_VERDICT_SLACK = 30.0


def _start_backoff() -> Backoff:
    """The pacing of a start-up wait: quick at first (a collective of ready nodes completes
    in well under a millisecond), 20 ms apart after that, 100 ms once it has waited a
    second (a node waits for the slowest one to stage: each wake-up costs CPU, and
    measured on 256 oversubscribed one-rank nodes the waits' wake-ups were a third of a
    daemon's start-up CPU)."""
    return Backoff(50e-6, 20e-3, coldest=0.1, cold_after=1.0)


def _verdict(what: str, notes: dict[int, bytes], missing: list[int],
             timeout: float | None) -> str | None:
    """One line from node 0's roll call: the nodes that failed, with their reasons, and
    those that did not arrive; None when every node arrived and succeeded."""
    failed = []
    for node in sorted(notes):
        raw = notes[node].rstrip(b"\0")
        if raw[:1] == b"\x01":
            continue
        host, _, error = raw[1:].decode("utf-8", "replace").partition("\0")
        who = f"node {node} ({host}): "
        error = error.removeprefix(f"rank {node} ({host}): ")  # the node's own prefix
        failed.append(who + error)
    parts = failed[:5]
    if len(failed) > 5:
        parts.append(f"and {len(failed) - 5} more nodes failed")
    if missing:
        shown = ", ".join(str(n) for n in missing[:20])
        more = f" and {len(missing) - 20} more" if len(missing) > 20 else ""
        parts.append(f"node{'s' if len(missing) > 1 else ''} {shown}{more} did not reach "
                     f"the {what} gate within {timeout:g} s (--start-timeout)")
    return "; ".join(parts) or None


#: seconds MPI_Init has at least, whatever ``--start-timeout`` says (a short one is for the
#: gates: MPI_Init's time is the launcher starting every rank, which a busy node stretches)
MPI_INIT_FLOOR = 60


def _init_mpi(timeout: float | None = None):
    """MPI_Init (thread-multiple), with ``timeout``: MPI_Init holds the interpreter until
    every rank of the job has started, so no thread of ours can watch it; an alarm
    (SIGALRM, default action: the process ends) bounds it instead, and the launcher reports
    the rank killed by SIGALRM (under hydra the shim says why: launcher.shim)."""
    import signal

    if timeout is not None:
        signal.signal(signal.SIGALRM, signal.SIG_DFL)
        signal.alarm(max(MPI_INIT_FLOOR, int(timeout + 0.999)))
    try:
        return _init_mpi_now()
    finally:
        if timeout is not None:
            signal.alarm(0)


def _init_mpi_now():
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
