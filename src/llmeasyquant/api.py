"""quantize(): resolve the plan, run the recipe block by block, quantize named layers outside the blocks."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from llmeasyquant.calibration.sequential import BlockReport, run_sequential
from llmeasyquant.errors import ConfigError
from llmeasyquant.methods.base import CacheMethod, Method, ModelTransform, Quantizer, Step, Transform, rtn_quant_linear
from llmeasyquant.models.arch import arch_for, get_module, linear_weight, set_module
from llmeasyquant.models.experts import unfuse_experts
from llmeasyquant.models.streaming import BlockStreamer
from llmeasyquant.nn.kv.cache import KVCacheSpec
from llmeasyquant.nn.positions import track_positions
from llmeasyquant.nn.qlinear import FULL_PRECISION_STATE, QuantLinear
from llmeasyquant.plan import Plan
from llmeasyquant.scheme import QuantScheme, parse_scheme

log = logging.getLogger(__name__)


@dataclass
class QuantizationInfo:
    """Attached to a quantized model as `model.llmeasyquant`; the checkpoint stores it."""

    recipe: list[dict]  # each method's name and options
    plan: dict
    float_dtype: str  # storage type of the tensors left unquantized: "float16" or "float32"
    source: str | None
    quantize_s: float = 0.0
    blocks: list[BlockReport] = field(default_factory=list)
    kv_cache: KVCacheSpec | None = None  # the quantized KV cache to run with, when the recipe had SimQuant
    # {"tokens": {layer: calibration tokens it read}, "fallbacks": {layer: [what a method did instead]}}, for the
    # layers of a mixture of experts' experts (whose token counts differ); the checkpoint keeps it.
    calibration: dict = field(default_factory=dict)


def calibration_summary(reports: Sequence[BlockReport], prefix: str, routed: tuple[str, ...]) -> dict:
    """The token counts of the routed layers (experts) and every fallback, by full layer name."""
    tokens = {f"{prefix}{r.index}.{name}": n for r in reports for name, n in r.tokens.items()
              if name.startswith(routed)}
    fallbacks = {f"{prefix}{r.index}.{name}": notes for r in reports for name, notes in r.fallbacks.items()}
    return {key: value for key, value in (("tokens", tokens), ("fallbacks", fallbacks)) if value}


def _split_recipe(recipe: Sequence[Step]) -> tuple[list[Method], CacheMethod | None]:
    """The weight methods, and the KV-cache method (SimQuant) when the recipe names one."""
    caches = [m for m in recipe if isinstance(m, CacheMethod)]
    if len(caches) > 1:
        raise ConfigError("a recipe holds at most one KV-cache method (SimQuant)")
    return [m for m in recipe if not isinstance(m, CacheMethod)], (caches[0] if caches else None)


def _check_recipe(recipe: Sequence[Method]) -> None:
    if not recipe:
        raise ConfigError("the recipe is empty; give at least one quantizer, e.g. [RTN()]")
    if not all(isinstance(m, Transform | Quantizer) for m in recipe):
        raise ConfigError("a recipe holds method objects (Transform, Quantizer or CacheMethod subclasses) such as "
                          f"RTN(); got {list(recipe)!r}")
    if sum(isinstance(m, Quantizer) for m in recipe) != 1 or not isinstance(recipe[-1], Quantizer):
        raise ConfigError("a recipe is transforms followed by exactly one quantizer, e.g. [SmoothQuant(), RTN()]")


def default_scheme(recipe: Sequence[Step]) -> QuantScheme:
    """The scheme a recipe is made for: its first method's (`smoothquant+gptq` -> W8A8, `awq+gptq` -> W4A16 g128),
    a rotation not counted (`rotate+smoothquant` -> W8A8)."""
    methods = _split_recipe(recipe)[0]
    return parse_scheme(next((m for m in methods if not isinstance(m, ModelTransform)), methods[0]).default_scheme)


def round_unquantized_to_fp16(model: nn.Module) -> None:
    """Round what stays float (embeddings, norms, biases) to fp16 values, in place and in fp32 storage.

    The checkpoint stores these in 16 bits; rounding here makes the model in memory evaluate exactly as the
    checkpoint will. A tensor that would overflow fp16 keeps its fp32 values.
    """
    for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
        if not tensor.is_floating_point() or tensor.dtype == torch.float16 or name.endswith(FULL_PRECISION_STATE):
            continue
        rounded = tensor.detach().to(torch.float16)
        if not torch.isfinite(rounded).all() and torch.isfinite(tensor).all():
            log.warning("%s does not fit in fp16; it is kept in fp32", name)
            continue
        with torch.no_grad():
            tensor.copy_(rounded.to(tensor.dtype))


@torch.no_grad()
def quantize(model: nn.Module, recipe: Step | Sequence[Step], plan: Plan | QuantScheme | None = None,
             calib: torch.Tensor | None = None, keep_fp32: bool = False, progress: bool = True,
             stream: BlockStreamer | None = None) -> nn.Module:
    """Quantize `model` in place and return it.

    `recipe` is a method or a list (transforms, then one quantizer, and optionally SimQuant for the KV cache);
    `plan` a Plan or one scheme for every linear layer in the blocks (None: the recipe's default scheme); `calib`
    token ids [samples, seqlen] for methods that need calibration (SimQuant without it tracks key ranges online).
    `stream` (from `load_model_streamed`) reads each block's weights only when its turn comes; a stream with a sink
    hands each quantized block to it and releases it, and leaves what stays float outside the blocks unrounded
    (the writer casts it), so the model in memory is then only a shell of the checkpoint written.
    """
    recipe = [recipe] if not isinstance(recipe, Sequence) else list(recipe)
    recipe, kv_method = _split_recipe(recipe)
    _check_recipe(recipe)
    if plan is None:
        plan = default_scheme(recipe)
    if any(isinstance(m, QuantLinear) for m in model.modules()):
        raise ConfigError("this model is quantized already; load the unquantized model to quantize it again")
    plan = Plan.uniform(plan) if isinstance(plan, QuantScheme) else plan
    arch = arch_for(model)
    if stream is not None and arch.experts is not None:
        raise ConfigError(f"--stream reads a block's weights by their names in the float checkpoint, which "
                          f"{arch.family}'s per-expert linears do not have: quantize without --stream")
    rewrite = next((step for step in recipe if isinstance(step, ModelTransform)), None)
    if stream is not None and rewrite is not None:
        raise ConfigError(f"{rewrite.name} rewrites the whole model at once, which --stream never holds; "
                          "quantize without --stream")
    unfuse_experts(model)  # one linear per expert, so that each is calibrated and quantized on its own tokens
    resolved = plan.resolve(model)
    if not resolved:
        raise ConfigError("the plan selects no linear layer of this model; check its patterns")
    track_positions(model, arch.blocks, resolved.values())  # before the KV cache's calibration runs the model
    hollow = stream is not None and stream.sink is not None  # blocks go to disk as they finish
    if hollow and kv_method is not None:
        raise ConfigError(f"{kv_method.name} calibrates the KV cache on the whole quantized model, which a streamed "
                          "write never holds; quantize without --stream, or without the KV-cache method")
    start = time.perf_counter()
    for step in recipe:  # whole-model rewrites (a rotation) come before any block is calibrated
        if isinstance(step, ModelTransform):
            step.apply_model(model, arch)
    # Calibration ids that only the KV cache needs skip the runner's per-block passes (RTN weights need none).
    weights_need = any(m.needs_calibration for m in recipe) or any(s.static_act for s in resolved.values())
    reports = run_sequential(model, recipe, resolved, calib if weights_need or kv_method is None else None, progress,
                             stream)
    # Layers outside the blocks (an LM head a rule names) are rounded to nearest: no block sees them.
    for name, scheme in resolved.items():
        if not name.startswith(arch.blocks + "."):
            if hollow and linear_weight(get_module(model, name)).is_meta:
                stream.load_module(name)  # left unread until now
            module = get_module(model, name)
            if hollow:
                module.float()  # an embedding tied head is kept in 16 bits; the rounding reads the fp32 values
            if name == arch.lm_head and getattr(model.config, "tie_word_embeddings", False):
                model.config.tie_word_embeddings = False  # the head gets its own integer copy
            if scheme.static_act:
                raise ConfigError(f"{name} lies outside the transformer blocks, where no calibration input is "
                                  "captured: give it dynamic activations (or leave it unquantized)")
            set_module(model, name, rtn_quant_linear(module, scheme, name))
    if not keep_fp32 and not hollow:  # a streamed write casts as it writes: the model in memory is hollow
        round_unquantized_to_fp16(model)
    # The cache is calibrated last, on the quantized model: its keys are what the cache will hold.
    kv_cache = kv_method.calibrate(model, calib, progress) if kv_method is not None else None
    elapsed = time.perf_counter() - start
    model.llmeasyquant = QuantizationInfo(
        recipe=[{"method": m.name, **dataclasses.asdict(m)} for m in recipe], plan=plan.to_dict(),
        float_dtype="float32" if keep_fp32 else "float16", source=getattr(model, "llmeasyquant_source", None),
        quantize_s=elapsed, blocks=reports, kv_cache=kv_cache,
        calibration=calibration_summary(reports, arch.blocks + ".", arch.routed))
    log.info("quantized %d layers in %.1f s", len(resolved), elapsed)
    return model
