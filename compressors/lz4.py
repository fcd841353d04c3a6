"""LZ4 raw block codecs: ``lz4`` (default mode) and ``lz4hc:<level>`` (levels 1-12).

Blocks are stored without the 4-byte size prefix (``store_size=False``): the
caller always knows the raw size, and decoding into exactly that many bytes is
what bounds the output.
"""

from __future__ import annotations

from typing import Any

from ._util import BytesLike, as_view, check_raw_size, require, size_mismatch
from .abc import Codec, LeveledCodec
from .errors import CodecError, CorruptDataError

__all__ = ["Lz4Codec", "Lz4HCCodec"]

_LIB = ("lz4.block", "lz4")
#: LZ4 cannot expand more than ~255x; refuse larger claims before allocating.
_MAX_RATIO = 256


class Lz4Codec(Codec):
    """LZ4 block, fast default mode."""

    codec_id = "lz4"
    requires = (_LIB,)

    def __init__(self) -> None:
        self._lz4 = require(*_LIB)
        self._kwargs: dict[str, Any] = {"mode": "default", "store_size": False}

    def encode(self, buf: BytesLike) -> bytes:
        try:
            return self._lz4.compress(as_view(buf), **self._kwargs)
        except (self._lz4.LZ4BlockError, ValueError, OverflowError) as exc:
            raise CodecError(f"{self.codec_id}: encode failed: {exc}") from exc

    def decode(self, buf: BytesLike, raw_size: int) -> bytes:
        raw_size = check_raw_size(raw_size)
        buf = as_view(buf)
        if raw_size > _MAX_RATIO * len(buf) + 64:
            raise CorruptDataError(f"{self.codec_id}: {len(buf)} bytes cannot hold {raw_size}")
        if raw_size == 0:  # lz4 refuses a zero-sized output buffer
            if buf != b"\x00":
                raise CorruptDataError(f"{self.codec_id}: bad encoding of empty input")
            return b""
        try:
            out = self._lz4.decompress(buf, uncompressed_size=raw_size)
        except (self._lz4.LZ4BlockError, ValueError) as exc:
            raise CorruptDataError(f"{self.codec_id}: {exc}") from exc
        if len(out) != raw_size:
            raise size_mismatch(self.codec_id, len(out), raw_size)
        return out

    def get_config(self) -> dict[str, Any]:
        return {"id": self.codec_id}

    @property
    def spec(self) -> str:
        return self.codec_id


class Lz4HCCodec(LeveledCodec, Lz4Codec):
    """LZ4 block, high-compression mode (same decoder as ``lz4``)."""

    codec_id = "lz4hc"
    levels = (1, 12)
    default_level = 9

    def __init__(self, level: int | None = None) -> None:
        LeveledCodec.__init__(self, level)
        Lz4Codec.__init__(self)
        self._kwargs = {"mode": "high_compression", "compression": self._level,
                        "store_size": False}
