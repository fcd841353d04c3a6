"""What a JPEG XL stream declares, read from its headers without libjxl: the image size,
and the bytes of the JPEG its ``jbrd`` box rebuilds (:func:`jbrd_bytes`).

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
from typing import NamedTuple

from .errors import CorruptDataError

__all__ = ["JXL_CONTAINER", "BARE_CODESTREAM", "MAX_BOXES", "declared", "declared_size",
           "codestream_head", "parse_size_header", "jbrd_bytes", "JpegParts"]

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
    """Fields of ``data`` read from each byte's least significant bit (JPEG XL's order),
    through a window of 64 bytes as one integer, moved on when a field runs past it."""

    _WINDOW = 64

    def __init__(self, data, what: str) -> None:
        self.data, self.pos, self.avail, self.what = data, 0, 8 * len(data), what
        self.base, self.end = 0, 8 * self._WINDOW  # the window's bits [base, end)
        self.window = int.from_bytes(data[:self._WINDOW], "little")

    def read(self, n: int) -> int:
        pos = self.pos
        stop = pos + n
        if stop > self.avail:
            raise CorruptDataError(f"jpegxl: the stream ends inside its {self.what}")
        self.pos = stop
        if stop > self.end:  # n <= 32: one window from the byte holding pos covers it
            first = pos >> 3
            self.base, self.end = 8 * first, 8 * (first + self._WINDOW)
            self.window = int.from_bytes(self.data[first:first + self._WINDOW], "little")
        return (self.window >> (pos - self.base)) & ((1 << n) - 1)

    def u32(self, dist) -> int:
        """A U32 field: a 2-bit selector picks ``(offset, bits)`` of ``dist``."""
        offset, n = dist[self.read(2)]
        return offset + self.read(n) if n else offset

    def skip(self, n: int) -> None:
        if self.pos + n > self.avail:
            raise CorruptDataError(f"jpegxl: the stream ends inside its {self.what}")
        self.pos += n

    def left(self) -> int:
        return self.avail - self.pos


def declared(buf) -> tuple[int, int, int]:
    """``(width, height, JPEG bytes)``: the image size the SizeHeader declares and the bytes
    of the JPEG file the ``jbrd`` box declares (:func:`jbrd_bytes`; 0 without one);
    :class:`CorruptDataError` for a stream without readable headers."""
    head, jbrd = _walk(buf)
    width, height, _ = parse_size_header(head)
    rebuilt = 0 if jbrd is None else sum(jbrd_bytes(memoryview(buf)[jbrd[0]:jbrd[1]]))
    return width, height, rebuilt


class JpegParts(NamedTuple):
    """Bytes of the JPEG file a ``jbrd`` box declares, each rebuilt whole by libjxl before
    it writes a byte: APPn and COM segments (as their 16-bit length fields count them, so one
    less than the file holds each), the data between markers, the data after EOI."""

    segments: int
    inter_marker: int
    tail: int


# U32 fields of the JPEGData bundle: the (offset, extra bits) each 2-bit selector picks.
_APP_TYPE = ((0, 0), (1, 0), (2, 1), (4, 2))
_MAX_SYMBOLS = 257  # a Huffman code's 256 byte values and libjxl's end symbol
_ONE_TO_FOUR = ((1, 0), (2, 0), (3, 0), (4, 0))
_HUFFMAN_CODES = ((4, 0), (2, 3), (10, 4), (26, 6))
_SYMBOL_COUNT = ((0, 0), (1, 0), (2, 3), (0, 8))
_SYMBOL_BITS = (4, 4, 6, 10)  # a symbol's bits (its selector's 2 included) by selector
_LOW64 = (1 << 64) - 1
_CODE_BYTES = (4 + 17 * 10 + _MAX_SYMBOLS * 10 + 7) // 8 + 1  # a code's most bytes, + 1
_LAST_PASS = ((0, 0), (1, 0), (2, 0), (3, 3))
_ENTRIES = ((0, 0), (1, 2), (4, 4), (20, 16))
_BLOCK_STEP = ((0, 0), (1, 3), (9, 5), (41, 28))
_ZERO_RUNS = ((1, 0), (2, 2), (5, 4), (20, 8))
_TAIL = ((0, 0), (1, 8), (257, 16), (65793, 22))
_MAX_BLOCK = 3 << 26  # libjxl: block indices of an 8K x 8K, 3-component JPEG


def jbrd_bytes(jbrd) -> JpegParts:
    """The JPEG bytes a ``jbrd`` box (JPEG reconstruction data) declares; libjxl allocates
    them all before it writes a byte of the file, so their sum is at most the file's size.

    The box opens with libjxl's JPEGData bundle (bits from each byte's least significant
    end; U32: a 2-bit selector, then per selector a constant or an offset plus a few bits):
    ``is_gray``; the markers (:func:`_markers`); per APPn a type and a 16-bit length - 1,
    per COM a 16-bit length - 1; the quantisation tables and components
    (:func:`_components`); the Huffman codes (:func:`_huffman_codes`); per scan its
    components and passes (:func:`_scan_headers`); a 16-bit restart interval if the file
    has DRI; per scan its reset points and extra zero runs (:func:`_scan_blocks`); per
    inter-marker marker a 16-bit length; the tail's length (U32 up to 4,260,096). The
    brotli-compressed bytes that follow are not read. :class:`CorruptDataError` for a
    bundle that ends early or that libjxl would refuse on a count or an index."""
    bits = _Bits(jbrd, "JPEG reconstruction header")
    bits.read(1)  # is_gray
    apps, coms, scans, inter, dri = _markers(bits)
    segments = 0
    for _ in range(apps):
        if bits.u32(_APP_TYPE) > 3:  # unknown, ICC, Exif, XMP
            raise CorruptDataError("jpegxl: an unknown APPn type in the JPEG reconstruction")
        segments += _segment_length(bits)
    for _ in range(coms):
        segments += _segment_length(bits)
    components = _components(bits)
    _huffman_codes(bits)
    _scan_headers(bits, scans, components)
    if dri:
        bits.read(16)
    _scan_blocks(bits, scans)
    inter_marker = 0
    for _ in range(inter):
        inter_marker += bits.read(16)
    return JpegParts(segments, inter_marker, bits.u32(_TAIL))


def _markers(bits: _Bits) -> tuple[int, int, int, int, bool]:
    """``(APPn, COM, SOS, inter-marker, has DRI)`` counted over the markers: 6 bits each (the
    marker - 0xC0; 0xFF stands for data between markers) up to EOI, at most 16,384."""
    apps = coms = scans = inter = markers = 0
    dri = False
    marker = 0
    while marker != 0xD9:
        marker = bits.read(6) + 0xC0
        markers += 1
        if markers > _MAX_MARKERS:
            raise CorruptDataError(f"jpegxl: more than {_MAX_MARKERS} JPEG markers")
        if marker & 0xF0 == 0xE0:
            apps += 1
        elif marker == 0xFE:
            coms += 1
        elif marker == 0xDA:
            scans += 1
        elif marker == 0xFF:
            inter += 1
        elif marker == 0xDD:
            dri = True
    if not scans:
        raise CorruptDataError("jpegxl: a JPEG reconstruction without a scan")
    return apps, coms, scans, inter, dri


def _segment_length(bits: _Bits) -> int:
    length = bits.read(16) + 1
    if length < 3:
        raise CorruptDataError(f"jpegxl: a JPEG marker segment of {length} bytes")
    return length


def _components(bits: _Bits) -> int:
    """Read the quantisation tables (U32 1-3 of them: 1 bit precision, 2 bits index, 1 bit
    is_last each) and the components (2 bits: grey, YCbCr, RGB or custom; custom: U32 1 or 3
    of them, 8-bit ids; then a 2-bit table index each); return the component count."""
    tables = bits.u32(_ONE_TO_FOUR)
    if tables == 4:
        raise CorruptDataError("jpegxl: 4 quantisation tables in the JPEG reconstruction")
    bits.read(4 * tables)
    kind = bits.read(2)
    count = 1 if kind == 0 else 3
    if kind == 3:
        count = bits.u32(_ONE_TO_FOUR)
        if count not in (1, 3):
            raise CorruptDataError(f"jpegxl: a JPEG of {count} components")
        bits.read(8 * count)
    for _ in range(count):
        if bits.read(2) >= tables:
            raise CorruptDataError("jpegxl: a JPEG component of a missing quantisation table")
    return count


def _huffman_codes(bits: _Bits) -> None:
    """Skip the Huffman codes (U32 4-89 of them): 4 bits of slot and is_last, 17 U32 symbol
    counts (0, 1, 2 + u(3), u(8)), then as many U32 symbols (u(2), 4 + u(2), 8 + u(4),
    1 + u(8): 4, 4, 6 or 10 bits by the selector alone), at most 257.

    The parse's hot loop (a usual JPEG has 4 codes, 300-400 symbols): each code is read
    from one integer of the most bytes it can take, its symbols through a 64-bit window of
    it (shifts of small integers are cheap), not field by field."""
    data, lengths = bits.data, _SYMBOL_BITS
    for _ in range(bits.u32(_HUFFMAN_CODES)):
        first = bits.pos >> 3
        v = int.from_bytes(data[first:first + _CODE_BYTES], "little") >> (bits.pos & 7)
        p, symbols = 4, 0
        for _ in range(17):
            selector = (v >> p) & 3
            if selector < 2:
                symbols, p = symbols + selector, p + 2
            elif selector == 2:
                symbols, p = symbols + 2 + ((v >> (p + 2)) & 7), p + 5
            else:
                symbols, p = symbols + ((v >> (p + 2)) & 255), p + 10
        if symbols > _MAX_SYMBOLS:
            raise CorruptDataError(f"jpegxl: a Huffman code of {symbols} symbols")
        v >>= p
        window, q = v & _LOW64, 0
        for _ in range(symbols):
            if q > 54:  # the next symbol (at most 10 bits) might run past the window
                v >>= q
                p, q, window = p + q, 0, v & _LOW64
            q += lengths[(window >> q) & 3]
        bits.skip(p + q)  # refuses a code past the box's end (read as zeros above)


def _scan_headers(bits: _Bits, scans: int, components: int) -> None:
    """Per scan: U32 1-3 components, 20 bits of spectral and approximation limits, 6 bits
    per component (its index, below ``components``, and two table indices), and a U32 last
    pass."""
    for _ in range(scans):
        count = bits.u32(_ONE_TO_FOUR)
        if count == 4:
            raise CorruptDataError("jpegxl: a JPEG scan of 4 components")
        bits.read(20)
        for _ in range(count):
            if bits.read(6) & 3 >= components:
                raise CorruptDataError("jpegxl: a JPEG scan of a missing component")
        bits.u32(_LAST_PASS)


def _too_many(count: int, what: str) -> CorruptDataError:
    return CorruptDataError(f"jpegxl: {count} JPEG {what} declared, more than the rest of "
                            "the JPEG reconstruction holds")


def _scan_blocks(bits: _Bits, scans: int) -> None:
    """Per scan: U32 reset points, each a U32 step past the last block index; U32 extra
    zero runs, each a U32 run count (at most 4) and a block step. Block indices stay below
    3 * 2**26 (libjxl's limit); each entry takes at least 2 bits, so a count the rest of the
    box cannot hold is refused before the loop."""
    u32 = bits.u32
    for _ in range(scans):
        count = u32(_ENTRIES)
        if 2 * count > bits.left():
            raise _too_many(count, "reset points")
        block = -1
        for _ in range(count):
            block += 1 + u32(_BLOCK_STEP)
            if block >= _MAX_BLOCK:
                raise CorruptDataError(f"jpegxl: JPEG block {block} in the reconstruction")
        count = u32(_ENTRIES)
        if 4 * count > bits.left():
            raise _too_many(count, "extra zero runs")
        block = -1
        for _ in range(count):
            if u32(_ZERO_RUNS) > 4:
                raise CorruptDataError("jpegxl: more than 4 extra zero runs in a JPEG block")
            block += 1 + u32(_BLOCK_STEP)
            if block > _MAX_BLOCK:
                raise CorruptDataError(f"jpegxl: JPEG block {block} in the reconstruction")


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
