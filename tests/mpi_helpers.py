"""Launch real multi-rank FanStore jobs with ``mpiexec`` and always clean them up.

    with MpiJob(store, tmp, ranks=4, extra=["--replicas", "2"]) as job:
        job.mnt(0)            # rank 0's mount point (ready when the block starts)
        job.pid(2)            # rank 2's daemon pid
        job.stats(0)          # `fanstore stats --json` of rank 0

Teardown, however the test ended: SIGTERM to every live daemon (a daemon stops all ranks),
wait for mpiexec; then SIGKILL whatever is left, lazily unmount what is still mounted and
remove the local directories.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from helpers import (
    DAEMON_PIDS,
    FANSTORE,
    daemon_pid,
    find_processes,
    is_mounted,
    lazy_unmount,
    pid_alive,
    run_cli,
    signal_ours,
    wait_until,
)

MPIEXEC = os.path.join(os.path.dirname(sys.executable), "mpiexec")


def mpi_available() -> tuple[bool, str]:
    if not os.access(MPIEXEC, os.X_OK) and not shutil.which("mpiexec"):
        return False, "mpiexec is not installed"
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return False, "mpi4py is not installed"
    return True, ""


class MpiJob:
    def __init__(self, store, tmp, ranks: int = 4, extra=(), timeout: float = 90,
                 local: bool = True, wait: bool = True, env: dict | None = None,
                 keep_local: bool = False, ranks_per_node: int | None = None) -> None:
        self.store = store if "://" in str(store) else Path(store)  # s3://... stays a URL
        self.tmp = Path(tmp)
        self.ranks = ranks
        self.extra = list(extra)
        self.timeout = timeout
        self.local = local
        self.wait_ready = wait
        self.env = env
        self.keep_local = keep_local  # leave the local dirs for the next job (restart tests)
        #: launch ``ranks`` nodes of this many ranks each (``--ranks-per-node``; one
        #: machine simulates the nodes); None: one rank per node (the node's mount is then
        #: served by forked FUSE workers)
        self.ranks_per_node = ranks_per_node
        self.proc: subprocess.Popen | None = None
        self.log = self.tmp / "mpiexec.log"
        self._pids: dict[int, int] = {}

    def mnt(self, rank: int) -> Path:
        return self.tmp / f"mnt{rank}"

    def local_dir(self, rank: int) -> Path:
        return self.tmp / f"local{rank}"

    def pid(self, rank: int) -> int | None:
        pid = daemon_pid(self.mnt(rank))
        if pid:
            self._pids[rank] = pid
            DAEMON_PIDS.add(pid)
        return pid

    def node_pids(self, rank: int) -> list[int]:
        """The daemon of node ``rank`` and its worker ranks (their pids are in its state)."""
        from fanstore import runtime

        pid = self.pid(rank)
        state = runtime.read_state(str(self.mnt(rank))) or {}
        return [p for p in [pid, *state.get("worker_pids", [])] if p]

    def kill_node(self, rank: int, sig: int = signal.SIGKILL) -> list[int]:
        """Send ``sig`` to every process of node ``rank`` (what a node crash or hang does);
        returns their pids."""
        pids = self.node_pids(rank)
        for p in pids:
            signal_ours(p, sig)
        return pids

    def output(self) -> str:
        try:
            return self.log.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def stats(self, rank: int) -> dict:
        proc = run_cli("stats", self.mnt(rank), "--json", check=True)
        return json.loads(proc.stdout)

    def start(self) -> "MpiJob":
        for r in range(self.ranks):
            self.mnt(r).mkdir(parents=True, exist_ok=True)
        n = self.ranks * (self.ranks_per_node or 1)
        cmd = [MPIEXEC, "-n", str(n), FANSTORE, "mount", str(self.store),
               str(self.tmp / "mnt{rank}")]
        cmd += ["--ranks-per-node", str(self.ranks_per_node or 1)]
        if self.local:
            cmd += ["--local-dir", str(self.tmp / "local{rank}")]
        cmd += self.extra
        env = dict(os.environ, PYTHONUNBUFFERED="1", **(self.env or {}))
        self._logf = open(self.log, "ab")
        self.proc = subprocess.Popen(cmd, stdout=self._logf, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)
        if self.wait_ready:
            for r in range(self.ranks):
                res = run_cli("wait", self.mnt(r), "--timeout", str(self.timeout))
                if res.returncode != 0:
                    raise AssertionError(f"rank {r} not ready: {res.stderr}\n{self.output()}")
                self.pid(r)
        return self

    def wait_exit(self, timeout: float = 60) -> int | None:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def stop(self) -> None:
        """SIGTERM every live daemon and wait; then force whatever is left."""
        if self.proc is None:
            return
        for r in range(self.ranks):
            self.pid(r)
        for p in self._pids.values():
            signal_ours(p, signal.SIGTERM)
        if self.wait_exit(30) is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.wait_exit(10)
        for p in self._pids.values():
            signal_ours(p, signal.SIGKILL)  # a pid read long ago may be anyone's by now
        wait_until(lambda: not any(pid_alive(p) for p in self._pids.values()), 10)
        for r in range(self.ranks):
            if is_mounted(self.mnt(r)):
                lazy_unmount(self.mnt(r))
            if not self.keep_local:
                shutil.rmtree(self.local_dir(r), ignore_errors=True)
        self._logf.close()

    def __enter__(self) -> "MpiJob":
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc) -> None:
        self.stop()


def job_pids(tmp) -> list[int]:
    """Live processes whose command line names a path under ``tmp`` (a job's daemons,
    shims, worker ranks, kernel-frontend processes and its ``mpiexec``)."""
    needle = os.fsencode(os.fspath(tmp))
    return find_processes(lambda p: needle in p.cmdline)


def _names(path: str | None, pattern: str) -> set[str]:
    import re

    try:
        return {n for n in os.listdir(path) if re.fullmatch(pattern, n)} if path else set()
    except OSError:
        return set()


def job_snapshot() -> dict[str, set[str]]:
    """The runtime directories and index copies of this user that exist now (the test
    module's own, tests/isolation.py), to tell a job's from others'."""
    return {"runtime_dirs": _names(os.environ.get("FANSTORE_RUNTIME_DIR"), r"[0-9a-f]{16}"),
            "copies": _names(os.environ.get("FANSTORE_SHM_DIR", "/dev/shm"),
                             rf"fanstore-{os.geteuid()}-\d+-[0-9a-f]{{16}}\.\w+")}


def job_leftovers(job: MpiJob, before: dict[str, set[str]], exclude=()) -> dict[str, list]:
    """What of ``job`` is still there: processes, FUSE mounts, runtime directories and
    index copies made since ``before`` (:func:`job_snapshot`). Nothing is swept first:
    a dead daemon's directory counts (the next mount would sweep it; the job must not
    leave it). ``exclude``: pids that are the test's own (readers)."""
    now = job_snapshot()
    return {
        "processes": [p for p in job_pids(job.tmp) if p not in set(exclude)],
        "mounts": [r for r in range(job.ranks) if is_mounted(job.mnt(r))],
        "runtime_dirs": [_described(n) for n in sorted(now["runtime_dirs"]
                                                       - before["runtime_dirs"])],
        "copies": sorted(now["copies"] - before["copies"]),
    }


def _described(name: str) -> str:
    """A runtime directory's name with what its state says (rank, pid, phase, error) and
    its files, for a failing test's message."""
    path = os.path.join(os.environ.get("FANSTORE_RUNTIME_DIR", ""), name)
    try:
        with open(os.path.join(path, "state.json")) as f:
            state = json.load(f)
    except (OSError, ValueError):
        state = {}
    keep = {k: state[k] for k in ("rank", "pid", "phase", "error") if k in state}
    try:
        files = sorted(os.listdir(path))
    except OSError:
        files = []
    return f"{name} {keep} {files}"


def read_tree_bytes(src: Path, mnt: Path) -> tuple[int, list[str], list[str]]:
    """Read every regular file of ``src`` through ``mnt``; return (ok, wrong, errors)."""
    ok, wrong, errors = 0, [], []
    for dirpath, _dirs, files in os.walk(src):
        for name in files:
            path = os.path.join(dirpath, name)
            if os.path.islink(path):
                continue
            rel = os.path.relpath(path, src)
            try:
                with open(os.path.join(mnt, rel), "rb") as f:
                    got = f.read()
            except OSError as exc:
                errors.append(f"{rel}: {exc.strerror}")
                continue
            with open(path, "rb") as f:
                if got == f.read():
                    ok += 1
                else:
                    wrong.append(rel)
    return ok, wrong, errors


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def wait_gone(paths, timeout: float = 30) -> bool:
    return wait_until(lambda: not any(is_mounted(p) for p in paths), timeout)


def now() -> float:
    return time.monotonic()
