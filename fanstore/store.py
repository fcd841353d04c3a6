"""A packed store opened in this process: its index, namespace and a reader of its partitions.

The synchronous way in for ``fanstore cat`` and the Python API on a store directory (no
FUSE, no daemon). Reading goes through the read core (:mod:`fanstore.read`).
"""

from __future__ import annotations

from fanstore.format.index import read_index
from fanstore.namespace import Namespace
from fanstore.read import ChunkReader, LocalPartitions


class LocalStore:
    """A packed store on a local or shared file system, read in this process.

    Thread-safe; after ``fork`` call :meth:`after_fork` in the child (the Python API does).
    """

    def __init__(self, path: str, cache_bytes: int = 64 << 20) -> None:
        self.path = path
        self.index = read_index(path)
        self.ns = Namespace(self.index)
        self.parts = LocalPartitions(path, self.index)
        self.reader = ChunkReader(self.index, self.parts, cache_bytes)

    def close(self) -> None:
        self.parts.close()

    def __enter__(self) -> "LocalStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def file_entry(self, path: str | bytes) -> int:
        """The file a path names (symlinks followed: see Namespace.resolve)."""
        return self.ns.file_entry(path)

    def read(self, entry: int, offset: int = 0, size: int = -1) -> bytes:
        return bytes(self.reader.read(entry, offset, size))

    def read_file(self, path: str | bytes) -> bytes:
        return self.read(self.file_entry(path))

    def iter_file(self, entry: int):
        """Decoded bytes of a file, one chunk at a time (bounded memory for huge files)."""
        return self.reader.iter_file(entry, keep=False)

    def after_fork(self) -> None:
        self.reader.after_fork()
