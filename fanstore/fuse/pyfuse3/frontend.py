"""The pyfuse3 frontend: one process (the node daemon itself) serves every FUSE request on a
trio loop; reads go through the async layer over the node's read core.

Kept beside the kernel-protocol frontend (``--frontend pyfuse3``): it is the reference
implementation on top of libfuse, and needs nothing but pyfuse3.
"""

from __future__ import annotations

import logging

import pyfuse3
import trio

from fanstore import mounttable
from fanstore.errors import MountError
from fanstore.frontend import UNMOUNTED, MountContext
from fanstore.mountspec import FSNAME
from fanstore.fuse.pyfuse3.reader import AsyncReader
from fanstore.fuse.fsops import FsOps
from fanstore.fuse.pyfuse3.operations import FanStoreOps

log = logging.getLogger(__name__)

#: pyfuse3's concurrent request handlers at most
MAX_TASKS = 64


class Pyfuse3Frontend:
    def __init__(self, ctx: MountContext) -> None:
        self.ctx = ctx
        self.fs = FsOps(ctx.ns)  # (a spec with prefetch mode names the kernel frontend)
        self.reader = AsyncReader(ctx.ns, ctx.reader, threads=ctx.spec.decode_threads())
        self.ops = FanStoreOps(self.fs, self.reader)
        self._token: trio.lowlevel.TrioToken | None = None
        self._reason: str | None = None
        self._mounted = False

    # ------------------------------------------------------------------ Frontend
    def mount(self) -> None:
        fuse_opts = set(pyfuse3.default_options)
        fuse_opts |= {"ro", f"fsname={FSNAME}", "subtype=fanstore"}
        if self.ctx.spec.allow_other:
            fuse_opts.add("allow_other")
        try:
            pyfuse3.init(self.ops, self.ctx.mountpoint, fuse_opts)
        except RuntimeError as exc:
            import os

            hint = "" if os.path.exists("/dev/fuse") else " (/dev/fuse is missing)"
            raise MountError(f"cannot mount {self.ctx.mountpoint}: {exc}{hint}") from exc
        self._mounted = True

    def unmount(self) -> None:
        self._close()

    def serve(self) -> str:
        try:
            trio.run(self._main)
        finally:
            self._close()
        return self._reason or UNMOUNTED

    def stop(self, reason: str) -> None:
        if self._reason is None:
            self._reason = reason
        token = self._token
        if token is not None:
            try:
                token.run_sync_soon(pyfuse3.terminate)  # thread- and signal-safe
            except trio.RunFinishedError:
                pass

    def stats(self) -> dict:
        return {}

    def set_order(self, entries: list[int], client: str) -> int:
        raise MountError("this mount is in sync mode; mount it with --mode prefetch")

    def prefetch_window(self) -> int:
        raise MountError("this mount is in sync mode; mount it with --mode prefetch")

    # ------------------------------------------------------------------ internals
    async def _main(self) -> None:
        self._token = trio.lowlevel.current_trio_token()
        async with trio.open_nursery() as nursery:
            if self._reason is not None:  # stopped before the loop ran
                pyfuse3.terminate()
            await pyfuse3.main(min_tasks=1, max_tasks=MAX_TASKS)
            nursery.cancel_scope.cancel()

    def _close(self) -> None:
        if not self._mounted:
            return
        self._mounted = False
        try:
            pyfuse3.close(unmount=True)
        except Exception:  # pragma: no cover - best effort
            log.exception("pyfuse3.close failed")
        mnt = self.ctx.mountpoint
        if mounttable.mount_status(mnt) != "none":
            ok, msg = mounttable.fusermount_unmount(mnt, lazy=True)
            if not ok:
                log.error("%s: could not unmount: %s", mnt, msg)


def create(ctx: MountContext) -> Pyfuse3Frontend:
    return Pyfuse3Frontend(ctx)
