"""This process's place in the job: an MPI world of N ranks, or a world of one.

``World.solo()`` is a single node without MPI; ``World.from_mpi()`` initialises MPI
itself (thread level, netmod choice for the PyPI MPICH, Slurm task-count check) and works
on a ``Dup()`` of the world communicator. Collectives here never spin: every wait is a
``Test`` with back-off (MPICH's blocking calls busy-poll a core).
"""

from __future__ import annotations

import os

import numpy as np

from fanstore.daemon.transport import Backoff, node_name, wait_request
from fanstore.errors import MountError

HYDRA_MARKERS = ("HYDI_CONTROL_FD", "HYDRA_CONTROL_FD")


# --------------------------------------------------------------------------- world


def choose_netmod(library_version: str, environ) -> str | None:
    """The MPICH netmod to force, if any, for the MPI library described by ``library_version``.

    The MPICH wheel from PyPI (5.0.2, ``ch4:ucx ofi``) defaults to UCX, whose large
    addresses are exchanged through PMI in segments at MPI_Init; under ``srun --mpi=pmi2``
    some of those PMI messages carry stale heap bytes, so a launch intermittently fails
    ("mpi/pmi2: invalid client request" in slurmd's log) or, worse, a rank gets a wrong
    address and its peers never reach it. Measured with a reproducer whose heap holds freed
    data, 2 nodes x 1 rank: UCX 14 of 30 launches failed, OFI 0 of 60. So for that wheel
    FanStore selects OFI; a site MPI, or an explicit ``MPIR_CVAR_CH4_NETMOD``, is left alone.
    """
    if "MPIR_CVAR_CH4_NETMOD" in environ:
        return None
    if "pypi.org/p/mpich" in library_version and "ucx" in library_version \
            and "ofi" in library_version:
        return "ofi"
    return None


class World:
    """This process's place in the job: rank, size, and collective helpers that never spin."""

    def __init__(self, rank: int = 0, size: int = 1, comm=None, mpi=None) -> None:
        self.rank = rank
        self.size = size
        self.comm = comm
        self.MPI = mpi

    @classmethod
    def solo(cls) -> "World":
        return cls()

    @classmethod
    def from_mpi(cls) -> "World":
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
        world = MPI.COMM_WORLD
        if provided < MPI.THREAD_MULTIPLE:
            names = {MPI.THREAD_SINGLE: "SINGLE", MPI.THREAD_FUNNELED: "FUNNELED",
                     MPI.THREAD_SERIALIZED: "SERIALIZED"}
            raise MountError(
                f"the MPI library provides only MPI_THREAD_{names.get(provided, provided)}; "
                "FanStore needs MPI_THREAD_MULTIPLE (its server thread and its readers call "
                "MPI at the same time): use an MPI built with thread support")
        expected = _slurm_tasks()
        if expected is not None and world.Get_size() != expected:
            raise MountError(
                f"MPI world size is {world.Get_size()} but Slurm started {expected} tasks: "
                "launch with 'srun --mpi=pmi2' (without an MPI plugin every task is its own "
                "1-rank world and would silently serve only its own partitions)")
        comm = world.Dup()
        return cls(comm.Get_rank(), comm.Get_size(), comm, MPI)

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


    def finalize(self) -> None:
        """End MPI once every rank got here: a polled barrier first, so that no rank leaves
        while a peer's last message to it is still in flight (with MPICH's OFI netmod a send
        completes only once the receiver acknowledges it), then MPI_Finalize."""
        if not self.is_mpi or self.MPI.Is_finalized():
            return
        self._wait(self.comm.Ibarrier())
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


def _slurm_tasks() -> int | None:
    """Number of tasks of this Slurm step, if srun (not mpiexec) launched us."""
    if os.environ.get("SLURM_STEP_ID") is None:
        return None
    if any(os.environ.get(m) for m in HYDRA_MARKERS):
        return None  # mpiexec inside an allocation: its proxies are the Slurm tasks
    value = os.environ.get("SLURM_STEP_NUM_TASKS") or os.environ.get("SLURM_NTASKS")
    return int(value) if value and value.isdigit() else None


def substitute(path: str, rank: int) -> str:
    return path.replace("{rank}", str(rank)).replace("{host}", node_name())


def launcher_world_size() -> int | None:
    """World size if we run under an MPI launcher with more than one rank, else None
    (read from the launcher's environment; MPI is not initialised)."""
    for var in ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_SIZE", "MPI_LOCALNRANKS"):
        value = os.environ.get(var)
        if value and value.isdigit() and int(value) > 1:
            return int(value)
    if os.environ.get("SLURM_STEP_ID") is not None:
        ntasks = os.environ.get("SLURM_STEP_NUM_TASKS") or os.environ.get("SLURM_NTASKS")
        if ntasks and ntasks.isdigit() and int(ntasks) > 1:
            return int(ntasks)
    return None
