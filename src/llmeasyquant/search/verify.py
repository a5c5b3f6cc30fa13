"""Check a searched plan: quantize with it, save the checkpoint, evaluate it against the float model, and put the
measured size and quality beside what the search predicted."""

from __future__ import annotations

import copy
import tempfile
from pathlib import Path

import torch
from torch import nn

from llmeasyquant.api import quantize
from llmeasyquant.export.checkpoint import WEIGHTS_FILE, bits_per_weight, checkpoint_bytes, save
from llmeasyquant.jobs.evaluate import evaluate
from llmeasyquant.methods import recipe_by_name
from llmeasyquant.search.mixed_precision import SearchResult


def verify_plan(result: SearchResult, model: nn.Module, tokenizer: object, calib: torch.Tensor | None,
                text: str | None = None, seqlen: int = 512, max_windows: int | None = 40, seed: int = 0,
                progress: bool = True) -> dict:
    """Fill and return `result.measured`; `model` (float) is left unchanged."""
    quantized = quantize(copy.deepcopy(model), recipe_by_name(result.search.method), result.plan, calib=calib,
                         progress=progress)
    with tempfile.TemporaryDirectory(prefix="llmeasyquant-verify-") as scratch:
        folder = save(quantized, Path(scratch) / "checkpoint", tokenizer)
        tensor_bytes, total_bytes = (folder / WEIGHTS_FILE).stat().st_size, checkpoint_bytes(folder)
    evaluation = evaluate(quantized, tokenizer, text, seqlen, max_windows, reference=model, seed=seed,
                          name="searched plan", progress=progress)
    metrics = evaluation.metrics
    bits = bits_per_weight(quantized)
    budget = result.budget
    within = bits <= budget.avg_bits if budget.avg_bits is not None else tensor_bytes <= budget.max_bytes
    result.measured = {
        "bits_per_weight": bits, "tensor_bytes": tensor_bytes, "checkpoint_bytes": total_bytes,
        "within_budget": bool(within), "ppl": metrics["ppl"], "ppl_reference": metrics["ppl_reference"],
        "kld": metrics["kld"], "top1": metrics["top1"], "quantize_s": quantized.llmeasyquant.quantize_s,
        "protocol": evaluation.protocol}
    return result.measured
