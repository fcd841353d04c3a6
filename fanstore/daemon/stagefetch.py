"""Staging from object storage: a partition fetched as parallel range reads, resumably.

A partition in object storage is fetched as ranges of ``block`` bytes by a pool of
``jobs`` threads (parallel range reads across all this node's partitions), each range
written in place (pwrite) into the hidden ``.part-NNNNN.fsp.partial`` file. A small
``.partial.json`` record lists the ranges already written, with the partition's size and
checksum: a stage-in that is interrupted (killed, endpoint gone, node rebooted) goes on
where it stopped on the next start and fetches only the missing ranges. The whole copy
is then checked against the index's XXH3-128 before it is installed (fsync, rename,
``.ok`` record); a resumed copy that fails the check is fetched again from scratch once,
a fresh one that fails means the stored partition is damaged.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import stat
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

from fanstore import safeio
from fanstore.daemon.stagecheck import (
    PRIVATE_MODES,
    Modes,
    create_new,
    fd_checksum,
    own_size,
    read_json,
    record_ok,
    unlink,
)
from fanstore.errors import FanStoreError, StageError, UnsafePathError
from fanstore.storage import open_location

if TYPE_CHECKING:
    from fanstore.format.index import Index

log = logging.getLogger(__name__)


def _partial(local_dir: str, name: str) -> str:
    return os.path.join(local_dir, "." + name + ".partial")


def resumable(local_dir: str, index: Index, numbers: list[int], block: int) -> set[str]:
    """Names of ``.partial`` files whose record says they belong to the same partition
    (size, checksum, range size): those are continued, not removed."""
    keep = set()
    for p in numbers:
        info = index.partitions[p]
        tmp = _partial(local_dir, info.name)
        rec = read_json(tmp + ".json")
        if rec and (rec.get("size"), rec.get("checksum"), rec.get("block")) == (
                info.size, info.checksum, block) and own_size(tmp) == info.size:
            keep.add(os.path.basename(tmp))
    return keep


class _Download:
    """One partition being fetched: its partial file, the ranges done, the record."""

    def __init__(self, local_dir: str, name: str, size: int, checksum: str, block: int,
                 modes: Modes = PRIVATE_MODES) -> None:
        self.name = name
        self.modes = modes
        self.size = size
        self.checksum = checksum
        self.block = block
        self.dst = os.path.join(local_dir, name)
        self.tmp = _partial(local_dir, name)
        self.rec_path = self.tmp + ".json"
        self.lock = threading.Lock()
        rec = read_json(self.rec_path)
        if rec and (rec.get("size"), rec.get("checksum"), rec.get("block")) == (
                size, checksum, block) and own_size(self.tmp) == size:
            self.done = {int(k) for k in rec.get("done", []) if isinstance(k, int)}
        else:
            self.done = set()
        self.resumed = bool(self.done)
        self.fetched = 0
        self.fd = -1

    def open(self) -> None:
        if not self.done:
            unlink(self.rec_path)
            fd = create_new(self.tmp, self.modes.file)
            os.ftruncate(fd, self.size)  # sparse until the ranges arrive
        else:  # ours, checked when the record was read; never through a symlink
            fd = safeio.open_nofollow(self.tmp, owner=os.geteuid(), what="partial copy",
                                      write=True)
            os.fchmod(fd, stat.S_IMODE(os.fstat(fd).st_mode) & self.modes.file)
        self.fd = fd

    def missing(self) -> list[tuple[int, int, int]]:
        n = -(-self.size // self.block)
        return [(k, k * self.block, min(self.size, (k + 1) * self.block))
                for k in range(n) if k not in self.done]

    def put(self, k: int, offset: int, data: bytes) -> None:
        view = memoryview(data)
        while view:
            n = os.pwrite(self.fd, view, offset)
            view, offset = view[n:], offset + n
        with self.lock:
            self.done.add(k)
            self.fetched += len(data)
            self._save()

    def _save(self) -> None:
        record = {"size": self.size, "checksum": self.checksum, "block": self.block,
                  "done": sorted(self.done)}
        safeio.atomic_write(self.rec_path, json.dumps(record).encode(), self.modes.file)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def fetch_all(url: str, local_dir: str, index: Index, todo: list[int], jobs: int, who: str,
               block: int, modes: Modes = PRIVATE_MODES):
    """Fetch partitions ``todo`` from object storage; yield (partition, bytes fetched) as
    each is verified and installed."""
    loc = open_location(url)
    downloads = {p: _Download(local_dir, index.partitions[p].name, index.partitions[p].size,
                              index.partitions[p].checksum, block, modes) for p in todo}
    pool = ThreadPoolExecutor(max_workers=max(1, jobs), thread_name_prefix="stage-fetch")
    futures: dict[int, list[Future]] = {}

    def fetch(d: _Download, k: int, a: int, b: int) -> None:
        d.put(k, a, loc.read_range(d.name, a, b))

    def submit(p: int) -> None:
        d = downloads[p]
        d.open()
        futures[p] = [pool.submit(fetch, d, k, a, b) for k, a, b in d.missing()]

    try:
        for p in todo:
            try:
                submit(p)
            except UnsafePathError as exc:
                raise UnsafePathError(f"{who}: {exc}") from None
            except OSError as exc:
                raise _local_error(exc, who, downloads[p], local_dir) from None
        for p in todo:
            d = downloads[p]
            for _ in range(2):  # a resumed copy that fails its check is fetched again once
                try:
                    for fut in futures[p]:
                        fut.result()
                except FanStoreError as exc:
                    raise StageError(f"{who}: cannot stage {d.name} from {url}: {exc} "
                                     "(what was fetched is kept; a restart goes on from "
                                     "there)") from None
                except OSError as exc:
                    raise _local_error(exc, who, d, local_dir) from None
                d.close()
                if _partial_checksum(d.tmp) == d.checksum:
                    break
                if not d.resumed:
                    unlink(d.tmp)
                    unlink(d.rec_path)
                    raise StageError(f"{who}: partition {loc.show(d.name)} in object storage "
                                     "is damaged (checksum mismatch); repack or restore it")
                log.warning("%s: the resumed copy of %s is damaged; fetching it again",
                            who, d.name)
                d.done, d.resumed = set(), False
                submit(p)
            try:
                fd = safeio.open_nofollow(d.tmp, owner=os.geteuid(), what="partial copy")
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
                os.replace(d.tmp, d.dst)
                unlink(d.rec_path)
                record_ok(d.dst, d.checksum, d.modes)
            except UnsafePathError as exc:
                raise UnsafePathError(f"{who}: {exc}") from None
            except OSError as exc:
                raise _local_error(exc, who, d, local_dir) from None
            yield p, d.fetched
    finally:
        for fl in futures.values():
            for fut in fl:
                fut.cancel()
        pool.shutdown(wait=True, cancel_futures=True)
        for d in downloads.values():
            d.close()


def _partial_checksum(path: str) -> str:
    fd = safeio.open_nofollow(path, owner=os.geteuid(), what="partial copy")
    try:
        return fd_checksum(fd)
    finally:
        os.close(fd)


def _local_error(exc: OSError, who: str, d: _Download, local_dir: str) -> StageError:
    if exc.errno == errno.ENOSPC:
        return StageError(f"{who}: local storage full while staging {d.name} ({d.size:,} "
                          f"bytes needed) into {local_dir}")
    return StageError(f"{who}: cannot stage {d.name} into {local_dir}: {exc.strerror}")
