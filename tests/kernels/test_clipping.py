"""Searched activation clipping (kernels/clipping.py, `--act-clip search`): each token clipped at one of the
fractions and rounding no worse than at any; the native operator against the PyTorch reference; the fallback."""

from __future__ import annotations

import dataclasses
import shutil

import pytest
import torch

from llmeasyquant.kernels import native
from llmeasyquant.kernels.clipping import (
    CLIP_SEARCH_FRACTIONS,
    limit_activations,
    search_clip_activations,
    search_clip_reference,
)
from llmeasyquant.primitives import MIN_SCALE, clip_activations, fake_quantize
from llmeasyquant.scheme import ActScheme, PerGroup, PerTensor, PerToken

HAS_COMPILER = shutil.which("c++") is not None or shutil.which("g++") is not None
SEARCHES = [search_clip_reference, search_clip_activations]  # the second natively where it builds


def tokens(seed: int, count: int = 12, width: int = 576) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(count, width, generator=generator) * torch.rand(count, 1, generator=generator) * 4
    x[3 % count, 7] = 40.0  # one token with a lone large value
    x[5 % count] = torch.linspace(-1, 1, width)  # evenly spread
    return x


def _rounding_error(x: torch.Tensor, clipped: torch.Tensor, symmetric: bool, granularity) -> torch.Tensor:
    """Each token's (the tensor's) squared error when the kernel rounds `clipped` at 4 bits, against x."""
    dims = (0, 1) if isinstance(granularity, PerTensor) else (1,)
    return (fake_quantize(clipped, 4, symmetric, granularity) - x).pow(2).sum(dim=dims)


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("granularity", [PerToken(), PerTensor()])
@pytest.mark.parametrize("search", SEARCHES)
def test_searched_clip_is_one_of_the_fractions_and_rounds_no_worse_than_any(symmetric, granularity, search):
    x = tokens(2)
    searched = search(x, 4, symmetric, granularity)
    candidates = torch.stack([clip_activations(x, f, symmetric, granularity) for f in CLIP_SEARCH_FRACTIONS])
    matches = (candidates == searched).flatten(2).all(dim=2) if isinstance(granularity, PerToken) else \
        (candidates == searched).flatten(1).all(dim=1, keepdim=True)
    assert bool(matches.any(dim=0).all())  # each token clipped at one of the fractions
    best = _rounding_error(x, searched, symmetric, granularity)
    for candidate in candidates:
        assert bool((best <= _rounding_error(x, candidate, symmetric, granularity) * (1 + 1e-5)).all())
    assert not torch.equal(searched, x)  # the near-Gaussian tokens are clipped


def test_searched_clip_beats_one_fraction_on_tokens_of_mixed_tails():
    """Why the option exists: tokens with light and heavier tails want different fractions; the best single
    fraction for all rounds worse than each token's own."""
    generator = torch.Generator().manual_seed(3)
    gaussian = torch.randn(64, 576, generator=generator)
    even = torch.rand(64, 576, generator=generator) * 2 - 1
    x = torch.cat((gaussian, even))
    searched = _rounding_error(x, search_clip_activations(x, 4, False, PerToken()), False, PerToken()).sum()
    fixed = min(_rounding_error(x, clip_activations(x, f, False, PerToken()), False, PerToken()).sum()
                for f in CLIP_SEARCH_FRACTIONS)  # the best one fraction for all
    assert searched < 0.95 * fixed


def test_limit_activations_follows_the_scheme():
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(4))
    assert torch.equal(limit_activations(x, ActScheme(bits=4, clip=0.8)), clip_activations(x, 0.8, True, PerToken()))
    assert torch.equal(limit_activations(x, ActScheme(bits=4, clip_search=True)),
                       search_clip_activations(x, 4, True, PerToken()))
    assert limit_activations(x, ActScheme(bits=4)) is x


@pytest.mark.parametrize("width", [64, 100])  # whole groups, and a last group of 4 channels
@pytest.mark.parametrize("search", [False, True])
def test_activation_groups_are_clipped_each_on_its_own_range(width, search):
    x = torch.randn(3, 5, width, generator=torch.Generator().manual_seed(width))
    act = ActScheme(bits=4, symmetric=False, granularity=PerGroup(32), clip=1.0 if search else 0.8,
                    clip_search=search)
    found = limit_activations(x, act)
    assert found.shape == x.shape
    for first in range(0, width, 32):  # each group as a token of its own
        group = x[..., first:first + 32].reshape(-1, min(32, width - first))
        expected = (search_clip_activations(group, 4, False, PerToken()) if search
                    else clip_activations(group, 0.8, False, PerToken()))
        assert torch.equal(found[..., first:first + 32].reshape(group.shape), expected)
    assert not torch.equal(found, limit_activations(x, dataclasses.replace(act, granularity=PerToken())))




@pytest.mark.skipif(not HAS_COMPILER, reason="no C++ compiler: the native operators cannot be built")
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("count", [1, 300])  # 300 rows: a prompt, split over the threads
def test_native_operator_chooses_what_the_reference_chooses(symmetric, bits, count):
    ops = native.ops()
    assert ops is not None, "a compiler is present, so the native operators must build (see the log for why not)"
    x = tokens(count, count=count, width=1536)
    x[0] = torch.rand(1536) + 0.5  # all positive: the range still holds zero
    fractions = torch.tensor(CLIP_SEARCH_FRACTIONS)
    found = ops.search_clip_rows(x, bits, symmetric, fractions, MIN_SCALE)
    expected = search_clip_reference(x, bits, symmetric, PerToken())
    same = (found == expected).all(dim=1)
    # The error sums run in another order: only a token whose best two fractions tie within float error may differ.
    assert int(same.sum()) >= count - max(1, count // 100)
    for row in torch.nonzero(~same).flatten().tolist():
        mine, theirs = (float((fake_quantize(t[row:row + 1], bits, symmetric, PerToken()) - x[row]).pow(2).sum())
                        for t in (found, expected))
        assert mine == pytest.approx(theirs, rel=1e-5)


def test_fallback_is_used_when_native_is_off_and_chooses_the_same(monkeypatch):
    x = tokens(7, count=6).reshape(2, 3, 576)  # a batch of sequences: any leading shape
    on = search_clip_activations(x, 4, False, PerToken())
    monkeypatch.setenv("LLMEASYQUANT_NATIVE", "0")
    assert native.ops() is None
    off = search_clip_activations(x, 4, False, PerToken())
    assert off.shape == x.shape and torch.equal(off, search_clip_reference(x, 4, False, PerToken()))
    assert torch.equal(off, on)  # these six tokens have no near-ties


@pytest.mark.skipif(not HAS_COMPILER, reason="no C++ compiler: the native operators cannot be built")
def test_native_operator_refuses_bad_arguments():
    ops = native.ops()
    with pytest.raises(RuntimeError, match="bits"):
        ops.search_clip_rows(torch.zeros(1, 8), 1, True, torch.ones(1), MIN_SCALE)
    with pytest.raises(RuntimeError, match="fractions"):
        ops.search_clip_rows(torch.zeros(1, 8), 4, True, torch.ones(17), MIN_SCALE)
    with pytest.raises(RuntimeError, match="rows, width"):
        ops.search_clip_rows(torch.zeros(8), 4, True, torch.ones(1), MIN_SCALE)
