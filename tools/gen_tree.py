#!/usr/bin/env python3
"""Generate a tree of many tiny files with ImageNet-like names, fast (for scale benchmarks).

    python tools/gen_tree.py OUT --files 10000000 [--per-dir 1000] [--jobs 2]

Layout: ``OUT/train/nDDDDDDDD/nDDDDDDDD_IIIIII.txt``, ``--per-dir`` files per directory
(ImageNet's shape: about 1,000 per class). Each file holds 20-300 words of an English-like
text (a Zipf-distributed vocabulary of 2,000 words): a window of a 32 MB text generated once
per seed, so files share words but not their order. Mean size about 1 kB: at 10 million files
the tree takes about 40 GB of ext4 blocks (one 4 KiB block per file) and 10 million inodes.

Deterministic: a file's content depends only on (seed, file number); ``--jobs`` processes
write disjoint directories. An existing complete tree (its stamp file matches) is kept.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from multiprocessing import Pool

import numpy as np

_CORPUS_BYTES = 32 << 20
_state: dict = {}


def _corpus(seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    letters = np.frombuffer(b"etaoinshrdlcumwfgypbvkjxqz", dtype=np.uint8)
    p = 1.0 / np.arange(1, 27)
    p /= p.sum()
    vocab = [bytes(rng.choice(letters, size=int(rng.integers(2, 11)), p=p)) for _ in range(2000)]
    z = 1.0 / np.arange(1, len(vocab) + 1)
    z /= z.sum()
    words = rng.choice(len(vocab), size=_CORPUS_BYTES // 5, p=z)
    text = b" ".join(vocab[w] for w in words)
    return text[:_CORPUS_BYTES]


def _init(seed: int) -> None:
    _state["text"] = _corpus(seed)
    _state["seed"] = seed


def file_windows(seed: int, d: int, n: int, text_len: int) -> tuple[np.ndarray, np.ndarray]:
    """(start, length) in the corpus of the n files of directory d: a file's bytes are
    ``corpus[start : start + length]`` (tools/bench/synth_store.py writes the same)."""
    rng = np.random.default_rng([seed, d])
    starts = rng.integers(0, text_len - 4096, size=n)
    lengths = rng.integers(20, 301, size=n) * 6  # about 6 bytes a word
    return starts, lengths


def tree_args(p: argparse.ArgumentParser) -> None:
    """The options that say which tree: file count, files a directory, seed; and jobs."""
    p.add_argument("--files", type=int, required=True)
    p.add_argument("--per-dir", type=int, default=1000)
    p.add_argument("--seed", type=int, default=20261127)
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1)


def _write_dir(job: tuple[str, int, int, int]) -> int:
    out, d, first, n = job
    text = _state["text"]
    starts, lengths = file_windows(_state["seed"], d, n, len(text))
    name = f"n{d:08d}"
    path = os.path.join(out, "train", name)
    os.makedirs(path, exist_ok=True)
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC
    for i in range(n):
        fd = os.open(f"{path}/{name}_{first + i:06d}.txt", flags, 0o644)
        try:
            s = int(starts[i])
            os.write(fd, text[s : s + int(lengths[i])])
        finally:
            os.close(fd)
    return n


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out")
    tree_args(p)
    a = p.parse_args(argv)
    stamp = os.path.join(a.out, ".gen_tree.json")
    want = {"files": a.files, "per_dir": a.per_dir, "seed": a.seed}
    try:
        with open(stamp) as f:
            if json.load(f) == want:
                print(f"{a.out}: complete tree already there", file=sys.stderr)
                return 0
    except (OSError, ValueError):
        pass
    os.makedirs(os.path.join(a.out, "train"), exist_ok=True)
    jobs = [(a.out, d, 0, min(a.per_dir, a.files - d * a.per_dir))
            for d in range((a.files + a.per_dir - 1) // a.per_dir)]
    done = 0
    with Pool(a.jobs, initializer=_init, initargs=(a.seed,)) as pool:
        for n in pool.imap_unordered(_write_dir, jobs, chunksize=4):
            done += n
            if done % (100 * a.per_dir) < n:
                print(f"\r{done:,} / {a.files:,} files", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    with open(stamp, "w") as f:
        json.dump(want, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
