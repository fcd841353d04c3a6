"""The image size a JPEG XL stream declares, read from its header without libjxl.

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

At most 68 bits: 9 bytes after the signature. :func:`declared_size` is strict where the
container could be read two ways (a ``jxlc`` and ``jxlp`` boxes both, two ``jxlc``, ``jxlp``
indices out of order or after the last, a box past the end): it refuses rather than guess
which codestream libjxl would read.
"""

from __future__ import annotations

import struct

from .errors import CorruptDataError

__all__ = ["JXL_CONTAINER", "BARE_CODESTREAM", "MAX_BOXES", "declared_size",
           "codestream_head", "parse_size_header"]

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
    if bytes(view[:2]) == BARE_CODESTREAM:
        return bytes(view[:_HEAD])
    if bytes(view[:len(JXL_CONTAINER)]) != JXL_CONTAINER:
        raise CorruptDataError("jpegxl: not a JPEG XL stream")
    head, jxlc, parts, last = b"", False, 0, False
    for kind, start, end in _boxes(view, len(JXL_CONTAINER)):
        if kind == b"jxlc":
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
    return head


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
    bits, avail, pos = int.from_bytes(head[2:], "little"), 8 * (len(head) - 2), 0

    def read(n: int) -> int:
        nonlocal pos
        if pos + n > avail:
            raise CorruptDataError("jpegxl: the codestream ends inside its size header")
        value = (bits >> pos) & ((1 << n) - 1)
        pos += n
        return value

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
    return width, height, pos
