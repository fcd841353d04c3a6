"""Per-mount runtime state shared by a daemon and the commands that talk to it.

Each mount point has a runtime directory (``$FANSTORE_RUNTIME_DIR`` or
``/tmp/fanstore-<uid>``, then a hash of the mount point's real path) holding:

- ``state.json``: pid, mount point, rank, phase (``starting``, ``mounting``, ``ready``,
  ``draining``, ``stopped``, ``failed``) and, on failure, the error; written atomically.
- ``ctl.sock``: the daemon's control socket (:mod:`fanstore.control`).
- ``daemon.log``: the log of a daemon that runs in the background.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from typing import Any


def runtime_root() -> str:
    return os.environ.get("FANSTORE_RUNTIME_DIR") or f"/tmp/fanstore-{os.getuid()}"


def mount_key(mountpoint: str) -> str:
    """Canonical path of a mount point, computed without touching the mount point itself
    (a daemon that stats its own mount before serving it would deadlock)."""
    absolute = os.path.abspath(mountpoint)
    return os.path.join(os.path.realpath(os.path.dirname(absolute)), os.path.basename(absolute))


def runtime_dir(mountpoint: str, create: bool = False) -> str:
    real = mount_key(mountpoint)
    h = hashlib.sha1(real.encode("utf-8", "surrogateescape")).hexdigest()[:16]
    path = os.path.join(runtime_root(), h)
    if create:
        os.makedirs(path, mode=0o700, exist_ok=True)
    return path


def state_path(mountpoint: str) -> str:
    return os.path.join(runtime_dir(mountpoint), "state.json")


def socket_path(mountpoint: str) -> str:
    return os.path.join(runtime_dir(mountpoint), "ctl.sock")


def log_path(mountpoint: str) -> str:
    return os.path.join(runtime_dir(mountpoint), "daemon.log")


def write_state(mnt: str, /, **fields: Any) -> None:
    path = state_path(mnt)
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    current = read_state(mnt) or {}
    if fields.get("pid") not in (None, current.get("pid")):
        current = {}
    current.update(fields)
    current["updated"] = time.time()
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(current, f)
    os.replace(tmp, path)


def read_state(mountpoint: str) -> dict[str, Any] | None:
    try:
        with open(state_path(mountpoint)) as f:
            return json.load(f)
    except (FileNotFoundError, ValueError):
        return None


def write_file(path: str, data) -> None:
    """Write ``data`` to ``path`` atomically (a temp file renamed over it)."""
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def shared_memory_path(mountpoint: str, name: str) -> str:
    """A path for a file the processes of a node share in memory: in ``/dev/shm`` (tmpfs:
    its pages are never dropped from memory the way page-cache pages of a disk file are,
    e.g. by ``drop_caches`` or memory pressure) when it is usable, else in the runtime
    directory."""
    shm = os.environ.get("FANSTORE_SHM_DIR", "/dev/shm")
    key = os.path.basename(runtime_dir(mountpoint))
    if os.path.isdir(shm) and os.access(shm, os.W_OK | os.X_OK):
        return os.path.join(shm, f"fanstore-{os.getuid()}-{key}-{name}")
    return os.path.join(runtime_dir(mountpoint, create=True), name)
