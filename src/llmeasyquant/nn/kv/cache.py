"""`QuantizedKVCache`, the transformers Cache of quantized layers (`layout.py`), and `KVCacheSpec`, what a model
needs to build one: pass `spec.new_cache(model)` as `past_key_values` to `generate` or a forward call."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from transformers.cache_utils import Cache

from llmeasyquant.errors import ConfigError
from llmeasyquant.models.arch import arch_for, get_module, head_dim_of
from llmeasyquant.nn.kv.calibration import KeyRanges
from llmeasyquant.nn.kv.coding import check_rope_width, rope_table
from llmeasyquant.nn.kv.config import KVQuantConfig
from llmeasyquant.nn.kv.layout import QuantizedKVLayer


@dataclass(frozen=True)
class KVCacheSpec:
    """What a model needs to build its quantized cache: the options, and the key ranges (None: tracked online)."""

    config: KVQuantConfig
    key_ranges: KeyRanges | None = None

    def new_cache(self, model: nn.Module) -> QuantizedKVCache:
        return QuantizedKVCache.for_model(model, self.config, self.key_ranges)



class QuantizedKVCache(Cache):
    """A transformers Cache of `QuantizedKVLayer`s: pass it as `past_key_values` to `generate` or a forward call."""

    def __init__(self, num_layers: int, config: KVQuantConfig | None = None, key_ranges: KeyRanges | None = None,
                 rotary: nn.Module | None = None):
        config = config or KVQuantConfig()
        if key_ranges is not None and len(key_ranges.lo) != num_layers:
            raise ConfigError(f"the KV key ranges cover {len(key_ranges.lo)} layers but the model has {num_layers}; "
                              "calibrate again for this model")
        self.config = config
        self._rotary = rotary
        self._rope_cache: tuple[torch.Tensor, torch.Tensor] | None = None
        rope = self._rope if rotary is not None else None
        ranges = [None] * num_layers if key_ranges is None else [key_ranges.layer(i) for i in range(num_layers)]
        super().__init__(layers=[QuantizedKVLayer(config, r, rope) for r in ranges])

    @classmethod
    def for_model(cls, model: nn.Module, config: KVQuantConfig | None = None,
                  key_ranges: KeyRanges | None = None) -> QuantizedKVCache:
        arch = arch_for(model)
        rotary = get_module(model, arch.rotary_embedding) if arch.rotary_embedding else None
        if rotary is not None and (config or KVQuantConfig()).pre_rope:
            check_rope_width(rotary, head_dim_of(model.config.get_text_config()))
        return cls(model.config.get_text_config().num_hidden_layers, config, key_ranges, rotary)

    def _rope(self, first: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        device = next(iter(self._rotary.buffers()), torch.empty(0)).device
        if self._rope_cache is None or self._rope_cache[0].shape[0] < end:
            self._rope_cache = rope_table(self._rotary, end, device)
        cos, sin = self._rope_cache
        return cos[first:end], sin[first:end]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        out = super().update(key_states, value_states, layer_idx, *args, **kwargs)
        if layer_idx == len(self.layers) - 1:
            self._rope_cache = None  # working memory of one step, not part of the cache
        return out

    def nbytes(self) -> dict[str, int]:
        """Bytes the cache holds, by part (codes, scales, key_ranges, outliers, sinks) and in total."""
        totals: dict[str, int] = {}
        for layer in self.layers:
            for part, size in layer.nbytes().items():
                totals[part] = totals.get(part, 0) + size
        totals["total"] = sum(totals.values())
        return totals

    def fp16_bytes(self) -> int:
        """Bytes an fp16 cache of the same tokens would hold (keys and values)."""
        return sum(2 * 2 * layer.length * layer.shape[0] * layer.shape[1] * layer.shape[2]
                   for layer in self.layers if layer.shape is not None)
