"""Zstandard codec (``zstd:<level>``, levels 1-19) with an optional trained dictionary."""

from __future__ import annotations

import base64
from typing import Any, Mapping

from ._util import BytesLike, PerThread, as_view, b64_field, check_int, check_raw_size
from ._util import require, size_mismatch
from .abc import LeveledCodec
from .errors import BadConfigError, CodecError, CorruptDataError

__all__ = ["ZstdCodec", "train_dictionary"]

_LIB = ("zstandard", "zstandard")


class ZstdCodec(LeveledCodec):
    """One zstd frame with content size and no checksum; per-thread zstd contexts."""

    codec_id = "zstd"
    requires = (_LIB,)
    levels = (1, 19)
    default_level = 3

    def __init__(self, level: int | None = None, dict_data: BytesLike | None = None) -> None:
        super().__init__(level)
        self._zstd = zstd = require(*_LIB)
        self._dict = None if dict_data is None else bytes(as_view(dict_data))
        if self._dict == b"":
            raise BadConfigError("zstd dictionary must not be empty")
        self._dict_id = self._dict and zstd.ZstdCompressionDict(self._dict).dict_id()
        # zstd contexts must not be used by two threads at once: one of each per thread.
        self._cctx = PerThread(lambda: zstd.ZstdCompressor(
            level=self._level, write_checksum=False, write_content_size=True))
        #: with a dictionary: per thread, a context per input size class (see _dict_cctx)
        self._dict_cctxs: PerThread[dict[int, Any]] = PerThread(dict)
        self._dctx = PerThread(lambda: zstd.ZstdDecompressor(dict_data=self._zdict()))

    dict_data = property(lambda self: self._dict, doc="Dictionary bytes or None.")
    dict_id = property(lambda self: self._dict_id, doc="zstd dictionary id or None.")

    def _zdict(self) -> Any:
        return self._dict and self._zstd.ZstdCompressionDict(self._dict)

    def encode(self, buf: BytesLike) -> bytes:
        view = as_view(buf)
        try:
            if self._dict is None:
                return self._cctx.get().compress(view)
            return self._dict_cctx(len(view)).compress(view)
        except self._zstd.ZstdError as exc:
            raise CodecError(f"zstd: encode failed: {exc}") from exc

    def _dict_cctx(self, size: int) -> Any:
        """This thread's context for inputs of about ``size`` bytes, with the dictionary
        digested for them.

        Without a dictionary zstd picks its parameters (window, search depth, minimum
        match) for the input's size by itself. A dictionary is digested once, with the
        parameters of the level for an input of unknown size, and a small input then
        searches it with those: at zstd:13 on 32 KiB blocks of small text files with 110 KB
        dictionaries that stored 40.90 MB where zstd's own parameters for 32 KiB store
        39.53 MB (btopt with a minimum match of 4 instead of 5, for 22% more CPU). So the dictionary is digested per size class
        (the next power of two, 4 KiB at least) with the level's parameters for that
        size, as zstd would choose them. The frame leaves out the dictionary's id (4
        bytes a chunk: the codec's config names the dictionary); what the decoder needs is
        unchanged."""
        size_class = max(4096, 1 << max(0, size - 1).bit_length())
        cctxs = self._dict_cctxs.get()
        cctx = cctxs.get(size_class)
        if cctx is None:
            zstd = self._zstd
            params = zstd.ZstdCompressionParameters.from_level(
                self._level, source_size=size_class, dict_size=len(self._dict),
                write_checksum=False, write_content_size=True, write_dict_id=False)
            digested = zstd.ZstdCompressionDict(self._dict)
            digested.precompute_compress(compression_params=params)
            cctx = cctxs[size_class] = zstd.ZstdCompressor(dict_data=digested,
                                                           compression_params=params)
        return cctx

    def decode(self, buf: BytesLike, raw_size: int) -> bytes:
        raw_size, buf, zstd = check_raw_size(raw_size), as_view(buf), self._zstd
        try:
            # Bound the output before allocating: encode() always records the content
            # size, so a frame without one (-1) or with another size is refused.
            claimed = zstd.frame_content_size(buf)  # parses the frame header only
            if claimed != raw_size:
                raise size_mismatch(self.codec_id, claimed, raw_size)
            out = self._dctx.get().decompress(buf, allow_extra_data=False)
        except zstd.ZstdError as exc:
            raise CorruptDataError(f"zstd: {exc}") from exc
        if len(out) != raw_size:
            raise size_mismatch(self.codec_id, len(out), raw_size)
        return out

    def get_config(self) -> dict[str, Any]:
        config = super().get_config()
        if self._dict is not None:
            config.update(dict=base64.b64encode(self._dict).decode(), dict_id=self._dict_id)
        return config

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> "ZstdCodec":
        params = dict(config)
        dict_id = params.pop("dict_id", None)
        if "dict" in params:
            params["dict_data"] = b64_field(params.pop("dict"), "zstd config 'dict'")
        codec = super().from_config(params)
        if codec.dict_id != dict_id:
            raise BadConfigError(f"zstd config dict_id {dict_id!r} != dictionary's {codec.dict_id}")
        return codec

    @property
    def spec(self) -> str:
        """``zstd:<level>``; ``+dict`` marks a dictionary (``parse_spec`` refuses it: the
        bytes are in the config; ``parse_codec_spec`` reads it as "trained per kind")."""
        return super().spec + ("+dict" if self._dict is not None else "")


def train_dictionary(samples: list[bytes], size: int = 112640) -> bytes:
    """Train a zstd dictionary of at most ``size`` bytes from sample objects."""
    zstd, data = require(*_LIB), [bytes(as_view(s)) for s in samples]
    size = check_int(size, "zstd dictionary size", 256, 1 << 30)
    try:
        return zstd.train_dictionary(size, data).as_bytes()
    except zstd.ZstdError as exc:
        raise BadConfigError(f"zstd dictionary training failed ({len(data)} samples, "
                             f"size {size}): {exc}") from exc
