"""``fanstore pack``: the command and its arguments. What the codec options mean is
``fanstore.select.packpolicy``'s; packing is ``fanstore.pack``'s (and, under an MPI launcher,
``fanstore.daemon.mpipack``'s)."""

from __future__ import annotations

import sys
from typing import Any

from fanstore.cli.common import (
    add_select_budget_args,
    add_storage_args,
    nonneg_int,
    positive_int,
    say,
    storage_setup,
)
from fanstore.errors import UsageError


def add_parsers(sub, common) -> None:
    s = sub.add_parser("pack", parents=[common], help="compress a dataset into a store",
                       description="Compress SRC into a store at DEST (partitions + index). "
                                   "SRC: a directory, a tar archive (plain, .gz, .bz2, .xz, "
                                   ".zst), tar shards ('shards-{000..099}.tar' or a file "
                                   "listing them), a zip archive, or s3://bucket/prefix. "
                                   "DEST: a directory or s3://bucket/name.fs.")
    s.add_argument("src", metavar="SRC")
    s.add_argument("dest", metavar="DEST")
    s.add_argument("--partitions", type=positive_int, default=8,
                   help="number of partitions (default 8; at least the node count)")
    s.add_argument("--codec", default=None, metavar="SPEC",
                   help="NAME[:ARG...][+dict][+solidNk] pins one codec (zstd:3, lz4, "
                        "lz4hc:9, snappy, blosc2:zstd:5:shuffle:4, zlib:6, none, jpegxl: "
                        "whole JPEGs recompressed losslessly, other files raw; any name "
                        "'fanstore select' reports); +dict: zstd:L with a dictionary "
                        "trained per kind of small files; +solidNk: as --solid-kb N; "
                        "'auto': the full selector. Default: a quick selection per file "
                        "kind (a few seconds on a small sample, reported in one line; "
                        "small files in solid blocks of 32 KiB at zstd:13)")
    s.add_argument("--kind-codec", action="append", metavar="KIND=SPEC",
                   help="files of one kind (EXT/BAND as 'fanstore select --per-kind' names "
                        "kinds, e.g. json/tiny; bands tiny, small, medium, large, huge) get "
                        "SPEC instead of --codec (repeatable; what the report of a per-kind "
                        "selection prints)")
    s.add_argument("--solid-kb", type=nonneg_int, default=None, metavar="N",
                   help="solid blocks: files of at most N KiB are packed back to back, by "
                        "kind, into blocks of N KiB, each compressed as one chunk (more "
                        "capacity on small files; a read decodes its whole block). 0: none "
                        "(each file on its own). Default: 32 for the kinds of small files "
                        "where blocks store best. The same as +solidNk in --codec")
    s.add_argument("--jobs", type=nonneg_int, default=0,
                   help="compression worker processes (default: all cores, or none for "
                        "a directory under 2 MiB: this process compresses it); with an "
                        "s3:// source also the parallel range reads (default 8)")
    s.add_argument("--chunk-kb", type=positive_int, default=1024,
                   help="chunk size for large files in KiB (default 1024)")
    s.add_argument("--broadcast", action="append", metavar="RELDIR",
                   help="put the files under RELDIR on every node (repeatable)")
    s.add_argument("--symlinks", choices=("store", "follow", "skip"), default="store",
                   help="symlinks that lead outside SRC (absolute, or '..' above it): "
                        "'store' keeps them as symlinks with their targets as they are (as "
                        "mksquashfs and tar; the mount shows them, the kernel resolves them "
                        "on the host), 'follow' stores the files they lead to instead (a "
                        "directory SRC only), 'skip' leaves them out. Symlinks that stay "
                        "inside SRC are kept in every mode. Default: store")
    s.add_argument("--no-dedup", action="store_true",
                   help="store every file's bytes, even a file identical to an earlier one "
                        "(default: such files are stored once and keep every name; a "
                        "directory SRC only)")
    s.add_argument("--skip-unreadable", action="store_true",
                   help="leave out entries that cannot be packed instead of failing")
    s.add_argument("--force", action="store_true", help="replace an existing store at DEST")
    s.add_argument("--shared", action="store_true",
                   help="let other users read the store as the umask allows even though the "
                        "source holds entries they may not read (or is in S3); without it "
                        "such a store is private to you (directory 0700, files 0600)")
    s.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_storage_args(s)
    add_select_budget_args(s, for_pack=True)
    s.set_defaults(func=cmd_pack)


def cmd_pack(args) -> int:
    from fanstore import storage
    from fanstore.pack import PackOptions, pack, pack_any
    from fanstore.pack.options import Symlinks
    from fanstore.select.packpolicy import AUTO, PolicyRequest, plan_policy
    from fanstore.pack.sources import detect

    storage_setup(args)
    extra: dict[str, Any] = {}
    kind = detect(args.src)[0]
    symlinks = Symlinks(args.symlinks)
    request = PolicyRequest(codec=args.codec, solid_kb=args.solid_kb,
                            chunk_size=args.chunk_kb * 1024,
                            skip_unreadable=args.skip_unreadable, symlinks=symlinks,
                            seed=args.seed, kind_codecs=_kind_codecs(args.kind_codec),
                            selection=lambda: _selection_options(args), notify=say)

    def make_policy(scan=None):
        plan = plan_policy(args.src, request, kind, scan)
        if plan.summary is not None:
            print(f"codec selection: {plan.summary}", file=sys.stderr)
        extra.update(plan.meta)
        return plan.policy

    options = PackOptions(
        partitions=args.partitions,
        jobs=args.jobs,
        chunk_size=args.chunk_kb * 1024,
        skip_unreadable=args.skip_unreadable,
        force=args.force,
        broadcast=args.broadcast or [],
        progress=None if not args.no_progress else False,
        extra_meta=extra,
        notify=say,
        shared=args.shared,
        symlinks=symlinks,
        dedup=not args.no_dedup,
    )
    request.check()
    from fanstore.daemon.jobenv import launcher_world_size

    if launcher_world_size() is not None:
        # One rank per node: rank 0 plans and writes the index, every rank compresses.
        from fanstore.daemon.mpipack import pack_mpi

        if kind != "directory" or storage.is_url(args.dest):
            raise UsageError("a pack across MPI ranks needs a directory source and a "
                             "destination on a shared file system; run one process for "
                             "an archive, S3 source or S3 destination")

        summary = pack_mpi(args.src, args.dest, make_policy, options)
        if summary is None:
            return 0
    elif kind == "directory" and not storage.is_url(args.dest):
        from fanstore.pack.pool import WorkerPool
        from fanstore.pack.write import check_arguments, pack_workers

        check_arguments(args.src, args.dest, options)  # before a selection takes seconds
        with WorkerPool(pack_workers(options)) as pool:  # started after the scan, if needed
            # the quick selection runs on the scan while the workers look for duplicates;
            # the full selector (auto) times trial packs: alone, before the pack starts
            policy = make_policy() if args.codec == AUTO else make_policy
            summary = pack(args.src, args.dest, policy, options, pool=pool)
    else:
        summary = pack_any(args.src, args.dest, make_policy(), options)
    for line in summary.lines():
        print(line)
    return 0


def _kind_codecs(items: list[str] | None) -> dict[str, str]:
    """``--kind-codec KIND=SPEC`` arguments as {kind: spec} (the specs are checked where
    they are used)."""
    from fanstore.kinds import LAST_BAND, SIZE_BANDS

    bands = {name for _, name in SIZE_BANDS} | {LAST_BAND}
    out: dict[str, str] = {}
    for item in items or []:
        kind, _, spec = item.partition("=")
        ext, _, band = kind.partition("/")
        if not ext or band not in bands or not spec:
            raise UsageError(f"--kind-codec {item}: give KIND=SPEC with KIND as EXT/BAND "
                             f"(BAND one of {', '.join(sorted(bands))}), e.g. json/tiny=zstd:3")
        if kind in out:
            raise UsageError(f"--kind-codec: {kind} is given twice")
        out[kind] = spec
    return out


def _selection_options(args):
    from fanstore.cli.select import selection_options

    return selection_options(args)
