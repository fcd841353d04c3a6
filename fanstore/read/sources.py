"""Where stored (still compressed) chunk bytes come from: the typed seams of the read core.

- :class:`ChunkSource` is what the read core reads from. Three kinds:
  *local* (:class:`~fanstore.read.partitions.LocalPartitions`: this node's disk, pread),
  *remote* (a :class:`RemoteSource`: another node's partitions, through the node's MPI
  process (:class:`fanstore.daemon.routing.PeerSource`) or, from any other process of the
  node, through the node daemon's socket (:class:`fanstore.control.NodeSource`)), and
  *routed* (:class:`RoutedSource`: local when the partition is here, else remote).
- A ChunkSource's ``fallback(part)`` names where to read a chunk again when the local copy
  fails its checksum (bit rot on node-local storage): a replica on another node, if any.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from fanstore.errors import FanStoreError


@runtime_checkable
class ChunkSource(Protocol):
    def is_local(self, part: int) -> bool:
        """True when the partition's bytes are on this node's disk (read and decode inline)."""

    def fetch(self, part: int, offset: int, length: int, entry: int | None = None):
        """The stored bytes [offset, offset+length) of partition ``part`` (a bytes-like).
        ``entry`` names the file being read, for error messages. Raises FanStoreError."""

    def fallback(self, part: int) -> "ChunkSource | None":
        """Where to re-read ``part`` when its local copy is damaged, or None."""


@runtime_checkable
class RemoteSource(Protocol):
    """Partitions held by other nodes."""

    def fetch(self, part: int, offset: int, length: int, entry: int | None = None):
        """Stored bytes from a node that holds ``part`` (nearest live owner first).
        Raises RemoteError (EIO) when no owner answers."""

    def serves(self, part: int) -> bool:
        """True if another node holds ``part`` (a replica to fall back on)."""


class RoutedSource:
    """This node's partitions from disk, every other one from ``remote``."""

    def __init__(self, local, remote: RemoteSource | None) -> None:
        self.local = local
        self.remote = remote

    def is_local(self, part: int) -> bool:
        return self.local.has(part)

    def fetch(self, part: int, offset: int, length: int, entry: int | None = None):
        if self.local.has(part) or self.remote is None:
            return self.local.fetch(part, offset, length, entry)
        return self.remote.fetch(part, offset, length, entry)

    def advise(self, part: int, offset: int, length: int) -> None:
        if self.local.has(part):
            self.local.advise(part, offset, length)

    def fetch_many(self, items: list[tuple[int, int, int, int | None]]) -> list:
        """Stored bytes of several ranges ``(part, offset, length, entry)``: each item's
        bytes or the FanStoreError it got. Remote ones go to the remote source together
        when it can batch them (one exchange per holder), else one by one."""
        out: list = [None] * len(items)
        remote = []
        for i, (part, off, n, entry) in enumerate(items):
            if self.local.has(part) or self.remote is None:
                try:
                    out[i] = self.local.fetch(part, off, n, entry)
                except FanStoreError as exc:
                    out[i] = exc
            else:
                remote.append(i)
        if remote:
            many = getattr(self.remote, "fetch_many", None)
            if many is not None:
                for i, data in zip(remote, many([items[i] for i in remote])):
                    out[i] = data
            else:
                for i in remote:
                    try:
                        out[i] = self.remote.fetch(*items[i])
                    except FanStoreError as exc:
                        out[i] = exc
        return out

    def fallback(self, part: int):
        if self.remote is not None and self.local.has(part) and self.remote.serves(part):
            return _Remote(self.remote)
        return None


class _Remote:
    """A RemoteSource seen as a ChunkSource (for re-reading a damaged local chunk)."""

    def __init__(self, remote: RemoteSource) -> None:
        self.remote = remote

    def is_local(self, part: int) -> bool:
        return False

    def fetch(self, part: int, offset: int, length: int, entry: int | None = None):
        return self.remote.fetch(part, offset, length, entry)

    def fallback(self, part: int):
        return None
