"""The Python API (fanstore.open_store), prefetch mode, and the PyTorch dataset.

Reads through the API are compared byte for byte with the source, for a packed store read
in-process and for live mounts (one node, and a 2-rank MPI job so that remote files are
read through the API too).
"""

from __future__ import annotations

import collections
import errno
import importlib.util
import json
import multiprocessing as mp
import os
import random
import subprocess
from pathlib import Path

import pytest

import fanstore
from fanstore.errors import (
    CorruptDataError,
    IsADirectoryError_,
    NotFoundError,
    OutsideStoreError,
    UsageError,
)
from helpers import (
    assert_cli_error,
    assert_no_traceback,
    damage_file,
    fuse_available,
    is_mounted,
    make_outside_links_tree,
    run_cli,
    run_main,
    wait_until,
)
from mpi_helpers import MpiJob, mpi_available

_fuse_ok, _fuse_why = fuse_available()
_mpi_ok, _mpi_why = mpi_available()
needs_fuse = [pytest.mark.fuse, pytest.mark.skipif(not _fuse_ok, reason=_fuse_why)]


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    """~300 files in 6 directories (some multi-chunk), packed into 4 partitions."""
    root = tmp_path_factory.mktemp("api")
    src = root / "src"
    rng = random.Random(3)
    for d in range(6):
        (src / f"c{d}").mkdir(parents=True)
        for i in range(50):
            n = rng.randint(0, 30_000) if i % 10 else 70_000  # some files span 2 chunks
            data = (rng.randbytes(n // 2) + bytes(n - n // 2)) if i % 3 else rng.randbytes(n)
            (src / f"c{d}" / f"f{i:03d}.bin").write_bytes(data)
    os.symlink("c0/f001.bin", src / "alias")
    store = root / "store"
    run_main("pack", src, store, "--partitions", "4", "--chunk-kb", "64", "--no-progress",
            check=True)
    files = sorted(str(p.relative_to(src)) for p in src.rglob("*.bin"))
    return src, store, files


def check_all(reader, src: Path, files: list[str]) -> int:
    n = 0
    for rel in files:
        assert reader.read(rel) == (src / rel).read_bytes(), rel
        n += 1
    return n


# --------------------------------------------------------------------------- a packed store


def test_store_reads_every_file_byte_exact(tree):
    src, store, files = tree
    with fanstore.open_store(str(store)) as s:
        assert type(s).__name__ == "StoreReader"
        assert s.files() == files
        assert check_all(s, src, files) == 300
        assert s.read("alias") == (src / "c0" / "f001.bin").read_bytes()  # symlinks followed
        assert sorted(s.listdir("")) == sorted(os.listdir(src))
        assert sorted(s.listdir("c3")) == sorted(os.listdir(src / "c3"))
        st, real = s.stat("c2/f007.bin"), os.stat(src / "c2" / "f007.bin")
        assert (st.st_size, st.st_mode, st.st_mtime_ns) == (
            real.st_size, real.st_mode, real.st_mtime_ns)
        assert s.stat("c2").is_dir() and not s.stat("c2").is_file()
        with s.open("c4/f010.bin") as f:
            whole = (src / "c4" / "f010.bin").read_bytes()
            assert f.read(100) == whole[:100]
            f.seek(len(whole) - 10)
            assert f.read() == whole[-10:]
        assert s.read_range("c4/f010.bin", 65530, 20) == whole[65530:65550]
        walked = {d: sorted(fs) for d, _ds, fs in s.walk()}
        assert walked["c5"] == sorted(os.listdir(src / "c5"))


def test_store_errors_are_fanstore_errors(tree, tmp_path):
    _src, store, _files = tree
    with fanstore.open_store(str(store)) as s:
        with pytest.raises(NotFoundError):
            s.read("c0/missing.bin")
        with pytest.raises(IsADirectoryError_):
            s.read("c1")
        with pytest.raises(UsageError):
            s.open("c0/f001.bin", "wb")
    with pytest.raises(NotFoundError):
        fanstore.open_store(str(tmp_path / "nothing"))
    with pytest.raises(UsageError):
        fanstore.open_store(str(tmp_path))  # an empty directory: neither store nor mount


def test_symlinks_that_leave_the_store_are_a_clear_error(tmp_path):
    """Issue 35: such links are stored as they are; the API resolves symlinks only inside
    the store, so a path through one is OutsideStoreError (a NotFoundError, ENOENT) naming
    the link and its target, never the host's file; stat/exists look at the link itself."""
    tree = make_outside_links_tree(tmp_path)
    store = tmp_path / "store"
    run_main("pack", tree["root"], store, "--codec", "zstd:3", "--no-progress", check=True)
    with fanstore.open_store(str(store)) as s:
        for rel in tree["leaving"]:
            target = tree["links"][rel]
            for call in (s.read, s.open, s.entry_of, s.listdir,
                         lambda p: s.read_range(p, 0, 4)):
                with pytest.raises(OutsideStoreError) as info:
                    call(rel)
                assert str(info.value) == (
                    f"{rel}: symlink {rel!r} -> {target!r} leads outside the store (FanStore's "
                    "readers resolve symlinks only inside the store; read it through the "
                    "mount)"), rel
                assert isinstance(info.value, NotFoundError)
                assert info.value.errno == errno.ENOENT
            assert s.stat(rel).st_mode & 0o170000 == 0o120000  # the link itself, like lstat
            assert s.exists(rel) and not s.exists(f"{rel}/x")
        assert s.read("inside") == tree["files"]["sub/g"]
        assert s.read("sub/up") == tree["files"]["f"]
        with pytest.raises(NotFoundError) as info:
            s.read("inside_dangling")
        assert not isinstance(info.value, OutsideStoreError)
    proc = run_main("cat", store, "sub/rel")
    line = assert_cli_error(proc, code=1, contains="symlink 'sub/rel' -> '../../outside.txt' "
                                                   "leads outside the store")
    assert proc.stdout == "" and proc.stderr.strip() == line


def test_corrupt_data_raises_and_never_returns_wrong_bytes(tree, tmp_path):
    src, store, files = tree
    bad = tmp_path / "store"
    subprocess.run(["cp", "-r", str(store), str(bad)], check=True)
    damage_file(bad, "c1/f002.bin")
    with fanstore.open_store(str(bad)) as s:
        with pytest.raises(CorruptDataError) as exc:
            s.read("c1/f002.bin")
        assert exc.value.errno == errno.EIO
        assert s.read("c1/f003.bin") == (src / "c1" / "f003.bin").read_bytes()


def _child_reads(store_obj, src, files, q):
    try:
        q.put(check_all(store_obj, Path(src), files))
    except BaseException as exc:  # noqa: BLE001 - report to the parent
        q.put(repr(exc))


def test_store_is_safe_after_fork(tree):
    src, store, files = tree
    with fanstore.open_store(str(store)) as s:
        s.read(files[0])  # warm it up in the parent first
        ctx = mp.get_context("fork")
        q = ctx.Queue()
        procs = [ctx.Process(target=_child_reads, args=(s, str(src), files[i::3], q))
                 for i in range(3)]
        for p in procs:
            p.start()
        results = [q.get(timeout=120) for _ in procs]
        for p in procs:
            p.join(30)
        assert sorted(results) == [100, 100, 100]
        assert check_all(s, src, files[:20]) == 20  # the parent still works


# --------------------------------------------------------------------------- a live mount


@pytest.mark.fuse
@pytest.mark.skipif(not _fuse_ok, reason=_fuse_why)
def test_mount_reads_every_file_byte_exact_and_after_fork(tree, mounted):
    src, store, files = tree
    mnt = mounted(store)
    with fanstore.open_store(str(mnt)) as s:
        assert type(s).__name__ == "MountReader"
        assert s.files() == files
        assert check_all(s, src, files) == 300
        ctx = mp.get_context("fork")
        q = ctx.Queue()
        procs = [ctx.Process(target=_child_reads, args=(s, str(src), files[i::2], q))
                 for i in range(2)]
        for p in procs:
            p.start()
        results = [q.get(timeout=120) for _ in procs]
        for p in procs:
            p.join(30)
        assert sorted(results) == [150, 150]
        # Local partitions are read in the reader's own process, not by the daemon.
        mine = s.reader.stats
        assert mine.reads == 300 and mine.local_reads >= 300 and mine.remote_reads == 0
        daemon = json.loads(run_main("stats", mnt, "--json", check=True).stdout)
        assert daemon["reads"] == 0 and daemon["local_reads"] == 0
        assert s.stats()["reads"] == 300  # the node's counters plus this process's


@pytest.mark.fuse
@pytest.mark.skipif(not _fuse_ok, reason=_fuse_why)
def test_prefetch_needs_prefetch_mode(tree, mounted, tmp_path):
    _src, store, files = tree
    mnt = mounted(store)
    order = tmp_path / "order.txt"
    order.write_text("\n".join(files) + "\n")
    res = run_main("prefetch", mnt, "--list", order)
    assert res.returncode != 0
    assert "sync mode" in res.stderr and "--mode prefetch" in res.stderr
    assert_no_traceback(res)


@pytest.mark.fuse
@pytest.mark.skipif(not _fuse_ok, reason=_fuse_why)
def test_prefetch_through_the_api(tree, mounted):
    """open_store(MNT) on a prefetch mount: the order goes over with .prefetch(); files the
    workers pushed are read through the mount, the others decoded here; every byte right."""
    src, store, files = tree
    mnt = mounted(store, "--mode", "prefetch", "--prefetch-mb", "64")
    with fanstore.open_store(str(mnt)) as s:
        assert s._window is not None  # the daemon handed the window over
        for rel in [f for f in files if f.startswith("c5/")][:20]:
            assert s.read(rel) == (src / rel).read_bytes()
        for epoch in range(2):
            order = files[:]
            random.Random(10 + epoch).shuffle(order)
            reply = s.prefetch(order)
            assert reply["files"] == 300 and reply["unknown"] == 0
            if epoch == 0:  # (a reader that gets to a file first keeps it: on a busy
                # machine the niced prefetcher may push nothing before this reader is done)
                assert wait_until(lambda: s.stats()["prefetch_pushed"] > 0, 30), \
                    "no file pushed 30 s after the order"
            assert check_all(s, src, order) == 300
        st = s.stats()
        assert st["prefetch_orders"] >= 2 and st["prefetch_pushed"] > 0 and st["errors"] == 0
        with pytest.raises(NotFoundError):
            s.read("c0/nope.bin")


@pytest.mark.fuse
@pytest.mark.mpi
@pytest.mark.skipif(not (_fuse_ok and _mpi_ok), reason=_fuse_why or _mpi_why)
def test_api_on_a_two_rank_mount_reads_remote_files(tree, tmp_path):
    src, store, files = tree
    with MpiJob(store, tmp_path, ranks=2, extra=["--mode", "prefetch"]) as job:
        with fanstore.open_store(str(job.mnt(0))) as s:
            assert check_all(s, src, files) == 300
            stats = s.stats()
            assert stats["remote_reads"] > 0 and stats["errors"] == 0
            order = files[::-1]
            s.prefetch(order)
            assert check_all(s, src, order) == 300


# --------------------------------------------------------------------------- PyTorch


_torch_ok = importlib.util.find_spec("torch") is not None
needs_torch = pytest.mark.skipif(not _torch_ok, reason="PyTorch is an optional extra "
                                 "(pip install torch==2.13.0 for these tests)")


def _loader_epochs(target, epochs=2, workers=4, replicas=None):
    import torch
    from torch.utils.data import DataLoader, DistributedSampler, RandomSampler

    from fanstore.torch import FanStoreDataset, PrefetchSampler

    ds = FanStoreDataset(target, transform=len)
    seen_per_epoch = []
    for rank in range(replicas or 1):
        if replicas:
            base = DistributedSampler(ds, num_replicas=replicas, rank=rank, shuffle=True, seed=1)
        else:
            base = RandomSampler(ds, generator=torch.Generator().manual_seed(1))
        sampler = PrefetchSampler(base, ds)
        loader = DataLoader(ds, batch_size=8, sampler=sampler, num_workers=workers,
                            collate_fn=lambda batch: batch)
        for epoch in range(epochs):
            sampler.set_epoch(epoch)
            sizes = []
            for batch in loader:
                sizes.extend(batch)
            order = sampler.last_order
            assert [ds.files[i] for i in order] and len(sizes) == len(order)
            seen_per_epoch.append((epoch, rank, order, sizes))
    return ds, seen_per_epoch


@needs_torch
def test_dataloader_over_a_store_yields_every_sample_once(tree):
    src, store, files = tree
    ds, epochs = _loader_epochs(str(store))
    assert len(ds) == 300 and ds.files == files
    for _epoch, _rank, order, sizes in epochs:
        assert sorted(order) == list(range(300))  # every sample exactly once
        assert sizes == [os.path.getsize(src / ds.files[i]) for i in order]
    assert epochs[0][2] != epochs[1][2]  # a new permutation each epoch


@needs_torch
def test_distributed_sampler_splits_the_store(tree):
    _src, store, _files = tree
    _ds, epochs = _loader_epochs(str(store), epochs=1, replicas=2)
    counts = collections.Counter(i for _e, _r, order, _s in epochs for i in order)
    assert sorted(counts) == list(range(300)) and set(counts.values()) == {1}


@needs_torch
@pytest.mark.fuse
@pytest.mark.skipif(not _fuse_ok, reason=_fuse_why)
def test_dataloader_over_a_prefetch_mount(tree, mounted):
    src, store, _files = tree
    mnt = mounted(store, "--mode", "prefetch")
    ds, epochs = _loader_epochs(str(mnt))
    for _epoch, _rank, order, sizes in epochs:
        assert sorted(order) == list(range(300))
        assert sizes == [os.path.getsize(src / ds.files[i]) for i in order]
    stats = json.loads(run_main("stats", mnt, "--json", check=True).stdout)
    assert stats["prefetch_pushed"] > 0 and stats["prefetch_orders"] >= 2
    assert stats["errors"] == 0
