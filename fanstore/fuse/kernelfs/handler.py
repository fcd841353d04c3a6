"""FanStore's handler on the kernel-protocol engine: the kernel's requests answered in its
byte layout, in one worker process.

Thin: the logic is :class:`~fanstore.fuse.fsops.FsOps` (shared with the pyfuse3 frontend)
and the read core (``ChunkReader.serve``: a READ is a reader's request, counted there);
this module packs the answers (``fuse_entry_out``, ``fuse_attr_out``, directory listings
built per READDIR(PLUS) with numpy from the mapped index: just the records that fit, no
per-process cache). Where it runs:
:mod:`fanstore.fuse.kernelfs.process` (the frontend process and its workers, or a node's worker
ranks); what the daemon runs: :mod:`fanstore.fuse.kernelfs.frontend`.
"""

from __future__ import annotations

import errno
import logging
import os

import numpy as np

from fanstore.errors import FanStoreError, NotFoundError
from fanstore.format.index import KIND_DIR, KIND_FILE
from fanstore.fuse.fsops import BLKSIZE, TIMEOUT, FsOps
from fanstore.fuse.engine import DirListing, FuseErrno
from fanstore.fuse.engine.proto import (
    ATTR_OUT,
    DIRENT_HEAD_SIZE,
    DIRENTPLUS_HEAD_SIZE,
    ENTRY_OUT,
    negative_entry,
    pack_statfs_out,
)
from fanstore.fuse.engine.records import ENTRY_OUT_DTYPE

log = logging.getLogger(__name__)


class KernelHandler:
    """FanStore's answers to the kernel's requests, in one worker process.

    Thin: the logic is :class:`~fanstore.fuse.fsops.FsOps` (shared with the pyfuse3
    frontend) and the read core; this class packs the answers in the kernel's byte layout.
    A directory listing is built for each READDIR(PLUS) request from the node's mapped
    index, vectorised: only the records that fit the kernel's buffer, nothing kept (a
    listing of every directory would otherwise cost each worker ~350 B per entry).
    """

    def __init__(self, fs: FsOps, reader, publish=None, prefetch=None, spill=None) -> None:
        self.fs = fs
        #: fanstore.fuse.kernelfs.spill.ChunkSpill: the rest of a chunk decoded for a partial READ
        #: goes into the page cache
        self._spill = None if spill is None else (
            lambda entry, start, chunk, offset, end: spill.offer(entry + 1, start, chunk,
                                                                 offset, end))
        #: prefetch mode: fanstore.fuse.kernelfs.orders.PrefetchHooks (READs may be answered from
        #: the buffer; LOOKUPs and IOCTLs tell where the readers are)
        self.prefetch = prefetch
        self._prefetched = prefetch.read if prefetch is not None else None
        if prefetch is not None:
            self.ioctl = self._ioctl  # the engine forwards IOCTLs only to handlers that ask
        self.ns = fs.ns
        self.reader = reader
        self.publish = publish or (lambda: None)  # counters to the shared table
        self._n = fs.n_entries
        self._kind = self.ns.index.entries["kind"]
        self._count = self.ns.index.entries["count"]  # a directory's number of children
        self._uid, self._gid = fs.uid, fs.gid
        self._negative = negative_entry(TIMEOUT)
        self._first = self.ns.index.entries["first"]  # a directory's first child
        self._names = np.frombuffer(self.ns.index.names, dtype=np.uint8)
        self._name_off = self.ns.index.entries["name_off"]
        self._name_len = self.ns.index.entries["name_len"]
        self._statfs = None

    # ------------------------------------------------------------------ attributes
    def _attr_fields(self, entry: int) -> tuple:
        ino, mode, nlink, size, blocks, mtime = self.fs.attr(entry)
        sec, nsec = divmod(mtime, 1_000_000_000)
        sec &= 0xFFFF_FFFF_FFFF_FFFF  # a u64 field the kernel reads as signed: before 1970
        return (ino, size, blocks, sec, sec, sec, nsec, nsec, nsec, mode, nlink, self._uid,
                self._gid, 0, BLKSIZE, 0)

    def _entry_out(self, entry: int) -> bytes:
        return ENTRY_OUT.pack(entry + 1, 0, TIMEOUT, TIMEOUT, 0, 0, *self._attr_fields(entry))

    def _entry(self, nodeid: int) -> int:
        entry = nodeid - 1
        if not 0 <= entry < self._n:
            raise FuseErrno(errno.ENOENT)
        return entry

    # ------------------------------------------------------------------ requests
    def lookup(self, parent: int, name: bytes):
        try:
            entry = self.fs.lookup(parent, name)
        except NotFoundError:
            return self._negative  # the kernel remembers the absence as long as a name
        except FanStoreError as exc:
            return exc.errno
        if self.prefetch is not None:
            self.prefetch.seen(entry)
        return self._entry_out(entry)

    def _ioctl(self, nodeid: int) -> None:
        self.prefetch.seen(nodeid - 1)

    def getattr(self, nodeid: int):
        entry = nodeid - 1
        if not 0 <= entry < self._n:
            return errno.ENOENT
        return ATTR_OUT.pack(TIMEOUT, 0, 0, *self._attr_fields(entry))

    def readlink(self, nodeid: int):
        try:
            return self.fs.readlink(self._entry(nodeid))
        except FanStoreError as exc:
            return exc.errno

    def read(self, nodeid: int, offset: int, size: int):
        entry = nodeid - 1
        if not 0 <= entry < self._n:
            return errno.ENOENT
        if int(self._kind[entry]) != KIND_FILE:
            return errno.EISDIR if int(self._kind[entry]) == KIND_DIR else errno.EINVAL
        try:
            # from the prefetch buffer, else the read core; whole-file reads land in the
            # page cache: no second copy in the chunk LRU
            data = self.reader.serve(entry, offset, size, keep_whole=False,
                                     first=self._prefetched, spill=self._spill)
        except FanStoreError as exc:
            log.error("%s", exc)
            self.publish()
            return exc.errno
        self.publish()
        return data

    def readdirplus(self, nodeid: int, offset: int, size: int):
        listing = self._listing(nodeid, offset, size, DIRENTPLUS_HEAD_SIZE)
        return listing if isinstance(listing, (int, bytes)) else listing.plus(0, size)

    def readdir(self, nodeid: int, offset: int, size: int):
        listing = self._listing(nodeid, offset, size, DIRENT_HEAD_SIZE)
        return listing if isinstance(listing, (int, bytes)) else listing.plain(0, size)

    def statfs(self):
        if self._statfs is None:
            s = self.fs.statfs()
            self._statfs = pack_statfs_out(
                blocks=s["blocks"], bfree=0, bavail=0, files=s["files"], ffree=0,
                bsize=s["bsize"], namelen=s["namemax"], frsize=s["frsize"])
        return self._statfs

    def access(self, nodeid: int, mask: int):
        entry = nodeid - 1
        if not 0 <= entry < self._n:
            return errno.ENOENT
        return errno.EROFS if mask & os.W_OK else None

    # ------------------------------------------------------------------ listings
    def _listing(self, nodeid: int, offset: int, size: int, head: int):
        """The records of directory ``nodeid`` from child ``offset`` on that fit in ``size``
        bytes (each ``head`` + its name, 8-byte aligned), as a DirListing whose cookies
        continue the directory's (child i has cookie i + 1); an errno for a bad directory."""
        entry = nodeid - 1
        if not 0 <= entry < self._n:
            return errno.ENOENT
        if int(self._kind[entry]) != KIND_DIR:
            return errno.ENOTDIR
        count = int(self._count[entry])
        if not 0 <= offset < count:
            return b""  # the end of the directory
        first = int(self._first[entry]) + offset
        # at most as many records as could fit (the shortest record is head + 1 byte)
        most = min(count - offset, size // ((head + 1 + 7) & ~7) + 1)
        ln = self._name_len[first : first + most].astype(np.int64)
        ends = np.cumsum((head + ln + 7) & ~7)
        n = int(np.searchsorted(ends, size, side="right"))
        if n == 0:
            return errno.EINVAL  # not even one record fits: the kernel's buffer is too small
        return self._build_listing(first, n, ln[:n], offset + 1)

    def _build_listing(self, first: int, n: int, ln: np.ndarray, cookie: int):
        entries = np.arange(first, first + n, dtype=np.int64)
        out = np.zeros(n, dtype=ENTRY_OUT_DTYPE)
        a = self.fs.attrs(entries)
        out["nodeid"] = a["ino"]
        out["entry_valid"] = TIMEOUT
        out["attr_valid"] = TIMEOUT
        attr = out["attr"]
        attr["ino"] = a["ino"]
        attr["size"] = a["size"]
        attr["blocks"] = a["blocks"]
        sec, nsec = np.divmod(a["mtime_ns"], 1_000_000_000)
        for f in ("atime", "mtime", "ctime"):
            attr[f] = sec
            attr[f + "nsec"] = nsec
        attr["mode"] = a["mode"]
        attr["nlink"] = a["nlink"]
        attr["uid"] = self._uid
        attr["gid"] = self._gid
        attr["blksize"] = BLKSIZE
        out["attr"] = attr
        off = self._name_off[first : first + n].astype(np.int64)
        if n == 1 or np.array_equal(off[1:], off[:-1] + ln[:-1]):
            concat = self._names[off[0] : off[-1] + ln[-1]]
        else:  # names not back to back in the blob (a v1/v2 index may): gather them
            starts = np.repeat(off - np.concatenate(([0], np.cumsum(ln)[:-1])), ln)
            concat = self._names[starts + np.arange(int(ln.sum()))]
        return DirListing((concat, ln), out, types=a["dtype"], first_cookie=cookie)
