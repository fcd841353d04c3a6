"""How a node daemon ends: a death in the job while it serves (issue 44), its clean-up,
MPI's end, and the clean-up of a daemon whose launcher is gone (:class:`NodeEnd`, the last
part of :class:`fanstore.daemon.node.Node`)."""

from __future__ import annotations

import logging
import shutil

from fanstore import mounttable, runtime
from fanstore.daemon import launcher
from fanstore.daemon.peerwatch import death_reason, lost_partitions
from fanstore.process import pid_alive

log = logging.getLogger("fanstore.daemon.node")


class NodeEnd:
    """The end of a :class:`~fanstore.daemon.node.Node` (a mixin: the attributes are the
    node's)."""

    def end_job(self, reason: str) -> None:
        """A process of the job died: stop every node, naming it (one error line)."""
        if self.stopping is None:
            log.error("%s: ending the job on every node: %s", self.who, reason)
        self.exit_status = 1
        self.request_stop(death_reason(reason), everywhere=self.world.is_mpi)

    def stopped_serving(self) -> None:
        """The frontend has ended (the mount is gone)."""
        self._serving.clear()
        self.end_remote_reads()

    def end_remote_reads(self) -> None:
        """The node stops serving its mount: reads of other nodes still waiting for a reply
        (this process's, for the frontend's workers and API readers; the worker ranks')
        end within STOP_GRACE (1 s) with ENOTCONN, instead of waiting out the remote
        timeout for a peer that may have died, which held the frontend's workers, the
        readers and so the node's end (measured: node 1's daemon SIGKILLed under readers
        of nodes 0 and 3: 12.8 s to nothing left, a read of 10.5 s). Serving the peers
        goes on (the drain)."""
        if self.transport is not None:
            self.transport.interrupt("the node stops serving its mount")
        self.group.stopped_serving()

    def _dead_worker(self) -> str | None:
        """Why this node's worker ranks cannot go on: one of them has died."""
        if self.job is not None:
            for rank, pid in zip(self.job.workers_of(self.job.node), self.group.worker_pids):
                if not pid_alive(pid):
                    return f"worker rank {rank} (pid {pid}) of node {self.rank} died"
        return None

    def check_deaths(self) -> None:
        """While serving (the probe thread, every second): act on what died.

        - one of this node's worker ranks: the job ends on every node;
        - this rank's hydra shim (the launcher ended it: a process of the job died, or the
          launcher was told to stop and cleaned up with SIGKILL, which no longer reaches
          this daemon): probe every node at once;
        - another node (every rank of it marked dead, by a ping or confirmed by one), once
          the launcher has said a process died (SIGUSR1, or the shim gone; without that it
          may be hung, and is re-probed and revived when it answers again): the job ends
          on every node, naming it, when a partition has no live holder left; with
          ``--replicas`` covering it, the node goes on serving (logged once);
        - the shim gone with no node dead: the launcher stopped the job, so it ends.
        """
        if self.stopping is not None:
            return
        dead_worker = self._dead_worker()
        if dead_worker:
            self.end_job(dead_worker)
            return
        if not self._shim_lost and launcher.shim_gone():
            self._shim_lost = True
            self.launcher_saw_death = True
            log.warning("%s: the MPI launcher ended this rank's process (shim pid %s); "
                        "probing every node", self.who, launcher.shim_pid)
            self.watch.probe()
        if self.peers is None or self.table is None or not self.launcher_saw_death:
            return  # a node that does not answer may be hung: EIO, re-probed, revived
        new = [n for n in self.peers.dead_nodes() if n not in self.known_dead]
        if any(r not in self.watch.pinged_dead for n in new for r in self.peers.ranks_of(n)):
            # marked dead by a read that timed out: ping first (a busy node answers now)
            self.watch.probe(only_dead=True)
            new = [n for n in self.peers.dead_nodes() if n not in self.known_dead]
        if new:
            self.known_dead.update(new)
            names = ", ".join(f"node {n}" for n in new)
            lost = lost_partitions(self.table, self.known_dead)
            if lost:
                self.end_job(f"{names} died (no answer to pings); {len(lost)} partitions "
                             "have no live copy")
                return
            log.warning("%s: %s died (no answer to pings); its partitions are served from "
                        "replicas", self.who, names)
        if self._shim_lost and not self.known_dead:
            self.end_job(f"the MPI launcher ended rank {self.rank}'s process (its shim); "
                         "every node answers")

    def _cleanup(self) -> None:
        if self.server is not None:
            self.server.close()
            self.server = None
        runtime.remove_shared(self.index_copy)
        runtime.sweep_shared()  # and what killed daemons of this user left (a dead peer's)
        if self.transport is not None and self.transport.running:
            self.transport.stop()
        if self.parts is not None:
            self.parts.close()
        self._remove_local()

    def _remove_local(self) -> None:
        """The data this node staged (unless --keep-local), and its owner record: the whole
        local directory when staging made it (or inherited it from a dead mount that had),
        else only the partitions it staged (never another user's dir)."""
        from fanstore.daemon import stageowner
        from fanstore.daemon.staging import remove_staged

        if self.local_dir and not self.spec.keep_local:
            # never the directory while another live mount stages there
            if self.created_local and not stageowner.others_alive(self.local_dir):
                shutil.rmtree(self.local_dir, ignore_errors=True)
            elif self.stage_report is not None:
                remove_staged(self.local_dir, self.stage_report.partitions)
            if self.stage_report is not None:
                stageowner.release(self.stage_report.owner_record)

    def emergency_cleanup(self) -> None:
        """What must not outlive a daemon that is about to leave with ``os._exit`` (its
        launcher is gone and it did not end by itself: fanstore.daemon.launcher.Lifeline):
        the mount (lazily: a reader may hold it), the index copy, the staged data, the
        runtime directory. Called from another thread; each step is on its own."""
        if self.frontend is not None:
            self.frontend.stop("the MPI launcher is gone")
        if self.mount_key in mounttable.fuse_mounts():
            mounttable.fusermount_unmount(self.mountpoint, lazy=True)
        runtime.remove_shared(self.index_copy)
        self._remove_local()
        if self.runtime is not None:  # (was left: measured once in 400 launcher kills)
            self.runtime.remove()

    def _finish_mpi(self, clean: bool) -> None:
        """Finalize MPI when every peer is alive and done; otherwise leave it (finalizing
        with a dead peer hangs or aborts) and tell the caller to exit without it. Either
        way this node's worker ranks end first (see LeaderSide.wait_workers_gone)."""
        if not self.world.is_mpi:
            return
        MPI = self.world.MPI
        if clean and not MPI.Is_finalized():
            if self.transport is not None and self.transport.running:
                self.transport.stop()
            if not self.world.finish_job():
                log.warning("%s: not every rank reached the end of the job; exiting without "
                            "MPI_Finalize", self.who)
                self.skip_finalize = True
            self.group.wait_workers_gone()
        elif not clean:
            self.group.wait_workers_gone()
            log.warning("%s: exiting without MPI_Finalize (a peer is gone or did not finish)",
                        self.who)
            self.skip_finalize = True
