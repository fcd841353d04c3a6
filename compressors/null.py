"""Identity codec (id ``none``): stores bytes as they are."""

from __future__ import annotations

from typing import Any

from ._util import BytesLike, as_view, check_raw_size, size_mismatch
from .abc import Codec

__all__ = ["NullCodec"]


class NullCodec(Codec):
    """Store uncompressed; decode only checks the size."""

    codec_id = "none"

    def encode(self, buf: BytesLike) -> bytes:
        view = as_view(buf)
        return view if type(view) is bytes else bytes(view)

    def decode(self, buf: BytesLike, raw_size: int) -> bytes:
        raw_size = check_raw_size(raw_size)
        view = as_view(buf)
        if len(view) != raw_size:
            raise size_mismatch(self.codec_id, len(view), raw_size)
        return view if type(view) is bytes else bytes(view)

    def get_config(self) -> dict[str, Any]:
        return {"id": self.codec_id}

    @property
    def spec(self) -> str:
        return self.codec_id
