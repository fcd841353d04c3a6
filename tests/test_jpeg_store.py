"""JPEGs packed with ``--codec jpegxl``: the fallbacks counted, every byte back through the
Python API and a real mount, and one clear line where imagecodecs is missing.

The tree: generated JPEGs (tools/gen_jpegs.py) and the inputs jpegxl declines (a CMYK
JPEG, a truncated one, a text file, and, with ``--chunk-kb 128``, every JPEG larger than
one chunk); the codec itself is tested in test_jpegxl.py.
"""

from __future__ import annotations

import errno
import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

pytest.importorskip("imagecodecs", reason="the jpegxl codec needs imagecodecs (jpeg extra)")

from helpers import (  # noqa: E402
    assert_cli_error,
    assert_same_tree,
    copy_store,
    daemon_pid,
    is_mounted,
    os_error,
    process_tree,
    run_cli,
    run_main,
    stored_extent,
    vm_rss_kb,
)
from jpeg_helpers import (  # noqa: E402
    APP5_4000,
    GREY_8192,
    INTER_3200,
    cmyk_jpeg,
    make_jpeg_tree,
    padded,
)

import fanstore  # noqa: E402
from fanstore.format.load import read_index  # noqa: E402

CHUNK_KB = 128
MISSING_LINE = "store needs codec jpegxl: install imagecodecs (pip install 'fanstore[jpeg]')"
_SUMMARY = re.compile(r"^jpegxl: ([\d,]+) of ([\d,]+) files transcoded; ([\d,]+) stored raw",
                      re.M)


@pytest.fixture(scope="module")
def jpeg_tree(tmp_path_factory) -> tuple[Path, dict[str, bytes], set[str]]:
    """(root, relative path -> bytes, the files jpegxl must decline)."""
    root = tmp_path_factory.mktemp("jpegs")
    files = make_jpeg_tree(root / "train", 30)
    files = {f"train/{rel}": data for rel, data in files.items()}
    whole = next(iter(files.values()))
    odd = {"odd/cmyk.jpg": cmyk_jpeg(), "odd/truncated.jpg": whole[: len(whole) // 2],
           "odd/notes.txt": b"labels: cat dog\n" * 40}
    (root / "odd").mkdir()
    for rel, data in odd.items():
        (root / rel).write_bytes(data)
    files.update(odd)
    declined = set(odd) | {rel for rel, data in files.items() if len(data) > CHUNK_KB << 10}
    assert 0 < len(declined) - len(odd) < 25, "the set should hold JPEGs above one chunk"
    return root, files, declined


def _pack(src, dest, *extra) -> subprocess.CompletedProcess:
    return run_main("pack", src, dest, "--codec", "jpegxl", "--chunk-kb", str(CHUNK_KB),
                   "--partitions", "2", "--jobs", "2", "--no-progress", *extra, check=True)


def _summary(proc) -> tuple[int, int, int]:
    m = _SUMMARY.search(proc.stdout)
    assert m, f"no jpegxl line in the summary:\n{proc.stdout}"
    return tuple(int(g.replace(",", "")) for g in m.groups())


@pytest.fixture(scope="module")
def jpeg_store(jpeg_tree, tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    root = jpeg_tree[0]
    store = tmp_path_factory.mktemp("jstore") / "ds.fs"
    return store, _pack(root, store)


def _codec_of_files(store) -> dict[str, str]:
    """Relative path -> the codec id its chunks are stored with ('none' when raw)."""
    index = read_index(str(store))
    ids = [cfg["id"] for cfg in index.codecs]
    out = {}
    for entry in index.file_entries():
        first, count = index.chunk_run(int(entry))
        used = {ids[int(s)] for s in index.chunks["codec"][first:first + count]}
        assert len(used) == 1, used
        out[os.fsdecode(index.path(int(entry)))] = used.pop()
    return out


def test_pack_counts_the_files_it_stored_raw(jpeg_tree, jpeg_store) -> None:
    _, files, declined = jpeg_tree
    store, proc = jpeg_store
    transcoded, planned, raw = _summary(proc)
    assert (planned, raw, transcoded) == (len(files), len(declined), len(files) - len(declined))
    codecs = _codec_of_files(store)
    assert {rel for rel, cid in codecs.items() if cid == "none"} == declined
    assert {cid for rel, cid in codecs.items() if rel not in declined} == {"jpegxl"}
    ratio = float(re.search(r"ratio ([\d.]+)x \(([\d.]+)x with the index\)",
                            proc.stdout).group(2))
    assert ratio > 1.05, proc.stdout


def test_every_file_reads_back_through_the_api(jpeg_tree, jpeg_store) -> None:
    _, files, _ = jpeg_tree
    with fanstore.open_store(str(jpeg_store[0])) as store:
        for rel, data in files.items():
            assert store.read(rel) == data, rel
    assert run_main("verify", jpeg_store[0]).returncode == 0


def test_every_file_reads_back_through_a_mount(jpeg_tree, jpeg_store, mounted) -> None:
    root, files, _ = jpeg_tree
    mnt = mounted(jpeg_store[0])
    dirs = {str(parent) for rel in files for parent in Path(rel).parents} - {"."}
    assert assert_same_tree(root, mnt) == len(files) + len(dirs)
    for rel, data in files.items():  # byte for byte, once more, through a fresh open
        with open(mnt / rel, "rb", buffering=0) as f:
            assert f.read() == data, rel


def _read(path) -> bytes:
    with open(path, "rb", buffering=0) as f:
        return f.read()


def test_streams_declaring_a_huge_jpeg_are_eio_alone(jpeg_tree, jpeg_store, mounted,
                                                     tmp_path) -> None:
    """Three files' stored streams replaced by real JPEG XL streams of JPEGs far larger than
    the files the index records (padded to the chunks' lengths, so the index is untouched):
    a grey 8192x8192 image, 64x64 with 262 MB of APP5 markers, 64x64 with 210 MB of bytes
    between markers. Reading them through a mount is EIO, refused from their headers before
    libjxl allocates the ~154 MB, ~258 MB and ~200 MB they cost (the mount's processes do
    not grow), and every other file reads exactly."""
    _, files, _ = jpeg_tree
    store = copy_store(jpeg_store[0], tmp_path / "hostile.fs")
    codecs = _codec_of_files(store)
    victims = {}
    for bomb in (GREY_8192.read_bytes(), APP5_4000.read_bytes(), INTER_3200.read_bytes()):
        victims[next(rel for rel in sorted(files) if codecs[rel] == "jpegxl"
                     and rel not in victims
                     and stored_extent(store, rel)[2] >= len(bomb) + 8
                     and 512 * len(files[rel]) < 8192 * 8192 // 2)] = bomb
    for rel, bomb in victims.items():
        part, offset, length = stored_extent(store, rel)
        with open(part, "r+b") as f:
            f.seek(offset)
            f.write(padded(bomb, length))
    mnt = mounted(store)
    pids = process_tree(daemon_pid(mnt))
    for rel, data in files.items():
        if rel not in victims:
            assert _read(mnt / rel) == data, rel
    before = {p: vm_rss_kb(p, "VmHWM") for p in pids}
    for _ in range(3):
        for rel in victims:
            assert os_error(_read, mnt / rel) == errno.EIO, rel
    grew = {p: vm_rss_kb(p, "VmHWM") - before[p] for p in pids}
    assert max(grew.values()) < 48 * 1024, f"peak RSS grew (KiB): {grew}"
    for rel, data in files.items():
        if rel not in victims:
            assert _read(mnt / rel) == data, rel


def test_a_streamed_source_counts_the_same(jpeg_tree, jpeg_store, tmp_path) -> None:
    root, files, declined = jpeg_tree
    tar = tmp_path / "ds.tar"
    with tarfile.open(tar, "w") as t:
        t.add(root, arcname=".")
    proc = _pack(tar, tmp_path / "tar.fs")
    assert _summary(proc) == _summary(jpeg_store[1])
    with fanstore.open_store(str(tmp_path / "tar.fs")) as store:
        for rel, data in files.items():
            assert store.read(rel) == data, rel


def test_solid_blocks_are_refused(jpeg_tree, tmp_path) -> None:
    for extra in (("--solid-kb", "64"),):
        proc = run_main("pack", jpeg_tree[0], tmp_path / "x.fs", "--codec", "jpegxl", *extra)
        assert_cli_error(proc, 2, "jpegxl takes whole files, not solid blocks")
    proc = run_main("pack", jpeg_tree[0], tmp_path / "y.fs", "--codec", "jpegxl+solid64k")
    assert_cli_error(proc, 2, "jpegxl takes whole files, not solid blocks")


# --------------------------------------------------------------------------- no imagecodecs


@pytest.fixture
def without_imagecodecs(tmp_path) -> dict[str, str]:
    """An environment whose ``import imagecodecs`` fails, in every process it starts (the
    mount's daemon and frontend too): a package of that name that raises ImportError,
    first on the path."""
    fake = tmp_path / "hide" / "imagecodecs"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('imagecodecs hidden by the test')\n")
    path = [str(fake.parent)] + [p for p in os.environ.get("PYTHONPATH", "").split(
        os.pathsep) if p]
    return {"PYTHONPATH": os.pathsep.join(path)}


def test_a_missing_library_is_one_line(jpeg_tree, jpeg_store, without_imagecodecs,
                                       tmp_path) -> None:
    store = jpeg_store[0]
    env = without_imagecodecs
    for args in (("cat", store, "train/c000/img_000000.jpg"), ("verify", store)):
        assert_cli_error(run_cli(*args, env=env), 1, MISSING_LINE)
    assert run_cli("ls", store, env=env).returncode == 0  # the names need no codec
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    proc = run_cli("mount", store, mnt, env=env, timeout=60)
    assert_cli_error(proc, 1, MISSING_LINE)
    assert not is_mounted(mnt)
    proc = run_cli("pack", jpeg_tree[0], tmp_path / "z.fs", "--codec", "jpegxl", env=env)
    assert_cli_error(proc, 2, "imagecodecs is not installed")
    code = ("import fanstore\n"
            "from fanstore.errors import FanStoreError\n"
            "try:\n"
            f"    fanstore.open_store({str(store)!r})\n"
            "except FanStoreError as exc:\n"
            "    print(type(exc).__name__, exc)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=dict(os.environ, **env), timeout=60)
    assert out.stdout.strip() == f"FormatError {MISSING_LINE}", out.stderr


# --------------------------------------------------------------------------- the selector

_FIXED_STORAGE = ("--storage-mb-per-sec", "1000", "--storage-latency-us", "100")


def _select(src, *args) -> dict:
    import json

    proc = run_main("select", src, "--json", "--cores", "2", *_FIXED_STORAGE, *args,
                   timeout=600)
    assert proc.returncode in (0, 3), proc.stderr
    return json.loads(proc.stdout)


def test_the_selector_offers_jpegxl_for_jpegs_only(jpeg_tree, tmp_path) -> None:
    root, files, declined = jpeg_tree
    report = _select(root, "--trials", "0", "--per-kind", "--files-per-sec", "100")
    cand = {c["codec"]: c for c in report["candidates"]}["jpegxl"]
    assert cand["ratio"] > 1.05
    # cores = decode CPU per file x the budget's files/s
    assert cand["decode_cores_for_budget"] == pytest.approx(
        cand["decode_cpu_us_per_file"] * 1e-6 * report["budget"]["required_files_per_s"],
        rel=0.02)
    assert cand["decode_cpu_us_per_file"] > 0
    assert 0 < cand["declined_units"] <= len(declined - {rel for rel in declined
                                                         if len(files[rel]) > 1 << 20})
    assert {k: v for k, v in report["per_kind"].items() if v == "jpegxl"}, report["per_kind"]
    assert all(k.startswith("jpg/") for k, v in report["per_kind"].items() if v == "jpegxl")
    for k in range(20):
        (tmp_path / f"notes{k}.txt").write_bytes(files["odd/notes.txt"] * (k + 1))
    report = _select(tmp_path, "--trials", "0")
    assert "jpegxl" not in {c["codec"] for c in report["candidates"]}


@pytest.mark.long
@pytest.mark.parametrize("mode", ["sync", "prefetch"])
def test_a_measured_jpegxl_finalist(jpeg_tree, mode) -> None:
    """Under a budget it meets, jpegxl (the best ratio) is measured through a real mount in
    the job's mode and chosen, and the pack command names it."""
    report = _select(jpeg_tree[0] / "train", "--trials", "2", "--rounds", "1", "--mode", mode,
                     "--files-per-sec", "20", "--reader", "mount")
    cand = {c["codec"]: c for c in report["candidates"]}["jpegxl"]
    assert cand["measured"] is not None and cand["rate_from"] == "measured", cand
    assert report["chosen"] == "jpegxl" and "--codec jpegxl" in report["pack_command"]
