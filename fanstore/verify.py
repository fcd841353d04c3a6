"""``fanstore verify``: decode every file, check every chunk and whole-file checksum.

Damage is reported per file (a missing or truncated partition damages exactly the files it
holds); verification never stops at the first problem.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import xxhash

from fanstore.errors import FanStoreError, FormatError
from fanstore.format.index import read_index
from fanstore.namespace import Namespace
from fanstore.store import Decoder, LocalPartitions


@dataclass
class VerifyReport:
    checked: int = 0
    bytes_checked: int = 0
    seconds: float = 0.0
    damaged: list[tuple[str, str]] = field(default_factory=list)
    skipped_partitions: list[int] = field(default_factory=list)

    def damaged_lines(self) -> list[str]:
        return [f"DAMAGED {path}: {reason}" for path, reason in sorted(self.damaged)]

    def summary(self) -> str:
        mb = self.bytes_checked / 1e6
        skipped = (f" ({len(self.skipped_partitions)} partitions not present, skipped)"
                   if self.skipped_partitions else "")
        rate = mb / self.seconds if self.seconds > 0 else 0.0
        head = (f"verified {self.checked:,} files ({mb:,.1f} MB) in {self.seconds:.1f} s "
                f"({rate:,.0f} MB/s): ")
        if self.damaged:
            return head + f"{len(self.damaged)} damaged" + skipped
        return head + "all intact" + skipped


def verify_store(path: str, jobs: int = 0, progress: bool | None = None,
                 data_dir: str | None = None, only_present: bool = False) -> VerifyReport:
    """Verify the store at ``path``; partitions are read from ``data_dir`` (default ``path``).

    With ``only_present``, partitions missing from ``data_dir`` are skipped (a node-local
    staging directory holds only this node's share) instead of reported as damage.
    """
    t0 = time.monotonic()
    index = read_index(path)
    ns = Namespace(index)
    decoder = Decoder(index)
    data_dir = data_dir or path
    if not os.path.isdir(data_dir):  # a mistyped --local-dir must not verify "all intact"
        raise FormatError(f"{data_dir}: no such directory")
    report = VerifyReport()
    files = index.file_entries()
    first = index.e["first"]
    count = index.e["count"]
    offset = index.e["offset"]
    part_of = {}
    for entry in files.tolist():
        n = int(count[entry])
        part_of[entry] = int(index.c["part"][int(first[entry])]) if n else -1

    sources: dict[int, LocalPartitions] = {}
    broken: dict[int, str] = {}
    for p in range(len(index.partitions)):
        if only_present and not os.path.exists(os.path.join(data_dir, index.partitions[p].name)):
            report.skipped_partitions.append(p)
            continue
        try:
            sources[p] = LocalPartitions(data_dir, index, [p])
        except FormatError as exc:
            broken[p] = str(exc).split(": ", 1)[-1] if ": " in str(exc) else str(exc)

    todo = []
    for entry in files.tolist():
        p = part_of[entry]
        if p in broken:
            report.damaged.append((os.fsdecode(ns.path(entry)), broken[p]))
        elif p == -1 or p in sources:
            todo.append(entry)
    todo.sort(key=lambda entry: int(first[entry]))

    show_bar = sys.stderr.isatty() if progress is None else progress
    bar = None
    if show_bar:
        from tqdm import tqdm

        total = int(sum(int(index.e["size"][e]) for e in todo))
        bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1000, desc="verifying",
                   file=sys.stderr)

    # Files in one solid chunk (format v2) are checked one after the other (todo is sorted
    # by first chunk) and each thread keeps its last decoded chunk: a shared chunk is
    # decoded about once, not once per file in it.
    last = threading.local()

    def decoded(k: int, entry: int) -> bytes:
        if getattr(last, "chunk", None) == k:
            return last.raw
        part, off, length = decoder.run_extent(k, 1)
        raw = decoder.decode(k, sources[part].fetch(part, off, length), entry)
        last.chunk, last.raw = k, raw
        return raw

    def check(entry: int) -> tuple[int, int, str | None]:
        f, n = int(first[entry]), int(count[entry])
        h = xxhash.xxh3_64()
        size = 0
        try:
            if n == 1:  # maybe a solid chunk: the file is a slice of it
                base, want = int(offset[entry]), int(index.e["size"][entry])
                raw = memoryview(decoded(f, entry))[base : base + want]
                h.update(raw)
                size += len(raw)
            for k in range(f, f + n) if n > 1 else ():
                raw = decoded(k, entry)
                h.update(raw)
                size += len(raw)
        except FanStoreError as exc:
            reason = str(exc).split(": ", 1)[-1]
            return entry, size, reason
        if h.intdigest() != int(index.e["checksum"][entry]):
            return entry, size, "whole-file checksum mismatch"
        return entry, size, None

    workers = jobs or len(os.sched_getaffinity(0))
    try:
        with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
            for entry, size, reason in pool.map(check, todo, chunksize=64):
                report.checked += 1
                report.bytes_checked += size
                if reason:
                    report.damaged.append((os.fsdecode(ns.path(entry)), reason))
                if bar is not None:
                    bar.update(size)
    finally:
        if bar is not None:
            bar.close()
        for s in sources.values():
            s.close()
    report.checked += sum(1 for e in files.tolist() if part_of[e] in broken)
    report.seconds = time.monotonic() - t0
    return report
