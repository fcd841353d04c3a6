"""What a node daemon's ``stats`` reply holds (``fanstore stats``): its own counters, the
frontend's, and what stays fixed once it serves (layout, staging, start-up costs)."""

from __future__ import annotations

from typing import Any

from fanstore.daemon.jobenv import node_name
from fanstore.namespace import metadata_bytes
from fanstore.read.stats import SUMMED


def stats_json(node) -> dict[str, Any]:
    """This node's counters: the daemon's own reader, plus the frontend's readers (summed
    counters add up; anything else the frontend reports is added as it is)."""
    out = node.stats.to_json(node.ctx.reader.cache if node.ctx else None)
    if node.frontend is not None:
        for key, value in node.frontend.stats().items():
            if key in SUMMED and isinstance(out.get(key), (int, float)):
                out[key] += value
            else:
                out[key] = value
    return out


def static_stats(node, index, mine) -> dict[str, Any]:
    """What stays fixed once ``node`` serves (values) and live counters (callables)."""
    memory = metadata_bytes(index)
    out: dict[str, Any] = {
        "rank": node.rank,
        "ranks": node.size,
        "node": node_name(),
        "replicas": getattr(node, "replicas", 1),
        "local_partitions": mine,
        "metadata_bytes": memory,
        "metadata_bytes_per_entry": round(memory / max(1, index.n_entries), 1),
        "index_broadcast_seconds": round(node.bcast_seconds, 4),
        # what this daemon received in the start-up's layout, gates and agreements (the
        # index broadcast apart): constant in the number of nodes (benchmarks)
        "startup_received_messages": lambda: node.world.received[0],
        "startup_received_bytes": lambda: node.world.received[1],
        "frontend": node.spec.frontend,
    }
    if node.stage_report is not None:
        out.update(node.stage_report.to_json())
    t = node.transport
    if t is not None:
        out["served_requests"] = lambda: t.served_requests
        out["served_bytes"] = lambda: t.served_bytes
    if node.peers is not None:
        peers = node.peers
        out["dead_ranks"] = lambda: sorted(peers.dead)
        out["dead_nodes"] = lambda: peers.dead_nodes()
    return out
