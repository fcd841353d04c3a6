"""Prefetch mode on the kernel frontend, through real mounts.

What is checked: an order's files are decoded ahead and pushed into the page cache (read
then without READ requests), looked up first when the kernel does not hold them, kept in
the shared buffer when a push is refused (READs answered from it, within --prefetch-mb);
directory read-ahead without an order; and that every byte a reader gets is the source's
whatever the order: wrong, partial, stale, duplicated, several clients at once, reads
outside it, the kernel dropping its inodes, a damaged file, a replaced worker, remote files
of a 2-rank job.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from helpers import (
    assert_cli_error,
    damage_file,
    daemon_pid,
    fuse_available,
    is_mounted,
    process_tree,
    run_cli,
    wait_until,
)
from mpi_helpers import MpiJob, mpi_available

_fuse_ok, _fuse_why = fuse_available()
_mpi_ok, _mpi_why = mpi_available()
ROOT = os.geteuid() == 0
#: A fresh mount holds no inode (but its root) and no page in the kernel: the tests start
#: from one. drop_caches empties every mount's page cache and dentries, which other mount
#: tests count on: the one test that drops them in the middle of an epoch is ``serial``
#: (``make test``'s second run, alone).


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    """~240 files in 4 directories (a few of them 2.3 MB: pushed in pieces), 4 partitions."""
    root = tmp_path_factory.mktemp("prefetch")
    src = root / "src"
    rng = random.Random(7)
    for d in range(4):
        (src / f"d{d}").mkdir(parents=True)
        for i in range(60):
            n = 2_300_000 if i == 7 else rng.randint(1, 90_000)
            data = rng.randbytes(n // 3) + bytes(n - n // 3)
            (src / f"d{d}" / f"f{i:03d}.bin").write_bytes(data)
    (src / "d0" / "empty.bin").write_bytes(b"")
    os.symlink("d1/f001.bin", src / "alias")
    store = root / "store"
    run_cli("pack", src, store, "--partitions", "4", "--chunk-kb", "256", "--codec", "zstd:3",
            "--no-progress", check=True)
    files = sorted(str(p.relative_to(src)) for p in src.rglob("*.bin"))
    return src, store, files


def stats(mnt) -> dict:
    return json.loads(run_cli("stats", mnt, "--json", check=True).stdout)


def reads(mnt) -> int:
    return stats(mnt)["requests_by_op"].get("read", 0)


def send_order(mnt, order, tmp_path, name="order.txt"):
    listing = Path(tmp_path) / name
    listing.write_text("".join(f"{p}\n" for p in order))
    return run_cli("prefetch", mnt, "--list", listing, check=True)


def wait_prefetched(mnt, n: int, timeout: float = 60) -> dict:
    """Until ``n`` files were pushed or buffered (or failed) since the mount."""
    last = {}

    def done():
        nonlocal last
        last = stats(mnt)
        return (last["prefetch_pushed"] + last["prefetch_buffered"]
                + last["prefetch_errors"]) >= n
    assert wait_until(done, timeout, 0.1), {
        k: v for k, v in last.items() if "prefetch" in k or k == "requests_by_op"}
    return last


def read_all(mnt, src, order) -> int:
    """Read ``order`` through the mount (unbuffered: no ioctl), every byte compared."""
    for rel in order:
        with open(Path(mnt) / rel, "rb", buffering=0) as f:
            got = f.read()
        assert got == (Path(src) / rel).read_bytes(), rel
    return len(order)


def drop_caches(level: int = 3) -> None:
    subprocess.run(["sh", "-c", f"sync; echo {level} > /proc/sys/vm/drop_caches"],
                   check=True)


def list_all(mnt) -> None:
    for _d, _dirs, _files in os.walk(mnt):
        pass


# --------------------------------------------------------------------------- frontends


@pytest.mark.fuse
@pytest.mark.skipif(not _fuse_ok, reason=_fuse_why)
def test_auto_serves_both_modes_with_the_kernel_frontend(tree, mounted, tmp_path, monkeypatch):
    _src, store, _files = tree
    monkeypatch.delenv("FANSTORE_FRONTEND", raising=False)
    mnt = mounted(store, "--mode", "prefetch")
    s = stats(mnt)
    assert s["frontend"] == "kernel" and s["prefetch_budget"] == 1024 << 20
    (tmp_path / "m2").mkdir()
    res = run_cli("mount", store, tmp_path / "m2", "--frontend", "pyfuse3", "--mode",
                  "prefetch")
    assert_cli_error(res, code=2, contains="--mode prefetch is served by the kernel frontend")
    assert not is_mounted(tmp_path / "m2")


# --------------------------------------------------------------------------- pushes


@pytest.mark.fuse
@pytest.mark.skipif(not _fuse_ok, reason=_fuse_why)
def test_a_listed_epoch_is_read_from_the_page_cache(tree, mounted, tmp_path):
    """The directory listed first (READDIRPLUS gives the kernel every inode), then the
    order: every file is pushed without a look-up, and the epoch sends (almost) no READ."""
    src, store, files = tree
    mnt = mounted(store, "--mode", "prefetch", "--prefetch-mb", "32")
    list_all(mnt)
    order = files[:]
    random.Random(1).shuffle(order)
    res = send_order(mnt, order, tmp_path)
    assert f"prefetch order of {len(order):,} files sent" in res.stdout
    s = wait_prefetched(mnt, len(order) - 1)
    assert s["prefetch_pushed"] == len(order) - 1 and s["prefetch_buffered"] == 0
    assert s["prefetch_lookups_ahead"] == 0  # the listing made every inode
    before = reads(mnt)
    assert read_all(mnt, src, order) == len(order)
    # (this VM's proactive reclaim may take a few pushed pages back: allow a little)
    assert reads(mnt) - before <= len(order) // 10
    after = stats(mnt)
    assert after["errors"] == 0 and after["prefetch_errors"] == 0
    assert after["prefetch_bytes_pushed"] == sum(
        (src / p).stat().st_size for p in order)


@pytest.mark.fuse
@pytest.mark.skipif(not _fuse_ok, reason=_fuse_why)
def test_unlisted_files_are_looked_up_then_pushed(tree, mounted, tmp_path):
    """Nothing listed: the first refused push of a directory lists it through the mount
    (once for all the workers), the kernel then holds every inode of it."""
    src, store, files = tree
    mnt = mounted(store, "--mode", "prefetch")
    order = files[::-1]
    send_order(mnt, order, tmp_path)
    s = wait_prefetched(mnt, len(order) - 1)
    assert s["prefetch_pushed"] == len(order) - 1
    # d0..d3, once each; two workers may both find a directory unlisted at the same moment
    assert 4 <= s["prefetch_listings"] <= 8
    # A worker that finds the directory being listed by another looks its file up: how
    # many depends on how long a listing takes against the other workers' pace, so what
    # holds on any machine is at most one look-up per file, most files made by listings,
    # and no kernel LOOKUP beyond those look-ups and the test's own few.
    lookups = s["prefetch_lookups_ahead"]
    assert lookups < (len(order) - 1) / 2, s
    assert s["requests_by_op"].get("lookup", 0) <= lookups + 10, s
    before = reads(mnt)
    read_all(mnt, src, order)
    assert reads(mnt) - before <= len(order) // 10


@pytest.mark.fuse
@pytest.mark.skipif(not _fuse_ok, reason=_fuse_why)
def test_refused_pushes_are_served_from_the_buffer(tree, mounted, tmp_path, monkeypatch):
    """No look-ups and no listing: the kernel holds no inode, every push is refused and the
    files wait in the shared buffer; READs (any worker) are answered from it."""
    src, store, files = tree
    mnt = mounted(store, "--mode", "prefetch", "--prefetch-mb", "64", "--workers", "2",
                  "--no-prefetch-lookup")
    small = [f for f in files if (src / f).stat().st_size < 1_000_000 and
             (src / f).stat().st_size > 0]
    send_order(mnt, small, tmp_path)
    s = wait_prefetched(mnt, len(small))
    assert s["prefetch_buffered"] == len(small) and s["prefetch_pushed"] == 0
    assert s["prefetch_push_refused"] == len(small)
    assert 0 < s["prefetch_buffer_bytes"] <= 64 << 20
    read_all(mnt, src, small)
    after = stats(mnt)
    assert after["prefetch_served_from_buffer"] >= len(small)
    assert after["chunks_decoded"] == s["chunks_decoded"]  # nothing decoded twice


@pytest.mark.fuse
@pytest.mark.skipif(not _fuse_ok, reason=_fuse_why)
def test_the_buffer_stays_within_prefetch_mb(tree, mounted, tmp_path, monkeypatch):
    """A 4 MB budget for ~5 MB of refused pushes: the oldest are dropped unread (counted),
    the buffer never holds more than its share, and reads stay right."""
    src, store, files = tree
    mnt = mounted(store, "--mode", "prefetch", "--prefetch-mb", "4", "--workers", "2",
                  "--no-prefetch-lookup")
    small = [f for f in files if 0 < (src / f).stat().st_size < 1_000_000]
    send_order(mnt, small, tmp_path)
    s = wait_prefetched(mnt, len(small))
    assert s["prefetch_buffer_bytes"] <= 4 << 20
    assert s["prefetch_bytes_evicted_unused"] > 0
    read_all(mnt, src, small)
    assert stats(mnt)["errors"] == 0


# --------------------------------------------------------------------------- whatever the order


@pytest.mark.fuse
@pytest.mark.skipif(not _fuse_ok, reason=_fuse_why)
@pytest.mark.skipif(not ROOT, reason="drops the page cache and the inodes (root)")
@pytest.mark.serial
def test_every_byte_is_the_sources_whatever_the_order(tree, mounted, tmp_path):
    src, store, files = tree
    mnt = mounted(store, "--mode", "prefetch", "--prefetch-mb", "16")
    rng = random.Random(5)
    # wrong: names the store does not have, a directory, a symlink, empty lines
    res = send_order(mnt, ["nope.bin", "d0", "alias", "d9/x.bin", *files[:5]], tmp_path)
    assert "6 files sent" in res.stdout or "files sent" in res.stdout
    read_all(mnt, src, files[:5] + files[-5:])
    # partial: half of the files, then the whole epoch read in another order
    drop_caches()
    half = rng.sample(files, len(files) // 2)
    send_order(mnt, half, tmp_path)
    read_all(mnt, src, rng.sample(files, len(files)))
    # stale: an order replaced by the next epoch's before it was read; read the old one
    drop_caches()
    old = rng.sample(files, len(files))
    send_order(mnt, old, tmp_path, "old.txt")
    send_order(mnt, rng.sample(files, len(files)), tmp_path, "new.txt")
    read_all(mnt, src, old)
    # a file more than once in the order, and read twice
    drop_caches()
    twice = files[:20] + files[:20] + files[20:40]
    send_order(mnt, twice, tmp_path)
    read_all(mnt, src, twice)
    # the kernel drops its dentries and inodes (and their pages) in the middle of an epoch
    drop_caches()
    epoch = rng.sample(files, len(files))
    send_order(mnt, epoch, tmp_path)
    read_all(mnt, src, epoch[: len(epoch) // 2])
    drop_caches(2)
    read_all(mnt, src, epoch[len(epoch) // 2:])
    s = stats(mnt)
    assert s["errors"] == 0 and s["prefetch_errors"] == 0 and s["prefetch_files"] > 0


@pytest.mark.fuse
@pytest.mark.skipif(not _fuse_ok, reason=_fuse_why)
def test_two_clients_with_their_own_orders(tree, mounted, tmp_path):
    """Two training processes send different orders at once: both orders are prefetched
    (the whole tree fits in one window), then both read concurrently, every byte right.

    The prefetch is waited for before the reads: a reader that gets to a file first keeps
    it (the prefetcher runs at nice 10 and yields), so how many files a prefetch beside
    the reads takes depends on the scheduler, not on the design."""
    import fanstore

    src, store, files = tree
    mnt = mounted(store, "--mode", "prefetch")
    a = files[: len(files) // 2]
    b = files[len(files) // 2:][::-1]
    nonempty = sum(1 for rel in files if (src / rel).stat().st_size > 0)
    stores = [fanstore.open_store(str(mnt)) for _ in range(2)]
    errors: list[BaseException] = []

    def run_both(work):
        errors.clear()
        threads = [threading.Thread(target=work, args=(k, o)) for k, o in enumerate((a, b))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not any(t.is_alive() for t in threads), "a client did not finish in 120 s"
        assert not errors, errors

    def order(k, order):
        try:
            reply = stores[k].prefetch(order, client=f"trainer-{k}")
            assert reply["files"] == len(order)
        except BaseException as exc:  # noqa: BLE001 - reported by run_both
            errors.append(exc)

    def read(k, order):
        try:
            for rel in order:
                assert stores[k].read(rel) == (src / rel).read_bytes(), rel
        except BaseException as exc:  # noqa: BLE001 - reported by run_both
            errors.append(exc)

    run_both(order)
    done = wait_until(lambda: stats(mnt)["prefetch_files"] >= nonempty, timeout=60,
                      interval=0.2)
    s = stats(mnt)
    assert done, f"{s['prefetch_files']} of {nonempty} files prefetched after 60 s"
    assert s["prefetch_clients"] == 2 and s["prefetch_orders"] >= 2
    assert s["prefetch_files"] == nonempty and s["prefetch_errors"] == 0
    run_both(read)
    assert stats(mnt)["errors"] == 0
    for st in stores:
        st.close()


@pytest.mark.fuse
@pytest.mark.skipif(not _fuse_ok, reason=_fuse_why)
def test_directory_read_ahead_without_an_order(tree, mounted):
    """No order ever given: a reader going through a directory in name order gets the next
    files of it pushed ahead; one reading in no order gets nothing it did not ask for."""
    src, store, files = tree
    mnt = mounted(store, "--mode", "prefetch")
    d1 = [f for f in files if f.startswith("d1/")]
    read_all(mnt, src, d1[::-7][:5])  # out of order: no read-ahead
    time.sleep(0.3)
    assert stats(mnt)["prefetch_files"] == 0
    d2 = [f for f in files if f.startswith("d2/")]
    read_all(mnt, src, d2[:2])  # two in a row: the directory is being read in order
    s = wait_prefetched(mnt, 10)
    assert s["prefetch_files"] >= 10
    before = reads(mnt)
    read_all(mnt, src, d2[2:12])
    assert reads(mnt) - before <= 3  # the next files of the directory were pushed


@pytest.mark.fuse
@pytest.mark.skipif(not _fuse_ok, reason=_fuse_why)
def test_a_damaged_file_is_eio_alone(tree, mounted, tmp_path):
    src, store, files = tree
    import shutil

    bad_store = tmp_path / "store"
    shutil.copytree(store, bad_store)
    victim = "d3/f010.bin"
    damage_file(bad_store, victim)
    mnt = mounted(bad_store, "--mode", "prefetch")
    send_order(mnt, files, tmp_path)
    s = wait_prefetched(mnt, len(files) - 1)
    assert s["prefetch_errors"] == 1
    with pytest.raises(OSError) as exc:
        (mnt / victim).read_bytes()
    assert exc.value.errno == 5
    read_all(mnt, src, [f for f in files if f != victim])


@pytest.mark.fuse
@pytest.mark.skipif(not _fuse_ok, reason=_fuse_why)
def test_a_replaced_worker_gets_the_order_again(tree, mounted, tmp_path):
    """SIGKILL one worker after the order was sent: its replacement is handed the order and
    prefetches the dead worker's share."""
    src, store, files = tree
    mnt = mounted(store, "--mode", "prefetch", "--workers", "2", "--prefetch-mb", "8")
    pid = daemon_pid(mnt)
    tree_pids = process_tree(pid)
    assert len(tree_pids) >= 4  # daemon, frontend process, 2 workers
    workers = tree_pids[-2:]
    os.kill(workers[0], signal.SIGKILL)
    assert wait_until(lambda: len(process_tree(pid)) >= 4 and
                      workers[0] not in process_tree(pid), 20)
    list_all(mnt)
    send_order(mnt, files, tmp_path)
    s = wait_prefetched(mnt, len(files) - 1)
    assert s["prefetch_orders"] >= 2  # both slots took it
    read_all(mnt, src, files)


# --------------------------------------------------------------------------- two ranks


@pytest.mark.mpi
@pytest.mark.skipif(not (_fuse_ok and _mpi_ok), reason=_fuse_why or _mpi_why)
@pytest.mark.fuse
@pytest.mark.skipif(not _fuse_ok, reason=_fuse_why)
@pytest.mark.parametrize("ranks_per_node", [1, 3])
def test_remote_files_are_prefetched_by_the_worker_ranks(tree, tmp_path, ranks_per_node):
    """A 2-node job: node 0's order, half of it held by node 1, is fetched over MPI by node
    0's FUSE workers (its forked workers, or with 3 ranks a node its 2 worker ranks, which
    get the shared chunk table and the prefetch window with their /dev/fuse descriptor),
    decoded and pushed; every byte right."""
    src, store, files = tree
    with MpiJob(store, tmp_path, ranks=2, extra=["--mode", "prefetch", "--workers", "2"],
                ranks_per_node=ranks_per_node) as job:
        mnt = job.mnt(0)
        list_all(mnt)
        order = files[:]
        random.Random(9).shuffle(order)
        send_order(mnt, order, tmp_path)
        s = wait_prefetched(mnt, len(order) - 1, timeout=120)
        assert s["prefetch_pushed"] == len(order) - 1 and s["remote_reads"] > 0
        before = reads(mnt)
        read_all(mnt, src, order)
        assert reads(mnt) - before <= len(order) // 10
        assert stats(mnt)["errors"] == 0
        assert stats(mnt)["workers"] == 2


# --------------------------------------------------------------------------- the shared window


def test_window_buffer_reads_check_the_sequence():
    """(no kernel) A buffered file is served only while its slab space holds it: the copy
    is checked against the state value it started from."""
    from fanstore.read.window import (
        BUFFERED,
        NONE,
        PUSHED,
        SharedWindow,
        kind,
        read_order,
        write_order,
    )

    w = SharedWindow.create(100, 2, 1 << 20)
    try:
        slab = w.arena_view(2)
        page0 = w.slab // 4096  # slot 2's first page in the arena
        slab[:5] = b"hello"
        v = SharedWindow.buffered_value(page0, 1)
        w.state[7] = v
        assert kind(int(w.state[7])) == BUFFERED
        assert w.read_buffered(7, 0, 100, 5) == b"hello"
        assert w.read_buffered(7, 1, 3, 5) == b"ell"
        assert w.marks[7] & 1
        w.state[7] = SharedWindow.buffered_value(page0, 2)  # reused meanwhile
        assert w.read_buffered(7, 0, 5, 5) == b"hello"  # (a fresh read of the new value)
        w.state[7] = NONE
        assert w.read_buffered(7, 0, 5, 5) is None
        # an order: worker 2 of 2 takes the odd indices; pushed marks are forgotten
        entries = np.array([5, 6, 7, 8, 9], np.uint32)
        sizes = np.array([10, 20, 30, 40, 50])
        fd = write_order(3, 42, entries, sizes)
        o = read_order(fd, 2, 2, 100)
        os.close(fd)
        assert list(o.entries) == [6, 8] and list(o.indices) == [1, 3]
        assert list(o.before) == [10, 60] and list(o.after) == [30, 100]
        w.state[6] = PUSHED
        w.state[8] = v
        w.begin_order(3, 42)
        w.mark_order(3, 42, o.entries, o.indices)
        assert int(w.state[6]) == NONE and int(w.state[8]) == v  # never a buffered value
        assert w.position(3, 42) == 0
        assert w.seen(8) == 4 and w.position(3, 42) == 4
        assert w.seen(6) == 2 and w.position(3, 42) == 4  # positions only move on
        w.begin_order(3, 43)
        assert w.seen(8) == 0 and w.position(3, 43) == 0  # a stale order is no sign
    finally:
        w.close()
        os.close(w.state_fd)
        os.close(w.arena_fd)
