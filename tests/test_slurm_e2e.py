"""End to end on a real Slurm: a controller and two nodes on this machine.

tools/slurm-local.sh starts Slurm for this module and stops it at the end, even when a
test fails. The jobs are the user-facing templates themselves: slurm/pack.sbatch and
slurm/train.sbatch.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fanstore import mounttable
from helpers import (FANSTORE, find_processes, fuse_available, lazy_unmount, run_cli,
                     wait_until)

REPO = Path(__file__).resolve().parent.parent
SLURM_LOCAL = REPO / "tools" / "slurm-local.sh"
VENV_BIN = os.path.dirname(sys.executable)

_fuse_ok, _fuse_why = fuse_available()
pytestmark = [
    pytest.mark.usefixtures("frontend"),
    pytest.mark.slurm,
    pytest.mark.fuse,
    pytest.mark.mpi,
    pytest.mark.skipif(os.geteuid() != 0, reason="the local Slurm needs root"),
    pytest.mark.skipif(not shutil.which("apt-get") and not shutil.which("slurmctld"),
                       reason="no Debian packages for Slurm here"),
    pytest.mark.skipif(not _fuse_ok, reason=_fuse_why),
]
#: Slurm starts, stages, cleans up and cancels the same whatever serves the mount: the
#: default frontend; the training job's reads run on both.
FUSE_FRONTENDS = ("kernel",)


RUN_DIR = Path(os.environ.get("FANSTORE_SLURM_RUN_DIR", "/run/fanstore-slurm-local"))
LOG_DIR = Path(os.environ.get("FANSTORE_SLURM_LOG_DIR", "/var/log/fanstore-slurm-local"))
#: the local cluster's daemons: pid file name -> the process name it must run as
DAEMONS = {"slurmctld": "slurmctld", "slurmd-n1": "slurmd", "slurmd-n2": "slurmd"}


def dead_daemons() -> list[str]:
    """The local cluster's daemons that are not running (by their pid files, the name
    checked so that a recycled pid does not count)."""
    dead = []
    for name, comm in DAEMONS.items():
        try:
            pid = int((RUN_DIR / f"{name}.pid").read_text().strip())
            alive = Path(f"/proc/{pid}/comm").read_text().strip() == comm
            state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
        except (OSError, ValueError, IndexError):
            alive, state = False, "?"
        if not alive or state in ("Z", "X"):
            dead.append(name)
    return dead


def daemon_logs(names, lines: int = 15) -> str:
    out = []
    for name in names:
        path = LOG_DIR / f"{name}.log"
        try:
            tail = path.read_text(errors="replace").splitlines()[-lines:]
        except OSError as exc:
            tail = [f"(cannot read: {exc.strerror})"]
        out.append(f"----- last lines of {path} -----\n" + "\n".join(tail))
    return "\n".join(out)


def start_slurm() -> None:
    res = subprocess.run(["bash", str(SLURM_LOCAL), "start"], capture_output=True, text=True,
                         timeout=600)
    assert res.returncode == 0, f"local Slurm did not start:\n{res.stdout}\n{res.stderr}"


class Cluster:
    """The module's local Slurm. A daemon found dead before a test is named with its log;
    the cluster is restarted once for the tests that follow; if that fails, every later
    test fails at once with the same message (no 300-600 s job timeouts)."""

    def __init__(self) -> None:
        self.broken: str | None = None

    def check(self) -> None:
        if self.broken:
            pytest.fail(self.broken, pytrace=False)
        dead = dead_daemons()
        if not dead:
            return
        why = (f"the local Slurm's {', '.join(dead)} died before this test (see "
               f"docs/slurm.md §9):\n{daemon_logs(dead)}")
        subprocess.run(["scancel", "--full", "--user", "root"], capture_output=True, timeout=30)
        try:
            start_slurm()
        except AssertionError as exc:
            self.broken = f"{why}\nand it could not be restarted: {exc}"
            pytest.fail(self.broken, pytrace=False)
        pytest.fail(f"{why}\n(restarted for the next tests)", pytrace=False)


@pytest.fixture(scope="module")
def slurm():
    start_slurm()
    try:
        yield Cluster()
    finally:
        subprocess.run(["scancel", "--full", "--user", "root"], capture_output=True, timeout=30)
        subprocess.run(["bash", str(SLURM_LOCAL), "stop"], capture_output=True, timeout=120)


@pytest.fixture(autouse=True)
def _slurm_alive(slurm):
    """Before each test: the local cluster is whole (``Cluster.check``)."""
    slurm.check()


def job_env(tmp: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = VENV_BIN + os.pathsep + env.get("PATH", "")
    env["FANSTORE"] = FANSTORE
    env["TMPDIR"] = str(tmp / "nodelocal")  # node-local staging goes under the test dir
    env["FANSTORE_MOUNT_DIR"] = str(tmp / "mnt" / "{host}")
    env["PYTHONUNBUFFERED"] = "1"
    env["FANSTORE_WORKERS"] = "2"  # worker ranks per node (the default: the CPUs of a node)
    (tmp / "nodelocal").mkdir(exist_ok=True)
    return env


def sbatch(tmp: Path, *args, wait: bool = True, timeout: float = 300):
    """``sbatch --parsable [--wait] ARGS`` in ``tmp``. While it waits, the cluster's
    daemons are watched: one that dies ends the wait at once (the job cancelled) with its
    log, rather than at ``timeout``."""
    cmd = ["sbatch", "--parsable"] + (["--wait"] if wait else []) + [str(a) for a in args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=tmp, env=job_env(tmp))
    deadline = time.monotonic() + timeout
    try:
        while proc.poll() is None:
            dead = dead_daemons()
            if dead:
                subprocess.run(["scancel", "--full", "--user", "root"], capture_output=True,
                               timeout=30)
                pytest.fail(f"the local Slurm's {', '.join(dead)} died during the job:\n"
                            f"{daemon_logs(dead)}\n--- job output\n{job_output(tmp)[-3000:]}",
                            pytrace=False)
            if time.monotonic() > deadline:
                pytest.fail(f"sbatch {' '.join(cmd[2:])} did not end within {timeout:g} s:\n"
                            f"{job_output(tmp)[-3000:]}", pytrace=False)
            time.sleep(1)
        out, err = proc.communicate()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def job_output(tmp: Path) -> str:
    return "\n".join(p.read_text(errors="replace") for p in sorted(tmp.glob("fanstore-*.out")))


def fanstore_mounts_under(path: Path) -> list[str]:
    return [m for m in mounttable.fuse_mounts() if m.startswith(str(path) + "/")]


def staged_files(tmp: Path) -> list[str]:
    return [str(p) for p in (tmp / "nodelocal").rglob("*") if p.is_file()]


def no_daemons_for(tmp: Path) -> bool:
    needle = os.fsencode(tmp)
    return not find_processes(lambda p: b"fanstore" in p.cmdline and needle in p.cmdline
                              and b"mount" in p.cmdline)


@pytest.fixture(scope="module")
def packed(slurm, tmp_path_factory):
    """A dataset packed by slurm/pack.sbatch across both nodes (MPI ranks)."""
    tmp = tmp_path_factory.mktemp("slurm-pack")
    src = tmp / "src"
    rng = random.Random(11)
    for d in range(6):
        (src / f"d{d}").mkdir(parents=True)
        for i in range(25):
            n = rng.randint(100, 40_000)
            data = rng.randbytes(n) if i % 2 else (b"sample %d " % i) * (n // 9 + 1)
            (src / f"d{d}" / f"f{i:02d}.bin").write_bytes(data)
    store = tmp / "store"
    # A pinned codec: the default (a quick selection that measures read speed) may choose
    # differently in two runs, and the two stores are compared byte for byte.
    res = sbatch(tmp, "-N", "2", REPO / "slurm" / "pack.sbatch", src, store, "--partitions", "4",
                 "--codec", "zstd:3")
    assert res.returncode == 0, job_output(tmp) + res.stderr
    # The parallel pack gives exactly what a one-node pack gives.
    run_cli("pack", src, tmp / "local-store", "--partitions", "4", "--codec", "zstd:3",
            "--no-progress", check=True)
    assert (store / "fanstore.idx").read_bytes() == (tmp / "local-store" / "fanstore.idx").read_bytes()
    return src, store


@pytest.mark.frontends("kernel", "pyfuse3")
def test_train_on_two_nodes_reads_everything_and_cleans_up(packed, tmp_path, frontend):
    src, store = packed
    out = tmp_path / "out"
    out.mkdir()
    res = sbatch(tmp_path, "-N", "2", REPO / "slurm" / "train.sbatch", store, "--",
                 sys.executable, REPO / "tests" / "slurm_reader.py", "$FANSTORE_MOUNT", src, out)
    log = job_output(tmp_path)
    assert res.returncode == 0, log + res.stderr
    reports = {p.stem: json.loads(p.read_text()) for p in out.glob("*.json")}
    assert sorted(reports) == ["n1", "n2"], log
    for node, rep in reports.items():
        assert rep["wrong"] == [] and rep["ok"] == 150, (node, rep)
        stats = rep["stats"]
        assert stats["remote_reads"] > 0 and stats["local_reads"] > 0, stats
        assert stats["ranks"] == 2 and stats["errors"] == 0
        # the template starts worker ranks on every node (FANSTORE_WORKERS, here 2): they
        # answer the other node's reads of this node's data, so the daemons answer none;
        # with the kernel frontend they also serve the mount's requests
        assert stats["served_requests"] == 0, stats
        if frontend == "kernel":
            assert stats["workers"] == 2 and stats["requests"] > 0, stats
    assert {r["stats"]["rank"] for r in reports.values()} == {0, 1}
    if frontend == "kernel":
        assert sum(r["stats"]["worker_served_requests"] for r in reports.values()) > 0
    assert fanstore_mounts_under(tmp_path) == []
    assert staged_files(tmp_path) == []
    assert wait_until(lambda: no_daemons_for(tmp_path), 10)


def test_the_users_exit_status_is_the_jobs(packed, tmp_path):
    _, store = packed
    res = sbatch(tmp_path, "-N", "2", REPO / "slurm" / "train.sbatch", store, "--",
                 "bash", "-c", "test -d $FANSTORE_MOUNT/d0 && exit 3")
    assert res.returncode == 3, job_output(tmp_path) + res.stderr
    assert fanstore_mounts_under(tmp_path) == []
    assert staged_files(tmp_path) == []
    assert wait_until(lambda: no_daemons_for(tmp_path), 10)


def test_scancel_cleans_up(packed, tmp_path):
    _, store = packed
    res = sbatch(tmp_path, "-N", "2", REPO / "slurm" / "train.sbatch", store, "--",
                 "sleep", "600", wait=False)
    assert res.returncode == 0, res.stderr
    job = res.stdout.strip().split(";")[0]
    try:
        # Wait until both nodes serve the mount, then cancel the job.
        assert wait_until(lambda: len(fanstore_mounts_under(tmp_path)) == 2, 120), \
            job_output(tmp_path)
        assert wait_until(lambda: "running: sleep" in job_output(tmp_path), 60)
        subprocess.run(["scancel", job], check=True, timeout=30)
        gone = wait_until(lambda: subprocess.run(
            ["squeue", "-h", "-j", job], capture_output=True, text=True).stdout.strip() == "", 90)
        assert gone, "the job did not end after scancel"
        assert wait_until(lambda: fanstore_mounts_under(tmp_path) == [], 30), job_output(tmp_path)
        assert wait_until(lambda: staged_files(tmp_path) == [], 30), staged_files(tmp_path)
        assert wait_until(lambda: no_daemons_for(tmp_path), 30)
    finally:
        subprocess.run(["scancel", job], capture_output=True, timeout=30)
        for m in fanstore_mounts_under(tmp_path):
            lazy_unmount(m)


def test_wait_reports_a_missing_store(slurm, tmp_path):
    res = sbatch(tmp_path, "-N", "2", REPO / "slurm" / "train.sbatch", tmp_path / "nothing",
                 "--", "true")
    assert res.returncode != 0
    log = job_output(tmp_path)
    assert "no such directory" in log, log
    assert "Traceback" not in log
    assert fanstore_mounts_under(tmp_path) == []
    assert wait_until(lambda: no_daemons_for(tmp_path), 10)



@pytest.mark.parametrize("planted", ["their-dir", "symlink"])
def test_a_job_dir_another_user_made_first_stops_the_job(packed, tmp_path, planted):
    """The template's private parent ($TMPDIR/fanstore-jobs-<uid>) made first by someone
    else (a directory of theirs, or a symlink to one): the job stops with one line naming
    it; nothing is staged or mounted, nothing is written into their directory."""
    from second_user import other_user

    user, why = other_user()
    if user is None:
        pytest.skip(why)
    _, store = packed
    base = tmp_path / "nodelocal"
    base.mkdir()
    private = base / f"fanstore-jobs-{os.getuid()}"
    theirs = base / "theirs"
    theirs.mkdir(mode=0o700)
    os.chown(theirs, user.uid, user.gid)
    if planted == "their-dir":
        private.mkdir(mode=0o700)
        os.chown(private, user.uid, user.gid)
        watched = private
    else:
        private.symlink_to(theirs)
        watched = theirs
    res = sbatch(tmp_path, "-N", "2", REPO / "slurm" / "train.sbatch", store, "--", "true")
    assert res.returncode != 0
    log = job_output(tmp_path)
    assert "is not a private directory of yours" in log, log
    assert "Traceback" not in log
    assert list(watched.iterdir()) == []
    assert fanstore_mounts_under(tmp_path) == []
    assert wait_until(lambda: no_daemons_for(tmp_path), 10)


#: launches of test_mpi_start_up_under_srun_is_reliable: two of each shape in the default
#: run (each launch is a real srun of real MPI ranks: 1-2 s, 2.5 CPU-s); the 30 that would
#: catch the 10% failures of old are the slow variant
LAUNCHES = [4, pytest.param(30, marks=pytest.mark.slow)]


@pytest.mark.parametrize("launches", LAUNCHES)
def test_mpi_start_up_under_srun_is_reliable(slurm, tmp_path, frontend, launches):
    """``launches`` launches of FanStore's MPI start-up on 2 nodes, each with a heap full of
    freed data, alternately 1 and 3 ranks per node (the template's shape: a leader and
    worker ranks): all must start and exchange a message. With the PyPI MPICH's default
    netmod (UCX) 10-40% of 1-rank launches failed (corrupt PMI messages); FanStore picks
    OFI. With 3 ranks per emulated node, 10-17% of launches hung in MPI_Init until the
    local cluster told MPICH that no two ranks share memory
    (tools/slurm-local/task-prolog.sh: the two emulated nodes are one host). MPI start-up
    involves no FUSE frontend: one run."""
    script = tmp_path / "launches.sh"
    script.write_text(
        f"#!/bin/bash\nfail=0\nfor i in $(seq {launches}); do\n"
        "  k=$(( i % 2 ? 1 : 3 ))\n"
        f"  timeout 30 srun --overlap --overcommit -N2 --ntasks=$((2 * k)) "
        f"--ntasks-per-node=$k --mpi=pmi2 {sys.executable} "
        f"{REPO / 'tests' / 'slurm_mpi_init.py'} || {{ fail=$((fail+1)); echo \"launch $i "
        "($k per node) failed\"; }\n"
        "done\necho \"failed launches: $fail\"\nexit $fail\n")
    res = sbatch(tmp_path, "-N", "2", "-o", tmp_path / "fanstore-launches.out", script,
                 timeout=900)
    out = job_output(tmp_path)
    assert "failed launches: 0" in out and res.returncode == 0, out + res.stderr
