"""Each test module's own runtime state, and the check that a test leaves nothing behind.

``make test`` runs modules in parallel processes. Whatever FanStore keeps per user on the
machine (the runtime root, the directory of the nodes' index copies) is shared by them unless
each module has its own: :class:`ModuleState` makes them and points ``FANSTORE_RUNTIME_DIR``
and ``FANSTORE_SHM_DIR`` at them for the module's tests and every process they start.

:class:`Snapshot` records, before a test, what of that state exists: FUSE mounts under the
session's temporary root, FanStore processes started under this module's state (they inherit
its ``FANSTORE_RUNTIME_DIR``), runtime directories and index copies. After the test,
:func:`leftovers` names what is new and still there: a mount, a process still alive after a
deadline, a runtime directory a later mount would not sweep, or an index copy.
"""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from helpers import find_processes, lazy_unmount, signal_ours

#: names of the processes a FanStore mount runs (the daemon, its frontend and workers carry
#: the ``fanstore`` command line they were forked from; MPI jobs add hydra's)
_PROGRAMS = (b"fanstore", b"mpiexec", b"hydra_pmi_proxy")

#: how long a process a test started may take to exit after the test
EXIT_DEADLINE = 15.0

ENV_KEYS = ("FANSTORE_RUNTIME_DIR", "FANSTORE_SHM_DIR")


@dataclass
class ModuleState:
    """A module's runtime root and index-copy directory (``own_shm`` "sticky": a directory
    of the module's own made like /dev/shm, world-writable and sticky, for tests of other
    users' files in it; ``shm`` None when the module keeps the machine's /dev/shm)."""

    root: Path
    shm: Path | None
    saved: dict[str, str | None] = field(default_factory=dict)

    @classmethod
    def enter(cls, tmp: Path, own_shm: bool | str) -> ModuleState:
        shm = None
        if own_shm and os.path.isdir("/dev/shm"):
            shm = Path(tempfile.mkdtemp(prefix="fanstore-test-", dir="/dev/shm"))
            if own_shm == "sticky":
                os.chmod(shm, 0o1777)
        self = cls(tmp, shm)
        self.saved = {k: os.environ.get(k) for k in ENV_KEYS}
        os.environ["FANSTORE_RUNTIME_DIR"] = str(tmp)
        if shm is not None:
            os.environ["FANSTORE_SHM_DIR"] = str(shm)
        return self

    def leave(self) -> None:
        for key, value in self.saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        if self.shm is not None:
            shutil.rmtree(self.shm, ignore_errors=True)

    @property
    def shm_dir(self) -> str:
        return str(self.shm) if self.shm is not None else "/dev/shm"


def _processes(root: Path) -> set[int]:
    """Live FanStore processes (or MPI launchers) whose environment names ``root``."""
    needle = b"FANSTORE_RUNTIME_DIR=" + os.fsencode(root) + b"\0"
    return set(find_processes(lambda p: any(name in p.cmdline for name in _PROGRAMS)
                              and needle in p.environ))


def _mounts(base: str) -> set[str]:
    from fanstore import mounttable

    return {m for m in mounttable.fuse_mounts() if m.startswith(base + "/")}


def _entries(path: str, prefix: str = "") -> set[str]:
    try:
        return {n for n in os.listdir(path) if n.startswith(prefix)}
    except OSError:
        return set()


@dataclass
class Snapshot:
    mounts: set[str]
    processes: set[int]
    runtime_dirs: set[str]
    copies: set[str]

    @classmethod
    def take(cls, state: ModuleState, base: str) -> Snapshot:
        return cls(_mounts(base), _processes(state.root), _entries(str(state.root)),
                   _copies(state))


def _copies(state: ModuleState) -> set[str]:
    """This uid's index copies in the module's own directory. None are checked for a module
    that keeps the machine's /dev/shm (``OWN_SHM = False``): another process of the suite
    may run the same module on the other frontend at the same time, and its files there are
    not this test's (they were once taken for this test's and removed under it)."""
    if state.shm is None:
        return set()
    return _entries(state.shm_dir, f"fanstore-{os.geteuid()}-")


def leftovers(before: Snapshot, state: ModuleState, base: str) -> list[str]:
    """What a test left that was not there before it, cleaned up, one line each. Processes
    get ``EXIT_DEADLINE`` to exit; dead daemons' runtime directories are swept first, as
    the next mount or umount would (a failed mount keeps its state until then)."""
    from fanstore import runtime, settings

    found = []
    deadline = time.monotonic() + EXIT_DEADLINE
    alive = _processes(state.root) - before.processes
    while alive and time.monotonic() < deadline:
        time.sleep(0.1)
        alive = _processes(state.root) - before.processes
    for pid in sorted(alive):
        found.append(f"process {pid} ({_cmdline(pid)}) still alive {EXIT_DEADLINE:g} s "
                     "after the test")
        signal_ours(pid, signal.SIGKILL)
    for mnt in sorted(_mounts(base) - before.mounts):
        found.append(f"FUSE mount {mnt}")
        lazy_unmount(mnt)
    settings.reset()
    runtime.sweep_dead()
    for name in sorted(_entries(str(state.root)) - before.runtime_dirs):
        found.append(f"runtime directory {state.root / name} "
                     f"({', '.join(sorted(_entries(str(state.root / name))))})")
        shutil.rmtree(state.root / name, ignore_errors=True)
    for name in sorted(_copies(state) - before.copies):
        found.append(f"index copy {state.shm_dir}/{name}")
        try:
            os.unlink(os.path.join(state.shm_dir, name))
        except OSError:
            pass
    return found


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()[:200]
    except OSError:
        return "?"
