"""The Linux kernel's FUSE protocol: opcodes, struct layouts, constants and scalar packers.

Written from ``/usr/include/linux/fuse.h`` (protocol 7.38 there). All layouts use the host's
byte order with standard sizes and no implicit padding (``=`` in :mod:`struct`), exactly as
the kernel lays them out on a 64-bit host.

The packers here (precompiled :class:`struct.Struct`) make one reply at a time:
:func:`pack_attr`, :func:`pack_entry_out`, :func:`pack_attr_out`, :func:`pack_open_out`,
:func:`pack_statfs_out`, :func:`pack_dirent`, :func:`pack_direntplus`. Many records in one
numpy pass (:class:`~.records.EntryTable`, :class:`~.records.DirListing`) are in
:mod:`.records`.
"""

from __future__ import annotations

import enum
import stat as _stat
import struct

from fanstore.fuseflags import BITS as _FLAG_BITS

# --------------------------------------------------------------------------------------------
# Protocol version

#: The major version this engine speaks.
KERNEL_VERSION = 7
#: The newest minor version this engine knows the layouts of (that of linux/fuse.h here).
KERNEL_MINOR_VERSION = 38
#: The oldest kernel minor version accepted: 7.31 (Linux 5.4) has every flag we rely on
#: (NO_OPEN_SUPPORT 7.23, PARALLEL_DIROPS 7.25, MAX_PAGES and CACHE_SYMLINKS 7.28,
#: NO_OPENDIR_SUPPORT 7.29) and the 64-byte fuse_init_out.
MIN_KERNEL_MINOR = 31

ROOT_ID = 1
MIN_READ_BUFFER = 8192
NAME_MAX = 1024  # FUSE_NAME_MAX: the kernel refuses longer names in dirents
PAGE_SIZE = 4096


class Op(enum.IntEnum):
    """``enum fuse_opcode``."""

    LOOKUP = 1
    FORGET = 2  # no reply
    GETATTR = 3
    SETATTR = 4
    READLINK = 5
    SYMLINK = 6
    MKNOD = 8
    MKDIR = 9
    UNLINK = 10
    RMDIR = 11
    RENAME = 12
    LINK = 13
    OPEN = 14
    READ = 15
    WRITE = 16
    STATFS = 17
    RELEASE = 18
    FSYNC = 20
    SETXATTR = 21
    GETXATTR = 22
    LISTXATTR = 23
    REMOVEXATTR = 24
    FLUSH = 25
    INIT = 26
    OPENDIR = 27
    READDIR = 28
    RELEASEDIR = 29
    FSYNCDIR = 30
    GETLK = 31
    SETLK = 32
    SETLKW = 33
    ACCESS = 34
    CREATE = 35
    INTERRUPT = 36
    BMAP = 37
    DESTROY = 38
    IOCTL = 39
    POLL = 40
    NOTIFY_REPLY = 41
    BATCH_FORGET = 42
    FALLOCATE = 43
    READDIRPLUS = 44
    RENAME2 = 45
    LSEEK = 46
    COPY_FILE_RANGE = 47
    SETUPMAPPING = 48
    REMOVEMAPPING = 49
    SYNCFS = 50
    TMPFILE = 51
    # Newer than this header (7.39+); only sent if negotiated, listed so they count by name.
    STATX = 52
    COPY_FILE_RANGE_64 = 53


#: Lower-case names by opcode, for counters and logs ("lookup", "read", ...).
OP_NAMES: dict[int, str] = {int(op): op.name.lower() for op in Op}

#: Opcodes that would modify the file system: a read-only engine answers them EROFS.
WRITE_OPS: frozenset[int] = frozenset({
    Op.SETATTR, Op.SYMLINK, Op.MKNOD, Op.MKDIR, Op.UNLINK, Op.RMDIR, Op.RENAME, Op.LINK,
    Op.WRITE, Op.SETXATTR, Op.REMOVEXATTR, Op.CREATE, Op.FALLOCATE, Op.RENAME2,
    Op.COPY_FILE_RANGE, Op.COPY_FILE_RANGE_64, Op.TMPFILE,
})


class Notify(enum.IntEnum):
    """``enum fuse_notify_code``: sent in ``fuse_out_header.error`` with unique 0."""

    POLL = 1
    INVAL_INODE = 2
    INVAL_ENTRY = 3
    STORE = 4
    RETRIEVE = 5
    DELETE = 6


# --------------------------------------------------------------------------------------------
# INIT flags (fuse_init_in/out.flags; bits 32..63 travel in flags2 when FUSE_INIT_EXT is set)

ASYNC_READ = 1 << 0
POSIX_LOCKS = 1 << 1
FILE_OPS = 1 << 2
ATOMIC_O_TRUNC = 1 << 3
EXPORT_SUPPORT = 1 << 4
BIG_WRITES = 1 << 5
DONT_MASK = 1 << 6
SPLICE_WRITE = 1 << 7
SPLICE_MOVE = 1 << 8
SPLICE_READ = 1 << 9
FLOCK_LOCKS = 1 << 10
HAS_IOCTL_DIR = 1 << 11
AUTO_INVAL_DATA = 1 << 12
DO_READDIRPLUS = 1 << 13
READDIRPLUS_AUTO = 1 << 14
ASYNC_DIO = 1 << 15
WRITEBACK_CACHE = 1 << 16
NO_OPEN_SUPPORT = 1 << 17
PARALLEL_DIROPS = 1 << 18
HANDLE_KILLPRIV = 1 << 19
POSIX_ACL = 1 << 20
ABORT_ERROR = 1 << 21
MAX_PAGES = 1 << 22
CACHE_SYMLINKS = 1 << 23
NO_OPENDIR_SUPPORT = 1 << 24
EXPLICIT_INVAL_DATA = 1 << 25
MAP_ALIGNMENT = 1 << 26
SUBMOUNTS = 1 << 27
HANDLE_KILLPRIV_V2 = 1 << 28
SETXATTR_EXT = 1 << 29
INIT_EXT = 1 << 30
INIT_RESERVED = 1 << 31
SECURITY_CTX = 1 << 32
HAS_INODE_DAX = 1 << 33
HAS_EXPIRE_ONLY = 1 << 35

#: Names of the INIT flag bits, for logs and benchmark labels (the one table, with the
#: ``+NAME,-NAME`` edits of ``--fuse-flags``: fanstore.fuseflags).
INIT_FLAG_NAMES: dict[int, str] = {bit: name for name, bit in _FLAG_BITS.items()}


def flag_names(flags: int) -> list[str]:
    """The names of the set bits of an INIT flag word (unknown bits as ``bitN``)."""
    out = []
    for bit in range(64):
        if flags & (1 << bit):
            out.append(INIT_FLAG_NAMES.get(1 << bit, f"bit{bit}"))
    return out


# FOPEN_* (fuse_open_out.open_flags)
FOPEN_DIRECT_IO = 1 << 0
FOPEN_KEEP_CACHE = 1 << 1
FOPEN_NONSEEKABLE = 1 << 2
FOPEN_CACHE_DIR = 1 << 3
FOPEN_STREAM = 1 << 4
FOPEN_NOFLUSH = 1 << 5

# Device ioctl: _IOR(229, 0, uint32_t)
FUSE_DEV_IOC_CLONE = (2 << 30) | (4 << 16) | (229 << 8) | 0

# --------------------------------------------------------------------------------------------
# Struct layouts

IN_HEADER = struct.Struct("=IIQQIIIHH")  # len opcode unique nodeid uid gid pid total_extlen pad
OUT_HEADER = struct.Struct("=IiQ")  # len error unique
IN_HEADER_SIZE = IN_HEADER.size  # 40
OUT_HEADER_SIZE = OUT_HEADER.size  # 16

_ATTR_FMT = "QQQQQQIIIIIIIIII"  # ino size blocks atime mtime ctime *nsec mode nlink uid gid
#                                 rdev blksize flags
ATTR = struct.Struct("=" + _ATTR_FMT)
ENTRY_OUT = struct.Struct("=QQQQII" + _ATTR_FMT)  # nodeid generation entry_valid attr_valid
#                                                   entry_valid_nsec attr_valid_nsec attr
ENTRY_OUT_HEAD = struct.Struct("=QQQQII")
ATTR_OUT = struct.Struct("=QII" + _ATTR_FMT)  # attr_valid attr_valid_nsec dummy attr
ATTR_OUT_HEAD = struct.Struct("=QII")
OPEN_OUT = struct.Struct("=QII")  # fh open_flags padding
KSTATFS = struct.Struct("=QQQQQIIII24x")  # blocks bfree bavail files ffree bsize namelen
#                                          frsize padding spare[6]
DIRENT_HEAD = struct.Struct("=QQII")  # ino off namelen type
INIT_IN = struct.Struct("=IIIII44x")  # major minor max_readahead flags flags2 unused[11]
INIT_IN_V1 = struct.Struct("=IIII")  # before 7.36 the kernel sent only these 16 bytes
INIT_OUT = struct.Struct("=IIIIHHIIHHI28x")  # major minor max_readahead flags max_background
#   congestion_threshold max_write time_gran max_pages map_alignment flags2 unused[7]
INIT_OUT_VERSION = struct.Struct("=II")  # major minor: the start of fuse_init_out, alone the
#   answer to a kernel whose major is newer (it retries INIT with ours)
READ_IN = struct.Struct("=QQIIQII")  # fh offset size read_flags lock_owner flags padding
READ_IN_HEAD = struct.Struct("=QQI")  # fh offset size: the start of fuse_read_in
WRITE_IN = struct.Struct("=QQIIQII")  # fh offset size write_flags lock_owner flags padding
GETATTR_IN = struct.Struct("=IIQ")  # getattr_flags dummy fh
OPEN_IN = struct.Struct("=II")  # flags open_flags
RELEASE_IN = struct.Struct("=QIIQ")  # fh flags release_flags lock_owner
ACCESS_IN = struct.Struct("=II")  # mask padding
GETXATTR_IN = struct.Struct("=II")  # size padding
GETXATTR_OUT = struct.Struct("=II")  # size padding
FORGET_IN = struct.Struct("=Q")
BATCH_FORGET_IN = struct.Struct("=II")  # count dummy
FORGET_ONE = struct.Struct("=QQ")  # nodeid nlookup
INTERRUPT_IN = struct.Struct("=Q")
IOCTL_IN = struct.Struct("=QIIQII")  # fh flags cmd arg in_size out_size
LSEEK_IN = struct.Struct("=QQII")  # fh offset whence padding
LSEEK_OUT = struct.Struct("=Q")
POLL_IN = struct.Struct("=QQII")
NOTIFY_INVAL_INODE_OUT = struct.Struct("=Qqq")  # ino off len
NOTIFY_INVAL_ENTRY_OUT = struct.Struct("=QII")  # parent namelen flags
NOTIFY_STORE_OUT = struct.Struct("=QQII")  # nodeid offset size padding

ATTR_SIZE = ATTR.size  # 88
ENTRY_OUT_SIZE = ENTRY_OUT.size  # 128
ATTR_OUT_SIZE = ATTR_OUT.size  # 104
DIRENT_HEAD_SIZE = DIRENT_HEAD.size  # 24
DIRENTPLUS_HEAD_SIZE = ENTRY_OUT_SIZE + DIRENT_HEAD_SIZE  # 152
STATFS_OUT_SIZE = KSTATFS.size  # 80
INIT_OUT_SIZE = INIT_OUT.size  # 64

assert (ATTR_SIZE, ENTRY_OUT_SIZE, ATTR_OUT_SIZE, STATFS_OUT_SIZE, INIT_OUT_SIZE) == (
    88, 128, 104, 80, 64)


def dirent_type(mode: int) -> int:
    """The ``d_type`` (DT_*) of a st_mode: the kernel's ``(mode & S_IFMT) >> 12``."""
    return (mode & 0o170000) >> 12


def align8(n: int) -> int:
    return (n + 7) & ~7


# --------------------------------------------------------------------------------------------
# Scalar packers


def pack_attr(ino: int, size: int, mode: int, *, nlink: int = 1, uid: int = 0, gid: int = 0,
              mtime: float = 0, atime: float | None = None,
              ctime: float | None = None, rdev: int = 0, blksize: int = 4096,
              blocks: int | None = None, flags: int = 0) -> bytes:
    """One packed ``fuse_attr`` (88 bytes). Times are seconds (float or int)."""
    if blocks is None:
        blocks = (size + 511) // 512
    ts = []
    for t in (atime if atime is not None else mtime, mtime,
              ctime if ctime is not None else mtime):
        sec = int(t // 1) if isinstance(t, float) else int(t)
        nsec = round((t - sec) * 1e9) if isinstance(t, float) else 0
        ts.append((sec, min(nsec, 999_999_999)))
    return ATTR.pack(ino, size, blocks, ts[0][0], ts[1][0], ts[2][0], ts[0][1], ts[1][1],
                     ts[2][1], mode, nlink, uid, gid, rdev, blksize, flags)


def split_timeout(t: float) -> tuple[int, int]:
    """(seconds, nanoseconds) of a timeout as entry_out/attr_out carry it (0 if negative)."""
    if t <= 0:
        return 0, 0
    sec = int(t)
    return sec, min(round((t - sec) * 1e9), 999_999_999)


def pack_entry_out(nodeid: int, attr: bytes | memoryview, entry_valid: float = 0.0,
                   attr_valid: float = 0.0, generation: int = 0) -> bytes:
    """A packed ``fuse_entry_out`` (128 bytes) from a packed attr (88 bytes).

    ``nodeid == 0`` with a positive ``entry_valid`` is a *negative entry*: the kernel caches
    "no such name" for that long (see :func:`negative_entry`).
    """
    es, ens = split_timeout(entry_valid)
    as_, ans = split_timeout(attr_valid)
    return ENTRY_OUT_HEAD.pack(nodeid, generation, es, as_, ens, ans) + bytes(attr)


def negative_entry(entry_valid: float) -> bytes:
    """A LOOKUP reply that makes the kernel cache the absence of a name for ``entry_valid`` s."""
    return pack_entry_out(0, bytes(ATTR_SIZE), entry_valid, 0.0)


def pack_attr_out(attr: bytes | memoryview, attr_valid: float = 0.0) -> bytes:
    """A packed ``fuse_attr_out`` (104 bytes) from a packed attr."""
    s, ns = split_timeout(attr_valid)
    return ATTR_OUT_HEAD.pack(s, ns, 0) + bytes(attr)


def pack_open_out(fh: int = 0, open_flags: int = 0) -> bytes:
    return OPEN_OUT.pack(fh, open_flags, 0)


def pack_statfs_out(*, blocks: int, bfree: int = 0, bavail: int = 0, files: int = 0,
                    ffree: int = 0, bsize: int = 4096, namelen: int = 255,
                    frsize: int | None = None) -> bytes:
    """A packed ``fuse_statfs_out`` (``struct fuse_kstatfs``, 80 bytes)."""
    return KSTATFS.pack(blocks, bfree, bavail, files, ffree, bsize, namelen,
                        bsize if frsize is None else frsize, 0)


def pack_dirent(ino: int, off: int, name: bytes, dtype: int) -> bytes:
    """One ``fuse_dirent`` record, padded to 8 bytes (for READDIR)."""
    rec = DIRENT_HEAD.pack(ino, off, len(name), dtype) + name
    return rec + bytes(align8(len(rec)) - len(rec))


def pack_direntplus(entry_out: bytes | memoryview, off: int, name: bytes) -> bytes:
    """One ``fuse_direntplus`` record from a packed entry_out (for READDIRPLUS).

    d_ino and d_type are taken from the entry's attr (``attr.ino``, ``attr.mode``).
    """
    attr = ATTR.unpack_from(entry_out, ENTRY_OUT_HEAD.size)
    ino, mode = attr[0], attr[9]
    rec = bytes(entry_out) + DIRENT_HEAD.pack(ino, off, len(name), dirent_type(mode)) + name
    return rec + bytes(align8(len(rec)) - len(rec))


def pack_init_out(*, minor: int, max_readahead: int, flags: int, max_background: int,
                  congestion_threshold: int, max_write: int, time_gran: int,
                  max_pages: int) -> bytes:
    """A packed ``fuse_init_out``; ``flags`` is the 64-bit flag word (high half in flags2)."""
    return INIT_OUT.pack(KERNEL_VERSION, minor, max_readahead, flags & 0xFFFFFFFF,
                         max_background, congestion_threshold, max_write, time_gran,
                         max_pages, 0, (flags >> 32) & 0xFFFFFFFF)


def out_header(payload_len: int, error: int, unique: int) -> bytes:
    return OUT_HEADER.pack(OUT_HEADER_SIZE + payload_len, error, unique)


S_IFDIR = _stat.S_IFDIR
S_IFREG = _stat.S_IFREG
S_IFLNK = _stat.S_IFLNK
