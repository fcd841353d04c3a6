"""What the node daemon starts the kernel frontend process with: :class:`FrontendStart`.

The daemon (:class:`~fanstore.fuse.kernelfs.frontend.KernelFrontend`) writes it as one JSON
object to a pipe (``--spec-fd``, never a file another user could read or swap) and closes
it; the frontend process (:func:`~fanstore.fuse.kernelfs.process.frontend_main`) reads it
to EOF with :func:`read_start`. It is the node's :class:`~fanstore.mountspec.NodeShare`
(the mount spec and this node's part, exactly as the node and its worker ranks have it)
and how the process is wired to the daemon; :mod:`fanstore.strictjson` writes and reads it
(no key unknown or missing, every value of its type: one SpecError line).
"""

from __future__ import annotations

from dataclasses import dataclass

from fanstore import strictjson
from fanstore.errors import SpecError
from fanstore.mountspec import NodeShare

#: A start larger than this is refused (a few hundred bytes plus the partition lists).
START_LIMIT = 64 << 20


@dataclass(frozen=True)
class FrontendStart:
    """The kernel frontend process's start.

    Attributes: ``share`` the node's share of the mount; ``counters_path`` the counters
    file the frontend creates (runtime directory); ``ready_fd`` the pipe it reports
    "ready" or "error: ..." on; ``daemon_pid`` the daemon (the frontend dies with it, and
    refuses to start under another); ``debug``, ``log_format`` logging like the daemon's;
    ``order_fd``, ``window_fds`` prefetch mode's order channel and shared window (state and
    arena memfds): given exactly in prefetch mode.
    """

    share: NodeShare
    counters_path: str
    ready_fd: int
    daemon_pid: int
    debug: bool
    log_format: str | None
    order_fd: int | None
    window_fds: tuple[int, int] | None

    def __post_init__(self) -> None:
        strictjson.typed(self)
        if not self.counters_path:
            raise SpecError("FrontendStart: counters_path must be a path, not ''")
        if self.ready_fd < 0 or self.daemon_pid < 1:
            raise SpecError("FrontendStart: ready_fd must be >= 0 and daemon_pid >= 1")
        fds = (self.order_fd, *(self.window_fds or (None, None)))
        if not (all(fd is not None and fd >= 0 for fd in fds) if self.share.spec.prefetch
                else all(fd is None for fd in fds)):
            raise SpecError("FrontendStart: order_fd and window_fds are descriptors in "
                            "prefetch mode, and null in sync mode")


def read_start(fd: int, limit: int = START_LIMIT) -> FrontendStart:
    """The frontend's start, read to EOF from the pipe ``fd`` the daemon wrote it to (closed
    here) and checked."""
    data = bytearray()
    with open(fd, "rb", closefd=True) as f:
        while len(data) <= limit:
            chunk = f.read(1 << 16)
            if not chunk:
                break
            data += chunk
    if len(data) > limit:
        raise SpecError(f"FrontendStart: larger than {limit} bytes")
    return strictjson.from_json(FrontendStart, bytes(data))
