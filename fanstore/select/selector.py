"""Run a selection: sample, measure every candidate, apply the budget, keep a small report.

The steps are in :func:`run_selection`; the model and its formulas are in
:mod:`fanstore.select.policy` and ``docs/selection.md``.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from compressors import Codec, CodecError, parse_spec
from fanstore.errors import BudgetNotMetError, FanStoreError, UsageError
from fanstore.select import bench, policy
from fanstore.select.calibrate import ReaderCost, calibrate, check_reader
from fanstore.select.candidates import Candidate, per_kind_candidates, whole_set_candidates
from fanstore.select.policy import Budget, Cost
from fanstore.select.sample import Sample, draw_sample, list_source

log = logging.getLogger(__name__)

MB = 1e6
#: Encode time allowed per candidate over the whole sample (see bench.py).
ENCODE_SECONDS = 4.0
#: The default budget: this fraction of the rate the reader gets from the data stored raw
#: (compression may cost a reader at most 10% of that rate; exactly 100% would refuse every
#: codec on small files, where decoding costs a reader a few percent at most).
DEFAULT_BUDGET = 0.9


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
    reader: str | None = None  # calibrate the read path: "mount", "api" (None: not modelled)
    chunk_size: int = 1 << 20
    encode_seconds: float = ENCODE_SECONDS
    progress: bool | None = None  # None: on a terminal only

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


def selection_options(args: Any) -> SelectionOptions:
    """Options from ``fanstore select``/``fanstore pack --codec auto`` arguments."""
    return SelectionOptions(
        mode=getattr(args, "mode", "sync") or "sync",
        files_per_sec=getattr(args, "files_per_sec", None),
        mb_per_sec=getattr(args, "mb_per_sec", None),
        cores=getattr(args, "cores", None),
        sample_mb=getattr(args, "sample_mb", None) or 200.0,
        seed=getattr(args, "seed", 0) or 0,
        per_kind=bool(getattr(args, "per_kind", False)),
        storage_mb_per_sec=getattr(args, "storage_mb_per_sec", None),
        storage_latency_us=getattr(args, "storage_latency_us", None),
        reader=getattr(args, "reader", None) or _default_reader(),
        chunk_size=(getattr(args, "chunk_kb", None) or 1024) * 1024,
        progress=False if getattr(args, "no_progress", False) else None,
    )


def _default_reader() -> str:
    """``mount`` where FUSE works here, else ``api`` (said once on stderr)."""
    from fanstore.select.calibrate import fuse_problem

    problem = fuse_problem()
    if problem:
        print(f"fanstore: --reader api (no FUSE here: {problem})", file=sys.stderr)
        return "api"
    return "mount"


@dataclass
class CandidateResult:
    """One candidate over the whole source (its per-kind costs mixed by bytes).

    ``decode_s`` is single-core decode seconds per raw byte (codec plus raw-chunk copies);
    ``cost.cpu`` adds the checksum. ``node_rate`` is the model's raw bytes/s per node.
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

    # ------------------------------------------------------------------ accessors

    @property
    def mode(self) -> str:
        return self.budget.mode

    @property
    def budget_met(self) -> bool:
        """The verdict that counts: the per-kind mix if one was chosen, else the codec."""
        return bool(self.per_kind_met) if self.per_kind is not None else self.met

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
        return policy.node_rate(self.per_kind_cost, self.budget)

    @property
    def per_kind_gain(self) -> float | None:
        """Capacity of the per-kind mix over the single choice (1.10: 10% more data fits)."""
        if self.per_kind_cost is None:
            return None
        return self.candidate(self.chosen).cost.stored / self.per_kind_cost.stored

    # ------------------------------------------------------------------ reports

    def summary_line(self) -> str:
        from fanstore.select.report import summary_line

        return summary_line(self)

    def to_json(self) -> dict[str, Any]:
        from fanstore.select.report import to_json

        return to_json(self)

    def not_met_message(self) -> str:
        from fanstore.select.report import not_met_message

        return not_met_message(self)

    def check_met(self) -> None:
        """Raise :class:`BudgetNotMetError` (exit status 3) if the budget is not met."""
        if not self.budget_met:
            raise BudgetNotMetError(self.not_met_message())


# --------------------------------------------------------------------------- the run


def _progress_bar(total: int, desc: str, progress: bool | None):
    if progress is False or (progress is None and not sys.stderr.isatty()):
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, file=sys.stderr, leave=False)


def run_selection(src: str, options: SelectionOptions | None = None) -> SelectionResult:
    """Sample ``src``, measure every candidate, and choose under the budget.

    Never raises because the budget is not met: the result says so (``budget_met``) and
    :meth:`SelectionResult.check_met` raises :class:`BudgetNotMetError`.
    """
    options = options or SelectionOptions()
    t_start = time.monotonic()
    files = list_source(src)
    sample = draw_sample(files, int(options.sample_mb * MB), options.chunk_size, options.seed,
                         root=src, progress=options.progress)
    kinds = [k for k, ks in sample.kinds.items() if ks.units]
    if not kinds:
        raise UsageError(f"{src}: no file could be read for the sample")

    # Random-read latency: given, else measured with the bandwidth, else 0 (storage given).
    given_latency = options.storage_latency_us
    if options.storage_mb_per_sec is not None:
        storage, latency, storage_from = options.storage_mb_per_sec * MB, 0.0, "given"
    else:
        storage, latency, storage_from = bench.measure_storage_access(
            options.storage_dir, 0 if given_latency is not None else options.n_cores)
        log.info("storage read bandwidth %.0f MB/s (%s)", storage / MB, storage_from)
    if given_latency is not None:
        latency = given_latency * 1e-6

    reader = None
    if options.reader is not None:
        reader = calibrate(files, options.reader, options.n_cores, options.chunk_size,
                           options.seed, options.storage_dir)
        log.info("reader %s", reader.describe())
    base = {k: bench.baseline(sample.kinds[k].units) for k in kinds}
    cands = whole_set_candidates(sample)
    if options.per_kind:
        cands += per_kind_candidates(sample, cands)
    measures = _measure_all(sample, kinds, cands, options)

    results = {k: KindResult(k, sample.kinds[k].files, sample.kinds[k].raw_bytes,
                             sample.kinds[k].sample_bytes, sample.kinds[k].typesize,
                             sample.kinds[k].typesize_from) for k in kinds}
    path, seeks = _per_file_costs(files, sample, kinds, reader, options.chunk_size)
    for cand in cands:
        # A dictionary is stored once: charge it per raw byte of the kind(s) that use it.
        spread = cand.overhead / sum(sample.kinds[k].raw_bytes for k in measures[cand.label])
        for k, m in measures[cand.label].items():
            if cand.by_kind:
                own = cand.codec_for(k).get_config().get("dict")
                extra = (len(cand.codec_for(k).dict_data) / sample.kinds[k].raw_bytes
                         if own else 0.0)
            else:
                extra = spread
            # Solid blocks: a read decodes and checks its whole block (amplification).
            amp = m.amplification
            decode = (m.decode_s + m.raw_unit_bytes * base[k].copy) / m.raw_bytes * amp
            stored = m.stored_bytes / m.raw_bytes
            results[k].costs[cand.label] = Cost(
                stored + extra, decode + base[k].checksum * amp,
                stored * amp if cand.solid else None, path.get(k, 0.0), seeks.get(k, 0.0))
            results[k].decode_s[cand.label] = decode
    weights = {k: float(sample.kinds[k].raw_bytes) for k in kinds}
    wsum = sum(weights.values())

    # The budget.
    cores = options.n_cores
    if options.mb_per_sec is not None:
        required, budget_from = options.mb_per_sec * MB, "mb_per_sec"
    elif options.files_per_sec is not None:
        required, budget_from = options.files_per_sec * sample.mean_file_size, "files_per_sec"
    else:
        none_cost = policy.mix([results[k].costs["none"] for k in kinds],
                               [weights[k] for k in kinds])
        required = DEFAULT_BUDGET * policy.node_rate(
            none_cost, Budget(options.mode, 1.0, cores, storage, latency))
        budget_from = "default"
    budget = Budget(options.mode, required, cores, storage, latency)

    order = [c.label for c in cands]
    cand_results: list[CandidateResult] = []
    for cand in cands:
        ks = [k for k in kinds if cand.label in results[k].costs]
        w = [weights[k] for k in ks]
        cost = policy.mix([results[k].costs[cand.label] for k in ks], w)
        decode = sum(weights[k] * results[k].decode_s[cand.label] for k in ks) / sum(w)
        ms = [measures[cand.label][k] for k in ks]
        enc_s = sum(m.encode_s for m in ms)
        measured = sum(m.raw_bytes for m in ms)
        rate = policy.node_rate(cost, budget) if cand.kinds is None else math.nan
        cand_results.append(CandidateResult(
            cand.label, cand.codec, cost, decode,
            measured / enc_s / MB if enc_s > 0 else math.inf, measured,
            sum(m.raw_unit_bytes for m in ms) / measured if measured else 0.0,
            rate, cand.kinds is None and policy.meets(cost, budget),
            kinds=None if cand.kinds is None else sorted(cand.kinds), solid=cand.solid,
            by_kind=dict(cand.by_kind)))
    single_costs = {c.label: c.cost for c in cand_results if c.kinds is None}
    chosen, met = policy.choose(single_costs, budget, order)
    for c in cand_results:
        c.chosen = c.label == chosen

    result = SelectionResult(
        source=os.path.abspath(src), options=options, budget=budget, budget_from=budget_from,
        files=sample.files, raw_bytes=sample.raw_bytes, sample_bytes=sample.sample_bytes,
        sample_units=sample.units, storage_from=storage_from,
        checksum_mb_per_s=wsum / sum(weights[k] * base[k].checksum for k in kinds) / MB,
        candidates=cand_results, kinds=results, chosen=chosen, met=met, reader=reader)
    if options.per_kind:
        mc = policy.choose_per_kind({k: results[k].costs for k in kinds}, weights, budget,
                                    single=chosen if met else None, order=order)
        result.per_kind, result.per_kind_cost, result.per_kind_met = mc.assign, mc.cost, mc.met
        for k, label in mc.assign.items():
            results[k].chosen = label
    else:
        for k in kinds:
            results[k].chosen = chosen
    result.seconds = time.monotonic() - t_start
    return result


def _per_file_costs(files, sample: Sample, kinds: list[str], reader: ReaderCost | None,
                    chunk_size: int) -> tuple[dict[str, float], dict[str, float]]:
    """Per raw byte of each kind: (the read path's own cost, random storage reads).

    The path cost is the calibrated cost of every file of the kind (per file, and per chunk
    beyond its first) over the kind's bytes, empty files included (they cost a reader an
    open too; files in solid blocks are one chunk each, and the kinds that get solid blocks
    have files of one chunk anyway); nothing without a calibrated ``reader``. Random reads:
    one per file (files are read in random order; the rest of a large file follows
    sequentially)."""
    from fanstore.kinds import file_kind

    seconds: dict[str, float] = {}
    count: dict[str, int] = {}
    for f in files:
        k = file_kind(f.rel, f.size)
        count[k] = count.get(k, 0) + 1
        if reader is not None:
            seconds[k] = seconds.get(k, 0.0) + reader.file_cost(-(-f.size // chunk_size))
    raw = {k: sample.kinds[k].raw_bytes for k in kinds if sample.kinds[k].raw_bytes}
    path = {k: seconds.get(k, 0.0) / n for k, n in raw.items()} if reader is not None else {}
    return path, {k: count.get(k, 0) / n for k, n in raw.items()}


def _measure_all(sample: Sample, kinds: list[str], cands: list[Candidate],
                 options: SelectionOptions) -> dict[str, dict[str, bench.KindMeasure]]:
    """Measure every candidate on its kinds; a codec that fails is left out (and removed
    from ``cands``) with a warning."""
    out: dict[str, dict[str, bench.KindMeasure]] = {}
    bar = _progress_bar(len(cands), "measuring codecs", options.progress)
    try:
        for cand in list(cands):
            mine = [k for k in kinds if cand.kinds is None or k in cand.kinds]
            mine_bytes = sum(sample.kinds[k].sample_bytes for k in mine)
            try:
                out[cand.label] = {}
                for k in mine:
                    budget = options.encode_seconds * sample.kinds[k].sample_bytes / mine_bytes
                    units = sample.kinds[k].units
                    codec = cand.codec_for(k)
                    out[cand.label][k] = (
                        bench.measure_solid(codec, units, budget, cand.solid)
                        if cand.solid else bench.measure(codec, units, budget))
            except (CodecError, FanStoreError) as exc:
                if cand.label == "none":
                    raise
                log.warning("codec %s left out: %s", cand.label, exc)
                cands.remove(cand)
            if bar is not None:
                bar.set_postfix_str(cand.label)
                bar.update(1)
    finally:
        if bar is not None:
            bar.close()
    return out


def policy_from_selection(result: SelectionResult):
    """The pack policy for a selection: its codec, or its per-kind codecs.

    Raises :class:`BudgetNotMetError` if the budget was not met: pack does not silently
    store data with a codec too slow for the job.
    """
    from fanstore.pack import CodecPolicy

    if not result.budget_met:
        solid = result.candidate(result.chosen).solid
        raise BudgetNotMetError(result.not_met_message() + "; to pack anyway, give the "
                                f"codec: --codec {_packable(result.chosen_codec)}"
                                + (f" --solid-kb {solid >> 10}" if solid else ""))
    chosen = result.candidate(result.chosen)
    default = chosen.codec
    if result.per_kind is None:
        return CodecPolicy(default, dict(chosen.by_kind), chosen.solid,
                           {k: chosen.solid for k in chosen.by_kind})
    by_kind, solid_by_kind = {}, {}
    for kind, label in result.per_kind.items():
        cand = result.candidate(label)
        codec = cand.by_kind.get(kind, cand.codec)
        if codec != default or cand.solid != chosen.solid:
            by_kind[kind] = codec
            solid_by_kind[kind] = cand.solid
    return CodecPolicy(default, by_kind, chosen.solid, solid_by_kind)


def _packable(codec: Codec) -> str:
    """A spec pack accepts for this codec (a dictionary cannot be given on the command line)."""
    spec = codec.spec
    try:
        parse_spec(spec)
        return spec
    except Exception:  # noqa: BLE001 - zstd:3+dict and the like
        return spec  # pack trains the dictionaries itself (--codec zstd:L+dict)
