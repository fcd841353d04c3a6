"""Shared fixtures: the special source tree and its store, real mounts that always clean up.

Fixtures (see each docstring):

- ``special_tree`` (session): the hard-case tree of :func:`helpers.make_special_tree`.
- ``special_pack`` / ``special_store`` (session): that tree packed once with
  ``SPECIAL_PACK_ARGS``.
- ``small_tree`` / ``small_store`` (session): a few small files, for quick tests.
- ``s3_server`` (session): a real S3 endpoint (moto server) on 127.0.0.1.
- ``mounted`` (function) and ``module_mounted`` (module): mount factories,
  ``mnt = mounted(store, *extra_args)``; teardown always unmounts and kills the daemon.
- ``other_user`` (session): a second, unprivileged local user (``second_user.py``) for the
  multi-user attack tests; skipped with the reason where one cannot be made.

Tests marked ``@pytest.mark.fuse`` are skipped when /dev/fuse, fusermount3 or pyfuse3 is
missing. At session end a safety net lazily unmounts any FUSE mount left under the pytest
temporary directories and kills any FanStore daemon the tests started.
"""

from __future__ import annotations

import collections
import os
import secrets
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from helpers import (  # noqa: E402
    DAEMON_PIDS,
    SESSION_MARK,
    SPECIAL_PACK_ARGS,
    cleanup_mount,
    find_processes,
    fuse_available,
    kill_pid,
    lazy_unmount,
    make_small_tree,
    make_special_tree,
    mount_store,
    pid_alive,
    run_cli,
    shm_mapped,
)

_FUSE_OK, _FUSE_WHY = fuse_available()

# Every process this session starts carries its mark (helpers.pid_ours): a pid remembered
# from earlier is signalled only while it is still one of ours. Set by the first process
# (the xdist controller); its workers inherit it.
os.environ.setdefault(SESSION_MARK, secrets.token_hex(8))


@pytest.hookimpl(tryfirst=True)  # before -m selects by the marks added here
def pytest_collection_modifyitems(config, items):
    """Skip FUSE tests without FUSE; mark ``s3`` the tests that use the S3 endpoint; put the
    longest modules first, so that under ``make test`` (several processes) none of them is
    left to run alone at the end."""
    skip = None if _FUSE_OK else pytest.mark.skip(reason=f"FUSE unavailable: {_FUSE_WHY}")
    for item in items:
        if _MOUNTING_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.fuse)  # a mount, whether or not the test says so
        if skip is not None and "fuse" in item.keywords:
            item.add_marker(skip)
        if "s3_server" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.s3)
    units = collections.Counter(_work_unit(item.nodeid) for item in items)
    items.sort(key=lambda item: (_LONG_FIRST.get(item.nodeid.split("::")[0], len(_LONG_FIRST)),
                                 -units[_work_unit(item.nodeid)]))


#: fixtures that mount (or run a test once per FUSE frontend): their tests are ``fuse``
_MOUNTING_FIXTURES = frozenset({"frontend", "mounted", "module_mounted"})

#: modules of more than half a minute under ``make test`` (the time from a unit's first
#: test to its last, on the CI log's timeline), handed out in this order, the rest after
#: them, larger units first: no long one is left to run alone at the end, and those that
#: mostly wait (Slurm, node deaths, start faults) overlap with those that compute. Each
#: process takes two units at the start (xdist) and runs its second when its first ends:
#: the modules that kill MPI processes are second units, so they start a minute or more
#: into the run, mostly after the Slurm module (not always: capacity's may end first).
_LONG_FIRST = {f"tests/{name}.py": i for i, name in enumerate(
    ("test_select_measure", "test_sources", "test_slurm_e2e", "test_capacity",
     "test_node_death", "test_start_faults", "test_launch", "test_hostile_input",
     "test_mpi", "test_select", "test_jpeg_store", "test_load", "test_access", "test_faults"))}


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist
def pytest_xdist_make_scheduler(config, log):
    """``make test`` runs ``pytest -n N --dist loadscope``: one unit of work per module and
    FUSE frontend (so module fixtures, stores, mounts and MPI jobs, are built once per unit),
    and the Slurm module whole (its one local cluster has fixed ports: one process starts
    and stops it). The tests that change machine-wide modes take a lock for it
    (``second_user.py``); those that drop the kernel's caches run afterwards, alone
    (``serial`` marker)."""
    if config.getvalue("dist") != "loadscope":
        return None
    config.option.loadscopereorder = False  # the order of pytest_collection_modifyitems
    from xdist.scheduler import LoadScopeScheduling

    class ModuleAndFrontend(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _work_unit(nodeid)

    return ModuleAndFrontend(config, log)


def _work_unit(nodeid: str) -> str:
    """The unit of work of a test id: its module, with the FUSE frontend it runs on."""
    module = nodeid.split("::")[0]
    if module.endswith("test_slurm_e2e.py"):
        return module
    params = nodeid.partition("[")[2].rstrip("]").split("-")
    frontend = next((p for p in params if p in ("kernel", "pyfuse3")), "")
    return f"{module}[{frontend}]" if frontend else module


# --------------------------------------------------------------------------- the environment


@pytest.fixture(autouse=True)
def _settings_follow_the_environment(monkeypatch):
    """fanstore.settings reads the environment once per process; a test that changes it
    (monkeypatch.setenv/delenv) and then calls FanStore in-process sees the change."""
    from fanstore import settings

    settings.reset()
    setenv, delenv = monkeypatch.setenv, monkeypatch.delenv

    def set_and_reset(*args, **kwargs):
        setenv(*args, **kwargs)
        settings.reset()

    def del_and_reset(*args, **kwargs):
        delenv(*args, **kwargs)
        settings.reset()

    monkeypatch.setenv, monkeypatch.delenv = set_and_reset, del_and_reset
    yield
    settings.reset()


# --------------------------------------------------------------------------- isolation


@pytest.fixture(scope="module", autouse=True)
def _module_state(request, tmp_path_factory):
    """Each test module has its own runtime root and index-copy directory (see
    ``isolation.py``): modules run in parallel, and a test that opens, damages or fills
    them must not reach another's. A module about other users' files in /dev/shm sets
    ``OWN_SHM = "sticky"`` (its own directory, made like /dev/shm); ``False`` keeps the
    machine's. At the module's end nothing of it may be left."""
    from isolation import ModuleState, Snapshot, leftovers

    from fanstore import settings

    base = str(tmp_path_factory.getbasetemp().resolve())
    state = ModuleState.enter(tmp_path_factory.mktemp("rt"),
                              own_shm=getattr(request.module, "OWN_SHM", True))
    settings.reset()
    empty = Snapshot(set(), set(), set(), set())
    empty.mounts = Snapshot.take(state, base).mounts  # other modules' (this process's)
    try:
        yield state
        left = leftovers(empty, state, base)
        if left:
            pytest.fail("the module left behind:\n  " + "\n  ".join(left), pytrace=False)
    finally:
        state.leave()
        settings.reset()


@pytest.fixture(autouse=True)
def _leaves_nothing(_module_state, tmp_path_factory):
    """Fail the test that leaves a FUSE mount, a FanStore process, a runtime directory or
    an index copy behind (each is cleaned up and named)."""
    from isolation import Snapshot, leftovers

    base = str(tmp_path_factory.getbasetemp().resolve())
    before = Snapshot.take(_module_state, base)
    yield
    left = leftovers(before, _module_state, base)
    if left:
        pytest.fail("the test left behind:\n  " + "\n  ".join(left), pytrace=False)


# --------------------------------------------------------------------------- trees and stores


def built_once(tmp_path_factory, name: str, build):
    """``build(directory)`` once per test run, whatever the number of xdist workers: the
    first worker to ask builds into ``shared-NAME`` under the run's temporary root (its
    workers share that root; another run has its own), under a lock; the others wait and
    reuse it. ``build`` returns a value of literals (str, bytes, int, lists, dicts), kept
    beside the directory as its repr. A failed build is removed and raises again."""
    import ast
    import fcntl
    import shutil

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # .../pytest-N/popen-gwK -> .../pytest-N
    where, record = root / f"shared-{name}", root / f"shared-{name}.repr"
    with open(root / f"shared-{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if record.exists():
            return ast.literal_eval(record.read_text())
        shutil.rmtree(where, ignore_errors=True)
        where.mkdir()
        try:
            value = build(where)
        except BaseException:
            shutil.rmtree(where, ignore_errors=True)
            raise
        record.write_text(repr(value))
        return value


@pytest.fixture(scope="session")
def special_tree(tmp_path_factory) -> dict:
    """The special source tree (built once per run, shared by the xdist workers); see
    ``make_special_tree``.

    Read-only for tests: never modify it (other tests compare against it).
    """
    return built_once(tmp_path_factory, "special-tree",
                      lambda where: make_special_tree(where / "src"))


@pytest.fixture(scope="session")
def special_pack(special_tree, tmp_path_factory):
    """(store path, completed ``fanstore pack`` process): ``special_tree`` packed once per
    run with ``SPECIAL_PACK_ARGS``. Read-only."""
    import subprocess

    def pack(where: Path) -> dict:
        proc = run_cli("pack", special_tree["root"], where / "store", *SPECIAL_PACK_ARGS,
                       check=True, timeout=300)
        return {"dest": str(where / "store"), "args": [str(a) for a in proc.args],
                "stdout": proc.stdout, "stderr": proc.stderr}

    got = built_once(tmp_path_factory, "special-store", pack)
    return Path(got["dest"]), subprocess.CompletedProcess(got["args"], 0, got["stdout"],
                                                          got["stderr"])


@pytest.fixture(scope="session")
def special_store(special_pack) -> Path:
    """Path of the packed special tree (see ``special_pack``). Read-only: copy it before
    damaging it."""
    return special_pack[0]


@pytest.fixture(scope="session")
def small_tree(tmp_path_factory) -> tuple[Path, dict[str, bytes]]:
    """(root, {relpath: bytes}) of a tiny tree with a symlink ``link -> sub/c.txt``."""
    root = tmp_path_factory.mktemp("small") / "src"
    return root, make_small_tree(root)


@pytest.fixture(scope="session")
def small_store(small_tree, tmp_path_factory) -> Path:
    """``small_tree`` packed with 4 KiB chunks into 2 partitions. Read-only: copy it
    (``shutil.copytree``) before damaging it."""
    dest = tmp_path_factory.mktemp("small-store") / "store"
    run_cli("pack", small_tree[0], dest, "--partitions", "2", "--chunk-kb", "4", "--jobs", "1",
            "--codec", "zstd:3", "--no-progress", check=True)  # pinned: tests compare bytes
    return dest


# --------------------------------------------------------------------------- S3


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """A real S3 endpoint (moto's server mode) on 127.0.0.1 for the whole session; see
    ``s3_helpers.MotoServer``. Skips when moto[server] or s3fs is missing. Stopped (and
    continued first, should a test have paused it) at session end."""
    from s3_helpers import MotoServer, moto_available

    ok, why = moto_available()
    if not ok:
        pytest.skip(why)
    server = MotoServer.start(tmp_path_factory.mktemp("moto"))
    try:
        yield server
    finally:
        server.stop()


# --------------------------------------------------------------------------- mounts

#: The FUSE frontends (``fanstore mount --frontend``) a test that uses ``frontend`` runs on,
#: unless its module (``FUSE_FRONTENDS = (...)``) or the test (``@pytest.mark.frontends(...)``)
#: names fewer: a test of the daemon, MPI or staging runs on the default frontend alone,
#: a test of what a mount answers on both (docs/reliability.md, "How it is tested").
FRONTENDS = ("pyfuse3", "kernel")


def pytest_generate_tests(metafunc):
    """Parametrize ``frontend`` (module scope) with the test's frontends."""
    if "frontend" not in metafunc.fixturenames:
        return
    marker = metafunc.definition.get_closest_marker("frontends")
    names = (marker.args if marker else getattr(metafunc.module, "FUSE_FRONTENDS", FRONTENDS))
    metafunc.parametrize("frontend", list(names), indirect=True, scope="module")


@pytest.fixture(scope="module")
def frontend(request):
    """Run the module's tests once per FUSE frontend (see ``pytest_generate_tests``): sets
    ``FANSTORE_FRONTEND`` (the default of ``fanstore mount --frontend``) for every command the
    tests start, MPI ranks and Slurm jobs included. Module-scoped fixtures that mount must
    depend on this one."""
    old = os.environ.get("FANSTORE_FRONTEND")
    os.environ["FANSTORE_FRONTEND"] = request.param
    try:
        yield request.param
    finally:
        if old is None:
            os.environ.pop("FANSTORE_FRONTEND", None)
        else:
            os.environ["FANSTORE_FRONTEND"] = old



class _Mounter:
    """Mount factory; every mount it made is cleaned up by ``close``."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.mounts: list[tuple[Path, int | None]] = []

    def __call__(self, store, *extra, mnt=None) -> Path:
        """Mount ``store`` at ``mnt`` (default: a fresh directory) with ``fanstore mount
        STORE MNT *extra`` (background mode); return the mount point once it is ready."""
        if mnt is None:
            mnt = self.tmp / f"mnt{len(self.mounts)}"
        mnt = Path(mnt)
        self.mounts.append((mnt, None))
        pid = mount_store(store, mnt, *extra)
        self.mounts[-1] = (mnt, pid)
        return mnt

    def close(self) -> None:
        for mnt, pid in reversed(self.mounts):
            cleanup_mount(mnt, pid)
        self.mounts.clear()


@pytest.fixture
def mounted(tmp_path):
    """Factory: ``mnt = mounted(store, *extra_args, mnt=None)``. Function scope; teardown
    runs ``fanstore umount``, then ``fusermount3 -u -z`` and kills the daemon if needed."""
    m = _Mounter(tmp_path)
    try:
        yield m
    finally:
        m.close()


@pytest.fixture(scope="module")
def module_mounted(tmp_path_factory):
    """Like ``mounted`` but the mounts live until the end of the module."""
    m = _Mounter(tmp_path_factory.mktemp("mnt"))
    try:
        yield m
    finally:
        m.close()


# --------------------------------------------------------------------------- safety net


def _daemon_pids_under(base: str) -> list[int]:
    """FanStore mounts' processes whose command line names a path under ``base``."""
    under = os.fsencode(base) + b"/"
    return find_processes(lambda p: any(a.endswith(b"fanstore") for a in p.argv[:2])
                          and b"mount" in p.argv and any(a.startswith(under) for a in p.argv))


@pytest.fixture(scope="session")
def other_user():
    """A second unprivileged user of this machine (see ``second_user.py``)."""
    from second_user import other_user as make

    user, why = make()
    if user is None:
        pytest.skip(f"no second user: {why}")
    return user


@pytest.fixture(scope="session", autouse=True)
def _fanstore_safety_net(tmp_path_factory):
    """At session end: lazily unmount every FUSE mount under the pytest temp root and kill
    every daemon the tests started (or whose command line names a path under it)."""
    yield
    from fanstore import mounttable

    # Only this session's own temp root: other sessions may run concurrently.
    base = str(tmp_path_factory.getbasetemp().resolve())
    for mnt in list(mounttable.fuse_mounts()):
        if mnt.startswith(base + "/"):
            lazy_unmount(mnt)
    for pid in set(DAEMON_PIDS) | set(_daemon_pids_under(base)):
        if pid_alive(pid):
            kill_pid(pid, timeout=2)
    for mnt in list(mounttable.fuse_mounts()):  # a killed daemon may leave a stale mount
        if mnt.startswith(base + "/"):
            lazy_unmount(mnt)


_SESSION_START = time.time()


def pytest_sessionfinish(session, exitstatus):
    """Once every test process is done (the controller of an xdist run, or the one
    process): MPI's orphaned shared-memory segments of this session. Not from a worker, which
    could catch the other's job between creating a segment and mapping it."""
    if not hasattr(session.config, "workerinput"):
        _remove_orphaned_mpi_shm(_SESSION_START)


def _remove_orphaned_mpi_shm(since: float) -> None:
    """MPICH's shared-memory segments of ranks that were killed (the fault tests SIGKILL
    ranks; MPICH unlinks them only in MPI_Finalize): those made during this session that
    no live process maps. About 1 MB each, in RAM; dozens a run otherwise."""
    shm = "/dev/shm"
    try:
        names = [n for n in os.listdir(shm) if n.startswith(("mpich_shm_", "ucx_shm_"))]
    except OSError:
        return
    if not names:
        return
    mapped = {os.path.basename(path) for pid in os.listdir("/proc") if pid.isdigit()
              for path in shm_mapped(int(pid))}
    for name in names:
        path = os.path.join(shm, name)
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if st.st_mtime >= since and st.st_uid == os.geteuid() and name not in mapped:
            try:
                os.unlink(path)
            except OSError:
                pass
