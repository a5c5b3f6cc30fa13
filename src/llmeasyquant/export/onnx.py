"""Export a quantized model to ONNX (QuantizeLinear/DequantizeLinear, opset 21) and run it with ONNX Runtime.

How: on a copy of the model, each QuantLinear becomes a stand-in computing `x @ weight_t (+ bias)` with its
dequantized weight, so the traced graph holds MatMul(x, <layer>.weight_t); `onnx_graph.rewrite` then swaps that
float initializer for the layer's exact integer codes, scales and zero points behind a DequantizeLinear, and adds
the activation QuantizeLinear/DequantizeLinear of W8A8 layers. The graph takes `input_ids` [1, seq] (int64, no KV
cache) and returns `logits` [1, seq, vocab] (float32); parameters that were not quantized are written in fp32.
"""

from __future__ import annotations

import contextlib
import copy
import io
import logging
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from llmeasyquant.errors import CheckpointError, ConfigError
from llmeasyquant.export.common import (
    ExportResult,
    RuntimeLogits,
    Stopwatch,
    layers_to_export,
    require,
)
from llmeasyquant.export.onnx_graph import (
    INSTALL,
    ActQuant,
    LayerCodes,
    OnnxExportError,
    initializer_bytes,
    rewrite,
    strip_debug_info,
)
from llmeasyquant.infra.files import check_output, staged_folder
from llmeasyquant.kernels import REFERENCE
from llmeasyquant.models.arch import arch_for
from llmeasyquant.nn.qlinear import QuantLinear, forced_kernel
from llmeasyquant.scheme import ActMode, PerToken

__all__ = ["OnnxExportError", "export_onnx", "open_onnx_runtime"]

log = logging.getLogger(__name__)

MODEL_FILE = "model.onnx"
DATA_FILE = "model.onnx.data"
OPSET = 21  # QuantizeLinear/DequantizeLinear with int4 and blocked (per-group) scales
EXTERNAL_DATA_BYTES = 1_500_000_000  # above this the weights go to DATA_FILE (protobuf stops at 2 GB)
VERIFY_TOKENS = 16
# How far ONNX Runtime's logits may be from the reference kernel's, relative to the largest logit, before a warning.
# Weight-only graphs follow it to float summation order (SmolLM2 W8A16: 2e-6). With quantized activations a last-bit
# difference before a rounding step flips codes, and the flips grow through the blocks: a one-ulp change of
# SmolLM2's embeddings moves its W8A8 logits by 0.14 of the largest one in our own arithmetic, so only a broken
# graph (differences near 1) is worth a warning there.
WEIGHT_ONLY_TOLERANCE = 1e-3
ACT_TOLERANCE = 0.3
# ORT fuses DequantizeLinear + MatMul into MatMulNBits and by default (accuracy level 4) then quantizes the
# activations to int8 on the fly, which a weight-only model never asked for: level 1 keeps them in fp32.
ORT_CONFIG = {"session.qdq_matmulnbits_accuracy_level": "1"}
_NOISY_LOGGERS = ("torch.onnx", "torch.export", "onnx_ir", "onnxscript")


class _MatMulStandIn(nn.Module):
    """What a QuantLinear computes, as one float MatMul whose weight initializer the rewrite can find by name."""

    def __init__(self, layer: QuantLinear) -> None:
        super().__init__()
        # [in, out]: the graph gets MatMul(x, weight_t) with no Transpose between the initializer and the MatMul.
        # The name is the one onnx_graph.WEIGHT_SUFFIX looks for.
        self.weight_t = nn.Parameter(layer.dequantize().t().contiguous(), requires_grad=False)
        self.bias = None if layer.bias is None else nn.Parameter(layer.bias.detach().float(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x @ self.weight_t
        return y if self.bias is None else y + self.bias


def _stand_in_model(model: nn.Module, layers: dict[str, QuantLinear]) -> nn.Module:
    """A float32 CPU copy of `model` with every QuantLinear replaced by its stand-in; `model` is not touched."""
    # Seeding deepcopy's memo makes the copy hold the stand-ins directly: the integer buffers are never copied.
    memo: dict[int, Any] = {id(layer): _MatMulStandIn(layer) for layer in layers.values()}
    clone = copy.deepcopy(model, memo)
    return clone.cpu().float().eval()


def _act_quant(name: str, layer: QuantLinear) -> ActQuant | None:
    act = layer.scheme.act
    if act is None:
        return None
    if act.bits != 8:
        raise ConfigError(f"{name} quantizes its activations to {act.bits} bits; the ONNX graph quantizes "
                          "activations to int8 only (QuantizeLinear's 4-bit types need opset 21 and are not run by "
                          "ONNX Runtime's CPU GEMMs): export a W4A8 or weight-only checkpoint, or use "
                          "`export --to compressed-tensors`")
    if act.group_size is not None:
        raise ConfigError(f"{name} scales its activations per token per {act.group_size} channels; the ONNX graph "
                          "quantizes activations per token or per tensor: quantize without --act-group-size, or use "
                          "`export --to compressed-tensors`")
    if act.mode is ActMode.DYNAMIC:
        return ActQuant(dynamic=True, symmetric=act.symmetric, per_token=isinstance(act.granularity, PerToken))
    layer.check_input_scale()
    scale = float(layer.input_scale.float())
    zero = 0 if layer.input_zero is None else int(layer.input_zero)
    return ActQuant(dynamic=False, symmetric=act.symmetric, per_token=False, scale=scale, zero=zero)


def _layer_codes(name: str, layer: QuantLinear) -> LayerCodes:
    if layer.scheme.grid is not None:
        raise ConfigError(f"layer {name} is on the non-uniform {layer.scheme.grid} grid "
                          "(weight = table[code] x scale); "
                          "ONNX's DequantizeLinear computes (code - zero) x scale only, so its codes would mean other "
                          "weights: export to gguf (IQ4_NL) instead, or quantize without --grid")
    qp = layer.qparams()
    zero = None if qp.zero is None else qp.zero.to(torch.int8).cpu().numpy()
    return LayerCodes(name=name, codes=layer.codes().cpu().numpy(), scale=qp.scale.float().cpu().numpy(), zero=zero,
                      group_size=qp.group_size, bits=layer.scheme.bits, act=_act_quant(name, layer))


@contextlib.contextmanager
def _quiet() -> Iterator[io.StringIO]:
    """torch.onnx prints progress, warnings and info logs; keep them for the debug log instead of the terminal."""
    buffer = io.StringIO()
    loggers = [logging.getLogger(name) for name in _NOISY_LOGGERS]
    levels = [logger.level for logger in loggers]
    try:
        for logger in loggers:
            logger.setLevel(logging.ERROR)
        with warnings.catch_warnings(), contextlib.redirect_stdout(buffer), contextlib.redirect_stderr(buffer):
            warnings.simplefilter("ignore")
            yield buffer
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)


def _max_positions(model: nn.Module) -> int:
    config = getattr(model, "config", None)
    return int(getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None) or 4096)


def _trace(model: nn.Module) -> Any:
    """torch.onnx (dynamo) export of the float stand-in model: an onnx_ir Model, sequence length dynamic."""
    require("onnxscript", INSTALL)  # the dynamo exporter is built on it
    ids = torch.arange(8, dtype=torch.int64).reshape(1, 8) % int(model.get_input_embeddings().num_embeddings)
    seq = torch.export.Dim("seq", min=2, max=max(_max_positions(model), ids.shape[1]))
    with _quiet() as output:
        try:
            program = torch.onnx.export(
                model, (ids,), kwargs={"use_cache": False}, dynamo=True, input_names=["input_ids"],
                output_names=["logits"], dynamic_shapes={"input_ids": {1: seq}, "use_cache": None},
                opset_version=OPSET, optimize=False, verbose=False)
        except Exception as exc:
            log.debug("torch.onnx output:\n%s", output.getvalue())
            first_line = next(iter(str(exc).strip().splitlines()), "")
            raise OnnxExportError(f"torch.onnx could not trace this model ({type(exc).__name__}: {first_line}); run "
                                  "with debug logging for the exporter's output and report the model family") from exc
    log.debug("torch.onnx output:\n%s", output.getvalue())
    return program.model


def _save(ir_model: Any, folder: Path, external: bool) -> None:
    ir = require("onnx_ir", INSTALL)
    onnx = require("onnx", INSTALL)
    path = folder / MODEL_FILE
    ir.save(ir_model, path, external_data=DATA_FILE if external else None)
    # The checker reads the file (external data included), so it also works past protobuf's 2 GB limit.
    onnx.checker.check_model(str(path))


def _write_extras(model: nn.Module, tokenizer: object | None, folder: Path) -> None:
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "to_json_string"):
        (folder / "config.json").write_text(config.to_json_string())


def _verify(model: nn.Module, layers: dict[str, QuantLinear], folder: Path, result: ExportResult) -> None:
    """Run the written file with ONNX Runtime on a few tokens and record how far its logits are from the reference
    kernel's (the fast CPU kernels round differently, e.g. W8A16 in bf16, so they are not the yardstick)."""
    vocab = int(model.get_input_embeddings().num_embeddings)
    ids = torch.randint(0, vocab, (VERIFY_TOKENS,), generator=torch.Generator().manual_seed(0))
    device = model.get_input_embeddings().weight.device
    with torch.no_grad(), forced_kernel(model, REFERENCE.name):
        ours = model(ids[None].to(device), use_cache=False).logits[0].float().cpu()
    theirs = open_onnx_runtime(folder)(ids)
    diff = float((theirs - ours).abs().max())
    relative = diff / max(float(ours.abs().max()), 1e-12)
    result.notes.append(f"onnxruntime check on {VERIFY_TOKENS} tokens: max abs logit difference {diff:.3g} "
                        f"({relative:.2g} of the largest logit)")
    log.info("onnxruntime check: max abs logit difference %.3g (%.2g relative)", diff, relative)
    quantized_inputs = any(layer.scheme.act is not None for layer in layers.values())
    if relative > (ACT_TOLERANCE if quantized_inputs else WEIGHT_ONLY_TOLERANCE):
        log.warning("ONNX Runtime's logits differ from the model's by %.3g (%.2g of the largest logit); the export "
                    "may not follow the model: report this model", diff, relative)


def export_onnx(model: nn.Module, tokenizer: object | None, out: str | Path, force: bool = False,
                external_data: bool | None = None, verify: bool = True) -> ExportResult:
    """Write a quantized model as an ONNX QDQ graph in the folder `out` (model.onnx [+ model.onnx.data], tokenizer
    files, config.json).

    Every quantized layer keeps its exact codes (int8; int4 for 4-bit; 2- and 3-bit codes widened to int8) with
    its scales and zero points, so `result.lossless` lists them all and `result.requantized` stays empty.
    `external_data` None puts the weights in model.onnx.data when they pass 1.5 GB. `verify` runs the file with
    ONNX Runtime on a few tokens and records the largest logit difference in the result's notes.
    """
    arch = arch_for(model)
    if arch.experts is not None:
        raise ConfigError(f"ONNX export does not cover the mixture of experts of {arch.family}: which experts run "
                          "depends on the tokens, and the traced graph would keep the routing of the trace's own "
                          "tokens; keep the llmeasyquant checkpoint (llmeasyquant.save) for this model")
    layers = layers_to_export(model, "ONNX")
    check_output(Path(out).expanduser(), force)  # before the slow trace; staged_folder checks again when writing
    for module in ("onnx", "onnx_ir", "onnxruntime"):
        require(module, INSTALL)
    watch = Stopwatch()
    codes = [_layer_codes(name, layer) for name, layer in layers.items()]
    log.info("exporting %d quantized layers to ONNX (opset %d)", len(codes), OPSET)
    onnx_model = _trace(_stand_in_model(model, layers))
    log.info("traced in %.1f s; rewriting weights as integer codes", watch.seconds())
    rewrite(onnx_model, codes)
    strip_debug_info(onnx_model)
    onnx_model.producer_name = "llmeasyquant"
    size = initializer_bytes(onnx_model)
    external = size > EXTERNAL_DATA_BYTES if external_data is None else external_data
    result = ExportResult(path=Path(out).expanduser(), format="onnx", seconds=0.0, lossless=[c.name for c in codes])
    with staged_folder(out, force) as folder:
        _save(onnx_model, folder, external)
        _write_extras(model, tokenizer, folder)
        if verify:
            _verify(model, layers, folder, result)
    if getattr(getattr(model, "llmeasyquant", None), "kv_cache", None) is not None:
        result.notes.append("the quantized KV cache is not exported: the graph runs without a cache (use_cache=False)")
    result.notes.append(f"weights in {DATA_FILE}" if external else f"weights inside {MODEL_FILE}")
    result.seconds = watch.seconds()
    log.info("wrote %s (%.1f MB of constants) in %.1f s", result.path, size / 1e6, result.seconds)
    return result


def _model_file(path: str | Path) -> Path:
    path = Path(path).expanduser()
    file = path / MODEL_FILE if path.is_dir() else path
    if not file.is_file():
        raise CheckpointError(f"no ONNX model at {file}; export one with: llmeasyquant export DIR --to onnx")
    return file


def open_onnx_runtime(path: str | Path, threads: int | None = None) -> RuntimeLogits:
    """An ONNX Runtime (CPU) session on an exported model: token ids [seqlen] -> logits [seqlen, vocab] float32.

    `path` is the export folder or its model.onnx; `threads` the intra-op threads (torch's thread count if None)."""
    ort = require("onnxruntime", INSTALL)
    file = _model_file(path)
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads or torch.get_num_threads()
    options.inter_op_num_threads = 1
    options.log_severity_level = 3  # errors only: the unoptimized graph draws harmless constant-folding warnings
    for key, value in ORT_CONFIG.items():
        options.add_session_config_entry(key, value)
    session = ort.InferenceSession(str(file), options, providers=["CPUExecutionProvider"])
    names = [i.name for i in session.get_inputs()]
    if names != ["input_ids"]:
        raise CheckpointError(f"{file} takes inputs {names}, not input_ids alone; it was not written by export_onnx")

    def logits(ids: torch.Tensor) -> torch.Tensor:
        if ids.dim() != 1:
            raise ConfigError(f"expected token ids of shape [seqlen], got {tuple(ids.shape)}")
        feed = {"input_ids": ids.detach().to(torch.int64).cpu().numpy()[None]}
        return torch.from_numpy(session.run(["logits"], feed)[0][0]).float()

    return logits
