"""Pure planning: which file goes to which partition, and with which codec."""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Any

from fanstore.kinds import file_kind


@dataclass
class CodecPolicy:
    """The codec for each file: one default spec, optionally one per file kind."""

    default: Any  # a compressors.Codec
    by_kind: dict[str, Any] = field(default_factory=dict)

    def codec_for(self, rel: str, size: int):
        if self.by_kind:
            codec = self.by_kind.get(file_kind(rel, size))
            if codec is not None:
                return codec
        return self.default


def plan_partitions(sizes: list[int], n: int) -> list[int]:
    """Balance files over ``n`` partitions by size: largest first into the lightest partition.

    Deterministic: ties break by the order of ``sizes`` (the scan order) and by partition
    number. Returns the partition of each file.
    """
    if n < 1:
        raise ValueError("need at least one partition")
    order = sorted(range(len(sizes)), key=lambda i: (-sizes[i], i))
    heap = [(0, p) for p in range(n)]
    assign = [0] * len(sizes)
    for i in order:
        load, p = heapq.heappop(heap)
        assign[i] = p
        # A small constant per file keeps many empty files from piling into one partition.
        heapq.heappush(heap, (load + sizes[i] + 512, p))
    return assign


def in_dir(rel: bytes, reldir: bytes) -> bool:
    reldir = reldir.strip(b"/")
    return rel == reldir or rel.startswith(reldir + b"/")
