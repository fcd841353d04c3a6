"""The default of ``fanstore pack``: a quick, bounded codec choice per file kind.

``fanstore pack SRC DEST`` without ``--codec`` runs this instead of the full selector: a
small seeded sample (:data:`SAMPLE_MB`, stratified by kind as :mod:`.sample` draws it), a
short list of candidates per kind, a few seconds in all (:data:`TIME_LIMIT` bounds it:
kinds not measured by then keep ``zstd:3``). The rule, from the capacity study
(``tools/bench/capacity_study.py``, docs/selection.md "The default of pack"):

    per kind, the best ratio among the candidates whose read cost (decode + checksum CPU
    per byte, measured here) is at most :data:`READ_COST_LIMIT` times that of ``zstd:3``,
    the previous default; ratios within 1% are a tie, won by the cheaper read.

So the default never makes a kind notably slower to read than ``zstd:3`` did, and takes
every byte of capacity that comes at that price: per-kind trained zstd dictionaries for
kinds of many small files (which *decode faster* than plain zstd on small files and store
them 1.3-1.4x smaller), ``zstd:9`` where it is as fast to read, byte-shuffled blosc2 for
numeric arrays, ``none`` for incompressible data. Levels above 9 are left out: on small
files ``zstd:19`` encodes at about 3 MB/s per core, which would make packing 10x slower;
``--codec auto`` weighs them (and solid blocks) with the full selector.

A dictionary is charged to the stored bytes of its kind (it lives in the store's codec
table), and trained on files of the kind that are not in the measured sample when the
source has enough of them (:func:`.sample.draw_sample`).
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any

from compressors import Codec, CodecError, ZstdCodec, parse_spec
from fanstore.errors import FanStoreError
from fanstore.select import bench
from fanstore.select.candidates import train_kind_dictionary
from fanstore.select.sample import SourceFile, draw_sample

log = logging.getLogger(__name__)

MB = 1e6
#: Sample size and dictionary training data (bytes), encode CPU per candidate over the
#: whole sample (seconds), and the wall-clock bound of the whole choice (seconds).
SAMPLE_MB = 8
TRAIN_BYTES = 2 << 20
ENCODE_SECONDS = 0.3
TIME_LIMIT = 20.0
#: A candidate may cost at most this many times the read CPU of zstd:3 on the same kind.
READ_COST_LIMIT = 1.25
RATIO_TIE = 0.01
REFERENCE = "zstd:3"
FALLBACK = "zstd:3"
_BASE = ("none", "lz4", "zstd:3", "zstd:9")
_DICT_LEVELS = (3, 9)
_BLOSC = ("blosc2:zstd:5:shuffle:{t}", "blosc2:lz4:5:shuffle:{t}")


@dataclass
class KindChoice:
    kind: str
    files: int
    raw_bytes: int
    label: str
    codec: Codec
    ratio: float  # on the sample, dictionary charged
    cpu: float  # read CPU seconds per raw byte (decode + checksum), one core
    measured: dict[str, tuple[float, float]] = field(default_factory=dict)  # label: (ratio, cpu)


@dataclass
class QuickSelection:
    """What the default pack chose: a codec per kind."""

    choices: dict[str, KindChoice]
    files: int
    raw_bytes: int
    sample_bytes: int
    seconds: float
    timed_out: bool = False

    @property
    def ratio(self) -> float:
        """Predicted ratio of the whole source (kinds weighted by their source bytes)."""
        stored = sum(c.raw_bytes / c.ratio for c in self.choices.values())
        raw = sum(c.raw_bytes for c in self.choices.values())
        return raw / stored if stored > 0 else 1.0

    def codecs(self) -> dict[str, Codec]:
        """Each kind's codec (kinds not measured: :data:`FALLBACK`)."""
        return {k: c.codec for k, c in self.choices.items()}

    def line(self) -> str:
        """One line for stderr: what was chosen for how much of the data."""
        share: dict[str, int] = {}
        for c in self.choices.values():
            share[c.label] = share.get(c.label, 0) + c.raw_bytes
        total = max(1, sum(share.values()))
        parts = ", ".join(f"{label} {n / total:.0%}" for label, n in
                          sorted(share.items(), key=lambda kv: -kv[1]))
        cut = "; time limit reached, the rest zstd:3" if self.timed_out else ""
        return (f"codec: quick selection on a {self.sample_bytes / MB:,.1f} MB sample in "
                f"{self.seconds:.1f} s: {parts} of the bytes{cut}; predicted ratio "
                f"{self.ratio:.2f}x (--codec SPEC pins one, --codec auto runs the full "
                f"selector)")

    def to_json(self) -> dict[str, Any]:
        return {
            "version": 1,
            "quick": True,
            "chosen": "per kind (quick)",
            "mode": "quick",
            "rule": f"per kind, best ratio with read CPU <= {READ_COST_LIMIT} x {REFERENCE}'s",
            "per_kind": {k: c.label for k, c in sorted(self.choices.items())},
            "predicted": {"ratio": round(self.ratio, 4)},
            "kinds": {k: {"files": c.files, "mb": round(c.raw_bytes / MB, 3),
                          "ratio": round(c.ratio, 4),
                          "read_mb_per_s": round(1 / c.cpu / MB, 1) if c.cpu > 0 else None}
                      for k, c in sorted(self.choices.items())},
            "sample_mb": round(self.sample_bytes / MB, 3),
            "seconds": round(self.seconds, 2),
        }


def quick_select(files: list[SourceFile], chunk_size: int = 1 << 20, seed: int = 0,
                 root: str = "", sample_mb: float = SAMPLE_MB,
                 time_limit: float = TIME_LIMIT) -> QuickSelection:
    """Choose a codec per kind of ``files`` (see the module docstring)."""
    t0 = time.monotonic()
    if not any(f.size for f in files):  # nothing to compress: the default codec, no sample
        return QuickSelection({}, len(files), 0, 0, time.monotonic() - t0)
    sample = draw_sample(files, int(sample_mb * MB), chunk_size, seed, root=root,
                         progress=False, train_bytes=TRAIN_BYTES)
    choices: dict[str, KindChoice] = {}
    timed_out = False
    fallback = parse_spec(FALLBACK)
    kinds = sorted(sample.kinds.values(), key=lambda ks: -ks.raw_bytes)  # biggest first
    budget = ENCODE_SECONDS / max(1, sample.sample_bytes)
    for ks in kinds:
        if not ks.units:  # only empty files: nothing to store
            choices[ks.kind] = KindChoice(ks.kind, ks.files, ks.raw_bytes, FALLBACK,
                                          fallback, 1.0, 0.0)
            continue
        if time.monotonic() - t0 > time_limit:
            timed_out = True
            choices[ks.kind] = KindChoice(ks.kind, ks.files, ks.raw_bytes, FALLBACK,
                                          fallback, math.nan, math.nan)
            continue
        choices[ks.kind] = _choose_kind(ks, budget * ks.sample_bytes)
    for c in choices.values():  # a kind cut by the time limit: ratio unknown, assume 1
        if not c.ratio == c.ratio:
            c.ratio = 1.0
    return QuickSelection(choices, sample.files, sample.raw_bytes, sample.sample_bytes,
                          time.monotonic() - t0, timed_out)


def _candidates(ks) -> list[tuple[str, Codec, int]]:
    """(label, codec, bytes stored once per store) to measure on one kind."""
    out = []
    for spec in _BASE + tuple(s.format(t=ks.typesize) for s in _BLOSC if ks.typesize > 1):
        try:
            out.append((spec, parse_spec(spec), 0))
        except CodecError as exc:  # an optional library missing
            log.info("quick selection: %s not available: %s", spec, exc)
    if ks.train:
        data = train_kind_dictionary(ks.train)
        if data is not None:
            for level in _DICT_LEVELS:
                codec = ZstdCodec(level, dict_data=data)  # its spec is zstd:L+dict
                out.append((codec.spec, codec, len(data)))
    return out


def _choose_kind(ks, encode_budget: float) -> KindChoice:
    base = bench.baseline(ks.units)
    measured: dict[str, tuple[float, float]] = {}
    codecs: dict[str, Codec] = {}
    for label, codec, overhead in _candidates(ks):
        try:
            m = bench.measure(codec, ks.units, encode_budget)
        except (CodecError, FanStoreError) as exc:
            log.info("quick selection: %s left out on %s: %s", label, ks.kind, exc)
            continue
        stored = m.stored_bytes / m.raw_bytes + overhead / max(1, ks.raw_bytes)
        cpu = (m.decode_s + m.raw_unit_bytes * base.copy) / m.raw_bytes + base.checksum
        measured[label] = (1 / stored, cpu)
        codecs[label] = codec
    ref = measured.get(REFERENCE)
    limit = READ_COST_LIMIT * ref[1] if ref else math.inf
    ok = {lb: v for lb, v in measured.items() if v[1] <= limit} or measured
    best = max(v[0] for v in ok.values())
    ties = [lb for lb, v in ok.items() if v[0] >= best * (1 - RATIO_TIE)]
    label = min(ties, key=lambda lb: ok[lb][1])
    ratio, cpu = measured[label]
    return KindChoice(ks.kind, ks.files, ks.raw_bytes, label, codecs[label], ratio, cpu,
                      measured)


def train_dictionaries(files: list[SourceFile], chunk_size: int = 1 << 20, seed: int = 0,
                       root: str = "") -> dict[str, bytes]:
    """A zstd dictionary per kind of many small files of ``files`` (trained as the quick
    selection trains them: :data:`TRAIN_BYTES` of files in all), for ``--codec zstd:L+dict``;
    kinds without one are left out."""
    out: dict[str, bytes] = {}
    if any(f.size for f in files):
        sample = draw_sample(files, 0, chunk_size, seed, root=root, progress=False,
                             train_bytes=TRAIN_BYTES)
        for kind, ks in sorted(sample.kinds.items()):
            data = train_kind_dictionary(ks.train) if ks.train else None
            if data is not None:
                out[kind] = data
    return out


__all__ = [
    "FALLBACK",
    "READ_COST_LIMIT",
    "SAMPLE_MB",
    "KindChoice",
    "QuickSelection",
    "quick_select",
    "train_dictionaries",
]
