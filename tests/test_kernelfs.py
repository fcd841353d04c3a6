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

from fanstore import strictjson
from fanstore.errors import SpecError
from fanstore.fuse.fsops import TIMEOUT, FsOps
from fanstore.fuse.engine import Dispatcher, RequestCounters
from fanstore.fuse.engine import counters as C
from fanstore.fuse.engine import proto as P
from fanstore.fuse.engine.records import iter_dirents
from fanstore.fuse.kernelfs.handler import KernelHandler
from fanstore.fuse.kernelfs.start import FrontendStart, read_start
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


# --------------------------------------------------------------------------- the start


def _start(**over) -> dict:
    """A FrontendStart's JSON (its share and spec as the node makes them)."""
    from fanstore.mountspec import MountSpec, NodeShare

    prefetch = over.pop("prefetch", False)
    share = NodeShare(spec=MountSpec("/s", "/mnt/x", mode="prefetch" if prefetch else "sync"),
                      mountpoint="/mnt/x", data_dir="/d", local_parts=(0, 2), replicated=(2,),
                      table=((0,), (1,), (0, 1)), index_copy="/dev/shm/x.idx",
                      socket_path="/run/ctl.sock", worker_socket="", fuse_workers=4)
    start = {"share": json.loads(strictjson.to_json(share)), "counters_path": "/run/counters",
             "ready_fd": 5, "daemon_pid": 1234, "debug": False, "log_format": None,
             "order_fd": 7 if prefetch else None, "window_fds": [8, 9] if prefetch else None}
    start.update(over)
    return start


def test_the_start_round_trips_through_a_pipe():
    for prefetch in (False, True):
        start = strictjson.from_json(FrontendStart, json.dumps(_start(prefetch=prefetch)))
        assert start.share.spec.prefetch == prefetch and start.share.local_parts == (0, 2)
        assert start.window_fds == ((8, 9) if prefetch else None)
        r, w = os.pipe()
        os.write(w, strictjson.to_json(start))
        os.close(w)
        assert read_start(r) == start


@pytest.mark.parametrize("raw, field", [
    (b"[1, 2]", "not a JSON object"),
    (b"{not json", "not a JSON object"),
    (json.dumps(_start(surprise=1)).encode(), "unknown key 'surprise'"),
    (json.dumps({k: v for k, v in _start().items() if k != "ready_fd"}).encode(),
     "missing key 'ready_fd'"),
    (json.dumps(_start(ready_fd="5")).encode(), "'ready_fd'"),
    (json.dumps(_start(ready_fd=-1)).encode(), "ready_fd"),
    (json.dumps(_start(daemon_pid=True)).encode(), "'daemon_pid'"),
    (json.dumps(_start(counters_path="")).encode(), "counters_path"),
    (json.dumps(_start(window_fds=[8])).encode(), "'window_fds'"),
    (json.dumps(_start(order_fd=7)).encode(), "prefetch mode"),
    (json.dumps(_start(prefetch=True, order_fd=None)).encode(), "prefetch mode"),
    (json.dumps(_start(share={})).encode(), "NodeShare: missing key"),
])
def test_a_bad_start_is_one_spec_error_line(raw, field):
    with pytest.raises(SpecError) as err:
        strictjson.from_json(FrontendStart, raw)
    text = str(err.value)
    assert field in text and "\n" not in text, text


def test_a_start_larger_than_its_limit_is_refused():
    r, w = os.pipe()
    os.write(w, b" " * 100)
    os.close(w)
    with pytest.raises(SpecError, match="larger than 10 bytes"):
        read_start(r, limit=10)


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
    os.write(w, json.dumps(_start(daemon_pid=-3)).encode())
    os.close(w)
    assert frontend_main(r) == SpecError("x").exit_code
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "daemon_pid >= 1" in err
