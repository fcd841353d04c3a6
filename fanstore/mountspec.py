"""One mount spec, end to end: :class:`MountSpec` and :class:`NodeShare`.

``fanstore mount`` (the CLI, alone or on every rank an MPI launcher starts) builds one
:class:`MountSpec` from its arguments and :mod:`fanstore.settings`; it is validated there,
once, here (:meth:`MountSpec.__post_init__`: the one place a mount's options are checked),
and never changes after. The same object is what :func:`fanstore.launch.mount` takes, what
the node daemon (:class:`fanstore.daemon.node.Node`) runs on, and, inside a
:class:`NodeShare` (what one node serves: the spec and the node's own facts), what the
kernel frontend process and the node's worker ranks receive, as JSON written and read by
:mod:`fanstore.strictjson` (exactly these keys, each of its type; anything else is one
:class:`~fanstore.errors.SpecError` line). Nothing below reads the environment or the
command line.

A low, standard-library-only module (its layer is the format's, tests/test_layers.py), so
that every process that takes a spec may import it.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, fields

from fanstore import fuseflags, strictjson
from fanstore.errors import SpecError
from fanstore.settings import DEFAULT_MPI_PIECE, FRONTENDS, MIN_MPI_PIECE
from fanstore.storage.location import is_url

__all__ = ["DEFAULT_MAX_WORKERS", "FSNAME", "MODES", "START_TIMEOUT", "MountSpec",
           "NodeShare"]

#: ``--mode``: decode on the read path, or ahead in a given order (kernel frontend only)
MODES = ("sync", "prefetch")
#: seconds a start-up step of an MPI job waits for the other nodes (``--start-timeout``)
START_TIMEOUT = 300.0
#: the kernel frontend's FUSE workers when ``--workers`` is not given: the cores, at most this
DEFAULT_MAX_WORKERS = 16
#: the "source" /proc/mounts shows for a FanStore mount (either frontend)
FSNAME = "fanstore"


def _option(default, flag: str):
    """A field with its default and the ``fanstore mount`` option that sets it (named in
    its errors)."""
    return field(default=default, metadata={"option": flag})


@dataclass(frozen=True)
class MountSpec:
    """A mount: what to serve, where, and how (every ``fanstore mount`` option that reaches
    the daemon, its frontend or its worker ranks; the CLI's own, such as ``--foreground``,
    stay there).

    ``store`` is made absolute (a URL stays one); ``frontend`` ``"auto"`` becomes the
    kernel frontend (measured faster on every pass: docs/benchmarks.md). ``mountpoint`` and
    ``local_dir`` may hold ``{rank}``/``{node}`` and ``{host}``, substituted by each node.
    ``fuse_flags`` are ``+NAME,-NAME`` edits of the kernel frontend's INIT flags
    (:mod:`fanstore.fuseflags`); ``mpi_piece`` comes from ``$FANSTORE_MPI_PIECE``.
    """

    store: str = field(metadata={"option": "STORE"})
    mountpoint: str = field(metadata={"option": "MOUNTPOINT"})
    frontend: str = _option("auto", "--frontend")
    mode: str = _option("sync", "--mode")
    cache_mb: int = _option(256, "--cache-mb")
    threads: int = _option(0, "--threads")  # pyfuse3's decode threads; 0: 2 per core, >= 4
    workers: int = _option(0, "--workers")  # kernel frontend's forked workers; 0: the cores
    allow_other: bool = _option(False, "--allow-other")
    prefetch_mb: int = _option(1024, "--prefetch-mb")
    fuse_flags: str = _option("", "--fuse-flags")
    chunk_spill: bool = _option(True, "--no-chunk-spill")
    prefetch_lookup: bool = _option(True, "--no-prefetch-lookup")
    local_dir: str | None = _option(None, "--local-dir")
    #: copies of each partition, or "auto": as many as fit (fanstore.daemon.replicas)
    replicas: int | str = _option(1, "--replicas")
    #: bytes per node for --replicas auto (None: the free space of local_dir)
    local_capacity: int | None = _option(None, "--local-capacity")
    remote_timeout: float = _option(30.0, "--remote-timeout")
    keep_local: bool = _option(False, "--keep-local")
    stage_jobs: int = _option(4, "--stage-jobs")
    #: how launched ranks form nodes: "auto" (the ranks with the same node name) or K
    #: consecutive ranks (fanstore.daemon.layout)
    ranks_per_node: int | str = _option("auto", "--ranks-per-node")
    start_timeout: float = _option(START_TIMEOUT, "--start-timeout")
    #: bytes per message of a remote read's reply (0: one message)
    mpi_piece: int = _option(DEFAULT_MPI_PIECE, "$FANSTORE_MPI_PIECE")

    def __post_init__(self) -> None:
        strictjson.typed(self)
        if self.frontend == "auto":
            object.__setattr__(self, "frontend", "kernel")
        if not is_url(self.store) and self.store:
            object.__setattr__(self, "store", os.path.abspath(self.store))
        self._check_values()
        self._check_together()

    def _check_values(self) -> None:
        for name in ("store", "mountpoint"):
            if not getattr(self, name):
                self._bad(name, "a path")
        if self.local_dir == "":
            self._bad("local_dir", "a path or null")
        if self.frontend not in FRONTENDS:
            self._bad("frontend", " or ".join(FRONTENDS))
        if self.mode not in MODES:
            self._bad("mode", " or ".join(MODES))
        for name, low in (("cache_mb", 0), ("threads", 0), ("workers", 0), ("prefetch_mb", 1),
                          ("stage_jobs", 1)):
            if getattr(self, name) < low:
                self._bad(name, f"a whole number >= {low}")
        for name in ("replicas", "ranks_per_node"):
            value = getattr(self, name)
            if value != "auto" and (isinstance(value, str) or value < 1):
                self._bad(name, "'auto' or a whole number >= 1")
        if self.local_capacity is not None and self.local_capacity < 1:
            self._bad("local_capacity", "a number of bytes >= 1 or null")
        for name in ("remote_timeout", "start_timeout"):
            value = getattr(self, name)
            if not (value > 0 and math.isfinite(value)):
                self._bad(name, "a number of seconds > 0")
        if self.mpi_piece != 0 and self.mpi_piece < MIN_MPI_PIECE:
            self._bad("mpi_piece", f"0 or a number of bytes >= {MIN_MPI_PIECE}")
        try:
            fuseflags.check(self.fuse_flags)
        except ValueError as exc:
            self._bad("fuse_flags", str(exc), show=False)

    def _check_together(self) -> None:
        """The options that only make sense together (the CLI's words: these are usage)."""
        if is_url(self.store) and not self.local_dir:
            raise SpecError(f"{self.store} is in object storage: mounting it needs "
                            "--local-dir (node-local storage to stage its partitions into)")
        if self.local_capacity is not None and self.replicas != "auto":
            raise SpecError("--local-capacity sizes --replicas auto: give --replicas auto, "
                            "or leave --local-capacity out")
        if self.local_capacity is not None and not self.local_dir:
            raise SpecError("--local-capacity is the room for staged partitions: it needs "
                            "--local-dir")
        if self.frontend == "pyfuse3" and self.mode == "prefetch":
            raise SpecError("--mode prefetch is served by the kernel frontend: mount with "
                            "--frontend kernel (or auto, the default)")

    def _bad(self, name: str, what: str, show: bool = True) -> None:
        option = next(f.metadata["option"] for f in fields(self) if f.name == name)
        detail = f"must be {what}, not {getattr(self, name)!r}" if show else what
        raise SpecError(f"MountSpec: {name} ({option}): {detail}")

    @property
    def prefetch(self) -> bool:
        return self.mode == "prefetch"

    def decode_threads(self) -> int:
        """The pyfuse3 frontend's decode threads: ``threads``, or 2 per core (at least 4)."""
        if self.threads:
            return self.threads
        return max(4, 2 * len(os.sched_getaffinity(0)))

    def worker_count(self) -> int:
        """The kernel frontend's forked workers: ``workers``, or by default the cores this
        process may use, at most ``DEFAULT_MAX_WORKERS`` (what a node needs, not what it
        has: docs/benchmarks.md, "Ranks per node")."""
        return self.workers or min(DEFAULT_MAX_WORKERS, len(os.sched_getaffinity(0)))


@dataclass(frozen=True)
class NodeShare:
    """One node's share of a mount: the :class:`MountSpec` and what the node made of it.
    The node daemon builds it once, after placement and staging; its frontend serves
    from it and it goes, as it is, to the kernel frontend process and to the node's
    worker ranks.

    Attributes: ``mountpoint`` this node's (``{rank}``, ``{host}`` substituted);
    ``data_dir`` where its partitions are (the local dir, or the store); ``local_parts``
    them, ``replicated`` those of them another node holds too, ``table`` the placement
    (partition -> holder nodes); ``index_copy`` the node's shared index copy (mapped by
    every process of the node); ``socket_path`` the daemon's control socket;
    ``worker_socket`` where the node's worker ranks join the kernel frontend ("" when
    they do not: the frontend forks its own workers, or serves from the daemon);
    ``fuse_workers`` the processes that serve the mount's FUSE requests (worker ranks or
    forked workers; 1 for the pyfuse3 frontend), among which ``--cache-mb`` is split.
    """

    spec: MountSpec
    mountpoint: str
    data_dir: str
    local_parts: tuple[int, ...]
    replicated: tuple[int, ...]
    table: tuple[tuple[int, ...], ...]
    index_copy: str
    socket_path: str
    worker_socket: str
    fuse_workers: int

    def __post_init__(self) -> None:
        strictjson.typed(self)
        for name in ("mountpoint", "data_dir", "index_copy", "socket_path"):
            if not getattr(self, name):
                raise SpecError(f"NodeShare: {name} must be a path, not ''")
        parts = (self.local_parts, self.replicated, *self.table)
        if any(p < 0 for row in parts for p in row):
            raise SpecError("NodeShare: partitions and nodes are numbers >= 0")
        if self.fuse_workers < 1:
            raise SpecError(f"NodeShare: fuse_workers must be >= 1, not {self.fuse_workers}")

    @property
    def cache_bytes(self) -> int:
        """Each FUSE-serving process's decoded-chunk cache: its share of ``--cache-mb``."""
        return (self.spec.cache_mb << 20) // self.fuse_workers
