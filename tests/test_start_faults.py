"""Faults at a mount's start: a launcher killed in each phase, a process that hangs, a
daemon killed after staging. Each asserts the end state: a clear error naming what did
not arrive, and no process, mount, runtime directory, index copy or staged data left.

Real ``mpiexec`` jobs and FUSE mounts. The phases are reached without racing the clock:
``tests/inject/sitecustomize.py`` holds one process for good at a given place
(``FANSTORE_TEST_START_HOLD``), as a hung process would, and marks where each rank got
to; the test acts once the marks say every other rank is where it must be. Each job's
processes are found by a tag in their environment (the kernel frontend's command line
names no path of the test).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import time

import pytest

from fanstore.daemon import stageowner
from fanstore.format.partition import partition_name
from helpers import (
    TESTS_DIR,
    assert_cli_error,
    daemon_log,
    daemon_pid,
    find_processes,
    fuse_available,
    is_mounted,
    kill_pid,
    lazy_unmount,
    pid_alive,
    run_cli,
    wait_until,
)
from mpi_helpers import MpiJob, mpi_available

_fuse_ok, _fuse_why = fuse_available()
_mpi_ok, _mpi_why = mpi_available()
pytestmark = [pytest.mark.fuse,
              pytest.mark.skipif(not _fuse_ok, reason=_fuse_why)]
mpi_only = pytest.mark.skipif(not _mpi_ok, reason=_mpi_why)

INJECT = os.path.join(TESTS_DIR, "inject")
TAG = "FANSTORE_TEST_JOB_TAG"
#: the issue's bound: nothing left this many seconds after the fault
GONE_WITHIN = 30.0


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    """Two stores of 48 files: 8 partitions and 2."""
    root = tmp_path_factory.mktemp("startfaults")
    src = root / "src"
    rng = random.Random(42)
    for i in range(48):
        (src / f"d{i % 4}").mkdir(parents=True, exist_ok=True)
        (src / f"d{i % 4}" / f"f{i:02d}").write_bytes(rng.randbytes(rng.randint(1, 20_000)))
    out = {}
    for parts in (8, 2):
        out[parts] = root / f"store{parts}"
        run_cli("pack", src, out[parts], "--partitions", str(parts), "--no-progress",
                check=True)
    return src, out


def _env(tmp_path, hold: str = "") -> dict:
    env = {TAG: str(tmp_path), "PYTHONPATH": os.pathsep.join(
        p for p in (INJECT, os.environ.get("PYTHONPATH")) if p),
        "FANSTORE_TEST_FAULT_MARK": str(tmp_path / "mark")}
    if hold:
        env["FANSTORE_TEST_START_HOLD"] = hold
    return env


def tagged(tmp_path) -> list[int]:
    """Live processes whose environment carries this test's tag."""
    needle = f"{TAG}={tmp_path}\0".encode()
    return find_processes(lambda p: needle in p.environ)


def _marks(tmp_path, what: str) -> set[int]:
    return {int(p.name.rsplit(".", 1)[1]) for p in tmp_path.glob(f"mark.{what}.*")}


def _left(job: MpiJob, tmp_path) -> dict:
    """What of the job is still there (the module's own index-copy directory)."""
    shm = os.environ.get("FANSTORE_SHM_DIR", "/dev/shm")
    return {"processes": tagged(tmp_path), "runtime_dirs": _runtime_dirs(tmp_path),
            "mounts": [r for r in range(job.ranks) if is_mounted(job.mnt(r))],
            "local": [r for r in range(job.ranks) if job.local_dir(r).exists()],
            "copies": [n for n in os.listdir(shm) if n.startswith(f"fanstore-{os.geteuid()}-")
                       and not pid_alive(int(n.split("-")[2]))]}


def _runtime_dirs(tmp_path) -> list[str]:
    """The module's runtime directories whose mount is under ``tmp_path``."""
    root = os.environ.get("FANSTORE_RUNTIME_DIR")
    found = []
    for name in os.listdir(root) if root and os.path.isdir(root) else []:
        try:
            with open(os.path.join(root, name, "state.json")) as f:
                state = json.load(f)
        except (OSError, ValueError):
            continue
        if str(state.get("mountpoint", "")).startswith(str(tmp_path)):
            found.append(name)
    return found


def _kill_all(tmp_path) -> None:
    for pid in tagged(tmp_path):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


#: phase -> (the process held, what the test waits for before it kills the launcher)
PHASES = {
    # rank 3 never calls MPI_Init: the others are inside it (MPI_Init holds the
    # interpreter: no thread of theirs runs; before issue 42 they spun there until their
    # 300 s start-up alarm)
    "before MPI_Init": "before-mpi-init:3",
    # rank 3 stops after MPI_Init: the others wait in the layout's first collective
    "in a collective": "after-mpi-init:3",
    # worker rank 3 never joins node 1's kernel frontend: node 1's daemon waits for its
    # frontend (before issue 42 it waited there until its lifeline ended it, 15 s later,
    # leaving its runtime directory)
    "frontend start": "join:3",
    # every rank serves
    "while serving": "",
}


@pytest.mark.mpi
@mpi_only
@pytest.mark.parametrize("phase", list(PHASES))
def test_a_launcher_killed_in_each_start_phase_leaves_nothing(stores, tmp_path, phase):
    """SIGKILL of ``mpiexec`` (2 nodes of 2 ranks) in each phase of the start: every
    process of the job ends within 30 s, with no mount, runtime directory, staged data or
    index copy left (the gate: tests/test_launch.py::test_a_launcher_killed_mid_start_…)."""
    _, by_parts = stores
    hold = PHASES[phase]
    job = MpiJob(by_parts[8], tmp_path, ranks=2, ranks_per_node=2, wait=not hold,
                 env=_env(tmp_path, hold), extra=["--start-timeout", "600"])
    job.start()
    try:
        if hold:
            assert wait_until(lambda: _marks(tmp_path, "held") == {3}, 60), job.output()[-2000:]
            if phase == "before MPI_Init":
                assert wait_until(lambda: _marks(tmp_path, "mpi-init") == {0, 1, 2}, 60), \
                    job.output()[-2000:]
        time.sleep(0.5)  # (the others are past the marks: in MPI_Init, or in a wait)
        assert len(tagged(tmp_path)) >= 4
        os.kill(job.proc.pid, signal.SIGKILL)
        t0 = time.monotonic()
        assert wait_until(lambda: not any(_left(job, tmp_path).values()), GONE_WITHIN,
                          interval=0.2), (_left(job, tmp_path), job.output()[-3000:])
        assert time.monotonic() - t0 < GONE_WITHIN
        assert "Traceback" not in job.output()
    finally:
        _kill_all(tmp_path)
        job.stop()


@pytest.mark.mpi
@mpi_only
def test_a_worker_rank_that_never_says_hello_is_named(stores, tmp_path):
    """Node 0's worker rank (rank 1) hangs before its hello, ``--start-timeout 2``: node 0
    names it within the start timeout, every node stops with that reason, the job exits
    non-zero and nothing is left but each node's state with its error, for ``fanstore
    wait`` (the hung rank is ended by its lifeline's start deadline)."""
    _, by_parts = stores
    job = MpiJob(by_parts[8], tmp_path, ranks=2, ranks_per_node=2, wait=False,
                 env=_env(tmp_path, "hello:1"), extra=["--start-timeout", "2"])
    job.start()
    try:
        assert job.wait_exit(90) not in (0, None), job.output()[-3000:]
        out = job.output()
        assert "worker rank 1 of this node did not say hello within 2 s " \
               "(--start-timeout)" in out, out[-3000:]
        assert "not starting: node 0 (" in out, out[-3000:]
        assert "Traceback" not in out

        def gone():  # a failed node keeps its state (its error) for `fanstore wait`
            return not any(v for k, v in _left(job, tmp_path).items() if k != "runtime_dirs")

        assert wait_until(gone, GONE_WITHIN, interval=0.2), (_left(job, tmp_path), out[-3000:])
        root = os.environ["FANSTORE_RUNTIME_DIR"]
        for name in _runtime_dirs(tmp_path):  # swept by the next mount or umount
            state = json.loads(open(os.path.join(root, name, "state.json")).read())
            assert state["phase"] == "failed" and "did not say hello" in state["error"]
            assert not pid_alive(state["pid"])
    finally:
        _kill_all(tmp_path)
        job.stop()


def test_a_daemon_silent_past_the_start_timeout_is_stopped(stores, tmp_path):
    """A background mount whose daemon hangs before staging (no progress), with
    ``--start-timeout 3``: ``fanstore mount`` exits 1 with one line naming the daemon and
    the timeout; the daemon is stopped and nothing is left; the same mount then works."""
    src, by_parts = stores
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    proc = run_cli("mount", by_parts[2], mnt, "--local-dir", tmp_path / "local",
                   "--start-timeout", "3", env=_env(tmp_path, "stage:any"), timeout=90)
    line = assert_cli_error(proc, code=1, contains="did not report ready or progress")
    assert "within 3 s (--start-timeout): stopped it; see " in line
    try:
        assert wait_until(lambda: not tagged(tmp_path), GONE_WITHIN), tagged(tmp_path)
        assert not is_mounted(mnt)
        res = run_cli("mount", by_parts[2], mnt, "--local-dir", tmp_path / "local", timeout=90)
        assert res.returncode == 0, res.stderr
        for path in src.rglob("f*"):
            assert (mnt / path.relative_to(src)).read_bytes() == path.read_bytes()
        assert run_cli("umount", mnt, timeout=60).returncode == 0
        assert not (tmp_path / "local").exists()
    finally:
        _kill_all(tmp_path)
        if is_mounted(mnt):
            lazy_unmount(mnt)


def test_the_next_mount_cleans_what_a_killed_daemon_staged(stores, tmp_path):
    """A daemon SIGKILLed after staging 8 partitions into a local directory it created
    (its frontend unmounts and cleans up; the copies stay, with its owner record). The
    next mount there, of a 2-partition store, removes the dead one's 6 other copies and
    logs one line naming its pid, keeps the 2 it stages (checked, copied again: another
    store's), reads exactly, and at its unmount removes the directory the dead mount
    had made."""
    src, by_parts = stores
    mnt, local = tmp_path / "mnt", tmp_path / "local"
    mnt.mkdir()
    env = _env(tmp_path)
    try:
        run_cli("mount", by_parts[8], mnt, "--local-dir", local, env=env, check=True)
        dead = daemon_pid(mnt)
        staged = sorted(n for n in os.listdir(local) if n.endswith(".fsp"))
        assert staged == [partition_name(p) for p in range(8)]
        records = [n for n in os.listdir(local) if n.startswith(stageowner.PREFIX)]
        assert len(records) == 1 and records[0].endswith(f"-{dead}.json")
        os.kill(dead, signal.SIGKILL)
        assert wait_until(lambda: not tagged(tmp_path) and not is_mounted(mnt), GONE_WITHIN)
        assert sorted(n for n in os.listdir(local) if n.endswith(".fsp")) == staged

        run_cli("mount", by_parts[2], mnt, "--local-dir", local, env=env, check=True)
        assert sorted(n for n in os.listdir(local) if n.endswith(".fsp")) == \
            [partition_name(0), partition_name(1)]
        assert [n for n in os.listdir(local) if n.startswith(stageowner.PREFIX)] == \
            [f"{stageowner.PREFIX}{os.uname().nodename}-{daemon_pid(mnt)}.json"]
        log = daemon_log(mnt, limit=100_000)
        assert log.count(f"a mount that died (pid {dead}) left 8 staged partitions in "
                         f"{local}: removed 6, kept 2") == 1, log[-2000:]
        for path in src.rglob("f*"):
            assert (mnt / path.relative_to(src)).read_bytes() == path.read_bytes()
        assert run_cli("umount", mnt, timeout=60).returncode == 0
        assert wait_until(lambda: not tagged(tmp_path), GONE_WITHIN)
        assert not local.exists()
    finally:
        _kill_all(tmp_path)
        if is_mounted(mnt):
            lazy_unmount(mnt)


def test_a_live_mounts_record_is_never_swept(tmp_path):
    """Records of a live process, of another host, or unreadable are left alone; a dead
    process's record (its pid gone, or reused by a process that started later) is swept:
    its partitions the new mount does not stage are removed, the others kept."""
    local = tmp_path / "local"
    local.mkdir()
    for p in range(4):
        (local / partition_name(p)).write_bytes(b"x")
    sleeper = subprocess.Popen(["sleep", "600"])
    try:
        host = os.uname().nodename

        def record(pid, parts, started, name_host=host, created=False):
            body = {"host": name_host, "pid": pid, "started": started, "created": created,
                    "partitions": parts}
            (local / f"{stageowner.PREFIX}{name_host}-{pid}.json").write_text(json.dumps(body))

        from fanstore.process import started_at

        record(sleeper.pid, [0], started_at(sleeper.pid))            # alive
        record(sleeper.pid + 1_000_000, [1], 0.0, name_host="elsewhere")  # another host
        (local / f"{stageowner.PREFIX}{host}-7.json").write_text("{not json")
        gone = subprocess.Popen(["true"])
        gone.wait()
        record(gone.pid, [2, 3], started_at(os.getpid()), created=True)  # dead
        record(sleeper.pid + 2_000_000, [], 0.0)  # a pid never used
        # the sleeper's pid with a start time before it started: a reused pid, dead owner
        removed, created = stageowner.sweep(str(local), keep=[3], who="t")
        assert removed == [2] and created
        left = sorted(os.listdir(local))
        assert partition_name(0) in left and partition_name(1) in left
        assert partition_name(2) not in left and partition_name(3) in left
        assert f"{stageowner.PREFIX}{host}-{sleeper.pid}.json" in left
        assert f"{stageowner.PREFIX}elsewhere-{sleeper.pid + 1_000_000}.json" in left
        assert f"{stageowner.PREFIX}{host}-7.json" in left
        assert f"{stageowner.PREFIX}{host}-{gone.pid}.json" not in left
        assert stageowner.others_alive(str(local))
        # a record naming the live sleeper but written before it started: a reused pid
        record(sleeper.pid, [0], started_at(sleeper.pid) - 3600)
        assert stageowner.sweep(str(local), keep=[], who="t")[0] == [0]
    finally:
        kill_pid(sleeper.pid)
        sleeper.wait()
