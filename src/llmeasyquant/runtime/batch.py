"""One forward step over the rows of many sequences: the serving engine's decode loop (runtime/engine.py).

The rows of a step are any mix of decode tokens (one row of a running sequence) and prompt chunks (consecutive
rows of one sequence): each row carries its own sequence slot and position, so the linears run once over all rows
(the integer kernels see a batch, as they are measured for) while rotary embedding, the KV pool write and attention
follow each row's own sequence (runtime/kv_pool.py). Rows never see another sequence's keys.
"""

from __future__ import annotations

import torch

from llmeasyquant.nn.positions import row_positions
from llmeasyquant.runtime.kv_pool import KVPool, Rows
from llmeasyquant.runtime.model_parts import NO_NORM, DecoderParts


class BatchDecoder:
    """`forward(ids, rows, wanted)`: the logits [len(wanted), vocab] of the rows `wanted`, after writing every
    row's keys and values into the pool."""

    def __init__(self, parts: DecoderParts, pool: KVPool) -> None:
        self.parts, self.pool = parts, pool
        self.ops = parts.fused_ops
        self.norms = [block.qk_norm or (NO_NORM, NO_NORM) for block in parts.blocks]

    def _rms(self, x: torch.Tensor, norm) -> torch.Tensor:
        return self.ops.rms_norm(x, norm.weight, norm.eps) if self.ops is not None else norm(x)

    def _mlp_input(self, block, gate_up: torch.Tensor) -> torch.Tensor:
        if self.ops is not None:
            return self.ops.silu_mul(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return block.activation(gate) * up

    @torch.no_grad()
    def forward(self, ids: torch.Tensor, rows: Rows, wanted: torch.Tensor) -> torch.Tensor:
        with row_positions(rows.positions):  # for layers that keep sink tokens in 8 bits (nn/positions.py)
            return self._forward(ids, rows, wanted)

    def _forward(self, ids: torch.Tensor, rows: Rows, wanted: torch.Tensor) -> torch.Tensor:
        parts, pool = self.parts, self.pool
        cos, sin = parts.cos[rows.positions].float(), parts.sin[rows.positions].float()  # [rows, dim]
        x = parts.embed(ids).float()  # [rows, hidden]; the pool operators take fp32 rows
        for index, block in enumerate(parts.blocks):
            qkv = block.qkv(self._rms(x, block.attn_norm))
            queries = pool.store(index, qkv.float().contiguous(), cos, sin, rows, self.norms[index])
            attended = pool.attend(index, queries, rows, parts.scaling)
            x = x + block.o(attended)
            x = x + block.down(self._mlp_input(block, block.gate_up(self._rms(x, block.mlp_norm))))
        return parts.logits(x[wanted]).float()


