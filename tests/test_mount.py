"""Real FUSE mounts through the CLI: the special tree byte for byte, readdir of a big
directory, attributes, random reads, concurrent readers, EROFS, damaged partitions, bad
stores, statfs, stats, and the daemon's life cycle (umount, SIGTERM, crash, stale mount)."""

from __future__ import annotations

import ctypes
import errno
import hashlib
import json
import os
import platform
import random
import re
import signal
import stat
import struct
import subprocess
import sys
import textwrap

import pytest

import fanstore
from fanstore import FORMAT_VERSION
from fanstore.format.index import INDEX_NAME, read_index
from fanstore.format.partition import partition_name
from helpers import (
    OUTSIDE_BYTES,
    kill_tree,
    process_tree,
    BIG_DIR_ENTRIES,
    BIG_SIZE,
    MiB,
    assert_cli_error,
    assert_same_tree,
    copy_store,
    daemon_log,
    daemon_pid,
    damage_file,
    flip_bytes,
    is_mounted,
    make_outside_links_tree,
    os_error,
    pid_alive,
    run_cli,
    run_main,
    set_index_version,
    wait_until,
)

pytestmark = [pytest.mark.fuse, pytest.mark.usefixtures("frontend")]


@pytest.fixture(scope="module")
def mnt(frontend, module_mounted, special_store):
    """The special store, mounted once for the read-only tests of this module."""
    return module_mounted(special_store)


def _rel(tree: dict, key: str) -> bytes:
    return os.path.relpath(os.fsencode(tree[key]), os.fsencode(tree["root"]))


def _read(path, flags: int = 0) -> bytes:
    fd = os.open(path, os.O_RDONLY | flags)
    try:
        out = []
        while True:
            block = os.read(fd, MiB)
            if not block:
                return b"".join(out)
            out.append(block)
    finally:
        os.close(fd)


# --------------------------------------------------------------------------- reads


def test_random_preads_of_the_big_file(mnt, special_tree):
    """pread at random offsets and lengths (crossing chunks, at and past EOF, zero length),
    through the page cache and with O_DIRECT (each read reaches the daemon as asked)."""
    data = open(special_tree["big"], "rb").read()
    path = os.path.join(mnt, "large/big.bin")
    assert os.stat(path).st_size == BIG_SIZE
    rng = random.Random(11)
    cases = [(0, 0), (BIG_SIZE, 10), (BIG_SIZE + MiB, 1), (BIG_SIZE - 1, 100), (MiB - 3, 6),
             (0, 3 * MiB + 17), (5 * MiB, 0)]
    cases += [(rng.randrange(BIG_SIZE), rng.choice([1, 7, 4096, 65537, MiB, 2 * MiB + 1]))
              for _ in range(80)]
    for flags in (os.O_DIRECT, 0):
        fd = os.open(path, os.O_RDONLY | flags)
        try:
            for off, size in cases:
                assert os.pread(fd, size, off) == data[off : off + size], (flags, off, size)
        finally:
            os.close(fd)


def test_tree_is_identical_to_the_source(mnt, special_tree, special_store):
    """Every entry: name, type, permission bits, size, bytes, symlink target, mtime (ns);
    nothing missing, nothing extra."""
    compared = assert_same_tree(special_tree["root"], mnt)
    assert compared == read_index(str(special_store)).n_entries - 1


def test_root_attributes(mnt, special_tree):
    src, got = os.stat(special_tree["root"]), os.stat(mnt)
    assert stat.S_ISDIR(got.st_mode) and stat.S_IMODE(got.st_mode) == stat.S_IMODE(src.st_mode)
    assert got.st_mtime_ns == src.st_mtime_ns


def test_stat_of_files(mnt, special_tree):
    for key in ("big", "exec", "readonly", "empty_file", "long_utf8", "deep_file", "non_utf8"):
        rel = _rel(special_tree, key)
        src = os.lstat(os.path.join(os.fsencode(special_tree["root"]), rel))
        got = os.lstat(os.path.join(os.fsencode(mnt), rel))
        assert got.st_size == src.st_size, key
        assert got.st_mode == src.st_mode, key  # type and all permission bits
        assert got.st_mtime_ns == src.st_mtime_ns, key
        assert got.st_nlink == 1 and got.st_uid == os.getuid()
        assert got.st_blocks == (got.st_size + 511) // 512
    exe = os.path.join(mnt, _rel(special_tree, "exec").decode())
    assert os.access(exe, os.X_OK)
    assert os.stat(exe).st_mode & 0o111 == 0o111
    assert os.stat(os.path.join(mnt, _rel(special_tree, "readonly").decode())).st_mode \
        & 0o777 == 0o444


def test_inodes_are_stable_and_unique(mnt):
    names = os.listdir(os.path.join(mnt, "text"))
    inos = [os.lstat(os.path.join(mnt, "text", n)).st_ino for n in names]
    assert len(set(inos)) == len(inos)
    assert inos == [os.lstat(os.path.join(mnt, "text", n)).st_ino for n in names]
    assert [e.inode() for e in sorted(os.scandir(os.path.join(mnt, "text")),
                                      key=lambda e: names.index(e.name))] == inos


def test_directory_nlink_counts_subdirectories(mnt, special_tree):
    for rel in ("", "modes", "empty", "names", "big_dir"):
        src = os.path.join(special_tree["root"], rel)
        subdirs = sum(1 for e in os.scandir(src) if e.is_dir(follow_symlinks=False))
        assert os.stat(os.path.join(mnt, rel)).st_nlink == 2 + subdirs, rel


# --------------------------------------------------------------------------- readdir

_SYS_GETDENTS64 = {"x86_64": 217, "aarch64": 61}.get(platform.machine())


def _getdents(fd: int, size: int) -> list[tuple[bytes, int]]:
    """One getdents64 call with a ``size``-byte buffer: [(name, d_off)]."""
    libc = ctypes.CDLL(None, use_errno=True)
    buf = ctypes.create_string_buffer(size)
    n = libc.syscall(_SYS_GETDENTS64, fd, buf, size)
    if n < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    raw, pos, out = buf.raw[:n], 0, []
    while pos < n:
        _ino, off, reclen, _type = struct.unpack_from("<QqHB", raw, pos)
        out.append((raw[pos + 19 : pos + reclen].split(b"\0", 1)[0], off))
        pos += reclen
    return out


def _expected_big_dir() -> list[str]:
    return [f"f{i:05d}.dat" for i in range(BIG_DIR_ENTRIES)]


def test_big_directory_listdir_and_scandir(mnt):
    path = os.path.join(mnt, "big_dir")
    names = os.listdir(path)
    assert len(names) == BIG_DIR_ENTRIES == len(set(names))
    assert sorted(names) == _expected_big_dir()
    entries = list(os.scandir(path))
    assert sorted(e.name for e in entries) == _expected_big_dir()
    assert all(e.is_file(follow_symlinks=False) for e in entries)
    assert os.stat(path).st_nlink == 2


def test_big_directory_with_ls(mnt):
    out = subprocess.run(["ls", "-f", os.path.join(mnt, "big_dir")], capture_output=True,
                         text=True, check=True).stdout.split()
    names = [n for n in out if n not in (".", "..")]
    assert sorted(names) == _expected_big_dir()


@pytest.mark.skipif(_SYS_GETDENTS64 is None, reason="getdents64 number unknown here")
def test_big_directory_small_buffer_and_seek(mnt):
    """Hundreds of getdents calls with a 512-byte buffer, then a seek to a saved offset:
    every name exactly once, and the listing resumes exactly after the saved entry."""
    fd = os.open(os.path.join(mnt, "big_dir"), os.O_RDONLY | os.O_DIRECTORY)
    try:
        listing, calls = [], 0
        while batch := _getdents(fd, 512):
            listing += batch
            calls += 1
        assert calls > 100
        names = [n.decode() for n, _ in listing if n not in (b".", b"..")]
        assert sorted(names) == _expected_big_dir() and len(names) == BIG_DIR_ENTRIES
        for i in (0, 1499, BIG_DIR_ENTRIES - 2):
            os.lseek(fd, listing[i][1], os.SEEK_SET)
            rest = []
            while batch := _getdents(fd, 512):
                rest += batch
            assert rest == listing[i + 1 :], i
        os.lseek(fd, listing[-1][1], os.SEEK_SET)
        assert _getdents(fd, 512) == []
    finally:
        os.close(fd)


def test_empty_directories(mnt):
    assert os.listdir(os.path.join(mnt, "empty/empty_dir")) == []
    assert os.listdir(os.path.join(mnt, "empty/nested/a/b/c")) == []


# --------------------------------------------------------------------------- symlinks


def test_symlinks_are_followed_inside_the_mount(mnt, special_tree):
    assert _read(os.path.join(mnt, "links/to_file")) == b"hello, world\n"
    assert _read(os.path.join(mnt, "links/to_link")) == b"hello, world\n"
    assert sorted(os.listdir(os.path.join(mnt, "links/to_dir"))) == sorted(
        os.listdir(os.path.join(special_tree["root"], "text")))
    assert os.listdir(os.path.join(mnt, "links/to_deep")) == ["l03"]
    assert os.readlink(os.path.join(mnt, "links/dangling")) == "no-such-file"
    assert os_error(os.stat, os.path.join(mnt, "links/dangling")) == errno.ENOENT
    assert os.path.realpath(os.path.join(mnt, "links/to_file")) == os.path.join(
        os.path.realpath(mnt), "text/hello.txt")


def test_symlinks_that_leave_the_store_are_shown_as_they_are(tmp_path, mounted):
    """Issue 35: packed with the default --symlinks store, each link that leads outside
    keeps its target byte for byte; the mount's readlink returns it and the kernel resolves
    it on the host, as on a squashfs mount (sub/rel's ../.. from the mount point's sub/
    names tmp_path/outside.txt, next to the mount point). The API on the mount stops at
    the store's edge."""
    from fanstore.errors import OutsideStoreError

    tree = make_outside_links_tree(tmp_path)
    store = tmp_path / "store"
    run_main("pack", tree["root"], store, "--codec", "zstd:3", "--no-progress", check=True)
    mnt = mounted(store)
    assert mnt.parent == tmp_path
    for rel, target in tree["links"].items():
        assert os.readlink(mnt / rel) == target, rel
        st = os.lstat(mnt / rel)
        assert stat.S_ISLNK(st.st_mode) and st.st_size == len(os.fsencode(target)), rel
    assert _read(mnt / "abs") == OUTSIDE_BYTES  # the host's file, through the link
    assert _read(mnt / "sub" / "rel") == OUTSIDE_BYTES
    assert _read(mnt / "inside") == tree["files"]["sub/g"]
    assert _read(mnt / "sub" / "up") == tree["files"]["f"]
    assert os_error(os.stat, mnt / "dangling") == errno.ENOENT
    assert os_error(os.stat, mnt / "outloop") == errno.ELOOP
    assert os_error(os.stat, mnt / "inside_dangling") == errno.ENOENT
    with fanstore.open_store(str(mnt)) as s:
        assert type(s).__name__ == "MountReader"
        assert s.read("inside") == tree["files"]["sub/g"]
        with pytest.raises(OutsideStoreError, match="symlink 'abs' -> .* leads outside"):
            s.read("abs")


# --------------------------------------------------------------------------- errors


def test_writes_fail_with_erofs(mnt):
    f = os.path.join(mnt, "text/hello.txt")
    d = os.path.join(mnt, "text")
    new = os.path.join(mnt, "text/new.txt")
    attempts = {
        "open O_WRONLY": lambda: os.open(f, os.O_WRONLY),
        "open O_RDWR": lambda: os.open(f, os.O_RDWR),
        "open O_APPEND": lambda: os.open(f, os.O_WRONLY | os.O_APPEND),
        "open O_TRUNC": lambda: os.open(f, os.O_RDONLY | os.O_TRUNC),
        "create": lambda: os.open(new, os.O_WRONLY | os.O_CREAT, 0o644),
        "mkdir": lambda: os.mkdir(os.path.join(d, "sub")),
        "rmdir": lambda: os.rmdir(os.path.join(mnt, "empty/empty_dir")),
        "unlink": lambda: os.unlink(f),
        "rename": lambda: os.rename(f, new),
        "symlink": lambda: os.symlink("x", new),
        "link": lambda: os.link(f, new),
        "mkfifo": lambda: os.mkfifo(new),
        "chmod": lambda: os.chmod(f, 0o600),
        "chown": lambda: os.chown(f, 1, 1),
        "utime": lambda: os.utime(f, (1, 1)),
        "truncate": lambda: os.truncate(f, 0),
        "setxattr": lambda: os.setxattr(f, "user.x", b"1"),
        "removexattr": lambda: os.removexattr(f, "user.x"),
    }
    got = {name: os_error(fn) for name, fn in attempts.items()}
    assert got == {name: errno.EROFS for name in attempts}
    assert _read(f) == b"hello, world\n" and not os.path.lexists(new)


def test_lookup_errors(mnt, frontend):
    assert os_error(os.stat, os.path.join(mnt, "nope")) == errno.ENOENT
    assert os_error(os.stat, os.path.join(mnt, "text/hello.txt/x")) == errno.ENOTDIR
    assert os_error(os.listdir, os.path.join(mnt, "text/hello.txt")) == errno.ENOTDIR
    fd = os.open(os.path.join(mnt, "text"), os.O_RDONLY)
    try:
        assert os_error(os.read, fd, 10) == errno.EISDIR
    finally:
        os.close(fd)
    # pyfuse3 answers "no such attribute"; the kernel frontend answers ENOSYS once and the
    # kernel then reports "not supported" itself without asking again (docs/architecture.md).
    no_xattr = errno.ENODATA if frontend == "pyfuse3" else errno.EOPNOTSUPP
    assert os_error(os.getxattr, os.path.join(mnt, "text/hello.txt"), "user.x") == no_xattr
    if frontend == "pyfuse3":
        assert os.listxattr(os.path.join(mnt, "text/hello.txt")) == []
    else:
        assert os_error(os.listxattr, os.path.join(mnt, "text/hello.txt")) == errno.EOPNOTSUPP


def test_statvfs(mnt, special_tree, special_store):
    s = os.statvfs(mnt)
    index = read_index(str(special_store))
    assert s.f_namemax == 255
    assert s.f_files == index.n_entries
    assert s.f_flag & os.ST_RDONLY
    assert s.f_bfree == 0 and s.f_bavail == 0
    assert s.f_blocks * s.f_frsize >= special_tree["raw_bytes"]
    assert s.f_blocks * s.f_frsize < special_tree["raw_bytes"] + 4096


# --------------------------------------------------------------------------- concurrency

_READER = textwrap.dedent("""
    import hashlib, json, os, random, sys
    root, listing, seed, direct = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4] == "1"
    paths = json.load(open(listing))
    random.Random(seed).shuffle(paths)
    out = {}
    for rel in paths:
        fd = os.open(os.path.join(root, rel), os.O_RDONLY | (os.O_DIRECT if direct else 0))
        h = hashlib.sha256()
        try:
            while True:
                block = os.read(fd, 1 << 20)
                if not block:
                    break
                h.update(block)
        finally:
            os.close(fd)
        out[rel] = h.hexdigest()
    json.dump(out, sys.stdout)
""")


def test_eight_concurrent_reader_processes(mounted, special_store, special_tree, tmp_path,
                                          frontend):
    """8 processes read the same files in different orders at once (half with O_DIRECT, so
    their reads all reach the daemon; a small cache forces evictions): all bytes right."""
    root = special_tree["root"]
    rels = ["large/big.bin", _rel(special_tree, "deep_file").decode()]
    rels += [os.path.relpath(p, root) for p in special_tree["chunk_files"]]
    rels += [f"big_dir/f{i:05d}.dat" for i in range(0, BIG_DIR_ENTRIES, 10)]
    expected = {rel: hashlib.sha256(open(os.path.join(root, rel), "rb").read()).hexdigest()
                for rel in rels}
    listing = tmp_path / "list.json"
    listing.write_text(json.dumps(rels))
    m = mounted(special_store, "--cache-mb", "8")
    procs = [subprocess.Popen([sys.executable, "-c", _READER, str(m), str(listing), str(i),
                               "1" if i % 2 else "0"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(8)]
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err
        assert json.loads(out) == expected
    stats = json.loads(run_main("stats", m, "--json", check=True).stdout)
    assert stats["errors"] == 0
    if frontend == "pyfuse3":
        assert stats["opens"] >= len(rels)
    else:  # zero-message open: the kernel stops sending OPEN after the first ENOSYS reply;
        # OPENs already in flight from the other readers still arrive: at most one per process
        assert stats["opens"] == 0 and stats["requests_by_op"].get("open", 0) <= len(procs)
        assert stats["reads"] >= len(rels)


# --------------------------------------------------------------------------- stats


def test_stats_counters_move_when_reading(mounted, special_store, special_tree, frontend):
    """O_DIRECT preads reach the daemon one for one: the counters move by exact amounts.
    (The file is two chunks, above --push-kb: nothing is pushed at OPEN.)"""
    # One kernel-frontend worker: each worker process has its own chunk cache, and this test
    # counts cache hits exactly.
    m = mounted(special_store, "--workers", "1")

    def stats():
        return json.loads(run_main("stats", m, "--json", check=True).stdout)

    before = stats()
    for key in ("opens", "reads", "cache_hits", "cache_misses", "local_reads", "remote_reads",
                "errors", "bytes_returned", "chunks_decoded"):
        assert isinstance(before[key], int), key
    expected = open(special_tree["chunk_files"][3], "rb").read()
    fd = os.open(os.path.join(m, "chunks/two_exact.bin"), os.O_RDONLY | os.O_DIRECT)
    try:
        for off in (0, 4096, 8192):  # all in chunk 0: one miss, then two hits
            assert os.pread(fd, 4096, off) == expected[off : off + 4096]
    finally:
        os.close(fd)
    after = stats()
    delta = {k: after[k] - before[k] for k in before if isinstance(before[k], int)}
    assert delta["opens"] == (1 if frontend == "pyfuse3" else 0)  # zero-message open
    assert delta["reads"] == 3
    assert delta["bytes_returned"] == 3 * 4096
    assert (delta["cache_misses"], delta["cache_hits"]) == (1, 2)
    assert delta["local_reads"] == 1 and delta["chunks_decoded"] == 1
    assert delta["remote_reads"] == 0 and delta["errors"] == 0
    assert _read(os.path.join(m, "chunks/two_exact.bin")) == expected
    final = stats()
    assert final["chunks_decoded"] == after["chunks_decoded"] + 1  # chunk 1 only
    human = run_main("stats", m, check=True).stdout
    assert re.search(rf"^opens +{final['opens']}$", human, re.M), human


# --------------------------------------------------------------------------- damage


def test_damaged_files_give_eio_and_the_rest_reads_right(mounted, small_store, small_tree,
                                                        tmp_path):
    _, files = small_tree
    store = copy_store(small_store, tmp_path / "s")
    damage_file(store, "a.txt")
    damage_file(store, "sub/deeper/d.txt", chunk=1)
    m = mounted(store)
    for rel, data in files.items():
        path = os.path.join(m, rel)
        assert os.stat(path).st_size == len(data)  # metadata is unaffected
        if rel in ("a.txt", "sub/deeper/d.txt"):
            assert os_error(_read, path) == errno.EIO, rel
            assert os_error(_read, path, os.O_DIRECT) == errno.EIO, rel
        else:
            assert _read(path) == data, rel
    # The intact first chunk of d.txt is still served exactly (read exactly it).
    fd = os.open(os.path.join(m, "sub/deeper/d.txt"), os.O_RDONLY | os.O_DIRECT)
    try:
        assert os.pread(fd, 4096, 0) == files["sub/deeper/d.txt"][:4096]
        assert os_error(os.pread, fd, 10, 4096) == errno.EIO
    finally:
        os.close(fd)
    stats = json.loads(run_main("stats", m, "--json", check=True).stdout)
    assert stats["errors"] >= 2
    # verify agrees on exactly which files are damaged.
    proc = run_main("verify", store, "--no-progress")
    assert proc.returncode == 1
    assert [ln.split(":")[0] for ln in proc.stdout.splitlines()] == [
        "DAMAGED a.txt", "DAMAGED sub/deeper/d.txt"]


def test_random_damage_never_gives_wrong_bytes(mounted, special_store, special_tree, tmp_path):
    """Flip bytes at random places of every partition: each file reads either its exact
    bytes or EIO; files whose chunks were not touched read exactly."""
    store = copy_store(special_store, tmp_path / "s")
    index = read_index(str(store))
    c = index.chunks
    owner = {}  # chunk -> file entry
    for entry in index.file_entries().tolist():
        first, count = index.chunk_run(entry)
        for k in range(first, first + count):
            owner[k] = entry
    rng = random.Random(5)
    hit = set()
    for p in index.partitions:
        if p.size <= 64:
            continue
        for _ in range(3):
            pos = rng.randrange(64, p.size - 8)
            flip_bytes(store / p.name, pos, 8)
            for k in range(index.n_chunks):
                if int(c["part"][k]) == p.number and \
                        int(c["offset"][k]) <= pos + 7 and pos < int(c["offset"][k]) + int(c["stored"][k]):
                    hit.add(os.fsdecode(index.path(owner[k])))
    assert hit
    m = mounted(store)
    root = special_tree["root"]
    eio = set()
    for rel in [os.fsdecode(index.path(e)) for e in index.file_entries().tolist()]:
        expected = open(os.path.join(root, rel), "rb").read()
        try:
            got = _read(os.path.join(m, rel))
        except OSError as exc:
            assert exc.errno == errno.EIO, rel
            eio.add(rel)
            continue
        assert got == expected, f"{rel}: wrong bytes served"
    assert eio and eio <= hit


# --------------------------------------------------------------------------- bad stores


def _assert_mount_refused(proc, mnt, code, contains):
    assert_cli_error(proc, code=code, contains=contains)
    assert not is_mounted(mnt)
    pid = daemon_pid(mnt)
    assert not pid_alive(pid)


def test_newer_format_version_is_refused_by_mount(small_store, tmp_path):
    store = copy_store(small_store, tmp_path / "s")
    set_index_version(store, FORMAT_VERSION + 1)
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    proc = run_cli("mount", store, mnt)
    _assert_mount_refused(proc, mnt, 33, f"store format v{FORMAT_VERSION + 1} is newer")


def test_truncated_index_is_refused_by_mount(small_store, tmp_path):
    store = copy_store(small_store, tmp_path / "s")
    idx = store / INDEX_NAME
    idx.write_bytes(idx.read_bytes()[:-10])
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    _assert_mount_refused(run_cli("mount", store, mnt), mnt, 1, "truncated")


def test_truncated_partition_is_refused_by_mount(small_store, tmp_path):
    store = copy_store(small_store, tmp_path / "s")
    os.truncate(store / partition_name(0), 100)
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    _assert_mount_refused(run_cli("mount", store, mnt), mnt, 1, "partition is truncated")


def test_partition_with_a_damaged_header_is_refused_by_mount(small_store, tmp_path):
    store = copy_store(small_store, tmp_path / "s")
    flip_bytes(store / partition_name(1), 0, 4)
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    _assert_mount_refused(run_cli("mount", store, mnt), mnt, 1,
                          "not a FanStore partition (bad magic)")


def test_mount_usage_errors(small_store, tmp_path, mounted):
    proc = run_cli("mount", small_store, tmp_path / "missing")
    assert_cli_error(proc, code=1, contains="does not exist")
    afile = tmp_path / "afile"
    afile.write_bytes(b"")
    assert_cli_error(run_cli("mount", small_store, afile), code=1, contains="not a directory")
    mnt = tmp_path / "m"
    mnt.mkdir()
    assert_cli_error(run_cli("mount", tmp_path / "nostore", mnt), code=1,
                     contains="no such directory")
    assert not is_mounted(mnt)
    m = mounted(small_store)
    line = assert_cli_error(run_cli("mount", small_store, m), code=1,
                            contains="is already mounted by FanStore")
    assert f"pid {daemon_pid(m)}" in line
    assert os.listdir(m)  # the first mount is unharmed


def test_empty_store_mounts(mounted, tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    run_main("pack", src, tmp_path / "store", "--partitions", "1", "--no-progress", check=True)
    m = mounted(tmp_path / "store")
    assert os.listdir(m) == []
    assert os.statvfs(m).f_files == 1


# --------------------------------------------------------------------------- life cycle


def test_umount(mounted, small_store):
    m = mounted(small_store)
    pid = daemon_pid(m)
    proc = run_main("umount", m)
    assert proc.returncode == 0, proc.stderr
    assert not is_mounted(m) and wait_until(lambda: not pid_alive(pid), 10)
    assert os.listdir(m) == []  # the empty mount point directory again
    assert_cli_error(run_main("umount", m), code=1, contains="is not mounted")


def test_umount_of_a_busy_mount_refuses_without_lazy(mounted, small_store, small_tree):
    m = mounted(small_store)
    fd = os.open(os.path.join(m, "a.txt"), os.O_RDONLY)
    try:
        proc = run_main("umount", m)
        refused = proc.returncode == 1 and "is busy" in proc.stderr and "--lazy" in proc.stderr
        still_mounted = is_mounted(m)
        read_error = os_error(os.pread, fd, 5, 0)
    finally:
        os_error(os.close, fd)
    assert (refused, still_mounted, read_error) == (True, True, None), proc.stderr
    assert run_main("umount", m, "--lazy").returncode == 0
    assert not is_mounted(m)


def test_sigterm_unmounts_cleanly(mounted, small_store, tmp_path):
    """SIGTERM ends the mount like an umount: every process gone, nothing left in the
    runtime root; what happened is in the log the user asked for (``--log``)."""
    from fanstore import mounttable, runtime

    log = tmp_path / "daemon.log"
    m = mounted(small_store, "--log", str(log))
    rt = runtime.MountRuntime.find(str(m))
    assert rt is not None and os.path.isdir(rt.path)
    pid = daemon_pid(m)
    serving = process_tree(pid)
    os.kill(pid, signal.SIGTERM)
    assert wait_until(lambda: not pid_alive(pid), 15), "daemon still alive after SIGTERM"
    assert wait_until(lambda: not any(pid_alive(p) for p in serving), 5), \
        "a frontend process or worker outlived the mount"
    assert not is_mounted(m)
    assert mounttable.mount_status(str(m)) == "none"
    assert runtime.MountRuntime.find(str(m)) is None and not os.path.exists(rt.path)
    assert "signal SIGTERM" in log.read_text()


def _crash(m) -> None:
    """SIGKILL every process of the mount of ``m`` at once (a daemon killed alone is cleaned
    up after by its frontend: test_a_daemon_killed_alone_…) after the kernel has cached the
    root's attributes (as any use of a mount does)."""
    os.stat(m)
    os.listdir(m)
    serving = kill_tree(daemon_pid(m))
    assert wait_until(lambda: not any(pid_alive(p) for p in serving), 10), \
        "a process of the mount outlived its SIGKILL"
    assert is_mounted(m)  # the kernel mount outlives its daemon
    assert os_error(os.statvfs, m) in (errno.ENOTCONN, errno.ECONNABORTED)
    # (a listing the kernel has cached, as the kernel frontend lets it, is still answered)
    assert os_error(os.listdir, m) in (errno.ENOTCONN, errno.ECONNABORTED, None)
    assert os_error(os.listdir, os.path.join(m, "sub")) in (errno.ENOTCONN,
                                                             errno.ECONNABORTED)


@pytest.mark.frontends("kernel")  # pyfuse3 serves from the daemon's own process
def test_a_daemon_killed_alone_is_cleaned_up_after_by_its_frontend(mounted, small_store):
    """SIGKILL of the daemon alone (issue 44): its kernel frontend notices (a pidfd), and
    within seconds the mount, the index copy and the runtime directory are gone, and every
    process of the mount has exited."""
    from fanstore import runtime

    m = mounted(small_store)
    os.listdir(m)
    state = runtime.read_state(str(m)) or {}
    rt = runtime.MountRuntime.find(str(m))
    pid = daemon_pid(m)
    serving = process_tree(pid)
    assert len(serving) >= 2 and state.get("index_copy")
    os.kill(pid, signal.SIGKILL)
    assert wait_until(lambda: not any(pid_alive(p) for p in serving), 15), \
        "a frontend process or worker outlived its daemon"
    assert wait_until(lambda: not is_mounted(m), 10)
    assert not os.path.exists(state["index_copy"])
    assert not os.path.exists(rt.path), os.listdir(rt.path)
    assert os.listdir(m) == []


@pytest.mark.frontends("kernel")  # the pyfuse3 frontend has no worker processes
def test_a_killed_worker_is_replaced_and_reads_go_on(mounted, small_store, small_tree, tmp_path,
                                                     frontend):
    """Kernel frontend: SIGKILL of a worker process; the frontend process starts another
    one in its place, every file still reads right, and umount ends every process."""
    log = tmp_path / "daemon.log"
    m = mounted(small_store, "--workers", "2", "--log", str(log))
    pid = daemon_pid(m)
    frontend_proc, *workers = process_tree(pid)[1:]
    assert len(workers) == 2
    os.kill(workers[0], signal.SIGKILL)
    assert wait_until(lambda: len(process_tree(pid)) == 4
                      and workers[0] not in process_tree(pid), 10), process_tree(pid)
    for _ in range(3):  # enough reads to reach both workers
        for rel, data in small_tree[1].items():
            assert _read(os.path.join(m, rel), os.O_DIRECT) == data
    serving = process_tree(pid)
    assert run_main("umount", m).returncode == 0
    assert wait_until(lambda: not any(pid_alive(p) for p in serving), 15)
    assert "replac" in log.read_text().lower()


def test_crashed_daemon_leaves_a_stale_mount_that_umount_cleans(mounted, small_store):
    """umount cleans the stale mount and sweeps the runtime directory the killed daemon
    could not remove."""
    from fanstore import runtime

    m = mounted(small_store)
    rt = runtime.MountRuntime.find(str(m))
    _crash(m)
    assert os.path.isdir(rt.path)
    proc = run_main("umount", m)
    assert proc.returncode == 0, proc.stderr
    assert not is_mounted(m) and os.listdir(m) == []
    assert not os.path.exists(rt.path)


def test_umount_leaves_no_runtime_directory(mounted, small_store):
    from fanstore import runtime

    m = mounted(small_store)
    rt = runtime.MountRuntime.find(str(m))
    assert "state.json" in os.listdir(rt.path)
    pid = daemon_pid(m)
    assert run_main("umount", m).returncode == 0
    assert wait_until(lambda: not pid_alive(pid), 15), "the daemon did not exit"
    assert not os.path.exists(rt.path), os.listdir(rt.path)
    assert os.path.isdir(rt.root)  # the root stays: other mounts of this user use it


def test_next_mount_cleans_a_stale_mount(mounted, small_store, small_tree):
    m = mounted(small_store)
    _crash(m)
    mounted(small_store, mnt=m)  # asserts exit 0 and a live daemon
    assert _read(os.path.join(m, "a.txt")) == small_tree[1]["a.txt"]


def test_next_mount_reports_the_stale_mount(small_store, tmp_path, mounted):
    m = mounted(small_store)
    _crash(m)
    proc = run_cli("mount", small_store, m)
    mounted.mounts.append((m, daemon_pid(m)))  # clean up whatever this mount left
    assert proc.returncode == 0, proc.stderr
    assert "stale mount" in proc.stderr


def test_times_before_1970_stat_without_a_listing_first(mounted, tmp_path):
    """A file whose mtime is before 1970 stats right on a fresh mount (a LOOKUP, not the
    listing's READDIRPLUS, answers it): the kernel frontend packs the u64 seconds field
    the kernel reads as signed."""
    src = tmp_path / "src"
    src.mkdir()
    old = src / "old.txt"
    old.write_bytes(b"1938\n")
    when_ns = -1_000_000_000 * 1_000_000_000 + 123  # 1938-04-24, with nanoseconds
    os.utime(old, ns=(when_ns, when_ns))
    store = tmp_path / "store"
    run_main("pack", src, store, "--codec", "zstd:3", "--no-progress", check=True)
    m = mounted(store)
    st = os.stat(m / "old.txt")  # no listing first
    assert st.st_mtime_ns == when_ns
    assert _read(m / "old.txt") == b"1938\n"


# ------------------------------------------------------------------ stores of older formats

GOLDEN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "format")


@pytest.mark.parametrize("version", ["v1", "v2"])
def test_a_store_of_an_older_format_mounts_and_reads_byte_for_byte(mounted, version):
    """The committed v1 and v2 stores (written by earlier releases, with a name lookup table
    that v3 dropped) mount today: every listing, attribute, link and byte is as packed, and
    a name the store lacks is ENOENT (names are found by bisection in every version)."""
    with open(os.path.join(GOLDEN, "manifest.json")) as f:
        manifest = json.load(f)
    mnt = mounted(os.path.join(GOLDEN, version))
    seen = {os.path.relpath(os.path.join(d, n), mnt)
            for d, dirs, files in os.walk(mnt) for n in dirs + files}
    assert seen == set(manifest)
    for rel, rec in manifest.items():
        path = os.path.join(mnt, rel)
        st = os.lstat(path)
        assert (stat.S_IMODE(st.st_mode), st.st_mtime_ns) == (rec["mode"], rec["mtime_ns"]), rel
        if rec["kind"] == "file":
            with open(path, "rb") as f:
                assert hashlib.sha256(f.read()).hexdigest() == rec["sha256"], rel
        elif rec["kind"] == "symlink":
            assert os.readlink(path) == rec["target"], rel
        assert os_error(os.lstat, path + "-not-there") == errno.ENOENT


@pytest.mark.parametrize("how", ["swap", "repeat"])
def test_a_directory_with_unsorted_names_is_eio_alone(mounted, tmp_path, how):
    """A damaged index whose one directory lists its names out of order, or one twice
    (lookups bisect; the checksum is valid): a lookup there is EIO, on every try; that
    directory still lists, every other directory reads as packed (the check is per
    directory, at its first lookup), and the daemon's log has one line naming the store and
    the directory, not one per lookup (one worker: each serving process logs it once)."""
    from helpers import damage_directory, make_small_tree

    src, store = tmp_path / "src", tmp_path / "store"
    files = make_small_tree(src)
    run_main("pack", src, store, "--no-progress", check=True)
    damage_directory(store, "sub/deeper", how)
    mnt = mounted(store, "--workers", "1")
    for name in ("d.txt", "e.bin", "missing", "d.txt"):
        assert os_error(os.stat, mnt / "sub/deeper" / name) == errno.EIO, name
    listed = ["d.txt", "e.bin"] if how == "swap" else ["d.txt", "d.txt"]
    assert sorted(os.listdir(mnt / "sub/deeper")) == listed
    for rel in ("a.txt", "b.bin", "sub/c.txt"):
        assert (mnt / rel).read_bytes() == files[rel]
    assert os_error(os.stat, mnt / "sub/missing") == errno.ENOENT
    lines = [ln for ln in daemon_log(mnt, limit=1 << 20).splitlines()
             if "are not sorted, or one repeats" in ln]
    assert len(lines) == 1, daemon_log(mnt)
    assert f"{store}: the names of directory sub/deeper are not sorted" in lines[0]
