"""One global namespace across ranks: real ``mpiexec -n 4`` jobs on this machine.

Each rank gets its own mount point and node-local directory; every test tears its job
down (tests/mpi_helpers.py) even when it fails.
"""

from __future__ import annotations

import errno
import os
import random
import signal
import time
from pathlib import Path

import pytest

from fanstore.daemon import placement as pl
from fanstore.daemon import protocol as P
from fanstore.format.index import read_index
from helpers import assert_no_traceback, fuse_available, is_mounted, pid_alive, run_cli, wait_until
from mpi_helpers import (
    MpiJob,
    cpu_seconds,
    mpi_available,
    read_tree_bytes,
    wait_gone,
)

#: The tests here are about ranks, staging and node failures: they run on the default FUSE
#: frontend. The remote reads themselves and a dead rank's EIO run on both (conftest.frontend):
#: the kernel frontend's workers fetch through the daemon, pyfuse3 reads in it.
pytestmark = pytest.mark.usefixtures("frontend")
FUSE_FRONTENDS = ("kernel",)
both_frontends = pytest.mark.frontends("kernel", "pyfuse3")

_fuse_ok, _fuse_why = fuse_available()
_mpi_ok, _mpi_why = mpi_available()
needs_cluster = [
    pytest.mark.fuse,
    pytest.mark.mpi,
    pytest.mark.skipif(not _fuse_ok, reason=_fuse_why),
    pytest.mark.skipif(not _mpi_ok, reason=_mpi_why),
]


# --------------------------------------------------------------------------- data


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    """~240 files in 12 directories, an empty file and dir, a symlink, multi-chunk files;
    packed into 8 partitions with 64 KiB chunks."""
    root = tmp_path_factory.mktemp("mpi")
    src = root / "src"
    rng = random.Random(7)
    for d in range(12):
        sub = src / f"class{d:02d}"
        sub.mkdir(parents=True)
        for i in range(20):
            n = rng.randint(1, 60_000)
            kind = i % 3
            if kind == 0:
                data = rng.randbytes(n)
            elif kind == 1:
                data = (f"row {i} " * (n // 6 + 1)).encode()[:n]
            else:
                data = bytes(rng.choice(b"ACGT") for _ in range(n))
            (sub / f"f{i:03d}.dat").write_bytes(data)
    (src / "big").mkdir()
    (src / "big" / "multi.bin").write_bytes(rng.randbytes(300_000))  # 5 chunks of 64 KiB
    (src / "empty.txt").write_bytes(b"")
    (src / "emptydir").mkdir()
    os.symlink("class00/f000.dat", src / "link")
    store = root / "store"
    run_cli("pack", src, store, "--partitions", "8", "--chunk-kb", "64", "--no-progress",
            check=True)
    return src, store


def stored_by_partition(store: Path) -> dict[int, int]:
    index = read_index(str(store))
    return {p.number: p.size for p in index.partitions}


def remote_stored_bytes(store: Path, local_parts: set[int]) -> int:
    """Sum of stored (compressed) bytes of every chunk of a file not held by
    ``local_parts``, each chunk once (files in one solid chunk, or stored once as
    duplicates, share it: one fetch brings it for all of them)."""
    index = read_index(str(store))
    remote: set[int] = set()
    for entry in index.file_entries().tolist():
        first, count = index.chunk_run(entry)
        if count and int(index.chunks["part"][first]) not in local_parts:
            remote.update(range(first, first + count))
    return sum(int(index.chunks["stored"][c]) for c in remote)


# --------------------------------------------------------------------------- pure parts


def test_placement_is_round_robin_with_consecutive_replicas():
    assert pl.owners(5, 4) == [1]
    assert pl.owners(3, 4, replicas=2) == [3, 0]
    assert pl.owners(2, 4, replicas=9) == [2, 3, 0, 1]  # clamped to the ranks there are
    assert pl.owners(7, 4, broadcast=True) == [0, 1, 2, 3]
    table = pl.placement([False] * 8 + [True], 4, replicas=2)
    for rank in range(4):
        mine = pl.local_partitions(table, rank)
        assert 8 in mine  # the broadcast partition is everywhere
        assert len(mine) == 5  # 8 partitions x 2 copies / 4 ranks + broadcast
    # A reader tries the nearest owner round the ring first.
    assert pl.preference([3, 0], rank=1, n_ranks=4) == [3, 0]
    assert pl.preference([3, 0], rank=0, n_ranks=4) == [0, 3]


def test_protocol_round_trip_and_rejects_garbage():
    req = P.Request(P.Op.READ, 3, 1234, 64, 4096, 77)
    assert P.decode_request(P.encode_request(req)) == req
    hdr = P.encode_response_header(P.Status.OK, 3, 77)
    assert P.decode_response_header(hdr + b"abc") == P.Response(P.Status.OK, 3, 77)
    msg = P.decode_control(P.encode_control(P.Control.SHUTDOWN, 2, "time limit"))
    assert (msg.kind, msg.rank, msg.reason) == (P.Control.SHUTDOWN, 2, "time limit")
    bad = [b"", b"x" * P.REQ.size, P.encode_request(req)[:-1],
           P.encode_request(P.Request(9, 0, 1234, 0, 1, 1)),
           P.encode_request(P.Request(P.Op.READ, 0, 5, 0, 1, 1)),  # reserved reply tag
           P.encode_request(P.Request(P.Op.READ, 0, 1234, 0, P.MAX_REQUEST + 1, 1))]
    for raw in bad:
        with pytest.raises(P.ProtocolError):
            P.decode_request(raw)
    with pytest.raises(P.ProtocolError):
        P.decode_response_header(hdr + b"ab")  # says 3 bytes, carries 2
    with pytest.raises(P.ProtocolError):
        P.decode_control(P.encode_control(P.Control.DONE, 1, "x")[:-1])
    # A reply in pieces: the header and the first piece - 24 bytes, then whole pieces.
    req = P.Request(P.Op.READ, 3, 1234, 64, 100_000, 77, piece=8000)
    assert P.decode_request(P.encode_request(req)) == req
    spans = P.pieces(100_000, 8000)
    assert spans[0] == (0, 8000) and spans[-1][1] == P.RESP.size + 100_000
    assert all(b - a <= 8000 for a, b in spans) and len(spans) == 13
    assert P.pieces(100, 8000) == [(0, P.RESP.size + 100)]  # fits in one message
    assert P.pieces(100_000, 0) == [(0, P.RESP.size + 100_000)]
    big = P.encode_response_header(P.Status.OK, 100_000, 77) + bytes(8000 - P.RESP.size)
    assert P.decode_response_header(big, 8000).length == 100_000
    with pytest.raises(P.ProtocolError):
        P.decode_response_header(big[:-1], 8000)  # a first piece one byte short
    with pytest.raises(P.ProtocolError):
        P.decode_request(P.encode_request(P.Request(P.Op.READ, 0, 1234, 0, 1, 1, piece=10)))


# --------------------------------------------------------------------------- jobs


@pytest.fixture(scope="module")
def job4(frontend, dataset, tmp_path_factory):
    """One healthy 4-rank job shared by the read-only tests of this module."""
    if not (_fuse_ok and _mpi_ok):
        pytest.skip(_fuse_why or _mpi_why)
    _src, store = dataset
    with MpiJob(store, tmp_path_factory.mktemp("job4"), ranks=4) as job:
        yield job


@both_frontends
class TestFourRanks:
    pytestmark = needs_cluster

    def test_every_file_is_byte_exact_on_every_rank(self, dataset, job4):
        from helpers import assert_same_tree

        src, _ = dataset
        for rank in range(4):
            assert_same_tree(src, job4.mnt(rank))

    def test_each_rank_stages_about_a_quarter(self, dataset, job4):
        _, store = dataset
        sizes = stored_by_partition(store)
        total = sum(sizes.values())
        for rank in range(4):
            local = job4.local_dir(rank)
            staged = sorted(p.name for p in local.iterdir() if p.name.endswith(".fsp"))
            expected = [f"part-{p:05d}.fsp" for p in range(8) if p % 4 == rank]
            assert staged == expected
            held = sum(p.stat().st_size for p in local.iterdir() if p.name.endswith(".fsp"))
            assert 0.1 * total < held < 0.45 * total, (rank, held, total)

    def test_rank0_reads_remote_files_compressed(self, dataset, job4, frontend):
        """After the whole tree is read on rank 0 (by the byte-exact test or here), its
        remote bytes are exactly the stored sizes of the files held elsewhere. (With the
        kernel frontend each worker process has its own chunk cache: two workers that serve
        READs of the same chunk at once, e.g. a read and the kernel's read-ahead, both
        fetch it; and when the page cache is emptied between the two passes, by memory
        pressure or another job's drop_caches, the second pass asks again. So the bytes
        are at least the stored sizes, and at most one fetch per worker and pass.)"""
        src, store = dataset
        ok, wrong, errors = read_tree_bytes(src, job4.mnt(0))
        assert not wrong and not errors and ok > 200
        stats = job4.stats(0)
        mine = set(stats["local_partitions"])
        assert mine == {0, 4}
        assert stats["remote_reads"] > 0 and stats["local_reads"] > 0
        expected = remote_stored_bytes(store, mine)
        if frontend == "pyfuse3":
            assert stats["remote_bytes"] == expected
        else:
            passes = 2  # the byte-exact test's and this one's
            assert expected <= stats["remote_bytes"] <= passes * stats["workers"] * expected
        assert stats["errors"] == 0
        for key in ("opens", "reads", "bytes_returned", "cache_hits", "cache_misses",
                    "decode_seconds", "remote_latency_ms_p50", "remote_latency_ms_p99"):
            assert key in stats
        human = run_cli("stats", job4.mnt(0), check=True).stdout
        assert "remote_reads" in human and "local_reads" in human

    def test_idle_daemons_use_under_five_percent_of_a_core(self, job4):
        pids = [job4.pid(r) for r in range(4)]
        before = [cpu_seconds(p) for p in pids]
        t0 = time.monotonic()
        time.sleep(3)
        elapsed = time.monotonic() - t0
        for pid, b in zip(pids, before):
            share = (cpu_seconds(pid) - b) / elapsed
            assert share < 0.05, f"daemon {pid} used {share:.1%} of a core while idle"

    def test_writes_are_refused_on_every_rank(self, job4):
        for rank in range(4):
            with pytest.raises(OSError) as exc:
                open(job4.mnt(rank) / "new.txt", "wb")
            assert exc.value.errno == errno.EROFS



@pytest.mark.fuse
@pytest.mark.mpi
@pytest.mark.skipif(not (_fuse_ok and _mpi_ok), reason=_fuse_why or _mpi_why)
def test_sigterm_to_one_daemon_unmounts_every_rank(dataset, tmp_path):
    _, store = dataset
    with MpiJob(store, tmp_path, ranks=4) as job:
        pids = [job.pid(r) for r in range(4)]
        os.kill(pids[2], signal.SIGTERM)  # what Slurm sends at the time limit
        code = job.wait_exit(60)
        assert code == 0, job.output()
        assert not any(is_mounted(job.mnt(r)) for r in range(4))
        assert not any(pid_alive(p) for p in pids)
        # Local dirs created by FanStore are removed on exit (no --keep-local).
        assert not any(job.local_dir(r).exists() for r in range(4))


@pytest.mark.fuse
@pytest.mark.mpi
@pytest.mark.skipif(not (_fuse_ok and _mpi_ok), reason=_fuse_why or _mpi_why)
def test_replicas_survive_a_killed_daemon(dataset, tmp_path):
    src, store = dataset
    with MpiJob(store, tmp_path, ranks=4,
                extra=["--replicas", "2", "--remote-timeout", "2"]) as job:
        victims = job.kill_node(2)  # the daemon and the node's worker ranks
        assert wait_until(lambda: not any(pid_alive(p) for p in victims), 10)
        for rank in (0, 1, 3):
            ok, wrong, errors = read_tree_bytes(src, job.mnt(rank))
            assert (wrong, errors) == ([], []), job.output()
            assert ok == 242
        # the survivors noticed: the dead node's ranks were marked dead and its files
        # read from the replicas (by the daemon's own reader or its worker ranks)
        seen = [job.stats(r) for r in (0, 1)]
        assert any(2 in s["dead_ranks"] or s["remote_failovers"] > 0 for s in seen), seen
        # Stopping the survivors still works and leaves no mount of theirs behind.
        os.kill(job.pid(0), signal.SIGTERM)
        assert wait_gone([job.mnt(r) for r in (0, 1, 3)], 60), job.output()
        # ... and the survivors end soon after (2 s of drain for the dead node): their
        # worker ranks got the exit message at once instead of when a 15 s wait ran out
        t = time.monotonic()
        survivors = [job._pids[r] for r in (0, 1, 3)]
        assert wait_until(lambda: not any(pid_alive(p) for p in survivors), 60)
        assert time.monotonic() - t < 10, (time.monotonic() - t, job.output()[-3000:])
        # The dead rank's frontend unmounted when its daemon died (issue 44): no stale mount.
        assert wait_gone([job.mnt(2)], 10)


@pytest.mark.fuse
@pytest.mark.mpi
@pytest.mark.skipif(not (_fuse_ok and _mpi_ok), reason=_fuse_why or _mpi_why)
@both_frontends
def test_without_replicas_a_dead_ranks_files_fail_and_the_job_ends(dataset, tmp_path):
    """Rank 3's partitions have no other holder: its files fail (EIO; or the job's end
    cuts the read: the mount goes), never hang, other files read right while the mount
    lasts, and the job ends on every node by itself, naming node 3 (issue 44)."""
    src, store = dataset
    timeout = 2.0
    with MpiJob(store, tmp_path, ranks=4, extra=["--remote-timeout", str(timeout)]) as job:
        victims = job.kill_node(3)
        assert wait_until(lambda: not any(pid_alive(p) for p in victims), 10)
        index = read_index(str(store))
        dead_parts = {3, 7}
        slowest = 0.0
        failed = []
        for entry in index.file_entries().tolist():
            rel = os.fsdecode(index.path(entry))
            first, count = index.chunk_run(entry)
            path = job.mnt(0) / rel
            t = time.monotonic()
            try:
                got = path.read_bytes()
            except OSError as exc:
                failed.append(exc.errno)
                if exc.errno != errno.EIO:
                    break  # the job ended: the mount is going or gone
                assert count and int(index.chunks["part"][first]) in dead_parts, rel
            else:
                assert got == (src / rel).read_bytes()
            slowest = max(slowest, time.monotonic() - t)
        assert failed, "no read failed"
        assert set(failed) <= {errno.EIO, errno.ENOENT, errno.ENOTCONN, errno.ECONNABORTED}
        assert slowest < timeout + 5, f"a read took {slowest:.1f} s"
        assert job.wait_exit(30) not in (None, 0), job.output()[-3000:]
        assert "node 3 died (no answer to pings)" in job.output()
        # (the dead node's own mount: gone with the kernel frontend, stale with pyfuse3,
        # which serves from the killed daemon's process; the next mount sweeps it)
        assert wait_gone([job.mnt(r) for r in (0, 1, 2)], 30)


@pytest.mark.fuse
@pytest.mark.mpi
@pytest.mark.skipif(not (_fuse_ok and _mpi_ok), reason=_fuse_why or _mpi_why)
def test_umount_one_node_keeps_serving_the_others(dataset, tmp_path):
    src, store = dataset
    with MpiJob(store, tmp_path, ranks=4) as job:
        res = run_cli("umount", job.mnt(1), timeout=60)
        assert res.returncode == 0, res.stderr
        assert not is_mounted(job.mnt(1))
        assert all(is_mounted(job.mnt(r)) for r in (0, 2, 3))
        # Rank 1 has unmounted but still serves its partitions to the others.
        ok, wrong, errors = read_tree_bytes(src, job.mnt(0))
        assert (ok, wrong, errors) == (242, [], [])
        for rank in (0, 2, 3):
            assert run_cli("umount", job.mnt(rank), timeout=60).returncode == 0
        assert job.wait_exit(60) == 0, job.output()
        assert not any(is_mounted(job.mnt(r)) for r in range(4))


@pytest.mark.fuse
@pytest.mark.mpi
@pytest.mark.skipif(not (_fuse_ok and _mpi_ok), reason=_fuse_why or _mpi_why)
def test_restart_reuses_staged_partitions(dataset, tmp_path):
    src, store = dataset
    extra = ["--keep-local"]
    with MpiJob(store, tmp_path, ranks=2, extra=extra, keep_local=True) as job:
        first = job.stats(0)
        assert first["staged_partitions"] == 4 and first["staged_bytes"] > 0
    assert (tmp_path / "local0" / "part-00000.fsp").exists()  # kept
    with MpiJob(store, tmp_path, ranks=2, extra=extra) as job:
        again = job.stats(0)
        assert again["staged_partitions"] == 0 and again["staged_bytes"] == 0
        assert again["reused_partitions"] == 4
        ok, wrong, errors = read_tree_bytes(src, job.mnt(1))
        assert (ok, wrong, errors) == (242, [], [])


@pytest.mark.mpi
@pytest.mark.skipif(not _mpi_ok, reason=_mpi_why)
def test_a_bad_store_fails_every_rank_cleanly(tmp_path):
    (tmp_path / "notastore").mkdir()
    job = MpiJob(tmp_path / "notastore", tmp_path, ranks=2, wait=False)
    job.start()
    try:
        assert job.wait_exit(60) not in (0, None)
        out = job.output()
        assert out.count("not a FanStore store") >= 2, out
        assert "Traceback" not in out
        assert not any(is_mounted(job.mnt(r)) for r in range(2))
    finally:
        job.stop()


@pytest.mark.mpi
@pytest.mark.skipif(not _mpi_ok, reason=_mpi_why)
def test_srun_without_mpi_plugin_is_refused(dataset, tmp_path):
    """Under srun, a world size different from the task count (e.g. --mpi=none gives every
    task a 1-rank world) must fail loudly, not serve a fraction of the data."""
    _, store = dataset
    (tmp_path / "m").mkdir()
    env = {"SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "2", "SLURM_NTASKS": "2",
           "SLURM_JOB_ID": "1"}
    res = run_cli("mount", store, tmp_path / "m", env=env, timeout=60)
    assert res.returncode != 0
    assert "MPI world size is 1 but Slurm started 2 tasks" in res.stderr
    assert "--mpi=pmi2" in res.stderr
    assert_no_traceback(res)
    assert not is_mounted(tmp_path / "m")



@pytest.mark.fuse
@pytest.mark.mpi
@pytest.mark.skipif(not (_fuse_ok and _mpi_ok), reason=_fuse_why or _mpi_why)
def test_a_hung_node_gives_eio_within_the_timeout_and_serves_again_when_it_resumes(
        dataset, tmp_path):
    """SIGSTOP of every process of a node (a hung node): reads of its files fail with EIO
    within the remote timeout, every other file reads right; after SIGCONT its files read
    right again (the unreachable ranks are probed and revived). Each process that marked
    them (the daemon, every worker rank) probes on its own every PROBE_INTERVAL, so the
    whole tree reads right within about one interval, not at the first file that does."""
    src, store = dataset
    timeout = 2.0
    with MpiJob(store, tmp_path, ranks=4, extra=["--remote-timeout", str(timeout)]) as job:
        index = read_index(str(store))
        hung_parts = {3, 7}
        victims = job.kill_node(3, signal.SIGSTOP)
        try:
            slowest, eio, ok = 0.0, 0, 0
            for entry in index.file_entries().tolist():
                rel = os.fsdecode(index.path(entry))
                first, count = index.chunk_run(entry)
                path = job.mnt(0) / rel
                t = time.monotonic()
                if count and int(index.chunks["part"][first]) in hung_parts:
                    if eio >= 6:
                        continue  # enough: each costs a timeout until the ranks are marked
                    with pytest.raises(OSError) as exc:
                        path.read_bytes()
                    assert exc.value.errno == errno.EIO
                    eio += 1
                else:
                    assert path.read_bytes() == (src / rel).read_bytes()
                    ok += 1
                slowest = max(slowest, time.monotonic() - t)
            assert eio == 6 and ok > 150
            assert slowest < timeout + 5, f"a read took {slowest:.1f} s"
        finally:
            for p in victims:
                os.kill(p, signal.SIGCONT)
        # resumed: after the probe interval the node's files read again
        passes = []

        def all_readable() -> bool:
            passes.append(read_tree_bytes(src, job.mnt(0)))
            return passes[-1] == (242, [], [])

        assert wait_until(all_readable, 60, interval=1.0), (passes[-1], job.output()[-3000:])


@pytest.mark.fuse
@pytest.mark.mpi
@pytest.mark.skipif(not (_fuse_ok and _mpi_ok), reason=_fuse_why or _mpi_why)
def test_launched_worker_ranks_form_nodes(dataset, tmp_path, frontend):
    """``mpiexec -n 6 ... --ranks-per-node 3``: two nodes of three ranks (srun
    --ntasks-per-node's shape on one machine). With the kernel frontend the ranks after a
    node's first serve its mount and its remote reads; every file reads right on both
    mounts, remote reads go through the worker ranks, and umount ends the job cleanly. The
    pyfuse3 frontend serves a node's mount from the node's first rank; its worker ranks
    answer the other node's reads (the daemons serve none)."""
    src, store = dataset
    job = MpiJob(store, tmp_path, ranks=2, ranks_per_node=3)
    with job:
        for node in range(2):
            ok, wrong, errors = read_tree_bytes(src, job.mnt(node))
            assert (ok, wrong, errors) == (242, [], [])
        s0, s1 = job.stats(0), job.stats(1)
        assert s0["remote_reads"] > 0 and s1["remote_reads"] > 0
        if frontend == "kernel":
            assert s0["workers"] == 2
            assert s0["worker_served_requests"] + s1["worker_served_requests"] > 0
        else:  # every remote read was answered by a worker rank of the holder node
            assert s0["served_requests"] == 0 and s1["served_requests"] == 0
        assert len(job.node_pids(0)) == 3
        for node in range(2):
            assert run_cli("umount", job.mnt(node), timeout=60).returncode == 0
        assert job.wait_exit(60) == 0, job.output()[-3000:]
