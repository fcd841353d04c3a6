"""The read path below FUSE: namespace queries, chunk maths, the LRU, LocalStore reads,
corruption detection, ``verify_store``, and the async reader's one-fetch-per-chunk rule."""

from __future__ import annotations

import errno
import os
import random
import stat

import pytest
import trio

from fanstore.fuse.pyfuse3.reader import AsyncReader
from fanstore.errors import (
    CorruptDataError,
    IsADirectoryError_,
    NotADirectoryError_,
    NotFoundError,
)
from fanstore.format.index import KIND_DIR, KIND_FILE, KIND_SYMLINK
from fanstore.format.partition import partition_name
from fanstore.read import ChunkCache, ChunkReader, LocalPartitions, assemble, chunk_span
from fanstore.store import LocalStore
from fanstore.verify import verify_store
from helpers import BIG_SIZE, MiB, copy_store, damage_file

# --------------------------------------------------------------------------- pure helpers


@pytest.mark.parametrize("offset, size, file_size, expected", [
    (0, 10, 100, (0, 1, 10)),
    (0, 4096, 10000, (0, 1, 4096)),
    (4095, 2, 10000, (0, 2, 4097)),
    (4096, 4096, 10000, (1, 2, 8192)),
    (9000, 5000, 10000, (2, 3, 10000)),  # short at EOF
    (10000, 10, 10000, (0, 0, 10000)),  # at EOF
    (20000, 10, 10000, (0, 0, 20000)),  # past EOF
    (100, 0, 10000, (0, 0, 100)),  # zero length
])
def test_chunk_span(offset, size, file_size, expected):
    assert chunk_span(offset, size, file_size, 4096) == expected


def test_assemble_slices_across_chunks():
    chunks = [bytes([i]) * 4096 for i in range(3)]
    data = b"".join(chunks)
    assert bytes(assemble(chunks[1:2], 1, 4096 + 5, 4096 + 10, 4096)) == data[4101:4106]
    assert bytes(assemble(chunks[0:3], 0, 4000, 9000, 4096)) == data[4000:9000]
    whole = assemble(chunks[2:3], 2, 8192, 12288, 4096)
    assert whole is chunks[2]  # no copy when one chunk is the whole answer


def test_chunk_cache_is_an_lru_with_a_byte_budget():
    cache = ChunkCache(10)
    cache.put(1, b"aaaa")
    cache.put(2, b"bbbb")
    assert cache.get(1) == b"aaaa"  # 1 is now the most recent
    cache.put(3, b"cccc")  # 12 > 10: evicts 2, the least recent
    assert cache.get(2) is None and cache.get(1) == b"aaaa" and cache.get(3) == b"cccc"
    assert cache.used == 8 and len(cache) == 2
    assert (cache.hits, cache.misses) == (3, 1)
    cache.put(4, b"x" * 11)  # larger than the budget: not cached, nothing evicted
    assert not cache.peek(4) and len(cache) == 2
    cache.put(1, b"a")  # replacing updates the byte count
    assert cache.used == 5
    cache.clear()
    assert cache.used == 0 and len(cache) == 0


# --------------------------------------------------------------------------- namespace


@pytest.fixture(scope="module")
def special(special_store):
    with LocalStore(str(special_store)) as s:
        yield s


def test_namespace_queries(special, special_tree):
    ns = special.ns
    root = ns.ROOT
    assert ns.lookup(root, b".") == root and ns.lookup(root, b"..") == root
    text = ns.lookup(root, b"text")
    assert ns.lookup(text, b"..") == root and ns.parent(text) == root
    hello = ns.lookup(text, b"hello.txt")
    assert ns.kind(hello) == KIND_FILE and ns.path(hello) == b"text/hello.txt"
    assert ns.lookup(text, b"missing") is None
    with pytest.raises(NotADirectoryError_):
        ns.children(hello)
    with pytest.raises(NotFoundError) as info:
        ns.resolve("text/missing")
    assert info.value.errno == errno.ENOENT
    link = ns.resolve("links/to_dir")
    assert ns.kind(link) == KIND_SYMLINK and ns.readlink(link) == b"../text"
    assert ns.resolve("links/to_dir/hello.txt") == hello  # a symlink on the way is followed
    s = ns.stat(ns.resolve("modes/run.sh"))
    assert s.mode == stat.S_IFREG | 0o755 and s.nlink == 1
    s = ns.stat(ns.resolve("modes/sticky"))
    assert s.mode == stat.S_IFDIR | 0o1777 and s.kind == KIND_DIR
    # nlink of a directory: 2 + its subdirectories.
    src_modes = os.path.join(special_tree["root"], "modes")
    subdirs = sum(os.path.isdir(os.path.join(src_modes, n)) for n in os.listdir(src_modes))
    assert ns.stat(ns.resolve("modes")).nlink == 2 + subdirs
    assert ns.show(root) == "/"


def test_walk_files_yields_every_file_once(special, special_tree):
    files = list(special.ns.walk_files())
    assert len(files) == len(set(files)) == special_tree["files"]
    assert all(special.ns.kind(f) == KIND_FILE for f in files)


# --------------------------------------------------------------------------- LocalStore reads


def test_random_reads_of_the_big_file(special, special_tree):
    data = open(special_tree["big"], "rb").read()
    assert len(data) == BIG_SIZE
    entry = special.file_entry("large/big.bin")
    rng = random.Random(3)
    cases = [(0, 0), (0, 1), (MiB - 1, 2), (BIG_SIZE - 1, 10), (BIG_SIZE, 10),
             (BIG_SIZE + 5, 1), (5 * MiB, 3 * MiB + 7)]
    cases += [(rng.randrange(BIG_SIZE), rng.choice([1, 4096, 131072, MiB + 3]))
              for _ in range(60)]
    for off, size in cases:
        assert special.read(entry, off, size) == data[off : off + size], (off, size)
    assert special.read(entry) == data


def test_iter_file_gives_chunk_sized_pieces(special, special_tree):
    entry = special.file_entry("chunks/one_more.bin")
    pieces = list(special.iter_file(entry))
    assert [len(p) for p in pieces] == [MiB, 1]
    assert b"".join(pieces) == open(special_tree["chunk_files"][2], "rb").read()
    assert list(special.iter_file(special.file_entry("empty/empty.txt"))) == []


def test_file_entry_follows_symlinks_like_open(special):
    """One symlink rule everywhere: reading a path follows symlinks inside the store."""
    with pytest.raises(IsADirectoryError_) as info:
        special.file_entry("text")
    assert info.value.errno == errno.EISDIR
    hello = special.file_entry("text/hello.txt")
    assert special.file_entry("links/to_file") == hello
    assert special.file_entry("links/to_link") == hello  # a link to a link
    assert special.file_entry("links/to_dir/hello.txt") == hello  # a link in the middle
    with pytest.raises(IsADirectoryError_, match="links/to_dir: is a directory"):
        special.file_entry("links/to_dir")
    with pytest.raises(NotFoundError, match="links/dangling: no such file"):
        special.file_entry("links/dangling")
    with pytest.raises(NotFoundError, match="no such file"):
        special.file_entry("nope")
    # stat-like lookups do not follow the last component (lstat)
    assert special.ns.kind(special.ns.resolve("links/to_file")) == KIND_SYMLINK


def test_every_small_file_reads_back(special_store, special_tree):
    """Every file of the 3,000-entry directory (many per chunk run, tiny) reads back exactly."""
    with LocalStore(str(special_store), cache_bytes=0) as s:  # no cache: every read decodes
        for i in range(0, 3000, 7):
            assert s.read_file(f"big_dir/f{i:05d}.dat") == b"%d\n" % i * (i % 7)


# --------------------------------------------------------------------------- corruption


@pytest.fixture
def damaged_small(small_store, tmp_path):
    store = copy_store(small_store, tmp_path / "s")
    damage_file(store, "sub/deeper/d.txt", chunk=1)
    damage_file(store, "a.txt")
    return store


def test_damaged_chunks_raise_corrupt_data_naming_the_file(damaged_small, small_tree):
    _, files = small_tree
    with LocalStore(str(damaged_small)) as s:
        with pytest.raises(CorruptDataError) as info:
            s.read_file("a.txt")
        assert info.value.errno == errno.EIO
        assert str(info.value).startswith("a.txt: data ")
        assert "partition" in str(info.value) and "offset" in str(info.value)
        d = s.file_entry("sub/deeper/d.txt")
        with pytest.raises(CorruptDataError):
            s.read(d)
        # Chunk 0 of that file is intact and chunk 1 never returns wrong bytes.
        assert s.read(d, 0, 4096) == files["sub/deeper/d.txt"][:4096]
        with pytest.raises(CorruptDataError):
            s.read(d, 4096, 10)
        for rel, data in files.items():
            if rel not in ("a.txt", "sub/deeper/d.txt"):
                assert s.read_file(rel) == data


def test_partition_shrunk_after_open_is_a_short_read(small_store, tmp_path):
    store = copy_store(small_store, tmp_path / "s")
    with LocalStore(str(store)) as s:
        for n in range(2):
            os.truncate(store / partition_name(n), 64)
        with pytest.raises(CorruptDataError, match="short read"):
            s.read_file("sub/deeper/d.txt")


def test_verify_store_in_process(damaged_small, small_store):
    report = verify_store(str(small_store), jobs=2, progress=False)
    assert report.damaged == [] and report.checked == 6
    report = verify_store(str(damaged_small), jobs=2, progress=False)
    assert sorted(p for p, _ in report.damaged) == ["a.txt", "sub/deeper/d.txt"]
    assert report.checked == 6
    assert report.summary().endswith("2 damaged")
    assert report.damaged_lines()[0].startswith("DAMAGED a.txt: data ")


def test_verify_only_present_skips_missing_partitions(small_store, tmp_path):
    data_dir = tmp_path / "local"
    data_dir.mkdir()
    name = partition_name(1)
    (data_dir / name).write_bytes((small_store / name).read_bytes())
    report = verify_store(str(small_store), progress=False, data_dir=str(data_dir),
                          only_present=True)
    assert report.skipped_partitions == [0] and report.damaged == []
    assert 0 < report.checked < 6
    report = verify_store(str(small_store), progress=False, data_dir=str(data_dir))
    assert report.damaged and all("is missing" in why for _, why in report.damaged)


# --------------------------------------------------------------------------- AsyncReader


def _chunk_store(store_path, cache_bytes):
    local = LocalStore(str(store_path))
    parts = LocalPartitions(str(store_path), local.index)
    return local, AsyncReader(local.ns, ChunkReader(local.index, parts, cache_bytes), threads=4)


@pytest.mark.parametrize("cache_bytes", [256 * MiB, 1])
def test_chunk_store_fetches_each_chunk_once_under_concurrency(special_store, special_tree,
                                                               cache_bytes):
    """20 concurrent readers of the same 3 MiB: every chunk is decoded once (with a big
    cache), and every reader gets the right bytes even when nothing can be cached."""
    data = open(special_tree["big"], "rb").read()
    local, cs = _chunk_store(special_store, cache_bytes)
    entry = local.file_entry("large/big.bin")
    results = {}

    async def reader(i):
        off = (i % 4) * 1000
        results[i] = (off, bytes(await cs.read(entry, off, 3 * MiB)))

    async def main():
        async with trio.open_nursery() as nursery:
            for i in range(20):
                nursery.start_soon(reader, i)

    try:
        trio.run(main)
        for off, got in results.values():
            assert got == data[off : off + 3 * MiB]
        assert cs.stats.reads == 20 and cs.stats.errors == 0
        if cache_bytes > 4 * MiB:
            assert cs.stats.chunks_decoded == 4  # chunks 0..3, each once
            before = cs.stats.chunks_decoded
            trio.run(cs.read, entry, 0, 100)
            assert cs.stats.chunks_decoded == before and cs.cache.hits > 0
        assert cs.stats.local_reads >= 1
    finally:
        local.close()
        cs.reader.source.close()


def test_chunk_store_hands_one_error_to_all_waiters(damaged_small):
    local, cs = _chunk_store(damaged_small, 1 << 20)
    entry = local.file_entry("a.txt")
    errors = []

    async def reader():
        try:
            await cs.read(entry, 0, 10)
        except CorruptDataError as exc:
            errors.append(exc)

    async def main():
        async with trio.open_nursery() as nursery:
            for _ in range(5):
                nursery.start_soon(reader)

    try:
        trio.run(main)
        assert len(errors) == 5
        assert cs.stats.errors == 1  # one failed fetch, shared by its waiters
        assert all("a.txt" in str(e) for e in errors)
        with pytest.raises(CorruptDataError):  # a later read tries again and fails again
            trio.run(cs.read, entry, 0, 10)
        assert cs.stats.errors == 2
        assert trio.run(cs.read, local.file_entry("b.bin"), 0, 4) == bytes(range(4))
    finally:
        local.close()
        cs.reader.source.close()
