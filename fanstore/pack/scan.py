"""Walk a source tree into breadth-first entries, reporting what cannot be packed.

Symlinks that stay inside the source are kept as symlinks (an absolute target inside the
source is rewritten relative, so it still works on the mount). One that leads outside
(absolute, ``..`` above the root, or through another symlink that does) is what
``--symlinks`` says (:class:`~fanstore.pack.options.Symlinks`): kept with its target as it
is (the default, as mksquashfs and tar), replaced by the file it leads to (``follow``: only
a symlink whose own target leaves; one that leads out through it stays a link to it), or
left out and counted (``skip``). Problems (looping symlinks, special files, unreadable
directories or files; with ``follow``, dangling ones) are collected by path; the caller
fails on them unless told to skip.
"""

from __future__ import annotations

import errno
import os
import stat
from collections import deque
from dataclasses import dataclass, field

from fanstore.format.index import (
    KIND_DIR,
    KIND_FILE,
    KIND_SYMLINK,
    clamp_mtime_ns,
)
from fanstore.format.symlinks import ESCAPES, Resolver, judge
from fanstore.pack.options import Symlinks


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
    #: symlinks leading outside the source that were left out (``--symlinks skip``)
    outside_skipped: int = 0

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


def scan_tree(root: str, skip_problems: bool = False, exclude: str | None = None,
              symlinks: Symlinks = Symlinks.STORE) -> ScanResult:
    """Breadth-first scan of ``root``; children sorted by name bytes.

    ``exclude`` is an absolute path that must not be packed (e.g. a destination inside the
    tree is refused earlier; this is for temp dirs). With ``skip_problems`` the offending
    entries are left out but still listed in ``problems``. ``symlinks``: what becomes of a
    symlink that leads outside the source (module docstring).
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
                problem = _symlink_entry(entry, path, real_root, links, symlinks)
                if problem is _LEFT_OUT:
                    result.outside_skipped += 1
                    continue
                if problem:
                    result.problems.append(f"{show(path)}: {problem}")
                    continue
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


#: What :func:`_symlink_entry` returns for a symlink ``--symlinks skip`` leaves out.
_LEFT_OUT = "left out"

#: Where a symlink leads (:func:`_check_symlink`).
_INSIDE, _OUT, _THROUGH = 0, 1, 2


def _symlink_entry(entry: ScanEntry, path: bytes, real_root: bytes, links: Resolver,
                   symlinks: Symlinks) -> str | None:
    """Make ``entry`` what the symlink at ``path`` is packed as: a symlink, or (``follow``,
    its own target outside the source) the regular file it leads to. Returns the problem
    that keeps it out, ``_LEFT_OUT`` (``skip``, it leads outside), or None."""
    problem, target, leads = _check_symlink(path, entry.rel, real_root, links)
    if problem:
        return problem
    if leads != _INSIDE and symlinks is Symlinks.SKIP:
        return _LEFT_OUT
    if leads == _OUT and symlinks is Symlinks.FOLLOW:
        return _follow(entry, path, target)
    entry.kind = KIND_SYMLINK
    entry.target = target
    entry.size = len(target)
    return None


def _follow(entry: ScanEntry, path: bytes, target: bytes) -> str | None:
    """``--symlinks follow``: ``entry`` becomes the regular file the symlink at ``path``
    (to ``target``, outside the source) leads to; or the problem that keeps it out."""
    try:
        st = os.stat(path)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return f"symlink loop (following {show(target)})"
        if exc.errno in (errno.ENOENT, errno.ENOTDIR):
            return f"dangling symlink: its target {show(target)} does not exist"
        return f"cannot follow symlink to {show(target)}: {exc.strerror}"
    if stat.S_ISDIR(st.st_mode):
        return (f"symlink to a directory outside the source ({show(target)}); --symlinks "
                "follow stores files only (store or skip it)")
    if not stat.S_ISREG(st.st_mode):
        return (f"symlink to a {_special_kind(st.st_mode)} outside the source "
                f"({show(target)}); --symlinks follow stores regular files only")
    if not os.access(path, os.R_OK):
        return f"unreadable file behind symlink to {show(target)} (permission denied)"
    entry.kind = KIND_FILE
    entry.size = st.st_size
    entry.mode = stat.S_IMODE(st.st_mode)
    entry.mtime_ns = clamp_mtime_ns(st.st_mtime_ns)
    return None


def _check_symlink(path: bytes, rel: bytes, real_root: bytes,
                   links: Resolver) -> tuple[str | None, bytes, int]:
    """(problem, target to store, where it leads: _INSIDE; _OUT, its own target leaves the
    source; _THROUGH, another symlink on its way does)."""
    try:
        target = os.readlink(path)
    except OSError as exc:
        return f"cannot read symlink: {exc.strerror}", b"", _INSIDE
    stored = _stored_target(target, rel, real_root)
    # Walk it through the tree, other symlinks followed: loops, chains that climb out
    # (even when they would come back in: on the mount, out is the mount's parent).
    try:
        resolved = links.resolve(rel)
    except _Unresolvable as exc:
        return f"cannot resolve symlink: {exc}", b"", _INSIDE
    problem = judge(resolved)
    if problem:
        return problem, b"", _INSIDE
    if resolved.status != ESCAPES:
        return None, target if stored is None else stored, _INSIDE
    return None, target if stored is None else stored, \
        _OUT if resolved.culprit == rel else _THROUGH
