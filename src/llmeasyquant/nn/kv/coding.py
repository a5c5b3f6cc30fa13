"""How the quantized KV cache codes keys and values (see the package docstring), as functions of tensors:

- keys per channel on a (head, channel) range, before rotary embedding (`undo_rope` on arrival, `apply_rope_` after
  decoding), the kept channels in fp16;
- keys (ablation) and values per token, on each head vector's own range with its zero point in one byte;
- outliers: a share of each head vector kept apart in fp16 with its index (with compact side information, values'
  outliers in int8 steps of their token's grid, and each value vector's range the best of a few clipped ones);
- levels: uniform, or normal-float levels (`KVQuantConfig.levels`).

What a coder returns is the named tensors a `TokenStore` appends; `decode_store` writes them back as fp32.
"""

from __future__ import annotations

import torch
from torch import nn

from llmeasyquant.errors import ConfigError
from llmeasyquant.models.arch import rotate_half
from llmeasyquant.nn.kv.key_blocks import kept_index
from llmeasyquant.primitives import MIN_SCALE, pack_bits, range_dequantize, range_quantize, unpack_bits

# One range per segment of channel-coded keys: (first quantized token, lo [heads, dim], scale [heads, dim]).
Segment = tuple[int, torch.Tensor, torch.Tensor]

# Compact side information: each value vector's range is the one of these fractions of its outlier-free min-max
# range (around zero) that rounds the vector with the least squared error. Min-max is rarely best: the extreme
# values of the dense part are few, and a finer step serves all the others (SmolLM2's values at 3 bits, five
# outliers apart: 3% of the vectors keep min-max, the step chosen is 0.89 of it on average, 0.7 for 4 of 181,440).
CLIP_FRACTIONS = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7)
# Compact value outliers: int8 multiples of the token's step from the grid's bottom; one further out is held at the
# last (SmolLM2's furthest at 3 bits, WikiText-2, is 73 steps out).
OUTLIER_STEPS = (-128, 127)


@torch.no_grad()
def apply_rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """`apply_rope` (models/arch.py) in place, with the same products and sums (so the same bits), without its
    temporaries."""
    half = x.shape[-1] // 2
    first = x[..., half:] * sin[..., :half]  # what rotate_half(x) * sin subtracts from the first half
    second = x[..., :half] * sin[..., half:]  # and adds to the second
    x.mul_(cos)
    x[..., :half] -= first
    x[..., half:] += second


def undo_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Inverse of `apply_rope` (rotation by -θ, divided by the squared attention scaling cos² + sin²)."""
    return (x * cos - rotate_half(x) * sin) / (cos * cos + sin * sin)


def rope_table(rotary: nn.Module, length: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) [length, head_dim] in fp32 from a model's rotary-embedding module."""
    positions = torch.arange(length, device=device)[None]
    try:
        cos, sin = rotary(torch.zeros((), dtype=torch.float32, device=device), positions)
    except TypeError as exc:  # Gemma 3's takes a layer type: local and global layers rotate differently
        raise ConfigError(f"{type(rotary).__name__} gives no one rotary table for every layer ({exc}), which keys "
                          "quantized before RoPE need; use KVQuantConfig(pre_rope=False)") from exc
    return cos[0].float(), sin[0].float()


def check_rope_width(rotary: nn.Module, head_dim: int) -> None:
    """Refuse a partial rotary embedding (GPT-NeoX rotates a quarter of each head): undoing RoPE on arrival
    rotates whole heads."""
    width = rope_table(rotary, 1, next(iter(rotary.buffers()), torch.empty(0)).device)[0].shape[-1]
    if width != head_dim:
        raise ConfigError(f"this model's rotary embedding turns {width} of the {head_dim} channels of each head; keys "
                          "quantized before RoPE need whole heads rotated: use KVQuantConfig(pre_rope=False)")


def range_params(lo: torch.Tensor, hi: torch.Tensor, bits: int, margin: float = 1.0
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(lo, scale) as stored (fp16) for the range [lo, hi] widened `margin` times around its centre."""
    if margin != 1.0:
        centre, half = (hi + lo) / 2, (hi - lo) / 2 * margin
        lo, hi = centre - half, centre + half
    scale = ((hi - lo) / (2**bits - 1)).clamp(min=MIN_SCALE)
    return lo.half(), scale.half()


def _zero_steps(bits: int) -> int:
    """Parts of a step the per-token zero point is stored in: as many as fit its 2^bits - 1 steps into a uint8."""
    return 256 // 2**bits


def _token_range(lo: torch.Tensor, hi: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(zero, scale) stored for a per-token range: the fp16 step and, in one byte instead of an fp16 lo, where zero
    lies on the grid in 1/`_zero_steps` of a step. The range is widened to hold 0 (head vectors nearly always do),
    and the grid moves by at most 1/32 of a step at 4 bits, so the largest values still land within half a step."""
    lo, hi = lo.clamp(max=0), hi.clamp(min=0)
    scale = ((hi - lo) / (2**bits - 1)).clamp(min=MIN_SCALE).half()
    parts = _zero_steps(bits)
    zero = (-lo / scale.float() * parts).round().clamp(0, (2**bits - 1) * parts)
    return zero.to(torch.uint8), scale


def _token_lo(zero: torch.Tensor, scale: torch.Tensor, bits: int) -> torch.Tensor:
    """The fp32 bottom of the grid `_token_range` stored."""
    return -zero.float() / _zero_steps(bits) * scale.float()


def _range_shrinking(x: torch.Tensor, count: int) -> torch.Tensor:
    """Per vector (last dim), the indices of the `count` values whose removal leaves the narrowest range: the a
    smallest and the count - a largest, for the best a."""
    ordered, order = x.sort(dim=-1)
    n = x.shape[-1]
    spans = torch.stack([ordered[..., n - 1 - (count - a)] - ordered[..., a] for a in range(count + 1)], dim=-1)
    low = spans.argmin(dim=-1, keepdim=True)  # how many of them are taken from the bottom
    j = torch.arange(count, device=x.device)
    return order.gather(-1, torch.where(j < low, j, n - 1 - (j - low)))


def _outliers(x: torch.Tensor, index: torch.Tensor) -> dict[str, torch.Tensor]:
    index_dtype = torch.uint8 if x.shape[-1] <= 256 else torch.int16
    return {"outlier_values": x.gather(-1, index).half(), "outlier_index": index.to(index_dtype)}


def code_per_channel(keys: torch.Tensor, lo: torch.Tensor, scale: torch.Tensor, bits: int,
                     levels: torch.Tensor | None, kept: torch.Tensor | None, count: int) -> dict[str, torch.Tensor]:
    """Keys [batch, heads, tokens, dim] on their segment's per-channel range (lo, scale [heads, dim] as stored),
    the `kept` channels ([1, heads, 1, n] or None) in fp16 and the `count` furthest values of each vector apart."""
    lo, scale = lo.float()[:, None, :], scale.float()[:, None, :]
    parts = {"codes": pack_bits(range_quantize(keys, lo, scale, bits, levels), bits)}
    if kept is not None:
        parts["kept"] = keys.gather(-1, kept_index(kept, keys)).half()
    if count:
        # Furthest from the channel's range centre, in units of its step: what clamping would hurt most.
        score = (keys - (lo + scale * (2**bits - 1) / 2)).abs() / scale
        if kept is not None:  # stored exactly already
            score = score.scatter(-1, kept_index(kept, score), -torch.inf)
        parts |= _outliers(keys, score.topk(count, dim=-1).indices)
    return parts


def code_per_token(x: torch.Tensor, bits: int, levels: torch.Tensor | None, count: int,
                   compact: bool = False) -> dict[str, torch.Tensor]:
    """Per-token (per head vector) dynamic range, after setting the `count` outliers of each vector apart; with
    `compact` the range is searched (`CLIP_FRACTIONS`) and the outliers are kept in int8 steps of the token's grid
    (`OUTLIER_STEPS`, 16 bits each with the index instead of 24)."""
    parts: dict[str, torch.Tensor] = {}
    dense = torch.ones_like(x, dtype=torch.bool)
    if count:
        parts = _outliers(x, _range_shrinking(x, count))
        dense.scatter_(-1, parts["outlier_index"].long(), False)
    lo = torch.where(dense, x, torch.inf).amin(dim=-1, keepdim=True)
    hi = torch.where(dense, x, -torch.inf).amax(dim=-1, keepdim=True)
    best = None
    for fraction in CLIP_FRACTIONS if compact else (1.0,):
        zero, scale16 = _token_range(lo * fraction, hi * fraction, bits)
        token_lo, scale = _token_lo(zero, scale16, bits), scale16.float()
        codes = range_quantize(x, token_lo, scale, bits, levels)
        if compact:
            error = (range_dequantize(codes, token_lo, scale, bits, levels) - x).square_().mul_(dense).sum(-1, True)
            if best is not None:  # keep the earlier (wider) range on a tie
                better = error < best[-1]
                zero, scale16, codes, error = (torch.where(better, new, old) for new, old in
                                               zip((zero, scale16, codes, error), best, strict=True))
            best = (zero, scale16, codes, error)
    if compact and count:
        outliers = x.gather(-1, parts["outlier_index"].long())
        steps = (outliers - _token_lo(zero, scale16, bits)) / scale16.float()
        parts["outlier_values"] = steps.round_().clamp_(*OUTLIER_STEPS).to(torch.int8)
    return {"codes": pack_bits(codes, bits), "zero": zero, "scale": scale16, **parts}


@torch.no_grad()  # decoded from integer codes: nothing to differentiate, and `out=` refuses autograd
def decode_store(tensors: dict[str, torch.Tensor], bits: int, levels: torch.Tensor | None,
                 segments: list[Segment] | None, kept: torch.Tensor | None, x: torch.Tensor) -> None:
    """Decode a store's tensors into x (fp32 [batch, heads, tokens, dim]): per token (`segments` None), or per
    channel on each segment's range."""
    codes = unpack_bits(tensors["codes"], bits, x.shape[-1])
    outliers = tensors.get("outlier_values")
    if segments is None:  # per token
        scale = tensors["scale"]
        token_lo = _token_lo(tensors["zero"], scale, bits)
        range_dequantize(codes, token_lo, scale.float(), bits, levels, out=x)
        if outliers is not None and outliers.dtype == torch.int8:  # compact: steps of the token's grid
            outliers = token_lo + outliers.float() * scale.float()
    else:  # per channel, one range per segment
        ends = [first for first, _, _ in segments[1:]] + [codes.shape[-2]]
        for (first, lo, scale), end in zip(segments, ends, strict=True):
            range_dequantize(codes[..., first:end, :], lo.float()[:, None, :], scale.float()[:, None, :], bits,
                             levels, out=x[..., first:end, :])
    if outliers is not None:
        x.scatter_(-1, tensors["outlier_index"].long(), outliers.float())
    if "kept" in tensors:
        x.scatter_(-1, kept_index(kept, x), tensors["kept"].float())
