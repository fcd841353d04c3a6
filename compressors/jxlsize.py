"""What a JPEG XL stream declares, read from its headers without libjxl: the image size,
and the APPn and COM bytes of the JPEG its ``jbrd`` box rebuilds (:func:`marker_bytes`).

A JPEG XL stream is either a bare codestream (``FF 0A`` then the headers) or an ISO BMFF
container (:data:`JXL_CONTAINER`, then boxes: ``size`` u32 big-endian, ``type``; a size of
1 is followed by a u64 size, a size of 0 runs to the end) whose codestream is one ``jxlc``
box, or ``jxlp`` boxes (a u32 index, the top bit set on the last, then a piece of the
codestream) concatenated in order. libjxl's JPEG transcoder writes the container with two
``jxlp`` boxes, the first holding just the signature and the first headers.

The codestream's first field after ``FF 0A`` is its SizeHeader (ISO/IEC 18181-1, A.2),
bits read from each byte's least significant end:

- ``small`` (1 bit). Small: ``ysize = 8 * (u(5) + 1)``; otherwise ``ysize`` is a U32: a
  2-bit selector, then ``1 + u(9)``, ``1 + u(13)``, ``1 + u(18)`` or ``1 + u(30)``;
- ``ratio`` (3 bits). 0: ``xsize`` is coded like ``ysize`` (a 5-bit field if small, else
  a U32); 1-7: ``xsize = floor(ysize * N / D)`` for 1/1, 12/10, 4/3, 3/2, 16/9, 5/4, 2/1.

At most 68 bits: 9 bytes after the signature. :func:`declared` is strict where the
container could be read two ways (a ``jxlc`` and ``jxlp`` boxes both, two ``jxlc``, ``jxlp``
indices out of order or after the last, two ``jbrd``, a box past the end): it refuses
rather than guess which codestream or reconstruction data libjxl would read.
"""

from __future__ import annotations

import struct

from .errors import CorruptDataError

__all__ = ["JXL_CONTAINER", "BARE_CODESTREAM", "MAX_BOXES", "declared", "declared_size",
           "codestream_head", "parse_size_header", "marker_bytes"]

#: The ISO BMFF container's signature box (``JXL `` with ``0D 0A 87 0A``).
JXL_CONTAINER = b"\x00\x00\x00\x0cJXL \r\n\x87\n"
#: A bare codestream's signature.
BARE_CODESTREAM = b"\xff\x0a"
#: Boxes read at most (libjxl's transcoder writes 5-8: signature, ftyp, jxll, jbrd, Exif,
#: xml, 2 jxlp); more is refused, which bounds the walk over a hostile stream.
MAX_BOXES = 64
_HEAD = len(BARE_CODESTREAM) + 9  # signature + the longest SizeHeader (68 bits)
_RATIOS = (None, (1, 1), (12, 10), (4, 3), (3, 2), (16, 9), (5, 4), (2, 1))
_U32_BITS = (9, 13, 18, 30)
_MAX_MARKERS = 16384  # libjxl's own limit on the markers of a JPEG it rebuilds
_BOX, _U64, _U32 = struct.Struct(">I4s"), struct.Struct(">Q"), struct.Struct(">I")


def _boxes(view, pos: int):
    """Yield ``(type, start, end)`` of each box from ``pos`` (content ``[start, end)``)."""
    n = len(view)
    for _ in range(MAX_BOXES):
        if pos == n:
            return
        if n - pos < 8:
            raise CorruptDataError("jpegxl: truncated box header")
        size, kind = _BOX.unpack_from(view, pos)
        start = pos + 8
        if size == 1:
            if n - pos < 16:
                raise CorruptDataError("jpegxl: truncated box header")
            size, start = _U64.unpack_from(view, start)[0], pos + 16
        elif size == 0:
            size = n - pos
        if size < start - pos or size > n - pos:
            raise CorruptDataError(f"jpegxl: box {kind!r} of {size} bytes at {pos} does not fit")
        yield kind, start, pos + size
        pos += size
    if pos != n:
        raise CorruptDataError(f"jpegxl: more than {MAX_BOXES} boxes")


def codestream_head(view) -> bytes:
    """The first bytes of the codestream (up to the longest signature + SizeHeader)."""
    return _walk(view)[0]


def _walk(view) -> tuple[bytes, tuple[int, int] | None]:
    """The codestream's first bytes and the ``jbrd`` box's content range (None: none)."""
    if bytes(view[:2]) == BARE_CODESTREAM:
        return bytes(view[:_HEAD]), None
    if bytes(view[:len(JXL_CONTAINER)]) != JXL_CONTAINER:
        raise CorruptDataError("jpegxl: not a JPEG XL stream")
    head, jxlc, parts, last, jbrd = b"", False, 0, False, None
    for kind, start, end in _boxes(view, len(JXL_CONTAINER)):
        if kind == b"jbrd":
            if jbrd is not None:
                raise CorruptDataError("jpegxl: more than one jbrd box")
            jbrd = (start, end)
        elif kind == b"jxlc":
            if jxlc or parts:
                raise CorruptDataError("jpegxl: more than one codestream box")
            jxlc, head = True, bytes(view[start:min(end, start + _HEAD)])
        elif kind == b"jxlp":
            if jxlc or last or end - start < 4:
                raise CorruptDataError("jpegxl: misplaced or short jxlp box")
            index = _U32.unpack_from(view, start)[0]
            if index & 0x7FFFFFFF != parts:
                raise CorruptDataError(f"jpegxl: jxlp box {index & 0x7FFFFFFF}, expected {parts}")
            parts, last = parts + 1, bool(index >> 31)
            if len(head) < _HEAD:
                head += bytes(view[start + 4:min(end, start + 4 + _HEAD - len(head))])
    if not (jxlc or parts):
        raise CorruptDataError("jpegxl: no codestream box")
    if parts and not last:
        raise CorruptDataError("jpegxl: the last jxlp box is missing")
    return head, jbrd


class _Bits:
    """Fields of ``data`` read from each byte's least significant bit (JPEG XL's order)."""

    def __init__(self, data, what: str) -> None:
        self.data, self.pos, self.avail, self.what = data, 0, 8 * len(data), what
        # the first 64 bytes as one integer: what a usual header needs, without slicing
        self.window, self.window_bits = int.from_bytes(data[:64], "little"), 8 * 64

    def read(self, n: int) -> int:
        pos = self.pos
        if pos + n > self.avail:
            raise CorruptDataError(f"jpegxl: the stream ends inside its {self.what}")
        self.pos = pos + n
        if pos + n <= self.window_bits:
            return (self.window >> pos) & ((1 << n) - 1)
        chunk = int.from_bytes(self.data[pos >> 3:(pos + n + 7) >> 3], "little")
        return (chunk >> (pos & 7)) & ((1 << n) - 1)


def declared(buf) -> tuple[int, int, int]:
    """``(width, height, marker bytes)``: the image size the SizeHeader declares and the
    bytes of APPn and COM marker segments the ``jbrd`` box declares (0 without one);
    :class:`CorruptDataError` for a stream without a readable size header."""
    head, jbrd = _walk(buf)
    width, height, _ = parse_size_header(head)
    markers = 0 if jbrd is None else marker_bytes(buf[jbrd[0]:jbrd[1]])
    return width, height, markers


def marker_bytes(jbrd) -> int:
    """The bytes of the APPn and COM segments a ``jbrd`` box (JPEG reconstruction data)
    declares: libjxl rebuilds them all before it writes a byte of the JPEG.

    The box opens with libjxl's JPEGData bundle: ``is_gray`` (1 bit); the file's markers,
    6 bits each (the marker - 0xC0) up to EOI (0xD9), at most 16,384; for each APPn marker
    a type (U32: 0, 1, 2 + u(1), 4 + u(2)) and a 16-bit length - 1; for each COM marker a
    16-bit length - 1. A segment of length L (the type byte, 2 length bytes and the payload)
    takes L + 1 bytes of the JPEG file, so their sum is less than the file's size."""
    bits = _Bits(jbrd, "JPEG reconstruction header")
    bits.read(1)
    apps = coms = markers = 0
    marker = 0
    while marker != 0xD9:
        marker = bits.read(6) + 0xC0
        markers += 1
        apps += marker & 0xF0 == 0xE0
        coms += marker == 0xFE
        if markers > _MAX_MARKERS:
            raise CorruptDataError(f"jpegxl: more than {_MAX_MARKERS} JPEG markers")
    total = 0
    for _ in range(apps):
        selector = bits.read(2)
        if selector >= 2:
            bits.read(selector - 1)
        total += bits.read(16) + 1
    for _ in range(coms):
        total += bits.read(16) + 1
    return total


def declared_size(buf) -> tuple[int, int]:
    """``(width, height)`` the stream's SizeHeader declares; :class:`CorruptDataError` for
    a stream without a readable one (not JPEG XL, truncated, no codestream box)."""
    width, height, _ = parse_size_header(codestream_head(buf))
    return width, height


def parse_size_header(head: bytes) -> tuple[int, int, int]:
    """``(width, height, bits)`` of the SizeHeader after the signature at ``head``'s start
    (``bits``: the header's length)."""
    if head[:2] != BARE_CODESTREAM:
        raise CorruptDataError("jpegxl: the codestream does not start with FF 0A")
    bits = _Bits(head[2:], "size header")
    read = bits.read

    def dim(small: int) -> int:
        return 8 * (read(5) + 1) if small else 1 + read(_U32_BITS[read(2)])

    small = read(1)
    height = dim(small)
    ratio = read(3)
    if ratio == 0:
        width = dim(small)
    else:
        num, den = _RATIOS[ratio]
        width = height * num // den
    return width, height, bits.pos
