"""The selector's measurements: which finalists, a measured epoch, the trial set and its
scaling, the reader's fit, the report's answer when nothing meets the budget, and
``select --check``.

Pure parts are tested with synthetic numbers; the real parts read through real mounts and
the real CLI. Nothing here asserts a speed: the measured rates are compared with what the
same measurement says (a budget met or not, the best ratio among the measured), never with
a clock.
"""

from __future__ import annotations

import json
import math
import os

import numpy as np
import pytest
from helpers import (FANSTORE, TESTS_DIR, assert_cli_error, assert_no_traceback,
                     cleanup_mount, mount_store, run_cli, run_main, started)

from fanstore.select import finalists
from fanstore.select.calibrate import reader_cost
from fanstore.select.epoch import PassResult, Target, drop_page_cache, run_pass
from fanstore.select.finalists import Option, choose_measured, next_to_measure
from fanstore.select.policy import Budget
from fanstore.select.trial import TrialFile, TrialSet, _scale, make_trial_set, prefix_sizes

MB = 1e6
needs_fuse = pytest.mark.fuse  # (conftest.py skips these without FUSE)


# --------------------------------------------------------------------------- finalists


def _budget(required: float) -> Budget:
    return Budget("sync", required, 1, math.inf)


def _search(options, truth, required, limit=6):
    """Run the finalist search against ``truth`` (label -> measured rate); returns the
    measured rates and the choice."""
    measured = {"none": truth["none"]}
    budget = _budget(required)
    while (label := next_to_measure(options, measured, budget, limit)) is not None:
        assert label not in measured
        measured[label] = truth[label]
    return measured, choose_measured(options, measured, budget)


TRUTH = {"zstd:19": 150.0, "zstd:9": 160.0, "lz4": 300.0, "none": 320.0}
RATIOS = {"zstd:19": 3.0, "zstd:9": 2.5, "lz4": 2.0, "none": 1.0}


def _options(model_over_truth: float) -> list[Option]:
    return [Option(lb, RATIOS[lb], TRUTH[lb] * model_over_truth) for lb in TRUTH]


def test_a_pessimistic_model_cannot_hide_a_winner():
    """The model says every codec is half as fast as it is: zstd:19 (modelled at 75, the
    budget 100) is measured anyway and chosen."""
    measured, (label, met) = _search(_options(0.5), TRUTH, required=100.0)
    assert (label, met) == ("zstd:19", True)
    assert measured["zstd:19"] == 150.0
    assert finalists.correction(_options(0.5), measured) == pytest.approx(2.0)


def test_an_optimistic_model_is_caught_by_the_measurement():
    """The model says twice the truth: zstd:19 and zstd:9 look fine (300, 320 for a budget
    of 200) and are measured; both fail; lz4 meets it and is chosen."""
    measured, (label, met) = _search(_options(2.0), TRUTH, required=200.0)
    assert {"zstd:19", "zstd:9", "lz4"} <= set(measured)
    assert (label, met) == ("lz4", True)


def test_nothing_meets_the_budget_the_fastest_measured_is_named():
    measured, (label, met) = _search(_options(1.0), TRUTH, required=1000.0)
    assert not met and label == "none" and measured["none"] == 320.0
    assert len(measured) >= finalists.MIN_MEASURED


def test_the_search_stops_at_its_limit_and_at_min_measured():
    opts = [Option(f"c{i}", 10.0 - i, 100.0) for i in range(10)] + [Option("none", 1, 500)]
    truth = {o.label: o.model for o in opts}
    measured, (label, met) = _search(opts, truth, required=50.0, limit=4)
    assert len(measured) <= 4 and (label, met) == ("c0", True)
    # an exact model: the best ratio meets it, and only the minimum is measured
    measured, _ = _search(opts, truth, required=50.0, limit=10)
    assert len(measured) == finalists.MIN_MEASURED


def test_measured_ties_go_to_the_faster():
    opts = [Option("a", 2.000, 100), Option("b", 1.995, 100), Option("none", 1, 100)]
    label, met = choose_measured(opts, {"a": 120.0, "b": 180.0, "none": 300.0},
                                 _budget(100.0))
    assert (label, met) == ("b", True)


def test_one_test_of_meeting_the_budget_for_the_model_and_the_measured():
    """A rate equal to the budget up to floating point meets it, for the model
    (policy.meets) and the finalists (choose_measured) alike; a rate 1e-6 below it does
    not."""
    from fanstore.select.policy import Cost, meets, node_rate

    budget = _budget(100.0)
    just = 100.0 * (1 - 1e-12)
    assert budget.met_by(just) and budget.met_by(100.0) and not budget.met_by(100.0 - 1e-4)
    opts = [Option("a", 2.0, 100), Option("none", 1, 300)]
    assert choose_measured(opts, {"a": just, "none": 300.0}, budget) == ("a", True)
    assert choose_measured(opts, {"a": 99.9999, "none": 300.0}, budget) == ("none", True)
    cost = Cost(0.5, 1 / 100.0)  # one core: exactly 100 raw bytes/s
    assert node_rate(cost, budget) == pytest.approx(100.0) and meets(cost, budget)


# --------------------------------------------------------------------------- scaling


def _pass(latency: list[float], sizes: list[int], wall: float, readers: int = 2):
    return PassResult(files=len(latency), bytes=sum(sizes), readers=readers, seconds=wall,
                      latency=latency, reader_cpu=wall, mount_cpu=wall)


def test_a_trial_pass_is_scaled_by_whole_files_and_by_bytes_of_large_files():
    """1,000 whole files and 100 MB in 10 large files; the trial read 10 whole files at
    1 ms each and 2 pieces of 10 MB at 20 ms each, two readers busy all along."""
    whole = [TrialFile(f"w/{i}", 1000, False, "txt/tiny") for i in range(10)]
    pieces = [TrialFile(f"l/{i}", 10_000_000, True, "f32/large") for i in range(2)]
    trial = TrialSet("/nowhere", whole, pieces, 1000, 1_000_000, 10, 100_000_000, 1 << 20)
    order = whole + pieces
    lat = [0.001] * 10 + [0.020] * 2
    files_s, bytes_s, cpu = _scale(trial, order, _pass(lat, [f.size for f in order],
                                                       wall=sum(lat) / 2))
    # reader-seconds: 1 ms x 1,000 + (40 ms / 20 MB) x 100 MB = 1.2 s; two at once: 0.6 s
    assert files_s == pytest.approx(1010 / 0.6)
    assert bytes_s == pytest.approx(101_000_000 / 0.6)
    assert cpu == pytest.approx(0.6 * 2 / 1010)  # CPU = 2 x wall in the synthetic pass


def test_the_reader_fit_recovers_its_costs():
    """Latencies made of 120 µs per file, 400 µs per further chunk, the copy and the
    storage: the fit finds the first two."""
    rng = np.random.default_rng(1)
    chunk, copy, storage, latency = 1 << 20, 0.2e-9, 2e9, 80e-6
    files = []
    for _ in range(500):
        size = int(rng.integers(1, 20 * chunk))
        chunks = -(-size // chunk)
        files.append((size, 120e-6 + (chunks - 1) * 400e-6 + size * copy + latency
                      + size / storage))
    cost = reader_cost(files, "mount", "sync", 2, chunk, copy, storage, latency, 1000.0, 1.0)
    assert cost.per_file == pytest.approx(120e-6, rel=1e-6)
    assert cost.per_chunk == pytest.approx(400e-6, rel=1e-6)
    assert cost.file_cost(3) == pytest.approx(920e-6, rel=1e-6)
    # prefetch mode charges no storage in the fit: it stays in the per-file cost
    pre = reader_cost(files, "mount", "prefetch", 2, chunk, copy, storage, latency, 1.0, 1.0)
    assert pre.per_file > cost.per_file


# --------------------------------------------------------------------------- a pass


def _tree(root, n=40, size=3000, seed=5) -> dict[str, bytes]:
    rng = np.random.default_rng(seed)
    files = {f"d{i % 4}/{i:03d}.txt": rng.bytes(size) for i in range(n)}
    for rel, data in files.items():
        p = os.path.join(root, rel)
        os.makedirs(os.path.dirname(p), exist_ok=True)
        with open(p, "wb") as f:
            f.write(data)
    return files


def test_a_pass_reads_every_file_once_and_counts_what_fails(tmp_path):
    files = _tree(tmp_path)
    rels = sorted(files) + ["d0/missing.txt"]
    r = run_pass(Target("mount", str(tmp_path)), rels, readers=3)
    assert r.files == len(rels) and r.readers == 3 and len(r.latency) == len(rels)
    assert r.bytes == sum(len(d) for d in files.values())
    assert r.errors == 1 and "d0/missing.txt" in r.first_error
    assert all(x > 0 for x in r.latency) and r.seconds > 0 and r.mount_cpu is None
    # more readers than files: one per file
    assert run_pass(Target("mount", str(tmp_path)), sorted(files)[:2], readers=8).readers == 2


def test_a_pass_through_the_api_reads_the_store(tmp_path):
    files = _tree(tmp_path / "src")
    run_main("pack", tmp_path / "src", tmp_path / "s", "--codec", "zstd:3", "--no-progress",
            check=True)
    drop_page_cache([str(tmp_path / "s")])
    r = run_pass(Target("api", str(tmp_path / "s"), cache_mb=1), sorted(files), readers=2)
    assert r.errors == 0 and r.bytes == sum(len(d) for d in files.values())


# --------------------------------------------------------------------------- the trial set


def test_the_trial_set_keeps_kinds_directories_and_bytes(tmp_path):
    """Whole files keep their kind and size, in directories as full as the source's; a
    large file is cut into pieces of its own bytes at chunk-aligned offsets."""
    from fanstore.kinds import file_kind
    from fanstore.select.sample import list_source

    src = tmp_path / "src"
    files = _tree(src, n=120)
    chunk = 64 << 10
    rng = np.random.default_rng(9)
    big = {f"big/{i}.f32": rng.bytes(200 * chunk + 123) for i in range(2)}
    for rel, data in big.items():
        os.makedirs(src / "big", exist_ok=True)
        (src / rel).write_bytes(data)
    trial = make_trial_set(list_source(str(src)), str(tmp_path / "set"), chunk, readers=2)
    assert (trial.source_whole_files, trial.source_large_files) == (120, 2)
    assert trial.source_large_bytes == sum(len(d) for d in big.values())
    assert len(trial.whole) == 120 and len(trial.pieces) == 4
    per_dir: dict[str, int] = {}
    for f in trial.whole:
        per_dir[os.path.dirname(f.rel)] = per_dir.get(os.path.dirname(f.rel), 0) + 1
        assert file_kind(f.rel, f.size) == f.kind == "txt/tiny"
        assert (tmp_path / "set" / f.rel).read_bytes() in files.values()
    assert set(per_dir.values()) == {30}  # 120 files in 4 directories at the source
    for p in trial.pieces:
        data = (tmp_path / "set" / p.rel).read_bytes()
        assert len(data) == 64 * chunk and p.kind == "f32/large"
        found = [(rel, whole.find(data)) for rel, whole in big.items() if data in whole]
        assert found and found[0][1] % chunk == 0
    # a slow encoder reads a prefix: every piece one reader needs, and MIN_FILES whole files
    n_whole, n_pieces = prefix_sizes(trial, 1.0, jobs=2, readers=2)
    assert (n_whole, n_pieces) == (min(120, 500), 2)


# --------------------------------------------------------------------------- the CLI


def _npy_tree(root, n=12):
    rng = np.random.default_rng(3)
    os.makedirs(root, exist_ok=True)
    for i in range(n):
        arr = np.cumsum(rng.standard_normal(20_000).astype(np.float32) * 0.01)
        np.save(os.path.join(root, f"{i:03d}.npy"), arr.astype(np.float32))
    return str(root)


@needs_fuse
def test_a_budget_no_codec_meets_ends_with_the_fastest_and_its_pack_command(tmp_path):
    src = _npy_tree(tmp_path / "d")
    proc = run_main("select", src, "--mode", "sync", "--mb-per-sec", "1000000000", "--cores",
                   "1", "--sample-mb", "1", "--trials", "2", "--rounds", "1", timeout=300)
    assert proc.returncode == 3, proc.stderr
    assert_no_traceback(proc)
    last = proc.stdout.rstrip("\n").splitlines()[-2:]
    assert last[0].startswith("not met   no codec reaches 1,000,000,000 MB/s")
    assert "the fastest," in last[0] and "measured" in last[0] and "short" in last[0]
    assert last[1].startswith(f"pack      fanstore pack {src} DEST --codec ")
    err = proc.stderr.strip().splitlines()
    assert err[-1].startswith("fanstore: budget not met: no codec meets the budget")
    assert not any(line.startswith("fanstore: error") for line in err)
    doc = json.loads(run_main("select", src, "--mode", "sync", "--mb-per-sec", "1000000000",
                             "--cores", "1", "--sample-mb", "1", "--trials", "2",
                                 "--rounds", "1", "--json",
                             timeout=300).stdout)
    assert doc["met"] is False and doc["not_met"]["fastest"] == doc["chosen"]
    assert doc["candidates"][0]["rate_from"] in ("measured", "model")
    assert doc["pack_command"].endswith(f"--codec {doc['chosen']}")


@needs_fuse
def test_check_reads_a_store_as_its_report_predicted(tmp_path):
    src = _npy_tree(tmp_path / "d", n=40)
    sel = run_main("select", src, "--json", "--mb-per-sec", "1", "--cores", "2",
                  "--sample-mb", "2", "--trials", "2", "--rounds", "1", timeout=300)
    assert sel.returncode == 0, sel.stderr
    report = tmp_path / "sel.json"
    report.write_text(sel.stdout)
    doc = json.loads(sel.stdout)
    store = tmp_path / "s"
    run_main("pack", src, store, "--codec", doc["chosen"], "--no-progress", check=True)
    proc = run_main("select", "--check", store, "--report", report, timeout=300)
    assert proc.returncode == 0, proc.stderr
    lines = {ln[:10].strip(): ln for ln in proc.stdout.splitlines()}
    assert "40 files" in lines["check"] and doc["chosen"].split("+")[0] in lines["check"]
    assert "sync, 2 readers through a temporary mount, cold" in lines["read"]
    assert f"for {doc['chosen']}" in lines["predicted"] and str(report) in lines["predicted"]
    assert "x the prediction" in lines["measured"] and lines["budget"].endswith(": met")
    out = json.loads(run_main("select", "--check", store, "--report", report, "--json",
                             timeout=300).stdout)
    assert out["files"] == 40 and out["met"] is True and out["kind"] == "store"
    assert out["cold"] is True and out["resident_after_drop"] <= 0.05  # on a disk
    assert out["measured_over_predicted"] == pytest.approx(
        out["measured"]["files_per_s"] / out["predicted"]["files_per_s"], rel=1e-2)
    # The same store against a budget its measurement cannot meet: status 3, one line.
    doc["budget"]["required_mb_per_s"] = 1e9
    report.write_text(json.dumps(doc))
    proc = run_main("select", "--check", store, "--report", report, timeout=300)
    assert proc.returncode == 3 and "NOT met" in proc.stdout
    assert proc.stderr.strip().startswith("fanstore: budget not met:")
    with open("/proc/mounts") as f:
        assert str(tmp_path) not in f.read()


@needs_fuse
def test_check_reads_a_live_mount_and_a_store_packed_with_auto(tmp_path):
    src = _npy_tree(tmp_path / "d", n=20)
    store = tmp_path / "s"
    proc = run_main("pack", src, store, "--codec", "auto", "--mb-per-sec", "1", "--cores", "2",
                   "--sample-mb", "2", "--trials", "2",
                       "--rounds", "1", "--no-progress", timeout=300)
    assert proc.returncode == 0, proc.stderr
    mnt = tmp_path / "mnt"
    pid = mount_store(store, mnt)
    try:
        out = json.loads(run_main("select", "--check", mnt, "--json", timeout=300).stdout)
        assert out["kind"] == "mount" and out["files"] == 20 and out["mode"] == "sync"
        assert out["predicted"]["from"] == "the store's recorded selection"
        assert out["predicted"]["rate_from"] == "measured" and out["met"] is True
    finally:
        cleanup_mount(mnt, pid)


@pytest.mark.parametrize("args, message", [
    (("--check", "{tmp}/nothing"), "does not exist"),
    (("--check", "{tmp}"), "neither a FanStore store nor a live FanStore mount"),
    (("{tmp}", "--check", "{tmp}"), "give SRC or --check STORE_OR_MOUNT, not both"),
    (("{tmp}", "--report", "{tmp}/r.json"), "--report and --check-files go with --check"),
    ((), "give SRC (the data to select a codec for) or --check STORE_OR_MOUNT"),
    (("--check", "{store}", "--report", "{tmp}/bad.json"), "not JSON"),
    (("--check", "{store}", "--report", "{tmp}/quick.json"), "not the report of a full"),
])
def test_check_bad_input(tmp_path, small_store, args, message):
    (tmp_path / "bad.json").write_text("{nope")
    (tmp_path / "quick.json").write_text(json.dumps({"quick": True}))
    argv = [a.format(tmp=tmp_path, store=small_store) for a in args]
    proc = run_main("select", *argv)
    assert_cli_error(proc, code=2, contains=message)


@needs_fuse
def test_a_selection_killed_mid_trial_leaves_nothing_behind(tmp_path):
    """SIGTERM while a finalist's trial mount is up: the selection unwinds, unmounts and
    removes its temporary directory, and exits 130."""
    import signal
    import time

    from helpers import FANSTORE, started, wait_until

    src = _npy_tree(tmp_path / "d", n=40)
    work = tmp_path / "tmp"
    work.mkdir()

    def trial_mounted() -> bool:
        with open("/proc/mounts") as f:
            return str(work) in f.read()

    with started([FANSTORE, "select", src, "--mb-per-sec", "1", "--cores", "2",
                  "--sample-mb", "2"], env=dict(os.environ, TMPDIR=str(work))) as proc:
        assert wait_until(trial_mounted, timeout=120, interval=0.02), "no trial mount seen"
        proc.send_signal(signal.SIGTERM)
        _out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert "fanstore: interrupted" in err and "Traceback" not in err
    time.sleep(0.5)
    with open("/proc/mounts") as f:
        assert str(tmp_path) not in f.read()
    assert os.listdir(work) == []


@pytest.mark.long  # measured finalists: over 5 s of CPU
def test_more_cores_than_here_are_scaled_by_the_cpu_per_file_and_said(tmp_path):
    """--cores 16 on this machine: the trials read with the cores here, and each finalist's
    rate is scaled to 16 by the lower of linear scaling and the CPU each file cost."""
    src = _npy_tree(tmp_path / "d", n=30)
    here = len(os.sched_getaffinity(0))
    args = [src, "--reader", "api", "--mode", "sync", "--mb-per-sec", "1", "--cores", "16",
            "--sample-mb", "2", "--trials", "2", "--rounds", "1", "--storage-mb-per-sec", "1000"]
    doc = json.loads(run_main("select", *args, "--json", timeout=300).stdout)
    assert doc["measurement"]["readers"] == min(16, here) and doc["budget"]["cores"] == 16
    assert doc["measurement"]["rounds"] == 1  # --rounds 1: each finalist read once
    for c in doc["candidates"]:
        m = c["measured"]
        if m is None:
            continue
        assert len(m["rounds_files_per_s"]) == 1
        assert m["readers"] == min(16, here) and m["scaled_to_cores"] == 16
        linear = m["files_per_s_as_measured"] * 16 / m["readers"]
        cpu_bound = 16 / (m["cpu_us_per_file"] * 1e-6)
        assert m["files_per_s"] == pytest.approx(
            max(m["files_per_s_as_measured"], min(linear, cpu_bound)), rel=0.02)
    text = run_main("select", *args, timeout=300).stdout
    line = next(x for x in text.splitlines() if x.startswith("measured  "))
    assert f"rates scaled from {min(16, here)} to 16 cores by the CPU each file" in line
    assert "the median of one round scaled to the whole source" in line


@pytest.mark.long  # measured finalists: over 5 s of CPU
def test_a_finalist_whose_trial_fails_is_left_out_and_said(tmp_path, monkeypatch):
    """One finalist's trial fails (here: made to): it is reported with why, never chosen,
    and the selection goes on with the others."""
    from fanstore.select import SelectionOptions, run_selection
    from fanstore.select.measuring import Measuring
    from fanstore.select.report import table, to_json
    from fanstore.select.trial import TrialError

    src = _npy_tree(tmp_path / "d", n=20)
    real = Measuring.measure
    failed = []

    def measure(self, policy, rate, label):
        if label != "none" and not failed:
            failed.append(label)
            raise TrialError("'fanstore mount' of a temporary store failed: test")
        return real(self, policy, rate, label)

    monkeypatch.setattr(Measuring, "measure", measure)
    res = run_selection(src, SelectionOptions(
        mode="sync", mb_per_sec=1.0, cores=2, sample_mb=2.0, reader="api", trials=4, rounds=1,
        storage_mb_per_sec=1000.0, progress=False, storage_dir=str(tmp_path)))
    bad = res.candidate(failed[0])
    assert bad.measured is None and "test" in bad.measure_error and not bad.chosen
    assert res.chosen != failed[0] and res.candidate(res.chosen).measured is not None
    row = next(c for c in to_json(res)["candidates"] if c["codec"] == failed[0])
    assert row["measure_error"] and row["rate_from"] == "model"
    line = next(x for x in table(res).splitlines() if x.startswith(failed[0] + " "))
    assert " failed " in line
    assert [p for p in os.listdir(tmp_path) if p.startswith("fanstore-select-")] == []


def _readers_fail_in(monkeypatch, where: str, how: str) -> None:
    """The trial rounds' readers (processes of their own) exit with status 9, or hang past
    the round's timeout, in the trial stores whose path matches the regular expression
    ``where``: what a reader killed by the OOM killer, or stuck on a dead mount, does. The
    parent's run_pass, the trial's clean-up and the selector run as they do; only the
    readers are made to fail (``tests/inject/sitecustomize.py``, which every reader this
    process starts imports)."""
    import re

    from fanstore.select import trial

    monkeypatch.setenv("FANSTORE_TEST_WORKER_FAULT", f"reader-{how}")
    monkeypatch.setenv("FANSTORE_TEST_FAULT_WHERE", where)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        p for p in (os.path.join(TESTS_DIR, "inject"), os.environ.get("PYTHONPATH")) if p))
    real = trial.run_pass

    def run_pass(target, *args, **kwargs):
        # the failing trials' rounds time out after 5 s (a round here takes well under
        # 1 s on a quiet machine); the others keep the real limit, however busy this one
        if re.search(where, target.root):
            kwargs["timeout"] = 5.0
        return real(target, *args, **kwargs)

    monkeypatch.setattr(trial, "run_pass", run_pass)


@pytest.mark.parametrize("how, why", [("dies", "a reader died (exit status 9)"),
                                      ("hangs", "the readers did not finish in 5 s")])
@pytest.mark.long  # measured finalists: over 5 s of CPU
def test_a_finalist_whose_reader_dies_or_hangs_is_not_measured_and_said(tmp_path, monkeypatch,
                                                                        how, why):
    """The first finalist's readers die (or hang): that finalist is reported not measured,
    with why in one line, and the selection goes on to measure and choose among the
    others; nothing is left behind."""
    from fanstore.select import SelectionOptions, run_selection
    from fanstore.select.report import table, to_json

    _readers_fail_in(monkeypatch, r"/trial-2/", how)
    src = _npy_tree(tmp_path / "d", n=20)
    res = run_selection(src, SelectionOptions(  # none, the failing finalist, one more
        mode="sync", mb_per_sec=1.0, cores=2, sample_mb=2.0, reader="api", trials=3, rounds=1,
        storage_mb_per_sec=1000.0, progress=False, storage_dir=str(tmp_path)))
    bad = [c for c in res.candidates if c.measure_error]
    assert len(bad) == 1 and bad[0].measured is None and not bad[0].chosen
    assert bad[0].measure_error == f"reading the trial store failed: {why}"
    measured = [c for c in res.candidates if c.measured is not None and c.label != "none"]
    assert measured, "the selection stopped at the failed finalist"
    assert res.candidate(res.chosen).measured is not None
    row = next(c for c in to_json(res)["candidates"] if c["codec"] == bad[0].label)
    assert row["measured"] is None and row["measure_error"] == bad[0].measure_error
    lines = [x for x in table(res).splitlines() if x.startswith("failed ")]
    assert lines == [f"failed    {bad[0].label} not measured: {bad[0].measure_error}"]
    assert [p for p in os.listdir(tmp_path) if p.startswith("fanstore-select-")] == []


@pytest.mark.long  # measured finalists: over 5 s of CPU
def test_a_per_kind_mix_whose_reader_dies_is_not_chosen_and_said(tmp_path, monkeypatch):
    """The per-kind mix is a finalist of its own, measured after the single codecs (at most
    --trials of them, `none` included): its readers die, so it is not chosen (the report
    packs the single choice) and the table and JSON say why."""
    from fanstore.select import SelectionOptions, run_selection
    from fanstore.select.report import pack_command, table, to_json

    trials = 3
    _readers_fail_in(monkeypatch, rf"/trial-([{trials + 1}-9]|\d\d+)/", "dies")
    src = _npy_tree(tmp_path / "d", n=20)
    rng = np.random.default_rng(5)
    for i in range(10):  # random bytes: kept raw, where the arrays want a shuffle filter
        (tmp_path / "d" / f"{i}.bin").write_bytes(rng.bytes(100_000))
    res = run_selection(src, SelectionOptions(
        mode="sync", mb_per_sec=1.0, cores=2, sample_mb=4.0, reader="api", trials=trials, rounds=1,
        per_kind=True, storage_mb_per_sec=1000.0, progress=False, storage_dir=str(tmp_path)))
    assert res.per_kind is not None and len(set(res.per_kind.values())) > 1
    why = "reading the trial store failed: a reader died (exit status 9)"
    assert res.per_kind_error == why and res.per_kind_met is False
    assert res.budget_met and res.candidate(res.chosen).measured is not None
    assert "--kind-codec" not in pack_command(res)
    assert to_json(res)["per_kind_predicted"]["measure_error"] == why
    lines = [x for x in table(res).splitlines() if x.startswith("failed ")]
    assert lines == [f"failed    the per-kind mix not measured, so not chosen: {why}"]
    assert [p for p in os.listdir(tmp_path) if p.startswith("fanstore-select-")] == []


@pytest.mark.long  # measured finalists: over 5 s of CPU
def test_no_finalist_measured_is_one_error_and_a_nonzero_exit(tmp_path, monkeypatch, capsys):
    """Every finalist's readers die (the `none` trial, the calibration, reads): `fanstore
    select` says so in one line naming the first and why, exits 1, prints no report and
    leaves nothing behind."""
    import tempfile

    from fanstore.cli import main

    _readers_fail_in(monkeypatch, r"/trial-([2-9]|\d\d+)/", "dies")
    src = _npy_tree(tmp_path / "d", n=20)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where the trials go ($TMPDIR)
    code = main(["select", src, "--reader", "api", "--mode", "sync", "--mb-per-sec", "1",
                 "--cores", "2", "--sample-mb", "2", "--trials", "3",
                     "--rounds", "1", "--storage-mb-per-sec",
                 "1000"])
    out, err = capsys.readouterr()
    assert code == 1 and out == ""
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith("fanstore: error: none of the 2 finalists could be measured (first, ")
    assert "reading the trial store failed: a reader died (exit status 9)); --trials 0" in err
    assert [p for p in os.listdir(tmp_path) if p.startswith("fanstore-select-")] == []


# --------------------------------------------------------------------------- the measured store


def _json_tree(root, n: int, seed: int = 12, rows: int = 22) -> str:
    """``n`` small JSON files of one kind (``rows`` 22: json/tiny, about 2.6 kB each;
    ``rows`` over 34: json/small, about 120 bytes a row)."""
    rng = np.random.default_rng(seed)
    words = np.array([f"w{i}" for i in range(300)])
    # rows per file, drawn for every file at once (a loop of draws took 6 s)
    ids = rng.integers(1 << 30, size=(n, rows)).tolist()
    labels = rng.choice(words, (n, rows)).tolist()
    boxes = np.round(rng.random((n, rows, 4)) * 640, 2).tolist()
    captions = rng.choice(words, (n, rows, 6)).tolist()
    for d in range(min(n, 20)):
        os.makedirs(os.path.join(root, f"c{d:02d}"), exist_ok=True)
    for i in range(n):
        doc = [{"id": ids[i][r], "label": labels[i][r], "box": boxes[i][r],
                "caption": " ".join(captions[i][r])} for r in range(rows)]
        with open(os.path.join(root, f"c{i % 20:02d}", f"{i:05d}.json"), "w") as f:
            f.write(json.dumps(doc))  # (dumps: the C encoder; dump's is Python, 3x slower)
    return str(root)


@pytest.mark.long
def test_the_report_pack_command_packs_the_store_it_measured(tmp_path):
    """A selection on small files chooses a codec with dictionaries; its report's pack
    command (seed included) packs a store whose dictionaries are byte for byte the ones the
    selection measured, at the ratio its trial store had. The source holds more small files
    than the dictionaries train on, so the training files are a choice that must agree."""
    import shlex

    from compressors import get_codec
    from fanstore.format.index import read_index
    from fanstore.select import SelectionOptions, run_selection
    from fanstore.select.dictionaries import DICT_TRAIN_BYTES
    from fanstore.select.report import pack_command

    src = _json_tree(tmp_path / "src", 700, rows=132)  # json/small, 9.5 MB
    raw = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(src) for f in fs)
    assert raw > DICT_TRAIN_BYTES * 1.05
    res = run_selection(src, SelectionOptions(
        mode="sync", mb_per_sec=1.0, cores=2, sample_mb=1.0, seed=7, reader="api", trials=2,
        rounds=1,
        storage_mb_per_sec=1000.0, progress=False, storage_dir=str(tmp_path)))
    chosen = res.candidate(res.chosen)
    assert "+dict" in res.chosen and chosen.measured is not None, res.chosen
    measured = {kind: codec.dict_data for kind, codec in chosen.by_kind.items()}
    assert measured and all(measured.values())
    dest = tmp_path / "packed"
    words = shlex.split(pack_command(res, dest=str(dest)))
    assert words[:2] == ["fanstore", "pack"] and words[words.index("--seed") + 1] == "7"
    run_main(*words[1:], "--no-progress", check=True, timeout=300)
    index = read_index(str(dest))
    stored = [get_codec(cfg).dict_data for cfg in index.codecs if "dict" in cfg]
    assert sorted(stored) == sorted(measured.values())
    counts = index.meta["counts"]
    ratio = counts["raw_bytes"] / counts["stored_bytes"]
    assert ratio == pytest.approx(chosen.measured.ratio, rel=0.02)

def test_a_drop_is_checked_with_mincore(tmp_path):
    """On a disk the dropped pages are gone (cold); on a tmpfs they are the storage and
    stay (not cold); a read brings them back. Our own files: no privilege needed."""
    import tempfile

    from fanstore.select.epoch import drop_page_cache, resident_pages

    shm = tempfile.mkdtemp(prefix="fanstore-test-", dir="/dev/shm")
    try:
        for where, cold in ((tmp_path, True), (shm, False)):
            path = os.path.join(where, "part")
            with open(path, "wb") as f:
                f.write(np.random.default_rng(1).bytes(3 << 20))
            left = drop_page_cache([str(where)])
            assert left.pages == (3 << 20) // os.sysconf("SC_PAGESIZE")
            assert left.cold is cold and left.fraction == (0.0 if cold else 1.0), where
            with open(path, "rb") as f:
                f.read()
            assert resident_pages([path]).fraction == 1.0
    finally:
        import shutil

        shutil.rmtree(shm, ignore_errors=True)


@needs_fuse
def test_trials_on_a_tmpfs_are_reported_not_cold(tmp_path):
    """A selection whose trial stores live on a tmpfs (/dev/shm), where dropping the page
    cache does nothing: the JSON says not cold, the table says so in a line of its own."""
    import shutil
    import tempfile

    src = _json_tree(tmp_path / "src", 600)
    shm = tempfile.mkdtemp(prefix="fanstore-test-", dir="/dev/shm")
    args = [src, "--mb-per-sec", "0.1", "--cores", "1", "--sample-mb", "1", "--trials", "1",
            "--rounds", "1", "--storage-mb-per-sec", "1000"]
    try:
        env = dict(os.environ, TMPDIR=shm)
        # the JSON and the table at once: two selections of one user side by side
        with started([FANSTORE, "select", *args, "--json"], env=env) as as_json, \
                started([FANSTORE, "select", *args], env=env) as text:
            doc = json.loads(as_json.communicate(timeout=300)[0])
            text_out, text_err = text.communicate(timeout=300)
        assert os.listdir(shm) == []  # the trials cleaned up
    finally:
        shutil.rmtree(shm, ignore_errors=True)
    m = doc["measurement"]
    assert m["cold"] is False and m["resident_after_drop"] > 0.9
    assert "NOT cold" in m["how"]
    assert text.returncode == 0, text_err
    line = next(x for x in text_out.splitlines() if x.startswith("cold "))
    assert line.startswith("cold      NO: ") and "tmpfs" in line
    assert "was not cold" in text_err

def _trial_mounts(work) -> list[str]:
    with open("/proc/mounts") as f:
        return [line.split()[1] for line in f if line.split()[1].startswith(str(work) + "/")]


def _workers_of(mnt: str) -> int | None:
    """The FUSE workers serving ``mnt`` (children of its kernel-frontend process), counted
    in /proc once the mount is ready; None when it went away first."""
    from helpers import daemon_pid, find_processes

    if run_cli("wait", mnt, "--timeout", "30").returncode != 0:
        return None
    pid = daemon_pid(mnt)
    if not pid:
        return None
    frontend = find_processes(lambda p: p.ppid == pid and b"kernelfs.process" in p.cmdline)
    if not frontend or not os.path.ismount(mnt):
        return None
    return len(find_processes(lambda p: p.ppid == frontend[0]))


@needs_fuse
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 cores: --cores 1 "
                    "must be fewer than the mount's default workers")
def test_the_trial_mount_has_at_most_cores_workers_and_reads_cold(tmp_path):
    """`select --cores 1` on a machine of more cores: every trial mount seen is served by
    one FUSE worker (counted in the process tree, not asked of the selection), and on a
    disk the trials report their reads cold."""
    from helpers import FANSTORE, daemon_pid, poll_while_running, started

    # 1,000 files: each round's mount is up for a second or more (the readers' start and
    # the pass), long enough to be seen; the storage is given (not measured: 128 MiB read)
    src = _json_tree(tmp_path / "src", 1000)
    work = tmp_path / "tmp"
    work.mkdir()
    seen: dict[tuple, int] = {}  # each trial mount (a round of a finalist), counted once

    def count_workers() -> None:
        for mnt in _trial_mounts(work):
            key = (mnt, daemon_pid(mnt))
            if key[1] and key not in seen and (count := _workers_of(mnt)) is not None:
                seen[key] = count

    with started([FANSTORE, "select", src, "--mb-per-sec", "0.1", "--cores", "1",
                  "--sample-mb", "1", "--trials", "1",
                      "--rounds", "1", "--storage-mb-per-sec", "1000",
                  "--json"],
                 env=dict(os.environ, TMPDIR=str(work), FANSTORE_FRONTEND="kernel")) as proc:
        out, err = poll_while_running(proc, count_workers)
    assert proc.returncode == 0, err
    assert seen and set(seen.values()) == {1}, seen
    doc = json.loads(out)
    assert doc["measurement"]["cold"] is True
    assert doc["measurement"]["resident_after_drop"] <= 0.05
    none = next(c for c in doc["candidates"] if c["codec"] == "none")
    assert none["measured"]["cold"] is True



# --------------------------------------------------------------------------- no mount here


def _selects_of_a_user_who_cannot_mount(other_user, *runs: tuple[str, ...]) -> list:
    """/dev/fuse exists (so `select` defaults to --reader mount), but an unprivileged user
    without fusermount3 on PATH cannot mount: one `fanstore select` of a small tree as that
    user per argument list in ``runs``, each with its --trials (the real `fanstore mount`
    failing); their completed processes. Every trial must be cleaned up."""
    import sys

    from second_user import reachable_for_others, shared_test_dir

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with shared_test_dir("fanstore-sel-") as d, \
            reachable_for_others(os.path.realpath(sys.executable), repo, sys.prefix):
        src = _npy_tree(os.path.join(d, "src"), n=20)
        for name in os.listdir(src):
            os.chmod(os.path.join(src, name), 0o644)
        work, rt, bare = (os.path.join(d, name) for name in ("work", "rt", "bin"))
        for path in (work, rt, bare):
            os.mkdir(path, 0o700)
            os.chown(path, other_user.uid, other_user.gid)
        env = other_user.env(PATH=bare, TMPDIR=work, FANSTORE_RUNTIME_DIR=rt,
                             FANSTORE_FRONTEND="kernel")
        done = [other_user.run(
            [sys.executable, "-m", "fanstore.cli", "select", src, "--mb-per-sec", "1",
             "--cores", "2", "--sample-mb", "1", "--rounds", "1",
             "--storage-mb-per-sec", "1000", *args], env=env, timeout=300) for args in runs]
        assert os.listdir(work) == []  # every trial cleaned up
    return done


needs_a_fuse_device = pytest.mark.skipif(not os.path.exists("/dev/fuse"),
                                         reason="needs a /dev/fuse to exist")


@pytest.mark.long
@needs_a_fuse_device
def test_a_fuse_device_that_cannot_mount_falls_back_to_the_api(other_user):
    """A sync selection where no mount can be made measures with the Python API and says so
    in one line (table and JSON)."""
    # (the text table is read for its fallback line only: one finalist, none)
    sync, table = _selects_of_a_user_who_cannot_mount(other_user, ("--json", "--trials", "2"),
                                                      ("--trials", "1"))
    assert sync.returncode == 0 and sync.stderr == "", sync.stderr
    doc = json.loads(sync.stdout)
    m = doc["measurement"]
    assert m["measured"] is True and m["trials"] >= 2 and doc["reader"]["reader"] == "api"
    assert m["reader_fallback"].startswith("--reader api: a trial mount failed here (")
    assert "fusermount3 not found" in m["reader_fallback"]
    assert "through the Python API on a temporary store" in m["how"]
    assert next(c for c in doc["candidates"] if c["codec"] == "none")["measured"]
    assert table.returncode == 0, table.stderr
    lines = [x for x in table.stdout.splitlines() if x.startswith("fallback  ")]
    assert lines == ["fallback  " + m["reader_fallback"]]


@pytest.mark.long
@needs_a_fuse_device
def test_without_a_mount_prefetch_chooses_on_the_model_and_a_mount_reader_is_an_error(
        other_user):
    """Where no mount can be made, a prefetch selection (whose API reads go through a mount
    too) chooses on the model and says why; --reader mount, asked for, is one error line
    and status 1."""
    prefetch, insist = _selects_of_a_user_who_cannot_mount(
        other_user, ("--mode", "prefetch", "--json", "--trials", "2"),
        ("--reader", "mount", "--trials", "2"))
    assert prefetch.returncode == 0 and prefetch.stderr == "", prefetch.stderr
    p = json.loads(prefetch.stdout)["measurement"]
    assert p["measured"] is False and p["reader_fallback"] is None
    assert p["note"].startswith("prefetch mode is measured through a mount, and a trial "
                                "mount failed here (") and "fusermount3 not found" in p["note"]
    assert insist.returncode == 1 and insist.stdout == ""
    assert insist.stderr.count("\n") == 1 and "Traceback" not in insist.stderr
    assert insist.stderr.startswith("fanstore: error: calibration: 'fanstore mount' of a "
                                    "temporary store failed: fusermount3 not found")
