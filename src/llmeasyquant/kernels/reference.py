"""The oracle every other kernel is tested against.

Weight-only layers: dequantize the weight, then a float32 matmul (ONNX export follows the same arithmetic).
Layers with quantized activations: the integer product, exactly. Codes minus zero points are multiplied and summed
in float64, where every partial sum is an integer below 2^53, so the sum has no rounding error whatever the order.
It is then scaled in float32 in the integer kernels' order (sum, times the activation scale, times the weight
scale), so an integer kernel that accumulates exactly in int32 gives the same bits. A float product of dequantized
values would differ from every integer kernel in the last bit, and a last-bit change before the next layer's
activation rounding flips codes downstream.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from llmeasyquant.kernels.kernel import StepCall
from llmeasyquant.kernels.scopes import LOAD_WEIGHTS, QUANTIZE_ACTIVATIONS, scope
from llmeasyquant.primitives import expand_groups, grouped_view, quantize


def _centred(codes: torch.Tensor, zero: torch.Tensor | None, width: int) -> torch.Tensor:
    """codes [rows, cols] minus their zero points [rows or 1, groups], as float64 integers."""
    rows, cols = codes.shape
    values = codes.double()
    return values if zero is None else values - expand_groups(zero.double(), width, rows, cols)


def integer_product(layer, x: torch.Tensor) -> torch.Tensor:
    """y [tokens, out] of a layer with quantized activations, from x [tokens, in]."""
    act = layer.scheme.act
    with scope(QUANTIZE_ACTIVATIONS):
        qp = layer.activation_qparams(x)
        qx = quantize(x, qp, act.bits)
    dx = _centred(qx, qp.zero, qp.group_size)  # [tokens, in]; per token, per tensor or per token per group
    with scope(LOAD_WEIGHTS):
        dw = _centred(layer.codes(), layer.zeros, layer.group_size)  # [out, in]
    if layer.scales.shape[1] == 1:
        x_scale = qp.scale.expand(x.shape[0], 1)  # [tokens, 1]
        return torch.mul((dx @ dw.t()).float(), x_scale) * layer.scales[:, 0].float()[None, :]
    # Group-wise weights: one exact integer sum per group, scaled per group, then summed.
    per_group = torch.einsum("tgk,ogk->tgo", grouped_view(dx, layer.group_size),
                             grouped_view(dw, layer.group_size))
    if act.group_size is not None:  # activation groups are the weights' groups (the scheme checks): both scales
        both = qp.scale.float()[:, :, None] * layer.scales.float().t()[None, :, :]  # [tokens, groups, out]
        return (per_group.float() * both).sum(dim=1)
    x_scale = qp.scale.expand(x.shape[0], 1)  # [tokens, 1]
    return torch.mul(torch.einsum("tgo,og->to", per_group.float(), layer.scales.float()), x_scale)


# Inside held_weights(): id(layer) -> (the layer, its dequantized weight). The layer is held too, so that its id
# cannot pass to another object while the entry lives.
_HELD: list[dict[int, tuple[object, torch.Tensor]]] = []


@contextlib.contextmanager
def held_weights() -> Iterator[None]:
    """Inside: a weight-only layer that this kernel runs is dequantized once and its float weight kept until the
    outermost exit, instead of dequantized on every call. For calibration, which runs each quantized block over
    every batch (an 8B block's seven layers took 1.3 s a batch to dequantize, longer than their GEMMs): the same
    dequantization, so the same bits, for the float weights of the layers run held meanwhile."""
    if _HELD:  # nested: the outer context's weights serve
        yield
        return
    _HELD.append({})
    try:
        yield
    finally:
        _HELD.clear()


def _weight(layer) -> torch.Tensor:
    if not _HELD:
        return layer.dequantize()
    held = _HELD[0].get(id(layer))
    if held is None:
        held = _HELD[0][id(layer)] = (layer, layer.dequantize())
    return held[1]


class ReferenceKernel:
    name = "reference"

    def supports(self, layer) -> bool:
        return True

    def prepare(self, layer) -> None:
        return None

    def run(self, layer, x: torch.Tensor, prepared: None) -> torch.Tensor:
        if layer.scheme.act is not None:
            return integer_product(layer, x)
        with scope(LOAD_WEIGHTS):
            weight = _weight(layer)
        return x @ weight.t()

    def step_call(self, layer, prepared: None, rows: int) -> StepCall | None:
        """Weight-only layers of uniform 8- or 4-bit codes: the same dequantization, then the fp32 GEMM (the 4-bit
        codes through the native dequantizer, which gives this kernel's fp32 weight bit for bit). Layers with
        quantized activations sum in float64 here, an oracle, never a step."""
        if layer.scheme.act is not None or layer.scheme.grid is not None or layer.scheme.bits not in (4, 8):
            return None
        zeros = None if layer.zeros is None else layer.zeros.to(torch.int32)
        if layer.scheme.bits == 8:
            return StepCall("int8_dequant", (layer.qweight, layer.scales.float(), zeros))
        return StepCall("int4_dequant", (layer.qweight, layer.scales.float().contiguous(),
                                         None if zeros is None else zeros.float().contiguous()))
