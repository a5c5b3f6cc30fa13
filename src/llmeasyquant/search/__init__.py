"""Mixed-precision search: per-layer sensitivity, then bit allocation under a budget, giving a Plan."""

from llmeasyquant.search.allocate import Allocation, solve_exact, solve_greedy
from llmeasyquant.search.mixed_precision import (
    Budget,
    LayerChoice,
    MixedPrecisionSearch,
    SearchResult,
    Sensitivities,
)

__all__ = ["Allocation", "Budget", "LayerChoice", "MixedPrecisionSearch", "SearchResult", "Sensitivities",
           "solve_exact", "solve_greedy"]
