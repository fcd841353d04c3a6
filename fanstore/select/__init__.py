"""``fanstore select``: the best compression ratio that still meets a decompression budget.

Pipeline: :mod:`.sample` (seeded, stratified by file kind) -> :mod:`.candidates` (the codec
grid) -> :mod:`.bench` (ratio, single-core decode time) -> :mod:`.readorder` (how often a
shuffled epoch decodes a solid block) -> :mod:`.policy` (pure choice under the
sync/prefetch budget) -> :mod:`.report` (table, JSON, plot, the pack command). The options
are in :mod:`.options`, the result in :mod:`.result`, the run in :mod:`.selector`. The model
and its formulas are written down in ``docs/selection.md``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

#: What the package exports, and the module each comes from. Imported on first use (PEP
#: 562), so that a module of the package alone is cheap to import: a measured pass's reader
#: process (``python -m fanstore.select.epochreader``, one per core and round) imported the
#: whole selector, numpy and the pack with it, 0.2 s of CPU per reader, for nothing it used.
_EXPORTS = {
    "CandidateResult": "fanstore.select.result",
    "SelectionOptions": "fanstore.select.options",
    "SelectionResult": "fanstore.select.result",
    "run_selection": "fanstore.select.selector",
}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from fanstore.select.options import SelectionOptions
    from fanstore.select.result import CandidateResult, SelectionResult
    from fanstore.select.selector import run_selection


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value
