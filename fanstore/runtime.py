"""A mount's private runtime state: one directory per user, checked, and what lives in it.

Layout (docs/architecture.md, "Runtime state"; docs/reliability.md, "Multi-user nodes")::

    <root>                 $FANSTORE_RUNTIME_DIR, else $XDG_RUNTIME_DIR/fanstore, else
                           /tmp/fanstore-<uid>; mode 0700, owned by this uid
    <root>/<key>/          one per mount point (key: 16 hex digits of SHA-1 of the mount
                           point's real path), mode 0700
        state.json         pid, mount point, rank, phase (``starting``, ``mounting``,
                           ``ready``, ``draining``, ``stopped``, ``failed``), the error, the
                           index copy's path; replaced atomically
        ctl.sock           the daemon's control socket (:mod:`fanstore.control`)
        daemon.log         the log of a daemon that runs in the background (0600)
        counters           the kernel frontend's per-worker counters (0600)
    /dev/shm/fanstore-<uid>-<pid>-<random>.idx
                           the node's decompressed index copy (0600, created exclusively
                           under a random name; found through state.json and the daemon's
                           ``info`` reply, never by guessing a name)

:class:`MountRuntime` is the one place that derives, creates and checks these paths. The
composition root (:func:`fanstore.launch.mount`) or the node makes it once with
:meth:`MountRuntime.create` and hands it down; commands that talk to a running mount find
it with :meth:`MountRuntime.find`. Both refuse a root or a mount directory that is not a
real directory owned by this uid with no group/other bits (another user may have made it
first, or planted a symlink): :class:`~fanstore.errors.UnsafePathError`, one line. Every
file is created ``O_EXCL|O_NOFOLLOW`` or written to a fresh temporary name and renamed
(:mod:`fanstore.safeio`), so nothing here follows a symlink.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import re
import secrets
import stat
import time
from typing import Any

from fanstore import safeio, settings
from fanstore.errors import FanStoreError, MountError, UnsafePathError

log = logging.getLogger(__name__)

#: Where the node's shared-memory files go when it is usable (tmpfs: its pages are never
#: dropped the way page-cache pages of a disk file are, e.g. by drop_caches);
#: $FANSTORE_SHM_DIR (fanstore.settings) names another.
SHM_DIR = settings.SHM_DIR


def candidate_roots() -> list[str]:
    """Runtime roots in the order they are tried: an explicit ``$FANSTORE_RUNTIME_DIR``
    alone; else ``$XDG_RUNTIME_DIR/fanstore`` (when set) and ``/tmp/fanstore-<uid>``.
    A daemon uses the first; a command looking for a mount tries each (a login shell
    may have XDG_RUNTIME_DIR where a Slurm step has none)."""
    env = settings.current()
    if env.runtime_dir:
        return [env.runtime_dir]
    roots = []
    if env.xdg_runtime_dir:
        roots.append(os.path.join(env.xdg_runtime_dir, "fanstore"))
    roots.append(f"/tmp/fanstore-{os.geteuid()}")
    return roots


def runtime_root() -> str:
    """The runtime root a daemon started now would use (not created or checked)."""
    return candidate_roots()[0]


def mount_key(mountpoint: str) -> str:
    """Canonical path of a mount point, computed without touching the mount point itself
    (a daemon that stats its own mount before serving it would deadlock)."""
    absolute = os.path.abspath(mountpoint)
    return os.path.join(os.path.realpath(os.path.dirname(absolute)), os.path.basename(absolute))


def _key(mountpoint: str) -> str:
    real = mount_key(mountpoint)
    return hashlib.sha1(real.encode("utf-8", "surrogateescape")).hexdigest()[:16]


class MountRuntime:
    """The private runtime directory of one mount point and the files in it.

    Attributes: ``mountpoint`` (its canonical path), ``root`` (this user's runtime root),
    ``path`` (the mount's directory), and the paths of the files listed in the module
    docstring.
    """

    def __init__(self, mountpoint: str, root: str) -> None:
        self.mountpoint = mount_key(mountpoint)
        self.root = root
        self.path = os.path.join(root, _key(mountpoint))
        self.state_path = os.path.join(self.path, "state.json")
        self.socket_path = os.path.join(self.path, "ctl.sock")
        self.log_path = os.path.join(self.path, "daemon.log")
        self.counters_path = os.path.join(self.path, "counters")

    def __repr__(self) -> str:
        return f"MountRuntime({self.mountpoint!r}, {self.path!r})"

    # ------------------------------------------------------------------ finding
    @classmethod
    def create(cls, mountpoint: str) -> MountRuntime:
        """The runtime of ``mountpoint`` for a daemon: root and mount directory created
        (0700) and checked. UnsafePathError if either is not private to this uid."""
        self = cls(mountpoint, runtime_root())
        self._check(create=True)
        return self

    @classmethod
    def find(cls, mountpoint: str) -> MountRuntime | None:
        """The runtime of ``mountpoint`` if a daemon made one (checked, never created), or
        None. UnsafePathError when what is there is not private to this uid."""
        for root in candidate_roots():
            self = cls(mountpoint, root)
            try:
                os.lstat(self.path)
            except OSError:
                continue
            self._check(create=False)
            return self
        return None

    def _check(self, create: bool) -> None:
        """The root's parents trusted, the root and the mount's directory private (made
        0700 with ``create``). The parents too: a root inside a directory another user
        may write (an $XDG_RUNTIME_DIR or $FANSTORE_RUNTIME_DIR there) could be renamed
        away and replaced by a symlink to theirs after our check."""
        safeio.trusted_path(os.path.dirname(self.root), what="runtime directory's parent")
        safeio.private_dir(self.root, create=create, what="runtime directory")
        safeio.private_dir(self.path, create=create, what="runtime directory")

    # ------------------------------------------------------------------ state
    def write_state(self, **fields: Any) -> None:
        """Update state.json (a new pid starts a fresh state), atomically."""
        current = self.read_state() or {}
        if fields.get("pid") not in (None, current.get("pid")):
            current = {}
        current.update(fields)
        current["updated"] = time.time()
        safeio.atomic_write(self.state_path, json.dumps(current).encode())

    def read_state(self) -> dict[str, Any] | None:
        return _read_state_file(self.state_path)

    def open_log(self, path: str | None = None) -> int:
        """An fd to append the daemon's log to (this runtime's daemon.log, or ``path``):
        created 0600, never through a symlink."""
        path = path or self.log_path
        flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            return os.open(path, flags, 0o600)
        except OSError as exc:
            raise UnsafePathError(f"cannot open the log file {path}: {exc.strerror}") from None

    def new_counters_file(self) -> str:
        """A fresh path for the kernel frontend's counters (any old file removed first:
        the frontend creates it exclusively)."""
        _unlink(self.counters_path)
        return self.counters_path

    def remove(self) -> bool:
        """Remove this mount's directory and what is in it, at the end of a daemon that
        ended cleanly. Not when its state is another live process's (a new daemon of the
        same mount point took it over). Returns whether it is gone."""
        state = self.read_state()
        if state is not None and state.get("pid") not in (None, os.getpid()):
            return False
        return _remove_mount_dir(self.path)

    # ------------------------------------------------------------------ shared memory
    def create_shared(self, data_parts: list[bytes], suffix: str = "idx") -> str:
        """A new file only this uid can read, holding ``data_parts``, for the processes of
        this node to map: in /dev/shm when it is usable and has room, else in the mount's
        directory (a full /dev/shm, which other jobs of the node may have filled, costs
        one log line, not the mount). Created exclusively under a random name that
        carries the daemon's pid (so a later mount can remove what a killed daemon left:
        :func:`sweep_shared`); a file that could not be written whole is removed."""
        need = sum(len(p) for p in data_parts)
        shm = _shm_dir()
        if shm is not None:
            try:
                return _write_private(shm, data_parts, suffix)
            except OSError as exc:
                if exc.errno not in _FULL:
                    raise MountError(f"cannot write the node's index copy ({need:,} bytes) "
                                     f"to {shm}: {exc.strerror or exc}") from None
                log.warning("%s has no room for the node's index copy (%s bytes: %s); it "
                            "goes to the runtime directory %s", shm, f"{need:,}",
                            exc.strerror, self.path)
        try:
            return _write_private(self.path, data_parts, suffix)
        except OSError as exc:
            raise MountError(f"cannot write the node's index copy ({need:,} bytes) to "
                             f"{self.path}: {exc.strerror or exc}") from None


#: What a full file system says: no space, no quota left, a file above the size limit.
_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def _write_private(base: str, data_parts: list[bytes], suffix: str) -> str:
    """``data_parts`` in a new file of ``base`` only this uid can read (see
    :meth:`RuntimeDir.create_shared`); OSError when it cannot be written whole (the file is
    then gone)."""
    for _ in range(16):
        path = os.path.join(base, f"fanstore-{os.geteuid()}-{os.getpid()}-"
                                  f"{secrets.token_hex(8)}.{suffix}")
        try:
            fd = safeio.create_excl(path, 0o600)
            break
        except FileExistsError:
            continue
    else:
        raise UnsafePathError(f"cannot create a private file in {base}")
    try:
        with open(fd, "wb", closefd=True) as f:
            for part in data_parts:
                f.write(part)
    except BaseException:
        _unlink(path)
        raise
    return path


def _read_state_file(path: str) -> dict[str, Any] | None:
    """A state.json of this uid (never through a symlink), or None."""
    try:
        fd = safeio.open_nofollow(path, owner=os.geteuid(), what="state file")
    except (OSError, FanStoreError):
        return None
    try:
        with open(fd, "rb", closefd=True) as f:
            state = json.loads(f.read(1 << 20))
    except (OSError, ValueError):
        return None
    return state if isinstance(state, dict) else None


def _shm_dir() -> str | None:
    """SHM_DIR if it is a real directory that is either sticky or writable only by its
    owner (root or us), and we may create files in it; else None."""
    shm = settings.current().shm_dir
    try:
        st = os.lstat(shm)
    except OSError:
        return None
    if not stat.S_ISDIR(st.st_mode) or st.st_uid not in (0, os.geteuid()):
        return None
    if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
        return None
    return shm if os.access(shm, os.W_OK | os.X_OK) else None


_SHARED_NAME = re.compile(r"fanstore-(\d+)-(\d+)-[0-9a-f]{16}\.\w+\Z")


def sweep_shared(keep: set[str] | None = None) -> list[str]:
    """Remove this uid's shared-memory files whose daemon is gone (SIGKILLed daemons leave
    them behind); returns the paths removed. Only regular files owned by this uid with our
    naming pattern are touched, never through a symlink. A pid in a name that a process
    started after the file was written is not its daemon (pids are reused)."""
    shm = _shm_dir()
    if shm is None:
        return []
    uid = os.geteuid()
    removed = []
    try:
        names = os.listdir(shm)
    except OSError:
        return []
    for name in names:
        m = _SHARED_NAME.match(name)
        if m is None or int(m.group(1)) != uid:
            continue
        path = os.path.join(shm, name)
        if keep and path in keep:
            continue
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if _still_running({"pid": int(m.group(2)), "updated": st.st_mtime}):
            continue
        if stat.S_ISREG(st.st_mode) and st.st_uid == uid:
            _unlink(path)
            removed.append(path)
    return removed


_MOUNT_DIR_NAME = re.compile(r"[0-9a-f]{16}\Z")

#: A mount directory without a state file younger than this may be a daemon starting.
_STATELESS_GRACE = 600.0


def sweep_dead() -> list[str]:
    """What daemons of this uid that are gone left behind: their shared-memory files
    (:func:`sweep_shared`) and their mount directories under each runtime root (a daemon
    that failed keeps its state and log for ``fanstore wait`` and the user; a killed one
    could not remove them). Called by every mount and umount. Returns the paths removed."""
    removed = sweep_shared()
    for root in candidate_roots():
        removed += _sweep_mount_dirs(root)
    return removed


def remove_after_daemon(path: str, daemon_pid: int) -> bool:
    """Remove the mount directory ``path`` of a daemon that is gone (its kernel frontend
    outlived it: fanstore.fuse.kernelfs.process): only when its state still names
    ``daemon_pid`` and that daemon no longer runs (a new daemon of the same mount point
    may have taken the directory over). Returns whether it is gone."""
    state = _read_state_file(os.path.join(path, "state.json"))
    if state is not None and (state.get("pid") != daemon_pid or _still_running(state)):
        return False
    return _remove_mount_dir(path)


def _sweep_mount_dirs(root: str) -> list[str]:
    try:
        safeio.private_dir(root, create=False)
        names = os.listdir(root)
    except (OSError, FanStoreError):
        return []  # none, or not ours to touch
    removed = []
    for name in names:
        if not _MOUNT_DIR_NAME.match(name):
            continue
        path = os.path.join(root, name)
        state = _read_state_file(os.path.join(path, "state.json"))
        if state is None:
            try:
                young = time.time() - os.lstat(path).st_mtime < _STATELESS_GRACE
            except OSError:
                continue
            if young:
                continue
        elif _still_running(state):
            continue
        if _remove_mount_dir(path):
            removed.append(path)
    return removed


def _still_running(state: dict[str, Any]) -> bool:
    """Whether the daemon a state names is alive: its pid runs a process that started
    before the state was last written (a later one reuses a dead daemon's pid; btime's
    one-second resolution is allowed for)."""
    from fanstore.process import pid_alive, started_at

    pid = state.get("pid")
    if not isinstance(pid, int) or not pid_alive(pid):
        return False
    start, updated = started_at(pid), state.get("updated")
    if start is None or not isinstance(updated, (int, float)):
        return True  # cannot tell: leave it
    return start <= updated + 1.0


def _remove_mount_dir(path: str) -> bool:
    """Remove a mount directory of this uid and the files in it (never through a symlink:
    only a real directory we own; names in it are unlinked, not followed)."""
    try:
        st = os.lstat(path)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
            return False
        for name in os.listdir(path):
            full = os.path.join(path, name)
            if not stat.S_ISDIR(os.lstat(full).st_mode):
                _unlink(full)
        os.rmdir(path)
    except FileNotFoundError:
        return True
    except OSError:
        return False
    return True


def remove_shared(path: str | None) -> None:
    """Remove a shared file this process created (only ours: name pattern and owner)."""
    if not path or not _SHARED_NAME.match(os.path.basename(path)):
        return
    try:
        st = os.lstat(path)
    except OSError:
        return
    if stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid():
        _unlink(path)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


# --------------------------------------------------------------------------- commands


def read_state(mountpoint: str) -> dict[str, Any] | None:
    """The state of the daemon serving ``mountpoint``, or None (no runtime, unreadable)."""
    rt = MountRuntime.find(mountpoint)
    return rt.read_state() if rt is not None else None


def socket_path(mountpoint: str) -> str | None:
    """The control socket of ``mountpoint``'s daemon if it has a runtime, else None."""
    rt = MountRuntime.find(mountpoint)
    return rt.socket_path if rt is not None else None
