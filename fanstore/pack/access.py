"""Who may read a store: the source's own access, kept at rest (docs/reliability.md,
"Multi-user nodes").

A store holds the bytes of every file of its source, so a file only its owner could read
must not become readable by anyone who can reach the store. The rule, decided once per
pack:

- a source whose entries other users may all read (files with ``o+r``, directories with
  ``o+rx``; the source directory itself included) gives a *shared* store: the store
  directory and its files get the modes the umask gives, as ``mksquashfs`` and ``tar``
  do, so a public dataset stays shareable;
- a source with anything others may not read (a 0600 file, a 0700 directory, a 0640 file:
  group is not "everyone"), a streamed archive that is itself not readable by others, or
  a source without modes (an ``s3://`` prefix) gives a *private* store: directory 0700,
  every file in it 0600; the packer shows one line saying so and why (naming one example);
- ``--shared`` (``PackOptions.shared``) says the owner means to share it: the umask rule.

While it is written a store is always private (its temporary directory is 0700, its files
0600); :meth:`LocalDestination.install <fanstore.pack.dest.LocalDestination.install>`
opens a shared one up just before the rename that makes it appear. The decision is
recorded in the index metadata as ``"access": "private" | "shared"`` (docs/format.md), so
a staged copy of the store (``fanstore mount --local-dir``) follows it too.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from typing import Iterable

from fanstore.format.index import KIND_DIR, KIND_FILE
from fanstore.pack.scan import ScanEntry, show

PRIVATE = "private"
SHARED = "shared"

#: Modes of a private store (and of the temporary directory every store is built in).
PRIVATE_DIR_MODE = 0o700
PRIVATE_FILE_MODE = 0o600


@dataclass(frozen=True)
class Access:
    """The decision: ``private`` or not, and the line that explains a private one."""

    private: bool
    why: str = ""

    @property
    def value(self) -> str:
        return PRIVATE if self.private else SHARED


def closed_to_others(kind: int, mode: int) -> bool:
    """May other users not read an entry of this kind and mode? Symlinks carry no access
    of their own."""
    if kind == KIND_FILE:
        return not mode & stat.S_IROTH
    if kind == KIND_DIR:
        return (mode & (stat.S_IROTH | stat.S_IXOTH)) != (stat.S_IROTH | stat.S_IXOTH)
    return False


def first_closed(entries: Iterable[ScanEntry]) -> ScanEntry | None:
    """The first entry (breadth-first: the shallowest) that others may not read."""
    for e in entries:
        if closed_to_others(e.kind, e.mode):
            return e
    return None


_PRIVATE_TAIL = ("so the store is private: only you can read it (directory 0700, files "
                 "0600); pack with --shared to let others read it as your umask allows")


def _entry_text(src: str, e: ScanEntry) -> str:
    what = "directory" if e.kind == KIND_DIR else "file"
    if not e.rel:
        return f"the source {src} itself (mode {e.mode & 0o7777:04o})"
    return f"{src}: {what} {show(e.rel)} (mode {e.mode & 0o7777:04o})"


def decide_tree(src: str, entries: list[ScanEntry], shared: bool) -> Access:
    """The access of a store of the tree ``entries`` (a directory scan or the tree a
    streamed source built)."""
    if shared:
        return Access(False)
    e = first_closed(entries)
    if e is None:
        return Access(False)
    return Access(True, f"{_entry_text(src, e)} is not readable by other users, "
                        f"{_PRIVATE_TAIL}")


def decide_stream(src: str, entries: list[ScanEntry], shared: bool,
                  archives: list[str], has_modes: bool = True) -> Access:
    """The access of a store of a streamed source: its members' modes as
    :func:`decide_tree`, and the archives' own modes (a 0600 tar gives a private store
    even when its members say 0644); a source without modes (S3) is private."""
    if shared:
        return Access(False)
    if not has_modes:
        return Access(True, f"{src}: object storage carries no file modes to go by, "
                            f"{_PRIVATE_TAIL}")
    for path in archives:
        try:
            mode = os.stat(path).st_mode
        except OSError:
            continue  # it was read a moment ago; a vanished shard changes nothing here
        if closed_to_others(KIND_FILE, mode):
            return Access(True, f"the archive {path} (mode {stat.S_IMODE(mode):04o}) is "
                                f"not readable by other users, {_PRIVATE_TAIL}")
    return decide_tree(src, entries, shared)


__all__ = [
    "Access",
    "PRIVATE",
    "PRIVATE_DIR_MODE",
    "PRIVATE_FILE_MODE",
    "SHARED",
    "closed_to_others",
    "decide_stream",
    "decide_tree",
    "first_closed",
]
