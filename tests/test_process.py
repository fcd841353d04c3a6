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
