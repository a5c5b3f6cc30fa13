"""Export to compressed-tensors: the checkpoint layout vLLM and transformers load natively.

The `compressed-tensors` library does the packing: we hand it a float copy of the model whose quantized layers
hold exactly the weights our codes stand for, with our scales and zero points installed, and it re-derives the
same codes (round((q - z) * s / s) + z == q) and packs them ("int-quantized" for W8A8, "pack-quantized" for
weight-only). The codes in the files are checked against ours in the tests.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch import nn
from transformers import AutoModelForCausalLM

from llmeasyquant.errors import ConfigError
from llmeasyquant.export.common import (
    ExportResult,
    RuntimeLogits,
    Stopwatch,
    layers_to_export,
    require,
)
from llmeasyquant.infra.files import staged_folder
from llmeasyquant.models.arch import arch_for, get_module
from llmeasyquant.models.load import no_init_weights
from llmeasyquant.nn.qlinear import QuantLinear
from llmeasyquant.scheme import ActMode, PerGroup, PerTensor, QuantScheme

log = logging.getLogger(__name__)

INSTALL = "pip install 'llmeasyquant[export]'"
STORAGE_DTYPES = {"float16": torch.float16, "float32": torch.float32}


def _weight_args(scheme: QuantScheme, ct: object) -> object:
    grouped = isinstance(scheme.granularity, PerGroup)
    return ct.QuantizationArgs(num_bits=scheme.bits, type="int", symmetric=scheme.symmetric,
                               strategy="group" if grouped else "channel",
                               group_size=scheme.granularity.size if grouped else None)


def _input_args(scheme: QuantScheme, ct: object) -> object | None:
    act = scheme.act
    if act is None:
        return None
    if act.mode is ActMode.DYNAMIC and act.group_size is not None:  # per token per group of channels
        return ct.QuantizationArgs(num_bits=act.bits, type="int", symmetric=act.symmetric, strategy="group",
                                   group_size=act.group_size, dynamic=True)
    if act.mode is ActMode.DYNAMIC:
        strategy = "tensor" if isinstance(act.granularity, PerTensor) else "token"
        return ct.QuantizationArgs(num_bits=act.bits, type="int", symmetric=act.symmetric, strategy=strategy,
                                   dynamic=True)
    return ct.QuantizationArgs(num_bits=act.bits, type="int", symmetric=act.symmetric, strategy="tensor")


def _check_layer(name: str, layer: QuantLinear) -> None:
    layer.check_input_scale(name)
    if layer.scheme.grid is not None:
        raise ConfigError(f"layer {name} is on the non-uniform {layer.scheme.grid} grid "
                          "(weight = table[code] x scale); "
                          "compressed-tensors stores uniform integer codes only, so its codes would mean other "
                          "weights: export to gguf (IQ4_NL) instead, or quantize without --grid")
    if layer.in_features % layer.group_size:
        raise ConfigError(f"layer {name} has {layer.in_features} inputs, not a multiple of its group size "
                          f"{layer.group_size}; compressed-tensors needs whole groups: quantize with a group size "
                          "that divides the layer width (e.g. 32, 64 or 128) or per channel")


def quantization_config(layers: dict[str, QuantLinear]) -> object:
    """One config group per distinct scheme (a mixed-precision plan gives several), targets named exactly."""
    ct = require("compressed_tensors.quantization", INSTALL)
    groups: dict[QuantScheme, list[str]] = {}
    for name, layer in layers.items():
        _check_layer(name, layer)
        groups.setdefault(layer.scheme, []).append(name)
    config_groups = {
        f"group_{i}": ct.QuantizationScheme(targets=names, weights=_weight_args(scheme, ct),
                                            input_activations=_input_args(scheme, ct))
        for i, (scheme, names) in enumerate(groups.items())
    }
    return ct.QuantizationConfig(config_groups=config_groups, quantization_status=ct.QuantizationStatus.FROZEN)


def _float_copy(model: nn.Module, layers: dict[str, QuantLinear]) -> nn.Module:
    """The architecture as plain float modules (fp32), each quantized layer holding its dequantized weight."""
    with no_init_weights():
        plain = AutoModelForCausalLM.from_config(model.config, dtype=torch.float32)
    plain.tie_weights()
    float_state = {k: v for k, v in model.state_dict().items() if v.is_floating_point()}
    own = plain.state_dict()
    for key, value in float_state.items():
        if key in own and own[key].shape == value.shape:
            own[key].copy_(value)
    for name, layer in layers.items():
        target = get_module(plain, name)
        if type(target) is not nn.Linear:
            raise ConfigError(f"layer {name} is a {type(target).__name__}, not nn.Linear; compressed-tensors "
                              f"quantizes nn.Linear layers only ({arch_for(model).family} models cannot be "
                              "exported to it): export to onnx instead, or to gguf where the family has a `gguf` entry")
        target.weight.data.copy_(layer.dequantize())
        if layer.bias is not None:
            target.bias.data.copy_(layer.bias)
    return plain


def _install_qparams(plain: nn.Module, layers: dict[str, QuantLinear]) -> None:
    """Our scales, zero points and static input scales into the parameters compressed-tensors created."""
    for name, layer in layers.items():
        target = get_module(plain, name)
        qp = layer.qparams()
        target.weight_scale.data.copy_(qp.scale.reshape(target.weight_scale.shape))
        zero_point = getattr(target, "weight_zero_point", None)
        if zero_point is not None:
            zero_point.data.copy_(torch.zeros_like(zero_point) if qp.zero is None
                                  else qp.zero.reshape(zero_point.shape))
        if layer.static_input:
            target.input_scale.data.copy_(layer.input_scale.float().reshape(target.input_scale.shape))
            if layer.input_zero is not None:
                target.input_zero_point.data.copy_(layer.input_zero.reshape(target.input_zero_point.shape))


def export_compressed_tensors(model: nn.Module, tokenizer: object | None, out: str | Path,
                              force: bool = False) -> ExportResult:
    """Write `model` (quantized) as a compressed-tensors checkpoint folder that vLLM and transformers load."""
    clock = Stopwatch()
    arch = arch_for(model)
    if arch.experts is not None:
        # transformers 5 builds these experts fused (3D parameters), which compressed-tensors' per-Linear
        # quantization does not cover; the names of our per-expert linears are not those vLLM reads either.
        raise ConfigError(f"compressed-tensors export does not cover the mixture of experts of {arch.family}: its "
                          "runtime holds each block's experts fused, not as the per-expert linears quantized here; "
                          "keep the llmeasyquant checkpoint (llmeasyquant.save) for this model")
    layers = layers_to_export(model, "compressed-tensors")
    lifecycle = require("compressed_tensors.quantization", INSTALL)
    compressors = require("compressed_tensors.compressors", INSTALL)
    config = quantization_config(layers)
    plain = _float_copy(model, layers)
    lifecycle.apply_quantization_config(plain, config, show_progress=False)
    _install_qparams(plain, layers)
    compressor = compressors.ModelCompressor.from_pretrained_model(plain)
    compressor.compress_model(plain)
    info = getattr(model, "llmeasyquant", None)
    plain.to(STORAGE_DTYPES.get(getattr(info, "float_dtype", "float16"), torch.float16))
    notes = []
    if info is not None and info.kv_cache is not None:
        notes.append("the quantized KV cache (SimQuant) is not part of this format; the runtime uses its own cache")
    with staged_folder(out, force) as tmp:
        plain.save_pretrained(tmp)
        compressor.update_config(str(tmp))
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
    for note in notes:
        log.warning(note)
    result = ExportResult(path=Path(out).expanduser(), format="compressed-tensors", seconds=clock.seconds(),
                          lossless=list(layers), notes=notes)
    log.info("wrote compressed-tensors checkpoint %s (%d layers, %.1f MB)", result.path, len(layers),
             result.bytes / 1e6)
    return result


def open_transformers_runtime(path: str | Path, threads: int | None = None) -> RuntimeLogits:
    """Load an exported compressed-tensors folder with transformers (in fp32 on the CPU) and return its logits."""
    require("compressed_tensors", INSTALL)
    if threads is not None:
        torch.set_num_threads(threads)
    loaded = AutoModelForCausalLM.from_pretrained(Path(path).expanduser(), dtype=torch.float32).eval()

    @torch.no_grad()
    def logits(ids: torch.Tensor) -> torch.Tensor:
        return loaded(ids.reshape(1, -1), use_cache=False).logits[0].float()

    return logits
