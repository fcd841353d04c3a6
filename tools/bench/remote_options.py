#!/usr/bin/env python3
"""Design options for remote reads, measured before building one (issue "Remote reads at
local speed"; results in docs/architecture.md, "Remote reads: the options measured").

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


class Engine:
    """One thread per process makes every MPI call: it answers node requests (pread +
    Isend) and completes this process's own fetches, whose callers block on an Event (a
    futex: no polling in the reader). One poll loop per process instead of two."""

    def __init__(self, comm, path: str | None, counts: list[int]) -> None:
        import queue

        from mpi4py import MPI

        self.MPI, self.comm, self.counts = MPI, comm, counts
        self.fd = os.open(path, os.O_RDONLY) if path else -1
        self.submit: "queue.SimpleQueue" = queue.SimpleQueue()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def fetch(self, owner: int, piece: int) -> bytearray:
        done = threading.Event()
        item = [owner, piece, bytearray(SIZE), done]
        self.submit.put(item)
        done.wait()
        return item[2]

    def run(self) -> None:
        MPI, comm = self.MPI, self.comm
        serving = self.fd >= 0
        bufs = [bytearray(REQ.size) for _ in range(8)] if serving else []
        reqs = [comm.Irecv(b, MPI.ANY_SOURCE, TAG_REQ) for b in bufs]
        sends: list = []
        waits: list = []  # (recv request, item)
        last, nap = time.perf_counter(), 20e-6
        statuses = [MPI.Status() for _ in bufs]
        while not self.stop.is_set():
            active = False
            while True:
                try:
                    item = self.submit.get_nowait()
                except Exception:
                    break
                owner, piece, out, _ = item
                r = comm.Irecv(out, owner, TAG_REP0 + piece)
                sends.append((comm.Isend(REQ.pack(piece, piece * SIZE, SIZE), owner,
                                         TAG_REQ), None))
                waits.append((r, item))
                active = True
            if reqs:
                done = MPI.Request.Testsome(reqs, statuses)
                for k, i in enumerate(done or ()):
                    active = True
                    piece, offset, length = REQ.unpack(bufs[i])
                    out = bytearray(length)
                    os.preadv(self.fd, [out], offset)
                    sends.append((comm.Isend(out, statuses[k].Get_source(),
                                             TAG_REP0 + piece), out))
                    self.counts[0] += 1
                    reqs[i] = comm.Irecv(bufs[i], MPI.ANY_SOURCE, TAG_REQ)
            if waits:
                keep = []
                for r, item in waits:
                    if r.Test():
                        item[3].set()
                        active = True
                    else:
                        keep.append((r, item))
                waits = keep
            if sends:
                sends = [(r, b) for r, b in sends if not r.Test()]
            now = time.perf_counter()
            if active or sends or waits and now - last < WAIT_SPIN:
                if active:
                    last, nap = now, 20e-6
                continue
            if now - last > WAIT_SPIN:
                time.sleep(nap)
                nap = min(2e-3, nap * 1.5)
        for r in reqs:
            r.Cancel()


def rma_progress(comm, stop: threading.Event) -> None:
    """What an RMA target still needs with this MPICH: a thread that enters MPI (a Test of
    a receive that never comes) so that passive-target Gets make progress; the same
    spin-then-sleep as the servers."""
    from mpi4py import MPI

    r = comm.Irecv(bytearray(8), MPI.ANY_SOURCE, 999)
    served0 = 0
    last, nap = time.perf_counter(), 20e-6
    while not stop.is_set():
        r.Test()
        now = time.perf_counter()
        if now - last > WAIT_SPIN:
            time.sleep(nap)
            nap = min(2e-3, nap * 1.5)
    r.Cancel()
    del served0


def fetch(comm, owner: int, piece: int) -> bytearray:
    from mpi4py import MPI

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
    if sys.argv[1] == "--relay-reader":
        relay_reader(sys.argv[2], json.loads(sys.argv[3]))
        return
    mode, readers = sys.argv[1], int(sys.argv[2])
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
    if os.environ.get("TIMERSLACK"):
        import ctypes

        ctypes.CDLL(None).prctl(29, int(os.environ["TIMERSLACK"]), 0, 0, 0)
    engine = None
    win = None
    if mode == "rma":
        import mmap

        from mpi4py import MPI

        if node == 1:
            f = open(data, "rb")
            mm = mmap.mmap(f.fileno(), 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
            win = MPI.Win.Create(memoryview(mm).cast("B"), 1, comm=comm)
            server = threading.Thread(target=rma_progress, args=(comm, stop))
            server.start()
        else:
            win = MPI.Win.Create(None, 1, comm=comm)
        comm.Barrier()
    elif mode == "engine":
        engine = Engine(comm, data if node == 1 else None, counts)
    elif node == 1:
        server = threading.Thread(target=serve_mpi, args=(comm, data, stop, counts))
        server.start()
    comm.Barrier()
    t0, c0 = time.perf_counter(), time.process_time()
    reader_cpu = 0.0
    if node == 0 and mode == "rma":
        from mpi4py import MPI

        owner = per_node + rank
        win.Lock(owner, MPI.LOCK_SHARED)
        for p in range(rank, FILES, per_node):
            out = bytearray(SIZE)
            r = win.Rget(out, owner, target=(p * SIZE, SIZE, MPI.BYTE))
            poll(r)
        win.Unlock(owner)
    elif node == 0 and mode == "engine":
        for p in range(rank, FILES, per_node):
            engine.fetch(per_node + rank, p)
    elif node == 0 and mode == "direct":
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
    if win is not None:
        comm.Barrier()
    stop.set()
    if server is not None:
        server.join()
    if win is not None:
        win.Free()
    if engine is not None:
        engine.stop.set()
        engine.thread.join()
    rows = comm.gather({"rank": rank, "node": node, "cpu": cpu, "reader_cpu": reader_cpu,
                        "served": counts[0], "loop": counts[1:] }, root=0)
    if rank == 0:
        print([r["loop"] for r in rows], flush=True)
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
        if "--save" in sys.argv:
            res = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                               "remote_options.jsonl")
            with open(res, "a") as f:
                f.write(json.dumps(out) + "\n")
    MPI.Finalize()


if __name__ == "__main__":
    main()
