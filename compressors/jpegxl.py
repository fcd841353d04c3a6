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
rebuilds follows the image size the stream declares (the DCT coefficients of the image,
a few bytes per pixel), which this codec does not check against ``raw_size``: a hostile
store could make a reader allocate that much. Not done yet: parsing the codestream's size
header and refusing images larger than any JPEG of ``raw_size`` bytes at encode's quality.
"""

from __future__ import annotations

from typing import Any

from ._util import BytesLike, as_view, check_raw_size, require, size_mismatch
from .abc import Codec
from .errors import CodecUnavailableError, CorruptDataError, DeclinedError

__all__ = ["JpegXlCodec", "JPEG_SOI", "JXL_CONTAINER"]

_LIB = ("imagecodecs", "imagecodecs")
#: A JPEG starts with SOI (FF D8) and then a marker (FF ..).
JPEG_SOI = b"\xff\xd8\xff"
#: The ISO BMFF container signature libjxl writes when it keeps JPEG reconstruction data.
JXL_CONTAINER = b"\x00\x00\x00\x0cJXL \r\n\x87\n"
_BARE_CODESTREAM = b"\xff\x0a"


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
        return bytes(out)

    def decode(self, buf: BytesLike, raw_size: int) -> bytes:
        raw_size, view = check_raw_size(raw_size), as_view(buf)
        head = bytes(view[:len(JXL_CONTAINER)])
        if not (head == JXL_CONTAINER or head.startswith(_BARE_CODESTREAM)):
            raise CorruptDataError("jpegxl: not a JPEG XL stream")
        if raw_size == 0:
            raise size_mismatch(self.codec_id, -1, raw_size)
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
