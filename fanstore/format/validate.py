"""Validation of a loaded index: refuse one whose structure could make a reader misbehave.

Everything read from disk is validated before use (:func:`validate_index`, called by
:mod:`fanstore.format.load`): a hostile or corrupt index is refused instead of making a
reader touch bytes outside the store. Symlink targets are checked for what a reader needs
(bounds, no NUL), not for where they lead: one may leave the store (see
:func:`_check_symlinks`). :func:`target_stays_inside` is the packers' lexical test.
"""

from __future__ import annotations

import os
import posixpath
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

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
    NO_LOOKUP_FROM,
    SHARED_RUNS_FROM,
    pairs_out_of_order,
)
from fanstore.format.partition import PARTITION_HEADER_SIZE

if TYPE_CHECKING:
    from fanstore.format.tables import Index

#: Directory levels a message follows to name a directory of a damaged tree.
MAX_DEPTH_SHOWN = 4096

#: Makes the error for a refused index (its message prefixed with where the index is from).
_Refusal = Callable[[str], FormatError]


def validate_index(
    index: Index, partition_sizes: dict[int, int] | None = None, where: str = "index"
) -> None:
    """Refuse an index whose structure could make a reader misbehave.

    Checks (vectorised, cheap even for millions of entries): the tree shape, names (no '/',
    NUL, '.', '..' or empty components), symlink targets are in bounds, not empty and
    without NUL (they may lead outside the store, as in squashfs), chunk runs
    are in bounds, contiguous and inside their partitions, chunk sizes are bounded (no
    decompression bombs), every chunk belongs to a file; a file of several chunks owns them
    (no other file refers to any; from v4, files with exactly the same run, identical files
    stored once, may all refer to it) and its size is their sum; a file of one chunk lies
    inside it (``offset + size <= raw``), and from v2 on it may share the chunk with other
    files.
    """

    def bad(msg: str) -> FormatError:
        return FormatError(f"{where}: {msg}")

    # The order of the checks is the order of the messages a corrupt index gets.
    _check_header(index, bad)
    dirs = np.nonzero(index.entries["kind"] == KIND_DIR)[0]
    _check_tree_shape(index, dirs, bad)
    _check_names(index, bad)
    if index.version < NO_LOOKUP_FROM:
        _check_lookup_table(index, bad)
    _check_symlinks(index, bad)
    file_runs = _check_file_entries(index, dirs, bad)
    if not index.n_chunks:
        return
    chunks = _check_chunk_table(index, partition_sizes, bad)
    _check_chunk_owners(index, file_runs, chunks, bad)
    _check_no_overlap_in_partitions(chunks, bad)


class _FileRuns(NamedTuple):
    """The files that have chunks, one int64 row each: their chunk run and their data."""

    first: np.ndarray  # first chunk of the run
    count: np.ndarray  # chunks in the run (> 0)
    size: np.ndarray  # bytes of the file
    offset: np.ndarray  # where the file's data starts in its first chunk (v2)

    def where(self, mask: np.ndarray) -> _FileRuns:
        return _FileRuns(self.first[mask], self.count[mask], self.size[mask], self.offset[mask])


class _ChunkColumns(NamedTuple):
    """The chunk table's columns as int64, checked against the partitions."""

    raw: np.ndarray
    stored: np.ndarray
    part: np.ndarray
    offset: np.ndarray


def _check_header(index: Index, bad: _Refusal) -> None:
    """The chunk size is bounded; entry 0 is the root directory; kinds and modes are known."""
    entries = index.entries
    chunk_size = index.chunk_size
    if not 0 < chunk_size <= MAX_CHUNK_SIZE:
        raise bad(f"bad chunk size {chunk_size}")
    if index.n_entries < 1:
        raise bad("no root entry")
    kind = entries["kind"]
    if kind[0] != KIND_DIR or entries["parent"][0] != 0 or entries["name_len"][0] != 0:
        raise bad("entry 0 is not the root directory")
    if np.any(kind > KIND_SYMLINK):
        raise bad("unknown entry kind")
    if np.any(entries["mode"] > 0o7777):
        raise bad("mode has bits beyond 07777")


def _check_tree_shape(index: Index, dirs: np.ndarray, bad: _Refusal) -> None:
    """The children runs of the directories ``dirs`` tile entries 1..n-1 in directory
    order (breadth-first), and every entry follows its parent."""
    entries, n_entries = index.entries, index.n_entries
    dir_first = entries["first"][dirs].astype(np.int64)
    dir_count = entries["count"][dirs].astype(np.int64)
    if dir_count.sum() != n_entries - 1:
        raise bad("directory child counts do not add up to the number of entries")
    expected_first = np.concatenate(([1], 1 + np.cumsum(dir_count)[:-1])) if len(dirs) else []
    if not np.array_equal(dir_first, expected_first):
        d = int(dirs[np.flatnonzero(dir_first != expected_first)[0]])
        raise bad("directory child runs are not contiguous in breadth-first order "
                  f"(first at directory {_dir_name(index, d)})")
    if n_entries > 1:
        parent = entries["parent"][1:].astype(np.int64)
        expected_parent = np.repeat(dirs, dir_count)
        if not np.array_equal(parent, expected_parent):
            d = int(expected_parent[np.flatnonzero(parent != expected_parent)[0]])
            raise bad("entries are not where their parent's child run says (first in the "
                      f"run of directory {_dir_name(index, d)})")
        if np.any(parent >= np.arange(1, n_entries)):
            raise bad("an entry precedes its parent")


def _dir_name(index: Index, d: int) -> str:
    """How a message names directory entry ``d`` of an index whose tree is not yet known to
    be sound: its path where its chain of parents leads to the root, and its entry."""
    parent, parts, e = index.entries["parent"], [], d
    for _ in range(MAX_DEPTH_SHOWN):
        if e == 0:
            return f"{os.fsdecode(b'/'.join(reversed(parts))) or '/'} (entry {d})"
        up = int(parent[e])
        if up >= e:  # a broken link (or a loop): no path to show
            break
        parts.append(index.name(e))
        e = up
    return f"entry {d}"


def _check_names(index: Index, bad: _Refusal) -> None:
    """Every entry but the root has a name inside the name table: not empty, not over-long,
    without '/' or NUL, not '.' or '..'."""
    entries, n_entries = index.entries, index.n_entries
    # Bounds are checked on the unsigned values first: a u64 offset above 2**63 would turn
    # negative as an int64 and slip past the checks below.
    names = np.frombuffer(index.names, dtype=np.uint8)
    if np.any(entries["name_off"][1:] > len(names)):
        raise bad("a name lies outside the name table")
    name_off = entries["name_off"][1:].astype(np.int64)
    name_len = entries["name_len"][1:].astype(np.int64)
    if np.any(name_len == 0) or np.any(name_len > MAX_NAME):
        raise bad("an entry has an empty or over-long name")
    if np.any(name_off + name_len > len(names)):
        raise bad("a name lies outside the name table")
    if np.any(names == ord("/")) or np.any(names == 0):
        raise bad("a name contains '/' or NUL")
    dot = ord(".")
    if n_entries > 1:
        first_byte = names[name_off]
        second_byte = names[np.minimum(name_off + 1, max(len(names) - 1, 0))]
        if np.any((name_len == 1) & (first_byte == dot)) or np.any(
            (name_len == 2) & (first_byte == dot) & (second_byte == dot)
        ):
            raise bad("an entry is named '.' or '..'")


def _check_lookup_table(index: Index, bad: _Refusal) -> None:
    """(v1, v2) The lookup table has one sorted row per entry but the root, naming real
    entries (readers no longer use it, but a store with a bad one is damaged)."""
    n_entries = index.n_entries
    if index.lk_hash.shape[0] != n_entries - 1 or index.lk_entry.shape[0] != n_entries - 1:
        raise bad("lookup table has the wrong length")
    if n_entries > 1:
        if np.any(index.lk_hash[1:] < index.lk_hash[:-1]):
            raise bad("lookup table is not sorted")
        if np.any(index.lk_entry == 0) or np.any(index.lk_entry >= n_entries):
            raise bad("lookup table points outside the entry table")


def _check_symlinks(index: Index, bad: _Refusal) -> None:
    """Symlink targets lie in the target table, are not empty or over-long and hold no NUL.
    Where they lead is not judged: a target may leave the store (absolute, or ``..`` above
    the root), as in squashfs and tar; the mount returns it as it is and the kernel resolves
    it on the host, and FanStore's own readers resolve symlinks only inside the store
    (``Namespace.resolve``: ``OutsideStoreError``). Stores written before that was allowed
    never hold such a target, so they open as before (docs/format.md, "Versions")."""
    links = np.nonzero(index.entries["kind"] == KIND_SYMLINK)[0]
    if not len(links):
        return
    _check_target_bounds(index, links, bad)
    for entry in links.tolist():
        if b"\0" in index.target(entry):
            raise bad("a symlink target contains NUL")


def _check_target_bounds(index: Index, links: np.ndarray, bad: _Refusal) -> None:
    """The targets of the symlinks ``links`` lie in the target table, are not empty or
    over-long, and each symlink's size is its target's length."""
    first, count = index.entries["first"][links], index.entries["count"][links]
    if np.any(first > len(index.targets)):
        raise bad("a symlink target lies outside the target table or is empty")
    target_end = first.astype(np.int64) + count.astype(np.int64)
    if np.any(target_end > len(index.targets)) or np.any(count == 0):
        raise bad("a symlink target lies outside the target table or is empty")
    if np.any(count > MAX_TARGET):
        raise bad("a symlink target is over-long")
    if np.any(index.entries["size"][links] != count):
        raise bad("a symlink's size differs from its target length")


def _check_file_entries(index: Index, dirs: np.ndarray, bad: _Refusal) -> _FileRuns:
    """Only files carry data; a file's chunk run lies in the chunk table and a file without
    chunks is empty. Return the runs of the files that have chunks."""
    entries, n_chunks = index.entries, index.n_chunks
    kind, first, count = entries["kind"], entries["first"], entries["count"]
    files = np.nonzero(kind == KIND_FILE)[0]
    nonfile = np.nonzero(kind != KIND_FILE)[0]
    if np.any(entries["checksum"][nonfile] != 0) or np.any(entries["size"][dirs] != 0):
        raise bad("a directory or symlink carries file data")
    if np.any(entries["offset"][nonfile] != 0):
        raise bad("a directory or symlink has a data offset")
    run_count = count[files].astype(np.int64)
    if np.any(first[files] > np.uint64(n_chunks)):  # unsigned, before any arithmetic
        raise bad("a file's chunk run lies outside the chunk table")
    run_first = first[files].astype(np.int64)
    size = entries["size"][files]
    if np.any(size > np.uint64(MAX_META_INT)):
        raise bad("a file claims an absurd size")
    size = size.astype(np.int64)
    offset = entries["offset"][files].astype(np.int64)
    used = run_count > 0
    if np.any(size[~used] != 0) or np.any(offset[~used] != 0):
        raise bad("a file's size differs from the sum of its chunks")
    if np.any(run_first[used] + run_count[used] > n_chunks):
        raise bad("a file's chunk run lies outside the chunk table")
    return _FileRuns(run_first, run_count, size, offset).where(used)


def _check_chunk_table(
    index: Index, partition_sizes: dict[int, int] | None, bad: _Refusal
) -> _ChunkColumns:
    """Chunk sizes are bounded (no decompression bombs), codecs and partitions exist, and
    each chunk lies inside its partition (of ``partition_sizes`` where given)."""
    table = index.chunks
    if np.any(table["offset"] > np.uint64(MAX_META_INT)):
        raise bad("a chunk lies outside its partition")
    chunks = _ChunkColumns(
        raw=table["raw"].astype(np.int64),
        stored=table["stored"].astype(np.int64),
        part=table["part"].astype(np.int64),
        offset=table["offset"].astype(np.int64),
    )
    if np.any(chunks.raw == 0) or np.any(chunks.raw > index.chunk_size):
        raise bad("a chunk claims an absurd raw size (possible decompression bomb)")
    if np.any(chunks.stored == 0):
        raise bad("a chunk has no stored bytes")
    if np.any(table["codec"] >= len(index.codecs)):
        raise bad("a chunk names a codec outside the codec table")
    if np.any(chunks.part >= len(index.partitions)):
        raise bad("a chunk names a partition outside the partition table")
    sizes = np.array([p.size for p in index.partitions], dtype=np.int64)
    if partition_sizes is not None:
        for number, size in partition_sizes.items():
            sizes[number] = size
    if np.any(chunks.offset < PARTITION_HEADER_SIZE) or np.any(
        chunks.offset + chunks.stored > sizes[chunks.part]
    ):
        raise bad("a chunk lies outside its partition")
    return chunks


def _check_chunk_owners(
    index: Index, runs: _FileRuns, chunks: _ChunkColumns, bad: _Refusal
) -> None:
    """Every chunk belongs to a file. Files of one chunk may share it (solid chunks, from
    v2): their bytes lie inside it. Files of several chunks own them: no other file refers
    to any, but from v4 other files with the very same run (first and count, so the same
    size too: identical files stored once)."""
    refs = _references_per_chunk(runs, index.n_chunks)
    if np.any(refs == 0):
        raise bad("a chunk belongs to no file")
    single = runs.count == 1
    singles = runs.where(single)
    if np.any(singles.offset + singles.size > chunks.raw[singles.first]):
        raise bad("a file's data lies outside its chunk")
    # (runs.offset covers all files with a non-zero offset: a file without chunks has none)
    if index.version < 2 and (np.any(refs > 1) or np.any(singles.size != chunks.raw[singles.first])
                              or np.any(runs.offset != 0)):
        raise bad("a file's size differs from the sum of its chunks")
    multi = ~single
    if np.any(multi):
        if index.version >= SHARED_RUNS_FROM:  # count each distinct run once
            refs = _references_per_chunk(_distinct_runs(runs), index.n_chunks)
        _check_multi_chunk_files(index.chunk_size, runs.where(multi), refs, chunks, bad)


def _references_per_chunk(runs: _FileRuns, n_chunks: int) -> np.ndarray:
    """How many files refer to each chunk (a difference array over the runs)."""
    diff = np.zeros(n_chunks + 1, dtype=np.int64)
    np.add.at(diff, runs.first, 1)
    np.add.at(diff, runs.first + runs.count, -1)
    return np.cumsum(diff[:n_chunks])


def _distinct_runs(runs: _FileRuns) -> _FileRuns:
    """One row per distinct (first, count) of ``runs``: the files that share a run exactly
    count as one owner (a run that overlaps another without being it still counts twice)."""
    pairs = np.unique(np.stack((runs.first, runs.count), axis=1), axis=0)
    zeros = np.zeros(len(pairs), dtype=np.int64)
    return _FileRuns(pairs[:, 0], pairs[:, 1], zeros, zeros)


def _check_multi_chunk_files(
    chunk_size: int, runs: _FileRuns, refs: np.ndarray, chunks: _ChunkColumns, bad: _Refusal
) -> None:
    """Files of several chunks (``runs``) start at offset 0, own their chunks, which add up
    to their size, are chunk_size long but the last, and lie contiguous in one partition."""
    end = runs.first + runs.count  # one past each run's last chunk
    last = end - 1
    if np.any(runs.offset != 0):
        raise bad("a file of several chunks has a data offset")
    if np.any(_run_sum(refs > 1, runs.first, end)):
        raise bad("file chunk runs overlap")
    if np.any(_run_sum(chunks.raw, runs.first, end) != runs.size):
        raise bad("a file's size differs from the sum of its chunks")
    # Every chunk but a file's last is exactly chunk_size long (offsets map to chunks).
    if np.any(_run_sum(chunks.raw != chunk_size, runs.first, last)):
        raise bad("a chunk other than a file's last is not chunk_size long")
    # Chunks of one file are contiguous in one partition.
    part, offset, stored = chunks.part, chunks.offset, chunks.stored
    broken = np.zeros(len(part), dtype=bool)
    broken[:-1] = (part[1:] != part[:-1]) | (offset[1:] != offset[:-1] + stored[:-1])
    if np.any(_run_sum(broken, runs.first, last)):
        raise bad("a file's chunks are not contiguous in one partition")


def _run_sum(flags: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """Sum of ``flags[lo:hi]`` for each run (prefix sums)."""
    prefix = np.concatenate(([0], np.cumsum(flags, dtype=np.int64)))
    return prefix[hi] - prefix[lo]


def _check_no_overlap_in_partitions(chunks: _ChunkColumns, bad: _Refusal) -> None:
    """No two chunks overlap inside a partition."""
    by_pos = np.lexsort((chunks.offset, chunks.part))
    part, offset, stored = chunks.part[by_pos], chunks.offset[by_pos], chunks.stored[by_pos]
    same = part[1:] == part[:-1]
    if np.any(offset[1:][same] < offset[:-1][same] + stored[:-1][same]):
        raise bad("chunks overlap inside a partition")


def unsorted_directories(index: Index) -> np.ndarray:
    """The directories (entries, ascending) whose children are not strictly sorted by name
    bytes: a name out of order or repeated, which the bisection of :meth:`Index.lookup`
    cannot find its way through. Not part of :func:`validate_index` (it is most of the
    cost of validating a large index: ``fanstore verify`` runs it; a reader checks a
    directory at its first lookup in it, :meth:`Index.check_sorted`). Needs an index that
    passed :func:`validate_index` (children runs where their parents say, names in bounds).
    """
    if index.n_entries < 3:
        return np.zeros(0, dtype=np.int64)
    e = index.entries
    parent = e["parent"]
    siblings = np.nonzero(parent[2:] == parent[1:-1])[0] + 1  # entries a and a + 1
    bad = pairs_out_of_order(np.frombuffer(index.names, dtype=np.uint8), e["name_off"],
                             e["name_len"], siblings)
    return np.unique(parent[bad].astype(np.int64))


def target_stays_inside(link_path: bytes, target: bytes) -> bool:
    """True if a symlink at ``link_path`` (relative to the store root) with ``target``
    resolves, lexically, to a path inside the store root."""
    if target.startswith(b"/"):
        return False
    joined = posixpath.normpath(posixpath.join(posixpath.dirname(link_path), target))
    return joined != b".." and not joined.startswith(b"../")
