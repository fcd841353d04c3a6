"""Identical files stored once (as mksquashfs does with duplicate files).

Before the partitions are planned, :func:`find_duplicates` finds the files of a scanned
tree whose bytes equal an earlier file's. Only such a *duplicate* is left out of the
partition tasks; its index entry gets the first copy's chunk run (first, count, offset and
whole-file checksum), so every name is kept and the bytes are stored once. That works the
same for a file in chunks of its own and for one in a solid block; a run of several chunks
shared by files makes the index format v4 (docs/format.md).

How a duplicate is found, reading as little as it can:

1. files are grouped by (class, size): only files of the same size, and of the same
   class (the caller's: broadcast or not, so a copy stays where its placement says), can
   be equal; an empty file has nothing to store;
2. within a group, by the XXH3-128 of their first 64 KiB, then (for larger files whose
   heads agree) of their whole content;
3. within a group of equal digests, each file's bytes are compared with the first copy's:
   a hash of 128 bits is not a proof (XXH3 is not built against crafted collisions, and a
   dataset may come from anyone), the bytes are. A file that turns out different starts a
   copy of its own.

The digests of step 2 are computed by the pack's worker processes (``fanstore.pack.pool``),
each reading its share of the files: on a tree of small files nearly every file has a
namesake in size, so this pass reads the whole tree once (the pack's own reads then find it
in the page cache); one process reading 60,000 cold files one after the other took 10 of a
22-second pack.

The first copy is the file earliest in scan order (the smallest entry number): the choice
does not depend on ``--jobs``, timing or which worker packs what, so a pack stays
reproducible. A file that cannot be read here is simply not deduplicated (the worker that
packs it reports the error).

A duplicate is never read again after the compare: its entry gets its first copy's run and
checksum. So at the end of the pack, before the store is installed,
:func:`check_unchanged` stats every file the merge relied on (each duplicate and each first
copy) again: one whose size or modification time (ns) is no longer what the scan saw
changed while being packed, and the pack fails naming it, as for a file that grew (a write
that leaves both as they were, within one tick of a coarse file-system clock, is not seen).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import xxhash

from fanstore.errors import PackError
from fanstore.format.index import clamp_mtime_ns
from fanstore.pack import wire
from fanstore.pack.scan import ScanEntry, show

if TYPE_CHECKING:
    from fanstore.pack.pool import WorkerPool

#: Bytes of a file hashed first: files whose heads differ are never read further.
HEAD = 64 << 10
_BLOCK = 1 << 20
#: Fewer candidate files than this are hashed in this process (a pool costs more).
POOL_FROM = 2000
#: Files in one task of the workers, at most: the tasks go out in scan order, so the
#: workers read neighbouring files at any time (on a disk that seeks, or a virtual one,
#: cold reads of a million tiny files ran 4x slower with each worker reading its own
#: quarter of the tree).
SHARE_FILES = 256


@dataclass
class Duplicates:
    """Files whose bytes equal an earlier file's: ``of`` maps each duplicate's entry to the
    entry of its first copy; ``saved_bytes`` is their total size (not stored again)."""

    of: dict[int, int] = field(default_factory=dict)
    saved_bytes: int = 0

    def __len__(self) -> int:
        return len(self.of)


def find_duplicates(root: bytes, entries: Sequence[ScanEntry], files: Iterable[int],
                    classes: Iterable[int], pool: WorkerPool | None = None) -> Duplicates:
    """The duplicates among ``files`` (entry numbers; ``classes``: one key per file, only
    files of one class are compared) of the tree scanned at ``root``, hashed by the
    workers of ``pool`` (None: in this process)."""
    by_size: dict[tuple[int, int], list[int]] = {}
    for entry, cls in zip(files, classes):
        size = entries[entry].size
        if size > 0:
            by_size.setdefault((cls, size), []).append(entry)
    groups = [(key, sorted(g)) for key, g in sorted(by_size.items()) if len(g) > 1]
    paths = {e: os.path.join(root, entries[e].rel) for _, g in groups for e in g}
    heads = _digests(paths, [e for _, g in groups for e in g], HEAD, pool)
    same = [(size, g) for (_, size), group in groups for g in _grouped(group, heads)]
    # Files larger than the head whose heads agree: their whole content decides.
    rest = [e for size, g in same if size > HEAD for e in g]
    wholes = _digests(paths, rest, None, pool)
    found = Duplicates()
    for size, group in same:
        for candidates in (_grouped(group, wholes) if size > HEAD else [group]):
            for dup, first in _equal_in(candidates, paths).items():
                found.of[dup] = first
                found.saved_bytes += size
    return found


def check_unchanged(root: bytes, entries: Sequence[ScanEntry], found: Duplicates) -> None:
    """Raise PackError naming the first file (scan order) of the duplicates ``found`` and
    their first copies whose size or modification time differs from the scan's, or that is
    gone: it changed after it was compared, and the store would hold other bytes under its
    name than it has (module docstring)."""
    for entry in sorted({*found.of, *found.of.values()}):
        e = entries[entry]
        path = os.path.join(root, e.rel)
        try:
            st = os.stat(path)
        except OSError as exc:
            raise PackError(f"{show(path)}: file changed while being packed "
                            f"({exc.strerror})") from exc
        if st.st_size != e.size or clamp_mtime_ns(st.st_mtime_ns) != e.mtime_ns:
            raise PackError(f"{show(path)}: file changed while being packed (stored once "
                            "with its identical copies; its size or modification time "
                            "is no longer what the scan saw)")


def _grouped(group: list[int], digests: dict[int, bytes | None]) -> list[list[int]]:
    """``group``'s entries (in entry order) grouped by their digest (groups of one and
    unreadable files left out), each group in entry order."""
    out: dict[bytes, list[int]] = {}
    for entry in group:
        d = digests.get(entry)
        if d is not None:
            out.setdefault(d, []).append(entry)
    return [g for g in out.values() if len(g) > 1]


def _digests(paths: dict[int, bytes], todo: list[int], limit: int | None,
             pool: WorkerPool | None) -> dict[int, bytes | None]:
    """The digest (:func:`_digest`) of each entry of ``todo``, by the workers of ``pool``
    reading contiguous shares of it."""
    if not todo:
        return {}
    names = [paths[e] for e in todo]
    if pool is None or pool.jobs <= 1 or len(todo) < POOL_FROM:
        return dict(zip(todo, digest_all(names, limit)))
    from fanstore.pack.pool import DIGEST

    step = min(SHARE_FILES, -(-len(names) // (4 * pool.jobs)))  # see SHARE_FILES
    shares = [names[i:i + step] for i in range(0, len(names), step)]
    bodies = pool.run(DIGEST, [wire.encode_paths(share, limit) for share in shares],
                      [f"reading files to find duplicates (e.g. {os.fsdecode(share[0])})"
                       for share in shares])
    out = [d for body in bodies for d in wire.decode_digests(body)]
    return dict(zip(todo, out))


def digest_all(names: list[bytes], limit: int | None) -> list[bytes | None]:
    return [_digest(p, limit) for p in names]


def _digest(path: bytes, limit: int | None) -> bytes | None:
    """XXH3-128 of the first ``limit`` bytes of ``path`` (all of it if None); None if it
    cannot be read."""
    h = xxhash.xxh3_128()
    left = limit
    try:
        with open(path, "rb", buffering=0) as f:
            while left is None or left > 0:
                data = f.read(_BLOCK if left is None else min(_BLOCK, left))
                if not data:
                    break
                h.update(data)
                if left is not None:
                    left -= len(data)
    except OSError:
        return None
    return h.digest()


def _equal_in(group: list[int], paths: dict[int, bytes]) -> dict[int, int]:
    """Within ``group`` (entry order, equal digests), each file whose bytes equal an earlier
    one's, mapped to the first such file."""
    firsts: list[int] = []
    out = {}
    for entry in group:
        same = next((f for f in firsts if _same_bytes(paths[f], paths[entry])), None)
        if same is None:
            firsts.append(entry)
        else:
            out[entry] = same
    return out


def _same_bytes(a: bytes, b: bytes) -> bool:
    """True if the files ``a`` and ``b`` hold the same bytes (False if either cannot be read)."""
    try:
        with open(a, "rb") as fa, open(b, "rb") as fb:  # buffered: reads are never short
            while True:
                da, db = fa.read(_BLOCK), fb.read(_BLOCK)
                if da != db:
                    return False
                if not da:
                    return True
    except OSError:
        return False
