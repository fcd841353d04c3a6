"""Partition files on this node's disk: opened once, checked against the index, read by pread.

:class:`LocalPartitions` is the ``local`` :class:`~fanstore.read.sources.ChunkSource`: every
reader process of a node (FUSE workers, Python API readers, ``cat``, ``verify``) opens the
partitions staged on the node itself and reads them with ``pread``, which has no shared file
offset, so one object is safe from many threads and after ``fork``.
"""

from __future__ import annotations

import os
import stat

from fanstore.errors import CorruptDataError, FormatError
from fanstore.format.index import Index
from fanstore.format.partition import PARTITION_HEADER_SIZE, partition_name, read_partition_header


class LocalPartitions:
    """Read-only access to partition files in one directory (a store or a staging dir).

    ``numbers`` limits which partitions are opened (a rank opens only its own). Each file's
    size and header are checked against the index on open, so a truncated or foreign
    partition is refused up front (FormatError naming it).
    """

    def __init__(self, directory: str, index: Index, numbers=None) -> None:
        self.directory = directory
        self._fds: dict[int, int] = {}
        self._sizes = {p.number: p.size for p in index.partitions}
        wanted = range(len(index.partitions)) if numbers is None else sorted(set(numbers))
        try:
            for n in wanted:
                self._fds[n] = open_partition(directory, index, n)
        except BaseException:
            self.close()
            raise

    @classmethod
    def available(cls, directory: str, index: Index, numbers=None
                  ) -> tuple["LocalPartitions", dict[int, str]]:
        """Open every partition that opens cleanly; return them and {number: problem} for
        the others (``verify`` reports the files of a broken partition as damaged)."""
        parts = cls(directory, index, numbers=[])
        wanted = range(len(index.partitions)) if numbers is None else sorted(set(numbers))
        broken: dict[int, str] = {}
        for n in wanted:
            try:
                parts._fds[n] = open_partition(directory, index, n)
            except FormatError as exc:
                text = str(exc)
                broken[n] = text.split(": ", 1)[-1] if ": " in text else text
        return parts, broken

    # ------------------------------------------------------------------ ChunkSource
    @property
    def numbers(self) -> list[int]:
        return sorted(self._fds)

    def has(self, part: int) -> bool:
        return part in self._fds

    is_local = has

    def fallback(self, part: int):
        """Nowhere else to read a damaged local copy from."""
        return None

    def size_of(self, part: int) -> int:
        return self._sizes[part]

    def fetch(self, part: int, offset: int, length: int, entry: int | None = None) -> bytes:
        fd = self._fds.get(part)
        if fd is None:
            raise FormatError(f"partition {part} is not available here")
        data = os.pread(fd, length, offset)
        if len(data) == length:
            return data
        pieces = [data]
        got = len(data)
        while got < length:
            more = os.pread(fd, length - got, offset + got)
            if not more:
                raise CorruptDataError(
                    f"partition {part}: short read at offset {offset} ({got} of {length} bytes)")
            pieces.append(more)
            got += len(more)
        return b"".join(pieces)

    def advise(self, part: int, offset: int, length: int) -> None:
        """The bytes at [offset, offset+length) will be read soon: let the kernel start."""
        fd = self._fds.get(part)
        if fd is not None and length > 0:
            try:
                os.posix_fadvise(fd, offset, length, os.POSIX_FADV_WILLNEED)
            except OSError:
                pass

    def read_into(self, part: int, offset: int, view: memoryview) -> None:
        """Fill ``view`` with the partition's bytes at ``offset`` (no intermediate copy)."""
        fd = self._fds.get(part)
        if fd is None:
            raise FormatError(f"partition {part} is not available here")
        got = 0
        while got < len(view):
            n = os.preadv(fd, [view[got:]], offset + got)
            if n <= 0:
                raise CorruptDataError(f"partition {part}: short read at offset {offset + got}")
            got += n

    def close(self) -> None:
        fds, self._fds = self._fds, {}
        for fd in fds.values():
            try:
                os.close(fd)
            except OSError:
                pass

    def __enter__(self) -> "LocalPartitions":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def open_partition(directory: str, index: Index, n: int) -> int:
    """Open partition ``n`` in ``directory`` and check it against the index; return its fd."""
    name = partition_name(n)
    path = os.path.join(directory, name)
    try:
        # O_NONBLOCK: a FIFO in a partition's place must not block the reader (refused below);
        # regular files ignore the flag.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise FormatError(f"{directory}: partition {name} is missing") from None
    except OSError as exc:
        raise FormatError(f"{path}: cannot open partition: {exc.strerror}") from exc
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise FormatError(f"{path}: partition is not a regular file")
        expected = index.partitions[n].size
        if st.st_size != expected:
            raise FormatError(
                f"{path}: partition is {'truncated' if st.st_size < expected else 'too long'} "
                f"({st.st_size} bytes, the index says {expected})")
        number = read_partition_header(os.pread(fd, PARTITION_HEADER_SIZE, 0), path)
        if number != n:
            raise FormatError(f"{path}: header says partition {number}, expected {n}")
    except BaseException:
        os.close(fd)
        raise
    return fd
