"""Commands on live mounts: ``mount``, ``umount``, ``wait``, ``prefetch``, ``stats``."""

from __future__ import annotations

import json
import os
import sys
import time

from fanstore.cli.common import (
    add_storage_args,
    nonneg_int,
    positive_float,
    positive_int,
    ranks_per_node,
    replicas,
    say,
    size,
    storage_setup,
)
from fanstore.errors import MountError, UsageError

def add_parsers(sub, common) -> None:
    _add_mount(sub, common)
    _add_live(sub, common)


def _add_mount(sub, common) -> None:
    from fanstore.mountspec import MODES
    from fanstore.mountspec import MountSpec as D  # its defaults are the options' defaults
    from fanstore.settings import FRONTENDS, current

    env = current()
    s = sub.add_parser("mount", parents=[common], help="mount a store read-only",
                       description="Mount STORE read-only at MOUNTPOINT. Returns once the mount "
                                   "is ready (unless --foreground). Under an MPI launcher, one "
                                   "daemon per rank in the foreground.")
    s.add_argument("store", metavar="STORE")
    s.add_argument("mountpoint", metavar="MOUNTPOINT")
    s.add_argument("--foreground", "-f", action="store_true", help="stay in the foreground")
    s.add_argument("--cache-mb", type=nonneg_int, default=D.cache_mb,
                   help="decoded-chunk cache budget in MB (default %(default)s)")
    s.add_argument("--frontend", choices=FRONTENDS, default=env.frontend or D.frontend,
                   help="how FUSE is served: kernel (the kernel's FUSE protocol spoken "
                        "directly by --workers processes), pyfuse3 (one process, libfuse), or "
                        "auto (kernel); --mode prefetch needs kernel; default "
                        f"$FANSTORE_FRONTEND or {D.frontend}")
    s.add_argument("--workers", type=nonneg_int, default=D.workers,
                   help="FUSE worker processes of the kernel frontend (default: the cores, at "
                        "most 16); in an MPI job a node launched with several ranks is served "
                        "by its worker ranks instead (--ranks-per-node)")
    s.add_argument("--ranks-per-node", type=ranks_per_node, default=D.ranks_per_node,
                   help="in an MPI job, how launched ranks form nodes: auto (the ranks of "
                        "one host, under srun of one Slurm node) or K consecutive ranks "
                        "(how one machine simulates many nodes); a node's ranks after its "
                        "first serve its mount and its remote reads")
    s.add_argument("--start-timeout", type=positive_float, default=D.start_timeout,
                   metavar="SECONDS",
                   help="in an MPI job, how long a node waits at each start-up step for the "
                        "others (default %(default)g); then every node stops, naming the "
                        "nodes that did not arrive")
    s.add_argument("--threads", type=nonneg_int, default=D.threads,
                   help="decode threads (default: 2 per core, at least 4)")
    s.add_argument("--allow-other", action="store_true",
                   help="let other users read the mount (needs user_allow_other)")
    s.add_argument("--mode", choices=MODES, default=D.mode,
                   help="sync: decode on the read path; prefetch: fetch and decode ahead in "
                        "the order given with 'fanstore prefetch' or the Python API (or, "
                        "without one, ahead within directories)")
    s.add_argument("--prefetch-mb", type=positive_int, default=D.prefetch_mb,
                   help="memory for files decoded ahead in prefetch mode (default %(default)s)")
    s.add_argument("--log", help="log file of a background daemon")
    s.add_argument("--local-dir", help="node-local directory to stage partitions into "
                                       "({node} or {rank}, and {host} are substituted)")
    s.add_argument("--replicas", type=replicas, default=D.replicas, metavar="K|auto",
                   help="copies of each partition on consecutive nodes (default 1); 'auto': "
                        "as many as fit in --local-capacity (or else the free space of "
                        "--local-dir, less 5%% of its file system up to 1 GiB) on every "
                        "node, every partition on every node when the store fits, so that "
                        "every read is local (without --local-dir: 1)")
    s.add_argument("--local-capacity", type=size, default=None, metavar="SIZE",
                   help="room for this store on each node's --local-dir with --replicas auto, "
                        "e.g. 500G, 1.5T, 800M (K, M, G, T: powers of 1024; KB, MB, GB, TB: of "
                        "1000) or bytes; 'fanstore info STORE --local-capacity SIZE' shows "
                        "how many copies fit")
    s.add_argument("--remote-timeout", type=positive_float, default=D.remote_timeout,
                   help="seconds before an unanswered remote read fails with EIO (default "
                        "%(default)g)")
    s.add_argument("--keep-local", action="store_true",
                   help="keep staged partitions on exit (a restart reuses them)")
    s.add_argument("--stage-jobs", type=positive_int, default=D.stage_jobs,
                   help="partition copies in flight while staging (default %(default)s); from an "
                        "s3:// store: parallel range reads")
    add_storage_args(s)
    g = s.add_argument_group("the kernel frontend's switches (for comparisons and "
                             "metadata-only work)")
    g.add_argument("--fuse-flags", default=env.fuse_flags, metavar="EDITS",
                   help="+NAME,-NAME edits of the INIT flags offered to the kernel, e.g. "
                        "-DO_READDIRPLUS for a bare `find` over millions of files (write "
                        "--fuse-flags=-NAME: the value starts with a dash; default "
                        "$FANSTORE_FUSE_FLAGS, else none)")
    g.add_argument("--no-chunk-spill", dest="chunk_spill", action="store_false",
                   help="do not push the rest of a chunk decoded for a partial read into the "
                        "page cache (the mount as it was before the spill)")
    g.add_argument("--no-prefetch-lookup", dest="prefetch_lookup", action="store_false",
                   help="prefetch mode: do not look files up ahead of their push")
    s.set_defaults(func=cmd_mount)


def _add_live(sub, common) -> None:
    s = sub.add_parser("umount", parents=[common], help="unmount a FanStore mount")
    s.add_argument("mountpoint", metavar="MOUNTPOINT")
    s.add_argument("--lazy", "-z", action="store_true", help="detach even if busy")
    s.add_argument("--timeout", type=positive_float, default=30.0,
                   help="seconds to wait for the daemon to exit (default 30)")
    s.set_defaults(func=cmd_umount)

    s = sub.add_parser("wait", parents=[common], help="wait until a mount is ready")
    s.add_argument("mountpoint", metavar="MOUNTPOINT")
    s.add_argument("--timeout", type=positive_float, default=300.0,
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


def cmd_mount(args) -> int:
    from fanstore import launch

    storage_setup(args)
    outcome = launch.mount(mount_spec(args), foreground=args.foreground, debug=args.debug,
                           log_file=args.log, notify=say)
    if outcome.error is not None:
        say(f"error: {outcome.error}")
    if outcome.hard_exit:  # an MPI rank that must not finalize, a hydra shim, a daemon
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(outcome.code)
    return outcome.code


def mount_spec(args):
    """The mount's one :class:`~fanstore.mountspec.MountSpec`, from the arguments and the
    settings: built and checked here, once (a bad one is a UsageError line, exit 2)."""
    from fanstore.mountspec import MountSpec
    from fanstore.settings import current

    return MountSpec(
        store=args.store, mountpoint=args.mountpoint, frontend=args.frontend,
        mode=args.mode, cache_mb=args.cache_mb, threads=args.threads, workers=args.workers,
        allow_other=args.allow_other, prefetch_mb=args.prefetch_mb,
        fuse_flags=args.fuse_flags, chunk_spill=args.chunk_spill,
        prefetch_lookup=args.prefetch_lookup, local_dir=args.local_dir,
        replicas=args.replicas, local_capacity=args.local_capacity,
        remote_timeout=args.remote_timeout, keep_local=args.keep_local,
        stage_jobs=args.stage_jobs, ranks_per_node=args.ranks_per_node,
        start_timeout=args.start_timeout, mpi_piece=current().mpi_piece)


def cmd_umount(args) -> int:
    from fanstore import control, mounttable, runtime
    from fanstore.process import pid_alive

    mnt = args.mountpoint
    status = mounttable.mount_status(mnt)
    state = runtime.read_state(mnt) or {}
    pid = state.get("pid")
    runtime.sweep_dead()  # what daemons that are gone left (shm files, runtime dirs)
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
