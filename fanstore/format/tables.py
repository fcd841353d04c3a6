"""The loaded index: its tables as read-only numpy arrays, and the lookups on them.

An :class:`Index` is made by :mod:`fanstore.format.load` (from a store) or
:func:`fanstore.format.localcopy.map_index_body` (from the node's shared copy), always
validated first; paths are resolved by :class:`fanstore.namespace.Namespace` (the one
symlink rule), which asks the index for one name at a time (:meth:`Index.lookup`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fanstore.format.layout import KIND_FILE, PartitionInfo, name_hash
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

    def lookup(self, parent: int, name: bytes) -> int | None:
        """The entry called ``name`` in directory ``parent``, or None (hot: every LOOKUP)."""
        h = name_hash(parent, name)
        lk_hash = self.lk_hash
        i = int(lk_hash.searchsorted(np.uint64(h)))
        n = lk_hash.shape[0]
        e = self.entries
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
        key = name_hash
        hashes = np.fromiter((key(int(p), nm) for p, nm in zip(parents, names)),
                             dtype=np.uint64, count=n)
        idx = self.lk_hash.searchsorted(hashes)
        idx[idx >= len(self.lk_hash)] = 0
        cand = self.lk_entry[idx].astype(np.int64)
        e = self.entries
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

    def chunk_run(self, entry: int) -> tuple[int, int]:
        """(first chunk row, number of chunks) of a file entry: its rows of ``chunks``."""
        return int(self.entries["first"][entry]), int(self.entries["count"][entry])

    def stored_bytes_of(self, entry: int) -> int:
        first, count = self.chunk_run(entry)
        return int(self.chunks["stored"][first : first + count].sum())

    def file_entries(self) -> np.ndarray:
        return np.nonzero(self.entries["kind"] == KIND_FILE)[0]
