"""Codec registry: codec id -> :class:`Codec` subclass, plus config/spec parsing.

Built-in codecs are registered at import time (their libraries are imported
lazily, on first construction). Third-party codecs are discovered through the
``fanstore.codecs`` entry-point group the first time an unknown id is asked for::

    [project.entry-points."fanstore.codecs"]
    mycodec = "mypkg.codec:MyCodec"     # MyCodec.codec_id == "mycodec"
"""

from __future__ import annotations

import copy
import importlib.metadata
import json
from types import MappingProxyType
from typing import Any, Mapping, TypeVar

from .abc import Codec
from .blosc2 import Blosc2Codec
from .errors import BadConfigError, CodecError, CodecUnavailableError, UnknownCodecError
from .jpegxl import JpegXlCodec
from .lz4 import Lz4Codec, Lz4HCCodec
from .null import NullCodec
from .snappy import SnappyCodec
from .zlib import ZlibCodec
from .zstd import ZstdCodec

__all__ = ["CODECS", "ENTRY_POINT_GROUP", "register_codec", "get_codec", "parse_spec", "available"]

ENTRY_POINT_GROUP = "fanstore.codecs"
_REGISTRY: dict[str, type[Codec]] = {}
#: Read-only view of the registry: codec id -> codec class.
CODECS: Mapping[str, type[Codec]] = MappingProxyType(_REGISTRY)
_INSTANCES: dict[str, Codec] = {}  # canonical config JSON -> shared immutable instance
# Fast path for callers passing the same config object again (a dictionary config is
# ~150 kB of base64, too slow to serialise per call): id -> (config, snapshot, codec).
_BY_IDENTITY: dict[int, tuple[Mapping[str, Any], dict[str, Any], Codec]] = {}
_MAX_INSTANCES, _MAX_IDENTITIES = 1024, 64

T = TypeVar("T", bound=type[Codec])


def register_codec(cls: T) -> T:
    """Register a :class:`Codec` subclass under its ``codec_id`` (usable as a decorator)."""
    if not (isinstance(cls, type) and issubclass(cls, Codec)):
        raise BadConfigError(f"only Codec subclasses can be registered, got {cls!r}")
    codec_id = getattr(cls, "codec_id", None)
    if not isinstance(codec_id, str) or not codec_id or ":" in codec_id:
        raise BadConfigError(f"{cls.__name__}.codec_id must be a non-empty string without ':'")
    current = _REGISTRY.get(codec_id)
    if current is not None and current is not cls:
        raise BadConfigError(f"codec id {codec_id!r} is already registered by {current.__name__}")
    _REGISTRY[codec_id] = cls
    return cls


for _cls in (NullCodec, ZstdCodec, Lz4Codec, Lz4HCCodec, SnappyCodec, Blosc2Codec, ZlibCodec,
             JpegXlCodec):
    register_codec(_cls)


def _plugin_entry_points() -> list[importlib.metadata.EntryPoint]:
    try:
        return list(importlib.metadata.entry_points(group=ENTRY_POINT_GROUP))
    except Exception:  # a broken distribution must not break built-in codecs
        return []


def _lookup(codec_id: str) -> type[Codec]:
    """Return the class for ``codec_id``, loading an entry-point plugin if needed."""
    cls = _REGISTRY.get(codec_id)
    if cls is not None:
        return cls
    eps = _plugin_entry_points()
    for ep in eps:
        if ep.name == codec_id:
            try:
                loaded = ep.load()
            except Exception as exc:
                raise CodecUnavailableError(
                    f"codec plugin {codec_id!r} ({ep.value}) failed to load: {exc}") from exc
            is_codec = isinstance(loaded, type) and issubclass(loaded, Codec)
            if not is_codec or getattr(loaded, "codec_id", None) != codec_id:
                raise CodecUnavailableError(
                    f"codec plugin {codec_id!r} ({ep.value}) is not a Codec with that codec_id")
            return register_codec(loaded)
    known = list(_REGISTRY) + sorted({ep.name for ep in eps} - set(_REGISTRY))
    raise UnknownCodecError(f"unknown codec {codec_id!r} (known: {', '.join(known)})")


def get_codec(config: Mapping[str, Any]) -> Codec:
    """Return the (shared, immutable) codec described by a ``get_config()`` dict.

    Instances are cached by canonical JSON; passing the very same config object again
    is a ~0.3 us lookup. Hot paths should still keep the returned codec.
    """
    hit = _BY_IDENTITY.get(id(config))
    if hit is not None and hit[0] is config and hit[1] == config:
        return hit[2]
    if not isinstance(config, Mapping):
        raise BadConfigError(f"codec config must be a dict, got {type(config).__name__}")
    try:
        key = json.dumps(config, sort_keys=True, separators=(",", ":"))
    except (TypeError, ValueError) as exc:
        raise BadConfigError(f"codec config is not JSON-serialisable: {exc}") from exc
    codec = _INSTANCES.get(key)
    if codec is None:
        codec_id = config.get("id")
        if not isinstance(codec_id, str):
            raise BadConfigError(f"codec config needs a string 'id', got {config!r:.200}")
        codec = _lookup(codec_id).from_config(config)
        if len(_INSTANCES) >= _MAX_INSTANCES:
            _INSTANCES.clear()
        _INSTANCES[key] = codec
    if len(_BY_IDENTITY) >= _MAX_IDENTITIES:
        _BY_IDENTITY.clear()
    _BY_IDENTITY[id(config)] = (config, copy.deepcopy(dict(config)), codec)
    return codec


def parse_spec(spec: str) -> Codec:
    """Build a codec from a spec string such as ``'zstd:9'`` or ``'blosc2:lz4:5:shuffle:4'``."""
    if not isinstance(spec, str) or not spec:
        raise UnknownCodecError(f"empty or non-string codec spec {spec!r}")
    codec_id, *args = spec.split(":")
    cls = _lookup(codec_id)
    try:
        return cls.from_spec_args(args)
    except BadConfigError as exc:
        raise BadConfigError(f"invalid codec spec {spec!r}: {exc}") from exc


def available() -> list[str]:
    """Ids of the registered codecs whose optional libraries can be imported."""
    ids = []
    for codec_id, cls in list(_REGISTRY.items()):
        try:
            cls.check_available()
        except CodecError:
            continue
        ids.append(codec_id)
    return ids
