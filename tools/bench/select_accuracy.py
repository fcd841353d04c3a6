#!/usr/bin/env python3
"""Does the selector predict what a reader gets, and does the default pack beat mksquashfs?

For each data set (a directory), in one sitting:

1. ``mksquashfs -comp zstd -Xcompression-level 3`` and ``fanstore pack`` with its default
   (the quick selection) and, optionally, ``--codec auto``: stored bytes and ratio.
2. ``fanstore select --reader mount`` and ``--reader api`` (``--cores N``, sync mode, the
   default budget): the chosen candidate and its predicted files/s per node.
3. The store packed with the mount selection's choice, read by N processes in random order,
   ``--files`` files: through a real ``fanstore mount`` (the default frontend) and through
   ``fanstore.open_store`` (the Python API), each cold (page cache dropped) and warm.
   Predicted vs measured, for the same codec (the API prediction is the api report's row of
   that codec).

Results go to ``tools/bench/results/select_accuracy.jsonl`` and, unless ``--no-docs``, to the
``select_accuracy`` section of docs/selection.md.

    tools/bench/select_accuracy.py /work/cap/small-text /work/cap/peers /work/cap/mixed \\
        --work /tmp/acc --readers 2 --auto small-text
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import shutil
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

REPO = common.REPO
FANSTORE = os.path.join(os.path.dirname(sys.executable), "fanstore")
SELECTION_MD = os.path.join(REPO, "docs", "selection.md")


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def run(cmd: list[str], ok=(0,), **kw) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False, **kw)
    if proc.returncode not in ok:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}): "
                         f"{proc.stderr.strip()[-2000:]}")
    return proc


def tree_bytes(root: str) -> tuple[int, list[str]]:
    total, rels = 0, []
    for d, _dirs, files in os.walk(root):
        for name in files:
            p = os.path.join(d, name)
            if os.path.isfile(p) and not os.path.islink(p):
                total += os.path.getsize(p)
                rels.append(os.path.relpath(p, root))
    return total, rels


def pack_args(label: str) -> list[str]:
    """``fanstore pack`` options that pack a selector candidate's label: the label itself
    (one codec-spec grammar: ``zstd:19+dict+solid64k`` is a ``--codec``)."""
    return ["--codec", label]


# --------------------------------------------------------------------------- readers


def _api_reader(store: str, rels: list[str], barrier, out, slot: int) -> None:
    import fanstore

    try:
        with fanstore.open_store(store) as s:
            barrier.wait(600)
            t0 = time.perf_counter()
            for rel in rels:
                s.read(rel)
            out[slot] = time.perf_counter() - t0
    except BaseException:  # noqa: BLE001 - the parent reports a failed pass
        out[slot] = -1.0
        try:
            barrier.abort()
        except Exception:  # noqa: BLE001
            pass


def api_pass(store: str, rels: list[str], readers: int) -> float:
    """Files/s of ``readers`` processes reading ``rels`` dealt round-robin (fork, barrier)."""
    ctx = mp.get_context("fork")
    barrier = ctx.Barrier(readers + 1)
    out = ctx.Array("d", readers)
    procs = [ctx.Process(target=_api_reader, args=(store, rels[i::readers], barrier, out, i))
             for i in range(readers)]
    for p in procs:
        p.start()
    barrier.wait(600)
    t0 = time.perf_counter()
    for p in procs:
        p.join(900)
    wall = time.perf_counter() - t0
    if any(v < 0 for v in out):
        raise SystemExit(f"an API reader of {store} failed")
    return len(rels) / wall


def mount_pass(mnt: str, list_file: str, readers: int) -> float:
    proc = run([sys.executable, os.path.join(REPO, "tools", "bench", "reader.py"), "read",
                "--root", mnt, "--list", list_file, "--workers", str(readers),
                "--seed", "1"])
    row = json.loads(proc.stdout.strip().splitlines()[-1])
    if row.get("errors"):
        raise SystemExit(f"reading through {mnt}: {row.get('first_error')}")
    return float(row["files_per_s"])


# --------------------------------------------------------------------------- one data set


def measure(data: str, name: str, a, rows: list[dict], emit) -> None:
    work = os.path.join(a.work, name)
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    raw, rels = tree_bytes(data)
    base = {"dataset": name, "files": len(rels), "raw_bytes": raw}
    log(f"{name}: {len(rels):,} files, {raw / 1e6:,.0f} MB")

    if not a.no_capacity:
        img = os.path.join(work, "img.sqfs")
        t0 = time.monotonic()
        run(["mksquashfs", data, img, "-comp", "zstd", "-Xcompression-level", "3",
             "-noappend", "-no-progress", "-quiet", "-processors", str(os.cpu_count() or 1)])
        emit({**base, "kind": "capacity", "option": "mksquashfs zstd-3",
              "stored_bytes": os.path.getsize(img), "seconds": round(time.monotonic() - t0, 1)})
        os.unlink(img)

    packs = [] if a.no_capacity else [("fanstore pack (default)", [])]
    if name in a.auto:
        packs.append(("fanstore pack --codec auto", ["--codec", "auto", "--cores",
                                                     str(a.readers)]))
    for label, extra in packs:
        dest = os.path.join(work, "store-default")
        t0 = time.monotonic()
        proc = run([FANSTORE, "pack", data, dest, "--no-progress", "--force", *extra])
        line = next((ln for ln in proc.stderr.splitlines() if "selection" in ln), "")
        emit({**base, "kind": "capacity", "option": label,
              "stored_bytes": common.dir_bytes(dest),
              "seconds": round(time.monotonic() - t0, 1), "line": line.strip()})
        shutil.rmtree(dest)

    # one prediction per reader: the mount calibrated through each FUSE frontend (the
    # selector measures whichever frontend `fanstore mount` uses: FANSTORE_FRONTEND)
    predictions = {}
    for reader in (*a.frontends, "api"):
        env = dict(os.environ, FANSTORE_FRONTEND=reader) if reader != "api" else None
        proc = run([FANSTORE, "select", data, "--reader", "api" if reader == "api" else "mount",
                    "--cores", str(a.readers), "--sample-mb", str(a.sample_mb), "--json",
                    *a.select_args.split()], ok=(0, 3), env=env)
        predictions[reader] = json.loads(proc.stdout)
    chosen = predictions[a.frontends[0]]["chosen"]
    store = os.path.join(work, "store-chosen")
    run([FANSTORE, "pack", data, store, "--no-progress", *pack_args(chosen)])
    stored = common.dir_bytes(store)

    rng = random.Random(a.seed)
    pick = rng.sample(rels, min(a.files, len(rels)) if a.files > 0 else len(rels))
    list_file = os.path.join(work, "list.txt")
    with open(list_file, "w") as f:
        f.write("".join(r + "\n" for r in pick))

    measured: dict[tuple[str, str], float] = {}
    stats: dict[str, dict] = {}
    mnt = os.path.join(work, "mnt")
    os.makedirs(mnt, exist_ok=True)
    for frontend in a.frontends:
        run([FANSTORE, "mount", store, mnt, "--local-dir", os.path.join(work, "local"),
             "--frontend", frontend])
        try:
            run([FANSTORE, "wait", mnt])
            common.drop_caches()
            measured[frontend, "cold"] = mount_pass(mnt, list_file, a.readers)
            stats[frontend] = json.loads(run([FANSTORE, "stats", mnt, "--json"]).stdout)
            measured[frontend, "warm"] = mount_pass(mnt, list_file, a.readers)
        finally:
            subprocess.run([FANSTORE, "umount", mnt], capture_output=True, check=False)
    common.drop_caches()
    measured["api", "cold"] = api_pass(store, pick, a.readers)
    measured["api", "warm"] = api_pass(store, pick, a.readers)
    for reader in (*a.frontends, "api"):
        doc = predictions[reader]
        row = next(c for c in doc["candidates"] if c["codec"] == chosen)
        for phase in ("cold", "warm"):
            extra = {}
            if phase == "cold" and reader in stats:  # decodes per file read, cold pass
                st = stats[reader]
                extra = {"chunks_decoded": st.get("chunks_decoded"), "reads": st.get("reads"),
                         "files_read_cold": len(pick)}
            emit({**base, "kind": "accuracy", "reader": reader, "phase": phase, **extra,
                  "codec": chosen, "ratio": raw / stored, "readers": a.readers,
                  "files_read": len(pick),
                  "predicted_files_per_s": row["files_per_s"],
                  "measured_files_per_s": round(measured[reader, phase], 1),
                  "reader_calibration": doc.get("reader"),
                  "storage_mb_per_s": doc["budget"]["storage_mb_per_s"],
                  "read_amplification": row.get("read_amplification"),
                  "select_args": a.select_args, "own_choice": doc["chosen"]})
    shutil.rmtree(work, ignore_errors=True)


# --------------------------------------------------------------------------- output


def render(rows: list[dict], a) -> str:
    out = [f"Measured by `tools/bench/select_accuracy.py` on {time.strftime('%Y-%m-%d')} "
           f"(commit {common.git_commit()}), "
           f"{a.readers} readers = `--cores {a.readers}`, sync mode, default budget; each "
           "pass reads the files in random order (a sample, or every file: column 'files "
           "read'); cold = page cache dropped, a fresh mount; a mount row names its FUSE "
           "frontend ('mount' alone: the default frontend of that run). Each data set's "
           "latest run (column 'run').", "",
           "Capacity (stored bytes; ratio = raw / stored):", "",
           "| data set | files | raw MB | mksquashfs zstd-3 | fanstore pack (default) | "
           "default / mksquashfs | --codec auto | auto / mksquashfs |",
           "|---|---|---|---|---|---|---|---|"]
    for name in dict.fromkeys(r["dataset"] for r in rows):
        cap = {r["option"]: r for r in rows if r["dataset"] == name and r["kind"] == "capacity"}
        if not cap:
            continue
        any_row = next(iter(cap.values()))
        raw = any_row["raw_bytes"]

        def ratio(opt):
            r = cap.get(opt)
            return raw / r["stored_bytes"] if r else None

        sq, de, au = (ratio("mksquashfs zstd-3"), ratio("fanstore pack (default)"),
                      ratio("fanstore pack --codec auto"))
        out.append(f"| {name} | {any_row['files']:,} | {raw / 1e6:,.0f} | "
                   f"{common.num(sq, 3)}x | {common.num(de, 3)}x | "
                   f"{common.ratio(de, sq) if de and sq else '-'} | "
                   f"{common.num(au, 3) + 'x' if au else '-'} | "
                   f"{common.ratio(au, sq) if au and sq else '-'} |")
    out += ["", "Predicted vs measured files/s for the codec `fanstore select --reader mount` "
            "chose (the api row is the api report's prediction for the same codec):", "",
            "| data set | run | codec | reader | files read | predicted files/s | measured "
            "cold | cold / predicted | measured warm | warm / predicted |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    for name in dict.fromkeys(r["dataset"] for r in rows):
        readers = dict.fromkeys(r["reader"] for r in rows if r["dataset"] == name
                                and r["kind"] == "accuracy")
        for reader in readers:
            acc = {r["phase"]: r for r in rows if r["dataset"] == name
                   and r["kind"] == "accuracy" and r["reader"] == reader}
            if not acc:
                continue
            p = acc["cold"]["predicted_files_per_s"]
            c, w = acc["cold"]["measured_files_per_s"], acc["warm"]["measured_files_per_s"]
            label = {"mount": "mount (kernel)"}.get(reader, reader)
            if reader in ("kernel", "pyfuse3"):
                label = f"mount ({reader})"
            args = acc["cold"].get("select_args")
            out.append(f"| {name} | {acc['cold']['run_id']} | {acc['cold']['codec']}"
                       f"{' (`' + args + '`)' if args else ''} | "
                       f"{label} | {acc['cold'].get('files_read', 4000):,} | {common.num(p)} | "
                       f"{common.num(c)} | {common.ratio(c, p)} | {common.num(w)} | "
                       f"{common.ratio(w, p)} |")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("data", nargs="+")
    p.add_argument("--work", required=True)
    p.add_argument("--readers", type=int, default=2)
    p.add_argument("--files", type=int, default=4000,
                   help="files read per pass, a random sample (0: every file, an epoch: "
                        "needed where a few large files hold most bytes, since the model's "
                        "files/s is bytes/s over the mean file size)")
    p.add_argument("--sample-mb", type=float, default=64.0)
    p.add_argument("--auto", default="", help="data set names also packed with --codec auto")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--frontends", default="kernel",
                   help="FUSE frontends to read through, comma-separated (kernel,pyfuse3)")
    p.add_argument("--select-args", default="",
                   help="more `fanstore select` options, e.g. '--files-per-sec 1000'")
    p.add_argument("--no-capacity", action="store_true",
                   help="skip mksquashfs and the default pack (prediction only)")
    p.add_argument("--no-docs", action="store_true")
    p.add_argument("--results", default=os.path.join(common.RESULTS_DIR,
                                                     "select_accuracy.jsonl"))
    a = p.parse_args(argv)
    a.auto = set(filter(None, a.auto.split(",")))
    a.frontends = [f for f in a.frontends.split(",") if f]
    if os.geteuid() != 0:
        p.error("needs root (drops the page cache for the cold passes)")
    rows: list[dict] = []
    run_id = time.strftime("%Y%m%dT%H%M%S")
    os.makedirs(os.path.dirname(a.results), exist_ok=True)

    def emit(row: dict) -> None:
        row["run_id"] = run_id
        rows.append(row)
        with open(a.results, "a") as f:
            f.write(json.dumps(row) + "\n")
        log(json.dumps({k: v for k, v in row.items() if k != "reader_calibration"}))

    for data in a.data:
        measure(os.path.abspath(data), os.path.basename(os.path.normpath(data)), a, rows, emit)
    # The table: each data set's latest run in the results file (a data set can be measured
    # again alone, e.g. with --files 0, without losing the others).
    # Capacity and accuracy rows each from their own latest run (a --no-capacity run keeps
    # the data set's capacity row).
    latest: dict[tuple[str, bool], str] = {}
    with open(a.results) as f:
        saved = [json.loads(line) for line in f if line.strip()]
    for r in saved:
        key = (r["dataset"], r["kind"] == "capacity")
        latest[key] = max(latest.get(key, ""), r["run_id"])
    text = render([r for r in saved
                   if r["run_id"] == latest[r["dataset"], r["kind"] == "capacity"]], a)
    print(text)
    if not a.no_docs:
        common.replace_section("select_accuracy", text, path=SELECTION_MD)
    return 0


if __name__ == "__main__":
    sys.exit(main())
