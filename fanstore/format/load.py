"""Loading an index: the bytes of ``fanstore.idx`` from a store, checked, parsed, validated.

:func:`read_index` reads a store's index (a local directory or an object-store URL);
:func:`read_index_bytes` checks the header (:func:`fanstore.format.layout.parse_index_header`),
the body's checksum and size before it decompresses it (bounded), parses the body into an
:class:`~fanstore.format.tables.Index` (:func:`parse_body`) and validates it
(:func:`fanstore.format.validate.validate_index`).
"""

from __future__ import annotations

import json
import os
import stat
import struct
from typing import Any

import numpy as np
import xxhash
import zstandard

from fanstore.errors import FormatError, NotAStoreError
from fanstore.format import filters
from fanstore.format.layout import (
    ABSENT_BEFORE,
    COMPACT_FROM,
    CHUNK_COLUMNS,
    CHUNK_PREFIX,
    ENTRY_COLUMNS,
    ENTRY_PREFIX,
    INDEX_HEADER,
    INDEX_HEADER_SIZE,
    INDEX_NAME,
    MAX_META_INT,
    NO_LOOKUP_FROM,
    PartitionInfo,
    entry_dtype,
    parse_index_header,
)
from fanstore.format.tables import Index
from fanstore.format.validate import validate_index
from fanstore.version import FORMAT_VERSION


def read_index_file(store_dir: str) -> tuple[str, bytes]:
    """Return (path, bytes) of ``<store_dir>/fanstore.idx`` without parsing them.

    ``store_dir`` may also be an object-store URL (``s3://bucket/prefix``, see
    ``fanstore.storage``).

    The index is opened O_NONBLOCK and must be a regular file: a FIFO in its place is
    refused instead of blocking the reader (and, in an MPI job, every rank waiting on it).
    """
    from fanstore.storage import is_url

    if is_url(store_dir):
        return _read_remote_index(store_dir)
    path = os.path.join(store_dir, INDEX_NAME)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        with open(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise FormatError(f"{path}: the index is not a regular file")
            return path, f.read()
    except FileNotFoundError:
        if not os.path.isdir(store_dir):
            raise NotAStoreError(f"{store_dir}: no such directory") from None
        raise NotAStoreError(
            f"{store_dir}: not a FanStore store (no {INDEX_NAME}; an interrupted pack leaves none)"
        ) from None
    except OSError as exc:
        raise FormatError(f"{path}: cannot read index: {exc.strerror}") from exc


def _read_remote_index(url: str) -> tuple[str, bytes]:
    """The index of a store in object storage (``s3://bucket/prefix``)."""
    from fanstore.storage import open_location

    loc = open_location(url)
    path = loc.show(INDEX_NAME)
    try:
        return path, loc.read_bytes(INDEX_NAME)
    except FileNotFoundError:
        loc.check()  # a missing bucket says so
        raise NotAStoreError(
            f"{loc.url}: not a FanStore store (no {INDEX_NAME}; an interrupted pack leaves none)"
        ) from None


def read_index(store_dir: str) -> Index:
    """Load and validate ``<store_dir>/fanstore.idx`` (partition sizes are not checked here)."""
    path, data = read_index_file(store_dir)
    index = read_index_bytes(data, where=path)
    index.where = store_dir  # what a damaged directory's message names
    return index


def read_index_bytes(data: bytes, where: str = "index", validate: bool = True) -> Index:
    """The index in ``data`` (a whole ``fanstore.idx``): header, size and checksum checked,
    body decompressed (bounded) and parsed, then validated unless ``validate`` is False
    (bytes another process validated and sent: the checksum shows they are the same)."""
    body_raw, body_stored, body_sum = parse_index_header(data, where)
    version = INDEX_HEADER.unpack_from(data)[1]
    stored = memoryview(data)[INDEX_HEADER_SIZE:]
    if len(stored) != body_stored:
        raise FormatError(
            f"{where}: truncated or extended index (body {len(stored)} bytes, header says "
            f"{body_stored})"
        )
    if xxhash.xxh3_64_intdigest(stored) != body_sum:
        raise FormatError(f"{where}: index checksum mismatch (corrupt index)")
    try:
        params = zstandard.get_frame_parameters(stored)
        if params.content_size != body_raw:
            raise FormatError(f"{where}: index body size does not match its header")
        body = zstandard.ZstdDecompressor().decompress(stored, max_output_size=body_raw)
    except zstandard.ZstdError as exc:
        raise FormatError(f"{where}: cannot decompress index: {exc}") from exc
    if len(body) != body_raw:
        raise FormatError(f"{where}: index body has the wrong size")
    if version >= COMPACT_FROM:
        body = _unfiltered(body, where, version)
    index = parse_body(body, where, version)
    index.raw_body_size = body_raw
    index.stored_size = len(data)
    index.body = body
    index.where = where
    if validate:
        validate_index(index, where=where)
    return index


def _unfiltered(body: bytes, where: str, version: int) -> bytes | bytearray:
    """A v5 body as decompressed, with its column filters undone (the plain body that
    :func:`parse_body` reads and a node maps)."""
    meta, _ = _parse_meta(body, where)
    if "filters" not in meta:
        return body
    out = bytearray(body)
    dtypes = {ENTRY_PREFIX + n: entry_dtype(n, dt, version) for n, dt in ENTRY_COLUMNS}
    dtypes.update((CHUNK_PREFIX + n, dt) for n, dt in CHUNK_COLUMNS)
    filters.undo_all(out, meta["columns"], meta["filters"], dtypes, where)
    return out


def parse_body(body: bytes, where: str, version: int = FORMAT_VERSION) -> Index:
    """The decompressed ``body`` of a v``version`` index as an :class:`Index` whose arrays
    are views of it (checked only as far as parsing needs: the caller validates)."""
    meta, columns_start = _parse_meta(body, where)
    directory = meta["columns"]
    column = _ColumnReader(body, directory, columns_start, where)
    _check_meta_fields(meta, where, version)
    entries, chunks = _entry_and_chunk_tables(column, meta, version, where)
    if version >= NO_LOOKUP_FROM:
        if "lk_hash" in directory or "lk_entry" in directory:
            raise FormatError(f"{where}: a v{version} index has a lookup table")
        lk_hash, lk_entry = np.zeros(0, dtype="<u8"), np.zeros(0, dtype="<u4")
    else:  # parsed (and validated) as written, never used: names are found by bisection
        lk_hash = column("lk_hash", "<u8")
        lk_entry = column("lk_entry", "<u4")
    codecs = meta.get("codecs")
    if not isinstance(codecs, list) or not all(isinstance(x, dict) and "id" in x for x in codecs):
        raise FormatError(f"{where}: index codec table is malformed")
    partitions = _parse_partitions(meta, where)
    return Index(
        meta=meta,
        entries=entries,
        chunks=chunks,
        lk_hash=lk_hash,
        lk_entry=lk_entry,
        names=column("names", None),
        targets=column("targets", None),
        codecs=codecs,
        partitions=partitions,
        version=version,
    )


def _parse_meta(body: bytes, where: str) -> tuple[dict[str, Any], int]:
    """The JSON metadata at the start of ``body`` (it has a column directory) and the
    offset where the columns may start (just past it)."""
    if len(body) < 4:
        raise FormatError(f"{where}: index body too short")
    (meta_len,) = struct.unpack_from("<I", body)
    if 4 + meta_len > len(body):
        raise FormatError(f"{where}: index metadata runs past the body")
    try:
        meta = json.loads(bytes(body[4 : 4 + meta_len]).decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise FormatError(f"{where}: index metadata is not valid JSON") from exc
    if not isinstance(meta, dict):
        raise FormatError(f"{where}: index metadata is not an object")
    if not isinstance(meta.get("columns"), dict):
        raise FormatError(f"{where}: index has no column directory")
    return meta, 4 + meta_len


class _ColumnReader:
    """Reads the columns of an index body by name, as the column directory places them."""

    def __init__(
        self, body: bytes, directory: dict[str, Any], columns_start: int, where: str
    ) -> None:
        self.body = body
        self.directory = directory
        self.columns_start = columns_start
        self.where = where

    def __call__(self, name: str, dtype: str | None) -> Any:
        """Column ``name``: a numpy view of ``dtype`` rows, or the bytes if ``dtype`` is None."""
        body, where = self.body, self.where
        spec = self.directory.get(name)
        if (
            not isinstance(spec, list)
            or len(spec) != 2
            or not all(isinstance(v, int) and v >= 0 for v in spec)
        ):
            raise FormatError(f"{where}: index column {name!r} missing or malformed")
        off, length = spec
        if off + length > len(body) or off < self.columns_start:
            raise FormatError(f"{where}: index column {name!r} lies outside the body")
        if dtype is None:
            return body[off : off + length]
        itemsize = np.dtype(dtype).itemsize
        if length % itemsize:
            raise FormatError(f"{where}: index column {name!r} has a partial row")
        return np.frombuffer(body, dtype=dtype, count=length // itemsize, offset=off)


def _check_meta_fields(meta: dict[str, Any], where: str, version: int) -> None:
    """The counts, the optional fields and the format version of the metadata are sound."""
    for key in ("n_entries", "n_chunks", "chunk_size"):
        if key not in meta:
            raise FormatError(f"{where}: index metadata lacks {key!r}")
        if not _meta_int(meta[key]):
            raise FormatError(f"{where}: index metadata {key!r} is not a valid count")
    counts = meta.get("counts", {})
    if not isinstance(counts, dict) or not all(_meta_int(v) for v in counts.values()):
        raise FormatError(f"{where}: index counts are malformed")
    for key, kind in (("pack", dict), ("selection", dict), ("created_by", str)):
        if meta.get(key) is not None and not isinstance(meta[key], kind):
            raise FormatError(f"{where}: index metadata {key!r} is malformed")
    if meta.get("format_version", version) != version:
        raise FormatError(f"{where}: index metadata says format v{meta.get('format_version')}, "
                          f"its header v{version}")


def _entry_and_chunk_tables(
    column: _ColumnReader, meta: dict[str, Any], version: int, where: str
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """The entry and chunk columns, each of its table's length; an entry column that
    ``version`` does not have reads as zeros."""
    n_entries = meta["n_entries"]
    n_chunks = meta["n_chunks"]
    entries = {}
    absent = []
    for name, dt in ENTRY_COLUMNS:
        if ABSENT_BEFORE.get(name, 0) > version:
            if ENTRY_PREFIX + name in column.directory:
                raise FormatError(f"{where}: a v{version} index has a column {name!r} of a "
                                  "later version")
            absent.append((name, dt))
        else:
            entries[name] = column(ENTRY_PREFIX + name, entry_dtype(name, dt, version))
    chunks = {name: column(CHUNK_PREFIX + name, dt) for name, dt in CHUNK_COLUMNS}
    for name, arr in entries.items():
        if arr.shape[0] != n_entries:
            raise FormatError(f"{where}: entry column {name!r} has the wrong length")
    for name, dt in absent:  # only now: n_entries is the real length of the columns
        # a read-only view of one zero: no memory per entry, in any process
        entries[name] = np.broadcast_to(np.zeros(1, dtype=dt), (n_entries,))
    for name, arr in chunks.items():
        if arr.shape[0] != n_chunks:
            raise FormatError(f"{where}: chunk column {name!r} has the wrong length")
    return entries, chunks


def _parse_partitions(meta: dict[str, Any], where: str) -> list[PartitionInfo]:
    """The partition table of the metadata."""
    parts_raw = meta.get("partitions")
    if not isinstance(parts_raw, list):
        raise FormatError(f"{where}: index partition table is malformed")
    partitions = []
    for number, part in enumerate(parts_raw):
        if not (
            isinstance(part, dict)
            and _meta_int(part.get("size"))
            and isinstance(part.get("checksum"), str)
            and _meta_int(part.get("files", 0))
            and _meta_int(part.get("raw_bytes", 0))
            and isinstance(part.get("broadcast", False), bool)
        ):
            raise FormatError(f"{where}: partition {number} entry is malformed")
        partitions.append(
            PartitionInfo(
                number=number,
                size=part["size"],
                checksum=part["checksum"],
                files=part.get("files", 0),
                raw_bytes=part.get("raw_bytes", 0),
                broadcast=part.get("broadcast", False),
            )
        )
    return partitions


def _meta_int(value: Any) -> bool:
    """A JSON count: an integer (not a bool, float or string) in [0, 2**62]."""
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_META_INT
