"""What a quantized tensor looks like: bit width, symmetry, granularity, and the activation side."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from llmeasyquant.errors import ConfigError

SUPPORTED_BITS = (2, 3, 4, 8)


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


ACT_MODES = ("dynamic", "static", "online")


@dataclass(frozen=True)
class ActScheme:
    """How activations entering a quantized linear are quantized: dynamic scales computed per token (or per
    tensor) on the fly, one static per-tensor scale calibrated beforehand and stored with the layer, or an online
    per-tensor range tracked while the model runs (δ_t = momentum·δ_{t-1} + (1 - momentum)·max(ε_t, absmax X_t),
    ε_t = `eps`, or max(`eps`, std X_t) with `std_floor`), with no calibration data."""

    bits: int = 8
    symmetric: bool = True
    dynamic: bool = True
    granularity: Granularity = field(default_factory=PerToken)
    online: bool = False
    momentum: float = 0.9
    eps: float = 1e-5
    std_floor: bool = False

    def __post_init__(self) -> None:
        if self.bits != 8:
            raise ConfigError(f"unsupported activation bit width {self.bits!r}; only 8-bit activations are supported")
        if not isinstance(self.granularity, PerToken | PerTensor):
            raise ConfigError("activation granularity must be per-token or per-tensor")
        if not self.dynamic and not isinstance(self.granularity, PerTensor):
            raise ConfigError("static and online activation scales are per tensor (tokens are not known in "
                              "advance); use per-tensor granularity or dynamic per-token scales")
        if self.online and self.dynamic:
            raise ConfigError("online activation ranges replace dynamic scales: set dynamic=False with online=True")
        if not 0.0 <= self.momentum < 1.0:
            raise ConfigError(f"activation EMA momentum must lie in [0, 1), got {self.momentum}")
        if not self.eps > 0:
            raise ConfigError(f"activation range floor eps must be positive, got {self.eps}")

    @property
    def mode(self) -> str:
        """'dynamic', 'static' or 'online'."""
        return "dynamic" if self.dynamic else "online" if self.online else "static"


@dataclass(frozen=True)
class QuantScheme:
    """Weight quantization of one linear layer, plus optional activation quantization."""

    bits: int
    symmetric: bool = True
    granularity: Granularity = field(default_factory=PerChannel)
    act: ActScheme | None = None

    def __post_init__(self) -> None:
        _check_bits(self.bits, "weight")
        if isinstance(self.granularity, PerToken):
            raise ConfigError("weights cannot be quantized per token; use per-tensor, per-channel or per-group")

    @property
    def static_act(self) -> bool:
        """Activations take one calibrated scale (so quantizing needs calibration data)."""
        return self.act is not None and self.act.mode == "static"

    @property
    def group_size(self) -> int | None:
        return self.granularity.size if isinstance(self.granularity, PerGroup) else None

    @property
    def name(self) -> str:
        """Short name such as `w4a16-g64-asym`; `parse_scheme(name)` gives the scheme back."""
        text = f"w{self.bits}a{self.act.bits if self.act else 16}"
        if self.act is not None and not self.act.dynamic:
            text += f"-a{self.act.mode}"
        elif self.act is not None and isinstance(self.act.granularity, PerTensor):
            text += "-apt"
        if self.act is not None and not self.act.symmetric:
            text += "-aasym"
        if isinstance(self.granularity, PerGroup):
            text += f"-g{self.granularity.size}"
        elif isinstance(self.granularity, PerTensor):
            text += "-pt"
        if not self.symmetric:
            text += "-asym"
        return text

    def to_dict(self) -> dict:
        return {"bits": self.bits, "symmetric": self.symmetric, "granularity": granularity_to_str(self.granularity),
                "act": None if self.act is None else {
                    "bits": self.act.bits, "symmetric": self.act.symmetric, "dynamic": self.act.dynamic,
                    "granularity": granularity_to_str(self.act.granularity)} | (
                    {"online": True, "momentum": self.act.momentum, "eps": self.act.eps,
                     "std_floor": self.act.std_floor} if self.act.online else {})}

    @classmethod
    def from_dict(cls, data: dict) -> QuantScheme:
        act = data.get("act")
        return cls(
            bits=int(data["bits"]), symmetric=bool(data["symmetric"]),
            granularity=granularity_from_str(data["granularity"]),
            act=None if act is None else ActScheme(
                bits=int(act["bits"]), symmetric=bool(act["symmetric"]), dynamic=bool(act["dynamic"]),
                granularity=granularity_from_str(act["granularity"]), online=bool(act.get("online", False)),
                momentum=float(act.get("momentum", 0.9)), eps=float(act.get("eps", 1e-5)),
                std_floor=bool(act.get("std_floor", False))),
        )


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


_SUFFIX = r"-(g-?\d+|pt|asym|sym|apt|aasym|astatic|aonline)"
_SCHEME_RE = re.compile(rf"^w(\d+)a(\d+)((?:{_SUFFIX})*)$")


def make_scheme(bits: int, group_size: int | None = None, symmetric: bool = True,
                act_bits: int | None = None, static_act: bool = False, act_mode: str | None = None,
                **online: float | bool) -> QuantScheme:
    """The scheme the CLI flags describe: `--bits`, `--group-size`, `--asym`, `--act-bits`, `--act-mode` (or
    `--static`); `online` takes the online mode's `momentum`, `eps` and `std_floor`."""
    mode = act_mode or ("static" if static_act else "dynamic")
    if mode not in ACT_MODES:
        raise ConfigError(f"unknown activation mode {mode!r}; choose one of {', '.join(ACT_MODES)}")
    if group_size is not None:
        granularity: Granularity = PerGroup(group_size)
    else:
        granularity = PerChannel()
    if mode != "dynamic" and act_bits in (None, 16):
        raise ConfigError(f"{mode} activation scales need quantized activations: add --act-bits 8")
    if act_bits in (None, 16):
        act = None
    elif mode == "dynamic":
        act = ActScheme(bits=act_bits)
    else:
        act = ActScheme(bits=act_bits, dynamic=False, granularity=PerTensor(), online=mode == "online",
                        **(online if mode == "online" else {}))
    return QuantScheme(bits=bits, symmetric=symmetric, granularity=granularity, act=act)


def parse_scheme(name: str) -> QuantScheme:
    """Parse `w8a8`, `w8a16`, `w4a16-g64`, `w4a16-g128-asym`, `w8a16-pt`, `w8a8-astatic` (case-insensitive)."""
    match = _SCHEME_RE.match(name.strip().lower())
    if not match:
        raise ConfigError(
            f"cannot read scheme {name!r}; write it as w<bits>a<act bits>[-g<group size>][-asym], "
            "e.g. w8a16, w8a8, w4a16-g64, w4a16-g128-asym"
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
        tracked = bool({"astatic", "aonline"} & set(parts))
        act = ActScheme(bits=act.bits, symmetric="aasym" not in parts, dynamic=not tracked,
                        granularity=PerTensor() if "apt" in parts or tracked else PerToken(),
                        online="aonline" in parts)
    elif {"apt", "aasym", "astatic", "aonline"} & set(parts):
        raise ConfigError(f"scheme {name!r} sets activation options (-apt, -aasym, -astatic, -aonline) without "
                          "quantized activations")
    return QuantScheme(bits, symmetric, granularity, act)


W8A16 = QuantScheme(bits=8)
W8A8 = QuantScheme(bits=8, act=ActScheme())
W4A16_G128 = QuantScheme(bits=4, symmetric=False, granularity=PerGroup(128))
W4A16_G64 = QuantScheme(bits=4, symmetric=False, granularity=PerGroup(64))
W4A8_G128 = QuantScheme(bits=4, symmetric=True, granularity=PerGroup(128), act=ActScheme())
PRESETS = {"W8A16": W8A16, "W8A8": W8A8, "W4A16_G128": W4A16_G128, "W4A16_G64": W4A16_G64,
           "W4A8_G128": W4A8_G128}
