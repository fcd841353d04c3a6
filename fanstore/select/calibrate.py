"""The read path a job will use, calibrated: what a reader pays per file and per chunk.

The selector's model (``policy.py``) multiplies per-byte codec costs; a real reader also pays
per file (FUSE: LOOKUP, OPEN, READs, RELEASE through the kernel and the workers; the Python
API: the namespace lookup, a ``pread``, Python calls) and per chunk (a fetch, a decode call,
READ requests). On small files that cost, not the codec, decides how many files per second
a reader gets.

The calibration is the ``none`` trial of :mod:`.trial`: the trial set (at least 1,500 of the
source's own files, in directories as full as the source's, and pieces of up to 64 chunks
of its large files) packed raw, read cold by ``--cores`` readers through a temporary mount
in the user's mode (or the Python API), three to five times, the median round kept. That is
an epoch's cost in steady state: no single slow first request weighs on it, and storage is
cold where the mode reads cold storage. :func:`reader_cost` fits the median round's files::

    latency(file) - (copy + checksum) x bytes - storage(file)  =  t_file + (chunks - 1) t_chunk

by least squares, where ``storage(file) = L + bytes / S`` in sync mode (the model charges
the random read and the transfer separately, per stored byte) and 0 in prefetch mode. The
model then charges every candidate ``t_file + (chunks - 1) x t_chunk`` per file of a kind
(one chunk per file in a solid block), on top of its decode, checksum and storage time;
docs/selection.md "Reader" has the formula.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from fanstore.errors import FanStoreError, UsageError

READERS = ("mount", "api")


class CalibrationError(FanStoreError):
    """The read path could not be calibrated (no FUSE, a mount that failed, ...)."""


@dataclass
class ReaderCost:
    """The calibrated read path. Times are seconds of one reader (of ``readers`` reading
    concurrently) per file and per extra chunk, beyond decode, checksum and storage."""

    reader: str
    mode: str
    per_file: float
    per_chunk: float
    readers: int
    files: int  # files of the calibration pass
    chunks: int  # chunks they hold
    chunk_size: int
    seconds: float
    files_per_s_raw: float  # what the readers got from the data stored raw (the source's)

    def file_cost(self, chunks: float) -> float:
        """Seconds of one reader per file of ``chunks`` chunks (at least one)."""
        return self.per_file + max(0.0, chunks - 1.0) * self.per_chunk

    def describe(self) -> str:
        n = self.readers
        return (f"{self.reader}: {self.per_file * 1e6:,.0f} µs per file + "
                f"{self.per_chunk * 1e6:,.0f} µs per further chunk (fit to the `none` "
                f"trial: {self.files:,} files, {self.chunks:,} chunks, {n} reader"
                f"{'s' if n != 1 else ''}, {self.mode}, cold; {self.seconds:.1f} s)")

    def to_json(self) -> dict:
        return {"reader": self.reader, "mode": self.mode,
                "per_file_us": round(self.per_file * 1e6, 1),
                "per_chunk_us": round(self.per_chunk * 1e6, 1), "readers": self.readers,
                "files": self.files, "chunks": self.chunks,
                "raw_files_per_s": round(self.files_per_s_raw, 1),
                "seconds": round(self.seconds, 2)}


def check_reader(reader: str) -> None:
    if reader not in READERS:
        raise UsageError(f"--reader must be one of {', '.join(READERS)}, got {reader!r}")


def reader_cost(latencies: list[tuple[int, float]], reader: str, mode: str, readers: int,
                chunk_size: int, copy_checksum: float, storage: float, latency: float,
                files_per_s: float, seconds: float) -> ReaderCost:
    """Fit ``t_file`` and ``t_chunk`` to a raw pass's files (``latencies``: (bytes,
    seconds) each; see the module docstring). ``copy_checksum``: seconds per byte of what
    ``none`` costs a read; ``storage``/``latency``: the model's S (bytes/s) and L (s)."""
    if not latencies:
        raise CalibrationError("calibration: the raw pass read no files")
    size = np.array([b for b, _ in latencies], dtype=float)
    lat = np.array([t for _, t in latencies], dtype=float)
    chunks = np.maximum(1.0, np.ceil(size / chunk_size))
    y = lat - size * copy_checksum
    if mode == "sync":
        y -= latency + size / storage
    extra = chunks - 1.0
    if np.ptp(extra) > 0:
        a = np.vstack([np.ones_like(extra), extra]).T
        (per_file, per_chunk), *_ = np.linalg.lstsq(a, y, rcond=None)
        if per_file < 0:  # the fit's intercept below zero: the chunks carry it all
            per_file, per_chunk = 0.0, float(np.sum(y) / np.sum(chunks))
    else:  # every file of one size class: one cost per file
        per_file, per_chunk = float(np.mean(y / chunks)), float(np.mean(y / chunks))
    return ReaderCost(reader, mode, max(0.0, float(per_file)), max(0.0, float(per_chunk)),
                      readers, len(latencies), int(chunks.sum()), chunk_size, seconds,
                      files_per_s)


# --------------------------------------------------------------------------- FUSE


def fuse_problem() -> str | None:
    """Why a mount cannot be used for a measurement here, or None. The mount itself runs as
    a subprocess (the CLI), which checks the rest; what it needs first is the device."""
    if not os.path.exists("/dev/fuse"):
        return "/dev/fuse does not exist on this machine"
    return None


def check_fuse() -> None:
    problem = fuse_problem()
    if problem:
        raise CalibrationError(f"--reader mount needs FUSE ({problem}); use --reader api")


__all__ = ["READERS", "CalibrationError", "ReaderCost", "check_fuse", "check_reader",
           "fuse_problem", "reader_cost"]
