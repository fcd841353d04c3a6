"""Tar archives (plain, gzip, bzip2, xz, zstd), one or several (webdataset shards), read
as one stream each: never extracted, never seeked.

The compression is recognised by its magic bytes, not the file name. Errors of the
archive itself (a truncated or corrupt tar, gzip, bzip2, xz or zstd stream) become one
``PackError`` naming the archive and how far it was read. A tar that simply stops at a
member boundary, without its end-of-archive blocks, is treated as truncated too.
"""

from __future__ import annotations

import bz2
import decimal
import gzip
import lzma
import os
import tarfile
import zlib
from typing import BinaryIO, Iterator

from fanstore.errors import PackError
from fanstore.format.index import KIND_DIR, KIND_FILE, KIND_SYMLINK
from fanstore.pack.sources.base import KIND_HARDLINK, KIND_SPECIAL, Member, Source

MAGICS = {
    b"\x1f\x8b": "gzip",
    b"BZh": "bzip2",
    b"\xfd7zXZ\x00": "xz",
    b"\x28\xb5\x2f\xfd": "zstd",
}

_SPECIAL = {
    tarfile.CHRTYPE: "character device",
    tarfile.BLKTYPE: "block device",
    tarfile.FIFOTYPE: "FIFO",
    tarfile.CONTTYPE: "contiguous file",
}


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


class _Counting:
    """A raw file that counts the bytes read from it (the progress bar's unit)."""

    def __init__(self, f: BinaryIO) -> None:
        self._f = f
        self.count = 0

    def read(self, n: int = -1) -> bytes:
        data = self._f.read(n)
        self.count += len(data)
        return data

    def readinto(self, buf) -> int:
        n = self._f.readinto(buf)
        self.count += n or 0
        return n

    def readable(self) -> bool:
        return True

    def close(self) -> None:
        self._f.close()


class _Delivered:
    """The decompressed stream tarfile reads; remembers how many bytes it delivered, so
    a tar that stops without its end-of-archive blocks can be told from a complete one."""

    def __init__(self, f) -> None:
        self._f = f
        self.count = 0

    def read(self, n: int = -1) -> bytes:
        data = self._f.read(n)
        self.count += len(data)
        return data


def _open_stream(raw: _Counting, comp: str):
    if comp == "tar":
        return raw
    if comp == "gzip":
        return gzip.GzipFile(fileobj=raw, mode="rb")
    if comp == "bzip2":
        return bz2.BZ2File(raw, "rb")
    if comp == "xz":
        return lzma.LZMAFile(raw, "rb")
    if comp == "zstd":
        import zstandard

        return zstandard.ZstdDecompressor().stream_reader(raw, read_across_frames=True)
    raise PackError(f"unknown compression {comp}")


def _mtime_ns(info: tarfile.TarInfo) -> int:
    text = info.pax_headers.get("mtime") if info.pax_headers else None
    if text:
        try:
            return int(decimal.Decimal(text) * 1_000_000_000)
        except decimal.InvalidOperation:
            pass
    return int(info.mtime) * 1_000_000_000 if float(info.mtime).is_integer() else \
        int(round(info.mtime * 1e9))


def _stream_errors() -> tuple[type[BaseException], ...]:
    import zstandard

    return (tarfile.TarError, EOFError, zlib.error, lzma.LZMAError, OSError, ValueError,
            zstandard.ZstdError)


_STREAM_ERRORS = _stream_errors()


def _damage(exc: BaseException) -> str:
    if isinstance(exc, EOFError) or "unexpected end of data" in str(exc):
        return "truncated"
    return "corrupt"


def _broken(path: str, comp: str, delivered: "_Delivered | None", exc: BaseException):
    """The one-line error for a damaged archive stream."""
    where = f" after {delivered.count:,} bytes" if delivered and delivered.count else ""
    detail = " ".join(str(exc).split()) or type(exc).__name__
    return PackError(f"{path}: {_damage(exc)} {comp} archive{where} ({detail})")


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
            f = open(path, "rb", buffering=1 << 20)
        except OSError as exc:
            raise PackError(f"{path}: cannot read: {exc.strerror}") from None
        raw = _Counting(f)
        if not quiet:
            self._raw = raw
        delivered = None
        try:
            stream = _open_stream(raw, comp)
            delivered = _Delivered(stream)
            tf = tarfile.open(fileobj=delivered, mode="r|", errorlevel=2)
            k = 0
            while True:
                info = tf.next()
                if info is None:
                    break
                m = self._member(tf, info, path, comp, delivered)
                m.ordinal = (shard << 32) | k
                k += 1
                yield m
                if m.read is not None:
                    m.read = None  # only valid until here
            # tarfile stops at the first zero block, or quietly at the end of the data:
            # the latter is a truncated archive (or not a tar at all).
            end_seen = delivered.count >= tf.offset + tarfile.BLOCKSIZE
            # Read the compressed stream to its end: only there do gzip, bzip2, xz and
            # zstd check their CRC and length (a damaged member would pass unnoticed).
            while delivered.read(1 << 20):
                pass
            if not end_seen:
                if tf.offset == 0:
                    raise PackError(f"{path}: empty or not a tar archive")
                raise PackError(f"{path}: truncated tar archive: it ends after "
                                f"{tf.offset:,} bytes without its end-of-archive marker")
        except PackError:
            raise
        except _STREAM_ERRORS as exc:
            raise _broken(path, comp, delivered, exc) from None
        finally:
            if not quiet:
                self._done += raw.count
                self._raw = None
            f.close()

    def _member(self, tf: tarfile.TarFile, info: tarfile.TarInfo, path: str, comp: str,
                delivered: "_Delivered") -> Member:
        name = os.fsencode(info.name)
        mode = info.mode & 0o7777
        mtime = _mtime_ns(info)
        if info.isreg():
            fobj = tf.extractfile(info)

            def read(n: int, _f=fobj) -> bytes:
                try:
                    return _f.read(n)
                except _STREAM_ERRORS as exc:
                    raise _broken(path, comp, delivered, exc) from None

            return Member(name, KIND_FILE, mode, mtime, info.size, read=read, where=path)
        if info.isdir():
            return Member(name, KIND_DIR, mode, mtime, where=path)
        if info.issym():
            return Member(name, KIND_SYMLINK, mode, mtime, target=os.fsencode(info.linkname),
                          where=path)
        if info.islnk():
            return Member(name, KIND_HARDLINK, mode, mtime, target=os.fsencode(info.linkname),
                          where=path)
        what = _SPECIAL.get(info.type, f"entry of tar type {info.type!r}")
        return Member(name, KIND_SPECIAL, mode, mtime, where=path, special=what)
