#!/usr/bin/env python3
"""Check the codec selector's predictions against the store's real read path.

Runs the selector on a dataset (generated, or --data), packs it with the chosen codec and a
few fixed ones, reads every file through ``LocalStore`` in one thread (warm page cache, no
chunk cache, ``iter_file``) and compares predicted and store ratio, and predicted and
measured single-core MB/s (per CPU second; wall clock alongside). Prints a markdown table
(docs/selection.md keeps the numbers of the development machine).

    python tools/bench/select_validate.py --files 1500 --work /tmp/selval
    python tools/bench/select_validate.py --data /data/ds --also none,zstd:3 --per-kind
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, ROOT)

from compressors import parse_spec  # noqa: E402
from fanstore.pack import CodecPolicy, PackOptions, pack  # noqa: E402
from fanstore.select.packpolicy import policy_from_selection  # noqa: E402
from fanstore.select import SelectionOptions, run_selection  # noqa: E402
from fanstore.select.policy import Cost  # noqa: E402
from fanstore.select.report import summary_line  # noqa: E402
from fanstore.store import LocalStore  # noqa: E402

MB = 1e6


def read_all(store_dir: str, passes: int) -> tuple[float, float, float, int, int]:
    """Read every file of the store once per pass; medians over the passes of: the thread's
    CPU seconds, the wall seconds, the CPU seconds to only ``pread`` every chunk's stored
    bytes (the warm page cache as "storage"); then the file count and the raw bytes."""
    with LocalStore(store_dir, cache_bytes=0) as store:
        entries = list(store.ns.walk_files())
        total = sum(store.ns.size(e) for e in entries)
        c = store.index.chunks
        extents = list(zip(c["part"].tolist(), c["offset"].tolist(), c["stored"].tolist()))
        fetch = store.parts.fetch

        def one() -> tuple[float, float]:
            t0, w0 = time.thread_time(), time.perf_counter()
            for e in entries:
                for _chunk in store.iter_file(e):
                    pass
            return time.thread_time() - t0, time.perf_counter() - w0

        def io() -> float:
            t0 = time.thread_time()
            for part, off, n in extents:
                fetch(part, off, n)
            return time.thread_time() - t0

        one()  # warm the page cache and the codec contexts
        runs = [one() for _ in range(passes)]
        io_s = statistics.median(io() for _ in range(passes))
        return (statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs),
                io_s, len(entries), total)


def predicted_cost(result, label: str | None) -> Cost:
    """The selector's per-byte cost of one codec, or of its per-kind mix (label None)."""
    if label is None:
        return result.per_kind_cost
    return result.candidate(label).cost


def cost_of_spec(result, spec: str) -> Cost | None:
    """A fixed codec's cost as the selector measured it (None if it was not a candidate)."""
    try:
        return result.candidate(spec).cost
    except KeyError:
        return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", help="dataset to use (default: generate one)")
    p.add_argument("--files", type=int, default=1500, help="files to generate (default 1500)")
    p.add_argument("--large", type=int, default=0, help="large .f32 files to generate")
    p.add_argument("--large-mb", type=int, default=48)
    p.add_argument("--work", help="work directory (default: a temporary one, removed)")
    p.add_argument("--mode", choices=("sync", "prefetch"), default="prefetch")
    p.add_argument("--mb-per-sec", type=float, default=None)
    p.add_argument("--files-per-sec", type=float, default=None)
    p.add_argument("--cores", type=int, default=4)
    p.add_argument("--sample-mb", type=float, default=200.0)
    p.add_argument("--storage-mb-per-sec", type=float, default=2000.0,
                   help="storage bandwidth for the selector (default 2000; not validated "
                        "here: the page cache is warm)")
    p.add_argument("--per-kind", action="store_true", help="validate the per-kind mix too")
    p.add_argument("--also", default="none,lz4,zstd:3,zstd:19",
                   help="fixed codecs packed and compared as well (comma-separated specs)")
    p.add_argument("--passes", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)

    work = a.work or tempfile.mkdtemp(prefix="fanstore-selval-")
    os.makedirs(work, exist_ok=True)
    try:
        data = a.data
        if not data:
            data = os.path.join(work, "data")
            if not os.path.isdir(data):
                cmd = [sys.executable, os.path.join(ROOT, "tools", "gen_dataset.py"), data,
                       "--files", str(a.files)]
                if a.large:
                    cmd += ["--large", str(a.large), "--large-mb", str(a.large_mb)]
                subprocess.run(cmd, check=True)
        opts = SelectionOptions(mode=a.mode, mb_per_sec=a.mb_per_sec,
                                files_per_sec=a.files_per_sec, cores=a.cores,
                                sample_mb=a.sample_mb, seed=a.seed, per_kind=a.per_kind,
                                storage_mb_per_sec=a.storage_mb_per_sec, progress=False)
        print(f"selecting on {data} ...", file=sys.stderr)
        result = run_selection(data, opts)
        print(summary_line(result), file=sys.stderr)

        runs: list[tuple[str, object, Cost]] = []
        # The chosen candidate as pack applies it (dictionaries per kind, solid blocks).
        c = result.candidate(result.chosen)
        chosen_policy = CodecPolicy(c.codec, dict(c.by_kind), c.solid,
                                    {k: c.solid for k in c.by_kind})
        runs.append((f"{result.chosen} (chosen)", chosen_policy,
                     predicted_cost(result, result.chosen)))
        if a.per_kind and result.per_kind is not None:
            runs.append(("per-kind mix (chosen)", policy_from_selection(result),
                         predicted_cost(result, None)))
        for spec in [s for s in a.also.split(",") if s and s != result.chosen]:
            cost = cost_of_spec(result, spec)
            if cost is None:
                print(f"skipping {spec}: not among the selector's candidates", file=sys.stderr)
                continue
            runs.append((spec, CodecPolicy(parse_spec(spec)), cost))

        rows = []
        for name, pol, cost in runs:
            dest = os.path.join(work, "store")
            print(f"packing with {name} ...", file=sys.stderr)
            pack(data, dest, pol, PackOptions(partitions=2, progress=False, force=True))
            seconds, wall, io_s, n_files, raw = read_all(dest, a.passes)
            from fanstore.format.index import read_index

            counts = read_index(dest).meta["counts"]
            ratio = counts["raw_bytes"] / counts["stored_bytes"]
            pred = 1 / cost.cpu  # decode + checksum only
            pred_io = raw / (raw * cost.cpu + io_s)  # sync model, 1 core, S = page cache
            meas = raw / seconds
            rows.append((name, cost.ratio, ratio, pred / MB, pred_io / MB, meas / MB,
                         n_files / seconds, raw / wall / MB))
            shutil.rmtree(dest, ignore_errors=True)
        print()
        print(f"dataset: {data} ({result.files:,} files, {result.raw_bytes / MB:,.1f} MB, "
              f"mean {result.raw_bytes / result.files / 1e3:,.1f} kB); sample "
              f"{result.sample_bytes / MB:,.1f} MB; LocalStore, 1 thread, warm page cache, "
              f"no chunk cache, median of {a.passes} passes")
        print()
        print("| codec | ratio predicted | ratio store | MB/s predicted: decode+checksum | "
              "MB/s predicted: + read of stored bytes | MB/s measured (CPU) | "
              "files/s measured (CPU) | MB/s measured (wall) | error vs decode+checksum | "
              "error vs + read |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for name, rp, rs, pp, pio, pm, fm, pw in rows:
            print(f"| {name} | {rp:.3f} | {rs:.3f} | {pp:,.0f} | {pio:,.0f} | {pm:,.0f} | "
                  f"{fm:,.0f} | {pw:,.0f} | {pm / pp - 1:+.0%} | {pm / pio - 1:+.0%} |")
    finally:
        if not a.work:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
