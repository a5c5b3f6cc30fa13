"""A decode step's block as one native call (`decode_block`, kernels/native/decode_block.cpp) where each of its four
linears runs, for one row, a kernel whose work is one or two native operators: W4A16's digits kernel, the native
W8A16 kernel (symmetric weights) or the native W8A8 kernel. The operators of the lean loop's fused path run in its
order without the Python between them (4.6-6.6 ms of a 142-145 ms token on the 8B shape in W4A16,
docs/RESULTS.md), so the logits are the Python loop's bit for bit (tested).

`block_arguments(block)` gathers what the call reads; None where any linear is something else (another kernel
chosen for one row, an input transform, hooks that must run, members not fused into one GEMM, clipped activations
or sink tokens): that block steps on the Python loop as before."""

from __future__ import annotations

from collections.abc import Callable

import torch

from llmeasyquant.nn.qlinear import QuantLinear
from llmeasyquant.primitives import MIN_SCALE
from llmeasyquant.runtime.model_parts import NO_NORM, Block

BlockArguments = tuple[list[torch.Tensor | None], list[int], list[int], list[float], float]


def linear_arguments(linear: Callable[[torch.Tensor], torch.Tensor]) -> tuple[int, list[torch.Tensor | None]] | None:
    """(kind, [codes, scales, zeros or code sums, bias]) when calling the block's callable on one row is exactly one
    of decode_block's kinds plus the bias: a QuantLinear's bound `forward` with nothing transforming its input."""
    layer = getattr(linear, "__self__", None)
    if (not isinstance(layer, QuantLinear) or getattr(linear, "__func__", None) is not QuantLinear.forward
            or layer.input_transform is not None or layer.shared is not None):
        return None
    act = layer.scheme.act
    if act is not None and (act.sinks or act.clips):  # QuantLinear changes such inputs before the kernel
        return None
    kernel = layer.kernel(1)
    if getattr(kernel, "decode_block_kind", None) is None or not kernel.in_decode_block(layer):
        return None
    return kernel.decode_block_kind, [*kernel.decode_block_tensors(layer, layer.prepared_for(kernel)), layer.bias]


def block_arguments(block: Block) -> BlockArguments | None:
    """(tensors, kinds, group sizes, epsilons, min_scale) as `decode_block` takes them, or None where the block does
    not qualify."""
    linears = [block.qkv, block.o, block.gate_up, block.down]
    found = [linear_arguments(linear) for linear in linears]
    if any(arguments is None for arguments in found):
        return None
    q_norm, k_norm = block.qk_norm or (NO_NORM, NO_NORM)
    tensors: list[torch.Tensor | None] = [block.attn_norm.weight, block.mlp_norm.weight, q_norm.weight, k_norm.weight]
    for _, parts in found:
        tensors += parts
    kinds = [kind for kind, _ in found]
    group_sizes = [linear.__self__.group_size for linear in linears]
    epsilons = [block.attn_norm.eps, block.mlp_norm.eps, q_norm.eps, k_norm.eps]
    return tensors, kinds, group_sizes, epsilons, MIN_SCALE
