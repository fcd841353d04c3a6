"""What a node's leader tells its worker ranks to serve: :class:`WorkerRankSpec`.

The leader (:class:`~fanstore.daemon.node.Node`) sends it once, as JSON over the node's
communicator (:class:`~fanstore.daemon.nodegroup.LeaderSide`); each worker rank
(:mod:`fanstore.workerrank`) reads it back with :meth:`WorkerRankSpec.from_json`, which
refuses a missing or unknown field and a value of the wrong type (one MountError line):
a worker never guesses a setting, and nothing the leader does not write is read.
"""

from __future__ import annotations

import json
from dataclasses import MISSING, asdict, dataclass, fields
from typing import Any

from fanstore.errors import MountError


@dataclass(frozen=True)
class WorkerRankSpec:
    """A worker rank's configuration.

    Attributes: ``data_dir`` where this node's partitions are; ``local_parts`` them;
    ``table`` the placement table (partition -> holder nodes); ``index_copy`` the node's
    shared index copy; ``remote_timeout`` seconds a remote read may take; ``worker_socket``
    the kernel frontend's handoff socket ("" when the node's frontend serves the mount
    itself: this rank serves peers only); ``cache_bytes`` this rank's decoded-chunk cache;
    ``connect_timeout`` seconds to join the frontend; ``idle_sleep`` the MPI server's
    longest sleep when idle; ``mpi_piece`` bytes per message of a reply
    (``$FANSTORE_MPI_PIECE``).
    """

    data_dir: str
    local_parts: tuple[int, ...]
    table: tuple[tuple[int, ...], ...]
    index_copy: str
    remote_timeout: float
    worker_socket: str
    cache_bytes: int
    connect_timeout: float = 300.0
    idle_sleep: float = 2e-3
    mpi_piece: int = 8000

    def __post_init__(self) -> None:
        bad = []
        for name in ("data_dir", "index_copy", "worker_socket"):
            if not isinstance(getattr(self, name), str):
                bad.append(name)
        for name in ("remote_timeout", "connect_timeout", "idle_sleep"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                bad.append(name)
        for name in ("cache_bytes", "mpi_piece"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                bad.append(name)
        if not _ints(self.local_parts) or not all(_ints(row) for row in self.table):
            bad.append("local_parts/table")
        if bad:
            raise MountError(f"worker rank spec: bad {', '.join(bad)}")

    def to_json(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def from_json(cls, data: bytes | dict[str, Any]) -> WorkerRankSpec:
        raw = json.loads(data) if isinstance(data, (bytes, str)) else dict(data)
        if not isinstance(raw, dict):
            raise MountError("worker rank spec: not an object")
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - names)
        if unknown:
            raise MountError(f"worker rank spec: unknown field(s) {', '.join(unknown)}")
        missing = sorted(f.name for f in fields(cls) if f.name not in raw
                         and f.default is MISSING)
        if missing:
            raise MountError(f"worker rank spec: missing field(s) {', '.join(missing)}")
        try:
            raw["local_parts"] = tuple(raw["local_parts"])
            raw["table"] = tuple(tuple(row) for row in raw["table"])
        except TypeError:
            raise MountError("worker rank spec: bad local_parts/table") from None
        return cls(**raw)


def _ints(values) -> bool:
    return isinstance(values, tuple) and all(
        isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values)


__all__ = ["WorkerRankSpec"]
