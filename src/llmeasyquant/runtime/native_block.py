"""A decode step's block as one native call (`decode_block`, kernels/native/decode_block.cpp) where its four linears
all run W4A16's digits kernel: the operators of the lean loop's fused path, in its order, without the Python between
them (6.6 ms of a 142.5 ms token on the 8B shape, docs/RESULTS.md). The same bits as the Python loop (tested).

`block_arguments(block)` gathers what the call reads; None where any linear is something else (another kernel
chosen for one row, an input transform, hooks that must run, members not fused into one GEMM, activation
quantization): that block steps on the Python loop as before."""

from __future__ import annotations

from collections.abc import Callable

import torch

from llmeasyquant.kernels.cpu import NativeInt4DigitsKernel
from llmeasyquant.nn.qlinear import QuantLinear
from llmeasyquant.runtime.model_parts import NO_NORM, Block

BlockArguments = tuple[list[torch.Tensor | None], list[int], list[float]]


def digits_layer(linear: Callable[[torch.Tensor], torch.Tensor]) -> QuantLinear | None:
    """The QuantLinear behind a block's callable when calling it is exactly the digits kernel on one row (plus the
    bias): its bound `forward`, nothing transforming the input, no activation quantization."""
    layer = getattr(linear, "__self__", None)
    if (not isinstance(layer, QuantLinear) or getattr(linear, "__func__", None) is not QuantLinear.forward
            or layer.input_transform is not None or layer.shared is not None or layer.scheme.act is not None):
        return None
    return layer if layer.kernel(1).name == NativeInt4DigitsKernel.name else None


def block_arguments(block: Block) -> BlockArguments | None:
    """(tensors, group sizes, epsilons) as `decode_block` takes them, or None where the block does not qualify."""
    layers = [digits_layer(linear) for linear in (block.qkv, block.o, block.gate_up, block.down)]
    if any(layer is None for layer in layers):
        return None
    q_norm, k_norm = block.qk_norm or (NO_NORM, NO_NORM)
    tensors: list[torch.Tensor | None] = [block.attn_norm.weight, block.mlp_norm.weight, q_norm.weight, k_norm.weight]
    for layer in layers:
        prepared = layer.prepared_for(layer.kernel(1))
        tensors += [layer.qweight, prepared["scales"], prepared["zeros"], layer.bias]
    epsilons = [block.attn_norm.eps, block.mlp_norm.eps, q_norm.eps, k_norm.eps]
    return tensors, [layer.group_size for layer in layers], epsilons
