"""The read core: one synchronous path from "bytes of a file" to checked, decoded bytes.

    reader = ChunkReader(index, source, cache_bytes)
    data = reader.serve(entry, offset, size)     # a reader's request: counted
    data = reader.read(entry, offset, size)      # the same bytes, not counted (prefetch...)

``get_chunks`` finds the chunks of a read that are not in the LRU, fetches their stored
bytes as ONE run (a file's chunks are contiguous in one partition), decodes and verifies
each (:class:`~fanstore.read.decode.Decoder`), re-reads them from a replica when the local
copy fails its checksum and another node holds the partition, and caches them. Every
frontend uses it: both FUSE frontends (the pyfuse3 one through a thin async wrapper that
adds in-flight de-duplication and the thread hop), the Python API, ``fanstore cat`` and
``fanstore verify``. Nothing here knows about trio, FUSE or MPI: the source decides where
bytes come from (:mod:`fanstore.read.sources`).

Counting: a reader's request is counted here, once for every frontend (``stats.reads`` when
asked, ``stats.bytes_returned`` when answered): :meth:`ChunkReader.serve`, or its two halves
:meth:`~ChunkReader.request` and :meth:`~ChunkReader.answered` for a caller that loads the
chunks itself. Loads, decodes and failures are counted where they happen (:meth:`load`).

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
from fanstore.read.shared import WAIT as SHARED_WAIT
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
        #: fanstore.read.shared.SharedChunks: chunks of partial reads, shared with the
        #: node's other reader processes (the kernel frontend's workers), or None
        self.shared = None
        self.chunk_size = index.chunk_size
        e = index.entries
        self._first = e["first"]
        self._raw = index.chunks["raw"]  # decoded size of each chunk
        self._count = e["count"]
        self._size = e["size"]
        self._base = e.get("offset")  # format v2: where a file starts in a shared chunk
        self._seen = bytearray(len(self._raw))  # chunks this process has decoded

    # ------------------------------------------------------------------ geometry
    def span(self, entry: int) -> tuple[int, int, int, int]:
        """(first chunk, chunk count, offset of the file in its first chunk, size)."""
        base = int(self._base[entry]) if self._base is not None else 0
        return int(self._first[entry]), int(self._count[entry]), base, int(self._size[entry])

    def locate(self, entry: int, offset: int = 0, size: int = -1) -> tuple[int, int, int]:
        """(a, b, end): bytes [offset, end) of a file (``size`` < 0: to its end; ``end``
        short at EOF) lie in the store's chunks a..b-1 (a == b: nothing to read)."""
        first, lo, hi, end, _base, _size = self._where(entry, offset, size)
        return first + lo, first + hi, end

    def _where(self, entry: int, offset: int, size: int) -> tuple[int, int, int, int, int, int]:
        """(first chunk, lo, hi, end, base, file size): the read's chunks are first+lo ..
        first+hi-1 (:func:`~fanstore.read.decode.chunk_span`)."""
        first, _count, base, file_size = self.span(entry)
        lo, hi, end = chunk_span(offset, file_size if size < 0 else size, file_size,
                                 self.chunk_size, base)
        return first, lo, hi, end, base, file_size

    def cut(self, entry: int, chunks: list, a: int, offset: int, end: int):
        """Bytes [offset, end) of a file from its decoded chunks a.. (as :meth:`locate`
        named them): a view into the chunk when one chunk covers them."""
        first = int(self._first[entry])
        base = int(self._base[entry]) if self._base is not None else 0
        return assemble(chunks, a - first, offset, end, self.chunk_size, base)

    def advise(self, entry: int) -> None:
        """Tell the source a file will be read soon (a local one's stored bytes are read
        ahead by the kernel: POSIX_FADV_WILLNEED)."""
        first, count, _, _ = self.span(entry)
        advise = getattr(self.source, "advise", None)
        if count and advise is not None:
            advise(*self.decoder.run_extent(first, count))

    def is_local(self, entry: int) -> bool:
        first, count, _, _ = self.span(entry)
        return count == 0 or self.source.is_local(int(self.index.chunks["part"][first]))

    # ------------------------------------------------------------------ chunks
    def load(self, entry: int, a: int, b: int) -> list[bytes]:
        """Fetch, decode and verify chunks a..b-1 of ``entry`` (no cache). A damaged local
        copy is read again from another node's replica when there is one. A failure is
        counted (``stats.errors``) and raised."""
        try:
            return self._load(entry, a, b)
        except FanStoreError:
            self.stats.errors += 1  # the frontend that answers the reader logs it
            raise

    def _load(self, entry: int, a: int, b: int) -> list[bytes]:
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
                self._count_decoded(a, b, out)
                return out
        t0 = time.perf_counter()
        blob = source.fetch(part, off, length, entry)
        stats.remote_latency.append(time.perf_counter() - t0)
        stats.remote_reads += 1
        stats.remote_bytes += length
        t = time.perf_counter()
        out = decoder.decode_run(a, b - a, blob, entry)
        stats.decode_seconds += time.perf_counter() - t
        self._count_decoded(a, b, out)
        return out

    def _count_decoded(self, a: int, b: int, out: list) -> None:
        """Chunks and bytes decoded, and the chunks this process had decoded before."""
        stats, seen = self.stats, self._seen
        stats.chunks_decoded += b - a
        stats.bytes_decoded += sum(len(x) for x in out)
        for k in range(a, b):
            if seen[k]:
                stats.chunks_redecoded += 1
            else:
                seen[k] = 1

    def get_chunks(self, entry: int, a: int, b: int, counted: bool = True,
                   keep: bool = True, share: bool = False) -> list[bytes]:
        """Decoded chunks a..b-1 of ``entry``: cached ones from the LRU, the missing ones
        loaded as one run. ``counted``: count cache hits/misses; ``keep``: cache the result;
        ``share``: look in, and publish to, the node's shared chunks (:attr:`shared`)."""
        cache = self.cache
        if b - a == 1:  # the common case: one chunk (a small file, or one READ of a big one)
            data = cache.get(a, counted)
            if data is None:
                shared = self.shared if share else None
                if shared is not None:
                    data = shared.get(a, self.decoder.checksum(a), SHARED_WAIT)
                    if data is not None:
                        self.stats.shared_hits += 1
                if data is None:
                    row = shared.claim(a) if shared is not None else None
                    try:
                        data = self.load(entry, a, b)[0]
                    except BaseException:
                        if row is not None:
                            shared.abandon(row)
                        raise
                    if row is not None:
                        shared.fill(row, data)
                if keep:
                    cache.put(a, data)
            return [data]
        out = [cache.get(k, counted) for k in range(a, b)]
        missing = [a + i for i, v in enumerate(out) if v is None]
        if missing:
            lo, hi = missing[0], missing[-1] + 1
            decoded = self.load(entry, lo, hi)
            for k, data in zip(range(lo, hi), decoded):
                out[k - a] = data
                if keep:
                    cache.put(k, data)
        return out  # type: ignore[return-value]

    # ------------------------------------------------------------------ a reader's requests
    def serve(self, entry: int, offset: int = 0, size: int = -1, keep_whole: bool = True,
              first=None, spill=None):
        """A reader's request for bytes [offset, offset+size) of a file (:meth:`read`),
        counted: ``stats.reads`` when asked, ``stats.bytes_returned`` when answered.

        ``first(entry, offset, size)``, when given, may answer before the read core does
        (a prefetch buffer; the page cache through the mount) by returning the bytes, or
        None. Every frontend answers its readers through this (or :meth:`request` and
        :meth:`answered`); none counts by itself. ``spill``: see :meth:`read`.
        """
        self.stats.reads += 1
        data = None if first is None else first(entry, offset, size)
        if data is None:
            data = self.read(entry, offset, size, keep_whole, spill)
        return self.answered(data)

    def request(self, entry: int, offset: int, size: int) -> tuple[int, int, int]:
        """The first half of :meth:`serve`, for a caller that loads the chunks itself (the
        pyfuse3 frontend, in worker threads): the request counted, and :meth:`locate`."""
        self.stats.reads += 1
        return self.locate(entry, offset, size)

    def answered(self, data):
        """The second half of :meth:`serve`: ``data``, the request's answer, counted."""
        self.stats.bytes_returned += len(data)
        return data

    # ------------------------------------------------------------------ files
    def read(self, entry: int, offset: int = 0, size: int = -1, keep_whole: bool = True,
             spill=None):
        """Bytes [offset, offset+size) of a file, short at EOF (a bytes-like object; a view
        into a cached chunk when one chunk covers the read). Not counted as a reader's
        request (:meth:`serve` is).

        ``keep_whole=False``: a read of a whole file does not put its chunks into the LRU
        (a FUSE frontend whose reads land in the kernel's page cache would only hold a
        second copy); reads of part of a file still do, for the rest of that chunk, and so
        does a whole file that shares its chunk (a solid block: its neighbours are read
        from the same decoded block).

        ``spill(entry, chunk_offset, chunk, offset, end)``, when given, is handed each
        decoded chunk of a read of part of a file, when the chunk is the file's own (not a
        solid block shared with others): the kernel frontend pushes the rest of it into the
        page cache (:mod:`fanstore.fuse.kernelfs.spill`).
        """
        first, lo, hi, end, base, file_size = self._where(entry, offset, size)
        if hi == lo:
            return b""
        partial = offset != 0 or end != file_size
        keep = (keep_whole or partial or base != 0
                or int(self._raw[first]) != file_size and hi - lo == 1)
        own = partial and base == 0 and (int(self._count[entry]) > 1
                                         or int(self._raw[first]) == file_size)
        if own and spill is not None and self.shared is not None:
            keep = False  # the page cache gets it (spill), the node's workers the table
        chunks = self.get_chunks(entry, first + lo, first + hi, keep=keep, share=own)
        if spill is not None and own:
            for i, chunk in enumerate(chunks):
                spill(entry, (lo + i) * self.chunk_size, chunk, offset, end)
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
                    int(self.index.chunks["part"][first])):
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
