"""W8A8 in Triton: quantize activation rows to int8, then an int8 x int8 -> int32 GEMM with a dequantizing epilogue.

y[m, n] = s_x[m] s_w[n] Σ_k (q_x[m, k] - z_x[m]) (q_w[n, k] - z_w[n])
        = s_x s_w (Σ q_x q_w - z_w Σ_k q_x - z_x (Σ_k q_w - K z_w)),
so one integer GEMM does the work and zero points (when asymmetric) are rank-1 corrections in the epilogue.

The quantization pass reproduces `choose_qparams` + `quantize` of primitives.py bit for bit: the same fp32 range
(including zero), IEEE divisions (`div_rn`: Triton's `/` may be approximate on GPUs), round half to even as
`torch.round` does, then the clamp.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from llmeasyquant.kernels.triton.launch import INTERPRETER_CONFIG, interpreting

log = logging.getLogger(__name__)

# primitives._MIN_SCALE, the scale of an all-zero row; constexpr because jitted code may only read such globals.
_MIN_SCALE = tl.constexpr(2.0**-24)
_QUANT_BLOCK = 1024  # columns per step of the row-quantization loop


@triton.jit
def round_half_even(v):
    """torch.round: halves go to the even neighbour (libdevice.rint would do, but the interpreter lacks it).
    v - floor(v) is exact in fp32 except for -0.5 < v < 0, where it may round but stays >= 0.5 and both
    candidates give 0, so the result is always torch.round's (up to the sign of zero)."""
    f = tl.floor(v)
    d = v - f
    half = f * 0.5
    odd = half != tl.floor(half)
    return tl.where((d > 0.5) | ((d == 0.5) & odd), f + 1.0, f)


# The kernels call only builtins of triton.language, not its @jit helpers (tl.sum, tl.max, tl.cdiv, tl.zeros,
# tl.interleave): those were compiled-mode functions if triton was imported before TRITON_INTERPRET was set
# (transformers imports it), and the interpreter cannot call them. Reductions use the builtin tl.reduce with the
# standard library's combine functions, which the interpreter recognises and runs in numpy.
_MIN, _MAX, _SUM = tl.standard._elementwise_min, tl.standard._elementwise_max, tl.standard._sum_combine


@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, scale_ptr, zero_ptr, qsum_ptr, in_scale_ptr, in_zero_ptr,
                          K, stride_xm, stride_qm, in_stride,
                          DYNAMIC: tl.constexpr, HAS_ZERO: tl.constexpr, BLOCK_K: tl.constexpr):
    """One program per row. DYNAMIC: the row's range gives its scale (and zero point); otherwise they are read
    from in_scale_ptr / in_zero_ptr at row * in_stride (stride 0: one per-tensor scale)."""
    row = tl.program_id(0)
    x_row = x_ptr + row.to(tl.int64) * stride_xm
    q_row = q_ptr + row.to(tl.int64) * stride_qm
    offs = tl.arange(0, BLOCK_K)
    if DYNAMIC:
        # Running min/max starting at zero: the range always includes zero, and masked lanes (0.0) change nothing.
        lo_acc = tl.full([BLOCK_K], 0.0, dtype=tl.float32)
        hi_acc = tl.full([BLOCK_K], 0.0, dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            v = tl.load(x_row + k0 + offs, mask=offs < K - k0, other=0.0).to(tl.float32)
            lo_acc = tl.minimum(lo_acc, v)
            hi_acc = tl.maximum(hi_acc, v)
        lo = tl.reduce(lo_acc, 0, _MIN)
        hi = tl.reduce(hi_acc, 0, _MAX)
        if HAS_ZERO:
            scale = tl.maximum(tl.math.div_rn(hi - lo, 255.0), _MIN_SCALE)
            zero = tl.minimum(tl.maximum(round_half_even(-128.0 - tl.math.div_rn(lo, scale)), -128.0), 127.0)
        else:
            scale = tl.maximum(tl.math.div_rn(tl.maximum(-lo, hi), 127.0), _MIN_SCALE)
    else:
        scale = tl.load(in_scale_ptr + row * in_stride).to(tl.float32)
        if HAS_ZERO:
            zero = tl.load(in_zero_ptr + row * in_stride).to(tl.float32)
    qsum = tl.full([BLOCK_K], 0, dtype=tl.int32)
    for k0 in range(0, K, BLOCK_K):
        mask = offs < K - k0
        v = tl.load(x_row + k0 + offs, mask=mask, other=0.0).to(tl.float32)
        q = round_half_even(tl.math.div_rn(v, scale))
        if HAS_ZERO:
            q = q + zero
        q = tl.minimum(tl.maximum(q, -128.0), 127.0).to(tl.int32)
        tl.store(q_row + k0 + offs, q.to(tl.int8), mask=mask)
        qsum += tl.where(mask, q, 0)
    tl.store(scale_ptr + row, scale)
    if HAS_ZERO:
        tl.store(zero_ptr + row, zero.to(tl.int32))
    else:
        tl.store(zero_ptr + row, 0)
    tl.store(qsum_ptr + row, tl.reduce(qsum, 0, _SUM))


def _tuned_configs() -> list[triton.Config]:
    """Tuned for M >= 512 on H100 (int8 tiles with BLOCK_K 128 = 128 bytes per row, several stages of cp.async);
    the BLOCK_M 16/32/64 entries only serve decode-sized M (pruned away for large M, kept alone for small M)."""
    big = [(128, 128, 128, 4, 8), (128, 256, 128, 3, 8), (256, 128, 128, 3, 8), (128, 128, 64, 4, 4),
           (128, 128, 128, 3, 4)]
    small = [(64, 128, 128, 4, 4), (32, 128, 128, 4, 4), (16, 128, 128, 4, 4), (16, 64, 256, 4, 4)]
    return [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8}, num_stages=s, num_warps=w)
            for bm, bn, bk, s, w in big + small]


def prune_by_m(configs: list[triton.Config], nargs: dict, **kwargs) -> list[triton.Config]:
    """Tiles taller than the (bucketed) token count waste the tensor cores: skip them when tuning."""
    limit = max(16, nargs["M_BUCKET"])
    return [c for c in configs if c.kwargs["BLOCK_M"] <= limit] or configs


@triton.jit
def grouped_tile(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(row tile, column tile) of program `pid` in grouped launch order: GROUP_M row tiles in turn take each
    column tile, so it is read from L2 rather than memory by all but the first."""
    num_m = (M + BLOCK_M - 1) // BLOCK_M
    num_n = (N + BLOCK_N - 1) // BLOCK_N
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    return first_m + (pid % per_group) % size_m, (pid % per_group) // size_m


@triton.jit
def _int8_gemm_kernel(a_ptr, b_ptr, out_ptr, a_scale_ptr, a_zero_ptr, a_sum_ptr, b_scale_ptr, b_zero_ptr, b_sum_ptr,
                      M, N, K, M_BUCKET, stride_am, stride_bn, stride_om,
                      A_ZERO: tl.constexpr, B_ZERO: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    """out[M, N] = epilogue(a[M, K] @ b[N, K]^T); b is K-contiguous, the operand layout int8 tensor cores take."""
    pid_m, pid_n = grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    # Out-of-range rows/columns wrap around instead of being masked: their results are simply not stored.
    a_ptrs = a_ptr + (rows % M).to(tl.int64)[:, None] * stride_am + offs_k[None, :]
    b_ptrs = b_ptr + (cols % N).to(tl.int64)[:, None] * stride_bn + offs_k[None, :]
    acc = tl.full([BLOCK_M, BLOCK_N], 0, dtype=tl.int32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = offs_k[None, :] < K - k0  # zeros past K add nothing to the integer sums
        a = tl.load(a_ptrs, mask=k_mask, other=0)
        b = tl.load(b_ptrs, mask=k_mask, other=0)
        acc = tl.dot(a, tl.trans(b), acc, out_dtype=tl.int32)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    row_ok = rows < M
    col_ok = cols < N
    if B_ZERO:
        a_sum = tl.load(a_sum_ptr + rows, mask=row_ok, other=0)
        b_zero = tl.load(b_zero_ptr + cols, mask=col_ok, other=0)
        acc -= a_sum[:, None] * b_zero[None, :]
    if A_ZERO:
        a_zero = tl.load(a_zero_ptr + rows, mask=row_ok, other=0)
        b_sum = tl.load(b_sum_ptr + cols, mask=col_ok, other=0)  # Σ_k q_w - K z_w, prepared once
        acc -= a_zero[:, None] * b_sum[None, :]
    a_scale = tl.load(a_scale_ptr + rows, mask=row_ok, other=0.0)
    b_scale = tl.load(b_scale_ptr + cols, mask=col_ok, other=0.0)
    out = acc.to(tl.float32) * a_scale[:, None] * b_scale[None, :]
    out_ptrs = out_ptr + rows.to(tl.int64)[:, None] * stride_om + cols[None, :]
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


_int8_gemm_tuned = triton.autotune(configs=_tuned_configs(), key=["M_BUCKET", "N", "K"],
                                   prune_configs_by={"early_config_prune": prune_by_m})(_int8_gemm_kernel)

@dataclass(frozen=True)
class QuantizedRows:
    """int8 activation codes [M, K] and per-row fp32 scales, int32 zero points (0 when symmetric), code sums."""

    q: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    qsum: torch.Tensor
    has_zero: bool


@dataclass(frozen=True)
class PreparedInt8Weight:
    """The layer's int8 codes [N, K] (K-contiguous), fp32 row scales, zero points and adjusted code sums."""

    w: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor | None
    w_sum: torch.Tensor  # Σ_k q_w - K z_w: the coefficient of the activations' zero point


def prepare_weight(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None) -> PreparedInt8Weight:
    """Done once per layer: the [out, in] int8 layout is already what the GEMM wants; only the per-row terms."""
    w = qweight.contiguous()
    w_sum = w.sum(dim=1, dtype=torch.int32)
    zero = None
    if zeros is not None:
        zero = zeros[:, 0].to(torch.int32).contiguous()
        w_sum = w_sum - w.shape[1] * zero
    return PreparedInt8Weight(w=w, scale=scales[:, 0].float().contiguous(), zero=zero, w_sum=w_sum.contiguous())


def _quantize(x: torch.Tensor, dynamic: bool, has_zero: bool, in_scale: torch.Tensor | None,
              in_zero: torch.Tensor | None, in_stride: int) -> QuantizedRows:
    if x.stride(-1) != 1:
        x = x.contiguous()
    m, k = x.shape
    q = torch.empty(m, k, dtype=torch.int8, device=x.device)
    scale = torch.empty(m, dtype=torch.float32, device=x.device)
    zero = torch.empty(m, dtype=torch.int32, device=x.device)
    qsum = torch.empty(m, dtype=torch.int32, device=x.device)
    if m:
        # Unused pointer arguments get a real tensor: the kernel never reads them (constexpr branches).
        in_scale = scale if in_scale is None else in_scale
        in_zero = zero if in_zero is None else in_zero
        block = min(_QUANT_BLOCK, triton.next_power_of_2(max(k, 16)))
        _quantize_rows_kernel[(m,)](x, q, scale, zero, qsum, in_scale, in_zero, k, x.stride(0), q.stride(0),
                                    in_stride, DYNAMIC=dynamic, HAS_ZERO=has_zero, BLOCK_K=block)
    return QuantizedRows(q=q, scale=scale, zero=zero, qsum=qsum, has_zero=has_zero)


def quantize_per_token(x: torch.Tensor, symmetric: bool = True) -> QuantizedRows:
    """Dynamic per-token int8 quantization of x [M, K] (fp32/fp16/bf16): each row's range sets its scale."""
    return _quantize(x, dynamic=True, has_zero=not symmetric, in_scale=None, in_zero=None, in_stride=0)


def quantize_with_scale(x: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None = None) -> QuantizedRows:
    """int8 quantization of x [M, K] with given scales (and zero points): one per tensor (static or dynamic
    per-tensor activations) or one per row. The absmax pass is skipped."""
    m = x.shape[0]
    scale = scale.reshape(-1).float().contiguous()
    if scale.numel() not in (1, m):
        raise ValueError(f"expected 1 or {m} activation scales, got {scale.numel()}")
    stride = 0 if scale.numel() == 1 else 1
    if zero is not None:
        zero = zero.reshape(-1).to(torch.int32).contiguous()
        if zero.numel() != scale.numel():
            raise ValueError("activation zero points and scales differ in number")
    return _quantize(x, dynamic=False, has_zero=zero is not None, in_scale=scale, in_zero=zero, in_stride=stride)


def int8_matmul(qx: QuantizedRows, weight: PreparedInt8Weight, out_dtype: torch.dtype = torch.float32,
                config: dict | None = None) -> torch.Tensor:
    """Dequantized qx @ weight^T as `out_dtype` [M, N]. `config` fixes the tile sizes (otherwise autotuned on GPUs;
    the interpreter always uses small fixed tiles)."""
    m, k = qx.q.shape
    n = weight.w.shape[0]
    if weight.w.shape[1] != k:
        raise ValueError(f"activations have {k} columns, weights {weight.w.shape[1]}")
    out = torch.empty(m, n, dtype=out_dtype, device=qx.q.device)
    if m == 0 or n == 0:
        return out
    b_zero = weight.zero if weight.zero is not None else weight.w_sum  # placeholder pointer when symmetric
    args = (qx.q, weight.w, out, qx.scale, qx.zero, qx.qsum, weight.scale, b_zero, weight.w_sum,
            m, n, k, min(triton.next_power_of_2(m), 4096), qx.q.stride(0), weight.w.stride(0), out.stride(0))
    flags = {"A_ZERO": qx.has_zero, "B_ZERO": weight.zero is not None}
    if config is None and not interpreting():
        def grid(meta: dict) -> tuple[int]:
            return (triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"]),)

        _int8_gemm_tuned[grid](*args, **flags)
    else:
        config = dict(config or INTERPRETER_CONFIG)
        grid = (triton.cdiv(m, config["BLOCK_M"]) * triton.cdiv(n, config["BLOCK_N"]),)
        _int8_gemm_kernel[grid](*args, **flags, **config)
    return out


def w8a8_linear(x: torch.Tensor, weight: PreparedInt8Weight, out_dtype: torch.dtype | None = None,
                symmetric_act: bool = True) -> torch.Tensor:
    """Dynamic per-token W8A8 linear (no bias): both kernels, for benchmarks and direct use."""
    return int8_matmul(quantize_per_token(x, symmetric_act), weight, out_dtype or x.dtype)
