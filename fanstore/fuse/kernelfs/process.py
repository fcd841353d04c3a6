"""The kernel frontend's process: mount, answer INIT, and serve with K workers.

Process model (one node)::

    node daemon (MPI rank, or a world of one)      frontend process (never touches MPI)
    ─────────────────────────────────────────      ─────────────────────────────────────
    index, placement, staging, peers, control  ──▶ spawned fresh (``python -m
    socket; read_stored for other nodes' chunks      fanstore.fuse.kernelfs.process``, exec'd:
    (fanstore.fuse.kernelfs.frontend)                      nothing of MPI is inherited); loads the
                                                     index copy, mounts /dev/fuse, answers
                                                     INIT, forks K workers
                                                   worker 1..K: read requests from the same
                                                     connection, pread + decode this node's
                                                     chunks inline, ask the daemon's socket
                                                     for other nodes' chunks (NodeSource)

The daemon never forks after MPI_Init: it starts this process with ``subprocess`` (fork +
exec at once), and this process, which never initialises MPI, forks the workers. It ends
with the daemon, whatever ends the daemon (:class:`DaemonWatch`: a pidfd in the
supervisor's poll, and PR_SET_PDEATHSIG with a signal of its own): it unmounts, its
workers end, and it removes the node's index copy and the mount's runtime directory,
logging one line (issue 44: with PDEATHSIG(SIGKILL) its forked workers outlived it, holding
the mount and the launcher's output pipes). SIGTERM to it unmounts and stops every worker;
an unmount from outside ends them all. With worker ranks (:mod:`fanstore.workerrank`) it
forks none: the ranks join it through
the handoff socket and serve with :func:`serve_worker`.

What the kernel is offered (see :mod:`fanstore.fuse.engine`): zero-message open and opendir,
cached directory listings, readdirplus, cached symlinks, parallel directory operations,
max_pages so one READ covers a 1 MiB chunk, entry and attribute timeouts of 10^6 s (the
data never changes while mounted) and negative entries cached as long, no automatic data
invalidation: a file read once is served by the page cache with no request at all.

Counters: every worker counts its requests by opcode and its reads in its own row of a
shared table in the runtime directory (:mod:`fanstore.fuse.kernelfs.stats`).
"""

from __future__ import annotations

import ctypes
import logging
import os
import select
import signal
import socket
import sys
from collections.abc import Callable
from typing import Any

from fanstore import fuseflags
from fanstore.errors import FanStoreError, MountError
from fanstore.fuse import engine
from fanstore.fuse.fsops import FsOps
from fanstore.fuse.kernelfs.handler import KernelHandler
from fanstore.fuse.kernelfs.start import FrontendStart, read_start
from fanstore.fuse.kernelfs.stats import RowPublisher
from fanstore.mountspec import FSNAME, MountSpec, NodeShare
from fanstore.read.shared import SharedChunks

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1


def make_handler_factory(share: NodeShare, index, fs: FsOps, session, window=None,
                         shared=None) -> Callable[[engine.WorkerContext], KernelHandler]:
    """The per-worker set-up: this node's partitions opened here, other nodes' chunks
    through the daemon's socket, counters in the worker's row; in prefetch mode, the
    worker's prefetch thread (``window``: the shared window, made before the fork)."""
    spec = share.spec

    def factory(wctx: engine.WorkerContext) -> KernelHandler:
        from fanstore.control import ControlClient, node_reader

        client = ControlClient(share.mountpoint, timeout=spec.remote_timeout + 30,
                               path=share.socket_path)
        reader = node_reader(index, client, share.data_dir, share.local_parts,
                             share.replicated, share.cache_bytes)
        if shared is not None:  # made before the fork: this worker writes its own slots
            shared.set_worker(wctx.slot)
            reader.shared = shared
        # (serve() made the counters table before forking this worker)
        row = session.counters.row(wctx.slot)
        publisher = RowPublisher(row, reader.stats, reader.cache)
        publisher.publish()
        hooks = None
        if window is not None:
            from fanstore.fuse.kernelfs.prefetcher import Prefetcher

            pf = Prefetcher(window, reader, fs.ns, wctx.slot, wctx.workers, wctx.fd,
                            wctx.channel, share.mountpoint, row,
                            stat_ahead=spec.prefetch_lookup, publish=publisher.publish)
            pf.start()
            hooks = pf.hooks
        return KernelHandler(fs, reader, publish=publisher.publish, prefetch=hooks,
                             spill=make_spill(wctx.fd, reader.stats, spec.chunk_spill))

    return factory


def make_spill(fd: int, stats, enabled: bool = True):
    """A worker's chunk spill thread (:mod:`fanstore.fuse.kernelfs.spill`); none when not
    ``enabled`` (``--no-chunk-spill``, for comparisons: benchmarks, experiments)."""
    if not enabled:
        return None
    from fanstore.fuse.kernelfs.spill import ChunkSpill

    return ChunkSpill(fd, stats)


def shares_chunks(share: NodeShare) -> bool:
    """Whether the processes that serve the mount share a table of decoded chunks (more
    than one of them). A worker rank gets, with its /dev/fuse descriptor, the table's two
    descriptors if so, then prefetch mode's window's two: both sides know which from the
    node's share, so nothing else travels with them."""
    return share.fuse_workers > 1


def serve_worker(share: NodeShare, reader, timeout: float = 300.0, alive=lambda: True,
                 served=None) -> str:
    """An external worker (an MPI worker rank of a node, :mod:`fanstore.workerrank`): join
    the kernel frontend at the share's worker socket (:mod:`fanstore.fuse.engine.handoff`),
    serve FUSE requests with ``reader`` (this node's partitions from disk, other nodes' over
    MPI) until the mount goes away, then tell the frontend. Returns why it stopped."""
    from fanstore.fuse.engine import handoff
    from fanstore.namespace import Namespace

    spec = share.spec
    grant, sock = handoff.join(share.worker_socket, timeout, alive)
    fds = list(grant.extra_fds)
    want = 2 * shares_chunks(share) + 2 * spec.prefetch
    if len(fds) != want:
        for fd in (grant.fd, *fds):
            os.close(fd)
        handoff.say_gone(sock)
        raise MountError(f"the kernel frontend sent {len(fds)} shared descriptors, not {want}")
    counters = engine.RequestCounters.attach(grant.counters, writable=True) \
        if grant.counters else None
    row = counters.row(grant.slot) if counters is not None else None
    publisher = RowPublisher(row, reader.stats, reader.cache, served) if row is not None \
        else None
    if publisher is not None:
        publisher.publish()
        if served is not None:
            served.on_served = publisher.publish_served
    fs = FsOps(Namespace(reader.index))
    if shares_chunks(share):
        reader.shared = SharedChunks(fds[0], fds[1], grant.slot)
    prefetcher = window = None
    if spec.prefetch and row is not None:
        from fanstore.fuse.kernelfs.prefetcher import Prefetcher
        from fanstore.read.window import SharedWindow

        window = SharedWindow(fds[-2], fds[-1])
        prefetcher = Prefetcher(window, reader, fs.ns, grant.slot, grant.workers, grant.fd,
                                sock, share.mountpoint, row, stat_ahead=spec.prefetch_lookup,
                                publish=publisher.publish if publisher else None)
        prefetcher.start()
    spill = make_spill(grant.fd, reader.stats, spec.chunk_spill)
    handler = KernelHandler(fs, reader, publish=publisher.publish if publisher else None,
                            prefetch=prefetcher.hooks if prefetcher else None, spill=spill)
    try:
        engine.Dispatcher(grant.fd, handler, bufsize=grant.bufsize, row=row).run()
    finally:
        if spill is not None:
            spill.stop()
        if prefetcher is not None:
            prefetcher.stop()
        if publisher is not None:
            publisher.publish()
        os.close(grant.fd)
        handoff.say_gone(sock)
        for fd in fds:
            os.close(fd)
    return "unmounted"


def frontend_main(spec_fd: int) -> int:
    """``python -m fanstore.fuse.kernelfs.process --spec-fd N``: the frontend process (see the
    module docstring). Reads its :class:`FrontendStart` from the pipe ``spec_fd``; reports
    "ready" or "error: ..." on the pipe fd named in it."""
    from fanstore.format.index import map_index_body
    from fanstore.namespace import Namespace
    from fanstore.process import setup_logging
    from fanstore.read.decode import Decoder

    try:
        start = read_start(spec_fd)
    except FanStoreError as exc:  # nowhere to report it but the daemon's log: one line
        sys.stderr.write(f"kernel frontend: {exc}\n")
        return exc.exit_code
    share, ready_fd = start.share, start.ready_fd
    setup_logging(start.debug, sys.stderr, fmt=start.log_format or None)
    # End with the daemon, whatever ends it (SIGKILL included): a pidfd on it is watched
    # while serving, and PR_SET_PDEATHSIG sends DaemonWatch.SIGNAL (see there). Never
    # SIGKILL: the workers and the mount would outlive this process (issue 44: orphaned
    # workers held the mount and the launcher's output pipes for good).
    daemon = DaemonWatch(start.daemon_pid)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, DaemonWatch.SIGNAL)
    if os.getppid() != start.daemon_pid:
        return 1

    def report(text: str) -> None:
        try:
            os.write(ready_fd, text.encode(errors="replace")[:4000])
        except OSError:
            pass

    session = None
    try:
        index = map_index_body(share.index_copy, owner=os.geteuid(),
                               where=share.spec.store)
        fs = FsOps(Namespace(index))
        # Import the store's codec libraries here, before the workers fork (a missing one
        # fails the mount, not every read): each worker's first request paid the import,
        # ~100 ms of blosc2's, which a measured epoch of a few thousand files could not hide
        Decoder(index)
        mount, init = engine_options(share.spec)
        session = engine.KernelSession(share.mountpoint, mount, init,
                                       counters_path=start.counters_path)
        session.mount()

        def on_ready(s) -> None:
            report("ready\n")
            os.close(ready_fd)  # the daemon stops reading here; EOF if we die before

        reason = _serve(start, index, fs, session, on_ready, daemon)
        if daemon.gone():
            session.close()  # unmount before the daemon's files go
            session = None
            log.error("kernel frontend: %s", daemon.clean_up(share, start.counters_path))
            return 1
        log.info("kernel frontend: %s", reason)
        return 0
    except FanStoreError as exc:
        log.error("%s", exc)
        report(f"error: {exc}")
        return exc.exit_code
    except Exception as exc:  # report, never vanish
        log.exception("kernel frontend failed")
        report(f"error: internal error in the kernel frontend ({type(exc).__name__}: {exc})")
        return 70
    finally:
        if session is not None:
            session.close()


def engine_options(spec: MountSpec) -> tuple[engine.MountOptions, engine.InitOptions]:
    """The engine's view of a mount spec (how to mount, what to ask for in INIT): the one
    place it is derived. The engine's defaults, READDIRPLUS included: listing then reading
    300,000 files (a first epoch) took 26.5 s with it and 38.2 s with plain READDIR, which
    costs a LOOKUP per file; only a bare cold `find` is faster without it
    (docs/benchmarks.md, fuse_bench-small300k-dirs). ``fuse_flags`` ("+NAME,-NAME", checked
    with the spec) edits the flags (-DO_READDIRPLUS for metadata-only work; experiments
    and benchmarks)."""
    mount = engine.MountOptions(fsname=FSNAME, subtype="fanstore", read_only=True,
                                allow_other=spec.allow_other)
    init = engine.InitOptions(flags=fuseflags.apply(spec.fuse_flags,
                                                    engine.DEFAULT_INIT_FLAGS))
    return mount, init


#: seconds the frontend waits for a daemon that is dying to have exited
EXIT_WAIT = 5.0


class DaemonWatch:
    """The node daemon, watched through a pidfd by the supervisor's poll and by
    PR_SET_PDEATHSIG: when it ends, whatever ended it, the mount stops (:meth:`on_gone`),
    and the frontend removes what the daemon can no longer remove (:meth:`clean_up`).

    PDEATHSIG is a signal of its own (``SIGNAL``), not SIGTERM: it fires when the daemon's
    *thread* that started us exits, which under SIGKILL can be before the daemon is
    reparented away from us or its pidfd readable; a SIGTERM then looked like the daemon's
    own "stop" and the dead daemon's runtime directory was left (1 run of ~12)."""

    SIGNAL = signal.SIGUSR2

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.fd = os.pidfd_open(pid)
        os.set_inheritable(self.fd, False)  # not into the forked workers' exec'd children
        self.session = None
        self.signalled = False
        signal.signal(self.SIGNAL, self._on_signal)

    def _on_signal(self, _signum, _frame) -> None:
        self.signalled = True
        if self.session is not None:
            self.session.stop()  # signal-safe

    def gone(self) -> bool:
        if self.signalled or os.getppid() != self.pid:
            return True
        ready, _, _ = select.select([self.fd], [], [], 0)
        return bool(ready)

    def on_gone(self) -> bool:
        """The supervisor's watch callback: the daemon has exited; stop serving."""
        log.warning("kernel frontend: the node's daemon (pid %d) is gone; unmounting",
                    self.pid)
        if self.session is not None:
            self.session.stop()
        return False

    def clean_up(self, share: NodeShare, counters_path: str) -> str:
        """After the unmount: the node's index copy and the mount's runtime directory (if
        its state still names this daemon). Returns the one line to log."""
        from fanstore import runtime

        # PDEATHSIG comes before the daemon is a zombie: until it is, its state names a
        # live process, and the directory would be left (seen, 1 run of 2)
        ready, _, _ = select.select([self.fd], [], [], EXIT_WAIT)
        if not ready and os.getppid() == self.pid:  # its thread ended, not the daemon
            return (f"the node's daemon (pid {self.pid}) still runs after the end of the "
                    f"thread that started this frontend; unmounted {share.mountpoint}")
        runtime.remove_shared(share.index_copy)
        rundir = os.path.dirname(counters_path)
        removed = runtime.remove_after_daemon(rundir, self.pid)
        return (f"the node's daemon (pid {self.pid}) died; unmounted {share.mountpoint}, "
                f"removed the index copy{' and the runtime directory' if removed else ''}")


def _serve(start: FrontendStart, index, fs: FsOps, session, on_ready,
           daemon: DaemonWatch | None = None) -> str:
    """Serve the mounted session with forked workers or the node's worker ranks, with
    prefetch mode's order relay and shared window when asked, until it is unmounted,
    stopped, or the node's ``daemon`` is gone."""
    share = start.share
    window = relay = None
    watch: dict[int, Any] = {}
    if daemon is not None:
        daemon.session = session
        watch[daemon.fd] = daemon.on_gone
    if share.spec.prefetch:  # (the start holds the order channel and the window then)
        from fanstore.fuse.kernelfs.orders import OrderRelay
        from fanstore.read.window import SharedWindow

        assert start.window_fds is not None and start.order_fd is not None
        window = SharedWindow(*start.window_fds)
        orders = socket.socket(fileno=start.order_fd)
        relay = OrderRelay(session, orders, window, share.spec.prefetch_mb << 20)
        watch[orders.fileno()] = relay.on_readable
    workers = share.fuse_workers
    shared = SharedChunks.create(workers, index.chunk_size) if shares_chunks(share) else None
    if share.worker_socket:
        # MPI worker ranks serve (fanstore/workerrank.py): they connect and get the
        # connection with the shared chunk table and prefetch mode's window (serve_worker);
        # what else they need is in the node's share, which their leader gave them
        fds: list[int] = []
        if shared is not None:
            fds += [shared.table_fd, shared.arena_fd]
        if window is not None:
            fds += [window.state_fd, window.arena_fd]
        return session.serve_external(share.worker_socket, workers, on_ready=on_ready,
                                      watch=watch, extra_fds=fds)
    factory = make_handler_factory(share, index, fs, session, window, shared)
    return session.serve(factory, workers=workers, on_ready=on_ready,
                         channels=window is not None, watch=watch,
                         on_worker_start=relay.resend if relay else None)


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] != "--spec-fd":
        sys.exit("usage: python -m fanstore.fuse.kernelfs.process --spec-fd N (started by the "
                 "daemon)")
    sys.exit(frontend_main(int(sys.argv[2])))
