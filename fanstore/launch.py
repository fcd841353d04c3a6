"""The composition root of a mount: one path for a single node and for an N-rank job.

``fanstore mount`` (the CLI) calls :func:`mount`; it picks the world (a world of one, or
MPI under a launcher), the frontend (pyfuse3 or the kernel protocol), builds the
:class:`~fanstore.daemon.node.Node` and runs it in the foreground or as a background
daemon. The two modules above the frontends compose them: this one (the mount) and
:mod:`fanstore.workerrank` (a node's worker rank: daemon side and kernel-frontend worker).
"""

from __future__ import annotations

import os
import signal
import sys
from dataclasses import dataclass
from typing import Callable

from fanstore import mounttable, process, runtime
from fanstore.daemon import launcher
from fanstore.daemon.jobenv import launcher_world_size, substitute
from fanstore.daemon.node import Node
from fanstore.daemon.world import World
from fanstore.errors import FanStoreError, MountError
from fanstore.frontend import FrontendFactory
from fanstore.mountspec import MountSpec


@dataclass
class Outcome:
    """How the calling process ends: with ``code``; ``hard_exit``: at once, without
    interpreter clean-up (an MPI rank that must not finalize, a hydra shim, a daemon child);
    ``error``: to report first."""

    code: int = 0
    hard_exit: bool = False
    error: FanStoreError | None = None


def frontend_factory(name: str) -> FrontendFactory:
    """The frontend called ``name`` (a spec's: "kernel" or "pyfuse3"); MountError with an
    install hint if it cannot run."""
    if not os.path.exists("/dev/fuse"):
        raise MountError("/dev/fuse does not exist: FUSE is not available on this machine")
    if name == "pyfuse3":
        try:
            from fanstore.fuse.pyfuse3 import frontend as pyfuse3_frontend
        except ImportError as exc:
            raise MountError(
                f"the pyfuse3 frontend is not installed ({exc.name} missing): pip install "
                "'fanstore[fuse]' (needs libfuse3-dev, fuse3 and pkg-config)") from None
        return pyfuse3_frontend.create
    from fanstore.fuse.kernelfs import frontend as kernelfs_frontend

    return kernelfs_frontend.create


def mount(spec: MountSpec, foreground: bool = False, debug: bool = False,
          log_file: str | None = None, notify: Callable[[str], None] = lambda text: None
          ) -> Outcome:
    """Mount a store as ``spec`` says (built and checked by the caller, frozen: it reaches
    the node, the kernel frontend process and the worker ranks as it is) and serve it; see
    the module docstring. ``notify`` shows a line to the user (the CLI prints it)."""
    process.limit_malloc_arenas()  # before any thread: the daemons inherit it
    factory = frontend_factory(spec.frontend)
    if launcher_world_size() is not None:
        return _mount_rank(spec, factory, debug, notify)
    # A world of one is rank 0: {rank} and {host} mean the same here as in a job.
    mountpoint = substitute(spec.mountpoint, 0)
    # Here, before going to the background: a stale mount's clean-up and a bad mount point
    # must reach the user, not the daemon's log.
    notice = mounttable.prepare_mountpoint(mountpoint)
    if notice:
        notify(notice)
    # The one place a single node's runtime directory is made and checked (an MPI rank's
    # node makes its own, behind the start-up gate): an unsafe one stops us here.
    runtime.sweep_dead()  # what daemons of this user that are gone left (before ours is made)
    rt = runtime.MountRuntime.create(mountpoint)
    if foreground:
        process.setup_logging(debug, sys.stderr)
        node = Node(spec, World.solo(), factory, runtime_=rt)
        node.catch_signals()
        node.run(lambda: notify(f"mounted {spec.store} at {mountpoint} "
                                "(foreground; Ctrl-C unmounts)"))
        return Outcome(0)
    log_fd = rt.open_log(log_file)

    def body(ready: process.ReadySignal):
        node = Node(spec, World.solo(), factory, runtime_=rt)
        node.progress = ready.progress
        node.catch_signals()
        return node.run(ready)

    # the start may stage for long: the deadline is for silence (no partition staged)
    try:
        detached = process.daemonize(log_fd, body, debug, log_name=log_file or rt.log_path,
                                     timeout=spec.start_timeout)
    except MountError:
        runtime.sweep_dead()  # a daemon stopped for its silence could not clean up
        raise
    if detached.child:
        return Outcome(detached.code, hard_exit=True)
    return Outcome(0)


def _mount_rank(spec: MountSpec, factory: FrontendFactory, debug: bool,
                notify: Callable[[str], None]) -> Outcome:
    """A rank of a multi-rank job: in the foreground (the launcher owns it). Every rank
    the launcher started is a daemon (its node's lowest rank) or one of its node's worker
    ranks (fanstore.workerrank): nothing is spawned (fanstore.daemon.layout)."""
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)  # hydra's "a peer died"; handled once serving
    code = launcher.shim()  # under hydra: continue in a forked daemon (see launcher.py)
    if code is not None:
        why = launcher.shim_error
        return Outcome(code, hard_exit=True, error=MountError(why) if why else None)
    outcome = _serve_rank(spec, factory, debug, notify)
    if outcome.hard_exit:  # no MPI_Finalize, which alone unlinks MPI's shared memory
        launcher.release_mpi_shm()
    return outcome


def _serve_rank(spec: MountSpec, factory: FrontendFactory, debug: bool,
                notify: Callable[[str], None]) -> Outcome:
    """The rank past its shim: MPI, then its node's daemon or one of its worker ranks.
    ``hard_exit``: it must leave without MPI_Finalize (a process of the job died)."""
    # from here on a launcher that dies ends this rank, whatever it is blocked in
    # from MPI_Init's return, the layout's waits and the node's hello have the start
    # timeout each; a rank stuck outside them is ended (the job could not start anyway)
    lifeline = launcher.watch_launcher((2 * spec.start_timeout + 10,
                                        "the start (the layout, the node's hello)"))
    world = World.from_mpi(spec.ranks_per_node, timeout=spec.start_timeout,
                           alive=launcher.launcher_alive)
    job = world.job
    if not job.is_leader:  # a worker rank of its node
        from fanstore import workerrank

        code, clean = workerrank.run_worker(world, debug, on_hello=lifeline.disarm)
        return Outcome(code, hard_exit=not workerrank.finish(world, clean))
    lifeline.disarm()  # the leader's own waits from here on all have deadlines
    runtime.sweep_dead()  # every node's leader: what gone daemons left on its host
    process.setup_logging(debug, sys.stderr, fmt=(
        f"%(asctime)s fanstore[node {world.rank}/{world.size}] %(levelname)s: %(message)s"))
    node = Node(spec, world, factory)
    lifeline.on_gone = node.emergency_cleanup
    node.catch_signals()
    try:
        code = node.run(lambda: notify(f"node {world.rank}: mounted at {node.mountpoint}"))
    except FanStoreError as exc:
        if not node.skip_finalize:
            raise
        return Outcome(exc.exit_code, hard_exit=True, error=exc)
    return Outcome(code, hard_exit=node.skip_finalize)
