"""Stage-in: copy this node's partitions from the shared store to node-local storage.

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
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import xxhash

from fanstore.errors import StageError
from fanstore.format.index import Index
from fanstore.format.partition import file_checksum, partition_name

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
                     jobs: int = 4, who: str = "node") -> StageReport:
    """Make ``local_dir`` hold valid copies of partitions ``numbers``; return what was done."""
    t0 = time.monotonic()
    report = StageReport(partitions=sorted(numbers))
    try:
        os.makedirs(local_dir, exist_ok=True)
        names = os.listdir(local_dir)
    except OSError as exc:  # a file in the way, a read-only or missing mount, ...
        raise StageError(f"{who}: cannot use local storage {local_dir}: {exc.strerror}") \
            from None
    for name in names:  # leftovers of an interrupted copy
        if name.startswith(".") and name.endswith(".partial"):
            _unlink(os.path.join(local_dir, name))
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

    if todo:
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


def remove_staged(local_dir: str, numbers: list[int]) -> None:
    for p in numbers:
        path = os.path.join(local_dir, partition_name(p))
        _unlink(path)
        _unlink(_ok_path(path))
