"""Exception hierarchy of the codec library.

Every failure of a codec - a bad configuration, a missing optional library, a
corrupt or hostile compressed stream - surfaces as a :class:`CodecError`.
Library specific exceptions (``zstandard.ZstdError``, ``lz4.block.LZ4BlockError``,
``zlib.error``, ...) are chained as ``__cause__``.
"""

from __future__ import annotations

__all__ = [
    "CodecError",
    "UnknownCodecError",
    "CodecUnavailableError",
    "CorruptDataError",
    "BadConfigError",
    "DeclinedError",
]


class CodecError(Exception):
    """Base class of every error raised by the codec library."""


class UnknownCodecError(CodecError, ValueError):
    """The codec id is not registered, or a spec string cannot be parsed."""


class CodecUnavailableError(CodecError):
    """The optional library a codec needs is not installed (message has the pip hint)."""


class CorruptDataError(CodecError):
    """Decoding failed, or would produce a size other than the expected raw size."""


class BadConfigError(CodecError, ValueError):
    """A codec parameter (level, filter, typesize, ...) is invalid."""


class DeclinedError(CodecError):
    """The codec does not apply to this input (``jpegxl`` given bytes that are not a whole
    JPEG it transcodes byte-exactly). Nothing is wrong with the data: a store keeps such an
    input as it is (codec ``none``), as it keeps any input a codec does not shrink."""
