"""Synchronous data access: partition files, chunk decoding with checksums, an LRU of chunks.

Used by the FUSE daemon (through :mod:`fanstore.asyncstore`, which runs these calls in worker
threads), by the Python API and by ``fanstore verify/cat``. Nothing here knows about trio,
FUSE or MPI.

Where bytes come from is a :class:`BlobSource`: ``fetch(part, offset, length) -> bytes``.
:class:`LocalPartitions` reads partition files with ``pread``; the MPI layer provides one that
fetches from peers. Every decoded chunk is checked against the XXH3-64 of its original bytes
before anyone sees it: a mismatch is a :class:`CorruptDataError` for that file only.
"""

from __future__ import annotations

import logging
import os
import stat
import threading
from collections import OrderedDict
from typing import Protocol

import xxhash

from compressors import CodecError, get_codec
from fanstore.errors import CorruptDataError, FormatError, IsADirectoryError_, NotFoundError
from fanstore.format.index import KIND_DIR, KIND_FILE, Index, read_index
from fanstore.format.partition import PARTITION_HEADER_SIZE, partition_name, read_partition_header
from fanstore.namespace import Namespace

log = logging.getLogger(__name__)


class BlobSource(Protocol):
    def fetch(self, part: int, offset: int, length: int) -> bytes: ...


class LocalPartitions:
    """Read-only access to partition files in one directory (a store or a staging dir).

    ``numbers`` limits which partitions are opened (a rank opens only its own). Each file's
    size and header are checked against the index on open, so a truncated or foreign
    partition is refused up front. Safe to use from many threads and after ``fork``
    (``pread`` has no shared file offset).
    """

    def __init__(self, directory: str, index: Index, numbers=None) -> None:
        self.directory = directory
        self._fds: dict[int, int] = {}
        self._sizes = {p.number: p.size for p in index.partitions}
        wanted = range(len(index.partitions)) if numbers is None else sorted(set(numbers))
        try:
            for n in wanted:
                self._fds[n] = self._open(n, index)
        except BaseException:
            self.close()
            raise

    def _open(self, n: int, index: Index) -> int:
        name = partition_name(n)
        path = os.path.join(self.directory, name)
        try:
            # O_NONBLOCK: opening a FIFO in a partition's place must not block the reader
            # (it is refused below); regular files ignore the flag.
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except FileNotFoundError:
            raise FormatError(f"{self.directory}: partition {name} is missing") from None
        except OSError as exc:
            raise FormatError(f"{path}: cannot open partition: {exc.strerror}") from exc
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise FormatError(f"{path}: partition is not a regular file")
            size = st.st_size
            expected = index.partitions[n].size
            if size != expected:
                raise FormatError(
                    f"{path}: partition is {'truncated' if size < expected else 'too long'} "
                    f"({size} bytes, the index says {expected})"
                )
            number = read_partition_header(os.pread(fd, PARTITION_HEADER_SIZE, 0), path)
            if number != n:
                raise FormatError(f"{path}: header says partition {number}, expected {n}")
        except BaseException:
            os.close(fd)
            raise
        return fd

    @property
    def numbers(self) -> list[int]:
        return sorted(self._fds)

    def has(self, part: int) -> bool:
        return part in self._fds

    is_local = has

    def size_of(self, part: int) -> int:
        return self._sizes[part]

    def read_into(self, part: int, offset: int, view: memoryview) -> None:
        """Fill ``view`` with the partition's bytes at ``offset`` (no intermediate copy)."""
        fd = self._fds.get(part)
        if fd is None:
            raise FormatError(f"partition {part} is not available here")
        got = 0
        while got < len(view):
            n = os.preadv(fd, [view[got:]], offset + got)
            if n <= 0:
                raise CorruptDataError(
                    f"partition {part}: short read at offset {offset + got}")
            got += n

    def fetch(self, part: int, offset: int, length: int) -> bytes:
        fd = self._fds.get(part)
        if fd is None:
            raise FormatError(f"partition {part} is not available here")
        data = os.pread(fd, length, offset)
        if len(data) == length:
            return data
        parts = [data]
        got = len(data)
        while got < length:
            more = os.pread(fd, length - got, offset + got)
            if not more:
                raise CorruptDataError(
                    f"partition {part}: short read at offset {offset} ({got} of {length} bytes)"
                )
            parts.append(more)
            got += len(more)
        return b"".join(parts)

    def close(self) -> None:
        fds, self._fds = self._fds, {}
        for fd in fds.values():
            try:
                os.close(fd)
            except OSError:
                pass


class Decoder:
    """Decodes and verifies chunks with the codec recorded for each chunk in the index."""

    def __init__(self, index: Index) -> None:
        self.index = index
        self._raw = index.c["raw"]
        self._stored = index.c["stored"]
        self._codec = index.c["codec"]
        self._sum = index.c["checksum"]
        self._part = index.c["part"]
        self._offset = index.c["offset"]
        try:
            self.codecs = [get_codec(cfg) for cfg in index.codecs]
        except CodecError as exc:
            raise FormatError(f"the store needs a codec this installation lacks: {exc}") from exc

    def run_extent(self, first: int, count: int) -> tuple[int, int, int]:
        """(partition, offset, length) of the stored bytes of chunks [first, first+count)."""
        length = int(self._stored[first : first + count].sum())
        return int(self._part[first]), int(self._offset[first]), length

    def decode(self, chunk: int, stored, entry: int | None = None) -> bytes:
        raw_size = int(self._raw[chunk])
        codec = self.codecs[int(self._codec[chunk])]
        try:
            raw = codec.decode(stored, raw_size)
        except CodecError as exc:
            raise CorruptDataError(self._where(chunk, entry, f"cannot be decoded ({exc})")) \
                from exc
        if xxhash.xxh3_64_intdigest(raw) != int(self._sum[chunk]):
            raise CorruptDataError(self._where(chunk, entry, "fails its checksum"))
        return raw

    def decode_run(self, first: int, count: int, blob, entry: int | None = None) -> list[bytes]:
        """Split a fetched run of stored chunks and decode each."""
        if len(blob) != int(self._stored[first : first + count].sum()):
            raise CorruptDataError(self._where(first, entry, "was fetched with the wrong length"))
        out = []
        view = memoryview(blob)
        pos = 0
        for k in range(first, first + count):
            n = int(self._stored[k])
            out.append(self.decode(k, view[pos : pos + n], entry))
            pos += n
        return out

    def _where(self, chunk: int, entry: int | None, what: str) -> str:
        where = f"partition {int(self._part[chunk])} offset {int(self._offset[chunk])}"
        name = os.fsdecode(self.index.path(entry)) if entry is not None else f"chunk {chunk}"
        return f"{name}: data {what} ({where})"


class ChunkCache:
    """LRU of decoded chunks with a byte budget. Not thread-safe: one owner (or a lock)."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.used = 0
        self._d: OrderedDict[int, bytes] = OrderedDict()
        self.hits = 0
        self.misses = 0

    def get(self, key: int, count: bool = True) -> bytes | None:
        v = self._d.get(key)
        if v is None:
            if count:
                self.misses += 1
            return None
        self._d.move_to_end(key)
        if count:
            self.hits += 1
        return v

    def peek(self, key: int) -> bool:
        return key in self._d

    def put(self, key: int, value: bytes) -> None:
        n = len(value)
        if n > self.budget:
            return
        old = self._d.pop(key, None)
        if old is not None:
            self.used -= len(old)
        self._d[key] = value
        self.used += n
        while self.used > self.budget:
            _, v = self._d.popitem(last=False)
            self.used -= len(v)

    def clear(self) -> None:
        self._d.clear()
        self.used = 0

    def __len__(self) -> int:
        return len(self._d)


def chunk_span(offset: int, size: int, file_size: int, chunk_size: int,
               base: int = 0) -> tuple[int, int, int]:
    """Chunks touched by a read: (first relative chunk, end relative chunk, end byte).

    ``base`` is the file's data offset in its first chunk (``Namespace.data_offset``: 0
    unless the file lives in a solid chunk): byte p of a file is byte ``(base + p) %
    chunk_size`` of its relative chunk ``(base + p) // chunk_size``.
    """
    end = min(offset + size, file_size)
    if offset >= end:
        return 0, 0, offset
    return (base + offset) // chunk_size, (base + end - 1) // chunk_size + 1, end


def assemble(chunks: list[bytes], lo: int, offset: int, end: int, chunk_size: int,
             base: int = 0):
    """The bytes [offset, end) of a file from its decoded chunks lo.. (a zero-copy view when
    one chunk covers the read); ``base`` as in :func:`chunk_span`."""
    start = base + offset - lo * chunk_size
    if len(chunks) == 1:
        c = chunks[0]
        if start == 0 and end - offset == len(c):
            return c
        return memoryview(c)[start : start + end - offset]
    joined = b"".join(chunks)
    return memoryview(joined)[start : start + end - offset]


def file_bytes(chunks: list[bytes], base: int, size: int):
    """A whole file from all its decoded chunks (its data starts at ``base``): the chunk
    itself when the file is exactly one chunk, else a view of the file's bytes."""
    joined = chunks[0] if len(chunks) == 1 else b"".join(chunks)
    if base == 0 and len(joined) == size:
        return joined
    return memoryview(joined)[base : base + size]


class LocalStore:
    """A packed store on a local or shared file system, read without FUSE or MPI.

    The synchronous reader behind ``fanstore cat/verify`` and the Python API for stores.
    Thread-safe (the chunk cache has its own lock).
    """

    def __init__(self, path: str, cache_bytes: int = 64 << 20) -> None:
        self.path = path
        self.index = read_index(path)
        self.ns = Namespace(self.index)
        self.decoder = Decoder(self.index)
        self.parts = LocalPartitions(path, self.index)
        self.cache = ChunkCache(cache_bytes)
        self._lock = threading.Lock()

    def close(self) -> None:
        self.parts.close()

    def __enter__(self) -> "LocalStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def file_entry(self, path: str | bytes) -> int:
        entry = self.ns.resolve(path)
        kind = self.ns.kind(entry)
        if kind == KIND_DIR:
            raise IsADirectoryError_(f"{self.ns.show(entry)}: is a directory")
        if kind != KIND_FILE:
            raise NotFoundError(f"{self.ns.show(entry)}: not a regular file")
        return entry

    def read_chunks(self, entry: int, lo: int, hi: int) -> list[bytes]:
        first, _count = self.ns.chunks(entry)
        out: list[bytes | None] = []
        with self._lock:
            for k in range(first + lo, first + hi):
                out.append(self.cache.get(k))
        missing = [i for i, v in enumerate(out) if v is None]
        if missing:
            a, b = first + lo + missing[0], first + lo + missing[-1] + 1
            part, off, length = self.decoder.run_extent(a, b - a)
            blob = self.parts.fetch(part, off, length)
            decoded = self.decoder.decode_run(a, b - a, blob, entry)
            with self._lock:
                for k, data in zip(range(a, b), decoded):
                    out[k - first - lo] = data
                    self.cache.put(k, data)
        return out  # type: ignore[return-value]

    def read(self, entry: int, offset: int = 0, size: int = -1) -> bytes:
        file_size = self.ns.size(entry)
        if size < 0:
            size = file_size
        base = self.ns.data_offset(entry)
        lo, hi, end = chunk_span(offset, size, file_size, self.index.chunk_size, base)
        if hi == lo:
            return b""
        return bytes(assemble(self.read_chunks(entry, lo, hi), lo, offset, end,
                              self.index.chunk_size, base))

    def read_file(self, path: str | bytes) -> bytes:
        return self.read(self.file_entry(path))

    def iter_file(self, entry: int):
        """The decoded bytes of a file, a chunk at a time (bounded memory for huge files); a
        file in a solid chunk is one piece, its own bytes."""
        first, count = self.ns.chunks(entry)
        if count == 1:
            yield file_bytes(self.read_chunks(entry, 0, 1), self.ns.data_offset(entry),
                             self.ns.size(entry))
            return
        for k in range(count):
            yield self.read_chunks(entry, k, k + 1)[0]
