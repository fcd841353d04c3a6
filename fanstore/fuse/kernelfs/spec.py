"""What the node daemon tells the kernel frontend process it starts: :class:`FrontendSpec`.

The daemon (:class:`~fanstore.fuse.kernelfs.frontend.KernelFrontend`) writes the spec as one JSON
object to a pipe (``--spec-fd``, never a file another user could read or swap) and closes
it; the frontend process (:func:`~fanstore.fuse.kernelfs.process.frontend_main`) reads it to EOF
with :func:`read_spec`. A spec is checked whenever one is made, on either side: every field
present and of its type, numbers in range, no unknown field; a bad one is a single
MountError line.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields

from fanstore.errors import MountError

#: A spec larger than this is refused (it is a few hundred bytes plus the partition lists).
SPEC_LIMIT = 64 << 20
MODES = ("sync", "prefetch")


@dataclass(frozen=True)
class FrontendSpec:
    """The kernel frontend's configuration (one node's mount).

    Attributes
    ----------
    mountpoint : where to mount.
    index_path : the node's shared index copy (mapped, owned by the daemon's uid).
    store : the store the node serves (for messages).
    data_dir : where this node's partitions are (the local dir, or the store).
    local_parts, replicated : this node's partitions, and those of them another node holds
        too (:func:`fanstore.control.node_reader`).
    socket_path : the daemon's control socket (other nodes' chunks, ``read_stored``).
    counters_path : the counters file the frontend creates (runtime directory).
    workers : worker processes to fork (>= 1).
    external_workers : worker ranks that join instead (``worker_socket``); 0: fork.
    worker_socket : the handoff socket worker ranks connect to (runtime directory).
    cache_bytes : each worker's decoded-chunk cache.
    allow_other, fsname : mount options.
    remote_timeout : seconds a remote read may take (> 0).
    ready_fd : the pipe the frontend reports "ready" or "error: ..." on.
    daemon_pid : the daemon; the frontend dies with it, and refuses to start under another.
    debug, log_format : logging like the daemon's.
    init_flags : ``+NAME,-NAME`` edits of the INIT flags (``--fuse-flags``).
    mode : "sync" or "prefetch".
    order_fd, window_fds, prefetch_bytes : prefetch mode: the daemon's order channel, the
        shared window (state and arena memfds), the ``--prefetch-mb`` budget in bytes.
    chunk_spill : push the rest of a chunk decoded for a partial read into the page cache
        (``--no-chunk-spill``: not).
    prefetch_lookup : prefetch mode: look files up ahead of their push
        (``--no-prefetch-lookup``: not).
    """

    mountpoint: str
    index_path: str
    store: str
    data_dir: str
    local_parts: tuple[int, ...]
    replicated: tuple[int, ...]
    socket_path: str
    counters_path: str
    workers: int
    external_workers: int
    worker_socket: str
    cache_bytes: int
    allow_other: bool
    fsname: str
    remote_timeout: float
    ready_fd: int
    daemon_pid: int
    debug: bool = False
    log_format: str | None = None
    init_flags: str = ""
    mode: str = "sync"
    order_fd: int | None = None
    window_fds: tuple[int, int] | None = None
    prefetch_bytes: int = 0
    chunk_spill: bool = True
    prefetch_lookup: bool = True

    def __post_init__(self) -> None:
        for name in ("mountpoint", "index_path", "data_dir", "socket_path", "counters_path",
                     "worker_socket", "fsname"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                self._bad(name, "a non-empty string")
        for name in ("store", "init_flags"):
            if not isinstance(getattr(self, name), str):
                self._bad(name, "a string")
        if self.log_format is not None and not isinstance(self.log_format, str):
            self._bad("log_format", "a string or null")
        for name in ("allow_other", "debug", "chunk_spill", "prefetch_lookup"):
            if not isinstance(getattr(self, name), bool):
                self._bad(name, "true or false")
        for name, low in (("workers", 1), ("external_workers", 0), ("cache_bytes", 0),
                          ("ready_fd", 0), ("daemon_pid", 1), ("prefetch_bytes", 0)):
            if not _whole(getattr(self, name), low):
                self._bad(name, f"a whole number >= {low}")
        for name in ("local_parts", "replicated"):
            value = getattr(self, name)
            if not isinstance(value, (list, tuple)) or not all(_whole(p, 0) for p in value):
                self._bad(name, "a list of partition numbers")
            object.__setattr__(self, name, tuple(value))
        t = self.remote_timeout
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not t > 0:
            self._bad("remote_timeout", "a number of seconds > 0")
        if self.mode not in MODES:
            self._bad("mode", " or ".join(repr(m) for m in MODES))
        if self.mode == "prefetch":
            w = self.window_fds
            if not isinstance(w, (list, tuple)) or len(w) != 2 \
                    or not all(_whole(fd, 0) for fd in w):
                self._bad("window_fds", "two descriptors in prefetch mode")
            object.__setattr__(self, "window_fds", tuple(w))
            if not _whole(self.order_fd, 0):
                self._bad("order_fd", "a descriptor in prefetch mode")
            if self.prefetch_bytes < 1:
                self._bad("prefetch_bytes", "a whole number >= 1 in prefetch mode")

    def _bad(self, name: str, what: str) -> None:
        raise MountError(f"the kernel frontend's spec is invalid: {name} must be {what}, "
                         f"not {getattr(self, name)!r}")

    @property
    def prefetch(self) -> bool:
        return self.mode == "prefetch"

    def to_json(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def from_json(cls, data: bytes) -> FrontendSpec:
        """A spec from its JSON (MountError, one line, if it is not a valid one)."""
        try:
            obj = json.loads(data)
        except (ValueError, RecursionError):
            obj = None
        if not isinstance(obj, dict):
            raise MountError("the kernel frontend's spec is not a JSON object")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(obj) - known)
        if unknown:
            raise MountError(f"the kernel frontend's spec has an unknown field {unknown[0]!r}")
        try:
            return cls(**obj)
        except TypeError as exc:  # a required field missing
            raise MountError(f"the kernel frontend's spec is invalid: {exc}") from None


def _whole(value: object, low: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= low


def read_spec(fd: int, limit: int = SPEC_LIMIT) -> FrontendSpec:
    """The frontend's spec, read to EOF from the pipe ``fd`` the daemon wrote it to (closed
    here) and checked."""
    data = bytearray()
    with open(fd, "rb", closefd=True) as f:
        while len(data) <= limit:
            chunk = f.read(1 << 16)
            if not chunk:
                break
            data += chunk
    if len(data) > limit:
        raise MountError("the kernel frontend's spec is not a JSON object")
    return FrontendSpec.from_json(bytes(data))
