"""Chunk decoding with checksums, and the arithmetic that maps file bytes to chunks.

Every decoded chunk is checked against the XXH3-64 of its original bytes (from the index)
before anyone sees it: a decoder error or a mismatch is :class:`CorruptDataError` for that
file only. Codecs are built from the configs stored in the index, never guessed.
"""

from __future__ import annotations

import os

import xxhash

from compressors import CODECS, CodecError, CodecUnavailableError, get_codec
from fanstore.errors import CorruptDataError, FormatError
from fanstore.format.index import Index


#: The extra of FanStore that installs a codec's optional library (``pip install
#: 'fanstore[EXTRA]'``); the core dependencies install the others.
CODEC_EXTRAS = {"jpegxl": "jpeg"}


def _codec(config: dict):
    """The codec of a codec table entry, or :class:`FormatError` in one line naming the codec
    and what to install."""
    try:
        return get_codec(config)
    except CodecUnavailableError as exc:
        codec_id = config.get("id")
        extra = CODEC_EXTRAS.get(codec_id)
        if extra is None or codec_id not in CODECS:
            raise FormatError(f"store needs codec {codec_id}: {exc}") from exc
        libs = ", ".join(module for module, _ in CODECS[codec_id].requires)
        raise FormatError(f"store needs codec {codec_id}: install {libs} "
                          f"(pip install 'fanstore[{extra}]')") from exc
    except CodecError as exc:
        raise FormatError(f"the store needs a codec this installation lacks: {exc}") from exc


class Decoder:
    """Decodes and verifies chunks with the codec recorded for each chunk in the index."""

    def __init__(self, index: Index) -> None:
        self.index = index
        self._raw = index.chunks["raw"]
        self._stored = index.chunks["stored"]
        self._codec = index.chunks["codec"]
        self._sum = index.chunks["checksum"]
        self._part = index.chunks["part"]
        self._offset = index.chunks["offset"]
        self.codecs = [_codec(cfg) for cfg in index.codecs]

    def checksum(self, chunk: int) -> int:
        """The XXH3-64 of ``chunk``'s decoded bytes (from the index)."""
        return int(self._sum[chunk])

    def run_extent(self, first: int, count: int) -> tuple[int, int, int]:
        """(partition, offset, length) of the stored bytes of chunks [first, first+count)."""
        if count == 1:
            return int(self._part[first]), int(self._offset[first]), int(self._stored[first])
        length = int(self._stored[first : first + count].sum())
        return int(self._part[first]), int(self._offset[first]), length

    def decode(self, chunk: int, stored, entry: int | None = None) -> bytes:
        raw_size = int(self._raw[chunk])
        codec = self.codecs[int(self._codec[chunk])]
        try:
            raw = codec.decode(stored, raw_size)
        except CodecError as exc:
            raise CorruptDataError(self._where(chunk, entry, f"cannot be decoded ({exc})")) \
                from exc
        if xxhash.xxh3_64_intdigest(raw) != int(self._sum[chunk]):
            raise CorruptDataError(self._where(chunk, entry, "fails its checksum"))
        return raw

    def decode_run(self, first: int, count: int, blob, entry: int | None = None) -> list[bytes]:
        """Split a fetched run of stored chunks and decode each."""
        if count == 1:
            if len(blob) != int(self._stored[first]):
                raise CorruptDataError(self._where(first, entry,
                                                   "was fetched with the wrong length"))
            return [self.decode(first, blob, entry)]
        if len(blob) != int(self._stored[first : first + count].sum()):
            raise CorruptDataError(self._where(first, entry, "was fetched with the wrong length"))
        out = []
        view = memoryview(blob)
        pos = 0
        for k in range(first, first + count):
            n = int(self._stored[k])
            out.append(self.decode(k, view[pos : pos + n], entry))
            pos += n
        return out

    def _where(self, chunk: int, entry: int | None, what: str) -> str:
        where = f"partition {int(self._part[chunk])} offset {int(self._offset[chunk])}"
        name = os.fsdecode(self.index.path(entry)) if entry is not None else f"chunk {chunk}"
        return f"{name}: data {what} ({where})"


def chunk_span(offset: int, size: int, file_size: int, chunk_size: int,
               base: int = 0) -> tuple[int, int, int]:
    """Chunks a read touches, relative to the file's first chunk: (lo, hi, end).

    ``end`` is the file offset the read stops at (short at EOF). ``base`` is where the
    file's bytes start inside its first chunk (0 unless the chunk is shared with other
    files), so file byte p lives in relative chunk (base + p) // chunk_size.
    """
    end = min(offset + size, file_size)
    if offset >= end:
        return 0, 0, offset
    return (base + offset) // chunk_size, (base + end - 1) // chunk_size + 1, end


def assemble(chunks: list[bytes], lo: int, offset: int, end: int, chunk_size: int,
             base: int = 0):
    """The file bytes [offset, end) from its decoded chunks lo.. (a zero-copy view, or the
    chunk itself, when one chunk covers the read)."""
    start = base + offset - lo * chunk_size
    if len(chunks) == 1:
        c = chunks[0]
        if start == 0 and end - offset == len(c):
            return c
        return memoryview(c)[start : start + end - offset]
    joined = b"".join(chunks)
    return memoryview(joined)[start : start + end - offset]
