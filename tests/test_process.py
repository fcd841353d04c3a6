"""fanstore/process.py's process-tree walk: the one select's measured passes
(fanstore/select/epoch.py), the tests (helpers.process_tree) and the benchmarks
(tools/bench/harness.py) all use."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

from fanstore.process import cpu_seconds, descendants

# A parent that starts one child from its main thread and one from a second thread that
# stays alive (that child is listed only under the thread's own task), prints the three
# pids, and ends both children when its stdin closes.
PARENT = r"""
import json, subprocess, sys, threading
main = subprocess.Popen(["sleep", "60"])
got, started, hold = [], threading.Event(), threading.Event()
def spawn():
    got.append(subprocess.Popen(["sleep", "60"]))
    started.set()
    hold.wait()
threading.Thread(target=spawn).start()
started.wait()
print(json.dumps([main.pid, got[0].pid]), flush=True)
sys.stdin.read()
for p in (main, got[0]):
    p.kill()
    p.wait()
hold.set()
"""


def test_descendants_finds_children_of_every_thread():
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    kids: list[int] = []
    try:
        kids = json.loads(parent.stdout.readline())
        tree = descendants(os.getpid())
        assert tree[0] == os.getpid()
        assert {parent.pid, *kids} <= set(tree)
        assert sorted(descendants(parent.pid)) == sorted([parent.pid, *kids])
        assert descendants(kids[1]) == [kids[1]]  # a leaf: itself
    finally:
        parent.stdin.close()
        try:
            parent.wait(timeout=10)
        except subprocess.TimeoutExpired:
            for pid in [*kids, parent.pid]:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            parent.wait()


def test_a_gone_pid_is_only_itself_and_costs_nothing():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()  # reaped: the pid names no process now
    assert descendants(proc.pid) == [proc.pid]
    assert cpu_seconds([proc.pid]) == 0


def test_cpu_seconds_counts_the_callers_own_cpu():
    before = cpu_seconds([os.getpid()])
    deadline = time.process_time() + 0.05
    while time.process_time() < deadline:
        pass
    assert cpu_seconds([os.getpid()]) >= before + 0.03


def test_a_ready_pipe_silent_past_its_deadline_names_what_did_not_arrive():
    """``read_ready`` with a deadline: silence past it raises ReadyTimeout naming the
    process; progress bytes restart the wait (a moving start is never cut, however long);
    "ready" and an error line come through as before; EOF is what a dead writer says."""
    import threading

    import pytest

    from fanstore.process import ReadyTimeout, read_ready

    r, w = os.pipe()
    with pytest.raises(ReadyTimeout, match=r"^the daemon \(pid 7\) did not report ready or "
                                           r"progress within 0.3 s$"):
        read_ready(r, 0.3, "the daemon (pid 7)")

    def moving():  # 2 s of progress, 0.1 s apart, against a 0.5 s deadline
        for _ in range(20):
            os.write(w, b".")
            time.sleep(0.1)
        os.write(w, b"ready\n")

    t = threading.Thread(target=moving)
    t.start()
    assert read_ready(r, 0.5, "x") == "ready"
    t.join()
    os.write(w, b"..error: staging failed. see LOG")
    os.close(w)
    assert read_ready(r, 5.0) == "error: staging failed. see LOG"
    os.close(r)
    r, w = os.pipe()
    os.close(w)
    assert read_ready(r, 5.0) == ""
    os.close(r)


# A module run the way FanStore runs its workers (spawn_worker: ``python -m MODULE FD``):
# imports numpy, then writes how many threads it has to FD.
THREAD_COUNTER = """
import os, sys
import numpy
os.write(int(sys.argv[1]), str(len(os.listdir("/proc/self/task"))).encode())
"""


def _threads_after_numpy(monkeypatch, tmp_path, **run) -> int:
    (tmp_path / "count_threads.py").write_text(THREAD_COUNTER)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    r, w = os.pipe()
    try:
        from fanstore.process import spawn_worker

        proc = spawn_worker("count_threads", [w])
        os.close(w)
        w = -1
        assert proc.wait(timeout=60) == 0
        return int(os.read(r, 16))
    finally:
        os.close(r)
        if w >= 0:
            os.close(w)


def test_a_worker_imports_numpy_without_blas_threads_whatever_the_user_set(
        monkeypatch, tmp_path):
    """numpy's OpenBLAS starts a thread per core at import (63 on a 64-core node) unless
    told otherwise: a FanStore worker is told, even when the user's environment asks for
    eight, and stays single-threaded (nothing it forks copies another thread's locks)."""
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "8")
    assert _threads_after_numpy(monkeypatch, tmp_path) == 1
    # and what the setting prevents, shown where nothing sets it: more than one thread
    probe = subprocess.run(
        [sys.executable, "-c", "import os, numpy; print(len(os.listdir('/proc/self/task')))"],
        capture_output=True, text=True, timeout=60,
        env={k: v for k, v in os.environ.items() if k != "OPENBLAS_NUM_THREADS"})
    if os.cpu_count() and len(os.sched_getaffinity(0)) > 1:
        assert int(probe.stdout) > 1, "numpy's BLAS no longer starts threads: drop the setting?"


def test_the_fanstore_command_runs_with_one_blas_thread(small_store):
    """The ``fanstore`` entry point sets FanStore's process environment before any command
    imports numpy (``info`` loads the index with it); its daemons and ranks inherit it."""
    code = ("import os, sys\n"
            "from fanstore.cli import run\n"
            f"sys.argv = ['fanstore', 'info', {str(small_store)!r}]\n"
            "code = run()\n"
            "assert 'numpy' in sys.modules\n"
            "print(os.environ['OPENBLAS_NUM_THREADS'], len(os.listdir('/proc/self/task')),\n"
            "      code, file=sys.stderr)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, env=dict(os.environ, OPENBLAS_NUM_THREADS="8"))
    assert proc.stderr.split()[-3:] == ["1", "1", "0"], proc.stderr


def test_a_kernel_mounts_processes_run_with_one_blas_thread(mounted, small_store,
                                                            monkeypatch):
    """The kernel frontend and its FUSE workers (forked from it) are started with
    FanStore's process environment, whatever the mount command's own says."""
    from helpers import daemon_pid, process_tree

    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "8")
    mnt = mounted(small_store, "--frontend", "kernel")
    assert os.listdir(mnt)
    tree = process_tree(daemon_pid(mnt))[1:]
    assert len(tree) >= 2, tree  # the frontend and at least one worker
    for pid in tree:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = f.read().split(b"\0")
        assert b"OPENBLAS_NUM_THREADS=1" in env and b"OPENBLAS_NUM_THREADS=8" not in env, pid
