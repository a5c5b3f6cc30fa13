"""Under torch.distributed: a block's layer solves shared out across ranks by cost, then every quantized layer
broadcast from the rank that solved it, so all ranks hold the same quantized block before the next one starts."""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from llmeasyquant.infra import distributed
from llmeasyquant.methods.base import BlockContext, Method, block_input_stats
from llmeasyquant.models.arch import linear_weight, set_module
from llmeasyquant.nn.qlinear import QuantLinear
from llmeasyquant.nn.transform import carry_input_transform


def solve_cost(module: nn.Module) -> float:
    """Relative cost of quantizing a layer: GPTQ's column updates take rows × columns² operations."""
    rows, cols = linear_weight(module).shape
    return float(rows) * cols * cols


def _empty_quant_linear(module: nn.Module, scheme) -> QuantLinear:
    """The QuantLinear a broadcast fills: right shapes and scheme, contents to come from the owner."""
    rows, cols = linear_weight(module).shape
    bias = getattr(module, "bias", None)
    layer = QuantLinear(cols, rows, scheme, bias is not None, bias.dtype if bias is not None else torch.float32)
    return carry_input_transform(module, layer)


def apply_shared(method: Method, block: nn.Module, ctx: BlockContext) -> None:
    """Run quantizer `method` (one whose layers solve apart: `Quantizer.solves_apart`) on this rank's share of the
    block's layers and exchange the results."""
    if method.input_stats:
        # A collective: every rank gathers the statistics of the whole plan before the plan is split.
        ctx.input_stats = block_input_stats(block, ctx, method.input_stats)
    names = list(ctx.plan)
    owners = distributed.assign([solve_cost(block.get_submodule(n)) for n in names], distributed.world())
    mine = {n: ctx.plan[n] for n, owner in zip(names, owners, strict=True) if owner == distributed.rank()}
    method.apply(block, dataclasses.replace(ctx, plan=mine))
    for name, owner in zip(names, owners, strict=True):
        if owner != distributed.rank():
            set_module(block, name, _empty_quant_linear(block.get_submodule(name), ctx.plan[name]))
        layer = block.get_submodule(name)
        for _, buffer in sorted(layer.named_buffers()):
            distributed.broadcast_(buffer, owner)
        layer.forget_kernel()
