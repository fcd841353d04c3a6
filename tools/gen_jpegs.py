#!/usr/bin/env python3
"""Make a deterministic set of dataset-like JPEGs from photographs that packages ship.

    python tools/gen_jpegs.py OUT --files 2000 [--seed 0] [--classes 20]

The sources are natural images inside the wheels themselves (nothing is downloaded):
scikit-image's ``skimage/data`` (astronaut, chelsea, coffee, the two motorcycle views,
rocket, the Hubble deep field, retina, an IHC slide, camera, and the brick, grass and
gravel textures) and matplotlib's ``sample_data/grace_hopper.jpg``; whichever of the two
packages is installed (``pip install 'fanstore[bench]'`` installs both). Each file is a
random crop (50-100% of the side, an aspect ratio of 4:3, 3:2, 1:1 or their portraits),
scaled to an ImageNet-like size (long side 400-500 px, mostly 500, as ImageNet's 500x375),
sometimes mirrored, its exposure and contrast jittered, sharpened as cameras do (an unsharp
mask), sensor-like grain added (sigma 5-11), and encoded by Pillow (libjpeg) at quality
75-95 (most near 90-95): 4:2:0 chroma subsampling for 80% of the files and 4:4:4 for the
rest, 8% progressive, 30% with optimised Huffman tables, 4% greyscale, and a ``--cmyk``
fraction (default 0.5%) in CMYK, a JPEG that JPEG XL cannot transcode (ImageNet's training
set holds a few dozen). 2,000 files: about 100 kB each on average (12-290 kB). Files go to
``OUT/cNNN/img_NNNNNN.jpg``.

Every file depends only on (seed, file number): the same arguments give the same bytes,
in any order, with any ``--jobs``.
"""

from __future__ import annotations

import argparse
import importlib.util
import io
import os
import sys
from multiprocessing import Pool

import numpy as np

#: (package, path inside it) of the photographs used, if present.
PHOTOS = (
    ("skimage", "data/astronaut.png"),
    ("skimage", "data/chelsea.png"),
    ("skimage", "data/coffee.png"),
    ("skimage", "data/motorcycle_left.png"),
    ("skimage", "data/motorcycle_right.png"),
    ("skimage", "data/rocket.jpg"),
    ("skimage", "data/hubble_deep_field.jpg"),
    ("skimage", "data/retina.jpg"),
    ("skimage", "data/ihc.png"),
    ("skimage", "data/camera.png"),
    ("skimage", "data/brick.png"),
    ("skimage", "data/grass.png"),
    ("skimage", "data/gravel.png"),
    ("matplotlib", "mpl-data/sample_data/grace_hopper.jpg"),
)
ASPECTS = (4 / 3, 3 / 2, 1.0, 3 / 4, 2 / 3)
ASPECT_P = (0.45, 0.2, 0.1, 0.15, 0.1)

_SOURCES: list[np.ndarray] = []


def photo_paths() -> list[str]:
    """The photographs found in the installed packages (located without importing them)."""
    paths = []
    for package, rel in PHOTOS:
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            continue
        path = os.path.join(list(spec.submodule_search_locations)[0], rel)
        if os.path.isfile(path):
            paths.append(path)
    return paths


def load_sources(paths: list[str]) -> list[np.ndarray]:
    from PIL import Image

    out = []
    for path in paths:
        with Image.open(path) as im:
            out.append(np.asarray(im.convert("RGB"), dtype=np.uint8))
    return out


def make_jpeg(index: int, seed: int, sources: list[np.ndarray], cmyk: float) -> bytes:
    """File ``index`` of the set: a function of (seed, index) and the sources only."""
    from PIL import Image, ImageFile, ImageFilter

    rng = np.random.default_rng([seed & 0xFFFFFFFF, index])
    src = sources[int(rng.integers(len(sources)))]
    h, w = src.shape[:2]
    aspect = ASPECTS[int(rng.choice(len(ASPECTS), p=ASPECT_P))]
    side = rng.uniform(0.5, 1.0)
    cw = int(min(w, h * aspect) * side)
    ch = max(16, int(cw / aspect))
    cw = max(16, cw)
    x0 = int(rng.integers(0, w - cw + 1))
    y0 = int(rng.integers(0, h - ch + 1))
    crop = src[y0:y0 + ch, x0:x0 + cw].astype(np.float32)
    if rng.random() < 0.5:
        crop = crop[:, ::-1]
    crop = (crop - 128.0) * rng.uniform(0.85, 1.15) + 128.0 + rng.uniform(-12, 12)
    long_side = 500 if rng.random() < 0.7 else int(rng.integers(400, 500))
    tw, th = ((long_side, round(long_side / aspect)) if aspect >= 1
              else (round(long_side * aspect), long_side))
    img = Image.fromarray(crop.clip(0, 255).astype(np.uint8)).resize(
        (tw, th), Image.Resampling.LANCZOS)
    # Cameras sharpen: an unsharp mask brings back the edges that scaling softened.
    img = img.filter(ImageFilter.UnsharpMask(radius=float(rng.uniform(1.0, 2.5)),
                                             percent=int(rng.integers(80, 200)), threshold=0))
    arr = np.asarray(img, dtype=np.float32)
    arr = arr + rng.normal(0.0, rng.uniform(5.0, 11.0), arr.shape).astype(np.float32)
    img = Image.fromarray(arr.clip(0, 255).astype(np.uint8))
    roll = rng.random()
    if roll < cmyk:
        img = img.convert("CMYK")
    elif roll < cmyk + 0.04:
        img = img.convert("L")
    quality = 95 - int(21 * rng.random() ** 3)  # 75-95, most near 90-95
    options = {
        "quality": quality,
        "subsampling": 2 if rng.random() < 0.8 else 0,  # 4:2:0, else 4:4:4
        "progressive": bool(rng.random() < 0.08),
        "optimize": bool(rng.random() < 0.3),
    }
    # libjpeg writes a progressive or optimised file in one piece ("Suspension not allowed
    # here" otherwise): Pillow's buffer must hold the whole file, which a noisy 500 px
    # image at quality 95 can make larger than the width x height Pillow allows.
    ImageFile.MAXBLOCK = max(ImageFile.MAXBLOCK, 8 << 20)
    buf = io.BytesIO()
    img.save(buf, "JPEG", **options)
    return buf.getvalue()


def file_path(out: str, index: int, classes: int) -> str:
    return os.path.join(out, f"c{index % classes:03d}", f"img_{index:06d}.jpg")


def _init(paths: list[str]) -> None:
    _SOURCES[:] = load_sources(paths)


def _write(job: tuple[str, int, int, int, float]) -> int:
    out, index, seed, classes, cmyk = job
    data = make_jpeg(index, seed, _SOURCES, cmyk)
    path = file_path(out, index, classes)
    with open(path, "wb") as f:
        f.write(data)
    return len(data)


def generate(out: str, files: int, seed: int = 0, classes: int = 20, cmyk: float = 0.005,
             jobs: int = 1) -> tuple[int, int]:
    """Write ``files`` JPEGs under ``out``; returns (files, bytes)."""
    paths = photo_paths()
    if not paths:
        raise SystemExit("gen_jpegs: no photographs found: install scikit-image or "
                         "matplotlib (pip install 'fanstore[bench]')")
    classes = max(1, min(classes, files))
    for c in range(classes):
        os.makedirs(os.path.join(out, f"c{c:03d}"), exist_ok=True)
    work = [(out, i, seed, classes, cmyk) for i in range(files)]
    if jobs > 1:
        with Pool(jobs, initializer=_init, initargs=(paths,)) as pool:
            sizes = pool.map(_write, work, chunksize=16)
    else:
        _init(paths)
        sizes = [_write(job) for job in work]
    return len(sizes), sum(sizes)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("--files", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--classes", type=int, default=20)
    ap.add_argument("--cmyk", type=float, default=0.005,
                    help="fraction of CMYK JPEGs (JPEG XL cannot transcode them; default 0.005)")
    ap.add_argument("--jobs", type=int, default=1)
    args = ap.parse_args(argv)
    n, total = generate(args.out, args.files, args.seed, args.classes, args.cmyk, args.jobs)
    print(f"{n} JPEGs, {total / 1e6:.1f} MB (mean {total / max(1, n) / 1e3:.1f} kB) in "
          f"{args.out} from {len(photo_paths())} photographs", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
