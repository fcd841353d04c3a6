"""One FanStore daemon per node: its life from start-up to exit, the same for one node and N.

1. Rank 0 reads the index from the shared store and broadcasts its bytes; every rank
   validates and loads it, so every node holds the whole namespace (a world of one just
   reads it).
2. Placement (:mod:`fanstore.daemon.placement`) says which partitions this rank holds;
   they are staged into ``--local-dir`` (or read in place without one).
3. A gate (an all-reduce) makes every rank wait until all have staged; the peer transport
   and the control socket start; the frontend mounts; a second gate waits until every rank
   has mounted: only then does any mount report ready, so ``fanstore wait`` returns on a
   node only when every node serves.
4. The frontend serves (reads of other ranks' partitions go to the nearest live owner and
   fail over, :mod:`fanstore.daemon.routing`).
5. Stopping: SIGTERM/SIGINT stop every rank (SHUTDOWN to all peers); ``fanstore umount``
   stops this node only. An unmounted daemon keeps serving its peers ("drain") until
   every rank is done or known dead, then exits (the probes and the drain:
   :mod:`fanstore.daemon.peerwatch`); MPI_Finalize is called only when no peer died
   (finalizing with a dead peer hangs or aborts): ``skip_finalize`` tells the caller to
   exit without it.
6. A death while serving (:meth:`Node.check_deaths`, every second): a node whose every
   rank is dead ends the job on every node, named, when a partition has no live holder
   left (with ``--replicas`` covering it the others go on serving); a dead worker rank of
   this node, a frontend that died, or this rank's hydra shim ended by the launcher with
   every node alive end the job too. The dead node's frontend cleans up after its daemon
   (:mod:`fanstore.fuse.kernelfs.process`). docs/reliability.md, "A process of a serving
   job killed".

The node knows nothing of FUSE: it is given a frontend factory (:mod:`fanstore.frontend`).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

from fanstore import mounttable, runtime
from fanstore.control import ControlServer
from fanstore.daemon import nodestats
from fanstore.daemon import placement as pl
from fanstore.daemon import protocol as P
from fanstore.daemon.jobenv import node_name, substitute
from fanstore.daemon.launcher import launcher_alive, shim_gone
from fanstore.daemon.nodeend import NodeEnd
from fanstore.daemon.nodegroup import LeaderSide
from fanstore.daemon.peerwatch import PeerWatch, dead_in, is_death
from fanstore.daemon.replicas import decide as decide_replicas
from fanstore.process import release_free_memory
from fanstore.daemon.routing import PeerSource
from fanstore.daemon.service import OWNER_OPS
from fanstore.daemon.world import World
from fanstore.errors import FanStoreError, FormatError, MountError
from fanstore.frontend import UNMOUNTED, FrontendFactory, MountContext
from fanstore.mountspec import MountSpec, NodeShare
from fanstore.namespace import Namespace
from fanstore.read import ChunkReader, LocalPartitions, ReadStats, RoutedSource

log = logging.getLogger(__name__)

#: the kernel frontend's socket in the runtime directory where worker ranks join it
WORKER_SOCKET = "workers.sock"


class Node(NodeEnd):
    def __init__(self, spec: MountSpec, world: World, frontend_factory: FrontendFactory,
                 transport_factory: Callable[..., Any] | None = None,
                 runtime_: runtime.MountRuntime | None = None) -> None:
        self.spec = spec
        self.world = world
        self.rank, self.size = world.rank, world.size  # this node's index, the node count
        self.job = world.job  # the rank-level layout (None for a world of one)
        self.group = LeaderSide(self.job)  # this node's worker ranks, if any
        self.workers = len(self.job.workers_of(self.job.node)) if self.job else 0
        self.who = f"rank {self.rank} ({node_name()})"
        self.mountpoint = substitute(spec.mountpoint, self.rank)
        self.mount_key = runtime.mount_key(self.mountpoint)
        #: the mount's private runtime directory: made by the caller (a single node, so that
        #: its errors reach the user before the daemon goes to the background) or in run()
        self.runtime = runtime_
        self.index_copy: str | None = None
        self.local_dir = substitute(spec.local_dir, self.rank) if spec.local_dir else None
        self.frontend_factory = frontend_factory
        self.transport_factory = transport_factory
        self.created_local = False
        self.progress: Callable[[], None] = lambda: None  # a partition staged (ReadySignal)
        self.stats = ReadStats()
        self.transport = None
        self.parts: LocalPartitions | None = None
        self.peers: PeerSource | None = None
        self.ctx: MountContext | None = None
        self.frontend = None
        self.server: ControlServer | None = None
        self.stage_report = None
        self.bcast_seconds = 0.0
        #: the reason this node stops, once it does
        self.stopping: str | None = None
        #: every rank is stopping (a signal or a peer's SHUTDOWN): the drain waits only
        #: DRAIN_GRACE for the peers' DONE (fanstore.daemon.peerwatch).
        self.job_stopping = False
        self.terminated = 0  # the last terminating signal received
        self.peer_died = False  # hydra's SIGUSR1 before the node served
        self._relayed = False  # node 0 has told every node to stop
        self.drain_incomplete: list[int] = []
        self.skip_finalize = False
        #: the other nodes: probes while serving, the drain after (attached in _connect)
        self.watch = PeerWatch(self.rank, self.size, self._other_leaders(),
                               spec.remote_timeout, self.who, alive=launcher_alive)
        self._serving = threading.Event()
        self._sig_r = self._sig_w = -1
        self.table: list[list[int]] | None = None  # placement: partition -> nodes
        #: the nodes this one has found dead while serving (each acted on once)
        self.known_dead: set[int] = set()
        self._shim_lost = False  # the launcher ended this rank's hydra shim
        #: the launcher said a process of the job died (hydra's SIGUSR1, or our shim
        #: ended): only then is a node that does not answer taken for dead, not hung
        self.launcher_saw_death = False
        #: the status this node exits with: 1 once a death ended the job
        self.exit_status = 0

    # ------------------------------------------------------------------ signals
    def catch_signals(self) -> None:
        """SIGTERM/SIGINT/SIGHUP stop the node (everywhere in a multi-rank job), SIGUSR1
        (MPICH's hydra: "a peer died") probes the peers. The handlers only write the signal
        number to a pipe; a thread acts on it, so no handler ever takes a lock the
        interrupted code may hold."""
        self._sig_r, self._sig_w = os.pipe()
        os.set_blocking(self._sig_w, False)

        def handler(signum, _frame):
            try:
                os.write(self._sig_w, bytes([signum]))
            except OSError:
                pass

        for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1):
            signal.signal(s, handler)
        threading.Thread(target=self._signal_loop, name="fanstore-signals", daemon=True).start()

    def _signal_loop(self) -> None:
        while True:
            try:
                data = os.read(self._sig_r, 64)
            except OSError:
                return
            if not data:
                return
            for signum in data:
                if signum == signal.SIGUSR1:
                    if not self._serving.is_set():  # the start-up waits give up (_interrupted)
                        self.peer_died = True
                        continue
                    log.warning("the MPI launcher reports a dead process; probing peers")
                    self.launcher_saw_death = True
                    self.watch.alarm(everyone=True)
                    continue
                self.terminated = signum
                self.watch.alarm()
                self.request_stop(f"signal {signal.Signals(signum).name}",
                                  everywhere=self.world.is_mpi)

    # ------------------------------------------------------------------ stopping
    def request_stop(self, reason: str, everywhere: bool = False) -> None:
        """Stop serving (thread-safe). ``everywhere`` asks every peer to stop too: through
        node 0, which tells every node once (on_control), so that a job whose every node
        got the launcher's SIGTERM sends 2N messages, not N²; node 0 itself, or a node
        that found node 0 dead, tells every node directly."""
        if everywhere:
            self.job_stopping = True
            if self.transport is not None and self.stopping is None:
                leader0 = self.watch.others[0] if self.watch.others else None
                direct = self.rank == 0 or (self.peers is not None and self.peers.node_dead(0))
                targets = self.watch.others if direct or leader0 is None else [leader0]
                if self.rank == 0:
                    self._relayed = True
                self._send_shutdown(targets, reason)
        if self.stopping is not None:
            return
        self.stopping = reason
        log.info("stopping: %s", reason)
        self.end_remote_reads()
        if self.frontend is not None:
            self.frontend.stop(reason)

    def on_control(self, msg: P.ControlMsg) -> None:
        """Transport thread: a peer asks everyone to stop, or says it is done."""
        node = self.job.node_of[msg.rank] if self.job and 0 <= msg.rank < self.job.size \
            else msg.rank
        if msg.kind == P.Control.SHUTDOWN:
            log.info("node %d asks every node to stop: %s", node, msg.reason)
            self.job_stopping = True
            if is_death(msg.reason):
                self.exit_status = 1  # a rank is dead: no MPI_Finalize (it would wait)
            if self.rank == 0 and not self._relayed:  # node 0 tells every node, once
                self._relayed = True
                self._send_shutdown([r for r in self.watch.others if r != msg.rank],
                                    f"node {node}: {msg.reason}")
            self.request_stop(f"node {node}: {msg.reason}")
        elif msg.kind == P.Control.DONE and self.peers is not None:
            self.peers.done.add(node)
        elif msg.kind == P.Control.ALL_DONE and self.peers is not None:
            for dead in dead_in(msg.reason):  # dead, not done: no MPI_Finalize with them
                if 0 <= dead < self.size and dead != self.rank:
                    for r in self.peers.ranks_of(dead):
                        self.peers.mark_dead(r, "node 0 found its node dead")
            self.peers.done.update(n for n in range(self.size) if n != self.rank)

    def _send_shutdown(self, ranks: list[int], reason: str) -> None:
        # In a thread: the caller may be a frontend or the transport's own thread, which
        # must not wait on MPI.
        threading.Thread(target=self.transport.send_control,
                         args=(P.Control.SHUTDOWN, ranks, reason), daemon=True).start()

    # ------------------------------------------------------------------ phases
    def load_index(self):
        """The index, read and validated by rank 0 and broadcast to every rank. Validated
        once: the others check that the bytes they received are intact (the header's
        checksum of the stored body) and parse them."""
        from fanstore.format.index import INDEX_NAME, read_index_bytes, read_index_file

        data = index = error = None
        if self.rank == 0:
            try:
                path, data = read_index_file(self.spec.store)
                index = read_index_bytes(data, where=path)  # before sending it out
            except FanStoreError as exc:  # every rank must learn of it, not just rank 0
                error = exc
                data = b"\0ERROR\0" + str(exc).encode("utf-8", "replace")
        t0 = time.monotonic()
        data = self.world.bcast_bytes(data)
        if bytes(data[:7]) == b"\0ERROR\0":
            if error is not None:
                raise error  # rank 0 keeps its error's kind (and exit code: 33 for a newer format)
            raise FormatError(bytes(data[7:]).decode("utf-8", "replace"))
        if index is None:
            index = read_index_bytes(data, where=os.path.join(self.spec.store, INDEX_NAME),
                                     validate=False)
        del data
        self.bcast_seconds = time.monotonic() - t0
        return index

    def stage(self, index, mine: list[int]) -> str:
        from fanstore.daemon.staging import stage_partitions

        if not self.local_dir:
            return self.spec.store
        self.stage_report = stage_partitions(
            self.spec.store, self.local_dir, index, mine, jobs=self.spec.stage_jobs,
            who=self.who, owned=not self.spec.keep_local, progress=self.progress)
        # only a directory staging created is removed at exit (never one made by another)
        self.created_local = self.stage_report.created
        log.info("%s", self.stage_report.line(self.who))
        return self.local_dir

    def run(self, on_ready: Callable[[], None] | None = None) -> int:
        """Start, serve until stopped, drain, clean up. Raises FanStoreError on failure."""
        try:
            code = self._run(on_ready)
        finally:
            # whatever ended the run: no index copy outlives a daemon that can remove it,
            # nor its state a launcher that is gone (nobody is left to read the error)
            runtime.remove_shared(self.index_copy)
            if self.runtime is not None and not launcher_alive():
                self.runtime.remove()
        # A clean end leaves nothing; a failed one keeps its state (the error, for
        # `fanstore wait`) and log until a later mount or umount sweeps it.
        if self.runtime is not None:
            self.runtime.remove()
        return code

    def _run(self, on_ready: Callable[[], None] | None) -> int:
        spec = self.spec
        early: FanStoreError | None = None
        try:
            self.group.hello(os.getpid(), self.spec.start_timeout, self.world)
            if self.runtime is None:
                self.runtime = runtime.MountRuntime.create(self.mountpoint)
            self.runtime.write_state(pid=os.getpid(), rank=self.rank, ranks=self.size,
                                     mountpoint=self.mount_key, phase="starting",
                                     worker_pids=self.group.worker_pids)
        except FanStoreError as exc:  # every rank must learn of it at the first gate
            early = exc
        try:
            index, table, mine = self._start(early)
            index = self._connect(index, table, mine)
            release_free_memory()  # what loading the index freed (the private body)
            self._mount()
            self.runtime.write_state(phase="ready")
            log.info("%s: serving %s at %s (%d entries, %d partitions here)", self.who,
                     spec.store, self.mountpoint, index.n_entries, len(mine))
            if on_ready is not None:
                on_ready()
            self._serving.set()
            if self.world.is_mpi:
                threading.Thread(target=self.watch.watch,
                                 args=(self._serving, self.request_stop, self.check_deaths),
                                 name="fanstore-probe", daemon=True).start()
            reason = self.frontend.serve()
            self.stopped_serving()
            if self.stopping is None and reason != UNMOUNTED:
                # the frontend died (SIGKILL, a crash; or it lost its worker ranks): not
                # this node's own stop, so the job ends on every node, as for a dead daemon
                self.end_job(self._dead_worker() or reason)
            if self.stopping is None:
                self.stopping = reason
            log.info("%s: unmounted (%s)", self.who, self.stopping)
            self.runtime.write_state(phase="stopped")
        except FanStoreError as exc:
            if self.runtime is not None:
                self.runtime.write_state(phase="failed", error=str(exc))
            # a node that never arrived will not meet the others at the end either
            clean = (self.peers is None or not self.peers.dead) and not self.world.incomplete
            self.group.failed(str(exc))
            clean = self.group.exit(clean) and clean
            self._cleanup()
            self._finish_mpi(clean)
            raise
        self._drain()
        clean = not (self.peers and self.peers.dead) and not self.drain_incomplete \
            and not self.exit_status
        # the worker ranks stop serving peers and finalize with us (not if one is gone)
        clean = self.group.exit(clean) and clean
        self._cleanup()
        self._finish_mpi(clean)
        self.runtime.write_state(phase="stopped")
        return self.exit_status

    def _start(self, early: FanStoreError | None = None):
        """Index, placement, staging and the node's index copy: each node's own work,
        then a gate for all of them (``early``: an error before this point, reported
        through the first gate). A node that fails tells every node why; a node that
        does not arrive within ``--start-timeout`` is named."""
        spec = self.spec
        error: FanStoreError | None = None
        index = table = mine = None
        self.world.interrupted = self._interrupted
        # every node learns of an early failure (an unsafe runtime directory) before the
        # collectives below, which a failed node would otherwise leave the others waiting in
        self._gate("start", early)
        try:
            index = self.load_index()
            # collective under --replicas auto: after load_index, before anything can fail
            replicas = decide_replicas(spec.replicas, index, self.world, self.rank, self.size,
                                       self.local_dir, spec.local_capacity, self.who)
            self.replicas = replicas
            table = pl.placement([p.broadcast for p in index.partitions], self.size, replicas)
            mine = pl.local_partitions(table, self.rank)
            notice = mounttable.prepare_mountpoint(self.mountpoint)
            if notice:
                log.warning("%s", notice)
            data_dir = self.stage(index, mine)
            self.parts = LocalPartitions(data_dir, index, mine)
            self.data_dir = data_dir
            index = self._share_index(index)  # before the gate: /dev/shm may be full
            if self.terminated:
                raise MountError(f"{self.who}: stopped by signal "
                                 f"{signal.Signals(self.terminated).name} while starting")
        except FanStoreError as exc:
            error = exc
        self._gate("staging", error)
        return index, table, mine

    def _gate(self, what: str, error: FanStoreError | None) -> None:
        """A start-up gate (World.gate): raise this node's own error (its kind and exit
        status kept), or one line naming the nodes that failed or did not arrive."""
        verdict = self.world.gate(what, str(error) if error is not None else None)
        if error is not None:
            raise error
        if verdict:
            raise MountError(f"{self.who}: not starting: {verdict}")

    def _interrupted(self) -> str | None:
        """Why a start-up wait must end now: a terminating signal came, or the launcher
        reports a dead process of the job (hydra's SIGUSR1): a job that lost a rank while
        starting cannot pass its gates."""
        if self.terminated:
            return f"stopped by signal {signal.Signals(self.terminated).name} while starting"
        if self.peer_died or shim_gone():
            return "the MPI launcher reports a dead process of the job while starting"
        return None

    def _connect(self, index, table, mine) -> None:
        """The peer transport, the read core, the control socket and the frontend."""
        spec = self.spec
        ns = Namespace(index)
        if self.world.is_mpi or self.transport_factory is not None:
            if self.transport_factory is not None:
                self.transport = self.transport_factory(self)
            else:
                from fanstore.daemon.mpitransport import MpiTransport

                self.transport = MpiTransport(self.job.comm, self.parts, self.on_control,
                                              piece=self.spec.mpi_piece)
            self.transport.start()
            self.peers = PeerSource(self.transport, table, self.rank, self.size,
                                    spec.remote_timeout, self.stats,
                                    show=lambda e: ns.show(e),
                                    ranks_of=self.job.servers_of if self.job else None,
                                    me=self.job.rank if self.job else None)
            self.watch.attach(self.transport, self.peers)
        self.table = table
        reader = ChunkReader(index, RoutedSource(self.parts, self.peers),
                             cache_bytes=spec.cache_mb << 20, stats=self.stats)
        self.stats.extra.update(nodestats.static_stats(self, index, mine))
        share = self._share(table, mine)
        self.ctx = MountContext(share=share, index=index, ns=ns, reader=reader,
                                runtime=self.runtime, request_stop=self.request_stop,
                                alive=lambda: launcher_alive() and self.group.workers_alive())
        self.frontend = self.frontend_factory(self.ctx)
        # what the worker ranks serve (they then join the frontend's worker socket, if any)
        self.group.start(share)
        from fanstore.daemon.service import handlers

        self.server = ControlServer(share.socket_path, handlers(self),
                                    owner_ops=OWNER_OPS)
        self.server.start()
        server = self.server
        self.stats.extra["control_refused"] = lambda: server.refused
        return index

    def _share(self, table, mine) -> NodeShare:
        """This node's share of the mount, made once: what its frontend serves from and
        what the kernel frontend process and the worker ranks receive, as it is."""
        spec = self.spec
        kernel = spec.frontend == "kernel"
        # the kernel frontend's requests are served by the node's worker ranks (joining at
        # its worker socket) or workers it forks; pyfuse3's by this process
        ranks = kernel and self.workers > 0
        return NodeShare(
            spec=spec, mountpoint=self.mountpoint, data_dir=os.path.abspath(self.data_dir),
            local_parts=tuple(mine),
            replicated=tuple(p for p in mine if any(r != self.rank for r in table[p])),
            table=tuple(tuple(row) for row in table), index_copy=self.index_copy,
            socket_path=self.runtime.socket_path,
            worker_socket=os.path.join(self.runtime.path, WORKER_SOCKET) if ranks else "",
            fuse_workers=(self.workers if ranks else spec.worker_count()) if kernel else 1)

    def _share_index(self, index):
        """Write the decompressed index body to a private shared-memory file and use a
        read-only mapping of it from now on: the frontend process, its workers and API
        readers map the same pages, so the namespace costs its size once per node. The
        file has a random name (0600, created exclusively); its path is in state.json
        (for clean-up after a SIGKILL) and in the ``info`` reply (for readers)."""
        from fanstore.format.index import index_body_parts, map_index_body

        self.index_copy = self.runtime.create_shared(index_body_parts(index))
        self.runtime.write_state(index_copy=self.index_copy)
        self.index_bytes = None
        return map_index_body(self.index_copy, check=False, owner=os.geteuid(),
                              where=self.spec.store)

    def _mount(self) -> None:
        self.runtime.write_state(phase="mounting")
        error: FanStoreError | None = None
        try:
            self.frontend.mount()
        except FanStoreError as exc:
            error = exc
        try:
            verdict = self.world.gate("mount", str(error) if error is not None else None)
        except MountError:
            if error is None:
                self.frontend.unmount()
            raise
        if error is not None:
            raise error
        if verdict:
            self.frontend.unmount()
            raise MountError(f"{self.mountpoint}: not serving: {verdict}")
        if self.stopping is not None:  # a signal or a peer's SHUTDOWN came while starting
            self.frontend.stop(self.stopping)

    def stats_json(self) -> dict[str, Any]:
        return nodestats.stats_json(self)

    # ------------------------------------------------------------------ peers
    def _other_leaders(self) -> list[int]:
        """The transport ranks of the other nodes' daemons."""
        if self.job is None:
            return [r for r in range(self.size) if r != self.rank]
        return [r for n, r in enumerate(self.job.leaders) if n != self.rank]

    def _drain(self) -> None:
        """After unmounting: keep serving peers until every node is done or dead."""
        if self.transport is None:
            return
        self.runtime.write_state(phase="draining")
        self.watch.say_done()
        self.terminated = 0
        try:
            self.drain_incomplete = self.watch.drain(
                stopped=lambda: bool(self.terminated), job_stopping=lambda: self.job_stopping)
        finally:
            self.transport.stop()
        if self.terminated:
            log.info("%s: stopped serving peers (signal %s)", self.who,
                     signal.Signals(self.terminated).name)
