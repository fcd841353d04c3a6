"""Replicas to the local budget: ``--replicas auto``, ``--local-capacity``, ``info``/``select``.

Known answers for the pure sizing (fanstore/daemon/replicas.py), checked against the
placement rule itself; the mount's decision with a stand-in world and a real small tmpfs;
the CLI; and real processes: a single-node mount and 4-rank ``mpiexec`` jobs whose local
directories and ``fanstore stats`` show what was kept.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
from helpers import (
    assert_cli_error,
    daemon_log,
    fuse_available,
    is_mounted,
    run_cli,
    run_main,
    stats_json,
    tmpfs,
)
from mpi_helpers import MpiJob, mpi_available, read_tree_bytes

from fanstore.daemon import placement as pl
from fanstore.daemon import replicas as R
from fanstore.daemon.stagecheck import record_ok, staged_copies
from fanstore.errors import StageError
from fanstore.format.index import read_index
from fanstore.format.partition import partition_name
from fanstore.units import parse_size, show_size

_fuse_ok, _fuse_why = fuse_available()
_mpi_ok, _mpi_why = mpi_available()
needs_fuse = [pytest.mark.fuse, pytest.mark.skipif(not _fuse_ok, reason=_fuse_why)]
needs_cluster = needs_fuse + [pytest.mark.mpi,
                              pytest.mark.skipif(not _mpi_ok, reason=_mpi_why)]

# --------------------------------------------------------------------------- pure sizing


def brute_force(sizes, flags, n, k) -> list[int]:
    """Bytes per node, straight from the placement table."""
    table = pl.placement(flags, n, k)
    return [sum(sizes[p] for p in pl.local_partitions(table, r)) for r in range(n)]


def test_node_bytes_follow_the_placement_rule():
    rng = random.Random(5)
    for _ in range(200):
        parts, n = rng.randint(1, 20), rng.randint(1, 9)
        sizes = [rng.randint(0, 1000) for _ in range(parts)]
        flags = [rng.random() < 0.2 for _ in range(parts)]
        fullest = R.fullest_bytes(sizes, flags, n)
        for k in range(1, n + 1):
            per_node = brute_force(sizes, flags, n, k)
            assert fullest[k - 1] == max(per_node)
            for r in range(n):
                assert R.node_bytes(sizes, flags, n, r)[k - 1] == per_node[r]
        capacity = rng.randint(0, 12000)
        fitting = [k for k in range(1, n + 1) if max(brute_force(sizes, flags, n, k)) <= capacity]
        assert R.fit(sizes, flags, n, capacity).replicas == max(fitting, default=0)


def test_equal_partitions_exactly_at_the_boundary():
    sizes, flags = [10] * 8, [False] * 8  # 4 nodes: 20 per node and copy
    assert [R.fit(sizes, flags, 4, c).replicas for c in (19, 20, 39, 40, 59, 60, 79, 80, 10**9)] \
        == [0, 1, 1, 2, 2, 3, 3, 4, 4]
    f = R.fit(sizes, flags, 4, 80)
    assert f.everywhere and f.node_bytes == 80 and f.next_bytes is None
    f = R.fit(sizes, flags, 4, 79)
    assert (f.replicas, f.node_bytes, f.next_bytes, f.one_copy) == (3, 60, 80, 20)


def test_unequal_partitions_the_fullest_node_decides_not_the_average():
    # T by p mod 4 = [20, 20, 20, 60]: with one copy node 3 holds 60 (the average is 30);
    # with two, nodes 0 (p 0, 4, 3, 7) and 3 hold 80 (the average is 60).
    sizes, flags = [10] * 7 + [50], [False] * 8
    assert R.fullest_bytes(sizes, flags, 4) == [60, 80, 100, 120]
    assert R.node_bytes(sizes, flags, 4, 1) == [20, 40, 100, 120]
    assert R.fit(sizes, flags, 4, 59).replicas == 0
    assert R.fit(sizes, flags, 4, 60).replicas == 1
    assert R.fit(sizes, flags, 4, 79).replicas == 1  # an average would say 2
    assert R.fit(sizes, flags, 4, 80).replicas == 2
    assert R.fit(sizes, flags, 4, 120).replicas == 4


def test_broadcast_partitions_count_on_every_node():
    # partition 4 is broadcast: 25 on both nodes whatever k, not on node 4 mod 2 only
    sizes, flags = [10, 10, 10, 10, 25], [False] * 4 + [True]
    assert R.fullest_bytes(sizes, flags, 2) == [45, 65]
    assert R.node_bytes(sizes, flags, 2, 1) == [45, 65]
    assert [R.fit(sizes, flags, 2, c).replicas for c in (44, 45, 64, 65)] == [0, 1, 1, 2]
    assert R.fit(sizes, flags, 2, 44).broadcast == 25
    # only broadcast partitions: every k costs the same, so all copies fit or none
    assert R.fit([7, 9], [True, True], 3, 16).replicas == 3
    assert R.fit([7, 9], [True, True], 3, 15).replicas == 0


def test_one_node_and_more_nodes_than_partitions():
    assert R.fit([5, 7, 9], [False] * 3, 1, 21).replicas == 1
    assert R.fit([5, 7, 9], [False] * 3, 1, 20).replicas == 0
    assert R.fit([5, 7, 9], [False] * 3, 1, 21).everywhere
    # 2 partitions on 4 nodes: one copy leaves two nodes empty, the fullest holds 7
    assert R.fullest_bytes([5, 7], [False, False], 4) == [7, 12, 12, 12]
    assert R.fit([5, 7], [False, False], 4, 12).replicas == 4
    assert R.fit([5, 7], [False, False], 4, 11).replicas == 1


def test_nodes_needed():
    sizes, flags = [10] * 8, [False] * 8
    assert R.nodes_needed(sizes, flags, 20) == 4
    assert R.nodes_needed(sizes, flags, 25, start=2) == 4  # 3 nodes: 30 on the fullest
    assert R.nodes_needed(sizes, flags, 9) is None  # no partition fits
    assert R.nodes_needed(sizes + [15], flags + [True], 25) == 8


def test_no_fit_message_says_what_is_needed_what_is_there_and_what_to_do():
    sizes, flags = [10 << 30] * 8, [False] * 8
    text = R.explain_no_fit(sizes, flags, 2, 40 << 30, 25 << 30, "available")
    assert text.startswith("the store does not fit: one copy needs 40 GiB on the fullest of "
                           "2 nodes, 25 GiB available; one copy fits on 4 nodes; use more "
                           "nodes, a bigger --local-dir (or --local-capacity), or a stronger "
                           "codec")
    text = R.explain_no_fit(sizes, flags, 8, 10 << 30, 5 << 30, "available")
    assert "no node count fits (a single partition is too big: pack more partitions)" in text
    text = R.explain_no_fit(sizes + [6 << 30], flags + [True], 8, 16 << 30, 5 << 30,
                            "available")
    assert "(6 GiB of it broadcast to every node)" in text
    assert "the broadcast partitions alone do not fit" in text


@pytest.mark.parametrize("text, value", [
    ("123456", 123456), ("500G", 500 << 30), ("1.5T", 3 << 39), ("800M", 800 << 20),
    ("800m", 800 << 20), ("2GiB", 2 << 30), ("2Gi", 2 << 30), ("2GB", 2 * 10**9),
    ("1.5KB", 1500), (".5K", 512), ("10 G", 10 << 30), ("7B", 7)])
def test_parse_size(text, value):
    assert parse_size(text) == value


@pytest.mark.parametrize("text", ["", "G", "x", "-1", "1.5", "5Q", "1e9", "1,000"])
def test_parse_size_refuses(text):
    with pytest.raises(ValueError):
        parse_size(text)


def test_show_size():
    assert [show_size(n) for n in (0, 1023, 1024, 1536, (1 << 20) - 1, 500 << 30, 3 << 39)] \
        == ["0 B", "1023 B", "1 KiB", "1.5 KiB", "1 MiB", "500 GiB", "1.5 TiB"]


# --------------------------------------------------------------------------- the decision


class Others:
    """A stand-in world: the other ranks' answers are ``others``; records every call."""

    def __init__(self, others: int | None = None) -> None:
        self.others = others
        self.calls: list[int] = []

    def all_min(self, value: int) -> int:
        self.calls.append(value)
        return value if self.others is None else min(value, self.others)


def fake_index(sizes, flags=None):
    flags = flags or [False] * len(sizes)
    return SimpleNamespace(partitions=[
        SimpleNamespace(number=p, size=s, broadcast=b, checksum=f"{p:032x}")
        for p, (s, b) in enumerate(zip(sizes, flags))])


def test_decide_an_integer_is_capped_at_the_nodes(caplog):
    world = Others()
    assert R.decide(2, fake_index([1] * 8), world, 0, 4) == 2
    with caplog.at_level(logging.WARNING):
        assert R.decide(9, fake_index([1] * 8), world, 0, 4) == 4
    assert "--replicas 9 is more than the 4 ranks; using 4" in caplog.text
    assert world.calls == []  # no collective for a number


def test_decide_auto_without_a_local_dir_is_one_copy(caplog):
    with caplog.at_level(logging.INFO):
        assert R.decide("auto", fake_index([1] * 8), Others(), 0, 4, None, 10**9) == 1
    assert "replicas auto: 1 copy (no --local-dir: nothing is staged" in caplog.text


def test_decide_auto_with_a_capacity(tmp_path, caplog):
    index = fake_index([10] * 7 + [50])  # node 3: 60, 80, 100, 120; node 1: 20, 40, 100, 120
    with caplog.at_level(logging.INFO):
        assert R.decide("auto", index, Others(), 3, 4, str(tmp_path), 79, "rank 3") == 1
    assert "rank 3: replicas auto: 1 copy (2 would need 80 B here): 60 B here, 79 B " \
           "available (--local-capacity)" in caplog.text
    assert R.decide("auto", index, Others(), 3, 4, str(tmp_path), 120) == 4
    caplog.clear()
    with caplog.at_level(logging.INFO):  # node 1 could hold 3; another rank only 2
        assert R.decide("auto", index, Others(2), 1, 4, str(tmp_path), 100, "rank 1") == 2
    assert "2 copies (another rank has room for no more): 40 B here" in caplog.text


def test_decide_auto_nothing_fits_fails_on_every_rank(tmp_path):
    index = fake_index([10] * 7 + [50])
    world = Others()
    with pytest.raises(StageError) as exc:
        R.decide("auto", index, world, 3, 4, str(tmp_path), 59, "rank 3")
    assert str(exc.value).startswith(
        "rank 3: replicas auto: the store does not fit: one copy needs 60 B on this node "
        "(one of 4), 59 B available (--local-capacity); one copy fits on 8 nodes; use more "
        "nodes")
    assert world.calls == [0]
    with pytest.raises(StageError, match="rank 1: replicas auto: another rank has no room "
                                         r"for one copy of its share \(see its message\)"):
        R.decide("auto", index, Others(0), 1, 4, str(tmp_path), 59, "rank 1")


def test_decide_auto_joins_the_collective_even_when_it_fails(tmp_path):
    world = Others()
    with pytest.raises(AttributeError):  # no index: a bug, raised after the collective
        R.decide("auto", None, world, 0, 2, str(tmp_path), 100)
    assert world.calls == [-1]
    with pytest.raises(StageError, match="another rank could not size its local storage"):
        R.decide("auto", fake_index([1, 1]), Others(-1), 0, 2, str(tmp_path), 100)


def test_decide_auto_uses_the_free_space_and_counts_copies_already_staged(tmp_path, caplog):
    """A 1 MiB tmpfs; 8 partitions of 150,000 bytes on 4 nodes: 300,000 per node and copy.
    Reserve 5% (52,428). Empty: 3 copies fit (900,000). With copies of partitions 0 and 4
    (node 0's own) already staged, the free space shrinks by what they occupy but they need
    no new space: still 3; without their .ok records they are not counted: 2."""
    index = fake_index([150_000] * 8)
    with tmpfs(tmp_path / "t", "1m") as root:
        local = root / "local"
        assert R.decide("auto", index, Others(), 0, 4, str(local)) == 3
        assert not local.exists()  # measured at its parent, not made before the gate
        local.mkdir()
        for p in (0, 4):
            path = local / partition_name(p)
            path.write_bytes(b"x" * 150_000)
            record_ok(str(path), index.partitions[p].checksum)
        assert staged_copies(str(local), index) == {0: 150_000, 4: 150_000}
        with caplog.at_level(logging.INFO):
            assert R.decide("auto", index, Others(), 0, 4, str(local), None, "n0") == 3
        assert "n0: replicas auto: 3 copies (4 would need 878.9 KiB here): 878.9 KiB here, " \
               "293 KiB of it already staged" in caplog.text
        assert f"free in {local} (keeping 51.2 KiB)" in caplog.text
        for p in (0, 4):
            os.unlink(local / (partition_name(p) + ".ok"))
        assert staged_copies(str(local), index) == {}
        assert R.decide("auto", index, Others(), 0, 4, str(local)) == 2


# --------------------------------------------------------------------------- data


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    """~70 files of unequal sizes in 8 partitions, plus ``val/`` broadcast to every node."""
    root = tmp_path_factory.mktemp("replicas")
    src = root / "src"
    rng = random.Random(19)
    for d in range(6):
        for i in range(12):
            n = rng.randint(1, 40_000) * (4 if i == 0 else 1)
            data = rng.randbytes(n) if i % 2 else (f"line {i} " * n).encode()[:n]
            path = src / f"c{d}" / f"f{i:02d}.bin"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
    (src / "val").mkdir()
    (src / "val" / "v.bin").write_bytes(rng.randbytes(30_000))
    store = root / "store"
    run_main("pack", src, store, "--partitions", "8", "--chunk-kb", "64", "--codec", "zstd:3",
            "--broadcast", "val", "--jobs", "2", "--no-progress", check=True)
    index = read_index(str(store))
    sizes = [p.size for p in index.partitions]
    flags = [p.broadcast for p in index.partitions]
    assert len(sizes) == 9 and flags[-1] and len(set(sizes)) == 9
    return SimpleNamespace(src=src, store=store, sizes=sizes, flags=flags)


def staged(local: Path) -> set[int]:
    return {int(p.name[5:10]) for p in local.iterdir()
            if p.name.startswith("part-") and p.name.endswith(".fsp")}


# --------------------------------------------------------------------------- CLI


def test_info_local_capacity_table_and_json(dataset):
    fullest = R.fullest_bytes(dataset.sizes, dataset.flags, 4)
    cap = fullest[1]  # exactly two copies on 4 nodes
    proc = run_main("info", dataset.store, "--local-capacity", str(cap), check=True)
    lines = proc.stdout.splitlines()
    at = lines.index(f"local capacity {show_size(cap)} per node: copies that fit "
                     "(--replicas auto)")
    rows = {int(ln.split()[0]): ln.split(None, 2) for ln in lines[at + 2:]}
    assert sorted(rows) == [1, 2, 4, 8, 16, 32, 64]
    assert rows[4][1] == "2"
    assert rows[4][2] == (f"{show_size(fullest[1])} (3 copies would need "
                          f"{show_size(fullest[2])})")
    assert rows[1][1] == "0" and rows[1][2].startswith("nothing fits: one copy needs ")
    doc = json.loads(run_main("info", dataset.store, "--local-capacity", str(cap), "--nodes",
                             "4", "--json", check=True).stdout)
    assert doc["local_capacity"] == {"bytes": cap, "fits": [{
        "nodes": 4, "replicas": 2, "node_bytes": fullest[1], "one_copy_node_bytes": fullest[0],
        "next_copy_node_bytes": fullest[2], "every_partition_on_every_node": False}]}
    whole = sum(dataset.sizes)
    doc = json.loads(run_main("info", dataset.store, "--local-capacity", "1G", "--nodes", "3",
                             "--json", check=True).stdout)
    assert doc["local_capacity"]["fits"][0]["replicas"] == 3
    assert doc["local_capacity"]["fits"][0]["every_partition_on_every_node"]
    assert doc["local_capacity"]["fits"][0]["node_bytes"] == whole
    assert "local_capacity" not in json.loads(
        run_main("info", dataset.store, "--json", check=True).stdout)


def test_bad_capacity_and_replicas_values_are_one_line_and_exit_2(dataset, tmp_path):
    store, mnt = dataset.store, tmp_path / "m"
    mnt.mkdir()
    for args, message in [
        (("info", store, "--local-capacity", "lots"), "expected a size such as 500G"),
        (("info", store, "--local-capacity", "0"), "must be more than 0 bytes"),
        (("info", store, "--local-capacity=-5G"), "expected a size such as 500G"),
        (("info", store, "--local-capacity", "1.5"), "a number of bytes must be whole"),
        (("info", store, "--nodes", "4"), "--nodes goes with --local-capacity"),
        (("info", store, "--local-capacity", "1G", "--nodes", "0"), "must be at least 1"),
        (("mount", store, mnt, "--replicas", "0"), "or 'auto', got '0'"),
        (("mount", store, mnt, "--replicas", "most"), "or 'auto', got 'most'"),
        (("mount", store, mnt, "--replicas", "auto", "--local-capacity", "9Q",
          "--local-dir", tmp_path / "l"), "expected a size such as 500G"),
        (("mount", store, mnt, "--replicas", "2", "--local-capacity", "1G", "--local-dir",
          tmp_path / "l"), "--local-capacity sizes --replicas auto"),
        (("mount", store, mnt, "--replicas", "auto", "--local-capacity", "1G"),
         "--local-capacity is the room for staged partitions: it needs --local-dir"),
        (("select", dataset.src, "--local-capacity", "big"), "expected a size such as 500G"),
    ]:
        assert_cli_error((run_cli if args[0] == "mount" else run_main)(*args), 2, message)
    assert not is_mounted(mnt) and not (tmp_path / "l").exists()


def test_mount_help_describes_auto():
    out = " ".join(run_cli("mount", "--help", check=True).stdout.split())
    assert "--replicas K|auto" in out and "--local-capacity SIZE" in out
    assert "every partition on every node" in out


def test_select_says_how_many_copies_fit(dataset):
    proc = run_main("select", dataset.src, "--reader", "api", "--sample-mb", "1",
                   "--mode", "prefetch", "--mb-per-sec", "1", "--cores", "2",
                   "--storage-mb-per-sec", "100000", "--local-capacity", "1K", "--json",
                   "--trials", "0",
                   check=True, timeout=300)
    doc = json.loads(proc.stdout)
    fits = doc["local_capacity"]
    raw = doc["sample"]["source_mb"] * 1e6
    assert fits["codec"] == doc["chosen"] and fits["ratio"] == doc["predicted"]["ratio"]
    assert abs(fits["predicted_stored_bytes"] - raw / fits["ratio"]) < 0.01 * raw
    stored = fits["predicted_stored_bytes"]
    assert fits["min_nodes_one_copy"] == -(-stored // 1024)
    assert not fits["every_partition_on_every_node"]
    assert fits["copies_per_node"] == round(1024 / stored, 2)
    proc = run_main("select", dataset.src, "--reader", "api", "--sample-mb", "1",
                   "--mode", "prefetch", "--mb-per-sec", "1", "--cores", "2",
                   "--storage-mb-per-sec", "100000", "--local-capacity", "1G", "--trials", "0",
                   check=True, timeout=300)
    chosen = [ln for ln in proc.stdout.splitlines() if ln.startswith("chosen    ")]
    codec = chosen[0].split()[1].rstrip(":")  # timing may choose another codec this time
    last = next(ln for ln in proc.stdout.splitlines() if ln.startswith("capacity  "))
    assert re.fullmatch(rf"capacity  packed with {re.escape(codec)} at [0-9.]+x, the store "
                        r"would be about [0-9.]+ [KM]iB: 1 GiB per node holds [0-9]+ whole "
                        r"copies \(--replicas auto: every partition on every node, every read "
                        r"local\)", last), last


# --------------------------------------------------------------------------- one node


class TestOneNode:
    pytestmark = needs_fuse

    def test_auto_stages_everything_and_reads_locally(self, dataset, mounted, tmp_path):
        local = tmp_path / "local"
        mnt = mounted(dataset.store, "--local-dir", local, "--replicas", "auto")
        assert staged(local) == set(range(9))
        ok, wrong, errors = read_tree_bytes(dataset.src, mnt)
        assert (wrong, errors) == ([], []) and ok == 73
        stats = stats_json(mnt)
        assert stats["replicas"] == 1 and stats["staged_partitions"] == 9
        assert stats["local_reads"] > 0 and stats["remote_reads"] == 0
        assert "replicas auto: 1 copy (every partition on every node)" in daemon_log(mnt)

    def test_auto_when_nothing_fits_fails_in_one_line(self, dataset, tmp_path):
        mnt, local = tmp_path / "m", tmp_path / "local"
        mnt.mkdir()
        need = sum(dataset.sizes)
        proc = run_cli("mount", dataset.store, mnt, "--local-dir", local, "--replicas", "auto",
                       "--local-capacity", str(need - 1))
        bc = dataset.sizes[-1]
        line = assert_cli_error(proc, 1, "replicas auto: the store does not fit: one copy "
                                f"needs {need:,} bytes on this node ({show_size(bc)} of it "
                                f"broadcast to every node), {need - 1:,} bytes available "
                                "(--local-capacity)")
        assert "one copy fits on 2 nodes" in line
        assert not is_mounted(mnt) and not local.exists()


# --------------------------------------------------------------------------- 4 ranks


class TestFourRanks:
    pytestmark = needs_cluster

    def test_a_store_that_fits_is_everywhere_and_no_read_is_remote(self, dataset, tmp_path):
        with MpiJob(dataset.store, tmp_path, ranks=4, extra=["--replicas", "auto"]) as job:
            for r in range(4):
                assert staged(job.local_dir(r)) == set(range(9)), r
            ok, wrong, errors = read_tree_bytes(dataset.src, job.mnt(0))
            assert (wrong, errors) == ([], []) and ok == 73
            stats = job.stats(0)
            assert stats["replicas"] == 4 and stats["local_partitions"] == list(range(9))
            assert stats["remote_reads"] == 0 and stats["remote_bytes"] == 0
            assert stats["local_reads"] > 0 and stats["errors"] == 0
            out = job.output()
            assert out.count("replicas auto: 4 copies (every partition on every node)") == 4

    def test_a_capacity_for_two_copies_keeps_two(self, dataset, tmp_path):
        cap = R.fullest_bytes(dataset.sizes, dataset.flags, 4)[1]  # exactly at the boundary
        extra = ["--replicas", "auto", "--local-capacity", str(cap)]
        with MpiJob(dataset.store, tmp_path, ranks=4, extra=extra) as job:
            table = pl.placement(dataset.flags, 4, 2)
            for r in range(4):
                want = set(pl.local_partitions(table, r))
                assert want == {p for p in range(8) if (r - p) % 4 < 2} | {8}
                assert staged(job.local_dir(r)) == want, r
            assert job.stats(1)["replicas"] == 2
            ok, wrong, errors = read_tree_bytes(dataset.src, job.mnt(2))
            assert (wrong, errors) == ([], []) and ok == 73
            assert job.stats(2)["remote_reads"] > 0

    def test_a_capacity_that_fits_nothing_fails_every_rank_cleanly(self, dataset, tmp_path):
        fullest = R.fullest_bytes(dataset.sizes, dataset.flags, 4)[0]
        short = [r for r in range(4)
                 if R.node_bytes(dataset.sizes, dataset.flags, 4, r)[0] == fullest]
        extra = ["--replicas", "auto", "--local-capacity", str(fullest - 1)]
        job = MpiJob(dataset.store, tmp_path, ranks=4, extra=extra, wait=False)
        job.start()
        try:
            assert job.wait_exit(60) not in (0, None)
            out = job.output()
            assert "Traceback" not in out and "internal error" not in out
            errors = [ln for ln in out.splitlines() if ln.startswith("fanstore: error:")]
            assert len(errors) == 4, out
            fails = [ln for ln in errors if "the store does not fit: one copy needs "
                     f"{fullest:,} bytes on this node (one of 4)" in ln]
            assert len(fails) == len(short) >= 1, out
            assert all("use more nodes, a bigger --local-dir" in ln for ln in fails)
            others = [ln for ln in errors if "another rank has no room for one copy" in ln]
            assert len(others) == 4 - len(short), out
            assert not any(is_mounted(job.mnt(r)) for r in range(4))
            assert not any(job.local_dir(r).exists() for r in range(4))
        finally:
            job.stop()
