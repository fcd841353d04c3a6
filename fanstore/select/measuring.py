"""The measuring half of a selection: the trial set, the calibration, the finalists.

:class:`Measuring` owns a temporary directory for the whole selection (the trial set,
:mod:`.trial`; each finalist's store and mount come and go inside it). It first measures the
``none`` trial, which both calibrates the read path (:func:`.calibrate.reader_cost`) and
is the reference of the default budget; then the selector asks it for finalists one at a
time (:mod:`.finalists` says which). :meth:`Measuring.close` removes everything, whatever
happened; no mount is ever left behind.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time

import numpy as np

from compressors import parse_spec
from fanstore.select import trial
from fanstore.select.calibrate import CalibrationError, ReaderCost, fuse_problem, reader_cost
from fanstore.select.epoch import COLD_RESIDENT, PassError
from fanstore.select.options import SelectionOptions
from fanstore.select.tempmount import MountFailed, TrialError, unmount
from fanstore.select.trial import HowToRead, Measured

log = logging.getLogger(__name__)


def local_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def why_not_measured(options: SelectionOptions) -> str | None:
    """Why this selection cannot measure its finalists here, or None."""
    if options.reader is None:
        return "no --reader: the model alone"
    if options.trials <= 0:
        return "--trials 0: the model alone"
    if options.reader == "mount" or options.mode == "prefetch":
        problem = fuse_problem()
        if problem:
            what = "--reader mount" if options.reader == "mount" else "prefetch mode"
            return f"{what} is measured through a mount and FUSE is missing ({problem})"
    return None


def copy_checksum_cost() -> float:
    """Seconds per byte of what ``none`` costs a read (a copy and the XXH3 check)."""
    from fanstore.select import bench

    units = [np.random.default_rng(3).bytes(64 << 10) for _ in range(64)]
    base = bench.baseline(units)
    return base.copy + base.checksum


def cold_line(resident: float | None) -> str:
    """The report's line on whether the trials read cold, from the most of a trial store
    ``mincore`` found in the page cache right after a drop (None: not known)."""
    if resident is None:
        return ("cold      unknown: the page cache was dropped before each round, but the "
                "kernel could not be asked what stayed (mincore)")
    if resident <= COLD_RESIDENT:
        return (f"cold      yes: after each drop at most {resident:.0%} of the trial store "
                "was in the page cache (mincore)")
    return (f"cold      NO: after a drop {resident:.0%} of the trial store was still in the "
            "page cache (mincore): the rounds read from memory, not from storage ($TMPDIR "
            "on a tmpfs, or a drop not permitted), so the measured rates are warm ones, "
            "faster than a cold epoch")


class Measuring:
    """Trials of one selection (see the module docstring)."""

    def __init__(self, files, options: SelectionOptions) -> None:
        self.options = options
        self.readers = max(1, min(options.n_cores, local_cores()))
        self.how = HowToRead(options.reader or "api", options.mode, self.readers,
                             options.n_cores)
        self.jobs = local_cores()
        self.tmp = tempfile.mkdtemp(prefix="fanstore-select-", dir=options.storage_dir)
        self.count = 0
        self.seconds = 0.0
        #: the most of a trial store any round found resident after its drop (None: a
        #: round could not tell; 0.0 before any trial)
        self.resident: float | None = 0.0
        #: why the trials read with the Python API although a mount was the default (one
        #: line for the report), or None
        self.fallback: str | None = None
        t0 = time.monotonic()
        try:
            self.trial = trial.make_trial_set(files, os.path.join(self.tmp, "set"),
                                              options.chunk_size, self.readers, options.seed)
        except BaseException:
            self.close()
            raise
        self.seconds += time.monotonic() - t0
        if not self.trial.whole and not self.trial.pieces:
            self.close()
            raise CalibrationError("no file of the source could be copied for the trials")

    # ------------------------------------------------------------------ trials

    def measure(self, policy, encode_bytes_per_s: float, label: str) -> Measured:
        """One finalist: ``policy`` (a ``CodecPolicy``) measured as :mod:`.trial` says.
        Raises :class:`TrialError` when it cannot be (a reader that died or timed out
        included: its trial's mount and files are gone by then)."""
        n_whole, n_pieces = trial.prefix_sizes(self.trial, encode_bytes_per_s, self.jobs,
                                               self.readers)
        self.count += 1
        t0 = time.monotonic()
        try:
            # the pack's default workers (every core, as self.jobs counts), so that a
            # trial under pack.worker.INLINE_BYTES is compressed here, with no worker
            m = trial.measure(self.trial, policy, self.how,
                              os.path.join(self.tmp, f"trial-{self.count}"), n_whole,
                              n_pieces, self.options.seed, rounds=self.options.rounds)
        except PassError as exc:  # a reader died or timed out: this finalist, not the rest
            raise TrialError(f"reading the trial store failed: {exc}") from None
        finally:
            self.seconds += time.monotonic() - t0
        log.info("measured %s: %.0f files/s (%.0f MB/s) for the source, rounds %s", label,
                 m.files_per_s, m.bytes_per_s / 1e6, [round(r) for r in m.rounds])
        if m.cold is False and self.resident is not None and self.resident <= COLD_RESIDENT:
            log.warning("the trial of %s was not cold: %.0f%% of its store stayed in the page "
                        "cache after the drop (a tmpfs?); its rates are warm ones", label,
                        100 * (m.resident or 0))
        self.resident = (None if self.resident is None or m.resident is None
                         else max(self.resident, m.resident))
        return m

    def calibrate(self, storage: float, latency: float) -> tuple[Measured, ReaderCost]:
        """The ``none`` trial and the reader's cost fitted to it.

        Its mount is the selection's first: when it cannot be made here and the reader was
        not given (``options.reader_default``), a sync-mode selection measures with the
        Python API instead (:attr:`fallback` says so, for the report); in prefetch mode,
        where the API reads through a mount too, :class:`MountFailed` goes up (the selector
        then measures nothing and says why). Any other failure: :class:`CalibrationError`.
        """
        try:
            m = self._none()
        except MountFailed as exc:
            if not self.options.reader_default:
                raise CalibrationError(f"calibration: {exc}") from None
            if self.how.mode != "sync":
                raise
            m = self._fall_back_to_api(exc)
        except TrialError as exc:
            raise CalibrationError(f"calibration: {exc}") from None
        cost = reader_cost(m.latencies, self.how.reader, self.how.mode, self.readers,
                           self.options.chunk_size, copy_checksum_cost(), storage, latency,
                           m.measured_files_per_s, m.seconds)
        return m, cost

    def _none(self) -> Measured:
        from fanstore.pack.plan import CodecPolicy

        return self.measure(CodecPolicy(parse_spec("none")), float("inf"), "none")

    def _fall_back_to_api(self, failed: MountFailed) -> Measured:
        """The ``none`` trial again, read with the Python API (a mount failed here)."""
        self.fallback = (f"--reader api: a trial mount failed here ({failed}), so the trials "
                         "read with the Python API, as a job without a mount reads (--reader "
                         "mount insists on a mount)")
        log.info("%s", self.fallback)
        self.how = HowToRead("api", self.how.mode, self.readers, self.options.n_cores)
        try:
            return self._none()
        except TrialError as exc:
            raise CalibrationError(f"calibration: {exc}") from None

    def close(self) -> None:
        trial_dirs = [os.path.join(self.tmp, d) for d in os.listdir(self.tmp)] \
            if os.path.isdir(self.tmp) else []
        for d in trial_dirs:
            mnt = os.path.join(d, "mnt")
            if os.path.ismount(mnt):
                unmount(mnt)
        if not any(os.path.ismount(os.path.join(d, "mnt")) for d in trial_dirs):
            shutil.rmtree(self.tmp, ignore_errors=True)


__all__ = ["Measuring", "cold_line", "copy_checksum_cost", "local_cores",
           "why_not_measured"]
