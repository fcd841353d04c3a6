"""The codec-spec grammar: one string names a codec and how a store applies it.

::

    SPEC := NAME[:ARG...][+dict][+solidNk]

* ``NAME[:ARG...]``: the codec, as :func:`~compressors.registry.parse_spec` builds it
  (``zstd:3``, ``lz4``, ``lz4hc:9``, ``blosc2:zstd:5:shuffle:4``, ``none``);
* ``+dict``: with a zstd dictionary trained per file kind of many small files (the packer
  trains them; only ``zstd:L`` takes one);
* ``+solidNk``: files of at most N KiB (N >= 1) are packed back to back into solid blocks of
  N KiB, each compressed as one chunk (not for a codec of whole files: ``jpegxl``).

The suffixes come in this order, each at most once. This is the one place the grammar is
parsed (:func:`parse_codec_spec`) and written (:attr:`CodecSpec.label`): every name the codec
selector reports and every codec ``fanstore info`` lists is such a string, and
``fanstore pack --codec`` takes it as it is.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from .abc import Codec
from .errors import BadConfigError, UnknownCodecError
from .registry import parse_spec
from .zstd import ZstdCodec

__all__ = ["DICT_SUFFIX", "GRAMMAR", "CodecSpec", "parse_codec_spec"]

DICT_SUFFIX = "+dict"
GRAMMAR = "NAME[:ARG...][+dict][+solidNk]"
_SOLID = re.compile(r"solid([0-9]+)k")


@dataclass(frozen=True)
class CodecSpec:
    """A parsed spec: the codec (without a dictionary), whether each kind of many small files
    gets a trained dictionary, and the solid block size in KiB (0: none)."""

    codec: Codec
    dictionary: bool = False
    solid_kb: int = 0

    def __post_init__(self) -> None:
        if self.dictionary and not _takes_dictionary(self.codec):
            raise BadConfigError(f"invalid codec spec {self.codec.spec + DICT_SUFFIX!r}: only "
                                 "zstd:L takes a trained dictionary")
        if not isinstance(self.solid_kb, int) or self.solid_kb < 0:
            raise BadConfigError(f"solid block size must be a whole number of KiB >= 0, got "
                                 f"{self.solid_kb!r}")
        if self.solid_kb and self.codec.declines:
            raise BadConfigError(f"invalid codec spec {self.codec.spec}+solid{self.solid_kb}k: "
                                 f"{self.codec.codec_id} takes whole files, not solid blocks")

    @property
    def label(self) -> str:
        """The canonical spec string (``zstd:19+dict+solid64k``): ``parse_codec_spec`` of it
        gives this spec back."""
        return (self.codec.spec + (DICT_SUFFIX if self.dictionary else "")
                + (f"+solid{self.solid_kb}k" if self.solid_kb else ""))

    def __str__(self) -> str:
        return self.label


def _takes_dictionary(codec: Codec) -> bool:
    return isinstance(codec, ZstdCodec) and codec.dict_data is None


def parse_codec_spec(text: str) -> CodecSpec:
    """Parse ``NAME[:ARG...][+dict][+solidNk]`` (see the module docstring).

    Raises :class:`BadConfigError` or :class:`UnknownCodecError` (both ``CodecError``) with
    a one-line message naming what is wrong.
    """
    if not isinstance(text, str) or not text:
        raise UnknownCodecError(f"empty or non-string codec spec {text!r}")
    base, *suffixes = text.split("+")
    dictionary, solid_kb = False, 0
    for suffix in suffixes:
        m = _SOLID.fullmatch(suffix)
        if suffix == DICT_SUFFIX[1:]:
            if dictionary or solid_kb:
                raise BadConfigError(f"invalid codec spec {text!r}: '+dict' comes once, before "
                                     f"'+solidNk' ({GRAMMAR})")
            dictionary = True
        elif m is not None:
            if solid_kb:
                raise BadConfigError(f"invalid codec spec {text!r}: '+solidNk' comes once "
                                     f"({GRAMMAR})")
            solid_kb = int(m.group(1))
            if solid_kb < 1:
                raise BadConfigError(f"invalid codec spec {text!r}: solid blocks need at least "
                                     "1 KiB (+solid1k)")
        else:
            raise BadConfigError(f"invalid codec spec {text!r}: unknown suffix {'+' + suffix!r} "
                                 f"({GRAMMAR})")
    codec = parse_spec(base)
    if dictionary and not _takes_dictionary(codec):
        raise BadConfigError(f"invalid codec spec {text!r}: only zstd:L takes a trained "
                             "dictionary")
    return CodecSpec(codec, dictionary, solid_kb)
