"""A pack whose worker dies ends at once, says why in one line, leaves nothing at DEST and
can be run again; no process that may have threads forks.

The faults are real: a worker process SIGKILLed (what the kernel's out-of-memory killer
does), a worker crashing with SIGSEGV, an MPI rank SIGKILLed under ``mpiexec``. To kill a
worker while it certainly holds a partition, however fast or busy the machine, the tests
start the pack with ``tests/inject/sitecustomize.py``, which makes the workers stall (or
crash) inside their task; the pack's own process is unchanged.
"""

from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import (FANSTORE, TESTS_DIR, assert_cli_error, find_processes, pid_alive,
                     run_cli, signal_ours, wait_until)

from fanstore.format.index import INDEX_NAME
from fanstore.pack.dest import TMP_MARK

INJECT = os.path.join(TESTS_DIR, "inject")
#: What the design guarantees: a worker's death is seen when its pipe closes (at once);
#: the slack is for a busy machine.
ENDS_WITHIN = 10.0


def _tree(root: Path, files: int = 40, size: int = 20_000) -> Path:
    root.mkdir(parents=True)
    for i in range(files):
        d = root / f"d{i % 4}"
        d.mkdir(exist_ok=True)
        (d / f"f{i:05d}.txt").write_bytes(b"line %d of a file\n" % i * (size // 18))
    return root


def _env(fault: str | None = None) -> dict[str, str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if fault:
        env["FANSTORE_TEST_WORKER_FAULT"] = fault
        env["PYTHONPATH"] = os.pathsep.join(p for p in (INJECT, env.get("PYTHONPATH")) if p)
    return env


def _workers_of(pid: int) -> list[int]:
    """The live pack workers whose parent is ``pid``."""
    return find_processes(lambda p: b"fanstore.pack." in p.cmdline and p.ppid == pid)


def _start(cmd: list[str], fault: str | None, mark: Path | None = None,
           where: str | None = None) -> subprocess.Popen:
    env = _env(fault)
    if mark is not None:
        env["FANSTORE_TEST_FAULT_MARK"] = str(mark)
    if where is not None:
        env["FANSTORE_TEST_FAULT_WHERE"] = where
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, start_new_session=True)


def _end(proc: subprocess.Popen) -> tuple[str, str]:
    try:
        return proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate(timeout=30)


def _kill_and_end(victim: int, proc: subprocess.Popen) -> tuple[str, str, float]:
    """SIGKILL ``victim``; the output of ``proc`` once it has ended, and the seconds that
    took."""
    os.kill(victim, signal.SIGKILL)
    killed = time.monotonic()
    out, err = _end(proc)
    return out, err, time.monotonic() - killed


def _assert_nothing_left(dest: Path, pack_pid: int) -> None:
    assert not dest.exists(), os.listdir(dest)
    assert not glob.glob(f"{dest}{TMP_MARK}*"), "the temporary directory is left"
    assert wait_until(lambda: not _workers_of(pack_pid), 10), "a pack worker is left"
    proc = run_cli("info", dest)
    assert_cli_error(proc, code=1, contains="no such directory")


def _rerun_succeeds(src: Path, dest: Path) -> None:
    proc = run_cli("pack", src, dest, "--codec", "zstd:3", "--no-progress", timeout=300)
    assert proc.returncode == 0, proc.stderr
    proc = run_cli("verify", dest, "--no-progress")
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.long  # a fault injected into a pack of its own: not the edit loop
@pytest.mark.parametrize("phase", ["compress", "dedup"])
def test_a_sigkilled_worker_ends_the_pack_at_once(tmp_path, phase):
    """SIGKILL of one worker while it holds a partition (or a share of the duplicate
    search): the pack exits 1 within seconds with one line naming the worker, the signal
    and what to try; nothing at DEST, no temporary directory, no worker; a rerun works."""
    src = _tree(tmp_path / "src", files=2400 if phase == "dedup" else 40,
                size=200 if phase == "dedup" else 20_000)
    dest = tmp_path / "store"
    fault = "stall" if phase == "compress" else "digest-stall"
    mark = tmp_path / "stalled"
    proc = _start([FANSTORE, "pack", str(src), str(dest), "--jobs", "2", "--partitions", "4",
                   "--codec", "zstd:3", "--no-progress"], fault, mark)
    try:
        # a stalled worker marks itself once it holds its task, and holds it forever: the
        # kill cannot come too late, however busy the machine
        assert wait_until(lambda: glob.glob(f"{mark}.*") or proc.poll() is not None, 60), \
            "no worker took a task"
        assert proc.poll() is None, _end(proc)
        victim = int(glob.glob(f"{mark}.*")[0].rpartition(".")[2])
        out, err, took = _kill_and_end(victim, proc)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert took < ENDS_WITHIN, f"the pack took {took:.1f} s to notice"
    result = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    line = assert_cli_error(result, code=1, contains=f"(pid {victim}) was killed by SIGKILL")
    assert "try fewer --jobs" in line
    assert ("while compressing partition" if phase == "compress"
            else "while reading files to find duplicates") in line
    _assert_nothing_left(dest, proc.pid)
    _rerun_succeeds(src, dest)


@pytest.mark.long  # a fault injected into a pack of its own: not the edit loop
def test_a_worker_that_crashes_ends_the_pack(tmp_path):
    """A crash inside a worker (SIGSEGV, as a codec bug would give): one line naming it."""
    src = _tree(tmp_path / "src")
    dest = tmp_path / "store"
    proc = _start([FANSTORE, "pack", str(src), str(dest), "--jobs", "2", "--partitions", "2",
                   "--codec", "zstd:3", "--no-progress"], "segv")
    out, err = _end(proc)
    result = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    line = assert_cli_error(result, code=1, contains="died of SIGSEGV while compressing "
                                                     "partition")
    assert "pack worker" in line and "try fewer --jobs" in line
    _assert_nothing_left(dest, proc.pid)
    _rerun_succeeds(src, dest)


@pytest.mark.long  # a fault injected into a pack of its own: not the edit loop
@pytest.mark.parametrize("fault", ["dedup-rewrite", "dedup-append"])
def test_a_duplicate_changed_after_its_compare_fails_the_pack(tmp_path, fault):
    """A duplicate is never read after the byte compare (its entry gets its first copy's
    run): changed after it (other bytes and a later mtime, or a byte appended with the
    mtime kept), it would be stored as it was. The pack re-stats every merged file before
    installing: one line naming it, nothing at DEST, no temporary directory; the re-run
    packs it as it now is. (The change is made by tests/inject right after the compare:
    no race against the clock.)"""
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    data = os.urandom(3 * 4096 + 99)  # several chunks: a shared run
    (src / "orig.bin").write_bytes(data)
    (src / "sub" / "copy.bin").write_bytes(data)
    (src / "sub" / "other.txt").write_bytes(b"other\n" * 100)
    dest = tmp_path / "store"
    proc = _start([FANSTORE, "pack", str(src), str(dest), "--chunk-kb", "4", "--codec",
                   "zstd:3", "--no-progress"], fault, where=r"/sub/copy\.bin$")
    out, err = _end(proc)
    result = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    line = assert_cli_error(result, code=1)
    assert line == (f"fanstore: error: {src}/sub/copy.bin: file changed while being packed "
                    "(stored once with its identical copies; its size or modification time "
                    "is no longer what the scan saw)")
    assert err.splitlines() == [line], err
    _assert_nothing_left(dest, proc.pid)
    now = (src / "sub" / "copy.bin").read_bytes()
    assert now != data
    _rerun_succeeds(src, dest)
    got = run_cli("cat", dest, "sub/copy.bin", text=False, check=True).stdout
    assert got == now
    assert run_cli("cat", dest, "orig.bin", text=False, check=True).stdout == data


@pytest.mark.long  # a fault injected into a pack of its own: not the edit loop
def test_the_python_api_is_told_which_worker_died(tmp_path):
    """``fanstore.pack.pack`` raises PackError (no exit, no print) and leaves no worker."""
    src = _tree(tmp_path / "src")
    code = f"""
import json, sys
from fanstore.errors import PackError
from fanstore.pack import PackOptions, pack
try:
    pack({str(src)!r}, {str(tmp_path / 'store')!r}, options=PackOptions(jobs=2, partitions=2))
except PackError as exc:
    print(json.dumps({{"error": str(exc)}}))
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=_env("segv"), timeout=120)
    assert proc.returncode == 0, proc.stderr
    error = json.loads(proc.stdout)["error"]
    assert "died of SIGSEGV while compressing partition" in error
    assert not (tmp_path / "store").exists()


_FORK_PROBE = r"""
import json, os, sys, threading, time
forks = []
os.register_at_fork(before=lambda: forks.append(threading.active_count()))
stop = threading.Event()
threading.Thread(target=stop.wait, daemon=True).start()   # a thread of the caller's own
from fanstore.pack import PackOptions, pack, pack_any
from fanstore.pack import dedup
dedup.POOL_FROM = 1   # the duplicate search on the workers too
src, dest, how = sys.argv[1:4]
options = PackOptions(jobs=2, partitions=4, progress=True)
if how == "directory":
    summary = pack(src, dest, options=options)
else:
    summary = pack_any(src, dest, options=options)
stop.set()
print(json.dumps({"forks": forks, "files": summary.files}))
"""


@pytest.mark.mpi
def test_a_lost_mpi_rank_ends_the_pack_on_every_rank(tmp_path):
    """``mpiexec -n 2 fanstore pack``: SIGKILL of a rank while its worker holds a
    partition ends the whole job within seconds (hydra ends the other rank and says so); no worker of any rank is left (they die with their rank), DEST
    is not a store, and the next pack removes what rank 0 left and succeeds."""
    src, dest, mark, proc = _stalled_mpi_pack(tmp_path)
    try:
        worker = int(glob.glob(f"{mark}.*")[0].rpartition(".")[2])
        with open(f"/proc/{worker}/stat", "rb") as f:
            rank = int(f.read().rpartition(b")")[2].split()[1])
        ranks = [rank] + [p for p in _pack_ranks(proc.pid) if p != rank]
        out, err, took = _kill_and_end(rank, proc)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert took < ENDS_WITHIN, f"mpiexec took {took:.1f} s to end"
    assert proc.returncode != 0
    # the launcher names a rank that ended killed (the lost one, or the one it killed first)
    assert "BAD TERMINATION" in out + err and any(f"PID {p} " in out + err for p in ranks), \
        out + err
    for pid in ranks:
        assert wait_until(lambda: not _workers_of(pid), 10), "a rank's worker is left"
    assert not dest.exists()
    proc = run_cli("pack", src, dest, "--codec", "zstd:3", "--no-progress", timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert not glob.glob(f"{dest}{TMP_MARK}*")
    assert run_cli("verify", dest, "--no-progress").returncode == 0


def _stalled_mpi_pack(tmp_path):
    """``mpiexec -n 2 fanstore pack`` whose workers stall in their task (skipped without
    MPI); returns (src, dest, mark, the mpiexec process) once a worker holds a task."""
    from mpi_helpers import MPIEXEC, mpi_available

    ok, why = mpi_available()
    if not ok:
        pytest.skip(why)
    src = _tree(tmp_path / "src")
    dest = tmp_path / "store"
    mark = tmp_path / "stalled"
    proc = _start([MPIEXEC, "-n", "2", FANSTORE, "pack", str(src), str(dest), "--jobs", "1",
                   "--partitions", "4", "--codec", "zstd:3", "--no-progress"], "stall", mark)
    try:
        assert wait_until(lambda: glob.glob(f"{mark}.*") or proc.poll() is not None, 120), \
            "no worker took a task"
        assert proc.poll() is None, _end(proc)
    except BaseException:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        raise
    return src, dest, mark, proc


def _pack_ranks(launcher: int) -> list[int]:
    """The ``fanstore pack`` processes below ``launcher`` (its ranks)."""
    from fanstore.process import descendants

    out = []
    for pid in descendants(launcher):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read()
        except OSError:
            continue
        if b"fanstore\0pack\0" in argv:
            out.append(pid)
    return out


@pytest.mark.parametrize("source", ["directory", "tar"])
def test_no_process_with_threads_forks(tmp_path, source):
    """A caller with a thread of its own (and a progress bar) packs a directory (the
    workers, the duplicate search) and a tar (the streaming encoders): ``os.fork`` is
    never called (``register_at_fork`` would see it; fork-and-exec does not fork the
    interpreter) and the store is whole."""
    src = _tree(tmp_path / "src", files=60, size=3000)
    for i in range(3):  # duplicates, so the search has something to compare
        (src / f"dup{i}.txt").write_bytes((src / "d0" / "f00000.txt").read_bytes())
    if source == "tar":
        subprocess.run(["tar", "cf", str(tmp_path / "src.tar"), "-C", str(src), "."],
                       check=True)
        src = tmp_path / "src.tar"
    dest = tmp_path / "store"
    proc = subprocess.run([sys.executable, "-c", _FORK_PROBE, str(src), str(dest), source],
                          capture_output=True, text=True, timeout=300, env=_env())
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["forks"] == [] and got["files"] == 63
    assert run_cli("verify", dest, "--no-progress").returncode == 0


def test_no_fork_while_s3fs_runs(s3_server, tmp_path):
    """An s3:// source: s3fs' event-loop thread is running when the encoders start."""
    bucket = s3_server.new_bucket()
    fs = s3_server.fs()
    for i in range(20):
        fs.pipe(f"{bucket}/raw/d{i % 3}/f{i}.txt", b"object %d\n" % i * 400)
    dest = tmp_path / "store"
    proc = subprocess.run([sys.executable, "-c", _FORK_PROBE, f"s3://{bucket}/raw",
                           str(dest), "s3"], capture_output=True, text=True, timeout=300,
                          env=dict(_env(), **s3_server.env))
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["forks"] == [] and got["files"] == 20


_PASS_PROBE = r"""
import json, os, sys, threading
forks = []
os.register_at_fork(before=lambda: forks.append(threading.active_count()))
stop = threading.Event()
threading.Thread(target=stop.wait, daemon=True).start()
from fanstore.select.epoch import Target, run_pass
root = sys.argv[1]
rels = sorted(os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs)
result = run_pass(Target("mount", root), rels, readers=2, timeout=120)
stop.set()
print(json.dumps({"forks": forks, "files": result.files, "bytes": result.bytes,
                  "errors": result.errors}))
"""


def test_a_measured_pass_of_select_does_not_fork(tmp_path):
    """``fanstore select`` measures passes with reader processes: started from a caller
    with threads, none of them is a fork, and they read every byte."""
    src = _tree(tmp_path / "src", files=30, size=5000)
    total = sum(p.stat().st_size for p in src.rglob("*") if p.is_file())
    proc = subprocess.run([sys.executable, "-c", _PASS_PROBE, str(src)], capture_output=True,
                          text=True, timeout=300, env=_env())
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got == {"forks": [], "files": 30, "bytes": total, "errors": 0}


@pytest.mark.mpi
def test_a_killed_launcher_ends_every_pack_rank_and_worker(tmp_path):
    """``mpiexec -n 2 fanstore pack`` SIGKILLed while a worker holds a partition: every
    rank and every worker ends within seconds (a rank dies with hydra's proxy, its workers
    with their rank), DEST is not a store, and the next pack succeeds."""
    src, dest, mark, proc = _stalled_mpi_pack(tmp_path)
    ranks, workers = [], []
    try:
        ranks = [p for p in _pack_ranks(proc.pid) if p != proc.pid]
        assert len(ranks) == 2, ranks
        workers = [w for r in ranks for w in _workers_of(r)]
        assert workers
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        gone = lambda: not any(pid_alive(p) for p in ranks + workers)  # noqa: E731
        assert wait_until(gone, ENDS_WITHIN), \
            [p for p in ranks + workers if pid_alive(p)]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        for p in ranks + workers:
            signal_ours(p, signal.SIGKILL)
    assert not dest.exists()
    proc = run_cli("pack", src, dest, "--codec", "zstd:3", "--no-progress", timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert run_cli("verify", dest, "--no-progress").returncode == 0
