#!/usr/bin/env python3
"""Capacity study: what small files gain from trained dictionaries and from solid blocks,
and what each costs a reader, next to mksquashfs on the same data (docs/selection.md).

Every option (per-file zstd:L with and without dictionaries, solid blocks of --blocks KiB)
is laid out as ``fanstore pack`` lays a store out, compressed, and measured: ratio (index
and dictionaries counted; ``~`` = estimated from a sample of the chunks), random and
in-order read CPU µs per file, decoded kB per file. One JSON row per option to --jsonl and
a markdown table on stdout (--md: also to a file).

    python tools/gen_dataset.py /tmp/st --preset small-text
    python tools/bench/capacity_study.py /tmp/st --name small-text --md /tmp/st.md
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np
import xxhash

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)

import harness as h  # noqa: E402

from compressors import ZstdCodec, get_codec, train_dictionary  # noqa: E402
from fanstore.format.index import (  # noqa: E402
    KIND_DIR,
    KIND_FILE,
    KIND_SYMLINK,
    IndexBuilder,
    encode_index,
)
from fanstore.format.partition import PARTITION_HEADER_SIZE  # noqa: E402
from fanstore.kinds import file_kind  # noqa: E402
from fanstore.pack.plan import plan_partitions  # noqa: E402
from fanstore.pack.scan import scan_tree  # noqa: E402
from fanstore.select.sample import DICT_TRAIN_BYTES, dict_eligible  # noqa: E402

MB = 1e6
CHUNK = 1 << 20
RESULTS = os.path.join(h.RESULTS_DIR, "capacity_study.jsonl")
_clock = time.thread_time


def log(msg: str) -> None:
    print(f"[capacity] {msg}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- the data


@dataclass
class Data:
    """Every file of the data set in memory (one buffer; workers fork and share it)."""

    root: str
    scan: object
    files: list[int]  # entry numbers of the regular files, scan order
    rel: list[str]
    size: np.ndarray
    start: np.ndarray  # offset of each file in ``buf``
    buf: np.ndarray
    kind: list[str]
    part: list[int]  # partition of each file (plan_partitions)

    def bytes_of(self, i: int) -> memoryview:
        s = int(self.start[i])
        return memoryview(self.buf)[s : s + int(self.size[i])]

    @property
    def raw_bytes(self) -> int:
        return int(self.size.sum())


def load(root: str, partitions: int) -> Data:
    scan = scan_tree(root)
    if scan.problems:
        raise SystemExit(f"cannot study {root}: {scan.problems[0]}")
    files = [i for i, e in enumerate(scan.entries) if e.kind == KIND_FILE]
    size = np.array([scan.entries[i].size for i in files], dtype=np.int64)
    start = np.concatenate(([0], np.cumsum(size)[:-1])).astype(np.int64)
    buf = np.empty(int(size.sum()), dtype=np.uint8)
    for k, i in enumerate(files):
        with open(os.path.join(scan.root, scan.entries[i].rel), "rb", buffering=0) as f:
            n = f.readinto(memoryview(buf)[int(start[k]) : int(start[k] + size[k])])
            if n != size[k]:
                raise SystemExit(f"{scan.entries[i].rel}: short read")
    rel = [os.fsdecode(scan.entries[i].rel) for i in files]
    kind = [file_kind(r, int(s)) for r, s in zip(rel, size.tolist())]
    part = plan_partitions(size.tolist(), partitions)
    return Data(root, scan, files, rel, size, start, buf, kind, part)


# --------------------------------------------------------------------------- layouts


@dataclass
class Option:
    name: str
    level: int
    dict: bool
    block: int  # solid block size in bytes; 0: per-file
    group: bool = True  # solid: one open block per kind (else one per partition)
    sampled: bool = False  # compress a random subset of the chunks (slow levels)


@dataclass
class Layout:
    """Chunks of an option: each is a list of (file, start in file, length) pieces, in
    partition order; per file its first chunk, chunk count and offset."""

    pieces: list[list[tuple[int, int, int]]] = field(default_factory=list)
    part: list[int] = field(default_factory=list)
    kind: list[str] = field(default_factory=list)  # kind of the chunk's (first) file
    first: np.ndarray | None = None
    count: np.ndarray | None = None
    offset: np.ndarray | None = None

    def raw(self, k: int) -> int:
        return sum(n for _, _, n in self.pieces[k])


def make_layout(data: Data, opt: Option, partitions: int) -> Layout:
    n = len(data.files)
    lay = Layout(first=np.zeros(n, np.int64), count=np.zeros(n, np.int64),
                 offset=np.zeros(n, np.int64))
    by_part: list[list[int]] = [[] for _ in range(partitions)]
    for i, p in enumerate(data.part):
        by_part[p].append(i)
    for p, members in enumerate(by_part):
        open_blocks: dict[str, list[tuple[int, int, int]]] = {}
        fill: dict[str, int] = {}

        def close(key: str) -> None:
            pieces = open_blocks.pop(key)
            fill.pop(key)
            k = len(lay.pieces)
            for off_in_block, (i, _, _) in zip(_offsets(pieces), pieces):
                lay.first[i], lay.count[i], lay.offset[i] = k, 1, off_in_block
            lay.pieces.append(pieces)
            lay.part.append(p)
            lay.kind.append(data.kind[pieces[0][0]])

        for i in members:
            size = int(data.size[i])
            if size == 0:
                continue
            if opt.block and size <= opt.block:
                key = data.kind[i] if opt.group else ""
                if key in open_blocks and fill[key] + size > opt.block:
                    close(key)
                open_blocks.setdefault(key, []).append((i, 0, size))
                fill[key] = fill.get(key, 0) + size
                continue
            k0 = len(lay.pieces)
            for pos in range(0, size, CHUNK):
                lay.pieces.append([(i, pos, min(CHUNK, size - pos))])
                lay.part.append(p)
                lay.kind.append(data.kind[i])
            lay.first[i], lay.count[i] = k0, len(lay.pieces) - k0
        for key in list(open_blocks):
            close(key)
    return lay


def _offsets(pieces: list[tuple[int, int, int]]) -> list[int]:
    out, pos = [], 0
    for _, _, n in pieces:
        out.append(pos)
        pos += n
    return out


def chunk_bytes(data: Data, pieces: list[tuple[int, int, int]]) -> bytes:
    if len(pieces) == 1:
        i, s, n = pieces[0]
        return bytes(data.bytes_of(i)[s : s + n])
    return b"".join(data.bytes_of(i)[s : s + n] for i, s, n in pieces)


# --------------------------------------------------------------------------- dictionaries


def train_dicts(data: Data, seed: int) -> dict[str, bytes]:
    """One dictionary per eligible kind (the selector's rule), plus ``""``: one for all the
    eligible kinds together (solid blocks that mix kinds)."""
    by_kind: dict[str, list[int]] = {}
    for i, k in enumerate(data.kind):
        if data.size[i]:
            by_kind.setdefault(k, []).append(i)
    eligible = {k: v for k, v in by_kind.items() if dict_eligible(k, len(v))}
    weight = sum(int(data.size[v].sum()) for v in eligible.values())
    rng = np.random.default_rng(seed)
    out: dict[str, bytes] = {}
    everything: list[bytes] = []
    for k, members in sorted(eligible.items()):
        budget = max(256 << 10, DICT_TRAIN_BYTES * int(data.size[members].sum()) // weight)
        got, samples = 0, []
        for j in rng.permutation(len(members)).tolist():
            if got >= budget:
                break
            b = bytes(data.bytes_of(members[j])[:CHUNK])
            samples.append(b)
            got += len(b)
        try:
            out[k] = train_dictionary(samples)
        except Exception as exc:  # noqa: BLE001 - report and go on without it
            log(f"no dictionary for {k}: {exc}")
            continue
        everything += samples
    if everything:
        rng2 = np.random.default_rng(seed + 1)
        pick = rng2.permutation(len(everything)).tolist()
        chosen, got = [], 0
        for j in pick:
            if got >= DICT_TRAIN_BYTES:
                break
            chosen.append(everything[j])
            got += len(everything[j])
        out[""] = train_dictionary(chosen)
    return out


_CODECS: dict[tuple, object] = {}


def codec_for(opt: Option, dicts: dict[str, bytes], kind: str):
    """The codec of a chunk of ``kind`` under ``opt`` and its dictionary key (or None).

    One instance per (level, dictionary), as a store has one per codec slot: a codec's
    zstd contexts load its dictionary once.
    """
    key = kind if (opt.block == 0 or opt.group) else ""
    if not opt.dict or key not in dicts:
        key = None
    cache_key = (opt.level, key, id(dicts))
    codec = _CODECS.get(cache_key)
    if codec is None:
        codec = ZstdCodec(opt.level, dict_data=dicts[key] if key is not None else None)
        _CODECS[cache_key] = codec
    return codec, key


# --------------------------------------------------------------------------- compression

_DATA: Data | None = None
_LAYOUT: Layout | None = None


def _compress_range(args: tuple[list[int], dict[str, dict]]) -> tuple[list[int], list[int]]:
    ks, configs = args
    codecs = {key: get_codec(cfg) for key, cfg in configs.items()}
    out = []
    for k in ks:
        raw = chunk_bytes(_DATA, _LAYOUT.pieces[k])
        codec = codecs[_LAYOUT.kind[k]]
        blob = codec.encode(raw)
        out.append(min(len(blob), len(raw)))
    return ks, out


def compress_all(data: Data, lay: Layout, opt: Option, dicts, jobs: int, slow_mb: float,
                 seed: int) -> tuple[np.ndarray, np.ndarray, float, float]:
    """Stored size of each chunk (estimated for the unsampled ones), the sampling
    probability, encode CPU seconds (all workers) and wall seconds."""
    global _DATA, _LAYOUT
    _DATA, _LAYOUT = data, lay
    m = len(lay.pieces)
    configs = {}
    for kind in set(lay.kind):
        codec, _ = codec_for(opt, dicts, kind)
        configs[kind] = codec.get_config()
    raw = np.array([lay.raw(k) for k in range(m)], dtype=np.int64)
    p = 1.0
    todo = np.arange(m)
    if opt.sampled:
        p = min(1.0, slow_mb * MB / max(1, raw.sum()))
        if p < 1.0:
            todo = np.nonzero(np.random.default_rng(seed).random(m) < p)[0]
    stored = np.full(m, -1, dtype=np.int64)
    step = max(1, len(todo) // (jobs * 16) + 1)
    batches = [(todo[a : a + step].tolist(), configs) for a in range(0, len(todo), step)]
    t0, c0 = time.monotonic(), _children_cpu()
    ctx = mp.get_context("fork")
    with ctx.Pool(jobs) as pool:
        for ks, sizes in pool.imap_unordered(_compress_range, batches):
            stored[ks] = sizes
    wall = time.monotonic() - t0
    cpu = _children_cpu() - c0
    return stored, raw, p, cpu, wall


def _children_cpu() -> float:
    t = os.times()
    return t.children_user + t.children_system


# --------------------------------------------------------------------------- index size


def index_bytes(data: Data, lay: Layout, stored: np.ndarray, opt: Option, dicts,
                lookup, names: bytes) -> int:
    entries = data.scan.entries
    n, m = len(entries), len(lay.pieces)
    b = IndexBuilder(n, m)
    e = b.entries
    for i, ent in enumerate(entries):
        e["parent"][i], e["kind"][i], e["mode"][i] = ent.parent, ent.kind, ent.mode
        e["mtime_ns"][i] = ent.mtime_ns
        if ent.kind == KIND_DIR:
            e["first"][i], e["count"][i] = ent.children
        elif ent.kind == KIND_SYMLINK:
            e["size"][i] = len(ent.target)
    b.names = bytearray(names)
    e["name_off"][:] = lookup[2]
    e["name_len"][:] = lookup[3]
    rng = np.random.default_rng(1)
    fidx = np.array(data.files, dtype=np.int64)
    e["size"][fidx] = data.size
    e["first"][fidx] = lay.first
    e["count"][fidx] = lay.count
    e["checksum"][fidx] = rng.integers(0, 1 << 63, len(fidx), dtype=np.uint64)
    if "offset" in e:
        e["offset"][fidx] = lay.offset
    c = b.chunks
    c["part"][:] = lay.part
    c["stored"][:] = np.maximum(1, stored)
    c["raw"][:] = [lay.raw(k) for k in range(m)]
    c["checksum"][:] = rng.integers(0, 1 << 63, m, dtype=np.uint64)
    pos = {}
    offs = np.zeros(m, dtype=np.int64)
    for k in range(m):
        p = lay.part[k]
        offs[k] = pos.get(p, PARTITION_HEADER_SIZE)
        pos[p] = offs[k] + c["stored"][k]
    c["offset"][:] = offs
    codecs = [{"id": "none"}]
    slots: dict[str, int] = {}
    slot_of_kind = {}
    for kind in sorted(set(lay.kind)):
        cfg = codec_for(opt, dicts, kind)[0].get_config()
        key = json.dumps(cfg, sort_keys=True)
        if key not in slots:
            slots[key] = len(codecs)
            codecs.append(cfg)
        slot_of_kind[kind] = slots[key]
    c["codec"][:] = [slot_of_kind[k] for k in lay.kind]
    meta = {"chunk_size": CHUNK, "codecs": codecs,
            "partitions": [{"size": int(v), "checksum": "0" * 32, "files": 0, "raw_bytes": 0,
                            "broadcast": False} for _, v in sorted(pos.items())],
            "counts": {"files": len(fidx), "raw_bytes": data.raw_bytes}}
    return len(encode_index(meta, e, c, (lookup[0], lookup[1]), bytes(names), b""))


def namespace_columns(data: Data):
    entries = data.scan.entries
    b = IndexBuilder(len(entries), 0)
    for i, ent in enumerate(entries):
        b.entries["parent"][i] = ent.parent
        if i:
            b.set_name(i, os.path.basename(ent.rel))
    lk_hash, lk_entry = b.build_lookup()
    cols = (lk_hash, lk_entry, b.entries["name_off"].copy(), b.entries["name_len"].copy())
    return cols, bytes(b.names)


# --------------------------------------------------------------------------- read cost


def read_costs(data: Data, lay: Layout, opt: Option, dicts, n_files: int, seed: int,
               passes: int = 3) -> dict[str, float]:
    """CPU µs per file in random order (no cache) and in storage order (LRU of 8)."""
    nonempty = np.nonzero(data.size > 0)[0]
    rng = np.random.default_rng(seed)
    rand = rng.choice(nonempty, size=min(n_files, len(nonempty)), replace=False).tolist()
    # In order: consecutive files of the partition holding the most files, storage order.
    p0 = max(set(lay.part), key=lay.part.count) if lay.part else 0
    chunks_p0 = [k for k in range(len(lay.pieces)) if lay.part[k] == p0]
    in_order, seen = [], set()
    for k in chunks_p0:
        for i, _, _ in lay.pieces[k]:
            if i not in seen:
                seen.add(i)
                in_order.append(i)
        if len(in_order) >= n_files:
            break
    in_order = in_order[:n_files]
    need = set()
    for i in rand + in_order:
        need.update(range(int(lay.first[i]), int(lay.first[i] + lay.count[i])))
    blobs: dict[int, tuple[object, bytes, int]] = {}
    for k in sorted(need):
        codec, _ = codec_for(opt, dicts, lay.kind[k])
        raw = chunk_bytes(data, lay.pieces[k])
        blob = codec.encode(raw)
        if len(blob) >= len(raw):
            blobs[k] = (None, raw, len(raw))
        else:
            blobs[k] = (codec, blob, len(raw))
        assert blobs[k][0] is None or codec.decode(blob, len(raw)) == raw
    digest = xxhash.xxh3_64_intdigest
    size, first, count, offset = data.size, lay.first, lay.count, lay.offset

    def decode(k: int) -> bytes:
        codec, blob, n = blobs[k]
        out = bytes(blob) if codec is None else codec.decode(blob, n)
        digest(out)
        return out

    def one(i: int, get) -> bytes:
        f, c = int(first[i]), int(count[i])
        if c == 1:
            out = get(f)
            o, s = int(offset[i]), int(size[i])
            return out if (o == 0 and len(out) == s) else bytes(memoryview(out)[o : o + s])
        return b"".join(get(k) for k in range(f, f + c))

    def random_pass() -> None:
        for i in rand:
            one(i, decode)

    def ordered_pass() -> None:
        cache: OrderedDict[int, bytes] = OrderedDict()

        def get(k: int) -> bytes:
            v = cache.get(k)
            if v is None:
                v = decode(k)
                cache[k] = v
                if len(cache) > 8:
                    cache.popitem(last=False)
            else:
                cache.move_to_end(k)
            return v

        for i in in_order:
            one(i, get)

    def timed(fn) -> float:
        fn()  # warm-up
        times = []
        for _ in range(passes):
            t0 = _clock()
            fn()
            times.append(_clock() - t0)
        return statistics.median(times)

    decoded = sum(lay.raw(int(first[i]) + j) for i in rand for j in range(int(count[i])))
    return {
        "random_us_per_file": timed(random_pass) / len(rand) * 1e6,
        "in_order_us_per_file": timed(ordered_pass) / max(1, len(in_order)) * 1e6,
        "decoded_kb_per_file": decoded / len(rand) / 1e3,
        "read_files": len(rand),
    }


# --------------------------------------------------------------------------- squashfs


def squashfs(data_dir: str, work: str, level: int, block: str | None, jobs: int) -> dict:
    img = os.path.join(work, "study.sqfs")
    cmd = ["mksquashfs", data_dir, img, "-comp", "zstd", "-Xcompression-level", str(level),
           "-noappend", "-no-progress", "-quiet", "-processors", str(jobs)]
    if block:
        cmd += ["-b", block]
    t0, c0 = time.monotonic(), _children_cpu()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    wall, cpu = time.monotonic() - t0, _children_cpu() - c0
    size = os.path.getsize(img)
    os.unlink(img)
    return {"store_bytes": size, "pack_wall_s": wall, "pack_cpu_s": round(cpu, 1),
            "cmd": " ".join(cmd)}


# --------------------------------------------------------------------------- real packs


def real_pack(data_dir: str, work: str, label: str, args: list[str], n_read: int,
              seed: int) -> dict:
    """``fanstore pack`` for real (the CLI), then a random-order read of ``n_read`` files
    through the Python API on the store (no chunk cache): CPU µs and wall µs per file."""
    import fanstore

    dest = os.path.join(work, "store")
    shutil.rmtree(dest, ignore_errors=True)
    cmd = [os.path.join(os.path.dirname(sys.executable), "fanstore"), "pack", data_dir, dest,
           "--no-progress", *args]
    t0, c0 = time.monotonic(), _children_cpu()
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    wall, cpu_pack = time.monotonic() - t0, _children_cpu() - c0
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed: {proc.stderr.strip()}")
    store_bytes = sum(os.path.getsize(os.path.join(dest, n)) for n in os.listdir(dest))
    with fanstore.open_store(dest, cache_mb=0) as store:
        files = store.files()
        rng = np.random.default_rng(seed)
        pick = [files[i] for i in rng.choice(len(files), min(n_read, len(files)),
                                              replace=False)]
        for rel in pick[:200]:  # warm the page cache and the codecs
            store.read(rel)
        t_cpu, t_wall = _clock(), time.perf_counter()
        for rel in pick:
            store.read(rel)
        cpu, w = _clock() - t_cpu, time.perf_counter() - t_wall
        info = store.index.meta
    shutil.rmtree(dest, ignore_errors=True)
    return {"option": label, "kind": "pack", "cmd": " ".join(cmd[1:]), "store_bytes": store_bytes,
            "pack_wall_s": round(wall, 1), "pack_cpu_s": round(cpu_pack, 1),
            "api_cpu_us_per_file": cpu / len(pick) * 1e6,
            "api_wall_us_per_file": w / len(pick) * 1e6, "read_files": len(pick),
            "format_version": info.get("format_version"),
            "selection_line": proc.stderr.strip().splitlines()[-1] if proc.stderr.strip()
            else ""}


# --------------------------------------------------------------------------- driver


def save(rows: list[dict], path: str, row: dict) -> None:
    """Keep ``row`` and append it to the JSONL file at once (a long run that stops half-way
    keeps what it measured); numpy scalars are written as plain numbers."""
    rows.append(row)
    with open(path, "a") as f:
        f.write(json.dumps(row, sort_keys=True, default=lambda v: v.item()) + "\n")


def options(levels: list[int], blocks: list[int], slow: list[int], group: bool,
            sample_levels: int) -> list[Option]:
    out = []
    for lv in levels:
        for d in (False, True):
            out.append(Option(f"file zstd:{lv}{'+dict' if d else ''}", lv, d, 0,
                              sampled=lv >= sample_levels))
    for kb in blocks:
        for d in (False, True):
            out.append(Option(f"solid {kb}K zstd:3{'+dict' if d else ''}", 3, d, kb << 10,
                              group))
    for lv in slow:
        for kb in (64, 128):
            if kb in blocks:
                for d in (False, True):
                    out.append(Option(f"solid {kb}K zstd:{lv}{'+dict' if d else ''}", lv, d,
                                      kb << 10, group, sampled=lv >= sample_levels))
    if 64 in blocks:
        out.append(Option("solid 64K zstd:3, kinds mixed", 3, False, 64 << 10, not group))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("data", help="the data set (a directory)")
    p.add_argument("--name", help="name of the data set in the results (default: basename)")
    p.add_argument("--partitions", type=int, default=8)
    p.add_argument("--levels", default="1,3,9,19")
    p.add_argument("--blocks", default="16,32,64,128,256", help="solid block sizes, KiB")
    p.add_argument("--solid-slow", default="19",
                   help="extra zstd levels for solid 64K/128K blocks (comma-separated)")
    p.add_argument("--no-group", action="store_true",
                   help="solid blocks mix kinds (one open block per partition)")
    p.add_argument("--sample-level", type=int, default=19,
                   help="levels from this one up compress a random subset (--slow-mb)")
    p.add_argument("--slow-mb", type=float, default=150.0)
    p.add_argument("--read-files", type=int, default=5000)
    p.add_argument("--only", help="only options whose name contains one of these "
                                  "(comma-separated)")
    p.add_argument("--jobs", type=int, default=len(os.sched_getaffinity(0)))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-squashfs", action="store_true")
    p.add_argument("--packs", default="default;--codec zstd:3",
                   help="real 'fanstore pack' runs to measure, ';'-separated argument lists "
                        "('default': no codec option); '' for none")
    p.add_argument("--jsonl", default=RESULTS)
    p.add_argument("--md", help="also write the markdown table here")
    a = p.parse_args(argv)
    name = a.name or os.path.basename(os.path.abspath(a.data))
    ints = lambda text: [int(x) for x in text.split(",") if x]  # noqa: E731
    t_start = time.monotonic()
    log(f"{name}: loading {a.data}")
    data = load(a.data, a.partitions)
    n_files = len(data.files)
    log(f"{name}: {n_files:,} files, {data.raw_bytes / MB:,.1f} MB; training dictionaries")
    dicts = train_dicts(data, a.seed)
    lookup, names = namespace_columns(data)
    rows: list[dict] = []
    os.makedirs(os.path.dirname(os.path.abspath(a.jsonl)), exist_ok=True)
    run = h.now_utc()
    base = {"run": run, "dataset": name, "files": n_files, "raw_bytes": data.raw_bytes,
            "partitions": a.partitions, "commit": h.git_commit()}
    if not a.no_squashfs and shutil.which("mksquashfs"):
        with tempfile.TemporaryDirectory(dir=os.path.dirname(os.path.abspath(a.data))) as w:
            for level, block in ((3, None), (3, "1M"), *([(19, None)] if ints(a.solid_slow)
                                                          else [])):
                label = f"mksquashfs zstd-{level}" + (f" -b {block}" if block else "")
                log(f"{name}: {label}")
                r = squashfs(a.data, w, level, block, a.jobs)
                save(rows, a.jsonl, dict(base, option=label, kind="squashfs",
                                         ratio=data.raw_bytes / r["store_bytes"], **r))
    if a.packs:
        with tempfile.TemporaryDirectory(dir=os.path.dirname(os.path.abspath(a.data))) as w:
            for spec in a.packs.split(";"):
                args = [] if spec.strip() == "default" else spec.split()
                label = "fanstore pack " + (" ".join(args) or "(default)")
                log(f"{name}: {label}")
                r = real_pack(a.data, w, label, args, a.read_files, a.seed)
                save(rows, a.jsonl, dict(base, ratio=data.raw_bytes / r["store_bytes"], **r))
                log(f"  ratio {rows[-1]['ratio']:.3f}, pack {r['pack_wall_s']} s, API read "
                    f"{r['api_cpu_us_per_file']:.0f} µs CPU/file")
    opts = options(ints(a.levels), ints(a.blocks), ints(a.solid_slow), not a.no_group,
                   a.sample_level)
    if a.only:
        keys = a.only.split(",")
        opts = [o for o in opts if any(k in o.name for k in keys)]
    for opt in opts:
        if opt.dict and not dicts:
            continue
        log(f"{name}: {opt.name}")
        lay = make_layout(data, opt, a.partitions)
        stored, raw, prob, cpu, wall = compress_all(data, lay, opt, dicts, a.jobs, a.slow_mb,
                                                    a.seed)
        done = stored >= 0
        if prob < 1.0:
            data_bytes = float(stored[done].sum() / prob)
            est = stored.copy()
            ratio_k = stored[done].sum() / raw[done].sum()
            est[~done] = np.maximum(1, (raw[~done] * ratio_k).astype(np.int64))
        else:
            data_bytes = float(stored.sum())
            est = stored
        used_dicts = {codec_for(opt, dicts, k)[1] for k in set(lay.kind)} - {None}
        dict_bytes = sum(len(dicts[k]) for k in used_dicts)
        idx = index_bytes(data, lay, est, opt, dicts, lookup, names)
        total = data_bytes + idx + PARTITION_HEADER_SIZE * a.partitions
        solid_files = int(np.sum((lay.count == 1) & (lay.offset > 0))) if opt.block else 0
        costs = read_costs(data, lay, opt, dicts,
                           a.read_files if not opt.sampled else min(a.read_files, 1000),
                           a.seed)
        save(rows, a.jsonl, dict(
            base, option=opt.name, kind="fanstore", level=opt.level, dict=opt.dict,
            block_kb=opt.block >> 10, group=opt.group, sampled=bool(prob < 1.0),
            sample_fraction=round(prob, 4), chunks=len(lay.pieces),
            data_bytes=int(data_bytes), index_bytes=idx, dict_bytes=dict_bytes,
            # dictionaries live in the index's codec table: index_bytes includes them
            store_bytes=int(total), ratio=data.raw_bytes / total,
            encode_cpu_s=round(cpu / max(prob, 1e-9), 2), encode_wall_s=round(wall, 2),
            files_in_solid_blocks=solid_files, **costs))
        r = rows[-1]
        log(f"  ratio {r['ratio']:.3f}, random {r['random_us_per_file']:.1f} µs/file, "
            f"in order {r['in_order_us_per_file']:.1f} µs/file")
    text = render(rows, time.monotonic() - t_start)
    print(text)
    if a.md:
        with open(a.md, "w") as f:
            f.write(text + "\n")
    return 0


def render(rows: list[dict], seconds: float) -> str:
    if not rows:
        return ""
    r0 = rows[0]
    sq = next((r for r in rows if r["option"] == "mksquashfs zstd-3"), None)
    out = []
    for r in rows:
        head = (r["option"] + (" ~" if r.get("sampled") else ""), f"{r['ratio']:.3f}",
                f"{r['ratio'] / sq['ratio']:.2f}x" if sq else "–",
                f"{r['store_bytes'] / MB:,.1f}")
        pack = f"{r.get('pack_cpu_s', 0):.0f} ({r.get('pack_wall_s', 0):.0f} wall)"
        if r["kind"] == "pack":
            out.append((*head, "–", f"API {r['api_cpu_us_per_file']:,.0f} (CPU), "
                        f"{r['api_wall_us_per_file']:,.0f} (wall)", "–", "–", pack))
        elif r["kind"] == "squashfs":
            out.append((*head, "–", "–", "–", "–", pack))
        else:
            out.append((*head, f"{r['index_bytes'] / MB:,.2f}", f"{r['random_us_per_file']:,.1f}",
                        f"{r['in_order_us_per_file']:,.1f}", f"{r['decoded_kb_per_file']:,.1f}",
                        f"{r['encode_cpu_s']:,.0f}"))
    return h.table(["option", "ratio", "vs mksquashfs zstd-3", "stored MB", "index MB",
                    "random read µs/file", "in-order read µs/file", "decoded kB/file (random)",
                    "encode / pack CPU s"], out, "l" * 9,
                   f"{r0['dataset']}: {r0['files']:,} files, {r0['raw_bytes'] / MB:,.1f} MB "
                   f"(mean {r0['raw_bytes'] / max(1, r0['files']) / 1e3:,.2f} kB), "
                   f"{r0['partitions']} partitions; run {r0['run']}, {seconds / 60:.0f} min")


if __name__ == "__main__":
    sys.exit(main())
