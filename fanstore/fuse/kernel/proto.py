"""The Linux kernel's FUSE protocol: opcodes, struct layouts, constants and packers.

Written from ``/usr/include/linux/fuse.h`` (protocol 7.38 there). All layouts use the host's
byte order with standard sizes and no implicit padding (``=`` in :mod:`struct`, explicit
offsets in numpy), exactly as the kernel lays them out on a 64-bit host.

Two kinds of packers are provided:

- scalar packers (precompiled :class:`struct.Struct`), for one reply at a time:
  :func:`pack_attr`, :func:`pack_entry_out`, :func:`pack_attr_out`, :func:`pack_open_out`,
  :func:`pack_statfs_out`, :func:`pack_dirent`, :func:`pack_direntplus`;
- vectorised packers (numpy structured dtypes) for many records in one pass:
  :data:`ATTR_DTYPE`, :data:`ENTRY_OUT_DTYPE`, :data:`ATTR_OUT_DTYPE`,
  :class:`EntryTable` (prebuilt entry_out/attr_out bytes per inode, O(1) zero-copy row
  access) and :class:`DirListing` (a directory's READDIR and READDIRPLUS streams packed once,
  any ``(offset, size)`` request answered by a slice of them).
"""

from __future__ import annotations

import enum
import stat as _stat
import struct
from collections.abc import Iterable, Sequence

import numpy as np

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

_FLAG_NAMES = [  # bit 0, 1, 2, ...
    "ASYNC_READ", "POSIX_LOCKS", "FILE_OPS", "ATOMIC_O_TRUNC", "EXPORT_SUPPORT", "BIG_WRITES",
    "DONT_MASK", "SPLICE_WRITE", "SPLICE_MOVE", "SPLICE_READ", "FLOCK_LOCKS", "HAS_IOCTL_DIR",
    "AUTO_INVAL_DATA", "DO_READDIRPLUS", "READDIRPLUS_AUTO", "ASYNC_DIO", "WRITEBACK_CACHE",
    "NO_OPEN_SUPPORT", "PARALLEL_DIROPS", "HANDLE_KILLPRIV", "POSIX_ACL", "ABORT_ERROR",
    "MAX_PAGES", "CACHE_SYMLINKS", "NO_OPENDIR_SUPPORT", "EXPLICIT_INVAL_DATA", "MAP_ALIGNMENT",
    "SUBMOUNTS", "HANDLE_KILLPRIV_V2", "SETXATTR_EXT", "INIT_EXT", "INIT_RESERVED",
    "SECURITY_CTX", "HAS_INODE_DAX",
]
#: Names of the INIT flag bits, for logs and benchmark labels.
INIT_FLAG_NAMES: dict[int, str] = {1 << i: n for i, n in enumerate(_FLAG_NAMES)}
INIT_FLAG_NAMES[HAS_EXPIRE_ONLY] = "HAS_EXPIRE_ONLY"


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
READ_IN = struct.Struct("=QQIIQII")  # fh offset size read_flags lock_owner flags padding
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


def _split_timeout(t: float) -> tuple[int, int]:
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
    es, ens = _split_timeout(entry_valid)
    as_, ans = _split_timeout(attr_valid)
    return ENTRY_OUT_HEAD.pack(nodeid, generation, es, as_, ens, ans) + bytes(attr)


def negative_entry(entry_valid: float) -> bytes:
    """A LOOKUP reply that makes the kernel cache the absence of a name for ``entry_valid`` s."""
    return pack_entry_out(0, bytes(ATTR_SIZE), entry_valid, 0.0)


def pack_attr_out(attr: bytes | memoryview, attr_valid: float = 0.0) -> bytes:
    """A packed ``fuse_attr_out`` (104 bytes) from a packed attr."""
    s, ns = _split_timeout(attr_valid)
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
    ino = struct.unpack_from("=Q", entry_out, ENTRY_OUT_HEAD.size)[0]
    mode = struct.unpack_from("=I", entry_out, ENTRY_OUT_HEAD.size + 60)[0]
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


# --------------------------------------------------------------------------------------------
# numpy structured dtypes (vectorised packing)

ATTR_DTYPE = np.dtype([
    ("ino", "=u8"), ("size", "=u8"), ("blocks", "=u8"),
    ("atime", "=u8"), ("mtime", "=u8"), ("ctime", "=u8"),
    ("atimensec", "=u4"), ("mtimensec", "=u4"), ("ctimensec", "=u4"),
    ("mode", "=u4"), ("nlink", "=u4"), ("uid", "=u4"), ("gid", "=u4"),
    ("rdev", "=u4"), ("blksize", "=u4"), ("flags", "=u4"),
])
ENTRY_OUT_DTYPE = np.dtype([
    ("nodeid", "=u8"), ("generation", "=u8"), ("entry_valid", "=u8"), ("attr_valid", "=u8"),
    ("entry_valid_nsec", "=u4"), ("attr_valid_nsec", "=u4"), ("attr", ATTR_DTYPE),
])
ATTR_OUT_DTYPE = np.dtype([
    ("attr_valid", "=u8"), ("attr_valid_nsec", "=u4"), ("dummy", "=u4"), ("attr", ATTR_DTYPE),
])
DIRENT_DTYPE = np.dtype([("ino", "=u8"), ("off", "=u8"), ("namelen", "=u4"), ("type", "=u4")])
DIRENTPLUS_HEAD_DTYPE = np.dtype([("entry_out", ENTRY_OUT_DTYPE), ("dirent", DIRENT_DTYPE)])
KSTATFS_DTYPE = np.dtype([
    ("blocks", "=u8"), ("bfree", "=u8"), ("bavail", "=u8"), ("files", "=u8"), ("ffree", "=u8"),
    ("bsize", "=u4"), ("namelen", "=u4"), ("frsize", "=u4"), ("padding", "=u4"),
    ("spare", "=u4", (6,)),
])

assert ATTR_DTYPE.itemsize == ATTR_SIZE
assert ENTRY_OUT_DTYPE.itemsize == ENTRY_OUT_SIZE
assert ATTR_OUT_DTYPE.itemsize == ATTR_OUT_SIZE
assert DIRENTPLUS_HEAD_DTYPE.itemsize == DIRENTPLUS_HEAD_SIZE
assert KSTATFS_DTYPE.itemsize == STATFS_OUT_SIZE


def make_attrs(ino: np.ndarray, size: np.ndarray, mode: np.ndarray, *,
               nlink: np.ndarray | int = 1, uid: np.ndarray | int = 0,
               gid: np.ndarray | int = 0, mtime: np.ndarray | float = 0,
               blksize: int = 4096) -> np.ndarray:
    """A structured array of ``fuse_attr`` (:data:`ATTR_DTYPE`) built column-wise.

    ``mtime`` (seconds, float allowed) is used for atime, mtime and ctime alike.
    """
    n = len(ino)
    a = np.zeros(n, dtype=ATTR_DTYPE)
    a["ino"] = ino
    a["size"] = size
    a["blocks"] = (np.asarray(size, dtype=np.uint64) + np.uint64(511)) // np.uint64(512)
    mt = np.broadcast_to(np.asarray(mtime, dtype=np.float64), (n,))
    sec = np.floor(mt)
    nsec = np.minimum(np.round((mt - sec) * 1e9), 999_999_999)
    for f in ("atime", "mtime", "ctime"):
        a[f] = sec.astype(np.uint64)
        a[f + "nsec"] = nsec.astype(np.uint32)
    a["mode"] = mode
    a["nlink"] = nlink
    a["uid"] = uid
    a["gid"] = gid
    a["blksize"] = blksize
    return a


class EntryTable:
    """Prebuilt ``fuse_entry_out`` and ``fuse_attr_out`` bytes for a dense table of inodes.

    Row ``i`` describes node id ``nodeids[i]`` (usually ``i`` itself, with row 0 unused).
    ``entry(i)`` and ``attr_out(i)`` are O(1) zero-copy memoryview slices of one bytes
    object each: what a LOOKUP or GETATTR handler returns.

    Attributes
    ----------
    entries : np.ndarray of ENTRY_OUT_DTYPE, one per row (read-only view of the blob)
    """

    __slots__ = ("_attr_blob", "_entry_blob", "_n", "entries")

    def __init__(self, attrs: np.ndarray, nodeids: np.ndarray | None = None, *,
                 entry_valid: float = 1e6, attr_valid: float = 1e6,
                 generation: np.ndarray | int = 0) -> None:
        if attrs.dtype != ATTR_DTYPE:
            raise TypeError("attrs must have ATTR_DTYPE")
        n = len(attrs)
        es, ens = _split_timeout(entry_valid)
        as_, ans = _split_timeout(attr_valid)
        e = np.zeros(n, dtype=ENTRY_OUT_DTYPE)
        e["nodeid"] = attrs["ino"] if nodeids is None else nodeids
        e["generation"] = generation
        e["entry_valid"] = es
        e["entry_valid_nsec"] = ens
        e["attr_valid"] = as_
        e["attr_valid_nsec"] = ans
        e["attr"] = attrs
        a = np.zeros(n, dtype=ATTR_OUT_DTYPE)
        a["attr_valid"] = as_
        a["attr_valid_nsec"] = ans
        a["attr"] = attrs
        self._entry_blob = e.tobytes()
        self._attr_blob = a.tobytes()
        self.entries = np.frombuffer(self._entry_blob, dtype=ENTRY_OUT_DTYPE)
        self._n = n

    def __len__(self) -> int:
        return self._n

    def entry(self, row: int) -> memoryview:
        """The packed fuse_entry_out of row ``row`` (a LOOKUP reply)."""
        if not 0 <= row < self._n:
            raise IndexError(row)
        return memoryview(self._entry_blob)[row * ENTRY_OUT_SIZE:(row + 1) * ENTRY_OUT_SIZE]

    def attr_out(self, row: int) -> memoryview:
        """The packed fuse_attr_out of row ``row`` (a GETATTR reply)."""
        if not 0 <= row < self._n:
            raise IndexError(row)
        return memoryview(self._attr_blob)[row * ATTR_OUT_SIZE:(row + 1) * ATTR_OUT_SIZE]

    def entry_blob(self) -> bytes:
        return self._entry_blob


def _names_buffer(names: Sequence[bytes] | tuple[np.ndarray, np.ndarray]
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(concatenated name bytes as uint8, start offsets, lengths) from names or arrays."""
    if isinstance(names, tuple):
        concat, lens = names
        concat = np.frombuffer(concat, dtype=np.uint8) if isinstance(
            concat, (bytes, bytearray, memoryview)) else np.asarray(concat, dtype=np.uint8)
        lens = np.asarray(lens, dtype=np.int64)
    else:
        concat = np.frombuffer(b"".join(names), dtype=np.uint8)
        lens = np.fromiter(map(len, names), dtype=np.int64, count=len(names))
    starts = np.zeros(len(lens), dtype=np.int64)
    if len(lens) > 1:
        np.cumsum(lens[:-1], out=starts[1:])
    return concat, starts, lens


def _pack_records(fixed: np.ndarray, concat: np.ndarray, starts: np.ndarray,
                  lens: np.ndarray) -> tuple[bytes, np.ndarray]:
    """Lay out N records ``fixed[i] + name[i]``, each padded to 8 bytes, in one buffer.

    ``fixed`` is an (N, F) uint8 array; ``concat`` holds the names back to back in order
    (``starts`` their offsets). Returns (buffer, ends) with ``ends[i]`` the byte offset just
    past record ``i``. Vectorised in a constant number of numpy passes: every record is
    first laid out in a row of one (N, W) table (W the longest padded record), then the
    rows are compacted by a boolean mask, which numpy walks in row order.
    """
    n, f = fixed.shape
    reclen = (f + lens + 7) & ~7
    ends = np.cumsum(reclen, dtype=np.int64)
    if not n:
        return b"", ends
    maxname = int(lens.max())
    width = int(reclen.max())
    table = np.zeros((n, width), dtype=np.uint8)
    table[:, :f] = fixed
    if maxname:
        name_mask = np.arange(maxname) < lens[:, None]
        table[:, f:f + maxname][name_mask] = concat[:int(lens.sum())]
    keep = np.arange(width) < reclen[:, None]
    return table[keep].tobytes(), ends


class DirListing:
    """One directory's READDIR and READDIRPLUS replies, packed once, sliced per request.

    Entry ``i`` (0-based) gets the cookie ``off = i + 1``: a request at ``offset = k``
    resumes at entry ``k``. :meth:`plus` and :meth:`plain` return the largest run of whole
    records from ``offset`` that fits in ``size`` (the kernel refuses a larger reply), as a
    zero-copy memoryview; an empty view means end of directory.

    Build it from arrays in one numpy pass (10,000 entries: a few ms):

    - ``names``: a sequence of bytes, or ``(concatenated_bytes, lengths)``;
    - ``entries``: an :data:`ENTRY_OUT_DTYPE` array, one per name (e.g. rows of
      :attr:`EntryTable.entries` picked with fancy indexing). ``nodeid == 0`` in an entry
      means "no attributes for this name" (the kernel then does not prime its caches; use it
      for ``.`` and ``..``).
    - ``inos`` / ``types`` (optional): d_ino and d_type; default from the entries' attrs.
    """

    __slots__ = ("_dirents", "_entries", "_names", "_plain", "_plain_ends", "_plus",
                 "_plus_ends", "n")

    def __init__(self, names: Sequence[bytes] | tuple[np.ndarray, np.ndarray],
                 entries: np.ndarray, *, inos: np.ndarray | None = None,
                 types: np.ndarray | None = None) -> None:
        if entries.dtype != ENTRY_OUT_DTYPE:
            raise TypeError("entries must have ENTRY_OUT_DTYPE")
        concat, starts, lens = _names_buffer(names)
        n = len(lens)
        if len(entries) != n:
            raise ValueError(f"{n} names but {len(entries)} entries")
        if n and (lens.min() < 1 or lens.max() > NAME_MAX):
            raise ValueError("directory entry names must be 1..1024 bytes")
        self.n = n
        self._names = (concat, starts, lens)
        d = np.zeros(n, dtype=DIRENT_DTYPE)
        d["ino"] = entries["attr"]["ino"] if inos is None else inos
        d["off"] = np.arange(1, n + 1, dtype=np.uint64)
        d["namelen"] = lens
        d["type"] = (entries["attr"]["mode"] >> 12) & 0o17 if types is None else types
        self._dirents = d
        self._entries = entries
        # Each form is packed on first use: a mount uses one of them (READDIRPLUS or not).
        self._plus = self._plus_ends = self._plain = self._plain_ends = None

    def __len__(self) -> int:
        return self.n

    @staticmethod
    def _slice(buf: bytes, ends: np.ndarray, offset: int, size: int) -> memoryview:
        n = len(ends)
        if offset >= n or offset < 0:
            return memoryview(b"")
        base = int(ends[offset - 1]) if offset else 0
        stop = int(np.searchsorted(ends, base + size, side="right"))
        if stop <= offset:
            return memoryview(b"")
        return memoryview(buf)[base:int(ends[stop - 1])]

    def plus(self, offset: int, size: int) -> memoryview:
        """The READDIRPLUS reply for ``(offset, size)``."""
        if self._plus is None:
            concat, starts, lens = self._names
            head = np.zeros(self.n, dtype=DIRENTPLUS_HEAD_DTYPE)
            head["entry_out"] = self._entries
            head["dirent"] = self._dirents
            self._plus, self._plus_ends = _pack_records(
                head.view(np.uint8).reshape(self.n, DIRENTPLUS_HEAD_SIZE), concat, starts, lens)
        return self._slice(self._plus, self._plus_ends, offset, size)

    def plain(self, offset: int, size: int) -> memoryview:
        """The READDIR reply for ``(offset, size)``."""
        if self._plain is None:
            concat, starts, lens = self._names
            self._plain, self._plain_ends = _pack_records(
                self._dirents.view(np.uint8).reshape(self.n, DIRENT_HEAD_SIZE), concat,
                starts, lens)
        return self._slice(self._plain, self._plain_ends, offset, size)


def iter_dirents(buf: bytes | memoryview, plus: bool) -> Iterable[tuple[int, int, int, bytes]]:
    """Parse packed dirent/direntplus records: yields (ino, off, type, name). For tests."""
    mv = memoryview(buf)
    pos = 0
    skip = ENTRY_OUT_SIZE if plus else 0
    while pos + skip + DIRENT_HEAD_SIZE <= len(mv):
        ino, off, namelen, typ = DIRENT_HEAD.unpack_from(mv, pos + skip)
        start = pos + skip + DIRENT_HEAD_SIZE
        if namelen == 0 or start + namelen > len(mv):
            raise ValueError(f"bad record at {pos}")
        yield ino, off, typ, bytes(mv[start:start + namelen])
        pos += align8(skip + DIRENT_HEAD_SIZE + namelen)
    if pos != len(mv):
        raise ValueError(f"trailing {len(mv) - pos} bytes")


def fit_records(buf: bytes | memoryview, size: int, plus: bool) -> memoryview:
    """The longest prefix of whole dirent(plus) records of ``buf`` that fits in ``size``.

    Used by the engine to repair a handler reply larger than the kernel asked for.
    """
    mv = memoryview(buf)
    skip = ENTRY_OUT_SIZE if plus else 0
    pos = 0
    while pos + skip + DIRENT_HEAD_SIZE <= len(mv):
        namelen = DIRENT_HEAD.unpack_from(mv, pos + skip)[2]
        rec = align8(skip + DIRENT_HEAD_SIZE + namelen)
        if pos + rec > size or pos + rec > len(mv):
            break
        pos += rec
    return mv[:pos]


S_IFDIR = _stat.S_IFDIR
S_IFREG = _stat.S_IFREG
S_IFLNK = _stat.S_IFLNK
