"""Stdlib zlib codec (``zlib:<level>``, levels 1-9): the always-available reference codec."""

from __future__ import annotations

import zlib

from ._util import BytesLike, as_view, check_raw_size, size_mismatch
from .abc import LeveledCodec
from .errors import CodecError, CorruptDataError

__all__ = ["ZlibCodec"]


class ZlibCodec(LeveledCodec):
    """One zlib stream (RFC 1950: header + deflate + adler32), decoded with a max length.

    Inflation stops after ``raw_size + 1`` bytes; CPython joins its output blocks once,
    so the transient peak is at most about twice ``raw_size``.
    """

    codec_id = "zlib"
    levels = (1, 9)
    default_level = 6

    def encode(self, buf: BytesLike) -> bytes:
        try:
            return zlib.compress(as_view(buf), self._level)
        except (zlib.error, OverflowError, ValueError) as exc:
            raise CodecError(f"zlib: encode failed: {exc}") from exc

    def decode(self, buf: BytesLike, raw_size: int) -> bytes:
        raw_size = check_raw_size(raw_size)
        dobj = zlib.decompressobj()
        try:
            # One byte of slack tells "too long" apart from "exactly raw_size"
            # (and keeps max_length > 0, since 0 would mean unlimited).
            out = dobj.decompress(as_view(buf), raw_size + 1)
        except (zlib.error, OverflowError, ValueError) as exc:
            raise CorruptDataError(f"zlib: {exc}") from exc
        if len(out) > raw_size:
            raise CorruptDataError(f"zlib: stream inflates past the expected {raw_size} bytes")
        if not dobj.eof or dobj.unused_data:
            raise CorruptDataError("zlib: stream is truncated or has trailing data")
        if len(out) != raw_size:
            raise size_mismatch(self.codec_id, len(out), raw_size)
        return out
