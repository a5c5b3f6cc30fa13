"""Key ranges per (head, channel), on which keys coded one at a time are quantized: calibrated offline
(`KeyRanges`, which SimQuant measures on calibration data) or measured online on the keys as they arrive (the layer
tracks those with an EMA observer, `online_key_range`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llmeasyquant.errors import ConfigError


@dataclass(frozen=True)
class KeyRanges:
    """Calibrated per-channel key ranges, one [kv_heads, head_dim] lo and hi per layer, and per layer the
    [kv_heads, key_channels] indices of the key channels kept in fp16 (no columns when none are)."""

    lo: tuple[torch.Tensor, ...]
    hi: tuple[torch.Tensor, ...]
    kept: tuple[torch.Tensor, ...]

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.lo[i], self.hi[i], self.kept[i]

    def to_tensors(self) -> dict[str, torch.Tensor]:
        out = {}
        for i, (lo, hi, kept) in enumerate(zip(self.lo, self.hi, self.kept, strict=True)):
            out |= {f"layers.{i}.key_lo": lo.float().contiguous(), f"layers.{i}.key_hi": hi.float().contiguous(),
                    f"layers.{i}.key_kept": kept.to(torch.int64).contiguous()}
        return out

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor]) -> KeyRanges:
        layers = len(tensors) // 3
        try:
            return cls(*(tuple(tensors[f"layers.{i}.key_{part}"] for i in range(layers))
                         for part in ("lo", "hi", "kept")))
        except KeyError as exc:
            raise ConfigError(f"the KV key ranges are incomplete: {exc.args[0]} is missing") from exc


def online_key_range(keys: torch.Tensor, share: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The (lo, hi) [heads, dim] of new keys [batch, heads, tokens, dim] per (head, channel): the range leaving the
    outlier `share` of values outside when there are several tokens, else the extremes."""
    flat = keys.transpose(1, 2).reshape(-1, keys.shape[1] * keys.shape[3])  # [batch * tokens, heads * dim]
    if share and flat.shape[0] > 1:
        ext = torch.quantile(flat, torch.tensor([share / 2, 1 - share / 2], device=flat.device), dim=0)
        lo, hi = ext[0], ext[1]
    else:
        lo, hi = flat.amin(dim=0), flat.amax(dim=0)
    heads, dim = keys.shape[1], keys.shape[3]
    return lo.reshape(heads, dim), hi.reshape(heads, dim)
