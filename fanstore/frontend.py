"""What a node daemon needs from a FUSE frontend, and what it gives one.

The node (:mod:`fanstore.daemon.node`) does everything that does not depend on how the
kernel is spoken to: the MPI world, the index, placement, staging, the peer transport, the
control socket, signals, the drain and the exit. A frontend (:mod:`fanstore.fuse`) only
mounts and serves. The composition root (:mod:`fanstore.launch`) picks one and hands the
node a factory; neither package imports the other.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol

from fanstore.mountspec import MountSpec, NodeShare


@dataclass
class MountContext:
    """Everything a frontend serves from, built by the node.

    ``share`` is the node's share of the mount (:class:`~fanstore.mountspec.NodeShare`:
    the mount spec, this node's mount point, data directory, partitions, index copy and
    sockets): plain data, which a frontend that serves from other processes hands them as
    it is. The rest lives in the daemon's process: ``reader`` its read core (local
    partitions from disk, other nodes' over MPI), ``index`` and ``ns`` the mapped index
    and namespace, ``runtime`` the mount's private runtime directory
    (:class:`fanstore.runtime.MountRuntime`: the only place a frontend may create files,
    such as counters), ``request_stop`` (reason, everywhere), thread- and signal-safe,
    ``alive`` whether the start may go on.
    """

    share: NodeShare
    index: Any
    ns: Any
    reader: Any  # fanstore.read.ChunkReader
    runtime: Any
    request_stop: Callable[[str, bool], None]
    #: whether the start may go on (the launcher, the node's worker ranks): a frontend's
    #: wait for its own start gives up once it is false
    alive: Callable[[], bool] = lambda: True

    @property
    def mountpoint(self) -> str:
        return self.share.mountpoint

    @property
    def spec(self) -> MountSpec:
        return self.share.spec


#: what :meth:`Frontend.serve` returns when the mount was removed from outside (``umount``,
#: ``fusermount3 -u``): this node's own stop; any other end nobody asked for is a failure
#: that ends the job on every node (fanstore.daemon.node)
UNMOUNTED = "unmounted from outside"


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
