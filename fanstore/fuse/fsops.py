"""The file system's logic, shared by both FUSE frontends: one operations object, two thin
adapters (pyfuse3 in :mod:`fanstore.fuse.pyfuse3.operations`, the kernel protocol in
:mod:`fanstore.fuse.kernelfs.handler`).

Everything here answers from the namespace (no I/O, no FUSE types) and raises FanStore
errors carrying their errno; each adapter turns answers into its own reply format and
errors into errnos. Inode = index entry + 1, so inode numbers are stable across mounts and
nodes. Attributes can be computed for many entries at once (numpy) for directory listings.
"""

from __future__ import annotations

import logging
import os
import stat as stat_mod

import numpy as np

from fanstore.errors import (
    DamagedDirectoryError,
    InvalidRequestError,
    IsADirectoryError_,
    NotADirectoryError_,
    NotFoundError,
    ReadOnlyError,
)
from fanstore.format.index import KIND_DIR, KIND_FILE, KIND_SYMLINK

#: The data never changes while mounted: let the kernel cache names and attributes for good
#: (finite: the kernel mishandles "infinite" timeouts and makes every access ask again).
TIMEOUT = 1_000_000
BLKSIZE = 131072
DIR_SIZE = 4096
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_TRUNC | os.O_APPEND | os.O_CREAT
_TYPE_BITS = np.array([stat_mod.S_IFREG, stat_mod.S_IFDIR, stat_mod.S_IFLNK], dtype=np.uint32)
#: d_type values (dirent.h) by entry kind
DT_BY_KIND = np.array([8, 4, 10], dtype=np.uint32)  # DT_REG, DT_DIR, DT_LNK

log = logging.getLogger(__name__)


class FsOps:
    """Read-only file system operations over a :class:`~fanstore.namespace.Namespace`."""

    def __init__(self, ns, uid: int | None = None, gid: int | None = None) -> None:
        self.ns = ns
        self.uid = os.getuid() if uid is None else uid
        self.gid = os.getgid() if gid is None else gid
        self.n_entries = ns.n_entries
        e = ns.index.entries
        self._kind = e["kind"]
        self._mode = e["mode"]
        self._size = e["size"]
        self._mtime = e["mtime_ns"]
        self.files = ns.n_files
        self.raw_bytes = ns.raw_bytes
        #: damaged directories (paths) this process has logged: one line each, not one
        #: per lookup (a lookup in one is EIO every time)
        self.damaged_logged: set[str] = set()

    # ------------------------------------------------------------------ entries
    def entry(self, inode: int) -> int:
        entry = inode - 1
        if not 0 <= entry < self.n_entries:
            raise NotFoundError(f"no inode {inode}")
        return entry

    def lookup(self, parent_inode: int, name: bytes) -> int:
        parent = self.entry(parent_inode)
        if int(self._kind[parent]) != KIND_DIR:
            raise NotADirectoryError_(f"inode {parent_inode} is not a directory")
        try:
            entry = self.ns.lookup(parent, name)
        except DamagedDirectoryError as exc:
            if exc.directory not in self.damaged_logged:
                self.damaged_logged.add(exc.directory)
                log.error("%s", exc)
            raise
        if entry is None:
            raise NotFoundError("no such entry")
        return entry

    def kind(self, entry: int) -> int:
        return int(self._kind[entry])

    # ------------------------------------------------------------------ attributes
    def attr(self, entry: int) -> tuple[int, int, int, int, int, int]:
        """(inode, st_mode, st_nlink, st_size, st_blocks, mtime_ns) of one entry."""
        kind = int(self._kind[entry])
        size = DIR_SIZE if kind == KIND_DIR else int(self._size[entry])
        nlink = self.ns.dir_nlink(entry) if kind == KIND_DIR else 1
        mode = int(_TYPE_BITS[kind]) | int(self._mode[entry])
        return entry + 1, mode, nlink, size, (size + 511) // 512, int(self._mtime[entry])

    def attrs(self, entries: np.ndarray) -> dict[str, np.ndarray]:
        """The attributes of many entries at once: arrays ino, mode, nlink, size, blocks,
        mtime_ns, dtype (d_type)."""
        kind = self._kind[entries].astype(np.intp)
        is_dir = kind == KIND_DIR
        size = np.where(is_dir, DIR_SIZE, self._size[entries].astype(np.int64))
        nlink = np.ones(len(entries), dtype=np.uint32)
        if is_dir.any():
            nlink[is_dir] = self.ns.dir_nlinks(entries[is_dir])
        return {
            "ino": entries.astype(np.uint64) + 1,
            "mode": _TYPE_BITS[kind] | self._mode[entries].astype(np.uint32),
            "nlink": nlink,
            "size": size.astype(np.uint64),
            "blocks": ((size + 511) // 512).astype(np.uint64),
            "mtime_ns": self._mtime[entries].astype(np.int64),
            "dtype": DT_BY_KIND[kind],
        }

    # ------------------------------------------------------------------ operations
    def readlink(self, entry: int) -> bytes:
        if int(self._kind[entry]) != KIND_SYMLINK:
            raise InvalidRequestError("not a symbolic link")
        return self.ns.readlink(entry)

    def children(self, entry: int) -> range:
        if int(self._kind[entry]) != KIND_DIR:
            raise NotADirectoryError_("not a directory")
        return self.ns.children(entry)

    def check_open(self, entry: int, flags: int) -> None:
        """What opening a file with ``flags`` may do: only read a regular file."""
        if flags & WRITE_FLAGS:
            raise ReadOnlyError("read-only file system")
        kind = int(self._kind[entry])
        if kind == KIND_DIR:
            raise IsADirectoryError_("is a directory")
        if kind != KIND_FILE:
            raise InvalidRequestError("not a regular file")

    def check_access(self, entry: int, mode: int) -> None:
        if mode & os.W_OK:
            raise ReadOnlyError("read-only file system")

    def file_size(self, entry: int) -> int:
        return int(self._size[entry])

    def statfs(self) -> dict[str, int]:
        return {"bsize": BLKSIZE, "frsize": 4096, "blocks": (self.raw_bytes + 4095) // 4096,
                "bfree": 0, "bavail": 0, "files": self.n_entries, "ffree": 0, "favail": 0,
                "namemax": 255}
