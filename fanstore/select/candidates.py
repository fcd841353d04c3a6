"""The candidate grid: which codec configurations the selector measures.

Every codec of :mod:`compressors` appears, at levels that span its speed/ratio range. Byte
filters (shuffle, bitshuffle) need the element size, which comes from the data
(:attr:`KindSample.typesize`: ``.npy`` headers, else extensions that name a type, else 1).
A single codec for the whole set uses the element size that covers the most bytes; with
``--per-kind`` each kind also gets blosc2 filters at its own element size and, for kinds of
many small files, a zstd dictionary trained on that kind alone. When the sample holds JPEG
files, ``jpegxl`` (lossless JPEG recompression) is a candidate too: whole files only, the
others declined and kept raw, as ``pack --codec jpegxl`` keeps them.

The order of the list is "simplest first": exact ties in ratio and speed go to the earlier.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from compressors import Codec, CodecError, CodecSpec, ZstdCodec, parse_spec
from fanstore.select.dictionaries import train
from fanstore.select.sample import Sample, dict_eligible

log = logging.getLogger(__name__)

#: Fixed part of the grid. lz4hc decodes as fast at any level, so only the high levels (more
#: ratio for the same decode) are worth measuring; zlib is the reference everyone knows.
BASE_SPECS = ("none", "lz4", "snappy", "lz4hc:9", "lz4hc:12", "zstd:1", "zstd:3", "zstd:9",
              "zstd:19", "zlib:6")
BLOSC_CODECS = ("blosclz", "lz4", "zstd")
BLOSC_CLEVEL = 5
DICT_LEVEL = 3
#: Levels measured with the whole-set dictionary: on small files a trained dictionary
#: decodes about as fast at any level, so the high level buys capacity for pack time only.
DICT_LEVELS = (3, 19)
#: Solid-block candidates: (block KiB, codec spec, with the dictionary). Measured on the
#: kinds of small files; their read cost includes the read amplification (a file read in
#: random order decodes its whole block unless the reader's caches still hold it:
#: ``readorder``).
SOLID = ((16, "zstd:3", False), (64, "zstd:3", False), (64, "zstd:19", True))
#: Extensions of JPEG files: the sources of which ``jpegxl`` (lossless JPEG recompression,
#: whole files only) is a candidate; other files it keeps raw, as pack does.
JPEG_EXTENSIONS = frozenset({"jpg", "jpeg", "jpe", "jfif"})


@dataclass(frozen=True)
class Candidate:
    """A codec to measure. ``kinds`` is None for a whole-set candidate, else the only kinds
    it is measured on (a per-kind extra). ``overhead`` is stored once per store whatever the
    data (a dictionary in the codec table): it is charged to the stored size."""

    label: str
    codec: Codec
    kinds: frozenset[str] | None = None
    overhead: int = 0
    solid: int = 0  # solid block size in bytes (0: every file in its own chunks)
    by_kind: tuple[tuple[str, Codec], ...] = ()  # kinds with their own codec (dictionaries)

    def codec_for(self, kind: str) -> Codec:
        for k, codec in self.by_kind:
            if k == kind:
                return codec
        return self.codec


def blosc_specs(typesize: int) -> list[str]:
    specs = []
    for name in BLOSC_CODECS:
        specs.append(f"blosc2:{name}:{BLOSC_CLEVEL}:noshuffle:1")
        if typesize > 1:
            specs.append(f"blosc2:{name}:{BLOSC_CLEVEL}:shuffle:{typesize}")
        specs.append(f"blosc2:{name}:{BLOSC_CLEVEL}:bitshuffle:{typesize}")
    return specs


def dominant_typesize(sample: Sample) -> int:
    """The element size (>1) covering the most bytes of the source, else 1."""
    weights: dict[int, int] = {}
    for ks in sample.kinds.values():
        if ks.typesize > 1:
            weights[ks.typesize] = weights.get(ks.typesize, 0) + ks.raw_bytes
    return max(sorted(weights), key=lambda t: weights[t]) if weights else 1


def jpeg_kinds(sample: Sample) -> list[str]:
    """The sampled kinds of JPEG files (``jpg/medium``: the kind's extension)."""
    return [kind for kind, ks in sorted(sample.kinds.items())
            if ks.units and kind.partition("/")[0] in JPEG_EXTENSIONS]


def _build(specs: list[str]) -> list[Codec]:
    out = []
    for spec in specs:
        try:
            out.append(parse_spec(spec))
        except CodecError as exc:  # an optional library missing on this install
            log.warning("codec %s not measured: %s", spec, exc)
    return out


def whole_set_candidates(sample: Sample) -> list[Candidate]:
    """Candidates applied to every kind (the single-codec choice)."""
    specs = list(BASE_SPECS) + blosc_specs(dominant_typesize(sample))
    if jpeg_kinds(sample):
        specs.append("jpegxl")
    out = [Candidate(c.spec, c) for c in _build(specs)]
    # One dictionary per kind of many small files, the very one pack's --codec zstd:L+dict
    # trains (dictionaries.py); every dictionary is charged to the stored size.
    dicts = train({k: ks.train for k, ks in sample.kinds.items()
                   if dict_eligible(k, ks.files) and ks.train})
    overhead = sum(len(d) for d in dicts.values())

    def with_dicts(level: int) -> tuple[tuple[str, Codec], ...]:
        return tuple((k, ZstdCodec(level, dict_data=d)) for k, d in dicts.items())

    if dicts:
        for level in DICT_LEVELS:
            codec = ZstdCodec(level)
            out.append(Candidate(CodecSpec(codec, dictionary=True).label, codec,
                                 overhead=overhead, by_kind=with_dicts(level)))
    if any(dict_eligible(k, ks.files) for k, ks in sample.kinds.items()):
        for kb, spec, with_dict in SOLID:
            if kb << 10 > sample.chunk_size or (with_dict and not dicts):
                continue
            base = parse_spec(spec)
            label = CodecSpec(base, dictionary=with_dict, solid_kb=kb).label
            out.append(Candidate(label, base, overhead=overhead if with_dict else 0,
                                 solid=kb << 10,
                                 by_kind=with_dicts(base.level) if with_dict else ()))
    return out


def per_kind_candidates(sample: Sample, base: list[Candidate]) -> list[Candidate]:
    """Extras measured only on their own kind: filters at the kind's element size."""
    have = {c.label for c in base}
    out: list[Candidate] = []
    extra_specs: dict[str, list[str]] = {}
    for kind, ks in sorted(sample.kinds.items()):
        if ks.units:
            for spec in blosc_specs(ks.typesize):
                if spec not in have:
                    extra_specs.setdefault(spec, []).append(kind)
    for spec, kinds in extra_specs.items():
        for codec in _build([spec]):
            out.append(Candidate(codec.spec, codec, frozenset(kinds)))
    return out
