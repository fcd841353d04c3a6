"""One FanStore daemon per rank: the life of a node from start-up to exit.

1. MPI start-up and checks: MPI_THREAD_MULTIPLE, and under ``srun`` a world size equal
   to the number of Slurm tasks (a launch without an MPI plugin gives singletons).
2. Rank 0 reads the index from the shared store and broadcasts its bytes; every rank
   validates and loads it, so every node holds the whole namespace.
3. Placement (:mod:`fanstore.daemon.placement`) says which partitions this rank holds;
   they are staged into ``--local-dir`` (or read in place without one).
4. The MPI server thread starts; a gate (an all-reduce) makes every rank wait until all
   have staged, and a second gate until all have mounted: only then does any mount
   report ready, so ``fanstore wait`` returns on a node only when every node serves.
5. Reads of other ranks' partitions go to the nearest live owner and fail over.
6. Stopping: SIGTERM/SIGINT stop every rank (SHUTDOWN to all peers); ``fanstore umount``
   stops this node only. An unmounted daemon keeps serving its peers ("drain") until
   every rank is done or known dead, then exits; MPI_Finalize is called only when no
   peer died (finalizing with a dead peer hangs or aborts).

With no MPI launcher this runs as a single "solo" rank: staging and everything else
work the same, and the daemon may go to the background.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import sys
import threading
import time
from typing import Any

import numpy as np

from fanstore.daemon import placement as pl
from fanstore.daemon import protocol as P
from fanstore.daemon.transport import Backoff, RemoteTimeout, node_name, wait_request
from fanstore.errors import FanStoreError, FormatError, MountError, RemoteError

log = logging.getLogger(__name__)

HYDRA_MARKERS = ("HYDI_CONTROL_FD", "HYDRA_CONTROL_FD")


# --------------------------------------------------------------------------- world


def choose_netmod(library_version: str, environ) -> str | None:
    """The MPICH netmod to force, if any, for the MPI library described by ``library_version``.

    The MPICH wheel from PyPI (5.0.2, ``ch4:ucx ofi``) defaults to UCX, whose large
    addresses are exchanged through PMI in segments at MPI_Init; under ``srun --mpi=pmi2``
    some of those PMI messages carry stale heap bytes, so a launch intermittently fails
    ("mpi/pmi2: invalid client request" in slurmd's log) or, worse, a rank gets a wrong
    address and its peers never reach it. Measured with a reproducer whose heap holds freed
    data, 2 nodes x 1 rank: UCX 14 of 30 launches failed, OFI 0 of 60. So for that wheel
    FanStore selects OFI; a site MPI, or an explicit ``MPIR_CVAR_CH4_NETMOD``, is left alone.
    """
    if "MPIR_CVAR_CH4_NETMOD" in environ:
        return None
    if "pypi.org/p/mpich" in library_version and "ucx" in library_version \
            and "ofi" in library_version:
        return "ofi"
    return None


#: How long a stopping job's daemon waits for its peers to say they are done (see Node).
DRAIN_GRACE = 2.0


class World:
    """This process's place in the job: rank, size, and collective helpers that never spin."""

    def __init__(self, rank: int = 0, size: int = 1, comm=None, mpi=None) -> None:
        self.rank = rank
        self.size = size
        self.comm = comm
        self.MPI = mpi

    @classmethod
    def solo(cls) -> "World":
        return cls()

    @classmethod
    def from_mpi(cls) -> "World":
        try:
            import mpi4py
        except ImportError:
            raise MountError("running under an MPI launcher but mpi4py is not installed: pip "
                             "install 'fanstore[mpi]' (on clusters, build it against the site "
                             "MPI)") from None
        mpi4py.rc.initialize = False  # MPI_Init below, once the netmod is chosen
        mpi4py.rc.finalize = False  # we finalize ourselves, and only when every peer is alive
        from mpi4py import MPI

        if not MPI.Is_initialized():
            netmod = choose_netmod(MPI.Get_library_version(), os.environ)
            if netmod:
                os.environ["MPIR_CVAR_CH4_NETMOD"] = netmod
            provided = MPI.Init_thread(MPI.THREAD_MULTIPLE)
        else:
            provided = MPI.Query_thread()
        world = MPI.COMM_WORLD
        if provided < MPI.THREAD_MULTIPLE:
            names = {MPI.THREAD_SINGLE: "SINGLE", MPI.THREAD_FUNNELED: "FUNNELED",
                     MPI.THREAD_SERIALIZED: "SERIALIZED"}
            raise MountError(
                f"the MPI library provides only MPI_THREAD_{names.get(provided, provided)}; "
                "FanStore needs MPI_THREAD_MULTIPLE (its server thread and its readers call "
                "MPI at the same time): use an MPI built with thread support")
        expected = _slurm_tasks()
        if expected is not None and world.Get_size() != expected:
            raise MountError(
                f"MPI world size is {world.Get_size()} but Slurm started {expected} tasks: "
                "launch with 'srun --mpi=pmi2' (without an MPI plugin every task is its own "
                "1-rank world and would silently serve only its own partitions)")
        comm = world.Dup()
        return cls(comm.Get_rank(), comm.Get_size(), comm, MPI)

    @property
    def is_mpi(self) -> bool:
        return self.comm is not None

    def _wait(self, req) -> None:
        wait_request(req, None, Backoff(50e-6, 5e-3))

    def all_ok(self, ok: bool) -> bool:
        """Collective: True if every rank passed ``ok=True``."""
        if not self.is_mpi:
            return ok
        mine = np.array([1 if ok else 0], dtype=np.int32)
        out = np.zeros(1, dtype=np.int32)
        self._wait(self.comm.Iallreduce(mine, out, op=self.MPI.MIN))
        return bool(out[0])

    def bcast_bytes(self, data: bytes | None) -> bytes | bytearray:
        """Broadcast bytes from rank 0 (in pieces, so sizes above 2 GiB work)."""
        if not self.is_mpi:
            assert data is not None
            return data
        n = np.array([len(data) if data is not None else 0], dtype=np.int64)
        self._wait(self.comm.Ibcast(n, root=0))
        size = int(n[0])
        buf = bytearray(data) if self.rank == 0 and data is not None else bytearray(size)
        view = memoryview(buf)
        for start in range(0, size, _PIECE):
            self._wait(self.comm.Ibcast([view[start : start + _PIECE], self.MPI.BYTE], root=0))
        return buf  # no second copy: the index is parsed straight from this buffer


    def finalize(self) -> None:
        """End MPI once every rank got here: a polled barrier first, so that no rank leaves
        while a peer's last message to it is still in flight (with MPICH's OFI netmod a send
        completes only once the receiver acknowledges it), then MPI_Finalize."""
        if not self.is_mpi or self.MPI.Is_finalized():
            return
        self._wait(self.comm.Ibarrier())
        self.MPI.Finalize()

    def gather_bytes(self, data: bytes) -> list[bytes] | None:
        """Rank 0 receives every rank's bytes (in rank order); others get None."""
        if not self.is_mpi:
            return [data]
        MPI = self.MPI
        if self.rank != 0:
            n = np.array([len(data)], dtype=np.int64)
            self._wait(self.comm.Isend(n, dest=0, tag=_GATHER_TAG))
            view = memoryview(data)
            for start in range(0, len(data), _PIECE):
                self._wait(self.comm.Isend([view[start : start + _PIECE], MPI.BYTE], dest=0,
                                           tag=_GATHER_TAG))
            return None
        out = [data]
        for src in range(1, self.size):
            n = np.zeros(1, dtype=np.int64)
            self._wait(self.comm.Irecv(n, source=src, tag=_GATHER_TAG))
            buf = bytearray(int(n[0]))
            view = memoryview(buf)
            for start in range(0, len(buf), _PIECE):
                self._wait(self.comm.Irecv([view[start : start + _PIECE], MPI.BYTE], source=src,
                                           tag=_GATHER_TAG))
            out.append(bytes(buf))
        return out


_GATHER_TAG = 21
_PIECE = 1 << 30


def _slurm_tasks() -> int | None:
    """Number of tasks of this Slurm step, if srun (not mpiexec) launched us."""
    if os.environ.get("SLURM_STEP_ID") is None:
        return None
    if any(os.environ.get(m) for m in HYDRA_MARKERS):
        return None  # mpiexec inside an allocation: its proxies are the Slurm tasks
    value = os.environ.get("SLURM_STEP_NUM_TASKS") or os.environ.get("SLURM_NTASKS")
    return int(value) if value and value.isdigit() else None


def substitute(path: str, rank: int) -> str:
    return path.replace("{rank}", str(rank)).replace("{host}", node_name())


# --------------------------------------------------------------------------- routing


class RoutedSource:
    """Where stored bytes come from: local partitions, else the nearest live owner."""

    def __init__(self, parts, transport, table: list[list[int]], rank: int, size: int,
                 timeout: float, stats, ns) -> None:
        self.parts = parts
        self.transport = transport
        self.table = table
        self.rank = rank
        self.size = size
        self.timeout = timeout
        self.stats = stats
        self.ns = ns
        self.dead: set[int] = set()
        self.done: set[int] = set()
        self._lock = threading.Lock()

    def is_local(self, part: int) -> bool:
        return self.parts.has(part)

    def has_replica_elsewhere(self, part: int) -> bool:
        return any(r != self.rank and r not in self.dead for r in self.table[part])

    def fetch(self, part: int, offset: int, length: int) -> bytes:
        return self.parts.fetch(part, offset, length)

    def mark_dead(self, rank: int, why: str) -> None:
        with self._lock:
            if rank in self.dead:
                return
            self.dead.add(rank)
        log.error("rank %d is unreachable (%s); its partitions are served by replicas if any",
                  rank, why)

    def revive(self, rank: int) -> None:
        with self._lock:
            if rank in self.dead:
                self.dead.discard(rank)
                log.warning("rank %d answers again", rank)

    def fetch_remote(self, part: int, offset: int, length: int, entry: int):
        owners = [r for r in pl.preference(self.table[part], self.rank, self.size)
                  if r != self.rank]
        tried = []
        for i, owner in enumerate(owners):
            if owner in self.dead:
                continue
            if tried:
                self.stats.remote_failovers += 1
            tried.append(owner)
            try:
                return self.transport.fetch(owner, part, offset, length, self.timeout)
            except RemoteTimeout as exc:
                self.mark_dead(owner, str(exc))
            except RemoteError as exc:
                log.error("%s: %s", self.ns.show(entry), exc)
        where = ", ".join(map(str, owners))
        why = "did not answer" if tried else "are unreachable"
        raise RemoteError(f"{self.ns.show(entry)}: the ranks holding partition {part} ({where}) "
                          f"{why}")


# --------------------------------------------------------------------------- the node


def mount_mpi(args) -> int:
    """``fanstore mount`` for a rank of a multi-rank job, or a solo daemon with staging."""
    from fanstore.cli import _daemonize, _mpi_launcher_world, _setup_logging

    if _mpi_launcher_world() is None and not args.foreground:
        return _daemonize(args, lambda on_ready: Node(args, World.solo()).run(on_ready))
    # MPI processes must stay in the foreground: the launcher owns them.
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)  # hydra's "a peer died"; handled once serving
    if _mpi_launcher_world() is not None:
        from fanstore.daemon.launcher import shim

        shim()  # under hydra: continue in a forked daemon (see launcher.py)
        world = World.from_mpi()
    else:
        world = World.solo()
    _setup_logging(args, stream=sys.stderr)
    for h in logging.getLogger().handlers:
        h.setFormatter(logging.Formatter(
            f"%(asctime)s fanstore[rank {world.rank}/{world.size}] %(levelname)s: %(message)s"))
    node = Node(args, world)
    node.catch_termination()
    try:
        code = node.run(lambda: print(
            f"fanstore: rank {world.rank}: mounted at {node.mountpoint}", file=sys.stderr,
            flush=True))
    except FanStoreError as exc:
        if not node.skip_finalize:
            raise
        print(f"fanstore: error: {exc}", file=sys.stderr, flush=True)
        code = exc.exit_code
    if node.skip_finalize:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


class Node:
    def __init__(self, args, world: World) -> None:
        self.args = args
        self.world = world
        self.rank, self.size = world.rank, world.size
        self.who = f"rank {self.rank} ({node_name()})"
        self.mountpoint = substitute(args.mountpoint, self.rank)
        self.local_dir = substitute(args.local_dir, self.rank) if args.local_dir else None
        self.created_local = False
        self.transport = None
        self.parts = None
        self.source: RoutedSource | None = None
        self.stage_report = None
        self.daemon = None
        self.stop_everywhere = False
        self._probe_now = threading.Event()

    # ------------------------------------------------------------------ signals
    def catch_termination(self) -> None:
        """Outside the trio loop (start-up, drain), SIGTERM/SIGINT only set a flag that the
        next phase acts on; trio's own handlers take over while the loop runs and put these
        back when it ends, so no window leaves the default (fatal) action in place."""

        def handler(signum, _frame):
            self.terminated = signum
            self._probe_now.set()

        for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(s, handler)

    terminated: int = 0

    # ------------------------------------------------------------------ phases
    def load_index(self):
        from fanstore.format.index import INDEX_NAME, read_index_bytes, read_index_file

        data = None
        if self.rank == 0:
            try:
                path, data = read_index_file(self.args.store)
                read_index_bytes(data, where=path)  # validate before sending it to everyone
            except FanStoreError as exc:  # every rank must learn of it, not just rank 0
                data = b"\0ERROR\0" + str(exc).encode("utf-8", "replace")
        t0 = time.monotonic()
        data = self.world.bcast_bytes(data)
        if bytes(data[:7]) == b"\0ERROR\0":
            raise FormatError(bytes(data[7:]).decode("utf-8", "replace"))
        index = read_index_bytes(data, where=os.path.join(self.args.store, INDEX_NAME))
        self.bcast_seconds = time.monotonic() - t0
        return index

    def stage(self, index, mine: list[int]) -> str:
        from fanstore.daemon.staging import stage_partitions

        if not self.local_dir:
            return self.args.store
        if not os.path.isdir(self.local_dir):
            self.created_local = True
        self.stage_report = stage_partitions(self.args.store, self.local_dir, index, mine,
                                             jobs=self.args.stage_jobs, who=self.who)
        log.info("%s", self.stage_report.line(self.who))
        return self.local_dir

    def on_control(self, msg: P.ControlMsg) -> None:
        """Server thread: a peer asks everyone to stop, or says it is done."""
        if msg.kind == P.Control.SHUTDOWN:
            log.info("rank %d asks every rank to stop: %s", msg.rank, msg.reason)
            self.job_stopping = True
            if self.daemon is not None:
                self.daemon.request_stop_threadsafe(f"rank {msg.rank}: {msg.reason}")
            else:
                self._early_stop = f"rank {msg.rank}: {msg.reason}"
        elif msg.kind == P.Control.DONE and self.source is not None:
            self.source.done.add(msg.rank)

    _early_stop: str | None = None
    #: every rank is stopping (a signal or a peer's SHUTDOWN), so no peer will read from us
    #: after its unmount: the drain then waits only DRAIN_GRACE for the peers' DONE (under
    #: scancel Slurm sends SIGKILL KillWait seconds after SIGTERM, often 5 s or less).
    job_stopping = False
    drain_incomplete: list[int] = []
    _probe_all = False
    skip_finalize = False

    def run(self, on_ready) -> int:
        from fanstore.asyncstore import ChunkStore, Stats
        from fanstore.daemon.transport import MpiTransport
        from fanstore.fuse import mount as fmount
        from fanstore.namespace import Namespace
        from fanstore.store import Decoder, LocalPartitions

        from fanstore import runtime

        args = self.args
        ok = False
        error: FanStoreError | None = None
        stats = Stats()
        runtime.write_state(self.mountpoint, pid=os.getpid(), rank=self.rank, ranks=self.size,
                            mountpoint=runtime.mount_key(self.mountpoint), phase="starting")
        try:
            try:
                index = self.load_index()
                replicas = args.replicas
                if replicas > self.size:
                    log.warning("--replicas %d is more than the %d ranks; using %d", replicas,
                                self.size, self.size)
                    replicas = self.size
                table = pl.placement([p.broadcast for p in index.partitions], self.size,
                                     replicas)
                mine = pl.local_partitions(table, self.rank)
                fmount.prepare_mountpoint(self.mountpoint)
                data_dir = self.stage(index, mine)
                self.parts = LocalPartitions(data_dir, index, mine)
                if self.terminated:
                    raise MountError(f"{self.who}: stopped by signal "
                                     f"{signal.Signals(self.terminated).name} while starting")
                ok = True
            except FanStoreError as exc:
                error = exc
            if not self.world.all_ok(ok):
                if error is not None:
                    runtime.write_state(self.mountpoint, phase="failed", error=str(error))
                    raise error
                runtime.write_state(self.mountpoint, phase="failed",
                                    error="another rank failed to start")
                raise MountError(f"{self.who}: another rank failed to start (see its messages)")
            ns = Namespace(index)
            if self.world.is_mpi:
                self.transport = MpiTransport(self.world.comm, self.parts, self.on_control)
                self.transport.start()
            self.source = RoutedSource(self.parts, self.transport, table, self.rank, self.size,
                                       args.remote_timeout, stats, ns)
            store = ChunkStore(ns, Decoder(index), self.source, cache_bytes=args.cache_mb << 20,
                               threads=_threads(args), stats=stats)
            stats.extra.update(self._static_stats(index, mine, replicas))
            source = self.source
            stats.extra["dead_ranks"] = lambda: sorted(source.dead)
            options = fmount.MountOptions(cache_mb=args.cache_mb, threads=args.threads,
                                          allow_other=args.allow_other, mode=args.mode,
                                          prefetch_mb=args.prefetch_mb,
                                          store_path=args.store if "://" in args.store
                                          else os.path.abspath(args.store))
            from fanstore.service import attach_prefetcher

            attach_prefetcher(store, options)
            options.extra_handlers["shutdown"] = self._control_shutdown
            code = self._serve(ns, store, options, on_ready)
        except FanStoreError:
            self._cleanup()
            self._finish_mpi(clean=self.source is None or not self.source.dead)
            raise
        self._drain()
        self._cleanup()
        self._finish_mpi(clean=not self.source.dead and not self.drain_incomplete)
        return code

    def _serve(self, ns, store, options, on_ready) -> int:
        from fanstore.fuse import mount as fmount

        def setup(daemon) -> None:
            self.daemon = daemon
            daemon.on_stop.append(self._on_stop)
            if self._early_stop:
                daemon.pending_stop = self._early_stop
            if self.terminated:
                daemon.pending_stop = f"signal {signal.Signals(self.terminated).name}"

        def gate(mounted: bool) -> bool:
            return self.world.all_ok(mounted)

        extra_tasks = (self._watch_peers,) if self.world.is_mpi else ()
        daemon = fmount.run(ns, store, self.mountpoint, options, on_ready=on_ready,
                            extra_tasks=extra_tasks, setup=setup, gate=gate,
                            signal_stop_everywhere=self.world.is_mpi)
        log.info("%s: unmounted (%s)", self.who, daemon.stop_reason)
        return 0

    def _control_shutdown(self, req: dict[str, Any]) -> dict[str, Any]:
        everywhere = bool(req.get("everywhere", False))
        self.daemon.request_stop(str(req.get("reason", "fanstore umount")), everywhere=everywhere)
        return {"ok": True}

    def _on_stop(self, reason: str, everywhere: bool = False) -> None:
        if everywhere:
            self.job_stopping = True
        if everywhere and self.transport is not None:
            # Tell every peer in a thread: the trio loop must not wait on MPI.
            others = [r for r in range(self.size) if r != self.rank]
            threading.Thread(target=self.transport.send_control,
                             args=(P.Control.SHUTDOWN, others, reason), daemon=True).start()

    async def _watch_peers(self, daemon) -> None:
        """Trio task: re-probe unreachable peers, and probe all when the launcher reports a
        dead process (MPICH's hydra sends SIGUSR1 to the survivors)."""
        import trio

        async def probe_loop():
            from fanstore.daemon.launcher import launcher_alive

            while True:
                if not launcher_alive():
                    daemon.request_stop("the MPI launcher is gone")
                    return
                with trio.move_on_after(5):
                    await trio.to_thread.run_sync(self._probe_now.wait, abandon_on_cancel=True)
                everyone = self._probe_now.is_set() or self._probe_all
                self._probe_now.clear()
                self._probe_all = False
                await trio.to_thread.run_sync(self._probe, not everyone, abandon_on_cancel=True)

        async with trio.open_nursery() as n:
            n.start_soon(probe_loop)
            with trio.open_signal_receiver(signal.SIGUSR1) as sigs:
                async for _ in sigs:
                    log.warning("the MPI launcher reports a dead process; probing peers")
                    self._probe_now.set()

    def _probe(self, only_dead: bool = False) -> None:
        if self.transport is None or self.source is None:
            return
        timeout = min(5.0, self.args.remote_timeout)
        for r in range(self.size):
            if r == self.rank or r in self.source.done:
                continue
            if only_dead and r not in self.source.dead:
                continue
            if self.transport.ping(r, timeout):
                self.source.revive(r)
            else:
                self.source.mark_dead(r, f"no answer to a ping within {timeout:g} s")

    def _drain(self) -> None:
        """After unmounting: keep serving peers until every rank is done or dead."""
        if self.transport is None:
            return
        from fanstore import runtime

        others = [r for r in range(self.size) if r != self.rank]
        runtime.write_state(self.mountpoint, phase="draining")
        self.transport.send_control(P.Control.DONE, others, "unmounted")
        from fanstore.daemon.launcher import launcher_alive

        self.terminated = 0
        grace_end = time.monotonic() + DRAIN_GRACE
        try:
            last_probe = 0.0  # probe at once: a peer may have died while nobody asked it
            announced = False
            while not self.terminated and launcher_alive():
                waiting = {r for r in others if r not in self.source.done
                           and r not in self.source.dead}
                if not waiting:
                    break
                if self.job_stopping and time.monotonic() > grace_end:
                    # Exit without MPI_Finalize: it could wait on them past SIGKILL.
                    self.drain_incomplete = sorted(waiting)
                    log.info("%s: the job is stopping; not waiting longer for ranks %s",
                             self.who, self.drain_incomplete)
                    break
                if not announced:
                    log.info("%s: unmounted; serving peers until ranks %s are done", self.who,
                             sorted(waiting))
                    announced = True
                if self._probe_now.is_set() or time.monotonic() - last_probe > 5:
                    self._probe_now.clear()
                    self._probe()
                    last_probe = time.monotonic()
                time.sleep(0.05)
        finally:
            self.transport.stop()
        if self.terminated:
            log.info("%s: stopped serving peers (signal %s)", self.who,
                     signal.Signals(self.terminated).name)

    def _cleanup(self) -> None:
        from fanstore.daemon.staging import remove_staged

        if self.transport is not None and self.transport.running:
            self.transport.stop()
        if self.parts is not None:
            self.parts.close()
        if self.local_dir and not self.args.keep_local:
            if self.created_local:
                shutil.rmtree(self.local_dir, ignore_errors=True)
            elif self.stage_report is not None:
                remove_staged(self.local_dir, self.stage_report.partitions)

    def _finish_mpi(self, clean: bool) -> None:
        """Finalize MPI when every peer is alive and done; otherwise leave it (finalizing
        with a dead peer hangs or aborts) and let the caller exit without it."""
        if not self.world.is_mpi:
            return
        MPI = self.world.MPI
        if clean and not MPI.Is_finalized():
            try:
                self.world.comm.Free()
            except Exception:  # noqa: BLE001 - freeing is a courtesy
                pass
            MPI.Finalize()
        elif not clean:
            log.warning("%s: exiting without MPI_Finalize (a peer is gone or did not finish)", self.who)
            self.skip_finalize = True

    def _static_stats(self, index, mine, replicas) -> dict[str, Any]:
        from fanstore.namespace import metadata_bytes

        memory = metadata_bytes(index)
        out = {
            "rank": self.rank,
            "ranks": self.size,
            "node": node_name(),
            "replicas": replicas,
            "local_partitions": mine,
            "metadata_bytes": memory,
            "metadata_bytes_per_entry": round(memory / max(1, index.n_entries), 1),
            "index_broadcast_seconds": round(getattr(self, "bcast_seconds", 0.0), 4),
        }
        if self.stage_report is not None:
            out.update(self.stage_report.to_json())
        t = self.transport
        if t is not None:
            out["served_requests"] = lambda: t.served_requests
            out["served_bytes"] = lambda: t.served_bytes
        return out


def _threads(args) -> int:
    return args.threads or max(4, 2 * len(os.sched_getaffinity(0)))
