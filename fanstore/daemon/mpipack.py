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

import json
import logging
import os
import shutil
import struct
from typing import Any, Callable

import numpy as np

from fanstore.daemon.world import World
from fanstore.errors import FanStoreError, PackError
from fanstore.pack.options import PackOptions, PackSummary
from fanstore.pack.worker import PartResult, PartTask, run_tasks
from fanstore.pack.write import finish, prepare

log = logging.getLogger(__name__)

_LEN = struct.Struct("<Q")
_RESULT_ARRAYS = ("entries", "file_sums", "chunk_counts", "chunk_firsts", "data_offsets")


class QuietPackError(FanStoreError):
    """Raised on ranks other than 0 after rank 0 has reported the error."""

    quiet = True


def encode_tasks(tasks: list[PartTask]) -> bytes:
    doc = {
        "codecs": tasks[0].codecs if tasks else [],
        "tasks": [
            {"number": t.number, "path": t.path, "chunk_size": t.chunk_size,
             "files": [[e, os.fsdecode(p), size, slot, solid, group]
                       for e, p, size, slot, solid, group in t.files]}
            for t in tasks
        ],
    }
    return json.dumps(doc).encode()


def decode_tasks(data: bytes) -> list[PartTask]:
    doc = json.loads(data)
    codecs = doc["codecs"]
    return [
        PartTask(t["number"], t["path"],
                  [(e, os.fsencode(p), size, slot, solid, group)
                   for e, p, size, slot, solid, group in t["files"]],
                  codecs, t["chunk_size"])
        for t in doc["tasks"]
    ]


def encode_results(results: list[PartResult]) -> bytes:
    out = bytearray()
    for r in results:
        arrays: list[tuple[str, np.ndarray]] = []
        if r.error is None:
            arrays = [(name, getattr(r, name)) for name in _RESULT_ARRAYS]
            arrays += [("c_" + name, arr) for name, arr in r.chunks.items()]
        header = {
            "number": r.number, "size": r.size, "checksum": r.checksum,
            "raw_bytes": r.raw_bytes, "error": r.error,
            "arrays": [[name, arr.dtype.str, int(arr.shape[0])] for name, arr in arrays],
        }
        head = json.dumps(header).encode()
        out += _LEN.pack(len(head)) + head
        for _name, arr in arrays:
            out += np.ascontiguousarray(arr).tobytes()
    return bytes(out)


def decode_results(data: bytes) -> list[PartResult]:
    results = []
    pos = 0
    view = memoryview(data)
    while pos < len(data):
        (n,) = _LEN.unpack_from(data, pos)
        pos += _LEN.size
        header = json.loads(bytes(view[pos : pos + n]))
        pos += n
        r = PartResult(header["number"], header["size"], header["checksum"])
        r.raw_bytes = header["raw_bytes"]
        r.error = header["error"]
        chunks: dict[str, np.ndarray] = {}
        for name, dtype, count in header["arrays"]:
            nbytes = np.dtype(dtype).itemsize * count
            arr = np.frombuffer(bytes(view[pos : pos + nbytes]), dtype=dtype, count=count)
            pos += nbytes
            if name.startswith("c_"):
                chunks[name[2:]] = arr
            else:
                setattr(r, name, arr)
        if r.error is None:
            r.chunks = chunks
        results.append(r)
    return results


def pack_mpi(src: str, dest: str, policy_factory: Callable[[], Any], options: PackOptions,
             world: World | None = None) -> PackSummary | None:
    """Pack with every rank of the job; returns the summary on rank 0, None elsewhere."""
    if world is not None:
        return _pack_ranks(src, dest, policy_factory, options, world)
    world = World.from_mpi(ranks_per_node=1)  # every rank packs: each a node of its own
    try:
        summary = _pack_ranks(src, dest, policy_factory, options, world)
    except FanStoreError:  # reported to every rank through the same collectives
        world.finalize()
        raise
    world.finalize()
    return summary


def _pack_ranks(src: str, dest: str, policy_factory: Callable[[], Any], options: PackOptions,
                world: World) -> PackSummary | None:
    rank, size = world.rank, world.size
    plan = None
    error = ""
    if rank == 0:
        try:
            plan = prepare(src, dest, policy_factory(), options)
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
        results = run_tasks(mine, options, sum(f[2] for t in mine for f in t.files))
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
