"""``fanstore verify``: decode every file, check every chunk and whole-file checksum, and
check every directory's names are in the order lookups bisect.

Damage is reported per file (a missing or truncated partition damages exactly the files it
holds) and per directory (names out of order or repeated: a lookup in it fails); verification
never stops at the first problem. What the index must hold for a reader to use it at all
(the tree's shape, names in bounds, ...) is checked when it is loaded: an index that fails is
refused whole, one line naming it.
"""

from __future__ import annotations

import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import xxhash

from fanstore.errors import FanStoreError, FormatError
from fanstore.format.index import Index, read_index
from fanstore.format.layout import COMPACT_FROM
from fanstore.format.validate import unsorted_directories
from fanstore.namespace import Namespace
from fanstore.read import ChunkReader, LocalPartitions


@dataclass
class VerifyReport:
    checked: int = 0
    bytes_checked: int = 0
    seconds: float = 0.0
    damaged: list[tuple[str, str]] = field(default_factory=list)
    skipped_partitions: list[int] = field(default_factory=list)
    #: directories a lookup cannot trust (path, "/" for the root; what is wrong)
    damaged_dirs: list[tuple[str, str]] = field(default_factory=list)

    def damaged_lines(self) -> list[str]:
        """One line per damaged directory (its path ends in "/"), then per damaged file."""
        dirs = [f"DAMAGED {path.rstrip('/')}/: {reason}" for path, reason in
                sorted(self.damaged_dirs)]
        return dirs + [f"DAMAGED {path}: {reason}" for path, reason in sorted(self.damaged)]

    def summary(self) -> str:
        mb = self.bytes_checked / 1e6
        skipped = (f" ({len(self.skipped_partitions)} partitions not present, skipped)"
                   if self.skipped_partitions else "")
        rate = mb / self.seconds if self.seconds > 0 else 0.0
        head = (f"verified {self.checked:,} files ({mb:,.1f} MB) in {self.seconds:.1f} s "
                f"({rate:,.0f} MB/s): ")
        dirs = (f"{len(self.damaged_dirs)} damaged director"
                f"{'y' if len(self.damaged_dirs) == 1 else 'ies'}") if self.damaged_dirs else ""
        if self.damaged:
            return head + f"{len(self.damaged)} damaged" + (f", {dirs}" if dirs else "") + skipped
        if dirs:
            return head + dirs + skipped
        return head + "all intact" + skipped

    @property
    def intact(self) -> bool:
        return not self.damaged and not self.damaged_dirs


def verify_store(path: str, jobs: int = 0, progress: bool | None = None,
                 data_dir: str | None = None, only_present: bool = False) -> VerifyReport:
    """Verify the store at ``path``; partitions are read from ``data_dir`` (default ``path``).

    Every file is read through the read core (each chunk decoded and checked against its
    checksum), then its whole-content checksum is checked. With ``only_present``, partitions
    missing from ``data_dir`` are skipped (a node-local staging directory holds only this
    node's share) instead of reported as damage.
    """
    t0 = time.monotonic()
    index = read_index(path)
    ns = Namespace(index)
    data_dir = data_dir or path
    if not os.path.isdir(data_dir):  # a mistyped --local-dir must not verify "all intact"
        raise FormatError(f"{data_dir}: no such directory")
    report = VerifyReport()
    report.damaged_dirs = _damaged_directories(index, path)
    wanted = _wanted_partitions(index, data_dir, only_present, report)
    parts, broken = LocalPartitions.available(data_dir, index, wanted)
    # Files that share a solid chunk (format v2 and later) are checked one after the other
    # (todo is sorted by first chunk below) and a one-chunk file keeps its chunk in a small
    # LRU: a shared chunk is decoded about once, not once per file in it.
    shared = index.version >= 2
    reader = ChunkReader(index, parts,
                         cache_bytes=min(64 << 20, 16 * index.chunk_size) if shared else 0)
    todo = _files_to_check(index, ns, reader, parts, broken, report)
    todo, copies = _stored_once(index, todo)
    if shared:
        todo.sort(key=index.entries["first"].__getitem__)
    bar = _progress_bar(index, todo, progress)
    check = _FileCheck(index, reader, shared)
    workers = jobs or len(os.sched_getaffinity(0))
    try:
        with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
            for entry, size, reason in pool.map(check, todo, chunksize=64):
                for same in (entry, *copies.get(entry, ())):
                    report.checked += 1
                    report.bytes_checked += size
                    if reason:
                        report.damaged.append((os.fsdecode(ns.path(same)), reason))
                if bar is not None:
                    bar.update(size)
    finally:
        if bar is not None:
            bar.close()
        parts.close()
    report.seconds = time.monotonic() - t0
    return report


def _damaged_directories(index: Index, store: str) -> list[tuple[str, str]]:
    """(path, what is wrong) of each directory whose names are not strictly sorted by bytes
    (one out of order or repeated): the bisection a lookup does cannot be trusted there, so
    a reader refuses a lookup in it (EIO)."""
    return [(os.fsdecode(index.path(d)) or "/",
             f"directory of {store}: its names are not sorted, or one repeats (a lookup "
             "in it fails)") for d in unsorted_directories(index).tolist()]


def _wanted_partitions(index: Index, data_dir: str, only_present: bool,
                       report: VerifyReport) -> list[int]:
    """The partitions to verify: all, or with ``only_present`` those in ``data_dir`` (the
    others are noted in ``report`` as skipped)."""
    wanted = []
    for number in range(len(index.partitions)):
        if only_present and not os.path.exists(
            os.path.join(data_dir, index.partitions[number].name)
        ):
            report.skipped_partitions.append(number)
        else:
            wanted.append(number)
    return wanted


def _files_to_check(index: Index, ns: Namespace, reader: ChunkReader, parts: LocalPartitions,
                    broken: dict[int, str], report: VerifyReport) -> list[int]:
    """The files to read: those in the partitions at hand and empty ones. A file in a
    ``broken`` partition is reported damaged (and counted as checked) without reading."""
    part_of = index.chunks["part"]
    todo = []
    for entry in index.file_entries().tolist():
        first, count, _, _ = reader.span(entry)
        part = int(part_of[first]) if count else -1
        if part in broken:
            report.damaged.append((os.fsdecode(ns.path(entry)), broken[part]))
            report.checked += 1
        elif part == -1 or parts.has(part):
            todo.append(entry)
    return todo


def _stored_once(index: Index, todo: list[int]) -> tuple[list[int], dict[int, list[int]]]:
    """The files of ``todo`` to read, and for each the files stored once as a copy of it
    (pack's dedup: the same chunk run, offset, size and checksum), whose check is its own:
    a run shared by identical files is read and checked once."""
    if not todo:
        return todo, {}
    e = index.entries
    files = np.asarray(todo, dtype=np.int64)
    keys = np.stack([e[c][files].astype(np.int64)
                     for c in ("first", "count", "offset", "size", "checksum")], axis=1)
    _, firsts, inverse = np.unique(keys, axis=0, return_index=True, return_inverse=True)
    owner = files[firsts][inverse.ravel()]
    is_copy = (owner != files) & (keys[:, 1] > 0)  # empty files share nothing
    copies: dict[int, list[int]] = {}
    for entry, first in zip(files[is_copy].tolist(), owner[is_copy].tolist()):
        copies.setdefault(first, []).append(entry)
    return files[~is_copy].tolist(), copies


def _progress_bar(index: Index, todo: list[int], progress: bool | None):
    """A progress bar over the bytes of the files ``todo`` (on a terminal, or as asked)."""
    show_bar = sys.stderr.isatty() if progress is None else progress
    if not show_bar:
        return None
    from tqdm import tqdm

    total = int(sum(int(index.entries["size"][e]) for e in todo))
    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1000, desc="verifying",
                file=sys.stderr)


class _FileCheck:
    """Reads one file through the read core and checks its whole-content checksum (called
    from the worker threads): ``(entry, bytes read, what is wrong or None)``."""

    def __init__(self, index: Index, reader: ChunkReader, shared: bool) -> None:
        self.reader = reader
        self.shared = shared  # keep one-chunk files' chunks: other files may share them
        self.sums = index.entries["checksum"]
        self.counts = index.entries["count"]
        # v5 keeps no whole-file checksum for a file of one chunk: the chunk's, checked
        # when it is decoded, covers its bytes.
        self.one_chunk_unsummed = index.version >= COMPACT_FROM

    def __call__(self, entry: int) -> tuple[int, int, str | None]:
        whole = xxhash.xxh3_64()
        size = 0
        keep = self.shared and int(self.counts[entry]) == 1
        try:
            for data in self.reader.iter_file(entry, keep=keep):
                whole.update(data)
                size += len(data)
        except FanStoreError as exc:
            return entry, size, str(exc).split(": ", 1)[-1]
        if self.one_chunk_unsummed and int(self.counts[entry]) == 1:
            return entry, size, None
        if whole.intdigest() != int(self.sums[entry]):
            return entry, size, "whole-file checksum mismatch"
        return entry, size, None
