"""SimQuant: KV-cache quantization in the style of KVQuant (Hooper et al. 2024).

Calibration runs the model on a few calibration samples, undoes RoPE on the cached keys and takes, per layer,
head and channel, the range of the keys: their extremes when keys are coded in blocks (each block then codes on its
own range inside it), or, when each key is coded on arrival, the range that leaves the `outliers` share of values
outside. Values beyond the range are the sparse part at run time. Values need no calibration: their ranges are
per token. Without calibration data each key block stores its own range (or, coding keys on arrival, the cache
tracks key ranges online with an EMA). The result is a `KVCacheSpec`; `spec.new_cache(model)` gives the cache for
`generate`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import ClassVar

import torch
from torch import nn
from tqdm.auto import tqdm
from transformers.cache_utils import DynamicCache

from llmeasyquant.errors import ConfigError
from llmeasyquant.methods.base import CacheMethod
from llmeasyquant.models.arch import ArchSpec, arch_for, get_module, head_dim_of, query_columns
from llmeasyquant.nn.kv.cache import KVCacheSpec
from llmeasyquant.nn.kv.calibration import KeyRanges
from llmeasyquant.nn.kv.coding import check_rope_width, rope_table, undo_rope
from llmeasyquant.nn.kv.config import KVQuantConfig

log = logging.getLogger(__name__)


def _channel_quantiles(keys: torch.Tensor, share: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per column of [tokens, channels]: the values with share/2 of the tokens below and above (nearest rank)."""
    if share == 0:
        return keys.amin(dim=0), keys.amax(dim=0)
    ordered = keys.sort(dim=0).values
    last = keys.shape[0] - 1
    below = round(share / 2 * last)
    return ordered[below], ordered[last - below]


@dataclass(frozen=True)
class SimQuant(CacheMethod):
    """Calibrates a quantized KV cache; joins any recipe (`quantize(model, [GPTQ(), SimQuant()])`)."""

    name: ClassVar[str] = "simquant"

    config: KVQuantConfig = field(default_factory=KVQuantConfig)
    samples: int = 16  # calibration samples read for the key ranges (KVQuant uses 16)

    def __post_init__(self) -> None:
        if self.samples <= 0:
            raise ConfigError(f"SimQuant samples must be positive, got {self.samples}")

    @torch.no_grad()
    def calibrate(self, model: nn.Module, calib: torch.Tensor | None, progress: bool = True) -> KVCacheSpec:
        """Key ranges from calibration token ids [samples, seqlen]; None gives a cache with online ranges."""
        if calib is None or self.config.key_axis == "token":
            return KVCacheSpec(self.config)
        sinks = self.config.sinks
        if calib.shape[1] <= sinks:
            raise ConfigError(f"calibration samples of {calib.shape[1]} tokens leave nothing after the {sinks} "
                              "attention-sink tokens; use longer samples (--calib-seqlen)")
        arch = arch_for(model)
        rotary = get_module(model, arch.rotary_embedding) if arch.rotary_embedding and self.config.pre_rope else None
        if rotary is not None:
            check_rope_width(rotary, head_dim_of(model.config.get_text_config()))
        device = next(model.parameters()).device
        per_layer: list[list[torch.Tensor]] = []
        ids = calib[: self.samples]
        query_power, hooks = self._watch_queries(model, arch)
        try:
            for sample in tqdm(ids, desc="calibrating KV cache", unit="sample", disable=not progress):
                cache = DynamicCache(config=model.config)
                model(sample[None].to(device), past_key_values=cache, use_cache=True)
                for i, layer in enumerate(cache.layers):
                    keys = layer.keys[0].float()  # [heads, tokens, dim], RoPE applied
                    if rotary is not None:
                        keys = undo_rope(keys, *rope_table(rotary, keys.shape[1], keys.device))
                    keys = keys[:, sinks:].transpose(0, 1).reshape(keys.shape[1] - sinks, -1)  # sinks stay exact
                    if len(per_layer) <= i:
                        per_layer.append([])
                    per_layer[i].append(keys.cpu())
        finally:
            for hook in hooks:
                hook.remove()
        heads, dim = cache.layers[0].keys.shape[1], cache.layers[0].keys.shape[3]
        # Keys coded on arrival need a range that leaves the outlier share out; in blocks, each block finds its own
        # range inside the calibrated one, and only what lies beyond everything calibration saw is an outlier.
        share = 0.0 if self.config.key_blocks else self.config.outliers
        ranges: tuple[list, list, list] = ([], [], [])
        for i, chunks in enumerate(per_layer):
            lo, hi = _channel_quantiles(torch.cat(chunks), share)
            lo, hi = lo.reshape(heads, dim), hi.reshape(heads, dim)
            kept = self._sensitive_channels(query_power.get(i), lo, hi, rotary is not None)
            for store, value in zip(ranges, (lo, hi, kept), strict=True):
                store.append(value)
        log.info("calibrated KV key ranges on %d samples of %d tokens", ids.shape[0], ids.shape[1])
        return KVCacheSpec(self.config, KeyRanges(*(tuple(r) for r in ranges)))

    def _watch_queries(self, model: nn.Module, arch: ArchSpec) -> tuple[dict[int, torch.Tensor], list]:
        """Hooks that sum each block's squared queries per channel (what a key channel's error is multiplied by)."""
        power: dict[int, torch.Tensor] = {}
        if self.config.key_channels == 0:
            return power, []
        # A fused projection (`qkv` in the family's table) holds the queries where its `qkv_layout` says.
        config = model.config.get_text_config()
        heads = config.num_attention_heads
        columns = query_columns(arch.attention, heads, head_dim_of(config))
        path = arch.attention.q or arch.attention.qkv

        def watch(index: int):
            def hook(module: nn.Module, args: tuple, output: torch.Tensor) -> None:
                square = output.detach().float()[0, self.config.sinks:][:, columns].pow(2).mean(dim=0)
                power[index] = power.get(index, 0) + square.cpu()
            return hook

        blocks = get_module(model, arch.blocks)
        hooks = [get_module(block, path).register_forward_hook(watch(i)) for i, block in enumerate(blocks)]
        return power, hooks

    def _sensitive_channels(self, query_power: torch.Tensor | None, lo: torch.Tensor, hi: torch.Tensor,
                            rotary: bool) -> torch.Tensor:
        """Per head, the `key_channels` channels where key rounding moves attention scores most: mean squared
        query (summed over the query heads sharing the key head; averaged over each RoPE pair, which rotation
        mixes) times the squared range, to which the rounding error is proportional."""
        heads, dim = lo.shape
        count = min(self.config.key_channels, dim)
        if query_power is None or count == 0:
            return torch.zeros(heads, 0, dtype=torch.int64)
        power = query_power.reshape(heads, -1, dim).sum(dim=1)
        if rotary:
            power = (power + power.roll(dim // 2, dims=-1)) / 2
        score = power * (hi - lo).pow(2)
        return score.topk(count, dim=-1).indices.sort(dim=-1).values
