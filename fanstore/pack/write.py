"""Write a store: parallel partition writers, then the index, then an atomic rename.

Each worker process owns whole partitions: it reads its files in chunks, checksums,
compresses (keeping the raw bytes where compression does not shrink them), appends to its
partition file and returns only the chunk rows. Nothing bulky crosses the process boundary.

Atomicity: everything is written into a temporary sibling directory, fsynced, and renamed
onto the destination at the end; the index, whose presence makes a store, is written last.
An interrupted pack leaves at most a temporary directory, which the next pack removes.

Access: a source with anything other users may not read gives a private store (0700, files
0600), else the umask decides (``fanstore.pack.access``); the temporary directory is
private either way until the store is installed.
"""

from __future__ import annotations

import errno
import logging
import multiprocessing as mp
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import xxhash

from compressors import CodecError, get_codec, parse_spec
from fanstore.version import __version__
from fanstore.errors import FanStoreError, PackError, UsageError
from fanstore.format.index import (
    KIND_DIR,
    KIND_FILE,
    KIND_SYMLINK,
    MAX_CHUNK_SIZE,
    IndexBuilder,
    PartitionInfo,
    encode_index,
)
from fanstore.format.partition import PartitionWriter, partition_name
from fanstore.kinds import file_kind
from fanstore.pack.access import PRIVATE_FILE_MODE, Access, decide_tree
from fanstore.pack.plan import CodecPolicy, CodecTable, in_dir, plan_partitions
from fanstore.pack.dest import (  # noqa: F401 - re-exported (tests, older imports)
    OLD_MARK,
    TMP_MARK,
    LocalDestination,
    check_destination,
    open_destination,
)
from fanstore.pack.scan import ScanResult, scan_tree, show
from fanstore.storage import is_url

log = logging.getLogger(__name__)



@dataclass
class PackOptions:
    partitions: int = 8
    jobs: int = 0  # 0: all cores
    chunk_size: int = 1 << 20
    skip_unreadable: bool = False
    force: bool = False
    broadcast: list[str] = field(default_factory=list)
    progress: bool | None = None  # None: on a terminal only
    extra_meta: dict[str, Any] = field(default_factory=dict)
    #: the owner means to share the store: the umask decides its modes even when the
    #: source holds entries other users may not read (``--shared``; see pack.access)
    shared: bool = False
    #: shows one line to the user (the CLI prints it; the default logs a warning)
    notify: Callable[[str], None] = field(default=lambda text: log.warning("%s", text))


@dataclass
class PackSummary:
    dest: str
    files: int
    dirs: int
    symlinks: int
    raw_bytes: int
    stored_bytes: int
    index_bytes: int
    partitions: int
    seconds: float
    skipped: list[str]

    @property
    def ratio(self) -> float:
        return self.raw_bytes / self.stored_bytes if self.stored_bytes else 1.0

    @property
    def ratio_with_index(self) -> float:
        """Raw bytes over everything the store holds (on many small files the index, with
        its dictionaries, is a few percent of the store)."""
        total = self.stored_bytes + self.index_bytes
        return self.raw_bytes / total if total else 1.0

    def lines(self) -> list[str]:
        mb_s = self.raw_bytes / 1e6 / self.seconds if self.seconds > 0 else 0.0
        return [
            f"packed {self.files:,} files, {self.dirs:,} directories, {self.symlinks:,} symlinks "
            f"into {self.partitions} partitions at {self.dest}",
            f"raw {_mb(self.raw_bytes)}, stored {_mb(self.stored_bytes)} "
            f"(+ index {_mb(self.index_bytes)}), ratio {self.ratio:.2f}x "
            f"({self.ratio_with_index:.2f}x with the index)",
            f"time {self.seconds:.1f} s, {mb_s:.0f} MB/s",
        ] + ([f"skipped {len(self.skipped)} entries (--skip-unreadable)"] if self.skipped else [])


def _mb(n: int) -> str:
    return f"{n / 1e6:,.1f} MB"


# --------------------------------------------------------------------------- arguments


def check_arguments(src: str, dest: str, options: PackOptions) -> None:
    """Refuse a bad source, destination or option before any work (the CLI calls this
    before a codec selection that takes seconds; :func:`prepare` checks again)."""
    destination = _open_checked(src, dest, options)
    check_destination(src, getattr(destination, "dest", destination.url), options.force)


def _open_checked(src: str, dest: str, options: PackOptions):
    """The destination of a pack of the directory ``src``, after checking the source and
    the options."""
    if not os.path.exists(src):
        raise UsageError(f"source {src} does not exist")
    if not os.path.isdir(src):
        raise UsageError(f"source {src} is not a directory")
    check_options(options)
    return open_destination(dest, options.notify)


# --------------------------------------------------------------------------- workers

# Set in each worker by the pool initializer.
_progress: Any = None


def _init_worker(progress) -> None:
    global _progress
    _progress = progress
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles ^C and terminates us
    try:
        import blosc2

        blosc2.set_nthreads(1)
    except Exception:  # pragma: no cover - optional
        pass


@dataclass
class _PartTask:
    number: int
    path: str
    #: (entry, abs path, size, codec slot, solid block size or 0, block group). Files with a
    #: block size go into solid blocks: one open block per (slot, block size, group), where
    #: the group is the file's kind (similar files compress best together).
    files: list[tuple[int, bytes, int, int, int, int]]
    codecs: list[dict[str, Any]]  # codec table (slot -> config); slot 0 is "none"
    chunk_size: int


@dataclass
class _PartResult:
    number: int
    size: int = 0
    checksum: str = ""
    entries: np.ndarray | None = None  # entry id per file, in partition order
    file_sums: np.ndarray | None = None
    chunk_counts: np.ndarray | None = None
    chunk_firsts: np.ndarray | None = None  # first chunk of each file (partition-relative)
    data_offsets: np.ndarray | None = None  # offset in the first chunk (solid blocks)
    chunks: dict[str, np.ndarray] | None = None
    raw_bytes: int = 0
    error: str | None = None


class _WriteError(OSError):
    """An OSError from writing a partition (reported as such, not as a source read error)."""


class _Rows:
    """The chunk rows a worker appends to its partition."""

    def __init__(self, writer: PartitionWriter, n_est: int) -> None:
        self.writer = writer
        self.k = 0
        self.cols = {
            "offset": np.zeros(n_est, "<u8"),
            "stored": np.zeros(n_est, "<u4"),
            "raw": np.zeros(n_est, "<u4"),
            "codec": np.zeros(n_est, "<u2"),
            "checksum": np.zeros(n_est, "<u8"),
        }

    def add(self, raw, slot: int, codec) -> int:
        """Compress (or keep raw) and append one chunk; returns its row."""
        n = len(raw)
        stored = codec.encode(raw) if slot else raw
        use = slot
        if len(stored) >= n:
            stored, use = raw, 0
        k = self.k
        if k == len(self.cols["offset"]):  # more chunks than estimated (cannot happen)
            for name, arr in self.cols.items():
                self.cols[name] = np.concatenate((arr, np.zeros_like(arr)))
        try:
            self.cols["offset"][k] = self.writer.append(stored)
        except OSError as exc:  # writing the partition, not reading a source file
            raise _WriteError(exc.errno, exc.strerror) from exc
        self.cols["stored"][k] = len(stored)
        self.cols["raw"][k] = n
        self.cols["codec"][k] = use
        self.cols["checksum"][k] = xxhash.xxh3_64_intdigest(raw)
        self.k += 1
        return k


def _progress_add(n: int) -> None:
    if _progress is not None:
        with _progress.get_lock():
            _progress.value += n


def _pack_partition(task: _PartTask) -> _PartResult:
    codecs = [get_codec(cfg) for cfg in task.codecs]
    res = _PartResult(task.number)
    n_est = sum(max(1, -(-size // task.chunk_size)) for _, _, size, *_ in task.files)
    n_files = len(task.files)
    entries = np.zeros(n_files, "<u4")
    sums = np.zeros(n_files, "<u8")
    counts = np.zeros(n_files, "<u4")
    firsts = np.zeros(n_files, "<u8")
    offsets = np.zeros(n_files, "<u4")
    writer = PartitionWriter(task.path, task.number, mode=PRIVATE_FILE_MODE)
    rows = _Rows(writer, n_est)
    buf = bytearray(task.chunk_size)
    view = memoryview(buf)
    # Open solid blocks: (slot, block size, group) -> [files (index, data)], fill
    blocks: dict[tuple[int, int, int], tuple[list[tuple[int, bytes]], list[int]]] = {}

    def flush(key: tuple[int, int, int]) -> None:
        members, _ = blocks.pop(key)
        slot = key[0]
        raw = members[0][1] if len(members) == 1 else b"".join(d for _, d in members)
        try:
            k = rows.add(raw, slot, codecs[slot])
        except CodecError as exc:
            raise PackError(f"{show(task.files[members[0][0]][1])} and the files packed with "
                            f"it: compression failed: {exc}") from exc
        pos = 0
        for i, data in members:
            firsts[i], counts[i], offsets[i] = k, 1, pos
            pos += len(data)

    try:
        for i, (entry, path, size, slot, solid, group) in enumerate(task.files):
            codec = codecs[slot]
            entries[i] = entry
            if solid and 0 < size <= solid:
                data = _read_small(path, size, solid)
                sums[i] = xxhash.xxh3_64_intdigest(data)
                key = (slot, solid, group)
                if key in blocks and blocks[key][1][0] + size > solid:
                    flush(key)
                members, fill = blocks.setdefault(key, ([], [0]))
                members.append((i, data))
                fill[0] += size
                res.raw_bytes += size
                _progress_add(size)
                continue
            whole = xxhash.xxh3_64()
            got = 0
            firsts[i] = rows.k
            try:
                with open(path, "rb", buffering=0) as f:
                    while True:
                        n = f.readinto(buf)
                        if not n:
                            break
                        # Short reads happen (pipes, network FS): fill the chunk before coding.
                        while n < len(buf):
                            m = f.readinto(view[n:])
                            if not m:
                                break
                            n += m
                        got += n
                        if got > size:
                            raise PackError(f"{show(path)}: file grew while being packed")
                        raw = view[:n]
                        whole.update(raw)
                        rows.add(raw, slot, codec)
                        counts[i] += 1
                        _progress_add(n)
                        if n < len(buf):
                            break
            except _WriteError:
                raise
            except OSError as exc:
                raise PackError(f"{show(path)}: cannot read: {exc.strerror}") from exc
            except CodecError as exc:
                raise PackError(f"{show(path)}: compression failed: {exc}") from exc
            if got != size:
                raise PackError(
                    f"{show(path)}: file changed size while being packed ({size} -> {got} bytes)"
                )
            if not counts[i]:
                firsts[i] = 0
            sums[i] = whole.intdigest()
            res.raw_bytes += size
        for key in list(blocks):
            flush(key)
        res.checksum = writer.close()
        res.size = writer.size
    except FanStoreError as exc:  # a source problem, or object storage failing
        writer.abort()
        res.error = str(exc)
        return res
    except OSError as exc:
        writer.abort()
        if exc.errno == errno.ENOSPC:
            res.error = f"no space left on device while writing {task.path}"
        else:
            res.error = f"cannot write {task.path}: {exc.strerror}"
        return res
    res.entries, res.file_sums, res.chunk_counts = entries, sums, counts
    res.chunk_firsts, res.data_offsets = firsts, offsets
    res.chunks = {name: arr[: rows.k] for name, arr in rows.cols.items()}
    res.chunks["part"] = np.full(rows.k, task.number, "<u4")
    return res


def _read_small(path: bytes, size: int, limit: int) -> bytes:
    """A whole small file (at most ``limit`` bytes), checked against its scanned size."""
    parts, got = [], 0
    try:
        with open(path, "rb", buffering=0) as f:
            while got <= limit:  # short reads happen: read until EOF or past the limit
                more = f.read(limit + 1 - got)
                if not more:
                    break
                parts.append(more)
                got += len(more)
    except OSError as exc:
        raise PackError(f"{show(path)}: cannot read: {exc.strerror}") from exc
    data = parts[0] if len(parts) == 1 else b"".join(parts)
    if len(data) > size:
        raise PackError(f"{show(path)}: file grew while being packed")
    if len(data) != size:
        raise PackError(
            f"{show(path)}: file changed size while being packed ({size} -> {len(data)} bytes)")
    return data


# --------------------------------------------------------------------------- driver


@dataclass
class PackPlan:
    """Everything decided before compression starts (see :func:`prepare`)."""

    src: str
    dest: str
    scan: ScanResult
    tasks: list[_PartTask]
    configs: list[dict[str, Any]]
    n_normal: int
    tmp: str
    skipped: list[str]
    t0: float
    target: Any = None  # a pack.dest destination (local directory or S3 prefix)
    access: Access = field(default_factory=lambda: Access(False))


def prepare(
    src: str,
    dest: str,
    policy: CodecPolicy | None = None,
    options: PackOptions | None = None,
    scan: ScanResult | None = None,
) -> PackPlan:
    """Check the arguments, scan the source, plan partitions and codecs, create the temp dir.

    The caller must run the plan's tasks and call :func:`finish`, or
    ``plan.target.discard()``.
    """
    options = options or PackOptions()
    policy = policy or CodecPolicy(parse_spec("zstd:3"))
    t0 = time.monotonic()
    destination = _open_checked(src, dest, options)
    destination.prepare(src, options.force)

    if scan is None:
        scan = scan_tree(src)
    skipped = report_problems(scan.problems, options)
    access = decide_tree(src, scan.entries, options.shared)
    if access.private:
        options.notify(access.why)

    entries = scan.entries
    files = scan.files
    bcast_dirs = [os.fsencode(b.strip("/")) for b in options.broadcast]
    for b in bcast_dirs:
        e = next((x for x in entries if x.rel == b), None)
        if e is None or e.kind != KIND_DIR:
            raise UsageError(f"--broadcast {os.fsdecode(b)}: no such directory in the source")
    is_bcast = [any(in_dir(entries[i].rel, b) for b in bcast_dirs) for i in files]
    normal = [i for i, bc in zip(files, is_bcast) if not bc]
    bcast = [i for i, bc in zip(files, is_bcast) if bc]

    n_normal = options.partitions
    assign_normal = plan_partitions([entries[i].size for i in normal], n_normal)
    n_bcast = 0
    assign_bcast: list[int] = []
    if bcast:
        total_normal = sum(entries[i].size for i in normal)
        target = max(1, total_normal // n_normal)
        bcast_bytes = sum(entries[i].size for i in bcast)
        n_bcast = max(1, min(len(bcast), -(-bcast_bytes // target)))
        assign_bcast = [n_normal + p for p in plan_partitions(
            [entries[i].size for i in bcast], n_bcast)]
    n_parts = n_normal + n_bcast

    codecs = CodecTable()
    configs = codecs.configs
    slot = codecs.slot

    destination.create_tmp()
    tasks = [
        _PartTask(p, destination.partition_path(partition_name(p)), [], configs, options.chunk_size)
        for p in range(n_parts)
    ]
    groups: dict[str, int] = {}
    for i, p in zip(normal + bcast, assign_normal + assign_bcast):
        e = entries[i]
        rel = os.fsdecode(e.rel)
        codec, solid = policy.choice_for(rel, e.size)
        if solid > options.chunk_size:
            raise UsageError(f"solid blocks of {solid >> 10} KiB do not fit in chunks of "
                             f"{options.chunk_size >> 10} KiB (raise --chunk-kb)")
        group = groups.setdefault(file_kind(rel, e.size), len(groups)) if solid else 0
        tasks[p].files.append((i, os.path.join(scan.root, e.rel), e.size, slot(codec),
                               solid, group))
    for t in tasks:
        t.files.sort(key=lambda f: f[0])  # scan (breadth-first) order: neighbours together
    return PackPlan(os.path.abspath(src), destination.url, scan, tasks, configs, n_normal,
                    destination.tmp, skipped, t0, destination, access)


def check_options(options: PackOptions) -> None:
    if options.partitions < 1:
        raise UsageError("--partitions must be at least 1")
    if not 4096 <= options.chunk_size <= MAX_CHUNK_SIZE:
        raise UsageError(f"chunk size must be between 4 KiB and {MAX_CHUNK_SIZE >> 20} MiB")


def report_problems(problems: list[str], options: PackOptions) -> list[str]:
    """Fail listing ``problems`` (entries that cannot be packed), or, with
    ``--skip-unreadable``, list them as skipped and return them."""
    if not problems:
        return []
    if not options.skip_unreadable:
        for p in problems:
            options.notify(f"cannot pack {p}")
        n = len(problems)
        raise PackError(
            f"{n} entr{'y' if n == 1 else 'ies'} cannot be packed (listed above); fix "
            "them or pass --skip-unreadable to leave them out"
        )
    for p in problems:
        options.notify(f"skipping {p}")
    return list(problems)


def finish(plan: PackPlan, results: list[_PartResult], options: PackOptions) -> PackSummary:
    """Check the workers' results, write the index, install the store atomically."""
    errors = [r.error for r in results if r.error]
    if errors:
        for msg in errors[:-1]:
            options.notify(msg)
        raise PackError(errors[-1] + ("" if len(errors) == 1 else
                                      f" (and {len(errors) - 1} more, above)"))
    results = sorted(results, key=lambda r: r.number)
    if [r.number for r in results] != list(range(len(plan.tasks))):
        raise PackError("internal error: partitions missing from the workers' results")
    data, stored = build_index(plan.scan, results, plan.configs, options, plan.n_normal,
                               plan.src, access=plan.access.value)
    plan.target.write_index(data)
    plan.target.install(shared=not plan.access.private)
    index_bytes = len(data)
    kinds = [e.kind for e in plan.scan.entries]
    return PackSummary(
        dest=plan.dest,
        files=kinds.count(KIND_FILE),
        dirs=kinds.count(KIND_DIR) - 1,
        symlinks=kinds.count(KIND_SYMLINK),
        raw_bytes=plan.scan.raw_bytes,
        stored_bytes=stored,
        index_bytes=index_bytes,
        partitions=len(plan.tasks),
        seconds=time.monotonic() - plan.t0,
        skipped=plan.skipped,
    )


def pack(
    src: str,
    dest: str,
    policy: CodecPolicy | None = None,
    options: PackOptions | None = None,
    scan: ScanResult | None = None,
) -> PackSummary:
    """Pack ``src`` into a store at ``dest``. Raises FanStoreError subclasses on failure."""
    options = options or PackOptions()
    plan = prepare(src, dest, policy, options, scan)
    try:
        results = run_tasks(plan.tasks, options, plan.scan.raw_bytes)
        return finish(plan, results, options)
    except BaseException:
        plan.target.discard()
        raise


def run_tasks(tasks: list[_PartTask], options: PackOptions, total: int) -> list[_PartResult]:
    """Compress ``tasks`` with a pool of worker processes (one partition per task)."""
    if not tasks:
        return []
    jobs = options.jobs or len(os.sched_getaffinity(0))
    jobs = max(1, min(jobs, len(tasks)))
    show_bar = sys.stderr.isatty() if options.progress is None else options.progress
    ctx = mp.get_context("fork")  # before any thread exists: the bar starts after the pool
    progress = ctx.Value("q", 0)
    # Biggest partitions first so the workers finish together.
    order = sorted(tasks, key=lambda t: -sum(f[2] for f in t.files))
    pool = ctx.Pool(jobs, initializer=_init_worker, initargs=(progress,))
    bar = None
    try:
        pending = [pool.apply_async(_pack_partition, (t,)) for t in order]
        if show_bar:
            from tqdm import tqdm

            tqdm.monitor_interval = 0
            bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1000,
                       desc="packing", file=sys.stderr, smoothing=0.1)
        results = []
        last = 0
        while pending:
            still = []
            for r in pending:
                if r.ready():
                    results.append(r.get())
                else:
                    still.append(r)
            pending = still
            if bar is not None:
                now = progress.value
                bar.update(now - last)
                last = now
            if pending:
                time.sleep(0.1)
        if bar is not None:
            bar.update(progress.value - last)
        pool.close()
        pool.join()
    except BaseException:
        pool.terminate()
        pool.join()
        raise
    finally:
        if bar is not None:
            bar.close()
    return sorted(results, key=lambda r: r.number)


def build_index(scan: ScanResult, results: list[_PartResult], configs, options: PackOptions,
                n_normal: int, src: str, access: str | None = None) -> tuple[bytes, int]:
    """The index bytes of a store made of ``results`` (one per partition, in number order)
    for the tree ``scan``; and the stored bytes of all partitions. ``access``: "private"
    or "shared", recorded in the metadata (``pack.access``)."""
    entries = scan.entries
    n_chunks = sum(len(r.chunks["part"]) for r in results)
    b = IndexBuilder(len(entries), n_chunks)
    for i, e in enumerate(entries):
        b.e["parent"][i] = e.parent
        b.e["kind"][i] = e.kind
        b.e["mode"][i] = e.mode
        b.e["mtime_ns"][i] = e.mtime_ns
        if i:
            b.set_name(i, os.path.basename(e.rel))
        if e.kind == KIND_DIR:
            b.e["first"][i], b.e["count"][i] = e.children
        elif e.kind == KIND_SYMLINK:
            b.set_target(i, e.target)
            b.e["size"][i] = len(e.target)
        else:
            b.e["size"][i] = e.size
    base = 0
    partitions = []
    for r in results:
        k = len(r.chunks["part"])
        for name, arr in r.chunks.items():
            b.c[name][base : base + k] = arr
        if r.chunk_firsts is not None:  # solid blocks: files may share a chunk
            firsts = base + r.chunk_firsts.astype(np.int64)
        else:  # each file's chunks follow the previous file's
            firsts = base + np.concatenate(([0], np.cumsum(r.chunk_counts)[:-1])).astype(
                np.int64)
        b.e["first"][r.entries] = np.where(r.chunk_counts > 0, firsts, 0)
        b.e["count"][r.entries] = r.chunk_counts
        if r.data_offsets is not None:  # solid blocks only (the streamed packer has none)
            b.e["offset"][r.entries] = r.data_offsets
        b.e["checksum"][r.entries] = r.file_sums
        base += k
        partitions.append(PartitionInfo(
            number=r.number, size=r.size, checksum=r.checksum, files=len(r.entries),
            raw_bytes=r.raw_bytes, broadcast=r.number >= n_normal,
        ))
    # Empty files own no chunks; point them at 0 so the runs of the others stay contiguous.
    stored = int(sum(p.size for p in partitions))
    meta = {
        "chunk_size": options.chunk_size,
        "codecs": configs,
        "partitions": [p.to_json() for p in partitions],
        "counts": {
            "files": sum(1 for e in entries if e.kind == KIND_FILE),
            "dirs": sum(1 for e in entries if e.kind == KIND_DIR) - 1,  # not the root
            "symlinks": sum(1 for e in entries if e.kind == KIND_SYMLINK),
            "raw_bytes": scan.raw_bytes,
            "stored_bytes": stored,
        },
        "pack": {
            "source": src if is_url(src) else os.path.abspath(src),
            "partitions": n_normal,
            "broadcast": list(options.broadcast),
            "chunk_size": options.chunk_size,
            "tool": f"fanstore {__version__}",
        },
    }
    if access is not None:
        meta["access"] = access
    meta.update(options.extra_meta)
    data = encode_index(meta, b.e, b.c, b.build_lookup(), bytes(b.names), bytes(b.targets))
    return data, stored
