"""The ``fanstore`` command without a mount: info/ls/cat/verify on stores, version and
truncation errors, and bad input that must exit non-zero with one line and no traceback."""

from __future__ import annotations

import json
import os
import re
import stat

import pytest

from fanstore import FORMAT_VERSION
from fanstore.format.index import INDEX_NAME
from fanstore.format.partition import partition_name
from helpers import (
    MiB,
    assert_cli_error,
    assert_no_traceback,
    copy_store,
    damage_directory,
    damage_file,
    run_cli,
    run_main,
    set_index_version,
)

# --------------------------------------------------------------------------- info


def test_info_json(special_tree, special_store):
    proc = run_main("info", special_store, "--json", check=True)
    info = json.loads(proc.stdout)
    assert info["format_version"] == 5  # what pack writes (v1 to v4 stores still read)
    assert info["created_by"].startswith("fanstore ")
    c = info["counts"]
    assert (c["files"], c["dirs"], c["symlinks"], c["raw_bytes"]) == (
        special_tree["files"], special_tree["dirs"], special_tree["symlinks_count"],
        special_tree["raw_bytes"])
    sizes = [os.path.getsize(special_store / partition_name(i)) for i in range(4)]
    assert [p["size"] for p in info["partitions"]] == sizes
    assert c["stored_bytes"] == sum(sizes)
    assert info["ratio"] == pytest.approx(c["raw_bytes"] / c["stored_bytes"])
    assert info["index_bytes"] == os.path.getsize(special_store / INDEX_NAME)
    assert info["chunk_size"] == MiB
    assert set(info["codec_chunks"]) == {"none", "zstd:3"}
    assert info["solid_chunks"] == info["files_in_solid_chunks"] == 0
    assert info["pack"]["partitions"] == 4
    assert info["pack"]["source"] == special_tree["root"]


def test_info_human(special_tree, special_store):
    proc = run_main("info", special_store, check=True)
    out = proc.stdout
    assert f"store          {special_store}\n" in out
    assert "format         v5 (fanstore " in out
    assert "solid blocks" not in out
    assert (f"entries        {special_tree['files']:,} files, {special_tree['dirs']:,} dirs, "
            f"{special_tree['symlinks_count']:,} symlinks") in out
    assert f"raw bytes      {special_tree['raw_bytes']:,}\n" in out
    assert "partitions     4\n" in out
    assert re.search(r"^codec          zstd:3: [\d,]+ chunks$", out, re.M)


# --------------------------------------------------------------------------- ls


def _listing(path) -> list[str]:
    """Expected ``fanstore ls`` lines for a source directory (names sorted as bytes)."""
    root = os.fsencode(path)
    out = []
    for name in sorted(os.listdir(root)):
        is_dir = stat.S_ISDIR(os.lstat(os.path.join(root, name)).st_mode)
        out.append(os.fsdecode(name) + ("/" if is_dir else ""))
    return out


@pytest.mark.parametrize("rel", ["", "names", "big_dir", "modes", "empty/empty_dir",
                                 "deep/" + "/".join(f"l{i:02d}" for i in range(1, 41))])
def test_ls_lists_exactly_the_source(special_tree, special_store, rel):
    proc = run_main("ls", special_store, rel, check=True)
    assert proc.stdout.splitlines() == _listing(os.path.join(special_tree["root"], rel))


def test_ls_long(special_tree, special_store):
    proc = run_main("ls", "-l", special_store, "links", check=True)
    lines = proc.stdout.splitlines()
    assert len(lines) == 5
    to_file = next(ln for ln in lines if " to_file" in ln)
    assert re.fullmatch(r"lrwxrwxrwx +17 \d{4}-\d\d-\d\d \d\d:\d\d to_file -> ../text/hello.txt",
                        to_file), to_file
    proc = run_main("ls", "-l", special_store, "modes", check=True)
    modes = {ln.split()[-1]: ln.split()[0] for ln in proc.stdout.splitlines()}
    assert modes == {"group.txt": "-rw-r-----", "private.txt": "-rw-------",
                     "readonly.txt": "-r--r--r--", "ro_dir/": "dr-xr-xr-x",
                     "run.sh": "-rwxr-xr-x", "sticky/": "drwxrwxrwt"}


def test_ls_of_a_file_prints_its_path(special_store):
    proc = run_main("ls", "-l", special_store, "text/hello.txt", check=True)
    assert re.fullmatch(r"-rw-r--r-- +13 \S+ \S+ text/hello.txt\n", proc.stdout), proc.stdout


def test_ls_non_utf8_names_with_a_strict_utf8_stdout(special_store):
    proc = run_cli("ls", special_store, "names", env={"PYTHONIOENCODING": "utf-8"},
                   text=False)
    assert proc.returncode == 0, proc.stderr
    assert b"latin1-\xe9.txt\n" in proc.stdout


# --------------------------------------------------------------------------- cat


@pytest.mark.parametrize("key", ["big", "unicode", "long_utf8", "long_ascii", "deep_file",
                                 "empty_file", "non_utf8", "exec"])
def test_cat(special_tree, special_store, key):
    """cat of files with hard names and of the >40 MB file equals the source bytes."""
    path = special_tree[key]
    rel = os.path.relpath(os.fsencode(path), os.fsencode(special_tree["root"]))
    proc = run_main("cat", special_store, rel, text=False, check=True)
    assert proc.stdout == open(path, "rb").read()
    assert proc.stderr == b""


def test_cat_follows_symlinks_inside_the_store(special_tree, special_store):
    """The one symlink rule: reading a path follows symlinks, as open() on the mount does."""
    want = open(os.path.join(special_tree["root"], "text", "hello.txt"), "rb").read()
    for rel in ("links/to_file", "links/to_link", "links/to_dir/hello.txt"):
        proc = run_main("cat", special_store, rel, text=False, check=True)
        assert proc.stdout == want, rel


@pytest.mark.parametrize("rel, message", [
    ("text", "text: is a directory"),
    ("", "/: is a directory"),
    ("links/dangling", "links/dangling: no such file or directory in the store"),
    ("links/to_dir", "links/to_dir: is a directory"),
    ("text/nope", "text/nope: no such file or directory in the store"),
    ("text/hello.txt/x", "text/hello.txt/x: not a directory"),  # ENOTDIR, as on the mount
])
def test_cat_errors(special_store, rel, message):
    proc = run_main("cat", special_store, rel)
    assert_cli_error(proc, code=1, contains=message)
    assert proc.stdout == ""


# --------------------------------------------------------------------------- verify


def test_verify_intact_store(special_tree, special_store):
    proc = run_main("verify", special_store, "--no-progress")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout == ""
    assert re.fullmatch(rf"verified {special_tree['files']:,} files \([\d,.]+ MB\) in [\d.]+ s "
                        r"\([\d,]+ MB/s\): all intact\n", proc.stderr), proc.stderr


def test_verify_lists_exactly_the_damaged_files(small_store, tmp_path):
    store = copy_store(small_store, tmp_path / "s")
    damaged = {"a.txt", "sub/deeper/d.txt"}
    damage_file(store, "a.txt")
    damage_file(store, "sub/deeper/d.txt", chunk=2)  # a later chunk of a multi-chunk file
    proc = run_main("verify", store, "--no-progress", "--jobs", "2")
    assert proc.returncode == 1, proc.stderr
    assert_no_traceback(proc)
    lines = proc.stdout.splitlines()
    assert [ln.split(":")[0] for ln in lines] == [f"DAMAGED {p}" for p in sorted(damaged)]
    assert all("fails its checksum" in ln or "cannot be decoded" in ln for ln in lines), lines
    assert proc.stderr.rstrip().endswith("2 damaged")


def test_verify_reports_every_file_of_a_truncated_partition(small_store, tmp_path):
    from fanstore.format.index import read_index

    store = copy_store(small_store, tmp_path / "s")
    index = read_index(str(store))
    in_part0 = sorted(
        os.fsdecode(index.path(int(e))) for e in index.file_entries()
        if int(index.entries["count"][e])
        and int(index.chunks["part"][int(index.entries["first"][e])]) == 0)
    assert in_part0
    part = store / partition_name(0)
    os.truncate(part, part.stat().st_size - 1)
    proc = run_main("verify", store, "--no-progress")
    assert proc.returncode == 1
    lines = proc.stdout.splitlines()
    assert [ln.split(": ")[0] for ln in lines] == [f"DAMAGED {p}" for p in in_part0]
    assert all("partition is truncated" in ln for ln in lines)
    (part).unlink()
    proc = run_main("verify", store, "--no-progress")
    assert proc.returncode == 1
    assert [ln.split(": ")[0] for ln in proc.stdout.splitlines()] == [
        f"DAMAGED {p}" for p in in_part0]
    assert "is missing" in proc.stdout


@pytest.mark.parametrize("how", ["swap", "repeat"])
def test_verify_names_each_damaged_directory(small_store, tmp_path, how):
    """Names out of order or repeated (a valid checksum: the index loads) in two
    directories, the root one of them: one line each naming the directory and the store,
    exit 1; the files themselves are intact. ``cat`` of a file in one is one error line
    naming both; a file elsewhere reads."""
    store = copy_store(small_store, tmp_path / "s")
    damage_directory(store, "sub/deeper", how)
    damage_directory(store, "", how)
    proc = run_main("verify", store, "--no-progress")
    assert proc.returncode == 1, proc.stderr
    assert_no_traceback(proc)
    why = (f"directory of {store}: its names are not sorted, or one repeats (a lookup in "
           "it fails)")
    assert proc.stdout.splitlines() == [f"DAMAGED /: {why}", f"DAMAGED sub/deeper/: {why}"]
    assert proc.stderr.rstrip().endswith(": 2 damaged directories"), proc.stderr
    assert_cli_error(run_main("cat", store, "a.txt"), code=1,
                     contains=f"{store}: the names of directory / are not sorted")
    copy = copy_store(small_store, tmp_path / "t")
    damage_directory(copy, "sub/deeper", how)
    assert_cli_error(run_main("cat", copy, "sub/deeper/d.txt"), code=1,
                     contains=f"{copy}: the names of directory sub/deeper are not sorted")
    assert run_main("cat", copy, "sub/c.txt", check=True).stdout == "gamma\n"
    proc = run_main("verify", copy, "--no-progress")
    assert (proc.returncode, proc.stdout) == (1, f"DAMAGED sub/deeper/: {why}\n".replace(
        str(store), str(copy)))
    assert proc.stderr.rstrip().endswith(": 1 damaged directory"), proc.stderr


def test_verify_refuses_a_child_run_out_of_place_naming_it(small_store, tmp_path):
    """A directory's child run moved breaks the tree every reader walks: refused when the
    index is loaded (verify, cat, ls alike), one line naming the store and the directory."""
    store = copy_store(small_store, tmp_path / "s")
    damage_directory(store, "sub/deeper", "span")
    for args in (("verify", store, "--no-progress"), ("cat", store, "a.txt"), ("ls", store)):
        line = assert_cli_error(run_main(*args), code=1,
                                contains="directory child runs are not contiguous")
        assert f"{store}/{INDEX_NAME}: " in line and "(first at directory sub/deeper " in line


def test_cat_of_a_damaged_file_fails_with_one_line(small_store, tmp_path):
    store = copy_store(small_store, tmp_path / "s")
    damage_file(store, "b.bin", chunk=1)
    proc = run_main("cat", store, "b.bin", text=False)
    assert proc.returncode == 1
    err = proc.stderr.decode()
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert "b.bin: data fails its checksum" in err or "b.bin: data cannot be decoded" in err
    # It may have written the intact first chunk, never the damaged one.
    assert (tmp_path / "s").exists() and len(proc.stdout) <= 4096
    proc = run_main("cat", store, "a.txt", text=False, check=True)
    assert proc.stdout == b"alpha\n" * 100


# --------------------------------------------------------------------------- version, truncation


@pytest.mark.parametrize("cmd", [("info",), ("info", "--json"), ("ls",), ("cat", "a.txt"),
                                 ("verify", "--no-progress")])
def test_newer_format_version_exits_33(small_store, tmp_path, cmd):
    store = copy_store(small_store, tmp_path / "s")
    set_index_version(store, FORMAT_VERSION + 1)
    proc = run_main(cmd[0], store, *cmd[1:])
    line = assert_cli_error(proc, code=33, contains=f"store format v{FORMAT_VERSION + 1} is "
                                                    f"newer than this FanStore reads")
    assert "upgrade fanstore" in line
    assert proc.stdout == ""


def test_older_format_version_exits_32(small_store, tmp_path):
    store = copy_store(small_store, tmp_path / "s")
    set_index_version(store, 0)
    proc = run_main("info", store)
    assert_cli_error(proc, code=32, contains="no longer supported")


@pytest.mark.parametrize("keep", [30, -1])
def test_truncated_index_is_refused(small_store, tmp_path, keep):
    """(Every truncation length is covered in test_format; here: the CLI's one line.)"""
    store = copy_store(small_store, tmp_path / "s")
    idx = store / INDEX_NAME
    data = idx.read_bytes()
    idx.write_bytes(data[:keep] if keep >= 0 else data[:-1])
    for cmd in (("info",), ("cat", "a.txt")):
        proc = run_main(cmd[0], store, *cmd[1:])
        assert_cli_error(proc, code=1, contains="truncated")


def test_truncated_partition_is_refused_by_cat(small_store, tmp_path):
    store = copy_store(small_store, tmp_path / "s")
    part = store / partition_name(1)
    os.truncate(part, part.stat().st_size // 2)
    proc = run_main("cat", store, "a.txt")
    assert_cli_error(proc, code=1, contains="partition is truncated")


def test_garbage_index_is_not_a_store(tmp_path):
    (tmp_path / INDEX_NAME).write_bytes(b"this is not an index" * 10)
    proc = run_main("info", tmp_path)
    assert_cli_error(proc, code=1, contains="not a FanStore index (bad magic)")


# --------------------------------------------------------------------------- bad input


def _bad_inputs(tmp_path, src, store):
    afile = tmp_path / "afile"
    afile.write_bytes(b"x")
    empty = tmp_path / "emptydir"
    empty.mkdir(exist_ok=True)
    dest = tmp_path / "dest"
    return [
        ((), 2, "no command given"),
        (("frobnicate",), 2, "invalid choice"),
        (("pack",), 2, "required"),
        (("pack", src), 2, "required"),
        (("pack", src, dest, "--partitions", "0"), 2, "must be at least 1"),
        (("pack", src, dest, "--partitions", "many"), 2, "expected a whole number"),
        (("pack", src, dest, "--jobs", "-1"), 2, "must not be negative"),
        (("pack", src, dest, "--codec", "bogus"), 2, "--codec"),
        (("pack", src, dest, "--codec", "zstd:99"), 2, "--codec"),
        (("pack", src, dest, "--chunk-kb", "2"), 2, "chunk size must be between"),
        (("pack", src, dest, "--chunk-kb", "1000000"), 2, "chunk size must be between"),
        (("pack", src, dest, "--no-such-option"), 2, "unrecognized arguments"),
        (("pack", tmp_path / "missing", dest), 2, "does not exist"),
        (("info",), 2, "required"),
        (("info", tmp_path / "missing"), 1, "no such directory"),
        (("info", empty), 1, "not a FanStore store"),
        (("info", afile), 1, "cannot read index"),
        (("ls", store, "nope"), 1, "no such file or directory in the store"),
        (("ls", store, "a.txt/x"), 1, "a.txt/x: not a directory"),
        (("cat", store), 2, "required"),
        (("verify", empty), 1, "not a FanStore store"),
        (("verify", store, "--jobs", "x"), 2, "expected a whole number"),
        (("stats", empty), 1, "no FanStore daemon serves this mount point"),
        (("umount", empty), 1, "is not mounted"),
        (("umount", empty, "--timeout", "0"), 2, "must be positive"),
        (("mount", store), 2, "required"),
        (("mount", store, empty, "--cache-mb", "-5"), 2, "must not be negative"),
        (("wait", empty, "--timeout", "0.2"), 1, "not ready after"),
    ]


def test_bad_input_exits_nonzero_with_one_line(small_tree, small_store, tmp_path):
    src = small_tree[0]
    for i, (args, code, message) in enumerate(_bad_inputs(tmp_path, src, small_store)):
        # Every fourth, and every mount, as the command (its exit and stream for real);
        # the rest through the same main in this process (0.1-0.3 s of CPU less each).
        proc = run_cli(*args) if i % 4 == 0 or args[0] == "mount" else run_main(*args)
        try:
            assert_cli_error(proc, code=code, contains=message)
        except AssertionError as exc:
            raise AssertionError(f"fanstore {' '.join(map(str, args))}: {exc}") from None
        assert proc.stdout == "", args
    assert not (tmp_path / "dest").exists()


def test_help_and_version():
    proc = run_main("--help", check=True)
    for cmd in ("pack", "mount", "umount", "stats", "verify", "info", "ls", "cat"):
        assert cmd in proc.stdout
    proc = run_main("pack", "--help", check=True)
    assert "--skip-unreadable" in proc.stdout and "--force" in proc.stdout
    proc = run_main("--version", check=True)
    assert re.fullmatch(r"fanstore \d+\.\d+\.\d+\S*\n", proc.stdout)


def test_debug_flag_shows_the_traceback(tmp_path):
    proc = run_main("--debug", "info", tmp_path / "missing")
    assert proc.returncode == 1
    assert "Traceback" in proc.stderr and "NotAStoreError" in proc.stderr


@pytest.mark.parametrize("var, value, message", [
    ("FANSTORE_MPI_PIECE", "lots", "$FANSTORE_MPI_PIECE must be 0"),
    ("FANSTORE_MPI_PIECE", "12", "of at least 64"),
    ("FANSTORE_FRONTEND", "fusepy", "$FANSTORE_FRONTEND must be one of auto, kernel, pyfuse3"),
    ("FANSTORE_FUSE_FLAGS", "DO_READDIRPLUS", "is not +NAME or -NAME"),
])
def test_a_bad_environment_variable_is_one_line_and_status_2(tmp_path, var, value, message):
    """The environment is read once, at the start, into typed settings: a bad value is
    refused there, whatever the command, never replaced by a default."""
    proc = run_cli("info", tmp_path, env={var: value})
    assert_cli_error(proc, code=2, contains=message)


def test_mount_switches_are_checked_at_the_edge(tmp_path, small_store):
    proc = run_cli("mount", small_store, tmp_path / "m", "--fuse-flags=-NO_SUCH_FLAG")
    assert proc.returncode == 2 and "bad flag edit '-NO_SUCH_FLAG'" in proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "m").exists()
