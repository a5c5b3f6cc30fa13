"""What a quantized tensor looks like: bit width, symmetry, granularity, and the activation side."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from enum import StrEnum

from llmeasyquant.errors import ConfigError

SUPPORTED_BITS = (2, 3, 4, 8)
ACT_BITS = (4, 8)  # activation bit widths; 4-bit codes are stored and multiplied as int8
# Non-uniform weight grids (grid.py): a weight is table[code] * scale. 'nf4' the NormalFloat levels (QLoRA),
# 'iq4nl' llama.cpp's IQ4_NL table (both 4-bit), 'learned' a table per row fitted to the weights (3 or 4 bits).
GRIDS = ("nf4", "iq4nl", "learned")
LEARNED_BITS = (3, 4)  # a learned table of 8 levels takes 3-bit codes, one of 16 4-bit codes


@dataclass(frozen=True)
class PerTensor:
    """One scale (and zero point) for the whole tensor."""


@dataclass(frozen=True)
class PerChannel:
    """One scale per output channel (row of an [out, in] weight)."""


@dataclass(frozen=True)
class PerGroup:
    """One scale per `size` consecutive input channels of each row; the last group may be shorter."""

    size: int

    def __post_init__(self) -> None:
        if isinstance(self.size, bool) or not isinstance(self.size, int) or self.size <= 0:
            raise ConfigError(
                f"group size must be a positive integer, got {self.size!r}; "
                "use e.g. 32, 64 or 128, or per-channel (no --group-size)"
            )


@dataclass(frozen=True)
class PerToken:
    """One scale per row of an activation matrix (one token); computed on the fly."""


Granularity = PerTensor | PerChannel | PerGroup | PerToken


def _check_bits(bits: int, what: str) -> None:
    if bits not in SUPPORTED_BITS:
        raise ConfigError(f"unsupported {what} bit width {bits!r}; choose one of {', '.join(map(str, SUPPORTED_BITS))}")


class ActMode(StrEnum):
    """Where a quantized linear's activation scale comes from; each prints (and compares equal) as its value."""

    DYNAMIC = "dynamic"  # computed per token (or per tensor) on the fly
    STATIC = "static"  # one per-tensor scale calibrated beforehand and stored with the layer
    ONLINE = "online"  # a per-tensor range tracked while the model runs, with no calibration data

    @classmethod
    def parse(cls, value: ActMode | str) -> ActMode:
        """The mode `value` names ('dynamic', 'static', 'online', or a member)."""
        try:
            return cls(value)
        except ValueError:
            raise ConfigError(f"unknown activation mode {value!r}; choose one of {', '.join(cls)}") from None

    @classmethod
    def from_flags(cls, dynamic: bool, online: bool) -> ActMode:
        """The mode a checkpoint's `dynamic` and `online` keys describe (see `QuantScheme.to_dict`)."""
        if dynamic and online:
            raise ConfigError("online activation ranges replace dynamic scales: an online activation scheme has "
                              "dynamic=False")
        return cls.DYNAMIC if dynamic else cls.ONLINE if online else cls.STATIC


@dataclass(frozen=True)
class ActScheme:
    """How activations entering a quantized linear are quantized, by `mode`: dynamic scales computed per token (or
    per tensor) on the fly, one static per-tensor scale calibrated beforehand and stored with the layer, or an online
    per-tensor range tracked while the model runs (δ_t = momentum·δ_{t-1} + (1 - momentum)·max(ε_t, absmax X_t),
    ε_t = `eps`, or max(`eps`, std X_t) with `std_floor`), with no calibration data.

    Dynamic scales may also be per token per group of channels (`granularity=PerGroup(size)`, `--act-group-size`):
    one scale (and zero point) for each `size` consecutive channels of a token, as the weights' groups are, so the
    integer kernel scales each group's exact sum by the two scales together. A 4-bit token of a rotated,
    near-Gaussian stream then rounds each group on its own range instead of the whole row's.

    `ActScheme(mode=ActMode.STATIC, granularity=PerTensor())`; `mode` also takes the value's string ('static')."""

    bits: int = 8
    symmetric: bool = True
    mode: ActMode = ActMode.DYNAMIC
    granularity: Granularity = field(default_factory=PerToken)
    momentum: float = 0.9  # the online mode's EMA (the other modes ignore momentum, eps and std_floor)
    eps: float = 1e-5
    std_floor: bool = False
    # Dynamic scales cover this fraction of each token's range (of the tensor's, per tensor); values beyond it
    # saturate. Below 1 it trades a few clipped outliers for finer steps everywhere else: at 4 bits a rotated,
    # near-Gaussian token's rounding error outweighs what clipping its tails costs (QuaRot clips at 0.9).
    clip: float = 1.0
    # Instead of one fraction: each token's (the tensor's, per tensor) among CLIP_SEARCH_FRACTIONS, the one whose
    # rounding leaves the least squared error (kernels/clipping.py). Tokens differ in how heavy their
    # tails are, so one fraction is too low for some and too high for others.
    clip_search: bool = False
    # The first `sinks` positions of each sequence take 8-bit activations (4-bit schemes): the attention sink's
    # hidden state carries the massive activations and every later token attends to it, so its 4-bit rounding
    # spreads to all of them. The layer learns the positions from nn/positions.py.
    sinks: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "mode", ActMode.parse(self.mode))
        if self.bits not in ACT_BITS:
            raise ConfigError(f"unsupported activation bit width {self.bits!r}; choose 8 or 4 (4-bit activations "
                              "want a rotation first: --method rotate+gptq)")
        if not isinstance(self.granularity, PerToken | PerTensor | PerGroup):
            raise ConfigError("activation granularity must be per-token, per token in groups of channels, or "
                              "per-tensor")
        if self.mode is not ActMode.DYNAMIC and not isinstance(self.granularity, PerTensor):
            raise ConfigError("static and online activation scales are per tensor (tokens are not known in "
                              "advance); use per-tensor granularity or dynamic per-token scales (drop "
                              "--act-group-size)")
        if not 0.0 <= self.momentum < 1.0:
            raise ConfigError(f"activation EMA momentum must lie in [0, 1), got {self.momentum}")
        if not self.eps > 0:
            raise ConfigError(f"activation range floor eps must be positive, got {self.eps}")
        if not 0.0 < self.clip <= 1.0:
            raise ConfigError(f"activation clip ratio must lie in (0, 1], got {self.clip}: it is the fraction of "
                              "each token's range the scale covers (e.g. 0.9)")
        if isinstance(self.sinks, bool) or not isinstance(self.sinks, int) or self.sinks < 0:
            raise ConfigError(f"the number of sink tokens must be a non-negative integer, got {self.sinks!r}")
        if self.sinks and (self.bits >= 8 or self.mode is not ActMode.DYNAMIC):
            raise ConfigError("sink tokens take 8-bit activations in place of dynamic 4-bit ones: use them with "
                              "--act-bits 4 and dynamic scales, or drop --act-sinks")
        if self.clip_search and self.clip < 1.0:
            raise ConfigError(f"activation clipping is either one fraction ({self.clip:g}) or searched per token, not "
                              "both: give --act-clip FRACTION or --act-clip search")
        if self.clips and self.mode is not ActMode.DYNAMIC:
            raise ConfigError("activation clipping shrinks dynamic scales; static and online ranges are fixed "
                              "beforehand: use --act-mode dynamic or drop --act-clip")

    @property
    def group_size(self) -> int | None:
        """Channels that share a scale within a token (`--act-group-size`); None: the whole token (or tensor)."""
        return self.granularity.size if isinstance(self.granularity, PerGroup) else None

    @property
    def clips(self) -> bool:
        """Whether inputs are clipped before the kernel (one fraction below 1, or a searched one)."""
        return self.clip < 1.0 or self.clip_search

    @property
    def clip_option(self) -> str:
        """The `--act-clip` value that gives this clipping: 'search' or the fraction."""
        return "search" if self.clip_search else f"{self.clip:g}"


@dataclass(frozen=True)
class QuantScheme:
    """Weight quantization of one linear layer, plus optional activation quantization."""

    bits: int
    symmetric: bool = True
    granularity: Granularity = field(default_factory=PerChannel)
    act: ActScheme | None = None
    grid: str | None = None  # None: uniform integer codes; else one of GRIDS (4-bit, symmetric, weight-only)

    def __post_init__(self) -> None:
        _check_bits(self.bits, "weight")
        if isinstance(self.granularity, PerToken):
            raise ConfigError("weights cannot be quantized per token; use per-tensor, per-channel or per-group")
        if self.grid is not None:
            _check_grid(self)
        if self.act is not None and self.act.group_size is not None and self.act.group_size != self.group_size:
            weights = f"groups of {self.group_size}" if self.group_size else "one scale a row"
            raise ConfigError(f"activation groups of {self.act.group_size} channels need weight groups of the same "
                              f"size (the kernel scales each group's integer sum by both scales), but the weights "
                              f"have {weights}: give --group-size {self.act.group_size} or drop --act-group-size")

    @property
    def static_act(self) -> bool:
        """Activations take one calibrated scale (so quantizing needs calibration data)."""
        return self.act is not None and self.act.mode is ActMode.STATIC

    @property
    def group_size(self) -> int | None:
        return self.granularity.size if isinstance(self.granularity, PerGroup) else None

    @property
    def name(self) -> str:
        """Short name such as `w4a16-g64-asym`; `parse_scheme(name)` gives the scheme back."""
        text = f"w{self.bits}a{self.act.bits if self.act else 16}"
        if self.act is not None and self.act.mode is not ActMode.DYNAMIC:
            text += f"-a{self.act.mode}"
        elif self.act is not None and isinstance(self.act.granularity, PerTensor):
            text += "-apt"
        if self.act is not None and not self.act.symmetric:
            text += "-aasym"
        if self.act is not None and self.act.clip < 1.0:
            text += f"-ac{self.act.clip * 100:g}"
        if self.act is not None and self.act.clip_search:
            text += "-acs"
        if self.act is not None and self.act.sinks:
            text += f"-as{self.act.sinks}"
        if self.act is not None and self.act.group_size is not None:
            text += f"-ag{self.act.group_size}"
        if isinstance(self.granularity, PerGroup):
            text += f"-g{self.granularity.size}"
        elif isinstance(self.granularity, PerTensor):
            text += "-pt"
        if not self.symmetric:
            text += "-asym"
        if self.grid is not None:
            text += f"-{self.grid}"
        return text

    def to_dict(self) -> dict:
        """The checkpoint's form. The activation mode is written as `dynamic` (true or false) plus, for online ranges
        only, `online: true` and the EMA's options: the keys checkpoints have always held. `grid` (and the
        activations' `clip`) only when set, so other schemes keep their old form (and a checkpoint without the key
        loads as before)."""
        grid = {"grid": self.grid} if self.grid is not None else {}
        return grid | {
                "bits": self.bits, "symmetric": self.symmetric, "granularity": granularity_to_str(self.granularity),
                "act": None if self.act is None else {
                    "bits": self.act.bits, "symmetric": self.act.symmetric,
                    "dynamic": self.act.mode is ActMode.DYNAMIC,
                    "granularity": granularity_to_str(self.act.granularity)} | (
                    {"clip": self.act.clip} if self.act.clip < 1.0 else {}) | (
                    {"clip_search": True} if self.act.clip_search else {}) | (
                    {"sinks": self.act.sinks} if self.act.sinks else {}) | (
                    {"online": True, "momentum": self.act.momentum, "eps": self.act.eps,
                     "std_floor": self.act.std_floor} if self.act.mode is ActMode.ONLINE else {})}

    @classmethod
    def from_dict(cls, data: dict) -> QuantScheme:
        act = data.get("act")
        return cls(
            bits=int(data["bits"]), symmetric=bool(data["symmetric"]),
            granularity=granularity_from_str(data["granularity"]),
            act=None if act is None else ActScheme(
                bits=int(act["bits"]), symmetric=bool(act["symmetric"]),
                mode=ActMode.from_flags(bool(act["dynamic"]), bool(act.get("online", False))),
                granularity=granularity_from_str(act["granularity"]),
                momentum=float(act.get("momentum", 0.9)), eps=float(act.get("eps", 1e-5)),
                std_floor=bool(act.get("std_floor", False)), clip=float(act.get("clip", 1.0)),
                clip_search=bool(act.get("clip_search", False)), sinks=int(act.get("sinks", 0))),
            grid=data.get("grid"),
        )


def _check_grid(scheme: QuantScheme) -> None:
    """A non-uniform grid is a table of 2^bits symmetric (zero-point free) weight levels run on float activations."""
    if scheme.grid not in GRIDS:
        raise ConfigError(f"unknown weight grid {scheme.grid!r}; choose one of {', '.join(GRIDS)} (or none for "
                          "uniform integer codes)")
    if scheme.grid == "learned" and scheme.bits not in LEARNED_BITS:
        raise ConfigError(f"the learned grid fits 8 or 16 levels: it needs 3- or 4-bit weights (--bits 3 or 4), got "
                          f"{scheme.bits} bits")
    if scheme.grid != "learned" and scheme.bits != 4:
        raise ConfigError(f"the {scheme.grid} grid has 16 levels: it needs 4-bit weights (--bits 4), got "
                          f"{scheme.bits} bits")
    if not scheme.symmetric:
        raise ConfigError(f"the {scheme.grid} grid is scaled, not shifted (no zero points): drop --asym")
    if isinstance(scheme.granularity, PerTensor):
        raise ConfigError(f"the {scheme.grid} grid takes one scale per group or per channel, not per tensor: use "
                          "--group-size or per-channel weights")
    if scheme.act is not None:
        raise ConfigError(f"the {scheme.grid} grid runs weight-only (float activations, a table-lookup kernel): "
                          "drop --act-bits")


def granularity_to_str(g: Granularity) -> str:
    if isinstance(g, PerGroup):
        return f"group:{g.size}"
    return {PerTensor: "tensor", PerChannel: "channel", PerToken: "token"}[type(g)]


def granularity_from_str(text: str) -> Granularity:
    if text.startswith("group:"):
        return PerGroup(int(text.split(":", 1)[1]))
    table = {"tensor": PerTensor, "channel": PerChannel, "token": PerToken}
    if text not in table:
        raise ConfigError(f"unknown granularity {text!r}; expected tensor, channel, token or group:N")
    return table[text]()


_SUFFIX = rf"-(g-?\d+|pt|asym|sym|apt|aasym|ac\d+(?:\.\d+)?|acs|as\d+|ag\d+|astatic|aonline|{'|'.join(GRIDS)})"
_SCHEME_RE = re.compile(rf"^w(\d+)a(\d+)((?:{_SUFFIX})*)$")


def make_scheme(bits: int, group_size: int | None = None, symmetric: bool = True,
                act_bits: int | None = None, static_act: bool = False, act_mode: ActMode | str | None = None,
                grid: str | None = None, act_clip: float | str = 1.0, act_symmetric: bool = True, act_sinks: int = 0,
                act_group_size: int | None = None, **online: float | bool) -> QuantScheme:
    """The scheme the CLI flags describe: `--bits`, `--group-size`, `--asym`, `--act-bits`, `--act-mode` (or
    `--static`), `--grid`, `--act-clip` (a fraction or 'search'), `--act-asym`, `--act-sinks`, `--act-group-size`;
    `online` takes the online mode's `momentum`, `eps` and `std_floor`."""
    mode = ActMode.parse(act_mode or (ActMode.STATIC if static_act else ActMode.DYNAMIC))
    if group_size is not None:
        granularity: Granularity = PerGroup(group_size)
    else:
        granularity = PerChannel()
    clip_search = act_clip == "search"
    if isinstance(act_clip, str) and not clip_search:
        raise ConfigError(f"--act-clip takes a fraction of each token's range in (0, 1] or 'search', got {act_clip!r}")
    clip = 1.0 if clip_search else float(act_clip)
    if mode is not ActMode.DYNAMIC and act_bits in (None, 16):
        raise ConfigError(f"{mode} activation scales need quantized activations: add --act-bits 8")
    if act_bits in (None, 16):
        given = [flag for flag, unset in (("--act-clip", act_clip == 1.0), ("--act-asym", act_symmetric),
                                          ("--act-sinks", act_sinks == 0), ("--act-group-size", act_group_size is None))
                 if not unset]
        if given:
            raise ConfigError(f"{given[0]} applies to quantized activations: add --act-bits 4 (or 8)")
        act = None
    elif mode is ActMode.DYNAMIC:
        act_granularity: Granularity = PerToken() if act_group_size is None else PerGroup(act_group_size)
        act = ActScheme(bits=act_bits, clip=clip, clip_search=clip_search, symmetric=act_symmetric, sinks=act_sinks,
                        granularity=act_granularity)
    else:
        if act_group_size is not None:
            raise ConfigError(f"--act-group-size groups dynamic scales; {mode} activation scales are one per tensor: "
                              "drop --act-group-size or use --act-mode dynamic")
        act = ActScheme(bits=act_bits, mode=mode, granularity=PerTensor(), clip=clip, clip_search=clip_search,
                        symmetric=act_symmetric, sinks=act_sinks, **(online if mode is ActMode.ONLINE else {}))
    return QuantScheme(bits=bits, symmetric=symmetric, granularity=granularity, act=act, grid=grid)


def parse_scheme(name: str) -> QuantScheme:
    """Parse `w8a8`, `w8a16`, `w4a16-g64`, `w4a16-g128-asym`, `w8a16-pt`, `w8a8-astatic`, `w4a16-g64-nf4`,
    `w4a4-ac90-as1-g64` (activations clipped at 0.90 of each token's range, the first token's in 8 bits),
    `w4a4-acs-g64` (each token's clip searched), `w4a4-ag64-g64` (activation scales per token per 64 channels)
    (case-insensitive)."""
    match = _SCHEME_RE.match(name.strip().lower())
    if not match:
        raise ConfigError(
            f"cannot read scheme {name!r}; write it as w<bits>a<act bits>[-g<group size>][-asym][-<grid>], "
            f"e.g. w8a16, w8a8, w4a16-g64, w4a16-g128-asym, w4a16-g64-nf4 (grids: {', '.join(GRIDS)})"
        )
    bits, act_bits = int(match.group(1)), int(match.group(2))
    parts = re.findall(_SUFFIX, match.group(3))
    symmetric = "asym" not in parts
    granularity: Granularity = PerChannel()
    for part in parts:
        if part == "pt":
            granularity = PerTensor()
        elif part.startswith("g"):
            granularity = PerGroup(int(part[1:]))
    act = make_scheme(bits, None, symmetric, act_bits).act
    if act is not None:
        mode = ActMode.ONLINE if "aonline" in parts else ActMode.STATIC if "astatic" in parts else ActMode.DYNAMIC
        clips = [float(part[2:]) / 100 for part in parts if re.fullmatch(r"ac[\d.]+", part)]
        sinks = [int(part[2:]) for part in parts if re.fullmatch(r"as\d+", part)]
        act_groups = [int(part[2:]) for part in parts if re.fullmatch(r"ag\d+", part)]
        act_granularity: Granularity = PerToken() if not act_groups else PerGroup(act_groups[-1])
        if act_groups and ("apt" in parts or mode is not ActMode.DYNAMIC):
            raise ConfigError(f"scheme {name!r} groups activation scales (-agN) that are one per tensor (-apt, "
                              "-astatic, -aonline): drop one or the other")
        act = ActScheme(bits=act.bits, symmetric="aasym" not in parts, mode=mode,
                        granularity=PerTensor() if "apt" in parts or mode is not ActMode.DYNAMIC else act_granularity,
                        clip=clips[-1] if clips else 1.0, clip_search="acs" in parts, sinks=sinks[-1] if sinks else 0)
    elif {"apt", "aasym", "astatic", "aonline", "acs"} & set(parts) or any(re.fullmatch(r"a[csg][\d.]+", part)
                                                                   for part in parts):
        raise ConfigError(f"scheme {name!r} sets activation options (-apt, -aasym, -acN, -acs, -asN, -agN, -astatic, "
                          "-aonline) without quantized activations")
    grids = [part for part in parts if part in GRIDS]
    if len(grids) > 1:
        raise ConfigError(f"scheme {name!r} names more than one grid ({', '.join(grids)}); give one")
    return QuantScheme(bits, symmetric, granularity, act, grids[0] if grids else None)


W8A16 = QuantScheme(bits=8)
W8A8 = QuantScheme(bits=8, act=ActScheme())
W4A16_G128 = QuantScheme(bits=4, symmetric=False, granularity=PerGroup(128))
W4A16_G64 = QuantScheme(bits=4, symmetric=False, granularity=PerGroup(64))
W4A8_G128 = QuantScheme(bits=4, symmetric=True, granularity=PerGroup(128), act=ActScheme())
PRESETS = {"W8A16": W8A16, "W8A8": W8A8, "W4A16_G128": W4A16_G128, "W4A16_G64": W4A16_G64,
           "W4A8_G128": W4A8_G128}
