"""How the quantized KV cache codes keys and values (see the package docstring), as functions of tensors:

- keys per channel on a (head, channel) range, before rotary embedding (`undo_rope` on arrival, `apply_rope_` after
  decoding), the kept channels in fp16;
- keys (ablation) and values per token, on each head vector's own range with its zero point in one byte;
- outliers: a share of each head vector kept apart in fp16 with its index;
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


def code_per_token(x: torch.Tensor, bits: int, levels: torch.Tensor | None, count: int) -> dict[str, torch.Tensor]:
    """Per-token (per head vector) dynamic range, after setting the `count` outliers of each vector apart."""
    parts: dict[str, torch.Tensor] = {}
    if count:
        parts = _outliers(x, _range_shrinking(x, count))
        mask = torch.zeros_like(x, dtype=torch.bool).scatter_(-1, parts["outlier_index"].long(), True)
        lo = torch.where(mask, torch.inf, x).amin(dim=-1, keepdim=True)
        hi = torch.where(mask, -torch.inf, x).amax(dim=-1, keepdim=True)
    else:
        lo, hi = x.amin(dim=-1, keepdim=True), x.amax(dim=-1, keepdim=True)
    zero, scale16 = _token_range(lo, hi, bits)
    codes = range_quantize(x, _token_lo(zero, scale16, bits), scale16.float(), bits, levels)
    return {"codes": pack_bits(codes, bits), "zero": zero, "scale": scale16, **parts}


@torch.no_grad()  # decoded from integer codes: nothing to differentiate, and `out=` refuses autograd
def decode_store(tensors: dict[str, torch.Tensor], bits: int, levels: torch.Tensor | None,
                 segments: list[Segment] | None, kept: torch.Tensor | None, x: torch.Tensor) -> None:
    """Decode a store's tensors into x (fp32 [batch, heads, tokens, dim]): per token (`segments` None), or per
    channel on each segment's range."""
    codes = unpack_bits(tensors["codes"], bits, x.shape[-1])
    if segments is None:  # per token
        scale = tensors["scale"]
        range_dequantize(codes, _token_lo(tensors["zero"], scale, bits), scale.float(), bits, levels, out=x)
    else:  # per channel, one range per segment
        ends = [first for first, _, _ in segments[1:]] + [codes.shape[-2]]
        for (first, lo, scale), end in zip(segments, ends, strict=True):
            range_dequantize(codes[..., first:end, :], lo.float()[:, None, :], scale.float()[:, None, :], bits,
                             levels, out=x[..., first:end, :])
    if "outlier_index" in tensors:
        x.scatter_(-1, tensors["outlier_index"].long(), tensors["outlier_values"].float())
    if "kept" in tensors:
        x.scatter_(-1, kept_index(kept, x), tensors["kept"].float())
