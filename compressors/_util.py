"""Small helpers shared by the codec modules (not part of the public API)."""

from __future__ import annotations

import base64
import binascii
import importlib
import operator
import threading
from types import ModuleType
from typing import Any, Callable, Generic, Sequence, TypeVar, Union

from .errors import BadConfigError, CodecUnavailableError, CorruptDataError

#: Anything exposing the buffer protocol: bytes, bytearray, memoryview, numpy arrays, mmap...
BytesLike = Union[bytes, bytearray, memoryview, Any]

_MODULES: dict[str, ModuleType] = {}
T = TypeVar("T")


def require(module: str, pip_name: str) -> ModuleType:
    """Import an optional library once, or raise :class:`CodecUnavailableError` with a hint."""
    mod = _MODULES.get(module)
    if mod is None:
        try:
            mod = importlib.import_module(module)
        except ImportError as exc:
            raise CodecUnavailableError(
                f"{module.split('.')[0]} is not installed: pip install {pip_name}"
            ) from exc
        _MODULES[module] = mod
    return mod


def as_view(buf: BytesLike) -> bytes | memoryview:
    """Return ``buf`` as bytes or as a flat, C-contiguous memoryview of unsigned bytes."""
    if type(buf) is bytes:
        return buf
    view = memoryview(buf)
    if view.format == "B" and view.ndim == 1 and view.c_contiguous:
        return view
    if not view.c_contiguous:
        return view.tobytes()
    return view.cast("B")


def check_int(value: Any, what: str, lo: int, hi: int) -> int:
    """Validate an integer parameter lying in ``[lo, hi]`` (bools and floats are refused)."""
    try:
        number = operator.index(value) if not isinstance(value, bool) else None
    except TypeError:
        number = None
    if number is None or not lo <= number <= hi:
        raise BadConfigError(f"{what} must be {lo}-{hi}, got {value!r}")
    return int(number)


def parse_int(text: str, what: str, lo: int, hi: int) -> int:
    """Parse a decimal spec field and validate it with :func:`check_int`."""
    if not text.isascii() or not text.isdigit():
        raise BadConfigError(f"{what} must be an integer {lo}-{hi}, got {text!r}")
    return check_int(int(text), what, lo, hi)


def check_choice(value: Any, what: str, allowed: Sequence[str]) -> str:
    """Validate that ``value`` is one of the ``allowed`` strings."""
    if value not in allowed or not isinstance(value, str):
        raise BadConfigError(f"{what} must be one of {', '.join(allowed)}, got {value!r}")
    return value


def check_nargs(codec_id: str, args: Sequence[str], form: str, most: int) -> None:
    """Refuse a spec string with more than ``most`` fields after the codec id."""
    if len(args) > most:
        raise BadConfigError(f"{codec_id} takes at most {most} field(s) ({form}), got {len(args)}")


def check_raw_size(raw_size: Any) -> int:
    """Validate the caller supplied expected output size (any non-negative integer type)."""
    if type(raw_size) is int and raw_size >= 0:
        return raw_size
    try:
        size = -1 if isinstance(raw_size, bool) else operator.index(raw_size)
    except TypeError:
        size = -1
    if size < 0:
        raise CorruptDataError(f"raw_size must be a non-negative int, got {raw_size!r}")
    return size


def size_mismatch(codec_id: str, got: int, raw_size: int) -> CorruptDataError:
    """Build the error for a stream whose (claimed) size differs from ``raw_size``."""
    if got < 0:
        return CorruptDataError(f"{codec_id}: stream does not record its size, expected {raw_size}")
    return CorruptDataError(f"{codec_id}: stream holds {got} bytes, expected {raw_size}")


def b64_field(value: Any, what: str) -> bytes:
    """Decode a base64 config field, or raise :class:`BadConfigError`."""
    try:
        return base64.b64decode(value, validate=True)
    except (binascii.Error, TypeError, ValueError) as exc:
        raise BadConfigError(f"{what} must be a base64 string") from exc


class PerThread(Generic[T]):
    """One lazily built object per thread, for library contexts that are not thread-safe."""

    def __init__(self, factory: Callable[[], T]) -> None:
        self._factory = factory
        self._local = threading.local()

    def get(self) -> T:
        """This thread's object, built on first use."""
        try:
            return self._local.obj
        except AttributeError:
            obj = self._local.obj = self._factory()
            return obj
