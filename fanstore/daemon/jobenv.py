"""The job as its launcher's environment describes it, before and without MPI.

Which launcher started this process (``srun`` or MPICH's hydra), how many tasks the Slurm
step has, this node's name, the MPICH netmod to force, and the ``{node}``/``{host}``
substitution in paths. Pure reads of the environment: no MPI here, so the CLI and a world
of one use it too.
"""

from __future__ import annotations

import os

HYDRA_MARKERS = ("HYDI_CONTROL_FD", "HYDRA_CONTROL_FD")


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


def under_hydra() -> bool:
    """Launched by hydra (``mpiexec``), as a launched rank."""
    return any(os.environ.get(m) for m in HYDRA_MARKERS)


def slurm_tasks() -> int | None:
    """Number of tasks of this Slurm step, if srun (not mpiexec) launched us."""
    if os.environ.get("SLURM_STEP_ID") is None:
        return None
    if any(os.environ.get(m) for m in HYDRA_MARKERS):
        return None  # mpiexec inside an allocation: its proxies are the Slurm tasks
    value = os.environ.get("SLURM_STEP_NUM_TASKS") or os.environ.get("SLURM_NTASKS")
    return int(value) if value and value.isdigit() else None


def node_name() -> str:
    """This node's name: Slurm's name for it when there is one, else the host name."""
    return os.environ.get("SLURMD_NODENAME") or os.uname().nodename.split(".")[0]


def substitute(path: str, node: int) -> str:
    """``{node}`` and ``{rank}`` (its older name: a rank was a node) become the node's
    index in the job, ``{host}`` the node's name."""
    return (path.replace("{node}", str(node)).replace("{rank}", str(node))
            .replace("{host}", node_name()))


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
