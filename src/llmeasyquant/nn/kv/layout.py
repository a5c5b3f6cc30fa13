"""One attention layer of the quantized KV cache (`QuantizedKVLayer`): where its tokens are kept (see the package
docstring). The sinks stay as they are; later keys and values are coded on arrival (`coding.py`, keys in blocks of
positions by `key_blocks.py`) into token stores, appended along the tokens and reordered along the batch, and every
update reads back all of them, decoded, rotated again and after the sinks."""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers.cache_utils import CacheLayerMixin

from llmeasyquant.errors import ConfigError
from llmeasyquant.nn.kv.calibration import online_key_range
from llmeasyquant.nn.kv.coding import (
    Segment,
    apply_rope_,
    code_per_channel,
    code_per_token,
    decode_store,
    range_params,
    undo_rope,
)
from llmeasyquant.nn.kv.config import KVQuantConfig
from llmeasyquant.nn.kv.key_blocks import KeyBlocks, TokenStore
from llmeasyquant.nn.observers import EMARangeObserver
from llmeasyquant.primitives import normal_float_levels

Rope = Callable[[int, int], tuple[torch.Tensor, torch.Tensor]]  # (first, end) position -> cos, sin [end-first, D]


class QuantizedKVLayer(CacheLayerMixin):
    """One attention layer's quantized cache (see the package docstring): the sink tokens as they are, then keys
    and values in token stores (or keys in `KeyBlocks`), decoded back whole on every update."""

    def __init__(self, config: KVQuantConfig,
                 key_range: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None, rope: Rope | None = None):
        super().__init__()
        self.config = config
        self.rope = rope if config.pre_rope else None
        self.key_range = key_range
        self.observer = EMARangeObserver(config.momentum)
        self.length = 0
        self.sinks = TokenStore()
        self.key_store = TokenStore()
        self.value_store = TokenStore()
        # Channel-axis keys: (first quantized token, lo [H, D], scale [H, D]) per segment sharing one range.
        self.segments: list[Segment] = []
        self.quantized = 0
        self.kept: torch.Tensor | None = None  # [1, heads, 1, n] key channels stored in fp16
        self.key_blocks: KeyBlocks | None = None
        self.shape: tuple[int, int, int] | None = None  # batch, heads, head_dim

    # transformers' layer protocol ----------------------------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        batch, heads, _, dim = key_states.shape
        if value_states.shape[-1] != dim:
            raise ConfigError("QuantizedKVCache needs keys and values of the same head size")
        if self.key_range is not None and self.config.key_axis == "channel":
            lo, hi, kept = self.key_range
            if tuple(lo.shape) != (heads, dim) or kept.shape[0] != heads:
                raise ConfigError(f"the KV key ranges were calibrated for keys of shape {tuple(lo.shape)} but this "
                                  f"model's are ({heads}, {dim}); calibrate again for this model")
            self.segments = [(0, *range_params(lo.to(self.device).float(), hi.to(self.device).float(),
                                               self.config.key_bits, self.config.margin))]
            self.kept = kept.to(self.device).long()[None, :, None, :] if kept.numel() else None
        self.shape = (batch, heads, dim)
        self.levels = {bits: normal_float_levels(bits).to(self.device) if self.config.levels == "nf" else None
                       for bits in {self.config.key_bits, self.config.value_bits}}
        if self.config.key_blocks:
            reference = None if self.key_range is None else tuple(r.to(self.device).float()
                                                                  for r in self.key_range[:2])
            self.key_blocks = KeyBlocks(self.config.key_bits, self.config.key_block, self.config.sinks,
                                        self.levels[self.config.key_bits], reference, self.kept,
                                        sparse=self.config.outliers > 0, compact=self.config.compact)
            self.segments = []
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        # What the cache returns is decoded from integer codes: no gradient flows through it.
        key_states, value_states = key_states.detach(), value_states.detach()
        tokens = key_states.shape[-2]
        start = self.length
        n_sink = min(max(self.config.sinks - start, 0), tokens)
        if n_sink:
            sink_dtype = self.dtype if self.dtype.itemsize <= 2 else torch.float16
            self.sinks.append(keys=key_states[..., :n_sink, :].to(sink_dtype),
                              values=value_states[..., :n_sink, :].to(sink_dtype))
        if tokens > n_sink:
            keys = key_states[..., n_sink:, :].float()
            if self.rope is not None:
                keys = undo_rope(keys, *self.rope(start + n_sink, start + tokens))
            pieces: tuple[torch.Tensor, ...] = (keys,)
            if self.key_range is None and self.config.key_axis == "channel" and not self.config.key_blocks:
                # Online ranges: split at segment boundaries so that each segment gets its own range snapshot.
                first = self.config.segment - (self.quantized - self.segments[-1][0]) if self.segments else 0
                pieces = keys.tensor_split([c for c in range(first, keys.shape[-2], self.config.segment) if c > 0],
                                           dim=-2)
            self._store_tokens(self.value_store, value_states[..., n_sink:, :].float(), self.config.value_bits)
            for piece in pieces:
                self._store_keys(piece)
                self.quantized += piece.shape[-2]
        self.length += tokens
        return self._keys(), self._values()

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.__init__(self.config, self.key_range, self.rope)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        for store in (self.sinks, self.key_store, self.value_store):
            store.reorder(beam_idx)
        if self.key_blocks is not None:
            self.key_blocks.reorder(beam_idx)
        if self.shape is not None:
            self.shape = (beam_idx.shape[0], *self.shape[1:])

    # storage -------------------------------------------------------------------------------------------------
    def _store_keys(self, keys: torch.Tensor) -> None:
        if self.key_blocks is not None:
            self.key_blocks.append(keys)
            return
        if self.config.key_axis == "token":
            self._store_tokens(self.key_store, keys, self.config.key_bits)
            return
        bits = self.config.key_bits
        _, lo, scale = self._key_segment(keys)
        self.key_store.append(**code_per_channel(keys, lo, scale, bits, self.levels[bits], self.kept,
                                                 self.config.outlier_count(keys.shape[-1])))

    def _key_segment(self, keys: torch.Tensor) -> tuple[int, torch.Tensor, torch.Tensor]:
        """The range the new keys are coded on: the calibrated one, or a snapshot of the online EMA range taken
        when the current segment has `segment` tokens already (or none exists)."""
        if self.key_range is not None:
            return self.segments[-1]
        lo, hi = self.observer.update(*online_key_range(keys, self.config.outliers))
        if not self.segments or self.quantized - self.segments[-1][0] >= self.config.segment:
            self.segments.append((self.quantized, *range_params(lo, hi, self.config.key_bits, self.config.margin)))
        return self.segments[-1]

    def _store_tokens(self, store: TokenStore, x: torch.Tensor, bits: int) -> None:
        """Per-token (per head vector) dynamic range, after setting the outliers apart."""
        store.append(**code_per_token(x, bits, self.levels[bits], self.config.outlier_count(x.shape[-1]),
                                      self.config.compact))

    # reading back --------------------------------------------------------------------------------------------
    def _dequantize(self, store: TokenStore, bits: int, segments: list[Segment] | None, x: torch.Tensor) -> None:
        """Decode the store into x (fp32 [batch, heads, tokens, dim])."""
        decode_store(store.tensors, bits, self.levels[bits], segments, self.kept, x)

    def _read(self, name: str, decode: Callable[[torch.Tensor], None]) -> torch.Tensor:
        """All keys or values, written into one fp32 tensor: the sinks, then what `decode` writes after them."""
        batch, heads, dim = self.shape
        out = torch.empty(batch, heads, self.length, dim, device=self.device)
        sunk = self.length - self.quantized
        if sunk:
            out[..., :sunk, :] = self.sinks.tensors[name]
        if self.quantized:
            decode(out[..., sunk:, :])
        return out.to(self.dtype)

    def _keys(self) -> torch.Tensor:
        def decode(keys: torch.Tensor) -> None:
            if self.key_blocks is not None:
                self.key_blocks.read(keys)
            else:
                per_channel = self.segments if self.config.key_axis == "channel" else None
                self._dequantize(self.key_store, self.config.key_bits, per_channel, keys)
            if self.rope is not None:
                apply_rope_(keys, *self.rope(self.length - self.quantized, self.length))

        return self._read("keys", decode)

    def _values(self) -> torch.Tensor:
        return self._read("values", lambda values: self._dequantize(self.value_store, self.config.value_bits, None,
                                                                    values))

    def nbytes(self) -> dict[str, int]:
        segments = sum(lo.numel() * lo.element_size() + s.numel() * s.element_size() for _, lo, s in self.segments)
        out = {"sinks": self.sinks.nbytes(), "key_ranges": segments}
        for store in (self.key_store, self.value_store):
            for name, tensor in store.tensors.items():
                part = {"codes": "codes", "kept": "kept_channels"}.get(name, "scales")
                part = "outliers" if name.startswith("outlier") else part
                out[part] = out.get(part, 0) + tensor.numel() * tensor.element_size()
        for part, size in (self.key_blocks.nbytes() if self.key_blocks is not None else {}).items():
            out[part] = out.get(part, 0) + size
        return out
