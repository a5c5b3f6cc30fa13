"""The reference kernel's held weights (kernels/reference.py `held_weights`): one dequantization, the same bits."""

from __future__ import annotations

import torch

from llmeasyquant.kernels import reference
from llmeasyquant.kernels.reference import held_weights
from llmeasyquant.nn.qlinear import QuantLinear
from llmeasyquant.scheme import parse_scheme


def _counting_layer(monkeypatch, seed: int) -> tuple[QuantLinear, list[int]]:
    weight = torch.randn(48, 64, generator=torch.Generator().manual_seed(seed))
    layer = QuantLinear.from_weight(weight, None, parse_scheme("w4a16-g32"))
    layer.kernel_name = "reference"
    calls = [0]
    dequantize = layer.dequantize

    def counted() -> torch.Tensor:
        calls[0] += 1
        return dequantize()

    monkeypatch.setattr(layer, "dequantize", counted)
    return layer, calls


def test_dequantized_once_inside_with_the_same_bits(monkeypatch):
    layer, calls = _counting_layer(monkeypatch, 0)
    other, other_calls = _counting_layer(monkeypatch, 1)
    xs = [torch.randn(5, 64, generator=torch.Generator().manual_seed(s)) for s in range(4)]
    outside = [layer(x) for x in xs]
    assert calls[0] == 4
    with held_weights():
        with held_weights():  # nested: the outer context holds
            inside = [layer(x) for x in xs] + [other(xs[0])]
        inside += [layer(x) for x in xs]
    assert calls[0] == 5 and other_calls[0] == 1
    assert all(torch.equal(a, b) for a, b in zip(outside + outside, inside[:4] + inside[5:], strict=True))
    assert not reference._HELD  # let go at the outermost exit
    layer(xs[0])
    assert calls[0] == 6  # and dequantized on every call again


def test_let_go_when_the_body_raises(monkeypatch):
    layer, _ = _counting_layer(monkeypatch, 2)
    try:
        with held_weights():
            layer(torch.randn(2, 64))
            raise KeyError("stop")
    except KeyError:
        pass
    assert not reference._HELD
