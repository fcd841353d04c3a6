"""Faults and bad input: nothing lost, no hang, a clear error.

Bad input that other test files already cover is not repeated here (docs/reliability.md has
the full table, with where each case is tested). This file fills the gaps:

- packing: names with newlines, a file growing while it is packed (through the CLI), SIGINT
  during a pack, a leftover of a killed pack (never mountable), the disk filling up while
  the index is written;
- opening a store: a missing partition, hostile indexes refused by ``fanstore mount`` (and
  every other command) with one line naming the problem and the index;
- a daemon SIGKILLed while readers are busy on the other ranks, with and without replicas;
- staging SIGKILLed halfway and restarted; local storage too small, or filling up during a
  copy; one rank out of space in a multi-rank job;
- bit rot in a staged copy, without replicas (EIO for those files only) and with them (a
  transparent re-fetch from the peer); ``fanstore verify --local-dir`` lists the files.
"""

from __future__ import annotations

import errno
import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from fanstore.daemon import stagecheck, stagecopy, staging
from fanstore.daemon.placement import owners
from fanstore.daemon.jobenv import node_name
from fanstore.errors import StageError
from fanstore.format.index import (
    INDEX_NAME,
    KIND_DIR,
    KIND_FILE,
    KIND_SYMLINK,
    encode_index,
    lookup_table,
    read_index,
)
from fanstore.format.partition import partition_name
from fanstore.namespace import Namespace
from fanstore.pack.dest import TMP_MARK
from fanstore.store import LocalStore
from helpers import (
    FANSTORE,
    MiB,
    assert_cli_error,
    assert_no_traceback,
    assert_same_tree,
    cleanup_mount,
    collect_readers,
    copy_store,
    daemon_log,
    daemon_pid,
    files_by_partition,
    flip_bytes,
    fuse_available,
    is_mounted,
    make_load_tree,
    make_small_tree,
    mount_store,
    pid_alive,
    run_cli,
    run_main,
    start_readers,
    stats_json,
    stored_extent,
    summarize_readers,
    tmpfs,
    wait_reading,
    wait_until,
)
from mpi_helpers import MpiJob, mpi_available, read_tree_bytes, wait_gone

#: The tests that read through a mount run once per FUSE frontend (conftest.frontend);
#: packing, staging and refusals happen before any frontend starts and run once. The
#: failures of MPI ranks are the daemons' to handle: those run on the default frontend
#: (the remote reads of both frontends are in test_mpi's TestFourRanks).
per_frontend = pytest.mark.usefixtures("frontend")
mpi_faults = pytest.mark.frontends("kernel")

_fuse_ok, _fuse_why = fuse_available()
_mpi_ok, _mpi_why = mpi_available()


def needs_cluster(f):
    for mark in (pytest.mark.fuse, pytest.mark.mpi,
                 pytest.mark.skipif(not (_fuse_ok and _mpi_ok), reason=_fuse_why or _mpi_why)):
        f = mark(f)
    return f


CHUNK = 64 << 10


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """(source, store, {rel: size}): 96 files (two of several MiB) packed into 8 partitions
    with 64 KiB chunks, so every partition holds about 1 MB and many files span chunks."""
    root = tmp_path_factory.mktemp("faults")
    src = root / "src"
    sizes = make_load_tree(src, n_files=96, big=2, seed=5)
    store = root / "store"
    # zstd:3 pinned: the staging tests size their file systems by these partitions.
    run_main("pack", src, store, "--partitions", "8", "--chunk-kb", "64", "--jobs", "2",
            "--codec", "zstd:3", "--no-progress", check=True)
    return src, store, sizes


def _no_leftovers(dest) -> bool:
    return not glob.glob(f"{dest}{TMP_MARK}*")


# =========================================================================== bad input: pack


@per_frontend
@pytest.mark.fuse
def test_names_with_newlines_pack_and_problems_stay_on_one_line(tmp_path, mounted):
    """A newline is a legal byte in a name: such files pack and mount exactly. A problem
    entry whose name holds a newline is reported on one line, escaped."""
    src, dest = tmp_path / "src", tmp_path / "store"
    files = {"dir\nwith newline/a\nb.txt": b"newline name\n", "tab\there.txt": b"tab\n",
             "plain.txt": b"plain\n", "trailing\n": b"x"}
    for rel, content in files.items():
        p = src / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(content)
    fifo = src / "bad\nfifo"
    os.mkfifo(fifo)
    proc = run_main("pack", src, dest, "--no-progress")
    assert_cli_error(proc, code=1, contains="1 entry cannot be packed")
    assert all(line.startswith("fanstore: ") for line in proc.stderr.splitlines()), proc.stderr
    problems = [ln for ln in proc.stderr.splitlines() if ln.startswith("fanstore: cannot pack ")]
    assert problems == [f"fanstore: cannot pack {src}/bad\\nfifo: FIFO cannot be packed "
                        "(not a regular file, directory or symlink)"]
    assert not dest.exists() and _no_leftovers(dest)

    fifo.unlink()
    run_main("pack", src, dest, "--no-progress", check=True)
    with LocalStore(str(dest)) as s:
        for rel, content in files.items():
            assert s.read_file(rel) == content, rel
    assert assert_same_tree(src, mounted(dest)) == len(files) + 1  # + the directory


def test_a_file_growing_during_the_pack_fails_it_cleanly(tmp_path):
    """A log being appended to while ``fanstore pack`` runs: one line naming the file, exit
    1, no store and no temporary directory; once it is quiet a re-run packs it."""
    src, dest = tmp_path / "src", tmp_path / "store"
    make_small_tree(src)
    log = src / "sub" / "growing.log"
    log.write_bytes(b"start\n" * 30_000)
    stop = threading.Event()

    def append() -> None:
        with open(log, "ab", buffering=0) as f:
            while not stop.is_set():
                f.write(b"another line of log\n" * 200)
                time.sleep(0.001)

    writer = threading.Thread(target=append)
    writer.start()
    try:
        proc = run_main("pack", src, dest, "--no-progress", "--jobs", "1", "--chunk-kb", "4")
    finally:
        stop.set()
        writer.join()
    line = assert_cli_error(proc, code=1, contains=str(log))
    assert "grew while being packed" in line or "changed size while being packed" in line
    assert not dest.exists() and _no_leftovers(dest)
    run_main("pack", src, dest, "--no-progress", check=True)
    with LocalStore(str(dest)) as s:
        assert s.read_file("sub/growing.log") == log.read_bytes()


def _slow_tree(root: Path) -> None:
    """Compressible files that take zstd:19 a few seconds with one job."""
    root.mkdir()
    for i in range(6):
        lines = b"".join(b"record %d of file %d: value %d\n" % (j, i, (j * 7919) % 100003)
                         for j in range(90_000))
        (root / f"f{i}.txt").write_bytes(lines)


def _start_slow_pack(src, dest) -> subprocess.Popen:
    """A pack that has started writing partitions, stopped (SIGSTOP to its group) so that it
    cannot finish before the test's signal however busy the machine; SIGCONT resumes it."""
    cmd = [FANSTORE, "pack", str(src), str(dest), "--jobs", "1", "--partitions", "3",
           "--codec", "zstd:19", "--no-progress"]
    # ^C as at a terminal, even where the test runs in a background job (which starts its
    # children with SIGINT ignored, as POSIX has it; the pack then rightly ignores it too)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        started = wait_until(lambda: glob.glob(f"{dest}{TMP_MARK}*/part-*.fsp"), timeout=30,
                             interval=0.01)
        assert started, "the pack never started writing a partition"
        os.killpg(proc.pid, signal.SIGSTOP)
        assert proc.poll() is None, "the pack finished before the fault; enlarge _slow_tree"
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate(timeout=30)
        raise
    return proc


def _assert_mount_refused(store, mnt, code: int, contains: str) -> str:
    mnt.mkdir(exist_ok=True)
    proc = run_cli("mount", store, mnt)
    line = assert_cli_error(proc, code=code, contains=contains)
    assert not is_mounted(mnt)
    assert not pid_alive(daemon_pid(mnt))
    return line


@pytest.mark.fuse  # the default frontend: the faults are the pack's, the mount only refuses
def test_sigint_during_pack_leaves_nothing_and_a_killed_pack_nothing_mountable(tmp_path,
                                                                               mounted):
    """Ctrl-C (SIGINT to the process group) during a pack: exit 130, one line, the temporary
    directory removed, nothing at DEST. A SIGKILLed pack leaves its temporary directory, which
    is not a store: it cannot be mounted, and DEST does not exist. A re-run succeeds."""
    src, dest = tmp_path / "src", tmp_path / "store"
    _slow_tree(src)
    proc = _start_slow_pack(src, dest)
    os.killpg(proc.pid, signal.SIGINT)
    os.killpg(proc.pid, signal.SIGCONT)
    out, err = proc.communicate(timeout=60)
    assert (proc.returncode, out, err) == (130, "", "fanstore: interrupted\n")
    assert not dest.exists() and _no_leftovers(dest)

    proc = _start_slow_pack(src, dest)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=60)
    leftovers = glob.glob(f"{dest}{TMP_MARK}*")
    assert len(leftovers) == 1 and not dest.exists()
    _assert_mount_refused(leftovers[0], tmp_path / "m1", 1, "not a FanStore store")
    _assert_mount_refused(dest, tmp_path / "m2", 1, "no such directory")

    proc = run_main("pack", src, dest, "--codec", "zstd:1", "--no-progress")
    assert proc.returncode == 0, proc.stderr
    assert f"removing leftover of an interrupted pack: {leftovers[0]}" in proc.stderr
    assert _no_leftovers(dest)
    m = mounted(dest)
    for i in range(6):
        assert (m / f"f{i}.txt").read_bytes() == (src / f"f{i}.txt").read_bytes()


def test_disk_full_while_writing_the_index_names_the_index(tmp_path):
    """The partitions fit but the index does not: one line naming the index file (not a bare
    "No space left on device"), exit 1, the file system left empty."""
    src = tmp_path / "src"
    src.mkdir()
    rng = np.random.default_rng(3)
    for i in range(5000):  # many entries: an index of about 75 KB
        (src / f"file-with-a-longish-name-{i:06d}.bin").write_bytes(
            rng.integers(0, 256, int(rng.integers(1, 2000)), dtype=np.uint8).tobytes())
    args = ("--partitions", "2", "--codec", "none", "--jobs", "1", "--no-progress")
    probe = tmp_path / "probe"
    run_main("pack", src, probe, *args, check=True)
    parts = sum(-(-os.path.getsize(probe / partition_name(p)) // 4096) * 4096 for p in (0, 1))
    index = os.path.getsize(probe / INDEX_NAME)
    assert index > 60 << 10
    with tmpfs(tmp_path / "full", f"{(parts >> 10) + 24}k") as full:
        proc = run_main("pack", src, full / "store", *args)
        line = assert_cli_error(proc, code=1, contains="no space left on device while writing")
        assert line.endswith(f"/{INDEX_NAME}") and f"{full}/store{TMP_MARK}" in line
        assert os.listdir(full) == []


# =========================================================================== bad input: open


def test_a_missing_partition_is_refused_and_verify_names_its_files(small_store, tmp_path):
    store = copy_store(small_store, tmp_path / "s")
    os.unlink(store / partition_name(1))
    lost = sorted(files_by_partition(small_store)[1])
    assert lost
    if _fuse_ok:
        _assert_mount_refused(store, tmp_path / "mnt", 1, "partition part-00001.fsp is missing")
    assert_cli_error(run_main("cat", store, lost[0]), code=1, contains="is missing")
    proc = run_main("verify", store, "--no-progress")
    assert proc.returncode == 1
    assert proc.stdout.splitlines() == [
        f"DAMAGED {rel}: partition part-00001.fsp is missing" for rel in lost]


@pytest.mark.parametrize("what", ["index", "partition"])
def test_a_fifo_in_the_store_is_refused_not_waited_on(small_store, tmp_path, what):
    """Before the fix, opening a FIFO named fanstore.idx or part-00001.fsp blocked every
    command forever (waiting for a writer)."""
    store = copy_store(small_store, tmp_path / "s")
    name = INDEX_NAME if what == "index" else partition_name(1)
    os.unlink(store / name)
    os.mkfifo(store / name)
    expect = f"{store}/{name}: " + ("the index is not a regular file" if what == "index"
                                    else "partition is not a regular file")
    for args in (("info",), ("cat", "a.txt"), ("verify", "--no-progress")):
        if what == "partition" and args[0] == "info":
            continue  # info reads only the index
        proc = run_main(args[0], store, *args[1:], timeout=30)
        if args[0] == "verify" and what == "partition":
            assert proc.returncode == 1 and "partition is not a regular file" in proc.stdout
            continue
        assert_cli_error(proc, code=1, contains=expect)
    if _fuse_ok:
        mnt = tmp_path / "mnt"
        mnt.mkdir()
        assert_cli_error(run_cli("mount", store, mnt, timeout=30), code=1, contains=expect)
        if what == "partition":  # staging copies from the store: refused there too
            proc = run_cli("mount", store, mnt, "--local-dir", tmp_path / "local", timeout=30)
            assert_cli_error(proc, code=1, contains=f"partition {store}/{name} on the shared "
                                                    "store is not a regular file")
        assert not is_mounted(mnt)


@pytest.mark.fuse
@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.skipif(not _mpi_ok, reason=_mpi_why)
def test_a_fifo_index_fails_a_multi_rank_mount_instead_of_hanging(small_store, tmp_path):
    store = copy_store(small_store, tmp_path / "s")
    os.unlink(store / INDEX_NAME)
    os.mkfifo(store / INDEX_NAME)
    job = MpiJob(store, tmp_path, ranks=2, wait=False)
    job.start()
    try:
        assert job.wait_exit(30) not in (0, None), "the job is still starting after 30 s"
        assert "the index is not a regular file" in job.output()
    finally:
        job.stop()


def test_verify_of_a_missing_local_dir_is_an_error_not_all_intact(small_store, tmp_path):
    """Before the fix a mistyped --local-dir verified nothing and exited 0 ("all intact")."""
    proc = run_main("verify", small_store, "--local-dir", tmp_path / "nope", "--no-progress")
    assert_cli_error(proc, code=1, contains=f"{tmp_path}/nope: no such directory")


def _hostile(store: Path, case: str) -> str:
    """Rewrite STORE's index with one hostile change (a valid checksum, so only validation
    can refuse it); returns the message expected."""
    index = read_index(str(store))
    e = {k: np.array(v) for k, v in index.entries.items()}
    c = {k: np.array(v) for k, v in index.chunks.items()}
    names, targets = bytes(index.names), bytes(index.targets)
    meta = {k: v for k, v in index.meta.items()
            if k not in ("columns", "n_entries", "n_chunks", "format_version")}
    kind = e["kind"]
    lookup = None  # format v3, as pack writes it
    a_dir = int(np.nonzero(kind == KIND_DIR)[0][1])
    link = int(np.nonzero(kind == KIND_SYMLINK)[0][0])
    multi = [int(x) for x in np.nonzero((kind == KIND_FILE) & (e["count"] > 1))[0]]
    single = [int(x) for x in np.nonzero((kind == KIND_FILE) & (e["count"] == 1))[0]]
    if case == "a NUL in a symlink target":  # (one that leads outside is kept: issue 35)
        e["first"][link], e["count"][link] = len(targets), 11
        e["size"][link] = 11
        targets += b"../etc\0/pwd"
        expect = "symlink target contains NUL"
    elif case == "a directory named '..'":
        e["name_off"][a_dir], e["name_len"][a_dir] = len(names), 2
        names += b".."
        expect = "named '.' or '..'"
    elif case == "an empty path component":
        e["name_len"][a_dir] = 0
        expect = "empty or over-long name"
    elif case == "a NUL in a name":
        e["name_off"][a_dir], e["name_len"][a_dir] = len(names), 3
        names += b"a\0b"
        expect = "contains '/' or NUL"
    elif case == "a name offset above 2**63":  # only the v1/v2 layout has 64-bit offsets
        e["name_off"] = e["name_off"].astype("<u8")
        e["name_len"] = e["name_len"].astype("<u2")
        lookup = lookup_table(e, names)
        e["name_off"][a_dir] = (1 << 64) - 1
        expect = "outside the name table"
    elif case == "a chunk past its partition":
        k = int(e["first"][single[0]])
        c["offset"][k] = index.partitions[int(c["part"][k])].size
        expect = "outside its partition"
    elif case == "overlapping chunks":
        k, k2 = int(e["first"][multi[0]]), int(e["first"][single[0]])
        c["part"][k2], c["offset"][k2] = c["part"][k], c["offset"][k]  # inside chunk k
        c["stored"][k2] = min(c["stored"][k2], c["stored"][k])
        expect = "overlap"
    elif case == "a decompression bomb":
        k = int(e["first"][single[0]])
        c["raw"][k] = 1 << 31
        e["size"][single[0]] = 1 << 31
        expect = "absurd raw size"
    else:
        raise AssertionError(case)
    data = encode_index(meta, e, c, lookup, names, targets)
    (store / INDEX_NAME).write_bytes(data)
    return expect


HOSTILE_CASES = ["a NUL in a symlink target", "a directory named '..'",
                 "an empty path component", "a NUL in a name", "a name offset above 2**63",
                 "a chunk past its partition", "overlapping chunks", "a decompression bomb"]


@pytest.mark.fuse
@pytest.mark.parametrize("case", HOSTILE_CASES)
def test_hostile_index_is_refused_by_mount(small_store, tmp_path, case):
    store = copy_store(small_store, tmp_path / "s")
    expect = _hostile(store, case)
    line = _assert_mount_refused(store, tmp_path / "mnt", 1, expect)
    assert f"{store}/{INDEX_NAME}" in line


def test_a_hostile_index_is_refused_by_every_command(small_store, tmp_path):
    store = copy_store(small_store, tmp_path / "s")
    expect = _hostile(store, "a NUL in a symlink target")
    for args in (("info",), ("ls",), ("cat", "a.txt"), ("verify", "--no-progress")):
        proc = run_main(args[0], store, *args[1:])
        line = assert_cli_error(proc, code=1, contains=expect)
        assert f"{store}/{INDEX_NAME}" in line, args
        assert proc.stdout == "", args


def test_info_of_an_index_with_partial_counts_is_not_an_internal_error(small_store, tmp_path):
    store = copy_store(small_store, tmp_path / "s")
    index = read_index(str(store))
    meta = {k: v for k, v in index.meta.items()
            if k not in ("columns", "n_entries", "n_chunks", "format_version")}
    meta["counts"] = {"raw_bytes": index.meta["counts"]["raw_bytes"]}
    (store / INDEX_NAME).write_bytes(encode_index(meta, index.entries, index.chunks, None,
                                                  index.names, index.targets))
    assert run_main("cat", store, "a.txt", check=True).stdout == "alpha\n" * 100
    proc = run_main("info", store)
    assert_no_traceback(proc)  # no "internal error" either
    assert proc.returncode == 0, proc.stderr


# =========================================================================== daemon killed


#: how a read may fail once a job without replicas ends itself after a node's death: the
#: mount goes (ENOTCONN/ECONNABORTED for requests it cuts, ENOENT after)
MOUNT_END_ERRORS = {"ENOENT", "ENOTCONN", "ECONNABORTED"}


def _kill_mid_read(data, tmp_path, replicas: bool, timeout: float = 2.0) -> dict:
    """4 ranks; 2 reader processes on each of ranks 0, 1, 3 read random files and ranges (no
    decoded-chunk cache: every read goes to a partition's owner); rank 2's daemon is
    SIGKILLed while they read. With replicas the survivors go on serving and are unmounted
    by the test; without, rank 2's partitions are lost and the job ends on every node by
    itself, naming node 2 (issue 44). Returns the reader totals."""
    src, store, sizes = data
    victim, survivors = 2, [0, 1, 3]
    n_ranks, k = 4, 2 if replicas else 1
    by_part = files_by_partition(store)
    lost_parts = {p for p in by_part if set(owners(p, n_ranks, k)) == {victim}}
    lost = {rel for p in lost_parts for rel in by_part[p]}
    assert bool(lost) != replicas
    extra = ["--remote-timeout", str(timeout), "--cache-mb", "0"]
    if replicas:
        extra += ["--replicas", "2"]
    marker = tmp_path / "killed"
    seconds = 1.5 + timeout + 2  # reads go on 2 s past the remote timeout of the kill
    with MpiJob(store, tmp_path, ranks=n_ranks, extra=extra) as job:
        readers = start_readers(6, lambda i: [job.mnt(survivors[i % 3])], src, sizes, seconds,
                                seed=7, chunk=CHUNK, may_fail=lost, marker=marker,
                                stop_on_error=not replicas, reading=tmp_path / "reading")
        try:
            wait_reading(readers)  # the kill lands mid-read
            pids = job.kill_node(victim)  # the daemon and the node's worker ranks
            marker.touch()
            assert wait_until(lambda: not any(pid_alive(p) for p in pids), 10)
        finally:
            results = collect_readers(readers, timeout=seconds + timeout + 30,
                                      mounts=[job.mnt(r) for r in survivors])
        total = summarize_readers(results)
        assert total["wrong"] == [], total["wrong"]
        assert total["eio_files"] <= lost
        assert total["max_latency"] < timeout + 5, f"a read took {total['max_latency']:.1f} s"
        if not replicas:
            # rank 2's partitions have no other holder: the job ends by itself, naming it
            assert set(total["errors"]) <= MOUNT_END_ERRORS, total["error_samples"]
            assert job.wait_exit(30) not in (None, 0), job.output()[-3000:]
            assert f"node {victim} died (no answer to pings)" in job.output()
            assert wait_gone([job.mnt(r) for r in range(n_ranks)], 30)
            print(f"\nSIGKILL of rank {victim} mid-read (no replica): {total['reads']:,} "
                  f"reads, 0 wrong, {total['expected_eio']} EIO on the lost files, errors "
                  f"{total['errors']}; the job ended by itself")
            return total
        assert total["errors"] == {}, (total["error_samples"], job.output()[-3000:])
        assert total["expected_eio"] == 0
        # The other files kept working after the kill, for every reader; nothing hung.
        assert all(r["after_marker_ok"] > 0 for r in results), results
        stats = {r: job.stats(r) for r in survivors}
        # the survivors noticed (the daemon itself, or its worker ranks, which serve the
        # kernel frontend's reads)
        assert any(victim in s["dead_ranks"] or s["peers_marked_dead"] > 0
                   for s in stats.values()), stats
        assert sum(s["errors"] for s in stats.values()) == 0, stats
        # `fanstore umount` works on the survivors and on the dead rank's stale mount.
        for r in survivors:
            res = run_main("umount", job.mnt(r), timeout=90)
            assert res.returncode == 0, res.stderr
        assert wait_gone([job.mnt(r) for r in survivors], 60), job.output()[-3000:]
        # The dead node's frontend unmounted when its daemon died (issue 44).
        assert wait_gone([job.mnt(victim)], 10)
        assert job.wait_exit(60) is not None, "mpiexec did not end"
    print(f"\nSIGKILL of rank {victim} mid-read (2 replicas): "
          f"{total['reads']:,} reads, {total['bytes_checked'] / 1e6:,.0f} MB checked, 0 wrong, "
          f"0 unexpected errors, {total['expected_eio']} EIO on {len(total['eio_files'])} of the "
          f"{len(lost)} lost files, {total['after_marker_ok']:,} good reads after the kill, "
          f"failovers {sum(s['remote_failovers'] for s in stats.values())}, max latency "
          f"{total['max_latency']:.2f} s")
    total["stats"] = stats
    return total


@per_frontend
@needs_cluster
@mpi_faults
def test_sigkill_mid_read_with_replicas_readers_fail_over(data, tmp_path):
    src, store, _ = data
    total = _kill_mid_read(data, tmp_path / "job1", replicas=True)
    assert total["reads"] > 200 and total["bytes_checked"] > 10 * MiB
    # Reads that were waiting on the victim failed over (usually a few; none when the ping
    # marked it dead before any read asked it, so this is reported, not required).
    print(f"remote failovers: {sum(s['remote_failovers'] for s in total['stats'].values())}")
    # A new job on the same mount points (the dead rank's included) serves everything.
    with MpiJob(store, tmp_path / "job1", ranks=4) as job:
        for rank in (0, 2):
            ok, wrong, errors = read_tree_bytes(src, job.mnt(rank))
            assert (ok, wrong, errors) == (96, [], [])


@per_frontend
@needs_cluster
@mpi_faults
def test_sigkill_mid_read_without_replicas_ends_the_job(data, tmp_path, mounted):
    src, store, _ = data
    total = _kill_mid_read(data, tmp_path / "job", replicas=False)
    assert total["reads"] > 20
    # The dead rank's mount point takes a new (single-node) mount at once.
    m = mounted(store, mnt=tmp_path / "job" / "mnt2")
    ok, wrong, errors = read_tree_bytes(src, m)
    assert (ok, wrong, errors) == (96, [], [])


@per_frontend
@needs_cluster
@pytest.mark.slow
def test_repeated_kills_of_different_ranks_with_replicas(data, tmp_path):
    """Three rounds: a fresh 4-rank job with 2 replicas, a different rank killed under
    readers each time; every round reads right, and the next job starts cleanly."""
    src, store, sizes = data
    for victim in (1, 3, 0):
        survivors = [r for r in range(4) if r != victim]
        work = tmp_path / f"round{victim}"
        with MpiJob(store, work, ranks=4,
                    extra=["--replicas", "2", "--remote-timeout", "2", "--cache-mb", "0"]) as job:
            readers = start_readers(6, lambda i: [job.mnt(survivors[i % 3])], src, sizes, 8,
                                    seed=victim, chunk=CHUNK, reading=work / "reading")
            try:
                wait_reading(readers)  # the kill lands mid-read
                job.kill_node(victim)
            finally:
                total = summarize_readers(collect_readers(
                    readers, timeout=60, mounts=[job.mnt(r) for r in survivors]))
            assert (total["wrong"], total["errors"]) == ([], {}), total["error_samples"]
            assert total["max_latency"] < 7, f"a read took {total['max_latency']:.1f} s"
            for r in survivors:
                ok, wrong, errors = read_tree_bytes(src, job.mnt(r))
                assert (ok, wrong, errors) == (96, [], [])


# =========================================================================== staging

_STAGE_AND_DIE = textwrap.dedent("""
    import os, signal, sys
    import xxhash
    from fanstore.daemon import stagecopy, staging
    from fanstore.format.index import read_index

    store, local, kill_after = sys.argv[1], sys.argv[2], int(sys.argv[3])
    stagecopy.BLOCK = 64 << 10  # many blocks per partition: the kill lands inside a copy

    class DyingHash:
        copied = 0

        def __init__(self):
            self._h = xxhash.xxh3_128()

        def update(self, block):
            DyingHash.copied += len(block)
            if DyingHash.copied > kill_after:
                os.kill(os.getpid(), signal.SIGKILL)  # the node dies mid-copy
            self._h.update(block)

        def hexdigest(self):
            return self._h.hexdigest()

    class Shim:
        xxh3_128 = DyingHash

    stagecopy.xxhash = Shim
    index = read_index(store)
    staging.stage_partitions(store, local, index, list(range(len(index.partitions))), jobs=1,
                             who="rank 0 (test)")
    print("finished without being killed")
""")


@per_frontend
@pytest.mark.fuse
def test_staging_killed_halfway_then_restarted_copies_only_what_is_missing_or_damaged(
        data, tmp_path, mounted):
    src, store, _ = data
    index = read_index(str(store))
    sizes = [p.size for p in index.partitions]
    local = tmp_path / "local"
    kill_after = sum(sizes[:3]) + sizes[3] // 2
    proc = subprocess.run([sys.executable, "-c", _STAGE_AND_DIE, str(store), str(local),
                           str(kill_after)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stdout + proc.stderr
    names = sorted(os.listdir(local))
    assert names == sorted([partition_name(p) for p in range(3)]
                           + [partition_name(p) + ".ok" for p in range(3)]
                           + ["." + partition_name(3) + ".partial"])
    assert 0 < os.path.getsize(local / ("." + partition_name(3) + ".partial")) < sizes[3]
    # Since then: bit rot in copy 1 (its .ok record is now stale), copy 2 touched but intact.
    flip_bytes(local / partition_name(1), sizes[1] // 2, 8)
    os.utime(local / partition_name(2), ns=(1, 1))
    inode = {p: os.stat(local / partition_name(p)).st_ino for p in range(3)}

    m = mounted(store, "--local-dir", local, "--keep-local")
    stats = stats_json(m)
    redo = [1, 3, 4, 5, 6, 7]
    assert (stats["staged_partitions"], stats["reused_partitions"]) == (len(redo), 2)
    assert stats["staged_bytes"] == sum(sizes[p] for p in redo)
    assert os.stat(local / partition_name(0)).st_ino == inode[0]  # reused, not rewritten
    assert os.stat(local / partition_name(2)).st_ino == inode[2]  # re-hashed, reused
    assert os.stat(local / partition_name(1)).st_ino != inode[1]  # damaged: copied again
    assert not [n for n in os.listdir(local) if n.endswith(".partial")]
    ok, wrong, errors = read_tree_bytes(src, m)
    assert (ok, wrong, errors) == (96, [], [])
    proc = run_main("verify", store, "--local-dir", local, "--no-progress")
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.fuse
def test_local_storage_too_small_names_the_node_and_the_bytes(data, tmp_path):
    _, store, _ = data
    need = sum(p.size for p in read_index(str(store)).partitions)
    with tmpfs(tmp_path / "local", "1m") as local:
        mnt = tmp_path / "mnt"
        mnt.mkdir()
        proc = run_cli("mount", store, mnt, "--local-dir", local)
        line = assert_cli_error(proc, code=1, contains="is too small")
        assert f"rank 0 ({node_name()}): local storage {local} is too small: 8 partitions need " \
               f"{need:,} bytes" in line
        assert not is_mounted(mnt) and not pid_alive(daemon_pid(mnt))
        assert os.listdir(local) == []


def test_a_full_dev_shm_moves_the_index_copy_to_the_runtime_directory(data, tmp_path,
                                                                     monkeypatch):
    """/dev/shm full (other jobs of the node filled it): the mount goes on with its index
    copy in the runtime directory, says so in one log line, reads every file exactly,
    and leaves nothing in either place once unmounted (the leak check sees the rest)."""
    src, store, files = data
    with tmpfs(tmp_path / "shm", "64k") as shm:
        filler = shm / "other-job"
        with open(filler, "wb", buffering=0) as f:  # fill it to the last block
            try:
                while True:
                    f.write(b"\0" * 4096)
            except OSError as exc:
                assert exc.errno == errno.ENOSPC
        monkeypatch.setenv("FANSTORE_SHM_DIR", str(shm))
        mnt = tmp_path / "mnt"
        mount_store(store, mnt)
        try:
            log = daemon_log(mnt)
            lines = [x for x in log.splitlines() if "has no room for the node's index copy" in x]
            assert len(lines) == 1 and str(shm) in lines[0] and "No space left" in lines[0], log
            assert sorted(os.listdir(shm)) == ["other-job"]  # no partial copy left there
            for rel in files:
                assert (mnt / rel).read_bytes() == (src / rel).read_bytes(), rel
        finally:
            cleanup_mount(mnt)
        assert sorted(os.listdir(shm)) == ["other-job"]


def test_local_storage_filling_up_during_a_copy(data, tmp_path, monkeypatch):
    """The free-space check passes, then another job fills the disk: the copy that hits
    ENOSPC fails with one message naming the node, the partition and the bytes it needed;
    no partial copy is left, and the copy that completed stays, verified, for a restart."""
    _, store, _ = data
    index = read_index(str(store))
    sizes = [p.size for p in index.partitions]
    real = shutil.disk_usage

    with tmpfs(tmp_path / "local", "5m") as local:
        def usage_then_fill(path):
            u = real(path)
            with open(local / "someone-else", "wb") as f:  # room for partition 0 only
                f.write(b"\0" * (u.free - sizes[0] - (256 << 10)))
            return u

        monkeypatch.setattr(staging.shutil, "disk_usage", usage_then_fill)
        with pytest.raises(StageError) as exc:
            staging.stage_partitions(str(store), str(local), index, [0, 1, 2], jobs=1,
                                     who="rank 5 (node17)")
        assert str(exc.value) == (
            f"rank 5 (node17): local storage full while staging {partition_name(1)} "
            f"({sizes[1]:,} bytes needed) into {local}")
        assert sorted(os.listdir(local)) == [partition_name(0), partition_name(0) + ".ok",
                                             "someone-else"]
        assert stagecheck.valid_copy(str(local / partition_name(0)), sizes[0],
                                   index.partitions[0].checksum)


@pytest.mark.fuse
@pytest.mark.parametrize("where", ["a file", "below a file"])
def test_a_local_dir_that_cannot_be_used_is_a_clear_error(data, tmp_path, where):
    """Before the fix: FileExistsError / NotADirectoryError escaped staging and the mount
    failed with "internal error" (exit 70)."""
    _, store, _ = data
    (tmp_path / "afile").write_bytes(b"x")
    local = tmp_path / "afile" if where == "a file" else tmp_path / "afile" / "sub"
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    proc = run_cli("mount", store, mnt, "--local-dir", local)
    why = "File exists" if where == "a file" else "Not a directory"
    assert_cli_error(proc, code=1,
                     contains=f"rank 0 ({node_name()}): cannot use local storage {local}: {why}")
    assert not is_mounted(mnt)


def test_a_damaged_ok_record_means_a_rehash_not_a_crash(data, tmp_path):
    """A .ok record that is not a JSON object (before the fix: AttributeError, "internal
    error") or not JSON at all: the copy is re-hashed and reused if intact."""
    _, store, _ = data
    index = read_index(str(store))
    local = tmp_path / "local"
    staging.stage_partitions(str(store), str(local), index, [0, 1], who="rank 0 (t)")
    (local / (partition_name(0) + ".ok")).write_text("[1, 2]")
    (local / (partition_name(1) + ".ok")).write_bytes(b"\xff\x00garbage")
    report = staging.stage_partitions(str(store), str(local), index, [0, 1, 2],
                                      who="rank 0 (t)")
    assert (report.reused, report.copied) == ([0, 1], [2])
    record = json.loads((local / (partition_name(0) + ".ok")).read_text())
    assert record["checksum"] == index.partitions[0].checksum


def _damaged_store(store, tmp_path):
    """A copy of ``store`` whose partition 1 has 8 bytes flipped, partition 2 lost its last
    byte and partition 3 has one byte too many; partition 0 is intact."""
    bad = tmp_path / "bad-store"
    shutil.copytree(store, bad)
    size1 = os.path.getsize(bad / partition_name(1))
    flip_bytes(bad / partition_name(1), size1 // 2, 8)
    os.truncate(bad / partition_name(2), os.path.getsize(bad / partition_name(2)) - 1)
    with open(bad / partition_name(3), "ab") as f:
        f.write(b"\0")
    return bad


def _refuse_direct_io(monkeypatch, where: str) -> list[str]:
    """Make the local file system refuse direct I/O: when O_DIRECT is asked for (``open``)
    or on the first direct write (``write``, as a file system that accepts the flag but
    not the alignment). Returns a log of what was refused."""
    refused: list[str] = []
    if where == "open":
        real_fcntl = stagecopy.fcntl.fcntl

        def fcntl(fd, cmd, arg=0):
            if cmd == stagecopy.fcntl.F_SETFL and arg & stagecopy._O_DIRECT:
                refused.append("open")
                raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
            return real_fcntl(fd, cmd, arg)

        monkeypatch.setattr(stagecopy.fcntl, "fcntl", fcntl)
    else:
        real_pwrite = os.pwrite

        def pwrite(fd, data, offset):
            if stagecopy.fcntl.fcntl(fd, stagecopy.fcntl.F_GETFL) & stagecopy._O_DIRECT:
                refused.append("write")
                raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
            return real_pwrite(fd, data, offset)

        monkeypatch.setattr(stagecopy.os, "pwrite", pwrite)
    return refused


def _count_direct_writes(monkeypatch) -> list[str]:
    """Log every write staging makes with O_DIRECT on."""
    seen: list[str] = []
    real_pwrite = os.pwrite

    def pwrite(fd, data, offset):
        if stagecopy.fcntl.fcntl(fd, stagecopy.fcntl.F_GETFL) & stagecopy._O_DIRECT:
            seen.append("direct")
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(stagecopy.os, "pwrite", pwrite)
    return seen


def _direct_io_works(where) -> bool:
    try:
        fd = os.open(os.path.join(where, "probe"), os.O_WRONLY | os.O_CREAT | os.O_DIRECT)
    except OSError:
        return False
    os.close(fd)
    return True


@pytest.mark.parametrize("direct", ["used", "refused at open", "refused at the first write"])
def test_a_damaged_or_short_source_is_never_installed(data, tmp_path, monkeypatch, direct):
    """Every copy is checked (size and XXH3-128 against the index) before it is installed,
    whichever way it was written (direct I/O, or the page cache where the local file system
    refuses it): one line naming the partition and what is wrong; no copy, no partial
    copy, no record is left for it; an intact partition staged beside it is installed."""
    _, store, _ = data
    index = read_index(str(store))
    sizes = [p.size for p in index.partitions]
    bad = _damaged_store(store, tmp_path)
    monkeypatch.setattr(stagecopy, "BLOCK", 64 << 10)  # many blocks per partition, and a tail
    if direct == "used":
        refused = _count_direct_writes(monkeypatch)
    else:
        refused = _refuse_direct_io(monkeypatch, direct.split()[-1])
    local = tmp_path / "local"
    report = staging.stage_partitions(str(bad), str(local), index, [0], jobs=1, who="rank 3 (n)")
    assert report.copied == [0]
    assert stagecheck.valid_copy(str(local / partition_name(0)), sizes[0],
                               index.partitions[0].checksum)
    if direct != "used":
        assert refused, "the refusal was never exercised"
    elif _direct_io_works(tmp_path):
        assert refused == ["direct"] * (sizes[0] // (64 << 10)), refused
    for p, what in ((1, "checksum mismatch"), (2, f"{sizes[2] - 1:,} bytes, expected {sizes[2]:,}"),
                    (3, f"more than {sizes[3]:,} bytes, expected {sizes[3]:,}")):
        with pytest.raises(StageError) as exc:
            staging.stage_partitions(str(bad), str(local), index, [0, p], jobs=2,
                                     who="rank 3 (n)")
        assert str(exc.value) == (f"rank 3 (n): partition {bad}/{partition_name(p)} on the "
                                  f"shared store is damaged ({what}); repack or restore it")
        assert sorted(os.listdir(local)) == [partition_name(0), partition_name(0) + ".ok"]


@pytest.mark.parametrize("size", [0, 100, 4096, 3 * (64 << 10), 3 * (64 << 10) + 1,
                                  3 * (64 << 10) - 4095])
def test_copies_of_every_size_are_exact(tmp_path, monkeypatch, size):
    """Whole blocks are written with direct I/O, an unaligned tail through the page cache;
    empty, sub-page, page-sized, block-multiple and block-plus-a-byte sources all arrive
    byte for byte, with the file's own checksum."""
    import xxhash

    monkeypatch.setattr(stagecopy, "BLOCK", 64 << 10)
    content = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8).tobytes()
    src = tmp_path / "src.fsp"
    src.write_bytes(content)
    (tmp_path / "local").mkdir(mode=0o700)
    dst = tmp_path / "local" / "part.fsp"
    checksum = xxhash.xxh3_128(content).hexdigest()
    assert stagecopy.copy_partition(str(src), str(dst), size, checksum, "rank 0 (t)") == size
    assert dst.read_bytes() == content
    assert stagecheck.valid_copy(str(dst), size, checksum)


@needs_cluster
def test_one_rank_out_of_local_space_fails_every_rank_with_its_message(data, tmp_path):
    _, store, _ = data
    with tmpfs(tmp_path / "local1", "512k"):
        job = MpiJob(store, tmp_path, ranks=2, wait=False)
        job.start()
        try:
            code = job.wait_exit(90)
            out = job.output()
            assert code not in (0, None), out
            assert f"rank 1 ({node_name()}): local storage {tmp_path}/local1 is too small" in out
            # node 0 stops with node 1's reason (the start-up gate's verdict)
            assert (f"rank 0 ({node_name()}): not starting: node 1 ({node_name()}): local "
                    f"storage {tmp_path}/local1 is too small") in out, out
            assert "Traceback" not in out
            assert not any(is_mounted(job.mnt(r)) for r in range(2))
        finally:
            job.stop()


# =========================================================================== bit rot


def _rot(store, local, rels_chunks) -> None:
    """Flip 8 bytes in the middle of the given chunks of the staged copies in ``local``."""
    for rel, chunk in rels_chunks:
        part, offset, length = stored_extent(store, rel, chunk)
        n = min(8, length)
        flip_bytes(Path(local) / os.path.basename(part), offset + (length - n) // 2, n)


def _victims(store) -> list[tuple[str, int]]:
    """Two files of partition 3: a one-chunk file (chunk 0) and a multi-chunk one (its
    second chunk)."""
    index = read_index(str(store))
    ns = Namespace(index)
    one = multi = None
    for rel in files_by_partition(store)[3]:
        count = int(index.entries["count"][ns.resolve(rel)])
        if count == 1 and one is None:
            one = (rel, 0)
        elif count > 2 and multi is None:
            multi = (rel, 1)
    assert one and multi
    return [one, multi]


@per_frontend
@pytest.mark.fuse
def test_bit_rot_in_a_staged_copy_gives_eio_for_those_files_only(data, tmp_path, mounted):
    src, store, sizes = data
    local = tmp_path / "local"
    m = mounted(store, "--local-dir", local, "--keep-local", "--cache-mb", "0")
    victims = _victims(store)
    _rot(store, local, victims)
    bad = {rel for rel, _ in victims}
    for rel in sizes:
        path = m / rel
        if rel in bad:
            with pytest.raises(OSError) as exc:
                path.read_bytes()
            assert exc.value.errno == errno.EIO, rel
        else:
            assert path.read_bytes() == (src / rel).read_bytes(), rel
    # The intact first chunk of the multi-chunk victim still reads exactly.
    multi = victims[1][0]
    fd = os.open(m / multi, os.O_RDONLY | os.O_DIRECT)
    try:
        assert os.pread(fd, CHUNK, 0) == (src / multi).read_bytes()[:CHUNK]
    finally:
        os.close(fd)
    stats = stats_json(m)
    assert stats["errors"] >= len(victims) and stats["refetched_from_replica"] == 0
    proc = run_main("verify", store, "--local-dir", local, "--no-progress")
    assert proc.returncode == 1
    assert [ln.split(": ")[0] for ln in proc.stdout.splitlines()] == \
        [f"DAMAGED {rel}" for rel in sorted(bad)]
    assert run_main("verify", store, "--no-progress").returncode == 0  # the shared copy is fine


@per_frontend
@needs_cluster
@mpi_faults
def test_bit_rot_with_replicas_is_refetched_from_a_peer(data, tmp_path):
    src, store, _ = data
    with MpiJob(store, tmp_path, ranks=2,
                extra=["--replicas", "2", "--cache-mb", "0"]) as job:
        victims = _victims(store)
        _rot(store, job.local_dir(0), victims)
        ok, wrong, errors = read_tree_bytes(src, job.mnt(0))
        assert (ok, wrong, errors) == (96, [], [])
        stats = job.stats(0)
        assert stats["errors"] == 0
        assert stats["refetched_from_replica"] >= len(victims)
        proc = run_main("verify", store, "--local-dir", job.local_dir(0), "--no-progress")
        assert proc.returncode == 1
        assert sorted(ln.split(": ")[0] for ln in proc.stdout.splitlines()) == \
            sorted(f"DAMAGED {rel}" for rel, _ in victims)
        proc = run_main("verify", store, "--local-dir", job.local_dir(1), "--no-progress")
        assert proc.returncode == 0, proc.stdout
