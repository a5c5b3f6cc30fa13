"""Exact sums: the same bits in any order and however the terms are split (as over ranks), close to the true sum."""

from __future__ import annotations

import math
import random

import pytest
import torch

from llmeasyquant.errors import ConfigError
from llmeasyquant.infra import exact_sum
from llmeasyquant.infra.exact_sum import ExactSum, exact_totals


def terms(count: int = 40, shape: tuple[int, ...] = (24, 24)) -> list[torch.Tensor]:
    """fp32 terms of very different magnitudes (from 1e-9 to 1e9, and a tiny and a huge entry), whose plain float
    sums differ from one order to the next."""
    g = torch.Generator().manual_seed(0)
    out = [torch.randn(shape, generator=g) * 10.0 ** int(torch.randint(-9, 10, (1,), generator=g))
           for _ in range(count)]
    out[3][0, 0], out[5][1, 1] = 1e-30, -3e20
    return out


def summed(parts: list[list[torch.Tensor]]) -> torch.Tensor:
    """The sum of each part alone, then the parts' bins added together (what all_reduce does across ranks)."""
    sums = []
    for part in parts:
        total = ExactSum(parts[0][0].shape)
        for term in part:
            total.add(term)
        sums.append(total)
    merged = sums[0]
    for other in sums[1:]:
        for index, values in other.bins.items():
            merged._bin(index).add_(values)
    return merged.value()


def test_the_same_bits_in_any_order_and_any_split():
    values = terms()
    reference = summed([values])
    plain = {bool(torch.equal(sum(t.double() for t in values), sum(t.double() for t in reversed(values))))}
    for seed in range(6):
        order = values[:]
        random.Random(seed).shuffle(order)
        cut = 1 + seed * 6
        assert torch.equal(summed([order]), reference)
        assert torch.equal(summed([order[:cut], order[cut:]]), reference)  # two "ranks"
        assert torch.equal(summed([order[0::3], order[1::3], order[2::3]]), reference)  # three, strided
    assert plain == {False}  # what this replaces: the plain fp64 sum does depend on the order here


def test_close_to_the_true_sum():
    values = terms()
    total = summed([values])
    true = torch.tensor([[math.fsum(float(t[i, j]) for t in values) for j in range(24)] for i in range(24)],
                        dtype=torch.float64)
    # Each term keeps at least 36 bits below its largest entry: the error is bounded by the terms' maxima.
    bound = sum(float(t.abs().max()) for t in values) * 2.0 ** -exact_sum.BIN_BITS
    assert float((total - true).abs().max()) <= bound
    ordinary = torch.tensor([1.5, -2.25e-3, 3e5], dtype=torch.float32)
    assert torch.equal(summed([[ordinary, ordinary]]), 2 * ordinary.double())  # fp32 values exactly


def test_scalars_zeros_and_non_finite_terms():
    assert exact_totals([(0.1, 1e-300), (0.2, 0.0), (0.3, -1e-300)], 2) == [math.fsum([0.1, 0.2, 0.3]), 0.0]
    assert exact_totals([], 3) == [0.0, 0.0, 0.0]
    total = ExactSum((2,))
    total.add(torch.zeros(2))
    total.add(torch.tensor([1.0, float("inf")]))
    total.add(torch.tensor([2.0, 1.0]))
    value = total.value()
    assert value[0] == 3.0 and value[1] == float("inf")


def test_bad_terms_are_refused(monkeypatch: pytest.MonkeyPatch):
    total = ExactSum((2,))
    with pytest.raises(ValueError, match="shape"):
        total.add(torch.zeros(3))
    monkeypatch.setattr(exact_sum, "MAX_TERMS", 2)
    total = ExactSum(())
    total.add(torch.tensor(1.0))
    total.add(torch.tensor(1.0))
    with pytest.raises(ConfigError, match="more than 2 terms"):
        total.add(torch.tensor(1.0))
