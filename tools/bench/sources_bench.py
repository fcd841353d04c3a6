#!/usr/bin/env python3
"""Packing from an archive, and stage-in from object storage (docs/sources.md).

A. The peer dataset's small files as one tar: `fanstore pack data.tar` (streamed) vs `tar
   -xf` + `fanstore pack dir` (and with `--before REV` the tar packed by revision REV),
   caches dropped before each step, alternating, `--reps` times.
B. That store packed into a local S3 endpoint (moto), staged with 1 and 8 range-read
   streams (`stage_partitions`). What is measured: docs/benchmarks.md, "Packing from a tar".

    .venv/bin/python tools/bench/sources_bench.py [--files 20000] [--reps 2] [--work DIR]
        [--before REV] [--no-docs]
"""

from __future__ import annotations

import argparse
import filecmp
import json
import os
import shutil
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(HERE)), "tests"))

from harness import (  # noqa: E402
    DOCS,
    REPO,
    RESULTS_DIR,
    drop_caches,
    export_revision,
    log,
    machine_table,
    now_utc,
    replace_section,
    spread,
    table,
    timed,
)

PY = sys.executable
FANSTORE = os.path.join(os.path.dirname(PY), "fanstore")
PEER_GEN = os.path.join(os.path.dirname(REPO), "shared", "bench", "gen_dataset.py")


def generate(data: str, files: int) -> str:
    """Make the dataset (unless a run before made it); how it was made."""
    record = data + "-how.txt"
    if os.path.isdir(data):
        try:
            with open(record) as f:
                return f.read().strip()
        except OSError:
            return "existing"
    if os.path.exists(PEER_GEN):
        lists = data + "-lists"
        subprocess.run([PY, PEER_GEN, "--out", data, "--lists", lists, "--n-small", str(files),
                        "--n-large", "0"], check=True)
        how = f"../shared/bench/gen_dataset.py --n-small {files} --n-large 0"
    else:
        subprocess.run([PY, os.path.join(REPO, "tools", "gen_dataset.py"), data, "--files",
                        str(files), "--classes", "100", "--min-kb", "50", "--max-kb", "150"],
                       check=True)
        how = f"tools/gen_dataset.py --files {files} --classes 100 --min-kb 50 --max-kb 150"
    with open(record, "w") as f:
        f.write(how + "\n")
    return how


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--files", type=int, default=20000)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--work", default="/tmp/fanstore-sourcesbench")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--before", metavar="REV",
                    help="also pack the tar with the code of this git revision")
    ap.add_argument("--no-docs", action="store_true")
    ap.add_argument("--docs", default=DOCS, help="markdown file the section is written to")
    ap.add_argument("--results", default=os.path.join(RESULTS_DIR, "sources-bench.jsonl"))
    return ap.parse_args(argv)


def pack_ways(a: argparse.Namespace, archive: str, pack_args: list[str]) -> list[dict]:
    """A. Pack from the tar vs extract + pack (vs the tar by an earlier revision)."""
    rows, ways = [], ("tar", "extract") + (("before",) if a.before else ())
    if a.before:
        old_code = export_revision(a.before, a.work)
        old_cmd = [PY, "-c", "import sys; from fanstore.cli import main; sys.exit(main())"]
        old_env = dict(os.environ, PYTHONPATH=old_code)
    for rep in range(a.reps):
        for way in ways:
            store = os.path.join(a.work, f"store-{way}")
            if way in ("tar", "before"):
                dropped = drop_caches()
                if way == "tar":
                    r = timed([FANSTORE, "pack", archive, store] + pack_args)
                else:
                    r = timed(old_cmd + ["pack", archive, store] + pack_args, env=old_env)
                rows.append({"part": "A", "way": way, "rep": rep, "wall": r["wall"],
                             "cpu": r["cpu"], "dropped": dropped})
            else:
                ex = os.path.join(a.work, "extracted")
                shutil.rmtree(ex, ignore_errors=True)
                os.makedirs(ex)
                dropped = drop_caches()
                r1 = timed(["tar", "-C", ex, "-xf", archive])
                drop_caches()
                r2 = timed([FANSTORE, "pack", ex, store] + pack_args)
                rows.append({"part": "A", "way": way, "rep": rep, "wall": r1["wall"] + r2["wall"],
                             "cpu": r1["cpu"] + r2["cpu"], "extract_wall": r1["wall"],
                             "extract_cpu": r1["cpu"], "pack_wall": r2["wall"],
                             "pack_cpu": r2["cpu"], "dropped": dropped})
                shutil.rmtree(ex, ignore_errors=True)
            log(f"A {way} rep {rep}: {rows[-1]['wall']:.1f} s wall, {rows[-1]['cpu']:.1f} s CPU")
    return rows


def same_trees(work: str) -> str:
    """"True" when the tar's and the extracted tree's stores hold the same entries."""
    return subprocess.run([PY, "-c", (
        "import sys\nfrom fanstore.format.index import read_index\n"
        "def t(s):\n i=read_index(s)\n return {i.path(k): (int(i.entries['kind'][k]), "
        "int(i.entries['mode'][k]) & 0o777, int(i.entries['size'][k]), "
        "int(i.entries['checksum'][k])) "
        "for k in range(1, i.n_entries)}\n"
        "print(t(sys.argv[1]) == t(sys.argv[2]))"),
        os.path.join(work, "store-tar"), os.path.join(work, "store-extract")],
        capture_output=True, text=True).stdout.strip()


def stage_streams(a: argparse.Namespace, archive: str, pack_args: list[str]) -> list[dict]:
    """B. Stage-in from a local S3 endpoint, 1 vs 8 streams."""
    from s3_helpers import MotoServer

    rows, server = [], MotoServer.start(a.work)
    try:
        env = dict(os.environ, **server.env)
        server.fs().mkdir("bench")
        url = "s3://bench/ds.fs"
        up = timed([FANSTORE, "pack", archive, url]
                   + pack_args, env=env)
        log(f"B: packed into {url} in {up['wall']:.1f} s")
        local = os.path.join(a.work, "staged")
        code = (
            "import json, sys\n"
            "from fanstore.format.index import read_index\n"
            "from fanstore.daemon.staging import stage_partitions\n"
            f"index = read_index({url!r})\n"
            f"r = stage_partitions({url!r}, {local!r}, index, "
            "list(range(len(index.partitions))), jobs=int(sys.argv[1]))\n"
            "print(json.dumps(r.to_json()))\n")
        for rep in range(a.reps):
            for streams in (1, 8):
                shutil.rmtree(local, ignore_errors=True)
                drop_caches()
                r = timed([PY, "-c", code, str(streams)], env=env)
                rep_json = json.loads(r["stdout"])
                rows.append({"part": "B", "streams": streams, "rep": rep, "wall": r["wall"],
                             "cpu": r["cpu"], "bytes": rep_json["staged_bytes"],
                             "stage_seconds": rep_json["stage_seconds"]})
                log(f"B {streams} streams rep {rep}: {rep_json['staged_bytes'] / 1e6:.0f} MB "
                    f"in {rep_json['stage_seconds']:.2f} s")
        shutil.rmtree(local, ignore_errors=True)
    finally:
        server.stop()
    return rows


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    os.makedirs(a.work, exist_ok=True)
    data = os.path.join(a.work, "data")
    how = generate(data, a.files)
    root = os.path.join(data, "small") if os.path.isdir(os.path.join(data, "small")) else data
    n_files = sum(len(f) for _, _, f in os.walk(root))
    raw = sum(os.path.getsize(os.path.join(t, f)) for t, _, fs in os.walk(root) for f in fs)
    archive = os.path.join(a.work, "data.tar")
    if not os.path.exists(archive):
        subprocess.run(["tar", "-C", root, "-cf", archive, "."], check=True)
    pack_args = ["--codec", "zstd:3", "--partitions", "8", "--jobs", str(a.jobs),
                 "--no-progress", "--force"]
    os.makedirs(os.path.dirname(os.path.abspath(a.results)), exist_ok=True)
    rows = pack_ways(a, archive, pack_args)
    same = same_trees(a.work)
    rows += stage_streams(a, archive, pack_args)
    with open(a.results, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    identical = None
    if a.before:
        tar_store, old_store = (os.path.join(a.work, f"store-{w}") for w in ("tar", "before"))
        names = sorted(os.listdir(tar_store))
        identical = names == sorted(os.listdir(old_store)) and all(
            filecmp.cmp(os.path.join(tar_store, n), os.path.join(old_store, n), shallow=False)
            for n in names)
    body = render(rows, a, how, n_files, raw, os.path.getsize(archive), same, identical)
    if a.no_docs:
        print(body)
    else:
        replace_section("sources_bench", body, a.docs)
        log(f"wrote {a.docs} (section sources_bench)")
    return 0


def render(rows, a, how, n_files, raw, tar_size, same, identical=None) -> str:
    def vals(part, key, **kw):
        return [r[key] for r in rows if r["part"] == part and all(r.get(k) == v
                                                                  for k, v in kw.items())]

    def median(way: str, key: str) -> float:
        return statistics.median(vals("A", key, way=way))

    ways = [("tar", "`fanstore pack data.tar` (streamed)"),
            ("extract", "`tar -xf` + `fanstore pack dir`")]
    packs = [(label, spread(vals("A", "wall", way=way), 1), spread(vals("A", "cpu", way=way), 1),
              spread([c / n_files * 1e6 for c in vals("A", "cpu", way=way)]))
             for way, label in ways]
    packs += [(label, spread(vals("A", f"{key}_wall", way="extract"), 1),
               spread(vals("A", f"{key}_cpu", way="extract"), 1), "")
              for key, label in (("extract", "(of which `tar -xf`)"),
                                 ("pack", "(of which pack of the extracted tree)"))]
    if a.before:
        cpu = vals("A", "cpu", way="before")
        packs.append((f"`fanstore pack data.tar` by `{a.before}` (before)",
                      spread(vals("A", "wall", way="before"), 1), spread(cpu, 1),
                      spread([c / n_files * 1e6 for c in cpu])))
    notes = []
    if vals("A", "wall", way="tar") and vals("A", "wall", way="extract"):
        notes = ["", f"Streamed pack / (extract + pack), medians: wall "
                 f"{median('tar', 'wall') / median('extract', 'wall'):.2f}x, CPU "
                 f"{median('tar', 'cpu') / median('extract', 'cpu'):.2f}x; same paths, kinds, "
                 f"sizes, modes and checksums in both stores: {same}."]
        if a.before and vals("A", "wall", way="before"):
            notes.append(f"Streamed pack now / by `{a.before}`, medians: wall "
                         f"{median('tar', 'wall') / median('before', 'wall'):.2f}x, CPU "
                         f"{median('tar', 'cpu') / median('before', 'cpu'):.2f}x; the two "
                         f"stores are byte-identical (every partition and the index): "
                         f"{identical}.")
    stage = []
    for s in (1, 8):
        secs, mb = vals("B", "stage_seconds", streams=s), vals("B", "bytes", streams=s)
        stage.append((s, f"{mb[0] / 1e6:,.0f}", spread(secs, 2), spread(
            [b / 1e6 / x for b, x in zip(mb, secs) if x]), spread(vals("B", "cpu", streams=s), 1))
            if mb else (s, "–", "", "", ""))
    return "\n".join([
        f"Run {now_utc()}, {a.reps} repetitions of each step, alternating; median (min-max).",
        "", machine_table(a.work), "",
        f"### A. Pack from a tar vs extract + pack ({n_files:,} files, {raw / 1e9:.2f} GB; "
        f"tar {tar_size / 1e9:.2f} GB)", "",
        f"Dataset: `{how}`; `--codec zstd:3 --partitions 8 --jobs {a.jobs}`.", "",
        table(["way", "wall s", "CPU s", "CPU µs per file"], packs, "llll"),
        *notes, "",
        table(["streams", "staged MB", "stage s", "MB/s", "process CPU s"], stage, "lllll",
              "B. Stage-in from a local S3 endpoint: 1 vs 8 range-read streams"),
        "", "### Exact commands", "", "```",
        f".venv/bin/python tools/bench/sources_bench.py --files {a.files} --reps {a.reps} "
        f"--jobs {a.jobs} --work {a.work}" + (f" --before {a.before}" if a.before else ""),
        "```"])


if __name__ == "__main__":
    sys.exit(main())
