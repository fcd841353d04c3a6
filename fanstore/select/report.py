"""Reports of a selection: the terminal table, the JSON document, the plot.

The JSON document (:func:`to_json`) is also what ``pack --codec auto`` stores in the index
metadata under ``"selection"``, so it stays small: no sample data, and dictionaries appear
only as their id and size (the store's codec table holds the dictionary itself).
"""

from __future__ import annotations

import math
import shlex
from typing import Any

from fanstore.errors import BudgetNotMetError
from fanstore.kinds import access_pattern
from fanstore.select.measuring import cold_line
from fanstore.select.options import EXTRA_ROUNDS
from fanstore.select.policy import Cost
from fanstore.select import wholefiles
from fanstore.select.result import CandidateResult, SelectionResult

MB = 1e6
#: 2: ``files_per_s``/``mb_per_s`` are the measured rates of the finalists (``rate_from``),
#: the model's are ``model_*``; ``measurement`` says how the finalists were measured.
JSON_VERSION = 2


def _num(x: float, digits: int = 1) -> float | None:
    """JSON-safe rounded number (None for inf/nan)."""
    if x is None or not math.isfinite(x):
        return None
    return round(float(x), digits)


def _rate(x: float) -> str:
    if not math.isfinite(x):
        return "unbounded"
    return f"{x / MB:,.0f} MB/s"


def _files(x: float) -> str:
    return f"{x:,.0f} files/s" if math.isfinite(x) else "unbounded"


def _compact_config(cfg: dict[str, Any]) -> dict[str, Any]:
    out = dict(cfg)
    if "dict" in out:
        out.pop("dict")
        out["dict"] = "(stored in the store's codec table)"
    return out


def _cand_json(res: SelectionResult, c: CandidateResult) -> dict[str, Any]:
    read = 1.0 / c.cost.cpu if c.cost.cpu > 0 else math.inf
    dec = 1.0 / c.decode_s if c.decode_s > 0 else math.inf
    out: dict[str, Any] = {
        "codec": c.label,
        "ratio": _num(c.cost.ratio, 4),
        "decode_mb_per_s": _num(dec / MB),
        "decode_files_per_s": _num(res.files_rate(dec)),
        "read_mb_per_s": _num(read / MB),
        "encode_mb_per_s": _num(c.encode_mb_per_s),
        "raw_fraction": _num(c.raw_fraction, 4),
        "measured_mb": _num(c.measured_bytes / MB, 2),
    }
    if c.solid:
        out["solid_kb"] = c.solid >> 10
        out["read_amplification"] = _num(c.cost.read / c.cost.stored, 2)
    out.update(wholefiles.to_json(res, c))
    if c.kinds is None:
        # The rate the choice used: measured for a finalist, else the model's.
        out.update(mb_per_s=_num(c.rate / MB), files_per_s=_num(res.files_rate(c.rate)),
                   rate_from=c.rate_from,
                   model_mb_per_s=_num(c.node_rate / MB),
                   model_files_per_s=_num(res.files_rate(c.node_rate)),
                   measured=c.measured.to_json() if c.measured is not None else None,
                   meets_budget=bool(c.meets), chosen=bool(c.chosen))
        if c.measure_error:
            out["measure_error"] = c.measure_error
    else:
        out["kinds"] = list(c.kinds)
    return out


def _measurement_json(res: SelectionResult) -> dict[str, Any] | None:
    info = res.measurement
    if info is None:
        return None
    return {"measured": info.measured, "how": info.how or None, "readers": info.readers,
            "cores": info.cores, "trials": info.trials, "rounds": info.rounds,
            "seconds": _num(info.seconds, 2),
            "model_correction": _num(info.correction, 3), "model_chosen": info.model_chosen,
            "note": info.note, "reader_fallback": info.fallback, "cold": info.cold,
            "resident_after_drop": _num(info.resident, 4) if info.measured else None}


def to_json(res: SelectionResult, capacity: int | None = None) -> dict[str, Any]:
    """The JSON report; ``capacity``: also how many copies fit in that many bytes per node
    (:func:`capacity_json`). It ends with the ``fanstore pack`` command of the choice."""
    chosen = res.candidate(res.chosen)
    doc: dict[str, Any] = {
        "version": JSON_VERSION,
        "source": res.source,
        "mode": res.mode,
        "assumes": assumptions(res),
        "budget": _budget_json(res),
        "sample": _sample_json(res),
        "checksum_mb_per_s": _num(res.checksum_mb_per_s),
        "reader": res.reader.to_json() if res.reader is not None else None,
        "measurement": _measurement_json(res),
        "candidates": [_cand_json(res, c) for c in res.candidates if c.kinds is None],
        "chosen": res.chosen,
        "met": res.budget_met,
        "predicted": _predicted_json(res, chosen),
        "kinds": _kinds_json(res),
        "seconds": _num(res.seconds, 2),
    }
    labels = {res.chosen}
    extras = [c for c in res.candidates if c.kinds is not None]
    if extras:
        doc["kind_candidates"] = [_cand_json(res, c) for c in extras]
    if res.per_kind is not None and res.per_kind_cost is not None:
        doc["per_kind"] = dict(sorted(res.per_kind.items()))
        doc["per_kind_predicted"] = _per_kind_predicted_json(res, res.per_kind_cost)
        labels |= set(res.per_kind.values())
    doc["configs"] = {lb: _compact_config(res.candidate(lb).codec.get_config())
                      for lb in sorted(labels)}
    if capacity is not None:
        doc["local_capacity"] = capacity_json(res, capacity)
    if _packs_per_kind(res):
        doc["pack_command_single"] = pack_command(res, per_kind=False)
    doc["pack_command"] = pack_command(res)
    if not res.budget_met:
        doc["not_met"] = _not_met_json(res, chosen)
    return doc


def _budget_json(res: SelectionResult) -> dict[str, Any]:
    """The budget the selection had to meet, and where its numbers came from."""
    budget = res.budget
    opts = res.options
    return {
        "from": res.budget_from,
        "mb_per_sec": opts.mb_per_sec,
        "files_per_sec": opts.files_per_sec,
        "required_mb_per_s": _num(budget.required / MB),
        "required_files_per_s": _num(res.files_rate(budget.required)),
        "cores": budget.cores,
        "storage_mb_per_s": _num(budget.storage / MB),
        "storage_from": res.storage_from,
        "storage_latency_us": _num(budget.latency * 1e6, 1),
    }


def _sample_json(res: SelectionResult) -> dict[str, Any]:
    """The sample the candidates were measured on, and the source it was drawn from."""
    opts = res.options
    return {
        "seed": opts.seed,
        "target_mb": opts.sample_mb,
        "mb": _num(res.sample_bytes / MB, 2),
        "units": res.sample_units,
        "chunk_size": opts.chunk_size,
        "source_files": res.files,
        "source_mb": _num(res.raw_bytes / MB, 2),
        "mean_file_bytes": _num(res.raw_bytes / res.files if res.files else 0.0, 0),
    }


def _predicted_json(res: SelectionResult, chosen: CandidateResult) -> dict[str, Any]:
    """What the chosen candidate is predicted to do."""
    return {
        "ratio": _num(chosen.cost.ratio, 4),
        "mb_per_s": _num(chosen.rate / MB),
        "files_per_s": _num(res.files_rate(chosen.rate)),
        "rate_from": chosen.rate_from,
        "read_mb_per_s_one_core": _num(1 / chosen.cost.cpu / MB) if chosen.cost.cpu else None,
    }


def _kinds_json(res: SelectionResult) -> dict[str, Any]:
    """Each kind of file: its share of the source and of the sample, and its choice."""
    return {
        kind: {"files": kr.files, "mb": _num(kr.raw_bytes / MB, 3),
               "sample_mb": _num(kr.sample_bytes / MB, 3), "typesize": kr.typesize,
               "typesize_from": kr.typesize_from, "chosen": kr.chosen,
               "access": access_pattern(kind),
               "ratio": _num(kr.costs[kr.chosen].ratio, 4) if kr.chosen else None,
               "decode_mb_per_s": _num(1 / kr.decode_s[kr.chosen] / MB)
               if kr.chosen and kr.decode_s[kr.chosen] > 0 else None}
        for kind, kr in sorted(res.kinds.items())
    }


def _per_kind_predicted_json(res: SelectionResult, cost: Cost) -> dict[str, Any]:
    """What the per-kind choice (of mixed ``cost``) is predicted (or was measured) to do."""
    rate = res.per_kind_rate or 0.0
    return {
        "ratio": _num(cost.ratio, 4),
        "mb_per_s": _num(rate / MB),
        "files_per_s": _num(res.files_rate(rate)),
        "rate_from": "measured" if res.per_kind_measured is not None else "model",
        "measured": res.per_kind_measured.to_json() if res.per_kind_measured else None,
        "gain_over_single": _num(res.per_kind_gain or 1.0, 4),
        "met": bool(res.per_kind_met),
        "measure_error": res.per_kind_error,
    }


def _not_met_json(res: SelectionResult, chosen: CandidateResult) -> dict[str, Any]:
    """How far the fastest candidate (the choice when none meets the budget) falls short."""
    required = res.budget.required
    return {"fastest": res.chosen, "mb_per_s": _num(chosen.rate / MB),
            "files_per_s": _num(res.files_rate(chosen.rate)),
            "of_budget": _num(chosen.rate / required, 3),
            "short_mb_per_s": _num((required - chosen.rate) / MB)}


#: pack's ``--chunk-kb`` default (left out of a command).
_DEFAULT_CHUNK = 1 << 20


def _packs_per_kind(res: SelectionResult) -> bool:
    """Whether the choice is a per-kind mix that meets the budget (``--kind-codec``)."""
    return res.per_kind is not None and bool(res.per_kind_met)


def pack_command(res: SelectionResult, dest: str = "DEST", per_kind: bool | None = None) -> str:
    """The ``fanstore pack`` command that packs the source as this selection chose and
    measured it.

    One codec: ``--codec LABEL``, the label as the report prints it (``zstd:19+dict+solid64k``
    is a spec pack takes). A per-kind mix that meets the budget: the single choice as
    ``--codec`` and a ``--kind-codec KIND=LABEL`` for each kind that differs from it
    (``per_kind=False``: the single choice alone). ``--seed`` when a dictionary's training
    files depend on it, ``--chunk-kb`` when not the default.
    """
    opts = res.options
    words = ["fanstore", "pack", shlex.quote(res.source), dest]
    if opts.chunk_size != _DEFAULT_CHUNK:
        words += ["--chunk-kb", str(opts.chunk_size >> 10)]
    if per_kind is None:
        per_kind = _packs_per_kind(res)
    kinds = sorted((res.per_kind or {}).items()) if per_kind else []
    if opts.seed and any("+dict" in label for label in [res.chosen] + [lb for _, lb in kinds]):
        words += ["--seed", _word(opts.seed)]  # it chooses the dictionaries' training files
    words += ["--codec", shlex.quote(res.chosen)]
    for kind, label in kinds:
        if label != res.chosen:
            words += ["--kind-codec", shlex.quote(f"{kind}={label}")]
    return " ".join(words)


def _word(value: object) -> str:
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return shlex.quote(str(value))


def pack_lines(res: SelectionResult) -> list[str]:
    """The report's last lines: the ``fanstore pack`` command of the choice."""
    command = pack_command(res)
    if not _packs_per_kind(res):
        return [f"pack      {command}"]
    note = ("pack      each kind with its codec, as measured (one codec for every file: "
            f"--codec {res.chosen}):")
    return [note, f"          {command}"]


#: What the model charges for a kind read at random offsets (docs/selection.md).
RANDOM_ACCESS_NOTE = ("a page read decodes the chunk around it once per node (the kernel "
                      "frontend spills decoded chunks into the page cache and shares them "
                      "between its workers), so an epoch over these files costs what a "
                      "sequential read of them costs")


def assumptions(res: SelectionResult) -> str:
    """What the chosen mode's model takes for granted, in one sentence (printed with every
    report: a prediction is only as good as these)."""
    n = res.budget.cores
    if res.mode == "prefetch":
        return (f"prefetch: the mount decodes ahead of the readers in the order they give "
                f"(fanstore.torch.PrefetchSampler, `fanstore prefetch`), on {n} core"
                f"{'s' if n != 1 else ''} the job leaves spare; decoding and storage reads "
                "overlap its compute, so the node sustains min(n / (c + p), S / a) and a "
                "training loop waits only when it asks for files faster than that")
    return (f"sync: each read fetches, decodes and checks on the read path, {n} reader"
            f"{'s' if n != 1 else ''} at once; the node sustains "
            "min(n / (c + p + a/S + q*L), S / a)")


def summary_line(res: SelectionResult) -> str:
    b = res.budget
    need = f"{_rate(b.required)}" + (" (default: 90% of the rate of storing raw)"
                                      if res.budget_from == "default" else "")
    verdict = "met" if res.budget_met else "NOT met"
    if _packs_per_kind(res) and res.per_kind is not None and res.per_kind_cost is not None:
        rate = res.per_kind_rate or 0.0
        n = len(set(res.per_kind.values()))
        how = "measured" if res.per_kind_measured is not None else "modelled"
        return (f"per kind ({n} codec{'s' if n != 1 else ''} over {len(res.per_kind)} kinds): "
                f"ratio {res.per_kind_cost.ratio:.2f}x ({(res.per_kind_gain or 1) - 1:+.1%} "
                f"over {res.chosen} alone), {how} {_rate(rate)} per node on {b.cores} cores, "
                f"{res.mode}; budget {need}: {verdict}")
    c = res.candidate(res.chosen)
    how = "measured" if c.measured is not None else "modelled"
    return (f"{c.label}: ratio {c.cost.ratio:.2f}x, {how} {_rate(c.rate)} "
            f"({_files(res.files_rate(c.rate))}) per node on {b.cores} cores, {res.mode}; "
            f"budget {need}: {verdict}")


def check_met(res: SelectionResult) -> None:
    """Raise :class:`BudgetNotMetError` (exit status 3) if the budget is not met."""
    if not res.budget_met:
        raise BudgetNotMetError(not_met_message(res))


def not_met_message(res: SelectionResult) -> str:
    """One line: what the budget needs, the fastest choice, what it reaches."""
    b = res.budget
    c = res.candidate(res.chosen)
    how = "measured" if c.measured is not None else "modelled"
    text = (f"no codec meets the budget: {res.mode} mode needs {_rate(b.required)} "
            f"({_files(res.files_rate(b.required))}) per node on {b.cores} cores; the fastest, "
            f"{c.label}, reaches {_rate(c.rate)} {how} ({c.rate / b.required:.0%} of it, "
            f"ratio {c.cost.ratio:.2f}x)")
    if res.per_kind is not None and res.per_kind_cost is not None and not res.per_kind_met:
        text += f", the fastest per-kind mix {_rate(res.per_kind_rate or 0.0)}"
    if c.cost.read > 0 and b.storage / c.cost.read < b.required:
        text += f" and storage reads at {_rate(b.storage)} cap it"
    return text


def answer_lines(res: SelectionResult) -> list[str]:
    """The report's last lines: the choice, or when nothing meets the budget the fastest
    choice and the gap; then its ``fanstore pack`` command."""
    if res.budget_met:
        return ["chosen    " + summary_line(res)] + pack_lines(res)
    b = res.budget
    c = res.candidate(res.chosen)
    how = "measured" if c.measured is not None else "modelled"
    short = b.required - c.rate
    return [f"not met   no codec reaches {_rate(b.required)} "
            f"({_files(res.files_rate(b.required))}) per node on {b.cores} cores, {res.mode}; "
            f"the fastest, {c.label} (ratio {c.cost.ratio:.2f}x), reaches {_rate(c.rate)} "
            f"({_files(res.files_rate(c.rate))}) {how}: {c.rate / b.required:.0%} of the "
            f"budget, {_rate(short)} short",
            f"pack      {pack_command(res)}   (the fastest; exit status 3: budget not met)"]


def table(res: SelectionResult, capacity: int | None = None) -> str:
    """The terminal report; ``capacity``: also how many copies fit in that many bytes per
    node. It ends with the ``fanstore pack`` command of the choice."""
    b = res.budget
    opts = res.options
    lines = []
    mean = res.raw_bytes / res.files if res.files else 0
    lines.append(f"source    {res.source}: {res.files:,} files, {res.raw_bytes / MB:,.1f} MB "
                 f"(mean {mean / 1e3:,.1f} kB per file)")
    whole = res.sample_bytes >= res.raw_bytes
    lines.append(f"sample    {res.sample_bytes / MB:,.1f} MB in {res.sample_units:,} units "
                 f"from {len(res.kinds)} kinds (seed {opts.seed}"
                 f"{', the whole source' if whole else ''}; chunk {opts.chunk_size >> 10} KiB)")
    how = {"mb_per_sec": "--mb-per-sec", "files_per_sec": "--files-per-sec",
           "default": "default: 90% of the rate of storing the data raw"}[res.budget_from]
    lines.append(f"budget    {res.mode}: {_rate(b.required)} = "
                 f"{_files(res.files_rate(b.required))} per node on {b.cores} cores ({how})")
    lines.append(f"assumes   {assumptions(res)}")
    random_kinds = sorted(k for k in res.kinds if access_pattern(k) == "random")
    if random_kinds:
        lines.append(f"access    {', '.join(random_kinds)}: read at random offsets; "
                     f"{RANDOM_ACCESS_NOTE}")
    lines.append(f"storage   {_rate(b.storage)}, {b.latency * 1e6:,.0f} us per random read "
                 f"per reader ({res.storage_from})")
    if res.reader is not None:
        lines.append(f"reader    {res.reader.describe()}")
    else:
        lines.append("reader    not modelled (--reader mount|api measures the read path)")
    if res.measurement is not None and res.measurement.fallback:
        lines.append(f"fallback  {res.measurement.fallback}")
    lines.append(f"checksum  xxh3-64 at {res.checksum_mb_per_s:,.0f} MB/s on one core, "
                 "charged to every candidate")
    lines.append(measure_line(res))
    if res.measured and res.measurement is not None:
        lines.append(cold_line(res.measurement.resident))
    lines.append("")
    head = (f"{'codec':<30} {'ratio':>7} {'enc MB/s':>9} {'dec MB/s':>9} {'model':>10} "
            f"{'measured':>10} {'measured':>9}  budget")
    lines.append(head)
    lines.append(f"{'':<30} {'':>7} {'1 core':>9} {'1 core':>9} {'files/s':>10} "
                 f"{'files/s':>10} {'MB/s':>9}")
    whole_cands = sorted((c for c in res.candidates if c.kinds is None),
                         key=lambda c: (-c.cost.ratio, -c.rate))
    for c in whole_cands:
        dec = 1 / c.decode_s if c.decode_s > 0 else math.inf
        if c.measured is not None:
            mark = "met" if c.meets else "not met"
            got = f"{_fmt(res.files_rate(c.rate)):>10} {_fmt(c.rate / MB):>9}"
        else:
            mark = "(model: ok)" if c.meets else "(model: --)"
            got = f"{'failed' if c.measure_error else '-':>10} {'-':>9}"
        if c.chosen:
            mark += "  <- chosen"
        lines.append(f"{c.label:<30} {c.cost.ratio:>7.3f} {_fmt(c.encode_mb_per_s):>9} "
                     f"{_fmt(dec / MB):>9} {_fmt(res.files_rate(c.node_rate)):>10} {got}"
                     f"  {mark}")
    lines += wholefiles.lines(res)
    lines += [f"failed    {c.label} not measured: {c.measure_error}" for c in whole_cands
              if c.measure_error]
    if res.per_kind_error:
        lines.append(f"failed    the per-kind mix not measured, so not chosen: "
                     f"{res.per_kind_error}")
    lines.append("")
    if res.per_kind is not None:
        lines.append(f"{'kind':<16} {'files':>8} {'MB':>9} {'typesize':>14}  "
                     f"{'codec':<34} {'ratio':>7} {'dec MB/s':>9}")
        for k, kr in sorted(res.kinds.items(), key=lambda kv: -kv[1].raw_bytes):
            label = kr.chosen or "?"
            cost = kr.costs.get(label)
            dec = kr.decode_s.get(label, 0.0)
            lines.append(f"{k:<16} {kr.files:>8,} {kr.raw_bytes / MB:>9,.1f} "
                         f"{f'{kr.typesize} ({kr.typesize_from})':>14}  {label:<34} "
                         f"{cost.ratio if cost else math.nan:>7.3f} "
                         f"{_fmt(1 / dec / MB) if dec > 0 else 'inf':>9}")
        lines.append("")
    if capacity is not None:
        lines.append(capacity_line(capacity_json(res, capacity)))
    lines += answer_lines(res)
    return "\n".join(lines)


def measure_line(res: SelectionResult) -> str:
    """How the finalists were measured, or why they were not."""
    info = res.measurement
    if info is None or not info.measured:
        note = info.note if info is not None and info.note else "not measured"
        return f"measured  nothing: {note}; every rate below is the model's"
    n = info.rounds  # and up to EXTRA_ROUNDS more while they disagree
    rounds = f"{n}-{n + EXTRA_ROUNDS} rounds" if n > 1 else "one round"
    scaled = (f"; rates scaled from {info.readers} to {info.cores} cores by the CPU each file "
              "cost (the lower of that bound and linear scaling)"
              if info.cores > info.readers else "")
    return (f"measured  {info.trials} finalists, each a miniature of the source (trial.py) "
            f"packed with it and read by {info.how}, the median of {rounds} scaled to the "
            f"whole source ({info.seconds:.0f} s; the model was off by "
            f"{info.correction:.2f}x){scaled}")


def capacity_json(res: SelectionResult, capacity: int) -> dict[str, Any]:
    """How many copies of the store packed as chosen fit in ``capacity`` bytes per node,
    from the predicted ratio (about: the index and partition headers are left out)."""
    mix = res.per_kind is not None and res.per_kind_cost is not None
    ratio = res.per_kind_cost.ratio if mix else res.candidate(res.chosen).cost.ratio
    stored = math.ceil(res.raw_bytes / ratio) if ratio > 0 else res.raw_bytes
    copies = capacity / stored if stored else math.inf
    return {"bytes": capacity, "codec": "per-kind mix" if mix else res.chosen,
            "ratio": _num(ratio, 4), "predicted_stored_bytes": stored,
            "copies_per_node": _num(copies, 2),
            "every_partition_on_every_node": copies >= 1,
            "min_nodes_one_copy": max(1, math.ceil(stored / capacity))}


def capacity_line(doc: dict[str, Any]) -> str:
    """One line of :func:`capacity_json` for the table."""
    from fanstore.units import show_size

    cap, stored = show_size(doc["bytes"]), show_size(doc["predicted_stored_bytes"])
    head = (f"capacity  packed with {doc['codec']} at {doc['ratio']:.2f}x, the store would be "
            f"about {stored}: {cap} per node holds")
    copies = doc["copies_per_node"]
    if doc["every_partition_on_every_node"]:
        n = None if copies is None else math.floor(copies)
        whole = "any number of whole copies" if n is None else \
            f"{n} whole cop{'y' if n == 1 else 'ies'}"
        return (f"{head} {whole} (--replicas auto: every partition on every node, every "
                "read local)")
    return (f"{head} {copies:.2f} of it (one copy needs {doc['min_nodes_one_copy']} nodes; "
            f"on N nodes --replicas auto keeps about N x {copies:.2f} copies)")


def _fmt(x: float) -> str:
    if not math.isfinite(x):
        return "inf"
    return f"{x:,.0f}" if x >= 10 else f"{x:.2f}"


__all__ = [
    "capacity_json",
    "capacity_line",
    "check_met",
    "answer_lines",
    "measure_line",
    "not_met_message",
    "pack_command",
    "pack_lines",
    "summary_line",
    "table",
    "to_json",
]
