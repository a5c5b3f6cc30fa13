"""A lean batch-1 decode loop for pre-norm rotary decoders (the families whose arch entry has a `decoder` map).

In transformers' forward, a batch-1 decode step of a small model spends most of its time outside the matrix
multiplies: some fifty operators per block, the Python around them, and a cache that grows by concatenation.
Quantized weights make the GEMMs several times cheaper, which pays only if the rest shrinks too. This loop runs the
model's own modules and weights (QuantLinear layers through their kernels, fused groups as one GEMM) with:
- a static KV cache, allocated once for the whole generation and written in place;
- rotary tables computed once, by the model's own rotary module (so its scaling rule holds);
- one `rms_norm` operator per norm, queries and keys rotated together;
- the LM head on the last position only;
- for fp32 SiLU models, the fused C++ operators of kernels/native.py, for the prompt and each step: norm, rotary
  embedding + cache write, attention over the cache and SiLU-times-up each in one call instead of several PyTorch
  operators (for a prompt, causal attention on BLAS GEMMs, 1.7x faster than PyTorch's fused CPU attention).
Logits equal transformers' to float rounding (tests compare them on tiny models of each family and on SmolLM2).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from llmeasyquant.kernels.choice import is_pinned
from llmeasyquant.models.arch import apply_rope
from llmeasyquant.nn.positions import row_positions
from llmeasyquant.runtime.model_parts import NO_NORM, DecoderParts
from llmeasyquant.runtime.native_block import BlockArguments, block_arguments


class LeanDecoder:
    """Greedy batch-1 generation over a static KV cache of `max_tokens` positions.

    `prefill(ids)` runs the prompt and returns the next token's logits; `step(token)` appends one token.
    `reset()` starts a new sequence in the same cache. `fused=False` runs on PyTorch operators only (as where the
    fused operators cannot be built or do not cover the model). With them, a step runs each block whose linears all
    take a kernel with a `decode_block_kind` (W4A16's digits kernel, the native W8A16 and W8A8 ones) as one native
    call (runtime/native_block.py; the same bits); `native_blocks=False` (or setting the attribute) keeps every block
    on the Python loop, to measure what that call brings."""

    def __init__(self, model: nn.Module, max_tokens: int, fused: bool = True, native_blocks: bool = True) -> None:
        parts = DecoderParts(model, max_tokens, fused)
        self.parts, self.blocks, self.fused_ops = parts, parts.blocks, parts.fused_ops
        self.heads, self.kv_heads, self.head_dim, self.scaling = (parts.heads, parts.kv_heads, parts.head_dim,
                                                                  parts.scaling)
        shape = (len(self.blocks), 1, self.kv_heads, max_tokens, self.head_dim)  # [blocks, batch, heads, pos, dim]
        self.keys = torch.zeros(shape, dtype=parts.dtype)
        self.values = torch.zeros(shape, dtype=parts.dtype)
        self.cos, self.sin = parts.cos[:, None, :], parts.sin[:, None, :]  # [pos, 1, dim]
        self.max_tokens = max_tokens
        self.length = 0
        self.native_blocks = native_blocks
        # Per (threads, pinned): each block's arguments for one native call a step, or None (kernels choose per
        # thread count, so the blocks that qualify may differ).
        self._native_blocks: dict[tuple[int, bool], list[BlockArguments | None]] = {}

    def reset(self) -> None:
        self.length = 0

    @torch.no_grad()
    def prefill(self, ids: torch.Tensor) -> torch.Tensor:
        """Run the prompt ids [P] (or [1, P]) into the cache; logits [vocab] of the next token."""
        if ids.dim() > 1 and ids.shape[0] != 1:
            raise ValueError(f"LeanDecoder runs one sequence, but ids hold {ids.shape[0]} prompts [{tuple(ids.shape)}]"
                             "; decode a batch with runtime.Engine (continuous batching) or one prompt at a time")
        return self._logits(self._forward(ids.reshape(-1)))

    @torch.no_grad()
    def step(self, token: torch.Tensor) -> torch.Tensor:
        """Append one token id (any shape of one element); logits [vocab] of the next token."""
        return self._logits(self._forward(token.reshape(1)))

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

    def _check_room(self, end: int) -> None:
        if end > self.max_tokens:
            raise ValueError(f"the sequence would reach {end} tokens; this decoder was built for {self.max_tokens}")

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.parts.logits(hidden)[0]

    def _forward(self, ids: torch.Tensor) -> torch.Tensor:
        # The rows' positions, for layers that keep sink tokens in 8 bits (nn/positions.py).
        with row_positions(torch.arange(self.length, self.length + ids.shape[0])):
            return self._fused_run(ids) if self.fused_ops is not None else self._run(ids)

    def _run(self, ids: torch.Tensor) -> torch.Tensor:
        """The hidden state [1, hidden] of the last of `ids` [T], their keys and values written to the cache."""
        count, start = ids.shape[0], self.length
        end = start + count
        self._check_room(end)
        heads, kv_heads, dim = self.heads, self.kv_heads, self.head_dim
        cos, sin = self.cos[start:end], self.sin[start:end]  # [T, 1, dim]
        mask = None
        if count > 1 and start > 0:  # a chunk after a cached prefix: position i sees the prefix and itself
            mask = torch.ones(count, end, dtype=torch.bool).tril(diagonal=start)
        x = self.parts.embed(ids)  # [T, hidden]
        for index, block in enumerate(self.blocks):
            qkv = block.qkv(block.attn_norm(x))  # [T, (heads + 2 kv_heads) * dim]
            qk = qkv[:, : (heads + kv_heads) * dim].view(count, heads + kv_heads, dim)
            if block.qk_norm is not None:
                qk = torch.cat((block.qk_norm[0](qk[:, :heads]), block.qk_norm[1](qk[:, heads:])), dim=1)
            qk = apply_rope(qk, cos, sin)
            keys, values = self.keys[index], self.values[index]  # [1, kv_heads, max_tokens, dim]
            keys[0, :, start:end] = qk[:, heads:].transpose(0, 1)
            values[0, :, start:end] = qkv[:, (heads + kv_heads) * dim:].view(count, kv_heads, dim).transpose(0, 1)
            attended = F.scaled_dot_product_attention(
                qk[:, :heads].transpose(0, 1)[None], keys[:, :, :end], values[:, :, :end], attn_mask=mask,
                is_causal=count > 1 and start == 0, scale=self.scaling, enable_gqa=True)  # [1, heads, T, dim]
            x = x + block.o(attended[0].transpose(0, 1).reshape(count, heads * dim))
            gate, up = block.gate_up(block.mlp_norm(x)).chunk(2, dim=-1)
            x = x + block.down(block.activation(gate) * up)
        self.length = end
        return x[-1:]

    def _fused_run(self, ids: torch.Tensor) -> torch.Tensor:
        """`_run` on the fused operators: the same computation in a third of the operator calls, each a single pass
        (split over the threads for a prompt's rows)."""
        ops, count, start = self.fused_ops, ids.shape[0], self.length
        end = start + count
        self._check_room(end)
        cos, sin = self.cos[start:end, 0], self.sin[start:end, 0]  # [T, dim]
        x = self.parts.embed(ids)  # [T, hidden]
        native_blocks = self.step_blocks() if count == 1 else None
        for index, block in enumerate(self.blocks):
            keys, values = self.keys[index, 0], self.values[index, 0]  # [kv_heads, max_tokens, dim], written in place
            arguments = native_blocks[index] if native_blocks is not None else None
            if arguments is not None:  # the lines below in one native call (runtime/native_block.py)
                ops.decode_block(x, *arguments, cos, sin, keys, values, start, self.heads, self.scaling)
                continue
            qkv = block.qkv(ops.rms_norm(x, block.attn_norm.weight, block.attn_norm.eps))
            q_norm, k_norm = block.qk_norm or (NO_NORM, NO_NORM)
            queries = ops.rope_store(qkv, cos, sin, keys, values, start, self.heads, q_norm.weight, k_norm.weight,
                                     q_norm.eps, k_norm.eps)  # [T, heads, dim]
            if count == 1:  # one query row: every cached key read once for the query heads that share it
                attended = ops.decode_attention(queries, keys, values, end, self.scaling)
            else:
                attended = ops.causal_attention(queries, keys, values, start, self.scaling)
            x += block.o(attended)  # x is this call's own tensor (from the embedding lookup): no one else sees it
            x += block.down(ops.silu_mul(block.gate_up(ops.rms_norm(x, block.mlp_norm.weight, block.mlp_norm.eps))))
        self.length = end
        return x[-1:]

    def step_blocks(self) -> list[BlockArguments | None] | None:
        """Each block's `decode_block` arguments for a one-token step, or None for all when switched off or while
        the profiler runs (its breakdown times the operators one by one). Gathered on the first step at a thread
        count and kept: they hold the layers' prepared tensors, so weights are moved (nn/placement.py) before a
        decoder is built, as every command does."""
        if not self.native_blocks or torch.autograd._profiler_enabled():
            return None
        key = (torch.get_num_threads(), is_pinned())
        if key not in self._native_blocks:
            self._native_blocks[key] = [block_arguments(block) for block in self.blocks]
        return self._native_blocks[key]
