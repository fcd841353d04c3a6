"""``fanstore pack`` across the nodes of an allocation: one MPI rank per node.

Rank 0 scans the source, plans partitions and codecs (exactly as a one-node pack does) and
creates the temporary store directory on the shared file system. The plan goes to every
rank as JSON (paths as surrogate-escaped strings; no pickle). Rank r compresses the
partitions p with p mod n == r, with a pool of worker processes on its node, writing
straight into the shared temporary directory. Each rank sends its chunk rows back to rank
0 as one buffer (a JSON header and raw little-endian arrays); rank 0 writes the index and
installs the store atomically, then tells every rank the outcome, so all ranks exit with
the same status. Because the plan is rank 0's, the result is byte-identical to a one-node
pack of the same tree.
"""

from __future__ import annotations

import logging
import shutil
from typing import Any, Callable

from fanstore.daemon.world import World
from fanstore.errors import FanStoreError, PackError
from fanstore.pack.options import PackOptions, PackSummary
from fanstore.pack.pool import WorkerPool
from fanstore.pack.wire import decode_results, decode_tasks, encode_results, encode_tasks
from fanstore.pack.worker import PartResult, run_tasks
from fanstore.pack.write import finish, pack_workers, prepare

log = logging.getLogger(__name__)

#: Seconds MPI_Init may take (every rank of the job must start); the plan and the
#: compression then take as long as the data needs: a rank that is lost ends the job
#: through its launcher (hydra ends every rank at once; under Slurm, srun
#: --kill-on-bad-exit, docs/slurm.md).
START_TIMEOUT = 120.0


class QuietPackError(FanStoreError):
    """Raised on ranks other than 0 after rank 0 has reported the error."""

    quiet = True


def pack_mpi(src: str, dest: str, policy_factory: Callable[[Any], Any], options: PackOptions,
             world: World | None = None) -> PackSummary | None:
    """Pack with every rank of the job; returns the summary on rank 0, None elsewhere."""
    if world is not None:
        return _pack_ranks(src, dest, policy_factory, options, world)
    from fanstore.daemon import launcher

    # every rank packs: each a node of its own
    world = World.from_mpi(ranks_per_node=1, timeout=START_TIMEOUT,
                           alive=launcher.launcher_alive)
    world.timeout = None  # (see START_TIMEOUT)
    try:
        summary = _pack_ranks(src, dest, policy_factory, options, world)
    except FanStoreError:  # reported to every rank through the same collectives
        world.finalize()
        raise
    world.finalize()
    return summary


def _pack_ranks(src: str, dest: str, policy_factory: Callable[[Any], Any], options: PackOptions,
                world: World) -> PackSummary | None:
    with WorkerPool(pack_workers(options)) as pool:
        pool.start()  # the workers start while rank 0 plans
        return _pack_share(src, dest, policy_factory, options, world, pool)


def _pack_share(src: str, dest: str, policy_factory: Callable[[Any], Any], options: PackOptions,
                world: World, pool: WorkerPool) -> PackSummary | None:
    rank, size = world.rank, world.size
    plan = None
    error = ""
    if rank == 0:
        try:
            plan = prepare(src, dest, policy_factory, options, pool=pool)
            payload = encode_tasks(plan.tasks)
        except FanStoreError as exc:
            error = str(exc)
            payload = b"\0ERROR\0" + error.encode("utf-8", "replace")
    else:
        payload = None
    payload = world.bcast_bytes(payload)
    if payload.startswith(b"\0ERROR\0"):
        if rank == 0:
            raise PackError(error)
        raise QuietPackError("rank 0 failed")
    tasks = decode_tasks(payload)
    mine = [t for t in tasks if t.number % size == rank]
    try:
        results = run_tasks(mine, options, sum(f[2] for t in mine for f in t.files), pool)
    except FanStoreError as exc:
        results = [PartResult(t.number, error=f"rank {rank}: {exc}") for t in mine]
    gathered = world.gather_bytes(encode_results(results))
    summary = None
    outcome = b"ok"
    if rank == 0:
        assert plan is not None and gathered is not None
        everything = [r for blob in gathered for r in decode_results(blob)]
        try:
            summary = finish(plan, everything, options)
        except BaseException as exc:
            shutil.rmtree(plan.tmp, ignore_errors=True)
            outcome = b"error"
            error_exc = exc
        else:
            error_exc = None
    outcome = world.bcast_bytes(outcome if rank == 0 else None)
    if rank == 0 and error_exc is not None:
        raise error_exc
    if outcome != b"ok":
        raise QuietPackError("the pack failed on rank 0")
    return summary
