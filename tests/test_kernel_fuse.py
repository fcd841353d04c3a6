"""The kernel-protocol FUSE engine (fanstore/fuse/engine): unit tests without a kernel, then
real mounts of its in-memory file system (memfs) served by forked workers.

Every mount is made by a fixture whose teardown stops the supervisor, kills every process it
started (supervisor and workers, found through /proc), and lazily unmounts, even when the
test failed.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import hashlib
import json
import os
import random
import shutil
import signal
import socket
import stat
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import kernel_memfs as memfs  # tests/kernel_memfs.py: the engine's in-memory test file system
import numpy as np
import pytest

from fanstore.errors import MountError
from fanstore.fuse.engine import Dispatcher, EngineOptions, FuseErrno, KernelSession
from fanstore.fuse.engine import counters as C
from fanstore.fuse.engine import proto as P
from fanstore.fuse.engine import records as R
from fanstore.fuse.engine.mount import cleanup_stale, is_mounted, mount_state
from fanstore.fuse.engine.notify import notify_inval_inode, notify_store
from fanstore.fuse.engine.optable import OPCODES

ROOT = os.geteuid() == 0
MEMFS = memfs.__file__  # run as a script by the mount tests
needs_fuse = pytest.mark.skipif(not os.path.exists("/dev/fuse"), reason="no /dev/fuse")
needs_root = pytest.mark.skipif(not ROOT, reason="mount(2) needs root")

# ============================================================================ unit: proto


def test_struct_sizes_match_the_kernel_header():
    # sizes from /usr/include/linux/fuse.h (FUSE_COMPAT_* and struct definitions)
    assert P.IN_HEADER.size == 40 and P.OUT_HEADER.size == 16
    assert P.ATTR_SIZE == 88 and P.ENTRY_OUT_SIZE == 128 and P.ATTR_OUT_SIZE == 104
    assert P.STATFS_OUT_SIZE == 80 and P.INIT_OUT_SIZE == 64 and P.READ_IN.size == 40
    assert P.DIRENTPLUS_HEAD_SIZE == 152 and P.INIT_IN.size == 64


def test_scalar_and_vector_attr_packing_agree():
    a = P.pack_attr(7, 12345, stat.S_IFREG | 0o640, nlink=3, uid=11, gid=12,
                    mtime=1700000000.5, blksize=65536)
    arr = R.make_attrs(np.array([7]), np.array([12345]), np.array([stat.S_IFREG | 0o640]),
                       nlink=3, uid=11, gid=12, mtime=1700000000.5, blksize=65536)
    assert arr.tobytes() == a
    fields = P.ATTR.unpack(a)
    assert fields[:3] == (7, 12345, (12345 + 511) // 512)
    assert fields[4] == 1700000000 and fields[7] == 500_000_000  # mtime, mtimensec
    assert fields[9] == stat.S_IFREG | 0o640 and fields[14] == 65536


def test_entry_table_rows_equal_scalar_packers():
    n = 50
    attrs = R.make_attrs(np.arange(n), np.arange(n) * 10, np.full(n, stat.S_IFREG | 0o644),
                         mtime=5.25)
    t = R.EntryTable(attrs, entry_valid=2.5, attr_valid=7)
    for i in (0, 1, 17, n - 1):
        raw = attrs[i:i + 1].tobytes()
        assert bytes(t.entry(i)) == P.pack_entry_out(i, raw, 2.5, 7)
        assert bytes(t.attr_out(i)) == P.pack_attr_out(raw, 7)
    with pytest.raises(IndexError):
        t.entry(n)
    nodeid, gen, ev, av, evn, avn = P.ENTRY_OUT_HEAD.unpack_from(t.entry(3))
    assert (nodeid, gen, ev, av, evn, avn) == (3, 0, 2, 7, 500_000_000, 0)


def _listing(n: int, plus_dots: bool = True):
    names = [f"name-{i:05d}".encode() + b"x" * (i % 13) for i in range(n)]
    attrs = R.make_attrs(np.arange(2, n + 2), np.arange(n), np.full(n, stat.S_IFREG | 0o644))
    entries = R.EntryTable(attrs).entries
    return names, R.DirListing(names, entries)


@pytest.mark.parametrize("size", [4096, 600, 8192, 65536])
def test_dir_listing_slices_cover_every_entry_once_within_size(size):
    names, lst = _listing(3000)
    for plus in (True, False):
        got: list[bytes] = []
        offset = 0
        while True:
            chunk = lst.plus(offset, size) if plus else lst.plain(offset, size)
            assert len(chunk) <= size
            if not len(chunk):
                break
            recs = list(R.iter_dirents(chunk, plus))
            assert [r[1] for r in recs] == list(range(offset + 1, offset + 1 + len(recs)))
            got += [r[3] for r in recs]
            offset = recs[-1][1]
        assert got == names


def test_dir_listing_direntplus_records_carry_the_entry():
    names, lst = _listing(20)
    chunk = lst.plus(5, 4096)
    first = bytes(chunk[:P.ENTRY_OUT_SIZE])
    assert P.ENTRY_OUT_HEAD.unpack_from(first)[0] == 7  # nodeid of entry 5 (inos start at 2)
    ino, off, namelen, typ = P.DIRENT_HEAD.unpack_from(chunk, P.ENTRY_OUT_SIZE)
    assert (ino, off, typ) == (7, 6, stat.S_IFREG >> 12) and namelen == len(names[5])
    # a scalar-packed record is byte-identical
    assert bytes(chunk[:P.align8(152 + namelen)]) == P.pack_direntplus(first, 6, names[5])


def test_dir_listing_edge_cases():
    _names, lst = _listing(10)
    assert len(lst.plus(10, 4096)) == 0 and len(lst.plus(999, 4096)) == 0
    assert len(lst.plus(0, 100)) == 0  # not even one record fits: nothing, never a partial one
    with pytest.raises(ValueError):
        R.DirListing([b""], R.EntryTable(R.make_attrs(np.array([1]), np.array([0]),
                                                      np.array([0o40755]))).entries)
    empty = R.DirListing([], np.zeros(0, dtype=R.ENTRY_OUT_DTYPE))
    assert len(empty.plus(0, 4096)) == 0


def test_dir_listing_of_10000_entries_is_vectorised():
    n = 10_000
    names = [f"file-{i:06d}.jpg".encode() for i in range(n)]
    attrs = R.make_attrs(np.arange(2, n + 2), np.full(n, 100_000), np.full(n, 0o100644))
    t0 = time.process_time()
    lst = R.DirListing(names, R.EntryTable(attrs).entries)
    cost = time.process_time() - t0
    recs = list(R.iter_dirents(lst.plus(0, 10**9), True))
    assert len(recs) == n and recs[-1][3] == names[-1]
    # not a speed assertion: a generous bound that only a per-entry Python loop of
    # struct packing plus joins would approach on a loaded machine
    assert cost < 5.0


def test_fit_records_trims_to_whole_records():
    _names, lst = _listing(50)
    full = bytes(lst.plus(0, 10**6))
    for size in (0, 100, 1000, 5000):
        cut = R.fit_records(full, size, True)
        assert len(cut) <= size
        assert full.startswith(bytes(cut))
        list(R.iter_dirents(cut, True))  # whole records only


def test_init_out_layout():
    out = P.pack_init_out(minor=38, max_readahead=1 << 20, flags=P.ASYNC_READ | (1 << 33),
                          max_background=64, congestion_threshold=48, max_write=1 << 20,
                          time_gran=1, max_pages=256)
    assert len(out) == 64
    major, minor, ra, flags, bg, cong, mw, tg, mp, _ma, flags2 = P.INIT_OUT.unpack(out)
    assert (major, minor, ra, flags, bg, cong, mw, tg, mp, flags2) == (
        7, 38, 1 << 20, P.ASYNC_READ, 64, 48, 1 << 20, 1, 256, 2)


def test_the_engine_imports_nothing_of_fanstore_but_its_errors():
    """fanstore.fuse.engine is a layer of its own, below fanstore.fuse: it may use
    fanstore.errors (MountError), fanstore.unixsock (socket paths of any length) and
    fanstore.fuseflags (the INIT flags by name), all standard library only, and nothing
    else of FanStore."""
    import ast

    engine = Path(P.__file__).parent
    found = []
    for path in sorted(engine.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                names = [("." * node.level) + (node.module or "")]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            found += [(path.name, n) for n in names
                      if n.startswith("..") or (n.startswith("fanstore")
                                                 and n not in ("fanstore.errors",
                                                               "fanstore.unixsock",
                                                               "fanstore.fuseflags")
                                                 and not n.startswith("fanstore.fuse.engine"))]
    assert not found, found


# ============================================================================ unit: dispatch


class _Handler:
    """A tiny handler for dispatch tests: node 1 is a directory with 'f' (node 2)."""

    def __init__(self):
        self.attr = P.pack_attr(2, 5, stat.S_IFREG | 0o644)
        self.forgotten: list[tuple[int, int]] = []
        names = [f"e{i:04d}".encode() for i in range(500)]
        attrs = R.make_attrs(np.arange(10, 510), np.zeros(500), np.full(500, 0o100644))
        self.listing = R.DirListing(names, R.EntryTable(attrs).entries)

    def lookup(self, parent, name):
        if name == b"f":
            return P.pack_entry_out(2, self.attr, 1, 1)
        if name == b"boom":
            raise ValueError("handler bug")
        if name == b"badtype":
            return 12.5
        if name == b"bigerr":
            raise FuseErrno(100000)
        if name == b"wide":
            return np.arange(4, dtype=np.uint64)  # 32 bytes in 4 items
        raise FuseErrno(errno.ENOENT)

    def getattr(self, nodeid):
        return P.pack_attr_out(self.attr, 1)

    def read(self, nodeid, offset, size):
        if nodeid == 3:
            return b"z" * (size + 100)  # longer than asked: must be trimmed
        return b"hello"[offset:offset + size]

    def readdirplus(self, nodeid, offset, size):
        if nodeid == 3:
            return self.listing.plus(offset, size * 4)  # oversized: must be trimmed
        return self.listing.plus(offset, size)

    def forget(self, pairs):
        self.forgotten.extend(pairs)


def _req(op: int, nodeid: int = 1, body: bytes = b"", unique: int = 77,
         length: int | None = None) -> bytes:
    n = P.IN_HEADER_SIZE + len(body)
    return P.IN_HEADER.pack(n if length is None else length, op, unique, nodeid, 0, 0, 0, 0,
                            0) + body


def _read_body(offset: int, size: int) -> bytes:
    return P.READ_IN.pack(0, offset, size, 0, 0, 0, 0)


@pytest.fixture
def fake_dev():
    """(dispatcher, reader socket): the dispatcher writes replies into a SEQPACKET socket."""
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    b.settimeout(0.2)
    d = Dispatcher(a.fileno(), _Handler(), bufsize=1 << 16)
    try:
        yield d, b
    finally:
        a.close()
        b.close()


def _dispatch(d: Dispatcher, raw: bytes) -> None:
    d.buf[:len(raw)] = raw
    d.handle(len(raw))


def _reply(sock) -> tuple[int, int, bytes] | None:
    try:
        msg = sock.recv(1 << 20)
    except (TimeoutError, BlockingIOError):
        return None
    length, err, unique = P.OUT_HEADER.unpack_from(msg)
    assert length == len(msg)
    return err, unique, msg[16:]


def test_dispatch_lookup_getattr_read(fake_dev):
    d, s = fake_dev
    _dispatch(d, _req(P.Op.LOOKUP, 1, b"f\0", unique=5))
    err, unique, payload = _reply(s)
    assert (err, unique, len(payload)) == (0, 5, 128)
    assert P.ENTRY_OUT_HEAD.unpack_from(payload)[0] == 2
    _dispatch(d, _req(P.Op.LOOKUP, 1, b"nope\0", unique=6))
    assert _reply(s) == (-errno.ENOENT, 6, b"")
    _dispatch(d, _req(P.Op.GETATTR, 2, P.GETATTR_IN.pack(0, 0, 0)))
    err, _, payload = _reply(s)
    assert err == 0 and len(payload) == 104
    _dispatch(d, _req(P.Op.READ, 2, _read_body(1, 3)))
    assert _reply(s)[2] == b"ell"
    assert d.row[P.Op.LOOKUP] == 2 and d.row[P.Op.READ] == 1


def test_dispatch_engine_answers(fake_dev):
    d, s = fake_dev
    cases = {P.Op.IOCTL: -errno.ENOTTY, P.Op.OPEN: -errno.ENOSYS, P.Op.OPENDIR: -errno.ENOSYS,
             P.Op.FLUSH: -errno.ENOSYS, P.Op.GETXATTR: -errno.ENOSYS, P.Op.POLL: -errno.ENOSYS,
             P.Op.LSEEK: -errno.ENOSYS, P.Op.READLINK: -errno.ENOSYS,
             P.Op.STATX: -errno.ENOSYS, 99: -errno.ENOSYS, 63: -errno.ENOSYS,
             4096: -errno.ENOSYS, 0xFFFFFFFF: -errno.ENOSYS, P.Op.INIT: -errno.EPROTO}
    for op in P.WRITE_OPS:
        cases[op] = -errno.EROFS
    for i, (op, want) in enumerate(cases.items()):
        _dispatch(d, _req(op, 1, bytes(64), unique=1000 + i))
        assert _reply(s) == (want, 1000 + i, b""), P.OP_NAMES.get(op, op)
    _dispatch(d, _req(P.Op.STATFS, 1))
    assert len(_reply(s)[2]) == 80
    _dispatch(d, _req(P.Op.RELEASE, 2, P.RELEASE_IN.pack(0, 0, 0, 0), unique=9))
    assert _reply(s) == (0, 9, b"")


def test_dispatch_no_reply_ops(fake_dev):
    d, s = fake_dev
    _dispatch(d, _req(P.Op.FORGET, 5, P.FORGET_IN.pack(3)))
    _dispatch(d, _req(P.Op.BATCH_FORGET, 0, P.BATCH_FORGET_IN.pack(2, 0)
                      + P.FORGET_ONE.pack(8, 1) + P.FORGET_ONE.pack(9, 4)))
    _dispatch(d, _req(P.Op.INTERRUPT, 0, P.INTERRUPT_IN.pack(12)))
    assert _reply(s) is None
    assert d.handler.forgotten == [(5, 3), (8, 1), (9, 4)]


def test_dispatch_xattr_and_opendir_options():
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    b.settimeout(0.2)
    try:
        d = Dispatcher(a.fileno(), _Handler(), bufsize=1 << 16,
                       options=EngineOptions(opendir="cache", xattr="empty"))
        _dispatch(d, _req(P.Op.OPENDIR, 1, P.OPEN_IN.pack(0, 0)))
        _fh, flags, _ = P.OPEN_OUT.unpack(_reply(b)[2])
        assert flags == P.FOPEN_CACHE_DIR | P.FOPEN_KEEP_CACHE
        _dispatch(d, _req(P.Op.GETXATTR, 2, P.GETXATTR_IN.pack(100, 0) + b"user.x\0"))
        assert _reply(b)[0] == -errno.ENODATA
        _dispatch(d, _req(P.Op.LISTXATTR, 2, P.GETXATTR_IN.pack(0, 0)))
        assert _reply(b)[2] == P.GETXATTR_OUT.pack(0, 0)
        _dispatch(d, _req(P.Op.LISTXATTR, 2, P.GETXATTR_IN.pack(4096, 0)))
        assert _reply(b)[2] == b""
        with pytest.raises(ValueError):
            EngineOptions(opendir="sometimes")
    finally:
        a.close()
        b.close()


def test_dispatch_malformed_requests_never_crash(fake_dev):
    d, s = fake_dev
    # shorter than 16 bytes: no usable unique, dropped
    _dispatch(d, b"\x01\x02\x03")
    assert _reply(s) is None
    # a header cut short but with its unique: EIO to that unique
    _dispatch(d, _req(P.Op.LOOKUP, unique=31)[:30])
    assert _reply(s) == (-errno.EIO, 31, b"")
    # length field disagrees with what was read
    _dispatch(d, _req(P.Op.LOOKUP, 1, b"f\0", unique=32, length=500))
    assert _reply(s) == (-errno.EIO, 32, b"")
    # name without its NUL, empty name
    _dispatch(d, _req(P.Op.LOOKUP, 1, b"f", unique=33))
    assert _reply(s) == (-errno.EIO, 33, b"")
    _dispatch(d, _req(P.Op.LOOKUP, 1, b"", unique=34))
    assert _reply(s) == (-errno.EIO, 34, b"")
    # truncated READ / READDIRPLUS / GETATTR / BATCH_FORGET structs
    for i, (op, body) in enumerate([(P.Op.READ, b"\0" * 10), (P.Op.READDIRPLUS, b""),
                                    (P.Op.GETATTR, b"\0"),
                                    (P.Op.BATCH_FORGET, P.BATCH_FORGET_IN.pack(1000, 0)),
                                    (P.Op.FORGET, b"")]):
        _dispatch(d, _req(op, 2, body, unique=40 + i))
        assert _reply(s) == (-errno.EIO, 40 + i, b""), P.OP_NAMES[op]
    # extension length larger than the request
    raw = P.IN_HEADER.pack(48, P.Op.LOOKUP, 50, 1, 0, 0, 0, 100, 0) + b"f\0" + bytes(6)
    _dispatch(d, raw)
    assert _reply(s) == (-errno.EIO, 50, b"")
    assert d.row[C.MALFORMED] == 11


class _EveryMethod:
    """A handler with every method of the opcode table, each answering an empty payload."""

    def __getattr__(self, name):
        if name in {row.method for row in OPCODES.values()}:
            return lambda *args: b""
        raise AttributeError(name)


@pytest.mark.parametrize("op", sorted(OPCODES), ids=lambda op: P.OP_NAMES[op])
def test_dispatch_checks_each_body_against_the_table(op):
    """One size check, derived from the opcode's row: a request one byte shorter than its
    struct (and name) is malformed (EIO), one of exactly that length is served."""
    row = OPCODES[op]
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    b.settimeout(0.2)
    try:
        d = Dispatcher(a.fileno(), _EveryMethod(), bufsize=1 << 16)
        assert d.need[op] == row.need == P.IN_HEADER_SIZE + (
            row.body.size if row.body is not None else 0) + (2 if row.name else 0)
        body = bytes(row.need - P.IN_HEADER_SIZE)
        if row.name:
            body = body[:-2] + b"n\0"
        if row.need > P.IN_HEADER_SIZE:
            _dispatch(d, _req(op, 2, body[:-1], unique=1))
            assert _reply(b) == (-errno.EIO, 1, b"")
            assert d.row[C.MALFORMED] == 1
        _dispatch(d, _req(op, 2, body, unique=2))
        got = _reply(b)
        if op in (P.Op.FORGET, P.Op.BATCH_FORGET):
            assert got is None  # no reply, and no complaint
        else:
            assert got == (0, 2, b"")
        assert d.row[C.MALFORMED] == (1 if row.need > P.IN_HEADER_SIZE else 0)
    finally:
        a.close()
        b.close()


def test_dispatch_handler_errors_become_eio(fake_dev):
    d, s = fake_dev
    _dispatch(d, _req(P.Op.LOOKUP, 1, b"boom\0", unique=60))
    assert _reply(s) == (-errno.EIO, 60, b"")
    _dispatch(d, _req(P.Op.LOOKUP, 1, b"badtype\0", unique=61))
    assert _reply(s) == (-errno.EIO, 61, b"")
    _dispatch(d, _req(P.Op.LOOKUP, 1, b"bigerr\0", unique=62))  # errno outside 1..511
    assert _reply(s) == (-errno.EIO, 62, b"")
    assert d.row[C.HANDLER_ERROR] == 2


def test_dispatch_trims_oversized_replies(fake_dev):
    d, s = fake_dev
    _dispatch(d, _req(P.Op.READ, 3, _read_body(0, 1000)))
    assert _reply(s)[2] == b"z" * 1000
    _dispatch(d, _req(P.Op.READDIRPLUS, 3, _read_body(0, 4096)))
    payload = _reply(s)[2]
    assert 0 < len(payload) <= 4096
    assert next(R.iter_dirents(payload, True))[1] == 1
    assert d.row[C.OVERSIZED] == 2


def test_dispatch_payload_length_is_counted_in_bytes():
    """Numpy arrays and multi-byte memoryviews are sent whole, with their byte length in the
    header (a wrong length would make the kernel reject the reply and leave the caller
    waiting); a non-contiguous buffer is answered EIO."""
    attrs = R.make_attrs(np.array([2]), np.array([5]), np.array([stat.S_IFREG | 0o644]))
    entry = R.EntryTable(attrs).entries  # structured array: len() == 1, nbytes == 128
    words = memoryview(bytearray(range(64))).cast("Q")  # len() == 8, nbytes == 64

    class H:
        def lookup(self, parent, name):
            return {b"entry": entry, b"words": words,
                    b"strided": np.arange(64, dtype=np.uint8)[::2],
                    b"big": np.zeros(10, dtype=np.uint64),
                    b"rows": memoryview(np.zeros((4, 8), dtype=np.uint8))}[name]

        def read(self, nodeid, offset, size):
            return np.arange(100, dtype=np.uint32)  # 400 bytes, more than asked

    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    b.settimeout(0.5)
    try:
        d = Dispatcher(a.fileno(), H(), bufsize=1 << 16)
        _dispatch(d, _req(P.Op.LOOKUP, 1, b"entry\0", unique=1))
        assert _reply(b) == (0, 1, entry.tobytes())
        _dispatch(d, _req(P.Op.LOOKUP, 1, b"words\0", unique=2))
        assert _reply(b) == (0, 2, bytes(range(64)))
        _dispatch(d, _req(P.Op.LOOKUP, 1, b"big\0", unique=3))
        assert _reply(b) == (0, 3, bytes(80))
        _dispatch(d, _req(P.Op.LOOKUP, 1, b"rows\0", unique=6))
        assert _reply(b) == (0, 6, bytes(32))
        _dispatch(d, _req(P.Op.LOOKUP, 1, b"strided\0", unique=4))
        assert _reply(b) == (-errno.EIO, 4, b"")
        _dispatch(d, _req(P.Op.READ, 2, _read_body(0, 10), unique=5))
        assert _reply(b) == (0, 5, np.arange(100, dtype=np.uint32).tobytes()[:10])
    finally:
        a.close()
        b.close()


def test_dispatch_fuzz_random_bytes(fake_dev):
    """Random and mutated requests: the dispatcher always returns, answering or dropping."""
    d, s = fake_dev
    rng = random.Random(1234)
    valid = [_req(P.Op.LOOKUP, 1, b"f\0"), _req(P.Op.READ, 2, _read_body(0, 5)),
             _req(P.Op.READDIRPLUS, 1, _read_body(0, 4096)), _req(P.Op.GETATTR, 2, bytes(16)),
             _req(P.Op.BATCH_FORGET, 0, P.BATCH_FORGET_IN.pack(1, 0) + bytes(16))]
    for i in range(3000):
        if i % 2:
            raw = bytearray(rng.choice(valid))
            for _ in range(rng.randint(1, 6)):
                raw[rng.randrange(len(raw))] = rng.randrange(256)
            raw = bytes(raw[:rng.randint(0, len(raw))])
        else:
            raw = rng.randbytes(rng.randint(0, 200))
        _dispatch(d, raw)
        while _reply_nowait(s):
            pass


def _reply_nowait(sock) -> bool:
    sock.setblocking(False)
    try:
        sock.recv(1 << 20)
        return True
    except BlockingIOError:
        return False
    finally:
        sock.settimeout(0.2)


def test_run_loop_over_a_socket():
    """The inlined fast loop gives the same answers as handle(), and ends at EOF."""
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        d = Dispatcher(a.fileno(), _Handler(), bufsize=1 << 16)
        t = threading.Thread(target=d.run)
        t.start()
        reqs = [_req(P.Op.LOOKUP, 1, b"f\0", unique=1), _req(P.Op.IOCTL, 2, bytes(32), unique=2),
                _req(P.Op.FORGET, 2, P.FORGET_IN.pack(1), unique=3),
                _req(P.Op.LOOKUP, 1, b"boom\0", unique=4), b"short",
                _req(P.Op.READ, 2, _read_body(0, 100), unique=5),
                _req(P.Op.MKDIR, 1, bytes(8) + b"d\0", unique=6),
                _req(P.Op.LOOKUP, 1, b"wide\0", unique=7)]
        for r in reqs:
            b.send(r)
        b.settimeout(5)
        got = [_reply(b) for _ in range(6)]
        b.shutdown(socket.SHUT_WR)
        t.join(5)
        assert not t.is_alive()
        assert [(g[0], g[1]) for g in got] == [(0, 1), (-errno.ENOTTY, 2), (-errno.EIO, 4),
                                               (0, 5), (-errno.EROFS, 6), (0, 7)]
        assert got[3][2] == b"hello"
        assert got[5][2] == np.arange(4, dtype=np.uint64).tobytes()
        assert d.row[C.MALFORMED] == 1 and d.row[C.HANDLER_ERROR] == 1
    finally:
        a.close()
        b.close()


def test_counters_shared_file(tmp_path):
    path = str(tmp_path / "cnt")
    c = C.RequestCounters(3, path)
    c.row(1)[P.Op.LOOKUP] += 5
    c.row(2)[P.Op.LOOKUP] += 2
    c.row(2)[P.Op.IOCTL] += 1
    c.row(0)[200 % 64] += 0
    r = C.RequestCounters.attach(path)
    assert r.requests == 8
    assert r.requests_by_op == {"lookup": 7, "ioctl": 1}
    with pytest.raises(ValueError):
        (tmp_path / "junk").write_bytes(b"x" * 64)
        C.RequestCounters.attach(str(tmp_path / "junk"))


# ============================================================================ mounts: helpers

SPEC = {
    "files": {"a.txt": 11, "sub/b.bin": 300_000, "sub/deep/c.dat": 4097, "zero": 0,
              "big.bin": 3 << 20, **{f"many/f{i:03d}": 1000 + i for i in range(60)}},
    "dirs": ["empty"],
    "symlinks": {"lnk": "sub/b.bin", "dangling": "nowhere", "sub/up": "../a.txt"},
    "big_dirs": {"bigdir": 10_000},
}
FILES = SPEC["files"]


class MemMount:
    """A memfs served by ``python tests/kernel_memfs.py`` in a subprocess."""

    def __init__(self, tmp: Path, spec: dict, name: str, *args: str,
                 user: int | None = None) -> None:
        self.own_dir: str | None = None
        if user is not None:  # pytest's temp root is private to root: use a shared place
            self.own_dir = tempfile.mkdtemp(prefix="kfuse-test-", dir="/tmp")
            os.chmod(self.own_dir, 0o755)
            os.chown(self.own_dir, user, user)
            tmp = Path(self.own_dir)
        self.mnt = tmp / name
        self.mnt.mkdir(exist_ok=True)
        self.spec_path = tmp / f"{name}.json"
        self.spec_path.write_text(json.dumps(spec))
        self.counters_path = tmp / f"{name}.counters"
        self.err_path = tmp / f"{name}.stderr"
        if user is not None:
            os.chown(self.mnt, user, user)
        self.err = open(self.err_path, "w+")  # noqa: SIM115 - open for the mount's life
        cmd = [sys.executable, MEMFS, str(self.mnt),
               "--spec", str(self.spec_path), "--counters", str(self.counters_path),
               "--log-level", "INFO", *args]
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=self.err, text=True,
            preexec_fn=(  # noqa: PLW1509 - the only way to start it as another user
                (lambda: (os.setgid(user), os.setuid(user))) if user else None))
        self.pids: set[int] = {self.proc.pid}
        line = self._ready_line(60)
        parts = line.split()
        self.sup = int(parts[1])
        self.workers = [int(p) for p in parts[2:]]
        self.pids.update(self.workers)
        self.counters = C.RequestCounters.attach(str(self.counters_path))

    def _ready_line(self, timeout: float) -> str:
        import selectors

        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if sel.select(0.2):
                line = self.proc.stdout.readline()
                if line.startswith("READY"):
                    return line
                if not line:
                    break
        self.close()
        raise AssertionError(f"memfs did not get ready:\n{self.stderr()}")

    def stderr(self) -> str:
        self.err.flush()
        return self.err_path.read_text(errors="replace")

    def snap(self) -> dict[str, int]:
        return self.counters.snapshot()

    def current_workers(self) -> list[int]:
        return _children(self.sup)

    def kernel_flags(self) -> int:
        for line in self.stderr().splitlines():
            if "kernel flags" in line:
                return int(line.rsplit(" ", 1)[1], 16)
        return 0

    def wait(self, timeout: float = 20) -> int:
        return self.proc.wait(timeout)

    def close(self) -> None:
        """Stop the server and everything it started; unmount. Never raises."""
        if hasattr(self, "sup"):
            self.pids.update(_children(self.sup))  # (never raises)
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                pass
        for pid in self.pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            pass
        for _ in range(2):
            if is_mounted(str(self.mnt)):
                subprocess.run(["umount", "-l", str(self.mnt)], capture_output=True, check=False)
                subprocess.run(["fusermount3", "-u", "-z", str(self.mnt)], capture_output=True,
                               check=False)
        self.err.close()
        if self.proc.stdout:
            self.proc.stdout.close()
        if self.own_dir and not is_mounted(str(self.mnt)):
            shutil.rmtree(self.own_dir, ignore_errors=True)


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(x) for x in f.read().split()]
    except OSError:
        return []


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def _wait_until(pred, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


@pytest.fixture
def memmount(tmp_path):
    """Factory: ``m = memmount(*cli_args, spec=SPEC)``; every mount is torn down."""
    made: list[MemMount] = []

    def make(*args: str, spec: dict | None = None, user: int | None = None) -> MemMount:
        m = MemMount(tmp_path, spec or SPEC, f"m{len(made)}", *args, user=user)
        made.append(m)
        return m

    try:
        yield make
    finally:
        for m in reversed(made):
            m.close()


def _expected(rel: str) -> bytes:
    return bytes(memfs.content_for(rel, FILES[rel]))


READER = r"""
import hashlib, json, os, sys
root, rels, mode = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
out = {}
for rel in rels:
    p = os.path.join(root, rel)
    if mode == "raw":
        with open(p, "rb", buffering=0) as f:
            data = f.read()
    else:
        with open(p, "rb") as f:
            data = f.read()
    out[rel] = hashlib.sha256(data).hexdigest()
print(json.dumps(out))
"""


def _read_in_processes(root: Path, rels: list[str], nproc: int, mode: str = "raw"
                       ) -> dict[str, str]:
    procs = []
    for k in range(nproc):
        part = rels[k::nproc]
        procs.append(subprocess.Popen([sys.executable, "-c", READER, str(root),
                                       json.dumps(part), mode], stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    got: dict[str, str] = {}
    try:
        for p in procs:
            out, err = p.communicate(timeout=120)
            assert p.returncode == 0, err
            got.update(json.loads(out))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return got


# ============================================================================ mounts: reading


@needs_fuse
@pytest.mark.fuse
@pytest.mark.parametrize("how", [pytest.param("mount2", marks=needs_root), "fusermount"])
def test_read_back_byte_exact(memmount, how):
    m = memmount(*(["--fusermount"] if how == "fusermount" else []), "--workers", "2")
    mounts = Path("/proc/self/mounts").read_text()
    line = next(ln for ln in mounts.splitlines() if f" {m.mnt} " in ln)
    assert line.split()[2] == "fuse.memfs" and "ro," in line and "default_permissions" in line
    rels = list(FILES)
    got = _read_in_processes(m.mnt, rels * 2, 4)
    assert got == {r: hashlib.sha256(_expected(r)).hexdigest() for r in rels}
    # partial reads at odd offsets, through the kernel's page cache and read-ahead
    with open(m.mnt / "big.bin", "rb", buffering=0) as f:
        f.seek(1_000_001)
        assert f.read(70_000) == _expected("big.bin")[1_000_001:1_070_001]
        f.seek((3 << 20) - 5)
        assert f.read(100) == _expected("big.bin")[-5:]
    assert m.snap().get("read", 0) > 0


@needs_fuse
@needs_root
@pytest.mark.fuse
def test_tree_listing_stat_symlinks_statvfs(memmount):
    m = memmount("--workers", "2")
    root = m.mnt
    assert sorted(os.listdir(root)) == sorted(
        ["a.txt", "sub", "zero", "big.bin", "many", "empty", "lnk", "dangling", "bigdir"])
    with os.scandir(root / "sub") as it:
        kinds = {e.name: (e.is_dir(follow_symlinks=False), e.is_symlink()) for e in it}
    assert kinds == {"b.bin": (False, False), "deep": (True, False), "up": (False, True)}
    st = os.stat(root / "sub/b.bin")
    assert stat.S_ISREG(st.st_mode) and st.st_size == 300_000 and st.st_mode & 0o777 == 0o644
    assert st.st_mtime == 1_700_000_000.25 and st.st_nlink == 1
    assert os.stat(root / "sub").st_nlink == 3  # . + .. + deep
    assert os.readlink(root / "lnk") == "sub/b.bin"
    assert os.readlink(root / "sub/up") == "../a.txt"
    assert (root / "lnk").read_bytes() == _expected("sub/b.bin")
    assert (root / "sub/up").read_bytes() == _expected("a.txt")
    assert os.lstat(root / "dangling").st_size == len("nowhere")
    with pytest.raises(FileNotFoundError):
        os.stat(root / "dangling")
    ls = subprocess.run(["ls", "-l", str(root / "sub")], capture_output=True, text=True,
                        timeout=30, check=False)
    assert ls.returncode == 0 and "300000" in ls.stdout and "up -> ../a.txt" in ls.stdout
    found = subprocess.run(["find", str(root), "-type", "f", "-not", "-path", "*/bigdir/*"],
                           capture_output=True, text=True, timeout=60, check=False)
    assert found.returncode == 0
    assert sorted(os.path.relpath(p, root) for p in found.stdout.split()) == sorted(FILES)
    sv = os.statvfs(root)
    assert sv.f_bsize == 4096 and sv.f_namemax == 255 and sv.f_flag & os.ST_RDONLY
    total = sum(FILES.values())
    assert sv.f_blocks == (total + 4095) // 4096
    assert subprocess.run(["stat", str(root / "zero")], capture_output=True,
                          timeout=30, check=False).returncode == 0
    assert (root / "zero").read_bytes() == b""
    assert os.listdir(root / "empty") == []


@needs_fuse
@needs_root
@pytest.mark.fuse
def test_errnos_enoent_enotdir(memmount):
    m = memmount("--workers", "1")
    root = m.mnt
    for func, path, want in [(os.stat, "missing", errno.ENOENT),
                             (os.stat, "sub/missing/x", errno.ENOENT),
                             (os.stat, "a.txt/x", errno.ENOTDIR),
                             (os.listdir, "a.txt", errno.ENOTDIR),
                             (os.readlink, "a.txt", errno.EINVAL)]:
        with pytest.raises(OSError) as info:
            func(root / path)
        assert info.value.errno == want, (func, path)


_SYS_getdents64 = 217  # x86_64


def _getdents(fd: int, bufsize: int) -> list[tuple[int, str]]:
    """One getdents64 call: [(d_off, name)]."""
    libc = ctypes.CDLL(None, use_errno=True)
    buf = ctypes.create_string_buffer(bufsize)
    n = libc.syscall(_SYS_getdents64, fd, buf, bufsize)
    if n < 0:
        raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
    out = []
    pos = 0
    raw = buf.raw[:n]
    while pos < n:
        _ino, off, reclen, _typ = struct.unpack_from("=QqHB", raw, pos)
        name = raw[pos + 19:pos + reclen].split(b"\0", 1)[0].decode()
        out.append((off, name))
        pos += reclen
    return out


@needs_fuse
@needs_root
@pytest.mark.fuse
@pytest.mark.skipif(os.uname().machine != "x86_64", reason="getdents64 syscall number")
def test_big_directory_small_getdents_buffers_and_seek(memmount):
    m = memmount("--workers", "2")
    d = m.mnt / "bigdir"
    want = [".", ".."] + [f"entry-{i:06d}-with-a-longer-name" for i in range(10_000)]
    fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    try:
        got: list[tuple[int, str]] = []
        while True:
            chunk = _getdents(fd, 600)  # a few entries per call: many small requests
            if not chunk:
                break
            got += chunk
        assert [n for _, n in got] == want
        rdp = m.snap().get("readdirplus", 0)
        assert rdp > 10_000 // 25  # small buffers really made small requests
        # seek back to a cookie in the middle: the listing resumes right after it
        cookie = {n: off for off, n in got}[want[5000]]
        os.lseek(fd, cookie, os.SEEK_SET)
        rest = []
        while True:
            chunk = _getdents(fd, 4096)
            if not chunk:
                break
            rest += [n for _, n in chunk]
        assert rest == want[5001:]
        os.lseek(fd, 0, os.SEEK_SET)
        assert [n for _, n in _getdents(fd, 600)][:3] == want[:3]
    finally:
        os.close(fd)
    assert sorted(os.listdir(d)) == want[2:]


# ============================================================================ mounts: EROFS


def _write_attempts(root: Path) -> dict[str, int | None]:
    def err(fn, *a):
        try:
            fn(*a)
        except OSError as exc:
            return exc.errno
        return None

    def open_and_write(p, flags):
        fd = os.open(p, flags, 0o644)
        try:
            os.write(fd, b"x")
        finally:
            os.close(fd)

    f = root / "a.txt"
    return {
        "open O_WRONLY+write": err(open_and_write, f, os.O_WRONLY),
        "open O_RDWR|O_APPEND+write": err(open_and_write, f, os.O_RDWR | os.O_APPEND),
        "open O_TRUNC": err(open_and_write, f, os.O_WRONLY | os.O_TRUNC),
        "create": err(open_and_write, root / "new", os.O_WRONLY | os.O_CREAT),
        "mkdir": err(os.mkdir, root / "newdir"),
        "unlink": err(os.unlink, f),
        "rmdir": err(os.rmdir, root / "empty"),
        "rename": err(os.rename, f, root / "renamed"),
        "chmod": err(os.chmod, f, 0o600),
        "chown": err(os.chown, f, 1, 1),
        "truncate": err(os.truncate, f, 0),
        "utime": err(os.utime, f, (1, 1)),
        "setxattr": err(os.setxattr, f, "user.k", b"v"),
        "removexattr": err(os.removexattr, f, "user.k"),
        "symlink": err(os.symlink, "a.txt", root / "ln2"),
        "link": err(os.link, f, root / "hard"),
        "mknod": err(os.mknod, root / "fifo", stat.S_IFIFO | 0o644),
    }


@needs_fuse
@needs_root
@pytest.mark.fuse
@pytest.mark.parametrize("rw", [False, True], ids=["ro-mount", "rw-mount-daemon-refuses"])
def test_every_write_path_is_erofs(memmount, rw):
    m = memmount(*(["--rw"] if rw else []), "--workers", "2")
    before = m.snap()
    results = _write_attempts(m.mnt)
    # removexattr of a name that was never set: the daemon says EROFS before looking
    assert results == {k: errno.EROFS for k in results}, results
    assert (m.mnt / "a.txt").read_bytes() == _expected("a.txt")
    d = C.diff(m.snap(), before)
    if rw:
        # the kernel let them through to the daemon, which refused each one
        for op in ("setattr", "mkdir", "unlink", "rmdir", "rename", "write", "symlink",
                   "link", "mknod", "setxattr", "removexattr"):
            assert d.get(op, 0) >= 1, (op, d)
    else:
        for op in P.WRITE_OPS:
            assert P.OP_NAMES[op] not in d, d


# ============================================================================ request counting


@needs_fuse
@needs_root
@pytest.mark.fuse
def test_zero_message_open_warm_pass_sends_nothing(memmount):
    m = memmount("--workers", "2")
    rels = [f"many/f{i:03d}" for i in range(60)]
    n = len(rels)
    _read_in_processes(m.mnt, rels, 2, "raw")  # cold: lookups and reads
    cold = m.snap()
    # OPEN until the first ENOSYS reply (one per racing process at most), then none
    assert cold.get("open", 0) <= 2 and cold.get("release", 0) == 0
    assert cold.get("read", 0) >= n
    got = _read_in_processes(m.mnt, rels, 2, "raw")  # warm, buffering=0: zero requests
    assert got == {r: hashlib.sha256(_expected(r)).hexdigest() for r in rels}
    warm = m.snap()
    assert C.diff(warm, cold) == {}
    _read_in_processes(m.mnt, rels, 2, "default")  # default open(): one ioctl (isatty) each
    assert C.diff(m.snap(), warm) == {"ioctl": n}


@needs_fuse
@needs_root
@pytest.mark.fuse
@pytest.mark.parametrize("opendir", ["enosys", "cache"])
def test_directory_listings_are_cached(memmount, opendir):
    m = memmount("--workers", "2", "--opendir", opendir)
    # RELEASEDIR is sent in the background after close: wait for it before each snapshot
    released = (lambda k: m.snap().get("releasedir", 0) >= k) if opendir == "cache" else (
        lambda k: True)
    first = sorted(os.listdir(m.mnt / "many"))
    assert _wait_until(lambda: released(1))
    s1 = m.snap()
    assert s1.get("readdirplus", 0) >= 1
    second = sorted(os.listdir(m.mnt / "many"))
    assert _wait_until(lambda: released(2))
    time.sleep(0.2)  # anything else would have arrived by now
    s2 = m.snap()
    assert first == second
    d = C.diff(s2, s1)
    assert "readdirplus" not in d and "readdir" not in d, d
    if opendir == "enosys":
        assert d == {}  # zero-message opendir: nothing at all
    else:
        assert d == {"opendir": 1, "releasedir": 1}


@needs_fuse
@needs_root
@pytest.mark.fuse
@pytest.mark.parametrize("ra", ["default", "kernel"])
def test_one_read_request_per_mib_with_the_read_ahead_set(memmount, ra):
    """max_pages 256 lets a READ carry 1 MiB, but the kernel's read-ahead (128 KiB, all
    INIT can offer) splits a 1 MiB read() into 8 READs unless the bdi's read_ahead_kb is
    raised after INIT, which the engine does by default as root."""
    m = memmount("--workers", "1", *(["--read-ahead-kb", "0"] if ra == "kernel" else []))
    before = m.snap().get("read", 0)
    with open(m.mnt / "big.bin", "rb", buffering=0) as f:
        data = b"".join(iter(lambda: f.read(1 << 20), b""))
    assert data == _expected("big.bin")
    reads = m.snap().get("read", 0) - before
    if ra == "default":
        assert reads == 3, reads  # 3 MiB in 1 MiB READs
    else:
        assert reads == 24, reads  # 3 MiB in 128 KiB READs


@needs_fuse
@needs_root
@pytest.mark.fuse
def test_xattr_enosys_is_asked_once(memmount):
    m = memmount("--workers", "1")
    for _ in range(3):
        subprocess.run(["ls", "-l", str(m.mnt / "many")], capture_output=True, timeout=30,
                       check=True)
        with pytest.raises(OSError) as info:
            os.getxattr(m.mnt / "a.txt", "user.x")
        assert info.value.errno == errno.EOPNOTSUPP
    s = m.snap()
    assert s.get("getxattr", 0) <= 1 and s.get("listxattr", 0) <= 1


# ============================================================================ supervision


@needs_fuse
@needs_root
@pytest.mark.fuse
def test_killed_worker_is_replaced_and_reads_go_on(memmount):
    m = memmount("--workers", "2")
    assert len(m.current_workers()) == 2
    victim = m.workers[0]
    os.kill(victim, signal.SIGKILL)
    assert _wait_until(lambda: victim not in m.current_workers()
                       and len(m.current_workers()) == 2)
    assert "died (signal SIGKILL); starting a replacement" in m.stderr()
    m.pids.update(m.current_workers())
    got = _read_in_processes(m.mnt, list(FILES), 2)
    assert got == {r: hashlib.sha256(_expected(r)).hexdigest() for r in FILES}
    assert m.proc.poll() is None


@needs_fuse
@needs_root
@pytest.mark.fuse
@pytest.mark.parametrize("clone", [True, False], ids=["clone-fd", "shared-fd"])
def test_worker_killed_mid_request_the_request_is_not_lost(memmount, clone):
    spec = dict(SPEC, delays={"sub/deep/c.dat": 2.0})
    m = memmount("--workers", "1", *([] if clone else ["--no-clone"]), spec=spec)
    result: dict = {}

    def reader():
        try:
            result["data"] = (m.mnt / "sub/deep/c.dat").read_bytes()
        except OSError as exc:
            result["errno"] = exc.errno

    t = threading.Thread(target=reader)
    t.start()
    assert _wait_until(lambda: m.snap().get("read", 0) >= 1)  # the worker is in read()
    os.kill(m.workers[0], signal.SIGKILL)
    t.join(30)
    assert not t.is_alive()
    if m.kernel_flags() & (1 << 39):  # FUSE_HAS_RESEND: requeued, served by the new worker
        assert result.get("data") == _expected("sub/deep/c.dat"), result
    elif clone:  # the dead worker's clone fd is closed: the call fails instead of hanging
        assert result.get("errno") == errno.ECONNABORTED, result
    else:
        pytest.skip("without FUSE_HAS_RESEND a request held by a dead worker on a shared fd "
                    "waits until the unmount")
    m.pids.update(m.current_workers())


@needs_fuse
@needs_root
@pytest.mark.fuse
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP],
                         ids=["TERM", "INT", "HUP"])
def test_stop_signal_unmounts_and_no_worker_survives(memmount, sig):
    m = memmount("--workers", "3")
    workers = m.current_workers()
    assert len(workers) == 3
    os.kill(m.sup, sig)
    assert m.wait(20) == 0
    assert f"{signal.Signals(sig).name} received; unmounting" in m.stderr()
    assert not is_mounted(str(m.mnt))
    assert _wait_until(lambda: not any(_alive(p) for p in workers), 5)


@needs_fuse
@needs_root
@pytest.mark.fuse
def test_sigkill_supervisor_workers_exit_and_stale_mount_is_cleaned(memmount):
    m = memmount("--workers", "2")
    workers = m.current_workers()
    os.kill(m.sup, signal.SIGKILL)
    m.wait(10)
    assert _wait_until(lambda: not any(_alive(p) for p in workers), 10)
    assert mount_state(str(m.mnt)) == "stale"
    assert cleanup_stale(str(m.mnt)) is True
    assert mount_state(str(m.mnt)) == "none" and not is_mounted(str(m.mnt))
    assert cleanup_stale(str(m.mnt)) is False


@needs_fuse
@needs_root
@pytest.mark.fuse
def test_new_mount_cleans_a_stale_one(memmount, tmp_path):
    m = memmount("--workers", "1")
    os.kill(m.sup, signal.SIGKILL)
    m.wait(10)
    assert _wait_until(lambda: mount_state(str(m.mnt)) == "stale", 10)
    s = KernelSession(str(m.mnt))
    try:
        s.mount()  # cleans the stale mount, then mounts again
        assert is_mounted(str(m.mnt))
    finally:
        s.close()
    assert not is_mounted(str(m.mnt))


@needs_fuse
@pytest.mark.fuse
@pytest.mark.parametrize("how", [pytest.param("umount", marks=needs_root), "fusermount3"])
def test_outside_unmount_ends_the_session(memmount, how):
    m = memmount("--workers", "2")
    workers = m.current_workers()
    assert os.listdir(m.mnt)
    cmd = ["umount", str(m.mnt)] if how == "umount" else ["fusermount3", "-u", str(m.mnt)]
    subprocess.run(cmd, check=True, capture_output=True, timeout=30)
    assert m.wait(20) == 0
    assert "unmounted from outside" in m.stderr()
    assert _wait_until(lambda: not any(_alive(p) for p in workers), 5)


_CRASHY = r"""
import sys
from fanstore.errors import MountError
from fanstore.fuse.engine import KernelSession
s = KernelSession(sys.argv[1], crash_limit=3, crash_window=30)
s.mount()
def factory():
    raise RuntimeError("cannot build the handler")
try:
    s.serve(factory, 2)
except MountError as exc:
    print("MOUNTERROR", exc)
finally:
    s.close()
"""


@needs_fuse
@needs_root
@pytest.mark.fuse
def test_crash_loop_stops_the_mount_with_a_message(tmp_path):
    mnt = tmp_path / "crash"
    mnt.mkdir()
    p = subprocess.Popen([sys.executable, "-c", _CRASHY, str(mnt)], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    try:
        out, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
        if is_mounted(str(mnt)):
            subprocess.run(["umount", "-l", str(mnt)], check=False)
    assert "MOUNTERROR" in out and "workers died within 30 s" in out, (out, err)
    assert "handler_factory failed" in err
    assert not is_mounted(str(mnt))


@needs_fuse
@pytest.mark.fuse
@pytest.mark.skipif(not ROOT, reason="needs root to switch to an unprivileged user")
def test_unprivileged_mount_through_fusermount(memmount):
    from second_user import fuse_device_for_all, reachable_for_others

    nobody = 65534
    as_nobody = lambda: (os.setgid(nobody), os.setuid(nobody))
    repo = Path(__file__).resolve().parent.parent
    with contextlib.ExitStack() as stack:
        # the venv's interpreter may sit under a 0700 home, /dev/fuse may be 0600 here
        stack.enter_context(reachable_for_others(os.path.realpath(sys.executable), repo,
                                                 sys.prefix))
        stack.enter_context(fuse_device_for_all())
        ok = subprocess.run([sys.executable, MEMFS, "--help"],
                            capture_output=True, preexec_fn=as_nobody,
                            check=False).returncode == 0
        assert ok, "the interpreter is not usable by user nobody even made reachable"
        _unprivileged_mount_as(memmount, nobody, as_nobody)


def _unprivileged_mount_as(memmount, nobody, as_nobody):
    m = memmount("--workers", "2", user=nobody)
    line = next(ln for ln in Path("/proc/self/mounts").read_text().splitlines()
                if f" {m.mnt} " in ln)
    assert f"user_id={nobody}" in line
    # root may not enter another user's mount without allow_other: read as nobody
    r = subprocess.run([sys.executable, "-c", READER, str(m.mnt), json.dumps(["sub/b.bin"]),
                        "raw"], capture_output=True, text=True, timeout=60,
                       preexec_fn=as_nobody, check=False)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["sub/b.bin"] == hashlib.sha256(
        _expected("sub/b.bin")).hexdigest()
    os.kill(m.sup, signal.SIGTERM)
    assert m.wait(20) == 0
    assert not is_mounted(str(m.mnt))


# ============================================================================ in-process API


@needs_fuse
@needs_root
@pytest.mark.fuse
def test_session_in_a_thread_notify_store_and_inval(tmp_path):
    """serve() in a thread, stop() from outside; NOTIFY_STORE fills the page cache so a read
    sends no READ; NOTIFY_INVAL_INODE drops it again."""
    fs = memfs.MemFS()
    data = bytes(memfs.content_for("s.bin", 50_000))
    ino = fs.add_file("s.bin", data)
    fs.finalize()
    mnt = tmp_path / "thr"
    mnt.mkdir()
    s = KernelSession(str(mnt))
    s.mount()
    ready = threading.Event()
    ctxs: list = []

    def factory(ctx):
        ctxs.append(ctx.slot)  # runs in the worker: not visible here, only proves the call
        return memfs.MemHandler(fs)

    t = threading.Thread(target=lambda: s.serve(factory, 2, on_ready=lambda _s: ready.set()))
    t.start()
    try:
        assert ready.wait(30)
        assert s.conn.minor >= 31 and s.conn.max_pages == 256
        os.stat(mnt / "s.bin")  # the inode must be in the kernel's cache to store into it
        nfd = s.notify_fd()
        try:
            stored = b"S" * 8192
            assert notify_store(nfd, ino, 0, stored) == 0
            before = s.counters.snapshot()
            with open(mnt / "s.bin", "rb", buffering=0) as f:
                assert f.read(8192) == stored  # what we pushed, not what read() would say
            assert "read" not in C.diff(s.counters.snapshot(), before)
            assert notify_inval_inode(nfd, ino) == 0
            with open(mnt / "s.bin", "rb", buffering=0) as f:
                assert f.read() == data
            assert C.diff(s.counters.snapshot(), before).get("read", 0) >= 1
            assert notify_store(nfd, 999_999, 0, b"x") == errno.ENOENT
        finally:
            os.close(nfd)
    finally:
        s.stop()
        t.join(30)
        if t.is_alive():
            subprocess.run(["umount", "-l", str(mnt)], check=False)
        s.close()
    assert not t.is_alive() and s.exit_reason == "stopped"
    assert not is_mounted(str(mnt))
    assert s.requests >= 3 and "lookup" in s.requests_by_op


def test_mount_errors_are_clear(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(MountError, match="not a directory"):
        KernelSession(str(f)).mount()
    with pytest.raises(MountError, match="cannot use as a mount point"):
        KernelSession(str(tmp_path / "missing")).mount()
    with pytest.raises(MountError, match="mount\\(\\) first"):
        KernelSession(str(tmp_path)).serve(lambda: None, 1)
