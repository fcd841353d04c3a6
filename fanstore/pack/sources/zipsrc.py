"""Zip archives: members in the order of the central directory, each read once.

Names are taken as the bytes the archive stores (UTF-8 when the archive says so, else the
raw bytes, which Python's zipfile decodes as cp437 and we encode back). Unix modes, file
types and symlinks come from the external attributes of archives made on Unix (Info-ZIP
``zip -y`` stores symlinks); other archives get 0644 files and 0755 directories. The
modification time is the extended-timestamp field (UTC seconds) when present, else the DOS
time (2-second resolution, local time).
"""

from __future__ import annotations

import bz2
import lzma
import os
import stat
import struct
import time
import zipfile
import zlib
from typing import Iterator

from fanstore.errors import PackError
from fanstore.format.index import KIND_DIR, KIND_FILE, KIND_SYMLINK
from fanstore.pack.sources.base import KIND_SPECIAL, Member, Source

ZIP_MAGICS = (b"PK\x03\x04", b"PK\x05\x06", b"PK\x07\x08")
_SUPPORTED = {zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED, zipfile.ZIP_BZIP2, zipfile.ZIP_LZMA}
_ERRORS = (zipfile.BadZipFile, zipfile.LargeZipFile, zlib.error, EOFError, OSError,
           lzma.LZMAError, ValueError, NotImplementedError, RuntimeError, struct.error)
_ = bz2  # zipfile needs it for ZIP_BZIP2


def sniff(path: str) -> bool:
    try:
        with open(path, "rb") as f:
            head = f.read(4)
    except OSError:
        return False
    return head in ZIP_MAGICS


def _raw_name(info: zipfile.ZipInfo) -> bytes:
    if info.flag_bits & 0x800:
        return info.filename.encode("utf-8", "surrogateescape")
    try:
        return info.filename.encode("cp437")
    except UnicodeEncodeError:
        return os.fsencode(info.filename)


def _mtime_ns(info: zipfile.ZipInfo) -> int:
    extra = info.extra
    i = 0
    while i + 4 <= len(extra):
        tag, size = struct.unpack_from("<HH", extra, i)
        body = extra[i + 4:i + 4 + size]
        if tag == 0x5455 and len(body) >= 5 and body[0] & 1:
            return struct.unpack_from("<i", body, 1)[0] * 1_000_000_000
        i += 4 + size
    try:
        return int(time.mktime(info.date_time + (0, 0, -1))) * 1_000_000_000
    except (OverflowError, ValueError):
        return 0


class ZipSource(Source):
    what = "zip archive"

    def __init__(self, path: str) -> None:
        self.url = path
        try:
            self.total_bytes = os.stat(path).st_size
        except OSError as exc:
            raise PackError(f"{path}: cannot read: {exc.strerror}") from None
        self._done = 0

    @property
    def bytes_read(self) -> int:
        return self._done

    def local_files(self) -> list[str]:
        return [self.url]

    def _fail(self, exc: BaseException, member: bytes | None = None) -> PackError:
        detail = " ".join(str(exc).split()) or type(exc).__name__
        what = "truncated or corrupt" if member is None else "corrupt"
        inside = f" (member {os.fsdecode(member)})" if member else ""
        return PackError(f"{self.url}: {what} zip archive{inside}: {detail}")

    def members(self) -> Iterator[Member]:
        try:
            zf = zipfile.ZipFile(self.url)
        except _ERRORS as exc:
            raise self._fail(exc) from None
        with zf:
            for k, info in enumerate(zf.infolist()):
                m = self._member(zf, info)
                m.ordinal = k
                yield m
                self._done += info.compress_size + 30 + len(info.filename)

    def _member(self, zf: zipfile.ZipFile, info: zipfile.ZipInfo) -> Member:
        name = _raw_name(info)
        mtime = _mtime_ns(info)
        unix = info.create_system == 3 and (info.external_attr >> 16) != 0
        st_mode = info.external_attr >> 16 if unix else 0
        is_dir = info.is_dir() or (unix and stat.S_ISDIR(st_mode))
        mode = stat.S_IMODE(st_mode) if unix else (0o755 if is_dir else 0o644)
        if is_dir:
            return Member(name, KIND_DIR, mode, mtime, where=self.url)
        if unix and stat.S_IFMT(st_mode) not in (0, stat.S_IFREG, stat.S_IFLNK):
            what = {stat.S_IFIFO: "FIFO", stat.S_IFCHR: "character device",
                    stat.S_IFBLK: "block device", stat.S_IFSOCK: "socket"}.get(
                stat.S_IFMT(st_mode), "special file")
            return Member(name, KIND_SPECIAL, mode, mtime, where=self.url, special=what)
        if info.flag_bits & 0x1:
            return Member(name, KIND_SPECIAL, mode, mtime, where=self.url,
                          special="encrypted member")
        if info.compress_type not in _SUPPORTED:
            return Member(name, KIND_SPECIAL, mode, mtime, where=self.url,
                          special=f"member compressed with method {info.compress_type} "
                                  "(unsupported)")
        if unix and stat.S_ISLNK(st_mode):
            try:
                target = zf.read(info)
            except _ERRORS as exc:
                raise self._fail(exc, name) from None
            return Member(name, KIND_SYMLINK, mode, mtime, target=target, where=self.url)
        try:
            fobj = zf.open(info)
        except _ERRORS as exc:
            raise self._fail(exc, name) from None

        def read(n: int) -> bytes:
            try:
                return fobj.read(n)
            except _ERRORS as exc:
                raise self._fail(exc, name) from None

        return Member(name, KIND_FILE, mode, mtime, info.file_size, read=read, where=self.url)
