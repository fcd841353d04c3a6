"""pyfuse3 request handlers: thin, read-only, answering from precomputed attributes.

The only exception a handler raises is ``pyfuse3.FUSEError``: FanStore errors are mapped to
their errno here (corrupt data and unreachable peers are EIO for that file only) and
anything unexpected is logged and reported as EIO rather than crashing the daemon.
Inode = index entry + 1, so inode numbers are stable across mounts and nodes.
"""

from __future__ import annotations

import errno
import logging
import os

import pyfuse3
from pyfuse3 import FUSEError

from fanstore.errors import FanStoreError
from fanstore.format.index import KIND_DIR, KIND_FILE, KIND_SYMLINK

log = logging.getLogger(__name__)

#: The data never changes while mounted: let the kernel cache names and attributes for good
#: (finite: the kernel mishandles "infinite" float timeouts).
TIMEOUT = 1e6
_ATTR_CACHE_MAX = 1 << 20
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_TRUNC | os.O_APPEND | os.O_CREAT


class FanStoreOps(pyfuse3.Operations):
    enable_writeback_cache = False
    supports_dot_lookup = True

    def __init__(self, ns, store, uid: int | None = None, gid: int | None = None) -> None:
        super().__init__()
        self.ns = ns
        self.store = store
        self.stats = store.stats
        self.uid = os.getuid() if uid is None else uid
        self.gid = os.getgid() if gid is None else gid
        self._attrs: dict[int, pyfuse3.EntryAttributes] = {}
        self._files = ns.n_files
        self._raw = ns.raw_bytes

    # ------------------------------------------------------------------ attributes
    def _attr(self, entry: int) -> pyfuse3.EntryAttributes:
        a = self._attrs.get(entry)
        if a is not None:
            return a
        st = self.ns.stat(entry)
        a = pyfuse3.EntryAttributes()
        a.st_ino = entry + 1
        a.generation = 0
        a.entry_timeout = TIMEOUT
        a.attr_timeout = TIMEOUT
        a.st_mode = st.mode
        a.st_nlink = st.nlink
        a.st_uid = self.uid
        a.st_gid = self.gid
        a.st_rdev = 0
        a.st_size = st.size if st.kind != KIND_DIR else 4096
        a.st_blksize = 131072
        a.st_blocks = (a.st_size + 511) // 512
        a.st_atime_ns = a.st_mtime_ns = a.st_ctime_ns = st.mtime_ns
        if len(self._attrs) >= _ATTR_CACHE_MAX:
            self._attrs.clear()
        self._attrs[entry] = a
        return a

    def _entry(self, inode: int) -> int:
        entry = inode - 1
        if not 0 <= entry < self.ns.n_entries:
            raise FUSEError(errno.ENOENT)
        return entry

    # ------------------------------------------------------------------ metadata
    async def lookup(self, parent_inode, name, ctx=None):
        parent = self._entry(parent_inode)
        if not self.ns.is_dir(parent):
            raise FUSEError(errno.ENOTDIR)
        entry = self.ns.lookup(parent, name)
        if entry is None:
            raise FUSEError(errno.ENOENT)
        return self._attr(entry)

    async def getattr(self, inode, ctx=None):
        return self._attr(self._entry(inode))

    async def readlink(self, inode, ctx):
        entry = self._entry(inode)
        if self.ns.kind(entry) != KIND_SYMLINK:
            raise FUSEError(errno.EINVAL)
        return self.ns.readlink(entry)

    async def opendir(self, inode, ctx):
        entry = self._entry(inode)
        if not self.ns.is_dir(entry):
            raise FUSEError(errno.ENOTDIR)
        return inode

    async def readdir(self, fh, start_id, token):
        # Offsets are positions in the directory's child run (+1), stable for the mount's
        # lifetime, so a listing resumed at any offset continues exactly where it stopped.
        children = self.ns.children(fh - 1)
        for pos in range(start_id, len(children)):
            entry = children[pos]
            if not pyfuse3.readdir_reply(token, self.ns.name(entry), self._attr(entry), pos + 1):
                return

    async def releasedir(self, fh):
        return None

    async def statfs(self, ctx):
        s = pyfuse3.StatvfsData()
        s.f_bsize = 131072
        s.f_frsize = 4096
        s.f_blocks = (self._raw + 4095) // 4096
        s.f_bfree = 0
        s.f_bavail = 0
        s.f_files = self.ns.n_entries
        s.f_ffree = 0
        s.f_favail = 0
        s.f_namemax = 255
        return s

    async def access(self, inode, mode, ctx):
        self._entry(inode)
        if mode & os.W_OK:
            raise FUSEError(errno.EROFS)
        return True

    # ------------------------------------------------------------------ data
    async def open(self, inode, flags, ctx):
        entry = self._entry(inode)
        if flags & _WRITE_FLAGS:
            raise FUSEError(errno.EROFS)
        kind = self.ns.kind(entry)
        if kind == KIND_DIR:
            raise FUSEError(errno.EISDIR)
        if kind != KIND_FILE:
            raise FUSEError(errno.EINVAL)
        self.stats.opens += 1
        # keep_cache: the page cache stays valid across opens, since the data never changes.
        return pyfuse3.FileInfo(fh=inode, keep_cache=True)

    async def read(self, fh, off, size):
        try:
            return await self.store.read(fh - 1, off, size)
        except FanStoreError as exc:
            raise FUSEError(exc.errno) from None
        except Exception:
            log.exception("unexpected error reading inode %d at %d", fh, off)
            self.stats.errors += 1
            raise FUSEError(errno.EIO) from None

    async def release(self, fh):
        return None

    # flush is left to pyfuse3's default (ENOSYS): the kernel then stops sending FLUSH on
    # every close, one request per file fewer (there is nothing to flush on a read-only FS).

    async def getxattr(self, inode, name, ctx):
        self._entry(inode)
        raise FUSEError(errno.ENODATA)

    async def listxattr(self, inode, ctx):
        self._entry(inode)
        return []

    # ------------------------------------------------------------------ writes: EROFS
    async def _erofs(self, *args, **kwargs):
        raise FUSEError(errno.EROFS)

    setattr = mknod = mkdir = unlink = rmdir = symlink = rename = link = _erofs
    write = create = setxattr = removexattr = fsync = fsyncdir = _erofs

