"""Which candidates to measure, and the choice among the measured: pure, no I/O.

The model (:mod:`.policy`) ranks two dozen candidates in a second; a measured epoch of one
(:mod:`.trial`) takes seconds, so only finalists are measured, one at a time, each choice of
the next informed by what the measurements so far say of the model:

1. ``f``, the model's correction: the median over the measured candidates of measured rate
   / modelled rate (1 before any measurement). A candidate not measured is *estimated* at
   its modelled rate times ``f``.
2. The next finalist is the highest-ratio candidate not yet measured whose estimate is at
   least ``(1 - SLACK)`` of the budget and whose ratio beats the best measured candidate
   that meets the budget by more than a tie: so a pessimistic model cannot hide a winner
   (a candidate the model puts below the budget is still measured when it is near), and
   an optimistic one is caught by the measurement.
3. While nothing measured meets the budget and an unmeasured candidate is estimated faster
   than every measured one, that one is next (the report must name the fastest codec).
4. Until :data:`MIN_MEASURED` are measured, the best-ratio candidate left that is
   estimated to meet the budget (else one near it, else the fastest): the report shows
   alternatives.

It stops when none of these applies, or at the caller's limit. The choice
(:func:`choose_measured`) is the rule of :func:`.policy.choose` on measured rates: the best
ratio among those meeting the budget, ties within :data:`~.policy.RATIO_TIE` to the faster;
if none meets it, the fastest measured. "Meets the budget" is :meth:`.policy.Budget.met_by`,
as it is for the model.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from fanstore.select.policy import RATIO_TIE, Budget

#: A candidate estimated within this fraction below the budget is still measured.
SLACK = 0.3
#: Finalists measured at least (when the candidates allow it).
MIN_MEASURED = 3


@dataclass(frozen=True)
class Option:
    """A candidate as the finalist search sees it: its ratio and modelled rate (raw
    bytes/s per node)."""

    label: str
    ratio: float
    model: float


def correction(options: Sequence[Option], measured: Mapping[str, float]) -> float:
    """``f``: the median of measured / modelled over the measured candidates (1.0 without
    any)."""
    ratios = [measured[o.label] / o.model for o in options
              if o.label in measured and o.model > 0 and measured[o.label] > 0]
    return statistics.median(ratios) if ratios else 1.0


def estimate(option: Option, measured: Mapping[str, float], f: float) -> float:
    return measured.get(option.label, option.model * f)


def best_met(options: Sequence[Option], measured: Mapping[str, float],
             budget: Budget) -> Option | None:
    ok = [o for o in options if o.label in measured and budget.met_by(measured[o.label])]
    return max(ok, key=lambda o: (o.ratio, measured[o.label])) if ok else None


def next_to_measure(options: Sequence[Option], measured: Mapping[str, float],
                    budget: Budget, limit: int, slack: float = SLACK,
                    min_measured: int = MIN_MEASURED) -> str | None:
    """The label of the next finalist to measure, or None (see the module docstring).
    ``measured``: label -> measured rate; ``limit``: measurements allowed in all."""
    if len(measured) >= limit:
        return None
    rest = [o for o in options if o.label not in measured]
    if not rest:
        return None
    f = correction(options, measured)

    def est(o: Option) -> float:
        return estimate(o, measured, f)

    near = budget.required * (1 - slack)
    best = best_met(options, measured, budget)
    floor = best.ratio * (1 + RATIO_TIE) if best is not None else 0.0
    higher = [o for o in rest if o.ratio > floor and est(o) >= near]
    if higher:
        return max(higher, key=lambda o: (o.ratio, est(o))).label
    if best is None:
        fastest = max(rest, key=lambda o: (est(o), o.ratio))
        if not measured or est(fastest) > max(measured.values()):
            return fastest.label
    if len(measured) < min_measured:
        may = ([o for o in rest if budget.met_by(est(o))] or
               [o for o in rest if est(o) >= near])
        pick = (max(may, key=lambda o: (o.ratio, est(o))) if may
                else max(rest, key=lambda o: (est(o), o.ratio)))
        return pick.label
    return None


def choose_measured(options: Sequence[Option], measured: Mapping[str, float],
                    budget: Budget, tie: float = RATIO_TIE) -> tuple[str, bool]:
    """``(label, met)`` among the measured candidates: the best ratio meeting the budget
    (ties to the faster), else the fastest."""
    mine = [o for o in options if o.label in measured]
    if not mine:
        raise ValueError("nothing measured")
    ok = [o for o in mine if budget.met_by(measured[o.label])]
    if not ok:
        return max(mine, key=lambda o: measured[o.label]).label, False
    top = max(o.ratio for o in ok)
    ties = [o for o in ok if o.ratio >= top / (1 + tie)]
    return max(ties, key=lambda o: (measured[o.label], o.ratio)).label, True


__all__ = ["MIN_MEASURED", "SLACK", "Option", "best_met", "choose_measured", "correction",
           "estimate", "next_to_measure"]
