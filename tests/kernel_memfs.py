"""A small read-only in-memory file system on the kernel engine, for tests and benchmarks.

Files hold slices of one pseudo-random pool (so 20,000 files of 100 kB cost no memory and
any reader can recompute the expected bytes with :func:`content_for`). Everything a request
needs is prebuilt: an :class:`~fanstore.fuse.engine.records.EntryTable` for LOOKUP/GETATTR
and one :class:`~fanstore.fuse.engine.records.DirListing` per directory for READDIR(PLUS); the
handler only indexes. A test double of the engine's tests (tests/test_kernel_fuse.py), kept
out of the product package.

Command line (what the tests run; so did the retired tools/bench/kernel_engine_bench.py)::

    python tests/kernel_memfs.py MOUNTPOINT (--spec FILE.json | --generate N,SIZE,DIRS)
        [--workers K] [--counters PATH] [--fusermount] [--rw] [--no-clone]
        [--opendir enosys|cache] [--xattr enosys|empty] [--flags +NAME,-NAME,...]
        [--max-pages N] [--read-ahead-kb KB] [--allow-other]

prints ``READY <supervisor pid> <worker pid>...`` on stdout once mounted and serving, and
exits 0 when the mount ends (signal or outside unmount), 1 with one line on error.

Spec file: ``{"files": {"a/b.bin": 1000, ...}, "dirs": ["empty"],
"symlinks": {"link": "a/b.bin"}, "big_dirs": {"big": 10000}}`` (a big dir of N empty files).
"""

from __future__ import annotations

import argparse
import errno
import json
import logging
import os
import stat
import sys
import time
import zlib
from typing import Any

import numpy as np

from fanstore.fuse.engine import EngineOptions, FuseErrno
from fanstore.fuse.engine import proto as P
from fanstore.fuse.engine import records as R

POOL_SIZE = 8 << 20
POOL_SEED = 20240611
_pool: bytes | None = None


def pool() -> bytes:
    """The shared 8 MiB pseudo-random pool file contents are cut from."""
    global _pool
    if _pool is None:
        _pool = np.random.default_rng(POOL_SEED).bytes(POOL_SIZE)
    return _pool


def content_for(path: str, size: int) -> memoryview:
    """The contents of the file ``path`` of ``size`` bytes (a zero-copy slice when possible)."""
    p = pool()
    if size <= POOL_SIZE // 2:
        off = (zlib.crc32(path.encode()) * 4099) % (POOL_SIZE - size)
        return memoryview(p)[off:off + size]
    reps = size // POOL_SIZE + 1
    return memoryview((p * reps)[:size])


class MemFS:
    """A tree built with add_* calls, then :meth:`finalize`d into packed tables."""

    def __init__(self, *, uid: int | None = None, gid: int | None = None,
                 mtime: float = 1_700_000_000.25) -> None:
        self.uid = os.getuid() if uid is None else uid
        self.gid = os.getgid() if gid is None else gid
        self.mtime = mtime
        # row = nodeid; row 0 unused, row 1 is the root
        self.modes: list[int] = [0, stat.S_IFDIR | 0o755]
        self.sizes: list[int] = [0, 0]
        self.parents: list[int] = [0, 1]
        self.data: list[Any] = [None, None]
        self.targets: dict[int, bytes] = {}
        self.children: dict[int, dict[bytes, int]] = {1: {}}
        self.delays: dict[int, float] = {}
        self.table: R.EntryTable | None = None
        self.listings: dict[int, R.DirListing] = {}
        self._statfs = b""

    # building ------------------------------------------------------------------------------

    def _parent_of(self, path: str) -> tuple[int, bytes]:
        parts = [p for p in path.strip("/").split("/") if p]
        if not parts:
            raise ValueError("empty path")
        node = 1
        for part in parts[:-1]:
            b = part.encode()
            child = self.children[node].get(b)
            if child is None:
                child = self._add(node, b, stat.S_IFDIR | 0o755, 0, None)
                self.children[child] = {}
            elif child not in self.children:
                raise ValueError(f"{path}: {part} is not a directory")
            node = child
        return node, parts[-1].encode()

    def _add(self, parent: int, name: bytes, mode: int, size: int, data: Any) -> int:
        if name in self.children[parent]:
            raise ValueError(f"{name!r} exists")
        ino = len(self.modes)
        self.modes.append(mode)
        self.sizes.append(size)
        self.parents.append(parent)
        self.data.append(data)
        self.children[parent][name] = ino
        return ino

    def add_file(self, path: str, data: bytes | memoryview, mode: int = 0o644) -> int:
        parent, name = self._parent_of(path)
        return self._add(parent, name, stat.S_IFREG | mode, len(data), memoryview(data))

    def add_dir(self, path: str, mode: int = 0o755) -> int:
        parent, name = self._parent_of(path)
        ino = self._add(parent, name, stat.S_IFDIR | mode, 0, None)
        self.children[ino] = {}
        return ino

    def add_symlink(self, path: str, target: str) -> int:
        parent, name = self._parent_of(path)
        t = target.encode()
        ino = self._add(parent, name, stat.S_IFLNK | 0o777, len(t), None)
        self.targets[ino] = t
        return ino

    def lookup_path(self, path: str) -> int:
        node = 1
        for part in [p for p in path.strip("/").split("/") if p]:
            node = self.children[node][part.encode()]
        return node

    def finalize(self, entry_valid: float = 1e6, attr_valid: float = 1e6) -> MemFS:
        """Pack the entry table and every directory listing (vectorised)."""
        n = len(self.modes)
        modes = np.array(self.modes, dtype=np.uint32)
        nlink = np.ones(n, dtype=np.uint32)
        for d, kids in self.children.items():
            nlink[d] = 2 + sum(1 for k in kids.values() if k in self.children)
        attrs = R.make_attrs(np.arange(n, dtype=np.uint64), np.array(self.sizes, np.uint64),
                             modes, nlink=nlink, uid=self.uid, gid=self.gid, mtime=self.mtime,
                             blksize=65536)
        self.table = R.EntryTable(attrs, entry_valid=entry_valid, attr_valid=attr_valid)
        entries = self.table.entries
        for d, kids in self.children.items():
            names = [b".", b".."] + sorted(kids)
            rows = np.array([d, self.parents[d]] + [kids[k] for k in names[2:]], dtype=np.int64)
            e = entries[rows].copy()
            e["nodeid"][:2] = 0  # no attributes for . and ..: the kernel skips them anyway
            self.listings[d] = R.DirListing(names, e)
        total = sum(self.sizes)
        self._statfs = P.pack_statfs_out(blocks=(total + 4095) // 4096, files=n - 1,
                                         bsize=4096, namelen=255)
        return self

    # sample trees -------------------------------------------------------------------------

    @classmethod
    def from_spec(cls, spec: dict[str, Any]) -> MemFS:
        fs = cls()
        for d in spec.get("dirs", []):
            fs.add_dir(d)
        for path, size in spec.get("files", {}).items():
            fs.add_file(path, content_for(path, int(size)))
        for path, target in spec.get("symlinks", {}).items():
            fs.add_symlink(path, target)
        for path, count in spec.get("big_dirs", {}).items():
            d = fs.add_dir(path)
            for i in range(int(count)):
                fs._add(d, f"entry-{i:06d}-with-a-longer-name".encode(),
                        stat.S_IFREG | 0o644, 0, memoryview(b""))
        for path, seconds in spec.get("delays", {}).items():
            fs.delays[fs.lookup_path(path)] = float(seconds)
        return fs.finalize()

    @classmethod
    def generated(cls, nfiles: int, size: int, ndirs: int = 1) -> MemFS:
        """``nfiles`` files of ``size`` bytes in ``ndirs`` directories: d000/f000000.bin."""
        fs = cls()
        dirs = [fs.add_dir(f"d{j:03d}") for j in range(ndirs)]
        for i in range(nfiles):
            j = i % ndirs
            path = f"d{j:03d}/f{i:06d}.bin"
            fs._add(dirs[j], f"f{i:06d}.bin".encode(), stat.S_IFREG | 0o644, size,
                    content_for(path, size))
        return fs.finalize()


def generated_paths(nfiles: int, ndirs: int = 1) -> list[str]:
    """The relative paths :meth:`MemFS.generated` creates (same order)."""
    return [f"d{i % ndirs:03d}/f{i:06d}.bin" for i in range(nfiles)]


class MemHandler:
    """The engine handler over a finalized :class:`MemFS` (see the package docstring)."""

    def __init__(self, fs: MemFS) -> None:
        assert fs.table is not None, "finalize() the MemFS first"
        self.fs = fs
        self.entry = fs.table.entry
        self.attr_out = fs.table.attr_out
        self.children = fs.children
        self.data = fs.data
        self.listings = fs.listings
        self.n = len(fs.modes)
        self.delays = fs.delays

    def lookup(self, parent: int, name: bytes) -> memoryview:
        kids = self.children.get(parent)
        if kids is None:
            raise FuseErrno(errno.ENOTDIR)
        ino = kids.get(name)
        if ino is None:
            raise FuseErrno(errno.ENOENT)
        return self.entry(ino)

    def getattr(self, nodeid: int) -> memoryview:
        if not 0 < nodeid < self.n:
            raise FuseErrno(errno.ENOENT)
        return self.attr_out(nodeid)

    def readlink(self, nodeid: int) -> bytes:
        t = self.fs.targets.get(nodeid)
        if t is None:
            raise FuseErrno(errno.EINVAL)
        return t

    def read(self, nodeid: int, offset: int, size: int) -> memoryview:
        if self.delays and nodeid in self.delays:
            time.sleep(self.delays[nodeid])
        data = self.data[nodeid] if 0 < nodeid < self.n else None
        if data is None:
            raise FuseErrno(errno.EISDIR if nodeid in self.children else errno.EBADF)
        return data[offset:offset + size]

    def readdirplus(self, nodeid: int, offset: int, size: int) -> memoryview:
        listing = self.listings.get(nodeid)
        if listing is None:
            raise FuseErrno(errno.ENOTDIR)
        return listing.plus(offset, size)

    def readdir(self, nodeid: int, offset: int, size: int) -> memoryview:
        listing = self.listings.get(nodeid)
        if listing is None:
            raise FuseErrno(errno.ENOTDIR)
        return listing.plain(offset, size)

    def statfs(self) -> bytes:
        return self.fs._statfs


def main(argv: list[str] | None = None) -> int:
    from fanstore.errors import FanStoreError
    from fanstore.fuse.engine import DEFAULT_INIT_FLAGS, InitOptions, KernelSession, MountOptions
    from fanstore.fuseflags import apply as apply_flags

    ap = argparse.ArgumentParser(prog="python tests/kernel_memfs.py")
    ap.add_argument("mountpoint")
    g = ap.add_mutually_exclusive_group(required=True)
    g.add_argument("--spec", help="JSON tree spec file")
    g.add_argument("--generate", help="N,SIZE,DIRS")
    ap.add_argument("--workers", type=int, default=None)
    ap.add_argument("--counters", default=None)
    ap.add_argument("--fusermount", action="store_true")
    ap.add_argument("--rw", action="store_true", help="mount without MS_RDONLY")
    ap.add_argument("--no-clone", action="store_true")
    ap.add_argument("--opendir", default="enosys", choices=["enosys", "cache"])
    ap.add_argument("--xattr", default="enosys", choices=["enosys", "empty"])
    ap.add_argument("--flags", default="")
    ap.add_argument("--max-pages", type=int, default=256)
    ap.add_argument("--read-ahead-kb", type=int, default=-1,
                    help="-1: max_pages pages (default); 0: leave the kernel's 128 KiB")
    ap.add_argument("--allow-other", action="store_true")
    ap.add_argument("--log-level", default="WARNING")
    args = ap.parse_args(argv)
    logging.basicConfig(level=args.log_level, stream=sys.stderr,
                        format="%(asctime)s %(process)d %(name)s %(levelname)s %(message)s")
    try:
        if args.spec:
            with open(args.spec) as f:
                fs = MemFS.from_spec(json.load(f))
        else:
            n, size, dirs = (int(x) for x in args.generate.split(","))
            fs = MemFS.generated(n, size, dirs)
        flags = apply_flags(args.flags, DEFAULT_INIT_FLAGS)
    except (OSError, ValueError, KeyError) as exc:
        print(f"memfs: bad tree: {exc}", file=sys.stderr)
        return 1
    session = KernelSession(
        args.mountpoint,
        MountOptions(fsname="memfs", subtype="memfs", read_only=not args.rw,
                     allow_other=args.allow_other, use_fusermount=args.fusermount or None),
        InitOptions(flags=flags, max_pages=args.max_pages,
                    read_ahead_kb=None if args.read_ahead_kb == 0 else args.read_ahead_kb),
        EngineOptions(opendir=args.opendir, xattr=args.xattr),
        counters_path=args.counters, clone_fd=not args.no_clone)

    def ready(s: KernelSession) -> None:
        pids = " ".join(str(p) for p in s.worker_pids.values())
        print(f"READY {os.getpid()} {pids}", flush=True)
        print(f"CONN {s.conn.describe()}; kernel flags {s.conn.kernel_flags:#x}",
              file=sys.stderr, flush=True)

    try:
        session.mount()
        try:
            session.serve(lambda: MemHandler(fs), args.workers, on_ready=ready)
        finally:
            session.close()
    except FanStoreError as exc:
        print(f"memfs: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
