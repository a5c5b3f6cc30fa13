"""SmoothQuant (Xiao et al. 2023): move activation outliers into the weights before W8A8 quantization.

For each (source -> linears) pair of the architecture table, per input channel j:
    s_j = max|X_j|^α / max|W_j|^(1-α)
the linears' input columns are multiplied by s and the source (a norm's scale and bias, or the output rows of a
preceding linear) divided by s, so the float function is unchanged and the activations are flatter.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from llmeasyquant.errors import ConfigError
from llmeasyquant.methods.base import BlockContext, block_input_stats
from llmeasyquant.models.arch import is_linear, linear_weight

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SmoothQuant:
    alpha: float = 0.5

    name: ClassVar[str] = "smoothquant"
    kind: ClassVar[str] = "transform"
    needs_calibration: ClassVar[bool] = True
    input_stats: ClassVar[frozenset[str]] = frozenset({"absmax"})

    def __post_init__(self) -> None:
        if not 0.0 <= self.alpha <= 1.0:
            raise ConfigError(f"SmoothQuant alpha must lie in [0, 1], got {self.alpha}; 0.5 is the usual choice")

    @torch.no_grad()
    def apply(self, block: nn.Module, ctx: BlockContext) -> None:
        pairs = [(src, targets) for src, targets in ctx.arch.smoothing if any(t in ctx.plan for t in targets)]
        pairs = [(src, targets) for src, targets in pairs if foldable(block, src, targets)]
        if not pairs:
            return
        absmax = block_input_stats(block, ctx, self.input_stats).absmax
        ctx.input_stats = None  # the weights change below
        for src, targets in pairs:
            scales = smoothing_scales(absmax[targets[0]], [linear_weight(block.get_submodule(t)) for t in targets],
                                      self.alpha)
            fold_scales(block.get_submodule(src), [block.get_submodule(t) for t in targets], scales)


def foldable(block: nn.Module, src: str, targets: tuple[str, ...]) -> bool:
    """A linear source must feed the targets channel for channel (not so under grouped-query attention)."""
    source = block.get_submodule(src)
    width = linear_weight(block.get_submodule(targets[0])).shape[1]
    if is_linear(source):
        return linear_weight(source).shape[0] == width
    return getattr(source, "weight", None) is not None and source.weight.shape[0] == width


def smoothing_scales(act_absmax: torch.Tensor, weights: list[torch.Tensor], alpha: float) -> torch.Tensor:
    """s [in] from the activations' and the weights' per-input-channel maxima; 1 where either is zero."""
    w_absmax = torch.stack([w.abs().amax(dim=0) for w in weights]).amax(dim=0).float()
    a = act_absmax.float()
    scales = a.pow(alpha) / w_absmax.pow(1 - alpha)
    bad = (a == 0) | (w_absmax == 0) | ~torch.isfinite(scales)
    return torch.where(bad, torch.ones_like(scales), scales).clamp(min=1e-5)


def fold_scales(source: nn.Module, targets: list[nn.Module], scales: torch.Tensor) -> None:
    """targets' input columns *= s; source's output /= s (norm scale and bias, or a linear's output rows)."""
    for target in targets:
        weight = linear_weight(target)  # [out, in], a view for GPT-2's Conv1D: updated in place
        weight.mul_(scales.to(weight.dtype)[None, :])
    if is_linear(source):
        linear_weight(source).div_(scales.to(source.weight.dtype)[:, None])
    else:
        source.weight.div_(scales.to(source.weight.dtype))
    if getattr(source, "bias", None) is not None:
        source.bias.div_(scales.to(source.bias.dtype))
