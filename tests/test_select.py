"""The codec selector: pure policy formulas, sampling, known answers on generated data, CLI.

Timing-dependent answers use budgets far from any boundary (the machine is a noisy 2-core
VM): either so loose every candidate meets them or so tight none can.
"""

from __future__ import annotations

import json
import math
import os

import numpy as np
import pytest

from compressors import get_codec
from fanstore.errors import BudgetNotMetError
from fanstore.format.index import KIND_FILE, read_index
from fanstore.kinds import file_kind
from fanstore.select.packpolicy import policy_from_selection
from fanstore.select import SelectionOptions, run_selection
from fanstore.select.bench import measure, measure_storage, measure_storage_access
from fanstore.select.policy import Budget, Cost, choose, choose_per_kind, meets, mix, node_rate
from fanstore.select.report import check_met, to_json
from fanstore.select.sample import draw_sample, list_source, npy_itemsize
from helpers import run_cli, run_main

MB = 1e6

# A budget every candidate meets (1 MB/s, prefetch, fast storage) and one none can.
LOOSE = dict(mode="prefetch", mb_per_sec=1.0, cores=2, storage_mb_per_sec=100000.0)
LOOSE_ARGS = ["--mode", "prefetch", "--mb-per-sec", "1", "--cores", "2",
              "--storage-mb-per-sec", "100000"]


# --------------------------------------------------------------------------- data


def _npy(arr: np.ndarray) -> bytes:
    import io

    buf = io.BytesIO()
    np.save(buf, arr)
    return buf.getvalue()


def smooth_floats(rng: np.random.Generator, n: int) -> np.ndarray:
    arr = np.cumsum(rng.standard_normal(n).astype(np.float32) * 0.01, dtype=np.float32)
    return (arr.view(np.uint32) & np.uint32(0xFFFFF000)).view(np.float32)


def write_files(root, files: dict[str, bytes]) -> str:
    for rel, data in files.items():
        path = os.path.join(root, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(data)
    return str(root)


def random_set(root, n=24, size=40_000, seed=1) -> str:
    rng = np.random.default_rng(seed)
    return write_files(root, {f"r/{i:03d}.bin": rng.bytes(size) for i in range(n)})


def zeros_set(root, n=16, size=100_000, seed=2) -> str:
    rng = np.random.default_rng(seed)
    files = {}
    for i in range(n):
        buf = bytearray(size)
        for pos in range(0, size, 16384):  # a few random bytes between long zero runs
            buf[pos:pos + 8] = rng.bytes(8)
        files[f"z/{i:03d}.dat"] = bytes(buf)
    return write_files(root, files)


def npy_set(root, n=16, elems=20_000, seed=3) -> str:
    rng = np.random.default_rng(seed)
    return write_files(root, {f"a/{i:03d}.npy": _npy(smooth_floats(rng, elems))
                              for i in range(n)})


def json_records(rng: np.random.Generator, n: int) -> bytes:
    return "".join(json.dumps({"id": int(rng.integers(0, 1 << 30)),
                               "label": int(rng.integers(0, 1000)),
                               "score": round(float(rng.random()), 6),
                               "tags": [f"t{int(x)}" for x in rng.integers(0, 50, 3)]}) + "\n"
                   for _ in range(n)).encode()


def mixed_set(root, seed=4) -> str:
    """Three kinds with three different right answers: random, float arrays, small JSON."""
    rng = np.random.default_rng(seed)
    files = {f"bin/{i:03d}.bin": rng.bytes(40_000) for i in range(12)}
    files.update({f"npy/{i:03d}.npy": _npy(smooth_floats(rng, 12_000)) for i in range(12)})
    files.update({f"json/{i:03d}.json": json_records(rng, 30) for i in range(60)})
    return write_files(root, files)


def select(src: str, **kw) -> object:
    opts = dict(LOOSE, sample_mb=8.0, encode_seconds=1.0, progress=False)
    opts.update(kw)
    return run_selection(src, SelectionOptions(**opts))


# --------------------------------------------------------------------------- pure policy

S = 1000 * MB  # storage in the synthetic budgets


def test_node_rate_sync_formula():
    b = Budget("sync", 100 * MB, cores=4, storage=S)
    cost = Cost(stored=0.5, cpu=1 / (500 * MB))
    # per reader: 1 / (cpu + stored/S) = 1 / (2 ns + 0.5 ns) = 400 MB/s; 4 readers: 1600;
    # storage cap S/stored = 2000 MB/s.
    assert node_rate(cost, b) == pytest.approx(1600 * MB)
    # One core: 400 MB/s; a tiny storage caps it at S/stored.
    assert node_rate(cost, Budget("sync", 1.0, 1, S)) == pytest.approx(400 * MB)
    assert node_rate(cost, Budget("sync", 1.0, 64, S)) == pytest.approx(2000 * MB)


def test_node_rate_charges_a_random_read_per_file_in_sync_mode():
    # 10 kB files: 1e-4 seeks per raw byte; 200 us per random read per reader adds 2 ns/B.
    cost = Cost(stored=0.5, cpu=1 / (500 * MB), seeks=1 / 10_000)
    slow = Budget("sync", 1.0, 4, S, latency=200e-6)
    # per reader: 1 / (2 + 0.5 + 20) ns per byte = 44.4 MB/s; 4 readers: 177.8 MB/s.
    assert node_rate(cost, slow) == pytest.approx(4 / (1 / (500 * MB) + 0.5 / S + 2e-8))
    assert node_rate(cost, Budget("sync", 1.0, 4, S)) == pytest.approx(1600 * MB)
    # Prefetch overlaps the reads with compute: no latency charged.
    assert node_rate(cost, Budget("prefetch", 1.0, 4, S, latency=200e-6)) == pytest.approx(
        2000 * MB)
    assert mix([cost, Cost(1.0, 0.0)], [1.0, 1.0]).seeks == pytest.approx(0.5 / 10_000)
    with pytest.raises(ValueError):
        Budget("sync", 1.0, 4, S, latency=-1.0)


def test_node_rate_prefetch_formula():
    cost = Cost(stored=0.5, cpu=1 / (500 * MB))
    # Decode overlaps I/O: 4 cores x 500 MB/s = 2000, storage cap 2000 MB/s.
    assert node_rate(cost, Budget("prefetch", 1.0, 4, S)) == pytest.approx(2000 * MB)
    assert node_rate(cost, Budget("prefetch", 1.0, 2, S)) == pytest.approx(1000 * MB)
    assert node_rate(cost, Budget("prefetch", 1.0, 2, 100 * MB)) == pytest.approx(200 * MB)
    # Sync is never faster than prefetch for the same numbers.
    for cores in (1, 2, 8):
        assert (node_rate(cost, Budget("sync", 1.0, cores, S))
                <= node_rate(cost, Budget("prefetch", 1.0, cores, S)))


def test_meets_at_the_boundary():
    cost = Cost(stored=1.0, cpu=1 / (250 * MB))
    assert meets(cost, Budget("prefetch", 1000 * MB, 4, 10 * S))
    assert not meets(cost, Budget("prefetch", 1001 * MB, 4, 10 * S))


def test_choose_best_ratio_that_meets():
    costs = {
        "fast": Cost(0.8, 1 / (4000 * MB)),
        "mid": Cost(0.5, 1 / (1000 * MB)),
        "slow": Cost(0.4, 1 / (100 * MB)),
    }
    assert choose(costs, Budget("prefetch", 50 * MB, 1, 10 * S)) == ("slow", True)
    assert choose(costs, Budget("prefetch", 500 * MB, 1, 10 * S)) == ("mid", True)
    assert choose(costs, Budget("prefetch", 3000 * MB, 1, 10 * S)) == ("fast", True)
    # More cores make the slow codec affordable.
    assert choose(costs, Budget("prefetch", 500 * MB, 8, 10 * S)) == ("slow", True)


def test_choose_ties_go_to_the_faster():
    costs = {"a": Cost(0.500, 1 / (300 * MB)), "b": Cost(0.504, 1 / (900 * MB)),
             "c": Cost(0.520, 1 / (5000 * MB))}
    # a and b are within 1% in ratio: b is faster. c is 4% worse: not a tie.
    assert choose(costs, Budget("prefetch", 10 * MB, 1, 10 * S)) == ("b", True)
    # Exact ties fall to the earlier label in the order (simplest first).
    same = {"none": Cost(1.0, 1e-10), "lz4": Cost(1.0, 1e-10)}
    assert choose(same, Budget("prefetch", 1.0, 1, S), order=["none", "lz4"])[0] == "none"


def test_choose_none_meets_picks_the_fastest():
    costs = {"x": Cost(0.5, 1 / (100 * MB)), "y": Cost(0.9, 1 / (900 * MB))}
    assert choose(costs, Budget("prefetch", 10_000 * MB, 1, 100 * S)) == ("y", False)
    # Sync charges the storage read: a slow disk favours the smaller stored size.
    costs = {"big": Cost(1.0, 1 / (10_000 * MB)), "small": Cost(0.2, 1 / (2000 * MB))}
    label, met = choose(costs, Budget("sync", 10_000 * MB, 1, 100 * MB))
    assert (label, met) == ("small", False)


def test_per_kind_beats_single_and_meets():
    table = {
        "floats": {"zstd": Cost(0.7, 1 / (800 * MB)), "shuffle": Cost(0.4, 1 / (1500 * MB)),
                   "none": Cost(1.0, 1 / (10_000 * MB))},
        "text": {"zstd": Cost(0.25, 1 / (800 * MB)), "shuffle": Cost(0.6, 1 / (1500 * MB)),
                 "none": Cost(1.0, 1 / (10_000 * MB))},
        "random": {"zstd": Cost(1.0, 1 / (10_000 * MB)), "shuffle": Cost(1.0, 1 / (10_000 * MB)),
                   "none": Cost(1.0, 1 / (10_000 * MB))},
    }
    weights = {"floats": 50.0, "text": 20.0, "random": 30.0}
    b = Budget("prefetch", 10 * MB, 1, 10 * S)  # loose
    single, met = choose({lb: mix([table[k][lb] for k in weights], list(weights.values()))
                          for lb in ("none", "zstd", "shuffle")}, b, ["none", "zstd", "shuffle"])
    assert met
    mc = choose_per_kind(table, weights, b, single=single, order=["none", "zstd", "shuffle"])
    assert mc.met
    assert mc.assign["floats"] == "shuffle" and mc.assign["text"] == "zstd"
    assert mc.assign["random"] == "none"  # exact tie on this kind: the simplest
    single_cost = mix([table[k][single] for k in weights], list(weights.values()))
    assert mc.cost.stored < single_cost.stored
    assert meets(mc.cost, b)


def test_per_kind_spends_the_budget_where_it_buys_most():
    # Tight budget: only one kind can afford the slow codec. It should be the one where it
    # saves the most bytes per core-second.
    table = {
        "a": {"fast": Cost(0.9, 1 / (2000 * MB)), "slow": Cost(0.3, 1 / (200 * MB))},
        "b": {"fast": Cost(0.9, 1 / (2000 * MB)), "slow": Cost(0.8, 1 / (200 * MB))},
    }
    weights = {"a": 1.0, "b": 1.0}
    # allowance: cores/R; fast+fast costs 1/2000 per byte, slow on one kind (1/200+1/2000)/2
    b = Budget("prefetch", 350 * MB, 1, 100 * S)
    mc = choose_per_kind(table, weights, b, order=["fast", "slow"])
    assert mc.met and mc.assign == {"a": "slow", "b": "fast"}
    assert meets(mc.cost, b)
    # Impossible: the fastest of every kind, not met.
    mc = choose_per_kind(table, weights, Budget("prefetch", 10_000 * MB, 1, 100 * S),
                         order=["fast", "slow"])
    assert not mc.met and mc.assign == {"a": "fast", "b": "fast"}


def test_per_kind_dp_matches_brute_force():
    rng = np.random.default_rng(7)
    import itertools

    for trial in range(20):
        kinds = [f"k{i}" for i in range(3)]
        labels = [f"c{j}" for j in range(4)]
        table = {k: {lb: Cost(float(rng.uniform(0.2, 1.0)), float(rng.uniform(1e-10, 5e-9)))
                     for lb in labels} for k in kinds}
        weights = {k: float(rng.uniform(1, 10)) for k in kinds}
        b = Budget(["sync", "prefetch"][trial % 2], float(rng.uniform(200, 3000)) * MB, 2,
                   float(rng.uniform(500, 5000)) * MB)
        best = math.inf
        for combo in itertools.product(labels, repeat=len(kinds)):
            c = mix([table[k][lb] for k, lb in zip(kinds, combo)], list(weights.values()))
            if meets(c, b):
                best = min(best, c.stored)
        mc = choose_per_kind(table, weights, b, order=labels, tie=0.0)
        if math.isinf(best):
            assert not mc.met
        else:
            assert mc.met and meets(mc.cost, b)
            assert mc.cost.stored <= best * 1.01  # the grid costs at most a little


# --------------------------------------------------------------------------- sampling


# --------------------------------------------------------------------------- the read order


def _simulate_lru_epochs(groups, workers: int, cache: int, seeds: int = 3) -> list[float]:
    """Decodes per block of each group (count, bytes, files), simulated: every file of every
    block read once in random order, each read on a random one of ``workers`` LRU caches of
    ``cache`` bytes."""
    import random
    from collections import OrderedDict

    group_of = [g for g, (count, _, _) in enumerate(groups) for _ in range(count)]
    reads = [b for b, g in enumerate(group_of) for _ in range(groups[g][2])]
    decodes = [0] * len(groups)
    for seed in range(seeds):
        rng = random.Random(seed)
        rng.shuffle(reads)
        caches = [OrderedDict() for _ in range(workers)]
        used = [0] * workers
        for block in reads:
            w = rng.randrange(workers)
            if block in caches[w]:
                caches[w].move_to_end(block)
                continue
            size = groups[group_of[block]][1]
            decodes[group_of[block]] += 1
            caches[w][block] = size
            used[w] += size
            while used[w] > cache:
                used[w] -= caches[w].popitem(last=False)[1]
    return [d / (count * seeds) for d, (count, _, _) in zip(decodes, groups)]


def test_decodes_per_block_limits():
    from fanstore.select.readorder import decodes_per_block

    for n, k in ((25, 2), (10, 4), (40, 1), (3, 8)):
        assert decodes_per_block(n, k, 0.0) == pytest.approx(n)  # nothing stays cached
        # everything stays: once per worker the block's files land on
        assert decodes_per_block(n, k, 1.0) == pytest.approx(k * (1 - (1 - 1 / k) ** n))
        assert decodes_per_block(n, 1, 0.3) == pytest.approx(1 + (n - 1) * 0.7 ** n)
        values = [decodes_per_block(n, k, t / 10) for t in range(11)]
        assert values == sorted(values, reverse=True)  # the longer cached, the fewer
    assert decodes_per_block(1, 4, 0.0) == decodes_per_block(1, 4, 1.0) == 1.0


def test_cached_fraction_of_blocks_alike():
    """B blocks of b bytes, m = C / b fit: tau = (K / n) ln(B / (B - m)), capped at 1."""
    from fanstore.select.readorder import Caches, amplification, cached_fraction

    b, n, blocks = 65536, 25, 2400
    for k, m in ((2, 1024), (4, 300), (1, 2000)):
        tau = cached_fraction([(blocks, b, n)], Caches(k, m * b))
        assert tau == pytest.approx(min(1.0, k / n * math.log(blocks / (blocks - m))), rel=1e-6)
    assert cached_fraction([(blocks, b, n)], Caches(2, 0)) == 0.0
    assert cached_fraction([(blocks, b, n)], Caches(2, blocks * b)) == 1.0
    small = Caches(2, b / 2)  # a block never fits: the LRU refuses it, every read decodes
    assert amplification([(blocks, b, n)], small, cached_fraction([(blocks, b, n)], small)) \
        == pytest.approx(n)


@pytest.mark.parametrize("groups, workers, cache", [
    ([(2400, 64, 25)], 2, 64 * 2048),      # the cache holds most blocks
    ([(2400, 64, 25)], 2, 64 * 1024),
    ([(500, 64, 10)], 1, 64 * 250),        # one cache (the API, one reader)
    ([(300, 64, 40)], 8, 64 * 20),         # little cached: nearly once per file
    ([(300, 64, 25), (600, 16, 4)], 2, 4000),      # two kinds share the caches
    ([(200, 64, 40), (100, 1024, 1)], 4, 3000),    # and chunks of large files
])
def test_read_order_model_against_simulated_lru_caches(groups, workers, cache):
    from fanstore.select.readorder import Caches, cached_fraction, decodes_per_block

    tau = cached_fraction(groups, Caches(workers, cache))
    simulated = _simulate_lru_epochs(groups, workers, cache)
    for (count, size, files), got in zip(groups, simulated):
        assert decodes_per_block(files, workers, tau) == pytest.approx(got, rel=0.06, abs=0.05)


def test_amplification_of_the_measured_case():
    """60,000 files of 2.6 kB in 64 KiB blocks read through a 2-worker mount (256 MiB) or by
    2 API readers (64 MiB each): far below the 25 decodes per block of no cache."""
    from fanstore.select.readorder import amplification, cached_fraction, reader_caches

    blocks = [(60_000 / 25, 25 * 2600, 25)]  # 156 MB of blocks
    mount, api = reader_caches("mount", 2), reader_caches("api", 2)
    assert (mount.workers, mount.bytes_each) == (2, 128 << 20)
    assert (api.workers, api.bytes_each) == (2, 64 << 20)
    no_cache = amplification(blocks, mount, 0.0)
    assert no_cache == pytest.approx(25)
    # 128 MiB per worker holds 85% of the blocks: about 4.7 decodes per block, not 25
    a_mount = amplification(blocks, mount, cached_fraction(blocks, mount))
    assert a_mount == pytest.approx(4.68, abs=0.05)
    a_api = amplification(blocks, api, cached_fraction(blocks, api))
    assert a_mount < a_api < no_cache / 1.5
    fits = [(6_000 / 25, 25 * 2600, 25)]  # a tenth of it fits: once per worker
    assert amplification(fits, mount, cached_fraction(fits, mount)) == pytest.approx(
        2 * (1 - 0.5 ** 25))
    # a block larger than a worker's cache is never kept: decoded for every file
    assert amplification(blocks, reader_caches("mount", 8192), 1.0) == pytest.approx(25)

@pytest.mark.long  # a real selection or pack --codec auto: over 5 s of CPU

def test_selection_charges_solid_blocks_by_the_readers_caches(tmp_path):
    """Without a reader model every file read decodes its block; the API reader's caches
    hold these blocks, so it decodes each about once per reader process."""
    rng = np.random.default_rng(5)
    src = write_files(tmp_path, {f"j/{i:03d}.json": json_records(rng, 6) for i in range(200)})
    label = "zstd:3+solid64k"
    amp = {}
    for reader in (None, "api"):  # the model's caches: nothing measured (trials=0)
        res = select(src, reader=reader, sample_mb=2.0, trials=0)
        cost = res.candidate(label).cost
        amp[reader] = cost.read / cost.stored
    assert amp[None] > 50  # 64 KiB blocks of ~600-byte files: ~100 files each
    assert 1 < amp["api"] <= 2 + 1e-9  # 2 readers (LOOSE: --cores 2)


def test_reader_cache_defaults_are_the_readers():
    import inspect

    from fanstore.api import open_store
    from fanstore.cli import build_parser
    from fanstore.mountspec import MountSpec
    from fanstore.select.readorder import API_CACHE_MB, MOUNT_CACHE_MB

    assert MOUNT_CACHE_MB == MountSpec.cache_mb
    assert MOUNT_CACHE_MB == build_parser().parse_args(["mount", "S", "M"]).cache_mb
    assert API_CACHE_MB == inspect.signature(open_store).parameters["cache_mb"].default


def test_npy_itemsize():
    assert npy_itemsize(_npy(np.zeros(3, np.float32))) == 4
    assert npy_itemsize(_npy(np.zeros(3, np.float64))) == 8
    assert npy_itemsize(_npy(np.zeros(3, np.uint8))) == 1
    assert npy_itemsize(b"not an npy file at all") is None


def test_sample_is_seeded_stratified_and_chunks_large_files(tmp_path):
    rng = np.random.default_rng(5)
    files = {f"s/{i:03d}.txt": rng.bytes(3000) for i in range(200)}  # 600 kB of small files
    files["big/huge.f32"] = smooth_floats(rng, 1_000_000).tobytes()  # 4 MB, 64 KiB chunks
    src = write_files(tmp_path, files)
    listing = list_source(src)
    chunk = 64 << 10
    a = draw_sample(listing, 1_000_000, chunk, seed=11)
    b = draw_sample(listing, 1_000_000, chunk, seed=11)
    c = draw_sample(listing, 1_000_000, chunk, seed=12)
    assert [u for k in sorted(a.kinds) for u in a.kinds[k].units] == \
        [u for k in sorted(b.kinds) for u in b.kinds[k].units]
    assert [u for k in sorted(a.kinds) for u in a.kinds[k].units] != \
        [u for k in sorted(c.kinds) for u in c.kinds[k].units]
    big = a.kinds[file_kind("huge.f32", 4_000_000)]
    small = a.kinds[file_kind("x.txt", 3000)]
    assert big.units and all(len(u) <= chunk for u in big.units)
    assert big.sample_bytes < 4_000_000  # chunks of it, not the whole file
    assert big.typesize == 4 and big.typesize_from == "extension"
    # Both strata are present, roughly in proportion to their bytes (with the floor).
    assert small.units and 0.5 < a.sample_bytes / 1_000_000 < 1.6
    assert a.files == 201 and a.raw_bytes == 600_000 + 4_000_000
    # Small data: the whole source is the sample.
    whole = draw_sample(listing, 100_000_000, chunk, seed=0)
    assert whole.sample_bytes == whole.raw_bytes


def test_a_dictionary_is_a_function_of_the_source_the_kind_and_the_seed(tmp_path):
    """What select measures and what `pack --codec zstd:L+dict` trains are the same bytes,
    whatever the sample size; the measured units of the kind are not its training files
    when enough others are left; another seed trains on other files."""
    from fanstore.select.candidates import whole_set_candidates
    from fanstore.select.dictionaries import train_dictionaries, training_files

    rng = np.random.default_rng(8)
    files = {f"j/{i:04d}.json": json_records(rng, int(rng.integers(15, 30)))
             for i in range(900)}  # json/tiny, about 2 MB: more than its training share
    files.update({f"t/{i:03d}.txt": b"a few words " * int(rng.integers(20, 200))
                  for i in range(60)})  # txt/tiny, a smaller kind
    src = write_files(tmp_path, files)
    listing = list_source(src)
    budget = 1 << 20  # training bytes in all (DICT_TRAIN_BYTES by default)
    packed = train_dictionaries(listing, 1 << 20, seed=3, train_bytes=budget)
    assert set(packed) == {"json/tiny", "txt/tiny"}
    for sample_mb in (0.2, 100.0):
        sample = draw_sample(listing, int(sample_mb * MB), 1 << 20, 3, train_bytes=budget)
        cand = next(c for c in whole_set_candidates(sample) if c.label == "zstd:19+dict")
        assert {k: codec.dict_data for k, codec in cand.by_kind} == packed
    trained = {os.path.basename(f.rel) for f in training_files(listing, 1 << 20, 3,
                                                                 budget)["json/tiny"]}
    assert 0 < len(trained) < 900
    sample = draw_sample(listing, 100 * MB, 1 << 20, 3, train_bytes=budget)
    units = set(sample.kinds["json/tiny"].units)
    assert units and not units & {files[f"j/{name}"] for name in trained}
    assert len(units) == 900 - len(trained)  # the rest, all of it (a large sample)
    assert train_dictionaries(listing, 1 << 20, seed=4, train_bytes=budget) != packed


def test_measure_models_raw_chunks():
    rng = np.random.default_rng(6)
    units = [rng.bytes(10_000) for _ in range(5)] + [bytes(10_000)] * 5
    m = measure(get_codec({"id": "zstd", "level": 3}), units, encode_budget=1.0)
    assert m.units == 10 and m.raw_units == 5 and m.raw_unit_bytes == 50_000
    assert 50_000 < m.stored_bytes < 51_000  # random kept raw, zeros shrink to a few bytes


def test_measure_storage(tmp_path):
    rate, how = measure_storage(str(tmp_path), size=8 << 20)
    assert rate > 1e6 and str(tmp_path) in how
    assert not [p for p in os.listdir(tmp_path)]  # the test file is gone
    rate, latency, how = measure_storage_access(str(tmp_path), readers=2, size=8 << 20,
                                                reads=32)
    assert rate > 1e6 and 0 < latency < 1.0 and "random 4 KiB reads, 2 at once" in how
    assert not [p for p in os.listdir(tmp_path)]


# --------------------------------------------------------------------------- known answers


def test_random_bytes_pick_none(tmp_path):
    res = select(random_set(tmp_path))
    assert res.met
    assert res.chosen == "none"
    # Every chunk kept raw, as pack does; a dictionary is charged to the stored size, so
    # one that memorised the random files buys nothing.
    assert all(c.cost.ratio == 1.0 for c in res.candidates if "+dict" not in c.label)
    assert all(c.cost.ratio < 1.001 for c in res.candidates)
    assert len([c for c in res.candidates if c.kinds is None]) >= 12


def test_zero_runs_pick_a_high_ratio_codec(tmp_path):
    res = select(zeros_set(tmp_path))
    chosen = res.candidate(res.chosen)
    best = max(c.cost.ratio for c in res.candidates)
    assert res.met and res.chosen != "none"
    assert chosen.cost.ratio > 50
    assert chosen.cost.ratio >= best / 1.0101  # the best, or within the 1% tie


def test_smooth_float_arrays_pick_a_shuffle_filter(tmp_path):
    res = select(npy_set(tmp_path))
    assert res.met
    assert ":shuffle:4" in res.chosen or ":bitshuffle:4" in res.chosen, res.chosen
    kind = next(iter(res.kinds.values()))
    assert kind.typesize == 4 and kind.typesize_from == "npy header"


def test_default_budget_is_storing_raw(tmp_path):
    """The default budget: 90% of the rate of the data stored raw (DEFAULT_BUDGET)."""
    res = select(npy_set(tmp_path), mb_per_sec=None, mode="sync", cores=1,
                 storage_mb_per_sec=500.0)
    assert res.budget_from == "default" and res.met
    assert res.budget.required == pytest.approx(0.9 * res.candidate("none").node_rate)
    assert res.candidate(res.chosen).node_rate >= res.budget.required * (1 - 1e-9)


def test_files_per_sec_budget_uses_mean_file_size(tmp_path):
    src = npy_set(tmp_path)
    res = select(src, mb_per_sec=None, files_per_sec=10.0)
    assert res.budget_from == "files_per_sec"
    assert res.budget.required == pytest.approx(10.0 * res.raw_bytes / res.files)


def test_impossible_budget_reports_and_raises(tmp_path):
    res = select(npy_set(tmp_path, n=4), mb_per_sec=1e9, cores=1)
    assert not res.met
    fastest = max((c for c in res.candidates if c.kinds is None), key=lambda c: c.node_rate)
    assert res.chosen == fastest.label
    with pytest.raises(BudgetNotMetError) as err:
        check_met(res)
    assert err.value.exit_code == 3 and "no codec meets the budget" in str(err.value)
    with pytest.raises(BudgetNotMetError):
        policy_from_selection(res)


def test_per_kind_choice(tmp_path):
    res = select(mixed_set(tmp_path), per_kind=True)
    pk = res.per_kind
    assert res.budget_met and pk is not None
    by_ext = {k.split("/")[0]: lb for k, lb in pk.items()}
    assert by_ext["bin"] == "none"
    assert ":shuffle:4" in by_ext["npy"] or ":bitshuffle:4" in by_ext["npy"]
    assert by_ext["json"] != "none" and by_ext["json"] != by_ext["npy"]
    json_kind = next(k for k in pk if k.startswith("json/"))
    assert res.kinds[json_kind].costs[pk[json_kind]].ratio > 2
    assert res.per_kind_gain is not None and res.per_kind_gain >= 1.0
    # Small JSON files got dictionary candidates.
    assert any("+dict" in c.label for c in res.candidates)
    policy = policy_from_selection(res)
    npy_kind = next(k for k in pk if k.startswith("npy/"))
    assert policy.codec_for("npy/000.npy", res.kinds[npy_kind].raw_bytes // 12).spec == pk[npy_kind]
    doc = to_json(res)
    assert doc["per_kind"] == pk and json.loads(json.dumps(doc)) == doc


def test_json_report_schema(tmp_path):
    doc = to_json(select(npy_set(tmp_path, n=6)))
    for key in ("mode", "budget", "candidates", "chosen"):
        assert key in doc
    assert doc["mode"] == "prefetch" and doc["budget"]["cores"] == 2
    assert doc["budget"]["required_mb_per_s"] == pytest.approx(1.0)
    assert doc["budget"]["storage_latency_us"] == 0  # storage given: no latency unless given
    assert len(doc["candidates"]) >= 12
    for c in doc["candidates"]:
        assert {"codec", "ratio", "decode_mb_per_s", "files_per_s", "meets_budget"} <= set(c)
        assert isinstance(c["meets_budget"], bool) and c["ratio"] >= 1.0
    assert sum(c["chosen"] for c in doc["candidates"]) == 1
    assert doc["chosen"] in {c["codec"] for c in doc["candidates"]}
    assert json.loads(json.dumps(doc)) == doc
    assert "dict\":\"" not in json.dumps(doc)  # no dictionary bytes
    # the model's premise is stated with the answer
    assert doc["assumes"].startswith("prefetch: the mount decodes ahead")
    assert "on 2 cores the job leaves spare" in doc["assumes"]


def test_reports_state_what_their_mode_assumes(tmp_path):
    from fanstore.select.report import table

    src = npy_set(tmp_path, n=6)
    pre = table(select(src))
    line = next(ln for ln in pre.splitlines() if ln.startswith("assumes "))
    assert "decoding and storage reads overlap its compute" in line and "2 cores" in line
    sync = select(src, mode="sync")
    assert to_json(sync)["assumes"].startswith("sync: each read fetches, decodes and checks")


def test_plot_written(tmp_path):
    pytest.importorskip("matplotlib")
    from fanstore.select.plot import plot

    res = select(random_set(tmp_path / "d", n=4))
    plot(res, str(tmp_path / "sel.png"))
    with open(tmp_path / "sel.png", "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


# --------------------------------------------------------------------------- the real CLI


def test_selection_options_from_the_cli_parsers():
    from fanstore.cli import build_parser
    from fanstore.cli.select import selection_options

    args = build_parser().parse_args(
        ["select", "SRC", "--mode", "prefetch", "--files-per-sec", "10", "--cores", "3",
         "--sample-mb", "5", "--seed", "7", "--per-kind", "--storage-mb-per-sec", "100"])
    o = selection_options(args)
    assert (o.mode, o.files_per_sec, o.mb_per_sec, o.cores, o.sample_mb, o.seed, o.per_kind,
            o.storage_mb_per_sec, o.chunk_size) == ("prefetch", 10.0, None, 3, 5.0, 7, True,
                                                    100.0, 1 << 20)
    args = build_parser().parse_args(["pack", "SRC", "DEST", "--codec", "auto", "--chunk-kb",
                                      "64", "--mb-per-sec", "800", "--no-progress"])
    o = selection_options(args)
    assert (o.mode, o.mb_per_sec, o.chunk_size, o.progress) == ("sync", 800.0, 65536, False)
    assert o.n_cores >= 1 and o.cores is None

@pytest.mark.long  # a real selection or pack --codec auto: over 5 s of CPU

def test_cli_impossible_budget_exits_3(tmp_path):
    src = npy_set(tmp_path / "d", n=4)
    # the model alone (--trials 0): the exit status and the report are the point here; a
    # measured budget no codec meets is test_select_measure's
    args = ["select", src, "--mode", "sync", "--mb-per-sec", "1000000000", "--cores", "1",
            "--storage-mb-per-sec", "1000", "--sample-mb", "1", "--trials", "0"]
    proc = run_cli(*args)
    assert proc.returncode == 3, proc.stderr
    assert "no codec meets the budget" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert "<- chosen" in proc.stdout  # the table is printed before the error
    proc = run_main(*args, "--json")
    assert proc.returncode == 3
    doc = json.loads(proc.stdout)
    assert doc["met"] is False and doc["chosen"]
    assert "Traceback" not in proc.stderr


def test_cli_usage_errors(tmp_path):
    proc = run_main("select", str(tmp_path / "missing"), "--mb-per-sec", "1")
    assert proc.returncode == 2 and "does not exist" in proc.stderr
    assert "Traceback" not in proc.stderr
    proc = run_main("select", str(tmp_path), "--mb-per-sec", "1", "--files-per-sec", "1")
    assert proc.returncode == 2
    proc = run_main("select", str(tmp_path), "--storage-latency-us", "-5")
    assert proc.returncode == 2 and "--storage-latency-us must be a number >= 0" in proc.stderr
    assert "Traceback" not in proc.stderr
    proc = run_main("select", str(tmp_path), "--rounds", "0")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "--rounds" in proc.stderr and "Traceback" not in proc.stderr

@pytest.mark.long  # a real selection or pack --codec auto: over 5 s of CPU

def test_pack_auto_records_the_choice(tmp_path):
    src = npy_set(tmp_path / "d", n=8)
    dest = str(tmp_path / "store")
    # the choice recorded, not measured (--trials 0): a pack --codec auto whose finalists
    # are measured is test_select_measure's test_check_reads_a_live_mount_and_a_store_...
    proc = run_main("pack", src, dest, "--codec", "auto", *LOOSE_ARGS, "--sample-mb", "4",
                   "--trials", "0", "--partitions", "1", "--no-progress")
    assert proc.returncode == 0, proc.stderr
    assert "codec selection:" in proc.stderr
    info = json.loads(run_main("info", dest, "--json").stdout)
    sel = info["selection"]
    assert sel["mode"] == "prefetch" and sel["met"] is True
    assert ":shuffle:4" in sel["chosen"] or ":bitshuffle:4" in sel["chosen"]
    assert sel["chosen"] in info["codec_chunks"]  # the chunks really use it

@pytest.mark.long  # a real selection or pack --codec auto: over 5 s of CPU

def test_pack_auto_per_kind_applies_the_policy(tmp_path):
    src = mixed_set(tmp_path / "d")
    dest = str(tmp_path / "store")
    # --trials 2: `none` and one single codec are measured, then the mix (always); read
    # through the Python API (sync): a trial round through a mount is test_select_measure's;
    # --rounds 1: the default's rounds (3, and more while they disagree) are test_capacity's
    proc = run_main("pack", src, dest, "--codec", "auto", "--per-kind", "--mode", "sync",
                   "--mb-per-sec", "1", "--cores", "2", "--storage-mb-per-sec", "100000",
                   "--reader", "api", "--sample-mb", "4", "--trials", "2", "--rounds", "1",
                   "--partitions", "2", "--no-progress")
    assert proc.returncode == 0, proc.stderr
    index = read_index(dest)
    sel = index.meta["selection"]
    per_kind = sel["per_kind"]
    assert len(set(per_kind.values())) >= 3  # none, a shuffle filter, a zstd for the JSON
    # the mix is a finalist of its own: packed and read like the single codecs
    mix = sel["per_kind_predicted"]
    assert mix["rate_from"] == "measured" and mix["met"] is True
    assert mix["files_per_s"] >= sel["budget"]["required_files_per_s"]
    assert len(mix["measured"]["rounds_files_per_s"]) == 1  # --rounds, as for the others
    slots_seen = _codecs_by_kind(index, per_kind, sel["configs"])
    npy_kind = next(k for k in per_kind if k.startswith("npy/"))
    assert slots_seen[npy_kind] == {"blosc2"}
    assert slots_seen[next(k for k in per_kind if k.startswith("bin/"))] == {"none"}
    json_kind = next(k for k in per_kind if k.startswith("json/"))
    assert slots_seen[json_kind] - {"none"}  # compressed with the chosen codec
    if "+dict" in per_kind[json_kind]:
        assert any("dict" in cfg for cfg in index.codecs)  # the dictionary travels along


def _codecs_by_kind(index, per_kind: dict[str, str], configs: dict[str, dict]
                    ) -> dict[str, set[str]]:
    """Every chunk of a store packed as ``per_kind`` says has its kind's codec (``configs``:
    a report's, which name no dictionary) or none (kept raw); the codec ids seen per kind."""
    slots_seen: dict[str, set[str]] = {}
    for entry in range(index.n_entries):
        if int(index.entries["kind"][entry]) != KIND_FILE:
            continue
        rel = os.fsdecode(index.path(entry))
        kind = file_kind(rel, int(index.entries["size"][entry]))
        want = configs[per_kind[kind]]
        first, count = index.chunk_run(entry)
        for slot in index.chunks["codec"][first:first + count].tolist():
            cfg = index.codecs[slot]
            slots_seen.setdefault(kind, set()).add(cfg["id"])
            if cfg["id"] == "none":
                continue  # kept raw: compression did not shrink this chunk
            assert cfg["id"] == want["id"]
            assert {k: v for k, v in cfg.items() if k not in ("dict", "dict_id")} == \
                {k: v for k, v in want.items() if k not in ("dict", "dict_id")}
    return slots_seen


def _names_tree(root) -> tuple[str, dict[str, bytes]]:
    """Every kind of candidate has something to do: many small JSON and text files
    (dictionaries, solid blocks), float arrays (shuffle filters at their element size),
    random bytes (kept raw), an empty file."""
    rng = np.random.default_rng(21)
    words = [f"w{i}" for i in range(60)]
    files = {f"json/{i:03d}.json": json_records(rng, int(rng.integers(2, 10)))
             for i in range(90)}
    files.update({f"txt/{i:03d}.txt": " ".join(rng.choice(words, int(rng.integers(20, 400))))
                  .encode() for i in range(40)})
    files.update({f"npy/{i:02d}.npy": _npy(smooth_floats(rng, 6_000)) for i in range(6)})
    files.update({f"bin/{i}.bin": rng.bytes(30_000) for i in range(3)})
    files["empty.txt"] = b""
    return write_files(root, files), files


def _pack_and_check(src: str, dest, files: dict[str, bytes], *args: str) -> dict:
    """``fanstore pack SRC DEST ARGS``, every file read back byte-exact; ``info --json``."""
    import fanstore
    from compressors import parse_codec_spec

    run_main("pack", src, dest, *args, "--partitions", "2", "--no-progress", check=True)
    with fanstore.open_store(str(dest), cache_mb=0) as store:
        for rel, data in files.items():
            assert store.read(rel) == data, (args, rel)
    info = json.loads(run_main("info", dest, "--json", check=True).stdout)
    for spec in info["codec_chunks"]:  # what info lists is a spec pack takes too
        parse_codec_spec(spec)
    return info


@pytest.mark.long
def test_every_name_select_prints_is_a_codec_pack_takes(tmp_path):
    """The names of a real selection (one codec, per kind, the extras per kind) go to
    `pack --codec` as they are, and pack applies what they say."""
    src, files = _names_tree(tmp_path / "src")
    proc = run_main("select", src, "--per-kind", "--json", "--sample-mb", "2", "--reader", "api",
                   "--trials", "0", *LOOSE_ARGS, timeout=300)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    names = ({c["codec"] for c in doc["candidates"]}
             | {c["codec"] for c in doc.get("kind_candidates", [])}
             | set(doc["per_kind"].values()) | {doc["chosen"]})
    assert {"zstd:3+dict", "zstd:19+dict", "zstd:3+solid16k", "zstd:3+solid64k",
            "zstd:19+dict+solid64k"} <= names
    assert any(":shuffle:4" in n for n in names)
    for i, name in enumerate(sorted(names)):
        info = _pack_and_check(src, tmp_path / f"s{i}", files, "--codec", name)
        assert bool(info["solid_chunks"]) == ("+solid" in name), (name, info["solid_chunks"])
        assert any("dict" in cfg for cfg in info["codecs"]) == ("+dict" in name), name


@pytest.mark.long
def test_the_report_ends_with_the_pack_command(tmp_path):
    """Text and JSON reports end with a `fanstore pack` command that packs as chosen; with
    --per-kind it gives each kind that differs from the single choice its codec
    (`--kind-codec KIND=LABEL`), and the store holds each kind as the report says."""
    import shlex

    src, files = _names_tree(tmp_path / "src")
    args = ["--sample-mb", "2", "--reader", "api", "--trials", "0", *LOOSE_ARGS]
    text = run_main("select", src, *args, timeout=300)
    assert text.returncode == 0, text.stderr
    doc = json.loads(run_main("select", src, "--json", *args, timeout=300).stdout)
    assert list(doc)[-1] == "pack_command"
    want = f"fanstore pack {src} DEST --codec {doc['chosen']}"
    assert doc["pack_command"] == want
    assert text.stdout.rstrip("\n").splitlines()[-1] == f"pack      {want}"

    def run(command: str, dest) -> dict:
        words = shlex.split(command.replace(" DEST ", f" {dest} "))
        assert words[:4] == ["fanstore", "pack", src, str(dest)]
        return _pack_and_check(src, dest, files, *words[4:])

    info = run(doc["pack_command"], tmp_path / "one")
    assert "selection" not in info or info["selection"] is None  # a pinned codec

    per_kind = json.loads(run_main("select", src, "--json", "--per-kind", *args,
                                  timeout=300).stdout)
    assert per_kind["met"] and list(per_kind)[-1] == "pack_command"
    chosen = per_kind["chosen"]
    differ = sorted((k, v) for k, v in per_kind["per_kind"].items() if v != chosen)
    assert differ  # arrays, random bytes and text want different codecs
    assert per_kind["pack_command"] == f"fanstore pack {src} DEST --codec {chosen}" + "".join(
        f" --kind-codec {k}={v}" for k, v in differ)
    assert per_kind["pack_command_single"] == f"fanstore pack {src} DEST --codec {chosen}"
    info = run(per_kind["pack_command"], tmp_path / "mix")
    assert "selection" not in info or info["selection"] is None  # nothing selected again
    _codecs_by_kind(read_index(str(tmp_path / "mix")), per_kind["per_kind"],
                    per_kind["configs"])
    # `select --check` of each store with the per-kind report compares with the prediction
    # for what the store holds: the mix's for the mix, the single choice's for the other.
    report = tmp_path / "per_kind.json"
    report.write_text(json.dumps(per_kind))
    run(per_kind["pack_command_single"], tmp_path / "single")
    mix_pred, single_pred = per_kind["per_kind_predicted"], per_kind["predicted"]
    assert mix_pred["files_per_s"] != single_pred["files_per_s"]  # they can be told apart
    check = ["--report", str(report), "--reader", "api", "--mode", "sync"]
    for store, want, mix in (("mix", mix_pred, per_kind["per_kind"]),
                             ("single", single_pred, None)):
        out = json.loads(run_main("select", "--check", str(tmp_path / store), *check, "--json",
                                 timeout=300).stdout)
        assert out["predicted"]["files_per_s"] == want["files_per_s"], store
        assert out["predicted"]["mb_per_s"] == want["mb_per_s"], store
        assert out["predicted"]["per_kind"] == mix, store
        assert out["measured_over_predicted"] == pytest.approx(
            out["measured"]["files_per_s"] / want["files_per_s"], rel=1e-2, abs=1e-3)
    text = run_main("select", "--check", str(tmp_path / "mix"), *check, timeout=300).stdout
    line = next(x for x in text.splitlines() if x.startswith("predicted "))
    assert "for the per-kind mix (" + ", ".join(
        f"{k}={v}" for k, v in sorted(per_kind["per_kind"].items())) + ")" in line
    assert not [x for x in text.splitlines() if "this store holds" in x]  # as predicted


@pytest.mark.parametrize("args, message", [
    (("--codec", "zstd:3+solid64k", "--solid-kb", "16"),
     "--codec zstd:3+solid64k and --solid-kb 16 ask for different solid blocks"),
    (("--codec", "zstd:3+solid2048k"),
     ("--codec zstd:3+solid2048k: solid blocks of 2048 KiB are larger than the chunk size "
      "(1024 KiB; raise --chunk-kb)")),
    (("--codec", "zstd:3+solid64k+dict"), "--codec: invalid codec spec 'zstd:3+solid64k+dict'"),
    (("--codec", "zstd:19+dict+solid64k+solid64k"), "'+solidNk' comes once"),
    (("--kind-codec", "json/tiny=zstd:3"), "--kind-codec goes with a pinned --codec"),
    (("--codec", "auto", "--kind-codec", "json/tiny=zstd:3"),
     "--kind-codec goes with a pinned --codec"),
    (("--codec", "lz4", "--kind-codec", "json/big=zstd:3"),
     "--kind-codec json/big=zstd:3: give KIND=SPEC with KIND as EXT/BAND"),
    (("--codec", "lz4", "--kind-codec", "txt/tiny=zstd:3", "--kind-codec", "txt/tiny=lz4"),
     "--kind-codec: txt/tiny is given twice"),
    (("--codec", "lz4", "--kind-codec", "txt/tiny=zstd:99x"), "--kind-codec txt/tiny=zstd:99x:"),
])
def test_codec_spec_usage_errors(tmp_path, args, message):
    src = write_files(tmp_path / "src", {"a.txt": b"abc"})
    proc = run_main("pack", src, str(tmp_path / "s"), *args, "--no-progress")
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("\n") == 1 and message in proc.stderr, proc.stderr
    assert not (tmp_path / "s").exists()


def test_solid_suffix_is_solid_kb(tmp_path):
    """`--codec X+solidNk`, `--codec X --solid-kb N` and both at once pack the same bytes."""
    src, files = _names_tree(tmp_path / "src")
    stores = []
    for i, args in enumerate((("--codec", "zstd:3+solid16k"),
                              ("--codec", "zstd:3", "--solid-kb", "16"),
                              ("--codec", "zstd:3+solid16k", "--solid-kb", "16"))):
        _pack_and_check(src, tmp_path / f"s{i}", files, *args)
        index = read_index(str(tmp_path / f"s{i}"))
        stores.append(([p.checksum for p in index.partitions], index.codecs,
                       index.meta["counts"]))
    assert stores[0] == stores[1] == stores[2]
    assert read_index(str(tmp_path / "s0")).version == 5


def test_access_pattern_by_kind():
    from fanstore.kinds import access_pattern

    assert access_pattern(file_kind("db/data.mdb", 1 << 30)) == "random"
    assert access_pattern(file_kind("rows.h5", 5 << 20)) == "random"
    assert access_pattern(file_kind("a.npy", 100 << 10)) == "whole"  # within one chunk
    assert access_pattern(file_kind("shard-0001.tar", 1 << 30)) == "sequential"


def test_the_report_says_which_kinds_it_reads_at_random_offsets(tmp_path):
    """A large HDF5 file beside small text files: the JSON gives each kind's access
    pattern, and the text report says what it assumed for the one read at random offsets."""
    src = tmp_path / "src"
    (src / "t").mkdir(parents=True)
    rng = np.random.default_rng(4)
    (src / "rows.h5").write_bytes(smooth_floats(rng, 300_000).tobytes()[:(1 << 20) + 4096])
    for i in range(40):
        (src / "t" / f"{i}.txt").write_bytes(b"some words again " * (50 + i))
    args = ["--sample-mb", "1", "--reader", "api", "--trials", "0", *LOOSE_ARGS]
    doc = json.loads(run_main("select", src, "--json", *args, timeout=300).stdout)
    assert doc["kinds"]["h5/large"]["access"] == "random"
    assert doc["kinds"]["txt/tiny"]["access"] == "whole"
    text = run_main("select", src, *args, timeout=300)
    assert text.returncode == 0, text.stderr
    line = next(x for x in text.stdout.splitlines() if x.startswith("access"))
    assert "h5/large: read at random offsets" in line and "once per node" in line
