"""Pure planning: which file goes to which partition, and with which codec."""

from __future__ import annotations

import heapq
import json
from dataclasses import dataclass, field
from typing import Any, Callable

from fanstore.kinds import file_kind


@dataclass
class CodecPolicy:
    """The codec for each file: one default, optionally one per file kind; and whether small
    files go into solid blocks.

    ``solid`` is the solid block size (bytes) for the files that take the default codec,
    ``solid_by_kind`` the one for the kinds of ``by_kind`` (0 or absent: none). A file goes
    into a solid block if it is not empty and no larger than the block: the packer appends
    such files of one kind back to back and compresses each block as one chunk (format v2).
    """

    default: Any  # a compressors.Codec
    by_kind: dict[str, Any] = field(default_factory=dict)
    solid: int = 0
    solid_by_kind: dict[str, int] = field(default_factory=dict)

    def choice_for(self, rel: str, size: int) -> tuple[Any, int]:
        """(codec, solid block size or 0) of a file."""
        if self.by_kind or self.solid_by_kind:
            kind = file_kind(rel, size)
            codec = self.by_kind.get(kind)
            if codec is not None:
                return codec, 0 if _declines(codec) else self.solid_by_kind.get(kind, 0)
        # A codec of whole inputs (jpegxl) never gets a solid block: it would decline it.
        return self.default, 0 if _declines(self.default) else self.solid

    def codec_for(self, rel: str, size: int):
        return self.choice_for(rel, size)[0]


def _declines(codec) -> bool:
    return bool(getattr(codec, "declines", False))


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


#: The codec config of slot 0: chunks stored raw.
NONE_CONFIG: dict[str, Any] = {"id": "none"}


class CodecTable:
    """The store's codec table as a pack builds it: slot 0 is always ``none`` (chunks kept
    raw), each distinct codec config gets the next slot. A policy's codec objects live
    through the pack, so each one's slot is remembered by identity: a config with a
    dictionary is ~150 kB of base64 to build and serialise, and a pack asks per file.
    ``on_new(slot, config)`` is called for each new slot (the streaming packer hands the
    config to its encoder workers)."""

    def __init__(self, on_new: Callable[[int, dict], None] | None = None) -> None:
        self.configs: list[dict[str, Any]] = [dict(NONE_CONFIG)]
        self._by_key: dict[str, int] = {}
        self._by_codec: dict[int, tuple[Any, int]] = {}  # id(codec) -> (codec, slot)
        self._on_new = on_new

    def slot(self, codec) -> int:
        known = self._by_codec.get(id(codec))
        if known is not None and known[0] is codec:
            return known[1]
        cfg = codec.get_config()
        if cfg.get("id") == "none":
            number = 0
        else:
            key = json.dumps(cfg, sort_keys=True)
            number = self._by_key.get(key, -1)
            if number < 0:
                number = self._by_key[key] = len(self.configs)
                self.configs.append(cfg)
                if self._on_new is not None:
                    self._on_new(number, cfg)
        self._by_codec[id(codec)] = (codec, number)
        return number

