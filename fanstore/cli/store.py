"""Commands on a store at rest (no mount): ``verify``, ``info``, ``ls``, ``cat``."""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

from fanstore.cli.common import add_storage_args, nonneg_int, positive_int, size, storage_setup
from fanstore.errors import UsageError


def add_parsers(sub, common) -> None:
    s = sub.add_parser("verify", parents=[common], help="check every file of a store")
    s.add_argument("store", metavar="STORE")
    s.add_argument("--jobs", type=nonneg_int, default=0, help="threads (default: all cores)")
    s.add_argument("--local-dir", metavar="DIR",
                   help="check the partitions staged in DIR (a node's share) instead of "
                        "STORE's; partitions not staged there are skipped")
    s.add_argument("--no-progress", action="store_true")
    s.set_defaults(func=cmd_verify)

    s = sub.add_parser("info", parents=[common], help="describe a store")
    s.add_argument("store", metavar="STORE")
    s.add_argument("--json", action="store_true")
    s.add_argument("--local-capacity", type=size, default=None, metavar="SIZE",
                   help="also show how many copies of the store fit in SIZE per node "
                        "(--replicas auto), for 1 to 64 nodes or --nodes N")
    s.add_argument("--nodes", type=positive_int, default=None, metavar="N",
                   help="the node count for --local-capacity (default: a table of 1, 2, 4, "
                        "8, 16, 32, 64)")
    add_storage_args(s)
    s.set_defaults(func=cmd_info)

    s = sub.add_parser("ls", parents=[common], help="list a directory of a store")
    s.add_argument("store", metavar="STORE")
    s.add_argument("path", metavar="PATH", nargs="?", default="")
    s.add_argument("-l", "--long", action="store_true")
    add_storage_args(s)
    s.set_defaults(func=cmd_ls)

    s = sub.add_parser("cat", parents=[common], help="write a file of a store to stdout")
    s.add_argument("store", metavar="STORE")
    s.add_argument("path", metavar="PATH")
    s.set_defaults(func=cmd_cat)


def _open_store(path: str):
    from fanstore.store import LocalStore

    return LocalStore(path)


def cmd_info(args) -> int:
    from fanstore.format.index import read_index

    storage_setup(args)
    if args.nodes is not None and args.local_capacity is None:
        raise UsageError("--nodes goes with --local-capacity (how many copies fit on N nodes)")
    index = read_index(args.store)
    info = _store_info(index)
    if args.local_capacity is not None:
        info["local_capacity"] = _capacity_fits(index, args.local_capacity, args.nodes)
    if args.json:
        print(json.dumps(info, indent=2, sort_keys=True))
        return 0
    c = {key: info["counts"].get(key, 0)
         for key in ("files", "dirs", "symlinks", "raw_bytes", "stored_bytes")}
    print(f"store          {_show_store(args.store)}")
    print(f"format         v{info['format_version']} ({info['created_by']})")
    print(f"entries        {c['files']:,} files, {c['dirs']:,} dirs, {c['symlinks']:,} symlinks")
    print(f"raw bytes      {c['raw_bytes']:,}")
    print(f"stored bytes   {c['stored_bytes']:,} (ratio {info['ratio']:.2f}x)")
    print(f"index bytes    {info['index_bytes']:,} ({info['index_bytes_per_entry']:.0f} B/entry "
          f"on disk, {info['memory_bytes_per_entry']:.0f} B/entry in memory)")
    print(f"chunk size     {info['chunk_size']:,}")
    if info.get("access"):
        print(f"access         {info['access']}" + (
            " (only its owner may read it: directory 0700, files 0600)"
            if info["access"] == "private" else ""))
    bc = sum(1 for p in info["partitions"] if p["broadcast"])
    print(f"partitions     {len(info['partitions'])}" + (f" ({bc} broadcast)" if bc else ""))
    for spec, n in info["codec_chunks"].items():
        print(f"codec          {spec}: {n:,} chunks")
    if info["solid_chunks"]:
        print(f"solid blocks   {info['solid_chunks']:,} chunks holding "
              f"{info['files_in_solid_chunks']:,} files")
    if info["duplicate_files"]:
        print(f"stored once    {info['duplicate_files']:,} files identical to others "
              f"({info['duplicate_bytes']:,} raw bytes not stored again)")
    if info.get("selection"):
        print(f"selection      {info['selection'].get('chosen')} "
              f"(mode {info['selection'].get('mode')})")
    if "local_capacity" in info:
        for line in _capacity_lines(info["local_capacity"]):
            print(line)
    return 0


#: Node counts of the ``info --local-capacity`` table (without --nodes).
CAPACITY_NODES = (1, 2, 4, 8, 16, 32, 64)


def _capacity_fits(index, capacity: int, nodes: int | None) -> dict[str, Any]:
    """How many copies of the store fit in ``capacity`` bytes per node, per node count."""
    from fanstore.daemon.replicas import fit

    sizes = [p.size for p in index.partitions]
    flags = [p.broadcast for p in index.partitions]
    counts = (nodes,) if nodes else CAPACITY_NODES
    return {"bytes": capacity,
            "fits": [fit(sizes, flags, n, capacity).to_json() for n in counts]}


def _capacity_lines(doc: dict[str, Any]) -> list[str]:
    from fanstore.units import show_size

    lines = [(f"local capacity {show_size(doc['bytes'])} per node: copies that fit "
              "(--replicas auto)"),
             f"  {'nodes':>6}  {'copies':>6}  fullest node holds"]
    for f in doc["fits"]:
        k, n = f["replicas"], f["nodes"]
        if k == 0:
            what = f"nothing fits: one copy needs {show_size(f['one_copy_node_bytes'])}"
        elif f["every_partition_on_every_node"]:
            what = f"{show_size(f['node_bytes'])} (every partition on every node)"
        else:
            what = (f"{show_size(f['node_bytes'])} ({k + 1} copies would need "
                    f"{show_size(f['next_copy_node_bytes'])})")
        lines.append(f"  {n:>6}  {k:>6}  {what}")
    return lines


def _show_store(store: str) -> str:
    from fanstore.storage import is_url

    return store if is_url(store) else os.path.abspath(store)


def _store_info(index) -> dict[str, Any]:
    import numpy as np

    from compressors import get_codec

    counts = dict(index.meta.get("counts", {}))
    raw, stored = counts.get("raw_bytes", 0), counts.get("stored_bytes", 0)
    per_codec = np.bincount(index.chunks["codec"], minlength=len(index.codecs))
    codec_chunks = {}
    for slot, cfg in enumerate(index.codecs):
        if per_codec[slot]:
            try:
                spec = get_codec(cfg).spec
            except Exception:  # noqa: BLE001 - a codec this install lacks
                spec = cfg.get("id", "?")
            codec_chunks[spec] = codec_chunks.get(spec, 0) + int(per_codec[slot])
    from fanstore.namespace import metadata_bytes

    memory = metadata_bytes(index)
    solid_chunks, solid_files, dup_files, dup_bytes = _sharing(index)
    n = max(1, index.n_entries)
    return {
        "format_version": index.meta.get("format_version"),
        "created_by": index.meta.get("created_by"),
        "counts": counts,
        "ratio": raw / stored if stored else 1.0,
        "chunk_size": index.chunk_size,
        "index_bytes": index.stored_size,
        "index_bytes_per_entry": index.stored_size / n,
        "memory_bytes_per_entry": memory / n,
        "partitions": [dict(p.to_json(), name=p.name) for p in index.partitions],
        "codecs": index.codecs,
        "codec_chunks": codec_chunks,
        "solid_chunks": solid_chunks,
        "files_in_solid_chunks": solid_files,
        "duplicate_files": dup_files,
        "duplicate_bytes": dup_bytes,
        "pack": index.meta.get("pack", {}),
        "selection": index.meta.get("selection"),
        "access": index.meta.get("access"),
    }


def _sharing(index) -> tuple[int, int, int, int]:
    """Solid blocks (format v2: chunks that more than one file lives in) and the files
    they hold; files stored once as a copy of an earlier identical file (pack's dedup: the
    same run and offset as another file) and their bytes, which no partition holds."""
    import numpy as np

    from fanstore.format.index import KIND_FILE

    e = index.entries
    files = np.flatnonzero((e["kind"] == KIND_FILE) & (e["count"] > 0))
    keys = np.stack([e[c][files].astype(np.int64) for c in ("first", "count", "offset")], 1)
    _, firsts = np.unique(keys, axis=0, return_index=True)
    copies = np.setdiff1d(np.arange(len(files)), firsts)
    dup_bytes = int(e["size"][files[copies]].astype(np.int64).sum())
    single = keys[firsts][keys[firsts][:, 1] == 1]
    refs = np.bincount(single[:, 0], minlength=index.n_chunks)
    return int(np.count_nonzero(refs > 1)), int(refs[refs > 1].sum()), len(copies), dup_bytes


def cmd_ls(args) -> int:
    import stat as st_mod

    from fanstore.format.index import KIND_DIR, KIND_SYMLINK, read_index
    from fanstore.namespace import Namespace

    storage_setup(args)
    ns = Namespace(read_index(args.store))
    entry = ns.resolve(args.path or "")
    entries = list(ns.children(entry)) if ns.is_dir(entry) else [entry]
    # Names are bytes: write them as they are, whatever the terminal's encoding.
    out = sys.stdout.buffer
    for child in entries:
        name = ns.name(child) if child != entry else ns.path(child)
        if not args.long:
            out.write(name + (b"/" if ns.is_dir(child) else b"") + b"\n")
            continue
        s = ns.stat(child)
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(s.mtime_ns / 1e9))
        line = f"{st_mod.filemode(s.mode)} {s.size:>12} {when} ".encode() + name
        if s.kind == KIND_SYMLINK:
            line += b" -> " + ns.readlink(child)
        elif s.kind == KIND_DIR:
            line += b"/"
        out.write(line + b"\n")
    out.flush()
    return 0


def cmd_cat(args) -> int:
    with _open_store(args.store) as store:
        entry = store.file_entry(args.path)
        out = sys.stdout.buffer
        for chunk in store.iter_file(entry):
            out.write(chunk)
        out.flush()
    return 0


def cmd_verify(args) -> int:
    from fanstore.verify import verify_store

    report = verify_store(args.store, jobs=args.jobs,
                          progress=None if not args.no_progress else False,
                          data_dir=args.local_dir, only_present=bool(args.local_dir))
    for line in report.damaged_lines():
        print(line)
    print(report.summary(), file=sys.stderr)
    return 0 if report.intact else 1
