"""How a node daemon ends: its clean-up, MPI's end, and the clean-up of a daemon whose
launcher is gone (:class:`NodeEnd`, the last part of :class:`fanstore.daemon.node.Node`)."""

from __future__ import annotations

import logging
import shutil

from fanstore import mounttable, runtime

log = logging.getLogger("fanstore.daemon.node")


class NodeEnd:
    """The end of a :class:`~fanstore.daemon.node.Node` (a mixin: the attributes are the
    node's)."""

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
        """The data this node staged (unless --keep-local): the whole local directory when
        staging made it, else only the partitions it copied (never another user's dir)."""
        from fanstore.daemon.staging import remove_staged

        if self.local_dir and not self.spec.keep_local:
            if self.created_local:
                shutil.rmtree(self.local_dir, ignore_errors=True)
            elif self.stage_report is not None:
                remove_staged(self.local_dir, self.stage_report.partitions)

    def emergency_cleanup(self) -> None:
        """What must not outlive a daemon that is about to leave with ``os._exit`` (its
        launcher is gone and it did not end by itself: fanstore.daemon.launcher.Lifeline):
        the mount (lazily: a reader may hold it), the index copy, the staged data. Called
        from another thread; each step is on its own."""
        if self.frontend is not None:
            self.frontend.stop("the MPI launcher is gone")
        if self.mount_key in mounttable.fuse_mounts():
            mounttable.fusermount_unmount(self.mountpoint, lazy=True)
        runtime.remove_shared(self.index_copy)
        self._remove_local()
        if self.runtime is not None:
            self.runtime.write_state(phase="stopped", error="the MPI launcher is gone")

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
