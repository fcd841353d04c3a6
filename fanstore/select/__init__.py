"""``fanstore select``: the best compression ratio that still meets a decompression budget.

Pipeline: :mod:`.sample` (seeded, stratified by file kind) -> :mod:`.candidates` (the codec
grid) -> :mod:`.bench` (ratio, single-core decode time) -> :mod:`.readorder` (how often a
shuffled epoch decodes a solid block) -> :mod:`.policy` (pure choice under the
sync/prefetch budget) -> :mod:`.report` (table, JSON, plot, the pack command). The options
are in :mod:`.options`, the result in :mod:`.result`, the run in :mod:`.selector`. The model
and its formulas are written down in ``docs/selection.md``.
"""

from fanstore.select.options import SelectionOptions
from fanstore.select.result import CandidateResult, SelectionResult
from fanstore.select.selector import run_selection

__all__ = [
    "CandidateResult",
    "SelectionOptions",
    "SelectionResult",
    "run_selection",
]
