"""The index's byte layout (docs/format.md): constants, column dtypes, the header struct.

Layout of ``fanstore.idx``::

    header (64 bytes, little-endian)
        magic        8s   b"FANSTIDX"
        version      u16  format version (5, or 3 and 4; 1 and 2 are still read: see below)
        flags        u16  0
        header_size  u32  64
        body_raw     u64  size of the body after decompression
        body_stored  u64  size of the body as stored (zstd frame)
        body_xxh3    u64  XXH3-64 of the stored body
        zero padding to 64 bytes
    body: one zstd frame; decompressed it is
        meta_len     u32
        meta         JSON (UTF-8): store metadata, codec table, partition table, column directory
        columns      raw little-endian arrays, each 8-byte aligned, at the offsets the column
                     directory gives (relative to the start of the decompressed body)

Format versions: v3 (what ``fanstore pack`` writes) has no name lookup table (a name is
found by binary search in its directory's run of children, which are sorted by name bytes)
and narrower name columns (``name_off`` u32, ``name_len`` u8: its names table is under
4 GiB). v1 and v2 bodies have the lookup table (``lk_hash``, ``lk_entry``: XXH3-64 of
(parent u32 LE + name), sorted) and 64/16-bit name columns; readers ignore their lookup
table. v2 added ``e_offset`` (solid chunks); v1 has none (it reads as zeros). v4 is v3's
layout in which files of several chunks may share one run (identical files stored once);
a pack writes it only for a store that does. v5 (what ``fanstore pack`` writes) is v4's
layout with a compact body: integer columns stored through filters undone on load, and
no whole-file checksum for a file of one chunk. Every version is mapped and read the same
way otherwise (docs/format.md "Versions").

Entries are numbered 0..N-1 (entry 0 is the root directory; inode = entry + 1). They are in
breadth-first order: the children of a directory are contiguous, sorted by name, and every
child comes after its parent. A file either owns a contiguous run of the chunk table whose
chunks are contiguous in one partition (so one read fetches a whole file; from v4, identical
files may all point at the same run), or (format v2)
lives in a *solid* chunk shared with other small files, at byte ``offset`` of its decoded
bytes. In both cases a file's content is ``concat(decoded chunks first..first+count-1)
[offset : offset + size]`` (``offset`` is 0 for files that own their chunks and in v1).

The header is checked here (:func:`parse_index_header`); the body is parsed by
:mod:`fanstore.format.load`, written by :mod:`fanstore.format.build` and validated by
:mod:`fanstore.format.validate` before anything uses it.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
import xxhash

from fanstore.errors import FormatError, NotAStoreError, VersionTooNewError, VersionTooOldError
from fanstore.format.partition import partition_name
from fanstore.version import FORMAT_VERSION

INDEX_NAME = "fanstore.idx"
INDEX_MAGIC = b"FANSTIDX"
#: magic, version, flags, header size, body_raw, body_stored, body_xxh3 (then zero padding)
INDEX_HEADER = struct.Struct("<8sHHIQQQ")
INDEX_HEADER_SIZE = 64

KIND_FILE = 0
KIND_DIR = 1
KIND_SYMLINK = 2

#: Largest chunk the format allows (the packer's default is 1 MiB).
MAX_CHUNK_SIZE = 64 << 20
#: A decompressed index larger than this is refused (guards against a bomb in the header).
MAX_INDEX_BODY = 64 << 30
#: ... and so is one that claims to expand more than this many times its stored size (plus
#: a small allowance): real index bodies compress 3-7x (mostly incompressible hashes), while
#: a 32 KB zstd frame of RLE blocks can claim (and make a reader allocate) 1 GiB.
MAX_INDEX_RATIO = 128
INDEX_RATIO_SLACK = 1 << 20
#: Counts, sizes and offsets are at most 2**62, so sums of them never overflow an int64.
MAX_META_INT = 1 << 62
MAX_NAME = 255
MAX_TARGET = 4095
#: What ``e_mtime_ns`` (i64 ns since the epoch) holds: 1677-09-21 to 2262-04-11. Packers
#: clamp times outside it (a year-2446 file on ext4, a hostile archive's 1e23) to the
#: nearest end (``clamp_mtime_ns``), as docs/sources.md says.
MTIME_MIN_NS = -(1 << 63)
MTIME_MAX_NS = (1 << 63) - 1

#: Entry table columns: (name, dtype). ``first``/``count`` mean: for a file, its run of the
#: chunk table; for a directory, its run of child entries; for a symlink, its target's
#: byte range in the ``targets`` blob.
ENTRY_COLUMNS: tuple[tuple[str, str], ...] = (
    ("parent", "<u4"),
    ("name_off", "<u8"),
    ("name_len", "<u2"),
    ("kind", "u1"),
    ("mode", "<u2"),  # permission bits only (07777); the type comes from ``kind``
    ("size", "<u8"),
    ("mtime_ns", "<i8"),
    ("first", "<u8"),
    ("count", "<u4"),
    ("checksum", "<u8"),  # XXH3-64 of a file's whole content; 0 otherwise
    # v2: byte offset of a file's data in the decoded bytes of its first chunk (0 for a file
    # that owns its chunks). Absent from v1 indexes, where it reads as zeros.
    ("offset", "<u4"),
)
#: Entry columns that a version of the format does not have (read as zeros).
ABSENT_BEFORE = {"offset": 2}
#: From v3 on, these entry columns are narrower (what a directory listing touches is
#: smaller, and so is every node's mapped copy); the writer checks the values fit.
NARROW_FROM_V3: dict[str, str] = {"name_off": "<u4", "name_len": "u1"}
#: The first version without the name lookup table.
NO_LOOKUP_FROM = 3
#: The first version in which files of several chunks may share their run: identical
#: files stored once (``pack`` dedup). Its layout is v3's; only this rule is new.
SHARED_RUNS_FROM = 4
#: The first version with a compact index: integer columns stored through filters
#: (``"filters"`` in the metadata: :mod:`fanstore.format.filters`), undone when the body is
#: decompressed, and whole-file checksums left 0 for files of one chunk (the chunk's
#: checksum covers them). Shared runs (v4) are allowed.
COMPACT_FROM = 5
#: zstd level of a compact index body (names compress 1.3-2.4x better than at level 3).
COMPACT_LEVEL = 9


def entry_dtype(name: str, dtype: str, version: int) -> str:
    """The dtype of entry column ``name`` in a v``version`` index."""
    return NARROW_FROM_V3.get(name, dtype) if version >= NO_LOOKUP_FROM else dtype
CHUNK_COLUMNS: tuple[tuple[str, str], ...] = (
    ("part", "<u4"),
    ("offset", "<u8"),
    ("stored", "<u4"),
    ("raw", "<u4"),
    ("codec", "<u2"),  # index into the codec table
    ("checksum", "<u8"),  # XXH3-64 of the chunk's original (raw) bytes
)
#: Name lookup table of v1/v2 indexes (v3 has none): XXH3-64 of (parent u32 LE + name),
#: sorted, with the entry it names.
LOOKUP_COLUMNS: tuple[tuple[str, str], ...] = (
    ("lk_hash", "<u8"),
    ("lk_entry", "<u4"),
)
BLOB_COLUMNS: tuple[str, ...] = ("names", "targets")

ENTRY_PREFIX = "e_"
CHUNK_PREFIX = "c_"

_U32 = struct.Struct("<I")
_xxh3_64 = xxhash.xxh3_64_intdigest


def name_hash(parent: int, name: bytes) -> int:
    """The key of the lookup table: XXH3-64 of (parent u32 LE + name)."""
    return _xxh3_64(_U32.pack(parent) + name)


def names_sorted(blob: np.ndarray, off: np.ndarray, length: np.ndarray) -> bool:
    """Whether the names ``blob[off[i] : off[i] + length[i]]`` are strictly increasing as
    bytes (sorted, none repeated): the order :meth:`Index.lookup` bisects under."""
    pairs = np.arange(max(len(off) - 1, 0))
    return not len(pairs_out_of_order(blob, off, length, pairs, first_only=True))


def pairs_out_of_order(blob: np.ndarray, off: np.ndarray, length: np.ndarray,
                       pairs: np.ndarray, first_only: bool = False) -> np.ndarray:
    """Of the neighbouring names ``a = pairs[k]`` and ``a + 1`` (names as in
    :func:`names_sorted`), the ``a`` whose two names are not strictly increasing under
    Python's ``bytes`` order (unsigned bytes, a prefix first): the second is smaller or the
    same. Vectorised over the pairs, one byte position per pass, each pass only over the
    pairs that agree so far; with ``first_only`` it stops at the first pass that finds one.
    """
    pairs = np.asarray(pairs, dtype=np.int64)
    off_a, off_b = off[pairs].astype(np.int64), off[pairs + 1].astype(np.int64)
    len_a, len_b = length[pairs].astype(np.int64), length[pairs + 1].astype(np.int64)
    last = max(len(blob) - 1, 0)
    found = []
    j = 0
    while len(pairs):
        ca = np.where(j < len_a, blob[np.minimum(off_a + j, last)].astype(np.int16), -1)
        cb = np.where(j < len_b, blob[np.minimum(off_b + j, last)].astype(np.int16), -1)
        wrong = (ca > cb) | ((ca < 0) & (cb < 0))  # b smaller, or both ended: the same
        if np.any(wrong):
            found.append(pairs[wrong])
            if first_only:
                break
        same = (ca == cb) & (ca >= 0)
        pairs, off_a, off_b = pairs[same], off_a[same], off_b[same]
        len_a, len_b = len_a[same], len_b[same]
        j += 1
    return np.concatenate(found) if found else np.zeros(0, dtype=np.int64)


def clamp_mtime_ns(ns: int) -> int:
    """A modification time (ns) as the index can hold it: clamped to the i64 range."""
    return max(MTIME_MIN_NS, min(ns, MTIME_MAX_NS))


@dataclass
class PartitionInfo:
    number: int
    size: int
    checksum: str  # XXH3-128 hex of the whole partition file
    files: int = 0
    raw_bytes: int = 0
    broadcast: bool = False

    @property
    def name(self) -> str:
        return partition_name(self.number)

    def to_json(self) -> dict[str, Any]:
        return {
            "size": self.size,
            "checksum": self.checksum,
            "files": self.files,
            "raw_bytes": self.raw_bytes,
            "broadcast": self.broadcast,
        }


def parse_index_header(data: bytes, where: str = "index") -> tuple[int, int, int]:
    """Check the fixed header; return (body_raw, body_stored, body_xxh3)."""
    if len(data) < INDEX_HEADER_SIZE:
        raise FormatError(f"{where}: truncated index ({len(data)} bytes)")
    fields = INDEX_HEADER.unpack_from(data)
    magic, version, _flags, hsize, body_raw, body_stored, body_sum = fields
    if magic != INDEX_MAGIC:
        raise NotAStoreError(f"{where}: not a FanStore index (bad magic)")
    if version > FORMAT_VERSION:
        raise VersionTooNewError(
            f"{where}: store format v{version} is newer than this FanStore reads "
            f"(v{FORMAT_VERSION}); upgrade fanstore"
        )
    if version < 1:
        raise VersionTooOldError(f"{where}: store format v{version} is no longer supported")
    if hsize != INDEX_HEADER_SIZE:
        raise FormatError(f"{where}: bad index header size {hsize}")
    if body_raw > MAX_INDEX_BODY or body_raw > INDEX_RATIO_SLACK + MAX_INDEX_RATIO * body_stored:
        raise FormatError(f"{where}: index claims an absurd size ({body_raw} bytes from "
                          f"{body_stored} stored)")
    return body_raw, body_stored, body_sum
