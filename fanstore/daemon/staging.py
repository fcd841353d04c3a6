"""Stage-in: copy this node's partitions from the shared store to node-local storage.

The store may also live in object storage (``s3://``): see "object storage" below.

- Large sequential reads (8 MiB) and several partitions in flight (``jobs`` threads).
- Each copy is written to a hidden ``.part-NNNNN.fsp.partial`` file, checked (size and
  XXH3-128 against the index) while it is written, fsynced, then renamed: a partial copy
  is never mistaken for a complete one.
- A verified partition gets a small ``.ok`` record (size, mtime, checksum). On a restart a
  partition whose record matches is reused without copying or reading it again; one whose
  record is missing or stale is re-hashed and copied again only if it is damaged.
- Free space is checked before copying; a full disk is a clear error naming the node and
  the bytes needed.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import stat
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import xxhash

from fanstore.errors import FanStoreError, StageError
from fanstore.format.index import Index
from fanstore.format.partition import file_checksum, partition_name
from fanstore.storage import is_url, open_location

log = logging.getLogger(__name__)

BLOCK = 8 << 20


@dataclass
class StageReport:
    partitions: list[int] = field(default_factory=list)
    copied: list[int] = field(default_factory=list)
    reused: list[int] = field(default_factory=list)
    bytes_copied: int = 0
    bytes_local: int = 0
    seconds: float = 0.0

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


def _ok_path(path: str) -> str:
    return path + ".ok"


def _record_ok(path: str, checksum: str) -> None:
    st = os.stat(path)
    tmp = _ok_path(path) + ".tmp"
    with open(tmp, "w") as f:
        json.dump({"size": st.st_size, "mtime_ns": st.st_mtime_ns, "checksum": checksum}, f)
    os.replace(tmp, _ok_path(path))


def _valid_copy(path: str, size: int, checksum: str) -> bool:
    """Is ``path`` a complete, undamaged copy? Cheap when its .ok record is current."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    if st.st_size != size:
        return False
    try:
        with open(_ok_path(path)) as f:
            rec = json.load(f)
        if isinstance(rec, dict) and (rec.get("size"), rec.get("mtime_ns"),
                                      rec.get("checksum")) == (size, st.st_mtime_ns, checksum):
            return True
    except (OSError, ValueError):
        pass  # no record, or a damaged one: hash the copy
    try:
        intact = file_checksum(path) == checksum
    except OSError as exc:  # an unreadable copy is copied again
        log.warning("%s: cannot read the staged copy (%s); copying it again", path, exc.strerror)
        return False
    if intact:
        try:
            _record_ok(path, checksum)
        except OSError as exc:  # the record only saves a re-hash next time
            log.warning("%s: cannot write its .ok record: %s", path, exc.strerror)
        return True
    log.warning("%s: staged copy is damaged; copying it again", path)
    return False


def _copy(src: str, dst: str, size: int, checksum: str, who: str) -> int:
    tmp = os.path.join(os.path.dirname(dst), "." + os.path.basename(dst) + ".partial")
    h = xxhash.xxh3_128()
    done = 0
    buf = bytearray(BLOCK)
    view = memoryview(buf)
    try:
        # O_NONBLOCK: a FIFO in a partition's place is refused instead of blocking the node.
        fd = os.open(src, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise StageError(f"{who}: partition {src} on the shared store is not a regular "
                             "file")
        with open(fd, "rb", buffering=0) as fin, open(tmp, "wb", buffering=0) as fout:
            try:
                os.posix_fadvise(fin.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
            except (AttributeError, OSError):
                pass
            while True:
                n = fin.readinto(buf)
                if not n:
                    break
                chunk = view[:n]
                h.update(chunk)
                written = 0
                while written < n:
                    written += fout.write(chunk[written:])
                done += n
            fout.flush()
            os.fsync(fout.fileno())
    except OSError as exc:
        _unlink(tmp)
        if exc.errno == errno.ENOSPC:
            raise StageError(f"{who}: local storage full while staging {os.path.basename(dst)} "
                             f"({size:,} bytes needed) into {os.path.dirname(dst)}") from None
        raise StageError(f"{who}: cannot stage {os.path.basename(dst)}: {exc.strerror} "
                         f"({exc.filename or src})") from None
    except BaseException:
        _unlink(tmp)
        raise
    if done != size or h.hexdigest() != checksum:
        _unlink(tmp)
        what = f"{done:,} bytes, expected {size:,}" if done != size else "checksum mismatch"
        raise StageError(f"{who}: partition {src} on the shared store is damaged ({what}); "
                         "repack or restore it")
    try:
        os.replace(tmp, dst)
        _record_ok(dst, checksum)
    except OSError as exc:  # e.g. ENOSPC for the record on a disk the copy just filled
        _unlink(tmp)
        raise StageError(f"{who}: cannot stage {os.path.basename(dst)} into "
                         f"{os.path.dirname(dst)}: {exc.strerror}") from None
    return done


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def stage_partitions(store_dir: str, local_dir: str, index: Index, numbers: list[int],
                     jobs: int = 4, who: str = "node", block: int = BLOCK) -> StageReport:
    """Make ``local_dir`` hold valid copies of partitions ``numbers``; return what was done.

    ``store_dir`` may be an object-store URL (``s3://bucket/ds.fs``): partitions are then
    fetched with ``jobs`` parallel range reads of ``block`` bytes, resumably (see
    :func:`_fetch_all`).
    """
    t0 = time.monotonic()
    report = StageReport(partitions=sorted(numbers))
    remote = is_url(store_dir)
    try:
        os.makedirs(local_dir, exist_ok=True)
        names = os.listdir(local_dir)
    except OSError as exc:  # a file in the way, a read-only or missing mount, ...
        raise StageError(f"{who}: cannot use local storage {local_dir}: {exc.strerror}") \
            from None
    resumable = _resumable(local_dir, index, numbers, block) if remote else set()
    for name in names:  # leftovers of an interrupted copy (unless a download can go on)
        if name.startswith(".") and name.endswith(".partial") and name not in resumable:
            _unlink(os.path.join(local_dir, name))
            _unlink(os.path.join(local_dir, name + ".json"))
    todo = []
    for p in report.partitions:
        info = index.partitions[p]
        dst = os.path.join(local_dir, partition_name(p))
        if _valid_copy(dst, info.size, info.checksum):
            report.reused.append(p)
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
        return _copy(os.path.join(store_dir, info.name), os.path.join(local_dir, info.name),
                     info.size, info.checksum, who)

    if todo and remote:
        for p, n in _fetch_all(store_dir, local_dir, index, todo, jobs, who, block):
            report.copied.append(p)
            report.bytes_copied += n
    elif todo:
        with ThreadPoolExecutor(max_workers=max(1, min(jobs, len(todo)))) as pool:
            for p, n in zip(todo, pool.map(one, todo)):
                report.copied.append(p)
                report.bytes_copied += n
    report.bytes_local = sum(index.partitions[p].size for p in report.partitions)
    report.seconds = time.monotonic() - t0
    return report


def _size(path: str) -> int:
    try:
        return os.stat(path).st_size
    except FileNotFoundError:
        return 0


# --------------------------------------------------------------------------- object storage
#
# A partition in object storage is fetched as ranges of ``block`` bytes by a pool of
# ``jobs`` threads (parallel range reads across all this node's partitions), each range
# written in place (pwrite) into the hidden ``.part-NNNNN.fsp.partial`` file. A small
# ``.partial.json`` record lists the ranges already written, with the partition's size and
# checksum: a stage-in that is interrupted (killed, endpoint gone, node rebooted) goes on
# where it stopped on the next start and fetches only the missing ranges. The whole copy
# is then checked against the index's XXH3-128 before it is installed (fsync, rename,
# ``.ok`` record); a resumed copy that fails the check is fetched again from scratch once,
# a fresh one that fails means the stored partition is damaged.


def _partial(local_dir: str, name: str) -> str:
    return os.path.join(local_dir, "." + name + ".partial")


def _read_record(path: str) -> dict | None:
    try:
        with open(path) as f:
            rec = json.load(f)
        return rec if isinstance(rec, dict) else None
    except (OSError, ValueError):
        return None


def _resumable(local_dir: str, index: Index, numbers: list[int], block: int) -> set[str]:
    """Names of ``.partial`` files whose record says they belong to the same partition
    (size, checksum, range size): those are continued, not removed."""
    keep = set()
    for p in numbers:
        info = index.partitions[p]
        tmp = _partial(local_dir, info.name)
        rec = _read_record(tmp + ".json")
        if rec and (rec.get("size"), rec.get("checksum"), rec.get("block")) == (
                info.size, info.checksum, block) and _size(tmp) == info.size:
            keep.add(os.path.basename(tmp))
    return keep


class _Download:
    """One partition being fetched: its partial file, the ranges done, the record."""

    def __init__(self, local_dir: str, name: str, size: int, checksum: str, block: int) -> None:
        self.name = name
        self.size = size
        self.checksum = checksum
        self.block = block
        self.dst = os.path.join(local_dir, name)
        self.tmp = _partial(local_dir, name)
        self.rec_path = self.tmp + ".json"
        self.lock = threading.Lock()
        rec = _read_record(self.rec_path)
        if rec and (rec.get("size"), rec.get("checksum"), rec.get("block")) == (
                size, checksum, block) and _size(self.tmp) == size:
            self.done = {int(k) for k in rec.get("done", []) if isinstance(k, int)}
        else:
            self.done = set()
        self.resumed = bool(self.done)
        self.fetched = 0
        self.fd = -1

    def open(self) -> None:
        if not self.done:
            _unlink(self.rec_path)
            fd = os.open(self.tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
            os.ftruncate(fd, self.size)  # sparse until the ranges arrive
        else:
            fd = os.open(self.tmp, os.O_WRONLY | os.O_CLOEXEC)
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
        tmp = self.rec_path + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"size": self.size, "checksum": self.checksum, "block": self.block,
                       "done": sorted(self.done)}, f)
        os.replace(tmp, self.rec_path)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _fetch_all(url: str, local_dir: str, index: Index, todo: list[int], jobs: int, who: str,
               block: int):
    """Fetch partitions ``todo`` from object storage; yield (partition, bytes fetched) as
    each is verified and installed."""
    loc = open_location(url)
    downloads = {p: _Download(local_dir, index.partitions[p].name, index.partitions[p].size,
                              index.partitions[p].checksum, block) for p in todo}
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
                if file_checksum(d.tmp) == d.checksum:
                    break
                if not d.resumed:
                    _unlink(d.tmp)
                    _unlink(d.rec_path)
                    raise StageError(f"{who}: partition {loc.show(d.name)} in object storage "
                                     "is damaged (checksum mismatch); repack or restore it")
                log.warning("%s: the resumed copy of %s is damaged; fetching it again",
                            who, d.name)
                d.done, d.resumed = set(), False
                submit(p)
            try:
                fd = os.open(d.tmp, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
                os.replace(d.tmp, d.dst)
                _unlink(d.rec_path)
                _record_ok(d.dst, d.checksum)
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


def _local_error(exc: OSError, who: str, d: _Download, local_dir: str) -> StageError:
    if exc.errno == errno.ENOSPC:
        return StageError(f"{who}: local storage full while staging {d.name} ({d.size:,} "
                          f"bytes needed) into {local_dir}")
    return StageError(f"{who}: cannot stage {d.name} into {local_dir}: {exc.strerror}")


def remove_staged(local_dir: str, numbers: list[int]) -> None:
    for p in numbers:
        path = os.path.join(local_dir, partition_name(p))
        _unlink(path)
        _unlink(_ok_path(path))
