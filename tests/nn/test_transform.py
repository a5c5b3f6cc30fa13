"""An online input transform on a layer (nn/transform.py): a float linear and a QuantLinear compute W T(x), forward
hooks learn what the weights read, the transform moves onto the layer that replaces a linear, and a module-level
forward (the lean decoder's call) runs it."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import llmeasyquant as lq
from llmeasyquant.methods.rotate import rotation_factors
from llmeasyquant.nn.qlinear import QuantLinear
from llmeasyquant.nn.transform import (
    HadamardTransform,
    attach_input_transform,
    carry_input_transform,
    input_transform_of,
    transformed_input,
)
from llmeasyquant.runtime.model_parts import callable_of


def transform(width: int = 96) -> HadamardTransform:
    return HadamardTransform(*rotation_factors(width, seed=3))


def test_float_and_quantized_layers_compute_w_of_the_transformed_input():
    torch.manual_seed(0)
    linear, t = nn.Linear(96, 40), transform()
    x = torch.randn(2, 5, 96)
    expected = linear(t(x))
    torch.testing.assert_close(t(x), (x.double() @ t.matrix()).float(), atol=1e-5, rtol=1e-5)
    quantized = QuantLinear.from_weight(linear.weight.detach(), linear.bias.detach(), lq.W8A16)
    carry_input_transform(linear, quantized)  # nothing to carry yet
    assert quantized.input_transform is None
    attach_input_transform(linear, t)
    torch.testing.assert_close(linear(x), expected)
    carry_input_transform(linear, quantized)
    assert input_transform_of(quantized) is t and not quantized._forward_pre_hooks  # applied in forward instead
    torch.testing.assert_close(quantized(x), expected, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(quantized.forward(x), quantized(x))  # the lean decoder's call: same function
    attach_input_transform(linear, transform())  # one already there: left as it is, not applied twice
    assert input_transform_of(linear) is t and len(linear._forward_pre_hooks) == 1


@pytest.mark.parametrize("kind", ["float", "quantized"])
def test_hooks_learn_what_the_weights_read(kind):
    torch.manual_seed(0)
    linear, t = nn.Linear(96, 40, bias=False), transform()
    layer = linear if kind == "float" else QuantLinear.from_weight(linear.weight.detach(), None, lq.W8A16)
    attach_input_transform(layer, t)
    seen = []
    layer.register_forward_hook(lambda m, args, _out: seen.append(transformed_input(m, args[0])))
    x = torch.randn(3, 96)
    layer(x)
    torch.testing.assert_close(seen[0], t(x))


def test_callable_of_runs_the_pre_hook_of_a_float_linear():
    linear, t = nn.Linear(96, 8), transform()
    assert callable_of(linear) == linear.forward  # no hooks: the bound forward, no __call__ overhead
    attach_input_transform(linear, t)
    x = torch.randn(1, 96)
    torch.testing.assert_close(callable_of(linear)(x), linear(x))


def test_a_transform_needs_a_power_of_two_times_the_odd_order():
    with pytest.raises(ValueError, match="power of two"):
        HadamardTransform(torch.ones(12), torch.eye(5))
    assert HadamardTransform.empty(1536, 3).describe() == {"kind": "hadamard", "width": 1536, "odd": 3}
