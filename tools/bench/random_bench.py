#!/usr/bin/env python3
"""Random access inside large files: an LMDB and an HDF5 file read at random offsets.

An LMDB of ``--records`` records (2-6 kB text-like values), an HDF5 file of ``--rows``
rows of 4 kB, and ``--seq-files`` files of 256 MiB read sequentially; backends raw,
squashfuse_ll (zstd-3, 128 KiB blocks), fanstore (default pack and mount) and the
``--fanstore-variants``; every pass cold, every value checked. What is measured:
docs/benchmarks.md, "Random reads inside large files".

    .venv/bin/python tools/bench/random_bench.py --preset quick   # a smoke run
    .venv/bin/python tools/bench/random_bench.py --preset full
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness as h  # noqa: E402
from harness import log, med, num  # noqa: E402

ME = os.path.abspath(__file__)
PRESETS = {
    "quick": dict(records=20000, rows=30000, gets=2000, reps=1, seq_files=1),
    "full": dict(records=200000, rows=300000, gets=20000, reps=2, seq_files=2),
}
CORPUS_BYTES = 16 << 20
SEQ_MB = 256


# ------------------------------------------------------------------------------ the data
# Values are slices of one deterministic text-like corpus: what a reader gets is checked
# by recomputing the slice.


def corpus(seed: int = 7) -> bytes:
    """~16 MB of text-like bytes: words of a 4,000-word vocabulary, Zipf-like frequencies."""
    import numpy as np

    rng = np.random.default_rng(seed)
    letters = np.frombuffer(b"etaoinshrdlucmfwypvbgkjqxz", dtype=np.uint8)
    vocab = []
    for _ in range(4000):
        n = int(rng.integers(2, 10))
        vocab.append(bytes(letters[rng.zipf(1.3, n).clip(1, 26) - 1]) + b" ")
    ranks = rng.zipf(1.2, CORPUS_BYTES // 4).clip(1, len(vocab)) - 1
    out = b"".join(vocab[r] for r in ranks.tolist())
    return out[:CORPUS_BYTES]


def lmdb_value(text: bytes, i: int) -> bytes:
    r = random.Random(i * 2654435761 % (1 << 32))
    n = r.randint(2000, 6000)
    off = r.randrange(0, len(text) - n)
    return text[off:off + n]


def hdf5_row(text: bytes, i: int, width: int = 4096) -> bytes:
    off = (i * 7919) % (len(text) - width)
    return text[off:off + width]


def make_lmdb(path: str, records: int, text: bytes) -> None:
    import lmdb

    os.makedirs(path, exist_ok=True)
    env = lmdb.open(path, map_size=8 << 30, subdir=True, sync=False, writemap=False)
    batch = 5000
    for start in range(0, records, batch):
        with env.begin(write=True) as txn:
            for i in range(start, min(records, start + batch)):
                txn.put(b"%08d" % i, lmdb_value(text, i))
    env.sync(True)
    env.close()
    lock = os.path.join(path, "lock.mdb")
    if os.path.exists(lock):
        os.unlink(lock)  # readers open with lock=False: the lock file is not data


def make_hdf5(path: str, rows: int, text: bytes, width: int = 4096) -> None:
    import h5py
    import numpy as np

    with h5py.File(path, "w") as f:
        ds = f.create_dataset("rows", shape=(rows, width), dtype="u1")  # contiguous
        batch = 4096
        for start in range(0, rows, batch):
            n = min(batch, rows - start)
            block = np.frombuffer(b"".join(hdf5_row(text, i, width)
                                           for i in range(start, start + n)), dtype="u1")
            ds[start:start + n] = block.reshape(n, width)


def make_seq(path: str, files: int, seed: int = 11) -> None:
    """Files of 256 MiB: a mix of text-like and random bytes (about 2x with zstd:3)."""
    os.makedirs(path, exist_ok=True)
    text = corpus(seed)
    rnd = random.Random(seed)
    for k in range(files):
        with open(os.path.join(path, f"big{k}.bin"), "wb") as f:
            left = SEQ_MB << 20
            while left:
                n = min(left, 1 << 20)
                if rnd.random() < 0.5:
                    off = rnd.randrange(0, len(text) - n)
                    f.write(text[off:off + n])
                else:
                    f.write(rnd.randbytes(n))
                left -= n


# ------------------------------------------------------------------------------ a pass
# (run as `random_bench.py _pass ...` in its own process group; prints one JSON row)


def _share(job):
    kind, root, gets, seed, n_items = job
    text = corpus()
    rnd = random.Random(seed)
    if kind == "seq":  # every file once, each reader in its own order
        keys = list(range(n_items))
        rnd.shuffle(keys)
    else:
        keys = [rnd.randrange(n_items) for _ in range(gets)]
    if kind == "lmdb":
        import lmdb

        env = lmdb.open(os.path.join(root, "lmdb"), readonly=True, lock=False,
                        readahead=False, subdir=True, max_readers=64)
        txn = env.begin(buffers=False)

        def get(i):
            return txn.get(b"%08d" % i)

        def want(i):
            return lmdb_value(text, i)
    elif kind == "hdf5":
        import h5py

        f = h5py.File(os.path.join(root, "rows.h5"), "r")
        ds = f["rows"]

        def get(i):
            return ds[i].tobytes()

        def want(i):
            return hdf5_row(text, i)
    else:  # seq: whole files, 1 MiB reads
        buf = bytearray(1 << 20)

        def get(i):
            n = 0
            with open(os.path.join(root, "seq", f"big{i}.bin"), "rb", buffering=0) as f:
                while True:
                    k = f.readinto(buf)
                    if not k:
                        return n
                    n += k

        def want(i):
            return SEQ_MB << 20

    def work() -> dict:
        bad = errors = 0
        first = None
        for i in keys:
            try:
                if get(i) != want(i):
                    bad += 1
            except Exception as exc:  # noqa: BLE001
                errors += 1
                first = first or f"{type(exc).__name__}: {exc}"
        return {"gets": len(keys), "bad": bad, "errors": errors, "first_error": first}

    return work


def pass_main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="random_bench.py _pass")
    ap.add_argument("--kind", choices=("lmdb", "hdf5", "seq"), required=True)
    ap.add_argument("--root", required=True)
    ap.add_argument("--readers", type=int, default=1)
    ap.add_argument("--gets", type=int, default=1000)
    ap.add_argument("--items", type=int, required=True)
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args(argv)
    try:
        got = h.fork_pass(_share, [(a.kind, a.root, a.gets, a.seed * 100 + k, a.items)
                                   for k in range(a.readers)], timeout=600)
    except Exception as exc:  # noqa: BLE001
        print(json.dumps({"errors": 1, "first_error": str(exc)}))
        return 1
    res, wall = got["results"], got["wall"]
    n = sum(r["gets"] for r in res)
    print(json.dumps({"kind": a.kind, "readers": a.readers, "gets": n,
                      "seconds": round(wall, 4), "gets_per_s": round(n / wall, 1),
                      "bad": sum(r["bad"] for r in res),
                      "errors": sum(r["errors"] for r in res),
                      "first_error": next((r["first_error"] for r in res
                                           if r["first_error"]), None)}), flush=True)
    return 0


# ------------------------------------------------------------------------------ the run


class RandomBench(h.Bench):
    name = "random_bench"

    def __init__(self, a) -> None:
        super().__init__(a)
        self.mounts: list[str] = []

    def sh(self, argv: list[str], **kw) -> subprocess.CompletedProcess:
        self.cmd(argv)
        return subprocess.run(argv, check=True, capture_output=True, text=True, **kw)

    # -------------------------------------------------------------- data and images
    def data(self) -> None:
        a = self.a
        self.src = os.path.join(self.work, "data")
        stamp = os.path.join(self.work, "data.json")
        want = {"records": a.records, "rows": a.rows, "seq_files": a.seq_files}
        if not h.stamped(stamp, want):
            shutil.rmtree(self.src, ignore_errors=True)
            os.makedirs(self.src)
            text = corpus()
            log(f"generating: LMDB of {a.records:,} records, HDF5 of {a.rows:,} rows, "
                f"{a.seq_files} x {SEQ_MB} MiB")
            make_lmdb(os.path.join(self.src, "lmdb"), a.records, text)
            make_hdf5(os.path.join(self.src, "rows.h5"), a.rows, text)
            make_seq(os.path.join(self.src, "seq"), a.seq_files)
            os.sync()
            with open(stamp, "w") as f:
                json.dump(want, f)
        self.sizes = {"lmdb": os.path.getsize(os.path.join(self.src, "lmdb", "data.mdb")),
                      "hdf5": os.path.getsize(os.path.join(self.src, "rows.h5"))}

    def images(self) -> None:
        """The squashfs image and every FanStore store (rebuilt when missing)."""
        a = self.a
        self.img = os.path.join(self.work, "data-zstd3-128k.sqfs")
        if not os.path.exists(self.img):
            h.drop_caches()
            self.sh(["mksquashfs", self.src, self.img, "-comp", "zstd", "-Xcompression-level",
                     "3", "-b", "131072", "-noappend", "-no-progress", "-quiet"])
        self.stores: dict[str, tuple[str, list[str]]] = {}
        for variant in ["default", *a.variants]:
            store = os.path.join(self.work, f"store-{variant}")
            pack_args = ["--chunk-kb", "64"] if variant == "chunk64" else []
            mount_args = ["--cache-mb", "3000"] if variant == "cache3000" else []
            base = "default" if variant in ("cache3000", "nospill") else variant
            store = os.path.join(self.work, f"store-{base}")
            if not os.path.exists(os.path.join(store, "fanstore.idx")):
                h.drop_caches()
                self.sh([self.fanstore, "pack", self.src, store, "--no-progress", "--force",
                         *pack_args])
            self.stores[variant] = (store, mount_args)
        info = json.loads(self.sh([self.fanstore, "info", self.stores["default"][0],
                                   "--json"]).stdout)
        raw = os.path.getsize(self.img)
        self.emit({"kind": "store", "info": {k: info.get(k) for k in
                                             ("counts", "ratio", "chunk_size", "kinds",
                                              "chunk_sizes")},
                   "sizes": self.sizes, "sqfs_bytes": raw,
                   "params": {"records": a.records, "rows": a.rows, "gets": a.gets}})

    # -------------------------------------------------------------- mounts
    def mnt(self, name: str) -> str:
        return os.path.join(self.work, "mnt", name)

    def mount(self, backend: str) -> tuple[str, int | None]:
        """(root to read, FanStore daemon pid or None) for a fresh mount of ``backend``."""
        self.unmount_all()
        if backend == "raw":
            return self.src, None
        m = self.mnt(backend)
        os.makedirs(m, exist_ok=True)
        if backend == "squashfuse_ll":
            self.sh(["squashfuse_ll", self.img, m])
            self.mounts.append(m)
            return m, None
        variant = backend.split(":", 1)[1]
        store, extra = self.stores[variant]
        off = ["--no-chunk-spill"] if variant == "nospill" else []
        return m, h.Bench.mount(self, store, m, [*extra, *off])

    def unmount_all(self) -> None:
        for m in self.mounts:
            subprocess.run(["fusermount3", "-u", "--", m], capture_output=True)
        for m in list(self.mounted):
            self.umount(m)
        self.mounts.clear()

    # -------------------------------------------------------------- passes
    def one(self, kind: str, backend: str, readers: int, rep: int) -> dict:
        root, pid = self.mount(backend)
        h.drop_caches()
        items = {"lmdb": self.a.records, "hdf5": self.a.rows,
                 "seq": self.a.seq_files}[kind]
        argv = [self.py, ME, "_pass", "--kind", kind, "--root", root, "--readers",
                str(readers), "--gets", str(self.a.gets), "--items", str(items), "--seed",
                str(rep)]
        self.cmd(argv, ROOT=root)
        before = h.control(root, {"op": "stats"}) if pid else None
        pids = h.fanstore_processes(pid) if pid else []
        cpu0, base = h.cpu_seconds(pids), h.memory(pids)
        row = self.sub(argv, timeout=self.a.pass_limit)
        row.update(kind=kind, backend=backend, readers=readers, rep=rep)
        if pid:
            pids = h.fanstore_processes(pid)
            row["fanstore_cpu_s"] = round(h.cpu_seconds(pids) - cpu0, 3)
            rss, pss = h.memory(pids)
            row.update(rss_base=base[0], pss_base=base[1], rss_after=rss, pss_after=pss)
            row["daemon"] = h.diff_stats(h.control(root, {"op": "stats"}), before)
        self.emit(row)
        d = row.get("daemon") or {}
        log(f"  {kind} r={readers} {backend:<22} {row.get('gets_per_s')} gets/s"
            + (f", decoded {d.get('chunks_decoded')} chunks" if d else "")
            + (f"  ERRORS {row.get('errors')} {row.get('first_error')}"
               if row.get("errors") else "")
            + (f"  WRONG {row['bad']}" if row.get("bad") else ""))
        return row

    def run(self) -> None:
        a = self.a
        self.data()
        self.images()
        backends = ["raw", "squashfuse_ll", "fanstore:default",
                    *[f"fanstore:{v}" for v in a.variants]]
        for rep in range(1, a.reps + 1):
            for kind in a.kinds:
                for readers in (a.readers if kind != "seq" else [1]):
                    k = rep % len(backends)
                    for backend in backends[k:] + backends[:k]:
                        self.one(kind, backend, readers, rep)
        self.unmount_all()

    def cleanup(self) -> None:
        self.unmount_all()
        super().cleanup()


# ------------------------------------------------------------------------------ report


def render(bench: RandomBench, label: str | None, argv: list[str]) -> str:
    rows, a = bench.rows, bench.a
    st = next(r for r in rows if r["kind"] == "store")
    info = st.get("info") or {}
    backends = ["raw", "squashfuse_ll", "fanstore:default", *[f"fanstore:{v}" for v in a.variants]]
    gets, targets = [], []
    for kind in [k for k in a.kinds if k != "seq"]:
        for readers in a.readers:
            cells = {b: [r["gets_per_s"] for r in rows if r.get("kind") == kind
                         and r.get("backend") == b and r.get("readers") == readers
                         and r.get("gets_per_s")] for b in backends}
            f, s_, raw = (med(cells.get(b, [])) for b in ("fanstore:default", "squashfuse_ll",
                                                          "raw"))
            gets.append((kind, readers, *(h.spread(cells[b]) for b in backends),
                         h.ratio(f, s_), h.ratio(f, raw)))
            if f and s_ and raw:
                what = f"{kind}, {readers} reader(s), default pack and mount"
                targets += [(f"{what}: vs squashfuse_ll", f"{f / s_:.2f}x", ">= 1.5x",
                             h.check(f / s_ >= 1.5)),
                            (f"{what}: vs the raw directory", f"{f / raw:.2f}x", ">= 1.0x",
                             h.check(f / raw >= 1.0))]
    fr = [r for r in rows if r.get("backend") == "fanstore:default" and r.get("daemon")
          and r.get("kind") != "seq"]
    chunk = info.get("chunk_size") or (1 << 20)
    n_chunks = {k: -(-v // chunk) for k, v in st["sizes"].items()}
    amp = [r["daemon"].get("chunks_decoded", 0) / n_chunks[r["kind"]] for r in fr
           if r["kind"] in n_chunks]
    if amp:
        targets.append(("chunks decoded per chunk of the file (worst pass)",
                        f"{max(amp):.2f}x", "<= 1.1x", h.check(max(amp) <= 1.1)))
    cache = 256 << 20
    pss = [(r["pss_after"] - r["pss_base"]) for r in fr if r.get("pss_after")]
    if pss:
        targets.append(("PSS of the FanStore processes after a pass <= base + `--cache-mb` "
                        "+ 10% (worst)", f"+{max(pss) / 1e6:,.0f} MB",
                        f"<= +{cache * 1.1 / 1e6:,.0f} MB", h.check(max(pss) <= cache * 1.1)))
    seq = {b: med([r["gets"] * SEQ_MB * 1.048576 / r["seconds"] for r in rows
                   if r.get("kind") == "seq" and r.get("backend") == b and r.get("seconds")])
           for b in backends}
    if seq.get("fanstore:default"):
        targets.append((f"sequential reads of {SEQ_MB} MiB files, 1 reader (MB/s)",
                        f"FanStore {num(seq['fanstore:default'])}, raw {num(seq.get('raw'))}, "
                        f"squashfuse_ll {num(seq.get('squashfuse_ll'))}", "–", "(info)"))
    counters = []
    for r in rows:
        d = r.get("daemon")
        if d and r.get("kind") != "seq":
            counters.append((
                r["kind"], r["readers"], r["backend"],
                num((r.get("fanstore_cpu_s") or 0) / max(1, r["gets"]) * 1e6),
                num((d.get("requests_by_op") or {}).get("read", 0) / max(1, r["gets"]), 2),
                num(d.get("chunks_decoded")), num(n_chunks.get(r["kind"])),
                num(d.get("bytes_decoded", 0) / max(1, d.get("bytes_returned", 0)), 1),
                f"{num(r.get('pss_base', 0) / 1e6)} → {num(r.get('pss_after', 0) / 1e6)}"))
    errs = [r for r in rows if r.get("errors")]
    return h.section(bench, label, argv, [
        f"LMDB of {a.records:,} records ({st['sizes']['lmdb'] / 1e9:.2f} GB), HDF5 of "
        f"{a.rows:,} rows of 4 kB ({st['sizes']['hdf5'] / 1e9:.2f} GB), {a.seq_files} x "
        f"{SEQ_MB} MiB; squashfs {st['sqfs_bytes'] / 1e9:.2f} GB; FanStore default pack ratio "
        f"{num(info.get('ratio'), 2)}, chunk sizes "
        f"{json.dumps(info.get('chunk_sizes') or info.get('chunk_size'))}; {a.gets:,} gets "
        "per reader.",
        h.table(["data", "readers", *backends, "FanStore vs squashfuse_ll", "FanStore vs raw"],
                gets, title="Gets per second (cold)"),
        h.table(["target", "measured", "goal", "status"], targets, "llrl", "Targets"),
        h.table(["data", "readers", "backend", "FanStore CPU µs/get", "READs/get",
                 "chunks decoded", "chunks in the file", "bytes decoded per byte of READ "
                 "replies", "PSS base → after MB"], counters, "lrl" + "r" * 6,
                "FanStore counters per pass"),
        "### Correctness\n\n- values that differed from what was written: "
        f"{sum(r.get('bad') or 0 for r in rows)}; passes with errors: {len(errs)}"
        + (f" (first: {errs[0].get('first_error')})" if errs else "")])


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="full")
    h.args(ap, "random_bench", "/tmp/fanstore-randombench")
    ap.add_argument("--records", type=int)
    ap.add_argument("--rows", type=int)
    ap.add_argument("--gets", type=int)
    ap.add_argument("--reps", type=int)
    ap.add_argument("--seq-files", type=int)
    ap.add_argument("--kinds", default="lmdb,hdf5,seq")
    ap.add_argument("--readers", default="1,4")
    ap.add_argument("--fanstore-variants", dest="variants", default="nospill",
                    help="extra FanStore backends: nospill (--no-chunk-spill: the "
                         "mount before the chunk spill), chunk64 (pack --chunk-kb 64), "
                         "cache3000 (mount --cache-mb 3000); empty for none")
    ap.add_argument("--pass-limit", type=float, default=1800)
    a = h.presets(ap.parse_args(argv), PRESETS)
    a.kinds = [k for k in a.kinds.split(",") if k]
    a.readers = [int(x) for x in a.readers.split(",") if x]
    a.variants = [v for v in a.variants.split(",") if v]
    return a


def main(argv=None) -> int:
    raw = sys.argv[1:] if argv is None else argv
    if raw and raw[0] == "_pass":
        return pass_main(raw[1:])
    a = parse_args(raw)
    for tool in ("mksquashfs", "squashfuse_ll"):
        if not shutil.which(tool):
            print(f"random_bench: {tool} is missing (apt-get install squashfs-tools "
                  "squashfuse)", file=sys.stderr)
            return 2
    return h.main(RandomBench(a), render, raw)


if __name__ == "__main__":
    sys.exit(main())
