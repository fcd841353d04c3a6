"""Identical files stored once (``fanstore.pack.dedup``): which files are merged, what the
index holds (format v4 for a shared run of several chunks), the counts, ``verify``, and
every name read back byte for byte, in-process and through a real mount."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import numpy as np
import pytest

from compressors import parse_spec
from fanstore.format.build import shares_runs
from fanstore.format.index import read_index
from fanstore.namespace import Namespace
from fanstore.pack import CodecPolicy, PackOptions, pack
from fanstore.pack import dedup as dedup_mod
from fanstore.store import LocalStore
from fanstore.verify import verify_store
from helpers import damage_file, run_main

CHUNK = 4096


def make_dup_tree(root) -> dict[str, bytes]:
    """A tree with duplicate small files, duplicate multi-chunk files and duplicates across
    directories, plus near misses (same size, other bytes; the same head, another tail).
    Returns {relative path: content}."""
    rng = random.Random(35)
    big = rng.randbytes(3 * CHUNK + 123)  # 4 chunks
    text = b"a small text file, the same in several places\n" * 8
    near = bytearray(big)
    near[-1] ^= 0xFF  # the same size and 64 KiB head... and another last byte
    files = {
        "big.bin": big,
        "a/big.bin": big,
        "a/b/big_copy.bin": big,
        "c/big_near.bin": bytes(near),
        "c/big_other.bin": rng.randbytes(len(big)),
        "text.txt": text,
        "a/text.txt": text,
        "c/d/text2.txt": text,
        "c/tiny": b"x" * 100,
        "c/tiny_same_size": b"y" * 100,
        "a/tiny": b"x" * 100,
        "empty": b"",
        "a/empty": b"",
        "unique.bin": rng.randbytes(5000),
    }
    for rel, data in files.items():
        path = Path(root) / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    return files


def _pack(src, dest, dedup: bool = True, jobs: int = 1, solid: int = 0, **kw):
    return pack(str(src), str(dest), CodecPolicy(parse_spec("zstd:3"), solid=solid),
                PackOptions(partitions=3, jobs=jobs, chunk_size=CHUNK, progress=False,
                            dedup=dedup, **kw))


@pytest.fixture(scope="module")
def dup_tree(tmp_path_factory):
    root = tmp_path_factory.mktemp("dups") / "src"
    return root, make_dup_tree(root)


def _assert_reads(store, files: dict[str, bytes]) -> None:
    with LocalStore(str(store)) as s:
        for rel, data in files.items():
            assert s.read_file(rel) == data, rel


# 3 copies of big (2 saved), 3 of text (2 saved), 2 of x*100 (1 saved)
SAVED_FILES = 5


def _saved_bytes(files):
    return 2 * len(files["big.bin"]) + 2 * len(files["text.txt"]) + 100


@pytest.mark.parametrize("solid", [0, 2048])
def test_identical_files_are_stored_once_and_every_name_reads(dup_tree, tmp_path, solid):
    src, files = dup_tree
    summary = _pack(src, tmp_path / "st", solid=solid)
    plain = _pack(src, tmp_path / "plain", dedup=False, solid=solid)
    assert (summary.duplicates, summary.saved_bytes) == (SAVED_FILES, _saved_bytes(files))
    assert plain.duplicates == 0 and summary.raw_bytes == plain.raw_bytes
    assert plain.stored_bytes - summary.stored_bytes >= 2 * len(files["big.bin"])
    assert any("5 files identical to earlier ones stored once" in line
               for line in summary.lines())
    _assert_reads(tmp_path / "st", files)
    _assert_reads(tmp_path / "plain", files)
    index = read_index(str(tmp_path / "st"))
    ns = Namespace(index)
    run = ns.chunks(ns.resolve("big.bin"))
    assert run[1] == 4
    assert ns.chunks(ns.resolve("a/big.bin")) == run == ns.chunks(ns.resolve("a/b/big_copy.bin"))
    assert ns.chunks(ns.resolve("c/big_near.bin")) != run
    for name in ("a/text.txt", "c/d/text2.txt"):
        e = ns.resolve(name)
        assert ns.chunks(e) == ns.chunks(ns.resolve("text.txt"))
        assert ns.data_offset(e) == ns.data_offset(ns.resolve("text.txt"))
    tiny, other = ns.resolve("c/tiny"), ns.resolve("c/tiny_same_size")
    assert (ns.chunks(tiny), ns.data_offset(tiny)) != (ns.chunks(other), ns.data_offset(other))
    assert index.version == 5 == read_index(str(tmp_path / "plain")).version
    assert index.meta["counts"]["raw_bytes"] == sum(map(len, files.values()))
    assert index.meta["counts"]["stored_bytes"] == sum(p.size for p in index.partitions)
    assert sum(p.files for p in index.partitions) == len(files) - SAVED_FILES  # empty ones too


def test_only_small_duplicates_share_one_chunk_runs(tmp_path):
    """Duplicates that are one-chunk files share their chunk (no run of several is
    shared)."""
    src = tmp_path / "src"
    make_dup_tree(src)
    for rel in ("a/big.bin", "a/b/big_copy.bin"):
        os.unlink(src / rel)
    summary = _pack(src, tmp_path / "st")
    assert summary.duplicates == 3
    index = read_index(str(tmp_path / "st"))
    assert index.version == 5 and not shares_runs(index.entries)


def test_the_pack_is_the_same_whatever_the_jobs(dup_tree, tmp_path, monkeypatch):
    """Two processes hash the candidates (the pool is used from one file on here)."""
    src, _ = dup_tree
    _pack(src, tmp_path / "one", jobs=1)
    monkeypatch.setattr(dedup_mod, "POOL_FROM", 1)
    _pack(src, tmp_path / "two", jobs=2)
    names = sorted(os.listdir(tmp_path / "one"))
    assert names == sorted(os.listdir(tmp_path / "two"))
    for name in names:
        if name != "fanstore.idx":
            assert (tmp_path / "one" / name).read_bytes() == (tmp_path / "two" / name).read_bytes()
    a, b = read_index(str(tmp_path / "one")), read_index(str(tmp_path / "two"))
    for col in ("first", "count", "offset", "checksum"):
        assert np.array_equal(a.entries[col], b.entries[col]), col


def test_a_hash_collision_never_merges_different_files(dup_tree, tmp_path, monkeypatch):
    """Every file of a size gets the same digest: only the byte comparison tells them apart."""
    src, files = dup_tree
    monkeypatch.setattr(dedup_mod, "_digest", lambda path, limit: b"same")
    summary = _pack(src, tmp_path / "st")
    assert summary.duplicates == SAVED_FILES
    _assert_reads(tmp_path / "st", files)


def test_a_broadcast_file_is_merged_only_with_broadcast_files(dup_tree, tmp_path):
    src, files = dup_tree
    summary = _pack(src, tmp_path / "st", broadcast=["a"])
    # Under a/ (broadcast) only a/b/big_copy.bin is a copy of a/big.bin; outside it only
    # c/d/text2.txt of text.txt: the others' first copies are on the other side.
    assert summary.duplicates == 2
    index = read_index(str(tmp_path / "st"))
    ns = Namespace(index)
    assert ns.chunks(ns.resolve("a/b/big_copy.bin")) == ns.chunks(ns.resolve("a/big.bin"))
    assert ns.chunks(ns.resolve("a/big.bin")) != ns.chunks(ns.resolve("big.bin"))
    for rel in ("a/big.bin", "a/b/big_copy.bin", "a/text.txt", "a/tiny"):
        first = ns.chunks(ns.resolve(rel))[0]
        assert index.partitions[int(index.chunks["part"][first])].broadcast, rel
    _assert_reads(tmp_path / "st", files)


def test_verify_checks_a_shared_run_once_and_names_every_file_on_it(dup_tree, tmp_path):
    src, files = dup_tree
    _pack(src, tmp_path / "st")
    report = verify_store(str(tmp_path / "st"), jobs=1, progress=False)
    assert not report.damaged and report.checked == len(files)
    assert report.bytes_checked == sum(map(len, files.values()))
    damage_file(tmp_path / "st", "big.bin", chunk=2)
    report = verify_store(str(tmp_path / "st"), jobs=1, progress=False)
    assert sorted(p for p, _ in report.damaged) == ["a/b/big_copy.bin", "a/big.bin", "big.bin"]


def test_the_cli_says_what_was_stored_once(dup_tree, tmp_path):
    src, files = dup_tree
    args = ("--partitions", "2", "--chunk-kb", "4", "--codec", "zstd:3", "--no-progress")
    out = run_main("pack", src, tmp_path / "st", *args, check=True).stdout
    assert "5 files identical to earlier ones stored once" in out
    plain = run_main("pack", src, tmp_path / "plain", *args, "--no-dedup", check=True).stdout
    assert "identical" not in plain
    info = run_main("info", tmp_path / "st", "--json", check=True).stdout
    doc, ref = json.loads(info), json.loads(run_main("info", tmp_path / "plain", "--json",
                                                    check=True).stdout)
    assert doc["format_version"] == 5 == ref["format_version"]
    assert (doc["duplicate_files"], doc["duplicate_bytes"]) == (SAVED_FILES, _saved_bytes(files))
    assert doc["counts"]["stored_bytes"] < ref["counts"]["stored_bytes"]
    text = run_main("info", tmp_path / "st", check=True).stdout
    assert "stored once    5 files identical to others" in text


@pytest.mark.fuse
@pytest.mark.usefixtures("frontend")
def test_every_name_reads_through_a_mount(dup_tree, tmp_path, mounted):
    """Duplicate small files, duplicate multi-chunk files and duplicates across directories,
    mounted: each name byte for byte (whole, and a read across chunks of the shared run,
    alternating names so the chunk cache serves them), its own inode; fewer stored bytes
    than the same tree packed without dedup."""
    src, files = dup_tree
    _pack(src, tmp_path / "st")
    _pack(src, tmp_path / "plain", dedup=False)
    mnt = mounted(tmp_path / "st")
    for rel, data in files.items():
        assert (mnt / rel).read_bytes() == data, rel
    names = ["big.bin", "a/big.bin", "a/b/big_copy.bin"]
    big = files["big.bin"]
    fds = [os.open(mnt / rel, os.O_RDONLY) for rel in names]
    try:
        for k in range(12):
            at = (k * 1777) % (len(big) - 3000)
            assert os.pread(fds[k % 3], 3000, at) == big[at : at + 3000], (names[k % 3], at)
    finally:
        for fd in fds:
            os.close(fd)
    inodes = {os.stat(mnt / rel).st_ino for rel in files}
    assert len(inodes) == len(files)
    sizes = [os.stat(mnt / rel).st_size for rel in names]
    assert sizes == [len(big)] * 3
    stored = [read_index(str(tmp_path / s)).meta["counts"]["stored_bytes"] for s in ("st", "plain")]
    info = run_main("info", tmp_path / "st", check=True).stdout
    assert f"stored bytes   {stored[0]:,}" in info and stored[0] < stored[1]
