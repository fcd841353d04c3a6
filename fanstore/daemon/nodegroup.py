"""What a node's leader tells its worker ranks, over the node's communicator.

Three messages, each a polled ``Ibcast`` from the leader (rank 0 of ``Job.node_comm``) to
the node's worker ranks, in this order:

1. **hello**: the leader's pid (a worker exits when its leader is gone, whatever MPI
   does), sent as soon as the job is laid out; each worker answers with its own pid (a
   point-to-point message, so that the leader names the worker ranks that did not answer
   within the start timeout).
2. **start**: a :class:`RankStart`: the node's :class:`~fanstore.mountspec.NodeShare` (the
   mount spec and the node's data directory, partitions, placement table, index copy and
   the kernel frontend's worker socket, exactly as the node and its frontend have it), or
   why the node failed to start; written and read by :mod:`fanstore.strictjson`.
3. **exit**: the node is done (drained): stop serving and finalize MPI (``clean``) or
   leave without MPI_Finalize (a peer died).

JSON, never pickle; sizes travel first as an int64. Waits never spin (``Test`` with a
growing sleep) and give up when the other side's process or the launcher is gone; the
hello's have the start timeout as their deadline.
"""

from __future__ import annotations

import json
import os
import signal
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np

from fanstore import strictjson
from fanstore.daemon.pacing import Backoff
from fanstore.errors import MountError, SpecError
from fanstore.mountspec import NodeShare
from fanstore.process import pid_alive


@dataclass(frozen=True)
class RankStart:
    """What a node's leader tells its worker ranks to serve: the node's ``share`` of the
    mount, or the ``error`` that stopped the node (one, not both)."""

    share: NodeShare | None
    error: str

    def __post_init__(self) -> None:
        strictjson.typed(self)
        if (self.share is None) == (not self.error):
            raise SpecError("RankStart: a share or an error, one of the two")


def _wait(req, alive: Callable[[], bool] | None = None, backoff: Backoff | None = None,
          deadline: float | None = None) -> bool:
    # 100 ms apart once idle for a second: worker ranks wait here for their leader's
    # start while it stages (measured: 353 s of start-up at 128x4 on 2 cores cost each
    # worker rank 1.3 s of CPU polling at 20 ms)
    backoff = backoff or Backoff(100e-6, 20e-3, coldest=0.1, cold_after=1.0)
    while not req.Test():
        if alive is not None and not alive():
            return False
        if deadline is not None and time.monotonic() > deadline:
            return False
        backoff.sleep()
    return True


def _bcast_bytes(comm, data: bytes | None, alive=None,
                 deadline: float | None = None) -> bytes | None:
    """Leader (data given) or worker (None): one message; None if the other side died
    (``alive()`` turned false) or ``deadline`` passed."""
    n = np.array([len(data) if data is not None else 0], dtype=np.int64)
    if not _wait(comm.Ibcast(n, root=0), alive, deadline=deadline):
        return None
    buf = bytearray(data) if data is not None else bytearray(int(n[0]))
    if len(buf) and not _wait(comm.Ibcast([buf, len(buf), _byte(comm)], root=0), alive,
                              deadline=deadline):
        return None
    return bytes(buf)


#: seconds a leader waits for its worker ranks to take a message (they are polling for it)
TELL_TIMEOUT = 30.0
#: the tag of a worker rank's hello (its pid) to its leader, on the node's communicator
HELLO_TAG = 77
#: the leader's word to its worker ranks that the node's mount is gone: their reads of
#: other nodes give up at once (a signal: a worker rank may be inside one, waiting)
STOPPED_SIGNAL = signal.SIGUSR2


def _byte(comm):
    from mpi4py import MPI

    return MPI.BYTE


class LeaderSide:
    """The leader's half (no-ops when the node has no worker ranks)."""

    def __init__(self, job) -> None:
        self.job = job
        self.active = job is not None and len(job.workers_of(job.node)) > 0
        self.start_sent = False
        self.exit_sent = False
        self.worker_pids: list[int] = []

    def hello(self, pid: int, timeout: float = TELL_TIMEOUT, world=None) -> None:
        """Tell the workers our pid; learn theirs (to wait for them at the end). A worker
        rank that has not answered within ``timeout`` seconds (the start timeout) is named
        in the MountError, and ``world`` marked incomplete (no rank waits for it at the
        end of the job)."""
        if not self.active:
            return
        from fanstore.daemon.launcher import launcher_alive

        comm = self.job.node_comm
        deadline = time.monotonic() + timeout
        if _bcast_bytes(comm, json.dumps({"pid": pid}).encode(), launcher_alive,
                        deadline) is None:
            self._incomplete(world)
            raise MountError(self._missing(range(1, comm.Get_size()), timeout, "start"))
        pids = {src: np.zeros(1, dtype=np.int64) for src in range(1, comm.Get_size())}
        reqs = {src: comm.Irecv(buf, source=src, tag=HELLO_TAG) for src, buf in pids.items()}
        backoff = Backoff(100e-6, 20e-3, coldest=0.1, cold_after=1.0)
        while reqs and launcher_alive() and time.monotonic() <= deadline:
            for src in [s for s, r in reqs.items() if r.Test()]:
                del reqs[src]
            if reqs:
                backoff.sleep()
        if reqs:
            for r in reqs.values():
                r.Cancel()
            self._incomplete(world)
            raise MountError(self._missing(sorted(reqs), timeout, "say hello"))
        self.worker_pids = [int(pids[src][0]) for src in sorted(pids)]

    @staticmethod
    def _incomplete(world) -> None:
        if world is not None:
            world.incomplete = True

    def _missing(self, node_ranks, timeout: float, what: str) -> str:
        ranks = [self.job.workers_of(self.job.node)[r - 1] for r in node_ranks]
        shown = ", ".join(str(r) for r in ranks[:20]) + (" ..." if len(ranks) > 20 else "")
        return (f"worker rank{'s' if len(ranks) > 1 else ''} {shown} of this node did not "
                f"{what} within {timeout:g} s (--start-timeout)")

    def stopped_serving(self) -> None:
        """The node's mount is gone (unmounted, lazily if files were open): tell the
        worker ranks (STOPPED_SIGNAL), so that a read waiting for another node's reply
        ends within STOP_GRACE (ENOTCONN). Without it, a read of a peer that died waited
        the remote timeout shared by the peer node's ranks (15 s of 30 for two), and the
        node's end with it (measured: a worker rank of node 1 SIGKILLed while node 0 read its data,
        node 0 gone 17.4 s later)."""
        for pid in self.worker_pids:
            try:
                os.kill(pid, STOPPED_SIGNAL)
            except ProcessLookupError:
                pass

    def wait_workers_gone(self, timeout: float = 15.0) -> bool:
        """After MPI_Finalize: wait (bounded) until every worker rank's process has exited,
        so that the launcher sees the workers end before their leader (hydra tears the
        job down, SIGKILL included, when the launched ranks are gone while spawned ones
        still run).

        Before MPI_Finalize (a peer died, so the job ends without it) the wait keeps MPI's
        progress engine turning: the exit message's send completed here once it was handed
        to the network, and with a manual-progress netmod (the one between a daemon and the
        worker ranks it spawned) it reaches them only while this process calls into MPI.
        Without that the workers waited for the message until this wait timed out (15 s)."""
        from mpi4py import MPI

        deadline = time.monotonic() + timeout
        backoff = Backoff(1e-3, 50e-3)
        while any(pid_alive(p) for p in self.worker_pids):
            if time.monotonic() > deadline:
                return False
            if self.active and not MPI.Is_finalized():
                self.job.node_comm.Iprobe(MPI.ANY_SOURCE, MPI.ANY_TAG)
            backoff.sleep()
        return True

    def workers_alive(self) -> bool:
        """Every worker rank of the node is still there: a message to them is a
        collective of the node, which never completes once one has gone."""
        return all(pid_alive(p) for p in self.worker_pids)

    def _send(self, data: bytes) -> bool:
        """Send ``data`` to the worker ranks; False when one is gone or it took longer
        than ``TELL_TIMEOUT`` (a worker that stopped listening)."""
        deadline = time.monotonic() + TELL_TIMEOUT
        return _bcast_bytes(self.job.node_comm, data, self.workers_alive,
                            deadline) is not None

    def start(self, share: NodeShare) -> None:
        """What the worker ranks serve: the node's share, as it is."""
        self._start(RankStart(share=share, error=""))

    def failed(self, error: str) -> None:
        """The node did not start: workers exit (if the start was not sent yet)."""
        self._start(RankStart(share=None, error=error or "the node's daemon failed"))

    def _start(self, start: RankStart) -> None:
        if self.active and not self.start_sent:
            self.start_sent = True
            self._send(strictjson.to_json(start))

    def exit(self, clean: bool) -> bool:
        """Tell the workers to end (``clean``: with MPI_Finalize). False when they could
        not all be told (one is gone): the job then ends without MPI_Finalize."""
        if self.active and not self.exit_sent:
            self.exit_sent = True
            return self._send(json.dumps({"clean": clean}).encode())
        return True


class WorkerSide:
    """A worker rank's half."""

    def __init__(self, job) -> None:
        self.job = job
        self.leader_pid = 0
        self.finished = False  # the exit message came: the leader may go
        self._exit_req = None
        self._exit_n = np.zeros(1, dtype=np.int64)

    def leader_alive(self) -> bool:
        return self.leader_pid == 0 or pid_alive(self.leader_pid)

    def hello(self, timeout: float = TELL_TIMEOUT) -> None:
        """Learn the leader's pid and send ours; MountError when the launcher is gone,
        the leader did not speak within ``timeout`` seconds, or died before taking it."""
        from fanstore.daemon.launcher import launcher_alive

        deadline = time.monotonic() + timeout
        data = _bcast_bytes(self.job.node_comm, None, launcher_alive, deadline)
        if data is None:
            raise MountError("the MPI launcher is gone" if not launcher_alive() else
                             f"the node's daemon did not speak within {timeout:g} s "
                             "(--start-timeout)")
        self.leader_pid = int(json.loads(data)["pid"])
        if not _wait(self.job.node_comm.Isend(np.array([os.getpid()], dtype=np.int64),
                                              dest=0, tag=HELLO_TAG),
                     lambda: self.leader_alive() and launcher_alive(), deadline=deadline):
            raise MountError("the node's daemon did not take this rank's hello within "
                             f"{timeout:g} s (--start-timeout), or died")

    def start(self) -> NodeShare:
        """The node's share, from the leader; MountError when the node failed or the
        leader died, SpecError when what came is not a :class:`RankStart`."""
        data = _bcast_bytes(self.job.node_comm, None, self.leader_alive)
        if data is None:
            raise MountError("the node's daemon died before it was ready")
        start = strictjson.from_json(RankStart, data)
        if start.share is None:
            raise MountError(start.error)
        return start.share

    def exit_posted(self) -> bool:
        """Poll (without waiting) for the leader's exit message: True once it came. The
        first call posts the receive."""
        if self._exit_req is None:
            self._exit_req = self.job.node_comm.Ibcast(self._exit_n, root=0)
        return bool(self._exit_req.Test())

    def exit(self) -> bool | None:
        """Wait for the exit message; returns ``clean``, or None if the leader died."""
        if self._exit_req is None:
            self._exit_req = self.job.node_comm.Ibcast(self._exit_n, root=0)
        if not _wait(self._exit_req, self.leader_alive):
            return None
        size = int(self._exit_n[0])
        buf = bytearray(size)
        if size and not _wait(self.job.node_comm.Ibcast([buf, size, _byte(self.job.node_comm)],
                                                        root=0), self.leader_alive):
            return None
        return bool(json.loads(bytes(buf)).get("clean"))
