"""Stage-in: copy this node's partitions from the shared store to node-local storage.

- Large sequential reads (8 MiB) and several partitions in flight (``jobs`` threads): the
  copy itself is :mod:`fanstore.daemon.stagecopy`; a store in object storage (``s3://``)
  is fetched with parallel range reads, resumably (:mod:`fanstore.daemon.stagefetch`).
- Each copy is written to a hidden ``.part-NNNNN.fsp.partial`` file, checked (size and
  XXH3-128 against the index) while it is written, fsynced, then renamed: a partial copy
  is never mistaken for a complete one.
- A verified partition gets a small ``.ok`` record (size, mtime, checksum). On a restart a
  partition whose record matches is reused without copying or reading it again; one whose
  record is missing or stale is re-hashed and copied again only if it is damaged
  (:mod:`fanstore.daemon.stagecheck`).
- Free space is checked before copying; a full disk is a clear error naming the node and
  the bytes needed.

Other users of the node (docs/reliability.md, "Multi-user nodes"):

- The local directory is checked before anything is written in it: an existing one must
  be a real directory owned by this uid that nobody else can write to
  (:func:`fanstore.safeio.owned_dir`), and no directory on the way to it may be
  replaceable by another user (:func:`fanstore.safeio.trusted_path`). A missing one is
  created with ``mkdir`` (parents 0700), never through a symlink planted at its name.
- Copies follow the store (:func:`store_is_private`, the index's ``access``): a private
  store's copies and records are 0600 and a local directory FanStore creates is 0700; a
  shared store's get the umask's modes.
- Every file is created ``O_CREAT|O_EXCL|O_NOFOLLOW`` (the ``.partial`` copy) or written
  to a fresh temporary name and renamed into place (``.ok`` and ``.partial.json``
  records); a file that is reused (a valid copy, a partial copy to resume, a record) is
  opened without following symlinks and must be a regular file owned by this uid.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import stat
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

from fanstore import safeio
from fanstore.daemon import stageowner
from fanstore.daemon.stagecheck import BLOCK, Modes, ok_path, unlink, valid_copy
from fanstore.daemon.stagecopy import copy_partition
from fanstore.daemon.stagefetch import fetch_all, resumable
from fanstore.errors import StageError, UnsafePathError
from fanstore.format.index import INDEX_NAME, Index
from fanstore.format.partition import partition_name
from fanstore.storage import is_url

log = logging.getLogger(__name__)


@dataclass
class StageReport:
    partitions: list[int] = field(default_factory=list)
    copied: list[int] = field(default_factory=list)
    reused: list[int] = field(default_factory=list)
    bytes_copied: int = 0
    bytes_local: int = 0
    seconds: float = 0.0
    #: the local directory did not exist and staging created it (or a dead mount that
    #: had created it left it: :func:`fanstore.daemon.stageowner.sweep`)
    created: bool = False
    #: this mount's owner record in the local directory (None with ``--keep-local``)
    owner_record: str | None = None

    @property
    def mb_per_s(self) -> float:
        return self.bytes_copied / 1e6 / self.seconds if self.seconds > 0 else 0.0

    def line(self, who: str) -> str:
        return (f"{who}: staged {len(self.copied)} partitions ({self.bytes_copied / 1e6:,.1f} MB) "
                f"in {self.seconds:.2f} s ({self.mb_per_s:,.0f} MB/s), reused "
                f"{len(self.reused)}; {self.bytes_local / 1e6:,.1f} MB local")

    def to_json(self) -> dict:
        return {"staged_partitions": len(self.copied), "reused_partitions": len(self.reused),
                "staged_bytes": self.bytes_copied, "local_bytes_on_disk": self.bytes_local,
                "stage_seconds": round(self.seconds, 3),
                "stage_mb_per_s": round(self.mb_per_s, 1)}


def store_is_private(store_dir: str, index: Index) -> bool:
    """Whether copies of this store must be private: its index says so (``access``), or,
    for a store written before the key existed, its own modes do (a directory or index
    other users cannot read); a store in object storage without the key counts as
    private (it has no modes to go by)."""
    access = index.meta.get("access")
    if access in ("private", "shared"):
        return access == "private"
    if access is not None or is_url(store_dir):
        return True
    try:
        d = os.stat(store_dir).st_mode
        i = os.stat(os.path.join(store_dir, INDEX_NAME)).st_mode
    except OSError:
        return True
    return (d & 0o005) != 0o005 or not i & 0o004


def prepare_local_dir(local_dir: str, private: bool, who: str = "node") -> bool:
    """Check (or create) the node-local directory before anything is written in it; see
    the module docstring. Returns whether it was created. Raises UnsafePathError for a
    directory another user could read into, write into or swap, StageError when it cannot
    be used at all (a file in the way, a read-only file system)."""
    what = "local directory"
    try:
        safeio.trusted_path(local_dir, what=what)
        try:
            created = safeio.make_dirs(local_dir, Modes.of(private).dir, 0o700, what=what)
        except OSError as exc:  # a file in the way, a read-only or missing mount, ...
            raise StageError(f"{who}: cannot use local storage {local_dir}: "
                             f"{exc.strerror}") from None
        st = os.lstat(local_dir)
        if not stat.S_ISDIR(st.st_mode) and not stat.S_ISLNK(st.st_mode):
            raise StageError(f"{who}: cannot use local storage {local_dir}: "
                             f"{os.strerror(errno.EEXIST)}")
        safeio.owned_dir(local_dir, what=what)
    except UnsafePathError as exc:
        raise UnsafePathError(f"{who}: {exc}") from None
    return created


def stage_partitions(store_dir: str, local_dir: str, index: Index, numbers: list[int],
                     jobs: int = 4, who: str = "node", block: int = BLOCK,
                     private: bool | None = None, owned: bool = False,
                     progress: Callable[[], None] = lambda: None) -> StageReport:
    """Make ``local_dir`` hold valid copies of partitions ``numbers``; return what was done.

    ``store_dir`` may be an object-store URL (``s3://bucket/ds.fs``): partitions are then
    fetched with ``jobs`` parallel range reads of ``block`` bytes, resumably (see
    :func:`fanstore.daemon.stagefetch.fetch_all`). ``private``: whether the copies must be
    private (default: as the store, :func:`store_is_private`). Raises StageError, or
    UnsafePathError for a local directory other users could read into, write into or swap.
    ``owned``: the copies are removed when this mount ends (no ``--keep-local``): an owner
    record says so in the directory (:mod:`fanstore.daemon.stageowner`); what mounts that
    died there left is cleaned up first in any case. ``progress`` is called once per
    partition done (found valid or copied): a waiting command's sign of life.
    """
    t0 = time.monotonic()
    report = StageReport(partitions=sorted(numbers))
    if private is None:
        private = store_is_private(store_dir, index)
    modes = Modes.of(private)
    report.created = prepare_local_dir(local_dir, private, who)
    _, inherited = stageowner.sweep(local_dir, report.partitions, who)
    if owned:
        report.created = report.created or inherited
        report.owner_record = stageowner.claim(local_dir, report.partitions, report.created,
                                               modes.file)
    try:
        _stage(store_dir, local_dir, index, report, jobs, who, block, modes, progress)
    except BaseException:
        if not (report.copied or report.reused):  # nothing here for the next mount to clean
            stageowner.release(report.owner_record)
        raise
    report.seconds = time.monotonic() - t0
    return report


def _stage(store_dir: str, local_dir: str, index: Index, report: StageReport, jobs: int,
           who: str, block: int, modes: Modes, progress: Callable[[], None]) -> None:
    numbers = report.partitions
    remote = is_url(store_dir)
    try:
        names = os.listdir(local_dir)
    except OSError as exc:  # a read-only or vanished mount, ...
        raise StageError(f"{who}: cannot use local storage {local_dir}: {exc.strerror}") \
            from None
    going_on = resumable(local_dir, index, numbers, block) if remote else set()
    for name in names:  # leftovers of an interrupted copy (unless a download can go on)
        if name.startswith(".") and name.endswith(".partial") and name not in going_on:
            unlink(os.path.join(local_dir, name))
            unlink(os.path.join(local_dir, name + ".json"))
        elif name.startswith(".part-") and name.endswith(".tmp"):  # a record half-written
            unlink(os.path.join(local_dir, name))
    todo = []
    for p in report.partitions:
        info = index.partitions[p]
        dst = os.path.join(local_dir, partition_name(p))
        if valid_copy(dst, info.size, info.checksum, modes):
            report.reused.append(p)
            progress()
        else:
            todo.append(p)
    need = sum(index.partitions[p].size for p in todo)
    if need:
        # A stale copy of the same partition is overwritten, so its space counts as free.
        reclaim = sum(_size(os.path.join(local_dir, partition_name(p))) for p in todo)
        free = shutil.disk_usage(local_dir).free + reclaim
        if need > free:
            raise StageError(
                f"{who}: local storage {local_dir} is too small: {len(todo)} partitions need "
                f"{need:,} bytes, {free:,} available (use more nodes or partitions, fewer "
                "replicas, or a bigger --local-dir)")

    def one(p: int) -> int:
        info = index.partitions[p]
        return copy_partition(os.path.join(store_dir, info.name),
                              os.path.join(local_dir, info.name), info.size, info.checksum,
                              who, modes)

    if todo and remote:
        for p, n in fetch_all(store_dir, local_dir, index, todo, jobs, who, block, modes):
            report.copied.append(p)
            report.bytes_copied += n
            progress()
    elif todo:
        with ThreadPoolExecutor(max_workers=max(1, min(jobs, len(todo)))) as pool:
            for p, n in zip(todo, pool.map(one, todo)):
                report.copied.append(p)
                report.bytes_copied += n
                progress()
    report.bytes_local = sum(index.partitions[p].size for p in report.partitions)


def _size(path: str) -> int:
    try:
        return os.lstat(path).st_size
    except FileNotFoundError:
        return 0


def remove_staged(local_dir: str, numbers: list[int]) -> None:
    for p in numbers:
        path = os.path.join(local_dir, partition_name(p))
        unlink(path)
        unlink(ok_path(path))
