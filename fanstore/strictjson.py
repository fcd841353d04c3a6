"""Frozen dataclasses to JSON and back, strictly: the one encoding of what FanStore's
processes tell each other (the mount spec and what travels with it: docs/architecture.md,
"One mount spec").

:func:`to_json` writes an object with exactly the dataclass's fields (tuples as lists, a
nested dataclass as an object). :func:`from_json` reads one back and accepts nothing else:
the keys must be exactly the fields (an unknown key and a missing one are errors, whatever
the defaults say), and every value must be of its field's annotated type. A dataclass
calls :func:`typed` in its ``__post_init__``, so the same type check holds for an object
built in Python (where a list is taken for a tuple and a whole number for a float).

Every failure is one :class:`~fanstore.errors.SpecError` line naming the class and the
key. The annotations understood: ``str``, ``int`` (not ``bool``), ``float`` (a whole
number too), ``bool``, ``None``, unions of those (``int | str``, ``str | None``),
``tuple[T, ...]``, ``tuple[T1, T2]`` and nested dataclasses.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from typing import Any, TypeVar

from fanstore.errors import SpecError

__all__ = ["from_json", "to_json", "typed"]

T = TypeVar("T")


def to_json(obj: Any) -> bytes:
    """The JSON of the dataclass instance ``obj``: one object, its fields as keys."""
    if not dataclasses.is_dataclass(obj) or isinstance(obj, type):
        raise TypeError(f"to_json takes a dataclass instance, not {type(obj).__name__}")
    return json.dumps(dataclasses.asdict(obj), allow_nan=False,
                      separators=(",", ":")).encode()


def from_json(cls: type[T], data: bytes | str) -> T:
    """An instance of the dataclass ``cls`` from its JSON (one SpecError line if the JSON is
    not exactly one)."""
    try:
        obj = json.loads(data)
    except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
        obj = None
    if not isinstance(obj, dict):
        raise SpecError(f"{cls.__name__}: not a JSON object")
    return _from_dict(cls, obj)


def typed(obj: Any) -> None:
    """Check the type of every field of the dataclass instance ``obj`` against its
    annotation (SpecError naming the first bad one); lists become tuples and whole numbers
    floats where the annotation says so. Called from ``__post_init__``: frozen instances
    are normalised in place, before anything else sees them."""
    cls = type(obj)
    hints = _hints(cls)
    for f in dataclasses.fields(cls):
        value = getattr(obj, f.name)
        try:
            good = _convert(hints[f.name], value)
        except _Mismatch:
            raise SpecError(f"{cls.__name__}: {f.name!r} must be {_describe(hints[f.name])}, "
                            f"not {_show(value)}") from None
        if good is not value:
            object.__setattr__(obj, f.name, good)


# --------------------------------------------------------------------------- internals

class _Mismatch(Exception):
    """A value is not of its annotated type (turned into a SpecError by the caller)."""


def _from_dict(cls: type[T], obj: dict) -> T:
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = [k for k in obj if k not in names]
    if unknown:
        raise SpecError(f"{cls.__name__}: unknown key {unknown[0]!r}")
    missing = [n for n in names if n not in obj]
    if missing:
        raise SpecError(f"{cls.__name__}: missing key {missing[0]!r}")
    return cls(**obj)  # its __post_init__ calls typed(): the values' types are checked there


_HINTS: dict[type, dict[str, Any]] = {}


def _hints(cls: type) -> dict[str, Any]:
    hints = _HINTS.get(cls)
    if hints is None:
        hints = _HINTS[cls] = typing.get_type_hints(cls)
    return hints


def _convert(hint: Any, value: Any) -> Any:
    """``value`` as the annotation ``hint`` has it (a tuple for a list, a float for a whole
    number, a dataclass for an object); _Mismatch if it cannot be one."""
    origin = typing.get_origin(hint)
    if origin is typing.Union or origin is types.UnionType:
        for arg in typing.get_args(hint):
            try:
                return _convert(arg, value)
            except _Mismatch:
                continue
        raise _Mismatch
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise _Mismatch
        args = typing.get_args(hint)
        if len(args) == 2 and args[1] is Ellipsis:
            out = tuple(_convert(args[0], v) for v in value)
        elif len(args) == len(value):
            out = tuple(_convert(a, v) for a, v in zip(args, value))
        else:
            raise _Mismatch
        return value if isinstance(value, tuple) and all(
            a is b for a, b in zip(out, value)) else out
    if dataclasses.is_dataclass(hint):
        if isinstance(value, hint):
            return value
        if isinstance(value, dict):
            return _from_dict(hint, value)
        raise _Mismatch
    if hint is type(None) or hint is None:
        if value is None:
            return None
        raise _Mismatch
    if hint is bool:
        if isinstance(value, bool):
            return value
        raise _Mismatch
    if hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise _Mismatch
    if hint is float:
        if isinstance(value, float):
            return value
        if isinstance(value, int) and not isinstance(value, bool):
            return float(value)
        raise _Mismatch
    if hint is str:
        if isinstance(value, str):
            return value
        raise _Mismatch
    raise TypeError(f"strictjson does not handle the annotation {hint!r}")


def _describe(hint: Any) -> str:
    origin = typing.get_origin(hint)
    if origin is typing.Union or origin is types.UnionType:
        return " or ".join(_describe(a) for a in typing.get_args(hint))
    if origin is tuple:
        args = typing.get_args(hint)
        if len(args) == 2 and args[1] is Ellipsis:
            return f"a list of ({_describe(args[0])})"
        return f"a list of {len(args)} ({', '.join(_describe(a) for a in args)})"
    if dataclasses.is_dataclass(hint):
        return f"an object ({hint.__name__})"
    return {type(None): "null", bool: "true or false", int: "a whole number",
            float: "a number", str: "a string"}.get(hint, repr(hint))


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
