"""The counters of a node's readers, as ``fanstore stats`` prints them."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

#: Counters that add up across processes (a node with several reader processes sums them).
SUMMED = ("opens", "reads", "bytes_returned", "local_reads", "local_bytes", "remote_reads",
          "remote_bytes", "remote_failovers", "refetched_from_replica", "decode_seconds",
          "chunks_decoded", "bytes_decoded", "chunks_redecoded", "spill_chunks", "spill_bytes",
          "spill_dropped", "spill_refused", "shared_hits", "errors", "cache_hits", "cache_misses", "cache_bytes",
          "cache_budget", "peers_marked_dead")


@dataclass
class ReadStats:
    """Counters of one reader process; the read core, the frontends and the peer router
    increment them (plain ints: single writers or GIL-atomic increments are enough for
    counters that are only ever reported)."""

    opens: int = 0
    reads: int = 0
    bytes_returned: int = 0
    local_reads: int = 0
    local_bytes: int = 0  # stored bytes read from local partitions
    remote_reads: int = 0
    remote_bytes: int = 0  # compressed bytes received from peers
    remote_failovers: int = 0
    peers_marked_dead: int = 0  # times a peer rank was found unreachable (a node's death)
    refetched: int = 0  # local chunks that failed their checksum, read again from a replica
    decode_seconds: float = 0.0
    chunks_decoded: int = 0
    bytes_decoded: int = 0
    chunks_redecoded: int = 0  # decoded again by the process that had decoded them before
    # the kernel frontend's chunk spill (fanstore.fuse.kernelfs.spill): chunks whose other
    # pages went into the page cache, those bytes, offers dropped (queue full), stores refused
    spill_chunks: int = 0
    spill_bytes: int = 0
    spill_dropped: int = 0
    spill_refused: int = 0
    shared_hits: int = 0  # chunks copied from another process's decode (read/shared.py)
    errors: int = 0
    remote_latency: deque = field(default_factory=lambda: deque(maxlen=20000))
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self, cache=None) -> dict[str, Any]:
        lat = sorted(self.remote_latency)

        def pct(p: float) -> float | None:
            if not lat:
                return None
            return round(lat[min(len(lat) - 1, int(p * len(lat)))] * 1000, 3)

        out: dict[str, Any] = {
            "opens": self.opens,
            "reads": self.reads,
            "bytes_returned": self.bytes_returned,
            "cache_hits": cache.hits if cache is not None else 0,
            "cache_misses": cache.misses if cache is not None else 0,
            "cache_bytes": cache.used if cache is not None else 0,
            "cache_budget": cache.budget if cache is not None else 0,
            "local_reads": self.local_reads,
            "local_bytes": self.local_bytes,
            "remote_reads": self.remote_reads,
            "remote_bytes": self.remote_bytes,
            "remote_failovers": self.remote_failovers,
            "peers_marked_dead": self.peers_marked_dead,
            "refetched_from_replica": self.refetched,
            "remote_latency_ms_p50": pct(0.50),
            "remote_latency_ms_p99": pct(0.99),
            "decode_seconds": round(self.decode_seconds, 6),
            "chunks_decoded": self.chunks_decoded,
            "bytes_decoded": self.bytes_decoded,
            "decoded_per_returned": decoded_per_returned(self.bytes_decoded,
                                                         self.bytes_returned),
            "chunks_redecoded": self.chunks_redecoded,
            "spill_chunks": self.spill_chunks,
            "spill_bytes": self.spill_bytes,
            "spill_dropped": self.spill_dropped,
            "spill_refused": self.spill_refused,
            "shared_hits": self.shared_hits,
            "errors": self.errors,
        }
        for key, value in self.extra.items():
            out[key] = value() if callable(value) else value
        return out


def decoded_per_returned(decoded: int, returned: int) -> float | None:
    """Bytes decoded per byte returned to readers (read amplification of decoding)."""
    return round(decoded / returned, 3) if returned else None
