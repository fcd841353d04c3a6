"""Staging's checks and records: what a valid staged copy is, and the files that say so.

A copy in the local directory is valid when it is a regular file of ours (never followed
through a symlink) of the size the index gives whose XXH3-128 matches the index; a
verified copy gets a small ``.ok`` record (size, mtime, checksum), so that a restart reuses
it without reading it again (:func:`valid_copy`, :func:`staged_copies`). Copies and records
get the modes the store asks for (:class:`Modes`); every file is created exclusively
(:func:`create_new`) or written to a fresh name and renamed into place
(:func:`record_ok`), and a file that is reused is opened without following symlinks and
must be owned by this uid.
"""

from __future__ import annotations

import json
import logging
import os
import stat
from dataclasses import dataclass
from typing import TYPE_CHECKING

import xxhash

from fanstore import safeio
from fanstore.errors import UnsafePathError
from fanstore.format.partition import partition_name

if TYPE_CHECKING:
    from fanstore.format.index import Index

log = logging.getLogger(__name__)

#: Reads of 8 MiB: the blocks of a copy, of a checksum, of an object-storage fetch.
BLOCK = 8 << 20


@dataclass(frozen=True)
class Modes:
    """Modes of what staging writes: ``file`` for copies and records, ``dir`` for a local
    directory it creates."""

    file: int
    dir: int

    @classmethod
    def of(cls, private: bool) -> Modes:
        if private:
            return cls(0o600, 0o700)
        return cls(safeio.umask_mode(0o666), safeio.umask_mode(0o777))


PRIVATE_MODES = Modes(0o600, 0o700)


def ok_path(path: str) -> str:
    return path + ".ok"


def record_ok(path: str, checksum: str, modes: Modes = PRIVATE_MODES) -> None:
    st = os.lstat(path)
    record = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "checksum": checksum}
    safeio.atomic_write(ok_path(path), json.dumps(record).encode(), modes.file)


def regular_ours(st: os.stat_result) -> bool:
    return stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid()


def read_json(path: str) -> dict | None:
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


def valid_copy(path: str, size: int, checksum: str, modes: Modes = PRIVATE_MODES) -> bool:
    """Is ``path`` a complete, undamaged copy? Cheap when its .ok record is current. Only a
    regular file owned by this uid counts (a symlink in its place is copied over)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    if not regular_ours(st) or st.st_size != size:
        return False
    if _recorded(path, st, size, checksum):
        _narrow_mode(path, modes.file)
        _narrow_mode(ok_path(path), modes.file)
        return True
    # no record, or a damaged one: hash the copy
    try:
        fd = safeio.open_nofollow(path, owner=os.geteuid(), what="staged copy")
        try:
            intact = fd_checksum(fd) == checksum
        finally:
            os.close(fd)
    except (OSError, UnsafePathError) as exc:  # an unreadable copy is copied again
        log.warning("%s: cannot read the staged copy (%s); copying it again", path,
                    getattr(exc, "strerror", None) or exc)
        return False
    if intact:
        _narrow_mode(path, modes.file)
        try:
            record_ok(path, checksum, modes)
        except OSError as exc:  # the record only saves a re-hash next time
            log.warning("%s: cannot write its .ok record: %s", path, exc.strerror)
        return True
    log.warning("%s: staged copy is damaged; copying it again", path)
    return False


def _recorded(path: str, st: os.stat_result, size: int, checksum: str) -> bool:
    """Does the .ok record of ``path`` (stat ``st``) vouch for it as it is now?"""
    rec = read_json(ok_path(path))
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
        if regular_ours(st) and st.st_size == info.size \
                and _recorded(path, st, info.size, info.checksum):
            out[info.number] = info.size
    return out


def fd_checksum(fd: int, block: int = BLOCK) -> str:
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


def create_new(path: str, mode: int) -> int:
    """A new file at ``path``, created exclusively (never through a symlink); a leftover
    at that name (ours: the directory is checked) is removed first."""
    try:
        return safeio.create_excl(path, mode)
    except FileExistsError:
        unlink(path)  # unlink never follows a symlink: a link is removed, not its target
        return safeio.create_excl(path, mode)


def unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def own_size(path: str) -> int:
    """Size of a regular file of ours at ``path`` (not through a symlink), else -1."""
    try:
        st = os.lstat(path)
    except OSError:
        return -1
    return st.st_size if regular_ours(st) else -1

