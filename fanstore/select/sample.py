"""A seeded, stratified sample of a source tree, in the units the store decodes.

Strata are file kinds (:func:`fanstore.kinds.file_kind`: extension and size band), the same
keys pack's per-kind policy uses. A *unit* is what one ``codec.decode`` call sees in the
store: a whole file up to the chunk size, else one chunk of it. Multi-GB files are never read
whole: their chunks are units like any other, drawn at random.

Each kind gets a byte quota proportional to its share of the data, with a floor so small
kinds are still measured (the larger of 1% of the sample and 8 units, capped by the kind's
size). Within a kind, units are drawn uniformly without replacement with a generator seeded
by ``(seed, crc32(kind))``: the same seed gives the same sample whatever else is in the tree.
If the whole source fits the sample size, every unit is taken. A kind of many small files
is measured on the files that do not train its dictionary (:mod:`.dictionaries`, which
chooses those first), when enough are left.
"""

from __future__ import annotations

import ast
import logging
import os
import sys
import zlib
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from fanstore.errors import UsageError
from fanstore.kinds import file_kind
from fanstore.select.dictionaries import (DICT_MIN_FILES, DICT_TRAIN_BYTES, dict_eligible,
                                          read_training, training_files)

log = logging.getLogger(__name__)

#: Element sizes of extensions that name their element type (raw arrays without a header).
EXTENSION_TYPESIZE = {
    "f16": 2, "f32": 4, "f64": 8, "fp16": 2, "fp32": 4, "fp64": 8, "bf16": 2,
    "i16": 2, "i32": 4, "i64": 8, "u16": 2, "u32": 4, "u64": 8,
    "float16": 2, "float32": 4, "float64": 8, "int16": 2, "int32": 4, "int64": 8,
}
_MIN_UNITS = 8
_MIN_SHARE = 0.01


@dataclass(slots=True)
class SourceFile:
    rel: str
    path: bytes
    size: int


@dataclass
class KindSample:
    """The sampled units of one kind and its population.

    Attributes: ``files``/``raw_bytes`` of the kind in the source; ``units`` the sampled
    units in random order (a prefix is itself a random sample); ``unit_files`` how many
    distinct files they come from; ``typesize`` the element size for byte-shuffle filters
    (1 if unknown) and ``typesize_from`` where it came from; ``train`` the bytes that train
    the kind's dictionary (:mod:`.dictionaries`; disjoint from the units when the source
    has enough files), empty if not eligible.
    """

    kind: str
    files: int = 0
    raw_bytes: int = 0
    units: list[bytes] = field(default_factory=list)
    unit_files: int = 0
    typesize: int = 1
    typesize_from: str = "default"
    train: list[bytes] = field(default_factory=list)

    @property
    def sample_bytes(self) -> int:
        return sum(len(u) for u in self.units)


@dataclass
class Sample:
    root: str
    chunk_size: int
    seed: int
    target_bytes: int
    files: int  # every regular file of the source, empty ones included
    raw_bytes: int
    kinds: dict[str, KindSample]

    @property
    def sample_bytes(self) -> int:
        return sum(k.sample_bytes for k in self.kinds.values())

    @property
    def units(self) -> int:
        return sum(len(k.units) for k in self.kinds.values())

    @property
    def mean_file_size(self) -> float:
        return self.raw_bytes / self.files if self.files else 0.0


def list_source(src: str) -> list[SourceFile]:
    """Regular files of ``src`` as pack sees them (same scan, same relative paths)."""
    from fanstore.pack.scan import scan_tree

    if not os.path.isdir(src):
        raise UsageError(f"source {src} is not a directory" if os.path.exists(src)
                         else f"source {src} does not exist")
    scan = scan_tree(src)
    for problem in scan.problems:
        log.debug("not sampled: %s", problem)
    return source_files(scan)


def source_files(scan) -> list[SourceFile]:
    """The regular files of a tree pack scanned (``fanstore.pack.scan.ScanResult``)."""
    from fanstore.format.index import KIND_FILE

    return [SourceFile(os.fsdecode(e.rel), os.path.join(scan.root, e.rel), e.size)
            for e in scan.entries if e.kind == KIND_FILE]


def draw_sample(files: list[SourceFile], target_bytes: int, chunk_size: int, seed: int,
                root: str = "", progress: bool | None = None,
                train_bytes: int = DICT_TRAIN_BYTES) -> Sample:
    """Draw and read the sample (see the module docstring); ``train_bytes`` of dictionary
    training files in all (:func:`.dictionaries.training_files`)."""
    by_kind: dict[str, list[SourceFile]] = {}
    for f in files:
        by_kind.setdefault(file_kind(f.rel, f.size), []).append(f)
    total = sum(f.size for f in files)
    if not files:
        raise UsageError(f"{root or 'the source'} holds no files to sample")
    if total == 0:
        raise UsageError(f"{root or 'the source'} holds no data to sample "
                         f"({len(files):,} file{'s' if len(files) != 1 else ''}, all empty)")
    sample = Sample(root, chunk_size, seed, target_bytes, len(files), total, {})
    training = training_files(files, chunk_size, seed, train_bytes)
    plans: dict[str, list[tuple[SourceFile, int]]] = {}
    for kind in sorted(by_kind):
        members = by_kind[kind]
        ks = KindSample(kind, len(members), sum(f.size for f in members))
        sample.kinds[kind] = ks
        if ks.raw_bytes:
            plans[kind] = _draw_units(_measured(members, training.get(kind)),
                                      _quota(ks.raw_bytes, total, target_bytes, members,
                                             chunk_size),
                                      chunk_size, _rng(seed, kind))
    _read_units(sample, plans, chunk_size, progress)
    for kind, plan in plans.items():
        ks = sample.kinds[kind]
        sampled = {id(f): f for f, _ in plan}
        ks.unit_files = len(sampled)
        ks.typesize, ks.typesize_from = _typesize(kind, list(sampled.values()))
        if kind in training:
            ks.train = read_training(training[kind], chunk_size)
    return sample


def _measured(members: list[SourceFile], train: list | None) -> list[SourceFile]:
    """The files of a kind its units are drawn from: those that do not train its
    dictionary, when at least DICT_MIN_FILES of them hold data; else all of them."""
    if not train:
        return members
    trained = {id(f) for f in train}
    rest = [f for f in members if f.size and id(f) not in trained]
    return rest if len(rest) >= DICT_MIN_FILES else members


def _rng(seed: int, kind: str, salt: int = 0) -> np.random.Generator:
    return np.random.default_rng([seed & 0xFFFFFFFF, zlib.crc32(kind.encode()), salt])


def _quota(kind_bytes: int, total: int, target: int, members: list[SourceFile],
           chunk_size: int) -> int:
    if total <= target:
        return kind_bytes
    nonempty = [f for f in members if f.size]
    mean_unit = sum(min(f.size, chunk_size) for f in nonempty) / max(1, len(nonempty))
    floor = max(_MIN_SHARE * target, _MIN_UNITS * mean_unit)
    return int(min(kind_bytes, max(target * kind_bytes / total, floor)))


def _draw_units(members: list[SourceFile], quota: int, chunk_size: int,
                rng: np.random.Generator) -> list[tuple[SourceFile, int]]:
    """Random (file, chunk number) units of one kind until ``quota`` bytes."""
    nonempty = [f for f in members if f.size]
    sizes = np.array([f.size for f in nonempty], dtype=np.int64)
    counts = -(-sizes // chunk_size)
    ends = np.cumsum(counts)
    n_units = int(ends[-1])
    if n_units <= 1 << 20:
        order = rng.permutation(n_units)
    else:  # a huge kind: draw only about what the quota needs
        want = min(n_units, int(quota / chunk_size * 1.5) + 64)
        order = rng.choice(n_units, size=want, replace=False)
    fidx = np.searchsorted(ends, order, side="right")
    chunk = order - (ends[fidx] - counts[fidx])
    units: list[tuple[SourceFile, int]] = []
    got = 0
    for fi, ci in zip(fidx.tolist(), chunk.tolist()):
        if got >= quota:
            break
        f = nonempty[fi]
        units.append((f, ci))
        got += min(chunk_size, f.size - ci * chunk_size)
    return units


def _read_units(sample: Sample, plans: dict[str, list[tuple[SourceFile, int]]],
                chunk_size: int, progress: bool | None) -> None:
    total = sum(min(chunk_size, f.size - c * chunk_size) for p in plans.values() for f, c in p)
    bar = _bar(total, "reading sample", progress)
    try:
        for kind, plan in plans.items():
            units = sample.kinds[kind].units
            kept = []
            for f, c in plan:
                want = min(chunk_size, f.size - c * chunk_size)
                try:
                    with open(f.path, "rb", buffering=0) as fh:
                        data = os.pread(fh.fileno(), want, c * chunk_size)
                except OSError as exc:
                    log.debug("not sampled: %s: %s", f.rel, exc.strerror)
                    continue
                if data:
                    units.append(data)
                    kept.append((f, c))
                if bar is not None:
                    bar.update(want)
            plan[:] = kept
    finally:
        if bar is not None:
            bar.close()


def _bar(total: int, desc: str, progress: bool | None):
    if progress is False or (progress is None and not sys.stderr.isatty()):
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, file=sys.stderr, leave=False)


# --------------------------------------------------------------------------- typesize


def npy_itemsize(head: bytes) -> int | None:
    """Element size from the start of a ``.npy`` file, or None if it is not one."""
    if len(head) < 10 or not head.startswith(b"\x93NUMPY"):
        return None
    major = head[6]
    if major == 1:
        hlen, start = int.from_bytes(head[8:10], "little"), 10
    elif major in (2, 3):
        if len(head) < 12:
            return None
        hlen, start = int.from_bytes(head[8:12], "little"), 12
    else:
        return None
    text = head[start:start + hlen]
    if len(text) < hlen:
        return None
    try:
        header = ast.literal_eval(text.decode("latin1" if major < 3 else "utf8"))
        return int(np.dtype(header["descr"]).itemsize)
    except (ValueError, SyntaxError, KeyError, TypeError, MemoryError):
        return None


def _typesize(kind: str, files: list[SourceFile]) -> tuple[int, str]:
    """The kind's element size: .npy headers (byte-weighted majority), else the extension."""
    ext = kind.split("/", 1)[0]
    if ext == "npy":
        votes: Counter[int] = Counter()
        for f in files:
            try:
                with open(f.path, "rb") as fh:
                    head = fh.read(4096)
            except OSError:
                continue
            size = npy_itemsize(head)
            if size:
                votes[size] += f.size
        if votes:
            size = votes.most_common(1)[0][0]
            if 1 <= size <= 255:
                return size, "npy header"
    if ext in EXTENSION_TYPESIZE:
        return EXTENSION_TYPESIZE[ext], "extension"
    return 1, "default"


__all__ = [
    "EXTENSION_TYPESIZE",
    "KindSample",
    "Sample",
    "SourceFile",
    "dict_eligible",
    "draw_sample",
    "list_source",
    "npy_itemsize",
    "source_files",
]
