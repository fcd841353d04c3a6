"""The local copy of a partition, from the shared store into node-local storage.

Each block is read into one page-aligned buffer per copy, hashed there and written from
there, so the bytes that are checked are the bytes that are written (measured in
docs/benchmarks.md, "Stage-in"). The destination is written with ``O_DIRECT`` (whole
blocks; the unaligned tail, and everything on a file system that refuses direct I/O, go
through the page cache and are dropped after the fsync), and the source's pages are dropped
(``POSIX_FADV_DONTNEED``) as soon as a block is written: staging never reads them again, and
the page cache then holds neither the store nor the copy. Through the page cache a stage-in
of N bytes filled 2N bytes of it; on the benchmark machine, where new page-cache pages are
what costs, that ran at 450 MB/s for 3 CPU s/GB, this at 700 MB/s for 0.35 s/GB (1 rank).
``copy_file_range`` (what ``cp`` does) goes through the page cache too, and would need the
bytes read back to hash them.

The copy is written to a hidden ``.part-NNNNN.fsp.partial`` file, checked (size and
XXH3-128 against the index) while it is written, fsynced, then renamed: a partial copy is
never mistaken for a complete one.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import mmap
import os
import stat

import xxhash

from fanstore.daemon.stagecheck import (
    BLOCK,
    PRIVATE_MODES,
    Modes,
    create_new,
    record_ok,
    unlink,
)
from fanstore.errors import StageError

log = logging.getLogger(__name__)

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


def copy_partition(src: str, dst: str, size: int, checksum: str, who: str,
                   modes: Modes = PRIVATE_MODES) -> int:
    """Copy one partition into ``dst`` (see the module docstring): the bytes
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
        out = create_new(tmp, modes.file)
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
            unlink(tmp)
        if exc.errno == errno.ENOSPC:
            raise StageError(f"{who}: local storage full while staging {os.path.basename(dst)} "
                             f"({size:,} bytes needed) into {os.path.dirname(dst)}") from None
        raise StageError(f"{who}: cannot stage {os.path.basename(dst)}: {exc.strerror} "
                         f"({exc.filename or src})") from None
    except BaseException:
        if created:
            unlink(tmp)
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
        unlink(tmp)
        what = ("checksum mismatch" if done == size else
                f"more than {size:,} bytes, expected {size:,}" if done > size else
                f"{done:,} bytes, expected {size:,}")
        raise StageError(f"{who}: partition {src} on the shared store is damaged ({what}); "
                         "repack or restore it")
    try:
        os.replace(tmp, dst)
        record_ok(dst, checksum, modes)
    except OSError as exc:  # e.g. ENOSPC for the record on a disk the copy just filled
        unlink(tmp)
        raise StageError(f"{who}: cannot stage {os.path.basename(dst)} into "
                         f"{os.path.dirname(dst)}: {exc.strerror}") from None
    return done

