"""ZeroQuant (Yao et al. 2022): group-wise weights, dynamic per-token activations, and layer-by-layer knowledge
distillation (LKD).

LKD trains the block's float weights so that the block, run with quantized weights and activations, matches the
unquantized block's outputs on the same inputs. Rounding is bypassed in the backward pass (straight-through
estimator). The trained weights are then rounded to nearest into QuantLinear layers.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from llmeasyquant.errors import ConfigError
from llmeasyquant.methods.base import BlockContext, rtn_quant_linear
from llmeasyquant.models.arch import linear_weight, set_module
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
        weight = linear_weight(self.inner)
        weight = _straight_through(weight, fake_quantize(weight.detach(), s.bits, s.symmetric, s.granularity,
                                                         scale_dtype=torch.float16))
        if s.act is not None:
            x = _straight_through(x, fake_quantize(x.detach(), s.act.bits, s.act.symmetric, s.act.granularity))
        return nn.functional.linear(x, weight, getattr(self.inner, "bias", None))


@dataclass(frozen=True)
class ZeroQuant:
    lkd: bool = True
    steps: int = 50
    lr: float = 5e-5

    name: ClassVar[str] = "zeroquant"
    kind: ClassVar[str] = "quantizer"
    needs_calibration: ClassVar[bool] = True
    input_stats: ClassVar[frozenset[str]] = frozenset()

    def __post_init__(self) -> None:
        if self.steps < 0 or self.lr <= 0:
            raise ConfigError(f"ZeroQuant needs steps >= 0 and lr > 0, got steps={self.steps}, lr={self.lr}")

    def apply(self, block: nn.Module, ctx: BlockContext) -> None:
        if self.lkd and self.steps and ctx.reference_outputs is not None:
            loss = self._distill(block, ctx)
            ctx.stats["lkd_loss"] = loss
        ctx.input_stats = None
        for rel_name, scheme in ctx.plan.items():
            layer = rtn_quant_linear(block.get_submodule(rel_name), scheme, ctx.prefix + rel_name)
            set_module(block, rel_name, layer)

    def _distill(self, block: nn.Module, ctx: BlockContext) -> float:
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
                    i = step % len(ctx.inputs)
                    out = block(ctx.inputs[i], **ctx.kwargs[i])
                    out = out[0] if isinstance(out, tuple | list) else out
                    loss = nn.functional.mse_loss(out, ctx.reference_outputs[i])
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
