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
- **Mount** (``MountReader``): the index is loaded from the store the daemon serves; each
  read asks the local daemon (a Unix socket) for the file. The daemon answers with the
  decoded bytes when it has them (prefetch buffer, cache) or with the still-compressed
  bytes, which it fetches from local storage or from the peer that holds them: remote files
  work. ``prefetch(paths)`` hands the daemon the order of the next epoch (prefetch mode).

Both are safe to use from several threads and after ``fork`` (each process and thread gets
its own daemon connection; file descriptors are only used with ``pread``).
"""

from __future__ import annotations

import io
import json
import os
import socket
import stat as stat_mod
import threading
from dataclasses import dataclass
from typing import Iterator

from fanstore.errors import (
    CorruptDataError,
    FanStoreError,
    IsADirectoryError_,
    MountError,
    NotFoundError,
    UsageError,
)
from fanstore.format.index import INDEX_NAME, KIND_DIR, KIND_FILE, KIND_SYMLINK

__all__ = ["open_store", "StoreReader", "MountReader", "StatResult"]


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
    from fanstore import runtime

    if runtime.mount_status(path) == "live" and os.path.exists(runtime.socket_path(path)):
        return MountReader(path)
    if not os.path.exists(path):
        raise NotFoundError(f"{path}: no such store or mount point")
    raise UsageError(f"{path}: neither a FanStore store nor a live FanStore mount")


class _Reader:
    """What both readers share: the namespace and decoding, on this side."""

    def _init_index(self, index) -> None:
        from fanstore.namespace import Namespace
        from fanstore.store import Decoder

        self.index = index
        self.ns = Namespace(index)
        self.decoder = Decoder(index)

    # ------------------------------------------------------------------ namespace
    def _entry(self, path: str | bytes) -> int:
        return self.ns.resolve(path)

    def _file(self, path: str | bytes) -> int:
        entry = self._entry(path)
        kind = self.ns.kind(entry)
        if kind == KIND_DIR:
            raise IsADirectoryError_(f"{_show(path)}: is a directory")
        if kind == KIND_SYMLINK:  # follow (within the store), as open() would
            target = self._follow(entry)
            return self._file(target)
        return entry

    def _follow(self, entry: int, depth: int = 0) -> bytes:
        if depth > 40:
            raise FanStoreError(f"{self.ns.show(entry)}: too many levels of symbolic links")
        import posixpath

        base = posixpath.dirname(self.ns.path(entry))
        return posixpath.normpath(posixpath.join(base, self.ns.readlink(entry)))

    def exists(self, path: str | bytes) -> bool:
        return self.index.resolve(path) is not None

    def stat(self, path: str | bytes) -> StatResult:
        s = self.ns.stat(self._entry(path))
        return StatResult(s.mode, s.size if s.kind != KIND_DIR else 4096, s.mtime_ns,
                          s.entry + 1, s.nlink)

    def listdir(self, path: str | bytes = "") -> list[str]:
        entry = self._entry(path)
        return [os.fsdecode(self.ns.name(c)) for c in self.ns.children(entry)]

    def files(self, root: str | bytes = "") -> list[str]:
        """Every regular file below ``root`` (relative to the store root), sorted."""
        start = self._entry(root)
        return sorted(os.fsdecode(self.ns.path(e)) for e in self.ns.walk_files(start))

    def walk(self, root: str | bytes = "") -> Iterator[tuple[str, list[str], list[str]]]:
        """Like ``os.walk`` (top-down), paths relative to the store root."""
        stack = [self._entry(root)]
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

    def open(self, path: str | bytes, mode: str = "rb") -> io.BufferedReader:
        """A read-only binary file object (the whole file is read and checked on open)."""
        if mode not in ("r", "rb"):
            raise UsageError(f"FanStore files are read-only (mode {mode!r})")
        return io.BufferedReader(_BytesRaw(self.read(path), _show(path)))

    def read_entry(self, entry: int) -> bytes:  # pragma: no cover - per reader
        raise NotImplementedError

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


def _show(path) -> str:
    return os.fsdecode(path) if isinstance(path, bytes) else str(path)


# --------------------------------------------------------------------------- a store


class StoreReader(_Reader):
    """Reads a packed store directly: ``pread`` from its partitions, decode here."""

    def __init__(self, path: str, cache_mb: int = 64) -> None:
        from fanstore.store import LocalStore

        self.path = path
        self._store = LocalStore(path, cache_bytes=cache_mb << 20)
        self._init_index(self._store.index)
        self._pid = os.getpid()

    def _after_fork(self) -> None:
        # A lock held by another thread at fork time would stay held in the child forever.
        if os.getpid() != self._pid:
            self._store._lock = threading.Lock()
            self._pid = os.getpid()

    def read_entry(self, entry: int) -> bytes:
        self._after_fork()
        return self._store.read(entry)

    def read_range(self, path: str | bytes, offset: int, size: int) -> bytes:
        """Bytes [offset, offset+size) of a file (decodes only the chunks needed)."""
        self._after_fork()
        return self._store.read(self._file(path), offset, size)

    def prefetch(self, paths, client: str | None = None) -> None:
        """Nothing to do for a store read in-process (the page cache reads ahead)."""

    def close(self) -> None:
        self._store.close()


# --------------------------------------------------------------------------- a mount


class MountReader(_Reader):
    """Reads a live mount through its local daemon: remote files work, no FUSE round trips."""

    def __init__(self, mountpoint: str, timeout: float = 120.0) -> None:
        from fanstore import runtime
        from fanstore.format.index import read_index

        self.mountpoint = mountpoint
        self.timeout = timeout
        self._sock_path = runtime.socket_path(mountpoint)
        self._local = threading.local()
        info = self._request({"op": "info"})[0]
        self.mode = info.get("mode", "sync")
        self.store_path = info.get("store") or ""
        if not self.store_path:
            raise MountError(f"{mountpoint}: the daemon did not say which store it serves")
        self._init_index(read_index(self.store_path))

    # ------------------------------------------------------------------ the connection
    def _conn(self):
        conn = getattr(self._local, "conn", None)
        if conn is None or self._local.pid != os.getpid():
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.settimeout(self.timeout)
            try:
                s.connect(self._sock_path)
            except OSError as exc:
                s.close()
                raise MountError(f"{self.mountpoint}: cannot reach the daemon: "
                                 f"{exc.strerror}") from None
            conn = (s, s.makefile("rb"))
            self._local.conn = conn
            self._local.pid = os.getpid()
        return conn

    def _drop(self) -> None:
        conn = getattr(self._local, "conn", None)
        self._local.conn = None
        if conn is not None and self._local.pid == os.getpid():
            try:
                conn[1].close()
                conn[0].close()
            except OSError:
                pass

    def _request(self, req: dict) -> tuple[dict, bytes]:
        sock, rfile = self._conn()
        try:
            sock.sendall(json.dumps(req).encode() + b"\n")
            line = rfile.readline()
            if not line:
                raise MountError(f"{self.mountpoint}: the daemon closed the connection")
            reply = json.loads(line)
            payload = rfile.read(reply.get("size", 0)) if reply.get("size") else b""
            if len(payload) != reply.get("size", 0):
                raise MountError(f"{self.mountpoint}: the daemon sent a short reply")
        except (OSError, ValueError) as exc:
            self._drop()
            if isinstance(exc, FanStoreError):
                raise
            raise MountError(f"{self.mountpoint}: talking to the daemon failed: {exc}") from None
        if "error" in reply:
            err = (CorruptDataError if reply.get("errno") == 5 else MountError)(reply["error"])
            raise err
        return reply, payload

    # ------------------------------------------------------------------ data
    def read_entry(self, entry: int) -> bytes:
        reply, payload = self._request({"op": "fetch", "entry": entry})
        if reply["kind"] == "raw":
            return payload
        from fanstore.store import file_bytes

        first, count = self.ns.chunks(entry)
        chunks = self.decoder.decode_run(first, count, payload, entry)
        return bytes(file_bytes(chunks, self.ns.data_offset(entry), self.ns.size(entry)))

    def prefetch(self, paths, client: str | None = None) -> dict:
        """Hand the daemon the order in which ``paths`` will be read (prefetch mode).

        Each training process has its own order; ``client`` names it (default: this
        process), so processes sharing the node's mount do not replace each other's.
        """
        name = client or f"{socket.gethostname()}:{os.getpid()}"
        reply, _ = self._request({"op": "prefetch", "paths": [_show(p) for p in paths],
                                  "client": name})
        return reply

    def stats(self) -> dict:
        return self._request({"op": "stats"})[0]

    def close(self) -> None:
        self._drop()

