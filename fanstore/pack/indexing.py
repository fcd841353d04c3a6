"""The index of a packed store, built from the chunk rows the partition writers return.

Both packers end here: the planned one of a directory (``fanstore.pack.write``, rows from
``fanstore.pack.worker``) and the streaming one (``fanstore.pack.stream``). The entries come
from the tree (a scan, or the namespace a stream assembled), the chunks from the rows; the
metadata records the codec table, the partitions, the counts and how the pack was run.
"""

from __future__ import annotations

import os

import numpy as np

from fanstore.format.index import (
    KIND_DIR,
    KIND_FILE,
    KIND_SYMLINK,
    IndexBuilder,
    PartitionInfo,
    encode_index,
)
from fanstore.pack.options import PackOptions
from fanstore.pack.scan import ScanResult
from fanstore.pack.worker import PartResult
from fanstore.storage import is_url
from fanstore.version import __version__


def build_index(scan: ScanResult, results: list[PartResult], configs, options: PackOptions,
                n_normal: int, src: str, access: str | None = None,
                duplicates: dict[int, int] | None = None) -> tuple[bytes, int]:
    """The index bytes of a store made of ``results`` (one per partition, in number order)
    for the tree ``scan``; and the stored bytes of all partitions. ``access``: "private"
    or "shared", recorded in the metadata (``pack.access``). ``duplicates``: file entries
    stored once (in no result), each mapped to the entry of its first copy, whose chunk run
    it gets (``fanstore.pack.dedup``)."""
    entries = scan.entries
    n_chunks = sum(len(r.chunks["part"]) for r in results)
    b = IndexBuilder(len(entries), n_chunks)
    _entry_rows(b, entries)
    base = 0
    partitions = []
    for r in results:
        k = len(r.chunks["part"])
        for name, arr in r.chunks.items():
            b.chunks[name][base : base + k] = arr
        if r.chunk_firsts is not None:  # solid blocks: files may share a chunk
            firsts = base + r.chunk_firsts.astype(np.int64)
        else:  # each file's chunks follow the previous file's
            firsts = base + np.concatenate(([0], np.cumsum(r.chunk_counts)[:-1])).astype(
                np.int64)
        b.entries["first"][r.entries] = np.where(r.chunk_counts > 0, firsts, 0)
        b.entries["count"][r.entries] = r.chunk_counts
        if r.data_offsets is not None:  # solid blocks only (the streamed packer has none)
            b.entries["offset"][r.entries] = r.data_offsets
        b.entries["checksum"][r.entries] = r.file_sums
        base += k
        partitions.append(PartitionInfo(
            number=r.number, size=r.size, checksum=r.checksum, files=len(r.entries),
            raw_bytes=r.raw_bytes, broadcast=r.number >= n_normal,
        ))
    if duplicates:
        dup = np.fromiter(duplicates.keys(), dtype=np.int64, count=len(duplicates))
        first = np.fromiter(duplicates.values(), dtype=np.int64, count=len(duplicates))
        for name in ("first", "count", "offset", "checksum"):
            b.entries[name][dup] = b.entries[name][first]
    # Empty files own no chunks; point them at 0 so the runs of the others stay contiguous.
    stored = int(sum(p.size for p in partitions))
    meta = {
        "chunk_size": options.chunk_size,
        "codecs": configs,
        "partitions": [p.to_json() for p in partitions],
        "counts": {
            "files": sum(1 for e in entries if e.kind == KIND_FILE),
            "dirs": sum(1 for e in entries if e.kind == KIND_DIR) - 1,  # not the root
            "symlinks": sum(1 for e in entries if e.kind == KIND_SYMLINK),
            "raw_bytes": scan.raw_bytes,
            "stored_bytes": stored,
        },
        "pack": {
            "source": src if is_url(src) else os.path.abspath(src),
            "partitions": n_normal,
            "broadcast": list(options.broadcast),
            "chunk_size": options.chunk_size,
            "tool": f"fanstore {__version__}",
        },
    }
    if access is not None:
        meta["access"] = access
    meta.update(options.extra_meta)
    data = encode_index(meta, b.entries, b.chunks, None, bytes(b.names), bytes(b.targets),
                        compact=True)
    return data, stored


def _entry_rows(b: IndexBuilder, entries) -> None:
    """The entry columns of the scanned tree: one pass to pull the fields out, then whole
    columns at once (names joined once; the v3 index needs no lookup table)."""
    n = len(entries)
    kind = np.fromiter((e.kind for e in entries), dtype=np.uint8, count=n)
    b.entries["kind"][:] = kind
    b.entries["parent"][:] = np.fromiter((e.parent for e in entries), dtype=np.int64, count=n)
    b.entries["mode"][:] = np.fromiter((e.mode for e in entries), dtype=np.int64, count=n)
    b.entries["mtime_ns"][:] = np.fromiter((e.mtime_ns for e in entries), dtype=np.int64,
                                           count=n)
    b.set_names([os.path.basename(e.rel) for e in entries[1:]])
    files = np.flatnonzero(kind == KIND_FILE)
    b.entries["size"][files] = np.fromiter((entries[i].size for i in files), dtype=np.int64,
                                           count=len(files))
    for i in np.flatnonzero(kind != KIND_FILE):
        e = entries[i]
        if e.kind == KIND_DIR:
            b.entries["first"][i], b.entries["count"][i] = e.children
        else:
            b.set_target(i, e.target)
            b.entries["size"][i] = len(e.target)
