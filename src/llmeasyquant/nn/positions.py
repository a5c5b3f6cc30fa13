"""The sequence positions of the rows a model call computes, for layers whose arithmetic depends on them.

A quantized linear sees rows of activations, not tokens: it cannot tell the first token of a sequence (the attention
sink, whose hidden state carries the model's massive activations and which every later token attends to) from the
others. Layers whose activation scheme keeps sink tokens in 8 bits (`ActScheme.sinks`) read the positions of the
current call from here. Whoever runs the model says them: the lean decoder and the serving engine (they know each
row's position), and, for the transformers forward (evaluation, `generate`, calibration), a pre-hook on the decoder
stack that reads `position_ids`, `cache_position` or the cache's length (`attach_position_hooks`).

The positions are a context variable: set for the duration of one call, private to its thread, None outside one,
and nested calls restore the outer value.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterable, Iterator
from contextvars import ContextVar, Token
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from llmeasyquant.scheme import QuantScheme

# (positions [rows], their smallest): the smallest, read once per model call, lets every layer of a decode step past
# the sinks skip the mask without a tensor operation.
_POSITIONS: ContextVar[tuple[torch.Tensor, int] | None] = ContextVar("llmeasyquant_row_positions", default=None)
_HOOKED = "_llmeasyquant_position_hooks"


def _set(positions: torch.Tensor | None) -> Token:
    if positions is None:
        return _POSITIONS.set(None)
    flat = positions.reshape(-1)
    return _POSITIONS.set((flat, int(flat.min()) if flat.numel() else 0))


@contextlib.contextmanager
def row_positions(positions: torch.Tensor | None) -> Iterator[None]:
    """Within the block, the rows of each layer call are at `positions` (any shape; flattened in row order)."""
    token = _set(positions)
    try:
        yield
    finally:
        _POSITIONS.reset(token)


def current_positions() -> torch.Tensor | None:
    """The positions [rows] of the current call's rows, or None when nobody said them."""
    held = _POSITIONS.get()
    return None if held is None else held[0]


def sink_rows(rows: int, sinks: int) -> torch.Tensor | None:
    """Bool [rows]: which rows of a call of `rows` rows are among the first `sinks` positions of their sequence; None
    when none are, or when the positions are unknown or are not one per row (e.g. an expert that sees some tokens)."""
    held = _POSITIONS.get()
    if sinks <= 0 or held is None or held[1] >= sinks or held[0].numel() != rows:
        return None
    return held[0] < sinks


def _positions_from_call(args: tuple, kwargs: dict[str, Any]) -> torch.Tensor | None:
    """[batch, seq] positions of a transformers decoder call: its position_ids, else its cache_position, else the
    cache's length onwards."""
    ids = kwargs.get("input_ids", args[0] if args else None)
    embeds = kwargs.get("inputs_embeds")
    shape = ids.shape if ids is not None else embeds.shape[:2] if embeds is not None else None
    if shape is None:
        return None
    position_ids = kwargs.get("position_ids")
    if position_ids is not None:
        return position_ids.expand(shape)
    cache_position = kwargs.get("cache_position")
    if cache_position is None:
        cache = kwargs.get("past_key_values")
        start = cache.get_seq_length() if cache is not None and hasattr(cache, "get_seq_length") else 0
        cache_position = torch.arange(start, start + shape[-1])
    return cache_position[None, :].expand(shape)


def attach_position_hooks(decoder: nn.Module) -> None:
    """Make every transformers forward of `decoder` (the stack of blocks, e.g. LlamaModel) say its rows' positions
    for its duration. Once per module; a no-op the second time."""
    if getattr(decoder, _HOOKED, False):
        return
    calls = threading.local()  # each thread's open calls: two threads may run one model at once

    def enter(_module: nn.Module, args: tuple, kwargs: dict) -> None:
        positions = _positions_from_call(args, kwargs)
        if not hasattr(calls, "tokens"):
            calls.tokens = []
        calls.tokens.append(_set(positions))

    def leave(_module: nn.Module, _args: tuple, _kwargs: dict, _output: Any) -> None:
        if getattr(calls, "tokens", None):
            _POSITIONS.reset(calls.tokens.pop())

    decoder.register_forward_pre_hook(enter, with_kwargs=True)
    decoder.register_forward_hook(leave, with_kwargs=True, always_call=True)
    object.__setattr__(decoder, _HOOKED, True)


def track_positions(model: nn.Module, blocks: str, schemes: Iterable[QuantScheme]) -> None:
    """Attach the position hooks to the module that runs the blocks (the parent of `blocks`, e.g. `model` for
    `model.layers`) when any of `schemes` keeps sink tokens in 8 bits."""
    if any(scheme.act is not None and scheme.act.sinks for scheme in schemes):
        attach_position_hooks(model.get_submodule(blocks.rpartition(".")[0]))
