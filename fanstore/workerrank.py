"""A node's worker ranks: FUSE serving and remote service spread over MPI processes.

With the kernel frontend in a multi-node job, the FUSE requests of a node's mount are
served by its *worker ranks*: the ranks of the node beside its leader, launched with it
(``srun --ntasks-per-node=K``, ``mpiexec -ppn K``; :mod:`fanstore.daemon.layout`). Each
worker rank

- receives from its leader (:mod:`fanstore.daemon.nodegroup`) what to serve: the node's
  :class:`~fanstore.mountspec.NodeShare` (the mount spec as the CLI built it, the node's
  data directory and partitions, the placement table, the index copy (mapped, shared with
  every process of the node), the kernel frontend's worker socket);
- answers other nodes' reads of this node's partitions with its own MPI server thread
  (:class:`~fanstore.daemon.mpitransport.MpiTransport`: pread + Isend from the buffer);
- joins the kernel frontend (:func:`fanstore.fuse.kernelfs.process.serve_worker`: the /dev/fuse
  descriptor arrives by ``SCM_RIGHTS``) and serves READs with its own read core: this
  node's chunks by pread + decode, other nodes' straight over MPI from a rank of the
  holder node (:class:`~fanstore.daemon.routing.PeerSource`); with the pyfuse3 frontend
  (one process serves the mount) it serves peers only;
- after the unmount keeps serving its peers until the leader says the job is done, then
  finalizes MPI with everyone (or leaves without it when a peer died).

So neither side of a remote read crosses a single per-node process: K readers of a node
ask K different ranks of the holder. A worker rank ignores SIGTERM/SIGINT (its leader
coordinates the stop) and exits at once if its leader's process is gone.

This is the composition of the daemon layer (MPI) and the FUSE layer (kernel protocol),
so it lives beside :mod:`fanstore.launch`, which runs it on every rank that is not its
node's leader.
"""

from __future__ import annotations

import logging
import os
import select
import signal
import sys
import threading
import time
from typing import Callable

from fanstore.daemon.launcher import launcher_alive, release_mpi_shm
from fanstore.daemon.nodegroup import STOPPED_SIGNAL, WorkerSide
from fanstore.daemon.world import World
from fanstore.errors import FanStoreError
from fanstore.mountspec import START_TIMEOUT, NodeShare
from fanstore.process import setup_logging

log = logging.getLogger("fanstore.workerrank")

#: seconds to join the kernel frontend (which waits as long for the worker ranks)
JOIN_TIMEOUT = 300.0


def run_worker(world: World, debug: bool = False,
               on_hello: Callable[[], None] = lambda: None) -> tuple[int, bool]:
    """Serve as a worker rank of ``world.job``'s node until the leader says the job is
    done (``on_hello``: once the leader and this rank know each other's pids). Returns
    (exit status, whether MPI may be finalized)."""
    job = world.job
    setup_logging(debug, sys.stderr, fmt=(
        f"%(asctime)s fanstore[node {job.node} worker rank {job.rank}] %(levelname)s: "
        "%(message)s"))
    for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, STOPPED_SIGNAL):
        signal.signal(s, signal.SIG_IGN)
    from fanstore.daemon.pacing import precise_sleeps

    precise_sleeps()  # this thread polls for remote replies (pacing.Pacer)
    side = WorkerSide(job)
    try:
        side.hello(world.timeout if world.timeout is not None else START_TIMEOUT)
    except FanStoreError as exc:
        log.error("%s", exc)
        return 1, False
    on_hello()
    log.debug("leader pid %d", side.leader_pid)
    threading.Thread(target=_watch_leader, args=(side,), name="fanstore-leader-watch",
                     daemon=True).start()
    try:
        share = side.start()
    except FanStoreError as exc:
        log.info("not serving: %s", exc)
        clean = side.exit()
        side.finished = True
        return 1, bool(clean)
    transport = parts = None
    try:
        transport, parts, reader = _build(job, share)
        # the node stops serving its mount: reads of other nodes still waiting end within
        # STOP_GRACE (ENOTCONN); serving the peers goes on
        signal.signal(STOPPED_SIGNAL, lambda _s, _f: transport.interrupt(
            "the node stops serving its mount"))
        if not share.worker_socket:
            # the node's frontend serves its mount itself (pyfuse3): this rank answers the
            # other nodes' reads of the node's partitions until the node is done
            raise _PeersOnly()
        from fanstore.fuse.kernelfs import process as kernelfs_process

        reason = kernelfs_process.serve_worker(
            share, reader, timeout=JOIN_TIMEOUT,
            alive=lambda: side.leader_alive() and not side.exit_posted(), served=transport)
        log.debug("FUSE serving ended (%s); serving peers until the node is done", reason)
    except _PeersOnly:
        log.debug("serving peers only (the node's frontend serves its mount)")
    except FanStoreError as exc:
        log.error("%s", exc)
    log.debug("waiting for the node's exit")
    clean = side.exit()
    side.finished = True  # the leader may exit from now on: stop watching it
    log.debug("exit (clean %s)", clean)
    if transport is not None:
        transport.stop()
    if parts is not None:
        parts.close()
    if clean is None:
        log.warning("the node's daemon is gone; leaving without MPI_Finalize")
        return 1, False
    return 0, clean


class _PeersOnly(Exception):
    """This worker rank has no FUSE share: it serves peers only."""


def _build(job, share: NodeShare):
    from fanstore.daemon.mpitransport import MpiTransport
    from fanstore.daemon.routing import PeerSource
    from fanstore.format.index import map_index_body
    from fanstore.namespace import Namespace
    from fanstore.read import ChunkReader, LocalPartitions, ReadStats, RoutedSource

    spec = share.spec
    index = map_index_body(share.index_copy, owner=os.geteuid(), where=spec.store)
    parts = LocalPartitions(share.data_dir, index, list(share.local_parts))
    transport = MpiTransport(job.comm, parts, on_control=lambda msg: None,
                             piece=spec.mpi_piece)
    transport.start()
    stats = ReadStats()
    ns = Namespace(index)
    peers = PeerSource(transport, [list(row) for row in share.table], job.node, job.nodes,
                       spec.remote_timeout, stats, show=ns.show,
                       ranks_of=job.servers_of, me=job.rank)
    # a rank that serves peers only decodes nothing: no cache
    reader = ChunkReader(index, RoutedSource(parts, peers), stats=stats,
                         cache_bytes=share.cache_bytes if share.worker_socket else 0)
    threading.Thread(target=_probe_dead, args=(peers, transport, spec.remote_timeout),
                     name="fanstore-probe", daemon=True).start()
    return transport, parts, reader


def _probe_dead(peers, transport, timeout: float, interval: float = 5.0) -> None:
    """Every few seconds, ping the ranks this worker found unreachable: a peer that comes
    back (a node resumed after a SIGSTOP) is read from again."""
    while transport.running:
        time.sleep(interval)
        if peers.dead:
            peers.probe(transport.ping, min(5.0, timeout))


def _watch_leader(side: WorkerSide) -> None:
    """A worker never outlives its leader (nor the launcher): it sleeps on a pidfd of the
    leader (woken the moment the leader's process ends), checking the launcher now and
    then."""
    try:
        pidfd = os.pidfd_open(side.leader_pid)
    except OSError:
        pidfd = -1
    while not side.finished:
        if pidfd >= 0:
            ready, _, _ = select.select([pidfd], [], [], 2.0)
            gone = bool(ready)
        else:
            time.sleep(0.5)
            gone = not side.leader_alive()
        if side.finished:
            return
        if gone or not launcher_alive():
            log.error("the node's daemon (pid %d) is gone; exiting", side.leader_pid)
            release_mpi_shm()  # (no MPI_Finalize: it alone would unlink it)
            os._exit(1)


def finish(world: World, clean: bool) -> bool:
    """MPI_Finalize with the whole job (after its last barrier), or nothing when a peer
    died (finalizing with a dead peer hangs or aborts). Returns whether MPI was finalized:
    only then may the process exit normally (the C library's exit handlers run: MPICH's
    hydra ends the job when a process leaves with _exit after MPI_Finalize, measured);
    otherwise it must leave at once (os._exit: nothing may wait on a dead peer)."""
    if not clean:
        return False
    if not world.finish_job():
        log.warning("not every rank reached the end of the job; leaving without "
                    "MPI_Finalize")
        return False
    return True
