"""QuantizedKVCache: a transformers Cache holding keys and values as packed low-bit codes, in the style of KVQuant.

- Keys per channel, before rotary embedding: RoPE is undone on arrival and redone after dequantization, because
  keys have fixed outlier channels that rotation would smear across pairs. By default keys are coded in blocks of
  `key_block` positions, each channel on the block's own range within the calibrated one (`kv_key_blocks.py`);
  with `key_block=0` each key is coded on arrival on its (head, channel) range, calibrated offline (`KeyRanges`)
  or tracked online with an EMA observer, as in KVQuant.
- Values per token, with a dynamic range per (token, head).
- Dense-and-sparse: the `outliers` share of each head vector that lies furthest out is kept apart in fp16 with
  its index; the dense rest is quantized on the tighter range.
- Attention sinks: the first `sinks` tokens are kept unquantized, in 16 bits (the model's dtype when it has 16 bits,
  fp16 otherwise: the precision of the fp16 cache the quantized one is measured against).

Every update returns the dequantized keys and values, so the quantization error reaches attention: evaluation
through this cache measures what a quantized cache costs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from transformers.cache_utils import Cache, CacheLayerMixin

from llmeasyquant.errors import ConfigError
from llmeasyquant.models.arch import arch_for, get_module
from llmeasyquant.nn.kv_key_blocks import KeyBlocks, TokenStore, kept_index
from llmeasyquant.observers import EMARangeObserver
from llmeasyquant.primitives import (
    MIN_SCALE,
    normal_float_levels,
    pack_bits,
    range_dequantize,
    range_quantize,
    unpack_bits,
)
from llmeasyquant.scheme import SUPPORTED_BITS

KEY_AXES = ("channel", "token")
LEVELS = ("uniform", "nf")
# How much wider than calibrated (or tracked) the key range is coded, by bit width, when the config gives no
# `key_margin`. At 8 bits a step is so fine that headroom costs nothing, while clamping a prompt's keys that fall
# outside the calibration data costs a lot (SmolLM2: max logit error 0.6-1.9 at 1x, 0.13-0.32 at 2x); at 4 bits
# and below each step counts and the outlier slots catch the stragglers.
DEFAULT_KEY_MARGIN = {2: 1.0, 3: 1.0, 4: 1.0, 8: 2.0}

# Defaults that depend on the bit width; a field left at None takes the entry for its bits, else BASE_DEFAULTS. At 3
# bits the 4-bit defaults cost SmolLM2 +5% perplexity; key blocks of 16, three value outliers per 64 and two fp16 key
# channels per head +2.3-2.7%, still in less memory than the 4-bit cache (docs/RESULTS.md). Key options follow the
# key bits, the outlier share the value bits.
BASE_DEFAULTS = {"outliers": 0.01, "key_block": 32, "key_channels": 0}
BIT_DEFAULTS = {
    "outliers": ("value_bits", {3: 0.047}),
    "key_block": ("key_bits", {3: 16}),
    "key_channels": ("key_bits", {3: 2}),
}

Rope = Callable[[int, int], tuple[torch.Tensor, torch.Tensor]]  # (first, end) position -> cos, sin [end-first, D]


@dataclass(frozen=True)
class KVQuantConfig:
    """How the cache quantizes. Options left at None take their default for the bit width (BIT_DEFAULTS).
    `outliers` is the share of each head vector kept apart in fp16 (0 for none);
    `key_axis` 'token' and `pre_rope` False exist for ablations; `momentum` and `segment` drive online key ranges
    (one snapshot of the tracked range per `segment` tokens)."""

    key_bits: int = 4
    value_bits: int = 4
    outliers: float | None = None  # None: 0.01, or BIT_DEFAULTS for the value bits
    sinks: int = 8
    # Per head, the calibrated most sensitive key channels, kept in fp16 for every token (None: 0, 2 at 3 bits).
    key_channels: int | None = None
    key_block: int | None = None  # keys coded per block of this many positions (0: each on arrival; None: 32, 16 at 3)
    key_margin: float | None = None  # key_block=0: range widening around its centre; None: DEFAULT_KEY_MARGIN
    key_axis: str = "channel"
    pre_rope: bool = True
    levels: str = "uniform"
    momentum: float = 0.99
    segment: int = 128

    def __post_init__(self) -> None:
        for what, bits in (("key", self.key_bits), ("value", self.value_bits)):
            if bits not in SUPPORTED_BITS:
                raise ConfigError(f"unsupported KV-cache {what} bit width {bits!r}; choose one of "
                                  f"{', '.join(map(str, SUPPORTED_BITS))}")
        for name, (bits_field, by_bits) in BIT_DEFAULTS.items():
            if getattr(self, name) is None:
                object.__setattr__(self, name, by_bits.get(getattr(self, bits_field), BASE_DEFAULTS[name]))
        if not 0.0 <= self.outliers < 0.5:
            raise ConfigError(f"the KV outlier share must lie in [0, 0.5), e.g. 0.01 for 1%; got {self.outliers}")
        if isinstance(self.sinks, bool) or not isinstance(self.sinks, int) or self.sinks < 0:
            raise ConfigError(f"KV sinks must be a token count of 0 or more, got {self.sinks!r}")
        if self.key_axis not in KEY_AXES:
            raise ConfigError(f"unknown key axis {self.key_axis!r}; choose one of {', '.join(KEY_AXES)}")
        if self.levels not in LEVELS:
            raise ConfigError(f"unknown KV levels {self.levels!r}; choose one of {', '.join(LEVELS)}")
        if not 0.0 <= self.momentum < 1.0:
            raise ConfigError(f"the EMA momentum must lie in [0, 1), got {self.momentum}")
        if isinstance(self.key_channels, bool) or not isinstance(self.key_channels, int) or self.key_channels < 0:
            raise ConfigError(f"key_channels must be a channel count of 0 or more, got {self.key_channels!r}")
        if self.key_margin is not None and not self.key_margin >= 1.0:
            raise ConfigError(f"key_margin widens the key range and must be 1 or more, got {self.key_margin}")
        if isinstance(self.key_block, bool) or not isinstance(self.key_block, int) or self.key_block < 0:
            raise ConfigError(f"key_block must be a position count of 0 or more (0 codes each key on arrival), "
                              f"got {self.key_block!r}")
        if self.segment <= 0:
            raise ConfigError(f"the key-range segment must be a positive token count, got {self.segment}")

    @property
    def key_blocks(self) -> bool:
        """Whether keys are coded in blocks of positions (per-channel keys and key_block > 0)."""
        return self.key_block > 0 and self.key_axis == "channel"

    @property
    def margin(self) -> float:
        return DEFAULT_KEY_MARGIN[self.key_bits] if self.key_margin is None else self.key_margin

    def outlier_count(self, dim: int) -> int:
        """Outliers kept per head vector of `dim` values: the share rounded, at least one when the share is > 0."""
        return 0 if self.outliers == 0 else max(1, round(self.outliers * dim))

    @property
    def name(self) -> str:
        bits = f"k{self.key_bits}v{self.value_bits}"
        extras = [f"o{self.outliers:g}" if self.outliers else "", f"s{self.sinks}" if self.sinks else "",
                  "" if self.key_axis == "channel" else "ktoken", "" if self.pre_rope else "postrope",
                  "" if self.levels == "uniform" else self.levels,
                  f"c{self.key_channels}" if self.key_channels else "",
                  f"b{self.key_block}" if self.key_blocks else ""]
        return "-".join([bits, *filter(None, extras)])

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> KVQuantConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"unknown KV-cache option(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        return cls(**data)


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


@dataclass(frozen=True)
class KVCacheSpec:
    """What a model needs to build its quantized cache: the options, and the key ranges (None: tracked online)."""

    config: KVQuantConfig
    key_ranges: KeyRanges | None = None

    def new_cache(self, model: nn.Module) -> QuantizedKVCache:
        return QuantizedKVCache.for_model(model, self.config, self.key_ranges)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + _rotate_half(x) * sin


@torch.no_grad()
def apply_rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """`apply_rope` in place, with the same products and sums (so the same bits), without its temporaries."""
    half = x.shape[-1] // 2
    first = x[..., half:] * sin[..., :half]  # what rotate_half(x) * sin subtracts from the first half
    second = x[..., :half] * sin[..., half:]  # and adds to the second
    x.mul_(cos)
    x[..., :half] -= first
    x[..., half:] += second


def undo_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Inverse of `apply_rope` (rotation by -θ, divided by the squared attention scaling cos² + sin²)."""
    return (x * cos - _rotate_half(x) * sin) / (cos * cos + sin * sin)


def rope_table(rotary: nn.Module, length: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) [length, head_dim] in fp32 from a model's rotary-embedding module."""
    positions = torch.arange(length, device=device)[None]
    cos, sin = rotary(torch.zeros((), dtype=torch.float32, device=device), positions)
    return cos[0].float(), sin[0].float()


def _range_params(lo: torch.Tensor, hi: torch.Tensor, bits: int, margin: float = 1.0
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


class QuantizedKVLayer(CacheLayerMixin):
    """One attention layer's quantized cache (see the module docstring)."""

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
        self.segments: list[tuple[int, torch.Tensor, torch.Tensor]] = []
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
            self.segments = [(0, *_range_params(lo.to(self.device).float(), hi.to(self.device).float(),
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
                                        sparse=self.config.outliers > 0)
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
        lo, scale = lo.float()[:, None, :], scale.float()[:, None, :]
        parts = {"codes": pack_bits(range_quantize(keys, lo, scale, bits, self.levels[bits]), bits)}
        if self.kept is not None:
            parts["kept"] = keys.gather(-1, kept_index(self.kept, keys)).half()
        count = self.config.outlier_count(keys.shape[-1])
        if count:
            # Furthest from the channel's range centre, in units of its step: what clamping would hurt most.
            score = (keys - (lo + scale * (2**bits - 1) / 2)).abs() / scale
            if self.kept is not None:  # stored exactly already
                score = score.scatter(-1, kept_index(self.kept, score), -torch.inf)
            parts |= self._outliers(keys, score.topk(count, dim=-1).indices)
        self.key_store.append(**parts)

    def _key_segment(self, keys: torch.Tensor) -> tuple[int, torch.Tensor, torch.Tensor]:
        """The range the new keys are coded on: the calibrated one, or a snapshot of the online EMA range taken
        when the current segment has `segment` tokens already (or none exists)."""
        if self.key_range is not None:
            return self.segments[-1]
        flat = keys.transpose(1, 2).reshape(-1, keys.shape[1] * keys.shape[3])  # [batch * tokens, heads * dim]
        share = self.config.outliers
        if share and flat.shape[0] > 1:
            ext = torch.quantile(flat, torch.tensor([share / 2, 1 - share / 2], device=flat.device), dim=0)
            lo, hi = ext[0], ext[1]
        else:
            lo, hi = flat.amin(dim=0), flat.amax(dim=0)
        heads, dim = keys.shape[1], keys.shape[3]
        lo, hi = self.observer.update(lo.reshape(heads, dim), hi.reshape(heads, dim))
        if not self.segments or self.quantized - self.segments[-1][0] >= self.config.segment:
            self.segments.append((self.quantized, *_range_params(lo, hi, self.config.key_bits, self.config.margin)))
        return self.segments[-1]

    def _store_tokens(self, store: TokenStore, x: torch.Tensor, bits: int) -> None:
        """Per-token (per head vector) dynamic range, after setting the outliers apart."""
        parts: dict[str, torch.Tensor] = {}
        count = self.config.outlier_count(x.shape[-1])
        if count:
            parts = self._outliers(x, _range_shrinking(x, count))
            mask = torch.zeros_like(x, dtype=torch.bool).scatter_(-1, parts["outlier_index"].long(), True)
            lo = torch.where(mask, torch.inf, x).amin(dim=-1, keepdim=True)
            hi = torch.where(mask, -torch.inf, x).amax(dim=-1, keepdim=True)
        else:
            lo, hi = x.amin(dim=-1, keepdim=True), x.amax(dim=-1, keepdim=True)
        zero, scale16 = _token_range(lo, hi, bits)
        codes = range_quantize(x, _token_lo(zero, scale16, bits), scale16.float(), bits, self.levels[bits])
        store.append(codes=pack_bits(codes, bits), zero=zero, scale=scale16, **parts)

    @staticmethod
    def _outliers(x: torch.Tensor, index: torch.Tensor) -> dict[str, torch.Tensor]:
        index_dtype = torch.uint8 if x.shape[-1] <= 256 else torch.int16
        return {"outlier_values": x.gather(-1, index).half(), "outlier_index": index.to(index_dtype)}

    # reading back --------------------------------------------------------------------------------------------
    @torch.no_grad()  # decoded from integer codes: nothing to differentiate, and `out=` refuses autograd
    def _dequantize(self, store: TokenStore, bits: int, lo_scale: list[tuple[int, torch.Tensor, torch.Tensor]] | None,
                    x: torch.Tensor) -> None:
        """Decode the store into x (fp32 [batch, heads, tokens, dim])."""
        codes = unpack_bits(store.tensors["codes"], bits, self.shape[2])
        levels = self.levels[bits]
        if lo_scale is None:  # per token
            scale = store.tensors["scale"]
            range_dequantize(codes, _token_lo(store.tensors["zero"], scale, bits), scale.float(), bits, levels, out=x)
        else:  # per channel, one range per segment
            ends = [first for first, _, _ in lo_scale[1:]] + [codes.shape[-2]]
            for (first, lo, scale), end in zip(lo_scale, ends, strict=True):
                range_dequantize(codes[..., first:end, :], lo.float()[:, None, :], scale.float()[:, None, :], bits,
                                 levels, out=x[..., first:end, :])
        if "outlier_index" in store.tensors:
            x.scatter_(-1, store.tensors["outlier_index"].long(), store.tensors["outlier_values"].float())
        if "kept" in store.tensors:
            x.scatter_(-1, kept_index(self.kept, x), store.tensors["kept"].float())

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
