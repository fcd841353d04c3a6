"""What a node daemon needs from a FUSE frontend, and what it gives one.

The node (:mod:`fanstore.daemon.node`) does everything that does not depend on how the
kernel is spoken to: the MPI world, the index, placement, staging, the peer transport, the
control socket, signals, the drain and the exit. A frontend (:mod:`fanstore.fuse`) only
mounts and serves. The composition root (:mod:`fanstore.launch`) picks one and hands the
node a factory; neither package imports the other.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

from fanstore.mountspec import MountSpec


@dataclass
class MountContext:
    """Everything a frontend serves from, built by the node.

    ``reader`` is the node process's read core (local partitions from disk, other nodes'
    over MPI). A frontend that serves from other processes builds a reader in each of them
    from ``store``, ``data_dir``, ``local_parts`` and ``replicated``, and asks the daemon at
    ``socket_path`` for the rest (:class:`fanstore.control.NodeSource`). ``index_path`` is
    the node's private index copy, owned by the daemon's uid.
    """

    mountpoint: str
    options: MountSpec
    index: Any
    ns: Any
    reader: Any  # fanstore.read.ChunkReader
    store: str
    data_dir: str
    local_parts: list[int]
    replicated: list[int]  # local partitions another node also holds
    socket_path: str
    index_path: str  # the node's shared index copy (format.index.map_index_body)
    request_stop: Callable[[str, bool], None]  # (reason, everywhere): thread/signal safe
    remote_timeout: float = 30.0
    extra_stats: dict[str, Any] = field(default_factory=dict)
    #: the mount's private runtime directory (fanstore.runtime.MountRuntime): the only place
    #: a frontend may create files (counters)
    runtime: Any = None
    #: worker ranks of this node that serve the mount (MPI processes that join the
    #: frontend: fanstore.workerrank); 0: the frontend forks its own workers
    external_workers: int = 0


class Frontend(Protocol):
    def mount(self) -> None:
        """Mount the file system (not yet serving); MountError on failure."""

    def unmount(self) -> None:
        """Undo a mount that will not be served (another rank failed)."""

    def serve(self) -> str:
        """Serve until unmounted or stopped (blocks the calling thread); return why."""

    def stop(self, reason: str) -> None:
        """End :meth:`serve` and unmount. Safe from any thread and from a signal handler."""

    def stats(self) -> dict[str, Any]:
        """Counters of the readers this frontend runs (``fanstore stats``)."""

    def set_order(self, entries: list[int], client: str) -> int:
        """Prefetch mode: the access order of ``client``'s next epoch (MountError in sync)."""

    def prefetch_window(self) -> int:
        """Prefetch mode: a descriptor of the prefetch window's shared state (what the
        node's API readers read and mark; MountError in sync mode)."""


FrontendFactory = Callable[[MountContext], Frontend]
