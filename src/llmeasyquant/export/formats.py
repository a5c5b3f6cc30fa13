"""The export formats as data: how each is written and which runtime loads it back for the check."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from torch import nn

from llmeasyquant.errors import ConfigError
from llmeasyquant.export.common import ExportResult, RuntimeLogits


@dataclass(frozen=True)
class ExportFormat:
    name: str
    runtime: str  # what loads it back in the check
    write: Callable[..., ExportResult]  # (model, tokenizer, out, force) -> ExportResult
    open_runtime: Callable[[Path, int, int | None], RuntimeLogits]  # (path, seqlen, threads)


def _compressed() -> ExportFormat:
    from llmeasyquant.export.compressed import export_compressed_tensors, open_transformers_runtime

    return ExportFormat("compressed-tensors", "transformers + compressed-tensors", export_compressed_tensors,
                        lambda path, seqlen, threads: open_transformers_runtime(path, threads))


def _gguf() -> ExportFormat:
    from llmeasyquant.export.gguf import export_gguf, open_gguf_runtime

    return ExportFormat("gguf", "llama.cpp (llama-cpp-python)", export_gguf,
                        lambda path, seqlen, threads: open_gguf_runtime(path, n_ctx=seqlen, threads=threads))


def _onnx() -> ExportFormat:
    from llmeasyquant.export.onnx import export_onnx, open_onnx_runtime

    return ExportFormat("onnx", "ONNX Runtime (CPU)", export_onnx,
                        lambda path, seqlen, threads: open_onnx_runtime(path, threads))


FORMATS: dict[str, Callable[[], ExportFormat]] = {"compressed-tensors": _compressed, "gguf": _gguf, "onnx": _onnx}


def export_format(name: str) -> ExportFormat:
    if name not in FORMATS:
        raise ConfigError(f"unknown export format {name!r}; choose one of {', '.join(FORMATS)}")
    return FORMATS[name]()


def export(model: nn.Module | str | Path, to: str, out: str | Path, force: bool = False,
           tokenizer: object | None = None) -> ExportResult:
    """Export a quantized model, or the checkpoint folder at `model`, to `to` (compressed-tensors, gguf, onnx)."""
    fmt = export_format(to)
    if not isinstance(model, nn.Module):
        from llmeasyquant.export.checkpoint import load

        model, tokenizer = load(model)
    return fmt.write(model, tokenizer, out, force=force)
