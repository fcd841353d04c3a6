"""Walk a source tree into breadth-first entries, reporting what cannot be packed.

Nothing is followed: symlinks are kept as symlinks when they stay inside the source (an
absolute target inside the source is rewritten relative, so it still works on the mount).
Problems (escaping or looping symlinks, special files, unreadable directories or files) are
collected by path; the caller fails on them unless told to skip.
"""

from __future__ import annotations

import os
import stat
from collections import deque
from dataclasses import dataclass, field

from fanstore.format.index import (
    KIND_DIR,
    KIND_FILE,
    KIND_SYMLINK,
    clamp_mtime_ns,
    target_stays_inside,
)
from fanstore.format.symlinks import Resolver, judge


@dataclass
class ScanEntry:
    rel: bytes  # path relative to the source root; b"" for the root
    kind: int
    mode: int  # permission bits (07777)
    size: int
    mtime_ns: int
    target: bytes = b""  # symlink target (as it will be stored)
    parent: int = 0  # index of the parent entry in ScanResult.entries
    children: tuple[int, int] = (0, 0)  # (first, count) for directories


@dataclass
class ScanResult:
    root: bytes
    entries: list[ScanEntry] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    @property
    def files(self) -> list[int]:
        return [i for i, e in enumerate(self.entries) if e.kind == KIND_FILE]

    @property
    def raw_bytes(self) -> int:
        return sum(e.size for e in self.entries if e.kind == KIND_FILE)


#: Longest path a message shows whole (a hostile archive's names can be megabytes long).
SHOW_MAX = 1024


def show(path: bytes) -> str:
    """A path as users should see it in a one-line message (newlines and odd bytes escaped;
    beyond SHOW_MAX bytes cut, with the length said)."""
    more = ""
    if len(path) > SHOW_MAX:
        more = f"... ({len(path):,} bytes)"
        path = path[:SHOW_MAX]
    text = os.fsdecode(path)
    if text.isprintable():
        return text + more
    return repr(text)[1:-1] + more


def scan_tree(root: str, skip_problems: bool = False, exclude: str | None = None) -> ScanResult:
    """Breadth-first scan of ``root``; children sorted by name bytes.

    ``exclude`` is an absolute path that must not be packed (e.g. a destination inside the
    tree is refused earlier; this is for temp dirs). With ``skip_problems`` the offending
    entries are left out but still listed in ``problems``.
    """
    root_b = os.fsencode(os.path.abspath(root))
    real_root = os.path.realpath(root_b)
    result = ScanResult(root=root_b)
    st = os.stat(root_b)
    result.entries.append(
        ScanEntry(b"", KIND_DIR, stat.S_IMODE(st.st_mode), 0, clamp_mtime_ns(st.st_mtime_ns))
    )
    exclude_b = os.fsencode(exclude) if exclude else None
    links = Resolver(_FsTree(root_b, real_root))
    queue: deque[int] = deque([0])
    while queue:
        d = queue.popleft()
        rel_dir = result.entries[d].rel
        abs_dir = os.path.join(root_b, rel_dir) if rel_dir else root_b
        try:
            with os.scandir(abs_dir) as it:
                names = sorted(de.name for de in it)
        except OSError as exc:
            result.problems.append(f"{show(abs_dir)}: cannot list directory: {exc.strerror}")
            result.entries[d].children = (len(result.entries), 0)
            continue
        first = len(result.entries)
        for name in names:
            rel = rel_dir + b"/" + name if rel_dir else name
            path = os.path.join(root_b, rel)
            if exclude_b and path == exclude_b:
                continue
            try:
                st = os.lstat(path)
            except OSError as exc:
                result.problems.append(f"{show(path)}: cannot stat: {exc.strerror}")
                continue
            mode = st.st_mode
            entry = ScanEntry(rel, KIND_FILE, stat.S_IMODE(mode), 0,
                              clamp_mtime_ns(st.st_mtime_ns), parent=d)
            if stat.S_ISDIR(mode):
                entry.kind = KIND_DIR
            elif stat.S_ISREG(mode):
                entry.size = st.st_size
                if not os.access(path, os.R_OK):
                    result.problems.append(f"{show(path)}: unreadable file (permission denied)")
                    continue
            elif stat.S_ISLNK(mode):
                problem, target = _check_symlink(path, rel, real_root, links)
                if problem:
                    result.problems.append(f"{show(path)}: {problem}")
                    continue
                entry.kind = KIND_SYMLINK
                entry.target = target
                entry.size = len(target)
            else:
                what = _special_kind(mode)
                result.problems.append(f"{show(path)}: {what} cannot be packed (not a regular "
                                       "file, directory or symlink)")
                continue
            if len(name) > 255:
                result.problems.append(f"{show(path)}: name longer than 255 bytes")
                continue
            result.entries.append(entry)
            if entry.kind == KIND_DIR:
                queue.append(len(result.entries) - 1)
        result.entries[d].children = (first, len(result.entries) - first)
    return result


def _special_kind(mode: int) -> str:
    if stat.S_ISFIFO(mode):
        return "FIFO"
    if stat.S_ISSOCK(mode):
        return "socket"
    if stat.S_ISCHR(mode):
        return "character device"
    if stat.S_ISBLK(mode):
        return "block device"
    return "special file"


def _stored_target(target: bytes, rel: bytes, real_root: bytes) -> bytes | None:
    """The target as the store will keep it: an absolute one inside the source rewritten
    relative (so it still works on the mount); None for an absolute one outside."""
    if not target.startswith(b"/"):
        return target
    real_target = os.path.normpath(target)
    if real_target == real_root or real_target.startswith(real_root + b"/"):
        return os.path.relpath(real_target, os.path.dirname(os.path.join(real_root, rel)))
    return None


class _Unresolvable(Exception):
    """A component of a symlink's way could not be looked at (permissions, ...)."""


class _FsTree:
    """The source directory as a tree for :class:`fanstore.format.symlinks.Resolver`:
    nodes are paths relative to the root, looked at with lstat (nothing is followed by
    the OS; the resolver follows symlinks itself, so ``..`` above the root is seen even
    when the walk would come back in)."""

    root = b""

    def __init__(self, root_b: bytes, real_root: bytes) -> None:
        self.root_b = root_b
        self.real_root = real_root
        self._mode: dict[bytes, int] = {b"": stat.S_IFDIR}

    def _lstat(self, rel: bytes) -> int | None:
        mode = self._mode.get(rel)
        if mode is None:
            try:
                mode = os.lstat(os.path.join(self.root_b, rel)).st_mode
            except (FileNotFoundError, NotADirectoryError):
                return None
            except OSError as exc:
                raise _Unresolvable(exc.strerror) from None
            self._mode[rel] = mode
        return mode

    def parent(self, node: bytes) -> bytes:
        return node.rpartition(b"/")[0]

    def child(self, node: bytes, name: bytes) -> bytes | None:
        rel = node + b"/" + name if node else name
        return None if self._lstat(rel) is None else rel

    def is_dir(self, node: bytes) -> bool:
        return stat.S_ISDIR(self._lstat(node) or 0)

    def link_target(self, node: bytes) -> bytes | None:
        if not stat.S_ISLNK(self._lstat(node) or 0):
            return None
        try:
            target = os.readlink(os.path.join(self.root_b, node))
        except OSError as exc:
            raise _Unresolvable(exc.strerror) from None
        stored = _stored_target(target, node, self.real_root)
        return b"/" if stored is None else stored  # absolute: outside


def _check_symlink(path: bytes, rel: bytes, real_root: bytes,
                   links: Resolver) -> tuple[str | None, bytes]:
    """Return (problem, target to store)."""
    try:
        target = os.readlink(path)
    except OSError as exc:
        return f"cannot read symlink: {exc.strerror}", b""
    stored = _stored_target(target, rel, real_root)
    if stored is None:
        return f"symlink points outside the source ({show(target)})", b""
    target = stored
    if not target_stays_inside(rel, target):
        return f"symlink points outside the source ({show(target)})", b""
    # Walk it through the tree, other symlinks followed: loops, chains that climb out
    # (even when they would come back in: on the mount, out is the mount's parent).
    try:
        problem = judge(links.resolve(rel))
    except _Unresolvable as exc:
        return f"cannot resolve symlink: {exc}", b""
    if problem:
        return problem, b""
    return None, target
