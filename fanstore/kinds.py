"""File kinds: the unit of stratified sampling (select) and of per-kind codec choice (pack).

A kind is ``"<ext>/<band>"``: the lower-cased extension (``noext`` if none) and a size band.
Pure and stable: the pack step and the selector must agree on it, and a per-kind choice
recorded in a store's metadata is keyed by these strings.
"""

from __future__ import annotations

import os

#: (upper bound exclusive, band name); the last band is open-ended.
SIZE_BANDS: tuple[tuple[int, str], ...] = (
    (4 << 10, "tiny"),  # < 4 KiB
    (64 << 10, "small"),  # < 64 KiB
    (1 << 20, "medium"),  # < 1 MiB
    (64 << 20, "large"),  # < 64 MiB
)
LAST_BAND = "huge"


def size_band(size: int) -> str:
    for bound, name in SIZE_BANDS:
        if size < bound:
            return name
    return LAST_BAND


def extension(relpath: str) -> str:
    base = os.path.basename(relpath)
    dot = base.rfind(".")
    if dot <= 0 or dot == len(base) - 1:
        return "noext"
    ext = base[dot + 1 :].lower()
    # Keep kinds readable and bounded: odd "extensions" (numbers, long junk) are one kind.
    if len(ext) > 10 or not ext.isalnum() or ext.isdigit():
        return "other"
    return ext


def file_kind(relpath: str, size: int) -> str:
    """Kind of a file: ``"npy/medium"``, ``"jpg/small"``, ``"noext/tiny"``."""
    return f"{extension(relpath)}/{size_band(size)}"


#: Extensions of formats read at random offsets (memory-mapped or paged): LMDB, HDF5 and
#: netCDF-4, numpy arrays, SQLite.
RANDOM_ACCESS_EXTENSIONS = frozenset({"mdb", "lmdb", "h5", "hdf5", "he5", "nc", "nc4", "npy",
                                      "sqlite", "sqlite3", "db"})


def access_pattern(kind: str) -> str:
    """How a kind's files are read, as the selector assumes: ``"whole"`` (a file within
    one chunk, read at once), ``"random"`` (a large file of a random-access format: pages
    read at random offsets), ``"sequential"`` (any other large file)."""
    ext, _, band = kind.partition("/")
    if band not in ("large", LAST_BAND):
        return "whole"
    return "random" if ext in RANDOM_ACCESS_EXTENSIONS else "sequential"
