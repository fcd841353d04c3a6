"""What ``fanstore pack`` can read: a directory, tar archives, a zip archive, an S3 prefix.

The kinds are a registry held as data (:data:`KNOWN_SOURCES`): the class, the modules it
needs and an install hint, imported on first use. :func:`detect` looks at SRC (a URL's
scheme, a directory, an archive's magic bytes, a brace pattern or a list file of tar
shards) and :func:`open_source` opens it.

A directory is packed by the planned path (``scan_tree``, ``plan_partitions``, worker
processes: ``fanstore.pack.write``, ``.worker``); every other kind is a streaming source
(``fanstore.pack.stream``): read once, in its own order.
"""

from __future__ import annotations

import importlib
import os
import re
from types import MappingProxyType
from typing import Any

from fanstore.errors import PackError, UsageError
from fanstore.storage import is_url, scheme_of

_KNOWN_SOURCES: dict[str, dict[str, Any]] = {
    "directory": {"class": "fanstore.pack.sources.DirectorySource", "modules": ()},
    "tar": {"class": "fanstore.pack.sources.tar.TarSource", "modules": ()},
    "zip": {"class": "fanstore.pack.sources.zipsrc.ZipSource", "modules": ()},
    "s3": {
        "class": "fanstore.pack.sources.s3.S3Source",
        "modules": ("s3fs",),
        "err": "packing from S3 needs s3fs: pip install 'fanstore[s3]' (or pip install s3fs)",
    },
}
KNOWN_SOURCES = MappingProxyType(_KNOWN_SOURCES)

_RANGE = re.compile(r"\{(\d+)\.\.(\d+)\}")
_LIST = re.compile(r"\{([^{}]*,[^{}]*)\}")
#: A list file is read only when it is small (a list of shards, not an archive).
_MAX_LIST = 4 << 20


class DirectorySource:
    """A directory tree: packed by the planned path (``fanstore.pack.write.pack``)."""

    what = "directory"

    def __init__(self, path: str) -> None:
        self.url = path


def expand_braces(pattern: str) -> list[str]:
    """``shards-{000..099}.tar`` (zero-padded as written) and ``{a,b}``, as webdataset and
    the shell spell shard lists; several braces multiply."""
    found = [m for m in (_RANGE.search(pattern), _LIST.search(pattern)) if m]
    if not found:
        return [pattern]
    m = min(found, key=lambda x: x.start())  # the leftmost brace varies slowest (as sh)
    if m.re is _RANGE:
        a, b = m.group(1), m.group(2)
        width = len(a) if a.startswith("0") or len(a) == len(b) else 0
        lo, hi = int(a), int(b)
        step = 1 if hi >= lo else -1
        items = [str(k).zfill(width) for k in range(lo, hi + step, step)]
    else:
        items = m.group(1).split(",")
    out = []
    for item in items:
        out += expand_braces(pattern[:m.start()] + item + pattern[m.end():])
    return out


def _sniff(path: str) -> str | None:
    from fanstore.pack.sources import tarstream, zipsrc

    if zipsrc.sniff(path):
        return "zip"
    if tarstream.sniff(path):
        return "tar"
    return None


def _list_file(path: str) -> list[str] | None:
    """The archives named by a list file (one per line, relative to the list's directory;
    blank lines and '#' comments skipped), or None if ``path`` is not one."""
    try:
        if os.path.getsize(path) > _MAX_LIST:
            return None
        with open(path, "rb") as f:
            data = f.read()
    except OSError:
        return None
    if b"\0" in data:
        return None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return None
    base = os.path.dirname(os.path.abspath(path))
    names = [ln.strip() for ln in text.splitlines()]
    names = [n for n in names if n and not n.startswith("#")]
    if not names:
        return None
    paths = [n if os.path.isabs(n) else os.path.join(base, n) for n in names]
    if not any(os.path.isfile(p) for p in paths):
        return None  # text that names no file: not a list of shards
    return paths


def detect(src: str) -> tuple[str, list[str]]:
    """(kind, paths) of SRC: kind is a key of KNOWN_SOURCES; paths are the archives for
    "tar" (one or more shards), else [SRC]. Raises UsageError for what is none of these."""
    if is_url(src):
        scheme = scheme_of(src)
        if scheme not in _KNOWN_SOURCES:
            raise UsageError(f"source {src}: unknown scheme {scheme}:// (known: s3://)")
        return scheme, [src]
    if ("{" in src and "}" in src) and not os.path.exists(src):
        paths = expand_braces(src)
        missing = [p for p in paths if not os.path.exists(p)]
        if missing:
            raise UsageError(f"source {src}: {len(missing)} of {len(paths)} shards do not "
                             f"exist (first: {missing[0]})")
        return "tar", _check_shards(src, paths)
    if not os.path.exists(src):
        raise UsageError(f"source {src} does not exist")
    if os.path.isdir(src):
        return "directory", [src]
    if not os.path.isfile(src):
        raise UsageError(f"source {src} is not a directory, an archive or a list of archives")
    kind = _sniff(src)
    if kind:
        return kind, [src]
    listed = _list_file(src)
    if listed is not None:
        missing = [p for p in listed if not os.path.isfile(p)]
        if missing:
            raise UsageError(f"source {src}: taken as a list of {len(listed)} tar shards, but "
                             f"{missing[0]} does not exist")
        return "tar", _check_shards(src, listed)
    raise UsageError(f"source {src} is not a directory, a tar or zip archive (plain, gzip, "
                     "bzip2, xz or zstd), a list of tar shards or an s3:// prefix")


def _check_shards(src: str, paths: list[str]) -> list[str]:
    for p in paths:
        if _sniff(p) != "tar":
            raise UsageError(f"source {src}: shard {p} is not a tar archive (plain, gzip, "
                             "bzip2, xz or zstd)")
    return paths


def open_source(src: str, streams: int = 8):
    """The source object for SRC (see :func:`detect`)."""
    kind, paths = detect(src)
    spec = _KNOWN_SOURCES[kind]
    for mod in spec["modules"]:
        try:
            importlib.import_module(mod)
        except ImportError:
            raise PackError(f"source {src}: {spec['err']}") from None
    module, _, name = spec["class"].rpartition(".")
    cls = getattr(importlib.import_module(module), name)
    if kind == "tar":
        return cls(paths, label=src)
    if kind == "s3":
        return cls(src, streams=streams)
    return cls(src)


__all__ = ["DirectorySource", "KNOWN_SOURCES", "detect", "expand_braces", "open_source"]
