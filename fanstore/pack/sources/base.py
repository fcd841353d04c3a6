"""What every streaming source gives the packer, and the tree its members build.

A streaming source (a tar stream, a zip file, objects under an S3 prefix) yields
:class:`Member` records in its own order, each file's bytes readable once, right then.
:class:`VirtualTree` collects them into the namespace a directory scan would have given:
names normalised and checked, duplicates resolved (the last one wins), directories that
the source never listed created implicitly, symlinks checked against the same rules as
``scan_tree`` (refused when they loop; one that leads outside the archive is kept as it is
or, with ``--symlinks skip``, left out; ``follow`` needs a directory source), and finally
laid out breadth-first with children sorted by name bytes (a ``ScanResult``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from fanstore.format.index import (
    KIND_DIR,
    KIND_FILE,
    KIND_SYMLINK,
    MAX_NAME,
    MAX_TARGET,
)
from fanstore.format.symlinks import ESCAPES, Resolver, judge
from fanstore.pack.options import Symlinks
from fanstore.pack.scan import ScanEntry, ScanResult, show

# Member kinds besides the three the format stores.
KIND_HARDLINK = 10
KIND_SPECIAL = 11

#: Mode of directories a source never listed (and of the root when it is not listed).
IMPLICIT_DIR_MODE = 0o755
#: Longest member name (a whole path) a source may give, as Linux's PATH_MAX; a longer
#: one is refused by name. Sources bound what they read by it (a tar's GNU long name, a
#: pax path), so that a hostile archive's name costs no more than this.
MAX_PATH = 4096
#: Memory a decompressor may need for one archive (an xz or LZMA dictionary; gzip, bzip2
#: and zstd need far less): xz -9 needs 65 MiB. A stream that asks for more is refused
#: before it is decoded, not allowed to fill a dictionary the archive chose.
MAX_DECODER_MEMORY = 256 << 20


@dataclass
class Member:
    """One entry of a source, in the source's order.

    ``name`` is the raw name (bytes) as the source spells it; ``where`` is what messages
    name (e.g. the archive). For files, ``read(n)`` returns up to n bytes of the content
    (b"" at its end) and is valid only until the source moves on. ``target`` is a
    symlink's target or a hard link's target member name. ``special`` names what a
    KIND_SPECIAL member is ("FIFO", "character device", ...); ``problem``, when set, is
    the whole reason a member is refused.
    """

    name: bytes
    kind: int
    mode: int
    mtime_ns: int
    size: int = 0
    target: bytes = b""
    read: Callable[[int], bytes] | None = None
    where: str = ""
    ordinal: int = 0
    special: str = ""
    #: optional, besides ``read``: fill a buffer with the next bytes of the content (fewer
    #: only at its end); saves a copy (tar)
    readinto: Callable[[memoryview], int] | None = None
    #: set when the member cannot be packed for a reason of its own (refused by name)
    problem: str = ""


class Source:
    """A streaming source. Subclasses set ``url`` and ``total_bytes`` and yield members."""

    url: str = ""
    #: What the progress bar counts to (bytes of the archive, or of the objects).
    total_bytes: int = 0
    #: Noun for messages ("tar archive", "zip archive", "S3 prefix").
    what: str = "source"
    #: The members carry modes of their own (S3 objects do not): see pack.access.
    has_modes: bool = True

    def local_files(self) -> list[str]:
        """The local files this source reads (archives, shards), whose own modes count for
        who may read the store (pack.access)."""
        return []

    def members(self) -> Iterator[Member]:
        raise NotImplementedError

    @property
    def bytes_read(self) -> int:
        """Progress so far, in the unit of ``total_bytes``."""
        return 0

    def reread(self, ordinals: set[int]) -> Iterator[Member]:
        """The members with these ordinals, read again (hard-link targets). Sources that
        cannot hold hard links never get here."""
        raise NotImplementedError

    def close(self) -> None:
        pass


def target_problem(target: bytes) -> str | None:
    """What is wrong with a symlink target on its own (None: nothing), checked as the
    member arrives, before the target is kept anywhere."""
    if not target:
        return "symlink with an empty target"
    if len(target) > MAX_TARGET:
        return f"symlink target longer than {MAX_TARGET} bytes"
    if b"\0" in target:
        return "symlink target contains NUL"
    return None


def normalize_name(name: bytes) -> tuple[bytes | None, str | None]:
    """(relative path, problem). ``./a//b/`` -> ``a/b``; the root is b"". Absolute names
    and names with a ``..`` component are refused: they would point outside the store."""
    if len(name) > MAX_PATH:  # before anything splits it (a name of 8 MiB of "a/")
        return None, f"name longer than {MAX_PATH} bytes"
    if name.startswith(b"/"):
        return None, "absolute member name refused (it would point outside the store)"
    parts = [p for p in name.split(b"/") if p not in (b"", b".")]
    if b".." in parts:
        return None, "member name with '..' refused (it would point outside the store)"
    if b"\0" in name:
        return None, "member name contains NUL"
    for p in parts:
        if len(p) > MAX_NAME:
            return None, "name longer than 255 bytes"
    return b"/".join(parts), None


@dataclass
class Node:
    kind: int
    mode: int
    mtime_ns: int
    size: int = 0
    target: bytes = b""
    file_id: int = -1  # the packer's record of the content (files)
    explicit: bool = True  # listed by the source (else an implied directory)
    ordinal: int = 0
    extra: Any = None
    #: why this entry is refused, decided when its member arrived (a symlink target too
    #: long to keep, which is not kept); reported by ``build``
    problem: str = ""


@dataclass
class VirtualTree:
    """The namespace being assembled from a source's members."""

    nodes: dict[bytes, Node] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    #: name -> times it appeared (only names seen more than once end up reported)
    seen: dict[bytes, int] = field(default_factory=dict)
    #: files whose content was superseded by a later member of the same name
    dropped: set[int] = field(default_factory=set)
    #: what becomes of a symlink that leads outside the archive (STORE or SKIP)
    symlinks: Symlinks = Symlinks.STORE
    #: symlinks left out by ``symlinks`` (SKIP)
    outside_skipped: int = 0

    def __post_init__(self) -> None:
        self.nodes[b""] = Node(KIND_DIR, IMPLICIT_DIR_MODE, 0, explicit=False)

    def problem(self, where: str, name: bytes, msg: str) -> None:
        self.problems.append(f"{where}: {show(name)}: {msg}")

    def add(self, rel: bytes, node: Node) -> None:
        """Put ``node`` at ``rel`` (the last member of a name wins)."""
        old = self.nodes.get(rel)
        if old is not None:
            if old.explicit and not (old.kind == KIND_DIR and node.kind == KIND_DIR):
                self.seen[rel] = self.seen.get(rel, 1) + 1
            if old.file_id >= 0:
                self.dropped.add(old.file_id)
            if node.kind == KIND_DIR and old.kind == KIND_DIR and not node.explicit:
                return  # an implied directory never replaces a listed one
        self.nodes[rel] = node
        # Parents the source has not listed (yet) exist implicitly.
        parent = rel.rpartition(b"/")[0] if rel else None
        while parent is not None and parent not in self.nodes:
            self.nodes[parent] = Node(KIND_DIR, IMPLICIT_DIR_MODE, 0, explicit=False)
            parent = parent.rpartition(b"/")[0] if parent else None

    def duplicates(self) -> list[tuple[bytes, int]]:
        return sorted((n, k) for n, k in self.seen.items() if k > 1)

    # -- the final layout
    def build(self, root: bytes) -> ScanResult:
        """Check the tree and lay it out breadth-first (children sorted by name bytes).

        Problems (files used as directories, symlinks that loop) are added to
        ``problems``; the offending entries (and what lies below them) are left out, and
        so are symlinks that lead outside with ``symlinks`` SKIP (counted).
        """
        where = os.fsdecode(root)
        children, bad = self._children(where)
        self._refuse_symlinks(where, bad)
        result, order = self._lay_out(root, children, bad)
        result.outside_skipped = self.outside_skipped
        _date_implicit_dirs(result, order)
        return result

    def _children(self, where: str) -> tuple[dict[bytes, list[bytes]], set[bytes]]:
        """Each directory's children, and the names left out (``bad``): a name below a
        non-directory (the source used a file or symlink as a directory) and all below it."""
        nodes = self.nodes
        children: dict[bytes, list[bytes]] = {}
        bad: set[bytes] = set()
        for rel in sorted(nodes):
            if not rel:
                continue
            parent = rel.rpartition(b"/")[0]
            if parent in bad:
                bad.add(rel)
                continue
            parent_node = nodes.get(parent)
            if parent_node is None or parent_node.kind != KIND_DIR:
                self.problem(where, rel, f"is inside {show(parent)!r}, which is not a directory "
                                         "in the source")
                bad.add(rel)
                continue
            children.setdefault(parent, []).append(rel)
        return children, bad

    def _refuse_symlinks(self, where: str, bad: set[bytes]) -> None:
        """Add to ``bad`` (and report) the symlinks refused: each on its own (its target),
        then walked through the tree (loops); and those that lead out (an absolute target,
        ``..`` above the root, through other symlinks too) when ``symlinks`` is SKIP."""
        nodes = self.nodes
        # As scan_tree walks a real tree: the walk sees every symlink, those refused on
        # their own too (a directory scan sees them on disk), so a chain is judged the
        # same in an archive and in a directory.
        links = [rel for rel, node in nodes.items()
                 if rel not in bad and node.kind == KIND_SYMLINK]
        resolver = Resolver(_TreeView(nodes, set(bad)))
        walk = []
        for rel in links:
            msg = nodes[rel].problem or target_problem(nodes[rel].target)
            if msg:
                self.problem(where, rel, msg)
                bad.add(rel)
            else:
                walk.append(rel)
        leaving = []
        for rel in walk:
            resolved = resolver.resolve(rel)
            msg = judge(resolved)
            if msg:
                self.problem(where, rel, msg)
                bad.add(rel)
            elif resolved.status == ESCAPES:
                leaving.append(rel)
        if self.symlinks is Symlinks.SKIP:  # after the walk: as a scan sees them on disk
            bad.update(leaving)
            self.outside_skipped += len(leaving)

    def _lay_out(self, root: bytes, children: dict[bytes, list[bytes]], bad: set[bytes]
                 ) -> tuple[ScanResult, list[Node]]:
        """The entries breadth-first, children sorted by name bytes, without ``bad``; and
        the node of each entry, in entry order."""
        nodes = self.nodes
        result = ScanResult(root=root)
        rootnode = nodes[b""]
        result.entries.append(ScanEntry(b"", KIND_DIR, rootnode.mode, 0, rootnode.mtime_ns))
        file_ids: list[int] = []
        order: list[Node] = [rootnode]
        head = 0
        while head < len(result.entries):
            dir_no = head
            head += 1
            if result.entries[dir_no].kind != KIND_DIR:
                continue
            first = len(result.entries)
            names = [r for r in children.get(result.entries[dir_no].rel, []) if r not in bad]
            names.sort(key=lambda r: r.rpartition(b"/")[2])
            for rel in names:
                node = nodes[rel]
                entry = ScanEntry(rel, node.kind, node.mode & 0o7777, 0, node.mtime_ns,
                                  parent=dir_no)
                if node.kind == KIND_FILE:
                    entry.size = node.size
                    file_ids.append(node.file_id)
                elif node.kind == KIND_SYMLINK:
                    entry.target = node.target
                    entry.size = len(node.target)
                result.entries.append(entry)
                order.append(node)
            result.entries[dir_no].children = (first, len(result.entries) - first)
        result.file_ids = file_ids  # type: ignore[attr-defined] - entry order of files
        return result, order


def _date_implicit_dirs(result: ScanResult, order: list[Node]) -> None:
    """Directories the source never listed (``order``: the node of each entry) get the
    mtime of their newest child (their mode is already 0755)."""
    for entry_no in range(len(result.entries) - 1, -1, -1):
        entry = result.entries[entry_no]
        if entry.kind == KIND_DIR and not order[entry_no].explicit:
            first, count = entry.children
            entry.mtime_ns = max((result.entries[child].mtime_ns
                                  for child in range(first, first + count)), default=0)


class _TreeView:
    """A VirtualTree's nodes as a tree for :class:`fanstore.format.symlinks.Resolver`
    (nodes are paths; ``absent`` ones are not there)."""

    root = b""

    def __init__(self, nodes: dict[bytes, Node], absent: set[bytes]) -> None:
        self.nodes = nodes
        self.absent = absent

    def parent(self, node: bytes) -> bytes:
        return node.rpartition(b"/")[0]

    def child(self, node: bytes, name: bytes) -> bytes | None:
        rel = node + b"/" + name if node else name
        return rel if rel in self.nodes and rel not in self.absent else None

    def is_dir(self, node: bytes) -> bool:
        return self.nodes[node].kind == KIND_DIR

    def link_target(self, node: bytes) -> bytes | None:
        n = self.nodes[node]
        return n.target if n.kind == KIND_SYMLINK else None
