"""The oracle: dequantize the weight and fake-quantize the activations, then a float matmul.

Every other kernel is tested against this one, and ONNX export follows the same arithmetic.
"""

from __future__ import annotations

import torch

from llmeasyquant.kernels.scopes import LOAD_WEIGHTS, QUANTIZE_ACTIVATIONS, scope
from llmeasyquant.primitives import dequantize, quantize


def quantize_activation(layer, x: torch.Tensor) -> torch.Tensor:
    """x as the integer kernels see it: rounded to the activation scheme's grid (identity when A16)."""
    act = layer.scheme.act
    if act is None:
        return x
    with scope(QUANTIZE_ACTIVATIONS):
        qp = layer.activation_qparams(x)
        return dequantize(quantize(x, qp, act.bits), qp)


class ReferenceKernel:
    name = "reference"

    def supports(self, layer) -> bool:
        return True

    def prepare(self, layer) -> None:
        return None

    def run(self, layer, x: torch.Tensor, prepared: None) -> torch.Tensor:
        with scope(LOAD_WEIGHTS):
            weight = layer.dequantize()
        return quantize_activation(layer, x) @ weight.t()
