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

The copy (measured in docs/benchmarks.md, "Stage-in"): each block is read into one
page-aligned buffer per copy, hashed there and written from there, so the bytes that are
checked are the bytes that are written. The destination is written with ``O_DIRECT`` (whole
blocks; the unaligned tail, and everything on a file system that refuses direct I/O, go
through the page cache and are dropped after the fsync), and the source's pages are dropped
(``POSIX_FADV_DONTNEED``) as soon as a block is written: staging never reads them again, and
the page cache then holds neither the store nor the copy. Through the page cache a stage-in
of N bytes filled 2N bytes of it; on the benchmark machine, where new page-cache pages are
what costs, that ran at 450 MB/s for 3 CPU s/GB, this at 700 MB/s for 0.35 s/GB (1 rank).
``copy_file_range`` (what ``cp`` does) goes through the page cache too, and would need the
bytes read back to hash them.

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
import fcntl
import json
import logging
import mmap
import os
import shutil
import stat
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import xxhash

from fanstore import safeio
from fanstore.errors import FanStoreError, StageError, UnsafePathError
from fanstore.format.index import INDEX_NAME, Index
from fanstore.format.partition import partition_name
from fanstore.storage import is_url, open_location

log = logging.getLogger(__name__)

BLOCK = 8 << 20
_O_DIRECT = getattr(os, "O_DIRECT", 0)
#: direct writes must be aligned (offset, length, buffer) to the device's logical block size:
#: whole blocks are; a tail that is not a multiple of this is written through the page cache
_DIRECT_ALIGN = 4096
_SEQUENTIAL = getattr(os, "POSIX_FADV_SEQUENTIAL", None)
#: the source's pages dropped after each block: the last this many bytes read, not just the
#: block's own range. A page still under readahead, or in a folio reaching past the block,
#: is kept by the call for its own block and dropped by a later one (measured: 1 MiB blocks
#: with exact ranges left 900 of 960 MiB read in the page cache, and ran at 280 MB/s instead
#: of 700)
_DROP_BEHIND = 64 << 20
_DONTNEED = getattr(os, "POSIX_FADV_DONTNEED", None)


@dataclass
class StageReport:
    partitions: list[int] = field(default_factory=list)
    copied: list[int] = field(default_factory=list)
    reused: list[int] = field(default_factory=list)
    bytes_copied: int = 0
    bytes_local: int = 0
    seconds: float = 0.0
    #: the local directory did not exist and staging created it
    created: bool = False

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


@dataclass(frozen=True)
class _Modes:
    """Modes of what staging writes: ``file`` for copies and records, ``dir`` for a local
    directory it creates."""

    file: int
    dir: int

    @classmethod
    def of(cls, private: bool) -> "_Modes":
        if private:
            return cls(0o600, 0o700)
        return cls(safeio.umask_mode(0o666), safeio.umask_mode(0o777))


_PRIVATE_MODES = _Modes(0o600, 0o700)


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


def _ok_path(path: str) -> str:
    return path + ".ok"


def _record_ok(path: str, checksum: str, modes: _Modes = _PRIVATE_MODES) -> None:
    st = os.lstat(path)
    record = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "checksum": checksum}
    safeio.atomic_write(_ok_path(path), json.dumps(record).encode(), modes.file)


def _regular_ours(st: os.stat_result) -> bool:
    return stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid()


def _read_json(path: str) -> dict | None:
    """A small JSON record of ours (a regular file owned by this uid, never read through a
    symlink), or None when it is missing, foreign or not a JSON object."""
    try:
        fd = safeio.open_nofollow(path, owner=os.geteuid(), what="staging record")
    except (OSError, UnsafePathError):
        return None
    try:
        with open(fd, "rb") as f:
            rec = json.loads(f.read(1 << 20))
        return rec if isinstance(rec, dict) else None
    except (OSError, ValueError):
        return None


def _narrow_mode(path: str, mode: int) -> None:
    """Take away permission bits ``mode`` does not have (a copy staged by an older
    FanStore, 0644, for a private store), without following a symlink."""
    try:
        fd = safeio.open_nofollow(path, owner=os.geteuid())
    except (OSError, UnsafePathError):
        return
    try:
        have = stat.S_IMODE(os.fstat(fd).st_mode)
        if have & ~mode:
            os.fchmod(fd, have & mode)
    finally:
        os.close(fd)


def _valid_copy(path: str, size: int, checksum: str, modes: _Modes = _PRIVATE_MODES) -> bool:
    """Is ``path`` a complete, undamaged copy? Cheap when its .ok record is current. Only a
    regular file owned by this uid counts (a symlink in its place is copied over)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    if not _regular_ours(st) or st.st_size != size:
        return False
    if _recorded(path, st, size, checksum):
        _narrow_mode(path, modes.file)
        _narrow_mode(_ok_path(path), modes.file)
        return True
    # no record, or a damaged one: hash the copy
    try:
        fd = safeio.open_nofollow(path, owner=os.geteuid(), what="staged copy")
        try:
            intact = _fd_checksum(fd) == checksum
        finally:
            os.close(fd)
    except (OSError, UnsafePathError) as exc:  # an unreadable copy is copied again
        log.warning("%s: cannot read the staged copy (%s); copying it again", path,
                    getattr(exc, "strerror", None) or exc)
        return False
    if intact:
        _narrow_mode(path, modes.file)
        try:
            _record_ok(path, checksum, modes)
        except OSError as exc:  # the record only saves a re-hash next time
            log.warning("%s: cannot write its .ok record: %s", path, exc.strerror)
        return True
    log.warning("%s: staged copy is damaged; copying it again", path)
    return False


def _recorded(path: str, st: os.stat_result, size: int, checksum: str) -> bool:
    """Does the .ok record of ``path`` (stat ``st``) vouch for it as it is now?"""
    rec = _read_json(_ok_path(path))
    return rec is not None and (rec.get("size"), rec.get("mtime_ns"),
                                rec.get("checksum")) == (size, st.st_mtime_ns, checksum)


def staged_copies(local_dir: str, index: Index) -> dict[int, int]:
    """{partition: size} of the copies in ``local_dir`` that staging will reuse without
    copying: regular files of ours, of the right size, with a current .ok record. Nothing
    is written or hashed (a copy without a current record is not counted, although
    staging may find it intact)."""
    out = {}
    for info in index.partitions:
        path = os.path.join(local_dir, partition_name(info.number))
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if _regular_ours(st) and st.st_size == info.size \
                and _recorded(path, st, info.size, info.checksum):
            out[info.number] = info.size
    return out


def _fd_checksum(fd: int, block: int = BLOCK) -> str:
    """XXH3-128 (hex) of the whole file open at ``fd`` (as ``file_checksum``)."""
    h = xxhash.xxh3_128()
    buf = bytearray(block)
    view = memoryview(buf)
    offset = 0
    while True:
        n = os.preadv(fd, [buf], offset)
        if not n:
            return h.hexdigest()
        h.update(view[:n])
        offset += n


def _create_new(path: str, mode: int) -> int:
    """A new file at ``path``, created exclusively (never through a symlink); a leftover
    at that name (ours: the directory is checked) is removed first."""
    try:
        return safeio.create_excl(path, mode)
    except FileExistsError:
        _unlink(path)  # unlink never follows a symlink: a link is removed, not its target
        return safeio.create_excl(path, mode)


def _fadvise(fd: int, offset: int, length: int, advice: int | None) -> None:
    if advice is None:  # a platform without posix_fadvise
        return
    try:
        os.posix_fadvise(fd, offset, length, advice)
    except OSError:  # advice only: not every file system takes it
        pass


def _direct(fd: int, on: bool) -> bool:
    """Switch ``O_DIRECT`` on or off for ``fd``; whether it is now on. A file system that
    cannot do direct I/O (some FUSE and network file systems, older tmpfs) refuses it and
    the copy goes through the page cache."""
    if not _O_DIRECT:
        return False
    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    try:
        fcntl.fcntl(fd, fcntl.F_SETFL, (flags | _O_DIRECT) if on else (flags & ~_O_DIRECT))
    except OSError as exc:
        log.debug("O_DIRECT %s refused (%s)", "on" if on else "off", exc.strerror)
        return bool(flags & _O_DIRECT)
    return on


def _fill(fd: int, view: memoryview) -> int:
    """Read into ``view`` until it is full or the file ends; the bytes read."""
    got = 0
    while got < len(view):
        n = os.readv(fd, [view[got:]])
        if not n:
            break
        got += n
    return got


def _write_at(fd: int, view: memoryview, offset: int, direct: bool) -> bool:
    """Write all of ``view`` at ``offset``; whether ``fd`` is still in direct mode (a write
    the file system refuses as unaligned, EINVAL, is done again through the page cache)."""
    while view:
        try:
            n = os.pwrite(fd, view, offset)
        except OSError as exc:
            if not (direct and exc.errno == errno.EINVAL):
                raise
            direct = _direct(fd, False)
            if direct:  # cannot switch it off: the EINVAL was not about O_DIRECT
                raise
            continue
        view, offset = view[n:], offset + n
    return direct


def _copy(src: str, dst: str, size: int, checksum: str, who: str,
          modes: _Modes = _PRIVATE_MODES) -> int:
    """Copy one partition into ``dst`` (see "The copy" in the module docstring): the bytes
    are hashed in the buffer they are read into and written from it, then checked against
    ``size`` and ``checksum`` before the copy is installed. Returns the bytes copied."""
    tmp = os.path.join(os.path.dirname(dst), "." + os.path.basename(dst) + ".partial")
    block = BLOCK
    h = xxhash.xxh3_128()
    done = 0
    buf = mmap.mmap(-1, block)  # page-aligned, as O_DIRECT needs
    view = memoryview(buf)
    fd = out = -1
    created = False
    try:
        # O_NONBLOCK: a FIFO in a partition's place is refused instead of blocking the node.
        fd = os.open(src, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise StageError(f"{who}: partition {src} on the shared store is not a regular "
                             "file")
        os.set_blocking(fd, True)
        out = _create_new(tmp, modes.file)
        created = True
        direct = _direct(out, True)
        _fadvise(fd, 0, 0, _SEQUENTIAL)
        while done <= size:  # a source longer than the index says is not read to its end
            n = _fill(fd, view)
            if not n:
                break
            chunk = view[:n]
            h.update(chunk)
            if direct and n % _DIRECT_ALIGN:  # the unaligned tail goes through the cache
                direct = _direct(out, False)
            direct = _write_at(out, chunk, done, direct)
            chunk.release()
            done += n
            behind = max(0, done - _DROP_BEHIND)  # never read again here
            _fadvise(fd, behind, done - behind, _DONTNEED)
            if n < block:
                break
        _fadvise(fd, 0, 0, _DONTNEED)  # and whatever readahead brought in past the end
        os.fsync(out)
        _fadvise(out, 0, 0, _DONTNEED)  # the tail, or all of a cached copy
    except OSError as exc:
        if created:
            _unlink(tmp)
        if exc.errno == errno.ENOSPC:
            raise StageError(f"{who}: local storage full while staging {os.path.basename(dst)} "
                             f"({size:,} bytes needed) into {os.path.dirname(dst)}") from None
        raise StageError(f"{who}: cannot stage {os.path.basename(dst)}: {exc.strerror} "
                         f"({exc.filename or src})") from None
    except BaseException:
        if created:
            _unlink(tmp)
        raise
    finally:
        for f in (fd, out):
            if f >= 0:
                os.close(f)
        view.release()
        try:
            buf.close()
        except BufferError:  # a slice is still held by the error on its way out: freed with it
            pass
    if done != size or h.hexdigest() != checksum:
        _unlink(tmp)
        what = ("checksum mismatch" if done == size else
                f"more than {size:,} bytes, expected {size:,}" if done > size else
                f"{done:,} bytes, expected {size:,}")
        raise StageError(f"{who}: partition {src} on the shared store is damaged ({what}); "
                         "repack or restore it")
    try:
        os.replace(tmp, dst)
        _record_ok(dst, checksum, modes)
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


def prepare_local_dir(local_dir: str, private: bool, who: str = "node") -> bool:
    """Check (or create) the node-local directory before anything is written in it; see
    the module docstring. Returns whether it was created. Raises UnsafePathError for a
    directory another user could read into, write into or swap, StageError when it cannot
    be used at all (a file in the way, a read-only file system)."""
    what = "local directory"
    try:
        safeio.trusted_path(local_dir, what=what)
        try:
            created = safeio.make_dirs(local_dir, _Modes.of(private).dir, 0o700, what=what)
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
                     private: bool | None = None) -> StageReport:
    """Make ``local_dir`` hold valid copies of partitions ``numbers``; return what was done.

    ``store_dir`` may be an object-store URL (``s3://bucket/ds.fs``): partitions are then
    fetched with ``jobs`` parallel range reads of ``block`` bytes, resumably (see
    :func:`_fetch_all`). ``private``: whether the copies must be private (default: as the
    store, :func:`store_is_private`). Raises StageError, or UnsafePathError for a local
    directory other users could read into, write into or swap.
    """
    t0 = time.monotonic()
    report = StageReport(partitions=sorted(numbers))
    remote = is_url(store_dir)
    if private is None:
        private = store_is_private(store_dir, index)
    modes = _Modes.of(private)
    report.created = prepare_local_dir(local_dir, private, who)
    try:
        names = os.listdir(local_dir)
    except OSError as exc:  # a read-only or vanished mount, ...
        raise StageError(f"{who}: cannot use local storage {local_dir}: {exc.strerror}") \
            from None
    resumable = _resumable(local_dir, index, numbers, block) if remote else set()
    for name in names:  # leftovers of an interrupted copy (unless a download can go on)
        if name.startswith(".") and name.endswith(".partial") and name not in resumable:
            _unlink(os.path.join(local_dir, name))
            _unlink(os.path.join(local_dir, name + ".json"))
        elif name.startswith(".part-") and name.endswith(".tmp"):  # a record half-written
            _unlink(os.path.join(local_dir, name))
    todo = []
    for p in report.partitions:
        info = index.partitions[p]
        dst = os.path.join(local_dir, partition_name(p))
        if _valid_copy(dst, info.size, info.checksum, modes):
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
                     info.size, info.checksum, who, modes)

    if todo and remote:
        for p, n in _fetch_all(store_dir, local_dir, index, todo, jobs, who, block, modes):
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
        return os.lstat(path).st_size
    except FileNotFoundError:
        return 0


def _own_size(path: str) -> int:
    """Size of a regular file of ours at ``path`` (not through a symlink), else -1."""
    try:
        st = os.lstat(path)
    except OSError:
        return -1
    return st.st_size if _regular_ours(st) else -1


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


def _resumable(local_dir: str, index: Index, numbers: list[int], block: int) -> set[str]:
    """Names of ``.partial`` files whose record says they belong to the same partition
    (size, checksum, range size): those are continued, not removed."""
    keep = set()
    for p in numbers:
        info = index.partitions[p]
        tmp = _partial(local_dir, info.name)
        rec = _read_json(tmp + ".json")
        if rec and (rec.get("size"), rec.get("checksum"), rec.get("block")) == (
                info.size, info.checksum, block) and _own_size(tmp) == info.size:
            keep.add(os.path.basename(tmp))
    return keep


class _Download:
    """One partition being fetched: its partial file, the ranges done, the record."""

    def __init__(self, local_dir: str, name: str, size: int, checksum: str, block: int,
                 modes: _Modes = _PRIVATE_MODES) -> None:
        self.name = name
        self.modes = modes
        self.size = size
        self.checksum = checksum
        self.block = block
        self.dst = os.path.join(local_dir, name)
        self.tmp = _partial(local_dir, name)
        self.rec_path = self.tmp + ".json"
        self.lock = threading.Lock()
        rec = _read_json(self.rec_path)
        if rec and (rec.get("size"), rec.get("checksum"), rec.get("block")) == (
                size, checksum, block) and _own_size(self.tmp) == size:
            self.done = {int(k) for k in rec.get("done", []) if isinstance(k, int)}
        else:
            self.done = set()
        self.resumed = bool(self.done)
        self.fetched = 0
        self.fd = -1

    def open(self) -> None:
        if not self.done:
            _unlink(self.rec_path)
            fd = _create_new(self.tmp, self.modes.file)
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


def _fetch_all(url: str, local_dir: str, index: Index, todo: list[int], jobs: int, who: str,
               block: int, modes: _Modes = _PRIVATE_MODES):
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
                    _unlink(d.tmp)
                    _unlink(d.rec_path)
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
                _unlink(d.rec_path)
                _record_ok(d.dst, d.checksum, d.modes)
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
        return _fd_checksum(fd)
    finally:
        os.close(fd)


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
