"""Trained zstd dictionaries: which files train a kind's dictionary, and the training.

Everything that trains a dictionary trains it here, from the same files: ``fanstore
select`` (its ``+dict`` candidates, measured on the sample and packed into every trial
store), ``fanstore pack --codec zstd:L+dict`` (the command a report ends with) and the
quick selection of the default pack. A kind's dictionary is a function of the source's
listing, the kind and the seed only (never of ``--sample-mb``, the budget or a clock), so
the store packed from a report's command holds the very dictionaries the selection
measured, byte for byte:

* **which kinds**: kinds of many small files (band ``tiny`` or ``small``, at least
  :data:`DICT_MIN_FILES` files);
* **which files**: the kind's non-empty files in a random order seeded by
  ``(seed, crc32(kind))``, taken until the kind's share of ``train_bytes`` (its bytes over
  those of every eligible kind, at least :data:`MIN_KIND_TRAIN_BYTES`), each file up to
  one chunk (:func:`training_files`, a function of the listing alone: nothing is read to
  choose);
* **the dictionary**: zstd's trainer (deterministic) on those files in that order, a tenth
  of their bytes in size, 4 KiB to zstd's default 110 KiB (:func:`train_kind_dictionary`).

The sample (:mod:`.sample`) measures such a kind on its other files when at least
:data:`DICT_MIN_FILES` are left: a dictionary measured on its own training files would
flatter itself. A kind with fewer files left is measured on all its files, training files
included, which is then what pack compresses with it.

This module imports no other module of :mod:`fanstore.select` (the sample imports it).
"""

from __future__ import annotations

import logging
import zlib
from collections.abc import Sequence
from typing import Protocol

import numpy as np

from compressors import CodecError, train_dictionary
from fanstore.kinds import file_kind

log = logging.getLogger(__name__)

#: Kinds of many small files get a trained zstd dictionary.
DICT_BANDS = ("tiny", "small")
DICT_MIN_FILES = 16
#: Bytes of training data, over all eligible kinds (zstd's rule of thumb is about 100 times
#: the dictionary size); a kind gets its share by bytes, and at least MIN_KIND_TRAIN_BYTES.
DICT_TRAIN_BYTES = 8 << 20
MIN_KIND_TRAIN_BYTES = 256 << 10
#: zstd's default dictionary size, the largest trained here.
DICT_MAX = 112640


class Listed(Protocol):
    """A file of the source's listing (``fanstore.select.sample.SourceFile``)."""

    rel: str
    path: bytes
    size: int


def dict_eligible(kind: str, files: int) -> bool:
    """Whether a kind of ``files`` files gets a dictionary."""
    return kind.split("/", 1)[1] in DICT_BANDS and files >= DICT_MIN_FILES


def _rng(seed: int, kind: str) -> np.random.Generator:
    return np.random.default_rng([seed & 0xFFFFFFFF, zlib.crc32(kind.encode()), 1])


def training_files(files: Sequence[Listed], chunk_size: int, seed: int,
                   train_bytes: int = DICT_TRAIN_BYTES) -> dict[str, list[Listed]]:
    """Per eligible kind of ``files`` (the source's listing), its training files in the
    order the trainer sees them (see the module docstring)."""
    by_kind: dict[str, list[Listed]] = {}
    for f in files:
        by_kind.setdefault(file_kind(f.rel, f.size), []).append(f)
    eligible = {kind: [f for f in members if f.size] for kind, members in by_kind.items()
                if dict_eligible(kind, len(members))}
    eligible = {kind: members for kind, members in eligible.items() if members}
    weight = sum(f.size for members in eligible.values() for f in members)
    out: dict[str, list[Listed]] = {}
    for kind in sorted(eligible):
        members = eligible[kind]
        budget = max(MIN_KIND_TRAIN_BYTES,
                     train_bytes * sum(f.size for f in members) // max(1, weight))
        chosen: list[Listed] = []
        got = 0
        for i in _rng(seed, kind).permutation(len(members)).tolist():
            if got >= budget:
                break
            chosen.append(members[i])
            got += min(members[i].size, chunk_size)
        out[kind] = chosen
    return out


def read_training(chosen: Sequence[Listed], chunk_size: int) -> list[bytes]:
    """The bytes the trainer sees: each file's first chunk (a file that cannot be read is
    left out)."""
    out = []
    for f in chosen:
        try:
            with open(f.path, "rb") as fh:
                data = fh.read(chunk_size)
        except OSError as exc:
            log.debug("not trained on %s: %s", f.rel, exc.strerror)
            continue
        if data:
            out.append(data)
    return out


def train_kind_dictionary(samples: list[bytes]) -> bytes | None:
    """A zstd dictionary for one kind trained on ``samples`` (a tenth of their bytes, 4 KiB
    to :data:`DICT_MAX`), or None when they are too few to train one."""
    total = sum(len(s) for s in samples)
    if len(samples) < 8 or total < 8192:
        return None
    size = max(4096, min(DICT_MAX, total // 10))
    try:
        return train_dictionary(samples, size)
    except CodecError as exc:
        log.info("no zstd dictionary: %s", exc)
        return None


def train(training: dict[str, list[bytes]]) -> dict[str, bytes]:
    """Each kind's dictionary from its training bytes (:func:`read_training`); kinds
    without one are left out."""
    out = {}
    for kind in sorted(training):
        data = train_kind_dictionary(training[kind])
        if data is not None:
            out[kind] = data
    return out


def train_dictionaries(files: Sequence[Listed], chunk_size: int = 1 << 20, seed: int = 0,
                       train_bytes: int = DICT_TRAIN_BYTES) -> dict[str, bytes]:
    """A dictionary per kind of many small files of ``files`` (the source's listing), as
    ``fanstore select`` trains and measures it: what ``pack --codec zstd:L+dict`` uses."""
    sets = training_files(files, chunk_size, seed, train_bytes)
    return train({kind: read_training(chosen, chunk_size) for kind, chosen in sets.items()})


__all__ = [
    "DICT_MAX",
    "DICT_MIN_FILES",
    "DICT_TRAIN_BYTES",
    "dict_eligible",
    "read_training",
    "train",
    "train_dictionaries",
    "train_kind_dictionary",
    "training_files",
]
