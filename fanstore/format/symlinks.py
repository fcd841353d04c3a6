"""Where a symlink leads, judged by one walk for every tree FanStore builds.

A symlink target that stays inside the store *lexically* (``target_stays_inside``) can
still lead out through another symlink: with ``a/b -> ..`` (the root, which is fine) the
target of ``c -> a/b/..`` normalises to ``a`` but resolves, as the kernel resolves it on
the mount, to the parent of the root: outside the store. So every symlink is walked
component by component through the tree itself, symlinks met on the way followed, the way
the kernel walks it; ``..`` above the root, or an absolute target, leads out (ESCAPES).

The same walk judges a directory being scanned (``scan_tree``) and an archive's namespace
(``VirtualTree``), so a chain in a tar is judged as the same chain in a directory: loops
are refused at pack time; a symlink that leads out is kept as it is, followed or left out
as ``--symlinks`` says. (The index does not refuse symlinks that lead out: the mount hands
their targets to the kernel as they are, and ``Namespace.resolve``, the readers' one rule,
stops at the store's edge.) The tree is given as a :class:`Tree` (five small functions),
the results are memoised per symlink and the walk is iterative, so the cost is linear in
the total length of the targets whatever the chains (no recursion, no re-walking a shared
chain).
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

#: Symlinks followed in one path lookup before it fails with ELOOP (Linux's MAXSYMLINKS).
MAX_HOPS = 40

#: How a walk ended.
OK = 0  # at a directory or file (``entry``)
DANGLING = 1  # a component is missing, or is not a directory where one is needed
ESCAPES = 2  # ``..`` above the root, or an absolute target
LOOP = 3  # the walk came back to a symlink it is resolving

N = TypeVar("N", bound=Hashable)


class Tree(Protocol[N]):
    """The tree a walk runs through; nodes are any hashable ids."""

    root: N

    def parent(self, node: N) -> N: ...

    def child(self, node: N, name: bytes) -> N | None:
        """The entry ``name`` in directory ``node``, or None."""
        ...

    def is_dir(self, node: N) -> bool: ...

    def link_target(self, node: N) -> bytes | None:
        """The target of ``node`` if it is a symlink, else None."""
        ...


@dataclass(frozen=True)
class Resolved(Generic[N]):
    """Where a symlink's target leads, walked from the symlink's directory."""

    status: int
    entry: N | None = None
    #: symlinks followed on the way (not counting the one resolved), at most MAX_HOPS + 1
    hops: int = 0
    #: for ESCAPES: the symlink whose own target goes above the root
    culprit: N | None = None


def components(path: bytes) -> list[bytes]:
    """The components of a relative path as the kernel walks them: empty ones dropped,
    ``.`` kept (it needs a directory: ``f/.`` is ENOTDIR for a file f), a trailing slash
    read as a last ``.``."""
    parts = [p for p in path.split(b"/") if p]
    if parts and path.endswith(b"/"):
        parts.append(b".")
    return parts


class _Frame:
    __slots__ = ("cur", "hops", "i", "link", "parts")

    def __init__(self, link, parts: list[bytes], cur) -> None:
        self.link = link
        self.parts = parts
        self.i = 0
        self.cur = cur
        self.hops = 0


class Resolver(Generic[N]):
    """Resolves symlinks of one tree, each once (results are kept)."""

    def __init__(self, tree: Tree[N]) -> None:
        self.tree = tree
        self._done: dict[N, Resolved[N]] = {}

    def resolve(self, link: N) -> Resolved[N]:
        """Where the symlink ``link`` leads: its target walked from its directory, every
        symlink on the way (the last component included) followed."""
        done = self._done
        found = done.get(link)
        if found is not None:
            return found
        tree = self.tree
        active: set[N] = set()
        stack = [self._frame(link)]
        active.add(link)
        while stack:
            fr = stack[-1]
            result = None
            while result is None and fr.i < len(fr.parts):
                name = fr.parts[fr.i]
                if not tree.is_dir(fr.cur):  # ENOTDIR, ``..`` included
                    result = Resolved(DANGLING)
                    break
                if name == b".":
                    fr.i += 1
                    continue
                if name == b"..":
                    if fr.cur == tree.root:
                        result = Resolved(ESCAPES, culprit=fr.link)
                        break
                    fr.cur = tree.parent(fr.cur)
                    fr.i += 1
                    continue
                child = tree.child(fr.cur, name)
                if child is None:
                    result = Resolved(DANGLING)
                    break
                if tree.link_target(child) is None:
                    fr.cur = child
                    fr.i += 1
                    continue
                sub = done.get(child)
                if sub is None:
                    if child in active:
                        result = Resolved(LOOP)
                        break
                    stack.append(self._frame(child))  # resolve it first, then come back
                    active.add(child)
                    break
                fr.hops = min(MAX_HOPS + 1, fr.hops + 1 + sub.hops)
                if sub.status != OK:
                    result = Resolved(sub.status, hops=fr.hops, culprit=sub.culprit)
                    break
                fr.cur = sub.entry
                fr.i += 1
            if result is None and stack[-1] is not fr:
                continue  # a symlink on the way is resolved first
            if result is None:
                result = Resolved(OK, fr.cur, fr.hops)
            elif result.hops != fr.hops:
                result = Resolved(result.status, result.entry, fr.hops, result.culprit)
            done[fr.link] = result
            active.discard(fr.link)
            stack.pop()
        return done[link]

    def _frame(self, link: N) -> _Frame:
        target = self.tree.link_target(link) or b""
        if target.startswith(b"/"):
            # Absolute: outside the tree (a scan rewrites the ones inside the source as
            # relative before they get here).
            fr = _Frame(link, [b".."], self.tree.root)
        elif not target or b"\0" in target:
            fr = _Frame(link, [b"\0"], self.tree.parent(link))  # resolves to nothing
        else:
            fr = _Frame(link, components(target), self.tree.parent(link))
        return fr


def judge(resolved: Resolved) -> str | None:
    """What a pack refuses in a symlink that resolved so, whatever ``--symlinks`` asks
    (None: nothing). Loops (more than MAX_HOPS symlinks to follow is a loop to the kernel)
    are refused; a symlink to nothing inside the tree is kept, as it is; one that leads out
    (``status == ESCAPES``, ``culprit`` the symlink whose own target leaves) is the
    caller's to keep, follow or leave out."""
    if resolved.status == LOOP or resolved.hops + 1 > MAX_HOPS:
        return "symlink loop"
    return None
