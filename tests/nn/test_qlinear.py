"""QuantLinear's activation clipping (--act-clip): each kernel rounds the clipped input, whatever kernel runs."""

from __future__ import annotations

import contextlib

import pytest
import torch

from llmeasyquant.kernels.clipping import search_clip_activations
from llmeasyquant.nn.qlinear import QuantLinear, forced_kernel
from llmeasyquant.primitives import clip_activations
from llmeasyquant.scheme import parse_scheme


@pytest.mark.parametrize("name", ["w8a8-ac80", "w4a4-ac90-g32", "w4a8-ac85-g32-asym", "w8a8-aasym-ac80",
                                  "w8a8-apt-ac90"])
def test_a_clipping_layer_computes_what_its_unclipped_twin_computes_on_the_clipped_input(name):
    generator = torch.Generator().manual_seed(0)
    weight, x = torch.randn(48, 64, generator=generator), torch.randn(7, 64, generator=generator) * 2
    clipping = QuantLinear.from_weight(weight, None, parse_scheme(name))
    act = clipping.scheme.act
    twin = QuantLinear.from_weight(weight, None, parse_scheme(name.replace(f"-ac{act.clip * 100:g}", "")))
    clipped = clip_activations(x, act.clip, act.symmetric, act.granularity)
    with torch.no_grad():
        for kernel in (None, "reference"):
            with forced_kernel(torch.nn.Sequential(clipping, twin), kernel) if kernel else contextlib.nullcontext():
                assert torch.equal(clipping(x), twin(clipped))
                assert not torch.equal(clipping(x), twin(x))  # the clip did bind



@pytest.mark.parametrize("name", ["w4a4-acs-g32", "w4a4-aasym-acs-g32-asym", "w4a4-apt-acs-g32"])
def test_a_layer_with_searched_clips_computes_its_twin_on_the_searched_input(name):
    generator = torch.Generator().manual_seed(1)
    weight, x = torch.randn(48, 64, generator=generator), torch.randn(7, 64, generator=generator) * 2
    searching = QuantLinear.from_weight(weight, None, parse_scheme(name))
    act = searching.scheme.act
    twin = QuantLinear.from_weight(weight, None, parse_scheme(name.replace("-acs", "")))
    searched = search_clip_activations(x, act.bits, act.symmetric, act.granularity)
    with torch.no_grad():
        for kernel in (None, "reference"):
            with forced_kernel(torch.nn.Sequential(searching, twin), kernel) if kernel else contextlib.nullcontext():
                assert torch.equal(searching(x), twin(searched))
                assert not torch.equal(searching(x), twin(x))
