"""Tar archives (plain, gzip, bzip2, xz, zstd), one or several (webdataset shards), read
as one stream each: never extracted, never seeked.

The compression is recognised by its magic bytes, not the file name. A compressed
archive is decompressed by a thread of its own (zlib, bz2, lzma and zstd release the GIL
while they work), so decompression overlaps the packing. The tar stream itself is read in
large blocks and its headers are parsed by ``tarheader`` (not Python's ``tarfile``, whose
stream mode costs tens of microseconds and a kept ``TarInfo`` per member); a member's
data is handed to the packer straight from those blocks (``Member.readinto``).

Errors of the archive itself become one ``PackError`` naming the archive and how far it
was read: a truncated or corrupt gzip, bzip2, xz or zstd stream (read to its end, so that
its CRC is checked), a truncated tar (inside a member, or at a member boundary without
the end-of-archive block), a header that is not one (bad checksum, bad number, bad pax
record: a damaged archive, never taken for its end).
"""

from __future__ import annotations

import bz2
import gzip
import lzma
import os
import queue
import threading
import zlib
from typing import BinaryIO, Iterator

from fanstore.errors import PackError
from fanstore.format.index import KIND_DIR, KIND_FILE, KIND_SYMLINK, clamp_mtime_ns
from fanstore.pack.sources import tarheader as th
from fanstore.pack.sources.base import (
    KIND_HARDLINK,
    KIND_SPECIAL,
    MAX_DECODER_MEMORY,
    MAX_PATH,
    Member,
    Source,
)

MAGICS = {
    b"\x1f\x8b": "gzip",
    b"BZh": "bzip2",
    b"\xfd7zXZ\x00": "xz",
    b"\x28\xb5\x2f\xfd": "zstd",
}

_SPECIAL = {
    th.CHARDEV: "character device",
    th.BLOCKDEV: "block device",
    th.FIFO: "FIFO",
}

#: Bytes read from the (decompressed) archive at a time.
READ_BLOCK = 1 << 20


def sniff(path: str) -> str | None:
    """'tar', 'gzip', 'bzip2', 'xz', 'zstd' (a compressed stream, presumably a tar) or None."""
    try:
        with open(path, "rb") as f:
            head = f.read(512)
    except OSError:
        return None
    for magic, name in MAGICS.items():
        if head.startswith(magic):
            return name
    if len(head) >= 262 and head[257:262] == b"ustar":
        return "tar"
    # A v7 tar (no "ustar"): a header whose checksum field matches its bytes.
    if len(head) == 512 and head[0] and _v7_checksum_ok(head):
        return "tar"
    return None


def _v7_checksum_ok(block: bytes) -> bool:
    field = block[148:156].split(b"\0")[0].strip()
    try:
        want = int(field or b"x", 8)
    except ValueError:
        return False
    return want == sum(block[:148]) + 8 * 32 + sum(block[156:])


#: How far ahead of the reader the kernel is asked to read (``POSIX_FADV_WILLNEED``), and
#: in what steps. The kernel's own read-ahead (a few MiB) leaves a cold archive's reader
#: waiting on the disk, most of all while the partitions are being written to it too.
READ_AHEAD = 64 << 20
READ_AHEAD_STEP = 16 << 20


class _Counting:
    """A raw file that counts the bytes read from it (the progress bar's unit), and asks
    the kernel to read ``READ_AHEAD`` bytes ahead of it."""

    def __init__(self, f: BinaryIO) -> None:
        self._f = f
        self.count = 0
        self._advised = 0  # bytes asked for so far
        self._fd = f.fileno()
        try:  # read once, front to back
            os.posix_fadvise(self._fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        except OSError:
            self._fd = -1  # not a regular file: no advice
        self._advise()

    def _advise(self) -> None:
        if self._fd < 0:
            return
        while self._advised < self.count + READ_AHEAD:
            try:
                os.posix_fadvise(self._fd, self._advised, READ_AHEAD_STEP,
                                 os.POSIX_FADV_WILLNEED)
            except OSError:
                self._fd = -1
                return
            self._advised += READ_AHEAD_STEP

    def read(self, n: int = -1) -> bytes:
        data = self._f.read(n)
        self.count += len(data)
        if self.count + READ_AHEAD - READ_AHEAD_STEP >= self._advised:
            self._advise()
        return data

    def readinto(self, buf) -> int:
        n = self._f.readinto(buf)
        self.count += n or 0
        if self.count + READ_AHEAD - READ_AHEAD_STEP >= self._advised:
            self._advise()
        return n

    def readable(self) -> bool:
        return True

    def close(self) -> None:
        self._f.close()


class _Prefetch:
    """Reads a decompressing stream ahead in a thread of its own, a few blocks deep.

    An exception of the stream (a damaged archive) is raised to the reader, in order,
    when it gets there."""

    def __init__(self, stream, block: int = READ_BLOCK, depth: int = 4) -> None:
        self._s = stream
        self._block = block
        self._q: queue.Queue = queue.Queue(depth)
        self._stop = False
        self._cur = memoryview(b"")
        self._eof = False
        self._t = threading.Thread(target=self._run, name="tar-decompress", daemon=True)
        self._t.start()

    def _run(self) -> None:
        try:
            while not self._stop:
                data = self._s.read(self._block)
                self._put(data)
                if not data:
                    return
        except BaseException as exc:  # noqa: BLE001 - handed to the reader
            self._put(exc)

    def _put(self, item) -> None:
        while not self._stop:
            try:
                self._q.put(item, timeout=0.2)
                return
            except queue.Full:
                continue

    def readinto(self, view) -> int:
        n = 0
        want = len(view)
        while n < want:
            if not self._cur:
                if self._eof:
                    break
                item = self._q.get()
                if isinstance(item, BaseException):
                    self._eof = True
                    raise item
                if not item:
                    self._eof = True
                    break
                self._cur = memoryview(item)
            k = min(want - n, len(self._cur))
            view[n:n + k] = self._cur[:k]
            self._cur = self._cur[k:]
            n += k
        return n

    def close(self) -> None:
        self._stop = True
        try:
            while True:
                self._q.get_nowait()
        except queue.Empty:
            pass
        self._t.join(timeout=10)


class _Blocks:
    """The (decompressed) tar stream, read in large blocks: headers by 512 bytes, member
    data into the caller's buffers. ``offset`` is the position in the tar (bytes
    consumed); ``delivered`` the bytes the stream has given so far."""

    def __init__(self, stream, size: int = READ_BLOCK) -> None:
        self._s = stream
        self._buf = bytearray(size)
        self._view = memoryview(self._buf)
        self._lo = 0
        self._hi = 0
        self.offset = 0
        self.delivered = 0
        self._eof = False

    def _more(self) -> int:
        """Read more into the buffer (keeping what is unread); bytes added, 0 at the end."""
        if self._eof:
            return 0
        if self._lo == self._hi:
            self._lo = self._hi = 0
        elif self._hi == len(self._buf):
            k = self._hi - self._lo
            self._buf[:k] = self._view[self._lo:self._hi]
            self._lo, self._hi = 0, k
        n = self._s.readinto(self._view[self._hi:])
        if not n:
            self._eof = True
            return 0
        self._hi += n
        self.delivered += n
        return n

    def read(self, n: int) -> bytes:
        """Up to ``n`` bytes (fewer only at the end of the stream)."""
        if self._hi - self._lo >= n:
            out = bytes(self._view[self._lo:self._lo + n])
            self._lo += n
            self.offset += n
            return out
        parts = []
        got = 0
        while got < n:
            if self._lo == self._hi and not self._more():
                break
            k = min(n - got, self._hi - self._lo)
            parts.append(bytes(self._view[self._lo:self._lo + k]))
            self._lo += k
            got += k
        self.offset += got
        return b"".join(parts)

    def readinto(self, view) -> int:
        """Fill ``view``; fewer bytes only at the end of the stream."""
        want = len(view)
        k = min(want, self._hi - self._lo)
        view[:k] = self._view[self._lo:self._lo + k]
        self._lo += k
        n = k
        while n < want:
            if want - n >= len(self._buf) // 2:  # large: straight from the stream
                got = self._s.readinto(view[n:])
                if not got:
                    self._eof = True
                    break
                self.delivered += got
                n += got
                continue
            if not self._more():
                break
            k = min(want - n, self._hi - self._lo)
            view[n:n + k] = self._view[self._lo:self._lo + k]
            self._lo += k
            n += k
        self.offset += n
        return n

    def skip(self, n: int) -> int:
        """Pass over ``n`` bytes; the number passed (fewer only at the end)."""
        done = 0
        while done < n:
            if self._lo == self._hi and not self._more():
                break
            k = min(n - done, self._hi - self._lo)
            self._lo += k
            done += k
        self.offset += done
        return done


class _XzStream:
    """An xz stream (or several, one after another) decompressed with a memory limit:
    ``lzma.LZMAFile`` has none, so an archive whose header asks for a 1.5 GiB dictionary
    would get one (and fill it with as little as a few hundred KB of input). Trailing
    bytes that are not an xz stream are ignored, as LZMAFile ignores them."""

    def __init__(self, raw: _Counting, path: str, limit: int = MAX_DECODER_MEMORY) -> None:
        self._raw = raw
        self._path = path
        self._limit = limit
        self._d = self._new()
        self._done = False

    def _new(self) -> lzma.LZMADecompressor:
        return lzma.LZMADecompressor(lzma.FORMAT_XZ, memlimit=self._limit)

    def read(self, n: int) -> bytes:
        while not self._done:
            data = b""
            if self._d.eof:
                data = self._d.unused_data or self._raw.read(1 << 16)
                if not data:
                    self._done = True
                    break
                self._d = self._new()
                try:
                    out = self._d.decompress(data, n)
                except lzma.LZMAError:
                    self._done = True  # trailing garbage: not an xz stream
                    break
            else:
                if self._d.needs_input:
                    data = self._raw.read(1 << 16)
                    if not data:
                        raise EOFError("compressed file ended before the end-of-stream "
                                       "marker was reached")
                try:
                    out = self._d.decompress(data, n)
                except lzma.LZMAError as exc:
                    if "memory" in str(exc).lower():
                        raise PackError(f"{self._path}: xz archive refused: it needs more "
                                        f"than {self._limit >> 20} MiB of memory to "
                                        "decompress (its dictionary is that large)") from None
                    raise
            if out:
                return out
        return b""


def _open_stream(raw: _Counting, comp: str, path: str):
    if comp == "tar":
        return raw
    if comp == "gzip":
        return gzip.GzipFile(fileobj=raw, mode="rb")
    if comp == "bzip2":
        return bz2.BZ2File(raw, "rb")
    if comp == "xz":
        return _XzStream(raw, path)
    if comp == "zstd":
        import zstandard

        return zstandard.ZstdDecompressor().stream_reader(raw, read_across_frames=True)
    raise PackError(f"unknown compression {comp}")


def _stream_errors() -> tuple[type[BaseException], ...]:
    import zstandard

    return (EOFError, zlib.error, lzma.LZMAError, OSError, ValueError, zstandard.ZstdError)


_STREAM_ERRORS = _stream_errors()


def _damage(exc: BaseException) -> str:
    if isinstance(exc, EOFError) or "unexpected end of data" in str(exc):
        return "truncated"
    return "corrupt"


def _broken(path: str, comp: str, blocks: "_Blocks | None", exc: BaseException):
    """The one-line error for a damaged archive stream."""
    where = f" after {blocks.delivered:,} bytes" if blocks and blocks.delivered else ""
    detail = " ".join(str(exc).split()) or type(exc).__name__
    return PackError(f"{path}: {_damage(exc)} {comp} archive{where} ({detail})")


def _truncated() -> EOFError:
    return EOFError("unexpected end of data")


class _Data:
    """What is left of the current member's data, and the padding after it."""

    __slots__ = ("left", "pad")

    def __init__(self, size: int) -> None:
        self.left = size
        self.pad = -size % th.BLOCK


class TarSource(Source):
    """One or more tar archives, read in order as one stream each."""

    what = "tar archive"

    def __init__(self, paths: list[str], label: str | None = None) -> None:
        self.paths = paths
        self.url = label or paths[0]
        self.total_bytes = 0
        for p in paths:
            try:
                self.total_bytes += os.stat(p).st_size
            except OSError as exc:
                raise PackError(f"{p}: cannot read: {exc.strerror}") from None
        self._done = 0
        self._raw: _Counting | None = None

    @property
    def bytes_read(self) -> int:
        return self._done + (self._raw.count if self._raw else 0)

    def local_files(self) -> list[str]:
        return list(self.paths)

    def members(self) -> Iterator[Member]:
        for shard, path in enumerate(self.paths):
            yield from self._one(shard, path)

    def reread(self, ordinals: set[int]) -> Iterator[Member]:
        shards = sorted({o >> 32 for o in ordinals})
        for shard in shards:
            for m in self._one(shard, self.paths[shard], quiet=True):
                if m.ordinal in ordinals:
                    yield m

    def _one(self, shard: int, path: str, quiet: bool = False) -> Iterator[Member]:
        comp = sniff(path)
        if comp is None:
            raise PackError(f"{path}: not a tar archive (nor a gzip, bzip2, xz or zstd one)")
        try:
            f = open(path, "rb", buffering=0)
        except OSError as exc:
            raise PackError(f"{path}: cannot read: {exc.strerror}") from None
        raw = _Counting(f)
        if not quiet:
            self._raw = raw
        blocks = None
        stream = None
        try:
            stream = raw if comp == "tar" else _Prefetch(_open_stream(raw, comp, path))
            blocks = _Blocks(stream)
            glob: dict[bytes, bytes] = {}
            k = 0
            while True:
                m, data = self._next(blocks, path, comp, glob)
                if m is None:
                    break
                m.ordinal = (shard << 32) | k
                k += 1
                yield m
                m.read = m.readinto = None  # only valid until here
                if data is not None:
                    todo = data.left + data.pad
                    if blocks.skip(todo) < todo:
                        raise _broken(path, comp, blocks, _truncated())
            # Read the compressed stream to its end: only there do gzip, bzip2, xz and
            # zstd check their CRC and length (a damaged member would pass unnoticed).
            while blocks.skip(READ_BLOCK):
                pass
        except PackError:
            raise
        except _STREAM_ERRORS as exc:
            raise _broken(path, comp, blocks, exc) from None
        finally:
            if not quiet:
                self._done += raw.count
                self._raw = None
            if isinstance(stream, _Prefetch):
                stream.close()
            f.close()

    def _next(self, blocks: _Blocks, path: str, comp: str,
              glob: dict[bytes, bytes]) -> tuple[Member | None, _Data | None]:
        """The next member (with what is left of its data), or (None, None) at the
        end-of-archive block."""
        start = blocks.offset
        try:
            return self._parse(blocks, path, comp, glob, start)
        except th.TarFormatError as exc:
            raise PackError(f"{path}: corrupt tar archive: {exc} (in the headers at byte "
                            f"{start:,} of the tar stream)") from None

    def _parse(self, blocks: _Blocks, path: str, comp: str, glob: dict[bytes, bytes],
               start: int) -> tuple[Member | None, _Data | None]:
        longname = longlink = None
        pax: dict[bytes, bytes] = {}
        too_long: dict[bytes, str] = {}  # GNU long names and links skipped unread
        run = 0
        while True:
            block = blocks.read(th.BLOCK)
            if len(block) < th.BLOCK:
                # The data ends without the end-of-archive blocks (or inside a header).
                if start == 0 and not block:
                    raise PackError(f"{path}: empty or not a tar archive")
                raise PackError(f"{path}: truncated tar archive: it ends after {start:,} "
                                "bytes without its end-of-archive marker")
            if block == th.ZERO_BLOCK:
                if longname is not None or longlink is not None or pax or too_long:
                    raise th.TarFormatError("a long-name or pax header is followed by the "
                                            "end of the archive")
                return None, None
            hdr = th.parse_header(block)
            t = hdr.type
            if t in (th.GNU_LONGNAME, th.GNU_LONGLINK, th.PAX_GLOBAL) or t in th.PAX_LOCAL:
                run += 1
                if run > th.MAX_META_RUN:
                    raise th.TarFormatError(f"more than {th.MAX_META_RUN} extended headers "
                                            "in a row")
                # Bounded before anything is read: a GNU long name or link target longer
                # than a path can be is skipped unread and the member refused by name; a
                # pax header beyond MAX_PAX refuses the archive (it may say the next
                # member's size: it cannot be skipped).
                if t in (th.GNU_LONGNAME, th.GNU_LONGLINK) and hdr.size > MAX_PATH + 1:
                    todo = hdr.size + -hdr.size % th.BLOCK
                    if blocks.skip(todo) < todo:
                        raise _broken(path, comp, blocks, _truncated())
                    what = "name" if t == th.GNU_LONGNAME else "link target"
                    too_long[t] = (f"{what} longer than {MAX_PATH} bytes (a GNU long {what} "
                                   f"of {hdr.size:,} bytes)")
                    continue
                if hdr.size > th.MAX_PAX:
                    raise PackError(f"{path}: tar archive refused: a {hdr.size:,}-byte pax "
                                    f"header at byte {blocks.offset - th.BLOCK:,} of the tar "
                                    f"stream (more than the {th.MAX_PAX >> 20} MiB FanStore "
                                    "reads)")
                body = blocks.read(hdr.size)
                if len(body) < hdr.size or blocks.skip(-hdr.size % th.BLOCK) < \
                        -hdr.size % th.BLOCK:
                    raise _broken(path, comp, blocks, _truncated())
                too_long.pop(t, None)
                if t == th.GNU_LONGNAME:
                    longname = th.cstring(body)
                elif t == th.GNU_LONGLINK:
                    longlink = th.cstring(body)
                elif t == th.PAX_GLOBAL:
                    glob.update(th.parse_pax(body))
                else:
                    pax.update(th.parse_pax(body))
                continue
            break
        name, link, size = hdr.name, hdr.linkname, hdr.size
        mtime_ns = hdr.mtime * 1_000_000_000
        if longname is not None:
            name = longname
        if longlink is not None:
            link = longlink
        if glob or pax:
            ext = {**glob, **pax}
            name = ext.get(b"path", name)
            link = ext.get(b"linkpath", link)
            if b"size" in ext:
                size = th.pax_number(ext[b"size"], "size")
            if b"mtime" in ext:
                ns = th.pax_mtime_ns(ext[b"mtime"])
                mtime_ns = mtime_ns if ns is None else ns
        else:
            ext = pax
        # Base-256 numbers and pax times can say anything: the index holds i64 ns.
        mtime_ns = clamp_mtime_ns(mtime_ns)
        mode = hdr.mode & 0o7777
        if hdr.extended:  # GNU sparse map continued in further blocks
            more = True
            while more:
                block = blocks.read(th.BLOCK)
                if len(block) < th.BLOCK:
                    raise _broken(path, comp, blocks, _truncated())
                more = block[504] != 0
        if t == b"\0" and name.endswith(b"/"):
            t = th.DIRECTORY  # a v7 directory
        data = _Data(0 if t in th.NO_DATA else size)
        if too_long:
            return Member(name, KIND_SPECIAL, mode, mtime_ns, where=path,
                          problem=next(iter(too_long.values()))), data
        if t == th.GNU_SPARSE or th.is_sparse_pax(ext):
            name = ext.get(b"GNU.sparse.name", name)  # pax 1.0 puts a made-up one in path
            return Member(name, KIND_SPECIAL, mode, mtime_ns, where=path,
                          problem="sparse file cannot be packed (GNU sparse members are not "
                                  "supported; archive it without --sparse)"), data
        if t in th.REGULAR:
            return self._file(blocks, path, comp, name, mode, mtime_ns, size, data), data
        if t == th.DIRECTORY:
            return Member(name, KIND_DIR, mode, mtime_ns, where=path), data
        if t == th.SYMLINK:
            return Member(name, KIND_SYMLINK, mode, mtime_ns, target=link, where=path), data
        if t == th.HARDLINK:
            return Member(name, KIND_HARDLINK, mode, mtime_ns, target=link, where=path), data
        what = _SPECIAL.get(t, f"entry of tar type {t!r}")
        return Member(name, KIND_SPECIAL, mode, mtime_ns, where=path, special=what), data

    @staticmethod
    def _file(blocks: _Blocks, path: str, comp: str, name: bytes, mode: int, mtime_ns: int,
              size: int, data: _Data) -> Member:
        def readinto(view) -> int:
            n = min(len(view), data.left)
            try:
                got = blocks.readinto(view[:n]) if n else 0
            except _STREAM_ERRORS as exc:
                raise _broken(path, comp, blocks, exc) from None
            data.left -= got
            if got < n:
                raise _broken(path, comp, blocks, _truncated())
            return got

        def read(n: int) -> bytes:
            buf = bytearray(min(n, data.left))
            got = readinto(memoryview(buf))
            return bytes(buf[:got]) if got < len(buf) else bytes(buf)

        return Member(name, KIND_FILE, mode, mtime_ns, size, read=read, readinto=readinto,
                      where=path)
