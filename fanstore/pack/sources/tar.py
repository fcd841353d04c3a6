"""Tar archives (plain, gzip, bzip2, xz, zstd), one or several (webdataset shards), read
as one stream each: never extracted, never seeked.

The archive's bytes come from :mod:`.tarstream` (compression recognised by its magic
bytes, decompressed in a thread, handed out in large blocks); the headers are parsed by
:mod:`.tarheader` (not Python's ``tarfile``, whose stream mode costs tens of microseconds
and a kept ``TarInfo`` per member); a member's data is handed to the packer straight from
those blocks (``Member.readinto``). This module turns headers into members: GNU long names
and links, pax headers, sparse and special entries.

Errors of the archive itself become one ``PackError`` naming the archive and how far it
was read: a truncated or corrupt compressed stream (:mod:`.tarstream`), a truncated tar
(inside a member, or at a member boundary without the end-of-archive block), a header that
is not one (bad checksum, bad number, bad pax record: a damaged archive, never taken for
its end).
"""

from __future__ import annotations

import os
from collections.abc import Iterator

from fanstore.errors import PackError
from fanstore.format.index import KIND_DIR, KIND_FILE, KIND_SYMLINK, clamp_mtime_ns
from fanstore.pack.sources import tarheader as th
from fanstore.pack.sources.base import KIND_HARDLINK, KIND_SPECIAL, MAX_PATH, Member, Source
from fanstore.pack.sources.tarstream import (
    READ_BLOCK,
    STREAM_ERRORS,
    CountingFile,
    ReadAhead,
    TarBlocks,
    broken,
    open_stream,
    sniff,
    truncated,
)

_SPECIAL = {
    th.CHARDEV: "character device",
    th.BLOCKDEV: "block device",
    th.FIFO: "FIFO",
}


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
        self._raw: CountingFile | None = None

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
        raw = CountingFile(f)
        if not quiet:
            self._raw = raw
        blocks = None
        stream = None
        try:
            stream = raw if comp == "tar" else ReadAhead(open_stream(raw, comp, path))
            blocks = TarBlocks(stream)
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
                        raise broken(path, comp, blocks, truncated())
            # Read the compressed stream to its end: only there do gzip, bzip2, xz and
            # zstd check their CRC and length (a damaged member would pass unnoticed).
            while blocks.skip(READ_BLOCK):
                pass
        except PackError:
            raise
        except STREAM_ERRORS as exc:
            raise broken(path, comp, blocks, exc) from None
        finally:
            if not quiet:
                self._done += raw.count
                self._raw = None
            if isinstance(stream, ReadAhead):
                stream.close()
            f.close()

    def _next(self, blocks: TarBlocks, path: str, comp: str,
              glob: dict[bytes, bytes]) -> tuple[Member | None, _Data | None]:
        """The next member (with what is left of its data), or (None, None) at the
        end-of-archive block."""
        start = blocks.offset
        try:
            return self._parse(blocks, path, comp, glob, start)
        except th.TarFormatError as exc:
            raise PackError(f"{path}: corrupt tar archive: {exc} (in the headers at byte "
                            f"{start:,} of the tar stream)") from None

    def _parse(self, blocks: TarBlocks, path: str, comp: str, glob: dict[bytes, bytes],
               start: int) -> tuple[Member | None, _Data | None]:
        extended = _Extended()
        hdr = _member_header(blocks, path, comp, glob, start, extended)
        if hdr is None:
            return None, None
        name, link, size, mtime_ns, ext = _apply_extended(hdr, extended, glob)
        mode = hdr.mode & 0o7777
        if hdr.extended:  # GNU sparse map continued in further blocks
            more = True
            while more:
                block = blocks.read(th.BLOCK)
                if len(block) < th.BLOCK:
                    raise broken(path, comp, blocks, truncated())
                more = block[504] != 0
        kind = hdr.type
        if kind == b"\0" and name.endswith(b"/"):
            kind = th.DIRECTORY  # a v7 directory
        data = _Data(0 if kind in th.NO_DATA else size)
        if extended.too_long:
            return Member(name, KIND_SPECIAL, mode, mtime_ns, where=path,
                          problem=next(iter(extended.too_long.values()))), data
        if kind == th.GNU_SPARSE or th.is_sparse_pax(ext):
            name = ext.get(b"GNU.sparse.name", name)  # pax 1.0 puts a made-up one in path
            return Member(name, KIND_SPECIAL, mode, mtime_ns, where=path,
                          problem="sparse file cannot be packed (GNU sparse members are not "
                                  "supported; archive it without --sparse)"), data
        if kind in th.REGULAR:
            return self._file(blocks, path, comp, name, mode, mtime_ns, size, data), data
        if kind == th.DIRECTORY:
            return Member(name, KIND_DIR, mode, mtime_ns, where=path), data
        if kind == th.SYMLINK:
            return Member(name, KIND_SYMLINK, mode, mtime_ns, target=link, where=path), data
        if kind == th.HARDLINK:
            return Member(name, KIND_HARDLINK, mode, mtime_ns, target=link, where=path), data
        what = _SPECIAL.get(kind, f"entry of tar type {kind!r}")
        return Member(name, KIND_SPECIAL, mode, mtime_ns, where=path, special=what), data

    @staticmethod
    def _file(blocks: TarBlocks, path: str, comp: str, name: bytes, mode: int, mtime_ns: int,
              size: int, data: _Data) -> Member:
        def readinto(view) -> int:
            n = min(len(view), data.left)
            try:
                got = blocks.readinto(view[:n]) if n else 0
            except STREAM_ERRORS as exc:
                raise broken(path, comp, blocks, exc) from None
            data.left -= got
            if got < n:
                raise broken(path, comp, blocks, truncated())
            return got

        def read(n: int) -> bytes:
            buf = bytearray(min(n, data.left))
            got = readinto(memoryview(buf))
            return bytes(buf[:got]) if got < len(buf) else bytes(buf)

        return Member(name, KIND_FILE, mode, mtime_ns, size, read=read, readinto=readinto,
                      where=path)


class _Extended:
    """The extended headers read before a member's own header: they apply to that member."""

    __slots__ = ("longlink", "longname", "pax", "run", "too_long")

    def __init__(self) -> None:
        self.longname: bytes | None = None  # GNU long name
        self.longlink: bytes | None = None  # GNU long link target
        self.pax: dict[bytes, bytes] = {}  # local pax records
        self.too_long: dict[bytes, str] = {}  # GNU long names and links skipped unread
        self.run = 0  # extended headers in a row

    def pending(self) -> bool:
        return (self.longname is not None or self.longlink is not None or bool(self.pax)
                or bool(self.too_long))


def _member_header(blocks: TarBlocks, path: str, comp: str, glob: dict[bytes, bytes],
                   start: int, extended: _Extended) -> th.Header | None:
    """The next member's own header, after the extended headers before it (read into
    ``extended``, or ``glob`` for global pax headers), or None at the end-of-archive block."""
    while True:
        block = blocks.read(th.BLOCK)
        if len(block) < th.BLOCK:
            # The data ends without the end-of-archive blocks (or inside a header).
            if start == 0 and not block:
                raise PackError(f"{path}: empty or not a tar archive")
            raise PackError(f"{path}: truncated tar archive: it ends after {start:,} "
                            "bytes without its end-of-archive marker")
        if block == th.ZERO_BLOCK:
            if extended.pending():
                raise th.TarFormatError("a long-name or pax header is followed by the "
                                        "end of the archive")
            return None
        hdr = th.parse_header(block)
        kind = hdr.type
        if kind not in (th.GNU_LONGNAME, th.GNU_LONGLINK, th.PAX_GLOBAL) and \
                kind not in th.PAX_LOCAL:
            return hdr
        _read_extended(blocks, path, comp, glob, hdr, extended)


def _read_extended(blocks: TarBlocks, path: str, comp: str, glob: dict[bytes, bytes],
                   hdr: th.Header, extended: _Extended) -> None:
    """Read the body of the extended header ``hdr`` into ``extended`` (or ``glob``)."""
    kind = hdr.type
    extended.run += 1
    if extended.run > th.MAX_META_RUN:
        raise th.TarFormatError(f"more than {th.MAX_META_RUN} extended headers in a row")
    # Bounded before anything is read: a GNU long name or link target longer than a path
    # can be is skipped unread and the member refused by name; a pax header beyond MAX_PAX
    # refuses the archive (it may say the next member's size: it cannot be skipped).
    if kind in (th.GNU_LONGNAME, th.GNU_LONGLINK) and hdr.size > MAX_PATH + 1:
        todo = hdr.size + -hdr.size % th.BLOCK
        if blocks.skip(todo) < todo:
            raise broken(path, comp, blocks, truncated())
        what = "name" if kind == th.GNU_LONGNAME else "link target"
        extended.too_long[kind] = (f"{what} longer than {MAX_PATH} bytes (a GNU long {what} "
                                   f"of {hdr.size:,} bytes)")
        return
    if hdr.size > th.MAX_PAX:
        raise PackError(f"{path}: tar archive refused: a {hdr.size:,}-byte pax header at "
                        f"byte {blocks.offset - th.BLOCK:,} of the tar stream (more than the "
                        f"{th.MAX_PAX >> 20} MiB FanStore reads)")
    body = blocks.read(hdr.size)
    padding = -hdr.size % th.BLOCK
    if len(body) < hdr.size or blocks.skip(padding) < padding:
        raise broken(path, comp, blocks, truncated())
    extended.too_long.pop(kind, None)
    if kind == th.GNU_LONGNAME:
        extended.longname = th.cstring(body)
    elif kind == th.GNU_LONGLINK:
        extended.longlink = th.cstring(body)
    elif kind == th.PAX_GLOBAL:
        glob.update(th.parse_pax(body))
    else:
        extended.pax.update(th.parse_pax(body))


def _apply_extended(hdr: th.Header, extended: _Extended, glob: dict[bytes, bytes]
                    ) -> tuple[bytes, bytes, int, int, dict[bytes, bytes]]:
    """The member's name, link target, size and mtime (ns) once the extended headers
    (``extended`` and the global pax records ``glob``) override its header's, and the pax
    records that apply to it."""
    name, link, size = hdr.name, hdr.linkname, hdr.size
    mtime_ns = hdr.mtime * 1_000_000_000
    if extended.longname is not None:
        name = extended.longname
    if extended.longlink is not None:
        link = extended.longlink
    if glob or extended.pax:
        ext = {**glob, **extended.pax}
        name = ext.get(b"path", name)
        link = ext.get(b"linkpath", link)
        if b"size" in ext:
            size = th.pax_number(ext[b"size"], "size")
        if b"mtime" in ext:
            ns = th.pax_mtime_ns(ext[b"mtime"])
            mtime_ns = mtime_ns if ns is None else ns
    else:
        ext = extended.pax
    # Base-256 numbers and pax times can say anything: the index holds i64 ns.
    return name, link, size, clamp_mtime_ns(mtime_ns), ext
