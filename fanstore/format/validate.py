"""Validation of a loaded index: refuse one whose structure could make a reader misbehave.

Everything read from disk is validated before use (:func:`validate_index`, called by
:mod:`fanstore.format.load`): a hostile or corrupt index is refused instead of making a
reader touch bytes outside the store. Symlink targets are judged here lexically
(:func:`target_stays_inside`, also used by the packers) and walked through the tree
(:mod:`fanstore.format.symlinks`).
"""

from __future__ import annotations

import os
import posixpath
from typing import TYPE_CHECKING

import numpy as np

from fanstore.errors import FormatError
from fanstore.format.layout import (
    KIND_DIR,
    KIND_FILE,
    KIND_SYMLINK,
    MAX_CHUNK_SIZE,
    MAX_META_INT,
    MAX_NAME,
    MAX_TARGET,
)
from fanstore.format.partition import PARTITION_HEADER_SIZE
from fanstore.format.symlinks import ESCAPES, Resolver, components

if TYPE_CHECKING:
    from fanstore.format.tables import Index


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

    e, c = index.entries, index.chunks
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
    if np.any(f_size > np.uint64(MAX_META_INT)):
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
    if np.any(c["offset"] > np.uint64(MAX_META_INT)):
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


class _IndexTree:
    """The index as a tree for :class:`fanstore.format.symlinks.Resolver`."""

    root = 0

    def __init__(self, index: Index) -> None:
        self.index = index
        self._kind = index.entries["kind"]
        self._parent = index.entries["parent"]

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
