"""SmoothQuant (Xiao et al. 2023): move activation outliers into the weights before W8A8 quantization.

For each (source -> linears) pair of the architecture table, per input channel j:
    s_j = max|X_j|^α / max|W_j|^(1-α)
the linears' input columns are multiplied by s and the source (a norm's scale and bias, or the output rows of a
preceding linear) divided by s, so the float function is unchanged and the activations are flatter.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from llmeasyquant.errors import ConfigError
from llmeasyquant.methods.base import BlockContext, Transform, block_input_stats, short_of_tokens
from llmeasyquant.methods.rtn import RTN
from llmeasyquant.methods.stats import InputStats, calibrate_static_inputs, relative_error, run_block
from llmeasyquant.models.arch import ArchSpec, is_linear, linear_weight
from llmeasyquant.nn.transform import input_transform_of

log = logging.getLogger(__name__)

Pairs = list[tuple[str, tuple[str, ...]]]


@dataclass(frozen=True)
class SmoothQuant(Transform):
    """`alpha` in [0, 1], or "auto": per block, the value of `alpha_grid` whose smoothed, W8A8-rounded block is
    closest to the float block on the first `search_samples` calibration samples."""

    alpha: float | str = 0.5
    alpha_grid: tuple[float, ...] = (0.3, 0.4, 0.5, 0.6, 0.7, 0.75, 0.8, 0.85, 0.9)
    search_samples: int = 16
    # A pair whose linears read fewer calibration tokens (an expert the router sent few or none) is not smoothed;
    # the fallback is named in the log and the checkpoint.
    min_tokens: int = 16

    name: ClassVar[str] = "smoothquant"
    needs_calibration: ClassVar[bool] = True
    default_scheme: ClassVar[str] = "w8a8"  # what --method smoothquant quantizes to when no scheme is given
    input_stats: ClassVar[frozenset[str]] = frozenset({"range"})
    float_path: ClassVar[bool] = False

    def __post_init__(self) -> None:
        if self.alpha == "auto":
            if not self.alpha_grid or not all(0.0 <= a <= 1.0 for a in self.alpha_grid):
                raise ConfigError(f"SmoothQuant alpha_grid must hold values in [0, 1], got {self.alpha_grid}")
            if self.search_samples < 1:
                raise ConfigError(f"SmoothQuant search_samples must be 1 or more, got {self.search_samples}")
        elif isinstance(self.alpha, str) or not 0.0 <= self.alpha <= 1.0:
            raise ConfigError(f"SmoothQuant alpha must lie in [0, 1] or be 'auto', got {self.alpha!r}; "
                              "0.5 is the usual choice")

    @torch.no_grad()
    def apply(self, block: nn.Module, ctx: BlockContext) -> None:
        pairs = [(src, targets) for src, targets in smoothable_pairs(ctx) if any(t in ctx.plan for t in targets)]
        pairs = [(src, targets) for src, targets in pairs if foldable(block, src, targets)]
        if not pairs:
            return
        stats = block_input_stats(block, ctx, self.input_stats)
        pairs = [(src, targets) for src, targets in pairs
                 if not short_of_tokens(ctx, stats.pooled(targets, ctx.arch.routed), [targets[0]], self.min_tokens,
                                        self.name, "not smoothed")]
        if not pairs:
            return
        alpha = self.alpha if self.alpha != "auto" else self._search_alpha(block, ctx, pairs, stats)
        # The statistics follow the smoothing exactly, so the quantizer after us needs no pass of its own.
        ctx.input_stats = smooth(block, pairs, stats, alpha, ctx.arch)

    def _search_alpha(self, block: nn.Module, ctx: BlockContext, pairs: Pairs, stats: InputStats) -> float:
        """Try each alpha on a copy of the block, rounded to nearest with the block's schemes, on the first
        `search_samples` calibration samples of all (those of them this rank holds, under torch.distributed)."""
        ids = ctx.sample_ids if ctx.sample_ids is not None else list(range(len(ctx.inputs)))
        chosen = [i for i, sample in enumerate(ids) if sample < self.search_samples]
        inputs, kwargs = [ctx.inputs[i] for i in chosen], [ctx.kwargs[i] for i in chosen]
        reference = ([ctx.reference_outputs[i] for i in chosen] if ctx.reference_outputs
                     else run_block(block, inputs, kwargs))
        errors = {}
        for alpha in self.alpha_grid:
            trial = copy.deepcopy(block)
            trial_stats = smooth(trial, pairs, stats, alpha, ctx.arch)
            RTN().apply(trial, ctx)
            calibrate_static_inputs(trial, trial_stats, inputs, kwargs, ctx.arch.routed)
            errors[alpha] = relative_error(run_block(trial, inputs, kwargs), reference)
        best = min(errors, key=errors.__getitem__)
        log.debug("block %d: SmoothQuant output error by alpha %s -> %.2f", ctx.index, errors, best)
        ctx.stats["alpha"] = best
        return best


def smoothable_pairs(ctx: BlockContext) -> Pairs:
    """The family's smoothing pairs less those whose source cannot take a scale (the table says why; logged once,
    on the first block)."""
    skipped = dict(ctx.arch.unsmoothable)
    for src, reason in skipped.items():
        log.log(logging.INFO if ctx.index == 0 else logging.DEBUG,
                "%s: no smoothing scales folded into %s (%s)", ctx.arch.family, src, reason)
    return [(src, targets) for src, targets in ctx.arch.smoothing if src not in skipped]


def smooth(block: nn.Module, pairs: Pairs, stats: InputStats, alpha: float, arch: ArchSpec) -> InputStats:
    """Fold the smoothing scales of every pair into `block`; the input statistics after it."""
    for src, targets in pairs:
        scales = smoothing_scales(stats.pooled(targets, arch.routed).absmax[targets[0]],
                                  [linear_weight(block.get_submodule(t)) for t in targets], alpha)
        fold_scales(block.get_submodule(src), [block.get_submodule(t) for t in targets], scales,
                    float_readers(block, arch, src), arch.norm_offset)
        stats = stats.divided(list(targets), scales)
    return stats


def float_readers(block: nn.Module, arch: ArchSpec, src: str) -> list[nn.Module]:
    """The float modules besides the targets that read `src` (a MoE router reading the post-attention norm)."""
    return [block.get_submodule(name) for source, names in arch.float_readers if source == src for name in names]


def foldable(block: nn.Module, src: str, targets: tuple[str, ...]) -> bool:
    """A linear source must feed the targets channel for channel (not so under grouped-query attention), and no
    target may transform its input online (rotate's Hadamard on the down-projection mixes the channels that a
    scale folded into the source would divide)."""
    if any(input_transform_of(block.get_submodule(t)) is not None for t in targets):
        return False
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


def fold_scales(source: nn.Module, targets: list[nn.Module], scales: torch.Tensor,
                readers: list[nn.Module] = (), norm_offset: float = 0.0) -> None:
    """targets' input columns *= s; source's output /= s (norm scale and bias, or a linear's output rows); `readers`
    (float modules that read the source too, with a `weight` [out, in]: a MoE router) keep their function. A norm
    that scales by (norm_offset + w) gets w <- (norm_offset + w) / s - norm_offset (Gemma's 1 + w)."""
    for target in targets:
        weight = linear_weight(target)  # [out, in], a view for GPT-2's Conv1D: updated in place
        weight.mul_(scales.to(weight.dtype)[None, :])
    for reader in readers:
        reader.weight.mul_(scales.to(reader.weight.dtype)[None, :])
    if is_linear(source):
        linear_weight(source).div_(scales.to(source.weight.dtype)[:, None])
    elif norm_offset:
        # In float64: with the offset, w is a small difference of large numbers.
        effective = (source.weight.double() + norm_offset) / scales.double()
        source.weight.copy_((effective - norm_offset).to(source.weight.dtype))
    else:
        source.weight.div_(scales.to(source.weight.dtype))
    if getattr(source, "bias", None) is not None:
        source.bias.div_(scales.to(source.bias.dtype))
