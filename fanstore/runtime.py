"""Per-mount runtime state shared by a daemon and the commands that talk to it.

Each mount point has a runtime directory (``$FANSTORE_RUNTIME_DIR`` or
``/tmp/fanstore-<uid>``, then a hash of the mount point's real path) holding:

- ``state.json``: pid, mount point, store, rank, phase (``starting``/``ready``/``stopping``)
  and, on failure, the error; written atomically.
- ``ctl.sock``: the daemon's control socket (JSON lines; see docs/architecture.md).
- ``daemon.log``: the log of a daemon that runs in the background.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import socket
import subprocess
import time
from typing import Any

from fanstore.errors import MountError


#: glibc's mallopt() parameter number for M_ARENA_MAX (malloc.h).
_M_ARENA_MAX = -8


def limit_malloc_arenas(arenas: int = 2) -> bool:
    """Bound glibc's malloc arenas for a daemon; call before any thread starts.

    glibc gives each allocating thread its own arena (up to 8 per core) and keeps freed
    memory in it, so a daemon with a few dozen decode and fetch threads grew from 53 MB to
    300 MB under load while holding a 16 MB cache (docs/reliability.md). Two arenas keep it
    flat at no measurable cost. ``MALLOC_ARENA_MAX`` in the environment wins; other C
    libraries are left alone. Returns whether the limit was set.
    """
    if "MALLOC_ARENA_MAX" in os.environ:
        return False
    try:
        import ctypes

        libc = ctypes.CDLL(None)
        return bool(libc.mallopt(_M_ARENA_MAX, int(arenas)))
    except (OSError, AttributeError):  # not glibc
        return False


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


def pid_alive(pid: int | None) -> bool:
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie is not alive for our purposes.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


# ------------------------------------------------------------------ mount table


def _unescape(field: str) -> str:
    # /proc/self/mountinfo escapes space, tab, newline and backslash as \ooo.
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and i + 3 < len(field) + 0 and field[i + 1 : i + 4].isdigit():
            out.append(chr(int(field[i + 1 : i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def fuse_mounts() -> dict[str, str]:
    """Mount point -> fs type for every FUSE mount visible to this process."""
    out = {}
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                left, _, right = line.partition(" - ")
                fstype = right.split(" ", 1)[0]
                if fstype.startswith("fuse"):
                    out[_unescape(left.split(" ")[4])] = fstype
    except OSError:
        pass
    return out


def mount_status(mountpoint: str) -> str:
    """``"none"``, ``"live"`` (a FUSE mount that answers) or ``"stale"`` (its daemon is gone).

    Probes with ``statvfs``: the kernel answers ``stat`` from its attribute cache even after
    the daemon died, but always asks the daemon for ``statfs`` (ENOTCONN when it is gone).
    """
    mounts = fuse_mounts()
    listed = mount_key(mountpoint) in mounts or os.path.abspath(mountpoint) in mounts
    if not listed:
        return "none"
    try:
        os.statvfs(mountpoint)
    except OSError as exc:
        if exc.errno in (errno.ENOTCONN, errno.ECONNABORTED, errno.EIO, errno.ENOENT):
            return "stale"
        raise
    return "live"


def fusermount_unmount(mountpoint: str, lazy: bool = False) -> tuple[bool, str]:
    cmd = ["fusermount3", "-u"] + (["-z"] if lazy else []) + [mountpoint]
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    except FileNotFoundError:
        cmd[0] = "umount"
        if lazy:
            cmd = ["umount", "-l", mountpoint]
        else:
            cmd = ["umount", mountpoint]
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    return res.returncode == 0, (res.stderr or res.stdout).strip()


# ------------------------------------------------------------------ control socket


def control(mountpoint: str, request: dict[str, Any], timeout: float = 10.0) -> dict[str, Any]:
    """Send one JSON request to the daemon serving ``mountpoint``; return its JSON reply."""
    path = socket_path(mountpoint)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    try:
        try:
            s.connect(path)
        except (FileNotFoundError, ConnectionRefusedError):
            raise MountError(f"{mountpoint}: no FanStore daemon serves this mount point") from None
        s.sendall(json.dumps(request).encode() + b"\n")
        buf = bytearray()
        while not buf.endswith(b"\n"):
            chunk = s.recv(65536)
            if not chunk:
                break
            buf += chunk
    except socket.timeout:
        raise MountError(f"{mountpoint}: the daemon did not answer within {timeout:g} s") from None
    except OSError as exc:
        raise MountError(f"{mountpoint}: cannot talk to the daemon: {exc.strerror}") from exc
    finally:
        s.close()
    try:
        reply = json.loads(buf.decode())
    except ValueError:
        raise MountError(f"{mountpoint}: the daemon sent a malformed reply") from None
    if "error" in reply:
        raise MountError(f"{mountpoint}: {reply['error']}")
    return reply
