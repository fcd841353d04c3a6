"""A second, unprivileged local user for the multi-user attack tests.

Shared nodes have other accounts beside every mount (docs/reliability.md, "Multi-user
nodes"). These helpers create one such account and run commands as it, the way another
user of the node would attack a FanStore mount:

- :func:`other_user` makes (once) the system user ``fanstore-other`` with ``useradd``, or
  returns None with the reason it cannot (not root, no ``useradd``).
- :meth:`OtherUser.run` runs a command as that user, with a clean environment, no
  supplementary groups and the working directory ``/``.
- :meth:`OtherUser.python` runs a snippet with the system's ``/usr/bin/python3`` (stdlib
  only, always reachable): enough to connect to sockets, open files and plant links.
- :func:`reachable_for_others` makes a path traversable by other users for the length of
  a ``with`` block (``o+x`` on each directory up to it), and restores every mode after:
  the venv's interpreter may sit under a 0700 home, the test's files under a 0700
  pytest directory.
- :func:`shared_test_dir` is a fresh 0755 directory under /tmp that the other user can
  reach (pytest's own temporary directories are 0700 and would stop every attack before
  FanStore's own defences are reached, proving nothing).

The modes :func:`reachable_for_others` and :func:`fuse_device_for_all` change are the
machine's, not a test's: while one test process holds them changed, another (``make test``
runs several) waits for a lock instead of changing and restoring them under its feet.

The tests run as root (CI does); everything here is undone in ``finally`` blocks.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import pwd
import shutil
import stat
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from typing import Iterator, Sequence

NAME = "fanstore-other"
SYSTEM_PYTHON = "/usr/bin/python3"


@dataclass(frozen=True)
class OtherUser:
    name: str
    uid: int
    gid: int

    def env(self, **extra: str) -> dict[str, str]:
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/", "LANG": "C.UTF-8",
               "USER": self.name, "LOGNAME": self.name}
        env.update(extra)
        return env

    def run(self, cmd: Sequence[str], timeout: float = 60, env: dict[str, str] | None = None,
            input: bytes | str | None = None, text: bool = True,
            check: bool = False) -> subprocess.CompletedProcess:
        """Run ``cmd`` as this user (stdout/stderr captured)."""
        return subprocess.run(
            [str(c) for c in cmd], user=self.uid, group=self.gid, extra_groups=[],
            env=env if env is not None else self.env(), cwd="/", capture_output=True,
            timeout=timeout, input=input, text=text, check=check)

    def popen(self, cmd: Sequence[str], env: dict[str, str] | None = None,
              **kwargs) -> subprocess.Popen:
        return subprocess.Popen(
            [str(c) for c in cmd], user=self.uid, group=self.gid, extra_groups=[],
            env=env if env is not None else self.env(), cwd="/", **kwargs)

    def python(self, code: str, *args: str, timeout: float = 60,
               env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        """Run ``code`` with the system interpreter as this user."""
        return self.run([SYSTEM_PYTHON, "-c", code, *args], timeout=timeout, env=env)


def other_user(name: str = NAME) -> tuple[OtherUser | None, str]:
    """The second user (or another called ``name``), created if missing; (None, why) when
    that is impossible here."""
    if os.geteuid() != 0:
        return None, "creating a second user needs root"
    if not os.path.exists(SYSTEM_PYTHON):
        return None, f"{SYSTEM_PYTHON} is missing"
    try:
        pw = pwd.getpwnam(name)
    except KeyError:
        exe = shutil.which("useradd") or "/usr/sbin/useradd"
        if not os.path.exists(exe):
            return None, "useradd is not installed"
        proc = subprocess.run([exe, "--system", "--no-create-home", "--home-dir", "/",
                               "--shell", "/usr/sbin/nologin", name],
                              capture_output=True, text=True)
        if proc.returncode not in (0, 9):  # 9: created meanwhile by another test process
            return None, f"useradd failed: {proc.stderr.strip()}"
        pw = pwd.getpwnam(name)
    if pw.pw_uid == 0:
        return None, f"{name} has uid 0"
    return OtherUser(name, pw.pw_uid, pw.pw_gid), ""


#: one holder of machine-wide mode changes at a time, across test processes (root's /run)
_LOCK_PATH = "/run/fanstore-tests-modes.lock"
_lock_depth = 0
_lock_fd = -1


@contextlib.contextmanager
def _machine_modes() -> Iterator[None]:
    """Hold the machine-wide lock for the block (re-entrant within a process: the helpers
    nest)."""
    global _lock_depth, _lock_fd
    if _lock_depth == 0:
        fd = os.open(_LOCK_PATH, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX)
        _lock_fd = fd
    _lock_depth += 1
    try:
        yield
    finally:
        _lock_depth -= 1
        if _lock_depth == 0:
            os.close(_lock_fd)  # releases the lock
            _lock_fd = -1


@contextlib.contextmanager
def reachable_for_others(*paths) -> Iterator[None]:
    """Add ``o+x`` to every directory from / down to each of ``paths`` (and ``o+r`` to a
    file named), restoring every mode changed when the block ends."""
    with _machine_modes():
        yield from _reachable(paths)


def _reachable(paths) -> Iterator[None]:
    changed: list[tuple[str, int]] = []
    try:
        for path in paths:
            real = os.path.realpath(path)
            parts = real.split(os.sep)
            for i in range(2, len(parts) + 1):
                p = os.sep.join(parts[:i]) or os.sep
                st = os.stat(p)
                want = st.st_mode
                if stat.S_ISDIR(st.st_mode):
                    want |= stat.S_IXOTH
                elif p == real:
                    want |= stat.S_IROTH | (stat.S_IXOTH if st.st_mode & stat.S_IXUSR else 0)
                if want != st.st_mode:
                    changed.append((p, stat.S_IMODE(st.st_mode)))
                    os.chmod(p, stat.S_IMODE(want))
        yield
    finally:
        for p, mode in reversed(changed):
            with contextlib.suppress(OSError):
                os.chmod(p, mode)


@contextlib.contextmanager
def fuse_device_for_all() -> Iterator[None]:
    """/dev/fuse 0666 as stock distributions ship it (this machine has 0600)."""
    with _machine_modes():
        st = os.stat("/dev/fuse")
        old = stat.S_IMODE(st.st_mode)
        os.chmod("/dev/fuse", 0o666)
        try:
            yield
        finally:
            os.chmod("/dev/fuse", old)


@contextlib.contextmanager
def shared_test_dir(prefix: str = "fanstore-mu-") -> Iterator[str]:
    """A fresh directory under /tmp, mode 0755 (reachable by the other user), removed
    after the block."""
    path = tempfile.mkdtemp(prefix=prefix, dir="/tmp")
    os.chmod(path, 0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def venv_python() -> str:
    """This test run's interpreter (the venv's), for running FanStore as the other user
    inside :func:`reachable_for_others` of it and of the source tree."""
    return sys.executable
