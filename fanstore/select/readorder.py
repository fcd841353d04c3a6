"""How often a shuffled epoch decodes a solid block: the read order, modelled.

A file in a solid block is read by fetching, decoding and checking its whole block (one
chunk of ``b`` raw bytes holding ``n`` files). Readers keep decoded chunks in LRU caches, so
a block is decoded again only when a file of it is read where it is no longer cached:

* through the mount (kernel frontend), each READ lands on any of its ``K`` worker processes
  (``--workers``, by default the cores: the selection's ``--cores``), and each worker keeps
  its own LRU of ``--cache-mb`` / ``K`` (256 MiB in all by default);
* through the Python API, each of the ``K`` reader processes (``--cores``) has its own LRU
  (``open_store(cache_mb=64)``), and a reader process reads a random share of the files.

So ``K`` LRUs of ``C`` bytes each, and a read lands on a random one of them. In an epoch every
file is read once, in random order. The model, per block (``docs/selection.md``):

1. **How long a block stays cached.** Counted in reads: a worker that touched block X keeps
   it while less than ``C`` bytes of *other* blocks were touched there since (LRU). Reads
   come in random order, so after a fraction ``tau`` of the epoch one worker has touched
   about ``sum_Y b_Y (1 - exp(-n_Y tau / K))`` bytes of distinct blocks (each of block Y's
   ``n_Y`` reads lands there with probability ``1/K``; Che's approximation for LRU caches).
   ``tau`` solves ``sum_Y b_Y (1 - exp(-n_Y tau / K)) = C`` (capped at 1: the cache holds
   all a worker touches in an epoch; a block larger than ``C`` is never kept). For ``B``
   blocks of one size, with ``m = C / b`` of them fitting:
   ``tau = min(1, (K / n) ln(B / (B - m)))``.
2. **How often it is decoded.** Block X's ``n`` reads fall on a worker ``j ~ Binomial(n,
   1/K)`` times, at random moments of the epoch. The first is a miss; each later one is a
   miss when the gap since the previous read there exceeds ``tau`` of the epoch, which for
   ``j`` random moments happens with probability ``(1 - tau)^j``. Summed over the ``K``
   workers (``q = 1 - tau / K``)::

       D(n, K, tau) = K (1 + (n / K) (1 - tau) q^(n - 1) - q^n)

   decodes per block: ``n`` when nothing stays cached (``tau = 0``), ``K (1 - (1 - 1/K)^n)``
   (about once per worker, at most ``n``) when everything does (``tau = 1``), and 1 for a
   block of one file.
3. **What a reader pays.** The decode, the checksum and the stored bytes fetched are
   charged ``A = sum_X D_X b_X / sum_X b_X`` times per raw byte delivered (the read
   amplification; ``sum_X n_X b_X / sum_X b_X`` without any cache).

Checked against a simulation of ``K`` LRU caches over shuffled epochs (tests/test_select.py):
within 6% from 300 to 2,400 blocks of 5-100 files, 1-8 workers, caches holding none to all.
Pure: no I/O, so testable with synthetic numbers.

Premise: a reader puts the block it decoded into its LRU. The API does
(``ChunkReader.read_all``), and so does the kernel frontend for a chunk that other files
share: it reads with ``keep_whole=False`` (a file read whole lands in the page cache, so a
chunk of its own is not kept twice), but a solid block stays in the worker's LRU
(``tests/test_capacity.py``: a shuffled pass decodes a block about once per worker).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

MIB = 1 << 20
#: The mount's decoded-chunk cache in all (``fanstore mount --cache-mb``,
#: ``fanstore.mountspec.MountSpec.cache_mb``), split between its workers.
MOUNT_CACHE_MB = 256
#: The Python API's decoded-chunk cache per reader process (``fanstore.open_store``).
API_CACHE_MB = 64


@dataclass(frozen=True)
class Caches:
    """The decoded-chunk caches reads land on: ``workers`` LRUs of ``bytes_each`` bytes,
    each read on a random one."""

    workers: int
    bytes_each: float

    def __post_init__(self) -> None:
        if self.workers < 1 or not self.bytes_each >= 0:
            raise ValueError(f"bad caches {self!r}")


def reader_caches(reader: str, cores: int) -> Caches:
    """The caches of ``reader`` (``mount``: the kernel frontend's ``cores`` workers sharing
    :data:`MOUNT_CACHE_MB`; ``api``: ``cores`` reader processes of :data:`API_CACHE_MB`
    each) with the defaults a job gets."""
    cores = max(1, cores)
    if reader == "mount":
        return Caches(cores, MOUNT_CACHE_MB * MIB / cores)
    if reader == "api":
        return Caches(cores, API_CACHE_MB * MIB)
    raise ValueError(f"unknown reader {reader!r}")


#: A group of blocks alike: (how many, raw bytes each, files each); counts may be fractions
#: (a sample's blocks scaled to the source).
Blocks = Sequence[tuple[float, float, float]]


def cached_fraction(blocks: Blocks, caches: Caches) -> float:
    """``tau``: the fraction of an epoch a decoded block stays in a worker's cache after it
    was last read there (step 1 of the module docstring), in [0, 1]."""
    k, cap = caches.workers, caches.bytes_each

    def touched(tau: float) -> float:  # bytes of distinct blocks one worker keeps
        return sum(count * size * -math.expm1(-files * tau / k)
                   for count, size, files in blocks
                   if count > 0 and 0 < size <= cap and files > 0)

    if cap <= 0:
        return 0.0
    if touched(1.0) <= cap:
        return 1.0
    lo, hi = 0.0, 1.0
    for _ in range(60):  # touched() grows with tau: bisect
        mid = (lo + hi) / 2
        if touched(mid) <= cap:
            lo = mid
        else:
            hi = mid
    return lo


def decodes_per_block(files: float, workers: int, tau: float) -> float:
    """``D(n, K, tau)``: expected decodes of a block of ``files`` files in an epoch (step 2
    of the module docstring)."""
    if files <= 1:
        return float(max(files, 0.0))
    q = 1.0 - tau / workers
    return workers * (1.0 + files / workers * (1.0 - tau) * q ** (files - 1) - q ** files)


def amplification(blocks: Blocks, caches: Caches, tau: float) -> float:
    """``A``: raw bytes decoded per raw byte delivered for these blocks (step 3), ``tau``
    from :func:`cached_fraction`. A block larger than a cache is never kept in it (the LRU
    refuses it): decoded for every file."""
    raw = sum(count * size for count, size, _ in blocks)
    if raw <= 0:
        return 1.0
    return sum(count * size * decodes_per_block(files, caches.workers,
                                                tau if size <= caches.bytes_each else 0.0)
               for count, size, files in blocks) / raw


__all__ = ["API_CACHE_MB", "MOUNT_CACHE_MB", "Blocks", "Caches", "amplification",
           "cached_fraction", "decodes_per_block", "reader_caches"]
