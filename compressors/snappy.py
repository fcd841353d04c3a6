"""Snappy raw-block codec (id ``snappy``), via python-snappy and its cramjam backend."""

from __future__ import annotations

from typing import Any

from ._util import BytesLike, as_view, check_raw_size, require, size_mismatch
from .abc import Codec
from .errors import CodecError, CorruptDataError

__all__ = ["SnappyCodec"]

_LIBS = (("snappy", "python-snappy"), ("cramjam", "python-snappy"))
#: A snappy copy op is >= 3 bytes per <= 64 output bytes: no stream expands beyond ~21.4x.
_MAX_RATIO = 22


class SnappyCodec(Codec):
    """Raw snappy block (no framing); its varint length header is checked before decoding."""

    codec_id = "snappy"
    requires = _LIBS

    def __init__(self) -> None:
        self._snappy = require(*_LIBS[0])
        cramjam = require(*_LIBS[1])  # python-snappy 0.7 is a thin wrapper over cramjam
        self._raw = cramjam.snappy
        self._errors = (cramjam.CompressionError, cramjam.DecompressionError, ValueError)

    def encode(self, buf: BytesLike) -> bytes:
        try:
            return self._snappy.compress(as_view(buf))
        except self._errors as exc:
            raise CodecError(f"snappy: encode failed: {exc}") from exc

    def decode(self, buf: BytesLike, raw_size: int) -> bytes:
        raw_size = check_raw_size(raw_size)
        buf = as_view(buf)
        if raw_size > _MAX_RATIO * len(buf) + 32:
            raise CorruptDataError(f"snappy: {len(buf)} bytes cannot hold {raw_size}")
        try:
            claimed = self._raw.decompress_raw_len(buf)  # reads the varint header only
            if claimed != raw_size:
                raise size_mismatch(self.codec_id, claimed, raw_size)
            out = bytes(self._raw.decompress_raw(buf))
        except self._errors as exc:
            raise CorruptDataError(f"snappy: {exc}") from exc
        if len(out) != raw_size:
            raise size_mismatch(self.codec_id, len(out), raw_size)
        return out

    def get_config(self) -> dict[str, Any]:
        return {"id": self.codec_id}

    @property
    def spec(self) -> str:
        return self.codec_id
