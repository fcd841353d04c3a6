"""The read core: one synchronous path from "bytes of a file" to checked, decoded bytes.

    reader = ChunkReader(index, source, cache_bytes)
    data = reader.read(entry, offset, size)

``get_chunks`` finds the chunks of a read that are not in the LRU, fetches their stored
bytes as ONE run (a file's chunks are contiguous in one partition), decodes and verifies
each (:class:`~fanstore.read.decode.Decoder`), re-reads them from a replica when the local
copy fails its checksum and another node holds the partition, and caches them. Every
frontend uses it: both FUSE frontends (the pyfuse3 one through a thin async wrapper that
adds in-flight de-duplication and the thread hop), the Python API, ``fanstore cat`` and
``fanstore verify``. Nothing here knows about trio, FUSE or MPI: the source decides where
bytes come from (:mod:`fanstore.read.sources`).

Thread-safe: the cache has its own lock and sources use pread or their own locking. Two
threads missing the same chunk at once may both decode it (the async layer de-duplicates
for the daemon; API readers are separate processes anyway).
"""

from __future__ import annotations

import logging
import time

from fanstore.errors import CorruptDataError, FanStoreError
from fanstore.format.index import Index
from fanstore.read.cache import ChunkCache
from fanstore.read.decode import Decoder, assemble, chunk_span
from fanstore.read.stats import ReadStats

log = logging.getLogger(__name__)


class ChunkReader:
    """Decoded, verified chunks and file byte ranges of one store, from one ChunkSource."""

    def __init__(self, index: Index, source, cache_bytes: int = 64 << 20,
                 stats: ReadStats | None = None, decoder: Decoder | None = None) -> None:
        self.index = index
        self.source = source
        self.decoder = decoder or Decoder(index)
        self.cache = ChunkCache(cache_bytes)
        self.stats = stats if stats is not None else ReadStats()
        self.chunk_size = index.chunk_size
        e = index.e
        self._first = e["first"]
        self._count = e["count"]
        self._size = e["size"]
        self._base = e.get("offset")  # format v2: where a file starts in a shared chunk

    # ------------------------------------------------------------------ geometry
    def span(self, entry: int) -> tuple[int, int, int, int]:
        """(first chunk, chunk count, offset of the file in its first chunk, size)."""
        base = int(self._base[entry]) if self._base is not None else 0
        return int(self._first[entry]), int(self._count[entry]), base, int(self._size[entry])

    def advise(self, entry: int) -> None:
        """Tell the source a file will be read soon (a local one's stored bytes are read
        ahead by the kernel: POSIX_FADV_WILLNEED)."""
        first, count, _, _ = self.span(entry)
        advise = getattr(self.source, "advise", None)
        if count and advise is not None:
            advise(*self.decoder.run_extent(first, count))

    def is_local(self, entry: int) -> bool:
        first, count, _, _ = self.span(entry)
        return count == 0 or self.source.is_local(int(self.index.c["part"][first]))

    # ------------------------------------------------------------------ chunks
    def load(self, entry: int, a: int, b: int) -> list[bytes]:
        """Fetch, decode and verify chunks a..b-1 of ``entry`` (no cache). A damaged local
        copy is read again from another node's replica when there is one."""
        decoder, source, stats = self.decoder, self.source, self.stats
        part, off, length = decoder.run_extent(a, b - a)
        if source.is_local(part):
            blob = source.fetch(part, off, length, entry)
            stats.local_reads += 1
            stats.local_bytes += length
            t = time.perf_counter()
            try:
                out = decoder.decode_run(a, b - a, blob, entry)
            except CorruptDataError as exc:
                other = source.fallback(part)
                if other is None:
                    raise
                log.warning("%s; reading it from a replica", exc)
                stats.refetched += 1
                source = other
            else:
                stats.decode_seconds += time.perf_counter() - t
                stats.chunks_decoded += b - a
                return out
        t0 = time.perf_counter()
        blob = source.fetch(part, off, length, entry)
        stats.remote_latency.append(time.perf_counter() - t0)
        stats.remote_reads += 1
        stats.remote_bytes += length
        t = time.perf_counter()
        out = decoder.decode_run(a, b - a, blob, entry)
        stats.decode_seconds += time.perf_counter() - t
        stats.chunks_decoded += b - a
        return out

    def get_chunks(self, entry: int, a: int, b: int, counted: bool = True,
                   keep: bool = True) -> list[bytes]:
        """Decoded chunks a..b-1 of ``entry``: cached ones from the LRU, the missing ones
        loaded as one run. ``counted``: count cache hits/misses; ``keep``: cache the result."""
        cache = self.cache
        if b - a == 1:  # the common case: one chunk (a small file, or one READ of a big one)
            data = cache.get(a, counted)
            if data is None:
                try:
                    data = self.load(entry, a, b)[0]
                except FanStoreError:
                    self.stats.errors += 1
                    raise
                if keep:
                    cache.put(a, data)
            return [data]
        out = [cache.get(k, counted) for k in range(a, b)]
        missing = [a + i for i, v in enumerate(out) if v is None]
        if missing:
            lo, hi = missing[0], missing[-1] + 1
            try:
                decoded = self.load(entry, lo, hi)
            except FanStoreError:
                self.stats.errors += 1  # the frontend that answers the reader logs it
                raise
            for k, data in zip(range(lo, hi), decoded):
                out[k - a] = data
                if keep:
                    cache.put(k, data)
        return out  # type: ignore[return-value]

    # ------------------------------------------------------------------ files
    def read(self, entry: int, offset: int = 0, size: int = -1, keep_whole: bool = True):
        """Bytes [offset, offset+size) of a file, short at EOF (a bytes-like object; a view
        into a cached chunk when one chunk covers the read).

        ``keep_whole=False``: a read of a whole file does not put its chunks into the LRU
        (a FUSE frontend whose reads land in the kernel's page cache would only hold a
        second copy); reads of part of a file still do, for the rest of that chunk.
        """
        first, _count, base, file_size = self.span(entry)
        if size < 0:
            size = file_size
        lo, hi, end = chunk_span(offset, size, file_size, self.chunk_size, base)
        if hi == lo:
            return b""
        keep = keep_whole or offset != 0 or end != file_size
        chunks = self.get_chunks(entry, first + lo, first + hi, keep=keep)
        return assemble(chunks, lo, offset, end, self.chunk_size, base)

    def read_files(self, entries: list[int]) -> list:
        """Whole files (bytes-like, checked) of several entries, each or the FanStoreError
        it got; the stored bytes of those held by other nodes fetched together (one
        exchange per holder, ``source.fetch_many``) rather than one round trip each. Files
        of several chunks, and a damaged local chunk, go the one-file way."""
        many = getattr(self.source, "fetch_many", None)
        out: list = [None] * len(entries)
        batch, items = [], []
        for i, entry in enumerate(entries):
            first, count, _base, _size = self.span(entry)
            if count == 1 and many is not None and not self.source.is_local(
                    int(self.index.c["part"][first])):
                part, off, length = self.decoder.run_extent(first, 1)
                batch.append(i)
                items.append((part, off, length, entry))
        blobs = many(items) if items else []
        stats = self.stats
        for i, blob in zip(batch, blobs):
            entry = entries[i]
            if isinstance(blob, Exception):
                stats.errors += 1
                out[i] = blob
                continue
            first, _count, base, size = self.span(entry)
            stats.remote_reads += 1
            stats.remote_bytes += len(blob)
            t = time.perf_counter()
            try:
                chunk = self.decoder.decode_run(first, 1, blob, entry)[0]
            except FanStoreError as exc:
                stats.errors += 1
                out[i] = exc
                continue
            stats.decode_seconds += time.perf_counter() - t
            stats.chunks_decoded += 1
            out[i] = memoryview(chunk)[base:base + size] if base or len(chunk) != size \
                else chunk
        for i, entry in enumerate(entries):
            if out[i] is None:
                try:
                    out[i] = self.read(entry, keep_whole=False)
                except FanStoreError as exc:
                    out[i] = exc
        return out

    def read_all(self, entry: int) -> bytes:
        """A whole file as bytes, checked."""
        return bytes(self.read(entry))

    def iter_file(self, entry: int, keep: bool = True):
        """A file's bytes one chunk at a time (bounded memory for huge files)."""
        first, count, base, size = self.span(entry)
        left = size
        for k in range(first, first + count):
            data = self.get_chunks(entry, k, k + 1, keep=keep)[0]
            if k == first and base:
                data = memoryview(data)[base:]
            if len(data) > left:
                data = memoryview(data)[:left]
            left -= len(data)
            yield data

    def after_fork(self) -> None:
        self.cache.after_fork()
