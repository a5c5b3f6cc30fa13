from __future__ import annotations

import pytest
import torch

from llmeasyquant.methods import gram as exact_gram
from llmeasyquant.methods.gram import ExactGram


def _batches(width: int, count: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    # Channels of very different scales, as activations have: the cuts then matter.
    return [torch.randn(int(torch.randint(3, 40, (1,), generator=g)), width, generator=g)
            * torch.logspace(-3, 3, width) for _ in range(count)]


def _gram(batches: list[torch.Tensor], order: list[int] | None = None) -> torch.Tensor:
    gram = ExactGram(batches[0].shape[1])
    for index in order or range(len(batches)):
        gram.add(batches[index])
    return gram.reduce(sum(b.shape[0] for b in batches))


@pytest.mark.parametrize("panel", [7, 512])
def test_the_same_bits_in_any_order_kept_or_folded(monkeypatch: pytest.MonkeyPatch, panel: int):
    monkeypatch.setattr(exact_gram, "PANEL_COLUMNS", panel)
    batches = _batches(20, 12)
    kept = _gram(batches)
    assert torch.equal(kept, _gram(batches, list(reversed(range(12)))))
    monkeypatch.setattr(exact_gram, "_BIN_BYTES", 0)  # fold into bins from the first batch on
    assert torch.equal(kept, _gram(batches, [5, 0, 11, 3, 1, 2, 4, 6, 7, 8, 9, 10]))
    monkeypatch.setattr(exact_gram, "_BIN_BYTES", 1)  # keep some, then fold: 20·20 bytes is a few batches
    assert torch.equal(kept, _gram(batches, [3, 2, 1, 0, 4, 5, 6, 7, 8, 9, 10, 11]))


def test_close_to_the_float64_gram_matrix():
    batches = _batches(33, 6, seed=1)
    x = torch.cat(batches).double()
    expected = x.t() @ x / x.shape[0]
    # fp32 products (each batch on its own), summed exactly: fp32 rounding relative to the largest entry
    torch.testing.assert_close(_gram(batches).double(), expected, rtol=1e-5, atol=1e-6 * float(expected.abs().max()))


def test_the_kept_batches_are_copies_and_memory_is_freed_after():
    batch = torch.randn(8, 5)
    gram = ExactGram(5)
    gram.add(batch)
    expected = (batch.double().t() @ batch.double()).float()
    batch.zero_()  # a forward pass may reuse the tensor a hook read
    torch.testing.assert_close(gram.reduce(1), expected)
    assert gram.kept == [] and gram.panels is None


def test_a_batch_of_another_width_is_refused():
    with pytest.raises(ValueError, match="Gram matrix of 4 inputs"):
        ExactGram(4).add(torch.zeros(3, 5))


@pytest.mark.parametrize("fold", [False, True])
def test_paired_products_are_the_cross_gram_in_any_order(monkeypatch: pytest.MonkeyPatch, fold: bool):
    if fold:
        monkeypatch.setattr(exact_gram, "_BIN_BYTES", 0)
    batches = _batches(20, 8, seed=2)
    others = [b.flip(1) * 0.5 + 1 for b in batches]  # another stream of the same shapes

    def cross(order: list[int]) -> torch.Tensor:
        gram = ExactGram(20, paired=True)
        for index in order:
            gram.add(batches[index], others[index])
        return gram.reduce(1)

    forward = cross(list(range(8)))
    assert torch.equal(forward, cross(list(reversed(range(8)))))
    expected = torch.cat(batches).double().t() @ torch.cat(others).double()
    assert torch.allclose(forward.double(), expected, rtol=1e-5, atol=1e-6 * float(expected.abs().max()))


def test_a_paired_gram_takes_pairs_and_an_unpaired_one_single_batches():
    with pytest.raises(ValueError, match="paired"):
        ExactGram(4, paired=True).add(torch.ones(3, 4))
    with pytest.raises(ValueError, match="paired"):
        ExactGram(4).add(torch.ones(3, 4), torch.ones(3, 4))
    with pytest.raises(ValueError, match="paired"):
        ExactGram(4, paired=True).add(torch.ones(3, 4), torch.ones(2, 4))
