"""``fanstore select``: the best compression ratio that still meets a decompression budget.

Pipeline: :mod:`.sample` (seeded, stratified by file kind) -> :mod:`.candidates` (the codec
grid) -> :mod:`.bench` (ratio, single-core decode time) -> :mod:`.policy` (pure choice
under the sync/prefetch budget) -> :mod:`.report` (table, JSON, plot). The model and its
formulas are written down in ``docs/selection.md``.
"""

from fanstore.select.selector import (
    CandidateResult,
    SelectionOptions,
    SelectionResult,
    policy_from_selection,
    run_selection,
    selection_options,
)

__all__ = [
    "CandidateResult",
    "SelectionOptions",
    "SelectionResult",
    "policy_from_selection",
    "run_selection",
    "selection_options",
]
