"""``fanstore pack``: planning, scanning, problem entries, determinism, atomicity, --force,
the summary, and what the written store contains."""

from __future__ import annotations

import glob
import os
import re
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

from compressors import parse_spec
from fanstore.errors import NotFoundError, PackError
from fanstore.format.index import INDEX_NAME, KIND_DIR, KIND_FILE, KIND_SYMLINK, read_index
from fanstore.namespace import Namespace
from fanstore.pack import CodecPolicy, PackOptions, pack, plan_partitions, scan_tree
from fanstore.pack.dest import OLD_MARK, TMP_MARK
from fanstore.store import LocalStore
from helpers import (
    FANSTORE,
    OUTSIDE_BYTES,
    SPECIAL_PACK_ARGS,
    assert_cli_error,
    assert_no_traceback,
    make_outside_links_tree,
    make_small_tree,
    run_cli,
    run_main,
    wait_until,
)

# --------------------------------------------------------------------------- planning


def test_plan_balances_by_size_largest_first():
    sizes = [100_000, 1_000, 50_000, 50_000, 30_000, 20_000]
    assign = plan_partitions(sizes, 3)
    loads = [sum(s for s, p in zip(sizes, assign) if p == k) for k in range(3)]
    assert loads == [100_000, 80_000, 71_000]
    assert assign == [0, 2, 1, 2, 1, 2]


def test_plan_is_deterministic_and_breaks_ties_by_order():
    sizes = [10] * 7
    assert plan_partitions(sizes, 3) == plan_partitions(list(sizes), 3) == [0, 1, 2, 0, 1, 2, 0]


def test_plan_spreads_empty_files():
    assign = plan_partitions([0] * 1000, 4)
    assert np.bincount(assign, minlength=4).tolist() == [250] * 4


def test_plan_edge_cases():
    assert plan_partitions([], 5) == []
    assert plan_partitions([5, 7], 8) == [1, 0]
    with pytest.raises(ValueError):
        plan_partitions([1], 0)


def test_codec_policy_by_kind():
    default, npy = parse_spec("zstd:3"), parse_spec("lz4")
    policy = CodecPolicy(default, {"npy/medium": npy})
    assert policy.codec_for("a/b.npy", 100 << 10) is npy
    assert policy.codec_for("a/b.NPY", 100 << 10) is npy
    assert policy.codec_for("a/b.npy", 10) is default
    assert policy.codec_for("a/b.jpg", 100 << 10) is default
    assert CodecPolicy(default).codec_for("x.npy", 100 << 10) is default


# --------------------------------------------------------------------------- scanning


def test_scan_is_breadth_first_with_sorted_children(tmp_path):
    src = tmp_path / "src"
    make_small_tree(src)
    scan = scan_tree(str(src))
    assert not scan.problems
    rels = [e.rel for e in scan.entries]
    assert rels == [b"", b"a.txt", b"b.bin", b"empty", b"emptydir", b"link", b"sub",
                    b"sub/c.txt", b"sub/deeper", b"sub/deeper/d.txt", b"sub/deeper/e.bin"]
    kinds = {e.rel: e.kind for e in scan.entries}
    assert kinds[b"sub"] == KIND_DIR and kinds[b"link"] == KIND_SYMLINK
    assert kinds[b"a.txt"] == KIND_FILE
    for i, e in enumerate(scan.entries):
        if e.kind == KIND_DIR:
            first, count = e.children
            assert all(scan.entries[k].parent == i for k in range(first, first + count))
    link = scan.entries[rels.index(b"link")]
    assert link.target == b"sub/c.txt" and link.size == len(b"sub/c.txt")


def test_scan_rewrites_absolute_symlinks_inside_the_source(tmp_path):
    src = tmp_path / "src"
    (src / "d").mkdir(parents=True)
    (src / "f").write_bytes(b"x")
    os.symlink(str(src / "f"), src / "d" / "abs")
    os.symlink(str(src / "d"), src / "absdir")
    scan = scan_tree(str(src))
    assert not scan.problems
    targets = {e.rel: e.target for e in scan.entries if e.kind == KIND_SYMLINK}
    assert targets == {b"d/abs": b"../f", b"absdir": b"d"}


def _make_problem_tree(root: Path) -> list[str]:
    """A good file, symlinks that lead out (kept: issue 35) plus entries pack must refuse;
    returns the refused paths."""
    (root / "sub").mkdir(parents=True)
    (root / "good.txt").write_bytes(b"good\n")
    (root / "sub" / "fine.txt").write_bytes(b"fine\n")
    (root.parent / "outside.txt").write_bytes(b"outside\n")
    os.mkfifo(root / "fifo")
    os.symlink("../outside.txt", root / "escape_rel")
    os.symlink(str(root.parent / "outside.txt"), root / "sub" / "escape_abs")
    os.symlink("loop_b", root / "loop_a")
    os.symlink("loop_a", root / "loop_b")
    os.symlink("../escape_rel", root / "sub" / "chain")  # lexically inside, resolves outside
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(root / "sock"))
    sock.close()
    return [str(root / n) for n in ("fifo", "loop_a", "loop_b", "sock")]


#: The symlinks of _make_problem_tree that lead outside, as the store keeps them.
_LEAVING = {b"escape_rel": b"../outside.txt", b"sub/chain": b"../escape_rel"}


def test_scan_reports_problem_entries_by_path(tmp_path):
    src = tmp_path / "src"
    bad = _make_problem_tree(src)
    scan = scan_tree(str(src))
    reported = sorted(p.split(": ", 1)[0] for p in scan.problems)
    assert reported == sorted(bad)
    text = "\n".join(scan.problems)
    assert "FIFO cannot be packed" in text and "socket cannot be packed" in text
    assert "symlink loop" in text and "outside" not in text
    links = {e.rel: e.target for e in scan.entries if e.kind == KIND_SYMLINK}
    assert links == {**_LEAVING, b"sub/escape_abs": os.fsencode(src.parent / "outside.txt")}
    assert {e.rel for e in scan.entries} == {b"", b"good.txt", b"sub", b"sub/fine.txt",
                                             *links}


def test_pack_refuses_problem_entries_unless_skipped(tmp_path):
    src, dest = tmp_path / "src", tmp_path / "store"
    bad = _make_problem_tree(src)
    proc = run_main("pack", src, dest, "--no-progress", timeout=60)
    assert_cli_error(proc, code=1, contains=f"{len(bad)} entries cannot be packed")
    assert "--skip-unreadable" in proc.stderr
    for path in bad:
        assert proc.stderr.count(f"fanstore: cannot pack {path}: ") == 1, path
    assert not dest.exists()
    assert not glob.glob(f"{dest}{TMP_MARK}*")

    proc = run_main("pack", src, dest, "--no-progress", "--skip-unreadable", timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert_no_traceback(proc)
    for path in bad:
        assert proc.stderr.count(f"fanstore: skipping {path}: ") == 1, path
    assert f"skipped {len(bad)} entries (--skip-unreadable)" in proc.stdout
    with LocalStore(str(dest)) as s:
        assert s.ns.n_entries == 7  # the root, 2 files, sub, 3 symlinks that lead out
        assert s.read_file("good.txt") == b"good\n"
        assert s.read_file("sub/fine.txt") == b"fine\n"


# --------------------------------------------------------------------------- --symlinks

SYMLINK_PACK_ARGS = ("--partitions", "1", "--jobs", "1", "--codec", "zstd:3", "--no-progress")


def _links_and_files(store) -> tuple[dict[str, str], dict[str, bytes]]:
    """({symlink: target}, {file: bytes}) of a store."""
    index = read_index(str(store))
    kind = index.entries["kind"]
    links = {index.path(i).decode(): index.target(i).decode()
             for i in range(index.n_entries) if int(kind[i]) == KIND_SYMLINK}
    with LocalStore(str(store)) as s:
        files = {index.path(i).decode(): s.read_file(index.path(i))
                 for i in range(index.n_entries) if int(kind[i]) == KIND_FILE}
    return links, files


def test_symlinks_that_leave_the_source_are_stored_as_they_are(tmp_path):
    """The default (--symlinks store), as mksquashfs and tar: each target byte for byte
    (absolute, '../', dangling, looping outside); the pack stopped at the first."""
    tree = make_outside_links_tree(tmp_path)
    proc = run_main("pack", tree["root"], tmp_path / "store", *SYMLINK_PACK_ARGS)
    assert proc.returncode == 0, proc.stderr
    assert_no_traceback(proc)
    assert "packed 2 files, 1 directories, 7 symlinks into 1 partitions" in proc.stdout
    links, files = _links_and_files(tmp_path / "store")
    assert links == tree["links"]
    assert files == tree["files"]
    # The same as asking for it
    proc = run_main("pack", tree["root"], tmp_path / "store2", *SYMLINK_PACK_ARGS,
                   "--symlinks", "store")
    assert proc.returncode == 0, proc.stderr
    assert _links_and_files(tmp_path / "store2")[0] == tree["links"]


def test_symlinks_skip_leaves_out_those_that_leave_and_counts_them(tmp_path):
    tree = make_outside_links_tree(tmp_path)
    os.symlink("abs", tree["root"] / "via_abs")  # inside, but leads out through abs
    proc = run_main("pack", tree["root"], tmp_path / "store", *SYMLINK_PACK_ARGS,
                   "--symlinks", "skip")
    assert proc.returncode == 0, proc.stderr
    assert_no_traceback(proc)
    assert ("packed 2 files, 1 directories, 3 symlinks (5 leading outside the source "
            "left out) into 1 partitions") in proc.stdout, proc.stdout
    links, files = _links_and_files(tmp_path / "store")
    assert links == {rel: t for rel, t in tree["links"].items() if rel not in tree["leaving"]}
    assert files == tree["files"]


def test_symlinks_follow_stores_the_files_they_lead_to(tmp_path):
    """A dangling or looping symlink that leads out is one line each and fails the pack
    (no traceback, nothing written); --skip-unreadable leaves them out; the others become
    the files they lead to (bytes and mode of the target); links inside stay links."""
    tree = make_outside_links_tree(tmp_path)
    root, dest = tree["root"], tmp_path / "store"
    proc = run_main("pack", root, dest, *SYMLINK_PACK_ARGS, "--symlinks", "follow")
    assert_cli_error(proc, code=1, contains="2 entries cannot be packed")
    assert (f"fanstore: cannot pack {root}/dangling: dangling symlink: its target "
            "../no-such-file does not exist\n") in proc.stderr
    assert (f"fanstore: cannot pack {root}/outloop: symlink loop (following ../loop_a)\n"
            in proc.stderr)
    assert not dest.exists()
    proc = run_main("pack", root, dest, *SYMLINK_PACK_ARGS, "--symlinks", "follow",
                   "--skip-unreadable")
    assert proc.returncode == 0, proc.stderr
    assert "packed 4 files, 1 directories, 3 symlinks into 1 partitions" in proc.stdout
    assert "skipped 2 entries (--skip-unreadable)" in proc.stdout
    links, files = _links_and_files(dest)
    assert files == {**tree["files"], "abs": OUTSIDE_BYTES, "sub/rel": OUTSIDE_BYTES}
    assert links == {rel: t for rel, t in tree["links"].items() if rel not in tree["leaving"]}
    with LocalStore(str(dest)) as s:
        assert s.ns.mode(s.ns.resolve("abs")) == 0o640


def test_symlinks_follow_refuses_a_directory_and_a_bad_mode(tmp_path):
    tree = make_outside_links_tree(tmp_path)
    (tmp_path / "outdir").mkdir()
    os.symlink(str(tmp_path / "outdir"), tree["root"] / "todir")
    proc = run_main("pack", tree["root"], tmp_path / "store", *SYMLINK_PACK_ARGS,
                   "--symlinks", "follow", "--skip-unreadable")
    assert proc.returncode == 0, proc.stderr
    assert (f"skipping {tree['root']}/todir: symlink to a directory outside the source "
            f"({tmp_path}/outdir); --symlinks follow stores files only") in proc.stderr
    proc = run_main("pack", tree["root"], tmp_path / "other", *SYMLINK_PACK_ARGS,
                   "--symlinks", "copy")
    assert_cli_error(proc, code=2, contains="--symlinks: invalid choice: 'copy'")


def _drop_dac_caps() -> list[str] | None:
    """A command prefix that runs as root without the capabilities that bypass file
    permissions (so mode 000 really is unreadable), or [] when not root, or None."""
    if os.geteuid() != 0:
        return []
    setpriv = shutil.which("setpriv")
    if not setpriv:
        return None
    return [setpriv, "--bounding-set", "-dac_override,-dac_read_search"]


def test_pack_refuses_unreadable_files_and_directories(tmp_path):
    prefix = _drop_dac_caps()
    if prefix is None:
        pytest.skip("running as root without setpriv: cannot make a file unreadable")
    src, dest = tmp_path / "src", tmp_path / "store"
    (src / "locked").mkdir(parents=True)
    (src / "locked" / "hidden.txt").write_bytes(b"hidden\n")
    (src / "ok.txt").write_bytes(b"ok\n")
    (src / "secret.txt").write_bytes(b"secret\n")
    os.chmod(src / "secret.txt", 0)
    os.chmod(src / "locked", 0)
    try:
        cmd = prefix + [FANSTORE, "pack", str(src), str(dest), "--no-progress"]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        assert_cli_error(proc, code=1, contains="2 entries cannot be packed")
        assert f"cannot pack {src}/secret.txt: unreadable file (permission denied)" in proc.stderr
        assert f"cannot pack {src}/locked: cannot list directory: Permission denied" \
            in proc.stderr
        assert not dest.exists()
        proc = subprocess.run(cmd + ["--skip-unreadable"], capture_output=True, text=True,
                              timeout=60)
        assert proc.returncode == 0, proc.stderr
        assert "skipped 2 entries" in proc.stdout
        with LocalStore(str(dest)) as s:
            assert s.read_file("ok.txt") == b"ok\n"
            for rel in ("secret.txt", "locked/hidden.txt"):
                with pytest.raises(NotFoundError):
                    s.ns.resolve(rel)
    finally:
        os.chmod(src / "locked", 0o755)
        os.chmod(src / "secret.txt", 0o644)


def test_pack_fails_cleanly_when_a_file_changes_under_it(tmp_path):
    src, dest = tmp_path / "src", tmp_path / "store"
    make_small_tree(src)
    policy = CodecPolicy(parse_spec("zstd:1"))
    opts = PackOptions(partitions=2, jobs=1, chunk_size=4096, progress=False)
    scan = scan_tree(str(src))
    os.truncate(src / "b.bin", 100)
    with pytest.raises(PackError, match=r"b.bin: file changed size while being packed "
                                        r"\(10240 -> 100 bytes\)"):
        pack(str(src), str(dest), policy, opts, scan=scan)
    assert not dest.exists() and not glob.glob(f"{dest}{TMP_MARK}*")
    scan = scan_tree(str(src))
    with open(src / "a.txt", "ab") as f:
        f.write(b"x" * 10000)
    with pytest.raises(PackError, match="a.txt: file grew while being packed"):
        pack(str(src), str(dest), policy, opts, scan=scan)
    assert not dest.exists() and not glob.glob(f"{dest}{TMP_MARK}*")


# --------------------------------------------------------------------------- the CLI


def test_pack_summary_lines(small_tree, tmp_path):
    src, files = small_tree
    dest = tmp_path / "store"
    proc = run_main("pack", src, dest, "--partitions", "3", "--codec", "zstd:3",
                   "--no-progress", check=True)
    assert_no_traceback(proc)
    lines = proc.stdout.splitlines()
    assert len(lines) == 3, proc.stdout
    assert lines[0] == (f"packed {len(files)} files, 3 directories, 1 symlinks "
                        f"into 3 partitions at {dest}")
    raw = sum(len(v) for v in files.values())
    m = re.fullmatch(r"raw ([\d,]+\.\d) MB, stored ([\d,]+\.\d) MB \(\+ index ([\d,]+\.\d) MB\), "
                     r"ratio (\d+\.\d\d)x \((\d+\.\d\d)x with the index\)", lines[1])
    assert m, lines[1]
    assert m.group(1) == f"{raw / 1e6:,.1f}"
    index = read_index(str(dest))
    stored = sum(p.size for p in index.partitions)
    assert m.group(2) == f"{stored / 1e6:,.1f}"
    assert m.group(4) == f"{raw / stored:.2f}"
    index_size = os.path.getsize(dest / "fanstore.idx")
    assert m.group(5) == f"{raw / (stored + index_size):.2f}"
    assert re.fullmatch(r"time \d+\.\d s, \d+ MB/s \(scan \d+\.\d s, "
                        r"(selection and )?duplicates \d+\.\d s, compression \d+\.\d s, "
                        r"index and install \d+\.\d s\)", lines[2]), lines[2]
    assert proc.stderr == ""  # no progress bar, no warnings


def test_special_tree_summary(special_tree, special_pack):
    _, proc = special_pack
    first = proc.stdout.splitlines()[0]
    assert first.startswith(
        f"packed {special_tree['files']:,} files, {special_tree['dirs']:,} directories, "
        f"{special_tree['symlinks_count']} symlinks into 4 partitions at ")


def test_pack_is_deterministic(special_tree, special_store, tmp_path):
    """Packing the same tree again, with another number of workers, gives byte-identical
    partitions and index."""
    args = list(SPECIAL_PACK_ARGS)
    args[args.index("--jobs") + 1] = "1"
    assert args != list(SPECIAL_PACK_ARGS)
    dest = tmp_path / "again"
    run_main("pack", special_tree["root"], dest, *args, check=True, timeout=300)
    names = sorted(os.listdir(special_store))
    assert sorted(os.listdir(dest)) == names
    assert INDEX_NAME in names and len(names) == 5
    for name in names:
        assert (dest / name).read_bytes() == (special_store / name).read_bytes(), name


def test_a_small_source_is_compressed_without_workers(small_tree, tmp_path, monkeypatch):
    """Under ``INLINE_BYTES`` with ``jobs`` at its default, no worker process starts (a
    worker's start costs more than the compression); an explicit ``jobs``, or a source over
    the threshold, gets the pool. The three stores are byte-identical."""
    from fanstore.pack import pool as pool_module
    from fanstore.pack import worker

    spawned = []
    real = pool_module.spawn_piped
    monkeypatch.setattr(pool_module, "spawn_piped",
                        lambda *a, **k: spawned.append(a) or real(*a, **k))
    src, files = small_tree
    total = sum(len(d) for d in files.values())
    assert 0 < total < worker.INLINE_BYTES
    stores = {}
    for how, options in (("inline", PackOptions(partitions=3)),
                         ("jobs", PackOptions(partitions=3, jobs=2)),
                         ("big", PackOptions(partitions=3))):
        if how == "big":
            monkeypatch.setattr(worker, "INLINE_BYTES", total)  # the source is not under it
        spawned.clear()
        dest = tmp_path / how
        summary = pack(src, str(dest), CodecPolicy(parse_spec("zstd:3")), options)
        assert summary.files == len(files)
        assert len(spawned) == (0 if how == "inline" else 2), how
        stores[how] = {name: (dest / name).read_bytes() for name in os.listdir(dest)}
    assert stores["inline"] == stores["jobs"] == stores["big"]
    with LocalStore(str(tmp_path / "inline")) as s:
        for rel, data in files.items():
            assert s.read_file(rel) == data


def test_store_holds_raw_chunks_where_compression_does_not_help(special_store):
    index = read_index(str(special_store))
    codec = index.chunks["codec"]
    assert index.codecs[0] == {"id": "none"}
    assert index.codecs[1]["id"] == "zstd"
    # The big file's random stripes are stored raw, its text stripes compressed.
    assert (codec == 0).any() and (codec == 1).any()
    assert np.all(index.chunks["stored"][codec == 0] == index.chunks["raw"][codec == 0])
    assert np.all(index.chunks["stored"][codec == 1] < index.chunks["raw"][codec == 1])


def test_chunk_size_and_codec_options(small_tree, tmp_path):
    src, files = small_tree
    dest = tmp_path / "store"
    run_main("pack", src, dest, "--chunk-kb", "8", "--codec", "none", "--partitions", "1",
            "--no-progress", check=True)
    index = read_index(str(dest))
    assert index.chunk_size == 8192
    assert index.codecs == [{"id": "none"}]
    assert np.all(index.chunks["codec"] == 0)
    with LocalStore(str(dest)) as s:
        for rel, data in files.items():
            assert s.read_file(rel) == data
            assert s.ns.chunks(s.ns.resolve(rel))[1] == -(-len(data) // 8192)


def test_more_partitions_than_files(tmp_path):
    src, dest = tmp_path / "src", tmp_path / "store"
    src.mkdir()
    (src / "one").write_bytes(b"1")
    (src / "two").write_bytes(b"22")
    run_main("pack", src, dest, "--partitions", "5", "--no-progress", check=True)
    index = read_index(str(dest))
    assert len(index.partitions) == 5
    assert sorted(p.files for p in index.partitions) == [0, 0, 0, 1, 1]
    assert sum(p.size == 64 for p in index.partitions) == 3  # header only
    with LocalStore(str(dest)) as s:
        assert s.read_file("two") == b"22"


def test_empty_source(tmp_path):
    src, dest = tmp_path / "src", tmp_path / "store"
    src.mkdir()
    proc = run_main("pack", src, dest, "--partitions", "2", "--no-progress", check=True)
    assert proc.stdout.startswith("packed 0 files, 0 directories, 0 symlinks into 2 partitions")
    index = read_index(str(dest))
    assert index.n_entries == 1 and index.n_chunks == 0


def test_broadcast_directories_get_their_own_partitions(small_tree, tmp_path):
    src, files = small_tree
    dest = tmp_path / "store"
    run_main("pack", src, dest, "--partitions", "2", "--broadcast", "sub", "--chunk-kb", "4",
            "--no-progress", check=True)
    index = read_index(str(dest))
    bc = [p.number for p in index.partitions if p.broadcast]
    assert bc and min(bc) == 2 and len(index.partitions) == 2 + len(bc)
    ns = Namespace(index)
    for rel in files:
        entry = ns.resolve(rel)
        first, count = index.chunk_run(entry)
        if count:
            part = int(index.chunks["part"][first])
            assert (part in bc) == rel.startswith("sub/"), rel
    proc = run_main("pack", src, tmp_path / "other", "--broadcast", "nope", "--no-progress")
    assert_cli_error(proc, code=2, contains="--broadcast nope: no such directory")


# --------------------------------------------------------------------------- destination


def _snapshot(store: Path) -> dict[str, bytes]:
    return {name: (store / name).read_bytes() for name in sorted(os.listdir(store))}


def test_refuses_to_overwrite_a_store_without_force(small_tree, tmp_path):
    src, _ = small_tree
    dest = tmp_path / "store"
    run_main("pack", src, dest, "--no-progress", check=True)
    before = _snapshot(dest)
    other = tmp_path / "other-src"
    other.mkdir()
    (other / "new.txt").write_bytes(b"new content\n")
    proc = run_main("pack", other, dest, "--no-progress")
    assert_cli_error(proc, code=1, contains="already holds a store (use --force to replace it)")
    assert _snapshot(dest) == before

    proc = run_main("pack", other, dest, "--no-progress", "--force")
    assert proc.returncode == 0, proc.stderr
    with LocalStore(str(dest)) as s:
        assert s.read_file("new.txt") == b"new content\n"
        with pytest.raises(NotFoundError):
            s.ns.resolve("a.txt")
    leftovers = [n for n in os.listdir(tmp_path) if TMP_MARK in n or OLD_MARK in n]
    assert leftovers == []


def test_refuses_a_destination_that_is_not_a_store(small_tree, tmp_path):
    src, _ = small_tree
    dest = tmp_path / "data"
    dest.mkdir()
    (dest / "precious.txt").write_bytes(b"keep me")
    for extra in ((), ("--force",)):
        proc = run_main("pack", src, dest, "--no-progress", *extra)
        assert_cli_error(proc, code=1, contains="is not empty and is not a store")
        assert os.listdir(dest) == ["precious.txt"]
    afile = tmp_path / "afile"
    afile.write_bytes(b"x")
    proc = run_main("pack", src, afile, "--no-progress", "--force")
    assert_cli_error(proc, code=1, contains="exists and is not a directory")
    assert afile.read_bytes() == b"x"
    # An existing empty directory is fine.
    empty = tmp_path / "empty"
    empty.mkdir()
    run_main("pack", src, empty, "--no-progress", check=True)
    assert (empty / INDEX_NAME).exists()


def test_force_through_a_symlinked_destination(small_tree, tmp_path):
    """DEST may be a symlink to a store (e.g. into a scratch file system): --force replaces
    the store it points to and leaves the link and no leftovers."""
    src, files = small_tree
    real = tmp_path / "scratch" / "store"
    run_main("pack", src, real, "--no-progress", check=True)
    link = tmp_path / "link"
    os.symlink("scratch/store", link)
    other = tmp_path / "other-src"
    other.mkdir()
    (other / "new.txt").write_bytes(b"new\n")
    proc = run_main("pack", other, link, "--no-progress", "--force")
    assert proc.returncode == 0, proc.stderr
    assert os.readlink(link) == "scratch/store"
    with LocalStore(str(link)) as s:
        assert s.read_file("new.txt") == b"new\n"
        with pytest.raises(NotFoundError):
            s.ns.resolve("a.txt")
    assert sorted(os.listdir(tmp_path)) == ["link", "other-src", "scratch"]
    assert os.listdir(tmp_path / "scratch") == ["store"]


def test_disk_full_is_reported_with_the_partition_path(small_tree, tmp_path):
    """ENOSPC while writing a partition: one line naming the partition (not a source read
    error, not a bare errno), exit 1, nothing left behind."""
    if os.geteuid() != 0:
        pytest.skip("needs root to mount a small tmpfs")
    full = tmp_path / "full"
    full.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(full)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here")
    try:
        src = tmp_path / "src"
        src.mkdir()
        (src / "big.bin").write_bytes(os.urandom(1 << 20))
        proc = run_main("pack", src, full / "store", "--codec", "none", "--jobs", "1",
                       "--partitions", "1", "--no-progress")
        line = assert_cli_error(proc, code=1, contains="no space left on device while writing ")
        assert f"{full}/store{TMP_MARK}" in line and line.endswith("/part-00000.fsp")
        assert os.listdir(full) == []
    finally:
        subprocess.run(["umount", "-l", str(full)], capture_output=True)


@pytest.mark.parametrize("where", ["inside", "same", "parent"])
def test_refuses_overlapping_source_and_destination(small_tree, tmp_path, where):
    src, _ = small_tree
    dest = {"inside": src / "store", "same": src, "parent": src.parent}[where]
    proc = run_main("pack", src, dest, "--no-progress", "--force")
    assert_cli_error(proc, code=2, contains="inside")
    assert not (src / "store").exists()


def test_bad_sources(tmp_path):
    proc = run_main("pack", tmp_path / "nope", tmp_path / "store")
    assert_cli_error(proc, code=2, contains="does not exist")
    (tmp_path / "file").write_bytes(b"x")
    proc = run_main("pack", tmp_path / "file", tmp_path / "store")
    assert_cli_error(proc, code=2, contains="is not a directory")
    assert not (tmp_path / "store").exists()


# --------------------------------------------------------------------------- atomicity


def _slow_tree(root: Path) -> None:
    """Compressible files that take zstd:19 a few seconds with one job."""
    root.mkdir()
    for i in range(6):
        lines = b"".join(b"record %d of file %d: value %d\n" % (j, i, (j * 7919) % 100003)
                         for j in range(90_000))
        (root / f"f{i}.txt").write_bytes(lines)


def test_killed_pack_leaves_no_store_and_the_next_pack_cleans_up(tmp_path):
    src, dest = tmp_path / "src", tmp_path / "store"
    _slow_tree(src)
    cmd = [FANSTORE, "pack", str(src), str(dest), "--jobs", "1", "--partitions", "3",
           "--codec", "zstd:19", "--no-progress"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)
    try:
        started = wait_until(lambda: glob.glob(f"{dest}{TMP_MARK}*/part-*.fsp"), timeout=30,
                             interval=0.01)
        assert started, "the pack never started writing a partition"
        time.sleep(0.3)
        assert proc.poll() is None, "the pack finished before it could be killed; enlarge " \
                                    "_slow_tree"
        os.killpg(proc.pid, signal.SIGKILL)  # the whole job, workers included
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    assert not os.path.exists(dest / INDEX_NAME)
    assert not dest.exists()
    leftovers = glob.glob(f"{dest}{TMP_MARK}*")
    assert len(leftovers) == 1
    proc = run_main("info", dest)
    assert_cli_error(proc, code=1, contains="no such directory")

    proc = run_main("pack", src, dest, "--codec", "zstd:1", "--no-progress")
    assert proc.returncode == 0, proc.stderr
    assert f"removing leftover of an interrupted pack: {leftovers[0]}" in proc.stderr
    assert not glob.glob(f"{dest}{TMP_MARK}*") and not glob.glob(f"{dest}{OLD_MARK}*")
    proc = run_main("verify", dest, "--no-progress")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    with LocalStore(str(dest)) as s:
        assert s.read_file("f5.txt") == (src / "f5.txt").read_bytes()


def test_leftover_of_a_live_pack_is_not_removed(small_tree, tmp_path):
    """A temp dir whose pid is alive belongs to a pack still running: keep it."""
    src, _ = small_tree
    dest = tmp_path / "store"
    live = Path(f"{dest}{TMP_MARK}{os.getpid()}")
    dead = Path(f"{dest}{TMP_MARK}999999999")
    live.mkdir()
    dead.mkdir()
    proc = run_cli("pack", src, dest, "--no-progress", check=True)
    assert live.exists() and not dead.exists()
    assert f"removing leftover of an interrupted pack: {dead}" in proc.stderr


def test_progress_bar_only_when_asked(small_tree, tmp_path):
    src, _ = small_tree
    proc = run_main("pack", src, tmp_path / "s1", check=True)  # stderr is not a terminal
    assert "packing" not in proc.stderr
