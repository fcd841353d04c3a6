"""The loaded index: its tables as read-only numpy arrays, and the lookups on them.

An :class:`Index` is made by :mod:`fanstore.format.load` (from a store) or
:func:`fanstore.format.localcopy.map_index_body` (from the node's shared copy), always
validated first; paths are resolved by :class:`fanstore.namespace.Namespace` (the one
symlink rule), which asks the index for one name at a time (:meth:`Index.lookup`).

Nothing here is per entry in Python: an Index made by mapping a node's copy costs its
process only the pages its queries touch (a name is found by bisecting its directory's
sorted run of children; no hash table is built or read).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fanstore.errors import DamagedDirectoryError
from fanstore.format.layout import KIND_DIR, KIND_FILE, PartitionInfo, names_sorted
from fanstore.version import FORMAT_VERSION


@dataclass
class Index:
    """A loaded, validated index. Columns are read-only numpy arrays."""

    meta: dict[str, Any]
    #: one numpy column per entry field (``ENTRY_COLUMNS``): ``entries["size"][i]`` is the
    #: size of entry i; entry 0 is the root
    entries: dict[str, np.ndarray]
    #: one numpy column per chunk field (``CHUNK_COLUMNS``): a file's chunks are the rows
    #: ``entries["first"][i]`` .. ``+ entries["count"][i]``
    chunks: dict[str, np.ndarray]
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
    #: directories whose names this process has checked sorted (:meth:`check_sorted`)
    sorted_dirs: set = field(default_factory=set, repr=False, compare=False)
    #: where the index is from, for messages: the store (a path or URL) where known
    where: str = field(default="index", compare=False)

    # ---- shape
    @property
    def n_entries(self) -> int:
        return int(self.entries["kind"].shape[0])

    @property
    def n_chunks(self) -> int:
        return int(self.chunks["part"].shape[0])

    @property
    def chunk_size(self) -> int:
        return int(self.meta["chunk_size"])

    # ---- per-entry helpers (scalar; used off the hot path or by the namespace)
    def name(self, entry: int) -> bytes:
        off = int(self.entries["name_off"][entry])
        return bytes(self.names[off : off + int(self.entries["name_len"][entry])])

    def target(self, entry: int) -> bytes:
        off = int(self.entries["first"][entry])
        return bytes(self.targets[off : off + int(self.entries["count"][entry])])

    def path(self, entry: int) -> bytes:
        parts = []
        parent = self.entries["parent"]
        while entry != 0:
            parts.append(self.name(entry))
            entry = int(parent[entry])
        return b"/".join(reversed(parts))

    def check_sorted(self, parent: int) -> None:
        """Refuse (:class:`DamagedDirectoryError`, naming the store and the directory) a
        directory whose children are not sorted by name bytes, or repeat a name: lookups
        bisect them. Checked when a process first looks a name up in
        the directory (about 0.3 ms for 1,000 names), not when the index is loaded: at ten
        million files that whole check took 4 s of every mount's start-up."""
        if parent in self.sorted_dirs:
            return
        e = self.entries
        first, count = int(e["first"][parent]), int(e["count"][parent])
        if count > 1 and not names_sorted(np.frombuffer(self.names, dtype=np.uint8),
                                          e["name_off"][first : first + count],
                                          e["name_len"][first : first + count]):
            directory = os.fsdecode(self.path(parent)) or "/"
            raise DamagedDirectoryError(
                f"{self.where}: the names of directory {directory} are not sorted, or one "
                "repeats (damaged index): a lookup in it fails", directory)
        self.sorted_dirs.add(parent)

    def lookup(self, parent: int, name: bytes) -> int | None:
        """The entry called ``name`` in directory ``parent``, or None (hot: every LOOKUP).
        Bisects the directory's run of children (sorted by name bytes: checked on the
        first lookup in the directory, :meth:`check_sorted`)."""
        e = self.entries
        if int(e["kind"][parent]) != KIND_DIR:
            return None
        if parent not in self.sorted_dirs:
            self.check_sorted(parent)
        lo = int(e["first"][parent])
        hi = lo + int(e["count"][parent])
        name_off, name_len, names = e["name_off"], e["name_len"], self.names
        while lo < hi:
            mid = (lo + hi) >> 1
            off = int(name_off[mid])
            probe = bytes(names[off : off + int(name_len[mid])])  # names may be a mapping
            if probe < name:
                lo = mid + 1
            elif probe == name:
                return mid
            else:
                hi = mid
        return None

    def children_names(self, parent: int) -> np.ndarray:
        """The names of a directory's children as one numpy ``S`` array, in their (sorted)
        order: for looking many names up at once with ``searchsorted``."""
        e = self.entries
        first, count = int(e["first"][parent]), int(e["count"][parent])
        if not count:
            return np.zeros(0, dtype="S1")
        off = e["name_off"][first : first + count].astype(np.int64)
        ln = e["name_len"][first : first + count].astype(np.int64)
        width = int(ln.max())
        blob = np.frombuffer(self.names, dtype=np.uint8)
        cols = np.arange(width)
        grid = blob[np.minimum(off[:, None] + cols, len(blob) - 1)]
        grid[cols >= ln[:, None]] = 0  # names hold no NUL: padding sorts first, as bytes do
        return grid.view(f"S{width}").ravel()

    def lookup_many(self, parents: np.ndarray, names: list[bytes]) -> np.ndarray:
        """:meth:`lookup` of many (parent, name) pairs at once: their entries, -1 where
        there is none. One ``searchsorted`` per distinct parent directory (or, for a few
        names of a directory 16 times larger, a bisection each)."""
        n = len(names)
        out = np.full(n, -1, dtype=np.int64)
        if not n:
            return out
        parents = np.asarray(parents, dtype=np.int64)
        kind, first = self.entries["kind"], self.entries["first"]
        order = np.argsort(parents, kind="stable")
        bounds = np.flatnonzero(np.diff(parents[order])) + 1
        for group in np.split(order, bounds):
            parent = int(parents[group[0]])
            if not 0 <= parent < self.n_entries or int(kind[parent]) != KIND_DIR:
                continue
            if int(self.entries["count"][parent]) > 16 * len(group):
                # a few names of a large directory: bisect each (no array of all its names)
                for i in group:
                    found = self.lookup(parent, names[i])
                    out[i] = -1 if found is None else found
                continue
            self.check_sorted(parent)
            have = self.children_names(parent)
            if not len(have):
                continue
            want = np.array([names[i] for i in group], dtype=f"S{max(have.itemsize, 1)}")
            fits = np.fromiter((0 < len(names[i]) <= have.itemsize for i in group),
                               dtype=bool, count=len(group))
            at = np.minimum(have.searchsorted(want), len(have) - 1)
            hit = fits & (have[at] == want)
            out[group[hit]] = int(first[parent]) + at[hit]
        return out

    def chunk_run(self, entry: int) -> tuple[int, int]:
        """(first chunk row, number of chunks) of a file entry: its rows of ``chunks``."""
        return int(self.entries["first"][entry]), int(self.entries["count"][entry])

    def stored_bytes_of(self, entry: int) -> int:
        first, count = self.chunk_run(entry)
        return int(self.chunks["stored"][first : first + count].sum())

    def file_entries(self) -> np.ndarray:
        return np.nonzero(self.entries["kind"] == KIND_FILE)[0]
