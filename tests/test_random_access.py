"""Large files read at random offsets through real mounts, by the clients that do it: an LMDB
(``lmdb``, memory-mapped, no read-ahead), an HDF5 dataset (``h5py``), a ``numpy.memmap`` of a
``.npy``, and plain ``pread`` of pages. Every value is checked against the source.

On the kernel frontend a chunk decoded for a partial READ is spilled into the page cache
(fanstore/fuse/kernelfs/spill.py): the tests check that a page-sized random pass decodes each chunk
it touches about once for the whole node, that the pages of the chunks it touched are then
read with no request at all, by any process, and that a file larger than the chunk cache
is served right with a cache of 1 MiB.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import random

import numpy as np
import pytest

from helpers import MiB, run_cli, run_main, wait_until

pytestmark = [pytest.mark.fuse, pytest.mark.usefixtures("frontend")]
lmdb = pytest.importorskip("lmdb")
h5py = pytest.importorskip("h5py")

PAGE = 4096
RECORDS = 4000
ROWS = 3000
ROW = 4096


def _text(seed: int, n: int) -> bytes:
    """Text-like bytes (about 3.3x with zstd:3), deterministic."""
    rng = random.Random(seed)
    words = [("".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9))))
             for _ in range(400)]
    spaced = [w.encode() + b" " for w in words]
    k = n // min(map(len, spaced)) + 1  # enough words, drawn at once (a loop took 6 s)
    return b"".join(rng.choices(spaced, k=k))[:n]


def _value(corpus: bytes, i: int) -> bytes:
    n = 2000 + (i * 7919) % 4000
    start = (i * 104729) % (len(corpus) - n)
    return b"%08d:" % i + corpus[start:start + n]


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    root = tmp_path_factory.mktemp("random-src")
    corpus = _text(3, 4 * MiB)
    env = lmdb.open(str(root / "samples.lmdb"), map_size=256 * MiB, subdir=True)
    with env.begin(write=True) as txn:
        for i in range(RECORDS):
            txn.put(b"%08d" % i, _value(corpus, i))
    env.close()
    rows = np.frombuffer(_text(5, ROWS * ROW), dtype=np.uint8).reshape(ROWS, ROW)
    with h5py.File(root / "rows.h5", "w") as f:
        f.create_dataset("rows", data=rows)
    arr = np.frombuffer(_text(7, 6 * MiB), dtype=np.uint8).view("<u4").reshape(-1, 256)
    np.save(root / "array.npy", arr)
    (root / "pages.bin").write_bytes(_text(11, 12 * MiB))
    return {"root": root, "corpus": corpus, "rows": rows, "array": arr}


@pytest.fixture(scope="module")
def store(tree, tmp_path_factory):
    dest = tmp_path_factory.mktemp("random-store") / "store"
    proc = run_main("pack", tree["root"], dest, "--no-progress", timeout=300)
    assert proc.returncode == 0, proc.stderr
    return dest


def _stats(mnt) -> dict:
    return json.loads(run_main("stats", mnt, "--json", check=True).stdout)


def _settled(mnt) -> bool:
    """The spill threads are done: their count stays the same over two polls."""
    last = [None]

    def same() -> bool:
        now = _stats(mnt)["spill_chunks"]
        done, last[0] = now == last[0], now
        return done

    return wait_until(same, 10, interval=0.2)


#: how the tests' two reader processes start: spawned, never forked from pytest, which
#: has threads (a fork CI run's pool worker hung on a lock another thread held at fork)
READERS = "spawn"


def _lmdb_gets(path: str, keys: list[int], corpus: bytes) -> int:
    env = lmdb.open(path, readonly=True, lock=False, readahead=False, subdir=True)
    try:
        with env.begin() as txn:
            for i in keys:
                assert txn.get(b"%08d" % i) == _value(corpus, i), i
    finally:
        env.close()
    return len(keys)


def test_lmdb_random_gets_from_two_processes(tree, store, mounted):
    mnt = mounted(store)
    rng = random.Random(1)
    keys = [[rng.randrange(RECORDS) for _ in range(1500)] for _ in range(2)]
    path = os.path.join(mnt, "samples.lmdb")
    ctx = mp.get_context(READERS)
    with ctx.Pool(2) as pool:
        done = pool.starmap(_lmdb_gets, [(path, k, tree["corpus"]) for k in keys])
    assert done == [1500, 1500]
    _lmdb_gets(path, list(range(0, RECORDS, 97)), tree["corpus"])  # and in this process


def test_hdf5_random_rows(tree, store, mounted):
    mnt = mounted(store)
    rng = random.Random(2)
    with h5py.File(os.path.join(mnt, "rows.h5"), "r") as f:
        ds = f["rows"]
        assert ds.shape == (ROWS, ROW)
        for i in (rng.randrange(ROWS) for _ in range(800)):
            assert np.array_equal(ds[i], tree["rows"][i]), i
        assert np.array_equal(ds[100:140], tree["rows"][100:140])


def test_numpy_memmap_random_slices(tree, store, mounted):
    mnt = mounted(store)
    arr = np.load(os.path.join(mnt, "array.npy"), mmap_mode="r")
    want = tree["array"]
    assert arr.shape == want.shape and arr.dtype == want.dtype
    rng = random.Random(3)
    for _ in range(500):
        i = rng.randrange(len(want) - 8)
        assert np.array_equal(arr[i:i + 8], want[i:i + 8]), i
    assert int(arr[-1, -1]) == int(want[-1, -1])


def _page_pass(path: str, offsets: list[int]) -> list[bytes]:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # page-sized READs: no read-ahead
        return [os.pread(fd, PAGE, off) for off in offsets]
    finally:
        os.close(fd)


def test_a_random_page_pass_decodes_each_chunk_about_once(tree, store, mounted, frontend):
    """Random 4 KiB preads of a 12 MiB file (12 chunks) from two processes, with a chunk
    cache of 1 MiB (smaller than the file): every page right; on the kernel frontend the
    chunks touched are decoded about once for the node (spilled into the page cache), and a
    second pass over the same chunks reaches the daemon with no READ at all."""
    mnt = mounted(store, "--cache-mb", "1")
    data = (tree["root"] / "pages.bin").read_bytes()
    path = os.path.join(mnt, "pages.bin")
    rng = random.Random(4)
    n_pages = len(data) // PAGE
    offsets = [[rng.randrange(n_pages) * PAGE for _ in range(600)] for _ in range(2)]
    ctx = mp.get_context(READERS)
    with ctx.Pool(2) as pool:
        got = pool.starmap(_page_pass, [(path, o) for o in offsets])
    for offs, pages in zip(offsets, got):
        for off, page in zip(offs, pages):
            assert page == data[off:off + PAGE], off
    touched = {off // MiB for offs in offsets for off in offs}
    first = _stats(mnt)
    print(f"\n{frontend}: {sum(map(len, offsets))} preads, {len(touched)} chunks touched, "
          f"{first['reads']} READs, {first['chunks_decoded']} decodes, "
          f"{first.get('shared_hits')} shared hits, {first.get('spill_chunks')} spilled")
    assert first["errors"] == 0
    if frontend != "kernel":
        return  # the pyfuse3 frontend has no spill: correctness only
    assert first["spill_chunks"] >= 1, first
    # about once per node: a READ that reaches the other worker before the chunk's spill
    # has landed copies the chunk from the shared table (read/shared.py), or waits for the
    # worker decoding it. The wait is 3 ms, which a busy machine can outlast: what holds
    # whatever the timing is at most one decode per worker and chunk (plus one per spill
    # the queue dropped); with neither spill nor table it would be one per READ.
    bound = len(touched) * first["workers"] + first["spill_dropped"]
    assert len(touched) <= first["chunks_decoded"] <= bound, (first, len(touched))
    # and the preads were page-cache hits: far fewer READ requests than preads
    assert first["reads"] < sum(map(len, offsets)) / 4, first
    # the spill threads finish; then every page of every chunk touched is in the page cache
    assert _settled(mnt)
    reads_before = _stats(mnt)["requests_by_op"].get("read", 0)
    again = [list(range(c * MiB, min(len(data), (c + 1) * MiB), PAGE)) for c in sorted(touched)]
    pages = _page_pass(path, [o for offs in again for o in offs])
    flat = [o for offs in again for o in offs]
    assert all(p == data[o:o + PAGE] for o, p in zip(flat, pages))
    after = _stats(mnt)
    assert after["requests_by_op"].get("read", 0) - reads_before <= 2 * len(touched), after
    assert after["decoded_per_returned"] is not None


@pytest.mark.frontends("kernel")  # the spill is the kernel frontend's
def test_spill_can_be_turned_off_for_comparisons(tree, store, mounted, frontend):
    """--no-chunk-spill (benchmarks compare with and without): the same bytes, no spill,
    and a page pass decodes a chunk per READ that misses the 1 MiB cache."""
    mnt = mounted(store, "--cache-mb", "0", "--no-chunk-spill")
    data = (tree["root"] / "pages.bin").read_bytes()
    offsets = [random.Random(5).randrange(len(data) // PAGE) * PAGE for _ in range(200)]
    pages = _page_pass(os.path.join(mnt, "pages.bin"), offsets)
    assert all(p == data[o:o + PAGE] for o, p in zip(offsets, pages))
    st = _stats(mnt)
    assert st["spill_chunks"] == 0
    assert st["chunks_decoded"] >= st["requests_by_op"]["read"] - 2, st


@pytest.mark.mpi
@pytest.mark.frontends("kernel")  # worker ranks' spill is the kernel frontend's
def test_worker_ranks_share_and_spill_chunks(tree, store, tmp_path, frontend):
    """Two nodes of three MPI ranks (``--ranks-per-node 3``: on the kernel frontend two
    worker ranks serve a node's mount; they receive the shared chunk table with their
    /dev/fuse descriptor): random pages of the 12 MiB file from two processes on node 0,
    right, some of its chunks remote; decodes bounded by what the design guarantees.

    The guarantee holds on a busy machine too: a worker decodes a chunk once, then its
    spill puts the chunk's pages in the page cache (no READ reaches any worker for them
    again) and, until then, its slot of the shared table or its own cache answers. Only a
    wait for another worker's decode (3 ms) can time out under load, so each of the node's
    two workers decodes each touched chunk at most once, plus one for each spill the queue
    dropped. Without the spill and the table every READ decodes (about 800)."""
    from mpi_helpers import MpiJob, mpi_available

    ok, why = mpi_available()
    if not ok:
        pytest.skip(why)
    data = (tree["root"] / "pages.bin").read_bytes()
    rng = random.Random(6)
    offsets = [[rng.randrange(len(data) // PAGE) * PAGE for _ in range(400)] for _ in range(2)]
    touched = {off // MiB for offs in offsets for off in offs}
    with MpiJob(store, tmp_path, ranks=2, ranks_per_node=3, extra=["--cache-mb", "1"]) as job:
        path = os.path.join(job.mnt(0), "pages.bin")
        with mp.get_context(READERS).Pool(2) as pool:
            got = pool.starmap(_page_pass, [(path, o) for o in offsets])
        for offs, pages in zip(offsets, got):
            assert all(p == data[o:o + PAGE] for o, p in zip(offs, pages))
        st = job.stats(0)
        assert st["errors"] == 0
        if frontend == "kernel":
            assert st["workers"] == 2 and st["spill_chunks"] >= 1, st
            bound = len(touched) * st["workers"] + st["spill_dropped"]
            assert len(touched) <= st["chunks_decoded"] <= bound, (st, len(touched))
            assert st["reads"] < sum(map(len, offsets)) / 4, st
        for node in range(2):
            assert run_main("umount", job.mnt(node), timeout=60).returncode == 0
        assert job.wait_exit(60) == 0, job.output()[-3000:]


def test_a_damaged_chunk_is_eio_for_its_pages_alone(store, tree, tmp_path, mounted, frontend):
    """One chunk of the 12 MiB file damaged: a random page pass gets EIO for that chunk's
    pages and right bytes everywhere else (nothing damaged is spilled or shared), and the
    mount keeps serving."""
    import errno

    from helpers import copy_store, damage_file

    bad = copy_store(store, tmp_path / "bad")
    damage_file(bad, "pages.bin", chunk=5)
    mnt = mounted(bad, "--cache-mb", "1")
    data = (tree["root"] / "pages.bin").read_bytes()
    path = os.path.join(mnt, "pages.bin")
    rng = random.Random(8)
    offsets = sorted({rng.randrange(len(data) // PAGE) * PAGE for _ in range(600)})
    fd = os.open(path, os.O_RDONLY)
    eio = 0
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        for off in offsets:
            try:
                page = os.pread(fd, PAGE, off)
            except OSError as exc:
                assert exc.errno == errno.EIO and off // MiB == 5, (off, exc)
                eio += 1
                continue
            assert off // MiB != 5 and page == data[off:off + PAGE], off
    finally:
        os.close(fd)
    assert eio == sum(1 for off in offsets if off // MiB == 5) > 0
    with open(os.path.join(mnt, "array.npy"), "rb") as f:  # another file: still served
        assert f.read(6) == b"\x93NUMPY"


def test_the_api_reads_a_large_file_lazily(tree, store):
    """``open_store(STORE).open`` of a 12 MiB file: random seeks and reads decode only the
    chunks they touch, each once while the cache holds it; with a 1 MiB cache (smaller than
    the file) memory stays within it and every byte is still right. numpy reads a .npy
    through the same file object."""
    import fanstore

    data = (tree["root"] / "pages.bin").read_bytes()
    rng = random.Random(9)
    offsets = [rng.randrange(len(data) - PAGE) for _ in range(400)]
    for cache_mb in (64, 1):
        with fanstore.open_store(str(store), cache_mb=cache_mb) as s, s.open("pages.bin") as f:
            for off in offsets:
                f.seek(off)
                assert f.read(PAGE) == data[off:off + PAGE], off
            f.seek(-5, os.SEEK_END)
            assert f.read() == data[-5:] and f.read() == b""
            st = s.stats()
            span = 64 << 10  # the file object's buffer: what one read asks of the store
            touched = {c for off in offsets
                       for c in range(off // MiB, min(len(data), off + span) // MiB + 1)}
            if cache_mb == 64:
                assert st["chunks_decoded"] <= len(touched), st
            assert st["cache_bytes"] <= cache_mb << 20, st
        with fanstore.open_store(str(store), cache_mb=cache_mb) as s, s.open("array.npy") as f:
            assert np.array_equal(np.load(f), tree["array"])
