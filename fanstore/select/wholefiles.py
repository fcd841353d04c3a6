"""The report's lines on codecs of whole files (``Codec.declines``: ``jpegxl``).

Such a codec costs far more CPU per file than the byte codecs (a JPEG XL transcode decodes
at 3-4x the CPU of decoding the JPEG itself), so the report says what the budget asks of
the node's cores: the decode CPU per file (one core, mixed over the source's kinds as every
figure is) times the budget's files per second. And it says how many sampled units the
codec declined (not a JPEG, a JPEG libjxl cannot transcode, a piece of a larger file):
pack stores those raw (``fanstore.pack.fallback``).
"""

from __future__ import annotations

import math
from typing import Any

from fanstore.select.result import CandidateResult, SelectionResult


def decode_cpu_per_file(res: SelectionResult, c: CandidateResult) -> float:
    """Single-core decode seconds per file of the source (raw copies included)."""
    return c.decode_s * res.raw_bytes / res.files if res.files else 0.0


def cores_for_budget(res: SelectionResult, c: CandidateResult) -> float:
    """Cores busy decoding at the budget's rate: decode CPU per file x files/s."""
    return c.decode_s * res.budget.required


def to_json(res: SelectionResult, c: CandidateResult) -> dict[str, Any]:
    """Extra keys of a candidate of whole files in the JSON report."""
    if not c.codec.declines:
        return {}
    return {"decode_cpu_us_per_file": round(decode_cpu_per_file(res, c) * 1e6, 1),
            "decode_cores_for_budget": round(cores_for_budget(res, c), 2),
            "sample_units": c.units, "declined_units": c.declined}


def lines(res: SelectionResult) -> list[str]:
    """One line per candidate of whole files, after the table."""
    out = []
    for c in res.candidates:
        if not c.codec.declines or c.kinds is not None:
            continue
        per_file = decode_cpu_per_file(res, c)
        cores = cores_for_budget(res, c)
        fits = (f"{'within' if cores <= res.budget.cores else 'more than'} the "
                f"{res.budget.cores} of the budget")
        out.append(f"{c.label:<9} decode {per_file * 1e3:,.2f} ms CPU per file on one core: "
                   f"{cores:,.2f} cores to decode {_files(res)} (the budget), {fits}; "
                   f"{c.declined:,} of {c.units:,} sampled files declined (kept raw: not a "
                   "whole JPEG it transcodes byte-exactly)")
    return out


def _files(res: SelectionResult) -> str:
    x = res.files_rate(res.budget.required)
    return f"{x:,.0f} files/s" if math.isfinite(x) else "unbounded"
