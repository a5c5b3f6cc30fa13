"""Block by block: capture a block's inputs, run the recipe on it, pass its quantized outputs to the next one.

Only this module knows that a model is a stack of blocks. At most one block's calibration activations are held
at a time, so peak memory is the model plus one block's inputs and outputs.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn
from tqdm.auto import tqdm

from llmeasyquant.calibration.shared_solves import apply_shared
from llmeasyquant.errors import ConfigError
from llmeasyquant.infra import distributed
from llmeasyquant.kernels import choice
from llmeasyquant.kernels.reference import held_weights
from llmeasyquant.methods.base import BlockContext, Method, Quantizer
from llmeasyquant.methods.stats import calibrate_static_inputs, collect_input_stats, relative_error, run_block
from llmeasyquant.models.arch import ArchSpec, arch_for, blocks_of
from llmeasyquant.models.streaming import BlockStreamer
from llmeasyquant.nn.positions import row_positions
from llmeasyquant.scheme import QuantScheme

log = logging.getLogger(__name__)


class _StopForward(Exception):
    """Raised inside the first block once its inputs are captured: nothing after it needs to run."""


@dataclass(frozen=True)
class BlockReport:
    index: int
    layers: int
    output_rel_error: float | None  # ||quantized - float|| / ||float|| on the calibration inputs, when given
    choices: dict[str, float] = field(default_factory=dict)  # what the methods chose here, e.g. SmoothQuant's alpha
    sent_bytes: int = 0  # what this rank put into collectives for this block (0 in a single process)
    # Calibration tokens each linear read (block-relative names; a mixture of experts' expert reads only those
    # routed to it), when calibration data was given; and what the methods did instead for layers that read too few.
    tokens: dict[str, int] = field(default_factory=dict)
    fallbacks: dict[str, list[str]] = field(default_factory=dict)
    seconds: float = 0.0  # wall time of this block: reading (when streamed), the recipe, its outputs, writing


@torch.no_grad()
def capture_block_inputs(model: nn.Module, batches: torch.Tensor) -> tuple[list[torch.Tensor], list[dict]]:
    """Hidden states and keyword arguments that the model passes to its first block, one entry per batch."""
    first = blocks_of(model)[0]
    inputs: list[torch.Tensor] = []
    kwargs: list[dict] = []

    def grab(_module: nn.Module, args: tuple, kw: dict) -> None:
        hidden = args[0] if args else kw.pop("hidden_states")
        inputs.append(hidden.detach())
        kwargs.append({k: v for k, v in kw.items() if k not in ("past_key_value", "past_key_values")})
        raise _StopForward

    handle = first.register_forward_pre_hook(grab, with_kwargs=True)
    try:
        for batch in batches:
            with contextlib.suppress(_StopForward):
                model(batch.unsqueeze(0) if batch.dim() == 1 else batch, use_cache=False)
    finally:
        handle.remove()
    return inputs, kwargs


def _block_plans(model: nn.Module, arch: ArchSpec, plan: dict[str, QuantScheme]) -> list[dict[str, QuantScheme]]:
    prefix = arch.blocks + "."
    per_block: list[dict[str, QuantScheme]] = [{} for _ in blocks_of(model)]
    for name, scheme in plan.items():
        if name.startswith(prefix):
            index, _, rel = name[len(prefix):].partition(".")
            per_block[int(index)][rel] = scheme
    return per_block


def run_sequential(model: nn.Module, recipe: Sequence[Method], plan: dict[str, QuantScheme],
                   calib: torch.Tensor | None = None, progress: bool = True,
                   stream: BlockStreamer | None = None) -> list[BlockReport]:
    """Apply `recipe` to every block in order. `calib` holds token ids [samples, seqlen] when any method needs it;
    `stream` reads each block's weights just before its turn (a model loaded by `load_model_streamed`).

    Quantized layers run on fixed kernels meanwhile (kernels/choice.py's `pinned`): a block's outputs feed the next
    block's statistics, and must not depend on which kernel a timing in this process happened to favour. Each
    calibration sample is a sequence from position 0, which the layers that keep sink tokens in 8 bits are told
    (nn/positions.py), so that calibration sees the arithmetic that inference will run."""
    positions = None if calib is None else torch.arange(calib.shape[-1])
    with choice.pinned(), row_positions(positions):
        return _run_sequential(model, recipe, plan, calib, progress, stream)


def _run_sequential(model: nn.Module, recipe: Sequence[Method], plan: dict[str, QuantScheme],
                    calib: torch.Tensor | None, progress: bool, stream: BlockStreamer | None) -> list[BlockReport]:
    arch = arch_for(model)
    if arch.experts is not None and distributed.active():
        raise ConfigError(f"{arch.family} routes each token to some of its experts, differently on each rank, which "
                          "the statistics summed over ranks do not follow yet: quantize it in one process")
    blocks = blocks_of(model)
    per_block = _block_plans(model, arch, plan)
    static = any(s.static_act for s in plan.values())
    if calib is None and (static or any(m.needs_calibration for m in recipe)):
        names = ", ".join(m.name for m in recipe if m.needs_calibration) or "static activation scales"
        raise ConfigError(f"{names} needs calibration data; pass calib=token ids (see llmeasyquant.calibration)")
    # The first pass gathers every statistic the recipe reads: a transform that keeps them exact (smoothing)
    # hands them on, so the quantizer after it needs no pass of its own; static activation scales read the ranges.
    first_pass_stats = frozenset().union(*(m.input_stats for m in recipe), {"range"} if static else set())
    inputs = kwargs = float_inputs = sample_ids = None
    if calib is not None:
        if distributed.active() and calib.shape[0] < distributed.world():
            raise ConfigError(f"{calib.shape[0]} calibration samples cannot be shared out over {distributed.world()} "
                              "ranks: give at least one sample per rank (--calib-samples)")
        sample_ids = distributed.shard(calib.shape[0])  # all of them in one process
        calib = calib[sample_ids]  # this rank's batches; statistics are summed (exactly) over ranks
    if calib is not None:
        inputs, kwargs = capture_block_inputs(model, calib)
        if stream is not None:
            stream.map_embeddings()  # the rows just looked up leave memory (a hollow model's embeddings are mapped)
        if any(m.float_path for m in recipe):
            float_inputs = inputs  # the unquantized model's activations, carried beside the quantized ones
    reports = []
    bar = tqdm(range(len(blocks)), desc="quantizing blocks", unit="block", disable=not progress)
    for index in bar:
        block_start = time.perf_counter()
        if stream is not None:
            stream.load_block(index)
        block = blocks[index]
        sent_before = distributed.sent_bytes()
        ctx = BlockContext(index=index, prefix=f"{arch.blocks}.{index}.", plan=per_block[index], arch=arch,
                           inputs=inputs, kwargs=kwargs, sample_ids=sample_ids)
        reference = None
        first_tokens: dict[str, int] = {}
        if inputs is not None:
            # One pass gives the float outputs (for the error shown) and the recipe's input statistics.
            ctx.input_stats, reference = collect_input_stats(block, list(per_block[index]), inputs, kwargs,
                                                             keep_outputs=True, want=first_pass_stats,
                                                             routed=arch.routed)
            ctx.reference_outputs = reference
            first_tokens = ctx.input_stats.tokens  # what the float block's linears read
        if float_inputs is not None:
            ctx.float_inputs = float_inputs
            ctx.float_outputs = reference if float_inputs is inputs else run_block(block, float_inputs, kwargs)
        for method in recipe:
            if distributed.active() and isinstance(method, Quantizer) and method.solves_apart:
                apply_shared(method, block, ctx)
            else:
                method.apply(block, ctx)
        error = None
        if inputs is not None:
            for name in calibrate_static_inputs(block, ctx.input_stats, inputs, kwargs, arch.routed):
                note = "static input range: no calibration token, took the range of the other experts' same layer"
                ctx.fallbacks.setdefault(name, []).append(note)
                log.warning("%s%s: %s", ctx.prefix, name, note)
            with held_weights():  # each weight dequantized once for all the batches, not once per batch
                inputs = run_block(block, inputs, kwargs)  # quantized outputs feed the next block
            float_inputs = ctx.float_outputs
            error = relative_error(inputs, reference)
            bar.set_postfix(out_err=f"{error:.4f}", **{k: f"{v:.3g}" for k, v in ctx.stats.items()})
        ctx_stats, fallbacks = dict(ctx.stats), ctx.fallbacks
        del ctx, reference  # the block's statistics (GPTQ's Hessians) go before the next block is read
        if stream is not None:
            stream.finish_block(index, block)  # with a sink: written out, then released
        reports.append(BlockReport(index=index, layers=len(per_block[index]), output_rel_error=error,
                                   choices=ctx_stats, sent_bytes=distributed.sent_bytes() - sent_before,
                                   tokens=first_tokens, fallbacks=fallbacks, seconds=time.perf_counter() - block_start))
        log.debug("block %d: %d layers quantized, output error %s", index, len(per_block[index]), error)
    return reports
