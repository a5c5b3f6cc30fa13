"""The only rounding math in the library: quantization parameters, quantize, dequantize, int4 packing.

Codes live in the signed domain [-2^(b-1), 2^(b-1) - 1] for every bit width, with an integer zero point
(0 when symmetric), so that x ≈ (q - zero) * scale. Tensors are 2-D [rows, cols]; groups run along cols.
With a non-uniform grid (QParams.levels, grid.py) x ≈ levels[q + L/2] * scale instead (L levels: 16, or 8 at 3 bits).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llmeasyquant.errors import DataError
from llmeasyquant.grid import grid_codes, grid_params, grid_values
from llmeasyquant.scheme import Granularity, PerChannel, PerGroup, PerTensor, PerToken

# Smallest positive fp16 value: a scale below it would round to zero when stored.
MIN_SCALE = 2.0**-24


def qrange(bits: int) -> tuple[int, int]:
    """Signed code range of a bit width, e.g. (-8, 7) for 4 bits."""
    return -(2 ** (bits - 1)), 2 ** (bits - 1) - 1


@dataclass(frozen=True)
class QParams:
    """Scales [rows, groups] (float32), zero points [rows, groups] (int32, None when symmetric), group width, and for
    a non-uniform grid its levels [1, L] (shared) or [rows, L] (per row), float32 (then no zero points)."""

    scale: torch.Tensor
    zero: torch.Tensor | None
    group_size: int
    levels: torch.Tensor | None = None


def group_width(granularity: Granularity, cols: int) -> int:
    return min(granularity.size, cols) if isinstance(granularity, PerGroup) else cols


def grouped_view(x: torch.Tensor, width: int) -> torch.Tensor:
    """[rows, cols] -> [rows, groups, width], the last group padded with zeros (which every range includes)."""
    rows, cols = x.shape
    groups = -(-cols // width)
    pad = groups * width - cols
    if pad:
        x = torch.nn.functional.pad(x, (0, pad))
    return x.reshape(rows, groups, width)


def _round_up_to(scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The smallest `dtype` value >= scale, back in fp32: rounding a scale down would clip the group's extremes."""
    if bool((scale > torch.finfo(dtype).max).any()):
        raise DataError(f"a quantization scale exceeds the {dtype} maximum ({torch.finfo(dtype).max:g}): the weights "
                        "hold values too large to quantize; check the model for damaged weights")
    stored = scale.to(dtype)
    below = stored.float() < scale
    if bool(below.any()):
        stored = torch.where(below, torch.nextafter(stored, torch.full_like(stored, float("inf"))), stored)
    return stored.float()


def group_ranges(x: torch.Tensor, granularity: Granularity) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(min, max, group width) of each group of a 2-D tensor, widened to include zero: [rows or 1, groups]."""
    if x.dim() != 2:
        raise ValueError(f"expected a 2-D tensor, got shape {tuple(x.shape)}")
    x = x.detach().float()
    width = group_width(granularity, x.shape[1])
    grouped = grouped_view(x, width)  # [rows, groups, width]
    lo = grouped.amin(dim=-1).clamp(max=0)
    hi = grouped.amax(dim=-1).clamp(min=0)
    if isinstance(granularity, PerTensor):
        lo, hi = lo.amin().reshape(1, 1), hi.amax().reshape(1, 1)
    elif not isinstance(granularity, PerChannel | PerToken | PerGroup):
        raise ValueError(f"unknown granularity {granularity!r}")
    return lo, hi, width


def choose_qparams(x: torch.Tensor, bits: int, symmetric: bool, granularity: Granularity,
                   scale_dtype: torch.dtype | None = torch.float16, grid: str | None = None,
                   importance: torch.Tensor | None = None) -> QParams:
    """Scales and zero points from the min/max of each group.

    The range always includes zero so that zero is exact. Scales are rounded to `scale_dtype` (the storage
    type) before codes are computed, so stored weights dequantize to exactly what was evaluated.
    With a `grid` (symmetric) the scales (and a learned grid's tables) are searched by grid.py instead, for the
    least squared error weighted per column by `importance` [cols] (e.g. GPTQ's Hessian diagonal); always fp16-exact.
    """
    if grid is not None:
        if x.dim() != 2:
            raise ValueError(f"expected a 2-D tensor, got shape {tuple(x.shape)}")
        width = group_width(granularity, x.shape[1])
        if isinstance(granularity, PerTensor):
            raise ValueError("a grid's scales are per group or per channel, not per tensor")
        scale, levels = grid_params(x.detach().float(), grid, width, importance, bits)
        return QParams(scale=scale, zero=None, group_size=width, levels=levels)
    lo, hi, width = group_ranges(x, granularity)
    qmin, qmax = qrange(bits)
    scale = torch.maximum(-lo, hi) / qmax if symmetric else (hi - lo) / (qmax - qmin)
    scale = scale.clamp(min=MIN_SCALE)
    if scale_dtype is not None:
        scale = _round_up_to(scale, scale_dtype)
    zero = None
    if not symmetric:
        zero = torch.round(qmin - lo / scale).clamp(qmin, qmax).to(torch.int32)
    return QParams(scale=scale, zero=zero, group_size=width)


def expand_groups(params: torch.Tensor, width: int, rows: int, cols: int) -> torch.Tensor:
    """[rows or 1, groups] -> [rows, cols], each group's value repeated over its columns."""
    if params.shape[1] == 1:  # one group per row: a broadcast view, no [rows, cols] copy to fill
        return params.expand(rows, cols)
    return params.repeat_interleave(width, dim=1)[:, :cols].expand(rows, cols)


def quantize(x: torch.Tensor, qp: QParams, bits: int) -> torch.Tensor:
    """Float [rows, cols] -> int8 codes in the signed range of `bits` (on a grid: the nearest level's index - L/2)."""
    rows, cols = x.shape
    if qp.levels is not None:
        return grid_codes(x, expand_groups(qp.scale, qp.group_size, rows, cols), qp.levels)
    qmin, qmax = qrange(bits)
    q = torch.round(x.float() / expand_groups(qp.scale, qp.group_size, rows, cols))
    if qp.zero is not None:
        q = q + expand_groups(qp.zero, qp.group_size, rows, cols)
    return q.clamp(qmin, qmax).to(torch.int8)


def dequantize(codes: torch.Tensor, qp: QParams) -> torch.Tensor:
    """int8 codes [rows, cols] -> float32 values (q - zero) * scale (on a grid: levels[q + L/2] * scale)."""
    rows, cols = codes.shape
    if qp.levels is not None:
        return grid_values(codes, expand_groups(qp.scale, qp.group_size, rows, cols), qp.levels)
    q = codes.float()
    if qp.zero is not None:
        q = q - expand_groups(qp.zero, qp.group_size, rows, cols)
    return q * expand_groups(qp.scale, qp.group_size, rows, cols)


def fake_quantize(x: torch.Tensor, bits: int, symmetric: bool, granularity: Granularity,
                  scale_dtype: torch.dtype | None = None, grid: str | None = None) -> torch.Tensor:
    """Quantize then dequantize; for error measurement and for the reference path of activations."""
    shape = x.shape
    flat = x.reshape(-1, shape[-1])
    qp = choose_qparams(flat, bits, symmetric, granularity, scale_dtype, grid=grid)
    return dequantize(quantize(flat, qp, bits), qp).reshape(shape).to(x.dtype)


def clip_activations(x: torch.Tensor, clip: float, symmetric: bool, granularity: Granularity) -> torch.Tensor:
    """x with each token (row of the last dimension; the whole tensor per tensor) limited to `clip` times its range:
    [-c max|x|, c max|x|] when symmetric, [c min(x, 0), c max(x, 0)] otherwise. The dynamic scale then computed from
    the clipped x covers exactly that fraction (its extremes are the bounds), so the integer kernels need no change.
    x itself when clip is 1."""
    if clip >= 1.0:
        return x
    dims = tuple(range(x.dim())) if isinstance(granularity, PerTensor) else (-1,)
    if symmetric:
        bound = torch.amax(x.abs(), dim=dims, keepdim=True) * clip
        return torch.clamp(x, -bound, bound)
    lo = torch.amin(x, dim=dims, keepdim=True).clamp(max=0) * clip
    hi = torch.amax(x, dim=dims, keepdim=True).clamp(min=0) * clip
    return torch.clamp(x, lo, hi)


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """int8 codes in [-8, 7], [rows, cols] -> uint8 [rows, ceil(cols / 2)]: even column low nibble, odd high."""
    if codes.numel() and (codes.min() < -8 or codes.max() > 7):
        raise ValueError("int4 codes must lie in [-8, 7]")
    unsigned = (codes.to(torch.int16) + 8).to(torch.uint8)
    if unsigned.shape[1] % 2:
        unsigned = torch.nn.functional.pad(unsigned, (0, 1), value=8)
    return unsigned[:, 0::2] | (unsigned[:, 1::2] << 4)


def unpack_int4(packed: torch.Tensor, cols: int) -> torch.Tensor:
    """Inverse of `pack_int4`: uint8 [rows, ceil(cols / 2)] -> int8 codes [rows, cols]."""
    low = (packed & 0x0F).to(torch.int8) - 8
    high = (packed >> 4).to(torch.int8) - 8
    return torch.stack((low, high), dim=-1).reshape(packed.shape[0], -1)[:, :cols].contiguous()


def check_finite(tensor: torch.Tensor, name: str) -> None:
    """Refuse NaN or infinite weights: rounding them gives garbage codes silently."""
    if not torch.isfinite(tensor).all():
        bad = int((~torch.isfinite(tensor)).sum())
        raise DataError(
            f"{name} has {bad} NaN or infinite value(s); the model's weights are damaged. "
            "Reload the model from a good source before quantizing."
        )


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Unsigned codes [..., n] in [0, 2^bits) -> uint8 [..., ceil(n / 8) * bits]: each run of 8 codes fills `bits`
    bytes, least significant bits first, so 2-, 3- and 4-bit codes pack without wasted bits (8-bit codes are
    stored as they are, [..., n])."""
    if bits == 8:
        return codes.to(torch.uint8)
    n = codes.shape[-1]
    pad = -n % 8
    if 8 % bits == 0:  # whole codes per byte: the same layout in uint8 arithmetic, without int64 words
        per_byte = 8 // bits
        grouped = torch.nn.functional.pad(codes.to(torch.uint8), (0, pad)).reshape(*codes.shape[:-1], -1, per_byte)
        shifted = grouped << (torch.arange(per_byte, device=codes.device, dtype=torch.uint8) * bits)
        return shifted.sum(dim=-1, dtype=torch.uint8)
    wide = torch.nn.functional.pad(codes.to(torch.int64), (0, pad)).reshape(*codes.shape[:-1], -1, 8)
    shifts = torch.arange(8, device=codes.device) * bits
    word = (wide << shifts).sum(dim=-1, keepdim=True)  # 8 codes in the low 8*bits bits of one int64
    byte_shifts = torch.arange(bits, device=codes.device) * 8
    return ((word >> byte_shifts) & 0xFF).to(torch.uint8).reshape(*codes.shape[:-1], -1)


def unpack_bits(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Inverse of `pack_bits`: uint8 [..., ceil(n / 8) * bits] -> unsigned codes (uint8) [..., n]."""
    if bits == 8:
        return packed[..., :n]
    if 8 % bits == 0:  # one scalar shift per code of a byte, no tensor of shifts to broadcast
        mask = (1 << bits) - 1
        codes = torch.stack([(packed >> (i * bits)) & mask for i in range(8 // bits)], dim=-1)
        return codes.reshape(*packed.shape[:-1], -1)[..., :n]
    # 8 codes in `bits` bytes, read as one word (int32 while it holds them: 3 bits) and split with scalar shifts.
    chunks = packed.to(torch.int32 if 8 * bits < 32 else torch.int64).reshape(*packed.shape[:-1], -1, bits)
    word = chunks[..., 0]
    for i in range(1, bits):
        word = word | (chunks[..., i] << (8 * i))
    mask = (1 << bits) - 1
    codes = torch.stack([(word >> (i * bits)) & mask for i in range(8)], dim=-1)
    return codes.to(torch.uint8).reshape(*packed.shape[:-1], -1)[..., :n]


def normal_float_levels(bits: int) -> torch.Tensor:
    """2^bits levels on [0, 1] placed at evenly spaced quantiles of a normal distribution (NF-style signposts):
    dense near the middle, where roughly bell-shaped data lies, sparse at the ends."""
    count = 2**bits
    probs = (torch.arange(count, dtype=torch.float64) + 0.5) / count
    z = torch.special.ndtri(probs)
    return ((z - z[0]) / (z[-1] - z[0])).float()


def range_quantize(x: torch.Tensor, lo: torch.Tensor, scale: torch.Tensor, bits: int,
                   levels: torch.Tensor | None = None) -> torch.Tensor:
    """Unsigned codes of x on the range [lo, lo + scale * (2^bits - 1)] (values outside are clamped).

    Uniform levels round (x - lo) / scale; with `levels` (on [0, 1], increasing) each value takes the nearest level.
    """
    top = 2**bits - 1
    t = (x.float() - lo) / scale
    if levels is None:
        return t.round_().clamp_(0, top).to(torch.uint8)
    midpoints = (levels[1:] + levels[:-1]) / 2 * top
    return torch.bucketize(t.clamp_(0, top).contiguous(), midpoints.to(t.device)).to(torch.uint8)


def range_dequantize(codes: torch.Tensor, lo: torch.Tensor, scale: torch.Tensor, bits: int,
                     levels: torch.Tensor | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """Inverse of `range_quantize`, in float32 (written into `out` when given)."""
    q = codes.float() if levels is None else levels.to(codes.device)[codes.long()] * (2**bits - 1)
    if out is None:
        return q * scale + lo
    return torch.mul(q, scale, out=out).add_(lo)
