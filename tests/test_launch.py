"""How an MPI job starts and ends: one launch shape, deadlines, a launcher that dies.

Real ``mpiexec`` jobs on this machine (tests/mpi_helpers.py). Nothing is spawned: the
ranks the launcher starts are grouped into nodes by host name (``--ranks-per-node auto``)
or in blocks (``--ranks-per-node K``, how one machine simulates several nodes). Every
start-up wait has a deadline (``--start-timeout``), a node that fails tells every node why,
and a launcher that dies at any stage ends every rank with nothing left behind.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import time

import pytest

from fanstore import mounttable
from helpers import (
    FANSTORE,
    assert_no_traceback,
    fuse_available,
    is_mounted,
    pid_alive,
    run_cli,
    wait_until,
)
from mpi_helpers import MPIEXEC, MpiJob, job_pids, mpi_available

_fuse_ok, _fuse_why = fuse_available()
_mpi_ok, _mpi_why = mpi_available()
pytestmark = [
    pytest.mark.fuse,
    pytest.mark.mpi,
    pytest.mark.skipif(not (_fuse_ok and _mpi_ok), reason=_fuse_why or _mpi_why),
]


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    """60 files in 3 directories, packed into 6 partitions."""
    root = tmp_path_factory.mktemp("launch")
    src = root / "src"
    rng = random.Random(34)
    for d in range(3):
        (src / f"d{d}").mkdir(parents=True)
        for i in range(20):
            (src / f"d{d}" / f"f{i:02d}").write_bytes(rng.randbytes(rng.randint(1, 9000)))
    store = root / "store"
    run_cli("pack", src, store, "--partitions", "6", "--no-progress", check=True)
    return src, store


_fanstore_pids = job_pids


def _leftovers(job: MpiJob, nodes: int, copies_before: set[str]) -> dict:
    """What a job left behind: processes, mounts, staged data, index copies."""
    shm = _copies()
    return {
        "processes": _fanstore_pids(job.tmp),
        "mounts": [r for r in range(nodes) if is_mounted(job.mnt(r))],
        "local": [r for r in range(nodes) if job.local_dir(r).exists()],
        "copies": sorted(n for n in shm - copies_before
                         if not pid_alive(int(n.split("-")[2]))),
    }


def _copies() -> set[str]:
    """The index copies of this user in the module's index-copy directory (conftest)."""
    shm = os.environ.get("FANSTORE_SHM_DIR", "/dev/shm")
    return {n for n in os.listdir(shm) if n.startswith(f"fanstore-{os.geteuid()}-")}


def _stop_node_when_starting(job: MpiJob, node: int, timeout: float = 60) -> list[int]:
    """SIGSTOP node ``node``'s daemon (and its hydra shim) as soon as it has written its
    state (before the start-up gates); returns the pids stopped."""
    assert wait_until(lambda: job.pid(node) is not None, timeout, interval=0.01), \
        job.output()[-2000:]
    pid = job.pid(node)
    pids = [pid]
    os.kill(pid, signal.SIGSTOP)
    return pids


def test_the_ranks_of_one_host_form_one_node(dataset, tmp_path):
    """``mpiexec -n 3`` with the default ``--ranks-per-node auto`` on one machine: one node
    of three ranks (grouped by host name, nothing spawned): one mount, served
    by the two worker ranks, every file byte-exact; umount ends the job with status 0."""
    src, store = dataset
    (tmp_path / "mnt").mkdir()
    proc = subprocess.Popen([MPIEXEC, "-n", "3", FANSTORE, "mount",
                             str(store), str(tmp_path / "mnt"), "--local-dir",
                             str(tmp_path / "local")], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        res = run_cli("wait", tmp_path / "mnt", "--timeout", "90")
        assert res.returncode == 0, res.stderr
        stats = json.loads(run_cli("stats", tmp_path / "mnt", "--json", check=True).stdout)
        assert stats["ranks"] == 1 and stats["workers"] == 2
        assert stats["local_partitions"] == list(range(6))
        for path in src.rglob("*"):
            if path.is_file():
                assert (tmp_path / "mnt" / path.relative_to(src)).read_bytes() == \
                    path.read_bytes()
        assert run_cli("umount", tmp_path / "mnt", timeout=60).returncode == 0
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0, out.decode(errors="replace")[-3000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        if is_mounted(tmp_path / "mnt"):
            mounttable.fusermount_unmount(str(tmp_path / "mnt"), lazy=True)
    assert not (tmp_path / "local").exists()


def test_a_node_that_fails_before_the_gate_stops_every_node_with_its_reason(dataset, tmp_path):
    """Node 2's local directory cannot be made (a file is in the way): every node stops
    at the start gate with node 2's reason, in bounded time; the job exits non-zero; no
    traceback, no mount, process or index copy left."""
    _, store = dataset
    before = _copies()
    (tmp_path / "local2").write_bytes(b"in the way")
    job = MpiJob(store, tmp_path, ranks=4, wait=False)
    t0 = time.monotonic()
    job.start()
    try:
        assert job.wait_exit(60) not in (0, None), job.output()[-3000:]
        assert time.monotonic() - t0 < 60
        out = job.output()
        # (the four ranks write to one log: their lines may interleave)
        assert out.count("cannot use local storage") == 4, out[-3000:]
        assert out.count("not starting: node 2 (") == 3, out[-3000:]
        assert "Traceback" not in out
        (tmp_path / "local2").unlink()
        assert wait_until(lambda: not any(_leftovers(job, 4, before).values()), 30), \
            _leftovers(job, 4, before)
    finally:
        job.stop()


def test_a_node_that_does_not_arrive_is_named_within_the_start_timeout(dataset, tmp_path):
    """Node 2 hangs before the start-up gates (SIGSTOP): the other nodes give up after
    ``--start-timeout`` with one line naming node 2; once node 2 resumes it ends too (its
    peers are gone); nothing is left."""
    _, store = dataset
    before = _copies()
    job = MpiJob(store, tmp_path, ranks=3, wait=False, extra=["--start-timeout", "4"])
    job.start()
    stopped = []
    try:
        stopped = _stop_node_when_starting(job, 2)
        t0 = time.monotonic()
        named = lambda: job.output().count("node 2 did not reach the") >= 2  # noqa: E731
        assert wait_until(named, 60), job.output()[-3000:]
        assert time.monotonic() - t0 < 4 + 30
        assert "within 4 s (--start-timeout)" in job.output()
        for p in stopped:
            os.kill(p, signal.SIGCONT)
        assert job.wait_exit(90) not in (0, None), job.output()[-3000:]
        assert "Traceback" not in job.output()
        assert wait_until(lambda: not any(_leftovers(job, 3, before).values()), 30), \
            _leftovers(job, 3, before)
    finally:
        for p in stopped:
            if pid_alive(p):
                os.kill(p, signal.SIGCONT)
        job.stop()


def test_a_launcher_killed_mid_start_leaves_nothing(dataset, tmp_path):
    """SIGKILL of ``mpiexec`` while the nodes wait in a start-up gate (node 2 is held
    stopped, the start timeout is long): every daemon and worker rank ends within 30 s of
    the kill (node 2 once it resumes), with no mount, staged data or index copy left."""
    _, store = dataset
    before = _copies()
    job = MpiJob(store, tmp_path, ranks=3, wait=False, ranks_per_node=2,
                 extra=["--start-timeout", "600"])
    job.start()
    stopped = []
    try:
        stopped = _stop_node_when_starting(job, 2)
        assert wait_until(lambda: job.pid(0) and job.pid(1), 60), job.output()[-2000:]
        time.sleep(1.0)  # nodes 0 and 1 are waiting in a gate for node 2
        assert len(_fanstore_pids(tmp_path)) >= 6
        os.kill(job.proc.pid, signal.SIGKILL)
        t0 = time.monotonic()
        for p in stopped:
            os.kill(p, signal.SIGCONT)
        assert wait_until(lambda: not _fanstore_pids(tmp_path), 40), \
            (_fanstore_pids(tmp_path), job.output()[-3000:])
        assert time.monotonic() - t0 < 40
        assert not any(_leftovers(job, 3, before).values()), _leftovers(job, 3, before)
    finally:
        for p in stopped:
            if pid_alive(p):
                os.kill(p, signal.SIGCONT)
        job.stop()


def test_start_timeout_is_checked_at_the_command_line(tmp_path):
    res = run_cli("mount", tmp_path, tmp_path / "m", "--start-timeout", "0")
    assert res.returncode == 2
    assert "--start-timeout" in res.stderr
    assert_no_traceback(res)


def test_a_daemon_killed_mid_start_ends_the_job(dataset, tmp_path):
    """SIGKILL of node 1's daemon while the nodes wait for node 2 in a start-up gate (the
    start timeout is long): the other nodes give up at once (hydra reports the dead
    process, or its launcher ends) instead of waiting out the timeout; every process ends
    and no mount or index copy is left (node 1's staged files are its to clean: the
    template's clean-up step removes them)."""
    _, store = dataset
    before = _copies()
    job = MpiJob(store, tmp_path, ranks=3, wait=False, extra=["--start-timeout", "600"])
    job.start()
    stopped = []
    try:
        stopped = _stop_node_when_starting(job, 2)
        assert wait_until(lambda: job.pid(0) and job.pid(1), 60), job.output()[-2000:]
        time.sleep(1.0)  # nodes 0 and 1 wait in a gate for node 2
        os.kill(job.pid(1), signal.SIGKILL)
        t0 = time.monotonic()
        for p in stopped:
            os.kill(p, signal.SIGCONT)
        assert wait_until(lambda: not _fanstore_pids(tmp_path), 40), \
            (_fanstore_pids(tmp_path), job.output()[-3000:])
        assert time.monotonic() - t0 < 40
        assert job.wait_exit(10) not in (0, None)
        left = _leftovers(job, 3, before)
        assert not left["mounts"] and not left["copies"], left
        assert "Traceback" not in job.output()
    finally:
        for p in stopped:
            if pid_alive(p):
                os.kill(p, signal.SIGCONT)
        job.stop()
