#!/usr/bin/env python3
"""The JPEG capacity tier: ``--codec jpegxl`` against the default pack and ``zstd:3``.

On a generated set of JPEGs (tools/gen_jpegs.py: photographs scikit-image and matplotlib
ship, cropped, scaled and re-encoded as datasets are; 2,000 files by default):

A. Capacity: ``fanstore pack`` with no ``--codec`` (the quick default), ``--codec zstd:3``
   and ``--codec jpegxl``; raw bytes over the whole store (partitions and index), the pack's
   wall and CPU seconds (CPU per file), and the files jpegxl stored raw (its summary line).
B. Codec CPU on one core, in this process (``time.thread_time``, median of 3 passes over
   every file): encode (jpegxl: transcode plus the round-trip check it makes), decode, and
   a JPEG decoded to pixels by Pillow (what a training loader pays anyway) for scale.
C. Every file of the jpegxl store read back through a fresh mount and through
   ``fanstore.open_store``, compared byte for byte with the source.
D. The selector: ``fanstore select --json`` in sync and prefetch mode with a budget
   (``--files-per-sec``), its jpegxl candidate modelled and measured as a finalist (a
   trial: a miniature of the set), then ``fanstore select --check`` of the jpegxl store
   (the whole set, cold, through a fresh mount in the same mode): the model, the trial and
   the whole set side by side, each with its CPU per file.

Timing runs share the machine: run it under the benchmark lock,

    flock /tmp/fanstore-bench.lock .venv/bin/python tools/bench/jpeg_bench.py [--files 2000]
        [--files-per-sec 80] [--work DIR] [--no-docs]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from harness import (  # noqa: E402
    PY,
    REPO,
    Bench,
    args,
    dir_bytes,
    log,
    main,
    num,
    section,
    table,
    timed,
)

GEN_JPEGS = os.path.join(REPO, "tools", "gen_jpegs.py")
PACKS = (("default", []), ("zstd:3", ["--codec", "zstd:3"]), ("jpegxl", ["--codec", "jpegxl"]))
_FALLBACK = re.compile(r"^jpegxl: ([\d,]+) of ([\d,]+) files transcoded; ([\d,]+) stored raw",
                       re.M)


def _median_pass(fn, passes: int = 3) -> float:
    times = []
    for _ in range(passes):
        t0 = time.thread_time()
        fn()
        times.append(time.thread_time() - t0)
    return statistics.median(times)


class JpegBench(Bench):
    name = "jpeg_bench"

    def run(self) -> None:
        a = self.a
        self.data = os.path.join(self.work, f"jpegs-{a.files}-{a.seed}")
        if not os.path.isdir(self.data):
            argv = [PY, GEN_JPEGS, self.data, "--files", str(a.files), "--seed", str(a.seed),
                    "--jobs", "2"]
            self.cmd(argv)
            subprocess.run(argv, check=True)
        self.paths = sorted(os.path.join(d, f) for d, _, fs in os.walk(self.data) for f in fs)
        self.raw = sum(os.path.getsize(p) for p in self.paths)
        log(f"{len(self.paths)} JPEGs, {self.raw / 1e6:.1f} MB")
        for label, extra in PACKS:
            self.pack(label, extra)
        self.codec_cpu()
        self.read_back()
        for mode in ("sync", "prefetch"):
            self.select(mode)

    def pack(self, label: str, extra: list[str]) -> None:
        store = os.path.join(self.work, "stores", label.replace(":", "-"))
        shutil.rmtree(store, ignore_errors=True)
        os.makedirs(os.path.dirname(store), exist_ok=True)
        argv = [self.fanstore, "pack", self.data, store, "--partitions", "8", "--jobs", "2",
                "--no-progress", *extra]
        self.cmd(argv)
        r = timed(argv)
        wall, cpu = r["wall"], r["cpu"]
        m = _FALLBACK.search(r["stdout"])
        stored = dir_bytes(store)
        row = self.emit({"part": "pack", "codec": label, "raw": self.raw, "stored": stored,
                         "ratio": self.raw / stored, "wall_s": wall, "cpu_s": cpu,
                         "cpu_ms_per_file": cpu / len(self.paths) * 1e3,
                         "stored_raw": int(m.group(3).replace(",", "")) if m else None,
                         "chosen_line": r["stderr"].strip().splitlines()[-1:] or [""]})
        log(f"pack {label}: ratio {row['ratio']:.3f}, {cpu:.1f} s CPU")

    def codec_cpu(self) -> None:
        import io

        from PIL import Image

        from compressors import DeclinedError, parse_spec

        data = [open(p, "rb").read() for p in self.paths]
        for spec in ("jpegxl", "zstd:3"):
            codec = parse_spec(spec)
            t0 = time.thread_time()
            blobs = []
            for d in data:
                try:
                    blobs.append((codec.encode(d), d))
                except DeclinedError:
                    pass
            enc = time.thread_time() - t0
            dec = _median_pass(lambda: [codec.decode(b, len(d)) for b, d in blobs])
            self.emit({"part": "cpu", "codec": spec, "files": len(data), "coded": len(blobs),
                       "encode_ms_per_file": enc / len(data) * 1e3,
                       "decode_ms_per_file": dec / len(blobs) * 1e3})
        pix = _median_pass(lambda: [Image.open(io.BytesIO(d)).load() for d in data])
        self.emit({"part": "cpu", "codec": "JPEG to pixels (Pillow)", "files": len(data),
                   "coded": len(data), "encode_ms_per_file": None,
                   "decode_ms_per_file": pix / len(data) * 1e3})

    def read_back(self) -> None:
        import fanstore

        store = os.path.join(self.work, "stores", "jpegxl")
        mnt = os.path.join(self.mnt_root, "jpegxl")
        self.mount(store, mnt)
        bad_mount = bad_api = 0
        try:
            with fanstore.open_store(store) as api:
                for p in self.paths:
                    rel = os.path.relpath(p, self.data)
                    want = open(p, "rb").read()
                    with open(os.path.join(mnt, rel), "rb", buffering=0) as f:
                        bad_mount += f.read() != want
                    bad_api += api.read(rel) != want
        finally:
            self.umount(mnt)
        self.emit({"part": "readback", "files": len(self.paths), "mount_mismatches": bad_mount,
                   "api_mismatches": bad_api})
        log(f"read back: {bad_mount} mismatches through the mount, {bad_api} through the API")

    def select(self, mode: str) -> None:
        a = self.a
        report = os.path.join(self.work, f"select-{mode}.json")
        argv = [self.fanstore, "select", self.data, "--json", "--mode", mode, "--cores", "2",
                "--files-per-sec", str(a.files_per_sec)]
        self.cmd(argv + [">", report])
        t0 = time.monotonic()
        p = subprocess.run(argv, capture_output=True, text=True)
        seconds = time.monotonic() - t0
        if p.returncode not in (0, 3):
            raise RuntimeError(f"select failed: {p.stderr[-500:]}")
        with open(report, "w") as f:
            f.write(p.stdout)
        doc = json.loads(p.stdout)
        cand = {c["codec"]: c for c in doc["candidates"]}["jpegxl"]
        # The whole jpegxl store read cold in the same mode (whatever the selection chose).
        check = [self.fanstore, "select", "--check", os.path.join(self.work, "stores", "jpegxl"),
                 "--mode", mode, "--cores", "2", "--json"]
        self.cmd(check)
        p = subprocess.run(check, capture_output=True, text=True)
        if p.returncode not in (0, 3):
            raise RuntimeError(f"select --check failed: {p.stderr[-500:]}")
        c = json.loads(p.stdout)
        meas = cand.get("measured") or {}
        self.emit({"part": "select", "mode": mode, "budget_files_per_s": a.files_per_sec,
                   "chosen": doc["chosen"], "ratio": cand["ratio"],
                   "model_files_per_s": cand["model_files_per_s"],
                   "trial_files_per_s": meas.get("files_per_s"),
                   "trial_cpu_us_per_file": meas.get("cpu_us_per_file"),
                   "decode_cpu_us_per_file": cand.get("decode_cpu_us_per_file"),
                   "decode_cores_for_budget": cand.get("decode_cores_for_budget"),
                   "declined_units": cand.get("declined_units"),
                   "sample_units": cand.get("sample_units"),
                   "full_files_per_s": c["measured"]["files_per_s"],
                   "full_cpu_us_per_file": c["measured"]["cpu_us_per_file"],
                   "select_s": seconds, "load1": os.getloadavg()[0]})
        log(f"select {mode}: chose {doc['chosen']}; jpegxl model "
            f"{cand['model_files_per_s']}, trial {meas.get('files_per_s')}, full "
            f"{c['measured']['files_per_s']} files/s")


def render(bench: JpegBench, label, argv) -> str:
    packs = bench.pick(part="pack")
    base = {r["codec"]: r for r in packs}
    t1 = table(["pack", "raw MB", "stored MB (with index)", "ratio", "vs default",
                "pack CPU ms/file", "pack wall s", "stored raw (jpegxl)"],
               [[r["codec"], num(r["raw"] / 1e6, 1), num(r["stored"] / 1e6, 1),
                 f"{r['ratio']:.3f}x", f"{r['ratio'] / base['default']['ratio']:.3f}x",
                 num(r["cpu_ms_per_file"], 1), num(r["wall_s"], 1),
                 "-" if r["stored_raw"] is None else r["stored_raw"]] for r in packs],
               title="Capacity: 2 cores, --jobs 2, 8 partitions")
    t2 = table(["codec", "files coded", "encode CPU ms/file", "decode CPU ms/file (1 core)"],
               [[r["codec"], f"{r['coded']} of {r['files']}",
                 num(r["encode_ms_per_file"], 2) if r["encode_ms_per_file"] else "-",
                 num(r["decode_ms_per_file"], 2)] for r in bench.pick(part="cpu")],
               title="Codec CPU per file, one core (thread CPU time, median of 3 passes)")
    rb = bench.pick(part="readback")
    t3 = "\n".join(f"Read back: {r['files']:,} files of the jpegxl store, "
                   f"{r['mount_mismatches']} differ through a mount, {r['api_mismatches']} "
                   "through open_store." for r in rb)
    t4 = table(["mode", "budget files/s", "chosen", "jpegxl ratio (sample)",
                "decode CPU µs/file", "cores for the budget", "declined (sample)",
                "model files/s", "trial files/s (measured)", "full set files/s (--check)",
                "full / trial", "CPU µs/file (full pass)", "load avg"],
               [[r["mode"], r["budget_files_per_s"], r["chosen"], f"{r['ratio']:.3f}",
                 num(r["decode_cpu_us_per_file"]), num(r["decode_cores_for_budget"], 2),
                 f"{r['declined_units']} of {r['sample_units']}",
                 num(r["model_files_per_s"]), num(r["trial_files_per_s"]),
                 num(r["full_files_per_s"]),
                 (f"{r['full_files_per_s'] / r['trial_files_per_s']:.2f}x"
                  if r["trial_files_per_s"] else "-"),
                 num(r["full_cpu_us_per_file"]), num(r["load1"], 1)]
                for r in bench.pick(part="select")],
               title="The selector on the same set, 2 cores, through the kernel mount")
    return section(bench, label, argv, [t1, t2, t3, t4])


def parse(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    args(ap, "jpeg_bench", "/tmp/fanstore-jpeg-bench")
    ap.add_argument("--files", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--files-per-sec", type=int, default=80,
                    help="the selector's budget (default 80 files/s)")
    return ap.parse_args(argv)


if __name__ == "__main__":
    a = parse(sys.argv[1:])
    sys.exit(main(JpegBench(a), render, sys.argv[1:]))
