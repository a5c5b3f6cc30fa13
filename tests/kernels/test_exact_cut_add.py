"""The native cut-and-add of the exact sums (kernels/native/exact_sum_ops.cpp): the PyTorch path's bits."""

from __future__ import annotations

import pytest
import torch

from llmeasyquant.infra.exact_sum import ExactSum


def _terms(seed: int) -> list[torch.Tensor]:
    """fp32 terms whose entries span many binades (so both cuts and the dropped bits matter), with signed zeros,
    subnormal-range quotients and entries that are exact multiples of a bin's unit."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(12):
        term = torch.randn(37, 53, generator=g) * torch.logspace(-30, 20, 53, base=2.0)
        term *= 10.0 ** float(torch.randint(-8, 9, (1,), generator=g))
        term[0, :4] = torch.tensor([0.0, -0.0, 2.0 ** -36, -(2.0 ** 36)])
        out.append(term)
    return out


def _bins(total: ExactSum) -> dict[int, torch.Tensor]:
    return {index: values.clone() for index, values in total.bins.items()}


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_same_bins_as_the_pytorch_cuts(ops, seed: int):
    plain, native = ExactSum((37, 53)), ExactSum((37, 53), cut_add=ops.exact_cut_add)
    for term in _terms(seed):
        plain.add(term)
        native.add(term)
    got, expected = _bins(native), _bins(plain)
    assert got.keys() == expected.keys()
    for index in expected:  # bit for bit, -0.0 against 0.0 included
        assert torch.equal(got[index].view(torch.int64), expected[index].view(torch.int64)), index
    assert torch.equal(native.value(), plain.value())


def test_a_transposed_term_is_read_in_its_own_order(ops):
    term = _terms(3)[0].t()  # not contiguous: the operator reads it as laid out by its shape
    plain, native = ExactSum(term.shape), ExactSum(term.shape, cut_add=ops.exact_cut_add)
    plain.add(term)
    native.add(term)
    assert torch.equal(native.value(), plain.value())


def test_refuses_units_that_fp32_cannot_hold(ops):
    term, high, low = torch.ones(4), torch.zeros(4, dtype=torch.float64), torch.zeros(4, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="normal fp32"):
        ops.exact_cut_add(term, high, low, 2.0 ** 200, 2.0 ** 164)
    with pytest.raises(RuntimeError, match="as many entries"):
        ops.exact_cut_add(term, high[:3], low, 2.0, 1.0)
