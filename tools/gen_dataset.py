#!/usr/bin/env python3
"""Generate a deterministic deep-learning-like dataset for demos, tests and benchmarks.

Without ``--preset`` (the original set, byte-identical to earlier versions for the same
arguments): 25% random bytes (.bin, a stand-in for JPEG), 12.5% numeric CSV, 12.5% JSON
records, 50% float32 .npy arrays of smooth noise with the low mantissa bits zeroed (as
sensor data or quantised features are). Files are spread over class directories; sizes are
uniform in [--min-kb, --max-kb]. Optional large float32 files go to large/.

    python tools/gen_dataset.py OUT --files 2000 --classes 20 [--large 1 --large-mb 48]

Presets (``--scale F`` multiplies every file count, for quick runs; ``--jobs`` processes):

``small-text``
    300,000 text files of about 2.6 kB (mean 2.6 kB, 0.6-6 kB) in 1,000 class directories
    ``train/c0000/ .. c0999/``, in the proportions of an image-caption/annotation corpus:
    50% ``.json`` COCO-style annotation records (pretty-printed, 2-space indent: an image id,
    file name, size, licence, 3-6 captions, 1-8 objects with category, bbox, area), 30%
    ``.txt`` caption files (10-30 template sentences over a vocabulary of about 400 words,
    Zipf-distributed), 20% ``.csv`` per-clip detection tables (a fixed header, 20-70 rows of
    frame, timestamp, box, label, confidence). Files share keys, headers, vocabulary and
    category names (what a compressor can learn across files) but no two are alike; numbers
    and ids are random. 780-800 MB.
``peers``
    The peer benchmark's shape: 20,000 files of 50-150 kB in 100 class directories under
    ``small/`` (the default kinds above, seed 20240601), about 2.0 GB; with ``--with-large``
    also 8 float32 files of 256 MiB under ``large/``.

Each preset file's content depends only on (seed, file number), so ``--jobs`` does not
change a byte.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from multiprocessing import Pool

import numpy as np


def npy_bytes(arr: np.ndarray) -> bytes:
    header = {"descr": arr.dtype.str, "fortran_order": False, "shape": arr.shape}
    text = repr(header).encode("latin1")
    pad = 64 - (10 + len(text) + 1) % 64
    text += b" " * pad + b"\n"
    return b"\x93NUMPY\x01\x00" + len(text).to_bytes(2, "little") + text + arr.tobytes()


def smooth_float32(rng: np.random.Generator, n: int) -> np.ndarray:
    steps = rng.standard_normal(n).astype(np.float32) * 0.01
    arr = np.cumsum(steps, dtype=np.float32) + np.float32(rng.uniform(-1, 1))
    # Zero the low 12 mantissa bits: smooth data with limited precision.
    bits = arr.view(np.uint32) & np.uint32(0xFFFFF000)
    return bits.view(np.float32)


def make_file(kind: str, size: int, rng: np.random.Generator) -> bytes:
    if kind == "bin":
        return rng.bytes(size)
    if kind == "csv":
        rows = []
        total = 0
        while total < size:
            vals = rng.normal(0, 100, 6)
            row = ",".join(f"{v:.4f}" for v in vals) + "\n"
            rows.append(row)
            total += len(row)
        return "".join(rows).encode()[:size]
    if kind == "json":
        out = []
        total = 0
        i = 0
        while total < size:
            rec = {"id": int(rng.integers(0, 1 << 30)), "label": int(rng.integers(0, 1000)),
                   "score": round(float(rng.random()), 6),
                   "tags": [f"t{int(x)}" for x in rng.integers(0, 50, 3)],
                   "bbox": [int(x) for x in rng.integers(0, 512, 4)], "seq": i}
            line = json.dumps(rec) + "\n"
            out.append(line)
            total += len(line)
            i += 1
        return "".join(out).encode()[:size]
    if kind == "npy":
        n = max(1, (size - 128) // 4)
        return npy_bytes(smooth_float32(rng, n))
    raise ValueError(kind)


KINDS = ["bin", "csv", "json", "npy", "npy", "bin", "npy", "npy"]  # 2/8 bin, 1/8 csv, ...


def generate_default(out: str, files: int, classes: int, min_kb: int, max_kb: int,
                     large: int, large_mb: int, seed: int, subdir: str) -> int:
    """The original data set (one generator for every file, in order)."""
    rng = np.random.default_rng(seed)
    root = os.path.join(out, subdir)
    total = 0
    for c in range(classes):
        os.makedirs(os.path.join(root, f"class{c:03d}"), exist_ok=True)
    for i in range(files):
        kind = KINDS[i % len(KINDS)]
        size = int(rng.integers(min_kb * 1000, max_kb * 1000 + 1))
        data = make_file(kind, size, rng)
        path = os.path.join(root, f"class{i % classes:03d}", f"{i:07d}.{kind}")
        with open(path, "wb") as f:
            f.write(data)
        total += len(data)
    if large:
        os.makedirs(os.path.join(out, "large"), exist_ok=True)
        for j in range(large):
            n = large_mb * (1 << 20) // 4
            data = smooth_float32(rng, n).tobytes()
            with open(os.path.join(out, "large", f"big{j:02d}.f32"), "wb") as f:
                f.write(data)
            total += len(data)
    return total


# --------------------------------------------------------------------------- text corpus

CATEGORIES = (
    "person bicycle car motorcycle airplane bus train truck boat traffic_light fire_hydrant "
    "stop_sign parking_meter bench bird cat dog horse sheep cow elephant bear zebra giraffe "
    "backpack umbrella handbag tie suitcase frisbee skis snowboard sports_ball kite "
    "baseball_bat baseball_glove skateboard surfboard tennis_racket bottle wine_glass cup "
    "fork knife spoon bowl banana apple sandwich orange broccoli carrot hot_dog pizza donut "
    "cake chair couch potted_plant bed dining_table toilet tv laptop mouse remote keyboard "
    "cell_phone microwave oven toaster sink refrigerator book clock vase scissors teddy_bear "
    "hair_drier toothbrush").split()
NOUNS = (
    "man woman child boy girl person people dog cat horse bird bus train car truck bicycle "
    "motorcycle plate table kitchen street road field beach park room window door wall sign "
    "tree building city bench grass water wave surfer skateboarder player ball bat racket "
    "kite umbrella pizza sandwich cake donut banana laptop phone computer desk couch bed "
    "clock giraffe elephant zebra sheep cow bear airplane boat toilet sink mirror bowl cup "
    "glass bottle vase flowers shelf fence sidewalk crowd group team snow hill mountain sky "
    "river lake bridge station platform tracks market store restaurant counter oven stove "
    "refrigerator van taxi pole light corner intersection lot yard garden tower").split()
ADJECTIVES = (
    "small large big little young old white black brown red blue green yellow orange gray "
    "tall short wooden metal empty crowded busy quiet sunny cloudy wet dry dirty clean "
    "colorful bright dark open closed parked modern old-fashioned fresh sliced cute happy "
    "smiling blurry stuffed plastic tiled narrow wide snowy grassy sandy").split()
VERBS = (
    "sitting standing walking running riding holding eating looking playing laying "
    "parked driving flying crossing waiting carrying throwing catching jumping cutting "
    "talking watching posing resting grazing leaning hanging sleeping surfing skiing").split()
PREPOSITIONS = "on in next_to near under behind in_front_of beside across_from along " \
               "over at_the_edge_of inside on_top_of".split()
PLACES = (
    "a busy street;a kitchen counter;a grassy field;the beach;a city park;a living room;"
    "a train station;a parking lot;a snowy hill;a dining table;a wooden bench;the ocean;"
    "a dirt road;an airport runway;a small bathroom;a fenced area;a baseball field;"
    "a tennis court;a market stall;the sidewalk;a river bank;a farm;a zoo enclosure;"
    "a bedroom;an office desk").split(";")
LICENSES = 8


def _zipf_pick(rng: np.random.Generator, words: list[str], n: int) -> list[str]:
    """``n`` words, the first ones of the list far more often (Zipf-like, as in captions)."""
    k = len(words)
    ranks = (rng.zipf(1.3, n) - 1) % k
    return [words[r] for r in ranks.tolist()]


def _sentence(rng: np.random.Generator) -> str:
    adj, adj2 = _zipf_pick(rng, ADJECTIVES, 2)
    noun, noun2 = _zipf_pick(rng, NOUNS, 2)
    verb = _zipf_pick(rng, VERBS, 1)[0]
    prep = PREPOSITIONS[int(rng.integers(len(PREPOSITIONS)))].replace("_", " ")
    place = PLACES[int(rng.integers(len(PLACES)))]
    form = int(rng.integers(6))
    det = "an" if adj[0] in "aeiou" else "a"
    if form == 0:
        s = f"{det} {adj} {noun} {verb} {prep} {place}"
    elif form == 1:
        s = f"there is {det} {adj} {noun} {verb} {prep} the {adj2} {noun2}"
    elif form == 2:
        s = f"{int(rng.integers(2, 7))} {noun}s {verb} {prep} {place}"
    elif form == 3:
        s = f"the {noun} is {verb} {prep} a {adj2} {noun2} in {place}"
    elif form == 4:
        s = f"a close up of {det} {adj} {noun} with a {adj2} {noun2}"
    else:
        s = f"{det} {adj} {noun} and a {noun2} {verb} {prep} {place}"
    return s[0].upper() + s[1:] + "."


def caption_text(rng: np.random.Generator) -> bytes:
    lines = [_sentence(rng) for _ in range(int(rng.integers(25, 60)))]
    return ("\n".join(lines) + "\n").encode()


def annotation_json(rng: np.random.Generator, i: int, cls: int) -> bytes:
    w, h = [(640, 480), (640, 427), (500, 375), (480, 640), (640, 360)][int(rng.integers(5))]
    objects = []
    for k in range(int(rng.integers(2, 13))):
        bw, bh = rng.uniform(8, w / 2), rng.uniform(8, h / 2)
        x, y = rng.uniform(0, w - bw), rng.uniform(0, h - bh)
        cat = _zipf_pick(rng, CATEGORIES, 1)[0]
        # An outline polygon around the box centre, as COCO's "segmentation".
        n = int(rng.integers(6, 16))
        ang = np.sort(rng.uniform(0, 2 * np.pi, n))
        rad = rng.uniform(0.6, 1.0, n)
        poly = np.empty(2 * n)
        poly[0::2] = x + bw / 2 * (1 + rad * np.cos(ang))
        poly[1::2] = y + bh / 2 * (1 + rad * np.sin(ang))
        objects.append({
            "id": int(rng.integers(100000, 2000000)),
            "category_id": CATEGORIES.index(cat) + 1,
            "category": cat.replace("_", " "),
            "segmentation": [[round(v, 2) for v in poly.tolist()]],
            "bbox": [round(x, 2), round(y, 2), round(bw, 2), round(bh, 2)],
            "area": round(bw * bh * rng.uniform(0.5, 0.9), 1),
            "iscrowd": int(rng.random() < 0.05),
        })
    rec = {
        "image_id": int(rng.integers(1, 600000)),
        "file_name": f"c{cls:04d}/{i:09d}.jpg",
        "width": w,
        "height": h,
        "license": int(rng.integers(1, LICENSES + 1)),
        "date_captured": f"2013-{int(rng.integers(1, 13)):02d}-{int(rng.integers(1, 29)):02d} "
                         f"{int(rng.integers(24)):02d}:{int(rng.integers(60)):02d}:"
                         f"{int(rng.integers(60)):02d}",
        "captions": [_sentence(rng) for _ in range(5)],
        "annotations": objects,
    }
    return (json.dumps(rec) + "\n").encode()


CSV_HEADER = "frame,timestamp_ms,x,y,w,h,label,confidence,track_id\n"


def detection_csv(rng: np.random.Generator) -> bytes:
    rows = int(rng.integers(30, 90))
    t = int(rng.integers(0, 10_000_000))
    track = int(rng.integers(1, 5000))
    lines = [CSV_HEADER]
    for f in range(rows):
        t += int(rng.integers(30, 45))
        if rng.random() < 0.2:
            track += 1
        x, y = rng.uniform(0, 1200, 2)
        w, h = rng.uniform(10, 300, 2)
        label = _zipf_pick(rng, CATEGORIES, 1)[0]
        lines.append(f"{f},{t},{x:.1f},{y:.1f},{w:.1f},{h:.1f},{label},"
                     f"{rng.uniform(0.3, 1):.3f},{track}\n")
    return "".join(lines).encode()


TEXT_KINDS = ("json", "json", "txt", "json", "csv", "txt", "json", "txt", "json", "csv")


def text_file(seed: int, i: int, classes: int) -> tuple[str, bytes]:
    """File number ``i`` of a text corpus: (relative path under its root, content)."""
    rng = np.random.default_rng([seed, 7, i])
    kind = TEXT_KINDS[i % len(TEXT_KINDS)]
    cls = i % classes
    if kind == "json":
        data = annotation_json(rng, i, cls)
    elif kind == "txt":
        data = caption_text(rng)
    else:
        data = detection_csv(rng)
    return f"c{cls:04d}/{i:09d}.{kind}" if classes > 100 else f"c{cls:03d}/{i:09d}.{kind}", data


def _write_text_range(args: tuple[str, int, int, int, int]) -> int:
    root, seed, lo, hi, classes = args
    total = 0
    for i in range(lo, hi):
        rel, data = text_file(seed, i, classes)
        with open(os.path.join(root, rel), "wb") as f:
            f.write(data)
        total += len(data)
    return total


def _parallel(fn, jobs: list, procs: int) -> int:
    if procs <= 1 or len(jobs) <= 1:
        return sum(fn(j) for j in jobs)
    with Pool(procs) as pool:
        return sum(pool.imap_unordered(fn, jobs))


def _ranges(n: int, step: int = 2000):
    return [(lo, min(n, lo + step)) for lo in range(0, n, step)]


def generate_text(root: str, n: int, classes: int, seed: int, procs: int) -> int:
    for c in range(classes):
        os.makedirs(os.path.join(root, f"c{c:04d}" if classes > 100 else f"c{c:03d}"),
                    exist_ok=True)
    return _parallel(_write_text_range,
                     [(root, seed, lo, hi, classes) for lo, hi in _ranges(n)], procs)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out")
    p.add_argument("--preset", choices=("small-text", "peers"),
                   help="a named data set (see the module docstring); the other size options "
                        "are then ignored except --scale, --with-large, --seed, --jobs")
    p.add_argument("--scale", type=float, default=1.0,
                   help="with --preset: multiply the file counts (e.g. 0.1 for a quick run)")
    p.add_argument("--with-large", action="store_true",
                   help="with --preset peers: also the 8 large float32 files of 256 MiB")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                   help="processes for the presets (the content does not depend on it)")
    p.add_argument("--files", type=int, default=2000)
    p.add_argument("--classes", type=int, default=20)
    p.add_argument("--min-kb", type=int, default=50)
    p.add_argument("--max-kb", type=int, default=150)
    p.add_argument("--large", type=int, default=0, help="number of large float32 files")
    p.add_argument("--large-mb", type=int, default=64)
    p.add_argument("--seed", type=int, default=20240601)
    p.add_argument("--subdir", default="train", help="directory for the small files")
    a = p.parse_args(argv)
    if not a.scale > 0:
        p.error("--scale must be positive")
    if a.preset == "small-text":
        n = max(1, round(300_000 * a.scale))
        total = generate_text(os.path.join(a.out, "train"), n, 1000, a.seed, a.jobs)
        what = f"{n:,} small text files"
    elif a.preset == "peers":
        n = max(1, round(20_000 * a.scale))
        large = 8 if a.with_large else 0
        total = generate_default(a.out, n, 100, 50, 150, large, 256, a.seed, "small")
        what = f"{n:,} files of 50-150 kB" + (" and 8 large" if large else "")
    else:
        total = generate_default(a.out, a.files, a.classes, a.min_kb, a.max_kb, a.large,
                                 a.large_mb, a.seed, a.subdir)
        what = f"{a.files} small files{f' and {a.large} large' if a.large else ''}"
    print(f"generated {what} ({total / 1e6:.1f} MB) in {a.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
