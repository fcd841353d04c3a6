"""What a selection found: every candidate's mixed cost, modelled rate and, for the
finalists, measured rate; the per-kind figures; the choice. Data and accessors only:
:mod:`fanstore.select.report` renders it (table, JSON, one-line summary) and
:mod:`fanstore.select.selector` fills it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from compressors import Codec
from fanstore.pack.plan import CodecPolicy
from fanstore.select import policy
from fanstore.select.calibrate import ReaderCost
from fanstore.select.epoch import COLD_RESIDENT
from fanstore.select.options import SelectionOptions
from fanstore.select.policy import Budget, Cost
from fanstore.select.trial import Measured


@dataclass
class CandidateResult:
    """One candidate over the whole source (its per-kind costs mixed by bytes).

    ``decode_s`` is single-core decode seconds per raw byte (codec plus raw-chunk copies);
    ``cost.cpu`` adds the checksum. ``node_rate`` is the model's raw bytes/s per node;
    ``measured`` the finalist's measured epoch (None: not measured), which, when there is
    one, is the rate the choice and the report use (:attr:`rate`).
    """

    label: str
    codec: Codec
    cost: Cost
    decode_s: float
    encode_mb_per_s: float
    measured_bytes: int
    raw_fraction: float
    node_rate: float
    meets: bool
    chosen: bool = False
    kinds: list[str] | None = None  # per-kind extras: the kinds it was measured on
    solid: int = 0  # solid block size (bytes), 0: none
    by_kind: dict[str, Codec] = field(default_factory=dict)  # kinds with their own codec
    measured: Measured | None = None
    measure_error: str | None = None  # why a finalist's measurement failed
    units: int = 0  # sample units encoded (files, or chunks of large files)
    declined: int = 0  # of them, declined by a codec of whole files (stored raw)

    @property
    def rate(self) -> float:
        """Raw bytes/s per node: measured if this candidate was, else modelled."""
        return self.measured.bytes_per_s if self.measured is not None else self.node_rate

    @property
    def rate_from(self) -> str:
        return "measured" if self.measured is not None else "model"

    def policy(self) -> CodecPolicy:
        """How pack stores the data with this candidate."""
        return CodecPolicy(self.codec, dict(self.by_kind), self.solid,
                           {k: self.solid for k in self.by_kind})


@dataclass
class KindResult:
    kind: str
    files: int
    raw_bytes: int
    sample_bytes: int
    typesize: int
    typesize_from: str
    costs: dict[str, Cost] = field(default_factory=dict)
    decode_s: dict[str, float] = field(default_factory=dict)
    chosen: str | None = None


@dataclass
class MeasurementInfo:
    """How the finalists were measured (``how``: one line), or why not (``note``); the
    model's correction (median of measured / modelled) and what the model alone chose;
    ``resident``: the most of a trial store any round found in the page cache after
    dropping it (``mincore``; None: not known); ``fallback``: why the trials read with the
    Python API although a mount was the default (None: they read as asked)."""

    how: str
    readers: int
    cores: int
    trials: int = 0
    rounds: int = 3  # cold passes per finalist asked for (up to 2 more while they disagree)
    seconds: float = 0.0
    correction: float = 1.0
    model_chosen: str | None = None
    note: str | None = None
    resident: float | None = None
    fallback: str | None = None

    @property
    def measured(self) -> bool:
        return self.note is None and self.trials > 0

    @property
    def cold(self) -> bool | None:
        """Whether every trial round read cold (None: not measured, or not known)."""
        if not self.measured or self.resident is None:
            return None
        return self.resident <= COLD_RESIDENT


@dataclass
class SelectionResult:
    """Everything ``fanstore select`` reports and ``pack --codec auto`` records."""

    source: str
    options: SelectionOptions
    budget: Budget
    budget_from: str  # "mb_per_sec", "files_per_sec" or "default"
    files: int
    raw_bytes: int
    sample_bytes: int
    sample_units: int
    storage_from: str
    checksum_mb_per_s: float
    candidates: list[CandidateResult]
    kinds: dict[str, KindResult]
    chosen: str
    met: bool
    per_kind: dict[str, str] | None = None
    per_kind_cost: Cost | None = None
    per_kind_met: bool | None = None
    seconds: float = 0.0
    reader: ReaderCost | None = None
    measurement: MeasurementInfo | None = None
    per_kind_measured: Measured | None = None
    per_kind_error: str | None = None  # why the per-kind mix could not be measured

    # ------------------------------------------------------------------ accessors

    @property
    def mode(self) -> str:
        return self.budget.mode

    @property
    def budget_met(self) -> bool:
        """The verdict that counts: met by the per-kind mix or by the single codec."""
        return bool(self.per_kind_met) or self.met

    @property
    def measured(self) -> bool:
        return self.measurement is not None and self.measurement.measured

    def candidate(self, label: str) -> CandidateResult:
        for c in self.candidates:
            if c.label == label:
                return c
        raise KeyError(label)

    @property
    def chosen_codec(self) -> Codec:
        return self.candidate(self.chosen).codec

    def files_rate(self, bytes_rate: float) -> float:
        return bytes_rate * self.files / self.raw_bytes if self.raw_bytes else 0.0

    @property
    def per_kind_rate(self) -> float | None:
        if self.per_kind_cost is None:
            return None
        if self.per_kind_measured is not None:
            return self.per_kind_measured.bytes_per_s
        return policy.node_rate(self.per_kind_cost, self.budget)

    def mix_policy(self, assign: dict[str, str]) -> CodecPolicy:
        """How pack stores a per-kind assignment (kind -> candidate label), over the single
        choice (the codec of kinds the sample did not see)."""
        chosen = self.candidate(self.chosen)
        default = chosen.codec
        by_kind, solid_by_kind = {}, {}
        for kind, label in assign.items():
            cand = self.candidate(label)
            codec = cand.by_kind.get(kind, cand.codec)
            if codec != default or cand.solid != chosen.solid:
                by_kind[kind] = codec
                solid_by_kind[kind] = cand.solid
        return CodecPolicy(default, by_kind, chosen.solid, solid_by_kind)

    @property
    def per_kind_gain(self) -> float | None:
        """Capacity of the per-kind mix over the single choice (1.10: 10% more data fits)."""
        if self.per_kind_cost is None:
            return None
        return self.candidate(self.chosen).cost.stored / self.per_kind_cost.stored
