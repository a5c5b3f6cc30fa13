"""Bit allocation: one candidate per layer, minimising Σ loss + λ·Σ cost subject to Σ cost ≤ budget.

This is the multiple-choice knapsack. `solve_exact` solves it by dynamic programming over the cost axis: costs are
integers (bits), and every cost above a layer's cheapest candidate is divided by their greatest common divisor,
which for transformer shapes leaves a few thousand states. `solve_greedy` is the paper's search: from the
best-quality choice, lower the layer that loses least per bit saved until the budget holds, then coordinate descent
(single-layer changes) until no change lowers the objective.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from llmeasyquant.errors import ConfigError

log = logging.getLogger(__name__)

MAX_STATES = 2_000_000  # beyond this the exact solver rounds costs up to a coarser unit (the budget still holds)


@dataclass(frozen=True)
class Allocation:
    choice: tuple[int, ...]  # index of the chosen candidate, per layer
    cost: int  # Σ cost of the chosen candidates
    loss: float  # Σ loss of the chosen candidates
    objective: float  # loss + λ·cost
    exact: bool  # proven optimal (False: greedy, or the exact solver had to coarsen costs)


def _check(costs: Sequence[Sequence[int]], losses: Sequence[Sequence[float]], budget: int) -> None:
    if len(costs) != len(losses) or not costs:
        raise ConfigError(f"allocation needs one cost and loss list per layer; got {len(costs)} and {len(losses)}")
    for i, (c, v) in enumerate(zip(costs, losses, strict=True)):
        if not c or len(c) != len(v):
            raise ConfigError(f"layer {i}: {len(c)} costs for {len(v)} losses; give one of each per candidate")
        if any(x < 0 or int(x) != x for x in c):
            raise ConfigError(f"layer {i}: costs must be non-negative integers (bits), got {list(c)}")
        if not all(math.isfinite(x) for x in v):
            raise ConfigError(f"layer {i}: losses must be finite, got {list(v)}")
    floor = sum(min(c) for c in costs)
    if budget < floor:
        raise ConfigError(f"the budget of {budget} bits is below the cheapest allocation ({floor} bits, every layer "
                          "at its cheapest candidate): raise the budget or add a lower bit width to the candidates")


def _result(costs, losses, choice, lam: float, exact: bool) -> Allocation:
    cost = sum(int(costs[i][j]) for i, j in enumerate(choice))
    loss = sum(float(losses[i][j]) for i, j in enumerate(choice))
    return Allocation(tuple(int(j) for j in choice), cost, loss, loss + lam * cost, exact)


def solve_exact(costs: Sequence[Sequence[int]], losses: Sequence[Sequence[float]], budget: int,
                lam: float = 0.0, max_states: int = MAX_STATES) -> Allocation:
    """The optimal allocation (dynamic programming); ties go to the earlier candidate."""
    _check(costs, losses, budget)
    base = [min(c) for c in costs]
    extra = [[int(x) - b for x in c] for c, b in zip(costs, base, strict=True)]
    slack = budget - sum(base)
    unit = math.gcd(*(x for row in extra for x in row)) or 1
    exact = True
    if slack // unit + 1 > max_states:
        unit = -(-slack // (max_states - 1))
        exact = False
        log.warning("allocation: %d cost states exceed %d; costs rounded up to multiples of %d bits (the budget "
                    "holds, the optimum is approximate)", slack // unit, max_states, unit)
    states = slack // unit + 1
    steps = [[-(-x // unit) for x in row] for row in extra]
    best = np.full(states, np.inf)  # best[s]: least objective with exactly s units of extra cost used
    best[0] = 0.0
    picks = np.zeros((len(costs), states), dtype=np.int16)
    for i, (row_steps, row_loss, row_cost) in enumerate(zip(steps, losses, costs, strict=True)):
        new = np.full(states, np.inf)
        for j, (w, v, c) in enumerate(zip(row_steps, row_loss, row_cost, strict=True)):
            if w >= states:
                continue
            shifted = np.full(states, np.inf)
            shifted[w:] = best[: states - w] + (float(v) + lam * int(c))
            better = shifted < new
            new[better] = shifted[better]
            picks[i, better] = j
        best = new
    state = int(np.argmin(best))
    choice = []
    for i in range(len(costs) - 1, -1, -1):
        j = int(picks[i, state])
        choice.append(j)
        state -= steps[i][j]
    return _result(costs, losses, choice[::-1], lam, exact)


def solve_greedy(costs: Sequence[Sequence[int]], losses: Sequence[Sequence[float]], budget: int,
                 lam: float = 0.0) -> Allocation:
    """Greedy descent to the budget, then coordinate descent; fast, not always optimal."""
    _check(costs, losses, budget)
    objective = [[float(v) + lam * int(c) for c, v in zip(cs, vs, strict=True)] for cs, vs in zip(costs, losses,
                                                                                                   strict=True)]
    choice = [int(np.argmin(row)) for row in objective]
    total = sum(int(costs[i][j]) for i, j in enumerate(choice))
    while total > budget:  # lower the layer that loses least per bit saved
        best_ratio, best_move = math.inf, None
        for i, row in enumerate(costs):
            for j, c in enumerate(row):
                saved = int(row[choice[i]]) - int(c)
                if saved > 0:
                    ratio = (objective[i][j] - objective[i][choice[i]]) / saved
                    if ratio < best_ratio:
                        best_ratio, best_move = ratio, (i, j)
        i, j = best_move  # _check guarantees some move saves bits while over budget
        total -= int(costs[i][choice[i]]) - int(costs[i][j])
        choice[i] = j
    improved = True
    while improved:  # coordinate descent: any single-layer change that fits and lowers the objective
        improved = False
        for i, row in enumerate(costs):
            for j, c in enumerate(row):
                fits = total - int(row[choice[i]]) + int(c) <= budget
                if fits and objective[i][j] < objective[i][choice[i]] - 1e-15:
                    total += int(c) - int(row[choice[i]])
                    choice[i] = j
                    improved = True
    return _result(costs, losses, choice, lam, exact=False)


SOLVERS = {"exact": solve_exact, "greedy": solve_greedy}
