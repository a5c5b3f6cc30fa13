"""ZeroQuant (Yao et al. 2022): group-wise weights, dynamic per-token activations, and layer-by-layer knowledge
distillation (LKD).

LKD trains the block's float weights so that the block, run with quantized weights and activations, matches the
unquantized block's outputs on the same inputs: by default the unquantized model's activations, as in the paper
(`lkd_inputs="quantized"` trains on the quantized model's instead). Rounding is bypassed in the backward pass
(straight-through estimator). The trained weights are then rounded to nearest into QuantLinear layers.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from llmeasyquant.errors import ConfigError
from llmeasyquant.infra import distributed
from llmeasyquant.kernels.clipping import limit_activations
from llmeasyquant.methods.base import BlockContext, Quantizer, rtn_quant_linear
from llmeasyquant.methods.stats import first_output
from llmeasyquant.models.arch import linear_weight, set_module
from llmeasyquant.nn.transform import input_transform_of
from llmeasyquant.primitives import fake_quantize
from llmeasyquant.scheme import QuantScheme

log = logging.getLogger(__name__)


def _straight_through(x: torch.Tensor, rounded: torch.Tensor) -> torch.Tensor:
    """Forward: the rounded values; backward: the identity."""
    return x + (rounded - x).detach()


class _FakeQuantLinear(nn.Module):
    """Wraps a linear-like module: its weight and input rounded as the scheme says, gradients passed straight."""

    def __init__(self, inner: nn.Module, scheme: QuantScheme) -> None:
        super().__init__()
        self.inner, self.scheme = inner, scheme

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = self.scheme
        transform = input_transform_of(self.inner)  # the inner module's pre-hook does not run: it is not called
        if transform is not None:
            x = transform(x)
        weight = linear_weight(self.inner)
        weight = _straight_through(weight, fake_quantize(weight.detach(), s.bits, s.symmetric, s.granularity,
                                                         scale_dtype=torch.float16))
        if s.act is not None:
            clipped = limit_activations(x.detach(), s.act)
            x = _straight_through(x, fake_quantize(clipped, s.act.bits, s.act.symmetric, s.act.granularity))
        return nn.functional.linear(x, weight, getattr(self.inner, "bias", None))


@dataclass(frozen=True)
class ZeroQuant(Quantizer):
    lkd: bool = True
    steps: int = 50
    lr: float = 5e-5
    samples: int | None = None  # calibration samples LKD trains on (None: all)
    # "float": match the float block on the unquantized model's activations (the paper); "quantized": on the
    # quantized model's, so that each block also corrects the error of the blocks before it.
    lkd_inputs: str = "float"

    name: ClassVar[str] = "zeroquant"
    needs_calibration: ClassVar[bool] = True
    default_scheme: ClassVar[str] = "w4a8-g64"  # what --method zeroquant quantizes to when no scheme is given
    input_stats: ClassVar[frozenset[str]] = frozenset()

    def __post_init__(self) -> None:
        if self.steps < 0 or self.lr <= 0:
            raise ConfigError(f"ZeroQuant needs steps >= 0 and lr > 0, got steps={self.steps}, lr={self.lr}")
        if self.samples is not None and self.samples < 1:
            raise ConfigError(f"ZeroQuant samples must be 1 or more (or None for all), got {self.samples}")
        if self.lkd_inputs not in ("float", "quantized"):
            raise ConfigError(f"ZeroQuant lkd_inputs must be 'float' or 'quantized', got {self.lkd_inputs!r}")

    @property
    def float_path(self) -> bool:
        return self.lkd and self.steps > 0 and self.lkd_inputs == "float"

    @property
    def solves_apart(self) -> bool:
        return not (self.lkd and self.steps)  # distillation trains the block's layers together

    def apply(self, block: nn.Module, ctx: BlockContext) -> None:
        if self.lkd and self.steps and ctx.reference_outputs is not None:
            loss = self._distill(block, ctx)
            ctx.stats["lkd_loss"] = loss
        ctx.input_stats = None
        for rel_name, scheme in ctx.plan.items():
            layer = rtn_quant_linear(block.get_submodule(rel_name), scheme, ctx.prefix + rel_name)
            set_module(block, rel_name, layer)

    def _distill(self, block: nn.Module, ctx: BlockContext) -> float:
        if self.lkd_inputs == "float":
            inputs, targets = ctx.float_inputs, ctx.float_outputs
        else:
            inputs, targets = ctx.inputs, ctx.reference_outputs
        # Every rank trains on the same samples as one process would: the first `samples` of all of them, each
        # sent from the rank that holds it. Each is a whole sequence from position 0, so their keyword arguments
        # (positions, rotary tables, the causal mask) are the same: this rank's first serve for all.
        count = int(distributed.all_reduce(torch.tensor(len(inputs), dtype=torch.int64)))
        count = count if self.samples is None else min(self.samples, count)
        inputs, targets = distributed.gather_dealt(inputs, count), distributed.gather_dealt(targets, count)
        kwargs = [ctx.kwargs[0]] * count if distributed.active() else ctx.kwargs
        originals = {name: block.get_submodule(name) for name in ctx.plan}
        params = [m.weight for m in originals.values()]
        flags = {p: p.requires_grad for p in block.parameters()}
        for p in block.parameters():
            p.requires_grad_(False)  # only the quantized layers' weights are trained
        for name, module in originals.items():
            set_module(block, name, _FakeQuantLinear(module, ctx.plan[name]))
        optimizer = torch.optim.Adam(params, lr=self.lr)
        loss_value = float("nan")
        try:
            with torch.enable_grad():
                for p in params:
                    p.requires_grad_(True)
                for step in range(self.steps):
                    i = step % len(inputs)
                    out = first_output(block(inputs[i], **kwargs[i]))
                    loss = nn.functional.mse_loss(out, targets[i])
                    optimizer.zero_grad(set_to_none=True)
                    loss.backward()
                    optimizer.step()
                    loss_value = float(loss.detach())
        finally:
            for p, flag in flags.items():
                p.requires_grad_(flag)
            for name, module in originals.items():
                set_module(block, name, module)
        return loss_value
