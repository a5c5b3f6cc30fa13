"""How the quantized KV cache codes keys and values: `KVQuantConfig`, and its defaults by bit width."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from llmeasyquant.errors import ConfigError
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


@dataclass(frozen=True)
class KVQuantConfig:
    """How the cache quantizes. Options left at None take their default for the bit width (BIT_DEFAULTS).
    `outliers` is the share of each head vector kept apart in fp16 (0 for none);
    `key_axis` 'token' and `pre_rope` False exist for ablations; `momentum` and `segment` drive online key ranges
    (one snapshot of the tracked range per `segment` tokens). `compact` stores the side information in fewer bytes
    (needs key blocks; the parts that need calibrated key ranges apply where they are calibrated): block range ends
    in 6 bits, the kept key channels in 8-bit codes apart from the low-bit ones (instead of fp16 beside them), value
    outliers in int8 steps of their token's grid (instead of fp16), and each value vector's range searched among
    clipped ones (key_blocks.py and coding.py say how)."""

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
    compact: bool = False

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
        if self.compact and not self.key_blocks:
            raise ConfigError("compact KV side information codes keys per channel in blocks of positions; give a "
                              "positive key_block (--kv-key-block) with key_axis 'channel', or leave compact "
                              "(--kv-compact) off")
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
                  f"b{self.key_block}" if self.key_blocks else "", "compact" if self.compact else ""]
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
