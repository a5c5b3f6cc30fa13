"""W4A16 in Triton: a GEMM that unpacks 4-bit weights and applies their group scales (and zero points) in the K
loop, against fp16/bf16 activations, accumulating in fp32.

Weights stay in QuantLinear's layout, uint8 [N, ceil(K / 2)] with column 2j in the low nibble of byte j and 2j + 1
in the high one, codes stored as q + 8: rows are K-contiguous, so a [BLOCK_N, BLOCK_K / 2] byte tile unpacks and
interleaves into a [BLOCK_N, BLOCK_K] tile that is the transposed (K-major) right operand of tl.dot.

Where the scales are applied depends on the group width G and the tile width BLOCK_K:
- one group per row (per-channel, or G >= K): the integers (q - z) go into the dot, the scale multiplies the result;
- G a multiple of BLOCK_K: each tile lies in one group, dot(x, q - z) * scale per tile;
- otherwise (e.g. G 32 with BLOCK_K 64): each weight is dequantized, (q - z) * s, before the dot.
The first two keep the weights exact in the dot ((q - z) in [-15, 15] is exact in fp16 and bf16).

Like w8a8.py, the kernel calls only builtins of triton.language (tl.join + tl.reshape rather than tl.interleave),
so that the interpreter runs it whenever triton was imported.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from llmeasyquant.kernels.triton.launch import INTERPRETER_CONFIG, interpreting
from llmeasyquant.kernels.triton.w8a8 import grouped_tile, prune_by_m

log = logging.getLogger(__name__)

_DOT_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


@triton.jit
def _w4a16_kernel(x_ptr, w_ptr, scale_ptr, zero_ptr, out_ptr, M, N, K, M_BUCKET, stride_xm, stride_wn, stride_sn,
                  stride_om, GROUP: tl.constexpr, ONE_GROUP: tl.constexpr, HAS_ZERO: tl.constexpr,
                  DOT_DTYPE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  GROUP_M: tl.constexpr):
    pid_m, pid_n = grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    safe_cols = cols % N  # out-of-range rows/columns wrap around; their results are not stored
    offs_k = tl.arange(0, BLOCK_K)
    offs_kb = tl.arange(0, BLOCK_K // 2)
    half_k = (K + 1) // 2
    x_ptrs = x_ptr + (rows % M).to(tl.int64)[:, None] * stride_xm + offs_k[None, :]
    w_ptrs = w_ptr + safe_cols.to(tl.int64)[:, None] * stride_wn + offs_kb[None, :]
    s_row = scale_ptr + safe_cols.to(tl.int64) * stride_sn  # [BLOCK_N] pointers to each row's first group
    z_row = zero_ptr + safe_cols.to(tl.int64) * stride_sn
    acc = tl.full([BLOCK_M, BLOCK_N], 0.0, dtype=tl.float32)
    if ONE_GROUP:
        scale = tl.load(s_row).to(tl.float32)
        if HAS_ZERO:
            zero = tl.load(z_row).to(tl.int32)
    for k0 in range(0, K, BLOCK_K):
        # Columns past K: activations 0, so whatever the padding byte decodes to adds nothing.
        x = tl.load(x_ptrs, mask=offs_k[None, :] < K - k0, other=0.0).to(DOT_DTYPE)
        packed = tl.load(w_ptrs, mask=offs_kb[None, :] < half_k - k0 // 2, other=0)
        low = (packed & 0xF).to(tl.int32) - 8  # even columns
        high = (packed >> 4).to(tl.int32) - 8  # odd columns
        q = tl.reshape(tl.join(low, high), [BLOCK_N, BLOCK_K])  # interleaved: [low0, high0, low1, ...]
        if ONE_GROUP:
            if HAS_ZERO:
                q = q - zero[:, None]
            acc = tl.dot(x, tl.trans(q.to(DOT_DTYPE)), acc)
        elif GROUP % BLOCK_K == 0:
            g = k0 // GROUP
            s = tl.load(s_row + g).to(tl.float32)
            if HAS_ZERO:
                q = q - tl.load(z_row + g).to(tl.int32)[:, None]
            acc += tl.dot(x, tl.trans(q.to(DOT_DTYPE))) * s[None, :]
        else:
            g = (k0 + offs_k) // GROUP
            g_mask = offs_k[None, :] < K - k0
            s = tl.load(s_row[:, None] + g[None, :], mask=g_mask, other=0.0).to(tl.float32)
            if HAS_ZERO:
                q = q - tl.load(z_row[:, None] + g[None, :], mask=g_mask, other=0).to(tl.int32)
            acc = tl.dot(x, tl.trans((q.to(tl.float32) * s).to(DOT_DTYPE)), acc)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K // 2
    if ONE_GROUP:
        acc = acc * scale[None, :]
    out_ptrs = out_ptr + rows.to(tl.int64)[:, None] * stride_om + cols[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=(rows < M)[:, None] & (cols < N)[None, :])


def _tuned_configs() -> list[triton.Config]:
    """Tuned for M >= 512 on H100 (fp16 tiles, BLOCK_K 64 = 128 bytes of activations per row); the BLOCK_M 16
    entries serve decode, where more, narrower column tiles keep the SMs busy streaming weights."""
    big = [(128, 128, 64, 3, 8), (128, 128, 64, 4, 4), (128, 256, 64, 3, 8), (64, 128, 64, 4, 4),
           (128, 64, 128, 3, 4)]
    small = [(16, 64, 128, 4, 4), (16, 32, 128, 4, 4), (16, 128, 64, 4, 4), (32, 64, 128, 4, 4)]
    return [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8}, num_stages=s, num_warps=w)
            for bm, bn, bk, s, w in big + small]


_w4a16_tuned = triton.autotune(configs=_tuned_configs(), key=["M_BUCKET", "N", "K", "GROUP"],
                               prune_configs_by={"early_config_prune": prune_by_m})(_w4a16_kernel)

@dataclass(frozen=True)
class PreparedInt4Weight:
    """QuantLinear's packed codes [N, ceil(K / 2)], fp16 scales and int8 zero points [N, groups], group width."""

    packed: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None
    in_features: int
    group_size: int

    @property
    def one_group(self) -> bool:
        return self.scales.shape[1] == 1


def prepare_weight(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, in_features: int,
                   group_size: int) -> PreparedInt4Weight:
    """Done once per layer: the stored layout is the kernel's, so this only makes the tensors contiguous."""
    if qweight.dtype != torch.uint8 or qweight.shape[1] != (in_features + 1) // 2:
        raise ValueError(f"expected uint8 codes [out, {(in_features + 1) // 2}], got {qweight.dtype} "
                         f"{tuple(qweight.shape)}")
    return PreparedInt4Weight(packed=qweight.contiguous(), scales=scales.contiguous(),
                              zeros=None if zeros is None else zeros.contiguous(), in_features=in_features,
                              group_size=group_size)


def w4a16_matmul(x: torch.Tensor, weight: PreparedInt4Weight, dot_dtype: torch.dtype = torch.float16,
                 out_dtype: torch.dtype | None = None, config: dict | None = None) -> torch.Tensor:
    """x [M, K] (fp32/fp16/bf16, rounded to `dot_dtype` in the kernel) @ dequantized weight^T -> [M, N] as
    `out_dtype` (default: x's dtype). `config` fixes the tile sizes (otherwise autotuned on GPUs; the interpreter
    always uses small fixed tiles)."""
    if dot_dtype not in _DOT_DTYPES:
        raise ValueError(f"the dot takes fp16 or bf16 activations, not {dot_dtype}")
    m, k = x.shape
    if k != weight.in_features:
        raise ValueError(f"activations have {k} columns, weights {weight.in_features}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    n = weight.packed.shape[0]
    out = torch.empty(m, n, dtype=out_dtype or x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    zeros = weight.zeros if weight.zeros is not None else weight.scales  # placeholder pointer when symmetric
    args = (x, weight.packed, weight.scales, zeros, out, m, n, k, min(triton.next_power_of_2(m), 4096), x.stride(0),
            weight.packed.stride(0), weight.scales.stride(0), out.stride(0))
    # One group per row: GROUP is unused, so 0 rather than K avoids compiling a kernel per input width.
    flags = {"GROUP": 0 if weight.one_group else weight.group_size, "ONE_GROUP": weight.one_group,
             "HAS_ZERO": weight.zeros is not None, "DOT_DTYPE": _DOT_DTYPES[dot_dtype]}
    if config is None and not interpreting():
        def grid(meta: dict) -> tuple[int]:
            return (triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"]),)

        _w4a16_tuned[grid](*args, **flags)
    else:
        config = dict(config or INTERPRETER_CONFIG)
        grid = (triton.cdiv(m, config["BLOCK_M"]) * triton.cdiv(n, config["BLOCK_N"]),)
        _w4a16_kernel[grid](*args, **flags, **config)
    return out
