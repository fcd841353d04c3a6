"""What a selection is asked for: the mode, the budget, the cores, the sample, the reader.

:class:`SelectionOptions` is what :func:`fanstore.select.run_selection` takes; the CLI
(``fanstore.cli.select.selection_options``) builds it from the arguments of ``fanstore
select`` and ``fanstore pack --codec auto`` (the same argument group).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

from fanstore.errors import UsageError
from fanstore.select import policy
from fanstore.select.calibrate import check_reader

#: Encode time allowed per candidate over the whole sample (see bench.py).
ENCODE_SECONDS = 4.0
#: Finalists measured at most (``--trials``; see finalists.py).
TRIALS = 6
#: Cold passes per finalist (``--rounds``), and up to EXTRA_ROUNDS more while the slowest
#: and the fastest disagree (see trial.py).
ROUNDS = 3
EXTRA_ROUNDS = 2


@dataclass
class SelectionOptions:
    """What to select for. Rates are per node; ``None`` rates mean the default budget."""

    mode: str = "sync"
    files_per_sec: float | None = None
    mb_per_sec: float | None = None
    cores: int | None = None  # None: the cores this process may run on
    sample_mb: float = 200.0
    seed: int = 0
    per_kind: bool = False
    storage_mb_per_sec: float | None = None  # None: measured
    storage_latency_us: float | None = None  # None: measured with the bandwidth, else 0
    storage_dir: str | None = None  # where to measure it (None: the temp directory)
    reader: str | None = None  # the read path measured: "mount", "api" (None: model only)
    #: the reader was not given (``mount``, FUSE being here): if no mount can be made after
    #: all, the trials fall back to the Python API (sync mode) or to the model alone
    reader_default: bool = False
    chunk_size: int = 1 << 20
    encode_seconds: float = ENCODE_SECONDS
    progress: bool | None = None  # None: on a terminal only
    trials: int = TRIALS  # finalists measured at most (0: the model alone); needs a reader
    rounds: int = ROUNDS  # cold passes per finalist (the median counts)

    def __post_init__(self) -> None:
        if self.mode not in policy.MODES:
            raise UsageError(f"--mode must be one of {', '.join(policy.MODES)}")
        if self.files_per_sec is not None and self.mb_per_sec is not None:
            raise UsageError("give --files-per-sec or --mb-per-sec, not both")
        for name in ("files_per_sec", "mb_per_sec", "sample_mb", "storage_mb_per_sec"):
            value = getattr(self, name)
            if value is not None and not (value > 0 and math.isfinite(value)):
                raise UsageError(f"--{name.replace('_', '-')} must be a positive number")
        if self.cores is not None and self.cores < 1:
            raise UsageError("--cores must be at least 1")
        if self.trials < 0:
            raise UsageError("--trials must be 0 or more")
        if self.rounds < 1:
            raise UsageError("--rounds must be at least 1")
        if self.storage_latency_us is not None and not (
                self.storage_latency_us >= 0 and math.isfinite(self.storage_latency_us)):
            raise UsageError("--storage-latency-us must be a number >= 0")
        if self.reader is not None:
            check_reader(self.reader)

    @property
    def n_cores(self) -> int:
        if self.cores:
            return self.cores
        try:
            return len(os.sched_getaffinity(0))
        except AttributeError:  # pragma: no cover - not Linux
            return os.cpu_count() or 1
