"""What a method is: a frozen dataclass subclassing one of the recipe step types below.

A recipe is `Transform`s, then exactly one `Quantizer` (both work on one block at a time), plus at most one
`CacheMethod` for the KV cache; `quantize()` tells them apart by type. A `ModelTransform` (a rotation) is a
transform that rewrites the whole model once before the blocks are calibrated.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from llmeasyquant.methods.stats import InputStats, collect_input_stats
from llmeasyquant.models.arch import ArchSpec, linear_weight
from llmeasyquant.nn.qlinear import QuantLinear
from llmeasyquant.nn.transform import carry_input_transform
from llmeasyquant.scheme import QuantScheme

if TYPE_CHECKING:
    from llmeasyquant.nn.kv.cache import KVCacheSpec

log = logging.getLogger(__name__)


@dataclass
class BlockContext:
    """Everything a method may know about the block in hand; nothing about the rest of the model."""

    index: int
    prefix: str  # the block's dotted name plus '.', e.g. 'model.layers.3.'
    plan: dict[str, QuantScheme]  # block-relative linear name -> scheme
    arch: ArchSpec
    # Calibration inputs of this block (hidden states per batch) and the keyword arguments the model passed to
    # it; None when no method of the recipe needs calibration.
    inputs: list[torch.Tensor] | None = None
    kwargs: list[dict[str, Any]] | None = None
    # The index of each of `inputs` among all the calibration samples (under torch.distributed a rank holds a
    # share): a method that uses some of the samples picks them by these, so every rank count picks the same ones.
    sample_ids: list[int] | None = None
    stats: dict[str, float] = field(default_factory=dict)  # what the method wants shown in progress
    # Statistics of the block's inputs under its current weights; a method that changes weights resets it to None.
    input_stats: InputStats | None = None
    reference_outputs: list[torch.Tensor] | None = None  # the float block's outputs on `inputs`
    # For methods with `float_path`: this block's inputs in the unquantized model, and the float block's outputs on
    # them (what layer-by-layer distillation matches).
    float_inputs: list[torch.Tensor] | None = None
    float_outputs: list[torch.Tensor] | None = None
    # Block-relative linear name -> what a method did instead for it, when its calibration tokens were too few
    # (a mixture of experts' expert that the router sent few or none): kept in the checkpoint's metadata.
    fallbacks: dict[str, list[str]] = field(default_factory=dict)


class Method(ABC):
    """A recipe step that works on one block at a time; a method subclasses `Transform` or `Quantizer`."""

    name: ClassVar[str]
    needs_calibration: ClassVar[bool]
    default_scheme: ClassVar[str]  # scheme name used when the caller gives none (AWQ: w4a16-g128-asym)
    input_stats: ClassVar[frozenset[str]]  # statistics of its block's inputs it reads: "hessian", "range"
    float_path: bool  # reads the unquantized model's activations too (the runner then carries them)

    @abstractmethod
    def apply(self, block: nn.Module, ctx: BlockContext) -> None: ...


class Transform(Method):
    """Rewrites a block's float weights and keeps them float (SmoothQuant, AWQ); a recipe's transforms come first."""


class ModelTransform(Transform):
    """Rewrites the whole float model once, before any block is calibrated (a rotation of the residual stream:
    embeddings, every block and the head change together). Its per-block `apply` does nothing."""

    needs_calibration: ClassVar[bool] = False
    input_stats: ClassVar[frozenset[str]] = frozenset()
    float_path: ClassVar[bool] = False

    @abstractmethod
    def apply_model(self, model: nn.Module, arch: ArchSpec) -> None: ...

    def apply(self, block: nn.Module, ctx: BlockContext) -> None:
        return None


class Quantizer(Method):
    """Swaps a block's linear layers for QuantLinear (RTN, GPTQ, ZeroQuant); a recipe ends with exactly one."""

    @property
    def solves_apart(self) -> bool:
        """Whether each layer's solve reads only the block's statistics as the runner hands them, so that under
        torch.distributed the layers can be shared out over ranks (calibration/shared_solves.py). A quantizer
        that passes over the block again (GPTQ's true-sequential groups, GPTAQ, ZeroQuant's distillation) runs
        whole on every rank instead: its passes' sums are exact over ranks, so every rank makes the same layers."""
        return True


class CacheMethod(ABC):
    """Calibrates a quantized KV cache on the whole quantized model (SimQuant); a recipe holds at most one."""

    name: ClassVar[str]

    @abstractmethod
    def calibrate(self, model: nn.Module, calib: torch.Tensor | None, progress: bool = True) -> KVCacheSpec: ...


Step = Method | CacheMethod  # what a recipe holds


def rtn_quant_linear(module: nn.Module, scheme: QuantScheme, name: str) -> QuantLinear:
    """Round-to-nearest QuantLinear from a linear-like module (nn.Linear or GPT-2's Conv1D), with the module's online
    input transform if it has one."""
    weight = linear_weight(module).detach()
    bias = module.bias.detach() if getattr(module, "bias", None) is not None else None
    return carry_input_transform(module, QuantLinear.from_weight(weight, bias, scheme, name=name))


def block_input_stats(block: nn.Module, ctx: BlockContext, want: frozenset[str]) -> InputStats:
    """The statistics of the block's linear inputs: those the runner gathered, or one pass now if weights changed
    or the runner did not gather what `want` names."""
    if ctx.input_stats is None or not want <= ctx.input_stats.kinds:
        ctx.input_stats, _ = collect_input_stats(block, list(ctx.plan), ctx.inputs, ctx.kwargs, want=want,
                                                 routed=ctx.arch.routed)
    return ctx.input_stats


def short_of_tokens(ctx: BlockContext, stats: InputStats, names: list[str], min_tokens: int, method: str,
                    fallback: str) -> bool:
    """Whether any of `names` read fewer than `min_tokens` calibration tokens (only an expert of a mixture of
    experts can: every other linear reads every token). Each such layer's fallback is logged and noted in
    `ctx.fallbacks`, which the checkpoint keeps."""
    short = [n for n in names if stats.tokens.get(n, 0) < min_tokens]
    for name in short:
        note = f"{method}: {stats.tokens.get(name, 0)} calibration tokens (fewer than {min_tokens}), {fallback}"
        ctx.fallbacks.setdefault(name, []).append(note)
        log.warning("%s%s: %s", ctx.prefix, name, note)
    return bool(short)
