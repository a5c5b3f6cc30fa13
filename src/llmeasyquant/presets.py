"""Named recipes for people who want the best measured result at a size without choosing methods and options:
`llmeasyquant quantize MODEL --preset NAME --out DIR`.

Each preset is the recipe that docs/RESULTS.md's "The accuracy frontier" table found best for its bit budget on
SmolLM2-135M (40 windows of WikiText-2 raw test, calibration 64 x 512 tokens of WikiText-2 validation); the figure
quoted with it is that measurement. Plain data: the CLI (cli/resolve.py `apply_preset`) turns it into the recipe,
the plan and the KV cache exactly as the equivalent options would.
"""

from __future__ import annotations

from dataclasses import dataclass

from llmeasyquant.errors import ConfigError
from llmeasyquant.scheme import parse_scheme


@dataclass(frozen=True)
class Preset:
    """A recipe (`method`, as `--method` spells it, with `online_rotation` the rotate step's run-time Hadamard of the
    down projection's input and `online_attention` that of the attention output's), the body's scheme, the LM head's
    scheme (None: left to --lm-head, float by default), the KV cache's bits (None: float), and the measured result
    quoted in `--help` and docs/methods.md."""

    name: str
    method: str
    online_rotation: bool
    scheme: str
    lm_head: str | None
    kv_bits: int | None
    measured: str
    online_attention: bool = False

    @property
    def options(self) -> str:
        """The same recipe as explicit `quantize` options."""
        scheme = parse_scheme(self.scheme)
        text = f"--method {self.method}" + (" --online-rotation" if self.online_rotation else "")
        text += " --online-attention-rotation" if self.online_attention else ""
        text += f" --bits {scheme.bits}"
        if scheme.group_size:
            text += f" --group-size {scheme.group_size}"
        if not scheme.symmetric:
            text += " --asym"
        if scheme.grid is not None:
            text += f" --grid {scheme.grid}"
        if scheme.act is not None:
            text += f" --act-bits {scheme.act.bits}"
            if not scheme.act.symmetric:
                text += " --act-asym"
            if scheme.act.clips:
                text += f" --act-clip {scheme.act.clip_option}"
            if scheme.act.sinks:
                text += f" --act-sinks {scheme.act.sinks}"
            if scheme.act.group_size:
                text += f" --act-group-size {scheme.act.group_size}"
        if self.lm_head:
            text += f" --lm-head {self.lm_head}"
        if self.kv_bits:
            text += f" --kv-bits {self.kv_bits}"
        return text + " --calib wikitext2"


QUANTIZE_PRESETS: dict[str, Preset] = {p.name: p for p in (
    Preset("w4a16-g64", "rotate+gptq", True, "w4a16-g64-learned", None, None,
           "+6.6% perplexity at 4.625 bits per weight (a learned 16-level table per row; the online transform "
           "keeps it to our runtime: the exporters refuse it)"),
    Preset("w4a16-g32-gguf", "rotate+gptq", False, "w4a16-g32-iq4nl", None, None,
           "+5.2% at 4.5 bits per weight, exported to GGUF IQ4_NL bit for bit (llama.cpp's own IQ4_NL with an "
           "importance matrix: +10.1%)"),
    Preset("w3a16-g64", "rotate+gptaq", True, "w3a16-g64-learned", None, None,
           "+33.6% perplexity at 3.44 bits per weight (GPTAQ on a learned 8-level table per row; our runtime only, "
           "as w4a16-g64; off the calibration's domain +65.6%, where rotate+gptq is +59.0%)"),
    Preset("w4a8-g64", "rotate+gptq", False, "w4a8-g64-asym", None, None,
           "+11.7% at 4.375 bits, int8 activations on the integer kernel"),
    Preset("w4a4-kv4", "rotate+gptq", True, "w4a4-aasym-acs-as1-ag64-g64-asym", None, 4,
           "+44.9% at 4.375 bits with 4-bit activations (asymmetric, a scale per token per 64 channels, each "
           "group's clip searched, the first token's in 8 bits) and a 4-bit KV cache (off the calibration's "
           "domain, pyref, +48.0%); with one scale a token +62.4%, and 0.91x the speed of that",
           online_attention=True),
)}


def preset(name: str) -> Preset:
    """The preset called `name`, or a ConfigError listing them."""
    if name not in QUANTIZE_PRESETS:
        raise ConfigError(f"unknown preset {name!r}; choose one of {', '.join(QUANTIZE_PRESETS)}")
    return QUANTIZE_PRESETS[name]
