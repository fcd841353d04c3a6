"""Temporary mounts of the stores a selection measures (its trials, ``select --check``),
made with the public CLI as a user makes them: ``fanstore mount`` in a subprocess, so a
trial reads through the frontend, options and process tree a job's mount has.

A mount that cannot be made here at all (no ``fusermount3`` for an unprivileged user, no
privilege for mount(2) in a container, a ``/dev/fuse`` that cannot be opened) raises
:class:`MountFailed`, a :class:`TrialError` the selection can tell apart from a store that
failed to read: where the reader was not given it then measures with the Python API
instead (``selector.py``). Every mount made here is unmounted by :func:`unmount`, lazily if
it is busy, and a trial's directory is removed only once nothing is mounted in it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

from fanstore.errors import FanStoreError

#: Seconds a ``fanstore mount`` or ``umount`` of a temporary store may take.
TIMEOUT = 300.0


class TrialError(FanStoreError):
    """A finalist could not be measured (the trial's pack, mount or pass failed)."""


class MountFailed(TrialError):
    """``fanstore mount`` of a temporary store failed; the message is its last line."""


def cli(*args: str, check: bool = True, timeout: float = TIMEOUT) -> int:
    """``fanstore ARGS`` as a user runs it (a subprocess); its exit status. Raises
    :class:`TrialError` with the command's last line when ``check`` and it failed."""
    cmd = [sys.executable, "-m", "fanstore.cli", *args]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                              check=False)
    except subprocess.TimeoutExpired:
        if not check:
            return 1
        raise TrialError(f"'fanstore {args[0]}' of a temporary store did not finish in "
                         f"{timeout:.0f} s") from None
    if check and proc.returncode != 0:
        line = (proc.stderr.strip().splitlines() or ["(no message)"])[-1]
        raise TrialError(f"'fanstore {args[0]}' of a temporary store failed: "
                         f"{line.removeprefix('fanstore: error: ')}")
    return proc.returncode


def mount(store: str, mnt: str, *options: str) -> None:
    """``fanstore mount OPTIONS -- STORE MNT``; :class:`MountFailed` when it fails."""
    try:
        cli("mount", *options, "--", store, mnt)
    except TrialError as exc:
        raise MountFailed(str(exc)) from None


def unmount(mnt: str) -> None:
    """Unmount a temporary mount, lazily if it is busy; never leaves it behind."""
    if cli("umount", "--", mnt, check=False) != 0:
        cli("umount", "--lazy", "--", mnt, check=False)


def remove(path: str) -> None:
    """Remove a trial's directory, never through a mount still there (its ``mnt``)."""
    mnt = os.path.join(path, "mnt")
    if os.path.ismount(mnt):
        unmount(mnt)
    if not os.path.ismount(mnt):
        shutil.rmtree(path, ignore_errors=True)


__all__ = ["TIMEOUT", "MountFailed", "TrialError", "cli", "mount", "remove", "unmount"]
