"""Blosc2 chunk codec: ``blosc2:<codec>:<clevel>:<filter>:<typesize>``.

Always runs with ``nthreads=1`` so callers' own thread pools are not
oversubscribed. A blosc2 chunk holds at most ``MAX_BUFFER`` (~2 GB) bytes.
"""

from __future__ import annotations

from typing import Any, Sequence

from ._util import BytesLike, as_view, check_choice, check_int, check_nargs, check_raw_size
from ._util import parse_int, require, size_mismatch
from .abc import Codec
from .errors import BadConfigError, CodecError, CorruptDataError

__all__ = ["Blosc2Codec", "CODECS", "FILTERS", "MAX_BUFFER"]

_LIB = ("blosc2", "blosc2")
CODECS = ("blosclz", "lz4", "lz4hc", "zstd", "zlib")
FILTERS = ("noshuffle", "shuffle", "bitshuffle")
_FILTER_ENUM = {"noshuffle": "NOFILTER", "shuffle": "SHUFFLE", "bitshuffle": "BITSHUFFLE"}
MAX_BUFFER = 2147483615  # blosc2.MAX_BUFFERSIZE: largest chunk payload
_DEFAULTS = ("zstd", 5, "shuffle", 1)
_FORM = "blosc2:<codec>:<clevel>:<filter>:<typesize>"


#: What :meth:`Blosc2Codec.encode` writes, all a chunk may use (README_CHUNK_FORMAT of
#: c-blosc2): compressor formats 0 blosclz, 1 lz4/lz4hc, 3 zlib, 4 zstd; filters 0 none,
#: 1 shuffle, 2 bitshuffle; special values 0 none, 1 zeros, 2 NaNs, 3 a repeated value.
_FORMATS, _FILTER_CODES, _SPECIALS = frozenset((0, 1, 3, 4)), frozenset((0, 1, 2)), (0, 1, 2, 3)
#: flags: bits 0 and 2 both set mark the 32-byte extended header; bit 3 is delta.
_EXTENDED, _DELTA = 0x05, 0x08


def _check_header(buf) -> None:
    """Refuse a chunk whose header uses what this codec never writes, before c-blosc2
    acts on it: the fuzzer (tests/test_fuzz_codecs.py) made c-blosc2 2.x segfault on a
    32-byte chunk with flags 0x5d (the reserved compressor format 2, delta) and filter code
    0x80 (a user-defined filter that is not registered). Refused: a header without the
    extended part, another compressor format (reserved, user-defined, super-chunk), the
    delta flag, a filter code other than none/shuffle/bitshuffle, any blosc2 flag (a
    dictionary, a longer header, a codec byte elsewhere, a lazy chunk that reads from a
    file, instrumentation) but the special values, and 'uninitialised' special chunks."""
    if len(buf) < 32 or buf[2] & _EXTENDED != _EXTENDED:
        raise CorruptDataError("blosc2: not an extended-header chunk")
    flags, b2flags = buf[2], buf[31]
    if flags >> 5 not in _FORMATS or flags & _DELTA:
        raise CorruptDataError(f"blosc2: flags {flags:#04x} name what this codec never writes")
    if any(code not in _FILTER_CODES for code in bytes(buf[16:22])):
        raise CorruptDataError(f"blosc2: filter codes {bytes(buf[16:22]).hex()} refused")
    if b2flags & 0x8F:
        raise CorruptDataError(f"blosc2: chunk flags {b2flags:#04x} refused")
    if (b2flags >> 4) & 7 not in _SPECIALS:
        raise CorruptDataError(f"blosc2: special value {(b2flags >> 4) & 7} refused "
                               "(4 is 'uninitialised', 5-7 are reserved)")


class Blosc2Codec(Codec):
    """One blosc2 chunk; decode checks the header's sizes before allocating anything."""

    codec_id = "blosc2"
    requires = (_LIB,)

    def __init__(self, codec: str = "zstd", clevel: int = 5, filter: str = "shuffle",
                 typesize: int = 1) -> None:
        self._codec = check_choice(codec, "blosc2 codec", CODECS)
        self._clevel = check_int(clevel, "blosc2 clevel", 0, 9)
        self._filter = check_choice(filter, "blosc2 filter", FILTERS)
        self._typesize = check_int(typesize, "blosc2 typesize", 1, 255)
        self._b2 = b2 = require(*_LIB)
        self._cparams = {
            "codec": b2.Codec[codec.upper()], "clevel": self._clevel, "typesize": self._typesize,
            "filters": [0] * 5 + [b2.Filter[_FILTER_ENUM[filter]]], "filters_meta": [0] * 6,
            "splitmode": b2.SplitMode.AUTO_SPLIT, "blocksize": 0, "nthreads": 1}

    def encode(self, buf: BytesLike) -> bytes:
        view = as_view(buf)
        if len(view) > MAX_BUFFER:
            raise BadConfigError(f"blosc2 cannot compress more than {MAX_BUFFER} bytes in one "
                                 f"buffer, got {len(view)}; use zstd or lz4 for this object")
        try:
            return self._b2.compress2(view, **self._cparams)
        except (RuntimeError, ValueError) as exc:
            raise CodecError(f"blosc2: encode failed: {exc}") from exc

    def decode(self, buf: BytesLike, raw_size: int) -> bytes:
        raw_size = check_raw_size(raw_size)
        buf, b2 = as_view(buf), self._b2
        try:
            nbytes, cbytes, _ = b2.get_cbuffer_sizes(buf)  # header only; ValueError if < 16 B
            if nbytes != raw_size:
                raise size_mismatch(self.codec_id, nbytes, raw_size)
            if cbytes != len(buf):
                raise CorruptDataError(f"blosc2: header claims {cbytes} compressed bytes, "
                                       f"got {len(buf)}")
            _check_header(buf)
            out = b2.decompress2(buf, nthreads=1)
        except (RuntimeError, ValueError) as exc:
            raise CorruptDataError(f"blosc2: {exc}") from exc
        if out is None or len(out) != raw_size:
            raise size_mismatch(self.codec_id, 0 if out is None else len(out), raw_size)
        return out

    def get_config(self) -> dict[str, Any]:
        return {"id": self.codec_id, "codec": self._codec, "clevel": self._clevel,
                "filter": self._filter, "typesize": self._typesize}

    @classmethod
    def from_spec_args(cls, args: Sequence[str]) -> "Blosc2Codec":
        """Missing trailing fields take the defaults of ``blosc2:zstd:5:shuffle:1``."""
        check_nargs(cls.codec_id, args, _FORM, 4)
        codec, clevel, filter_, typesize = list(args) + list(_DEFAULTS[len(args):])
        if isinstance(clevel, str):
            clevel = parse_int(clevel, "blosc2 clevel", 0, 9)
        if isinstance(typesize, str):
            typesize = parse_int(typesize, "blosc2 typesize", 1, 255)
        return cls(codec, clevel, filter_, typesize)

    @property
    def spec(self) -> str:
        return f"blosc2:{self._codec}:{self._clevel}:{self._filter}:{self._typesize}"
