"""Partition files: a 64-byte header followed by stored chunk bodies (docs/format.md).

A partition holds no metadata of its own beyond its header: where each chunk lives, its
codec and checksums are in the index. The writer computes the whole-file XXH3-128 as it
writes, so the index can record it without a second pass (staging verifies against it).
"""

from __future__ import annotations

import os
import struct

import xxhash

from fanstore.errors import FormatError, VersionTooNewError
from fanstore.storage import is_url, open_location

PARTITION_MAGIC = b"FANSTPRT"
# magic, version, flags, header size, partition number; zero padding to 64 bytes.
_HEADER = struct.Struct("<8sHHII")
PARTITION_HEADER_SIZE = 64
#: Version of the partition layout. It is unchanged since format v1 (format v2 changed only
#: the index), so partitions are written and read as v1.
PARTITION_VERSION = 1


def partition_name(number: int) -> str:
    return f"part-{number:05d}.fsp"


def encode_partition_header(number: int) -> bytes:
    head = _HEADER.pack(PARTITION_MAGIC, PARTITION_VERSION, 0, PARTITION_HEADER_SIZE, number)
    return head.ljust(PARTITION_HEADER_SIZE, b"\0")


def read_partition_header(buf: bytes, where: str = "partition") -> int:
    """Check a partition header and return the partition number it declares."""
    if len(buf) < PARTITION_HEADER_SIZE:
        raise FormatError(f"{where}: truncated header ({len(buf)} bytes)")
    magic, version, _flags, hsize, number = _HEADER.unpack_from(buf)
    if magic != PARTITION_MAGIC:
        raise FormatError(f"{where}: not a FanStore partition (bad magic)")
    if version > PARTITION_VERSION:
        raise VersionTooNewError(
            f"{where}: partition format v{version} is newer than this FanStore reads "
            f"(v{PARTITION_VERSION}); upgrade fanstore"
        )
    if version < 1 or hsize != PARTITION_HEADER_SIZE:
        raise FormatError(f"{where}: unsupported partition header (v{version}, {hsize} bytes)")
    return number


class PartitionWriter:
    """Append-only writer of one partition file; ``append`` returns the blob's offset."""

    def __init__(self, path: str, number: int, buffer_size: int = 4 << 20,
                 mode: int = 0o666) -> None:
        """A new partition at ``path`` (a file created exclusively, never through a
        symlink, with ``mode`` narrowed by the umask; an object-store URL: an upload)."""
        self.path = path
        self.number = number
        self._remote = None
        if is_url(path):  # object storage: a multipart upload, complete only at close()
            parent, _, name = path.rstrip("/").rpartition("/")
            self._remote = self._f = open_location(parent).open_write(name)
        else:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                         | os.O_CLOEXEC, mode)
            self._f = open(fd, "wb", buffering=buffer_size)
        self._hash = xxhash.xxh3_128()
        self.size = 0
        self._write(encode_partition_header(number))

    def _write(self, data) -> None:
        self._f.write(data)
        self._hash.update(data)
        self.size += len(data)

    def append(self, data) -> int:
        offset = self.size
        self._write(data)
        return offset

    def close(self) -> str:
        """Flush, fsync and close; return the file's XXH3-128 as hex."""
        if self._remote is not None:
            self._remote.close()
            return self._hash.hexdigest()
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()
        return self._hash.hexdigest()

    def abort(self) -> None:
        if self._remote is not None:
            self._remote.abort()
            return
        try:
            self._f.close()
        except OSError:
            pass  # flushing the buffer fails again after ENOSPC/EIO: the file goes anyway
        finally:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass


def file_checksum(path: str, block: int = 8 << 20) -> str:
    """XXH3-128 (hex) of a whole file, as recorded in the index's partition table."""
    h = xxhash.xxh3_128()
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(block)
        view = memoryview(buf)
        while True:
            n = f.readinto(buf)
            if not n:
                break
            h.update(view[:n])
    return h.hexdigest()
