"""One sequence on the engine's forward: `LeanDecoder` is runtime/batch.py's BatchDecoder (the serving engine's
step, native where the fused operators cover the model: runtime/native_step.py) over a KV pool that holds one
sequence, with greedy choice. `bench`, the speed evaluation and the Python API's batch-1 loop run it, so every speed
figure is the path `generate`, `chat` and `serve` take. The pool keeps fp32 keys and values by default (logits equal
transformers' to float rounding; tested per family); `kv_dtype="float16"` stores them as the server does by default.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from llmeasyquant.errors import ConfigError
from llmeasyquant.runtime.batch import BatchDecoder
from llmeasyquant.runtime.kv_pool import FLOAT_DTYPES, FloatPool, Shape
from llmeasyquant.runtime.model_parts import DecoderParts


def sequence_pool(parts: DecoderParts, sequences: int, max_tokens: int, kv_dtype: str = "float32") -> FloatPool:
    """A float KV pool that holds exactly `sequences` sequences of `max_tokens` positions."""
    if kv_dtype not in FLOAT_DTYPES:
        raise ConfigError(f"unknown KV dtype {kv_dtype!r}; choose one of {', '.join(FLOAT_DTYPES)}")
    shape = Shape(len(parts.blocks), parts.kv_heads, parts.head_dim, parts.heads)
    blocks = sequences * math.ceil(max_tokens / FloatPool.block_size)
    return FloatPool(shape, blocks * FloatPool.bytes_per_block(shape, kv_dtype), sequences, max_tokens, kv_dtype)


class LeanDecoder:
    """Greedy generation of one sequence of at most `max_tokens` positions.

    `prefill(ids)` runs the prompt (any length, one forward) and returns the next token's logits; `step(token)`
    appends one token. `reset()` starts a new sequence in the same pool. `fused=False` runs on PyTorch operators
    only (as where the fused operators cannot be built); `native_blocks=False` keeps the fused operators but runs
    every block on the Python forward, to measure what the native step brings."""

    def __init__(self, model: nn.Module, max_tokens: int, fused: bool = True, native_blocks: bool = True,
                 kv_dtype: str = "float32") -> None:
        parts = DecoderParts(model, max_tokens, fused)
        if parts.dtype != torch.float32:
            raise ConfigError(f"the decoder runs fp32 models (the serving engine's forward); this one is "
                              f"{parts.dtype}: load it in float32")
        self.pool = sequence_pool(parts, 1, max_tokens, kv_dtype)
        self.slot = self.pool.allocate(max_tokens)
        self.batch = BatchDecoder(parts, self.pool, native=native_blocks)
        self.parts, self.blocks, self.fused_ops = parts, parts.blocks, parts.fused_ops
        self.max_tokens = max_tokens
        self.length = 0

    def reset(self) -> None:
        self.length = 0

    @torch.no_grad()
    def prefill(self, ids: torch.Tensor) -> torch.Tensor:
        """Run the prompt ids [P] (or [1, P]) into the cache; logits [vocab] of the next token."""
        if ids.dim() > 1 and ids.shape[0] != 1:
            raise ValueError(f"LeanDecoder runs one sequence, but ids hold {ids.shape[0]} prompts [{tuple(ids.shape)}]"
                             "; decode a batch with runtime.Engine (continuous batching) or one prompt at a time")
        return self._forward(ids.reshape(-1))

    @torch.no_grad()
    def step(self, token: torch.Tensor) -> torch.Tensor:
        """Append one token id (any shape of one element); logits [vocab] of the next token."""
        return self._forward(token.reshape(1))

    @torch.no_grad()
    def generate(self, ids: torch.Tensor, new_tokens: int) -> torch.Tensor:
        """Greedy continuation of ids [P] or [1, P]: the `new_tokens` ids chosen, [new_tokens]."""
        if new_tokens < 1:
            raise ValueError(f"new_tokens must be at least 1, got {new_tokens}")
        self.reset()
        token = self.prefill(ids).argmax()
        chosen = [token]
        for _ in range(new_tokens - 1):
            token = self.step(token).argmax()
            chosen.append(token)
        return torch.stack(chosen)

    def _forward(self, ids: torch.Tensor) -> torch.Tensor:
        """The logits [vocab] after the rows `ids` [T] at the next positions."""
        count, start = ids.shape[0], self.length
        if start + count > self.max_tokens:
            raise ValueError(f"the sequence would reach {start + count} tokens; this decoder was built for "
                             f"{self.max_tokens}")
        rows = self.pool.rows([self.slot] * count, range(start, start + count))
        logits = self.batch.forward(ids, rows, torch.tensor([count - 1]))
        self.length = start + count
        return logits[0]
