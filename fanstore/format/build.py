"""Building an index: the packer's rows in, the bytes of ``fanstore.idx`` out.

:class:`IndexBuilder` collects the namespace and chunk rows during a pack,
:func:`encode_index` lays them out (:mod:`fanstore.format.layout`): v3 (no lookup table),
v4 when files of several chunks share a run, v5 when the packer asks for a compact index
(filtered columns, no checksum per one-chunk file), or with a lookup table the oldest of
v1/v2 that can hold them (what earlier releases wrote; tests make such stores);
:func:`write_index` installs the bytes atomically.
"""

from __future__ import annotations

import json
import os
import struct
from typing import Any

import numpy as np
import xxhash
import zstandard

from fanstore.errors import FormatError
from fanstore.format import filters
from fanstore.format.layout import (
    ABSENT_BEFORE,
    COMPACT_FROM,
    COMPACT_LEVEL,
    CHUNK_COLUMNS,
    CHUNK_PREFIX,
    ENTRY_COLUMNS,
    ENTRY_PREFIX,
    INDEX_HEADER,
    INDEX_HEADER_SIZE,
    INDEX_MAGIC,
    KIND_FILE,
    NO_LOOKUP_FROM,
    SHARED_RUNS_FROM,
    entry_dtype,
    name_hash,
)
from fanstore.version import __version__


class IndexBuilder:
    """Collects the namespace and chunk rows during a pack and serialises the index.

    The packer adds entries in breadth-first order with children sorted by name bytes (a
    v3 index has no lookup table: names are found by binary search in that order).
    """

    def __init__(self, n_entries: int, n_chunks: int) -> None:
        self.entries = {name: np.zeros(n_entries, dtype=dt) for name, dt in ENTRY_COLUMNS}
        self.chunks = {name: np.zeros(n_chunks, dtype=dt) for name, dt in CHUNK_COLUMNS}
        self.names = bytearray()
        self.targets = bytearray()

    def set_name(self, entry: int, name: bytes) -> None:
        self.entries["name_off"][entry] = len(self.names)
        self.entries["name_len"][entry] = len(name)
        self.names += name

    def set_target(self, entry: int, target: bytes) -> None:
        self.entries["first"][entry] = len(self.targets)
        self.entries["count"][entry] = len(target)
        self.targets += target

    def set_names(self, names: list[bytes]) -> None:
        """Set the names of entries 1..len(names) at once (entry 0, the root, has none)."""
        lengths = np.fromiter(map(len, names), dtype=np.int64, count=len(names))
        n = len(names)
        self.entries["name_len"][1 : n + 1] = lengths
        self.entries["name_off"][1 : n + 1] = len(self.names) + np.cumsum(lengths) - lengths
        self.names += b"".join(names)

    def build_lookup(self) -> tuple[np.ndarray, np.ndarray]:
        """The v1/v2 lookup table of this builder's entries (:func:`lookup_table`)."""
        return lookup_table(self.entries, self.names)


def lookup_table(e: dict[str, np.ndarray], names: bytes) -> tuple[np.ndarray, np.ndarray]:
    """The v1/v2 lookup table of entry columns ``e`` and their ``names`` blob (a Python
    loop: 0.75 µs/entry; v3 has none)."""
    n = e["kind"].shape[0]
    hashes = np.zeros(n, dtype="<u8")
    names = bytes(names)
    parent, off, ln = e["parent"], e["name_off"], e["name_len"]
    for i in range(1, n):
        o = int(off[i])
        hashes[i] = name_hash(int(parent[i]), names[o : o + int(ln[i])])
    # The root (entry 0) has no name and is never looked up: leave it out.
    order = np.argsort(hashes[1:], kind="stable") + 1
    return hashes[order].astype("<u8"), order.astype("<u4")


def encode_index(
    meta: dict[str, Any],
    e: dict[str, np.ndarray],
    c: dict[str, np.ndarray],
    lookup: tuple[np.ndarray, np.ndarray] | None,
    names: bytes,
    targets: bytes,
    level: int = 3,
    compact: bool = False,
) -> bytes:
    """Serialise an index (header + zstd body) to bytes.

    With ``compact`` (what ``fanstore pack`` asks for) the index is v5 when its names fit
    the v3 layout: its integer columns stored through the filter that compresses each best
    (:mod:`fanstore.format.filters`), and no whole-file checksum for a file of one chunk
    (that chunk's checksum covers its bytes), compressed at ``max(level, COMPACT_LEVEL)``.

    Without ``lookup`` the index is v3 (no lookup table, 32/8-bit name columns), or v4 when
    files of several chunks share a run (:func:`shares_runs`: identical files stored once;
    earlier readers refuse it as too new); a names
    table of 4 GiB or more (or a name over 255 bytes) does not fit v3: it gets a lookup
    table built here and the older layout. With ``lookup`` it is written in the oldest of v1/v2 that can hold it: v1
    unless some file lives in a solid chunk (:func:`needs_v2`), byte for byte what earlier
    releases wrote.
    """
    version, lookup = _version_of(e, c, lookup, names)
    if compact and lookup is None:
        version, level = COMPACT_FROM, max(level, COMPACT_LEVEL)
        e = dict(e, checksum=one_chunk_sums_dropped(e))
    columns, chosen = _columns(e, c, lookup, names, targets, version)
    meta = {k: v for k, v in meta.items() if k != "filters"}  # this call chooses them
    meta["format_version"] = version
    meta.setdefault("created_by", f"fanstore {__version__}")
    meta["n_entries"] = int(e["kind"].shape[0])
    meta["n_chunks"] = int(c["part"].shape[0])
    if chosen:
        meta["filters"] = chosen

    # Column offsets depend on the JSON length, which depends on the offsets: lay out the
    # columns after a JSON area padded to a fixed size computed from a first estimate.
    directory = {name: [0, len(data)] for name, data in columns}
    meta["columns"] = directory
    estimate = len(json.dumps(meta, sort_keys=True).encode()) + 32 * len(columns) + 64
    data_start = _align(4 + estimate)
    pos = data_start
    for name, data in columns:
        directory[name] = [pos, len(data)]
        pos = _align(pos + len(data))
    meta_bytes = json.dumps(meta, sort_keys=True, separators=(",", ":")).encode()
    if 4 + len(meta_bytes) > data_start:  # cannot happen with the estimate above
        raise FormatError("internal error: index metadata larger than its reserved area")
    body = bytearray(pos)
    struct.pack_into("<I", body, 0, len(meta_bytes))
    body[4 : 4 + len(meta_bytes)] = meta_bytes
    for name, data in columns:
        off = directory[name][0]
        body[off : off + len(data)] = data

    stored = zstandard.ZstdCompressor(level=level, write_content_size=True).compress(bytes(body))
    header = INDEX_HEADER.pack(
        INDEX_MAGIC,
        version,
        0,
        INDEX_HEADER_SIZE,
        len(body),
        len(stored),
        xxhash.xxh3_64_intdigest(stored),
    ).ljust(INDEX_HEADER_SIZE, b"\0")
    return header + stored


def _columns(e: dict[str, np.ndarray], c: dict[str, np.ndarray],
             lookup: tuple[np.ndarray, np.ndarray] | None, names: bytes, targets: bytes,
             version: int) -> tuple[list[tuple[str, bytes]], dict[str, str]]:
    """The body's columns as (name, bytes) in body order, and the filter each integer
    column is stored through (v5: :func:`fanstore.format.filters.choose`)."""
    chosen: dict[str, str] = {}

    def column(name: str, values: np.ndarray, dt: str) -> tuple[str, bytes]:
        arr = np.ascontiguousarray(values, dtype=dt)
        how = filters.choose(arr) if version >= COMPACT_FROM else None
        if how is None:
            return name, arr.tobytes()
        chosen[name] = how
        return name, filters.apply(arr, how)

    columns: list[tuple[str, bytes]] = []
    for name, dt in ENTRY_COLUMNS:
        if ABSENT_BEFORE.get(name, 0) > version:
            continue
        columns.append(column(ENTRY_PREFIX + name, e[name], entry_dtype(name, dt, version)))
    for name, dt in CHUNK_COLUMNS:
        columns.append(column(CHUNK_PREFIX + name, c[name], dt))
    if lookup is not None:
        lk_hash, lk_entry = lookup
        columns.append(("lk_hash", np.ascontiguousarray(lk_hash, dtype="<u8").tobytes()))
        columns.append(("lk_entry", np.ascontiguousarray(lk_entry, dtype="<u4").tobytes()))
    columns.append(("names", bytes(names)))
    columns.append(("targets", bytes(targets)))
    return columns, chosen


def _version_of(e: dict[str, np.ndarray], c: dict[str, np.ndarray],
                lookup: tuple[np.ndarray, np.ndarray] | None, names: bytes
                ) -> tuple[int, tuple[np.ndarray, np.ndarray] | None]:
    """The version an index is written in (see :func:`encode_index`), and its lookup table
    (built here for names too wide for v3)."""
    name_len = e["name_len"]
    too_wide = len(names) >= 1 << 32 or (len(name_len) and int(name_len.max()) > 255)
    if lookup is None and too_wide:
        lookup = lookup_table(e, names)
    if lookup is None:
        return (SHARED_RUNS_FROM if shares_runs(e) else NO_LOOKUP_FROM), None
    if shares_runs(e):
        raise FormatError("files of several chunks share their chunks, which only the v4 "
                          "layout holds, but the names do not fit it (pack with --no-dedup)")
    offsets = e.get("offset")
    return (2 if offsets is not None and needs_v2(e, c) else 1), lookup


def one_chunk_sums_dropped(e: dict[str, np.ndarray]) -> np.ndarray:
    """The whole-file checksums as v5 keeps them: 0 for a file of one chunk (its own, or a
    solid block it shares), whose bytes that chunk's checksum covers."""
    sums = np.array(e["checksum"], dtype="<u8")
    sums[(e["kind"] == KIND_FILE) & (e["count"] == 1)] = 0
    return sums


def needs_v2(e: dict[str, np.ndarray], c: dict[str, np.ndarray]) -> bool:
    """True if some file lives in a solid chunk (format v2): at a non-zero offset, in a
    chunk another file refers to too, or in a single chunk larger than itself."""
    files = e["kind"] == KIND_FILE
    if np.any(e["offset"][files] != 0):
        return True
    n_chunks = int(c["raw"].shape[0])
    f_count = e["count"][files].astype(np.int64)
    f_first = e["first"][files]  # unsigned: any value, even a hostile one, stays in range
    used = f_count > 0
    if int(f_count.sum()) != n_chunks or len(np.unique(f_first[used])) != int(used.sum()):
        return True
    single = f_count == 1
    if not n_chunks or not single.any():
        return False
    at = np.minimum(f_first[single], np.uint64(n_chunks - 1)).astype(np.int64)
    return bool(np.any(e["size"][files][single] != c["raw"][at]))


def shares_runs(e: dict[str, np.ndarray]) -> bool:
    """True if two files of several chunks share their run (format v4: identical files
    stored once; one-chunk files could always share a chunk)."""
    multi = (e["kind"] == KIND_FILE) & (e["count"] > 1)
    firsts = e["first"][multi]
    return len(np.unique(firsts)) < len(firsts)


def write_index(path: str, data: bytes) -> None:
    """Write index bytes to ``path`` atomically (temp file, fsync, rename)."""
    tmp = path + ".tmp"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def _align(n: int) -> int:
    return (n + 7) & ~7
