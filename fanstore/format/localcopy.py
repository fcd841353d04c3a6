"""Node-local copies of a loaded index, shared by the processes of one node.

The processes of one node (the daemon, its frontend process and workers) share one
decompressed copy of the index: the daemon writes the body to a node-local file once and
every process maps it read-only, so the namespace costs its size once per node (in the
page cache), not once per process. A private runtime file, never part of a store:
header = magic b"FANSTIDB", u64 body size, u64 XXH3-64 of the body, u64 stored size of
the index it came from, u64 its format version (the body's layout); then the body.
"""

from __future__ import annotations

import os
import struct

import xxhash

from fanstore.errors import FormatError
from fanstore.format.load import parse_body
from fanstore.format.tables import Index
from fanstore.format.validate import validate_index
from fanstore.version import FORMAT_VERSION

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
        f.writelines(index_body_parts(index))


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
    index = parse_body(body, path, version)
    index.raw_body_size = size
    index.stored_size = stored
    index.body = body
    if validate:
        validate_index(index, where=path)
    return index

