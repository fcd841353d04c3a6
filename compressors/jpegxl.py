"""Lossless JPEG recompression with JPEG XL (``jpegxl``): a JPEG in, the same bytes out.

libjxl (through ``imagecodecs.jpegxl_encode_jpeg``) re-encodes a JPEG's DCT coefficients
with JPEG XL's entropy coder and keeps what it needs to rebuild the very same file
(``jpegxl_decode_jpeg``): 14-20% smaller on camera and dataset JPEGs, byte for byte the
same file on decode. No pixel is decoded either way.

It applies to whole JPEG files only (:attr:`Codec.declines`): :meth:`JpegXlCodec.encode`
raises :class:`DeclinedError` for any input that does not start like a JPEG, that libjxl
refuses (CMYK, arithmetic coding, 12-bit, a truncated file, a piece of a larger file), or
whose round trip is not the input byte for byte (checked on every encode). A store keeps a
declined input as it is (codec ``none``). The transcoder runs at libjxl's default effort
(imagecodecs exposes no effort for JPEG transcoding), so the config has no parameters:
``{"id": "jpegxl"}``; the stream records everything the decoder needs.

Both directions run on one thread (``numthreads=1``): the callers' own pools (pack workers,
the mount's readers) are the parallelism.

Bounds: decode writes into one buffer of exactly ``raw_size`` bytes and never grows it (a
stream that rebuilds a longer file is refused). libjxl's own working memory while it
rebuilds follows the image size the stream declares: the DCT coefficients of the image,
2.4-3.6 bytes per pixel measured (greyscale to 4:2:0 colour; 4:4:4 colour about 6). So
before libjxl sees the stream, decode reads that size from the codestream's SizeHeader
(:mod:`compressors.jxlsize`; with the JPEGData bundle below, 35-90 us a decode)
and refuses a stream whose header cannot be read (not JPEG XL, truncated, no codestream
box, an ambiguous container) or that declares more pixels than a JPEG of ``raw_size``
bytes can hold, :func:`max_pixels`: ``max(2**22, 512 * raw_size)``.

Why 512 pixels a byte: a Huffman-coded JPEG (libjxl transcodes no other) codes every 8x8
block of its full-resolution component with at least one bit, the Huffman code of the
block's DC difference (codes are 1-16 bits; a baseline block adds at least an end-of-block
code, a progressive JPEG's AC scans may skip runs of blocks but its DC scan does not). So n
bytes hold at most 8n blocks, 512n pixels; a uniform baseline JPEG measures 255 pixels a
byte, a photograph 5-20. The floor of 2**22 pixels (2048x2048, 10-25 MB for libjxl) is
slack for the few JPEGs the argument does not cover (a progressive JPEG that leaves out a
DC scan, which libjpeg reads as grey): a few-KB stream can then make libjxl allocate tens
of MB, never the 10+ GB of a declared 65535x65535. Encode applies the same bound to what it
writes (a JPEG beyond it is declined and stored raw), so a store never holds a stream its
own reader refuses.

The JPEG reconstruction data (the ``jbrd`` box: the markers, APPn and COM segments, bytes
between markers and tail of the original file, the bytes brotli-compressed) is rebuilt
whole by libjxl before it writes the file, so it too costs memory whatever ``raw_size``
says: a 12.9 KB stream of a 64x64 JPEG with 4,000 64 KB APP5 markers of zeros (262 MB)
grew the reader by 258 MB, an 18.4 KB one with 3,200 runs of 65,535 zero bytes between
markers (210 MB) by 207 MB, both recorded as a few-KB file. Decode also reads the lengths
the box's JPEGData bundle declares (:func:`compressors.jxlsize.jbrd_bytes`: the segments'
are its first fields, the inter-marker sections' and the tail's come after the Huffman
codes and scans) and refuses more than ``raw_size`` of them: they are all bytes of the
file. Parse cost, headers and bundle: 35-90 us per decode on the test JPEGs (a bundle of
4 Huffman codes, 150-470 bytes), against 2-12 ms for libjxl, on a loaded 2-core machine.
Not bounded: a frame header declaring a frame larger than the image (docs/reliability.md).
"""

from __future__ import annotations

from typing import Any

from ._util import BytesLike, as_view, check_raw_size, require, size_mismatch
from .abc import Codec
from .errors import CodecUnavailableError, CorruptDataError, DeclinedError
from .jxlsize import JXL_CONTAINER, declared

__all__ = ["JpegXlCodec", "JPEG_SOI", "JXL_CONTAINER", "max_pixels"]

_LIB = ("imagecodecs", "imagecodecs")
#: A JPEG starts with SOI (FF D8) and then a marker (FF ..).
JPEG_SOI = b"\xff\xd8\xff"
#: Pixels a JPEG may have per byte of its file, and at least (module docstring, "Bounds").
PIXELS_PER_BYTE, MIN_PIXELS = 512, 1 << 22


def max_pixels(raw_size: int) -> int:
    """The most pixels a stream that rebuilds a JPEG of ``raw_size`` bytes may declare."""
    return max(MIN_PIXELS, PIXELS_PER_BYTE * raw_size)


def check_declared_size(view, raw_size: int) -> None:
    """Refuse (:class:`CorruptDataError`) a stream whose declared image is larger than a
    JPEG of ``raw_size`` bytes holds, whose reconstruction data declares more bytes of the
    JPEG file than ``raw_size``, or whose headers cannot be read."""
    width, height, rebuilt = declared(view)
    if width * height > max_pixels(raw_size):
        raise CorruptDataError(f"jpegxl: the stream declares a {width}x{height} image, more "
                               f"than a JPEG of {raw_size} bytes holds")
    if rebuilt > raw_size:
        raise CorruptDataError(f"jpegxl: the stream declares {rebuilt} bytes of JPEG markers "
                               f"and data, more than a JPEG of {raw_size} bytes holds")


def _library() -> Any:
    lib = require(*_LIB)
    jpegxl = getattr(lib, "JPEGXL", None)
    if jpegxl is None or not getattr(jpegxl, "available", False):
        raise CodecUnavailableError("imagecodecs was built without JPEG XL (libjxl) support: "
                                    "pip install --force-reinstall imagecodecs")
    return lib


class JpegXlCodec(Codec):
    """A whole JPEG recompressed losslessly as JPEG XL; see the module docstring."""

    codec_id = "jpegxl"
    requires = (_LIB,)
    declines = True

    def __init__(self) -> None:
        lib = self._lib = _library()
        self._encode = lib.jpegxl_encode_jpeg
        self._decode = lib.jpegxl_decode_jpeg
        # imagecodecs raises its JpegxlError (a RuntimeError) and ValueError for bad input
        self._errors = (RuntimeError, ValueError, MemoryError, lib.JpegxlError)

    @classmethod
    def check_available(cls) -> None:
        _library()

    def encode(self, buf: BytesLike) -> bytes:
        view = as_view(buf)
        n = len(view)
        if n < len(JPEG_SOI) or bytes(view[:3]) != JPEG_SOI:
            raise DeclinedError("jpegxl: not a JPEG (no SOI marker)")
        try:
            out = self._encode(view, numthreads=1)
        except self._errors as exc:
            raise DeclinedError(f"jpegxl: libjxl cannot transcode this JPEG: {exc}") from exc
        # Verified on every encode: a store must give back the very bytes it was given.
        try:
            back = self._decode(out, numthreads=1, out=n)
        except self._errors as exc:
            raise DeclinedError(f"jpegxl: round trip failed: {exc}") from exc
        if len(back) != n or back != view:
            raise DeclinedError("jpegxl: round trip is not byte-exact")
        try:  # what decode would refuse is never stored
            check_declared_size(out, n)
        except CorruptDataError as exc:
            raise DeclinedError(str(exc)) from exc
        return bytes(out)

    def decode(self, buf: BytesLike, raw_size: int) -> bytes:
        raw_size, view = check_raw_size(raw_size), as_view(buf)
        if raw_size == 0:
            raise size_mismatch(self.codec_id, -1, raw_size)
        # before libjxl allocates for the image the stream declares
        check_declared_size(view, raw_size)
        try:
            # out=raw_size: the output buffer is allocated once at exactly the size the
            # index records and never grown (a longer JPEG is an error, not a realloc).
            out = self._decode(view, numthreads=1, out=raw_size)
        except self._errors as exc:
            raise CorruptDataError(f"jpegxl: {exc}") from exc
        if len(out) != raw_size:
            raise size_mismatch(self.codec_id, len(out), raw_size)
        return out if type(out) is bytes else bytes(out)

    def get_config(self) -> dict[str, Any]:
        return {"id": self.codec_id}

    @property
    def spec(self) -> str:
        return self.codec_id
