"""Where ``fanstore pack`` writes: a local directory or an object-store prefix.

Both are atomic in the same sense: a store is complete only when its index exists, and the
index is written last.

- Local (``LocalDestination``): everything goes into a temporary sibling directory
  ``DEST.fanstore-tmp-<pid>``, which is fsynced and renamed onto DEST; an existing store
  (``--force``) is replaced by the rename and removed afterwards. The temporary directory
  is 0700 and every file in it 0600 while it is written; a shared store
  (``fanstore.pack.access``) gets the umask's modes just before the rename.
- S3 (``S3Destination``): partitions are uploaded (multipart) under a temporary sibling
  prefix ``DEST.fanstore-tmp-<host>-<pid>/``. Installing removes an old store's index
  first (from then on the old store is incomplete, never half-new), copies the partitions
  onto DEST server-side, removes old partitions the new store does not have, writes the
  index last and removes the temporary prefix. An interrupted pack leaves a temporary
  prefix (and at most an index-less DEST); the next pack into DEST removes a leftover made
  on this host by a process that is gone, and names any other one.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import shutil
import socket
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

from fanstore import safeio
from fanstore.errors import PackError, StoreExistsError, UsageError
from fanstore.format.index import INDEX_NAME
from fanstore.pack.access import PRIVATE_DIR_MODE, PRIVATE_FILE_MODE
from fanstore.process import pid_alive
from fanstore.storage import is_url, open_location, split_parent
from fanstore.storage.s3 import S3Location

log = logging.getLogger(__name__)

TMP_MARK = ".fanstore-tmp-"
OLD_MARK = ".fanstore-old-"
_PART_RE = re.compile(r"^part-\d{5}\.fsp$")


def _log_note(msg: str) -> None:
    log.warning("%s", msg)


# --------------------------------------------------------------------------- local


def clean_stale_siblings(dest: str, note: Callable[[str], None] = _log_note) -> None:
    parent, base = os.path.split(dest)
    try:
        names = os.listdir(parent)
    except OSError:
        return
    for name in names:
        for mark in (TMP_MARK, OLD_MARK):
            prefix = base + mark
            if name.startswith(prefix):
                try:
                    pid = int(name[len(prefix) :].split("-")[0])
                except ValueError:
                    continue
                if not pid_alive(pid):
                    path = os.path.join(parent, name)
                    note(f"removing leftover of an interrupted pack: {path}")
                    shutil.rmtree(path, ignore_errors=True)


def check_destination(src: str, dest: str, force: bool) -> None:
    if not is_url(src):
        real_src = os.path.realpath(src)
        real_dest = os.path.realpath(dest)
        if real_dest == real_src or real_dest.startswith(real_src.rstrip("/") + "/"):
            raise UsageError(f"destination {dest} is inside the source {src}")
        if real_src.startswith(real_dest.rstrip("/") + "/"):
            raise UsageError(f"source {src} is inside the destination {dest}")
    if os.path.lexists(dest):
        if not os.path.isdir(dest):
            raise StoreExistsError(f"destination {dest} exists and is not a directory")
        if os.path.exists(os.path.join(dest, INDEX_NAME)):
            if not force:
                raise StoreExistsError(
                    f"destination {dest} already holds a store (use --force to replace it)"
                )
        elif os.listdir(dest):
            raise StoreExistsError(
                f"destination {dest} exists, is not empty and is not a store; refusing to "
                "overwrite it"
            )


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def install_dir(tmp: str, dest: str) -> None:
    """Move the finished store into place; an existing store (--force) is replaced."""
    old = None
    if os.path.isdir(dest) and os.listdir(dest):
        old = f"{dest}{OLD_MARK}{os.getpid()}"
        os.rename(dest, old)
    elif os.path.isdir(dest):
        os.rmdir(dest)
    try:
        os.rename(tmp, dest)
    except BaseException:
        if old:
            os.rename(old, dest)
        raise
    fsync_dir(os.path.dirname(dest) or ".")
    if old:
        shutil.rmtree(old, ignore_errors=True)


class LocalDestination:
    """A store directory on a local or shared POSIX file system."""

    local = True

    def __init__(self, dest: str, notify: Callable[[str], None] = _log_note) -> None:
        self.notify = notify
        dest = os.path.abspath(dest)
        if os.path.islink(dest):
            # Write where the link points: renaming over the link itself would put the new
            # store beside the link and leave the old one (and a DEST.fanstore-old-* link).
            dest = os.path.realpath(dest)
        self.dest = dest
        self.url = dest
        self.tmp = f"{dest}{TMP_MARK}{os.getpid()}"

    def prepare(self, src: str, force: bool) -> None:
        check_destination(src, self.dest, force)
        os.makedirs(os.path.dirname(self.dest), exist_ok=True)
        clean_stale_siblings(self.dest, self.notify)

    #: Mode of the partition files while they are written (see install()).
    file_mode = PRIVATE_FILE_MODE

    def create_tmp(self) -> None:
        os.mkdir(self.tmp, PRIVATE_DIR_MODE)  # private until install(): see access.py

    def partition_path(self, name: str) -> str:
        return os.path.join(self.tmp, name)

    def write_index(self, data: bytes) -> None:
        path = os.path.join(self.tmp, INDEX_NAME)
        try:
            safeio.atomic_write(path, data, PRIVATE_FILE_MODE, fsync=True)
        except OSError as exc:  # name the file: a bare "No space left on device" says nothing
            if exc.errno == errno.ENOSPC:
                raise PackError(f"no space left on device while writing {path}") from None
            raise PackError(f"cannot write {path}: {exc.strerror}") from None

    def install(self, shared: bool = False) -> None:
        """Rename the finished store onto DEST: private (0700, files 0600) as it was
        written, or with the umask's modes when ``shared``."""
        dir_mode, file_mode = PRIVATE_DIR_MODE, PRIVATE_FILE_MODE
        if shared:
            dir_mode, file_mode = safeio.umask_mode(0o777), safeio.umask_mode(0o666)
        # Our own 0700 directory: nobody else can have put a name (or a symlink) in it.
        for name in os.listdir(self.tmp):
            os.chmod(os.path.join(self.tmp, name), file_mode)
        os.chmod(self.tmp, dir_mode)
        fsync_dir(self.tmp)
        install_dir(self.tmp, self.dest)

    def discard(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)


# --------------------------------------------------------------------------- S3


class S3Destination:
    """A store under an object-store prefix (``s3://bucket/ds.fs``)."""

    local = False

    def __init__(self, url: str, notify: Callable[[str], None] = _log_note) -> None:
        self.notify = notify
        loc = open_location(url)
        if not isinstance(loc, S3Location) or not loc.prefix:
            raise UsageError(f"{url}: a store in object storage needs a prefix "
                             "(s3://bucket/name.fs)")
        self.loc = loc
        self.url = loc.url
        self.host = socket.gethostname().replace("-", "_")
        self.tmp_loc = loc.with_prefix(f"{loc.prefix}{TMP_MARK}{self.host}-{os.getpid()}")
        self.tmp = self.tmp_loc.url

    def prepare(self, src: str, force: bool) -> None:
        loc = self.loc
        if is_url(src):
            s = src.rstrip("/")
            if self.url == s or self.url.startswith(s + "/"):
                raise UsageError(f"destination {self.url} is inside the source {src}")
        loc.check()
        objects = loc.list()
        if INDEX_NAME in objects:
            if not force:
                raise StoreExistsError(
                    f"destination {self.url} already holds a store (use --force to replace it)")
        elif objects:
            strays = [n for n in objects if not _PART_RE.match(n)]
            if strays:
                raise StoreExistsError(
                    f"destination {self.url} is not empty and is not a store ({len(objects)} "
                    f"objects, e.g. {strays[0]}); refusing to overwrite it")
            self.notify(f"{self.url}: {len(objects)} partitions without an index (the "
                        "leftover of an interrupted pack) will be replaced")
        self._clean_stale_tmp()

    def _clean_stale_tmp(self) -> None:
        base = self.loc.prefix.rpartition("/")[2] + TMP_MARK
        for prefix in self.loc.list_prefixes(base):
            tag = prefix.rpartition("/")[2][len(base):]
            host, _, pid = tag.rpartition("-")
            other = self.loc.with_prefix(prefix)
            if host == self.host and pid.isdigit() and not pid_alive(int(pid)):
                self.notify(f"removing leftover of an interrupted pack: {other.url}/")
                other.remove(list(other.list()))
            elif other.url != self.tmp:
                self.notify(f"{other.url}/ is the leftover of a pack on host {host or '?'} (pid "
                     f"{pid or '?'}) that may still be running; remove it once that pack "
                     "is gone")

    def create_tmp(self) -> None:
        """Nothing to create (prefixes exist by their objects); an old leftover of this very
        pid is emptied."""
        stale = list(self.tmp_loc.list())
        if stale:
            self.tmp_loc.remove(stale)

    def partition_path(self, name: str) -> str:
        return self.tmp_loc.show(name)

    def write_index(self, data: bytes) -> None:
        self._index = data  # written by install(), last

    _index: bytes = b""

    def install(self, shared: bool = False, jobs: int = 8) -> None:
        """Copy the partitions onto DEST, index last (object storage has no modes:
        ``shared`` changes nothing here, the index records the decision)."""
        loc, tmp = self.loc, self.tmp_loc
        new = sorted(tmp.list())
        old = loc.list()
        if INDEX_NAME in old:
            loc.remove([INDEX_NAME])  # the old store is incomplete from here on
        with ThreadPoolExecutor(max_workers=max(1, min(jobs, len(new) or 1))) as pool:
            list(pool.map(lambda n: loc.copy_from(tmp, n), new))
        extra = [n for n in old if n != INDEX_NAME and n not in new]
        if extra:
            loc.remove(extra)
        loc.write_bytes(INDEX_NAME, self._index)
        tmp.remove(new)

    def discard(self) -> None:
        try:
            names = list(self.tmp_loc.list())
            if names:
                self.tmp_loc.remove(names)
        except Exception as exc:  # noqa: BLE001 - the endpoint may be what failed
            self.notify(f"could not remove {self.tmp}/ ({exc}); the next pack into {self.url} will")


def open_destination(dest: str, notify: Callable[[str], None] = _log_note):
    return (S3Destination(dest, notify) if is_url(dest)
            else LocalDestination(dest, notify))


__all__ = [
    "LocalDestination",
    "OLD_MARK",
    "S3Destination",
    "TMP_MARK",
    "check_destination",
    "clean_stale_siblings",
    "install_dir",
    "open_destination",
    "split_parent",
]
