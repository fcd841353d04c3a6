"""FanStore's kernel frontend without a kernel: its handler driven through the engine's
Dispatcher with raw request bytes, its spec, its counter columns.

The way S3QL tests its Operations without a mount: a SOCK_SEQPACKET socketpair stands in
for /dev/fuse (one request per message each way, as the device does), the Dispatcher's real
loop (``run``) serves it in a thread, and each test writes ``fuse_in_header`` + body bytes
and checks the reply's bytes (error field, payload) against a small real store.
"""

from __future__ import annotations

import errno
import json
import os
import socket
import stat
import threading

import pytest
from helpers import copy_store, damage_file

from fanstore.errors import MountError
from fanstore.fuse.fsops import TIMEOUT, FsOps
from fanstore.fuse.engine import Dispatcher, RequestCounters
from fanstore.fuse.engine import counters as C
from fanstore.fuse.engine import proto as P
from fanstore.fuse.engine.records import iter_dirents
from fanstore.fuse.kernelfs.handler import KernelHandler
from fanstore.fuse.kernelfs.spec import FrontendSpec, read_spec
from fanstore.fuse.kernelfs.stats import (
    COL,
    PREFETCH_COLUMNS,
    READ_COLUMNS,
    RowPublisher,
    summed_stats,
)
from fanstore.store import LocalStore


class FakeDevice:
    """A KernelHandler over a store, served by a Dispatcher's loop on one end of a
    socketpair; :meth:`ask` writes a raw request to the other end and reads the reply."""

    def __init__(self, store_path) -> None:
        self.store = LocalStore(str(store_path))
        self.counters = RequestCounters(2)
        self.row = self.counters.row(1)
        reader = self.store.reader
        publisher = RowPublisher(self.row, reader.stats, reader.cache)
        self.handler = KernelHandler(FsOps(self.store.ns), reader, publish=publisher.publish)
        self.dev, self.kernel = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.kernel.settimeout(10)
        self.dispatcher = Dispatcher(self.dev.fileno(), self.handler, bufsize=1 << 20,
                                     row=self.row)
        self.thread = threading.Thread(target=self.dispatcher.run, daemon=True)
        self.thread.start()
        self._unique = 100

    def send(self, raw: bytes) -> None:
        self.kernel.send(raw)

    def reply(self) -> tuple[int, int, bytes]:
        msg = self.kernel.recv(4 << 20)
        length, err, unique = P.OUT_HEADER.unpack_from(msg)
        assert length == len(msg)  # the header's length is the reply's, always
        return err, unique, msg[P.OUT_HEADER_SIZE:]

    def ask(self, op: int, nodeid: int = P.ROOT_ID, body: bytes = b"") -> tuple[int, bytes]:
        """(error field, payload) of the reply to one well-formed request."""
        self._unique += 1
        self.send(request(op, nodeid, body, self._unique))
        err, unique, payload = self.reply()
        assert unique == self._unique
        return err, payload

    def lookup(self, parent: int, name: bytes) -> tuple[int, bytes]:
        return self.ask(P.Op.LOOKUP, parent, name + b"\0")

    def nodeid(self, path: str) -> int:
        node = P.ROOT_ID
        for part in path.split("/"):
            err, payload = self.lookup(node, part.encode())
            assert err == 0
            node = P.ENTRY_OUT_HEAD.unpack_from(payload)[0]
        return node

    def close(self) -> None:
        self.kernel.shutdown(socket.SHUT_WR)  # end of file: the loop returns
        self.thread.join(10)
        assert not self.thread.is_alive()
        self.dev.close()
        self.kernel.close()
        self.store.close()


def request(op: int, nodeid: int, body: bytes = b"", unique: int = 1) -> bytes:
    return P.IN_HEADER.pack(P.IN_HEADER_SIZE + len(body), op, unique, nodeid, 0, 0, 0, 0,
                            0) + body


def read_body(offset: int, size: int) -> bytes:
    return P.READ_IN.pack(0, offset, size, 0, 0, 0, 0)


@pytest.fixture
def device(small_store):
    d = FakeDevice(small_store)
    try:
        yield d
    finally:
        d.close()


# --------------------------------------------------------------------------- requests


def test_lookup_and_getattr(device, small_tree):
    want = small_tree[1]["sub/deeper/d.txt"]
    err, payload = device.lookup(P.ROOT_ID, b"sub")
    assert err == 0 and len(payload) == P.ENTRY_OUT_SIZE
    sub, _gen, entry_valid, attr_valid, _ns1, _ns2 = P.ENTRY_OUT_HEAD.unpack_from(payload)
    assert (entry_valid, attr_valid) == (TIMEOUT, TIMEOUT)
    assert stat.S_ISDIR(P.ATTR.unpack_from(payload, P.ENTRY_OUT_HEAD.size)[9])
    node = device.nodeid("sub/deeper/d.txt")
    err, payload = device.ask(P.Op.GETATTR, node, P.GETATTR_IN.pack(0, 0, 0))
    assert err == 0 and len(payload) == P.ATTR_OUT_SIZE
    attr = P.ATTR.unpack_from(payload, P.ATTR_OUT_HEAD.size)
    assert attr[0] == node and attr[1] == len(want) and stat.S_ISREG(attr[9])
    # a missing name: a negative entry the kernel caches (node 0), not an error
    err, payload = device.lookup(sub, b"nope")
    assert err == 0 and P.ENTRY_OUT_HEAD.unpack_from(payload)[:3] == (0, 0, TIMEOUT)
    err, _ = device.ask(P.Op.GETATTR, 10**6, P.GETATTR_IN.pack(0, 0, 0))
    assert err == -errno.ENOENT


def test_read_a_file_whole_and_in_part(device, small_tree):
    want = small_tree[1]["b.bin"]  # 10 KiB: three 4 KiB chunks
    node = device.nodeid("b.bin")
    err, payload = device.ask(P.Op.READ, node, read_body(0, 1 << 20))
    assert (err, payload) == (0, want)
    err, payload = device.ask(P.Op.READ, node, read_body(5000, 3000))
    assert (err, payload) == (0, want[5000:8000])
    err, payload = device.ask(P.Op.READ, node, read_body(len(want), 4096))
    assert (err, payload) == (0, b"")  # past the end: empty
    # counted once, by the read core, and published to the worker's row
    stats = device.store.reader.stats
    assert (stats.reads, stats.bytes_returned) == (3, len(want) + 3000)
    assert device.row[COL["reads"]] == 3 and device.row[COL["bytes_returned"]] == len(want) + 3000
    assert device.row[P.Op.READ] == 3
    err, _ = device.ask(P.Op.READ, device.nodeid("sub"), read_body(0, 4096))
    assert err == -errno.EISDIR
    err, _ = device.ask(P.Op.READ, 10**6, read_body(0, 4096))
    assert err == -errno.ENOENT


def test_readdirplus_lists_the_directory_with_its_entries(device):
    records = []
    offset = 0
    while True:
        err, payload = device.ask(P.Op.READDIRPLUS, P.ROOT_ID, read_body(offset, 4096))
        assert err == 0 and len(payload) <= 4096
        if not payload:
            break
        batch = list(iter_dirents(payload, plus=True))
        records += batch
        offset = batch[-1][1]
    assert [r[3] for r in records] == [b"a.txt", b"b.bin", b"empty", b"emptydir", b"link",
                                       b"sub"]
    assert [r[1] for r in records] == list(range(1, len(records) + 1))  # cookies
    # each direntplus carries the entry a LOOKUP gives
    err, payload = device.ask(P.Op.READDIRPLUS, P.ROOT_ID, read_body(5, 4096))
    assert err == 0
    err2, looked_up = device.lookup(P.ROOT_ID, b"sub")
    assert err2 == 0 and bytes(payload[:P.ENTRY_OUT_SIZE]) == looked_up
    assert device.ask(P.Op.READLINK, device.nodeid("link")) == (0, b"sub/c.txt")


def test_unknown_and_engine_opcodes(device):
    for op in (99, 4096, 0xFFFFFFFF):
        assert device.ask(op, P.ROOT_ID, bytes(16)) == (-errno.ENOSYS, b"")
    assert device.ask(P.Op.MKDIR, P.ROOT_ID, bytes(8) + b"d\0") == (-errno.EROFS, b"")
    assert device.ask(P.Op.OPEN, 2, P.OPEN_IN.pack(0, 0)) == (-errno.ENOSYS, b"")
    assert device.ask(P.Op.IOCTL, 2, bytes(P.IOCTL_IN.size)) == (-errno.ENOTTY, b"")
    err, payload = device.ask(P.Op.STATFS)
    assert err == 0 and len(payload) == P.STATFS_OUT_SIZE
    assert device.row[0] == 3  # the opcodes above 63 count as "unknown"


def test_truncated_requests_are_answered_eio(device):
    # a READ whose body is shorter than fuse_read_in
    device.send(request(P.Op.READ, 2, read_body(0, 4096)[:P.READ_IN.size - 1], unique=7))
    assert device.reply() == (-errno.EIO, 7, b"")
    # a header cut short (its unique still readable)
    device.send(request(P.Op.GETATTR, 2, unique=8)[:30])
    assert device.reply() == (-errno.EIO, 8, b"")
    # a LOOKUP name without its NUL, a length field that disagrees with the message
    device.send(request(P.Op.LOOKUP, 1, b"a.txt", unique=9))
    assert device.reply() == (-errno.EIO, 9, b"")
    raw = bytearray(request(P.Op.GETATTR, 2, P.GETATTR_IN.pack(0, 0, 0), unique=10))
    raw[0] += 1
    device.send(bytes(raw))
    assert device.reply() == (-errno.EIO, 10, b"")
    assert device.row[C.MALFORMED] == 4
    # and the loop goes on serving
    assert device.lookup(P.ROOT_ID, b"a.txt")[0] == 0


def test_a_damaged_file_is_eio_for_that_file_only(small_store, small_tree, tmp_path):
    bad = copy_store(small_store, tmp_path / "bad")
    damage_file(bad, "a.txt")
    d = FakeDevice(bad)
    try:
        assert d.ask(P.Op.READ, d.nodeid("a.txt"), read_body(0, 4096)) == (-errno.EIO, b"")
        assert d.ask(P.Op.READ, d.nodeid("sub/c.txt"), read_body(0, 4096)) == (
            0, small_tree[1]["sub/c.txt"])
        assert d.row[COL["errors"]] == 1 and d.store.reader.stats.reads == 2
    finally:
        d.close()


# --------------------------------------------------------------------------- the spec


def _spec(**over) -> dict:
    spec = {"mountpoint": "/mnt/x", "index_path": "/dev/shm/x.idx", "store": "/s",
            "data_dir": "/d", "local_parts": [0, 2], "replicated": [2],
            "socket_path": "/run/ctl.sock", "counters_path": "/run/counters", "workers": 4,
            "external_workers": 0, "worker_socket": "/run/workers.sock",
            "cache_bytes": 1 << 20, "allow_other": False, "fsname": "fanstore",
            "remote_timeout": 30.0, "ready_fd": 5, "daemon_pid": 1234}
    spec.update(over)
    return spec


def test_spec_round_trips_through_json():
    spec = FrontendSpec(**_spec(mode="prefetch", order_fd=7, window_fds=[8, 9],
                                prefetch_bytes=1 << 30, log_format=None, debug=True))
    again = FrontendSpec.from_json(spec.to_json())
    assert again == spec and again.local_parts == (0, 2) and again.window_fds == (8, 9)
    assert again.prefetch and not FrontendSpec(**_spec()).prefetch
    r, w = os.pipe()
    os.write(w, spec.to_json())
    os.close(w)
    assert read_spec(r) == spec


@pytest.mark.parametrize("raw, field", [
    (b"[1, 2]", "JSON object"),
    (b"{not json", "JSON object"),
    (json.dumps(_spec(surprise=1)).encode(), "surprise"),
    (json.dumps({k: v for k, v in _spec().items() if k != "mountpoint"}).encode(),
     "mountpoint"),
    (json.dumps(_spec(workers="4")).encode(), "workers"),
    (json.dumps(_spec(workers=0)).encode(), "workers"),
    (json.dumps(_spec(workers=True)).encode(), "workers"),
    (json.dumps(_spec(cache_bytes=-1)).encode(), "cache_bytes"),
    (json.dumps(_spec(local_parts=["a"])).encode(), "local_parts"),
    (json.dumps(_spec(replicated=[-1])).encode(), "replicated"),
    (json.dumps(_spec(remote_timeout=0)).encode(), "remote_timeout"),
    (json.dumps(_spec(allow_other="yes")).encode(), "allow_other"),
    (json.dumps(_spec(mountpoint="")).encode(), "mountpoint"),
    (json.dumps(_spec(mode="sometimes")).encode(), "mode"),
    (json.dumps(_spec(mode="prefetch", order_fd=7, prefetch_bytes=1)).encode(), "window_fds"),
    (json.dumps(_spec(mode="prefetch", window_fds=[8, 9], prefetch_bytes=1)).encode(),
     "order_fd"),
])
def test_a_bad_spec_is_one_mount_error_line(raw, field):
    with pytest.raises(MountError) as err:
        FrontendSpec.from_json(raw)
    text = str(err.value)
    assert field in text and "\n" not in text and text.startswith("the kernel frontend's spec")


# --------------------------------------------------------------------------- counters


def test_counter_columns_are_laid_out_once_and_unchanged():
    """The application columns of a worker's row, by name (the layout the daemon and the
    frontend share): the read core's from APP_COL0 (96; the chunk spill's and the decode
    counters appended after the first 18, which keep their places), prefetch mode's from
    120."""
    assert [COL[n] for n in READ_COLUMNS] == list(range(C.APP_COL0, C.APP_COL0 + 24))
    assert COL["peers_marked_dead"] == C.APP_COL0 + 17 and COL["spill_refused"] == 119
    assert [COL[n] for n in PREFETCH_COLUMNS] == list(range(120, 120 + 17))
    assert len(set(COL.values())) == len(COL) and max(COL.values()) < C.COLS


def test_summed_stats_adds_the_workers_rows(device):
    device.ask(P.Op.READ, device.nodeid("a.txt"), read_body(0, 100))
    other = device.counters.row(0)  # as if a second worker had read too
    other[COL["reads"]] = 5
    other[COL["decode_ns"]] = 2_000_000_000
    out = summed_stats(device.counters)
    assert out["reads"] == 6 and out["bytes_returned"] == 100
    assert out["decode_seconds"] >= 2.0 and "decode_ns" not in out
    assert out["requests_by_op"]["read"] == 1 and out["requests"] >= 2
    assert "prefetch_pushed" not in out
    assert summed_stats(device.counters, prefetch=True)["prefetch_pushed"] == 0


def test_the_frontend_process_refuses_a_bad_spec_in_one_line(capsys):
    from fanstore.fuse.kernelfs.process import frontend_main

    r, w = os.pipe()
    os.write(w, json.dumps(_spec(workers=-3)).encode())
    os.close(w)
    assert frontend_main(r) == MountError("x").exit_code
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "workers must be a whole number >= 1" in err
