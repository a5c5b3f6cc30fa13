"""The paged KV-cache operators of native/paged_ops.cpp in PyTorch: the same names, arguments and results, slow and
plain. They are the oracle of the operators' tests and the serving engine's fallback where the extension cannot be
built.

Paging. A layer's cache is a pool of N blocks of B positions. A running sequence has a slot s in 0..S-1 and a block
table row `tables[s]` (int32 [M]): its position p lives in block `tables[s, p // B]` at offset `p % B`, flat slot
`tables[s, p // B] * B + p % B`. A step runs `rows` query rows, possibly of different sequences: row r belongs to
sequence `row_seq[r]`, sits at position `positions[r]`, is stored at flat slot `slots[r]` and attends over `lengths[r]
= positions[r] + 1` positions (all int64). Rows of one sequence come in increasing position order. A step first
stores every row's key and value, then runs attention for every row: a row sees the pool as the whole step left it.

Float pool (keys after rotary): `key_pool`, `value_pool` [N, kv_heads, B, dim], float32 or float16.

Quantized pool (the SimQuant coding of nn/kv/coding.py and nn/kv/key_blocks.py, uniform levels): `bits` in
{2, 3, 4, 8} for keys and values, P = ceil(dim / 8) * bits bytes a packed vector (dim for 8 bits) as
`primitives.pack_bits` lays them out. A list of 11 tensors, in this order (`QUANT_POOL`):

 0 key_codes            [N, kv_heads, B, P] uint8    pre-rotary keys of complete blocks, per channel on their range
 1 key_lo               [N, kv_heads, dim] float16   the block's range per channel (KeyBlocks online mode): lo = min,
 2 key_scale            [N, kv_heads, dim] float16   scale = (max - lo) / (2^bits - 1), at least 2^-24
 3 value_codes          [N, kv_heads, B, P] uint8    values per token as `code_per_token` codes them
 4 value_scale          [N, kv_heads, B] float16     its step
 5 value_zero           [N, kv_heads, B] uint8       its zero point, in `_zero_steps` parts of a step
 6 value_outlier_values [N, kv_heads, B, n_out] float16  the outliers `_range_shrinking` sets apart (n_out may be 0)
 7 value_outlier_index  [N, kv_heads, B, n_out] uint8
 8 sink_keys            [S, kv_heads, sinks, dim] float16  post-rotary keys of positions < sinks (sinks may be 0)
 9 sink_values          [S, kv_heads, sinks, dim] float16
10 residual_keys        [S, kv_heads, B, dim] float16      pre-rotary keys of the sequence's incomplete block, at p % B

Positions p < sinks live only in the sink buffers (their slots stay unused, and block 0's key range covers only its
positions >= sinks). A position p >= sinks has its value coded at once into its slot and its key (after the key norm,
before rotary) written to residual_keys; when p is its block's last position the block's keys (positions
max(sinks, block start) .. block end - 1) are coded from residual_keys. Attention reads the sinks from their buffers,
complete blocks from their codes, the sequence's last, incomplete block from residual_keys (a sequence's stored
length is the largest `lengths[r]` of its rows in the call), and rotates keys by their position's cos/sin.
"""

from __future__ import annotations

import torch

from llmeasyquant.models.arch import rotate_half
from llmeasyquant.nn.kv.coding import code_per_token, decode_store
from llmeasyquant.primitives import MIN_SCALE, pack_bits, range_dequantize, range_quantize, unpack_bits

QUANT_POOL = ("key_codes", "key_lo", "key_scale", "value_codes", "value_scale", "value_zero", "value_outlier_values",
              "value_outlier_index", "sink_keys", "sink_values", "residual_keys")


def _norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMS norm bit for bit as paged_ops.cpp computes it (the quantized pool codes the normalised keys, so they must
    match): the squares summed in double (each exact there), then fp32 steps. PyTorch's fp32 sqrt is not correctly
    rounded on every CPU (SLEEF), the C++ one is: it is taken in double and rounded once, which is exact."""
    mean = (x.double().square().sum(-1, keepdim=True) / x.shape[-1]).float()
    root = torch.sqrt((mean + eps).double()).float()
    return weight * (x * (1.0 / root))


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + rotate_half(x) * sin


def _split_qkv(qkv: torch.Tensor, heads: int, kv_heads: int, dim: int, q_norm: torch.Tensor | None,
               k_norm: torch.Tensor | None, q_eps: float, k_eps: float
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(queries [rows, heads, dim], keys, values [rows, kv_heads, dim]), queries and keys normalised when asked."""
    if (q_norm is None) != (k_norm is None):
        raise ValueError("give both query and key norms or neither")
    rows = qkv.shape[0]
    q = qkv[:, : heads * dim].reshape(rows, heads, dim).float()
    k = qkv[:, heads * dim: (heads + kv_heads) * dim].reshape(rows, kv_heads, dim).float()
    v = qkv[:, (heads + kv_heads) * dim:].reshape(rows, kv_heads, dim).float()
    if q_norm is not None and k_norm is not None:
        q, k = _norm(q, q_norm.float(), q_eps), _norm(k, k_norm.float(), k_eps)
    return q, k, v


def _softmax_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
    """One row's queries [heads, dim] over keys/values [kv_heads, length, dim] (grouped-query) -> [heads * dim]."""
    group = q.shape[0] // keys.shape[0]
    keys, values = keys.repeat_interleave(group, dim=0), values.repeat_interleave(group, dim=0)
    weights = torch.softmax(torch.einsum("hd,htd->ht", q, keys) * scale, dim=-1)
    return torch.einsum("ht,htd->hd", weights, values).reshape(-1)


# ---- float pool ----------------------------------------------------------------------------------------------------

@torch.no_grad()
def paged_rope_store(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, key_pool: torch.Tensor,
                     value_pool: torch.Tensor, slots: torch.Tensor, heads: int, q_norm: torch.Tensor | None,
                     k_norm: torch.Tensor | None, q_eps: float, k_eps: float) -> torch.Tensor:
    """Rotated queries [rows, heads, dim] of qkv [rows, (heads + 2 kv_heads) * dim]; row r's rotated key and its
    value written at flat slot slots[r] of the pools [N, kv_heads, B, dim] (rounded to their dtype)."""
    _, kv_heads, block, dim = key_pool.shape
    q, k, v = _split_qkv(qkv, heads, kv_heads, dim, q_norm, k_norm, q_eps, k_eps)
    cos, sin = cos.float()[:, None], sin.float()[:, None]
    q, k = _rope(q, cos, sin), _rope(k, cos, sin)
    slots = slots.long()
    blocks, offsets = slots // block, slots % block
    key_pool[blocks, :, offsets] = k.to(key_pool.dtype)
    value_pool[blocks, :, offsets] = v.to(value_pool.dtype)
    return q


@torch.no_grad()
def paged_attention(q: torch.Tensor, key_pool: torch.Tensor, value_pool: torch.Tensor, tables: torch.Tensor,
                    row_seq: torch.Tensor, lengths: torch.Tensor, scale: float) -> torch.Tensor:
    """softmax(scale * q k^T) v of each row [rows, heads, dim] over its sequence's positions 0..lengths[r]-1 ->
    [rows, heads * dim]."""
    _, kv_heads, block, dim = key_pool.shape
    out = torch.empty(q.shape[0], q.shape[1] * dim)
    for r in range(q.shape[0]):
        length = int(lengths[r])
        blocks = tables[int(row_seq[r]), : -(-length // block)].long()
        keys = key_pool[blocks].float().transpose(0, 1).reshape(kv_heads, -1, dim)[:, :length]
        values = value_pool[blocks].float().transpose(0, 1).reshape(kv_heads, -1, dim)[:, :length]
        out[r] = _softmax_attention(q[r].float(), keys, values, scale)
    return out


# ---- quantized pool ------------------------------------------------------------------------------------------------

def _code_key_block(pool: list[torch.Tensor], seq: int, pool_block: int, first: int, bits: int) -> None:
    """Code residual rows first..B-1 of a sequence into pool block `pool_block` (KeyBlocks' online coding)."""
    keys = pool[10][seq, :, first:].float()  # [kv_heads, n, dim]
    lo16 = keys.amin(dim=1).half()
    scale16 = ((keys.amax(dim=1) - lo16.float()) / (2**bits - 1)).clamp(min=MIN_SCALE).half()
    codes = range_quantize(keys, lo16.float()[:, None], scale16.float()[:, None], bits)
    pool[0][pool_block, :, first:] = pack_bits(codes, bits)
    pool[1][pool_block], pool[2][pool_block] = lo16, scale16


@torch.no_grad()
def quant_rope_store(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pool: list[torch.Tensor],
                     slots: torch.Tensor, row_seq: torch.Tensor, positions: torch.Tensor, heads: int,
                     q_norm: torch.Tensor | None, k_norm: torch.Tensor | None, q_eps: float, k_eps: float, bits: int,
                     sinks: int) -> torch.Tensor:
    """Rotated queries [rows, heads, dim]; each row's key and value stored in the quantized pool (module docstring),
    rows in order."""
    _, kv_heads, block, _ = pool[0].shape
    dim, n_out = pool[1].shape[-1], pool[6].shape[-1]
    q, k, v = _split_qkv(qkv, heads, kv_heads, dim, q_norm, k_norm, q_eps, k_eps)
    cos, sin = cos.float()[:, None], sin.float()[:, None]
    parts = code_per_token(v, bits, None, n_out)  # per vector: independent of the other rows
    for r in range(qkv.shape[0]):
        seq, position, slot = int(row_seq[r]), int(positions[r]), int(slots[r])
        if position < sinks:
            pool[8][seq, :, position] = _rope(k[r], cos[r], sin[r]).half()
            pool[9][seq, :, position] = v[r].half()
            continue
        pool_block, offset = divmod(slot, block)
        pool[3][pool_block, :, offset] = parts["codes"][r]
        pool[4][pool_block, :, offset] = parts["scale"][r, :, 0]
        pool[5][pool_block, :, offset] = parts["zero"][r, :, 0]
        if n_out:
            pool[6][pool_block, :, offset] = parts["outlier_values"][r]
            pool[7][pool_block, :, offset] = parts["outlier_index"][r]
        pool[10][seq, :, offset] = k[r].half()
        if offset == block - 1:
            _code_key_block(pool, seq, pool_block, max(sinks - (position - offset), 0), bits)
    return _rope(q, cos, sin)


@torch.no_grad()
def quant_gather(pool: list[torch.Tensor], table: torch.Tensor, seq: int, length: int, cos_table: torch.Tensor,
                 sin_table: torch.Tensor, bits: int, sinks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(keys, values) [kv_heads, length, dim] fp32 of sequence `seq` stored up to `length`, keys rotated: what
    quant_attention reads."""
    _, kv_heads, block, _ = pool[0].shape
    dim = pool[1].shape[-1]
    keys, values = torch.empty(kv_heads, length, dim), torch.empty(kv_heads, length, dim)
    count = min(sinks, length)
    keys[:, :count], values[:, :count] = pool[8][seq, :, :count].float(), pool[9][seq, :, :count].float()
    for b in range(sinks // block, -(-length // block)):
        first, end = max(b * block, sinks), min(b * block + block, length)
        if first >= end:
            continue
        pool_block, rows = int(table[b]), slice(first - b * block, end - b * block)
        if b * block + block <= length:  # complete: decoded from the block's codes on its per-channel range
            codes = unpack_bits(pool[0][pool_block, :, rows], bits, dim)
            pre = range_dequantize(codes, pool[1][pool_block].float()[:, None], pool[2][pool_block].float()[:, None],
                                   bits)
        else:  # the incomplete last block
            pre = pool[10][seq, :, rows].float()
        keys[:, first:end] = _rope(pre, cos_table[first:end].float(), sin_table[first:end].float())
        tensors = {"codes": pool[3][pool_block, :, rows], "scale": pool[4][pool_block, :, rows, None],
                   "zero": pool[5][pool_block, :, rows, None]}
        if pool[6].shape[-1]:
            tensors |= {"outlier_values": pool[6][pool_block, :, rows], "outlier_index": pool[7][pool_block, :, rows]}
        decoded = torch.empty(kv_heads, end - first, dim)
        decode_store(tensors, bits, None, None, None, decoded)
        values[:, first:end] = decoded
    return keys, values


@torch.no_grad()
def quant_attention(q: torch.Tensor, pool: list[torch.Tensor], tables: torch.Tensor, row_seq: torch.Tensor,
                    lengths: torch.Tensor, cos_table: torch.Tensor, sin_table: torch.Tensor, bits: int, sinks: int,
                    scale: float) -> torch.Tensor:
    """paged_attention over the quantized pool: each row over the keys and values `quant_gather` decodes for its
    sequence at its stored length -> [rows, heads * dim]."""
    stored: dict[int, int] = {}
    for seq, length in zip(row_seq.tolist(), lengths.tolist(), strict=True):
        stored[seq] = max(stored.get(seq, 0), length)
    cache = {seq: quant_gather(pool, tables[seq], seq, length, cos_table, sin_table, bits, sinks)
             for seq, length in stored.items()}
    dim = pool[1].shape[-1]
    out = torch.empty(q.shape[0], q.shape[1] * dim)
    for r, (seq, length) in enumerate(zip(row_seq.tolist(), lengths.tolist(), strict=True)):
        keys, values = cache[seq]
        out[r] = _softmax_attention(q[r].float(), keys[:, :length], values[:, :length], scale)
    return out
