"""Where a store or a source lives, behind one :class:`Location`: a local directory or an
object-store prefix (``scheme://...``), chosen by a scheme registry held as data.

:func:`open_location` gives a :class:`Location` with the few operations FanStore needs:
read an object whole or a byte range of it, its size, list what lies under the location,
write an object, copy and remove objects. Schemes are :data:`KNOWN_SCHEMES`: the class to
use, the modules it needs and an install hint, imported on first use (the S3 backend,
:mod:`fanstore.storage.s3`, needs the optional extra ``fanstore[s3]``).
"""

from __future__ import annotations

import importlib
import os
import re
from types import MappingProxyType
from typing import Any

from fanstore.errors import StorageError, UsageError
from fanstore.storage.options import default_options

#: scheme -> how to open it. "modules" are imported before the class; "err" is the hint.
_KNOWN_SCHEMES: dict[str, dict[str, Any]] = {
    "s3": {
        "class": "fanstore.storage.s3.S3Location",
        "modules": ("s3fs",),
        "err": "S3 support needs s3fs: pip install 'fanstore[s3]' (or pip install s3fs)",
    },
}
KNOWN_SCHEMES = MappingProxyType(_KNOWN_SCHEMES)

_URL = re.compile(r"^([a-zA-Z][a-zA-Z0-9+.-]*)://")


def is_url(text: str | bytes | os.PathLike) -> bool:
    """True for ``scheme://...`` (an object-store location), False for a local path."""
    if isinstance(text, os.PathLike):
        return False
    if isinstance(text, bytes):
        text = os.fsdecode(text)
    return bool(_URL.match(text))


def scheme_of(url: str) -> str:
    m = _URL.match(url)
    return m.group(1).lower() if m else ""


def open_location(url: str, options: dict[str, Any] | None = None) -> Location:
    """A :class:`Location` for a local directory path or a ``scheme://`` URL."""
    url = os.fspath(url)
    if not is_url(url):
        return LocalLocation(url)
    scheme = scheme_of(url)
    if scheme == "file":
        return LocalLocation(url[len("file://"):])
    spec = _KNOWN_SCHEMES.get(scheme)
    if spec is None:
        known = ", ".join(f"{s}://" for s in sorted(_KNOWN_SCHEMES))
        raise UsageError(f"{url}: unknown storage scheme {scheme}:// (known: {known} and "
                         "local paths)")
    for mod in spec["modules"]:
        try:
            importlib.import_module(mod)
        except ImportError:
            raise StorageError(f"{url}: {spec['err']}") from None
    module, _, name = spec["class"].rpartition(".")
    cls = getattr(importlib.import_module(module), name)
    return cls(url, default_options() if options is None else options)


def split_parent(url: str) -> tuple[str, str]:
    """(parent location, last name) of a path or URL: ``s3://b/x/y`` -> (``s3://b/x``, ``y``)."""
    url = url.rstrip("/")
    parent, _, name = url.rpartition("/")
    return parent, name


class Location:
    """A directory-like place holding named objects (a local directory or an S3 prefix)."""

    url: str
    #: True when objects can be written in place and renamed (a local file system).
    local = False

    def show(self, name: str = "") -> str:
        """How users see ``name`` inside this location (a path or URL)."""
        return f"{self.url.rstrip('/')}/{name}" if name else self.url

    def read_bytes(self, name: str) -> bytes:
        raise NotImplementedError

    def read_range(self, name: str, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of object ``name``."""
        raise NotImplementedError

    def size(self, name: str) -> int | None:
        """Size of object ``name``, None if it does not exist."""
        raise NotImplementedError

    def list(self) -> dict[str, tuple[int, int]]:
        """Every object under this location: relative name -> (size, mtime in ns)."""
        raise NotImplementedError

    def open_write(self, name: str):
        """A writable binary file for ``name``: ``write``, ``close`` (the object appears
        only then) and ``abort`` (nothing appears)."""
        raise NotImplementedError

    def write_bytes(self, name: str, data: bytes) -> None:
        f = self.open_write(name)
        try:
            f.write(data)
        except BaseException:
            f.abort()
            raise
        f.close()

    def remove(self, names: list[str]) -> None:
        raise NotImplementedError

    def check(self) -> None:
        """Fail with one clear line if the location cannot be used at all (no bucket, ...)."""


# --------------------------------------------------------------------------- local


class LocalLocation(Location):
    local = True

    def __init__(self, path: str) -> None:
        self.path = os.fspath(path)
        self.url = self.path

    def _p(self, name: str) -> str:
        return os.path.join(self.path, name)

    def read_bytes(self, name: str) -> bytes:
        with open(self._p(name), "rb") as f:
            return f.read()

    def read_range(self, name: str, start: int, end: int) -> bytes:
        with open(self._p(name), "rb", buffering=0) as f:
            return os.pread(f.fileno(), end - start, start)

    def size(self, name: str) -> int | None:
        try:
            return os.stat(self._p(name)).st_size
        except FileNotFoundError:
            return None

    def list(self) -> dict[str, tuple[int, int]]:
        out = {}
        for top, _dirs, files in os.walk(self.path):
            for fn in files:
                p = os.path.join(top, fn)
                st = os.stat(p)
                out[os.path.relpath(p, self.path)] = (st.st_size, st.st_mtime_ns)
        return out

    def open_write(self, name: str):
        return _LocalWriter(self._p(name))

    def remove(self, names: list[str]) -> None:
        for n in names:
            try:
                os.unlink(self._p(n))
            except FileNotFoundError:
                pass


class _LocalWriter:
    def __init__(self, path: str) -> None:
        self.path = path
        self._f = open(path, "wb", buffering=4 << 20)  # noqa: SIM115 - closed by close/abort

    def write(self, data) -> int:
        return self._f.write(data)

    def fileno(self) -> int:
        return self._f.fileno()

    def close(self) -> None:
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()

    def abort(self) -> None:
        try:
            self._f.close()
        except OSError:
            pass
        finally:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
