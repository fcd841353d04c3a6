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
    """Write ``index``'s node-local copy to a new file ``path`` (0600, created exclusively);
    a file that could not be written whole (a full file system) is removed."""
    from fanstore.safeio import create_excl

    fd = create_excl(path, 0o600)  # (a file already there is not ours to remove)
    try:
        with open(fd, "wb") as f:
            f.writelines(index_body_parts(index))
    except OSError:
        os.unlink(path)
        raise


def _digest_of(fd: int, start: int, size: int, block: int = 8 << 20) -> int:
    """XXH3-64 of ``size`` bytes of ``fd`` from ``start``, read in blocks."""
    h = xxhash.xxh3_64()
    buf = bytearray(min(block, max(size, 1)))
    view = memoryview(buf)
    pos, end = start, start + size
    while pos < end:
        n = os.preadv(fd, [view[: min(block, end - pos)]], pos)
        if n <= 0:
            raise FormatError("index copy: short read")
        h.update(view[:n])
        pos += n
    return h.intdigest()


def map_index_body(path: str, check: bool = True, validate: bool = False,
                   owner: int | None = None, where: str | None = None) -> Index:
    """The index whose body :func:`index_body_parts` made, in the file ``path``, its arrays
    views of a read-only shared mapping of the file. The file is opened without following a
    symlink and, with ``owner``, must belong to that uid (the daemon's). Magic, sizes and
    the body's checksum (``check``) are verified before anything is parsed: it is the very
    body a validated index had, so validating it again is optional (``validate``). The
    checksum is computed from reads, not through the mapping: the process then has mapped
    only the pages its queries touch (the node pays for the copy once, in the page cache;
    a process for what it uses). ``where`` names the store in the index's messages (default
    ``path``)."""
    import mmap

    from fanstore.safeio import open_nofollow

    fd = open_nofollow(path, owner=owner, what="index copy")
    try:
        if os.fstat(fd).st_size < _BODY_HEADER.size:
            raise FormatError(f"{path}: truncated index copy")
        magic, size, digest, stored, version = _BODY_HEADER.unpack(
            os.pread(fd, _BODY_HEADER.size, 0))
        if (magic != _BODY_MAGIC or size != os.fstat(fd).st_size - _BODY_HEADER.size
                or version > FORMAT_VERSION):
            raise FormatError(f"{path}: not a FanStore index copy")
        if check and _digest_of(fd, _BODY_HEADER.size, size) != digest:
            raise FormatError(f"{path}: index copy checksum mismatch")
        mm = mmap.mmap(fd, 0, prot=mmap.PROT_READ)
    finally:
        os.close(fd)
    if len(mm) != size + _BODY_HEADER.size:
        raise FormatError(f"{path}: truncated index copy")
    body = memoryview(mm)[_BODY_HEADER.size:]
    index = parse_body(body, path, version)
    index.raw_body_size = size
    index.stored_size = stored
    index.body = body
    index.where = where or path
    if validate:
        validate_index(index, where=path)
    return index

