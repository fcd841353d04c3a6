"""The store index: the whole namespace and where every chunk lives (docs/format.md).

Layout of ``fanstore.idx``::

    header (64 bytes, little-endian)
        magic        8s   b"FANSTIDX"
        version      u16  format version (1)
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

Entries are numbered 0..N-1 (entry 0 is the root directory; inode = entry + 1). They are in
breadth-first order: the children of a directory are contiguous, sorted by name, and every
child comes after its parent. A file either owns a contiguous run of the chunk table whose
chunks are contiguous in one partition (so one read fetches a whole file), or (format v2)
lives in a *solid* chunk shared with other small files, at byte ``offset`` of its decoded
bytes. In both cases a file's content is ``concat(decoded chunks first..first+count-1)
[offset : offset + size]`` (``offset`` is 0 for files that own their chunks and in v1).

Everything read from disk is validated before use (``Index.validate``): a hostile or corrupt
index is refused instead of making a reader touch bytes outside the store.
"""

from __future__ import annotations

import json
import os
import posixpath
import stat
import struct
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import xxhash
import zstandard

from fanstore.version import FORMAT_VERSION, __version__
from fanstore.errors import FormatError, NotAStoreError, VersionTooNewError, VersionTooOldError
from fanstore.format.partition import PARTITION_HEADER_SIZE, partition_name
from fanstore.format.symlinks import ESCAPES, Resolver, components

INDEX_NAME = "fanstore.idx"
INDEX_MAGIC = b"FANSTIDX"
_HEADER = struct.Struct("<8sHHIQQQ")
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
_MAX_META_INT = 1 << 62
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
_ABSENT_BEFORE = {"offset": 2}
CHUNK_COLUMNS: tuple[tuple[str, str], ...] = (
    ("part", "<u4"),
    ("offset", "<u8"),
    ("stored", "<u4"),
    ("raw", "<u4"),
    ("codec", "<u2"),  # index into the codec table
    ("checksum", "<u8"),  # XXH3-64 of the chunk's original (raw) bytes
)
#: Name lookup table: XXH3-64 of (parent u32 LE + name), sorted, with the entry it names.
LOOKUP_COLUMNS: tuple[tuple[str, str], ...] = (
    ("lk_hash", "<u8"),
    ("lk_entry", "<u4"),
)
BLOB_COLUMNS: tuple[str, ...] = ("names", "targets")

_ENTRY_PREFIX = "e_"
_CHUNK_PREFIX = "c_"


_U32 = struct.Struct("<I")
_xxh3_64 = xxhash.xxh3_64_intdigest


def name_hash(parent: int, name: bytes) -> int:
    return _xxh3_64(_U32.pack(parent) + name)


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


@dataclass
class Index:
    """A loaded, validated index. Columns are read-only numpy arrays."""

    meta: dict[str, Any]
    e: dict[str, np.ndarray]  # entry columns without prefix: e["size"], e["kind"], ...
    c: dict[str, np.ndarray]  # chunk columns without prefix
    lk_hash: np.ndarray
    lk_entry: np.ndarray
    names: bytes
    targets: bytes
    codecs: list[dict[str, Any]] = field(default_factory=list)
    partitions: list[PartitionInfo] = field(default_factory=list)
    raw_body_size: int = 0
    stored_size: int = 0
    version: int = FORMAT_VERSION  # the format version of the index as read (header)
    #: the decompressed body the arrays above are views of (bytes, or a shared mmap)
    body: Any = None

    # ---- shape
    @property
    def n_entries(self) -> int:
        return int(self.e["kind"].shape[0])

    @property
    def n_chunks(self) -> int:
        return int(self.c["part"].shape[0])

    @property
    def chunk_size(self) -> int:
        return int(self.meta["chunk_size"])

    # ---- per-entry helpers (scalar; used off the hot path or by the namespace)
    def name(self, entry: int) -> bytes:
        off = int(self.e["name_off"][entry])
        return bytes(self.names[off : off + int(self.e["name_len"][entry])])

    def target(self, entry: int) -> bytes:
        off = int(self.e["first"][entry])
        return bytes(self.targets[off : off + int(self.e["count"][entry])])

    def path(self, entry: int) -> bytes:
        parts = []
        parent = self.e["parent"]
        while entry != 0:
            parts.append(self.name(entry))
            entry = int(parent[entry])
        return b"/".join(reversed(parts))

    def lookup(self, parent: int, name: bytes) -> int | None:
        """The entry called ``name`` in directory ``parent``, or None (hot: every LOOKUP)."""
        h = _xxh3_64(_U32.pack(parent) + name)
        lk_hash = self.lk_hash
        i = int(lk_hash.searchsorted(np.uint64(h)))
        n = lk_hash.shape[0]
        e = self.e
        while i < n and int(lk_hash[i]) == h:
            entry = int(self.lk_entry[i])
            if entry and int(e["parent"][entry]) == parent:
                off = int(e["name_off"][entry])
                if self.names[off : off + int(e["name_len"][entry])] == name:
                    return entry
            i += 1
        return None

    def lookup_many(self, parents: np.ndarray, names: list[bytes]) -> np.ndarray:
        """:meth:`lookup` of many (parent, name) pairs at once: their entries, -1 where
        there is none (the hash search vectorised; a pair whose first candidate is not it,
        a hash collision, is looked up alone)."""
        n = len(names)
        out = np.full(n, -1, dtype=np.int64)
        if not n:
            return out
        pack = _U32.pack
        hashes = np.fromiter((_xxh3_64(pack(int(p)) + nm) for p, nm in zip(parents, names)),
                             dtype=np.uint64, count=n)
        idx = self.lk_hash.searchsorted(hashes)
        idx[idx >= len(self.lk_hash)] = 0
        cand = self.lk_entry[idx].astype(np.int64)
        e = self.e
        ok = (self.lk_hash[idx] == hashes) & (cand > 0) \
            & (e["parent"][cand] == parents) & (e["name_len"][cand] == [len(x) for x in names])
        name_off = e["name_off"]
        blob = self.names
        for i in np.nonzero(ok)[0]:
            c = int(cand[i])
            off = int(name_off[c])
            if blob[off:off + len(names[i])] == names[i]:
                out[i] = c
        for i in np.nonzero(out < 0)[0]:  # collisions, and the names that are not there
            found = self.lookup(int(parents[i]), names[i])
            out[i] = -1 if found is None else found
        return out

    def resolve(self, path: bytes | str) -> int | None:
        """Entry of a relative path inside the store (no symlinks followed), or None."""
        if isinstance(path, str):
            path = os.fsencode(path)
        entry = 0
        for part in path.split(b"/"):
            if part in (b"", b"."):
                continue
            if int(self.e["kind"][entry]) != KIND_DIR:
                return None
            found = self.lookup(entry, part)
            if found is None:
                return None
            entry = found
        return entry

    def stored_bytes_of(self, entry: int) -> int:
        first, count = int(self.e["first"][entry]), int(self.e["count"][entry])
        return int(self.c["stored"][first : first + count].sum())

    def file_entries(self) -> np.ndarray:
        return np.nonzero(self.e["kind"] == KIND_FILE)[0]

    def validate(self, partition_sizes: dict[int, int] | None = None) -> None:
        validate_index(self, partition_sizes)


# --------------------------------------------------------------------------- building


class IndexBuilder:
    """Collects the namespace and chunk rows during a pack and serialises the index.

    The packer adds entries in breadth-first order with children sorted by name; ``finish``
    checks that and builds the lookup table.
    """

    def __init__(self, n_entries: int, n_chunks: int) -> None:
        self.e = {name: np.zeros(n_entries, dtype=dt) for name, dt in ENTRY_COLUMNS}
        self.c = {name: np.zeros(n_chunks, dtype=dt) for name, dt in CHUNK_COLUMNS}
        self.names = bytearray()
        self.targets = bytearray()

    def set_name(self, entry: int, name: bytes) -> None:
        self.e["name_off"][entry] = len(self.names)
        self.e["name_len"][entry] = len(name)
        self.names += name

    def set_target(self, entry: int, target: bytes) -> None:
        self.e["first"][entry] = len(self.targets)
        self.e["count"][entry] = len(target)
        self.targets += target

    def build_lookup(self) -> tuple[np.ndarray, np.ndarray]:
        n = self.e["kind"].shape[0]
        hashes = np.zeros(n, dtype="<u8")
        names = bytes(self.names)
        parent, off, ln = self.e["parent"], self.e["name_off"], self.e["name_len"]
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
    lookup: tuple[np.ndarray, np.ndarray],
    names: bytes,
    targets: bytes,
    level: int = 3,
) -> bytes:
    """Serialise an index (header + zstd body) to bytes.

    The index is written in the oldest format version that can hold it: v1 unless some file
    lives in a solid chunk (:func:`needs_v2`); a v1 index has no ``e_offset`` column, so its
    bytes are exactly those of earlier releases.
    """
    offsets = e.get("offset")
    version = 2 if offsets is not None and needs_v2(e, c) else 1
    columns: list[tuple[str, bytes]] = []
    for name, dt in ENTRY_COLUMNS:
        if _ABSENT_BEFORE.get(name, 0) > version:
            continue
        columns.append((_ENTRY_PREFIX + name, np.ascontiguousarray(e[name], dtype=dt).tobytes()))
    for name, dt in CHUNK_COLUMNS:
        columns.append((_CHUNK_PREFIX + name, np.ascontiguousarray(c[name], dtype=dt).tobytes()))
    lk_hash, lk_entry = lookup
    columns.append(("lk_hash", np.ascontiguousarray(lk_hash, dtype="<u8").tobytes()))
    columns.append(("lk_entry", np.ascontiguousarray(lk_entry, dtype="<u4").tobytes()))
    columns.append(("names", bytes(names)))
    columns.append(("targets", bytes(targets)))

    meta = dict(meta)
    meta["format_version"] = version
    meta.setdefault("created_by", f"fanstore {__version__}")
    meta["n_entries"] = int(e["kind"].shape[0])
    meta["n_chunks"] = int(c["part"].shape[0])

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
    header = _HEADER.pack(
        INDEX_MAGIC,
        version,
        0,
        INDEX_HEADER_SIZE,
        len(body),
        len(stored),
        xxhash.xxh3_64_intdigest(stored),
    ).ljust(INDEX_HEADER_SIZE, b"\0")
    return header + stored


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


# --------------------------------------------------------------------------- reading


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
    return read_index_bytes(data, where=path)


def parse_index_header(data: bytes, where: str = "index") -> tuple[int, int, int]:
    """Check the fixed header; return (body_raw, body_stored, body_xxh3)."""
    if len(data) < INDEX_HEADER_SIZE:
        raise FormatError(f"{where}: truncated index ({len(data)} bytes)")
    magic, version, _flags, hsize, body_raw, body_stored, body_sum = _HEADER.unpack_from(data)
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


def read_index_bytes(data: bytes, where: str = "index") -> Index:
    body_raw, body_stored, body_sum = parse_index_header(data, where)
    version = _HEADER.unpack_from(data)[1]
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
    index = _parse_body(body, where, version)
    index.raw_body_size = body_raw
    index.stored_size = len(data)
    index.body = body
    validate_index(index, where=where)
    return index


# --------------------------------------------------------------------------- node-local copies
#
# The processes of one node (the daemon, its frontend process and workers) share one
# decompressed copy of the index: the daemon writes the body to a node-local file once and
# every process maps it read-only, so the namespace costs its size once per node (in the
# page cache), not once per process. A private runtime file, never part of a store:
# header = magic b"FANSTIDB", u64 body size, u64 XXH3-64 of the body, u64 stored size of
# the index it came from, u64 its format version (the body's layout); then the body.

_BODY_MAGIC = b"FANSTIDB"
_BODY_HEADER = struct.Struct("<8sQQQQ")


def index_body_parts(index: Index) -> list[bytes]:
    """The header and body of ``index``'s node-local copy, for :func:`map_index_body` (the
    runtime writes them to a private file: :meth:`fanstore.runtime.MountRuntime.create_shared`)."""
    body = index.body
    head = _BODY_HEADER.pack(_BODY_MAGIC, len(body), xxhash.xxh3_64_intdigest(body),
                             index.stored_size, index.version)
    return [head, bytes(body) if not isinstance(body, bytes) else body]


def write_index_body(path: str, index: Index) -> None:
    """Write ``index``'s node-local copy to a new file ``path`` (0600, created exclusively)."""
    from fanstore.safeio import create_excl

    with open(create_excl(path, 0o600), "wb") as f:
        for part in index_body_parts(index):
            f.write(part)


def map_index_body(path: str, check: bool = True, validate: bool = False,
                   owner: int | None = None) -> Index:
    """The index whose body :func:`index_body_parts` made, in the file ``path``, its arrays
    views of a read-only shared mapping of the file. The file is opened without following a
    symlink and, with ``owner``, must belong to that uid (the daemon's). Magic, sizes and
    the body's checksum (``check``) are verified before anything is parsed: it is the very
    body a validated index had, so validating it again is optional (``validate``)."""
    import mmap

    from fanstore.safeio import open_nofollow

    fd = open_nofollow(path, owner=owner, what="index copy")
    try:
        if os.fstat(fd).st_size < _BODY_HEADER.size:
            raise FormatError(f"{path}: truncated index copy")
        mm = mmap.mmap(fd, 0, prot=mmap.PROT_READ)
    finally:
        os.close(fd)
    if len(mm) < _BODY_HEADER.size:
        raise FormatError(f"{path}: truncated index copy")
    magic, size, digest, stored, version = _BODY_HEADER.unpack_from(mm)
    if magic != _BODY_MAGIC or size != len(mm) - _BODY_HEADER.size or version > FORMAT_VERSION:
        raise FormatError(f"{path}: not a FanStore index copy")
    body = memoryview(mm)[_BODY_HEADER.size:]
    if check and xxhash.xxh3_64_intdigest(body) != digest:
        raise FormatError(f"{path}: index copy checksum mismatch")
    index = _parse_body(body, path, version)
    index.raw_body_size = size
    index.stored_size = stored
    index.body = body
    if validate:
        validate_index(index, where=path)
    return index


def _parse_body(body: bytes, where: str, version: int = FORMAT_VERSION) -> Index:
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
    directory = meta.get("columns")
    if not isinstance(directory, dict):
        raise FormatError(f"{where}: index has no column directory")

    def column(name: str, dtype: str | None) -> Any:
        spec = directory.get(name)
        if (
            not isinstance(spec, list)
            or len(spec) != 2
            or not all(isinstance(v, int) and v >= 0 for v in spec)
        ):
            raise FormatError(f"{where}: index column {name!r} missing or malformed")
        off, length = spec
        if off + length > len(body) or off < 4 + meta_len:
            raise FormatError(f"{where}: index column {name!r} lies outside the body")
        if dtype is None:
            return body[off : off + length]
        itemsize = np.dtype(dtype).itemsize
        if length % itemsize:
            raise FormatError(f"{where}: index column {name!r} has a partial row")
        arr = np.frombuffer(body, dtype=dtype, count=length // itemsize, offset=off)
        return arr

    for key in ("n_entries", "n_chunks", "chunk_size"):
        if key not in meta:
            raise FormatError(f"{where}: index metadata lacks {key!r}")
        if not _meta_int(meta[key]):
            raise FormatError(f"{where}: index metadata {key!r} is not a valid count")
    n_entries = meta["n_entries"]
    n_chunks = meta["n_chunks"]
    counts = meta.get("counts", {})
    if not isinstance(counts, dict) or not all(_meta_int(v) for v in counts.values()):
        raise FormatError(f"{where}: index counts are malformed")
    for key, kind in (("pack", dict), ("selection", dict), ("created_by", str)):
        if meta.get(key) is not None and not isinstance(meta[key], kind):
            raise FormatError(f"{where}: index metadata {key!r} is malformed")
    if meta.get("format_version", version) != version:
        raise FormatError(f"{where}: index metadata says format v{meta.get('format_version')}, "
                          f"its header v{version}")
    e = {}
    absent = []
    for name, dt in ENTRY_COLUMNS:
        if _ABSENT_BEFORE.get(name, 0) > version:
            if _ENTRY_PREFIX + name in directory:
                raise FormatError(f"{where}: a v{version} index has a column {name!r} of a "
                                  "later version")
            absent.append((name, dt))
        else:
            e[name] = column(_ENTRY_PREFIX + name, dt)
    c = {name: column(_CHUNK_PREFIX + name, dt) for name, dt in CHUNK_COLUMNS}
    for name, arr in e.items():
        if arr.shape[0] != n_entries:
            raise FormatError(f"{where}: entry column {name!r} has the wrong length")
    for name, dt in absent:  # only now: n_entries is the real length of the columns
        zeros = np.zeros(n_entries, dtype=dt)
        zeros.flags.writeable = False
        e[name] = zeros
    for name, arr in c.items():
        if arr.shape[0] != n_chunks:
            raise FormatError(f"{where}: chunk column {name!r} has the wrong length")
    lk_hash = column("lk_hash", "<u8")
    lk_entry = column("lk_entry", "<u4")
    codecs = meta.get("codecs")
    if not isinstance(codecs, list) or not all(isinstance(x, dict) and "id" in x for x in codecs):
        raise FormatError(f"{where}: index codec table is malformed")
    parts_raw = meta.get("partitions")
    if not isinstance(parts_raw, list):
        raise FormatError(f"{where}: index partition table is malformed")
    partitions = []
    for number, p in enumerate(parts_raw):
        if not (
            isinstance(p, dict)
            and _meta_int(p.get("size"))
            and isinstance(p.get("checksum"), str)
            and _meta_int(p.get("files", 0))
            and _meta_int(p.get("raw_bytes", 0))
            and isinstance(p.get("broadcast", False), bool)
        ):
            raise FormatError(f"{where}: partition {number} entry is malformed")
        partitions.append(
            PartitionInfo(
                number=number,
                size=p["size"],
                checksum=p["checksum"],
                files=p.get("files", 0),
                raw_bytes=p.get("raw_bytes", 0),
                broadcast=p.get("broadcast", False),
            )
        )
    return Index(
        meta=meta,
        e=e,
        c=c,
        lk_hash=lk_hash,
        lk_entry=lk_entry,
        names=column("names", None),
        targets=column("targets", None),
        codecs=codecs,
        partitions=partitions,
        version=version,
    )


def _meta_int(value: Any) -> bool:
    """A JSON count: an integer (not a bool, float or string) in [0, 2**62]."""
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= _MAX_META_INT


# --------------------------------------------------------------------------- validation


def validate_index(
    index: Index, partition_sizes: dict[int, int] | None = None, where: str = "index"
) -> None:
    """Refuse an index whose structure could make a reader misbehave.

    Checks (vectorised, cheap even for millions of entries): the tree shape, names (no '/',
    NUL, '.', '..' or empty components), symlink targets stay inside the store (lexically,
    and walked through the tree: no chain of symlinks climbs above the root), chunk runs
    are in bounds, contiguous and inside their partitions, chunk sizes are bounded (no
    decompression bombs), every chunk belongs to a file; a file of several chunks owns them
    (no other file refers to any) and its size is their sum; a file of one chunk lies inside
    it (``offset + size <= raw``), and only in v2 may it share the chunk with other files.
    """

    def bad(msg: str) -> FormatError:
        return FormatError(f"{where}: {msg}")

    e, c = index.e, index.c
    n, m = index.n_entries, index.n_chunks
    chunk_size = index.chunk_size
    if not 0 < chunk_size <= MAX_CHUNK_SIZE:
        raise bad(f"bad chunk size {chunk_size}")
    if n < 1:
        raise bad("no root entry")
    kind, parent, first, count = e["kind"], e["parent"], e["first"], e["count"]
    if kind[0] != KIND_DIR or parent[0] != 0 or e["name_len"][0] != 0:
        raise bad("entry 0 is not the root directory")
    if np.any(kind > KIND_SYMLINK):
        raise bad("unknown entry kind")
    if np.any(e["mode"] > 0o7777):
        raise bad("mode has bits beyond 07777")

    # -- tree: the children runs of directories tile entries 1..n-1 in directory order.
    dirs = np.nonzero(kind == KIND_DIR)[0]
    d_first = first[dirs].astype(np.int64)
    d_count = count[dirs].astype(np.int64)
    if d_count.sum() != n - 1:
        raise bad("directory child counts do not add up to the number of entries")
    expected_first = np.concatenate(([1], 1 + np.cumsum(d_count)[:-1])) if len(dirs) else []
    if not np.array_equal(d_first, expected_first):
        raise bad("directory child runs are not contiguous in breadth-first order")
    if n > 1:
        expected_parent = np.repeat(dirs, d_count)
        if not np.array_equal(parent[1:].astype(np.int64), expected_parent):
            raise bad("entries are not where their parent's child run says")
        if np.any(parent[1:].astype(np.int64) >= np.arange(1, n)):
            raise bad("an entry precedes its parent")

    # -- names (bounds are checked on the unsigned values first: a u64 offset above 2**63
    # would turn negative as an int64 and slip past the checks below)
    names = np.frombuffer(index.names, dtype=np.uint8)
    if np.any(e["name_off"][1:] > len(names)):
        raise bad("a name lies outside the name table")
    name_off = e["name_off"][1:].astype(np.int64)
    name_len = e["name_len"][1:].astype(np.int64)
    if np.any(name_len == 0) or np.any(name_len > MAX_NAME):
        raise bad("an entry has an empty or over-long name")
    if np.any(name_off + name_len > len(names)):
        raise bad("a name lies outside the name table")
    if np.any(names == ord("/")) or np.any(names == 0):
        raise bad("a name contains '/' or NUL")
    dot = ord(".")
    if n > 1:
        b0 = names[name_off]
        b1 = names[np.minimum(name_off + 1, max(len(names) - 1, 0))]
        if np.any((name_len == 1) & (b0 == dot)) or np.any(
            (name_len == 2) & (b0 == dot) & (b1 == dot)
        ):
            raise bad("an entry is named '.' or '..'")

    # -- lookup table
    if index.lk_hash.shape[0] != n - 1 or index.lk_entry.shape[0] != n - 1:
        raise bad("lookup table has the wrong length")
    if n > 1:
        if np.any(index.lk_hash[1:] < index.lk_hash[:-1]):
            raise bad("lookup table is not sorted")
        if np.any(index.lk_entry == 0) or np.any(index.lk_entry >= n):
            raise bad("lookup table points outside the entry table")

    # -- symlinks
    links = np.nonzero(kind == KIND_SYMLINK)[0]
    if len(links):
        if np.any(first[links] > len(index.targets)):
            raise bad("a symlink target lies outside the target table or is empty")
        t_end = first[links].astype(np.int64) + count[links].astype(np.int64)
        if np.any(t_end > len(index.targets)) or np.any(count[links] == 0):
            raise bad("a symlink target lies outside the target table or is empty")
        if np.any(count[links] > MAX_TARGET):
            raise bad("a symlink target is over-long")
        if np.any(e["size"][links] != count[links]):
            raise bad("a symlink's size differs from its target length")
        # Depth of every directory (parents come first): a symlink's own path is needed
        # only to name it (building it for each symlink cost O(depth): a hostile index
        # of 4,000 nested directories and 4,000 symlinks took 11 s to validate).
        par = parent.tolist()
        depth = [0] * n
        for i in range(1, n):
            depth[i] = depth[par[i]] + 1
        upward = []
        for entry in links.tolist():
            target = index.target(entry)
            if b"\0" in target:
                raise bad("a symlink target contains NUL")
            if not _stays_inside(depth[par[entry]], target):
                raise bad(
                    f"symlink {os.fsdecode(index.path(entry))!r} points outside the store"
                )
            if b".." in components(target):
                upward.append(entry)
        # Lexically inside is not enough: ``..`` after a symlink (``c -> a/b/..`` with
        # ``a/b -> ..``) climbs from where that symlink leads, and on the mount the kernel
        # would climb out of the mount point. Only targets with a ``..`` can climb; the
        # symlinks they pass through are resolved on the way (fanstore.format.symlinks).
        if upward:
            resolver = Resolver(_IndexTree(index))
            for entry in upward:
                if resolver.resolve(entry).status == ESCAPES:
                    raise bad(f"symlink {os.fsdecode(index.path(entry))!r} resolves outside "
                              "the store (through other symlinks)")

    # -- files and chunks
    files = np.nonzero(kind == KIND_FILE)[0]
    nonfile = np.nonzero(kind != KIND_FILE)[0]
    if np.any(e["checksum"][nonfile] != 0) or np.any(e["size"][dirs] != 0):
        raise bad("a directory or symlink carries file data")
    if np.any(e["offset"][nonfile] != 0):
        raise bad("a directory or symlink has a data offset")
    f_count = count[files].astype(np.int64)
    if np.any(first[files] > np.uint64(m)):  # unsigned, before any arithmetic
        raise bad("a file's chunk run lies outside the chunk table")
    f_first = first[files].astype(np.int64)
    f_size = e["size"][files]
    if np.any(f_size > np.uint64(_MAX_META_INT)):
        raise bad("a file claims an absurd size")
    f_size = f_size.astype(np.int64)
    f_off = e["offset"][files].astype(np.int64)
    used = f_count > 0
    if np.any(f_size[~used] != 0) or np.any(f_off[~used] != 0):
        raise bad("a file's size differs from the sum of its chunks")
    if np.any(f_first[used] + f_count[used] > m):
        raise bad("a file's chunk run lies outside the chunk table")
    if not m:
        return
    if np.any(c["offset"] > np.uint64(_MAX_META_INT)):
        raise bad("a chunk lies outside its partition")
    raw = c["raw"].astype(np.int64)
    stored = c["stored"].astype(np.int64)
    part = c["part"].astype(np.int64)
    offset = c["offset"].astype(np.int64)
    if np.any(raw == 0) or np.any(raw > chunk_size):
        raise bad("a chunk claims an absurd raw size (possible decompression bomb)")
    if np.any(stored == 0):
        raise bad("a chunk has no stored bytes")
    if np.any(c["codec"] >= len(index.codecs)):
        raise bad("a chunk names a codec outside the codec table")
    if np.any(part >= len(index.partitions)):
        raise bad("a chunk names a partition outside the partition table")
    sizes = np.array([p.size for p in index.partitions], dtype=np.int64)
    if partition_sizes is not None:
        for number, size in partition_sizes.items():
            sizes[number] = size
    if np.any(offset < PARTITION_HEADER_SIZE) or np.any(offset + stored > sizes[part]):
        raise bad("a chunk lies outside its partition")
    # How many files refer to each chunk (a difference array over the runs).
    u_first, u_count = f_first[used], f_count[used]
    diff = np.zeros(m + 1, dtype=np.int64)
    np.add.at(diff, u_first, 1)
    np.add.at(diff, u_first + u_count, -1)
    refs = np.cumsum(diff[:m])
    if np.any(refs == 0):
        raise bad("a chunk belongs to no file")
    # Files of one chunk ("single") may share it (solid chunks, v2): their bytes must lie
    # inside it. Files of several chunks own them: no other file refers to any of them.
    single = u_count == 1
    s_first, s_size, s_off = u_first[single], f_size[used][single], f_off[used][single]
    if np.any(s_off + s_size > raw[s_first]):
        raise bad("a file's data lies outside its chunk")
    if index.version < 2 and (np.any(refs > 1) or np.any(s_size != raw[s_first])
                              or np.any(f_off != 0)):
        raise bad("a file's size differs from the sum of its chunks")
    multi = ~single
    if np.any(multi):
        m_first, m_count = u_first[multi], u_count[multi]
        m_last = m_first + m_count - 1
        if np.any(f_off[used][multi] != 0):
            raise bad("a file of several chunks has a data offset")

        def run_sum(flags: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
            """Sum of ``flags[lo:hi]`` for each run (prefix sums)."""
            prefix = np.concatenate(([0], np.cumsum(flags, dtype=np.int64)))
            return prefix[hi] - prefix[lo]

        if np.any(run_sum(refs > 1, m_first, m_last + 1)):
            raise bad("file chunk runs overlap")
        if np.any(run_sum(raw, m_first, m_last + 1) != f_size[used][multi]):
            raise bad("a file's size differs from the sum of its chunks")
        # Every chunk but a file's last is exactly chunk_size long (offsets map to chunks).
        if np.any(run_sum(raw != chunk_size, m_first, m_last)):
            raise bad("a chunk other than a file's last is not chunk_size long")
        # Chunks of one file are contiguous in one partition.
        broken = np.zeros(m, dtype=bool)
        broken[:-1] = (part[1:] != part[:-1]) | (offset[1:] != offset[:-1] + stored[:-1])
        if np.any(run_sum(broken, m_first, m_last)):
            raise bad("a file's chunks are not contiguous in one partition")
    # No two chunks overlap inside a partition.
    by_pos = np.lexsort((offset, part))
    p_s, o_s, s_s = part[by_pos], offset[by_pos], stored[by_pos]
    same = p_s[1:] == p_s[:-1]
    if np.any(o_s[1:][same] < o_s[:-1][same] + s_s[:-1][same]):
        raise bad("chunks overlap inside a partition")


def clamp_mtime_ns(ns: int) -> int:
    """A modification time (ns) as the index can hold it: clamped to the i64 range."""
    return max(MTIME_MIN_NS, min(ns, MTIME_MAX_NS))


class _IndexTree:
    """The index as a tree for :class:`fanstore.format.symlinks.Resolver`."""

    root = 0

    def __init__(self, index: Index) -> None:
        self.index = index
        self._kind = index.e["kind"]
        self._parent = index.e["parent"]

    def parent(self, node: int) -> int:
        return int(self._parent[node])

    def child(self, node: int, name: bytes) -> int | None:
        return self.index.lookup(node, name)

    def is_dir(self, node: int) -> bool:
        return int(self._kind[node]) == KIND_DIR

    def link_target(self, node: int) -> bytes | None:
        if int(self._kind[node]) != KIND_SYMLINK:
            return None
        return self.index.target(node)


def _stays_inside(depth: int, target: bytes) -> bool:
    """``target_stays_inside`` for a symlink whose directory is ``depth`` levels below the
    root: lexically, ``..`` never climbs above the root."""
    if target.startswith(b"/"):
        return False
    for part in target.split(b"/"):
        if part == b"..":
            depth -= 1
            if depth < 0:
                return False
        elif part not in (b"", b"."):
            depth += 1
    return True


def target_stays_inside(link_path: bytes, target: bytes) -> bool:
    """True if a symlink at ``link_path`` (relative to the store root) with ``target``
    resolves, lexically, to a path inside the store root."""
    if target.startswith(b"/"):
        return False
    joined = posixpath.normpath(posixpath.join(posixpath.dirname(link_path), target))
    return joined != b".." and not joined.startswith(b"../")
