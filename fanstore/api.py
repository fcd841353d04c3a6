"""The Python API: read a FanStore store or a live mount without going through FUSE.

    import fanstore
    store = fanstore.open_store("/lustre/ds.fs")     # a packed store: read in this process
    store = fanstore.open_store("/tmp/fs")           # a live mount: ask the local daemon
    data = store.read("train/class000/0001.npy")
    names = store.listdir("train")
    st = store.stat("train/class000/0001.npy")       # st.st_size, st.st_mode, st.st_mtime_ns
    with store.open("train/class000/0001.npy") as f:  # a binary file object
        header = f.read(128)

Both kinds decode in the calling process (so DataLoader workers decode in parallel) and
check every chunk's checksum exactly as the mount does: corrupt data raises
``CorruptDataError`` (an ``OSError``-like ``FanStoreError`` with ``errno`` EIO), never
returns wrong bytes.

- **Store** (``StoreReader``): the index is loaded once; files are read with ``pread`` from
  the partition files and decoded here.
- **Mount** (``MountReader``): the index is loaded from the store the daemon serves; files
  whose partition is on this node's disk are read and decoded in this process, exactly as
  from a store (so any number of reader processes scale with the cores), and only files
  held by other nodes go through the node's daemon (a Unix socket), which fetches their
  still-compressed bytes from the peer over MPI. In prefetch mode the node's workers decode
  the order ahead into the mount's page cache: a file they pushed (or are decoding, or
  hold in their buffer) is read through the mount, a page-cache copy; one they have not
  started is marked as taken (so they pass it by) and decoded here as in sync mode, so a
  reader ahead of the prefetch is never slower than one of a sync mount.
  ``prefetch(paths)`` hands the daemon the order of the next epoch (prefetch mode).

Paths follow FanStore's one symlink rule (:meth:`fanstore.namespace.Namespace.resolve`):
symlinks inside the store are followed when reading a file, as ``open`` on the mount does;
``stat``, ``listdir`` and ``walk`` do not follow the last component, like ``lstat``. The API
resolves symlinks **only inside the store**: a store may hold symlinks that lead outside
it (an absolute target, or ``..`` above the root; ``fanstore pack --symlinks store``, the
default, keeps them as squashfs and tar do), which the mount shows and the kernel resolves
on the host; here a path through one raises ``OutsideStoreError`` (a ``NotFoundError``,
``errno`` ENOENT) naming the link and its target, and never reads a file outside the store.

Both are safe to use from several threads and after ``fork`` (each process and thread gets
its own daemon connection; file descriptors are only used with ``pread``).
"""

from __future__ import annotations

import io
import os
import socket
import stat as stat_mod
from collections.abc import Iterator
from dataclasses import dataclass

from fanstore.errors import (
    CorruptDataError,
    FanStoreError,
    MountError,
    NotFoundError,
    PermissionDeniedError,
    UsageError,
)
from fanstore.format.index import INDEX_NAME, KIND_DIR
from fanstore.read import ChunkReader
from fanstore.read.stats import SUMMED
from fanstore.read.window import INFLIGHT, NONE, PUSHING, READING, SharedWindow

__all__ = ["MountReader", "StatResult", "StoreReader", "open_store"]


@dataclass(frozen=True)
class StatResult:
    """What ``os.stat`` would say through the mount (inode = index entry + 1)."""

    st_mode: int
    st_size: int
    st_mtime_ns: int
    st_ino: int
    st_nlink: int

    @property
    def st_mtime(self) -> float:
        return self.st_mtime_ns / 1e9

    def is_dir(self) -> bool:
        return stat_mod.S_ISDIR(self.st_mode)

    def is_file(self) -> bool:
        return stat_mod.S_ISREG(self.st_mode)


def open_store(path_or_mount: str, cache_mb: int = 64):
    """Open a packed store directory or a live FanStore mount point for reading."""
    path = os.fspath(path_or_mount)
    if os.path.isfile(os.path.join(path, INDEX_NAME)):
        return StoreReader(path, cache_mb=cache_mb)
    from fanstore import mounttable, runtime

    if mounttable.mount_status(path) == "live":
        sock = runtime.socket_path(path)
        if sock and os.path.exists(sock):
            return MountReader(path, cache_mb=cache_mb)
    if not os.path.exists(path):
        raise NotFoundError(f"{path}: no such store or mount point")
    raise UsageError(f"{path}: neither a FanStore store nor a live FanStore mount")


class _Reader:
    """What both readers share: the namespace and the read core, in this process."""

    reader: ChunkReader

    def _init(self, index, reader: ChunkReader) -> None:
        from fanstore.namespace import Namespace

        self.index = index
        self.ns = Namespace(index)
        self.reader = reader
        self._pid = os.getpid()

    def _after_fork(self) -> None:
        if os.getpid() != self._pid:
            self.reader.after_fork()
            self._pid = os.getpid()

    def _check_access(self, entry: int) -> None:
        """What a mount would refuse this process (a store read directly: nothing beyond
        its partitions' own modes)."""

    # ------------------------------------------------------------------ namespace
    def _file(self, path: str | bytes) -> int:
        return self.ns.file_entry(path)

    def exists(self, path: str | bytes) -> bool:
        try:
            self.ns.resolve(path)
        except FanStoreError:
            return False
        return True

    def stat(self, path: str | bytes) -> StatResult:
        s = self.ns.stat(self.ns.resolve(path))
        return StatResult(s.mode, s.size if s.kind != KIND_DIR else 4096, s.mtime_ns,
                          s.entry + 1, s.nlink)

    def listdir(self, path: str | bytes = "") -> list[str]:
        entry = self.ns.resolve(path, follow=True)
        return [os.fsdecode(self.ns.name(c)) for c in self.ns.children(entry)]

    def files(self, root: str | bytes = "") -> list[str]:
        """Every regular file below ``root`` (relative to the store root), sorted."""
        start = self.ns.resolve(root, follow=True)
        return sorted(os.fsdecode(self.ns.path(e)) for e in self.ns.walk_files(start))

    def walk(self, root: str | bytes = "") -> Iterator[tuple[str, list[str], list[str]]]:
        """Like ``os.walk`` (top-down), paths relative to the store root."""
        stack = [self.ns.resolve(root, follow=True)]
        while stack:
            d = stack.pop()
            dirs, files = [], []
            for c in self.ns.children(d):
                (dirs if self.ns.is_dir(c) else files).append(os.fsdecode(self.ns.name(c)))
            yield os.fsdecode(self.ns.path(d)), dirs, files
            stack.extend(reversed([c for c in self.ns.children(d) if self.ns.is_dir(c)]))

    # ------------------------------------------------------------------ data
    def read(self, path: str | bytes) -> bytes:
        """The whole content of a file, checked against its checksums."""
        return self.read_entry(self._file(path))

    def entry_of(self, path: str | bytes) -> int:
        """The index entry of the file ``path`` names (symlinks followed), for
        :meth:`read_entry` and ``prefetch_entries``."""
        return self._file(path)

    def read_entry(self, entry: int) -> bytes:
        self._after_fork()
        return bytes(self.reader.serve(entry))

    def read_range(self, path: str | bytes, offset: int, size: int) -> bytes:
        """Bytes [offset, offset+size) of a file (decodes only the chunks needed)."""
        self._after_fork()
        return bytes(self.reader.serve(self._file(path), offset, size))

    def open(self, path: str | bytes, mode: str = "rb") -> io.BufferedReader:
        """A read-only binary file object. A file of one chunk is read and checked on open;
        a larger one is read lazily: a ``seek`` and a ``read`` decode only the chunks they
        touch (kept in this process's chunk cache, ``cache_mb``: an LMDB, HDF5 or .npy file
        read at random offsets decodes each chunk once per process while it fits)."""
        if mode not in ("r", "rb"):
            raise UsageError(f"FanStore files are read-only (mode {mode!r})")
        entry = self._file(path)
        size = self.reader.span(entry)[3]
        if size <= self.reader.chunk_size:
            return io.BufferedReader(_BytesRaw(bytes(self.read_entry(entry)), _show(path)))
        self._check_access(entry)
        return io.BufferedReader(_RangeRaw(self, entry, size, _show(path)),
                                 buffer_size=64 << 10)

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _BytesRaw(io.RawIOBase):
    """A read-only raw stream over bytes that names its file (``name`` attribute)."""

    def __init__(self, data: bytes, name: str) -> None:
        self._buf = io.BytesIO(data)
        self.name = name

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        return self._buf.readinto(b)

    def seek(self, offset: int, whence: int = 0) -> int:
        return self._buf.seek(offset, whence)

    def tell(self) -> int:
        return self._buf.tell()


class _RangeRaw(io.RawIOBase):
    """A read-only raw stream over a large file of a store, read range by range."""

    def __init__(self, store: _Reader, entry: int, size: int, name: str) -> None:
        self._store = store
        self._entry = entry
        self._size = size
        self._pos = 0
        self.name = name

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        n = min(len(b), max(0, self._size - self._pos))
        if n == 0:
            return 0
        self._store._after_fork()
        data = self._store.reader.serve(self._entry, self._pos, n)
        b[:len(data)] = data
        self._pos += len(data)
        return len(data)

    def seek(self, offset: int, whence: int = 0) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence]
        if base + offset < 0:
            raise ValueError("negative seek position")
        self._pos = base + offset
        return self._pos

    def tell(self) -> int:
        return self._pos


def _node_index(path: str | None, owner: int):
    """The node daemon's shared copy of the index (mapped, not read: every reader process
    of the node shares its pages), or None if it cannot be used. It must be a regular file
    of the daemon's uid ``owner`` (never followed through a symlink) whose magic, sizes and
    checksum are right."""
    from fanstore.format.index import map_index_body

    if not path or not isinstance(path, str):
        return None
    try:
        return map_index_body(path, owner=owner)
    except (OSError, FanStoreError):
        return None


def _os_error(exc: OSError, what: str) -> FanStoreError:
    """A read through the mount failed: the FanStore error of its errno."""
    import errno as E

    cls = {E.ENOENT: NotFoundError, E.EACCES: PermissionDeniedError,
           E.EPERM: PermissionDeniedError}.get(exc.errno or 0, CorruptDataError)
    err = cls(f"{what}: {exc.strerror or exc}")
    err.errno = exc.errno or E.EIO
    return err


def _show(path) -> str:
    return os.fsdecode(path) if isinstance(path, bytes) else str(path)


# --------------------------------------------------------------------------- a store


class StoreReader(_Reader):
    """Reads a packed store directly: ``pread`` from its partitions, decode here."""

    def __init__(self, path: str, cache_mb: int = 64) -> None:
        from fanstore.store import LocalStore

        self.path = path
        self._store = LocalStore(path, cache_bytes=cache_mb << 20)
        self._init(self._store.index, self._store.reader)

    def prefetch(self, paths, client: str | None = None) -> None:
        """Nothing to do for a store read in-process (the page cache reads ahead)."""

    def prefetch_entries(self, entries, client: str | None = None) -> None:
        """Nothing to do for a store read in-process."""

    def stats(self) -> dict:
        return self.reader.stats.to_json(self.reader.cache)

    def close(self) -> None:
        self._store.close()


# --------------------------------------------------------------------------- a mount


class MountReader(_Reader):
    """Reads a live mount: local partitions in this process, other nodes' via the daemon."""

    def __init__(self, mountpoint: str, timeout: float = 120.0, cache_mb: int = 64) -> None:
        from fanstore.control import ControlClient, node_reader
        from fanstore.format.index import read_index

        self.mountpoint = mountpoint
        self._mount_b = os.fsencode(os.path.abspath(mountpoint)) + b"/"
        self.client = ControlClient(mountpoint, timeout)
        info = self.client.request({"op": "info"})[0]
        self.mode = info.get("mode", "sync")
        self.store_path = info.get("store") or ""
        if not self.store_path:
            raise MountError(f"{mountpoint}: the daemon did not say which store it serves")
        server_uid = self.client.server[1] if self.client.server else os.geteuid()
        self._uid, self._server_uid = os.geteuid(), server_uid
        self._searchable: dict[int, bool] = {}  # directory -> every one up to the root is
        index = _node_index(info.get("index_copy"), server_uid) or read_index(self.store_path)
        reader = node_reader(index, self.client, info.get("data_dir") or self.store_path,
                             info.get("local_parts", []), info.get("replicated", []),
                             cache_mb << 20)
        self._parts = reader.source.local
        self._init(index, reader)
        self._window = self._prefetch_window() if self.mode == "prefetch" else None

    def _prefetch_window(self):
        """The node's prefetch window (shared state, read and marked here), or None if the
        daemon does not give it (the reads then all go through the mount)."""
        try:
            _reply, fds = self.client.request_fds({"op": "window"}, 1)
        except FanStoreError:
            return None
        if len(fds) != 1:
            for fd in fds:
                os.close(fd)
            return None
        try:
            w = SharedWindow(fds[0])
        except (OSError, FanStoreError):
            os.close(fds[0])
            return None
        if w.n != self.index.n_entries:
            w.close()
            os.close(fds[0])
            return None
        return w

    def read_entry(self, entry: int) -> bytes:
        self._check_access(entry)
        w = self._window
        if w is not None:
            self._after_fork()
            w.seen(entry)  # where this reader is: the prefetch window follows
            k = int(w.state[entry]) & 7
            if k in (NONE, READING, INFLIGHT, PUSHING) and self.reader.is_local(entry):
                # not in the page cache yet: decode it here, as in sync mode (waiting for a
                # worker that is decoding it would wait for a thread of low priority)
                if k == NONE:
                    w.state[entry] = READING  # the prefetch passes it by
            else:  # pushed or buffered, or another node's: a page-cache copy
                return self.reader.serve(entry, first=self._read_through_mount)
        return super().read_entry(entry)

    def read_range(self, path: str | bytes, offset: int, size: int) -> bytes:
        self._check_access(self._file(path))
        return super().read_range(path, offset, size)

    def _check_access(self, entry: int) -> None:
        """What the mount would refuse this process (its default_permissions: every file
        shows the daemon's uid as owner) is refused here too, though the bytes are read
        from the partitions: read permission on the file, search on each directory."""
        if self._uid == 0:
            return
        owner = self._uid == self._server_uid
        read_bit, search_bit = (0o400, 0o100) if owner else (0o004, 0o001)
        ns = self.ns
        if not ns.mode(entry) & read_bit:
            raise PermissionDeniedError(f"{ns.show(entry)}: permission denied")
        d = ns.parent(entry)
        ok = self._searchable.get(d)
        if ok is None:
            ok, e = True, d
            while True:
                if not ns.mode(e) & search_bit:
                    ok = False
                    break
                if e == 0:
                    break
                e = ns.parent(e)
            self._searchable[d] = ok
        if not ok:
            raise PermissionDeniedError(f"{ns.show(entry)}: permission denied")

    def _read_through_mount(self, entry: int, _offset: int = 0, _size: int = -1) -> bytes:
        """The whole file through the kernel (the kernel checks permissions as for any
        reader); the mount's errors as FanStore errors."""
        path = self._mount_b + self.ns.path(entry)
        size = self.ns.size(entry)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            try:
                data = os.read(fd, size)  # one copy out of the page cache
                if len(data) < size:
                    parts = [data]
                    got = len(data)
                    while got < size:
                        more = os.read(fd, size - got)
                        if not more:
                            break
                        parts.append(more)
                        got += len(more)
                    data = b"".join(parts)
            finally:
                os.close(fd)
        except OSError as exc:
            raise _os_error(exc, self.ns.show(entry)) from None
        if len(data) != size:
            raise CorruptDataError(f"{self.ns.show(entry)}: the mount returned {len(data)} of "
                                   f"{size} bytes")
        return data

    def prefetch(self, paths, client: str | None = None) -> dict:
        """Hand the daemon the order in which ``paths`` will be read (prefetch mode).

        Each training process has its own order; ``client`` names it (default: this
        process), so processes sharing the node's mount do not replace each other's. Paths
        are resolved here (symlinks followed, as reading does); ones the store does not
        have are counted as ``unknown`` and left out.
        """
        found = self.ns.file_entries([_show(p) for p in paths])
        entries = [e for e in found if e >= 0]
        unknown = len(found) - len(entries)
        reply = self.prefetch_entries(entries, client)
        reply["unknown"] = reply.get("unknown", 0) + unknown
        return reply

    def prefetch_entries(self, entries, client: str | None = None) -> dict:
        """:meth:`prefetch` with index entries (``entry_of(path)``) instead of paths."""
        name = client or f"{socket.gethostname()}:{os.getpid()}"
        reply, _ = self.client.request({"op": "prefetch", "client": name,
                                        "entries": [int(e) for e in entries]})
        return reply

    def stats(self) -> dict:
        """The node's counters, with this process's own reads added to them."""
        out = self.client.request({"op": "stats"})[0]
        mine = self.reader.stats.to_json(self.reader.cache)
        for key in SUMMED:
            if key in mine and key != "cache_budget":
                out[key] = out.get(key, 0) + mine[key]
        return out

    def close(self) -> None:
        self.client.close()
        self._parts.close()
        if self._window is not None:
            self._window.close()
            os.close(self._window.state_fd)
            self._window = None
