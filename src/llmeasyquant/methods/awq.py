"""AWQ (Lin et al. 2024): activation-aware per-input-channel scaling and weight clipping, then any quantizer.

Both searches minimise the quantized linear's output error on the calibration inputs, computed from the Gram
matrix H = Σ x xᵀ of one pass over the block (‖X Δᵀ‖² = tr(Δ H Δᵀ)), so no activations are kept:
- scales: for each group of linears reading one input, s = m^r with m the RMS of each input channel and r on a grid
  in [0, 1); r = 0 is plain rounding, so the search never makes the layers worse. s is folded into the source as
  SmoothQuant folds its scales;
- clipping: for each output row and weight group, the range is shrunk by a ratio in [min_clip, 1] on a grid.
The weights stay float; the quantizer that follows (RTN, or GPTQ) rounds them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from llmeasyquant.infra import distributed
from llmeasyquant.methods.base import BlockContext, Transform, block_input_stats, short_of_tokens
from llmeasyquant.methods.smoothquant import float_readers, fold_scales, foldable, smoothable_pairs
from llmeasyquant.models.arch import linear_weight
from llmeasyquant.primitives import expand_groups, fake_quantize, group_ranges
from llmeasyquant.scheme import PerTensor, QuantScheme


@dataclass(frozen=True)
class AWQ(Transform):
    grid: int = 20
    clip: bool = True
    clip_grid: int = 20
    min_clip: float = 0.5
    # Layers that read fewer calibration tokens (experts the router sent few or none) keep their weights: no scale
    # search for a group whose inputs they read, no clipping; the fallback is named in the log and the checkpoint.
    min_tokens: int = 16

    name: ClassVar[str] = "awq"
    needs_calibration: ClassVar[bool] = True
    default_scheme: ClassVar[str] = "w4a16-g128-asym"  # what --method awq quantizes to when no scheme is given
    input_stats: ClassVar[frozenset[str]] = frozenset({"hessian"})
    float_path: ClassVar[bool] = False

    @torch.no_grad()
    def apply(self, block: nn.Module, ctx: BlockContext) -> None:
        stats = block_input_stats(block, ctx, self.input_stats)
        ctx.input_stats = None  # clipping changes what later linears of the block read: not followed exactly
        routed = ctx.arch.routed
        groups = [(src, list(targets)) for src, targets in smoothable_pairs(ctx)
                  if all(t in ctx.plan for t in targets) and foldable(block, src, list(targets))
                  and not short_of_tokens(ctx, stats.pooled(targets, routed), [targets[0]], self.min_tokens,
                                          self.name, "no scaling")]
        # Under torch.distributed each search runs on one rank (balanced by cost) and its result is broadcast; in
        # one process rank 0 owns them all. A group's search reads only its targets' weights and inputs, which
        # no other group's folding touches, so the searches can all run before any scale is folded.
        owners = distributed.assign([_cost(block, targets) for _, targets in groups], distributed.world())
        found = {i: search_scales({t: linear_weight(block.get_submodule(t)).detach().float() for t in targets},
                                  stats.pooled(targets, routed).hessian[targets[0]], {t: ctx.plan[t] for t in targets},
                                  self.grid)
                 for i, ((_, targets), owner) in enumerate(zip(groups, owners, strict=True))
                 if owner == distributed.rank()}
        for i, ((src, targets), owner) in enumerate(zip(groups, owners, strict=True)):
            scales = found.get(i, torch.empty(linear_weight(block.get_submodule(targets[0])).shape[1]))
            distributed.broadcast_(scales, owner)
            fold_scales(block.get_submodule(src), [block.get_submodule(t) for t in targets], scales,
                        float_readers(block, ctx.arch, src), ctx.arch.norm_offset)
            stats = stats.divided(targets, scales)  # the targets now read x / s
        if self.clip:
            names = [n for n in ctx.plan
                     if not short_of_tokens(ctx, stats, [n], self.min_tokens, self.name, "no clipping")]
            owners = distributed.assign([_cost(block, [n]) for n in names], distributed.world())
            for name, owner in zip(names, owners, strict=True):
                if owner == distributed.rank():
                    weight = linear_weight(block.get_submodule(name))
                    weight.copy_(search_clip(weight.detach().float(), stats.hessian[name], ctx.plan[name],
                                             self.clip_grid, self.min_clip).to(weight.dtype))
            for name, owner in zip(names, owners, strict=True):
                distributed.broadcast_(block.get_submodule(name).weight.data, owner)  # the stored layout


def _cost(block: nn.Module, names: list[str]) -> float:
    """Relative cost of a search over these layers: their weights times their input width."""
    return float(sum(linear_weight(block.get_submodule(n)).numel() * linear_weight(block.get_submodule(n)).shape[1]
                     for n in names))


def output_error(weight: torch.Tensor, approx: torch.Tensor, h: torch.Tensor) -> float:
    """‖X (W - Ŵ)ᵀ‖² up to the constant of H, from the Gram matrix H [in, in].

    Row by row (a reduction along the last axis), then math.fsum: a whole-tensor sum is split by thread count, and
    the search's argmin must not depend on how many threads the rank that runs it has."""
    delta = weight - approx
    return math.fsum(((delta @ h) * delta).sum(-1).tolist())


def _rounded(weight: torch.Tensor, scheme: QuantScheme) -> torch.Tensor:
    return fake_quantize(weight, scheme.bits, scheme.symmetric, scheme.granularity, scale_dtype=torch.float16,
                         grid=scheme.grid)


def search_scales(weights: dict[str, torch.Tensor], h: torch.Tensor, schemes: dict[str, QuantScheme],
                  grid: int) -> torch.Tensor:
    """Per-input-channel scales [in] minimising the summed output error of the linears after rounding."""
    magnitude = torch.diag(h).clamp(min=0).sqrt().clamp(min=1e-8)  # RMS of each input channel (up to a constant)
    best, best_err = torch.ones_like(magnitude), None
    for step in range(grid):
        ratio = step / grid
        s = magnitude.pow(ratio)
        s = s / (s.max() * s.min()).sqrt()  # centred in log space so that weights and inputs share the change
        err = math.fsum(output_error(w, _rounded(w * s, schemes[n]) / s, h) for n, w in weights.items())
        if best_err is None or err < best_err:
            best, best_err = s, err
    return best


def search_clip(weight: torch.Tensor, h: torch.Tensor, scheme: QuantScheme, grid: int,
                min_clip: float) -> torch.Tensor:
    """The weight with each (row, group) range shrunk by the ratio that minimises its output error."""
    if isinstance(scheme.granularity, PerTensor):
        return weight
    rows, cols = weight.shape
    lo, hi, width = group_ranges(weight, scheme.granularity)  # [rows, groups]
    if scheme.symmetric:
        lo = torch.minimum(lo, -hi)
        hi = -lo
    starts = range(0, cols, width)
    best_err = torch.full_like(lo, float("inf"))
    best_ratio = torch.ones_like(lo)
    for ratio in torch.linspace(1.0, min_clip, grid).tolist():
        clipped = torch.clamp(weight, expand_groups(lo * ratio, width, rows, cols),
                              expand_groups(hi * ratio, width, rows, cols))
        delta = weight - _rounded(clipped, scheme)
        err = torch.stack([((delta[:, g:g + width] @ h[g:g + width, g:g + width]) * delta[:, g:g + width]).sum(-1)
                           for g in starts], dim=1)  # [rows, groups]: each group with its own inputs
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_ratio = torch.where(better, torch.full_like(best_ratio, ratio), best_ratio)
    return torch.clamp(weight, expand_groups(lo * best_ratio, width, rows, cols),
                       expand_groups(hi * best_ratio, width, rows, cols))
