"""Mounting and unmounting a FUSE file system without libfuse.

Two ways to get a connected ``/dev/fuse`` descriptor for a mount point:

- **mount(2)** (needs CAP_SYS_ADMIN, i.e. root here): open ``/dev/fuse`` ourselves and pass
  its number to the kernel in the mount data (``fd=N,rootmode=...,user_id=...,group_id=...``).
- **fusermount3** (unprivileged, or when asked): the set-uid helper opens ``/dev/fuse``,
  mounts, and hands the descriptor back over a unix socket: we create a socketpair, give one
  end to the helper (its number in the environment variable ``_FUSE_COMMFD``), and receive
  the descriptor on the other end as SCM_RIGHTS ancillary data with a one-byte message.

Unmounting: ``umount2(2)`` as root (``MNT_DETACH`` for a lazy unmount), else
``fusermount3 -u [-z]``. :func:`cleanup_stale` lazily unmounts a mount whose daemon died
(``stat`` fails with ENOTCONN).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import logging
import os
import shutil
import socket
import stat
import subprocess
from dataclasses import dataclass

from fanstore.errors import MountError

log = logging.getLogger(__name__)

MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MS_NOEXEC = 8
MNT_FORCE = 1
MNT_DETACH = 2

FUSERMOUNT = "fusermount3"

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong,
                        ctypes.c_char_p]
_libc.mount.restype = ctypes.c_int
_libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
_libc.umount2.restype = ctypes.c_int


@dataclass
class MountOptions:
    """How to mount.

    Attributes
    ----------
    fsname : the "source" shown in /proc/mounts.
    subtype : shown as the type ``fuse.<subtype>``; empty for plain ``fuse``.
    read_only : mount with MS_RDONLY (the kernel then refuses writes itself, with EROFS).
    allow_other : let other users than the mounting one use the mount.
    use_fusermount : None = mount(2) when we are root, else fusermount3; True/False forces.
    max_read : the ``max_read`` mount option (0 = not given).
    """

    fsname: str = "kfuse"
    subtype: str = ""
    read_only: bool = True
    allow_other: bool = False
    use_fusermount: bool | None = None
    max_read: int = 0

    def via_fusermount(self) -> bool:
        if self.use_fusermount is None:
            return os.geteuid() != 0
        return self.use_fusermount


def _check_opt(value: str, what: str) -> str:
    if any(c in value for c in ",\\\0\n"):
        raise MountError(f"{what} {value!r} may not contain ',', '\\', NUL or newlines")
    return value


def _root_mode(mountpoint: str) -> int:
    try:
        st = os.stat(mountpoint)
    except OSError as exc:
        raise MountError(f"{mountpoint}: cannot use as a mount point: {exc.strerror}") from exc
    if not stat.S_ISDIR(st.st_mode):
        raise MountError(f"{mountpoint}: not a directory")
    return stat.S_IFDIR


def kernel_mount(mountpoint: str, opts: MountOptions) -> int:
    """Open /dev/fuse and mount(2) it on ``mountpoint``; returns the (close-on-exec) fd."""
    mountpoint = os.path.abspath(mountpoint)
    rootmode = _root_mode(mountpoint)
    fsname = _check_opt(opts.fsname or "kfuse", "fsname")
    subtype = _check_opt(opts.subtype, "subtype")
    try:
        fd = os.open("/dev/fuse", os.O_RDWR | os.O_CLOEXEC)
    except OSError as exc:
        raise MountError(f"cannot open /dev/fuse: {exc.strerror}") from exc
    data = [f"fd={fd}", f"rootmode={rootmode:o}", f"user_id={os.geteuid()}",
            f"group_id={os.getegid()}", "default_permissions"]
    if opts.allow_other:
        data.append("allow_other")
    if opts.max_read:
        data.append(f"max_read={int(opts.max_read)}")
    flags = MS_NOSUID | MS_NODEV | (MS_RDONLY if opts.read_only else 0)
    fstype = f"fuse.{subtype}" if subtype else "fuse"
    rc = _libc.mount(fsname.encode(), mountpoint.encode(), fstype.encode(), flags,
                     ",".join(data).encode())
    if rc != 0:
        err = ctypes.get_errno()
        os.close(fd)
        raise MountError(f"mount {mountpoint}: {os.strerror(err)}"
                         + (" (mounting needs root; use fusermount3)" if err == errno.EPERM
                            else ""))
    return fd


def fusermount_mount(mountpoint: str, opts: MountOptions) -> int:
    """Mount through fusermount3 and receive the /dev/fuse fd over a socketpair."""
    mountpoint = os.path.abspath(mountpoint)
    _root_mode(mountpoint)
    exe = shutil.which(FUSERMOUNT)
    if exe is None:
        raise MountError(f"{FUSERMOUNT} not found (install the fuse3 package)")
    o = ["nosuid", "nodev", "default_permissions",
         f"fsname={_check_opt(opts.fsname or 'kfuse', 'fsname')}"]
    if opts.read_only:
        o.insert(0, "ro")
    if opts.subtype:
        o.append(f"subtype={_check_opt(opts.subtype, 'subtype')}")
    if opts.allow_other:
        o.append("allow_other")
    if opts.max_read:
        o.append(f"max_read={int(opts.max_read)}")
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        env = dict(os.environ, _FUSE_COMMFD=str(theirs.fileno()))
        proc = subprocess.Popen([exe, "-o", ",".join(o), "--", mountpoint], env=env,
                                pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        theirs.close()
        fd = -1
        try:
            # One byte of data with the descriptor as SCM_RIGHTS; EOF if the helper failed.
            _msg, fds, _flags, _addr = socket.recv_fds(ours, 1, 1)
            if fds:
                fd = fds[0]
                for extra in fds[1:]:
                    os.close(extra)
        except OSError as exc:
            log.debug("receiving the fd from %s failed: %s", FUSERMOUNT, exc)
        _out, err = proc.communicate(timeout=60)
        if fd < 0 or proc.returncode != 0:
            if fd >= 0:
                os.close(fd)
            msg = err.decode(errors="replace").strip() or f"exit status {proc.returncode}"
            raise MountError(f"{FUSERMOUNT} could not mount {mountpoint}: {msg}")
        os.set_inheritable(fd, False)
        return fd
    finally:
        ours.close()
        if theirs.fileno() >= 0:
            theirs.close()


def mount(mountpoint: str, opts: MountOptions) -> int:
    """Mount by the way ``opts`` asks; returns the connection fd (INIT not yet answered)."""
    if opts.via_fusermount():
        return fusermount_mount(mountpoint, opts)
    return kernel_mount(mountpoint, opts)


def unmount(mountpoint: str, *, lazy: bool = False, use_fusermount: bool | None = None) -> None:
    """Unmount ``mountpoint``: umount2(2) as root, else ``fusermount3 -u [-z]``.

    Raises MountError with the reason (e.g. "Device or resource busy") on failure; a mount
    point that is not mounted is not an error.
    """
    mountpoint = os.path.abspath(mountpoint)
    via_fm = (os.geteuid() != 0) if use_fusermount is None else use_fusermount
    if not via_fm:
        rc = _libc.umount2(mountpoint.encode(), MNT_DETACH if lazy else 0)
        if rc == 0:
            return
        err = ctypes.get_errno()
        if err == errno.EINVAL:  # not a mount point (any more)
            return
        raise MountError(f"umount {mountpoint}: {os.strerror(err)}")
    exe = shutil.which(FUSERMOUNT)
    if exe is None:
        raise MountError(f"{FUSERMOUNT} not found (install the fuse3 package)")
    args = [exe, "-u", "-q"] + (["-z"] if lazy else []) + ["--", mountpoint]
    r = subprocess.run(args, stdin=subprocess.DEVNULL, capture_output=True, timeout=60,
                       check=False)
    if r.returncode != 0:
        msg = r.stderr.decode(errors="replace").strip()
        if not is_mounted(mountpoint):
            return
        raise MountError(f"{FUSERMOUNT} -u {mountpoint}: {msg or 'failed'}")


def is_mounted(mountpoint: str) -> bool:
    """Whether ``mountpoint`` is a mount point listed in /proc/self/mounts."""
    target = os.path.abspath(mountpoint)
    try:
        with open("/proc/self/mounts", "rb") as f:
            for line in f:
                parts = line.split()
                if len(parts) > 1 and _unescape(parts[1]) == target:
                    return True
    except OSError:
        return os.path.ismount(target)
    return False


def _unescape(field: bytes) -> str:
    # /proc/mounts escapes space, tab, newline and backslash as \ooo
    out = bytearray()
    i = 0
    while i < len(field):
        if field[i] == 0x5C and i + 3 < len(field) + 1 and field[i + 1:i + 4].isdigit():
            out.append(int(field[i + 1:i + 4], 8))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return out.decode(errors="surrogateescape")


def mount_device(mountpoint: str) -> str | None:
    """``"major:minor"`` of the mount at ``mountpoint`` from /proc/self/mountinfo (no stat:
    it would send a request to the file system), or None. The last mount there wins."""
    target = os.path.abspath(mountpoint)
    found = None
    try:
        with open("/proc/self/mountinfo", "rb") as f:
            for line in f:
                parts = line.split()
                if len(parts) > 4 and _unescape(parts[4]) == target:
                    found = parts[2].decode()
    except OSError:
        return None
    return found


def mount_state(mountpoint: str) -> str:
    """"stale" (ENOTCONN/ECONNABORTED: the daemon is gone), "live", or "none"."""
    try:
        os.stat(mountpoint)
    except OSError as exc:
        if exc.errno in (errno.ENOTCONN, errno.ECONNABORTED):
            return "stale"
        if exc.errno == errno.ENOENT:
            return "none"
        raise MountError(f"{mountpoint}: {exc.strerror}") from exc
    return "live" if is_mounted(mountpoint) else "none"


def cleanup_stale(mountpoint: str) -> bool:
    """Lazily unmount ``mountpoint`` if its daemon died (stat gives ENOTCONN).

    Returns True when a stale mount was removed, False when there was nothing to clean.
    A live mount is left alone.
    """
    if mount_state(mountpoint) != "stale":
        return False
    log.warning("%s: stale FUSE mount (its daemon died); unmounting it lazily", mountpoint)
    unmount(mountpoint, lazy=True)
    return True
