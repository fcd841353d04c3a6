"""The node daemon's control-socket requests (the protocol is in :mod:`fanstore.control`).

Served from the control server's threads; each handler only reads node state or hands the
request to the frontend or the read core, both of which are thread-safe.
"""

from __future__ import annotations

import os
import time
from typing import Any

from fanstore.errors import MountError, NotFoundError, RemoteError, UsageError
from fanstore.format.index import KIND_FILE


def handlers(node) -> dict[str, Any]:
    """The request handlers of ``node`` (a :class:`fanstore.daemon.node.Node` that serves)."""

    def ping(req):
        return {"ok": True, "pid": os.getpid()}

    def info(req):
        ctx = node.ctx
        return {"ok": True, "pid": os.getpid(), "store": ctx.store, "mode": ctx.options.mode,
                "frontend": ctx.options.frontend, "mountpoint": node.mount_key,
                "data_dir": ctx.data_dir, "local_parts": ctx.local_parts,
                "replicated": ctx.replicated, "rank": node.rank, "ranks": node.size,
                "index_copy": ctx.index_path}

    def stats(req):
        return node.stats_json()

    def shutdown(req):
        node.request_stop(str(req.get("reason", "shutdown requested")),
                          bool(req.get("everywhere", False)))
        return {"ok": True}

    def prefetch(req):
        """The access order of a reader's next epoch: ``paths`` (relative to the mount
        root) or ``list`` (a file with one path per line, read here); ``client`` names the
        reader (one order per training process; a new order replaces that client's)."""
        paths = req.get("paths")
        if paths is None and req.get("list"):
            try:
                with open(req["list"], "rb") as f:
                    paths = [os.fsdecode(line.rstrip(b"\n")) for line in f if line.strip()]
            except OSError as exc:
                raise MountError(f"{req['list']}: cannot read: {exc.strerror}") from None
        if not isinstance(paths, list):
            raise UsageError("prefetch needs 'paths' (a list) or 'list' (a file of paths)")
        index = node.ctx.index
        entries, unknown = [], 0
        for p in paths:
            entry = index.resolve(os.fsencode(str(p)))
            if entry is None:
                unknown += 1
            else:
                entries.append(entry)
        n = node.frontend.set_order(entries, str(req.get("client") or "default"))
        return {"ok": True, "files": n, "unknown": unknown}

    def fetch(req):
        """A whole file, decoded and checked (prefetch-mode API readers)."""
        ns = node.ctx.ns
        entry = req.get("entry")
        if not isinstance(entry, int) or not 0 <= entry < ns.n_entries:
            entry = node.ctx.index.resolve(os.fsencode(str(req.get("path", ""))))
            if entry is None:
                raise NotFoundError(f"{req.get('path')}: no such file in the store")
        if ns.kind(entry) != KIND_FILE:
            raise MountError(f"{ns.show(entry)}: not a regular file")
        return {"ok": True, "entry": entry}, node.frontend.fetch(entry)

    def read_stored(req):
        """Stored bytes of a partition held by another node, for a reader process here."""
        part, offset, length = int(req["part"]), int(req["offset"]), int(req["length"])
        index = node.ctx.index
        if not 0 <= part < len(index.partitions) or offset < 0 or length < 0 \
                or offset + length > index.partitions[part].size:
            raise UsageError(f"read_stored: no such range in partition {part}")
        entry = req.get("entry")
        entry = entry if isinstance(entry, int) and 0 <= entry < index.n_entries else None
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
            "prefetch": prefetch, "fetch": fetch, "read_stored": read_stored}
