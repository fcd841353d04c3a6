"""Pack a streaming source (tar shards, a zip file, an S3 prefix): read it once, in its order.

A tar stream cannot be listed before it is read, so nothing is planned ahead:

1. Each file, as it arrives, goes to the partition with the least data so far (the same
   size balance as ``plan_partitions``, decided on the fly; ``--broadcast`` files go to
   one extra partition). Its chunks are read straight into a ring of shared memory and
   checksummed and compressed there by ``--jobs`` worker processes
   (``fanstore.pack.encoders``) while this process reads on; this process appends the
   results to the partitions strictly in arrival order, so the output does not depend on
   the number of workers, and a file's chunks are adjacent in its partition. The ring
   bounds the data in flight: ``max(64 MiB, 4 chunks per worker)``. The workers start
   once the source has given ``worker.INLINE_BYTES`` (2 MiB) without an explicit
   ``--jobs``: a smaller source is compressed in this process
   (``encoders.InlineFirst``), as a small directory is, into the same bytes.
2. Names are normalised and checked as they come (``..`` and absolute names refused, never
   written anywhere); the namespace is assembled in a :class:`VirtualTree` (duplicates:
   the last one wins, reported; implied directories; symlink checks).
3. Hard links (tar): the link becomes a regular file holding a copy of its target's
   content; the targets are read again from the archive after the first pass (only when
   there are links), one line reports how many. A link to a member that is not in the
   archive before it is refused by name.
4. At the end the tree is laid out breadth-first with children sorted by name bytes (as
   docs/format.md requires), the index is built from the chunk rows and written last, and
   the store is installed atomically (``fanstore.pack.dest``).

Problems (refused names, device or FIFO entries, escaping symlinks) are collected while
reading and reported together at the end; the pack then fails (nothing installed) unless
``--skip-unreadable``.

Access (``fanstore.pack.access``): only known once every member has been read, so the store
is written private and opened up at install time when the members' modes and the
archives' own modes let every user read them (an S3 source has no modes: private unless
``--shared``).
"""

from __future__ import annotations

import heapq
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import xxhash

from compressors import parse_spec
from fanstore.errors import PackError, UsageError
from fanstore.format.index import KIND_DIR, KIND_FILE, KIND_SYMLINK
from fanstore.format.partition import PartitionWriter, partition_name
from fanstore.pack import fallback
from fanstore.pack.access import PRIVATE_FILE_MODE, decide_stream
from fanstore.pack.dest import open_destination
from fanstore.pack.encoders import InlineFirst
from fanstore.pack.indexing import build_index
from fanstore.pack.options import (
    PackOptions,
    PackSummary,
    check_options,
    check_symlinks,
    report_problems,
)
from fanstore.pack.plan import CodecPolicy, CodecTable, in_dir
from fanstore.pack.scan import show
from fanstore.pack.sources.base import (
    KIND_HARDLINK,
    KIND_SPECIAL,
    Member,
    Node,
    Source,
    VirtualTree,
    normalize_name,
    target_problem,
)
from fanstore.pack.worker import INLINE_BYTES, PartResult


@dataclass
class _File:
    """One file's content as written: its partition and chunk rows."""

    part: int
    size: int
    checksum: int = 0
    slot: int = 0  # the codec slot planned (a chunk's row has the one used)
    rows: list[tuple[int, int, int, int, int]] = field(default_factory=list)
    # (offset, stored, raw, codec slot, checksum) per chunk


_EMPTY_SUM = xxhash.xxh3_64_intdigest(b"")


class StreamPacker:
    def __init__(self, source: Source, dest: str, policy: CodecPolicy,
                 options: PackOptions) -> None:
        self.source = source
        self.policy = policy
        self.options = options
        self.cs = options.chunk_size
        self.n_normal = options.partitions
        self.bcast_dirs = [os.fsencode(b.strip("/")) for b in options.broadcast]
        self.dest = open_destination(dest, self.options.notify)
        # A new codec config goes to the encoder workers as soon as it gets its slot.
        self.codecs = CodecTable(on_new=lambda slot, cfg: self.pool.add_codec(slot, cfg))
        self.configs = self.codecs.configs
        self.files: list[_File] = []
        self.part_files: dict[int, list[int]] = {}
        self.writers: dict[int, PartitionWriter] = {}
        self.loads = [(0, p) for p in range(self.n_normal)]
        self.tree = VirtualTree(symlinks=options.symlinks)
        self.links: list[tuple[bytes, Node, bytes]] = []
        self.jobs = options.jobs or len(os.sched_getaffinity(0))
        self.ring_size = max(64 << 20, 4 * self.jobs * self.cs)
        self.pool: InlineFirst | None = None
        self.bar = None
        self._bar_last = 0

    # ------------------------------------------------------------------ partitions
    def _writer(self, p: int) -> PartitionWriter:
        w = self.writers.get(p)
        if w is None:
            w = PartitionWriter(self.dest.partition_path(partition_name(p)), p,
                                mode=PRIVATE_FILE_MODE)
            self.writers[p] = w
            self.part_files.setdefault(p, [])
        return w

    def _choose(self, rel: bytes, size: int) -> int:
        if self.bcast_dirs and any(in_dir(rel, b) for b in self.bcast_dirs):
            return self.n_normal
        load, p = heapq.heappop(self.loads)
        heapq.heappush(self.loads, (load + size + 512, p))  # as plan_partitions
        return p

    # ------------------------------------------------------------------ data
    def add_file(self, rel: bytes, size: int, read: Callable[[int], bytes] | None, where: str,
                 readinto: Callable[[memoryview], int] | None = None) -> int:
        """Pack one file of ``size`` bytes, its content read by ``readinto`` (fills a
        buffer, exactly ``size`` bytes in all) or else by ``read`` (whose end is checked:
        a source may hold more than it announced)."""
        p = self._choose(rel, size)
        self._writer(p)
        slot = self.codecs.slot(self.policy.codec_for(os.fsdecode(rel), size))
        f = _File(p, size, _EMPTY_SUM, slot)
        fid = len(self.files)
        self.files.append(f)
        self.part_files[p].append(fid)
        fill = readinto or _into(read)
        # One chunk: its checksum (from the worker) is the file's; else hash here too.
        whole = xxhash.xxh3_64() if size > self.cs else None
        pool = self.pool
        got = 0
        while got < size:
            n = min(self.cs, size - got)
            view = pool.reserve(n)
            k = _fill(fill, view)
            if k < n:
                raise PackError(f"{where}: {show(rel)}: member data ends after {got + k:,} "
                                f"of {size:,} bytes (truncated archive?)")
            if whole is not None:
                whole.update(view)
            got += n
            pool.submit(n, slot, f)
            self._progress()
        if readinto is None and read(1):
            raise PackError(f"{where}: {show(rel)}: member holds more data than its "
                            f"header says ({size:,} bytes)")
        if whole is not None:
            f.checksum = whole.intdigest()
        return fid

    def _sink(self, f: _File, stored: memoryview, used: int, raw: int, csum: int) -> None:
        """A chunk's result, in submission order: append it to its partition."""
        w = self.writers[f.part]
        try:
            offset = w.append(stored)
        except OSError as exc:
            raise PackError(f"cannot write {w.path}: {exc.strerror}") from None
        f.rows.append((offset, len(stored), raw, used, csum))
        if f.size <= self.cs:
            f.checksum = csum

    def _progress(self) -> None:
        if self.bar is not None:
            now = self.source.bytes_read
            if now > self._bar_last:
                self.bar.update(now - self._bar_last)
                self._bar_last = now

    # ------------------------------------------------------------------ members
    def take(self, m: Member) -> None:
        tree = self.tree
        rel, problem = normalize_name(m.name)
        if problem:
            tree.problem(m.where, m.name, problem)
            return
        if m.problem:
            tree.problem(m.where, m.name, m.problem)
            return
        if m.kind == KIND_SPECIAL:
            tree.problem(m.where, m.name, f"{m.special} cannot be packed (not a regular file, "
                                          "directory or symlink)")
            return
        if not rel:
            if m.kind == KIND_DIR:
                tree.add(b"", Node(KIND_DIR, m.mode, m.mtime_ns, ordinal=m.ordinal))
            else:
                tree.problem(m.where, m.name, "names the root of the archive but is not a "
                                              "directory")
            return
        if m.kind == KIND_DIR:
            tree.add(rel, Node(KIND_DIR, m.mode, m.mtime_ns, ordinal=m.ordinal))
        elif m.kind == KIND_SYMLINK:
            # A target that cannot be kept is not kept, not even until the end: a hostile
            # archive's thousands of 16 MiB targets would all be held by the tree.
            bad = target_problem(m.target)
            tree.add(rel, Node(KIND_SYMLINK, m.mode, m.mtime_ns, target=b"" if bad else m.target,
                               ordinal=m.ordinal, problem=bad or ""))
        elif m.kind == KIND_HARDLINK:
            self._hard_link(m, rel)
        else:
            fid = self.add_file(rel, m.size, m.read, m.where, m.readinto)
            tree.add(rel, Node(KIND_FILE, m.mode, m.mtime_ns, m.size, file_id=fid,
                               ordinal=m.ordinal))

    def _hard_link(self, m: Member, rel: bytes) -> None:
        target, problem = normalize_name(m.target)
        node = self.tree.nodes.get(target) if problem is None else None
        if node is None or not node.explicit or node.kind == KIND_DIR:
            why = "a directory" if node is not None and node.explicit else \
                "not in the archive before it"
            self.tree.problem(m.where, m.name, f"hard link to {show(m.target)}, which is {why}")
            return
        if node.kind == KIND_SYMLINK:
            self.tree.add(rel, Node(KIND_SYMLINK, node.mode, m.mtime_ns, target=node.target,
                                    ordinal=m.ordinal, problem=node.problem))
            return
        copy = Node(KIND_FILE, m.mode, m.mtime_ns, node.size, ordinal=node.ordinal)
        self.tree.add(rel, copy)
        self.links.append((rel, copy, target))

    def _copy_links(self) -> None:
        """Second pass: each hard link gets a copy of its target's content."""
        live = [(rel, node, t) for rel, node, t in self.links if self.tree.nodes.get(rel) is node]
        if not live:
            return
        by_ordinal: dict[int, list[tuple[bytes, Node]]] = {}
        for rel, node, _ in live:
            by_ordinal.setdefault(node.ordinal, []).append((rel, node))
        for m in self.source.reread(set(by_ordinal)):
            wanted = by_ordinal.pop(m.ordinal)
            if len(wanted) == 1:
                rel, node = wanted[0]
                node.file_id = self.add_file(rel, m.size, m.read, m.where, m.readinto)
                continue
            with tempfile.SpooledTemporaryFile(max_size=64 << 20) as spool:
                while True:
                    data = m.read(8 << 20)
                    if not data:
                        break
                    spool.write(data)
                for rel, node in wanted:
                    spool.seek(0)
                    node.file_id = self.add_file(rel, m.size, spool.read, m.where)
        if by_ordinal:  # the archive changed between the passes
            raise PackError(f"{self.source.url}: could not read the targets of "
                            f"{sum(len(v) for v in by_ordinal.values())} hard links again "
                            "(did the archive change while being packed?)")
        rel, _, target = live[0]
        n = len(live)
        what = "1 hard link stored as a copy of its target" if n == 1 else \
            f"{n} hard links stored as copies of their targets"
        self.options.notify(f"{self.source.url}: {what} (e.g. {show(rel)}, a hard link to "
                            f"{show(target)})")

    # ------------------------------------------------------------------ the run
    def run(self) -> PackSummary:
        options = self.options
        t0 = time.monotonic()
        self.dest.prepare(self.source.url, options.force)
        self.dest.create_tmp()
        show_bar = sys.stderr.isatty() if options.progress is None else options.progress
        try:
            # The workers start once the source has given INLINE_BYTES (a small one is
            # compressed here), or at once with an explicit --jobs.
            self.pool = InlineFirst(self.jobs, self.ring_size, self._sink, self.source.url,
                                    0 if options.jobs else INLINE_BYTES)
            self.pool.start({})
            for p in range(self.n_normal):  # every partition exists, even an empty one
                self._writer(p)
            if show_bar:
                from tqdm import tqdm

                tqdm.monitor_interval = 0
                self.bar = tqdm(total=self.source.total_bytes, unit="B", unit_scale=True,
                                unit_divisor=1000, desc="packing", file=sys.stderr,
                                smoothing=0.1)
            for m in self.source.members():
                self.take(m)
                self._progress()
            self._copy_links()
            self.pool.finish()
            return self._finish(t0)
        except BaseException:
            if self.pool is not None:  # the collector writes no more
                self.pool.close()
                self.pool = None
            for w in self.writers.values():
                try:
                    w.abort()
                except Exception:  # noqa: BLE001 - cleanup only
                    pass
            self.dest.discard()
            raise
        finally:
            if self.pool is not None:
                self.pool.close()
            if self.bar is not None:
                self.bar.close()
            self.source.close()

    def _finish(self, t0: float) -> PackSummary:
        options = self.options
        tree = self.tree
        root = os.fsencode(self.source.url)
        scan = tree.build(root)
        for b in self.bcast_dirs:
            e = next((x for x in scan.entries if x.rel == b), None)
            if e is None or e.kind != KIND_DIR:
                raise UsageError(f"--broadcast {os.fsdecode(b)}: no such directory in the "
                                 "source")
        skipped = report_problems(tree.problems, options)
        dups = tree.duplicates()
        for name, k in dups[:10]:
            self.options.notify(f"warning: {self.source.url}: {show(name)} appears {k} "
                                "times; the last one is kept")
        if len(dups) > 10:
            self.options.notify(f"warning: {self.source.url}: {len(dups) - 10} more names "
                                "appear more than once; the last of each is kept")
        entry_of: dict[int, int] = {}
        k = 0
        for i, e in enumerate(scan.entries):
            if e.kind == KIND_FILE:
                entry_of[scan.file_ids[k]] = i
                k += 1
        results = []
        for p in sorted(self.writers):
            w = self.writers[p]
            try:
                checksum = w.close()
            except OSError as exc:
                raise PackError(f"cannot write {w.path}: {exc.strerror}") from None
            fids = [fid for fid in self.part_files[p] if fid in entry_of]
            results.append(_part_result(p, w.size, checksum, fids, self.files, entry_of))
        source = self.source
        access = decide_stream(source.url, scan.entries, options.shared,
                               source.local_files(), source.has_modes)
        if access.private:
            options.notify(access.why)
        data, stored = build_index(scan, results, self.configs, options, self.n_normal,
                                   source.url, access=access.value)
        self.dest.write_index(data)
        self.dest.install(shared=not access.private)
        kinds = [e.kind for e in scan.entries]
        return PackSummary(
            dest=self.dest.url, files=kinds.count(KIND_FILE), dirs=kinds.count(KIND_DIR) - 1,
            symlinks=kinds.count(KIND_SYMLINK), raw_bytes=scan.raw_bytes, stored_bytes=stored,
            index_bytes=len(data), partitions=len(results),
            seconds=time.monotonic() - t0, skipped=skipped, outside_skipped=scan.outside_skipped,
            fallbacks=fallback.count(self.configs,
                                     ((f.slot, [r[3] for r in f.rows]) for f in self.files)))


def _part_result(p: int, size: int, checksum: str, fids: list[int], files: list[_File],
                 entry_of: dict[int, int]) -> PartResult:
    rows = [r for fid in fids for r in files[fid].rows]
    arr = np.array(rows, dtype=np.uint64).reshape(-1, 5)
    res = PartResult(p, size=size, checksum=checksum)
    res.entries = np.array([entry_of[f] for f in fids], "<u4")
    res.file_sums = np.array([files[f].checksum for f in fids], "<u8")
    res.chunk_counts = np.array([len(files[f].rows) for f in fids], "<u4")
    res.raw_bytes = sum(files[f].size for f in fids)
    res.chunks = {
        "offset": arr[:, 0].astype("<u8"),
        "stored": arr[:, 1].astype("<u4"),
        "raw": arr[:, 2].astype("<u4"),
        "codec": arr[:, 3].astype("<u2"),
        "checksum": arr[:, 4].astype("<u8"),
        "part": np.full(len(rows), p, "<u4"),
    }
    return res


def _fill(readinto: Callable[[memoryview], int], view: memoryview) -> int:
    """Fill ``view`` from ``readinto``; fewer bytes only at the end of the data."""
    n = readinto(view)
    want = len(view)
    while 0 < n < want:
        k = readinto(view[n:])
        if not k:
            break
        n += k
    return n


def _into(read: Callable[[int], bytes]) -> Callable[[memoryview], int]:
    """A ``readinto`` made of a ``read``."""
    def readinto(view: memoryview) -> int:
        data = read(len(view))
        view[:len(data)] = data
        return len(data)
    return readinto


def pack_stream(source: Source, dest: str, policy: CodecPolicy | None = None,
                options: PackOptions | None = None) -> PackSummary:
    """Pack a streaming source into a store at ``dest`` (a path or an s3:// URL)."""
    options = options or PackOptions()
    check_options(options)
    check_symlinks(options.symlinks, source.what)
    return StreamPacker(source, dest, policy or CodecPolicy(parse_spec("zstd:3")),
                        options).run()
