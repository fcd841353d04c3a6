"""The abstract :class:`Codec` every compressor implements.

A codec is an immutable value object: its :meth:`Codec.get_config` dict fully
describes how to decode what it encoded, and equality, hashing, ``repr`` and
pickling are all derived from that config.
"""

from __future__ import annotations

import inspect
import json
from abc import ABC, abstractmethod
from typing import Any, ClassVar, Mapping, Sequence, TypeVar

from ._util import BytesLike, check_int, check_nargs, parse_int, require
from .errors import BadConfigError

__all__ = ["Codec", "LeveledCodec", "BytesLike"]

C = TypeVar("C", bound="Codec")


class Codec(ABC):
    """A lossless bytes-to-bytes compressor with bounded, size-checked decoding.

    Subclasses set :attr:`codec_id`, list their optional libraries in
    :attr:`requires` and implement :meth:`encode`, :meth:`decode`,
    :meth:`get_config` and :attr:`spec`. Instances are safe to share between
    threads.
    """

    #: Registry id, also the first field of the spec string (``"zstd"``).
    codec_id: ClassVar[str]
    #: ``(module, pip package)`` pairs of the optional libraries this codec imports.
    requires: ClassVar[tuple[tuple[str, str], ...]] = ()
    #: True for a codec that applies to some inputs only (``jpegxl``: a whole JPEG): its
    #: :meth:`encode` raises :class:`~compressors.errors.DeclinedError` for the others, which
    #: a store keeps as they are. Such a codec takes whole files, never solid blocks.
    declines: ClassVar[bool] = False

    _key: str | None = None

    @abstractmethod
    def encode(self, buf: BytesLike) -> bytes:
        """Compress any bytes-like object (bytes, bytearray, memoryview, ndarray...).

        A codec with :attr:`declines` raises :class:`~compressors.errors.DeclinedError` for
        an input it does not apply to; every other codec encodes any input.
        """

    @abstractmethod
    def decode(self, buf: BytesLike, raw_size: int) -> bytes:
        """Decompress ``buf`` into exactly ``raw_size`` bytes.

        Raises :class:`~compressors.errors.CorruptDataError` if the stream is
        damaged or would decode to any other size; never allocates or inflates
        beyond ``raw_size`` (plus a small constant).
        """

    @abstractmethod
    def get_config(self) -> dict[str, Any]:
        """JSON-serialisable dict with key ``'id'`` describing how to decode."""

    @property
    @abstractmethod
    def spec(self) -> str:
        """Short human spec string, e.g. ``'zstd:3'``, accepted by ``parse_spec``."""

    @classmethod
    def from_config(cls: type[C], config: Mapping[str, Any]) -> C:
        """Build a codec from :meth:`get_config` output (keys map to ``__init__`` args)."""
        params = dict(config)
        codec_id = params.pop("id", None)
        if codec_id != cls.codec_id:
            raise BadConfigError(f"config id {codec_id!r} does not match codec {cls.codec_id!r}")
        kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
        allowed = [p.name for p in inspect.signature(cls.__init__).parameters.values()
                   if p.kind in kinds and p.name != "self"]
        unknown = sorted(set(params) - set(allowed))
        if unknown:
            raise BadConfigError(
                f"{cls.codec_id} config has unknown keys {unknown} "
                f"(allowed: {', '.join(allowed) or 'none'})"
            )
        return cls(**params)

    @classmethod
    def from_spec_args(cls: type[C], args: Sequence[str]) -> C:
        """Build a codec from the ``:``-separated spec fields that follow the id."""
        if args:
            raise BadConfigError(f"{cls.codec_id} takes no parameters, got {':'.join(args)!r}")
        return cls()

    @classmethod
    def check_available(cls) -> None:
        """Import the optional libraries, raising ``CodecUnavailableError`` if one is missing."""
        for module, pip_name in cls.requires:
            require(module, pip_name)

    def _config_key(self) -> str:
        key = self._key
        if key is None:
            key = json.dumps(self.get_config(), sort_keys=True, separators=(",", ":"))
            object.__setattr__(self, "_key", key)
        return key

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Codec):
            return NotImplemented
        return type(self) is type(other) and self._config_key() == other._config_key()

    def __hash__(self) -> int:
        return hash(self._config_key())

    def __repr__(self) -> str:
        def short(value: Any) -> str:
            text = repr(value)
            return text if len(text) <= 40 else f"{text[:30]}...<{len(text)} chars>"

        fields = ", ".join(f"{k}={short(v)}" for k, v in self.get_config().items() if k != "id")
        return f"{type(self).__name__}({fields})"

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self).from_config, (self.get_config(),))


class LeveledCodec(Codec):
    """A codec whose only parameter is an integer level: spec ``<id>:<level>``."""

    #: Inclusive ``(lowest, highest)`` level, and the level used when none is given.
    levels: ClassVar[tuple[int, int]]
    default_level: ClassVar[int]

    def __init__(self, level: int | None = None) -> None:
        level = self.default_level if level is None else level
        self._level = check_int(level, f"{self.codec_id} level", *self.levels)

    @property
    def level(self) -> int:
        """The compression level."""
        return self._level

    def get_config(self) -> dict[str, Any]:
        return {"id": self.codec_id, "level": self._level}

    @classmethod
    def from_spec_args(cls: type[C], args: Sequence[str]) -> C:
        check_nargs(cls.codec_id, args, f"{cls.codec_id}:<level>", 1)
        return cls(parse_int(args[0], f"{cls.codec_id} level", *cls.levels)) if args else cls()

    @property
    def spec(self) -> str:
        return f"{self.codec_id}:{self._level}"
