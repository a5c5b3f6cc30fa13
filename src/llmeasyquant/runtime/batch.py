"""One forward step over the rows of many sequences: the serving engine's decode loop (runtime/engine.py), and the
one path every command that generates text takes (runtime/decoder.py is it for one sequence).

The rows of a step are any mix of decode tokens (one row of a running sequence) and prompt chunks (consecutive
rows of one sequence): each row carries its own sequence slot and position, so the linears run once over all rows
(the integer kernels see a batch, as they are measured for) while rotary embedding, the KV pool write and attention
follow each row's own sequence (runtime/kv_pool.py). Rows never see another sequence's keys.

The blocks run as one native call (runtime/native_step.py) where the fused operators cover the model; `_block` is
the same computation in Python, the reference the native step is tested against, and what runs a block the native
step does not take (and every block while the profiler runs, so that its breakdown sees the operators one by one).
"""

from __future__ import annotations

import torch

from llmeasyquant.infra.memory import release_freed_memory
from llmeasyquant.kernels.choice import ROW_BUCKETS, is_pinned, row_bucket
from llmeasyquant.nn.positions import row_positions
from llmeasyquant.nn.qlinear import QuantLinear
from llmeasyquant.runtime.kv_pool import KVPool, Rows
from llmeasyquant.runtime.model_parts import NO_NORM, DecoderParts
from llmeasyquant.runtime.native_step import NativeStep, build_step


class BatchDecoder:
    """`forward(ids, rows, wanted)`: the logits [len(wanted), vocab] of the rows `wanted`, after writing every
    row's keys and values into the pool. `native=False` keeps every block on the Python forward."""

    def __init__(self, parts: DecoderParts, pool: KVPool, native: bool = True) -> None:
        self.parts, self.pool = parts, pool
        self.ops = parts.fused_ops
        self.activation = self.ops.GATE_ACTIVATIONS[parts.activation] if self.ops is not None else -1
        self.norms = [block.qk_norm or (NO_NORM, NO_NORM) for block in parts.blocks]
        self.native = native
        # (row bucket, threads, pinned) -> the native step for such steps: kernels are chosen per bucket and threads
        self._steps: dict[tuple[int, int, bool], NativeStep | None] = {}

    def native_step(self, rows: int) -> NativeStep | None:
        """The native program for steps of `rows` rows (built on first use), or None when the Python forward runs."""
        if not self.native or self.ops is None or torch.autograd._profiler_enabled():
            return None
        key = (row_bucket(rows), torch.get_num_threads(), is_pinned())
        if key not in self._steps:
            self._steps[key] = build_step(self.parts, self.pool, rows)
        return self._steps[key]

    def prepare(self, rows: int, head_rows: int) -> None:
        """Choose every quantized linear's kernel, and build the native step, for each row bucket up to `rows` (the
        head's up to `head_rows`) now: otherwise the first step to reach a bucket times the candidates (a second
        and more on a large head) while its requests wait. Then drop what the kernels that lost prepared."""
        blocks, head = [], getattr(self.parts.lm_head, "__self__", None)
        for block in self.parts.blocks:
            for projection in block.projections:
                blocks += [layer for member in projection.members
                           if isinstance(layer := getattr(member, "__self__", None), QuantLinear)]
        for bucket in ROW_BUCKETS:
            if bucket <= row_bucket(rows):
                for layer in blocks:
                    layer.kernel(bucket)
                self.native_step(bucket)
            if bucket <= row_bucket(head_rows) and isinstance(head, QuantLinear):
                head.kernel(bucket)
        for layer in [*blocks, head] if isinstance(head, QuantLinear) else blocks:
            layer.release_unchosen()
        release_freed_memory()

    def _rms(self, x: torch.Tensor, norm) -> torch.Tensor:
        return self.ops.rms_norm(x, norm.weight, norm.eps) if self.ops is not None else norm(x)

    def _mlp_input(self, block, gate_up: torch.Tensor) -> torch.Tensor:
        if self.ops is not None:
            return self.ops.gate_mul(gate_up, self.activation)
        gate, up = gate_up.chunk(2, dim=-1)
        return block.activation(gate) * up

    @torch.no_grad()
    def forward(self, ids: torch.Tensor, rows: Rows, wanted: torch.Tensor) -> torch.Tensor:
        with row_positions(rows.positions):  # for layers that keep sink tokens in 8 bits (nn/positions.py)
            return self._forward(ids, rows, wanted)

    def _forward(self, ids: torch.Tensor, rows: Rows, wanted: torch.Tensor) -> torch.Tensor:
        parts = self.parts
        cos, sin = parts.cos[rows.positions].float(), parts.sin[rows.positions].float()  # [rows, dim]
        x = parts.embed(ids).float()  # [rows, hidden]; the pool operators take fp32 rows
        step = self.native_step(ids.shape[0])
        for first, last, native in step.runs if step is not None else ((0, len(parts.blocks), False),):
            if native:  # in place, the blocks [first, last) in one call
                step.program.run(x, cos, sin, rows.slots, rows.row_seq, rows.positions, rows.lengths, first, last)
                continue
            for index in range(first, last):
                x = self._block(index, x, cos, sin, rows)
        return parts.logits(x[wanted]).float()

    def _block(self, index: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rows: Rows) -> torch.Tensor:
        block, pool = self.parts.blocks[index], self.pool
        qkv = block.qkv(self._rms(x, block.attn_norm))
        queries = pool.store(index, qkv.float().contiguous(), cos, sin, rows, self.norms[index])
        x = x + block.o(pool.attend(index, queries, rows, self.parts.scaling))
        return x + block.down(self._mlp_input(block, block.gate_up(self._rms(x, block.mlp_norm))))
