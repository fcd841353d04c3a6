"""``fanstore pack`` from archives and object storage, stores in object storage.

Real parts only: archives made by the ``tar``, ``zip``, ``gzip``... commands, a real S3
endpoint (moto's server mode, ``s3_server``) on 127.0.0.1 reached through the standard AWS
environment of the CLI processes, real FUSE mounts of stores staged from it.
"""

from __future__ import annotations

import glob
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fanstore.format.index import INDEX_NAME, KIND_DIR, KIND_FILE, KIND_SYMLINK, read_index
from fanstore.pack.sources import expand_braces
from fanstore.pack.dest import TMP_MARK
from fanstore.store import LocalStore
from helpers import (
    FANSTORE,
    SPECIAL_PACK_ARGS,
    assert_cli_error,
    assert_no_traceback,
    assert_same_tree,
    environment,
    make_small_tree,
    run_cli,
    run_main,
    wait_until,
)

# A pinned codec: tests compare stores byte for byte, and the default (a quick selection that
# measures read speed) may choose differently on a busier machine.
SMALL_ARGS = ("--partitions", "2", "--chunk-kb", "4", "--jobs", "1", "--codec", "zstd:3",
              "--no-progress")


def need(*tools: str) -> None:
    for t in tools:
        if not shutil.which(t):
            pytest.skip(f"{t} is not installed (tools/setup-system.sh installs it)")


def sh(*cmd, cwd=None) -> None:
    proc = subprocess.run([os.fspath(c) for c in cmd], cwd=cwd, capture_output=True)
    assert proc.returncode == 0, f"{cmd}: {proc.stderr.decode(errors='replace')}"


def table(store) -> dict[bytes, tuple]:
    """path -> (kind, mode, size, checksum, symlink target) of every entry of a store."""
    index = read_index(os.fspath(store))
    out = {}
    for i in range(index.n_entries):
        kind = int(index.entries["kind"][i])
        out[index.path(i)] = (kind, int(index.entries["mode"][i]), int(index.entries["size"][i]),
                              int(index.entries["checksum"][i]),
                              index.target(i) if kind == KIND_SYMLINK else b"")
    return out


def assert_same_index(a, b) -> None:
    ta, tb = table(a), table(b)
    diff = sorted(k for k in set(ta) | set(tb) if ta.get(k) != tb.get(k))
    assert not diff, [(k, ta.get(k), tb.get(k)) for k in diff[:10]]


def no_leftovers(dest: Path) -> None:
    assert not dest.exists(), f"{dest} exists after a failed pack"
    assert not glob.glob(f"{dest}{TMP_MARK}*"), "temporary directory left behind"


# --------------------------------------------------------------------------- tar and zip


def test_tar_of_the_special_tree_equals_the_tree(special_tree, special_store, tmp_path):
    """A tar made by `tar` of the hard-case tree packs into a store whose index lists the
    same paths, kinds, modes, sizes, checksums and symlink targets as packing the tree."""
    need("tar")
    archive = tmp_path / "special.tar"
    sh("tar", "-C", special_tree["root"], "-cf", archive, ".")
    dest = tmp_path / "store"
    proc = run_main("pack", archive, dest, *SPECIAL_PACK_ARGS, check=True, timeout=300)
    assert_no_traceback(proc)
    assert proc.stdout.splitlines()[0].startswith(
        f"packed {special_tree['files']:,} files, {special_tree['dirs']:,} directories, "
        f"{special_tree['symlinks_count']} symlinks into 4 partitions at {dest}")
    assert_same_index(dest, special_store)
    assert run_main("verify", dest, "--no-progress").returncode == 0
    with LocalStore(str(dest)) as s:
        assert s.read_file(os.path.relpath(special_tree["big"], special_tree["root"])) == \
            Path(special_tree["big"]).read_bytes()
        # tar keeps whole seconds (GNU format): the mtime is the tree's, truncated.
        e = s.ns.resolve(os.path.relpath(special_tree["exec"], special_tree["root"]))
        want = os.lstat(special_tree["exec"]).st_mtime_ns // 10**9 * 10**9
        assert s.ns.stat(e).mtime_ns == want


@pytest.mark.parametrize("flag,tool", [("-z", "gzip"), ("-j", "bzip2"), ("-J", "xz"),
                                       ("--zstd", "zstd")])
def test_compressed_tars(small_tree, small_store, tmp_path, flag, tool):
    need("tar", tool)
    src, files = small_tree
    archive = tmp_path / f"small.tar.{tool}"
    sh("tar", flag, "-C", src, "-cf", archive, ".")
    dest = tmp_path / "store"
    run_main("pack", archive, dest, *SMALL_ARGS, check=True)
    assert_same_index(dest, small_store)
    with LocalStore(str(dest)) as s:
        for rel, data in files.items():
            assert s.read_file(rel) == data


def test_zip_of_the_special_tree_equals_the_tree(special_tree, special_store, tmp_path):
    need("zip")
    archive = tmp_path / "special.zip"
    sh("zip", "-qry", archive, ".", cwd=special_tree["root"])  # -y: symlinks as links
    dest = tmp_path / "store"
    run_main("pack", archive, dest, *SPECIAL_PACK_ARGS, check=True, timeout=300)
    assert_same_index(dest, special_store)
    with LocalStore(str(dest)) as s:
        rel = os.path.relpath(special_tree["non_utf8"], os.fsencode(special_tree["root"]))
        assert s.read_file(rel) == b"latin-1 name\n"


def test_webdataset_shards_by_pattern_and_by_list(tmp_path):
    """Shards made by `tar`: `shards-{000..002}.tar` and a list file give the same store,
    holding every sample of every shard."""
    need("tar")
    rng = random.Random(3)
    samples = {}
    for shard in range(3):
        d = tmp_path / f"s{shard}"
        d.mkdir()
        names = []
        for i in range(5):
            key = f"{shard * 5 + i:06d}"
            for ext, data in ((".jpg", rng.randbytes(rng.randint(100, 20000))),
                              (".cls", b"%d\n" % rng.randint(0, 9))):
                (d / (key + ext)).write_bytes(data)
                samples[key + ext] = data
                names.append(key + ext)
        sh("tar", "-C", d, "-cf", tmp_path / f"shards-{shard:03d}.tar", *sorted(names))
    (tmp_path / "shards.txt").write_text("# webdataset shards\n" + "".join(
        f"shards-{k:03d}.tar\n" for k in range(3)))
    a, b = tmp_path / "by-pattern", tmp_path / "by-list"
    run_main("pack", tmp_path / "shards-{000..002}.tar", a, *SMALL_ARGS, check=True)
    run_main("pack", tmp_path / "shards.txt", b, *SMALL_ARGS, check=True)
    assert_same_index(a, b)
    with LocalStore(str(a)) as s:
        assert sorted(os.fsdecode(s.ns.name(e)) for e in s.ns.children(0)) == sorted(samples)
        for name, data in samples.items():
            assert s.read_file(name) == data
    proc = run_main("pack", tmp_path / "shards-{000..003}.tar", tmp_path / "c", *SMALL_ARGS)
    assert_cli_error(proc, code=2, contains="1 of 4 shards do not exist")


def test_expand_braces():
    assert expand_braces("s-{000..002}.tar") == ["s-000.tar", "s-001.tar", "s-002.tar"]
    assert expand_braces("s-{8..10}.tar") == ["s-8.tar", "s-9.tar", "s-10.tar"]
    assert expand_braces("{a,b}-{0..1}") == ["a-0", "a-1", "b-0", "b-1"]
    assert expand_braces("plain.tar") == ["plain.tar"]


def test_directories_missing_from_the_tar_are_implied(tmp_path):
    """Members whose directories the tar never lists: the directories exist with mode
    0755 and the mtime of their newest child; the root too."""
    need("tar")
    src = tmp_path / "src"
    (src / "a" / "b").mkdir(parents=True)
    (src / "a" / "b" / "x.txt").write_bytes(b"x")
    (src / "a" / "y.txt").write_bytes(b"y")
    os.utime(src / "a" / "b" / "x.txt", (0, 1_700_000_000))
    os.utime(src / "a" / "y.txt", (0, 1_600_000_000))
    os.chmod(src / "a", 0o700)
    archive = tmp_path / "files-only.tar"
    sh("tar", "-C", src, "--no-recursion", "-cf", archive, "a/b/x.txt", "a/y.txt")
    dest = tmp_path / "store"
    run_main("pack", archive, dest, *SMALL_ARGS, check=True)
    with LocalStore(str(dest)) as s:
        st = {p: s.ns.stat(s.ns.resolve(p)) for p in ("", "a", "a/b")}
        assert all(x.kind == KIND_DIR and x.mode & 0o7777 == 0o755 for x in st.values())
        assert st["a/b"].mtime_ns == 1_700_000_000 * 10**9
        assert st["a"].mtime_ns == 1_700_000_000 * 10**9  # newest child: a/b
        assert st[""].mtime_ns == 1_700_000_000 * 10**9
        assert s.read_file("a/y.txt") == b"y"


# --------------------------------------------------------------------------- bad archives


def _archives(tmp_path) -> Path:
    src = tmp_path / "src"
    make_small_tree(src)
    (src / "big.bin").write_bytes(random.Random(1).randbytes(300_000))
    return src


@pytest.mark.parametrize("case", ["tar-mid-member", "tar-at-boundary", "gzip-truncated",
                                  "gzip-corrupt", "zip-truncated", "zip-corrupt", "garbage"])
def test_damaged_archives_fail_with_one_line(tmp_path, case):
    need("tar", "gzip", "zip")
    src = _archives(tmp_path)
    tar = tmp_path / "ok.tar"
    sh("tar", "--sort=name", "-C", src, "-cf", tar, ".")
    data = tar.read_bytes()
    bad = tmp_path / "bad"
    if case == "tar-mid-member":
        bad.write_bytes(data[:len(data) // 2 + 100])
        want = "truncated tar archive after"
    elif case == "tar-at-boundary":
        import tarfile

        with tarfile.open(tar) as tf:  # cut right after the data of the first file
            m = next(m for m in tf.getmembers() if m.isreg() and m.size)
            cut = m.offset_data + -(-m.size // 512) * 512
        bad.write_bytes(data[:cut])
        want = f"truncated tar archive: it ends after {cut:,} bytes without its end-of-archive"
    elif case.startswith("gzip"):
        gz = subprocess.run(["gzip", "-c", tar], capture_output=True, check=True).stdout
        if case == "gzip-truncated":
            bad.write_bytes(gz[:len(gz) // 2])
            want = "truncated gzip archive"
        else:
            # Damage the CRC in the trailer: only a reader that checks it notices.
            bad.write_bytes(gz[:-8] + bytes(b ^ 0x55 for b in gz[-8:-4]) + gz[-4:])
            want = "corrupt gzip archive"
    elif case.startswith("zip"):
        z = tmp_path / "ok.zip"
        sh("zip", "-qry", z, ".", cwd=src)
        zdata = z.read_bytes()
        if case == "zip-truncated":
            bad.write_bytes(zdata[:len(zdata) - 200])
            want = "truncated or corrupt zip archive"
        else:
            i = zdata.index(b"big.bin") + 2000  # inside big.bin's (stored random) data
            bad.write_bytes(zdata[:i] + bytes([zdata[i] ^ 0xFF]) + zdata[i + 1:])
            want = "corrupt zip archive (member big.bin)"
    else:
        bad.write_bytes(b"\x1f\x8b" + os.urandom(5000))
        want = "corrupt gzip archive"
    dest = tmp_path / "store"
    proc = run_main("pack", bad, dest, *SMALL_ARGS)
    line = assert_cli_error(proc, code=1, contains=want)
    assert str(bad) in line
    no_leftovers(dest)


def test_names_that_escape_are_refused_and_never_written(tmp_path):
    """`tar -P` keeps '..' and absolute member names: refused by name, nothing written
    outside the store (or anywhere), with --skip-unreadable the rest is packed."""
    need("tar")
    work = tmp_path / "work"
    (work / "in").mkdir(parents=True)
    (work / "in" / "ok.txt").write_bytes(b"fine\n")
    (tmp_path / "victim.txt").write_bytes(b"original\n")
    archive = tmp_path / "evil.tar"
    sh("tar", "-P", "-cf", archive, "in/ok.txt", "../victim.txt", str(tmp_path / "victim.txt"),
       cwd=work)
    names = subprocess.run(["tar", "-P", "-tf", archive], capture_output=True, text=True,
                           check=True).stdout.split()
    assert "../victim.txt" in names and str(tmp_path / "victim.txt") in names
    before = sorted(p for p in tmp_path.rglob("*"))
    dest = tmp_path / "store"
    proc = run_main("pack", archive, dest, *SMALL_ARGS)
    assert_cli_error(proc, code=1, contains="2 entries cannot be packed")
    assert (f"fanstore: cannot pack {archive}: ../victim.txt: member name with '..' refused"
            in proc.stderr)
    assert (f"fanstore: cannot pack {archive}: {tmp_path}/victim.txt: absolute member name "
            "refused" in proc.stderr)
    no_leftovers(dest)
    assert sorted(p for p in tmp_path.rglob("*")) == before
    assert (tmp_path / "victim.txt").read_bytes() == b"original\n"
    proc = run_main("pack", archive, dest, *SMALL_ARGS, "--skip-unreadable", check=True)
    assert "skipped 2 entries (--skip-unreadable)" in proc.stdout
    assert table(dest).keys() == {b"", b"in", b"in/ok.txt"}


def test_duplicate_members_last_one_wins(tmp_path):
    need("tar")
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_bytes(b"first\n")
    (src / "b.txt").write_bytes(b"b\n")
    archive = tmp_path / "dup.tar"
    sh("tar", "-C", src, "-cf", archive, "a.txt", "b.txt")
    (src / "a.txt").write_bytes(b"second, longer\n")
    sh("tar", "-C", src, "-rf", archive, "a.txt")  # appended: a.txt twice
    dest = tmp_path / "store"
    proc = run_main("pack", archive, dest, *SMALL_ARGS, check=True)
    assert proc.stderr.count("appears") == 1
    assert f"fanstore: warning: {archive}: a.txt appears 2 times; the last one is kept" \
        in proc.stderr
    with LocalStore(str(dest)) as s:
        assert s.read_file("a.txt") == b"second, longer\n"
        assert s.read_file("b.txt") == b"b\n"
        assert s.index.meta["counts"]["files"] == 2
    assert run_main("verify", dest, "--no-progress").returncode == 0


def test_hard_links_become_copies_and_dangling_ones_are_refused(tmp_path):
    need("tar")
    src = tmp_path / "src"
    (src / "d").mkdir(parents=True)
    data = random.Random(2).randbytes(50_000)
    (src / "a.bin").write_bytes(data)
    os.link(src / "a.bin", src / "d" / "b.bin")
    os.link(src / "a.bin", src / "d" / "c.bin")
    archive = tmp_path / "links.tar"
    sh("tar", "--sort=name", "-C", src, "-cf", archive, ".")
    listing = subprocess.run(["tar", "-tvf", archive], capture_output=True, text=True,
                             check=True).stdout
    assert listing.count("link to ./a.bin") == 2, listing
    dest = tmp_path / "store"
    proc = run_main("pack", archive, dest, *SMALL_ARGS, check=True)
    assert len([ln for ln in proc.stderr.splitlines() if "hard link" in ln]) == 1
    assert (f"fanstore: {archive}: 2 hard links stored as copies of their targets (e.g. "
            "d/b.bin, a hard link to a.bin)") in proc.stderr
    with LocalStore(str(dest)) as s:
        for rel in ("a.bin", "d/b.bin", "d/c.bin"):
            assert s.ns.stat(s.ns.resolve(rel)).kind == KIND_FILE
            assert s.read_file(rel) == data
    assert run_main("verify", dest, "--no-progress").returncode == 0
    # The target deleted from the archive: the links point at nothing.
    sh("tar", "--delete", "-f", archive, "./a.bin")
    proc = run_main("pack", archive, tmp_path / "other", *SMALL_ARGS)
    assert_cli_error(proc, code=1, contains="2 entries cannot be packed")
    assert (f"cannot pack {archive}: ./d/b.bin: hard link to ./a.bin, which is not in the "
            "archive before it") in proc.stderr
    no_leftovers(tmp_path / "other")


def test_device_fifo_and_escaping_symlink_entries(tmp_path):
    """Devices, FIFOs and loops are refused by name; a symlink that leads outside the
    archive is kept as it is (issue 35), or left out with --symlinks skip; --symlinks
    follow needs a directory (an archive's link never reads the host)."""
    need("tar")
    src = tmp_path / "src"
    src.mkdir()
    (src / "ok.txt").write_bytes(b"ok\n")
    os.mkfifo(src / "fifo")
    os.symlink("../../etc/passwd", src / "escape")
    os.symlink("/etc/passwd", src / "absolute")
    os.symlink("loop2", src / "loop1")
    os.symlink("loop1", src / "loop2")
    os.symlink("ok.txt", src / "fine")
    archive = tmp_path / "special.tar"
    sh("tar", "-C", src, "-cf", archive, ".")
    if os.path.exists("/dev/null"):
        sh("tar", "-C", "/dev", "-rf", archive, "null")
    dest = tmp_path / "store"
    proc = run_main("pack", archive, dest, *SMALL_ARGS)
    n = 4 if os.path.exists("/dev/null") else 3
    assert_cli_error(proc, code=1, contains=f"{n} entries cannot be packed")
    assert f"{archive}: ./fifo: FIFO cannot be packed" in proc.stderr
    assert f"{archive}: loop1: symlink loop" in proc.stderr
    assert "escape" not in proc.stderr and "absolute" not in proc.stderr
    if n == 4:
        assert f"{archive}: null: character device cannot be packed" in proc.stderr
    no_leftovers(dest)
    run_main("pack", archive, dest, *SMALL_ARGS, "--skip-unreadable", check=True)
    with LocalStore(str(dest)) as s:
        assert set(table(dest)) == {b"", b"ok.txt", b"fine", b"escape", b"absolute"}
        assert s.ns.readlink(s.ns.resolve("fine")) == b"ok.txt"
        assert s.ns.readlink(s.ns.resolve("escape")) == b"../../etc/passwd"
        assert s.ns.readlink(s.ns.resolve("absolute")) == b"/etc/passwd"
    skipped = tmp_path / "skipped"
    proc = run_main("pack", archive, skipped, *SMALL_ARGS, "--skip-unreadable",
                   "--symlinks", "skip")
    assert proc.returncode == 0, proc.stderr
    assert "1 symlinks (2 leading outside the source left out)" in proc.stdout
    assert set(table(skipped)) == {b"", b"ok.txt", b"fine"}
    proc = run_main("pack", archive, tmp_path / "followed", *SMALL_ARGS, "--symlinks", "follow")
    assert_cli_error(proc, code=2, contains="--symlinks follow needs a directory source; "
                                            "with a tar source give --symlinks store or skip")
    no_leftovers(tmp_path / "followed")


def test_sources_that_are_none_of_these(tmp_path):
    (tmp_path / "notes.bin").write_bytes(b"\0\1\2 not an archive")
    proc = run_main("pack", tmp_path / "notes.bin", tmp_path / "store")
    assert_cli_error(proc, code=2, contains="is not a directory, a tar or zip archive")
    proc = run_main("pack", "ftp://host/x", tmp_path / "store")
    assert_cli_error(proc, code=2, contains="unknown scheme ftp://")
    need("tar")
    src = tmp_path / "d"
    src.mkdir()
    (src / "f").write_bytes(b"f")
    sh("tar", "-C", src, "-cf", tmp_path / "x.tar", ".")
    proc = run_main("pack", tmp_path / "x.tar", tmp_path / "store", "--codec", "auto")
    assert_cli_error(proc, code=2, contains="--codec auto needs a directory source")
    for args in (["--solid-kb", "64"], ["--codec", "zstd:3+dict"]):
        proc = run_main("pack", tmp_path / "x.tar", tmp_path / "store", *args)
        assert_cli_error(proc, code=2, contains="needs a directory source; with a tar source")
    assert not (tmp_path / "store").exists()
    # No codec option: a streamed source gets zstd:3, and says so (nothing to sample first).
    proc = run_main("pack", tmp_path / "x.tar", tmp_path / "store", "--no-progress", check=True)
    assert "a tar source is packed with zstd:3" in proc.stderr
    with LocalStore(str(tmp_path / "store")) as s:
        assert s.read_file("f") == b"f"
        assert {c.get("id") for c in s.index.meta["codecs"]} <= {"none", "zstd"}


# --------------------------------------------------------------------------- tar formats


def _format_tree(root: Path, long_link: bool) -> None:
    """A tree every tar format can hold (long_link: also a symlink target over 100
    bytes, which ustar cannot): a path over 100 bytes, modes, a sub-second mtime."""
    deep = root / ("x" * 60) / ("y" * 60)
    deep.mkdir(parents=True)
    (deep / ("z" * 90)).write_bytes(b"deep\n")  # 212-byte path: prefix, GNU L, pax path
    (root / "a.txt").write_bytes(b"alpha\n" * 1000)
    (root / "empty").write_bytes(b"")
    (root / "d").mkdir()
    (root / "d" / "r.bin").write_bytes(random.Random(5).randbytes(30_000))
    os.symlink("../a.txt", root / "d" / "to-a")
    if long_link:
        os.symlink(f"{'x' * 60}/{'y' * 60}/{'z' * 90}", root / "long-link")
    os.chmod(root / "a.txt", 0o640)
    os.utime(root / "a.txt", ns=(0, 1_700_000_000_123_456_789))


@pytest.mark.parametrize("fmt", ["gnu", "oldgnu", "posix", "ustar"])
def test_tar_formats_pack_like_the_tree(tmp_path, fmt):
    """GNU tar's formats (GNU long names and links, pax records, the ustar prefix) give the
    same index as packing the tree; pax keeps nanoseconds, the others whole seconds."""
    need("tar")
    src = tmp_path / "src"
    _format_tree(src, long_link=fmt != "ustar")
    archive = tmp_path / f"{fmt}.tar"
    sh("tar", f"--format={fmt}", "-C", src, "-cf", archive, ".")
    a, b = tmp_path / "from-tar", tmp_path / "from-dir"
    run_main("pack", archive, a, *SMALL_ARGS, check=True)
    run_main("pack", src, b, *SMALL_ARGS, check=True)
    assert_same_index(a, b)
    with LocalStore(str(a)) as s:
        assert s.read_file(f"{'x' * 60}/{'y' * 60}/{'z' * 90}") == b"deep\n"
        mtime = s.ns.stat(s.ns.resolve("a.txt")).mtime_ns
    assert mtime == (1_700_000_000_123_456_789 if fmt == "posix" else 1_700_000_000 * 10**9)


def test_tar_headers_written_by_python(tmp_path):
    """Archives made by Python's tarfile: a pax global header, a pax path and sub-second
    mtime overriding the header's, a GNU base-256 (negative) mtime, a contiguous file
    (type 7, a regular file), a v7 directory (type NUL, name ending in '/')."""
    import io
    import tarfile

    def add(tf, name, data=b"", **kw):
        info = tarfile.TarInfo(name)
        info.size = len(data)
        for k, v in kw.items():
            setattr(info, k, v)
        tf.addfile(info, io.BytesIO(data))

    pax = tmp_path / "pax.tar"
    with tarfile.open(pax, "w", format=tarfile.PAX_FORMAT,
                      pax_headers={"comment": "global header"}) as tf:
        add(tf, "short", b"pax data\n", mtime=5, pax_headers={
            "path": "renamed/by/pax.txt", "mtime": "1600000000.25"})
        add(tf, "n\u00e9.txt", b"utf-8 name\n", mtime=7)
    gnu = tmp_path / "gnu.tar"
    with tarfile.open(gnu, "w", format=tarfile.GNU_FORMAT) as tf:
        add(tf, "old.txt", b"before 1970\n", mtime=-1)
        add(tf, "contiguous.bin", b"c" * 3000, type=tarfile.CONTTYPE, mode=0o600)
    v7 = tmp_path / "v7dir.tar"
    with tarfile.open(v7, "w", format=tarfile.USTAR_FORMAT) as tf:
        add(tf, "olddir/", type=tarfile.AREGTYPE, mode=0o750)
        add(tf, "olddir/f", b"in the v7 directory\n")
    for archive in (pax, gnu, v7):
        run_main("pack", archive, tmp_path / archive.stem, *SMALL_ARGS, check=True)
    with LocalStore(str(tmp_path / "pax")) as s:
        assert set(table(tmp_path / "pax")) == {b"", b"renamed", b"renamed/by",
                                                b"renamed/by/pax.txt", "n\u00e9.txt".encode()}
        assert s.read_file("renamed/by/pax.txt") == b"pax data\n"
        assert s.ns.stat(s.ns.resolve("renamed/by/pax.txt")).mtime_ns == 1_600_000_000_250_000_000
    with LocalStore(str(tmp_path / "gnu")) as s:
        assert s.ns.stat(s.ns.resolve("old.txt")).mtime_ns == -10**9
        e = s.ns.resolve("contiguous.bin")
        assert s.ns.stat(e).kind == KIND_FILE and s.ns.stat(e).mode & 0o7777 == 0o600
        assert s.read_file("contiguous.bin") == b"c" * 3000
    with LocalStore(str(tmp_path / "v7dir")) as s:
        st = s.ns.stat(s.ns.resolve("olddir"))
        assert st.kind == KIND_DIR and st.mode & 0o7777 == 0o750
        assert s.read_file("olddir/f") == b"in the v7 directory\n"


@pytest.mark.parametrize("fmt", ["gnu", "posix"])
def test_sparse_members_are_refused_by_name(tmp_path, fmt):
    """`tar -S` (GNU type S, or pax GNU.sparse.* records): refused by name like a device;
    with --skip-unreadable the members after it are packed (its data skipped exactly)."""
    need("tar")
    src = tmp_path / "src"
    src.mkdir()
    with open(src / "holes.img", "wb") as f:
        f.truncate(8 << 20)
        f.seek(3 << 20)
        f.write(b"island")
    if os.stat(src / "holes.img").st_blocks * 512 >= 8 << 20:
        pytest.skip("this file system does not make sparse files")
    (src / "after.txt").write_bytes(b"after the sparse file\n")
    archive = tmp_path / "sparse.tar"
    sh("tar", "-S", f"--format={fmt}", "-C", src, "-cf", archive, "holes.img", "after.txt")
    dest = tmp_path / "store"
    proc = run_main("pack", archive, dest, *SMALL_ARGS)
    assert_cli_error(proc, code=1, contains="1 entry cannot be packed")
    assert f"cannot pack {archive}: holes.img: sparse file cannot be packed" in proc.stderr
    no_leftovers(dest)
    run_main("pack", archive, dest, *SMALL_ARGS, "--skip-unreadable", check=True)
    assert set(table(dest)) == {b"", b"after.txt"}
    with LocalStore(str(dest)) as s:
        assert s.read_file("after.txt") == b"after the sparse file\n"


def test_a_damaged_header_is_an_error_not_the_end(tmp_path):
    """A header whose checksum does not match, after good members, fails the pack by name
    (tarfile's stream mode took it for the end and packed the members before it)."""
    need("tar")
    src = tmp_path / "src"
    src.mkdir()
    for i in range(3):
        (src / f"f{i}.txt").write_bytes(b"%d\n" % i * 700)
    archive = tmp_path / "ok.tar"
    sh("tar", "-C", src, "-cf", archive, "f0.txt", "f1.txt", "f2.txt")
    data = bytearray(archive.read_bytes())
    second = data.index(b"f1.txt")  # the second member's header
    assert second % 512 == 0
    data[second + 1] ^= 0x20  # its name: the checksum no longer matches
    bad = tmp_path / "bad.tar"
    bad.write_bytes(bytes(data))
    dest = tmp_path / "store"
    proc = run_main("pack", bad, dest, *SMALL_ARGS)
    assert_cli_error(proc, code=1, contains=f"{bad}: corrupt tar archive: bad header "
                                                   f"checksum (in the headers at byte {second:,}")
    no_leftovers(dest)


def test_the_store_does_not_depend_on_the_number_of_workers(tmp_path):
    """The same archive packed with 1 and with 3 worker processes (many files, several
    chunks each for some): byte-identical partitions and index."""
    need("tar")
    src = tmp_path / "src"
    rng = random.Random(11)
    for d in range(4):
        (src / f"d{d}").mkdir(parents=True)
        for i in range(60):
            size = rng.choice([0, 10, 3000, 20_000, 70_000])
            data = rng.randbytes(size // 2) + bytes(size - size // 2)
            (src / f"d{d}" / f"{i:03d}.bin").write_bytes(data)
    archive = tmp_path / "many.tar"
    sh("tar", "-C", src, "-cf", archive, ".")
    stores = []
    for jobs in ("1", "3"):
        dest = tmp_path / f"store-{jobs}"
        run_main("pack", archive, dest, "--partitions", "3", "--chunk-kb", "16", "--jobs", jobs,
                "--no-progress", check=True)
        stores.append(dest)
    names = sorted(os.listdir(stores[0]))
    assert names == sorted(os.listdir(stores[1])) and len(names) == 4
    for n in names:
        assert (stores[0] / n).read_bytes() == (stores[1] / n).read_bytes(), n
    assert run_main("verify", stores[0], "--no-progress").returncode == 0


def test_a_small_archive_is_compressed_without_workers(tmp_path, monkeypatch):
    """``--jobs`` left at its default: an archive that gives less than ``INLINE_BYTES`` is
    compressed in the packing process (no worker starts); a larger one there until then,
    by the workers after; an explicit ``--jobs`` gets its workers from the start. The
    three stores are byte-identical (codec, stored-raw and empty chunks alike)."""
    from fanstore.pack import encoders, stream

    need("tar")
    src = tmp_path / "src"
    rng = random.Random(12)
    raw = 0
    for d in range(3):
        (src / f"d{d}").mkdir(parents=True)
        for i in range(40):
            size = rng.choice([0, 10, 3000, 20_000, 70_000])
            data = rng.randbytes(size // 2) + bytes(size - size // 2)
            if i % 7 == 0:
                data = rng.randbytes(size)  # does not shrink: stored raw
            (src / f"d{d}" / f"{i:03d}.bin").write_bytes(data)
            raw += size
    archive = tmp_path / "small.tar"
    sh("tar", "-C", src, "-cf", archive, ".")
    spawned = []
    real = encoders.spawn_piped
    monkeypatch.setattr(encoders, "spawn_piped",
                        lambda *a, **k: spawned.append(a) or real(*a, **k))
    stores = {}
    for how, inline, jobs in (("inline", raw * 2, ()), ("switch", raw // 2, ()),
                              ("jobs", raw * 2, ("--jobs", "2"))):
        monkeypatch.setattr(stream, "INLINE_BYTES", inline)
        spawned.clear()
        dest = tmp_path / how
        run_main("pack", archive, dest, "--partitions", "3", "--chunk-kb", "16", "--codec",
                 "zstd:3", *jobs, "--no-progress", check=True)
        want = {"inline": 0, "switch": len(os.sched_getaffinity(0)), "jobs": 2}[how]
        assert len(spawned) == want, how
        stores[how] = {n: (dest / n).read_bytes() for n in os.listdir(dest)}
    assert stores["inline"] == stores["switch"] == stores["jobs"]
    with LocalStore(str(tmp_path / "inline")) as s:
        for path in src.rglob("*.bin"):
            assert s.read_file(path.relative_to(src).as_posix()) == path.read_bytes()


@pytest.mark.long
def test_a_compression_worker_that_dies_fails_the_pack(tmp_path):
    """A worker process killed mid-pack (as the OOM killer would): the pack ends at once
    (the other worker, its queue still full, is ended, not drained), one line naming it,
    a non-zero exit, nothing left behind, no process left running."""
    need("tar")
    src = tmp_path / "src"
    src.mkdir()
    rng = random.Random(4)
    words = [rng.randbytes(rng.randint(2, 9)).hex().encode() for _ in range(5000)]
    text = b" ".join(rng.choices(words, k=400_000))
    for i in range(12):  # text-like, each a rotation of one: zstd:19 takes half a minute
        cut = i * len(text) // 12
        (src / f"{i:02d}.txt").write_bytes(text[cut:] + text[:cut])
    archive = tmp_path / "big.tar"
    sh("tar", "-C", src, "-cf", archive, ".")
    dest = tmp_path / "store"
    proc = subprocess.Popen([FANSTORE, "pack", archive, dest, "--codec", "zstd:19",
                             "--jobs", "2", "--no-progress"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        def workers() -> list[int]:
            try:
                with open(f"/proc/{proc.pid}/task/{proc.pid}/children") as f:
                    return [int(x) for x in f.read().split()]
            except OSError:
                return []

        assert wait_until(lambda: len(workers()) == 2, timeout=60)
        pids = workers()
        time.sleep(0.5)
        os.kill(pids[0], signal.SIGKILL)
        killed = time.monotonic()
        out, err = proc.communicate(timeout=120)
        took = time.monotonic() - killed
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    # its death is seen when its pipe closes; the slack is for a busy machine (the other
    # worker's queue alone held over ten seconds of work)
    assert took < 8, f"the pack took {took:.1f} s to end after its worker's death"
    result = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    assert_cli_error(result, code=1, contains="compression worker")
    assert "was killed by SIGKILL" in err and "try fewer --jobs" in err
    no_leftovers(dest)

    def running(pid: int) -> bool:
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().rpartition(")")[2].split()[0] != "Z"
        except OSError:
            return False

    assert not any(running(p) for p in pids)


# --------------------------------------------------------------------------- S3 sources


def _upload_tree(server, bucket: str, prefix: str, root: Path) -> dict[str, bytes]:
    """Every regular file under ``root`` as an object; returns {relative path: bytes}."""
    fs = server.fs()
    files = {}
    for p in sorted(root.rglob("*")):
        if p.is_file() and not p.is_symlink():
            rel = p.relative_to(root).as_posix()
            data = p.read_bytes()
            fs.pipe(f"{bucket}/{prefix}/{rel}", data)
            files[rel] = data
    return files


def test_pack_from_an_s3_prefix(s3_server, small_tree, small_store, tmp_path):
    """Objects under a prefix pack into the same paths, sizes and checksums as the tree's
    files; S3 has no modes, links or empty directories (0644 files, 0755 directories)."""
    src, files = small_tree
    bucket = s3_server.new_bucket()
    assert _upload_tree(s3_server, bucket, "data/set", src) == files
    s3_server.fs().pipe(f"{bucket}/data/setx/not-under-the-prefix", b"x")
    dest = tmp_path / "store"
    proc = run_main("pack", f"s3://{bucket}/data/set", dest, *SMALL_ARGS[:-3], "--jobs", "4",
                   "--no-progress", env=s3_server.env, check=True)
    assert_no_traceback(proc)
    got, tree = table(dest), table(small_store)
    want = {k: v for k, v in tree.items() if v[0] == KIND_FILE}
    assert {k: (v[2], v[3]) for k, v in got.items() if v[0] == KIND_FILE} == \
        {k: (v[2], v[3]) for k, v in want.items()}
    assert {v[1] for v in got.values() if v[0] == KIND_FILE} == {0o644}
    assert {k for k, v in got.items() if v[0] == KIND_DIR} == {b"", b"sub", b"sub/deeper"}
    assert {v[1] for v in got.values() if v[0] == KIND_DIR} == {0o755}
    with LocalStore(str(dest)) as s:
        for rel, data in files.items():
            assert s.read_file(rel) == data
        assert s.index.meta["pack"]["source"] == f"s3://{bucket}/data/set"


def test_s3_source_errors(s3_server, tmp_path):
    dest = tmp_path / "store"
    proc = run_main("pack", "s3://no-such-bucket-here/x", dest, env=s3_server.env)
    assert_cli_error(proc, code=1, contains="bucket 'no-such-bucket-here' does not exist")
    bucket = s3_server.new_bucket()
    proc = run_main("pack", f"s3://{bucket}/empty", dest, env=s3_server.env)
    assert_cli_error(proc, code=1, contains=f"s3://{bucket}/empty: no objects under this prefix")
    proc = run_main("pack", f"s3://{bucket}/x", dest, "--storage-options", "[1]",
                   env=s3_server.env)
    assert_cli_error(proc, code=2, contains="--storage-options: expected a JSON object")
    no_leftovers(dest)


@pytest.mark.s3  # an S3 endpoint of its own
def test_wrong_credentials(tmp_path):
    """A second endpoint that checks signatures: a wrong secret is one clear line."""
    from s3_helpers import MotoServer, moto_available

    ok, why = moto_available()
    if not ok:
        pytest.skip(why)
    server = MotoServer.start(tmp_path)
    try:
        import boto3

        iam = boto3.client("iam", endpoint_url=server.url, region_name="us-east-1",
                           aws_access_key_id="x", aws_secret_access_key="x")
        iam.create_user(UserName="reader")
        iam.put_user_policy(UserName="reader", PolicyName="all", PolicyDocument=(
            '{"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "s3:*",'
            ' "Resource": "*"}]}'))
        key = iam.create_access_key(UserName="reader")["AccessKey"]
        server.env.update(AWS_ACCESS_KEY_ID=key["AccessKeyId"],
                          AWS_SECRET_ACCESS_KEY=key["SecretAccessKey"])
        fs = server.fs()
        fs.mkdir("creds")
        fs.pipe("creds/data/f.txt", b"hello")
        server.set_auth(0)  # from now on every request must be signed by a known key
        ok_proc = run_main("pack", "s3://creds/data", tmp_path / "ok", "--no-progress",
                          env=server.env)
        assert ok_proc.returncode == 0, ok_proc.stderr
        bad = dict(server.env, AWS_SECRET_ACCESS_KEY="not-the-secret")
        proc = run_main("pack", "s3://creds/data", tmp_path / "bad", "--no-progress", env=bad)
        line = assert_cli_error(proc, code=1, contains="s3://creds/data: access denied by "
                                                        f"{server.url}")
        assert "check the credentials" in line
        assert "retrying" not in proc.stderr  # refused credentials are not retried
        no_leftovers(tmp_path / "bad")
    finally:
        server.stop()


def test_endpoint_that_stops_answering_mid_pack(s3_server, tmp_path):
    """SIGSTOP the endpoint while a pack reads from it: each request times out, is retried
    with a growing backoff, then the pack fails with one line naming the object; nothing
    that looks like a store is left."""
    bucket = s3_server.new_bucket()
    fs = s3_server.fs()
    rng = random.Random(9)
    for i in range(64):
        fs.pipe(f"{bucket}/big/obj{i:03d}.bin", rng.randbytes(2 << 20))
    dest = tmp_path / "store"
    cmd = [FANSTORE, "pack", f"s3://{bucket}/big", str(dest), "--codec", "none", "--jobs",
           "1", "--partitions", "4", "--no-progress", "--storage-options",
           '{"timeout": 1, "retries": 2}']
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, **s3_server.env), start_new_session=True)
    try:
        def written() -> int:
            return sum(os.path.getsize(p) for p in glob.glob(f"{dest}{TMP_MARK}*/part-*"))

        # stop it at the first bytes written: 3 of the 4 partitions are still to be read
        # (with a later start the pack could read everything first when the machine is busy)
        assert wait_until(lambda: written() > 0 or proc.poll() is not None, 60, 0.005)
        assert proc.poll() is None, "the pack finished before the endpoint could be stopped"
        s3_server.pause()
        t0 = time.monotonic()
        out, err = proc.communicate(timeout=60)
        elapsed = time.monotonic() - t0
    finally:
        s3_server.resume()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate(timeout=30)
    assert proc.returncode == 1, err
    assert "retrying in 0.5 s (retry 1 of 2)" in err and "retrying in 1.0 s (retry 2 of 2)" \
        in err, err
    line = assert_cli_error(subprocess.CompletedProcess(cmd, 1, out, err), code=1,
                            contains=f"reading s3://{bucket}/big/obj")
    assert "gave up after 3 attempts" in line and "Read timeout" in line
    assert elapsed < 30
    no_leftovers(dest)


# --------------------------------------------------------------------------- S3 stores


def _objects(server, prefix: str) -> list[str]:
    fs = server.fs()
    try:
        return sorted(p.split("/", 1)[1] for p in fs.find(prefix))
    except FileNotFoundError:
        return []


def test_pack_into_s3_replace_and_read_its_index(s3_server, small_tree, special_tree,
                                                 small_store, tmp_path):
    src, _ = small_tree
    bucket = s3_server.new_bucket()
    url = f"s3://{bucket}/sets/ds.fs"
    env = s3_server.env
    proc = run_main("pack", src, url, *SMALL_ARGS, env=env, check=True)
    assert proc.stdout.splitlines()[0].endswith(f"into 2 partitions at {url}")
    assert _objects(s3_server, f"{bucket}/sets") == [
        "sets/ds.fs/fanstore.idx", "sets/ds.fs/part-00000.fsp", "sets/ds.fs/part-00001.fsp"]
    # The same bytes as a local pack of the same tree (the index records the same source).
    fs = s3_server.fs()
    for name in ("part-00000.fsp", "part-00001.fsp"):
        assert fs.cat(f"{bucket}/sets/ds.fs/{name}") == (small_store / name).read_bytes()
    info = run_main("info", url, env=env, check=True).stdout
    assert f"store          {url}" in info and "partitions     2" in info
    ls = run_main("ls", url, "sub", env=env, check=True).stdout.split()
    assert ls == ["c.txt", "deeper/"]

    proc = run_main("pack", src, url, *SMALL_ARGS, env=env)
    assert_cli_error(proc, code=1, contains=f"destination {url} already holds a store")
    # --force from a tar, with fewer partitions: the old extra partition goes.
    need("tar")
    archive = tmp_path / "small.tar"
    sh("tar", "-C", src, "-cf", archive, ".")
    run_main("pack", archive, url, "--partitions", "1", "--chunk-kb", "4", "--no-progress",
            "--force", env=env, check=True)
    assert _objects(s3_server, f"{bucket}/sets") == [
        "sets/ds.fs/fanstore.idx", "sets/ds.fs/part-00000.fsp"]
    index = read_index_env(url, env)
    assert len(index.partitions) == 1 and index.meta["pack"]["source"] == str(archive)
    # Something that is not a store is never overwritten.
    fs.pipe(f"{bucket}/other/precious.txt", b"keep")
    proc = run_main("pack", src, f"s3://{bucket}/other", *SMALL_ARGS, "--force", env=env)
    assert_cli_error(proc, code=1, contains="is not empty and is not a store")
    assert fs.cat(f"{bucket}/other/precious.txt") == b"keep"


def read_index_env(url: str, env: dict):
    """read_index of an s3:// store with the endpoint of ``env`` (in this process)."""
    with environment(env):
        return read_index(url)


def _slow_tree(root: Path) -> None:
    root.mkdir()
    for i in range(4):
        lines = b"".join(b"record %d of file %d: value %d\n" % (j, i, (j * 7919) % 100003)
                         for j in range(60_000))
        (root / f"f{i}.txt").write_bytes(lines)


def test_interrupted_pack_into_s3_leaves_no_store_and_is_cleaned(s3_server, tmp_path):
    """SIGKILL a pack into S3 once a partition is uploaded: no index anywhere (not a
    store); the next pack removes the leftover temporary prefix, naming it."""
    src = tmp_path / "src"
    _slow_tree(src)
    bucket = s3_server.new_bucket()
    url = f"s3://{bucket}/ds.fs"
    cmd = [FANSTORE, "pack", str(src), url, "--jobs", "1", "--partitions", "4", "--codec",
           "zstd:19", "--no-progress"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env=dict(os.environ, **s3_server.env), start_new_session=True)
    try:
        # (every look is a listing the endpoint answers: 0.1 s apart, not 0.02; zstd:19
        # keeps the pack busy for seconds after its first partition)
        assert wait_until(lambda: any(TMP_MARK in o for o in _objects(s3_server, bucket))
                          or proc.poll() is not None, 60, 0.1)
        assert proc.poll() is None, "the pack finished before it could be killed"
        os.killpg(proc.pid, signal.SIGKILL)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate(timeout=30)
    left = _objects(s3_server, bucket)
    assert left and all(TMP_MARK in o for o in left), left
    assert not any(o.endswith(INDEX_NAME) for o in left)
    tmp_prefix = left[0].rsplit("/", 1)[0]
    proc = run_main("info", url, env=s3_server.env)
    assert_cli_error(proc, code=1, contains="not a FanStore store")
    proc = run_main("pack", src, url, "--codec", "zstd:1", "--no-progress", env=s3_server.env,
                   check=True)
    assert f"removing leftover of an interrupted pack: s3://{bucket}/{tmp_prefix}/" \
        in proc.stderr
    assert not any(TMP_MARK in o for o in _objects(s3_server, bucket))
    assert f"ds.fs/{INDEX_NAME}" in _objects(s3_server, bucket)


def test_endpoint_that_stops_answering_while_writing_a_store(s3_server, tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    rng = random.Random(4)
    for i in range(3):  # 12 MiB: three 5 MiB parts at most
        (src / f"r{i}.bin").write_bytes(rng.randbytes(4 << 20))
    bucket = s3_server.new_bucket()
    url = f"s3://{bucket}/ds.fs"
    cmd = [FANSTORE, "pack", str(src), url, "--codec", "none", "--jobs", "1", "--partitions",
           "1", "--no-progress", "--storage-options",
           '{"timeout": 1, "retries": 0, "part_size_mb": 5}']  # retries: mid_pack's test
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, **s3_server.env), start_new_session=True)
    fs = s3_server.fs()

    def uploading() -> bool:
        return bool(fs.call_s3("list_multipart_uploads", Bucket=bucket).get("Uploads"))

    try:
        assert wait_until(lambda: uploading() or proc.poll() is not None, 60, 0.01)
        # the pack is stopped while the endpoint goes quiet, so it cannot finish first
        # however busy the machine
        os.killpg(proc.pid, signal.SIGSTOP)
        assert proc.poll() is None, "the pack finished before the endpoint could be stopped"
        s3_server.pause()
        os.killpg(proc.pid, signal.SIGCONT)
        out, err = proc.communicate(timeout=60)
    finally:
        s3_server.resume()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGCONT)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate(timeout=30)
    line = assert_cli_error(subprocess.CompletedProcess(cmd, proc.returncode, out, err),
                            code=1, contains=f"writing s3://{bucket}/ds.fs{TMP_MARK}")
    # the request the quiet endpoint meets is a part's upload ("(part N of ...)") or, when
    # every part went before the stop, the upload's completion: either names the object
    assert "/part-00000.fsp" in line and "gave up after 1 attempt;" in line, line
    assert INDEX_NAME not in " ".join(_objects(s3_server, bucket))


# --------------------------------------------------------------------------- staging


def _s3_store(server, src, extra=()) -> str:
    bucket = server.new_bucket()
    url = f"s3://{bucket}/ds.fs"
    run_main("pack", src, url, *extra, "--no-progress", env=server.env, check=True)
    return url


@pytest.mark.fuse
def test_mount_a_store_staged_from_s3(s3_server, special_tree, mounted, tmp_path,
                                      monkeypatch):
    url = _s3_store(s3_server, special_tree["root"], ("--partitions", "3"))
    for k, v in s3_server.env.items():
        monkeypatch.setenv(k, v)
    proc = run_cli("mount", url, tmp_path / "m0")
    assert_cli_error(proc, code=2, contains="mounting it needs --local-dir")
    local = tmp_path / "local"
    mnt = mounted(url, "--local-dir", local, "--stage-jobs", "3", "--keep-local")
    assert assert_same_tree(special_tree["root"], mnt, check_mtime=True) > 3000
    stats = run_main("stats", mnt, "--json", check=True).stdout
    assert '"staged_partitions": 3' in stats
    assert sorted(n for n in os.listdir(local) if n.endswith(".fsp")) == [
        "part-00000.fsp", "part-00001.fsp", "part-00002.fsp"]


@pytest.mark.fuse
@pytest.mark.mpi
def test_two_ranks_stage_an_s3_store_and_read_each_others_files(s3_server, small_tree,
                                                                tmp_path):
    """mpiexec -n 2: each rank stages its own partitions from S3 into its local dir, and
    every file reads byte for byte on both ranks (half of them from the other rank)."""
    from mpi_helpers import MpiJob, mpi_available

    ok, why = mpi_available()
    if not ok:
        pytest.skip(why)
    src, files = small_tree
    url = _s3_store(s3_server, src, ("--partitions", "4", "--chunk-kb", "4"))
    with MpiJob(url, tmp_path, ranks=2, env=s3_server.env) as job:
        for rank in range(2):
            for rel, data in files.items():
                with open(job.mnt(rank) / rel, "rb") as f:
                    assert f.read() == data, (rank, rel)
        for rank in range(2):
            st = job.stats(rank)
            assert st["staged_partitions"] == 2 and st["errors"] == 0
            assert st["local_partitions"] == [rank, rank + 2]
            assert st["remote_reads"] > 0 and st["local_reads"] > 0
            assert sorted(n for n in os.listdir(job.local_dir(rank)) if n.endswith(".fsp")) \
                == [f"part-0000{rank}.fsp", f"part-0000{rank + 2}.fsp"]


def _stage_script(url: str, local: Path, jobs: int, block: int) -> str:
    return (
        "import json, sys\n"
        "from fanstore.format.index import read_index\n"
        "from fanstore.daemon.staging import stage_partitions\n"
        f"index = read_index({url!r})\n"
        f"r = stage_partitions({url!r}, {str(local)!r}, index, "
        f"list(range(len(index.partitions))), jobs={jobs}, block={block})\n"
        "print(json.dumps(r.to_json()))\n")


def test_interrupted_stage_in_fetches_only_what_is_missing(s3_server, tmp_path):
    """Kill a stage-in from S3 half-way; the next one continues the partial copies (fetches
    less than the store), and every installed partition matches its checksum."""
    import json

    src = tmp_path / "src"
    src.mkdir()
    rng = random.Random(5)
    for i in range(4):  # 32 MiB: 2 partitions of 16 blocks of 1 MiB, killed after 4
        (src / f"r{i}.bin").write_bytes(rng.randbytes(8 << 20))
    url = _s3_store(s3_server, src, ("--codec", "none", "--partitions", "2"))
    index = read_index_env(url, s3_server.env)
    total = sum(p.size for p in index.partitions)
    local = tmp_path / "local"
    env = dict(os.environ, **s3_server.env)
    code = _stage_script(url, local, jobs=1, block=1 << 20)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)

    def progress() -> int:
        done = 0
        for rec in glob.glob(f"{local}/.*.partial.json"):
            try:
                done += len(json.load(open(rec))["done"])
            except (OSError, ValueError):
                pass
        return done

    try:
        assert wait_until(lambda: progress() >= 4 or proc.poll() is not None, 60, 0.005)
        assert proc.poll() is None, "the stage-in finished before it could be killed"
        proc.kill()
    finally:
        proc.communicate(timeout=30)
    assert glob.glob(f"{local}/.part-*.fsp.partial")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["staged_partitions"] + report["reused_partitions"] == 2
    assert 0 < report["staged_bytes"] < total
    from fanstore.format.partition import file_checksum

    for p in index.partitions:
        assert file_checksum(str(local / p.name)) == p.checksum
    assert not glob.glob(f"{local}/.*partial*")


def test_a_damaged_partition_in_s3_is_never_installed(s3_server, small_tree, tmp_path):
    url = _s3_store(s3_server, small_tree[0], ("--partitions", "2", "--chunk-kb", "4"))
    bucket = url[5:].split("/")[0]
    fs = s3_server.fs()
    key = f"{bucket}/ds.fs/part-00001.fsp"
    data = bytearray(fs.cat(key))
    data[100] ^= 0xFF
    fs.pipe(key, bytes(data))
    local = tmp_path / "local"
    proc = subprocess.run([sys.executable, "-c", _stage_script(url, local, 4, 8 << 20)],
                          capture_output=True, text=True, env=dict(os.environ, **s3_server.env),
                          timeout=120)
    assert proc.returncode != 0
    assert f"partition {url}/part-00001.fsp in object storage is damaged (checksum mismatch)" \
        in proc.stderr
    assert not (local / "part-00001.fsp").exists()
    assert not glob.glob(f"{local}/.part-00001*")
