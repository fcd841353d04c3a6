"""The kernel's FUSE INIT flags by name, and ``--fuse-flags``: ``+NAME,-NAME`` edits of a
flag word.

One table and one parser for every use: the kernel-protocol engine names the flags it
negotiated (:mod:`fanstore.fuse.engine.proto`), :mod:`fanstore.settings` checks
``$FANSTORE_FUSE_FLAGS``, the mount spec checks its ``fuse_flags``
(:class:`fanstore.mountspec.MountSpec`, the one check of a mount's flags) and the kernel
frontend applies them to the engine's defaults. Standard library only, so that the engine
can use it too (tests/test_layers.py).
"""

from __future__ import annotations

__all__ = ["BITS", "apply", "check"]

_BY_BIT = (  # bit 0, 1, 2, ... of fuse_init_in/out.flags (32..63: flags2 with INIT_EXT)
    "ASYNC_READ", "POSIX_LOCKS", "FILE_OPS", "ATOMIC_O_TRUNC", "EXPORT_SUPPORT", "BIG_WRITES",
    "DONT_MASK", "SPLICE_WRITE", "SPLICE_MOVE", "SPLICE_READ", "FLOCK_LOCKS", "HAS_IOCTL_DIR",
    "AUTO_INVAL_DATA", "DO_READDIRPLUS", "READDIRPLUS_AUTO", "ASYNC_DIO", "WRITEBACK_CACHE",
    "NO_OPEN_SUPPORT", "PARALLEL_DIROPS", "HANDLE_KILLPRIV", "POSIX_ACL", "ABORT_ERROR",
    "MAX_PAGES", "CACHE_SYMLINKS", "NO_OPENDIR_SUPPORT", "EXPLICIT_INVAL_DATA", "MAP_ALIGNMENT",
    "SUBMOUNTS", "HANDLE_KILLPRIV_V2", "SETXATTR_EXT", "INIT_EXT", "INIT_RESERVED",
    "SECURITY_CTX", "HAS_INODE_DAX",
)
#: Every INIT flag by name: its bit.
BITS: dict[str, int] = {name: 1 << bit for bit, name in enumerate(_BY_BIT)}
BITS["HAS_EXPIRE_ONLY"] = 1 << 35


def apply(text: str, base: int) -> int:
    """``base`` with the edits of ``text`` applied in order (``+NAME`` sets a flag,
    ``-NAME`` clears it; names as in ``linux/fuse.h`` without ``FUSE_``, any case).
    ValueError, naming the first bad edit, for anything else."""
    flags = base
    for item in filter(None, (s.strip() for s in text.split(","))):
        sign, name = item[0], item[1:].upper()
        if sign not in "+-" or not name:
            raise ValueError(f"bad flag edit {item!r}: is not +NAME or -NAME "
                             "(e.g. -DO_READDIRPLUS)")
        if name not in BITS:
            raise ValueError(f"bad flag edit {item!r}: no INIT flag is called {name}")
        flags = flags | BITS[name] if sign == "+" else flags & ~BITS[name]
    return flags


def check(text: str) -> str:
    """``text`` if every edit in it is one (ValueError otherwise, as :func:`apply`)."""
    apply(text, 0)
    return text
