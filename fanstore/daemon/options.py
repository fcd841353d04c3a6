"""What ``fanstore mount`` asks of a node: :class:`NodeOptions` (MPI-free, typed; the CLI
fills it from its arguments and :mod:`fanstore.settings`, and nothing below reads the
environment)."""

from __future__ import annotations

from dataclasses import dataclass, field

from fanstore.frontend import MountOptions
from fanstore.settings import DEFAULT_MPI_PIECE

#: seconds a start-up step of an MPI job waits for the other nodes (--start-timeout)
START_TIMEOUT = 300.0


@dataclass
class NodeOptions:
    """What ``fanstore mount`` asks of a node."""

    store: str
    mountpoint: str
    mount: MountOptions = field(default_factory=MountOptions)
    local_dir: str | None = None
    #: copies of each partition, or "auto": as many as fit (fanstore.daemon.replicas)
    replicas: int | str = 1
    #: bytes per node for --replicas auto (None: the free space of local_dir)
    local_capacity: int | None = None
    remote_timeout: float = 30.0
    keep_local: bool = False
    stage_jobs: int = 4
    #: how launched ranks form nodes: "auto" (the ranks with the same node name: the
    #: Slurm node name under srun, else the host name) or K consecutive ranks (see fanstore.daemon.layout)
    ranks_per_node: str | int = "auto"
    #: seconds each start-up wait on the other nodes may take (--start-timeout)
    start_timeout: float = START_TIMEOUT
    #: bytes per message of a remote read's reply ($FANSTORE_MPI_PIECE; 0: one message)
    mpi_piece: int = DEFAULT_MPI_PIECE


__all__ = ["NodeOptions"]
