"""Zip archives: members in the order of the central directory, each read once.

Names are taken as the bytes the archive stores (UTF-8 when the archive says so, else the
raw bytes, which Python's zipfile decodes as cp437 and we encode back). Unix modes, file
types and symlinks come from the external attributes of archives made on Unix (Info-ZIP
``zip -y`` stores symlinks); other archives get 0644 files and 0755 directories. The
modification time is the extended-timestamp field (UTC seconds) when present, else the DOS
time (2-second resolution, local time).

Python's ``zipfile`` reads the central directory; the members' bytes are read here, from
their local headers, by :class:`_MemberReader`: never more output than asked for per read
(``zipfile`` decompresses a whole bzip2 or LZMA block at once, so 785 bytes of bzip2 were
1 GiB in memory), the CRC checked at the end, and a member whose content is longer or
shorter than the central directory says is an error naming it. A symlink's target is read
only if its declared size fits a target (4095 bytes), and never past it. Members whose data
overlap (a "zip bomb" of many entries pointing at the same bytes) refuse the archive.
"""

from __future__ import annotations

import bz2
import itertools
import lzma
import os
import stat
import struct
import time
import zipfile
import zlib
from collections.abc import Callable, Iterator
from typing import BinaryIO

from fanstore.errors import PackError
from fanstore.format.index import KIND_DIR, KIND_FILE, KIND_SYMLINK, MAX_TARGET
from fanstore.pack.sources.base import KIND_SPECIAL, MAX_DECODER_MEMORY, Member, Source

ZIP_MAGICS = (b"PK\x03\x04", b"PK\x05\x06", b"PK\x07\x08")
_SUPPORTED = {zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED, zipfile.ZIP_BZIP2, zipfile.ZIP_LZMA}
_ERRORS = (zipfile.BadZipFile, zipfile.LargeZipFile, zlib.error, EOFError, OSError,
           lzma.LZMAError, ValueError, NotImplementedError, RuntimeError, struct.error)
#: Local file header: signature, version, flags, method, time, date, CRC, sizes, name and
#: extra lengths (30 bytes).
_LOCAL = struct.Struct("<4sHHHHHIIIHH")
_LOCAL_MAGIC = b"PK\x03\x04"
#: Compressed bytes read from the archive at a time.
_READ = 1 << 16


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


class _Inflate:
    """zlib's raw deflate with the ``decompress(data, max_length)``/``needs_input``/``eof``
    interface of bz2's and lzma's decompressors."""

    def __init__(self) -> None:
        self._d = zlib.decompressobj(-15)
        self._capped = False

    @property
    def eof(self) -> bool:
        return self._d.eof

    @property
    def needs_input(self) -> bool:
        return not (self._capped or self._d.unconsumed_tail)

    def decompress(self, data: bytes, max_length: int) -> bytes:
        out = self._d.decompress(self._d.unconsumed_tail + data, max_length)
        self._capped = len(out) == max_length  # more may be waiting inside
        return out


class _Stored:
    """A stored member, through the same interface."""

    eof = False
    needs_input = True

    def decompress(self, data: bytes, max_length: int) -> bytes:
        return data


def _lzma(f: BinaryIO, left: int, size: int) -> tuple[object, int]:
    """A zip LZMA member: its 4-byte header and the LZMA properties, then raw LZMA1. The
    dictionary is what the decoder allocates (and fills): never more than the member's
    size needs, and not beyond MAX_DECODER_MEMORY."""
    head = f.read(4)
    if len(head) < 4 or left < 4:
        raise EOFError("truncated LZMA header")
    (psize,) = struct.unpack_from("<H", head, 2)
    props = f.read(psize)
    if psize < 5 or len(props) < psize or left < 4 + psize:
        raise lzma.LZMAError("bad LZMA properties")
    d = props[0]
    if d >= 9 * 5 * 5:
        raise lzma.LZMAError("bad LZMA properties")
    lc, lp, pb = d % 9, (d // 9) % 5, d // 45
    (dict_size,) = struct.unpack_from("<I", props, 1)
    dict_size = min(dict_size, max(size, 4096))  # no match reaches before the start
    if dict_size > MAX_DECODER_MEMORY:
        raise lzma.LZMAError(f"an LZMA dictionary of {dict_size >> 20} MiB (FanStore "
                             f"decodes at most {MAX_DECODER_MEMORY >> 20} MiB ones)")
    filters = [{"id": lzma.FILTER_LZMA1, "lc": lc, "lp": lp, "pb": pb,
                "dict_size": dict_size}]
    return lzma.LZMADecompressor(lzma.FORMAT_RAW, filters=filters), left - 4 - psize


class _MemberReader:
    """One member's content, read from its local header on: ``read(n)`` gives at most
    ``n`` bytes (fewer only at its end), decompressing no more than that; at the end of
    the compressed stream the CRC is checked. Errors raise what ``fail`` makes of them."""

    def __init__(self, f: BinaryIO, info: zipfile.ZipInfo,
                 fail: Callable[[BaseException], PackError]) -> None:
        self._f = f
        self._fail = fail
        self._crc = 0
        self._want_crc = info.CRC
        self._eof = False
        try:
            f.seek(info.header_offset)
            head = f.read(_LOCAL.size)
            if len(head) < _LOCAL.size:
                raise EOFError("truncated local file header")
            fields = _LOCAL.unpack(head)
            if fields[0] != _LOCAL_MAGIC:
                raise zipfile.BadZipFile("bad magic number for the local file header")
            f.seek(info.header_offset + _LOCAL.size + fields[9] + fields[10])
            self._left = info.compress_size  # compressed bytes not read yet
            if info.compress_type == zipfile.ZIP_STORED:
                self._dec: object = _Stored()
            elif info.compress_type == zipfile.ZIP_DEFLATED:
                self._dec = _Inflate()
            elif info.compress_type == zipfile.ZIP_BZIP2:
                self._dec = bz2.BZ2Decompressor()
            else:
                self._dec, self._left = _lzma(f, self._left, info.file_size + 1)
        except _ERRORS as exc:
            raise fail(exc) from None

    def read(self, n: int) -> bytes:
        parts = []
        got = 0
        try:
            while got < n and not self._eof:
                dec = self._dec
                data = b""
                if dec.needs_input:
                    if not self._left:
                        # The end of the compressed bytes is the end (as zipfile takes
                        # it: LZMA may have no end marker); the CRC and the size, which
                        # the caller checks, tell a cut member.
                        self._end()
                        break
                    want = min(_READ, self._left)
                    if isinstance(dec, _Stored):
                        want = min(want, n - got)
                    data = self._f.read(want)
                    if not data:
                        raise EOFError("the archive ends inside the member")
                    self._left -= len(data)
                piece = dec.decompress(data, n - got)
                if piece:
                    self._crc = zlib.crc32(piece, self._crc)
                    parts.append(piece)
                    got += len(piece)
                if dec.eof:
                    self._end()
        except _ERRORS as exc:
            raise self._fail(exc) from None
        return b"".join(parts)

    def _end(self) -> None:
        self._eof = True
        if self._crc != self._want_crc:
            raise zipfile.BadZipFile("Bad CRC-32")


def _check_overlaps(infos: list[zipfile.ZipInfo]) -> None:
    """Refuse members whose local header and data overlap another's (at least 30 bytes
    of header and the compressed size): the "overlapping files" zip bomb lets thousands
    of entries share one deflate stream, each expanding to its full size."""
    order = sorted(infos, key=lambda i: i.header_offset)
    for a, b in itertools.pairwise(order):
        if b.header_offset < a.header_offset + _LOCAL.size + a.compress_size:
            raise zipfile.BadZipFile(f"members {a.filename!r} and {b.filename!r} overlap")


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
            with zipfile.ZipFile(self.url) as zf:  # the central directory, nothing else
                infos = zf.infolist()
            _check_overlaps(infos)
        except _ERRORS as exc:
            raise self._fail(exc) from None
        with open(self.url, "rb") as f:
            for k, info in enumerate(infos):
                m = self._member(f, info)
                m.ordinal = k
                yield m
                m.read = None  # only valid until here
                self._done += info.compress_size + 30 + len(info.filename)

    def _member(self, f: BinaryIO, info: zipfile.ZipInfo) -> Member:
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
        if info.flag_bits & 0x20:
            return Member(name, KIND_SPECIAL, mode, mtime, where=self.url,
                          special="member with compressed patch data (unsupported)")
        if unix and stat.S_ISLNK(st_mode):
            return self._symlink(f, info, name, mode, mtime)
        reader = _MemberReader(f, info, lambda exc: self._fail(exc, name))
        return Member(name, KIND_FILE, mode, mtime, info.file_size, read=reader.read,
                      where=self.url)

    def _symlink(self, f: BinaryIO, info: zipfile.ZipInfo, name: bytes, mode: int,
                 mtime: int) -> Member:
        """A symlink member: its target read only when its declared size fits one, and
        never more than that size (plus one byte, to see a member longer than it says)."""
        size = info.file_size
        if size > MAX_TARGET:
            return Member(name, KIND_SPECIAL, mode, mtime, where=self.url,
                          problem=f"symlink target longer than {MAX_TARGET} bytes (the "
                                  f"member says {size:,} bytes; not read)")
        target = _MemberReader(f, info, lambda exc: self._fail(exc, name)).read(size + 1)
        if len(target) != size:
            how = "more" if len(target) > size else "less"
            raise PackError(f"{self.url}: {os.fsdecode(name)}: symlink member holds {how} "
                            f"data than the zip directory says ({size:,} bytes)")
        return Member(name, KIND_SYMLINK, mode, mtime, target=target, where=self.url)
