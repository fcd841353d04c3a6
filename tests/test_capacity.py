"""Capacity: solid blocks (format v2), trained dictionaries, and the default pack.

Solid stores are read through every reader the project has: the Python API on the store,
the real FUSE mount, the API on the mount (the daemon's fetch), ``cat`` and ``verify``;
damage to a solid chunk must fail exactly the files inside it. The default ``pack``
(quick selection) is checked through the real CLI.
"""

from __future__ import annotations

import errno
import json
import os
import random
import re
import subprocess
import sys

import numpy as np
import pytest
from helpers import (
    assert_cli_error,
    assert_no_traceback,
    copy_store,
    flip_bytes,
    fuse_available,
    os_error,
    run_cli,
    run_main,
)

import fanstore
from compressors import parse_codec_spec
from fanstore.errors import CorruptDataError
from fanstore.format.index import read_index
from fanstore.namespace import Namespace

needs_fuse = pytest.mark.skipif(not fuse_available()[0], reason=fuse_available()[1])

WORDS = ("person bicycle car dog cat horse sheep bus train truck boat bird bench kite "
         "umbrella pizza sandwich laptop phone clock vase book chair couch bed").split()


def _text_file(rng: random.Random, kind: str, i: int) -> bytes:
    if kind == "json":
        objs = [{"id": rng.randrange(10**6), "category": rng.choice(WORDS),
                 "bbox": [round(rng.uniform(0, 600), 2) for _ in range(4)]}
                for _ in range(rng.randrange(2, 9))]
        return (json.dumps({"image_id": i, "file_name": f"{i:09d}.jpg", "width": 640,
                            "height": 480, "annotations": objs}) + "\n").encode()
    if kind == "txt":
        return "".join(f"A {rng.choice(WORDS)} next to a {rng.choice(WORDS)} in the "
                       f"{rng.choice(WORDS)}.\n" for _ in range(rng.randrange(5, 40))).encode()
    rows = "".join(f"{f},{rng.randrange(10**7)},{rng.uniform(0, 900):.1f},"
                   f"{rng.choice(WORDS)},{rng.random():.3f}\n" for f in range(rng.randrange(5, 60)))
    return ("frame,timestamp_ms,x,label,confidence\n" + rows).encode()


@pytest.fixture(scope="module")
def text_tree(tmp_path_factory):
    """(root, {rel: bytes}): 600 small text files of three kinds in 6 directories, one file
    larger than a chunk, an empty file, a symlink."""
    root = tmp_path_factory.mktemp("text") / "src"
    rng = random.Random(13)
    files: dict[str, bytes] = {}
    for i in range(600):
        kind = ("json", "txt", "csv")[i % 3]
        files[f"c{i % 6}/{i:05d}.{kind}"] = _text_file(rng, kind, i)
    files["big/large.bin"] = bytes(rng.randrange(7) for _ in range(300_000))  # 3 chunks of 128K
    files["empty.txt"] = b""
    for rel, data in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)
    os.symlink("c0/00000.json", root / "link.json")
    return root, files


@pytest.fixture(scope="module")
def solid_store(text_tree, tmp_path_factory):
    """``text_tree`` packed with zstd:3 and solid blocks of 16 KiB (chunks of 128 KiB)."""
    dest = tmp_path_factory.mktemp("solid") / "store"
    run_main("pack", text_tree[0], dest, "--codec", "zstd:3", "--solid-kb", "16",
            "--chunk-kb", "128", "--partitions", "3", "--jobs", "2", "--no-progress",
            check=True)
    return dest


def _solid_groups(store) -> dict[int, list[str]]:
    """chunk -> paths of the files that share it (only chunks with several files)."""
    index = read_index(str(store))
    single = np.nonzero((index.entries["kind"] == 0) & (index.entries["count"] == 1))[0]
    groups: dict[int, list[str]] = {}
    for entry in single.tolist():
        groups.setdefault(int(index.entries["first"][entry]), []).append(
            os.fsdecode(index.path(entry)))
    return {k: v for k, v in groups.items() if len(v) > 1}


# --------------------------------------------------------------------------- the store


def test_solid_store_is_format_v5_and_shares_chunks(solid_store, text_tree):
    index = read_index(str(solid_store))
    assert index.version == 5 == index.meta["format_version"]
    groups = _solid_groups(solid_store)
    ns = Namespace(index)
    in_blocks = sum(len(v) for v in groups.values())
    assert in_blocks >= 550  # nearly every small file shares a block
    for paths in groups.values():  # one kind per block
        assert len({p.rsplit(".", 1)[1] for p in paths}) == 1, paths
    # Every block holds at most 16 KiB; its files lie back to back inside it.
    for k, paths in groups.items():
        raw = int(index.chunks["raw"][k])
        assert raw <= 16 << 10
        spans = sorted((int(index.entries["offset"][ns.resolve(p)]),
                        int(index.entries["size"][ns.resolve(p)])) for p in paths)
        assert spans[0][0] == 0
        assert all(a + n == b for (a, n), (b, _) in zip(spans, spans[1:]))
        assert spans[-1][0] + spans[-1][1] == raw
    big = ns.resolve("big/large.bin")
    assert int(index.entries["count"][big]) == 3 and int(index.entries["offset"][big]) == 0
    proc = run_main("info", solid_store, check=True)
    assert re.search(rf"^solid blocks   {len(groups):,} chunks holding {in_blocks:,} files$",
                     proc.stdout, re.M), proc.stdout
    assert "format         v5 (fanstore " in proc.stdout


def test_solid_store_is_smaller_than_per_file(solid_store, text_tree, tmp_path):
    plain = tmp_path / "plain"
    run_main("pack", text_tree[0], plain, "--codec", "zstd:3", "--chunk-kb", "128",
            "--partitions", "3", "--no-progress", check=True)
    a = read_index(str(plain)).meta["counts"]["stored_bytes"]
    b = read_index(str(solid_store)).meta["counts"]["stored_bytes"]
    assert b < 0.9 * a, (a, b)
    assert read_index(str(plain)).version == 5


def test_solid_store_reads_through_the_api(solid_store, text_tree):
    _, files = text_tree
    with fanstore.open_store(str(solid_store), cache_mb=0) as store:
        for rel, data in files.items():
            assert store.read(rel) == data, rel
            assert store.stat(rel).st_size == len(data)
        assert store.read("link.json") == files["c0/00000.json"]
        rng = random.Random(3)
        for rel in rng.sample(sorted(files), 60):  # byte ranges, also past the end
            data = files[rel]
            for _ in range(4):
                off = rng.randrange(len(data) + 10)
                n = rng.randrange(1, 5000)
                assert store.read_range(rel, off, n) == data[off : off + n], (rel, off, n)
        with store.open("c1/00001.txt") as f:
            f.seek(7)
            assert f.read(11) == files["c1/00001.txt"][7:18]


def test_cat_and_verify_of_a_solid_store(solid_store, text_tree):
    _, files = text_tree
    for rel in ("c2/00002.csv", "c5/00599.csv", "big/large.bin", "empty.txt"):
        proc = run_main("cat", solid_store, rel, text=False, check=True)
        assert proc.stdout == files[rel], rel
    proc = run_main("verify", solid_store, "--no-progress", check=True)
    assert f"verified {len(files):,} files" in proc.stderr and "all intact" in proc.stderr


@needs_fuse
def test_solid_store_reads_through_the_mount(frontend, mounted, solid_store, text_tree):
    _, files = text_tree
    mnt = mounted(solid_store, "--cache-mb", "1")
    order = sorted(files)
    random.Random(4).shuffle(order)  # random order: neighbours are not in the cache
    for rel in order:
        with open(mnt / rel, "rb", buffering=0) as f:
            assert f.read() == files[rel], rel
        assert os.stat(mnt / rel).st_size == len(files[rel])
    fd = os.open(mnt / "c3/00003.json", os.O_RDONLY)
    try:
        data = files["c3/00003.json"]
        for off in (0, 1, 100, len(data) - 1, len(data), len(data) + 50):
            assert os.pread(fd, 64, off) == data[off : off + 64], off
    finally:
        os.close(fd)
    # The API on the live mount reads the partitions staged on this node itself.
    with fanstore.open_store(str(mnt)) as store:
        for rel in order[:200]:
            assert store.read(rel) == files[rel], rel


@needs_fuse
def test_a_solid_block_is_decoded_once_per_worker_not_once_per_file(frontend, mounted,
                                                                   solid_store, text_tree):
    """Whole files of a solid block are slices of one decoded chunk: the mount keeps that
    chunk in its cache (what select's read-order model counts on), so a shuffled pass
    decodes each block about once per worker, not once per file."""
    _, files = text_tree
    mnt = mounted(solid_store, "--workers", "2")
    order = sorted(files)
    random.Random(9).shuffle(order)
    for rel in order:
        with open(mnt / rel, "rb", buffering=0) as f:
            assert f.read() == files[rel], rel
    st = json.loads(run_main("stats", mnt, "--json", check=True).stdout)
    index = read_index(str(solid_store))
    blocks = int(np.count_nonzero(np.bincount(index.entries["first"][index.entries["kind"] == 0],
                                              minlength=index.n_chunks) > 1))
    assert blocks > 5
    workers = 2 if frontend == "kernel" else 1
    assert st["chunks_decoded"] <= workers * index.n_chunks, (st["chunks_decoded"], blocks)
    assert st["chunks_decoded"] < len(files) // 2


@needs_fuse
def test_damaged_solid_block_fails_exactly_its_files(frontend, mounted, solid_store, text_tree,
                                                     tmp_path):
    _, files = text_tree
    store = copy_store(solid_store, tmp_path / "damaged")
    groups = _solid_groups(store)
    k, victims = sorted(groups.items())[len(groups) // 2]
    index = read_index(str(store))
    part = index.partitions[int(index.chunks["part"][k])].name
    off, n = int(index.chunks["offset"][k]), int(index.chunks["stored"][k])
    flip_bytes(store / part, off + n // 2, min(8, n))
    # verify names exactly the files of that block
    proc = run_main("verify", store, "--no-progress")
    assert proc.returncode == 1
    assert_no_traceback(proc)
    damaged = {ln.split(": ", 1)[0][len("DAMAGED "):] for ln in proc.stdout.splitlines()}
    assert damaged == set(victims)
    # the API and the mount: EIO (CorruptDataError) for them, right bytes for the others
    with fanstore.open_store(str(store), cache_mb=0) as api:
        for rel in victims:
            with pytest.raises(CorruptDataError):
                api.read(rel)
    mnt = mounted(store)

    def read(path):
        with open(path, "rb", buffering=0) as f:
            return f.read()

    for rel in victims:
        assert os_error(read, mnt / rel) == errno.EIO, rel
    for rel in sorted(set(files) - set(victims))[:150]:
        assert read(mnt / rel) == files[rel], rel


# --------------------------------------------------------------------------- pack options


def test_default_pack_runs_a_quick_selection(text_tree, tmp_path):
    src, files = text_tree
    dest = tmp_path / "default"
    proc = run_main("pack", src, dest, "--chunk-kb", "128", "--partitions", "2",
                   "--no-progress", check=True)
    assert_no_traceback(proc)
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    assert re.fullmatch(r"fanstore: codec: quick selection on a [\d.,]+ MB sample in "
                        r"[\d.]+ s: .+ of the bytes; predicted ratio [\d.]+x \(--codec SPEC "
                        r"pins one, --codec auto runs the full selector\)", lines[0]), lines[0]
    index = read_index(str(dest))
    sel = index.meta["selection"]
    assert sel["quick"] is True and sel["mode"] == "quick"
    assert set(sel["per_kind"]) == {"json/tiny", "txt/tiny", "csv/tiny", "bin/medium"}
    # Small text files get a trained dictionary: smaller than the old default, zstd:3.
    assert any("+dict" in label for label in sel["per_kind"].values())
    for label in sel["per_kind"].values():  # what info shows is a --codec value
        parse_codec_spec(label)
    assert any("dict" in cfg for cfg in index.codecs)
    old = tmp_path / "zstd3"
    run_main("pack", src, old, "--codec", "zstd:3", "--chunk-kb", "128", "--partitions", "2",
            "--no-progress", check=True)
    size = lambda s: os.path.getsize(s / "fanstore.idx") + read_index(str(s)).meta[  # noqa
        "counts"]["stored_bytes"]
    assert size(dest) < 0.9 * size(old), (size(dest), size(old))
    with fanstore.open_store(str(dest)) as store:
        for rel, data in files.items():
            assert store.read(rel) == data, rel
    assert "quick" in run_main("info", dest, check=True).stdout


def test_default_pack_puts_small_files_in_solid_blocks(text_tree, tmp_path):
    """Kinds of small files go into solid blocks of 32 KiB at the level the quick selection
    measured (recorded per kind); large files keep chunks of their own; --solid-kb 0 packs
    every file on its own; both read back byte for byte."""
    src, files = text_tree
    dest, single = tmp_path / "default", tmp_path / "single"
    run_main("pack", src, dest, "--chunk-kb", "128", "--no-progress", check=True)
    run_main("pack", src, single, "--chunk-kb", "128", "--solid-kb", "0", "--no-progress",
            check=True)
    index = read_index(str(dest))
    sel = index.meta["selection"]
    small = {k for k in sel["per_kind"] if k.endswith("/tiny")}
    assert sel["solid_kb"] == {k: 32 for k in small}
    assert all(sel["per_kind"][k].endswith("+solid32k") for k in small)
    groups = _solid_groups(dest)
    assert sum(len(v) for v in groups.values()) >= 550
    assert all(int(index.chunks["raw"][k]) <= 32 << 10 for k in groups)
    big = Namespace(index).resolve("big/large.bin")
    assert int(index.entries["count"][big]) > 1 and int(index.entries["offset"][big]) == 0
    plain = read_index(str(single))
    assert not _solid_groups(single) and plain.meta["selection"]["solid_kb"] == {}
    assert index.meta["counts"]["stored_bytes"] < plain.meta["counts"]["stored_bytes"]
    for store in (dest, single):
        with fanstore.open_store(str(store), cache_mb=0) as reader:
            for rel, data in files.items():
                assert reader.read(rel) == data, rel


def test_pinned_codec_runs_no_selection(text_tree, tmp_path):
    proc = run_main("pack", text_tree[0], tmp_path / "s", "--codec", "lz4", "--no-progress",
                   check=True)
    assert proc.stderr == ""
    index = read_index(str(tmp_path / "s"))
    assert "selection" not in index.meta
    assert {c["id"] for c in index.codecs} == {"none", "lz4"}


def test_codec_with_dictionaries(text_tree, tmp_path):
    src, files = text_tree
    dest = tmp_path / "dict"
    proc = run_main("pack", src, dest, "--codec", "zstd:5+dict", "--no-progress", check=True)
    assert proc.stderr == ""
    index = read_index(str(dest))
    with_dict = [c for c in index.codecs if "dict" in c]
    assert with_dict and all(c["id"] == "zstd" and c["level"] == 5 for c in with_dict)
    with fanstore.open_store(str(dest)) as store:
        for rel, data in files.items():
            assert store.read(rel) == data, rel


@pytest.mark.parametrize("args, message", [
    (("--codec", "lz4+dict"), "only zstd:L takes a trained dictionary"),
    (("--codec", "zstd:99+dict"), "--codec: invalid codec spec"),
    (("--codec", "zstd:3", "--solid-kb", "2048"), "--solid-kb 2048 is larger than the chunk"),
    (("--solid-kb", "-1"), "--solid-kb"),
])
def test_bad_capacity_options(text_tree, tmp_path, args, message):
    proc = run_main("pack", text_tree[0], tmp_path / "s", *args, "--no-progress")
    assert_cli_error(proc, code=2, contains=message)
    assert not (tmp_path / "s").exists()


def test_solid_with_the_default_selection_and_dictionaries(text_tree, tmp_path):
    src, files = text_tree
    dest = tmp_path / "s"
    run_main("pack", src, dest, "--solid-kb", "32", "--chunk-kb", "128", "--no-progress",
            check=True)
    index = read_index(str(dest))
    assert index.version == 5 and _solid_groups(dest)
    with fanstore.open_store(str(dest), cache_mb=0) as store:
        for rel, data in files.items():
            assert store.read(rel) == data, rel


@pytest.mark.parametrize("tree", ["nothing", "empty files"])
def test_default_pack_of_a_tree_without_data(tmp_path, tree):
    src = tmp_path / "src"
    src.mkdir()
    if tree == "empty files":
        for i in range(5):
            (src / f"e{i}").write_bytes(b"")
    proc = run_main("pack", src, tmp_path / "s", "--no-progress", check=True)
    assert_no_traceback(proc)
    with fanstore.open_store(str(tmp_path / "s")) as store:
        assert sorted(store.files()) == ([f"e{i}" for i in range(5)] if tree != "nothing"
                                         else [])


# --------------------------------------------------------------------------- select


def _select_json(src, *args, env=None, timeout=300):
    proc = run_main("select", src, "--json", "--sample-mb", "4", "--storage-mb-per-sec", "1000",
                   *args, env=env, timeout=timeout)
    assert_no_traceback(proc)
    assert proc.returncode in (0, 3), proc.stderr
    return json.loads(proc.stdout), proc


@pytest.mark.long  # a real selection or pack --codec auto: over 5 s of CPU
@pytest.mark.parametrize("reader", ["api", pytest.param("mount", marks=needs_fuse)])
def test_select_measures_its_finalists(text_tree, tmp_path, reader):
    """The finalists are packed and read through the public interfaces, cold, three rounds
    each (the default; one through a mount, whose rounds cost a mount each); their rates are
    the measurements, the others the model's; the reader's cost is fitted to the raw (none)
    trial; nothing of the trials is left behind."""
    work = tmp_path / "tmp"
    work.mkdir()
    rounds = 3 if reader == "api" else 1
    # --trials 3: `none` (the reader's fit and the default budget) and two finalists
    doc, proc = _select_json(text_tree[0], "--reader", reader, "--trials", "3",
                             *([] if rounds == 3 else ["--rounds", str(rounds)]),
                             env={"TMPDIR": str(work)})
    r = doc["reader"]
    assert r["reader"] == reader and r["readers"] == min(doc["budget"]["cores"],
                                                         len(os.sched_getaffinity(0)))
    assert r["files"] >= 64 and r["per_file_us"] > 0 and r["per_chunk_us"] >= 0
    m = doc["measurement"]
    assert m["measured"] is True and m["note"] is None and m["trials"] >= 3
    assert m["rounds"] == rounds  # the default: 3, and up to 2 more while they disagree
    cands = {c["codec"]: c for c in doc["candidates"]}
    measured = {k: c for k, c in cands.items() if c["rate_from"] == "measured"}
    assert "none" in measured and len(measured) == m["trials"]
    required = doc["budget"]["required_files_per_s"]
    for c in cands.values():
        if c["rate_from"] == "measured":
            got = c["measured"]
            assert rounds <= len(got["rounds_files_per_s"]) <= rounds + 2
            assert got["trial_files"] > 0
            assert c["files_per_s"] == pytest.approx(got["files_per_s"], rel=1e-3)
            assert c["meets_budget"] == (c["files_per_s"] >= required * 0.9999)
        else:
            assert c["measured"] is None and c["files_per_s"] == c["model_files_per_s"]
    # The default budget is 90% of what the data stored raw measured, and the choice is
    # the best measured ratio that meets it.
    assert doc["budget"]["from"] == "default"
    assert required == pytest.approx(0.9 * measured["none"]["files_per_s"], rel=1e-2)
    chosen = cands[doc["chosen"]]
    assert chosen["rate_from"] == "measured" and chosen["meets_budget"] and doc["met"]
    best = max(c["ratio"] for c in measured.values() if c["meets_budget"])
    assert chosen["ratio"] >= best / 1.0101
    # Dictionaries and solid blocks are candidates on small files.
    assert {"zstd:3+dict", "zstd:19+dict", "zstd:3+solid64k"} <= set(cands)
    assert os.listdir(work) == []  # the trial stores (and mount points) are gone
    with open("/proc/mounts") as f:
        assert str(tmp_path) not in f.read()


def test_select_without_a_reader_model_in_the_library(text_tree):
    from fanstore.select import SelectionOptions, run_selection
    from fanstore.select.report import to_json

    res = run_selection(str(text_tree[0]), SelectionOptions(  # a short bench: not the point
        sample_mb=2, storage_mb_per_sec=1e3, encode_seconds=1.0, progress=False))
    assert res.reader is None and to_json(res)["reader"] is None


@pytest.mark.parametrize("setup, args, message", [
    ("files", ("--reader", "disk"), "argument --reader: invalid choice: 'disk'"),
    ("nothing", (), "holds no files to sample"),
    ("empty files", (), "holds no data to sample (5 files, all empty)"),
    ("files", ("--sample-mb", "0"), "--sample-mb: must be positive"),
])
def test_select_bad_input(tmp_path, setup, args, message):
    src = tmp_path / "src"
    src.mkdir()
    if setup == "empty files":
        for i in range(5):
            (src / f"e{i}").write_bytes(b"")
    elif setup == "files":
        (src / "a.txt").write_bytes(b"hello " * 1000)
    proc = run_main("select", src, *args)
    assert_cli_error(proc, code=2, contains=message)
    assert proc.stdout == ""

@pytest.mark.long  # a real selection or pack --codec auto: over 5 s of CPU

def test_select_on_one_10_gb_file(tmp_path):
    """One huge (sparse) file: the sample reads a few chunks of it, nothing divides by zero,
    and the report is complete."""
    src = tmp_path / "src"
    src.mkdir()
    with open(src / "huge.bin", "wb") as f:
        f.truncate(10 << 30)
    doc, proc = _select_json(src, "--reader", "api", "--trials", "2", "--rounds", "1")
    assert proc.returncode == 0
    assert doc["sample"]["source_files"] == 1 and doc["sample"]["source_mb"] > 10_000
    # zeros compress far (the sampled ratios); which codec wins the measured race against
    # raw depends on the machine's load, not on the file's size
    assert max(c["ratio"] for c in doc["candidates"]) > 100 and doc["met"] is True
    assert doc["predicted"]["ratio"] >= 1 and doc["chosen"] in {c["codec"] for c in
                                                                 doc["candidates"]}
    # the trials read pieces of 64 chunks of the one file, one per reader at least
    assert doc["reader"]["files"] >= 1 and doc["reader"]["chunks"] >= 64
    # the text report's end (measured above: the model's choice is enough here)
    proc = run_main("select", src, "--sample-mb", "4", "--storage-mb-per-sec", "1000",
                   "--trials", "0")
    assert proc.returncode == 0
    assert proc.stdout.splitlines()[-2].startswith("chosen    ")
    assert proc.stdout.splitlines()[-1].startswith("pack      fanstore pack ")
    assert_no_traceback(proc)


_BURN = "import time\nt = time.time() + 120\nwhile time.time() < t:\n    pass\n"


@pytest.mark.long  # a busy loop on every core while it packs
def test_the_default_pack_is_a_function_of_the_data(tmp_path):
    """Two default packs of one tree, the second beside a busy loop on every core: the
    same codecs and the same bytes, file for file (the index records no time)."""
    src = tmp_path / "src"
    rng = np.random.default_rng(8)
    words = [bytes(rng.choice(list(b"abcdefghij klmnop"), 6)) for _ in range(300)]
    for i in range(600):
        d = src / f"c{i % 12}"
        d.mkdir(parents=True, exist_ok=True)
        (d / f"{i}.txt").write_bytes(b" ".join(words[j] for j in rng.integers(0, 300, 400)))
    for i in range(6):
        arr = np.cumsum(rng.standard_normal(100_000).astype(np.float32))
        np.save(src / f"a{i}.npy", arr.astype(np.float32))
    run_main("pack", src, tmp_path / "quiet", "--no-progress", check=True, timeout=300)
    burners = [subprocess.Popen([sys.executable, "-c", _BURN])
               for _ in range(len(os.sched_getaffinity(0)))]
    try:
        run_main("pack", src, tmp_path / "busy", "--no-progress", check=True, timeout=300)
    finally:
        for p in burners:
            p.kill()
            p.wait()
    names = sorted(os.listdir(tmp_path / "quiet"))
    assert names == sorted(os.listdir(tmp_path / "busy"))
    for name in names:
        assert (tmp_path / "quiet" / name).read_bytes() == \
            (tmp_path / "busy" / name).read_bytes(), name
    info = json.loads(run_main("info", tmp_path / "quiet", "--json").stdout)
    sel = info["selection"]
    assert sel["quick"] is True and "seconds" not in sel
    assert any("+dict" in lb for lb in sel["per_kind"].values())  # the text files
    assert any(":shuffle:4" in lb for lb in sel["per_kind"].values())  # the arrays
