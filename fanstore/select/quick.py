"""The default of ``fanstore pack``: a codec per file kind, a function of the data alone.

``fanstore pack SRC DEST`` without ``--codec`` runs this instead of the full selector: a
small seeded sample (:data:`SAMPLE_MB`, stratified by kind as :mod:`.sample` draws it), a
short list of candidates per kind, each encoding the kind's whole sample. The rule, from
the capacity study (docs/selection.md "The default of pack"; the script is retired, its
command and results are in docs/benchmarks.md, "Retired studies"):

    per kind, the best ratio among the candidates (the dictionary charged to its kind);
    ratios within 1% are a tie, won by the candidate earlier in :data:`READ_COST_ORDER`
    (the cheaper read).

Nothing here is timed: the sample, the dictionaries (zstd's trainer is deterministic), the
encoders and the rule are functions of the data and of this FanStore version, so the same
source packs to the same codecs, and the same bytes, on a quiet machine or a busy one. The
read cost enters as a fixed order, not as a measurement: on the four data sets of the study
every candidate here read at 0.03-1.15x the CPU of ``zstd:3`` on the kinds where it had the
best ratio (docs/selection.md §9 has the table), so no kind is notably slower to read than
with ``zstd:3``, the previous default. Per-kind trained zstd dictionaries on kinds of many
small files (which decode faster than plain zstd there and store them 1.3-1.4x smaller),
``zstd:9`` where it buys ratio, byte-shuffled blosc2 on numeric arrays, ``none`` on
incompressible data. Levels above 9 are left out: on small files ``zstd:19`` encodes at
about 3 MB/s per core, which would make packing 10x slower; ``--codec auto`` weighs them
(and solid blocks) with the full selector.

A dictionary is charged to the stored bytes of its kind (it lives in the store's codec
table), and trained on files of the kind that are not in the measured sample when the
source has enough of them (:func:`.sample.draw_sample`). At most :data:`MAX_KINDS` kinds
are chosen for (the largest by bytes); the others keep ``zstd:3``.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from compressors import Codec, CodecError, ZstdCodec, parse_spec
from fanstore.select.bench import solid_blocks
from fanstore.select.dictionaries import train_kind_dictionary
from fanstore.select.policy import RATIO_TIE
from fanstore.select.sample import SourceFile, draw_sample

log = logging.getLogger(__name__)

MB = 1e6
#: Sample size and dictionary training data (bytes): the training makes dictionaries large
#: enough for the smaller kinds at SOLID_LEVEL (docs/selection.md §11).
SAMPLE_MB = 4
TRAIN_BYTES = 4 << 20
#: Kinds chosen for, the largest by bytes (ties by name); the others keep FALLBACK.
MAX_KINDS = 64
#: The size bands whose files go into solid blocks (fanstore.kinds: below 64 KiB).
SOLID_BANDS = ("tiny", "small")
FALLBACK = "zstd:3"
_BASE = ("none", "lz4", "zstd:3", "zstd:9")
_DICT_LEVELS = (3, 9)
#: Kinds of small files are also measured in solid blocks of this size at this level, with
#: the kind's dictionary when it has one: level 13 is zstd's btopt for a 32 KiB block
#: (docs/selection.md §11 has the levels measured).
SOLID_BLOCK = 32 << 10
SOLID_LEVEL = 13
_BLOSC = ("blosc2:zstd:5:shuffle:{t}", "blosc2:lz4:5:shuffle:{t}")
#: Ties go to the earlier: the order of read CPU per byte found by the capacity study
#: (none a copy; lz4 and blosc2 lz4 a fraction of zstd; a dictionary decodes small files
#: faster than plain zstd; level 9 no faster than level 3).
READ_COST_ORDER = ("none", "blosc2:lz4:5:shuffle", "lz4", "blosc2:zstd:5:shuffle",
                   "zstd:3+dict", "zstd:3", "zstd:9+dict", "zstd:9",
                   f"zstd:{SOLID_LEVEL}+dict+solid{SOLID_BLOCK >> 10}k",
                   f"zstd:{SOLID_LEVEL}+solid{SOLID_BLOCK >> 10}k")


@dataclass
class KindChoice:
    kind: str
    files: int
    raw_bytes: int
    label: str
    codec: Codec
    ratio: float  # on the sample, dictionary charged
    measured: dict[str, float] = field(default_factory=dict)  # label: ratio
    solid: int = 0  # solid block size (bytes), 0: each file in chunks of its own


@dataclass
class QuickSelection:
    """What the default pack chose: a codec per kind."""

    choices: dict[str, KindChoice]
    files: int
    raw_bytes: int
    sample_bytes: int
    seconds: float
    left_out: int = 0  # kinds beyond MAX_KINDS (FALLBACK)

    @property
    def ratio(self) -> float:
        """Predicted ratio of the whole source (kinds weighted by their source bytes)."""
        stored = sum(c.raw_bytes / c.ratio for c in self.choices.values())
        raw = sum(c.raw_bytes for c in self.choices.values())
        return raw / stored if stored > 0 else 1.0

    def codecs(self) -> dict[str, Codec]:
        """Each kind's codec (kinds not chosen for: :data:`FALLBACK`)."""
        return {k: c.codec for k, c in self.choices.items()}

    def solid(self) -> dict[str, int]:
        """The kinds packed in solid blocks, and their block size."""
        return {k: c.solid for k, c in self.choices.items() if c.solid}

    def line(self) -> str:
        """One line for stderr: what was chosen for how much of the data."""
        share: dict[str, int] = {}
        for c in self.choices.values():
            share[c.label] = share.get(c.label, 0) + c.raw_bytes
        total = max(1, sum(share.values()))
        parts = ", ".join(f"{label} {n / total:.0%}" for label, n in
                          sorted(share.items(), key=lambda kv: (-kv[1], kv[0])))
        cut = (f"; {self.left_out} more kinds {FALLBACK}" if self.left_out else "")
        return (f"codec: quick selection on a {self.sample_bytes / MB:,.1f} MB sample in "
                f"{self.seconds:.1f} s: {parts} of the bytes{cut}; predicted ratio "
                f"{self.ratio:.2f}x (--codec SPEC pins one, --codec auto runs the full "
                f"selector)")

    def to_json(self) -> dict[str, Any]:
        """The record the index keeps: no time or speed in it, so that the same source
        packs to the same index bytes."""
        return {
            "version": 2,
            "quick": True,
            "chosen": "per kind (quick)",
            "mode": "quick",
            "rule": "per kind, the best ratio; ties within 1% to the cheaper read",
            "solid_kb": {k: n >> 10 for k, n in sorted(self.solid().items())},
            "per_kind": {k: c.label for k, c in sorted(self.choices.items())},
            "predicted": {"ratio": round(self.ratio, 4)},
            "kinds": {k: {"files": c.files, "mb": round(c.raw_bytes / MB, 3),
                          "ratio": round(c.ratio, 4)}
                      for k, c in sorted(self.choices.items())},
            "sample_mb": round(self.sample_bytes / MB, 3),
        }


def quick_select(files: list[SourceFile], chunk_size: int = 1 << 20, seed: int = 0,
                 root: str = "", sample_mb: float = SAMPLE_MB,
                 solid_kb: int = SOLID_BLOCK >> 10) -> QuickSelection:
    """Choose a codec per kind of ``files`` (see the module docstring); ``solid_kb``: the
    solid block size offered to kinds of small files (0: none; at most the chunk size)."""
    t0 = time.monotonic()
    if not any(f.size for f in files):  # nothing to compress: the default codec, no sample
        return QuickSelection({}, len(files), 0, 0, time.monotonic() - t0)
    sample = draw_sample(files, int(sample_mb * MB), chunk_size, seed, root=root,
                         progress=False, train_bytes=TRAIN_BYTES)
    block = min(solid_kb << 10, chunk_size) if solid_kb else 0
    choices: dict[str, KindChoice] = {}
    fallback = parse_spec(FALLBACK)
    kinds = sorted(sample.kinds.values(), key=lambda ks: (-ks.raw_bytes, ks.kind))
    for n, ks in enumerate(kinds):
        if not ks.units or n >= MAX_KINDS:  # nothing to store, or beyond the bound
            choices[ks.kind] = KindChoice(ks.kind, ks.files, ks.raw_bytes, FALLBACK,
                                          fallback, 1.0)
            continue
        choices[ks.kind] = _choose_kind(ks, block)
    return QuickSelection(choices, sample.files, sample.raw_bytes, sample.sample_bytes,
                          time.monotonic() - t0, max(0, len(kinds) - MAX_KINDS))


def _candidates(ks, block: int) -> list[tuple[str, Codec, int, int]]:
    """(label, codec, bytes stored once per store, solid block size or 0) to measure on one
    kind; solid blocks of ``block`` bytes for a kind of small files (0: none)."""
    out = []
    for spec in _BASE + tuple(s.format(t=ks.typesize) for s in _BLOSC if ks.typesize > 1):
        try:
            out.append((spec, parse_spec(spec), 0, 0))
        except CodecError as exc:  # an optional library missing
            log.info("quick selection: %s not available: %s", spec, exc)
    data = train_kind_dictionary(ks.train) if ks.train else None
    if data is not None:
        for level in _DICT_LEVELS:
            codec = ZstdCodec(level, dict_data=data)  # its spec is zstd:L+dict
            out.append((codec.spec, codec, len(data), 0))
    if block and size_band_of(ks.kind) in SOLID_BANDS:
        codec = ZstdCodec(SOLID_LEVEL, dict_data=data)
        out.append((f"{codec.spec}+solid{block >> 10}k", codec, len(data or b""), block))
    return out


def size_band_of(kind: str) -> str:
    return kind.rpartition("/")[2]


def _rank(label: str) -> int:
    """A label's place in :data:`READ_COST_ORDER` (blosc2's element size left out; every
    solid block size ranks as the default's)."""
    key = label.rsplit(":", 1)[0] if label.startswith("blosc2:") else label
    head, plus, _ = key.rpartition("+solid")
    if plus:
        key = f"{head}+solid{SOLID_BLOCK >> 10}k"
    return READ_COST_ORDER.index(key) if key in READ_COST_ORDER else len(READ_COST_ORDER)


def stored_bytes(codec: Codec, units: list[bytes], block: int = 0) -> int:
    """What pack stores for ``units`` with ``codec``: each unit compressed, or kept raw
    when compression does not shrink it."""
    encode = codec.encode
    if block:
        units = solid_blocks(units, block)[0]
    return sum(min(len(encode(u)), len(u)) for u in units)


def _choose_kind(ks, block: int) -> KindChoice:
    raw = sum(len(u) for u in ks.units)
    ratios: dict[str, float] = {}
    codecs: dict[str, tuple[Codec, int]] = {}
    for label, codec, overhead, solid in _candidates(ks, block):
        try:
            stored = stored_bytes(codec, ks.units, solid)
        except CodecError as exc:
            log.info("quick selection: %s left out on %s: %s", label, ks.kind, exc)
            continue
        share = overhead * raw / max(1, ks.raw_bytes)  # the dictionary, charged pro rata
        ratios[label] = raw / max(1.0, stored + share)
        codecs[label] = (codec, solid)
    best = max(ratios.values())
    ties = [lb for lb, r in ratios.items() if r >= best / (1 + RATIO_TIE)]
    label = min(ties, key=lambda lb: (_rank(lb), -ratios[lb], lb))
    codec, solid = codecs[label]
    return KindChoice(ks.kind, ks.files, ks.raw_bytes, label, codec, ratios[label], ratios,
                      solid)


__all__ = [
    "FALLBACK",
    "READ_COST_ORDER",
    "SAMPLE_MB",
    "KindChoice",
    "QuickSelection",
    "quick_select",
]
