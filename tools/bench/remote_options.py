#!/usr/bin/env python3
"""Design options for remote reads, measured before building one (issue "Remote reads at
local speed").

Two "nodes" on this machine. Node 1 holds a file of FILES x SIZE stored bytes (page cache
warm: this measures the path, not the disk); node 0 reads every piece once with READERS
reader processes. What differs is who is on the path:

  relay    node 0's readers are plain processes (like the kernel frontend's forked workers):
           each asks node 0's one MPI rank over a Unix socket (a struct header, the bytes
           back), which fetches over MPI from node 1's one MPI rank (a server thread:
           pread + Isend). Today's shape, minus the JSON.
  direct   every reader is an MPI rank of its own and asks a rank of node 1 directly; node
           1 has READERS ranks, each with a server thread (pread + Isend from the buffer),
           so neither side has one process on the path.

Both wait the same way: Test spinning WAIT_SPIN us after the last activity, then a sleep
growing from 20 us to 2 ms (docs/architecture.md "Never spin"). Printed per mode: files/s,
and CPU us per file of each process (time.process_time, every thread), summed per node.

    mpiexec -n 2 python remote_options.py relay 4          # 1 rank per node + 4 readers
    mpiexec -n 8 python remote_options.py direct 4         # 4 ranks per node

One JSON line per run (tools/bench/results/remote_options.jsonl when --save).
"""

from __future__ import annotations

import json
import os
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time

os.environ.setdefault("MPIR_CVAR_CH4_NETMOD", "ofi")

SIZE = int(os.environ.get("SIZE", 100_000))
FILES = int(os.environ.get("FILES", 4000))
WAIT_SPIN = float(os.environ.get("WAIT_SPIN", 200)) * 1e-6
REQ = struct.Struct("<qqq")  # piece index (-1: stop), offset, length
TAG_REQ, TAG_REP0 = 11, 1000


def poll(req, spin: float = WAIT_SPIN) -> None:
    start, nap = time.perf_counter(), 20e-6
    while not req.Test():
        if time.perf_counter() - start >= spin:
            time.sleep(nap)
            nap = min(2e-3, nap * 1.5)


def serve_mpi(comm, path: str, stop: threading.Event, counts: list[int]) -> None:
    """A server thread: pre-posted receives, pread into a buffer, Isend from it."""
    from mpi4py import MPI

    fd = os.open(path, os.O_RDONLY)
    bufs = [bytearray(REQ.size) for _ in range(8)]
    reqs = [comm.Irecv(b, MPI.ANY_SOURCE, TAG_REQ) for b in bufs]
    pending = []
    last, nap = time.perf_counter(), 20e-6
    status = MPI.Status()
    iters = [0, 0, 0.0]  # loop iterations, sleeps, pread seconds
    counts.append(iters)
    while not stop.is_set():
        iters[0] += 1
        active = False
        for i, r in enumerate(reqs):
            if r.Test(status):
                active = True
                piece, offset, length = REQ.unpack(bufs[i])
                src, tag = status.Get_source(), TAG_REP0 + piece
                out = bytearray(length)
                t_ = time.perf_counter()
                os.preadv(fd, [out], offset)
                iters[2] += time.perf_counter() - t_
                pending.append((comm.Isend(out, src, tag), out))
                counts[0] += 1
                reqs[i] = comm.Irecv(bufs[i], MPI.ANY_SOURCE, TAG_REQ)
        if pending:
            pending = [(r, b) for r, b in pending if not r.Test()]
        now = time.perf_counter()
        if active or pending:
            last, nap = now, 20e-6
            continue
        if now - last > WAIT_SPIN:
            iters[1] += 1
            time.sleep(nap)
            nap = min(2e-3, nap * 1.5)
    for r in reqs:
        r.Cancel()
    os.close(fd)


def fetch(comm, owner: int, piece: int) -> bytearray:
    out = bytearray(SIZE)
    r = comm.Irecv(out, owner, TAG_REP0 + piece)
    s = comm.Isend(REQ.pack(piece, piece * SIZE, SIZE), owner, TAG_REQ)
    poll(r)
    s.Wait()
    return out


def relay_reader(sock_path: str, pieces: list[int]) -> None:
    """A plain reader process (no MPI): one Unix socket to the node's rank."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(sock_path)
    f = s.makefile("rb")
    t0 = time.process_time()
    for p in pieces:
        s.sendall(REQ.pack(p, p * SIZE, SIZE))
        data = f.read(SIZE)
        assert len(data) == SIZE
    s.sendall(REQ.pack(-1, 0, 0))
    print(json.dumps({"cpu": time.process_time() - t0}), flush=True)


def main() -> None:
    if sys.argv[1:2] == ["--relay-reader"]:
        relay_reader(sys.argv[2], json.loads(sys.argv[3]))
        return
    import argparse

    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", choices=("relay", "direct"))
    ap.add_argument("readers", type=int)
    ap.add_argument("--save", action="store_true", help="append the row to results/")
    a = ap.parse_args()
    mode, readers = a.mode, a.readers
    import mpi4py

    mpi4py.rc.initialize = False
    from mpi4py import MPI

    MPI.Init_thread(MPI.THREAD_MULTIPLE)
    world = MPI.COMM_WORLD
    comm = world.Dup()
    rank, size = comm.Get_rank(), comm.Get_size()
    per_node = size // 2
    node = rank // per_node
    data = os.path.join(tempfile.gettempdir(), "remote_options.dat")
    if rank == 0:
        if not os.path.exists(data) or os.path.getsize(data) != FILES * SIZE:
            with open(data, "wb") as f:
                f.write(os.urandom(FILES * SIZE))
        with open(data, "rb") as f:  # warm
            while f.read(1 << 24):
                pass
    comm.Barrier()
    stop = threading.Event()
    counts = [0]
    server = None
    if node == 1:
        server = threading.Thread(target=serve_mpi, args=(comm, data, stop, counts))
        server.start()
    comm.Barrier()
    t0, c0 = time.perf_counter(), time.process_time()
    reader_cpu = 0.0
    if node == 0 and mode == "direct":
        mine = list(range(rank, FILES, per_node))
        owner = per_node + rank  # the rank of node 1 with the same local index
        for p in mine:
            fetch(comm, owner, p)
    elif node == 0 and mode == "relay":
        sock_path = os.path.join(tempfile.mkdtemp(), "relay.sock")
        srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        srv.bind(sock_path)
        srv.listen(64)

        def one(conn):
            f = conn.makefile("rb")
            while True:
                raw = f.read(REQ.size)
                piece, _, _ = REQ.unpack(raw)
                if piece < 0:
                    return
                conn.sendall(fetch(comm, per_node, piece))

        procs = [subprocess.Popen([sys.executable, __file__, "--relay-reader", sock_path,
                                   json.dumps(list(range(i, FILES, readers)))],
                                  stdout=subprocess.PIPE, text=True) for i in range(readers)]
        threads = []
        for _ in range(readers):
            conn, _ = srv.accept()
            t = threading.Thread(target=one, args=(conn,))
            t.start()
            threads.append(t)
        for t in threads:
            t.join()
        reader_cpu = sum(json.loads(p.stdout.readline())["cpu"] for p in procs)
        for p in procs:
            p.wait()
    comm.Barrier()
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    stop.set()
    if server is not None:
        server.join()
    rows = comm.gather({"rank": rank, "node": node, "cpu": cpu, "reader_cpu": reader_cpu,
                        "served": counts[0], "loop": counts[1:] }, root=0)
    if rank == 0:
        files = FILES
        out = {
            "mode": mode, "readers": readers, "ranks": size, "size": SIZE, "files": files,
            "files_per_s": round(files / wall), "wait_spin_us": WAIT_SPIN * 1e6,
            "node0_us_per_file": round(sum(r["cpu"] + r["reader_cpu"] for r in rows
                                           if r["node"] == 0) / files * 1e6, 1),
            "node1_us_per_file": round(sum(r["cpu"] for r in rows if r["node"] == 1)
                                       / files * 1e6, 1),
            "busiest_process_share": round(max(
                [r["cpu"] for r in rows] + [r["reader_cpu"] / max(1, readers)
                                            for r in rows]) / max(1e-9, sum(
                    r["cpu"] + r["reader_cpu"] for r in rows)), 3),
            "per_rank_us_per_file": [round((r["cpu"] + r["reader_cpu"]) / files * 1e6, 1)
                                     for r in rows],
        }
        print(json.dumps(out), flush=True)
        if a.save:
            res = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                               "remote_options.jsonl")
            with open(res, "a") as f:
                f.write(json.dumps(out) + "\n")
    MPI.Finalize()


if __name__ == "__main__":
    main()
