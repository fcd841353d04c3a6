"""Run a selection: sample, model every candidate, measure the finalists, choose.

The steps are in :func:`run_selection`: the model (:func:`_model`; its formulas are in
:mod:`fanstore.select.policy` and ``docs/selection.md``) ranks the candidates, and with a
reader the finalists are measured (:func:`_decide`: :mod:`.finalists` picks them,
:mod:`.measuring` measures them) and the choice is made on the measurements.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import sys
import time

from compressors import CodecError
from fanstore.errors import FanStoreError, UsageError
from fanstore.select import bench, finalists, policy, readorder
from fanstore.select.calibrate import ReaderCost
from fanstore.select.candidates import Candidate, per_kind_candidates, whole_set_candidates
from fanstore.select.measuring import Measuring, why_not_measured
from fanstore.select.options import SelectionOptions
from fanstore.select.policy import Budget, Cost
from fanstore.select.result import (CandidateResult, KindResult, MeasurementInfo,
                                    SelectionResult)
from fanstore.select.sample import Sample, draw_sample, list_source
from fanstore.select.tempmount import MountFailed, TrialError
from fanstore.select.trial import Measured

log = logging.getLogger(__name__)

MB = 1e6
#: The default budget: this fraction of the rate the reader gets from the data stored raw
#: (compression may cost a reader at most 10% of that rate; exactly 100% would refuse every
#: codec on small files, where decoding costs a reader a few percent at most).
DEFAULT_BUDGET = 0.9


# --------------------------------------------------------------------------- the run


def _progress_bar(total: int, desc: str, progress: bool | None):
    if progress is False or (progress is None and not sys.stderr.isatty()):
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, file=sys.stderr, leave=False)


def run_selection(src: str, options: SelectionOptions | None = None) -> SelectionResult:
    """Sample ``src``, model every candidate, measure the finalists, choose under the budget.

    Never raises because the budget is not met: the result says so (``budget_met``) and
    :func:`fanstore.select.report.check_met` raises :class:`BudgetNotMetError`.
    """
    options = options or SelectionOptions()
    t_start = time.monotonic()
    files = list_source(src)
    sample = draw_sample(files, int(options.sample_mb * MB), options.chunk_size, options.seed,
                         root=src, progress=options.progress)
    kinds = [kind for kind, kind_sample in sample.kinds.items() if kind_sample.units]
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

    note = why_not_measured(options)
    measuring = Measuring(files, options) if note is None else None
    try:
        reader = none_trial = None
        if measuring is not None:
            none_trial, reader, options, note = _calibrate(measuring, options, storage,
                                                           latency)
        result = _model(src, files, sample, kinds, options, storage, latency, storage_from,
                        reader)
        result.measurement = MeasurementInfo(
            measuring.how.describe() if measuring else "", measuring.readers if measuring
            else 0, options.n_cores, rounds=options.rounds, note=note,
            fallback=measuring.fallback if measuring else None)
        if measuring is not None and none_trial is not None:
            _decide(result, measuring, none_trial, options)
            result.measurement.resident = measuring.resident
            result.measurement.how = measuring.how.describe(result.measurement.cold)
    finally:
        if measuring is not None:
            measuring.close()
    result.seconds = time.monotonic() - t_start
    return result


def _calibrate(measuring: Measuring, options: SelectionOptions, storage: float,
               latency: float) -> tuple[Measured | None, ReaderCost | None, SelectionOptions,
                                        str | None]:
    """The ``none`` trial and the reader fitted to it, the options as measured (``reader``
    "api" when the trials fell back to it: the model's caches are the API's then) and why
    nothing is measured (None: the finalists are)."""
    try:
        none_trial, reader = measuring.calibrate(storage, latency)
    except MountFailed as exc:  # prefetch mode, no reader given: nothing reads without one
        note = (f"prefetch mode is measured through a mount, and a trial mount failed here "
                f"({exc})")
        log.info("%s", note)
        return None, None, dataclasses.replace(options, reader="api"), note
    log.info("reader %s", reader.describe())
    if measuring.fallback is not None:
        options = dataclasses.replace(options, reader="api")
    return none_trial, reader, options, None


def _model(src: str, files, sample: Sample, kinds: list[str], options: SelectionOptions,
           storage: float, latency: float, storage_from: str,
           reader: ReaderCost | None) -> SelectionResult:
    """Every candidate measured on the sample and modelled for the node: the ranking."""
    baselines = {kind: bench.baseline(sample.kinds[kind].units) for kind in kinds}
    cands = whole_set_candidates(sample)
    if options.per_kind:
        cands += per_kind_candidates(sample, cands)
    measures = _measure_all(sample, kinds, cands, options)
    kind_results = _kind_costs(files, sample, kinds, cands, measures, baselines, options,
                               reader)
    weights = {kind: float(sample.kinds[kind].raw_bytes) for kind in kinds}
    budget, budget_from = _budget(options, sample, kind_results, weights, storage, latency)
    cand_results = [_candidate_result(cand, kind_results, weights, measures[cand.label], budget)
                    for cand in cands]
    order = [c.label for c in cands]
    single_costs = {c.label: c.cost for c in cand_results if c.kinds is None}
    chosen, met = policy.choose(single_costs, budget, order)

    checksum_s = sum(weights[kind] * baselines[kind].checksum for kind in kinds)
    result = SelectionResult(
        source=os.path.abspath(src), options=options, budget=budget, budget_from=budget_from,
        files=sample.files, raw_bytes=sample.raw_bytes, sample_bytes=sample.sample_bytes,
        sample_units=sample.units, storage_from=storage_from,
        checksum_mb_per_s=sum(weights.values()) / checksum_s / MB,
        candidates=cand_results, kinds=kind_results, chosen=chosen, met=met, reader=reader)
    _mark_chosen(result)
    if options.per_kind:
        _choose_per_kind(result, weights, order)
    return result


def _kind_costs(files, sample: Sample, kinds: list[str], cands: list[Candidate],
                measures: dict[str, dict[str, bench.KindMeasure]],
                baselines: dict[str, bench.KindBaseline], options: SelectionOptions,
                reader: ReaderCost | None) -> dict[str, KindResult]:
    """Each kind with the modelled cost, per raw byte, of every candidate measured on it."""
    results = {kind: KindResult(kind, sample.kinds[kind].files, sample.kinds[kind].raw_bytes,
                                sample.kinds[kind].sample_bytes, sample.kinds[kind].typesize,
                                sample.kinds[kind].typesize_from) for kind in kinds}
    path, seeks = _per_file_costs(files, sample, kinds, reader, options.chunk_size)
    caches = (readorder.reader_caches(options.reader, options.n_cores)
              if options.reader is not None else None)
    for cand in cands:
        cand_measures = measures[cand.label]
        amplification = (_solid_amplification(sample, cand_measures, caches) if cand.solid
                         else {})
        # A dictionary is stored once: charge it per raw byte of the kind(s) that use it.
        spread = cand.overhead / sum(sample.kinds[kind].raw_bytes for kind in cand_measures)
        for kind, measure in cand_measures.items():
            if cand.by_kind:
                own = cand.codec_for(kind).get_config().get("dict")
                dict_share = (len(cand.codec_for(kind).dict_data) / sample.kinds[kind].raw_bytes
                              if own else 0.0)
            else:
                dict_share = spread
            # Solid blocks: a read decodes and checks its whole block, unless the reader's
            # caches still hold it (readorder: decodes per raw byte delivered).
            amp = amplification.get(kind, 1.0)
            baseline = baselines[kind]
            decode = (measure.decode_s + measure.raw_unit_bytes * baseline.copy) \
                / measure.raw_bytes * amp
            stored = measure.stored_bytes / measure.raw_bytes
            kind_seeks = seeks.get(kind, 0.0)
            results[kind].costs[cand.label] = Cost(
                stored + dict_share, decode + baseline.checksum * amp,
                stored * amp if cand.solid else None, path.get(kind, 0.0),
                _solid_seeks(kind_seeks, measure, amp) if cand.solid else kind_seeks)
            results[kind].decode_s[cand.label] = decode
    return results


def _budget(options: SelectionOptions, sample: Sample, kind_results: dict[str, KindResult],
            weights: dict[str, float], storage: float, latency: float) -> tuple[Budget, str]:
    """The budget and where it comes from: the options, else the default (a fraction of
    what the model gives the data stored raw; set again from the measured ``none`` when the
    finalists are measured)."""
    cores = options.n_cores
    if options.mb_per_sec is not None:
        required, budget_from = options.mb_per_sec * MB, "mb_per_sec"
    elif options.files_per_sec is not None:
        required, budget_from = options.files_per_sec * sample.mean_file_size, "files_per_sec"
    else:
        none_cost = policy.mix([kind_results[kind].costs["none"] for kind in kind_results],
                               [weights[kind] for kind in kind_results])
        required = DEFAULT_BUDGET * policy.node_rate(
            none_cost, Budget(options.mode, 1.0, cores, storage, latency))
        budget_from = "default"
    return Budget(options.mode, required, cores, storage, latency), budget_from


def _candidate_result(cand: Candidate, kind_results: dict[str, KindResult],
                      weights: dict[str, float], cand_measures: dict[str, bench.KindMeasure],
                      budget: Budget) -> CandidateResult:
    """Candidate ``cand`` over the kinds it was measured on: its costs mixed by bytes."""
    covered = [kind for kind in kind_results if cand.label in kind_results[kind].costs]
    covered_weights = [weights[kind] for kind in covered]
    cost = policy.mix([kind_results[kind].costs[cand.label] for kind in covered],
                      covered_weights)
    decode = sum(weights[kind] * kind_results[kind].decode_s[cand.label]
                 for kind in covered) / sum(covered_weights)
    kind_measures = [cand_measures[kind] for kind in covered]
    encode_s = sum(measure.encode_s for measure in kind_measures)
    measured = sum(measure.raw_bytes for measure in kind_measures)
    rate = policy.node_rate(cost, budget) if cand.kinds is None else math.nan
    return CandidateResult(
        cand.label, cand.codec, cost, decode,
        measured / encode_s / MB if encode_s > 0 else math.inf, measured,
        sum(measure.raw_unit_bytes for measure in kind_measures) / measured
        if measured else 0.0,
        rate, cand.kinds is None and policy.meets(cost, budget),
        kinds=None if cand.kinds is None else sorted(cand.kinds), solid=cand.solid,
        by_kind=dict(cand.by_kind), units=sum(m.units for m in kind_measures),
        declined=sum(m.declined for m in kind_measures))


def _mark_chosen(result: SelectionResult) -> None:
    for cand in result.candidates:
        cand.chosen = cand.label == result.chosen
    for kind_result in result.kinds.values():
        kind_result.chosen = result.chosen


def _choose_per_kind(result: SelectionResult, weights: dict[str, float], order: list[str],
                     correction: float = 1.0) -> None:
    """The per-kind mix under the budget; ``correction`` (measured / modelled, see
    finalists.py) scales the model's rates before the budget is applied."""
    kinds = list(result.kinds)
    budget = result.budget
    if correction != 1.0:
        budget = dataclasses.replace(budget, required=budget.required / correction)
    mix_choice = policy.choose_per_kind(
        {kind: result.kinds[kind].costs for kind in kinds}, weights, budget,
        single=result.chosen if result.met else None, order=order)
    result.per_kind = mix_choice.assign
    result.per_kind_cost, result.per_kind_met = mix_choice.cost, mix_choice.met
    for kind, label in mix_choice.assign.items():
        result.kinds[kind].chosen = label


def _decide(result: SelectionResult, measuring: Measuring, none_trial: Measured,
            options: SelectionOptions) -> None:
    """Measure finalists (finalists.py says which) and choose among the measured."""
    info = result.measurement
    assert info is not None
    singles = [c for c in result.candidates if c.kinds is None]
    by_label = {c.label: c for c in singles}
    by_label["none"].measured = none_trial
    info.trials = 1
    info.model_chosen = result.chosen
    if result.budget_from == "default":  # 90% of what the data stored raw measured
        result.budget = dataclasses.replace(
            result.budget, required=DEFAULT_BUDGET * none_trial.bytes_per_s)
    opts = [finalists.Option(c.label, c.cost.ratio, c.node_rate) for c in singles]
    measured = {"none": none_trial.bytes_per_s}
    bar = _progress_bar(options.trials, "measuring finalists", options.progress)
    failed: list[str] = []
    try:
        while True:
            label = finalists.next_to_measure(opts, measured, result.budget, options.trials)
            if label is None:
                break
            cand = by_label[label]
            try:
                cand.measured = measuring.measure(cand.policy(), _encode_rate(cand), label)
                measured[label] = cand.measured.bytes_per_s
            except TrialError as exc:  # (a reader that died or timed out included)
                log.warning("finalist %s could not be measured: %s", label, exc)
                cand.measure_error = str(exc)
                measured[label] = 0.0
                failed.append(label)
            info.trials += 1
            if bar is not None:
                bar.set_postfix_str(label)
                bar.update(1)
    finally:
        if bar is not None:
            bar.close()
    if failed and len(failed) == info.trials - 1:
        raise TrialError(f"none of the {len(failed)} finalist{'s' if len(failed) != 1 else ''}"
                         f" could be measured (first, {failed[0]}: "
                         f"{by_label[failed[0]].measure_error}); --trials 0 chooses on the "
                         "model alone")
    info.correction = finalists.correction(opts, {k: v for k, v in measured.items() if v})
    for c in singles:
        c.meets = result.budget.met_by(c.rate)
    result.chosen, result.met = finalists.choose_measured(
        opts, {k: v for k, v in measured.items() if v > 0}, result.budget)
    _mark_chosen(result)
    if options.per_kind and result.per_kind is not None:
        weights = {k: float(kr.raw_bytes) for k, kr in result.kinds.items()}
        _choose_per_kind(result, weights, [c.label for c in result.candidates],
                         info.correction)
        if len(set(result.per_kind.values())) > 1:
            _measure_mix(result, measuring)
    info.seconds = measuring.seconds


def _measure_mix(result: SelectionResult, measuring: Measuring) -> None:
    """The per-kind mix is a finalist of its own: met only if its measurement is."""
    assert result.per_kind is not None
    labels = set(result.per_kind.values())
    rate = min(_encode_rate(result.candidate(lb)) for lb in labels)
    try:
        measured = measuring.measure(result.mix_policy(result.per_kind), rate, "per-kind mix")
    except TrialError as exc:
        log.warning("the per-kind mix could not be measured: %s", exc)
        result.per_kind_error = str(exc)
        result.per_kind_met = False
        return
    result.per_kind_measured = measured
    result.per_kind_met = result.budget.met_by(measured.bytes_per_s)
    if result.measurement is not None:
        result.measurement.trials += 1


def _encode_rate(cand: CandidateResult) -> float:
    return cand.encode_mb_per_s * MB if math.isfinite(cand.encode_mb_per_s) else math.inf


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
    for listed in files:
        kind = file_kind(listed.rel, listed.size)
        count[kind] = count.get(kind, 0) + 1
        if reader is not None:
            seconds[kind] = (seconds.get(kind, 0.0)
                             + reader.file_cost(-(-listed.size // chunk_size)))
    raw = {k: sample.kinds[k].raw_bytes for k in kinds if sample.kinds[k].raw_bytes}
    path = {k: seconds.get(k, 0.0) / n for k, n in raw.items()} if reader is not None else {}
    return path, {k: count.get(k, 0) / n for k, n in raw.items()}


def _solid_seeks(per_file: float, measure: bench.KindMeasure, amp: float) -> float:
    """Random storage reads per raw byte of a kind packed in solid blocks: one per decode of
    a block (its stored bytes are one extent; the files read from a block a cache still
    holds need no read at all), ``amp`` / the mean block's raw size; never more than one per
    file (``per_file``). On 60,000 small files in 64 KiB blocks that is 0.17 reads per file
    where one per file had predicted half the measured rate."""
    total = sum(raw for raw, _ in measure.blocks)
    if not total:
        return per_file
    return min(per_file, amp * len(measure.blocks) / total)


def _solid_amplification(sample: Sample, measures: dict[str, bench.KindMeasure],
                         caches: readorder.Caches | None) -> dict[str, float]:
    """Per kind, raw bytes decoded per raw byte delivered for solid blocks read in a
    shuffled epoch (``readorder``): each kind's measured blocks stand for the kind's bytes
    in the source, and all of them share the reader's caches. Without a reader (no
    ``--reader``): no cache, every file read decodes its block."""
    if caches is None:
        return {k: m.amplification for k, m in measures.items()}
    groups = {k: [(sample.kinds[k].raw_bytes / m.raw_bytes, raw, n) for raw, n in m.blocks]
              for k, m in measures.items() if m.raw_bytes and m.blocks}
    tau = readorder.cached_fraction([g for blocks in groups.values() for g in blocks], caches)
    log.info("solid blocks stay cached %.0f%% of an epoch (%d caches of %.0f MiB)", tau * 100,
             caches.workers, caches.bytes_each / (1 << 20))
    return {k: readorder.amplification(blocks, caches, tau)
            for k, blocks in groups.items()}


def _measure_all(sample: Sample, kinds: list[str], cands: list[Candidate],
                 options: SelectionOptions) -> dict[str, dict[str, bench.KindMeasure]]:
    """Measure every candidate on its kinds; a codec that fails is left out (and removed
    from ``cands``) with a warning."""
    out: dict[str, dict[str, bench.KindMeasure]] = {}
    bar = _progress_bar(len(cands), "measuring codecs", options.progress)
    try:
        for cand in list(cands):
            mine = [kind for kind in kinds if cand.kinds is None or kind in cand.kinds]
            mine_bytes = sum(sample.kinds[kind].sample_bytes for kind in mine)
            try:
                out[cand.label] = {}
                for kind in mine:
                    budget = options.encode_seconds * sample.kinds[kind].sample_bytes / mine_bytes
                    units = sample.kinds[kind].units
                    codec = cand.codec_for(kind)
                    out[cand.label][kind] = (
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
