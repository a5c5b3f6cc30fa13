"""What every exporter shares: the result record, the check that a runtime is installed, the quantized layers."""

from __future__ import annotations

import importlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

import torch
from torch import nn

from llmeasyquant.errors import ConfigError, LLMEasyQuantError
from llmeasyquant.export.checkpoint import checkpoint_bytes
from llmeasyquant.nn.qlinear import QuantLinear, quantized_layers
from llmeasyquant.nn.transform import input_transform_of

# A runtime loaded from an exported file: token ids [seqlen] (int64) -> logits [seqlen, vocab] (float32).
RuntimeLogits = Callable[[torch.Tensor], torch.Tensor]


class MissingRuntimeError(LLMEasyQuantError, ImportError):
    """An optional package an export or its check needs is not installed."""


def require(module: str, install: str) -> ModuleType:
    """Import an optional package, or fail with the command that installs it."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise MissingRuntimeError(f"{module} is not installed; install it with: {install}") from exc


@dataclass
class ExportResult:
    """What an export wrote: where, in which format, how big, how long it took, and which tensors were kept exact."""

    path: Path
    format: str
    seconds: float
    lossless: list[str] = field(default_factory=list)  # quantized layers written with their codes as they are
    requantized: list[str] = field(default_factory=list)  # layers the format could not hold exactly
    notes: list[str] = field(default_factory=list)

    @property
    def bytes(self) -> int:
        return checkpoint_bytes(self.path) if self.path.is_dir() else self.path.stat().st_size

    def to_dict(self) -> dict:
        return {"path": str(self.path), "format": self.format, "bytes": self.bytes, "export_s": self.seconds,
                "lossless_layers": len(self.lossless), "requantized_layers": self.requantized, "notes": self.notes}


def layers_to_export(model: nn.Module, fmt: str) -> dict[str, QuantLinear]:
    """The model's QuantLinear layers by module name; a model that is not quantized cannot be exported, nor one
    whose layers transform their input online (rotate's online Hadamard), clip their activations (--act-clip) or keep
    sink tokens in 8 bits (--act-sinks), which `fmt`'s graph has no place for."""
    layers = quantized_layers(model)
    if not layers:
        raise ConfigError("this model has no quantized layers; quantize it (llmeasyquant quantize) before exporting")
    online = [name for name, module in model.named_modules() if input_transform_of(module) is not None]
    if online:
        raise ConfigError(f"{online[0]} (and {len(online) - 1} more layers) applies an online Hadamard transform to "
                          f"its input, which the {fmt} format cannot carry: the exported model would compute "
                          "another function. Quantize without the online rotation (--no-online-rotation; the "
                          "offline rotation of the residual stream exports fine) or keep our checkpoint format")
    options = (("--act-clip", lambda act: act.clips,
                lambda act: f"clips its activations (--act-clip {act.clip_option})"),
               ("--act-sinks", lambda act: act.sinks > 0,
                lambda act: f"keeps its first {act.sinks} positions' activations in 8 bits (--act-sinks {act.sinks})"))
    for option, differs, says in options:
        named = [name for name, layer in layers.items() if layer.scheme.act is not None and differs(layer.scheme.act)]
        if named:
            raise ConfigError(f"{named[0]} (and {len(named) - 1} more layers) {says(layers[named[0]].scheme.act)}, "
                              f"which the {fmt} format has no way to express: the exported model would round "
                              f"activations differently. Quantize without {option} or keep our checkpoint format")
    return layers


class Stopwatch:
    def __init__(self) -> None:
        self.start = time.perf_counter()

    def seconds(self) -> float:
        return time.perf_counter() - self.start

