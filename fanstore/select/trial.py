"""The finalists, measured: a miniature of the source packed with a candidate, mounted
cold the way the job will mount it, read once per round, and scaled to the whole source.

The trial set (:func:`make_trial_set`, once per selection, shared by every finalist):

* **Whole files**: the source's files of at most :data:`SMALL_CHUNKS` chunks, drawn
  uniformly (seeded), up to :data:`MAX_FILES` files or :data:`MAX_WHOLE_BYTES`. They keep
  their extension and size (so their kind, and the codec a per-kind policy gives them) and
  are filed in directories of as many files as the source's directories hold on average
  (a cold lookup of a directory costs what it costs in the source, per file).
* **Pieces** of the larger files: the whole file, or :data:`PIECE_CHUNKS` chunks of it
  from a random chunk-aligned offset, :data:`PIECES_PER_READER` per reader, up to
  :data:`MAX_PIECE_BYTES`: a large file is read sequentially, and a file's first chunks
  cost more than the rest (the kernel's read-ahead grows as it goes: pieces of 16 chunks
  of 64 MiB files read at 0.7x the files' pace), so a piece is as long as the files or
  64 chunks.

A finalist (:func:`measure`) packs a prefix of that set (its own encode speed decides how
much: :data:`PACK_SECONDS` of encoding on this node's cores, never fewer than
:data:`MIN_FILES` whole files), and reads it ``--rounds`` times (3 by default; up to
``EXTRA_ROUNDS`` (2) more while the rounds disagree by more than :data:`SPREAD`): each round
drops the
store from the page cache (and checks with ``mincore`` that it is gone: a round whose
store stayed resident, on a tmpfs say, is said not to be cold), mounts it afresh
(``fanstore mount`` with the user's mode, ``--workers`` at most the selection's
``--cores``, ``--cache-mb`` scaled to the trial's share of the source, so solid blocks see
the cache pressure of the whole store) or opens it with the Python API, and runs one epoch
(:mod:`.epoch`). A round is scaled to the source by what it cost per whole file and per
byte of the pieces::

    T = (sum of whole-file latencies / whole files read) x whole files of the source
      + (sum of piece latencies / piece bytes read) x bytes of the source's large files
    epoch seconds = T / (files in flight on average in the round)

and the median round counts. With ``--cores`` above the cores here the readers are the
cores here, and the rate is scaled to ``--cores`` by the lower of linear scaling and the
CPU bound (cores / CPU seconds per file of every process of the pass), which the report
says.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fanstore.errors import FanStoreError
from fanstore.mountspec import DEFAULT_MAX_WORKERS
from fanstore.kinds import file_kind
from fanstore.select.epoch import COLD_RESIDENT, PassResult, Target, drop_page_cache, run_pass
from fanstore.select.options import EXTRA_ROUNDS, ROUNDS
from fanstore.select.tempmount import TrialError, mount, remove, unmount

log = logging.getLogger(__name__)

#: A large file is one of more than this many chunks (read sequentially, measured per
#: byte); a trial reads pieces of at most ``PIECE_CHUNKS`` chunks of them (the whole file
#: when it is no longer).
SMALL_CHUNKS = 16
PIECE_CHUNKS = 64
#: Whole files of the trial set: at most this many, and this many bytes.
MAX_FILES = 8000
MAX_WHOLE_BYTES = 128 << 20
#: A finalist's trial reads at least this many whole files (or all the set has).
MIN_FILES = 500
#: Pieces of large files: this many per reader (two files each, so that one file's start
#: is not the whole measurement), at most this many bytes.
PIECES_PER_READER = 2
MAX_PIECE_BYTES = 256 << 20
#: Seconds of encoding a finalist's trial may take on this node's cores.
PACK_SECONDS = 4.0
#: Partitions of a trial store: ``fanstore pack``'s default. A store's layout changes what
#: a cold pass costs (the kernel's read-ahead works per partition file: 1,500 files of
#: 120 kB read 12% faster cold from 4 partitions than from 8), so the trial is packed as
#: the user's store will be by default.
PARTITIONS = 8
#: Cold passes per finalist: ``--rounds`` (options.ROUNDS, 3), and up to EXTRA_ROUNDS more
#: while the slowest and the fastest are more than SPREAD apart; the median counts. On this
#: shared 2-core VM one pass in four or five runs 20-35% slower than the rest (12 passes of
#: one trial: 14,757 and 16,695 files/s, the others 17,484-18,810), and a median of three
#: unlucky ones was 0.74x the whole set's pace.
SPREAD = 1.15
#: The mount's decoded-chunk cache (``fanstore mount --cache-mb``'s default), scaled to
#: the trial's share of the source.
MOUNT_CACHE_MB = 256
API_CACHE_MB = 64
#: Seconds a round's readers may take.
TIMEOUT = 300.0

@dataclass
class TrialFile:
    rel: str  # in the trial tree
    size: int
    piece: bool  # cut from a large file
    kind: str  # the source file's kind (its codec under a per-kind policy)


@dataclass
class TrialSet:
    """The files a finalist is measured on, in random order (a prefix of ``whole`` and of
    ``pieces`` is itself a random trial), and the source they stand for."""

    root: str  # the trial tree
    whole: list[TrialFile]
    pieces: list[TrialFile]
    source_whole_files: int
    source_whole_bytes: int
    source_large_files: int
    source_large_bytes: int
    chunk_size: int

    @property
    def source_files(self) -> int:
        return self.source_whole_files + self.source_large_files

    @property
    def source_bytes(self) -> int:
        return self.source_whole_bytes + self.source_large_bytes


@dataclass
class HowToRead:
    """How the job reads: ``reader`` mount or api, ``mode`` sync or prefetch, ``readers``
    processes here, ``cores`` the selection's cores (the rate is scaled to them when
    there are more of them than readers)."""

    reader: str
    mode: str
    readers: int
    cores: int

    @property
    def workers(self) -> int:
        """The trial mount's FUSE workers (``--workers``): the selection's cores, at most
        the cores here (the readers) and the mount's own cap. Each decodes on a core of
        its own, and the read-order model gives each worker its share of the cache."""
        return max(1, min(self.cores, self.readers, DEFAULT_MAX_WORKERS))

    def describe(self, cold: bool | None = True) -> str:
        """One line; ``cold``: whether the rounds' checks found the page cache dropped
        (False: not, None: not checked)."""
        via = ("a temporary mount" if self.reader == "mount" else
               "the Python API on a temporary mount" if self.mode == "prefetch" else
               "the Python API on a temporary store")
        order = ("the order handed to the mount first (prefetch)" if self.mode == "prefetch"
                 else "a shuffled order")
        n = self.readers
        start = ("cold (page cache dropped, a fresh mount)" if cold else
                 "NOT cold (the page cache kept the store after the drop), a fresh mount"
                 if cold is False else "page cache dropped (not checked), a fresh mount")
        return (f"{n} reader{'s' if n != 1 else ''} through {via}, {start}, every file "
                f"once in {order}")


@dataclass
class Measured:
    """A finalist's measured rate for the whole source (the median round), and how it was
    measured."""

    files_per_s: float
    bytes_per_s: float
    cpu_per_file: float  # CPU seconds per file of every process of the pass
    rounds: list[float]  # each round's files/s, scaled to the source
    files: int  # whole files read per round
    pieces: int
    trial_bytes: int
    readers: int
    scaled_to: int | None = None  # --cores the rate was scaled to (None: as measured)
    ratio: float = 0.0  # raw / stored of the trial store
    seconds: float = 0.0  # the whole trial: pack, mounts, passes
    measured_files_per_s: float = 0.0  # before scaling to --cores
    #: the most of the trial store still in the page cache after a round's drop (a
    #: fraction, ``mincore``; None: not known): above ``epoch.COLD_RESIDENT``, not cold
    resident: float | None = None
    #: the median round's files: (bytes, seconds from open to close), for the reader's
    #: calibration (``calibrate.reader_cost``)
    latencies: list[tuple[int, float]] = field(default_factory=list, repr=False)

    def to_json(self) -> dict[str, Any]:
        return {"files_per_s": round(self.files_per_s, 1),
                "mb_per_s": round(self.bytes_per_s / 1e6, 1),
                "cpu_us_per_file": round(self.cpu_per_file * 1e6, 1),
                "rounds_files_per_s": [round(r, 1) for r in self.rounds],
                "trial_files": self.files, "trial_pieces": self.pieces,
                "trial_mb": round(self.trial_bytes / 1e6, 2), "readers": self.readers,
                "scaled_to_cores": self.scaled_to,
                "files_per_s_as_measured": round(self.measured_files_per_s, 1),
                "trial_ratio": round(self.ratio, 4), "seconds": round(self.seconds, 2),
                "cold": self.cold,
                "resident_after_drop": None if self.resident is None
                else round(self.resident, 4)}

    @property
    def cold(self) -> bool | None:
        """Whether every round read the store cold (None: not known)."""
        return None if self.resident is None else self.resident <= COLD_RESIDENT


# --------------------------------------------------------------------------- the set


def make_trial_set(files, root: str, chunk_size: int, readers: int, seed: int = 0
                   ) -> TrialSet:
    """Copy (hard-link where possible) the trial set of ``files`` (the source's
    :class:`~fanstore.select.sample.SourceFile` entries) into ``root``."""
    small = SMALL_CHUNKS * chunk_size
    whole_src = [f for f in files if f.size <= small]
    large_src = [f for f in files if f.size > small]
    rng = np.random.default_rng([seed, 21])
    dirs = len({os.path.dirname(f.rel) for f in whole_src}) or 1
    per_dir = max(1, round(len(whole_src) / dirs))
    whole: list[TrialFile] = []
    total = 0
    for i in rng.permutation(len(whole_src)).tolist() if whole_src else []:
        if len(whole) >= MAX_FILES or (total >= MAX_WHOLE_BYTES
                                       and len(whole) >= 4 * readers):
            break
        f = whole_src[i]
        n = len(whole)
        rel = f"w/{n // per_dir}/{n:06d}{_suffix(f.rel)}"
        if _place(f.path, os.path.join(root, rel), f.size):
            whole.append(TrialFile(rel, f.size, False, file_kind(f.rel, f.size)))
            total += f.size
    pieces: list[TrialFile] = []
    if large_src:
        longest = PIECE_CHUNKS * chunk_size
        want = PIECES_PER_READER * max(1, readers)
        order = rng.permutation(len(large_src)).tolist()
        taken: dict[int, set[int]] = {}
        for _ in range(want):  # rounds over the large files: one piece of each per round
            for i in order:
                if len(pieces) >= want or sum(p.size for p in pieces) >= MAX_PIECE_BYTES:
                    break
                f = large_src[i]
                length = min(f.size, longest)
                starts = (f.size - length) // chunk_size + 1  # chunk-aligned offsets
                free = [s for s in range(starts) if s not in taken.setdefault(i, set())
                        and all(abs(s - t) * chunk_size >= length for t in taken[i])]
                if not free:
                    continue
                s = free[int(rng.integers(len(free)))]
                taken[i].add(s)
                rel = f"l/{len(pieces):04d}{_suffix(f.rel)}"
                if _cut(f.path, os.path.join(root, rel), s * chunk_size, length):
                    pieces.append(TrialFile(rel, length, True, file_kind(f.rel, f.size)))
    return TrialSet(root, whole, pieces, len(whole_src), sum(f.size for f in whole_src),
                    len(large_src), sum(f.size for f in large_src), chunk_size)


def _suffix(rel: str) -> str:
    """The extension of ``rel`` (its kind's), or nothing."""
    base = os.path.basename(rel)
    dot = base.rfind(".")
    return base[dot:] if 0 < dot < len(base) - 1 and len(base) - dot <= 11 else ""


def _place(src, dest: str, size: int) -> bool:
    os.makedirs(os.path.dirname(dest), exist_ok=True)
    try:
        os.link(src, dest)
        return True
    except OSError:
        pass
    try:
        shutil.copyfile(src, dest)
        return os.path.getsize(dest) == size
    except OSError as exc:
        log.debug("trial: %r left out: %s", src, exc)
        return False


def _cut(src, dest: str, offset: int, length: int) -> bool:
    os.makedirs(os.path.dirname(dest), exist_ok=True)
    try:
        with open(src, "rb") as fin, open(dest, "wb") as fout:
            fin.seek(offset)
            left = length
            while left:
                data = fin.read(min(left, 8 << 20))
                if not data:
                    return False
                fout.write(data)
                left -= len(data)
        return True
    except OSError as exc:
        log.debug("trial: a piece of %r left out: %s", src, exc)
        return False


# --------------------------------------------------------------------------- a finalist


def prefix_sizes(trial: TrialSet, encode_bytes_per_s: float, jobs: int, readers: int
                 ) -> tuple[int, int]:
    """(whole files, pieces) a finalist encoding at ``encode_bytes_per_s`` per core is
    measured on: what :data:`PACK_SECONDS` of encoding on ``jobs`` cores covers, but at
    least one piece per reader and :data:`MIN_FILES` whole files (or all there are)."""
    budget = max(encode_bytes_per_s, 1.0) * max(1, jobs) * PACK_SECONDS
    pieces = 0
    total = 0
    for p in trial.pieces:
        if pieces >= max(1, readers) and total + p.size > budget:
            break
        pieces += 1
        total += p.size
    n = 0
    for f in trial.whole:
        if n >= MIN_FILES and total + f.size > budget:
            break
        n += 1
        total += f.size
    return n, pieces


def measure(trial: TrialSet, policy, how: HowToRead, workdir: str, n_whole: int,
            n_pieces: int, seed: int = 0, jobs: int = 0, rounds: int = ROUNDS) -> Measured:
    """Pack the first ``n_whole`` whole files and ``n_pieces`` pieces of ``trial`` with
    ``policy`` (a :class:`~fanstore.pack.plan.CodecPolicy`), read them ``rounds`` times (up
    to :data:`EXTRA_ROUNDS` more while they disagree) as ``how`` says, and scale to the
    source (see the module docstring). ``jobs``: the pack's workers (0: its default, which
    packs a small trial without any). Everything made under ``workdir`` is removed before
    it returns or raises."""
    from fanstore.pack import PackOptions, pack

    t0 = time.monotonic()
    chosen = trial.whole[:n_whole] + trial.pieces[:n_pieces]
    if not chosen:
        raise TrialError("the trial set is empty")
    os.makedirs(workdir)
    try:
        src = os.path.join(workdir, "src")
        for f in chosen:
            dest = os.path.join(src, f.rel)
            os.makedirs(os.path.dirname(dest), exist_ok=True)
            os.link(os.path.join(trial.root, f.rel), dest)
        store = os.path.join(workdir, "store")
        try:
            summary = pack(src, store, _for_trial(policy, chosen), PackOptions(
                partitions=PARTITIONS, jobs=jobs, progress=False,
                chunk_size=trial.chunk_size, notify=lambda text: log.info("%s", text)))
        except FanStoreError as exc:
            raise TrialError(f"packing the trial failed: {exc}") from None
        share = sum(f.size for f in chosen) / max(1, trial.source_bytes)
        rng = np.random.default_rng([seed, 22])
        wanted, rounds = rounds, []
        while len(rounds) < wanted or (len(rounds) < wanted + EXTRA_ROUNDS
                                       and _spread(rounds) > SPREAD):
            r = len(rounds)
            order = [chosen[i] for i in rng.permutation(len(chosen)).tolist()]
            result = _one_round(store, workdir, [f.rel for f in order], how, share)
            if result.errors:
                raise TrialError(f"reading the trial store failed: {result.first_error}")
            rounds.append((*_scale(trial, order, result), order, result))
            log.debug("trial round %d: %.0f files/s as measured, %.0f for the source", r,
                      result.files_per_s, rounds[-1][0])
    finally:
        remove(workdir)
    rounds.sort(key=lambda r: r[0])
    files_s, bytes_s, cpu, order, median = rounds[len(rounds) // 2]
    out = Measured(files_s, bytes_s, cpu, [r[0] for r in rounds], n_whole, n_pieces,
                   sum(f.size for f in chosen), how.readers,
                   ratio=summary.ratio, measured_files_per_s=files_s,
                   resident=_most_resident([r[-1] for r in rounds]),
                   latencies=[(f.size, lat) for f, lat in zip(order, median.latency)])
    if how.cores > how.readers and cpu > 0:
        # More cores than readers here: the lower of linear scaling and the CPU bound.
        factor = min(how.cores / how.readers, how.cores / (cpu * files_s))
        factor = max(factor, 1.0)
        out.files_per_s, out.bytes_per_s = files_s * factor, bytes_s * factor
        out.scaled_to = how.cores
    out.seconds = time.monotonic() - t0
    return out


def _most_resident(results: list[PassResult]) -> float | None:
    """The largest share of the store any round found in the page cache after its drop
    (None when one round could not tell)."""
    fractions = [r.resident for r in results]
    return None if any(f is None for f in fractions) else max(fractions, default=0.0)


def _spread(rounds: list) -> float:
    rates = [r[0] for r in rounds]
    return max(rates) / min(rates) if rates and min(rates) > 0 else 1.0


def _for_trial(policy, files: list[TrialFile]):
    """``policy`` as the trial's pieces need it: a piece's kind can differ from its
    file's (64 chunks of a 1 GiB file are a "large" file, the file a "huge" one), and takes
    the codec of its file's kind."""
    from fanstore.pack.plan import CodecPolicy

    by_kind, solid = dict(policy.by_kind), dict(policy.solid_by_kind)
    for f in files:
        mine = file_kind(f.rel, f.size)
        if f.piece and mine != f.kind and f.kind in policy.by_kind and mine not in by_kind:
            by_kind[mine] = policy.by_kind[f.kind]
            solid[mine] = policy.solid_by_kind.get(f.kind, 0)
    if by_kind == policy.by_kind:
        return policy
    return CodecPolicy(policy.default, by_kind, policy.solid, solid)


def _one_round(store: str, workdir: str, rels: list[str], how: HowToRead,
               share: float) -> PassResult:
    """One cold pass over ``rels`` of ``store`` (``resident``: what the drop left)."""
    resident = drop_page_cache([store]).fraction
    if how.reader == "api" and how.mode == "sync":
        cache = max(1, round(API_CACHE_MB * share))
        result = run_pass(Target("api", store, cache_mb=cache), rels, how.readers,
                          timeout=TIMEOUT)
        result.resident = resident
        return result
    mnt = os.path.join(workdir, "mnt")
    os.makedirs(mnt, exist_ok=True)
    cache = max(1, round(MOUNT_CACHE_MB * share))
    mount(store, mnt, "--mode", how.mode, "--cache-mb", str(cache), "--workers",
          str(how.workers))
    try:
        order_to = mnt if how.mode == "prefetch" else None
        result = run_pass(Target(how.reader, mnt, order_to=order_to,
                                 cache_mb=max(1, round(API_CACHE_MB * share))),
                          rels, how.readers, watch=mnt, timeout=TIMEOUT)
    finally:
        unmount(mnt)
    result.resident = resident
    return result


def _scale(trial: TrialSet, order: list[TrialFile], r: PassResult
           ) -> tuple[float, float, float]:
    """(files/s, bytes/s, CPU seconds per file) of the whole source from one pass."""
    lw = lp = 0.0
    nw = bp = 0
    for f, lat in zip(order, r.latency):
        if f.piece:
            lp += lat
            bp += f.size
        else:
            lw += lat
            nw += 1
    reader_s = 0.0
    if trial.source_whole_files:
        reader_s += (lw / nw if nw else 0.0) * trial.source_whole_files
    if trial.source_large_bytes:
        reader_s += (lp / bp if bp else 0.0) * trial.source_large_bytes
    if reader_s <= 0:
        return r.files_per_s, r.bytes_per_s, r.cpu / max(1, r.files)
    wall = reader_s / r.concurrency
    cpu = r.cpu * wall / r.seconds if r.seconds > 0 else 0.0
    return (trial.source_files / wall, trial.source_bytes / wall,
            cpu / max(1, trial.source_files))


__all__ = ["HowToRead", "Measured", "TrialError", "TrialSet", "make_trial_set", "measure",
           "prefix_sizes"]
