"""Pure codec choice under a decompression budget: the formulas of ``docs/selection.md``.

Nothing here measures or reads anything: every function takes per-byte costs (seconds of one
core per raw byte) and stored fractions, so the choice is testable with synthetic numbers.

Notation (all rates in bytes per second of *raw*, i.e. decoded, data):

* ``s``  stored bytes per raw byte (``1 / ratio``);
* ``c``  single-core CPU seconds per raw byte on the read path: decode (raw chunks: a copy)
  plus the XXH3 checksum every read verifies;
* ``S``  node-local storage read bandwidth, ``n`` cores, ``R`` the required rate;
* ``p``  the read path's own cost per raw byte (per file and per chunk, calibrated);
* ``q``  random reads per raw byte (one per file), ``L`` one reader's time per random read
  with ``n`` readers at once (measured: the storage's access latency at that queue depth).

``sync``:      ``X = min(n / (c + p + s/S + q·L), S/s)``  (read then decode, ``n`` readers)
``prefetch``:  ``X = min(n / (c + p), S/s)``    (decode and I/O overlap compute)

A candidate meets the budget when ``X >= R``. Both constraints are linear in the per-kind
costs, which is what makes the per-kind choice a small multiple-choice knapsack.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np

MODES = ("sync", "prefetch")
#: Ratios within this relative distance of the best are a tie; the faster candidate wins
#: (the model's choice, the choice among the measured, the quick selection of ``pack``).
RATIO_TIE = 0.01
#: Node rates within this relative distance of the fastest tie's are equally fast: timings
#: of one core vary that much on a busy machine, so the simplest of them (earliest in the
#: candidates' order) wins, the same answer quiet or busy.
RATE_NOISE = 0.10
#: Budget slack for floating-point equality (the default budget is met exactly by ``none``):
#: :meth:`Budget.met_by`, the one test of "meets the budget".
_EPS = 1e-9


@dataclass(frozen=True)
class Cost:
    """One candidate on one kind (or on the whole mix), per raw byte.

    Attributes: ``stored`` stored bytes per raw byte (1/ratio, at most 1 since the store keeps
    chunks raw when compression does not shrink them); ``cpu`` single-core seconds per raw
    byte on the read path (decode + checksum); ``io`` stored bytes *read* per raw byte a
    reader gets (``None``: ``stored``). They differ for solid blocks: a file read in random
    order fetches, decodes and checks its whole block unless a cache still holds it
    (``readorder``), so ``cpu`` and ``io`` carry that read amplification while ``stored``
    (capacity) does not; ``path`` is what the read path
    itself (the FUSE mount or the Python API) costs one reader per raw byte, from its cost
    per file and per chunk (0 when not calibrated); ``seeks`` random storage reads per raw
    byte (one per file: the first read of a file lands anywhere in its partition).
    """

    stored: float
    cpu: float
    io: float | None = None
    path: float = 0.0  # the reader's own cost per raw byte (per file and chunk; calibrate.py)
    seeks: float = 0.0  # random storage reads per raw byte

    @property
    def ratio(self) -> float:
        return 1.0 / self.stored if self.stored > 0 else math.inf

    @property
    def read(self) -> float:
        """Stored bytes read per raw byte delivered."""
        return self.stored if self.io is None else self.io


@dataclass(frozen=True)
class Budget:
    """What the node must sustain.

    Attributes: ``mode`` sync or prefetch; ``required`` raw bytes/s per node; ``cores`` cores
    decoding; ``storage`` node-local read bandwidth in bytes/s (``inf``: not a limit);
    ``latency`` one reader's seconds per random storage read with ``cores`` readers at once
    (0: not charged).
    """

    mode: str
    required: float
    cores: int
    storage: float
    latency: float = 0.0

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if not self.required > 0 or self.cores < 1 or not self.storage > 0 \
                or not self.latency >= 0:
            raise ValueError(f"bad budget {self!r}")

    def met_by(self, rate: float) -> bool:
        """Whether ``rate`` (raw bytes/s per node: modelled, measured, or read by a check)
        meets the budget: the one test of it, with slack for floating-point equality."""
        return rate >= self.required * (1 - _EPS)

    @property
    def time_allowance(self) -> float:
        """Core-seconds per raw byte the read path may spend: ``n / R``."""
        return self.cores / self.required

    def work(self, cost: Cost) -> float:
        """Core-seconds per raw byte charged against :attr:`time_allowance`."""
        if self.mode == "sync":
            return cost.cpu + cost.path + cost.read / self.storage + cost.seeks * self.latency
        return cost.cpu + cost.path


def node_rate(cost: Cost, budget: Budget) -> float:
    """Raw bytes/s one node sustains with this cost under the budget's mode, cores, storage."""
    work = budget.work(cost)
    cpu_bound = math.inf if work <= 0 else budget.cores / work
    io_bound = math.inf if cost.read <= 0 else budget.storage / cost.read
    return min(cpu_bound, io_bound)


def meets(cost: Cost, budget: Budget) -> bool:
    return budget.met_by(node_rate(cost, budget))


def mix(costs: Sequence[Cost], weights: Sequence[float]) -> Cost:
    """The cost of a dataset whose kinds (raw bytes ``weights``) have the given costs."""
    total = float(sum(weights))
    if total <= 0:
        return Cost(1.0, 0.0)
    io = None
    if any(c.io is not None for c in costs):
        io = sum(w * c.read for c, w in zip(costs, weights)) / total
    return Cost(sum(w * c.stored for c, w in zip(costs, weights)) / total,
                sum(w * c.cpu for c, w in zip(costs, weights)) / total, io,
                sum(w * c.path for c, w in zip(costs, weights)) / total,
                sum(w * c.seeks for c, w in zip(costs, weights)) / total)


def choose(costs: Mapping[str, Cost], budget: Budget, order: Sequence[str] | None = None,
           tie: float = RATIO_TIE) -> tuple[str, bool]:
    """Pick one candidate: ``(label, met)``.

    Among the candidates meeting the budget, the highest ratio; candidates whose ratio is
    within ``tie`` of it are a tie and the one with the highest node rate wins, where rates
    within :data:`RATE_NOISE` of the highest are equal and fall to the earlier label in
    ``order`` (simplest first). If none meets the budget, the fastest (highest node rate)
    with ``met=False``.
    """
    if not costs:
        raise ValueError("no candidates")
    order = list(order) if order is not None else list(costs)
    pos = {label: i for i, label in enumerate(order)}
    labels = sorted(costs, key=lambda lb: pos.get(lb, len(pos)))
    rate = {lb: node_rate(costs[lb], budget) for lb in labels}
    ok = [lb for lb in labels if meets(costs[lb], budget)]
    if not ok:
        return max(labels, key=lambda lb: (rate[lb], -pos.get(lb, len(pos)))), False
    best = min(costs[lb].stored for lb in ok)
    ties = [lb for lb in ok if costs[lb].stored <= best * (1 + tie)]
    fastest = max(rate[lb] for lb in ties)
    as_fast = [lb for lb in ties if rate[lb] * (1 + RATE_NOISE) >= fastest]
    return min(as_fast, key=lambda lb: pos.get(lb, len(pos))), True


@dataclass
class MixChoice:
    """A per-kind assignment: ``assign`` kind -> label, its mixed ``cost`` and ``met``."""

    assign: dict[str, str]
    cost: Cost
    met: bool


def choose_per_kind(
    table: Mapping[str, Mapping[str, Cost]],
    weights: Mapping[str, float],
    budget: Budget,
    single: str | None = None,
    order: Sequence[str] | None = None,
    tie: float = RATIO_TIE,
    grid: int = 4000,
) -> MixChoice:
    """Choose a candidate per kind: the smallest stored size whose mix meets the budget.

    ``table[kind][label]`` is the cost of a candidate on a kind, ``weights[kind]`` the kind's
    raw bytes. The budget is linear in the per-kind costs (``sum w_k a_k <= n/R`` with ``a``
    the :meth:`Budget.work` per byte), so this is a multiple-choice knapsack, solved exactly
    by dynamic programming over a grid of ``grid`` steps of the time allowance (each kind's
    work is rounded *up*, so a chosen mix always meets the real budget). The result is never
    worse than ``single`` (a label present for every kind), the best one-codec choice. Near
    ties (within ``tie`` of a kind's stored size) then go to the faster candidate per kind.
    If nothing meets the budget: the fastest candidate of every kind, ``met=False``.
    """
    kinds = _KindMix(table, weights, budget, order)
    best = _least_stored_in_budget(kinds, grid)
    if single is not None and all(single in table[kind] for kind in kinds.kinds):
        one = {kind: single for kind in kinds.kinds}
        if meets(kinds.mixed(one), budget) and (
            best is None or kinds.mixed(one).stored < kinds.mixed(best).stored
        ):
            best = one
    if best is None or not meets(kinds.mixed(best), budget):
        fastest = kinds.fastest()
        return MixChoice(fastest, kinds.mixed(fastest), False)
    best = _prefer_faster_near_ties(kinds, best, tie)
    return MixChoice(best, kinds.mixed(best), True)


class _KindMix:
    """The kinds with data, with their candidates' costs and their weights: what an
    assignment (kind -> label) costs as a whole."""

    def __init__(self, table: Mapping[str, Mapping[str, Cost]], weights: Mapping[str, float],
                 budget: Budget, order: Sequence[str] | None) -> None:
        self.kinds = [kind for kind in table if weights.get(kind, 0) > 0 and table[kind]]
        total = float(sum(weights[kind] for kind in self.kinds))
        if not self.kinds:
            raise ValueError("no kinds with data")
        self.table = table
        self.weights = weights
        self.budget = budget
        order = list(order) if order is not None else []
        self.position = {label: i for i, label in enumerate(order)}
        self.fraction = {kind: weights[kind] / total for kind in self.kinds}

    def rank(self, label: str) -> int:
        """Where ``label`` comes in the preferred order (unlisted labels last)."""
        return self.position.get(label, len(self.position))

    def mixed(self, assign: Mapping[str, str]) -> Cost:
        """The cost of the whole mix with ``assign[kind]`` for each kind."""
        return mix([self.table[kind][assign[kind]] for kind in self.kinds],
                   [self.weights[kind] for kind in self.kinds])

    def steps(self, kind: str, cost: Cost, grid: int) -> int:
        """The work of ``cost`` on ``kind``'s share of the mix in steps of the time allowance
        (of ``grid`` steps), rounded up."""
        allowance = self.budget.time_allowance
        return max(0, math.ceil(self.fraction[kind] * self.budget.work(cost) / allowance * grid
                                - 1e-9))

    def fastest(self) -> dict[str, str]:
        """The fastest candidate of every kind (least work, then least stored, then order)."""
        table, work = self.table, self.budget.work
        return {kind: min(table[kind], key=lambda lb, kind=kind: (work(table[kind][lb]),
                                                                  table[kind][lb].stored,
                                                                  self.rank(lb)))
                for kind in self.kinds}


def _least_stored_in_budget(kinds: _KindMix, grid: int) -> dict[str, str] | None:
    """The assignment of least stored size whose work, each kind's rounded up to steps of
    the time allowance, fits in ``grid`` steps (None if none does or, at the boundary, the
    mix misses the real budget): a multiple-choice knapsack by dynamic programming."""
    table = kinds.table
    # least[step]: least stored (fraction of the mix) whose rounded work is at most step steps.
    least = np.zeros(grid + 1)
    picks: list[tuple[list[str], np.ndarray]] = []
    for kind in kinds.kinds:
        labels = sorted(table[kind], key=kinds.rank)
        new = np.full(grid + 1, np.inf)
        pick = np.full(grid + 1, -1)
        for label_no, label in enumerate(labels):
            steps = kinds.steps(kind, table[kind][label], grid)
            if steps > grid:
                continue
            share = kinds.fraction[kind] * table[kind][label].stored  # of the mix's stored size
            cand = np.full(grid + 1, np.inf)
            cand[steps:] = least[: grid + 1 - steps] + share
            better = cand < new - 1e-15
            new[better] = cand[better]
            pick[better] = label_no
        least = new
        picks.append((labels, pick))
    if not np.isfinite(least[grid]):
        return None
    assign: dict[str, str] = {}
    step = grid
    for kind, (labels, pick) in zip(reversed(kinds.kinds), reversed(picks)):
        label = labels[int(pick[step])]
        assign[kind] = label
        step -= kinds.steps(kind, table[kind][label], grid)
    if meets(kinds.mixed(assign), kinds.budget):  # always, up to floating point at the boundary
        return assign
    return None


def _prefer_faster_near_ties(kinds: _KindMix, best: dict[str, str], tie: float
                             ) -> dict[str, str]:
    """``best`` with near ties per kind (within ``tie`` of its stored size) given to the
    faster candidate while the mix still meets the budget (heaviest kinds first)."""
    table, work = kinds.table, kinds.budget.work
    for kind in sorted(kinds.kinds, key=lambda kind: -kinds.weights[kind]):
        here = table[kind][best[kind]]
        for label in sorted(table[kind], key=lambda lb, kind=kind: (work(table[kind][lb]),
                                                                     kinds.rank(lb))):
            cost = table[kind][label]
            if work(cost) >= work(here) or cost.stored > here.stored * (1 + tie):
                continue
            trial = dict(best, **{kind: label})
            if meets(kinds.mixed(trial), kinds.budget):
                best = trial
                break
    return best
