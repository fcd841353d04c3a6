"""FanStore codec library: small, bounded, thread-safe compressors (numcodecs style).

Standalone: it does not import ``fanstore``. Typical use::

    from compressors import get_codec, parse_spec

    codec = parse_spec("zstd:3")                 # or "lz4", "blosc2:lz4:5:shuffle:4", ...
    blob = codec.encode(raw)
    config = codec.get_config()                  # JSON-serialisable, stored with the data
    raw2 = get_codec(config).decode(blob, len(raw))   # exactly len(raw) bytes or CorruptDataError

A store-level spec adds how the packer applies the codec (``compressors.spec``)::

    spec = parse_codec_spec("zstd:19+dict+solid64k")   # codec zstd:19, dictionary, 64 KiB
"""

from .abc import Codec
from .blosc2 import Blosc2Codec
from .errors import (
    BadConfigError,
    CodecError,
    CodecUnavailableError,
    CorruptDataError,
    DeclinedError,
    UnknownCodecError,
)
from .jpegxl import JpegXlCodec
from .lz4 import Lz4Codec, Lz4HCCodec
from .null import NullCodec
from .registry import CODECS, available, get_codec, parse_spec, register_codec
from .snappy import SnappyCodec
from .spec import CodecSpec, parse_codec_spec
from .zlib import ZlibCodec
from .zstd import ZstdCodec, train_dictionary

__all__ = [
    "Codec",
    "get_codec",
    "parse_spec",
    "CodecSpec",
    "parse_codec_spec",
    "register_codec",
    "available",
    "CODECS",
    "train_dictionary",
    "CodecError",
    "UnknownCodecError",
    "CodecUnavailableError",
    "CorruptDataError",
    "DeclinedError",
    "BadConfigError",
    "NullCodec",
    "ZstdCodec",
    "Lz4Codec",
    "Lz4HCCodec",
    "SnappyCodec",
    "Blosc2Codec",
    "ZlibCodec",
    "JpegXlCodec",
]
