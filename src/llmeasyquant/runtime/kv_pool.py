"""The serving engine's KV cache: a pool of blocks under a memory budget, handed out to sequences.

Every sequence that runs holds a slot (0..max_running-1) and, in its slot's row of the block table, the blocks
its positions live in (position p in block `table[p // B]` at offset p % B). A request reserves the blocks for its
prompt and all its completion tokens when it is admitted, so a running sequence never waits for memory and nothing
is ever evicted; a request whose blocks do not fit waits in the engine's queue.

Two kinds of pool, one interface (`store` the step's keys and values, then `attend`):
- `FloatPool`: keys (after rotary embedding) and values in float16 or float32, blocks of 16 positions;
- `QuantPool`: the SimQuant coding (nn/kv/): keys before rotary embedding coded per channel on each block's own
  range (blocks of `key_block` positions; the incomplete block kept in fp16 until it completes), values per token
  with their outliers apart, the first `sinks` positions of each sequence in fp16. Attention reads the codes where
  they lie (kernels/native/paged_ops.cpp); nothing dequantizes the cache.
The budget counts every byte a sequence can hold: blocks, and for the quantized pool each slot's sinks and
incomplete key block. Tensors are allocated with torch.empty, so memory the pool never writes is never resident.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from llmeasyquant.errors import ConfigError
from llmeasyquant.kernels import native
from llmeasyquant.nn.kv.config import KVQuantConfig

FLOAT_BLOCK = 16
FLOAT_DTYPES = {"float16": torch.float16, "float32": torch.float32}
MIB = 2**20


def paged_ops():
    """The compiled paged operators, or their PyTorch reference where the extension cannot be built."""
    ops = native.ops()
    if ops is not None and hasattr(ops, "paged_attention"):
        return ops
    from llmeasyquant.runtime import paged_reference

    return paged_reference


@dataclass(frozen=True)
class Rows:
    """The query rows of one step: which sequence slot, position and flat cache slot each row has."""

    row_seq: torch.Tensor  # [rows] int64
    positions: torch.Tensor  # [rows] int64
    slots: torch.Tensor  # [rows] int64: block * block_size + offset
    lengths: torch.Tensor  # [rows] int64: positions + 1


@dataclass(frozen=True)
class Shape:
    layers: int
    kv_heads: int
    head_dim: int
    heads: int


class KVPool:
    """Blocks and slots under a byte budget; subclasses hold the tensors and run the operators."""

    block_size: int
    block_bytes: int  # bytes of one block across all layers
    sequence_bytes: int  # bytes every admitted sequence holds besides its blocks
    kind: str

    def __init__(self, shape: Shape, budget_bytes: int, max_running: int, max_context: int) -> None:
        self.shape, self.budget, self.max_running = shape, int(budget_bytes), max_running
        self.blocks_per_sequence = math.ceil(max_context / self.block_size)
        self.num_blocks = max(0, (self.budget - self.sequence_bytes) // self.block_bytes)
        if self.num_blocks < 1:
            raise ConfigError(f"a KV memory of {self.budget / MIB:.1f} MiB holds no block of {self.block_size} "
                              f"positions ({self.block_bytes / MIB:.2f} MiB each, {self.kind}); raise --kv-memory")
        self.tables = torch.zeros(max_running, self.blocks_per_sequence, dtype=torch.int32)
        self._free_blocks = list(range(self.num_blocks - 1, -1, -1))
        self._free_slots = list(range(max_running - 1, -1, -1))
        self._held: dict[int, int] = {}  # slot -> blocks held
        self.ops = paged_ops()

    # admission ---------------------------------------------------------------------------------------------------
    def blocks_for(self, tokens: int) -> int:
        return math.ceil(tokens / self.block_size)

    def bytes_for(self, tokens: int) -> int:
        return self.blocks_for(tokens) * self.block_bytes + self.sequence_bytes

    def used_bytes(self) -> int:
        return sum(blocks * self.block_bytes + self.sequence_bytes for blocks in self._held.values())

    def fits_ever(self, tokens: int) -> bool:
        """Whether a sequence of `tokens` positions fits in the budget at all (in an empty pool)."""
        return self.bytes_for(tokens) <= self.budget and self.blocks_for(tokens) <= self.num_blocks

    def capacity(self, tokens: int) -> int:
        """Sequences of `tokens` positions the budget holds at once (memory only, whatever max_running says)."""
        return min(self.budget // self.bytes_for(tokens), self.num_blocks // self.blocks_for(tokens))

    def allocate(self, tokens: int) -> int | None:
        """A slot holding blocks for `tokens` positions, or None when they (or a slot) do not fit now."""
        need = self.blocks_for(tokens)
        if (not self._free_slots or need > len(self._free_blocks)
                or self.used_bytes() + self.bytes_for(tokens) > self.budget):
            return None
        slot = self._free_slots.pop()
        blocks = [self._free_blocks.pop() for _ in range(need)]
        self.tables[slot, :need] = torch.tensor(blocks, dtype=torch.int32)
        self._held[slot] = need
        return slot

    def release(self, slot: int) -> None:
        need = self._held.pop(slot)
        self._free_blocks.extend(self.tables[slot, :need].tolist())
        self._free_slots.append(slot)

    @property
    def blocks_used(self) -> int:
        return self.num_blocks - len(self._free_blocks)

    def rows(self, row_seq: Sequence[int], positions: Sequence[int]) -> Rows:
        seq = torch.tensor(row_seq, dtype=torch.int64)
        pos = torch.tensor(positions, dtype=torch.int64)
        blocks = self.tables[seq, pos // self.block_size].long()
        return Rows(seq, pos, blocks * self.block_size + pos % self.block_size, pos + 1)

    # the step ----------------------------------------------------------------------------------------------------
    def store(self, layer: int, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rows: Rows,
              norms: tuple) -> torch.Tensor:
        """Write the rows' keys and values of `layer` from qkv [rows, (heads + 2 kv_heads) * dim]; the rotated
        queries [rows, heads, dim]."""
        raise NotImplementedError

    def attend(self, layer: int, q: torch.Tensor, rows: Rows, scale: float) -> torch.Tensor:
        """Each row's attention over its sequence's positions < its length: [rows, heads * dim]."""
        raise NotImplementedError

    def native_layout(self) -> NativeLayout:
        """What the native step (runtime/native_step.py) reads of the pool."""
        raise NotImplementedError


@dataclass(frozen=True)
class NativeLayout:
    """A pool as the native step takes it: each layer's tensors (float: keys and values; coded: the 11 tensors of
    paged_ops.cpp), and for the coded pool its rotary tables, bits and sink positions."""

    quantized: bool
    layers: list[list[torch.Tensor]]
    cos: torch.Tensor
    sin: torch.Tensor
    bits: int = 0
    sinks: int = 0


class FloatPool(KVPool):
    block_size = FLOAT_BLOCK
    sequence_bytes = 0

    def __init__(self, shape: Shape, budget_bytes: int, max_running: int, max_context: int,
                 dtype: str = "float16") -> None:
        if dtype not in FLOAT_DTYPES:
            raise ConfigError(f"unknown KV dtype {dtype!r}; choose one of {', '.join(FLOAT_DTYPES)}")
        self.dtype = FLOAT_DTYPES[dtype]
        self.kind = dtype
        self.block_bytes = self.bytes_per_block(shape, dtype)
        super().__init__(shape, budget_bytes, max_running, max_context)
        pool_shape = (shape.layers, self.num_blocks, shape.kv_heads, self.block_size, shape.head_dim)
        self.keys = torch.empty(pool_shape, dtype=self.dtype)
        self.values = torch.empty(pool_shape, dtype=self.dtype)
        self._layers = [(self.keys[i], self.values[i]) for i in range(shape.layers)]

    @classmethod
    def bytes_per_block(cls, shape: Shape, dtype: str) -> int:
        """Bytes of one block of keys and values across all layers."""
        return 2 * shape.layers * shape.kv_heads * cls.block_size * shape.head_dim * FLOAT_DTYPES[dtype].itemsize

    def store(self, layer, qkv, cos, sin, rows, norms):
        keys, values = self._layers[layer]
        q_norm, k_norm = norms
        return self.ops.paged_rope_store(qkv, cos, sin, keys, values, rows.slots, self.shape.heads, q_norm.weight,
                                         k_norm.weight, q_norm.eps, k_norm.eps)

    def attend(self, layer, q, rows, scale):
        keys, values = self._layers[layer]
        return self.ops.paged_attention(q, keys, values, self.tables, rows.row_seq, rows.lengths, scale)

    def native_layout(self) -> NativeLayout:
        none = torch.empty(0)
        return NativeLayout(False, [list(pair) for pair in self._layers], none, none)


class QuantPool(KVPool):
    """SimQuant codes (see the module docstring); `cos`/`sin` [max_context, dim] rotate keys as they are read."""

    def __init__(self, shape: Shape, budget_bytes: int, max_running: int, max_context: int, config: KVQuantConfig,
                 cos: torch.Tensor, sin: torch.Tensor) -> None:
        check_servable(config)
        # Its own layout: calibrated fp16 key channels are not kept, side information not compacted.
        config = dataclasses.replace(config, key_channels=0, compact=False)
        if config.key_bits != config.value_bits:
            raise ConfigError("the serving KV pool codes keys and values with the same bits; give one --kv-bits")
        self.config, self.bits, self.sinks = config, config.key_bits, config.sinks
        self.kind = config.name
        self.block_size = config.key_block
        dim = shape.head_dim
        self.outliers = config.outlier_count(dim)
        packed = dim if self.bits == 8 else math.ceil(dim / 8) * self.bits
        per_head_block = (2 * self.block_size * packed  # key and value codes
                          + 2 * dim * 2  # the block's key range per channel: lo and scale in fp16
                          + self.block_size * 3  # each value's scale (fp16) and zero point (uint8)
                          + self.block_size * self.outliers * 3)  # value outliers: fp16 value, uint8 index
        self.block_bytes = shape.layers * shape.kv_heads * per_head_block
        # sinks (keys and values) and the incomplete key block, fp16
        self.sequence_bytes = shape.layers * shape.kv_heads * (2 * self.sinks + self.block_size) * dim * 2
        super().__init__(shape, budget_bytes, max_running, max_context)
        n, kvh, b, s = self.num_blocks, shape.kv_heads, self.block_size, max_running
        u8, f16 = torch.uint8, torch.float16
        layout = [((n, kvh, b, packed), u8), ((n, kvh, dim), f16), ((n, kvh, dim), f16), ((n, kvh, b, packed), u8),
                  ((n, kvh, b), f16), ((n, kvh, b), u8), ((n, kvh, b, self.outliers), f16),
                  ((n, kvh, b, self.outliers), u8), ((s, kvh, self.sinks, dim), f16),
                  ((s, kvh, self.sinks, dim), f16), ((s, kvh, b, dim), f16)]
        self.tensors = [torch.empty((shape.layers, *size), dtype=dtype) for size, dtype in layout]
        self._layers = [[t[i] for t in self.tensors] for i in range(shape.layers)]
        self.cos, self.sin = cos.float().contiguous(), sin.float().contiguous()

    def store(self, layer, qkv, cos, sin, rows, norms):
        q_norm, k_norm = norms
        return self.ops.quant_rope_store(qkv, cos, sin, self._layers[layer], rows.slots, rows.row_seq,
                                         rows.positions, self.shape.heads, q_norm.weight, k_norm.weight, q_norm.eps,
                                         k_norm.eps, self.bits, self.sinks)

    def attend(self, layer, q, rows, scale):
        return self.ops.quant_attention(q, self._layers[layer], self.tables, rows.row_seq, rows.lengths, self.cos,
                                        self.sin, self.bits, self.sinks, scale)

    def native_layout(self) -> NativeLayout:
        return NativeLayout(True, self._layers, self.cos, self.sin, self.bits, self.sinks)


def check_servable(config: KVQuantConfig) -> None:
    """The SimQuant options the serving pool codes; the rest are ablations of the offline cache (nn/kv/)."""
    if config.levels != "uniform" or config.key_axis != "channel" or not config.pre_rope:
        raise ConfigError(f"the serving KV pool codes uniform levels, per-channel pre-RoPE keys; the cache "
                          f"{config.name} asks for another coding: serve it with --kv-bits alone")
    if not config.key_blocks:
        raise ConfigError("the serving KV pool codes keys in blocks of positions; key_block must be positive")
