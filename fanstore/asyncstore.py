"""The daemon's read path: decoded-chunk cache, one fetch per chunk, work off the trio loop.

``ChunkStore.read(entry, offset, size)`` runs on the trio loop and never blocks it: cache
hits are answered inline; misses run ``fetch + decode + verify`` in worker threads bounded
by a ``trio.CapacityLimiter`` (codecs release the GIL, so threads give real parallelism).
Remote fetches wait in threads of their own limiter (they mostly sleep), then decode in the
decode pool.

Concurrency protocol (every ``await`` is a point where other requests run):
- ``_inflight`` maps a chunk to the ``_Pending`` fetch that is producing it. A reader that
  finds its chunk in flight waits on that fetch's event instead of fetching it again; so
  each chunk is fetched and decoded once however many readers want it at the same time.
- The cache is touched only from the trio thread, so it needs no lock.
- Waiters take the bytes from the fetch's own result, not from the cache, so a tiny cache
  cannot make them fetch again; a failed fetch hands its error to its waiters and is
  counted once in ``errors``. A later read tries again.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import trio

from fanstore.errors import CorruptDataError, FanStoreError
from fanstore.store import ChunkCache, Decoder, assemble, chunk_span, file_bytes

log = logging.getLogger(__name__)


@dataclass
class Stats:
    """This node's counters, as ``fanstore stats`` prints them."""

    opens: int = 0
    reads: int = 0
    bytes_returned: int = 0
    local_reads: int = 0
    remote_reads: int = 0
    remote_bytes: int = 0  # compressed bytes received from peers
    local_bytes: int = 0  # stored bytes read from local partitions
    decode_seconds: float = 0.0
    chunks_decoded: int = 0
    errors: int = 0
    remote_failovers: int = 0
    refetched: int = 0  # local chunks that failed their checksum, read again from a replica
    remote_latency: deque = field(default_factory=lambda: deque(maxlen=20000))
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self, cache: ChunkCache | None = None) -> dict[str, Any]:
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
            "refetched_from_replica": self.refetched,
            "remote_latency_ms_p50": pct(0.50),
            "remote_latency_ms_p99": pct(0.99),
            "decode_seconds": round(self.decode_seconds, 6),
            "chunks_decoded": self.chunks_decoded,
            "errors": self.errors,
        }
        for key, value in self.extra.items():
            out[key] = value() if callable(value) else value
        return out


class _Pending:
    """One fetch in flight: the chunks it produces, or the error it hit."""

    __slots__ = ("event", "result", "error")

    def __init__(self) -> None:
        self.event = trio.Event()
        self.result: dict[int, bytes] = {}
        self.error: FanStoreError | None = None


class ChunkStore:
    """Async reads of file byte ranges for the FUSE layer.

    ``source`` provides ``fetch(part, offset, length)`` and ``is_local(part)``; remote
    sources also ``fetch_remote(part, offset, length)`` (blocking, bounded by a timeout).
    """

    def __init__(
        self,
        ns,
        decoder: Decoder,
        source,
        cache_bytes: int,
        threads: int = 4,
        remote_threads: int = 16,
        stats: Stats | None = None,
    ) -> None:
        self.ns = ns
        self.decoder = decoder
        self.source = source
        self.chunk_size = decoder.index.chunk_size
        self.cache = ChunkCache(cache_bytes)
        self.stats = stats or Stats()
        self._decode_limiter = trio.CapacityLimiter(max(1, threads))
        self._remote_limiter = trio.CapacityLimiter(max(1, remote_threads))
        self._inflight: dict[int, _Pending] = {}
        self._nursery: trio.Nursery | None = None
        self.prefetcher = None  # fanstore.prefetch.Prefetcher in prefetch mode

    def start(self, nursery: trio.Nursery) -> None:
        """Give the store a nursery for background work (the prefetcher); without one it
        only answers reads."""
        self._nursery = nursery
        if self.prefetcher is not None:
            nursery.start_soon(self.prefetcher.run)

    async def read(self, entry: int, offset: int, size: int):
        """Bytes [offset, offset+size) of a file (short at EOF). Raises FanStoreError."""
        self.stats.reads += 1
        file_size = self.ns.size(entry)
        base = self.ns.data_offset(entry)
        lo, hi, end = chunk_span(offset, size, file_size, self.chunk_size, base)
        if hi == lo:
            return b""
        first, count = self.ns.chunks(entry)
        if self.prefetcher is not None and lo == 0:
            ready = self.prefetcher.take(entry)
            if ready is not None:
                for k, data in zip(range(first, first + count), ready):
                    self.cache.put(k, data)
                if hi == 1 and not self.cache.peek(first):  # too big for the LRU: serve it
                    data = assemble(ready[:1], 0, offset, end, self.chunk_size, base)
                    self.stats.bytes_returned += len(data)
                    return data
        chunks = await self.get_chunks(entry, first + lo, first + hi)
        data = assemble(chunks, lo, offset, end, self.chunk_size, base)
        self.stats.bytes_returned += len(data)
        return data

    async def get_chunks(self, entry: int, a: int, b: int, counted: bool = True,
                         keep: bool = True) -> list[bytes]:
        """Decoded chunks a..b-1 of one file, each fetched at most once at a time.

        ``counted``: a reader's request (cache hits and misses are counted);
        ``keep``: put what was fetched into the LRU (the prefetcher keeps its own buffer).
        """
        out: list[bytes | None] = [self.cache.get(k, counted) for k in range(a, b)]
        missing = [a + i for i, v in enumerate(out) if v is None]
        if not missing:
            return out  # type: ignore[return-value]
        waits = [(k, self._inflight[k]) for k in missing if k in self._inflight]
        mine = [k for k in missing if k not in self._inflight]
        if mine:
            lo, hi = mine[0], mine[-1] + 1
            pending = _Pending()
            owned = [k for k in range(lo, hi) if k not in self._inflight]
            for k in owned:
                self._inflight[k] = pending
            try:
                decoded = await self._load(entry, lo, hi)
            except FanStoreError as exc:
                self.stats.errors += 1
                log.error("%s", exc)
                pending.error = exc
                raise
            else:
                pending.result = dict(zip(range(lo, hi), decoded))
                if keep:
                    for k, data in pending.result.items():
                        self.cache.put(k, data)
            finally:
                for k in owned:
                    del self._inflight[k]
                pending.event.set()
            for k in mine:
                out[k - a] = pending.result[k]
        for k, pending in waits:
            await pending.event.wait()
            if pending.error is not None:
                raise type(pending.error)(str(pending.error))
            out[k - a] = pending.result[k]
            if keep and not self.cache.peek(k):
                self.cache.put(k, pending.result[k])
        return out  # type: ignore[return-value]

    async def fetch_for_api(self, entry: int) -> tuple[str, bytes]:
        """A whole file for the Python API: ``("raw", bytes)`` when its decoded chunks are at
        hand (prefetch buffer, LRU), else ``("stored", bytes)``: the still-compressed run,
        fetched locally or from a peer, for the caller to decode and verify."""
        self.stats.reads += 1
        first, count = self.ns.chunks(entry)
        if count == 0:
            return "raw", b""
        chunks = self.prefetcher.take(entry) if self.prefetcher is not None else None
        if chunks is None:
            cached = [self.cache.get(k) for k in range(first, first + count)]
            if all(c is not None for c in cached):
                chunks = cached
        if chunks is not None:
            data = bytes(file_bytes(chunks, self.ns.data_offset(entry), self.ns.size(entry)))
            self.stats.bytes_returned += len(data)
            return "raw", data
        part, off, length = self.decoder.run_extent(first, count)
        if self.source.is_local(part):
            blob = await trio.to_thread.run_sync(self.source.fetch, part, off, length,
                                                 limiter=self._decode_limiter)
            self.stats.local_reads += 1
            self.stats.local_bytes += length
        else:
            t0 = time.perf_counter()
            blob = await trio.to_thread.run_sync(self.source.fetch_remote, part, off, length,
                                                 entry, limiter=self._remote_limiter)
            self.stats.remote_latency.append(time.perf_counter() - t0)
            self.stats.remote_reads += 1
            self.stats.remote_bytes += len(blob)
        self.stats.bytes_returned += int(self.ns.size(entry))
        return "stored", bytes(blob)

    async def _load(self, entry: int, a: int, b: int) -> list[bytes]:
        part, off, length = self.decoder.run_extent(a, b - a)
        source = self.source
        stats = self.stats
        remote = not source.is_local(part)
        if not remote:

            def work():
                blob = source.fetch(part, off, length)
                t = time.perf_counter()
                out = self.decoder.decode_run(a, b - a, blob, entry)
                return out, time.perf_counter() - t

            stats.local_reads += 1
            stats.local_bytes += length
            try:
                decoded, secs = await trio.to_thread.run_sync(work,
                                                              limiter=self._decode_limiter)
            except CorruptDataError as exc:
                # Bit rot in the local copy: a peer holding a replica has good bytes.
                if not getattr(source, "has_replica_elsewhere", lambda p: False)(part):
                    raise
                log.warning("%s; fetching it from a replica", exc)
                stats.refetched += 1
                remote = True
        if remote:
            t0 = time.perf_counter()
            blob = await trio.to_thread.run_sync(
                source.fetch_remote, part, off, length, entry, limiter=self._remote_limiter
            )
            stats.remote_latency.append(time.perf_counter() - t0)
            stats.remote_reads += 1
            stats.remote_bytes += len(blob)

            def decode():
                t = time.perf_counter()
                out = self.decoder.decode_run(a, b - a, blob, entry)
                return out, time.perf_counter() - t

            decoded, secs = await trio.to_thread.run_sync(decode, limiter=self._decode_limiter)
        stats.decode_seconds += secs
        stats.chunks_decoded += b - a
        return decoded
