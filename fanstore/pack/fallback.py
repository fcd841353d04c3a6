"""Files a codec of some inputs only declined: counted for the pack's summary.

A codec with ``Codec.declines`` (``jpegxl``: whole JPEGs it transcodes byte-exactly) raises
``DeclinedError`` for any other input, and the packer keeps that chunk raw (codec slot 0),
as it keeps any chunk a codec does not shrink. A file planned with such a codec whose
chunks went raw is a *fallback*: a file that is not a JPEG, a JPEG libjxl refuses (CMYK,
arithmetic coding, 12-bit), a damaged one, or a JPEG larger than one chunk (no chunk of it
is a whole JPEG; ``--chunk-kb`` raises the limit). The store reads them like any raw chunk.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from compressors import get_codec


@dataclass
class Fallbacks:
    """Per codec spec (of the codecs that decline): files planned with it, and how many of
    them it declined (stored raw)."""

    planned: dict[str, int] = field(default_factory=dict)
    raw: dict[str, int] = field(default_factory=dict)

    def add(self, spec: str, stored_raw: bool) -> None:
        self.planned[spec] = self.planned.get(spec, 0) + 1
        if stored_raw:
            self.raw[spec] = self.raw.get(spec, 0) + 1

    def lines(self) -> list[str]:
        out = []
        for spec, n in self.planned.items():
            k = self.raw.get(spec, 0)
            out.append(f"{spec}: {n - k:,} of {n:,} files transcoded; {k:,} stored raw (not "
                       "a whole JPEG it transcodes byte-exactly, or larger than one chunk)")
        return out

    def to_json(self) -> dict[str, dict[str, int]]:
        return {spec: {"files": n, "stored_raw": self.raw.get(spec, 0)}
                for spec, n in self.planned.items()}


def declining_slots(configs: Sequence[dict[str, Any]]) -> dict[int, str]:
    """Codec table slot -> spec of the codecs that decline some inputs."""
    out = {}
    for slot, config in enumerate(configs):
        codec = get_codec(config)
        if codec.declines:
            out[slot] = codec.spec
    return out


def count(configs: Sequence[dict[str, Any]],
          files: Iterable[tuple[int, Sequence[int]]]) -> Fallbacks:
    """``files``: (planned slot, the used slot of each of its chunks) per packed file."""
    slots = declining_slots(configs)
    found = Fallbacks()
    if not slots:
        return found
    for planned, used in files:
        spec = slots.get(planned)
        if spec is not None and len(used):
            found.add(spec, any(u == 0 for u in used))
    return found


def count_tasks(configs: Sequence[dict[str, Any]], tasks, results) -> Fallbacks:
    """:func:`count` over planned partition tasks and their results (``fanstore.pack.worker``:
    a result's per-file columns are in its task's file order)."""
    if not declining_slots(configs):
        return Fallbacks()

    def files():
        for task, res in zip(tasks, results):
            codec_col = res.chunks["codec"]
            for k, f in enumerate(task.files):
                first, n = int(res.chunk_firsts[k]), int(res.chunk_counts[k])
                yield f[3], codec_col[first:first + n]

    return count(configs, files())
