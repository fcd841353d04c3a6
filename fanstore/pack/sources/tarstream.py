"""The bytes of a tar archive, read once, front to back: the compression recognised by its
magic bytes (plain, gzip, bzip2, xz, zstd), decompressed by a thread of its own (zlib, bz2,
lzma and zstd release the GIL while they work, so decompression overlaps the packing), the
kernel asked to read the file ahead, and the tar stream handed out in large blocks
(:class:`TarBlocks`: headers by 512 bytes, member data straight into the caller's
buffers). Never seeked.

A damaged stream (a truncated or corrupt gzip, bzip2, xz or zstd stream, which is read to its
end so that its CRC is checked) becomes one ``PackError`` naming the archive and how far
it was read (:func:`broken`).
"""

from __future__ import annotations

import bz2
import gzip
import lzma
import os
import queue
import threading
import zlib
from typing import BinaryIO

from fanstore.errors import PackError
from fanstore.pack.sources.base import MAX_DECODER_MEMORY

MAGICS = {
    b"\x1f\x8b": "gzip",
    b"BZh": "bzip2",
    b"\xfd7zXZ\x00": "xz",
    b"\x28\xb5\x2f\xfd": "zstd",
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


class CountingFile:
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


class ReadAhead:
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


class TarBlocks:
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


class XzStream:
    """An xz stream (or several, one after another) decompressed with a memory limit:
    ``lzma.LZMAFile`` has none, so an archive whose header asks for a 1.5 GiB dictionary
    would get one (and fill it with as little as a few hundred KB of input). Trailing
    bytes that are not an xz stream are ignored, as LZMAFile ignores them."""

    def __init__(self, raw: CountingFile, path: str, limit: int = MAX_DECODER_MEMORY) -> None:
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


def open_stream(raw: CountingFile, comp: str, path: str):
    if comp == "tar":
        return raw
    if comp == "gzip":
        return gzip.GzipFile(fileobj=raw, mode="rb")
    if comp == "bzip2":
        return bz2.BZ2File(raw, "rb")
    if comp == "xz":
        return XzStream(raw, path)
    if comp == "zstd":
        import zstandard

        return zstandard.ZstdDecompressor().stream_reader(raw, read_across_frames=True)
    raise PackError(f"unknown compression {comp}")


def _stream_errors() -> tuple[type[BaseException], ...]:
    import zstandard

    return (EOFError, zlib.error, lzma.LZMAError, OSError, ValueError, zstandard.ZstdError)


STREAM_ERRORS = _stream_errors()


def _damage(exc: BaseException) -> str:
    if isinstance(exc, EOFError) or "unexpected end of data" in str(exc):
        return "truncated"
    return "corrupt"


def broken(path: str, comp: str, blocks: TarBlocks | None, exc: BaseException) -> PackError:
    """The one-line error for a damaged archive stream."""
    where = f" after {blocks.delivered:,} bytes" if blocks and blocks.delivered else ""
    detail = " ".join(str(exc).split()) or type(exc).__name__
    return PackError(f"{path}: {_damage(exc)} {comp} archive{where} ({detail})")


def truncated() -> EOFError:
    return EOFError("unexpected end of data")
