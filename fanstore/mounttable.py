"""The kernel's mount table as FanStore needs it: which FUSE mounts exist, whether one still
answers, unmounting, and checking a mount point before mounting on it.
"""

from __future__ import annotations

import errno
import os
import subprocess

from fanstore import runtime
from fanstore.errors import MountError
from fanstore.process import pid_alive


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


def mounts() -> dict[str, str]:
    """Mount point -> fs type for every mount visible to this process."""
    out = {}
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                left, _, right = line.partition(" - ")
                out[_unescape(left.split(" ")[4])] = right.split(" ", 1)[0]
    except OSError:
        pass
    return out


def fuse_mounts() -> dict[str, str]:
    """Mount point -> fs type for every FUSE mount visible to this process."""
    return {m: t for m, t in mounts().items() if t.startswith("fuse")}


def mount_status(mountpoint: str) -> str:
    """``"none"``, ``"live"`` (a FUSE mount that answers) or ``"stale"`` (its daemon is gone).

    Probes with ``statvfs``: the kernel answers ``stat`` from its attribute cache even after
    the daemon died, but always asks the daemon for ``statfs`` (ENOTCONN when it is gone).
    """
    mounts = fuse_mounts()
    listed = runtime.mount_key(mountpoint) in mounts or os.path.abspath(mountpoint) in mounts
    if not listed:
        return "none"
    try:
        os.statvfs(mountpoint)
    except OSError as exc:
        if exc.errno in (errno.ENOTCONN, errno.ECONNABORTED, errno.EIO, errno.ENOENT):
            return "stale"
        raise
    return "live"


def unmount_command(mountpoint: str, lazy: bool = False,
                    tool: str = "fusermount3") -> list[str]:
    """The argv that unmounts ``mountpoint`` with ``tool`` (fusermount3 or umount): the
    path always after ``--``, so a mount point named like an option ("-z", "--help") is
    never taken for one."""
    if tool == "umount":
        return ["umount"] + (["-l"] if lazy else []) + ["--", mountpoint]
    return [tool, "-u"] + (["-z"] if lazy else []) + ["--", mountpoint]


def fusermount_unmount(mountpoint: str, lazy: bool = False) -> tuple[bool, str]:
    try:
        res = subprocess.run(unmount_command(mountpoint, lazy), capture_output=True, text=True,
                             timeout=60)
    except FileNotFoundError:
        res = subprocess.run(unmount_command(mountpoint, lazy, "umount"), capture_output=True,
                             text=True, timeout=60)
    return res.returncode == 0, (res.stderr or res.stdout).strip()


def prepare_mountpoint(mountpoint: str) -> str | None:
    """Refuse bad mount points; clean a stale mount left by a crashed daemon.

    Returns a notice for the user when a stale mount was cleaned (the caller shows it),
    else None. Raises MountError for a live mount, a missing or non-directory mount point.
    """
    notice = None
    status = mount_status(mountpoint)
    if status == "stale":
        notice = f"{mountpoint}: cleaning up a stale mount left by a crashed daemon"
        ok, msg = fusermount_unmount(mountpoint, lazy=True)
        if not ok and mount_status(mountpoint) != "none":
            raise MountError(f"{mountpoint}: cannot clean up the stale mount: {msg}")
    elif status == "live":
        state = runtime.read_state(mountpoint) or {}
        pid = state.get("pid")
        if pid_alive(pid):
            raise MountError(f"{mountpoint} is already mounted by FanStore (daemon pid {pid})")
        raise MountError(f"{mountpoint} is already a mount point; unmount it first")
    if not os.path.exists(mountpoint):
        raise MountError(f"mount point {mountpoint} does not exist")
    if not os.path.isdir(mountpoint):
        raise MountError(f"mount point {mountpoint} is not a directory")
    return notice
