"""The kernel frontend's counters: which column of a worker's row holds what, how a worker
fills its row, and what ``fanstore stats`` sums from the rows.

Every worker (forked, or a worker rank) has a row of the engine's counters table
(:class:`fanstore.fuse.engine.RequestCounters`, shared memory in the mount's runtime
directory): columns 0..63 count requests by opcode, 64..95 the engine's events, and the
application's columns, from ``APP_COL0``, are laid out here, once, by name (:data:`COL`):
:data:`READ_COLUMNS` (the worker's read core and chunk cache, and what a worker rank served
other nodes) from ``APP_COL0``, :data:`PREFETCH_COLUMNS` (prefetch mode) from
:data:`PREFETCH_COL0`. Each process writes only its own row; the daemon sums the rows
(:func:`summed_stats`).
"""

from __future__ import annotations

from typing import Any

from fanstore.fuse.engine.counters import APP_COL0, COLS, OP_COLS
from fanstore.read.stats import decoded_per_returned

#: The read core's counters in a worker's row, from APP_COL0 on.
READ_COLUMNS = ("reads", "bytes_returned", "local_reads", "local_bytes", "remote_reads",
                "remote_bytes", "refetched", "chunks_decoded", "errors", "decode_ns",
                "cache_hits", "cache_misses", "cache_bytes", "cache_budget",
                "served_requests", "served_bytes", "remote_failovers", "peers_marked_dead",
                "bytes_decoded", "chunks_redecoded", "spill_chunks", "spill_bytes",
                "spill_dropped", "spill_refused")
#: Prefetch mode's counters (fanstore.fuse.kernelfs.orders), from PREFETCH_COL0 on; every one is
#: summed over the workers except those of MAX_COLUMNS, which every worker copies alike.
PREFETCH_COLUMNS = ("prefetch_files", "prefetch_pushed", "prefetch_bytes_pushed",
                    "prefetch_push_refused", "prefetch_lookups_ahead", "prefetch_buffered",
                    "prefetch_served_from_buffer", "prefetch_late", "prefetch_missed",
                    "prefetch_read_after_push", "prefetch_bytes_evicted_unused",
                    "prefetch_errors", "prefetch_skipped", "prefetch_buffer_bytes",
                    "prefetch_window_bytes", "prefetch_orders", "prefetch_listings")
PREFETCH_COL0 = 120
MAX_COLUMNS = ("prefetch_window_bytes",)
#: More read-core counters, after the prefetch columns (the read columns are full).
MORE_COLUMNS = ("shared_hits",)
MORE_COL0 = 140

#: Every application column of a worker's row, by name.
COL: dict[str, int] = {
    **{name: APP_COL0 + i for i, name in enumerate(READ_COLUMNS)},
    **{name: PREFETCH_COL0 + i for i, name in enumerate(PREFETCH_COLUMNS)},
    **{name: MORE_COL0 + i for i, name in enumerate(MORE_COLUMNS)},
}
assert APP_COL0 + len(READ_COLUMNS) <= PREFETCH_COL0
assert PREFETCH_COL0 + len(PREFETCH_COLUMNS) <= MORE_COL0
assert MORE_COL0 + len(MORE_COLUMNS) <= COLS

# the columns RowPublisher writes after every request that read data (module constants:
# one cached global load each, where a dict lookup per column would cost more than the copy)
_READS, _BYTES_RETURNED = COL["reads"], COL["bytes_returned"]
_LOCAL_READS, _LOCAL_BYTES = COL["local_reads"], COL["local_bytes"]
_REMOTE_READS, _REMOTE_BYTES = COL["remote_reads"], COL["remote_bytes"]
_REFETCHED, _CHUNKS_DECODED = COL["refetched"], COL["chunks_decoded"]
_ERRORS, _DECODE_NS = COL["errors"], COL["decode_ns"]
_CACHE_HITS, _CACHE_MISSES = COL["cache_hits"], COL["cache_misses"]
_CACHE_BYTES, _CACHE_BUDGET = COL["cache_bytes"], COL["cache_budget"]
_SERVED_REQUESTS, _SERVED_BYTES = COL["served_requests"], COL["served_bytes"]
_FAILOVERS, _DEAD = COL["remote_failovers"], COL["peers_marked_dead"]
_BYTES_DECODED, _REDECODED = COL["bytes_decoded"], COL["chunks_redecoded"]
_SPILL_CHUNKS, _SPILL_BYTES = COL["spill_chunks"], COL["spill_bytes"]
_SPILL_DROPPED, _SPILL_REFUSED = COL["spill_dropped"], COL["spill_refused"]
_SHARED_HITS = COL["shared_hits"]


class RowPublisher:
    """Copies a worker's read counters (a plain :class:`~fanstore.read.ReadStats`, cheap to
    increment) into its row of the shared counters table (:data:`READ_COLUMNS`), where the
    daemon sums every worker's; called after each request that read data (a dozen 8-byte
    stores)."""

    def __init__(self, row, stats, cache, served=None) -> None:
        self.row = row
        self.stats = stats
        self.cache = cache
        self.served = served  # a worker rank's MPI transport: what it served other nodes

    def publish(self) -> None:
        s, c, row = self.stats, self.cache, self.row
        row[_READS] = s.reads
        row[_BYTES_RETURNED] = s.bytes_returned
        row[_LOCAL_READS] = s.local_reads
        row[_LOCAL_BYTES] = s.local_bytes
        row[_REMOTE_READS] = s.remote_reads
        row[_REMOTE_BYTES] = s.remote_bytes
        row[_REFETCHED] = s.refetched
        row[_CHUNKS_DECODED] = s.chunks_decoded
        row[_ERRORS] = s.errors
        row[_DECODE_NS] = int(s.decode_seconds * 1e9)
        row[_CACHE_HITS] = c.hits
        row[_CACHE_MISSES] = c.misses
        row[_CACHE_BYTES] = c.used
        row[_CACHE_BUDGET] = c.budget
        row[_FAILOVERS] = s.remote_failovers
        row[_DEAD] = s.peers_marked_dead
        row[_BYTES_DECODED] = s.bytes_decoded
        row[_REDECODED] = s.chunks_redecoded
        row[_SPILL_CHUNKS] = s.spill_chunks
        row[_SPILL_BYTES] = s.spill_bytes
        row[_SPILL_DROPPED] = s.spill_dropped
        row[_SPILL_REFUSED] = s.spill_refused
        row[_SHARED_HITS] = s.shared_hits
        if self.served is not None:
            self.publish_served()

    def publish_served(self) -> None:
        row, t = self.row, self.served
        row[_SERVED_REQUESTS] = t.served_requests
        row[_SERVED_BYTES] = t.served_bytes


def summed_stats(counters, prefetch: bool = False) -> dict[str, Any]:
    """What ``fanstore stats`` reports for the kernel frontend, from the shared table
    (with the prefetch counters in prefetch mode)."""
    sums = counters.column_sums()
    out: dict[str, Any] = {name: sums[COL[name]] for name in READ_COLUMNS + MORE_COLUMNS}
    if prefetch:
        for name in PREFETCH_COLUMNS:
            col = COL[name]
            out[name] = counters.column_max(col) if name in MAX_COLUMNS else sums[col]
    out["decode_seconds"] = round(out.pop("decode_ns") / 1e9, 6)
    out["decoded_per_returned"] = decoded_per_returned(out["bytes_decoded"],
                                                       out["bytes_returned"])
    out["refetched_from_replica"] = out.pop("refetched")
    out["worker_served_requests"] = out.pop("served_requests")
    out["worker_served_bytes"] = out.pop("served_bytes")
    out["requests"] = sum(sums[:OP_COLS])
    out["requests_by_op"] = counters.requests_by_op
    out["fuse_events"] = {k: v for k, v in counters.events.items()
                          if not k.startswith("event")}
    return out
