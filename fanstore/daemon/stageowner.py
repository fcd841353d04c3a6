"""Who staged what into a local directory, so that the next mount cleans up after a dead one.

A mount that stages without ``--keep-local`` removes its copies when it ends, but a daemon
that is SIGKILLed (the OOM killer, a launcher's clean-up, ``kill -9``) cannot, and nothing
else knew the copies were its: the next job on that directory found them. So before it
stages, a node writes an *owner record* into the local directory,
``.fanstore-owner-HOST-PID.json``: its host, pid and process start time (a pid is reused),
whether it created the directory, and the partitions it stages. It removes the record
when it removes its copies (:func:`release`).

Before the next mount on the directory stages, :func:`sweep` reads every record: one of
this host whose process is gone (no such pid, or a process that started later) belonged to
a mount that died. Its partitions that the new mount does not stage are removed (copy,
``.ok`` record); those it does stage are kept, and staging checks them as it checks any
copy it finds (reused when valid). The new mount then owns them, and the directory too
when the dead mount had created it. A record of a live process (another mount using the
directory), of another host (a local directory on a shared file system), or that cannot be
read is never acted on. ``--keep-local`` mounts write no record: their copies are meant to
stay.

Records are written like staging's other files (:mod:`fanstore.daemon.stagecheck`): to a
fresh name and renamed into place, read without following symlinks and only when owned by
this uid. Strict JSON; never pickle.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass

from fanstore import safeio
from fanstore.daemon.stagecheck import ok_path, unlink
from fanstore.errors import UnsafePathError
from fanstore.format.partition import partition_name
from fanstore.process import pid_alive, started_at

log = logging.getLogger(__name__)

PREFIX = ".fanstore-owner-"
#: a record is tiny; a bigger file is not one of ours
MAX_RECORD = 1 << 20
#: seconds of slack when comparing a process's start time with a record's (clock ticks)
START_SLACK = 2.0


@dataclass(frozen=True)
class Owner:
    """One owner record: the mount (``host``, ``pid`` started at ``started``) that staged
    ``partitions`` into the directory, and whether it ``created`` the directory."""

    host: str
    pid: int
    started: float
    created: bool
    partitions: tuple[int, ...]

    def alive(self) -> bool:
        """Whether the process that wrote the record still runs (this host only)."""
        if not pid_alive(self.pid):
            return False
        now = started_at(self.pid)
        return now is None or now <= self.started + START_SLACK


def _host() -> str:
    return os.uname().nodename


def record_path(local_dir: str, pid: int | None = None) -> str:
    return os.path.join(local_dir, f"{PREFIX}{_host()}-{pid or os.getpid()}.json")


def claim(local_dir: str, partitions: list[int], created: bool, mode: int = 0o600) -> str:
    """Write this process's record (replacing one of the same pid, a dead process's
    leftover); returns its path."""
    me = os.getpid()
    body = {"host": _host(), "pid": me, "started": started_at(me) or 0.0,
            "created": bool(created), "partitions": sorted(int(p) for p in partitions)}
    path = record_path(local_dir)
    safeio.atomic_write(path, json.dumps(body).encode(), mode=mode)
    return path


def release(path: str | None) -> None:
    if path:
        unlink(path)


def read_owners(local_dir: str) -> list[tuple[str, Owner]]:
    """Every readable record of this host in ``local_dir``, with its path."""
    try:
        names = [n for n in os.listdir(local_dir)
                 if n.startswith(PREFIX) and n.endswith(".json")]
    except OSError:
        return []
    out = []
    for name in sorted(names):
        path = os.path.join(local_dir, name)
        owner = _read(path)
        if owner is not None and owner.host == _host():
            out.append((path, owner))
    return out


def _read(path: str) -> Owner | None:
    try:
        fd = safeio.open_nofollow(path, owner=os.geteuid(), what="owner record")
    except (OSError, UnsafePathError):
        return None
    try:
        with os.fdopen(fd, "rb") as f:
            raw = json.loads(f.read(MAX_RECORD + 1) or b"null")
        parts = raw["partitions"]
        if not (isinstance(parts, list) and all(type(p) is int and p >= 0 for p in parts)):
            return None
        return Owner(host=str(raw["host"]), pid=int(raw["pid"]),
                     started=float(raw["started"]), created=raw["created"] is True,
                     partitions=tuple(parts))
    except (OSError, ValueError, TypeError, KeyError):
        return None


def sweep(local_dir: str, keep: list[int], who: str = "node") -> tuple[list[int], bool]:
    """Clean up after the mounts that staged into ``local_dir`` and died; see the module
    docstring. Returns the partitions removed and whether a dead mount had created the
    directory (the caller then owns it: it removes the directory when it ends)."""
    keep_set = set(keep)
    removed: list[int] = []
    created = False
    for path, owner in read_owners(local_dir):
        if owner.pid == os.getpid() or owner.alive():
            continue
        gone = [p for p in owner.partitions if p not in keep_set]
        for p in gone:
            copy = os.path.join(local_dir, partition_name(p))
            unlink(copy)
            unlink(ok_path(copy))
        removed.extend(gone)
        created = created or owner.created
        unlink(path)
        log.warning("%s: a mount that died (pid %d) left %d staged partitions in %s: "
                    "removed %d, kept %d this mount stages", who, owner.pid,
                    len(owner.partitions), local_dir, len(gone),
                    len(owner.partitions) - len(gone))
    return sorted(set(removed)), created


def others_alive(local_dir: str) -> bool:
    """Another live mount of this host has a record in ``local_dir``."""
    return any(owner.pid != os.getpid() and owner.alive()
               for _, owner in read_owners(local_dir))
