"""The read core with routed sources, without mpiexec: ranks of one process wired by
``LocalTransport``. Remote reads, failover to a replica, a dead owner without one, and a
damaged local copy read again from a replica; then the node's control socket and a reader
process's ``NodeSource``; then the frontend-neutral operations and the pyfuse3 adapter
called directly (no kernel)."""

from __future__ import annotations

import errno
import os

import pytest

from fanstore.control import ControlClient, ControlServer, NodeSource
from fanstore.daemon import placement as pl
from fanstore.daemon.routing import PeerSource
from fanstore.daemon.transport import LocalHub, LocalTransport
from fanstore.errors import CorruptDataError, MountError, RemoteError
from fanstore.format.index import read_index
from fanstore.namespace import Namespace
from fanstore.read import ChunkReader, LocalPartitions, ReadStats, RoutedSource
from helpers import copy_store, damage_file, files_by_partition, run_cli

N_RANKS = 3


@pytest.fixture(scope="module")
def routed_store(small_tree, tmp_path_factory):
    """``small_tree`` packed into 3 partitions (one per rank)."""
    dest = tmp_path_factory.mktemp("routed") / "store"
    run_cli("pack", small_tree[0], dest, "--partitions", "3", "--chunk-kb", "4", "--jobs",
            "1", "--no-progress", "--codec", "zstd:3", check=True)
    return dest


class Job:
    """N ranks in this process: each opens only its own partitions (from ``dirs[rank]``)
    and reads the others through a PeerSource over a LocalTransport."""

    def __init__(self, store, replicas: int, dirs=None) -> None:
        self.index = read_index(str(store))
        self.ns = Namespace(self.index)
        self.table = pl.placement([p.broadcast for p in self.index.partitions], N_RANKS,
                                  replicas)
        self.hub = LocalHub()
        self.readers, self.parts, self.peers = [], [], []
        for rank in range(N_RANKS):
            mine = pl.local_partitions(self.table, rank)
            parts = LocalPartitions(str(dirs[rank] if dirs else store), self.index, mine)
            transport = LocalTransport(self.hub, rank, N_RANKS, parts)
            transport.start()
            stats = ReadStats()
            peers = PeerSource(transport, self.table, rank, N_RANKS, timeout=1.0, stats=stats,
                               show=self.ns.show)
            self.parts.append(parts)
            self.peers.append(peers)
            self.readers.append(ChunkReader(self.index, RoutedSource(parts, peers), 1 << 20,
                                            stats=stats))

    def entry(self, rel: str) -> int:
        return self.ns.file_entry(rel)

    def close(self) -> None:
        for p in self.parts:
            p.close()


def _owner(store, rel: str) -> int | None:
    """The partition holding ``rel`` (None for an empty file: it owns no chunks)."""
    return next((p for p, rels in files_by_partition(store).items() if rel in rels), None)


def test_remote_reads_return_the_right_bytes_from_every_rank(routed_store, small_tree):
    job = Job(routed_store, replicas=1)
    try:
        for rank, reader in enumerate(job.readers):
            for rel, data in small_tree[1].items():
                assert reader.read_all(job.entry(rel)) == data, (rank, rel)
            assert reader.stats.remote_reads > 0 and reader.stats.local_reads > 0
    finally:
        job.close()


def test_a_dead_owner_fails_over_to_a_replica(routed_store, small_tree):
    job = Job(routed_store, replicas=2)
    try:
        rel = "a.txt"
        part = _owner(routed_store, rel)
        # A reader that holds no copy of the partition: owners part and part+1 hold it.
        reader_rank = next(r for r in range(N_RANKS) if r not in job.table[part])
        nearest = pl.preference(job.table[part], reader_rank, N_RANKS)[0]
        job.hub.down.add(nearest)
        reader = job.readers[reader_rank]
        assert reader.read_all(job.entry(rel)) == small_tree[1][rel]
        assert reader.stats.remote_failovers == 1
        assert nearest in job.peers[reader_rank].dead
        job.hub.down.clear()
        job.peers[reader_rank].revive(nearest)
        assert nearest not in job.peers[reader_rank].dead
    finally:
        job.close()


def test_a_stopping_node_reads_no_peer_and_blames_none(routed_store, small_tree):
    """transport.interrupt (the node stops serving its mount; no grace here): a read of
    another node's file is ENOTCONN at once, with no failover and no peer marked dead;
    this node's own files still read, and pings (the drain's probes) still go out."""
    job = Job(routed_store, replicas=2)
    try:
        rel = "a.txt"
        part = _owner(routed_store, rel)
        reader_rank = next(r for r in range(N_RANKS) if r not in job.table[part])
        peers = job.peers[reader_rank]
        peers.transport.interrupt("the node stops serving its mount", grace=0)
        reader = job.readers[reader_rank]
        with pytest.raises(RemoteError) as info:
            reader.read_all(job.entry(rel))
        assert info.value.errno == errno.ENOTCONN
        assert "not asked further: the node stops serving its mount" in str(info.value)
        assert reader.stats.remote_failovers == 0 and peers.dead == set()
        mine = [r for r in small_tree[1] if _owner(routed_store, r) is not None
                and reader_rank in job.table[_owner(routed_store, r)]]
        assert mine
        for r in mine:
            assert reader.read_all(job.entry(r)) == small_tree[1][r]
        assert all(peers.transport.ping(r, 1.0) for r in range(N_RANKS) if r != reader_rank)
    finally:
        job.close()


def test_a_dead_owner_without_replica_is_eio_for_its_files_only(routed_store, small_tree):
    job = Job(routed_store, replicas=1)
    try:
        rel = "a.txt"
        part = _owner(routed_store, rel)
        reader_rank = (part + 1) % N_RANKS
        job.hub.down.add(part % N_RANKS)
        reader = job.readers[reader_rank]
        with pytest.raises(RemoteError) as info:
            reader.read_all(job.entry(rel))
        assert info.value.errno == errno.EIO
        assert "a.txt: the nodes holding partition" in str(info.value)
        others = [r for r in small_tree[1] if _owner(routed_store, r) != part]
        for r in others:
            assert reader.read_all(job.entry(r)) == small_tree[1][r]
    finally:
        job.close()


def test_files_read_together_batch_per_holder_and_fail_over(routed_store, small_tree):
    """read_files (the prefetcher's batched remote reads): every file right, the remote
    ones in one exchange per holder; a dead holder's files come from its replica, and
    without one they are errors for those files alone."""
    job = Job(routed_store, replicas=2)
    try:
        rels = sorted(small_tree[1])
        reader = job.readers[0]
        calls = []
        hub_rank = job.peers[0].transport
        orig = type(hub_rank).fetch_many

        def spy(self, owner, ranges, timeout):
            calls.append((owner, len(ranges)))
            return orig(self, owner, ranges, timeout)

        type(hub_rank).fetch_many = spy
        try:
            got = reader.read_files([job.entry(r) for r in rels])
        finally:
            type(hub_rank).fetch_many = orig
        assert [bytes(g) for g in got] == [small_tree[1][r] for r in rels]
        remote = [r for r in rels if _owner(routed_store, r) is not None
                  and 0 not in job.table[_owner(routed_store, r)]]
        assert remote and sum(n for _o, n in calls) >= len(remote) // 2
        assert len(calls) <= N_RANKS - 1  # one exchange per holder rank
        # a dead holder: its replica serves
        job.hub.down.add(1)
        got = reader.read_files([job.entry(r) for r in rels])
        assert [bytes(g) for g in got] == [small_tree[1][r] for r in rels]
    finally:
        job.close()
    job = Job(routed_store, replicas=1)
    try:
        rels = sorted(small_tree[1])
        dead = 1
        job.hub.down.add(dead)
        got = job.readers[0].read_files([job.entry(r) for r in rels])
        for r, g in zip(rels, got):
            if _owner(routed_store, r) is not None and job.table[_owner(routed_store, r)] == [dead]:
                assert isinstance(g, RemoteError) and g.errno == errno.EIO, r
            else:
                assert bytes(g) == small_tree[1][r], r
    finally:
        job.close()


def test_a_damaged_local_copy_is_read_again_from_a_replica(routed_store, small_tree,
                                                           tmp_path):
    """Bit rot in one rank's staged copy: that rank reads the chunk from the replica."""
    rel = "a.txt"
    part = _owner(routed_store, rel)
    bad = copy_store(routed_store, tmp_path / "bad")
    damage_file(bad, rel)
    dirs = {r: routed_store for r in range(N_RANKS)}
    dirs[part % N_RANKS] = bad  # the primary owner's copy is damaged
    job = Job(routed_store, replicas=2, dirs=dirs)
    try:
        reader = job.readers[part % N_RANKS]
        assert reader.read_all(job.entry(rel)) == small_tree[1][rel]
        assert reader.stats.refetched == 1 and reader.stats.remote_reads == 1
    finally:
        job.close()
    job = Job(routed_store, replicas=1, dirs=dirs)  # no replica: EIO, never wrong bytes
    try:
        with pytest.raises(CorruptDataError):
            job.readers[part % N_RANKS].read_all(job.entry(rel))
    finally:
        job.close()


def test_a_reader_process_gets_other_nodes_chunks_through_the_daemon_socket(
        routed_store, small_tree, tmp_path):
    """The node daemon's ``read_stored`` request served over a real Unix socket from a
    PeerSource, and the reader side's NodeSource: what a FUSE worker or an API reader uses."""
    from fanstore.daemon import service

    job = Job(routed_store, replicas=1)
    sock = str(tmp_path / "ctl.sock")

    class FakeNode:  # only what the read_stored handler touches
        peers = job.peers[0]
        stats = job.readers[0].stats

        class ctx:
            index = job.index

    server = ControlServer(sock, service.handlers(FakeNode))
    server.start()
    client = ControlClient("test", path=sock, timeout=10)
    try:
        mine = pl.local_partitions(job.table, 0)
        remote = set(range(len(job.index.partitions))) - set(mine)
        parts = LocalPartitions(str(routed_store), job.index, mine)
        reader = ChunkReader(job.index, RoutedSource(parts, NodeSource(client, remote, set())))
        for rel, data in small_tree[1].items():
            assert reader.read_all(job.entry(rel)) == data
        assert reader.stats.remote_reads > 0 and FakeNode.stats.extra["relayed_reads"] > 0
        with pytest.raises(Exception) as info:  # a range outside the partition
            client.request({"op": "read_stored", "part": 0, "offset": 0, "length": 1 << 40})
        assert "no such range" in str(info.value)
        parts.close()
    finally:
        client.close()
        server.close()
        job.close()
    assert not os.path.exists(sock)


# --------------------------------------------------------------------------- operations


@pytest.fixture(scope="module")
def special_ops(special_store):
    from fanstore.fuse.fsops import FsOps
    from fanstore.store import LocalStore

    store = LocalStore(str(special_store))
    yield FsOps(store.ns, uid=1234, gid=5678), store
    store.close()


def test_fsops_lookup_attrs_and_errors(special_ops, special_tree):
    from fanstore.errors import (
        InvalidRequestError,
        IsADirectoryError_,
        NotADirectoryError_,
        NotFoundError,
        ReadOnlyError,
    )

    fs, store = special_ops
    text = fs.lookup(1, b"text")
    hello = fs.lookup(text + 1, b"hello.txt")
    ino, mode, nlink, size, blocks, mtime = fs.attr(hello)
    st = os.lstat(os.path.join(special_tree["root"], "text", "hello.txt"))
    assert (ino, mode, nlink, size, mtime) == (hello + 1, st.st_mode, 1, st.st_size,
                                               st.st_mtime_ns)
    assert fs.attr(text)[1] & 0o170000 == 0o040000 and fs.attr(text)[3] == 4096
    with pytest.raises(NotFoundError):
        fs.lookup(1, b"nope")
    with pytest.raises(NotADirectoryError_):
        fs.lookup(hello + 1, b"x")
    with pytest.raises(NotFoundError):
        fs.entry(fs.n_entries + 1)
    with pytest.raises(ReadOnlyError) as info:
        fs.check_open(hello, os.O_WRONLY)
    assert info.value.errno == errno.EROFS
    with pytest.raises(IsADirectoryError_):
        fs.check_open(text, os.O_RDONLY)
    with pytest.raises(InvalidRequestError):
        fs.readlink(hello)
    link = fs.lookup(fs.lookup(1, b"links") + 1, b"to_file")
    assert fs.readlink(link) == b"../text/hello.txt"
    # Attributes of many entries at once equal the one-at-a-time answers.
    kids = fs.children(text)
    many = fs.attrs(__import__("numpy").arange(kids.start, kids.stop))
    for i, e in enumerate(kids):
        ino, mode, nlink, size, blocks, mtime = fs.attr(e)
        assert (int(many["ino"][i]), int(many["mode"][i]), int(many["nlink"][i]),
                int(many["size"][i]), int(many["mtime_ns"][i])) == (ino, mode, nlink, size,
                                                                    mtime)


def test_pyfuse3_handlers_called_directly(special_ops, special_tree, special_store):
    """S3QL-style: the pyfuse3 operations class without a kernel."""
    trio = pytest.importorskip("trio")
    pyfuse3 = pytest.importorskip("pyfuse3")
    from fanstore.fuse.pyfuse3.reader import AsyncReader
    from fanstore.fuse.pyfuse3.operations import FanStoreOps

    fs, store = special_ops
    ops = FanStoreOps(fs, AsyncReader(store.ns, store.reader))
    want = open(os.path.join(special_tree["root"], "text", "hello.txt"), "rb").read()

    async def main():
        text = await ops.lookup(1, b"text")
        attr = await ops.lookup(text.st_ino, b"hello.txt")
        assert attr.st_uid == 1234 and attr.st_size == len(want)
        info = await ops.open(attr.st_ino, os.O_RDONLY, None)
        assert info.keep_cache
        assert bytes(await ops.read(info.fh, 0, 1 << 20)) == want
        for call in (ops.lookup(1, b"nope"), ops.open(attr.st_ino, os.O_RDWR, None),
                     ops.open(text.st_ino, os.O_RDONLY, None), ops.mkdir(1, b"x", 0o755, None),
                     ops.getxattr(attr.st_ino, b"user.x", None), ops.readlink(attr.st_ino, None)):
            with pytest.raises(pyfuse3.FUSEError) as err:
                await call
            codes.append(err.value.errno)

    codes: list[int] = []
    trio.run(main)
    assert codes == [errno.ENOENT, errno.EROFS, errno.EISDIR, errno.EROFS, errno.ENODATA,
                     errno.EINVAL]


def test_pyfuse3_read_of_corrupt_data_is_eio(small_store, tmp_path):
    trio = pytest.importorskip("trio")
    pyfuse3 = pytest.importorskip("pyfuse3")
    from fanstore.fuse.pyfuse3.reader import AsyncReader
    from fanstore.fuse.fsops import FsOps
    from fanstore.fuse.pyfuse3.operations import FanStoreOps
    from fanstore.store import LocalStore

    bad = copy_store(small_store, tmp_path / "bad")
    damage_file(bad, "a.txt")
    with LocalStore(str(bad)) as store:
        ops = FanStoreOps(FsOps(store.ns), AsyncReader(store.ns, store.reader))
        entry = store.file_entry("a.txt")

        async def main():
            with pytest.raises(pyfuse3.FUSEError) as err:
                await ops.read(entry + 1, 0, 100)
            return err.value.errno

        assert trio.run(main) == errno.EIO
        assert store.reader.stats.errors == 1


def test_probes_stop_at_the_drain_deadline_and_a_cut_ping_is_no_death():
    """Once the whole job stops, a draining node's probes end by the grace deadline (Slurm
    SIGKILLs KillWait seconds after SIGTERM; a 5 s ping to a node that finished meanwhile
    left its staged data behind), and a ping cut short by it marks nobody dead."""
    import time

    from fanstore.daemon.peerwatch import PeerWatch

    hub = LocalHub()
    mine = LocalTransport(hub, 0, 3, None, max_wait=10.0)
    for r in (1, 2):
        LocalTransport(hub, r, 3, None)  # never started: a finished node does not answer
    asked = []
    ping = mine.ping
    mine.ping = lambda r, t: asked.append(t) or ping(r, t)
    watch = PeerWatch(0, 3, [1, 2], timeout=30.0, who="rank 0 (t)")
    watch.attach(mine, PeerSource(mine, [[0], [1], [2]], node=0, nodes=3, timeout=30.0,
                                  stats=None))
    t0 = time.monotonic()
    watch.probe(deadline=t0 + 0.3)
    assert time.monotonic() - t0 < 1.0
    assert asked and all(t <= 0.3 for t in asked)
    assert watch.peers.dead == set()


def test_a_death_is_judged_by_the_partitions_it_leaves_without_a_live_holder():
    """issue 44: a dead node ends the job only when some partition has no live holder; a
    SHUTDOWN's reason says a death however often node 0 relays it."""
    from fanstore.daemon.peerwatch import death_reason, is_death, lost_partitions

    one_copy = [[0], [1], [2], [3], [0], [1], [2], [3]]
    two_copies = [[0, 1], [1, 2], [2, 3], [3, 0]]
    assert lost_partitions(one_copy, {1}) == [1, 5]
    assert lost_partitions(two_copies, {1}) == []
    assert lost_partitions(two_copies, {1, 2}) == [1]
    assert lost_partitions(two_copies, set()) == []
    reason = death_reason("node 1 died (no answer to pings)")
    assert is_death(reason) and is_death(f"node 0: node 3: {reason}")
    assert not is_death("signal SIGTERM")


def test_the_serving_watch_checks_every_second_and_probes_on_alarm():
    """PeerWatch.watch runs the node's check about once a CHECK_INTERVAL and probes at an
    alarm without waiting for PROBE_INTERVAL; it ends when serving ends."""
    import threading
    import time

    from fanstore.daemon import peerwatch
    from fanstore.daemon.peerwatch import PeerWatch

    hub = LocalHub()
    mine = LocalTransport(hub, 0, 2, None, max_wait=10.0)
    peer = LocalTransport(hub, 1, 2, None)
    peer.start()
    pinged, checks = [], []
    ping = mine.ping
    mine.ping = lambda r, t: pinged.append(r) or ping(r, t)
    watch = PeerWatch(0, 2, [1], timeout=30.0, who="rank 0 (t)")
    watch.attach(mine, PeerSource(mine, [[0], [1]], node=0, nodes=2, timeout=30.0,
                                  stats=None))
    serving = threading.Event()
    serving.set()
    t = threading.Thread(target=watch.watch,
                         args=(serving, lambda why: None, lambda: checks.append(1)))
    t.start()
    try:
        time.sleep(2.5 * peerwatch.CHECK_INTERVAL)
        assert 1 <= len(checks) <= 4 and pinged == []  # not a spin, and not only at alarms
        watch.alarm(everyone=True)
        deadline = time.monotonic() + 5
        while not pinged and time.monotonic() < deadline:
            time.sleep(0.05)
        assert pinged == [1]
        assert watch.peers.dead == set()
    finally:
        serving.clear()
        watch.alarm()
        t.join(5)
        peer.stop()
    assert not t.is_alive()


def test_the_end_of_a_job_is_relayed_by_node_0_in_2n_messages():
    """Each node tells node 0 it is done (DONE); node 0, done too, tells every node at once
    (ALL_DONE): 2(N-1) control messages for the job's end, not N(N-1); every drain ends."""
    import threading

    from fanstore.daemon import protocol as P
    from fanstore.daemon.peerwatch import PeerWatch

    n = 4
    hub = LocalHub()
    sent = []
    watches, transports = [], []
    for r in range(n):
        box = {}
        t = LocalTransport(hub, r, n, None, on_control=lambda msg, box=box: box["on"](msg))
        real = t.send_control
        t.send_control = (lambda kind, ranks, reason="", timeout=2.0, real=real:
                          sent.append((kind, list(ranks))) or real(kind, ranks, reason))
        w = PeerWatch(r, n, [x for x in range(n) if x != r], timeout=30.0, who=f"rank {r}")
        w.attach(t, PeerSource(t, [[x] for x in range(n)], node=r, nodes=n, timeout=30.0,
                               stats=None))

        def on(msg, w=w, r=r):
            if msg.kind == P.Control.DONE:
                w.peers.done.add(msg.rank)
            elif msg.kind == P.Control.ALL_DONE:
                w.peers.done.update(x for x in range(n) if x != r)

        box["on"] = on
        t.start()
        watches.append(w)
        transports.append(t)
    results = {}
    threads = []
    for w in watches:
        w.say_done()
        th = threading.Thread(target=lambda w=w: results.__setitem__(
            w.node, w.drain(stopped=lambda: False, job_stopping=lambda: False)))
        th.start()
        threads.append(th)
    for th in threads:
        th.join(20)
    assert results == {r: [] for r in range(n)}
    done = [ranks for kind, ranks in sent if kind == P.Control.DONE]
    assert done == [[0]] * (n - 1)  # each to node 0 alone
    assert [ranks for kind, ranks in sent if kind == P.Control.ALL_DONE] == [[1, 2, 3]]
    assert sum(len(ranks) for _, ranks in sent) == 2 * (n - 1)
    for t in transports:
        t.stop()


# --------------------------------------------------------------------------- shared chunks


def test_shared_chunks_pass_a_decoded_chunk_between_processes():
    """A chunk one process publishes is read by another (forked, as kernel workers are),
    whole and checked; a wrong checksum, an unknown chunk or a reused slot give None."""
    import multiprocessing as mp

    import xxhash

    from fanstore.read.shared import SharedChunks

    shared = SharedChunks.create(workers=2, chunk_size=1 << 16)
    data = bytes(range(256)) * 256
    digest = xxhash.xxh3_64_intdigest(data)
    shared.set_worker(1)
    shared.put(7, data)
    ctx = mp.get_context("fork")
    q = ctx.Queue()

    def child() -> None:
        shared.set_worker(2)
        got = shared.get(7, digest)
        q.put((got == data, shared.get(7, digest ^ 1), shared.get(8, digest)))
        shared.put(9, b"from the other worker")

    p = ctx.Process(target=child)
    p.start()
    ok, wrong_sum, unknown = q.get(timeout=30)
    p.join(30)
    assert ok and wrong_sum is None and unknown is None
    other = b"from the other worker"
    assert shared.get(9, xxhash.xxh3_64_intdigest(other)) == other
    for k in range(shared.per_worker):  # worker 1's slots all reused: chunk 7 is gone
        shared.put(100 + k, b"x" * 10)
    assert shared.get(7, digest) is None
    with pytest.raises(MountError):
        shared.set_worker(3)
    shared.close()
