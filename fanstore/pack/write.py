"""The planned pack of a directory: check, scan, plan, compress, write the index, install.

:func:`prepare` checks the arguments, scans the tree and plans which partition and codec
each file gets (``fanstore.pack.plan``, with the policy it is given: the CLI makes it with
``fanstore.select.packpolicy``); the workers of ``fanstore.pack.worker`` compress the
partitions; :func:`finish` builds the index from their chunk rows
(``fanstore.pack.indexing``) and installs the store. :func:`pack` is the
three in one process; an MPI pack spreads the middle step over ranks
(``fanstore.daemon.mpipack``).

Atomicity: everything is written into a temporary sibling directory, fsynced, and renamed
onto the destination at the end; the index, whose presence makes a store, is written last.
An interrupted pack leaves at most a temporary directory, which the next pack removes.

Access: a source with anything other users may not read gives a private store (0700, files
0600), else the umask decides (``fanstore.pack.access``); the temporary directory is
private either way until the store is installed.
"""

from __future__ import annotations

import os
import time
from concurrent import futures
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable

from compressors import parse_spec
from fanstore.errors import PackError, UsageError
from fanstore.format.index import KIND_DIR, KIND_FILE, KIND_SYMLINK
from fanstore.format.partition import partition_name
from fanstore.kinds import file_kind
from fanstore.pack.access import Access, decide_tree
from fanstore.pack.dedup import Duplicates, check_unchanged, find_duplicates
from fanstore.pack.dest import check_destination, open_destination
from fanstore.pack.fallback import count_tasks
from fanstore.pack.indexing import build_index
from fanstore.pack.options import PackOptions, PackSummary, check_options, report_problems
from fanstore.pack.plan import CodecPolicy, CodecTable, in_dir, plan_partitions
from fanstore.pack.scan import ScanResult, scan_tree
from fanstore.pack.pool import WorkerPool
from fanstore.pack.worker import PartResult, PartTask, compress_inline, run_tasks, worker_count

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


# --------------------------------------------------------------------------- driver


def pack_workers(options: PackOptions) -> int:
    """The worker processes a pack of a directory needs: ``--jobs`` (0: every CPU), at most
    one per partition."""
    return worker_count(options, options.partitions + (1 if options.broadcast else 0))


@dataclass
class PackPlan:
    """Everything decided before compression starts (see :func:`prepare`)."""

    src: str
    dest: str
    scan: ScanResult
    tasks: list[PartTask]
    configs: list[dict[str, Any]]
    n_normal: int
    tmp: str
    skipped: list[str]
    t0: float
    target: Any = None  # a pack.dest destination (local directory or S3 prefix)
    access: Access = field(default_factory=lambda: Access(False))
    #: files stored once: duplicates are in no task, their entries get the first copy's run
    duplicates: Duplicates = field(default_factory=Duplicates)
    #: where the time went so far: (phase, seconds), see PackSummary.phases
    phases: list[tuple[str, float]] = field(default_factory=list)
    #: compressed in this process, with no worker (a small source: worker.INLINE_BYTES)
    inline: bool = False
    _mark: float = 0.0

    def lap(self, phase: str) -> None:
        """The time since the last phase ended goes to ``phase``."""
        now = time.monotonic()
        self.phases.append((phase, now - (self._mark or self.t0)))
        self._mark = now


def prepare(
    src: str,
    dest: str,
    policy: CodecPolicy | Callable[[ScanResult], CodecPolicy] | None = None,
    options: PackOptions | None = None,
    scan: ScanResult | None = None,
    pool: WorkerPool | None = None,
) -> PackPlan:
    """Check the arguments, scan the source, plan partitions and codecs, create the temp dir
    (``pool``: the workers that find duplicates; None: this process alone). A pool not
    started yet is started once the scan is done, unless the source is small enough to
    compress in this process (``plan.inline``, :func:`~fanstore.pack.worker.compress_inline`:
    then no worker starts at all). ``policy`` may
    be a function of the scan: it then runs while the workers look for duplicates (a
    quick selection and the duplicate search each take seconds on a large tree, one in
    this process, one in the workers).

    The caller must run the plan's tasks and call :func:`finish`, or
    ``plan.target.discard()``.
    """
    options = options or PackOptions()
    t0 = time.monotonic()
    policy_in = policy
    destination = _open_checked(src, dest, options)
    destination.prepare(src, options.force)

    if scan is None:
        scan = scan_tree(src, symlinks=options.symlinks)
    t_scan = time.monotonic()
    inline = pool is not None and not pool.started and compress_inline(options, scan.raw_bytes)
    if inline:
        pool = None
    elif pool is not None:
        pool.start()  # the interpreters start while this one plans (and selects codecs)
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
    # A broadcast file's first copy stays in a broadcast partition (class 1), and so on.
    dups, policy = _duplicates_and_policy(scan, is_bcast, policy, options, pool)
    destination.create_tmp()
    tasks, configs = _tasks(scan, is_bcast, dups, policy, options, destination)
    plan = PackPlan(os.path.abspath(src), destination.url, scan, tasks, configs,
                    options.partitions, destination.tmp, skipped, t0, destination, access, dups,
                    inline=inline)
    plan.phases.append(("scan", t_scan - t0))
    plan._mark = t_scan
    plan.lap("selection and duplicates" if callable(policy_in) else "duplicates")
    return plan


def _tasks(scan: ScanResult, is_bcast: list[bool], dups: Duplicates, policy: CodecPolicy,
           options: PackOptions, destination) -> tuple[list[PartTask], list[dict[str, Any]]]:
    """The partition tasks (``options.partitions``, then the broadcast ones) of the files
    that are no duplicate, with their codecs and solid blocks; and the codec table."""
    entries = scan.entries
    files = scan.files
    normal = [i for i, bc in zip(files, is_bcast) if not bc and i not in dups.of]
    bcast = [i for i, bc in zip(files, is_bcast) if bc and i not in dups.of]

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

    codecs = CodecTable()
    slot = codecs.slot
    tasks = [PartTask(p, destination.partition_path(partition_name(p)), [], codecs.configs,
                      options.chunk_size) for p in range(n_normal + n_bcast)]
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
    return tasks, codecs.configs


def _duplicates_and_policy(scan: ScanResult, is_bcast: list[bool], policy, options: PackOptions,
                           pool: WorkerPool | None) -> tuple[Duplicates, CodecPolicy]:
    """The duplicates of the scanned tree (``options.dedup``) and the codec policy (a
    function of the scan is called while a thread of this process drives the search on
    the workers; the thread is always waited for)."""
    if not callable(policy):
        dups = (find_duplicates(scan.root, scan.entries, scan.files, is_bcast, pool)
                if options.dedup else Duplicates())
        return dups, policy or CodecPolicy(parse_spec("zstd:3"))
    if not options.dedup:
        return Duplicates(), policy(scan)
    with ThreadPoolExecutor(1, thread_name_prefix="pack-dedup") as search:
        found = search.submit(find_duplicates, scan.root, scan.entries, scan.files, is_bcast,
                              pool)
        try:
            chosen = policy(scan)
        finally:
            futures.wait([found])
    return found.result(), chosen


def finish(plan: PackPlan, results: list[PartResult], options: PackOptions) -> PackSummary:
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
    plan.lap("compression")
    # A duplicate was never read after the compare: changed since, it must not be stored.
    check_unchanged(plan.scan.root, plan.scan.entries, plan.duplicates)
    fallbacks = count_tasks(plan.configs, plan.tasks, results)
    data, stored = build_index(plan.scan, results, plan.configs, options, plan.n_normal,
                               plan.src, access=plan.access.value,
                               duplicates=plan.duplicates.of)
    plan.target.write_index(data)
    plan.target.install(shared=not plan.access.private)
    plan.lap("index and install")
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
        outside_skipped=plan.scan.outside_skipped,
        duplicates=len(plan.duplicates),
        saved_bytes=plan.duplicates.saved_bytes,
        fallbacks=fallbacks,
        phases=plan.phases,
    )


def pack(
    src: str,
    dest: str,
    policy: CodecPolicy | Callable[[ScanResult], CodecPolicy] | None = None,
    options: PackOptions | None = None,
    scan: ScanResult | None = None,
    pool: WorkerPool | None = None,
) -> PackSummary:
    """Pack ``src`` into a store at ``dest`` with the worker processes of ``pool`` (None: a
    pool of ``options.jobs`` made here), or in this process if the source is small (see
    :func:`prepare`); ``policy``: a codec policy, or a function of the scan that makes one
    (see :func:`prepare`). Raises FanStoreError subclasses on failure."""
    options = options or PackOptions()
    if pool is None:
        with WorkerPool(pack_workers(options)) as own:  # started by prepare, if needed
            return pack(src, dest, policy, options, scan, own)
    plan = prepare(src, dest, policy, options, scan, pool)
    try:
        results = run_tasks(plan.tasks, options, plan.scan.raw_bytes,
                            None if plan.inline else pool, inline=plan.inline)
        return finish(plan, results, options)
    except BaseException:
        plan.target.discard()
        raise
