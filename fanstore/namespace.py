"""Read-only, in-memory namespace over a loaded index: lookup, stat, readdir, readlink.

No I/O and no async: every answer comes from the index's arrays. Entry ids are stable
(they are the index rows), so inode numbers derived from them are stable too.
"""

from __future__ import annotations

import os
import stat as stat_mod
from collections import deque
from dataclasses import dataclass

import numpy as np

from fanstore.errors import (
    DamagedDirectoryError,
    FanStoreError,
    FormatError,
    IsADirectoryError_,
    NotADirectoryError_,
    NotFoundError,
    OutsideStoreError,
    SymlinkLoopError,
)
from fanstore.format.index import KIND_DIR, KIND_FILE, KIND_SYMLINK, Index
from fanstore.format.symlinks import MAX_HOPS, components

_TYPE_BITS = {KIND_FILE: stat_mod.S_IFREG, KIND_DIR: stat_mod.S_IFDIR,
              KIND_SYMLINK: stat_mod.S_IFLNK}


def metadata_bytes(index: Index) -> int:
    """Bytes a node holds for the namespace: the index's tables as the node's mapped copy
    has them (what ``fanstore stats``/``info`` report). A v1/v2 lookup table is counted (it
    is in the copy) though no reader touches it; a column a version lacks costs nothing."""
    columns = [a for a in (*index.entries.values(), *index.chunks.values())
               if a.strides != (0,)]
    total = sum(a.nbytes for a in columns)
    total += index.lk_hash.nbytes + index.lk_entry.nbytes + len(index.names)
    total += len(index.targets)
    return total


#: Symlinks followed in one path lookup before giving up (Linux's limit).
MAX_SYMLINKS = MAX_HOPS


def _show(path: bytes) -> str:
    return os.fsdecode(path) or "/"


@dataclass(frozen=True)
class Stat:
    entry: int
    mode: int  # full st_mode, type bits included
    size: int
    mtime_ns: int
    nlink: int
    kind: int


class Namespace:
    """Path and attribute queries on an :class:`Index` (entry 0 is the root)."""

    ROOT = 0

    def __init__(self, index: Index) -> None:
        self.index = index
        e = index.entries
        self._kind = e["kind"]
        self._parent = e["parent"]
        self._first = e["first"]
        self._count = e["count"]
        self._offset = e["offset"]
        self._size = e["size"]
        self._mode = e["mode"]
        self._mtime = e["mtime_ns"]
        # Nothing per entry is derived here: a process pays only for the pages it reads.
        counts = index.meta.get("counts", {})
        # (computed only when the metadata lacks them: a default argument would scan the
        # kind and size columns, every page of them, in every process)
        files = counts.get("files")
        self.n_files = int((self._kind == KIND_FILE).sum()) if files is None else int(files)
        raw = counts.get("raw_bytes")
        self.raw_bytes = (int(self._size[self._kind == KIND_FILE].sum()) if raw is None
                          else int(raw))

    @property
    def n_entries(self) -> int:
        return self.index.n_entries

    def kind(self, entry: int) -> int:
        return int(self._kind[entry])

    def is_dir(self, entry: int) -> bool:
        return int(self._kind[entry]) == KIND_DIR

    def parent(self, entry: int) -> int:
        return int(self._parent[entry])

    def lookup(self, parent: int, name: bytes) -> int | None:
        if name == b".":
            return parent
        if name == b"..":
            return int(self._parent[parent])
        return self.index.lookup(parent, name)

    def stat(self, entry: int) -> Stat:
        kind = int(self._kind[entry])
        nlink = self.dir_nlink(entry) if kind == KIND_DIR else 1
        return Stat(entry, _TYPE_BITS[kind] | int(self._mode[entry]), int(self._size[entry]),
                    int(self._mtime[entry]), nlink, kind)

    def dir_nlink(self, entry: int) -> int:
        """st_nlink of a directory: 2 + its subdirectories (counted in its run of children)."""
        first = int(self._first[entry])
        return 2 + int(np.count_nonzero(
            self._kind[first : first + int(self._count[entry])] == KIND_DIR))

    def dir_nlinks(self, dirs: np.ndarray) -> np.ndarray:
        """:meth:`dir_nlink` of many directories (uint32)."""
        return np.fromiter((self.dir_nlink(int(d)) for d in dirs), dtype=np.uint32,
                           count=len(dirs))

    def size(self, entry: int) -> int:
        return int(self._size[entry])

    def mode(self, entry: int) -> int:
        """Permission bits of an entry (no file-type bits)."""
        return int(self._mode[entry])

    def children(self, entry: int) -> range:
        if int(self._kind[entry]) != KIND_DIR:
            raise NotADirectoryError_(f"{self.show(entry)}: not a directory")
        first = int(self._first[entry])
        return range(first, first + int(self._count[entry]))

    def name(self, entry: int) -> bytes:
        return self.index.name(entry)

    def readlink(self, entry: int) -> bytes:
        return self.index.target(entry)

    def chunks(self, entry: int) -> tuple[int, int]:
        """(first chunk, number of chunks) of a file."""
        return int(self._first[entry]), int(self._count[entry])

    def data_offset(self, entry: int) -> int:
        """Where a file's bytes start in the decoded bytes of its first chunk: 0, except
        for a file in a solid chunk shared with other files (format v2)."""
        return int(self._offset[entry])

    def path(self, entry: int) -> bytes:
        return self.index.path(entry)

    def show(self, entry: int) -> str:
        return os.fsdecode(self.path(entry)) or "/"

    def resolve(self, path: str | bytes, follow: bool = False) -> int:
        """Entry for a path relative to the store root, resolved the way the mount resolves
        it: symlinks in the middle of the path are followed; the last component is followed
        only with ``follow`` (reading data follows, like ``open``; stat, ls and readlink do
        not, like ``lstat``). Raises NotFoundError, NotADirectoryError_ or SymlinkLoopError.

        This is FanStore's one symlink rule, used by the Python API, ``cat`` and ``ls``.
        Symlinks are resolved only inside the store: a path that goes through a symlink
        leading out (an absolute target, or ``..`` above the root, through any chain of
        symlinks) raises :class:`OutsideStoreError` (a NotFoundError) naming it; on the
        mount the kernel resolves such a link on the host. ``..`` at the root stays at the
        root when the path itself says it (as ``/..`` is ``/``).
        """
        if isinstance(path, str):
            path = os.fsencode(path)
        # (component, the symlink whose target it comes from, or -1 for the path's own)
        todo = [(p, -1) for p in reversed(components(path))]
        entry = 0
        links = 0
        kind = self._kind
        while todo:
            name, via = todo.pop()
            if int(kind[entry]) != KIND_DIR:
                raise NotADirectoryError_(f"{_show(path)}: not a directory")
            if name == b".":  # as the kernel: only a directory has one (``f/.``, ``f/``)
                continue
            if name == b"..":
                if entry == 0 and via >= 0:
                    raise self._outside(path, via)
                entry = int(self._parent[entry])
                continue
            child = self.index.lookup(entry, name)
            if child is None:
                raise NotFoundError(f"{_show(path)}: no such file or directory in the store")
            if int(kind[child]) == KIND_SYMLINK and (todo or follow):
                links += 1
                if links > MAX_SYMLINKS:
                    raise SymlinkLoopError(f"{_show(path)}: too many levels of symbolic links")
                target = self.index.target(child)
                if not target or b"\0" in target:
                    raise FormatError(f"{_show(path)}: a symlink on the way has an empty "
                                      "or NUL target (damaged or hostile index)")
                if target.startswith(b"/"):
                    raise self._outside(path, child)
                todo.extend((p, child) for p in reversed(components(target)))
                continue  # the target is relative to the link's directory: ``entry``
            entry = child
        return entry

    def _outside(self, path: bytes, link: int) -> OutsideStoreError:
        """The error for ``path``, which leads out of the store through symlink ``link``."""
        return OutsideStoreError(
            f"{_show(path)}: symlink {self.show(link)!r} -> "
            f"{os.fsdecode(self.index.target(link))!r} leads outside the store (FanStore's "
            "readers resolve symlinks only inside the store; read it through the mount)")

    def file_entry(self, path: str | bytes) -> int:
        """The regular file a path names, symlinks followed (what ``open`` would read)."""
        if isinstance(path, str):
            path = os.fsencode(path)
        entry = self.resolve(path, follow=True)
        if int(self._kind[entry]) == KIND_DIR:
            raise IsADirectoryError_(f"{_show(path.strip(b'/'))}: is a directory")
        return entry

    def file_entries(self, paths) -> list[int]:
        """:meth:`file_entry` of many paths at once (a prefetch order, a dataset's files):
        each directory resolved once, the names looked up together; -1 for a path that
        names no regular file. Anything unusual (a symlink on the way, ``..``) goes the
        one-path way."""
        dirs: dict[bytes, int] = {}
        parents = np.empty(len(paths), dtype=np.int64)
        names: list[bytes] = []
        for i, p in enumerate(paths):
            b = os.fsencode(p).strip(b"/")
            d, _, name = b.rpartition(b"/")
            parent = dirs.get(d)
            if parent is None:
                try:
                    parent = self.resolve(d, follow=True)
                    if int(self._kind[parent]) != KIND_DIR:
                        parent = -1
                except FanStoreError:
                    parent = -1
                dirs[d] = parent
            parents[i] = parent
            names.append(name)
        good = parents >= 0
        found = np.full(len(paths), -1, dtype=np.int64)
        if good.any():
            sel = np.nonzero(good)[0]
            try:
                found[sel] = self.index.lookup_many(parents[sel], [names[i] for i in sel])
            except DamagedDirectoryError:
                pass  # each path goes the one-path way: only those in the directory fail
        out = found.tolist()
        kind = self._kind
        for i, e in enumerate(out):
            name = names[i]
            if e >= 0 and int(kind[e]) == KIND_FILE and name not in (b"", b".", b".."):
                continue
            try:  # a symlink, a directory, a dotted name, or not there: as one path does
                out[i] = self.file_entry(paths[i])
                if int(kind[out[i]]) != KIND_FILE:
                    out[i] = -1
            except FanStoreError:
                out[i] = -1
        return out

    def walk_files(self, root: int = 0):
        """Yield every file entry below ``root`` in breadth-first order."""
        stack = deque([root])  # (a list's pop(0) made this quadratic in directories)
        while stack:
            d = stack.popleft()
            for child in self.children(d):
                k = int(self._kind[child])
                if k == KIND_DIR:
                    stack.append(child)
                elif k == KIND_FILE:
                    yield child
