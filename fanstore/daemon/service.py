"""The node daemon's control-socket requests (the protocol is in :mod:`fanstore.control`).

Served from the control server's threads; each handler only reads node state or hands the
request to the frontend or the read core, both of which are thread-safe.
"""

from __future__ import annotations

import os
import time
from typing import Any

from fanstore.errors import (
    RemoteError,
    UsageError,
)


#: Requests only the mount's owner (its uid, or root) may make.
OWNER_OPS = frozenset({"shutdown", "prefetch", "window"})


def _int(req: dict[str, Any], key: str, default: int | None = None) -> int:
    value = req.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool):
        raise UsageError(f"{req.get('op')}: {key!r} must be an integer")
    return value


def _str(req: dict[str, Any], key: str, default: str = "", limit: int = 4096) -> str:
    value = req.get(key, default)
    if not isinstance(value, str) or len(value) > limit:
        raise UsageError(f"{req.get('op')}: {key!r} must be a string of at most {limit} "
                         "characters")
    return value


def handlers(node) -> dict[str, Any]:
    """The request handlers of ``node`` (a :class:`fanstore.daemon.node.Node` that serves).
    Each checks the types of the fields it uses; ``_uid`` is the asking process's uid."""

    def ping(req):
        return {"ok": True, "pid": os.getpid()}

    def info(req):
        share = node.ctx.share
        return {"ok": True, "pid": os.getpid(), "store": share.spec.store,
                "mode": share.spec.mode, "frontend": share.spec.frontend,
                "mountpoint": node.mount_key, "data_dir": share.data_dir,
                "local_parts": list(share.local_parts), "replicated": list(share.replicated),
                "rank": node.rank, "ranks": node.size, "index_copy": share.index_copy}

    def stats(req):
        return node.stats_json()

    def shutdown(req):
        everywhere = req.get("everywhere", False)
        if not isinstance(everywhere, bool):
            raise UsageError("shutdown: 'everywhere' must be true or false")
        node.request_stop(_str(req, "reason", "shutdown requested", 512), everywhere)
        return {"ok": True}

    def prefetch(req):
        """The access order of a reader's next epoch: ``paths`` (relative to the mount
        root; the client reads any list file itself: the daemon never opens a path it is
        given) or ``entries`` (index entries the client resolved itself, e.g. the Python
        API); ``client`` names the reader (one order per training process; a new order
        replaces that client's)."""
        index = node.ctx.index
        entries, unknown = [], 0
        if "entries" in req:
            entries = req["entries"]
            if not isinstance(entries, list) or not all(
                    isinstance(e, int) and not isinstance(e, bool)
                    and 0 <= e < index.n_entries for e in entries):
                raise UsageError("prefetch: 'entries' must be a list of index entries")
        else:
            paths = req.get("paths")
            if not isinstance(paths, list) or not all(isinstance(p, str) for p in paths):
                raise UsageError("prefetch needs 'paths': a list of path strings")
            found = node.ctx.ns.file_entries(paths)  # as reading resolves them
            entries = [e for e in found if e >= 0]
            unknown = len(found) - len(entries)
        n = node.frontend.set_order(entries, _str(req, "client", "default", 256) or "default")
        return {"ok": True, "files": n, "unknown": unknown}

    def window(req):
        """The prefetch window's shared state (a descriptor, SCM_RIGHTS), for an API
        reader of the node in prefetch mode (fanstore.api.MountReader)."""
        return {"ok": True, "_fds": [node.frontend.prefetch_window()]}

    def read_stored(req):
        """Stored bytes of a partition held by another node, for a reader process here."""
        part, offset, length = _int(req, "part"), _int(req, "offset"), _int(req, "length")
        index = node.ctx.index
        if not 0 <= part < len(index.partitions) or offset < 0 or length < 0 \
                or offset + length > index.partitions[part].size:
            raise UsageError(f"read_stored: no such range in partition {part}")
        entry = req.get("entry")
        entry = entry if isinstance(entry, int) and not isinstance(entry, bool) \
            and 0 <= entry < index.n_entries else None
        if node.peers is None:
            raise RemoteError(f"partition {part} is held by no other node of this job")
        t0 = time.perf_counter()
        data = node.peers.fetch(part, offset, length, entry)
        # The reader process counts the read itself; the daemon records how long the peer
        # took (the p50/p99 of ``fanstore stats``) and how many it relayed.
        node.stats.remote_latency.append(time.perf_counter() - t0)
        node.stats.extra["relayed_reads"] = node.stats.extra.get("relayed_reads", 0) + 1
        return {"ok": True}, bytes(data)

    return {"ping": ping, "info": info, "stats": stats, "shutdown": shutdown,
            "prefetch": prefetch, "window": window, "read_stored": read_stored}

