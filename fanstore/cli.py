"""The ``fanstore`` command. Only ``main`` turns errors into messages and exit codes.

Exit codes: 0 ok; 1 failure (including damaged files found by ``verify``); 2 bad usage;
3 no codec meets the budget (``select``); 32/33 store format too old/new; 70 internal
error; 130 interrupted.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from typing import Any

from fanstore.version import __version__
from fanstore.errors import FanStoreError, MountError, UsageError

log = logging.getLogger("fanstore")


#: The FUSE frontend of ``fanstore mount`` unless --frontend or $FANSTORE_FRONTEND says
#: otherwise: "auto" is the kernel-protocol frontend, or pyfuse3 in prefetch mode
#: (launch.resolve_frontend; docs/benchmarks.md says why).
DEFAULT_FRONTEND = "auto"


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (no usage dump) and exit status 2."""

    def error(self, message: str):  # type: ignore[override]
        raise UsageError(f"{message} (see '{self.prog} --help')")


def _ranks_per_node(text: str):
    if text == "auto":
        return text
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected auto or a positive integer, got {text!r}")
    return value


def _number(kind, minimum, strict: bool):
    """An argparse type: ``kind`` (int or float) at least (or above) ``minimum``."""
    what = "a whole number" if kind is int else "a number"
    if strict:
        bound = f"be more than {minimum}" if minimum else "be positive"
    else:
        bound = f"be at least {minimum}" if minimum else "not be negative"

    def convert(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if value < minimum or (strict and value == minimum) or value != value:
            raise argparse.ArgumentTypeError(f"must {bound}, got {text}")
        return value

    return convert


_positive_int = _number(int, 1, strict=False)
_nonneg_int = _number(int, 0, strict=False)
_positive_float = _number(float, 0.0, strict=True)


def _size(text: str) -> int:
    """An argparse type: a size in bytes (500G, 1.5T, 800M, 123456: fanstore.units)."""
    from fanstore.units import parse_size

    try:
        value = parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be more than 0 bytes, got {text!r}")
    return value


def _replicas(text: str) -> int | str:
    """An argparse type: a number of copies, or ``auto``."""
    if text.strip().lower() == "auto":
        return "auto"
    try:
        return _positive_int(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected a whole number of copies (at least 1) or "
                                         f"'auto', got {text!r}") from None


# --------------------------------------------------------------------------- pack


def cmd_pack(args) -> int:
    from fanstore import storage
    from fanstore.pack import PackOptions, pack, pack_any
    from fanstore.pack.sources import detect

    _storage_setup(args)
    extra: dict[str, Any] = {}
    scanned: dict[str, Any] = {}
    kind = detect(args.src)[0]

    def make_policy():
        policy, meta = _pack_policy(args, scanned, kind)
        extra.update(meta)
        return policy

    options = PackOptions(
        partitions=args.partitions,
        jobs=args.jobs,
        chunk_size=args.chunk_kb * 1024,
        skip_unreadable=args.skip_unreadable,
        force=args.force,
        broadcast=args.broadcast or [],
        progress=None if not args.no_progress else False,
        extra_meta=extra,
        notify=lambda text: print(f"fanstore: {text}", file=sys.stderr, flush=True),
        shared=args.shared,
    )
    if args.solid_kb is not None and args.solid_kb * 1024 > options.chunk_size:
        raise UsageError(f"--solid-kb {args.solid_kb} is larger than the chunk size "
                         f"({args.chunk_kb} KiB; raise --chunk-kb)")
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
        from fanstore.pack.write import check_arguments

        check_arguments(args.src, args.dest, options)  # before a selection takes seconds
        policy = make_policy()
        summary = pack(args.src, args.dest, policy, options, scan=scanned.get("scan"))
    else:
        summary = pack_any(args.src, args.dest, make_policy(), options)
    for line in summary.lines():
        print(line)
    return 0


def _pack_policy(args, scanned: dict[str, Any], source_kind: str = "directory"):
    """The codec policy of ``fanstore pack``: ``--codec SPEC`` (pinned), ``SPEC+dict``
    (zstd with a dictionary per kind of small files), ``auto`` (the full selector), or by
    default the quick selection (zstd:3 for a streamed source: nothing to sample before it
    is read). Returns (policy, index metadata to record)."""
    from compressors import CodecError, parse_spec
    from fanstore.pack import CodecPolicy

    spec = args.codec
    meta: dict[str, Any] = {}
    if source_kind != "directory":
        # The selectors and solid blocks sample and plan a tree; a streamed source is packed
        # as it is read, with one codec.
        if spec == "auto" or (spec or "").endswith("+dict") or args.solid_kb:
            what = ("--codec auto" if spec == "auto" else
                    "--solid-kb" if args.solid_kb else f"--codec {spec}")
            raise UsageError(f"{what} needs a directory source; with a {source_kind} source "
                             "give a codec (e.g. --codec zstd:3)")
        if spec is None:
            print(f"fanstore: a {source_kind} source is packed with zstd:3 (the quick "
                  "selection samples a directory; --codec pins another)", file=sys.stderr)
            spec = "zstd:3"
    if spec == "auto":
        policy, meta = _auto_policy(args)
    elif spec is None or spec.endswith("+dict"):
        from fanstore.select import quick

        files = _source_files(args.src, scanned)
        if "scan" in scanned and scanned["scan"].problems and not args.skip_unreadable:
            return CodecPolicy(parse_spec("zstd:3")), meta  # pack reports the problems
        if spec is None:
            choice = quick.quick_select(files, args.chunk_kb * 1024, root=args.src)
            print(f"fanstore: {choice.line()}", file=sys.stderr)
            policy, meta = choice.policy(), {"selection": choice.to_json()}
        else:
            base = spec[: -len("+dict")]
            try:
                codec = parse_spec(base)
            except CodecError as exc:
                raise UsageError(f"--codec: {exc}") from None
            policy = quick.dict_policy(files, codec, args.chunk_kb * 1024, root=args.src)
    else:
        try:
            policy = CodecPolicy(parse_spec(spec))
        except CodecError as exc:
            raise UsageError(f"--codec: {exc}") from None
    if args.solid_kb is not None:
        block = args.solid_kb * 1024
        policy.solid = block
        policy.solid_by_kind = {kind: block for kind in policy.by_kind}
    return policy, meta


def _source_files(src: str, scanned: dict[str, Any]):
    """The regular files of SRC as the selector sees them; the scan is kept for pack."""
    from fanstore.format.index import KIND_FILE
    from fanstore.pack.scan import scan_tree
    from fanstore.select.sample import SourceFile

    if not os.path.isdir(src):
        return []  # pack reports the bad source
    scan = scan_tree(src)
    scanned["scan"] = scan
    return [SourceFile(os.fsdecode(e.rel), os.path.join(scan.root, e.rel), e.size)
            for e in scan.entries if e.kind == KIND_FILE]


def _auto_policy(args):
    """Run the codec selector on the source and turn its choice into a pack policy."""
    try:
        from fanstore.select import policy_from_selection, run_selection, selection_options
    except ImportError as exc:  # pragma: no cover - select is part of the package
        raise UsageError(f"--codec auto is not available: {exc}") from None
    sel_opts = selection_options(args)
    result = run_selection(args.src, sel_opts)
    policy = policy_from_selection(result)
    print(f"codec selection: {result.summary_line()}", file=sys.stderr)
    return policy, {"selection": result.to_json()}


# --------------------------------------------------------------------------- mount


def cmd_mount(args) -> int:
    from fanstore import launch
    from fanstore.daemon.node import NodeOptions
    from fanstore.frontend import MountOptions

    _storage_setup(args)
    from fanstore.storage import is_url

    if is_url(args.store) and not args.local_dir:
        raise UsageError(f"{args.store} is in object storage: mounting it needs --local-dir "
                         "(node-local storage to stage its partitions into)")
    if args.local_capacity is not None and args.replicas != "auto":
        raise UsageError("--local-capacity sizes --replicas auto: give --replicas auto, or "
                         "leave --local-capacity out")
    if args.local_capacity is not None and not args.local_dir:
        raise UsageError("--local-capacity is the room for staged partitions: it needs "
                         "--local-dir")
    options = NodeOptions(
        store=args.store, mountpoint=args.mountpoint,
        mount=MountOptions(frontend=args.frontend, cache_mb=args.cache_mb,
                           threads=args.threads, workers=args.workers,
                           allow_other=args.allow_other, mode=args.mode,
                           prefetch_mb=args.prefetch_mb),
        local_dir=args.local_dir, replicas=args.replicas, local_capacity=args.local_capacity,
        remote_timeout=args.remote_timeout, keep_local=args.keep_local,
        stage_jobs=args.stage_jobs, ranks_per_node=args.ranks_per_node)

    def notify(text: str) -> None:
        print(f"fanstore: {text}", file=sys.stderr, flush=True)

    outcome = launch.mount(options, foreground=args.foreground, debug=args.debug,
                           log_file=args.log, notify=notify)
    if outcome.error is not None:
        print(f"fanstore: error: {outcome.error}", file=sys.stderr, flush=True)
    if outcome.hard_exit:  # an MPI rank that must not finalize, a hydra shim, a daemon
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(outcome.code)
    return outcome.code


def _storage_setup(args) -> None:
    """Object-storage settings of this command (inherited by forked workers and daemons),
    with a warning when they expose credentials (given on the command line, or in a file
    other users may read)."""
    from fanstore import storage

    text = getattr(args, "storage_options", None)
    options = storage.parse_storage_options(text)
    warnings = storage.exposure_warnings(text, options) if text else []
    env = os.environ.get("FANSTORE_STORAGE_OPTIONS")
    if not text and env and env.startswith("@"):
        try:  # a bad one is reported where it is used (not every command uses S3)
            env_options = storage.parse_storage_options(env, "$FANSTORE_STORAGE_OPTIONS")
        except UsageError:
            env_options = {}
        warnings = storage.exposure_warnings(env, env_options, on_command_line=False)
    for line in warnings:
        print(f"fanstore: warning: {line}", file=sys.stderr, flush=True)
    storage.set_default_options(options)


def cmd_umount(args) -> int:
    from fanstore import control, mounttable, runtime
    from fanstore.process import pid_alive

    mnt = args.mountpoint
    status = mounttable.mount_status(mnt)
    state = runtime.read_state(mnt) or {}
    pid = state.get("pid")
    runtime.sweep_shared()  # shared-memory files of daemons that were killed
    if status == "none":
        if pid_alive(pid) and state.get("phase") not in ("stopped", "failed"):
            control.control(mnt, {"op": "shutdown", "reason": "fanstore umount"})
            _wait_pid(pid, args.timeout, mnt)
            return 0
        raise MountError(f"{mnt} is not mounted")
    if status == "stale":
        ok, msg = mounttable.fusermount_unmount(mnt, lazy=True)
        if not ok:
            raise MountError(f"{mnt}: cannot clean up the stale mount: {msg}")
        print(f"fanstore: {mnt}: cleaned up a stale mount (its daemon had died)", file=sys.stderr)
        return 0
    # Unmount from outside (not lazily unless asked): a busy mount is refused instead of
    # being detached under its readers. The daemon sees its mount go, exits (or, in a
    # multi-rank job, keeps serving its peers until every rank is done).
    ok, msg = mounttable.fusermount_unmount(mnt, lazy=args.lazy)
    retry_until = time.monotonic() + 2.0
    while not ok and "busy" in msg.lower() and time.monotonic() < retry_until:
        # a prefetch-mode mount lists directories through itself for a moment now and
        # then: busy for that moment is not the user's open file
        time.sleep(0.1)
        ok, msg = mounttable.fusermount_unmount(mnt, lazy=args.lazy)
    if not ok:
        if mounttable.mount_status(mnt) == "none":
            return 0
        if "busy" in msg.lower():
            raise MountError(f"{mnt} is busy (files or directories in use); close them or use "
                             "--lazy")
        raise MountError(f"cannot unmount {mnt}: {msg}")
    if pid and not _wait_unmounted(pid, args.timeout, mnt):
        raise MountError(f"{mnt}: daemon pid {pid} did not exit within {args.timeout:g} s")
    return 0


def _wait_unmounted(pid: int, timeout: float, mnt: str) -> bool:
    """Wait until the mount is gone and its daemon has exited or is only serving peers."""
    from fanstore import mounttable, runtime
    from fanstore.process import pid_alive

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if mounttable.mount_status(mnt) == "none":
            state = runtime.read_state(mnt) or {}
            if not pid_alive(pid) or state.get("phase") in ("draining", "stopped"):
                return True
        time.sleep(0.05)
    return False


def _wait_pid(pid: int | None, timeout: float, mnt: str, must: bool = True) -> bool:
    from fanstore.process import pid_alive

    deadline = time.monotonic() + timeout
    while pid_alive(pid):
        if time.monotonic() > deadline:
            if must:
                raise MountError(f"{mnt}: daemon pid {pid} did not exit within {timeout:g} s")
            return False
        time.sleep(0.05)
    return True


def cmd_wait(args) -> int:
    """Wait until this node's daemon reports ready (all ranks are mounted by then).

    A state left by an earlier daemon counts only once it is newer than this wait: the
    daemon being waited for may not have started yet.
    """
    from fanstore import mounttable, runtime
    from fanstore.process import pid_alive

    mnt = args.mountpoint
    start = time.time()
    deadline = time.monotonic() + args.timeout
    while True:
        state = runtime.read_state(mnt) or {}
        current = pid_alive(state.get("pid")) or state.get("updated", 0) >= start
        phase = state.get("phase") if current else None
        if phase == "ready" and mounttable.mount_status(mnt) == "live":
            return 0
        if phase in ("failed", "stopped"):
            why = f": {state['error']}" if state.get("error") else f" (phase: {phase})"
            raise MountError(f"{mnt}: the daemon stopped before the mount was ready{why}")
        if phase and not pid_alive(state.get("pid")):
            raise MountError(f"{mnt}: the daemon died before the mount was ready (phase: "
                             f"{phase})")
        if time.monotonic() > deadline:
            raise MountError(f"{mnt}: not ready after {args.timeout:g} s (phase: "
                             f"{phase or 'not started'})")
        time.sleep(0.1)


def cmd_prefetch(args) -> int:
    from fanstore import control

    if args.list == "-":
        lines = sys.stdin.buffer.read().splitlines()
    else:
        try:
            with open(args.list, "rb") as f:
                lines = f.read().splitlines()
        except OSError as exc:
            raise UsageError(f"{args.list}: cannot read: {exc.strerror}") from None
    paths = [os.fsdecode(line) for line in lines if line.strip()]
    reply = control.control(args.mountpoint, {"op": "prefetch", "paths": paths,
                                              "client": args.client}, timeout=120)
    print(f"prefetch order of {reply['files']:,} files sent"
          + (f" ({reply['unknown']:,} paths not in the store were left out)"
             if reply.get("unknown") else ""))
    return 0


def cmd_stats(args) -> int:
    from fanstore import control

    reply = control.control(args.mountpoint, {"op": "stats"})
    if args.json:
        print(json.dumps(reply, indent=2, sort_keys=True))
        return 0
    width = max(len(k) for k in reply)
    for key in sorted(reply):
        print(f"{key:<{width}}  {reply[key]}")
    return 0


# --------------------------------------------------------------------------- offline


def _open_store(path: str):
    from fanstore.store import LocalStore

    return LocalStore(path)


def cmd_info(args) -> int:
    from fanstore.format.index import read_index

    _storage_setup(args)
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
    per_codec = np.bincount(index.c["codec"], minlength=len(index.codecs))
    codec_chunks = {}
    for slot, cfg in enumerate(index.codecs):
        if per_codec[slot]:
            try:
                spec = get_codec(cfg).spec
            except Exception:  # noqa: BLE001 - a codec this install lacks
                spec = cfg.get("id", "?")
            codec_chunks[spec] = codec_chunks.get(spec, 0) + int(per_codec[slot])
    from fanstore.format.index import KIND_FILE
    from fanstore.namespace import metadata_bytes

    memory = metadata_bytes(index)
    # Solid blocks (format v2): chunks that more than one file lives in.
    single = (index.e["kind"] == KIND_FILE) & (index.e["count"] == 1)
    refs = np.bincount(index.e["first"][single].astype(np.int64), minlength=index.n_chunks)
    solid_chunks = int(np.count_nonzero(refs > 1))
    solid_files = int(refs[refs > 1].sum())
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
        "pack": index.meta.get("pack", {}),
        "selection": index.meta.get("selection"),
        "access": index.meta.get("access"),
    }


def cmd_ls(args) -> int:
    import stat as st_mod

    from fanstore.format.index import KIND_DIR, KIND_SYMLINK
    from fanstore.format.index import read_index
    from fanstore.namespace import Namespace

    _storage_setup(args)
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
    return 1 if report.damaged else 0


# --------------------------------------------------------------------------- select


def cmd_select(args) -> int:
    from fanstore.select.cli import run_select_command

    return run_select_command(args)


# --------------------------------------------------------------------------- parser


def build_parser() -> argparse.ArgumentParser:
    common = _Parser(add_help=False)
    common.add_argument("--debug", action="store_true",
                        help="verbose logging and a traceback on errors")
    p = _Parser(prog="fanstore", parents=[common],
                description="Compressed burst-buffer object store for deep-learning training.")
    p.add_argument("--version", action="version", version=f"fanstore {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    s = sub.add_parser("pack", parents=[common], help="compress a dataset into a store",
                       description="Compress SRC into a store at DEST (partitions + index). "
                                   "SRC: a directory, a tar archive (plain, .gz, .bz2, .xz, "
                                   ".zst), tar shards ('shards-{000..099}.tar' or a file "
                                   "listing them), a zip archive, or s3://bucket/prefix. "
                                   "DEST: a directory or s3://bucket/name.fs.")
    s.add_argument("src", metavar="SRC")
    s.add_argument("dest", metavar="DEST")
    s.add_argument("--partitions", type=_positive_int, default=8,
                   help="number of partitions (default 8; at least the node count)")
    s.add_argument("--codec", default=None,
                   help="codec spec to pin one (zstd:3, lz4, lz4hc:9, snappy, "
                        "blosc2:zstd:5:shuffle:4, zlib:6, none); zstd:L+dict: zstd with a "
                        "dictionary trained per kind of small files; 'auto': the full "
                        "selector. Default: a quick selection per file kind (a few seconds "
                        "on a small sample, reported in one line)")
    s.add_argument("--solid-kb", type=_nonneg_int, default=None, metavar="N",
                   help="solid blocks: files of at most N KiB are packed back to back, by "
                        "kind, into blocks of N KiB, each compressed as one chunk (more "
                        "capacity on small files; a read decodes its whole block). 0: none")
    s.add_argument("--jobs", type=_nonneg_int, default=0,
                   help="compression workers (default: all cores); with an s3:// source "
                        "also the parallel range reads (default 8)")
    s.add_argument("--chunk-kb", type=_positive_int, default=1024,
                   help="chunk size for large files in KiB (default 1024)")
    s.add_argument("--broadcast", action="append", metavar="RELDIR",
                   help="put the files under RELDIR on every node (repeatable)")
    s.add_argument("--skip-unreadable", action="store_true",
                   help="leave out entries that cannot be packed instead of failing")
    s.add_argument("--force", action="store_true", help="replace an existing store at DEST")
    s.add_argument("--shared", action="store_true",
                   help="let other users read the store as the umask allows even though the "
                        "source holds entries they may not read (or is in S3); without it "
                        "such a store is private to you (directory 0700, files 0600)")
    s.add_argument("--no-progress", action="store_true", help="no progress bar")
    _add_storage_args(s)
    _add_select_budget_args(s, for_pack=True)
    s.set_defaults(func=cmd_pack)

    s = sub.add_parser("mount", parents=[common], help="mount a store read-only",
                       description="Mount STORE read-only at MOUNTPOINT. Returns once the mount "
                                   "is ready (unless --foreground). Under an MPI launcher, one "
                                   "daemon per rank in the foreground.")
    s.add_argument("store", metavar="STORE")
    s.add_argument("mountpoint", metavar="MOUNTPOINT")
    s.add_argument("--foreground", "-f", action="store_true", help="stay in the foreground")
    s.add_argument("--cache-mb", type=_nonneg_int, default=256,
                   help="decoded-chunk cache budget in MB (default 256)")
    s.add_argument("--frontend", choices=("auto", "kernel", "pyfuse3"),
                   default=os.environ.get("FANSTORE_FRONTEND") or DEFAULT_FRONTEND,
                   help="how FUSE is served: kernel (the kernel's FUSE protocol spoken "
                        "directly by --workers processes), pyfuse3 (one process, libfuse), or "
                        "auto (kernel; pyfuse3 with --mode prefetch); default "
                        f"$FANSTORE_FRONTEND or {DEFAULT_FRONTEND}")
    s.add_argument("--workers", type=_nonneg_int, default=0,
                   help="FUSE worker processes of the kernel frontend (default: the cores); "
                        "in an MPI job, the worker ranks each node spawns (mpiexec, one "
                        "rank per node) to serve its mount and its remote reads")
    s.add_argument("--ranks-per-node", type=_ranks_per_node, default="auto",
                   help="in an MPI job, how launched ranks form nodes: auto (the tasks of "
                        "one Slurm node share it; elsewhere every rank is a node) or K "
                        "consecutive ranks (mpiexec -n N*K on one machine); a node's ranks "
                        "after its first serve its mount and its remote reads")
    s.add_argument("--threads", type=_nonneg_int, default=0,
                   help="decode threads (default: 2 per core, at least 4)")
    s.add_argument("--allow-other", action="store_true",
                   help="let other users read the mount (needs user_allow_other)")
    s.add_argument("--mode", choices=("sync", "prefetch"), default="sync",
                   help="sync: decode on the read path; prefetch: fetch and decode ahead in "
                        "the order given with 'fanstore prefetch' or the Python API (or, "
                        "without one, ahead within directories)")
    s.add_argument("--prefetch-mb", type=_positive_int, default=1024,
                   help="memory for files decoded ahead in prefetch mode (default 1024)")
    s.add_argument("--log", help="log file of a background daemon")
    s.add_argument("--local-dir", help="node-local directory to stage partitions into "
                                       "({node} or {rank}, and {host} are substituted)")
    s.add_argument("--replicas", type=_replicas, default=1, metavar="K|auto",
                   help="copies of each partition on consecutive nodes (default 1); 'auto': "
                        "as many as fit in --local-capacity (or else the free space of "
                        "--local-dir, less 5%% of its file system up to 1 GiB) on every "
                        "node, every partition on every node when the store fits, so that "
                        "every read is local (without --local-dir: 1)")
    s.add_argument("--local-capacity", type=_size, default=None, metavar="SIZE",
                   help="room for this store on each node's --local-dir with --replicas auto, "
                        "e.g. 500G, 1.5T, 800M (K, M, G, T: powers of 1024; KB, MB, GB, TB: of "
                        "1000) or bytes; 'fanstore info STORE --local-capacity SIZE' shows "
                        "how many copies fit")
    s.add_argument("--remote-timeout", type=_positive_float, default=30.0,
                   help="seconds before an unanswered remote read fails with EIO (default 30)")
    s.add_argument("--keep-local", action="store_true",
                   help="keep staged partitions on exit (a restart reuses them)")
    s.add_argument("--stage-jobs", type=_positive_int, default=4,
                   help="partition copies in flight while staging (default 4); from an "
                        "s3:// store: parallel range reads")
    _add_storage_args(s)
    s.set_defaults(func=cmd_mount)

    s = sub.add_parser("umount", parents=[common], help="unmount a FanStore mount")
    s.add_argument("mountpoint", metavar="MOUNTPOINT")
    s.add_argument("--lazy", "-z", action="store_true", help="detach even if busy")
    s.add_argument("--timeout", type=_positive_float, default=30.0,
                   help="seconds to wait for the daemon to exit (default 30)")
    s.set_defaults(func=cmd_umount)

    s = sub.add_parser("wait", parents=[common], help="wait until a mount is ready")
    s.add_argument("mountpoint", metavar="MOUNTPOINT")
    s.add_argument("--timeout", type=_positive_float, default=300.0,
                   help="seconds (default 300)")
    s.set_defaults(func=cmd_wait)

    s = sub.add_parser("prefetch", parents=[common],
                       help="give a prefetch-mode mount the access order of the next epoch",
                       description="Send the order in which files will be read (one path "
                                   "per line, relative to the mount root) to the daemon of "
                                   "a mount in prefetch mode.")
    s.add_argument("mountpoint", metavar="MOUNTPOINT")
    s.add_argument("--list", required=True, metavar="FILE",
                   help="file with one path per line ('-' for standard input)")
    s.add_argument("--client", default="cli",
                   help="name of the reader this order is for: each reader has one order, "
                        "a new one replaces it (default 'cli')")
    s.set_defaults(func=cmd_prefetch)

    s = sub.add_parser("stats", parents=[common], help="this node's counters for a mount")
    s.add_argument("mountpoint", metavar="MOUNTPOINT")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_stats)

    s = sub.add_parser("verify", parents=[common], help="check every file of a store")
    s.add_argument("store", metavar="STORE")
    s.add_argument("--jobs", type=_nonneg_int, default=0, help="threads (default: all cores)")
    s.add_argument("--local-dir", metavar="DIR",
                   help="check the partitions staged in DIR (a node's share) instead of "
                        "STORE's; partitions not staged there are skipped")
    s.add_argument("--no-progress", action="store_true")
    s.set_defaults(func=cmd_verify)

    s = sub.add_parser("info", parents=[common], help="describe a store")
    s.add_argument("store", metavar="STORE")
    s.add_argument("--json", action="store_true")
    s.add_argument("--local-capacity", type=_size, default=None, metavar="SIZE",
                   help="also show how many copies of the store fit in SIZE per node "
                        "(--replicas auto), for 1 to 64 nodes or --nodes N")
    s.add_argument("--nodes", type=_positive_int, default=None, metavar="N",
                   help="the node count for --local-capacity (default: a table of 1, 2, 4, "
                        "8, 16, 32, 64)")
    _add_storage_args(s)
    s.set_defaults(func=cmd_info)

    s = sub.add_parser("ls", parents=[common], help="list a directory of a store")
    s.add_argument("store", metavar="STORE")
    s.add_argument("path", metavar="PATH", nargs="?", default="")
    s.add_argument("-l", "--long", action="store_true")
    _add_storage_args(s)
    s.set_defaults(func=cmd_ls)

    s = sub.add_parser("cat", parents=[common], help="write a file of a store to stdout")
    s.add_argument("store", metavar="STORE")
    s.add_argument("path", metavar="PATH")
    s.set_defaults(func=cmd_cat)

    s = sub.add_parser("select", parents=[common], help="benchmark codecs and pick one",
                       description="Benchmark codecs on a sample of SRC and pick the best "
                                   "ratio that meets the decompression budget.")
    s.add_argument("src", metavar="SRC")
    _add_select_budget_args(s, for_pack=False)
    s.add_argument("--local-capacity", type=_size, default=None, metavar="SIZE",
                   help="also say how many copies of the store packed with the chosen codec "
                        "fit in SIZE per node (500G, 1.5T, 800M or bytes)")
    s.add_argument("--json", action="store_true", help="print the report as JSON")
    s.add_argument("--plot", metavar="FILE", help="draw ratio vs decode rate (matplotlib)")
    s.set_defaults(func=cmd_select)
    return p


def _add_storage_args(s) -> None:
    s.add_argument("--storage-options", metavar="JSON|@FILE",
                   help="object-storage settings beyond the AWS environment (AWS_ENDPOINT_URL, "
                        "AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN, "
                        "AWS_REGION, AWS_SHARED_CREDENTIALS_FILE): s3fs keyword arguments, "
                        "plus 'retries' (default 5) and 'timeout' (seconds, default 30), "
                        "e.g. '{\"timeout\": 10}'; @FILE reads the JSON from FILE. Keep "
                        "credentials out of it: every user of the node can read a command "
                        "line (use the environment or a 0600 @FILE)")


def _add_select_budget_args(s, for_pack: bool) -> None:
    g = s.add_argument_group("codec selection" + (" (with --codec auto)" if for_pack else ""))
    g.add_argument("--mode", choices=("sync", "prefetch"), default="sync",
                   help="sync: decode on the read path; prefetch: decode overlaps compute")
    rate = g.add_mutually_exclusive_group()
    rate.add_argument("--files-per-sec", type=_positive_float, help="required files/s per node")
    rate.add_argument("--mb-per-sec", type=_positive_float, help="required MB/s per node")
    g.add_argument("--cores", type=_positive_int, default=None,
                   help="cores available for decompression per node (default: all here)")
    g.add_argument("--sample-mb", type=_positive_float, default=200.0,
                   help="sample size in MB (default 200)")
    g.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    g.add_argument("--per-kind", action="store_true",
                   help="choose a codec per file kind (extension and size band)")
    g.add_argument("--storage-mb-per-sec", type=_positive_float, default=None,
                   help="node-local read bandwidth in MB/s for the sync model (default: measured)")
    g.add_argument("--storage-latency-us", type=float, default=None,
                   help="one reader's time per random node-local read, in us, with --cores "
                        "readers at once (sync model; default: measured with the bandwidth, "
                        "0 when --storage-mb-per-sec is given)")
    g.add_argument("--reader", choices=("mount", "api"), default=None,
                   help="the read path the job will use, calibrated on this node (a few "
                        "hundred files through a temporary mount or the Python API) and "
                        "charged per file and per chunk: mount (default; api where FUSE is "
                        "missing) or api")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    debug = "--debug" in argv
    try:
        args = build_parser().parse_args(argv)
        if not getattr(args, "command", None):
            raise UsageError("no command given (see 'fanstore --help')")
        if not logging.getLogger().handlers:
            logging.basicConfig(level=logging.DEBUG if debug else logging.WARNING,
                                format="fanstore: %(levelname)s: %(message)s")
        return int(args.func(args) or 0)
    except FanStoreError as exc:
        if debug:
            import traceback

            traceback.print_exc()
        if not exc.quiet:
            print(f"fanstore: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("fanstore: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        try:
            sys.stdout = None  # type: ignore[assignment]
        finally:
            return 1
    except OSError as exc:
        if debug:
            import traceback

            traceback.print_exc()
        where = f": {exc.filename}" if exc.filename else ""
        print(f"fanstore: error: {exc.strerror or exc}{where}", file=sys.stderr)
        return 1
    except Exception as exc:  # noqa: BLE001 - last line of defence: never a raw traceback
        if debug:
            import traceback

            traceback.print_exc()
        print(f"fanstore: internal error: {type(exc).__name__}: {exc} (run with --debug for "
              "details)", file=sys.stderr)
        return 70


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
