"""The pyfuse3 adapter: thin async handlers over :class:`~fanstore.fuse.fsops.FsOps` and the
async read path.

The only exception a handler raises is ``pyfuse3.FUSEError``: FanStore errors are mapped to
their errno here (corrupt data and unreachable peers are EIO for that file only) and
anything unexpected is logged and reported as EIO rather than crashing the daemon.
"""

from __future__ import annotations

import errno
import logging

import pyfuse3
from pyfuse3 import FUSEError

from fanstore.errors import FanStoreError
from fanstore.fuse.fsops import BLKSIZE, TIMEOUT, FsOps

log = logging.getLogger(__name__)

#: Attribute objects kept for reuse (a warm GETATTR/LOOKUP then allocates nothing); bounded
#: so a namespace of millions of entries cannot grow the daemon without limit.
_ATTR_CACHE_MAX = 1 << 16


def _fuse_error(exc: FanStoreError) -> FUSEError:
    return FUSEError(exc.errno)


class FanStoreOps(pyfuse3.Operations):
    enable_writeback_cache = False
    supports_dot_lookup = True

    def __init__(self, fs: FsOps, reader) -> None:
        super().__init__()
        self.fs = fs
        self.reader = reader  # fanstore.fuse.pyfuse3.reader.AsyncReader
        self.stats = reader.stats
        self._attrs: dict[int, pyfuse3.EntryAttributes] = {}

    # ------------------------------------------------------------------ attributes
    def _attr(self, entry: int) -> pyfuse3.EntryAttributes:
        a = self._attrs.get(entry)
        if a is not None:
            return a
        ino, mode, nlink, size, blocks, mtime = self.fs.attr(entry)
        a = pyfuse3.EntryAttributes()
        a.st_ino = ino
        a.generation = 0
        a.entry_timeout = TIMEOUT
        a.attr_timeout = TIMEOUT
        a.st_mode = mode
        a.st_nlink = nlink
        a.st_uid = self.fs.uid
        a.st_gid = self.fs.gid
        a.st_rdev = 0
        a.st_size = size
        a.st_blksize = BLKSIZE
        a.st_blocks = blocks
        a.st_atime_ns = a.st_mtime_ns = a.st_ctime_ns = mtime
        if len(self._attrs) >= _ATTR_CACHE_MAX:
            self._attrs.clear()
        self._attrs[entry] = a
        return a

    def _entry(self, inode: int) -> int:
        try:
            return self.fs.entry(inode)
        except FanStoreError as exc:
            raise _fuse_error(exc) from None

    # ------------------------------------------------------------------ metadata
    async def lookup(self, parent_inode, name, ctx=None):
        try:
            return self._attr(self.fs.lookup(parent_inode, name))
        except FanStoreError as exc:
            raise _fuse_error(exc) from None

    async def getattr(self, inode, ctx=None):
        return self._attr(self._entry(inode))

    async def readlink(self, inode, ctx):
        try:
            return self.fs.readlink(self._entry(inode))
        except FanStoreError as exc:
            raise _fuse_error(exc) from None

    async def opendir(self, inode, ctx):
        try:
            self.fs.children(self._entry(inode))
        except FanStoreError as exc:
            raise _fuse_error(exc) from None
        return inode

    async def readdir(self, fh, start_id, token):
        # Offsets are positions in the directory's child run (+1), stable for the mount's
        # lifetime, so a listing resumed at any offset continues exactly where it stopped.
        children = self.fs.children(fh - 1)
        ns = self.fs.ns
        for pos in range(start_id, len(children)):
            entry = children[pos]
            if not pyfuse3.readdir_reply(token, ns.name(entry), self._attr(entry), pos + 1):
                return

    async def releasedir(self, fh):
        return None

    async def statfs(self, ctx):
        s = pyfuse3.StatvfsData()
        for key, value in self.fs.statfs().items():
            setattr(s, f"f_{key}", value)
        return s

    async def access(self, inode, mode, ctx):
        try:
            self.fs.check_access(self._entry(inode), mode)
        except FanStoreError as exc:
            raise _fuse_error(exc) from None
        return True

    # ------------------------------------------------------------------ data
    async def open(self, inode, flags, ctx):
        try:
            self.fs.check_open(self._entry(inode), flags)
        except FanStoreError as exc:
            raise _fuse_error(exc) from None
        self.stats.opens += 1
        # keep_cache: the page cache stays valid across opens, since the data never changes.
        return pyfuse3.FileInfo(fh=inode, keep_cache=True)

    async def read(self, fh, off, size):
        try:
            return await self.reader.read(fh - 1, off, size)
        except FanStoreError as exc:
            raise _fuse_error(exc) from None
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
