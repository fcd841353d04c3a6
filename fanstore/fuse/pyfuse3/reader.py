"""The read core on a trio loop, for the pyfuse3 frontend: in-flight de-duplication and the
thread hop, nothing else.

``AsyncReader.read(entry, offset, size)`` runs on the trio loop and never blocks it: cache
hits are answered inline; misses run :meth:`ChunkReader.load` (fetch + decode + verify +
re-read from a replica) in worker threads bounded by a ``trio.CapacityLimiter`` (codecs
release the GIL, so threads give real parallelism). Loads of chunks held by other nodes
mostly wait on the network: they get a limiter of their own. Everything else is the read
core's: which chunks a read needs and the bytes cut from them (``ChunkReader.request``,
``cut``, ``answered``: the request counted there), the chunk LRU, the counters.

Concurrency protocol (every ``await`` is a point where other requests run):
- ``_inflight`` maps a chunk to the ``_Pending`` load that is producing it. A reader that
  finds its chunk in flight waits on that load's event instead of loading it again; so
  each chunk is fetched and decoded once however many readers want it at the same time.
- Waiters take the bytes from the load's own result, not from the cache, so a tiny cache
  cannot make them load again; a failed load hands its error to its waiters and is logged
  once. A later read tries again.
"""

from __future__ import annotations

import logging

import trio

from fanstore.errors import FanStoreError
from fanstore.read import ChunkReader

log = logging.getLogger(__name__)


class _Pending:
    """One load in flight: the chunks it produces, or the error it hit."""

    __slots__ = ("error", "event", "result")

    def __init__(self) -> None:
        self.event = trio.Event()
        self.result: dict[int, bytes] = {}
        self.error: FanStoreError | None = None


class AsyncReader:
    """Async file reads over a :class:`ChunkReader` (``reader.source`` says what is local)."""

    def __init__(self, ns, reader: ChunkReader, threads: int = 4,
                 remote_threads: int = 16) -> None:
        self.ns = ns
        self.reader = reader
        self.cache = reader.cache
        self.stats = reader.stats
        self._local_limiter = trio.CapacityLimiter(max(1, threads))
        self._remote_limiter = trio.CapacityLimiter(max(1, remote_threads))
        self._inflight: dict[int, _Pending] = {}

    async def read(self, entry: int, offset: int, size: int):
        """Bytes [offset, offset+size) of a file (short at EOF), a reader's request (counted
        by the read core). Raises FanStoreError."""
        reader = self.reader
        a, b, end = reader.request(entry, offset, size)
        if a == b:
            return reader.answered(b"")
        chunks = await self.get_chunks(entry, a, b)
        return reader.answered(reader.cut(entry, chunks, a, offset, end))

    async def get_chunks(self, entry: int, a: int, b: int, counted: bool = True,
                         keep: bool = True) -> list[bytes]:
        """Decoded chunks a..b-1 of one file, each loaded at most once at a time.

        ``counted``: a reader's request (cache hits and misses are counted);
        ``keep``: put what was loaded into the LRU (the prefetcher keeps its own buffer).
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
            local = self.reader.is_local(entry)
            try:
                decoded = await trio.to_thread.run_sync(
                    self.reader.load, entry, lo, hi,
                    limiter=self._local_limiter if local else self._remote_limiter)
            except FanStoreError as exc:
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
